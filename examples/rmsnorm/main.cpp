// demo.rmsnorm trained inside a small classifier: check_op against a naive reference, then a few
// AdamW steps on synthetic data on the CPU, once more in checked mode (every kernel emulated and
// verified), and on the GPU when there is one. Exits non-zero when a check fails or the loss does
// not fall.
#include <cmath>
#include <cstdio>
#include <random>

#include "kg/kg.hpp"
#include "rmsnorm.hpp"

namespace {

// Four Gaussian blobs in 16 dims; the label is the blob.
void make_batch(std::mt19937& rng, kg::Tensor& x, kg::Tensor& y) {
  std::normal_distribution<float> nd(0.f, 1.f);
  const std::int64_t b = x.shape()[0], d = x.shape()[1];
  for (std::int64_t i = 0; i < b; ++i) {
    const std::int64_t c = static_cast<std::int64_t>(rng() % 4);
    y.data<std::int64_t>()[i] = c;
    for (std::int64_t k = 0; k < d; ++k)
      x.data<float>()[i * d + k] = nd(rng) * 0.5f + (k % 4 == c ? 2.f : 0.f);
  }
}

// Loss of the first and of the last step.
std::pair<double, double> train(kg::LoadedModel& m, int steps, std::uint32_t seed) {
  std::mt19937 rng(seed);
  const auto shapes = m.input_shapes();
  kg::Tensor x = kg::Tensor::empty(kg::DType::F32, shapes[0]),
             y = kg::Tensor::empty(kg::DType::I64, shapes[1]);
  m.set_optimizer(kg::OptimizerOptions::adamw(1e-2));
  double first = 0, last = 0;
  for (int s = 0; s < steps; ++s) {
    make_batch(rng, x, y);
    m.zero_grad();
    const auto out = m.forward({x, y});
    m.backward();
    m.step();
    last = out[1].item(0);
    if (s == 0) first = last;
  }
  return {first, last};
}

}  // namespace

int main() {
  try {
    const auto op = kg::CustomData::make<demo::RmsNormOp>();

    // 1. The op alone, against a naive reference.
    kg::testing::CheckOpOptions co;
    co.reference = [](const std::vector<kg::Tensor>& in, const std::map<std::string, kg::Tensor>& p) {
      const kg::Tensor& x = in[0];
      const kg::Tensor& w = p.at("weight");
      kg::Tensor out = kg::Tensor::empty(kg::DType::F64, x.shape());
      const std::int64_t n = x.shape().back();
      for (std::int64_t r = 0; r < x.numel() / n; ++r) {
        double ss = 0;
        for (std::int64_t i = 0; i < n; ++i) ss += x.item(r * n + i) * x.item(r * n + i);
        for (std::int64_t i = 0; i < n; ++i)
          out.data<double>()[r * n + i] = x.item(r * n + i) / std::sqrt(ss / double(n) + 1e-6) * w.item(i);
      }
      return out;
    };
    const kg::testing::CheckOpReport report =
        kg::testing::check_op(op, {kg::Shape{kg::Dim::named("batch"), 64}}, {kg::DType::F32}, co);
    std::printf("%s", report.to_string().c_str());
    if (!report.ok) return 1;

    // 2. Inside a model: linear → rmsnorm → relu → linear → cross entropy.
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 16}, "x");
    kg::SymTensor labels = g->input(kg::DType::I64, kg::Shape{kg::Dim::named("batch")}, "label");
    kg::SymTensor h = kg::nn::linear(x, 64, "fc1");
    h = h.record_custom(op, {}, std::nullopt, "norm");
    h = kg::relu(h, "act");
    kg::SymTensor logits = kg::nn::linear(h, 4, "fc2");
    kg::Model model(g, {{"logits", logits}, {"loss", kg::cross_entropy(logits, labels)}},
                    kg::LoweringMode::Training);
    const std::vector<std::vector<std::int64_t>> shapes{{32, 16}, {32}};

    kg::LoadedModel cpu = model.load(kg::Device::cpu(), shapes);
    const auto init = cpu.state_dict();
    std::printf("parameters:");
    for (const auto& [name, t] : init)
      std::printf(" %s%s", name.c_str(), kg::sizes_to_string(t.shape()).c_str());
    std::printf("\n");
    const auto [first, last] = train(cpu, 60, 7);
    std::printf("cpu: loss %.4f -> %.4f after 60 steps\n", first, last);
    if (!(last < 0.5 * first)) return 1;

    kg::LoadOptions checked;
    checked.checked = true;
    kg::LoadedModel emu = model.load(kg::Device::cpu(), shapes, checked);
    emu.load_state_dict(init);
    const auto [cf, cl] = train(emu, 3, 7);
    std::printf("cpu checked (kernels emulated and verified): loss %.4f -> %.4f after 3 steps\n", cf, cl);

    if (kg::Device::cuda_available()) {
      kg::LoadedModel gpu = model.load(kg::Device::cuda(), shapes);
      gpu.load_state_dict(init);
      const auto [gf, gl] = train(gpu, 60, 7);
      std::printf("cuda: loss %.4f -> %.4f after 60 steps (cpu %.4f -> %.4f)\n", gf, gl, first, last);
      if (std::abs(gf - first) > 1e-4 * std::max(1.0, first) || !(gl < 0.5 * gf)) return 1;
    } else {
      std::printf("cuda: no GPU on this machine; ran on the CPU only\n");
    }
    std::printf("rmsnorm: ok\n");
    return 0;
  } catch (const kg::Error& e) {
    std::fprintf(stderr, "rmsnorm: error: %s\n", e.what());
    return 1;
  }
}
