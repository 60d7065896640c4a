// Helpers for the built-in ops' lowerings: embedded kernel sources and common launch shapes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "compile/embedded_sources.hpp"
#include "kg/error.hpp"
#include "kg/runtime_op.hpp"
#include "util/str.hpp"

namespace kg::ops {

// The text of an embedded kernel source beside the op (e.g. "elementwise.cu").
inline const std::string& kernel_file(const std::string& name) { return compile::kernel_source(name); }

// A kernel file's text without its entries: every section from a line "#ifndef KG_FUSED_MODULE"
// to its "#endif  // KG_FUSED_MODULE" is cut (the CUDA emulator finds entries in the text, so
// they are removed rather than only guarded). A fused module (a reduction's prologue, a GEMM's
// epilogue) holds the file's device code and entries of its own.
inline std::string without_entries(const std::string& file) {
  static const std::string open = "#ifndef KG_FUSED_MODULE\n", close = "#endif  // KG_FUSED_MODULE\n";
  std::string out;
  std::size_t at = 0;
  for (std::size_t b; (b = file.find(open, at)) != std::string::npos;) {
    const std::size_t e = file.find(close, b);
    out += file.substr(at, b - at);
    at = e == std::string::npos ? file.size() : e + close.size();
  }
  return out + file.substr(std::min(at, file.size()));
}

// CUDA's grid limits: 2^31 - 1 blocks along x, 65535 along y and z.
inline constexpr std::int64_t kGridMaxX = 2147483647, kGridMaxYZ = 65535;

// A block count as the grid dimension along `axis` ('x', 'y' or 'z'), for a kernel that takes
// one tile per block (no grid-stride loop): at least 1 (an empty launch is one idle block), and
// over the axis' limit an error naming `what` (the launch and the work it covers) rather than a
// count cast to 32 bits, which wraps and would pass the launch check.
inline unsigned grid_dim(std::int64_t blocks, char axis, const std::string& what) {
  const std::int64_t limit = axis == 'x' ? kGridMaxX : kGridMaxYZ;
  if (blocks > limit)
    throw Error(
        util::cat(what, " needs gridDim.", axis, " = ", blocks, ", over CUDA's limit of ", limit, " blocks"));
  return static_cast<unsigned>(std::max<std::int64_t>(blocks, 1));
}

// Tiles of `tile` covering n items, without overflow near INT64_MAX.
inline std::int64_t tiles_of(std::int64_t n, std::int64_t tile) { return n / tile + (n % tile != 0); }

// A 1-D grid covering n items with `block` threads each, capped for grid-stride loops.
inline Dim3 grid_1d(std::int64_t n, unsigned block, std::int64_t max_blocks = 65535LL * 32) {
  std::int64_t b = tiles_of(n, block);
  b = std::clamp<std::int64_t>(b, 1, max_blocks);
  return {static_cast<unsigned>(b), 1, 1};
}

// The kernel entry for a floating dtype: "<stem>_f32", "<stem>_f64", "<stem>_f16" or "<stem>_bf16".
inline std::string entry_for(const std::string& stem, DType t) {
  switch (t) {
    case DType::F64: return stem + "_f64";
    case DType::F16: return stem + "_f16";
    case DType::BF16: return stem + "_bf16";
    default: return stem + "_f32";
  }
}

// The element type kernels use for a floating dtype: "float", "double", and kg_dtype.cuh's
// "kg_f16" and "kg_bf16" (16-bit storage, computed in float).
inline const char* device_type(DType t) {
  switch (t) {
    case DType::F64: return "double";
    case DType::F16: return "kg_f16";
    case DType::BF16: return "kg_bf16";
    default: return "float";
  }
}
// The type a kernel computes a floating dtype in: "double" for f64, "float" otherwise.
inline const char* device_compute_type(DType t) { return t == DType::F64 ? "double" : "float"; }

}  // namespace kg::ops
