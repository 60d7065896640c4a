// On a GPU: what a tuned load measures is kept in the tuning cache, and a later untuned load runs
// the same tactics without measuring (its profile says "cached" for every library call), with the
// same results.
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>

#include "compile/tuning_cache.hpp"
#include "support/test_util.hpp"

namespace {

// A profile's tactic without what tuning adds: "(tuned)", "(tuned, cached)" and the times a tuned
// load measured, " (own 0.010 ms, library 0.026 ms)".
std::string without_tuning_note(std::string s) {
  for (const char* note : {" (tuned, cached)", " (tuned)"})
    for (std::size_t at; (at = s.find(note)) != std::string::npos;) s.erase(at, std::string(note).size());
  return std::regex_replace(s, std::regex(R"( \(own [0-9.]+ ms, library [0-9.]+ ms\))"), "");
}

TEST(TuningCacheGpu, AnUntunedLoadRunsWhatATunedLoadKept) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no CUDA device";
  if (kg::compile::TuningCache::global().dir().empty()) GTEST_SKIP() << "no private cache folder";
  auto graph = kg::Graph::create();
  kg::SymTensor x = graph->input(kg::DType::F32, {kg::Dim::named("batch"), 8, 20, 20}, "x");
  kg::SymTensor h = kg::relu(kg::nn::conv2d(x, 24, 3, {.padding = 1}, "conv"), "act");
  h = kg::flatten(kg::global_avg_pool(h, "pool"), 1, -1, "flat");
  kg::Model model(graph, {kg::nn::linear(h, 10, "fc")});
  const std::vector<std::int64_t> shape{4, 8, 20, 20};
  std::mt19937_64 rng(kg_test::fresh_seed());
  const kg::Tensor in = kg_test::random_tensor(rng, kg::DType::F32, shape);

  kg::LoadOptions opt;
  opt.profile = true;
  opt.tune = true;
  kg::LoadedModel tuned = model.load(kg::Device::cuda(), {shape}, opt);
  const kg::Tensor want = tuned.forward({in})[0];
  // The measurements are on disk: at least the library-or-own verdict of both library nodes.
  std::size_t lines = 0;
  for (const auto& f : std::filesystem::directory_iterator(kg::compile::TuningCache::global().dir())) {
    std::ifstream in_file(f.path());
    for (std::string line; std::getline(in_file, line);) lines += line.rfind("#", 0) != 0;
  }
  EXPECT_GE(lines, 2u);
  opt.tune = false;
  kg::LoadedModel later = model.load(kg::Device::cuda(), {shape}, opt);
  later.load_state_dict(tuned.state_dict());
  const kg::Tensor got = later.forward({in})[0];
  EXPECT_TRUE(kg_test::all_close(got, want, 1e-5, 1e-6));

  const auto a = tuned.profile(), b = later.profile();
  ASSERT_EQ(a.size(), b.size());
  int library_nodes = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(without_tuning_note(a[i].kernel), without_tuning_note(b[i].kernel)) << a[i].node;
    // A library call the tuned load measured (not one it read back) shows both tactics' times.
    if (a[i].kernel.find("(tuned)") != std::string::npos) {
      EXPECT_TRUE(std::regex_search(a[i].kernel, std::regex(R"(\(own [0-9.]+ ms, library [0-9.]+ ms\))")))
          << a[i].kernel;
    }
    const bool library = b[i].kernel.rfind("cudnn", 0) == 0 || b[i].kernel.rfind("cublasLt", 0) == 0;
    if (!library) continue;
    ++library_nodes;
    EXPECT_NE(b[i].kernel.find("(tuned, cached)"), std::string::npos) << b[i].node << ": " << b[i].kernel;
  }
  // The convolution and the linear layer, unless the op's own kernels won both.
  SUCCEED() << library_nodes << " library calls";
}

}  // namespace
