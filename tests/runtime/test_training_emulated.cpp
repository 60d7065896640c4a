// Training on the cpu device through an op whose only backward is its CUDA kernels: the
// runtime runs them through the emulator (gradients equal the closed form); a backward grid with
// a zero dimension, or a backward source with no backward launches, is an error at load naming
// the op and the node; backward launches without a backward source give the op no backward.
#include <gtest/gtest.h>

#include <cstring>

#include "kg/kg.hpp"
#include "kg/runtime_op.hpp"
#include "support/test_util.hpp"

namespace {

using kg::DType;
using kg::SymTensor;
using kg::Tensor;

// y = w ⊙ x over the last dim (f32), w a learnable [C] vector.
const char* kForward = R"(
extern "C" __global__ void wmul_fwd(const float* x, const float* w, float* y, long long n, long long c) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = w[i % c] * x[i];
}
)";
// Launch 0: dx = w ⊙ dy (skipped when dx is not wanted). Launch 1: dw[j] = Σ_rows x ⊙ dy.
const char* kBackward = R"(
extern "C" __global__ void wmul_dx(const float* w, const float* dy, float* dx, long long n, long long c) {
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

// How the RuntimeOp's backward is wrong.
enum class Bwd { Fine, ZeroGrid, NoLaunches };

class WmulRuntime final : public kg::RuntimeOp {
 public:
  WmulRuntime(std::int64_t c, Bwd bwd) : c_(c), bwd_(bwd) {}
  void pack_args(const kg::LaunchTensors& t, kg::ArgVisitor& v) const override {
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.params[0].ptr);
    v.pointer(t.output.ptr);
    v.i64(t.output.numel());
    v.i64(c_);
  }
  kg::Dim3 block() const override { return {64, 1, 1}; }
  kg::Dim3 grid(const std::vector<std::int64_t>& shape) const override {
    return {static_cast<unsigned>((kg::numel_of(shape) + 63) / 64), 1, 1};
  }
  std::vector<kg::Launch> backward_launches(const kg::LaunchTensors& t) const override {
    if (bwd_ == Bwd::NoLaunches) return {};
    const std::int64_t n = t.grad_output.numel();
    std::vector<kg::Launch> v;
    v.push_back({"wmul_dx", grid(t.grad_output.shape), {64, 1, 1}, 0,
                 {t.params[0], t.grad_output, t.grad_inputs[0], n, c_}});
    v.push_back({"wmul_dw", {bwd_ == Bwd::ZeroGrid ? 0u : static_cast<unsigned>((c_ + 63) / 64), 1, 1}, {64, 1, 1}, 0,
                 {t.inputs[0], t.grad_output, t.grad_params[0], n / c_, c_}});
    return v;
  }

 private:
  std::int64_t c_;
  Bwd bwd_;
};

class WmulOp final : public kg::CustomOp {
 public:
  WmulOp(std::int64_t c, Bwd bwd = Bwd::Fine, bool with_source = true) : c_(c), bwd_(bwd), with_source_(with_source) {}
  std::string name() const override { return "test.wmul"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>&) const override {
    return {{"w", {c_}, DType::F32, kg::ParamInit::uniform(0.5, 1.5), true}};
  }
  std::optional<kg::Lowered> lower(const kg::LowerContext&) const override {
    return kg::Lowered{"test.wmul", kForward, "wmul_fwd", std::make_shared<WmulRuntime>(c_, bwd_)};
  }
  // The RuntimeOp describes backward launches either way; without a source they are not used.
  std::string lower_backward_source(const kg::LowerContext& ctx) const override {
    EXPECT_EQ(ctx.mode, kg::LoweringMode::Training);
    return with_source_ ? kBackward : "";
  }

 private:
  std::int64_t c_;
  Bwd bwd_;
  bool with_source_;
};

struct Net {
  kg::Model model;
  std::shared_ptr<kg::Graph> graph;
};
Net make(Bwd bwd = Bwd::Fine, bool with_source = true) {
  auto [x, g] = SymTensor::input(DType::F32, {kg::Dim::named("batch"), 6}, "x");
  SymTensor h = kg::nn::linear(x, 6, "fc");
  h = h.record_custom(kg::CustomData::make<WmulOp>(6, bwd, with_source), {}, std::nullopt, "wmul");
  SymTensor loss = kg::mse_loss(h, x, "loss");
  return {kg::Model(g, {{"out", h}, {"loss", loss}}, kg::LoweringMode::Training), g};
}

TEST(TrainingEmulated, KernelOnlyBackwardRunsThroughTheEmulator) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  Net s = make();
  // Unchecked, and in checked mode (every lowered op through the emulator with guarded buffers,
  // outputs and gradients poisoned and verified).
  for (bool checked : {false, true}) {
    SCOPED_TRACE(checked ? "checked" : "unchecked");
    kg::LoadOptions opt;
    opt.poison_buffers = true;
    opt.checked = checked;
    kg::LoadedModel m = s.model.load(kg::Device::cpu(), {{5, 6}}, opt);
    Tensor x = kg_test::random_tensor(rng, DType::F32, {5, 6});
    m.forward({x});
    m.backward();
    // Reference in double: loss = mean((w ⊙ (x Wᵀ + b) - x)²).
    const Tensor W = m.parameter("fc.weight"), b = m.parameter("fc.bias"), w = m.parameter("wmul.w");
    const std::int64_t N = 5, C = 6;
    std::vector<double> gw(C, 0.0), gb(C, 0.0), gW(C * C, 0.0);
    for (std::int64_t r = 0; r < N; ++r)
      for (std::int64_t j = 0; j < C; ++j) {
        double h = b.item(j);
        for (std::int64_t k = 0; k < C; ++k) h += W.item(j * C + k) * x.item(r * C + k);
        const double y = w.item(j) * h;
        const double dy = 2.0 * (y - x.item(r * C + j)) / static_cast<double>(N * C);
        gw[static_cast<std::size_t>(j)] += dy * h;
        const double dh = dy * w.item(j);
        gb[static_cast<std::size_t>(j)] += dh;
        for (std::int64_t k = 0; k < C; ++k) gW[static_cast<std::size_t>(j * C + k)] += dh * x.item(r * C + k);
      }
    auto close = [](const Tensor& got, const std::vector<double>& want, const char* what) {
      ASSERT_EQ(got.numel(), static_cast<std::int64_t>(want.size())) << what;
      for (std::size_t i = 0; i < want.size(); ++i)
        EXPECT_NEAR(got.item(static_cast<std::int64_t>(i)), want[i], 1e-5 + 1e-4 * std::abs(want[i])) << what << " " << i;
    };
    close(m.grad("wmul.w"), gw, "wmul.w");
    close(m.grad("fc.bias"), gb, "fc.bias");
    close(m.grad("fc.weight"), gW, "fc.weight");
  }
}

TEST(TrainingEmulated, ZeroBackwardGridIsNamedAtLoad) {
  // The backward launches are described and checked at load, before anything runs.
  Net s = make(Bwd::ZeroGrid);
  kg_test::expect_error([&] { s.model.load(kg::Device::cpu(), {{3, 6}}); },
                        {"[test.wmul @ wmul]", "backward", "launch 1", "(0, 1, 1)", "zero dimension"});
}

TEST(TrainingEmulated, ABackwardSourceWithoutLaunchesIsAnError) {
  Net s = make(Bwd::NoLaunches);
  kg_test::expect_error([&] { s.model.load(kg::Device::cpu(), {{3, 6}}); },
                        {"[test.wmul @ wmul]", "RuntimeOp::backward_launches() described no launch"});
}

TEST(TrainingEmulated, ABackwardWithoutSourceIsNoBackward) {
  Net s = make(Bwd::Fine, /*with_source=*/false);
  kg_test::expect_error([&] { s.model.load(kg::Device::cpu(), {{3, 6}}); },
                        {"[test.wmul @ wmul] has no backward", "parameter 'wmul.w'", "loss 'loss'"});
}

}  // namespace
