// Pooling on channels-last tensors ([N, H, W, C]): nn.max_pool2d_nhwc and nn.avg_pool2d_nhwc run
// by oneDNN on the CPU (f32), nn.global_avg_pool_nhwc by a vectorised loop; on a GPU all three by
// the kernels of pool_nhwc.cu (f32, f16, bf16). Only the channels-last pass builds them, at load,
// from the NCHW ops whose configuration pool_config() reads; they have no backward.
#pragma once

#include <optional>

#include "kg/custom_op.hpp"
#include "kg/ops.hpp"

namespace kg::ops {

// The configuration of a pooling op of pool.cpp (nullopt for any other op).
struct PoolConfig {
  enum class Kind : std::uint8_t { Max, Avg, Global };
  Kind kind = Kind::Global;
  Size2 kernel{1}, stride{1}, padding{0}, dilation{1};
  bool ceil_mode = false;
  bool count_include_pad = true;  // Avg only
};
std::optional<PoolConfig> pool_config(const CustomOp& op);

// True when the channels-last op for `c` can run in this build: on the CPU (f32, oneDNN) or, with
// `gpu`, on a GPU.
bool channels_last_pool_supported(const PoolConfig& c, bool gpu = false);

// The channels-last op computing what the NCHW op of configuration `c` computes.
CustomData channels_last_pool(const PoolConfig& c);

}  // namespace kg::ops
