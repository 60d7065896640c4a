// The book's silent failures planted inside a model: each is an error naming the op, the node and
// the numbers — at load on every device, or in checked mode (LoadOptions::checked) — never a
// plausible wrong result. On a machine with a GPU the same models run on cuda in checked mode.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>

#include "kg/cuda.hpp"
#include "kg/kg.hpp"
#include "kg/runtime_op.hpp"
#include "support/test_util.hpp"

namespace {

// What is wrong with the op.
enum class Fault {
  None,
  WideShape,        // infer_output_shape one column too wide
  MissingArg,       // one argument too few
  IntForPointer,    // an i32 where the kernel takes float*
  I64ForPointer,    // an i64 where the kernel takes float* (same width)
  BlockOverBounds,  // a block of 512 threads for __launch_bounds__(256)
  NoLower,          // lower() gives nothing
  WritePastEnd,     // the kernel writes one element past its output
  WrongEntry,       // an entry point the source does not have
  BadInitSize,      // parameter init data one element short
  NoBackward,       // no backward at all
};

const char* kScaleSource = R"(
extern "C" __global__ void __launch_bounds__(256)
scale_fwd(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y, int n, long long total) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < total) y[i] = x[i] * w[i % n];
}
extern "C" __global__ void __launch_bounds__(256)
scale_fwd_past_end(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y, int n,
                   long long total) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i <= total) y[i] = x[i < total ? i : 0] * w[i % n];
}
)";

const char* kScaleBackward = R"(
extern "C" __global__ void scale_bwd_input(const float* g, const float* w, float* dx, int n, long long total) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < total) dx[i] = g[i] * w[i % n];
}
extern "C" __global__ void scale_bwd_weight(const float* g, const float* x, float* dw, int n, long long rows) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  float s = 0.f;
  for (long long r = 0; r < rows; ++r) s += g[r * n + j] * x[r * n + j];
  dw[j] = s;
}
)";

class ScaleRuntime final : public kg::RuntimeOp {
 public:
  explicit ScaleRuntime(Fault f) : f_(f) {}
  std::vector<kg::Launch> launches(const kg::LaunchTensors& t) const override {
    const std::int64_t total = t.inputs[0].numel();
    const auto n = static_cast<std::int32_t>(t.inputs[0].shape.back());
    kg::Launch l;
    l.entry = f_ == Fault::WritePastEnd ? "scale_fwd_past_end"
              : f_ == Fault::WrongEntry ? "scale_forward"
                                        : "";
    l.block = {f_ == Fault::BlockOverBounds ? 512u : 256u, 1, 1};
    l.grid = {static_cast<unsigned>((total + 1 + 255) / 256), 1, 1};
    l.args.add(t.inputs[0]);
    if (f_ == Fault::IntForPointer)
      l.args.i32(0);
    else if (f_ == Fault::I64ForPointer)
      l.args.i64(0);
    else
      l.args.add(t.params[0]);
    l.args.add(t.output);
    l.args.add(n);
    if (f_ != Fault::MissingArg) l.args.add(total);
    return {l};
  }
  std::vector<kg::Launch> backward_launches(const kg::LaunchTensors& t) const override {
    const std::int64_t total = t.inputs[0].numel();
    const auto n = static_cast<std::int32_t>(t.inputs[0].shape.back());
    std::vector<kg::Launch> v;
    if (t.grad_inputs[0].ptr)
      v.push_back({"scale_bwd_input",
                   {static_cast<unsigned>((total + 255) / 256), 1, 1},
                   {256, 1, 1},
                   0,
                   {t.grad_output, t.params[0], t.grad_inputs[0], n, total}});
    if (t.grad_params[0].ptr)
      v.push_back({"scale_bwd_weight",
                   {static_cast<unsigned>((n + 255) / 256), 1, 1},
                   {256, 1, 1},
                   0,
                   {t.grad_output, t.inputs[0], t.grad_params[0], n, total / n}});
    return v;
  }

 private:
  Fault f_;
};

// y = x · w over the last dim, w a learned [n] (init 0.5, 1.5, 0.5, ...).
class ScaleOp final : public kg::CustomOp {
 public:
  explicit ScaleOp(Fault f) : f_(f) {}
  std::string name() const override { return "test.scale"; }
  kg::DType infer_output_dtype(const std::vector<kg::DType>& in) const override {
    if (in.at(0) != kg::DType::F32) throw kg::Error("its kernels take f32");
    return in[0];
  }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    kg::Shape s = in.at(0);
    if (f_ == Fault::WideShape) {
      std::vector<kg::Dim> d(s.begin(), s.end());
      d.back() = kg::Dim(d.back().size() + 1);
      return kg::Shape(d);
    }
    return s;
  }
  std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>& in) const override {
    const std::int64_t n = in.at(0)[in[0].rank() - 1].size();
    std::vector<float> v(static_cast<std::size_t>(f_ == Fault::BadInitSize ? n - 1 : n));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = i % 2 ? 1.5f : 0.5f;
    kg::ParamSpec w;
    w.name = "weight";
    w.shape = {n};
    w.init = kg::ParamInit::from_values(v);
    return {w};
  }
  std::optional<kg::Lowered> lower(const kg::LowerContext&) const override {
    if (f_ == Fault::NoLower) return std::nullopt;
    return kg::Lowered{"test.scale", kScaleSource, "scale_fwd", std::make_shared<ScaleRuntime>(f_)};
  }
  std::string lower_backward_source(const kg::LowerContext&) const override {
    return f_ == Fault::NoBackward ? "" : kScaleBackward;
  }
  void cpu_forward(kg::CpuContext& ctx) const override {
    const kg::Tensor& x = ctx.inputs[0];
    const std::int64_t n = x.shape().back();
    const std::int64_t out_n = ctx.output.shape().back();
    for (std::int64_t i = 0; i < x.numel(); ++i)  // writes as the kernel does: x's layout
      ctx.output.data<float>()[i] = x.data<float>()[i] * ctx.params[0].data<float>()[i % n];
    for (std::int64_t i = x.numel(); i < ctx.output.numel() && out_n != n; ++i)
      ctx.output.data<float>()[i] = 0.f;
  }
  bool has_cpu_backward() const override { return f_ != Fault::NoBackward; }
  void cpu_backward(kg::CpuBackwardContext& ctx) const override {
    const kg::Tensor& x = ctx.inputs[0];
    const std::int64_t n = x.shape().back();
    const float* g = ctx.grad_output.data<float>();
    const float* w = ctx.params[0].data<float>();
    if (ctx.wants_input_grad(0))
      for (std::int64_t i = 0; i < x.numel(); ++i) ctx.grad_inputs[0].data<float>()[i] = g[i] * w[i % n];
    if (ctx.wants_param_grad(0)) {
      float* dw = ctx.grad_params[0].data<float>();
      for (std::int64_t j = 0; j < n; ++j) dw[j] = 0.f;
      for (std::int64_t i = 0; i < x.numel(); ++i) dw[i % n] += g[i] * x.data<float>()[i];
    }
  }

 private:
  Fault f_;
};

// ScaleOp's kernels alone: no cpu_forward, no cpu_backward.
class KernelOnlyScaleOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.scale_gpu"; }
  kg::DType infer_output_dtype(const std::vector<kg::DType>& in) const override {
    return inner_.infer_output_dtype(in);
  }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    return inner_.infer_output_shape(in);
  }
  std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>& in) const override {
    return inner_.parameters(in);
  }
  std::optional<kg::Lowered> lower(const kg::LowerContext& c) const override { return inner_.lower(c); }
  std::string lower_backward_source(const kg::LowerContext& c) const override {
    return inner_.lower_backward_source(c);
  }

 private:
  ScaleOp inner_{Fault::None};
};

// A row sum through shared memory; `sync` false leaves out the barrier between the tree's steps.
// (x, y, row length): a block of `threads` per row of x [rows, n].
struct RowRuntime final : kg::RuntimeOp {
  explicit RowRuntime(unsigned threads) : threads(threads) {}
  void pack_args(const kg::LaunchTensors& t, kg::ArgVisitor& v) const override {
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.output.ptr);
    v.i32(static_cast<std::int32_t>(t.inputs[0].shape[1]));
  }
  kg::Dim3 block() const override { return {threads, 1, 1}; }
  kg::Dim3 grid(const std::vector<std::int64_t>& out) const override { return {static_cast<unsigned>(out[0]), 1, 1}; }
  unsigned threads;
};

class RowSumOp final : public kg::CustomOp {
 public:
  explicit RowSumOp(bool sync) : sync_(sync) {}
  std::string name() const override { return "test.row_sum"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    return kg::Shape{in.at(0)[0]};
  }
  std::optional<kg::Lowered> lower(const kg::LowerContext&) const override {
    std::string src = R"(
extern "C" __global__ void row_sum(const float* x, float* y, int n) {
  __shared__ float s[64];
  const float* r = x + (long long)blockIdx.x * n;
  float v = 0.f;
  for (int i = threadIdx.x; i < n; i += 64) v += r[i];
  s[threadIdx.x] = v;
  __syncthreads();
  for (int k = 32; k > 0; k >>= 1) {
    if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
    SYNC
  }
  if (threadIdx.x == 0) y[blockIdx.x] = s[0];
}
)";
    src.replace(src.find("SYNC"), 4, sync_ ? "__syncthreads();" : "");
    return kg::Lowered{"test.row_sum", src, "row_sum", std::make_shared<RowRuntime>(64)};
  }
  void cpu_forward(kg::CpuContext& ctx) const override {
    const kg::Tensor& x = ctx.inputs[0];
    const std::int64_t n = x.shape()[1];
    for (std::int64_t r = 0; r < x.shape()[0]; ++r) {
      float s = 0.f;
      for (std::int64_t i = 0; i < n; ++i) s += x.data<float>()[r * n + i];
      ctx.output.data<float>()[r] = s;
    }
  }

 private:
  bool sync_;
};

// Sums each row with float4 loads, which is right only when a row starts at a multiple of 16
// bytes: a row length that is not a multiple of 4 puts row 1 off that, where a GPU faults.
class Row4SumOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.row_sum4"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return kg::Shape{in.at(0)[0]}; }
  std::optional<kg::Lowered> lower(const kg::LowerContext&) const override {
    const std::string src = R"(
extern "C" __global__ void row_sum4(const float* x, float* y, int n) {
  const float4* r = reinterpret_cast<const float4*>(x + (long long)blockIdx.x * n);
  float v = 0.f;
  for (int i = 0; i < n / 4; ++i) {
    const float4 q = r[i];
    v += q.x + q.y + q.z + q.w;
  }
  y[blockIdx.x] = v;
}
)";
    return kg::Lowered{"test.row_sum4", src, "row_sum4", std::make_shared<RowRuntime>(1)};
  }
  void cpu_forward(kg::CpuContext& ctx) const override {
    const kg::Tensor& x = ctx.inputs[0];
    const std::int64_t n = x.shape()[1];
    for (std::int64_t r = 0; r < x.shape()[0]; ++r) {
      double s = 0;
      for (std::int64_t i = 0; i < n / 4 * 4; ++i) s += x.data<float>()[r * n + i];
      ctx.output.data<float>()[r] = static_cast<float>(s);
    }
  }
};

kg::Tensor random(std::vector<std::int64_t> shape, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  kg::Tensor t = kg::Tensor::empty(kg::DType::F32, shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = u(rng);
  return t;
}

// x [batch, 40] → linear(40) → scale → [batch, 40 or 41] as "y".
kg::Model scale_model(Fault f, kg::LoweringMode mode = kg::LoweringMode::Inference) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 40}, "x");
  kg::SymTensor h = kg::nn::linear(x, 40, "fc");
  kg::SymTensor y = h.record_custom(kg::CustomData::make<ScaleOp>(f), {}, std::nullopt, "scale");
  if (mode == kg::LoweringMode::Training) {
    kg::SymTensor target = g->input(kg::DType::F32, kg::Shape{kg::Dim::named("batch"), 40}, "target");
    return kg::Model(g, {{"y", y}, {"loss", kg::mse_loss(y, target, "loss")}}, mode);
  }
  return kg::Model(g, {{"y", y}}, mode);
}

kg::LoadOptions checked() {
  kg::LoadOptions o;
  o.checked = true;
  return o;
}

// Each test runs once per device; the cuda instance skips without a GPU.
class CheckedMode : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (cuda() && !kg::Device::cuda_available()) GTEST_SKIP() << "no usable GPU on this machine";
  }
  bool cuda() const { return GetParam() == "Cuda"; }
  kg::Device device() const { return cuda() ? kg::Device::cuda() : kg::Device::cpu(); }
};

const std::vector<std::vector<std::int64_t>> kShapes{{3, 40}};
const std::vector<std::vector<std::int64_t>> kTrainShapes{{3, 40}, {3, 40}};

TEST_P(CheckedMode, HealthyModelMatchesUnchecked) {
  kg::Model m = scale_model(Fault::None);
  const kg::Tensor x = random({3, 40}, 1);
  kg::LoadedModel ref = m.load(kg::Device::cpu(), kShapes);
  const kg::Tensor want = ref.forward({x})[0];
  kg::LoadedModel c = m.load(device(), kShapes, checked());
  c.load_state_dict(ref.state_dict());
  const kg::Tensor got = c.forward({x})[0];
  ASSERT_EQ(got.shape(), want.shape());
  for (std::int64_t i = 0; i < want.numel(); ++i) ASSERT_NEAR(got.item(i), want.item(i), 1e-5) << i;
}

TEST_P(CheckedMode, WrongOutputShapeIsAnUnwrittenElement) {
  kg::Model m = scale_model(Fault::WideShape);
  // Unchecked, the cpu's own cpu_forward fills the extra column and the GPU leaves it as it was:
  // a plausible result either way.
  EXPECT_NO_THROW(m.load(device(), kShapes).forward({random({3, 40}, 2)}));
  kg_test::expect_error(
      [&] {
        m.load(device(), kShapes, checked()).forward({random({3, 40}, 2)});
      },
      {"[test.scale @ scale]", "kernel 'test.scale'", "output 'scale' [3, 41]", "element 120",
       "was not written", "infer_output_shape"});
}

TEST_P(CheckedMode, ArgumentChecksRunAtLoad) {
  // Whether or not the op has a cpu_forward, and without checked mode.
  {
    const kg::Device d = device();
    kg_test::expect_error([&] { scale_model(Fault::MissingArg).load(d, kShapes); },
                          {"[test.scale @ scale]", "kernel 'scale_fwd'",
                           "takes 5 arguments but 4 were packed", "missing argument 4 'total' (long long)"});
    kg_test::expect_error([&] { scale_model(Fault::IntForPointer).load(d, kShapes); },
                          {"[test.scale @ scale]", "argument 1 'w' (const float*) is a pointer in the kernel",
                           "an i32 (4 bytes) was packed"});
    kg_test::expect_error([&] { scale_model(Fault::I64ForPointer).load(d, kShapes); },
                          {"[test.scale @ scale]", "argument 1 'w' (const float*) is a pointer in the kernel",
                           "an i64 (8 bytes) was packed"});
    kg_test::expect_error(
        [&] { scale_model(Fault::BlockOverBounds).load(d, kShapes); },
        {"[test.scale @ scale]", "block (512, 1, 1) has 512 threads", "__launch_bounds__(256)"});
    kg_test::expect_error([&] { scale_model(Fault::WrongEntry).load(d, kShapes); },
                          {"[test.scale @ scale]", "entry point 'scale_forward' is not a __global__ function",
                           "scale_fwd, scale_fwd_past_end"});
  }
}

TEST_P(CheckedMode, NoLowerIsTheSeedsErrorWhereKernelsAreNeeded) {
  kg::Model m = scale_model(Fault::NoLower);
  const std::vector<std::string> parts{"[test.scale @ scale]", "custom op 'test.scale' is not handled",
                                       "implement CustomOp::lower()"};
  if (cuda()) {
    kg_test::expect_error([&] { m.load(device(), kShapes); }, parts);
  } else {
    EXPECT_NO_THROW(m.load(device(), kShapes).forward({random({3, 40}, 3)}));  // cpu_forward serves
  }
  kg_test::expect_error([&] { m.load(device(), kShapes, checked()); }, parts);
}

TEST_P(CheckedMode, WritePastTheEndNamesTheBuffer) {
  kg::Model m = scale_model(Fault::WritePastEnd);
  if (cuda())
    kg_test::expect_error(
        [&] {
          m.load(device(), kShapes, checked()).forward({random({3, 40}, 4)});
        },
        {"[test.scale @ scale]", "kernel 'test.scale'", "wrote past the end of its output 'scale'",
         "element 120"});
  else
    kg_test::expect_error(
        [&] {
          m.load(device(), kShapes, checked()).forward({random({3, 40}, 4)});
        },
        {"[test.scale @ scale]", "output 'scale'", "120"});
}

TEST(CheckedModeCpu, MissingBarrierIsARace) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 256}, "x");
  kg::Model good(g, {{"y", x.record_custom(kg::CustomData::make<RowSumOp>(true), {}, std::nullopt, "sum")}});
  const kg::Tensor in = random({4, 256}, 5);
  EXPECT_NO_THROW(good.load(kg::Device::cpu(), {{4, 256}}, checked()).forward({in}));
  auto [x2, g2] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 256}, "x");
  kg::Model racy(g2,
                 {{"y", x2.record_custom(kg::CustomData::make<RowSumOp>(false), {}, std::nullopt, "sum")}});
  EXPECT_NO_THROW(racy.load(kg::Device::cpu(), {{4, 256}}).forward({in}));  // cpu_forward: silent
  kg_test::expect_error(
      [&] {
        racy.load(kg::Device::cpu(), {{4, 256}}, checked()).forward({in});
      },
      {"[test.row_sum @ sum]"});
}

TEST(CheckedModeCpu, AMisalignedVectorLoadNamesTheOpAndTheRow) {
  auto row4_model = [](std::int64_t n) {
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), n}, "x");
    return kg::Model(g, {{"y", x.record_custom(kg::CustomData::make<Row4SumOp>(), {}, std::nullopt, "sum")}});
  };
  // Rows of 256 floats start at multiples of 16 bytes: the kernel agrees with the CPU form.
  const kg::Tensor in = random({3, 256}, 6);
  const kg::Tensor want = row4_model(256).load(kg::Device::cpu(), {{3, 256}}).forward({in})[0];
  const kg::Tensor got = row4_model(256).load(kg::Device::cpu(), {{3, 256}}, checked()).forward({in})[0];
  EXPECT_TRUE(kg_test::all_close(got, want, 1e-5, 1e-5));
  // Rows of 258: row 1 starts 1032 bytes in, 8 past a multiple of 16. The CPU form is silent.
  const kg::Tensor odd = random({3, 258}, 7);
  EXPECT_NO_THROW(row4_model(258).load(kg::Device::cpu(), {{3, 258}}).forward({odd}));
  kg_test::expect_error(
      [&] { row4_model(258).load(kg::Device::cpu(), {{3, 258}}, checked()).forward({odd}); },
      {"[test.row_sum4 @ sum]", "kernel 'row_sum4'", "misaligned", "float4", "element 258 (byte offset 1032) of argument 0 'x'",
       "8 bytes past a multiple of 16", "test.row_sum4.cu:", "block (1, 0, 0)"});
}

TEST_P(CheckedMode, NoBackwardOnThePathToTheLoss) {
  for (bool c : {false, true}) {
    kg::LoadOptions o;
    o.checked = c;
    kg_test::expect_error(
        [&] { scale_model(Fault::NoBackward, kg::LoweringMode::Training).load(device(), kTrainShapes, o); },
        {"[test.scale @ scale] has no backward", "parameter 'scale.weight'", "the loss 'loss'"});
  }
}

TEST(CheckedModeCpu, InitDataOfTheWrongSizeFailsAtRecord) {
  kg_test::expect_error(
      [&] { scale_model(Fault::BadInitSize); },
      {"[test.scale @ scale]", "parameter 'scale.weight'", "init data is 156 bytes", "[40] × f32 needs 160"});
}

TEST_P(CheckedMode, ParameterDeclaredOnceHasOneNameOnEveryDevice) {
  kg::Model m = scale_model(Fault::None, kg::LoweringMode::Training);
  std::map<std::string, std::vector<std::int64_t>> want;
  for (const auto& p : m.parameters()) want[p.name] = p.shape;
  ASSERT_EQ(want.count("scale.weight"), 1u);
  {
    for (bool c : {false, true}) {
      SCOPED_TRACE(c ? "checked" : "unchecked");
      kg::LoadOptions o;
      o.checked = c;
      kg::LoadedModel lm = m.load(device(), kTrainShapes, o);
      std::map<std::string, std::vector<std::int64_t>> got;
      for (const auto& [name, t] : lm.state_dict()) got[name] = t.shape();
      EXPECT_EQ(got, want);
      EXPECT_EQ(lm.parameter("scale.weight").item(1), 1.5);  // the declared init
    }
  }
}

TEST_P(CheckedMode, ParameterDeclaredOnceTrainsAndPassesCheckOp) {
  const auto report = kg::testing::check_op(kg::CustomData::make<ScaleOp>(Fault::None),
                                            {kg::Shape{kg::Dim::named("batch"), 40}}, {kg::DType::F32});
  EXPECT_TRUE(report.ok) << report.to_string();
  EXPECT_GE(kg_test::count_lines(report, "PASS", {"gradients"}), 1) << report.to_string();
  // Training through the op, checked (kernels emulated and verified, backward too) and not.
  kg::Model m = scale_model(Fault::None, kg::LoweringMode::Training);
  for (bool c : {false, true}) {
    SCOPED_TRACE(c ? "checked" : "unchecked");
    kg::LoadOptions o;
    o.checked = c;
    kg::LoadedModel lm = m.load(device(), kTrainShapes, o);
    lm.set_optimizer(kg::OptimizerOptions::sgd(0.01));
    const kg::Tensor x = random({3, 40}, 6);
    const double before = lm.parameter("scale.weight").item(0);
    lm.zero_grad();
    lm.forward({x, random({3, 40}, 7)});
    lm.backward();
    const kg::Tensor g = lm.grad("scale.weight");
    lm.step();
    EXPECT_NE(g.item(0), 0.0);
    EXPECT_NEAR(lm.parameter("scale.weight").item(0), before - 0.01 * g.item(0), 1e-6);
  }
}

// Writes ones; on a GPU (not under the emulator) also far outside any allocation.
class GpuFaultOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.gpu_fault"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  std::optional<kg::Lowered> lower(const kg::LowerContext&) const override {
    struct Rt final : kg::RuntimeOp {
      void pack_args(const kg::LaunchTensors& t, kg::ArgVisitor& v) const override {
        v.pointer(t.output.ptr);
        v.i64(t.output.numel());
      }
    };
    return kg::Lowered{"test.gpu_fault", R"(
extern "C" __global__ void ones(float* y, long long n) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= n) return;
  y[i] = 1.f;
#ifdef __CUDA_ARCH__
  y[i + (1LL << 40)] = 1.f;
#endif
}
)",
                       "ones", std::make_shared<Rt>()};
  }
  void cpu_forward(kg::CpuContext& ctx) const override { ctx.output.fill(1.0); }
};

kg::Model wild_model() {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 8}, "x");
  return kg::Model(g,
                   {{"y", x.record_custom(kg::CustomData::make<GpuFaultOp>(), {}, std::nullopt, "wild")}});
}

// The output of this test binary run with one disabled test of its own, in a child process. A
// sharded parent's shard variables are dropped: the child runs its one test whatever the shard.
std::string run_child(const std::string& test) {
  const std::string cmd = "env -u GTEST_TOTAL_SHARDS -u GTEST_SHARD_INDEX -u GTEST_SHARD_STATUS_FILE '" +
                          std::filesystem::read_symlink("/proc/self/exe").string() +
                          "' --gtest_also_run_disabled_tests --gtest_filter=" + test + " 2>&1";
  std::string out;
  if (FILE* p = popen(cmd.c_str(), "r")) {
    char buf[4096];
    while (std::fgets(buf, sizeof buf, p)) out += buf;
    pclose(p);
  }
  return out;
}

// Run only as a child process by the test below: a fault on the GPU, and what the process says
// about the CUDA context afterwards.
TEST(CheckedModeGpuChild, DISABLED_Fault) {
  try {
    wild_model().load(kg::Device::cuda(), {{2, 8}}, checked()).forward({random({2, 8}, 9)});
    std::printf("no fault\n");
  } catch (const kg::Error& e) {
    std::printf("first: %s\n", e.what());
  }
  try {
    scale_model(Fault::None).load(kg::Device::cuda(), kShapes).forward({random({3, 40}, 10)});
    std::printf("later: ran\n");
  } catch (const kg::Error& e) {
    std::printf("later: %s\n", e.what());
  }
}

// A fault is that op's error, and it does not spread beyond its process: the CUDA context of the
// process that faulted stays unusable (and says why), this one runs on.
TEST(CheckedModeGpu, AFaultIsTheOpsErrorAndStaysInItsProcess) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no usable GPU on this machine";
  const std::string out = run_child("CheckedModeGpuChild.DISABLED_Fault");
  EXPECT_NE(out.find("first: [test.gpu_fault @ wild] kernel 'test.gpu_fault'"), std::string::npos) << out;
  EXPECT_NE(out.find("CUDA_ERROR_ILLEGAL_ADDRESS"), std::string::npos) << out;
  EXPECT_NE(out.find("first seen at: [test.gpu_fault @ wild]"), std::string::npos) << out;
  // This process's context is untouched.
  kg::Model m = scale_model(Fault::None);
  kg::LoadedModel ref = m.load(kg::Device::cpu(), kShapes);
  kg::LoadedModel gpu = m.load(kg::Device::cuda(), kShapes, checked());
  gpu.load_state_dict(ref.state_dict());
  const kg::Tensor x = random({3, 40}, 11);
  const kg::Tensor a = ref.forward({x})[0], b = gpu.forward({x})[0];
  for (std::int64_t i = 0; i < a.numel(); ++i) ASSERT_NEAR(a.item(i), b.item(i), 1e-5) << i;
}

// An op with kernels only: check_op compares them with a reference when given one, says there is
// none otherwise, and checks the backward kernels against finite differences of the emulated
// forward.
TEST(CheckedModeCpu, KernelOnlyOpGetsAReferenceAndFiniteDifferences) {
  const auto op = kg::CustomData::make<KernelOnlyScaleOp>();
  const std::vector<kg::Shape> shapes{kg::Shape{kg::Dim::named("batch"), 40}};
  const auto plain = kg::testing::check_op(op, shapes, {kg::DType::F32});
  EXPECT_TRUE(plain.ok) << plain.to_string();
  EXPECT_EQ(kg_test::count_lines(plain, "SKIP", {"reference", "not with an independent value"}), 1)
      << plain.to_string();
  EXPECT_GE(kg_test::count_lines(plain, "PASS", {"gradients", "emulator", "finite differences"}), 2)
      << plain.to_string();
  EXPECT_EQ(kg_test::count_lines(plain, "SKIP", {"cpu_backward", "emulated forward kernels"}), 1)
      << plain.to_string();

  kg::testing::CheckOpOptions o;
  o.reference = [](const std::vector<kg::Tensor>& in, const std::map<std::string, kg::Tensor>& p) {
    kg::Tensor r = kg::Tensor::empty(kg::DType::F64, in[0].shape());
    const std::int64_t n = in[0].shape().back();
    for (std::int64_t i = 0; i < in[0].numel(); ++i)
      r.data<double>()[i] = in[0].item(i) * p.at("weight").item(i % n);
    return r;
  };
  const auto good = kg::testing::check_op(op, shapes, {kg::DType::F32}, o);
  EXPECT_TRUE(good.ok) << good.to_string();
  EXPECT_EQ(kg_test::count_lines(good, "PASS", {"reference"}), 3) << good.to_string();
  // A reference that disagrees fails the check.
  o.reference = [](const std::vector<kg::Tensor>& in, const std::map<std::string, kg::Tensor>&) {
    return in[0].clone();
  };
  const auto bad = kg::testing::check_op(op, shapes, {kg::DType::F32}, o);
  EXPECT_FALSE(bad.ok) << bad.to_string();
  EXPECT_GE(kg_test::count_lines(bad, "FAIL", {"reference"}), 1) << bad.to_string();
}


// Run only as a child process: check_op on an op that faults on the GPU, then on a healthy one.
TEST(CheckedModeGpuChild, DISABLED_CheckOpFault) {
  const std::vector<kg::Shape> shapes{kg::Shape{kg::Dim::named("batch"), 40}};
  const auto bad = kg::testing::check_op(kg::CustomData::make<GpuFaultOp>(), shapes, {kg::DType::F32});
  std::printf("bad report:\n%s", bad.to_string().c_str());
  const auto next =
      kg::testing::check_op(kg::CustomData::make<ScaleOp>(Fault::None), shapes, {kg::DType::F32});
  std::printf("next report:\n%s", next.to_string().c_str());
}

// check_op on an op whose kernel faults on the GPU: its gpu line fails naming the op and the fault;
// later GPU lines in that process are skipped with the reason (CUDA cannot recover from a fault
// in-process); a check in another process — as ctest runs every test — uses the GPU as before.
TEST(CheckedModeGpu, AFaultInCheckOpDoesNotFailTheNextCheck) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no usable GPU on this machine";
  const std::string out = run_child("CheckedModeGpuChild.DISABLED_CheckOpFault");
  const auto bad = out.find("bad report:"), next = out.find("next report:");
  ASSERT_NE(bad, std::string::npos) << out;
  ASSERT_NE(next, std::string::npos) << out;
  const std::string first = out.substr(bad, next - bad), second = out.substr(next);
  EXPECT_NE(first.find("check_op: FAILED"), std::string::npos) << first;
  EXPECT_NE(first.find("FAIL batch 1, gpu: [test.gpu_fault @ gpu_fault]"), std::string::npos) << first;
  EXPECT_NE(first.find("CUDA_ERROR_ILLEGAL_ADDRESS"), std::string::npos) << first;
  EXPECT_NE(first.find("later GPU checks in this process are skipped"), std::string::npos) << first;
  EXPECT_NE(first.find("PASS batch 1, emulator"), std::string::npos) << first;
  EXPECT_NE(second.find("SKIP batch 1, gpu: not run: a kernel fault earlier in this process"),
            std::string::npos)
      << second;
  EXPECT_NE(second.find("first seen at: [test.gpu_fault @ gpu_fault]"), std::string::npos) << second;
  EXPECT_EQ(second.find("FAIL"), std::string::npos) << second;
  // This process never faulted: the same healthy check runs on the GPU.
  EXPECT_TRUE(kg::cuda::first_fault().empty());
  const std::vector<kg::Shape> shapes{kg::Shape{kg::Dim::named("batch"), 40}};
  const auto good =
      kg::testing::check_op(kg::CustomData::make<ScaleOp>(Fault::None), shapes, {kg::DType::F32});
  EXPECT_TRUE(good.ok) << good.to_string();
  EXPECT_GE(kg_test::count_lines(good, "PASS", {", gpu"}), 4) << good.to_string();  // 3 batches + gradients
}

// y = the byte `value` in every element of a one-byte dtype, except element `skip` (-1: none),
// which the kernel leaves as it was.
class FillByteOp final : public kg::CustomOp {
 public:
  FillByteOp(kg::DType dtype, int value, std::int64_t skip) : dtype_(dtype), value_(value), skip_(skip) {}
  std::string name() const override { return "test.fill_byte"; }
  kg::DType infer_output_dtype(const std::vector<kg::DType>&) const override { return dtype_; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  std::optional<kg::Lowered> lower(const kg::LowerContext&) const override {
    const char* src = R"(
extern "C" __global__ void __launch_bounds__(256)
fill_byte(unsigned char* __restrict__ y, int v, long long total, long long skip) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < total && i != skip) y[i] = (unsigned char)v;
}
)";
    struct Rt final : kg::RuntimeOp {
      Rt(int v, std::int64_t skip) : v_(v), skip_(skip) {}
      std::vector<kg::Launch> launches(const kg::LaunchTensors& t) const override {
        const std::int64_t total = t.output.numel();
        kg::Launch l;
        l.block = {256, 1, 1};
        l.grid = {static_cast<unsigned>((total + 255) / 256), 1, 1};
        l.args.add(t.output);
        l.args.i32(v_);
        l.args.i64(total);
        l.args.i64(skip_);
        return {l};
      }
      int v_;
      std::int64_t skip_;
    };
    return kg::Lowered{"test.fill_byte", src, "fill_byte", std::make_shared<Rt>(value_, skip_)};
  }

 private:
  kg::DType dtype_;
  int value_;
  std::int64_t skip_;
};

kg::Model fill_byte_model(kg::DType dtype, int value, std::int64_t skip) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 40}, "x");
  kg::SymTensor y = x.record_custom(kg::CustomData::make<FillByteOp>(dtype, value, skip), {}, std::nullopt, "fill");
  return kg::Model(g, {{"y", y}});
}

// The integer poison is 0xA5 bytes, a value a one-byte output may hold (u8 165, i8 -91): a kernel
// writing it everywhere wrote every element, and is not reported; an element it does not write
// still is, whatever the others hold.
TEST_P(CheckedMode, AnOutputHoldingThePoisonValueIsWrittenAndAMissedElementIsNot) {
  const kg::Tensor x = random({3, 40}, 3);
  for (kg::DType dtype : {kg::DType::U8, kg::DType::I8, kg::DType::Bool}) {
    SCOPED_TRACE(kg::dtype_name(dtype));
    const int value = dtype == kg::DType::Bool ? 1 : 0xA5;
    if (dtype != kg::DType::Bool) {
      const kg::Tensor y = fill_byte_model(dtype, value, -1).load(device(), kShapes, checked()).forward({x}).at(0);
      ASSERT_EQ(y.dtype(), dtype);
      ASSERT_EQ(y.nbytes(), 120u);
      const auto* b = static_cast<const unsigned char*>(y.raw());
      for (std::size_t i = 0; i < 120; ++i) ASSERT_EQ(b[i], 0xA5) << i;
    }
    for (std::int64_t skip : {std::int64_t{0}, std::int64_t{77}, std::int64_t{119}})
      kg_test::expect_error(
          [&] { fill_byte_model(dtype, value, skip).load(device(), kShapes, checked()).forward({x}); },
          {"[test.fill_byte @ fill]", "output 'fill' [3, 40]", "element " + std::to_string(skip) + " ",
           "was not written"});
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, CheckedMode, ::testing::Values("Cpu", "Cuda"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
