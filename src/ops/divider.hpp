// KgDivider (ops/index_shared.cuh) filled on the host: the multiplier and shift that turn division
// by a divisor fixed for a launch into a multiply-high, an add and a shift in the kernel.
#pragma once

#include <cstdint>

#include "ops/index_shared.cuh"

namespace kg::ops {

static_assert(sizeof(KgDivider) == 16 && sizeof(long long) == 8 && sizeof(unsigned) == 4);

// The divider for `d` (taken as 1 when d < 1, for empty extents). The multiplier is exact for
// dividends below 2^31 when d is below 2^31; larger divisors keep only the 64-bit path (mul 0).
inline KgDivider kg_divider(std::int64_t d) {
  KgDivider f{1, 0, d < 1 ? 1 : d};
  if (f.d < (std::int64_t{1} << 31)) {
    const auto u = static_cast<std::uint64_t>(f.d);
    unsigned s = 0;
    while ((std::uint64_t{1} << s) < u) ++s;
    f.shift = s;
    f.mul = static_cast<unsigned>(((std::uint64_t{1} << 32) * ((std::uint64_t{1} << s) - u)) / u + 1);
  } else {
    f.mul = 0;
    f.shift = 0;
  }
  return f;
}

}  // namespace kg::ops
