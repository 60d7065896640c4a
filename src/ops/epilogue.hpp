// A GEMM that can apply an epilogue as it stores its output: the contract between the GEMM ops
// (nn.linear, nn.matmul) and kg.fused_gemm (ops/fused_gemm), which folds the elementwise group that
// reads the GEMM's output into the GEMM's store (passes/fuse_gemm).
#pragma once

#include <optional>
#include <string>

#include "kg/custom_op.hpp"

namespace kg::ops {

// The generated pieces a GEMM's epilogue kernel is made of.
struct EpilogueCode {
  std::string head;      // first in the module: includes, the typedefs kg_t and kg_s, KG_FUSED_MODULE
  std::string source;    // after the GEMM's device code: the members and the epilogue struct
  std::string params;    // after the unfused entry's parameters: ", const kg_s* p1, ..., KgFusedWalk pw"
  std::string epilogue;  // an expression building the functor from them ("KgEpilogue{p1, ...}")
  std::string entry;     // the entry's name
};

class EpilogueGemm {
 public:
  virtual ~EpilogueGemm() = default;
  // True when this op takes an epilogue for an output of `dtype`.
  virtual bool takes_epilogue(DType dtype) const = 0;
  // The node's kernel as lower(ctx) gives it, but with each output element stored as
  // epi(value, i), where value is what the unfused kernel stores (in the compute type kg_t) and i
  // the element's index in the output: the module is code.head, the op's device code without its
  // entries (KG_FUSED_MODULE), code.source, then one entry code.entry whose parameters are those of
  // the unfused entry followed by code.params. The RuntimeOp is the unfused one: kg.fused_gemm
  // appends the epilogue's arguments to each of its launches.
  virtual std::optional<Lowered> lower_with_epilogue(const LowerContext& ctx, const EpilogueCode& code) const = 0;
};

}  // namespace kg::ops
