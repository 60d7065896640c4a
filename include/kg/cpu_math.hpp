// Float and double math that the compiler vectorises, for the CPU forms of custom ops.
//
// glibc's expf, tanhf and erfcf are library calls that GCC cannot vectorise (without
// -ffast-math), so a loop calling std::tanh runs one element at a time. The functions here are
// branch-free polynomial forms (Cephes' and fdlibm's range reductions and coefficients) written
// so that a plain loop over them becomes SIMD code on every x86-64 level, SSE2 included: no
// std::fma, std::floor, float-to-int conversions or tables, and selects made of bit masks
// instead of branches. Call them qualified (kg::cpu_math::tanh), inside a loop or a lambda.
//
// apply() and apply_n() run a per-element function over arrays. On x86-64 they hold copies of
// their loop compiled for AVX-512F and for AVX2 with FMA and take the widest one the CPU runs,
// chosen at run time, so a portable build still gets 512-bit vectors. Build with -O3 (or -O2
// -fvect-cost-model=dynamic): GCC's -O2 default cost model leaves most of these loops scalar.
//
// Accuracy, the largest error measured against the C library in a wider precision (the bounds
// tests/ops/test_cpu_math.cpp checks in parentheses), in ulps:
//   float:  exp 1.0 (1.5), tanh 1.3 (2), sigmoid 2.4 (3), erfc 4.0 (5), gelu: erfc's at -x/√2
//   double: exp 0.9 (1.5), tanh 1.3 (2), sigmoid 2.3 (3); erfc and gelu call std::erfc
// Float exp flushes results below the smallest normal float to 0 (so sigmoid is 0 below -87.3);
// double exp keeps subnormals. NaN stays NaN, exp(±inf) is inf and 0, tanh(±inf) is ±1, and
// tanh keeps the sign of -0.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>

#include "kg/error.hpp"

// 1 where apply() has AVX-512 and AVX2 copies of its loop, chosen at run time (x86-64 with GCC
// or Clang); define it to 0 to leave them out.
#ifndef KG_CPU_MATH_DISPATCH
#if defined(__x86_64__) && defined(__GNUC__)
#define KG_CPU_MATH_DISPATCH 1
#else
#define KG_CPU_MATH_DISPATCH 0
#endif
#endif

// The functions below are forced inline: in a large file GCC's inlining budget runs out, and a
// loop around a call that stays a call is not vectorised.
#if defined(__GNUC__)
#define KG_CPU_MATH_INLINE [[gnu::always_inline]] inline
#else
#define KG_CPU_MATH_INLINE inline
#endif

namespace kg::cpu_math {

namespace detail {
// a·b + c. Written as an expression, not std::fma: the compiler contracts it into one FMA
// instruction where the target has FMA (the AVX-512 loops, -march=native) and keeps a multiply
// and an add elsewhere, where std::fma would be a library call per element.
template <class T>
KG_CPU_MATH_INLINE T madd(T a, T b, T c) {
  return a * b + c;
}
// c ? a : b for floats, computed with a bit mask. A plain ?: lets GCC move the computation of the
// value it picks into a branch, or specialise the code after it for the value of a clamp, and a
// loop with a branch around operations that may trap (any float operation, under the default
// -ftrapping-math) is not vectorised without AVX-512's masks.
KG_CPU_MATH_INLINE float select(bool c, float a, float b) {
  const std::int32_t m = -static_cast<std::int32_t>(c);
  return std::bit_cast<float>((std::bit_cast<std::int32_t>(a) & m) | (std::bit_cast<std::int32_t>(b) & ~m));
}
// The double form takes its mask from above() instead of a bool: SSE2 has no 64-bit compare, and
// GCC does not vectorise a bool widened to a 64-bit mask there.
KG_CPU_MATH_INLINE double select(std::uint64_t m, double a, double b) {
  return std::bit_cast<double>((std::bit_cast<std::uint64_t>(a) & m) |
                               (std::bit_cast<std::uint64_t>(b) & ~m));
}
// All ones where a > b, else 0, for a >= 0 or NaN (which counts as above everything) and b >= 0:
// non-negative doubles order as their bit patterns do, so an integer subtraction decides.
KG_CPU_MATH_INLINE std::uint64_t above(double a, double b) {
  return 0 - ((std::bit_cast<std::uint64_t>(b) - std::bit_cast<std::uint64_t>(a)) >> 63);
}
// 2^k as a float for -126 <= k <= 127 and as a double for -1022 <= k <= 1023 (k plus the bias
// in the exponent field).
KG_CPU_MATH_INLINE float pow2_f32(std::int32_t k) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(k + 127) << 23);
}
KG_CPU_MATH_INLINE double pow2_f64(std::int64_t k) {
  return std::bit_cast<double>(static_cast<std::uint64_t>(k + 1023) << 52);
}
// The integer n of t = n + 1.5 · 2^23 (float) or t = n + 1.5 · 2^52 (double): the low bits of t,
// read without a float-to-int conversion, which is undefined out of range (and not vectorised
// for 64-bit lanes without AVX-512DQ). For other t it is some integer, no error.
KG_CPU_MATH_INLINE std::int32_t int_of_shifted(float t) {
  return static_cast<std::int32_t>(std::bit_cast<std::uint32_t>(t) -
                                   std::bit_cast<std::uint32_t>(12582912.0f));
}
KG_CPU_MATH_INLINE std::int64_t int_of_shifted(double t) {
  return static_cast<std::int64_t>(std::bit_cast<std::uint64_t>(t) -
                                   std::bit_cast<std::uint64_t>(6755399441055744.0));
}
}  // namespace detail

// e^x in float within 1 ulp (Cephes' range reduction and polynomial); results below the
// smallest normal float flush to 0, above the largest give inf.
KG_CPU_MATH_INLINE float exp(float x) {
  constexpr float hi = 88.7228394f, lo = -87.3365479f;  // log(FLT_MAX), log(FLT_MIN)
  constexpr float shift = 12582912.0f;                  // 1.5 · 2^23: adding it rounds to an integer
  // n = round(x / ln 2) = t - shift (std::floor does not vectorise); r = x - n ln 2 with ln 2 split
  // in two (the high part's few bits make n · high exact).
  const float t = detail::madd(x, 1.44269504088896341f, shift);
  const float n = t - shift;
  const float r = detail::madd(n, 2.12194440e-4f, detail::madd(n, -0.693359375f, x));
  float p = 1.9875691500e-4f;
  p = detail::madd(p, r, 1.3981999507e-3f);
  p = detail::madd(p, r, 8.3334519073e-3f);
  p = detail::madd(p, r, 4.1665795894e-2f);
  p = detail::madd(p, r, 1.6666665459e-1f);
  p = detail::madd(p, r, 5.0000001201e-1f);
  p = detail::madd(p, r * r, r) + 1.0f;
  // p · 2^n, with 2^n as two factors so that n = 128 and n = -126 stay representable.
  const std::int32_t k = detail::int_of_shifted(t), h = k >> 1;
  const float y = p * detail::pow2_f32(h) * detail::pow2_f32(k - h);
  // Outside [lo, hi], where y may be anything, 0 or inf; NaN has stayed NaN through every step.
  return detail::select(x > hi, std::numeric_limits<float>::infinity(), detail::select(x < lo, 0.0f, y));
}

// e^x in double within 0.9 ulp (fdlibm's reduction and rational form), subnormal results included.
KG_CPU_MATH_INLINE double exp(double x) {
  // |x| above 746 is taken as ±746, where e^x is already inf or 0; 2^n then overflows or
  // underflows by itself. NaN is put back at the end.
  const double a = std::fabs(x);
  const double c = detail::select(detail::above(a, 746.0), std::copysign(746.0, x), x);
  constexpr double shift = 6755399441055744.0;  // 1.5 · 2^52: adding it rounds to an integer
  const double t = detail::madd(c, 1.44269504088896338700, shift);
  const double n = t - shift;
  // r = c - n ln 2 as rh - rl, ln 2's high part with enough zero bits that n · it is exact.
  const double rh = detail::madd(n, -6.93147180369123816490e-01, c);
  const double rl = n * 1.90821492927058770002e-10;
  const double r = rh - rl;
  const double r2 = r * r;
  double p = 4.13813679705723846039e-08;
  p = detail::madd(p, r2, -1.65339022054652515390e-06);
  p = detail::madd(p, r2, 6.61375632143793436117e-05);
  p = detail::madd(p, r2, -2.77777777770155933842e-03);
  p = detail::madd(p, r2, 1.66666666666666019037e-01);
  const double cr = r - r2 * p;
  const double e = 1.0 - ((rl - (r * cr) / (2.0 - cr)) - rh);
  // e · 2^n in two factors 2^h · 2^(n-h), h = n/2 rounded, so that n from -1076 to 1076 works.
  const std::int64_t k = detail::int_of_shifted(t), h = detail::int_of_shifted(detail::madd(n, 0.5, shift));
  const double y = e * detail::pow2_f64(h) * detail::pow2_f64(k - h);
  return detail::select(detail::above(a, std::numeric_limits<double>::infinity()), x, y);
}

// tanh(x) in float within 1.3 ulp: 1 - 2 / (e^2|x| + 1) above |x| = 0.625, Cephes' odd
// polynomial below it.
KG_CPU_MATH_INLINE float tanh(float x) {
  const float a = std::fabs(x);
  const float big = 1.0f - 2.0f / (cpu_math::exp(2.0f * a) + 1.0f);
  const float s = x * x;
  float p = -5.70498872745e-3f;
  p = detail::madd(p, s, 2.06390887954e-2f);
  p = detail::madd(p, s, -5.37397155531e-2f);
  p = detail::madd(p, s, 1.33314422036e-1f);
  p = detail::madd(p, s, -3.33332819422e-1f);
  const float small = detail::madd(p * s, a, a);
  return std::copysign(detail::select(a > 0.625f, big, small), x);
}

// tanh(x) in double within 1.3 ulp: 1 - 2 / (e^2|x| + 1) above |x| = 0.625, Cephes' rational
// form x + x³·P(x²)/Q(x²) below it.
KG_CPU_MATH_INLINE double tanh(double x) {
  const double a = std::fabs(x);
  const double big = 1.0 - 2.0 / (cpu_math::exp(2.0 * a) + 1.0);
  const double s = x * x;
  double p = -9.64399179425052238628e-1;
  p = detail::madd(p, s, -9.92877231001918586564e1);
  p = detail::madd(p, s, -1.61468768441708447952e3);
  double q = s + 1.12811678491632931402e2;
  q = detail::madd(q, s, 2.23548839060100448583e3);
  q = detail::madd(q, s, 4.84406305325125486048e3);
  const double small = detail::madd(a * s, p / q, a);
  return std::copysign(detail::select(detail::above(a, 0.625), big, small), x);
}

// The logistic function 1 / (1 + e^-x) in float or double, within 2.4 ulp; 0 below x = -87.3 in
// float.
KG_CPU_MATH_INLINE float sigmoid(float x) { return 1.0f / (1.0f + cpu_math::exp(-x)); }
KG_CPU_MATH_INLINE double sigmoid(double x) { return 1.0 / (1.0 + cpu_math::exp(-x)); }

// erfc(x) in float within 4 ulp (results below the smallest normal flush to 0): e^-a² times a
// polynomial fit of (1 + 2a) e^a² erfc(a) in q = (a - 2) / (a + 2), a = |x|; erfc(-a) =
// 2 - erfc(a). a² is carried as s - t (exactly, through double) so that e^-a² keeps its precision.
KG_CPU_MATH_INLINE float erfc(float x) {
  float a = std::fabs(x);
  a = detail::select(a > 10.0546875f, 10.0546875f, a);  // erfc is 0 in float beyond
  const float q = (a - 2.0f) / (a + 2.0f);
  float p = -4.0958286e-4f;
  p = detail::madd(p, q, -1.2415353e-3f);
  p = detail::madd(p, q, 1.3206749e-3f);
  p = detail::madd(p, q, 8.642994e-3f);
  p = detail::madd(p, q, -8.061685e-3f);
  p = detail::madd(p, q, -5.4207817e-2f);
  p = detail::madd(p, q, 1.6405554e-1f);
  p = detail::madd(p, q, -1.6603108e-1f);
  p = detail::madd(p, q, -9.276399e-2f);
  p = detail::madd(p, q, 2.7697837e-1f);
  const float scaled = (p + 1.0f) / detail::madd(2.0f, a, 1.0f);  // e^a² erfc(a)
  // a² is exact in double (24 + 24 bits); s is it rounded to float and t = s - a² its error.
  const double a2 = static_cast<double>(a) * static_cast<double>(a);
  const float s = static_cast<float>(a2);
  const float t = static_cast<float>(static_cast<double>(s) - a2);
  const float e = cpu_math::exp(-s);
  const float r = scaled * detail::madd(e, t, e);  // e^-s (1 + t) = e^-a²
  return detail::select(x < 0.0f, 2.0f - r, r);
}

// erfc(x) in double: std::erfc, a library call (no vectorised double form yet).
inline double erfc(double x) { return std::erfc(x); }

// GELU with the exact normal CDF, 0.5·x·(1 + erf(x/√2)), written with erfc, which keeps its
// precision for negative x where 1 + erf cancels. Float: vectorised, within 5 ulp of 0.5·x·erfc
// at the rounded float -x/√2 (the rounding of which the steep tail amplifies, as it would any
// input's: 1e-5 relative at x = -12). Double: std::erfc.
template <class T>
KG_CPU_MATH_INLINE T gelu(T x) {
  constexpr T inv_sqrt2 = T(0.70710678118654752440084436210484903928);
  return T(0.5) * x * cpu_math::erfc(-x * inv_sqrt2);
}

// GELU's tanh approximation 0.5·x·(1 + tanh(√(2/π)(x + 0.044715 x³))), as x / (1 + e^-2u): one
// exp, and no cancellation for negative x. Float and double.
template <class T>
KG_CPU_MATH_INLINE T gelu_tanh(T x) {
  constexpr T two_sqrt_2_over_pi = T(1.5957691216057307117597842397375274738);
  constexpr T k = T(0.044715);
  return x / (T(1) + cpu_math::exp(-two_sqrt_2_over_pi * (x + k * x * x * x)));
}

// ---- apply: a per-element function over arrays ----

// The instruction sets apply() has a copy of its loop for, widest first.
enum class Isa { Avx512, Avx2, Baseline };

namespace detail {
// y[i] = f(x[0][i], ..., x[K-1][i]) for i < n: the loop the compiler vectorises once f (and the
// functions above) are inlined into it, which flatten makes sure of.
template <class T, class F, class... X>
[[gnu::flatten]] inline void apply_baseline(std::int64_t n, T* y, F& f, const X*... x) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = static_cast<T>(f(x[i]...));
}
#if KG_CPU_MATH_DISPATCH
// The same loop compiled for AVX-512F (512-bit vectors, FMA) and for AVX2 with FMA (256-bit);
// call them only where the CPU runs them (isa()).
template <class T, class F, class... X>
[[gnu::target("avx512f"), gnu::flatten]] void apply_avx512(std::int64_t n, T* y, F& f, const X*... x) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = static_cast<T>(f(x[i]...));
}
template <class T, class F, class... X>
[[gnu::target("avx2,fma"), gnu::flatten]] void apply_avx2(std::int64_t n, T* y, F& f, const X*... x) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = static_cast<T>(f(x[i]...));
}
#endif
}  // namespace detail

// The widest copy of apply()'s loop this CPU runs (Baseline where there are no copies).
inline Isa isa() {
#if KG_CPU_MATH_DISPATCH
  static const Isa best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return Isa::Avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::Avx2;
    return Isa::Baseline;
  }();
  return best;
#else
  return Isa::Baseline;
#endif
}

// apply_n() below in the copy of the loop for `use`, or the widest one the CPU runs where it
// does not run `use`: for benchmarks and tests that compare the copies.
template <class T, class F, class... X>
void apply_n_on(Isa use, std::int64_t n, T* y, F&& f, const X*... x) {
#if KG_CPU_MATH_DISPATCH
  const Isa best = isa();
  switch (static_cast<int>(use) < static_cast<int>(best) ? best : use) {
    case Isa::Avx512:
      return detail::apply_avx512(n, y, f, x...);
    case Isa::Avx2:
      return detail::apply_avx2(n, y, f, x...);
    case Isa::Baseline:
      break;
  }
#else
  (void)use;
#endif
  detail::apply_baseline(n, y, f, x...);
}

// y[i] = f(x[0][i], ..., x[K-1][i]) for i < n, with f called as f(T, ..., T), in the widest copy
// of the loop this CPU runs: the pointer form of apply() below (any number of inputs; y may be
// one of them).
template <class T, class F, class... X>
void apply_n(std::int64_t n, T* y, F&& f, const X*... x) {
  apply_n_on(Isa::Avx512, n, y, f, x...);
}

// y[i] = f(x[i]) over spans of one size (y may be x itself). Write f with the functions above,
// e.g. apply<float>(x, y, [](float v) { return 1.7159f * kg::cpu_math::tanh(0.6667f * v); }).
template <class T, class F>
void apply(std::span<const T> x, std::span<T> y, F&& f) {
  if (x.size() != y.size())
    throw Error("kg::cpu_math::apply: the input has " + std::to_string(x.size()) +
                " elements but the output " + std::to_string(y.size()));
  apply_n(static_cast<std::int64_t>(y.size()), y.data(), f, x.data());
}

// y[i] = f(a[i], b[i]) over spans of one size.
template <class T, class F>
void apply(std::span<const T> a, std::span<const T> b, std::span<T> y, F&& f) {
  if (a.size() != y.size() || b.size() != y.size())
    throw Error("kg::cpu_math::apply: the inputs have " + std::to_string(a.size()) + " and " +
                std::to_string(b.size()) + " elements but the output " + std::to_string(y.size()));
  apply_n(static_cast<std::int64_t>(y.size()), y.data(), f, a.data(), b.data());
}

}  // namespace kg::cpu_math

#undef KG_CPU_MATH_INLINE
