// The backward of nn.conv2d on the GPU, for [N, C, H, W] inputs, [O, C/groups, kh, kw] weights
// and any stride, padding, dilation and groups (ops/conv_gpu.cpp launches them):
//
// - input: one thread per input element, summing dy * w over the output pixels and channels of
//   its group whose window covers it (a gather: no atomics, every element written once);
// - weight: one block per weight element and range of images, its threads summing dy * x over
//   those images' output pixels, then a block reduction; with several ranges a second launch adds
//   each weight's partial sums in order (a fixed order: the result does not vary between runs);
// - bias: one block per output channel, the sum of dy over the batch's pixels.
//
// Every loop is a grid-stride loop with 64-bit indices, so one launch covers any size. A kernel
// whose gradient is not wanted (a null pointer) returns at once.
#include "conv_shared.cuh"  // KG_CONV_BWD_THREADS and KgConvGradShape, shared with ops/conv_gpu.cpp
#include "reduce.cuh"

// dx[img, c, iy, ix] = sum over the group's output channels o and the taps (ky, kx) that put
// (iy, ix) under output pixel (oy, ox) of dy[img, o, oy, ox] * w[o, c % cg, ky, kx].
template <class T>
__device__ __forceinline__ void kg_conv2d_backward_input(const T* __restrict__ dy, const T* __restrict__ w,
                                                         T* __restrict__ dx, const KgConvGradShape& s) {
  if (!dx) return;  // not wanted
  const long long cg = s.c / s.groups, og = s.o / s.groups, khw = s.kh * s.kw;
  const long long total = s.n * s.c * s.h * s.w, hwo = s.ho * s.wo;
  for (long long i = kg_thread_index(); i < total; i += kg_grid_stride()) {
    const long long ix = i % s.w, iy = i / s.w % s.h, c = i / (s.w * s.h) % s.c, img = i / (s.w * s.h * s.c);
    const long long g = c / cg, cl = c - g * cg;
    const T* dyg = dy + (img * s.o + g * og) * hwo;
    const T* wg = w + (g * og * cg + cl) * khw;
    T acc = T(0);
    for (long long ky = 0; ky < s.kh; ++ky) {
      const long long ty = iy + s.ph - ky * s.dh;
      if (ty < 0 || ty % s.sh != 0) continue;
      const long long oy = ty / s.sh;
      if (oy >= s.ho) continue;
      for (long long kx = 0; kx < s.kw; ++kx) {
        const long long tx = ix + s.pw - kx * s.dw;
        if (tx < 0 || tx % s.sw != 0) continue;
        const long long ox = tx / s.sw;
        if (ox >= s.wo) continue;
        const T* d = dyg + oy * s.wo + ox;
        const T* wt = wg + ky * s.kw + kx;
        for (long long om = 0; om < og; ++om) acc += d[om * hwo] * wt[om * cg * khw];
      }
    }
    dx[i] = acc;
  }
}

// dw[o, cl, ky, kx] = sum over images and output pixels of dy[img, o, oy, ox] * x[img, g * cg +
// cl, oy * sh - ph + ky * dh, ox * sw - pw + kx * dw] (0 in the padding). Block (b, r) sums weight
// element b (a grid-stride loop over the blocks) over the r-th of `chunks` ranges of images: into
// dw when there is one range, else into partial[b * chunks + r]. The threads stride over the
// range's (image, pixel) pairs with 32-bit indices: the host makes each range hold fewer than 2^31.
template <class T>
__device__ __forceinline__ void kg_conv2d_backward_weight(const T* __restrict__ x, const T* __restrict__ dy,
                                                          T* __restrict__ dw, T* __restrict__ partial,
                                                          long long chunks, const KgConvGradShape& s) {
  __shared__ T red[32];
  if (!dw) return;  // not wanted
  const long long cg = s.c / s.groups, og = s.o / s.groups, khw = s.kh * s.kw;
  const long long kdim = cg * khw, hwo = s.ho * s.wo, hwi = s.h * s.w;
  const long long per = (s.n + chunks - 1) / chunks, img0 = blockIdx.y * per;
  const long long img1 = img0 + per < s.n ? img0 + per : s.n;
  const unsigned npix = static_cast<unsigned>(hwo), wo = static_cast<unsigned>(s.wo);
  const unsigned items = static_cast<unsigned>((img1 > img0 ? img1 - img0 : 0) * hwo);
  for (long long b = blockIdx.x; b < s.o * kdim; b += gridDim.x) {
    const long long o = b / kdim, r = b - o * kdim;
    const long long cl = r / khw, ky = r / s.kw % s.kh, kx = r % s.kw;
    const long long c = o / og * cg + cl;
    const long long dy0 = ky * s.dh - s.ph, dx0 = kx * s.dw - s.pw;  // input position of pixel (0, 0)
    T acc = T(0);
    for (unsigned t = threadIdx.x; t < items; t += blockDim.x) {
      const unsigned i = t / npix, p = t - i * npix, oy = p / wo, ox = p - oy * wo;
      const long long img = img0 + i;
      const long long iy = oy * s.sh + dy0, ix = ox * s.sw + dx0;
      if (iy < 0 || iy >= s.h || ix < 0 || ix >= s.w) continue;
      acc += dy[(img * s.o + o) * hwo + p] * x[(img * s.c + c) * hwi + iy * s.w + ix];
    }
    acc = kg_block_sum(acc, red);
    if (threadIdx.x == 0) {
      if (chunks == 1)
        dw[b] = acc;
      else
        partial[b * chunks + blockIdx.y] = acc;
    }
  }
}

// dw[i] = the sum of weight element i's partial sums, in range order (nothing to do for one range).
template <class T>
__device__ __forceinline__ void kg_conv2d_backward_weight_sum(const T* __restrict__ partial, T* __restrict__ dw,
                                                              long long weights, long long chunks) {
  if (!dw || chunks == 1) return;
  for (long long i = kg_thread_index(); i < weights; i += kg_grid_stride()) {
    T acc = T(0);
    for (long long r = 0; r < chunks; ++r) acc += partial[i * chunks + r];
    dw[i] = acc;
  }
}

// db[o] = sum over images and output pixels of dy[img, o, oy, ox]. One block per channel.
template <class T>
__device__ __forceinline__ void kg_conv2d_backward_bias(const T* __restrict__ dy, T* __restrict__ db,
                                                        const KgConvGradShape& s) {
  __shared__ T red[32];
  if (!db) return;  // not wanted
  const long long hwo = s.ho * s.wo, npix = s.n * hwo;
  for (long long o = blockIdx.x; o < s.o; o += gridDim.x) {
    T acc = T(0);
    for (long long t = threadIdx.x; t < npix; t += blockDim.x) {
      const long long img = t / hwo, pix = t - img * hwo;
      acc += dy[(img * s.o + o) * hwo + pix];
    }
    acc = kg_block_sum(acc, red);
    if (threadIdx.x == 0) db[o] = acc;
  }
}

// ---- entries ----

extern "C" __global__ void __launch_bounds__(KG_CONV_BWD_THREADS)
    kg_conv2d_backward_input_f32(const float* __restrict__ dy, const float* __restrict__ w,
                                 float* __restrict__ dx, KgConvGradShape s) {
  kg_conv2d_backward_input<float>(dy, w, dx, s);
}
extern "C" __global__ void __launch_bounds__(KG_CONV_BWD_THREADS)
    kg_conv2d_backward_input_f64(const double* __restrict__ dy, const double* __restrict__ w,
                                 double* __restrict__ dx, KgConvGradShape s) {
  kg_conv2d_backward_input<double>(dy, w, dx, s);
}

extern "C" __global__ void __launch_bounds__(KG_CONV_BWD_THREADS)
    kg_conv2d_backward_weight_f32(const float* __restrict__ x, const float* __restrict__ dy,
                                  float* __restrict__ dw, float* __restrict__ partial, long long chunks,
                                  KgConvGradShape s) {
  kg_conv2d_backward_weight<float>(x, dy, dw, partial, chunks, s);
}
extern "C" __global__ void __launch_bounds__(KG_CONV_BWD_THREADS)
    kg_conv2d_backward_weight_f64(const double* __restrict__ x, const double* __restrict__ dy,
                                  double* __restrict__ dw, double* __restrict__ partial, long long chunks,
                                  KgConvGradShape s) {
  kg_conv2d_backward_weight<double>(x, dy, dw, partial, chunks, s);
}

extern "C" __global__ void __launch_bounds__(KG_CONV_BWD_THREADS)
    kg_conv2d_backward_weight_sum_f32(const float* __restrict__ partial, float* __restrict__ dw, long long weights,
                                      long long chunks) {
  kg_conv2d_backward_weight_sum<float>(partial, dw, weights, chunks);
}
extern "C" __global__ void __launch_bounds__(KG_CONV_BWD_THREADS)
    kg_conv2d_backward_weight_sum_f64(const double* __restrict__ partial, double* __restrict__ dw,
                                      long long weights, long long chunks) {
  kg_conv2d_backward_weight_sum<double>(partial, dw, weights, chunks);
}

extern "C" __global__ void __launch_bounds__(KG_CONV_BWD_THREADS)
    kg_conv2d_backward_bias_f32(const float* __restrict__ dy, float* __restrict__ db, KgConvGradShape s) {
  kg_conv2d_backward_bias<float>(dy, db, s);
}
extern "C" __global__ void __launch_bounds__(KG_CONV_BWD_THREADS)
    kg_conv2d_backward_bias_f64(const double* __restrict__ dy, double* __restrict__ db, KgConvGradShape s) {
  kg_conv2d_backward_bias<double>(dy, db, s);
}
