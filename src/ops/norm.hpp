// Normalisation ops (nn.batch_norm2d, nn.layer_norm). BatchNorm2dOp is visible here so that
// passes can recognise a batch norm node and read its configuration.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kg/custom_op.hpp"
#include "kg/runtime_op.hpp"

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
  std::vector<ParamSpec> parameters(const std::vector<Shape>& input_shapes) const override;
  // The GPU kernel (src/ops/norm.cu): one entry for both modes (the running statistics, or in
  // train mode the batch's with the running ones updated). Its backward kernels
  // (norm_backward.cu) follow the forward's mode.
  std::optional<Lowered> lower(const LowerContext& ctx) const override;
  std::string lower_backward_source(const LowerContext& ctx) const override;
  // Training mode normalises with the batch statistics and updates the running ones as PyTorch
  // does: running = (1 - momentum) running + momentum batch (the unbiased variance), and
  // num_batches_tracked + 1.
  void cpu_forward(CpuContext& ctx) const override;
  bool has_cpu_backward() const override { return true; }
  BackwardSaves backward_saves() const override { return {true, false}; }
  // Training: the full backward through the batch statistics; inference: through the running
  // ones (constants). Gradients for x, weight and bias; the running statistics get none.
  void cpu_backward(CpuBackwardContext& ctx) const override;

  std::int64_t channels() const { return channels_; }
  double eps() const { return eps_; }
  double momentum() const { return momentum_; }
  DType dtype() const { return dtype_; }

 private:
  std::int64_t channels_;
  double eps_, momentum_;
  DType dtype_;  // of the float parameters: the input's
};

// The GPU half (RuntimeOp) of nn.batch_norm2d. Its forward depends on the run
// (LaunchTensors::training): the running statistics in inference; in train mode the batch's,
// updating the running ones with `momentum` and num_batches_tracked. `training` selects the
// statistics of its backward when LaunchTensors::training: the batch's (recomputed from the
// saved input) or the running ones; the op's lower() builds it for training.
std::shared_ptr<RuntimeOp> batch_norm2d_runtime(std::int64_t channels, double eps, DType dtype, bool training,
                                                double momentum = 0.1);

// The eps of a batch norm op; throws kg::Error when `op` is not an nn.batch_norm2d.
double batch_norm_eps(const CustomOp& op);

}  // namespace kg::ops
