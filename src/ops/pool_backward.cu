// The backward of the pooling family on the GPU, for [N, C, H, W] tensors seen as N*C planes:
// one thread per input element (grid-stride), which gathers the output gradients of the
// windows that cover it, so every element of dx is written once, with no atomics and in a
// fixed order. The window arithmetic is that of the forward kernels in pool.cu.
//
// - max_pool2d: two launches. The first finds each window's pick, the tap the forward took (the
//   first largest, or the last NaN, as PyTorch), and writes it to the backward's scratch as an
//   index in its plane; the second gives each input element the gradients of the windows that
//   picked it.
// - avg_pool2d: each covering window adds dy / its divisor (count_include_pad or not).
// - global_avg_pool: dy of the plane / (H * W).
// - upsample_nearest2d: the sum of dy over the scale_h × scale_w block the element was copied to.
// The block size and the geometry (KgPoolShape, that of the forward) are pool_shared.cuh's, the
// index loops pool_device.cuh's.
#include "index.cuh"
#include "kg_device.cuh"
#include "pool_device.cuh"
#include "pool_shared.cuh"

// Runs body(i, plane, iy, ix) for every input element i of the planes; nothing when dx is null
// (not wanted).
template <class T, class Body>
__device__ __forceinline__ void kg_pool_grad_for_each(T* dx, const KgPoolShape& s, const Body& body) {
  if (dx) kg_pool_launch(s.planes, s.h, s.w, body);
}

// Calls fn(o, t) for each window o in [0, n) (first tap at o * stride - pad, taps dil apart)
// whose tap t lands on `pos`, in increasing t.
template <class Fn>
__device__ __forceinline__ void kg_pool_windows(long long pos, long long n, long long k, long long stride,
                                                long long pad, long long dil, const Fn& fn) {
  const bool small = pos + pad < (1LL << 31) && stride < (1LL << 31);
  for (long long t = 0; t < k; ++t) {
    const long long q = pos + pad - t * dil;
    if (q < 0) break;  // q falls as t grows
    long long r;
    const long long o = small ? kg_pool_divmod<true>(q, stride, r) : kg_pool_divmod<false>(q, stride, r);
    if (r == 0 && o < n) fn(o, t);
  }
}

// ---- nn.max_pool2d ----

// Each window's pick as an index in its plane (iy * W + ix), or -1 for a window with no tap
// inside the input: the first strictly larger value, or a NaN. A thread per output element.
template <class T>
__device__ __forceinline__ void kg_max_pool2d_picks(const T* __restrict__ x, int* __restrict__ picks,
                                                    const KgPoolShape& s) {
  if (kg_pool_is_small_3x3(s)) {
    kg_pool_3x3_for_each(x, s, [&](unsigned i, const T* src, int y0, int x0) {
      T value;
      picks[i] = kg_pool_pick_3x3(src, (int)s.h, (int)s.w, y0, x0, value);
    });
    return;
  }
  kg_pool_launch(s.planes, s.ho, s.wo, [&](long long i, long long pl, long long oy, long long ox) {
    const T* src = x + pl * s.h * s.w;
    const long long y0 = oy * s.sh - s.ph, x0 = ox * s.sw - s.pw;
    long long pick = -1;
    T m = T(0);
    for (long long ky = 0; ky < s.kh; ++ky) {
      const long long yy = y0 + ky * s.dh;
      if (yy < 0 || yy >= s.h) continue;
      for (long long kx = 0; kx < s.kw; ++kx) {
        const long long xx = x0 + kx * s.dw;
        if (xx < 0 || xx >= s.w) continue;
        const T v = src[yy * s.w + xx];
        if (pick < 0 || v > m || v != v) {
          m = v;
          pick = yy * s.w + xx;
        }
      }
    }
    picks[i] = (int)pick;
  });
}

// The windows [lo, hi] of one axis (stride by its divider, no dilation) whose taps cover `pos`;
// lo > hi when none does. 32-bit: every value below 2^31.
struct KgPoolSpan {
  int lo, hi;
};
__device__ __forceinline__ KgPoolSpan kg_pool_span(int pos, int pad, int k, int n, const KgDivider& stride) {
  const int q = pos + pad;  // the first tap of window o sits at o * stride - pad
  const int hi = min((int)kg_div<true>(stride, q), n - 1);
  const int first = q - (k - 1);
  const int lo = first <= 0 ? 0 : (int)kg_div<true>(stride, first + (int)stride.d - 1);
  return {lo, hi};
}

// The gather without dilation and with every index below 2^31: divisions by multiply-high
// (KgPoolShape's dividers), the windows of each axis as a span. Windows are visited in the order
// of the general path (falling window index, i.e. rising tap).
template <class T>
__device__ __forceinline__ void kg_max_pool2d_backward_fast(const int* __restrict__ picks, const T* __restrict__ dy,
                                                            T* __restrict__ dx, const KgPoolShape& s) {
  const kg_index total = s.planes * s.h * s.w;
  const int w = (int)s.w, ho = (int)s.ho, wo = (int)s.wo;
  for (kg_index i = kg_thread_index(); i < total; i += kg_grid_stride()) {
    const int pl = (int)kg_div<true>(s.hw_div, i), pix = (int)(i - (kg_index)pl * s.hw_div.d);
    const int iy = (int)kg_div<true>(s.w_div, pix), ix = pix - iy * w;
    const KgPoolSpan ys = kg_pool_span(iy, (int)s.ph, (int)s.kh, ho, s.sh_div);
    const KgPoolSpan xs = kg_pool_span(ix, (int)s.pw, (int)s.kw, wo, s.sw_div);
    const int* pp = picks + (kg_index)pl * ho * wo;
    const T* gp = dy + (kg_index)pl * ho * wo;
    T acc = T(0);
    if (ys.hi - ys.lo <= 1 && xs.hi - xs.lo <= 1) {
      // At most 2 × 2 windows (a kernel no wider than twice its stride, as 3×3 stride 2): the
      // eight loads are issued before any compare, so that they overlap; the sum keeps the loop's
      // order below.
      int pick[4];
      T g[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int oy = ys.hi - (k >> 1), ox = xs.hi - (k & 1);
        const bool in = oy >= ys.lo && ox >= xs.lo;
        pick[k] = in ? pp[oy * wo + ox] : -1;
        g[k] = in ? gp[oy * wo + ox] : T(0);
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) acc += pick[k] == pix ? g[k] : T(0);
    } else {
      // Both loads of a window issued before the compare, so that they overlap.
      for (int oy = ys.hi; oy >= ys.lo; --oy)
        for (int ox = xs.hi; ox >= xs.lo; --ox) {
          const int o = oy * wo + ox;
          const int pick = pp[o];
          const T g = gp[o];
          acc += pick == pix ? g : T(0);
        }
    }
    dx[i] = acc;
  }
}

template <class T>
__device__ __forceinline__ void kg_max_pool2d_backward(const int* __restrict__ picks, const T* __restrict__ dy,
                                                       T* __restrict__ dx, const KgPoolShape& s) {
  if (!dx) return;
  const long long big = 1LL << 30;
  if (s.dh == 1 && s.dw == 1 && s.planes * s.h * s.w < big && s.planes * s.ho * s.wo < big && s.h + s.ph < big &&
      s.w + s.pw < big && s.sh < big && s.sw < big) {
    kg_max_pool2d_backward_fast(picks, dy, dx, s);
    return;
  }
  kg_pool_grad_for_each(dx, s, [&](long long i, long long pl, long long iy, long long ix) {
    const int self = (int)(iy * s.w + ix);
    const long long plane = pl * s.ho * s.wo;
    T acc = T(0);
    kg_pool_windows(iy, s.ho, s.kh, s.sh, s.ph, s.dh, [&](long long oy, long long) {
      kg_pool_windows(ix, s.wo, s.kw, s.sw, s.pw, s.dw, [&](long long ox, long long) {
        const long long o = plane + oy * s.wo + ox;
        if (picks[o] == self) acc += dy[o];
      });
    });
    dx[i] = acc;
  });
}

// ---- nn.avg_pool2d ----

template <class T>
__device__ __forceinline__ void kg_avg_pool2d_backward(const T* __restrict__ dy, T* __restrict__ dx,
                                                       const KgPoolShape& s, int count_include_pad) {
  kg_pool_grad_for_each(dx, s, [&](long long i, long long pl, long long iy, long long ix) {
    T acc = T(0);
    kg_pool_windows(iy, s.ho, s.kh, s.sh, s.ph, 1, [&](long long oy, long long) {
      long long y0 = oy * s.sh - s.ph, y1 = min(y0 + s.kh, s.h + s.ph);
      const long long rows = y1 - y0;
      y0 = max(y0, 0LL);
      y1 = min(y1, s.h);
      kg_pool_windows(ix, s.wo, s.kw, s.sw, s.pw, 1, [&](long long ox, long long) {
        long long x0 = ox * s.sw - s.pw, x1 = min(x0 + s.kw, s.w + s.pw);
        const long long cols = x1 - x0;
        x0 = max(x0, 0LL);
        x1 = min(x1, s.w);
        const long long count = count_include_pad ? rows * cols : (y1 - y0) * (x1 - x0);
        acc += dy[(pl * s.ho + oy) * s.wo + ox] / (T)count;
      });
    });
    dx[i] = acc;
  });
}

// ---- nn.upsample_nearest2d ----

template <class T>
__device__ __forceinline__ void kg_upsample_nearest2d_backward(const T* __restrict__ dy, T* __restrict__ dx,
                                                               const KgPoolShape& s) {
  kg_pool_grad_for_each(dx, s, [&](long long i, long long pl, long long iy, long long ix) {
    const T* src = dy + (pl * s.ho + iy * s.kh) * s.wo + ix * s.kw;
    T acc = T(0);
    for (long long a = 0; a < s.kh; ++a)
      for (long long b = 0; b < s.kw; ++b) acc += src[a * s.wo + b];
    dx[i] = acc;
  });
}

// ---- nn.global_avg_pool ----

template <class T>
__device__ __forceinline__ void kg_global_avg_pool_backward(const T* __restrict__ dy, T* __restrict__ dx,
                                                            long long planes, long long hw) {
  if (!dx) return;
  kg_pool_launch(planes, 1, hw, [&](long long i, long long pl, long long, long long) { dx[i] = dy[pl] / (T)hw; });
}

// ---- entries ----

extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_max_pool2d_picks_f32(const float* __restrict__ x, int* __restrict__ picks, KgPoolShape s) {
  kg_max_pool2d_picks<float>(x, picks, s);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_max_pool2d_picks_f64(const double* __restrict__ x, int* __restrict__ picks, KgPoolShape s) {
  kg_max_pool2d_picks<double>(x, picks, s);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_max_pool2d_backward_f32(const int* __restrict__ picks, const float* __restrict__ dy,
                               float* __restrict__ dx, KgPoolShape s) {
  kg_max_pool2d_backward<float>(picks, dy, dx, s);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_max_pool2d_backward_f64(const int* __restrict__ picks, const double* __restrict__ dy,
                               double* __restrict__ dx, KgPoolShape s) {
  kg_max_pool2d_backward<double>(picks, dy, dx, s);
}

extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_avg_pool2d_backward_f32(const float* __restrict__ dy, float* __restrict__ dx, KgPoolShape s,
                               int count_include_pad) {
  kg_avg_pool2d_backward<float>(dy, dx, s, count_include_pad);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_avg_pool2d_backward_f64(const double* __restrict__ dy, double* __restrict__ dx, KgPoolShape s,
                               int count_include_pad) {
  kg_avg_pool2d_backward<double>(dy, dx, s, count_include_pad);
}

extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_upsample_nearest2d_backward_f32(const float* __restrict__ dy, float* __restrict__ dx, KgPoolShape s) {
  kg_upsample_nearest2d_backward<float>(dy, dx, s);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_upsample_nearest2d_backward_f64(const double* __restrict__ dy, double* __restrict__ dx,
                                       KgPoolShape s) {
  kg_upsample_nearest2d_backward<double>(dy, dx, s);
}

extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_global_avg_pool_backward_f32(const float* __restrict__ dy, float* __restrict__ dx, long long planes,
                                    long long hw) {
  kg_global_avg_pool_backward<float>(dy, dx, planes, hw);
}
extern "C" __global__ void __launch_bounds__(KG_POOL_THREADS)
    kg_global_avg_pool_backward_f64(const double* __restrict__ dy, double* __restrict__ dx, long long planes,
                                    long long hw) {
  kg_global_avg_pool_backward<double>(dy, dx, planes, hw);
}
