// LoadOptions::threads on the cpu: 0 is the shared pool (one thread per core), 1 to 256 a pool
// of the model's own, and a negative count an error naming the option rather than the shared
// pool taken quietly.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <new>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

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
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    return kg::Shape{in.at(0)[0]};
  }
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

// ---- the pool's two kinds of workers, inline small ranges, library thread counts, per-run
// allocations ----

namespace {

using Pool = kg::util::ThreadPool;

// The kinds of workers this process can run: its own always, OpenMP's where a runtime is loaded.
std::vector<Pool::Workers> worker_kinds() {
  std::vector<Pool::Workers> k{Pool::Workers::Own};
  if (Pool::openmp_available()) k.push_back(Pool::Workers::OpenMP);
  return k;
}

const char* kind_name(Pool::Workers w) { return w == Pool::Workers::Own ? "own" : "openmp"; }

// Counts operator new calls of this thread while `counting` is set.
thread_local bool t_counting = false;
thread_local long t_allocations = 0;

}  // namespace

// The replacements pair malloc with free; GCC cannot see that once they are inlined.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
__attribute__((noinline)) void* operator new(std::size_t n) {
  if (t_counting) ++t_allocations;
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
__attribute__((noinline)) void operator delete(void* p) noexcept { std::free(p); }
__attribute__((noinline)) void operator delete(void* p, std::size_t) noexcept { std::free(p); }
// The nothrow forms too (std::stable_sort's buffer comes from them): left to the runtime, they would
// allocate with its own operator new and be freed here with free, a mismatch AddressSanitizer reports.
__attribute__((noinline)) void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  if (t_counting) ++t_allocations;
  return std::malloc(n ? n : 1);
}
__attribute__((noinline)) void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }

namespace {

// Allocations (operator new) made by `fn` on this thread.
long allocations_of(const std::function<void()>& fn) {
  t_allocations = 0;
  t_counting = true;
  fn();
  t_counting = false;
  return t_allocations;
}

}  // namespace

TEST(CpuThreads, BothKindsOfWorkersCoverEveryIndexOnDistinctThreads) {
  for (Pool::Workers kind : worker_kinds()) {
    SCOPED_TRACE(kind_name(kind));
    for (int threads : {2, 3, 5}) {
      Pool pool(threads, kind);
      EXPECT_EQ(pool.size(), threads);
      EXPECT_EQ(pool.uses_openmp(), kind == Pool::Workers::OpenMP);
      for (int rep = 0; rep < 200; ++rep) {  // back to back: the spinning hand-over, then blocking
        const std::int64_t n = 1 + (rep * 37) % 500, grain = 1 + rep % 7;
        std::vector<std::atomic<int>> hits(static_cast<std::size_t>(n));
        std::mutex mu;
        std::set<std::thread::id> ids;
        std::atomic<int> chunks{0};
        pool.parallel_for(n, grain, [&](std::int64_t b, std::int64_t e) {
          ++chunks;
          for (std::int64_t i = b; i < e; ++i) hits[static_cast<std::size_t>(i)].fetch_add(1);
          std::lock_guard<std::mutex> lk(mu);
          ids.insert(std::this_thread::get_id());
        });
        for (std::size_t i = 0; i < hits.size(); ++i)
          ASSERT_EQ(hits[i].load(), 1) << "rep " << rep << " index " << i;
        const int want = static_cast<int>(std::clamp<std::int64_t>(n / grain, 1, threads));
        ASSERT_EQ(chunks.load(), want) << "rep " << rep;
        ASSERT_EQ(ids.size(), static_cast<std::size_t>(want)) << "rep " << rep;
        if (rep % 50 == 49) std::this_thread::sleep_for(std::chrono::milliseconds(2));  // workers block
      }
    }
  }
}

TEST(CpuThreads, ExceptionsPropagateFromEitherKindOfWorker) {
  for (Pool::Workers kind : worker_kinds()) {
    SCOPED_TRACE(kind_name(kind));
    Pool pool(3, kind);
    for (int rep = 0; rep < 3; ++rep) {
      // A worker's chunk, then the caller's, then every chunk.
      kg_test::expect_error(
          [&] {
            pool.parallel_for(90, 1, [](std::int64_t b, std::int64_t) {
              if (b >= 60) throw kg::Error("worker chunk " + std::to_string(b));
            });
          },
          {"worker chunk 60"});
      EXPECT_THROW(pool.parallel_for(90, 1,
                                     [](std::int64_t b, std::int64_t) {
                                       if (b == 0) throw std::invalid_argument("caller");
                                     }),
                   std::invalid_argument);
      std::atomic<int> ran{0};
      EXPECT_THROW(pool.parallel_for(90, 1,
                                     [&](std::int64_t, std::int64_t) {
                                       ++ran;
                                       throw std::runtime_error("all");
                                     }),
                   std::runtime_error);
      EXPECT_EQ(ran.load(), 3);
    }
    std::atomic<std::int64_t> sum{0};
    pool.parallel_for(100, 1, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) sum += i;
    });
    EXPECT_EQ(sum.load(), 99 * 100 / 2);  // still works
  }
}

// A range of one chunk (n < 2 * grain) and a call from inside a chunk run on the calling thread.
TEST(CpuThreads, SmallRangesAndNestedCallsRunInlineOnTheCaller) {
  for (Pool::Workers kind : worker_kinds()) {
    SCOPED_TRACE(kind_name(kind));
    Pool pool(4, kind);
    const auto me = std::this_thread::get_id();
    for (std::int64_t n : {1, 5, 63, 127}) {
      int calls = 0;
      pool.parallel_for(n, 64, [&](std::int64_t b, std::int64_t e) {
        ++calls;
        EXPECT_EQ(std::this_thread::get_id(), me);
        EXPECT_EQ(b, 0);
        EXPECT_EQ(e, n);
      });
      EXPECT_EQ(calls, 1);
    }
    std::vector<std::atomic<int>> hits(4 * 50);
    pool.parallel_for(4, 1, [&](std::int64_t b, std::int64_t e) {
      const auto outer = std::this_thread::get_id();
      for (std::int64_t i = b; i < e; ++i)
        pool.parallel_for(50, 1, [&](std::int64_t ib, std::int64_t ie) {
          EXPECT_EQ(std::this_thread::get_id(), outer);
          for (std::int64_t j = ib; j < ie; ++j) hits[static_cast<std::size_t>(i * 50 + j)].fetch_add(1);
        });
    });
    for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  }
}

TEST(CpuThreads, KgThreadPoolVariableIsChecked) {
  const char* old = std::getenv("KG_THREAD_POOL");
  const std::string saved = old ? old : "";
  ::setenv("KG_THREAD_POOL", "own", 1);
  EXPECT_FALSE(Pool(2).uses_openmp());
  ::setenv("KG_THREAD_POOL", "openmp", 1);
  EXPECT_EQ(Pool(2).uses_openmp(), Pool::openmp_available());
  ::setenv("KG_THREAD_POOL", "threads", 1);
  kg_test::expect_error([] { Pool p(2); }, {"KG_THREAD_POOL is 'threads'", "auto, own or openmp"});
  EXPECT_FALSE(Pool(2, Pool::Workers::Own).uses_openmp());  // an explicit kind is not the variable's
  if (old)
    ::setenv("KG_THREAD_POOL", saved.c_str(), 1);
  else
    ::unsetenv("KG_THREAD_POOL");
}

namespace {

// A small CNN (convolution, pooling, linear: our kernels, OpenBLAS or oneDNN) on `threads`.
std::vector<kg::Tensor> cnn_outputs(int threads, const kg::Tensor& x, int runs) {
  auto [in, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, 20, 20}, "x");
  kg::SymTensor h = kg::relu(kg::nn::conv2d(in, 8, 3, kg::nn::Conv2dOptions{1, 1}, "conv"), "relu");
  h = kg::max_pool2d(h, 2, 2, 0, 1, false, "pool");
  h = kg::avg_pool2d(h, 3, 2, 1, false, true, "avg");
  h = kg::nn::linear(kg::flatten(h, 1, -1, "flat"), 16, "fc");
  kg::Model m(g, {{"y", h}});
  kg::LoadOptions o;
  o.threads = threads;
  kg::LoadedModel lm = m.load(kg::Device::cpu(), {x.shape()}, o);
  std::vector<kg::Tensor> outs;
  for (int r = 0; r < runs; ++r) outs.push_back(lm.forward({x}).at(0));
  return outs;
}

}  // namespace

// Results on several threads equal those on one (within the libraries' summation order), run
// after run, with either kind of workers.
TEST(CpuThreads, ResultsOnSeveralThreadsEqualOneThread) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {37, 3, 20, 20});
  const kg::Tensor one = cnn_outputs(1, x, 1).at(0);
  for (const char* kind : {"own", "openmp"}) {
    ::setenv("KG_THREAD_POOL", kind, 1);
    for (int threads : {2, 3}) {
      SCOPED_TRACE(std::string(kind) + " " + std::to_string(threads) + " threads");
      for (const kg::Tensor& y : cnn_outputs(threads, x, 3))
        EXPECT_TRUE(kg_test::all_close(y, one, 1e-5, 1e-6));
    }
  }
  ::unsetenv("KG_THREAD_POOL");
}

// A forward sets the calling thread's OpenMP thread count (oneDNN's) and OpenBLAS's to the
// model's thread count.
TEST(CpuThreads, LibraryThreadCountsFollowTheModel) {
  using GetFn = int (*)();
  const auto omp_max = reinterpret_cast<GetFn>(::dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
  const auto blas_threads = reinterpret_cast<GetFn>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  if (!omp_max && !blas_threads) GTEST_SKIP() << "neither OpenMP nor OpenBLAS is loaded";
  for (int threads : {3, 1, 2}) {
    SCOPED_TRACE(threads);
    kg::LoadedModel m = load_with_threads(threads);
    m.forward({kg::Tensor::zeros(kg::DType::F32, {2, 8})});
    if (omp_max) {
      EXPECT_EQ(omp_max(), threads);
    }
    if (blas_threads) {
      EXPECT_EQ(blas_threads(), threads);
    }
    // Another thread's OpenMP count is its own: set by the forward that runs there.
    std::thread([&] {
      m.forward({kg::Tensor::zeros(kg::DType::F32, {2, 8})});
      if (omp_max) {
        EXPECT_EQ(omp_max(), threads);
      }
    }).join();
  }
}

// An exception in a chunk of an op's parallel_for comes out of forward with the node's label, on
// either kind of workers; the model runs again after it.
TEST(CpuThreads, AnOpsErrorInAWorkerChunkPropagates) {
  struct ThrowOp final : kg::CustomOp {
    std::shared_ptr<std::atomic<bool>> fail = std::make_shared<std::atomic<bool>>(true);
    std::string name() const override { return "test.throw_in_chunk"; }
    kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
    void cpu_forward(kg::CpuContext& ctx) const override {
      const std::int64_t n = ctx.output.numel();
      ctx.parallel_for(n, 1, [&](std::int64_t b, std::int64_t e) {
        if (*fail && b > 0) throw kg::Error("chunk at " + std::to_string(b) + " failed");
        for (std::int64_t i = b; i < e; ++i) ctx.output.data<float>()[i] = 2 * ctx.inputs[0].data<float>()[i];
      });
    }
  };
  for (const char* kind : {"own", "openmp"}) {
    SCOPED_TRACE(kind);
    ::setenv("KG_THREAD_POOL", kind, 1);
    auto op = std::make_shared<ThrowOp>();
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 8}, "x");
    kg::SymTensor y =
        x.record_custom(kg::CustomData(std::shared_ptr<const kg::CustomOp>(op)), {}, std::nullopt, "thrower");
    kg::LoadOptions o;
    o.threads = 3;
    kg::LoadedModel m = kg::Model(g, {kg::relu(y, "after")}).load(kg::Device::cpu(), {{4, 8}}, o);
    kg::Tensor in = kg::Tensor::zeros(kg::DType::F32, {4, 8});
    in.data<float>()[31] = 1.5f;
    kg_test::expect_error([&] { m.forward({in}); }, {"test.throw_in_chunk @ thrower", "failed"});
    *op->fail = false;
    const kg::Tensor out = m.forward({in}).at(0);
    EXPECT_EQ(out.shape(), (std::vector<std::int64_t>{4, 8}));
    EXPECT_EQ(out.data<float>()[31], 3.0f);
  }
  ::unsetenv("KG_THREAD_POOL");
}

// The executor allocates nothing per step: a forward through one op allocates as much as a
// forward through five (what remains is the returned output), and no more than copying the
// output does, plus its vector.
TEST(CpuThreads, AForwardAllocatesOnlyItsOutputs) {
  auto chain = [](int ops) {
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, 8, 8}, "x");
    kg::SymTensor h = x;
    for (int i = 0; i < ops; ++i) h = kg::max_pool2d(h, 1, 1, 0, 1, false, "pool" + std::to_string(i));
    kg::LoadOptions o;
    o.threads = 2;
    return kg::Model(g, {{"y", h}}).load(kg::Device::cpu(), {{64, 3, 8, 8}}, o);
  };
  kg::LoadedModel one = chain(1), five = chain(5);
  const std::vector<kg::Tensor> in{kg::Tensor::zeros(kg::DType::F32, {64, 3, 8, 8})};
  const std::vector<kg::Tensor> other{kg::Tensor::zeros(kg::DType::F32, {64, 3, 8, 8})};  // a new input
  for (int r = 0; r < 3; ++r) {
    one.forward(in);
    five.forward(r % 2 ? in : other);
  }
  std::vector<kg::Tensor> out;
  const long a = allocations_of([&] { out = one.forward(in); });
  const long b = allocations_of([&] { out = five.forward(other); });
  const long c = allocations_of([&] { out = five.forward(in); });
  kg::Tensor copy;
  const long clone = allocations_of([&] { copy = out.at(0).clone(); });
  EXPECT_EQ(a, b);
  EXPECT_EQ(b, c);
  EXPECT_LE(a, clone + 1) << "a forward allocates more than its output";
}
