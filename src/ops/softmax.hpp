// What passes read of nn.softmax (the op itself is private to softmax.cpp).
#pragma once

#include <cstdint>
#include <optional>

#include "kg/custom_op.hpp"

namespace kg::ops {

// The dim of an nn.softmax node, as recorded (negative counts from the end); nullopt for any other
// op, nn.log_softmax included.
std::optional<std::int64_t> softmax_dim(const CustomOp& op);

}  // namespace kg::ops
