// Pooling and resampling on [N, C, H, W]: nn.max_pool2d, nn.avg_pool2d, nn.global_avg_pool,
// nn.upsample_nearest2d. Output sizes follow PyTorch (ops::window_out), including ceil_mode.
// Every op runs over the N*C planes in parallel; on the GPU (pool.cu) one thread per output
// element, one warp per plane for the global average. The backward passes scatter each output
// gradient over its window on the CPU and gather it per input element on the GPU
// (pool_backward.cu). Every op also computes in f16 and bf16 (CustomOp::computes_in), for
// inference: the kernels compare and sum in float, the CPU runs the f32 implementation on f32
// copies (cpu_forward_in_f32) and nn.upsample_nearest2d copies the elements as they are; a
// backward of a 16-bit node is an error naming the op and the dtype.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


#include "kg/ops.hpp"
#include "ops/divider.hpp"
#include "ops/gpu_util.hpp"
#include "ops/op_util.hpp"
#include "ops/pool_dnnl.hpp"
#include "ops/pool_shared.cuh"
#include "util/cpu.hpp"

namespace kg::ops {
namespace {

std::string size2_text(Size2 s) { return s.h == s.w ? util::cat(s.h) : util::cat(s.h, "x", s.w); }

// The dtype of a pooling node: f32 or f64, or f16 or bf16 (forward only), one for every input.
DType pool_dtype(const std::vector<DType>& in) {
  for (DType t : in)
    if (!is_floating(t))
      throw Error(
          util::cat("supports f32 and f64 inputs (and f16 and bf16 for inference), got ", dtype_name(t)));
  return require_float_or_half(in);
}

// Throws for the backward of a 16-bit node: the 16-bit forms are for inference.
void require_backward_dtype(const std::string& op, DType t) {
  if (is_half_float(t))
    throw Error(util::cat(op, " has no backward in ", dtype_name(t),
                          ": 16-bit pooling runs in inference only (train the model in f32)"));
}

#if KG_HAVE_AVX512_PATHS
KG_AVX512_BEGIN
inline __mmask16 pool_lanes(std::int64_t count) {
  return static_cast<__mmask16>(count >= 16 ? 0xFFFFu : count <= 0 ? 0u : (1u << count) - 1u);
}

// max_taps for f32 with stride 1 or 2: the maximum of a window stays in a register across its
// taps; the loads are masked so that no element past the last one used is read.
void max_taps_avx512(float* out, const float* src, std::int64_t taps, std::int64_t tap_step, std::int64_t stride,
                     std::int64_t n) {
  const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  for (std::int64_t j = 0; j < n; j += 16) {
    const std::int64_t left = n - j;
    const __mmask16 used = pool_lanes(left);
    // The stride-2 lanes need 2 * left - 1 consecutive elements.
    const __mmask16 lo_used = pool_lanes(2 * left - 1), hi_used = pool_lanes(2 * left - 17);
    __m512 m = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (std::int64_t t = 0; t < taps; ++t) {
      const float* p = src + t * tap_step + j * stride;
      // Plain loads where every lane is used: masked ones are much slower on memory that
      // misses the cache.
      __m512 v;
      if (stride == 1)
        v = left >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(used, p);
      else if (left > 16)
        v = _mm512_permutex2var_ps(_mm512_loadu_ps(p), evens, _mm512_loadu_ps(p + 16));
      else
        v = _mm512_permutex2var_ps(_mm512_maskz_loadu_ps(lo_used, p), evens, _mm512_maskz_loadu_ps(hi_used, p + 16));
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      // (The zero-masked max avoids GCC 12's false -Wmaybe-uninitialized on the plain one.)
      m = t == 0 ? v : _mm512_maskz_max_ps(0xFFFF, m, v);
    }
    m = _mm512_mask_mov_ps(m, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
    _mm512_mask_storeu_ps(out + j, used, m);
  }
}

// 2x2 windows with stride 2 and no padding (LeNet's, and most CNNs' pools) for f32: each output
// row is the maximum of two input rows, then of the even and odd columns of that, in registers,
// 16 outputs per step; NaN propagates as in max_taps.
void max_pool_2x2_avx512(const float* x, float* y, std::int64_t h, std::int64_t w, std::int64_t ho, std::int64_t wo,
                         std::int64_t planes) {
  (void)h;
  const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odds = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  const __m512 qnan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
  for (std::int64_t pl = 0; pl < planes; ++pl) {
    const float* src = x + pl * h * w;
    float* dst = y + pl * ho * wo;
    for (std::int64_t oy = 0; oy < ho; ++oy) {
      const float* r0 = src + 2 * oy * w;
      const float* r1 = r0 + w;
      for (std::int64_t ox = 0; ox < wo; ox += 16) {
        const std::int64_t n = std::min<std::int64_t>(16, wo - ox);
        const __mmask16 lo = pool_lanes(2 * n), hi = pool_lanes(2 * n - 16), out = pool_lanes(n);
        const float* p0 = r0 + 2 * ox;
        const float* p1 = r1 + 2 * ox;
        const __m512 a0 = _mm512_maskz_loadu_ps(lo, p0), a1 = _mm512_maskz_loadu_ps(hi, p0 + 16);
        const __m512 b0 = _mm512_maskz_loadu_ps(lo, p1), b1 = _mm512_maskz_loadu_ps(hi, p1 + 16);
        __mmask16 nan0 = _mm512_cmp_ps_mask(a0, b0, _CMP_UNORD_Q), nan1 = _mm512_cmp_ps_mask(a1, b1, _CMP_UNORD_Q);
        const __m512 v0 = _mm512_mask_mov_ps(_mm512_maskz_max_ps(0xFFFF, a0, b0), nan0, qnan);
        const __m512 v1 = _mm512_mask_mov_ps(_mm512_maskz_max_ps(0xFFFF, a1, b1), nan1, qnan);
        const __m512 e = _mm512_permutex2var_ps(v0, evens, v1), o = _mm512_permutex2var_ps(v0, odds, v1);
        const __mmask16 nan = _mm512_cmp_ps_mask(e, o, _CMP_UNORD_Q);
        _mm512_mask_storeu_ps(dst + oy * wo + ox, out,
                              _mm512_mask_mov_ps(_mm512_maskz_max_ps(0xFFFF, e, o), nan, qnan));
      }
    }
  }
}
KG_AVX512_END
#endif

// out[j] = the largest of src[t * tap_step + j * stride] over the taps t, for j < n; NaN when
// any is NaN (PyTorch's max pooling propagates NaN). Vectorised for f32 with stride 1 or 2 where
// the CPU has AVX-512.
template <class T>
void max_taps(T* out, const T* src, std::int64_t taps, std::int64_t tap_step, std::int64_t stride,
              std::int64_t n) {
#if KG_HAVE_AVX512_PATHS
  if constexpr (std::is_same_v<T, float>) {
    if (stride <= 2 && util::cpu_has_avx512f()) {
      max_taps_avx512(out, src, taps, tap_step, stride, n);
      return;
    }
  }
#endif
  for (std::int64_t j = 0; j < n; ++j) {
    T m = src[j * stride];
    for (std::int64_t t = 1; t < taps; ++t) {
      const T v = src[t * tap_step + j * stride];
      m = (v > m || v != v) ? v : m;
    }
    out[j] = m;
  }
}

// Planes per parallel chunk so that a chunk reads about 32K elements (some 10 us of pooling:
// handing a chunk to another thread costs a few).
std::int64_t plane_grain(std::int64_t plane_elems) {
  return std::max<std::int64_t>(1, 32768 / std::max<std::int64_t>(plane_elems, 1));
}

// The max pooling of planes [b, e) of x [planes, h, w] into y [planes, ho, wo], in two passes per
// block of output rows: the maximum over the window's rows of each input column (rows in
// memory order, so contiguous loads), into `tmp`; then the maximum over the window's columns of
// those. Where windows neither overlap nor reach into padding horizontally (kw <= sw, pw == 0,
// dw == 1, and no ceil-mode window past the row's end), the column pass runs over a whole block of output
// rows at once, whatever the width: small planes (LeNet's 10x10) then cost a few long vector loops instead of
// many short ones.
struct MaxPoolGeom {
  std::int64_t h, w, ho, wo, kh, kw, sh, sw, ph, pw, dh, dw;
};

template <class T>
void max_pool_planes(const MaxPoolGeom& g, const T* x, T* y, std::int64_t b, std::int64_t e) {
#if KG_HAVE_AVX512_PATHS
  if constexpr (std::is_same_v<T, float>) {
    if (g.kh == 2 && g.kw == 2 && g.sh == 2 && g.sw == 2 && g.ph == 0 && g.pw == 0 && g.dh == 1 && g.dw == 1 &&
        2 * g.ho <= g.h && 2 * g.wo <= g.w && util::cpu_has_avx512f()) {
      max_pool_2x2_avx512(x + b * g.h * g.w, y + b * g.ho * g.wo, g.h, g.w, g.ho, g.wo, e - b);
      return;
    }
  }
#endif
  const T lowest = -std::numeric_limits<T>::infinity();
  auto take = [](T m, T v) { return (v > m || v != v) ? v : m; };
  // The column pass of one output row from its row maxima `rm` (the input row's columns).
  // Output columns whose whole window lies inside the row: [ox_lo, ox_hi).
  const std::int64_t ox_lo = std::min(g.wo, (g.pw + g.sw - 1) / g.sw);
  const std::int64_t last = g.w - (g.kw - 1) * g.dw + g.pw;  // windows starting before it fit
  const std::int64_t ox_hi = std::max(ox_lo, std::min(g.wo, last > 0 ? (last - 1) / g.sw + 1 : 0));
  // The row pass of output row oy of plane `src` into `dst` (`cols` columns): false when the
  // window has no row inside the input (then the output row is -inf).
  auto rows = [&](const T* src, std::int64_t oy, std::int64_t cols, T* dst) {
    const std::int64_t top = oy * g.sh - g.ph;
    const std::int64_t ky0 = top >= 0 ? 0 : (-top + g.dh - 1) / g.dh;
    const std::int64_t ky1 = std::min(g.kh, top >= g.h ? 0 : (g.h - top + g.dh - 1) / g.dh);
    if (ky1 <= ky0) return false;
    max_taps(dst, src + (top + ky0 * g.dh) * g.w, ky1 - ky0, g.dh * g.w, 1, cols);
    return true;
  };
  constexpr std::int64_t kStack = 16384 / sizeof(T);
  alignas(64) T stack[kStack];
  const bool flat = g.kw <= g.sw && g.pw == 0 && g.dw == 1 && (g.wo - 1) * g.sw + g.kw <= g.w;
  const std::int64_t span = flat ? g.wo * g.sw : g.w;  // tmp's row pitch
  std::vector<T> heap;
  T* tmp = stack;
  if (span > kStack) {
    heap.resize(static_cast<std::size_t>(span));
    tmp = heap.data();
  }
  if (flat) {
    // Output rows r in [b * ho, e * ho), in blocks that fit in tmp; the column pass of a block
    // is one run over its rows (the output rows of consecutive planes are consecutive too).
    const std::int64_t cols = std::min(span, g.w), block = std::max<std::int64_t>(1, kStack / span);
    for (std::int64_t r0 = b * g.ho; r0 < e * g.ho; r0 += block) {
      const std::int64_t r1 = std::min(e * g.ho, r0 + block);
      std::int64_t pl = r0 / g.ho, oy = r0 % g.ho;
      for (std::int64_t r = r0; r < r1; ++r) {
        T* t = tmp + (r - r0) * span;
        if (!rows(x + pl * g.h * g.w, oy, cols, t)) std::fill(t, t + span, lowest);
        if (++oy == g.ho) oy = 0, ++pl;
      }
      max_taps(y + r0 * g.wo, tmp, g.kw, 1, g.sw, (r1 - r0) * g.wo);
    }
    return;
  }
  for (std::int64_t pl = b; pl < e; ++pl) {
    const T* src = x + pl * g.h * g.w;
    for (std::int64_t oy = 0; oy < g.ho; ++oy) {
      T* out = y + (pl * g.ho + oy) * g.wo;
      if (!rows(src, oy, g.w, tmp)) {
        std::fill(out, out + g.wo, lowest);
        continue;
      }
      auto edge = [&](std::int64_t ox) {
        T m = lowest;
        for (std::int64_t kx = 0; kx < g.kw; ++kx) {
          const std::int64_t ix = ox * g.sw - g.pw + kx * g.dw;
          if (ix >= 0 && ix < g.w) m = take(m, tmp[ix]);
        }
        out[ox] = m;
      };
      for (std::int64_t ox = 0; ox < ox_lo; ++ox) edge(ox);
      if (ox_hi > ox_lo) max_taps(out + ox_lo, tmp - g.pw + ox_lo * g.sw, g.kw, g.dw, g.sw, ox_hi - ox_lo);
      for (std::int64_t ox = ox_hi; ox < g.wo; ++ox) edge(ox);
    }
  }
}

// A sliding window's configuration, checked as PyTorch checks it.
struct Window {
  Size2 kernel, stride, padding, dilation;
  bool ceil_mode;

  void check() const {
    if (kernel.h <= 0 || kernel.w <= 0)
      throw Error(util::cat("kernel size must be positive, got ", kernel.h, "x", kernel.w));
    if (stride.h <= 0 || stride.w <= 0)
      throw Error(util::cat("stride must be positive, got ", stride.h, "x", stride.w));
    if (dilation.h <= 0 || dilation.w <= 0)
      throw Error(util::cat("dilation must be positive, got ", dilation.h, "x", dilation.w));
    if (padding.h < 0 || padding.w < 0)
      throw Error(util::cat("padding must be non-negative, got ", padding.h, "x", padding.w));
    // PyTorch's rule, which keeps every window on at least one input element.
    if (padding.h > kernel.h / 2 || padding.w > kernel.w / 2)
      throw Error(util::cat("padding ", padding.h, "x", padding.w, " must be at most half the kernel size ",
                            kernel.h, "x", kernel.w));
  }

  Shape out_shape(const std::vector<Shape>& in) const {
    require_inputs(in, 1);
    const Shape& x = in[0];
    require_rank(x, 4, "[N, C, H, W]");
    return Shape{x[0], x[1],
                 window_out(x[2], kernel.h, stride.h, padding.h, dilation.h, ceil_mode, "input height"),
                 window_out(x[3], kernel.w, stride.w, padding.w, dilation.w, ceil_mode, "input width")};
  }

  std::string text() const {
    std::string s =
        util::cat("k=", size2_text(kernel), " s=", size2_text(stride), " p=", size2_text(padding));
    if (dilation.h != 1 || dilation.w != 1) s += " d=" + size2_text(dilation);
    if (ceil_mode) s += " ceil_mode=true";
    return s;
  }
};

Size2 default_stride(Size2 stride, Size2 kernel) {
  return Size2(stride.h == 0 ? kernel.h : stride.h, stride.w == 0 ? kernel.w : stride.w);
}

// ---- the GPU half ----

constexpr unsigned kPoolThreads = KG_POOL_THREADS;

// One launch over [N, C, H, W] → [N, C, H', W'] of the pool.cu entry for `kind`; the backward
// launches pool_backward.cu's entry "<stem>_backward", a thread per input element (after
// "<stem>_picks", a thread per window, for max pooling).
class PoolRuntime final : public RuntimeOp {
 public:
  enum class Kind { Max, Avg, Global, Upsample };
  // `w` is the window (for Upsample: the scale factors as the kernel).
  PoolRuntime(Kind kind, Window w, bool count_include_pad, std::string op_name, std::string stem, DType dtype)
      : kind_(kind),
        w_(w),
        count_include_pad_(count_include_pad),
        op_name_(std::move(op_name)),
        stem_(std::move(stem)),
        dtype_(dtype) {}

  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    const auto& in = t.inputs.at(0).shape;
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.output.ptr);
    pack_geometry(in, t.output.shape, v);
  }
  Dim3 block() const override { return {kPoolThreads, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>& shape) const override {
    if (kind_ == Kind::Global) return grid_1d(shape[0] * shape[1], kPoolThreads / 32);  // a warp per plane
    return grid_1d(numel_of(shape), kPoolThreads);
  }

  // Max pooling first writes each window's pick into the scratch (an int32 per output element),
  // then gathers; the others gather in one launch.
  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    require_backward_dtype(op_name_, dtype_);  // pool_backward.cu has f32 and f64 entries only
    const DeviceTensor& dx = t.grad_inputs.at(0);
    const auto& in = t.inputs.at(0).shape;
    std::vector<Launch> ls;
    if (kind_ == Kind::Max && dx.ptr != 0) {
      if (in[2] * in[3] > std::numeric_limits<std::int32_t>::max())
        throw Error(util::cat(op_name_, ": the backward indexes a plane in 32 bits, and this input's planes have ",
                              in[2], " x ", in[3], " elements"));
      Launch P;
      P.entry = entry_for(stem_ + "_picks", dtype_);
      P.block = {kPoolThreads, 1, 1};
      P.grid = grid_1d(numel_of(t.grad_output.shape), kPoolThreads);
      P.args.pointer(t.inputs[0].ptr);
      P.args.pointer(t.scratch);
      pack_geometry(in, t.grad_output.shape, P.args);
      ls.push_back(std::move(P));
    }
    Launch L;
    L.entry = entry_for(stem_ + "_backward", dtype_);
    L.block = {kPoolThreads, 1, 1};
    // Not wanted: one idle block (the kernel returns at once).
    if (dx.ptr != 0) L.grid = grid_1d(numel_of(in), kPoolThreads);
    if (kind_ == Kind::Max) L.args.pointer(dx.ptr != 0 ? t.scratch : 0);
    L.args.pointer(t.grad_output.ptr);
    L.args.pointer(dx.ptr);
    pack_geometry(in, t.grad_output.shape, L.args);
    ls.push_back(std::move(L));
    return ls;
  }
  std::size_t backward_scratch_bytes(const LaunchTensors& t) const override {
    return kind_ == Kind::Max ? sizeof(std::int32_t) * static_cast<std::size_t>(numel_of(t.grad_output.shape)) : 0;
  }

 private:
  // What follows the pointers, forward and backward: the planes and their size for the global
  // average, else the geometry (and count_include_pad for the average).
  void pack_geometry(const std::vector<std::int64_t>& in, const std::vector<std::int64_t>& out,
                     ArgVisitor& v) const {
    if (kind_ == Kind::Global) {
      v.i64(in[0] * in[1]);
      v.i64(in[2] * in[3]);
      return;
    }
    const KgPoolShape s{in[0] * in[1],
                        in[2],
                        in[3],
                        out[2],
                        out[3],
                        w_.kernel.h,
                        w_.kernel.w,
                        w_.stride.h,
                        w_.stride.w,
                        w_.padding.h,
                        w_.padding.w,
                        w_.dilation.h,
                        w_.dilation.w,
                        kg_divider(in[2] * in[3]),
                        kg_divider(in[3]),
                        kg_divider(w_.stride.h),
                        kg_divider(w_.stride.w)};
    v.bytes(&s, sizeof s);
    if (kind_ == Kind::Avg) v.i32(count_include_pad_ ? 1 : 0);
  }

  Kind kind_;
  Window w_;
  bool count_include_pad_;
  std::string op_name_;  // for errors
  std::string stem_;     // of the forward entry; the backward's adds "_backward"
  DType dtype_;       // of the kernel entries
};

// The lowering of one pooling op, its entries those of the node's dtype.
Lowered pool_lowering(const LowerContext& ctx, const std::string& op_name, const char* stem,
                      PoolRuntime::Kind kind, Window w, bool count_include_pad = false) {
  return Lowered{op_name, kernel_file("pool.cu"), entry_for(stem, ctx.output_dtype),
                 std::make_shared<PoolRuntime>(kind, w, count_include_pad, op_name, stem, ctx.output_dtype)};
}

// The backward kernels of the whole family.
std::string pool_backward_source() { return kernel_file("pool_backward.cu"); }

// ---- nn.max_pool2d ----

class MaxPool2dOp final : public CustomOp {
 public:
  explicit MaxPool2dOp(Window w) : w_(w) {}
  std::string name() const override { return "nn.max_pool2d"; }
  const Window& window() const { return w_; }
  std::string attributes() const override { return w_.text(); }
  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    w_.check();
    return w_.out_shape(in);
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override { return pool_dtype(in); }
  bool computes_in(DType t) const override { return is_half_float(t); }
  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    return pool_lowering(ctx, name(), "kg_max_pool2d", PoolRuntime::Kind::Max, w_);
  }

  void cpu_forward(CpuContext& ctx) const override {
    // 16-bit: the maximum of the f32 copies is one of them, so rounding it back is exact.
    if (is_half_float(ctx.output.dtype()))
      return cpu_forward_in_f32(ctx, [&](CpuContext& c) { cpu_forward(c); });
    const Tensor& x = ctx.inputs[0];
    const MaxPoolGeom g{x.dim(2),     x.dim(3),     ctx.output.dim(2), ctx.output.dim(3),
                        w_.kernel.h,  w_.kernel.w,  w_.stride.h,       w_.stride.w,
                        w_.padding.h, w_.padding.w, w_.dilation.h,     w_.dilation.w};
    dispatch_float(x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data<T>();
      T* yp = ctx.output.data<T>();
      auto body = [&](std::int64_t b, std::int64_t e) { max_pool_planes(g, xp, yp, b, e); };
      // std::ref: the std::function holds a reference, not a copy on the heap.
      ctx.parallel_for(x.dim(0) * x.dim(1), plane_grain(g.h * g.w), std::ref(body));
    });
  }

 // The gradient of each window goes to the tap the forward picked: the first largest, or the
  // last NaN (PyTorch's rule). Reads the input again to find it.
  bool has_cpu_backward() const override { return true; }
  BackwardSaves backward_saves() const override { return {true, false}; }
  std::string lower_backward_source(const LowerContext&) const override { return pool_backward_source(); }
  void cpu_backward(CpuBackwardContext& ctx) const override {
    require_backward_dtype(name(), ctx.grad_output.dtype());
    if (!ctx.wants_input_grad(0)) return;
    const Tensor& x = ctx.inputs[0];
    const std::int64_t h = x.dim(2), w = x.dim(3), ho = ctx.grad_output.dim(2), wo = ctx.grad_output.dim(3);
    const std::int64_t kh = w_.kernel.h, kw = w_.kernel.w, sh = w_.stride.h, sw = w_.stride.w;
    const std::int64_t ph = w_.padding.h, pw = w_.padding.w, dh = w_.dilation.h, dw = w_.dilation.w;
    dispatch_float(x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data<T>();
      const T* dyp = ctx.grad_output.data<T>();
      T* dxp = ctx.grad_inputs[0].data<T>();
      ctx.parallel_for(x.dim(0) * x.dim(1), plane_grain(h * w), [&](std::int64_t b, std::int64_t e) {
        for (std::int64_t pl = b; pl < e; ++pl) {
          const T* src = xp + pl * h * w;
          const T* dy = dyp + pl * ho * wo;
          T* dx = dxp + pl * h * w;
          std::fill(dx, dx + h * w, T(0));
          for (std::int64_t oy = 0; oy < ho; ++oy) {
            const std::int64_t y0 = oy * sh - ph;
            for (std::int64_t ox = 0; ox < wo; ++ox) {
              const std::int64_t x0 = ox * sw - pw;
              std::int64_t pick = -1;
              T m = T(0);
              for (std::int64_t ky = 0; ky < kh; ++ky) {
                const std::int64_t iy = y0 + ky * dh;
                if (iy < 0 || iy >= h) continue;
                for (std::int64_t kx = 0; kx < kw; ++kx) {
                  const std::int64_t ix = x0 + kx * dw;
                  if (ix < 0 || ix >= w) continue;
                  const T v = src[iy * w + ix];
                  if (pick < 0 || v > m || v != v) {
                    m = v;
                    pick = iy * w + ix;
                  }
                }
              }
              if (pick >= 0) dx[pick] += dy[oy * wo + ox];
            }
          }
        }
      });
    });
  }

 private:
  Window w_;
};

// ---- nn.avg_pool2d ----

class AvgPool2dOp final : public CustomOp {
 public:
  AvgPool2dOp(Window w, bool count_include_pad) : w_(w), count_include_pad_(count_include_pad) {}
  std::string name() const override { return "nn.avg_pool2d"; }
  const Window& window() const { return w_; }
  bool count_include_pad() const { return count_include_pad_; }
  std::string attributes() const override {
    return w_.text() + (count_include_pad_ ? "" : " count_include_pad=false");
  }
  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    w_.check();
    return w_.out_shape(in);
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override { return pool_dtype(in); }
  bool computes_in(DType t) const override { return is_half_float(t); }
  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    return pool_lowering(ctx, name(), "kg_avg_pool2d", PoolRuntime::Kind::Avg, w_, count_include_pad_);
  }

  void cpu_forward(CpuContext& ctx) const override {
    // 16-bit: summed in f32, rounded once.
    if (is_half_float(ctx.output.dtype()))
      return cpu_forward_in_f32(ctx, [&](CpuContext& c) { cpu_forward(c); });
    const Tensor& x = ctx.inputs[0];
    const std::int64_t h = x.dim(2), w = x.dim(3), ho = ctx.output.dim(2), wo = ctx.output.dim(3);
    dispatch_float(x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data<T>();
      T* yp = ctx.output.data<T>();
      ctx.parallel_for(x.dim(0) * x.dim(1), plane_grain(h * w), [&](std::int64_t b, std::int64_t e) {
        for (std::int64_t pl = b; pl < e; ++pl) {
          const T* src = xp + pl * h * w;
          T* dst = yp + pl * ho * wo;
          for (std::int64_t oy = 0; oy < ho; ++oy)
            for (std::int64_t ox = 0; ox < wo; ++ox) {
              const Taps t = taps(oy, ox, h, w);
              T s = 0;
              for (std::int64_t iy = t.y0; iy < t.y1; ++iy)
                for (std::int64_t ix = t.x0; ix < t.x1; ++ix) s += src[iy * w + ix];
              dst[oy * wo + ox] = s / static_cast<T>(t.count);
            }
        }
      });
    });
  }

  // Each window's gradient spread evenly over the taps inside the input, over the forward's
  // divisor. Needs no saved tensor.
  bool has_cpu_backward() const override { return true; }
  BackwardSaves backward_saves() const override { return {false, false}; }
  std::string lower_backward_source(const LowerContext&) const override { return pool_backward_source(); }
  void cpu_backward(CpuBackwardContext& ctx) const override {
    require_backward_dtype(name(), ctx.grad_output.dtype());
    if (!ctx.wants_input_grad(0)) return;
    const Tensor& x = ctx.inputs[0];
    const std::int64_t h = x.dim(2), w = x.dim(3), ho = ctx.grad_output.dim(2), wo = ctx.grad_output.dim(3);
    dispatch_float(ctx.grad_output.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* dyp = ctx.grad_output.data<T>();
      T* dxp = ctx.grad_inputs[0].data<T>();
      ctx.parallel_for(x.dim(0) * x.dim(1), plane_grain(h * w), [&](std::int64_t b, std::int64_t e) {
        for (std::int64_t pl = b; pl < e; ++pl) {
          const T* dy = dyp + pl * ho * wo;
          T* dx = dxp + pl * h * w;
          std::fill(dx, dx + h * w, T(0));
          for (std::int64_t oy = 0; oy < ho; ++oy)
            for (std::int64_t ox = 0; ox < wo; ++ox) {
              const Taps t = taps(oy, ox, h, w);
              if (t.count <= 0) continue;
              const T g = dy[oy * wo + ox] / static_cast<T>(t.count);
              for (std::int64_t iy = t.y0; iy < t.y1; ++iy)
                for (std::int64_t ix = t.x0; ix < t.x1; ++ix) dx[iy * w + ix] += g;
            }
        }
      });
    });
  }

 private:
  // The input taps of output pixel (oy, ox), clipped to the input, and the divisor. PyTorch: with
  // count_include_pad the divisor counts the window clipped to the padded input.
  struct Taps {
    std::int64_t y0, y1, x0, x1, count;
  };
  Taps taps(std::int64_t oy, std::int64_t ox, std::int64_t h, std::int64_t w) const {
    const std::int64_t ry = oy * w_.stride.h - w_.padding.h, ry1 = std::min(ry + w_.kernel.h, h + w_.padding.h);
    const std::int64_t rx = ox * w_.stride.w - w_.padding.w, rx1 = std::min(rx + w_.kernel.w, w + w_.padding.w);
    Taps t{std::max<std::int64_t>(ry, 0), std::min(ry1, h), std::max<std::int64_t>(rx, 0), std::min(rx1, w), 0};
    t.count = count_include_pad_ ? (ry1 - ry) * (rx1 - rx)
                                 : std::max<std::int64_t>(t.y1 - t.y0, 0) * std::max<std::int64_t>(t.x1 - t.x0, 0);
    return t;
  }

  Window w_;
  bool count_include_pad_;
};

// ---- nn.global_avg_pool ----

class GlobalAvgPoolOp final : public CustomOp {
 public:
  std::string name() const override { return "nn.global_avg_pool"; }
  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    const Shape& x = in[0];
    require_rank(x, 4, "[N, C, H, W]");
    if ((x[2].is_static() && x[2].size() == 0) || (x[3].is_static() && x[3].size() == 0))
      throw Error(util::cat("needs a non-empty H and W to average, got ", x.to_string()));
    return Shape{x[0], x[1], Dim(1), Dim(1)};
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override { return pool_dtype(in); }
  bool computes_in(DType t) const override { return is_half_float(t); }
  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    return pool_lowering(ctx, name(), "kg_global_avg_pool", PoolRuntime::Kind::Global,
                         Window{1, 1, 0, 1, false});
  }

  void cpu_forward(CpuContext& ctx) const override {
    // 16-bit: summed in f32, rounded once.
    if (is_half_float(ctx.output.dtype()))
      return cpu_forward_in_f32(ctx, [&](CpuContext& c) { cpu_forward(c); });
    const Tensor& x = ctx.inputs[0];
    const std::int64_t hw = x.dim(2) * x.dim(3);
    dispatch_float(x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data<T>();
      T* yp = ctx.output.data<T>();
      ctx.parallel_for(x.dim(0) * x.dim(1), plane_grain(hw), [&](std::int64_t b, std::int64_t e) {
        for (std::int64_t pl = b; pl < e; ++pl) {
          const T* src = xp + pl * hw;
          // Eight partial sums: vectorisable, and closer to a pairwise sum than one running total.
          T part[8] = {};
          std::int64_t i = 0;
          for (; i + 8 <= hw; i += 8)
            for (int k = 0; k < 8; ++k) part[k] += src[i + k];
          T s = 0;
          for (; i < hw; ++i) s += src[i];
          for (int k = 0; k < 8; ++k) s += part[k];
          yp[pl] = s / static_cast<T>(hw);
        }
      });
    });
  }

 // dx = dy / (H * W) over each plane. Needs no saved tensor.
  bool has_cpu_backward() const override { return true; }
  BackwardSaves backward_saves() const override { return {false, false}; }
  std::string lower_backward_source(const LowerContext&) const override { return pool_backward_source(); }
  void cpu_backward(CpuBackwardContext& ctx) const override {
    require_backward_dtype(name(), ctx.grad_output.dtype());
    if (!ctx.wants_input_grad(0)) return;
    const Tensor& x = ctx.inputs[0];
    const std::int64_t hw = x.dim(2) * x.dim(3);
    dispatch_float(ctx.grad_output.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* dy = ctx.grad_output.data<T>();
      T* dx = ctx.grad_inputs[0].data<T>();
      ctx.parallel_for(x.dim(0) * x.dim(1), plane_grain(hw), [&](std::int64_t b, std::int64_t e) {
        for (std::int64_t pl = b; pl < e; ++pl) std::fill(dx + pl * hw, dx + (pl + 1) * hw, dy[pl] / static_cast<T>(hw));
      });
    });
  }
};

// ---- nn.upsample_nearest2d ----

class UpsampleNearest2dOp final : public CustomOp {
 public:
  explicit UpsampleNearest2dOp(Size2 scale) : scale_(scale) {}
  std::string name() const override { return "nn.upsample_nearest2d"; }
  std::string attributes() const override { return "scale=" + size2_text(scale_); }
  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    if (scale_.h <= 0 || scale_.w <= 0)
      throw Error(util::cat("scale factors must be positive integers, got ", scale_.h, "x", scale_.w));
    const Shape& x = in[0];
    require_rank(x, 4, "[N, C, H, W]");
    auto scaled = [](const Dim& d, std::int64_t s) {
      return d.is_dynamic() ? Dim(dynamic) : Dim(d.size() * s);
    };
    return Shape{x[0], x[1], scaled(x[2], scale_.h), scaled(x[3], scale_.w)};
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override { return pool_dtype(in); }
  bool computes_in(DType t) const override { return is_half_float(t); }
  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    // The kernel reads the scale factors from the window's kernel size.
    return pool_lowering(ctx, name(), "kg_upsample_nearest2d", PoolRuntime::Kind::Upsample,
                         Window{scale_, 1, 0, 1, false});
  }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    const std::int64_t h = x.dim(2), w = x.dim(3), ho = ctx.output.dim(2), wo = ctx.output.dim(3);
    const std::int64_t sh = scale_.h, sw = scale_.w;
    // A copy of elements, by their width: the 16-bit dtypes move as they are.
    dispatch_width(dtype_size(x.dtype()), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = static_cast<const T*>(x.raw());
      T* yp = static_cast<T*>(ctx.output.raw());
      ctx.parallel_for(x.dim(0) * x.dim(1), plane_grain(ho * wo), [&](std::int64_t b, std::int64_t e) {
        for (std::int64_t pl = b; pl < e; ++pl) {
          const T* src = xp + pl * h * w;
          T* dst = yp + pl * ho * wo;
          for (std::int64_t iy = 0; iy < h; ++iy) {
            T* first = dst + iy * sh * wo;
            const T* row = src + iy * w;
            for (std::int64_t ix = 0; ix < w; ++ix)
              for (std::int64_t k = 0; k < sw; ++k) first[ix * sw + k] = row[ix];
            for (std::int64_t r = 1; r < sh; ++r) std::copy(first, first + wo, first + r * wo);
          }
        }
      });
    });
  }

 // dx = the sum of dy over the block each input element was copied to. Needs no saved tensor.
  bool has_cpu_backward() const override { return true; }
  BackwardSaves backward_saves() const override { return {false, false}; }
  std::string lower_backward_source(const LowerContext&) const override { return pool_backward_source(); }
  void cpu_backward(CpuBackwardContext& ctx) const override {
    require_backward_dtype(name(), ctx.grad_output.dtype());
    if (!ctx.wants_input_grad(0)) return;
    const Tensor& x = ctx.inputs[0];
    const std::int64_t h = x.dim(2), w = x.dim(3), ho = ctx.grad_output.dim(2), wo = ctx.grad_output.dim(3);
    const std::int64_t sh = scale_.h, sw = scale_.w;
    dispatch_float(ctx.grad_output.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* dyp = ctx.grad_output.data<T>();
      T* dxp = ctx.grad_inputs[0].data<T>();
      ctx.parallel_for(x.dim(0) * x.dim(1), plane_grain(ho * wo), [&](std::int64_t b, std::int64_t e) {
        for (std::int64_t pl = b; pl < e; ++pl) {
          const T* dy = dyp + pl * ho * wo;
          T* dx = dxp + pl * h * w;
          for (std::int64_t iy = 0; iy < h; ++iy) {
            T* row = dx + iy * w;
            std::fill(row, row + w, T(0));
            for (std::int64_t r = 0; r < sh; ++r) {
              const T* src = dy + (iy * sh + r) * wo;
              for (std::int64_t ix = 0; ix < w; ++ix)
                for (std::int64_t k = 0; k < sw; ++k) row[ix] += src[ix * sw + k];
            }
          }
        }
      });
    });
  }

 private:
  Size2 scale_;
};

}  // namespace

std::optional<PoolConfig> pool_config(const CustomOp& op) {
  auto from = [](PoolConfig::Kind kind, const Window& w, bool include_pad) {
    return PoolConfig{kind, w.kernel, w.stride, w.padding, w.dilation, w.ceil_mode, include_pad};
  };
  if (const auto* m = dynamic_cast<const MaxPool2dOp*>(&op)) return from(PoolConfig::Kind::Max, m->window(), false);
  if (const auto* a = dynamic_cast<const AvgPool2dOp*>(&op))
    return from(PoolConfig::Kind::Avg, a->window(), a->count_include_pad());
  if (dynamic_cast<const GlobalAvgPoolOp*>(&op)) return PoolConfig{PoolConfig::Kind::Global};
  return std::nullopt;
}

}  // namespace kg::ops

namespace kg {

SymTensor max_pool2d(const SymTensor& x, Size2 kernel, Size2 stride, Size2 padding, Size2 dilation,
                     bool ceil_mode, const std::string& name) {
  ops::Window w{kernel, ops::default_stride(stride, kernel), padding, dilation, ceil_mode};
  return x.record_custom(CustomData::make<ops::MaxPool2dOp>(w), {}, std::nullopt, name);
}

SymTensor avg_pool2d(const SymTensor& x, Size2 kernel, Size2 stride, Size2 padding, bool ceil_mode,
                     bool count_include_pad, const std::string& name) {
  ops::Window w{kernel, ops::default_stride(stride, kernel), padding, Size2(1), ceil_mode};
  return x.record_custom(CustomData::make<ops::AvgPool2dOp>(w, count_include_pad), {}, std::nullopt, name);
}

SymTensor global_avg_pool(const SymTensor& x, const std::string& name) {
  return x.record_custom(CustomData::make<ops::GlobalAvgPoolOp>(), {}, std::nullopt, name);
}

SymTensor upsample_nearest2d(const SymTensor& x, Size2 scale_factor, const std::string& name) {
  return x.record_custom(CustomData::make<ops::UpsampleNearest2dOp>(scale_factor), {}, std::nullopt, name);
}

}  // namespace kg
