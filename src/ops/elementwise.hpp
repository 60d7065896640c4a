// The elementwise op family: activations, dropout and broadcasting arithmetic. Every formula is
// written once here, as a scalar function selected by an enum (one table of unary ops, one of
// binary ops), so that the CPU loops and fusion (a convolution epilogue applying an activation)
// share it, and a GPU lowering maps the same enums to device functions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "kg/cpu_math.hpp"
#include "kg/custom_op.hpp"
#include "kg/runtime_op.hpp"
#include "ops/elementwise_shared.cuh"

namespace kg::ops {

// ---- float math that vectorises ----
// The formulas use the public vectorisable forms of <kg/cpu_math.hpp> (glibc's expf, erfcf and
// tanhf are calls the compiler cannot vectorise without -ffast-math). These names are the f32
// forms under the names the op code's tests measure.

inline float exp_f32(float x) { return cpu_math::exp(x); }
inline float tanh_f32(float x) { return cpu_math::tanh(x); }
inline float erfc_f32(float x) { return cpu_math::erfc(x); }

// ---- unary ops ----

enum class UnaryFn : std::uint8_t { Relu, LeakyRelu, Silu, GeluErf, GeluTanh, Sigmoid, Tanh };

struct UnaryEntry {
  UnaryFn fn;
  const char* op_name;    // the CustomOp name, "nn.relu"
  const char* kernel;     // the GPU entry's stem, "kg_relu" (+ "_f32" / "_f64")
  const char* device_fn;  // the formula in elementwise.cuh, "KG_RELU"
};

// One row per unary op, in UnaryFn order.
inline constexpr UnaryEntry kUnaryOps[] = {
    {UnaryFn::Relu, "nn.relu", "kg_relu", "KG_RELU"},
    {UnaryFn::LeakyRelu, "nn.leaky_relu", "kg_leaky_relu", "KG_LEAKY_RELU"},
    {UnaryFn::Silu, "nn.silu", "kg_silu", "KG_SILU"},
    {UnaryFn::GeluErf, "nn.gelu", "kg_gelu_erf", "KG_GELU_ERF"},
    {UnaryFn::GeluTanh, "nn.gelu", "kg_gelu_tanh", "KG_GELU_TANH"},
    {UnaryFn::Sigmoid, "nn.sigmoid", "kg_sigmoid", "KG_SIGMOID"},
    {UnaryFn::Tanh, "nn.tanh", "kg_tanh", "KG_TANH"},
};

// y = f(x) in the precision T. `param` is LeakyRelu's negative slope; the others ignore it.
// NaN propagates as in PyTorch.
template <UnaryFn F, class T>
inline T unary_fn(T x, [[maybe_unused]] T param) {
  if constexpr (F == UnaryFn::Relu) {
    return x < T(0) ? T(0) : x;
  } else if constexpr (F == UnaryFn::LeakyRelu) {
    return x < T(0) ? x * param : x;
  } else if constexpr (F == UnaryFn::Silu) {
    return x / (T(1) + cpu_math::exp(-x));
  } else if constexpr (F == UnaryFn::GeluErf) {
    return cpu_math::gelu(x);  // 0.5 x (1 + erf(x/√2)), written with erfc
  } else if constexpr (F == UnaryFn::GeluTanh) {
    return cpu_math::gelu_tanh(x);  // 0.5 x (1 + tanh(u)) as x / (1 + exp(-2u))
  } else if constexpr (F == UnaryFn::Sigmoid) {
    return cpu_math::sigmoid(x);
  } else {
    static_assert(F == UnaryFn::Tanh);
    return cpu_math::tanh(x);
  }
}

// What the derivative of a unary op reads: its output (Relu, Sigmoid, Tanh) or its input.
constexpr bool unary_grad_uses_output(UnaryFn f) {
  return f == UnaryFn::Relu || f == UnaryFn::Sigmoid || f == UnaryFn::Tanh;
}

// dx = dy * f'(.) in the precision T, PyTorch's formulas. `s` is the op's output when
// unary_grad_uses_output(F), else its input; `param` is LeakyRelu's negative slope.
template <UnaryFn F, class T>
inline T unary_grad(T s, T dy, [[maybe_unused]] T param) {
  if constexpr (F == UnaryFn::Relu) {
    return s <= T(0) ? T(0) : dy;  // s = y; NaN passes the gradient, as threshold_backward
  } else if constexpr (F == UnaryFn::LeakyRelu) {
    return s > T(0) ? dy : dy * param;
  } else if constexpr (F == UnaryFn::Silu) {
    const T sig = cpu_math::sigmoid(s);
    return dy * (sig * (T(1) + s * (T(1) - sig)));
  } else if constexpr (F == UnaryFn::GeluErf) {
    // Φ(x) + x φ(x), Φ written with erfc as in the forward.
    constexpr T inv_sqrt2 = T(0.70710678118654752440084436210484903928);
    constexpr T inv_sqrt_2pi = T(0.39894228040143267793994605993438186848);
    const T cdf = T(0.5) * cpu_math::erfc(-s * inv_sqrt2);
    const T pdf = inv_sqrt_2pi * cpu_math::exp(T(-0.5) * s * s);
    return dy * (cdf + s * pdf);
  } else if constexpr (F == UnaryFn::GeluTanh) {
    constexpr T beta = T(0.79788456080286535587989211986876373695);  // √(2/π)
    constexpr T kappa = T(0.044715);
    const T x2 = s * s;
    const T t = cpu_math::tanh(beta * (s + kappa * x2 * s));
    const T left = T(0.5) * s, right = T(1) + t;
    return dy * (T(0.5) * right + left * (T(1) - t * t) * (beta * (T(1) + T(3) * kappa * x2)));
  } else if constexpr (F == UnaryFn::Sigmoid) {
    return dy * ((T(1) - s) * s);
  } else {
    static_assert(F == UnaryFn::Tanh);
    return dy * (T(1) - s * s);
  }
}

// Calls fn(std::integral_constant<UnaryFn, F>{}) for the runtime value `f`, so that a loop
// written once is instantiated (and vectorised) per function.
template <class Fn>
decltype(auto) visit_unary(UnaryFn f, Fn&& fn) {
  using U = UnaryFn;
  switch (f) {
    case U::Relu:
      return fn(std::integral_constant<U, U::Relu>{});
    case U::LeakyRelu:
      return fn(std::integral_constant<U, U::LeakyRelu>{});
    case U::Silu:
      return fn(std::integral_constant<U, U::Silu>{});
    case U::GeluErf:
      return fn(std::integral_constant<U, U::GeluErf>{});
    case U::GeluTanh:
      return fn(std::integral_constant<U, U::GeluTanh>{});
    case U::Sigmoid:
      return fn(std::integral_constant<U, U::Sigmoid>{});
    case U::Tanh:
      break;
  }
  return fn(std::integral_constant<U, U::Tanh>{});
}

// What a unary elementwise node computes.
struct UnarySpec {
  UnaryFn fn = UnaryFn::Relu;
  double param = 0.0;  // LeakyRelu's negative slope
};

// The spec of an activation node (nn.relu, nn.leaky_relu, nn.silu, nn.gelu, nn.sigmoid,
// nn.tanh); nullopt for any other op. Fusion passes use it to recognise and absorb them.
std::optional<UnarySpec> unary_spec(const CustomOp& op);

// y[i] = f(x[i]) over n contiguous elements on the calling thread (y may equal x), for callers
// that split the work themselves, such as a fused epilogue. Instantiated for float and double.
template <class T>
void apply_unary(const UnarySpec& spec, const T* x, T* y, std::int64_t n);

// The GPU half (RuntimeOp) of nn.dropout with probability p. Its forward launch depends on the
// run (LaunchTensors::training and seed): in train mode the mask the CPU draws from the run's
// seed, else a copy. `training` selects what its backward launch computes: the forward's mask
// drawn again from LaunchTensors::seed when LaunchTensors::training, or the identity; the op's
// lower() builds it for training.
std::shared_ptr<RuntimeOp> dropout_runtime(double p, DType dtype, bool training);

// ---- binary ops ----

enum class BinaryFn : std::uint8_t { Add, Sub, Mul, Div };

struct BinaryEntry {
  BinaryFn fn;
  const char* op_name;          // tensor ⊙ tensor with broadcasting, "nn.add"
  const char* scalar_op_name;   // tensor ⊙ scalar, "nn.add_scalar"
  const char* rscalar_op_name;  // scalar ⊙ tensor where the order matters, "nn.rsub_scalar"; else null
  // The GPU entries' stems, in the same roles (+ "_f32" / "_f64"), and the formula in
  // elementwise.cuh ("KG_ADD").
  const char* kernel;
  const char* scalar_kernel;
  const char* rscalar_kernel;
  const char* device_fn;
};

// One row per binary op, in BinaryFn order.
inline constexpr BinaryEntry kBinaryOps[] = {
    {BinaryFn::Add, "nn.add", "nn.add_scalar", nullptr, "kg_add", "kg_add_scalar", nullptr, "KG_ADD"},
    {BinaryFn::Sub, "nn.sub", "nn.sub_scalar", "nn.rsub_scalar", "kg_sub", "kg_sub_scalar", "kg_rsub_scalar",
     "KG_SUB"},
    {BinaryFn::Mul, "nn.mul", "nn.mul_scalar", nullptr, "kg_mul", "kg_mul_scalar", nullptr, "KG_MUL"},
    {BinaryFn::Div, "nn.div", "nn.div_scalar", "nn.rdiv_scalar", "kg_div", "kg_div_scalar", "kg_rdiv_scalar",
     "KG_DIV"},
};

// y = a ⊙ b in the precision T.
template <BinaryFn F, class T>
inline T binary_fn(T a, T b) {
  if constexpr (F == BinaryFn::Add) {
    return a + b;
  } else if constexpr (F == BinaryFn::Sub) {
    return a - b;
  } else if constexpr (F == BinaryFn::Mul) {
    return a * b;
  } else {
    static_assert(F == BinaryFn::Div);
    return a / b;
  }
}

// As visit_unary, for BinaryFn.
template <class Fn>
decltype(auto) visit_binary(BinaryFn f, Fn&& fn) {
  using B = BinaryFn;
  switch (f) {
    case B::Add:
      return fn(std::integral_constant<B, B::Add>{});
    case B::Sub:
      return fn(std::integral_constant<B, B::Sub>{});
    case B::Mul:
      return fn(std::integral_constant<B, B::Mul>{});
    case B::Div:
      break;
  }
  return fn(std::integral_constant<B, B::Div>{});
}

// The function of an nn.add, nn.sub, nn.mul or nn.div node (tensor ⊙ tensor); nullopt for any
// other op.
std::optional<BinaryFn> binary_fn(const CustomOp& op);

// What a tensor ⊙ scalar node computes: x ⊙ scalar, or scalar ⊙ x when `reversed` (rsub, rdiv).
struct ScalarSpec {
  BinaryFn fn = BinaryFn::Add;
  double scalar = 0.0;
  bool reversed = false;
};
// The spec of an nn.<fn>_scalar node; nullopt for any other op.
std::optional<ScalarSpec> scalar_spec(const CustomOp& op);

// ---- the GPU's view of a broadcast ----

// How a binary op's GPU kernel walks its operands for concrete shapes: the KgBroadcast of
// elementwise_shared.cuh, passed by value. The dims are merged as far as possible first, so that
// the common patterns take a fast path:
//   KG_BCAST_SAME:      a[i] ⊙ b[i]
//   KG_BCAST_SCALAR_B:  a[i] ⊙ b[0]                (KG_BCAST_SCALAR_A mirrored)
//   KG_BCAST_CHANNEL_B: a[i] ⊙ b[(i / inner) % c]  (per-channel and bias patterns;
//                       KG_BCAST_CHANNEL_A mirrored), with inner = size[0].d and c = size[1].d
//   KG_BCAST_GENERAL:   up to KG_EW_MAX_DIMS merged dims, innermost first: output index i
//                       unravels into k[d] < size[d].d and reads a[Σ k[d] stride_a[d]],
//                       b[Σ k[d] stride_b[d]].
// Throws kg::Error (naming `op_name` and the shapes) when the general case needs more than
// KG_EW_MAX_DIMS dims.
KgBroadcast gpu_broadcast(const std::vector<std::int64_t>& a, const std::vector<std::int64_t>& b,
                          const std::vector<std::int64_t>& out, const char* op_name);

}  // namespace kg::ops
