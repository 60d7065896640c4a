// nn.attention, scaled dot-product attention, for the passes that build it directly (the op itself
// is private to attention.cpp; kg::nn::attention records it).
#pragma once

#include <cstdint>
#include <optional>

#include "kg/custom_op.hpp"

namespace kg::ops {

// What an nn.attention node computes: softmax(scale · q kᵀ + mask) v.
struct AttentionSpec {
  enum class Mask { None, Additive, Bool };
  Mask mask = Mask::None;
  bool causal = false;
  std::optional<double> scale;  // nullopt: 1 / sqrt(D)
};

// The op for `spec`: inputs q, k, v, then the mask when spec.mask is not None.
CustomData attention_op(const AttentionSpec& spec);

// The spec of an nn.attention node; nullopt for any other op.
std::optional<AttentionSpec> attention_spec(const CustomOp& op);

// The largest D and Dv the op's GPU kernel takes (a node with a larger one has no lowering; it
// runs on the CPU only).
std::int64_t attention_max_head();

}  // namespace kg::ops
