// lenet.scaled_tanh, the custom op of the lenet5-tanh zoo model: its forward against the formula,
// kg::testing::check_op (CPU and the emulated CUDA kernel), its backward against finite
// differences and the emulated backward kernel (kg::testing::check_gradients), the CPU backward
// against the derivative written in x, and the zoo model built on it.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "kg/models.hpp"
#include "kg/testing.hpp"
#include "support/test_util.hpp"

using kg_test::count_lines;
using kg_test::fresh_seed;

namespace {

constexpr double kA = 1.7159, kS = 2.0 / 3.0;

}  // namespace

TEST(ScaledTanh, ForwardMatchesTheFormula) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
    SCOPED_TRACE(kg::dtype_name(dt));
    const kg::Tensor x = kg_test::random_tensor(rng, dt, {3, 4, 37}, -4.0, 4.0);
    const kg::Tensor y =
        kg_test::run_op([](const kg::SymTensor& t) { return kg::models::scaled_tanh(t, "act"); }, x);
    ASSERT_EQ(y.shape(), x.shape());
    ASSERT_EQ(y.dtype(), dt);
    kg::Tensor want = kg::Tensor::empty(kg::DType::F64, x.shape());
    for (std::int64_t i = 0; i < x.numel(); ++i) want.data<double>()[i] = kA * std::tanh(kS * x.item(i));
    EXPECT_TRUE(kg_test::all_close(y.to(kg::DType::F64), want, dt == kg::DType::F32 ? 1e-6 : 1e-14, 1e-6));
  }
}

TEST(ScaledTanh, PassesCheckOp) {
  const auto seed = fresh_seed();
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
    kg::testing::CheckOpOptions o;
    o.seed = seed;
    o.make_input = [&](int, const std::vector<std::int64_t>& shape) {
      std::mt19937_64 rng(seed + 1);
      return kg_test::random_tensor(rng, dt, shape, -3.0, 3.0);
    };
    const auto r =
        kg::testing::check_op(kg::models::scaled_tanh_op(dt), {{kg::Dim::named("batch"), 6, 5, 5}}, {dt}, o);
    EXPECT_TRUE(r.ok) << r.to_string();
    EXPECT_GE(count_lines(r, "PASS batch 8, emulator"), 1) << r.to_string();
  }
}

TEST(ScaledTanh, GradientsMatchFiniteDifferencesAndTheBackwardKernel) {
  const auto seed = fresh_seed();
  for (const std::vector<std::int64_t>& shape :
       std::vector<std::vector<std::int64_t>>{{7}, {4, 13}, {3, 6, 5, 5}, {2, 1100}}) {
    SCOPED_TRACE(kg::sizes_to_string(shape));
    kg::testing::GradCheckOptions o;
    o.seed = seed;
    const auto r = kg::testing::check_gradients(kg::models::scaled_tanh_op(kg::DType::F64), {shape},
                                                {kg::DType::F64}, o);
    EXPECT_TRUE(r.ok) << r.to_string();
    EXPECT_EQ(count_lines(r, "PASS cpu_backward, input 0"), 1) << r.to_string();
    EXPECT_EQ(count_lines(r, "PASS emulator", {"input 0"}), 1) << r.to_string();
  }
  // f32: the difference quotients are coarse, so the tolerance is too; this runs the f32 kernel.
  kg::testing::GradCheckOptions o;
  o.seed = seed;
  o.eps = 1e-2;
  o.rtol = 2e-2;
  o.atol = 2e-3;
  const auto r =
      kg::testing::check_gradients(kg::models::scaled_tanh_op(kg::DType::F32), {{5, 9}}, {kg::DType::F32}, o);
  EXPECT_TRUE(r.ok) << r.to_string();
  EXPECT_EQ(count_lines(r, "PASS emulator", {"input 0"}), 1) << r.to_string();
}

TEST(ScaledTanh, CpuBackwardMatchesTheDerivativeInX) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::CustomData op = kg::models::scaled_tanh_op(kg::DType::F64);
  EXPECT_FALSE(op->backward_saves().inputs);
  EXPECT_TRUE(op->backward_saves().output);
  ASSERT_TRUE(op->has_cpu_backward());
  const std::vector<std::int64_t> shape{3, 41};
  const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F64, shape, -3.0, 3.0);
  const kg::Tensor dy = kg_test::random_tensor(rng, kg::DType::F64, shape);
  kg::Tensor y = kg::Tensor::empty(kg::DType::F64, shape);
  for (std::int64_t i = 0; i < x.numel(); ++i) y.data<double>()[i] = kA * std::tanh(kS * x.item(i));
  // The input is not saved: it reaches the backward without data.
  const kg::Tensor no_data = kg::Tensor::wrap(nullptr, kg::DType::F64, shape);
  std::vector<kg::Tensor> inputs{no_data};
  kg::Tensor dx = kg::Tensor::empty(kg::DType::F64, shape);
  dx.fill(std::numeric_limits<double>::quiet_NaN());
  std::vector<kg::Tensor> grad_inputs{dx};
  kg::CpuBackwardContext ctx(inputs, {}, y, dy, grad_inputs, {}, true, 1);
  op->cpu_backward(ctx);
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double sech = 1.0 / std::cosh(kS * x.item(i));
    const double want = dy.item(i) * kA * kS * sech * sech;
    ASSERT_NEAR(dx.item(i), want, 1e-12 * (1 + std::abs(want))) << "element " << i;
  }
  // No input gradient wanted: nothing to write, and no failure.
  std::vector<kg::Tensor> none{kg::Tensor::wrap(nullptr, kg::DType::F64, shape)};
  kg::CpuBackwardContext ctx2(inputs, {}, y, dy, none, {}, true, 1);
  EXPECT_NO_THROW(op->cpu_backward(ctx2));
}

TEST(ScaledTanh, RejectsWrongDtypesAndSettings) {
  auto [h, g] = kg::SymTensor::input(kg::DType::F16, {kg::Dim::named("batch"), 4}, "x");
  kg_test::expect_error([&] { kg::models::scaled_tanh(h, "act"); }, {"lenet.scaled_tanh", "f16"});
  auto [x, g2] = kg::SymTensor::input(kg::DType::F64, {kg::Dim::named("batch"), 4}, "x");
  kg_test::expect_error(
      [&] { x.record_custom(kg::models::scaled_tanh_op(kg::DType::F32), {}, std::nullopt, "act"); },
      {"lenet.scaled_tanh @ act", "made for f32", "input is f64"});
  kg_test::expect_error([&] { kg::models::scaled_tanh_op(kg::DType::F32, 0.0); },
                        {"lenet.scaled_tanh", "amplitude"});
  const kg::CustomData op = kg::models::scaled_tanh_op(kg::DType::F32, 2.0, 0.5);
  EXPECT_EQ(op->attributes(), "A=2 S=0.5");
  EXPECT_EQ(op.name(), "lenet.scaled_tanh");
}

TEST(ScaledTanh, Lenet5TanhIsLenet5WithTheCustomActivation) {
  const kg::Model relu = kg::models::build("lenet5");
  const kg::Model tanh = kg::models::build("lenet5-tanh");
  const auto pr = relu.parameters(), pt = tanh.parameters();
  ASSERT_EQ(pr.size(), pt.size());
  for (std::size_t i = 0; i < pr.size(); ++i) {
    EXPECT_EQ(pr[i].name, pt[i].name);
    EXPECT_EQ(pr[i].shape, pt[i].shape);
  }
  const kg::Graph& gr = tanh.recorded_graph();
  for (const char* name : {"features.1", "features.4", "classifier.1", "classifier.3"}) {
    const int id = gr.find(name);
    ASSERT_GE(id, 0) << name;
    EXPECT_EQ(gr.node(id).op_name(), "lenet.scaled_tanh") << name;
  }
  for (const char* name : {"features.2", "features.5"})
    EXPECT_EQ(gr.node(gr.find(name)).op_name(), "nn.max_pool2d");

  // Same weights: lenet5-tanh's logits are lenet5's graph with A·tanh(S·x) in place of ReLU; checked
  // here by running the tanh model against a hand-built graph of public ops (tanh and a scale).
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {3, 1, 28, 28});
  std::map<std::string, kg::Tensor> w;
  for (const auto& p : pt) w.emplace(p.name, kg_test::random_tensor(rng, p.dtype, p.shape, -0.3, 0.3));
  const auto got = kg_test::run_graph(
      [](const std::vector<kg::SymTensor>& in) {
        return std::vector<kg::SymTensor>{kg::models::lenet5_tanh(in[0])};
      },
      {x}, w);
  const auto act = [](const kg::SymTensor& t, const std::string& name) {
    return kg::mul(kg::tanh(kg::mul(t, kS, name + "_s"), name + "_t"), kA, name);
  };
  const auto want = kg_test::run_graph(
      [&](const std::vector<kg::SymTensor>& in) {
        kg::SymTensor h = in[0];
        {
          kg::NameScope s(h, "features");
          kg::nn::Conv2dOptions pad2;
          pad2.padding = 2;
          h = act(kg::nn::conv2d(h, 6, 5, pad2, "0"), "1");
          h = kg::max_pool2d(h, 2, 2, 0, 1, false, "2");
          h = act(kg::nn::conv2d(h, 16, 5, {}, "3"), "4");
          h = kg::max_pool2d(h, 2, 2, 0, 1, false, "5");
        }
        h = kg::flatten(h, 1, -1, "flatten");
        kg::NameScope s(h, "classifier");
        h = act(kg::nn::linear(h, 120, "0"), "1");
        h = act(kg::nn::linear(h, 84, "2"), "3");
        return std::vector<kg::SymTensor>{kg::nn::linear(h, 10, "4")};
      },
      {x}, w);
  ASSERT_EQ(got[0].shape(), (std::vector<std::int64_t>{3, 10}));
  EXPECT_TRUE(kg_test::all_close(got[0], want[0], 1e-4, 1e-5));
}
