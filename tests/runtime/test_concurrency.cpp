// Under load: several threads at once, each with its own LoadedModel of one shared Model, and
// several threads importing the same ONNX file. Results must be those of one thread alone,
// bitwise: every thread runs the same code on the same data (the process-wide thread pool splits
// a parallel_for the same way whoever calls it), so there is no rounding that could differ.
//
// One LoadedModel used by several threads at once is not supported (it owns one activation arena
// and one set of run state; see docs/threads.md) and is not tested: that would be undefined
// behaviour, not a result.
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "kg/models.hpp"
#include "kg/onnx.hpp"
#include "support/test_util.hpp"

namespace {

constexpr int kThreads = 4;
constexpr int kForwards = 200;

bool same_bytes(const kg::Tensor& a, const kg::Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// What a thread found: forwards whose outputs differ from the reference, and the first error.
struct ThreadResult {
  int mismatched = 0;
  int first_mismatch = -1;
  std::string error;
};

// Runs fn(t) on kThreads threads at once; an exception becomes the thread's error.
template <class Fn>
std::vector<ThreadResult> on_threads(Fn fn) {
  std::vector<ThreadResult> results(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      try {
        fn(t, results[static_cast<std::size_t>(t)]);
      } catch (const std::exception& e) {
        results[static_cast<std::size_t>(t)].error = e.what();
      }
    });
  for (auto& th : threads) th.join();
  return results;
}

void expect_all_equal(const std::vector<ThreadResult>& results) {
  for (int t = 0; t < kThreads; ++t) {
    const ThreadResult& r = results[static_cast<std::size_t>(t)];
    EXPECT_EQ(r.error, "") << "thread " << t << " failed";
    EXPECT_EQ(r.mismatched, 0) << "thread " << t << ": forwards whose outputs differ from the single-thread "
                               << "reference (the first: " << r.first_mismatch << ")";
  }
}

// The load options of thread t: the even threads share the process-wide pool, the odd ones have a
// pool of their own (LoadOptions::threads), so both kinds run at once.
kg::LoadOptions options_of_thread(int t) {
  kg::LoadOptions o;
  o.threads = t % 2 == 0 ? 0 : 2;
  return o;
}

// 4 threads, each loading the one Model (shared, read-only) into its own LoadedModel on the cpu and
// running 200 forwards on inputs of its own, compared bitwise with references computed first on
// this thread alone (with the same load options: the same default parameters, LoadOptions::seed 0,
// and the same pool size, so that every parallel_for is split the same way).
TEST(Concurrency, ThreadsWithTheirOwnLoadedModelOfOneSharedModelMatchOneThread) {
  const auto seed = kg_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const kg::Model model = kg::models::build("lenet5");
  const std::vector<std::int64_t> shape = kg::models::input_shape("lenet5", 2);
  std::vector<std::vector<kg::Tensor>> inputs(kThreads), want(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    kg::LoadedModel reference = model.load(kg::Device::cpu(), {shape}, options_of_thread(t));
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(t));
    for (int i = 0; i < kForwards; ++i) {
      inputs[static_cast<std::size_t>(t)].push_back(kg_test::random_tensor(rng, kg::DType::F32, shape));
      want[static_cast<std::size_t>(t)].push_back(
          reference.forward({inputs[static_cast<std::size_t>(t)].back()}).at(0));
    }
  }
  const auto results = on_threads([&](int t, ThreadResult& r) {
    kg::LoadedModel m = model.load(kg::Device::cpu(), {shape}, options_of_thread(t));
    const auto& in = inputs[static_cast<std::size_t>(t)];
    const auto& ref = want[static_cast<std::size_t>(t)];
    for (int i = 0; i < kForwards; ++i) {
      const std::vector<kg::Tensor> out = m.forward({in[static_cast<std::size_t>(i)]});
      if (out.size() != 1 || !same_bytes(out[0], ref[static_cast<std::size_t>(i)])) {
        if (r.mismatched++ == 0) r.first_mismatch = i;
      }
    }
  });
  expect_all_equal(results);
}

// 4 threads each importing bert2.onnx (kg::onnx::import), loading it on the cpu and running it
// once on the fixture's inputs: every output bitwise equal to one import run on this thread.
TEST(Concurrency, ThreadsImportingOneOnnxFileAtOnceGetEqualModels) {
  const std::string dir = std::string(KG_SOURCE_DIR) + "/tests/fixtures/onnx/";
  const auto fixture = kg::read_safetensors(dir + "bert2.case1.safetensors");
  const std::vector<kg::Tensor> ins = {fixture.at("input_ids"), fixture.at("attention_mask")};
  const std::vector<std::vector<std::int64_t>> shapes = {ins[0].shape(), ins[1].shape()};
  const auto run_once = [&] {
    kg::Model model = kg::onnx::import(dir + "bert2.onnx");
    kg::LoadedModel lm = model.load(kg::Device::cpu(), shapes);
    return lm.forward(ins);
  };
  const std::vector<kg::Tensor> want = run_once();
  ASSERT_EQ(want.size(), 2u);  // last_hidden_state, pooler_output
  const auto results = on_threads([&](int, ThreadResult& r) {
    const std::vector<kg::Tensor> got = run_once();
    bool same = got.size() == want.size();
    for (std::size_t k = 0; same && k < got.size(); ++k) same = same_bytes(got[k], want[k]);
    if (!same) {
      r.mismatched = 1;
      r.first_mismatch = 0;
    }
  });
  expect_all_equal(results);
}

}  // namespace
