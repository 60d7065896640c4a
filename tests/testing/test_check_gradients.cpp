// kg::testing::check_gradients: a correct op with a CPU and a CUDA backward passes; planted bugs
// (a wrong or incomplete CPU backward, a wrong or incomplete backward kernel, a zero backward
// grid, a backward that reads a tensor it did not ask to keep) fail with the op, the tensor, the
// element and both values in the report.
#include <gtest/gtest.h>

#include "kg/cuda.hpp"
#include "kg/model.hpp"
#include "kg/runtime_op.hpp"
#include "kg/testing.hpp"
#include "support/test_util.hpp"

using kg_test::count_lines;
using kg_test::fresh_seed;

namespace {


enum class Bug {
  None,
  WrongCpu,
  UnwrittenCpu,
  WrongKernel,
  UnwrittenKernel,
  ZeroGrid,
  ReadsUnsaved,
  NoCpuBackward,             // only the kernels: compared with finite differences
  NoCpuBackwardWrongKernel,  // and dx[3] off by one
  FixedParams                // parameters always in the op's configured dtype, not the input's
};

// y[b, c] = w[c] * x[b, c]^2 + offset[c]: w trainable, offset a non-trainable buffer (0.5).
const char* kForward = R"(
template <class T>
__device__ void wsq_fwd(const T* x, const T* w, const T* off, T* y, long long rows, long long cols) {
  const long long n = rows * cols;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const long long c = i % cols;
    y[i] = w[c] * x[i] * x[i] + off[c];
  }
}
extern "C" __global__ void wsq_fwd_f32(const float* x, const float* w, const float* off, float* y, long long rows,
                                       long long cols) { wsq_fwd(x, w, off, y, rows, cols); }
extern "C" __global__ void wsq_fwd_f64(const double* x, const double* w, const double* off, double* y,
                                       long long rows, long long cols) { wsq_fwd(x, w, off, y, rows, cols); }
)";

// dx = 2 w x g (grid-stride over every element); dw[c] = sum_b x^2 g (one thread per column).
// `bug` plants an error: dx[3] off by one, or the last dw left unwritten.
const char* kBackward = R"(
template <class T>
__device__ void wsq_dx(const T* x, const T* w, const T* g, T* dx, long long rows, long long cols, int bug) {
  if (!dx) return;
  const long long n = rows * cols;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dx[i] = T(2) * w[i % cols] * x[i] * g[i] + (bug == 1 && i == 3 ? T(1) : T(0));
}
template <class T>
__device__ void wsq_dw(const T* x, const T* g, T* dw, long long rows, long long cols, int bug) {
  const long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (!dw || c >= cols - (bug == 2 ? 1 : 0)) return;
  T s = 0;
  for (long long r = 0; r < rows; ++r) s += x[r * cols + c] * x[r * cols + c] * g[r * cols + c];
  dw[c] = s;
}
extern "C" __global__ void wsq_dx_f32(const float* x, const float* w, const float* g, float* dx, long long rows,
                                      long long cols, int bug) { wsq_dx(x, w, g, dx, rows, cols, bug); }
extern "C" __global__ void wsq_dx_f64(const double* x, const double* w, const double* g, double* dx, long long rows,
                                      long long cols, int bug) { wsq_dx(x, w, g, dx, rows, cols, bug); }
extern "C" __global__ void wsq_dw_f32(const float* x, const float* g, float* dw, long long rows, long long cols,
                                      int bug) { wsq_dw(x, g, dw, rows, cols, bug); }
extern "C" __global__ void wsq_dw_f64(const double* x, const double* g, double* dw, long long rows, long long cols,
                                      int bug) { wsq_dw(x, g, dw, rows, cols, bug); }
)";

unsigned blocks(std::int64_t n) { return static_cast<unsigned>((n + 63) / 64); }

class WsqRuntime final : public kg::RuntimeOp {
 public:
  WsqRuntime(kg::DType dtype, Bug bug) : suffix_(dtype == kg::DType::F64 ? "_f64" : "_f32"), bug_(bug) {}
  void pack_args(const kg::LaunchTensors& t, kg::ArgVisitor& v) const override {
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.params[0].ptr);
    v.pointer(t.params[1].ptr);
    v.pointer(t.output.ptr);
    v.i64(t.output.shape[0]);
    v.i64(t.output.shape[1]);
  }
  kg::Dim3 block() const override { return {64, 1, 1}; }
  kg::Dim3 grid(const std::vector<std::int64_t>& shape) const override {
    return {std::max(1u, blocks(kg::numel_of(shape))), 1, 1};
  }

  std::vector<kg::Launch> backward_launches(const kg::LaunchTensors& t) const override {
    const auto& s = t.grad_output.shape;
    const bool wrong = bug_ == Bug::WrongKernel || bug_ == Bug::NoCpuBackwardWrongKernel;
    const std::int32_t dx_bug = wrong ? 1 : 0, dw_bug = bug_ == Bug::UnwrittenKernel ? 2 : 0;
    std::vector<kg::Launch> v;
    v.push_back({"wsq_dx" + suffix_, {std::max(1u, blocks(s[0] * s[1])), 1, 1}, {64, 1, 1}, 0,
                 {t.inputs[0], t.params[0], t.grad_output, t.grad_inputs[0], s[0], s[1], dx_bug}});
    v.push_back({"wsq_dw" + suffix_, {bug_ == Bug::ZeroGrid ? 0u : std::max(1u, blocks(s[1])), 1, 1}, {64, 1, 1}, 0,
                 {t.inputs[0], t.grad_output, t.grad_params[0], s[0], s[1], dw_bug}});
    return v;
  }

 private:
  std::string suffix_;
  Bug bug_;
};

class WsqOp final : public kg::CustomOp {
 public:
  WsqOp(std::int64_t cols, kg::DType dtype, Bug bug) : cols_(cols), dtype_(dtype), bug_(bug) {}
  std::string name() const override { return "test.wsq"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    if (in.size() != 1 || in[0].rank() != 2 || !in[0][1].is_static() || in[0][1].size() != cols_)
      throw kg::Error("expects one [B, " + std::to_string(cols_) + "] input");
    return in[0];
  }
  // In the input's dtype (f64 inputs, f64 parameters), unless FixedParams.
  std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>&) const override {
    const int follow = bug_ == Bug::FixedParams ? -1 : 0;
    return {{"w", {cols_}, dtype_, kg::ParamInit::uniform(-1, 1), true, follow},
            {"offset", {cols_}, dtype_, kg::ParamInit::constant(0.5), false, follow}};
  }
  // The kernels for the dtype the node is lowered in.
  std::optional<kg::Lowered> lower(const kg::LowerContext& ctx) const override {
    const kg::DType dt = ctx.input_dtypes.at(0);
    return kg::Lowered{"test.wsq", kForward, dt == kg::DType::F64 ? "wsq_fwd_f64" : "wsq_fwd_f32",
                       std::make_shared<WsqRuntime>(dt, bug_)};
  }
  std::string lower_backward_source(const kg::LowerContext&) const override { return kBackward; }
  void cpu_forward(kg::CpuContext& ctx) const override {
    if (ctx.inputs[0].dtype() == kg::DType::F64)
      forward<double>(ctx);
    else
      forward<float>(ctx);
  }
  bool has_cpu_backward() const override {
    return bug_ != Bug::NoCpuBackward && bug_ != Bug::NoCpuBackwardWrongKernel;
  }
  kg::BackwardSaves backward_saves() const override {
    if (bug_ == Bug::ReadsUnsaved) return {false, true};  // keeps the output, yet reads the input
    return {};
  }
  void cpu_backward(kg::CpuBackwardContext& ctx) const override {
    if (ctx.wants_param_grad(1)) throw kg::Error("a gradient for the non-trainable 'offset' was asked for");
    if (ctx.inputs[0].dtype() == kg::DType::F64)
      backward<double>(ctx);
    else
      backward<float>(ctx);
  }

 private:
  template <class T>
  void forward(kg::CpuContext& ctx) const {
    const T* x = ctx.inputs[0].data<T>();
    const T* w = ctx.params[0].data<T>();
    const T* off = ctx.params[1].data<T>();
    T* y = ctx.output.data<T>();
    for (std::int64_t i = 0; i < ctx.output.numel(); ++i) {
      const auto c = static_cast<std::size_t>(i % cols_);
      y[i] = w[c] * x[i] * x[i] + off[c];
    }
  }
  template <class T>
  void backward(kg::CpuBackwardContext& ctx) const {
    const T* x = ctx.inputs[0].data<T>();
    const T* w = ctx.params[0].data<T>();
    const T* g = ctx.grad_output.data<T>();
    const std::int64_t n = ctx.grad_output.numel(), rows = n / cols_;
    if (ctx.wants_input_grad(0)) {
      T* dx = ctx.grad_inputs[0].data<T>();
      for (std::int64_t i = 0; i < n - (bug_ == Bug::UnwrittenCpu ? 1 : 0); ++i)
        dx[i] = T(2) * w[i % cols_] * x[i] * g[i];
    }
    if (ctx.wants_param_grad(0)) {
      T* dw = ctx.grad_params[0].data<T>();
      for (std::int64_t c = 0; c < cols_; ++c) {
        T s = 0;
        for (std::int64_t r = 0; r < rows; ++r) s += x[r * cols_ + c] * x[r * cols_ + c] * g[r * cols_ + c];
        dw[c] = s + (bug_ == Bug::WrongCpu && c == 2 ? T(0.25) : T(0));
      }
    }
  }
  std::int64_t cols_;
  kg::DType dtype_;
  Bug bug_;
};

kg::testing::CheckOpReport check(Bug bug, std::uint64_t seed, kg::DType dtype = kg::DType::F64,
                                 std::vector<std::int64_t> shape = {4, 5}) {
  kg::testing::GradCheckOptions o;
  o.seed = seed;
  return kg::testing::check_gradients(kg::CustomData::make<WsqOp>(shape[1], dtype, bug), {shape}, {dtype}, o);
}

TEST(CheckGradients, CorrectOpPassesInF64) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check(Bug::None, seed);
  SCOPED_TRACE(r.to_string());
  EXPECT_TRUE(r.ok);
  EXPECT_EQ(r.lines.at(0), "INFO gradient check of op test.wsq, seed " + std::to_string(seed) +
                               " (GradCheckOptions::seed reproduces this run)");
  EXPECT_EQ(count_lines(r,
                        "PASS cpu_backward, input 0: the gradient of input 0 ([4, 5] f64) matches central "
                        "finite differences at all 20 elements within rtol 0.0001, atol 1e-06"),
            1);
  EXPECT_EQ(count_lines(r,
                        "PASS cpu_backward, parameter 'wsq.w': the gradient of parameter 'wsq.w' ([5] f64) "
                        "matches central finite differences at all 5 elements"),
            1);
  // The non-trainable buffer gets no gradient (only the INFO line of the dtypes names it).
  EXPECT_EQ(count_lines(r, "PASS", {"offset"}) + count_lines(r, "FAIL", {"offset"}), 0);
  EXPECT_EQ(count_lines(r,
                        "PASS emulator: the emulated backward (checked mode) for the gradient of input 0 "
                        "matches the CPU backward"),
            1);
  EXPECT_EQ(count_lines(r,
                        "PASS emulator: the emulated backward (checked mode) for the gradient of parameter "
                        "'wsq.w' matches the CPU backward"),
            1);
  if (!kg::cuda::compile_archs().empty()) {
    EXPECT_EQ(count_lines(r,
                          "PASS nvrtc: 2 backward launch(es) of 2 kernel(s) compiled for sm_90 and checked "
                          "against the CUDA signature and the PTX"),
              1);
  }
  if (!kg::Device::cuda_available()) {
    EXPECT_EQ(count_lines(r, "SKIP gpu: no usable GPU on this machine"), 1);
  }
  EXPECT_EQ(count_lines(r, "FAIL"), 0);
}

TEST(CheckGradients, F32OpIsCheckedInF64AndLargeTensorsAreSampled) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check(Bug::None, seed, kg::DType::F32, {24, 30});
  SCOPED_TRACE(r.to_string());
  EXPECT_TRUE(r.ok);
  EXPECT_EQ(count_lines(r,
                        "INFO finite differences in f64 (inputs f64, parameters wsq.w f64, wsq.offset f64, output "
                        "f64); the lowered backward in the dtypes given (inputs f32, parameters wsq.w f32, "
                        "wsq.offset f32, output f32)"),
            1);
  EXPECT_EQ(r.to_string().rfind("check_gradients: ok (", 0), 0u);
  EXPECT_EQ(count_lines(r,
                        "PASS cpu_backward, input 0: the gradient of input 0 ([24, 30] f64) matches central "
                        "finite differences at 64 sampled elements of 720"),
            1);
  EXPECT_EQ(count_lines(r,
                        "PASS emulator: the emulated backward (checked mode) for the gradient of parameter "
                        "'wsq.w' matches the CPU backward within rtol 0.0001, atol 1e-05"),
            1);
}

TEST(CheckGradients, WrongCpuBackwardFailsNamingTheElementAndBothValues) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check(Bug::WrongCpu, seed);
  SCOPED_TRACE(r.to_string());
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(count_lines(r,
                        "FAIL cpu_backward, parameter 'wsq.w': [test.wsq @ wsq] the gradient of parameter "
                        "'wsq.w' ([5] f64) differs from central finite differences at 1 of all 5 elements; "
                        "worst at [2]: backward gives ",
                        {", finite differences give ", "(|diff| 2.50e-01"}),
            1);
  EXPECT_EQ(count_lines(r, "PASS cpu_backward, input 0"), 1);
}

TEST(CheckGradients, UnwrittenCpuGradientElementFails) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check(Bug::UnwrittenCpu, seed);
  SCOPED_TRACE(r.to_string());
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(
      count_lines(r,
                  "FAIL cpu_backward: [test.wsq @ wsq] left 1 of 20 elements of the gradient of input 0 "
                  "unwritten (NaN in a NaN-poisoned gradient; first at [3, 4])"),
      1);
}

TEST(CheckGradients, WrongBackwardKernelFails) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check(Bug::WrongKernel, seed);
  SCOPED_TRACE(r.to_string());
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(
      count_lines(r,
                  "FAIL emulator: [test.wsq @ wsq] the emulated backward (checked mode) for the gradient "
                  "of input 0 differs from the CPU backward at 1 of 20 elements; worst at [0, 3]",
                  {"(|diff| 1.00e+00"}),
      1);
  EXPECT_EQ(count_lines(r, "PASS cpu_backward, input 0"), 1);
}

TEST(CheckGradients, UnwrittenKernelGradientElementFails) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check(Bug::UnwrittenKernel, seed);
  SCOPED_TRACE(r.to_string());
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(count_lines(r,
                        "FAIL emulator: [test.wsq @ wsq] the emulated backward (checked mode) left 1 of 5 "
                        "elements of the gradient of parameter 'wsq.w' unwritten",
                        {"first at [4]"}),
            1);
}

TEST(CheckGradients, ZeroBackwardGridFailsNamingTheLaunch) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check(Bug::ZeroGrid, seed);
  SCOPED_TRACE(r.to_string());
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(count_lines(r, "FAIL emulator: [test.wsq @ wsq] backward grid (launch 1) (0, 1, 1) has a zero dimension"),
            1);
  if (!kg::cuda::compile_archs().empty()) {
    EXPECT_EQ(count_lines(r, "FAIL nvrtc: [test.wsq @ wsq] backward grid (launch 1) (0, 1, 1) has a zero dimension"),
              1);
  }
}

// A backward that reads an input it did not ask to keep: check_gradients first gives it a
// stand-in with other values (NaN), so the read shows as a changed gradient and is reported
// before the backward is ever called with no data there (a null read would crash the process).
// The lowered backward gets a null pointer for it; the emulator reports the fault.
TEST(CheckGradients, BackwardReadingATensorItDidNotKeepFails) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check(Bug::ReadsUnsaved, seed);
  SCOPED_TRACE(r.to_string());
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(count_lines(r,
                        "FAIL cpu_backward: [test.wsq @ wsq] reads input 0, which backward_saves() does not "
                        "ask to keep (inputs = false; the runtime passes it without data): the gradient of "
                        "input 0 changes at [0, 0]"),
            1);
  EXPECT_EQ(count_lines(r, "FAIL emulator: [test.wsq @ wsq] backward launch 0"), 1);
  // A kernel that faults would leave a GPU's context unusable: it is not launched there.
  if (kg::Device::cuda_available()) {
    EXPECT_EQ(count_lines(r, "SKIP gpu: not run: the emulated backward failed to run"), 1) << r.to_string();
  }
}

// An op whose only backward is its kernels: they are compared with finite differences.
TEST(CheckGradients, KernelsWithoutACpuBackwardAreComparedWithFiniteDifferences) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check(Bug::NoCpuBackward, seed);
  EXPECT_TRUE(r.ok) << r.to_string();
  EXPECT_EQ(count_lines(r, "SKIP cpu_backward: the op has no CPU backward"), 1) << r.to_string();
  EXPECT_EQ(
      count_lines(r,
                  "PASS emulator, input 0: the emulated backward's gradient of input 0 ([4, 5] f64) matches "
                  "central finite differences at all 20 elements within rtol 0.0001, atol 1e-05"),
      1)
      << r.to_string();
  EXPECT_EQ(count_lines(r, "PASS emulator, parameter 'wsq.w': the emulated backward's gradient of parameter"),
            1)
      << r.to_string();

  // f32 kernels against finite differences in f64.
  r = check(Bug::NoCpuBackward, seed, kg::DType::F32, {6, 5});
  EXPECT_TRUE(r.ok) << r.to_string();
  EXPECT_EQ(
      count_lines(r, "PASS emulator, input 0: the emulated backward's gradient of input 0 ([6, 5] f64)"), 1)
      << r.to_string();

  r = check(Bug::NoCpuBackwardWrongKernel, seed);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(
      count_lines(r,
                  "FAIL emulator, input 0: [test.wsq @ wsq] the emulated backward's gradient of input 0 "
                  "([4, 5] f64) differs from central finite differences at 1 of all 20 elements; worst at "
                  "[0, 3]: the emulated backward gives "),
      1)
      << r.to_string();
}

TEST(CheckGradients, SetupErrorsAndOpsWithoutABackward) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  kg::testing::GradCheckOptions o;
  o.seed = seed;
  auto op = kg::CustomData::make<WsqOp>(5, kg::DType::F64, Bug::None);
  auto r = kg::testing::check_gradients(op, {{4, 5}}, {}, o);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(count_lines(r, "FAIL setup: [test.wsq] check_gradients: 1 input shapes but 0 dtypes"), 1)
      << r.to_string();
  r = kg::testing::check_gradients(op, {{4, 6}}, {kg::DType::F64}, o);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(count_lines(r, "FAIL record: [test.wsq @ wsq] expects one [B, 5] input"), 1) << r.to_string();
  o.make_input = [](int, const std::vector<std::int64_t>&) { return kg::Tensor::zeros(kg::DType::F64, {2}); };
  r = kg::testing::check_gradients(op, {{4, 5}}, {kg::DType::F64}, o);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(count_lines(r,
                        "FAIL record: [test.wsq @ wsq] GradCheckOptions::make_input(0, [4, 5]) returned [2] "
                        "f64; the input is [4, 5] f64"),
            1)
      << r.to_string();

  // No CPU backward: nothing to check.
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 3}, "x");
  kg::SymTensor y = kg::softmax(x, -1);
  r = kg::testing::check_gradients(*g->node(y.node()).op, {{2, 3}}, {kg::DType::F32}, o);
  if (!(*g->node(y.node()).op)->has_cpu_backward()) {
    EXPECT_TRUE(r.ok);
    EXPECT_EQ(count_lines(r, "SKIP gradients: the op has no CPU backward"), 1) << r.to_string();
  }
}

TEST(CheckGradients, CheckOpRunsTheGradientCheckAtTheLargestBatch) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  kg::testing::CheckOpOptions o;
  o.seed = seed;
  o.batch_sizes = {1, 3};
  auto r = kg::testing::check_op(kg::CustomData::make<WsqOp>(5, kg::DType::F32, Bug::None),
                                 {{kg::Dim::named("batch"), 5}}, {kg::DType::F32}, o);
  SCOPED_TRACE(r.to_string());
  EXPECT_TRUE(r.ok);
  EXPECT_EQ(
      count_lines(r, "PASS gradients batch 3, cpu_backward, input 0: the gradient of input 0 ([3, 5] f64)"),
      1);
  EXPECT_EQ(count_lines(r,
                        "PASS gradients batch 3, emulator: the emulated backward (checked mode) for the "
                        "gradient of parameter 'wsq.w'"),
            1);
  r = kg::testing::check_op(kg::CustomData::make<WsqOp>(5, kg::DType::F32, Bug::WrongCpu),
                            {{kg::Dim::named("batch"), 5}}, {kg::DType::F32}, o);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(count_lines(r, "FAIL gradients batch 3, cpu_backward, parameter 'wsq.w'", {"worst at [2]"}), 1)
      << r.to_string();
}

}  // namespace

// An op whose parameters keep a fixed f32 dtype cannot run on f64 inputs in a model (its forward
// reads the weight as double). The check says so and runs in f32, instead of converting the
// parameters behind the op's back and reporting f64.
TEST(CheckGradients, FixedF32ParametersAreNotConvertedBehindTheOpsBack) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check(Bug::FixedParams, seed, kg::DType::F32, {4, 5});
  SCOPED_TRACE(r.to_string());
  EXPECT_EQ(count_lines(r, "INFO finite differences in f64"), 0);
  EXPECT_EQ(count_lines(r, "INFO finite differences in the dtypes given (inputs f32, parameters wsq.w f32, wsq.offset "
                           "f32, output f32), not f64 (the op fails on f64 inputs: ",
                        {"f32", "step and tolerances widened"}),
            1);
  EXPECT_EQ(count_lines(r, "PASS cpu_backward, input 0", {"[4, 5] f32"}), 1);
}
