// Pooling on channels-last tensors on the GPU, for the channels-last pass's ops (ops/pool_dnnl.hpp):
// nn.max_pool2d_nhwc (one thread per 16 bytes of channels of an output pixel where the channel
// count allows, else per output element: the channel fastest, so a warp's loads of a tap are
// consecutive in memory), nn.avg_pool2d_nhwc (one thread per output element), and
// nn.global_avg_pool_nhwc (one thread per image and channel, looping over the H*W rows). The
// window arithmetic, NaN rule and divisors are pool.cu's; entries for f32, f64, f16 and bf16.
#include "kg_device.cuh"
#include "pool_device.cuh"
#include "pool_shared.cuh"

__device__ __forceinline__ float kg_pool_nhwc_lowest(float) { return __int_as_float(0xff800000); }
__device__ __forceinline__ double kg_pool_nhwc_lowest(double) {
  return __longlong_as_double(0xfff0000000000000ULL);
}

// Runs body(i, n, oy, ox, c) for every element i of the output [s.n, s.ho, s.wo, s.c].
template <class Body>
__device__ __forceinline__ void kg_pool_nhwc_each(const KgPoolNhwcShape& s, const Body& body) {
  const long long total = s.n * s.ho * s.wo * s.c;
  for (long long i = kg_thread_index(); i < total; i += kg_grid_stride()) {
    const long long c = i % s.c, pix = i / s.c;
    const long long ox = pix % s.wo, rest = pix / s.wo;
    body(i, rest / s.ho, rest % s.ho, ox, c);
  }
}

// V consecutive channels, loaded and stored as one access of V elements.
template <class T, int V>
struct alignas(sizeof(T) * V) KgPoolPack {
  T e[V];
};

// A thread per V consecutive channels of an output pixel (16-byte loads where the channel
// count allows); quotients in 32 bits when Small (fewer than 2^31 packs).
template <class T, int V, bool Small>
__device__ __forceinline__ void kg_max_pool2d_nhwc_run(const T* __restrict__ x, T* __restrict__ y,
                                                       const KgPoolNhwcShape& s) {
  typedef kg_compute_t<T> C;
  typedef KgPoolPack<T, V> P;
  const long long cv = s.c / V, total = s.n * s.ho * s.wo * cv;
  for (long long i = kg_thread_index(); i < total; i += kg_grid_stride()) {
    long long cb, ox, oy;
    const long long pix = kg_pool_divmod<Small>(i, cv, cb);
    const long long n = kg_pool_divmod<Small>(kg_pool_divmod<Small>(pix, s.wo, ox), s.ho, oy);
    const T* img = x + n * s.h * s.w * s.c + cb * V;
    const long long iy0 = oy * s.sh - s.ph, ix0 = ox * s.sw - s.pw;
    C m[V];
    P pick;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      m[j] = kg_pool_nhwc_lowest(C(0));
      pick.e[j] = kg_from_compute<T>(m[j]);
    }
    for (long long ky = 0; ky < s.kh; ++ky) {
      const long long iy = iy0 + ky * s.dh;
      if (iy < 0 || iy >= s.h) continue;
      for (long long kx = 0; kx < s.kw; ++kx) {
        const long long ix = ix0 + kx * s.dw;
        if (ix < 0 || ix >= s.w) continue;
        const P v = *reinterpret_cast<const P*>(img + (iy * s.w + ix) * s.c);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const C c = kg_ld(v.e, j);
          if (c > m[j] || c != c) {
            m[j] = c;
            pick.e[j] = v.e[j];
          }
        }
      }
    }
    *reinterpret_cast<P*>(y + i * V) = pick;
  }
}

template <class T>
__device__ __forceinline__ void kg_max_pool2d_nhwc(const T* __restrict__ x, T* __restrict__ y,
                                                   const KgPoolNhwcShape& s) {
  constexpr int V = 16 / (int)sizeof(T);
  const bool small = s.n * s.ho * s.wo * s.c < (1LL << 31);
  if (s.c % V == 0) {
    if (small)
      kg_max_pool2d_nhwc_run<T, V, true>(x, y, s);
    else
      kg_max_pool2d_nhwc_run<T, V, false>(x, y, s);
  } else if (small) {
    kg_max_pool2d_nhwc_run<T, 1, true>(x, y, s);
  } else {
    kg_max_pool2d_nhwc_run<T, 1, false>(x, y, s);
  }
}

template <class T>
__device__ __forceinline__ void kg_avg_pool2d_nhwc(const T* __restrict__ x, T* __restrict__ y,
                                                   const KgPoolNhwcShape& s, int count_include_pad) {
  typedef kg_compute_t<T> C;
  kg_pool_nhwc_each(s, [&](long long i, long long n, long long oy, long long ox, long long c) {
    const T* img = x + n * s.h * s.w * s.c + c;
    long long y0 = oy * s.sh - s.ph, y1 = min(y0 + s.kh, s.h + s.ph);
    long long x0 = ox * s.sw - s.pw, x1 = min(x0 + s.kw, s.w + s.pw);
    const long long padded = (y1 - y0) * (x1 - x0);
    y0 = max(y0, 0LL);
    x0 = max(x0, 0LL);
    y1 = min(y1, s.h);
    x1 = min(x1, s.w);
    C sum = C(0);
    for (long long iy = y0; iy < y1; ++iy)
      for (long long ix = x0; ix < x1; ++ix) sum += kg_ld(img, (iy * s.w + ix) * s.c);
    const long long count = count_include_pad ? padded : max(y1 - y0, 0LL) * max(x1 - x0, 0LL);
    kg_st(y, i, sum / (C)count);
  });
}

// The mean over each image's hw rows of c channels: y [n, c].
template <class T>
__device__ __forceinline__ void kg_global_avg_pool_nhwc(const T* __restrict__ x, T* __restrict__ y,
                                                        long long n, long long hw, long long c) {
  typedef kg_compute_t<T> C;
  for (long long i = kg_thread_index(); i < n * c; i += kg_grid_stride()) {
    const T* src = x + i / c * hw * c + i % c;
    C sum = C(0);
    for (long long p = 0; p < hw; ++p) sum += kg_ld(src, p * c);
    kg_st(y, i, sum / (C)hw);
  }
}

// ---- entries ----
// One per element type (spelled out: the launch checks read the signatures from this text).

extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_max_pool2d_nhwc_f32(const float* __restrict__ x, float* __restrict__ y, KgPoolNhwcShape s) {
  kg_max_pool2d_nhwc<float>(x, y, s);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_avg_pool2d_nhwc_f32(const float* __restrict__ x, float* __restrict__ y, KgPoolNhwcShape s,
                           int count_include_pad) {
  kg_avg_pool2d_nhwc<float>(x, y, s, count_include_pad);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_global_avg_pool_nhwc_f32(const float* __restrict__ x, float* __restrict__ y, long long n, long long hw,
                                long long c) {
  kg_global_avg_pool_nhwc<float>(x, y, n, hw, c);
}

extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_max_pool2d_nhwc_f64(const double* __restrict__ x, double* __restrict__ y, KgPoolNhwcShape s) {
  kg_max_pool2d_nhwc<double>(x, y, s);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_avg_pool2d_nhwc_f64(const double* __restrict__ x, double* __restrict__ y, KgPoolNhwcShape s,
                           int count_include_pad) {
  kg_avg_pool2d_nhwc<double>(x, y, s, count_include_pad);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_global_avg_pool_nhwc_f64(const double* __restrict__ x, double* __restrict__ y, long long n, long long hw,
                                long long c) {
  kg_global_avg_pool_nhwc<double>(x, y, n, hw, c);
}

extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_max_pool2d_nhwc_f16(const kg_f16* __restrict__ x, kg_f16* __restrict__ y, KgPoolNhwcShape s) {
  kg_max_pool2d_nhwc<kg_f16>(x, y, s);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_avg_pool2d_nhwc_f16(const kg_f16* __restrict__ x, kg_f16* __restrict__ y, KgPoolNhwcShape s,
                           int count_include_pad) {
  kg_avg_pool2d_nhwc<kg_f16>(x, y, s, count_include_pad);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_global_avg_pool_nhwc_f16(const kg_f16* __restrict__ x, kg_f16* __restrict__ y, long long n, long long hw,
                                long long c) {
  kg_global_avg_pool_nhwc<kg_f16>(x, y, n, hw, c);
}

extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_max_pool2d_nhwc_bf16(const kg_bf16* __restrict__ x, kg_bf16* __restrict__ y, KgPoolNhwcShape s) {
  kg_max_pool2d_nhwc<kg_bf16>(x, y, s);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_avg_pool2d_nhwc_bf16(const kg_bf16* __restrict__ x, kg_bf16* __restrict__ y, KgPoolNhwcShape s,
                           int count_include_pad) {
  kg_avg_pool2d_nhwc<kg_bf16>(x, y, s, count_include_pad);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_global_avg_pool_nhwc_bf16(const kg_bf16* __restrict__ x, kg_bf16* __restrict__ y, long long n, long long hw,
                                long long c) {
  kg_global_avg_pool_nhwc<kg_bf16>(x, y, n, hw, c);
}
