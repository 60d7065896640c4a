// nn.batch_norm2d (inference: running statistics) and nn.layer_norm on the GPU.
#include "index.cuh"
#include "reduce.cuh"

#define KG_NORM_THREADS 256

__device__ __forceinline__ float kg_sqrt(float v) { return sqrtf(v); }
__device__ __forceinline__ double kg_sqrt(double v) { return sqrt(v); }

// ---- nn.batch_norm2d ----
// Launch 0 turns the running statistics into a per-channel scale and shift, in double as the CPU
// does: scale = w / sqrt(var + eps), shift = b - mean * scale, stored as T in `scale_shift` (the
// C scales, then the C shifts). Launch 1 applies y = x * scale[c] + shift[c] to every element,
// the channel of element i being (i / hw) % c.

template <class T, bool Small>
__device__ __forceinline__ void kg_batch_norm2d_apply(const T* __restrict__ x,
                                                      const T* __restrict__ scale_shift, T* __restrict__ y,
                                                      kg_index total, kg_index c, const KgDivider& hw_div,
                                                      const KgDivider& c_div) {
  kg_for_each_unrolled<T, Small ? KG_UNROLL : 1>(
      total, [&](kg_index i) { return x[i]; },
      [&](kg_index i, T v) {
        const kg_index plane = kg_div<Small>(hw_div, i);
        const kg_index ch = plane - kg_div<Small>(c_div, plane) * c;
        y[i] = v * scale_shift[ch] + scale_shift[c + ch];
      });
}

template <class T>
__device__ __forceinline__ void kg_batch_norm2d(const T* __restrict__ x, const T* __restrict__ w,
                                                const T* __restrict__ b, const T* __restrict__ mean,
                                                const T* __restrict__ var, T* __restrict__ y, T* scale_shift,
                                                long long total, long long c, double eps, int phase,
                                                KgDivider hw_div, KgDivider c_div) {
  if (phase == 0) {
    for (kg_index ch = kg_thread_index(); ch < c; ch += kg_grid_stride()) {
      const double s = (double)w[ch] / sqrt((double)var[ch] + eps);
      scale_shift[ch] = (T)s;
      scale_shift[c + ch] = (T)((double)b[ch] - (double)mean[ch] * s);
    }
    return;
  }
  if (total < (1LL << 31))
    kg_batch_norm2d_apply<T, true>(x, scale_shift, y, total, c, hw_div, c_div);
  else
    kg_batch_norm2d_apply<T, false>(x, scale_shift, y, total, c, hw_div, c_div);
}

extern "C" __global__ void __launch_bounds__(KG_NORM_THREADS)
    kg_batch_norm2d_f32(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                        const float* __restrict__ mean, const float* __restrict__ var, float* __restrict__ y,
                        float* scale_shift, long long total, long long c, double eps, int phase,
                        KgDivider hw_div, KgDivider c_div) {
  kg_batch_norm2d<float>(x, w, b, mean, var, y, scale_shift, total, c, eps, phase, hw_div, c_div);
}

extern "C" __global__ void __launch_bounds__(KG_NORM_THREADS)
    kg_batch_norm2d_f64(const double* __restrict__ x, const double* __restrict__ w,
                        const double* __restrict__ b, const double* __restrict__ mean,
                        const double* __restrict__ var, double* __restrict__ y, double* scale_shift,
                        long long total, long long c, double eps, int phase, KgDivider hw_div,
                        KgDivider c_div) {
  kg_batch_norm2d<double>(x, w, b, mean, var, y, scale_shift, total, c, eps, phase, hw_div, c_div);
}

// ---- nn.layer_norm ----
// Each row of `inner` elements is normalised with its mean and biased variance (two passes over
// the row, the second one re-reading it from cache), then scaled and shifted elementwise when
// w and b are given. Rows of up to KG_LN_WARP_MAX elements take one warp each (8 rows per block);
// longer rows one block each.

#define KG_LN_WARP_MAX 1024

template <class T>
__device__ __forceinline__ void kg_layer_norm_write(const T* __restrict__ src, T* __restrict__ dst,
                                                    const T* __restrict__ w, const T* __restrict__ b, T mean,
                                                    T inv, kg_index inner, kg_index j0, kg_index step) {
  if (w) {
    for (kg_index j = j0; j < inner; j += step) dst[j] = (src[j] - mean) * inv * w[j] + b[j];
  } else {
    for (kg_index j = j0; j < inner; j += step) dst[j] = (src[j] - mean) * inv;
  }
}

template <class T>
__device__ __forceinline__ void kg_layer_norm(const T* __restrict__ x, const T* __restrict__ w,
                                              const T* __restrict__ b, T* __restrict__ y, long long rows,
                                              long long inner, double eps) {
  const T n = (T)inner;
  if (inner <= KG_LN_WARP_MAX) {
    const int lane = threadIdx.x & 31;
    const kg_index warps = (kg_index)gridDim.x * (KG_NORM_THREADS / 32);
    for (kg_index r = (kg_index)blockIdx.x * (KG_NORM_THREADS / 32) + (threadIdx.x >> 5); r < rows;
         r += warps) {
      const T* src = x + r * inner;
      T s = T(0);
      for (kg_index j = lane; j < inner; j += 32) s += src[j];
      const T mean = kg_warp_sum(s) / n;
      T v = T(0);
      for (kg_index j = lane; j < inner; j += 32) {
        const T d = src[j] - mean;
        v += d * d;
      }
      const T inv = T(1) / kg_sqrt(kg_warp_sum(v) / n + (T)eps);
      kg_layer_norm_write<T>(src, y + r * inner, w, b, mean, inv, inner, lane, 32);
    }
    return;
  }
  __shared__ T smem[32];
  for (kg_index r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* src = x + r * inner;
    T s = T(0);
    for (kg_index j = threadIdx.x; j < inner; j += KG_NORM_THREADS) s += src[j];
    const T mean = kg_block_sum(s, smem) / n;
    T v = T(0);
    for (kg_index j = threadIdx.x; j < inner; j += KG_NORM_THREADS) {
      const T d = src[j] - mean;
      v += d * d;
    }
    const T inv = T(1) / kg_sqrt(kg_block_sum(v, smem) / n + (T)eps);
    kg_layer_norm_write<T>(src, y + r * inner, w, b, mean, inv, inner, threadIdx.x, KG_NORM_THREADS);
  }
}

extern "C" __global__ void __launch_bounds__(KG_NORM_THREADS)
    kg_layer_norm_f32(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                      float* __restrict__ y, long long rows, long long inner, double eps) {
  kg_layer_norm<float>(x, w, b, y, rows, inner, eps);
}

extern "C" __global__ void __launch_bounds__(KG_NORM_THREADS)
    kg_layer_norm_f64(const double* __restrict__ x, const double* __restrict__ w,
                      const double* __restrict__ b, double* __restrict__ y, long long rows, long long inner,
                      double eps) {
  kg_layer_norm<double>(x, w, b, y, rows, inner, eps);
}
