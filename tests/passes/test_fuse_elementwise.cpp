// The elementwise fusion pass and kg.fused_elementwise: fused and unfused graphs agree on the CPU
// (the chunked forms) and under the CUDA emulator (the generated kernels, checked mode), forward
// and backward; groups split around nodes that cannot join; what cannot be fused in training.
#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "kg/models.hpp"
#include "kg/testing.hpp"
#include "ops/fused_elementwise.hpp"
#include "ops/fused_gemm.hpp"
#include "support/fusion_util.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;
using kg_test::member_names;

namespace {

struct Built {
  std::shared_ptr<kg::Graph> graph;
  std::vector<kg::SymTensor> outputs;
  std::vector<std::vector<std::int64_t>> input_shapes;
};

// Nodes of op `op`, or with "" every node that runs (views, such as a group's outputs, run nothing).
int count_ops(const kg::Model& m, const std::string& op) {
  if (op.empty()) return kg_test::count_ops(m, false);
  int n = 0;
  for (int id : m.live_nodes()) {
    const kg::Node& node = m.graph().node(id);
    n += node.kind == kg::Node::Kind::Op && node.op_name() == op;
  }
  return n;
}

std::vector<const kg::ops::FusedElementwiseOp*> fused_ops(const kg::Model& m) {
  return kg_test::ops_of<kg::ops::FusedElementwiseOp>(m);
}

// Random values for every f32 parameter by name: running variances in [0.5, 1.5], the others in
// [-scale, scale] (the i64 counters keep theirs).
std::map<std::string, kg::Tensor> random_params(const kg::Model& m, std::mt19937_64& rng, double scale) {
  std::map<std::string, kg::Tensor> p;
  for (const auto& info : m.parameters()) {
    if (info.dtype != kg::DType::F32) continue;
    const bool var = info.name.ends_with("running_var");
    p[info.name] = kg_test::random_tensor(rng, info.dtype, info.shape, var ? 0.5 : -scale, var ? 1.5 : scale);
  }
  return p;
}

std::vector<kg::Tensor> random_inputs(std::mt19937_64& rng, const Built& b, kg::DType dt) {
  return kg_test::random_inputs(rng, b.input_shapes, dt);
}

// Runs `b` fused and unfused with the same inputs; the fused model on the CPU (its chunked
// forms) and checked under the emulator (its generated kernels); expects the unfused outputs.
kg::Model compare_inference(const Built& b, const std::vector<kg::Tensor>& inputs, double tol) {
  kg::Model fused(b.graph, b.outputs);
  kg::Model plain(b.graph, b.outputs, kg::LoweringMode::Inference, {.fusion = false});
  kg_test::expect_fused_matches_plain(fused, plain, b.input_shapes, inputs, tol);
  return fused;
}

}  // namespace

TEST(FuseElementwise, TheSwishChainIsOneNodeWithTheSameValues) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
    SCOPED_TRACE(std::string(kg::dtype_name(dt)));
    auto [x, g] = kg::SymTensor::input(dt, {kg::Dim::named("batch"), 37}, "x");
    auto y = kg::relu(kg::add(kg::mul(x, kg::sigmoid(x, "sig"), "mul"), 1.0, "plus1"), "out");
    for (std::int64_t batch : {1, 5, 64}) {
      Built b{g, {y}, {{batch, 37}}};
      kg::Model m = compare_inference(b, random_inputs(rng, b, dt), dt == kg::DType::F32 ? 1e-6 : 1e-12);
      EXPECT_EQ(count_ops(m, ""), 1);
      auto f = fused_ops(m);
      ASSERT_EQ(f.size(), 1u);
      EXPECT_EQ(member_names(*f[0]), (std::vector<std::string>{"sig", "mul", "plus1", "out"}));
      EXPECT_EQ(f[0]->inputs(), 1);  // x is read once, by two members
      // The fused node keeps the root's name; its attributes name the members and the kernel.
      const kg::Node& node = m.graph().node(m.outputs()[0].second);
      EXPECT_EQ(node.name, "out");
      EXPECT_NE(node.op->op().attributes().find("nodes=sig,mul,plus1,out kernel=kg_fused_"),
                std::string::npos);
    }
  }
}

// Random DAGs of fusable ops over inputs that broadcast in several ways (a scalar, a channel
// vector, a row, a full tensor), with the demo's custom scaled tanh among them.
TEST(FuseElementwise, RandomBroadcastingGraphsAgreeFusedAndUnfused) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 12; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const kg::DType dt = trial % 4 == 3 ? kg::DType::F64 : kg::DType::F32;
    auto [x, g] = kg::SymTensor::input(dt, {kg::Dim::named("batch"), 3, 5, 6}, "x");
    std::vector<kg::SymTensor> inputs{x, g->input(dt, {3, 1, 1}, "c"), g->input(dt, {1}, "s"),
                                      g->input(dt, {6}, "row"),
                                      g->input(dt, {kg::Dim::named("batch"), 3, 5, 6}, "y")};
    std::vector<kg::SymTensor> values = inputs;
    std::uniform_int_distribution<int> pick_op(0, 10);
    for (int k = 0; k < 9; ++k) {
      auto pick = [&] {
        return values[std::uniform_int_distribution<std::size_t>(0, values.size() - 1)(rng)];
      };
      const std::string name = "n" + std::to_string(k);
      kg::SymTensor a = pick(), b = pick(), v;
      switch (pick_op(rng)) {
        case 0:
          v = kg::add(a, b, name);
          break;
        case 1:
          v = kg::sub(a, b, name);
          break;
        case 2:
          v = kg::mul(a, b, name);
          break;
        case 3:
          v = kg::div(a, kg::add(kg::mul(b, b), 1.0), name);
          break;  // a / (b² + 1)
        case 4:
          v = kg::sigmoid(a, name);
          break;
        case 5:
          v = kg::tanh(a, name);
          break;
        case 6:
          v = kg::silu(a, name);
          break;
        case 7:
          v = kg::leaky_relu(a, 0.2, name);
          break;
        case 8:
          v = kg::rsub(a, 0.5, name);
          break;
        case 9:
          v = kg::gelu(a, kg::GeluApprox::Tanh, name);
          break;
        default:
          v = kg::models::scaled_tanh(a, name);
          break;
      }
      values.push_back(v);
    }
    // Two outputs: the last value, broadcast against x so it has the full shape, and one more.
    std::vector<kg::SymTensor> outs{kg::add(values.back(), x, "out0"), values[values.size() - 3]};
    Built b{g, outs, {{2, 3, 5, 6}, {3, 1, 1}, {1}, {6}, {2, 3, 5, 6}}};
    kg::Model m = compare_inference(b, random_inputs(rng, b, dt), dt == kg::DType::F32 ? 2e-5 : 1e-11);
    kg::Model plain(b.graph, b.outputs, kg::LoweringMode::Inference, {.fusion = false});
    EXPECT_LT(count_ops(m, ""), count_ops(plain, ""));
    EXPECT_FALSE(fused_ops(m).empty());
  }
}

// A node without an elementwise form (softmax) or with parameters (linear) splits a chain: the
// parts on either side are fused on their own, and a lone node stays as it was.
TEST(FuseElementwise, AGroupIsSplitAroundANodeThatCannotJoin) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 16}, "x");
  auto a = kg::tanh(kg::mul(x, 2.0, "scale"), "t");
  auto s = kg::softmax(a, -1, "soft");
  auto b = kg::relu(kg::add(kg::sigmoid(s, "sig"), s, "sum"), "r");
  auto l = kg::nn::linear(b, 16, "fc");
  auto out = kg::silu(l, "act");  // after the linear: its epilogue
  Built built{g, {out}, {{4, 16}}};
  kg::Model m(built.graph, built.outputs);
  auto f = fused_ops(m);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(member_names(*f[0]), (std::vector<std::string>{"sig", "sum", "r"}));
  // The group before the softmax, read by it alone, became its prologue (docs/fusion.md).
  EXPECT_EQ(count_ops(m, "nn.softmax"), 0);
  ASSERT_EQ(count_ops(m, "kg.fused_reduction"), 1);
  EXPECT_NE(m.graph().node(m.graph().find("soft")).op->op().attributes().find("prologue=scale,t "),
            std::string::npos);
  // The lone node after the linear, read by nothing else, became its epilogue.
  EXPECT_EQ(count_ops(m, "nn.linear"), 0);
  EXPECT_EQ(count_ops(m, "nn.silu"), 0);
  EXPECT_EQ(count_ops(m, "kg.fused_gemm"), 1);
  // Same values as unfused (the linear's weights by name).
  kg::Model plain(built.graph, built.outputs, kg::LoweringMode::Inference, {.fusion = false});
  auto mf = m.load(kg::Device::cpu(), built.input_shapes);
  auto mp = plain.load(kg::Device::cpu(), built.input_shapes);
  mf.load_state_dict(mp.state_dict());
  auto in = random_inputs(rng, built, kg::DType::F32);
  EXPECT_TRUE(kg_test::all_close(mf.forward(in)[0], mp.forward(in)[0], 1e-6, 1e-6));
}

// A value that is a model output, or that a node outside the group reads, is not absorbed: it
// becomes one more output of the group (tests/passes/test_fuse_multi_output.cpp has the rest), and
// a node that would make the group its own ancestor stays out.
TEST(FuseElementwise, AValueNeededOutsideTheGroupIsNotAbsorbed) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 8}, "x");
  auto a = kg::sigmoid(kg::add(x, 1.0, "p"), "a");  // also an output
  auto b = kg::tanh(kg::mul(a, 3.0, "m"), "b");
  auto c = kg::softmax(kg::relu(b, "rb"), -1, "soft");  // b also read by "late"
  auto late = kg::sub(b, c, "late");
  kg::Model m(g, {{"a", a}, {"late", late}});
  auto f = fused_ops(m);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(member_names(*f[0]), (std::vector<std::string>{"p", "a", "m", "b", "rb"}));
  EXPECT_NE(f[0]->attributes().find("outputs=a,b,rb "), std::string::npos);
  EXPECT_EQ(count_ops(m, "kg.group_output"), 3);
  EXPECT_EQ(count_ops(m, "nn.sub"), 1);  // late reads b and the softmax of rb: alone
}

TEST(FuseElementwise, FusionCanBeTurnedOff) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {4, 8}, "x");
  auto y = kg::relu(kg::sigmoid(x, "a"), "b");
  EXPECT_EQ(count_ops(kg::Model(g, {y}), "kg.fused_elementwise"), 1);
  EXPECT_EQ(count_ops(kg::Model(g, {y}, kg::LoweringMode::Inference, {.fusion = false}), ""), 2);
  ::setenv("KG_NO_FUSION", "1", 1);
  const int unfused = count_ops(kg::Model(g, {y}), "");
  ::setenv("KG_NO_FUSION", "0", 1);
  const int fused = count_ops(kg::Model(g, {y}), "");
  ::unsetenv("KG_NO_FUSION");
  EXPECT_EQ(unfused, 2);
  EXPECT_EQ(fused, 1);
}

namespace {

// y = x·sigmoid(x) written by a user, with a device function; its derivative only when asked.
class UserSwish final : public kg::CustomOp {
 public:
  explicit UserSwish(bool derivative) : derivative_(derivative) {}
  std::string name() const override { return "user.swish"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  void cpu_forward(kg::CpuContext& ctx) const override {
    const float* x = ctx.inputs[0].data<float>();
    float* y = ctx.output.data<float>();
    for (std::int64_t i = 0; i < ctx.output.numel(); ++i) y[i] = x[i] / (1.0f + std::exp(-x[i]));
  }
  bool has_cpu_backward() const override { return true; }
  void cpu_backward(kg::CpuBackwardContext& ctx) const override {
    const float* x = ctx.inputs[0].data<float>();
    const float* dy = ctx.grad_output.data<float>();
    float* dx = ctx.grad_inputs[0].data<float>();
    for (std::int64_t i = 0; i < ctx.grad_output.numel(); ++i) {
      const float s = 1.0f / (1.0f + std::exp(-x[i]));
      dx[i] = dy[i] * (s + x[i] * s * (1.0f - s));
    }
  }
  std::optional<kg::ElementwiseForm> elementwise_form(const std::vector<kg::DType>& in) const override {
    if (in.at(0) != kg::DType::F32) return std::nullopt;
    kg::ElementwiseForm f;
    f.function = "swish";
    f.device_source = R"(
__device__ float swish(float x) { return x / (1.0f + expf(-x)); }
__device__ float swish_grad(int, float x, float) {
  const float s = 1.0f / (1.0f + expf(-x));
  return s + x * s * (1.0f - s);
})";
    f.cpu = kg::ElementwiseForm::cpu_map<1>([](float x) { return x / (1.0f + std::exp(-x)); });
    if (derivative_) {
      f.derivative = "swish_grad";
      f.cpu_derivative = kg::ElementwiseForm::cpu_map_derivative<1>([](int, float x, float) {
        const float s = 1.0f / (1.0f + std::exp(-x));
        return s + x * s * (1.0f - s);
      });
    }
    return f;
  }

 private:
  bool derivative_;
};

kg::SymTensor user_swish(const kg::SymTensor& x, bool derivative, const std::string& name) {
  return x.record_custom(kg::CustomData::make<UserSwish>(derivative), {}, std::nullopt, name);
}

// x → linear → user swish → * 0.5 + tanh(...) → mse against t: gradients reach the linear's
// parameters only through the fused group.
Built training_graph(bool derivative) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 12}, "x");
  auto t = g->input(kg::DType::F32, {kg::Dim::named("batch"), 10}, "t");
  auto h = kg::nn::linear(x, 10, "fc");
  auto y = user_swish(h, derivative, "swish");
  auto half = kg::mul(y, 0.5, "half");
  y = kg::add(half, kg::tanh(h, "th"), "mix");
  y = kg::mul(y, kg::sigmoid(y, "gate"), "gated");
  return {g, {kg::mse_loss(y, t, "loss")}, {{6, 12}, {6, 10}}};
}

}  // namespace

TEST(FuseElementwise, TrainingGradientsOfAFusedGroupMatchTheUnfusedOnes) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Built b = training_graph(true);
  kg::Model fused(b.graph, b.outputs, kg::LoweringMode::Training);
  kg::Model plain(b.graph, b.outputs, kg::LoweringMode::Training, {.fusion = false});
  auto f = fused_ops(fused);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(member_names(*f[0]), (std::vector<std::string>{"swish", "half", "th", "mix", "gate", "gated"}));
  auto in = random_inputs(rng, b, kg::DType::F32);
  kg::LoadOptions checked;
  checked.checked = true;
  auto mp = plain.load(kg::Device::cpu(), b.input_shapes);
  std::map<std::string, kg::Tensor> want;
  {
    mp.zero_grad();
    mp.forward(in);
    mp.backward();
    want = mp.gradients();
  }
  for (bool emulated : {false, true}) {
    SCOPED_TRACE(emulated ? "emulated kernels" : "cpu forms");
    auto mf = fused.load(kg::Device::cpu(), b.input_shapes, emulated ? checked : kg::LoadOptions{});
    mf.load_state_dict(mp.state_dict());
    mf.zero_grad();
    EXPECT_TRUE(kg_test::all_close(mf.forward(in)[0], mp.forward(in)[0], 1e-6, 1e-6));
    mf.backward();
    auto got = mf.gradients();
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, w] : want) {
      SCOPED_TRACE(name);
      EXPECT_TRUE(kg_test::all_close(got.at(name), w, 1e-5, 1e-6));
    }
  }
}

// The fused op itself against finite differences, on the CPU and in the emulated backward kernel.
TEST(FuseElementwise, AFusedGroupPassesTheGradientCheck) {
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
  const auto fwd = kg::testing::check_op(*node->op, {kg::Shape{kg::Dim::named("batch"), 10}},
                                         {kg::DType::F32}, {.rtol = 1e-5, .atol = 1e-6, .gpu = false});
  EXPECT_TRUE(fwd.ok) << fwd.to_string();
}

// A custom op with a device function but no derivative is fused for inference and stays its own
// node in training (where its cpu_backward runs); the rest of the chain is still fused.
TEST(FuseElementwise, AnOpWithoutADerivativeIsNotFusedInTraining) {
  Built b = training_graph(false);
  // For inference the whole group, the swish first, becomes the linear's epilogue.
  kg::Model inference(b.graph, b.outputs);
  EXPECT_TRUE(fused_ops(inference).empty());
  const int fc = inference.graph().find("fc");
  ASSERT_GE(fc, 0);
  const auto* gemm = inference.graph().node(fc).op->as<kg::ops::FusedGemmOp>();
  ASSERT_NE(gemm, nullptr) << inference.summary();
  EXPECT_EQ(gemm->members().front().node, "swish");
  kg::Model training(b.graph, b.outputs, kg::LoweringMode::Training);
  EXPECT_EQ(count_ops(training, "user.swish"), 1);
  auto ft = fused_ops(training);
  ASSERT_EQ(ft.size(), 1u);
  EXPECT_EQ(member_names(*ft[0]), (std::vector<std::string>{"half", "th", "mix", "gate", "gated"}));
  // It trains: the loss decreases with the unfused swish's own backward.
  auto m = training.load(kg::Device::cpu(), b.input_shapes);
  std::mt19937_64 rng(fresh_seed());
  auto in = random_inputs(rng, b, kg::DType::F32);
  m.set_optimizer(kg::OptimizerOptions::sgd(0.05));
  const float first = m.forward(in)[0].data<float>()[0];
  for (int i = 0; i < 20; ++i) {
    m.zero_grad();
    m.forward(in);
    m.backward();
    m.step();
  }
  EXPECT_LT(m.forward(in)[0].data<float>()[0], first);
}

namespace {

// x → linear → h [batch, 2, 3, 5], then one group over h with broadcast inputs that come from
// linear layers on z [1, 3] (so their gradients reach parameters): a per-channel scale [2, 1, 1]
// through a sigmoid inside the group (a member of that shape), a per-channel bias [1, 2, 1, 1]
// and a scalar [1, 1]; and a row c [5] that is an input (no gradient wanted).
Built broadcast_training_graph(std::int64_t batch = 3) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 2, 3, 6}, "x");
  auto z = g->input(kg::DType::F32, {1, 3}, "z");
  auto c = g->input(kg::DType::F32, {5}, "c");
  auto t = g->input(kg::DType::F32, {kg::Dim::named("batch"), 2, 3, 5}, "target");
  auto h = kg::nn::linear(x, 5, "fc");
  auto scale = kg::reshape(kg::nn::linear(z, 2, "fs"), {2, 1, 1}, "scale_v");
  auto bias = kg::reshape(kg::nn::linear(z, 2, "fb"), {1, 2, 1, 1}, "bias_v");
  auto k = kg::nn::linear(z, 1, "fk");
  auto y = kg::mul(h, kg::sigmoid(scale, "gs"), "scale");
  y = kg::silu(kg::add(y, bias, "shift"), "act");
  y = kg::tanh(kg::add(kg::mul(y, k, "u"), c, "addc"), "th");
  return {g, {kg::mse_loss(y, t, "loss")}, {{batch, 2, 3, 6}, {1, 3}, {5}, {batch, 2, 3, 5}}};
}

// The gradients of `fused` and of `b` unfused, after one forward and backward on the same inputs
// and parameters, on the CPU forms and checked under the emulator (poisoned buffers: every element
// of every gradient written).
void compare_training(const Built& b, const kg::Model& fused, std::mt19937_64& rng, double rtol, double atol) {
  kg::Model plain(b.graph, b.outputs, kg::LoweringMode::Training, {.fusion = false});
  auto in = random_inputs(rng, b, kg::DType::F32);
  auto mp = plain.load(kg::Device::cpu(), b.input_shapes);
  mp.load_state_dict(random_params(plain, rng, 1.0), false);
  mp.zero_grad();
  const auto want_out = mp.forward(in);
  mp.backward();
  const auto want = mp.gradients();
  for (bool emulated : {false, true}) {
    SCOPED_TRACE(emulated ? "emulated kernels" : "cpu forms");
    kg::LoadOptions opt;
    opt.checked = emulated;
    opt.poison_buffers = true;
    auto mf = fused.load(kg::Device::cpu(), b.input_shapes, opt);
    mf.load_state_dict(mp.state_dict());
    mf.zero_grad();
    const auto got_out = mf.forward(in);
    for (std::size_t i = 0; i < want_out.size(); ++i)
      EXPECT_TRUE(kg_test::all_close(got_out[i], want_out[i], rtol, atol));
    mf.backward();
    const auto got = mf.gradients();
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, w] : want) {
      SCOPED_TRACE(name);
      EXPECT_TRUE(kg_test::all_written(got.at(name)));
      EXPECT_TRUE(kg_test::all_close(got.at(name), w, rtol, atol));
    }
  }
}

// The concrete shapes of a node's inputs, dynamic dims given `batch`.
std::vector<std::vector<std::int64_t>> input_sizes(const kg::Graph& g, const kg::Node& n, std::int64_t batch) {
  std::vector<std::vector<std::int64_t>> v;
  for (int in : n.inputs) {
    std::vector<std::int64_t> sizes;
    for (const kg::Dim& d : g.node(in).shape) sizes.push_back(d.is_static() ? d.size() : batch);
    v.push_back(sizes);
  }
  return v;
}

}  // namespace

// In training, nodes whose inputs broadcast (a scalar, a per-channel scale and bias, a row) join
// groups as in inference: the whole chain after the linear layer is one group, and its gradients
// (the broadcast inputs' summed over the elements that read them) match the unfused graph's.
TEST(FuseElementwise, BroadcastInputsJoinTrainingGroups) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Built b = broadcast_training_graph();
  kg::Model fused(b.graph, b.outputs, kg::LoweringMode::Training);
  auto f = fused_ops(fused);
  ASSERT_EQ(f.size(), 1u) << fused.summary();
  EXPECT_EQ(member_names(*f[0]), (std::vector<std::string>{"gs", "scale", "shift", "act", "u", "addc", "th"}));
  EXPECT_EQ(f[0]->inputs(), 5);  // the scale, h, the bias, the scalar and the row
  EXPECT_EQ(count_ops(fused, "nn.add"), 0);
  EXPECT_EQ(count_ops(fused, "nn.mul"), 0);
  compare_training(b, fused, rng, 1e-5, 1e-6);
}

// The group with broadcast inputs against finite differences (every input, the scalar and the
// per-channel ones included), on the CPU and in the emulated backward kernels, and the op checks.
TEST(FuseElementwise, AGroupWithBroadcastInputsPassesTheGradientCheck) {
  Built b = broadcast_training_graph();
  kg::Model fused(b.graph, b.outputs, kg::LoweringMode::Training);
  const int id = fused.graph().find("th");
  ASSERT_GE(id, 0);
  const kg::Node& node = fused.graph().node(id);
  ASSERT_EQ(node.op_name(), "kg.fused_elementwise");
  kg::testing::GradCheckOptions opt;
  opt.gpu = false;
  std::vector<kg::DType> dtypes(node.inputs.size(), kg::DType::F32);
  const auto report = kg::testing::check_gradients(*node.op, input_sizes(fused.graph(), node, 4), dtypes, opt);
  EXPECT_TRUE(report.ok) << report.to_string();
  std::vector<kg::Shape> shapes;
  for (int in : node.inputs) shapes.push_back(fused.graph().node(in).shape);
  const auto fwd = kg::testing::check_op(*node.op, shapes, dtypes, {.rtol = 1e-5, .atol = 1e-6, .gpu = false});
  EXPECT_TRUE(fwd.ok) << fwd.to_string();
}

// Random DAGs of fusable ops in training over values that broadcast in several ways, each from a
// linear layer so that its gradient is checked: a full tensor, a channel vector, a row and a
// scalar, plus a full input and a channel input that want no gradient.
TEST(FuseElementwise, RandomBroadcastingTrainingGraphsAgreeFusedAndUnfused) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  int broadcast_groups = 0;
  for (int trial = 0; trial < 8; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const kg::DType dt = kg::DType::F32;
    auto [x, g] = kg::SymTensor::input(dt, {kg::Dim::named("batch"), 3, 5, 4}, "x");
    auto z = g->input(dt, {1, 4}, "z");
    auto t = g->input(dt, {kg::Dim::named("batch"), 3, 5, 6}, "t");
    auto h = kg::nn::linear(x, 6, "fh");
    std::vector<kg::SymTensor> values{h,
                                      kg::reshape(kg::nn::linear(z, 3, "fc"), {3, 1, 1}, "c"),
                                      kg::nn::linear(z, 6, "frow"),
                                      kg::nn::linear(z, 1, "fs"),
                                      g->input(dt, {kg::Dim::named("batch"), 3, 5, 6}, "y"),
                                      g->input(dt, {3, 1, 1}, "c_in")};
    std::uniform_int_distribution<int> pick_op(0, 6);
    for (int k = 0; k < 8; ++k) {
      auto pick = [&] { return values[std::uniform_int_distribution<std::size_t>(0, values.size() - 1)(rng)]; };
      const std::string name = "n" + std::to_string(k);
      kg::SymTensor a = pick(), c = pick(), v;
      switch (pick_op(rng)) {
        case 0: v = kg::add(a, c, name); break;
        case 1: v = kg::sub(a, c, name); break;
        case 2: v = kg::mul(a, c, name); break;
        case 3: v = kg::div(a, kg::add(kg::mul(c, c), 1.0), name); break;
        case 4: v = kg::sigmoid(a, name); break;
        case 5: v = kg::tanh(a, name); break;
        default: v = kg::models::scaled_tanh(a, name); break;
      }
      values.push_back(v);
    }
    // The last value scaled by the channel vector and broadcast against h, so that a group reads
    // broadcast values whatever was drawn.
    auto out = kg::add(kg::mul(values.back(), values[1], "out_scale"), h, "out");
    Built b{g, {kg::mse_loss(out, t, "loss")}, {{2, 3, 5, 4}, {1, 4}, {2, 3, 5, 6}, {2, 3, 5, 6}, {3, 1, 1}}};
    kg::Model fused(b.graph, b.outputs, kg::LoweringMode::Training);
    for (int id : fused.live_nodes()) {
      const kg::Node& n = fused.graph().node(id);
      if (n.kind != kg::Node::Kind::Op || !n.op->as<kg::ops::FusedElementwiseOp>()) continue;
      broadcast_groups += std::any_of(n.inputs.begin(), n.inputs.end(),
                                      [&](int in) { return !(fused.graph().node(in).shape == n.shape); });
    }
    compare_training(b, fused, rng, 1e-4, 1e-5);
  }
  EXPECT_GE(broadcast_groups, 8);  // out_scale and out are in a group with the channel vector
}

TEST(FuseElementwise, ABadGroupDescriptionIsAnError) {
  using kg::ops::FusedElementwiseOp;
  using kg::ops::FusedMember;
  auto relu_form = [] {
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {2}, "x");
    auto y = kg::relu(x, "r");
    return std::make_pair(*g->node(y.node()).op,
                          *g->node(y.node()).op->op().elementwise_form({kg::DType::F32}));
  };
  auto [op, form] = relu_form();
  auto member = [&](std::vector<int> args) { return FusedMember{"r", op, form, std::move(args)}; };
  const auto mode = kg::LoweringMode::Inference;
  EXPECT_THROW(FusedElementwiseOp({}, 1, kg::DType::F32, mode), kg::Error);
  kg_test::expect_error([&] { FusedElementwiseOp({member({-1})}, 0, kg::DType::F32, mode); },
                        {"reads 1 to 8 inputs"});
  kg_test::expect_error([&] { FusedElementwiseOp({member({-1})}, 9, kg::DType::F32, mode); }, {"got 9"});
  kg_test::expect_error([&] { FusedElementwiseOp({member({0})}, 1, kg::DType::F32, mode); },
                        {"nn.relu @ r", "not an earlier member"});
  kg_test::expect_error([&] { FusedElementwiseOp({member({-1})}, 2, kg::DType::F32, mode); },
                        {"group input 1 is read by no member"});
  kg_test::expect_error([&] { FusedElementwiseOp({member({-1})}, 1, kg::DType::I32, mode); },
                        {"f32, f64, f16 or bf16", "not i32"});
  kg_test::expect_error(
      [&] { FusedElementwiseOp({member({-1})}, 1, kg::DType::BF16, kg::LoweringMode::Training); },
      {"bf16 group runs in inference only"});
  FusedMember no_cpu = member({-1});
  no_cpu.form.cpu = nullptr;
  kg_test::expect_error([&] { FusedElementwiseOp({no_cpu}, 1, kg::DType::F32, mode); }, {"no CPU form"});
  FusedMember no_derivative = member({-1});
  no_derivative.form.derivative.clear();
  kg_test::expect_error(
      [&] { FusedElementwiseOp({no_derivative}, 1, kg::DType::F32, kg::LoweringMode::Training); },
      {"no derivative", "cannot be fused in training"});
  // A fused op given inputs of another dtype names both.
  FusedElementwiseOp ok({member({-1})}, 1, kg::DType::F32, mode);
  kg_test::expect_error([&] { ok.infer_output_dtype({kg::DType::F64}); }, {"fused for f32", "got f64"});
}

// A user's activation after a convolution becomes the convolution's epilogue (inference), after
// the folded batch norm and the residual add: one nn.fused_conv2d, same values on the CPU and
// from the generated kernel under the emulator.
TEST(FuseElementwise, AUserActivationBecomesAConvolutionsEpilogue) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, 9, 9}, "x");
  auto y =
      user_swish(kg::nn::batch_norm2d(kg::nn::conv2d(x, 8, 3, {.padding = 1}, "conv1"), "bn1"), true, "act1");
  auto r = kg::nn::conv2d(y, 8, 3, {.padding = 1, .bias = false}, "conv2");
  auto out = user_swish(kg::add(kg::nn::batch_norm2d(r, "bn2"), y, "res"), true, "act2");
  kg::Model fused(g, {out});
  kg::Model plain(g, {out}, kg::LoweringMode::Inference, {.fusion = false});
  EXPECT_EQ(count_ops(fused, "nn.fused_conv2d"), 2);
  EXPECT_EQ(count_ops(fused, ""), 2);
  for (int id : fused.live_nodes()) {
    const kg::Node& n = fused.graph().node(id);
    if (n.kind != kg::Node::Kind::Op) continue;
    EXPECT_NE(n.op->op().attributes().find("user.swish]"), std::string::npos) << n.op->op().attributes();
  }
  const std::vector<std::vector<std::int64_t>> shapes{{2, 3, 9, 9}};
  auto mp = plain.load(kg::Device::cpu(), shapes);
  const auto params = random_params(plain, rng, 1.0);
  mp.load_state_dict(params, false);
  auto in = kg_test::random_tensor(rng, kg::DType::F32, shapes[0]);
  const auto want = mp.forward({in})[0];
  kg::LoadOptions checked;
  checked.checked = true;
  for (const kg::LoadOptions& opt : {kg::LoadOptions{}, checked}) {
    SCOPED_TRACE(opt.checked ? "emulated kernels" : "cpu");
    auto mf = fused.load(kg::Device::cpu(), shapes, opt);
    mf.load_state_dict(params, false);
    EXPECT_TRUE(kg_test::all_close(mf.forward({in})[0], want, 1e-5, 1e-5));
  }
}

// LeNet-5's custom scaled tanh after each convolution becomes its epilogue, and the two after the
// linear layers become theirs (kg.fused_gemm).
TEST(FuseElementwise, LeNetsScaledTanhIsFusedIntoItsConvolutions) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  kg::Model fused = kg::models::build("lenet5-tanh");
  kg::Model plain = kg::models::build("lenet5-tanh", kg::LoweringMode::Inference, {.fusion = false});
  EXPECT_EQ(count_ops(fused, "nn.fused_conv2d"), 2);
  EXPECT_EQ(count_ops(fused, "kg.fused_gemm"), 2);
  EXPECT_EQ(count_ops(fused, "lenet.scaled_tanh"), 0);
  EXPECT_EQ(count_ops(plain, "lenet.scaled_tanh"), 4);
  const std::vector<std::vector<std::int64_t>> shapes{kg::models::input_shape("lenet5-tanh", 3)};
  auto mp = plain.load(kg::Device::cpu(), shapes);
  auto in = kg_test::random_tensor(rng, kg::DType::F32, shapes[0]);
  const auto want = mp.forward({in})[0];
  kg::LoadOptions checked;
  checked.checked = true;
  for (const kg::LoadOptions& opt : {kg::LoadOptions{}, checked}) {
    SCOPED_TRACE(opt.checked ? "emulated kernels" : "cpu");
    auto mf = fused.load(kg::Device::cpu(), shapes, opt);
    mf.load_state_dict(mp.state_dict());
    EXPECT_TRUE(kg_test::all_close(mf.forward({in})[0], want, 1e-5, 1e-6));
  }
}

// ---- on a GPU ----

namespace {

// Fused on the GPU against unfused on the CPU, every output element written.
void compare_on_gpu(const Built& b, const std::vector<kg::Tensor>& inputs, double tol,
                    const std::map<std::string, kg::Tensor>& params = {}) {
  kg::Model fused(b.graph, b.outputs);
  kg::Model plain(b.graph, b.outputs, kg::LoweringMode::Inference, {.fusion = false});
  kg::LoadOptions poisoned;
  poisoned.poison_buffers = true;
  auto mp = plain.load(kg::Device::cpu(), b.input_shapes);
  auto mg = fused.load(kg::Device::cuda(), b.input_shapes, poisoned);
  if (!params.empty()) {
    mp.load_state_dict(params, false);
    mg.load_state_dict(params, false);
  }
  auto want = mp.forward(inputs);
  auto got = mg.forward(inputs);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("output " + std::to_string(i));
    EXPECT_TRUE(kg_test::all_written(got[i]));
    EXPECT_TRUE(kg_test::all_close(got[i], want[i], tol, tol));
  }
}

}  // namespace

TEST(FuseElementwiseGpu, GeneratedKernelsMatchTheCpu) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // The swish chain over sizes that take the packed path with and without a scalar tail.
  for (std::int64_t cols : {1, 37, 4096, 65537}) {
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), cols}, "x");
    auto y = kg::relu(kg::add(kg::mul(x, kg::sigmoid(x, "sig"), "mul"), 1.0, "plus1"), "out");
    Built b{g, {y}, {{3, cols}}};
    compare_on_gpu(b, random_inputs(rng, b, kg::DType::F32), 1e-6);
  }
  // Broadcast walks: a channel vector, a row and a scalar against a full tensor, f32 and f64.
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
    auto [x, g] = kg::SymTensor::input(dt, {kg::Dim::named("batch"), 3, 5, 6}, "x");
    auto c = g->input(dt, {3, 1, 1}, "c");
    auto row = g->input(dt, {6}, "row");
    auto s = g->input(dt, {1}, "s");
    auto y = kg::tanh(kg::add(kg::mul(x, kg::sigmoid(c, "gc"), "m"), row, "a"), "t");
    y = kg::models::scaled_tanh(kg::div(y, kg::add(kg::mul(s, s), 1.0, "s2"), "d"), "st");
    Built b{g, {y}, {{4, 3, 5, 6}, {3, 1, 1}, {6}, {1}}};
    compare_on_gpu(b, random_inputs(rng, b, dt), dt == kg::DType::F32 ? 1e-5 : 1e-12);
  }
}

TEST(FuseElementwiseGpu, TrainingGradientsMatchTheCpu) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Built b = training_graph(true);
  kg::Model fused(b.graph, b.outputs, kg::LoweringMode::Training);
  kg::Model plain(b.graph, b.outputs, kg::LoweringMode::Training, {.fusion = false});
  auto in = random_inputs(rng, b, kg::DType::F32);
  auto mp = plain.load(kg::Device::cpu(), b.input_shapes);
  auto mg = fused.load(kg::Device::cuda(), b.input_shapes);
  mg.load_state_dict(mp.state_dict());
  kg_test::expect_same_gradients(mp, mg, in, 1e-4, 1e-5);
}

// A training group with broadcast inputs (a per-channel scale and bias, a scalar, a row): the
// GPU's backward kernel and its reductions of the broadcast inputs' contributions against the
// unfused CPU graph, at a batch whose scalar reduction is split over several blocks too.
TEST(FuseElementwiseGpu, BroadcastTrainingGradientsMatchTheCpu) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t batch : {3, 2048}) {
    SCOPED_TRACE("batch " + std::to_string(batch));
    Built b = broadcast_training_graph(batch);
    kg::Model fused(b.graph, b.outputs, kg::LoweringMode::Training);
    kg::Model plain(b.graph, b.outputs, kg::LoweringMode::Training, {.fusion = false});
    ASSERT_EQ(fused_ops(fused).size(), 1u);
    auto in = random_inputs(rng, b, kg::DType::F32);
    auto mp = plain.load(kg::Device::cpu(), b.input_shapes);
    mp.load_state_dict(random_params(plain, rng, 1.0), false);
    kg::LoadOptions poisoned;
    poisoned.poison_buffers = true;
    auto mg = fused.load(kg::Device::cuda(), b.input_shapes, poisoned);
    mg.load_state_dict(mp.state_dict());
    kg_test::expect_same_gradients(mp, mg, in, 1e-4, 1e-5, /*written=*/true);
  }
}

TEST(FuseElementwiseGpu, AUserActivationEpilogueMatchesTheCpu) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 16, 12, 12}, "x");
  auto y = user_swish(kg::nn::batch_norm2d(kg::nn::conv2d(x, 32, 3, {.padding = 1}, "conv1"), "bn1"), true,
                      "act1");
  auto out = user_swish(kg::add(kg::nn::conv2d(y, 32, 3, {.padding = 1}, "conv2"), y, "res"), true, "act2");
  Built b{g, {out}, {{2, 16, 12, 12}}};
  kg::Model plain(g, {out}, kg::LoweringMode::Inference, {.fusion = false});
  const auto params = random_params(plain, rng, 0.3);
  compare_on_gpu(b, random_inputs(rng, b, kg::DType::F32), 1e-4, params);
}

// The zoo's user.swish (a user-style custom op) passes the op checks on its own, forward and
// backward, and ResNet-18 with it in place of every ReLU keeps torchvision's parameter names and
// fuses every swish into a convolution's epilogue.
TEST(FuseElementwise, ResNetWithAUserSwishFusesItIntoItsConvolutions) {
  const auto fwd = kg::testing::check_op(kg::models::swish_op(), {kg::Shape{kg::Dim::named("batch"), 33}},
                                         {kg::DType::F32}, {.gpu = false});
  EXPECT_TRUE(fwd.ok) << fwd.to_string();
  kg::testing::GradCheckOptions gopt;
  gopt.gpu = false;
  const auto bwd = kg::testing::check_gradients(kg::models::swish_op(), {{3, 7}}, {kg::DType::F64}, gopt);
  EXPECT_TRUE(bwd.ok) << bwd.to_string();

  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  kg::Model fused = kg::models::build("resnet18-swish");
  kg::Model plain = kg::models::build("resnet18-swish", kg::LoweringMode::Inference, {.fusion = false});
  kg::Model relu = kg::models::build("resnet18", kg::LoweringMode::Inference, {.fusion = false});
  std::vector<std::string> a, b;
  for (const auto& p : plain.parameters()) a.push_back(p.name);
  for (const auto& p : relu.parameters()) b.push_back(p.name);
  EXPECT_EQ(a, b);
  EXPECT_EQ(count_ops(plain, "user.swish"), 17);
  EXPECT_EQ(count_ops(fused, "user.swish"), 0);
  EXPECT_EQ(count_ops(fused, "nn.fused_conv2d"), 20);
  const std::vector<std::vector<std::int64_t>> shapes{kg::models::input_shape("resnet18-swish", 1)};
  auto mp = plain.load(kg::Device::cpu(), shapes);
  auto mf = fused.load(kg::Device::cpu(), shapes);
  mf.load_state_dict(mp.state_dict());
  auto in = kg_test::random_tensor(rng, kg::DType::F32, shapes[0]);
  EXPECT_TRUE(kg_test::all_close(mf.forward({in})[0], mp.forward({in})[0], 1e-4, 1e-5));
}
