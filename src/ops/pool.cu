// Pooling and resampling on the GPU, for [N, C, H, W] tensors seen as N*C planes:
// nn.max_pool2d, nn.avg_pool2d, nn.upsample_nearest2d (one thread per output element, in a
// grid-stride loop; consecutive threads take consecutive output columns) and
// nn.global_avg_pool (one warp per plane, summed with shuffles). The window arithmetic is that
// of the CPU implementations in ops/pool.cpp, including their NaN rule and divisors. Every entry
// exists for f32, f64, f16 and bf16 (kg_dtype.cuh's storage types): the 16-bit ones compare and
// sum in float and round once into the output.
// KG_POOL_THREADS and the geometry passed by value, KgPoolShape, are pool_shared.cuh's.
#include "kg_device.cuh"
#include "pool_device.cuh"
#include "pool_shared.cuh"

__device__ __forceinline__ float kg_pool_lowest(float) { return __int_as_float(0xff800000); }
__device__ __forceinline__ double kg_pool_lowest(double) {
  return __longlong_as_double(0xfff0000000000000ULL);
}

// ---- nn.max_pool2d ----
// The largest value of the window's taps inside the input; a NaN among them wins. Compared in
// the compute type; the element picked is stored as it was read (its bits, NaN payloads too).

template <class T>
__device__ __forceinline__ void kg_max_pool2d(const T* __restrict__ x, T* __restrict__ y,
                                              const KgPoolShape& s) {
  typedef kg_compute_t<T> C;
  if (kg_pool_is_small_3x3(s)) {  // the nine taps' loads in flight together (pool_device.cuh)
    kg_pool_3x3_for_each(x, s, [&](unsigned i, const T* src, int y0, int x0) {
      T value;
      y[i] = kg_pool_pick_3x3(src, (int)s.h, (int)s.w, y0, x0, value) >= 0 ? value
                                                                            : kg_from_compute<T>(kg_pool_lowest(C(0)));
    });
    return;
  }
  kg_pool_launch(s.planes, s.ho, s.wo, [&](long long i, long long pl, long long oy, long long ox) {
    const T* src = x + pl * s.h * s.w;
    const long long iy0 = oy * s.sh - s.ph, ix0 = ox * s.sw - s.pw;
    C m = kg_pool_lowest(C(0));
    T pick = kg_from_compute<T>(m);
    for (long long ky = 0; ky < s.kh; ++ky) {
      const long long iy = iy0 + ky * s.dh;
      if (iy < 0 || iy >= s.h) continue;
      const T* row = src + iy * s.w;
      for (long long kx = 0; kx < s.kw; ++kx) {
        const long long ix = ix0 + kx * s.dw;
        if (ix < 0 || ix >= s.w) continue;
        const C v = kg_ld(row, ix);
        if (v > m || v != v) {
          m = v;
          pick = row[ix];
        }
      }
    }
    y[i] = pick;
  });
}

// ---- nn.avg_pool2d ----
// The sum of the taps inside the input over a divisor that counts the window clipped to the
// padded input (count_include_pad) or only the taps inside the input, as PyTorch.

template <class T>
__device__ __forceinline__ void kg_avg_pool2d(const T* __restrict__ x, T* __restrict__ y,
                                              const KgPoolShape& s, int count_include_pad) {
  typedef kg_compute_t<T> C;
  kg_pool_launch(s.planes, s.ho, s.wo, [&](long long i, long long pl, long long oy, long long ox) {
    const T* src = x + pl * s.h * s.w;
    long long y0 = oy * s.sh - s.ph, y1 = min(y0 + s.kh, s.h + s.ph);
    long long x0 = ox * s.sw - s.pw, x1 = min(x0 + s.kw, s.w + s.pw);
    const long long padded = (y1 - y0) * (x1 - x0);
    y0 = max(y0, 0LL);
    x0 = max(x0, 0LL);
    y1 = min(y1, s.h);
    x1 = min(x1, s.w);
    C sum = C(0);
    for (long long iy = y0; iy < y1; ++iy)
      for (long long ix = x0; ix < x1; ++ix) sum += kg_ld(src, iy * s.w + ix);
    const long long count = count_include_pad ? padded : max(y1 - y0, 0LL) * max(x1 - x0, 0LL);
    kg_st(y, i, sum / (C)count);
  });
}

// ---- nn.upsample_nearest2d ----
// A copy: every element type moves as it is.

template <class T>
__device__ __forceinline__ void kg_upsample_nearest2d(const T* __restrict__ x, T* __restrict__ y,
                                                      const KgPoolShape& s) {
  kg_pool_launch(s.planes, s.ho, s.wo, [&](long long i, long long pl, long long oy, long long ox) {
    y[i] = x[(pl * s.h + oy / s.kh) * s.w + ox / s.kw];
  });
}

// ---- nn.global_avg_pool ----
// One warp per plane of hw elements; KG_POOL_THREADS / 32 planes per block.

template <class T>
__device__ __forceinline__ void kg_global_avg_pool(const T* __restrict__ x, T* __restrict__ y,
                                                   long long planes, long long hw) {
  typedef kg_compute_t<T> C;
  const int lane = threadIdx.x % 32;
  const long long nwarps = (long long)gridDim.x * (blockDim.x / 32);
  for (long long pl = kg_thread_index() / 32; pl < planes; pl += nwarps) {
    const T* src = x + pl * hw;
    C sum = C(0);
    for (long long j = lane; j < hw; j += 32) sum += kg_ld(src, j);
    sum = kg_warp_sum(sum);
    if (lane == 0) kg_st(y, pl, sum / (C)hw);
  }
}

// ---- entries ----
// One per element type: kg_<op>_f32, _f64, _f16 and _bf16.

extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_max_pool2d_f32(const float* __restrict__ x, float* __restrict__ y, KgPoolShape s) {
  kg_max_pool2d<float>(x, y, s);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_max_pool2d_f64(const double* __restrict__ x, double* __restrict__ y, KgPoolShape s) {
  kg_max_pool2d<double>(x, y, s);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_max_pool2d_f16(const kg_f16* __restrict__ x, kg_f16* __restrict__ y, KgPoolShape s) {
  kg_max_pool2d<kg_f16>(x, y, s);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_max_pool2d_bf16(const kg_bf16* __restrict__ x, kg_bf16* __restrict__ y, KgPoolShape s) {
  kg_max_pool2d<kg_bf16>(x, y, s);
}

extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_avg_pool2d_f32(const float* __restrict__ x, float* __restrict__ y, KgPoolShape s,
                      int count_include_pad) {
  kg_avg_pool2d<float>(x, y, s, count_include_pad);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_avg_pool2d_f64(const double* __restrict__ x, double* __restrict__ y, KgPoolShape s,
                      int count_include_pad) {
  kg_avg_pool2d<double>(x, y, s, count_include_pad);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_avg_pool2d_f16(const kg_f16* __restrict__ x, kg_f16* __restrict__ y, KgPoolShape s,
                      int count_include_pad) {
  kg_avg_pool2d<kg_f16>(x, y, s, count_include_pad);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_avg_pool2d_bf16(const kg_bf16* __restrict__ x, kg_bf16* __restrict__ y, KgPoolShape s,
                       int count_include_pad) {
  kg_avg_pool2d<kg_bf16>(x, y, s, count_include_pad);
}

extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_upsample_nearest2d_f32(const float* __restrict__ x, float* __restrict__ y, KgPoolShape s) {
  kg_upsample_nearest2d<float>(x, y, s);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_upsample_nearest2d_f64(const double* __restrict__ x, double* __restrict__ y, KgPoolShape s) {
  kg_upsample_nearest2d<double>(x, y, s);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_upsample_nearest2d_f16(const kg_f16* __restrict__ x, kg_f16* __restrict__ y, KgPoolShape s) {
  kg_upsample_nearest2d<kg_f16>(x, y, s);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_upsample_nearest2d_bf16(const kg_bf16* __restrict__ x, kg_bf16* __restrict__ y, KgPoolShape s) {
  kg_upsample_nearest2d<kg_bf16>(x, y, s);
}

extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_global_avg_pool_f32(const float* __restrict__ x, float* __restrict__ y, long long planes,
                           long long hw) {
  kg_global_avg_pool<float>(x, y, planes, hw);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_global_avg_pool_f64(const double* __restrict__ x, double* __restrict__ y, long long planes,
                           long long hw) {
  kg_global_avg_pool<double>(x, y, planes, hw);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_global_avg_pool_f16(const kg_f16* __restrict__ x, kg_f16* __restrict__ y, long long planes,
                           long long hw) {
  kg_global_avg_pool<kg_f16>(x, y, planes, hw);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_global_avg_pool_bf16(const kg_bf16* __restrict__ x, kg_bf16* __restrict__ y, long long planes,
                            long long hw) {
  kg_global_avg_pool<kg_bf16>(x, y, planes, hw);
}
