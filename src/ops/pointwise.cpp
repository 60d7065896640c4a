// The pointwise op family: one op class for the n-ary functions (PointwiseOp, driven by the kFns
// table) and one for Cast (CastOp). Both walk their inputs with the same broadcast plan: the
// output's dims with size-1 dims dropped and adjacent dims merged where every input walks them
// alike, each input's stride 0 along the dims it is broadcast over. On the CPU a loop per
// (function, dtype) instantiation; on the GPU a kernel source per op instance: pointwise.cu, a
// functor computing the table's expression for the function in the dtypes' C types, and one
// entry ("kg_pw_<fn>_<dtype>", "kg_pw_cast_<from>_<to>"), launched by PointwiseRuntime.
#include "ops/pointwise.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>

#include "kg/error.hpp"
#include "ops/divider.hpp"
#include "ops/gpu_util.hpp"
#include "ops/op_util.hpp"
#include "ops/pointwise_shared.cuh"
#include "util/half.hpp"
#include "util/str.hpp"

namespace kg::ops {
namespace {

using P = PointwiseFn;

// Elements per parallel chunk: large enough that scheduling costs little next to the work.
constexpr std::int64_t kGrain = 16 * 1024;
constexpr unsigned kGpuThreads = KG_PW_THREADS;

// ---- the functions ----

// Which dtypes a function's inputs (x and y for Where) take.
enum class Takes : std::uint8_t {
  Any,      // every dtype but f16 and bf16
  Numeric,  // every dtype but bool (and f16, bf16)
  Float,    // f32 and f64
  Bool,     // bool
  Integer,  // i8, i16, i32, i64, u8
};

struct FnInfo {
  PointwiseFn fn;
  const char* name;  // the op name, "pw.exp"
  int arity;         // inputs: 1, 2, or 3 (Where)
  Takes takes;
  bool bool_out;              // the output is bool (comparisons, IsNaN, IsInf, logical ops)
  int attrs;                  // attribute count
  const char* attr_names[2];  // "alpha", ...
  const char* expr;           // the device expression over a, b, c, T (the inputs' C type) and p
};

// One row per function, in PointwiseFn order. The expressions call pointwise.cuh's helpers.
// clang-format off
constexpr FnInfo kFns[] = {
    {P::Neg, "pw.neg", 1, Takes::Numeric, false, 0, {}, "kg_pw_neg(a)"},
    {P::Abs, "pw.abs", 1, Takes::Numeric, false, 0, {}, "kg_pw_abs(a)"},
    {P::Exp, "pw.exp", 1, Takes::Float, false, 0, {}, "kg_pw_exp(a)"},
    {P::Log, "pw.log", 1, Takes::Float, false, 0, {}, "kg_pw_log(a)"},
    {P::Sqrt, "pw.sqrt", 1, Takes::Float, false, 0, {}, "kg_pw_sqrt(a)"},
    {P::Reciprocal, "pw.reciprocal", 1, Takes::Float, false, 0, {}, "(T)1 / a"},
    {P::Erf, "pw.erf", 1, Takes::Float, false, 0, {}, "kg_pw_erf(a)"},
    {P::Sin, "pw.sin", 1, Takes::Float, false, 0, {}, "kg_pw_sin(a)"},
    {P::Cos, "pw.cos", 1, Takes::Float, false, 0, {}, "kg_pw_cos(a)"},
    {P::Tan, "pw.tan", 1, Takes::Float, false, 0, {}, "kg_pw_tan(a)"},
    {P::Asin, "pw.asin", 1, Takes::Float, false, 0, {}, "kg_pw_asin(a)"},
    {P::Acos, "pw.acos", 1, Takes::Float, false, 0, {}, "kg_pw_acos(a)"},
    {P::Atan, "pw.atan", 1, Takes::Float, false, 0, {}, "kg_pw_atan(a)"},
    {P::Sinh, "pw.sinh", 1, Takes::Float, false, 0, {}, "kg_pw_sinh(a)"},
    {P::Cosh, "pw.cosh", 1, Takes::Float, false, 0, {}, "kg_pw_cosh(a)"},
    {P::Asinh, "pw.asinh", 1, Takes::Float, false, 0, {}, "kg_pw_asinh(a)"},
    {P::Acosh, "pw.acosh", 1, Takes::Float, false, 0, {}, "kg_pw_acosh(a)"},
    {P::Atanh, "pw.atanh", 1, Takes::Float, false, 0, {}, "kg_pw_atanh(a)"},
    {P::Floor, "pw.floor", 1, Takes::Float, false, 0, {}, "kg_pw_floor(a)"},
    {P::Ceil, "pw.ceil", 1, Takes::Float, false, 0, {}, "kg_pw_ceil(a)"},
    {P::Round, "pw.round", 1, Takes::Float, false, 0, {}, "kg_pw_rint(a)"},
    {P::Sign, "pw.sign", 1, Takes::Numeric, false, 0, {}, "kg_pw_sign(a)"},
    {P::IsNaN, "pw.is_nan", 1, Takes::Float, true, 0, {}, "a != a"},
    {P::IsInf, "pw.is_inf", 1, Takes::Float, true, 0, {}, "kg_pw_fabs(a) > kg_pw_max_finite(a)"},
    {P::Not, "pw.not", 1, Takes::Bool, true, 0, {}, "!a"},
    {P::Relu, "pw.relu", 1, Takes::Numeric, false, 0, {}, "kg_pw_relu(a)"},
    {P::Sigmoid, "pw.sigmoid", 1, Takes::Float, false, 0, {}, "kg_pw_sigmoid(a)"},
    {P::Tanh, "pw.tanh", 1, Takes::Float, false, 0, {}, "kg_pw_tanh(a)"},
    {P::Softplus, "pw.softplus", 1, Takes::Float, false, 0, {}, "kg_pw_softplus(a)"},
    {P::Softsign, "pw.softsign", 1, Takes::Float, false, 0, {}, "a / ((T)1 + kg_pw_fabs(a))"},
    {P::Elu, "pw.elu", 1, Takes::Float, false, 1, {"alpha"}, "kg_pw_elu(a, (T)p.attr[0])"},
    {P::Selu, "pw.selu", 1, Takes::Float, false, 2, {"alpha", "gamma"},
     "kg_pw_selu(a, (T)p.attr[0], (T)p.attr[1])"},
    {P::Celu, "pw.celu", 1, Takes::Float, false, 1, {"alpha"}, "kg_pw_celu(a, (T)p.attr[0])"},
    {P::LeakyRelu, "pw.leaky_relu", 1, Takes::Float, false, 1, {"alpha"}, "a < (T)0 ? (T)p.attr[0] * a : a"},
    {P::HardSigmoid, "pw.hard_sigmoid", 1, Takes::Float, false, 2, {"alpha", "beta"},
     "kg_pw_hard_sigmoid(a, (T)p.attr[0], (T)p.attr[1])"},
    {P::HardSwish, "pw.hard_swish", 1, Takes::Float, false, 0, {}, "kg_pw_hard_swish(a)"},
    {P::ThresholdedRelu, "pw.thresholded_relu", 1, Takes::Float, false, 1, {"alpha"},
     "a > (T)p.attr[0] ? a : (T)0"},
    {P::Mish, "pw.mish", 1, Takes::Float, false, 0, {}, "kg_pw_mish(a)"},
    {P::Clip, "pw.clip", 1, Takes::Numeric, false, 2, {"min", "max"}, "kg_pw_clip(a, p)"},
    {P::Identity, "pw.identity", 1, Takes::Any, false, 0, {}, "a"},
    {P::Add, "pw.add", 2, Takes::Numeric, false, 0, {}, "kg_pw_add(a, b)"},
    {P::Sub, "pw.sub", 2, Takes::Numeric, false, 0, {}, "kg_pw_sub(a, b)"},
    {P::Mul, "pw.mul", 2, Takes::Numeric, false, 0, {}, "kg_pw_mul(a, b)"},
    {P::Div, "pw.div", 2, Takes::Numeric, false, 0, {}, "kg_pw_div(a, b)"},
    {P::Pow, "pw.pow", 2, Takes::Numeric, false, 0, {}, "kg_pw_pow(a, b)"},
    {P::Max, "pw.max", 2, Takes::Numeric, false, 0, {}, "kg_pw_max(a, b)"},
    {P::Min, "pw.min", 2, Takes::Numeric, false, 0, {}, "kg_pw_min(a, b)"},
    {P::Mod, "pw.mod", 2, Takes::Numeric, false, 0, {}, "kg_pw_mod(a, b)"},
    {P::FMod, "pw.fmod", 2, Takes::Numeric, false, 0, {}, "kg_pw_fmod(a, b)"},
    {P::PRelu, "pw.prelu", 2, Takes::Numeric, false, 0, {}, "kg_pw_prelu(a, b)"},
    {P::Equal, "pw.equal", 2, Takes::Any, true, 0, {}, "a == b"},
    {P::Less, "pw.less", 2, Takes::Numeric, true, 0, {}, "a < b"},
    {P::LessOrEqual, "pw.less_or_equal", 2, Takes::Numeric, true, 0, {}, "a <= b"},
    {P::Greater, "pw.greater", 2, Takes::Numeric, true, 0, {}, "a > b"},
    {P::GreaterOrEqual, "pw.greater_or_equal", 2, Takes::Numeric, true, 0, {}, "a >= b"},
    {P::And, "pw.and", 2, Takes::Bool, true, 0, {}, "a & b"},
    {P::Or, "pw.or", 2, Takes::Bool, true, 0, {}, "a | b"},
    {P::Xor, "pw.xor", 2, Takes::Bool, true, 0, {}, "a ^ b"},
    {P::BitwiseAnd, "pw.bitwise_and", 2, Takes::Integer, false, 0, {}, "a & b"},
    {P::BitwiseOr, "pw.bitwise_or", 2, Takes::Integer, false, 0, {}, "a | b"},
    {P::BitwiseXor, "pw.bitwise_xor", 2, Takes::Integer, false, 0, {}, "a ^ b"},
    {P::Where, "pw.where", 3, Takes::Any, false, 0, {}, "a ? b : c"},
};
// clang-format on

constexpr bool table_in_enum_order() {
  for (std::size_t i = 0; i < std::size(kFns); ++i)
    if (static_cast<std::size_t>(kFns[i].fn) != i) return false;
  return std::size(kFns) == static_cast<std::size_t>(P::Where) + 1;
}
static_assert(table_in_enum_order());

constexpr const FnInfo& info(PointwiseFn fn) { return kFns[static_cast<std::size_t>(fn)]; }

constexpr bool is_integer(DType t) {
  return t == DType::I8 || t == DType::I16 || t == DType::I32 || t == DType::I64 || t == DType::U8;
}

// True when `fn` takes inputs (x and y for Where) of dtype `t`.
constexpr bool fn_takes(PointwiseFn fn, DType t) {
  if (t == DType::F16 || t == DType::BF16) return false;
  switch (info(fn).takes) {
    case Takes::Any:
      return true;
    case Takes::Numeric:
      return t != DType::Bool;
    case Takes::Float:
      return t == DType::F32 || t == DType::F64;
    case Takes::Bool:
      return t == DType::Bool;
    case Takes::Integer:
      return is_integer(t);
  }
  return false;
}

// What the dtype rule of `takes` says, for errors.
const char* takes_text(Takes t) {
  switch (t) {
    case Takes::Any:
      return "takes bool, integer, f32 and f64 inputs";
    case Takes::Numeric:
      return "takes integer, f32 and f64 inputs (not bool)";
    case Takes::Float:
      return "takes f32 and f64 inputs only";
    case Takes::Bool:
      return "takes bool inputs only";
    case Takes::Integer:
      return "takes integer inputs only (i8, i16, i32, i64, u8)";
  }
  return "";
}

// Calls g(std::integral_constant<PointwiseFn, F>{}) for the runtime value `fn`, so that a loop
// written once is instantiated per function.
// clang-format off
#define KG_PW_FNS(X)                                                                                     \
  X(Neg) X(Abs) X(Exp) X(Log) X(Sqrt) X(Reciprocal) X(Erf) X(Sin) X(Cos) X(Tan) X(Asin) X(Acos) X(Atan)   \
  X(Sinh) X(Cosh) X(Asinh) X(Acosh) X(Atanh) X(Floor) X(Ceil) X(Round) X(Sign) X(IsNaN) X(IsInf) X(Not)    \
  X(Relu) X(Sigmoid) X(Tanh) X(Softplus) X(Softsign) X(Elu) X(Selu) X(Celu) X(LeakyRelu) X(HardSigmoid)   \
  X(HardSwish) X(ThresholdedRelu) X(Mish) X(Clip) X(Identity) X(Add) X(Sub) X(Mul) X(Div) X(Pow) X(Max)  \
  X(Min) X(Mod) X(FMod) X(PRelu) X(Equal) X(Less) X(LessOrEqual) X(Greater) X(GreaterOrEqual) X(And)     \
  X(Or) X(Xor) X(BitwiseAnd) X(BitwiseOr) X(BitwiseXor) X(Where)
// clang-format on

template <class G>
void visit_fn(PointwiseFn fn, G&& g) {
  switch (fn) {
#define KG_PW_CASE(n)                               \
  case P::n:                                        \
    g(std::integral_constant<PointwiseFn, P::n>{}); \
    return;
    KG_PW_FNS(KG_PW_CASE)
#undef KG_PW_CASE
  }
  throw Error(util::cat("unknown pointwise function ", static_cast<int>(fn)));
}

// ---- dtypes ----

// The element type a dtype is stored as: bool as a byte (0 or 1), f16 and bf16 as their bits.
template <DType D>
struct Storage;
// clang-format off
template <> struct Storage<DType::Bool> { using type = std::uint8_t; };
template <> struct Storage<DType::I8> { using type = std::int8_t; };
template <> struct Storage<DType::I16> { using type = std::int16_t; };
template <> struct Storage<DType::I32> { using type = std::int32_t; };
template <> struct Storage<DType::I64> { using type = std::int64_t; };
template <> struct Storage<DType::U8> { using type = std::uint8_t; };
template <> struct Storage<DType::F16> { using type = std::uint16_t; };
template <> struct Storage<DType::BF16> { using type = std::uint16_t; };
template <> struct Storage<DType::F32> { using type = float; };
template <> struct Storage<DType::F64> { using type = double; };
// clang-format on
template <DType D>
using St = typename Storage<D>::type;

// Calls g(std::integral_constant<DType, D>{}) for the runtime value `t`.
template <class G>
void visit_dtype(DType t, G&& g) {
  using D = DType;
  switch (t) {
    case D::Bool:
      return g(std::integral_constant<D, D::Bool>{});
    case D::I8:
      return g(std::integral_constant<D, D::I8>{});
    case D::I16:
      return g(std::integral_constant<D, D::I16>{});
    case D::I32:
      return g(std::integral_constant<D, D::I32>{});
    case D::I64:
      return g(std::integral_constant<D, D::I64>{});
    case D::U8:
      return g(std::integral_constant<D, D::U8>{});
    case D::F16:
      return g(std::integral_constant<D, D::F16>{});
    case D::BF16:
      return g(std::integral_constant<D, D::BF16>{});
    case D::F32:
      return g(std::integral_constant<D, D::F32>{});
    case D::F64:
      return g(std::integral_constant<D, D::F64>{});
  }
  throw Error(util::cat("unknown dtype ", static_cast<int>(t)));
}

// The kernels' C type of a dtype.
const char* c_type(DType t) {
  switch (t) {
    case DType::Bool:
      return "kg_bool";
    case DType::I8:
      return "signed char";
    case DType::I16:
      return "short";
    case DType::I32:
      return "int";
    case DType::I64:
      return "long long";
    case DType::U8:
      return "unsigned char";
    case DType::F16:
    case DType::BF16:
      return "unsigned short";
    case DType::F32:
      return "float";
    case DType::F64:
      return "double";
  }
  return "";
}

// The shortest text that reads back as the same double ("0.1", "2.5", "-inf").
std::string format_double(double v) {
  char buf[32];
  auto res = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, res.ptr);
}

// ---- the functions on the CPU: the helpers of pointwise.cu, in C++ ----

template <class T>
constexpr bool kFloat = std::is_floating_point_v<T>;
template <class T>
constexpr bool kSigned = std::is_signed_v<T>;

template <class T>
std::uint64_t u64(T v) {
  return static_cast<std::uint64_t>(v);  // modular for negative integers
}

template <class T>
T neg(T a) {
  if constexpr (kFloat<T>)
    return -a;
  else
    return static_cast<T>(std::uint64_t{0} - u64(a));
}
template <class T>
T add(T a, T b) {
  if constexpr (kFloat<T>)
    return a + b;
  else
    return static_cast<T>(u64(a) + u64(b));
}
template <class T>
T sub(T a, T b) {
  if constexpr (kFloat<T>)
    return a - b;
  else
    return static_cast<T>(u64(a) - u64(b));
}
template <class T>
T mul(T a, T b) {
  if constexpr (kFloat<T>)
    return a * b;
  else
    return static_cast<T>(u64(a) * u64(b));
}
template <class T>
T div(T a, T b) {
  if constexpr (kFloat<T>) {
    return a / b;
  } else {
    if (b == 0) return T(0);
    if constexpr (kSigned<T>) {
      if (b == T(-1)) return neg(a);
    }
    return static_cast<T>(a / b);
  }
}
template <class T>
T fmod_of(T a, T b) {
  if constexpr (kFloat<T>) {
    return std::fmod(a, b);
  } else {
    if (b == 0) return T(0);
    if constexpr (kSigned<T>) {
      if (b == T(-1)) return T(0);
    }
    return static_cast<T>(a % b);
  }
}
template <class T>
T mod_of(T a, T b) {
  T r = fmod_of(a, b);
  if constexpr (kSigned<T>) {
    if (r != T(0) && ((r < T(0)) != (b < T(0)))) r = static_cast<T>(r + b);
  }
  return r;
}
template <class T>
T pow_of(T a, T b) {
  if constexpr (kFloat<T>) {
    return std::pow(a, b);
  } else {
    if constexpr (kSigned<T>) {
      if (b < 0) {
        if (a == 1) return T(1);
        if (a == T(-1)) return (b & 1) ? T(-1) : T(1);
        return T(0);
      }
    }
    std::uint64_t r = 1, base = u64(a), e = u64(b);
    while (e) {
      if (e & 1) r *= base;
      base *= base;
      e >>= 1;
    }
    return static_cast<T>(r);
  }
}
template <class T>
T max_of(T a, T b) {
  if constexpr (kFloat<T>) {
    if (std::isnan(a)) return a;
    if (std::isnan(b)) return b;
  }
  return a > b ? a : b;
}
template <class T>
T min_of(T a, T b) {
  if constexpr (kFloat<T>) {
    if (std::isnan(a)) return a;
    if (std::isnan(b)) return b;
  }
  return a < b ? a : b;
}
template <class T>
T abs_of(T a) {
  if constexpr (kFloat<T>)
    return std::fabs(a);
  else if constexpr (kSigned<T>)
    return a < 0 ? neg(a) : a;
  else
    return a;
}
template <class T>
T sign_of(T a) {
  if constexpr (kFloat<T>) {
    if (std::isnan(a)) return a;
  }
  if (a > T(0)) return T(1);
  if constexpr (kSigned<T>) {
    if (a < T(0)) return T(-1);
  }
  return T(0);
}
template <class T>
T relu_of(T a) {
  if constexpr (kSigned<T>)
    return a < T(0) ? T(0) : a;
  else
    return a;
}
template <class T>
T prelu_of(T a, T slope) {
  if constexpr (kSigned<T>)
    return a < T(0) ? mul(slope, a) : a;
  else
    return a;
}

// The function's attributes as the kernels get them (KgPwArgs::attr, iattr).
struct Attrs {
  double a[2] = {0, 0};
  std::int64_t i[2] = {0, 0};
};

template <class T>
T clip_of(T a, const Attrs& at) {
  T lo, hi;
  if constexpr (kFloat<T>) {
    lo = static_cast<T>(at.a[0]);
    hi = static_cast<T>(at.a[1]);
  } else {
    lo = static_cast<T>(at.i[0]);
    hi = static_cast<T>(at.i[1]);
  }
  const T y = a < lo ? lo : a;
  return y > hi ? hi : y;
}

template <class T>
T sigmoid_of(T a) {
  if (a >= T(0)) return T(1) / (T(1) + std::exp(-a));
  const T e = std::exp(a);
  return e / (T(1) + e);
}
template <class T>
T softplus_of(T a) {
  return a > T(0) ? a + std::log1p(std::exp(-a)) : std::log1p(std::exp(a));
}

template <PointwiseFn F, class T>
auto unary_fn(T a, const Attrs& at) {
  using B = std::uint8_t;
  // The float attributes in T (called by the float functions only).
  [[maybe_unused]] auto attr = [&](int k) { return static_cast<T>(at.a[k]); };
  // clang-format off
  if constexpr (F == P::Neg) return neg(a);
  else if constexpr (F == P::Abs) return abs_of(a);
  else if constexpr (F == P::Exp) return std::exp(a);
  else if constexpr (F == P::Log) return std::log(a);
  else if constexpr (F == P::Sqrt) return std::sqrt(a);
  else if constexpr (F == P::Reciprocal) return T(1) / a;
  else if constexpr (F == P::Erf) return std::erf(a);
  else if constexpr (F == P::Sin) return std::sin(a);
  else if constexpr (F == P::Cos) return std::cos(a);
  else if constexpr (F == P::Tan) return std::tan(a);
  else if constexpr (F == P::Asin) return std::asin(a);
  else if constexpr (F == P::Acos) return std::acos(a);
  else if constexpr (F == P::Atan) return std::atan(a);
  else if constexpr (F == P::Sinh) return std::sinh(a);
  else if constexpr (F == P::Cosh) return std::cosh(a);
  else if constexpr (F == P::Asinh) return std::asinh(a);
  else if constexpr (F == P::Acosh) return std::acosh(a);
  else if constexpr (F == P::Atanh) return std::atanh(a);
  else if constexpr (F == P::Floor) return std::floor(a);
  else if constexpr (F == P::Ceil) return std::ceil(a);
  else if constexpr (F == P::Round) return std::nearbyint(a);  // half to even
  else if constexpr (F == P::Sign) return sign_of(a);
  else if constexpr (F == P::IsNaN) return static_cast<B>(std::isnan(a));
  else if constexpr (F == P::IsInf) return static_cast<B>(std::isinf(a));
  else if constexpr (F == P::Not) return static_cast<B>(!a);
  else if constexpr (F == P::Relu) return relu_of(a);
  else if constexpr (F == P::Sigmoid) return sigmoid_of(a);
  else if constexpr (F == P::Tanh) return std::tanh(a);
  else if constexpr (F == P::Softplus) return softplus_of(a);
  else if constexpr (F == P::Softsign) return a / (T(1) + std::fabs(a));
  else if constexpr (F == P::Elu) return a < T(0) ? attr(0) * std::expm1(a) : a;
  else if constexpr (F == P::Selu) return a > T(0) ? attr(1) * a : attr(1) * (attr(0) * std::expm1(a));
  else if constexpr (F == P::Celu) return a > T(0) ? a : attr(0) * std::expm1(a / attr(0));
  else if constexpr (F == P::LeakyRelu) return a < T(0) ? attr(0) * a : a;
  else if constexpr (F == P::HardSigmoid) {
    const T v = attr(0) * a + attr(1);
    return v < T(0) ? T(0) : (v > T(1) ? T(1) : v);
  } else if constexpr (F == P::HardSwish) {
    const T v = a / T(6) + T(0.5);
    return a * (v < T(0) ? T(0) : (v > T(1) ? T(1) : v));
  } else if constexpr (F == P::ThresholdedRelu) return a > attr(0) ? a : T(0);
  else if constexpr (F == P::Mish) return a * std::tanh(softplus_of(a));
  else if constexpr (F == P::Clip) return clip_of(a, at);
  else {
    static_assert(F == P::Identity);
    return a;
  }
  // clang-format on
}

template <PointwiseFn F, class T>
auto binary_fn(T a, T b) {
  using B = std::uint8_t;
  // clang-format off
  if constexpr (F == P::Add) return add(a, b);
  else if constexpr (F == P::Sub) return sub(a, b);
  else if constexpr (F == P::Mul) return mul(a, b);
  else if constexpr (F == P::Div) return div(a, b);
  else if constexpr (F == P::Pow) return pow_of(a, b);
  else if constexpr (F == P::Max) return max_of(a, b);
  else if constexpr (F == P::Min) return min_of(a, b);
  else if constexpr (F == P::Mod) return mod_of(a, b);
  else if constexpr (F == P::FMod) return fmod_of(a, b);
  else if constexpr (F == P::PRelu) return prelu_of(a, b);
  else if constexpr (F == P::Equal) return static_cast<B>(a == b);
  else if constexpr (F == P::Less) return static_cast<B>(a < b);
  else if constexpr (F == P::LessOrEqual) return static_cast<B>(a <= b);
  else if constexpr (F == P::Greater) return static_cast<B>(a > b);
  else if constexpr (F == P::GreaterOrEqual) return static_cast<B>(a >= b);
  else if constexpr (F == P::And) return static_cast<B>(a & b);  // bools are 0 or 1 here
  else if constexpr (F == P::Or) return static_cast<B>(a | b);
  else if constexpr (F == P::Xor) return static_cast<B>(a ^ b);
  else if constexpr (F == P::BitwiseAnd) return static_cast<T>(a & b);
  else if constexpr (F == P::BitwiseOr) return static_cast<T>(a | b);
  else {
    static_assert(F == P::BitwiseXor);
    return static_cast<T>(a ^ b);
  }
  // clang-format on
}

// ---- Cast: the helpers of pointwise.cu in C++ ----

// The double rounded to nearest even into a 16-bit float format of `man` mantissa bits,
// exponent bias `bias` and infinite biased exponent `emax` (kg_pw_double_to_small).
std::uint16_t double_to_small(double v, int man, int bias, int emax) {
  std::uint64_t x;
  std::memcpy(&x, &v, sizeof x);
  const auto sign = static_cast<std::uint32_t>(x >> 63) << 15;
  const int be = static_cast<int>((x >> 52) & 0x7ff);
  std::uint64_t m = x & 0xfffffffffffffull;
  const std::uint32_t inf = static_cast<std::uint32_t>(emax) << man;
  if (be == 0x7ff) return static_cast<std::uint16_t>(sign | inf | (m ? 1u << (man - 1) : 0u));
  const int e = be - 1023 + bias;
  if (e >= emax) return static_cast<std::uint16_t>(sign | inf);
  int shift = 52 - man;
  std::uint64_t h;
  if (e <= 0) {
    if (e < -man) return static_cast<std::uint16_t>(sign);
    m |= std::uint64_t{1} << 52;
    shift += 1 - e;
    h = m >> shift;
  } else {
    h = (static_cast<std::uint64_t>(e) << man) | (m >> shift);
  }
  const std::uint64_t rem = m & ((std::uint64_t{1} << shift) - 1), mid = std::uint64_t{1} << (shift - 1);
  if (rem > mid || (rem == mid && (h & 1))) ++h;
  return static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(h));
}

std::int64_t double_to_i64(double v) {
  if (std::isnan(v)) return 0;
  if (v >= 9223372036854775808.0) return std::numeric_limits<std::int64_t>::max();
  if (v < -9223372036854775808.0) return std::numeric_limits<std::int64_t>::min();
  return static_cast<std::int64_t>(v);
}

template <DType From, DType To>
St<To> cast_value(St<From> v) {
  using R = St<To>;
  if constexpr (From == To && From != DType::Bool) {
    return v;
  } else {
    // The source as a long long (integers, bool) or a double (floats).
    constexpr bool from_int = From == DType::Bool || is_integer(From);
    auto source = [&] {
      if constexpr (From == DType::Bool)
        return static_cast<std::int64_t>(v != 0);
      else if constexpr (from_int)
        return static_cast<std::int64_t>(v);
      else if constexpr (From == DType::F16)
        return static_cast<double>(util::half_to_float(v));
      else if constexpr (From == DType::BF16)
        return static_cast<double>(util::bf16_to_float(v));
      else
        return static_cast<double>(v);
    };
    const auto s = source();
    if constexpr (To == DType::Bool)
      return static_cast<R>(s != 0);
    else if constexpr (is_integer(To) && !from_int)
      return static_cast<R>(double_to_i64(s));
    else if constexpr (To == DType::F16)
      return double_to_small(static_cast<double>(s), 10, 15, 31);
    else if constexpr (To == DType::BF16)
      return double_to_small(static_cast<double>(s), 7, 127, 255);
    else
      return static_cast<R>(s);  // integers wrap; a long long or double to float rounds once
  }
}

// The device expression of the same cast over input a (the kernel's KgPwOp).
std::string cast_expr(DType from, DType to) {
  const bool from_int = from == DType::Bool || is_integer(from);
  std::string s;
  if (from == DType::Bool || is_integer(from))
    s = "(long long)a";
  else if (from == DType::F16)
    s = "(double)kg_pw_half_to_float(a)";
  else if (from == DType::BF16)
    s = "(double)kg_pw_bf16_to_float(a)";
  else
    s = "(double)a";
  if (from == to && from != DType::Bool) return "a";
  if (to == DType::Bool) return util::cat(s, " != 0");
  if (is_integer(to) && !from_int) return util::cat("kg_pw_double_to_ll(", s, ")");
  if (to == DType::F16) return util::cat("kg_pw_double_to_half(", s, ")");
  if (to == DType::BF16) return util::cat("kg_pw_double_to_bf16(", s, ")");
  return s;
}

// ---- broadcasting ----

// The output's dims with size-1 dims dropped and adjacent dims merged where every input walks
// them alike (outermost first), each input's element stride along each (0 where broadcast).
struct Plan {
  std::vector<std::int64_t> size;
  std::vector<std::array<std::int64_t, KG_PW_MAX_INPUTS>> stride;
  std::int64_t n = 0;
  bool same = false;  // every input has the output's elements in order
};

Plan make_plan(const std::vector<std::vector<std::int64_t>>& in, const std::vector<std::int64_t>& out) {
  Plan p;
  p.n = numel_of(out);
  p.same = true;
  for (const auto& s : in) p.same = p.same && numel_of(s) == p.n;
  const std::size_t r = out.size();
  std::vector<std::vector<std::int64_t>> aligned(in.size(), std::vector<std::int64_t>(r, 0));
  for (std::size_t j = 0; j < in.size(); ++j) {
    std::int64_t st = 1;
    for (std::size_t i = in[j].size(); i-- > 0;) {
      aligned[j][i + r - in[j].size()] = in[j][i] == 1 ? 0 : st;
      st *= in[j][i];
    }
  }
  for (std::size_t i = 0; i < r; ++i) {
    if (out[i] == 1) continue;
    std::array<std::int64_t, KG_PW_MAX_INPUTS> s{};
    for (std::size_t j = 0; j < in.size(); ++j) s[j] = aligned[j][i];
    bool merge = !p.size.empty();
    for (std::size_t j = 0; j < in.size() && merge; ++j) merge = p.stride.back()[j] == s[j] * out[i];
    if (merge) {
      p.size.back() *= out[i];
      p.stride.back() = s;
    } else {
      p.size.push_back(out[i]);
      p.stride.push_back(s);
    }
  }
  if (p.size.empty()) {  // a single element
    p.size.push_back(1);
    p.stride.push_back({});
  }
  return p;
}

std::string shapes_text(const std::vector<std::vector<std::int64_t>>& in) {
  std::string s;
  for (std::size_t j = 0; j < in.size(); ++j) s += (j ? ", " : "") + sizes_to_string(in[j]);
  return s;
}

// Why the GPU kernel cannot walk this broadcast ("" when it can): more merged dims than it has.
std::string gpu_unfit(const Plan& p, const std::vector<std::vector<std::int64_t>>& in,
                      const std::vector<std::int64_t>& out) {
  if (p.n == 0 || p.same || p.size.size() <= static_cast<std::size_t>(KG_PW_MAX_DIMS)) return {};
  return util::cat("broadcasting ", shapes_text(in), " to ", sizes_to_string(out), " needs ", p.size.size(),
                   " dims after merging; the GPU kernel handles up to ", KG_PW_MAX_DIMS);
}

KgPwArgs gpu_args(const std::vector<std::vector<std::int64_t>>& in, const std::vector<std::int64_t>& out,
                  const Attrs& at, const std::string& op_name) {
  KgPwArgs g{};
  std::fill(std::begin(g.size), std::end(g.size), kg_divider(1));
  for (int k = 0; k < 2; ++k) {
    g.attr[k] = at.a[k];
    g.iattr[k] = at.i[k];
  }
  const Plan p = make_plan(in, out);
  g.n = p.n;
  g.same = (p.n == 0 || p.same) ? 1 : 0;
  if (g.same) return g;
  if (const std::string why = gpu_unfit(p, in, out); !why.empty()) throw Error(util::cat(op_name, ": ", why));
  const std::size_t rank = p.size.size();
  g.rank = static_cast<int>(rank);
  for (std::size_t d = 0; d < rank; ++d) {  // innermost first
    const std::size_t src = rank - 1 - d;
    g.size[d] = kg_divider(p.size[src]);
    for (std::size_t j = 0; j < KG_PW_MAX_INPUTS; ++j) g.stride[j][d] = p.stride[src][j];
  }
  return g;
}

// y[i] = fn(a[.], b[.], c[.]) over the output with N inputs, walking the plan: contiguous when
// every input has the output's elements, else along the innermost merged dim with a carry.
template <int N, class R, class A, class B, class C, class Fn>
void run_plan(const CpuContext& ctx, const Plan& p, R* y, const A* a, const B* b, const C* c, const Fn& fn) {
  if (p.n == 0) return;
  auto at = [&](std::int64_t ia, [[maybe_unused]] std::int64_t ib, [[maybe_unused]] std::int64_t ic) -> R {
    if constexpr (N == 1)
      return fn(a[ia]);
    else if constexpr (N == 2)
      return fn(a[ia], b[ib]);
    else
      return fn(a[ia], b[ib], c[ic]);
  };
  if (p.same) {
    ctx.parallel_for(p.n, kGrain, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t i = lo; i < hi; ++i) y[i] = at(i, i, i);
    });
    return;
  }
  const std::size_t rank = p.size.size(), last = rank - 1;
  ctx.parallel_for(p.n, kGrain, [&](std::int64_t lo, std::int64_t hi) {
    std::vector<std::int64_t> k(rank, 0);
    std::array<std::int64_t, KG_PW_MAX_INPUTS> off{};
    std::int64_t rem = lo;
    for (std::size_t d = rank; d-- > 0;) {
      k[d] = rem % p.size[d];
      rem /= p.size[d];
      for (std::size_t j = 0; j < KG_PW_MAX_INPUTS; ++j) off[j] += k[d] * p.stride[d][j];
    }
    const std::int64_t inner = p.size[last];
    const auto& s = p.stride[last];
    for (std::int64_t i = lo; i < hi;) {
      const std::int64_t run = std::min(inner - k[last], hi - i);
      for (std::int64_t t = 0; t < run; ++t)
        y[i + t] = at(off[0] + t * s[0], off[1] + t * s[1], off[2] + t * s[2]);
      i += run;
      k[last] += run;
      for (std::size_t j = 0; j < KG_PW_MAX_INPUTS; ++j) off[j] += run * s[j];
      for (std::size_t d = last; d > 0 && k[d] == p.size[d]; --d) {
        k[d] = 0;
        ++k[d - 1];
        for (std::size_t j = 0; j < KG_PW_MAX_INPUTS; ++j)
          off[j] += p.stride[d - 1][j] - p.size[d] * p.stride[d][j];
      }
    }
  });
}

std::vector<std::vector<std::int64_t>> shapes_of(std::span<const Tensor> ts) {
  std::vector<std::vector<std::int64_t>> v;
  for (const auto& t : ts) v.push_back(t.shape());
  return v;
}

std::vector<std::vector<std::int64_t>> shapes_of(const std::vector<DeviceTensor>& ts) {
  std::vector<std::vector<std::int64_t>> v;
  for (const auto& t : ts) v.push_back(t.shape);
  return v;
}

// ---- the GPU launch ----

// One launch of the op's entry: entry(inputs..., y, KgPwArgs), a thread per KG_UNROLL output
// elements in grid-stride loops.
class PointwiseRuntime final : public RuntimeOp {
 public:
  PointwiseRuntime(std::string op_name, Attrs attrs) : op_name_(std::move(op_name)), attrs_(attrs) {}
  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    const KgPwArgs args = gpu_args(shapes_of(t.inputs), t.output.shape, attrs_, op_name_);
    for (const auto& in : t.inputs) v.pointer(in.ptr);
    v.pointer(t.output.ptr);
    v.bytes(&args, sizeof args);
  }
  Dim3 block() const override { return {kGpuThreads, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>& shape) const override {
    return grid_1d((numel_of(shape) + KG_UNROLL - 1) / KG_UNROLL, kGpuThreads);
  }

 private:
  std::string op_name_;
  Attrs attrs_;
};

// The kernel source of one op instance: pointwise.cu, the functor KgPwOp computing `expr` over
// inputs of dtypes `in` (named a, b, c; bool inputs read as v != 0) into `out`, with T the C type
// of `t`, and the entry.
std::string op_source(const std::string& entry, const std::vector<DType>& in, DType t, DType out,
                      const std::string& expr) {
  static const char* const names[KG_PW_MAX_INPUTS] = {"a", "b", "c"};
  std::string args, norm, params;
  for (std::size_t j = 0; j < in.size(); ++j) {
    args += util::cat(c_type(in[j]), " ", names[j], ", ");
    if (in[j] == DType::Bool) norm += util::cat("    ", names[j], " = (kg_bool)(", names[j], " != 0);\n");
    params += util::cat("const ", c_type(in[j]), "* __restrict__ ", names[j], ", ");
  }
  const std::size_t n = in.size();
  const std::string call = util::cat("kg_pw_entry<", n, ", KgPwOp>(a, ", n > 1 ? "b" : "a", ", ",
                                     n > 2 ? "c" : (n > 1 ? "b" : "a"), ", y, p)");
  return util::cat("#define KG_PW_ONE_ENTRY\n", kernel_file("pointwise.cu"), "\nstruct KgPwOp {\n  typedef ",
                   c_type(t), " T;\n  typedef ", c_type(out),
                   " R;\n  __device__ __forceinline__ R operator()(", args, "const KgPwArgs& p) const {\n",
                   norm, "    (void)p;\n    return (R)(", expr,
                   ");\n  }\n};\n\nextern \"C\" __global__ void __launch_bounds__(KG_PW_THREADS)\n    ",
                   entry, "(", params, c_type(out), "* __restrict__ y, KgPwArgs p) {\n  ", call, ";\n}\n");
}

// The lowering of an op instance, or nullopt on the CPU where the broadcast has more merged dims
// than the kernel walks (cpu_forward runs it instead); on a GPU that is an error.
std::optional<Lowered> lowering(const LowerContext& ctx, const std::string& op_name, const std::string& entry,
                                DType t, const std::string& expr, const Attrs& attrs) {
  if (!ctx.concrete_input_shapes.empty()) {
    const Plan p = make_plan(ctx.concrete_input_shapes, ctx.concrete_output_shape);
    if (const std::string why = gpu_unfit(p, ctx.concrete_input_shapes, ctx.concrete_output_shape);
        !why.empty()) {
      if (ctx.emulated()) return std::nullopt;
      throw Error(why);
    }
  }
  return Lowered{op_name, op_source(entry, ctx.input_dtypes, t, ctx.output_dtype, expr), entry,
                 std::make_shared<PointwiseRuntime>(op_name, attrs)};
}

// Clip's bounds for an integer dtype: ceil(min) and floor(max) within the dtype's range.
template <class T>
void integer_bounds(Attrs& at) {
  const auto lo = static_cast<std::int64_t>(std::numeric_limits<T>::min());
  const auto hi = static_cast<std::int64_t>(std::numeric_limits<T>::max());
  at.i[0] = std::clamp(double_to_i64(std::ceil(at.a[0])), lo, hi);
  at.i[1] = std::clamp(double_to_i64(std::floor(at.a[1])), lo, hi);
}

// ---- elementwise forms (the fusion pass) ----

// True when the function has an elementwise form for f32 and f64 inputs: one or two inputs of
// the output's dtype. Not the comparisons, IsNaN, IsInf and the logical ops (bool results), the
// bitwise ops (integers only) or Where (a bool condition).
constexpr bool has_form(PointwiseFn fn) {
  const FnInfo& f = info(fn);
  return f.arity <= 2 && !f.bool_out && f.takes != Takes::Bool && f.takes != Takes::Integer;
}

// The table's expression for a float dtype with the attributes as literals (Clip's bounds through
// kg_pw_clamp), or "" when it would still read the kernel's arguments p.
std::string form_expr(PointwiseFn fn, const Attrs& at) {
  if (fn == P::Clip)
    return util::cat("kg_pw_clamp(a, (T)", device_literal(at.a[0]), ", (T)", device_literal(at.a[1]), ")");
  std::string e = info(fn).expr;
  for (int k = 0; k < info(fn).attrs; ++k) {
    const std::string ref = util::cat("p.attr[", k, "]"), lit = device_literal(at.a[k]);
    for (std::size_t i = e.find(ref); i != std::string::npos; i = e.find(ref, i + lit.size()))
      e.replace(i, ref.size(), lit);
  }
  // An expression that still reads p (an argument not replaced above) gets no form.
  auto ident = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (std::size_t i = 0; i < e.size(); ++i)
    if (e[i] == 'p' && (i == 0 || !ident(e[i - 1])) && (i + 1 == e.size() || !ident(e[i + 1]))) return {};
  return e;
}

// ---- the ops ----

class PointwiseOp final : public CustomOp {
 public:
  PointwiseOp(PointwiseFn fn, const std::vector<double>& attrs) : fn_(fn) {
    const FnInfo& f = info(fn);
    if (static_cast<int>(attrs.size()) != f.attrs) {
      std::string names;
      for (int k = 0; k < f.attrs; ++k) names += util::cat(k ? ", " : "", f.attr_names[k]);
      throw Error(f.attrs == 0
                      ? util::cat(f.name, " takes no attributes, got ", attrs.size())
                      : util::cat(f.name, " takes ", f.attrs, f.attrs == 1 ? " attribute (" : " attributes (",
                                  names, "), got ", attrs.size()));
    }
    for (std::size_t k = 0; k < attrs.size(); ++k) {
      if (std::isnan(attrs[k]))
        throw Error(util::cat(f.name, ": attribute ", f.attr_names[k], " is NaN",
                              fn == P::Clip ? " (an open side of Clip is ±infinity)" : ""));
      if (fn != P::Clip && !std::isfinite(attrs[k]))
        throw Error(util::cat(f.name, ": attribute ", f.attr_names[k], " must be finite, got ", attrs[k]));
      attrs_.a[k] = attrs[k];
    }
    if (fn == P::Celu && attrs_.a[0] == 0.0) throw Error("pw.celu: alpha must not be 0");
  }

  std::string name() const override { return info(fn_).name; }
  PointwiseFn fn() const { return fn_; }
  double attr(int k) const { return attrs_.a[k]; }
  std::string attributes() const override {
    const FnInfo& f = info(fn_);
    std::string s;
    for (int k = 0; k < f.attrs; ++k)
      s += util::cat(k ? " " : "", f.attr_names[k], "=", format_double(attrs_.a[k]));
    return s;
  }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    const FnInfo& f = info(fn_);
    require_inputs(in, static_cast<std::size_t>(f.arity));
    if (f.arity == 1) return in[0];
    if (f.arity == 2) return broadcast_shapes(in[0], in[1]);
    try {
      return broadcast_shapes(broadcast_shapes(in[0], in[1]), in[2]);
    } catch (const Error& e) {
      throw Error(util::cat("inputs ", in[0].to_string(), ", ", in[1].to_string(), " and ", in[2].to_string(),
                            " do not broadcast: ", e.what()));
    }
  }

  DType infer_output_dtype(const std::vector<DType>& in) const override {
    const FnInfo& f = info(fn_);
    if (in.size() != static_cast<std::size_t>(f.arity))
      throw Error(util::cat("expects ", f.arity, " input(s), got ", in.size()));
    std::size_t x = 0;  // the input whose dtype the rule is about
    if (fn_ == P::Where) {
      if (in[0] != DType::Bool)
        throw Error(util::cat("the condition (input 0) must be bool, got ", dtype_name(in[0])));
      if (in[1] != in[2])
        throw Error(util::cat("x and y (inputs 1 and 2) must share one dtype, got ", dtype_name(in[1]),
                              " and ", dtype_name(in[2])));
      x = 1;
    } else if (f.arity == 2 && in[0] != in[1]) {
      throw Error(
          util::cat("inputs must share one dtype, got ", dtype_name(in[0]), " and ", dtype_name(in[1])));
    }
    const DType t = in[x];
    if (t == DType::F16 || t == DType::BF16)
      throw Error(util::cat("does not take ", dtype_name(t),
                            " inputs (cast them to f32 first; pw.cast is the "
                            "pointwise op that takes f16 and bf16)"));
    if (!fn_takes(fn_, t)) throw Error(util::cat(takes_text(f.takes), ", got ", dtype_name(t)));
    return f.bool_out ? DType::Bool : t;
  }

  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    const DType t = ctx.input_dtypes.at(fn_ == P::Where ? 1 : 0);
    const std::string stem = name().substr(3);  // after "pw."
    return lowering(ctx, name(), util::cat("kg_pw_", stem, "_", dtype_name(t)), t, info(fn_).expr,
                    attrs_for(t));
  }

  // f = the unfused kernel's expression with the attributes as literals, on the CPU the same
  // scalar function as cpu_forward. No derivative (the family has no backward): fused in
  // inference only. The helpers it calls are pointwise.cuh's, which every module a form goes into
  // (a fused group's, a convolution's epilogue) includes.
  std::optional<ElementwiseForm> elementwise_form(const std::vector<DType>& in) const override {
    const FnInfo& f = info(fn_);
    if (!has_form(fn_) || in.size() != static_cast<std::size_t>(f.arity)) return std::nullopt;
    const DType t = in[0];
    if (t != DType::F32 && t != DType::F64) return std::nullopt;
    for (DType d : in)
      if (d != t) return std::nullopt;
    const Attrs at = attrs_for(t);
    const std::string expr = form_expr(fn_, at);
    if (expr.empty()) return std::nullopt;
    ElementwiseForm form;
    form.function = "f";
    form.device_source =
        util::cat("template <class T> __device__ __forceinline__ T f(T a",
                  f.arity == 2 ? ", T b" : "", ") { return (T)(", expr, "); }\n");
    visit_fn(fn_, [&](auto fc) {
      constexpr PointwiseFn F = decltype(fc)::value;
      if constexpr (has_form(F)) {
        if constexpr (info(F).arity == 1)
          form.cpu = ElementwiseForm::cpu_map<1>([at](auto a) { return unary_fn<F>(a, at); });
        else
          form.cpu = ElementwiseForm::cpu_map<2>([](auto a, auto b) { return binary_fn<F>(a, b); });
      }
    });
    return form;
  }

  void cpu_forward(CpuContext& ctx) const override {
    const DType t = ctx.inputs[fn_ == P::Where ? 1 : 0].dtype();
    const Plan p = make_plan(shapes_of(ctx.inputs), ctx.output.shape());
    const Attrs at = attrs_for(t);
    visit_fn(fn_, [&](auto fc) {
      constexpr PointwiseFn F = decltype(fc)::value;
      visit_dtype(t, [&](auto dc) {
        constexpr DType D = decltype(dc)::value;
        if constexpr (fn_takes(F, D))
          run<F, D>(ctx, p, at);
        else
          throw Error(util::cat(takes_text(info(F).takes), ", got ", dtype_name(D)));
      });
    });
  }

 private:
  // The attributes for inputs of dtype t (Clip's integer bounds in t's range).
  Attrs attrs_for(DType t) const {
    Attrs at = attrs_;
    if (fn_ == P::Clip && is_integer(t))
      visit_dtype(t, [&](auto dc) {
        constexpr DType D = decltype(dc)::value;
        if constexpr (is_integer(D)) integer_bounds<St<D>>(at);
      });
    return at;
  }

  template <PointwiseFn F, DType D>
  static void run(CpuContext& ctx, const Plan& p, const Attrs& at) {
    using T = St<D>;
    using R = std::conditional_t<info(F).bool_out, std::uint8_t, T>;
    R* y = static_cast<R*>(ctx.output.raw());
    auto ld = [](T v) {
      if constexpr (D == DType::Bool)
        return static_cast<T>(v != 0);
      else
        return v;
    };
    constexpr int N = info(F).arity;
    if constexpr (N == 1) {
      const T* a = static_cast<const T*>(ctx.inputs[0].raw());
      run_plan<1>(ctx, p, y, a, a, a, [&](T u) { return static_cast<R>(unary_fn<F, T>(ld(u), at)); });
    } else if constexpr (N == 2) {
      const T* a = static_cast<const T*>(ctx.inputs[0].raw());
      const T* b = static_cast<const T*>(ctx.inputs[1].raw());
      run_plan<2>(ctx, p, y, a, b, b,
                  [&](T u, T v) { return static_cast<R>(binary_fn<F, T>(ld(u), ld(v))); });
    } else {
      const auto* c = static_cast<const std::uint8_t*>(ctx.inputs[0].raw());
      const T* a = static_cast<const T*>(ctx.inputs[1].raw());
      const T* b = static_cast<const T*>(ctx.inputs[2].raw());
      run_plan<3>(ctx, p, y, c, a, b, [&](std::uint8_t w, T u, T v) { return w ? ld(u) : ld(v); });
    }
  }

  PointwiseFn fn_;
  Attrs attrs_;
};

class CastOp final : public CustomOp {
 public:
  explicit CastOp(DType to) : to_(to) {}
  std::string name() const override { return "pw.cast"; }
  std::string attributes() const override { return util::cat("to=", dtype_name(to_)); }
  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    return in[0];
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override {
    if (in.size() != 1) throw Error(util::cat("expects 1 input(s), got ", in.size()));
    return to_;
  }

  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    const DType from = ctx.input_dtypes.at(0);
    return lowering(ctx, name(), util::cat("kg_pw_cast_", dtype_name(from), "_", dtype_name(to_)), from,
                    cast_expr(from, to_), Attrs{});
  }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    const Plan p = make_plan(shapes_of(ctx.inputs), ctx.output.shape());
    visit_dtype(x.dtype(), [&](auto fc) {
      constexpr DType From = decltype(fc)::value;
      visit_dtype(to_, [&](auto tc) { run<From, decltype(tc)::value>(ctx, p); });
    });
  }

 private:
  template <DType From, DType To>
  static void run(CpuContext& ctx, const Plan& p) {
    const auto* a = static_cast<const St<From>*>(ctx.inputs[0].raw());
    run_plan<1>(ctx, p, static_cast<St<To>*>(ctx.output.raw()), a, a, a,
                [](St<From> v) { return cast_value<From, To>(v); });
  }
  DType to_;
};

}  // namespace

const char* pointwise_name(PointwiseFn fn) {
  if (static_cast<std::size_t>(fn) >= std::size(kFns))
    throw Error(util::cat("unknown pointwise function ", static_cast<int>(fn)));
  return info(fn).name;
}

int pointwise_arity(PointwiseFn fn) {
  pointwise_name(fn);  // checks the value
  return info(fn).arity;
}

std::optional<std::pair<double, double>> clip_bounds(const CustomOp& op) {
  const auto* p = dynamic_cast<const PointwiseOp*>(&op);
  if (!p || p->fn() != PointwiseFn::Clip) return std::nullopt;
  return std::pair{p->attr(0), p->attr(1)};
}

CustomData pointwise_op(PointwiseFn fn, const std::vector<double>& attrs) {
  pointwise_name(fn);
  return CustomData::make<PointwiseOp>(fn, attrs);
}

SymTensor pointwise(PointwiseFn fn, const std::vector<SymTensor>& inputs, const std::vector<double>& attrs,
                    const std::string& name) {
  const CustomData op = pointwise_op(fn, attrs);
  if (inputs.empty())
    throw Error(util::cat("[", pointwise_name(fn), name.empty() ? "" : " @ " + name, "] expects ",
                          pointwise_arity(fn), " input(s), got 0"));
  return inputs[0].record_custom(op, std::vector<SymTensor>(inputs.begin() + 1, inputs.end()), std::nullopt,
                                 name);
}

CustomData cast_op(DType to) { return CustomData::make<CastOp>(to); }

SymTensor cast(const SymTensor& x, DType to, const std::string& name) {
  return x.record_custom(cast_op(to), {}, std::nullopt, name);
}

}  // namespace kg::ops
