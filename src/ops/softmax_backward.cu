// The backward of nn.softmax and nn.log_softmax over one dim, from the forward's output y:
//   softmax:     dx = y * (dy - sum(dy * y))
//   log_softmax: dx = dy - exp(y) * sum(dy)
// with the sums over the softmax dim. The input is viewed as [outer, n, inner] and the launch is
// laid out as the forward's (softmax.cu):
//   inner == 1, n <= KG_SOFTMAX_WARP_MAX: one warp per row, 8 rows per block;
//   inner == 1, longer rows: one block per row;
//   inner > 1: blocks of up to 32 adjacent columns (o, j), the block's threads splitting n.
// Every sum is a tree in a fixed order: the result does not depend on the schedule. The block
// size and the layouts' limits are softmax_shared.cuh's.
#include "reduce.cuh"
#include "softmax_shared.cuh"

__device__ __forceinline__ float kg_exp(float v) { return expf(v); }
__device__ __forceinline__ double kg_exp(double v) { return exp(v); }

// The summand of element i: dy * y (softmax) or dy (log_softmax).
template <class T, bool Log>
__device__ __forceinline__ T kg_softmax_grad_term(T y, T dy) {
  return Log ? dy : dy * y;
}

template <class T, bool Log>
__device__ __forceinline__ T kg_softmax_grad(T y, T dy, T sum) {
  return Log ? dy - kg_exp(y) * sum : y * (dy - sum);
}

// Writes one row of n elements `step` apart, for lanes j0, j0 + stride, ...
template <class T, bool Log>
__device__ __forceinline__ void kg_softmax_grad_write(const T* __restrict__ y, const T* __restrict__ dy,
                                                      T* __restrict__ dx, kg_index n, kg_index step,
                                                      kg_index j0, kg_index stride, T sum) {
  for (kg_index i = j0; i < n; i += stride)
    dx[i * step] = kg_softmax_grad<T, Log>(y[i * step], dy[i * step], sum);
}

// The sum over the block's groups of `width` lanes (width a power of two up to 32): every
// thread gets its column's total.
template <class T>
__device__ __forceinline__ T kg_softmax_column_sum(T v, T* part, int width) {
  part[threadIdx.x] = v;
  __syncthreads();
  for (int s = KG_SOFTMAX_THREADS / 2; s >= width; s >>= 1) {
    if ((int)threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  v = part[threadIdx.x % width];
  __syncthreads();
  return v;
}

__device__ __forceinline__ int kg_softmax_width(kg_index inner) {
  int w = 2;
  while (w < KG_SOFTMAX_COLUMNS && w < inner) w *= 2;
  return w;
}

template <class T, bool Log>
__device__ __forceinline__ void kg_softmax_backward(const T* __restrict__ y, const T* __restrict__ dy,
                                                    T* __restrict__ dx, long long outer, long long n,
                                                    long long inner) {
  if (!dx) return;
  if (inner > 1) {
    __shared__ T part[KG_SOFTMAX_THREADS];
    const int width = kg_softmax_width(inner), groups = KG_SOFTMAX_THREADS / width;
    const int lane = threadIdx.x % width, group = threadIdx.x / width;
    const kg_index tiles = (inner + width - 1) / width;
    for (kg_index b = blockIdx.x; b < outer * tiles; b += gridDim.x) {
      const kg_index o = b / tiles, j = (b - o * tiles) * width + lane;
      const bool active = j < inner;
      const kg_index base = o * n * inner + j;
      T s = T(0);
      if (active)
        for (kg_index i = group; i < n; i += groups)
          s += kg_softmax_grad_term<T, Log>(y[base + i * inner], dy[base + i * inner]);
      s = kg_softmax_column_sum(s, part, width);
      if (active) kg_softmax_grad_write<T, Log>(y + base, dy + base, dx + base, n, inner, group, groups, s);
    }
    return;
  }
  if (n <= KG_SOFTMAX_WARP_MAX) {
    const int lane = threadIdx.x & 31;
    const kg_index warps = (kg_index)gridDim.x * (KG_SOFTMAX_THREADS / 32);
    for (kg_index r = (kg_index)blockIdx.x * (KG_SOFTMAX_THREADS / 32) + (threadIdx.x >> 5); r < outer;
         r += warps) {
      const T* yr = y + r * n;
      const T* dyr = dy + r * n;
      T s = T(0);
      for (kg_index i = lane; i < n; i += 32) s += kg_softmax_grad_term<T, Log>(yr[i], dyr[i]);
      kg_softmax_grad_write<T, Log>(yr, dyr, dx + r * n, n, 1, lane, 32, kg_warp_sum(s));
    }
    return;
  }
  __shared__ T smem[32];
  for (kg_index r = blockIdx.x; r < outer; r += gridDim.x) {
    const T* yr = y + r * n;
    const T* dyr = dy + r * n;
    T s = T(0);
    for (kg_index i = threadIdx.x; i < n; i += KG_SOFTMAX_THREADS)
      s += kg_softmax_grad_term<T, Log>(yr[i], dyr[i]);
    kg_softmax_grad_write<T, Log>(yr, dyr, dx + r * n, n, 1, threadIdx.x, KG_SOFTMAX_THREADS,
                                  kg_block_sum(s, smem));
  }
}

extern "C" __global__ void __launch_bounds__(KG_SOFTMAX_THREADS)
    kg_softmax_backward_f32(const float* __restrict__ y, const float* __restrict__ dy, float* __restrict__ dx,
                            long long outer, long long n, long long inner) {
  kg_softmax_backward<float, false>(y, dy, dx, outer, n, inner);
}

extern "C" __global__ void __launch_bounds__(KG_SOFTMAX_THREADS)
    kg_softmax_backward_f64(const double* __restrict__ y, const double* __restrict__ dy,
                            double* __restrict__ dx, long long outer, long long n, long long inner) {
  kg_softmax_backward<double, false>(y, dy, dx, outer, n, inner);
}

extern "C" __global__ void __launch_bounds__(KG_SOFTMAX_THREADS)
    kg_log_softmax_backward_f32(const float* __restrict__ y, const float* __restrict__ dy,
                                float* __restrict__ dx, long long outer, long long n, long long inner) {
  kg_softmax_backward<float, true>(y, dy, dx, outer, n, inner);
}

extern "C" __global__ void __launch_bounds__(KG_SOFTMAX_THREADS)
    kg_log_softmax_backward_f64(const double* __restrict__ y, const double* __restrict__ dy,
                                double* __restrict__ dx, long long outer, long long n, long long inner) {
  kg_softmax_backward<double, true>(y, dy, dx, outer, n, inner);
}
