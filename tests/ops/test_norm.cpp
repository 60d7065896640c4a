#include <cmath>
#include <cstring>

#include "compile/compiler.hpp"
#include "lower/dry_run.hpp"
#include "ops/norm.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

double tol(kg::DType dt) { return dt == kg::DType::F32 ? 2e-5 : 1e-12; }

// BatchNorm over [N, C, H, W] in double: with the given per-channel mean/var.
kg::Tensor naive_bn(const kg::Tensor& x, const kg::Tensor& w, const kg::Tensor& b,
                    const std::vector<double>& mean, const std::vector<double>& var, double eps) {
  const std::int64_t n = x.dim(0), c = x.dim(1), hw = x.dim(2) * x.dim(3);
  kg::Tensor y = kg::Tensor::empty(kg::DType::F64, x.shape());
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t ch = 0; ch < c; ++ch)
      for (std::int64_t j = 0; j < hw; ++j) {
        const std::int64_t at = (i * c + ch) * hw + j;
        const auto k = static_cast<std::size_t>(ch);
        y.data<double>()[at] = (x.item(at) - mean[k]) / std::sqrt(var[k] + eps) * w.item(ch) + b.item(ch);
      }
  return y;
}

// Per-channel mean and biased variance of [N, C, H, W].
void batch_stats(const kg::Tensor& x, std::vector<double>& mean, std::vector<double>& var) {
  const std::int64_t n = x.dim(0), c = x.dim(1), hw = x.dim(2) * x.dim(3);
  mean.assign(static_cast<std::size_t>(c), 0.0);
  var.assign(static_cast<std::size_t>(c), 0.0);
  for (std::int64_t ch = 0; ch < c; ++ch) {
    double s = 0, s2 = 0;
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = 0; j < hw; ++j) s += x.item((i * c + ch) * hw + j);
    const double m = s / static_cast<double>(n * hw);
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = 0; j < hw; ++j) {
        const double d = x.item((i * c + ch) * hw + j) - m;
        s2 += d * d;
      }
    mean[static_cast<std::size_t>(ch)] = m;
    var[static_cast<std::size_t>(ch)] = s2 / static_cast<double>(n * hw);
  }
}

std::vector<double> values(const kg::Tensor& t) {
  std::vector<double> v;
  for (std::int64_t i = 0; i < t.numel(); ++i) v.push_back(t.item(i));
  return v;
}

// LayerNorm over the trailing `inner` elements of each row, in double.
kg::Tensor naive_ln(const kg::Tensor& x, std::int64_t inner, const kg::Tensor* w, const kg::Tensor* b,
                    double eps) {
  kg::Tensor y = kg::Tensor::empty(kg::DType::F64, x.shape());
  for (std::int64_t r = 0; r < x.numel() / inner; ++r) {
    double s = 0, s2 = 0;
    for (std::int64_t j = 0; j < inner; ++j) s += x.item(r * inner + j);
    const double m = s / static_cast<double>(inner);
    for (std::int64_t j = 0; j < inner; ++j) s2 += (x.item(r * inner + j) - m) * (x.item(r * inner + j) - m);
    const double inv = 1.0 / std::sqrt(s2 / static_cast<double>(inner) + eps);
    for (std::int64_t j = 0; j < inner; ++j) {
      double v = (x.item(r * inner + j) - m) * inv;
      if (w) v = v * w->item(j) + b->item(j);
      y.data<double>()[r * inner + j] = v;
    }
  }
  return y;
}

// Runs a one-input graph lowered for training, in train mode (or not), with poisoned buffers.
kg::Tensor run_training_graph(const std::function<kg::SymTensor(const kg::SymTensor&)>& build,
                              const kg::Tensor& x, const std::map<std::string, kg::Tensor>& params,
                              bool train) {
  kg::Shape s = kg::Shape::of(x.shape());
  s[0] = kg::Dim::named("batch");
  auto [in, g] = kg::SymTensor::input(x.dtype(), s, "x");
  kg::Model model(g, {build(in)}, kg::LoweringMode::Training);
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  kg::LoadedModel m = model.load(kg::Device::cpu(), {x.shape()}, opt);
  m.load_state_dict(params, false);
  m.set_training(train);
  kg::Tensor y = m.forward({x})[0];
  EXPECT_TRUE(kg_test::all_written(y));
  return y;
}

// kg_test::check_lowering with the given parameters (it keeps the default ones, which make a
// batch norm nearly the identity): a dry run at sm_90 where NVRTC is present, returning its
// launches, and where a GPU is present the GPU output compared with the CPU's.
std::optional<kg::lower::DryRun> check_lowering_with_params(
    const std::function<kg::SymTensor(const kg::SymTensor&)>& build, const kg::Tensor& x,
    const std::map<std::string, kg::Tensor>& params, double rtol, double atol) {
  kg::Shape s = kg::Shape::of(x.shape());
  s[0] = kg::Dim::named("batch");
  auto [in, g] = kg::SymTensor::input(x.dtype(), s, "x");
  kg::Model model(g, {build(in)});
  std::optional<kg::lower::DryRun> dry;
  if (kg::compile::Compiler::available()) dry = kg::lower::dry_run(model, {x.shape()}, 90);
  if (!kg::Device::cuda_available()) return dry;
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  kg::LoadedModel cpu = model.load(kg::Device::cpu(), {x.shape()}, opt);
  kg::LoadedModel gpu = model.load(kg::Device::cuda(), {x.shape()}, opt);
  cpu.load_state_dict(params, false);
  gpu.load_state_dict(params, false);
  const kg::Tensor want = cpu.forward({x})[0], got = gpu.forward({x})[0];
  EXPECT_TRUE(kg_test::all_written(got)) << "the kernel left output elements unwritten";
  EXPECT_TRUE(kg_test::all_close(got, want, rtol, atol)) << "the GPU output differs from the CPU's";
  return dry;
}

}  // namespace

// ---- BatchNorm2d ----

TEST(BatchNorm2d, ShapeAndParameters) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F64, {kg::Dim::named("batch"), 6, kg::dynamic, 9});
  auto y = kg::nn::batch_norm2d(x, "bn", 2e-3, 0.25);
  EXPECT_EQ(y.shape().to_string(), "[batch, 6, ?, 9]");
  EXPECT_EQ(y.dtype(), kg::DType::F64);
  const kg::Node& n = g->node(y.node());
  EXPECT_EQ((*n.op)->attributes(), "eps=0.002 momentum=0.25");
  EXPECT_DOUBLE_EQ(kg::ops::batch_norm_eps(n.op->op()), 2e-3);
  ASSERT_NE(n.op->as<kg::ops::BatchNorm2dOp>(), nullptr);
  EXPECT_DOUBLE_EQ(n.op->as<kg::ops::BatchNorm2dOp>()->momentum(), 0.25);
  // PyTorch's names, order, shapes and initial values.
  ASSERT_EQ(n.params.size(), 5u);
  const char* names[] = {"bn.weight", "bn.bias", "bn.running_mean", "bn.running_var",
                         "bn.num_batches_tracked"};
  const double init[] = {1, 0, 0, 1, 0};
  for (std::size_t i = 0; i < 5; ++i) {
    SCOPED_TRACE(names[i]);
    EXPECT_EQ(n.params[i].name, names[i]);
    EXPECT_EQ(n.params[i].init.kind, kg::ParamInit::Kind::Constant);
    EXPECT_EQ(n.params[i].init.a, init[i]);
    EXPECT_EQ(n.params[i].trainable, i < 2);
    EXPECT_EQ(n.params[i].dtype, i < 4 ? kg::DType::F64 : kg::DType::I64);
    EXPECT_EQ(n.params[i].shape, i < 4 ? std::vector<std::int64_t>{6} : std::vector<std::int64_t>{});
  }
  // The defaults, as util::cat prints them.
  auto y2 = kg::nn::batch_norm2d(x, "bn2");
  EXPECT_EQ((*g->node(y2.node()).op)->attributes(), "eps=1e-05 momentum=0.1");
}

TEST(BatchNorm2d, RejectsBadInputs) {
  auto [x3, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 3, 8});
  kg_test::expect_error([&] { kg::nn::batch_norm2d(x3, "bn"); },
                        {"[nn.batch_norm2d @ bn]", "4-D", "[?, 3, 8]"});
  auto [xc, g2] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, kg::dynamic, 4, 4});
  kg_test::expect_error([&] { kg::nn::batch_norm2d(xc, "bn"); },
                        {"[nn.batch_norm2d @ bn]", "known channel count", "[?, ?, 4, 4]"});
  auto [xi, g3] = kg::SymTensor::input(kg::DType::I32, {kg::dynamic, 3, 4, 4});
  kg_test::expect_error([&] { kg::nn::batch_norm2d(xi, "bn"); },
                        {"[nn.batch_norm2d @ bn]", "f32 and f64", "i32"});
  auto [x, g4] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 4, 5, 5});
  kg_test::expect_error([&] { kg::nn::batch_norm2d(x, "bn", -1.0); }, {"nn.batch_norm2d", "eps", "-1"});
  // The op itself, given a channel count the input does not have, or another dtype.
  kg_test::expect_error(
      [&] {
        x.record_custom(kg::CustomData::make<kg::ops::BatchNorm2dOp>(3, 1e-5, 0.1, kg::DType::F32), {}, {},
                        "b3");
      },
      {"[nn.batch_norm2d @ b3]", "C = 3", "[?, 4, 5, 5]"});
  kg_test::expect_error(
      [&] {
        x.record_custom(kg::CustomData::make<kg::ops::BatchNorm2dOp>(4, 1e-5, 0.1, kg::DType::F64), {}, {},
                        "b4");
      },
      {"[nn.batch_norm2d @ b4]", "f32", "f64"});
  // batch_norm_eps on another op.
  auto ln = kg::nn::layer_norm(x, {5}, "ln");
  kg_test::expect_error([&] { kg::ops::batch_norm_eps(g4->node(ln.node()).op->op()); },
                        {"nn.layer_norm", "not nn.batch_norm2d"});
}

TEST(BatchNorm2d, InferenceMatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t batch : {1, 7, 64}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      SCOPED_TRACE(::testing::Message() << "batch " << batch << " " << kg::dtype_name(dt));
      kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, 5, 3, 4}, -3, 3);
      kg::Tensor w = kg_test::random_tensor(rng, dt, {5});
      kg::Tensor b = kg_test::random_tensor(rng, dt, {5});
      kg::Tensor rm = kg_test::random_tensor(rng, dt, {5});
      kg::Tensor rv = kg_test::random_tensor(rng, dt, {5}, 0.2, 2.0);
      const double eps = 1e-3;
      kg::Tensor y = kg_test::run_op(
          [&](const kg::SymTensor& t) { return kg::nn::batch_norm2d(t, "bn", eps); }, x,
          {{"bn.weight", w}, {"bn.bias", b}, {"bn.running_mean", rm}, {"bn.running_var", rv}});
      EXPECT_TRUE(kg_test::all_close(y, naive_bn(x, w, b, values(rm), values(rv), eps), tol(dt), tol(dt)));
    }
  }
}

TEST(BatchNorm2d, DefaultParametersNormaliseWithUnitStatistics) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F64, {3, 2, 4, 4}, -5, 5);
  kg::Tensor y = kg_test::run_op([](const kg::SymTensor& t) { return kg::nn::batch_norm2d(t, "bn"); }, x);
  kg::Tensor ones = kg::Tensor::zeros(kg::DType::F64, {2});
  ones.fill(1.0);
  EXPECT_TRUE(kg_test::all_close(
      y, naive_bn(x, ones, kg::Tensor::zeros(kg::DType::F64, {2}), {0, 0}, {1, 1}, 1e-5), 1e-12, 1e-12));
}

TEST(BatchNorm2d, TrainingUsesBatchStatistics) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t batch : {1, 7, 64}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      SCOPED_TRACE(::testing::Message() << "batch " << batch << " " << kg::dtype_name(dt));
      kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, 3, 4, 5}, -2, 4);
      kg::Tensor w = kg_test::random_tensor(rng, dt, {3});
      kg::Tensor b = kg_test::random_tensor(rng, dt, {3});
      kg::Tensor rm = kg_test::random_tensor(rng, dt, {3});
      kg::Tensor rv = kg_test::random_tensor(rng, dt, {3}, 0.5, 2.0);
      std::map<std::string, kg::Tensor> params{
          {"bn.weight", w}, {"bn.bias", b}, {"bn.running_mean", rm}, {"bn.running_var", rv}};
      auto build = [](const kg::SymTensor& t) { return kg::nn::batch_norm2d(t, "bn"); };
      std::vector<double> mean, var;
      batch_stats(x, mean, var);
      EXPECT_TRUE(kg_test::all_close(run_training_graph(build, x, params, true),
                                     naive_bn(x, w, b, mean, var, 1e-5), tol(dt) * 5, tol(dt) * 5));
      // The same loaded graph out of train mode uses the running statistics.
      EXPECT_TRUE(kg_test::all_close(run_training_graph(build, x, params, false),
                                     naive_bn(x, w, b, values(rm), values(rv), 1e-5), tol(dt), tol(dt)));
    }
  }
}

TEST(BatchNorm2d, TrainingRejectsOneValuePerChannel) {
  kg::Tensor x = kg::Tensor::zeros(kg::DType::F32, {1, 3, 1, 1});
  kg_test::expect_error(
      [&] {
        run_training_graph([](const kg::SymTensor& t) { return kg::nn::batch_norm2d(t, "bn"); }, x, {}, true);
      },
      {"[nn.batch_norm2d @ bn]", "more than 1 value per channel", "[1, 3, 1, 1]"});
}

TEST(BatchNorm2d, MatchesPyTorch) {
  std::map<std::string, std::string> meta;
  auto fx = kg_test::fixture("norm_batchnorm.safetensors", &meta);
  const double eps = std::stod(meta.at("eps"));
  for (std::string tag : {"f32", "f64"}) {
    SCOPED_TRACE(tag);
    const kg::Tensor& x = fx.at("x_" + tag);
    std::map<std::string, kg::Tensor> params;
    for (std::string p : {"weight", "bias", "running_mean", "running_var"})
      params["bn." + p] = fx.at(p + "_" + tag);
    auto build = [&](const kg::SymTensor& t) { return kg::nn::batch_norm2d(t, "bn", eps); };
    const double t = tol(x.dtype());
    EXPECT_TRUE(kg_test::all_close(kg_test::run_op(build, x, params), fx.at("y_eval_" + tag), t, t));
    EXPECT_TRUE(kg_test::all_close(run_training_graph(build, x, params, true), fx.at("y_train_" + tag), 5 * t,
                                   5 * t));
  }
}

TEST(BatchNorm2d, GpuLoweringCompilesAndMatchesTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t batch : {1, 7, 96}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      SCOPED_TRACE(::testing::Message() << "batch " << batch << " " << kg::dtype_name(dt));
      kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, 6, 9, 13}, -3, 3);
      const std::map<std::string, kg::Tensor> params{
          {"bn.weight", kg_test::random_tensor(rng, dt, {6})},
          {"bn.bias", kg_test::random_tensor(rng, dt, {6})},
          {"bn.running_mean", kg_test::random_tensor(rng, dt, {6})},
          {"bn.running_var", kg_test::random_tensor(rng, dt, {6}, 0.2, 2.0)}};
      // Scale and shift are computed in double as on the CPU; only y = x*scale + shift may round
      // differently (a fused multiply-add).
      auto dry = check_lowering_with_params(
          [](const kg::SymTensor& t) { return kg::nn::batch_norm2d(t, "bn", 1e-3); }, x, params,
          dt == kg::DType::F32 ? 1e-5 : 1e-12, 1e-6);
      if (!dry) continue;
      ASSERT_EQ(dry->launches.steps.size(), 1u);
      const auto& step = dry->launches.steps[0];
      // Per-channel scale and shift (8-byte aligned), then 3 doubles per (channel, range): the
      // ranges of at least 1024 values of the 9 * 13 * batch per channel (1 at batch 1 and 7, 10 at 96).
      const std::size_t ranges = batch == 96 ? 10 : 1;
      EXPECT_EQ(step.scratch_bytes, (2 * 6 * kg::dtype_size(dt) + 7) / 8 * 8 + 3 * 8 * 6 * ranges);
      ASSERT_EQ(step.launches.size(), 2u);  // inference: the scale and shift, then y
      for (const auto& l : step.launches)
        EXPECT_EQ(l.entry, dt == kg::DType::F32 ? "kg_batch_norm2d_f32" : "kg_batch_norm2d_f64");
      EXPECT_EQ(step.launches[0].launch.grid.x, 1u);  // 6 channels
      // Four elements per thread, 256 threads per block.
      EXPECT_EQ(step.launches[1].launch.grid.x, static_cast<unsigned>((batch * 6 * 9 * 13 + 1023) / 1024));
    }
  }
}

TEST(BatchNorm2d, GpuRuntimeSharesItsScratchBetweenItsLaunches) {
  // The partial moments (train mode) and the per-channel scale and shift go to scratch; the
  // launches after the one that writes them read them.
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 4, 5, 5});
  auto y = kg::nn::batch_norm2d(x, "bn");
  kg::LowerContext lc;
  lc.node = "bn";
  lc.input_dtypes = {kg::DType::F32};
  lc.output_dtype = kg::DType::F32;
  lc.input_shapes = {x.shape()};
  lc.output_shape = y.shape();
  auto lowered = g->node(y.node()).op->op().lower(lc);
  ASSERT_TRUE(lowered.has_value());
  EXPECT_EQ(lowered->entry_point, "kg_batch_norm2d_f32");
  kg::LaunchTensors t;
  t.inputs = {{0x100, {2, 4, 5, 5}, kg::DType::F32}};
  for (kg::DevicePtr p : {0x200, 0x210, 0x220, 0x230}) t.params.push_back({p, {4}, kg::DType::F32});
  t.params.push_back({0x300, {}, kg::DType::I64});
  t.output = {0x400, {2, 4, 5, 5}, kg::DType::F32};
  // Scale and shift, then one range's partial moments per channel (50 values each).
  EXPECT_EQ(lowered->runtime_op->scratch_bytes(t), 2 * 4 * sizeof(float) + 3 * 4 * sizeof(double));
  t.scratch = 0x500;
  for (bool training : {false, true}) {
    t.training = training;
    const std::vector<kg::Launch> ls = lowered->runtime_op->launches(t);
    ASSERT_EQ(ls.size(), training ? 3u : 2u);  // train mode adds the partial moments first
    for (const kg::Launch& l : ls) {
      EXPECT_EQ(l.entry, "");  // the lowering's entry point
      ASSERT_EQ(l.args.size(), 18u);
      kg::DevicePtr scratch = 0, partials = 0;
      std::memcpy(&scratch, l.args.args()[7].data().data(), sizeof scratch);
      std::memcpy(&partials, l.args.args()[8].data().data(), sizeof partials);
      EXPECT_EQ(scratch, 0x500u);
      EXPECT_EQ(partials, 0x500u + 2 * 4 * sizeof(float));
    }
  }
}

// ---- LayerNorm ----

TEST(LayerNorm, ShapeAndParameters) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 7, 4, 5});
  auto y = kg::nn::layer_norm(x, {4, 5}, "ln");
  EXPECT_EQ(y.shape().to_string(), "[batch, 7, 4, 5]");
  const auto& p = g->node(y.node()).params;
  ASSERT_EQ(p.size(), 2u);
  EXPECT_EQ(p[0].name, "ln.weight");
  EXPECT_EQ(p[0].shape, (std::vector<std::int64_t>{4, 5}));
  EXPECT_EQ(p[0].init.a, 1.0);
  EXPECT_EQ(p[1].name, "ln.bias");
  EXPECT_EQ(p[1].init.a, 0.0);
  EXPECT_TRUE(p[0].trainable && p[1].trainable);
  auto z = kg::nn::layer_norm(x, {5}, "plain", 1e-5, false);
  EXPECT_TRUE(g->node(z.node()).params.empty());
  // A dynamic trailing dim is accepted at record time and checked at load.
  auto [d, g2] = kg::SymTensor::input(kg::DType::F32, {2, kg::dynamic});
  EXPECT_EQ(kg::nn::layer_norm(d, {6}, "ln").shape().to_string(), "[2, ?]");
}

TEST(LayerNorm, RejectsBadInputs) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 3, 5});
  kg_test::expect_error(
      [&] {
        kg::nn::layer_norm(x, {4, 5}, "ln");
      },
      {"[nn.layer_norm @ ln]", "[4, 5]", "[?, 3, 5]", "dim 1 is 3, expected 4"});
  kg_test::expect_error(
      [&] {
        kg::nn::layer_norm(x, {2, 3, 5, 1}, "ln");
      },
      {"[nn.layer_norm @ ln]", "4 dims", "rank 3"});
  kg_test::expect_error([&] { kg::nn::layer_norm(x, {}, "ln"); },
                        {"[nn.layer_norm @ ln]", "at least one dim"});
  kg_test::expect_error([&] { kg::nn::layer_norm(x, {0}, "ln"); },
                        {"[nn.layer_norm @ ln]", "positive", "[0]"});
  auto [xi, g2] = kg::SymTensor::input(kg::DType::I64, {kg::dynamic, 5});
  kg_test::expect_error([&] { kg::nn::layer_norm(xi, {5}, "ln"); },
                        {"[nn.layer_norm @ ln]", "f32 and f64", "i64"});
  // A dynamic trailing dim that turns out wrong at load.
  auto [d, g3] = kg::SymTensor::input(kg::DType::F32, {2, kg::dynamic}, "x");
  auto y = kg::nn::layer_norm(d, {6}, "ln");
  kg::Model model(g3, {y});
  kg_test::expect_error(
      [&] {
        model.load(kg::Device::cpu(), {{2, 7}});
      },
      {"[nn.layer_norm @ ln]", "at load", "[2, 7]", "dim 1 is 7, expected 6"});
}

TEST(LayerNorm, MatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t batch : {1, 7, 64}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      SCOPED_TRACE(::testing::Message() << "batch " << batch << " " << kg::dtype_name(dt));
      kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, 4, 6}, -3, 5);
      kg::Tensor w = kg_test::random_tensor(rng, dt, {4, 6});
      kg::Tensor b = kg_test::random_tensor(rng, dt, {4, 6});
      kg::Tensor y = kg_test::run_op(
          [](const kg::SymTensor& t) {
            return kg::nn::layer_norm(t, {4, 6}, "ln", 1e-4);
          },
          x, {{"ln.weight", w}, {"ln.bias", b}});
      EXPECT_TRUE(kg_test::all_close(y, naive_ln(x, 24, &w, &b, 1e-4), tol(dt), tol(dt)));
      kg::Tensor z = kg_test::run_op(
          [](const kg::SymTensor& t) { return kg::nn::layer_norm(t, {6}, "ln", 1e-5, false); }, x);
      EXPECT_TRUE(kg_test::all_close(z, naive_ln(x, 6, nullptr, nullptr, 1e-5), tol(dt), tol(dt)));
    }
  }
}

TEST(LayerNorm, MatchesPyTorch) {
  std::map<std::string, std::string> meta;
  auto fx = kg_test::fixture("norm_layernorm.safetensors", &meta);
  const double eps = std::stod(meta.at("eps"));
  for (std::string tag : {"f32", "f64"}) {
    SCOPED_TRACE(tag);
    const kg::Tensor& x = fx.at("x_" + tag);
    const double t = tol(x.dtype());
    kg::Tensor y = kg_test::run_op(
        [&](const kg::SymTensor& s) {
          return kg::nn::layer_norm(s, {3, 6}, "ln", eps);
        },
        x, {{"ln.weight", fx.at("weight_" + tag)}, {"ln.bias", fx.at("bias_" + tag)}});
    EXPECT_TRUE(kg_test::all_close(y, fx.at("y_affine_" + tag), t, t));
    kg::Tensor z = kg_test::run_op(
        [&](const kg::SymTensor& s) { return kg::nn::layer_norm(s, {6}, "ln", eps, false); }, x);
    EXPECT_TRUE(kg_test::all_close(z, fx.at("y_plain_" + tag), t, t));
  }
}

TEST(LayerNorm, GpuLoweringCompilesAndMatchesTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // Rows of 33 elements take one warp each, rows of 1200 one block each.
  const std::vector<std::vector<std::int64_t>> layouts = {{33}, {4, 300}};
  for (std::int64_t batch : {1, 7, 130}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      for (const auto& normalized : layouts) {
        for (bool affine : {true, false}) {
          SCOPED_TRACE(::testing::Message()
                       << "batch " << batch << " " << kg::dtype_name(dt) << " normalized "
                       << kg::sizes_to_string(normalized) << " affine " << affine);
          std::vector<std::int64_t> shape{batch, 3};
          shape.insert(shape.end(), normalized.begin(), normalized.end());
          kg::Tensor x = kg_test::random_tensor(rng, dt, shape, -3, 5);
          std::map<std::string, kg::Tensor> params;
          if (affine) {
            params["ln.weight"] = kg_test::random_tensor(rng, dt, normalized);
            params["ln.bias"] = kg_test::random_tensor(rng, dt, normalized);
          }
          // The kernel sums in the input's precision, the CPU in double: f32 needs atol 1e-5.
          auto dry = check_lowering_with_params(
              [&](const kg::SymTensor& t) { return kg::nn::layer_norm(t, normalized, "ln", 1e-4, affine); },
              x, params, dt == kg::DType::F32 ? 1e-5 : 1e-12, dt == kg::DType::F32 ? 1e-5 : 1e-12);
          if (!dry) continue;
          const auto& step = dry->launches.steps.at(0);
          EXPECT_EQ(step.launches.at(0).entry,
                    dt == kg::DType::F32 ? "kg_layer_norm_f32" : "kg_layer_norm_f64");
          const std::int64_t rows = batch * 3, blocks = normalized.size() == 1 ? (rows + 7) / 8 : rows;
          EXPECT_EQ(step.launches.at(0).launch.grid.x, static_cast<unsigned>(blocks));
        }
      }
    }
  }
}
