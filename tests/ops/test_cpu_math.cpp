// <kg/cpu_math.hpp>: the vectorisable float and double functions against the C library in a wider
// precision (double for the float forms, long double for the double ones), in units in the last
// place, on fresh random inputs and at the edges (±0, large |x|, the overflow and underflow
// thresholds, inf, NaN), through every copy of apply()'s loop this CPU runs; apply()'s spans; and
// lenet.scaled_tanh's CPU forward, backward and elementwise form, which are written with it,
// against the naive formula.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kg/cpu_math.hpp"
#include "kg/models.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;
namespace cm = kg::cpu_math;

namespace {

// Every copy of apply()'s loop this CPU runs, widest first.
std::vector<cm::Isa> runnable_isas() {
  std::vector<cm::Isa> out;
  for (cm::Isa i : {cm::Isa::Avx512, cm::Isa::Avx2, cm::Isa::Baseline})
    if (static_cast<int>(i) >= static_cast<int>(cm::isa())) out.push_back(i);
  return out;
}

const char* isa_name(cm::Isa i) {
  switch (i) {
    case cm::Isa::Avx512:
      return "avx512";
    case cm::Isa::Avx2:
      return "avx2";
    case cm::Isa::Baseline:
      break;
  }
  return "baseline";
}

// |got - want| in units of the spacing of T at want (the subnormal spacing below the normal
// range). A NaN or infinity must be matched exactly.
template <class T>
double ulps(T got, long double want) {
  if (std::isnan(want)) return std::isnan(got) ? 0.0 : INFINITY;
  if (std::isinf(want) || std::isnan(got) || std::isinf(got))
    return static_cast<long double>(got) == want ? 0.0 : INFINITY;
  const long double aw = std::fabs(want);
  long double spacing = std::numeric_limits<T>::denorm_min();
  if (aw >= std::numeric_limits<T>::min()) {
    int e = 0;
    std::frexp(aw, &e);  // aw = m · 2^e, m in [0.5, 1)
    spacing = std::ldexp(1.0L, e - std::numeric_limits<T>::digits);
  }
  return static_cast<double>(std::fabs(static_cast<long double>(got) - want) / spacing);
}

// Inputs for an accuracy run: uniform in [lo, hi) and log-spaced magnitudes below 1 of both signs.
template <class T>
std::vector<T> accuracy_inputs(std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<T> xs;
  for (int i = 0; i < 300000; ++i) xs.push_back(static_cast<T>(u(rng)));
  const T smallest = sizeof(T) == 4 ? T(1e-7) : T(1e-30);
  for (T m = smallest; m < T(1); m *= T(1.01))
    if (m > lo && m < hi) xs.insert(xs.end(), {m, -m});
  return xs;
}

// The worst error of f over the inputs, in every copy of the loop, must stay within max_ulps.
template <class T, class F, class Ref>
void expect_within_ulps(const char* name, F f, Ref ref, double lo, double hi, double max_ulps,
                        std::mt19937_64& rng) {
  SCOPED_TRACE(std::string(name) + (sizeof(T) == 4 ? " f32" : " f64"));
  const std::vector<T> xs = accuracy_inputs<T>(rng, lo, hi);
  std::vector<T> ys(xs.size());
  for (cm::Isa isa : runnable_isas()) {
    SCOPED_TRACE(isa_name(isa));
    cm::apply_n_on(isa, static_cast<std::int64_t>(xs.size()), ys.data(), f, xs.data());
    double worst = 0;
    T at = 0;
    for (std::size_t i = 0; i < xs.size(); ++i) {
      const double e = ulps<T>(ys[i], ref(static_cast<long double>(xs[i])));
      if (!(e <= worst)) worst = e, at = xs[i];
    }
    EXPECT_LE(worst, max_ulps) << "at x = " << static_cast<double>(at);
  }
}

// f over `xs` in every copy of the loop and called directly: each result must be `want`'s
// (the same NaN-ness and sign; equal, or within max_ulps of it when max_ulps > 0).
template <class T, class F>
void expect_values(const char* name, F f, const std::vector<T>& xs, const std::vector<long double>& want,
                   double max_ulps = 0) {
  SCOPED_TRACE(std::string(name) + (sizeof(T) == 4 ? " f32" : " f64"));
  ASSERT_EQ(xs.size(), want.size());
  std::vector<T> ys(xs.size());
  auto check = [&](const char* how) {
    for (std::size_t i = 0; i < xs.size(); ++i) {
      SCOPED_TRACE(std::string(how) + ", x = " + std::to_string(static_cast<double>(xs[i])));
      if (std::isnan(want[i])) {
        EXPECT_TRUE(std::isnan(ys[i])) << ys[i];
        continue;
      }
      EXPECT_EQ(std::signbit(ys[i]), std::signbit(want[i])) << ys[i];
      if (max_ulps > 0)
        EXPECT_LE(ulps<T>(ys[i], want[i]), max_ulps) << ys[i] << " vs " << static_cast<double>(want[i]);
      else
        EXPECT_EQ(static_cast<long double>(ys[i]), want[i]);
    }
  };
  for (cm::Isa isa : runnable_isas()) {
    std::fill(ys.begin(), ys.end(), T(7));
    cm::apply_n_on(isa, static_cast<std::int64_t>(xs.size()), ys.data(), f, xs.data());
    check(isa_name(isa));
  }
  for (std::size_t i = 0; i < xs.size(); ++i) ys[i] = f(xs[i]);
  check("direct call");
}

constexpr double kInvSqrt2 = 0.70710678118654752440084436210484903928;

}  // namespace

TEST(CpuMath, FloatFunctionsAreWithinTheirUlpBounds) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  using L = long double;
  expect_within_ulps<float>(
      "exp", [](float x) { return cm::exp(x); }, [](L x) { return L(std::exp(double(x))); }, -87.3, 88.7, 1.5,
      rng);
  expect_within_ulps<float>(
      "tanh", [](float x) { return cm::tanh(x); }, [](L x) { return L(std::tanh(double(x))); }, -12, 12, 2.0,
      rng);
  expect_within_ulps<float>(
      "sigmoid", [](float x) { return cm::sigmoid(x); },
      [](L x) { return L(1.0 / (1.0 + std::exp(-double(x)))); }, -80, 80, 3.0, rng);
  expect_within_ulps<float>(
      "erfc", [](float x) { return cm::erfc(x); }, [](L x) { return L(std::erfc(double(x))); }, -5, 9.1, 5.0,
      rng);
  // gelu is erfc at the float argument -x/√2 (its rounding is the input's, not gelu's error).
  expect_within_ulps<float>(
      "gelu", [](float x) { return cm::gelu(x); },
      [](L x) {
        const float u = -static_cast<float>(x) * static_cast<float>(kInvSqrt2);
        return L(0.5 * double(x) * std::erfc(double(u)));
      },
      -12, 12, 5.5, rng);
}

TEST(CpuMath, DoubleFunctionsAreWithinTheirUlpBounds) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  using L = long double;
  expect_within_ulps<double>(
      "exp", [](double x) { return cm::exp(x); }, [](L x) { return std::exp(x); }, -708.3, 709.7, 1.5, rng);
  // Subnormal results: the spacing there is the smallest subnormal.
  expect_within_ulps<double>(
      "exp (subnormal results)", [](double x) { return cm::exp(x); }, [](L x) { return std::exp(x); }, -745.1,
      -708.4, 1.5, rng);
  expect_within_ulps<double>(
      "tanh", [](double x) { return cm::tanh(x); }, [](L x) { return std::tanh(x); }, -20, 20, 2.0, rng);
  expect_within_ulps<double>(
      "sigmoid", [](double x) { return cm::sigmoid(x); }, [](L x) { return 1.0L / (1.0L + std::exp(-x)); },
      -700, 700, 3.0, rng);
  // gelu_tanh in double: x / (1 + e^-2u) with u in long double; the rounding of u in double is
  // amplified by 2|u|, so the bound is relative and loose at the ends.
  std::uniform_real_distribution<double> u(-8, 8);
  for (int i = 0; i < 20000; ++i) {
    const double x = u(rng);
    const L v = 1.5957691216057307117597842397375274738L * (x + 0.044715L * x * x * x);
    const L want = x / (1 + std::exp(-v));
    ASSERT_NEAR(cm::gelu_tanh(x), static_cast<double>(want),
                5e-14 * std::fabs(static_cast<double>(want)) + 1e-300)
        << "x = " << x;
  }
  EXPECT_EQ(cm::erfc(0.5), std::erfc(0.5));  // the library's
  EXPECT_EQ(cm::gelu(1.25), 0.5 * 1.25 * std::erfc(-1.25 * kInvSqrt2));
}

TEST(CpuMath, GeluTanhFloatMatchesItsFormula) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-8, 8);
  std::vector<float> xs(10000), ys(xs.size());
  for (float& x : xs) x = u(rng);
  for (cm::Isa isa : runnable_isas()) {
    SCOPED_TRACE(isa_name(isa));
    cm::apply_n_on(
        isa, static_cast<std::int64_t>(xs.size()), ys.data(), [](float x) { return cm::gelu_tanh(x); },
        xs.data());
    for (std::size_t i = 0; i < xs.size(); ++i) {
      const double x = xs[i];
      const double want = x / (1 + std::exp(-1.5957691216057307 * (x + 0.044715 * x * x * x)));
      // 2|u| amplifies the rounding of u (|2u| = 49 at |x| = 8): a relative bound, loose at the ends.
      ASSERT_NEAR(ys[i], want, 3e-5 * std::fabs(want) + 1e-37) << "x = " << x;
    }
  }
}

TEST(CpuMath, EdgeValues) {
  const float fi = INFINITY, fnan = NAN;
  const double di = INFINITY, dnan = NAN;
  const long double li = INFINITY, lnan = NAN;
  const float fmax = std::numeric_limits<float>::max();
  const double dmax = std::numeric_limits<double>::max();
  using L = long double;

  // exp, float: 0 below the smallest normal result, inf above the largest.
  expect_values<float>(
      "exp", [](float x) { return cm::exp(x); },
      {0.0f, -0.0f, fi, -fi, fnan, 88.72f, 88.73f, 100.0f, fmax, -87.3f, -87.4f, -100.0f, -fmax, 1e-30f,
       -1e-30f},
      {1, 1, li, 0, lnan, std::exp(L(88.72f)), li, li, li, std::exp(L(-87.3f)), 0, 0, 0, 1, 1}, 1.5);
  // exp, double: subnormal results down to e^-745.13, then 0.
  expect_values<double>(
      "exp", [](double x) { return cm::exp(x); },
      {0.0, -0.0, di, -di, dnan, 709.78, 709.79, 1000.0, dmax, -708.5, -745.0, -745.2, -1000.0, -dmax, 1e-300,
       -1e-300},
      {1, 1, li, 0, lnan, std::exp(L(709.78)), li, li, li, std::exp(L(-708.5)), std::exp(L(-745.0)), 0, 0, 0,
       1, 1},
      1.5);
  // tanh: odd, ±0 keeps its sign, ±1 for large |x|, x itself for tiny x (subnormals too).
  const float fsub = 1e-40f;
  expect_values<float>(
      "tanh", [](float x) { return cm::tanh(x); },
      {0.0f, -0.0f, fi, -fi, fnan, 20.0f, -20.0f, 1e30f, -fmax, 1e-30f, -1e-30f, fsub, -fsub, 0.625f,
       -0.625f},
      {0.0L, -0.0L, 1, -1, lnan, 1, -1, 1, -1, L(1e-30f), -L(1e-30f), L(fsub), -L(fsub), std::tanh(L(0.625f)),
       -std::tanh(L(0.625f))},
      2.0);
  const double dsub = 1e-310;
  expect_values<double>(
      "tanh", [](double x) { return cm::tanh(x); },
      {0.0, -0.0, di, -di, dnan, 40.0, -40.0, 1e300, -dmax, 1e-300, -1e-300, dsub, -dsub, 0.625, -0.625},
      {0.0L, -0.0L, 1, -1, lnan, 1, -1, 1, -1, L(1e-300), -L(1e-300), L(dsub), -L(dsub), std::tanh(L(0.625)),
       -std::tanh(L(0.625))},
      2.0);
  // sigmoid: 1/2 at ±0, 0 and 1 at the ends.
  expect_values<float>("sigmoid", [](float x) { return cm::sigmoid(x); },
                       {0.0f, -0.0f, fi, -fi, fnan, 100.0f, -100.0f, fmax, -fmax},
                       {0.5, 0.5, 1, 0, lnan, 1, 0, 1, 0});
  expect_values<double>("sigmoid", [](double x) { return cm::sigmoid(x); },
                        {0.0, -0.0, di, -di, dnan, 1000.0, -1000.0, dmax, -dmax},
                        {0.5, 0.5, 1, 0, lnan, 1, 0, 1, 0});
  // erfc: 1 at 0, 0 and 2 at the ends.
  expect_values<float>("erfc", [](float x) { return cm::erfc(x); },
                       {0.0f, -0.0f, fi, -fi, fnan, 10.1f, -10.1f, fmax}, {1, 1, 0, 2, lnan, 0, 2, 0});
  // gelu and gelu_tanh: 0 at ±0 (-0 stays -0), x for large x, -0 for large negative x.
  expect_values<float>("gelu", [](float x) { return cm::gelu(x); }, {0.0f, -0.0f, 1000.0f, -1000.0f, fnan},
                       {0.0L, -0.0L, 1000, -0.0L, lnan});
  expect_values<float>("gelu_tanh", [](float x) { return cm::gelu_tanh(x); },
                       {0.0f, -0.0f, 1000.0f, -1000.0f, fnan}, {0.0L, -0.0L, 1000, -0.0L, lnan});
  expect_values<double>("gelu_tanh", [](double x) { return cm::gelu_tanh(x); },
                        {0.0, -0.0, 1000.0, -1000.0, dnan}, {0.0L, -0.0L, 1000, -0.0L, lnan});
}

TEST(CpuMath, ApplyCoversEveryLengthInPlaceAndSeveralInputs) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-6, 6);
  auto f = [](float v) { return 1.5f * cm::tanh(0.5f * v); };
  // Lengths around the vector widths: the loops' remainders are right too.
  for (std::int64_t n = 0; n <= 70; ++n) {
    SCOPED_TRACE("n = " + std::to_string(n));
    std::vector<float> x(static_cast<std::size_t>(n)), y(x.size(), NAN), b(x.size()), z(x.size(), NAN);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = u(rng), b[i] = u(rng);
    cm::apply<float>(x, y, f);
    cm::apply<float>(x, b, z, [](float p, float q) { return p * cm::sigmoid(q); });
    // The widest copy of the loop contracts into FMAs where a direct call does not: a few ulps.
    for (std::size_t i = 0; i < x.size(); ++i) {
      ASSERT_LE(ulps<float>(y[i], f(x[i])), 4) << "element " << i;
      ASSERT_LE(ulps<float>(z[i], x[i] * cm::sigmoid(b[i])), 6) << "element " << i;
    }
    // In place, in every copy of the loop: the same values as a fresh output.
    for (cm::Isa isa : runnable_isas()) {
      std::vector<float> fresh(x.size()), in_place = x;
      cm::apply_n_on(isa, n, fresh.data(), f, x.data());
      cm::apply_n_on(isa, n, in_place.data(), f, in_place.data());
      ASSERT_EQ(fresh, in_place) << isa_name(isa);
    }
  }
  // Three inputs through the pointer form, in double.
  std::vector<double> a{1, 2, 3}, b{0.5, -1, 2}, c{0, 1, -1}, y(3);
  cm::apply_n(
      3, y.data(), [](double p, double q, double r) { return p * cm::exp(q) + r; }, a.data(), b.data(),
      c.data());
  for (int i = 0; i < 3; ++i) EXPECT_DOUBLE_EQ(y[i], a[i] * std::exp(b[i]) + c[i]);
  // Spans of different sizes are an error.
  std::vector<float> four(4), five(5);
  kg_test::expect_error([&] { cm::apply<float>(four, five, [](float v) { return v; }); },
                        {"kg::cpu_math::apply", "4", "5"});
  kg_test::expect_error([&] { cm::apply<float>(four, five, five, [](float p, float) { return p; }); },
                        {"kg::cpu_math::apply", "4", "5"});
}

TEST(CpuMath, ScaledTanhCpuFormsMatchTheNaiveFormula) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  constexpr long double kA = 1.7159L, kS = 2.0L / 3.0L;
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
    SCOPED_TRACE(std::string(kg::dtype_name(dt)));
    const bool f32 = dt == kg::DType::F32;
    // rtol: float rounds S·x and A·tanh, and tanh is within 2 ulp; double likewise at 2^-53.
    const long double rtol = f32 ? 5e-7L : 1e-15L;
    const kg::CustomData op = kg::models::scaled_tanh_op(dt);
    // 40,007 elements: several chunks of the op's parallel_for and a remainder for the loops.
    const std::vector<std::int64_t> shape{7, 5715, 1};
    kg::Tensor x = kg_test::random_tensor(rng, dt, shape, -6.0, 6.0);
    if (f32) {
      x.data<float>()[0] = 0.0f, x.data<float>()[1] = -0.0f, x.data<float>()[2] = 40.0f;
    } else {
      x.data<double>()[0] = 0.0, x.data<double>()[1] = -0.0, x.data<double>()[2] = 40.0;
    }
    auto want_y = [&](std::int64_t i) { return kA * std::tanh(kS * static_cast<long double>(x.item(i))); };

    // Forward.
    kg::Tensor y = kg::Tensor::empty(dt, shape);
    y.fill(std::numeric_limits<double>::quiet_NaN());
    std::vector<kg::Tensor> ins{x};
    kg::CpuContext ctx(ins, {}, y, false, 0);
    op->cpu_forward(ctx);
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      const long double want = want_y(i);
      ASSERT_LE(std::fabs(y.item(i) - want), rtol * std::fabs(want))
          << "element " << i << ", x = " << x.item(i);
    }
    EXPECT_TRUE(std::signbit(y.item(1)));

    // Backward: dx = dy · A·S·(1 - (y/A)²) from the saved output.
    const kg::Tensor dy = kg_test::random_tensor(rng, dt, shape);
    kg::Tensor dx = kg::Tensor::empty(dt, shape);
    dx.fill(std::numeric_limits<double>::quiet_NaN());
    const kg::Tensor no_input = kg::Tensor::wrap(nullptr, dt, shape);
    std::vector<kg::Tensor> bins{no_input}, grads{dx};
    kg::CpuBackwardContext bctx(bins, {}, y, dy, grads, {}, true, 0);
    op->cpu_backward(bctx);
    auto want_d = [&](std::int64_t i) {
      const long double t = static_cast<long double>(y.item(i)) / kA;
      return kA * kS * (1 - t * t);
    };
    // 1 - t² cancels as |y| nears A: the error is relative to A·S, not to the result.
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      const long double want = dy.item(i) * want_d(i);
      ASSERT_LE(std::fabs(dx.item(i) - want), 4 * rtol * kA * kS * std::fabs(dy.item(i)) + 1e-300L)
          << "element " << i;
    }

    // The elementwise form (fusion's CPU path): the same values over a span.
    const std::optional<kg::ElementwiseForm> form = op->elementwise_form({dt});
    ASSERT_TRUE(form.has_value());
    kg::Tensor fy = kg::Tensor::empty(dt, shape), fd = kg::Tensor::empty(dt, shape);
    const void* span_in[] = {x.raw()};
    kg::ElementwiseSpan s;
    s.dtype = dt;
    s.inputs = span_in;
    s.result = fy.raw();
    s.n = x.numel();
    form->cpu(s);
    s.output = y.raw();
    s.result = fd.raw();
    form->cpu_derivative(s);
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      ASSERT_EQ(fy.item(i), y.item(i)) << "element " << i;
      ASSERT_LE(std::fabs(fd.item(i) - want_d(i)), 4 * rtol * kA * kS) << "element " << i;
    }
  }
}
