// Re-declaring a parameter in another dtype: a parameter that follows an input's dtype
// (ParamSpec::dtype_from_input), resolved when the node is recorded, and an f32 parameter of a
// node that computes in f16 or bf16 (recording such a node, and the reduced-precision pass).
#pragma once

#include <vector>

#include "kg/custom_op.hpp"

namespace kg {

// An f32 parameter becomes `dtype`; a Data initialiser is rounded to it. Others are unchanged.
void narrow_param(ParamSpec& p, DType dtype);

// A parameter with dtype_from_input = k takes the dtype of input k (of `input_dtypes`, recorded
// order); a Data initialiser given in its declared `dtype` is converted. Throws kg::Error (the
// caller puts the node's label in front) when k names no input or a non-float one.
void follow_input_dtype(ParamSpec& p, const std::vector<DType>& input_dtypes);

}  // namespace kg
