// The backward of nn.batch_norm2d and nn.layer_norm on the GPU. Every sum is a block or warp
// tree in a fixed order (no atomics): the gradients do not depend on the schedule. An entry
// skips each gradient whose pointer is null. The block size, the row strategies and the scratch
// layouts are norm_shared.cuh's.
#include "index.cuh"
#include "norm_device.cuh"
#include "norm_shared.cuh"
#include "reduce.cuh"

__device__ __forceinline__ float kg_sqrt(float v) { return sqrtf(v); }
__device__ __forceinline__ double kg_sqrt(double v) { return sqrt(v); }

// ---- nn.batch_norm2d ----
// x and dy are [N, C, H, W]; per channel c, over its M = N*H*W elements:
//   training (batch statistics): mean, biased var of x; r = 1 / sqrt(var + eps); x̂ = (x - mean) r
//     db = Σ dy, dw = Σ dy x̂, dx = w r (dy - db / M - x̂ dw / M)
//   inference (running statistics): mean, var the running ones; db, dw alike, dx = w r dy.
// Three phases (`phase`), as the forward's:
//   phase 0: a block per (channel, range of its M values, `chunks` ranges) writes to `partials`
//     (KG_BN_BWD_PARTIALS doubles per block, channel-major) its count, its centre (the range's
//     own mean in training, the running mean in inference), the sum of squared deviations from
//     the centre, Σ dy and Σ dy (x - centre); one pass over the range (sums shifted by its first
//     value in training, as the forward's; ranges of 16-byte packs where a plane holds whole
//     packs), block tree sums in double;
//   phase 1 (a thread per channel) merges the ranges in order (no atomics, the same result for
//     any schedule), using Σ dy (x - mean) = Σ dy (x - centre) + (centre - mean) Σ dy, and writes
//     dw, db and the coefficients of dx = A dy + B (x - mean) + C as T in `coef` (A, B, mean, C for
//     each channel, channel-major);
//   phase 2 (when dx is wanted) applies them elementwise (in 16-byte packs when H*W is a multiple
//     of a pack).

template <class T, bool Small>
__device__ __forceinline__ void kg_batch_norm2d_backward_partials(const T* __restrict__ x,
                                                                  const T* __restrict__ rmean,
                                                                  const T* __restrict__ dy,
                                                                  double* __restrict__ partials, kg_index n,
                                                                  kg_index c, kg_index chunks,
                                                                  const KgDivider& hw_div, int training) {
  __shared__ double smem[32];
  constexpr int W = KG_PACK_BYTES / sizeof(T);
  // Ranges of whole 16-byte packs where a plane holds whole packs (`unit` values each).
  const int unit = Small && hw_div.d % W == 0 && kg_aligned16(x) && kg_aligned16(dy) ? W : 1;
  const kg_index m = n * hw_div.d;
  for (kg_index blk = blockIdx.x; blk < c * chunks; blk += gridDim.x) {
    const kg_index ch = blk / chunks, k = blk - ch * chunks;
    const KgBnRange r = kg_bn_range(m / unit, chunks, k);
    // One pass over x and dy, shifted by s: the range's first value in training, the running
    // mean in inference. Sums of d = x - s, d^2, dy and dy d, in double.
    const double shift =
        training ? (double)x[kg_bn_offset<Small>(r.begin * unit, ch, c, hw_div)] : (double)rmean[ch];
    double s1 = 0, s2 = 0, sdy = 0, sdyx = 0;
    auto add = [&](T xv, T gv) {
      const double d = (double)xv - shift, g = (double)gv;
      s1 += d;
      s2 += d * d;
      sdy += g;
      sdyx += g * d;
    };
    if (unit == W) {
      struct Packs {
        KgPack<T> x, dy;
      };
      const KgPack<T>* xp = reinterpret_cast<const KgPack<T>*>(x);
      const KgPack<T>* gp = reinterpret_cast<const KgPack<T>*>(dy);
      kg_bn_for_range<KG_BN_PACK_UNROLL>(
          r.begin, r.end,
          [&](kg_index u) {
            const kg_index e = kg_bn_offset<true>(u * W, ch, c, hw_div) / W;
            return Packs{xp[e], gp[e]};
          },
          [&](const Packs& v) {
#pragma unroll
            for (int e = 0; e < W; ++e) add(v.x.v[e], v.dy.v[e]);
          });
    } else {
      struct Pair {
        T x, dy;
      };
      kg_bn_for_range<KG_BN_UNROLL>(
          r.begin, r.end,
          [&](kg_index i) {
            const kg_index e = kg_bn_offset<Small>(i, ch, c, hw_div);
            return Pair{x[e], dy[e]};
          },
          [&](const Pair& v) { add(v.x, v.dy); });
    }
    s1 = training ? kg_block_sum(s1, smem) : 0.0;
    s2 = training ? kg_block_sum(s2, smem) : 0.0;
    sdy = kg_block_sum(sdy, smem);
    sdyx = kg_block_sum(sdyx, smem);
    if (threadIdx.x == 0) {
      // Re-centred on the range's own mean in training: Σ dy (x - mean) = Σ dy d - (mean - s) Σ dy.
      const double count = (double)((r.end - r.begin) * unit), dm = training ? s1 / count : 0.0;
      double* p = partials + KG_BN_BWD_PARTIALS * blk;
      p[0] = count;
      p[1] = shift + dm;
      p[2] = training ? fmax(s2 - s1 * dm, 0.0) : 0.0;
      p[3] = sdy;
      p[4] = sdyx - dm * sdy;
    }
  }
}

template <class T>
__device__ __forceinline__ void kg_batch_norm2d_backward_coefs(const T* __restrict__ w, const T* __restrict__ rvar,
                                                               T* __restrict__ dw, T* __restrict__ db,
                                                               T* __restrict__ coef,
                                                               const double* __restrict__ partials, kg_index c,
                                                               kg_index chunks, double eps, int training) {
  for (kg_index ch = kg_thread_index(); ch < c; ch += kg_grid_stride()) {
    const double* p0 = partials + KG_BN_BWD_PARTIALS * ch * chunks;
    KgBnMoments acc = kg_bn_moments(p0);
    for (kg_index k = 1; k < chunks; ++k) acc = kg_bn_merge(acc, kg_bn_moments(p0 + KG_BN_BWD_PARTIALS * k));
    const double mean = acc.mean, m = acc.count;
    double sdy = 0, sdyx = 0;  // Σ dy, Σ dy (x - mean)
    for (kg_index k = 0; k < chunks; ++k) {
      const double* p = p0 + KG_BN_BWD_PARTIALS * k;
      sdy += p[3];
      sdyx += p[4] + (p[1] - mean) * p[3];
    }
    const double rstd = 1.0 / sqrt((training ? acc.m2 / m : (double)rvar[ch]) + eps);
    sdyx *= rstd;  // Σ dy x̂
    if (db) db[ch] = (T)sdy;
    if (dw) dw[ch] = (T)sdyx;
    const double a = (double)w[ch] * rstd;
    coef[KG_BN_COEFS * ch] = (T)a;
    coef[KG_BN_COEFS * ch + 1] = training ? (T)(-a * rstd * sdyx / m) : T(0);
    coef[KG_BN_COEFS * ch + 2] = (T)mean;
    coef[KG_BN_COEFS * ch + 3] = training ? (T)(-a * sdy / m) : T(0);
  }
}

template <class T, bool Small>
__device__ __forceinline__ void kg_batch_norm2d_backward_dx(const T* __restrict__ x, const T* __restrict__ dy,
                                                            T* __restrict__ dx, const T* __restrict__ coef,
                                                            kg_index total, kg_index c,
                                                            const KgDivider& hw_div, const KgDivider& c_div) {
  constexpr int W = KG_PACK_BYTES / sizeof(T);
  if (Small && hw_div.d % W == 0 && kg_aligned16(x) && kg_aligned16(dy) && kg_aligned16(dx)) {
    // 16-byte packs, each within one plane: one channel and one set of coefficients per pack.
    struct Packs {
      KgPack<T> x, dy;
    };
    const KgPack<T>* xp = reinterpret_cast<const KgPack<T>*>(x);
    const KgPack<T>* gp = reinterpret_cast<const KgPack<T>*>(dy);
    KgPack<T>* dp = reinterpret_cast<KgPack<T>*>(dx);
    kg_for_each_unrolled<Packs>(
        total / W, [&](kg_index j) { return Packs{xp[j], gp[j]}; },
        [&](kg_index j, const Packs& v) {
          const kg_index plane = kg_div<true>(hw_div, j * W);
          const kg_index ch = plane - kg_div<true>(c_div, plane) * c;
          const T* k = coef + KG_BN_COEFS * ch;
          const T a = k[0], b = k[1], mean = k[2], cc = k[3];
          KgPack<T> out;
#pragma unroll
          for (int e = 0; e < W; ++e) out.v[e] = a * v.dy.v[e] + b * (v.x.v[e] - mean) + cc;
          dp[j] = out;
        });
    return;
  }
  // The loads of a round only read x and dy; the channel and its coefficients come in the store.
  struct Pair {
    T x, dy;
  };
  kg_for_each_unrolled<Pair, Small ? KG_UNROLL : 1>(
      total, [&](kg_index i) { return Pair{x[i], dy[i]}; },
      [&](kg_index i, const Pair& v) {
        const kg_index plane = kg_div<Small>(hw_div, i);
        const kg_index ch = plane - kg_div<Small>(c_div, plane) * c;
        const T* k = coef + KG_BN_COEFS * ch;
        dx[i] = k[0] * v.dy + k[1] * (v.x - k[2]) + k[3];
      });
}

template <class T>
__device__ __forceinline__ void kg_batch_norm2d_backward(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ rmean, const T* __restrict__ rvar,
    const T* __restrict__ dy, T* __restrict__ dx, T* __restrict__ dw, T* __restrict__ db, T* coef,
    double* partials, long long n, long long c, long long chunks, double eps, int training, int phase,
    KgDivider hw_div, KgDivider c_div) {
  const kg_index total = n * c * hw_div.d;
  const bool small = total < (1LL << 31);
  if (phase == 0) {
    if (small)
      kg_batch_norm2d_backward_partials<T, true>(x, rmean, dy, partials, n, c, chunks, hw_div, training);
    else
      kg_batch_norm2d_backward_partials<T, false>(x, rmean, dy, partials, n, c, chunks, hw_div, training);
    return;
  }
  if (phase == 1) {
    kg_batch_norm2d_backward_coefs<T>(w, rvar, dw, db, coef, partials, c, chunks, eps, training);
    return;
  }
  if (!dx) return;
  if (small)
    kg_batch_norm2d_backward_dx<T, true>(x, dy, dx, coef, total, c, hw_div, c_div);
  else
    kg_batch_norm2d_backward_dx<T, false>(x, dy, dx, coef, total, c, hw_div, c_div);
}

extern "C" __global__ void __launch_bounds__(KG_NORM_THREADS)
    kg_batch_norm2d_backward_f32(const float* __restrict__ x, const float* __restrict__ w,
                                 const float* __restrict__ running_mean,
                                 const float* __restrict__ running_var, const float* __restrict__ dy,
                                 float* __restrict__ dx, float* __restrict__ dw, float* __restrict__ db,
                                 float* coef, double* partials, long long n, long long c, long long chunks,
                                 double eps, int training, int phase, KgDivider hw_div, KgDivider c_div) {
  kg_batch_norm2d_backward<float>(x, w, running_mean, running_var, dy, dx, dw, db, coef, partials, n, c, chunks,
                                  eps, training, phase, hw_div, c_div);
}

extern "C" __global__ void __launch_bounds__(KG_NORM_THREADS)
    kg_batch_norm2d_backward_f64(const double* __restrict__ x, const double* __restrict__ w,
                                 const double* __restrict__ running_mean,
                                 const double* __restrict__ running_var, const double* __restrict__ dy,
                                 double* __restrict__ dx, double* __restrict__ dw, double* __restrict__ db,
                                 double* coef, double* partials, long long n, long long c, long long chunks,
                                 double eps, int training, int phase, KgDivider hw_div, KgDivider c_div) {
  kg_batch_norm2d_backward<double>(x, w, running_mean, running_var, dy, dx, dw, db, coef, partials, n, c,
                                   chunks, eps, training, phase, hw_div, c_div);
}

// ---- nn.layer_norm ----
// Rows of `inner` elements; mean, r = 1 / sqrt(biased var + eps), x̂ = (x - mean) r, g = dy w
// (dy without affine):
//   dx = r (g - mean(g) - x̂ mean(g x̂)),  dw = Σ_rows dy x̂,  db = Σ_rows dy.
// Launch 0 takes rows as the forward does (a warp per row up to KG_LN_WARP_MAX elements, else a
// block) and writes dx and each row's (mean, r) to `stats` (when not null). Launch 1 (affine
// only) sums dw and db per column: blocks of 32 adjacent columns whose 8 groups of threads split
// the rows, their partial sums meeting in shared memory.

// One row: the sums (mean, var) and (Σ g, Σ g x̂) over lanes j0, j0 + step, ...; `sum` reduces
// over those lanes (a warp or the block).
template <class T, class Sum>
__device__ __forceinline__ void kg_layer_norm_backward_row(const T* __restrict__ x, const T* __restrict__ w,
                                                           const T* __restrict__ dy, T* __restrict__ dx,
                                                           T* __restrict__ stats, kg_index r, kg_index inner,
                                                           double eps, kg_index j0, kg_index step,
                                                           const Sum& sum) {
  const T* xr = x + r * inner;
  const T* dyr = dy + r * inner;
  const T n = (T)inner;
  T s = T(0);
  for (kg_index j = j0; j < inner; j += step) s += xr[j];
  const T mean = sum(s) / n;
  T v = T(0);
  for (kg_index j = j0; j < inner; j += step) {
    const T d = xr[j] - mean;
    v += d * d;
  }
  const T rstd = T(1) / kg_sqrt(sum(v) / n + (T)eps);
  if (stats && j0 == 0) {
    stats[KG_LN_STATS * r] = mean;
    stats[KG_LN_STATS * r + 1] = rstd;
  }
  if (!dx) return;
  T sg = T(0), sgx = T(0);
  for (kg_index j = j0; j < inner; j += step) {
    const T g = w ? dyr[j] * w[j] : dyr[j];
    sg += g;
    sgx += g * ((xr[j] - mean) * rstd);
  }
  const T mg = sum(sg) / n, mgx = sum(sgx) / n;
  T* dxr = dx + r * inner;
  for (kg_index j = j0; j < inner; j += step) {
    const T g = w ? dyr[j] * w[j] : dyr[j];
    dxr[j] = rstd * (g - mg - ((xr[j] - mean) * rstd) * mgx);
  }
}

template <class T>
struct KgWarpSum {
  __device__ __forceinline__ T operator()(T v) const { return kg_warp_sum(v); }
};

template <class T>
struct KgBlockSum {
  T* smem;
  __device__ __forceinline__ T operator()(T v) const { return kg_block_sum(v, smem); }
};

template <class T>
__device__ __forceinline__ void kg_layer_norm_backward(const T* __restrict__ x, const T* __restrict__ w,
                                                       const T* __restrict__ dy, T* __restrict__ dx,
                                                       T* __restrict__ stats, long long rows, long long inner,
                                                       double eps) {
  if (inner <= KG_LN_WARP_MAX) {
    const int lane = threadIdx.x & 31;
    const kg_index warps = (kg_index)gridDim.x * (KG_NORM_THREADS / 32);
    for (kg_index r = (kg_index)blockIdx.x * (KG_NORM_THREADS / 32) + (threadIdx.x >> 5); r < rows;
         r += warps)
      kg_layer_norm_backward_row<T>(x, w, dy, dx, stats, r, inner, eps, lane, 32, KgWarpSum<T>{});
    return;
  }
  __shared__ T smem[32];
  for (kg_index r = blockIdx.x; r < rows; r += gridDim.x)
    kg_layer_norm_backward_row<T>(x, w, dy, dx, stats, r, inner, eps, threadIdx.x, KG_NORM_THREADS,
                                  KgBlockSum<T>{smem});
}

template <class T>
__device__ __forceinline__ void kg_layer_norm_param_backward(const T* __restrict__ x,
                                                             const T* __restrict__ dy,
                                                             const T* __restrict__ stats, T* __restrict__ dw,
                                                             T* __restrict__ db, long long rows,
                                                             long long inner) {
  __shared__ T part_w[KG_NORM_THREADS];
  __shared__ T part_b[KG_NORM_THREADS];
  const int groups = KG_NORM_THREADS / KG_LN_COLS;
  const int lane = threadIdx.x % KG_LN_COLS, group = threadIdx.x / KG_LN_COLS;
  const kg_index tiles = (inner + KG_LN_COLS - 1) / KG_LN_COLS;
  for (kg_index t = blockIdx.x; t < tiles; t += gridDim.x) {
    const kg_index j = t * KG_LN_COLS + lane;
    T sw = T(0), sb = T(0);
    if (j < inner)
      for (kg_index r = group; r < rows; r += groups) {
        const T g = dy[r * inner + j];
        sb += g;
        sw += g * ((x[r * inner + j] - stats[KG_LN_STATS * r]) * stats[KG_LN_STATS * r + 1]);
      }
    part_w[threadIdx.x] = sw;
    part_b[threadIdx.x] = sb;
    __syncthreads();
    for (int s = KG_NORM_THREADS / 2; s >= KG_LN_COLS; s >>= 1) {
      if ((int)threadIdx.x < s) {
        part_w[threadIdx.x] += part_w[threadIdx.x + s];
        part_b[threadIdx.x] += part_b[threadIdx.x + s];
      }
      __syncthreads();
    }
    if (group == 0 && j < inner) {
      if (dw) dw[j] = part_w[lane];
      if (db) db[j] = part_b[lane];
    }
    __syncthreads();
  }
}

extern "C" __global__ void __launch_bounds__(KG_NORM_THREADS)
    kg_layer_norm_backward_f32(const float* __restrict__ x, const float* __restrict__ w,
                               const float* __restrict__ dy, float* __restrict__ dx,
                               float* __restrict__ stats, long long rows, long long inner, double eps) {
  kg_layer_norm_backward<float>(x, w, dy, dx, stats, rows, inner, eps);
}

extern "C" __global__ void __launch_bounds__(KG_NORM_THREADS)
    kg_layer_norm_backward_f64(const double* __restrict__ x, const double* __restrict__ w,
                               const double* __restrict__ dy, double* __restrict__ dx,
                               double* __restrict__ stats, long long rows, long long inner, double eps) {
  kg_layer_norm_backward<double>(x, w, dy, dx, stats, rows, inner, eps);
}

extern "C" __global__ void __launch_bounds__(KG_NORM_THREADS)
    kg_layer_norm_param_backward_f32(const float* __restrict__ x, const float* __restrict__ dy,
                                     const float* __restrict__ stats, float* __restrict__ dw,
                                     float* __restrict__ db, long long rows, long long inner) {
  kg_layer_norm_param_backward<float>(x, dy, stats, dw, db, rows, inner);
}

extern "C" __global__ void __launch_bounds__(KG_NORM_THREADS)
    kg_layer_norm_param_backward_f64(const double* __restrict__ x, const double* __restrict__ dy,
                                     const double* __restrict__ stats, double* __restrict__ dw,
                                     double* __restrict__ db, long long rows, long long inner) {
  kg_layer_norm_param_backward<double>(x, dy, stats, dw, db, rows, inner);
}
