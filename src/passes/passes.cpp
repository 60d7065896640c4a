#include "passes/passes.hpp"

#include <cstdlib>
#include <string_view>

#include "kg/error.hpp"
#include "passes/dead_nodes.hpp"

namespace kg::passes {

Rewriter::Rewriter(const Graph& old) : old_(old), graph_(Graph::create()), map_(old.nodes().size(), -1) {
  for (int id : old.inputs()) {
    const Node& n = old.node(id);
    map_[static_cast<std::size_t>(id)] = graph_->input(n.dtype, n.shape, n.name).node();
  }
}

int Rewriter::copy(int id) {
  int fresh = add(old_.node(id), old_.node(id).inputs);
  map(id, fresh);
  return fresh;
}

int Rewriter::add(Node node, const std::vector<int>& old_inputs) {
  node.inputs.clear();
  for (int in : old_inputs) {
    int m = mapped(in);
    if (m < 0) throw Error(node.label() + " pass: an input was not copied before its consumer");
    node.inputs.push_back(m);
  }
  return graph_->add_node(std::move(node));
}

GraphAndOutputs Rewriter::finish(const std::vector<int>& old_outputs) {
  GraphAndOutputs r{graph_, {}};
  for (int o : old_outputs) {
    int m = mapped(o);
    if (m < 0) throw Error("pass: a model output was dropped");
    r.outputs.push_back(m);
  }
  return r;
}

std::vector<int> use_counts(const Graph& graph, const std::vector<int>& outputs) {
  std::vector<int> uses(graph.nodes().size(), 0);
  for (const auto& n : graph.nodes())
    for (int in : n.inputs) ++uses[static_cast<std::size_t>(in)];
  for (int o : outputs) ++uses[static_cast<std::size_t>(o)];
  return uses;
}

GraphAndOutputs without_dead_nodes(std::shared_ptr<Graph> graph, std::vector<int> outputs) {
  const std::vector<int> live = live_nodes(*graph, outputs);
  if (live.size() == graph->nodes().size()) return {std::move(graph), std::move(outputs)};
  Rewriter rw(*graph);
  for (int id : live)
    if (graph->node(id).kind == Node::Kind::Op) rw.copy(id);
  return rw.finish(outputs);
}

namespace {

// False when the environment variable `name` is set to anything but "" or "0".
bool not_turned_off(const char* name) {
  const char* v = std::getenv(name);
  return !(v && *v && std::string_view(v) != "0");
}

}  // namespace

bool fusion_enabled_by_env() { return not_turned_off("KG_NO_FUSION"); }

GraphAndOutputs optimize(std::shared_ptr<Graph> graph, std::vector<int> outputs, LoweringMode mode,
                         const ModelOptions& options) {
  GraphAndOutputs g{std::move(graph), std::move(outputs)};
  g = split_nodes(*g.graph, g.outputs);
  if (!options.fusion || !fusion_enabled_by_env()) return g;
  // The fusion passes count a value's readers: a node no output needs must not count.
  g = without_dead_nodes(std::move(g.graph), std::move(g.outputs));
  if (mode == LoweringMode::Inference && options.attention && not_turned_off("KG_NO_ATTENTION_FUSION"))
    g = fuse_attention(*g.graph, g.outputs, mode);
  if (mode == LoweringMode::Inference) g = fuse_conv_epilogue(*g.graph, g.outputs);
  g = fuse_elementwise(*g.graph, g.outputs, mode);
  if (mode == LoweringMode::Inference) {
    g = fuse_gemm_epilogue(*g.graph, g.outputs, mode);
    g = fuse_prologue(*g.graph, g.outputs, mode);
  }
  return g;
}

}  // namespace kg::passes
