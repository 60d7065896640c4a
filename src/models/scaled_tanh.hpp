// LeCun's scaled hyperbolic tangent y = A·tanh(S·x), the activation of the original LeNet-5,
// written as a user writes a custom op: only the public API (<kg/...>), a CPU forward and
// backward, and CUDA kernels for both directions.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "kg/custom_op.hpp"

namespace kg::models {

class ScaledTanh final : public CustomOp {
 public:
  // `dtype` is the input's (f32 or f64): the kernels are generated for it.
  explicit ScaledTanh(DType dtype = DType::F32, double amplitude = 1.7159, double slope = 2.0 / 3.0);

  std::string name() const override { return "lenet.scaled_tanh"; }
  std::string attributes() const override;
  Shape infer_output_shape(const std::vector<Shape>& in) const override;
  DType infer_output_dtype(const std::vector<DType>& in) const override;

  std::optional<Lowered> lower(const LowerContext& ctx) const override;
  std::string lower_backward_source(const LowerContext& ctx) const override;

  // y = A·tanh(S·x) per element, so that the fusion pass can merge it with its neighbours.
  std::optional<ElementwiseForm> elementwise_form(const std::vector<DType>& in) const override;

  void cpu_forward(CpuContext& ctx) const override;
  bool has_cpu_backward() const override { return true; }
  void cpu_backward(CpuBackwardContext& ctx) const override;
  // dy/dx = A·S·(1 - (y/A)²) needs only the output.
  BackwardSaves backward_saves() const override { return {.inputs = false, .output = true}; }

  double amplitude() const { return a_; }
  double slope() const { return s_; }

 private:
  DType dtype_;
  double a_, s_;
};

}  // namespace kg::models
