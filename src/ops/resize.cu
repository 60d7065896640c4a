// nn.resize on the GPU (ONNX Resize; see ops/resize.hpp for the formulas): one thread per output
// element, in a grid-stride loop. Each thread maps its coordinate along every dim to the input
// taps and their weights, in double, with the arithmetic of ops/resize.cpp (the host computes
// the per-dim constants once, so that both sides evaluate the same expressions and nearest
// rounding picks the same input), then copies the nearest tap or sums weight products × inputs
// in double over the taps of every dim, the last dim fastest, as the CPU does.
#include "kg_device.cuh"

#define KG_RESIZE_THREADS 256
#define KG_RESIZE_MAX_DIMS 8

// The concrete resize, passed by value. ops/resize.cpp's ResizeArgs mirrors it member for
// member; every member is 8 bytes wide, so both have the same layout.
struct KgResizeArgs {
  long long rank;
  long long total;            // output elements
  long long mode;             // 0 nearest, 1 linear, 2 cubic
  long long rounding;         // nearest: 0 round_prefer_floor, 1 round_prefer_ceil, 2 floor, 3 ceil
  long long coord;            // 0 half_pixel, 1 pytorch_half_pixel, 2 align_corners, 3 asymmetric,
                              // 4 tf_half_pixel_for_nn, 5 half_pixel_symmetric
  long long exclude_outside;  // linear, cubic: taps outside the input weigh 0, the rest renormalised
  double cubic_a;
  long long in[KG_RESIZE_MAX_DIMS], out[KG_RESIZE_MAX_DIMS];
  long long in_stride[KG_RESIZE_MAX_DIMS];  // elements between consecutive input indices
  long long identity[KG_RESIZE_MAX_DIMS];   // 1: the output index is the input index
  double scale[KG_RESIZE_MAX_DIMS];         // of the coordinates
  double span[KG_RESIZE_MAX_DIMS];          // scale * in, the real output length
  double offset[KG_RESIZE_MAX_DIMS];        // half_pixel_symmetric's shift
};

// The input coordinate of output index o along dim d.
__device__ __forceinline__ double kg_resize_coord(const KgResizeArgs& a, int d, long long o) {
  const double x = (double)o, s = a.scale[d];
  switch (a.coord) {
    case 0:
      return (x + 0.5) / s - 0.5;
    case 1:
      return a.out[d] == 1 ? 0.0 : (x + 0.5) / s - 0.5;
    case 2:
      return a.span[d] == 1.0 ? 0.0 : x * (double)(a.in[d] - 1) / (a.span[d] - 1.0);
    case 3:
      return x / s;
    case 4:
      return (x + 0.5) / s;
    default:
      return a.offset[d] + (x + 0.5) / s - 0.5;
  }
}

// The taps of output index o along dim d: their input indices (clamped into the input) and
// weights; returns how many (1 nearest, 2 linear, 4 cubic).
__device__ __forceinline__ int kg_resize_taps(const KgResizeArgs& a, int d, long long o, long long* idx,
                                              double* wt) {
  const long long n = a.in[d];
  const double xo = kg_resize_coord(a, d, o), f = floor(xo);
  if (a.mode == 0) {
    long long i = (long long)f;
    if (xo != f) {
      const double r = xo - f;
      if (a.rounding == 0)
        i += r > 0.5 ? 1 : 0;
      else if (a.rounding == 1)
        i += r >= 0.5 ? 1 : 0;
      else if (a.rounding == 3)
        i += 1;
    }
    idx[0] = i < 0 ? 0 : i >= n ? n - 1 : i;
    wt[0] = 1.0;
    return 1;
  }
  // The left neighbour and the distance r in (0, 1] from it: an integer coordinate is the right
  // neighbour of the interval left of it.
  const long long left = xo == f ? (long long)f - 1 : (long long)f;
  const double r = xo == f ? 1.0 : xo - f;
  int nt;
  long long first;
  if (a.mode == 1) {
    nt = 2;
    first = left;
    wt[0] = 1.0 - r;
    wt[1] = r;
  } else {
    nt = 4;
    first = left - 1;
    const double A = a.cubic_a, q = 1.0 - r;
    wt[0] = ((A * (r + 1.0) - 5.0 * A) * (r + 1.0) + 8.0 * A) * (r + 1.0) - 4.0 * A;
    wt[1] = ((A + 2.0) * r - (A + 3.0)) * r * r + 1.0;
    wt[2] = ((A + 2.0) * q - (A + 3.0)) * q * q + 1.0;
    wt[3] = ((A * (q + 1.0) - 5.0 * A) * (q + 1.0) + 8.0 * A) * (q + 1.0) - 4.0 * A;
  }
  if (a.exclude_outside) {
    double sum = 0.0;
    for (int k = 0; k < nt; ++k) {
      if (first + k < 0 || first + k >= n) wt[k] = 0.0;
      sum += wt[k];
    }
    if (sum != 0.0)
      for (int k = 0; k < nt; ++k) wt[k] = wt[k] / sum;
  }
  for (int k = 0; k < nt; ++k) {
    const long long i = first + k;
    idx[k] = i < 0 ? 0 : i >= n ? n - 1 : i;
  }
  return nt;
}

template <class T>
__device__ __forceinline__ void kg_resize(const T* __restrict__ x, T* __restrict__ y, const KgResizeArgs& a) {
  const int rank = (int)a.rank;
  for (long long i = kg_thread_index(); i < a.total; i += kg_grid_stride()) {
    long long idx[KG_RESIZE_MAX_DIMS][4];
    double wt[KG_RESIZE_MAX_DIMS][4];
    int nt[KG_RESIZE_MAX_DIMS];
    long long rem = i, combos = 1;
    for (int d = rank - 1; d >= 0; --d) {
      const long long o = rem % a.out[d];
      rem /= a.out[d];
      if (a.identity[d]) {
        nt[d] = 1;
        idx[d][0] = o;
        wt[d][0] = 1.0;
      } else {
        nt[d] = kg_resize_taps(a, d, o, idx[d], wt[d]);
      }
      combos *= nt[d];
    }
    if (a.mode == 0) {
      long long off = 0;
      for (int d = 0; d < rank; ++d) off += idx[d][0] * a.in_stride[d];
      y[i] = x[off];
      continue;
    }
    // Every combination of one tap per dim, the last dim's tap fastest; the weight is the
    // product over the dims in order.
    double acc = 0.0;
    for (long long k = 0; k < combos; ++k) {
      int t[KG_RESIZE_MAX_DIMS];
      long long r = k;
      for (int d = rank - 1; d >= 0; --d) {
        t[d] = (int)(r % nt[d]);
        r /= nt[d];
      }
      long long off = 0;
      double w = 1.0;
      for (int d = 0; d < rank; ++d) {
        off += idx[d][t[d]] * a.in_stride[d];
        w = w * wt[d][t[d]];
      }
      acc += w * (double)x[off];
    }
    y[i] = (T)acc;
  }
}

// ---- entries ----

extern "C" __global__ void __launch_bounds__(KG_RESIZE_THREADS)
    kg_resize_f32(const float* __restrict__ x, float* __restrict__ y, KgResizeArgs a) {
  kg_resize<float>(x, y, a);
}
extern "C" __global__ void __launch_bounds__(KG_RESIZE_THREADS)
    kg_resize_f64(const double* __restrict__ x, double* __restrict__ y, KgResizeArgs a) {
  kg_resize<double>(x, y, a);
}
