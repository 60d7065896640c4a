// Splitting nodes: an op may describe itself as several nodes (CustomOp::split), recorded with the
// public API into the graph being built, for instance a convolution with a bias as the
// convolution and a separately named bias node. The pass checks what the split recorded: the
// node's output shape and dtype, and every parameter the node declared, once, under its full
// name with its shape and dtype (so weights load by the names the recorded graph shows); each
// keeps the node's declared initialisation and trainable flag.
#include <map>

#include "kg/error.hpp"
#include "passes/passes.hpp"
#include "util/str.hpp"

namespace kg::passes {

GraphAndOutputs split_nodes(const Graph& graph, const std::vector<int>& outputs) {
  Rewriter rw(graph);
  Graph& g = *rw.graph();
  for (const auto& n : graph.nodes()) {
    if (n.kind != Node::Kind::Op) continue;
    std::vector<SymTensor> inputs;
    for (int in : n.inputs) inputs.emplace_back(rw.graph(), rw.mapped(in));
    const auto first_new = static_cast<int>(g.nodes().size());
    SymTensor out;
    try {
      out = n.op->op().split(inputs, n.name);
    } catch (const Error& e) {
      throw Error(n.label() + " split: " + e.what());
    }
    if (!out.valid()) {
      if (static_cast<int>(g.nodes().size()) != first_new)
        throw Error(n.label() + " split: recorded nodes but returned no output");
      rw.copy(n.id);
      continue;
    }
    if (out.graph_ptr() != rw.graph() || out.node() < first_new)
      throw Error(n.label() + " split: the returned value is not one of the nodes the split recorded");
    const Node& last = g.node(out.node());
    if (!(last.shape == n.shape) || last.dtype != n.dtype)
      throw Error(util::cat(n.label(), " split: the split's output is ", last.shape.to_string(), " ",
                            dtype_name(last.dtype), " but the node's is ", n.shape.to_string(), " ",
                            dtype_name(n.dtype)));
    // Every declared parameter exactly once, as declared; nothing else.
    std::map<std::string, std::pair<int, std::size_t>> found;  // name -> (node, index)
    for (int id = first_new; id < static_cast<int>(g.nodes().size()); ++id) {
      const Node& m = g.node(id);
      for (std::size_t k = 0; k < m.params.size(); ++k)
        found.emplace(m.params[k].name, std::make_pair(id, k));
    }
    std::vector<std::string> split_names;
    for (const auto& [name, at] : found) split_names.push_back(name);
    const std::string listed = split_names.empty() ? std::string("none") : util::join(split_names, ", ");
    for (const ParamSpec& p : n.params) {
      auto it = found.find(p.name);
      if (it == found.end())
        throw Error(util::cat(n.label(), " split: parameter '", p.name,
                              "' is in no node of the split (it has: ", listed,
                              "); give it its full name with Graph::bind_param"));
      const auto [id, k] = it->second;
      const ParamSpec& q = g.node(id).params[k];
      if (q.shape != p.shape || q.dtype != p.dtype)
        throw Error(util::cat(n.label(), " split: parameter '", p.name, "' is ", sizes_to_string(q.shape),
                              " ", dtype_name(q.dtype), " in the split but declared ",
                              sizes_to_string(p.shape), " ", dtype_name(p.dtype)));
      g.bind_param(id, k, p.name, p.init, p.trainable);
      found.erase(it);
    }
    if (!found.empty())
      throw Error(util::cat(n.label(), " split: parameter '", found.begin()->first,
                            "' is not one the node declared (a split keeps the node's parameters)"));
    rw.map(n.id, out.node());
  }
  return rw.finish(outputs);
}

}  // namespace kg::passes
