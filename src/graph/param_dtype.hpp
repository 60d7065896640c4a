// Re-declaring a parameter in a 16-bit float dtype: what recording a node that computes in f16 or
// bf16 does to its f32 parameters, and what the reduced-precision pass does to a node it converts.
#pragma once

#include "kg/custom_op.hpp"

namespace kg {

// An f32 parameter becomes `dtype`; a Data initialiser is rounded to it. Others are unchanged.
void narrow_param(ParamSpec& p, DType dtype);

}  // namespace kg
