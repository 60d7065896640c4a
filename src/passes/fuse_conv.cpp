// Placeholder until the fused convolution exists: copies the graph unchanged.
#include "passes/passes.hpp"

namespace kg::passes {

GraphAndOutputs fuse_conv_epilogue(const Graph& graph, const std::vector<int>& outputs) {
  Rewriter rw(graph);
  for (const auto& n : graph.nodes())
    if (n.kind == Node::Kind::Op) rw.copy(n.id);
  return rw.finish(outputs);
}

}  // namespace kg::passes
