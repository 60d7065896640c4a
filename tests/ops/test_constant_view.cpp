// nn.constant (a parameter as a value) and nn.view (dims taken from inputs), and Graph::bind_param.
#include <gtest/gtest.h>

#include <random>

#include "kg/testing.hpp"
#include "ops/constant.hpp"
#include "ops/view.hpp"
#include "support/test_util.hpp"

namespace {

using kg::ops::DimRef;

TEST(Constant, OutputsItsParameterOnEveryPathAndTrainsIt) {
  const auto seed = kg_test::fresh_seed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const kg::Tensor value = kg_test::random_tensor(rng, kg::DType::F32, {3, 5});
  auto g = kg::Graph::create();
  kg::SymTensor c = kg::ops::record_constant(*g, value, "table.weight", "table", true);
  EXPECT_EQ(c.shape().to_string(), "[3, 5]");
  EXPECT_EQ(g->node(c.node()).params.at(0).name, "table.weight");
  kg::Model m(g, {c});
  kg::LoadOptions o;
  o.poison_buffers = true;
  const kg::Tensor y = m.load(kg::Device::cpu(), {}, o).forward({}).at(0);
  EXPECT_TRUE(kg_test::all_close(y, value, 0, 0));
  // The lowered kernel (emulated, checked) and the backward (the gradient is the output's).
  kg::testing::CheckOpOptions co;
  co.reference = [&](const std::vector<kg::Tensor>&, const std::map<std::string, kg::Tensor>& p) {
    return p.at("value");
  };
  const auto r = kg::testing::check_op(kg::ops::constant_op(kg::DType::F32, {4, 3}, kg::ParamInit::normal(0, 1), true),
                                       {}, {}, co);
  EXPECT_TRUE(r.ok) << r.to_string();
}

TEST(Constant, IntegerConstantsAreNotTrainable) {
  auto g = kg::Graph::create();
  kg::SymTensor c = kg::ops::record_constant(*g, kg::Tensor::from_vector<std::int64_t>({2}, {4, 7}), "ids", "ids", true);
  EXPECT_FALSE(g->node(c.node()).params.at(0).trainable);
  EXPECT_EQ(c.dtype(), kg::DType::I64);
}

TEST(View, DimsReferToTheInputAndToShapeSources) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 6});
  kg::SymTensor other = g->input(kg::DType::F32, {kg::Dim::named("seq"), 2}, "other");
  // [batch, 6] → [batch, 2, 3]; → [3, batch, 2] reads dims across; -1 infers.
  EXPECT_EQ(kg::ops::view(x, {DimRef::of(0, 0), DimRef::constant(2), DimRef::constant(3)}).shape().to_string(),
            "[batch, 2, 3]");
  EXPECT_EQ(kg::ops::view(x, {DimRef::constant(3), DimRef::of(0, 0), DimRef::constant(-1)}).shape().to_string(),
            "[3, batch, 2]");
  EXPECT_EQ(kg::ops::view(x, {DimRef::constant(-1)}).shape().to_string(), "[?]");
  EXPECT_EQ(kg::ops::view(x, {DimRef::of(1, 0), DimRef::constant(-1)}, {other}).shape().to_string(), "[seq, ?]");
  // At load the shapes are concrete and the bytes are the input's.
  kg::Model m(g, {kg::ops::view(x, {DimRef::constant(2), DimRef::of(0, 0), DimRef::constant(3)})});
  const auto seed = kg_test::fresh_seed();
  std::mt19937_64 rng(seed);
  const kg::Tensor in = kg_test::random_tensor(rng, kg::DType::F32, {4, 6});
  const kg::Tensor y = m.load(kg::Device::cpu(), {{4, 6}, {1, 2}}).forward({in, kg::Tensor::zeros(kg::DType::F32, {1, 2})}).at(0);
  ASSERT_EQ(y.shape(), (std::vector<std::int64_t>{2, 4, 3}));
  for (std::int64_t i = 0; i < in.numel(); ++i) ASSERT_EQ(y.item(i), in.item(i));
}

TEST(View, BadDimsAreErrors) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {4, 6});
  kg_test::expect_error([&] { kg::ops::view(x, {DimRef::constant(-1), DimRef::constant(-1)}); },
                        {"at most one size can be inferred"});
  kg_test::expect_error([&] { kg::ops::view(x, {DimRef::constant(-3)}); }, {"invalid size -3"});
  kg_test::expect_error([&] { kg::ops::view(x, {DimRef::constant(5), DimRef::constant(5)}); },
                        {"[nn.view", "24 elements vs 25"});
  kg_test::expect_error([&] { kg::ops::view(x, {DimRef::constant(5), DimRef::constant(-1)}); },
                        {"24 elements do not divide into 5"});
  kg_test::expect_error([&] { kg::ops::view(x, {DimRef::of(0, 7)}); }, {"dim 7 of input 0", "rank 2"});
  kg_test::expect_error([&] { kg::ops::view(x, {DimRef::of(3, 0)}); }, {"refers to input 3"});
}

TEST(BindParam, ChecksTheIndexTheSizeAndTheName) {
  auto g = kg::Graph::create();
  kg::SymTensor a = kg::ops::record_constant(*g, kg::Tensor::zeros(kg::DType::F32, {2, 2}), "a.w", "a", true);
  kg::SymTensor b = kg::ops::record_constant(*g, kg::Tensor::zeros(kg::DType::F32, {3}), "b.w", "b", true);
  kg_test::expect_error([&] { g->bind_param(a.node(), 1, "x", kg::ParamInit::constant(0)); },
                        {"[nn.constant @ a]", "has 1 parameters", "cannot bind parameter 1"});
  kg_test::expect_error([&] { g->bind_param(b.node(), 0, "a.w", kg::ParamInit::constant(0)); },
                        {"'a.w' is already a parameter of [nn.constant @ a]"});
  kg_test::expect_error(
      [&] { g->bind_param(b.node(), 0, "b.w", kg::ParamInit::from_values(std::vector<float>{1, 2})); },
      {"8 bytes of data but [3] × f32 needs 12"});
  kg_test::expect_error([&] { g->bind_param(99, 0, "z", kg::ParamInit::constant(0)); }, {"no op node 99"});
  g->bind_param(b.node(), 0, "renamed", kg::ParamInit::from_values(std::vector<float>{1, 2, 3}), false);
  EXPECT_EQ(g->node(b.node()).params[0].name, "renamed");
  EXPECT_FALSE(g->node(b.node()).params[0].trainable);
}

}  // namespace
