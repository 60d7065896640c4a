// LeNet-5 with a custom op, LeCun's scaled tanh (lenet.scaled_tanh, src/models/scaled_tanh.cpp),
// as every activation: recorded once with a dynamic batch, loaded at batch 1 and 64 on the CPU,
// run, and reported: outputs, timings, the memory plan and the time of each node. The zoo's
// "lenet5-tanh" (kgraph train's default) is the same graph.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <random>

#include "kg/kg.hpp"
#include "kg/models.hpp"  // kg::models::scaled_tanh

namespace {

kg::Model build_lenet() {
  auto [x, graph] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 1, 28, 28}, "image");
  kg::SymTensor h = x;
  {
    kg::NameScope s(*graph, "features");
    h = kg::nn::conv2d(h, 6, 5, {.padding = 2}, "0");
    h = kg::models::scaled_tanh(h, "1");  // the custom op
    h = kg::max_pool2d(h, 2, 2, 0, 1, false, "2");
    h = kg::nn::conv2d(h, 16, 5, {}, "3");
    h = kg::models::scaled_tanh(h, "4");
    h = kg::max_pool2d(h, 2, 2, 0, 1, false, "5");
  }
  h = kg::flatten(h, 1, -1, "flatten");
  {
    kg::NameScope s(*graph, "classifier");
    h = kg::nn::linear(h, 120, "0");
    h = kg::models::scaled_tanh(h, "1");
    h = kg::nn::linear(h, 84, "2");
    h = kg::models::scaled_tanh(h, "3");
    h = kg::nn::linear(h, 10, "4");
  }
  return kg::Model(graph, {{"logits", h}});
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void run_at(const kg::Model& model, std::int64_t batch, std::mt19937& rng) {
  kg::LoadOptions opt;
  opt.seed = 42;
  opt.profile = true;
  kg::LoadedModel m = model.load(kg::Device::cpu(), {{batch, 1, 28, 28}}, opt);
  kg::Tensor x = kg::Tensor::empty(kg::DType::F32, {batch, 1, 28, 28});
  std::normal_distribution<float> nd(0.f, 1.f);
  for (std::int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = nd(rng);

  std::vector<double> times;
  kg::Tensor logits;
  for (int r = 0; r < 20; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    logits = m.forward({x})[0];
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::printf("\n== batch %lld on %s ==\n", static_cast<long long>(batch), m.device().to_string().c_str());
  std::printf("logits %s; first row:", kg::sizes_to_string(logits.shape()).c_str());
  for (int j = 0; j < 10; ++j) std::printf(" %+.4f", logits.data<float>()[j]);
  std::printf("\nforward: median %.3f ms over %zu runs (%.0f images/s)\n", median(times), times.size(),
              1000.0 * static_cast<double>(batch) / median(times));
  std::printf("memory plan: %s\n", m.memory_plan().to_string().c_str());
  std::printf("per-node time of the last run:\n");
  for (const auto& t : m.profile())
    std::printf("  %-16s %-20s %8.3f ms\n", t.node.c_str(), t.op.c_str(), t.ms);
}

}  // namespace

int main() {
  try {
    kg::Model model = build_lenet();
    std::cout << model.summary();
    std::mt19937 rng(7);
    for (std::int64_t batch : {1, 64}) run_at(model, batch, rng);
    return 0;
  } catch (const kg::Error& e) {
    std::fprintf(stderr, "lenet5: error: %s\n", e.what());
    return 1;
  }
}
