// Index arithmetic of the pooling kernels (pool.cu, pool_backward.cu) over [N*C, H, W] planes:
// the loop over every element of a launch, and quotients in 32 bits where every value fits
// (64-bit division costs dozens of instructions on the GPU).
#pragma once

#include "kg_device.cuh"

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
