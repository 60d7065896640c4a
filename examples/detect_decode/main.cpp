// The seed's yolo.detect_decode inside a model: a small conv head over a feature map, reshaped
// to [B, 4, A], decoded by the custom op. Recorded once with a dynamic batch, run on the CPU
// and, where a GPU is present, on it too; the two must agree.
#include <cmath>
#include <cstdio>
#include <random>

#include "detect_decode.hpp"
#include "kg/kg.hpp"

int main(int argc, char** argv) {
  try {
    const int h = 20, w = 20;
    const float stride = 16.f;
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 32, h, w}, "features");
    kg::SymTensor y;
    {
      kg::NameScope s(*g, "head");
      y = kg::nn::conv2d(x, 4, 1, {}, "box");
      y = kg::relu(y, "act");  // distances are non-negative
      y = kg::reshape(y, {0, 4, -1}, "flat");
      y = y.record_custom(kg::CustomData(yolo::DetectDecodeOp::for_level(h, w, stride)), {}, std::nullopt, "decode");
    }
    kg::Model model(g, {{"boxes", y}});
    std::printf("%s\n", model.summary().c_str());

    const std::int64_t batch = argc > 1 ? std::atoll(argv[1]) : 8;
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0.f, 1.f);
    kg::Tensor in = kg::Tensor::empty(kg::DType::F32, {batch, 32, h, w});
    for (std::int64_t i = 0; i < in.numel(); ++i) in.data<float>()[i] = nd(rng);

    kg::LoadedModel cpu = model.load(kg::Device::cpu(), {in.shape()});
    kg::Tensor boxes = cpu.forward({in})[0];
    std::printf("cpu: boxes %s; anchor 0 of image 0: cx=%.2f cy=%.2f w=%.2f h=%.2f\n",
                kg::sizes_to_string(boxes.shape()).c_str(), boxes.item(0), boxes.item(h * w), boxes.item(2 * h * w),
                boxes.item(3 * h * w));
    if (!kg::Device::cuda_available()) {
      std::printf("cuda: no GPU on this machine; ran on the CPU only\n");
      return 0;
    }
    kg::LoadedModel gpu = model.load(kg::Device::cuda(), {in.shape()});
    gpu.load_state_dict(cpu.state_dict(), false);  // the same conv weights
    kg::Tensor gboxes = gpu.forward({in})[0];
    // Box coordinates are differences of nearby values (anchor ± distance), so an element-wise
    // relative error is meaningless near zero: compare against the largest coordinate.
    double worst = 0, scale = 0;
    for (std::int64_t i = 0; i < boxes.numel(); ++i) {
      worst = std::max(worst, std::abs(gboxes.item(i) - boxes.item(i)));
      scale = std::max(scale, std::abs(boxes.item(i)));
    }
    std::printf("cuda: max relative difference to the CPU: %.3g (max abs %.3g over max |box| %.3g)\n",
                worst / scale, worst, scale);
    return worst <= 1e-5 * scale ? 0 : 1;
  } catch (const kg::Error& e) {
    std::fprintf(stderr, "detect_decode: error: %s\n", e.what());
    return 1;
  }
}
