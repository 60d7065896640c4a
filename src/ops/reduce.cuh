// Block-wide reductions for row kernels (norms, softmax): every thread of the block gets the
// result. The block size must be a multiple of 32, at most 1024; each call may reuse `smem`.
#pragma once

#include "kg_device.cuh"

// -infinity of T, without <cmath>.
template <class T>
__device__ __forceinline__ T kg_neg_inf();
template <>
__device__ __forceinline__ float kg_neg_inf<float>() {
  return __int_as_float(0xff800000);
}
template <>
__device__ __forceinline__ double kg_neg_inf<double>() {
  return __longlong_as_double(0xfff0000000000000ULL);
}

// Sum over the block; smem holds 32 partial sums.
template <class T>
__device__ __forceinline__ T kg_block_sum(T v, T* smem) {
  v = kg_warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // an earlier call may still read smem
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < (int)(blockDim.x >> 5) ? smem[lane] : T(0);
  return kg_warp_sum(v);
}

// Maximum over the block (NaN-ignoring, as fmax); smem holds 32 partial maxima.
template <class T>
__device__ __forceinline__ T kg_block_max(T v, T* smem) {
  v = kg_warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < (int)(blockDim.x >> 5) ? smem[lane] : kg_neg_inf<T>();
  return kg_warp_max(v);
}
