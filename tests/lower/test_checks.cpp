// The checks where the seed says "nothing checks it", run through the real lowering with every
// kernel compiled by NVRTC for sm_90 and every launch packed against its PTX signature.
#include <gtest/gtest.h>

#include <cstring>

#include "compile/compiler.hpp"
#include "kg/runtime_op.hpp"
#include "lower/dry_run.hpp"
#include "support/test_util.hpp"

namespace {

const char* kScaleSource = R"(
extern "C" __global__ void __launch_bounds__(128) test_scale(const float* __restrict__ x, float* __restrict__ y,
                                                           const float* __restrict__ gain, int n, float bias) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * gain[i % 4] + bias;
}
)";

// What each variant gets wrong.
enum class Fault { None, SwapArgs, MissingArg, ExtraArg, FloatForInt, WrongBlock, BadInitSize, ZeroGrid, WrongEntry, NoEntryName, ShapeLie };

class ScaleRuntime final : public kg::RuntimeOp {
 public:
  explicit ScaleRuntime(Fault f) : f_(f) {}
  int n_activation_inputs() const override { return 1; }
  std::vector<std::vector<std::int64_t>> param_shapes(const std::vector<std::vector<std::int64_t>>&,
                                                      const std::vector<std::int64_t>&) const override {
    return {{4}};
  }
  std::vector<std::string> param_names() const override { return {"gain"}; }
  std::optional<std::vector<std::byte>> param_init_data(int) const override {
    std::vector<float> g{1.f, 2.f, 3.f, 4.f};
    std::size_t n = f_ == Fault::BadInitSize ? 3 : 4;
    std::vector<std::byte> b(n * sizeof(float));
    std::memcpy(b.data(), g.data(), b.size());
    return b;
  }
  void pack_args(const std::vector<kg::DeviceTensor>& in, const std::vector<kg::DeviceTensor>& params,
                 const kg::DeviceTensor& out, const std::vector<std::int64_t>& shape, std::int64_t,
                 kg::ArgVisitor& v) const override {
    const auto n = static_cast<std::int32_t>(kg::numel_of(shape));
    if (f_ == Fault::SwapArgs) {
      v.pointer(in[0].ptr);
      v.pointer(out.ptr);
      v.i32(n);  // swapped with the gain pointer
      v.pointer(params[0].ptr);
      v.f32(0.5f);
      return;
    }
    v.pointer(in[0].ptr);
    v.pointer(out.ptr);
    v.pointer(params[0].ptr);
    if (f_ == Fault::FloatForInt)
      v.f32(static_cast<float>(n));
    else
      v.i32(n);
    if (f_ != Fault::MissingArg) v.f32(0.5f);
    if (f_ == Fault::ExtraArg) v.i32(7);
  }
  kg::Dim3 block() const override { return {f_ == Fault::WrongBlock ? 256u : 128u, 1, 1}; }
  kg::Dim3 grid(const std::vector<std::int64_t>& shape) const override {
    if (f_ == Fault::ZeroGrid) return {0, 1, 1};
    return {static_cast<unsigned>((kg::numel_of(shape) + 127) / 128), 1, 1};
  }
  std::optional<std::vector<std::int64_t>> compute_concrete_output_shape(
      const std::vector<std::vector<std::int64_t>>& in) const override {
    if (f_ != Fault::ShapeLie) return std::nullopt;
    auto s = in[0];
    s.back() *= 2;
    return s;
  }

 private:
  Fault f_;
};

class ScaleOp final : public kg::CustomOp {
 public:
  explicit ScaleOp(Fault f, bool lowerable = true) : f_(f), lowerable_(lowerable) {}
  std::string name() const override { return "test.scale"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  std::optional<kg::Lowered> lower() const override {
    if (!lowerable_) return std::nullopt;
    std::string entry = f_ == Fault::WrongEntry ? "test_scal" : f_ == Fault::NoEntryName ? "" : "test_scale";
    return kg::Lowered{"test.scale", kScaleSource, entry, std::make_shared<ScaleRuntime>(f_)};
  }

 private:
  Fault f_;
  bool lowerable_;
};

kg::lower::DryRun dry(Fault f, bool lowerable = true) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 10});
  kg::SymTensor y;
  {
    kg::NameScope s(*g, "head");
    y = x.record_custom(kg::CustomData::make<ScaleOp>(f, lowerable), {}, std::nullopt, "scale");
  }
  kg::Model m(g, {y});
  return kg::lower::dry_run(m, {{7, 10}}, 90);
}

#define REQUIRE_NVRTC() \
  if (!kg::compile::Compiler::available()) GTEST_SKIP() << "built without NVRTC"

}  // namespace

TEST(LaunchChecks, ACorrectOpPacksAndSizes) {
  REQUIRE_NVRTC();
  auto r = dry(Fault::None);
  ASSERT_EQ(r.launches.steps.size(), 1u);
  const auto& s = r.launches.steps[0];
  EXPECT_EQ(s.entry, "test_scale");
  ASSERT_EQ(s.launches.size(), 1u);
  EXPECT_EQ(s.launches[0].grid.x, 1u);  // 70 elements, 128 per block
  EXPECT_EQ(s.launches[0].args.args().size(), 5u);
  // The RuntimeOp's parameter became a model parameter named after the node, with its data.
  ASSERT_EQ(r.plan.steps[0].specs.size(), 1u);
  EXPECT_EQ(r.plan.steps[0].specs[0].name, "head.scale.gain");
  EXPECT_EQ(r.plan.steps[0].params[0].item(3), 4.0);
}

TEST(LaunchChecks, SwappedArgumentIsNamed) {
  REQUIRE_NVRTC();
  kg_test::expect_error([] { dry(Fault::SwapArgs); },
                        {"[test.scale @ head.scale]", "pack_args", "argument 2 'gain'", "an i32 (4 bytes) was visited"});
}

TEST(LaunchChecks, MissingArgumentIsNamed) {
  REQUIRE_NVRTC();
  kg_test::expect_error([] { dry(Fault::MissingArg); },
                        {"[test.scale @ head.scale]", "takes 5 arguments but 4 were visited", "missing argument 4 'bias'"});
}

TEST(LaunchChecks, ExtraArgumentIsCounted) {
  REQUIRE_NVRTC();
  kg_test::expect_error([] { dry(Fault::ExtraArg); }, {"[test.scale @ head.scale]", "takes 5 arguments but 6 were visited"});
}

TEST(LaunchChecks, FloatWhereTheKernelTakesAnInt) {
  REQUIRE_NVRTC();
  kg_test::expect_error([] { dry(Fault::FloatForInt); }, {"argument 3 'n'", "an integer", "an f32"});
}

TEST(LaunchChecks, BlockOverMaxntid) {
  REQUIRE_NVRTC();
  kg_test::expect_error([] { dry(Fault::WrongBlock); },
                        {"[test.scale @ head.scale]", "block (256, 1, 1)", "256 threads", ".maxntid (128, 1, 1)"});
}

TEST(LaunchChecks, ParamInitDataOfTheWrongSize) {
  REQUIRE_NVRTC();
  kg_test::expect_error([] { dry(Fault::BadInitSize); },
                        {"[test.scale @ head.scale]", "param_init_data for 'head.scale.gain' has 12 bytes", "[4]", "needs 16"});
}

TEST(LaunchChecks, ZeroGridDimension) {
  REQUIRE_NVRTC();
  kg_test::expect_error([] { dry(Fault::ZeroGrid); }, {"[test.scale @ head.scale]", "grid (0, 1, 1)", "zero dimension", "[7, 10]"});
}

TEST(LaunchChecks, EntryPointNotInTheModule) {
  REQUIRE_NVRTC();
  kg_test::expect_error([] { dry(Fault::WrongEntry); },
                        {"[test.scale @ head.scale]", "entry point 'test_scal'", "test_scale"});
}

TEST(LaunchChecks, EmptyEntryPointMeansTheOnlyEntry) {
  REQUIRE_NVRTC();
  auto r = dry(Fault::NoEntryName);
  EXPECT_EQ(r.launches.steps[0].entry, "test_scale");
}

TEST(LaunchChecks, MissingLowerNamesTheOpAndNode) {
  kg_test::expect_error([] { dry(Fault::None, false); },
                        {"custom op 'test.scale' is not handled — implement CustomOp::lower()", "head.scale"});
}

TEST(LaunchChecks, KernelOutputShapeDisagreeingWithInferenceIsCaughtAtLoad) {
  REQUIRE_NVRTC();
  kg_test::expect_error([] { dry(Fault::ShapeLie); },
                        {"[test.scale @ head.scale]", "infer_output_shape says [7, 10]", "writes [7, 20]"});
}
