// The GPU lowering of the convolution family (kernels in src/ops/conv.cu and conv_backward.cu),
// from a plain description of the convolution: nn.conv2d and the inference-time nn.fused_conv2d
// (convolution, folded BatchNorm, residual add, activation) build one in conv.cpp.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kg/custom_op.hpp"
#include "kg/ops.hpp"
#include "ops/elementwise.hpp"

namespace kg::ops {

// What the GPU kernel of a convolution needs to know at lowering: the convolution and, for a
// fused one, its epilogue.
struct ConvGpuConfig {
  std::int64_t in_channels = 0, out_channels = 0;
  Size2 kernel = 1;
  nn::Conv2dOptions options;
  // Of every tensor: f32, f64, or f16 / bf16 (16-bit storage, computed in float).
  DType dtype = DType::F32;
  bool batch_norm = false;  // parameters after the convolution's: weight, bias, mean, var, count
  double bn_eps = 1e-5;
  bool residual = false;                // a second input added before the activation
  std::optional<UnarySpec> activation;  // applied last
  // Or a single-input elementwise form (its device function), applied last.
  std::optional<ElementwiseForm> activation_form;
  // Channels-last activations: x [N, H, W, C], the residual and y [N, OH, OW, O] (the weights
  // stay [O, C/groups, kh, kw]). Inference only; the library call gets the weights laid out
  // [O, kh, kw, C/groups] in the op's scratch by a prologue launch.
  bool channels_last = false;
};

// The GPU algorithms (see conv.cu): an implicit GEMM for many output channels per group and
// deep reductions; otherwise a shared-memory tiled loop for stride 1, no dilation and kernels
// up to 7x7, and a direct loop for the rest. Channels-last has an implicit GEMM on tensor cores
// for f16 and bf16 with one group (NhwcMma), and one loop of its own for the rest (Nhwc).
enum class ConvGpuAlgo { Direct, Gemm, Tiled, Nhwc, NhwcMma };
ConvGpuAlgo conv_gpu_algo(const ConvGpuConfig& cfg);

// The kernel and RuntimeOp of the convolution `cfg` describes; `op_name` names it in errors
// and caches. Without an epilogue, in f32 or f64, the RuntimeOp also describes the backward
// launches of conv2d_backward_source().
Lowered lower_conv(const ConvGpuConfig& cfg, const std::string& op_name);

// The backward kernels of nn.conv2d (conv_backward.cu).
std::string conv2d_backward_source();

}  // namespace kg::ops
