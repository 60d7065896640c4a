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
