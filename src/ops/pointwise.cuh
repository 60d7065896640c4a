// The pointwise family's scalar functions on the device, for float and double and for the integer
// types, with ONNX's semantics (ops/pointwise.hpp): what the expressions of ops/pointwise.cpp call,
// in the unfused kernels (pointwise.cu) and in the elementwise forms the fusion pass puts into
// generated kernels and convolution epilogues.
//
// A plain header that includes nothing, so that it may also be included inside a namespace (an
// op's elementwise device source is placed in one): it needs only CUDA's math functions. Integer
// arithmetic wraps: it is done in unsigned 64-bit and narrowed.
#pragma once

// ---- element types ----

template <class T>
struct KgPwIsFloat {
  static constexpr bool value = false;
};
template <>
struct KgPwIsFloat<float> {
  static constexpr bool value = true;
};
template <>
struct KgPwIsFloat<double> {
  static constexpr bool value = true;
};
template <class T>
struct KgPwIsSigned {
  static constexpr bool value = (T)(-1) < (T)0;
};

// ---- float math in the input's precision ----

#define KG_PW_MATH(name, f32, f64)                                           \
  __device__ __forceinline__ float kg_pw_##name(float v) { return f32(v); } \
  __device__ __forceinline__ double kg_pw_##name(double v) { return f64(v); }
KG_PW_MATH(exp, expf, exp)
KG_PW_MATH(expm1, expm1f, expm1)
KG_PW_MATH(log, logf, log)
KG_PW_MATH(log1p, log1pf, log1p)
KG_PW_MATH(sqrt, sqrtf, sqrt)
KG_PW_MATH(erf, erff, erf)
KG_PW_MATH(sin, sinf, sin)
KG_PW_MATH(cos, cosf, cos)
KG_PW_MATH(tan, tanf, tan)
KG_PW_MATH(asin, asinf, asin)
KG_PW_MATH(acos, acosf, acos)
KG_PW_MATH(atan, atanf, atan)
KG_PW_MATH(sinh, sinhf, sinh)
KG_PW_MATH(cosh, coshf, cosh)
KG_PW_MATH(tanh, tanhf, tanh)
KG_PW_MATH(asinh, asinhf, asinh)
KG_PW_MATH(acosh, acoshf, acosh)
KG_PW_MATH(atanh, atanhf, atanh)
KG_PW_MATH(floor, floorf, floor)
KG_PW_MATH(ceil, ceilf, ceil)
KG_PW_MATH(rint, rintf, rint)  // round half to even
KG_PW_MATH(fabs, fabsf, fabs)
#undef KG_PW_MATH
__device__ __forceinline__ float kg_pw_math_pow(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double kg_pw_math_pow(double a, double b) { return pow(a, b); }
__device__ __forceinline__ float kg_pw_math_fmod(float a, float b) { return fmodf(a, b); }
__device__ __forceinline__ double kg_pw_math_fmod(double a, double b) { return fmod(a, b); }
// The largest finite value (|x| above it is infinite).
__device__ __forceinline__ float kg_pw_max_finite(float) { return 3.40282346638528859812e+38f; }
__device__ __forceinline__ double kg_pw_max_finite(double) { return 1.79769313486231570815e+308; }

// ---- arithmetic: floats as they are, integers wrapping ----

template <class T>
__device__ __forceinline__ T kg_pw_neg(T a) {
  if constexpr (KgPwIsFloat<T>::value)
    return -a;
  else
    return (T)(0ULL - (unsigned long long)a);
}
template <class T>
__device__ __forceinline__ T kg_pw_add(T a, T b) {
  if constexpr (KgPwIsFloat<T>::value)
    return a + b;
  else
    return (T)((unsigned long long)a + (unsigned long long)b);
}
template <class T>
__device__ __forceinline__ T kg_pw_sub(T a, T b) {
  if constexpr (KgPwIsFloat<T>::value)
    return a - b;
  else
    return (T)((unsigned long long)a - (unsigned long long)b);
}
template <class T>
__device__ __forceinline__ T kg_pw_mul(T a, T b) {
  if constexpr (KgPwIsFloat<T>::value)
    return a * b;
  else
    return (T)((unsigned long long)a * (unsigned long long)b);
}
// Integers: truncated toward zero; x / 0 = 0; MIN / -1 wraps to MIN.
template <class T>
__device__ __forceinline__ T kg_pw_div(T a, T b) {
  if constexpr (KgPwIsFloat<T>::value) {
    return a / b;
  } else {
    if (b == (T)0) return (T)0;
    if constexpr (KgPwIsSigned<T>::value) {
      if (b == (T)(-1)) return kg_pw_neg(a);
    }
    return (T)(a / b);
  }
}
// The remainder with the dividend's sign (C fmod); integers: x % 0 = 0.
template <class T>
__device__ __forceinline__ T kg_pw_fmod(T a, T b) {
  if constexpr (KgPwIsFloat<T>::value) {
    return kg_pw_math_fmod(a, b);
  } else {
    if (b == (T)0) return (T)0;
    if constexpr (KgPwIsSigned<T>::value) {
      if (b == (T)(-1)) return (T)0;
    }
    return (T)(a % b);
  }
}
// The remainder with the divisor's sign (Python's %).
template <class T>
__device__ __forceinline__ T kg_pw_mod(T a, T b) {
  T r = kg_pw_fmod(a, b);
  if constexpr (KgPwIsSigned<T>::value) {
    if (r != (T)0 && ((r < (T)0) != (b < (T)0))) r = (T)(r + b);
  }
  return r;
}
// Floats: pow. Integers: repeated multiplication (by squaring, wrapping); a negative exponent
// gives 0, except for a base of 1 (1) or -1 (±1).
template <class T>
__device__ __forceinline__ T kg_pw_pow(T a, T b) {
  if constexpr (KgPwIsFloat<T>::value) {
    return kg_pw_math_pow(a, b);
  } else {
    if constexpr (KgPwIsSigned<T>::value) {
      if (b < (T)0) {
        if (a == (T)1) return (T)1;
        if (a == (T)(-1)) return (b & 1) ? (T)(-1) : (T)1;
        return (T)0;
      }
    }
    unsigned long long r = 1ULL, base = (unsigned long long)a, e = (unsigned long long)b;
    while (e) {
      if (e & 1ULL) r *= base;
      base *= base;
      e >>= 1;
    }
    return (T)r;
  }
}
// NaN wins for floats.
template <class T>
__device__ __forceinline__ T kg_pw_max(T a, T b) {
  if constexpr (KgPwIsFloat<T>::value) {
    if (a != a) return a;
    if (b != b) return b;
  }
  return a > b ? a : b;
}
template <class T>
__device__ __forceinline__ T kg_pw_min(T a, T b) {
  if constexpr (KgPwIsFloat<T>::value) {
    if (a != a) return a;
    if (b != b) return b;
  }
  return a < b ? a : b;
}

// ---- unary functions of every numeric dtype ----

template <class T>
__device__ __forceinline__ T kg_pw_abs(T a) {
  if constexpr (KgPwIsFloat<T>::value)
    return kg_pw_fabs(a);
  else if constexpr (KgPwIsSigned<T>::value)
    return a < (T)0 ? kg_pw_neg(a) : a;
  else
    return a;
}
// -1, 0 or 1; NaN stays NaN.
template <class T>
__device__ __forceinline__ T kg_pw_sign(T a) {
  if constexpr (KgPwIsFloat<T>::value) {
    if (a != a) return a;
  }
  if (a > (T)0) return (T)1;
  if constexpr (KgPwIsSigned<T>::value) {
    if (a < (T)0) return (T)(-1);
  }
  return (T)0;
}
template <class T>
__device__ __forceinline__ T kg_pw_relu(T a) {
  if constexpr (KgPwIsSigned<T>::value)
    return a < (T)0 ? (T)0 : a;
  else
    return a;
}
// x < 0 ? slope * x : x.
template <class T>
__device__ __forceinline__ T kg_pw_prelu(T a, T slope) {
  if constexpr (KgPwIsSigned<T>::value)
    return a < (T)0 ? kg_pw_mul(slope, a) : a;
  else
    return a;
}
// min(max(x, lo), hi). NaN stays NaN.
template <class T>
__device__ __forceinline__ T kg_pw_clamp(T a, T lo, T hi) {
  const T y = a < lo ? lo : a;
  return y > hi ? hi : y;
}
// Clip with the bounds of the kernel's arguments `p` (a KgPwArgs, pointwise_shared.cuh): floats
// between attr[0] and attr[1], integers between iattr[0] and iattr[1] (the host's rounding of them
// into the dtype's range).
template <class T, class Args>
__device__ __forceinline__ T kg_pw_clip(T a, const Args& p) {
  if constexpr (KgPwIsFloat<T>::value)
    return kg_pw_clamp(a, (T)p.attr[0], (T)p.attr[1]);
  else
    return kg_pw_clamp(a, (T)p.iattr[0], (T)p.iattr[1]);
}

// ---- activations (floats) ----

template <class T>
__device__ __forceinline__ T kg_pw_sigmoid(T a) {
  if (a >= (T)0) return (T)1 / ((T)1 + kg_pw_exp(-a));
  const T e = kg_pw_exp(a);
  return e / ((T)1 + e);
}
// log(1 + e^x) without overflow.
template <class T>
__device__ __forceinline__ T kg_pw_softplus(T a) {
  return a > (T)0 ? a + kg_pw_log1p(kg_pw_exp(-a)) : kg_pw_log1p(kg_pw_exp(a));
}
template <class T>
__device__ __forceinline__ T kg_pw_mish(T a) {
  return a * kg_pw_tanh(kg_pw_softplus(a));
}
template <class T>
__device__ __forceinline__ T kg_pw_elu(T a, T alpha) {
  return a < (T)0 ? alpha * kg_pw_expm1(a) : a;
}
template <class T>
__device__ __forceinline__ T kg_pw_selu(T a, T alpha, T gamma) {
  return a > (T)0 ? gamma * a : gamma * (alpha * kg_pw_expm1(a));
}
template <class T>
__device__ __forceinline__ T kg_pw_celu(T a, T alpha) {
  return a > (T)0 ? a : alpha * kg_pw_expm1(a / alpha);
}
template <class T>
__device__ __forceinline__ T kg_pw_hard_sigmoid(T a, T alpha, T beta) {
  const T v = alpha * a + beta;
  return v < (T)0 ? (T)0 : (v > (T)1 ? (T)1 : v);
}
template <class T>
__device__ __forceinline__ T kg_pw_hard_swish(T a) {
  const T v = a / (T)6 + (T)0.5;
  return a * (v < (T)0 ? (T)0 : (v > (T)1 ? (T)1 : v));
}
