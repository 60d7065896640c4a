// lenet.scaled_tanh: y = A·tanh(S·x). Everything here uses the public API only, the way a user
// adds an op: the kernel sources are raw strings, generated for the op's dtype.
#include "models/scaled_tanh.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>

#include "kg/cpu_math.hpp"
#include "kg/error.hpp"
#include "kg/graph.hpp"
#include "kg/models.hpp"
#include "kg/runtime_op.hpp"

namespace kg::models {
namespace {

constexpr unsigned kThreads = 256;
// Grid-stride loops: more blocks than this only add scheduling work.
constexpr std::int64_t kMaxBlocks = 4096;

// One thread per element in a grid-stride loop. `scalar_t` (float or double) and `scalar_tanh`
// (tanhf or tanh) are defined in front of it.
const char* const kForwardSource = R"(
extern "C" __global__ void __launch_bounds__(256)
lenet_scaled_tanh_forward(const scalar_t* __restrict__ x, scalar_t* __restrict__ y, long long n,
                          scalar_t a, scalar_t s) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = a * scalar_tanh(s * x[i]);
}
)";

// dx = dy · A·S·(1 - (y/A)²), from the saved output. dx is null when no input gradient is
// wanted; the kernel then does nothing.
const char* const kBackwardSource = R"(
extern "C" __global__ void __launch_bounds__(256)
lenet_scaled_tanh_backward(const scalar_t* __restrict__ y, const scalar_t* __restrict__ dy,
                           scalar_t* __restrict__ dx, long long n, scalar_t a, scalar_t s) {
  if (dx == 0) return;
  const scalar_t as = a * s;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const scalar_t t = y[i] / a;
    dx[i] = dy[i] * as * ((scalar_t)1 - t * t);
  }
}
)";

std::string with_scalar(DType dtype, const char* body) {
  return std::string(dtype == DType::F64 ? "typedef double scalar_t;\n#define scalar_tanh tanh\n"
                                         : "typedef float scalar_t;\n#define scalar_tanh tanhf\n") +
         body;
}

Dim3 blocks_for(std::int64_t n) {
  const std::int64_t b = std::clamp<std::int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks);
  return {static_cast<unsigned>(b), 1, 1};
}

class ScaledTanhRuntime final : public RuntimeOp {
 public:
  ScaledTanhRuntime(DType dtype, double a, double s) : dtype_(dtype), a_(a), s_(s) {}

  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    v.pointer(t.inputs.at(0).ptr);
    v.pointer(t.output.ptr);
    v.i64(t.output.numel());
    scalars(v);
  }
  Dim3 block() const override { return {kThreads, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>& shape) const override { return blocks_for(numel_of(shape)); }

  // One launch; dx is null (the kernel does nothing) when no input gradient is wanted.
  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    Launch l;
    l.entry = "lenet_scaled_tanh_backward";
    l.block = {kThreads, 1, 1};
    l.grid = blocks_for(t.grad_output.numel());
    l.args = {t.output, t.grad_output, ptr(t.grad_inputs.empty() ? DevicePtr{0} : t.grad_inputs[0].ptr),
              t.grad_output.numel()};
    scalars(l.args);
    return {l};
  }

 private:
  void scalars(ArgVisitor& v) const {
    if (dtype_ == DType::F64) {
      v.f64(a_);
      v.f64(s_);
    } else {
      v.f32(static_cast<float>(a_));
      v.f32(static_cast<float>(s_));
    }
  }
  DType dtype_;
  double a_, s_;
};

// y = A·tanh(S·x) over n elements, and the derivative dy/dx = A·S·(1 - (y/A)²) from y, times dy
// where dy is given. kg::cpu_math::apply_n vectorises them (tanh included: std::tanh would be a
// library call per element) in the widest copy of the loop the CPU runs.
template <class T>
void forward_span(std::int64_t n, const T* x, T* y, T a, T s) {
  cpu_math::apply_n(
      n, y, [a, s](T v) { return a * cpu_math::tanh(s * v); }, x);
}

template <class T>
void derivative_span(std::int64_t n, const T* y, const T* dy, T* dx, T a, T s) {
  const T as = a * s;
  if (dy == nullptr) {
    cpu_math::apply_n(
        n, dx,
        [a, as](T v) {
          const T t = v / a;
          return as * (T(1) - t * t);
        },
        y);
  } else {
    cpu_math::apply_n(
        n, dx,
        [a, as](T v, T g) {
          const T t = v / a;
          return g * as * (T(1) - t * t);
        },
        y, dy);
  }
}

template <class T>
void forward_cpu(CpuContext& ctx, T a, T s) {
  const T* x = ctx.inputs[0].data<T>();
  T* y = ctx.output.data<T>();
  ctx.parallel_for(ctx.output.numel(), 1 << 14,
                   [&](std::int64_t b, std::int64_t e) { forward_span<T>(e - b, x + b, y + b, a, s); });
}

template <class T>
void backward_cpu(CpuBackwardContext& ctx, T a, T s) {
  const T* y = ctx.output.data<T>();
  const T* dy = ctx.grad_output.data<T>();
  T* dx = ctx.grad_inputs[0].data<T>();
  ctx.parallel_for(ctx.grad_output.numel(), 1 << 14, [&](std::int64_t b, std::int64_t e) {
    derivative_span<T>(e - b, y + b, dy + b, dx + b, a, s);
  });
}

}  // namespace

ScaledTanh::ScaledTanh(DType dtype, double amplitude, double slope)
    : dtype_(dtype), a_(amplitude), s_(slope) {
  if (dtype != DType::F32 && dtype != DType::F64)
    throw Error(std::string("lenet.scaled_tanh: supports f32 and f64, not ") +
                std::string(dtype_name(dtype)));
  if (!std::isfinite(amplitude) || amplitude == 0.0 || !std::isfinite(slope))
    throw Error("lenet.scaled_tanh: the amplitude must be finite and non-zero and the slope finite, got A=" +
                std::to_string(amplitude) + " S=" + std::to_string(slope));
}

std::string ScaledTanh::attributes() const {
  char buf[64];
  std::snprintf(buf, sizeof buf, "A=%g S=%g", a_, s_);
  return buf;
}

Shape ScaledTanh::infer_output_shape(const std::vector<Shape>& in) const {
  if (in.size() != 1) throw Error("takes one input, got " + std::to_string(in.size()));
  return in[0];
}

DType ScaledTanh::infer_output_dtype(const std::vector<DType>& in) const {
  if (in.size() != 1) throw Error("takes one input, got " + std::to_string(in.size()));
  if (in[0] != dtype_)
    throw Error("was made for " + std::string(dtype_name(dtype_)) + " inputs but the input is " +
                std::string(dtype_name(in[0])) + " (kg::models::scaled_tanh takes the input's dtype)");
  return in[0];
}

std::optional<Lowered> ScaledTanh::lower(const LowerContext&) const {
  return Lowered{name(), with_scalar(dtype_, kForwardSource), "lenet_scaled_tanh_forward",
                 std::make_shared<ScaledTanhRuntime>(dtype_, a_, s_)};
}

std::string ScaledTanh::lower_backward_source(const LowerContext&) const {
  return with_scalar(dtype_, kBackwardSource);
}

std::optional<ElementwiseForm> ScaledTanh::elementwise_form(const std::vector<DType>& in) const {
  if (in.size() != 1 || in[0] != dtype_) return std::nullopt;
  char consts[96];
  std::snprintf(consts, sizeof consts, "const double A = %.17g, S = %.17g;\n", a_, s_);
  ElementwiseForm f;
  f.function = "scaled_tanh";
  f.derivative = "scaled_tanh_grad";
  // The derivative from the output, as the backward kernel: A·S·(1 - (y/A)²).
  f.device_source = std::string(consts) + R"(
__device__ __forceinline__ float scaled_tanh(float x) { return (float)A * tanhf((float)S * x); }
__device__ __forceinline__ double scaled_tanh(double x) { return A * tanh(S * x); }
template <class T>
__device__ __forceinline__ T scaled_tanh_grad(int, T, T y) {
  const T t = y / (T)A;
  return (T)A * (T)S * ((T)1 - t * t);
}
)";
  const double a = a_, s = s_;
  f.cpu = [a, s](const ElementwiseSpan& sp) {
    if (sp.dtype == DType::F64)
      forward_span<double>(sp.n, static_cast<const double*>(sp.inputs[0]), static_cast<double*>(sp.result), a,
                           s);
    else
      forward_span<float>(sp.n, static_cast<const float*>(sp.inputs[0]), static_cast<float*>(sp.result),
                          static_cast<float>(a), static_cast<float>(s));
  };
  f.cpu_derivative = [a, s](const ElementwiseSpan& sp) {
    if (sp.dtype == DType::F64)
      derivative_span<double>(sp.n, static_cast<const double*>(sp.output), nullptr,
                              static_cast<double*>(sp.result), a, s);
    else
      derivative_span<float>(sp.n, static_cast<const float*>(sp.output), nullptr,
                             static_cast<float*>(sp.result), static_cast<float>(a), static_cast<float>(s));
  };
  return f;
}

void ScaledTanh::cpu_forward(CpuContext& ctx) const {
  if (dtype_ == DType::F64)
    forward_cpu<double>(ctx, a_, s_);
  else
    forward_cpu<float>(ctx, static_cast<float>(a_), static_cast<float>(s_));
}

void ScaledTanh::cpu_backward(CpuBackwardContext& ctx) const {
  if (!ctx.wants_input_grad(0)) return;
  if (dtype_ == DType::F64)
    backward_cpu<double>(ctx, a_, s_);
  else
    backward_cpu<float>(ctx, static_cast<float>(a_), static_cast<float>(s_));
}

CustomData scaled_tanh_op(DType dtype, double amplitude, double slope) {
  return CustomData::make<ScaledTanh>(dtype, amplitude, slope);
}

SymTensor scaled_tanh(const SymTensor& x, const std::string& name) {
  return x.record_custom(scaled_tanh_op(x.dtype()), {}, std::nullopt, name);
}

}  // namespace kg::models
