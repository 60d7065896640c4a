// nn.resize: ONNX's Resize (opset 11–18 semantics, without roi, antialias, axes or
// keep_aspect_ratio_policy) on a tensor of any rank from 1 to 8, f32 or f64. Each output
// coordinate x_resized of a dim maps to a real input coordinate x_original by the coordinate
// transformation mode, with `scale` the dim's scale (given, or output size / input size):
//   half_pixel            (x_resized + 0.5) / scale - 0.5
//   pytorch_half_pixel    the same, or 0 when the output length is 1 (the spec's and ONNX
//                         Runtime's rule; the ONNX reference implementation takes -0.5 there)
//   align_corners         x_resized * (length_in - 1) / (scale * length_in - 1), or 0 when
//                         scale * length_in is 1: as the ONNX reference (and its test data), the
//                         real output length, which differs from the integer one when scales
//                         are given (scales 0.6 on a length of 4 divide by 1.4, not 1)
//   asymmetric            x_resized / scale
//   tf_half_pixel_for_nn  (x_resized + 0.5) / scale
//   half_pixel_symmetric  offset + (x_resized + 0.5) / scale - 0.5, where
//                         offset = length_in / 2 * (1 - length_out / (scale * length_in))
// Then, per dim (indices clamped into the input, as the reference's edge padding):
//   Nearest  the input at x_original rounded by nearest_mode (an integer x_original is itself);
//   Linear   the two inputs around x_original, weights 1 - r and r (r = x_original - floor, or
//            1 at an integer, where the left weight is 0);
//   Cubic    the four inputs around x_original with Keys' weights for cubic_coeff_a.
// With exclude_outside, Linear and Cubic give the taps outside the input weight 0 and
// renormalise the others to sum 1 (Nearest ignores it, as ONNX Runtime does). Linear and Cubic
// combine the dims as products of their weights (n-linear, n-cubic), summed in double. A dim
// whose scale is 1 and whose output length is its input's is copied through in every mode (the
// reference skips such axes; tf_half_pixel_for_nn would otherwise shift them by half a pixel).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kg/custom_op.hpp"
#include "kg/graph.hpp"

namespace kg::ops {

struct ResizeSpec {
  enum class Mode { Nearest, Linear, Cubic };
  Mode mode = Mode::Nearest;
  // "half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_half_pixel_for_nn",
  // "half_pixel_symmetric"; tf_crop_and_resize is rejected (it needs roi and an extrapolation value).
  std::string coordinate_transformation_mode = "half_pixel";
  // "round_prefer_floor", "round_prefer_ceil", "floor", "ceil".
  std::string nearest_mode = "round_prefer_floor";
  double cubic_coeff_a = -0.75;
  bool exclude_outside = false;
  // One entry per input dim: either scales (output = floor(in * scale)) or sizes (explicit output
  // size; when sizes are given, the scale used for coordinates is size/in). A dim with scale 1 / size
  // -1 keeps the input's dim, dynamic or not (only such dims may be dynamic).
  std::vector<double> scales;
  std::vector<std::int64_t> sizes;
};

// The op; the spec is checked by infer_output_shape, so that errors carry the node's label.
CustomData resize_op(const ResizeSpec& spec);
SymTensor resize(const SymTensor& x, const ResizeSpec& spec, const std::string& name = "");

}  // namespace kg::ops
