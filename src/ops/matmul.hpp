// What passes read of nn.matmul (the op itself is private to matmul.cpp).
#pragma once

#include "kg/custom_op.hpp"

namespace kg::ops {

// True for an nn.matmul node's op (not nn.linear, not a fused GEMM).
bool is_matmul(const CustomOp& op);

}  // namespace kg::ops
