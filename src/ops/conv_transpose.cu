// nn.conv_transpose2d on the GPU: x [N, C, H, W], w [C, O/groups, KH, KW], bias [O] (null: none)
// → y [N, O, HO, WO]. One thread per output element, in a grid-stride loop; consecutive threads
// take consecutive output columns. Each gathers the input pixels that map to its pixel: output
// row oy receives tap ky from input row iy = (oy + pad_top - ky * dh) / sh when that division is
// exact and iy lies in [0, H), and likewise for the columns. It sums, in the tensor's dtype,
// over the taps and then the group's input channels, starting at the bias; the arithmetic is
// that of ops/conv_transpose.cpp (which scatters instead, so the summation order differs).
#include "kg_device.cuh"

#define KG_CONVT_THREADS 256

// a / b and a % b, in 32 bits when every value involved fits (Small).
template <bool Small>
__device__ __forceinline__ long long kg_convt_divmod(long long a, long long b, long long& rem) {
  if (Small) {
    const unsigned q = (unsigned)a / (unsigned)b;
    rem = (long long)((unsigned)a - q * (unsigned)b);
    return q;
  }
  const long long q = a / b;
  rem = a - q * b;
  return q;
}

// The input index i along one axis that output position `out` reads through tap k:
// out = i * stride - pad + k * dilation. False when there is none inside [0, n).
__device__ __forceinline__ bool kg_convt_source(long long out, long long k, long long stride, long long pad,
                                                long long dilation, long long n, long long& i) {
  const long long t = out + pad - k * dilation;
  if (t < 0) return false;
  i = t / stride;
  return i * stride == t && i < n;
}

template <class T, bool Small>
__device__ __forceinline__ void kg_conv_transpose2d_run(const T* __restrict__ x, const T* __restrict__ w,
                                                        const T* __restrict__ bias, T* __restrict__ y,
                                                        long long n, long long c, long long h, long long wd,
                                                        long long o, long long ho, long long wo, long long kh,
                                                        long long kw, long long sh, long long sw,
                                                        long long pt, long long pl, long long dh,
                                                        long long dw, long long groups) {
  const long long cg = c / groups, og = o / groups, hw = h * wd, khw = kh * kw;
  const long long total = n * o * ho * wo;
  for (long long i = kg_thread_index(); i < total; i += kg_grid_stride()) {
    long long ox, oy, oc;
    const long long rest = kg_convt_divmod<Small>(i, wo, ox);
    const long long plane = kg_convt_divmod<Small>(rest, ho, oy);
    const long long img = kg_convt_divmod<Small>(plane, o, oc);
    long long m;
    const long long g = kg_convt_divmod<Small>(oc, og, m);
    const T* xg = x + (img * c + g * cg) * hw;
    const T* wg = w + (g * cg * og + m) * khw;  // tap (ky, kx) of input channel j at j * og * khw
    T acc = bias ? bias[oc] : T(0);
    for (long long ky = 0; ky < kh; ++ky) {
      long long iy;
      if (!kg_convt_source(oy, ky, sh, pt, dh, h, iy)) continue;
      for (long long kx = 0; kx < kw; ++kx) {
        long long ix;
        if (!kg_convt_source(ox, kx, sw, pl, dw, wd, ix)) continue;
        const T* xp = xg + iy * wd + ix;
        const T* wp = wg + ky * kw + kx;
        for (long long j = 0; j < cg; ++j) acc += xp[j * hw] * wp[j * og * khw];
      }
    }
    y[i] = acc;
  }
}

template <class T>
__device__ __forceinline__ void kg_conv_transpose2d(const T* __restrict__ x, const T* __restrict__ w,
                                                    const T* __restrict__ bias, T* __restrict__ y,
                                                    long long n, long long c, long long h, long long wd,
                                                    long long o, long long ho, long long wo, long long kh,
                                                    long long kw, long long sh, long long sw, long long pt,
                                                    long long pl, long long dh, long long dw,
                                                    long long groups) {
  if (n * o * ho * wo < (1LL << 31))
    kg_conv_transpose2d_run<T, true>(x, w, bias, y, n, c, h, wd, o, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw,
                                     groups);
  else
    kg_conv_transpose2d_run<T, false>(x, w, bias, y, n, c, h, wd, o, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw,
                                      groups);
}

// ---- entries ----

extern "C" __global__ void __launch_bounds__(KG_CONVT_THREADS)
    kg_conv_transpose2d_f32(const float* __restrict__ x, const float* __restrict__ w,
                            const float* __restrict__ bias, float* __restrict__ y, long long n, long long c,
                            long long h, long long wd, long long o, long long ho, long long wo, long long kh,
                            long long kw, long long sh, long long sw, long long pt, long long pl,
                            long long dh, long long dw, long long groups) {
  kg_conv_transpose2d<float>(x, w, bias, y, n, c, h, wd, o, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, groups);
}
extern "C" __global__ void __launch_bounds__(KG_CONVT_THREADS)
    kg_conv_transpose2d_f64(const double* __restrict__ x, const double* __restrict__ w,
                            const double* __restrict__ bias, double* __restrict__ y, long long n, long long c,
                            long long h, long long wd, long long o, long long ho, long long wo, long long kh,
                            long long kw, long long sh, long long sw, long long pt, long long pl,
                            long long dh, long long dw, long long groups) {
  kg_conv_transpose2d<double>(x, w, bias, y, n, c, h, wd, o, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, groups);
}
