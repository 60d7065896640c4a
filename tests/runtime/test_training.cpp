// The training runtime on the CPU, with small custom ops written here: gradients through a
// value used twice, parameter gradients summed over backward calls, optimiser updates against
// the update rules written out, checkpoints, and each misuse.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "kg/kg.hpp"
#include "support/test_util.hpp"

namespace {

using kg::CpuBackwardContext;
using kg::CpuContext;
using kg::DType;
using kg::Shape;
using kg::SymTensor;
using kg::Tensor;

// y = w * x with a learnable scalar w.
class ScaleOp final : public kg::CustomOp {
 public:
  explicit ScaleOp(double init) : init_(init) {}
  std::string name() const override { return "test.scale"; }
  Shape infer_output_shape(const std::vector<Shape>& in) const override { return in.at(0); }
  std::vector<kg::ParamSpec> parameters(const std::vector<Shape>&) const override {
    return {{"w", {1}, DType::F64, kg::ParamInit::constant(init_), true}};
  }
  void cpu_forward(CpuContext& c) const override {
    const double w = c.params[0].data<double>()[0];
    const double* x = c.inputs[0].data<double>();
    double* y = c.output.data<double>();
    for (std::int64_t i = 0; i < c.output.numel(); ++i) y[i] = w * x[i];
  }
  bool has_cpu_backward() const override { return true; }
  void cpu_backward(CpuBackwardContext& c) const override {
    const double w = c.params[0].data<double>()[0];
    const double* x = c.inputs[0].data<double>();
    const double* dy = c.grad_output.data<double>();
    const std::int64_t n = c.grad_output.numel();
    if (c.wants_input_grad(0)) {
      double* dx = c.grad_inputs[0].data<double>();
      for (std::int64_t i = 0; i < n; ++i) dx[i] = w * dy[i];
    }
    if (c.wants_param_grad(0)) {
      double s = 0;
      for (std::int64_t i = 0; i < n; ++i) s += x[i] * dy[i];
      c.grad_params[0].data<double>()[0] = s;
    }
  }

 private:
  double init_;
};

// y = x², saving only its input.
class SquareOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.square"; }
  Shape infer_output_shape(const std::vector<Shape>& in) const override { return in.at(0); }
  void cpu_forward(CpuContext& c) const override {
    const double* x = c.inputs[0].data<double>();
    double* y = c.output.data<double>();
    for (std::int64_t i = 0; i < c.output.numel(); ++i) y[i] = x[i] * x[i];
  }
  bool has_cpu_backward() const override { return true; }
  void cpu_backward(CpuBackwardContext& c) const override {
    const double* x = c.inputs[0].data<double>();
    const double* dy = c.grad_output.data<double>();
    double* dx = c.grad_inputs[0].data<double>();
    for (std::int64_t i = 0; i < c.grad_output.numel(); ++i) dx[i] = 2 * x[i] * dy[i];
  }
};

// y = a + b (same shapes); its backward needs nothing saved.
class AddOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.add"; }
  Shape infer_output_shape(const std::vector<Shape>& in) const override { return in.at(0); }
  void cpu_forward(CpuContext& c) const override {
    const double* a = c.inputs[0].data<double>();
    const double* b = c.inputs[1].data<double>();
    double* y = c.output.data<double>();
    for (std::int64_t i = 0; i < c.output.numel(); ++i) y[i] = a[i] + b[i];
  }
  bool has_cpu_backward() const override { return true; }
  kg::BackwardSaves backward_saves() const override { return {false, false}; }
  void cpu_backward(CpuBackwardContext& c) const override {
    EXPECT_EQ(c.inputs[0].raw(), nullptr) << "an input the op did not ask for was passed";
    const double* dy = c.grad_output.data<double>();
    for (std::size_t k = 0; k < 2; ++k) {
      if (!c.wants_input_grad(k)) continue;
      double* dx = c.grad_inputs[k].data<double>();
      for (std::int64_t i = 0; i < c.grad_output.numel(); ++i) dx[i] = dy[i];
    }
  }
};

// Sum of every element: a scalar [].
class SumOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.sum"; }
  Shape infer_output_shape(const std::vector<Shape>&) const override { return Shape(std::vector<kg::Dim>{}); }
  void cpu_forward(CpuContext& c) const override {
    double s = 0;
    for (std::int64_t i = 0; i < c.inputs[0].numel(); ++i) s += c.inputs[0].data<double>()[i];
    c.output.data<double>()[0] = s;
  }
  bool has_cpu_backward() const override { return true; }
  kg::BackwardSaves backward_saves() const override { return {false, false}; }
  void cpu_backward(CpuBackwardContext& c) const override {
    const double g = c.grad_output.data<double>()[0];
    for (std::int64_t i = 0; i < c.grad_inputs[0].numel(); ++i) c.grad_inputs[0].data<double>()[i] = g;
  }
};

// Identity with a CPU forward and no backward anywhere.
class NoBackwardOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.no_backward"; }
  Shape infer_output_shape(const std::vector<Shape>& in) const override { return in.at(0); }
  void cpu_forward(CpuContext& c) const override {
    std::memcpy(c.output.raw(), c.inputs[0].raw(), c.output.nbytes());
  }
};

SymTensor rec(const SymTensor& x, const kg::CustomData& op, std::vector<SymTensor> others = {},
              const std::string& name = "") {
  return x.record_custom(op, others, std::nullopt, name);
}

// loss = sum(w2 * (h + h²)) with h = w1 * x: h feeds two consumers.
struct Net {
  std::shared_ptr<kg::Graph> graph;
  kg::Model model;
};
Net make_net(double w1, double w2, bool with_gap = false) {
  auto [x, g] = SymTensor::input(DType::F64, {kg::dynamic, 3}, "x");
  SymTensor h = rec(x, kg::CustomData::make<ScaleOp>(w1), {}, "s1");
  if (with_gap) h = rec(h, kg::CustomData::make<NoBackwardOp>(), {}, "gap");
  SymTensor sq = rec(h, kg::CustomData::make<SquareOp>(), {}, "sq");
  SymTensor sum = rec(h, kg::CustomData::make<AddOp>(), {sq}, "add");
  SymTensor out = rec(sum, kg::CustomData::make<ScaleOp>(w2), {}, "s2");
  SymTensor loss = rec(out, kg::CustomData::make<SumOp>(), {}, "loss");
  return {g, kg::Model(g, {{"out", out}, {"loss", loss}}, kg::LoweringMode::Training)};
}

// The closed forms: dL/dw2 = Σ(h + h²), dL/dw1 = w2 Σ(1 + 2h) x.
std::pair<double, double> reference_grads(const Tensor& x, double w1, double w2) {
  double g1 = 0, g2 = 0;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double xi = x.data<double>()[i], h = w1 * xi;
    g2 += h + h * h;
    g1 += w2 * (1 + 2 * h) * xi;
  }
  return {g1, g2};
}

TEST(Training, GradientsThroughAValueUsedTwiceMatchTheClosedForm) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  const double w1 = 0.7, w2 = -1.3;
  Net net = make_net(w1, w2);
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  kg::LoadedModel m = net.model.load(kg::Device::cpu(), {{5, 3}}, opt);
  EXPECT_EQ(m.loss_name(), "loss");
  Tensor x = kg_test::random_tensor(rng, DType::F64, {5, 3});
  auto outs = m.forward({x});
  m.backward();
  auto [g1, g2] = reference_grads(x, w1, w2);
  EXPECT_NEAR(m.grad("s1.w").item(0), g1, 1e-12 * (1 + std::abs(g1)));
  EXPECT_NEAR(m.grad("s2.w").item(0), g2, 1e-12 * (1 + std::abs(g2)));
  auto all = m.gradients();
  EXPECT_EQ(all.size(), 2u);
}

TEST(Training, ParameterGradientsAddUpUntilZeroGrad) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  Net net = make_net(0.5, 2.0);
  kg::LoadedModel m = net.model.load(kg::Device::cpu(), {{4, 3}});
  Tensor a = kg_test::random_tensor(rng, DType::F64, {4, 3}), b = kg_test::random_tensor(rng, DType::F64, {4, 3});
  m.forward({a});
  m.backward();
  m.forward({b});
  m.backward();
  auto [a1, a2] = reference_grads(a, 0.5, 2.0);
  auto [b1, b2] = reference_grads(b, 0.5, 2.0);
  EXPECT_NEAR(m.grad("s1.w").item(0), a1 + b1, 1e-11);
  EXPECT_NEAR(m.grad("s2.w").item(0), a2 + b2, 1e-11);
  m.zero_grad();
  EXPECT_EQ(m.grad("s1.w").item(0), 0.0);
  m.forward({b});
  m.backward();
  EXPECT_NEAR(m.grad("s1.w").item(0), b1, 1e-11);
}

TEST(Training, SgdWithMomentumFollowsTheUpdateRule) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  double w1 = 0.3, w2 = 0.8;
  Net net = make_net(w1, w2);
  kg::LoadedModel m = net.model.load(kg::Device::cpu(), {{2, 3}});
  const double lr = 0.05, mom = 0.9, wd = 0.01;
  m.set_optimizer(kg::OptimizerOptions::sgd(lr, mom, wd));
  double v1 = 0, v2 = 0;
  for (int step = 1; step <= 3; ++step) {
    Tensor x = kg_test::random_tensor(rng, DType::F64, {2, 3});
    m.zero_grad();
    m.forward({x});
    m.backward();
    m.step();
    auto [g1, g2] = reference_grads(x, w1, w2);
    g1 += wd * w1;
    g2 += wd * w2;
    v1 = step == 1 ? g1 : mom * v1 + g1;
    v2 = step == 1 ? g2 : mom * v2 + g2;
    w1 -= lr * v1;
    w2 -= lr * v2;
    EXPECT_NEAR(m.parameter("s1.w").item(0), w1, 1e-12) << "step " << step;
    EXPECT_NEAR(m.parameter("s2.w").item(0), w2, 1e-12) << "step " << step;
  }
}

TEST(Training, SetLearningRateChangesTheNextSteps) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  double w1 = 0.3, w2 = 0.8;
  Net net = make_net(w1, w2);
  kg::LoadedModel m = net.model.load(kg::Device::cpu(), {{2, 3}});
  kg_test::expect_error([&] { m.set_learning_rate(0.1); }, {"set_learning_rate", "no optimizer set"});
  m.set_optimizer(kg::OptimizerOptions::sgd(0.1));
  kg_test::expect_error([&] { m.set_learning_rate(-0.5); }, {"learning rate", "-0.5"});
  for (const double lr : {0.1, 0.025}) {
    m.set_learning_rate(lr);
    Tensor x = kg_test::random_tensor(rng, DType::F64, {2, 3});
    m.zero_grad();
    m.forward({x});
    m.backward();
    m.step();
    auto [g1, g2] = reference_grads(x, w1, w2);
    w1 -= lr * g1;
    w2 -= lr * g2;
    EXPECT_NEAR(m.parameter("s1.w").item(0), w1, 1e-12) << "lr " << lr;
    EXPECT_NEAR(m.parameter("s2.w").item(0), w2, 1e-12) << "lr " << lr;
  }
}

TEST(Training, AdamWFollowsTheUpdateRule) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  double w[2] = {0.3, 0.8};
  Net net = make_net(w[0], w[1]);
  kg::LoadedModel m = net.model.load(kg::Device::cpu(), {{2, 3}});
  const double lr = 0.01, wd = 0.1, b1 = 0.9, b2 = 0.99, eps = 1e-8;
  const std::size_t peak = m.memory_plan().peak_bytes;
  EXPECT_EQ(m.memory_plan().grad_bytes, 2 * sizeof(double));  // two scalar weights
  m.set_optimizer(kg::OptimizerOptions::adamw(lr, wd, b1, b2, eps));
  EXPECT_EQ(m.memory_plan().optimizer_bytes, 4 * sizeof(double));  // two moments each
  EXPECT_EQ(m.memory_plan().peak_bytes, peak + 4 * sizeof(double));
  EXPECT_NE(m.memory_plan().to_string().find("optimizer state 32 B"), std::string::npos) << m.memory_plan().to_string();
  double mm[2] = {0, 0}, vv[2] = {0, 0};
  for (int step = 1; step <= 4; ++step) {
    Tensor x = kg_test::random_tensor(rng, DType::F64, {2, 3});
    m.zero_grad();
    m.forward({x});
    m.backward();
    m.step();
    auto [g1, g2] = reference_grads(x, w[0], w[1]);
    const double g[2] = {g1, g2};
    for (int k = 0; k < 2; ++k) {
      w[k] *= 1 - lr * wd;
      mm[k] = b1 * mm[k] + (1 - b1) * g[k];
      vv[k] = b2 * vv[k] + (1 - b2) * g[k] * g[k];
      const double mhat = mm[k] / (1 - std::pow(b1, step)), vhat = vv[k] / (1 - std::pow(b2, step));
      w[k] -= lr * mhat / (std::sqrt(vhat) + eps);
    }
    EXPECT_NEAR(m.parameter("s1.w").item(0), w[0], 1e-12) << "step " << step;
    EXPECT_NEAR(m.parameter("s2.w").item(0), w[1], 1e-12) << "step " << step;
  }
  auto state = m.optimizer_state();
  EXPECT_EQ(state.at("step").item(0), 4.0);
  EXPECT_NEAR(state.at("s1.w.exp_avg").item(0), mm[0], 1e-12);
  EXPECT_NEAR(state.at("s2.w.exp_avg_sq").item(0), vv[1], 1e-12);
}

TEST(Training, CheckpointRestoresParametersAndOptimizerState) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  Net net = make_net(0.4, 0.9);
  auto train = [&](kg::LoadedModel& m, const Tensor& x) {
    m.zero_grad();
    m.forward({x});
    m.backward();
    m.step();
  };
  std::vector<Tensor> xs;
  for (int i = 0; i < 4; ++i) xs.push_back(kg_test::random_tensor(rng, DType::F64, {2, 3}));
  kg::LoadedModel a = net.model.load(kg::Device::cpu(), {{2, 3}});
  a.set_optimizer(kg::OptimizerOptions::adamw(0.01));
  train(a, xs[0]);
  train(a, xs[1]);
  const auto dir = std::filesystem::temp_directory_path() / ("kg_ckpt_" + std::to_string(kg_test::fresh_seed()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "ck.safetensors").string();
  a.save_checkpoint(path, {{"epoch", "2"}});
  train(a, xs[2]);
  train(a, xs[3]);

  kg::LoadedModel b = net.model.load(kg::Device::cpu(), {{2, 3}});
  b.set_optimizer(kg::OptimizerOptions::adamw(0.01));
  auto meta = b.load_checkpoint(path);
  EXPECT_EQ(meta.at("epoch"), "2");
  train(b, xs[2]);
  train(b, xs[3]);
  EXPECT_EQ(a.parameter("s1.w").item(0), b.parameter("s1.w").item(0));
  EXPECT_EQ(a.parameter("s2.w").item(0), b.parameter("s2.w").item(0));

  // A checkpoint of another optimiser is refused, naming what is missing.
  kg::LoadedModel c = net.model.load(kg::Device::cpu(), {{2, 3}});
  c.set_optimizer(kg::OptimizerOptions::sgd(0.1, 0.9));
  kg_test::expect_error([&] { c.load_checkpoint(path); }, {path, "s1.w.momentum_buffer: missing"});
  std::filesystem::remove_all(dir);
}

TEST(Training, AnOpWithoutBackwardOnThePathIsNamed) {
  Net net = make_net(0.4, 0.9, /*with_gap=*/true);
  kg_test::expect_error([&] { net.model.load(kg::Device::cpu(), {{2, 3}}); },
                        {"[test.no_backward @ gap]", "has no backward", "parameter 's1.w'", "loss 'loss'"});
}

TEST(Training, MisuseIsAnErrorNotAWrongNumber) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  Net net = make_net(0.4, 0.9);
  kg::LoadedModel m = net.model.load(kg::Device::cpu(), {{2, 3}});
  kg_test::expect_error([&] { m.backward(); }, {"backward", "no forward()"});
  m.forward({kg_test::random_tensor(rng, DType::F64, {2, 3})});
  m.backward();
  kg_test::expect_error([&] { m.backward(); }, {"no forward()"});
  kg_test::expect_error([&] { m.step(); }, {"no optimizer set"});
  kg_test::expect_error([&] { m.grad("nope"); }, {"no parameter named 'nope'"});
  kg_test::expect_error([&] { m.set_optimizer(kg::OptimizerOptions::sgd(-1.0)); }, {"learning rate"});
  kg_test::expect_error([&] { m.set_optimizer(kg::OptimizerOptions::adamw(0.1, 0.0, 1.5)); }, {"beta1"});

  // An inference model has no backward; a training model whose outputs hold no scalar has no
  // loss unless one is named, and a named loss must exist and be a scalar.
  kg::Model inf(net.graph, {{"loss", SymTensor(net.graph, net.graph->find("loss"))}});
  kg::LoadedModel mi = inf.load(kg::Device::cpu(), {{2, 3}});
  kg_test::expect_error([&] { mi.backward(); }, {"lowered for inference"});
  kg::Model no_loss(net.graph, {{"out", SymTensor(net.graph, net.graph->find("s2"))}}, kg::LoweringMode::Training);
  kg::LoadedModel mn = no_loss.load(kg::Device::cpu(), {{2, 3}});
  kg_test::expect_error([&] { mn.backward(); }, {"no loss output"});
  kg::LoadOptions named;
  named.loss = "out";
  kg_test::expect_error([&] { no_loss.load(kg::Device::cpu(), {{2, 3}}, named); }, {"'out' must be a scalar"});
  named.loss = "missing";
  kg_test::expect_error([&] { net.model.load(kg::Device::cpu(), {{2, 3}}, named); }, {"no output named 'missing'"});
}

TEST(Training, SavedActivationsSurviveTheArenaReuse) {
  // A deeper chain, so that the backward's gradient buffers reuse arena bytes of activations
  // that are dead by then, while the inputs that backward steps read stay intact.
  std::mt19937_64 rng(kg_test::fresh_seed());
  auto [x, g] = SymTensor::input(DType::F64, {kg::dynamic, 8}, "x");
  SymTensor h = x;
  std::vector<double> ws = {0.9, 1.1, 0.8, 1.2, 0.95};
  for (std::size_t i = 0; i < ws.size(); ++i) {
    h = rec(h, kg::CustomData::make<ScaleOp>(ws[i]), {}, "s" + std::to_string(i));
    h = rec(h, kg::CustomData::make<SquareOp>(), {}, "q" + std::to_string(i));
  }
  SymTensor loss = rec(h, kg::CustomData::make<SumOp>(), {}, "loss");
  kg::Model model(g, {{"loss", loss}}, kg::LoweringMode::Training);
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  kg::LoadedModel m = model.load(kg::Device::cpu(), {{3, 8}}, opt);
  Tensor xin = kg_test::random_tensor(rng, DType::F64, {3, 8}, 0.5, 1.0);
  m.forward({xin});
  m.backward();
  EXPECT_LT(m.memory_plan().arena_bytes, m.memory_plan().unshared_bytes);
  // Reference: per element, forward values and the chain rule in double.
  std::vector<double> gw(ws.size(), 0.0);
  for (std::int64_t e = 0; e < xin.numel(); ++e) {
    std::vector<double> a(ws.size() + 1);  // inputs of each scale
    a[0] = xin.data<double>()[e];
    for (std::size_t i = 0; i < ws.size(); ++i) a[i + 1] = (ws[i] * a[i]) * (ws[i] * a[i]);
    double up = 1.0;  // dL/d(output of square i)
    for (std::size_t i = ws.size(); i-- > 0;) {
      const double s = ws[i] * a[i];
      const double ds = up * 2 * s;
      gw[i] += ds * a[i];
      up = ds * ws[i];
    }
  }
  for (std::size_t i = 0; i < ws.size(); ++i)
    EXPECT_NEAR(m.grad("s" + std::to_string(i) + ".w").item(0), gw[i], 1e-9 * (1 + std::abs(gw[i]))) << i;
}

}  // namespace
