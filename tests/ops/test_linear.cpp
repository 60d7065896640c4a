#include <array>

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
  // Small products take direct dot products, larger ones go through BLAS: cover both.
  for (auto [batch, in, out] : std::vector<std::array<std::int64_t, 3>>{{1, 33, 10}, {7, 33, 10}, {64, 33, 10},
                                                                         {1, 400, 120}, {3, 401, 129}, {64, 70, 65}}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, in});
      kg::Tensor w = kg_test::random_tensor(rng, dt, {out, in});
      kg::Tensor b = kg_test::random_tensor(rng, dt, {out});
      kg::Tensor y = kg_test::run_op([out = out](const kg::SymTensor& t) { return kg::nn::linear(t, out, "fc"); }, x,
                                     {{"fc.weight", w}, {"fc.bias", b}});
      // f32 sums of up to 401 products: allow a few ulps of the sum of |terms| in absolute terms.
      EXPECT_TRUE(kg_test::all_close(y, naive_linear(x, w, b), dt == kg::DType::F32 ? 1e-5 : 1e-12,
                                     dt == kg::DType::F32 ? 2e-5 : 1e-9));
    }
  }
  // Without a bias, on the direct path (batch 1, a feature count past the last full vector).
  kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {1, 37});
  kg::Tensor w = kg_test::random_tensor(rng, kg::DType::F32, {6, 37});
  kg::Tensor y = kg_test::run_op([](const kg::SymTensor& t) { return kg::nn::linear(t, 6, "fc", false); }, x,
                                 {{"fc.weight", w}});
  EXPECT_TRUE(kg_test::all_close(y, naive_linear(x, w, kg::Tensor::zeros(kg::DType::F32, {6})), 1e-5, 2e-5));
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
