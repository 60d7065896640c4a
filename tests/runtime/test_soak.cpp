// Under load: a loaded model run 10^5 times keeps its memory flat. After a warm-up (every
// thread-local scratch buffer, the pool's threads, malloc's arenas at their working size), the
// resident set must not grow by more than a small bound; each forward allocates only the outputs
// it returns, which the caller frees.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "kg/models.hpp"
#include "support/test_util.hpp"

namespace {

// Resident set size in bytes: the second field of /proc/self/statm, in pages.
std::size_t resident_bytes() {
  std::ifstream f("/proc/self/statm");
  std::size_t size_pages = 0, resident_pages = 0;
  f >> size_pages >> resident_pages;
  return resident_pages * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
}

bool same_bytes(const kg::Tensor& a, const kg::Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

constexpr int kWarmup = 1000;
constexpr int kForwards = 100000;
constexpr std::size_t kGrowthBound = 2u << 20;  // 2 MiB over 10^5 forwards: ~20 bytes a forward

// 10^5 forwards of LeNet-5 at batch 1 on the CPU: the resident set after the warm-up and at the end
// differ by less than kGrowthBound, and the outputs stay those of the first run (bitwise).
TEST(Soak, LeNetForwardsKeepMemoryFlat) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer keeps freed memory in quarantine, so the resident set is no measure here";
#endif
  const auto seed = kg_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  kg::Model model = kg::models::build("lenet5");
  kg::LoadedModel m = model.load(kg::Device::cpu(), {kg::models::input_shape("lenet5", 1)});
  // A few inputs, cycled, each with the logits of its first run.
  std::vector<kg::Tensor> inputs, want;
  for (int k = 0; k < 8; ++k) {
    inputs.push_back(kg_test::random_tensor(rng, kg::DType::F32, kg::models::input_shape("lenet5", 1)));
    want.push_back(m.forward({inputs.back()}).at(0));
  }
  const auto at = [&](int i) { return static_cast<std::size_t>(i) % inputs.size(); };
  int mismatched = 0;
  for (int i = 0; i < kWarmup; ++i)
    if (!same_bytes(m.forward({inputs[at(i)]}).at(0), want[at(i)])) ++mismatched;
  const std::size_t before = resident_bytes();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kForwards; ++i) {
    std::vector<kg::Tensor> out = m.forward({inputs[at(i)]});
    // Every 97th result checked in full (a check on each would time the comparison, not the model).
    if (i % 97 == 0 && !same_bytes(out.at(0), want[at(i)])) ++mismatched;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::size_t after = resident_bytes();
  const long long growth = static_cast<long long>(after) - static_cast<long long>(before);
  std::printf(
      "soak: %d LeNet-5 forwards (batch 1, cpu) in %.2f s (%.4f ms each); resident set %.2f MiB "
      "after %d warm-up forwards, %.2f MiB at the end (%+lld bytes; bound %zu)\n",
      kForwards, seconds, 1e3 * seconds / kForwards, static_cast<double>(before) / (1 << 20), kWarmup,
      static_cast<double>(after) / (1 << 20), growth, kGrowthBound);
  EXPECT_EQ(mismatched, 0) << "forwards whose logits differ from the first run's";
  EXPECT_LT(growth, static_cast<long long>(kGrowthBound))
      << "the resident set grew from " << before << " to " << after << " bytes over " << kForwards
      << " forwards";
}

}  // namespace
