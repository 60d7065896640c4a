// 16-bit float storage for the built-in kernels: kg_f16 (IEEE binary16) and kg_bf16 (bfloat16).
// A kernel stores them and computes in float: kg_ld() reads any element type as its compute
// type (float for the 16-bit ones, the type itself otherwise), kg_st() rounds a computed value
// to nearest even into the element type. The same text compiles under NVRTC (the conversions
// are single cvt instructions) and under the CUDA emulator (its header's integer conversions,
// bit-identical).
// Given to NVRTC as an in-memory header through kg_device.cuh; it includes nothing.
#pragma once

struct __align__(2) kg_f16 {
  unsigned short bits;
};
struct __align__(2) kg_bf16 {
  unsigned short bits;
};

// The type an element type computes in.
template <class T>
struct kg_compute {
  typedef T type;
};
template <>
struct kg_compute<kg_f16> {
  typedef float type;
};
template <>
struct kg_compute<kg_bf16> {
  typedef float type;
};
template <class T>
using kg_compute_t = typename kg_compute<T>::type;

// ---- conversions ----
// Under the emulator, its header's own conversions (the same rounding) serve.
__device__ __forceinline__ float kg_f16_to_float(unsigned short h) {
#ifdef KG_CUDA_EMU
  return kg_emu_half_to_float(h);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}

__device__ __forceinline__ unsigned short kg_float_to_f16(float f) {
#ifdef KG_CUDA_EMU
  return kg_emu_float_to_half(f);
#else
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#endif
}

__device__ __forceinline__ float kg_bf16_to_float(unsigned short b) { return __uint_as_float((unsigned)b << 16); }

__device__ __forceinline__ unsigned short kg_float_to_bf16(float f) {
  const unsigned x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);  // quiet NaN
  return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// ---- element access ----
// A value of an element type as its compute type.
__device__ __forceinline__ float kg_to_compute(kg_f16 v) { return kg_f16_to_float(v.bits); }
__device__ __forceinline__ float kg_to_compute(kg_bf16 v) { return kg_bf16_to_float(v.bits); }
__device__ __forceinline__ float kg_to_compute(float v) { return v; }
__device__ __forceinline__ double kg_to_compute(double v) { return v; }

// A computed value rounded into element type T.
template <class T>
__device__ __forceinline__ T kg_from_compute(kg_compute_t<T> v) {
  return (T)v;
}
template <>
__device__ __forceinline__ kg_f16 kg_from_compute<kg_f16>(float v) {
  kg_f16 r;
  r.bits = kg_float_to_f16(v);
  return r;
}
template <>
__device__ __forceinline__ kg_bf16 kg_from_compute<kg_bf16>(float v) {
  kg_bf16 r;
  r.bits = kg_float_to_bf16(v);
  return r;
}

// Two floats rounded to nearest-even into 16-bit elements, as one 32-bit word with the first in
// its low half (as a pair of T is laid out in memory). One instruction on compute capability 8.0
// and newer; the scalar conversions elsewhere (the same rounding).
__device__ __forceinline__ unsigned kg_pack2(kg_bf16, float lo, float hi) {
#if !defined(KG_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (unsigned)kg_float_to_bf16(lo) | ((unsigned)kg_float_to_bf16(hi) << 16);
#endif
}
__device__ __forceinline__ unsigned kg_pack2(kg_f16, float lo, float hi) {
#if !defined(KG_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (unsigned)kg_float_to_f16(lo) | ((unsigned)kg_float_to_f16(hi) << 16);
#endif
}

// Reads p[i] as the compute type; writes v (a compute-type value) rounded into p[i].
template <class T>
__device__ __forceinline__ kg_compute_t<T> kg_ld(const T* p, long long i = 0) {
  return kg_to_compute(p[i]);
}
template <class T>
__device__ __forceinline__ void kg_st(T* p, long long i, kg_compute_t<T> v) {
  p[i] = kg_from_compute<T>(v);
}
