// Host side of KgDivider (src/ops/index.cuh): the multiplier and shift that turn division by a divisor
// fixed for a launch into a multiply-high, an add and a shift in the kernel.
#pragma once

#include <cstdint>

namespace kg::ops {

// Laid out as the kernels' KgDivider (16 bytes), passed by value with ArgVisitor::bytes.
struct FastDiv {
  std::uint32_t mul = 1;
  std::uint32_t shift = 0;
  std::int64_t d = 1;
};
static_assert(sizeof(FastDiv) == 16);

// The divider for `d` (taken as 1 when d < 1, for empty extents). The multiplier is exact for
// dividends below 2^31 when d is below 2^31; larger divisors keep only the 64-bit path.
inline FastDiv fast_div(std::int64_t d) {
  FastDiv f;
  f.d = d < 1 ? 1 : d;
  if (f.d < (std::int64_t{1} << 31)) {
    const auto u = static_cast<std::uint64_t>(f.d);
    std::uint32_t s = 0;
    while ((std::uint64_t{1} << s) < u) ++s;
    f.shift = s;
    f.mul = static_cast<std::uint32_t>(((std::uint64_t{1} << 32) * ((std::uint64_t{1} << s) - u)) / u + 1);
  } else {
    f.mul = 0;
    f.shift = 0;
  }
  return f;
}

// Threads per element of the kernels that loop with kg_for_each_unrolled (KG_UNROLL).
constexpr std::int64_t kUnroll = 4;

}  // namespace kg::ops
