// user.swish: y = x·sigmoid(x), dy/dx = s·(1 + x·(1 - s)) with s = sigmoid(x). Public API only; the
// kernel sources are raw strings for f32 and f64.
#include "models/swish.hpp"

#include <algorithm>
#include <cmath>
#include <memory>

#include "kg/error.hpp"
#include "kg/graph.hpp"
#include "kg/models.hpp"
#include "kg/runtime_op.hpp"

namespace kg::models {
namespace {

constexpr unsigned kThreads = 256;
constexpr std::int64_t kMaxBlocks = 8192;

// The per-element functions, shared by the standalone kernels and the fused form.
const char* const kDeviceFunctions = R"(
__device__ __forceinline__ float swish_exp(float v) { return expf(v); }
__device__ __forceinline__ double swish_exp(double v) { return exp(v); }
template <class T>
__device__ __forceinline__ T swish(T x) { return x / ((T)1 + swish_exp(-x)); }
template <class T>
__device__ __forceinline__ T swish_grad(int, T x, T) {
  const T s = (T)1 / ((T)1 + swish_exp(-x));
  return s * ((T)1 + x * ((T)1 - s));
}
)";

const char* const kKernels = R"(
extern "C" __global__ void __launch_bounds__(256)
user_swish_forward(const scalar_t* __restrict__ x, scalar_t* __restrict__ y, long long n) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) y[i] = swish(x[i]);
}
extern "C" __global__ void __launch_bounds__(256)
user_swish_backward(const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy, scalar_t* __restrict__ dx,
                    long long n) {
  if (dx == 0) return;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    dx[i] = dy[i] * swish_grad(0, x[i], (scalar_t)0);
}
)";

std::string source_for(DType dtype) {
  return std::string(dtype == DType::F64 ? "typedef double scalar_t;\n" : "typedef float scalar_t;\n") +
         kDeviceFunctions + kKernels;
}

Dim3 blocks_for(std::int64_t n) {
  return {static_cast<unsigned>(std::clamp<std::int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks)), 1,
          1};
}

class SwishRuntime final : public RuntimeOp {
 public:
  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    v.pointer(t.inputs.at(0).ptr);
    v.pointer(t.output.ptr);
    v.i64(t.output.numel());
  }
  Dim3 block() const override { return {kThreads, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>& shape) const override { return blocks_for(numel_of(shape)); }
  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    Launch l;
    l.entry = "user_swish_backward";
    l.block = {kThreads, 1, 1};
    l.grid = blocks_for(t.grad_output.numel());
    l.args = {t.inputs.at(0), t.grad_output, ptr(t.grad_inputs.empty() ? DevicePtr{0} : t.grad_inputs[0].ptr),
              t.grad_output.numel()};
    return {l};
  }
};

template <class T>
T swish_of(T x) {
  return x / (T(1) + std::exp(-x));
}
template <class T>
T swish_grad_of(T x) {
  const T s = T(1) / (T(1) + std::exp(-x));
  return s * (T(1) + x * (T(1) - s));
}

template <class F>
void on_dtype(DType t, F&& f) {
  if (t == DType::F64)
    f(double{});
  else
    f(float{});
}

}  // namespace

Shape Swish::infer_output_shape(const std::vector<Shape>& in) const {
  if (in.size() != 1) throw Error("takes one input, got " + std::to_string(in.size()));
  return in[0];
}

DType Swish::infer_output_dtype(const std::vector<DType>& in) const {
  if (in.size() != 1) throw Error("takes one input, got " + std::to_string(in.size()));
  if (in[0] != DType::F32 && in[0] != DType::F64)
    throw Error("supports f32 and f64 inputs, got " + std::string(dtype_name(in[0])));
  return in[0];
}

std::optional<Lowered> Swish::lower(const LowerContext& ctx) const {
  return Lowered{name(), source_for(ctx.output_dtype), "user_swish_forward",
                 std::make_shared<SwishRuntime>()};
}

std::string Swish::lower_backward_source(const LowerContext& ctx) const {
  return source_for(ctx.output_dtype);
}

std::optional<ElementwiseForm> Swish::elementwise_form(const std::vector<DType>& in) const {
  if (in.size() != 1 || (in[0] != DType::F32 && in[0] != DType::F64)) return std::nullopt;
  ElementwiseForm f;
  f.device_source = kDeviceFunctions;
  f.function = "swish";
  f.derivative = "swish_grad";
  f.cpu = ElementwiseForm::cpu_map<1>([](auto x) { return swish_of(x); });
  f.cpu_derivative =
      ElementwiseForm::cpu_map_derivative<1>([](int, auto x, auto) { return swish_grad_of(x); });
  return f;
}

void Swish::cpu_forward(CpuContext& ctx) const {
  on_dtype(ctx.output.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* x = ctx.inputs[0].data<T>();
    T* y = ctx.output.data<T>();
    ctx.parallel_for(ctx.output.numel(), 1 << 14, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) y[i] = swish_of(x[i]);
    });
  });
}

void Swish::cpu_backward(CpuBackwardContext& ctx) const {
  if (!ctx.wants_input_grad(0)) return;
  on_dtype(ctx.grad_output.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* x = ctx.inputs[0].data<T>();
    const T* dy = ctx.grad_output.data<T>();
    T* dx = ctx.grad_inputs[0].data<T>();
    ctx.parallel_for(ctx.grad_output.numel(), 1 << 14, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) dx[i] = dy[i] * swish_grad_of(x[i]);
    });
  });
}

CustomData swish_op() { return CustomData::make<Swish>(); }

SymTensor swish(const SymTensor& x, const std::string& name) {
  return x.record_custom(swish_op(), {}, std::nullopt, name);
}

}  // namespace kg::models
