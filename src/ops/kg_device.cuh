// Device helpers shared by the built-in kernels. Given to NVRTC as an in-memory header; it
// includes nothing outside this folder.
#pragma once

#include "kg_dtype.cuh"

typedef long long kg_index;

// The global thread index of a 1-D launch, and its stride for grid-stride loops.
__device__ __forceinline__ kg_index kg_thread_index() {
  return (kg_index)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ kg_index kg_grid_stride() { return (kg_index)gridDim.x * blockDim.x; }

// Sum over a warp with shuffles (full mask).
template <class T>
__device__ __forceinline__ T kg_warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <class T>
__device__ __forceinline__ T kg_warp_max(T v) {
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
