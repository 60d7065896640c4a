// What the batch-norm kernels (norm.cu, norm_backward.cu) share on the device: where element i of
// a channel lies in [N, C, H, W], the ranges a channel is cut into for its per-block partial sums,
// and the merge of two ranges' moments.
#pragma once

#include "index.cuh"
#include "norm_shared.cuh"

// Element i of channel ch's M = N*H*W values (batch-major).
template <bool Small>
__device__ __forceinline__ kg_index kg_bn_offset(kg_index i, kg_index ch, kg_index c, const KgDivider& hw_div) {
  const kg_index plane = kg_div<Small>(hw_div, i);  // batch index
  return (plane * c + ch) * hw_div.d + (i - plane * hw_div.d);
}

// Range k of `chunks` near-equal ranges of [0, m) (none empty when chunks <= m).
struct KgBnRange {
  kg_index begin, end;
};
__device__ __forceinline__ KgBnRange kg_bn_range(kg_index m, kg_index chunks, kg_index k) {
  return {m * k / chunks, m * (k + 1) / chunks};
}

// Calls fn(u, e) for the elements e of range r of channel ch that this thread takes: KG_UNROLL
// indices KG_NORM_THREADS apart per round, their offsets computed first so that their loads
// are in flight together; u (the index's slot in its round) picks one of KG_UNROLL
// accumulators, which kg_bn_total then sums in a fixed order.
template <bool Small, class Fn>
__device__ __forceinline__ void kg_bn_range_each(const KgBnRange& r, kg_index ch, kg_index c,
                                                 const KgDivider& hw_div, const Fn& fn) {
  for (kg_index i0 = r.begin + threadIdx.x; i0 < r.end; i0 += KG_UNROLL * KG_NORM_THREADS) {
    kg_index e[KG_UNROLL];
#pragma unroll
    for (int u = 0; u < KG_UNROLL; ++u) {
      const kg_index i = i0 + u * KG_NORM_THREADS;
      e[u] = i < r.end ? kg_bn_offset<Small>(i, ch, c, hw_div) : -1;
    }
#pragma unroll
    for (int u = 0; u < KG_UNROLL; ++u)
      if (e[u] >= 0) fn(u, e[u]);
  }
}

__device__ __forceinline__ double kg_bn_total(const double (&a)[KG_UNROLL]) {
  double t = a[0];
#pragma unroll
  for (int u = 1; u < KG_UNROLL; ++u) t += a[u];
  return t;
}

// Count, mean and sum of squared deviations from the mean of a range of values.
struct KgBnMoments {
  double count, mean, m2;
};
__device__ __forceinline__ KgBnMoments kg_bn_moments(const double* p) { return {p[0], p[1], p[2]}; }

// The moments of two ranges together (Chan, Golub and LeVeque's pairwise update).
__device__ __forceinline__ KgBnMoments kg_bn_merge(const KgBnMoments& a, const KgBnMoments& b) {
  const double n = a.count + b.count, d = b.mean - a.mean;
  return {n, a.mean + d * (b.count / n), a.m2 + b.m2 + d * d * (a.count * b.count / n)};
}
