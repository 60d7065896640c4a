#include <cmath>

#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

// softmax (or log_softmax) over dim `d` in double, max-subtracted.
kg::Tensor naive_softmax(const kg::Tensor& x, std::size_t d, bool log) {
  const auto& s = x.shape();
  std::int64_t outer = 1, n = s[d], inner = 1;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i < d) outer *= s[i];
    if (i > d) inner *= s[i];
  }
  kg::Tensor y = kg::Tensor::empty(kg::DType::F64, s);
  double* out = y.data<double>();
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t j = 0; j < inner; ++j) {
      auto at = [&](std::int64_t i) { return (o * n + i) * inner + j; };
      double m = -INFINITY;
      for (std::int64_t i = 0; i < n; ++i) m = std::max(m, x.item(at(i)));
      double sum = 0;
      for (std::int64_t i = 0; i < n; ++i) sum += std::exp(x.item(at(i)) - m);
      for (std::int64_t i = 0; i < n; ++i)
        out[at(i)] = log ? x.item(at(i)) - m - std::log(sum) : std::exp(x.item(at(i)) - m) / sum;
    }
  return y;
}

kg::SymTensor apply(const kg::SymTensor& t, std::int64_t dim, bool log) {
  return log ? kg::log_softmax(t, dim, "sm") : kg::softmax(t, dim, "sm");
}

}  // namespace

TEST(Softmax, ShapeInference) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), kg::dynamic, 10});
  for (std::int64_t dim : {-3, -2, -1, 0, 1, 2}) {
    auto y = kg::softmax(x, dim);
    EXPECT_EQ(y.shape().to_string(), "[batch, ?, 10]");
    EXPECT_EQ(y.dtype(), kg::DType::F32);
    EXPECT_EQ(g->node(y.node()).op_name(), "nn.softmax");
    EXPECT_EQ(g->node(kg::log_softmax(x, dim).node()).op_name(), "nn.log_softmax");
  }
  auto [s, g2] = kg::SymTensor::input(kg::DType::F64, kg::Shape{});
  EXPECT_EQ(kg::softmax(s, 0).shape().to_string(), "[]");
}

TEST(Softmax, RejectsBadInputs) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 4, 5});
  kg_test::expect_error([&] { kg::softmax(x, 3, "sm"); }, {"[nn.softmax @ sm]", "dim 3", "rank 3"});
  kg_test::expect_error([&] { kg::log_softmax(x, -4, "lsm"); },
                        {"[nn.log_softmax @ lsm]", "dim -4", "rank 3"});
  auto [i, g2] = kg::SymTensor::input(kg::DType::I32, {kg::dynamic, 4});
  kg_test::expect_error([&] { kg::softmax(i, -1, "sm"); }, {"[nn.softmax @ sm]", "f32 and f64", "i32"});
}

TEST(Softmax, MatchesNaiveReferenceOverEveryDim) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t batch : {1, 7, 64}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, 5, 3, 7}, -6, 6);
      for (std::int64_t dim = -4; dim < 4; ++dim) {
        for (bool log : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "batch " << batch << " " << kg::dtype_name(dt) << " dim "
                                            << dim << (log ? " log" : ""));
          kg::Tensor y = kg_test::run_op([&](const kg::SymTensor& t) { return apply(t, dim, log); }, x);
          const auto d = static_cast<std::size_t>(dim < 0 ? dim + 4 : dim);
          const double tol = dt == kg::DType::F32 ? 1e-5 : 1e-12;
          EXPECT_TRUE(kg_test::all_close(y, naive_softmax(x, d, log), tol, tol));
        }
      }
    }
  }
}

TEST(Softmax, LongRowsAndWideColumns) {
  // Rows longer than a cache line of work and inner strides wider than one column block.
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
    kg::Tensor x = kg_test::random_tensor(rng, dt, {3, 37, 600}, -20, 20);
    const double tol = dt == kg::DType::F32 ? 1e-5 : 1e-12;
    for (std::int64_t dim : {1, 2})
      for (bool log : {false, true}) {
        SCOPED_TRACE(::testing::Message() << kg::dtype_name(dt) << " dim " << dim << (log ? " log" : ""));
        kg::Tensor y = kg_test::run_op([&](const kg::SymTensor& t) { return apply(t, dim, log); }, x);
        EXPECT_TRUE(kg_test::all_close(y, naive_softmax(x, static_cast<std::size_t>(dim), log), tol, tol));
      }
  }
}

TEST(Softmax, StableForLargeValues) {
  // Values far beyond exp's range: the result must be finite and exact for each dtype.
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
    kg::Tensor x = kg_test::random_tensor(rng, dt, {4, 9, 6}, 2000, 2050);
    const double tol = dt == kg::DType::F32 ? 1e-5 : 1e-12;
    for (std::int64_t dim : {1, 2})
      for (bool log : {false, true}) {
        SCOPED_TRACE(::testing::Message() << kg::dtype_name(dt) << " dim " << dim << (log ? " log" : ""));
        kg::Tensor y = kg_test::run_op([&](const kg::SymTensor& t) { return apply(t, dim, log); }, x);
        EXPECT_TRUE(kg_test::all_close(y, naive_softmax(x, static_cast<std::size_t>(dim), log), tol, tol));
      }
  }
}

TEST(Softmax, Scalar) {
  kg::Tensor x = kg::Tensor::from_vector<double>({}, {3.25});
  auto out = kg_test::run_graph(
      [](const std::vector<kg::SymTensor>& xs) {
        return std::vector<kg::SymTensor>{kg::softmax(xs[0], 0), kg::log_softmax(xs[0], -1)};
      },
      {x});
  EXPECT_EQ(out[0].item(0), 1.0);
  EXPECT_EQ(out[1].item(0), 0.0);
}

TEST(Softmax, MatchesPyTorch) {
  auto fx = kg_test::fixture("softmax_dims.safetensors");
  for (std::string tag : {"f32", "f64"}) {
    const kg::Tensor& x = fx.at("x_" + tag);
    const double tol = tag == "f32" ? 1e-5 : 1e-12;
    for (std::int64_t d = 0; d < 3; ++d)
      for (bool log : {false, true}) {
        SCOPED_TRACE(::testing::Message() << tag << " dim " << d << (log ? " log" : ""));
        const std::string key = (log ? "log_softmax" : "softmax") + std::to_string(d) + "_" + tag;
        EXPECT_TRUE(
            kg_test::all_close(kg_test::run_op([&](const kg::SymTensor& t) { return apply(t, d, log); }, x),
                               fx.at(key), tol, tol));
        // The same dim counted from the end.
        EXPECT_TRUE(kg_test::all_close(
            kg_test::run_op([&](const kg::SymTensor& t) { return apply(t, d - 3, log); }, x), fx.at(key), tol,
            tol));
      }
  }
  auto large = kg_test::fixture("softmax_large.safetensors");
  for (std::string tag : {"f32", "f64"}) {
    SCOPED_TRACE("large " + tag);
    const kg::Tensor& x = large.at("x_" + tag);
    const double tol = tag == "f32" ? 1e-5 : 1e-12;
    EXPECT_TRUE(kg_test::all_close(kg_test::run_op([](const kg::SymTensor& t) { return kg::softmax(t); }, x),
                                   large.at("softmax_" + tag), tol, tol));
    EXPECT_TRUE(
        kg_test::all_close(kg_test::run_op([](const kg::SymTensor& t) { return kg::log_softmax(t); }, x),
                           large.at("log_softmax_" + tag), tol, tol));
  }
}
