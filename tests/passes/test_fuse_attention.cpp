// The attention pass (passes/fuse_attention.cpp): recorded chains in each of the exporters' forms
// (scale after the product as Mul or Div, on q and k separately, no scale, a mask or none, k
// transposed by a permute that is folded or by a transpose of k itself, an identity view before
// the last product) become one nn.attention node and compute what the unfused graph computes, on
// the CPU forms and under the emulator; chains it must leave alone (a value read elsewhere, a scale
// after the mask, broadcast batch dims, training); and the exported BERT and GPT-2 fixtures, whose
// attention layers each become one node, against ONNX Runtime's outputs stored beside them.
#include <cstdlib>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>

#include "kg/kg.hpp"
#include "kg/onnx.hpp"
#include "ops/attention.hpp"
#include "passes/passes.hpp"
#include "support/fusion_util.hpp"
#include "support/test_util.hpp"

namespace {

using V = std::vector<kg::SymTensor>;

int count_named(const kg::Model& m, const std::string& op) {
  int n = 0;
  for (int id : m.live_nodes()) {
    const kg::Node& node = m.graph().node(id);
    if (node.kind == kg::Node::Kind::Op && node.op_name() == op) ++n;
  }
  return n;
}

// The nn.attention node's spec (the model must have exactly one).
kg::ops::AttentionSpec only_attention(const kg::Model& m) {
  std::vector<kg::ops::AttentionSpec> found;
  for (int id : m.live_nodes()) {
    const kg::Node& node = m.graph().node(id);
    if (node.kind != kg::Node::Kind::Op) continue;
    if (auto s = kg::ops::attention_spec(node.op->op())) found.push_back(*s);
  }
  EXPECT_EQ(found.size(), 1u);
  return found.empty() ? kg::ops::AttentionSpec{} : found[0];
}

struct Chain {
  std::string what;
  std::vector<std::vector<std::int64_t>> shapes;  // inputs
  std::function<kg::SymTensor(const V&)> build;
  bool fused = true;
  double scale = 0;  // the nn.attention node's, when fused
};

kg::Model model_of(const Chain& c, bool fusion) {
  auto g = kg::Graph::create();
  V xs;
  for (std::size_t i = 0; i < c.shapes.size(); ++i)
    xs.push_back(g->input(kg::DType::F32, kg::Shape::of(c.shapes[i]), "x" + std::to_string(i)));
  return kg::Model(g, {c.build(xs)}, kg::LoweringMode::Inference, kg::ModelOptions{.fusion = fusion});
}

std::vector<Chain> chains() {
  const std::vector<std::int64_t> q{2, 3, 7, 16}, k{2, 3, 9, 16}, v{2, 3, 9, 8}, mask{2, 1, 1, 9};
  // [batch, S, heads, D] as BERT's reshape gives it, transposed by the permutes the exporters write.
  const std::vector<std::int64_t> qs{2, 7, 3, 16}, ks{2, 9, 3, 16}, vs{2, 9, 3, 8};
  auto kt = [](const kg::SymTensor& x) { return kg::transpose(x, -1, -2); };
  return {
      {"mul after the product, additive mask",
       {q, k, v, mask},
       [=](const V& x) { return kg::matmul(kg::softmax(kg::matmul(x[0], kt(x[1])) * 0.25 + x[3], -1), x[2]); },
       true,
       0.25},
      {"div after the product, the mask first in the add",
       {q, k, v, mask},
       [=](const V& x) { return kg::matmul(kg::softmax(kg::add(x[3], kg::matmul(x[0], kt(x[1])) / 4.0), 3), x[2]); },
       true,
       0.25},
      {"scale on q and on k, no mask",
       {q, k, v},
       [=](const V& x) { return kg::matmul(kg::softmax(kg::matmul(x[0] * 0.5, kt(x[1] * 0.5)), -1), x[2]); },
       true,
       0.25},
      {"no scale, BERT's permutes (k's folded into one)",
       {qs, ks, vs, mask},
       [=](const V& x) {
         auto q4 = kg::permute(x[0], {0, 2, 1, 3});
         auto k4t = kg::permute(x[1], {0, 2, 3, 1});
         auto v4 = kg::permute(x[2], {0, 2, 1, 3});
         auto o = kg::matmul(kg::softmax(kg::matmul(q4, k4t) + x[3], -1), v4);
         return kg::permute(o, {0, 2, 1, 3});
       },
       true,
       1.0},
      {"identity view before the last product, rank 3",
       {{6, 7, 16}, {6, 9, 16}, {6, 9, 8}},
       [=](const V& x) {
         auto p = kg::softmax(kg::matmul(x[0], kt(x[1])) * 0.125, -1);
         return kg::matmul(kg::reshape(p, {6, 7, 9}), x[2]);
       },
       true,
       0.125},
      {"scores also an output: left alone",
       {q, k, v},
       [=](const V& x) {
         auto s = kg::matmul(x[0], kt(x[1]));
         return kg::matmul(kg::softmax(s, -1), x[2]) + kg::matmul(kg::softmax(s, -1), x[2]);
       },
       false},
      {"scale after the mask: left alone",
       {q, k, v, mask},
       [=](const V& x) { return kg::matmul(kg::softmax((kg::matmul(x[0], kt(x[1])) + x[3]) * 0.25, -1), x[2]); },
       false},
      {"softmax over another dim: left alone",
       {q, k, v},
       [=](const V& x) { return kg::matmul(kg::softmax(kg::matmul(x[0], kt(x[1])), 2), x[2]); },
       false},
      {"k broadcast over the heads: left alone",
       {q, {2, 1, 9, 16}, v},
       [=](const V& x) { return kg::matmul(kg::softmax(kg::matmul(x[0], kt(x[1])), -1), x[2]); },
       false},
  };
}

}  // namespace

TEST(FuseAttention, ChainsBecomeOneNodeAndComputeTheSame) {
  const auto seed = kg_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const Chain& c : chains()) {
    SCOPED_TRACE(c.what);
    const kg::Model fused = model_of(c, true), plain = model_of(c, false);
    EXPECT_EQ(count_named(fused, "nn.attention"), c.fused ? 1 : 0);
    EXPECT_EQ(count_named(plain, "nn.attention"), 0);
    if (c.fused) {
      EXPECT_EQ(count_named(fused, "nn.softmax") + count_named(fused, "kg.fused_reduction"), 0);
      EXPECT_EQ(count_named(fused, "nn.matmul") + count_named(fused, "kg.fused_gemm"), 0);
      const kg::ops::AttentionSpec spec = only_attention(fused);
      ASSERT_TRUE(spec.scale.has_value());
      EXPECT_DOUBLE_EQ(*spec.scale, c.scale);
      EXPECT_FALSE(spec.causal);
    }
    const auto inputs = kg_test::random_inputs(rng, c.shapes, kg::DType::F32, -1.5, 1.5);
    kg_test::expect_fused_matches_plain(fused, plain, c.shapes, inputs, 1e-5);
  }
}

TEST(FuseAttention, TrainingKeepsTheChain) {
  const Chain c = chains()[0];
  auto g = kg::Graph::create();
  V xs;
  for (std::size_t i = 0; i < c.shapes.size(); ++i)
    xs.push_back(g->input(kg::DType::F32, kg::Shape::of(c.shapes[i]), "x" + std::to_string(i)));
  const kg::SymTensor y = c.build(xs);
  auto attention_nodes = [](const kg::passes::GraphAndOutputs& r) {
    int n = 0;
    for (const auto& node : r.graph->nodes())
      if (node.kind == kg::Node::Kind::Op && kg::ops::attention_spec(node.op->op())) ++n;
    return n;
  };
  EXPECT_EQ(attention_nodes(kg::passes::optimize(g, {y.node()}, kg::LoweringMode::Inference)), 1);
  EXPECT_EQ(attention_nodes(kg::passes::optimize(g, {y.node()}, kg::LoweringMode::Training)), 0);
  // Turned off by the option or the environment, the chain stays as recorded.
  kg::ModelOptions off;
  off.attention = false;
  EXPECT_EQ(attention_nodes(kg::passes::optimize(g, {y.node()}, kg::LoweringMode::Inference, off)), 0);
  ::setenv("KG_NO_ATTENTION_FUSION", "1", 1);
  const int with_env = attention_nodes(kg::passes::optimize(g, {y.node()}, kg::LoweringMode::Inference));
  ::unsetenv("KG_NO_ATTENTION_FUSION");
  EXPECT_EQ(with_env, 0);
}

// The exported models' attention layers each become one node; outputs still match ONNX Runtime's.
TEST(FuseAttention, ExportedBertAndGpt2) {
  const std::string dir = std::string(KG_SOURCE_DIR) + "/tests/fixtures/onnx/";
  struct Exported {
    std::string name;
    std::vector<std::string> inputs, outputs;
  };
  const std::vector<Exported> models = {
      {"bert2", {"input_ids", "attention_mask"}, {"last_hidden_state", "pooler_output"}},
      {"gpt2", {"input_ids"}, {"logits"}},
  };
  for (const Exported& e : models) {
    SCOPED_TRACE(e.name);
    const kg::Model model = kg::onnx::import(dir + e.name + ".onnx");
    EXPECT_EQ(count_named(model, "nn.attention"), 2);  // one per layer
    EXPECT_EQ(count_named(model, "nn.softmax"), 0);
    const auto t = kg::read_safetensors(dir + e.name + ".case1.safetensors");
    std::vector<kg::Tensor> ins;
    std::vector<std::vector<std::int64_t>> shapes;
    for (const auto& n : e.inputs) {
      ins.push_back(t.at(n));
      shapes.push_back(t.at(n).shape());
    }
    for (bool checked : {false, true}) {
      SCOPED_TRACE(checked ? "emulated" : "cpu");
      kg::LoadOptions o;
      o.poison_buffers = !checked;
      o.checked = checked;
      kg::LoadedModel lm = model.load(kg::Device::cpu(), shapes, o);
      const auto got = lm.forward(ins);
      const auto names = lm.output_names();
      for (const auto& out : e.outputs) {
        const auto at = std::find(names.begin(), names.end(), out) - names.begin();
        ASSERT_LT(static_cast<std::size_t>(at), names.size()) << out;
        const kg::Tensor& want = t.at(out);
        double scale = 0;
        for (std::int64_t i = 0; i < want.numel(); ++i) scale = std::max(scale, std::abs(want.item(i)));
        EXPECT_TRUE(kg_test::all_close(got[static_cast<std::size_t>(at)], want, 1e-4, 1e-4 * scale)) << out;
      }
    }
  }
}
