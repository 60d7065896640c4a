// A custom op without a CPU implementation runs on the cpu device through the CUDA emulator: the
// seed's detect_decode with its cpu_forward taken away matches the real op and a naive reference;
// a kernel with several launches, scratch, a padded output row stride and op-declared
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
  std::optional<kg::Lowered> lower() const override { return op_->lower(); }

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
    EXPECT_EQ(m.parameters().size(), 0u);  // the anchors are the RuntimeOp's, created by the fallback
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

// y[r, c] = 2 x[r, c] + bias[c] in two launches of one kernel: phase 0 writes the doubled
// values to scratch, phase 1 adds the bias into an output whose rows are padded to C + 3
// elements. The bias is the op's own parameter.
const char* kPadSource = R"(
extern "C" __global__ void __launch_bounds__(64)
    pad_double(int phase, const float* x, float* scratch, const float* bias, float* y, long long rows,
               int cols, long long stride) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  if (phase == 0) {
    scratch[i] = 2.f * x[i];
    return;
  }
  const long long r = i / cols;
  const int c = (int)(i % cols);
  y[r * stride + c] = scratch[i] + bias[c];
}
)";

enum class PadBug { None, ParamShape, ArgCount };

class PadRuntime final : public kg::RuntimeOp {
 public:
  explicit PadRuntime(PadBug bug) : bug_(bug) {}
  int n_activation_inputs() const override { return 1; }
  std::vector<std::vector<std::int64_t>> param_shapes(const std::vector<std::vector<std::int64_t>>&,
                                                      const std::vector<std::int64_t>& out) const override {
    return {{out.back() + (bug_ == PadBug::ParamShape ? 1 : 0)}};
  }
  void pack_args(const std::vector<kg::DeviceTensor>&, const std::vector<kg::DeviceTensor>&,
                 const kg::DeviceTensor&, const std::vector<std::int64_t>&, std::int64_t,
                 kg::ArgVisitor&) const override {}
  int n_launches(const std::vector<std::int64_t>&) const override { return 2; }
  void pack_args_for_launch(int launch, const std::vector<kg::DeviceTensor>& in,
                            const std::vector<kg::DeviceTensor>& params, const kg::DeviceTensor& out,
                            const std::vector<std::int64_t>& shape, std::int64_t row_stride,
                            kg::DevicePtr scratch, kg::ArgVisitor& v) const override {
    v.i32(launch);
    v.pointer(in[0].ptr);
    v.pointer(scratch);
    v.pointer(params[0].ptr);
    v.pointer(out.ptr);
    v.i64(kg::numel_of(shape) / shape.back());
    v.i32(static_cast<std::int32_t>(shape.back()));
    if (bug_ != PadBug::ArgCount || launch == 0) v.i64(row_stride);
  }
  kg::Dim3 block() const override { return {64, 1, 1}; }
  kg::Dim3 grid(const std::vector<std::int64_t>& shape) const override {
    return {static_cast<unsigned>((kg::numel_of(shape) + 63) / 64), 1, 1};
  }
  std::size_t scratch_bytes(const std::vector<std::vector<std::int64_t>>&,
                            const std::vector<std::int64_t>& out) const override {
    return static_cast<std::size_t>(kg::numel_of(out)) * sizeof(float);
  }
  std::int64_t forward_output_row_stride(const std::vector<std::int64_t>& out) const override {
    return out.back() + 3;
  }

 private:
  PadBug bug_;
};

class PadOp final : public kg::CustomOp {
 public:
  explicit PadOp(std::int64_t cols, PadBug bug = PadBug::None) : cols_(cols), bug_(bug) {}
  std::string name() const override { return "test.pad_double"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  std::vector<kg::ParamSpec> parameters() const override {
    return {{"bias", {cols_}, kg::DType::F32, kg::ParamInit::uniform(-1, 1), true}};
  }
  std::optional<kg::Lowered> lower() const override {
    return kg::Lowered{"test.pad_double", kPadSource, "pad_double", std::make_shared<PadRuntime>(bug_)};
  }

 private:
  std::int64_t cols_;
  PadBug bug_;
};

kg::Model pad_model(std::int64_t cols, PadBug bug) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), cols}, "x");
  kg::NameScope s(*g, "blk");
  kg::SymTensor y = x.record_custom(kg::CustomData::make<PadOp>(cols, bug), {}, std::nullopt, "pad");
  return kg::Model(g, {y});
}

TEST(CpuFallback, SeveralLaunchesScratchPaddedRowsAndOpParameters) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::int64_t cols = 13;
  kg::Model model = pad_model(cols, PadBug::None);
  for (std::int64_t rows : {1, 9}) {
    kg::LoadedModel m = model.load(kg::Device::cpu(), {{rows, cols}}, poisoned());
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
  expect_error(
      [&] {
        pad_model(5, PadBug::ParamShape).load(kg::Device::cpu(), {{3, 5}}).forward({in});
      },
      {"[test.pad_double @ blk.pad]", "RuntimeOp::param_shapes gives [[6]] but the op declares [[5]]"});
  expect_error(
      [&] {
        pad_model(5, PadBug::ArgCount).load(kg::Device::cpu(), {{3, 5}}).forward({in});
      },
      {"[test.pad_double @ blk.pad]", "pack_args", "takes 8 arguments but 7 were visited", "'stride'"});
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
