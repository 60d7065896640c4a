// Helpers for the built-in ops' lowerings: embedded kernel sources and common launch shapes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "compile/embedded_sources.hpp"
#include "kg/runtime_op.hpp"

namespace kg::ops {

// The text of an embedded kernel source beside the op (e.g. "elementwise.cu").
inline const std::string& kernel_file(const std::string& name) { return compile::kernel_source(name); }

// A 1-D grid covering n items with `block` threads each, capped for grid-stride loops.
inline Dim3 grid_1d(std::int64_t n, unsigned block, std::int64_t max_blocks = 65535LL * 32) {
  std::int64_t b = (n + block - 1) / block;
  b = std::clamp<std::int64_t>(b, 1, max_blocks);
  return {static_cast<unsigned>(b), 1, 1};
}

// The kernel entry for a dtype: "<stem>_f32" or "<stem>_f64".
inline std::string entry_for(const std::string& stem, DType t) {
  return stem + (t == DType::F64 ? "_f64" : "_f32");
}

}  // namespace kg::ops
