// nn.batch_norm2d (running or batch statistics) and nn.layer_norm on the GPU. The block size,
// the row strategies and the scratch layouts are norm_shared.cuh's. Layer norm reads its input
// through a loader (prologue.cuh): the tensor itself for the entries below, or a folded prologue
// (ops/fused_reduction), whose module holds this file without the sections guarded by
// KG_FUSED_MODULE (its entries) and an entry of its own.
#include "index.cuh"
#include "norm_device.cuh"
#include "norm_shared.cuh"
#include "prologue.cuh"
#include "reduce.cuh"

__device__ __forceinline__ float kg_sqrt(float v) { return sqrtf(v); }
__device__ __forceinline__ double kg_sqrt(double v) { return sqrt(v); }

// ---- nn.batch_norm2d ----
// One entry for both modes, three phases (`phase`); `training` selects batch statistics.
//   phase 0 (training only): each channel's M = N*H*W values are cut into `chunks` ranges, a
//     block per (channel, range); each block writes the count, mean and sum of squared
//     deviations of its range to `partials` (KG_BN_FWD_PARTIALS doubles per block,
//     channel-major). One pass over the range: the sums of d = x - s and d^2 in double, s being
//     the range's first value (shifted data keep d^2's sum from cancelling: the variance is
//     Σd² - (Σd)²/n, exact in double for float data near s), block tree sums in fixed order.
//     Where a plane holds whole 16-byte packs, the ranges are of packs and read as packs.
//   phase 1 (a thread per channel): the scale and shift, in double as the CPU computes them:
//     scale = w / sqrt(var + eps), shift = b - mean * scale, stored as T in `scale_shift` (the C
//     scales, then the C shifts). Inference takes the running statistics; training merges the
//     ranges in order (Chan's pairwise update: exact algebra, no atomics, the same result for
//     any schedule), takes the biased variance and updates the running statistics in place as
//     PyTorch does: running = (1 - momentum) running + momentum batch (the unbiased variance),
//     num_batches_tracked + 1.
//   phase 2 applies y = x * scale[c] + shift[c] to every element, the channel of element i
//     being (i / hw) % c; in 16-byte packs when H*W is a multiple of a pack (one channel per pack).

template <class T, bool Small>
__device__ __forceinline__ void kg_batch_norm2d_apply(const T* __restrict__ x,
                                                      const T* __restrict__ scale_shift, T* __restrict__ y,
                                                      kg_index total, kg_index c, const KgDivider& hw_div,
                                                      const KgDivider& c_div) {
  constexpr int W = KG_PACK_BYTES / sizeof(T);
  if (Small && hw_div.d % W == 0 && kg_aligned16(x) && kg_aligned16(y)) {
    // 16-byte packs, each within one plane: one channel lookup per pack.
    const KgPack<T>* xp = reinterpret_cast<const KgPack<T>*>(x);
    KgPack<T>* yp = reinterpret_cast<KgPack<T>*>(y);
    kg_for_each_unrolled<KgPack<T>>(
        total / W, [&](kg_index j) { return xp[j]; },
        [&](kg_index j, KgPack<T> p) {
          const kg_index plane = kg_div<true>(hw_div, j * W);
          const kg_index ch = plane - kg_div<true>(c_div, plane) * c;
          const T sc = scale_shift[ch], sh = scale_shift[c + ch];
#pragma unroll
          for (int k = 0; k < W; ++k) p.v[k] = p.v[k] * sc + sh;
          yp[j] = p;
        });
    return;
  }
  kg_for_each_unrolled<T, Small ? KG_UNROLL : 1>(
      total, [&](kg_index i) { return x[i]; },
      [&](kg_index i, T v) {
        const kg_index plane = kg_div<Small>(hw_div, i);
        const kg_index ch = plane - kg_div<Small>(c_div, plane) * c;
        y[i] = v * scale_shift[ch] + scale_shift[c + ch];
      });
}

template <class T, bool Small>
__device__ __forceinline__ void kg_batch_norm2d_partials(const T* __restrict__ x, double* __restrict__ partials,
                                                         kg_index total, kg_index c, kg_index chunks,
                                                         const KgDivider& hw_div) {
  __shared__ double smem[32];
  constexpr int W = KG_PACK_BYTES / sizeof(T);
  // Ranges of whole 16-byte packs where a plane holds whole packs (`unit` values each).
  const int unit = Small && hw_div.d % W == 0 && kg_aligned16(x) ? W : 1;
  const kg_index m = total / c;
  for (kg_index blk = blockIdx.x; blk < c * chunks; blk += gridDim.x) {
    const kg_index ch = blk / chunks, k = blk - ch * chunks;
    const KgBnRange r = kg_bn_range(m / unit, chunks, k);
    // One pass: sums of x - s and (x - s)^2 in double, shifted by the range's first value s.
    const double shift = (double)x[kg_bn_offset<Small>(r.begin * unit, ch, c, hw_div)];
    double s1 = 0, s2 = 0;
    auto add = [&](T v) {
      const double d = (double)v - shift;
      s1 += d;
      s2 += d * d;
    };
    if (unit == W) {
      const KgPack<T>* xp = reinterpret_cast<const KgPack<T>*>(x);
      kg_bn_for_range<KG_BN_PACK_UNROLL>(
          r.begin, r.end, [&](kg_index u) { return xp[kg_bn_offset<true>(u * W, ch, c, hw_div) / W]; },
          [&](const KgPack<T>& p) {
#pragma unroll
            for (int e = 0; e < W; ++e) add(p.v[e]);
          });
    } else {
      kg_bn_for_range<KG_BN_UNROLL>(
          r.begin, r.end, [&](kg_index i) { return x[kg_bn_offset<Small>(i, ch, c, hw_div)]; }, add);
    }
    s1 = kg_block_sum(s1, smem);
    s2 = kg_block_sum(s2, smem);
    if (threadIdx.x == 0) {
      const double count = (double)((r.end - r.begin) * unit), dm = s1 / count;
      double* p = partials + KG_BN_FWD_PARTIALS * blk;
      p[0] = count;
      p[1] = shift + dm;
      p[2] = fmax(s2 - s1 * dm, 0.0);
    }
  }
}

template <class T>
__device__ __forceinline__ void kg_batch_norm2d_scale_shift(const T* __restrict__ w, const T* __restrict__ b,
                                                            T* mean, T* var, long long* tracked, T* scale_shift,
                                                            const double* __restrict__ partials, kg_index c,
                                                            kg_index chunks, double eps, double momentum,
                                                            int training) {
  for (kg_index ch = kg_thread_index(); ch < c; ch += kg_grid_stride()) {
    double mu, sigma2;
    if (training) {
      KgBnMoments acc = kg_bn_moments(partials + KG_BN_FWD_PARTIALS * ch * chunks);
      for (kg_index k = 1; k < chunks; ++k)
        acc = kg_bn_merge(acc, kg_bn_moments(partials + KG_BN_FWD_PARTIALS * (ch * chunks + k)));
      mu = acc.mean;
      sigma2 = acc.m2 / acc.count;
      const double unbias = acc.count / (acc.count - 1);
      mean[ch] = (T)((1.0 - momentum) * (double)mean[ch] + momentum * mu);
      var[ch] = (T)((1.0 - momentum) * (double)var[ch] + momentum * sigma2 * unbias);
      if (ch == 0) *tracked += 1;
    } else {
      mu = (double)mean[ch];
      sigma2 = (double)var[ch];
    }
    const double sc = (double)w[ch] / sqrt(sigma2 + eps);
    scale_shift[ch] = (T)sc;
    scale_shift[c + ch] = (T)((double)b[ch] - mu * sc);
  }
}

template <class T>
__device__ __forceinline__ void kg_batch_norm2d(const T* __restrict__ x, const T* __restrict__ w,
                                                const T* __restrict__ b, T* mean, T* var, long long* tracked,
                                                T* __restrict__ y, T* scale_shift, double* partials,
                                                long long total, long long c, long long chunks, double eps,
                                                double momentum, int training, int phase, KgDivider hw_div,
                                                KgDivider c_div) {
  const bool small = total < (1LL << 31);
  if (phase == 0) {
    if (small)
      kg_batch_norm2d_partials<T, true>(x, partials, total, c, chunks, hw_div);
    else
      kg_batch_norm2d_partials<T, false>(x, partials, total, c, chunks, hw_div);
  } else if (phase == 1) {
    kg_batch_norm2d_scale_shift<T>(w, b, mean, var, tracked, scale_shift, partials, c, chunks, eps, momentum,
                                   training);
  } else if (small) {
    kg_batch_norm2d_apply<T, true>(x, scale_shift, y, total, c, hw_div, c_div);
  } else {
    kg_batch_norm2d_apply<T, false>(x, scale_shift, y, total, c, hw_div, c_div);
  }
}

#ifndef KG_FUSED_MODULE
extern "C" __global__ void __launch_bounds__(KG_NORM_THREADS)
    kg_batch_norm2d_f32(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                        float* running_mean, float* running_var, long long* num_batches_tracked,
                        float* __restrict__ y, float* scale_shift, double* partials, long long total, long long c,
                        long long chunks, double eps, double momentum, int training, int phase, KgDivider hw_div,
                        KgDivider c_div) {
  kg_batch_norm2d<float>(x, w, b, running_mean, running_var, num_batches_tracked, y, scale_shift, partials, total,
                         c, chunks, eps, momentum, training, phase, hw_div, c_div);
}

extern "C" __global__ void __launch_bounds__(KG_NORM_THREADS)
    kg_batch_norm2d_f64(const double* __restrict__ x, const double* __restrict__ w,
                        const double* __restrict__ b, double* running_mean, double* running_var,
                        long long* num_batches_tracked, double* __restrict__ y, double* scale_shift,
                        double* partials, long long total, long long c, long long chunks, double eps,
                        double momentum, int training, int phase, KgDivider hw_div, KgDivider c_div) {
  kg_batch_norm2d<double>(x, w, b, running_mean, running_var, num_batches_tracked, y, scale_shift, partials,
                          total, c, chunks, eps, momentum, training, phase, hw_div, c_div);
}
#endif  // KG_FUSED_MODULE

// ---- nn.layer_norm ----
// Each row of `inner` elements is normalised with its mean and biased variance (two passes over
// the row, the second one re-reading it from cache), then scaled and shifted elementwise when
// w and b are given. Rows of up to KG_LN_WARP_MAX elements take one warp each (8 rows per block);
// longer rows one block each.

// Row r's element j is ld(base + j), base = r * inner.
template <class T, class Load>
__device__ __forceinline__ void kg_layer_norm_write(const Load& ld, kg_index base, T* __restrict__ dst,
                                                    const T* __restrict__ w, const T* __restrict__ b, T mean,
                                                    T inv, kg_index inner, kg_index j0, kg_index step) {
  if (w) {
    for (kg_index j = j0; j < inner; j += step) dst[j] = ((T)ld(base + j) - mean) * inv * w[j] + b[j];
  } else {
    for (kg_index j = j0; j < inner; j += step) dst[j] = ((T)ld(base + j) - mean) * inv;
  }
}

template <class T, class Load>
__device__ __forceinline__ void kg_layer_norm(const Load& ld, const T* __restrict__ w, const T* __restrict__ b,
                                              T* __restrict__ y, long long rows, long long inner, double eps) {
  const T n = (T)inner;
  if (inner <= KG_LN_WARP_MAX) {
    const int lane = threadIdx.x & 31;
    const kg_index warps = (kg_index)gridDim.x * (KG_NORM_THREADS / 32);
    for (kg_index r = (kg_index)blockIdx.x * (KG_NORM_THREADS / 32) + (threadIdx.x >> 5); r < rows;
         r += warps) {
      const kg_index base = r * inner;
      T s = T(0);
      for (kg_index j = lane; j < inner; j += 32) s += (T)ld(base + j);
      const T mean = kg_warp_sum(s) / n;
      T v = T(0);
      for (kg_index j = lane; j < inner; j += 32) {
        const T d = (T)ld(base + j) - mean;
        v += d * d;
      }
      const T inv = T(1) / kg_sqrt(kg_warp_sum(v) / n + (T)eps);
      kg_layer_norm_write<T>(ld, base, y + base, w, b, mean, inv, inner, lane, 32);
    }
    return;
  }
  __shared__ T smem[32];
  for (kg_index r = blockIdx.x; r < rows; r += gridDim.x) {
    const kg_index base = r * inner;
    T s = T(0);
    for (kg_index j = threadIdx.x; j < inner; j += KG_NORM_THREADS) s += (T)ld(base + j);
    const T mean = kg_block_sum(s, smem) / n;
    T v = T(0);
    for (kg_index j = threadIdx.x; j < inner; j += KG_NORM_THREADS) {
      const T d = (T)ld(base + j) - mean;
      v += d * d;
    }
    const T inv = T(1) / kg_sqrt(kg_block_sum(v, smem) / n + (T)eps);
    kg_layer_norm_write<T>(ld, base, y + base, w, b, mean, inv, inner, threadIdx.x, KG_NORM_THREADS);
  }
}

#ifndef KG_FUSED_MODULE

extern "C" __global__ void __launch_bounds__(KG_NORM_THREADS)
    kg_layer_norm_f32(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                      float* __restrict__ y, long long rows, long long inner, double eps) {
  kg_layer_norm<float>(kg_load_ptr(x), w, b, y, rows, inner, eps);
}

extern "C" __global__ void __launch_bounds__(KG_NORM_THREADS)
    kg_layer_norm_f64(const double* __restrict__ x, const double* __restrict__ w,
                      const double* __restrict__ b, double* __restrict__ y, long long rows, long long inner,
                      double eps) {
  kg_layer_norm<double>(kg_load_ptr(x), w, b, y, rows, inner, eps);
}
#endif  // KG_FUSED_MODULE
