// The pointwise op family on the GPU: n-ary elementwise functions with numpy broadcasting over
// every dtype but f16 and bf16, with ONNX's semantics, and Cast between any two dtypes.
//
// Each op's kernel source is this file, with KG_PW_ONE_ENTRY defined, followed by a functor
// KgPwOp and one entry, both written by ops/pointwise.cpp for the op's function and dtypes:
//
//   struct KgPwOp {
//     typedef float T;  // the inputs' element type (x's for Where)
//     typedef float R;  // the output's
//     __device__ __forceinline__ R operator()(T a, T b, const KgPwArgs& p) const {
//       (void)p;
//       return (R)(kg_pw_add(a, b));  // the function's expression over a, b, c, T and p
//     }
//   };
//   extern "C" __global__ void __launch_bounds__(KG_PW_THREADS)
//       kg_pw_add_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ y,
//                     KgPwArgs p) {
//     kg_pw_entry<2, KgPwOp>(a, b, b, y, p);
//   }
//
// The functions the expressions call (kg_pw_add, kg_pw_exp, ...) are pointwise.cuh's. bool is
// unsigned char (kg_bool), 0 or 1; a bool input is read as (v != 0). f16 and bf16 (Cast only) are
// their bits as unsigned short, converted here. Compiled alone (kgraph compile --all), the file
// instantiates one entry of each form (unary, binary, comparison, Where, Cast).
#include "index.cuh"
#include "pointwise.cuh"  // the scalar functions the expressions call
#include "pointwise_shared.cuh"

typedef unsigned char kg_bool;

// ---- Cast ----
// Every source is read as a double (floats, f16, bf16) or a long long (integers, bool), then
// written to the target: to bool x != 0; a double to an integer truncated (NaN 0, saturated at the
// ends of long long, then narrowed by wrapping); to f16 and bf16 rounded to nearest even from the
// double directly (no double rounding through float).

__device__ __forceinline__ float kg_pw_half_to_float(unsigned short h) {
  const unsigned sign = (unsigned)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    const float v = (float)m * 5.9604644775390625e-8f;  // m * 2^-24: zero or subnormal
    return sign ? -v : v;
  }
  if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
  return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}
__device__ __forceinline__ float kg_pw_bf16_to_float(unsigned short b) {
  return __uint_as_float((unsigned)b << 16);
}

// The double rounded to nearest even into a format of `man` mantissa bits and exponent bias
// `bias` whose largest biased exponent `emax` is infinity and NaN (f16: 10, 15, 31; bf16: 7,
// 127, 255).
__device__ __forceinline__ unsigned short kg_pw_double_to_small(double v, int man, int bias, int emax) {
  const unsigned long long x = (unsigned long long)__double_as_longlong(v);
  const unsigned sign = (unsigned)(x >> 63) << 15;
  const int be = (int)((x >> 52) & 0x7ffULL);
  unsigned long long m = x & 0xfffffffffffffULL;
  const unsigned inf = (unsigned)emax << man;
  if (be == 0x7ff) return (unsigned short)(sign | inf | (m ? 1u << (man - 1) : 0u));
  const int e = be - 1023 + bias;
  if (e >= emax) return (unsigned short)(sign | inf);
  int shift = 52 - man;
  unsigned long long h;
  if (e <= 0) {  // subnormal in the small format (or zero)
    if (e < -man) return (unsigned short)sign;
    m |= 1ULL << 52;
    shift += 1 - e;
    h = m >> shift;
  } else {
    h = ((unsigned long long)e << man) | (m >> shift);
  }
  const unsigned long long rem = m & ((1ULL << shift) - 1), mid = 1ULL << (shift - 1);
  if (rem > mid || (rem == mid && (h & 1ULL))) ++h;  // a carry moves into the exponent
  return (unsigned short)(sign | (unsigned)h);
}
__device__ __forceinline__ unsigned short kg_pw_double_to_half(double v) {
  return kg_pw_double_to_small(v, 10, 15, 31);
}
__device__ __forceinline__ unsigned short kg_pw_double_to_bf16(double v) {
  return kg_pw_double_to_small(v, 7, 127, 255);
}
// Truncated toward zero; NaN gives 0, values beyond long long saturate.
__device__ __forceinline__ long long kg_pw_double_to_ll(double v) {
  if (!(v == v)) return 0;
  if (v >= 9223372036854775808.0) return 0x7fffffffffffffffLL;
  if (v < -9223372036854775808.0) return -0x7fffffffffffffffLL - 1;
  return (long long)v;
}

// ---- the broadcasting loops ----
// KgPwArgs (pointwise_shared.cuh) says how the output's index space maps to the inputs. Every
// loop is a grid-stride loop over the output (kg_for_each_unrolled); grids are sized for
// n / KG_UNROLL threads, any grid is correct.

// The function at one output element, input j read at offset o_j.
template <int N, class R, class Op, class A, class B, class C>
__device__ __forceinline__ R kg_pw_apply(const Op& op, const A* __restrict__ a, const B* __restrict__ b,
                                         const C* __restrict__ c, kg_index ia, kg_index ib, kg_index ic,
                                         const KgPwArgs& p) {
  if constexpr (N == 1)
    return op(a[ia], p);
  else if constexpr (N == 2)
    return op(a[ia], b[ib], p);
  else
    return op(a[ia], b[ib], c[ic], p);
}

// Output index i unravelled over the merged dims (innermost first) into each input's offset.
template <int N, bool Small, class Op, class R, class A, class B, class C>
__device__ __forceinline__ void kg_pw_strided(const A* __restrict__ a, const B* __restrict__ b,
                                              const C* __restrict__ c, R* __restrict__ y, const KgPwArgs& p) {
  const Op op{};
  kg_for_each_unrolled<R, Small ? KG_UNROLL : 1>(
      p.n,
      [&](kg_index i) {
        kg_index r = i, ia = 0, ib = 0, ic = 0;
#pragma unroll
        for (int d = 0; d < KG_PW_MAX_DIMS; ++d) {
          if (d < p.rank) {
            const kg_index q = kg_div<Small>(p.size[d], r), k = r - q * p.size[d].d;
            ia += k * p.stride[0][d];
            if (N > 1) ib += k * p.stride[1][d];
            if (N > 2) ic += k * p.stride[2][d];
            r = q;
          }
        }
        return kg_pw_apply<N, R>(op, a, b, c, ia, ib, ic, p);
      },
      [&](kg_index i, R v) { y[i] = v; });
}

// y = Op(a, b, c) over the output: N inputs (the unused pointers repeat `a`), read at the
// output's index when p.same, else through the strides (32-bit index math below 2^31 elements).
template <int N, class Op, class R, class A, class B, class C>
__device__ __forceinline__ void kg_pw_entry(const A* __restrict__ a, const B* __restrict__ b,
                                            const C* __restrict__ c, R* __restrict__ y, const KgPwArgs& p) {
  if (p.same) {
    const Op op{};
    kg_for_each_unrolled<R>(
        p.n, [&](kg_index i) { return kg_pw_apply<N, R>(op, a, b, c, i, i, i, p); },
        [&](kg_index i, R v) { y[i] = v; });
  } else if (p.n < (1LL << 31)) {
    kg_pw_strided<N, true, Op>(a, b, c, y, p);
  } else {
    kg_pw_strided<N, false, Op>(a, b, c, y, p);
  }
}

// ---- one entry of each form, when the file is compiled alone ----
// The functors ops/pointwise.cpp writes, for a few functions.
#ifndef KG_PW_ONE_ENTRY

#define KG_PW_ENTRY extern "C" __global__ void __launch_bounds__(KG_PW_THREADS)

struct KgPwExpF32 {
  __device__ __forceinline__ float operator()(float a, const KgPwArgs&) const { return kg_pw_exp(a); }
};
struct KgPwAddI64 {
  __device__ __forceinline__ long long operator()(long long a, long long b, const KgPwArgs&) const {
    return kg_pw_add(a, b);
  }
};
struct KgPwLessF32 {
  __device__ __forceinline__ kg_bool operator()(float a, float b, const KgPwArgs&) const {
    return (kg_bool)(a < b);
  }
};
struct KgPwWhereF32 {
  __device__ __forceinline__ float operator()(kg_bool a, float b, float c, const KgPwArgs&) const {
    return a ? b : c;
  }
};
struct KgPwCastF32F16 {
  __device__ __forceinline__ unsigned short operator()(float a, const KgPwArgs&) const {
    return kg_pw_double_to_half((double)a);
  }
};

KG_PW_ENTRY kg_pw_exp_f32(const float* __restrict__ a, float* __restrict__ y, KgPwArgs p) {
  kg_pw_entry<1, KgPwExpF32>(a, a, a, y, p);
}
KG_PW_ENTRY kg_pw_add_i64(const long long* __restrict__ a, const long long* __restrict__ b,
                          long long* __restrict__ y, KgPwArgs p) {
  kg_pw_entry<2, KgPwAddI64>(a, b, b, y, p);
}
KG_PW_ENTRY kg_pw_less_f32(const float* __restrict__ a, const float* __restrict__ b, kg_bool* __restrict__ y,
                           KgPwArgs p) {
  kg_pw_entry<2, KgPwLessF32>(a, b, b, y, p);
}
KG_PW_ENTRY kg_pw_where_f32(const kg_bool* __restrict__ a, const float* __restrict__ b,
                            const float* __restrict__ c, float* __restrict__ y, KgPwArgs p) {
  kg_pw_entry<3, KgPwWhereF32>(a, b, c, y, p);
}
KG_PW_ENTRY kg_pw_cast_f32_f16(const float* __restrict__ a, unsigned short* __restrict__ y, KgPwArgs p) {
  kg_pw_entry<1, KgPwCastF32F16>(a, a, a, y, p);
}

#undef KG_PW_ENTRY
#endif  // KG_PW_ONE_ENTRY
