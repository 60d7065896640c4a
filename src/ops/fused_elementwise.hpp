// kg.fused_elementwise: a group of elementwise nodes that the fusion pass (passes/fuse_elementwise)
// merged into one node. It runs the members' per-element forms (CustomOp::elementwise_form) in one
// pass over memory: on a GPU one generated kernel (and one for the backward), on the CPU chunks
// small enough to stay in cache, every member applied to a chunk before the next is read.
//
// The group has one output (its root member's value) and up to KG_FUSE_MAX_INPUTS inputs (the
// values its members read from outside the group), broadcast to the output as numpy does. In
// training every input has the output's shape (the pass keeps broadcasting nodes out of
// training groups) and the backward recomputes the members' values from the saved inputs, so the
// group saves no more than its inputs.
#pragma once

#include <string>
#include <vector>

#include "kg/custom_op.hpp"
#include "ops/fused_elementwise.cuh"

namespace kg::ops {

// One member of a group, in an order where every member comes after the members it reads.
struct FusedMember {
  std::string node;  // the node's name in the recorded graph
  CustomData op;
  ElementwiseForm form;
  // What each of the op's inputs is: k >= 0 the value of member k, k < 0 group input -1 - k.
  std::vector<int> args;
};

class FusedElementwiseOp final : public CustomOp {
 public:
  // `members` end with the root, whose value is the output; `inputs` is the number of group
  // inputs; `dtype` is the group's tensors' (f32 or f64, whose members compute in it, or f16 or
  // bf16 in inference, whose members compute in f32: their forms are the f32 ones). Checks the
  // description (kg::Error).
  FusedElementwiseOp(std::vector<FusedMember> members, int inputs, DType dtype, LoweringMode mode);

  std::string name() const override { return "kg.fused_elementwise"; }
  // "nodes=a,b,c kernel=kg_fused_..." (the entry of the forward kernel).
  std::string attributes() const override;
  // Each member's output shape from its inputs' (the ops' own shape inference), in order.
  Shape infer_output_shape(const std::vector<Shape>& input_shapes) const override;
  DType infer_output_dtype(const std::vector<DType>& input_dtypes) const override;

  std::optional<Lowered> lower(const LowerContext& ctx) const override;
  std::string lower_backward_source(const LowerContext& ctx) const override;

  void cpu_forward(CpuContext& ctx) const override;
  bool has_cpu_backward() const override { return mode_ == LoweringMode::Training; }
  void cpu_backward(CpuBackwardContext& ctx) const override;
  BackwardSaves backward_saves() const override { return {.inputs = true, .output = false}; }

  const std::vector<FusedMember>& members() const { return members_; }
  DType dtype() const { return dtype_; }
  LoweringMode mode() const { return mode_; }
  int inputs() const { return inputs_; }
  // The forward kernel's entry point (a hash of the group's description).
  const std::string& entry() const { return entry_; }

 private:
  // The forward on tensors of `dtype` (the group's, or f32 for a 16-bit group's widened copies).
  void forward(CpuContext& ctx, DType dtype) const;

  std::vector<FusedMember> members_;
  int inputs_;
  DType dtype_;
  LoweringMode mode_;
  std::string entry_;
};

}  // namespace kg::ops
