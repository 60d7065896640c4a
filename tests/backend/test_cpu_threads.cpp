// LoadOptions::threads on the cpu: 0 is the shared pool (one thread per core), 1 to 256 a pool
// of the model's own, and a negative count an error naming the option rather than the shared
// pool taken quietly.
#include <gtest/gtest.h>

#include <limits>
#include <string>

#include "kg/kg.hpp"
#include "support/test_util.hpp"

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

}  // namespace

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
