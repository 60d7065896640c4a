// nn.conv_transpose2d: the transposed 2-D convolution (PyTorch's ConvTranspose2d, ONNX's
// ConvTranspose), the gradient of a convolution with respect to its input used as a layer. Each
// input pixel (iy, ix) of channel c adds x * w[c, o, ky, kx] into output pixel
// (iy * stride - pad_top + ky * dilation, ix * stride - pad_left + kx * dilation) of every
// output channel o of its group; the output starts at the bias.
#pragma once

#include <cstdint>
#include <string>

#include "kg/custom_op.hpp"
#include "kg/dtype.hpp"
#include "kg/graph.hpp"

namespace kg::ops {

struct ConvTranspose2dOptions {
  std::int64_t stride_h = 1, stride_w = 1;
  std::int64_t pad_top = 0, pad_left = 0, pad_bottom = 0, pad_right = 0;  // may differ (ONNX pads)
  std::int64_t output_padding_h = 0, output_padding_w = 0;
  std::int64_t dilation_h = 1, dilation_w = 1;
  std::int64_t groups = 1;
  bool bias = true;
};

// x [N, Cin, H, W] → [N, Cout, Ho, Wo], Ho = stride*(H-1) + output_padding + dilation*(kh-1) + 1 - pad_top -
// pad_bottom (Wo likewise with the left and right pads). Parameters, in this order: "weight" [Cin,
// Cout/groups, kh, kw] (ONNX/PyTorch layout) and, with o.bias, "bias" [Cout], of `dtype` (the input's dtype
// must match; f32 or f64), initialised as PyTorch's ConvTranspose2d does: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
// with fan_in = Cout/groups * kh * kw. Cin is read from the input's shape when the op is recorded (dim 1 must
// be static). The configuration is checked by infer_output_shape, so that errors carry the node's label.
CustomData conv_transpose2d_op(std::int64_t out_channels, std::int64_t kh, std::int64_t kw,
                               const ConvTranspose2dOptions& o, DType dtype = DType::F32);
// Records nn.conv_transpose2d on x, with parameters of x's dtype.
SymTensor conv_transpose2d(const SymTensor& x, std::int64_t out_channels, std::int64_t kh, std::int64_t kw,
                           const ConvTranspose2dOptions& o, const std::string& name = "");

}  // namespace kg::ops
