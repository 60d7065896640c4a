// Prologue folding (inference): an elementwise group (a kg.fused_elementwise node, or a lone node
// with an elementwise form) whose value only a reduction reads becomes that reduction's prologue.
// The reduction (an op that takes a prologue, ops/prologue.hpp: nn.softmax, nn.log_softmax,
// nn.layer_norm, reduce.<fn>) and the group become one kg.fused_reduction node with the group's
// inputs and the reduction's name and parameters, whose kernel computes each element it reads
// instead of reading the group's value from memory.
//
// A group is folded when it is the reduction's only input, no other node reads its value, it is
// not a model output, and the reduction takes a prologue of its dtype (f32 or f64). In training
// nothing is folded: the reductions' backward reads their input (layer norm) or output, and the
// group's backward needs the reduction's input gradient, so both keep their own kernels.
#include <algorithm>

#include "kg/error.hpp"
#include "ops/fused_elementwise.hpp"
#include "ops/fused_reduction.hpp"
#include "ops/prologue.hpp"
#include "passes/passes.hpp"

namespace kg::passes {
GraphAndOutputs fuse_prologue(const Graph& graph, const std::vector<int>& outputs, LoweringMode mode) {
  const auto& nodes = graph.nodes();
  const std::vector<int> uses = use_counts(graph, outputs);
  std::vector<char> is_output(nodes.size(), 0);
  for (int o : outputs) is_output[static_cast<std::size_t>(o)] = 1;
  // folded_into[p] = the reduction node that takes node p as its prologue.
  std::vector<int> folded_into(nodes.size(), -1);
  std::vector<std::optional<ElementwiseGroup>> prologues(nodes.size());
  if (mode == LoweringMode::Inference) {
    for (const auto& r : nodes) {
      if (r.kind != Node::Kind::Op || r.inputs.size() != 1) continue;
      const auto* reducer = dynamic_cast<const ops::PrologueReduction*>(&r.op->op());
      if (!reducer) continue;
      const int p = r.inputs[0];
      const Node& pn = graph.node(p);
      const auto up = static_cast<std::size_t>(p);
      if (uses[up] != 1 || is_output[up] || folded_into[up] >= 0) continue;
      if (pn.dtype != DType::F32 && pn.dtype != DType::F64) continue;
      if (!reducer->takes_prologue(pn.dtype)) continue;
      std::optional<ElementwiseGroup> pro = elementwise_group(graph, pn);
      if (!pro) continue;
      folded_into[up] = r.id;
      prologues[static_cast<std::size_t>(r.id)] = std::move(pro);
    }
  }
  Rewriter rw(graph);
  for (const auto& n : nodes) {
    if (n.kind != Node::Kind::Op) continue;
    const auto u = static_cast<std::size_t>(n.id);
    if (folded_into[u] >= 0) continue;  // emitted with its reduction
    if (!prologues[u]) {
      rw.copy(n.id);
      continue;
    }
    ElementwiseGroup& pro = *prologues[u];
    Node fused;
    fused.kind = Node::Kind::Op;
    fused.name = n.name;
    fused.dtype = n.dtype;
    fused.shape = n.shape;
    fused.params = n.params;
    try {
      fused.op = CustomData::make<ops::FusedReductionOp>(std::move(pro.members), pro.inputs, *n.op,
                                                         graph.node(n.inputs[0]).dtype);
    } catch (const Error& e) {
      throw Error(n.label() + " prologue: " + e.what());
    }
    rw.map(n.id, rw.add(std::move(fused), pro.old_inputs));
  }
  return rw.finish(outputs);
}

}  // namespace kg::passes
