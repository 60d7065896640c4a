// kg.fused_gemm: a GEMM (nn.linear, nn.matmul) whose output is stored through a fused epilogue, a
// group of elementwise members that the epilogue pass (passes/fuse_gemm) folded into it: the bias
// add of a linear, then a residual add, a scale, the user's activation, any elementwise group that
// reads the GEMM's output once. The GEMM's output is never written by itself: on a GPU the GEMM's
// own tiled kernel evaluates the group at each element as it stores it, reading the group's other
// inputs there (broadcast as numpy does). A vendor-library tactic (cuBLASLt) keeps its own bias
// and ReLU epilogues and runs the group as a second kernel over its output in place; the tactic
// choice times both on the real shapes. On the CPU the GEMM's own CPU form writes a scratch buffer
// that the group (as kg.fused_elementwise) then reads.
//
// The node's inputs are the GEMM's, then the group's other inputs in order (at most
// KG_FUSE_MAX_INPUTS group inputs in all); its parameters are the GEMM's, its output the group's,
// which has the GEMM output's shape. Inference only.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kg/custom_op.hpp"
#include "ops/fused_elementwise.hpp"

namespace kg::ops {

class EpilogueGemm;

class FusedGemmOp final : public CustomOp {
 public:
  // `gemm` is the GEMM's op (one that takes an epilogue of `dtype`, ops/epilogue.hpp), which reads
  // `gemm_inputs` inputs. `members` (ending with the root) read `inputs` group inputs as for
  // kg.fused_elementwise; group input `given` is the GEMM's output. `dtype` is the tensors' (f32,
  // f64, f16 or bf16; an f32 node may be re-declared in a 16-bit dtype when its GEMM computes in
  // it). Checks the description (kg::Error).
  FusedGemmOp(CustomData gemm, int gemm_inputs, std::vector<FusedMember> members, int inputs, int given,
              DType dtype);

  std::string name() const override { return "kg.fused_gemm"; }
  // "<gemm op> <its attributes> epilogue=a,b,c kernel=kg_epilogue_...".
  std::string attributes() const override;
  // The GEMM's output shape, then the group's from it and the other inputs (it must be the GEMM's).
  Shape infer_output_shape(const std::vector<Shape>& input_shapes) const override;
  DType infer_output_dtype(const std::vector<DType>& input_dtypes) const override;
  // The GEMM's, for its inputs.
  std::vector<ParamSpec> parameters(const std::vector<Shape>& input_shapes) const override;
  bool computes_in(DType dtype) const override;

  // The GEMM's kernel storing through the epilogue (one entry), plus an entry that applies the
  // epilogue alone in place, for the vendor-library tactic.
  std::optional<Lowered> lower(const LowerContext& ctx) const override;
  // The GEMM's cpu_forward into scratch, then the group's on it.
  void cpu_forward(CpuContext& ctx) const override;

  const CustomData& gemm() const { return gemm_; }
  int gemm_inputs() const { return gemm_inputs_; }
  const std::vector<FusedMember>& members() const { return group(dtype_).members(); }
  int group_inputs() const { return group(dtype_).inputs(); }
  int given() const { return given_; }
  DType dtype() const { return dtype_; }
  // The forward kernel's entry point (a hash of the GEMM and the epilogue).
  const std::string& entry() const { return entry_; }

 private:
  // The members as a group in `dtype` (its CPU form).
  const FusedElementwiseOp& group(DType dtype) const;
  // The group's input shapes (or dtypes) from the node's: the GEMM's output at `given`, the
  // node's inputs after the GEMM's in the other places.
  template <class T>
  std::vector<T> group_list(const std::vector<T>& node, T gemm_out) const;

  CustomData gemm_;
  const EpilogueGemm* epilogue_gemm_;
  int gemm_inputs_;
  int given_;
  DType dtype_;
  std::vector<std::pair<DType, std::shared_ptr<const FusedElementwiseOp>>> groups_;
  std::string entry_;
};

}  // namespace kg::ops
