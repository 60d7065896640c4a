// kg.fused_reduction: a reduction (softmax, log-softmax, layer norm, reduce.<fn>) whose data input
// is computed by a prologue, a group of elementwise members that the prologue pass
// (passes/fuse_prologue) folded into it. The group's value is never written: on a GPU the
// reduction's kernel computes each element it reads from the prologue's inputs (broadcast as numpy
// does), so `softmax(x * scale + mask)` is one kernel that reads x and mask once. On the CPU the
// prologue runs chunk-wise (as kg.fused_elementwise) into a scratch buffer that the reduction's own
// CPU form then reads.
//
// The node's inputs are the prologue's (at most KG_FUSE_MAX_INPUTS), its parameters the
// reduction's (a layer norm's weight and bias), its output the reduction's. Inference only, in f32
// or f64: the precision pass keeps it in f32 with casts around it in a 16-bit model.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kg/custom_op.hpp"
#include "ops/fused_elementwise.hpp"

namespace kg::ops {

class PrologueReduction;

class FusedReductionOp final : public CustomOp {
 public:
  // `members` (ending with the root, whose value is the reduction's data input) read `inputs`
  // group inputs, as for kg.fused_elementwise; `reduction` is the reduction's op, which must take a
  // prologue (ops/prologue.hpp) for `dtype` (f32 or f64). Checks the description (kg::Error).
  FusedReductionOp(std::vector<FusedMember> members, int inputs, CustomData reduction, DType dtype);

  std::string name() const override { return "kg.fused_reduction"; }
  // "<reduction op> <its attributes> prologue=a,b,c kernel=kg_prologue_...".
  std::string attributes() const override;
  // The prologue's value's shape, then the reduction's from it.
  Shape infer_output_shape(const std::vector<Shape>& input_shapes) const override;
  DType infer_output_dtype(const std::vector<DType>& input_dtypes) const override;
  // The reduction's, for the prologue's value.
  std::vector<ParamSpec> parameters(const std::vector<Shape>& input_shapes) const override;

  // The reduction's kernel with its data input read through the prologue (one entry).
  std::optional<Lowered> lower(const LowerContext& ctx) const override;
  // The prologue into scratch, then the reduction's cpu_forward on it.
  void cpu_forward(CpuContext& ctx) const override;

  const std::vector<FusedMember>& members() const { return prologue_->members(); }
  int inputs() const { return prologue_->inputs(); }
  const CustomData& reduction() const { return reduction_; }
  DType dtype() const { return dtype_; }
  // The forward kernel's entry point (a hash of the prologue and the reduction).
  const std::string& entry() const { return entry_; }

 private:
  std::shared_ptr<const FusedElementwiseOp> prologue_;  // the members as a group (its CPU form)
  CustomData reduction_;
  const PrologueReduction* reducer_;
  DType dtype_;
  std::string entry_;
};

}  // namespace kg::ops
