// kg.fused_elementwise: a group of elementwise nodes that the fusion pass (passes/fuse_elementwise)
// merged into one node. It runs the members' per-element forms (CustomOp::elementwise_form) in one
// pass over memory: on a GPU one generated kernel (and one for the backward), on the CPU chunks
// small enough to stay in cache, every member applied to a chunk before the next is read.
//
// The group reads up to KG_FUSE_MAX_INPUTS inputs (the values its members read from outside the
// group), broadcast to its values as numpy does, and writes up to KG_FUSE_MAX_OUTPUTS of its
// members' values (its root's, and any other needed outside it). With one output the node's value
// is that output; with k > 1, all of one shape, it is a packed tensor [k, <shape>] and each output
// is read through a kg.group_output view of its part (no copy). In training the backward takes
// one incoming gradient per output (packed like the outputs) and recomputes the members' values
// from the saved inputs, so the group saves no more than its inputs. An input read at the same
// index gets its gradient written element by element; a broadcast one (a scalar, or one walked)
// gets the sum of its contributions over the elements that read it: on the GPU the backward
// kernel writes them to scratch shaped like one output and nn.add's reduction sums them onto the
// input's shape, on the CPU sum_to_shape does.
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
  // `members` end with the root; `inputs` is the number of group inputs; `dtype` is the group's
  // tensors' (f32 or f64, whose members compute in it, or f16 or bf16 in inference, whose members
  // compute in f32: their forms are the f32 ones). `outputs` lists the members whose values the
  // group writes, in the packed order; it holds the root; empty means the root alone. Checks the
  // description (kg::Error).
  FusedElementwiseOp(std::vector<FusedMember> members, int inputs, DType dtype, LoweringMode mode,
                     std::vector<int> outputs = {});

  std::string name() const override { return "kg.fused_elementwise"; }
  // "nodes=a,b,c kernel=kg_fused_..." (the entry of the forward kernel); with several outputs
  // "nodes=a,b,c outputs=a,c kernel=...".
  std::string attributes() const override;
  // Each member's output shape from its inputs' (the ops' own shape inference), in order: the
  // output's, or [k, <shape>] for k outputs (which must share one shape).
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
  // The members whose values are written, in the packed order (the root among them).
  const std::vector<int>& outputs() const { return outputs_; }
  // The forward kernel's entry point (a hash of the group's description).
  const std::string& entry() const { return entry_; }

 private:
  // The forward on tensors of `dtype` (the group's, or f32 for a 16-bit group's widened copies).
  void forward(CpuContext& ctx, DType dtype) const;

  std::vector<FusedMember> members_;
  int inputs_;
  std::vector<int> outputs_;
  DType dtype_;
  LoweringMode mode_;
  std::string entry_;
};

// kg.group_output: output `index` of a fused group with `count` outputs, a view of its part of
// the packed value [count, <shape>] (elements index * numel(shape) on). It computes nothing and
// has no backward of its own: the runtime aliases its value and its gradient.
class GroupOutputOp final : public CustomOp {
 public:
  GroupOutputOp(int index, int count);

  std::string name() const override { return "kg.group_output"; }
  // "output=1/3".
  std::string attributes() const override;
  // [count, <shape>] → <shape>.
  Shape infer_output_shape(const std::vector<Shape>& input_shapes) const override;
  bool is_view() const override { return true; }
  std::optional<std::int64_t> view_offset(const std::vector<std::int64_t>& input_sizes) const override;
  // A view serves any dtype, the packed value's.
  bool computes_in(DType) const override { return true; }

  int index() const { return index_; }
  int count() const { return count_; }

 private:
  int index_, count_;
};

}  // namespace kg::ops
