// The prologue pass and kg.fused_reduction: an elementwise group read only by a reduction is folded
// into it, and the folded node agrees with the unfused graph on the CPU (the chunked prologue, then
// the reduction's CPU form) and under the CUDA emulator (the reduction's kernel reading through the
// prologue, checked mode); what is not folded; bad descriptions; a bf16 load; the GPU.
#include <algorithm>
#include <cmath>

#include "kg/models.hpp"
#include "kg/onnx.hpp"
#include "kg/testing.hpp"
#include "ops/fused_reduction.hpp"
#include "ops/pointwise.hpp"
#include "ops/reduce_ops.hpp"
#include "support/onnx_builder.hpp"
#include "support/fusion_util.hpp"
#include "support/test_util.hpp"

using kg_test::count_ops;
using kg_test::fresh_seed;
using kg_test::member_names;

namespace {

struct Built {
  std::shared_ptr<kg::Graph> graph;
  std::vector<kg::SymTensor> outputs;
  std::vector<std::vector<std::int64_t>> input_shapes;
};

std::vector<const kg::ops::FusedReductionOp*> folded_ops(const kg::Graph& g, const std::vector<int>& live) {
  std::vector<const kg::ops::FusedReductionOp*> v;
  for (int id : live) {
    const kg::Node& node = g.node(id);
    if (node.kind != kg::Node::Kind::Op) continue;
    if (const auto* f = node.op->as<kg::ops::FusedReductionOp>()) v.push_back(f);
  }
  return v;
}
std::vector<const kg::ops::FusedReductionOp*> folded_ops(const kg::Model& m) {
  return folded_ops(m.graph(), m.live_nodes());
}

// Inputs in [lo, hi].
std::vector<kg::Tensor> random_inputs(std::mt19937_64& rng, const Built& b, kg::DType dt, double lo = -2.0,
                                      double hi = 2.0) {
  return kg_test::random_inputs(rng, b.input_shapes, dt, lo, hi);
}

// Random values for every float parameter.
std::map<std::string, kg::Tensor> random_params(const kg::Model& m, std::mt19937_64& rng) {
  std::map<std::string, kg::Tensor> p;
  for (const auto& info : m.parameters())
    p[info.name] = kg_test::random_tensor(rng, info.dtype, info.shape, -1.5, 1.5);
  return p;
}

// Runs `b` folded and unfused (ModelOptions::fusion off) on the same inputs and parameters: the
// folded model on the CPU (its CPU form) and checked under the emulator (its generated kernel, every
// output element written); expects the unfused outputs. Returns the folded model.
kg::Model compare_inference(const Built& b, const std::vector<kg::Tensor>& inputs, std::mt19937_64& rng,
                            double tol) {
  kg::Model fused(b.graph, b.outputs);
  kg::Model plain(b.graph, b.outputs, kg::LoweringMode::Inference, {.fusion = false});
  kg_test::expect_fused_matches_plain(fused, plain, b.input_shapes, inputs, tol, random_params(plain, rng));
  return fused;
}

kg::SymTensor exp_of(const kg::SymTensor& x, const std::string& name) {
  return kg::ops::pointwise(kg::ops::PointwiseFn::Exp, {x}, {}, name);
}

}  // namespace

// Attention scores: softmax(x * scale + mask) with a scalar scale and a [1, 1, T, T] mask broadcast
// to [B, H, T, T], over the last dim (rows) and over dim 2 (columns), softmax and log-softmax.
TEST(FusePrologue, MaskedScaledSoftmaxIsOneNodeWithTheUnfusedValues) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64})
    for (bool log : {false, true})
      for (std::int64_t dim : {-1, 2}) {
        SCOPED_TRACE(::testing::Message() << kg::dtype_name(dt) << " log=" << log << " dim=" << dim);
        auto [x, g] = kg::SymTensor::input(dt, {kg::Dim::named("batch"), 3, 17, 17}, "x");
        kg::SymTensor scale = g->input(dt, {}, "scale");
        kg::SymTensor mask = g->input(dt, {1, 1, 17, 17}, "mask");
        kg::SymTensor s = kg::add(kg::mul(x, scale, "scaled"), mask, "masked");
        kg::SymTensor y = log ? kg::log_softmax(s, dim, "probs") : kg::softmax(s, dim, "probs");
        Built b{g, {y}, {{2, 3, 17, 17}, {}, {1, 1, 17, 17}}};
        kg::Model m = compare_inference(b, random_inputs(rng, b, dt), rng, dt == kg::DType::F32 ? 1e-5 : 1e-12);
        EXPECT_EQ(count_ops(m), 1);
        auto f = folded_ops(m);
        ASSERT_EQ(f.size(), 1u);
        EXPECT_EQ(member_names(*f[0]), (std::vector<std::string>{"scaled", "masked"}));
        EXPECT_EQ(f[0]->inputs(), 3);
        // The folded node keeps the reduction's name; its attributes name the reduction, the
        // prologue's members and the kernel.
        const kg::Node& node = m.graph().node(m.outputs()[0].second);
        EXPECT_EQ(node.name, "probs");
        EXPECT_EQ(node.op_name(), "kg.fused_reduction");
        const std::string attrs = node.op->op().attributes();
        EXPECT_NE(attrs.find(log ? "nn.log_softmax dim=" : "nn.softmax dim="), std::string::npos) << attrs;
        EXPECT_NE(attrs.find("prologue=scaled,masked kernel=kg_prologue_"), std::string::npos) << attrs;
      }
}

// Rows longer than a warp's share (a block per row) and a softmax whose rows are all -inf after the
// mask in places.
TEST(FusePrologue, LongRowsAndMaskedOutRowsAgree) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 1500}, "x");
  kg::SymTensor bias = g->input(kg::DType::F32, {1500}, "bias");
  kg::SymTensor y = kg::softmax(kg::sub(kg::mul(x, 0.5, "half"), bias, "shifted"), -1, "sm");
  Built b{g, {y}, {{5, 1500}, {1500}}};
  compare_inference(b, random_inputs(rng, b, kg::DType::F32), rng, 1e-6);
}

// layer_norm(a + b) with its affine parameters (loaded by the reduction's names), rows taken by a
// warp and by a block, a row-broadcast b.
TEST(FusePrologue, LayerNormOfASumIsFolded) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t inner : {48, 1300})
    for (bool affine : {true, false})
      for (bool row_b : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "inner " << inner << " affine " << affine << " row_b " << row_b);
        auto [a, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, inner}, "a");
        kg::SymTensor bb = row_b ? g->input(kg::DType::F32, {inner}, "b")
                                 : g->input(kg::DType::F32, {kg::Dim::named("batch"), 3, inner}, "b");
        kg::SymTensor y = kg::nn::layer_norm(kg::add(a, bb, "residual"), {inner}, "ln", 1e-5, affine);
        Built b{g, {y}, {{4, 3, inner}, row_b ? std::vector<std::int64_t>{inner} : std::vector<std::int64_t>{4, 3, inner}}};
        kg::Model m = compare_inference(b, random_inputs(rng, b, kg::DType::F32), rng, 2e-5);
        auto f = folded_ops(m);
        ASSERT_EQ(f.size(), 1u);
        EXPECT_EQ(member_names(*f[0]), (std::vector<std::string>{"residual"}));
        // The parameters keep the layer norm's names.
        std::vector<std::string> names;
        for (const auto& p : m.parameters()) names.push_back(p.name);
        EXPECT_EQ(names, affine ? (std::vector<std::string>{"ln.weight", "ln.bias"}) : std::vector<std::string>{});
      }
}

// Every reduce.<fn> over several axis sets, sum(exp(x - c)) style: the prologue reads a broadcast
// c [B, 1, W] and a scalar.
TEST(FusePrologue, EveryReductionFunctionAgreesFoldedAndUnfolded) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  using kg::ops::ReduceFn;
  const std::vector<std::vector<std::int64_t>> axes_sets{{-1}, {1}, {0, 2}, {}};
  for (ReduceFn fn : {ReduceFn::Sum, ReduceFn::Mean, ReduceFn::Max, ReduceFn::Min, ReduceFn::Prod, ReduceFn::L1,
                      ReduceFn::L2, ReduceFn::SumSquare, ReduceFn::LogSum, ReduceFn::LogSumExp})
    for (const auto& axes : axes_sets)
      for (bool keep : {false, true}) {
        SCOPED_TRACE(::testing::Message() << kg::ops::reduce_op_name(fn) << " axes " << kg::sizes_to_string(axes)
                                          << " keepdims " << keep);
        auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 6, 11}, "x");
        kg::SymTensor c = g->input(kg::DType::F32, {kg::Dim::named("batch"), 1, 11}, "c");
        kg::SymTensor k = g->input(kg::DType::F32, {1}, "k");
        // exp(x - c) * k: positive for LogSum; near 1 for Prod (x, c in [-0.1, 0.1], k near 1).
        kg::SymTensor v = kg::mul(exp_of(kg::sub(x, c, "centred"), "e"), k, "scaled");
        kg::SymTensor y = kg::ops::reduce(fn, v, axes, keep, "r");
        Built b{g, {y}, {{3, 6, 11}, {3, 1, 11}, {1}}};
        auto in = random_inputs(rng, b, kg::DType::F32, -0.1, 0.1);
        in[2] = kg_test::random_tensor(rng, kg::DType::F32, {1}, 0.9, 1.1);
        kg::Model m = compare_inference(b, in, rng, 1e-5);
        auto f = folded_ops(m);
        ASSERT_EQ(f.size(), 1u);
        EXPECT_EQ(member_names(*f[0]), (std::vector<std::string>{"centred", "e", "scaled"}));
        EXPECT_EQ(count_ops(m), 1);
      }
}

// A reduction of few outputs with many elements each is split in two launches (partials, then
// their combination): both take the prologue's arguments.
TEST(FusePrologue, ASplitReductionReadsThroughThePrologue) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (auto fn : {kg::ops::ReduceFn::Sum, kg::ops::ReduceFn::LogSumExp}) {
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {2, 40000}, "x");
    kg::SymTensor y = kg::ops::reduce(fn, kg::mul(x, 3.0, "tripled"), {-1}, false, "total");
    Built b{g, {y}, {{2, 40000}}};
    kg::Model m = compare_inference(b, random_inputs(rng, b, kg::DType::F32), rng, 1e-5);
    EXPECT_EQ(folded_ops(m).size(), 1u);
  }
}

// A lone fusable node reading one value twice (an imported instance norm's variance, mean(d * d))
// is a prologue of one member and one input.
TEST(FusePrologue, ALoneNodeReadingAValueTwiceIsFolded) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [d, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 4, 9, 9}, "d");
  kg::SymTensor var = kg::ops::reduce(kg::ops::ReduceFn::Mean, kg::mul(d, d, "sq"), {2, 3}, true, "var");
  Built b{g, {var}, {{2, 4, 9, 9}}};
  kg::Model m = compare_inference(b, random_inputs(rng, b, kg::DType::F32), rng, 1e-6);
  auto f = folded_ops(m);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0]->inputs(), 1);
  EXPECT_EQ(member_names(*f[0]), (std::vector<std::string>{"sq"}));
}

TEST(FusePrologue, AValueAlsoReadElsewhereIsNotFolded) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 20}, "x");
  kg::SymTensor m0 = g->input(kg::DType::F32, {20}, "m");
  kg::SymTensor s = kg::add(kg::mul(x, 2.0, "twice"), m0, "shifted");
  kg::SymTensor p = kg::softmax(s, -1, "probs");
  kg::SymTensor total = kg::ops::reduce(kg::ops::ReduceFn::Sum, s, {-1}, false, "total");
  Built b{g, {p, total}, {{3, 20}, {20}}};
  kg::Model m = compare_inference(b, random_inputs(rng, b, kg::DType::F32), rng, 1e-5);
  EXPECT_TRUE(folded_ops(m).empty());
  EXPECT_EQ(count_ops(m), 3);  // the group, the softmax, the sum
}

TEST(FusePrologue, AModelOutputIsNotFolded) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 20}, "x");
  kg::SymTensor s = kg::add(kg::mul(x, 2.0, "twice"), 1.0, "shifted");
  kg::SymTensor p = kg::softmax(s, -1, "probs");
  Built b{g, {s, p}, {{3, 20}}};
  kg::Model m = compare_inference(b, random_inputs(rng, b, kg::DType::F32), rng, 1e-5);
  EXPECT_TRUE(folded_ops(m).empty());
}

// The reduction reads the group through one of its inputs only when that is its data input: a
// reduction of a value of another dtype, or of an op with no form, stays.
TEST(FusePrologue, OnlyElementwiseProducersAreFolded) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 8, 8}, "x");
  kg::SymTensor t = kg::transpose(kg::mul(x, 2.0, "twice"), 1, 2, "t");
  kg::SymTensor y = kg::softmax(t, -1, "sm");
  kg::Model m(g, {y});
  EXPECT_TRUE(folded_ops(m).empty());
}

TEST(FusePrologue, TrainingLeavesTheReductionUnfolded) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 16}, "x");
  kg::SymTensor y = kg::nn::layer_norm(kg::tanh(kg::mul(x, 0.5, "half"), "act"), {16}, "ln");
  kg::Model training(g, {y}, kg::LoweringMode::Training);
  EXPECT_TRUE(folded_ops(training).empty());
  // The same graph for inference is folded.
  kg::Model inference(g, {y});
  EXPECT_EQ(folded_ops(inference).size(), 1u);
  // And the training model's forward still matches the unfused one.
  kg::Model plain(g, {y}, kg::LoweringMode::Training, {.fusion = false});
  auto lt = training.load(kg::Device::cpu(), {{4, 16}});
  auto lp = plain.load(kg::Device::cpu(), {{4, 16}});
  lp.load_state_dict(lt.state_dict());
  const kg::Tensor in = kg_test::random_tensor(rng, kg::DType::F32, {4, 16}, -1.0, 1.0);
  EXPECT_TRUE(kg_test::all_close(lt.forward({in})[0], lp.forward({in})[0], 1e-6, 1e-6));
}

TEST(FusePrologue, FusionOffLeavesEverythingUnfolded) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 16}, "x");
  kg::SymTensor y = kg::softmax(kg::mul(x, 0.5, "half"), -1, "sm");
  kg::Model off(g, {y}, kg::LoweringMode::Inference, {.fusion = false});
  EXPECT_TRUE(folded_ops(off).empty());
  ::setenv("KG_NO_FUSION", "1", 1);
  kg::Model env(g, {y});
  ::unsetenv("KG_NO_FUSION");
  EXPECT_TRUE(folded_ops(env).empty());
  kg::Model on(g, {y});
  EXPECT_EQ(folded_ops(on).size(), 1u);
}

// kgraph inspect's table and the DOT picture show the prologue's members.
TEST(FusePrologue, SummaryAndDotShowThePrologue) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 16}, "x");
  kg::SymTensor mask = g->input(kg::DType::F32, {16}, "mask");
  kg::SymTensor y = kg::softmax(kg::add(kg::mul(x, 0.5, "half"), mask, "masked"), -1, "sm");
  kg::Model m(g, {y});
  const std::string summary = m.summary();
  EXPECT_NE(summary.find("kg.fused_reduction"), std::string::npos) << summary;
  EXPECT_NE(summary.find("prologue=half,masked"), std::string::npos) << summary;
  const std::string dot = m.to_dot();
  EXPECT_NE(dot.find("subgraph cluster_n"), std::string::npos) << dot;
  EXPECT_NE(dot.find("fused: sm"), std::string::npos) << dot;
  EXPECT_NE(dot.find("label=\"half\""), std::string::npos) << dot;
  EXPECT_NE(dot.find("label=\"masked\""), std::string::npos) << dot;
}

// A bf16 load: the precision pass keeps the folded node in f32 (it declares no 16-bit compute) with
// casts around it; the outputs match the f32 run within bf16's rounding.
TEST(FusePrologue, ABf16LoadKeepsTheFoldedNodeInF32WithCasts) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 4, 32}, "x");
  kg::SymTensor mask = g->input(kg::DType::F32, {1, 1, 32}, "mask");
  kg::SymTensor p = kg::softmax(kg::add(kg::mul(x, 0.25, "scaled"), mask, "masked"), -1, "probs");
  kg::SymTensor n = kg::nn::layer_norm(kg::add(x, 1.0, "plus1"), {32}, "ln");
  Built b{g, {p, n}, {{2, 4, 32}, {1, 1, 32}}};
  kg::Model m(g, b.outputs);
  ASSERT_EQ(folded_ops(m).size(), 2u);
  const auto in = random_inputs(rng, b, kg::DType::F32);
  auto want = m.load(kg::Device::cpu(), b.input_shapes).forward(in);
  for (bool checked : {false, true}) {
    SCOPED_TRACE(checked ? "emulated" : "cpu");
    kg::LoadOptions opt;
    opt.precision = kg::DType::BF16;
    opt.checked = checked;
    auto lm = m.load(kg::Device::cpu(), b.input_shapes, opt);
    auto got = lm.forward(in);
    ASSERT_EQ(got.size(), 2u);
    for (std::size_t i = 0; i < 2; ++i) {
      EXPECT_TRUE(kg_test::all_written(got[i]));
      EXPECT_TRUE(kg_test::all_close(got[i].to(kg::DType::F32), want[i], 0.03, 0.03)) << "output " << i;
    }
    // The folded nodes stay f32 and read f32 values.
    const kg::Graph& lg = lm.graph();
    int folded = 0;
    for (const auto& node : lg.nodes()) {
      if (node.kind != kg::Node::Kind::Op || !node.op->as<kg::ops::FusedReductionOp>()) continue;
      ++folded;
      EXPECT_EQ(node.dtype, kg::DType::F32) << node.name;
      for (int in_id : node.inputs) EXPECT_EQ(lg.node(in_id).dtype, kg::DType::F32) << node.name;
    }
    EXPECT_EQ(folded, 2);
  }
}

TEST(FusePrologue, ABadDescriptionIsAnError) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {4, 8}, "x");
  kg::SymTensor y = kg::mul(x, 2.0, "twice");
  const kg::CustomData twice = g->node(y.node()).op.value();
  auto form = twice->elementwise_form({kg::DType::F32});
  ASSERT_TRUE(form);
  auto member = [&](std::vector<int> args) { return kg::ops::FusedMember{"twice", twice, *form, std::move(args)}; };
  const kg::CustomData softmax = g->node(kg::softmax(x, -1, "sm").node()).op.value();
  const kg::CustomData relu = g->node(kg::relu(x, "r").node()).op.value();
  // A reduction that takes no prologue.
  kg_test::expect_error([&] { kg::ops::FusedReductionOp({member({-1})}, 1, relu, kg::DType::F32); },
                        {"kg.fused_reduction (nn.relu)", "not a reduction that takes a prologue"});
  // A 16-bit prologue.
  kg_test::expect_error([&] { kg::ops::FusedReductionOp({member({-1})}, 1, softmax, kg::DType::BF16); },
                        {"kg.fused_reduction (nn.softmax)", "f32 or f64, not bf16"});
  // A member reading a group input that does not exist, an input nobody reads, no member.
  kg_test::expect_error([&] { kg::ops::FusedReductionOp({member({-2})}, 1, softmax, kg::DType::F32); },
                        {"prologue", "member nn.mul_scalar @ twice", "reads value -2"});
  kg_test::expect_error([&] { kg::ops::FusedReductionOp({member({-1})}, 2, softmax, kg::DType::F32); },
                        {"prologue", "group input 1 is read by no member"});
  kg_test::expect_error([&] { kg::ops::FusedReductionOp({}, 1, softmax, kg::DType::F32); },
                        {"prologue", "at least one member"});
  // Inputs that do not broadcast, and the wrong dtype.
  kg::ops::FusedReductionOp ok({member({-1})}, 1, softmax, kg::DType::F32);
  kg_test::expect_error([&] { ok.infer_output_shape({kg::Shape{4, 8}, kg::Shape{3}}); }, {"expects 1 input(s), got 2"});
  kg_test::expect_error([&] { ok.infer_output_dtype({kg::DType::F64}); }, {"fused for f32 inputs, got f64"});
  kg::LowerContext ctx;
  ctx.node = "sm";
  ctx.input_shapes = {kg::Shape{4, 8}, kg::Shape{4, 8}};
  kg_test::expect_error([&] { ok.lower(ctx); }, {"[kg.fused_reduction @ sm]", "expects 1 input(s), got 2"});
}

// Shapes that do not broadcast at load are named.
TEST(FusePrologue, PrologueInputsThatDoNotBroadcastAreAnError) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 8}, "x");
  kg::SymTensor b = g->input(kg::DType::F32, {kg::Dim::named("other"), 8}, "b");
  kg::SymTensor y = kg::softmax(kg::add(x, b, "sum"), -1, "sm");
  kg::Model m(g, {y});
  ASSERT_EQ(folded_ops(m).size(), 1u);
  kg_test::expect_error([&] { m.load(kg::Device::cpu(), {{3, 8}, {5, 8}}); }, {"sm"});
}

// An imported model benefits: attention-style Softmax(x * scale + mask), LayerNormalization of a
// residual Add, and ReduceSum(Exp(x - c)) each become one kg.fused_reduction with the ONNX node's
// name, and agree with the import without fusion.
TEST(FusePrologue, AnImportedOnnxModelsReductionsTakeTheirPrologues) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  kg_test::OnnxBuilder m;
  m.input("x", kg::DType::F32, {std::string("batch"), std::int64_t{4}, std::int64_t{24}});
  m.input("mask", kg::DType::F32, {std::int64_t{1}, std::int64_t{4}, std::int64_t{24}});
  m.initializer("scale", kg::Tensor::from_vector<float>({}, {0.3f}));
  m.initializer("ln.weight", kg_test::random_tensor(rng, kg::DType::F32, {24}, -1.0, 1.0));
  m.initializer("ln.bias", kg_test::random_tensor(rng, kg::DType::F32, {24}, -1.0, 1.0));
  m.initializer("axes", kg::Tensor::from_vector<std::int64_t>({1}, {-1}));
  m.node("Mul", {"x", "scale"}, {"xs"}, "/attn/Mul");
  m.node("Add", {"xs", "mask"}, {"scores"}, "/attn/Add");
  kg_test::OnnxBuilder::attr(m.node("Softmax", {"scores"}, {"probs"}, "/attn/Softmax"), "axis", std::int64_t{-1});
  m.node("Add", {"x", "mask"}, {"res"}, "/res/Add");
  kg_test::OnnxBuilder::attr(m.node("LayerNormalization", {"res", "ln.weight", "ln.bias"}, {"normed"}, "/ln/LN"),
                             "axis", std::int64_t{-1});
  m.node("Sub", {"x", "mask"}, {"d"}, "/lse/Sub");
  m.node("Exp", {"d"}, {"e"}, "/lse/Exp");
  m.node("ReduceSum", {"e", "axes"}, {"total"}, "/lse/ReduceSum");
  m.output("probs");
  m.output("normed");
  m.output("total");
  kg::Model fused = kg::onnx::import_bytes(m.bytes(), "prologues.onnx");
  kg::onnx::ImportOptions off;
  off.model.fusion = false;
  kg::Model plain = kg::onnx::import_bytes(m.bytes(), "prologues.onnx", off);
  const auto f = folded_ops(fused);
  EXPECT_EQ(f.size(), 3u) << fused.summary();
  // Each keeps the ONNX node's name; the layer norm its initializers' names.
  for (const char* name : {"attn.Softmax", "ln.LN", "lse.ReduceSum"}) {
    const int id = fused.graph().find(name);
    ASSERT_GE(id, 0) << name;
    EXPECT_EQ(fused.graph().node(id).op_name(), "kg.fused_reduction") << name;
  }
  std::vector<std::string> params;
  for (const auto& p : fused.parameters()) params.push_back(p.name);
  EXPECT_NE(std::find(params.begin(), params.end(), "ln.weight"), params.end());
  EXPECT_NE(std::find(params.begin(), params.end(), "ln.bias"), params.end());
  EXPECT_TRUE(folded_ops(plain).empty());
  const std::vector<std::vector<std::int64_t>> shapes{{3, 4, 24}, {1, 4, 24}};
  const std::vector<kg::Tensor> in{kg_test::random_tensor(rng, kg::DType::F32, shapes[0], -2.0, 2.0),
                                   kg_test::random_tensor(rng, kg::DType::F32, shapes[1], -2.0, 2.0)};
  auto want = plain.load(kg::Device::cpu(), shapes).forward(in);
  kg::LoadOptions checked;
  checked.checked = true;
  for (const auto& got : {fused.load(kg::Device::cpu(), shapes).forward(in),
                          fused.load(kg::Device::cpu(), shapes, checked).forward(in)}) {
    ASSERT_EQ(got.size(), 3u);
    for (std::size_t i = 0; i < 3; ++i) EXPECT_TRUE(kg_test::all_close(got[i], want[i], 1e-5, 1e-5)) << i;
  }
}

// On a GPU: the folded kernels against the unfused graph on the CPU.
TEST(FusePrologueGpu, FoldedKernelsMatchTheCpu) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 8, 128, 128}, "x");
  kg::SymTensor mask = g->input(kg::DType::F32, {1, 1, 128, 128}, "mask");
  kg::SymTensor c = g->input(kg::DType::F32, {kg::Dim::named("batch"), 8, 128, 1}, "c");
  kg::SymTensor scores = kg::add(kg::mul(x, 0.125, "scaled"), mask, "masked");
  kg::SymTensor p = kg::softmax(scores, -1, "probs");
  kg::SymTensor lp = kg::log_softmax(kg::mul(x, 2.0, "x2"), 1, "logp");
  kg::SymTensor n = kg::nn::layer_norm(kg::add(x, mask, "res"), {128}, "ln");
  kg::SymTensor s = kg::ops::reduce(kg::ops::ReduceFn::Sum, exp_of(kg::sub(x, c, "xc"), "ex"), {-1}, true, "sums");
  kg::SymTensor t = kg::ops::reduce(kg::ops::ReduceFn::Max, kg::mul(x, 3.0, "x3"), {}, false, "top");
  Built b{g, {p, lp, n, s, t}, {{4, 8, 128, 128}, {1, 1, 128, 128}, {4, 8, 128, 1}}};
  kg::Model fused(g, b.outputs);
  EXPECT_EQ(folded_ops(fused).size(), 5u);
  kg::Model plain(g, b.outputs, kg::LoweringMode::Inference, {.fusion = false});
  const auto params = random_params(plain, rng);
  kg::LoadOptions poisoned;
  poisoned.poison_buffers = true;
  auto lp_cpu = plain.load(kg::Device::cpu(), b.input_shapes);
  auto lg = fused.load(kg::Device::cuda(), b.input_shapes, poisoned);
  lp_cpu.load_state_dict(params);
  lg.load_state_dict(params);
  const auto in = random_inputs(rng, b, kg::DType::F32);
  auto want = lp_cpu.forward(in);
  auto got = lg.forward(in);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("output " + std::to_string(i));
    EXPECT_TRUE(kg_test::all_written(got[i]));
    EXPECT_TRUE(kg_test::all_close(got[i], want[i], 1e-4, 1e-4));
  }
}
