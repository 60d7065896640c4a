// LoadOptions::threads on the cpu: 0 is the shared pool (one thread per core), 1 to 256 a pool
// of the model's own, and a negative count an error naming the option rather than the shared
// pool taken quietly.
#include <gtest/gtest.h>

#include <chrono>
#include <limits>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "kg/kg.hpp"
#include "kg/runtime_op.hpp"
#include "support/test_util.hpp"
#include "util/thread_pool.hpp"

namespace {

kg::Model relu_model() {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 8});
  return kg::Model(g, {kg::relu(x, "relu")});
}

kg::LoadedModel load_with_threads(int threads) {
  kg::LoadOptions o;
  o.threads = threads;
  return relu_model().load(kg::Device::cpu(), {{2, 8}}, o);
}

// The distinct threads that ran an op's chunks.
struct ThreadRecord {
  std::mutex mu;
  std::set<std::thread::id> forward, backward;
  void note(std::set<std::thread::id>& s) {
    std::lock_guard<std::mutex> lk(mu);
    s.insert(std::this_thread::get_id());
  }
};

// y = x, copied in chunks of one row through ctx.parallel_for (grain 1, so a pool of P threads
// runs P chunks, one on each of its threads); the backward likewise. Each chunk notes its thread.
class ThreadsOp final : public kg::CustomOp {
 public:
  explicit ThreadsOp(std::shared_ptr<ThreadRecord> r) : r_(std::move(r)) {}
  std::string name() const override { return "test.threads"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  void cpu_forward(kg::CpuContext& ctx) const override {
    const kg::Tensor& x = ctx.inputs[0];
    const std::int64_t rows = x.shape()[0], n = x.shape()[1];
    ctx.parallel_for(rows, 1, [&](std::int64_t b, std::int64_t e) {
      r_->note(r_->forward);
      for (std::int64_t i = b * n; i < e * n; ++i) ctx.output.data<float>()[i] = x.data<float>()[i];
    });
  }
  bool has_cpu_backward() const override { return true; }
  void cpu_backward(kg::CpuBackwardContext& ctx) const override {
    if (!ctx.wants_input_grad(0)) return;
    const std::int64_t rows = ctx.grad_output.shape()[0], n = ctx.grad_output.shape()[1];
    ctx.parallel_for(rows, 1, [&](std::int64_t b, std::int64_t e) {
      r_->note(r_->backward);
      for (std::int64_t i = b * n; i < e * n; ++i)
        ctx.grad_inputs[0].data<float>()[i] = ctx.grad_output.data<float>()[i];
    });
  }

 private:
  std::shared_ptr<ThreadRecord> r_;
};

// An op with only a kernel (run by the emulator on the cpu): each block notes the OS thread that
// ran it in y[block] and waits a little, so that every thread of the pool takes some blocks.
class EmulatedThreadsOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.emulated_threads"; }
  kg::DType infer_output_dtype(const std::vector<kg::DType>&) const override { return kg::DType::I64; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return kg::Shape{in.at(0)[0]}; }
  std::optional<kg::Lowered> lower(const kg::LowerContext&) const override {
    const char* src = R"(
#include <pthread.h>
#include <unistd.h>
extern "C" __global__ void who_ran(long long* y, long long n) {
  if (threadIdx.x == 0 && blockIdx.x < n) {
    y[blockIdx.x] = (long long)pthread_self();
    usleep(20000);
  }
}
)";
    struct Rt final : kg::RuntimeOp {
      std::vector<kg::Launch> launches(const kg::LaunchTensors& t) const override {
        kg::Launch l;
        l.block = {1, 1, 1};
        l.grid = {static_cast<unsigned>(t.output.numel()), 1, 1};
        l.args.add(t.output);
        l.args.i64(t.output.numel());
        return {l};
      }
    };
    return kg::Lowered{"test.emulated_threads", src, "who_ran", std::make_shared<Rt>()};
  }
};

}  // namespace

// An op's parallel_for runs on the pool of the model that runs it: as many threads as
// LoadOptions::threads, forward and backward, not the process-wide pool's count.
TEST(CpuThreads, AnOpsParallelForRunsOnTheModelsPool) {
  const int global = kg::util::ThreadPool::global().size();
  for (int threads : {1, 3, 0}) {
    SCOPED_TRACE(threads);
    auto record = std::make_shared<ThreadRecord>();
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 8}, "x");
    kg::SymTensor h = kg::nn::linear(x, 8, "fc");
    kg::SymTensor y = h.record_custom(kg::CustomData::make<ThreadsOp>(record), {}, std::nullopt, "threads");
    kg::SymTensor target = g->input(kg::DType::F32, kg::Shape{kg::Dim::named("batch"), 8}, "target");
    kg::Model m(g, {{"y", y}, {"loss", kg::mse_loss(y, target, "loss")}}, kg::LoweringMode::Training);
    kg::LoadOptions o;
    o.threads = threads;
    kg::LoadedModel lm = m.load(kg::Device::cpu(), {{64, 8}, {64, 8}}, o);
    const kg::Tensor in = kg::Tensor::zeros(kg::DType::F32, {64, 8});
    lm.forward({in, in});
    lm.backward();
    const std::size_t want = static_cast<std::size_t>(threads ? threads : global);
    EXPECT_EQ(record->forward.size(), want);
    EXPECT_EQ(record->backward.size(), want);
  }
}

// The emulator runs an emulated op's blocks on the model's pool too.
TEST(CpuThreads, EmulatedKernelsRunOnTheModelsPool) {
  for (int threads : {1, 3}) {
    SCOPED_TRACE(threads);
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 1}, "x");
    kg::SymTensor y = x.record_custom(kg::CustomData::make<EmulatedThreadsOp>(), {}, std::nullopt, "who");
    kg::Model m(g, {{"y", y}});
    kg::LoadOptions o;
    o.threads = threads;
    kg::LoadedModel lm = m.load(kg::Device::cpu(), {{24, 1}}, o);
    const kg::Tensor out = lm.forward({kg::Tensor::zeros(kg::DType::F32, {24, 1})}).at(0);
    std::set<std::int64_t> ran;
    for (std::int64_t i = 0; i < out.numel(); ++i) ran.insert(out.data<std::int64_t>()[i]);
    EXPECT_EQ(ran.size(), static_cast<std::size_t>(threads));
  }
}

TEST(CpuThreads, NegativeThreadCountIsAnError) {
  for (int threads : {-1, -256, std::numeric_limits<int>::min()}) {
    SCOPED_TRACE(threads);
    kg_test::expect_error([&] { load_with_threads(threads); },
                          {"LoadOptions::threads is " + std::to_string(threads), "expected 0", "256"});
  }
}

TEST(CpuThreads, ZeroAndPositiveCountsLoadAndRun) {
  for (int threads : {0, 1, 3}) {
    SCOPED_TRACE(threads);
    kg::LoadedModel m = load_with_threads(threads);
    kg::Tensor x = kg::Tensor::zeros(kg::DType::F32, {2, 8});
    x.data<float>()[3] = -1.0f;
    x.data<float>()[4] = 2.0f;
    const std::vector<kg::Tensor> y = m.forward({x});
    ASSERT_EQ(y.size(), 1u);
    EXPECT_EQ(y[0].data<float>()[3], 0.0f);
    EXPECT_EQ(y[0].data<float>()[4], 2.0f);
  }
}

TEST(CpuThreads, CountOverTheLimitIsStillRefused) {
  kg_test::expect_error([] { load_with_threads(257); }, {"257", "LoadOptions::threads"});
}
