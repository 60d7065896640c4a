// The passes that run when a Model is built (split, dead nodes, attention, conv epilogues,
// elementwise groups, GEMM epilogues, prologues) take time linear in the graph: a long imported
// chain of elementwise nodes, a chain with values leaving it every so often (groups with several
// outputs, so the cycle check runs at every join), and one value read by many nodes all build a
// Model in well under a second per 20000 nodes. The elementwise pass once recounted the whole
// group at every join (5.5 s for a chain of 20000 ReLUs, minutes for 100000).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <string>

#include "kg/kg.hpp"
#include "kg/onnx.hpp"
#include "ops/fused_elementwise.hpp"
#include "support/fusion_util.hpp"
#include "support/onnx_builder.hpp"
#include "support/test_util.hpp"

using kg_test::OnnxBuilder;

namespace {

constexpr int kNodes = 20000;
// Generous: each build takes 0.1 to 0.7 s here in a release build; with the quadratic pass the
// ONNX chain and the chain of additions took 5 s and more (the other two cases guard the cycle
// check and the readers' lists, which were slower but not past the limit at this size).
constexpr double kLimitSeconds = 3.0;

double seconds(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

kg::Tensor run_cpu(const kg::Model& m, const kg::Tensor& x) {
  kg::LoadedModel lm = m.load(kg::Device::cpu(), {x.shape()});
  return lm.forward({x}).at(0);
}

std::vector<float> values(const kg::Tensor& t) {
  const float* p = t.data<float>();
  return std::vector<float>(p, p + t.numel());
}

kg::Tensor ramp(std::int64_t rows, std::int64_t cols) {
  std::vector<float> v(static_cast<std::size_t>(rows * cols));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) * 0.25f - 2.0f;
  return kg::Tensor::from_vector<float>({rows, cols}, v);
}

}  // namespace

// An ONNX file of 20000 Relu nodes in a chain: import and Model build together stay within the
// limit, the chain is one fused group, and it computes relu(x).
TEST(PassScaling, ALongOnnxChainBuildsAModelInLinearTime) {
  OnnxBuilder b;
  b.input("x", kg::DType::F32, {std::string("batch"), std::int64_t{4}});
  for (int i = 0; i < kNodes; ++i)
    b.node("Relu", {i == 0 ? "x" : "v" + std::to_string(i - 1)}, {i + 1 == kNodes ? "y" : "v" + std::to_string(i)},
           "/relu" + std::to_string(i));
  b.output("y");
  const std::string bytes = b.bytes();
  std::optional<kg::Model> model;
  const double s = seconds([&] { model.emplace(kg::onnx::import_bytes(bytes, "chain.onnx")); });
  EXPECT_LT(s, kLimitSeconds) << "importing and building a " << kNodes << "-node chain took " << s << " s";
  const auto fused = kg_test::ops_of<kg::ops::FusedElementwiseOp>(*model);
  ASSERT_EQ(fused.size(), 1u);
  EXPECT_EQ(fused[0]->members().size(), static_cast<std::size_t>(kNodes));
  const kg::Tensor x = ramp(3, 4);
  const kg::Tensor y = run_cpu(*model, x);
  std::vector<float> want;
  for (float v : values(x)) want.push_back(v > 0.0f ? v : 0.0f);
  EXPECT_EQ(values(y), want);
}

// Chains recorded with the API: x + 1 repeated (one group of 20000 members), a
// chain whose every 500th value is also a model output (groups of several outputs: each later join
// runs the cycle check), and x read by 20000 separate nodes (a value with many readers).
TEST(PassScaling, ChainsSideOutputsAndWideFanOutBuildInLinearTime) {
  {
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 4}, "x");
    kg::SymTensor v = x;
    for (int i = 0; i < kNodes; ++i) v = kg::add(v, 1.0, "a" + std::to_string(i));
    std::optional<kg::Model> m;
    const double s = seconds([&] { m.emplace(g, std::vector<kg::SymTensor>{v}); });
    EXPECT_LT(s, kLimitSeconds) << "a chain of " << kNodes << " additions took " << s << " s to build";
    const auto fused = kg_test::ops_of<kg::ops::FusedElementwiseOp>(*m);
    ASSERT_EQ(fused.size(), 1u);
    EXPECT_EQ(fused[0]->members().size(), static_cast<std::size_t>(kNodes));
  }
  {
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 4}, "x");
    kg::SymTensor v = x;
    std::vector<std::pair<std::string, kg::SymTensor>> outs;
    for (int i = 0; i < kNodes; ++i) {
      v = kg::tanh(v, "t" + std::to_string(i));
      if (i % 500 == 250) outs.emplace_back("side" + std::to_string(i), v);
    }
    outs.emplace_back("last", v);
    std::optional<kg::Model> m;
    const double s = seconds([&] { m.emplace(g, outs); });
    EXPECT_LT(s, kLimitSeconds) << "a chain of " << kNodes << " with " << outs.size() << " outputs took " << s
                                << " s to build";
    std::size_t most = 0;
    for (const auto* f : kg_test::ops_of<kg::ops::FusedElementwiseOp>(*m)) most = std::max(most, f->outputs().size());
    EXPECT_GT(most, 1u) << "the side outputs were expected to form groups of several outputs";
  }
  {
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 4}, "x");
    std::vector<std::pair<std::string, kg::SymTensor>> outs;
    for (int i = 0; i < kNodes; ++i) outs.emplace_back("r" + std::to_string(i), kg::relu(x, "r" + std::to_string(i)));
    std::optional<kg::Model> m;
    const double s = seconds([&] { m.emplace(g, outs); });
    EXPECT_LT(s, kLimitSeconds) << "x read by " << kNodes << " nodes took " << s << " s to build";
  }
}
