// Index arithmetic of the pooling kernels (pool.cu, pool_backward.cu) over [N*C, H, W] planes:
// the loop over every element of a launch, and quotients in 32 bits where every value fits
// (64-bit division costs dozens of instructions on the GPU); and the pick of a 3×3 max-pool
// window, which the forward and the backward's picks both find.
#pragma once

#include "kg_device.cuh"
#include "kg_dtype.cuh"
#include "pool_shared.cuh"

// a / b and a % b for a >= 0, b > 0; in 32 bits when Small (every value involved fits).
template <bool Small>
__device__ __forceinline__ long long kg_pool_divmod(long long a, long long b, long long& rem) {
  if (Small) {
    const unsigned q = (unsigned)a / (unsigned)b;
    rem = (long long)((unsigned)a - q * (unsigned)b);
    return q;
  }
  const long long q = a / b;
  rem = a - q * b;
  return q;
}

// Runs body(i, plane, y, x) for every element i of `planes` planes of h × w (grid-stride).
template <bool Small, class Body>
__device__ __forceinline__ void kg_pool_for_each(long long planes, long long h, long long w, const Body& body) {
  const long long hw = h * w, total = planes * hw;
  for (long long i = kg_thread_index(); i < total; i += kg_grid_stride()) {
    long long pix, x;
    const long long pl = kg_pool_divmod<Small>(i, hw, pix);
    const long long y = kg_pool_divmod<Small>(pix, w, x);
    body(i, pl, y, x);
  }
}

// The same, choosing 32-bit quotients when the launch's element count fits.
template <class Body>
__device__ __forceinline__ void kg_pool_launch(long long planes, long long h, long long w, const Body& body) {
  if (planes * h * w < (1LL << 31))
    kg_pool_for_each<true>(planes, h, w, body);
  else
    kg_pool_for_each<false>(planes, h, w, body);
}

// Whether the 3×3 path below serves a max pool: 3×3 windows without dilation, every index of the
// input and output planes below 2^30 (and a window's first tap, which starts before h + ph + sh).
__host__ __device__ inline bool kg_pool_is_small_3x3(const KgPoolShape& s) {
  const long long big = 1LL << 30;
  return s.kh == 3 && s.kw == 3 && s.dh == 1 && s.dw == 1 && s.planes * s.h * s.w < big &&
         s.planes * s.ho * s.wo < big && s.h + s.ph + s.sh < big && s.w + s.pw + s.sw < big;
}

// Runs body(i, src, y0, x0) for every output element i of a max pool that kg_pool_is_small_3x3
// takes: src is the element's input plane, (y0, x0) its window's first tap. 32-bit arithmetic.
template <class T, class Body>
__device__ __forceinline__ void kg_pool_3x3_for_each(const T* __restrict__ x, const KgPoolShape& s, const Body& body) {
  const int h = (int)s.h, w = (int)s.w, ho = (int)s.ho, wo = (int)s.wo;
  const unsigned out_plane = (unsigned)(ho * wo), total = (unsigned)s.planes * out_plane;
  for (unsigned i = (unsigned)kg_thread_index(); i < total; i += (unsigned)kg_grid_stride()) {
    const unsigned pl = i / out_plane, opix = i - pl * out_plane;
    const int oy = (int)(opix / (unsigned)wo), ox = (int)opix - oy * wo;
    body(i, x + (kg_index)pl * h * w, (int)((long long)oy * s.sh - s.ph), (int)((long long)ox * s.sw - s.pw));
  }
}

// The pick of the 3×3 window whose first tap is (y0, x0) in an h × w plane: the index in the plane
// (yy * w + xx) of the first strictly largest tap inside it, or of the last NaN, with its value in
// `value`; -1 when no tap is inside. The nine taps are loaded (those outside skipped) before the
// first compare, so that their loads are in flight together.
template <class T>
__device__ __forceinline__ int kg_pool_pick_3x3(const T* __restrict__ src, int h, int w, int y0, int x0, T& value) {
  typedef kg_compute_t<T> C;
  T r[9];
  bool in[9];
#pragma unroll
  for (int k = 0; k < 9; ++k) {
    const int yy = y0 + k / 3, xx = x0 + k % 3;
    in[k] = yy >= 0 && yy < h && xx >= 0 && xx < w;
    if (in[k]) r[k] = src[yy * w + xx];
  }
  int pick = -1;
  C m = C(0);
#pragma unroll
  for (int k = 0; k < 9; ++k) {
    if (!in[k]) continue;
    const C v = kg_ld(&r[k]);  // compared in the compute type, kept as read
    if (pick < 0 || v > m || v != v) {
      m = v;
      value = r[k];
      pick = (y0 + k / 3) * w + x0 + k % 3;
    }
  }
  return pick;
}
