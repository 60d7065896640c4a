// Epilogue folding (inference): the elementwise group that is the only reader of a GEMM's value
// (nn.linear, nn.matmul) becomes that GEMM's epilogue. The two become one kg.fused_gemm node with
// the GEMM's name and parameters (so weights load by their recorded names) and the group's value,
// whose kernel applies the group to each output element as the GEMM stores it, so the GEMM's own
// output is never written to memory.
//
// A GEMM is folded when its value is read by one node only, is not a model output, and that node
// is an elementwise group with one output (a kg.fused_elementwise node, or a lone fusable node such
// as a user's activation) whose value has the GEMM output's shape and dtype, and the GEMM takes an
// epilogue of that dtype. The group's other inputs (a residual, a broadcast scale) become the fused
// node's inputs after the GEMM's. The fused node is placed where the group was: its other inputs
// may be computed after the GEMM, and nothing between them reads the GEMM's value. In training
// nothing is folded (the GEMMs' backward kernels know no epilogue).
#include <algorithm>

#include "kg/error.hpp"
#include "ops/epilogue.hpp"
#include "ops/fused_gemm.hpp"
#include "passes/passes.hpp"

namespace kg::passes {
namespace {

struct Fold {
  int gemm = -1;
  ElementwiseGroup group;
  int given = -1;  // the group input that is the GEMM's value
};

}  // namespace

GraphAndOutputs fuse_gemm_epilogue(const Graph& graph, const std::vector<int>& outputs, LoweringMode mode) {
  const auto& nodes = graph.nodes();
  const std::vector<int> uses = use_counts(graph, outputs);
  std::vector<char> is_output(nodes.size(), 0);
  for (int o : outputs) is_output[static_cast<std::size_t>(o)] = 1;
  std::vector<int> consumer(nodes.size(), -1);
  for (const auto& n : nodes)
    for (int in : n.inputs) consumer[static_cast<std::size_t>(in)] = n.id;
  // folds[e] = the fold whose group is node e; folded[g] = true for a GEMM folded into its reader.
  std::vector<std::optional<Fold>> folds(nodes.size());
  std::vector<char> folded(nodes.size(), 0);
  if (mode == LoweringMode::Inference) {
    for (const auto& n : nodes) {
      if (n.kind != Node::Kind::Op) continue;
      const auto* gemm = dynamic_cast<const ops::EpilogueGemm*>(&n.op->op());
      if (!gemm) continue;
      const auto u = static_cast<std::size_t>(n.id);
      if (uses[u] != 1 || is_output[u] || consumer[u] < 0) continue;
      if (!gemm->takes_epilogue(n.dtype)) continue;
      const Node& e = graph.node(consumer[u]);
      const auto ue = static_cast<std::size_t>(e.id);
      if (folds[ue] || e.dtype != n.dtype || e.shape != n.shape) continue;
      // A node reading the GEMM's value twice (x * x) counts it as one use of two: not single.
      if (std::count(e.inputs.begin(), e.inputs.end(), n.id) != 1) continue;
      std::optional<ElementwiseGroup> group = elementwise_group(graph, e);
      if (!group) continue;
      const auto at = std::find(group->old_inputs.begin(), group->old_inputs.end(), n.id);
      if (at == group->old_inputs.end()) continue;
      if (static_cast<int>(n.inputs.size() + group->old_inputs.size() - 1) > KG_FUSE_MAX_INPUTS) continue;
      Fold f;
      f.gemm = n.id;
      f.given = static_cast<int>(at - group->old_inputs.begin());
      f.group = std::move(*group);
      folds[ue] = std::move(f);
      folded[u] = 1;
    }
  }
  Rewriter rw(graph);
  for (const auto& n : nodes) {
    if (n.kind != Node::Kind::Op) continue;
    const auto u = static_cast<std::size_t>(n.id);
    if (folded[u]) continue;  // emitted with its epilogue
    if (!folds[u]) {
      rw.copy(n.id);
      continue;
    }
    Fold& f = *folds[u];
    const Node& gemm = graph.node(f.gemm);
    Node fused;
    fused.kind = Node::Kind::Op;
    fused.name = gemm.name;
    fused.dtype = n.dtype;
    fused.shape = n.shape;
    fused.params = gemm.params;
    std::vector<int> ins = gemm.inputs;
    for (int j = 0; j < f.group.inputs; ++j)
      if (j != f.given) ins.push_back(f.group.old_inputs[static_cast<std::size_t>(j)]);
    try {
      fused.op = CustomData::make<ops::FusedGemmOp>(*gemm.op, static_cast<int>(gemm.inputs.size()),
                                                    std::move(f.group.members), f.group.inputs, f.given, n.dtype);
    } catch (const Error& e) {
      throw Error(gemm.label() + " epilogue: " + e.what());
    }
    rw.map(n.id, rw.add(std::move(fused), ins));
  }
  return rw.finish(outputs);
}

}  // namespace kg::passes
