// Factories of the shape ops for passes that build nodes directly (the ops themselves are
// private to shape_ops.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "kg/custom_op.hpp"

namespace kg::ops {

// nn.permute: output dim i is input dim dims[i].
CustomData permute_op(std::vector<std::int64_t> dims);

// For an nn.permute (or transpose) node on an input of `rank` dims: true when output dim 0 is
// input dim 0. False for any other op.
bool permute_keeps_dim0(const CustomOp& op, std::size_t rank);

}  // namespace kg::ops
