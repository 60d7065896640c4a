// kg::testing::check_op: correct ops (detect_decode, built-in layers) pass every check;
// ops with planted bugs — unwritten outputs, a wrong kernel, an out-of-bounds write, a lying
// shape, non-deterministic results — fail with the op, the node and the numbers in the report.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <random>

#include "../../examples/detect_decode/detect_decode.hpp"
#include "kg/runtime_op.hpp"
#include "kg/testing.hpp"
#include "support/test_util.hpp"

using kg_test::count_lines;
using kg_test::fresh_seed;

namespace {


kg::testing::CheckOpOptions options(std::uint64_t seed) {
  kg::testing::CheckOpOptions o;
  o.seed = seed;
  return o;
}

// The op of the node that `build` records on a fresh input.
kg::CustomData recorded_op(kg::DType dtype, const kg::Shape& shape,
                           const std::function<kg::SymTensor(const kg::SymTensor&)>& build) {
  auto [x, g] = kg::SymTensor::input(dtype, shape, "x");
  kg::SymTensor y = build(x);
  return *g->node(y.node()).op;
}

TEST(CheckOp, DetectDecodePassesEveryCheck) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  kg::CustomData op(yolo::DetectDecodeOp::for_level(5, 9, 16.f, 32));  // 45 anchors: a partial second tile
  auto r = kg::testing::check_op(op, {{kg::Dim::named("batch"), 4, 45}}, {kg::DType::F32}, options(seed));
  SCOPED_TRACE(r.to_string());
  EXPECT_TRUE(r.ok);
  EXPECT_EQ(r.lines.at(0), "INFO op yolo.detect_decode, seed " + std::to_string(seed) +
                               " (CheckOpOptions::seed reproduces this run)");
  EXPECT_EQ(count_lines(r, "PASS record", {"[batch, 4, 45] f32 -> output [batch, 4, 45] f32"}), 1);
  EXPECT_EQ(
      count_lines(r, "PASS batch 3, shape", {"inputs [3, 4, 45] -> [3, 4, 45] (declared [batch, 4, 45])"}),
      1);
  for (const char* b : {"batch 1", "batch 3", "batch 8"}) {
    EXPECT_EQ(count_lines(r, std::string("PASS ") + b + ", cpu_forward", {"elements written", "2 rerun(s)"}),
              1)
        << b;
    EXPECT_EQ(count_lines(r, std::string("PASS ") + b + ", emulator",
                          {"the emulated kernel (checked mode) matches the CPU within rtol 1e-05, atol 1e-06",
                           "2 rerun(s) bitwise equal"}),
              1)
        << b;
  }
  EXPECT_EQ(count_lines(r, "PASS batch 8, cpu_forward", {"every one of 1440 elements"}), 1);
  if (!kg::Device::cuda_available()) {
    EXPECT_EQ(count_lines(r, "SKIP batch 1, gpu", {"no usable GPU"}), 1);
  }
  EXPECT_EQ(count_lines(r, "SKIP gradient check", {"no backward"}), 1);
  EXPECT_EQ(count_lines(r, "FAIL"), 0);
  EXPECT_EQ(r.to_string().rfind("check_op: ok (", 0), 0u) << r.to_string();
  EXPECT_NE(r.to_string().find(" skipped)\n  INFO op yolo.detect_decode"), std::string::npos);
}

TEST(CheckOp, BuiltInLayersPass) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto o = options(seed);
  o.batch_sizes = {1, 5};
  o.rtol = 1e-4;  // the kernels reduce in another order than the CPU
  o.atol = 1e-5;
  auto linear = recorded_op(kg::DType::F32, {kg::dynamic, 12},
                            [](const kg::SymTensor& x) { return kg::nn::linear(x, 7, "fc"); });
  auto r = kg::testing::check_op(linear, {{kg::dynamic, 12}}, {kg::DType::F32}, o);
  EXPECT_TRUE(r.ok) << r.to_string();
  EXPECT_EQ(count_lines(r, "PASS batch 5, emulator"), 1) << r.to_string();
  auto softmax = recorded_op(kg::DType::F64, {kg::dynamic, 3, 10},
                             [](const kg::SymTensor& x) { return kg::softmax(x, -1); });
  r = kg::testing::check_op(softmax, {{kg::Dim::named("n"), 3, 10}}, {kg::DType::F64}, o);
  EXPECT_TRUE(r.ok) << r.to_string();
  EXPECT_EQ(count_lines(r, "PASS batch 5, shape", {"inputs [5, 3, 10] -> [5, 3, 10]"}), 1) << r.to_string();
}

// y = 2x over [B, C] f32, with a bug planted by mode.
enum class Bug {
  None,
  Unwritten,
  WrongKernel,
  OutOfBounds,
  ShapeLie,
  NonDeterministic,
  SourceWithoutLaunches,  // a backward source, but the RuntimeOp describes no backward launch
  LaunchesWithoutSource,  // backward launches, but no backward source: no backward
  NoLowering,
  BadSource,
  BadSignature,
  FormDisagrees  // an elementwise_form that adds 0.0625 the kernel and the CPU do not
};

const char* kScaleSource = R"(
extern "C" __global__ void __launch_bounds__(64) scale2(const float* x, float* y, long long n) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = 2.f * x[i];
}
extern "C" __global__ void __launch_bounds__(64) scale2_wrong(const float* x, float* y, long long n) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = 2.f * x[i] + (i == 5 ? 1.f : 0.f);
}
extern "C" __global__ void __launch_bounds__(64) scale2_oob(const float* x, float* y, long long n) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i <= n) y[i] = 2.f * x[i < n ? i : 0];
}
)";

class ScaleRuntime final : public kg::RuntimeOp {
 public:
  void pack_args(const kg::LaunchTensors& t, kg::ArgVisitor& v) const override {
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.output.ptr);
    v.i64(t.output.numel());
  }
  kg::Dim3 block() const override { return {64, 1, 1}; }
  kg::Dim3 grid(const std::vector<std::int64_t>& shape) const override {
    return {static_cast<unsigned>((kg::numel_of(shape) + 63) / 64), 1, 1};
  }
  // Described, but only used when the op has a backward source (Bug::LaunchesWithoutSource).
  std::vector<kg::Launch> backward_launches(const kg::LaunchTensors& t) const override {
    if (!with_backward_) return {};
    return {kg::Launch{"scale2", grid(t.grad_output.shape), block(), 0,
                       {t.grad_output, t.grad_inputs[0], t.grad_output.numel()}}};
  }
  explicit ScaleRuntime(bool with_backward = false) : with_backward_(with_backward) {}

 private:
  bool with_backward_;
};

class ScaleOp final : public kg::CustomOp {
 public:
  explicit ScaleOp(Bug bug) : bug_(bug) {}
  std::string name() const override { return "test.scale2"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    if (in.size() != 1 || in[0].rank() != 2) throw kg::Error("expects one [B, C] input");
    kg::Shape s = in[0];
    if (bug_ == Bug::ShapeLie && s[0].is_static() && s[0].size() == 3) s[1] = s[1].size() + 1;
    return s;
  }
  std::optional<kg::Lowered> lower(const kg::LowerContext&) const override {
    if (bug_ == Bug::NoLowering) return std::nullopt;
    const char* entry = bug_ == Bug::WrongKernel   ? "scale2_wrong"
                        : bug_ == Bug::OutOfBounds ? "scale2_oob"
                                                   : "scale2";
    // BadSource: the signature matches the launch (so the load-time checks pass) but the body
    // does not compile. BadSignature: compiles, but takes one argument where three are packed.
    const char* source =
        bug_ == Bug::BadSource ? "extern \"C\" __global__ void scale2(const float* x, float* y, long long n) "
                                 "{ y[0] = undeclared; }"
        : bug_ == Bug::BadSignature ? "extern \"C\" __global__ void scale2(float* y) { y[0] = 1.f; }"
                                    : kScaleSource;
    return kg::Lowered{"test.scale2", source, entry,
                       std::make_shared<ScaleRuntime>(bug_ == Bug::LaunchesWithoutSource)};
  }
  std::string lower_backward_source(const kg::LowerContext&) const override {
    return bug_ == Bug::SourceWithoutLaunches ? kScaleSource : "";
  }
  // y = 2x per element: what the fusion pass would run in the op's place.
  std::optional<kg::ElementwiseForm> elementwise_form(const std::vector<kg::DType>&) const override {
    kg::ElementwiseForm f;
    const bool off = bug_ == Bug::FormDisagrees;
    f.device_source = off ? "template <class T> __device__ T twice(T x) { return T(2) * x + T(0.0625); }\n"
                          : "template <class T> __device__ T twice(T x) { return T(2) * x; }\n";
    f.function = "twice";
    f.cpu = kg::ElementwiseForm::cpu_map<1>([off](auto x) { return decltype(x)(2) * x + (off ? decltype(x)(0.0625) : 0); });
    return f;
  }
  void cpu_forward(kg::CpuContext& ctx) const override {
    const float* x = ctx.inputs[0].data<float>();
    float* y = ctx.output.data<float>();
    const float extra = bug_ == Bug::NonDeterministic ? static_cast<float>(calls_++) : 0.f;
    for (std::int64_t i = 0; i < ctx.output.numel(); i += bug_ == Bug::Unwritten ? 2 : 1)
      y[i] = 2.f * x[i] + extra;
  }

 private:
  Bug bug_;
  mutable std::atomic<int> calls_{0};
};

kg::testing::CheckOpReport check_scale(Bug bug, std::uint64_t seed,
                                       std::vector<std::int64_t> batches = {1, 3}) {
  auto o = options(seed);
  o.batch_sizes = std::move(batches);
  return kg::testing::check_op(kg::CustomData::make<ScaleOp>(bug), {{kg::Dim::named("batch"), 6}},
                               {kg::DType::F32}, o);
}

TEST(CheckOp, CorrectOpPassesAndAnOpWithoutABackwardSkipsTheGradientCheck) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check_scale(Bug::None, seed);
  EXPECT_TRUE(r.ok) << r.to_string();
  EXPECT_EQ(count_lines(r, "SKIP gradient check: the op has no backward"), 1) << r.to_string();
  // Backward launches without a backward source: the source is what gives an op a lowered
  // backward, so it has none.
  r = check_scale(Bug::LaunchesWithoutSource, seed);
  EXPECT_TRUE(r.ok) << r.to_string();
  EXPECT_EQ(count_lines(r, "SKIP gradient check: the op has no backward (no CPU backward, lower_backward_source() is "
                           "empty)"),
            1)
      << r.to_string();
}

TEST(CheckOp, ABackwardSourceWithoutBackwardLaunchesFails) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check_scale(Bug::SourceWithoutLaunches, seed);
  SCOPED_TRACE(r.to_string());
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(count_lines(r, "SKIP gradient check"), 0);
  EXPECT_EQ(count_lines(r, "FAIL gradients batch 3, emulator",
                        {"[test.scale2 @ scale2]", "RuntimeOp::backward_launches() described no launch"}),
            1);
}

TEST(CheckOp, UnwrittenCpuOutputFails) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check_scale(Bug::Unwritten, seed);
  SCOPED_TRACE(r.to_string());
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(count_lines(r,
                        "FAIL batch 1, cpu_forward: [test.scale2 @ scale2] cpu_forward left 3 of 6 output "
                        "elements unwritten (NaN in a NaN-poisoned output; first at [0, 1])"),
            1);
  EXPECT_EQ(count_lines(r, "FAIL batch 3, cpu_forward", {"left 9 of 18 output elements unwritten"}), 1);
}

TEST(CheckOp, WrongKernelFailsWithTheElementAndNumbers) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check_scale(Bug::WrongKernel, seed);
  SCOPED_TRACE(r.to_string());
  EXPECT_FALSE(r.ok);
  // Element 5 is [0, 5] at every batch size; the kernel adds exactly 1 there.
  EXPECT_EQ(count_lines(r,
                        "FAIL batch 1, emulator: [test.scale2 @ scale2] the emulated kernel (checked mode) "
                        "differs from the CPU at 1 of 6 elements; worst at [0, 5]",
                        {"(|diff| 1.00e+00"}),
            1);
  EXPECT_EQ(count_lines(r, "FAIL batch 3, emulator", {"at 1 of 18 elements; worst at [0, 5]"}), 1);
  EXPECT_EQ(count_lines(r, "PASS batch 3, cpu_forward"), 1);
}

TEST(CheckOp, OutOfBoundsWriteFailsNamingTheArgument) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check_scale(Bug::OutOfBounds, seed, {2});  // 48 bytes: the end lies on the guard page
  SCOPED_TRACE(r.to_string());
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(
      count_lines(r,
                  "FAIL batch 2, emulator: [test.scale2 @ scale2] kernel 'scale2_oob': out-of-bounds write "
                  "past the end of argument 1 'y'",
                  {"at element 12 (byte offset 48)", "thread (12, 0, 0) of block (0, 0, 0)"}),
      1);
}

TEST(CheckOp, AKernelThatDoesNotCompileIsReportedOnce) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check_scale(Bug::BadSource, seed, {1, 3, 4});
  SCOPED_TRACE(r.to_string());
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(count_lines(r, "FAIL batch 1, emulator: [test.scale2 @ scale2]", {"undeclared"}), 1);
  EXPECT_EQ(count_lines(r, "FAIL batch 3, emulator: [test.scale2 @ scale2] the same failure as batch 1"), 1);
  EXPECT_EQ(count_lines(r, "FAIL batch 4, emulator: [test.scale2 @ scale2] the same failure as batch 1"), 1);
  EXPECT_EQ(count_lines(r, "PASS batch 4, cpu_forward"), 1);
}

TEST(CheckOp, ALaunchThatDoesNotMatchTheKernelSignatureFailsAtLoad) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check_scale(Bug::BadSignature, seed, {1, 3});
  SCOPED_TRACE(r.to_string());
  EXPECT_FALSE(r.ok);
  // The cpu device checks every lowered op's launches at load, even one it runs on the CPU.
  EXPECT_EQ(count_lines(r,
                        "FAIL batch 1, cpu: [test.scale2 @ scale2] launch 0 of kernel 'scale2': the kernel takes 1 "
                        "arguments but 3 were packed"),
            1);
  EXPECT_EQ(count_lines(r, "FAIL batch 3, cpu: [test.scale2 @ scale2] the same failure as batch 1"), 1);
}

TEST(CheckOp, ShapeThatDisagreesWithTheRecordFails) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check_scale(Bug::ShapeLie, seed, {1, 3, 4});
  SCOPED_TRACE(r.to_string());
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(
      count_lines(r,
                  "FAIL batch 3, shape: [test.scale2 @ scale2] infer_output_shape gives [3, 7] for inputs "
                  "[3, 6]: dim 1 is 7 but 6 was declared at record time ([batch, 6])"),
      1);
  EXPECT_EQ(count_lines(r, "PASS batch 1, shape"), 1);
  EXPECT_EQ(count_lines(r, "PASS batch 4, emulator"), 1);
}

TEST(CheckOp, NonDeterministicResultsFail) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check_scale(Bug::NonDeterministic, seed, {2});
  SCOPED_TRACE(r.to_string());
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(
      count_lines(r,
                  "FAIL batch 2, cpu_forward: [test.scale2 @ scale2] rerun 1 differs from the first run at "
                  "[0, 0]",
                  {"bitwise-equal"}),
      1);
}

TEST(CheckOp, OpsWithoutALoweringOrACpuImplementation) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check_scale(Bug::NoLowering, seed);
  EXPECT_TRUE(r.ok) << r.to_string();
  EXPECT_EQ(count_lines(r, "SKIP batch 3, emulator: the op has no lowering"), 1) << r.to_string();
  EXPECT_EQ(count_lines(r, "SKIP batch 3, gpu: the op has no lowering"), 1) << r.to_string();

  // No cpu_forward: the cpu device runs the kernel through the emulator; the checked emulated run
  // is compared with that. The op's parameters (the anchors) are the real op's.
  class Decode final : public kg::CustomOp {
   public:
    std::string name() const override { return "test.decode_gpu_only"; }
    kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
      return op_->infer_output_shape(in);
    }
    std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>& in) const override {
      return op_->parameters(in);
    }
    std::optional<kg::Lowered> lower(const kg::LowerContext& ctx) const override { return op_->lower(ctx); }

   private:
    std::shared_ptr<yolo::DetectDecodeOp> op_ = yolo::DetectDecodeOp::for_level(3, 4, 8.f, 32);
  };
  r = kg::testing::check_op(kg::CustomData::make<Decode>(), {{kg::dynamic, 4, 12}}, {kg::DType::F32},
                            options(seed));
  {
    SCOPED_TRACE(r.to_string());
    EXPECT_TRUE(r.ok);
    EXPECT_EQ(count_lines(r, "SKIP cpu_forward: the op has no CPU implementation"), 1);
    EXPECT_EQ(count_lines(r, "PASS batch 8, cpu device: emulated kernel (guarded buffers) wrote every one of 384 elements"), 1);
    EXPECT_EQ(count_lines(r, "PASS batch 8, emulator", {"matches the cpu device"}), 1);
    // Without a reference there is nothing independent to compare the kernel with: said once.
    EXPECT_EQ(count_lines(r, "SKIP reference", {"no CheckOpOptions::reference"}), 1);
  }

  // With an independent reference, computed from the inputs and the parameters by the names the
  // op declares, the emulated cpu device is compared with it. The kernel adds and subtracts
  // coordinates of up to ~100 in f32 against a double reference: an absolute tolerance of f32's
  // rounding at that size.
  auto o = options(seed);
  o.atol = 1e-4;
  std::vector<std::vector<std::string>> names_seen;
  auto reference = [&](double scale) {
    return [&names_seen, scale](const std::vector<kg::Tensor>& in, const std::map<std::string, kg::Tensor>& p) {
      std::vector<std::string> names;
      for (const auto& [name, t] : p) names.push_back(name);
      names_seen.push_back(names);
      const kg::Tensor& d = in.at(0);
      const std::int64_t B = d.dim(0), A = d.dim(2);
      kg::Tensor out = kg::Tensor::empty(kg::DType::F64, d.shape());
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t a = 0; a < A; ++a) {
          auto dist = [&](int k) { return d.item((b * 4 + k) * A + a); };
          const double ax = p.at("anchor_x").item(a), ay = p.at("anchor_y").item(a), s = p.at("strides").item(a);
          const double x1 = ax - dist(0), y1 = ay - dist(1), x2 = ax + dist(2), y2 = ay + dist(3);
          double* o4 = out.data<double>() + b * 4 * A + a;
          o4[0] = 0.5 * (x1 + x2) * s * scale;
          o4[A] = 0.5 * (y1 + y2) * s;
          o4[2 * A] = (x2 - x1) * s;
          o4[3 * A] = (y2 - y1) * s;
        }
      return out;
    };
  };
  o.reference = reference(1.0);
  r = kg::testing::check_op(kg::CustomData::make<Decode>(), {{kg::dynamic, 4, 12}}, {kg::DType::F32}, o);
  {
    SCOPED_TRACE(r.to_string());
    EXPECT_TRUE(r.ok);
    EXPECT_EQ(count_lines(r, "PASS batch 8, reference"), 1);
    EXPECT_EQ(count_lines(r, "SKIP reference"), 0);
    ASSERT_FALSE(names_seen.empty());
    EXPECT_EQ(names_seen[0], (std::vector<std::string>{"anchor_x", "anchor_y", "strides"}));
  }
  // A reference that disagrees (centre x doubled) fails the check.
  o.reference = reference(2.0);
  r = kg::testing::check_op(kg::CustomData::make<Decode>(), {{kg::dynamic, 4, 12}}, {kg::DType::F32}, o);
  SCOPED_TRACE(r.to_string());
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(count_lines(r, "FAIL batch 8, reference"), 1);
}

TEST(CheckOp, InputGeneratorAndSetupErrors) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // A generator of positive inputs, called once per batch size with the concrete shape.
  std::vector<std::vector<std::int64_t>> asked;
  auto o = options(seed);
  o.batch_sizes = {2, 5};
  std::mt19937_64 rng(seed);
  o.make_input = [&](int index, const std::vector<std::int64_t>& shape) {
    EXPECT_EQ(index, 0);
    asked.push_back(shape);
    return kg_test::random_tensor(rng, kg::DType::F32, shape, 0.5, 1.0);
  };
  auto r = kg::testing::check_op(kg::CustomData::make<ScaleOp>(Bug::None), {{kg::dynamic, 6}},
                                 {kg::DType::F32}, o);
  EXPECT_TRUE(r.ok) << r.to_string();
  EXPECT_EQ(asked, (std::vector<std::vector<std::int64_t>>{{2, 6}, {5, 6}}));

  // A generator that returns the wrong shape.
  o.make_input = [](int, const std::vector<std::int64_t>&) {
    return kg::Tensor::zeros(kg::DType::F32, {2, 2});
  };
  r = kg::testing::check_op(kg::CustomData::make<ScaleOp>(Bug::None), {{kg::dynamic, 6}}, {kg::DType::F32},
                            o);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(count_lines(r,
                        "FAIL batch 5, inputs: [test.scale2 @ scale2] CheckOpOptions::make_input(0, [5, 6]) "
                        "returned [2, 2] f32; the input is [5, 6] f32"),
            1)
      << r.to_string();

  // Recording fails: the error names the op and the node, and nothing else runs.
  r = kg::testing::check_op(kg::CustomData::make<ScaleOp>(Bug::None), {{kg::dynamic, 6, 2}},
                            {kg::DType::F32});
  EXPECT_FALSE(r.ok);
  ASSERT_EQ(r.lines.size(), 2u) << r.to_string();
  EXPECT_EQ(r.lines[1], "FAIL record: [test.scale2 @ scale2] expects one [B, C] input");
  EXPECT_NE(r.to_string().find("check_op: FAILED"), std::string::npos);

  // Shapes and dtypes of different counts; a negative batch size.
  r = kg::testing::check_op(kg::CustomData::make<ScaleOp>(Bug::None), {{kg::dynamic, 6}}, {});
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(count_lines(r, "FAIL setup: [test.scale2] check_op: 1 input shapes but 0 dtypes"), 1)
      << r.to_string();
  o = options(seed);
  o.batch_sizes = {-2};
  r = kg::testing::check_op(kg::CustomData::make<ScaleOp>(Bug::None), {{kg::dynamic, 6}}, {kg::DType::F32},
                            o);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(count_lines(r, "FAIL batch -2: [test.scale2 @ scale2] batch size -2 is negative"), 1)
      << r.to_string();
}

}  // namespace

// The elementwise form is what the fusion pass runs in the op's place: one that disagrees with the
// op's own result changes a model's numbers when the op is fused. check_op compares the two.
TEST(CheckOp, AnElementwiseFormThatDisagreesWithTheOpFails) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check_scale(Bug::FormDisagrees, seed);
  SCOPED_TRACE(r.to_string());
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(count_lines(r, "FAIL batch 1, elementwise form: [test.scale2 @ scale2] the op's elementwise_form (what the fusion pass runs in its place) differs from the CPU at 6 of 6 elements",
                        {"(|diff| 6.25e-02"}),
            1);
  // The fused kernel the fusion pass would generate from the form's device function too.
  EXPECT_EQ(count_lines(r, "FAIL batch 3, elementwise form, emulator: [test.scale2 @ scale2] the fused kernel of the op's "
                           "elementwise_form (checked mode) differs from the CPU at 18 of 18 elements",
                        {"(|diff| 6.25e-02"}),
            1);
  EXPECT_EQ(count_lines(r, "PASS batch 1, emulator"), 1);  // the kernel itself is right
  r = check_scale(Bug::None, seed);
  EXPECT_EQ(count_lines(r, "PASS batch 3, elementwise form:", {"matches"}), 1) << r.to_string();
  EXPECT_EQ(count_lines(r, "PASS batch 3, elementwise form, emulator:", {"matches"}), 1) << r.to_string();
}

// After the CPU fails, the emulator and GPU lines are still there (run, or skipped saying why),
// and the heading says FAILED with the counts.
TEST(CheckOp, EveryLineIsReportedAfterACpuFailureAndTheHeadingIsTheWorstResult) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = check_scale(Bug::Unwritten, seed);
  SCOPED_TRACE(r.to_string());
  EXPECT_FALSE(r.ok);
  for (const char* b : {"batch 1", "batch 3"}) {
    EXPECT_EQ(count_lines(r, std::string("FAIL ") + b + ", cpu_forward"), 1);
    // The emulator runs checked; with no reference there is nothing to compare it with.
    EXPECT_EQ(count_lines(r, std::string("PASS ") + b + ", emulator",
                          {"no fault, race or unwritten element", "not compared: the CPU failed above"}),
              1);
    EXPECT_EQ(count_lines(r, std::string("SKIP ") + b + ", elementwise form:", {"the CPU failed above"}), 1);
    EXPECT_EQ(count_lines(r, std::string("SKIP ") + b + ", elementwise form, emulator:", {"the CPU failed above"}), 1);
    EXPECT_EQ(count_lines(r, std::string("SKIP ") + b + ", gpu") + count_lines(r, std::string("PASS ") + b + ", gpu"),
              1);
  }
  EXPECT_EQ(r.to_string().rfind("check_op: FAILED (2 failed, ", 0), 0u);
  // With a reference, the other paths are compared with it instead.
  auto o = options(seed);
  o.batch_sizes = {2};
  o.reference = [](const std::vector<kg::Tensor>& in, const std::map<std::string, kg::Tensor>&) {
    kg::Tensor y = kg::Tensor::empty(kg::DType::F32, in[0].shape());
    for (std::int64_t i = 0; i < y.numel(); ++i) y.data<float>()[i] = 2.f * in[0].data<float>()[i];
    return y;
  };
  r = kg::testing::check_op(kg::CustomData::make<ScaleOp>(Bug::Unwritten), {{kg::Dim::named("batch"), 6}},
                            {kg::DType::F32}, o);
  EXPECT_EQ(count_lines(r, "SKIP batch 2, reference", {"the other paths are compared with the reference instead"}), 1)
      << r.to_string();
  EXPECT_EQ(count_lines(r, "PASS batch 2, emulator", {"the reference"}), 1) << r.to_string();
  EXPECT_EQ(count_lines(r, "PASS batch 2, elementwise form:", {"the reference"}), 1) << r.to_string();
  EXPECT_EQ(count_lines(r, "PASS batch 2, elementwise form, emulator:", {"the reference"}), 1) << r.to_string();
}

// A cpu_forward that writes past the end of its output is caught by the canary after it.
TEST(CheckOp, ACpuForwardWritingPastItsOutputFails) {
  struct Op final : kg::CustomOp {
    std::string name() const override { return "test.past"; }
    kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
    void cpu_forward(kg::CpuContext& ctx) const override {
      float* y = static_cast<float*>(ctx.output.raw());
      for (std::int64_t i = 0; i <= ctx.output.numel(); ++i) y[i] = 1.f;  // one too many
    }
  };
  auto o = options(fresh_seed());
  o.batch_sizes = {2};
  auto r = kg::testing::check_op(kg::CustomData::make<Op>(), {{kg::Dim::named("batch"), 3}}, {kg::DType::F32}, o);
  EXPECT_EQ(count_lines(r, "FAIL batch 2, cpu_forward", {"cpu_forward wrote past the end of its output [2, 3] f32 (24 bytes): byte 0 after the end was changed"}), 1)
      << r.to_string();
}
