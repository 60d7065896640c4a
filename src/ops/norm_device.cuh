// What the batch-norm kernels (norm.cu, norm_backward.cu) share on the device: where element i of
// a channel lies in [N, C, H, W], the ranges a channel is cut into for its per-block partial sums,
// the loop that reads a range once, and the merge of two ranges' moments.
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

// For every i of [begin, end) taken by this thread (a block of KG_NORM_THREADS threads strides
// through the range): add(load(i)). Each thread issues U loads before it adds, so that it keeps U
// requests in flight: with one at a time a block's partial sums stall on memory latency, not on
// bandwidth.
template <int U, class Load, class Add>
__device__ __forceinline__ void kg_bn_for_range(kg_index begin, kg_index end, const Load& load, const Add& add) {
  using V = decltype(load(begin));
  kg_strided_unrolled<V, U>(begin + threadIdx.x, end, KG_NORM_THREADS, load, [&](kg_index, const V& v) { add(v); });
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
