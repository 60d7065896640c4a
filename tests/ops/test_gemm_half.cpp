// nn.linear and nn.matmul computing in f16 and bf16 (inference): recorded on 16-bit inputs, the
// CPU output (the f32 form on widened copies, rounded back) against naive double loops over the
// same rounded values; the lowering (the 16-bit kernel entries and the vendor GEMM description)
// dry-run, emulated against the CPU and, where a GPU is present, run on it (check_lowering), and
// the op's own kernels emulated on their own too (check_lowering's emulated run takes the
// library-call path first and stops at its first failure); an op recorded in f32
// and recorded again on a 16-bit input (as a model loaded in reduced precision is); and the
// errors for mixed dtypes and for training through a 16-bit node.
//
// Tolerances. An element is |got - ref| <= tol * |ref| + tol / 100 * s, where s = sqrt(k) *
// max|x| * max|w| + max|b| is the scale of the output (k the reduction length) and tol is 2e-3
// for f16 and 1e-2 for bf16. The output is rounded once, to half an ulp (2^-11 of |ref| in f16,
// 2^-8 in bf16); two results summed in f32 in different orders can round one ulp apart (2^-10,
// 2^-7), which tol covers with a margin. The term in s covers the f32 sums' own error where the
// output cancels to near zero (about k * 2^-24 * max|x| * max|w|, far below it).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <variant>

#include "backend/emu/executor.hpp"
#include "compile/compiler.hpp"
#include "kg/runtime_op.hpp"
#include "lower/dry_run.hpp"
#include "ops/pointwise.hpp"
#include "support/gpu_util.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

constexpr kg::DType kHalves[] = {kg::DType::F16, kg::DType::BF16};

double tolerance(kg::DType t) { return t == kg::DType::F16 ? 2e-3 : 1e-2; }

double max_abs(const kg::Tensor& t) {
  double m = 0;
  for (std::int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(t.item(i)));
  return m;
}

// The output scale s of the header for a reduction of length k.
double output_scale(std::int64_t k, double max_x, double max_w, double max_b = 0) {
  return std::sqrt(static_cast<double>(std::max<std::int64_t>(k, 1))) * max_x * max_w + max_b;
}

// got against a double reference under the header's bound.
::testing::AssertionResult near_reference(const kg::Tensor& got, const kg::Tensor& want, kg::DType dtype,
                                          double scale) {
  if (got.dtype() != dtype)
    return ::testing::AssertionFailure() << "output is " << kg::dtype_name(got.dtype()) << ", want "
                                         << kg::dtype_name(dtype);
  return kg_test::all_close(got, want, tolerance(dtype), tolerance(dtype) / 100 * scale);
}

// y[r, j] = sum_k x[r, k] w[j, k] + b[j] over the values as stored, in double.
kg::Tensor naive_linear(const kg::Tensor& x, const kg::Tensor& w, const kg::Tensor* b) {
  const std::int64_t in = w.dim(1), out = w.dim(0), rows = in ? x.numel() / in : 0;
  std::vector<std::int64_t> shape = x.shape();
  shape.back() = out;
  kg::Tensor y = kg::Tensor::empty(kg::DType::F64, shape);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < out; ++j) {
      double s = b ? b->item(j) : 0.0;
      for (std::int64_t k = 0; k < in; ++k) s += x.item(r * in + k) * w.item(j * in + k);
      y.data<double>()[r * out + j] = s;
    }
  return y;
}

// torch.matmul over the values as stored, in double: a 1-D A is a row and a 1-D B a column
// (the added dim removed afterwards); leading dims broadcast.
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
    std::int64_t ia = 0, ib = 0, mul_a = 1, mul_b = 1;
    for (std::int64_t rem = idx, i = static_cast<std::int64_t>(r) - 1; i >= 0; --i) {
      const auto u = static_cast<std::size_t>(i);
      const std::int64_t c = rem % batch[u];
      rem /= batch[u];
      ia += (ba[u] == 1 ? 0 : c) * mul_a;
      ib += (bb[u] == 1 ? 0 : c) * mul_b;
      mul_a *= ba[u];
      mul_b *= bb[u];
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

struct LinearCase {
  std::vector<std::int64_t> x;  // the input's shape, [..., in]
  std::int64_t out;
  bool bias;
};
// Batch 1, k small and large, sizes past one 64×64 tile and off its multiples, a 3-D input.
const LinearCase kLinearCases[] = {{{1, 37}, 6, false}, {{7, 3}, 5, true},   {{3, 1000}, 17, true},
                                   {{65, 70}, 65, true}, {{2, 3, 33}, 130, false}, {{1, 1}, 1, true}};

struct MatmulCase {
  const char* what;
  std::vector<std::int64_t> a, b;
};
// check_lowering names dim 0 of every input "batch": both operands' first dims agree.
const MatmulCase kMatmulCases[] = {
    {"2-D, n past a tile", {9, 9}, {9, 66}},
    {"batched, B shared: one GEMM", {20, 65, 20}, {20, 66}},
    {"batched, B per batch", {2, 9, 70}, {2, 70, 5}},
    {"broadcast both", {1, 3, 1, 5, 9}, {1, 1, 4, 9, 4}},
    {"A broadcast", {6, 17}, {6, 17, 6}},
    {"batch 1", {1, 6, 8}, {1, 8, 7}},
    {"k large", {3, 2, 1500}, {3, 1500, 5}},
    {"k = 1", {1, 4, 1}, {1, 1, 3}},
    {"vector × batched", {9}, {9, 9, 3}},
    {"batched × vector", {9, 4, 9}, {9}},
};

// The graph `build` records run by the op's own kernels under the emulator (checked mode, the
// library-call path off) against the CPU, on poisoned buffers; dim 0 of every input is "batch"
// as in check_lowering. The parameters are the CPU model's.
void check_own_kernels_emulated(const kg_test::BuildFn& build, const std::vector<kg::Tensor>& inputs,
                                double rtol, double atol) {
  auto graph = kg::Graph::create();
  std::vector<kg::SymTensor> xs;
  std::vector<std::vector<std::int64_t>> shapes;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    kg::Shape s = kg::Shape::of(inputs[i].shape());
    if (s.rank() > 0) s[0] = kg::Dim::named("batch");
    xs.push_back(graph->input(inputs[i].dtype(), s, "x" + std::to_string(i)));
    shapes.push_back(inputs[i].shape());
  }
  kg::Model model(graph, build(xs));
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  kg::LoadedModel cpu = model.load(kg::Device::cpu(), shapes, opt);
  const auto want = cpu.forward(inputs);
  const auto got = kg::emu::run_model(model, inputs, cpu.state_dict(), /*checked=*/true, /*library_calls=*/false);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].dtype(), want[i].dtype());
    EXPECT_TRUE(kg_test::all_written(got[i])) << "emulated output " << i << " has elements the kernel never wrote";
    EXPECT_TRUE(kg_test::all_close(got[i], want[i], rtol, atol)) << "emulated output " << i << " differs from the CPU";
  }
}

kg::Tensor run_linear(const kg::Tensor& x, std::int64_t out, bool bias, const kg::Tensor& w,
                      const kg::Tensor* b) {
  std::map<std::string, kg::Tensor> params{{"fc.weight", w}};
  if (b) params.emplace("fc.bias", *b);
  return kg_test::run_op([&](const kg::SymTensor& t) { return kg::nn::linear(t, out, "fc", bias); }, x, params);
}

}  // namespace

TEST(GemmHalf, LinearMatchesDoubleReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : kHalves) {
    for (const LinearCase& c : kLinearCases) {
      SCOPED_TRACE(::testing::Message() << kg::dtype_name(dt) << " " << kg::sizes_to_string(c.x) << " -> "
                                        << c.out << (c.bias ? "" : " no bias"));
      const std::int64_t in = c.x.back();
      // Random values rounded to the dtype; the reference reads the same rounded values.
      kg::Tensor x = kg_test::random_tensor(rng, dt, c.x);
      kg::Tensor w = kg_test::random_tensor(rng, dt, {c.out, in});
      kg::Tensor b = kg_test::random_tensor(rng, dt, {c.out});
      const kg::Tensor* bp = c.bias ? &b : nullptr;
      // run_op loads with poisoned buffers and fails on any element left unwritten.
      const kg::Tensor y = run_linear(x, c.out, c.bias, w, bp);
      EXPECT_EQ(y.shape().back(), c.out);
      EXPECT_TRUE(near_reference(y, naive_linear(x, w, bp), dt,
                                 output_scale(in, max_abs(x), max_abs(w), c.bias ? max_abs(b) : 0)));
    }
  }
}

TEST(GemmHalf, MatmulMatchesDoubleReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : kHalves) {
    for (const MatmulCase& c : kMatmulCases) {
      SCOPED_TRACE(::testing::Message() << kg::dtype_name(dt) << " " << c.what);
      kg::Tensor a = kg_test::random_tensor(rng, dt, c.a);
      kg::Tensor b = kg_test::random_tensor(rng, dt, c.b);
      const kg::Tensor y = kg_test::run_graph(
          [](const std::vector<kg::SymTensor>& xs) { return std::vector<kg::SymTensor>{kg::matmul(xs[0], xs[1], "mm")}; },
          {a, b}, {}, /*dynamic_batch=*/false)[0];
      EXPECT_TRUE(near_reference(y, naive_matmul(a, b), dt, output_scale(c.a.back(), max_abs(a), max_abs(b))));
    }
  }
}

TEST(GemmHalf, LinearLoweringMatchesTheCpu) {
  // The weights and bias keep their default initialisation, U(-1/sqrt(in), 1/sqrt(in)), copied
  // from the CPU model; inputs in [-1, 1).
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : kHalves) {
    for (const LinearCase& c : kLinearCases) {
      SCOPED_TRACE(::testing::Message() << kg::dtype_name(dt) << " " << kg::sizes_to_string(c.x) << " -> "
                                        << c.out << (c.bias ? "" : " no bias"));
      const std::int64_t in = c.x.back();
      const double bound = 1 / std::sqrt(static_cast<double>(in));
      const double s = output_scale(in, 1.0, bound, bound);
      kg::Tensor x = kg_test::random_tensor(rng, dt, c.x);
      const kg_test::BuildFn build = [&](const std::vector<kg::SymTensor>& xs) {
        return std::vector<kg::SymTensor>{kg::nn::linear(xs[0], c.out, "fc", c.bias)};
      };
      check_own_kernels_emulated(build, {x}, tolerance(dt), tolerance(dt) / 100 * s);
      // cuBLASLt may reduce split sums of a 16-bit product in the 16-bit type (as PyTorch allows
      // by default), so the library path gets one 16-bit step of the output's scale.
      kg_test::check_lowering(build, {x}, tolerance(dt), tolerance(dt) / 10 * s);
    }
  }
}

TEST(GemmHalf, MatmulLoweringMatchesTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : kHalves) {
    for (const MatmulCase& c : kMatmulCases) {
      SCOPED_TRACE(::testing::Message() << kg::dtype_name(dt) << " " << c.what);
      kg::Tensor a = kg_test::random_tensor(rng, dt, c.a);
      kg::Tensor b = kg_test::random_tensor(rng, dt, c.b);
      const kg_test::BuildFn build = [](const std::vector<kg::SymTensor>& xs) {
        return std::vector<kg::SymTensor>{kg::matmul(xs[0], xs[1], "mm")};
      };
      const double atol = tolerance(dt) / 100 * output_scale(c.a.back(), 1.0, 1.0);
      check_own_kernels_emulated(build, {a, b}, tolerance(dt), atol);
      kg_test::check_lowering(build, {a, b}, tolerance(dt), 10 * atol);  // as for linear above
    }
  }
}

TEST(GemmHalf, LoweringTakesTheHalfEntriesAndDescribesHalfGemms) {
  for (kg::DType dt : kHalves) {
    SCOPED_TRACE(kg::dtype_name(dt));
    const std::string suffix = dt == kg::DType::F16 ? "_f16" : "_bf16";
    // nn.linear with a bias: y [6, 7] = x [6, 5] · Wᵀ + b, all in the dtype.
    auto g = kg::Graph::create();
    auto x = g->input(dt, {6, 5}, "x");
    auto y = kg::nn::linear(x, 7, "fc");
    for (const auto& p : g->node(y.node()).params) EXPECT_EQ(p.dtype, dt) << p.name;
    // With NVRTC the 16-bit kernels are compiled for sm_90 and checked against their PTX too.
    const int arch = kg::compile::Compiler::available() ? 90 : 0;
    const auto lin = kg::lower::dry_run(kg::Model(g, {y}), {{6, 5}}, arch);
    const auto& ls = lin.launches.steps.at(0);
    EXPECT_EQ(ls.launches.at(0).entry, "kg_linear" + suffix);
    ASSERT_TRUE(ls.library.has_value());
    const auto* lg = std::get_if<kg::GemmCall>(&ls.library->call);
    ASSERT_NE(lg, nullptr);
    EXPECT_EQ(lg->dtype, dt);
    EXPECT_NE(lg->bias, 0u);
    EXPECT_TRUE(lg->trans_b);
    EXPECT_EQ((std::array<std::int64_t, 3>{lg->m, lg->n, lg->k}), (std::array<std::int64_t, 3>{6, 7, 5}));
    // nn.matmul over one broadcast level: a strided batch of GEMMs.
    auto g2 = kg::Graph::create();
    auto a = g2->input(dt, {5, 17}, "a");
    auto b = g2->input(dt, {4, 17, 6}, "b");
    const auto mm = kg::lower::dry_run(kg::Model(g2, {kg::matmul(a, b, "mm")}), {{5, 17}, {4, 17, 6}}, arch);
    const auto& ms = mm.launches.steps.at(0);
    EXPECT_EQ(ms.launches.at(0).entry, "kg_matmul" + suffix);
    ASSERT_TRUE(ms.library.has_value());
    const auto* mg = std::get_if<kg::GemmCall>(&ms.library->call);
    ASSERT_NE(mg, nullptr);
    EXPECT_EQ(mg->dtype, dt);
    EXPECT_EQ(mg->batch, 4);
    EXPECT_EQ(mg->stride_a, 0);
  }
}

TEST(GemmHalf, F32RecordedOpsComputeInHalfWhenRecordedOnHalfInputs) {
  // A model loaded in reduced precision records each op again on 16-bit inputs: the graph then
  // re-declares the f32 parameters in that dtype (CustomOp::computes_in).
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto f32 = kg::Graph::create();
  const kg::CustomData lin = *f32->node(kg::nn::linear(f32->input(kg::DType::F32, {3, 10}), 4, "fc").node()).op;
  const kg::CustomData mm =
      *f32->node(kg::matmul(f32->input(kg::DType::F32, {3, 4}), f32->input(kg::DType::F32, {4, 2})).node()).op;
  for (kg::DType dt : kHalves) {
    SCOPED_TRACE(kg::dtype_name(dt));
    EXPECT_TRUE(lin->computes_in(dt));
    EXPECT_TRUE(mm->computes_in(dt));
    auto g = kg::Graph::create();
    auto x = g->input(dt, {3, 10}, "x");
    auto v = g->input(dt, {4, 2}, "v");
    auto y = g->record(lin, {x}, std::nullopt, "fc");
    auto z = g->record(mm, {y, v}, std::nullopt, "mm");
    EXPECT_EQ(y.dtype(), dt);
    EXPECT_EQ(z.dtype(), dt);
    const auto& params = g->node(y.node()).params;
    ASSERT_EQ(params.size(), 2u);
    for (const auto& p : params) EXPECT_EQ(p.dtype, dt) << p.name;
    kg::Tensor xin = kg_test::random_tensor(rng, dt, {3, 10});
    kg::Tensor vin = kg_test::random_tensor(rng, dt, {4, 2});
    kg::Tensor w = kg_test::random_tensor(rng, dt, {4, 10});
    kg::Tensor b = kg_test::random_tensor(rng, dt, {4});
    kg::LoadOptions opt;
    opt.poison_buffers = true;
    kg::LoadedModel m = kg::Model(g, {y, z}).load(kg::Device::cpu(), {{3, 10}, {4, 2}}, opt);
    m.load_state_dict({{"fc.weight", w}, {"fc.bias", b}}, false);
    const auto out = m.forward({xin, vin});
    EXPECT_TRUE(near_reference(out[0], naive_linear(xin, w, &b), dt,
                               output_scale(10, max_abs(xin), max_abs(w), max_abs(b))));
    // The matmul's reference takes the linear's rounded output, as the model does.
    EXPECT_TRUE(near_reference(out[1], naive_matmul(out[0], vin), dt, output_scale(4, max_abs(out[0]), max_abs(vin))));
  }
}

TEST(GemmHalf, ModelLoadedInReducedPrecisionComputesTheGemmsInIt) {
  // An f32 model, x [batch, 20] -> nn.linear(13) -> nn.matmul with v [13, 7], loaded with
  // LoadOptions::precision: both ops run in the dtype, the output is cast back to f32.
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto g = kg::Graph::create();
  auto x = g->input(kg::DType::F32, {kg::Dim::named("batch"), 20}, "x");
  auto v = g->input(kg::DType::F32, {13, 7}, "v");
  const kg::Model model(g, {kg::matmul(kg::nn::linear(x, 13, "fc"), v, "mm")});
  for (kg::DType dt : kHalves) {
    SCOPED_TRACE(kg::dtype_name(dt));
    // Values the dtype holds exactly, given in f32.
    const kg::Tensor xin = kg_test::random_tensor(rng, dt, {5, 20}).to(kg::DType::F32);
    const kg::Tensor vin = kg_test::random_tensor(rng, dt, {13, 7}).to(kg::DType::F32);
    const kg::Tensor w = kg_test::random_tensor(rng, dt, {13, 20}).to(kg::DType::F32);
    const kg::Tensor b = kg_test::random_tensor(rng, dt, {13}).to(kg::DType::F32);
    kg::LoadOptions opt;
    opt.poison_buffers = true;
    opt.precision = dt;
    kg::LoadedModel m = model.load(kg::Device::cpu(), {{5, 20}, {13, 7}}, opt);
    m.load_state_dict({{"fc.weight", w}, {"fc.bias", b}}, false);
    const auto state = m.state_dict();
    EXPECT_EQ(state.at("fc.weight").dtype(), dt);
    EXPECT_EQ(state.at("fc.bias").dtype(), dt);
    const kg::Tensor out = m.forward({xin, vin})[0];
    EXPECT_EQ(out.dtype(), kg::DType::F32);
    EXPECT_TRUE(kg_test::all_written(out));
    // The reference rounds the linear's output to the dtype, as the model stores it.
    const kg::Tensor y = naive_linear(xin, w, &b).to(dt);
    EXPECT_TRUE(near_reference(out.to(dt), naive_matmul(y, vin), dt, output_scale(13, max_abs(y), max_abs(vin))));
  }
}

TEST(GemmHalf, MixedDtypesAreRejected) {
  auto g = kg::Graph::create();
  auto h = g->input(kg::DType::F16, {4, 5}, "h");
  auto f = g->input(kg::DType::F32, {5, 3}, "f");
  auto bf = g->input(kg::DType::BF16, {5, 3}, "bf");
  auto i = g->input(kg::DType::I32, {5, 3}, "i");
  kg_test::expect_error([&] { kg::matmul(h, f, "hf"); }, {"[nn.matmul @ hf]", "one dtype", "f16", "f32"});
  kg_test::expect_error([&] { kg::matmul(h, bf, "hb"); }, {"[nn.matmul @ hb]", "one dtype", "f16", "bf16"});
  kg_test::expect_error([&] { kg::matmul(h, i, "hi"); }, {"[nn.matmul @ hi]", "i32"});
  // A linear whose parameters are f16 recorded again on a bf16 input, and one whose parameters
  // are f64 (never re-declared) on an f16 input.
  const kg::CustomData lin16 = *g->node(kg::nn::linear(h, 2, "fc16").node()).op;
  auto d = g->input(kg::DType::F64, {4, 5}, "d");
  const kg::CustomData lin64 = *g->node(kg::nn::linear(d, 2, "fc64").node()).op;
  auto b5 = g->input(kg::DType::BF16, {4, 5}, "b5");
  kg_test::expect_error([&] { g->record(lin16, {b5}, std::nullopt, "again16"); },
                        {"[nn.linear @ again16]", "input is bf16", "parameters are f16"});
  kg_test::expect_error([&] { g->record(lin64, {h}, std::nullopt, "again64"); },
                        {"[nn.linear @ again64]", "input is f16", "parameters are f64"});
}

TEST(GemmHalf, TrainingThroughHalfNodesIsRefused) {
  for (kg::DType dt : kHalves) {
    SCOPED_TRACE(kg::dtype_name(dt));
    const std::string name(kg::dtype_name(dt));
    // loss = mse(f32(linear(x)), target): the linear's weight needs a backward in the dtype.
    auto g = kg::Graph::create();
    auto x = g->input(dt, {kg::Dim::named("batch"), 8}, "x");
    auto target = g->input(kg::DType::F32, {kg::Dim::named("batch"), 4}, "target");
    auto y = kg::ops::cast(kg::nn::linear(x, 4, "fc"), kg::DType::F32, "widen");
    auto loss = kg::mse_loss(y, target, "loss");
    kg::Model model(g, {{"loss", loss}}, kg::LoweringMode::Training);
    kg_test::expect_error([&] { model.load(kg::Device::cpu(), {{3, 8}, {3, 4}}); },
                          {"[nn.linear @ fc]", name, "inference only"});
    // The same for a matmul in a training model.
    auto g2 = kg::Graph::create();
    auto a = g2->input(dt, {3, 8}, "a");
    auto w = kg::nn::linear(g2->input(kg::DType::F32, {8, 8}, "p"), 8, "fc");  // trainable, in f32
    auto mm = kg::matmul(a, kg::ops::cast(w, dt, "narrow"), "mm");
    auto loss2 = kg::mse_loss(kg::ops::cast(mm, kg::DType::F32, "widen"), g2->input(kg::DType::F32, {3, 8}, "t"),
                              "loss");
    kg::Model model2(g2, {{"loss", loss2}}, kg::LoweringMode::Training);
    kg_test::expect_error([&] { model2.load(kg::Device::cpu(), {{3, 8}, {8, 8}, {3, 8}}); },
                          {"[nn.matmul @ mm]", name, "inference only"});
  }
}
