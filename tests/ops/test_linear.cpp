#include "support/gpu_util.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

// y[r, j] = sum_k x[r, k] w[j, k] + b[j], in double.
kg::Tensor naive_linear(const kg::Tensor& x, const kg::Tensor& w, const kg::Tensor& b) {
  const std::int64_t in = w.dim(1), out = w.dim(0), rows = x.numel() / in;
  std::vector<std::int64_t> shape = x.shape();
  shape.back() = out;
  kg::Tensor y = kg::Tensor::empty(kg::DType::F64, shape);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < out; ++j) {
      double s = b.item(j);
      for (std::int64_t k = 0; k < in; ++k) s += x.item(r * in + k) * w.item(j * in + k);
      y.data<double>()[r * out + j] = s;
    }
  return y;
}

}  // namespace

TEST(Linear, ShapeInference) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, 20});
  auto y = kg::nn::linear(x, 7, "fc");
  EXPECT_EQ(y.shape().to_string(), "[batch, 3, 7]");
  EXPECT_EQ(y.name(), "fc");
  const auto& params = g->node(y.node()).params;
  ASSERT_EQ(params.size(), 2u);
  EXPECT_EQ(params[0].name, "fc.weight");
  EXPECT_EQ(params[0].shape, (std::vector<std::int64_t>{7, 20}));
  EXPECT_EQ(params[1].shape, (std::vector<std::int64_t>{7}));
}

TEST(Linear, RejectsBadInputs) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, kg::dynamic});
  kg_test::expect_error([&] { kg::nn::linear(x, 4, "fc"); }, {"nn.linear", "last dim must be known", "[?, ?]"});
  auto [i, g2] = kg::SymTensor::input(kg::DType::I32, {kg::dynamic, 5});
  kg_test::expect_error([&] { kg::nn::linear(i, 4, "fc"); }, {"[nn.linear @ fc]", "f32 and f64", "i32"});
  auto [z, g3] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 5});
  kg_test::expect_error([&] { kg::nn::linear(z, 0, "fc"); }, {"out_features must be positive"});
}

TEST(Linear, MatchesNaiveReferenceAtSeveralBatches) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t batch : {1, 7, 64}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, 33});
      kg::Tensor w = kg_test::random_tensor(rng, dt, {10, 33});
      kg::Tensor b = kg_test::random_tensor(rng, dt, {10});
      kg::Tensor y = kg_test::run_op([](const kg::SymTensor& t) { return kg::nn::linear(t, 10, "fc"); }, x,
                                     {{"fc.weight", w}, {"fc.bias", b}});
      EXPECT_TRUE(kg_test::all_close(y, naive_linear(x, w, b), dt == kg::DType::F32 ? 1e-5 : 1e-12, 1e-6));
    }
  }
}

TEST(Linear, GpuLoweringCompilesAndMatchesTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t batch : {1, 7, 130}) {
    for (bool bias : {true, false}) {
      kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {batch, 3, 70});
      kg_test::check_lowering(
          [&](const std::vector<kg::SymTensor>& xs) {
            return std::vector<kg::SymTensor>{kg::nn::linear(xs[0], 65, "fc", bias)};
          },
          {x}, 1e-4, 1e-5);
    }
  }
}
