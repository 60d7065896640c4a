#include "compile/compiler.hpp"
#include "lower/dry_run.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

// torch.matmul in double, written from its definition: 1-D operands are promoted to a row
// (A) or a column (B) and the added dim removed afterwards; leading dims broadcast.
kg::Tensor naive_matmul(const kg::Tensor& a, const kg::Tensor& b) {
  std::vector<std::int64_t> sa = a.shape(), sb = b.shape();
  const bool a_vec = sa.size() == 1, b_vec = sb.size() == 1;
  if (a_vec) sa.insert(sa.begin(), 1);
  if (b_vec) sb.push_back(1);
  const std::int64_t m = sa[sa.size() - 2], k = sa.back(), n = sb.back();
  std::vector<std::int64_t> ba(sa.begin(), sa.end() - 2), bb(sb.begin(), sb.end() - 2);
  const std::size_t r = std::max(ba.size(), bb.size());
  ba.insert(ba.begin(), r - ba.size(), 1);
  bb.insert(bb.begin(), r - bb.size(), 1);
  std::vector<std::int64_t> batch(r);
  for (std::size_t i = 0; i < r; ++i) batch[i] = std::max(ba[i], bb[i]);
  std::vector<std::int64_t> out_shape = batch;
  if (!a_vec) out_shape.push_back(m);
  if (!b_vec) out_shape.push_back(n);
  kg::Tensor y = kg::Tensor::empty(kg::DType::F64, out_shape);
  const std::int64_t batches = kg::numel_of(batch);
  for (std::int64_t idx = 0; idx < batches; ++idx) {
    // Multi-index of the output batch, then the flat batch index of each operand.
    std::vector<std::int64_t> c(r);
    for (std::int64_t rem = idx, i = static_cast<std::int64_t>(r) - 1; i >= 0; --i) {
      c[static_cast<std::size_t>(i)] = rem % batch[static_cast<std::size_t>(i)];
      rem /= batch[static_cast<std::size_t>(i)];
    }
    std::int64_t ia = 0, ib = 0;
    for (std::size_t i = 0; i < r; ++i) {
      ia = ia * ba[i] + (ba[i] == 1 ? 0 : c[i]);
      ib = ib * bb[i] + (bb[i] == 1 ? 0 : c[i]);
    }
    for (std::int64_t p = 0; p < m; ++p)
      for (std::int64_t q = 0; q < n; ++q) {
        double s = 0;
        for (std::int64_t t = 0; t < k; ++t) s += a.item((ia * m + p) * k + t) * b.item((ib * k + t) * n + q);
        y.data<double>()[(idx * m + p) * n + q] = s;
      }
  }
  return y;
}

kg::Shape shape_of(std::initializer_list<kg::Dim> d) { return kg::Shape(d); }

std::string matmul_shape(const kg::Shape& a, const kg::Shape& b) {
  auto g = kg::Graph::create();
  auto x = g->input(kg::DType::F32, a, "a");
  auto y = g->input(kg::DType::F32, b, "b");
  return kg::matmul(x, y, "mm").shape().to_string();
}

// Records a × b with the given symbolic shapes, loads it with poisoned buffers and runs it.
kg::Tensor run_matmul(const kg::Shape& sa, const kg::Shape& sb, const kg::Tensor& a, const kg::Tensor& b) {
  auto g = kg::Graph::create();
  auto x = g->input(a.dtype(), sa, "a");
  auto y = g->input(b.dtype(), sb, "b");
  kg::Model model(g, {kg::matmul(x, y, "mm")});
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  kg::LoadedModel m = model.load(kg::Device::cpu(), {a.shape(), b.shape()}, opt);
  kg::Tensor out = m.forward({a, b})[0];
  EXPECT_TRUE(kg_test::all_written(out)) << "the matmul left output elements unwritten";
  return out;
}

// The GPU lowering of a × b recorded with the given symbolic shapes: a dry run at sm_90 where
// NVRTC is present (returned), and where a GPU is present its output compared with the CPU's.
std::optional<kg::lower::DryRun> check_matmul_lowering(const kg::Shape& sa, const kg::Shape& sb,
                                                       const kg::Tensor& a, const kg::Tensor& b, double rtol,
                                                       double atol) {
  auto g = kg::Graph::create();
  auto x = g->input(a.dtype(), sa, "a");
  auto y = g->input(b.dtype(), sb, "b");
  kg::Model model(g, {kg::matmul(x, y, "mm")});
  std::optional<kg::lower::DryRun> dry;
  if (kg::compile::Compiler::available()) dry = kg::lower::dry_run(model, {a.shape(), b.shape()}, 90);
  if (!kg::Device::cuda_available()) return dry;
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  const kg::Tensor want = model.load(kg::Device::cpu(), {a.shape(), b.shape()}, opt).forward({a, b})[0];
  const kg::Tensor got = model.load(kg::Device::cuda(), {a.shape(), b.shape()}, opt).forward({a, b})[0];
  EXPECT_TRUE(kg_test::all_written(got)) << "the kernel left output elements unwritten";
  EXPECT_TRUE(kg_test::all_close(got, want, rtol, atol)) << "the GPU output differs from the CPU's";
  return dry;
}

}  // namespace

TEST(Matmul, ShapeInference) {
  const kg::Dim batch = kg::Dim::named("batch");
  EXPECT_EQ(matmul_shape(shape_of({3}), shape_of({3})), "[]");
  EXPECT_EQ(matmul_shape(shape_of({2, 3}), shape_of({3, 4})), "[2, 4]");
  EXPECT_EQ(matmul_shape(shape_of({3}), shape_of({3, 4})), "[4]");
  EXPECT_EQ(matmul_shape(shape_of({2, 3}), shape_of({3})), "[2]");
  EXPECT_EQ(matmul_shape(shape_of({batch, 2, 3}), shape_of({3, 4})), "[batch, 2, 4]");
  EXPECT_EQ(matmul_shape(shape_of({batch, 2, 3}), shape_of({batch, 3, 4})), "[batch, 2, 4]");
  EXPECT_EQ(matmul_shape(shape_of({5, 1, 2, 3}), shape_of({4, 3, 6})), "[5, 4, 2, 6]");
  EXPECT_EQ(matmul_shape(shape_of({1, 2, 3}), shape_of({batch, 3, 6})), "[batch, 2, 6]");
  EXPECT_EQ(matmul_shape(shape_of({3}), shape_of({batch, 3, 4})), "[batch, 4]");
  EXPECT_EQ(matmul_shape(shape_of({batch, 2, 3}), shape_of({3})), "[batch, 2]");
  EXPECT_EQ(matmul_shape(shape_of({batch, 3}), shape_of({3, kg::dynamic})), "[batch, ?]");
  // An unknown inner dim is accepted and checked at load.
  EXPECT_EQ(matmul_shape(shape_of({2, kg::dynamic}), shape_of({kg::dynamic, 4})), "[2, 4]");
}

TEST(Matmul, RejectsBadInputs) {
  auto g = kg::Graph::create();
  auto a = g->input(kg::DType::F32, {kg::dynamic, 2, 3}, "a");
  auto b = g->input(kg::DType::F32, {4, 5}, "b");
  kg_test::expect_error([&] { kg::matmul(a, b, "mm"); },
                        {"[nn.matmul @ mm]", "[?, 2, 3]", "[4, 5]", "inner dims 3 and 4 differ"});
  auto v = g->input(kg::DType::F32, {5}, "v");
  kg_test::expect_error([&] { kg::matmul(v, b, "mv"); }, {"[nn.matmul @ mv]", "[5]", "[4, 5]", "5 and 4"});
  auto s = g->input(kg::DType::F32, kg::Shape{}, "s");
  kg_test::expect_error([&] { kg::matmul(s, b, "ms"); }, {"[nn.matmul @ ms]", "rank >= 1", "[]"});
  auto c = g->input(kg::DType::F32, {2, 2, 3}, "c");
  auto d = g->input(kg::DType::F32, {3, 3, 4}, "d");
  kg_test::expect_error([&] { kg::matmul(c, d, "mb"); }, {"[nn.matmul @ mb]", "batch dims", "2 vs 3"});
  auto e = g->input(kg::DType::F64, {3, 4}, "e");
  kg_test::expect_error([&] { kg::matmul(a, e, "md"); }, {"[nn.matmul @ md]", "f32", "f64"});
  auto i = g->input(kg::DType::I32, {4, 4}, "i");
  kg_test::expect_error([&] { kg::matmul(i, i, "mi"); }, {"[nn.matmul @ mi]", "f32 and f64", "i32"});
  // Unknown inner dims that disagree at load.
  auto g2 = kg::Graph::create();
  auto p = g2->input(kg::DType::F32, {2, kg::dynamic}, "p");
  auto q = g2->input(kg::DType::F32, {kg::dynamic, 4}, "q");
  kg::Model model(g2, {kg::matmul(p, q, "mm")});
  kg_test::expect_error(
      [&] {
        model.load(kg::Device::cpu(), {{2, 3}, {5, 4}});
      },
      {"[nn.matmul @ mm]", "at load", "[2, 3]", "[5, 4]", "inner dims 3 and 5 differ"});
}

TEST(Matmul, MatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Dim B = kg::Dim::named("batch");
  for (std::int64_t batch : {1, 7, 64}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      struct Case {
        const char* what;
        kg::Shape sa, sb;
        std::vector<std::int64_t> a, b;
      };
      const Case cases[] = {
          {"batched, B per batch", {B, 5, 6}, {B, 6, 3}, {batch, 5, 6}, {batch, 6, 3}},
          {"batched, B shared", {B, 5, 6}, {6, 3}, {batch, 5, 6}, {6, 3}},
          {"2-D", {B, 6}, {6, 9}, {batch, 6}, {6, 9}},
          {"broadcast both", {B, 1, 5, 6}, {4, 6, 3}, {batch, 1, 5, 6}, {4, 6, 3}},
          {"A broadcast", {1, 5, 6}, {B, 6, 2}, {1, 5, 6}, {batch, 6, 2}},
          {"matrix × vector", {B, 6}, {6}, {batch, 6}, {6}},
          {"vector × matrix", {6}, {6, B}, {6}, {6, batch}},
          {"vector × batched", {6}, {B, 6, 4}, {6}, {batch, 6, 4}},
          {"batched × vector", {B, 3, 6}, {6}, {batch, 3, 6}, {6}},
          {"vector · vector", {B}, {B}, {batch}, {batch}},
          {"large, per batch", {B, 70, 80}, {B, 80, 65}, {batch, 70, 80}, {batch, 80, 65}},
          {"empty inner dim", {B, 4, 0}, {0, 3}, {batch, 4, 0}, {0, 3}},
      };
      for (const Case& c : cases) {
        if (batch == 64 && std::string(c.what).rfind("large", 0) == 0)
          continue;  // keeps the naive loop short
        SCOPED_TRACE(::testing::Message() << c.what << ", batch " << batch << " " << kg::dtype_name(dt));
        kg::Tensor a = kg_test::random_tensor(rng, dt, c.a);
        kg::Tensor b = kg_test::random_tensor(rng, dt, c.b);
        kg::Tensor y = run_matmul(c.sa, c.sb, a, b);
        EXPECT_TRUE(kg_test::all_close(y, naive_matmul(a, b), dt == kg::DType::F32 ? 1e-4 : 1e-12, 1e-5));
      }
    }
  }
}

TEST(Matmul, DynamicShapesPropagate) {
  auto g = kg::Graph::create();
  auto a = g->input(kg::DType::F32, {kg::Dim::named("n"), 1, kg::Dim::named("rows"), 8}, "a");
  auto b = g->input(kg::DType::F32, {3, 8, kg::dynamic}, "b");
  auto y = kg::matmul(a, b, "mm");
  EXPECT_EQ(y.shape().to_string(), "[n, 3, rows, ?]");
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  kg::Tensor ta = kg_test::random_tensor(rng, kg::DType::F32, {2, 1, 5, 8});
  kg::Tensor tb = kg_test::random_tensor(rng, kg::DType::F32, {3, 8, 4});
  kg::Tensor out = run_matmul(a.shape(), b.shape(), ta, tb);
  EXPECT_EQ(out.shape(), (std::vector<std::int64_t>{2, 3, 5, 4}));
  EXPECT_TRUE(kg_test::all_close(out, naive_matmul(ta, tb), 1e-4, 1e-5));
}

TEST(Matmul, GpuLoweringCompilesAndMatchesTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Dim B = kg::Dim::named("batch");
  auto tiles = [](std::int64_t v) { return static_cast<unsigned>((v + 63) / 64); };
  for (std::int64_t batch : {1, 7, 130}) {
    const auto nb = static_cast<unsigned>(batch);
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      struct Case {
        const char* what;
        kg::Shape sa, sb;
        std::vector<std::int64_t> a, b;
        std::array<unsigned, 3> grid;  // n tiles, m tiles, batch entries
      };
      const Case cases[] = {
          {"batched, B per batch", {B, 5, 6}, {B, 6, 3}, {batch, 5, 6}, {batch, 6, 3}, {1, 1, nb}},
          {"batched, B shared: one GEMM", {B, 5, 6}, {6, 3}, {batch, 5, 6}, {6, 3}, {1, tiles(5 * batch), 1}},
          {"2-D", {B, 6}, {6, 9}, {batch, 6}, {6, 9}, {1, tiles(batch), 1}},
          {"broadcast both", {B, 1, 5, 6}, {4, 6, 3}, {batch, 1, 5, 6}, {4, 6, 3}, {1, 1, 4 * nb}},
          {"A broadcast", {1, 5, 6}, {B, 6, 2}, {1, 5, 6}, {batch, 6, 2}, {1, 1, nb}},
          {"matrix × vector", {B, 6}, {6}, {batch, 6}, {6}, {1, tiles(batch), 1}},
          {"vector × matrix", {6}, {6, B}, {6}, {6, batch}, {tiles(batch), 1, 1}},
          {"vector × batched", {6}, {B, 6, 4}, {6}, {batch, 6, 4}, {1, 1, nb}},
          {"batched × vector", {B, 3, 6}, {6}, {batch, 3, 6}, {6}, {1, tiles(3 * batch), 1}},
          {"vector · vector", {B}, {B}, {batch}, {batch}, {1, 1, 1}},
          {"large, per batch", {B, 70, 80}, {B, 80, 65}, {batch, 70, 80}, {batch, 80, 65}, {2, 2, nb}},
          {"empty inner dim", {B, 4, 0}, {0, 3}, {batch, 4, 0}, {0, 3}, {1, tiles(4 * batch), 1}},
          {"alternating broadcast levels",
           {B, 1, 3, 1, 5, 6},
           {1, 4, 1, 2, 6, 3},
           {batch, 1, 3, 1, 5, 6},
           {1, 4, 1, 2, 6, 3},
           {1, 1, 24 * nb}},
          {"B's batch dims all 1",
           {B, 2, 5, 6},
           {1, 1, 6, 3},
           {batch, 2, 5, 6},
           {1, 1, 6, 3},
           {1, 1, 2 * nb}},
      };
      for (const Case& c : cases) {
        SCOPED_TRACE(::testing::Message() << c.what << ", batch " << batch << " " << kg::dtype_name(dt));
        kg::Tensor a = kg_test::random_tensor(rng, dt, c.a);
        kg::Tensor b = kg_test::random_tensor(rng, dt, c.b);
        // The tiled GEMM sums k in another order than the BLAS: f32 needs rtol 1e-4.
        auto dry = check_matmul_lowering(c.sa, c.sb, a, b, dt == kg::DType::F32 ? 1e-4 : 1e-12, 1e-5);
        if (!dry) continue;
        const auto& step = dry->launches.steps.at(0);
        EXPECT_EQ(step.launches.at(0).entry, dt == kg::DType::F32 ? "kg_matmul_f32" : "kg_matmul_f64");
        const kg::Dim3 g = step.launches.at(0).launch.grid;
        EXPECT_EQ((std::array<unsigned, 3>{g.x, g.y, g.z}), c.grid);
      }
    }
  }
}

TEST(Matmul, GpuLoopsOverGridLimits) {
  // More batch entries than grid.z and more row tiles than grid.y can hold (65535 each): the
  // kernel loops over the rest.
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const bool gpu = kg::Device::cuda_available();
  // Without a GPU only the shapes matter (dry run): leave the big operands unfilled.
  auto operand = [&](std::vector<std::int64_t> shape) {
    return gpu ? kg_test::random_tensor(rng, kg::DType::F32, std::move(shape))
               : kg::Tensor::empty(kg::DType::F32, std::move(shape));
  };
  const std::int64_t batches = 70000, rows = 65535 * 64 + 300;
  auto many = check_matmul_lowering({batches, 3, 2}, {batches, 2, 5}, operand({batches, 3, 2}),
                                    operand({batches, 2, 5}), 1e-4, 1e-5);
  auto tall = check_matmul_lowering({rows, 2}, {2, 3}, operand({rows, 2}), operand({2, 3}), 1e-4, 1e-5);
  if (!many || !tall) return;
  const kg::Dim3 gm = many->launches.steps.at(0).launches.at(0).launch.grid;
  EXPECT_EQ((std::array<unsigned, 3>{gm.x, gm.y, gm.z}), (std::array<unsigned, 3>{1, 1, 65535}));
  const kg::Dim3 gt = tall->launches.steps.at(0).launches.at(0).launch.grid;
  EXPECT_EQ((std::array<unsigned, 3>{gt.x, gt.y, gt.z}), (std::array<unsigned, 3>{1, 65535, 1}));
}

TEST(Matmul, GpuRejectsTooManyBroadcastLevels) {
  if (!kg::compile::Compiler::available()) GTEST_SKIP() << "built without NVRTC";
  // Nine dims broadcast from A alternating with nine from B cannot be merged into fewer levels.
  std::vector<std::int64_t> sa, sb;
  for (int i = 0; i < 9; ++i) {
    sa.insert(sa.end(), {2, 1});
    sb.insert(sb.end(), {1, 2});
  }
  sa.insert(sa.end(), {1, 3});
  sb.insert(sb.end(), {3, 1});
  auto g = kg::Graph::create();
  auto x = g->input(kg::DType::F32, kg::Shape::of(sa), "a");
  auto y = g->input(kg::DType::F32, kg::Shape::of(sb), "b");
  kg::Model model(g, {kg::matmul(x, y, "mm")});
  kg_test::expect_error(
      [&] {
        kg::lower::dry_run(model, {sa, sb}, 90);
      },
      {"nn.matmul", kg::sizes_to_string(sa), kg::sizes_to_string(sb), "18 broadcast batch levels",
       "handles 8"});
}
