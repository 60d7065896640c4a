// nn.conv2d and nn.fused_conv2d on the CPU.
//
// A convolution is a GEMM per group: out[o, pixel] = sum over taps k = (c, ky, kx) of
// w[o, k] * x[c, the tap's input position for that pixel]. The f32 algorithms (AVX-512) share
// one register-blocked kernel, 8 output channels x 48 pixels, that reads the B operand through
// a per-tap offset table instead of an im2col matrix:
//
// - Direct, in place (stride 1 and "same" width, e.g. 3x3 pad 1 or 1x1): consecutive output
//   pixels read consecutive input floats for every tap, across rows too, so the kernel reads
//   the input itself; per-tile lane masks zero the taps that fall into the padding.
// - Direct, transformed (strided, or not "same" width): each band of output rows gets its
//   input rewritten, zero-padded and split into stride phases, so that the same holds on rows
//   of the padded width; the few columns past the output width are computed and dropped.
// - Packed (many channels on small images, where those dropped columns or partial tiles would
//   waste more than a gather costs): blocks of output pixels spanning images are gathered into
//   an im2col block first.
//
// The other dtypes and builds use Gemm (im2col tiles and the BLAS GEMM, f64 or f32 without
// AVX-512), and grouped convolutions with at most four output channels per group (depthwise)
// a direct loop per output plane. Every algorithm applies the epilogue (bias, folded
// BatchNorm, residual add, activation) to each block of results while it is in cache, and
// splits the work over the runtime's threads: (image, group, block of pixels) items for the
// f32 kernel, with the next item's input prefetched while the current one computes.
//
// A convolution in f16 or bf16 (inference only) runs the f32 algorithms on f32 copies of its
// input and parameters and rounds the result once (cpu_forward_in_f32).
#include "ops/conv.hpp"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>

// The AVX-512 kernels are compiled for AVX-512F whatever the build's -march and chosen at run
// time when the CPU has it (util/cpu.hpp).
#include "util/cpu.hpp"
#define KG_CONV_AVX512 KG_HAVE_AVX512_PATHS

#include "ops/blas.hpp"
#include "ops/conv_gpu.hpp"
#include "ops/op_util.hpp"

namespace kg::ops {
namespace {

// ---- geometry ----

struct ConvGeom {
  std::int64_t n = 0, c = 0, h = 0, w = 0;  // input
  std::int64_t o = 0, kh = 0, kw = 0;       // output channels, kernel
  std::int64_t sh = 1, sw = 1, ph = 0, pw = 0, dh = 1, dw = 1, groups = 1;
  std::int64_t ho = 0, wo = 0;  // output

  std::int64_t cg() const { return c / groups; }
  std::int64_t og() const { return o / groups; }
  std::int64_t kdim() const { return cg() * kh * kw; }  // GEMM depth per group
  std::int64_t pixels() const { return ho * wo; }
  // The input of a 1x1 stride-1 unpadded convolution is already the [C, H*W] GEMM operand.
  bool pointwise() const { return kh == 1 && kw == 1 && sh == 1 && sw == 1 && ph == 0 && pw == 0; }
};

// Per-channel affine, residual and activation applied after the convolution.
template <class T>
struct Epilogue {
  const T* scale = nullptr;     // [O]; null: 1
  const T* shift = nullptr;     // [O]; null: 0
  const T* residual = nullptr;  // laid out like the output; null: none
  std::optional<UnarySpec> act;
  const ElementwiseForm* form = nullptr;  // an activation given by its CPU form, applied last
};

// dst[j] = epilogue(src[j]) for output channel `o` over n consecutive pixels; `res` is the
// residual at dst's position (or null). src may be dst.
template <class T>
void epilogue_row(const Epilogue<T>& ep, std::int64_t o, std::int64_t n, const T* src, T* dst, const T* res) {
  const T s = ep.scale ? ep.scale[o] : T(1);
  const T t = ep.shift ? ep.shift[o] : T(0);
  const bool relu = ep.act && ep.act->fn == UnaryFn::Relu;
  if (res && relu) {
    for (std::int64_t j = 0; j < n; ++j) {
      const T v = src[j] * s + t + res[j];
      dst[j] = v < T(0) ? T(0) : v;
    }
  } else if (res) {
    for (std::int64_t j = 0; j < n; ++j) dst[j] = src[j] * s + t + res[j];
  } else if (relu) {
    for (std::int64_t j = 0; j < n; ++j) {
      const T v = src[j] * s + t;
      dst[j] = v < T(0) ? T(0) : v;
    }
  } else if (ep.scale || ep.shift || src != dst) {
    for (std::int64_t j = 0; j < n; ++j) dst[j] = src[j] * s + t;
  }
  if (ep.act && !relu) apply_unary<T>(*ep.act, dst, dst, n);
  if (ep.form) {
    const void* in[1] = {dst};
    ep.form->cpu(ElementwiseSpan{std::is_same_v<T, double> ? DType::F64 : DType::F32, in, nullptr, dst, n, 0});
  }
}

using util::cpu_has_avx512f;

#if KG_CONV_AVX512
KG_AVX512_BEGIN
// Lanes [lo, hi) of a 16-lane mask (empty when hi <= lo); lo, hi in [0, 16].
inline __mmask16 lane_range(std::int64_t lo, std::int64_t hi) {
  if (hi <= lo) return 0;
  const unsigned upto = hi >= 16 ? 0xFFFFu : (1u << hi) - 1u;
  return static_cast<__mmask16>(upto & ~((1u << lo) - 1u));
}

// 16 floats starting `at` elements from `base`; only the lanes of `m` are read, so `at` may
// lie outside the row where those lanes are masked off.
inline __m512 load_lanes(const float* base, std::int64_t at, __mmask16 m) {
  const auto addr = reinterpret_cast<std::uintptr_t>(base) + static_cast<std::uintptr_t>(at) * sizeof(float);
  return _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(addr));
}

// gather_row for f32 with stride 1 or 2, vectorised with masked loads; false for other strides.
inline bool gather_row_avx(const float* row, std::int64_t w, std::int64_t ix0, std::int64_t sw,
                           std::int64_t n, float* d) {
  if (sw > 2) return false;
  // Stride 2: the even lanes of 32 consecutive values.
  const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  for (std::int64_t j = 0; j < n; j += 16) {
    const __mmask16 out = lane_range(0, std::min<std::int64_t>(16, n - j));
    __m512 v = _mm512_setzero_ps();
    if (row) {
      const std::int64_t s = ix0 + j * sw;  // source index of lane 0
      if (sw == 1) {
        v = load_lanes(
            row, s,
            out & lane_range(std::clamp<std::int64_t>(-s, 0, 16), std::clamp<std::int64_t>(w - s, 0, 16)));
      } else {
        const __m512 lo = load_lanes(
            row, s, lane_range(std::clamp<std::int64_t>(-s, 0, 16), std::clamp<std::int64_t>(w - s, 0, 16)));
        const __m512 hi = load_lanes(row, s + 16,
                                     lane_range(std::clamp<std::int64_t>(-s - 16, 0, 16),
                                                std::clamp<std::int64_t>(w - s - 16, 0, 16)));
        v = _mm512_permutex2var_ps(lo, evens, hi);
      }
    }
    _mm512_mask_storeu_ps(d + j, out, v);
  }
  return true;
}
KG_AVX512_END
#endif

// d[j] = row[ix0 + j * sw] for j in [0, n), 0 where the index falls outside [0, w) or when
// `row` is null (a padding row).
template <class T>
void gather_row(const T* row, std::int64_t w, std::int64_t ix0, std::int64_t sw, std::int64_t n, T* d) {
#if KG_CONV_AVX512
  if constexpr (std::is_same_v<T, float>)
    if (cpu_has_avx512f() && gather_row_avx(row, w, ix0, sw, n, d)) return;
#endif
  if (!row) {
    std::fill(d, d + n, T(0));
    return;
  }
  // Columns j in [lo, hi) read inside the row.
  std::int64_t lo = ix0 >= 0 ? 0 : (-ix0 + sw - 1) / sw;
  std::int64_t hi = ix0 >= w ? 0 : (w - ix0 + sw - 1) / sw;
  lo = std::min(lo, n);
  hi = std::clamp(hi, lo, n);
  std::fill(d, d + lo, T(0));
  if (sw == 1) {
    std::memcpy(d + lo, row + ix0 + lo, static_cast<std::size_t>(hi - lo) * sizeof(T));
  } else {
    const T* src = row + ix0;
    for (std::int64_t j = lo; j < hi; ++j) d[j] = src[j * sw];
  }
  std::fill(d + hi, d + n, T(0));
}

// A run of output pixels that are consecutive both in a column block and in the output:
// block columns [col, col + len) are pixels [pix, pix + len) of output row `oy` of image `img`,
// starting at column `ox`.
struct Run {
  std::int64_t col, len, img, oy, ox;
};

// The runs of output pixels [q0, q0 + n) in image-major order (pixel q is image q / (ho * wo)).
void pixel_runs(const ConvGeom& g, std::int64_t q0, std::int64_t n, std::vector<Run>& runs) {
  runs.clear();
  const std::int64_t p = g.pixels();
  for (std::int64_t j = 0; j < n;) {
    const std::int64_t q = q0 + j, img = q / p, pix = q % p, oy = pix / g.wo, ox = pix % g.wo;
    const std::int64_t len = std::min(g.wo - ox, n - j);
    runs.push_back({j, len, img, oy, ox});
    j += len;
  }
}

// col[k * ld + j] for the taps k in [k0, k0 + kn) of the group starting at input channel c0,
// over the pixels of `runs`: the input value under the tap, 0 in the padding.
template <class T>
void im2col_runs(const ConvGeom& g, const T* x, std::int64_t c0, std::int64_t k0, std::int64_t kn,
                 const std::vector<Run>& runs, T* col, std::int64_t ld) {
  std::int64_t c = k0 / (g.kh * g.kw), ky = k0 / g.kw % g.kh, kx = k0 % g.kw;
  for (std::int64_t k = 0; k < kn; ++k) {
    T* dst = col + k * ld;
    for (const Run& r : runs) {
      const std::int64_t iy = r.oy * g.sh - g.ph + ky * g.dh;
      const T* row = iy < 0 || iy >= g.h ? nullptr : x + ((r.img * g.c + c0 + c) * g.h + iy) * g.w;
      gather_row(row, g.w, r.ox * g.sw - g.pw + kx * g.dw, g.sw, r.len, dst + r.col);
    }
    if (++kx == g.kw) {
      kx = 0;
      if (++ky == g.kh) {
        ky = 0;
        ++c;
      }
    }
  }
}

// Writes the block's results (rows of `cbuf`, `ldc` apart, one per output channel of group
// `grp`; those in [m0, m1) when given) to the output through the epilogue.
template <class T>
void store_runs(const ConvGeom& g, const Epilogue<T>& ep, std::int64_t grp, const std::vector<Run>& runs,
                const T* cbuf, std::int64_t ldc, T* y, std::int64_t m0 = 0, std::int64_t m1 = -1) {
  const std::int64_t og = g.og(), p = g.pixels();
  if (m1 < 0 || m1 > og) m1 = og;
  for (std::int64_t m = m0; m < m1; ++m) {
    const std::int64_t o = grp * og + m;
    for (const Run& r : runs) {
      const std::int64_t at = (r.img * g.o + o) * p + r.oy * g.wo + r.ox;
      epilogue_row(ep, o, r.len, cbuf + m * ldc + r.col, y + at, ep.residual ? ep.residual + at : nullptr);
    }
  }
}

// Per-thread scratch buffers that keep their size between calls. A worker uses kResults,
// kOperand and kInput; the thread that starts a convolution fills kWeights, which the workers
// read during the call.
enum Scratch { kResults, kOperand, kInput, kWeights, kScratchCount };

template <class T>
T* scratch_data(Scratch slot, std::int64_t n) {
  thread_local std::vector<T> bufs[kScratchCount];
  auto& v = bufs[slot];
  if (v.size() < static_cast<std::size_t>(n)) v.resize(static_cast<std::size_t>(n));
  return v.data();
}

// ---- Gemm: im2col tiles and the BLAS GEMM ----

// OpenBLAS threads each GEMM itself; while tiles run on the runtime's threads, every GEMM must
// run on its calling thread, so the library is set to one thread for the duration.
class BlasSingleThreaded {
 public:
  BlasSingleThreaded() {
    std::lock_guard<std::mutex> lk(mu());
    if (depth()++ == 0) {
      saved() = openblas_get_num_threads();
      if (saved() != 1) openblas_set_num_threads(1);
    }
  }
  ~BlasSingleThreaded() {
    std::lock_guard<std::mutex> lk(mu());
    if (--depth() == 0 && saved() != 1) openblas_set_num_threads(saved());
  }
  BlasSingleThreaded(const BlasSingleThreaded&) = delete;
  BlasSingleThreaded& operator=(const BlasSingleThreaded&) = delete;

 private:
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static int& depth() {
    static int d = 0;
    return d;
  }
  static int& saved() {
    static int s = 1;
    return s;
  }
};

// Output pixels per tile: the tile's im2col buffer stays within about half the L2 cache.
std::int64_t gemm_tile_pixels(const ConvGeom& g, std::size_t elem) {
  const std::int64_t p = g.pixels();
  if (g.pointwise()) return std::min<std::int64_t>(p, 512);
  const auto budget = static_cast<std::int64_t>((384 * 1024) / elem);
  std::int64_t nt = budget / std::max<std::int64_t>(g.kdim(), 1);
  nt = std::max<std::int64_t>(nt / 16 * 16, 64);
  if (nt >= p) return p;
  const std::int64_t tiles = (p + nt - 1) / nt;  // even tiles
  return (p + tiles - 1) / tiles;
}

template <class T>
void conv_gemm(const ConvGeom& g, const T* x, const T* w, const Epilogue<T>& ep, T* y,
               const CpuContext& ctx) {
  const std::int64_t m = g.og(), k = g.kdim(), p = g.pixels();
  const std::int64_t nt = gemm_tile_pixels(g, sizeof(T));
  const std::int64_t tiles = (p + nt - 1) / nt;
  const std::int64_t items = g.n * g.groups * tiles;
  auto run = [&](std::int64_t b, std::int64_t e) {
    std::vector<Run> runs;
    for (std::int64_t it = b; it < e; ++it) {
      const std::int64_t img = it / (g.groups * tiles), grp = it / tiles % g.groups, t = it % tiles;
      const std::int64_t p0 = t * nt, cnt = std::min(nt, p - p0);
      const std::int64_t out_off = (img * g.o + grp * m) * p + p0;
      const T* bmat = x + (img * g.c + grp * g.cg()) * g.h * g.w + p0;
      std::int64_t ldb = p;
      if (!g.pointwise()) {
        pixel_runs(g, img * p + p0, cnt, runs);
        T* col = scratch_data<T>(kOperand, k * cnt);
        im2col_runs(g, x, grp * g.cg(), 0, k, runs, col, cnt);
        bmat = col;
        ldb = cnt;
      }
      gemm(false, false, m, cnt, k, T(1), w + grp * m * k, k, bmat, ldb, T(0), y + out_off, p);
      for (std::int64_t r = 0; r < m; ++r) {
        T* row = y + out_off + r * p;
        epilogue_row(ep, grp * m + r, cnt, row, row, ep.residual ? ep.residual + out_off + r * p : nullptr);
      }
    }
  };
  if (items == 1) {
    run(0, 1);  // one GEMM: the BLAS library threads it
    return;
  }
  BlasSingleThreaded single;
  ctx.parallel_for(items, 1, run);
}

// ---- Depthwise: a direct loop per output plane ----

template <class T>
void conv_depthwise(const ConvGeom& g, const T* x, const T* w, const Epilogue<T>& ep, T* y,
                    const CpuContext& ctx) {
  const std::int64_t og = g.og(), cg = g.cg(), planes = g.n * g.o, p = g.pixels();
  ctx.parallel_for(planes, std::max<std::int64_t>(1, 4096 / std::max<std::int64_t>(p * cg * g.kh * g.kw, 1)),
                   [&](std::int64_t b, std::int64_t e) {
                     std::vector<T> acc(static_cast<std::size_t>(g.wo));
                     for (std::int64_t pl = b; pl < e; ++pl) {
                       const std::int64_t img = pl / g.o, oc = pl % g.o, grp = oc / og;
                       const T* xin = x + (img * g.c + grp * cg) * g.h * g.w;
                       const T* wk = w + oc * cg * g.kh * g.kw;
                       T* out = y + pl * p;
                       for (std::int64_t oy = 0; oy < g.ho; ++oy) {
                         std::fill(acc.begin(), acc.end(), T(0));
                         for (std::int64_t c = 0; c < cg; ++c)
                           for (std::int64_t ky = 0; ky < g.kh; ++ky) {
                             const std::int64_t iy = oy * g.sh - g.ph + ky * g.dh;
                             if (iy < 0 || iy >= g.h) continue;
                             const T* row = xin + (c * g.h + iy) * g.w;
                             for (std::int64_t kx = 0; kx < g.kw; ++kx) {
                               const T wv = wk[(c * g.kh + ky) * g.kw + kx];
                               // Output columns whose tap lies inside the row.
                               const std::int64_t ix0 = kx * g.dw - g.pw;
                               const std::int64_t lo = ix0 >= 0 ? 0 : (-ix0 + g.sw - 1) / g.sw;
                               const std::int64_t hi =
                                   std::min(g.wo, ix0 >= g.w ? 0 : (g.w - ix0 + g.sw - 1) / g.sw);
                               for (std::int64_t ox = lo; ox < hi; ++ox)
                                 acc[static_cast<std::size_t>(ox)] += wv * row[ox * g.sw + ix0];
                             }
                           }
                         std::copy(acc.begin(), acc.end(), out + oy * g.wo);
                       }
                       epilogue_row(ep, oc, p, out, out, ep.residual ? ep.residual + pl * p : nullptr);
                     }
                   });
}

// ---- Direct and Packed: the AVX-512 single-precision kernel ----

#if KG_CONV_AVX512
KG_AVX512_BEGIN
namespace avx {

constexpr std::int64_t kMR = 8;     // output channels per kernel call
constexpr std::int64_t kNR = 48;    // columns per kernel call (three vectors)
constexpr std::int64_t kKC = 1280;  // most taps per block

// Lanes to load per kernel tap, for a tile whose columns map to input positions that wrap
// around rows or reach into the padding: m[t * 3 + v] holds the lanes of vector v that tap t
// (within a channel: ky * kw + kx) may read; the pattern repeats every `period` taps.
struct TapMasks {
  const __mmask16* m;
  std::int64_t period;
  std::int64_t t0;  // the tap of the kernel call's first k
};

// How the kernel loads B. A masked load (vmovups with a mask) in the kernel's loop runs at a
// third of the speed of a plain load followed by a register blend on this AVX-512 hardware, so
// masks are applied by blending wherever the plain load is known to stay inside the buffer.
enum class BLoad {
  Plain,    // every lane is readable (a packed block, the padded transformed band); lanes past
            // the tile's columns are junk and never stored
  Blend,    // plain loads, then the tap's lanes (TapMasks) are kept and the others zeroed
  Guarded,  // masked loads: the tile reads next to the ends of the input tensor
};

// c[i * ldc + j] (+)= sum over k < kc of A[i][k] * b[off[k] + j] for i < kMR and j < 16 * NV.
// A is read in place, A[i][k] = rows[i][k], or from a packed panel, A[i][k] = rows[0][k * kMR +
// i] (PackedA: one contiguous stream instead of kMR).
template <int NV, BLoad Load, bool PackedA>
inline void kernel(std::int64_t kc, const float* const* rows, const float* __restrict b,
                   const std::int64_t* __restrict off, const TapMasks* tm, float* __restrict c,
                   std::int64_t ldc, bool accumulate) {
  __m512 acc[kMR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < kMR; ++i)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v)
      acc[i][v] = accumulate ? _mm512_loadu_ps(c + i * ldc + 16 * v) : _mm512_setzero_ps();
  const float* ar[kMR];
#pragma GCC unroll 8
  for (int i = 0; i < kMR; ++i) ar[i] = rows[i];
  constexpr bool masked = Load != BLoad::Plain;
  std::int64_t t = masked ? tm->t0 : 0;
  const __mmask16* mt = masked ? tm->m + t * 3 : nullptr;
  for (std::int64_t k = 0; k < kc; ++k) {
    const float* bk = b + off[k];
    __m512 bv[NV];
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) {
      if constexpr (Load == BLoad::Guarded) {
        bv[v] = _mm512_maskz_loadu_ps(mt[v], bk + 16 * v);
      } else {
        bv[v] = _mm512_loadu_ps(bk + 16 * v);
        // The empty asm keeps the compiler from folding the load and the blend back into a
        // masked load.
        if constexpr (Load == BLoad::Blend) {
          asm("" : "+v"(bv[v]));
          bv[v] = _mm512_maskz_mov_ps(mt[v], bv[v]);
        }
      }
    }
    if constexpr (masked) {
      if (++t == tm->period) {
        t = 0;
        mt = tm->m;
      } else {
        mt += 3;
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < kMR; ++i) {
      __m512 ai = _mm512_set1_ps(PackedA ? ar[0][k * kMR + i] : ar[i][k]);
      // A broadcast in a register, used by NV multiply-adds, is faster here than NV
      // multiply-adds with an embedded broadcast operand, which the compiler would otherwise pick.
      asm("" : "+v"(ai));
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(ai, bv[v], acc[i][v]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < kMR; ++i)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + i * ldc + 16 * v, acc[i][v]);
}

// The taps in equal blocks of at most kKC: a block goes through the kernel for every column
// tile before the next block, so that its B rows stay in cache.
struct TapBlocks {
  std::int64_t size;
  explicit TapBlocks(std::int64_t k) {
    const std::int64_t count = (k + kKC - 1) / kKC;
    size = (k + count - 1) / count;
  }
};

using PackFn = std::function<void(std::int64_t k0, std::int64_t kn, float* dst, std::int64_t ld)>;

// Memory that the next work item will read, brought into L2 a little at a time while the
// current one computes, so that its loads do not wait for DRAM.
class Prefetch {
 public:
  void clear() {
    ranges_.clear();
    lines_ = 0;
  }
  void add(const float* p, std::int64_t floats) {
    if (floats <= 0) return;
    const auto* b = reinterpret_cast<const char*>(p);
    ranges_.push_back({b, b + floats * static_cast<std::int64_t>(sizeof(float))});
    lines_ += floats * static_cast<std::int64_t>(sizeof(float)) / 64 + 1;
  }
  // Spreads the lines over `steps` calls of step().
  void plan(std::int64_t steps) {
    per_step_ = lines_ / std::max<std::int64_t>(steps, 1) + 1;
    range_ = 0;
    at_ = ranges_.empty() ? nullptr : ranges_[0].first;
  }
  void step() {
    for (std::int64_t i = 0; i < per_step_ && range_ < ranges_.size(); ++i) {
      _mm_prefetch(at_, _MM_HINT_T1);
      at_ += 64;
      if (at_ >= ranges_[range_].second && ++range_ < ranges_.size()) at_ = ranges_[range_].first;
    }
  }

 private:
  std::vector<std::pair<const char*, const char*>> ranges_;
  std::int64_t lines_ = 0, per_step_ = 0;
  std::size_t range_ = 0;
  const char* at_ = nullptr;
};

// The weights as panels of kMR output channels, for PackedA: ap[((grp * panels + panel) * K +
// k) * kMR + i] = w[grp * og + panel * kMR + i, k], repeating the group's last channel past og.
// Worth its copy when several images share it.
void pack_weights(const ConvGeom& g, const float* w, float* ap, const CpuContext& ctx) {
  const std::int64_t og = g.og(), k = g.kdim(), panels = (og + kMR - 1) / kMR;
  ctx.parallel_for(g.groups * panels, 1, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t it = b; it < e; ++it) {
      const std::int64_t grp = it / panels, m0 = it % panels * kMR;
      float* dst = ap + it * k * kMR;
      for (std::int64_t i = 0; i < kMR; ++i) {
        const float* src = w + (grp * og + std::min(m0 + i, og - 1)) * k;
        for (std::int64_t kk = 0; kk < k; ++kk) dst[kk * kMR + i] = src[kk];
      }
    }
  });
}

// The packed weights when at least four blocks share them (else null: A is read in place).
const float* packed_weights(const ConvGeom& g, const float* w, std::int64_t blocks, const CpuContext& ctx) {
  if (blocks < 4) return nullptr;
  float* ap = scratch_data<float>(kWeights, g.groups * (g.og() + kMR - 1) / kMR * kMR * g.kdim());
  pack_weights(g, w, ap, ctx);
  return ap;
}

// One column block of one group: C[og, n] = W_grp · B, where B's column j of tap k is
// b[off[k] + j] (`off` covers all taps) or, with `pack`, is gathered per tap block by pack(k0,
// kn, dst, ld) into a scratch block first. `wg` is the group's weight [og, K] and `packed_a`,
// when not null, the same packed by pack_weights (the group's panels). Results go to
// `cbuf`, row m at cbuf + m * ldc, in panels of kMR rows (rows past og hold junk); only the
// panels [p0, p1) are computed when given.
void block_gemm(const ConvGeom& g, const float* wg, const float* packed_a, const float* b,
                const std::int64_t* off, std::int64_t n, const PackFn* pack, float* cbuf, std::int64_t ldc,
                Prefetch* pf = nullptr, const __mmask16* tile_masks = nullptr, bool guarded = false,
                std::int64_t p0 = 0, std::int64_t p1 = -1) {
  const std::int64_t period = g.kh * g.kw;
  const std::int64_t k = g.kdim(), og = g.og(), panels = (og + kMR - 1) / kMR;
  if (p1 < 0 || p1 > panels) p1 = panels;
  const TapBlocks tb(k);
  if (pf) pf->plan((k + tb.size - 1) / tb.size * ((n + kNR - 1) / kNR) * (p1 - p0));
  const std::int64_t ldb = (n + 15) / 16 * 16;
  float* bblock = pack ? scratch_data<float>(kOperand, tb.size * ldb) : nullptr;
  std::int64_t poff[kKC];
  if (pack)
    for (std::int64_t kk = 0; kk < tb.size; ++kk) poff[kk] = kk * ldb;
  const float* rows[kMR];
  for (std::int64_t k0 = 0; k0 < k; k0 += tb.size) {
    const std::int64_t kn = std::min(tb.size, k - k0);
    const float* bb = b;
    const std::int64_t* ob = off + k0;
    if (pack) {
      (*pack)(k0, kn, bblock, ldb);
      // The columns past n are read (BLoad::Plain) but never stored: zeros keep them finite.
      for (std::int64_t kk = 0; kk < kn; ++kk)
        std::fill(bblock + kk * ldb + n, bblock + (kk + 1) * ldb, 0.0f);
      bb = bblock;
      ob = poff;
    }
    // Column tiles outside, channel panels inside: a tile's B rows (kn x 48) stay in L1 while
    // every panel's weights stream past.
    for (std::int64_t j = 0; j < n; j += kNR) {
      const std::int64_t cols = std::min(kNR, n - j);
      const int nv = static_cast<int>((cols + 15) / 16);
      for (std::int64_t pnl = p0; pnl < p1; ++pnl) {
        // Rows past the group's channels repeat its last channel.
        if (packed_a)
          rows[0] = packed_a + (pnl * k + k0) * kMR;
        else
          for (std::int64_t i = 0; i < kMR; ++i) rows[i] = wg + std::min(pnl * kMR + i, og - 1) * k + k0;
        float* c = cbuf + pnl * kMR * ldc + j;
        const TapMasks tm{tile_masks ? tile_masks + j / kNR * period * 3 : nullptr, period, k0 % period};
        auto run = [&]<BLoad Load, bool Packed>() {
          if (nv == 3)
            kernel<3, Load, Packed>(kn, rows, bb + j, ob, &tm, c, ldc, k0 > 0);
          else if (nv == 2)
            kernel<2, Load, Packed>(kn, rows, bb + j, ob, &tm, c, ldc, k0 > 0);
          else
            kernel<1, Load, Packed>(kn, rows, bb + j, ob, &tm, c, ldc, k0 > 0);
        };
        if (!tile_masks)
          packed_a ? run.template operator()<BLoad::Plain, true>()
                   : run.template operator()<BLoad::Plain, false>();
        else if (!guarded)
          packed_a ? run.template operator()<BLoad::Blend, true>()
                   : run.template operator()<BLoad::Blend, false>();
        else
          packed_a ? run.template operator()<BLoad::Guarded, true>()
                   : run.template operator()<BLoad::Guarded, false>();
        if (pf) pf->step();
      }
    }
  }
}

// Work items per (image, group, block of pixels): the group's channel panels are split into
// this many chunks when there are too few blocks to keep every thread busy (small batches).
std::int64_t channel_chunks(const ConvGeom& g, std::int64_t items) {
  constexpr std::int64_t kWanted = 8;
  const std::int64_t panels = (g.og() + kMR - 1) / kMR;
  return std::clamp<std::int64_t>((kWanted + items - 1) / std::max<std::int64_t>(items, 1), 1, panels);
}

// The panels [p0, p1) of chunk `c` out of `chunks`.
std::pair<std::int64_t, std::int64_t> chunk_panels(const ConvGeom& g, std::int64_t c, std::int64_t chunks) {
  const std::int64_t panels = (g.og() + kMR - 1) / kMR;
  return {c * panels / chunks, (c + 1) * panels / chunks};
}

// Columns per block: the block's results (all the group's channels) stay within 256 KiB.
std::int64_t block_columns(const ConvGeom& g, std::int64_t total) {
  const std::int64_t rows = (g.og() + kMR - 1) / kMR * kMR;
  const std::int64_t most = std::clamp<std::int64_t>(65536 / rows / kNR * kNR, kNR, 32 * kNR);
  const std::int64_t blocks = (total + most - 1) / most;
  return std::min(most, ((total + blocks - 1) / blocks + 15) / 16 * 16);
}

// The Direct layout of a band of output rows [oy0, oy0 + rows), for the convolutions that
// in_place() does not take: the group's input as [C/groups][phase][hb][wq], zero-padded, where
// phase (py, px) holds the padded input's rows py + sh * (oy0 + r) and columns px, px + sw, ...
// for r < hb. Output pixel (oy0 + i, ox) of tap (ky, kx) is then at
// ((c * phases + phase) * hb + i + ky*dh / sh) * wq + ox + kx*dw / sw: consecutive output
// columns read consecutive floats. Rows are computed on the full width wq; the wq - wo columns
// past the output width are dropped. Only the phases some tap reads are stored (a 1x1 stride-2
// convolution reads one).
struct DirectLayout {
  std::vector<std::int64_t> phase_index;                      // py * sw + px -> stored phase, or -1
  std::vector<std::pair<std::int64_t, std::int64_t>> phases;  // stored phases as (py, px)
  std::int64_t wq = 0;
  std::int64_t band_rows = 0;  // output rows per band
  std::int64_t hb = 0;         // stored rows per band and phase
  std::int64_t floats = 0;     // per band, with slack for the last row's reads

  DirectLayout(const ConvGeom& g, std::int64_t columns) {
    wq = (g.w + 2 * g.pw + g.sw - 1) / g.sw;
    // As many rows as fit the block's columns, spread evenly over the bands.
    const std::int64_t most = std::clamp<std::int64_t>(columns / wq, 1, g.ho);
    const std::int64_t nbands = (g.ho + most - 1) / most;
    band_rows = (g.ho + nbands - 1) / nbands;
    phase_index.assign(static_cast<std::size_t>(g.sh * g.sw), -1);
    for (std::int64_t ky = 0; ky < g.kh; ++ky)
      for (std::int64_t kx = 0; kx < g.kw; ++kx) {
        const std::int64_t py = ky * g.dh % g.sh, px = kx * g.dw % g.sw;
        auto& idx = phase_index[static_cast<std::size_t>(py * g.sw + px)];
        if (idx < 0) {
          idx = static_cast<std::int64_t>(phases.size());
          phases.emplace_back(py, px);
        }
      }
    hb = band_rows + (g.kh - 1) * g.dh / g.sh;
    floats = g.cg() * count() * hb * wq + wq + 16;
  }
  std::int64_t count() const { return static_cast<std::int64_t>(phases.size()); }
  std::int64_t bands(const ConvGeom& g) const { return (g.ho + band_rows - 1) / band_rows; }
};

// 16 floats of `row` from index s: plain loads inside the row, masked ones at its ends.
inline __m512 row_vector(const float* row, std::int64_t w, std::int64_t s) {
  if (s >= 0 && s + 16 <= w) return _mm512_loadu_ps(row + s);
  return load_lanes(row, s,
                    lane_range(std::clamp<std::int64_t>(-s, 0, 16), std::clamp<std::int64_t>(w - s, 0, 16)));
}

// d0[j] = row[s0 + 2j] and d1[j] = row[s0 + 2j + 1] for j < n (0 outside [0, w), or when `row`
// is null): both stride-2 column phases of a row from one pass over it; d1 may be null.
inline void deinterleave_row(const float* row, std::int64_t w, std::int64_t s0, std::int64_t n, float* d0,
                             float* d1) {
  const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odds = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (std::int64_t j = 0; j < n; j += 16) {
    const __mmask16 out = lane_range(0, std::min<std::int64_t>(16, n - j));
    __m512 lo = _mm512_setzero_ps(), hi = lo;
    if (row) {
      lo = row_vector(row, w, s0 + 2 * j);
      hi = row_vector(row, w, s0 + 2 * j + 16);
    }
    _mm512_mask_storeu_ps(d0 + j, out, _mm512_permutex2var_ps(lo, evens, hi));
    if (d1) _mm512_mask_storeu_ps(d1 + j, out, _mm512_permutex2var_ps(lo, odds, hi));
  }
}

// The input rows [iy0, iy1) that the band starting at output row oy0 reads.
std::pair<std::int64_t, std::int64_t> band_input_rows(const ConvGeom& g, const DirectLayout& L,
                                                      std::int64_t oy0) {
  const std::int64_t iy0 = std::clamp<std::int64_t>(oy0 * g.sh - g.ph, 0, g.h);
  return {iy0, std::clamp<std::int64_t>((oy0 + L.hb) * g.sh - g.ph, iy0, g.h)};
}

// Fills the band starting at output row oy0 from the group's input `x` ([C/groups, H, W]).
void transform_band(const ConvGeom& g, const DirectLayout& L, const float* x, std::int64_t oy0, float* xt) {
  const std::int64_t plane = L.hb * L.wq;
  for (std::int64_t c = 0; c < g.cg(); ++c) {
    for (std::int64_t py = 0; py < g.sh; ++py)
      for (std::int64_t px = 0; px < g.sw; ++px) {
        const std::int64_t f = L.phase_index[static_cast<std::size_t>(py * g.sw + px)];
        if (f < 0) continue;
        float* dst = xt + (c * L.count() + f) * plane;
        // Stride 2: phase px = 1 is written along with px = 0 when both are stored.
        const std::int64_t f1 =
            g.sw == 2 && px == 0 ? L.phase_index[static_cast<std::size_t>(py * 2 + 1)] : -1;
        if (g.sw == 2 && px == 1 && L.phase_index[static_cast<std::size_t>(py * 2)] >= 0) continue;
        for (std::int64_t r = 0; r < L.hb; ++r) {
          const std::int64_t iy = (oy0 + r) * g.sh + py - g.ph;
          const float* row = iy < 0 || iy >= g.h ? nullptr : x + (c * g.h + iy) * g.w;
          if (g.sw == 2)
            deinterleave_row(row, g.w, px - g.pw, L.wq, dst + r * L.wq,
                             f1 >= 0 ? xt + (c * L.count() + f1) * plane + r * L.wq : nullptr);
          else
            gather_row(row, g.w, px - g.pw, g.sw, L.wq, dst + r * L.wq);
        }
      }
  }
  std::fill(xt + g.cg() * L.count() * plane, xt + L.floats, 0.0f);
}

// Direct in place, for stride-1 convolutions whose output rows are as wide as the input's
// ("same" horizontal padding): output pixel p of tap (c, ky, kx) reads input float
// p + c*H*W + (ky*dh - ph)*W + (kx*dw - pw), so consecutive pixels read consecutive floats,
// across rows too. The lanes whose tap falls in the padding (or wraps to a neighbouring row)
// are masked off per tile; nothing is copied and no column is dropped.
bool in_place(const ConvGeom& g) { return g.sh == 1 && g.sw == 1 && 2 * g.pw == (g.kw - 1) * g.dw; }

// The tap masks of block `blk` (of `nc` pixels) for convolutions of g's geometry, kept per
// thread across calls: they depend on the geometry alone, and computing them costs more than a
// small convolution itself. `fresh` is set when the returned masks (of `size` entries) still
// have to be filled. A few hundred geometries and blocks at most are kept.
std::vector<__mmask16>& tap_masks_cached(const ConvGeom& g, std::int64_t nc, std::int64_t blk, std::size_t size,
                                         bool& fresh) {
  using Key = std::array<std::int64_t, 12>;
  thread_local std::map<Key, std::vector<__mmask16>> cache;
  const Key key{g.h, g.w, g.ho, g.wo, g.kh, g.kw, g.dh, g.dw, g.ph, g.pw, nc, blk};
  if (auto it = cache.find(key); it != cache.end() && it->second.size() == size) {
    fresh = false;
    return it->second;
  }
  if (cache.size() >= 512) cache.clear();
  auto& m = cache[key];
  m.assign(size, 0);
  fresh = true;
  return m;
}

void conv_in_place(const ConvGeom& g, const float* x, const float* w, const Epilogue<float>& ep, float* y,
                   const CpuContext& ctx) {
  const std::int64_t cg = g.cg(), k = g.kdim(), taps = g.kh * g.kw, p = g.pixels(), plane = g.h * g.w;
  std::vector<std::int64_t> off(static_cast<std::size_t>(k));
  for (std::int64_t c = 0, t = 0; c < cg; ++c)
    for (std::int64_t ky = 0; ky < g.kh; ++ky)
      for (std::int64_t kx = 0; kx < g.kw; ++kx, ++t)
        off[static_cast<std::size_t>(t)] = c * plane + (ky * g.dh - g.ph) * g.w + kx * g.dw - g.pw;
  const std::int64_t off_lo = *std::min_element(off.begin(), off.end());
  const std::int64_t off_hi = *std::max_element(off.begin(), off.end());
  const float* x_end = x + g.n * g.c * plane;
  const std::int64_t nc = block_columns(g, p), blocks = (p + nc - 1) / nc;
  const std::int64_t ldc = (nc + 15) / 16 * 16;
  const std::int64_t cbuf_floats = (g.og() + kMR - 1) / kMR * kMR * ldc;
  const std::int64_t tiles = (nc + kNR - 1) / kNR;
  const std::int64_t panels = (g.og() + kMR - 1) / kMR;
  const float* ap = packed_weights(g, w, g.n * g.groups * blocks, ctx);
  const std::int64_t chunks = channel_chunks(g, g.n * g.groups * blocks);
  ctx.parallel_for(g.n * g.groups * blocks * chunks, 1, [&](std::int64_t b, std::int64_t e) {
    std::vector<Run> runs;
    Prefetch pf;
    float* cbuf = scratch_data<float>(kResults, cbuf_floats);
    std::vector<__mmask16>* masks_of = nullptr;  // the current block's, in the thread's cache
    std::int64_t masks_for = -1;                 // the block `masks_of` describes
    // The input rows that output pixels [q0, q0 + n) read.
    auto input_rows = [&](std::int64_t q0, std::int64_t n) {
      const std::int64_t iy0 = std::clamp<std::int64_t>(q0 / g.wo - g.ph, 0, g.h);
      return std::pair{
          iy0, std::clamp<std::int64_t>((q0 + n - 1) / g.wo + (g.kh - 1) * g.dh - g.ph + 1, iy0, g.h)};
    };
    for (std::int64_t item = b; item < e; ++item) {
      const std::int64_t it = item / chunks, next = (item + 1) / chunks;
      const auto [p0, p1] = chunk_panels(g, item % chunks, chunks);
      const std::int64_t img = it / (g.groups * blocks), grp = it / blocks % g.groups, blk = it % blocks;
      const std::int64_t q0 = blk * nc, n = std::min(nc, p - q0);
      // Lanes each tap may read, per tile of the block: those whose input row (for ky) and
      // column (for kx) exist.
      bool fresh = false;
      if (masks_for != blk) {
        masks_of = &tap_masks_cached(g, nc, blk, static_cast<std::size_t>(tiles * taps * 3), fresh);
        masks_for = blk;
      }
      std::vector<__mmask16>& masks = *masks_of;
      for (std::int64_t tile = 0; fresh && tile * kNR < n; ++tile)
        for (std::int64_t v = 0; v < 3; ++v) {
          std::int64_t oy[16], ox[16];
          const std::int64_t j0 = tile * kNR + 16 * v;
          const std::int64_t lanes = std::clamp<std::int64_t>(n - j0, 0, 16);
          // One division per vector; the lanes step through the row from there.
          std::int64_t y0 = (q0 + j0) / g.wo, x0 = (q0 + j0) % g.wo;
          for (std::int64_t l = 0; l < lanes; ++l) {
            oy[l] = y0;
            ox[l] = x0;
            if (++x0 == g.wo) x0 = 0, ++y0;
          }
          unsigned cm[64];  // per kx: the lanes whose input column exists (kw <= 64 here)
          const std::int64_t kw_masked = std::min<std::int64_t>(g.kw, 64);
          for (std::int64_t kx = 0; kx < kw_masked; ++kx) {
            unsigned m = 0;
            for (std::int64_t l = 0; l < lanes; ++l) {
              const std::int64_t ix = ox[l] + kx * g.dw - g.pw;
              if (ix >= 0 && ix < g.w) m |= 1u << l;
            }
            cm[kx] = m;
          }
          for (std::int64_t ky = 0; ky < g.kh; ++ky) {
            unsigned rm = 0;
            for (std::int64_t l = 0; l < lanes; ++l) {
              const std::int64_t iy = oy[l] + ky * g.dh - g.ph;
              if (iy >= 0 && iy < g.h) rm |= 1u << l;
            }
            for (std::int64_t kx = 0; kx < g.kw; ++kx) {
              unsigned m = 0;
              if (kx < kw_masked) {
                m = cm[kx];
              } else {
                for (std::int64_t l = 0; l < lanes; ++l) {
                  const std::int64_t ix = ox[l] + kx * g.dw - g.pw;
                  if (ix >= 0 && ix < g.w) m |= 1u << l;
                }
              }
              masks[static_cast<std::size_t>((tile * taps + ky * g.kw + kx) * 3 + v)] =
                  static_cast<__mmask16>(rm & m);
            }
          }
        }
      pf.clear();
      if (item + 1 < e && next != it) {
        const std::int64_t nimg = next / (g.groups * blocks), ngrp = next / blocks % g.groups;
        const std::int64_t nq0 = next % blocks * nc;
        const auto [iy0, iy1] = input_rows(nq0, std::min(nc, p - nq0));
        const float* nin = x + (nimg * g.c + ngrp * cg) * plane;
        for (std::int64_t c = 0; c < cg; ++c) pf.add(nin + c * plane + iy0 * g.w, (iy1 - iy0) * g.w);
      }
      const float* in = x + (img * g.c + grp * cg) * plane;
      // Plain loads (masks applied by blending) unless some tap's 16-float vectors would reach
      // past either end of the input tensor.
      const bool guarded = in + q0 + off_lo < x || in + q0 + (n + 15) / 16 * 16 + off_hi > x_end;
      block_gemm(g, w + grp * g.og() * k, ap ? ap + grp * panels * k * kMR : nullptr, in + q0, off.data(), n,
                 nullptr, cbuf, ldc, &pf, masks.data(), guarded, p0, p1);
      runs.assign(1, Run{0, n, img, q0 / g.wo, q0 % g.wo});
      store_runs(g, ep, grp, runs, cbuf, ldc, y, p0 * kMR, p1 * kMR);
    }
  });
}

void conv_direct(const ConvGeom& g, const float* x, const float* w, const Epilogue<float>& ep, float* y,
                 const CpuContext& ctx) {
  if (in_place(g)) return conv_in_place(g, x, w, ep, y, ctx);
  const std::int64_t cg = g.cg(), k = g.kdim();
  const DirectLayout L(g, block_columns(g, g.ho * ((g.w + 2 * g.pw + g.sw - 1) / g.sw)));
  // Tap k = (c, ky, kx) reads phase (ky*dh % sh, kx*dw % sw) shifted by (ky*dh / sh, kx*dw / sw).
  std::vector<std::int64_t> off(static_cast<std::size_t>(k));
  for (std::int64_t c = 0, t = 0; c < cg; ++c)
    for (std::int64_t ky = 0; ky < g.kh; ++ky)
      for (std::int64_t kx = 0; kx < g.kw; ++kx, ++t) {
        const std::int64_t phase =
            L.phase_index[static_cast<std::size_t>((ky * g.dh % g.sh) * g.sw + kx * g.dw % g.sw)];
        off[static_cast<std::size_t>(t)] =
            (c * L.count() + phase) * L.hb * L.wq + ky * g.dh / g.sh * L.wq + kx * g.dw / g.sw;
      }
  const std::int64_t bands = L.bands(g);
  const std::int64_t ldc = (L.band_rows * L.wq + 15) / 16 * 16;
  const std::int64_t cbuf_floats = (g.og() + kMR - 1) / kMR * kMR * ldc;
  const std::int64_t panels = (g.og() + kMR - 1) / kMR;
  const float* ap = packed_weights(g, w, g.n * g.groups * bands, ctx);
  const std::int64_t chunks = channel_chunks(g, g.n * g.groups * bands);
  // Work items: (image, group, band, channel chunk), each computed by one thread; a band is
  // transformed once by each thread that computes some of its chunks.
  ctx.parallel_for(g.n * g.groups * bands * chunks, 1, [&](std::int64_t b, std::int64_t e) {
    std::vector<Run> runs;
    Prefetch pf;
    float* cbuf = scratch_data<float>(kResults, cbuf_floats);
    float* xt = scratch_data<float>(kInput, L.floats);
    std::int64_t transformed = -1;  // the band in xt
    for (std::int64_t item = b; item < e; ++item) {
      const std::int64_t it = item / chunks, next = (item + 1) / chunks;
      const auto [p0, p1] = chunk_panels(g, item % chunks, chunks);
      const std::int64_t img = it / (g.groups * bands), grp = it / bands % g.groups, band = it % bands;
      const std::int64_t oy0 = band * L.band_rows, rows = std::min(L.band_rows, g.ho - oy0);
      if (transformed != it) transform_band(g, L, x + (img * g.c + grp * cg) * g.h * g.w, oy0, xt);
      transformed = it;
      // While this band computes, the next one's input comes into L2.
      pf.clear();
      if (item + 1 < e && next != it) {
        const std::int64_t nimg = next / (g.groups * bands), ngrp = next / bands % g.groups;
        const auto [iy0, iy1] = band_input_rows(g, L, next % bands * L.band_rows);
        const float* nin = x + (nimg * g.c + ngrp * cg) * g.h * g.w;
        for (std::int64_t c = 0; c < cg; ++c) pf.add(nin + (c * g.h + iy0) * g.w, (iy1 - iy0) * g.w);
      }
      block_gemm(g, w + grp * g.og() * k, ap ? ap + grp * panels * k * kMR : nullptr, xt, off.data(),
                 rows * L.wq, nullptr, cbuf, ldc, &pf, nullptr, false, p0, p1);
      runs.clear();
      for (std::int64_t i = 0; i < rows; ++i) runs.push_back({i * L.wq, g.wo, img, oy0 + i, 0});
      store_runs(g, ep, grp, runs, cbuf, ldc, y, p0 * kMR, p1 * kMR);
    }
  });
}

// Gathers im2col blocks for Packed with the per-run work done once: for each run, the source
// column and lane masks of every kernel column (kx) and the source row of every kernel row
// (ky) are computed up front, so that each tap costs a masked load and a masked store per 16
// pixels of each run.
class RunPacker {
 public:
  RunPacker(const ConvGeom& g, const float* x, std::int64_t c0, const std::vector<Run>& runs)
      : g_(g), runs_(runs), begin_(x), end_(x + g.n * g.c * g.h * g.w) {
    vecs_ = 0;
    for (const Run& r : runs) vecs_ = std::max(vecs_, (r.len + 15) / 16);
    const auto nr = runs.size();
    rows_.resize(nr * static_cast<std::size_t>(g.kh));
    cols_.resize(nr * static_cast<std::size_t>(g.kw * vecs_));
    for (std::size_t i = 0; i < nr; ++i) {
      const Run& r = runs[i];
      const float* image = x + (r.img * g.c + c0) * g.h * g.w;
      for (std::int64_t ky = 0; ky < g.kh; ++ky) {
        const std::int64_t iy = r.oy * g.sh - g.ph + ky * g.dh;
        rows_[i * static_cast<std::size_t>(g.kh) + static_cast<std::size_t>(ky)] =
            iy < 0 || iy >= g.h ? nullptr : image + iy * g.w;
      }
      for (std::int64_t kx = 0; kx < g.kw; ++kx)
        for (std::int64_t v = 0; v < vecs_; ++v) {
          Col& c = cols_[(i * static_cast<std::size_t>(g.kw) + static_cast<std::size_t>(kx)) *
                             static_cast<std::size_t>(vecs_) +
                         static_cast<std::size_t>(v)];
          c.out = lane_range(0, std::clamp<std::int64_t>(r.len - 16 * v, 0, 16));
          c.src = (r.ox + 16 * v) * g.sw - g.pw + kx * g.dw;
          c.lo = lane_range(std::clamp<std::int64_t>(-c.src, 0, 16),
                            std::clamp<std::int64_t>(g.w - c.src, 0, 16));
          c.hi = lane_range(std::clamp<std::int64_t>(-c.src - 16, 0, 16),
                            std::clamp<std::int64_t>(g.w - c.src - 16, 0, 16));
          if (g.sw == 1) c.lo &= c.out;
        }
    }
  }

  // dst[k * ld + run.col + j] for the taps k in [k0, k0 + kn).
  void pack(std::int64_t k0, std::int64_t kn, float* dst, std::int64_t ld) const {
    const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const std::int64_t plane = g_.h * g_.w;
    std::int64_t c = k0 / (g_.kh * g_.kw), ky = k0 / g_.kw % g_.kh, kx = k0 % g_.kw;
    const auto kh = static_cast<std::size_t>(g_.kh), kw = static_cast<std::size_t>(g_.kw);
    const auto nv = static_cast<std::size_t>(vecs_);
    for (std::int64_t k = 0; k < kn; ++k) {
      float* d = dst + k * ld;
      for (std::size_t i = 0; i < runs_.size(); ++i) {
        const float* row = rows_[i * kh + static_cast<std::size_t>(ky)];
        const Col* col = &cols_[(i * kw + static_cast<std::size_t>(kx)) * nv];
        float* out = d + runs_[i].col;
        for (std::size_t v = 0; v < nv && col[v].out; ++v) {
          __m512 val = _mm512_setzero_ps();
          if (row) {
            const float* src = row + c * plane;
            val = load(src, col[v].src, col[v].lo);
            if (g_.sw == 2) val = _mm512_permutex2var_ps(val, evens, load(src, col[v].src + 16, col[v].hi));
          }
          _mm512_mask_storeu_ps(out + 16 * static_cast<std::int64_t>(v), col[v].out, val);
        }
      }
      if (++kx == g_.kw) {
        kx = 0;
        if (++ky == g_.kh) {
          ky = 0;
          ++c;
        }
      }
    }
  }

 private:
  struct Col {
    std::int64_t src;       // source column of lane 0
    __mmask16 out, lo, hi;  // lanes to write; lanes to read in the first and second 16 sources
  };
  // The lanes `m` of 16 floats from row + at, the others 0. A masked load is far slower than a
  // plain one on memory that misses the cache, so it is used only at the ends of the tensor.
  __m512 load(const float* row, std::int64_t at, __mmask16 m) const {
    const auto p = reinterpret_cast<std::uintptr_t>(row) + static_cast<std::uintptr_t>(at) * sizeof(float);
    if (p >= reinterpret_cast<std::uintptr_t>(begin_) &&
        p + 16 * sizeof(float) <= reinterpret_cast<std::uintptr_t>(end_)) {
      __m512 v = _mm512_loadu_ps(reinterpret_cast<const float*>(p));
      asm("" : "+v"(v));  // keeps the load and the blend apart (see BLoad)
      return _mm512_maskz_mov_ps(m, v);
    }
    return load_lanes(row, at, m);
  }
  const ConvGeom& g_;
  const std::vector<Run>& runs_;
  const float *begin_, *end_;  // the input tensor
  std::int64_t vecs_;
  std::vector<const float*> rows_;  // [run][ky]: the source row in channel c0, null in the padding
  std::vector<Col> cols_;           // [run][kx][vector]
};

void conv_packed(const ConvGeom& g, const float* x, const float* w, const Epilogue<float>& ep, float* y,
                 const CpuContext& ctx) {
  const std::int64_t k = g.kdim(), total = g.n * g.pixels();
  const std::int64_t nc = block_columns(g, total), blocks = (total + nc - 1) / nc;
  const std::int64_t panels = (g.og() + kMR - 1) / kMR;
  const float* ap = packed_weights(g, w, g.groups * blocks, ctx);
  const std::int64_t chunks = channel_chunks(g, g.groups * blocks);
  ctx.parallel_for(g.groups * blocks * chunks, 1, [&](std::int64_t b, std::int64_t e) {
    std::vector<Run> runs;
    const std::int64_t ldc = (nc + 15) / 16 * 16;
    float* cbuf = scratch_data<float>(kResults, panels * kMR * ldc);
    for (std::int64_t item = b; item < e; ++item) {
      const std::int64_t it = item / chunks;
      const auto [p0, p1] = chunk_panels(g, item % chunks, chunks);
      const std::int64_t grp = it / blocks, q0 = it % blocks * nc, n = std::min(nc, total - q0);
      pixel_runs(g, q0, n, runs);
      PackFn pack;
      if (g.sw <= 2) {
        auto packer = std::make_shared<RunPacker>(g, x, grp * g.cg(), runs);
        pack = [packer](std::int64_t k0, std::int64_t kn, float* dst, std::int64_t ld) {
          packer->pack(k0, kn, dst, ld);
        };
      } else {
        pack = [&](std::int64_t k0, std::int64_t kn, float* dst, std::int64_t ld) {
          im2col_runs(g, x, grp * g.cg(), k0, kn, runs, dst, ld);
        };
      }
      block_gemm(g, w + grp * g.og() * k, ap ? ap + grp * panels * k * kMR : nullptr, nullptr, nullptr, n,
                 &pack, cbuf, ldc, nullptr, nullptr, false, p0, p1);
      store_runs(g, ep, grp, runs, cbuf, ldc, y, p0 * kMR, p1 * kMR);
    }
  });
}

// ---- Rows: output rows as vectors, for convolutions with few channels ----
//
// For stride-1 columns: each output row of a group is covered by vectors of 16 (NV of them at
// a time, 16 * NV pixels), and CB output channels are computed together, so every tap costs NV
// loads of the input and CB * NV multiply-adds with the tap's weights broadcast. A band of
// input rows is first copied, zero-padded, so that no load needs a mask. This suits the first
// layers of small CNNs (LeNet's 1 -> 6 and 6 -> 16 5x5 convolutions), where the 8 x 48 kernel's
// per-call and per-block costs outweigh its few taps.

bool rows_apply(const ConvGeom& g) { return g.sw == 1; }

// acc[cb][v] for output channels [co0, co0 + cb_n) of the group, output row oy, columns
// [ox0, ox0 + 16 * NV) of the band's padded input `xp` (rows of `wpp` floats, `rows_in` per
// channel, the band's first input row at 0); `wp` holds the group's weights as [tap][CB] for
// the block (zero past cb_n).
template <int CB, int NV>
void rows_block(const ConvGeom& g, const float* xp, std::int64_t wpp, std::int64_t rows_in, std::int64_t oy_band,
                std::int64_t ox0, const float* wp, __m512 (&acc)[CB][NV]) {
#pragma GCC unroll 16
  for (int b = 0; b < CB; ++b)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[b][v] = _mm512_setzero_ps();
  const float* wt = wp;
  for (std::int64_t ci = 0; ci < g.cg(); ++ci)
    for (std::int64_t ky = 0; ky < g.kh; ++ky) {
      const float* row = xp + (ci * rows_in + oy_band * g.sh + ky * g.dh) * wpp + ox0;
      for (std::int64_t kx = 0; kx < g.kw; ++kx, wt += CB) {
        __m512 in[NV];
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) in[v] = _mm512_loadu_ps(row + kx * g.dw + 16 * v);
#pragma GCC unroll 16
        for (int b = 0; b < CB; ++b) {
          const __m512 wv = _mm512_set1_ps(wt[b]);
#pragma GCC unroll 2
          for (int v = 0; v < NV; ++v) acc[b][v] = _mm512_fmadd_ps(wv, in[v], acc[b][v]);
        }
      }
    }
}

// Copies the input rows that output rows [oy0, oy1) of image `img`, group `grp` read into
// per-thread scratch, zero-padded to rows of `wpp` floats (input column ix at ix + pw);
// returns the copy and sets `rows_in`, its rows per channel.
float* rows_padded_input(const ConvGeom& g, const float* x, std::int64_t wpp, std::int64_t img, std::int64_t grp,
                         std::int64_t oy0, std::int64_t oy1, std::int64_t& rows_in) {
  const std::int64_t cg = g.cg();
  const std::int64_t iy0 = oy0 * g.sh - g.ph;  // the band's first input row
  rows_in = (oy1 - 1 - oy0) * g.sh + (g.kh - 1) * g.dh + 1;
  float* xp = scratch_data<float>(kInput, cg * rows_in * wpp + 16);
  const float* xin = x + (img * g.c + grp * cg) * g.h * g.w;
  for (std::int64_t ci = 0; ci < cg; ++ci)
    for (std::int64_t r = 0; r < rows_in; ++r) {
      float* d = xp + (ci * rows_in + r) * wpp;
      const std::int64_t iy = iy0 + r;
      if (iy < 0 || iy >= g.h) {
        std::fill(d, d + wpp, 0.0f);
        continue;
      }
      std::fill(d, d + g.pw, 0.0f);
      std::copy(xin + (ci * g.h + iy) * g.w, xin + (ci * g.h + iy + 1) * g.w, d + g.pw);
      std::fill(d + g.pw + g.w, d + wpp, 0.0f);
    }
  return xp;
}

// The part of the epilogue that the Rows kernels leave to epilogue_row after applying scale,
// shift and ReLU on their vectors: an activation other than ReLU, and a user's form.
struct RowsTail {
  bool relu = false;
  Epilogue<float> tail;
  bool any = false;
  explicit RowsTail(const Epilogue<float>& ep) {
    relu = ep.act && ep.act->fn == UnaryFn::Relu;
    if (ep.act && !relu) tail.act = ep.act;
    tail.form = ep.form;
    any = tail.act || tail.form;
  }
};

// The weights of every group as [group][block][tap][lanes] for blocks of `lanes` output
// channels, zero past the group's last channel, in the calling thread's scratch (the workers
// read it during the call); returns the blocks per group through `blocks`.
const float* rows_packed_weights(const ConvGeom& g, const float* w, std::int64_t lanes, std::int64_t& blocks) {
  const std::int64_t og = g.og(), taps = g.kdim();
  blocks = (og + lanes - 1) / lanes;
  float* wpack = scratch_data<float>(kWeights, g.groups * blocks * taps * lanes);
  for (std::int64_t grp = 0; grp < g.groups; ++grp)
    for (std::int64_t blk = 0; blk < blocks; ++blk) {
      float* d = wpack + (grp * blocks + blk) * taps * lanes;
      for (std::int64_t t = 0; t < taps; ++t)
        for (std::int64_t b = 0; b < lanes; ++b) {
          const std::int64_t co = blk * lanes + b;
          d[t * lanes + b] = co < og ? w[(grp * og + co) * taps + t] : 0.0f;
        }
    }
  return wpack;
}

// One band of output rows [oy0, oy1) of image `img`, group `grp`: pads its input rows into
// scratch, then every block of CB channels and every row and column chunk, with the epilogue.
template <int CB, int NV>
void rows_band(const ConvGeom& g, const float* x, const float* wpack, std::int64_t blocks, const Epilogue<float>& ep,
               float* y, std::int64_t img, std::int64_t grp, std::int64_t oy0, std::int64_t oy1) {
  const std::int64_t og = g.og(), taps = g.kdim();
  const std::int64_t chunk = 16 * NV, chunks = (g.wo + chunk - 1) / chunk;
  const std::int64_t wpp = chunks * chunk + (g.kw - 1) * g.dw;  // >= w + 2 pw
  std::int64_t rows_in = 0;
  const float* xp = rows_padded_input(g, x, wpp, img, grp, oy0, oy1, rows_in);
  const RowsTail rt(ep);  // what the vector epilogue below leaves to epilogue_row
  for (std::int64_t blk = 0; blk < blocks; ++blk) {
    const std::int64_t co0 = blk * CB, cb_n = std::min<std::int64_t>(CB, og - co0);
    const float* wp = wpack + (grp * blocks + blk) * taps * CB;
    for (std::int64_t oy = oy0; oy < oy1; ++oy)
      for (std::int64_t cx = 0; cx < chunks; ++cx) {
        __m512 acc[CB][NV];
        rows_block<CB, NV>(g, xp, wpp, rows_in, oy - oy0, cx * chunk, wp, acc);
        for (std::int64_t b = 0; b < cb_n; ++b) {
          const std::int64_t o = grp * og + co0 + b;
          const std::int64_t at = ((img * g.o + o) * g.ho + oy) * g.wo + cx * chunk;
          const __m512 sc = _mm512_set1_ps(ep.scale ? ep.scale[o] : 1.0f);
          const __m512 sh = _mm512_set1_ps(ep.shift ? ep.shift[o] : 0.0f);
          for (int v = 0; v < NV; ++v) {
            const std::int64_t x0 = cx * chunk + 16 * v;
            const __mmask16 m = lane_range(0, std::clamp<std::int64_t>(g.wo - x0, 0, 16));
            if (!m) continue;
            __m512 r = _mm512_fmadd_ps(acc[b][v], sc, sh);
            if (ep.residual) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(m, ep.residual + at + 16 * v));
            if (rt.relu) r = _mm512_maskz_max_ps(0xFFFF, r, _mm512_setzero_ps());  // (GCC 12 warns on the plain max)
            _mm512_mask_storeu_ps(y + at + 16 * v, m, r);
          }
          if (rt.any) {
            const std::int64_t n = std::min(chunk, g.wo - cx * chunk);
            epilogue_row<float>(rt.tail, o, n, y + at, y + at, nullptr);
          }
        }
      }
  }
}

// Runs band(img, grp, oy0, oy1) over bands of output rows: enough of them for the threads
// when the convolution is worth splitting (about 64K multiply-adds per band at least; `per_row`
// is an output row's), one per image and group otherwise, so that a small convolution runs on
// the calling thread.
template <class Band>
void rows_parallel(const ConvGeom& g, std::int64_t per_row, const CpuContext& ctx, const Band& band) {
  const std::int64_t planes = g.n * g.groups;
  const std::int64_t want_items = std::max<std::int64_t>(1, per_row * g.ho * planes / (1 << 16));
  const std::int64_t bands = std::clamp<std::int64_t>(std::min<std::int64_t>(want_items, 8) / planes, 1, g.ho);
  const std::int64_t band_rows = (g.ho + bands - 1) / bands;
  ctx.parallel_for(planes * bands, 1, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t it = b; it < e; ++it) {
      const std::int64_t plane = it / bands, part = it % bands;
      const std::int64_t oy0 = part * band_rows, oy1 = std::min(g.ho, oy0 + band_rows);
      if (oy0 < oy1) band(plane / g.groups, plane % g.groups, oy0, oy1);
    }
  });
}

// The pixel form of Rows, for output rows of at most 16 pixels and many channels: 16 output
// channels fill the lanes and P pixels of a row are computed together, so every tap costs one
// load of the weights and P multiply-adds with the input broadcast. The results are written
// transposed, a channel's P pixels at a time, through the epilogue.
template <int P>
void pixels_band(const ConvGeom& g, const float* x, const float* wpack, std::int64_t blocks, const Epilogue<float>& ep,
                 float* y, std::int64_t img, std::int64_t grp, std::int64_t oy0, std::int64_t oy1) {
  const std::int64_t og = g.og(), taps = g.kdim();
  const std::int64_t chunks = (g.wo + P - 1) / P;
  const std::int64_t wpp = chunks * P + (g.kw - 1) * g.dw + 16;  // >= w + 2 pw
  std::int64_t rows_in = 0;
  const float* xp = rows_padded_input(g, x, wpp, img, grp, oy0, oy1, rows_in);
  alignas(64) float t[P][16];
  // Without a residual the epilogue's scale, shift and ReLU run on the vectors; a residual, or
  // another activation after them, goes through epilogue_row.
  const bool vector_ep = ep.residual == nullptr;
  const RowsTail rt(ep);
  for (std::int64_t blk = 0; blk < blocks; ++blk) {
    const std::int64_t co0 = blk * 16, cb_n = std::min<std::int64_t>(16, og - co0);
    const float* wp = wpack + (grp * blocks + blk) * taps * 16;
    const __mmask16 lanes = lane_range(0, cb_n);
    const std::int64_t o0 = grp * og + co0;
    const __m512 sc = ep.scale ? _mm512_maskz_loadu_ps(lanes, ep.scale + o0) : _mm512_set1_ps(1.0f);
    const __m512 sh = ep.shift ? _mm512_maskz_loadu_ps(lanes, ep.shift + o0) : _mm512_setzero_ps();
    for (std::int64_t oy = oy0; oy < oy1; ++oy)
      for (std::int64_t cx = 0; cx < chunks; ++cx) {
        const std::int64_t ox0 = cx * P, n = std::min<std::int64_t>(P, g.wo - ox0);
        __m512 acc[P];
#pragma GCC unroll 16
        for (int q = 0; q < P; ++q) acc[q] = _mm512_setzero_ps();
        const float* wt = wp;
        for (std::int64_t ci = 0; ci < g.cg(); ++ci)
          for (std::int64_t ky = 0; ky < g.kh; ++ky) {
            const float* row = xp + (ci * rows_in + (oy - oy0) * g.sh + ky * g.dh) * wpp + ox0;
            for (std::int64_t kx = 0; kx < g.kw; ++kx, wt += 16) {
              const __m512 wv = _mm512_loadu_ps(wt);
              const float* r = row + kx * g.dw;
#pragma GCC unroll 16
              for (int q = 0; q < P; ++q) acc[q] = _mm512_fmadd_ps(_mm512_set1_ps(r[q]), wv, acc[q]);
            }
          }
        if (vector_ep) {  // scale, shift and ReLU on the lanes (channels) before the transpose
#pragma GCC unroll 16
          for (int q = 0; q < P; ++q) {
            __m512 r = _mm512_fmadd_ps(acc[q], sc, sh);
            if (rt.relu) r = _mm512_maskz_max_ps(0xFFFF, r, _mm512_setzero_ps());
            _mm512_store_ps(t[q], r);
          }
        } else {
#pragma GCC unroll 16
          for (int q = 0; q < P; ++q) _mm512_store_ps(t[q], acc[q]);
        }
        for (std::int64_t b = 0; b < cb_n; ++b) {
          const std::int64_t o = grp * og + co0 + b;
          const std::int64_t at = ((img * g.o + o) * g.ho + oy) * g.wo + ox0;
          for (std::int64_t q = 0; q < n; ++q) y[at + q] = t[q][b];
          if (!vector_ep)
            epilogue_row<float>(ep, o, n, y + at, y + at, ep.residual ? ep.residual + at : nullptr);
          else if (rt.any)
            epilogue_row<float>(rt.tail, o, n, y + at, y + at, nullptr);
        }
      }
  }
}

template <int P>
void conv_pixels_p(const ConvGeom& g, const float* x, const float* w, const Epilogue<float>& ep, float* y,
                   const CpuContext& ctx) {
  std::int64_t blocks = 0;
  const float* wpack = rows_packed_weights(g, w, 16, blocks);
  const std::int64_t per_row = blocks * 16 * g.kdim() * g.wo;
  rows_parallel(g, per_row, ctx, [&](std::int64_t img, std::int64_t grp, std::int64_t oy0, std::int64_t oy1) {
    pixels_band<P>(g, x, wpack, blocks, ep, y, img, grp, oy0, oy1);
  });
}

template <int... P>
void conv_pixels_dispatch(std::int64_t p, const ConvGeom& g, const float* x, const float* w,
                          const Epilogue<float>& ep, float* y, const CpuContext& ctx,
                          std::integer_sequence<int, P...>) {
  ((p == P + 1 ? (conv_pixels_p<P + 1>(g, x, w, ep, y, ctx), 0) : 0), ...);
}

// Lanes wasted by the two forms of Rows: the row form leaves the lanes past each row's last
// pixel empty, the pixel form those past the group's last channel.
double rows_lane_waste(std::int64_t n, std::int64_t lanes) {
  return 1.0 - static_cast<double>(n) / static_cast<double>((n + lanes - 1) / lanes * lanes);
}
bool rows_pixel_form(const ConvGeom& g) {
  return g.wo <= 16 && rows_lane_waste(g.og(), 16) < rows_lane_waste(g.wo, 16);
}

template <int CB, int NV>
void conv_rows_cb(const ConvGeom& g, const float* x, const float* w, const Epilogue<float>& ep, float* y,
                  const CpuContext& ctx) {
  std::int64_t blocks = 0;
  const float* wpack = rows_packed_weights(g, w, CB, blocks);
  const std::int64_t per_row = blocks * CB * g.kdim() * ((g.wo + 16 * NV - 1) / (16 * NV)) * 16 * NV;
  rows_parallel(g, per_row, ctx, [&](std::int64_t img, std::int64_t grp, std::int64_t oy0, std::int64_t oy1) {
    rows_band<CB, NV>(g, x, wpack, blocks, ep, y, img, grp, oy0, oy1);
  });
}

template <int NV, int... CB>
void conv_rows_dispatch(std::int64_t cb, const ConvGeom& g, const float* x, const float* w, const Epilogue<float>& ep,
                        float* y, const CpuContext& ctx, std::integer_sequence<int, CB...>) {
  ((cb == CB + 1 ? (conv_rows_cb<CB + 1, NV>(g, x, w, ep, y, ctx), 0) : 0), ...);
}

// The pixel form where it wastes fewer lanes; otherwise the row form, with up to 12 channels
// per block and two vectors per row chunk (rows wider than 16), 16 with one.
void conv_rows(const ConvGeom& g, const float* x, const float* w, const Epilogue<float>& ep, float* y,
               const CpuContext& ctx) {
  if (rows_pixel_form(g)) {  // up to 14 pixels together
    const std::int64_t chunks = (g.wo + 13) / 14;
    return conv_pixels_dispatch((g.wo + chunks - 1) / chunks, g, x, w, ep, y, ctx,
                                std::make_integer_sequence<int, 14>{});
  }
  const int nv = g.wo > 16 ? 2 : 1;
  const std::int64_t most = nv == 2 ? 12 : 16;
  const std::int64_t blocks = (g.og() + most - 1) / most;
  const std::int64_t cb = (g.og() + blocks - 1) / blocks;
  if (nv == 2)
    conv_rows_dispatch<2>(cb, g, x, w, ep, y, ctx, std::make_integer_sequence<int, 12>{});
  else
    conv_rows_dispatch<1>(cb, g, x, w, ep, y, ctx, std::make_integer_sequence<int, 16>{});
}

}  // namespace avx
KG_AVX512_END
#endif

// ---- choosing the algorithm ----

bool algo_available(ConvAlgo algo, DType dtype) {
  switch (algo) {
    case ConvAlgo::Auto:
    case ConvAlgo::Gemm:
    case ConvAlgo::Depthwise:
      return true;
    case ConvAlgo::Direct:
    case ConvAlgo::Packed:
    case ConvAlgo::Rows:
      return KG_CONV_AVX512 && dtype == DType::F32 && cpu_has_avx512f();
  }
  return false;
}

ConvAlgo choose_algo(const ConvGeom& g, DType dtype) {
  if (g.groups > 1 && g.og() <= 4) return ConvAlgo::Depthwise;
  if (!algo_available(ConvAlgo::Direct, dtype)) return ConvAlgo::Gemm;
#if KG_CONV_AVX512
  // Few output channels (the first layers of small CNNs): Direct's 8-channel panels spend
  // more on per-call and per-block work than on their few taps, and Rows wins (LeNet-5's
  // 1 -> 6 and 6 -> 16 5x5 layers take about two thirds of the time at batch 64).
  if (avx::rows_apply(g) && g.og() <= 16 && g.kdim() <= 512) return ConvAlgo::Rows;
  // Direct wastes the lanes past each image's last pixel (in place) or the wq - wo columns past
  // each output row (transformed). Packed wastes only the lanes past the batch's last pixel but
  // gathers each input value under each tap once per block, which costs about as much as 40
  // multiply-adds per element, shared by the group's output channels (measured on ResNet-18's
  // layers).
  auto lane_waste = [](std::int64_t pixels) {
    return 1.0 - static_cast<double>(pixels) / static_cast<double>((pixels + 15) / 16 * 16);
  };
  const double direct = avx::in_place(g) ? lane_waste(g.pixels())
                                         : 1.0 - static_cast<double>(g.wo) /
                                                     static_cast<double>((g.w + 2 * g.pw + g.sw - 1) / g.sw);
  const double packed =
      lane_waste(g.n * g.pixels()) + 40.0 / static_cast<double>(std::max<std::int64_t>(g.og(), 1));
  return direct <= packed ? ConvAlgo::Direct : ConvAlgo::Packed;
#else
  return ConvAlgo::Gemm;
#endif
}

template <class T>
void conv2d_forward(const ConvGeom& g, ConvAlgo algo, const T* x, const T* w, const Epilogue<T>& ep, T* y,
                    const CpuContext& ctx) {
  if (g.n == 0 || g.o == 0 || g.pixels() == 0) return;
  if (g.kdim() == 0) {  // no input channels: the epilogue of zeros
    const std::int64_t p = g.pixels();
    std::fill(y, y + g.n * g.o * p, T(0));
    for (std::int64_t pl = 0; pl < g.n * g.o; ++pl)
      epilogue_row(ep, pl % g.o, p, y + pl * p, y + pl * p, ep.residual ? ep.residual + pl * p : nullptr);
    return;
  }
  if (algo == ConvAlgo::Auto) algo = choose_algo(g, dtype_of_v<T>);
  if (!algo_available(algo, dtype_of_v<T>))
    throw Error(util::cat("convolution algorithm ", static_cast<int>(algo), " is not available for ",
                          dtype_name(dtype_of_v<T>), " in this build"));
  switch (algo) {
    case ConvAlgo::Depthwise:
      return conv_depthwise(g, x, w, ep, y, ctx);
    case ConvAlgo::Direct:
    case ConvAlgo::Packed:
    case ConvAlgo::Rows:
#if KG_CONV_AVX512
      if constexpr (std::is_same_v<T, float>) {
        // Rows takes stride-1 columns only; other geometries asked for it run Direct.
        if (algo == ConvAlgo::Rows && avx::rows_apply(g))
          avx::conv_rows(g, x, w, ep, y, ctx);
        else if (algo != ConvAlgo::Packed)
          avx::conv_direct(g, x, w, ep, y, ctx);
        else
          avx::conv_packed(g, x, w, ep, y, ctx);
        return;
      }
#endif
      break;
    default:
      break;
  }
  conv_gemm(g, x, w, ep, y, ctx);
}

ConvGeom geometry(const Conv2dOp& op, const std::vector<std::int64_t>& in,
                  const std::vector<std::int64_t>& out) {
  ConvGeom g;
  g.n = in[0];
  g.c = in[1];
  g.h = in[2];
  g.w = in[3];
  g.o = op.out_channels();
  g.kh = op.kernel().h;
  g.kw = op.kernel().w;
  const auto& o = op.options();
  g.sh = o.stride.h;
  g.sw = o.stride.w;
  g.ph = o.padding.h;
  g.pw = o.padding.w;
  g.dh = o.dilation.h;
  g.dw = o.dilation.w;
  g.groups = o.groups;
  g.ho = out[2];
  g.wo = out[3];
  return g;
}

std::string size2_text(Size2 s) { return s.h == s.w ? util::cat(s.h) : util::cat(s.h, "x", s.w); }

// ---- backward ----
//
// With the im2col matrix col[k, pixel] of an image and group (the input under tap k, 0 in the
// padding) the convolution is y = W col, so dW = sum over images of dY colᵀ and dcol = Wᵀ dY,
// which col2im scatters back onto the input (several taps read the same input value). The
// batch is cut into a fixed number of image ranges; a work unit is a range and a group, taken
// in blocks of output pixels (several whole images per GEMM when they are small, else tiles of
// one image). Each range sums its weight gradient into its own buffer and the buffers are
// added in range order, so the result does not depend on the threads. A stride-1 convolution
// takes dx another way: as the convolution of dy with the flipped weights, on the forward's
// kernels (input_grad_as_convolution).

// row[ix0 + j * sw] += s[j] for the j in [0, n) whose index falls inside [0, w); nothing for a
// padding row (null).
template <class T>
void scatter_add_row(T* row, std::int64_t w, std::int64_t ix0, std::int64_t sw, std::int64_t n, const T* s) {
  if (!row) return;
  std::int64_t lo = ix0 >= 0 ? 0 : (-ix0 + sw - 1) / sw;
  std::int64_t hi = ix0 >= w ? 0 : (w - ix0 + sw - 1) / sw;
  lo = std::min(lo, n);
  hi = std::clamp(hi, lo, n);
  if (sw == 1) {
    for (std::int64_t j = lo; j < hi; ++j) row[ix0 + j] += s[j];
  } else {
    for (std::int64_t j = lo; j < hi; ++j) row[ix0 + j * sw] += s[j];
  }
}

// The adjoint of im2col_runs: dx[the input under tap k for each pixel of `runs`] +=
// col[k * ld + column], for the taps k in [k0, k0 + kn) of the group starting at channel c0.
template <class T>
void col2im_runs(const ConvGeom& g, T* dx, std::int64_t c0, std::int64_t k0, std::int64_t kn,
                 const std::vector<Run>& runs, const T* col, std::int64_t ld) {
  std::int64_t c = k0 / (g.kh * g.kw), ky = k0 / g.kw % g.kh, kx = k0 % g.kw;
  for (std::int64_t k = 0; k < kn; ++k) {
    const T* src = col + k * ld;
    for (const Run& r : runs) {
      const std::int64_t iy = r.oy * g.sh - g.ph + ky * g.dh;
      T* row = iy < 0 || iy >= g.h ? nullptr : dx + ((r.img * g.c + c0 + c) * g.h + iy) * g.w;
      scatter_add_row(row, g.w, r.ox * g.sw - g.pw + kx * g.dw, g.sw, r.len, src + r.col);
    }
    if (++kx == g.kw) {
      kx = 0;
      if (++ky == g.kh) {
        ky = 0;
        ++c;
      }
    }
  }
}

// c[i * ldc + j] += sum over k < kd of a[i * lda + k] * b[j * ldb + k] for i < m, j < n: the
// weight gradient's GEMM (dY times the im2col matrix transposed), whose operands both run along
// the pixels. For few output channels and taps the BLAS spends more time packing its operands
// than multiplying (each element is used m or n times); this kernel reads them in place, 4 rows
// of each at a time against 16 accumulator vectors, over 64-byte vectors of pixels.
#if KG_CONV_AVX512
KG_AVX512_BEGIN  // 64-byte vectors: AVX-512 registers where the CPU has them (checked by the caller)
#endif
template <class T, int MB, int NB>
void dot_block(std::int64_t i0, std::int64_t j0, std::int64_t kd, const T* a, std::int64_t lda, const T* b,
               std::int64_t ldb, T* c, std::int64_t ldc) {
  constexpr int L = 64 / sizeof(T);  // lanes of a vector
  typedef T Vec __attribute__((vector_size(64)));
  Vec acc[MB][NB] = {};
  std::int64_t k = 0;
  for (; k + L <= kd; k += L) {
    Vec av[MB], bv[NB];
    for (int i = 0; i < MB; ++i) std::memcpy(&av[i], a + (i0 + i) * lda + k, sizeof(Vec));
    for (int j = 0; j < NB; ++j) std::memcpy(&bv[j], b + (j0 + j) * ldb + k, sizeof(Vec));
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] += av[i] * bv[j];
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      T sum = T(0);
      for (int l = 0; l < L; ++l) sum += acc[i][j][l];
      for (std::int64_t kk = k; kk < kd; ++kk) sum += a[(i0 + i) * lda + kk] * b[(j0 + j) * ldb + kk];
      c[(i0 + i) * ldc + j0 + j] += sum;
    }
}

template <class T, int MB>
void dot_row_block(std::int64_t i0, std::int64_t n, std::int64_t kd, const T* a, std::int64_t lda, const T* b,
                   std::int64_t ldb, T* c, std::int64_t ldc) {
  std::int64_t j0 = 0;
  for (; j0 + 4 <= n; j0 += 4) dot_block<T, MB, 4>(i0, j0, kd, a, lda, b, ldb, c, ldc);
  for (; j0 < n; ++j0) dot_block<T, MB, 1>(i0, j0, kd, a, lda, b, ldb, c, ldc);
}

template <class T>
void dot_rows(std::int64_t m, std::int64_t n, std::int64_t kd, const T* a, std::int64_t lda, const T* b,
              std::int64_t ldb, T* c, std::int64_t ldc) {
  std::int64_t i0 = 0;
  for (; i0 + 4 <= m; i0 += 4) dot_row_block<T, 4>(i0, n, kd, a, lda, b, ldb, c, ldc);
  for (; i0 < m; ++i0) dot_row_block<T, 1>(i0, n, kd, a, lda, b, ldb, c, ldc);
}
#if KG_CONV_AVX512
KG_AVX512_END
#endif

// The weight gradient's GEMM: dot_rows where the BLAS would mostly pack, else the BLAS.
template <class T>
void weight_grad_gemm(std::int64_t og, std::int64_t kdim, std::int64_t cnt, const T* dy, std::int64_t ld_dy,
                      const T* col, std::int64_t ld_col, T* dw) {
  if (og * kdim <= 4096 && (!KG_CONV_AVX512 || cpu_has_avx512f()))
    dot_rows(og, kdim, cnt, dy, ld_dy, col, ld_col, dw, kdim);
  else
    gemm(false, true, og, kdim, cnt, T(1), dy, ld_dy, col, ld_col, T(1), dw, kdim);
}

// The number of image ranges (each with its weight-gradient partial sum): at most one per image,
// at most max(16, hardware threads), and their partial sums together at most about 64 MiB.
std::int64_t backward_chunks(std::int64_t items, std::int64_t weight_bytes) {
  const std::int64_t threads = std::max<std::int64_t>(16, std::thread::hardware_concurrency());
  const std::int64_t by_memory = std::max<std::int64_t>(1, (std::int64_t{64} << 20) / std::max<std::int64_t>(weight_bytes, 1));
  return std::clamp<std::int64_t>(std::min(threads, by_memory), 1, std::max<std::int64_t>(items, 1));
}

// dx of a stride-1 convolution is itself a stride-1 convolution: of dy, zero-padded by
// d * (k - 1) - p, with the weights flipped in both kernel dims and their two channel dims
// swapped within each group, w'[g * cg + c, m, ky, kx] = w[g * og + m, c, kh - 1 - ky, kw - 1 - kx].
// It then runs on the forward's kernels. False (nothing done) when the convolution is strided or
// pads more than that.
template <class T>
bool input_grad_as_convolution(const ConvGeom& g, const T* w, const T* dy, T* dx, const CpuContext& ctx) {
  const std::int64_t ph = g.dh * (g.kh - 1) - g.ph, pw = g.dw * (g.kw - 1) - g.pw;
  if (g.sh != 1 || g.sw != 1 || ph < 0 || pw < 0) return false;
  ConvGeom t = g;
  t.c = g.o;
  t.h = g.ho;
  t.w = g.wo;
  t.o = g.c;
  t.ph = ph;
  t.pw = pw;
  t.ho = g.h;
  t.wo = g.w;
  const std::int64_t og = g.og(), cg = g.cg(), khw = g.kh * g.kw;
  std::vector<T> flipped(static_cast<std::size_t>(g.o * cg * khw));
  for (std::int64_t grp = 0; grp < g.groups; ++grp)
    for (std::int64_t m = 0; m < og; ++m)
      for (std::int64_t c = 0; c < cg; ++c) {
        const T* src = w + ((grp * og + m) * cg + c) * khw;
        T* dst = flipped.data() + ((grp * cg + c) * og + m) * khw;
        for (std::int64_t i = 0; i < khw; ++i) dst[i] = src[khw - 1 - i];
      }
  conv2d_forward<T>(t, ConvAlgo::Auto, dy, flipped.data(), Epilogue<T>{}, dx, ctx);
  return true;
}

// Gradients of a convolution without epilogue: dx [N, C, H, W] (null: not wanted), dw
// [O, C/groups, kh, kw] and db [O] (null: not wanted), from dy [N, O, Ho, Wo]. x is needed only
// for dw, w only for dx.
template <class T>
void conv2d_backward(const ConvGeom& g, const T* x, const T* w, const T* dy, T* dx, T* dw, T* db,
                     const CpuContext& ctx) {
  const std::int64_t p = g.pixels(), og = g.og(), cg = g.cg(), kdim = g.kdim(), hw = g.h * g.w;
  if (db) {
    ctx.parallel_for(g.o, std::max<std::int64_t>(1, 65536 / std::max<std::int64_t>(g.n * p, 1)),
                     [&](std::int64_t o0, std::int64_t o1) {
                       for (std::int64_t o = o0; o < o1; ++o) {
                         T s = T(0);
                         for (std::int64_t img = 0; img < g.n; ++img) {
                           const T* row = dy + (img * g.o + o) * p;
                           T part[8] = {};
                           std::int64_t j = 0;
                           for (; j + 8 <= p; j += 8)
                             for (int l = 0; l < 8; ++l) part[l] += row[j + l];
                           for (; j < p; ++j) s += row[j];
                           for (int l = 0; l < 8; ++l) s += part[l];
                         }
                         db[o] = s;
                       }
                     });
  }
  const std::int64_t wsize = g.o * kdim;
  if (!dx && !dw) return;
  // A stride-1 convolution's dx on the forward's kernels; the blocks below then compute dw only.
  if (dx && g.n > 0 && p > 0 && kdim > 0 && og > 0 && input_grad_as_convolution(g, w, dy, dx, ctx)) {
    if (!dw) return;
    dx = nullptr;
  }
  if (g.n == 0 || p == 0 || kdim == 0 || og == 0) {  // nothing reaches a weight or an input
    if (dw) std::fill(dw, dw + wsize, T(0));
    if (dx) std::fill(dx, dx + g.n * g.c * hw, T(0));
    return;
  }
  // Blocks of output pixels: whole images while several fit the budget of gemm_tile_pixels
  // (one GEMM over all of them), else tiles of one image. A pointwise convolution reads its
  // operands in place, image by image.
  std::int64_t nb = gemm_tile_pixels(g, sizeof(T));
  if (nb >= p && !g.pointwise()) {
    const auto budget = static_cast<std::int64_t>((384 * 1024) / sizeof(T)) / kdim;
    nb = std::max<std::int64_t>(1, budget / p) * p;
  }
  const std::int64_t image_chunks = backward_chunks(g.n, wsize * static_cast<std::int64_t>(sizeof(T)));
  const std::int64_t units = image_chunks * g.groups;  // (image range, group)
  std::vector<T> partials(dw ? static_cast<std::size_t>(image_chunks * wsize) : 0, T(0));
  auto run_unit = [&](std::int64_t unit) {
    const std::int64_t ic = unit / g.groups, grp = unit % g.groups;
    const std::int64_t img0 = ic * g.n / image_chunks, img1 = (ic + 1) * g.n / image_chunks;
    T* dwp = dw ? partials.data() + ic * wsize + grp * og * kdim : nullptr;
    const T* wg = w + grp * og * kdim;
    if (dx && !g.pointwise())
      for (std::int64_t img = img0; img < img1; ++img) {
        T* d = dx + (img * g.c + grp * cg) * hw;
        std::fill(d, d + cg * hw, T(0));
      }
    std::vector<Run> runs;
    for (std::int64_t q0 = img0 * p; q0 < img1 * p;) {
      // Pixels [q0, q0 + cnt): within one image, or whole images.
      const std::int64_t img = q0 / p, pix = q0 % p;
      const std::int64_t cnt = nb <= p ? std::min(nb, p - pix) : std::min(nb, (img1 - img) * p);
      const std::int64_t in_off = (img * g.c + grp * cg) * hw;
      // dY of the block as [og, cnt]: in place within one image, else gathered image by image.
      const T* dyb = dy + (img * g.o + grp * og) * p + pix;
      std::int64_t ld = p;
      if (cnt > p - pix) {
        T* buf = scratch_data<T>(kInput, og * cnt);
        for (std::int64_t i = 0; i < cnt / p; ++i)
          for (std::int64_t m = 0; m < og; ++m) {
            const T* src = dy + ((img + i) * g.o + grp * og + m) * p;
            std::copy(src, src + p, buf + m * cnt + i * p);
          }
        dyb = buf;
        ld = cnt;
      }
      if (g.pointwise()) {
        // The input is its own im2col matrix (rows of p pixels); so is dx.
        if (dwp) weight_grad_gemm(og, kdim, cnt, dyb, ld, x + in_off + pix, p, dwp);
        if (dx) gemm(true, false, kdim, cnt, og, T(1), wg, kdim, dyb, ld, T(0), dx + in_off + pix, p);
      } else {
        pixel_runs(g, q0, cnt, runs);
        if (dwp) {
          T* col = scratch_data<T>(kOperand, kdim * cnt);
          bool packed = false;
#if KG_CONV_AVX512
          if constexpr (std::is_same_v<T, float>) {
            if (g.sw <= 2 && cpu_has_avx512f()) {
              avx::RunPacker(g, x, grp * cg, runs).pack(0, kdim, col, cnt);
              packed = true;
            }
          }
#endif
          if (!packed) im2col_runs(g, x, grp * cg, 0, kdim, runs, col, cnt);
          weight_grad_gemm(og, kdim, cnt, dyb, ld, col, cnt, dwp);
        }
        if (dx) {
          T* dcol = scratch_data<T>(kResults, kdim * cnt);
          gemm(true, false, kdim, cnt, og, T(1), wg, kdim, dyb, ld, T(0), dcol, cnt);
          col2im_runs(g, dx, grp * cg, 0, kdim, runs, dcol, cnt);
        }
      }
      q0 += cnt;
    }
  };
  if (units == 1) {
    run_unit(0);  // one unit: the BLAS library threads its GEMMs
  } else {
    BlasSingleThreaded single;
    ctx.parallel_for(units, 1, [&](std::int64_t u0, std::int64_t u1) {
      for (std::int64_t u = u0; u < u1; ++u) run_unit(u);
    });
  }
  if (dw) {
    ctx.parallel_for(wsize, 4096, [&](std::int64_t i0, std::int64_t i1) {
      for (std::int64_t i = i0; i < i1; ++i) {
        T s = partials[static_cast<std::size_t>(i)];
        for (std::int64_t c = 1; c < image_chunks; ++c) s += partials[static_cast<std::size_t>(c * wsize + i)];
        dw[i] = s;
      }
    });
  }
}

}  // namespace

bool conv_algo_available(ConvAlgo algo, DType dtype) { return algo_available(algo, dtype); }

ConvAlgo conv_algo_for(const Conv2dOp& op, const std::vector<std::int64_t>& input, DType dtype) {
  const Shape out = op.infer_output_shape({Shape::of(input)});
  return choose_algo(geometry(op, input, out.sizes()), dtype);
}

void conv2d_cpu(const Conv2dOp& op, ConvAlgo algo, CpuContext& ctx) {
  if (is_half_float(ctx.output.dtype()))
    return cpu_forward_in_f32(ctx, [&](CpuContext& c) { conv2d_cpu(op, algo, c); });
  const Tensor& x = ctx.inputs[0];
  const ConvGeom g = geometry(op, x.shape(), ctx.output.shape());
  dispatch_float(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    Epilogue<T> ep;
    if (op.options().bias) ep.shift = ctx.params[1].data<T>();
    conv2d_forward<T>(g, algo, x.data<T>(), ctx.params[0].data<T>(), ep, ctx.output.data<T>(), ctx);
  });
}

namespace {

// The GPU lowering's view of a convolution (conv_gpu.hpp) run in `dtype`, the node's: the op's
// own, or f16 / bf16 for an f32 convolution loaded in a reduced precision.
ConvGpuConfig gpu_config(const Conv2dOp& op, DType dtype) {
  ConvGpuConfig c;
  c.in_channels = op.in_channels();
  c.out_channels = op.out_channels();
  c.kernel = op.kernel();
  c.options = op.options();
  c.dtype = dtype;
  return c;
}

// ... and of a fused one, with its epilogue.
ConvGpuConfig gpu_config(const FusedConv2dOp& op, DType dtype) { return conv_gpu_config(op.conv(), op.spec(), dtype); }

// The one dtype of a convolution's inputs: f32, f64, or f16 / bf16 (for inference).
DType input_dtype(const std::vector<DType>& in) {
  for (DType t : in)
    if (!is_floating(t))
      throw Error(
          util::cat("supports f32 and f64 inputs (and f16 and bf16 for inference), got ", dtype_name(t)));
  return require_float_or_half(in);
}

// True when a node of dtype `t` may hold parameters declared as `declared`: the same dtype, or
// f32 ones that the graph converted for a node computing in f16 or bf16 (CustomOp::computes_in).
bool params_fit(DType declared, DType t) {
  return declared == t || (declared == DType::F32 && is_half_float(t));
}

// The error for the gradients of a 16-bit convolution, which are not implemented.
[[noreturn]] void no_half_backward(const std::string& op, DType t) {
  throw Error(util::cat(op, " has no ", dtype_name(t),
                        " backward: 16-bit convolutions run in inference only (train the model in f32)"));
}

}  // namespace

ConvGpuConfig conv_gpu_config(const Conv2dOp& conv, const ConvEpilogueSpec& spec, DType dtype) {
  ConvGpuConfig c = gpu_config(conv, dtype);
  c.batch_norm = spec.batch_norm;
  c.bn_eps = spec.bn_eps;
  c.residual = spec.residual;
  c.activation = spec.activation;
  c.activation_form = spec.activation_form;
  return c;
}

// ---- nn.conv2d ----

Conv2dOp::Conv2dOp(std::int64_t in_channels, std::int64_t out_channels, Size2 kernel,
                   const nn::Conv2dOptions& options, DType dtype)
    : in_(in_channels), out_(out_channels), kernel_(kernel), opt_(options), dtype_(dtype) {}

std::string Conv2dOp::attributes() const {
  std::string s = util::cat("in=", in_, " out=", out_, " k=", size2_text(kernel_),
                            " s=", size2_text(opt_.stride), " p=", size2_text(opt_.padding));
  if (opt_.dilation.h != 1 || opt_.dilation.w != 1) s += " d=" + size2_text(opt_.dilation);
  if (opt_.groups != 1) s += util::cat(" groups=", opt_.groups);
  if (!opt_.bias) s += " bias=false";
  return s;
}

Shape Conv2dOp::infer_output_shape(const std::vector<Shape>& in) const {
  require_inputs(in, 1);
  if (out_ <= 0) throw Error(util::cat("out_channels must be positive, got ", out_));
  if (kernel_.h <= 0 || kernel_.w <= 0)
    throw Error(util::cat("kernel size must be positive, got ", kernel_.h, "x", kernel_.w));
  if (opt_.stride.h <= 0 || opt_.stride.w <= 0)
    throw Error(util::cat("stride must be positive, got ", opt_.stride.h, "x", opt_.stride.w));
  if (opt_.dilation.h <= 0 || opt_.dilation.w <= 0)
    throw Error(util::cat("dilation must be positive, got ", opt_.dilation.h, "x", opt_.dilation.w));
  if (opt_.padding.h < 0 || opt_.padding.w < 0)
    throw Error(util::cat("padding must be non-negative, got ", opt_.padding.h, "x", opt_.padding.w));
  if (opt_.groups <= 0) throw Error(util::cat("groups must be positive, got ", opt_.groups));
  const Shape& x = in[0];
  require_rank(x, 4, "[N, C, H, W]");
  if (x[1].is_dynamic())
    throw Error(util::cat("needs a known channel count (dim 1) to size its weight, got ", x.to_string()));
  if (in_ >= 0 && x[1].size() != in_)
    throw Error(util::cat("expects ", in_, " input channels, got ", x.to_string()));
  const std::int64_t c = x[1].size();
  if (c % opt_.groups != 0)
    throw Error(util::cat("in_channels ", c, " is not divisible by groups ", opt_.groups));
  if (out_ % opt_.groups != 0)
    throw Error(util::cat("out_channels ", out_, " is not divisible by groups ", opt_.groups));
  Shape out{
      x[0], Dim(out_),
      window_out(x[2], kernel_.h, opt_.stride.h, opt_.padding.h, opt_.dilation.h, false, "input height"),
      window_out(x[3], kernel_.w, opt_.stride.w, opt_.padding.w, opt_.dilation.w, false, "input width")};
  return out;
}

DType Conv2dOp::infer_output_dtype(const std::vector<DType>& in) const {
  DType t = input_dtype(in);
  if (!params_fit(dtype_, t))
    throw Error(util::cat("input is ", dtype_name(t), " but the parameters are ", dtype_name(dtype_)));
  return t;
}

std::vector<ParamSpec> Conv2dOp::parameters(const std::vector<Shape>&) const {
  // PyTorch: kaiming_uniform(a=sqrt(5)) gives U(-1/sqrt(fan_in), 1/sqrt(fan_in)); the bias the same.
  const std::int64_t cg = in_ / opt_.groups;
  const std::int64_t fan_in = cg * kernel_.h * kernel_.w;
  const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
  std::vector<ParamSpec> p{
      {"weight", {out_, cg, kernel_.h, kernel_.w}, dtype_, ParamInit::uniform(-bound, bound), true}};
  if (opt_.bias) p.push_back({"bias", {out_}, dtype_, ParamInit::uniform(-bound, bound), true});
  return p;
}

void Conv2dOp::cpu_forward(CpuContext& ctx) const { conv2d_cpu(*this, ConvAlgo::Auto, ctx); }

std::optional<Lowered> Conv2dOp::lower(const LowerContext& ctx) const {
  return lower_conv(gpu_config(*this, ctx.output_dtype), name());
}

std::string Conv2dOp::lower_backward_source(const LowerContext& ctx) const {
  if (is_half_float(ctx.output_dtype)) no_half_backward(name(), ctx.output_dtype);
  return conv2d_backward_source();
}

void Conv2dOp::cpu_backward(CpuBackwardContext& ctx) const {
  const Tensor& x = ctx.inputs[0];
  if (is_half_float(x.dtype())) no_half_backward(name(), x.dtype());
  const ConvGeom g = geometry(*this, x.shape(), ctx.grad_output.shape());
  dispatch_float(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    T* dx = ctx.wants_input_grad(0) ? ctx.grad_inputs[0].data<T>() : nullptr;
    T* dw = ctx.wants_param_grad(0) ? ctx.grad_params[0].data<T>() : nullptr;
    T* db = opt_.bias && ctx.wants_param_grad(1) ? ctx.grad_params[1].data<T>() : nullptr;
    conv2d_backward<T>(g, dw ? x.data<T>() : nullptr, ctx.params[0].data<T>(), ctx.grad_output.data<T>(), dx, dw,
                       db, ctx);
  });
}

// ---- nn.fused_conv2d ----

FusedConv2dOp::FusedConv2dOp(Conv2dOp conv, ConvEpilogueSpec spec, std::vector<ParamSpec> params)
    : conv_(std::move(conv)), spec_(std::move(spec)), params_(std::move(params)) {}

std::optional<Lowered> FusedConv2dOp::lower(const LowerContext& ctx) const {
  return lower_conv(gpu_config(*this, ctx.output_dtype), name());
}

std::string FusedConv2dOp::attributes() const {
  std::vector<std::string> parts;
  for (std::size_t i = 0; i < spec_.fused_nodes.size(); ++i) {
    std::string op = i < spec_.fused_ops.size() ? spec_.fused_ops[i] : "";
    parts.push_back(spec_.fused_nodes[i] + ":" + op);
  }
  std::string what;
  if (spec_.batch_norm) what += util::cat(" batch_norm(eps=", spec_.bn_eps, ")");
  if (spec_.residual) what += " add";
  if (spec_.activation)
    what += util::cat(" ", kUnaryOps[static_cast<std::size_t>(spec_.activation->fn)].op_name);
  if (spec_.activation_form) what += " " + spec_.activation_op;
  return util::cat(conv_.attributes(), " epilogue=[", what.empty() ? "" : what.substr(1), "] fused=[",
                   util::join(parts, ", "), "]");
}

Shape FusedConv2dOp::infer_output_shape(const std::vector<Shape>& in) const {
  require_inputs(in, spec_.residual ? 2 : 1);
  Shape out = conv_.infer_output_shape({in[0]});
  if (spec_.residual && !(in[1] == out))
    throw Error(util::cat("the residual ", in[1].to_string(), " must have the convolution's output shape ",
                          out.to_string()));
  return out;
}

DType FusedConv2dOp::infer_output_dtype(const std::vector<DType>& in) const {
  DType t = input_dtype(in);
  for (const ParamSpec& p : params_)
    if (is_floating(p.dtype) && !params_fit(p.dtype, t))
      throw Error(
          util::cat("input is ", dtype_name(t), " but parameter '", p.name, "' is ", dtype_name(p.dtype)));
  return conv_.infer_output_dtype({t});
}

void FusedConv2dOp::cpu_forward(CpuContext& ctx) const {
  if (is_half_float(ctx.output.dtype()))
    return cpu_forward_in_f32(ctx, [&](CpuContext& c) { cpu_forward(c); });
  const Tensor& x = ctx.inputs[0];
  const ConvGeom g = geometry(conv_, x.shape(), ctx.output.shape());
  const bool has_bias = conv_.options().bias;
  const std::size_t bn_at = has_bias ? 2 : 1;
  const auto oc = static_cast<std::size_t>(g.o);
  dispatch_float(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* bias = has_bias ? ctx.params[1].data<T>() : nullptr;
    T* y = ctx.output.data<T>();
    Epilogue<T> ep;
    ep.residual = spec_.residual ? ctx.inputs[1].data<T>() : nullptr;
    ep.act = spec_.activation;
    // A user's form runs after the convolution over large chunks of the output: called once per
    // output row (a few dozen pixels) its per-call cost was larger than the convolution's.
    const ElementwiseForm* form = spec_.activation_form ? &*spec_.activation_form : nullptr;
    const auto apply_form = [&] {
      if (!form) return;
      constexpr std::int64_t kChunk = 1 << 14;
      ctx.parallel_for(ctx.output.numel(), kChunk, [&](std::int64_t b, std::int64_t e) {
        for (std::int64_t at = b; at < e; at += kChunk) {
          const std::int64_t n = std::min(kChunk, e - at);
          const void* in[1] = {y + at};
          form->cpu(ElementwiseSpan{std::is_same_v<T, double> ? DType::F64 : DType::F32, in, nullptr, y + at, n, 0});
        }
      });
    };
    std::vector<T> scale, shift;
    if (!spec_.batch_norm) {
      ep.shift = bias;
      conv2d_forward<T>(g, ConvAlgo::Auto, x.data<T>(), ctx.params[0].data<T>(), ep, y, ctx);
      apply_form();
      return;
    }
    // Inference only: the lowering keeps batch norms unfused for training.
    if (ctx.training)
      throw Error("a batch norm fused for inference cannot run in train mode; lower the model for training");
    const T* gamma = ctx.params[bn_at].data<T>();
    const T* beta = ctx.params[bn_at + 1].data<T>();
    const T* mean = ctx.params[bn_at + 2].data<T>();
    const T* var = ctx.params[bn_at + 3].data<T>();
    // y = (conv + bias - mean) * s + beta with s = gamma / sqrt(var + eps), as one scale and shift.
    scale.resize(oc);
    shift.resize(oc);
    for (std::size_t c = 0; c < oc; ++c) {
      const double s = static_cast<double>(gamma[c]) / std::sqrt(static_cast<double>(var[c]) + spec_.bn_eps);
      const double b = bias ? static_cast<double>(bias[c]) : 0.0;
      scale[c] = static_cast<T>(s);
      shift[c] = static_cast<T>(static_cast<double>(beta[c]) + (b - static_cast<double>(mean[c])) * s);
    }
    ep.scale = scale.data();
    ep.shift = shift.data();
    conv2d_forward<T>(g, ConvAlgo::Auto, x.data<T>(), ctx.params[0].data<T>(), ep, y, ctx);
    apply_form();
  });
}

}  // namespace kg::ops

namespace kg::nn {

SymTensor conv2d(const SymTensor& x, std::int64_t out_channels, Size2 kernel, const Conv2dOptions& options,
                 const std::string& name) {
  const Shape& s = x.shape();
  // An unusable input is reported by infer_output_shape, with the node's label.
  const std::int64_t in = s.rank() == 4 && s[1].is_static() ? s[1].size() : -1;
  return x.record_custom(CustomData::make<ops::Conv2dOp>(in, out_channels, kernel, options, x.dtype()), {},
                         std::nullopt, name);
}

}  // namespace kg::nn
