// CustomOp::split: a convolution with a bias, declared as one node, runs as the convolution and a
// separately named bias node whose parameter keeps the declared name, so weights load by it.
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

// y[n, c, ...] = x[n, c, ...] + bias[c], the bias its parameter.
class BiasAdd final : public kg::CustomOp {
 public:
  explicit BiasAdd(std::int64_t channels) : c_(channels) {}
  std::string name() const override { return "test.bias_add"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>&) const override {
    return {{"bias", {c_}, kg::DType::F32, kg::ParamInit::constant(0.0), true}};
  }
  void cpu_forward(kg::CpuContext& ctx) const override {
    const auto& s = ctx.output.shape();
    const std::int64_t inner = ctx.output.numel() / (s[0] * c_);
    const float* x = ctx.inputs[0].data<float>();
    const float* b = ctx.params[0].data<float>();
    float* y = ctx.output.data<float>();
    for (std::int64_t i = 0; i < ctx.output.numel(); ++i) y[i] = x[i] + b[(i / inner) % c_];
  }

 private:
  std::int64_t c_;
};

// What `split` does: 0 the conv and the bias node; 1 forgets the bias; 2 gives the wrong shape;
// 3 leaves the bias parameter under the bias node's name; 4 has the conv's own bias as well, so the
// bias node's parameter is one the node does not declare.
class ConvBias final : public kg::CustomOp {
 public:
  ConvBias(std::int64_t in, std::int64_t out, std::int64_t k, int variant = 0)
      : in_(in), out_(out), k_(k), variant_(variant) {}
  std::string name() const override { return "test.conv_bias"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    const kg::Shape& s = in.at(0);
    return {s[0], out_, s[2].size() - k_ + 1, s[3].size() - k_ + 1};
  }
  std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>&) const override {
    return {{"weight", {out_, in_, k_, k_}, kg::DType::F32, kg::ParamInit::uniform(-0.3, 0.3), true},
            {"bias", {out_}, kg::DType::F32, kg::ParamInit::uniform(-0.1, 0.1), true}};
  }
  kg::SymTensor split(const std::vector<kg::SymTensor>& in, const std::string& name) const override {
    // The convolution takes the node's name, so its weight is "<name>.weight" as declared.
    kg::SymTensor y =
        kg::nn::conv2d(in[0], variant_ == 2 ? out_ + 1 : out_, k_, {.bias = variant_ == 4}, name);
    if (variant_ == 1) return y;
    // The bias node gets its own name; its parameter is renamed to the declared "<name>.bias".
    kg::SymTensor b = y.record_custom(kg::CustomData::make<BiasAdd>(variant_ == 2 ? out_ + 1 : out_), {},
                                      std::nullopt, name + ".bias_add");
    if (variant_ != 3 && variant_ != 4)
      y.graph().bind_param(b.node(), 0, name + ".bias", kg::ParamInit::constant(0.0));
    return b;
  }

 private:
  std::int64_t in_, out_, k_;
  int variant_;
};

}  // namespace

TEST(SplitNodes, AConvWithBiasRunsAsTwoNodesAndLoadsByTheDeclaredNames) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, 9, 9}, "x");
  auto y = kg::relu(x.record_custom(kg::CustomData::make<ConvBias>(3, 5, 3), {}, std::nullopt, "c"), "r");
  // Recorded: one node owning both parameters.
  const kg::Node& rec = g->node(y.node() - 1);
  ASSERT_EQ(rec.params.size(), 2u);
  EXPECT_EQ(rec.params[1].name, "c.bias");
  for (bool fusion : {true, false}) {
    SCOPED_TRACE(fusion ? "fusion" : "no fusion");
    kg::Model m(g, {y}, kg::LoweringMode::Inference, {.fusion = fusion});
    // Run: the convolution named "c" and the bias node "c.bias_add" owning "c.bias".
    const int conv = m.graph().find("c"), bias = m.graph().find("c.bias_add");
    ASSERT_GE(conv, 0);
    ASSERT_GE(bias, 0);
    EXPECT_EQ(m.graph().node(conv).op_name(), "nn.conv2d");
    ASSERT_EQ(m.graph().node(bias).params.size(), 1u);
    EXPECT_EQ(m.graph().node(bias).params[0].name, "c.bias");
    std::vector<std::string> names;
    for (const auto& p : m.parameters()) names.push_back(p.name);
    EXPECT_EQ(names, (std::vector<std::string>{"c.weight", "c.bias"}));
    // The declared initialisation is kept: the bias is not the split's zeros.
    auto loaded = m.load(kg::Device::cpu(), {{2, 3, 9, 9}});
    bool nonzero = false;
    const kg::Tensor b0 = loaded.parameter("c.bias");
    for (std::int64_t i = 0; i < b0.numel(); ++i) nonzero = nonzero || b0.item(i) != 0.0;
    EXPECT_TRUE(nonzero);
    // Weights by the declared names give what a conv2d with a bias gives.
    auto weight = kg_test::random_tensor(rng, kg::DType::F32, {5, 3, 3, 3});
    auto bias_t = kg_test::random_tensor(rng, kg::DType::F32, {5});
    loaded.load_state_dict({{"c.weight", weight}, {"c.bias", bias_t}});
    auto [rx, rg] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, 9, 9}, "x");
    kg::Model ref(rg, {kg::relu(kg::nn::conv2d(rx, 5, 3, {}, "c"), "r")});
    auto rm = ref.load(kg::Device::cpu(), {{2, 3, 9, 9}});
    rm.load_state_dict({{"c.weight", weight}, {"c.bias", bias_t}});
    auto in = kg_test::random_tensor(rng, kg::DType::F32, {2, 3, 9, 9});
    EXPECT_TRUE(kg_test::all_close(loaded.forward({in})[0], rm.forward({in})[0], 1e-5, 1e-6));
  }
}

TEST(SplitNodes, ASplitThatLosesOrChangesSomethingIsAnError) {
  auto make = [](int variant) {
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, 9, 9}, "x");
    auto y = x.record_custom(kg::CustomData::make<ConvBias>(3, 5, 3, variant), {}, std::nullopt, "c");
    kg::Model m(g, {y});
  };
  kg_test::expect_error([&] { make(1); },
                        {"[test.conv_bias @ c] split", "parameter 'c.bias' is in no node", "c.weight"});
  kg_test::expect_error([&] { make(2); }, {"[test.conv_bias @ c] split", "[batch, 6, 7, 7] f32",
                                           "the node's is [batch, 5, 7, 7] f32"});
  kg_test::expect_error([&] { make(3); }, {"[test.conv_bias @ c] split", "parameter 'c.bias' is in no node",
                                           "c.bias_add.bias", "Graph::bind_param"});
  kg_test::expect_error([&] { make(4); },
                        {"[test.conv_bias @ c] split", "parameter 'c.bias_add.bias' is not one",
                         "keeps the node's parameters"});
}
