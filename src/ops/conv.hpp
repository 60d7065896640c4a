// The convolution family: nn.conv2d and the inference-time fused convolution that applies a
// folded BatchNorm, a residual add and an activation while the output tile is in cache. Both
// op classes are visible here so that the fusion pass can recognise a convolution, read its
// configuration and build the fused node.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kg/custom_op.hpp"
#include "kg/ops.hpp"
#include "ops/conv_gpu.hpp"
#include "ops/elementwise.hpp"

namespace kg::ops {

// nn.conv2d on [N, C, H, W]. Parameters, in this order: weight [out, in/groups, kh, kw] and,
// with options.bias, bias [out]. The configuration is checked by infer_output_shape (so that
// errors carry the node's label); `in_channels` is -1 when the input's channel count is not
// known at record time, which infer_output_shape reports. It computes in f32, f64, f16 and bf16
// (the 16-bit ones for inference, accumulating in f32; they have no backward).
class Conv2dOp final : public CustomOp {
 public:
  Conv2dOp(std::int64_t in_channels, std::int64_t out_channels, Size2 kernel,
           const nn::Conv2dOptions& options, DType dtype);
  std::string name() const override { return "nn.conv2d"; }
  // "in=64 out=128 k=3 s=2 p=1", with "d=", "groups=" and "bias=false" when not the default.
  std::string attributes() const override;
  Shape infer_output_shape(const std::vector<Shape>& in) const override;
  // The input's dtype, which must be the parameters' (or f16 / bf16 with f32 parameters, which
  // the graph converts for a node computing in it).
  DType infer_output_dtype(const std::vector<DType>& in) const override;
  std::vector<ParamSpec> parameters(const std::vector<Shape>& in) const override;
  void cpu_forward(CpuContext& ctx) const override;
  // The GPU kernel (conv_gpu.cpp), in the node's dtype.
  std::optional<Lowered> lower(const LowerContext& ctx) const override;
  bool computes_in(DType dtype) const override { return is_half_float(dtype); }
  // Gradients of the input, the weight and the bias: im2col and BLAS GEMMs on the CPU; the
  // kernels of conv_backward.cu on the GPU. The backward reads the input (for the weight's
  // gradient) and the weight, never the output. In f16 and bf16 both are errors naming the op.
  bool has_cpu_backward() const override { return true; }
  BackwardSaves backward_saves() const override { return {true, false}; }
  void cpu_backward(CpuBackwardContext& ctx) const override;
  std::string lower_backward_source(const LowerContext& ctx) const override;

  std::int64_t in_channels() const { return in_; }
  std::int64_t out_channels() const { return out_; }
  Size2 kernel() const { return kernel_; }
  const nn::Conv2dOptions& options() const { return opt_; }
  // The dtype the parameters were declared in (a node's may differ: see infer_output_dtype).
  DType dtype() const { return dtype_; }

 private:
  std::int64_t in_, out_;
  Size2 kernel_;
  nn::Conv2dOptions opt_;
  DType dtype_;  // of the parameters: the input's
};

// The CPU algorithms of a convolution (see conv.cpp). Auto picks one from the shapes and the
// dtype; the others are named so that tests can run each of them on the same inputs.
enum class ConvAlgo {
  Auto,
  Gemm,       // im2col tiles and the BLAS GEMM: any float dtype
  Depthwise,  // a direct loop per output plane: any float dtype
  Direct,     // f32 with AVX-512: implicit GEMM on a padded, stride-split copy of the input
  Packed,     // f32 with AVX-512: im2col blocks spanning images, same kernel
  Rows,       // f32 with AVX-512: output rows as vectors, few channels (stride-1 columns;
              // Direct serves other strides)
};

// True when `algo` can run for `dtype` in this build.
bool conv_algo_available(ConvAlgo algo, DType dtype);

// The algorithm Auto picks for `op` on an input of these sizes ([N, C, H, W]) and dtype.
ConvAlgo conv_algo_for(const Conv2dOp& op, const std::vector<std::int64_t>& input, DType dtype);

// Computes `op` (with its bias) from ctx.inputs[0] and ctx.params into ctx.output with the
// given algorithm (for f16 and bf16 tensors, on f32 copies); throws kg::Error when it is not
// available.
void conv2d_cpu(const Conv2dOp& op, ConvAlgo algo, CpuContext& ctx);

// What a fused convolution applies after the convolution, in this order.
struct ConvEpilogueSpec {
  bool batch_norm = false;  // y = y * gamma / sqrt(var + eps) + (beta - mean * gamma / sqrt(var + eps))
  double bn_eps = 1e-5;
  bool residual = false;                 // y += the node's second input (same shape as the output)
  std::optional<UnarySpec> activation;   // y = f(y)
  // Or any other single-input op with an ElementwiseForm (a user's activation): y = f(y) by its
  // device function on the GPU and its CPU form on the CPU. `activation_op` is its op name.
  std::optional<ElementwiseForm> activation_form;
  std::string activation_op;
  // Set when activation_form is a pointwise Clip to [first, second] (ReLU6): oneDNN applies it
  // as a post-op where the other paths run the form.
  std::optional<std::pair<double, double>> clip;
  std::vector<std::string> fused_nodes;  // names of the absorbed nodes, for attributes()
  std::vector<std::string> fused_ops;    // their op names ("nn.batch_norm2d", "nn.relu", ...)
};

// nn.fused_conv2d: a convolution followed by the epilogue of `spec`. Inputs: x and, with
// spec.residual, the tensor added before the activation. Parameters: the convolution's
// (weight, bias?) then, with spec.batch_norm, the batch norm's (weight, bias, running_mean,
// running_var, num_batches_tracked). `params` are the specs with their full dotted names, as
// the fused node holds them; parameters() returns them unchanged. Built only by the fusion pass
// for inference: with a batch norm inside, running in train mode is an error. Computes in f32,
// f64, f16 and bf16 (every input, output and floating parameter of one dtype; the 16-bit ones
// accumulate and apply the epilogue in f32, an activation's form included).
class FusedConv2dOp final : public CustomOp {
 public:
  FusedConv2dOp(Conv2dOp conv, ConvEpilogueSpec spec, std::vector<ParamSpec> params);
  std::string name() const override { return "nn.fused_conv2d"; }
  // The convolution's attributes, then what was fused: "... fused=[bn1:nn.batch_norm2d(eps=1e-05),
  // relu:nn.relu]".
  std::string attributes() const override;
  Shape infer_output_shape(const std::vector<Shape>& in) const override;
  DType infer_output_dtype(const std::vector<DType>& in) const override;
  std::vector<ParamSpec> parameters(const std::vector<Shape>&) const override { return params_; }
  void cpu_forward(CpuContext& ctx) const override;
  // The GPU kernel (conv_gpu.cpp), in the node's dtype; no lowered backward (inference only).
  std::optional<Lowered> lower(const LowerContext& ctx) const override;
  bool computes_in(DType dtype) const override { return is_half_float(dtype); }

  const Conv2dOp& conv() const { return conv_; }
  const ConvEpilogueSpec& spec() const { return spec_; }

 private:
  Conv2dOp conv_;
  ConvEpilogueSpec spec_;
  std::vector<ParamSpec> params_;
};

// The GPU lowering's view (conv_gpu.hpp) of `conv` followed by the epilogue `spec` (empty for a
// plain convolution), computing in `dtype`.
ConvGpuConfig conv_gpu_config(const Conv2dOp& conv, const ConvEpilogueSpec& spec, DType dtype);

}  // namespace kg::ops
