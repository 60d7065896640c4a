// What the batch-norm kernels (norm.cu, norm_backward.cu) share on the device: where element i of
// a channel lies in [N, C, H, W], the ranges a channel is cut into for its per-block partial sums,
// and the merge of two ranges' moments.
#pragma once

#include "index.cuh"

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
