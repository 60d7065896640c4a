// The pointwise op family (ops/pointwise.hpp): every function against a naive reference written
// here with std:: functions (broadcast index by index), the integer corner cases, every Cast pair,
// shape inference with dynamic dims, every error, and the CUDA kernels under the emulator
// (kg::testing::check_op) for a representative set.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "compile/compiler.hpp"
#include "lower/dry_run.hpp"
#include "ops/pointwise.hpp"
#include "support/test_util.hpp"
#include "util/half.hpp"

using kg::DType;
using kg::ops::PointwiseFn;
using kg_test::fresh_seed;
using F = PointwiseFn;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---- naive broadcasting ----

// numpy's broadcast of concrete shapes.
std::vector<std::int64_t> broadcast(const std::vector<std::vector<std::int64_t>>& shapes) {
  std::size_t r = 0;
  for (const auto& s : shapes) r = std::max(r, s.size());
  std::vector<std::int64_t> out(r, 1);
  for (const auto& s : shapes)
    for (std::size_t i = 0; i < s.size(); ++i) {
      std::int64_t& o = out[r - s.size() + i];
      if (s[i] != 1) o = s[i];
    }
  return out;
}

// The flat index into an input of shape `in` that output element `flat` of shape `out` reads.
std::int64_t source_index(std::int64_t flat, const std::vector<std::int64_t>& out,
                          const std::vector<std::int64_t>& in) {
  std::vector<std::int64_t> idx(out.size());
  for (std::size_t d = out.size(); d-- > 0;) {
    idx[d] = flat % out[d];
    flat /= out[d];
  }
  std::int64_t src = 0;
  for (std::size_t i = 0; i < in.size(); ++i)
    src = src * in[i] + (in[i] == 1 ? 0 : idx[i + out.size() - in.size()]);
  return src;
}

// An element read exactly as an integer (bool as 0 / 1).
std::int64_t int_at(const kg::Tensor& t, std::int64_t i) {
  const void* p = t.raw();
  switch (t.dtype()) {
    case DType::Bool:
      return static_cast<const std::uint8_t*>(p)[i] != 0;
    case DType::I8:
      return static_cast<const std::int8_t*>(p)[i];
    case DType::I16:
      return static_cast<const std::int16_t*>(p)[i];
    case DType::I32:
      return static_cast<const std::int32_t*>(p)[i];
    case DType::I64:
      return static_cast<const std::int64_t*>(p)[i];
    case DType::U8:
      return static_cast<const std::uint8_t*>(p)[i];
    default:
      ADD_FAILURE() << "int_at: " << kg::dtype_name(t.dtype());
      return 0;
  }
}

// `v` wrapped into the width of integer dtype `t` (two's complement).
std::int64_t wrap_to(DType t, std::int64_t v) {
  switch (t) {
    case DType::I8:
      return static_cast<std::int8_t>(v);
    case DType::I16:
      return static_cast<std::int16_t>(v);
    case DType::I32:
      return static_cast<std::int32_t>(v);
    case DType::U8:
      return static_cast<std::uint8_t>(v);
    case DType::Bool:
      return v != 0;
    default:
      return v;
  }
}

// Writes `v` into element i of t, whatever its dtype.
void store(kg::Tensor& t, std::int64_t i, double v) {
  void* p = t.raw();
  switch (t.dtype()) {
    case DType::Bool:
      static_cast<std::uint8_t*>(p)[i] = v != 0;
      break;
    case DType::I8:
      static_cast<std::int8_t*>(p)[i] = static_cast<std::int8_t>(static_cast<std::int64_t>(v));
      break;
    case DType::I16:
      static_cast<std::int16_t*>(p)[i] = static_cast<std::int16_t>(static_cast<std::int64_t>(v));
      break;
    case DType::I32:
      static_cast<std::int32_t*>(p)[i] = static_cast<std::int32_t>(static_cast<std::int64_t>(v));
      break;
    case DType::I64:
      static_cast<std::int64_t*>(p)[i] = static_cast<std::int64_t>(v);
      break;
    case DType::U8:
      static_cast<std::uint8_t*>(p)[i] = static_cast<std::uint8_t>(static_cast<std::int64_t>(v));
      break;
    case DType::F16:
      static_cast<std::uint16_t*>(p)[i] = kg::util::float_to_half(static_cast<float>(v));
      break;
    case DType::BF16:
      static_cast<std::uint16_t*>(p)[i] = kg::util::float_to_bf16(static_cast<float>(v));
      break;
    case DType::F32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      break;
    case DType::F64:
      static_cast<double*>(p)[i] = v;
      break;
  }
}

kg::Tensor tensor_of(DType t, std::vector<std::int64_t> shape, const std::vector<double>& values) {
  kg::Tensor x = kg::Tensor::empty(t, std::move(shape));
  EXPECT_EQ(x.numel(), static_cast<std::int64_t>(values.size()));
  for (std::int64_t i = 0; i < x.numel(); ++i) store(x, i, values[static_cast<std::size_t>(i)]);
  return x;
}

kg::Tensor random_of(std::mt19937_64& rng, DType t, std::vector<std::int64_t> shape, double lo, double hi) {
  kg::Tensor x = kg::Tensor::empty(t, shape);
  std::uniform_real_distribution<double> u(lo, hi);
  std::uniform_int_distribution<std::int64_t> ui(static_cast<std::int64_t>(lo),
                                                 static_cast<std::int64_t>(hi));
  const bool integral = !kg::is_floating(t);
  for (std::int64_t i = 0; i < x.numel(); ++i) store(x, i, integral ? static_cast<double>(ui(rng)) : u(rng));
  return x;
}

// The reference output of `fn` over the broadcast inputs: element by element, in double.
kg::Tensor reference(DType out_dtype, const std::vector<kg::Tensor>& ins,
                     const std::function<double(const std::vector<double>&)>& fn) {
  std::vector<std::vector<std::int64_t>> shapes;
  for (const auto& t : ins) shapes.push_back(t.shape());
  const auto out = broadcast(shapes);
  kg::Tensor y = kg::Tensor::empty(out_dtype, out);
  std::vector<double> v(ins.size());
  for (std::int64_t i = 0; i < y.numel(); ++i) {
    for (std::size_t j = 0; j < ins.size(); ++j) v[j] = ins[j].item(source_index(i, out, ins[j].shape()));
    store(y, i, fn(v));
  }
  return y;
}

// Every element of `got` against `fn` of the broadcast inputs (in double): both NaN, or within
// atol + rtol * |want|.
::testing::AssertionResult matches_ref(const kg::Tensor& got, const std::vector<kg::Tensor>& ins,
                                       const std::function<double(const std::vector<double>&)>& fn,
                                       double rtol, double atol) {
  std::vector<std::vector<std::int64_t>> shapes;
  for (const auto& t : ins) shapes.push_back(t.shape());
  const auto out = broadcast(shapes);
  if (got.shape() != out)
    return ::testing::AssertionFailure()
           << "shape " << kg::sizes_to_string(got.shape()) << ", expected " << kg::sizes_to_string(out);
  std::vector<double> v(ins.size());
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    for (std::size_t j = 0; j < ins.size(); ++j) v[j] = ins[j].item(source_index(i, out, ins[j].shape()));
    const double w = fn(v), g = got.item(i);
    if (std::isnan(w) && std::isnan(g)) continue;
    if (!(std::abs(g - w) <= atol + rtol * std::abs(w)) && !(g == w)) {
      auto f = ::testing::AssertionFailure();
      f << "element " << i << ": got " << g << ", expected " << w << " for inputs";
      for (double x : v) f << " " << x;
      return f;
    }
  }
  return ::testing::AssertionSuccess();
}

// The same for integer (and bool) outputs, exactly, with the inputs read exactly as integers.
::testing::AssertionResult matches_int(
    const kg::Tensor& got, const std::vector<kg::Tensor>& ins,
    const std::function<std::int64_t(const std::vector<std::int64_t>&)>& fn) {
  std::vector<std::vector<std::int64_t>> shapes;
  for (const auto& t : ins) shapes.push_back(t.shape());
  const auto out = broadcast(shapes);
  if (got.shape() != out)
    return ::testing::AssertionFailure()
           << "shape " << kg::sizes_to_string(got.shape()) << ", expected " << kg::sizes_to_string(out);
  std::vector<std::int64_t> v(ins.size());
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    for (std::size_t j = 0; j < ins.size(); ++j) v[j] = int_at(ins[j], source_index(i, out, ins[j].shape()));
    const std::int64_t w = fn(v), g = int_at(got, i);
    if (g != w) {
      auto f = ::testing::AssertionFailure();
      f << "element " << i << ": got " << g << ", expected " << w << " for inputs";
      for (auto x : v) f << " " << x;
      return f;
    }
  }
  return ::testing::AssertionSuccess();
}

// The op recorded on inputs of the given tensors' shapes (static) and run on the CPU through the
// runtime (lowered and launch-checked at load like any model; poisoned buffers).
kg::Tensor run_pw(PointwiseFn fn, const std::vector<kg::Tensor>& ins, const std::vector<double>& attrs = {}) {
  return kg_test::run_graph(
      [&](const std::vector<kg::SymTensor>& xs) {
        return std::vector<kg::SymTensor>{kg::ops::pointwise(fn, xs, attrs, "op")};
      },
      ins, {}, false, false)[0];
}

kg::Tensor run_cast(const kg::Tensor& x, DType to) {
  return kg_test::run_graph(
      [&](const std::vector<kg::SymTensor>& xs) {
        return std::vector<kg::SymTensor>{kg::ops::cast(xs[0], to, "c")};
      },
      {x}, {}, false, false)[0];
}

const DType kInts[] = {DType::I8, DType::I16, DType::I32, DType::I64, DType::U8};
const DType kFloats[] = {DType::F32, DType::F64};
const DType kAll[] = {DType::Bool, DType::I8,  DType::I16,  DType::I32, DType::I64,
                      DType::U8,   DType::F16, DType::BF16, DType::F32, DType::F64};

double rtol_of(DType t) { return t == DType::F32 ? 2e-6 : 1e-13; }
double atol_of(DType t) { return t == DType::F32 ? 1e-6 : 1e-14; }

// ---- references of the functions, in double ----

double ref_softplus(double x) { return x > 30 ? x : std::log(1 + std::exp(x)); }

struct UnaryCase {
  PointwiseFn fn;
  double lo, hi;  // input domain
  std::vector<double> attrs;
  std::function<double(double)> ref;
};

std::vector<UnaryCase> float_unary_cases() {
  const double alpha = 0.7, beta = 0.3;
  return {
      {F::Neg, -4, 4, {}, [](double x) { return -x; }},
      {F::Abs, -4, 4, {}, [](double x) { return std::fabs(x); }},
      {F::Exp, -5, 5, {}, [](double x) { return std::exp(x); }},
      {F::Log, 0.05, 5, {}, [](double x) { return std::log(x); }},
      {F::Sqrt, 0, 5, {}, [](double x) { return std::sqrt(x); }},
      {F::Reciprocal, 0.2, 3, {}, [](double x) { return 1 / x; }},
      {F::Erf, -3, 3, {}, [](double x) { return std::erf(x); }},
      {F::Sin, -4, 4, {}, [](double x) { return std::sin(x); }},
      {F::Cos, -4, 4, {}, [](double x) { return std::cos(x); }},
      {F::Tan, -1.2, 1.2, {}, [](double x) { return std::tan(x); }},
      {F::Asin, -0.95, 0.95, {}, [](double x) { return std::asin(x); }},
      {F::Acos, -0.95, 0.95, {}, [](double x) { return std::acos(x); }},
      {F::Atan, -4, 4, {}, [](double x) { return std::atan(x); }},
      {F::Sinh, -4, 4, {}, [](double x) { return std::sinh(x); }},
      {F::Cosh, -4, 4, {}, [](double x) { return std::cosh(x); }},
      {F::Asinh, -4, 4, {}, [](double x) { return std::asinh(x); }},
      {F::Acosh, 1.05, 5, {}, [](double x) { return std::acosh(x); }},
      {F::Atanh, -0.9, 0.9, {}, [](double x) { return std::atanh(x); }},
      {F::Floor, -4, 4, {}, [](double x) { return std::floor(x); }},
      {F::Ceil, -4, 4, {}, [](double x) { return std::ceil(x); }},
      {F::Round, -4, 4, {}, [](double x) { return std::nearbyint(x); }},
      {F::Sign, -4, 4, {}, [](double x) { return x > 0   ? 1.0
                                                 : x < 0 ? -1.0
                                                         : 0.0; }},
      {F::IsNaN, -4, 4, {}, [](double x) { return std::isnan(x) ? 1.0 : 0.0; }},
      {F::IsInf, -4, 4, {}, [](double x) { return std::isinf(x) ? 1.0 : 0.0; }},
      {F::Relu, -4, 4, {}, [](double x) { return std::max(0.0, x); }},
      {F::Sigmoid, -20, 20, {}, [](double x) { return 1 / (1 + std::exp(-x)); }},
      {F::Tanh, -4, 4, {}, [](double x) { return std::tanh(x); }},
      {F::Softplus, -40, 40, {}, ref_softplus},
      {F::Softsign, -4, 4, {}, [](double x) { return x / (1 + std::fabs(x)); }},
      {F::Elu, -4, 4, {alpha}, [=](double x) { return x >= 0 ? x : alpha * (std::exp(x) - 1); }},
      {F::Selu,
       -4,
       4,
       {1.67326, 1.0507},
       [](double x) { return x > 0 ? 1.0507 * x : 1.0507 * (1.67326 * std::exp(x) - 1.67326); }},
      {F::Celu,
       -4,
       4,
       {1.3},
       [](double x) { return std::max(0.0, x) + std::min(0.0, 1.3 * (std::exp(x / 1.3) - 1)); }},
      {F::LeakyRelu, -4, 4, {0.1}, [](double x) { return x < 0 ? 0.1 * x : x; }},
      {F::HardSigmoid,
       -8,
       8,
       {alpha, beta},
       [=](double x) { return std::max(0.0, std::min(1.0, alpha * x + beta)); }},
      {F::HardSwish, -5, 5, {}, [](double x) { return x * std::max(0.0, std::min(1.0, x / 6 + 0.5)); }},
      {F::ThresholdedRelu, -2, 2, {0.4}, [](double x) { return x > 0.4 ? x : 0.0; }},
      {F::Mish, -10, 10, {}, [](double x) { return x * std::tanh(ref_softplus(x)); }},
      {F::Clip, -2, 2, {-0.5, 0.8}, [](double x) { return std::min(0.8, std::max(-0.5, x)); }},
      {F::Clip, -2, 2, {-kInf, 0.3}, [](double x) { return std::min(0.3, x); }},
      {F::Identity, -4, 4, {}, [](double x) { return x; }},
  };
}

double py_mod(double a, double b) { return a - b * std::floor(a / b); }

std::int64_t int_pow(std::int64_t base, std::int64_t e) {
  if (e < 0) return base == 1 ? 1 : base == -1 ? (e % 2 == 0 ? 1 : -1) : 0;
  std::uint64_t r = 1;
  for (std::int64_t k = 0; k < e; ++k) r *= static_cast<std::uint64_t>(base);
  return static_cast<std::int64_t>(r);
}

// Integer references: `t` is the dtype results wrap into.
std::function<std::int64_t(const std::vector<std::int64_t>&)> int_binary_ref(PointwiseFn fn, DType t) {
  return [fn, t](const std::vector<std::int64_t>& v) -> std::int64_t {
    const std::int64_t a = v[0], b = v[1];
    auto w = [&](std::int64_t x) { return wrap_to(t, x); };
    switch (fn) {
      case F::Add:
        return w(a + b);
      case F::Sub:
        return w(a - b);
      case F::Mul:
        return w(static_cast<std::int64_t>(static_cast<std::uint64_t>(a) * static_cast<std::uint64_t>(b)));
      case F::Div:
        return b == 0 ? 0
                      : w(static_cast<std::int64_t>(
                            std::trunc(static_cast<double>(a) / static_cast<double>(b))));
      case F::Mod:
        return b == 0 ? 0
                      : w(static_cast<std::int64_t>(py_mod(static_cast<double>(a), static_cast<double>(b))));
      case F::FMod:
        return b == 0
                   ? 0
                   : w(static_cast<std::int64_t>(std::fmod(static_cast<double>(a), static_cast<double>(b))));
      case F::Pow:
        return w(int_pow(a, b));
      case F::Max:
        return std::max(a, b);
      case F::Min:
        return std::min(a, b);
      case F::PRelu:
        return a < 0 ? w(a * b) : a;
      case F::Equal:
        return a == b;
      case F::Less:
        return a < b;
      case F::LessOrEqual:
        return a <= b;
      case F::Greater:
        return a > b;
      case F::GreaterOrEqual:
        return a >= b;
      case F::BitwiseAnd:
        return w(a & b);
      case F::BitwiseOr:
        return w(a | b);
      case F::BitwiseXor:
        return w(a ^ b);
      default:
        ADD_FAILURE() << "no integer reference for " << kg::ops::pointwise_name(fn);
        return 0;
    }
  };
}

std::function<double(const std::vector<double>&)> float_binary_ref(PointwiseFn fn) {
  return [fn](const std::vector<double>& v) -> double {
    const double a = v[0], b = v[1];
    switch (fn) {
      case F::Add:
        return a + b;
      case F::Sub:
        return a - b;
      case F::Mul:
        return a * b;
      case F::Div:
        return a / b;
      case F::Pow:
        return std::pow(a, b);
      case F::Max:
        return std::isnan(a) || std::isnan(b) ? kNaN : std::max(a, b);
      case F::Min:
        return std::isnan(a) || std::isnan(b) ? kNaN : std::min(a, b);
      case F::Mod:
        return py_mod(a, b);
      case F::FMod:
        return std::fmod(a, b);
      case F::PRelu:
        return a < 0 ? a * b : a;
      case F::Equal:
        return a == b;
      case F::Less:
        return a < b;
      case F::LessOrEqual:
        return a <= b;
      case F::Greater:
        return a > b;
      case F::GreaterOrEqual:
        return a >= b;
      default:
        ADD_FAILURE() << "no float reference for " << kg::ops::pointwise_name(fn);
        return 0;
    }
  };
}

// The nearest f16 / bf16 value of x, ties to even, by scaling (independent of the bit-level
// conversions): mantissa bits `man`, smallest normal exponent `emin`, largest finite `max`.
double round_small(double x, int man, int emin, double max) {
  if (std::isnan(x) || std::isinf(x) || x == 0) return x;
  int e = std::ilogb(x);
  if (e < emin) e = emin;
  const double ulp = std::ldexp(1.0, e - man);
  const double r = std::nearbyint(x / ulp) * ulp;
  const double overflow =
      max + std::ldexp(1.0, std::ilogb(max) - man - 1);  // halfway to the next binade step
  if (std::fabs(r) >= overflow || std::fabs(x) >= overflow) return std::copysign(kInf, x);
  return r;
}
double round_f16(double x) { return round_small(x, 10, -14, 65504.0); }
double round_bf16(double x) { return round_small(x, 7, -126, 3.38953138925153547590e38); }

// What Cast gives for source value s (exactly representable, small) into `to`.
double ref_cast(double s, DType to) {
  switch (to) {
    case DType::Bool:
      return s != 0;
    case DType::F16:
      return round_f16(s);
    case DType::BF16:
      return round_bf16(s);
    case DType::F32:
      return static_cast<float>(s);
    case DType::F64:
      return s;
    default:
      return static_cast<double>(wrap_to(to, static_cast<std::int64_t>(std::trunc(s))));
  }
}

std::string shape_of(const std::function<kg::SymTensor(std::shared_ptr<kg::Graph>&)>& build) {
  auto g = kg::Graph::create();
  return build(g).shape().to_string();
}

}  // namespace

// ---- names and attributes ----

TEST(Pointwise, NamesAndAttributes) {
  EXPECT_STREQ(kg::ops::pointwise_name(F::Exp), "pw.exp");
  EXPECT_STREQ(kg::ops::pointwise_name(F::Where), "pw.where");
  EXPECT_STREQ(kg::ops::pointwise_name(F::LessOrEqual), "pw.less_or_equal");
  EXPECT_STREQ(kg::ops::pointwise_name(F::IsNaN), "pw.is_nan");
  EXPECT_EQ(kg::ops::pointwise_arity(F::Neg), 1);
  EXPECT_EQ(kg::ops::pointwise_arity(F::BitwiseXor), 2);
  EXPECT_EQ(kg::ops::pointwise_arity(F::Where), 3);
  auto [x, g] = kg::SymTensor::input(DType::F32, {kg::Dim::named("batch"), 3});
  auto y = kg::ops::pointwise(F::HardSigmoid, {x}, {0.2, 0.5}, "hs");
  EXPECT_EQ(g->node(y.node()).op_name(), "pw.hard_sigmoid");
  EXPECT_EQ(kg::ops::pointwise_op(F::HardSigmoid, {0.2, 0.5})->attributes(), "alpha=0.2 beta=0.5");
  EXPECT_EQ(kg::ops::pointwise_op(F::Clip, {-kInf, 6})->attributes(), "min=-inf max=6");
  EXPECT_EQ(kg::ops::pointwise_op(F::Exp)->attributes(), "");
  EXPECT_EQ(kg::ops::cast_op(DType::F16).name(), "pw.cast");
  EXPECT_EQ(kg::ops::cast_op(DType::F16)->attributes(), "to=f16");
}

// ---- unary functions ----

TEST(Pointwise, FloatUnaryFunctionsMatchStd) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const UnaryCase& c : float_unary_cases())
    for (DType t : kFloats) {
      SCOPED_TRACE(std::string(kg::ops::pointwise_name(c.fn)) + " " + std::string(kg::dtype_name(t)));
      kg::Tensor x = random_of(rng, t, {3, 37}, c.lo, c.hi);
      kg::Tensor y = run_pw(c.fn, {x}, c.attrs);
      const bool to_bool = c.fn == F::IsNaN || c.fn == F::IsInf;
      EXPECT_EQ(y.dtype(), to_bool ? DType::Bool : t);
      EXPECT_TRUE(matches_ref(
          y, {x}, [&](const std::vector<double>& v) { return c.ref(v[0]); }, rtol_of(t), atol_of(t)));
    }
}

TEST(Pointwise, SpecialFloatValues) {
  const double big = 1e30;
  kg::Tensor x = tensor_of(DType::F32, {8}, {kNaN, kInf, -kInf, 0.0, -0.0, big, -big, 1e-30});
  kg::Tensor nan = run_pw(F::IsNaN, {x}), inf = run_pw(F::IsInf, {x});
  const std::vector<std::int64_t> want_nan = {1, 0, 0, 0, 0, 0, 0, 0}, want_inf = {0, 1, 1, 0, 0, 0, 0, 0};
  for (std::int64_t i = 0; i < 8; ++i) {
    EXPECT_EQ(int_at(nan, i), want_nan[static_cast<std::size_t>(i)]) << i;
    EXPECT_EQ(int_at(inf, i), want_inf[static_cast<std::size_t>(i)]) << i;
  }
  // Stable forms: no overflow at the ends of the range.
  kg::Tensor e = tensor_of(DType::F32, {4}, {-200, -90, 90, 200});
  EXPECT_TRUE(matches_ref(
      run_pw(F::Softplus, {e}), {e}, [](auto& v) { return ref_softplus(v[0]); }, 1e-6, 1e-30));
  EXPECT_TRUE(matches_ref(
      run_pw(F::Sigmoid, {e}), {e}, [](auto& v) { return 1 / (1 + std::exp(-v[0])); }, 1e-6, 1e-38));
  EXPECT_TRUE(matches_ref(
      run_pw(F::Mish, {e}), {e}, [](auto& v) { return v[0] * std::tanh(ref_softplus(v[0])); }, 1e-6, 1e-30));
  // Sign keeps NaN and gives 0 for both zeros.
  kg::Tensor s = run_pw(F::Sign, {x});
  EXPECT_TRUE(std::isnan(s.item(0)));
  EXPECT_EQ(s.item(1), 1);
  EXPECT_EQ(s.item(2), -1);
  EXPECT_EQ(s.item(3), 0);
  EXPECT_EQ(s.item(4), 0);
  // Clip with both sides open is the identity, NaN included.
  kg::Tensor open = run_pw(F::Clip, {x}, {-kInf, kInf});
  EXPECT_TRUE(std::isnan(open.item(0)));
  for (std::int64_t i = 1; i < 8; ++i) EXPECT_EQ(open.item(i), x.item(i)) << i;
}

TEST(Pointwise, RoundIsHalfToEven) {
  for (DType t : kFloats) {
    kg::Tensor x =
        tensor_of(t, {12}, {0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 0.49999997, 2.4, 2.6, -2.6, 1e7 + 0.5});
    kg::Tensor y = run_pw(F::Round, {x});
    const std::vector<double> want = {0, 2, 2, 4, -0.0, -2, -2, 0, 2, 3, -3, 1e7};
    for (std::int64_t i = 0; i < 12; ++i) EXPECT_EQ(y.item(i), want[static_cast<std::size_t>(i)]) << i;
    EXPECT_TRUE(std::signbit(y.item(4)));
    kg::Tensor f = run_pw(F::Floor, {x}), c = run_pw(F::Ceil, {x});
    EXPECT_EQ(f.item(5), -2);
    EXPECT_EQ(c.item(5), -1);
  }
}

TEST(Pointwise, NumericUnaryFunctionsOnIntegers) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (DType t : kInts) {
    SCOPED_TRACE(std::string(kg::dtype_name(t)));
    kg::Tensor x = random_of(rng, t, {5, 13}, t == DType::U8 ? 0 : -100, 100);
    auto w = [t](std::int64_t v) { return wrap_to(t, v); };
    EXPECT_TRUE(matches_int(run_pw(F::Neg, {x}), {x}, [&](auto& v) { return w(-v[0]); }));
    EXPECT_TRUE(matches_int(run_pw(F::Abs, {x}), {x}, [&](auto& v) { return w(std::abs(v[0])); }));
    EXPECT_TRUE(matches_int(run_pw(F::Sign, {x}), {x}, [&](auto& v) {
      return w(v[0] > 0 ? 1 : v[0] < 0 ? -1 : 0);
    }));
    EXPECT_TRUE(
        matches_int(run_pw(F::Relu, {x}), {x}, [&](auto& v) { return std::max<std::int64_t>(v[0], 0); }));
    EXPECT_TRUE(matches_int(run_pw(F::Identity, {x}), {x}, [&](auto& v) { return v[0]; }));
    // Clip: ceil(min) and floor(max); an open side is the dtype's end.
    EXPECT_TRUE(matches_int(run_pw(F::Clip, {x}, {-20.5, 30.5}), {x}, [&](auto& v) {
      return std::min<std::int64_t>(30, std::max<std::int64_t>(-20, v[0]));
    }));
    EXPECT_TRUE(matches_int(run_pw(F::Clip, {x}, {-kInf, 7}), {x},
                            [&](auto& v) { return std::min<std::int64_t>(7, v[0]); }));
    EXPECT_TRUE(matches_int(run_pw(F::Clip, {x}, {5, 1e30}), {x},
                            [&](auto& v) { return std::max<std::int64_t>(5, v[0]); }));
  }
  // The ends wrap: -(-128) and |-128| are -128 in i8.
  kg::Tensor m = tensor_of(DType::I8, {3}, {-128, 127, -1});
  EXPECT_TRUE(matches_int(run_pw(F::Neg, {m}), {m}, [](auto& v) { return wrap_to(DType::I8, -v[0]); }));
  EXPECT_EQ(int_at(run_pw(F::Abs, {m}), 0), -128);
  const std::int64_t lo = std::numeric_limits<std::int64_t>::min();
  kg::Tensor l = kg::Tensor::from_vector<std::int64_t>({2}, {lo, lo + 1});
  kg::Tensor nl = run_pw(F::Neg, {l});
  EXPECT_EQ(int_at(nl, 0), lo);
  EXPECT_EQ(int_at(nl, 1), -(lo + 1));
}

TEST(Pointwise, NotAndIdentityOnBool) {
  kg::Tensor b = kg::Tensor::empty(DType::Bool, {4});
  const std::uint8_t bytes[4] = {0, 1, 2, 255};  // any nonzero byte is true
  std::memcpy(b.raw(), bytes, 4);
  kg::Tensor n = run_pw(F::Not, {b}), id = run_pw(F::Identity, {b});
  EXPECT_EQ(n.dtype(), DType::Bool);
  const std::uint8_t* np = static_cast<const std::uint8_t*>(n.raw());
  const std::uint8_t* ip = static_cast<const std::uint8_t*>(id.raw());
  EXPECT_EQ(np[0], 1);
  EXPECT_EQ(ip[0], 0);
  for (int i = 1; i < 4; ++i) {
    EXPECT_EQ(np[i], 0) << i;
    EXPECT_EQ(ip[i], 1) << i;  // written as 0 or 1
  }
}

// ---- binary functions ----

TEST(Pointwise, FloatBinaryFunctionsBroadcast) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const PointwiseFn fns[] = {F::Add,   F::Sub,  F::Mul,         F::Div,     F::Pow,
                             F::Max,   F::Min,  F::Mod,         F::FMod,    F::PRelu,
                             F::Equal, F::Less, F::LessOrEqual, F::Greater, F::GreaterOrEqual};
  std::bernoulli_distribution coin(0.5);
  for (DType t : kFloats)
    for (PointwiseFn fn : fns) {
      SCOPED_TRACE(std::string(kg::ops::pointwise_name(fn)) + " " + std::string(kg::dtype_name(t)));
      // [3, 1, 5] with [4, 1] -> [3, 4, 5]; a positive base for pow, divisors away from 0.
      kg::Tensor a = random_of(rng, t, {3, 1, 5}, fn == F::Pow ? 0.1 : -10, fn == F::Pow ? 3 : 10);
      kg::Tensor b = random_of(rng, t, {4, 1}, 0.5, 3);
      if (fn != F::Pow)
        for (std::int64_t i = 0; i < b.numel(); ++i)
          if (coin(rng)) store(b, i, -b.item(i));
      if (fn == F::Pow)
        for (std::int64_t i = 0; i < b.numel(); ++i) store(b, i, b.item(i) - 1.5);
      if (fn == F::Equal || fn == F::LessOrEqual || fn == F::GreaterOrEqual)
        store(a, 0, b.item(0));  // one equal pair
      kg::Tensor y = run_pw(fn, {a, b});
      const bool cmp = fn >= F::Equal;
      EXPECT_EQ(y.dtype(), cmp ? DType::Bool : t);
      EXPECT_TRUE(
          matches_ref(y, {a, b}, float_binary_ref(fn), rtol_of(t) * 5, fn == F::Mod ? 1e-5 : atol_of(t)));
    }
}

TEST(Pointwise, MaxMinPropagateNaN) {
  for (DType t : kFloats) {
    kg::Tensor a = tensor_of(t, {4}, {kNaN, 1, kNaN, -kInf});
    kg::Tensor b = tensor_of(t, {4}, {2, kNaN, kNaN, 3});
    for (PointwiseFn fn : {F::Max, F::Min}) {
      kg::Tensor y = run_pw(fn, {a, b});
      EXPECT_TRUE(std::isnan(y.item(0)) && std::isnan(y.item(1)) && std::isnan(y.item(2)))
          << kg::ops::pointwise_name(fn) << " " << y.item(0) << " " << y.item(1) << " " << y.item(2);
      EXPECT_EQ(y.item(3), fn == F::Max ? 3 : -kInf);
    }
    // Comparisons with NaN are false (Equal too).
    for (PointwiseFn fn : {F::Equal, F::Less, F::LessOrEqual, F::Greater, F::GreaterOrEqual})
      EXPECT_EQ(int_at(run_pw(fn, {a, b}), 0), 0) << kg::ops::pointwise_name(fn);
  }
}

TEST(Pointwise, IntegerBinaryFunctions) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const PointwiseFn fns[] = {F::Add,        F::Sub,       F::Mul,         F::Div,     F::Mod,
                             F::FMod,       F::Pow,       F::Max,         F::Min,     F::PRelu,
                             F::Equal,      F::Less,      F::LessOrEqual, F::Greater, F::GreaterOrEqual,
                             F::BitwiseAnd, F::BitwiseOr, F::BitwiseXor};
  for (DType t : kInts)
    for (PointwiseFn fn : fns) {
      SCOPED_TRACE(std::string(kg::ops::pointwise_name(fn)) + " " + std::string(kg::dtype_name(t)));
      const bool u = t == DType::U8;
      // Negative operands and divisors 0 and -1 included; small exponents (negative ones too).
      kg::Tensor a = random_of(rng, t, {3, 1, 5}, u ? 0 : -120, u ? 250 : 120);
      kg::Tensor b =
          fn == F::Pow ? random_of(rng, t, {4, 1}, u ? 0 : -2, 6) : random_of(rng, t, {4, 1}, u ? 0 : -7, 7);
      store(b, 0, 0);
      if (!u) store(b, 1, -1);
      kg::Tensor y = run_pw(fn, {a, b});
      EXPECT_EQ(y.dtype(), fn >= F::Equal && fn <= F::GreaterOrEqual ? DType::Bool : t);
      EXPECT_TRUE(matches_int(y, {a, b}, int_binary_ref(fn, t)));
    }
}

TEST(Pointwise, IntegerDivisionCornerCases) {
  // Truncation toward zero (Div), the divisor's sign (Mod), the dividend's sign (FMod).
  kg::Tensor a = kg::Tensor::from_vector<std::int32_t>({8}, {7, -7, 7, -7, 6, -6, 5, 0});
  kg::Tensor b = kg::Tensor::from_vector<std::int32_t>({8}, {2, 2, -2, -2, 3, -3, 0, 0});
  auto vals = [](const kg::Tensor& t) {
    std::vector<std::int64_t> v;
    for (std::int64_t i = 0; i < t.numel(); ++i) v.push_back(int_at(t, i));
    return v;
  };
  EXPECT_EQ(vals(run_pw(F::Div, {a, b})), (std::vector<std::int64_t>{3, -3, -3, 3, 2, 2, 0, 0}));
  EXPECT_EQ(vals(run_pw(F::Mod, {a, b})), (std::vector<std::int64_t>{1, 1, -1, -1, 0, 0, 0, 0}));
  EXPECT_EQ(vals(run_pw(F::FMod, {a, b})), (std::vector<std::int64_t>{1, -1, 1, -1, 0, 0, 0, 0}));
  // The floats agree on the signs.
  kg::Tensor af = a.to(DType::F32), bf = b.to(DType::F32);
  kg::Tensor mf = run_pw(F::Mod, {af, bf}), ff = run_pw(F::FMod, {af, bf});
  for (std::int64_t i = 0; i < 6; ++i) {
    EXPECT_EQ(mf.item(i), static_cast<double>(vals(run_pw(F::Mod, {a, b}))[static_cast<std::size_t>(i)]))
        << i;
    EXPECT_EQ(ff.item(i), static_cast<double>(vals(run_pw(F::FMod, {a, b}))[static_cast<std::size_t>(i)]))
        << i;
  }
  EXPECT_EQ(run_pw(F::Mod, {tensor_of(DType::F64, {1}, {-1.25}), tensor_of(DType::F64, {1}, {0.5})}).item(0),
            0.25);
  EXPECT_EQ(run_pw(F::FMod, {tensor_of(DType::F64, {1}, {-1.25}), tensor_of(DType::F64, {1}, {0.5})}).item(0),
            -0.25);
  // MIN / -1 and MIN % -1 wrap instead of trapping.
  const std::int64_t lo = std::numeric_limits<std::int64_t>::min();
  kg::Tensor l = kg::Tensor::from_vector<std::int64_t>({2}, {lo, lo});
  kg::Tensor m1 = kg::Tensor::from_vector<std::int64_t>({2}, {-1, 0});
  EXPECT_EQ(vals(run_pw(F::Div, {l, m1})), (std::vector<std::int64_t>{lo, 0}));
  EXPECT_EQ(vals(run_pw(F::Mod, {l, m1})), (std::vector<std::int64_t>{0, 0}));
  EXPECT_EQ(vals(run_pw(F::FMod, {l, m1})), (std::vector<std::int64_t>{0, 0}));
  kg::Tensor i8 = tensor_of(DType::I8, {3}, {-128, 127, 16});
  kg::Tensor j8 = tensor_of(DType::I8, {3}, {-1, 1, 16});
  EXPECT_EQ(vals(run_pw(F::Div, {i8, j8})), (std::vector<std::int64_t>{-128, 127, 1}));
  EXPECT_EQ(vals(run_pw(F::Add, {i8, j8})), (std::vector<std::int64_t>{127, -128, 32}));
  EXPECT_EQ(vals(run_pw(F::Mul, {i8, j8})), (std::vector<std::int64_t>{-128, 127, 0}));
  // Pow: repeated multiplication; a negative exponent gives 0 except for bases 1 and -1.
  kg::Tensor base = kg::Tensor::from_vector<std::int64_t>({7}, {2, 3, -2, 1, -1, -1, 2});
  kg::Tensor ex = kg::Tensor::from_vector<std::int64_t>({7}, {10, 40, 3, -5, -3, -4, -1});
  EXPECT_EQ(vals(run_pw(F::Pow, {base, ex})),
            (std::vector<std::int64_t>{1024, int_pow(3, 40), -8, 1, -1, 1, 0}));
}

TEST(Pointwise, LogicalAndBitwise) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  kg::Tensor a = kg::Tensor::empty(DType::Bool, {3, 1, 4}), b = kg::Tensor::empty(DType::Bool, {5, 1});
  std::uniform_int_distribution<int> byte(0, 3);  // 2 and 3 are true as well
  for (kg::Tensor* t : {&a, &b})
    for (std::int64_t i = 0; i < t->numel(); ++i)
      static_cast<std::uint8_t*>(t->raw())[i] = static_cast<std::uint8_t>(byte(rng));
  EXPECT_TRUE(matches_int(run_pw(F::And, {a, b}), {a, b}, [](auto& v) { return v[0] && v[1]; }));
  EXPECT_TRUE(matches_int(run_pw(F::Or, {a, b}), {a, b}, [](auto& v) { return v[0] || v[1]; }));
  EXPECT_TRUE(matches_int(run_pw(F::Xor, {a, b}), {a, b}, [](auto& v) { return v[0] != v[1]; }));
  EXPECT_TRUE(matches_int(run_pw(F::Equal, {a, b}), {a, b}, [](auto& v) { return v[0] == v[1]; }));
  for (DType t : {DType::I32, DType::I64, DType::U8}) {
    kg::Tensor x = random_of(rng, t, {6, 7}, t == DType::U8 ? 0 : -1e9, t == DType::U8 ? 255 : 1e9);
    kg::Tensor y = random_of(rng, t, {7}, t == DType::U8 ? 0 : -1e9, t == DType::U8 ? 255 : 1e9);
    for (PointwiseFn fn : {F::BitwiseAnd, F::BitwiseOr, F::BitwiseXor})
      EXPECT_TRUE(matches_int(run_pw(fn, {x, y}), {x, y}, int_binary_ref(fn, t)))
          << kg::ops::pointwise_name(fn) << " " << kg::dtype_name(t);
  }
}

// ---- Where ----

TEST(Pointwise, WhereBroadcasts) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  kg::Tensor c = random_of(rng, DType::Bool, {3, 1}, 0, 1);
  store(c, 0, 1);
  store(c, 1, 0);
  for (DType t : {DType::F32, DType::I64, DType::Bool, DType::U8}) {
    SCOPED_TRACE(std::string(kg::dtype_name(t)));
    kg::Tensor x = random_of(rng, t, {1, 4}, 0, 50);
    kg::Tensor y = random_of(rng, t, {}, 0, 50);  // a scalar
    kg::Tensor out = run_pw(F::Where, {c, x, y});
    EXPECT_EQ(out.dtype(), t);
    EXPECT_EQ(out.shape(), (std::vector<std::int64_t>{3, 4}));
    EXPECT_TRUE(matches_ref(
        out, {c, x, y}, [](auto& v) { return v[0] != 0 ? v[1] : v[2]; }, 0, 0));
  }
  // All three broadcast: [2, 1, 1], [1, 3, 1], [1, 1, 4] -> [2, 3, 4].
  kg::Tensor c3 = random_of(rng, DType::Bool, {2, 1, 1}, 0, 1);
  store(c3, 0, 1);
  store(c3, 1, 0);
  kg::Tensor x3 = random_of(rng, DType::F64, {1, 3, 1}, -1, 1), y3 = random_of(rng, DType::F64, {4}, -1, 1);
  EXPECT_TRUE(matches_ref(
      run_pw(F::Where, {c3, x3, y3}), {c3, x3, y3}, [](auto& v) { return v[0] != 0 ? v[1] : v[2]; }, 0, 0));
}

// ---- broadcasting and shapes ----

TEST(Pointwise, BroadcastingShapes) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>>> cases = {
      {{3, 1, 5}, {4, 1}},
      {{}, {2, 3}},
      {{2, 3}, {}},
      {{}, {}},
      {{2, 3, 4}, {2, 3, 4}},
      {{1, 1, 7}, {6, 1, 1}},
      {{5, 1, 3, 1, 2}, {4, 3, 1, 1}},
      {{2, 0, 3}, {3}},
      {{1, 4}, {3, 1}},
      {{2, 1, 2, 1, 2, 1, 2, 1, 2}, {2, 1, 2, 1, 2, 1, 2, 1}}};  // the last: 9 merged dims
  for (const auto& [sa, sb] : cases) {
    SCOPED_TRACE(kg::sizes_to_string(sa) + " with " + kg::sizes_to_string(sb));
    kg::Tensor a = random_of(rng, DType::F32, sa, -1, 1), b = random_of(rng, DType::F32, sb, -1, 1);
    EXPECT_TRUE(matches_ref(
        run_pw(F::Sub, {a, b}), {a, b}, [](auto& v) { return v[0] - v[1]; }, 1e-6, 1e-7));
    kg::Tensor ia = random_of(rng, DType::I16, sa, -50, 50), ib = random_of(rng, DType::I16, sb, -50, 50);
    EXPECT_TRUE(matches_int(run_pw(F::Mul, {ia, ib}), {ia, ib}, int_binary_ref(F::Mul, DType::I16)));
  }
}

TEST(Pointwise, ShapeInferenceWithDynamicDims) {
  const kg::Dim B = kg::Dim::named("batch");
  auto pw = [&](PointwiseFn fn, std::vector<std::pair<DType, kg::Shape>> ins) {
    return shape_of([&](std::shared_ptr<kg::Graph>& g) {
      std::vector<kg::SymTensor> xs;
      for (auto& [t, s] : ins) xs.push_back(g->input(t, s));
      return kg::ops::pointwise(fn, xs);
    });
  };
  EXPECT_EQ(pw(F::Add, {{DType::F32, {B, 1, 5}}, {DType::F32, {4, 1}}}), "[batch, 4, 5]");
  EXPECT_EQ(pw(F::Add, {{DType::F32, {B, 3}}, {DType::F32, {B, 3}}}), "[batch, 3]");
  EXPECT_EQ(pw(F::Add, {{DType::F32, {B, 3}}, {DType::F32, kg::Shape{}}}), "[batch, 3]");
  EXPECT_EQ(pw(F::Add, {{DType::F32, {B}}, {DType::F32, {7}}}), "[7]");  // the dynamic dim must be 1 or 7
  EXPECT_EQ(pw(F::Less, {{DType::I32, {1, B}}, {DType::I32, {3, 1}}}), "[3, batch]");
  EXPECT_EQ(pw(F::Where, {{DType::Bool, {B, 1}}, {DType::F32, {1, 4}}, {DType::F32, kg::Shape{}}}),
            "[batch, 4]");
  EXPECT_EQ(pw(F::Exp, {{DType::F32, {B, kg::dynamic, 2}}}), "[batch, ?, 2]");
  EXPECT_EQ(shape_of([&](auto& g) {
              return kg::ops::cast(g->input(DType::F32, {B, 3}), DType::F16);
            }),
            "[batch, 3]");

  // Loaded at two batch sizes.
  auto g = kg::Graph::create();
  auto x = g->input(DType::F32, {B, 1, 5}, "x");
  auto y = g->input(DType::I32, {4, 1}, "y");
  auto c = g->input(DType::Bool, {B, 1, 1}, "c");
  auto sum = kg::ops::pointwise(F::Add, {x, kg::ops::cast(y, DType::F32, "yf")}, {}, "sum");
  auto out = kg::ops::pointwise(F::Where, {c, sum, x}, {}, "pick");
  kg::Model model(g, {out});
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t batch : {2, 5}) {
    kg::Tensor xv = random_of(rng, DType::F32, {batch, 1, 5}, -1, 1);
    kg::Tensor yv = random_of(rng, DType::I32, {4, 1}, -9, 9);
    kg::Tensor cv = random_of(rng, DType::Bool, {batch, 1, 1}, 0, 1);
    kg::LoadedModel m = model.load(kg::Device::cpu(), {{batch, 1, 5}, {4, 1}, {batch, 1, 1}});
    kg::Tensor got = m.forward({xv, yv, cv}).at(0);
    EXPECT_TRUE(matches_ref(
        got, {cv, xv, yv}, [](auto& v) { return v[0] != 0 ? v[1] + v[2] : v[1]; }, 1e-6, 1e-7));
  }
}

// ---- Cast ----

TEST(Pointwise, CastEveryPair) {
  // Small values every dtype holds exactly (halves for the floats), negative ones too.
  const std::vector<double> floats = {-100.75, -2.5, -1.5, -0.5, -0.0, 0,     0.25,
                                      0.5,     1,    1.5,  2.5,  3.75, 100.5, 127.25};
  const std::vector<double> ints = {-100, -2, -1, 0, 1, 2, 100, 127};
  for (DType from : kAll) {
    const std::vector<double>& vals = from == DType::Bool     ? std::vector<double>{0, 1, 1, 0}
                                      : kg::is_floating(from) ? floats
                                                              : ints;
    kg::Tensor x = tensor_of(from, {static_cast<std::int64_t>(vals.size())}, vals);
    for (DType to : kAll) {
      SCOPED_TRACE(std::string(kg::dtype_name(from)) + " -> " + std::string(kg::dtype_name(to)));
      kg::Tensor y = run_cast(x, to);
      EXPECT_EQ(y.dtype(), to);
      EXPECT_TRUE(matches_ref(
          y, {x}, [&](auto& v) { return ref_cast(v[0], to); }, 0, 0));
    }
  }
}

TEST(Pointwise, CastCornerCases) {
  // Float to integer truncates toward zero; NaN gives 0; integers wrap into narrower ones.
  kg::Tensor f = tensor_of(DType::F32, {6}, {-2.9, 2.9, kNaN, kInf, -kInf, 1e30});
  kg::Tensor i = run_cast(f, DType::I32);
  EXPECT_EQ(int_at(i, 0), -2);
  EXPECT_EQ(int_at(i, 1), 2);
  EXPECT_EQ(int_at(i, 2), 0);
  kg::Tensor l = run_cast(f, DType::I64);
  EXPECT_EQ(int_at(l, 3), std::numeric_limits<std::int64_t>::max());
  EXPECT_EQ(int_at(l, 4), std::numeric_limits<std::int64_t>::min());
  EXPECT_EQ(int_at(run_cast(tensor_of(DType::F64, {1}, {kNaN}), DType::U8), 0), 0);
  kg::Tensor wide = kg::Tensor::from_vector<std::int32_t>({3}, {300, -1, 70000});
  EXPECT_EQ(int_at(run_cast(wide, DType::U8), 0), 44);
  EXPECT_EQ(int_at(run_cast(wide, DType::U8), 1), 255);
  EXPECT_EQ(int_at(run_cast(wide, DType::I16), 2), 70000 - 65536);
  EXPECT_EQ(int_at(run_cast(tensor_of(DType::U8, {1}, {200}), DType::I8), 0), -56);
  // To bool: x != 0 (NaN is true, -0 false).
  kg::Tensor bz = run_cast(tensor_of(DType::F32, {3}, {kNaN, -0.0, 1e-40}), DType::Bool);
  EXPECT_EQ(int_at(bz, 0), 1);
  EXPECT_EQ(int_at(bz, 1), 0);
  EXPECT_EQ(int_at(bz, 2), 1);
  // i64 to f32 rounds once.
  const std::int64_t odd = (std::int64_t{1} << 40) + 1;
  EXPECT_EQ(run_cast(kg::Tensor::from_vector<std::int64_t>({1}, {odd}), DType::F32).item(0),
            static_cast<double>(static_cast<float>(odd)));

  // f32 -> f16 / bf16: ties to even, overflow to infinity, subnormals, NaN.
  const double h = std::ldexp(1.0, -11), s = std::ldexp(1.0, -24);
  const std::vector<double> to16 = {1 + h,   1 + 3 * h, 65504, 65519.99, 65520, -70000, s,   s / 2,
                                    s * 1.5, s * 2.5,   kNaN,  kInf,     -0.0,  1e-10,  0.1, 3.14159};
  for (DType t : kFloats) {
    kg::Tensor x = tensor_of(t, {16}, to16);
    kg::Tensor y = run_cast(x, DType::F16);
    EXPECT_TRUE(matches_ref(
        y, {x}, [](auto& v) { return round_f16(v[0]); }, 0, 0))
        << kg::dtype_name(t);
    EXPECT_TRUE(std::signbit(y.item(12)));
    kg::Tensor b = run_cast(x, DType::BF16);
    EXPECT_TRUE(matches_ref(
        b, {x}, [](auto& v) { return round_bf16(v[0]); }, 0, 0))
        << kg::dtype_name(t);
  }
  const double bh = std::ldexp(1.0, -8);
  kg::Tensor xb = tensor_of(DType::F32, {5}, {1 + bh, 1 + 3 * bh, 3.4e38, -3.4e38, 1e-39});
  EXPECT_TRUE(matches_ref(
      run_cast(xb, DType::BF16), {xb}, [](auto& v) { return round_bf16(v[0]); }, 0, 0));
  // f64 -> f16 rounds the double itself: 1 + 2^-11 + 2^-40 is above the tie (through f32 it would
  // land on the tie and round down to 1).
  kg::Tensor d = tensor_of(DType::F64, {1}, {1 + h + std::ldexp(1.0, -40)});
  EXPECT_EQ(run_cast(d, DType::F16).item(0), 1 + 2 * h);
  EXPECT_EQ(run_cast(d, DType::BF16).item(0), 1.0);
  // The bit patterns agree with the library's f32 conversions.
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  kg::Tensor r = random_of(rng, DType::F32, {200}, -60000, 60000);
  for (std::int64_t k = 0; k < 50; ++k) store(r, k, r.item(k) * 1e-9);  // subnormal range too
  kg::Tensor r16 = run_cast(r, DType::F16), rb = run_cast(r, DType::BF16);
  for (std::int64_t k = 0; k < r.numel(); ++k) {
    const float v = r.data<float>()[k];
    EXPECT_EQ(static_cast<const std::uint16_t*>(r16.raw())[k], kg::util::float_to_half(v)) << v;
    EXPECT_EQ(static_cast<const std::uint16_t*>(rb.raw())[k], kg::util::float_to_bf16(v)) << v;
  }
  // Round trips: f32 -> f16 -> f32 is within half an f16 ulp; f16 -> f32 -> f16 is exact.
  kg::Tensor back = run_cast(r16, DType::F32);
  for (std::int64_t k = 50; k < r.numel(); ++k)
    EXPECT_LE(std::abs(back.item(k) - r.item(k)), std::abs(r.item(k)) * std::ldexp(1.0, -11)) << r.item(k);
  kg::Tensor again = run_cast(run_cast(r16, DType::F32), DType::F16);
  EXPECT_EQ(std::memcmp(again.raw(), r16.raw(), r16.nbytes()), 0);
  kg::Tensor bagain = run_cast(run_cast(rb, DType::F64), DType::BF16);
  EXPECT_EQ(std::memcmp(bagain.raw(), rb.raw(), rb.nbytes()), 0);
  // f16 and bf16 to integers through their value.
  EXPECT_EQ(int_at(run_cast(tensor_of(DType::F16, {1}, {-3.75}), DType::I32), 0), -3);
  EXPECT_EQ(int_at(run_cast(tensor_of(DType::BF16, {1}, {1024}), DType::I16), 0), 1024);
}

// ---- errors ----

TEST(Pointwise, ErrorsNameWhatWasExpected) {
  // Attribute counts and values.
  kg_test::expect_error([] { kg::ops::pointwise_op(F::Elu); }, {"pw.elu takes 1 attribute (alpha), got 0"});
  kg_test::expect_error([] { kg::ops::pointwise_op(F::Exp, {1.0}); }, {"pw.exp takes no attributes, got 1"});
  kg_test::expect_error([] { kg::ops::pointwise_op(F::Clip, {1.0}); },
                        {"pw.clip takes 2 attributes (min, max), got 1"});
  kg_test::expect_error(
      [] {
        kg::ops::pointwise_op(F::Selu, {1, 2, 3});
      },
      {"pw.selu takes 2 attributes (alpha, gamma), got 3"});
  kg_test::expect_error(
      [] {
        kg::ops::pointwise_op(F::Clip, {kNaN, 1});
      },
      {"pw.clip", "min is NaN", "infinity"});
  kg_test::expect_error([] { kg::ops::pointwise_op(F::LeakyRelu, {kInf}); },
                        {"pw.leaky_relu", "alpha", "finite", "inf"});
  kg_test::expect_error([] { kg::ops::pointwise_op(F::Celu, {0.0}); }, {"pw.celu", "alpha must not be 0"});
  kg_test::expect_error([] { kg::ops::pointwise_name(static_cast<PointwiseFn>(999)); },
                        {"unknown pointwise function 999"});

  auto g = kg::Graph::create();
  auto f32 = g->input(DType::F32, {kg::dynamic, 3}, "a");
  auto f32b = g->input(DType::F32, {4}, "b");
  auto i32 = g->input(DType::I32, {kg::dynamic, 3}, "i");
  auto bl = g->input(DType::Bool, {kg::dynamic, 3}, "c");
  auto h = g->input(DType::F16, {3}, "h");
  using V = std::vector<kg::SymTensor>;
  // Input counts.
  kg_test::expect_error([&] { kg::ops::pointwise(F::Add, V{f32}, {}, "e1"); },
                        {"[pw.add @ e1]", "expects 2 input(s), got 1"});
  kg_test::expect_error(
      [&] {
        kg::ops::pointwise(F::Exp, V{f32, f32}, {}, "e2");
      },
      {"[pw.exp @ e2]", "expects 1 input(s), got 2"});
  kg_test::expect_error(
      [&] {
        kg::ops::pointwise(F::Where, V{bl, f32}, {}, "e3");
      },
      {"[pw.where @ e3]", "expects 3 input(s), got 2"});
  kg_test::expect_error([&] { kg::ops::pointwise(F::Neg, V{}, {}, "e4"); },
                        {"[pw.neg @ e4]", "expects 1 input(s), got 0"});
  // Dtypes.
  kg_test::expect_error(
      [&] {
        kg::ops::pointwise(F::Add, V{f32, i32}, {}, "d1");
      },
      {"[pw.add @ d1]", "inputs must share one dtype, got f32 and i32"});
  kg_test::expect_error(
      [&] {
        kg::ops::pointwise(F::Equal, V{i32, bl}, {}, "d2");
      },
      {"[pw.equal @ d2]", "share one dtype, got i32 and bool"});
  kg_test::expect_error(
      [&] {
        kg::ops::pointwise(F::Where, V{f32, f32, f32}, {}, "d3");
      },
      {"[pw.where @ d3]", "condition (input 0) must be bool, got f32"});
  kg_test::expect_error(
      [&] {
        kg::ops::pointwise(F::Where, V{bl, f32, i32}, {}, "d4");
      },
      {"[pw.where @ d4]", "x and y (inputs 1 and 2) must share one dtype, got f32 and i32"});
  kg_test::expect_error([&] { kg::ops::pointwise(F::Exp, V{i32}, {}, "d5"); },
                        {"[pw.exp @ d5]", "takes f32 and f64 inputs only, got i32"});
  kg_test::expect_error([&] { kg::ops::pointwise(F::Round, V{i32}, {}, "d6"); },
                        {"[pw.round @ d6]", "got i32"});
  kg_test::expect_error(
      [&] {
        kg::ops::pointwise(F::And, V{f32, f32}, {}, "d7");
      },
      {"[pw.and @ d7]", "takes bool inputs only, got f32"});
  kg_test::expect_error([&] { kg::ops::pointwise(F::Not, V{i32}, {}, "d8"); },
                        {"[pw.not @ d8]", "bool inputs only, got i32"});
  kg_test::expect_error(
      [&] {
        kg::ops::pointwise(F::BitwiseAnd, V{f32, f32}, {}, "d9");
      },
      {"[pw.bitwise_and @ d9]", "integer inputs only", "got f32"});
  kg_test::expect_error(
      [&] {
        kg::ops::pointwise(F::BitwiseOr, V{bl, bl}, {}, "d10");
      },
      {"[pw.bitwise_or @ d10]", "integer inputs only", "got bool"});
  kg_test::expect_error(
      [&] {
        kg::ops::pointwise(F::Add, V{bl, bl}, {}, "d11");
      },
      {"[pw.add @ d11]", "not bool", "got bool"});
  kg_test::expect_error([&] { kg::ops::pointwise(F::Relu, V{bl}, {}, "d12"); },
                        {"[pw.relu @ d12]", "got bool"});
  kg_test::expect_error(
      [&] {
        kg::ops::pointwise(F::Less, V{bl, bl}, {}, "d13");
      },
      {"[pw.less @ d13]", "got bool"});
  kg_test::expect_error([&] { kg::ops::pointwise(F::Abs, V{h}, {}, "d14"); },
                        {"[pw.abs @ d14]", "does not take f16 inputs", "pw.cast"});
  // Shapes.
  kg_test::expect_error(
      [&] {
        kg::ops::pointwise(F::Add, V{f32, f32b}, {}, "s1");
      },
      {"[pw.add @ s1]", "[?, 3] and [4] do not broadcast (3 vs 4)"});
  auto c2 = g->input(DType::Bool, {5, 1}, "c2");
  auto x2 = g->input(DType::F32, {1, 3}, "x2");
  auto y2 = g->input(DType::F32, {2, 1}, "y2");
  kg_test::expect_error(
      [&] {
        kg::ops::pointwise(F::Where, V{c2, x2, y2}, {}, "s2");
      },
      {"[pw.where @ s2]", "inputs [5, 1], [1, 3] and [2, 1] do not broadcast", "5 vs 2"});
  // A dynamic dim that does not broadcast at load.
  auto g2 = kg::Graph::create();
  auto p = g2->input(DType::F32, {kg::Dim::named("batch"), 3}, "p");
  auto q = g2->input(DType::F32, {4, 3}, "q");
  kg::Model model(g2, {kg::ops::pointwise(F::Mul, V{p, q}, {}, "m")});
  kg_test::expect_error([&] { model.load(kg::Device::cpu(), {{5, 3}, {4, 3}}); }, {"pw.mul", "5 vs 4"});
  EXPECT_NO_THROW(model.load(kg::Device::cpu(), {{1, 3}, {4, 3}}));
}

TEST(Pointwise, LoweringNamesOneEntryPerFunctionAndDtypes) {
  kg::LowerContext ctx;
  ctx.node = "op";
  ctx.input_dtypes = {DType::I32, DType::I32};
  ctx.output_dtype = DType::Bool;
  ctx.input_shapes = {kg::Shape{3, 1}, kg::Shape{4}};
  ctx.output_shape = kg::Shape{3, 4};
  auto l = kg::ops::pointwise_op(F::LessOrEqual)->lower(ctx);
  ASSERT_TRUE(l.has_value());
  EXPECT_EQ(l->entry_point, "kg_pw_less_or_equal_i32");
  EXPECT_EQ(l->name, "pw.less_or_equal");
  EXPECT_NE(l->source.find("kg_pw_less_or_equal_i32(const int* __restrict__ a, const int* __restrict__ b, "
                           "kg_bool* __restrict__ y, KgPwArgs p)"),
            std::string::npos)
      << l->source.substr(l->source.size() - 600);
  EXPECT_NE(l->source.find("return (R)(a <= b);"), std::string::npos);
  kg::LowerContext cc;
  cc.input_dtypes = {DType::Bool};
  cc.output_dtype = DType::BF16;
  cc.input_shapes = {kg::Shape{2}};
  cc.output_shape = kg::Shape{2};
  auto lc = kg::ops::cast_op(DType::BF16)->lower(cc);
  ASSERT_TRUE(lc.has_value());
  EXPECT_EQ(lc->entry_point, "kg_pw_cast_bool_bf16");
  EXPECT_NE(lc->source.find("a = (kg_bool)(a != 0);"), std::string::npos);  // bool read as v != 0
  // A broadcast the kernel cannot walk (9 dims after merging): on the CPU the op runs its
  // cpu_forward instead; for a GPU it is an error naming the numbers.
  kg::LowerContext big;
  big.input_dtypes = {DType::F32, DType::F32};
  big.output_dtype = DType::F32;
  big.concrete_input_shapes = {{2, 1, 2, 1, 2, 1, 2, 1, 2}, {2, 1, 2, 1, 2, 1, 2, 1}};
  big.concrete_output_shape = {2, 2, 2, 2, 2, 2, 2, 2, 2};
  EXPECT_FALSE(kg::ops::pointwise_op(F::Add)->lower(big).has_value());
  big.sm = 90;
  kg_test::expect_error(
      [&] { kg::ops::pointwise_op(F::Add)->lower(big); },
      {"broadcasting [2, 1, 2, 1, 2, 1, 2, 1, 2], [2, 1, 2, 1, 2, 1, 2, 1] to "
       "[2, 2, 2, 2, 2, 2, 2, 2, 2] needs 9 dims after merging; the GPU kernel handles up to 8"});
  big.concrete_input_shapes = {{2, 2, 2, 2, 2, 2, 2, 2, 2},
                               {2, 2, 2, 2, 2, 2, 2, 2, 2}};  // merges to one dim
  EXPECT_TRUE(kg::ops::pointwise_op(F::Add)->lower(big).has_value());
}

TEST(Pointwise, CastTakesOneInput) {
  auto g = kg::Graph::create();
  auto a = g->input(DType::F32, {3}), b = g->input(DType::F32, {3});
  kg_test::expect_error([&] { a.record_custom(kg::ops::cast_op(DType::I8), {b}, std::nullopt, "c"); },
                        {"[pw.cast @ c]", "expects 1 input(s), got 2"});
  EXPECT_EQ(kg::ops::cast(a, DType::F16).dtype(), DType::F16);
}

// ---- the CUDA kernels under the emulator ----

namespace {

kg::testing::CheckOpOptions check_options(std::uint64_t seed, DType out) {
  kg::testing::CheckOpOptions o;
  o.seed = seed;
  o.batch_sizes = {1, 3};
  o.reruns = 1;
  o.rtol = out == DType::F32 ? 1e-5 : 1e-12;
  o.atol = out == DType::F32 ? 1e-6 : 1e-14;
  return o;
}

// A check_op reference: `fn` of the broadcast inputs in double, stored in `out`.
auto ref_of(DType out, std::function<double(const std::vector<double>&)> fn) {
  return [out, fn](const std::vector<kg::Tensor>& in, const std::map<std::string, kg::Tensor>&) {
    return reference(out, in, fn);
  };
}

void expect_check_op(const kg::CustomData& op, const std::vector<kg::Shape>& shapes,
                     const std::vector<DType>& dtypes, const kg::testing::CheckOpOptions& o) {
  const kg::testing::CheckOpReport r = kg::testing::check_op(op, shapes, dtypes, o);
  EXPECT_TRUE(r.ok) << r.to_string();
  EXPECT_EQ(kg_test::count_lines(r, "PASS batch 3, emulator"), 1) << r.to_string();
  EXPECT_EQ(kg_test::count_lines(r, "PASS batch 3, reference"), 1) << r.to_string();
  if (kg::Device::cuda_available()) {
    EXPECT_EQ(kg_test::count_lines(r, "PASS batch 3, gpu"), 1) << r.to_string();
  }
}

}  // namespace

TEST(Pointwise, KernelsUnderEmulationMatchTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Dim B = kg::Dim::named("b");
  {  // unary, every input the output's shape
    auto o = check_options(seed, DType::F32);
    o.reference = ref_of(DType::F32, [](auto& v) { return std::exp(v[0]); });
    expect_check_op(kg::ops::pointwise_op(F::Exp), {{B, 3, 7}}, {DType::F32}, o);
  }
  {  // binary with broadcasting, integers: Python's modulo with negative operands
    auto o = check_options(seed, DType::I32);
    o.make_input = [&](int i, const std::vector<std::int64_t>& shape) {
      return random_of(rng, DType::I32, shape, i == 0 ? -50 : -6, i == 0 ? 50 : 6);
    };
    o.reference = ref_of(DType::I32, [](auto& v) { return v[1] == 0 ? 0.0 : py_mod(v[0], v[1]); });
    expect_check_op(kg::ops::pointwise_op(F::Mod), {{B, 1, 5}, {4, 1}}, {DType::I32, DType::I32}, o);
  }
  {  // a comparison: bool out, one operand a row broadcast over the batch
    auto o = check_options(seed, DType::Bool);
    o.reference = ref_of(DType::Bool, [](auto& v) { return v[0] < v[1]; });
    expect_check_op(kg::ops::pointwise_op(F::Less), {{B, 4}, {4}}, {DType::F32, DType::F32}, o);
  }
  {  // Where, all three broadcast
    auto o = check_options(seed, DType::F64);
    o.reference = ref_of(DType::F64, [](auto& v) { return v[0] != 0 ? v[1] : v[2]; });
    expect_check_op(kg::ops::pointwise_op(F::Where), {{B, 1, 3}, {4, 1}, {}},
                    {DType::Bool, DType::F64, DType::F64}, o);
  }
  {  // Clip on a narrow integer (the host's bounds) with an open side
    auto o = check_options(seed, DType::I16);
    o.make_input = [&](int, const std::vector<std::int64_t>& shape) {
      return random_of(rng, DType::I16, shape, -9, 9);
    };
    o.reference = ref_of(DType::I16, [](auto& v) { return std::min(3.0, v[0]); });
    expect_check_op(kg::ops::pointwise_op(F::Clip, {-kInf, 3.5}), {{B, 9}}, {DType::I16}, o);
  }
  {  // Cast down to f16 and from a double to bf16 (ties to even), and int to float
    auto o = check_options(seed, DType::F16);
    o.rtol = o.atol = 0;
    o.make_input = [&](int, const std::vector<std::int64_t>& shape) {
      return random_of(rng, DType::F32, shape, -70000, 70000);
    };
    o.reference = ref_of(DType::F16, [](auto& v) { return round_f16(v[0]); });
    expect_check_op(kg::ops::cast_op(DType::F16), {{B, 11}}, {DType::F32}, o);
    auto o2 = check_options(seed, DType::BF16);
    o2.rtol = o2.atol = 0;
    o2.reference = ref_of(DType::BF16, [](auto& v) { return round_bf16(v[0]); });
    expect_check_op(kg::ops::cast_op(DType::BF16), {{B, 11}}, {DType::F64}, o2);
    auto o3 = check_options(seed, DType::F32);
    o3.make_input = [&](int, const std::vector<std::int64_t>& shape) {
      return random_of(rng, DType::I64, shape, -1e6, 1e6);
    };
    o3.reference = ref_of(DType::F32, [](auto& v) { return static_cast<float>(v[0]); });
    expect_check_op(kg::ops::cast_op(DType::F32), {{B, 2, 3}}, {DType::I64}, o3);
  }
}

// Where NVRTC is present: the generated sources compile for sm_90 and every launch checks against
// the PTX, for one function of each kind.
TEST(Pointwise, KernelsCompileWithNvrtc) {
  if (!kg::compile::Compiler::available())
    GTEST_SKIP() << "no NVRTC: " << kg::compile::Compiler::unavailable_reason();
  auto g = kg::Graph::create();
  auto x = g->input(DType::F32, {kg::Dim::named("b"), 1, 5}, "x");
  auto y = g->input(DType::F32, {4, 1}, "y");
  auto c = g->input(DType::Bool, {4, 5}, "c");
  auto i = g->input(DType::I8, {4, 5}, "i");
  std::vector<kg::SymTensor> outs = {
      kg::ops::pointwise(F::Selu, {x}, {1.67, 1.05}),
      kg::ops::pointwise(F::Pow, {x, y}),
      kg::ops::pointwise(F::GreaterOrEqual, {x, y}),
      kg::ops::pointwise(F::Where, {c, x, y}),
      kg::ops::pointwise(F::Xor, {c, c}),
      kg::ops::pointwise(F::FMod, {i, i}),
      kg::ops::cast(x, DType::BF16),
      kg::ops::cast(kg::ops::cast(i, DType::F16), DType::I64),
  };
  EXPECT_NO_THROW(kg::lower::dry_run(kg::Model(g, outs), {{3, 1, 5}, {4, 1}, {4, 5}, {4, 5}}, 90));
}

// Every function on every dtype it takes, and every cast, compiled with NVRTC (slow: hundreds of
// compiles; run by hand with --gtest_also_run_disabled_tests).
TEST(Pointwise, DISABLED_EveryKernelCompilesWithNvrtc) {
  if (!kg::compile::Compiler::available()) GTEST_SKIP() << "no NVRTC";
  const DType dtypes[] = {DType::Bool, DType::I8, DType::I16, DType::I32,
                          DType::I64,  DType::U8, DType::F32, DType::F64};
  for (int f = 0; f <= static_cast<int>(F::Where); ++f) {
    const auto fn = static_cast<PointwiseFn>(f);
    for (DType t : dtypes) {
      auto g = kg::Graph::create();
      std::vector<kg::SymTensor> xs;
      const int n = kg::ops::pointwise_arity(fn);
      for (int k = 0; k < n; ++k) xs.push_back(g->input(fn == F::Where && k == 0 ? DType::Bool : t, {3, 1}));
      const int attrs = fn == F::Selu || fn == F::HardSigmoid || fn == F::Clip                            ? 2
                        : fn == F::Elu || fn == F::Celu || fn == F::LeakyRelu || fn == F::ThresholdedRelu ? 1
                                                                                                          : 0;
      kg::SymTensor y;
      try {
        y = kg::ops::pointwise(fn, xs, std::vector<double>(static_cast<std::size_t>(attrs), 0.5));
      } catch (const kg::Error&) {
        continue;  // a dtype the function does not take
      }
      SCOPED_TRACE(std::string(kg::ops::pointwise_name(fn)) + " " + std::string(kg::dtype_name(t)));
      std::vector<std::vector<std::int64_t>> shapes(static_cast<std::size_t>(n), {3, 1});
      EXPECT_NO_THROW(kg::lower::dry_run(kg::Model(g, {y}), shapes, 90));
    }
  }
  for (DType from : kAll)
    for (DType to : kAll) {
      auto g = kg::Graph::create();
      auto x = g->input(from, {2, 3});
      SCOPED_TRACE(std::string(kg::dtype_name(from)) + " -> " + std::string(kg::dtype_name(to)));
      EXPECT_NO_THROW(kg::lower::dry_run(kg::Model(g, {kg::ops::cast(x, to)}), {{2, 3}}, 90));
    }
}

namespace {

// On a GPU: each function on each of `dtypes` it takes and the casts from them to every dtype, and
// f16 to f32 (with `casts_from_all`, every dtype to every dtype), against the CPU: one model per
// input dtype, every node its own kernel.
void expect_gpu_matches_cpu(const std::vector<DType>& dtypes, bool casts_from_all) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (DType t : kAll) {
    const bool listed = std::find(dtypes.begin(), dtypes.end(), t) != dtypes.end();
    if (!listed && !casts_from_all && t != DType::F16) continue;
    SCOPED_TRACE(std::string(kg::dtype_name(t)));
    auto g = kg::Graph::create();
    auto x = g->input(t, {3, 1, 5}, "x");
    auto y = g->input(t, {4, 1}, "y");
    auto c = g->input(DType::Bool, {3, 4, 1}, "c");
    std::vector<kg::SymTensor> outs;
    std::vector<std::string> what;
    for (int f = 0; f <= static_cast<int>(F::Where) && listed; ++f) {
      const auto fn = static_cast<PointwiseFn>(f);
      const int n = kg::ops::pointwise_arity(fn);
      std::vector<double> attrs;
      if (fn == F::Selu) attrs = {1.67, 1.05};
      if (fn == F::HardSigmoid) attrs = {0.2, 0.5};
      if (fn == F::Clip) attrs = {-1.5, 2.5};
      if (fn == F::Elu || fn == F::Celu || fn == F::LeakyRelu || fn == F::ThresholdedRelu) attrs = {0.7};
      const std::vector<kg::SymTensor> ins = n == 1   ? std::vector<kg::SymTensor>{x}
                                             : n == 2 ? std::vector<kg::SymTensor>{x, y}
                                                      : std::vector<kg::SymTensor>{c, x, y};
      try {
        outs.push_back(kg::ops::pointwise(fn, ins, attrs));
        what.push_back(kg::ops::pointwise_name(fn));
      } catch (const kg::Error&) {  // a dtype the function does not take
      }
    }
    for (DType to : kAll) {
      if (!listed && !casts_from_all && to != DType::F32) continue;  // f16 -> f32 at least
      outs.push_back(kg::ops::cast(x, to));
      what.push_back("cast to " + std::string(kg::dtype_name(to)));
    }
    const double lo = t == DType::U8 || t == DType::Bool ? 0 : kg::is_floating(t) ? -3 : -9;
    const double hi = t == DType::U8 ? 250 : t == DType::Bool ? 1 : kg::is_floating(t) ? 3 : 9;
    std::vector<kg::Tensor> inputs = {random_of(rng, t, {3, 1, 5}, lo, hi), random_of(rng, t, {4, 1}, lo, hi),
                                      random_of(rng, DType::Bool, {3, 4, 1}, 0, 1)};
    kg::Model model(g, outs);
    const std::vector<std::vector<std::int64_t>> shapes = {{3, 1, 5}, {4, 1}, {3, 4, 1}};
    kg::LoadOptions opt;
    opt.poison_buffers = true;
    const auto want = model.load(kg::Device::cpu(), shapes, opt).forward(inputs);
    const auto got = model.load(kg::Device::cuda(), shapes, opt).forward(inputs);
    ASSERT_EQ(got.size(), want.size());
    const double rtol = t == DType::F32 ? 2e-6 : t == DType::F64 ? 1e-14 : 0;
    for (std::size_t k = 0; k < got.size(); ++k)
      EXPECT_TRUE(kg_test::all_close(got[k], want[k], rtol, rtol * 0.1)) << what[k];
  }
}

}  // namespace

// On a GPU (skipped without one; the emulator and NVRTC checks above cover the kernels): every
// function on f32, i32 and bool, and the casts from those and from f16 to f32.
TEST(Pointwise, FunctionsOnTheGpuMatchTheCpu) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no usable GPU";
  expect_gpu_matches_cpu({DType::F32, DType::I32, DType::Bool}, false);
}

// Every function on every dtype it takes and all 100 casts (about 350 kernels, so a minute or two
// of NVRTC; run by hand with --gtest_also_run_disabled_tests).
TEST(Pointwise, DISABLED_EveryFunctionAndDtypeOnTheGpuMatchesTheCpu) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no usable GPU";
  expect_gpu_matches_cpu(
      {DType::Bool, DType::I8, DType::I16, DType::I32, DType::I64, DType::U8, DType::F32, DType::F64}, true);
}
