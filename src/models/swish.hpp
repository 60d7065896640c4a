// Swish, y = x·sigmoid(x), written as a user writes an activation: only the public API (<kg/...>),
// a CPU forward and backward, CUDA kernels for both directions, and its per-element form so that
// the fusion passes can merge it with its neighbours (a convolution's epilogue, an elementwise
// group). ResNet-18's "resnet18-swish" variant uses it in place of every ReLU.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "kg/custom_op.hpp"

namespace kg::models {

class Swish final : public CustomOp {
 public:
  std::string name() const override { return "user.swish"; }
  Shape infer_output_shape(const std::vector<Shape>& in) const override;
  DType infer_output_dtype(const std::vector<DType>& in) const override;

  std::optional<Lowered> lower(const LowerContext& ctx) const override;
  std::string lower_backward_source(const LowerContext& ctx) const override;
  std::optional<ElementwiseForm> elementwise_form(const std::vector<DType>& in) const override;

  void cpu_forward(CpuContext& ctx) const override;
  bool has_cpu_backward() const override { return true; }
  void cpu_backward(CpuBackwardContext& ctx) const override;
};

}  // namespace kg::models
