// The elementwise op family on the GPU: activations, dropout (inference: a copy), tensor ⊙ tensor
// with numpy broadcasting, and tensor ⊙ scalar. The formulas are those of ops/elementwise.hpp,
// with CUDA's accurate expf, erfcf and tanhf (no fast-math intrinsics).
//
// Each op's kernel source is this file, with KG_EW_ONE_ENTRY defined, followed by its one entry
// (kg_<op>_f32 or kg_<op>_f64) calling one of the entry bodies at the end: ops/elementwise.cpp
// writes it. One entry per module keeps compiles, PTX checks and module loads to what a model
// uses. Compiled alone (kgraph compile --all), the file instantiates every entry.
//
// All kernels are grid-stride loops over the output (kg_for_each_unrolled: KG_UNROLL loads in
// flight per thread). Where every operand is read contiguously, 16-byte aligned pointers
// (checked in the kernel, as the entry is fixed before addresses are known) take 16-byte loads
// and stores, with a scalar loop for the remainder. The host sizes the grid for one thread per
// KG_UNROLL 16-byte packs of output; any grid is correct.
#include "index.cuh"

#define KG_EW_THREADS 256
#define KG_EW_MAX_DIMS 8

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

// ---- contiguous maps with 16-byte accesses ----

template <class T>
struct alignas(16) KgPack {
  T v[16 / sizeof(T)];
};

__device__ __forceinline__ bool kg_aligned16(const void* p) { return ((unsigned long long)p & 15) == 0; }

// y[i] = f(x[i]) for i < n.
template <class T, class Fn>
__device__ __forceinline__ void kg_map1(const T* __restrict__ x, T* __restrict__ y, kg_index n, const Fn& f) {
  constexpr int W = 16 / sizeof(T);
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
  constexpr int W = 16 / sizeof(T);
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

// How the output's index space maps to the operands (host: ops/elementwise.cpp, which merges the
// dims first, so that the plain cases below are recognised). Passed by value; 264 bytes.
enum KgBroadcastMode {
  KG_BCAST_SAME,       // a[i] ⊙ b[i]
  KG_BCAST_SCALAR_B,   // a[i] ⊙ b[0]
  KG_BCAST_SCALAR_A,   // a[0] ⊙ b[i]
  KG_BCAST_CHANNEL_B,  // a[i] ⊙ b[(i / inner) % c]: inner = size[0].d, c = size[1].d
  KG_BCAST_CHANNEL_A,  // a[(i / inner) % c] ⊙ b[i]
  KG_BCAST_GENERAL,    // dims innermost first: size[d], element strides stride_a[d], stride_b[d]
};

struct KgBroadcast {
  KgDivider size[KG_EW_MAX_DIMS];
  long long stride_a[KG_EW_MAX_DIMS];
  long long stride_b[KG_EW_MAX_DIMS];
  int rank;
  int mode;
};

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

// Dropout in inference: the identity.
template <class T>
__device__ __forceinline__ void kg_dropout_entry(const T* __restrict__ x, T* __restrict__ y, long long n) {
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

// ---- every entry, when the file is compiled alone ----
// The same entries ops/elementwise.cpp writes one at a time.
#ifndef KG_EW_ONE_ENTRY

#define KG_EW_ENTRY extern "C" __global__ void __launch_bounds__(KG_EW_THREADS)

#define KG_EW_MAP_ENTRIES(name, body)                                                                  \
  KG_EW_ENTRY name##_f32(const float* __restrict__ x, float* __restrict__ y, long long n, double s) {  \
    body(x, y, n, s);                                                                                  \
  }                                                                                                    \
  KG_EW_ENTRY name##_f64(const double* __restrict__ x, double* __restrict__ y, long long n, double s) { \
    body(x, y, n, s);                                                                                  \
  }

#define KG_EW_BINARY_ENTRIES(name, F)                                                                    \
  KG_EW_ENTRY name##_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ y, \
                         long long n, KgBroadcast bc) {                                                  \
    kg_binary_entry<F>(a, b, y, n, bc);                                                                  \
  }                                                                                                      \
  KG_EW_ENTRY name##_f64(const double* __restrict__ a, const double* __restrict__ b,                     \
                         double* __restrict__ y, long long n, KgBroadcast bc) {                          \
    kg_binary_entry<F>(a, b, y, n, bc);                                                                  \
  }

KG_EW_MAP_ENTRIES(kg_relu, kg_unary_entry<KG_RELU>)
KG_EW_MAP_ENTRIES(kg_leaky_relu, kg_unary_entry<KG_LEAKY_RELU>)
KG_EW_MAP_ENTRIES(kg_silu, kg_unary_entry<KG_SILU>)
KG_EW_MAP_ENTRIES(kg_gelu_erf, kg_unary_entry<KG_GELU_ERF>)
KG_EW_MAP_ENTRIES(kg_gelu_tanh, kg_unary_entry<KG_GELU_TANH>)
KG_EW_MAP_ENTRIES(kg_sigmoid, kg_unary_entry<KG_SIGMOID>)
KG_EW_MAP_ENTRIES(kg_tanh, kg_unary_entry<KG_TANH>)

KG_EW_ENTRY kg_dropout_f32(const float* __restrict__ x, float* __restrict__ y, long long n) {
  kg_dropout_entry(x, y, n);
}
KG_EW_ENTRY kg_dropout_f64(const double* __restrict__ x, double* __restrict__ y, long long n) {
  kg_dropout_entry(x, y, n);
}

#define KG_EW_SCALAR_BODY(F, Reversed) kg_scalar_entry<F, Reversed>
KG_EW_MAP_ENTRIES(kg_add_scalar, KG_EW_SCALAR_BODY(KG_ADD, false))
KG_EW_MAP_ENTRIES(kg_sub_scalar, KG_EW_SCALAR_BODY(KG_SUB, false))
KG_EW_MAP_ENTRIES(kg_rsub_scalar, KG_EW_SCALAR_BODY(KG_SUB, true))
KG_EW_MAP_ENTRIES(kg_mul_scalar, KG_EW_SCALAR_BODY(KG_MUL, false))
KG_EW_MAP_ENTRIES(kg_div_scalar, KG_EW_SCALAR_BODY(KG_DIV, false))
KG_EW_MAP_ENTRIES(kg_rdiv_scalar, KG_EW_SCALAR_BODY(KG_DIV, true))

KG_EW_BINARY_ENTRIES(kg_add, KG_ADD)
KG_EW_BINARY_ENTRIES(kg_sub, KG_SUB)
KG_EW_BINARY_ENTRIES(kg_mul, KG_MUL)
KG_EW_BINARY_ENTRIES(kg_div, KG_DIV)

#endif  // KG_EW_ONE_ENTRY
