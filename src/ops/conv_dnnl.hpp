// nn.conv2d_nhwc: a convolution (with a fused convolution's epilogue) on channels-last tensors,
// run by oneDNN on the CPU (f32) and, on a GPU, by cuDNN with tensor cores (f16, bf16, f32 with
// TF32) or by its own kernel (ops/conv_gpu.hpp). Only the channels-last pass
// (passes/channels_last.cpp) builds it, at load, from an nn.conv2d or nn.fused_conv2d node of an
// inference graph: the node keeps its name and its parameters (weights stay
// [out, in/groups, kh, kw]); only the activations are laid out [N, H, W, C]. No backward.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kg/custom_op.hpp"
#include "ops/conv.hpp"

namespace kg::ops {

namespace dnnl {
class Conv;
}

class ChannelsLastConvOp final : public CustomOp {
 public:
  // `spec` is empty for a plain nn.conv2d; `params` are the node's, with full names. `tune`:
  // time oneDNN's implementations at the first run and keep the fastest (LoadOptions::tune).
  ChannelsLastConvOp(Conv2dOp conv, ConvEpilogueSpec spec, std::vector<ParamSpec> params, bool tune = false);
  ~ChannelsLastConvOp() override;
  std::string name() const override { return "nn.conv2d_nhwc"; }
  // The convolution's attributes, what was fused, and the oneDNN implementation once it ran.
  std::string attributes() const override;
  // Input [N, H, W, C] (and the residual [N, OH, OW, O]) → [N, OH, OW, O].
  Shape infer_output_shape(const std::vector<Shape>& in) const override;
  DType infer_output_dtype(const std::vector<DType>& in) const override;
  std::vector<ParamSpec> parameters(const std::vector<Shape>&) const override { return params_; }
  // On the CPU: f32 only (oneDNN).
  void cpu_forward(CpuContext& ctx) const override;
  // The GPU kernel and library call of the convolution in channels-last (ops/conv_gpu.hpp).
  std::optional<Lowered> lower(const LowerContext& ctx) const override;
  bool computes_in(DType dtype) const override { return is_half_float(dtype); }

  // True when oneDNN can run this convolution in this build: f32, on a machine where its engine
  // starts.
  static bool supports(const Conv2dOp& conv);
  // The epilogue it applies.
  const ConvEpilogueSpec& spec() const { return spec_; }

 private:
  Conv2dOp conv_;
  ConvEpilogueSpec spec_;
  std::vector<ParamSpec> params_;
  bool tune_ = false;
  // The primitive for the bound shape and the weights it holds (converted again when the
  // parameters change: dnnl::parameters_generation).
  struct State;
  mutable std::mutex mu_;
  mutable std::unique_ptr<State> state_;
};

}  // namespace kg::ops
