// nn.conv2d and nn.fused_conv2d on the GPU, for [N, C, H, W] inputs and [O, C/groups, kh, kw]
// weights with any stride, padding, dilation and groups. Three algorithms (ops/conv_gpu.cpp picks
// one from the op's configuration):
//
// - tiled: stride 1, no dilation, kernels up to 7x7, up to 64 output channels per block. A
//   block computes a tile of output rows and columns for a chunk of a group's channels: it
//   stages the input window of the tile (zero-padded) and the weights (transposed to [tap][o])
//   in shared memory, a chunk of input channels at a time, then each thread computes OCB
//   channels × PX consecutive columns of one row, reading PX + KW - 1 inputs per kernel row and
//   OCB weights per tap as one vector. Kernel sizes, OCB and PX are template arguments, so the
//   tap loops unroll; the tile sizes are chosen per shape at launch.
// - direct: the general small convolution: one thread per output pixel and block of up to four
//   output channels of one group, looping over the group's input channels and the kernel window
//   and reading each input value once for all its channels. Consecutive threads take
//   consecutive pixels of the same channels, so input reads are coalesced and weight reads are
//   one broadcast per warp.
// - gemm: an implicit GEMM per group, out[m, p] = sum_k w[m, k] * B(k, p) with k = (c, ky, kx)
//   the weight's own layout and p = (image, oy, ox), B read straight from the input (0 in the
//   padding). 64×64 output tiles, 16-deep k slices in shared memory, 256 threads each computing
//   4×4, as src/ops/gemm.cuh; the slice's tap offsets are decoded once per slice into shared
//   memory, so the gathers take no divisions. For many output channels and deep reductions.
//
// A launch covers fewer than 2^31 output items (direct), pixels (gemm) or blocks (tiled), so
// that the index math divides in 32 bits; the host splits larger batches into several launches
// of whole images (ops/conv_gpu.cpp), each with its own base pointers and image count.
//
// All apply the epilogue to each output value before it is stored: the bias, or a folded
// BatchNorm computed from its parameters (scale = gamma / sqrt(var + eps) and shift = beta +
// (bias - mean) * scale, in double as on the CPU), then the residual add and the activation.
// A null bias / bn_weight / residual pointer leaves that step out.
//
// The kernels are templates over the element type T of every tensor (float, double, or
// kg_dtype.cuh's 16-bit kg_f16 and kg_bf16): they read elements as the compute type C =
// kg_compute_t<T> (float for the 16-bit types), accumulate, stage shared memory and apply the
// epilogue in C, and round once when the result is stored. The activation functor takes and
// returns C.
//
// The entries here are direct and gemm without an activation, and the epilogue alone, for each
// element type. Other kernels get their source from ops/conv_gpu.cpp: elementwise.cu for an
// activation's formula, this file up to the "---- entries ----" line, and one entry with the
// same parameters as those below that calls kg_conv2d_direct, kg_conv2d_gemm or kg_conv2d_tiled
// with an activation functor.
#include "conv_shared.cuh"  // KG_CONV_* and KgConvShape, shared with ops/conv_gpu.cpp
#include "index.cuh"        // KgPack, kg_strided_unrolled
#include "kg_device.cuh"
#include "mma.cuh"

template <class T>
struct KgConvEpilogue {
  const T* bias;
  const T* bn_weight;  // null: no batch norm (then bn_bias, bn_mean, bn_var are unused)
  const T* bn_bias;
  const T* bn_mean;
  const T* bn_var;
  const T* residual;  // laid out as the output; null: none
  double eps;
};

// An activation functor of compute type C that applies nothing.
template <class C>
struct KgConvIdentity {
  __device__ __forceinline__ C operator()(C v) const { return v; }
};

// *p through the read-only data cache, as the compute type.
__device__ __forceinline__ float kg_conv_ldg(const float* p) { return __ldg(p); }
__device__ __forceinline__ double kg_conv_ldg(const double* p) { return __ldg(p); }
__device__ __forceinline__ float kg_conv_ldg(const kg_f16* p) { return kg_f16_to_float(__ldg(&p->bits)); }
__device__ __forceinline__ float kg_conv_ldg(const kg_bf16* p) { return kg_bf16_to_float(__ldg(&p->bits)); }

// The per-channel affine map of output channel o: y = conv * scale + shift.
template <class T>
__device__ __forceinline__ void kg_conv_affine(const KgConvEpilogue<T>& ep, long long o,
                                               kg_compute_t<T>& scale, kg_compute_t<T>& shift) {
  typedef kg_compute_t<T> C;
  if (ep.bn_weight) {
    const double s = (double)kg_ld(ep.bn_weight, o) / sqrt((double)kg_ld(ep.bn_var, o) + ep.eps);
    const double b = ep.bias ? (double)kg_ld(ep.bias, o) : 0.0;
    scale = (C)s;
    shift = (C)((double)kg_ld(ep.bn_bias, o) + (b - (double)kg_ld(ep.bn_mean, o)) * s);
  } else {
    scale = C(1);
    shift = ep.bias ? kg_ld(ep.bias, o) : C(0);
  }
}

// y[at] = act(acc * scale + shift + residual[at]), computed in C and rounded into T once.
template <class T, class Act>
__device__ __forceinline__ void kg_conv_store(const KgConvEpilogue<T>& ep, const Act& act, T* __restrict__ y,
                                              long long at, kg_compute_t<T> acc, kg_compute_t<T> scale,
                                              kg_compute_t<T> shift) {
  kg_compute_t<T> v = acc * scale + shift;
  if (ep.residual) v += kg_ld(ep.residual, at);
  kg_st(y, at, act(v));
}

// Where the channels-last prologue puts the shift after `filter` weights of `esize` bytes: the
// first element at a multiple of KG_CONV_SCRATCH_ALIGN bytes (as ops/conv_gpu.cpp places it).
__device__ __forceinline__ long long kg_conv_shift_offset(long long filter, long long esize) {
  return (filter * esize + KG_CONV_SCRATCH_ALIGN - 1) / KG_CONV_SCRATCH_ALIGN * KG_CONV_SCRATCH_ALIGN / esize;
}

// V consecutive elements, loaded and stored as one 16-byte access.
template <class T, int V>
struct alignas(16) KgConvPack {
  T e[V];
};

// a / b and a % b for 0 <= a, b < 2^31.
__device__ __forceinline__ unsigned kg_conv_divmod(unsigned a, unsigned b, unsigned& rem) {
  const unsigned q = a / b;
  rem = a - q * b;
  return q;
}

// ---- direct ----

template <class T, int OCB, class Act>
__device__ __forceinline__ void kg_conv2d_direct_run(const T* __restrict__ x, const T* __restrict__ w,
                                                     T* __restrict__ y, const KgConvShape& s,
                                                     const KgConvEpilogue<T>& ep, const Act& act) {
  typedef kg_compute_t<T> C;
  const unsigned groups = (unsigned)s.groups, og = (unsigned)(s.o / s.groups),
                 cg = (unsigned)(s.c / s.groups);
  const unsigned nob = (og + OCB - 1) / OCB;  // channel blocks per group
  const unsigned hwo = (unsigned)(s.ho * s.wo), wo = (unsigned)s.wo;
  const long long hwi = s.h * s.w;
  const unsigned total = (unsigned)s.n * groups * nob * hwo;
  const int kh = (int)s.kh, kw = (int)s.kw, h = (int)s.h, wd = (int)s.w;
  const int dh = (int)s.dh, dw = (int)s.dw;
  const int kdim = (int)(cg * kh * kw);
  for (unsigned t = blockIdx.x * blockDim.x + threadIdx.x; t < total; t += gridDim.x * blockDim.x) {
    unsigned pix, ob, g, ox;
    const unsigned img = kg_conv_divmod(kg_conv_divmod(kg_conv_divmod(t, hwo, pix), nob, ob), groups, g);
    const unsigned oy = kg_conv_divmod(pix, wo, ox);
    const unsigned oc0 = g * og + ob * OCB;
    const int nvalid = min(OCB, (int)(og - ob * OCB));
    // Offsets of the block's weight rows from the first; a channel past the group's end re-reads
    // the first row and is not stored.
    int woff[OCB];
#pragma unroll
    for (int j = 0; j < OCB; ++j) woff[j] = (j < nvalid ? j : 0) * kdim;
    C acc[OCB];
#pragma unroll
    for (int j = 0; j < OCB; ++j) acc[j] = C(0);
    const int iy0 = (int)(oy * s.sh - s.ph), ix0 = (int)(ox * s.sw - s.pw);
    const T* xc = x + ((long long)img * s.c + (long long)g * cg) * hwi;
    const T* wk = w + (long long)oc0 * kdim;  // the weights of tap (c, ky, 0)
    for (unsigned c = 0; c < cg; ++c, xc += hwi) {
      for (int ky = 0; ky < kh; ++ky, wk += kw) {
        const int iy = iy0 + ky * dh;
        if ((unsigned)iy >= (unsigned)h) continue;
        const T* row = xc + iy * wd;
        for (int kx = 0; kx < kw; ++kx) {
          const int ix = ix0 + kx * dw;
          if ((unsigned)ix >= (unsigned)wd) continue;
          const C v = kg_ld(row, ix);
#pragma unroll
          for (int j = 0; j < OCB; ++j) acc[j] += v * kg_conv_ldg(wk + woff[j] + kx);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < OCB; ++j) {
      if (j >= nvalid) break;
      const long long o = oc0 + j;
      C scale, shift;
      kg_conv_affine(ep, o, scale, shift);
      kg_conv_store(ep, act, y, ((long long)img * s.o + o) * hwo + pix, acc[j], scale, shift);
    }
  }
}

template <class T, class Act>
__device__ __forceinline__ void kg_conv2d_direct(const T* __restrict__ x, const T* __restrict__ w,
                                                 T* __restrict__ y, const KgConvShape& s,
                                                 const KgConvEpilogue<T>& ep, const Act& act) {
  if (s.ocb == 4)
    kg_conv2d_direct_run<T, 4>(x, w, y, s, ep, act);
  else if (s.ocb == 2)
    kg_conv2d_direct_run<T, 2>(x, w, y, s, ep, act);
  else
    kg_conv2d_direct_run<T, 1>(x, w, y, s, ep, act);
}

// ---- channels-last ----
// One thread per output element of [N, OH, OW, O], the channel fastest, so consecutive threads
// share their input reads; each loops over the window's taps and the group's input channels,
// which lie next to each other in memory. The reference and the fallback of the channels-last
// convolution, whose fast path is a vendor library (ops/conv_gpu.cpp).

template <class T, class Act>
__device__ __forceinline__ void kg_conv2d_nhwc(const T* __restrict__ x, const T* __restrict__ w,
                                               T* __restrict__ y, const KgConvShape& s,
                                               const KgConvEpilogue<T>& ep, const Act& act) {
  typedef kg_compute_t<T> C;
  const unsigned o_count = (unsigned)s.o, og = (unsigned)(s.o / s.groups), cg = (unsigned)(s.c / s.groups);
  const unsigned wo = (unsigned)s.wo, ho = (unsigned)s.ho;
  const unsigned total = (unsigned)(s.n * s.ho * s.wo * s.o);  // < 2^31: the host splits launches
  const int kh = (int)s.kh, kw = (int)s.kw, h = (int)s.h, wd = (int)s.w;
  for (unsigned t = blockIdx.x * blockDim.x + threadIdx.x; t < total; t += gridDim.x * blockDim.x) {
    unsigned o, ox, oy;
    const unsigned img = kg_conv_divmod(kg_conv_divmod(kg_conv_divmod(t, o_count, o), wo, ox), ho, oy);
    const unsigned first = o / og * cg;  // the group's first input channel
    const int iy0 = (int)(oy * s.sh - s.ph), ix0 = (int)(ox * s.sw - s.pw);
    const T* wt = w + (long long)o * cg * kh * kw;  // [c][ky][kx]
    C acc = C(0);
    for (int ky = 0; ky < kh; ++ky) {
      const int iy = iy0 + ky * (int)s.dh;
      if ((unsigned)iy >= (unsigned)h) continue;
      for (int kx = 0; kx < kw; ++kx) {
        const int ix = ix0 + kx * (int)s.dw;
        if ((unsigned)ix >= (unsigned)wd) continue;
        const T* px = x + (((long long)img * h + iy) * wd + ix) * s.c + first;
        const T* wk = wt + ky * kw + kx;
        for (unsigned c = 0; c < cg; ++c) acc += kg_ld(px, c) * kg_conv_ldg(wk + (long long)c * kh * kw);
      }
    }
    C scale, shift;
    kg_conv_affine(ep, o, scale, shift);
    kg_conv_store(ep, act, y, (long long)t, acc, scale, shift);
  }
}

// The prologue of the channels-last library call (ops/conv_gpu.cpp): the weights
// [O, C/g, kh, kw] laid out [O, kh, kw, cp] into `out` with each output channel's scale folded in
// (a BatchNorm's; 1 without) and channels c >= C/g of a padded input 0 (cp = s.cpad with one
// group, else C/g), or [O, s.gemm_k] in the k order of s.gemm_c channels a tap where s.gemm_k is
// set; then, from the first multiple of KG_CONV_SCRATCH_ALIGN bytes after them, each channel's
// shift (bias and BatchNorm).
template <class T>
__device__ __forceinline__ void kg_conv2d_filter_nhwc(const T* __restrict__ w, T* __restrict__ out,
                                                      const KgConvShape& s, const KgConvEpilogue<T>& ep) {
  typedef kg_compute_t<T> C;
  const long long cg = s.c / s.groups, cp = s.groups == 1 ? s.cpad : cg, taps = s.kh * s.kw;
  const long long filter = s.gemm_k ? s.o * s.gemm_k : s.o * taps * cp;
  const long long shift_at = kg_conv_shift_offset(filter, sizeof(T));
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < filter + s.o;
       i += (long long)gridDim.x * blockDim.x) {
    const long long o = i >= filter ? i - filter : i / (s.gemm_k ? s.gemm_k : cp * taps);
    C scale, shift;
    kg_conv_affine(ep, o, scale, shift);
    if (i >= filter) {
      kg_st(out, shift_at + o, shift);
      continue;
    }
    if (s.gemm_k) {  // the GEMM form and nhwc_mma: [O, gemm_k], k = tap·gemm_c + c, zeros past the taps
      const long long k = i % s.gemm_k, c = k % s.gemm_c, tap = k / s.gemm_c;
      kg_st(out, i, tap < taps && c < cg ? kg_ld(w, (o * cg + c) * taps + tap) * scale : C(0));
      continue;
    }
    const long long c = i % cp, tap = (i / cp) % taps;
    kg_st(out, i, c < cg ? kg_ld(w, (o * cg + c) * taps + tap) * scale : C(0));
  }
}

// The GEMM form's rows: for each output pixel p = (n, oy, ox) of [N, OH, OW], the window's
// inputs in the weights' order, k = (ky·kw + kx)·C + c, zero where the window leaves the input
// and past kh·kw·C (the row is s.gemm_k long, a multiple of 8). One thread writes V = 16 /
// sizeof(T) consecutive elements of a row as one 16-byte store. When V divides C (a 1×1
// convolution's subsampled pixels, say) the V elements lie in one tap and are read as one 16-byte
// load; otherwise (few channels: ResNet's stem) element by element, walking (ky, kx, c) from the
// first. Index math in I (int where every index fits, else long long).
template <class T, class I>
__device__ __forceinline__ void kg_conv2d_im2col_nhwc_run(const T* __restrict__ x, T* __restrict__ out,
                                                          const KgConvShape& s) {
  constexpr int V = 16 / (int)sizeof(T);
  typedef KgConvPack<T, V> P;
  const I chunks = (I)(s.gemm_k / V), c = (I)s.c, kh = (I)s.kh, kw = (I)s.kw;
  const I ho = (I)s.ho, wo = (I)s.wo, h = (I)s.h, w = (I)s.w;
  const I total = (I)s.n * ho * wo * chunks;
  const bool packed = c % V == 0;
  const T zero = kg_from_compute<T>(kg_compute_t<T>(0));
  for (I i = (I)(blockIdx.x * blockDim.x + threadIdx.x); i < total; i += (I)(gridDim.x * blockDim.x)) {
    const I p = i / chunks, k = (i - p * chunks) * V;
    const I q = p / wo, ox = p - q * wo, n = q / ho, oy = q - n * ho;
    const I tap = k / c;
    I cc = k - tap * c, ky = tap / kw, kx = tap - ky * kw;
    const I y0 = oy * (I)s.sh - (I)s.ph, x0 = ox * (I)s.sw - (I)s.pw;
    P v;
    if (packed) {
      const I iy = y0 + ky * (I)s.dh, ix = x0 + kx * (I)s.dw;
      if (ky < kh && iy >= 0 && iy < h && ix >= 0 && ix < w) {
        v = *reinterpret_cast<const P*>(x + ((n * h + iy) * w + ix) * c + cc);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) v.e[j] = zero;
      }
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const I iy = y0 + ky * (I)s.dh, ix = x0 + kx * (I)s.dw;
        v.e[j] = ky < kh && iy >= 0 && iy < h && ix >= 0 && ix < w ? x[((n * h + iy) * w + ix) * c + cc] : zero;
        if (++cc == c) {
          cc = 0;
          if (++kx == kw) kx = 0, ++ky;
        }
      }
    }
    *reinterpret_cast<P*>(out + (long long)i * V) = v;
  }
}

template <class T>
__device__ __forceinline__ void kg_conv2d_im2col_nhwc(const T* __restrict__ x, T* __restrict__ out,
                                                      const KgConvShape& s) {
  const long long limit = 2147483647LL - 65535LL * 32 * KG_CONV_THREADS;  // room for the stride
  if (s.n * s.ho * s.wo * s.gemm_k <= limit && s.n * s.h * s.w * s.c <= limit)
    kg_conv2d_im2col_nhwc_run<T, int>(x, out, s);
  else
    kg_conv2d_im2col_nhwc_run<T, long long>(x, out, s);
}

// The NCHW GEMM form's columns (one group): for each image n, cols[n] is [K, OH·OW] with
// K = C·kh·kw in the weights' own order, k = (c·kh + ky)·kw + kx, so that y[n] [O, OH·OW] =
// w [O, K] · cols[n]; zero where the window leaves the input. One thread per element, consecutive
// threads along the output pixels. Index math in I (int where every index fits, else long long).
template <class T, class I>
__device__ __forceinline__ void kg_conv2d_im2col_nchw_run(const T* __restrict__ x, T* __restrict__ out,
                                                          const KgConvShape& s) {
  const I ho = (I)s.ho, wo = (I)s.wo, h = (I)s.h, w = (I)s.w, kh = (I)s.kh, kw = (I)s.kw;
  const I hwo = ho * wo, k_all = (I)s.c * kh * kw;
  const I total = (I)s.n * k_all * hwo;
  const T zero = kg_from_compute<T>(kg_compute_t<T>(0));
  for (I i = (I)(blockIdx.x * blockDim.x + threadIdx.x); i < total; i += (I)(gridDim.x * blockDim.x)) {
    const I q = i / hwo, p = i - q * hwo;  // q = n·K + k
    const I n = q / k_all, k = q - n * k_all;
    const I r = k / kw, kx = k - r * kw, c = r / kh, ky = r - c * kh;
    const I oy = p / wo, ox = p - oy * wo;
    const I iy = oy * (I)s.sh - (I)s.ph + ky * (I)s.dh, ix = ox * (I)s.sw - (I)s.pw + kx * (I)s.dw;
    out[i] = iy >= 0 && iy < h && ix >= 0 && ix < w ? x[((n * (I)s.c + c) * h + iy) * w + ix] : zero;
  }
}

template <class T>
__device__ __forceinline__ void kg_conv2d_im2col_nchw(const T* __restrict__ x, T* __restrict__ out,
                                                      const KgConvShape& s) {
  const long long limit = 2147483647LL - 65535LL * 32 * KG_CONV_THREADS;  // room for the stride
  if (s.n * s.c * s.kh * s.kw * s.ho * s.wo <= limit && s.n * s.c * s.h * s.w <= limit)
    kg_conv2d_im2col_nchw_run<T, int>(x, out, s);
  else
    kg_conv2d_im2col_nchw_run<T, long long>(x, out, s);
}

// ---- channels-last on tensor cores (f16, bf16; one group) ----
// An implicit GEMM: y[p, o] = act(sum_k rows[p, k] · w'[o, k] + shift[o] + residual[p, o]) over
// the output pixels p = (n, oy, ox) of [N, OH, OW] and k = (ky·kw + kx)·CP + c < K = s.gemm_k
// (CP = s.gemm_c: C, or C rounded up to even on the few-channel path below), where w' is the
// weights as the filter launch lays them out ([O, K], a BatchNorm's scale folded in, zeros in
// padding channels and past kh·kw·CP), `shift` (ep.bias) the per-channel shift it writes after
// them, and the rows are gathered from the input [N, H, W, C] as they are needed, zero outside the
// image. A block of 256 threads computes a tile of KG_IG_BM (128) pixels × KG_IG_BN (64) channels:
// 8 warps as 4 × 2, each 32 × 32 with mma.m16n8k16 (mma.cuh), over k in slices of KG_IG_BK staged in
// shared memory, two buffers deep: the next slice is read into registers while the tensor cores
// work on this one. Each thread reads 16 bytes of two rows and of one weight row per slice: one
// 16-byte load where C is a multiple of 8 (the 8 elements lie in one tap), element by element
// otherwise (few channels where the few-channel path's patch does not fit). K is a multiple of 8,
// so no 8-element chunk crosses it.
// Grid: x over pixel tiles, y over channel tiles. The tile sizes are conv_shared.cuh's.
// Shared-memory row length in elements: 32 + 8, so that the 32 fragment reads of a warp (8 rows
// × 4 words) fall in 32 different banks.
#define KG_IG_LD 40
// The few-channel path's loads of its patch and weights: channel pairs (and 16-byte packs) a
// thread has in flight at once.
#define KG_IG_ROUND 8

template <class T>
struct __align__(4) KgConvPair {
  T e[2];
};
// Two 32-bit words read as one 8-byte access.
struct __align__(8) KgConvWords {
  unsigned lo, hi;
};

// The shift (ep.bias, laid out by the filter launch) of the channels whose accumulators a thread
// holds: o = n0 + wn·32 + nt·8 + 2t and o + 1 for nt = 0..3; 0 past O.
template <class T>
__device__ __forceinline__ void kg_conv_mma_shift(const KgConvEpilogue<T>& ep, int o0, int O, float (&sh)[4][2]) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int o = o0 + nt * 8 + e;
      sh[nt][e] = ep.bias && o < O ? kg_ld(ep.bias, o) : 0.0f;
    }
}

// The epilogue of one accumulator pair, its shift added: channels o and o + 1 of output element
// `at` (p·O + o). The residual is added, the activation applied and the pair rounded and stored as
// one 4-byte word where O is even.
template <class T, class Act>
__device__ __forceinline__ void kg_conv_mma_store(T* __restrict__ y, const T* __restrict__ residual, const Act& act,
                                                  long long at, int o, int O, float v0, float v1) {
  const bool two = o + 1 < O;
  if (O % 2 == 0) {
    if (residual) {
      float r0, r1;
      kg_mma_unpack(T(), *reinterpret_cast<const unsigned*>(residual + at), r0, r1);
      v0 += r0;
      v1 += r1;
    }
    *reinterpret_cast<unsigned*>(y + at) = kg_pack2(T(), act(v0), act(v1));
    return;
  }
  if (residual) {
    v0 += kg_ld(residual, at);
    if (two) v1 += kg_ld(residual, at + 1);
  }
  y[at] = kg_from_compute<T>(act(v0));
  if (two) y[at + 1] = kg_from_compute<T>(act(v1));
}

// Two 16-bit elements as one fragment register (the first in the low half).
template <class T>
__device__ __forceinline__ unsigned kg_mma_pair(T lo, T hi) {
  return (unsigned)lo.bits | ((unsigned)hi.bits << 16);
}

template <class T, class Act>
__device__ __forceinline__ void kg_conv2d_nhwc_mma_general(const T* __restrict__ x, const T* __restrict__ w,
                                                           T* __restrict__ y, const KgConvShape& s,
                                                           const KgConvEpilogue<T>& ep, const Act& act,
                                                           unsigned char* smem) {
  typedef KgConvPack<T, 8> P;
  typedef T Row[KG_IG_LD];
  Row* as0 = reinterpret_cast<Row*>(smem);
  Row* bs0 = as0 + 2 * KG_IG_BM;
  auto as = [&](int buf, int r) { return as0[buf * KG_IG_BM + r]; };
  auto bs = [&](int buf, int r) { return bs0[buf * KG_IG_BN + r]; };
  const int tid = (int)threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp % 4, wn = warp / 4, g = lane / 4, t = lane % 4;
  const long long m_total = s.n * s.ho * s.wo;
  const long long m0 = (long long)blockIdx.x * KG_IG_BM;
  const int n0 = (int)blockIdx.y * KG_IG_BN;
  const int K = (int)s.gemm_k, C = (int)s.c, kh = (int)s.kh, kw = (int)s.kw, H = (int)s.h, W = (int)s.w;
  const int O = (int)s.o;
  const bool packed = C % 8 == 0;
  // This thread's share of each slice: chunk kc (8 elements) of the A rows ar and ar + 64 and of
  // the weight row ar.
  const int kc = tid % 4, ar = tid / 4;
  long long a_image[2];
  int a_y0[2], a_x0[2];
  bool a_valid[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const long long p = m0 + ar + j * 64;
    a_valid[j] = p < m_total;
    const long long q = p / s.wo, n = q / s.ho;
    a_image[j] = n * H * W * C;
    a_y0[j] = (int)(q - n * s.ho) * (int)s.sh - (int)s.ph;
    a_x0[j] = (int)(p - q * s.wo) * (int)s.sw - (int)s.pw;
  }
  const bool b_valid = n0 + ar < O;
  const T* w_row = w + (long long)(b_valid ? n0 + ar : 0) * K;
  P zero;
#pragma unroll
  for (int e = 0; e < 8; ++e) zero.e[e] = kg_from_compute<T>(0.0f);
  P ra[2], rb;
  auto load = [&](int kt) {
    const int k0 = kt * KG_IG_BK + kc * 8;
    rb = b_valid && k0 < K ? *reinterpret_cast<const P*>(w_row + k0) : zero;
    int tap = k0 / C, c = k0 - tap * C;
    int ky = tap / kw, kx = tap - ky * kw;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      ra[j] = zero;
      if (!a_valid[j] || k0 >= K) continue;
      if (packed) {
        const int iy = a_y0[j] + ky * (int)s.dh, ix = a_x0[j] + kx * (int)s.dw;
        if (ky < kh && iy >= 0 && iy < H && ix >= 0 && ix < W)
          ra[j] = *reinterpret_cast<const P*>(x + a_image[j] + ((long long)iy * W + ix) * C + c);
      } else {
        int cc = c, yy = ky, xx = kx;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int iy = a_y0[j] + yy * (int)s.dh, ix = a_x0[j] + xx * (int)s.dw;
          if (yy < kh && iy >= 0 && iy < H && ix >= 0 && ix < W)
            ra[j].e[e] = x[a_image[j] + ((long long)iy * W + ix) * C + cc];
          if (++cc == C) {
            cc = 0;
            if (++xx == kw) xx = 0, ++yy;
          }
        }
      }
    }
  };
  auto store = [&](int buf) {
    *reinterpret_cast<P*>(&as(buf, ar)[kc * 8]) = ra[0];
    *reinterpret_cast<P*>(&as(buf, ar + 64)[kc * 8]) = ra[1];
    *reinterpret_cast<P*>(&bs(buf, ar)[kc * 8]) = rb;
  };
  float acc[2][4][4] = {};
  const int slices = (K + KG_IG_BK - 1) / KG_IG_BK;
  load(0);
  store(0);
  __syncthreads();
  for (int kt = 0; kt < slices; ++kt) {
    const int buf = kt & 1;
    if (kt + 1 < slices) load(kt + 1);
#pragma unroll
    for (int ks = 0; ks < KG_IG_BK; ks += 16) {
      unsigned af[2][4], bf[4][2];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const T* r0 = &as(buf, wm * 32 + mt * 16 + g)[ks + 2 * t];
        const T* r8 = r0 + 8 * KG_IG_LD;
        af[mt][0] = *reinterpret_cast<const unsigned*>(r0);
        af[mt][1] = *reinterpret_cast<const unsigned*>(r8);
        af[mt][2] = *reinterpret_cast<const unsigned*>(r0 + 8);
        af[mt][3] = *reinterpret_cast<const unsigned*>(r8 + 8);
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const T* c0 = &bs(buf, wn * 32 + nt * 8 + g)[ks + 2 * t];
        bf[nt][0] = *reinterpret_cast<const unsigned*>(c0);
        bf[nt][1] = *reinterpret_cast<const unsigned*>(c0 + 8);
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) kg_mma_16816<T>(acc[mt][nt], af[mt], bf[nt]);
    }
    if (kt + 1 < slices) store(buf ^ 1);
    __syncthreads();
  }
  // The epilogue: two neighbouring channels of a pixel per step.
  const int o0 = n0 + wn * 32 + 2 * t;
  float sh[4][2];
  kg_conv_mma_shift(ep, o0, O, sh);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const long long p = m0 + wm * 32 + mt * 16 + g + half * 8;
      if (p >= m_total) continue;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int o = o0 + nt * 8;
        if (o < O)
          kg_conv_mma_store(y, ep.residual, act, p * O + o, o, O, acc[mt][nt][half * 2] + sh[nt][0],
                            acc[mt][nt][half * 2 + 1] + sh[nt][1]);
      }
    }
}

// Few input channels (C not a multiple of 8: ResNet's 3-channel stem), where gathering rows
// element by element from global memory costs more than the product. The k order pads each tap's
// channels to CP = s.gemm_c (C rounded up to even), so that a fragment register, two neighbouring
// k, is two neighbouring channels of one pixel: one 4-byte shared-memory read. A block computes
// s.patch_tiles tiles of tile_h × tile_w (= KG_IG_BM) output pixels for KG_IG_BN channels (grid y)
// in turn; the tiles are numbered image by image, row of tiles by row (grid x: groups of
// patch_tiles). The block stages once its weights, [KG_IG_BN][patch_ldb] with the k of each
// 16-wide step reordered 0 1 8 9 2 3 10 11 ... so that a lane's two B registers are one 8-byte
// read, and a table of each step's k offsets in the patch per lane (two: k = 2t and 2t + 8). Then
// for each tile it stages the input patch the tile's windows cover, [patch_h][patch_w][CP], zero
// outside the image and in the padding channel, and runs the whole reduction from shared memory
// with no bounds checks: register (pixel r, k) = patch[pixel_offset(r) + k_offset(k)]. The
// reduction's last step, partly past kh·kw·CP, masks those registers to zero (the weights there
// are zero too, but an inf or NaN read would not be). ops/conv_gpu.cpp picks the tile shape and
// the layout (KgConvShape's patch_* fields) and this path where it fits in KG_IG_SMEM.
template <class T, class Act>
__device__ __forceinline__ void kg_conv2d_nhwc_mma_patch(const T* __restrict__ x, const T* __restrict__ w,
                                                         T* __restrict__ y, const KgConvShape& s,
                                                         const KgConvEpilogue<T>& ep, const Act& act,
                                                         unsigned char* smem) {
  typedef KgConvPack<T, 8> P;
  const int tid = (int)threadIdx.x, lane = tid % 32, warp = tid / 32, threads = (int)blockDim.x;
  const int wm = warp % 4, wn = warp / 4, g = lane / 4, t = lane % 4;
  const int C = (int)s.c, CP = (int)s.gemm_c, H = (int)s.h, W = (int)s.w, O = (int)s.o, K = (int)s.gemm_k;
  const int kw = (int)s.kw, KR = (int)s.kh * kw * CP;  // k past KR: padding
  const int TH = (int)s.tile_h, TW = (int)s.tile_w, PH = (int)s.patch_h, PW = (int)s.patch_w;
  const int OH = (int)s.ho, OW = (int)s.wo, ldb = (int)s.patch_ldb;
  const int n0 = (int)blockIdx.y * KG_IG_BN;
  T* ps = reinterpret_cast<T*>(smem);
  T* bs = reinterpret_cast<T*>(smem + s.patch_b);
  KgConvWords* ktab = reinterpret_cast<KgConvWords*>(smem + s.patch_k);
  P pz;
#pragma unroll
  for (int e = 0; e < 8; ++e) pz.e[e] = kg_from_compute<T>(0.0f);
  // The weights: 16-byte packs of 8 k, the four words of a pack spread to every other word of its
  // 16-wide step (the low or high 8 k), in rounds of KG_IG_ROUND packs a thread.
  const int row_packs = K / 8, packs = KG_IG_BN * row_packs;
  for (int base = 0; base < packs; base += KG_IG_ROUND * threads) {
    P v[KG_IG_ROUND];
#pragma unroll
    for (int u = 0; u < KG_IG_ROUND; ++u) {
      const int i = base + u * threads + tid, r = i / row_packs;
      v[u] = i < packs && n0 + r < O ? *reinterpret_cast<const P*>(w + (long long)(n0 + r) * K + (i - r * row_packs) * 8)
                                     : pz;
    }
#pragma unroll
    for (int u = 0; u < KG_IG_ROUND; ++u) {
      const int i = base + u * threads + tid, r = i / row_packs, k = (i - r * row_packs) * 8;
      if (i >= packs) break;
      unsigned* to = reinterpret_cast<unsigned*>(bs + r * ldb + (k & ~15)) + (k & 8 ? 1 : 0);
      const unsigned* from = reinterpret_cast<const unsigned*>(&v[u]);
#pragma unroll
      for (int q = 0; q < 4; ++q) to[2 * q] = from[q];
    }
  }
  // The k table: per 16-wide step and lane column t, the patch offsets of k = 2t and 2t + 8.
  auto k_offset = [&](int k) {
    if (k >= KR) return 0;
    const int tap = k / CP, c = k - tap * CP, ky = tap / kw, kx = tap - ky * kw;
    return (ky * (int)s.dh * PW + kx * (int)s.dw) * CP + c;
  };
  for (int i = tid; i < K / 16 * 4; i += threads) {
    const int k = i / 4 * 16 + i % 4 * 2;
    ktab[i].lo = (unsigned)k_offset(k);
    ktab[i].hi = (unsigned)k_offset(k + 8);
  }
  // This thread's four pixels of a tile, rows wm·32 + mt·16 + g (+ 8): their windows' offsets in
  // the patch and their places in the tile.
  int pix[2][2], ry[2][2], rx[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wm * 32 + mt * 16 + g + h * 8;
      ry[mt][h] = r / TW;
      rx[mt][h] = r - ry[mt][h] * TW;
      pix[mt][h] = (ry[mt][h] * (int)s.sh * PW + rx[mt][h] * (int)s.sw) * CP;
    }
  const int o0 = n0 + wn * 32 + 2 * t;
  float sh[4][2];
  kg_conv_mma_shift(ep, o0, O, sh);
  // The patch's channel pairs: index i = (py·PW + px)·CP/2 + c/2; the divisions as multiply-highs,
  // exact below 2^16 (ops/conv_gpu.cpp keeps the patch far smaller).
  const int row_pairs = PW * CP / 2, pairs = PH * row_pairs;
  const unsigned row_magic = 0xffffffffu / (unsigned)row_pairs + 1u, cp_magic = 0xffffffffu / (unsigned)CP + 1u;
  const long long tiles = s.n * s.tiles_h * s.tiles_w;
  for (int j = 0; j < (int)s.patch_tiles; ++j) {
    const long long tile = (long long)blockIdx.x * s.patch_tiles + j;
    if (tile >= tiles) break;
    const long long q = tile / s.tiles_w, n = q / s.tiles_h;
    const int oy0 = (int)(q - n * s.tiles_h) * TH, ox0 = (int)(tile - q * s.tiles_w) * TW;
    const int iy0 = oy0 * (int)s.sh - (int)s.ph, ix0 = ox0 * (int)s.sw - (int)s.pw;
    const T* image = x + n * H * W * C;
    if (j > 0) __syncthreads();  // every warp is done with the last tile's patch
    for (int base = 0; base < pairs; base += KG_IG_ROUND * threads) {
      unsigned v[KG_IG_ROUND];
#pragma unroll
      for (int u = 0; u < KG_IG_ROUND; ++u) {
        const int i = base + u * threads + tid;
        v[u] = 0u;
        if (i >= pairs) continue;
        const int py = (int)__umulhi((unsigned)i, row_magic), e = 2 * (i - py * row_pairs);
        const int px = (int)__umulhi((unsigned)e, cp_magic), c = e - px * CP;
        const int iy = iy0 + py, ix = ix0 + px;
        if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
        const T* at = image + ((long long)iy * W + ix) * C + c;
        v[u] = (unsigned)at[0].bits | (c + 1 < C ? (unsigned)at[1].bits << 16 : 0u);
      }
#pragma unroll
      for (int u = 0; u < KG_IG_ROUND; ++u) {
        const int i = base + u * threads + tid;
        if (i < pairs) reinterpret_cast<unsigned*>(ps)[i] = v[u];
      }
    }
    __syncthreads();
    float acc[2][4][4] = {};
    auto step = [&](int kb, bool last) {
      const KgConvWords ko = ktab[kb / 16 * 4 + t];
      unsigned af[2][4], bf[4][2];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        af[mt][0] = *reinterpret_cast<const unsigned*>(ps + pix[mt][0] + ko.lo);
        af[mt][1] = *reinterpret_cast<const unsigned*>(ps + pix[mt][1] + ko.lo);
        af[mt][2] = *reinterpret_cast<const unsigned*>(ps + pix[mt][0] + ko.hi);
        af[mt][3] = *reinterpret_cast<const unsigned*>(ps + pix[mt][1] + ko.hi);
        if (last) {
          if (kb + 2 * t >= KR) af[mt][0] = af[mt][1] = 0u;
          if (kb + 2 * t + 8 >= KR) af[mt][2] = af[mt][3] = 0u;
        }
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const KgConvWords b = *reinterpret_cast<const KgConvWords*>(bs + (wn * 32 + nt * 8 + g) * ldb + kb + 4 * t);
        bf[nt][0] = b.lo;
        bf[nt][1] = b.hi;
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) kg_mma_16816<T>(acc[mt][nt], af[mt], bf[nt]);
    };
    const int full = KR / 16 * 16;
    for (int kb = 0; kb < full; kb += 16) step(kb, false);
    if (full < K) step(full, true);
    // The epilogue: two neighbouring channels of a pixel per step.
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int oy = oy0 + ry[mt][h], ox = ox0 + rx[mt][h];
        if (oy >= OH || ox >= OW) continue;
        const long long at = ((n * OH + oy) * OW + ox) * O;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int o = o0 + nt * 8;
          if (o < O)
            kg_conv_mma_store(y, ep.residual, act, at + o, o, O, acc[mt][nt][h * 2] + sh[nt][0],
                              acc[mt][nt][h * 2 + 1] + sh[nt][1]);
        }
      }
  }
}

template <class T, class Act>
__device__ __forceinline__ void kg_conv2d_nhwc_mma(const T* __restrict__ x, const T* __restrict__ w,
                                                   T* __restrict__ y, const KgConvShape& s,
                                                   const KgConvEpilogue<T>& ep, const Act& act) {
  __shared__ __align__(16) unsigned char smem[KG_IG_SMEM];
  if (s.patch_w)
    kg_conv2d_nhwc_mma_patch<T>(x, w, y, s, ep, act, smem);
  else
    kg_conv2d_nhwc_mma_general<T>(x, w, y, s, ep, act, smem);
}

// The input [N, H, W, C] with its channels padded with zeros to s.cpad, into `out`.
template <class T>
__device__ __forceinline__ void kg_conv2d_pad_channels(const T* __restrict__ x, T* __restrict__ out,
                                                       const KgConvShape& s) {
  const long long total = s.n * s.h * s.w * s.cpad;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const long long c = i % s.cpad;
    out[i] = c < s.c ? x[i / s.cpad * s.c + c] : kg_from_compute<T>(kg_compute_t<T>(0));
  }
}

// ---- tiled (stride 1, no dilation) ----
// Grid: x over n × groups × channel chunks × tiles_h × tiles_w blocks. Dynamic shared memory, of
// the compute type (16-bit elements are widened as they are staged): the input window, cc ×
// (tile_h + KH - 1) × (tile_w + KW - 1), rounded up to KG_CONV_SMEM_ALIGN bytes, then the
// weights, cc × KH × KW × och.

// n consecutive values from 16-byte aligned shared memory, as one or two vector loads.
template <int N>
__device__ __forceinline__ void kg_conv_load_vec(const float* p, float* v) {
  if constexpr (N == 4) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else if constexpr (N == 2) {
    const float2 q = *reinterpret_cast<const float2*>(p);
    v[0] = q.x, v[1] = q.y;
  } else {
    v[0] = p[0];
  }
}
template <int N>
__device__ __forceinline__ void kg_conv_load_vec(const double* p, double* v) {
  if constexpr (N == 1) {
    v[0] = p[0];
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const double2 q = *reinterpret_cast<const double2*>(p + i);
      v[i] = q.x, v[i + 1] = q.y;
    }
  }
}

template <class T, int KH, int KW, int OCB, int PX, class Act>
__device__ __forceinline__ void kg_conv2d_tiled(const T* __restrict__ x, const T* __restrict__ w,
                                                T* __restrict__ y, const KgConvShape& s,
                                                const KgConvEpilogue<T>& ep, const Act& act) {
  typedef kg_compute_t<T> C;
  extern __shared__ __align__(16) unsigned char kg_conv_smem[];
  constexpr int KHW = KH * KW;
  const int th = (int)s.tile_h, tw = (int)s.tile_w, tcb = tw / PX, cc = (int)s.cc, och = (int)s.och;
  const int ih = th + KH - 1, iw = tw + KW - 1;
  const int xs_elems = (cc * ih * iw * (int)sizeof(C) + KG_CONV_SMEM_ALIGN - 1) / KG_CONV_SMEM_ALIGN *
                       (KG_CONV_SMEM_ALIGN / (int)sizeof(C));
  C* xs = reinterpret_cast<C*>(kg_conv_smem);
  C* ws = xs + xs_elems;
  const int og = (int)(s.o / s.groups), cg = (int)(s.c / s.groups);
  const int h = (int)s.h, wd = (int)s.w, ho = (int)s.ho, wo = (int)s.wo;
  const long long hwi = s.h * s.w;
  const int kdim = cg * KHW;

  unsigned tile, chunk, g, tx;
  const unsigned img =
      kg_conv_divmod(kg_conv_divmod(kg_conv_divmod(blockIdx.x, (unsigned)(s.tiles_w * s.tiles_h), tile),
                                    (unsigned)s.chunks, chunk),
                     (unsigned)s.groups, g);
  if (img >= s.n) return;  // an empty batch still launches one block
  const int ty = (int)kg_conv_divmod(tile, (unsigned)s.tiles_w, tx);
  const int oy0 = ty * th, ox0 = (int)tx * tw;
  const int ob0 = (int)chunk * och;  // the block's first output channel within the group

  // This thread: channels cb*OCB.., row r, columns q*PX.. of the tile.
  const int tid = threadIdx.x;
  const int per_cb = th * tcb;
  const bool active = tid < (och / OCB) * per_cb;
  const int cb = tid / per_cb, r = (tid - cb * per_cb) / tcb, q = tid - cb * per_cb - r * tcb;

  C acc[OCB][PX];
#pragma unroll
  for (int j = 0; j < OCB; ++j)
#pragma unroll
    for (int p = 0; p < PX; ++p) acc[j][p] = C(0);

  const T* xg = x + ((long long)img * s.c + (long long)g * cg) * hwi;
  const T* wg = w + ((long long)g * og + ob0) * kdim;
  const int iy0 = oy0 - (int)s.ph, ix0 = ox0 - (int)s.pw;
  for (int c0 = 0; c0 < cg; c0 += cc) {
    const int nc = min(cc, cg - c0);
    // The input window of the tile for channels c0.., 0 outside the image.
    const int plane = ih * iw;
    for (int i = tid; i < nc * plane; i += blockDim.x) {
      const int c = i / plane, rem = i - c * plane, yy = rem / iw, xx = rem - yy * iw;
      const int iy = iy0 + yy, ix = ix0 + xx;
      xs[i] = ((unsigned)iy < (unsigned)h && (unsigned)ix < (unsigned)wd)
                  ? kg_ld(xg, (c0 + c) * hwi + iy * wd + ix)
                  : C(0);
    }
    // Their weights as [c][tap][o], 0 past the group's channels.
    for (int i = tid; i < nc * KHW * och; i += blockDim.x) {
      const int o = i % och, ct = i / och, c = ct / KHW, tap = ct - c * KHW;
      ws[i] = ob0 + o < og ? kg_conv_ldg(wg + (long long)o * kdim + (c0 + c) * KHW + tap) : C(0);
    }
    __syncthreads();
    if (active) {
      for (int c = 0; c < nc; ++c) {
#pragma unroll
        for (int ky = 0; ky < KH; ++ky) {
          C xr[PX + KW - 1];
          const C* row = xs + (c * ih + r + ky) * iw + q * PX;
#pragma unroll
          for (int i = 0; i < PX + KW - 1; ++i) xr[i] = row[i];
#pragma unroll
          for (int kx = 0; kx < KW; ++kx) {
            C wv[OCB];
            kg_conv_load_vec<OCB>(ws + ((c * KH + ky) * KW + kx) * och + cb * OCB, wv);
#pragma unroll
            for (int j = 0; j < OCB; ++j)
#pragma unroll
              for (int p = 0; p < PX; ++p) acc[j][p] += xr[p + kx] * wv[j];
          }
        }
      }
    }
    __syncthreads();
  }
  if (!active) return;
  const int oy = oy0 + r;
  if (oy >= ho) return;
#pragma unroll
  for (int j = 0; j < OCB; ++j) {
    const int om = ob0 + cb * OCB + j;
    if (om >= og) break;
    const long long o = (long long)g * og + om;
    C scale, shift;
    kg_conv_affine(ep, o, scale, shift);
    const long long row_at = (((long long)img * s.o + o) * ho + oy) * wo;
#pragma unroll
    for (int p = 0; p < PX; ++p) {
      const int ox = ox0 + q * PX + p;
      if (ox < wo) kg_conv_store(ep, act, y, row_at + ox, acc[j][p], scale, shift);
    }
  }
}

// ---- implicit GEMM ----
// Grid: x over the n*ho*wo output pixels (64 per block), y over the group's output channels (64
// per block), z over the groups.

template <class T, class Act>
__device__ __forceinline__ void kg_conv2d_gemm(const T* __restrict__ x, const T* __restrict__ w,
                                               T* __restrict__ y, const KgConvShape& s,
                                               const KgConvEpilogue<T>& ep, const Act& act) {
  typedef kg_compute_t<T> C;
  __shared__ C as[KG_CONV_BK][KG_CONV_BM];  // staged in the compute type
  __shared__ C bs[KG_CONV_BK][KG_CONV_BN];
  __shared__ long long koff[KG_CONV_BK];  // input offset of tap k from the window's corner
  __shared__ int kdy[KG_CONV_BK], kdx[KG_CONV_BK];
  const int og = (int)(s.o / s.groups), cg = (int)(s.c / s.groups);
  const int khw = (int)(s.kh * s.kw), kdim = cg * khw, kw = (int)s.kw;
  const unsigned hwo = (unsigned)(s.ho * s.wo);
  const long long hwi = s.h * s.w;
  const unsigned npix = (unsigned)s.n * hwo;
  const long long g = blockIdx.z;
  const int m0 = blockIdx.y * KG_CONV_BM;
  const unsigned p0 = blockIdx.x * KG_CONV_BN;
  const int tid = threadIdx.x;
  const T* wg = w + g * og * kdim;

  // This thread gathers B's column `bcol` (one output pixel) at rows brow, brow + 4, ...
  const int bcol = tid % KG_CONV_BN, brow = tid / KG_CONV_BN;
  const unsigned p = p0 + bcol;
  const bool pvalid = p < npix;
  long long corner = 0;  // input offset of the window's top-left tap (may lie in the padding)
  int iy0 = 0, ix0 = 0;
  const T* xb = x;
  if (pvalid) {
    unsigned pix, ox;
    const unsigned img = kg_conv_divmod(p, hwo, pix);
    const unsigned oy = kg_conv_divmod(pix, (unsigned)s.wo, ox);
    iy0 = (int)(oy * s.sh - s.ph);
    ix0 = (int)(ox * s.sw - s.pw);
    xb = x + ((long long)img * s.c + g * cg) * hwi;
    corner = (long long)iy0 * s.w + ix0;
  }
  const int h = (int)s.h, wd = (int)s.w;

  const int tm = (tid / 16) * 4, tn = (tid % 16) * 4;
  C acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = C(0);

  for (int k0 = 0; k0 < kdim; k0 += KG_CONV_BK) {
    if (tid < KG_CONV_BK) {
      const int k = k0 + tid;
      if (k < kdim) {
        const int c = k / khw, r = k - c * khw;
        const int ky = r / kw, kx = r - ky * kw;
        kdy[tid] = ky * (int)s.dh;
        kdx[tid] = kx * (int)s.dw;
        koff[tid] = c * hwi + (long long)kdy[tid] * s.w + kdx[tid];
      } else {
        kdy[tid] = -(1 << 30);  // never inside the input: the row reads 0
        kdx[tid] = 0;
        koff[tid] = 0;
      }
    }
    // A: 64 channels × 16 taps, consecutive threads along k (the weight's contiguous dim).
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int idx = tid + r * KG_CONV_THREADS;
      const int kk = idx % KG_CONV_BK, mm = idx / KG_CONV_BK;
      const int gm = m0 + mm, gk = k0 + kk;
      as[kk][mm] = (gm < og && gk < kdim) ? kg_conv_ldg(wg + (long long)gm * kdim + gk) : C(0);
    }
    __syncthreads();
    // B: 16 taps × 64 pixels, consecutive threads along the pixels.
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int kk = brow + 4 * r;
      const int iy = iy0 + kdy[kk], ix = ix0 + kdx[kk];
      const bool inside = pvalid && iy >= 0 && iy < h && ix >= 0 && ix < wd;
      bs[kk][bcol] = inside ? kg_ld(xb, corner + koff[kk]) : C(0);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < KG_CONV_BK; ++kk) {
      C av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = as[kk][tm + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = bs[kk][tn + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
    }
    __syncthreads();
  }

  long long out_at[4];  // output offset of pixel tn + j in channel 0; -1 past the end
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const unsigned pj = p0 + tn + j;
    if (pj < npix) {
      unsigned pix;
      const unsigned img = kg_conv_divmod(pj, hwo, pix);
      out_at[j] = (long long)img * s.o * hwo + pix;
    } else {
      out_at[j] = -1;
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = m0 + tm + i;
    if (m >= og) continue;
    const long long o = g * og + m;
    C scale, shift;
    kg_conv_affine(ep, o, scale, shift);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (out_at[j] >= 0) kg_conv_store(ep, act, y, out_at[j] + o * hwo, acc[i][j], scale, shift);
  }
}

// The epilogue from the entries' arguments.
template <class T>
__device__ __forceinline__ KgConvEpilogue<T> kg_conv_epilogue(const T* bias, const T* bn_weight,
                                                              const T* bn_bias, const T* bn_mean,
                                                              const T* bn_var, const T* residual,
                                                              double bn_eps) {
  KgConvEpilogue<T> ep;
  ep.bias = bias;
  ep.bn_weight = bn_weight;
  ep.bn_bias = bn_bias;
  ep.bn_mean = bn_mean;
  ep.bn_var = bn_var;
  ep.residual = residual;
  ep.eps = bn_eps;
  return ep;
}

// The epilogue alone, in place over an output a vendor library computed without it (the
// convolution's LibraryCall, ops/conv_gpu.cpp): y = act(y * scale + shift + residual), every
// output element, with a grid-stride loop over the whole batch of s.n images (NCHW, or
// channels-last when s.nhwc).
template <class T, class Act>
__device__ __forceinline__ void kg_conv2d_epilogue(T* __restrict__ y, const KgConvShape& s,
                                                   const KgConvEpilogue<T>& ep, const Act& act) {
  const long long hwo = s.ho * s.wo, total = s.n * s.o * hwo;
  constexpr int V = 16 / (int)sizeof(T);
  if (s.nhwc && !ep.bn_weight && s.o % V == 0) {
    // Channels-last with the scale folded into the weights (the library path): packs of V
    // channels of one pixel, read and written 16 bytes at a time.
    typedef kg_compute_t<T> C;
    typedef KgConvPack<T, V> P;
    for (long long p = blockIdx.x * (long long)blockDim.x + threadIdx.x; p < total / V;
         p += (long long)gridDim.x * blockDim.x) {
      const long long at = p * V, o0 = at % s.o;
      P v = *reinterpret_cast<const P*>(y + at);
      P r;
      if (ep.residual) r = *reinterpret_cast<const P*>(ep.residual + at);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        C a = kg_ld(v.e, j);
        if (ep.bias) a += kg_ld(ep.bias, o0 + j);
        if (ep.residual) a += kg_ld(r.e, j);
        v.e[j] = kg_from_compute<T>(act(a));
      }
      *reinterpret_cast<P*>(y + at) = v;
    }
    return;
  }
  if (!s.nhwc && hwo % V == 0 && total / V < (1LL << 31) && kg_aligned16(y) &&
      (!ep.residual || kg_aligned16(ep.residual))) {
    // NCHW whose planes hold whole packs of V elements: a pack's channel, scale and shift once
    // (a 32-bit division, where the general loop divides in 64 bits per element), y and the
    // residual read 16 bytes at a time, two packs' loads in flight per thread. The host sizes the
    // grid for total / V threads (ops/conv_gpu.cpp, epilogue_items).
    typedef kg_compute_t<T> C;
    struct Packs {
      KgPack<T> v, r;
    };
    const unsigned plane_packs = (unsigned)(hwo / V), channels = (unsigned)s.o;
    KgPack<T>* yp = reinterpret_cast<KgPack<T>*>(y);
    const KgPack<T>* rp = reinterpret_cast<const KgPack<T>*>(ep.residual);
    kg_strided_unrolled<Packs, 2>(
        kg_thread_index(), total / V, kg_grid_stride(),
        [&](kg_index p) {
          Packs a;
          a.v = yp[p];
          if (rp) a.r = rp[p];
          return a;
        },
        [&](kg_index p, Packs& a) {
          C scale, shift;
          kg_conv_affine(ep, ((unsigned)p / plane_packs) % channels, scale, shift);
#pragma unroll
          for (int j = 0; j < V; ++j) {
            C v = kg_ld(a.v.v, j) * scale + shift;  // as kg_conv_store
            if (rp) v += kg_ld(a.r.v, j);
            a.v.v[j] = kg_from_compute<T>(act(v));
          }
          yp[p] = a.v;
        });
    return;
  }
  for (long long at = blockIdx.x * (long long)blockDim.x + threadIdx.x; at < total;
       at += (long long)gridDim.x * blockDim.x) {
    kg_compute_t<T> scale, shift;
    kg_conv_affine(ep, s.nhwc ? at % s.o : (at / hwo) % s.o, scale, shift);
    kg_conv_store(ep, act, y, at, kg_ld(y, at), scale, shift);
  }
}

// ---- entries ----
// (ops/conv_gpu.cpp cuts the file at the line above for the kernels it writes an entry for.)

extern "C" __global__ void __launch_bounds__(KG_CONV_THREADS)
    kg_conv2d_direct_f32(const float* __restrict__ x, const float* __restrict__ w,
                         const float* __restrict__ bias, const float* __restrict__ bn_weight,
                         const float* __restrict__ bn_bias, const float* __restrict__ bn_mean,
                         const float* __restrict__ bn_var, const float* __restrict__ residual,
                         float* __restrict__ y, KgConvShape s, double bn_eps, double act_param) {
  kg_conv2d_direct<float>(x, w, y, s,
                          kg_conv_epilogue(bias, bn_weight, bn_bias, bn_mean, bn_var, residual, bn_eps),
                          KgConvIdentity<float>());
}

extern "C" __global__ void __launch_bounds__(KG_CONV_THREADS)
    kg_conv2d_direct_f64(const double* __restrict__ x, const double* __restrict__ w,
                         const double* __restrict__ bias, const double* __restrict__ bn_weight,
                         const double* __restrict__ bn_bias, const double* __restrict__ bn_mean,
                         const double* __restrict__ bn_var, const double* __restrict__ residual,
                         double* __restrict__ y, KgConvShape s, double bn_eps, double act_param) {
  kg_conv2d_direct<double>(x, w, y, s,
                           kg_conv_epilogue(bias, bn_weight, bn_bias, bn_mean, bn_var, residual, bn_eps),
                           KgConvIdentity<double>());
}

extern "C" __global__ void __launch_bounds__(KG_CONV_THREADS)
    kg_conv2d_gemm_f32(const float* __restrict__ x, const float* __restrict__ w,
                       const float* __restrict__ bias, const float* __restrict__ bn_weight,
                       const float* __restrict__ bn_bias, const float* __restrict__ bn_mean,
                       const float* __restrict__ bn_var, const float* __restrict__ residual,
                       float* __restrict__ y, KgConvShape s, double bn_eps, double act_param) {
  kg_conv2d_gemm<float>(x, w, y, s,
                        kg_conv_epilogue(bias, bn_weight, bn_bias, bn_mean, bn_var, residual, bn_eps),
                        KgConvIdentity<float>());
}

extern "C" __global__ void __launch_bounds__(KG_CONV_THREADS)
    kg_conv2d_gemm_f64(const double* __restrict__ x, const double* __restrict__ w,
                       const double* __restrict__ bias, const double* __restrict__ bn_weight,
                       const double* __restrict__ bn_bias, const double* __restrict__ bn_mean,
                       const double* __restrict__ bn_var, const double* __restrict__ residual,
                       double* __restrict__ y, KgConvShape s, double bn_eps, double act_param) {
  kg_conv2d_gemm<double>(x, w, y, s,
                         kg_conv_epilogue(bias, bn_weight, bn_bias, bn_mean, bn_var, residual, bn_eps),
                         KgConvIdentity<double>());
}

extern "C" __global__ void __launch_bounds__(KG_CONV_THREADS)
    kg_conv2d_epilogue_f32(const float* __restrict__ x, const float* __restrict__ w,
                           const float* __restrict__ bias, const float* __restrict__ bn_weight,
                           const float* __restrict__ bn_bias, const float* __restrict__ bn_mean,
                           const float* __restrict__ bn_var, const float* __restrict__ residual,
                           float* __restrict__ y, KgConvShape s, double bn_eps, double act_param) {
  kg_conv2d_epilogue<float>(y, s, kg_conv_epilogue(bias, bn_weight, bn_bias, bn_mean, bn_var, residual, bn_eps),
                           KgConvIdentity<float>());
}

extern "C" __global__ void __launch_bounds__(KG_CONV_THREADS)
    kg_conv2d_epilogue_f64(const double* __restrict__ x, const double* __restrict__ w,
                           const double* __restrict__ bias, const double* __restrict__ bn_weight,
                           const double* __restrict__ bn_bias, const double* __restrict__ bn_mean,
                           const double* __restrict__ bn_var, const double* __restrict__ residual,
                           double* __restrict__ y, KgConvShape s, double bn_eps, double act_param) {
  kg_conv2d_epilogue<double>(y, s, kg_conv_epilogue(bias, bn_weight, bn_bias, bn_mean, bn_var, residual, bn_eps),
                           KgConvIdentity<double>());
}

// The NCHW GEMM form's columns of an f32 convolution without an activation (ops/conv_gpu.cpp).
extern "C" __global__ void __launch_bounds__(KG_CONV_THREADS)
    kg_conv2d_im2col_nchw_f32(const float* __restrict__ x, const float* __restrict__ w,
                              const float* __restrict__ bias, const float* __restrict__ bn_weight,
                              const float* __restrict__ bn_bias, const float* __restrict__ bn_mean,
                              const float* __restrict__ bn_var, const float* __restrict__ residual,
                              float* __restrict__ y, KgConvShape s, double bn_eps, double act_param) {
  kg_conv2d_im2col_nchw<float>(x, y, s);
}

// 16-bit storage (kg_f16, kg_bf16), computed in float.

extern "C" __global__ void __launch_bounds__(KG_CONV_THREADS)
    kg_conv2d_direct_f16(const kg_f16* __restrict__ x, const kg_f16* __restrict__ w,
                         const kg_f16* __restrict__ bias, const kg_f16* __restrict__ bn_weight,
                         const kg_f16* __restrict__ bn_bias, const kg_f16* __restrict__ bn_mean,
                         const kg_f16* __restrict__ bn_var, const kg_f16* __restrict__ residual,
                         kg_f16* __restrict__ y, KgConvShape s, double bn_eps, double act_param) {
  kg_conv2d_direct<kg_f16>(x, w, y, s,
                           kg_conv_epilogue(bias, bn_weight, bn_bias, bn_mean, bn_var, residual, bn_eps),
                           KgConvIdentity<float>());
}

extern "C" __global__ void __launch_bounds__(KG_CONV_THREADS)
    kg_conv2d_direct_bf16(const kg_bf16* __restrict__ x, const kg_bf16* __restrict__ w,
                          const kg_bf16* __restrict__ bias, const kg_bf16* __restrict__ bn_weight,
                          const kg_bf16* __restrict__ bn_bias, const kg_bf16* __restrict__ bn_mean,
                          const kg_bf16* __restrict__ bn_var, const kg_bf16* __restrict__ residual,
                          kg_bf16* __restrict__ y, KgConvShape s, double bn_eps, double act_param) {
  kg_conv2d_direct<kg_bf16>(x, w, y, s,
                            kg_conv_epilogue(bias, bn_weight, bn_bias, bn_mean, bn_var, residual, bn_eps),
                            KgConvIdentity<float>());
}

extern "C" __global__ void __launch_bounds__(KG_CONV_THREADS)
    kg_conv2d_gemm_f16(const kg_f16* __restrict__ x, const kg_f16* __restrict__ w,
                       const kg_f16* __restrict__ bias, const kg_f16* __restrict__ bn_weight,
                       const kg_f16* __restrict__ bn_bias, const kg_f16* __restrict__ bn_mean,
                       const kg_f16* __restrict__ bn_var, const kg_f16* __restrict__ residual,
                       kg_f16* __restrict__ y, KgConvShape s, double bn_eps, double act_param) {
  kg_conv2d_gemm<kg_f16>(x, w, y, s,
                         kg_conv_epilogue(bias, bn_weight, bn_bias, bn_mean, bn_var, residual, bn_eps),
                         KgConvIdentity<float>());
}

extern "C" __global__ void __launch_bounds__(KG_CONV_THREADS)
    kg_conv2d_gemm_bf16(const kg_bf16* __restrict__ x, const kg_bf16* __restrict__ w,
                        const kg_bf16* __restrict__ bias, const kg_bf16* __restrict__ bn_weight,
                        const kg_bf16* __restrict__ bn_bias, const kg_bf16* __restrict__ bn_mean,
                        const kg_bf16* __restrict__ bn_var, const kg_bf16* __restrict__ residual,
                        kg_bf16* __restrict__ y, KgConvShape s, double bn_eps, double act_param) {
  kg_conv2d_gemm<kg_bf16>(x, w, y, s,
                          kg_conv_epilogue(bias, bn_weight, bn_bias, bn_mean, bn_var, residual, bn_eps),
                          KgConvIdentity<float>());
}

extern "C" __global__ void __launch_bounds__(KG_CONV_THREADS)
    kg_conv2d_epilogue_f16(const kg_f16* __restrict__ x, const kg_f16* __restrict__ w,
                           const kg_f16* __restrict__ bias, const kg_f16* __restrict__ bn_weight,
                           const kg_f16* __restrict__ bn_bias, const kg_f16* __restrict__ bn_mean,
                           const kg_f16* __restrict__ bn_var, const kg_f16* __restrict__ residual,
                           kg_f16* __restrict__ y, KgConvShape s, double bn_eps, double act_param) {
  kg_conv2d_epilogue<kg_f16>(y, s,
                             kg_conv_epilogue(bias, bn_weight, bn_bias, bn_mean, bn_var, residual, bn_eps),
                             KgConvIdentity<float>());
}

extern "C" __global__ void __launch_bounds__(KG_CONV_THREADS)
    kg_conv2d_epilogue_bf16(const kg_bf16* __restrict__ x, const kg_bf16* __restrict__ w,
                            const kg_bf16* __restrict__ bias, const kg_bf16* __restrict__ bn_weight,
                            const kg_bf16* __restrict__ bn_bias, const kg_bf16* __restrict__ bn_mean,
                            const kg_bf16* __restrict__ bn_var, const kg_bf16* __restrict__ residual,
                            kg_bf16* __restrict__ y, KgConvShape s, double bn_eps, double act_param) {
  kg_conv2d_epilogue<kg_bf16>(y, s,
                              kg_conv_epilogue(bias, bn_weight, bn_bias, bn_mean, bn_var, residual, bn_eps),
                              KgConvIdentity<float>());
}
