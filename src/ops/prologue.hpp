// A reduction that can read its data input through a prologue: the contract between the reduction
// ops (softmax, layer_norm, reduce.<fn>) and kg.fused_reduction (ops/fused_reduction), which folds a
// group of elementwise members into the reduction's load (passes/fuse_prologue).
#pragma once

#include <optional>
#include <string>

#include "kg/custom_op.hpp"
#include "ops/gpu_util.hpp"

namespace kg::ops {

// The generated pieces a reduction's prologue kernel is made of.
struct PrologueCode {
  std::string head;    // first in the module: includes and the typedefs kg_t and kg_s
  std::string source;  // after the reduction's device code: the members and the loader struct
  std::string params;  // in place of the data pointer: "const kg_s* p0, ..., KgFusedWalk pw"
  std::string loader;  // an expression building the loader from them ("KgPrologue{p0, ...}")
  std::string entry;   // the entry's name
};

class PrologueReduction {
 public:
  virtual ~PrologueReduction() = default;
  // True when this op takes a prologue for a data input of `dtype` (f32 or f64).
  virtual bool takes_prologue(DType dtype) const = 0;
  // The node's kernel as lower(ctx) gives it, but with its data input (input 0) read as
  // loader(k): the module is code.head, the op's device code, code.source, then one entry
  // code.entry whose parameters are code.params followed by those of the unfused entry after its
  // data pointer. The RuntimeOp is the unfused one: the data pointer is argument 0 of each of its
  // launches, and kg.fused_reduction puts the prologue's arguments in its place.
  virtual std::optional<Lowered> lower_with_prologue(const LowerContext& ctx, const PrologueCode& code) const = 0;
};

}  // namespace kg::ops
