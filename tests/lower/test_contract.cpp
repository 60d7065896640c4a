// The custom-op contract where a mistake used to pass silently: a backward launch of an op that
// also has a CPU backward is checked at a cpu load like any other; a parameter may follow its
// input's dtype, so one op instance serves f32 and f64 models; a plain (unchecked) cpu run of an
// emulated kernel runs on guarded buffers, so a write past the output is an error naming the
// kernel instead of corrupted host memory.
#include <gtest/gtest.h>

#include <cmath>

#include "kg/kg.hpp"
#include "kg/runtime_op.hpp"
#include "support/test_util.hpp"

namespace {

using kg::DType;
using kg::SymTensor;
using kg::Tensor;

// y = w ⊙ x over the last dim, in the input's dtype (`real` from the lowering).
const char* kForward = R"(
extern "C" __global__ void wmul_fwd(const real* x, const real* w, real* y, long long n, long long c) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = w[i % c] * x[i];
}
extern "C" __global__ void wmul_fwd_scratch(const real* x, const real* w, real* y, real* tmp, long long n, long long c) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) tmp[i] = w[i % c] * x[i];
  if (i < n) y[i] = tmp[i];
}
extern "C" __global__ void wmul_fwd_past_end(const real* x, const real* w, real* y, long long n, long long c) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i <= n) y[i] = w[i % c] * x[i < n ? i : 0];
}
)";
const char* kBackward = R"(
extern "C" __global__ void wmul_dx(const real* w, const real* dy, real* dx, long long n, long long c) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (dx && i < n) dx[i] = w[i % c] * dy[i];
}
extern "C" __global__ void wmul_dw(const float* x, const float* dy, float* dw, long long rows, long long c) {
  long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (j >= c) return;
  float s = 0.0f;
  for (long long r = 0; r < rows; ++r) s += x[r * c + j] * dy[r * c + j];
  dw[j] = s;
}
)";

enum class Bug { None, BackwardEntryMissing, PastEnd, FixedF32Weight, SmallScratch };

class WmulRuntime final : public kg::RuntimeOp {
 public:
  WmulRuntime(std::int64_t c, Bug bug) : c_(c), bug_(bug) {}
  // SmallScratch: one element less than the kernel writes there.
  std::size_t scratch_bytes(const kg::LaunchTensors& t) const override {
    if (bug_ != Bug::SmallScratch) return 0;
    return static_cast<std::size_t>(t.output.numel() - 1) * kg::dtype_size(t.output.dtype);
  }
  std::vector<kg::Launch> launches(const kg::LaunchTensors& t) const override {
    const std::int64_t n = t.output.numel();
    if (bug_ == Bug::SmallScratch)
      return {{"wmul_fwd_scratch", {static_cast<unsigned>((n + 63) / 64), 1, 1}, {64, 1, 1}, 0,
               {t.inputs[0], t.params[0], t.output, kg::ptr(t.scratch), n, c_}}};
    return {{bug_ == Bug::PastEnd ? "wmul_fwd_past_end" : "wmul_fwd",
             {static_cast<unsigned>((n + 63) / 64), 1, 1}, {64, 1, 1}, 0,
             {t.inputs[0], t.params[0], t.output, n, c_}}};
  }
  std::vector<kg::Launch> backward_launches(const kg::LaunchTensors& t) const override {
    const std::int64_t n = t.grad_output.numel();
    std::vector<kg::Launch> v;
    v.push_back({bug_ == Bug::BackwardEntryMissing ? "wmul_dinput" : "wmul_dx",
                 {static_cast<unsigned>((n + 63) / 64), 1, 1}, {64, 1, 1}, 0,
                 {t.params[0], t.grad_output, t.grad_inputs[0], n, c_}});
    if (t.grad_params[0].ptr != 0)
      v.push_back({"wmul_dw", {static_cast<unsigned>((c_ + 63) / 64), 1, 1}, {64, 1, 1}, 0,
                   {t.inputs[0], t.grad_output, t.grad_params[0], n / c_, c_}});
    return v;
  }

 private:
  std::int64_t c_;
  Bug bug_;
};

// The op: a CPU forward and backward (unless `emulated_only`), kernels for both.
class WmulOp final : public kg::CustomOp {
 public:
  WmulOp(std::int64_t c, Bug bug, bool emulated_only = false) : c_(c), bug_(bug), emulated_only_(emulated_only) {}
  std::string name() const override { return "test.wmul"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>&) const override {
    kg::ParamSpec w{"w", {c_}, DType::F32, kg::ParamInit::from_values(std::vector<float>{0.5f, 1.5f, 2.f, -1.f}),
                    true};
    if (bug_ != Bug::FixedF32Weight) w.dtype_from_input = 0;
    return {w};
  }
  std::optional<kg::Lowered> lower(const kg::LowerContext& ctx) const override {
    const std::string real = ctx.output_dtype == DType::F64 ? "double" : "float";
    return kg::Lowered{"test.wmul", "typedef " + real + " real;\n" + kForward, "",
                       std::make_shared<WmulRuntime>(c_, bug_)};
  }
  std::string lower_backward_source(const kg::LowerContext& ctx) const override {
    const std::string real = ctx.output_dtype == DType::F64 ? "double" : "float";
    return "typedef " + real + " real;\n" + kBackward;
  }
  void cpu_forward(kg::CpuContext& ctx) const override {
    if (emulated_only_) kg::CustomOp::cpu_forward(ctx);
    if (ctx.output.dtype() == DType::F64)
      forward<double>(ctx);
    else
      forward<float>(ctx);
  }
  bool has_cpu_backward() const override { return !emulated_only_; }
  void cpu_backward(kg::CpuBackwardContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      if (ctx.wants_input_grad(0))
        Tensor::wrap(static_cast<std::byte*>(ctx.grad_inputs[0].raw()) + i * kg::dtype_size(x.dtype()), x.dtype(), {})
            .fill(ctx.params[0].item(i % c_) * ctx.grad_output.item(i));
    }
    if (ctx.wants_param_grad(0))
      for (std::int64_t j = 0; j < c_; ++j) {
        double s = 0;
        for (std::int64_t r = 0; r < x.numel() / c_; ++r) s += x.item(r * c_ + j) * ctx.grad_output.item(r * c_ + j);
        Tensor::wrap(static_cast<std::byte*>(ctx.grad_params[0].raw()) + j * kg::dtype_size(x.dtype()), x.dtype(), {})
            .fill(s);
      }
  }

 private:
  template <class T>
  void forward(kg::CpuContext& ctx) const {
    const T* x = ctx.inputs[0].data<T>();
    const T* w = ctx.params[0].data<T>();  // throws when the weight is not the input's dtype
    T* y = ctx.output.data<T>();
    for (std::int64_t i = 0; i < ctx.output.numel(); ++i) y[i] = w[i % c_] * x[i];
  }
  std::int64_t c_;
  Bug bug_;
  bool emulated_only_;
};

kg::Model model(DType dtype, Bug bug, kg::LoweringMode mode, bool emulated_only = false) {
  auto [x, g] = SymTensor::input(dtype, {kg::Dim::named("batch"), 4}, "x");
  SymTensor h = x.record_custom(kg::CustomData::make<WmulOp>(4, bug, emulated_only), {}, std::nullopt, "wmul");
  if (mode == kg::LoweringMode::Inference) return kg::Model(g, {h});
  SymTensor loss = kg::mse_loss(h, x, "loss");
  return kg::Model(g, {{"out", h}, {"loss", loss}}, mode);
}

Tensor input(DType dtype, std::int64_t rows) {
  Tensor x = Tensor::empty(dtype, {rows, 4});
  for (std::int64_t i = 0; i < x.numel(); ++i)
    Tensor::wrap(static_cast<std::byte*>(x.raw()) + i * kg::dtype_size(dtype), dtype, {}).fill(0.25 * (i % 7) - 0.5);
  return x;
}

}  // namespace

// The op runs its CPU backward on the cpu, but its backward kernels are what a GPU and checked
// mode run: a backward launch naming an entry its source lacks is refused at a cpu load too.
TEST(CustomOpContract, BackwardLaunchesOfAnOpWithACpuBackwardAreCheckedAtACpuLoad) {
  kg::Model m = model(DType::F32, Bug::BackwardEntryMissing, kg::LoweringMode::Training);
  kg_test::expect_error([&] { m.load(kg::Device::cpu(), {{3, 4}}); },
                        {"[test.wmul @ wmul]", "entry point 'wmul_dinput' is not a __global__ function of the backward "
                                               "kernel source (it has: wmul_dx, wmul_dw)"});
  // The correct op loads and trains on its CPU backward.
  kg::LoadedModel ok = model(DType::F32, Bug::None, kg::LoweringMode::Training).load(kg::Device::cpu(), {{3, 4}});
  ok.forward({input(DType::F32, 3)});
  ok.backward();
}

// The backward's pointer element types too: in an f64 model, the weight-gradient kernel takes
// float pointers (it is written for f32 only) where f64 tensors are packed.
TEST(CustomOpContract, BackwardPointerTypesAreCheckedAgainstTheTensors) {
  kg::Model m = model(DType::F64, Bug::None, kg::LoweringMode::Training);
  kg_test::expect_error([&] { m.load(kg::Device::cpu(), {{3, 4}}); },
                        {"[test.wmul @ wmul] backward launch 1 of kernel 'wmul_dw'",
                         "argument 0 'x' (const float*) points to f32 elements", "input 0 packed there is f64 [3, 4]"});
}

// One op instance serves f32 and f64: the weight follows input 0's dtype (its Data init, given
// in f32, converted), on the cpu and in the emulated kernel alike.
TEST(CustomOpContract, AParameterFollowsTheInputDtype) {
  for (DType dt : {DType::F32, DType::F64}) {
    SCOPED_TRACE(std::string(kg::dtype_name(dt)));
    kg::Model m = model(dt, Bug::None, kg::LoweringMode::Inference);
    ASSERT_EQ(m.parameters().size(), 1u);
    EXPECT_EQ(m.parameters()[0].dtype, dt);
    const Tensor x = input(dt, 3);
    const Tensor y = m.load(kg::Device::cpu(), {{3, 4}}).forward({x})[0];
    const double w[4] = {0.5, 1.5, 2.0, -1.0};
    ASSERT_EQ(y.dtype(), dt);
    for (std::int64_t i = 0; i < 12; ++i) EXPECT_DOUBLE_EQ(y.item(i), w[i % 4] * x.item(i)) << i;
    kg::LoadOptions checked;
    checked.checked = true;
    const Tensor e = m.load(kg::Device::cpu(), {{3, 4}}, checked).forward({x})[0];
    for (std::int64_t i = 0; i < 12; ++i) EXPECT_DOUBLE_EQ(e.item(i), w[i % 4] * x.item(i)) << i;
  }
  // A fixed f32 weight in an f64 model: the op's own forward refuses it, named.
  kg::Model fixed = model(DType::F64, Bug::FixedF32Weight, kg::LoweringMode::Inference);
  EXPECT_EQ(fixed.parameters()[0].dtype, DType::F32);
}

TEST(CustomOpContract, FollowingAnInputThatCannotBeFollowedIsAnErrorAtRecord) {
  struct Op final : kg::CustomOp {
    int from;
    explicit Op(int f) : from(f) {}
    std::string name() const override { return "test.follow"; }
    kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
    kg::DType infer_output_dtype(const std::vector<kg::DType>&) const override { return DType::F32; }
    std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>&) const override {
      kg::ParamSpec p{"w", {2}, DType::F32, kg::ParamInit::constant(1.0), true};
      p.dtype_from_input = from;
      return {p};
    }
  };
  auto [x, g] = SymTensor::input(DType::I64, {2}, "x");
  kg_test::expect_error([&] { x.record_custom(kg::CustomData::make<Op>(0), {}, std::nullopt, "f"); },
                        {"[test.follow @ f] parameter 'w' takes the dtype of input 0", "which is i64",
                         "may follow a float input only"});
  kg_test::expect_error([&] { x.record_custom(kg::CustomData::make<Op>(2), {}, std::nullopt, "f"); },
                        {"[test.follow @ f] parameter 'w' takes the dtype of input 2", "but the op has 1 input"});
}

// A plain cpu run of an op that has no cpu_forward emulates its kernel. Before, that run got raw
// host memory: a write one element past the output went unnoticed (or corrupted the heap). It
// runs on guarded buffers now, and the write is an error naming the kernel and the argument.
TEST(CustomOpContract, APlainCpuRunOfAnEmulatedKernelIsGuarded) {
  kg::Model m = model(DType::F32, Bug::PastEnd, kg::LoweringMode::Inference, /*emulated_only=*/true);
  kg::LoadedModel lm = m.load(kg::Device::cpu(), {{4, 4}});  // 64 bytes: the end lies on the guard page
  kg_test::expect_error([&] { lm.forward({input(DType::F32, 4)}); },
                        {"[test.wmul @ wmul]", "kernel 'wmul_fwd_past_end'", "out-of-bounds write past the end of argument 2 'y'",
                         "element 16"});
  // The correct kernel, emulated unchecked, gives the right numbers.
  const Tensor x = input(DType::F32, 3);
  const Tensor y =
      model(DType::F32, Bug::None, kg::LoweringMode::Inference, true).load(kg::Device::cpu(), {{3, 4}}).forward({x})[0];
  const double w[4] = {0.5, 1.5, 2.0, -1.0};
  for (std::int64_t i = 0; i < 12; ++i) EXPECT_FLOAT_EQ(static_cast<float>(y.item(i)), static_cast<float>(w[i % 4] * x.item(i)));
}

// scratch_bytes() one element short of what the kernel writes there: checked mode, and a plain
// cpu run of the emulated kernel, stop at the scratch buffer's guard.
TEST(CustomOpContract, AScratchTooSmallIsCaught) {
  kg::LoadOptions checked;
  checked.checked = true;
  const std::vector<std::string> parts = {"[test.wmul @ wmul]", "kernel 'wmul_fwd_scratch'",
                                          "out-of-bounds write past the end of argument 3 'tmp'", "buffer scratch"};
  kg_test::expect_error(
      [&] {
        model(DType::F32, Bug::SmallScratch, kg::LoweringMode::Inference)
            .load(kg::Device::cpu(), {{5, 4}}, checked)
            .forward({input(DType::F32, 5)});
      },
      parts);
  kg_test::expect_error(
      [&] {
        model(DType::F32, Bug::SmallScratch, kg::LoweringMode::Inference, true)
            .load(kg::Device::cpu(), {{5, 4}})
            .forward({input(DType::F32, 5)});
      },
      parts);
}
