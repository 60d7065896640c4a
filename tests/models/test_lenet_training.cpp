// Training the zoo's LeNet-5 models end to end: logits, cross-entropy loss and every parameter
// gradient against PyTorch (fixtures from scripts/fixtures/lenet_grads.py, references in
// float64), on the CPU and on a GPU when there is one; an SGD step on the GPU against the same
// step on the CPU; and AdamW overfitting one batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kg/kg.hpp"
#include "kg/models.hpp"
#include "support/test_util.hpp"

namespace {

using kg::DType;
using kg::SymTensor;
using kg::Tensor;

constexpr std::int64_t kBatch = 16;

// A zoo model with a cross-entropy loss on integer labels, lowered for training. Outputs:
// "logits" [N, 10] and "loss" [].
kg::Model training_model(const std::string& name) {
  std::vector<kg::Dim> dims{kg::Dim::named("batch"), 1, 28, 28};
  auto [x, graph] = SymTensor::input(DType::F32, kg::Shape(std::move(dims)), "input");
  SymTensor labels = graph->input(DType::I64, kg::Shape{kg::Dim::named("batch")}, "labels");
  SymTensor logits = kg::models::record(name, x);
  SymTensor loss = kg::cross_entropy(logits, labels, "loss");
  return kg::Model(graph, {{"logits", logits}, {"loss", loss}}, kg::LoweringMode::Training);
}

std::vector<std::vector<std::int64_t>> shapes(std::int64_t batch) { return {{batch, 1, 28, 28}, {batch}}; }

// The fixture's tensors: weights (prefix "weight/" removed), gradients ("grad/" removed), the
// batch and PyTorch's outputs.
struct Reference {
  std::map<std::string, Tensor> weights, grads;
  Tensor input, labels, logits, loss;
};

Reference reference(const std::string& file) {
  Reference r;
  const auto fx = kg_test::fixture(file);
  for (const auto& [key, t] : fx) {
    if (key.rfind("weight/", 0) == 0)
      r.weights[key.substr(7)] = t;
    else if (key.rfind("grad/", 0) == 0)
      r.grads[key.substr(5)] = t;
  }
  r.input = fx.at("input");
  r.labels = fx.at("labels");
  r.logits = fx.at("logits");
  r.loss = fx.at("loss");
  return r;
}

// max|got - want| / max|want| must stay below `tol`; reports the worst element. Also fails on a
// NaN (an element never written) and on differing element counts.
double max_abs(const Tensor& t) {
  double scale = 0;
  for (std::int64_t i = 0; i < t.numel(); ++i) scale = std::max(scale, std::abs(t.item(i)));
  return scale == 0 ? 1.0 : scale;
}

// The worst element of |got - want| / max|want| (infinite for a NaN) and its index.
std::pair<double, std::int64_t> worst_element(const Tensor& got, const Tensor& want) {
  const double scale = max_abs(want);
  double worst = -1;
  std::int64_t at = 0;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.item(i);
    const double e = std::isnan(g) ? INFINITY : std::abs(g - want.item(i)) / scale;
    if (e > worst) worst = e, at = i;
  }
  return {worst, at};
}

double worst_error(const Tensor& got, const Tensor& want) {
  return got.numel() == want.numel() ? worst_element(got, want).first : INFINITY;
}

::testing::AssertionResult close_to(const Tensor& got, const Tensor& want, double tol) {
  if (got.numel() != want.numel())
    return ::testing::AssertionFailure() << "got " << kg::sizes_to_string(got.shape()) << ", want "
                                         << kg::sizes_to_string(want.shape());
  const double scale = max_abs(want);
  const auto [worst, at] = worst_element(got, want);
  std::ostringstream os;
  os << "worst element " << at << ": got " << got.item(at) << ", want " << want.item(at) << ", relative error "
     << worst << " (of max|want| = " << scale << ", " << got.numel() << " elements)";
  if (!(worst < tol)) return ::testing::AssertionFailure() << os.str() << ", tolerance " << tol;
  return ::testing::AssertionSuccess() << os.str();
}

std::set<std::string> trainable_names(const kg::LoadedModel& m) {
  std::set<std::string> out;
  for (const auto& p : m.parameters())
    if (p.trainable) out.insert(p.name);
  return out;
}

template <class V>
std::set<std::string> keys(const std::map<std::string, V>& m) {
  std::set<std::string> out;
  for (const auto& kv : m) out.insert(kv.first);
  return out;
}

struct Case {
  const char* model;
  const char* fixture;
};
const Case kCases[] = {{"lenet5-tanh", "lenet5_tanh_grads.safetensors"}, {"lenet5", "lenet5_relu_grads.safetensors"}};

// Loads the model on `device` with the fixture's weights, runs forward and backward, and checks
// logits, loss and every gradient against PyTorch.
void check_against_pytorch(const Case& c, kg::Device device) {
  SCOPED_TRACE(std::string(c.model) + " on " + device.to_string());
  const Reference ref = reference(c.fixture);
  const kg::Model model = training_model(c.model);
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  kg::LoadedModel m = model.load(device, shapes(kBatch), opt);
  EXPECT_EQ(m.loss_name(), "loss");
  EXPECT_EQ(trainable_names(m), keys(ref.weights)) << "the model's parameters are not PyTorch's";
  m.load_state_dict(ref.weights);
  m.set_training(true);
  m.zero_grad();
  const std::vector<Tensor> out = m.forward({ref.input, ref.labels});
  EXPECT_EQ(out.at(0).shape(), (std::vector<std::int64_t>{kBatch, 10}));
  EXPECT_EQ(out.at(1).numel(), 1);
  EXPECT_TRUE(close_to(out.at(0), ref.logits, 1e-4)) << "logits";
  EXPECT_TRUE(close_to(out.at(1), ref.loss, 1e-4)) << "loss";
  m.backward();
  const std::map<std::string, Tensor> grads = m.gradients();
  double worst = 0;
  std::string worst_name;
  EXPECT_EQ(keys(grads), trainable_names(m)) << "the gradients are not those of the trainable parameters";
  for (const auto& [name, want] : ref.grads) {
    auto it = grads.find(name);
    if (it == grads.end()) {
      ADD_FAILURE() << "no gradient for " << name;
      continue;
    }
    EXPECT_EQ(it->second.shape(), want.shape()) << name;
    EXPECT_TRUE(close_to(it->second, want, 1e-4)) << "gradient of " << name;
    const double e = worst_error(it->second, want);
    if (e > worst) worst = e, worst_name = name;
  }
  std::printf("  %s on %s: largest gradient error %.3g of max|grad| (%s)\n", c.model, device.to_string().c_str(),
              worst, worst_name.c_str());
}

TEST(LenetTraining, CpuGradientsMatchPyTorch) {
  for (const Case& c : kCases) check_against_pytorch(c, kg::Device::cpu());
}

TEST(LenetTraining, GpuGradientsMatchPyTorch) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  for (const Case& c : kCases) check_against_pytorch(c, kg::Device::cuda());
}

// Two SGD steps (momentum and weight decay, so the second step reads the momentum buffer) on the
// GPU and on the CPU from the same weights and batch: parameters within 1e-5 and momentum buffers
// within 1e-4 of each tensor's largest magnitude.
TEST(LenetTraining, GpuSgdStepMatchesCpu) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.model);
    const Reference ref = reference(c.fixture);
    const kg::Model model = training_model(c.model);
    std::vector<kg::LoadedModel> ms;
    for (kg::Device d : {kg::Device::cpu(), kg::Device::cuda()}) {
      ms.push_back(model.load(d, shapes(kBatch)));
      ms.back().load_state_dict(ref.weights);
      ms.back().set_training(true);
      ms.back().set_optimizer(kg::OptimizerOptions::sgd(0.05, 0.9, 1e-3));
    }
    for (int step = 1; step <= 2; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      for (kg::LoadedModel& m : ms) {
        m.zero_grad();
        m.forward({ref.input, ref.labels});
        m.backward();
        m.step();
      }
      const auto cpu = ms[0].state_dict(), gpu = ms[1].state_dict();
      ASSERT_EQ(keys(cpu), keys(gpu));
      for (const auto& [name, p] : cpu) EXPECT_TRUE(close_to(gpu.at(name), p, 1e-5)) << name;
      const auto cpu_state = ms[0].optimizer_state(), gpu_state = ms[1].optimizer_state();
      ASSERT_EQ(keys(cpu_state), keys(gpu_state));
      for (const auto& [name, v] : cpu_state) EXPECT_TRUE(close_to(gpu_state.at(name), v, 1e-4)) << name;
    }
  }
}

// AdamW on one fixed batch of random images and labels, from the default initialisation: 50
// steps must at least halve the loss (a network that cannot overfit 16 examples is not learning).
TEST(LenetTraining, AdamWOverfitsOneBatchOnCpu) {
  const std::uint64_t seed = kg_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.model);
    const kg::Model model = training_model(c.model);
    kg::LoadOptions opt;
    opt.seed = seed;
    kg::LoadedModel m = model.load(kg::Device::cpu(), shapes(kBatch), opt);
    m.set_training(true);
    m.set_optimizer(kg::OptimizerOptions::adamw(3e-3));
    const Tensor x = kg_test::random_tensor(rng, DType::F32, {kBatch, 1, 28, 28}, -1.0, 1.0);
    std::vector<std::int64_t> label_values(static_cast<std::size_t>(kBatch));
    std::uniform_int_distribution<std::int64_t> cls(0, 9);
    for (auto& l : label_values) l = cls(rng);
    const Tensor labels = Tensor::from_vector<std::int64_t>({kBatch}, label_values);
    std::vector<double> losses;
    for (int step = 0; step < 50; ++step) {
      m.zero_grad();
      losses.push_back(m.forward({x, labels}).at(1).item(0));
      ASSERT_TRUE(std::isfinite(losses.back())) << "step " << step;
      m.backward();
      m.step();
    }
    const double final_loss = m.forward({x, labels}).at(1).item(0);
    std::ostringstream trace;
    for (double l : losses) trace << l << " ";
    EXPECT_LT(final_loss, 0.5 * losses.front()) << "losses: " << trace.str() << final_loss;
  }
}

// A label outside [0, 10) is named when the loss runs, not turned into a number.
TEST(LenetTraining, ALabelOutOfRangeIsAnError) {
  const Reference ref = reference(kCases[0].fixture);
  kg::LoadedModel m = training_model(kCases[0].model).load(kg::Device::cpu(), shapes(kBatch));
  Tensor labels = ref.labels.clone();
  labels.data<std::int64_t>()[3] = 10;
  kg_test::expect_error([&] { m.forward({ref.input, labels}); }, {"loss", "10"});
}

}  // namespace
