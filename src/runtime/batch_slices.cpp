#include "runtime/batch_slices.hpp"

#include <cstdlib>
#include <set>
#include <string>

#include "kg/error.hpp"
#include "ops/fused_gemm.hpp"
#include "ops/shape_ops.hpp"

namespace kg::runtime {

namespace {

// Ops that compute each sample from that sample alone whatever their attributes.
const std::set<std::string>& per_sample_ops() {
  static const std::set<std::string> ops = {
      "nn.conv2d",          "nn.fused_conv2d",           "nn.conv2d_nhwc",     "nn.max_pool2d",
      "nn.max_pool2d_nhwc", "nn.avg_pool2d",             "nn.avg_pool2d_nhwc", "nn.global_avg_pool",
      "nn.global_avg_pool_nhwc", "nn.linear",            "nn.flatten",         "nn.view",
      "nn.reshape",         "nn.batch_norm2d",           "nn.dropout",         "kg.fused_elementwise",
  };
  return ops;
}

}  // namespace

bool per_sample(const Graph& graph, const std::vector<int>& live, const plan::BoundShapes& bound,
                std::int64_t batch) {
  if (batch < 2) return false;
  for (int id : live) {
    const auto& shape = bound.node_shapes.at(static_cast<std::size_t>(id));
    // Every value carries the batch first; a reshape folding it into another dim, a reduction
    // over it or a concatenation along it changes that.
    if (shape.empty() || shape[0] != batch) return false;
    const Node& n = graph.node(id);
    if (n.kind != Node::Kind::Op) continue;
    const CustomOp& op = n.op->op();
    const std::string name = op.name();
    if (name == "nn.permute") {
      if (!ops::permute_keeps_dim0(op, shape.size())) return false;
      continue;
    }
    if (per_sample_ops().count(name)) continue;
    // A GEMM with a folded epilogue: as its GEMM (a linear layer, not a matmul across samples);
    // its other inputs carry the batch first like every value here.
    if (const auto* f = n.op->as<ops::FusedGemmOp>()) {
      if (per_sample_ops().count(f->gemm().name())) continue;
      return false;
    }
    std::vector<DType> dtypes;
    for (int in : n.inputs) dtypes.push_back(graph.node(in).dtype);
    if (!n.inputs.empty() && op.elementwise_form(dtypes)) continue;
    return false;
  }
  return true;
}

std::int64_t forced_slice() {
  const char* e = std::getenv("KG_BATCH_SLICE");
  if (!e || !*e) return 0;
  char* end = nullptr;
  const long long v = std::strtoll(e, &end, 10);
  if (*end != '\0' || v <= 0)
    throw Error(std::string("KG_BATCH_SLICE='") + e + "' is not a positive number of samples per slice");
  return v;
}

std::vector<std::int64_t> slice_candidates(std::int64_t batch) {
  std::vector<std::int64_t> out;
  for (std::int64_t s : {1, 2, 4, 8})
    if (s < batch && batch % s == 0) out.push_back(s);
  return out;
}

}  // namespace kg::runtime
