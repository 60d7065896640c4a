// Normalisation ops (nn.batch_norm2d, nn.layer_norm). BatchNorm2dOp is visible here so that
// passes can recognise a batch norm node and read its configuration.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kg/custom_op.hpp"

namespace kg::ops {

// nn.batch_norm2d over the channels of [N, C, H, W]. Parameters, in this order: weight [C],
// bias [C], running_mean [C], running_var [C] (not trainable), num_batches_tracked (i64
// scalar, not trainable). Inference normalises with the running statistics; training mode
// with the batch's (biased) statistics.
class BatchNorm2dOp final : public CustomOp {
 public:
  BatchNorm2dOp(std::int64_t channels, double eps, double momentum, DType dtype);
  std::string name() const override { return "nn.batch_norm2d"; }
  // "eps=<eps> momentum=<momentum>".
  std::string attributes() const override;
  Shape infer_output_shape(const std::vector<Shape>& in) const override;
  DType infer_output_dtype(const std::vector<DType>& in) const override;
  std::vector<ParamSpec> parameters() const override;
  // The GPU kernel (src/ops/norm.cu); it normalises with the running statistics.
  std::optional<Lowered> lower() const override;
  void cpu_forward(CpuContext& ctx) const override;

  std::int64_t channels() const { return channels_; }
  double eps() const { return eps_; }
  double momentum() const { return momentum_; }
  DType dtype() const { return dtype_; }

 private:
  std::int64_t channels_;
  double eps_, momentum_;
  DType dtype_;  // of the float parameters: the input's
};

// The eps of a batch norm op; throws kg::Error when `op` is not an nn.batch_norm2d.
double batch_norm_eps(const CustomOp& op);

}  // namespace kg::ops
