#include <cmath>

#include "compile/compiler.hpp"
#include "lower/dry_run.hpp"
#include "support/gpu_util.hpp"
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

TEST(Softmax, GpuLoweringCompilesAndMatchesTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    std::vector<std::int64_t> shape;  // after the batch dim
    std::int64_t dim;
    double lo, hi;
  };
  const std::vector<Case> cases = {
      {{37}, -1, -6, 6},          // contiguous rows, one warp each
      {{3, 1000}, 2, -6, 6},      // the longest rows a warp takes
      {{2000}, 1, -6, 6},         // longer rows, one block each
      {{5, 6}, 1, -6, 6},         // strided: blocks of 8 columns
      {{5, 6}, 0, -6, 6},         // strided over the batch dim
      {{300, 2}, 1, -6, 6},       // two columns, long softmaxes
      {{40, 37}, 1, -6, 6},       // blocks of 32 columns, the second one partial
      {{9, 40}, -1, 2000, 2050},  // far beyond exp's range: the maximum is subtracted
      {{4, 9, 6}, -2, 2000, 2050},
  };
  for (std::int64_t batch : {1, 7, 130}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      for (const Case& c : cases) {
        for (bool log : {false, true}) {
          SCOPED_TRACE(::testing::Message()
                       << "batch " << batch << " " << kg::dtype_name(dt) << " shape "
                       << kg::sizes_to_string(c.shape) << " dim " << c.dim << (log ? " log" : ""));
          std::vector<std::int64_t> shape{batch};
          shape.insert(shape.end(), c.shape.begin(), c.shape.end());
          kg::Tensor x = kg_test::random_tensor(rng, dt, shape, c.lo, c.hi);
          // The kernel sums the exponentials in the input's precision, the CPU in double.
          kg_test::check_lowering(
              [&](const std::vector<kg::SymTensor>& xs) {
                return std::vector<kg::SymTensor>{apply(xs[0], c.dim, log)};
              },
              {x}, dt == kg::DType::F32 ? 1e-5 : 1e-12, dt == kg::DType::F32 ? 1e-6 : 1e-12);
        }
      }
    }
  }
}

TEST(Softmax, GpuGridFollowsTheRowLayout) {
  if (!kg::compile::Compiler::available()) GTEST_SKIP() << "built without NVRTC";
  auto grid_of = [](std::vector<std::int64_t> shape, std::int64_t dim, bool log) {
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, kg::Shape::of(shape), "x");
    kg::Model model(g, {apply(x, dim, log)});
    auto dry = kg::lower::dry_run(model, {shape}, 90);
    const auto& step = dry.launches.steps.at(0);
    EXPECT_EQ(step.launches.at(0).entry, log ? "kg_log_softmax_f32" : "kg_softmax_f32");
    EXPECT_EQ(step.launches.at(0).launch.block.x, 256u);
    return step.launches.at(0).launch.grid.x;
  };
  EXPECT_EQ(grid_of({130, 37}, 1, false), 17u);           // 130 rows, 8 per block (a warp each)
  EXPECT_EQ(grid_of({130, 1024}, -1, true), 17u);         // still a warp per row
  EXPECT_EQ(grid_of({130, 1025}, 1, false), 130u);        // a block per row
  EXPECT_EQ(grid_of({130, 5, 600}, 1, true), 130u * 19);  // 600 columns in blocks of 32
  EXPECT_EQ(grid_of({130, 5, 3}, 1, false), 130u);        // 3 columns: one block of width 4
  EXPECT_EQ(grid_of({70, 9}, 0, false), 1u);              // 9 columns: one block of width 16
  EXPECT_EQ(grid_of({}, 0, false), 1u);                   // a scalar: one row of one
}
