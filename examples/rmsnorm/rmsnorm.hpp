// demo.rmsnorm: y = x / sqrt(mean(x²) + eps) * weight over the last dim, with a learned weight.
//
// A trainable custom op written against the whole contract: one parameter declared once (it
// exists with the same name on every device), a CPU forward and backward, and CUDA forward and
// backward kernels (a block per row, warp shuffles and shared memory). lower() is told the dtype,
// so one op instance serves f32 and f64.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kg/kg.hpp"
#include "kg/runtime_op.hpp"

namespace demo {

// Both kernels sum within a block: a warp reduction, then one across the warps.
inline const char* kRmsNormCommon = R"(
#define RMS_THREADS 256
__device__ real rms_block_sum(real v, real* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (int)(blockDim.x >> 5) ? shared[lane] : (real)0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) shared[32] = v;
  }
  __syncthreads();
  const real total = shared[32];
  __syncthreads();  // the caller may reuse `shared`
  return total;
}
)";

inline const char* kRmsNormForward = R"(
extern "C" __global__ void __launch_bounds__(RMS_THREADS)
rmsnorm_forward(const real* __restrict__ x, const real* __restrict__ w, real* __restrict__ y, int n, real eps) {
  __shared__ real shared[33];
  const real* xr = x + (long long)blockIdx.x * n;
  real* yr = y + (long long)blockIdx.x * n;
  real ss = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
  const real r = (real)1 / sqrt(rms_block_sum(ss, shared) / n + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * r * w[i];
}
)";

// Launch 0, a block per row: r = rstd of the row (kept in scratch) and, when wanted,
// dx = r·g·w − x·r³·Σ(g·w·x)/n. Launch 1, a thread per column: dw = Σ_rows g·x·r.
inline const char* kRmsNormBackward = R"(
extern "C" __global__ void __launch_bounds__(RMS_THREADS)
rmsnorm_backward_input(const real* __restrict__ x, const real* __restrict__ w, const real* __restrict__ g,
                       real* __restrict__ dx, real* __restrict__ rstd, int n, real eps) {
  __shared__ real shared[33];
  const long long row = blockIdx.x;
  const real* xr = x + row * n;
  const real* gr = g + row * n;
  real ss = 0, dot = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    ss += xr[i] * xr[i];
    dot += gr[i] * w[i] * xr[i];
  }
  const real r = (real)1 / sqrt(rms_block_sum(ss, shared) / n + eps);
  dot = rms_block_sum(dot, shared);
  if (threadIdx.x == 0) rstd[row] = r;
  if (dx == 0) return;
  real* dxr = dx + row * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x) dxr[i] = r * gr[i] * w[i] - xr[i] * r * r * r * dot / n;
}

extern "C" __global__ void rmsnorm_backward_weight(const real* __restrict__ x, const real* __restrict__ g,
                                                   const real* __restrict__ rstd, real* __restrict__ dw,
                                                   long long rows, int n) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  real s = 0;
  for (long long r = 0; r < rows; ++r) s += g[r * n + j] * x[r * n + j] * rstd[r];
  dw[j] = s;
}
)";

// The launch half: what each execution launches, described once as a list.
class RmsNormRuntime final : public kg::RuntimeOp {
 public:
  explicit RmsNormRuntime(double eps) : eps_(eps) {}

  std::vector<kg::Launch> launches(const kg::LaunchTensors& t) const override {
    const auto [rows, n] = dims(t.output);
    kg::Launch l;
    l.grid = {static_cast<unsigned>(rows), 1, 1};
    l.block = {256, 1, 1};
    l.args = {t.inputs[0], t.params[0], t.output, n, eps(t.output.dtype)};
    return {l};
  }

  std::size_t backward_scratch_bytes(const kg::LaunchTensors& t) const override {
    return static_cast<std::size_t>(dims(t.output).first) * kg::dtype_size(t.output.dtype);
  }
  std::vector<kg::Launch> backward_launches(const kg::LaunchTensors& t) const override {
    const auto [rows, n] = dims(t.output);
    std::vector<kg::Launch> v(1);
    v[0].entry = "rmsnorm_backward_input";
    v[0].grid = {static_cast<unsigned>(rows), 1, 1};
    v[0].block = {256, 1, 1};
    v[0].args = {t.inputs[0],        t.params[0], t.grad_output,      t.grad_inputs[0],
                 kg::ptr(t.scratch), n,           eps(t.output.dtype)};
    if (t.grad_params[0].ptr != 0) {  // the weight may be frozen
      kg::Launch w;
      w.entry = "rmsnorm_backward_weight";
      w.grid = {static_cast<unsigned>((n + 255) / 256), 1, 1};
      w.block = {256, 1, 1};
      w.args = {t.inputs[0],
                t.grad_output,
                kg::ptr(t.scratch),
                t.grad_params[0],
                static_cast<std::int64_t>(rows),
                n};
      v.push_back(std::move(w));
    }
    return v;
  }

 private:
  static std::pair<std::int64_t, std::int32_t> dims(const kg::DeviceTensor& y) {
    const std::int64_t n = y.shape.back();
    return {n ? y.numel() / n : 0, static_cast<std::int32_t>(n)};
  }
  kg::KernelArg eps(kg::DType t) const {
    return t == kg::DType::F64 ? kg::KernelArg(eps_) : kg::KernelArg(static_cast<float>(eps_));
  }
  double eps_;
};

// The graph half.
class RmsNormOp final : public kg::CustomOp {
 public:
  explicit RmsNormOp(double eps = 1e-6) : eps_(eps) {}
  std::string name() const override { return "demo.rmsnorm"; }

  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    if (in.size() != 1) throw kg::Error("takes one input");
    if (in[0].rank() < 1 || in[0][in[0].rank() - 1].is_dynamic())
      throw kg::Error("needs a static last dim, got " + in[0].to_string());
    return in[0];
  }
  kg::DType infer_output_dtype(const std::vector<kg::DType>& in) const override {
    if (in.at(0) != kg::DType::F32 && in.at(0) != kg::DType::F64) throw kg::Error("supports f32 and f64");
    return in[0];
  }
  // Declared once: [features], ones, trainable, in the input's dtype.
  std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>& in) const override {
    kg::ParamSpec w;
    w.name = "weight";
    w.shape = {in.at(0)[in[0].rank() - 1].size()};
    w.init = kg::ParamInit::constant(1.0);
    w.dtype_from_input = 0;  // f32 in an f32 model, f64 in an f64 one
    return {w};
  }

  std::optional<kg::Lowered> lower(const kg::LowerContext& ctx) const override {
    const std::string real = ctx.output_dtype == kg::DType::F64 ? "double" : "float";
    return kg::Lowered{"demo.rmsnorm_" + real,
                       "typedef " + real + " real;\n" + kRmsNormCommon + kRmsNormForward, "rmsnorm_forward",
                       std::make_shared<RmsNormRuntime>(eps_)};
  }
  std::string lower_backward_source(const kg::LowerContext& ctx) const override {
    const std::string real = ctx.output_dtype == kg::DType::F64 ? "double" : "float";
    return "typedef " + real + " real;\n" + kRmsNormCommon + kRmsNormBackward;
  }

  void cpu_forward(kg::CpuContext& ctx) const override {
    if (ctx.output.dtype() == kg::DType::F64)
      forward<double>(ctx);
    else
      forward<float>(ctx);
  }
  bool has_cpu_backward() const override { return true; }
  void cpu_backward(kg::CpuBackwardContext& ctx) const override {
    if (ctx.output.dtype() == kg::DType::F64)
      backward<double>(ctx);
    else
      backward<float>(ctx);
  }

 private:
  template <class T>
  void forward(kg::CpuContext& ctx) const {
    const kg::Tensor& x = ctx.inputs[0];
    const std::int64_t n = x.shape().back(), rows = n ? x.numel() / n : 0;
    const T* xp = x.data<T>();
    const T* w = ctx.params[0].data<T>();
    T* y = ctx.output.data<T>();
    ctx.parallel_for(rows, 16, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t r = b; r < e; ++r) {
        double ss = 0;
        for (std::int64_t i = 0; i < n; ++i) ss += double(xp[r * n + i]) * xp[r * n + i];
        const double rs = 1.0 / std::sqrt(ss / double(n) + eps_);
        for (std::int64_t i = 0; i < n; ++i) y[r * n + i] = static_cast<T>(xp[r * n + i] * rs * w[i]);
      }
    });
  }
  template <class T>
  void backward(kg::CpuBackwardContext& ctx) const {
    const kg::Tensor& x = ctx.inputs[0];
    const std::int64_t n = x.shape().back(), rows = n ? x.numel() / n : 0;
    const T* xp = x.data<T>();
    const T* w = ctx.params[0].data<T>();
    const T* g = ctx.grad_output.data<T>();
    std::vector<double> dw(static_cast<std::size_t>(n), 0.0);
    for (std::int64_t r = 0; r < rows; ++r) {
      double ss = 0, dot = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        ss += double(xp[r * n + i]) * xp[r * n + i];
        dot += double(g[r * n + i]) * w[i] * xp[r * n + i];
      }
      const double rs = 1.0 / std::sqrt(ss / double(n) + eps_);
      for (std::int64_t i = 0; i < n; ++i) {
        dw[static_cast<std::size_t>(i)] += double(g[r * n + i]) * xp[r * n + i] * rs;
        if (ctx.wants_input_grad(0))
          ctx.grad_inputs[0].data<T>()[r * n + i] =
              static_cast<T>(rs * g[r * n + i] * w[i] - xp[r * n + i] * rs * rs * rs * dot / double(n));
      }
    }
    if (ctx.wants_param_grad(0))
      for (std::int64_t i = 0; i < n; ++i)
        ctx.grad_params[0].data<T>()[i] = static_cast<T>(dw[static_cast<std::size_t>(i)]);
  }
  double eps_;
};

}  // namespace demo
