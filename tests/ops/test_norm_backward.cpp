// Backward of nn.batch_norm2d (training: through the batch statistics; inference: through the
// running ones) and nn.layer_norm (with and without elementwise affine). The CPU backward against
// finite differences (f64) and closed forms written out naively (f32); the CUDA backward kernels
// under the emulator (checked mode); every gradient element written; BatchNorm's running
// statistics updated by a training forward as PyTorch does, and given no gradient.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "kg/kg.hpp"
#include "ops/backward_check.hpp"
#include "ops/norm.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;
using kg_test::random_tensor;
namespace bwd = kg_test::bwd;

namespace {

using V = std::vector<kg::SymTensor>;

constexpr double kEps = 1e-5;

// A batch norm problem: weight, bias random, running mean in [-1, 1), running var in [0.5, 1.5).
bwd::Problem bn_problem(const std::vector<std::int64_t>& shape, kg::DType dtype, bool training,
                        std::mt19937_64& rng, double momentum = 0.1) {
  bwd::Problem p{
      bwd::record_op({shape}, dtype,
                     [momentum](const V& x) { return kg::nn::batch_norm2d(x[0], "", kEps, momentum); }),
      {random_tensor(rng, dtype, shape, -2.0, 3.0)},
      {},
      training,
      rng()};
  p.params = bwd::make_params(p, rng);
  p.params[3] = random_tensor(rng, dtype, {shape[1]}, 0.5, 1.5);
  return p;
}

bwd::Problem ln_problem(const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& normalized,
                        bool affine, kg::DType dtype, std::mt19937_64& rng) {
  bwd::Problem p{
      bwd::record_op({shape}, dtype,
                     [&](const V& x) { return kg::nn::layer_norm(x[0], normalized, "", kEps, affine); }),
      {random_tensor(rng, dtype, shape, -2.0, 3.0)},
      {},
      true,
      rng()};
  p.params = bwd::make_params(p, rng);
  return p;
}

}  // namespace

TEST(BatchNormBackward, TrainMatchesFiniteDifferencesAndKernels) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& shape : std::vector<std::vector<std::int64_t>>{{3, 4, 5, 5}, {2, 3, 1, 1}, {1, 2, 3, 7}}) {
    SCOPED_TRACE(kg::sizes_to_string(shape));
    bwd::check_f64(bn_problem(shape, kg::DType::F64, true, rng), true, 1e-5, 1e-7);
  }
}

TEST(BatchNormBackward, EvalMatchesFiniteDifferencesAndKernels) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& shape : std::vector<std::vector<std::int64_t>>{{3, 4, 5, 5}, {1, 3, 1, 1}}) {
    SCOPED_TRACE(kg::sizes_to_string(shape));
    // The kernels of a RuntimeOp built for inference.
    bwd::check_f64(bn_problem(shape, kg::DType::F64, false, rng), true, 1e-6, 1e-8,
                   kg::ops::batch_norm2d_runtime(shape[1], kEps, kg::DType::F64, false));
  }
}

TEST(BatchNormBackward, F32AgainstTheClosedForm) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // One range per channel, and 4 (4650 values per channel: the kernels' partial sums merged);
  // planes of 7×9 values, and of 6×8, whole 16-byte packs.
  for (const auto& shape : std::vector<std::vector<std::int64_t>>{{4, 3, 7, 9}, {5, 2, 30, 31}, {3, 4, 6, 8}})
  for (const bool training : {true, false}) {
    SCOPED_TRACE(kg::sizes_to_string(shape) + (training ? " train" : " eval"));
    const bwd::Problem p = bn_problem(shape, kg::DType::F32, training, rng);
    const kg::Tensor y = bwd::forward(p);
    const kg::Tensor dy = random_tensor(rng, kg::DType::F32, y.shape());
    // Per channel, naively in double: x̂ = (x - mean) / sqrt(var + eps);
    // db = Σ dy, dw = Σ dy x̂, dx = w / sqrt(var + eps) (dy - [train] (db + x̂ dw) / M).
    const std::int64_t n = shape[0], c = shape[1], hw = shape[2] * shape[3], m = n * hw;
    kg::Tensor dx = kg::Tensor::empty(kg::DType::F32, shape), dw = kg::Tensor::empty(kg::DType::F32, {c}),
               db = kg::Tensor::empty(kg::DType::F32, {c});
    const kg::Tensor& x = p.inputs[0];
    for (std::int64_t ch = 0; ch < c; ++ch) {
      auto at = [&](std::int64_t i) { return ((i / hw) * c + ch) * hw + i % hw; };
      double mean = p.params[2].item(ch), var = p.params[3].item(ch);
      if (training) {
        mean = 0;
        for (std::int64_t i = 0; i < m; ++i) mean += x.item(at(i)) / static_cast<double>(m);
        var = 0;
        for (std::int64_t i = 0; i < m; ++i)
          var += (x.item(at(i)) - mean) * (x.item(at(i)) - mean) / static_cast<double>(m);
      }
      const double r = 1 / std::sqrt(var + kEps);
      double sdy = 0, sdyx = 0;
      for (std::int64_t i = 0; i < m; ++i) {
        sdy += dy.item(at(i));
        sdyx += dy.item(at(i)) * (x.item(at(i)) - mean) * r;
      }
      db.data<float>()[ch] = static_cast<float>(sdy);
      dw.data<float>()[ch] = static_cast<float>(sdyx);
      for (std::int64_t i = 0; i < m; ++i) {
        const double xh = (x.item(at(i)) - mean) * r;
        const double g =
            training ? dy.item(at(i)) - (sdy + xh * sdyx) / static_cast<double>(m) : dy.item(at(i));
        dx.data<float>()[at(i)] = static_cast<float>(p.params[0].item(ch) * r * g);
      }
    }
    const std::vector<kg::Tensor> want = {dx, dw, db};
    // All gradients, then dx alone, then the parameters alone.
    for (const auto& w : std::vector<bwd::Wants>{{{true}, {true, true, false, false, false}},
                                                 {{true}, {false, false, false, false, false}},
                                                 {{false}, {true, true, false, false, false}}}) {
      const bwd::Grads cpu = bwd::cpu_backward(p, y, dy, w);
      const bwd::Grads emu = bwd::emulated_backward(
          p, y, dy, w, kg::ops::batch_norm2d_runtime(c, kEps, kg::DType::F32, training));
      const std::vector<const kg::Tensor*> cg = {&cpu.inputs[0], &cpu.params[0], &cpu.params[1]};
      const std::vector<const kg::Tensor*> eg = {&emu.inputs[0], &emu.params[0], &emu.params[1]};
      const std::vector<bool> wanted = {w.inputs[0], w.params[0], w.params[1]};
      for (std::size_t k = 0; k < 3; ++k) {
        if (!wanted[k]) continue;
        SCOPED_TRACE(k == 0 ? "dx" : k == 1 ? "dweight" : "dbias");
        EXPECT_TRUE(kg_test::all_written(*cg[k]));
        EXPECT_TRUE(kg_test::all_close(*cg[k], want[k], 1e-4, 1e-5)) << "CPU backward vs the closed form";
        EXPECT_TRUE(kg_test::all_written(*eg[k]));
        EXPECT_TRUE(kg_test::all_close(*eg[k], want[k], 1e-4, 1e-5))
            << "emulated backward vs the closed form";
      }
    }
  }
}

TEST(BatchNormBackward, TrainForwardUpdatesRunningStatisticsAsPyTorch) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const double momentum = 0.3;
  const std::vector<std::int64_t> shape = {3, 2, 4, 5};
  bwd::Problem p = bn_problem(shape, kg::DType::F64, true, rng, momentum);
  const kg::Tensor rm0 = p.params[2].clone(), rv0 = p.params[3].clone();
  p.params[4].data<std::int64_t>()[0] = 7;
  const kg::Tensor y = bwd::forward(p);
  const std::int64_t m = shape[0] * shape[2] * shape[3];
  for (std::int64_t ch = 0; ch < shape[1]; ++ch) {
    double mean = 0, sq = 0;
    for (std::int64_t i = 0; i < m; ++i) mean += p.inputs[0].item(((i / 20) * 2 + ch) * 20 + i % 20) / m;
    for (std::int64_t i = 0; i < m; ++i) {
      const double d = p.inputs[0].item(((i / 20) * 2 + ch) * 20 + i % 20) - mean;
      sq += d * d;
    }
    EXPECT_NEAR(p.params[2].item(ch), (1 - momentum) * rm0.item(ch) + momentum * mean, 1e-12);
    EXPECT_NEAR(p.params[3].item(ch), (1 - momentum) * rv0.item(ch) + momentum * sq / (m - 1), 1e-12);
  }
  EXPECT_EQ(p.params[4].data<std::int64_t>()[0], 8);
  // An inference forward leaves them alone.
  const kg::Tensor rm1 = p.params[2].clone();
  p.training = false;
  bwd::forward(p);
  EXPECT_TRUE(kg_test::all_close(p.params[2], rm1, 0, 0));
  EXPECT_EQ(p.params[4].data<std::int64_t>()[0], 8);
}

TEST(BatchNormBackward, RunningStatisticsAreNotTrainable) {
  std::mt19937_64 rng(3);
  const bwd::Problem p = bn_problem({2, 3, 2, 2}, kg::DType::F32, true, rng);
  const auto specs = p.op->parameters({kg::Shape::of({2, 3, 2, 2})});
  ASSERT_EQ(specs.size(), 5u);
  EXPECT_TRUE(specs[0].trainable);
  EXPECT_TRUE(specs[1].trainable);
  EXPECT_FALSE(specs[2].trainable);
  EXPECT_FALSE(specs[3].trainable);
  EXPECT_FALSE(specs[4].trainable);
  EXPECT_TRUE(p.op->backward_saves().inputs);
  EXPECT_FALSE(p.op->backward_saves().output);
  // The forward kernel has a train mode, chosen per run (batch statistics, running ones updated).
  kg::LowerContext lc;
  lc.input_dtypes = {kg::DType::F32};
  lc.output_dtype = kg::DType::F32;
  lc.input_shapes = {kg::Shape::of({2, 3, 2, 2})};
  lc.output_shape = lc.input_shapes[0];
  lc.mode = kg::LoweringMode::Training;
  const auto lowered = p.op->lower(lc);
  ASSERT_TRUE(lowered && lowered->runtime_op);
  EXPECT_TRUE(lowered->runtime_op->supports_train_mode());
  EXPECT_TRUE(lowered->runtime_op->depends_on_run());
}

TEST(BatchNormBackward, TrainNeedsMoreThanOneValuePerChannel) {
  std::mt19937_64 rng(5);
  const bwd::Problem p = bn_problem({1, 3, 1, 1}, kg::DType::F64, true, rng);
  const kg::Tensor dy = random_tensor(rng, kg::DType::F64, {1, 3, 1, 1});
  kg_test::expect_error([&] { bwd::cpu_backward(p, dy, dy, bwd::want_all(p)); },
                        {"training mode needs more than 1 value per channel", "[1, 3, 1, 1]"});
}

TEST(LayerNormBackward, MatchesFiniteDifferencesAndKernels) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const struct {
    std::vector<std::int64_t> shape, normalized;
  } cases[] = {
      {{3, 8}, {8}}, {{2, 3, 4}, {3, 4}}, {{5, 1}, {1}}, {{2, 1100}, {1100}}, {{4, 40}, {40}},
  };
  for (const bool affine : {true, false}) {
    for (const auto& c : cases) {
      SCOPED_TRACE(std::string(affine ? "affine " : "no affine ") + kg::sizes_to_string(c.shape));
      bwd::check_f64(ln_problem(c.shape, c.normalized, affine, kg::DType::F64, rng), true, 1e-5, 1e-7);
    }
  }
}

TEST(LayerNormBackward, F32AgainstTheClosedForm) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const bool affine : {true, false}) {
    // Rows a warp takes, and rows of more than 1024 elements that a block takes.
    for (const auto& shape : std::vector<std::vector<std::int64_t>>{{37, 70}, {3, 1500}}) {
      SCOPED_TRACE(std::string(affine ? "affine " : "no affine ") + kg::sizes_to_string(shape));
      const std::int64_t rows = shape[0], inner = shape[1];
      const bwd::Problem p = ln_problem(shape, {inner}, affine, kg::DType::F32, rng);
      const kg::Tensor y = bwd::forward(p);
      const kg::Tensor dy = random_tensor(rng, kg::DType::F32, y.shape());
      const kg::Tensor& x = p.inputs[0];
      kg::Tensor dx = kg::Tensor::empty(kg::DType::F32, shape);
      std::vector<double> dw(static_cast<std::size_t>(inner), 0.0), db(static_cast<std::size_t>(inner), 0.0);
      for (std::int64_t r = 0; r < rows; ++r) {
        double mean = 0, var = 0;
        for (std::int64_t j = 0; j < inner; ++j) mean += x.item(r * inner + j) / static_cast<double>(inner);
        for (std::int64_t j = 0; j < inner; ++j)
          var += std::pow(x.item(r * inner + j) - mean, 2) / static_cast<double>(inner);
        const double rs = 1 / std::sqrt(var + kEps);
        double mg = 0, mgx = 0;
        for (std::int64_t j = 0; j < inner; ++j) {
          const double g = dy.item(r * inner + j) * (affine ? p.params[0].item(j) : 1.0);
          const double xh = (x.item(r * inner + j) - mean) * rs;
          mg += g / static_cast<double>(inner);
          mgx += g * xh / static_cast<double>(inner);
          dw[static_cast<std::size_t>(j)] += dy.item(r * inner + j) * xh;
          db[static_cast<std::size_t>(j)] += dy.item(r * inner + j);
        }
        for (std::int64_t j = 0; j < inner; ++j) {
          const double g = dy.item(r * inner + j) * (affine ? p.params[0].item(j) : 1.0);
          const double xh = (x.item(r * inner + j) - mean) * rs;
          dx.data<float>()[r * inner + j] = static_cast<float>(rs * (g - mg - xh * mgx));
        }
      }
      const kg::Tensor want_dw =
          kg::Tensor::from_vector<float>({inner}, std::vector<float>(dw.begin(), dw.end()));
      const kg::Tensor want_db =
          kg::Tensor::from_vector<float>({inner}, std::vector<float>(db.begin(), db.end()));
      std::vector<bwd::Wants> wants = {{{true}, {}}};
      if (affine)
        wants = {{{true}, {true, true}},
                 {{true}, {false, false}},
                 {{false}, {true, false}},
                 {{false}, {false, true}}};
      for (const auto& w : wants) {
        const bwd::Grads cpu = bwd::cpu_backward(p, y, dy, w);
        const bwd::Grads emu = bwd::emulated_backward(p, y, dy, w);
        for (const auto* g : {&cpu, &emu}) {
          SCOPED_TRACE(g == &cpu ? "cpu" : "emulated");
          if (w.inputs[0]) {
            EXPECT_TRUE(kg_test::all_close(g->inputs[0], dx, 1e-3, 1e-4)) << "dx";
          }
          if (affine && w.params[0]) {
            EXPECT_TRUE(kg_test::all_close(g->params[0], want_dw, 1e-4, 1e-4)) << "dweight";
          }
          if (affine && w.params[1]) {
            EXPECT_TRUE(kg_test::all_close(g->params[1], want_db, 1e-4, 1e-4)) << "dbias";
          }
        }
      }
    }
  }
}

TEST(NormBackward, GradientCheckerPasses) {
  for (const kg::DType dt : {kg::DType::F64, kg::DType::F32}) {
    SCOPED_TRACE(kg::dtype_name(dt));
    // BatchNorm in training: FD through the batch statistics, the op's kernels (training).
    bwd::check_with_checker(
        bwd::record_op({{2, 3, 4, 4}}, dt, [](const V& x) { return kg::nn::batch_norm2d(x[0]); }),
        {{2, 3, 4, 4}}, dt, true, true, 1e-4, 1e-5);
    // In inference: the CPU backward (the op's kernels run in training mode).
    bwd::check_with_checker(
        bwd::record_op({{2, 3, 4, 4}}, dt, [](const V& x) { return kg::nn::batch_norm2d(x[0]); }),
        {{2, 3, 4, 4}}, dt, false, false, 1e-4, 1e-5);
    for (const bool affine : {true, false}) {
      SCOPED_TRACE(affine ? "layer_norm affine" : "layer_norm");
      bwd::check_with_checker(bwd::record_op({{3, 2, 5}}, dt,
                                             [affine](const V& x) {
                                               return kg::nn::layer_norm(x[0], {2, 5}, "", kEps, affine);
                                             }),
                              {{3, 2, 5}}, dt, true, true, 1e-4, 1e-5);
    }
  }
}

TEST(NormBackward, TrainsThroughTheCpuRuntimeWithTheOtherFamilies) {
  // x -> batch_norm2d -> relu -> permute -> slice (step 2) -> concat with itself -> reshape ->
  // layer_norm -> log_softmax -> * 2 - t -> mse_loss(·, t): the parameter gradients of the
  // training runtime against finite differences of its own train-mode forward.
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto g = kg::Graph::create();
  const kg::SymTensor x = g->input(kg::DType::F64, {kg::Dim::named("batch"), 3, 5, 5}, "x");
  const kg::SymTensor t = g->input(kg::DType::F64, {kg::Dim::named("batch"), 90}, "t");
  kg::SymTensor h = kg::relu(kg::nn::batch_norm2d(x, "bn"));
  h = kg::slice(kg::permute(h, {0, 2, 3, 1}), 1, 0, 5, 2);  // [N, 3, 5, 3]
  h = kg::reshape(kg::concat({h, h}, -1), {-1, 90});
  h = kg::log_softmax(kg::nn::layer_norm(h, {90}, "ln"), -1);
  h = kg::sub(kg::mul(h, 2.0), t);
  const kg::SymTensor loss = kg::mse_loss(h, t, "loss");
  kg::Model model(g, {{"loss", loss}}, kg::LoweringMode::Training);
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  kg::LoadedModel m = model.load(kg::Device::cpu(), {{4, 3, 5, 5}, {4, 90}}, opt);
  std::map<std::string, kg::Tensor> params;
  for (const char* name : {"bn.weight", "bn.bias", "ln.weight", "ln.bias"}) {
    const auto shape = m.state_dict().at(name).shape();
    params[name] = random_tensor(rng, kg::DType::F64, shape, 0.5, 1.5);
  }
  m.load_state_dict(params, false);
  m.set_training(true);
  const kg::Tensor xin = random_tensor(rng, kg::DType::F64, {4, 3, 5, 5}, -1, 2);
  const kg::Tensor tin = random_tensor(rng, kg::DType::F64, {4, 90});
  m.zero_grad();
  m.forward({xin, tin});
  m.backward();
  auto loss_at = [&](const std::string& name, std::int64_t k, double v) {
    kg::Tensor p = params.at(name).clone();
    p.data<double>()[k] = v;
    m.load_state_dict({{name, p}}, false);
    const double l = m.forward({xin, tin}).at(0).item(0);
    m.load_state_dict({{name, params.at(name)}}, false);
    return l;
  };
  int nonzero = 0;
  double largest = 0;
  for (const auto& [name, p] : params) {
    SCOPED_TRACE(name);
    const kg::Tensor got = m.grad(name);
    for (std::int64_t k = 0; k < p.numel(); ++k) {
      const double v = p.item(k), step = 1e-6;
      const double fd = (loss_at(name, k, v + step) - loss_at(name, k, v - step)) / (2 * step);
      EXPECT_NEAR(got.item(k), fd, 1e-6 + 1e-5 * std::abs(fd)) << "element " << k;
      nonzero += fd != 0;
      largest = std::max(largest, std::abs(fd));
    }
  }
  EXPECT_GT(nonzero, 150) << "the gradients should be mostly nonzero";
  EXPECT_GT(largest, 1e-3);
}
