// Device code of the elementwise op family (elementwise.cu, elementwise_backward.cu): the
// formulas of ops/elementwise.hpp with CUDA's accurate expf, erfcf and tanhf (no fast-math
// intrinsics), contiguous and broadcasting maps, and the entry bodies the entries call, forward
// and backward. It declares no entry itself.
//
// All kernels are grid-stride loops over the output (kg_for_each_unrolled: KG_UNROLL loads in
// flight per thread). Where every operand is read contiguously, 16-byte aligned pointers
// (checked in the kernel, as the entry is fixed before addresses are known) take 16-byte loads
// and stores, with a scalar loop for the remainder. The host sizes the grid for one thread per
// KG_UNROLL 16-byte packs of output; any grid is correct.
//
// Backward: derivatives of the activations and scalar forms are maps over (saved tensor, dy);
// dropout's mask is drawn again from the forward's seed; tensor ⊙ tensor has one launch per
// operand that sums the output's contributions over that operand's broadcast dims with block
// reductions in a fixed order (no atomics: deterministic).
#pragma once

#include "elementwise_shared.cuh"
#include "index.cuh"

// ---- scalar formulas ----

enum KgUnaryFn { KG_RELU, KG_LEAKY_RELU, KG_SILU, KG_GELU_ERF, KG_GELU_TANH, KG_SIGMOID, KG_TANH };
enum KgBinaryFn { KG_ADD, KG_SUB, KG_MUL, KG_DIV };

__device__ __forceinline__ float kg_ew_exp(float v) { return expf(v); }
__device__ __forceinline__ double kg_ew_exp(double v) { return exp(v); }
__device__ __forceinline__ float kg_ew_erfc(float v) { return erfcf(v); }
__device__ __forceinline__ double kg_ew_erfc(double v) { return erfc(v); }
__device__ __forceinline__ float kg_ew_tanh(float v) { return tanhf(v); }
__device__ __forceinline__ double kg_ew_tanh(double v) { return tanh(v); }

// y = f(x); `param` is LeakyRelu's negative slope. NaN propagates (no fmax).
template <int F, class T>
__device__ __forceinline__ T kg_unary_fn(T x, T param) {
  if constexpr (F == KG_RELU) {
    return x < T(0) ? T(0) : x;
  } else if constexpr (F == KG_LEAKY_RELU) {
    return x < T(0) ? x * param : x;
  } else if constexpr (F == KG_SILU) {
    return x / (T(1) + kg_ew_exp(-x));
  } else if constexpr (F == KG_GELU_ERF) {
    // 0.5 x (1 + erf(x/√2)) as 0.5 x erfc(-x/√2): no cancellation for negative x.
    const T inv_sqrt2 = T(0.70710678118654752440084436210484903928);
    return T(0.5) * x * kg_ew_erfc(-x * inv_sqrt2);
  } else if constexpr (F == KG_GELU_TANH) {
    // 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), u = √(2/π) (x + 0.044715 x³).
    const T two_sqrt_2_over_pi = T(1.5957691216057307117597842397375274738);
    const T k = T(0.044715);
    return x / (T(1) + kg_ew_exp(-two_sqrt_2_over_pi * (x + k * x * x * x)));
  } else if constexpr (F == KG_SIGMOID) {
    return T(1) / (T(1) + kg_ew_exp(-x));
  } else {
    return kg_ew_tanh(x);
  }
}

template <int F, class T>
__device__ __forceinline__ T kg_binary_fn(T a, T b) {
  if constexpr (F == KG_ADD)
    return a + b;
  else if constexpr (F == KG_SUB)
    return a - b;
  else if constexpr (F == KG_MUL)
    return a * b;
  else
    return a / b;
}

// dx = dy * f'(.), PyTorch's formulas (ops/elementwise.hpp unary_grad): `s` is the output for
// relu, sigmoid and tanh, the input for the others.
template <int F, class T>
__device__ __forceinline__ T kg_unary_grad(T s, T dy, T param) {
  if constexpr (F == KG_RELU) {
    return s <= T(0) ? T(0) : dy;
  } else if constexpr (F == KG_LEAKY_RELU) {
    return s > T(0) ? dy : dy * param;
  } else if constexpr (F == KG_SILU) {
    const T sig = T(1) / (T(1) + kg_ew_exp(-s));
    return dy * (sig * (T(1) + s * (T(1) - sig)));
  } else if constexpr (F == KG_GELU_ERF) {
    const T inv_sqrt2 = T(0.70710678118654752440084436210484903928);
    const T inv_sqrt_2pi = T(0.39894228040143267793994605993438186848);
    const T cdf = T(0.5) * kg_ew_erfc(-s * inv_sqrt2);
    const T pdf = inv_sqrt_2pi * kg_ew_exp(T(-0.5) * s * s);
    return dy * (cdf + s * pdf);
  } else if constexpr (F == KG_GELU_TANH) {
    const T beta = T(0.79788456080286535587989211986876373695);  // sqrt(2/pi)
    const T kappa = T(0.044715);
    const T x2 = s * s;
    const T t = kg_ew_tanh(beta * (s + kappa * x2 * s));
    const T left = T(0.5) * s, right = T(1) + t;
    return dy * (T(0.5) * right + left * (T(1) - t * t) * (beta * (T(1) + T(3) * kappa * x2)));
  } else if constexpr (F == KG_SIGMOID) {
    return dy * ((T(1) - s) * s);
  } else {
    return dy * (T(1) - s * s);
  }
}

// d(x ⊙ s)/dx * dy, or d(s ⊙ x)/dx * dy when Reversed; only rdiv reads x.
template <int F, bool Reversed, class T>
__device__ __forceinline__ T kg_scalar_grad(T x, T dy, T s) {
  if constexpr (F == KG_ADD)
    return dy;
  else if constexpr (F == KG_SUB)
    return Reversed ? -dy : dy;
  else if constexpr (F == KG_MUL)
    return dy * s;
  else if constexpr (Reversed)
    return -(dy * ((s / x) / x));
  else
    return dy / s;
}

// ---- contiguous maps with 16-byte accesses ----

// y[i] = f(x[i]) for i < n.
template <class T, class Fn>
__device__ __forceinline__ void kg_map1(const T* __restrict__ x, T* __restrict__ y, kg_index n, const Fn& f) {
  constexpr int W = KG_EW_PACK_BYTES / sizeof(T);
  kg_index done = 0;
  if (kg_aligned16(x) && kg_aligned16(y)) {
    const KgPack<T>* xp = reinterpret_cast<const KgPack<T>*>(x);
    KgPack<T>* yp = reinterpret_cast<KgPack<T>*>(y);
    kg_for_each_unrolled<KgPack<T>>(
        n / W,
        [&](kg_index i) {
          KgPack<T> p = xp[i];
#pragma unroll
          for (int k = 0; k < W; ++k) p.v[k] = f(p.v[k]);
          return p;
        },
        [&](kg_index i, const KgPack<T>& p) { yp[i] = p; });
    done = n / W * W;
  }
  kg_for_each_unrolled<T>(
      n - done, [&](kg_index i) { return f(x[done + i]); }, [&](kg_index i, T v) { y[done + i] = v; });
}

// y[i] = f(a[i], b[i]) for i < n (a and b may be the same buffer).
template <class T, class Fn>
__device__ __forceinline__ void kg_map2(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ y,
                                        kg_index n, const Fn& f) {
  constexpr int W = KG_EW_PACK_BYTES / sizeof(T);
  kg_index done = 0;
  if (kg_aligned16(a) && kg_aligned16(b) && kg_aligned16(y)) {
    const KgPack<T>* ap = reinterpret_cast<const KgPack<T>*>(a);
    const KgPack<T>* bp = reinterpret_cast<const KgPack<T>*>(b);
    KgPack<T>* yp = reinterpret_cast<KgPack<T>*>(y);
    kg_for_each_unrolled<KgPack<T>>(
        n / W,
        [&](kg_index i) {
          KgPack<T> p = ap[i];
          const KgPack<T> q = bp[i];
#pragma unroll
          for (int k = 0; k < W; ++k) p.v[k] = f(p.v[k], q.v[k]);
          return p;
        },
        [&](kg_index i, const KgPack<T>& p) { yp[i] = p; });
    done = n / W * W;
  }
  kg_for_each_unrolled<T>(
      n - done, [&](kg_index i) { return f(a[done + i], b[done + i]); },
      [&](kg_index i, T v) { y[done + i] = v; });
}

// ---- functors ----

template <int F, class T>
struct KgUnary {
  T param;
  __device__ __forceinline__ T operator()(T x) const { return kg_unary_fn<F>(x, param); }
};

template <class T>
struct KgCopy {
  __device__ __forceinline__ T operator()(T x) const { return x; }
};

template <int F, class T>
struct KgBinary {
  __device__ __forceinline__ T operator()(T a, T b) const { return kg_binary_fn<F>(a, b); }
};

template <int F, class T>
struct KgUnaryGrad {
  T param;
  __device__ __forceinline__ T operator()(T s, T dy) const { return kg_unary_grad<F>(s, dy, param); }
};

template <int F, bool Reversed, class T>
struct KgScalarGrad {
  T s;
  __device__ __forceinline__ T operator()(T x, T dy) const { return kg_scalar_grad<F, Reversed>(x, dy, s); }
  __device__ __forceinline__ T operator()(T dy) const { return kg_scalar_grad<F, Reversed>(T(0), dy, s); }
};

// x ⊙ s, or s ⊙ x when Reversed.
template <int F, bool Reversed, class T>
struct KgWithScalar {
  T s;
  __device__ __forceinline__ T operator()(T x) const {
    if constexpr (Reversed)
      return kg_binary_fn<F>(s, x);
    else
      return kg_binary_fn<F>(x, s);
  }
};

// ---- broadcasting ----
// KgBroadcast (elementwise_shared.cuh) says how the output's index space maps to the operands;
// the host (ops/elementwise.cpp) merges the dims first, so that the plain cases are recognised.

// y[i] = a[...] ⊙ b[i] (or mirrored) where the broadcast operand is indexed by channel.
template <int F, bool Small, bool ChannelA, class T>
__device__ __forceinline__ void kg_broadcast_channel(const T* __restrict__ a, const T* __restrict__ b,
                                                     T* __restrict__ y, kg_index n, const KgBroadcast& bc) {
  const kg_index c = bc.size[1].d;
  kg_for_each_unrolled<T, Small ? KG_UNROLL : 1>(
      n,
      [&](kg_index i) {
        const kg_index q = kg_div<Small>(bc.size[0], i);
        const kg_index ch = q - kg_div<Small>(bc.size[1], q) * c;
        return ChannelA ? kg_binary_fn<F>(a[ch], b[i]) : kg_binary_fn<F>(a[i], b[ch]);
      },
      [&](kg_index i, T v) { y[i] = v; });
}

template <int F, bool Small, class T>
__device__ __forceinline__ void kg_broadcast_general(const T* __restrict__ a, const T* __restrict__ b,
                                                     T* __restrict__ y, kg_index n, const KgBroadcast& bc) {
  kg_for_each_unrolled<T, Small ? KG_UNROLL : 1>(
      n,
      [&](kg_index i) {
        kg_index r = i, ia = 0, ib = 0;
#pragma unroll
        for (int d = 0; d < KG_EW_MAX_DIMS; ++d) {
          if (d < bc.rank) {
            const kg_index q = kg_div<Small>(bc.size[d], r);
            const kg_index k = r - q * bc.size[d].d;
            ia += k * bc.stride_a[d];
            ib += k * bc.stride_b[d];
            r = q;
          }
        }
        return kg_binary_fn<F>(a[ia], b[ib]);
      },
      [&](kg_index i, T v) { y[i] = v; });
}

template <int F, bool Small, class T>
__device__ __forceinline__ void kg_broadcast_strided(const T* __restrict__ a, const T* __restrict__ b,
                                                     T* __restrict__ y, kg_index n, const KgBroadcast& bc) {
  if (bc.mode == KG_BCAST_CHANNEL_B)
    kg_broadcast_channel<F, Small, false>(a, b, y, n, bc);
  else if (bc.mode == KG_BCAST_CHANNEL_A)
    kg_broadcast_channel<F, Small, true>(a, b, y, n, bc);
  else
    kg_broadcast_general<F, Small>(a, b, y, n, bc);
}

template <int F, class T>
__device__ __forceinline__ void kg_binary(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ y,
                                          kg_index n, const KgBroadcast& bc) {
  switch (bc.mode) {
    case KG_BCAST_SAME:
      kg_map2(a, b, y, n, KgBinary<F, T>{});
      return;
    case KG_BCAST_SCALAR_B:
      kg_map1(a, y, n, KgWithScalar<F, false, T>{b[0]});
      return;
    case KG_BCAST_SCALAR_A:
      kg_map1(b, y, n, KgWithScalar<F, true, T>{a[0]});
      return;
    default:
      break;
  }
  // Every dividend and divisor is at most n.
  if (n < (1LL << 31))
    kg_broadcast_strided<F, true>(a, b, y, n, bc);
  else
    kg_broadcast_strided<F, false>(a, b, y, n, bc);
}

// ---- dropout's mask ----
// Element i of a run is kept when the top 32 bits of splitmix64(seed, i) are >= threshold =
// p * 2^32: the stream ops/elementwise.cpp draws on the CPU (mix, dropout_range), so that both
// backends and both passes agree on every element.

__device__ __forceinline__ unsigned long long kg_dropout_bits(unsigned long long seed, unsigned long long i) {
  unsigned long long z = seed + (i + 1ULL) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// dst[i] = src[i] * (kept ? scale : 0): train-mode dropout of x, and equally its backward on dy.
template <class T>
__device__ __forceinline__ void kg_dropout_mask(const T* __restrict__ src, T* __restrict__ dst, kg_index n,
                                                unsigned long long seed, unsigned long long threshold,
                                                T scale) {
  kg_for_each_unrolled<T>(
      n,
      [&](kg_index i) {
        const bool keep = (kg_dropout_bits(seed, (unsigned long long)i) >> 32) >= threshold;
        return src[i] * (keep ? scale : T(0));
      },
      [&](kg_index i, T v) { dst[i] = v; });
}

// ---- gradients of a broadcast operand ----
// The gradient of operand X of y = a ⊙ b is, for each element t of X, the sum over the output
// elements that read it (X's broadcast dims) of the contribution dy ∂y/∂X. The host merges the
// output's dims into kept ones (they index X; innermost first, X's elements in order) and
// reduced ones, with element strides into the output, a and b. A block takes `width` adjacent
// elements of X; its KG_EW_THREADS / width groups of threads split each element's reduction,
// and the groups' partial sums meet in shared memory in a fixed order: the result does not
// depend on the schedule. width = KG_EW_THREADS (one thread per element) when nothing is reduced.
// When X has too few elements to occupy the GPU (a bias's gradient), each reduction is also
// split into `splits` chunks of `chunk` output elements taken by different blocks: phase 0 writes
// their sums to partial[split * m + t], phase 1 adds them up per element in split order. The
// plan is a KgReduce (elementwise_shared.cuh).

// dy ∂(a ⊙ b)/∂a (Which = 0) or ∂/∂b (Which = 1), as PyTorch writes them.
template <int F, int Which, class T>
__device__ __forceinline__ T kg_binary_contribution(T dy, const T* __restrict__ a, const T* __restrict__ b,
                                                    kg_index ia, kg_index ib) {
  if constexpr (F == KG_ADD) {
    return dy;
  } else if constexpr (F == KG_SUB) {
    return Which == 0 ? dy : -dy;
  } else if constexpr (F == KG_MUL) {
    if constexpr (Which == 0)
      return dy * b[ib];
    else
      return dy * a[ia];
  } else {
    if constexpr (Which == 0)
      return dy / b[ib];
    else {
      const T bv = b[ib];
      return -(((dy * a[ia]) / bv) / bv);
    }
  }
}

// Offsets of index `i` unravelled over `rank` dims (innermost first).
template <bool Small>
__device__ __forceinline__ void kg_reduce_offsets(kg_index i, int rank, const KgDivider* size,
                                                  const long long* so, const long long* sa,
                                                  const long long* sb, kg_index& o, kg_index& oa,
                                                  kg_index& ob) {
  o = 0, oa = 0, ob = 0;
#pragma unroll
  for (int d = 0; d < KG_EW_MAX_DIMS; ++d) {
    if (d < rank) {
      const kg_index q = kg_div<Small>(size[d], i), k = i - q * size[d].d;
      o += k * so[d];
      oa += k * sa[d];
      ob += k * sb[d];
      i = q;
    }
  }
}

template <int F, int Which, bool Small, class T>
__device__ __forceinline__ void kg_binary_grad(const T* __restrict__ dy, const T* __restrict__ a,
                                               const T* __restrict__ b, T* __restrict__ g,
                                               T* __restrict__ partial, const KgReduce& p) {
  __shared__ T part[KG_EW_THREADS];
  const int width = p.width, groups = KG_EW_THREADS / width;
  const int lane = threadIdx.x % width, group = threadIdx.x / width;
  const kg_index tiles = (p.m + width - 1) / width;
  for (kg_index item = blockIdx.x; item < tiles * p.splits; item += gridDim.x) {
    const kg_index split = item / tiles, tile = item - split * tiles;
    const kg_index t = tile * width + lane;
    const kg_index r0 = split * p.chunk, r1 = r0 + p.chunk < p.r ? r0 + p.chunk : p.r;
    T acc = T(0);
    if (t < p.m) {
      kg_index o0, a0, b0;
      kg_reduce_offsets<Small>(t, p.kept_rank, p.kept_size, p.kept_so, p.kept_sa, p.kept_sb, o0, a0, b0);
      for (kg_index r = r0 + group; r < r1; r += groups) {
        kg_index o, oa, ob;
        kg_reduce_offsets<Small>(r, p.red_rank, p.red_size, p.red_so, p.red_sa, p.red_sb, o, oa, ob);
        acc += kg_binary_contribution<F, Which>(dy[o0 + o], a, b, a0 + oa, b0 + ob);
      }
    }
    if (groups > 1) {
      part[threadIdx.x] = acc;
      __syncthreads();
      for (int s = KG_EW_THREADS / 2; s >= width; s >>= 1) {
        if ((int)threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
      }
      acc = part[threadIdx.x % width];
      __syncthreads();
    }
    if (t < p.m && group == 0) {
      if (p.splits == 1)
        g[t] = acc;
      else
        partial[split * p.m + t] = acc;
    }
  }
}

// Phase 1 of a split reduction: g[t] = the sum of the splits' partial sums, in split order.
template <class T>
__device__ __forceinline__ void kg_binary_grad_splits(const T* __restrict__ partial, T* __restrict__ g,
                                                      const KgReduce& p) {
  for (kg_index t = kg_thread_index(); t < p.m; t += kg_grid_stride()) {
    T acc = T(0);
    for (int s = 0; s < p.splits; ++s) acc += partial[s * p.m + t];
    g[t] = acc;
  }
}

// ---- entry bodies ----
// The entries ops/elementwise.cpp appends, e.g.
//   extern "C" __global__ void __launch_bounds__(KG_EW_THREADS)
//       kg_relu_f32(const float* __restrict__ x, float* __restrict__ y, long long n, double param) {
//     kg_unary_entry<KG_RELU>(x, y, n, param);
//   }

// Activations: param is LeakyRelu's negative slope, ignored by the others.
template <int F, class T>
__device__ __forceinline__ void kg_unary_entry(const T* __restrict__ x, T* __restrict__ y, long long n,
                                               double param) {
  kg_map1(x, y, n, KgUnary<F, T>{(T)param});
}

// Dropout, one entry for both modes: in training (`training` nonzero) the mask drawn from the
// run's seed, kept elements scaled by 1 / (1 - p) (threshold = p * 2^32, scale = 1 / (1 - p));
// in inference the identity.
template <class T>
__device__ __forceinline__ void kg_dropout_entry(const T* __restrict__ x, T* __restrict__ y, long long n,
                                                 long long seed, long long threshold, double scale,
                                                 int training) {
  if (training)
    kg_dropout_mask(x, y, n, (unsigned long long)seed, (unsigned long long)threshold, (T)scale);
  else
    kg_map1(x, y, n, KgCopy<T>{});
}

// x ⊙ s, or s ⊙ x when Reversed (rsub, rdiv). The scalar is rounded to T first, as on the CPU.
template <int F, bool Reversed, class T>
__device__ __forceinline__ void kg_scalar_entry(const T* __restrict__ x, T* __restrict__ y, long long n,
                                                double s) {
  kg_map1(x, y, n, KgWithScalar<F, Reversed, T>{(T)s});
}

// a ⊙ b broadcast as bc says.
template <int F, class T>
__device__ __forceinline__ void kg_binary_entry(const T* __restrict__ a, const T* __restrict__ b,
                                                T* __restrict__ y, long long n, const KgBroadcast& bc) {
  kg_binary<F>(a, b, y, n, bc);
}

// Dropout in training only (kg_dropout_entry with training set).
template <class T>
__device__ __forceinline__ void kg_dropout_train_entry(const T* __restrict__ x, T* __restrict__ y,
                                                       long long n, long long seed, long long threshold,
                                                       double scale) {
  kg_dropout_mask(x, y, n, (unsigned long long)seed, (unsigned long long)threshold, (T)scale);
}

// ---- backward entry bodies ----
// Each returns at once when its gradient is not wanted (a null dx or g).

// dx = dy f'(s): s is the output for relu, sigmoid and tanh, the input for the others.
template <int F, class T>
__device__ __forceinline__ void kg_unary_backward_entry(const T* __restrict__ s, const T* __restrict__ dy,
                                                        T* __restrict__ dx, long long n, double param) {
  if (!dx) return;
  kg_map2(s, dy, dx, n, KgUnaryGrad<F, T>{(T)param});
}

// dx of x ⊙ s (or s ⊙ x): x is read by rdiv only (null for the others).
template <int F, bool Reversed, class T>
__device__ __forceinline__ void kg_scalar_backward_entry(const T* __restrict__ x, const T* __restrict__ dy,
                                                         T* __restrict__ dx, long long n, double s) {
  if (!dx) return;
  if (F == KG_DIV && Reversed)
    kg_map2(x, dy, dx, n, KgScalarGrad<F, Reversed, T>{(T)s});
  else
    kg_map1(dy, dx, n, KgScalarGrad<F, Reversed, T>{(T)s});
}

// Dropout: in training the forward's mask (same seed, same element indices) times 1 / (1 - p);
// in inference the identity.
template <class T>
__device__ __forceinline__ void kg_dropout_backward_entry(const T* __restrict__ dy, T* __restrict__ dx,
                                                          long long n, long long seed, long long threshold,
                                                          double scale, int training) {
  if (!dx) return;
  if (training)
    kg_dropout_mask(dy, dx, n, (unsigned long long)seed, (unsigned long long)threshold, (T)scale);
  else
    kg_map1(dy, dx, n, KgCopy<T>{});
}

// The gradient of operand `which` (0: a, 1: b) of a ⊙ b, summed over its broadcast dims (phase 0,
// then phase 1 when the reduction is split, `partial` being scratch). a and b are read only where
// the derivative needs them (mul, div); add and sub get null pointers.
template <int F, class T>
__device__ __forceinline__ void kg_binary_backward_entry(const T* __restrict__ dy, const T* __restrict__ a,
                                                         const T* __restrict__ b, T* __restrict__ g,
                                                         T* __restrict__ partial, const KgReduce& p,
                                                         int which, int phase) {
  if (!g) return;
  if (phase == 1) {
    kg_binary_grad_splits(partial, g, p);
    return;
  }
  const bool small = p.m < (1LL << 31) && p.r < (1LL << 31);
  if (which == 0) {
    if (small)
      kg_binary_grad<F, 0, true>(dy, a, b, g, partial, p);
    else
      kg_binary_grad<F, 0, false>(dy, a, b, g, partial, p);
  } else {
    if (small)
      kg_binary_grad<F, 1, true>(dy, a, b, g, partial, p);
    else
      kg_binary_grad<F, 1, false>(dy, a, b, g, partial, p);
  }
}
