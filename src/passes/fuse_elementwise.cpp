// Elementwise fusion: maximal groups of nodes whose ops declare a per-element form
// (CustomOp::elementwise_form) become one kg.fused_elementwise node each. The pass reads only what
// the ops declare; built-in activations and arithmetic are found the same way as a user's op.
//
// A node is fusable when its op gives a form for its input dtypes, it owns no parameters, its
// inputs and output share one dtype (f32 or f64) and its output shape is the broadcast of its
// inputs' shapes. In training it also needs the form's derivative, and every input must have the
// output's shape (a broadcast input's gradient is a reduction, which the fused backward does not
// do): such nodes stay their own kernels.
//
// Groups grow from their root (the last node, whose value leaves the group) towards the inputs:
// a fusable producer joins when every consumer of its value is in the group and it is not a model
// output, so that no member's value is needed outside. A group reads at most KG_FUSE_MAX_INPUTS
// values from outside; a lone node stays as it is. The fused node takes the root's name and its
// place in the graph (every input of the group is computed before the root).
#include <algorithm>
#include <map>

#include "kg/error.hpp"
#include "ops/fused_elementwise.hpp"
#include "ops/op_util.hpp"
#include "passes/passes.hpp"

namespace kg::passes {
namespace {

bool same_shape(const Shape& a, const Shape& b) { return a == b; }

}  // namespace

std::optional<ElementwiseForm> fusable_form(const Graph& g, const Node& n, LoweringMode mode) {
  if (n.kind != Node::Kind::Op || !n.params.empty() || n.inputs.empty()) return std::nullopt;
  if (n.dtype != DType::F32 && n.dtype != DType::F64) return std::nullopt;
  std::vector<DType> dtypes;
  for (int in : n.inputs) {
    const Node& src = g.node(in);
    if (src.dtype != n.dtype) return std::nullopt;
    dtypes.push_back(src.dtype);
  }
  std::optional<ElementwiseForm> form;
  try {
    form = n.op->op().elementwise_form(dtypes);
  } catch (const std::exception& e) {
    throw Error(n.label() + " elementwise_form: " + e.what());
  }
  if (!form || form->function.empty() || !form->cpu) return std::nullopt;
  if (mode == LoweringMode::Training) {
    if (form->derivative.empty() || !form->cpu_derivative) return std::nullopt;
    for (int in : n.inputs)
      if (!same_shape(g.node(in).shape, n.shape)) return std::nullopt;
  }
  // The output must be the broadcast of the inputs.
  Shape b = g.node(n.inputs[0]).shape;
  try {
    for (std::size_t k = 1; k < n.inputs.size(); ++k) b = ops::broadcast_shapes(b, g.node(n.inputs[k]).shape);
  } catch (const Error&) {
    return std::nullopt;
  }
  if (!same_shape(b, n.shape)) return std::nullopt;
  return form;
}

namespace {

struct Group {
  std::vector<int> members;  // node ids, topological order, root last
  std::vector<int> inputs;   // node ids read from outside, in order of first use
};

}  // namespace

GraphAndOutputs fuse_elementwise(const Graph& graph, const std::vector<int>& outputs, LoweringMode mode) {
  const auto& nodes = graph.nodes();
  const std::size_t count = nodes.size();
  std::vector<std::vector<int>> consumers(count);
  for (const auto& n : nodes)
    for (int in : n.inputs) {
      auto& c = consumers[static_cast<std::size_t>(in)];
      if (std::find(c.begin(), c.end(), n.id) == c.end()) c.push_back(n.id);
    }
  std::vector<char> is_output(count, 0);
  for (int o : outputs) is_output[static_cast<std::size_t>(o)] = 1;
  std::vector<std::optional<ElementwiseForm>> forms(count);
  for (const auto& n : nodes) forms[static_cast<std::size_t>(n.id)] = fusable_form(graph, n, mode);

  std::vector<int> group_of(count, -1);
  std::vector<Group> groups;
  for (std::size_t r = count; r-- > 0;) {
    if (!forms[r] || group_of[r] >= 0) continue;
    const int gi = static_cast<int>(groups.size());
    std::vector<int> members{static_cast<int>(r)};
    group_of[r] = gi;
    // External values of the group as it stands.
    auto externals = [&]() {
      std::vector<int> ext;
      for (int m : members)
        for (int in : graph.node(m).inputs)
          if (group_of[static_cast<std::size_t>(in)] != gi &&
              std::find(ext.begin(), ext.end(), in) == ext.end())
            ext.push_back(in);
      return ext;
    };
    for (bool grew = true; grew;) {
      grew = false;
      for (int p : externals()) {
        const auto up = static_cast<std::size_t>(p);
        if (!forms[up] || group_of[up] >= 0 || is_output[up]) continue;
        const auto& cs = consumers[up];
        if (!std::all_of(cs.begin(), cs.end(),
                         [&](int c) { return group_of[static_cast<std::size_t>(c)] == gi; }))
          continue;
        group_of[up] = gi;
        members.push_back(p);
        if (externals().size() > KG_FUSE_MAX_INPUTS) {
          group_of[up] = -1;
          members.pop_back();
          continue;
        }
        grew = true;
      }
    }
    if (members.size() < 2) {
      group_of[r] = -1;
      continue;
    }
    std::sort(members.begin(), members.end());
    Group g;
    g.members = members;
    for (int m : members)
      for (int in : graph.node(m).inputs)
        if (group_of[static_cast<std::size_t>(in)] != gi &&
            std::find(g.inputs.begin(), g.inputs.end(), in) == g.inputs.end())
          g.inputs.push_back(in);
    groups.push_back(std::move(g));
  }
  Rewriter rw(graph);
  for (const auto& n : nodes) {
    if (n.kind != Node::Kind::Op) continue;
    const int gi = group_of[static_cast<std::size_t>(n.id)];
    if (gi < 0) {
      rw.copy(n.id);
      continue;
    }
    const Group& g = groups[static_cast<std::size_t>(gi)];
    if (g.members.back() != n.id) continue;  // members are emitted with their root
    std::map<int, int> index;                // node id -> member index
    std::vector<ops::FusedMember> members;
    for (int m : g.members) {
      const Node& mn = graph.node(m);
      ops::FusedMember f{mn.name, *mn.op, *forms[static_cast<std::size_t>(m)], {}};
      for (int in : mn.inputs) {
        auto it = index.find(in);
        if (it != index.end()) {
          f.args.push_back(it->second);
        } else {
          const auto pos = std::find(g.inputs.begin(), g.inputs.end(), in) - g.inputs.begin();
          f.args.push_back(-1 - static_cast<int>(pos));
        }
      }
      index[m] = static_cast<int>(members.size());
      members.push_back(std::move(f));
    }
    Node fused;
    fused.kind = Node::Kind::Op;
    fused.name = n.name;
    fused.dtype = n.dtype;
    fused.shape = n.shape;
    fused.op = CustomData::make<ops::FusedElementwiseOp>(std::move(members),
                                                         static_cast<int>(g.inputs.size()), n.dtype, mode);
    rw.map(n.id, rw.add(std::move(fused), g.inputs));
  }
  return rw.finish(outputs);
}

}  // namespace kg::passes
