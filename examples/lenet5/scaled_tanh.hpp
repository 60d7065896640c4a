// A custom op written the way a user writes one: LeCun's scaled hyperbolic tangent,
// f(x) = A * tanh(S * x), the activation of the original LeNet-5.
#pragma once

#include <cmath>
#include <string>

#include "kg/kg.hpp"

namespace lenet {

class ScaledTanh final : public kg::CustomOp {
 public:
  explicit ScaledTanh(double amplitude = 1.7159, double slope = 2.0 / 3.0) : a_(amplitude), s_(slope) {}

  std::string name() const override { return "lenet.scaled_tanh"; }
  std::string attributes() const override { return "A=" + std::to_string(a_) + " S=" + std::to_string(s_); }

  // Shape-preserving: whatever comes in goes out, dynamic dims included.
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    if (in.size() != 1) throw kg::Error("takes one input, got " + std::to_string(in.size()));
    return in[0];
  }
  kg::DType infer_output_dtype(const std::vector<kg::DType>& in) const override {
    if (in.at(0) != kg::DType::F32) throw kg::Error("supports f32 only");
    return in[0];
  }

  void cpu_forward(kg::CpuContext& ctx) const override {
    const float* x = ctx.inputs[0].data<float>();
    float* y = ctx.output.data<float>();
    const auto a = static_cast<float>(a_), s = static_cast<float>(s_);
    ctx.parallel_for(ctx.output.numel(), 1 << 14, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) y[i] = a * std::tanh(s * x[i]);
    });
  }

 private:
  double a_, s_;
};

// Records the op after `x`.
inline kg::SymTensor scaled_tanh(const kg::SymTensor& x, const std::string& name = "") {
  return x.record_custom(kg::CustomData::make<ScaledTanh>(), {}, std::nullopt, name);
}

}  // namespace lenet
