// Factories of the shape ops for passes that build nodes directly (the ops themselves are
// private to shape_ops.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "kg/custom_op.hpp"

namespace kg::ops {

// nn.permute: output dim i is input dim dims[i].
CustomData permute_op(std::vector<std::int64_t> dims);
// The same with the elements converted to `to` as they are copied (f32, f16 or bf16 on both
// sides, rounding to nearest even): a cast and the permutation in one pass. It has no backward.
CustomData permute_op(std::vector<std::int64_t> dims, DType to);

// For an nn.permute (or transpose) node on an input of `rank` dims: true when output dim 0 is
// input dim 0. False for any other op.
bool permute_keeps_dim0(const CustomOp& op, std::size_t rank);

// For an nn.permute (or transpose) node on an input of `rank` dims that copies without converting:
// output dim i is input dim result[i]. nullopt for any other op.
std::optional<std::vector<std::int64_t>> permute_dims(const CustomOp& op, std::size_t rank);

}  // namespace kg::ops
