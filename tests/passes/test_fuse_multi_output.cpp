// Elementwise groups with several outputs: a group writes every value of its own that is needed
// outside it (read by a node outside, or a model output) in one pass, into a packed value that
// kg.group_output views read. Fused and unfused graphs agree on the CPU forms and under the CUDA
// emulator (checked: every element of every output written), forward and backward; the pass keeps
// the limits and the recorded names; a bad description is an error.
#include <algorithm>
#include <cmath>

#include "kg/models.hpp"
#include "kg/testing.hpp"
#include "ops/fused_elementwise.hpp"
#include "support/fusion_util.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

struct Built {
  std::shared_ptr<kg::Graph> graph;
  std::vector<std::pair<std::string, kg::SymTensor>> outputs;
  std::vector<std::vector<std::int64_t>> input_shapes;
};

std::vector<const kg::ops::FusedElementwiseOp*> fused_ops(const kg::Model& m) {
  return kg_test::ops_of<kg::ops::FusedElementwiseOp>(m);
}

// Nodes that run (views run nothing).
int kernels(const kg::Model& m) { return kg_test::count_ops(m, false); }

// The group's members, or (`outputs`) only those it writes.
std::vector<std::string> names(const kg::ops::FusedElementwiseOp& f, bool outputs) {
  if (!outputs) return kg_test::member_names(f);
  std::vector<std::string> v;
  for (int o : f.outputs()) v.push_back(f.members()[static_cast<std::size_t>(o)].node);
  return v;
}

std::size_t most_outputs(const kg::Model& m) {
  std::size_t k = 0;
  for (const auto* f : fused_ops(m)) k = std::max(k, f->outputs().size());
  return k;
}

std::vector<kg::Tensor> random_inputs(std::mt19937_64& rng, const Built& b, kg::DType dt) {
  return kg_test::random_inputs(rng, b.input_shapes, dt);
}

// The fused model on the CPU forms (poisoned buffers) and checked under the emulator (the
// generated kernels; every output element must be written) against the unfused one.
kg::Model compare_inference(const Built& b, const std::vector<kg::Tensor>& inputs, double tol) {
  kg::Model fused(b.graph, b.outputs);
  kg::Model plain(b.graph, b.outputs, kg::LoweringMode::Inference, {.fusion = false});
  kg_test::expect_fused_matches_plain(fused, plain, b.input_shapes, inputs, tol);
  return fused;
}

// A random DAG of fusable ops over a full input x, a second full input y, a channel vector and a
// scalar, whose values leave in several ways: some are model outputs, one is read by a softmax, and
// a tail p = sigmoid(v + x), q = p * x has both p and q as outputs.
Built random_graph(std::mt19937_64& rng, kg::DType dt) {
  auto [x, g] = kg::SymTensor::input(dt, {kg::Dim::named("batch"), 3, 5, 6}, "x");
  std::vector<kg::SymTensor> values{x, g->input(dt, {kg::Dim::named("batch"), 3, 5, 6}, "y"),
                                    g->input(dt, {3, 1, 1}, "c"), g->input(dt, {1}, "s")};
  const std::size_t first = values.size();
  std::uniform_int_distribution<int> pick_op(0, 7);
  auto pick = [&] { return values[std::uniform_int_distribution<std::size_t>(0, values.size() - 1)(rng)]; };
  for (int k = 0; k < 10; ++k) {
    const std::string name = "n" + std::to_string(k);
    kg::SymTensor a = pick(), b = pick(), v;
    switch (pick_op(rng)) {
      case 0: v = kg::add(a, b, name); break;
      case 1: v = kg::sub(a, b, name); break;
      case 2: v = kg::mul(a, b, name); break;
      case 3: v = kg::div(a, kg::add(kg::mul(b, b), 1.0), name); break;
      case 4: v = kg::sigmoid(a, name); break;
      case 5: v = kg::tanh(a, name); break;
      case 6: v = kg::silu(a, name); break;
      default: v = kg::models::scaled_tanh(a, name); break;
    }
    values.push_back(v);
  }
  auto pick_made = [&] {
    return values[std::uniform_int_distribution<std::size_t>(first, values.size() - 1)(rng)];
  };
  Built b{g, {}, {{2, 3, 5, 6}, {2, 3, 5, 6}, {3, 1, 1}, {1}}};
  auto p = kg::sigmoid(kg::add(pick_made(), x, "pre"), "p");
  auto q = kg::mul(p, x, "q");
  auto soft = kg::softmax(kg::add(pick_made(), x, "to_soft"), -1, "soft");
  b.outputs = {{"p", p}, {"q", q}, {"soft", soft}, {"last", values.back()}};
  for (int k = 0; k < 2; ++k) {
    const kg::SymTensor v = pick_made();
    if (std::none_of(b.outputs.begin(), b.outputs.end(), [&](const auto& o) { return o.second.node() == v.node(); }))
      b.outputs.push_back({"extra" + std::to_string(k), v});
  }
  return b;
}

}  // namespace

// s = sigmoid(x); a = s * x; b = s + 1 with a and b both needed outside: one kernel writes both,
// reading x once, and each output keeps its name.
TEST(FuseMultiOutput, TwoValuesLeavingTheGroupAreWrittenByOneKernel) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
    SCOPED_TRACE(std::string(kg::dtype_name(dt)));
    auto [x, g] = kg::SymTensor::input(dt, {kg::Dim::named("batch"), 37}, "x");
    auto s = kg::sigmoid(x, "s");
    auto a = kg::mul(s, x, "a");
    auto b = kg::add(s, 1.0, "b");
    for (std::int64_t batch : {1, 4, 64}) {
      Built built{g, {{"a", a}, {"b", b}}, {{batch, 37}}};
      kg::Model m = compare_inference(built, random_inputs(rng, built, dt), dt == kg::DType::F32 ? 1e-6 : 1e-12);
      auto f = fused_ops(m);
      ASSERT_EQ(f.size(), 1u);
      EXPECT_EQ(names(*f[0], false), (std::vector<std::string>{"s", "a", "b"}));
      EXPECT_EQ(names(*f[0], true), (std::vector<std::string>{"a", "b"}));
      EXPECT_EQ(f[0]->inputs(), 1);
      EXPECT_EQ(kernels(m), 1);
      // The outputs are views of the packed value under the recorded names.
      ASSERT_EQ(m.outputs().size(), 2u);
      for (std::size_t i = 0; i < 2; ++i) {
        const kg::Node& node = m.graph().node(m.outputs()[i].second);
        EXPECT_EQ(node.name, i == 0 ? "a" : "b");
        EXPECT_EQ(node.op_name(), "kg.group_output");
        EXPECT_EQ(node.shape, a.shape());
        EXPECT_EQ(m.graph().find(i == 0 ? "a" : "b"), m.outputs()[i].second);
      }
      const kg::Node& packed = m.graph().node(m.graph().node(m.outputs()[0].second).inputs.at(0));
      EXPECT_EQ(packed.op_name(), "kg.fused_elementwise");
      EXPECT_EQ(packed.name, "b.group");
      EXPECT_EQ(packed.shape, (kg::Shape{2, kg::Dim::named("batch"), 37}));
      // What kgraph inspect prints, and the DOT drawing with the group's cluster.
      const std::string summary = m.summary();
      EXPECT_NE(summary.find("nodes=s,a,b outputs=a,b kernel=kg_fused_"), std::string::npos) << summary;
      EXPECT_NE(summary.find("kg.group_output"), std::string::npos) << summary;
      EXPECT_NE(summary.find("output=1/2"), std::string::npos) << summary;
      const std::string dot = m.to_dot();
      EXPECT_NE(dot.find("cluster"), std::string::npos);
      EXPECT_NE(dot.find("kg.group_output"), std::string::npos);
    }
  }
}

// s also read by a node that cannot join (a softmax) is a third output; a value read by such a node
// that feeds the group again (late = b - softmax(b)) stays out, or the group would be its own
// ancestor.
TEST(FuseMultiOutput, AValueReadByAnUnfusableNodeIsAnOutputUnlessItWouldMakeACycle) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 16}, "x");
  auto s = kg::sigmoid(x, "s");
  auto a = kg::mul(s, x, "a");
  auto b = kg::add(s, 1.0, "b");
  auto soft = kg::softmax(s, -1, "soft");
  auto late = kg::sub(b, kg::softmax(b, -1, "soft_b"), "late");
  Built built{g, {{"a", a}, {"soft", soft}, {"late", late}}, {{5, 16}}};
  kg::Model m = compare_inference(built, random_inputs(rng, built, kg::DType::F32), 1e-6);
  auto f = fused_ops(m);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(names(*f[0], false), (std::vector<std::string>{"s", "a", "b"}));
  EXPECT_EQ(names(*f[0], true), (std::vector<std::string>{"s", "a", "b"}));
  int subs = 0;
  for (int id : m.live_nodes()) subs += m.graph().node(id).op_name() == "nn.sub";
  EXPECT_EQ(subs, 1) << "late reads the softmax of b, which reads the group: it cannot join";
}

// A model output that its group also reads inside (a = sigmoid(x) is an output and feeds b).
TEST(FuseMultiOutput, AModelOutputAlsoReadInsideTheGroup) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, 5, 6}, "x");
  auto c = g->input(kg::DType::F32, {3, 1, 1}, "c");
  auto a = kg::sigmoid(kg::mul(x, c, "xc"), "a");
  auto b = kg::tanh(kg::add(a, x, "ax"), "b");
  Built built{g, {{"b", b}, {"a", a}}, {{2, 3, 5, 6}, {3, 1, 1}}};
  kg::Model m = compare_inference(built, random_inputs(rng, built, kg::DType::F32), 1e-6);
  auto f = fused_ops(m);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(names(*f[0], false), (std::vector<std::string>{"xc", "a", "ax", "b"}));
  EXPECT_EQ(names(*f[0], true), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(m.graph().node(m.outputs()[0].second).name, "b");
  EXPECT_EQ(m.graph().node(m.outputs()[1].second).name, "a");
}

// Random DAGs whose values leave in several ways, f32 and f64, on the CPU forms and the emulated
// kernels; in every one the p, q tail makes a group with several outputs.
TEST(FuseMultiOutput, RandomGraphsWithSeveralOutputsAgreeFusedAndUnfused) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 10; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const kg::DType dt = trial % 3 == 2 ? kg::DType::F64 : kg::DType::F32;
    Built b = random_graph(rng, dt);
    kg::Model m = compare_inference(b, random_inputs(rng, b, dt), dt == kg::DType::F32 ? 2e-5 : 1e-11);
    kg::Model plain(b.graph, b.outputs, kg::LoweringMode::Inference, {.fusion = false});
    EXPECT_LT(kernels(m), kernels(plain));
    EXPECT_GE(most_outputs(m), 2u);
    EXPECT_LE(most_outputs(m), static_cast<std::size_t>(KG_FUSE_MAX_OUTPUTS));
  }
}

// 16-bit groups with several outputs (LoadOptions::precision): the generated kernels under the
// emulator and the CPU forms agree with each other and with the f32 run.
TEST(FuseMultiOutput, SixteenBitGroupsWithSeveralOutputs) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType precision : {kg::DType::BF16, kg::DType::F16}) {
    SCOPED_TRACE(std::string(kg::dtype_name(precision)));
    Built b = random_graph(rng, kg::DType::F32);
    kg::Model fused(b.graph, b.outputs);
    kg::LoadOptions low;
    low.precision = precision;
    kg::LoadOptions low_checked = low;
    low_checked.checked = true;
    const auto in = random_inputs(rng, b, kg::DType::F32);
    auto want = fused.load(kg::Device::cpu(), b.input_shapes).forward(in);
    kg::LoadedModel cpu = fused.load(kg::Device::cpu(), b.input_shapes, low);
    bool several = false;
    for (const kg::Node& n : cpu.graph().nodes()) {
      if (const auto* f = n.op ? n.op->as<kg::ops::FusedElementwiseOp>() : nullptr)
        several = several || (f->outputs().size() > 1 && f->dtype() == precision);
    }
    EXPECT_TRUE(several) << "a 16-bit group with several outputs";
    auto got_cpu = cpu.forward(in);
    auto got_emu = fused.load(kg::Device::cpu(), b.input_shapes, low_checked).forward(in);
    const double tol = precision == kg::DType::BF16 ? 6e-2 : 1e-2;
    for (std::size_t i = 0; i < want.size(); ++i) {
      SCOPED_TRACE("output " + b.outputs[i].first);
      EXPECT_TRUE(kg_test::all_close(got_cpu[i], want[i], tol, tol));
      EXPECT_TRUE(kg_test::all_close(got_emu[i], got_cpu[i], tol / 4, tol / 4));
    }
  }
}

// Six values of one shape needed outside: no group writes more than KG_FUSE_MAX_OUTPUTS, values of
// another shape (a broadcast intermediate) are no outputs, and the results are the unfused ones.
TEST(FuseMultiOutput, TheOutputLimitAndOutputsOfAnotherShape) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 8}, "x");
  auto row = g->input(kg::DType::F32, {8}, "row");
  Built b{g, {}, {{3, 8}, {8}}};
  kg::SymTensor acc = kg::sigmoid(x, "v0");
  b.outputs.push_back({"v0", acc});
  for (int k = 1; k < 6; ++k) {
    acc = kg::tanh(kg::add(acc, static_cast<double>(k), "p" + std::to_string(k)), "v" + std::to_string(k));
    b.outputs.push_back({"v" + std::to_string(k), acc});
  }
  auto r = kg::sigmoid(row, "r");  // [8]: needed outside, but not of the group's shape
  b.outputs.push_back({"r", r});
  b.outputs.push_back({"out", kg::mul(acc, r, "out")});
  kg::Model m = compare_inference(b, random_inputs(rng, b, kg::DType::F32), 1e-6);
  const auto f = fused_ops(m);
  ASSERT_GE(f.size(), 2u);
  std::size_t written = 0;
  for (const auto* op : f) {
    EXPECT_LE(op->outputs().size(), static_cast<std::size_t>(KG_FUSE_MAX_OUTPUTS));
    const auto outs = names(*op, true);
    EXPECT_EQ(std::find(outs.begin(), outs.end(), "r"), outs.end());
    written += outs.size();
  }
  EXPECT_EQ(most_outputs(m), static_cast<std::size_t>(KG_FUSE_MAX_OUTPUTS));
  EXPECT_GE(written, 7u);  // v0..v5 and out leave their groups
}

// Between convolutions (where the CPU runs channels-last with oneDNN, and the group keeps the
// standard layout): s = sigmoid(conv(x)) feeds a second convolution and leaves as a model output
// with s * conv(x).
TEST(FuseMultiOutput, AGroupWithSeveralOutputsBetweenConvolutions) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 4, 9, 9}, "x");
  auto c = kg::nn::conv2d(x, 8, 3, {.padding = 1}, "conv1");
  auto s = kg::tanh(kg::mul(c, 0.5, "half"), "s");
  auto a = kg::mul(s, c, "a");
  auto d = kg::nn::conv2d(s, 8, 3, {.padding = 1}, "conv2");
  Built b{g, {{"a", a}, {"d", d}, {"s", s}}, {{2, 4, 9, 9}}};
  kg::Model plain(b.graph, b.outputs, kg::LoweringMode::Inference, {.fusion = false});
  kg::Model fused(b.graph, b.outputs);
  auto f = fused_ops(fused);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(names(*f[0], true), (std::vector<std::string>{"s", "a"}));
  std::map<std::string, kg::Tensor> params;
  for (const auto& info : plain.parameters())
    params[info.name] = kg_test::random_tensor(rng, info.dtype, info.shape, -0.3, 0.3);
  const auto in = random_inputs(rng, b, kg::DType::F32);
  auto mp = plain.load(kg::Device::cpu(), b.input_shapes);
  mp.load_state_dict(params);
  const auto want = mp.forward(in);
  for (bool checked : {false, true}) {
    SCOPED_TRACE(checked ? "emulated kernels" : "cpu");
    kg::LoadOptions opt;
    opt.checked = checked;
    opt.poison_buffers = !checked;
    auto mf = fused.load(kg::Device::cpu(), b.input_shapes, opt);
    mf.load_state_dict(params);
    const auto got = mf.forward(in);
    for (std::size_t i = 0; i < want.size(); ++i) {
      SCOPED_TRACE("output " + b.outputs[i].first);
      EXPECT_TRUE(kg_test::all_close(got[i], want[i], 1e-5, 1e-5));
    }
  }
}

namespace {

// x → linear → h; s = sigmoid(h), a = s * h, b = tanh(s), c = a + b: a is a model output and (when
// `a_in_loss`) read by a loss, c by another, so one group writes a and c. Without `a_in_loss` a's
// part of the packed gradient gets no contribution and is zeroed.
Built training_graph(bool a_in_loss) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 12}, "x");
  auto t1 = g->input(kg::DType::F32, {kg::Dim::named("batch"), 10}, "t1");
  auto t2 = g->input(kg::DType::F32, {kg::Dim::named("batch"), 10}, "t2");
  auto h = kg::nn::linear(x, 10, "fc");
  auto s = kg::sigmoid(h, "s");
  auto a = kg::mul(s, h, "a");
  auto b = kg::tanh(s, "b");
  auto c = kg::add(a, b, "c");
  kg::SymTensor loss = kg::mse_loss(c, t2, "l2");
  if (a_in_loss) loss = kg::add(kg::mse_loss(a, t1, "l1"), loss, "loss");
  return {g, {{"loss", loss}, {"a", a}}, {{6, 12}, {6, 10}, {6, 10}}};
}

// x → linear → h; hw = h * w with a row w [1, 10] and a scalar k [1, 1], each from a linear layer on
// z [1, 3]; s = sigmoid(hw), a = s * k, b = tanh(s), c = a + b: one group writing a and c whose
// backward sums the row's and the scalar's contributions over the elements that read them.
Built broadcast_training_graph(std::int64_t batch) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 12}, "x");
  auto z = g->input(kg::DType::F32, {1, 3}, "z");
  auto t1 = g->input(kg::DType::F32, {kg::Dim::named("batch"), 10}, "t1");
  auto t2 = g->input(kg::DType::F32, {kg::Dim::named("batch"), 10}, "t2");
  auto h = kg::nn::linear(x, 10, "fc");
  auto w = kg::nn::linear(z, 10, "fw");
  auto k = kg::nn::linear(z, 1, "fk");
  auto s = kg::sigmoid(kg::mul(h, w, "hw"), "s");
  auto a = kg::mul(s, k, "a");
  auto c = kg::add(a, kg::tanh(s, "b"), "c");
  kg::SymTensor loss = kg::add(kg::mse_loss(a, t1, "l1"), kg::mse_loss(c, t2, "l2"), "loss");
  return {g, {{"loss", loss}, {"a", a}}, {{batch, 12}, {1, 3}, {batch, 10}, {batch, 10}}};
}

// The fused model's outputs and gradients against the unfused one's, on the CPU forms and checked
// under the emulator, with poisoned buffers (every gradient element must be written).
void compare_training(const Built& b, const kg::Model& fused, std::mt19937_64& rng) {
  kg::Model plain(b.graph, b.outputs, kg::LoweringMode::Training, {.fusion = false});
  auto in = random_inputs(rng, b, kg::DType::F32);
  kg::LoadOptions checked;
  checked.checked = true;
  auto mp = plain.load(kg::Device::cpu(), b.input_shapes);
  mp.zero_grad();
  const auto want_out = mp.forward(in);
  mp.backward();
  const auto want = mp.gradients();
  for (bool emulated : {false, true}) {
    SCOPED_TRACE(emulated ? "emulated kernels" : "cpu forms");
    kg::LoadOptions opt = emulated ? checked : kg::LoadOptions{};
    opt.poison_buffers = true;
    auto mf = fused.load(kg::Device::cpu(), b.input_shapes, opt);
    mf.load_state_dict(mp.state_dict());
    mf.zero_grad();
    const auto got_out = mf.forward(in);
    for (std::size_t i = 0; i < want_out.size(); ++i)
      EXPECT_TRUE(kg_test::all_close(got_out[i], want_out[i], 1e-6, 1e-6));
    mf.backward();
    const auto got = mf.gradients();
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, w] : want) {
      SCOPED_TRACE(name);
      EXPECT_TRUE(kg_test::all_written(got.at(name)));
      EXPECT_TRUE(kg_test::all_close(got.at(name), w, 1e-5, 1e-6));
    }
  }
}

}  // namespace

TEST(FuseMultiOutput, TrainingGradientsMatchTheUnfusedOnes) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (bool a_in_loss : {true, false}) {
    SCOPED_TRACE(a_in_loss ? "both outputs in the loss" : "one output outside the loss");
    Built b = training_graph(a_in_loss);
    kg::Model fused(b.graph, b.outputs, kg::LoweringMode::Training);
    auto f = fused_ops(fused);
    ASSERT_EQ(f.size(), 1u);
    EXPECT_EQ(names(*f[0], false), (std::vector<std::string>{"s", "a", "b", "c"}));
    EXPECT_EQ(names(*f[0], true), (std::vector<std::string>{"a", "c"}));
    compare_training(b, fused, rng);
  }
}

// A group with several outputs whose inputs broadcast (a row and a scalar from linear layers) in
// training: one group writing a and c, its gradients those of the unfused graph.
TEST(FuseMultiOutput, BroadcastInputsInATrainingGroupWithSeveralOutputs) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // At batch 4096 the scalar's reduction on the GPU (and emulated) is split over two blocks.
  for (std::int64_t batch : {6, 4096}) {
    SCOPED_TRACE("batch " + std::to_string(batch));
    Built b = broadcast_training_graph(batch);
    kg::Model fused(b.graph, b.outputs, kg::LoweringMode::Training);
    auto f = fused_ops(fused);
    ASSERT_EQ(f.size(), 1u) << fused.summary();
    EXPECT_EQ(names(*f[0], false), (std::vector<std::string>{"hw", "s", "a", "b", "c"}));
    EXPECT_EQ(names(*f[0], true), (std::vector<std::string>{"a", "c"}));
    EXPECT_EQ(f[0]->inputs(), 3);  // h, the row and the scalar
    compare_training(b, fused, rng);
  }
}

// The fused op with several outputs on its own: kg::testing's forward checks and its finite
// difference gradient check, through the packed output.
TEST(FuseMultiOutput, AGroupWithSeveralOutputsPassesTheOpChecks) {
  Built b = training_graph(true);
  kg::Model fused(b.graph, b.outputs, kg::LoweringMode::Training);
  const kg::Node* node = nullptr;
  for (int id : fused.live_nodes())
    if (fused.graph().node(id).op_name() == "kg.fused_elementwise") node = &fused.graph().node(id);
  ASSERT_NE(node, nullptr);
  kg::testing::GradCheckOptions opt;
  opt.gpu = false;
  const auto report = kg::testing::check_gradients(*node->op, {{4, 10}}, {kg::DType::F32}, opt);
  EXPECT_TRUE(report.ok) << report.to_string();
  const auto fwd = kg::testing::check_op(*node->op, {kg::Shape{kg::Dim::named("batch"), 10}}, {kg::DType::F32},
                                         {.rtol = 1e-5, .atol = 1e-6, .gpu = false});
  EXPECT_TRUE(fwd.ok) << fwd.to_string();
}

TEST(FuseMultiOutput, ABadDescriptionIsAnError) {
  using kg::ops::FusedElementwiseOp;
  using kg::ops::FusedMember;
  using kg::ops::GroupOutputOp;
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {4}, "x");
  auto row = g->input(kg::DType::F32, {1}, "one");
  auto r = kg::relu(x, "r");
  auto ad = kg::add(x, row, "ad");
  const kg::CustomData relu_op = *g->node(r.node()).op, add_op = *g->node(ad.node()).op;
  const kg::ElementwiseForm relu_form = *relu_op->elementwise_form({kg::DType::F32});
  const kg::ElementwiseForm add_form = *add_op->elementwise_form({kg::DType::F32, kg::DType::F32});
  auto relu = [&](const std::string& name, int arg) { return FusedMember{name, relu_op, relu_form, {arg}}; };
  const auto mode = kg::LoweringMode::Inference;
  const auto f32 = kg::DType::F32;
  // Members: a = relu(x0), b = relu(a), c = relu(b).
  const std::vector<FusedMember> chain{relu("a", -1), relu("b", 0), relu("c", 1)};
  kg_test::expect_error([&] { FusedElementwiseOp(chain, 1, f32, mode, {0, 1, 2, 0, 1}); },
                        {"writes 1 to 4 outputs, got 5"});
  kg_test::expect_error([&] { FusedElementwiseOp(chain, 1, f32, mode, {0, 3}); },
                        {"output 1 is member 3", "has 3 members"});
  kg_test::expect_error([&] { FusedElementwiseOp(chain, 1, f32, mode, {-1, 2}); }, {"output 0 is member -1"});
  kg_test::expect_error([&] { FusedElementwiseOp(chain, 1, f32, mode, {2, 2}); },
                        {"nn.relu @ c", "listed as an output twice"});
  kg_test::expect_error([&] { FusedElementwiseOp(chain, 1, f32, mode, {0, 1}); },
                        {"the root, member 2", "nn.relu @ c", "must be an output"});
  // A member nobody reads that is no output: a = relu(x0), b = relu(x0) (dead), c = relu(a).
  kg_test::expect_error(
      [&] { FusedElementwiseOp({relu("a", -1), relu("b", -1), relu("c", 0)}, 1, f32, mode); },
      {"nn.relu @ b", "read by no member and is no output"});
  // Outputs of two shapes: a = relu(x1) [1] and c = x0 + a [4].
  FusedElementwiseOp shapes({relu("a", -2), FusedMember{"c", add_op, add_form, {-1, 0}}}, 2, f32, mode, {0, 1});
  kg_test::expect_error([&] { (void)shapes.infer_output_shape({kg::Shape{4}, kg::Shape{1}}); },
                        {"outputs share one shape", "a is [1]", "c is [4]"});
  // A good one: a packed [3, 4], its attributes list the outputs.
  FusedElementwiseOp ok(chain, 1, f32, mode, {0, 2, 1});
  EXPECT_EQ(ok.infer_output_shape({kg::Shape{4}}), (kg::Shape{3, 4}));
  EXPECT_NE(ok.attributes().find("nodes=a,b,c outputs=a,c,b kernel=kg_fused_"), std::string::npos);
  EXPECT_NE(FusedElementwiseOp(chain, 1, f32, mode, {2}).entry(), ok.entry()) << "outputs are in the kernel's hash";

  // kg.group_output.
  kg_test::expect_error([] { GroupOutputOp(2, 2); }, {"output 2 of 2", "2 to 4"});
  kg_test::expect_error([] { GroupOutputOp(0, 1); }, {"output 0 of 1"});
  kg_test::expect_error([] { GroupOutputOp(0, 5); }, {"output 0 of 5"});
  kg_test::expect_error([] { GroupOutputOp(-1, 2); }, {"output -1 of 2"});
  const GroupOutputOp view(1, 3);
  EXPECT_EQ(view.infer_output_shape({kg::Shape{3, kg::Dim::named("batch"), 5}}),
            (kg::Shape{kg::Dim::named("batch"), 5}));
  EXPECT_EQ(view.view_offset({3, 2, 5}), 10);
  EXPECT_EQ(view.attributes(), "output=1/3");
  kg_test::expect_error([&] { (void)view.infer_output_shape({kg::Shape{2, 5}}); },
                        {"3 outputs packed as [3, ...]", "got [2, 5]"});
  kg_test::expect_error([&] { (void)view.infer_output_shape({kg::Shape{3, 5}, kg::Shape{3, 5}}); },
                        {"expects 1 input", "got 2"});
  kg_test::expect_error([&] { (void)view.view_offset({2, 5}); }, {"kg.group_output", "got [2, 5]"});

  // A part of a model input cannot be taken (its bytes are the caller's, not the arena's).
  auto [p, pg] = kg::SymTensor::input(kg::DType::F32, {3, 4}, "packed");
  auto part = p.record_custom(kg::CustomData::make<GroupOutputOp>(1, 3), {}, std::nullopt, "part");
  kg::Model bad(pg, {kg::relu(part, "use")}, kg::LoweringMode::Inference, {.fusion = false});
  kg_test::expect_error([&] { (void)bad.load(kg::Device::cpu(), {{3, 4}}); },
                        {"[kg.group_output @ part]", "part of model input 'packed'"});
}

// ---- on a GPU ----

namespace {

void compare_on_gpu(const Built& b, const std::vector<kg::Tensor>& inputs, double tol) {
  kg::Model fused(b.graph, b.outputs);
  kg::Model plain(b.graph, b.outputs, kg::LoweringMode::Inference, {.fusion = false});
  kg::LoadOptions poisoned;
  poisoned.poison_buffers = true;
  auto want = plain.load(kg::Device::cpu(), b.input_shapes).forward(inputs);
  auto got = fused.load(kg::Device::cuda(), b.input_shapes, poisoned).forward(inputs);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("output " + b.outputs[i].first);
    EXPECT_TRUE(kg_test::all_written(got[i]));
    EXPECT_TRUE(kg_test::all_close(got[i], want[i], tol, tol));
  }
}

}  // namespace

TEST(FuseMultiOutputGpu, GeneratedKernelsMatchTheCpu) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // Sizes that take the packed path with and without a scalar tail; 37 columns puts the second
  // output off 16-byte alignment (the scalar loop then writes it).
  for (std::int64_t cols : {1, 37, 4096, 65537}) {
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), cols}, "x");
    auto s = kg::sigmoid(x, "s");
    auto a = kg::mul(s, x, "a");
    auto b = kg::add(s, 1.0, "b");
    auto soft = kg::softmax(s, -1, "soft");
    Built built{g, {{"a", a}, {"b", b}, {"soft", soft}}, {{3, cols}}};
    compare_on_gpu(built, random_inputs(rng, built, kg::DType::F32), 1e-6);
  }
  for (int trial = 0; trial < 4; ++trial) {
    const kg::DType dt = trial % 2 ? kg::DType::F64 : kg::DType::F32;
    Built b = random_graph(rng, dt);
    compare_on_gpu(b, random_inputs(rng, b, dt), dt == kg::DType::F32 ? 2e-5 : 1e-11);
  }
  // 16-bit: the GPU against the 16-bit CPU forms.
  for (kg::DType precision : {kg::DType::BF16, kg::DType::F16}) {
    Built b = random_graph(rng, kg::DType::F32);
    kg::Model fused(b.graph, b.outputs);
    kg::LoadOptions low;
    low.precision = precision;
    const auto in = random_inputs(rng, b, kg::DType::F32);
    auto want = fused.load(kg::Device::cpu(), b.input_shapes, low).forward(in);
    auto got = fused.load(kg::Device::cuda(), b.input_shapes, low).forward(in);
    const double tol = precision == kg::DType::BF16 ? 2e-2 : 3e-3;
    for (std::size_t i = 0; i < want.size(); ++i) {
      SCOPED_TRACE("output " + b.outputs[i].first);
      EXPECT_TRUE(kg_test::all_close(got[i], want[i], tol, tol));
    }
  }
}

TEST(FuseMultiOutputGpu, TrainingGradientsMatchTheCpu) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // Both outputs in the loss, one outside it, and broadcast inputs (a row and a scalar) at a batch
  // whose scalar reduction is split over several blocks.
  for (int which = 0; which < 3; ++which) {
    SCOPED_TRACE("graph " + std::to_string(which));
    Built b = which < 2 ? training_graph(which == 0) : broadcast_training_graph(4096);
    kg::Model fused(b.graph, b.outputs, kg::LoweringMode::Training);
    kg::Model plain(b.graph, b.outputs, kg::LoweringMode::Training, {.fusion = false});
    auto in = random_inputs(rng, b, kg::DType::F32);
    auto mp = plain.load(kg::Device::cpu(), b.input_shapes);
    auto mg = fused.load(kg::Device::cuda(), b.input_shapes);
    mg.load_state_dict(mp.state_dict());
    kg_test::expect_same_gradients(mp, mg, in, 1e-4, 1e-5);
  }
}
