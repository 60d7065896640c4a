#include <cmath>
#include <set>

#include "compile/compiler.hpp"
#include "compile/embedded_sources.hpp"
#include "compile/ptx.hpp"
#include "lower/dry_run.hpp"
#include "ops/elementwise.hpp"
#include "support/gpu_util.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

using Build = std::function<kg::SymTensor(const std::vector<kg::SymTensor>&)>;

// Records `build` over inputs with the given symbolic shapes, loads it for the tensors' own
// shapes with poisoned buffers, runs it and checks that every output element was written.
kg::Tensor run_sym(const Build& build, const std::vector<kg::Shape>& sym,
                   const std::vector<kg::Tensor>& inputs) {
  auto g = kg::Graph::create();
  std::vector<kg::SymTensor> xs;
  std::vector<std::vector<std::int64_t>> shapes;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    xs.push_back(g->input(inputs[i].dtype(), sym[i], "x" + std::to_string(i)));
    shapes.push_back(inputs[i].shape());
  }
  kg::Model model(g, std::vector<kg::SymTensor>{build(xs)});
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  kg::Tensor out = model.load(kg::Device::cpu(), shapes, opt).forward(inputs)[0];
  EXPECT_TRUE(kg_test::all_written(out)) << "the op left output elements unwritten";
  return out;
}

// Uniform magnitudes in [0.5, 1.5] with random signs: safe divisors.
kg::Tensor away_from_zero(std::mt19937_64& rng, kg::DType dt, std::vector<std::int64_t> shape) {
  kg::Tensor t = kg_test::random_tensor(rng, kg::DType::F64, std::move(shape), 0.5, 1.5);
  std::bernoulli_distribution coin(0.5);
  for (std::int64_t i = 0; i < t.numel(); ++i)
    if (coin(rng)) t.data<double>()[i] = -t.data<double>()[i];
  return t.to(dt);
}

kg::Tensor naive_unary(const kg::Tensor& x, const std::function<double(double)>& f) {
  kg::Tensor y = kg::Tensor::empty(kg::DType::F64, x.shape());
  for (std::int64_t i = 0; i < x.numel(); ++i) y.data<double>()[i] = f(x.item(i));
  return y;
}

// numpy broadcasting, one output element at a time: unravel the output index, then read each
// operand at that index with broadcast dims pinned to 0.
kg::Tensor naive_binary(const kg::Tensor& a, const kg::Tensor& b,
                        const std::function<double(double, double)>& f) {
  const std::size_t rank = std::max(a.rank(), b.rank());
  auto aligned = [&](const kg::Tensor& t) {
    std::vector<std::int64_t> s(rank - t.rank(), 1);
    s.insert(s.end(), t.shape().begin(), t.shape().end());
    return s;
  };
  const std::vector<std::int64_t> as = aligned(a), bs = aligned(b);
  std::vector<std::int64_t> out(rank);
  for (std::size_t d = 0; d < rank; ++d) out[d] = std::max(as[d], bs[d]);
  kg::Tensor y = kg::Tensor::empty(kg::DType::F64, out);
  std::vector<std::int64_t> idx(rank);
  for (std::int64_t o = 0; o < y.numel(); ++o) {
    std::int64_t r = o;
    for (std::size_t d = rank; d-- > 0;) {
      idx[d] = r % out[d];
      r /= out[d];
    }
    std::int64_t ia = 0, ib = 0;
    for (std::size_t d = 0; d < rank; ++d) {
      ia = ia * as[d] + (as[d] == 1 ? 0 : idx[d]);
      ib = ib * bs[d] + (bs[d] == 1 ? 0 : idx[d]);
    }
    y.data<double>()[o] = f(a.item(ia), b.item(ib));
  }
  return y;
}

double tol_r(kg::DType dt) { return dt == kg::DType::F32 ? 1e-5 : 1e-12; }
double tol_a(kg::DType dt) { return dt == kg::DType::F32 ? 1e-6 : 1e-14; }

// Symbolic shape from sizes where -1 is the dynamic "batch" dim; concrete with batch = n.
kg::Shape sym_shape(const std::vector<std::int64_t>& s) {
  kg::Shape out;
  for (auto v : s) out.push_back(v < 0 ? kg::Dim::named("batch") : kg::Dim(v));
  return out;
}
std::vector<std::int64_t> concrete(std::vector<std::int64_t> s, std::int64_t batch) {
  for (auto& v : s)
    if (v < 0) v = batch;
  return s;
}

struct BinaryCase {
  const char* name;
  std::function<kg::SymTensor(const kg::SymTensor&, const kg::SymTensor&)> build;
  std::function<double(double, double)> ref;
  const char* op_name;
};

std::vector<BinaryCase> binary_cases() {
  return {
      {"add", [](auto& a, auto& b) { return kg::add(a, b); }, [](double a, double b) { return a + b; },
       "nn.add"},
      {"sub", [](auto& a, auto& b) { return kg::sub(a, b); }, [](double a, double b) { return a - b; },
       "nn.sub"},
      {"mul", [](auto& a, auto& b) { return kg::mul(a, b); }, [](double a, double b) { return a * b; },
       "nn.mul"},
      {"div", [](auto& a, auto& b) { return kg::div(a, b); }, [](double a, double b) { return a / b; },
       "nn.div"},
      {"a+b", [](auto& a, auto& b) { return a + b; }, [](double a, double b) { return a + b; }, "nn.add"},
      {"a-b", [](auto& a, auto& b) { return a - b; }, [](double a, double b) { return a - b; }, "nn.sub"},
      {"a*b", [](auto& a, auto& b) { return a * b; }, [](double a, double b) { return a * b; }, "nn.mul"},
      {"a/b", [](auto& a, auto& b) { return a / b; }, [](double a, double b) { return a / b; }, "nn.div"},
  };
}

}  // namespace

// ---- shape and dtype inference ----

TEST(ElementwiseShape, UnaryKeepsShapeAndDtype) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F64, {kg::Dim::named("batch"), 3, kg::dynamic, 5});
  std::vector<kg::SymTensor> ys = {kg::relu(x),
                                   kg::leaky_relu(x, 0.2),
                                   kg::silu(x),
                                   kg::gelu(x),
                                   kg::gelu(x, kg::GeluApprox::Tanh),
                                   kg::sigmoid(x),
                                   kg::tanh(x),
                                   kg::dropout(x, 0.3),
                                   x + 1.0,
                                   2.0 / x,
                                   kg::rsub(x, 3.0)};
  for (const auto& y : ys) {
    EXPECT_EQ(y.shape().to_string(), "[batch, 3, ?, 5]") << g->node(y.node()).op_name();
    EXPECT_EQ(y.dtype(), kg::DType::F64) << g->node(y.node()).op_name();
  }
}

TEST(ElementwiseShape, OpNamesAndAttributes) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 4});
  auto op = [&](const kg::SymTensor& t) { return g->node(t.node()).op_name(); };
  auto attrs = [&](const kg::SymTensor& t) { return (*g->node(t.node()).op)->attributes(); };
  EXPECT_EQ(op(kg::relu(x)), "nn.relu");
  auto lr = kg::leaky_relu(x, 0.2);
  EXPECT_EQ(op(lr), "nn.leaky_relu");
  EXPECT_EQ(attrs(lr), "negative_slope=0.2");
  EXPECT_EQ(op(kg::silu(x)), "nn.silu");
  EXPECT_EQ(attrs(kg::gelu(x)), "approximate=none");
  auto gt = kg::gelu(x, kg::GeluApprox::Tanh);
  EXPECT_EQ(op(gt), "nn.gelu");
  EXPECT_EQ(attrs(gt), "approximate=tanh");
  EXPECT_EQ(op(kg::sigmoid(x)), "nn.sigmoid");
  EXPECT_EQ(op(kg::tanh(x)), "nn.tanh");
  auto d = kg::dropout(x, 0.25, "drop");
  EXPECT_EQ(op(d), "nn.dropout");
  EXPECT_EQ(attrs(d), "p=0.25");
  EXPECT_EQ(d.name(), "drop");
  // Scalar forms are one op kind each with the scalar as an attribute.
  auto s = x + 2.5;
  EXPECT_EQ(op(s), "nn.add_scalar");
  EXPECT_EQ(attrs(s), "scalar=2.5");
  EXPECT_EQ(op(2.5 + x), "nn.add_scalar");
  EXPECT_EQ(op(x - 1.0), "nn.sub_scalar");
  EXPECT_EQ(op(1.0 - x), "nn.rsub_scalar");
  EXPECT_EQ(op(x * 0.1), "nn.mul_scalar");
  EXPECT_EQ(attrs(x * 2), "scalar=2");  // an integer literal is a scalar too
  EXPECT_EQ(attrs(x * 0.1), "scalar=0.1");
  EXPECT_EQ(op(3.0 * x), "nn.mul_scalar");
  EXPECT_EQ(op(x / 4.0), "nn.div_scalar");
  auto rd = 4.0 / x;
  EXPECT_EQ(op(rd), "nn.rdiv_scalar");
  EXPECT_EQ(attrs(rd), "scalar=4");
  EXPECT_EQ(op(x + x), "nn.add");
  EXPECT_EQ(op(x - x), "nn.sub");
  EXPECT_EQ(op(x * x), "nn.mul");
  EXPECT_EQ(op(x / x), "nn.div");
}

TEST(ElementwiseShape, Broadcasting) {
  auto g = kg::Graph::create();
  auto nchw = g->input(kg::DType::F32, {kg::Dim::named("batch"), 8, kg::dynamic, 7}, "nchw");
  auto chan = g->input(kg::DType::F32, {8, 1, 1}, "chan");
  auto col = g->input(kg::DType::F32, {kg::Dim::named("batch"), 1}, "col");
  auto row = g->input(kg::DType::F32, {1, 6}, "row");
  auto bias = g->input(kg::DType::F32, {7}, "bias");
  auto anon = g->input(kg::DType::F32, {kg::dynamic, 7}, "anon");
  auto four = g->input(kg::DType::F32, {4, 7}, "four");
  auto one = g->input(kg::DType::F32, {1, 7}, "one");
  auto scalar = g->input(kg::DType::F32, {}, "scalar");
  EXPECT_EQ((nchw + chan).shape().to_string(), "[batch, 8, ?, 7]");
  EXPECT_EQ((chan * nchw).shape().to_string(), "[batch, 8, ?, 7]");
  EXPECT_EQ((col * row).shape().to_string(), "[batch, 6]");
  EXPECT_EQ((nchw - bias).shape().to_string(), "[batch, 8, ?, 7]");
  EXPECT_EQ((nchw / scalar).shape().to_string(), "[batch, 8, ?, 7]");
  EXPECT_EQ((scalar + scalar).shape().to_string(), "[]");
  // A dynamic dim against 1 stays dynamic; against a known size it takes that size.
  EXPECT_EQ((anon + one).shape().to_string(), "[?, 7]");
  EXPECT_EQ((one + anon).shape().to_string(), "[?, 7]");
  EXPECT_EQ((anon + four).shape().to_string(), "[4, 7]");
  EXPECT_EQ((four + anon).shape().to_string(), "[4, 7]");
  EXPECT_EQ((col + nchw).shape().to_string(), "[batch, 8, batch, 7]");
}

TEST(ElementwiseShape, RejectsShapesThatDoNotBroadcast) {
  auto g = kg::Graph::create();
  auto a = g->input(kg::DType::F32, {kg::Dim::named("batch"), 3}, "a");
  auto b = g->input(kg::DType::F32, {4}, "b");
  auto c = g->input(kg::DType::F32, {2, 5, 3}, "c");
  auto d = g->input(kg::DType::F32, {5, 1, 4}, "d");
  kg_test::expect_error([&] { kg::add(a, b, "sum"); }, {"[nn.add @ sum]", "[batch, 3]", "[4]", "3 vs 4"});
  kg_test::expect_error([&] { kg::div(b, a, "ratio"); }, {"[nn.div @ ratio]", "[4]", "[batch, 3]", "4 vs 3"});
  kg_test::expect_error([&] { kg::mul(c, d, "prod"); },
                        {"[nn.mul @ prod]", "[2, 5, 3]", "[5, 1, 4]", "2 vs 5"});
  kg_test::expect_error([&] { (void)(c - d); }, {"[nn.sub @ sub]", "[2, 5, 3]", "[5, 1, 4]"});
}

TEST(ElementwiseShape, RejectsMismatchAtLoad) {
  // [batch, 3] + [4, 3] records as [4, 3]; batch must then be 4 or 1.
  auto g = kg::Graph::create();
  auto a = g->input(kg::DType::F64, {kg::Dim::named("batch"), 3}, "a");
  auto b = g->input(kg::DType::F64, {4, 3}, "b");
  auto y = kg::add(a, b, "sum");
  EXPECT_EQ(y.shape().to_string(), "[4, 3]");
  kg::Model model(g, std::vector<kg::SymTensor>{y});
  kg_test::expect_error(
      [&] {
        model.load(kg::Device::cpu(), {{5, 3}, {4, 3}});
      },
      {"[nn.add @ sum]", "at load", "[5, 3]", "[4, 3]", "5 vs 4"});
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t batch : {1, 4}) {
    kg::Tensor ta = kg_test::random_tensor(rng, kg::DType::F64, {batch, 3});
    kg::Tensor tb = kg_test::random_tensor(rng, kg::DType::F64, {4, 3});
    kg::Tensor got = run_sym([](const auto& xs) { return xs[0] + xs[1]; }, {a.shape(), b.shape()}, {ta, tb});
    EXPECT_TRUE(kg_test::all_close(got, naive_binary(ta, tb, std::plus<>()), 1e-14, 1e-15));
  }
}

TEST(ElementwiseShape, RejectsBadDtypes) {
  auto g = kg::Graph::create();
  auto f = g->input(kg::DType::F32, {kg::dynamic, 3}, "f");
  auto d = g->input(kg::DType::F64, {kg::dynamic, 3}, "d");
  auto i = g->input(kg::DType::I32, {kg::dynamic, 3}, "i");
  kg_test::expect_error([&] { kg::mul(f, d, "prod"); }, {"[nn.mul @ prod]", "share one dtype", "f32", "f64"});
  kg_test::expect_error([&] { kg::add(d, f, "sum"); }, {"[nn.add @ sum]", "share one dtype", "f64", "f32"});
  kg_test::expect_error([&] { kg::relu(i, "act"); }, {"[nn.relu @ act]", "f32 and f64", "i32"});
  kg_test::expect_error([&] { kg::gelu(i, kg::GeluApprox::Tanh, "g"); }, {"[nn.gelu @ g]", "i32"});
  kg_test::expect_error([&] { kg::dropout(i, 0.5, "drop"); }, {"[nn.dropout @ drop]", "i32"});
  kg_test::expect_error([&] { kg::mul(i, 2.0, "scale"); }, {"[nn.mul_scalar @ scale]", "i32"});
  kg_test::expect_error([&] { kg::sub(i, f, "diff"); }, {"[nn.sub @ diff]", "i32"});
}

TEST(ElementwiseShape, RejectsBadParameters) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 3});
  kg_test::expect_error([&] { kg::dropout(x, 1.0, "drop"); },
                        {"[nn.dropout @ drop]", "p must be in [0, 1)", "1"});
  kg_test::expect_error([&] { kg::dropout(x, -0.1, "drop"); }, {"[nn.dropout @ drop]", "-0.1"});
  kg_test::expect_error([&] { kg::dropout(x, std::nan(""), "drop"); }, {"[nn.dropout @ drop]", "nan"});
  kg_test::expect_error([&] { kg::leaky_relu(x, INFINITY, "act"); },
                        {"[nn.leaky_relu @ act]", "negative_slope must be finite", "inf"});
}

// ---- numerics ----

TEST(ElementwiseUnary, MatchesNaiveReferenceAtSeveralBatches) {
  struct Case {
    const char* name;
    std::function<kg::SymTensor(const kg::SymTensor&)> build;
    std::function<double(double)> ref;
  };
  // References use formulas other than the implementation's where one exists.
  auto sigmoid = [](double v) { return 0.5 * (1.0 + std::tanh(0.5 * v)); };
  const std::vector<Case> cases = {
      {"relu", [](auto& t) { return kg::relu(t); }, [](double v) { return std::max(v, 0.0); }},
      {"leaky_relu", [](auto& t) { return kg::leaky_relu(t); },
       [](double v) { return v >= 0 ? v : 0.01 * v; }},
      {"leaky_relu(0.3)", [](auto& t) { return kg::leaky_relu(t, 0.3); },
       [](double v) { return v >= 0 ? v : 0.3 * v; }},
      {"silu", [](auto& t) { return kg::silu(t); }, [&](double v) { return v * sigmoid(v); }},
      // GELU's textbook forms in long double, whose 64-bit mantissa absorbs the cancellation
      // in 1 + erf and 1 + tanh for negative x.
      {"gelu", [](auto& t) { return kg::gelu(t); },
       [](double v) {
         const long double x = v;
         return static_cast<double>(0.5L * x * (1.0L + std::erf(x / std::sqrt(2.0L))));
       }},
      {"gelu_tanh", [](auto& t) { return kg::gelu(t, kg::GeluApprox::Tanh); },
       [](double v) {
         const long double x = v, pi = std::acos(-1.0L);
         return static_cast<double>(0.5L * x *
                                    (1.0L + std::tanh(std::sqrt(2.0L / pi) * (x + 0.044715L * x * x * x))));
       }},
      {"sigmoid", [](auto& t) { return kg::sigmoid(t); }, sigmoid},
      {"tanh", [](auto& t) { return kg::tanh(t); },
       [](double v) {
         const double e = std::expm1(2.0 * v);
         return e / (e + 2.0);
       }},
  };
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& c : cases) {
    for (std::int64_t batch : {1, 7, 64}) {
      for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
        SCOPED_TRACE(std::string(c.name) + " batch " + std::to_string(batch) + " " +
                     std::string(kg::dtype_name(dt)));
        kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, 3, 700}, -6.0, 6.0);
        kg::Tensor y = kg_test::run_op(c.build, x);
        EXPECT_EQ(y.dtype(), dt);
        EXPECT_TRUE(kg_test::all_close(y, naive_unary(x, c.ref), tol_r(dt), tol_a(dt)));
      }
    }
  }
}

TEST(ElementwiseUnary, PropagatesNaNAndHandlesTails) {
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
    SCOPED_TRACE(std::string(kg::dtype_name(dt)));
    kg::Tensor x = kg::Tensor::from_vector<double>({1, 5}, {std::nan(""), -1000.0, 1000.0, -0.0, 0.0}).to(dt);
    auto run = [&](const std::function<kg::SymTensor(const kg::SymTensor&)>& b) {
      return kg_test::run_graph([&](const auto& xs) { return std::vector<kg::SymTensor>{b(xs[0])}; }, {x}, {},
                                true, false)[0];
    };
    struct Tail {
      kg::SymTensor (*build)(const kg::SymTensor&);
      double at_minus_1000;
    };
    const Tail tails[] = {
        {+[](const kg::SymTensor& t) { return kg::relu(t); }, 0.0},
        {+[](const kg::SymTensor& t) { return kg::leaky_relu(t); }, -10.0},
        {+[](const kg::SymTensor& t) { return kg::silu(t); }, 0.0},
        {+[](const kg::SymTensor& t) { return kg::gelu(t); }, 0.0},
        {+[](const kg::SymTensor& t) { return kg::gelu(t, kg::GeluApprox::Tanh); }, 0.0},
    };
    for (const Tail& tail : tails) {
      kg::Tensor y = run(tail.build);
      EXPECT_TRUE(std::isnan(y.item(0)));
      EXPECT_EQ(y.item(1), tail.at_minus_1000);
      EXPECT_EQ(y.item(2), 1000.0);
      EXPECT_EQ(y.item(3), 0.0);
      EXPECT_EQ(y.item(4), 0.0);
    }
    kg::Tensor s = run([](const kg::SymTensor& t) { return kg::sigmoid(t); });
    EXPECT_TRUE(std::isnan(s.item(0)));
    EXPECT_EQ(s.item(1), 0.0);
    EXPECT_EQ(s.item(2), 1.0);
    kg::Tensor t = run([](const kg::SymTensor& v) { return kg::tanh(v); });
    EXPECT_TRUE(std::isnan(t.item(0)));
    EXPECT_EQ(t.item(1), -1.0);
    EXPECT_EQ(t.item(2), 1.0);
  }
}

// The f32 activations use polynomial forms of exp, erfc and tanh; measure them in units in
// the last place against the double-precision library over dense grids.
TEST(ElementwiseUnary, FloatMathIsAccurate) {
  auto ulps = [](float got, double want) {
    const float w = static_cast<float>(want);
    const double ulp = std::nextafter(std::abs(w), INFINITY) - std::abs(w);
    return std::abs(static_cast<double>(got) - want) / ulp;
  };
  struct Fn {
    const char* name;
    float (*f32)(float);
    double (*f64)(double);
    float lo, hi;
    double max_ulps;
  };
  const Fn fns[] = {
      {"exp", kg::ops::exp_f32, [](double v) { return std::exp(v); }, -87.3f, 88.7f, 1.5},
      {"tanh", kg::ops::tanh_f32, [](double v) { return std::tanh(v); }, -12.0f, 12.0f, 2.0},
      {"erfc", kg::ops::erfc_f32, [](double v) { return std::erfc(v); }, -5.0f, 9.1f, 5.0},
  };
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const Fn& fn : fns) {
    SCOPED_TRACE(fn.name);
    std::uniform_real_distribution<float> u(fn.lo, fn.hi);
    std::vector<float> xs;
    for (int i = 0; i < 200000; ++i) xs.push_back(u(rng));
    for (float m = 1e-7f; m < 1.0f; m *= 1.01f) xs.insert(xs.end(), {m, -m});
    double worst = 0;
    float at = 0;
    for (float x : xs) {
      const double e = ulps(fn.f32(x), fn.f64(static_cast<double>(x)));
      if (!(e <= worst)) worst = e, at = x;
    }
    EXPECT_LE(worst, fn.max_ulps) << "at x = " << at;
  }
  const float inf = INFINITY;
  EXPECT_EQ(kg::ops::exp_f32(100.0f), inf);
  EXPECT_EQ(kg::ops::exp_f32(-100.0f), 0.0f);
  EXPECT_EQ(kg::ops::exp_f32(-inf), 0.0f);
  EXPECT_EQ(kg::ops::exp_f32(0.0f), 1.0f);
  EXPECT_TRUE(std::isnan(kg::ops::exp_f32(NAN)));
  EXPECT_EQ(kg::ops::tanh_f32(inf), 1.0f);
  EXPECT_EQ(kg::ops::tanh_f32(-inf), -1.0f);
  EXPECT_TRUE(std::signbit(kg::ops::tanh_f32(-0.0f)));
  EXPECT_TRUE(std::isnan(kg::ops::tanh_f32(NAN)));
  EXPECT_EQ(kg::ops::erfc_f32(inf), 0.0f);
  EXPECT_EQ(kg::ops::erfc_f32(-inf), 2.0f);
  EXPECT_EQ(kg::ops::erfc_f32(0.0f), 1.0f);
  EXPECT_TRUE(std::isnan(kg::ops::erfc_f32(NAN)));
}

TEST(ElementwiseUnary, SpecAndApplyForFusion) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 4});
  auto spec = [&](const kg::SymTensor& t) { return kg::ops::unary_spec((*g->node(t.node()).op).op()); };
  ASSERT_TRUE(spec(kg::relu(x)).has_value());
  EXPECT_EQ(spec(kg::relu(x))->fn, kg::ops::UnaryFn::Relu);
  auto lr = spec(kg::leaky_relu(x, 0.125));
  ASSERT_TRUE(lr.has_value());
  EXPECT_EQ(lr->fn, kg::ops::UnaryFn::LeakyRelu);
  EXPECT_EQ(lr->param, 0.125);
  EXPECT_EQ(spec(kg::gelu(x, kg::GeluApprox::Tanh))->fn, kg::ops::UnaryFn::GeluTanh);
  EXPECT_EQ(spec(kg::gelu(x))->fn, kg::ops::UnaryFn::GeluErf);
  EXPECT_EQ(spec(kg::silu(x))->fn, kg::ops::UnaryFn::Silu);
  EXPECT_EQ(spec(kg::sigmoid(x))->fn, kg::ops::UnaryFn::Sigmoid);
  EXPECT_EQ(spec(kg::tanh(x))->fn, kg::ops::UnaryFn::Tanh);
  EXPECT_FALSE(spec(x + x).has_value());
  EXPECT_FALSE(spec(x * 2.0).has_value());
  EXPECT_FALSE(spec(kg::dropout(x, 0.1)).has_value());

  // apply_unary in place gives what the graph op gives.
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  kg::Tensor in = kg_test::random_tensor(rng, kg::DType::F64, {3, 100}, -4.0, 4.0);
  kg::Tensor want = kg_test::run_op([](const kg::SymTensor& t) { return kg::leaky_relu(t, 0.125); }, in);
  kg::Tensor got = in.clone();
  kg::ops::apply_unary<double>(*lr, got.data<double>(), got.data<double>(), got.numel());
  EXPECT_TRUE(kg_test::all_close(got, want, 0.0, 1e-300));
  kg::Tensor inf = in.to(kg::DType::F32), outf = kg::Tensor::empty(kg::DType::F32, {3, 100});
  kg::ops::apply_unary<float>({kg::ops::UnaryFn::Sigmoid, 0.0}, inf.data<float>(), outf.data<float>(), 300);
  EXPECT_TRUE(kg_test::all_close(outf, naive_unary(inf, [](double v) { return 1.0 / (1.0 + std::exp(-v)); }),
                                 1e-5, 1e-6));
}

TEST(ElementwiseBinary, BroadcastPatternsMatchNaiveReference) {
  struct Pattern {
    const char* name;
    std::vector<std::int64_t> a, b;  // -1: the dynamic batch dim
  };
  const std::vector<Pattern> patterns = {
      {"same shape", {-1, 5, 33}, {-1, 5, 33}},
      {"per-channel [N,C,H,W] + [C,1,1]", {-1, 8, 20, 41}, {8, 1, 1}},
      {"[C,1,1] + [N,C,H,W]", {8, 1, 1}, {-1, 8, 5, 3}},
      {"outer [N,1] * [1,M]", {-1, 1}, {1, 300}},
      {"bias [N,T,C] + [C]", {-1, 3, 70}, {70}},
      {"scalar tensor on the right", {-1, 3, 50}, {1}},
      {"scalar tensor on the left", {1, 1}, {-1, 60}},
      {"rank-0 tensor", {-1, 4}, {}},
      {"both broadcast", {3, 1, 5}, {-1, 1, 4, 1}},
      {"middle dim", {-1, 1, 6}, {-1, 5, 6}},
      {"dynamic against 1", {-1, 7}, {1, 7}},
  };
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& p : patterns) {
    for (const auto& c : binary_cases()) {
      for (std::int64_t batch : {1, 7, 64}) {
        for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
          SCOPED_TRACE(std::string(p.name) + ": " + c.name + " batch " + std::to_string(batch) + " " +
                       std::string(kg::dtype_name(dt)));
          kg::Tensor a = kg_test::random_tensor(rng, dt, concrete(p.a, batch));
          kg::Tensor b = away_from_zero(rng, dt, concrete(p.b, batch));
          std::string op_name;
          kg::Tensor y = run_sym(
              [&](const auto& xs) {
                auto out = c.build(xs[0], xs[1]);
                op_name = out.graph().node(out.node()).op_name();
                return out;
              },
              {sym_shape(p.a), sym_shape(p.b)}, {a, b});
          EXPECT_EQ(op_name, c.op_name);
          EXPECT_EQ(y.dtype(), dt);
          // Each output element is one rounding of the exact result of its inputs.
          EXPECT_TRUE(kg_test::all_close(y, naive_binary(a, b, c.ref), dt == kg::DType::F32 ? 1e-6 : 1e-15,
                                         dt == kg::DType::F32 ? 1e-7 : 1e-16));
        }
      }
    }
  }
}

TEST(ElementwiseBinary, LargeTensorsSplitAcrossThreads) {
  // Odd element counts, so the parallel loop's chunks start in the middle of broadcast rows.
  struct Big {
    std::vector<std::int64_t> a, b;
  };
  const std::vector<Big> bigs = {{{3, 15, 97, 83}, {15, 1, 83}}, {{5, 7, 1009}, {7, 1}}, {{9, 4001}, {9, 1}}};
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& big : bigs) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      SCOPED_TRACE(kg::sizes_to_string(big.a) + " * " + kg::sizes_to_string(big.b) + " " +
                   std::string(kg::dtype_name(dt)));
      kg::Tensor a = kg_test::random_tensor(rng, dt, big.a);
      kg::Tensor b = kg_test::random_tensor(rng, dt, big.b);
      kg::Shape sa = kg::Shape::of(big.a);
      sa[0] = kg::Dim::named("batch");
      kg::Tensor y =
          run_sym([](const auto& xs) { return xs[0] * xs[1]; }, {sa, kg::Shape::of(big.b)}, {a, b});
      EXPECT_TRUE(kg_test::all_close(y, naive_binary(a, b, std::multiplies<>()), 1e-6, 1e-7));
    }
  }
}

TEST(ElementwiseBinary, ScalarFormsAndOperators) {
  struct Case {
    const char* name;
    std::function<kg::SymTensor(const kg::SymTensor&, double)> build;
    std::function<double(double, double)> ref;  // (x, s)
    const char* op_name;
  };
  const std::vector<Case> cases = {
      {"add", [](auto& t, double s) { return kg::add(t, s); }, [](double x, double s) { return x + s; },
       "nn.add_scalar"},
      {"x+s", [](auto& t, double s) { return t + s; }, [](double x, double s) { return x + s; },
       "nn.add_scalar"},
      {"s+x", [](auto& t, double s) { return s + t; }, [](double x, double s) { return s + x; },
       "nn.add_scalar"},
      {"sub", [](auto& t, double s) { return kg::sub(t, s); }, [](double x, double s) { return x - s; },
       "nn.sub_scalar"},
      {"x-s", [](auto& t, double s) { return t - s; }, [](double x, double s) { return x - s; },
       "nn.sub_scalar"},
      {"rsub", [](auto& t, double s) { return kg::rsub(t, s); }, [](double x, double s) { return s - x; },
       "nn.rsub_scalar"},
      {"s-x", [](auto& t, double s) { return s - t; }, [](double x, double s) { return s - x; },
       "nn.rsub_scalar"},
      {"mul", [](auto& t, double s) { return kg::mul(t, s); }, [](double x, double s) { return x * s; },
       "nn.mul_scalar"},
      {"x*s", [](auto& t, double s) { return t * s; }, [](double x, double s) { return x * s; },
       "nn.mul_scalar"},
      {"s*x", [](auto& t, double s) { return s * t; }, [](double x, double s) { return s * x; },
       "nn.mul_scalar"},
      {"div", [](auto& t, double s) { return kg::div(t, s); }, [](double x, double s) { return x / s; },
       "nn.div_scalar"},
      {"x/s", [](auto& t, double s) { return t / s; }, [](double x, double s) { return x / s; },
       "nn.div_scalar"},
      {"rdiv", [](auto& t, double s) { return kg::rdiv(t, s); }, [](double x, double s) { return s / x; },
       "nn.rdiv_scalar"},
      {"s/x", [](auto& t, double s) { return s / t; }, [](double x, double s) { return s / x; },
       "nn.rdiv_scalar"},
  };
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> scalar(-3.0, 3.0);
  for (const auto& c : cases) {
    for (std::int64_t batch : {1, 7, 64}) {
      for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
        SCOPED_TRACE(std::string(c.name) + " batch " + std::to_string(batch) + " " +
                     std::string(kg::dtype_name(dt)));
        const double s = scalar(rng);
        kg::Tensor x = away_from_zero(rng, dt, {batch, 3, 250});
        std::string op_name;
        kg::Tensor y = kg_test::run_op(
            [&](const kg::SymTensor& t) {
              auto out = c.build(t, s);
              op_name = out.graph().node(out.node()).op_name();
              return out;
            },
            x);
        EXPECT_EQ(op_name, c.op_name);
        // The scalar is rounded to the tensor's dtype first, as in PyTorch.
        const double s_t = dt == kg::DType::F32 ? static_cast<double>(static_cast<float>(s)) : s;
        EXPECT_TRUE(kg_test::all_close(y, naive_unary(x, [&](double v) { return c.ref(v, s_t); }),
                                       dt == kg::DType::F32 ? 1e-6 : 1e-15,
                                       dt == kg::DType::F32 ? 1e-7 : 1e-16));
      }
    }
  }
}

// ---- dropout ----

namespace {

// x [batch, 4000] → dropout(p), lowered for training.
struct DropoutModel {
  std::shared_ptr<kg::Graph> graph;
  std::unique_ptr<kg::Model> model;
  DropoutModel(kg::DType dt, double p) {
    graph = kg::Graph::create();
    auto x = graph->input(dt, {kg::Dim::named("batch"), 4000}, "x");
    model = std::make_unique<kg::Model>(graph, std::vector<kg::SymTensor>{kg::dropout(x, p, "drop")},
                                        kg::LoweringMode::Training);
  }
  kg::LoadedModel load(std::int64_t batch, std::uint64_t seed = 0) const {
    kg::LoadOptions opt;
    opt.poison_buffers = true;
    opt.seed = seed;
    return model->load(kg::Device::cpu(), {{batch, 4000}}, opt);
  }
};

bool same_values(const kg::Tensor& a, const kg::Tensor& b) {
  if (a.shape() != b.shape()) return false;
  for (std::int64_t i = 0; i < a.numel(); ++i)
    if (a.item(i) != b.item(i)) return false;
  return true;
}

}  // namespace

TEST(ElementwiseDropout, IdentityInInference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t batch : {1, 7, 64}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, 3, 300});
      EXPECT_TRUE(
          same_values(kg_test::run_op([](const kg::SymTensor& t) { return kg::dropout(t, 0.5); }, x), x));
      // A training-lowered model outside train mode is also the identity.
      DropoutModel dm(dt, 0.7);
      kg::Tensor x2 = kg_test::random_tensor(rng, dt, {batch, 4000});
      kg::LoadedModel m = dm.load(batch);
      EXPECT_TRUE(same_values(m.forward({x2})[0], x2));
      m.set_training(true);
      m.set_training(false);
      EXPECT_TRUE(same_values(m.forward({x2})[0], x2));
    }
  }
}

TEST(ElementwiseDropout, TrainingZeroesWithProbabilityPAndScalesTheRest) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (double p : {0.0, 0.1, 0.5, 0.85}) {
    for (std::int64_t batch : {1, 7, 64}) {
      for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
        SCOPED_TRACE("p " + std::to_string(p) + " batch " + std::to_string(batch) + " " +
                     std::string(kg::dtype_name(dt)));
        DropoutModel dm(dt, p);
        kg::LoadedModel m = dm.load(batch, rng());
        m.set_training(true);
        // Inputs away from zero, so a zero in the output is a dropped element.
        kg::Tensor x = away_from_zero(rng, dt, {batch, 4000});
        kg::Tensor y = m.forward({x})[0];
        EXPECT_TRUE(kg_test::all_written(y));
        const double scale = 1.0 / (1.0 - p);
        std::int64_t zeros = 0, zeros_even = 0, bad = 0;
        for (std::int64_t i = 0; i < y.numel(); ++i) {
          if (y.item(i) == 0.0) {
            ++zeros;
            zeros_even += i % 2 == 0;
          } else if (std::abs(y.item(i) - x.item(i) * scale) >
                     (dt == kg::DType::F32 ? 1e-6 : 1e-14) * scale) {
            ++bad;
          }
        }
        EXPECT_EQ(bad, 0) << "kept elements must equal x / (1 - p)";
        const auto n = static_cast<double>(y.numel());
        const double sigma = std::sqrt(p * (1 - p) / n);
        EXPECT_NEAR(zeros / n, p, 5 * sigma + 1e-12);
        // Even and odd positions drop at the same rate (no pattern tied to the index).
        EXPECT_NEAR(zeros_even / (n / 2), p, 5 * std::sqrt(p * (1 - p) / (n / 2)) + 1e-12);
      }
    }
  }
}

TEST(ElementwiseDropout, MaskIsDeterministicPerSeedAndChangesBetweenRuns) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
    DropoutModel dm(dt, 0.5);
    const std::uint64_t load_seed = rng();
    kg::Tensor x = away_from_zero(rng, dt, {64, 4000});
    kg::LoadedModel m1 = dm.load(64, load_seed), m2 = dm.load(64, load_seed);
    m1.set_training(true);
    m2.set_training(true);
    kg::Tensor a1 = m1.forward({x})[0], a2 = m1.forward({x})[0];
    kg::Tensor b1 = m2.forward({x})[0];
    EXPECT_TRUE(same_values(a1, b1)) << "the same seed must give the same mask";
    EXPECT_FALSE(same_values(a1, a2)) << "each run must draw a new mask";
    kg::LoadedModel m3 = dm.load(64, load_seed + 1);
    m3.set_training(true);
    EXPECT_FALSE(same_values(a1, m3.forward({x})[0])) << "another seed must give another mask";
  }
}

TEST(ElementwiseDropout, TrainModeNeedsATrainingModel) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 4});
  kg::Model model(g, std::vector<kg::SymTensor>{kg::dropout(x, 0.5)});
  kg::LoadedModel m = model.load(kg::Device::cpu(), {{2, 4}});
  kg_test::expect_error([&] { m.set_training(true); }, {"LoweringMode::Training"});
}

// ---- GELU against PyTorch ----

TEST(ElementwiseGelu, MatchesPyTorchBothForms) {
  std::map<std::string, std::string> meta;
  auto fx = kg_test::fixture("gelu.safetensors", &meta);
  ASSERT_EQ(meta.count("n"), 1u);
  for (const char* tag : {"f32", "f64"}) {
    SCOPED_TRACE(tag);
    const kg::Tensor& x = fx.at(std::string("x_") + tag);
    ASSERT_EQ(std::to_string(x.numel()), meta["n"]);
    const bool f32 = x.dtype() == kg::DType::F32;
    kg::Tensor erf =
        kg_test::run_op([](const kg::SymTensor& t) { return kg::gelu(t, kg::GeluApprox::Erf); }, x);
    kg::Tensor tnh =
        kg_test::run_op([](const kg::SymTensor& t) { return kg::gelu(t, kg::GeluApprox::Tanh); }, x);
    // PyTorch computes 0.5 x (1 + erf) and 0.5 x (1 + tanh), which cancel for negative x: its
    // error there is a few units in the last place of 1, times |x|/2 (up to 8 here). Our forms
    // avoid the cancellation, hence an absolute tolerance of that size.
    const double rtol = f32 ? 2e-6 : 1e-14, atol = f32 ? 2e-6 : 5e-15;
    EXPECT_TRUE(kg_test::all_close(erf, fx.at(std::string("erf_") + tag), rtol, atol));
    EXPECT_TRUE(kg_test::all_close(tnh, fx.at(std::string("tanh_") + tag), rtol, atol));
    // The two forms differ measurably, so each comparison checks its own formula.
    EXPECT_FALSE(kg_test::all_close(erf, tnh, 1e-5, 1e-6));
  }
}

// ---- GPU lowering ----

namespace {

// kg_test::check_lowering with the inputs' symbolic shapes given: check_lowering names every
// input's dim 0 "batch", which broadcast operands such as [C, 1, 1] cannot take. Dry run at
// sm_90 where NVRTC is present; with a GPU, the GPU's outputs against the CPU's. True when the
// GPU ran.
bool check_lowering_sym(const kg_test::BuildFn& build, const std::vector<kg::Shape>& sym,
                        const std::vector<kg::Tensor>& inputs, double rtol = 1e-5, double atol = 1e-6) {
  auto g = kg::Graph::create();
  std::vector<kg::SymTensor> xs;
  std::vector<std::vector<std::int64_t>> shapes;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    xs.push_back(g->input(inputs[i].dtype(), sym[i], "x" + std::to_string(i)));
    shapes.push_back(inputs[i].shape());
  }
  kg::Model model(g, build(xs));
  if (kg::compile::Compiler::available()) kg::lower::dry_run(model, shapes, 90);
  if (!kg::Device::cuda_available()) return false;
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  auto want = model.load(kg::Device::cpu(), shapes, opt).forward(inputs);
  auto got = model.load(kg::Device::cuda(), shapes, opt).forward(inputs);
  EXPECT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) {
    EXPECT_TRUE(kg_test::all_written(got[i])) << "GPU output " << i << " has elements the kernel never wrote";
    EXPECT_TRUE(kg_test::all_close(got[i], want[i], rtol, atol))
        << "GPU output " << i << " differs from the CPU";
  }
  return true;
}

// Records how many graphs ran on a GPU (the test XML's "gpu_runs"; 0 on a machine without one).
void record_gpu_runs(int n) { ::testing::Test::RecordProperty("gpu_runs", n); }

std::vector<kg::SymTensor> all_binary_ops(const kg::SymTensor& a, const kg::SymTensor& b) {
  return {kg::add(a, b), kg::sub(a, b), kg::mul(a, b), kg::div(a, b)};
}

// What the lowering tells the op of node `n` for sm_90, from the recorded shapes.
kg::LowerContext lower_context(const kg::Graph& g, const kg::Node& n) {
  kg::LowerContext lc;
  lc.node = n.name;
  for (int id : n.inputs) {
    lc.input_dtypes.push_back(g.node(id).dtype);
    lc.input_shapes.push_back(g.node(id).shape);
  }
  lc.output_dtype = n.dtype;
  lc.output_shape = n.shape;
  lc.sm = 90;
  return lc;
}

// A KgBroadcast mode (KG_BCAST_*) by name.
const char* mode_name(int m) {
  switch (m) {
    case KG_BCAST_SAME: return "same";
    case KG_BCAST_SCALAR_B: return "scalar b";
    case KG_BCAST_SCALAR_A: return "scalar a";
    case KG_BCAST_CHANNEL_B: return "channel b";
    case KG_BCAST_CHANNEL_A: return "channel a";
    case KG_BCAST_GENERAL: return "general";
  }
  return "?";
}

// The kernel's division: fast_div's 32-bit path below 2^31, else plain.
std::int64_t emulated_div(const KgDivider& f, std::int64_t n, bool small) {
  if (!small) return n / f.d;
  const auto u = static_cast<std::uint64_t>(n);
  return static_cast<std::int64_t>((((u * f.mul) >> 32) + u) >> f.shift);
}

// The operand offsets the kernel reads for output element i, computed from the packed walk the
// way elementwise.cu does.
std::pair<std::int64_t, std::int64_t> emulated_offsets(const KgBroadcast& g, std::int64_t i, std::int64_t n) {
  const bool small = n < (std::int64_t{1} << 31);
  switch (g.mode) {
    case KG_BCAST_SAME: return {i, i};
    case KG_BCAST_SCALAR_B: return {i, 0};
    case KG_BCAST_SCALAR_A: return {0, i};
    case KG_BCAST_CHANNEL_B:
    case KG_BCAST_CHANNEL_A: {
      const std::int64_t q = emulated_div(g.size[0], i, small);
      const std::int64_t ch = q - emulated_div(g.size[1], q, small) * g.size[1].d;
      return g.mode == KG_BCAST_CHANNEL_B ? std::pair{i, ch} : std::pair{ch, i};
    }
    default: break;  // KG_BCAST_GENERAL
  }
  std::int64_t r = i, ia = 0, ib = 0;
  for (int d = 0; d < g.rank; ++d) {
    const std::int64_t q = emulated_div(g.size[d], r, small);
    const std::int64_t k = r - q * g.size[d].d;
    ia += k * g.stride_a[d];
    ib += k * g.stride_b[d];
    r = q;
  }
  return {ia, ib};
}

// numpy's offsets of output element o in a and b.
std::pair<std::int64_t, std::int64_t> numpy_offsets(const std::vector<std::int64_t>& a,
                                                    const std::vector<std::int64_t>& b,
                                                    const std::vector<std::int64_t>& out, std::int64_t o) {
  std::int64_t ia = 0, ib = 0, sa = 1, sb = 1;
  for (std::size_t d = out.size(); d-- > 0;) {
    const std::int64_t k = o % out[d];
    o /= out[d];
    const std::size_t from_end = out.size() - 1 - d;
    if (from_end < a.size()) {
      const std::int64_t size = a[a.size() - 1 - from_end];
      if (size != 1) ia += k * sa;
      sa *= size;
    }
    if (from_end < b.size()) {
      const std::int64_t size = b[b.size() - 1 - from_end];
      if (size != 1) ib += k * sb;
      sb *= size;
    }
  }
  return {ia, ib};
}

std::vector<std::int64_t> broadcast_sizes(const std::vector<std::int64_t>& a,
                                          const std::vector<std::int64_t>& b) {
  const std::size_t rank = std::max(a.size(), b.size());
  std::vector<std::int64_t> out(rank, 1);
  for (std::size_t k = 0; k < rank; ++k) {
    const std::int64_t x = k < a.size() ? a[a.size() - 1 - k] : 1, y = k < b.size() ? b[b.size() - 1 - k] : 1;
    out[rank - 1 - k] = x == 1 ? y : x;
  }
  return out;
}

struct GpuPattern {
  const char* name;
  std::vector<std::int64_t> a, b;  // -1: the dynamic batch dim
  int mode;  // the kernel's path at batch > 1 (KG_BCAST_*)
};

// Every path of the binary kernel, through the patterns models use.
std::vector<GpuPattern> gpu_patterns() {
  return {
      {"same shape", {-1, 5, 33}, {-1, 5, 33}, KG_BCAST_SAME},
      {"same shape, odd count", {-1, 7, 3}, {-1, 7, 3}, KG_BCAST_SAME},
      {"scalar tensor on the right", {-1, 3, 50}, {1}, KG_BCAST_SCALAR_B},
      {"rank-0 tensor on the right", {-1, 4}, {}, KG_BCAST_SCALAR_B},
      {"scalar tensor on the left", {1, 1}, {-1, 61}, KG_BCAST_SCALAR_A},
      {"per-channel [N,C,H,W] ⊙ [C,1,1]", {-1, 8, 20, 41}, {8, 1, 1}, KG_BCAST_CHANNEL_B},
      {"per-channel [C,1,1] ⊙ [N,C,H,W]", {8, 1, 1}, {-1, 8, 5, 3}, KG_BCAST_CHANNEL_A},
      {"per-sample-channel [N,C,H,W] ⊙ [N,C,1,1]", {-1, 6, 9, 7}, {-1, 6, 1, 1}, KG_BCAST_CHANNEL_B},
      {"bias [N,T,C] ⊙ [C]", {-1, 3, 70}, {70}, KG_BCAST_CHANNEL_B},
      {"per-row [N,1] ⊙ [N,M]", {-1, 1}, {-1, 37}, KG_BCAST_CHANNEL_A},
      {"outer [N,1] ⊙ [1,M]", {-1, 1}, {1, 300}, KG_BCAST_GENERAL},
      {"both broadcast", {3, 1, 5}, {-1, 1, 4, 1}, KG_BCAST_GENERAL},
      {"middle dim", {-1, 1, 6}, {-1, 5, 6}, KG_BCAST_GENERAL},
      {"eight alternating dims", {2, 1, 3, 1, 2, 1, 3, 1}, {1, 3, 1, 2, 1, 3, 1, -1}, KG_BCAST_GENERAL},
  };
}

}  // namespace

TEST(Elementwise, GpuBroadcastWalkReadsWhatNumpyReads) {
  const std::int64_t batches[] = {1, 7, 64};
  for (const auto& p : gpu_patterns()) {
    for (std::int64_t batch : batches) {
      const auto a = concrete(p.a, batch), b = concrete(p.b, batch), out = broadcast_sizes(a, b);
      SCOPED_TRACE(std::string(p.name) + " batch " + std::to_string(batch));
      const KgBroadcast g = kg::ops::gpu_broadcast(a, b, out, "nn.add");
      if (batch > 1) {
        EXPECT_STREQ(mode_name(g.mode), mode_name(p.mode));
      }
      const std::int64_t n = kg::numel_of(out);
      std::int64_t wrong = 0;
      for (std::int64_t i = 0; i < n; ++i) wrong += emulated_offsets(g, i, n) != numpy_offsets(a, b, out, i);
      EXPECT_EQ(wrong, 0) << "of " << n << " elements read the wrong operand elements";
    }
  }
  // Single elements, and an empty output (no work).
  const auto one = kg::ops::gpu_broadcast({1}, {}, {1}, "nn.add");
  EXPECT_EQ(emulated_offsets(one, 0, 1), (std::pair<std::int64_t, std::int64_t>{0, 0}));
  EXPECT_STREQ(mode_name(kg::ops::gpu_broadcast({0, 3}, {3}, {0, 3}, "nn.add").mode), "same");
}

TEST(Elementwise, GpuBroadcastRejectsMoreThanEightMergedDims) {
  const std::vector<std::int64_t> a = {2, 1, 2, 1, 2, 1, 2, 1, 2}, b = {1, 2, 1, 2, 1, 2, 1, 2, 1};
  const std::vector<std::int64_t> out(9, 2);
  kg_test::expect_error([&] { kg::ops::gpu_broadcast(a, b, out, "nn.mul"); },
                        {"nn.mul", "[2, 1, 2, 1, 2, 1, 2, 1, 2]", "[1, 2, 1, 2, 1, 2, 1, 2, 1]", "9 dims",
                         "up to 8"});
  // Nine dims that merge are fine, and the CPU takes any rank.
  const std::vector<std::int64_t> full(9, 2);
  EXPECT_STREQ(mode_name(kg::ops::gpu_broadcast(full, {2}, full, "nn.mul").mode), "channel b");
  if (!kg::compile::Compiler::available()) GTEST_SKIP() << "no NVRTC: the launch is not packed";
  auto g = kg::Graph::create();
  auto x = g->input(kg::DType::F32, kg::Shape::of(a), "x");
  auto y = g->input(kg::DType::F32, kg::Shape::of(b), "y");
  kg::Model model(g, std::vector<kg::SymTensor>{kg::mul(x, y, "prod")});
  kg_test::expect_error([&] { kg::lower::dry_run(model, {a, b}, 90); }, {"nn.mul", "9 dims", "up to 8"});
}

TEST(Elementwise, GpuActivationsAndDropoutMatchTheCpu) {
  // CUDA's expf, erfcf and tanhf are within 4 ulp, the CPU's polynomial forms within 4 ulp too:
  // 1e-5 relative holds for every activation in f32.
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  int gpu_runs = 0;
  auto build = [](const std::vector<kg::SymTensor>& xs) {
    const kg::SymTensor& x = xs[0];
    return std::vector<kg::SymTensor>{kg::relu(x),
                                      kg::leaky_relu(x),
                                      kg::leaky_relu(x, 0.3),
                                      kg::silu(x),
                                      kg::gelu(x),
                                      kg::gelu(x, kg::GeluApprox::Tanh),
                                      kg::sigmoid(x),
                                      kg::tanh(x),
                                      kg::dropout(x, 0.4)};
  };
  for (std::int64_t batch : {1, 7, 3001}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      SCOPED_TRACE("batch " + std::to_string(batch) + " " + std::string(kg::dtype_name(dt)));
      // 3 × 37 per sample: an element count that is no multiple of the 16-byte vector.
      kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, 3, 37}, -8.0, 8.0);
      gpu_runs += kg_test::check_lowering(build, {x});
    }
  }
  record_gpu_runs(gpu_runs);
}

TEST(Elementwise, GpuScalarFormsMatchTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  int gpu_runs = 0;
  std::uniform_real_distribution<double> scalar(-3.0, 3.0);
  for (std::int64_t batch : {1, 7, 2999}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      SCOPED_TRACE("batch " + std::to_string(batch) + " " + std::string(kg::dtype_name(dt)));
      // A scalar with bits below f32's precision, so that rounding it to the dtype shows.
      const double s = scalar(rng) + 1e-9;
      auto build = [s](const std::vector<kg::SymTensor>& xs) {
        const kg::SymTensor& x = xs[0];
        return std::vector<kg::SymTensor>{x + s, s + x, x - s, s - x, x * s, s * x, x / s, s / x};
      };
      gpu_runs += kg_test::check_lowering(build, {away_from_zero(rng, dt, {batch, 5, 13})});
    }
  }
  record_gpu_runs(gpu_runs);
}

TEST(Elementwise, GpuBroadcastPatternsMatchTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  int gpu_runs = 0;
  for (const auto& p : gpu_patterns()) {
    for (std::int64_t batch : {1, 7, 300}) {
      for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
        SCOPED_TRACE(std::string(p.name) + " batch " + std::to_string(batch) + " " +
                     std::string(kg::dtype_name(dt)));
        const auto as = concrete(p.a, batch), bs = concrete(p.b, batch);
        if (batch > 1) {
          EXPECT_STREQ(mode_name(kg::ops::gpu_broadcast(as, bs, broadcast_sizes(as, bs), "nn.add").mode),
                       mode_name(p.mode));
        }
        kg::Tensor a = kg_test::random_tensor(rng, dt, as);
        kg::Tensor b = away_from_zero(rng, dt, bs);
        gpu_runs += check_lowering_sym([](const auto& xs) { return all_binary_ops(xs[0], xs[1]); },
                                       {sym_shape(p.a), sym_shape(p.b)}, {a, b});
      }
    }
  }
  record_gpu_runs(gpu_runs);
}

TEST(Elementwise, GpuSameShapeThroughCheckLowering) {
  // The same-shape and per-sample patterns, whose inputs all lead with the batch dim, through
  // the shared checker; x + x reads one buffer twice.
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  int gpu_runs = 0;
  for (std::int64_t batch : {1, 7, 4097}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      SCOPED_TRACE("batch " + std::to_string(batch) + " " + std::string(kg::dtype_name(dt)));
      kg::Tensor a = kg_test::random_tensor(rng, dt, {batch, 4, 33});
      kg::Tensor b = away_from_zero(rng, dt, {batch, 4, 33});
      kg::Tensor c = away_from_zero(rng, dt, {batch, 4, 1});
      gpu_runs += kg_test::check_lowering(
          [](const std::vector<kg::SymTensor>& xs) {
            auto out = all_binary_ops(xs[0], xs[1]);
            for (auto& y : all_binary_ops(xs[0], xs[2])) out.push_back(y);
            out.push_back(xs[0] + xs[0]);
            return out;
          },
          {a, b, c});
    }
  }
  record_gpu_runs(gpu_runs);
}

TEST(Elementwise, GpuLaunchesPackForTensorsBeyondTwoToThe31) {
  // Past 2^31 elements the kernels take their 64-bit index paths; packing and grids must hold.
  // A dry run only: nothing is allocated.
  if (!kg::compile::Compiler::available()) GTEST_SKIP() << "no NVRTC";
  const std::int64_t big = (std::int64_t{1} << 31) + 5;
  auto g = kg::Graph::create();
  auto x = g->input(kg::DType::F32, {kg::Dim::named("batch"), 3}, "x");
  auto c = g->input(kg::DType::F32, {3}, "c");
  auto r = g->input(kg::DType::F32, {kg::Dim::named("batch"), 1}, "r");
  kg::Model model(g, std::vector<kg::SymTensor>{kg::gelu(x), x * c, x / r, kg::dropout(x, 0.1), x - 1.0});
  const auto dry = kg::lower::dry_run(model, {{big, 3}, {3}, {big, 1}}, 90);
  EXPECT_EQ(dry.launches.steps.size(), 5u);
  const auto bc = kg::ops::gpu_broadcast({big, 3}, {big, 1}, {big, 3}, "nn.div");
  EXPECT_STREQ(mode_name(bc.mode), "channel b");
  EXPECT_EQ(bc.size[0].d, 3);
  EXPECT_EQ(bc.size[1].d, big);
  EXPECT_EQ(bc.size[1].mul, 0u) << "a divisor past 2^31 has only the 64-bit path";
}

TEST(Elementwise, GpuEachOpCompilesToItsOwnEntry) {
  // Every op's source holds exactly the entry it names; the file compiled alone holds all of them.
  if (!kg::compile::Compiler::available()) GTEST_SKIP() << "no NVRTC";
  auto& compiler = kg::compile::Compiler::global();
  auto visible = [](const std::string& ptx) {
    std::set<std::string> names;
    for (const auto& e : kg::compile::parse_ptx_entries(ptx))
      if (e.visible) names.insert(e.name);
    return names;
  };
  const std::set<std::string> all =
      visible(compiler.compile("elementwise", kg::compile::kernel_source("elementwise.cu"), 90).ptx);
  std::set<std::string> seen;
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
    auto g = kg::Graph::create();
    auto x = g->input(dt, {kg::Dim::named("batch"), 4}, "x");
    const std::vector<kg::SymTensor> ys = {
        kg::relu(x), kg::leaky_relu(x), kg::silu(x), kg::gelu(x), kg::gelu(x, kg::GeluApprox::Tanh),
        kg::sigmoid(x), kg::tanh(x), kg::dropout(x, 0.5), x + 1.0, 1.0 + x, x - 1.0, 1.0 - x, x * 2.0,
        2.0 * x, x / 2.0, 2.0 / x, x + x, x - x, x * x, x / x};
    for (const auto& y : ys) {
      const kg::Node& node = g->node(y.node());
      SCOPED_TRACE(node.label());
      const auto lowered = node.op->op().lower(lower_context(*g, node));
      ASSERT_TRUE(lowered.has_value());
      EXPECT_EQ(lowered->name, node.op_name());
      EXPECT_EQ(lowered->entry_point.substr(lowered->entry_point.size() - 4),
                dt == kg::DType::F32 ? "_f32" : "_f64");
      const auto entries = visible(compiler.compile(lowered->name, lowered->source, 90).ptx);
      EXPECT_EQ(entries, std::set<std::string>{lowered->entry_point});
      EXPECT_EQ(all.count(lowered->entry_point), 1u);
      seen.insert(lowered->entry_point);
    }
  }
  EXPECT_EQ(seen, all) << "the ops and the file's own entries differ";
}
