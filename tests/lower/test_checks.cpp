// The checks where the seed says "nothing checks it", run through the real lowering: every launch
// described by the RuntimeOp is checked against the kernel's CUDA signature on every device (at
// arch 0, as the cpu does at load, without NVRTC) and, where NVRTC is available, also compiled for
// sm_90 and checked against its PTX. Parameter init data is checked when the op is recorded, and
// an infer_output_shape larger than what the kernel writes is caught in checked mode.
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
enum class Fault {
  None,
  SwapArgs,
  MissingArg,
  ExtraArg,
  FloatForInt,
  I64ForInt,
  SmallGrid,
  WrongBlock,
  HugeBlock,
  BadInitSize,
  ZeroGrid,
  WrongEntry,
  NoEntryName,
  ShapeLie
};

class ScaleRuntime final : public kg::RuntimeOp {
 public:
  explicit ScaleRuntime(Fault f) : f_(f) {}
  void pack_args(const kg::LaunchTensors& t, kg::ArgVisitor& v) const override {
    // The kernel's n: what it writes. ShapeLie's output is larger than its input; the kernel
    // writes as many elements as the input has.
    const auto n = static_cast<std::int32_t>(t.inputs[0].numel());
    if (f_ == Fault::SwapArgs) {
      v.pointer(t.inputs[0].ptr);
      v.pointer(t.output.ptr);
      v.i32(n);  // swapped with the gain pointer
      v.pointer(t.params[0].ptr);
      v.f32(0.5f);
      return;
    }
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.output.ptr);
    v.pointer(t.params[0].ptr);
    if (f_ == Fault::FloatForInt)
      v.f32(static_cast<float>(n));
    else if (f_ == Fault::I64ForInt)
      v.i64(n);
    else
      v.i32(n);
    if (f_ != Fault::MissingArg) v.f32(0.5f);
    if (f_ == Fault::ExtraArg) v.i32(7);
  }
  kg::Dim3 block() const override {
    return {f_ == Fault::WrongBlock ? 256u : f_ == Fault::HugeBlock ? 2048u : 128u, 1, 1};
  }
  kg::Dim3 grid(const std::vector<std::int64_t>& shape) const override {
    if (f_ == Fault::ZeroGrid) return {0, 1, 1};
    if (f_ == Fault::SmallGrid) return {static_cast<unsigned>(kg::numel_of(shape) / 128), 1, 1};  // rounds down
    return {static_cast<unsigned>((kg::numel_of(shape) + 127) / 128), 1, 1};
  }

 private:
  Fault f_;
};

class ScaleOp final : public kg::CustomOp {
 public:
  explicit ScaleOp(Fault f, bool lowerable = true) : f_(f), lowerable_(lowerable) {}
  std::string name() const override { return "test.scale"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    if (f_ != Fault::ShapeLie) return in.at(0);
    kg::Shape s = in.at(0);  // one column too many: the kernel never writes the extra ones
    s[s.rank() - 1] = kg::Dim(s[s.rank() - 1].size() * 2);
    return s;
  }
  // The gain, declared once for every device, with its values.
  std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>&) const override {
    std::vector<float> g{1.f, 2.f, 3.f, 4.f};
    if (f_ == Fault::BadInitSize) g.pop_back();
    return {{"gain", {4}, kg::DType::F32, kg::ParamInit::from_values(g), false}};
  }
  std::optional<kg::Lowered> lower(const kg::LowerContext&) const override {
    if (!lowerable_) return std::nullopt;
    std::string entry = f_ == Fault::WrongEntry ? "test_scal" : f_ == Fault::NoEntryName ? "" : "test_scale";
    return kg::Lowered{"test.scale", kScaleSource, entry, std::make_shared<ScaleRuntime>(f_)};
  }
  void cpu_forward(kg::CpuContext& ctx) const override {
    const float* x = ctx.inputs[0].data<float>();
    const float* g = ctx.params[0].data<float>();
    float* y = ctx.output.data<float>();
    for (std::int64_t i = 0; i < ctx.output.numel(); ++i) y[i] = x[i % ctx.inputs[0].numel()] * g[i % 4] + 0.5f;
  }

 private:
  Fault f_;
  bool lowerable_;
};

kg::Model model(Fault f, bool lowerable = true) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 10});
  kg::SymTensor y;
  {
    kg::NameScope s(*g, "head");
    y = x.record_custom(kg::CustomData::make<ScaleOp>(f, lowerable), {}, std::nullopt, "scale");
  }
  return kg::Model(g, {y});
}

kg::lower::DryRun dry(Fault f, int arch, bool lowerable = true) {
  return kg::lower::dry_run(model(f, lowerable), {{7, 10}}, arch);
}

// The targets to check at: the signature checks alone (arch 0, always), and sm_90 with the PTX
// checks too when this build has NVRTC.
std::vector<int> archs() {
  std::vector<int> a{0};
  if (kg::compile::Compiler::available()) a.push_back(90);
  return a;
}

// The error of a faulty op at every target, and on the cpu device at load.
void expect_fault(Fault f, const std::vector<std::string>& parts) {
  for (int arch : archs()) {
    SCOPED_TRACE("arch " + std::to_string(arch));
    kg_test::expect_error([&] { dry(f, arch); }, parts);
  }
  SCOPED_TRACE("cpu load");
  kg_test::expect_error([&] { model(f).load(kg::Device::cpu(), {{7, 10}}); }, parts);
}

}  // namespace

TEST(LaunchChecks, ACorrectOpPacksAndSizes) {
  for (int arch : archs()) {
    SCOPED_TRACE("arch " + std::to_string(arch));
    auto r = dry(Fault::None, arch);
    ASSERT_EQ(r.launches.steps.size(), 1u);
    const auto& s = r.launches.steps[0];
    EXPECT_EQ(s.label, "[test.scale @ head.scale]");
    ASSERT_EQ(s.launches.size(), 1u);
    EXPECT_EQ(s.launches[0].entry, "test_scale");
    EXPECT_EQ(s.launches[0].ptx_entry.empty(), arch == 0);
    EXPECT_EQ(s.module.ptx.empty(), arch == 0);
    EXPECT_EQ(s.launches[0].launch.grid.x, 1u);  // 70 elements, 128 per block
    EXPECT_EQ(s.launches[0].launch.block.x, 128u);
    const auto& args = s.launches[0].launch.args.args();
    ASSERT_EQ(args.size(), 5u);
    EXPECT_EQ(args[2].kind(), kg::KernelArg::Kind::Pointer);
    EXPECT_EQ(args[3].kind(), kg::KernelArg::Kind::I32);
    std::int32_t n = 0;
    std::memcpy(&n, args[3].data().data(), sizeof n);
    EXPECT_EQ(n, 70);
    EXPECT_EQ(args[4].kind(), kg::KernelArg::Kind::F32);
    // The tensors the launch was described for: the node's input, its parameter, its output.
    ASSERT_EQ(s.tensors.inputs.size(), 1u);
    EXPECT_EQ(s.tensors.inputs[0].shape, (std::vector<std::int64_t>{7, 10}));
    ASSERT_EQ(s.tensors.params.size(), 1u);
    EXPECT_EQ(s.tensors.params[0].shape, (std::vector<std::int64_t>{4}));
    EXPECT_NE(s.tensors.params[0].ptr, 0u);
    EXPECT_EQ(s.tensors.output.shape, (std::vector<std::int64_t>{7, 10}));
    // The op's parameter became a model parameter named after the node, with its data.
    ASSERT_EQ(r.plan.steps[0].specs.size(), 1u);
    EXPECT_EQ(r.plan.steps[0].specs[0].name, "head.scale.gain");
    EXPECT_EQ(r.plan.steps[0].params[0].item(3), 4.0);
  }
  // The same on the cpu device, where the op runs its cpu_forward: same name, shape and values.
  kg::Model m = model(Fault::None);
  ASSERT_EQ(m.parameters().size(), 1u);
  EXPECT_EQ(m.parameters()[0].name, "head.scale.gain");
  EXPECT_EQ(m.parameters()[0].shape, (std::vector<std::int64_t>{4}));
  EXPECT_FALSE(m.parameters()[0].trainable);
  const auto sd = m.load(kg::Device::cpu(), {{7, 10}}).state_dict();
  ASSERT_EQ(sd.size(), 1u);
  ASSERT_TRUE(sd.count("head.scale.gain"));
  EXPECT_EQ(sd.at("head.scale.gain").shape(), (std::vector<std::int64_t>{4}));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(sd.at("head.scale.gain").item(i), i + 1.0);
}

TEST(LaunchChecks, SwappedArgumentIsNamed) {
  expect_fault(Fault::SwapArgs, {"[test.scale @ head.scale] launch 0 of kernel 'test_scale'", "argument 2 'gain'",
                                 "is a pointer in the kernel but an i32 (4 bytes) was packed"});
}

TEST(LaunchChecks, MissingArgumentIsNamed) {
  expect_fault(Fault::MissingArg, {"[test.scale @ head.scale] launch 0 of kernel 'test_scale'",
                                   "the kernel takes 5 arguments but 4 were packed", "missing argument 4 'bias' (float)"});
}

TEST(LaunchChecks, ExtraArgumentIsCounted) {
  expect_fault(Fault::ExtraArg,
               {"[test.scale @ head.scale] launch 0 of kernel 'test_scale'", "the kernel takes 5 arguments but 6 were packed"});
}

TEST(LaunchChecks, FloatWhereTheKernelTakesAnInt) {
  expect_fault(Fault::FloatForInt, {"[test.scale @ head.scale]", "argument 3 'n' (int)",
                                    "is a 4-byte signed integer in the kernel but an f32 (4 bytes) was packed"});
}

TEST(LaunchChecks, ArgumentOfTheWrongWidthIsNamed) {
  expect_fault(Fault::I64ForInt, {"[test.scale @ head.scale] launch 0 of kernel 'test_scale'", "argument 3 'n' (int)",
                                  "is a 4-byte signed integer in the kernel but an i64 (8 bytes) was packed"});
}

TEST(LaunchChecks, BlockOverLaunchBounds) {
  expect_fault(Fault::WrongBlock, {"[test.scale @ head.scale] launch 0 of kernel 'test_scale'", "block (256, 1, 1)",
                                   "256 threads", "over the kernel's __launch_bounds__(128)"});
}

TEST(LaunchChecks, BlockOverTheThreadLimit) {
  expect_fault(Fault::HugeBlock, {"[test.scale @ head.scale] launch 0 of kernel 'test_scale'", "block (2048, 1, 1)",
                                  "has 2048 threads; a block has 1 to 1024"});
}

TEST(LaunchChecks, ParamInitDataOfTheWrongSizeFailsAtRecord) {
  // Before any lowering: recording the op is the error, naming the op, the node and the parameter.
  kg_test::expect_error([] { model(Fault::BadInitSize); },
                        {"[test.scale @ head.scale] parameter 'head.scale.gain'", "init data is 12 bytes", "[4]",
                         "f32", "needs 16"});
}

TEST(LaunchChecks, ZeroGridDimension) {
  expect_fault(Fault::ZeroGrid, {"[test.scale @ head.scale]", "grid (0, 1, 1)", "has a zero dimension", "nothing would run"});
}

TEST(LaunchChecks, EntryPointNotInTheModule) {
  expect_fault(Fault::WrongEntry, {"[test.scale @ head.scale]",
                                   "entry point 'test_scal' is not a __global__ function of the kernel source (it has: "
                                   "test_scale)"});
}

TEST(LaunchChecks, EmptyEntryPointMeansTheOnlyEntry) {
  for (int arch : archs()) {
    SCOPED_TRACE("arch " + std::to_string(arch));
    auto r = dry(Fault::NoEntryName, arch);
    ASSERT_EQ(r.launches.steps[0].launches.size(), 1u);
    EXPECT_EQ(r.launches.steps[0].launches[0].entry, "test_scale");
  }
}

TEST(LaunchChecks, MissingLowerNamesTheOpAndNode) {
  kg_test::expect_error([] { dry(Fault::None, 0, false); },
                        {"[test.scale @ head.scale] custom op 'test.scale' is not handled — implement CustomOp::lower()"});
  // The cpu device runs such an op's cpu_forward, except in checked mode, where every op must have
  // its kernels.
  kg::LoadedModel m = model(Fault::None, false).load(kg::Device::cpu(), {{7, 10}});
  EXPECT_EQ(m.forward({kg::Tensor::zeros(kg::DType::F32, {7, 10})})[0].item(0), 0.5);
  kg::LoadOptions checked;
  checked.checked = true;
  kg_test::expect_error([&] { model(Fault::None, false).load(kg::Device::cpu(), {{7, 10}}, checked); },
                        {"[test.scale @ head.scale] custom op 'test.scale' is not handled — implement CustomOp::lower()"});
}

// infer_output_shape twice as wide as what the kernel writes: nothing at load can tell (the
// launches are well-formed), but checked mode poisons the output and finds the first element the
// kernel left unwritten, naming the op, the node, the kernel and the index.
TEST(LaunchChecks, KernelOutputSmallerThanInferredIsCaughtInCheckedMode) {
  kg::Model m = model(Fault::ShapeLie);
  kg::LoadOptions o;
  o.checked = true;
  kg::LoadedModel lm = m.load(kg::Device::cpu(), {{7, 10}}, o);
  EXPECT_EQ(lm.output_shapes()[0], (std::vector<std::int64_t>{7, 20}));
  kg_test::expect_error([&] { lm.forward({kg::Tensor::zeros(kg::DType::F32, {7, 10})}); },
                        {"[test.scale @ head.scale] kernel 'test.scale': output 'head.scale' [7, 20]",
                         "element 70 (index [3, 10]) was not written", "140 elements",
                         "is infer_output_shape larger than what the kernel writes?"});
  // Unchecked, the cpu runs cpu_forward (which fills the whole output): no error.
  EXPECT_EQ(m.load(kg::Device::cpu(), {{7, 10}}).forward({kg::Tensor::zeros(kg::DType::F32, {7, 10})})[0].numel(), 140);
}

// ---- Pointer element types against the tensors' dtypes ----

namespace {

// An op whose kernel takes float pointers whatever the dtype it is recorded with, and which claims
// to compute in bf16: in a bf16 load its tensors are bf16, half the bytes the kernel reads and
// writes. It has no cpu_forward, so a plain cpu run emulates the kernel.
class F32OnlyOp final : public kg::CustomOp {
 public:
  explicit F32OnlyOp(bool cpu = false) : cpu_(cpu) {}
  std::string name() const override { return "test.f32only"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>&) const override {
    return {{"gain", {4}, kg::DType::F32, kg::ParamInit::constant(1.0), false}};
  }
  std::optional<kg::Lowered> lower(const kg::LowerContext&) const override {
    return kg::Lowered{"test.f32only", kScaleSource, "test_scale", std::make_shared<ScaleRuntime>(Fault::None)};
  }
  void cpu_forward(kg::CpuContext& ctx) const override {
    if (!cpu_) kg::CustomOp::cpu_forward(ctx);
    ctx.output.fill(0.0);
  }
  bool computes_in(kg::DType) const override { return true; }

 private:
  bool cpu_;
};

kg::Model f32only_model(kg::DType input, bool cpu = false) {
  auto [x, g] = kg::SymTensor::input(input, {kg::Dim::named("batch"), 10});
  kg::SymTensor y = x.record_custom(kg::CustomData::make<F32OnlyOp>(cpu), {}, std::nullopt, "f32only");
  return kg::Model(g, {y});
}

}  // namespace

TEST(LaunchChecks, PointerElementTypeAgainstTheTensorDtype) {
  using kg::lower::pointee_type;
  EXPECT_EQ(pointee_type("const float* __restrict__").dtype, kg::DType::F32);
  EXPECT_EQ(pointee_type("double *").dtype, kg::DType::F64);
  EXPECT_EQ(pointee_type("const __nv_bfloat16*").dtype, kg::DType::BF16);
  EXPECT_EQ(pointee_type("kg_f16*").dtype, kg::DType::F16);
  EXPECT_EQ(pointee_type("const float4*").dtype, kg::DType::F32);
  EXPECT_EQ(pointee_type("long long*").dtype, kg::DType::I64);
  EXPECT_EQ(pointee_type("const int64_t*").dtype, kg::DType::I64);
  EXPECT_EQ(pointee_type("int*").dtype, kg::DType::I32);
  EXPECT_EQ(pointee_type("unsigned*").unsigned_bytes, 4u);  // a bit view: any 4-byte dtype
  EXPECT_FALSE(pointee_type("unsigned char*").dtype);       // bytes: any dtype
  EXPECT_FALSE(pointee_type("void*").dtype);
  EXPECT_FALSE(pointee_type("const T*").dtype);  // a template parameter says nothing
  EXPECT_FALSE(pointee_type("float").dtype);     // not a pointer
  // An alias of the source is followed, as rmsnorm's `typedef double real;`.
  EXPECT_EQ(pointee_type("const real*", "typedef double real;\n__global__ void k(const real* x) {}").dtype,
            kg::DType::F64);
  EXPECT_EQ(pointee_type("acc_t*", "using acc_t = float;").dtype, kg::DType::F32);
}

// A float* kernel given f64 tensors: the widths of every argument match the signature (a pointer
// is a pointer), so only the element types tell. Caught at load, on every target and on the cpu.
TEST(LaunchChecks, FloatKernelGivenF64TensorsIsRefusedAtLoad) {
  const std::vector<std::string> parts = {"[test.f32only @ f32only] launch 0 of kernel 'test_scale'",
                                          "argument 0 'x' (const float*) points to f32 elements",
                                          "input 0 packed there is f64 [7, 10]"};
  for (int arch : archs()) {
    SCOPED_TRACE("arch " + std::to_string(arch));
    kg_test::expect_error([&] { kg::lower::dry_run(f32only_model(kg::DType::F64), {{7, 10}}, arch); }, parts);
  }
  kg_test::expect_error([&] { f32only_model(kg::DType::F64, true).load(kg::Device::cpu(), {{7, 10}}); }, parts);
}

// The f32-only kernel in a bf16 load: before the element types were checked, a plain cpu run
// emulated it on raw host memory and the writes of 4-byte floats into 2-byte elements corrupted
// the heap (free(): invalid next size). Now the load refuses it.
TEST(LaunchChecks, F32OnlyKernelInABf16LoadIsAnErrorNotHeapCorruption) {
  kg::LoadOptions o;
  o.precision = kg::DType::BF16;
  kg_test::expect_error(
      [&] {
        kg::LoadedModel m = f32only_model(kg::DType::F32).load(kg::Device::cpu(), {{7, 10}}, o);
        m.forward({kg::Tensor::zeros(kg::DType::F32, {7, 10})});
      },
      {"[test.f32only @ f32only]", "kernel 'test_scale'", "(const float*) points to f32 elements",
       "is bf16"});
}

// A grid that rounds down (300 elements, 2 blocks of 128): well-formed, so nothing at load can
// tell, but checked mode finds the first output element no thread wrote.
TEST(LaunchChecks, GridTooSmallIsCaughtInCheckedMode) {
  kg::LoadOptions o;
  o.checked = true;
  kg::LoadedModel lm = model(Fault::SmallGrid).load(kg::Device::cpu(), {{30, 10}}, o);
  kg_test::expect_error([&] { lm.forward({kg::Tensor::zeros(kg::DType::F32, {30, 10})}); },
                        {"[test.scale @ head.scale] kernel 'test.scale': output 'head.scale' [30, 10]",
                         "element 256 (index [25, 6]) was not written"});
}
