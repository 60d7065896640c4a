// A custom op without a CPU implementation runs on the cpu device through the CUDA emulator: the
// seed's detect_decode with its cpu_forward taken away matches the real op and a naive reference,
// with the parameters it declares once; a kernel with several launches, scratch and op-declared
// parameters; and the errors when there is nothing to run or the RuntimeOp is wrong.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "../../examples/detect_decode/detect_decode.hpp"
#include "kg/runtime_op.hpp"
#include "support/test_util.hpp"

using kg_test::expect_error;
using kg_test::fresh_seed;

namespace {

// detect_decode without cpu_forward: everything else is the real op's.
class DecodeWithoutCpu final : public kg::CustomOp {
 public:
  explicit DecodeWithoutCpu(std::shared_ptr<const yolo::DetectDecodeOp> op) : op_(std::move(op)) {}
  std::string name() const override { return "test.decode_gpu_only"; }
  std::string attributes() const override { return op_->attributes(); }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    return op_->infer_output_shape(in);
  }
  kg::DType infer_output_dtype(const std::vector<kg::DType>& in) const override {
    return op_->infer_output_dtype(in);
  }
  std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>& in) const override {
    return op_->parameters(in);
  }
  std::optional<kg::Lowered> lower(const kg::LowerContext& ctx) const override { return op_->lower(ctx); }

 private:
  std::shared_ptr<const yolo::DetectDecodeOp> op_;
};

// The decode in double precision, straight from its definition.
kg::Tensor decode_reference(const kg::Tensor& in, int h, int w, double stride) {
  const std::int64_t B = in.dim(0), A = in.dim(2);
  kg::Tensor out = kg::Tensor::empty(kg::DType::F64, in.shape());
  double* o = out.data<double>();
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t a = 0; a < A; ++a) {
      const double ax = static_cast<double>(a % w) + 0.5, ay = static_cast<double>(a / w) + 0.5;
      auto d = [&](int k) { return in.item((b * 4 + k) * A + a); };
      const double x1 = ax - d(0), y1 = ay - d(1), x2 = ax + d(2), y2 = ay + d(3);
      o[(b * 4 + 0) * A + a] = 0.5 * (x1 + x2) * stride;
      o[(b * 4 + 1) * A + a] = 0.5 * (y1 + y2) * stride;
      o[(b * 4 + 2) * A + a] = (x2 - x1) * stride;
      o[(b * 4 + 3) * A + a] = (y2 - y1) * stride;
    }
  (void)h;
  return out;
}

kg::LoadOptions poisoned() {
  kg::LoadOptions o;
  o.poison_buffers = true;
  return o;
}

TEST(CpuFallback, DecodeWithoutCpuForwardRunsThroughTheEmulator) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int h = 6, w = 7;  // 42 anchors in blocks of 32: two tiles per image, the second partial
  const float stride = 8.f;
  auto real = yolo::DetectDecodeOp::for_level(h, w, stride, 32);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 4, h * w}, "x");
  kg::SymTensor emulated = [&] {
    kg::NameScope s(*g, "head");
    return x.record_custom(kg::CustomData::make<DecodeWithoutCpu>(real), {}, std::nullopt, "decode");
  }();
  kg::SymTensor native = x.record_custom(kg::CustomData(real), {}, std::nullopt, "native");
  // The emulated op's output feeds a built-in op that runs natively.
  kg::SymTensor after = kg::mul(emulated, 0.5, "half");
  kg::Model model(g, {{"emulated", emulated}, {"native", native}, {"half", after}});
  for (std::int64_t batch : {1, 5}) {
    SCOPED_TRACE("batch " + std::to_string(batch));
    kg::LoadedModel m = model.load(kg::Device::cpu(), {{batch, 4, h * w}}, poisoned());
    // The anchors are declared once, in CustomOp::parameters: the emulated node and the native
    // one own the same buffers under their own names, with the same shapes and values, on the cpu
    // as the model reports them.
    const auto sd = m.state_dict();
    ASSERT_EQ(sd.size(), 6u);
    const std::vector<kg::ParamInfo> declared = model.parameters(), loaded = m.parameters();
    ASSERT_EQ(declared.size(), 6u);
    ASSERT_EQ(loaded.size(), declared.size());
    for (std::size_t i = 0; i < declared.size(); ++i) {
      const kg::ParamInfo& p = declared[i];
      EXPECT_EQ(loaded[i].name, p.name);
      EXPECT_EQ(loaded[i].shape, p.shape);
      EXPECT_FALSE(p.trainable) << p.name;
      ASSERT_TRUE(sd.count(p.name)) << p.name;
      EXPECT_EQ(sd.at(p.name).shape(), (std::vector<std::int64_t>{h * w})) << p.name;
    }
    for (const char* name : {"anchor_x", "anchor_y", "strides"}) {
      const std::string a = std::string("head.decode.") + name, b = std::string("native.") + name;
      ASSERT_TRUE(sd.count(a) && sd.count(b)) << name;
      for (std::int64_t i = 0; i < h * w; ++i) ASSERT_EQ(sd.at(a).item(i), sd.at(b).item(i)) << name << " " << i;
    }
    EXPECT_EQ(sd.at("head.decode.anchor_x").item(8), 1.5);  // anchor 8 is cell (1, 1) of a 7-wide map
    EXPECT_EQ(sd.at("head.decode.anchor_y").item(8), 1.5);
    EXPECT_EQ(sd.at("head.decode.strides").item(8), stride);
    for (int run = 0; run < 2; ++run) {    // the second run takes the cached kernel
      kg::Tensor in = kg_test::random_tensor(rng, kg::DType::F32, {batch, 4, h * w}, -2.0, 2.0);
      auto out = m.forward({in});
      ASSERT_EQ(out.size(), 3u);
      EXPECT_TRUE(kg_test::all_written(out[0])) << "the emulated kernel left elements unwritten";
      kg::Tensor want = decode_reference(in, h, w, stride);
      EXPECT_TRUE(kg_test::all_close(out[0], want, 1e-6, 1e-5));
      EXPECT_TRUE(kg_test::all_close(out[1], want, 1e-6, 1e-5));
      // Emulated and cpu_forward: the same float expression, so the same bits up to rounding.
      EXPECT_TRUE(kg_test::all_close(out[0], out[1], 1e-6, 1e-6));
      for (std::int64_t i = 0; i < want.numel(); ++i) want.data<double>()[i] *= 0.5;
      EXPECT_TRUE(kg_test::all_close(out[2], want, 1e-6, 1e-5));
    }
  }
}

TEST(CpuFallback, ProfileNamesTheEmulatedNode) {
  auto real = yolo::DetectDecodeOp::for_level(2, 3, 4.f, 32);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 4, 6}, "x");
  kg::SymTensor y = x.record_custom(kg::CustomData::make<DecodeWithoutCpu>(real), {}, std::nullopt, "decode");
  kg::LoadOptions o = poisoned();
  o.profile = true;
  kg::LoadedModel m = kg::Model(g, {y}).load(kg::Device::cpu(), {{2, 4, 6}}, o);
  m.forward({kg::Tensor::zeros(kg::DType::F32, {2, 4, 6})});
  ASSERT_EQ(m.profile().size(), 1u);
  EXPECT_EQ(m.profile()[0].node, "decode");
  EXPECT_EQ(m.profile()[0].op, "test.decode_gpu_only");
}

// y[r, c] = scale x[r, c] + bias[c] in two launches of one kernel: phase 0 writes the scaled
// values to scratch, phase 1 adds the bias into the output. The bias is the op's own parameter.
const char* kTwoPhaseSource = R"(
extern "C" __global__ void __launch_bounds__(64)
    two_phase(int phase, const float* x, float* scratch, const float* bias, float* y, long long rows,
              int cols, float scale) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  if (phase == 0) {
    scratch[i] = scale * x[i];
    return;
  }
  y[i] = scratch[i] + bias[i % cols];
}
)";

enum class PadBug { None, BadInitSize, ArgCount };

class TwoPhaseRuntime final : public kg::RuntimeOp {
 public:
  explicit TwoPhaseRuntime(PadBug bug) : bug_(bug) {}
  std::vector<kg::Launch> launches(const kg::LaunchTensors& t) const override {
    const std::int64_t cols = t.output.shape.back(), rows = t.output.numel() / cols;
    const kg::Dim3 grid{static_cast<unsigned>((t.output.numel() + 63) / 64), 1, 1};
    std::vector<kg::Launch> v;
    for (std::int32_t phase : {0, 1}) {
      kg::Launch l{"", grid, {64, 1, 1}, 0,
                   {phase, t.inputs[0], kg::ptr(t.scratch), t.params[0], t.output, rows,
                    static_cast<std::int32_t>(cols)}};
      if (bug_ != PadBug::ArgCount || phase == 0) l.args.add(2.0f);
      v.push_back(std::move(l));
    }
    return v;
  }
  std::size_t scratch_bytes(const kg::LaunchTensors& t) const override {
    return static_cast<std::size_t>(t.output.numel()) * sizeof(float);
  }

 private:
  PadBug bug_;
};

class PadOp final : public kg::CustomOp {
 public:
  explicit PadOp(PadBug bug = PadBug::None) : bug_(bug) {}
  std::string name() const override { return "test.two_phase"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  // The bias follows the input's last dim (static).
  std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>& in) const override {
    const std::int64_t cols = in.at(0)[1].size();
    if (bug_ == PadBug::BadInitSize)
      return {{"bias", {cols}, kg::DType::F32,
               kg::ParamInit::from_values(std::vector<float>(static_cast<std::size_t>(cols + 1), 0.f)), true}};
    return {{"bias", {cols}, kg::DType::F32, kg::ParamInit::uniform(-1, 1), true}};
  }
  std::optional<kg::Lowered> lower(const kg::LowerContext&) const override {
    return kg::Lowered{"test.two_phase", kTwoPhaseSource, "two_phase", std::make_shared<TwoPhaseRuntime>(bug_)};
  }

 private:
  PadBug bug_;
};

kg::Model pad_model(std::int64_t cols, PadBug bug) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), cols}, "x");
  kg::NameScope s(*g, "blk");
  kg::SymTensor y = x.record_custom(kg::CustomData::make<PadOp>(bug), {}, std::nullopt, "pad");
  return kg::Model(g, {y});
}

TEST(CpuFallback, SeveralLaunchesScratchAndOpParameters) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::int64_t cols = 13;
  kg::Model model = pad_model(cols, PadBug::None);
  ASSERT_EQ(model.parameters().size(), 1u);
  EXPECT_EQ(model.parameters()[0].name, "blk.pad.bias");
  EXPECT_EQ(model.parameters()[0].shape, (std::vector<std::int64_t>{cols}));
  for (std::int64_t rows : {1, 9}) {
    kg::LoadOptions o = poisoned();
    o.checked = rows == 9;  // checked mode: guarded buffers, both thread orders, the output verified
    kg::LoadedModel m = model.load(kg::Device::cpu(), {{rows, cols}}, o);
    EXPECT_EQ(m.parameter("blk.pad.bias").shape(), (std::vector<std::int64_t>{cols}));
    kg::Tensor bias = kg_test::random_tensor(rng, kg::DType::F32, {cols});
    m.load_state_dict({{"blk.pad.bias", bias}});
    for (int run = 0; run < 2; ++run) {
      kg::Tensor in = kg_test::random_tensor(rng, kg::DType::F32, {rows, cols});
      kg::Tensor out = m.forward({in})[0];
      ASSERT_EQ(out.shape(), (std::vector<std::int64_t>{rows, cols}));
      kg::Tensor want = kg::Tensor::empty(kg::DType::F64, {rows, cols});
      for (std::int64_t i = 0; i < want.numel(); ++i)
        want.data<double>()[i] = 2.0 * in.item(i) + bias.item(i % cols);
      EXPECT_TRUE(kg_test::all_close(out, want, 1e-6, 1e-6));
    }
  }
}

TEST(CpuFallback, ErrorsNameTheOpAndTheNode) {
  const kg::Tensor in = kg::Tensor::zeros(kg::DType::F32, {3, 5});
  // Init data of the wrong size: at record time, naming the parameter.
  expect_error([&] { pad_model(5, PadBug::BadInitSize); },
               {"[test.two_phase @ blk.pad] parameter 'blk.pad.bias'", "init data is 24 bytes", "[5]", "needs 20"});
  // Launch 1 one argument short: at load (the launches are checked there on the cpu too).
  expect_error([&] { pad_model(5, PadBug::ArgCount).load(kg::Device::cpu(), {{3, 5}}); },
               {"[test.two_phase @ blk.pad]", "launch 1 of kernel 'two_phase'",
                "the kernel takes 8 arguments but 7 were packed", "missing argument 7 'scale' (float)"});
  // Neither a CPU implementation nor a lowering: nothing can run it.
  class Nothing final : public kg::CustomOp {
   public:
    std::string name() const override { return "test.nothing"; }
    kg::Shape infer_output_shape(const std::vector<kg::Shape>& s) const override { return s.at(0); }
  };
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 5}, "x");
  kg::NameScope s(*g, "blk");
  kg::SymTensor y = x.record_custom(kg::CustomData::make<Nothing>(), {}, std::nullopt, "b");
  expect_error(
      [&] {
        kg::Model(g, {y}).load(kg::Device::cpu(), {{3, 5}}).forward({in});
      },
      {"[test.nothing @ blk.b] has no CPU implementation", "no lowering",
       "CustomOp::lower() returns nothing"});
}

}  // namespace
