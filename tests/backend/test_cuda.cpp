// The CUDA backend: the by-hand path (include/kg/cuda.hpp) compiled and checked everywhere,
// and, on a machine with a GPU, kernels launched by hand and models run on the device against
// the CPU (eager, CUDA-graph replay, poisoned buffers, weights uploaded again).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "compile/compiler.hpp"
#include "compile/ptx.hpp"
#include "kg/cuda.hpp"
#include "kg/models.hpp"
#include "support/test_util.hpp"

using kg_test::expect_error;
using kg_test::fresh_seed;

namespace {

// y[i] = a * x[i] + y[i] over n elements, grid-stride.
const char* kSaxpy = R"(
extern "C" __global__ void __launch_bounds__(256)
kg_test_saxpy(const float* __restrict__ x, float* __restrict__ y, float a, long long n) {
  const long long step = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += step)
    y[i] = a * x[i] + y[i];
}
)";

// out[i] = x[i] * scale + shift, out of place (every element written once).
const char* kAffine = R"(
extern "C" __global__ void __launch_bounds__(128)
kg_test_affine(const double* __restrict__ x, double* __restrict__ out, double scale, double shift, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i] * scale + shift;
}
)";

bool have_nvrtc() { return kg::compile::Compiler::available(); }

// max |got - want| / max |want|: the relative error of the whole tensor (inf-norm), which does
// not blow up on elements that happen to be near zero.
double normwise_rel_err(const kg::Tensor& got, const kg::Tensor& want) {
  double diff = 0, scale = 0;
  for (std::int64_t i = 0; i < want.numel(); ++i) {
    const double g = got.item(i), w = want.item(i);
    diff = std::max(diff, std::isnan(g) ? INFINITY : std::abs(g - w));
    scale = std::max(scale, std::abs(w));
  }
  return diff / std::max(scale, 1e-30);
}

// Records the largest value seen in this test as the XML property "max_rel_err".
void record_rel_err(double e) {
  static std::string test;
  static double worst = 0;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = std::string(info->test_suite_name()) + "." + info->name();
  if (name != test) test = name, worst = 0;
  worst = std::max(worst, e);
  std::ostringstream os;
  os.precision(3);
  os << std::scientific << worst;
  ::testing::Test::RecordProperty("max_rel_err", os.str());
}

// LeNet-5 loaded on `device` for `batch` with `weights`.
kg::LoadedModel load_lenet(kg::Device device, std::int64_t batch,
                           const std::map<std::string, kg::Tensor>& weights, kg::LoadOptions options = {}) {
  kg::Model model = kg::models::build("lenet5");
  kg::LoadedModel m = model.load(device, {kg::models::input_shape("lenet5", batch)}, options);
  m.load_state_dict(weights);
  return m;
}

std::map<std::string, kg::Tensor> random_lenet_weights(std::mt19937_64& rng) {
  std::map<std::string, kg::Tensor> w;
  for (const auto& p : kg::models::build("lenet5").parameters())
    w.emplace(p.name, kg_test::random_tensor(rng, p.dtype, p.shape, -0.3, 0.3));
  return w;
}

kg::Tensor lenet_input(std::mt19937_64& rng, std::int64_t batch) {
  return kg_test::random_tensor(rng, kg::DType::F32, kg::models::input_shape("lenet5", batch));
}

// A pack of kSaxpy's arguments with one thing wrong.
enum class Bad { None, MissingArg, ExtraArg, FloatForInt, IntForFloat, I64ForPointer };
std::function<void(kg::ArgVisitor&)> saxpy_args(kg::DevicePtr x, kg::DevicePtr y, float a, long long n,
                                                Bad bad = Bad::None) {
  return [=](kg::ArgVisitor& v) {
    if (bad == Bad::I64ForPointer)
      v.i64(static_cast<std::int64_t>(x));
    else
      v.pointer(x);
    v.pointer(y);
    if (bad == Bad::IntForFloat)
      v.i32(2);
    else
      v.f32(a);
    if (bad == Bad::MissingArg) return;
    if (bad == Bad::FloatForInt)
      v.f64(static_cast<double>(n));
    else
      v.i64(n);
    if (bad == Bad::ExtraArg) v.i32(0);
  };
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Everywhere: compiling and checking by hand needs NVRTC only.

TEST(CudaByHand, CompilePtxNeedsNoGpu) {
  if (!have_nvrtc()) GTEST_SKIP() << "built without NVRTC";
  for (int arch : {80, 90}) {
    const std::string ptx = kg::cuda::compile_ptx("test.saxpy", kSaxpy, arch);
    EXPECT_EQ(kg::compile::ptx_target(ptx), "sm_" + std::to_string(arch));
    const auto entries = kg::compile::parse_ptx_entries(ptx);
    ASSERT_EQ(entries.size(), 1u);
    EXPECT_EQ(entries[0].name, "kg_test_saxpy");
    EXPECT_EQ(entries[0].params.size(), 4u);
  }
  const auto archs = kg::cuda::compile_archs();
  EXPECT_NE(std::find(archs.begin(), archs.end(), 90), archs.end()) << "NVRTC cannot compile for sm_90";
  expect_error([] { kg::cuda::compile_ptx("test.saxpy", kSaxpy, 0); }, {"[test.saxpy]", "arch", "got 0"});
  expect_error(
      [] { kg::cuda::compile_ptx("user.broken", "extern \"C\" __global__ void k() { nope = 1; }", 90); },
      {"[user.broken]", "NVRTC failed", "user.broken.cu", "nope", "sm_90"});
}

TEST(CudaByHand, CompileForArchRunsEveryLaunchCheckWithoutAGpu) {
  if (!have_nvrtc()) GTEST_SKIP() << "built without NVRTC";
  const auto k = kg::cuda::Kernel::compile_for_arch("test.saxpy", kSaxpy, "kg_test_saxpy", 90);
  EXPECT_EQ(k.name(), "test.saxpy");
  EXPECT_EQ(k.entry(), "kg_test_saxpy");
  EXPECT_EQ(k.arch(), 90);
  EXPECT_EQ(kg::compile::ptx_target(k.ptx()), "sm_90");
  EXPECT_EQ(k.param_names(), (std::vector<std::string>{"x", "y", "a", "n"}));

  const kg::DevicePtr x = 0x7f0000000000ull, y = x + 4096;
  k.check({4, 1, 1}, {256, 1, 1}, saxpy_args(x, y, 2.f, 1000));  // a good launch passes
  k.check({4, 1, 1}, {64, 2, 1}, saxpy_args(x, y, 2.f, 1000));   // 128 threads, under the bound

  expect_error(
      [&] {
        k.check({4, 1, 1}, {512, 1, 1}, saxpy_args(x, y, 2.f, 1000));
      },
      {"[test.saxpy]", "block", "(512, 1, 1)", "512 threads", ".maxntid", "256"});
  expect_error(
      [&] {
        k.check({4, 1, 1}, {2048, 1, 1}, saxpy_args(x, y, 2.f, 1000));
      },
      {"[test.saxpy]", "2048 threads", "1024"});
  expect_error(
      [&] {
        k.check({4, 0, 1}, {256, 1, 1}, saxpy_args(x, y, 2.f, 1000));
      },
      {"[test.saxpy]", "grid (4, 0, 1)", "zero dimension"});
  expect_error(
      [&] {
        k.check({4, 70000, 1}, {256, 1, 1}, saxpy_args(x, y, 2.f, 1000));
      },
      {"[test.saxpy]", "grid (4, 70000, 1)", "65535"});
  // An i64 has a pointer's width, so only the C++ signature tells them apart.
  expect_error(
      [&] {
        k.check({4, 1, 1}, {256, 1, 1}, saxpy_args(x, y, 2.f, 1000, Bad::I64ForPointer));
      },
      {"[test.saxpy]", "kernel 'kg_test_saxpy'", "argument 0 'x' (const float*) is a pointer", "an i64 (8 bytes)"});
  expect_error(
      [&] {
        k.check({4, 1, 1}, {256, 1, 1}, saxpy_args(x, y, 2.f, 1000, Bad::MissingArg));
      },
      {"[test.saxpy]", "takes 4 arguments but 3 were visited", "missing argument 3 'n'"});
  expect_error(
      [&] {
        k.check({4, 1, 1}, {256, 1, 1}, saxpy_args(x, y, 2.f, 1000, Bad::ExtraArg));
      },
      {"[test.saxpy]", "takes 4 arguments but 5 were visited"});
  expect_error(
      [&] {
        k.check({4, 1, 1}, {256, 1, 1}, saxpy_args(x, y, 2.f, 1000, Bad::FloatForInt));
      },
      {"[test.saxpy]", "argument 3 'n'", "an f64"});
  expect_error(
      [&] {
        k.check({4, 1, 1}, {256, 1, 1}, saxpy_args(x, y, 2.f, 1000, Bad::IntForFloat));
      },
      {"[test.saxpy]", "argument 2 'a'", ".f32", "an i32"});
  expect_error(
      [&] {
        k.launch({4, 1, 1}, {256, 1, 1}, saxpy_args(x, y, 2.f, 1000));
      },
      {"[test.saxpy]", "sm_90", "without a device", "Kernel::compile"});

  expect_error([] { kg::cuda::Kernel::compile_for_arch("test.saxpy", kSaxpy, "saxpy_typo", 90); },
               {"[test.saxpy]", "entry point 'saxpy_typo'", "kg_test_saxpy"});
  expect_error([] { kg::cuda::Kernel::compile_for_arch("test.saxpy", kSaxpy, "", 90); },
               {"[test.saxpy]", "entry point"});
  expect_error([] { kg::cuda::Kernel().entry(); }, {"empty"});
}

TEST(CudaByHand, WithoutADeviceEveryCallSaysWhy) {
  if (kg::cuda::available()) GTEST_SKIP() << "a GPU is present: " << kg::cuda::device_name(0);
  const std::string why = kg::cuda::unavailable_reason();
  EXPECT_FALSE(why.empty());
  EXPECT_EQ(kg::cuda::device_count(), 0);
  EXPECT_FALSE(kg::Device::cuda_available());
  const std::vector<std::string> parts{"CUDA is not available", why};
  expect_error([] { kg::cuda::Kernel::compile("test.saxpy", kSaxpy, "kg_test_saxpy"); }, parts);
  expect_error([] { kg::cuda::DeviceTensorBuffer(kg::DType::F32, {4}); }, parts);
  expect_error([] { kg::cuda::DeviceTensorBuffer::from(kg::Tensor::zeros(kg::DType::F32, {3})); }, parts);
  expect_error([] { kg::cuda::device_name(0); }, parts);
  expect_error([] { kg::cuda::device_arch(0); }, parts);
  expect_error([] { kg::cuda::synchronize(0); }, parts);

  // An empty buffer needs no GPU and says what is wrong.
  kg::cuda::DeviceTensorBuffer empty;
  EXPECT_EQ(empty.ptr(), 0u);
  EXPECT_EQ(empty.nbytes(), 0u);
  expect_error([&] { empty.upload(kg::Tensor::zeros(kg::DType::F32, {3})); }, {"upload", "empty"});
  expect_error([&] { empty.download(); }, {"download", "empty"});
}

// ---------------------------------------------------------------------------------------------
// With a GPU.

#define KG_REQUIRE_GPU()                                                                      \
  do {                                                                                        \
    if (!kg::cuda::available()) GTEST_SKIP() << "no GPU: " << kg::cuda::unavailable_reason(); \
  } while (0)

TEST(CudaGpu, DeviceIsDescribed) {
  KG_REQUIRE_GPU();
  EXPECT_GE(kg::cuda::device_count(), 1);
  EXPECT_FALSE(kg::cuda::device_name(0).empty());
  EXPECT_GE(kg::cuda::device_arch(0), 50);
  EXPECT_EQ(kg::cuda::unavailable_reason(), "");
  EXPECT_TRUE(kg::Device::cuda_available());
  std::printf("[   info   ] cuda:0 is %s, sm_%d; %d device(s)\n", kg::cuda::device_name(0).c_str(),
              kg::cuda::device_arch(0), kg::cuda::device_count());
  expect_error([] { kg::cuda::device_name(kg::cuda::device_count()); }, {"does not exist"});
}

TEST(CudaGpu, SaxpyByHandMatchesTheCpu) {
  KG_REQUIRE_GPU();
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const auto k = kg::cuda::Kernel::compile("test.saxpy", kSaxpy, "kg_test_saxpy");
  EXPECT_EQ(k.arch(), kg::cuda::device_arch(0));
  for (std::int64_t n : {1LL, 1000LL, 1000003LL}) {
    const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {n});
    const kg::Tensor y0 = kg_test::random_tensor(rng, kg::DType::F32, {n});
    const float a = std::uniform_real_distribution<float>(-3.f, 3.f)(rng);
    auto dx = kg::cuda::DeviceTensorBuffer::from(x);
    auto dy = kg::cuda::DeviceTensorBuffer::from(y0);
    EXPECT_EQ(dx.nbytes(), static_cast<std::size_t>(n) * 4);
    EXPECT_EQ(dx.shape(), x.shape());
    // Two launches in a row (y = 2a x + y0), few blocks so that the grid-stride loop runs.
    const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((n + 255) / 256, 64));
    for (int rep = 0; rep < 2; ++rep)
      k.launch({blocks, 1, 1}, {256, 1, 1}, saxpy_args(dx.ptr(), dy.ptr(), a, n));
    const kg::Tensor got = dy.download();
    kg::Tensor want = kg::Tensor::empty(kg::DType::F64, {n});
    const float* xs = x.data<float>();
    const float* ys = y0.data<float>();
    for (std::int64_t i = 0; i < n; ++i) want.data<double>()[i] = 2.0 * a * xs[i] + ys[i];
    EXPECT_TRUE(kg_test::all_close(got, want, 1e-6, 1e-6)) << "n = " << n;
    EXPECT_TRUE(kg_test::all_close(dx.download(), x, 0, 0)) << "x must be untouched";
  }
  // A bad launch fails before anything runs.
  auto dy = kg::cuda::DeviceTensorBuffer::from(kg::Tensor::zeros(kg::DType::F32, {8}));
  expect_error(
      [&] {
        k.launch({1, 1, 1}, {1024, 1, 1}, saxpy_args(dy.ptr(), dy.ptr(), 1.f, 8));
      },
      {"[test.saxpy]", "1024 threads", ".maxntid"});
  expect_error(
      [&] {
        k.launch({1, 1, 1}, {256, 1, 1}, saxpy_args(dy.ptr(), dy.ptr(), 1.f, 8, Bad::MissingArg));
      },
      {"[test.saxpy]", "missing argument 3 'n'"});
  expect_error([&] { dy.upload(kg::Tensor::zeros(kg::DType::F32, {9})); }, {"upload", "[9]", "[8]"});
  expect_error([&] { dy.upload(kg::Tensor::zeros(kg::DType::F64, {8})); }, {"upload", "f64", "f32"});
  kg::cuda::synchronize();
}

TEST(CudaGpu, ByHandOutputIsFullyWrittenOverPoison) {
  KG_REQUIRE_GPU();
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const auto k = kg::cuda::Kernel::compile("test.affine", kAffine, "kg_test_affine");
  const int n = 12345;
  const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F64, {n});
  auto dx = kg::cuda::DeviceTensorBuffer::from(x);
  kg::cuda::DeviceTensorBuffer out(kg::DType::F64, {n});
  out.fill_bytes(0xFF);
  EXPECT_FALSE(kg_test::all_written(out.download())) << "the poison did not land";
  const double scale = 1.5, shift = -0.25;
  k.launch({(n + 127) / 128, 1, 1}, {128, 1, 1}, [&](kg::ArgVisitor& v) {
    v.pointer(dx.ptr());
    v.pointer(out.ptr());
    v.f64(scale);
    v.f64(shift);
    v.i32(n);
  });
  const kg::Tensor got = out.download();
  EXPECT_TRUE(kg_test::all_written(got));
  kg::Tensor want = kg::Tensor::empty(kg::DType::F64, {n});
  for (int i = 0; i < n; ++i) want.data<double>()[i] = x.data<double>()[i] * scale + shift;
  EXPECT_TRUE(kg_test::all_close(got, want, 1e-15, 1e-15));
}

TEST(CudaGpu, Lenet5MatchesTheCpu) {
  KG_REQUIRE_GPU();
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  kg::Model model = kg::models::build("lenet5");
  for (std::int64_t batch : {1, 7, 130}) {
    const auto shape = kg::models::input_shape("lenet5", batch);
    kg::LoadOptions opt;
    opt.seed = rng();
    kg::LoadedModel cpu = model.load(kg::Device::cpu(), {shape}, opt);
    kg::LoadedModel gpu = model.load(kg::Device::cuda(), {shape}, opt);
    gpu.load_state_dict(cpu.state_dict());
    const kg::Tensor x = lenet_input(rng, batch);
    const kg::Tensor want = cpu.forward({x}).at(0);
    const kg::Tensor got = gpu.forward({x}).at(0);
    ASSERT_EQ(got.shape(), want.shape());
    EXPECT_TRUE(kg_test::all_written(got));
    const double e = normwise_rel_err(got, want);
    record_rel_err(e);
    EXPECT_LT(e, 1e-4) << "batch " << batch;
    EXPECT_TRUE(kg_test::all_close(got, want, 1e-3, 1e-4)) << "batch " << batch;
  }
}

TEST(CudaGpu, CudaGraphReplayEqualsEager) {
  KG_REQUIRE_GPU();
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const auto weights = random_lenet_weights(rng);
  for (std::int64_t batch : {1, 64}) {
    kg::LoadOptions graph_opt;
    graph_opt.cuda_graph = true;
    kg::LoadedModel replay = load_lenet(kg::Device::cuda(), batch, weights, graph_opt);
    kg::LoadedModel eager = load_lenet(kg::Device::cuda(), batch, weights);
    kg::LoadedModel cpu = load_lenet(kg::Device::cpu(), batch, weights);
    kg::Tensor previous;
    bool have_previous = false;
    for (int run = 0; run < 3; ++run) {
      const kg::Tensor x = lenet_input(rng, batch);
      const kg::Tensor got = replay.forward({x}).at(0);
      const kg::Tensor want = eager.forward({x}).at(0);
      // The same kernels on the same data: equal, up to the order of any reduction.
      EXPECT_TRUE(kg_test::all_close(got, want, 1e-6, 1e-7)) << "batch " << batch << ", replay " << run;
      const double e = normwise_rel_err(got, cpu.forward({x}).at(0));
      record_rel_err(e);
      EXPECT_LT(e, 1e-4) << "batch " << batch << ", replay " << run;
      // A replay must read the new input, not the one captured.
      if (have_previous) {
        EXPECT_FALSE(kg_test::all_close(got, previous, 1e-6, 1e-7))
            << "replay " << run << " repeated the last output";
      }
      previous = got.clone();
      have_previous = true;
    }
  }
}

TEST(CudaGpu, PoisonedBuffersAreAllWritten) {
  KG_REQUIRE_GPU();
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const auto weights = random_lenet_weights(rng);
  for (bool graph : {false, true}) {
    for (std::int64_t batch : {3, 257}) {
      kg::LoadOptions opt;
      opt.poison_buffers = true;
      opt.cuda_graph = graph;
      kg::LoadedModel gpu = load_lenet(kg::Device::cuda(), batch, weights, opt);
      kg::LoadedModel cpu = load_lenet(kg::Device::cpu(), batch, weights, opt);
      for (int run = 0; run < 2; ++run) {
        const kg::Tensor x = lenet_input(rng, batch);
        const kg::Tensor got = gpu.forward({x}).at(0);
        EXPECT_TRUE(kg_test::all_written(got)) << "graph " << graph << ", batch " << batch;
        const double e = normwise_rel_err(got, cpu.forward({x}).at(0));
        record_rel_err(e);
        EXPECT_LT(e, 1e-4) << "graph " << graph << ", batch " << batch;
      }
    }
  }
}

TEST(CudaGpu, LoadStateDictUploadsAgain) {
  KG_REQUIRE_GPU();
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::int64_t batch = 5;
  for (bool graph : {false, true}) {
    kg::LoadOptions opt;
    opt.cuda_graph = graph;
    const auto first = random_lenet_weights(rng);
    const auto second = random_lenet_weights(rng);
    kg::LoadedModel gpu = load_lenet(kg::Device::cuda(), batch, first, opt);
    kg::LoadedModel cpu = load_lenet(kg::Device::cpu(), batch, second);
    const kg::Tensor x = lenet_input(rng, batch);
    const kg::Tensor before = gpu.forward({x}).at(0).clone();
    gpu.load_state_dict(second);
    const kg::Tensor after = gpu.forward({x}).at(0);
    EXPECT_FALSE(kg_test::all_close(after, before, 1e-3, 1e-4)) << "new weights did not change the outputs";
    const double e = normwise_rel_err(after, cpu.forward({x}).at(0));
    record_rel_err(e);
    EXPECT_LT(e, 1e-4) << "graph " << graph;
    // The device copy is what state_dict() reads back.
    const auto back = gpu.state_dict();
    for (const auto& [name, t] : second) {
      ASSERT_TRUE(back.count(name)) << name;
      EXPECT_TRUE(kg_test::all_close(back.at(name), t, 0, 0)) << name;
    }
  }
}

TEST(CudaGpu, PlanOverTheFreeGpuMemoryIsRefusedBeforeAllocating) {
  KG_REQUIRE_GPU();
  // LeNet-5 at batch 2^27 needs about 3 TB on the device: refused from cuMemGetInfo's figure,
  // naming the input shape and the counts, before the arena allocation is tried.
  kg::Model m = kg::models::build("lenet5");
  const std::int64_t batch = std::int64_t{1} << 27;
  expect_error([&] { m.load(kg::Device::cuda(), {kg::models::input_shape("lenet5", batch)}); },
               {"the memory plan for input 'input' [134217728, 1, 28, 28] needs", "on cuda:0 but",
                "are free (cuMemGetInfo)", "KG_NO_MEMORY_CHECK=1"});
  // Without the check the allocation itself fails, with the driver's error.
  ::setenv("KG_NO_MEMORY_CHECK", "1", 1);
  try {
    m.load(kg::Device::cuda(), {kg::models::input_shape("lenet5", batch)});
    ADD_FAILURE() << "a 3 TB arena was allocated";
  } catch (const kg::Error& e) {
    EXPECT_EQ(std::string(e.what()).find("the memory plan for"), std::string::npos) << e.what();
  }
  ::unsetenv("KG_NO_MEMORY_CHECK");
}
