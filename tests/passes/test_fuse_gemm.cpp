// The epilogue pass and kg.fused_gemm: the elementwise group that alone reads a linear's or a
// matmul's value is folded into the GEMM's store. The folded node is checked against a naive
// reference and the unfused graph on the CPU (the GEMM's CPU form, then the group's) and under the
// CUDA emulator (the tiled GEMM kernel storing through the generated epilogue, checked mode); what
// is not folded; bad descriptions; a bf16 load; inspect and DOT; the GPU with and without cuBLASLt.
#include <algorithm>
#include <cmath>

#include "backend/emu/executor.hpp"
#include "kg/models.hpp"
#include "kg/testing.hpp"
#include "ops/fused_gemm.hpp"
#include "ops/pointwise.hpp"
#include "support/fusion_util.hpp"
#include "support/test_util.hpp"

using kg_test::count_ops;
using kg_test::fresh_seed;
using kg_test::member_names;

namespace {

std::vector<const kg::ops::FusedGemmOp*> folded_ops(const kg::Model& m) {
  return kg_test::ops_of<kg::ops::FusedGemmOp>(m);
}

std::map<std::string, kg::Tensor> random_params(const kg::Model& m, std::mt19937_64& rng) {
  std::map<std::string, kg::Tensor> p;
  for (const auto& info : m.parameters()) p[info.name] = kg_test::random_tensor(rng, info.dtype, info.shape, -1.0, 1.0);
  return p;
}

double at(const kg::Tensor& t, std::int64_t i) {
  return t.dtype() == kg::DType::F64 ? t.data<double>()[i] : static_cast<double>(t.data<float>()[i]);
}

// y[r, j] = b[j] + sum_k x[r, k] w[j, k], in double.
std::vector<double> naive_linear(const kg::Tensor& x, const kg::Tensor& w, const kg::Tensor* b) {
  const std::int64_t out = w.shape()[0], in = w.shape()[1], rows = x.numel() / in;
  std::vector<double> y(static_cast<std::size_t>(rows * out));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < out; ++j) {
      double s = b ? at(*b, j) : 0.0;
      for (std::int64_t k = 0; k < in; ++k) s += at(x, r * in + k) * at(w, j * in + k);
      y[static_cast<std::size_t>(r * out + j)] = s;
    }
  return y;
}

// Expects `got` to hold want[i] at every element, within atol + rtol |want|.
void expect_values(const kg::Tensor& got, const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.numel(), static_cast<std::int64_t>(want.size()));
  EXPECT_TRUE(kg_test::all_written(got));
  int bad = 0;
  for (std::int64_t i = 0; i < got.numel() && bad < 5; ++i) {
    const double w = want[static_cast<std::size_t>(i)];
    if (!(std::abs(at(got, i) - w) <= tol + tol * std::abs(w))) {
      ADD_FAILURE() << "element " << i << ": got " << at(got, i) << ", want " << w;
      ++bad;
    }
  }
}

struct Loaded {
  std::vector<kg::Tensor> cpu, emulated, plain;
};

// The folded model on the CPU and checked under the emulator, and the unfused one, on the same
// inputs and parameters.
Loaded run_three(const std::shared_ptr<kg::Graph>& g, const std::vector<kg::SymTensor>& outs,
                 const std::vector<std::vector<std::int64_t>>& shapes, const std::vector<kg::Tensor>& in,
                 const std::map<std::string, kg::Tensor>& params) {
  kg::Model fused(g, outs);
  kg::Model plain(g, outs, kg::LoweringMode::Inference, {.fusion = false});
  kg::LoadOptions poisoned;
  poisoned.poison_buffers = true;
  kg::LoadOptions checked;
  checked.checked = true;
  auto lc = fused.load(kg::Device::cpu(), shapes, poisoned);
  auto le = fused.load(kg::Device::cpu(), shapes, checked);
  auto lp = plain.load(kg::Device::cpu(), shapes, poisoned);
  for (auto* l : {&lc, &le, &lp}) l->load_state_dict(params);
  return {lc.forward(in), le.forward(in), lp.forward(in)};
}

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

}  // namespace

// A linear layer and what follows it: a built-in ReLU, a user's custom activation (swish), a group
// of a broadcast scale, a residual add and tanh, and a bias-free layer's GELU. Each becomes one
// kg.fused_gemm node with the linear's name and parameters, whose values match a naive reference.
TEST(FuseGemm, LinearEpiloguesAreOneNodeWithTheNaiveValues) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64})
    for (int c = 0; c < 4; ++c) {
      SCOPED_TRACE(::testing::Message() << kg::dtype_name(dt) << " case " << c);
      auto [x, g] = kg::SymTensor::input(dt, {kg::Dim::named("batch"), 33}, "x");
      kg::SymTensor scale = g->input(dt, {40}, "scale");
      kg::SymTensor res = g->input(dt, {kg::Dim::named("batch"), 40}, "res");
      kg::SymTensor h = kg::nn::linear(x, 40, "fc1", c != 3);
      kg::SymTensor y;
      std::vector<std::string> members;
      switch (c) {
        case 0: y = kg::relu(h, "act"), members = {"act"}; break;
        case 1: y = kg::models::swish(h, "act"), members = {"act"}; break;
        case 2:
          y = kg::tanh(kg::add(kg::mul(h, scale, "scaled"), res, "residual"), "act");
          members = {"scaled", "residual", "act"};
          break;
        default: y = kg::gelu(h, kg::GeluApprox::Erf, "act"), members = {"act"}; break;
      }
      kg::Model m(g, {y});
      EXPECT_EQ(count_ops(m), 1) << m.summary();
      const auto f = folded_ops(m);
      ASSERT_EQ(f.size(), 1u) << m.summary();
      EXPECT_EQ(member_names(*f[0]), members);
      const kg::Node& node = m.graph().node(m.outputs()[0].second);
      EXPECT_EQ(node.name, "fc1");
      const std::string attrs = node.op->op().attributes();
      EXPECT_NE(attrs.find("nn.linear in=33 out=40"), std::string::npos) << attrs;
      EXPECT_NE(attrs.find("epilogue=" + members[0]), std::string::npos) << attrs;
      EXPECT_NE(attrs.find("kernel=kg_epilogue_"), std::string::npos) << attrs;
      std::vector<std::string> names;
      for (const auto& p : m.parameters()) names.push_back(p.name);
      const std::vector<std::string> want_names =
          c == 3 ? std::vector<std::string>{"fc1.weight"} : std::vector<std::string>{"fc1.weight", "fc1.bias"};
      EXPECT_EQ(names, want_names);

      const std::vector<std::vector<std::int64_t>> shapes{{5, 33}, {40}, {5, 40}};
      std::vector<kg::Tensor> in;
      for (const auto& s : shapes) in.push_back(kg_test::random_tensor(rng, dt, s, -2.0, 2.0));
      const auto params = random_params(m, rng);
      const kg::Tensor* bias = c == 3 ? nullptr : &params.at("fc1.bias");
      std::vector<double> want = naive_linear(in[0], params.at("fc1.weight"), bias);
      for (std::size_t i = 0; i < want.size(); ++i) {
        double& v = want[i];
        switch (c) {
          case 0: v = std::max(v, 0.0); break;
          case 1: v = v * sigmoid(v); break;
          case 2: v = std::tanh(v * at(in[1], static_cast<std::int64_t>(i % 40)) + at(in[2], static_cast<std::int64_t>(i))); break;
          default: v = 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0))); break;
        }
      }
      const double tol = dt == kg::DType::F32 ? 2e-5 : 1e-12;
      const Loaded r = run_three(g, {y}, shapes, in, params);
      expect_values(r.cpu[0], want, tol);
      expect_values(r.emulated[0], want, tol);
      expect_values(r.plain[0], want, tol);
    }
}

// nn.matmul's epilogue: a batch broadcast B ([7, 6] against [b, 3, 5, 7], one merged GEMM) with a
// broadcast bias input and a sigmoid; and a batched product over two levels whose group reads a
// tensor broadcast along one of them (the epilogue's walk), each index of the whole output.
TEST(FuseGemm, MatmulEpiloguesReadTheirOtherInputsAtTheOutputsIndex) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int c = 0; c < 2; ++c) {
    SCOPED_TRACE(::testing::Message() << "case " << c);
    const kg::DType dt = kg::DType::F32;
    auto [a, g] = kg::SymTensor::input(dt, {kg::Dim::named("batch"), 3, 5, 7}, "a");
    kg::SymTensor b = c == 0 ? g->input(dt, {7, 6}, "b") : g->input(dt, {kg::Dim::named("batch"), 3, 7, 6}, "b");
    kg::SymTensor e = c == 0 ? g->input(dt, {6}, "e") : g->input(dt, {kg::Dim::named("batch"), 1, 5, 6}, "e");
    kg::SymTensor p = kg::matmul(a, b, "mm");
    kg::SymTensor y = c == 0 ? kg::sigmoid(kg::add(p, e, "biased"), "act") : kg::mul(p, e, "gated");
    kg::Model m(g, {y});
    const auto f = folded_ops(m);
    ASSERT_EQ(f.size(), 1u) << m.summary();
    EXPECT_EQ(count_ops(m), 1);
    EXPECT_EQ(m.graph().node(m.outputs()[0].second).name, "mm");
    const std::int64_t B = 2;
    const std::vector<std::vector<std::int64_t>> shapes =
        c == 0 ? std::vector<std::vector<std::int64_t>>{{B, 3, 5, 7}, {7, 6}, {6}}
               : std::vector<std::vector<std::int64_t>>{{B, 3, 5, 7}, {B, 3, 7, 6}, {B, 1, 5, 6}};
    std::vector<kg::Tensor> in;
    for (const auto& s : shapes) in.push_back(kg_test::random_tensor(rng, dt, s, -2.0, 2.0));
    std::vector<double> want(static_cast<std::size_t>(B * 3 * 5 * 6));
    for (std::int64_t z = 0; z < B * 3; ++z)
      for (std::int64_t i = 0; i < 5; ++i)
        for (std::int64_t j = 0; j < 6; ++j) {
          double s = 0;
          for (std::int64_t k = 0; k < 7; ++k)
            s += at(in[0], (z * 5 + i) * 7 + k) * at(in[1], (c == 0 ? 0 : z * 42) + k * 6 + j);
          const std::int64_t o = (z * 5 + i) * 6 + j;
          want[static_cast<std::size_t>(o)] =
              c == 0 ? sigmoid(s + at(in[2], j)) : s * at(in[2], ((z / 3) * 5 + i) * 6 + j);
        }
    const Loaded r = run_three(g, {y}, shapes, in, {});
    expect_values(r.cpu[0], want, 2e-5);
    expect_values(r.emulated[0], want, 2e-5);
    expect_values(r.plain[0], want, 2e-5);
  }
}

// Left alone: a GEMM whose value has another reader or is a model output, a group whose value is
// broadcast beyond the GEMM's shape, a training graph, and fusion turned off. A group before the
// GEMM stays a group of its own (the GEMM's input is not its epilogue).
TEST(FuseGemm, WhatIsNotFoldedKeepsItsOwnNodes) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 8}, "x");
  kg::SymTensor wide = g->input(kg::DType::F32, {3, kg::Dim::named("batch"), 6}, "wide");
  kg::SymTensor h1 = kg::nn::linear(x, 6, "two_readers");
  kg::SymTensor a1 = kg::relu(h1, "r1");
  kg::SymTensor s1 = kg::add(h1, 1.0, "r2");
  kg::SymTensor h2 = kg::nn::linear(x, 6, "is_output");
  kg::SymTensor a2 = kg::relu(h2, "r3");
  kg::SymTensor h3 = kg::nn::linear(x, 6, "broadcast");
  kg::SymTensor a3 = kg::add(h3, wide, "wider");
  kg::Model m(g, {a1, s1, h2, a2, a3});
  EXPECT_TRUE(folded_ops(m).empty()) << m.summary();

  auto [x2, g2] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 8}, "x");
  kg::SymTensor pre = kg::nn::linear(kg::tanh(kg::mul(x2, 2.0, "scaled"), "t"), 6, "fc");
  kg::SymTensor target = g2->input(kg::DType::F32, {kg::Dim::named("batch"), 6}, "target");
  kg::SymTensor loss = kg::mse_loss(kg::relu(pre, "act"), target, "loss");
  kg::Model train(g2, {loss}, kg::LoweringMode::Training);
  EXPECT_TRUE(folded_ops(train).empty()) << train.summary();
  kg::Model off(g2, {pre}, kg::LoweringMode::Inference, {.fusion = false});
  EXPECT_TRUE(folded_ops(off).empty());
  ::setenv("KG_NO_FUSION", "1", 1);
  kg::Model env(g2, {kg::relu(pre, "act2")});
  ::unsetenv("KG_NO_FUSION");
  EXPECT_TRUE(folded_ops(env).empty());
  kg::Model on(g2, {kg::relu(pre, "act3")});
  const auto f = folded_ops(on);
  ASSERT_EQ(f.size(), 1u) << on.summary();
  EXPECT_EQ(member_names(*f[0]), std::vector<std::string>{"act3"});
  EXPECT_EQ(count_ops(on), 2) << on.summary();  // the group before the GEMM, the fused GEMM
}

// Bad descriptions are errors that name the op and what is wrong.
TEST(FuseGemm, BadDescriptionsAreErrors) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {4, 8}, "x");
  kg::SymTensor h = kg::nn::linear(x, 6, "fc");
  kg::SymTensor r = kg::relu(h, "act");
  const kg::CustomData linear = *g->node(h.node()).op;
  const kg::CustomData relu = *g->node(r.node()).op;
  auto member = [&](std::vector<int> args) {
    auto form = relu->elementwise_form({kg::DType::F32});
    return kg::ops::FusedMember{"act", relu, *form, std::move(args)};
  };
  kg_test::expect_error([&] { kg::ops::FusedGemmOp(relu, 1, {member({-1})}, 1, 0, kg::DType::F32); },
                        {"kg.fused_gemm (nn.relu)", "is not a GEMM that takes an epilogue"});
  kg_test::expect_error([&] { kg::ops::FusedGemmOp(linear, 1, {member({-1})}, 1, 1, kg::DType::F32); },
                        {"kg.fused_gemm (nn.linear)", "group input 1", "the group has 1"});
  kg_test::expect_error([&] { kg::ops::FusedGemmOp(linear, 0, {member({-1})}, 1, 0, kg::DType::F32); },
                        {"kg.fused_gemm (nn.linear)", "at least one input"});
  kg_test::expect_error([&] { kg::ops::FusedGemmOp(linear, 1, {member({-2})}, 1, 0, kg::DType::F32); },
                        {"kg.fused_gemm (nn.linear)", "epilogue", "reads value -2"});
  kg_test::expect_error([&] { kg::ops::FusedGemmOp(linear, 1, {}, 1, 0, kg::DType::F32); },
                        {"epilogue", "at least one member"});
  kg::ops::FusedGemmOp ok(linear, 1, {member({-1})}, 1, 0, kg::DType::F32);
  EXPECT_EQ(ok.infer_output_shape({kg::Shape{4, 8}}), (kg::Shape{4, 6}));
  kg_test::expect_error([&] { ok.infer_output_shape({kg::Shape{4, 8}, kg::Shape{4, 6}}); },
                        {"expects 1 inputs (1 of nn.linear, then 0 of the epilogue), got 2"});
  kg_test::expect_error([&] { ok.infer_output_shape({kg::Shape{4, 9}}); }, {"GEMM nn.linear", "in_features = 8"});
  kg_test::expect_error([&] { ok.infer_output_shape({}); }, {"at least the 1 input(s) of nn.linear, got 0"});
  // An epilogue whose value would be wider than the GEMM's output.
  kg::SymTensor w = g->input(kg::DType::F32, {3, 4, 6}, "w");
  kg::SymTensor s = kg::add(h, w, "wide");
  const kg::CustomData add = *g->node(s.node()).op;
  kg::ops::FusedGemmOp wide(linear, 1, {kg::ops::FusedMember{"wide", add, *add->elementwise_form({kg::DType::F32, kg::DType::F32}), {-1, -2}}},
                            2, 0, kg::DType::F32);
  kg_test::expect_error([&] { wide.infer_output_shape({kg::Shape{4, 8}, kg::Shape{3, 4, 6}}); },
                        {"the epilogue's value is [3, 4, 6] but the GEMM's output is [4, 6]"});
  kg::LowerContext ctx;
  ctx.node = "fc";
  ctx.input_shapes = {kg::Shape{4, 8}, kg::Shape{4, 6}};
  kg_test::expect_error([&] { ok.lower(ctx); }, {"[kg.fused_gemm @ fc]", "expects 1 input(s), got 2"});
}

// A bf16 load: the fused node computes in bf16 like the linear it holds (its group in f32 on each
// bf16 element) and matches the f32 model within bf16's rounding, on the CPU and the emulator.
TEST(FuseGemm, Bf16LoadRunsTheFusedNodeInBf16) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 64}, "x");
  kg::SymTensor y = kg::models::swish(kg::nn::linear(x, 32, "fc"), "act");
  kg::Model m(g, {y});
  ASSERT_EQ(folded_ops(m).size(), 1u);
  const auto params = random_params(m, rng);
  const std::vector<std::vector<std::int64_t>> shapes{{6, 64}};
  const std::vector<kg::Tensor> in{kg_test::random_tensor(rng, kg::DType::F32, shapes[0], -1.0, 1.0)};
  auto l32 = m.load(kg::Device::cpu(), shapes);
  l32.load_state_dict(params);
  const auto want = l32.forward(in);
  for (bool checked : {false, true}) {
    SCOPED_TRACE(checked ? "emulated" : "cpu");
    kg::LoadOptions o;
    o.precision = kg::DType::BF16;
    o.checked = checked;
    auto l16 = m.load(kg::Device::cpu(), shapes, o);
    l16.load_state_dict(params);
    const auto got = l16.forward(in);
    EXPECT_TRUE(kg_test::all_written(got[0]));
    EXPECT_TRUE(kg_test::all_close(got[0], want[0], 3e-2, 3e-2));
    bool bf16_node = false;
    for (const kg::Node& n : l16.graph().nodes())
      if (n.kind == kg::Node::Kind::Op && n.op_name() == "kg.fused_gemm") bf16_node = n.dtype == kg::DType::BF16;
    EXPECT_TRUE(bf16_node);
  }
}

// kgraph inspect's table names the epilogue's members and kernel; the DOT picture draws a cluster.
TEST(FuseGemm, SummaryAndDotShowTheEpilogue) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 16}, "x");
  kg::SymTensor y = kg::relu(kg::mul(kg::nn::linear(x, 8, "fc"), 0.5, "half"), "act");
  kg::Model m(g, {y});
  const std::string summary = m.summary();
  EXPECT_NE(summary.find("kg.fused_gemm"), std::string::npos) << summary;
  EXPECT_NE(summary.find("epilogue=half,act"), std::string::npos) << summary;
  const std::string dot = m.to_dot();
  EXPECT_NE(dot.find("subgraph cluster_n"), std::string::npos) << dot;
  EXPECT_NE(dot.find("fused: fc"), std::string::npos) << dot;
  EXPECT_NE(dot.find("label=\"half\""), std::string::npos) << dot;
  EXPECT_NE(dot.find("label=\"act\""), std::string::npos) << dot;
  // LeNet-5 with its scaled tanh: clusters for the two folded linear layers; a fused convolution's
  // "epilogue=[op]" attribute names an op kind, not nodes, and draws none.
  const std::string lenet = kg::models::build("lenet5-tanh").to_dot();
  EXPECT_NE(lenet.find("fused: classifier.0"), std::string::npos) << lenet;
  EXPECT_NE(lenet.find("fused: classifier.2"), std::string::npos) << lenet;
  EXPECT_EQ(lenet.find("fused: features.0"), std::string::npos) << lenet;
}

// The vendor-library tactic without a GPU: the emulator runs each fused GEMM's library call by its
// definition, then its epilogue launches (the module's apply kernel over the output in place, or
// nothing for a lone ReLU, which the call itself applies), checked; the values are the unfused
// graph's. A linear with a residual group, a bias-free linear with a ReLU, and a batched matmul
// whose group walks a broadcast input.
TEST(FuseGemm, TheLibraryTacticWithItsApplyKernelMatchesUnderTheEmulator) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 24}, "x");
  kg::SymTensor res = g->input(kg::DType::F32, {kg::Dim::named("batch"), 16}, "res");
  kg::SymTensor a = g->input(kg::DType::F32, {kg::Dim::named("batch"), 3, 5, 7}, "a");
  kg::SymTensor b = g->input(kg::DType::F32, {kg::Dim::named("batch"), 3, 7, 6}, "b");
  kg::SymTensor e = g->input(kg::DType::F32, {kg::Dim::named("batch"), 1, 5, 6}, "e");
  kg::SymTensor h = kg::models::swish(kg::add(kg::nn::linear(x, 16, "fc1"), res, "residual"), "act1");
  kg::SymTensor r = kg::relu(kg::nn::linear(h, 8, "fc2", false), "act2");
  kg::SymTensor m = kg::tanh(kg::mul(kg::matmul(a, b, "mm"), e, "gated"), "act3");
  kg::Model fused(g, {r, m});
  ASSERT_EQ(folded_ops(fused).size(), 3u) << fused.summary();
  kg::Model plain(g, {r, m}, kg::LoweringMode::Inference, {.fusion = false});
  const auto params = random_params(plain, rng);
  const std::vector<std::vector<std::int64_t>> shapes{{4, 24}, {4, 16}, {4, 3, 5, 7}, {4, 3, 7, 6}, {4, 1, 5, 6}};
  std::vector<kg::Tensor> in;
  for (const auto& s : shapes) in.push_back(kg_test::random_tensor(rng, kg::DType::F32, s, -1.0, 1.0));
  auto lp = plain.load(kg::Device::cpu(), shapes);
  lp.load_state_dict(params);
  const auto want = lp.forward(in);
  int library_steps = 0;
  const auto got = kg::emu::run_model(fused, in, params, /*checked=*/true, /*library_calls=*/true, &library_steps);
  EXPECT_EQ(library_steps, 3);
  ASSERT_EQ(got.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(kg_test::all_written(got[i])) << i;
    EXPECT_TRUE(kg_test::all_close(got[i], want[i], 1e-5, 1e-5)) << i;
  }
}

// On a GPU: the tiled GEMM with its fused epilogue (vendor libraries off), cuBLASLt with the
// epilogue as a second kernel or its own ReLU (libraries on), and the tuned choice between them,
// against the unfused graph on the CPU; f32 with TF32 off.
TEST(FuseGemmGpu, FusedKernelsAndLibraryTacticsMatchTheCpu) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 300}, "x");
  kg::SymTensor scale = g->input(kg::DType::F32, {200}, "scale");
  kg::SymTensor h1 = kg::relu(kg::nn::linear(x, 200, "fc1"), "act1");
  kg::SymTensor h2 = kg::models::swish(kg::mul(kg::nn::linear(h1, 200, "fc2"), scale, "scaled"), "act2");
  kg::SymTensor a = g->input(kg::DType::F32, {kg::Dim::named("groups"), 4, 33, 20}, "a");
  kg::SymTensor bm = g->input(kg::DType::F32, {20, 50}, "bm");
  kg::SymTensor h3 = kg::tanh(kg::matmul(a, bm, "mm"), "act3");
  kg::Model fused(g, {h2, h3});
  ASSERT_EQ(folded_ops(fused).size(), 3u) << fused.summary();
  kg::Model plain(g, {h2, h3}, kg::LoweringMode::Inference, {.fusion = false});
  const auto params = random_params(plain, rng);
  const std::vector<std::vector<std::int64_t>> shapes{{70, 300}, {200}, {3, 4, 33, 20}, {20, 50}};
  std::vector<kg::Tensor> in;
  for (const auto& s : shapes) in.push_back(kg_test::random_tensor(rng, kg::DType::F32, s, -1.0, 1.0));
  auto lp = plain.load(kg::Device::cpu(), shapes);
  lp.load_state_dict(params);
  const auto want = lp.forward(in);
  for (int mode = 0; mode < 3; ++mode) {
    SCOPED_TRACE(mode == 0 ? "own kernels" : mode == 1 ? "libraries" : "tuned");
    kg::LoadOptions o;
    o.poison_buffers = true;
    o.vendor_libraries = mode != 0;
    o.tune = mode == 2;
    auto lg = fused.load(kg::Device::cuda(), shapes, o);
    lg.load_state_dict(params);
    const auto got = lg.forward(in);
    ASSERT_EQ(got.size(), 2u);
    for (std::size_t i = 0; i < 2; ++i) {
      EXPECT_TRUE(kg_test::all_written(got[i])) << i;
      EXPECT_TRUE(kg_test::all_close(got[i], want[i], 1e-4, 1e-4)) << i;
    }
  }
}
