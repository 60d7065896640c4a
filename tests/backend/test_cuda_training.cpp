// The CUDA backend's training half against the CPU's: gradients (including a tensor with two
// consumers and gradients added over two backward calls), zero_grad, SGD and AdamW steps, the
// optimiser state, and the errors of train-mode runs. Skipped without a GPU.
#include <gtest/gtest.h>

#include "kg/cuda.hpp"
#include "kg/kg.hpp"
#include "support/test_util.hpp"

namespace {

using kg::DType;
using kg::SymTensor;
using kg::Tensor;

#define KG_REQUIRE_GPU()                                                                      \
  do {                                                                                        \
    if (!kg::cuda::available()) GTEST_SKIP() << "no GPU: " << kg::cuda::unavailable_reason(); \
  } while (0)

// logits = W2 (h + relu(h)) + b2, h = W1 x + b1: h feeds two consumers; loss = cross-entropy.
kg::Model mlp() {
  auto [x, g] = SymTensor::input(DType::F32, {kg::Dim::named("batch"), 12}, "x");
  SymTensor labels = g->input(DType::I64, {kg::Dim::named("batch")}, "labels");
  SymTensor h = kg::nn::linear(x, 16, "fc1");
  SymTensor both = kg::add(h, kg::relu(h, "act"), "both");
  SymTensor logits = kg::nn::linear(both, 5, "fc2");
  SymTensor loss = kg::cross_entropy(logits, labels, "loss");
  return kg::Model(g, {{"logits", logits}, {"loss", loss}}, kg::LoweringMode::Training);
}

struct Batch {
  Tensor x, labels;
};
Batch batch(std::mt19937_64& rng, std::int64_t n) {
  Batch b{kg_test::random_tensor(rng, DType::F32, {n, 12}), Tensor::empty(DType::I64, {n})};
  std::uniform_int_distribution<std::int64_t> u(0, 4);
  for (std::int64_t i = 0; i < n; ++i) b.labels.data<std::int64_t>()[i] = u(rng);
  return b;
}

void expect_same(const std::map<std::string, Tensor>& gpu, const std::map<std::string, Tensor>& cpu,
                 const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  for (const auto& [name, t] : cpu) {
    ASSERT_TRUE(gpu.count(name)) << what << ": " << name;
    EXPECT_TRUE(kg_test::all_close(gpu.at(name), t, 1e-4, 1e-6)) << what << ": " << name;
  }
}

TEST(CudaTraining, GpuGradientsAndStepsMatchTheCpu) {
  KG_REQUIRE_GPU();
  std::mt19937_64 rng(kg_test::fresh_seed());
  kg::Model model = mlp();
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  opt.seed = 3;
  kg::LoadedModel cpu = model.load(kg::Device::cpu(), {{8, 12}, {8}}, opt);
  kg::LoadedModel gpu = model.load(kg::Device::cuda(), {{8, 12}, {8}}, opt);
  gpu.load_state_dict(cpu.state_dict());
  for (auto* m : {&cpu, &gpu}) m->set_optimizer(kg::OptimizerOptions::adamw(0.01, 0.05));
  for (int step = 0; step < 3; ++step) {
    Batch a = batch(rng, 8), b = batch(rng, 8);
    for (auto* m : {&cpu, &gpu}) {
      m->set_training(true);
      m->zero_grad();
      auto outs = m->forward({a.x, a.labels});
      m->backward();
      m->forward({b.x, b.labels});  // a second backward adds to the first
      m->backward();
    }
    expect_same(gpu.gradients(), cpu.gradients(), "gradients, step " + std::to_string(step));
    for (auto* m : {&cpu, &gpu}) m->step();
    expect_same(gpu.state_dict(), cpu.state_dict(), "parameters after step " + std::to_string(step));
  }
  expect_same(gpu.optimizer_state(), cpu.optimizer_state(), "optimizer state");
  gpu.zero_grad();
  for (const auto& [name, g] : gpu.gradients())
    for (std::int64_t i = 0; i < g.numel(); ++i) ASSERT_EQ(g.item(i), 0.0) << name;
}

TEST(CudaTraining, GpuSgdWithMomentumMatchesTheCpu) {
  KG_REQUIRE_GPU();
  std::mt19937_64 rng(kg_test::fresh_seed());
  kg::Model model = mlp();
  kg::LoadedModel cpu = model.load(kg::Device::cpu(), {{4, 12}, {4}});
  kg::LoadedModel gpu = model.load(kg::Device::cuda(), {{4, 12}, {4}});
  gpu.load_state_dict(cpu.state_dict());
  for (auto* m : {&cpu, &gpu}) m->set_optimizer(kg::OptimizerOptions::sgd(0.1, 0.9, 1e-3));
  for (int step = 0; step < 4; ++step) {
    Batch a = batch(rng, 4);
    std::vector<Tensor> losses;
    for (auto* m : {&cpu, &gpu}) {
      m->zero_grad();
      losses.push_back(m->forward({a.x, a.labels}).at(1));
      m->backward();
      m->step();
    }
    EXPECT_TRUE(kg_test::all_close(losses[1], losses[0], 1e-5, 1e-6)) << "loss, step " << step;
  }
  expect_same(gpu.state_dict(), cpu.state_dict(), "parameters");
}

TEST(CudaTraining, GpuCheckpointMovesBetweenDevices) {
  KG_REQUIRE_GPU();
  std::mt19937_64 rng(kg_test::fresh_seed());
  kg::Model model = mlp();
  kg::LoadedModel gpu = model.load(kg::Device::cuda(), {{4, 12}, {4}});
  gpu.set_optimizer(kg::OptimizerOptions::adamw(0.01));
  Batch a = batch(rng, 4);
  gpu.zero_grad();
  gpu.forward({a.x, a.labels});
  gpu.backward();
  gpu.step();
  const std::string path = testing::TempDir() + "kg_gpu_ckpt.safetensors";
  gpu.save_checkpoint(path);
  kg::LoadedModel cpu = model.load(kg::Device::cpu(), {{4, 12}, {4}});
  cpu.set_optimizer(kg::OptimizerOptions::adamw(0.01));
  cpu.load_checkpoint(path);
  expect_same(cpu.state_dict(), gpu.state_dict(), "parameters");
  expect_same(cpu.optimizer_state(), gpu.optimizer_state(), "optimizer state");
}

// conv → BatchNorm (batch statistics) → ReLU → max pool 3x3 s2 p1 → linear → cross-entropy,
// optionally with a Dropout before the linear layer.
kg::Model cnn(bool with_dropout) {
  auto [x, g] = SymTensor::input(DType::F32, {kg::Dim::named("batch"), 3, 12, 12}, "x");
  SymTensor labels = g->input(DType::I64, {kg::Dim::named("batch")}, "labels");
  SymTensor h = kg::nn::conv2d(x, 8, 3, {1, 1, 1, 1, false}, "conv");
  h = kg::relu(kg::nn::batch_norm2d(h, "bn"), "act");
  h = kg::flatten(kg::max_pool2d(h, 3, 2, 1, 1, false, "pool"));
  if (with_dropout) h = kg::dropout(h, 0.25, "drop");
  SymTensor loss = kg::cross_entropy(kg::nn::linear(h, 5, "fc"), labels, "loss");
  return kg::Model(g, {{"loss", loss}}, kg::LoweringMode::Training);
}

// Training steps whose forward and backward replay CUDA graphs (from the second step: BatchNorm's
// train-mode launches are the same each run) match the CPU and the same steps launched one by
// one, parameters and running statistics after every step. A Dropout model, whose launches
// change every run (a new seed), replays nothing and still matches the CPU.
TEST(CudaTraining, GpuCudaGraphStepsMatchTheCpuAndStepByStep) {
  KG_REQUIRE_GPU();
  std::mt19937_64 rng(kg_test::fresh_seed());
  for (bool with_dropout : {false, true}) {
    SCOPED_TRACE(with_dropout ? "with dropout" : "without dropout");
    kg::Model model = cnn(with_dropout);
    const std::vector<std::vector<std::int64_t>> shapes{{6, 3, 12, 12}, {6}};
    kg::LoadOptions graphed, plain;
    plain.cuda_graph = false;
    kg::LoadedModel cpu = model.load(kg::Device::cpu(), shapes);
    kg::LoadedModel gpu = model.load(kg::Device::cuda(), shapes, graphed);
    kg::LoadedModel one_by_one = model.load(kg::Device::cuda(), shapes, plain);
    for (auto* m : {&gpu, &one_by_one}) m->load_state_dict(cpu.state_dict());
    for (auto* m : {&cpu, &gpu, &one_by_one}) {
      m->set_training(true);
      m->set_optimizer(kg::OptimizerOptions::sgd(0.05, 0.9));
    }
    const int steps = 4;
    for (int step = 0; step < steps; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      const Tensor x = kg_test::random_tensor(rng, DType::F32, shapes[0]);
      Tensor labels = Tensor::empty(DType::I64, {6});
      for (std::int64_t i = 0; i < 6; ++i) labels.data<std::int64_t>()[i] = static_cast<std::int64_t>(rng() % 5);
      std::vector<double> losses;
      for (auto* m : {&cpu, &gpu, &one_by_one}) {
        m->zero_grad();
        losses.push_back(m->forward({x, labels}).at(0).item(0));
        m->backward();
        m->step();
      }
      // The same load seed draws the same Dropout masks on both devices.
      EXPECT_NEAR(losses[1], losses[0], 1e-4 * (1 + std::abs(losses[0])));
      expect_same(gpu.state_dict(), cpu.state_dict(), "graphed GPU vs CPU");
      EXPECT_NEAR(losses[1], losses[2], 1e-5 * (1 + std::abs(losses[2])));
      expect_same(gpu.state_dict(), one_by_one.state_dict(), "graphed vs one by one");
    }
    // Forward and backward replayed from the second step on; nothing with Dropout or without graphs.
    EXPECT_EQ(gpu.cuda_graph_replays(), with_dropout ? 0 : 2 * (steps - 1));
    EXPECT_EQ(one_by_one.cuda_graph_replays(), 0);
    EXPECT_EQ(cpu.cuda_graph_replays(), 0);
  }
}

}  // namespace
