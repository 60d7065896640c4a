// nn.softmax and nn.log_softmax over one dim on the GPU. The input is viewed as [outer, n, inner]
// with the softmax over n. Each softmax subtracts its maximum (0 when every element is -inf),
// sums exp(x - max), then writes exp(x - max) / sum or (x - max) - log(sum).
//   inner == 1, n <= KG_SOFTMAX_WARP_MAX: one warp per row, 8 rows per block;
//   inner == 1, longer rows: one block per row;
//   inner > 1: blocks of up to 32 adjacent columns (o, j), the block's threads splitting n.
// The block size and these limits are softmax_shared.cuh's. The input is read through a loader
// (prologue.cuh): the tensor itself for the entries below, or a folded prologue
// (ops/fused_reduction), whose module holds this file without the sections guarded by
// KG_FUSED_MODULE (its entries) and an entry of its own.
#include "prologue.cuh"
#include "reduce.cuh"
#include "softmax_shared.cuh"

__device__ __forceinline__ float kg_exp(float v) { return expf(v); }
__device__ __forceinline__ double kg_exp(double v) { return exp(v); }
__device__ __forceinline__ float kg_log(float v) { return logf(v); }
__device__ __forceinline__ double kg_log(double v) { return log(v); }

// A maximum of -inf (a row of -inf) is taken as 0, so that exp(x - max) stays 0 there.
template <class T>
__device__ __forceinline__ T kg_softmax_shift(T m) {
  return m == kg_neg_inf<T>() ? T(0) : m;
}

// Writes one softmax of n elements `step` apart, starting at element `base`, for lanes j0,
// j0 + stride, ...
template <class T, bool Log, class Load>
__device__ __forceinline__ void kg_softmax_write(const Load& ld, kg_index base, T* __restrict__ y, kg_index n,
                                                 kg_index step, kg_index j0, kg_index stride, T m, T sum) {
  if (Log) {
    const T ls = kg_log(sum);
    for (kg_index i = j0; i < n; i += stride) y[base + i * step] = ((T)ld(base + i * step) - m) - ls;
  } else {
    const T inv = T(1) / sum;
    for (kg_index i = j0; i < n; i += stride) y[base + i * step] = kg_exp((T)ld(base + i * step) - m) * inv;
  }
}

// Columns lanes wide for inner > 1: up to 32 adjacent columns j of one o per block (`width`, a
// power of two), the block's 256 / width groups of threads splitting the n elements of each
// column; the groups' partial maxima and sums meet in shared memory.
__device__ __forceinline__ int kg_softmax_width(kg_index inner) {
  int w = 2;
  while (w < KG_SOFTMAX_COLUMNS && w < inner) w *= 2;
  return w;
}

template <class T>
__device__ __forceinline__ T kg_column_reduce(T v, T* part, int width, bool is_max) {
  part[threadIdx.x] = v;
  __syncthreads();
  for (int s = KG_SOFTMAX_THREADS / 2; s >= width; s >>= 1) {
    if ((int)threadIdx.x < s) {
      const T o = part[threadIdx.x + s];
      part[threadIdx.x] = is_max ? fmax(part[threadIdx.x], o) : part[threadIdx.x] + o;
    }
    __syncthreads();
  }
  v = part[threadIdx.x % width];
  __syncthreads();
  return v;
}

template <class T, bool Log, class Load>
__device__ __forceinline__ void kg_softmax_columns(const Load& ld, T* __restrict__ y, kg_index outer,
                                                   kg_index n, kg_index inner) {
  __shared__ T part[KG_SOFTMAX_THREADS];
  const int width = kg_softmax_width(inner), groups = KG_SOFTMAX_THREADS / width;
  const int lane = threadIdx.x % width, group = threadIdx.x / width;
  const kg_index tiles = (inner + width - 1) / width;
  for (kg_index b = blockIdx.x; b < outer * tiles; b += gridDim.x) {
    const kg_index o = b / tiles, j = (b - o * tiles) * width + lane;
    const bool active = j < inner;
    const kg_index base = o * n * inner + j;
    T m = kg_neg_inf<T>();
    if (active)
      for (kg_index i = group; i < n; i += groups) m = fmax(m, (T)ld(base + i * inner));
    m = kg_softmax_shift(kg_column_reduce(m, part, width, true));
    T s = T(0);
    if (active)
      for (kg_index i = group; i < n; i += groups) s += kg_exp((T)ld(base + i * inner) - m);
    s = kg_column_reduce(s, part, width, false);
    if (active) kg_softmax_write<T, Log>(ld, base, y, n, inner, group, groups, m, s);
  }
}

template <class T, bool Log, class Load>
__device__ __forceinline__ void kg_softmax(const Load& ld, T* __restrict__ y, long long outer, long long n,
                                           long long inner) {
  if (inner > 1) {
    kg_softmax_columns<T, Log>(ld, y, outer, n, inner);
    return;
  }
  if (n <= KG_SOFTMAX_WARP_MAX) {
    const int lane = threadIdx.x & 31;
    const kg_index warps = (kg_index)gridDim.x * (KG_SOFTMAX_THREADS / 32);
    for (kg_index r = (kg_index)blockIdx.x * (KG_SOFTMAX_THREADS / 32) + (threadIdx.x >> 5); r < outer;
         r += warps) {
      const kg_index base = r * n;
      T m = kg_neg_inf<T>();
      for (kg_index i = lane; i < n; i += 32) m = fmax(m, (T)ld(base + i));
      m = kg_softmax_shift(kg_warp_max(m));
      T s = T(0);
      for (kg_index i = lane; i < n; i += 32) s += kg_exp((T)ld(base + i) - m);
      kg_softmax_write<T, Log>(ld, base, y, n, 1, lane, 32, m, kg_warp_sum(s));
    }
    return;
  }
  __shared__ T smem[32];
  for (kg_index r = blockIdx.x; r < outer; r += gridDim.x) {
    const kg_index base = r * n;
    T m = kg_neg_inf<T>();
    for (kg_index i = threadIdx.x; i < n; i += KG_SOFTMAX_THREADS) m = fmax(m, (T)ld(base + i));
    m = kg_softmax_shift(kg_block_max(m, smem));
    T s = T(0);
    for (kg_index i = threadIdx.x; i < n; i += KG_SOFTMAX_THREADS) s += kg_exp((T)ld(base + i) - m);
    kg_softmax_write<T, Log>(ld, base, y, n, 1, threadIdx.x, KG_SOFTMAX_THREADS, m, kg_block_sum(s, smem));
  }
}

#ifndef KG_FUSED_MODULE

extern "C" __global__ void __launch_bounds__(KG_SOFTMAX_THREADS)
    kg_softmax_f32(const float* __restrict__ x, float* __restrict__ y, long long outer, long long n,
                   long long inner) {
  kg_softmax<float, false>(kg_load_ptr(x), y, outer, n, inner);
}

extern "C" __global__ void __launch_bounds__(KG_SOFTMAX_THREADS)
    kg_softmax_f64(const double* __restrict__ x, double* __restrict__ y, long long outer, long long n,
                   long long inner) {
  kg_softmax<double, false>(kg_load_ptr(x), y, outer, n, inner);
}

extern "C" __global__ void __launch_bounds__(KG_SOFTMAX_THREADS)
    kg_log_softmax_f32(const float* __restrict__ x, float* __restrict__ y, long long outer, long long n,
                       long long inner) {
  kg_softmax<float, true>(kg_load_ptr(x), y, outer, n, inner);
}

extern "C" __global__ void __launch_bounds__(KG_SOFTMAX_THREADS)
    kg_log_softmax_f64(const double* __restrict__ x, double* __restrict__ y, long long outer, long long n,
                       long long inner) {
  kg_softmax<double, true>(kg_load_ptr(x), y, outer, n, inner);
}

#endif  // KG_FUSED_MODULE
