// Recording: SymTensor handles, inputs, name scopes, unique names, and the errors of
// Graph::record (names, foreign and empty tensors, failing shape inference, dtypes).
#include <set>
#include <stdexcept>

#include "support/test_util.hpp"

using kg_test::expect_error;

namespace {

// Elementwise y = factor * x, any shape.
class ScaleOp final : public kg::CustomOp {
 public:
  explicit ScaleOp(double f) : f_(f) {}
  std::string name() const override { return "test.scale"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    if (in.empty()) throw kg::Error("expects at least 1 input, got 0");
    return in[0];
  }
  void cpu_forward(kg::CpuContext& ctx) const override {
    const float* x = ctx.inputs[0].data<float>();
    float* y = ctx.output.data<float>();
    for (std::int64_t i = 0; i < ctx.output.numel(); ++i) y[i] = static_cast<float>(f_ * x[i]);
  }

 private:
  double f_;
};

kg::SymTensor scale(const kg::SymTensor& x, double f, const std::string& name = "") {
  return x.record_custom(kg::CustomData::make<ScaleOp>(f), {}, std::nullopt, name);
}

// Shape inference that always fails, with a kg::Error or another exception type.
class FailingOp final : public kg::CustomOp {
 public:
  explicit FailingOp(bool kg_error) : kg_error_(kg_error) {}
  std::string name() const override { return "test.op"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    if (kg_error_) throw kg::Error("wants rank 3, got " + in.at(0).to_string());
    throw std::out_of_range("vector index 9 >= 2");
  }

 private:
  bool kg_error_;
};

// Output dtype: i64 (an index-producing op), unless overridden at record time.
class ArgOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.argmax"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    kg::Shape s = in.at(0);
    s[s.rank() - 1] = kg::Dim(1);
    return s;
  }
  kg::DType infer_output_dtype(const std::vector<kg::DType>& in) const override {
    if (in.at(0) == kg::DType::Bool) throw kg::Error("bool inputs have no order");
    return kg::DType::I64;
  }
};

// Takes any number of inputs (including none) and returns a fixed shape.
class SourceOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.source"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>&) const override { return kg::Shape{4}; }
};

// Owns parameters with names given at construction (to test their validation).
class ParamOp final : public kg::CustomOp {
 public:
  explicit ParamOp(std::vector<kg::ParamSpec> p) : p_(std::move(p)) {}
  std::string name() const override { return "test.params"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>&) const override { return p_; }
  std::string attributes() const override { return "n=" + std::to_string(p_.size()); }

 private:
  std::vector<kg::ParamSpec> p_;
};

}  // namespace

TEST(Graph, InputStartsAGraph) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 784});
  ASSERT_TRUE(x.valid());
  EXPECT_EQ(x.graph_ptr(), g);
  EXPECT_EQ(&x.graph(), g.get());
  EXPECT_EQ(x.dtype(), kg::DType::F32);
  EXPECT_EQ(x.shape().to_string(), "[?, 784]");
  EXPECT_EQ(x.rank(), 2u);
  EXPECT_EQ(x.name(), "input");
  EXPECT_EQ(g->nodes().size(), 1u);
  EXPECT_EQ(g->inputs(), std::vector<int>{x.node()});
  const kg::Node& n = g->node(x.node());
  EXPECT_EQ(n.kind, kg::Node::Kind::Input);
  EXPECT_EQ(n.op_name(), "input");
  EXPECT_EQ(n.label(), "[input @ input]");
  EXPECT_FALSE(n.op.has_value());

  // Further inputs through the graph, with their own dtypes, shapes and names.
  kg::SymTensor mask = g->input(kg::DType::Bool, {kg::Dim::named("batch"), 7}, "mask");
  kg::SymTensor ids = g->input(kg::DType::I64, {3}, "ids");
  EXPECT_EQ(g->inputs(), (std::vector<int>{x.node(), mask.node(), ids.node()}));
  EXPECT_EQ(mask.shape().to_string(), "[batch, 7]");
  EXPECT_EQ(mask.dtype(), kg::DType::Bool);
  EXPECT_EQ(ids.name(), "ids");
  EXPECT_EQ(g->find("mask"), mask.node());
  EXPECT_EQ(g->find("ids"), ids.node());
  EXPECT_EQ(g->find("nothing"), -1);
  // Input names are unique like every node name.
  expect_error([&] { g->input(kg::DType::F32, {2}, "mask"); }, {"'mask'", "already used", "input"});
  EXPECT_EQ(g->inputs().size(), 3u);
  // Unnamed inputs are numbered after the first, "input".
  EXPECT_EQ(g->input(kg::DType::F32, {2}).name(), "input_1");
  EXPECT_EQ(g->input(kg::DType::F32, {2}).name(), "input_2");
}

TEST(Graph, SymTensorIsAHandle) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 16}, "x");
  kg::SymTensor copy = x;
  EXPECT_EQ(copy.node(), x.node());
  EXPECT_EQ(copy.graph_ptr(), x.graph_ptr());
  // Recording through a copy appends to the one shared graph.
  kg::SymTensor y = scale(copy, 2.0);
  kg::SymTensor z = scale(x, 3.0);
  EXPECT_EQ(g->nodes().size(), 3u);
  EXPECT_EQ(y.graph_ptr(), g);
  EXPECT_EQ(z.graph_ptr(), g);
  EXPECT_EQ(g->node(y.node()).inputs, std::vector<int>{x.node()});
  EXPECT_EQ(g->node(z.node()).inputs, std::vector<int>{x.node()});
  // Nodes only refer to earlier nodes.
  for (const auto& n : g->nodes())
    for (int in : n.inputs) EXPECT_LT(in, n.id);

  // The handles keep the graph alive.
  std::weak_ptr<kg::Graph> weak = g;
  g.reset();
  ASSERT_FALSE(weak.expired());
  kg::SymTensor w = scale(y, 4.0);
  EXPECT_EQ(w.graph().nodes().size(), 4u);
  x = kg::SymTensor();
  copy = kg::SymTensor();
  y = z = w = kg::SymTensor();
  EXPECT_TRUE(weak.expired());
}

TEST(Graph, NameScopesGiveDottedNames) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 8}, "x");
  EXPECT_EQ(g->scope(), "");
  kg::SymTensor h;
  {
    kg::NameScope features(*g, "features");
    EXPECT_EQ(g->scope(), "features");
    h = kg::nn::linear(x, 6, "0");
    EXPECT_EQ(h.name(), "features.0");
    {
      kg::NameScope block(h, "block");  // from a tensor
      EXPECT_EQ(g->scope(), "features.block");
      kg::SymTensor a = scale(h, 2.0);
      EXPECT_EQ(a.name(), "features.block.scale");
      {
        kg::NameScope inner(*g, "3");
        h = kg::nn::linear(a, 4, "fc");
        EXPECT_EQ(h.name(), "features.block.3.fc");
      }
    }
    EXPECT_EQ(g->scope(), "features");
    EXPECT_EQ(scale(h, 1.0, "post").name(), "features.post");
  }
  EXPECT_EQ(g->scope(), "");
  kg::SymTensor out = kg::nn::linear(h, 2, "0");  // "0" again, but outside the scope
  EXPECT_EQ(out.name(), "0");

  // Parameter names follow the node name.
  const auto& p0 = g->node(g->find("features.0")).params;
  ASSERT_EQ(p0.size(), 2u);
  EXPECT_EQ(p0[0].name, "features.0.weight");
  EXPECT_EQ(p0[1].name, "features.0.bias");
  EXPECT_EQ(p0[0].shape, (std::vector<std::int64_t>{6, 8}));
  const auto& p1 = g->node(g->find("features.block.3.fc")).params;
  ASSERT_EQ(p1.size(), 2u);
  EXPECT_EQ(p1[0].name, "features.block.3.fc.weight");
  EXPECT_EQ(p1[0].shape, (std::vector<std::int64_t>{4, 6}));
  EXPECT_EQ(g->node(out.node()).params.at(0).name, "0.weight");

  expect_error([&] { kg::NameScope bad(*g, ""); }, {"NameScope", "empty"});
  EXPECT_EQ(g->scope(), "");
}

TEST(Graph, AutomaticNamesAreUnique) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 4}, "x");
  kg::SymTensor a = scale(x, 1.0);
  kg::SymTensor b = scale(a, 1.0);
  kg::SymTensor c = scale(b, 1.0);
  EXPECT_EQ(a.name(), "scale");
  EXPECT_EQ(b.name(), "scale_1");
  EXPECT_EQ(c.name(), "scale_2");
  // An explicit name that an automatic one would have taken pushes the automatic one further.
  kg::SymTensor d = scale(c, 1.0, "scale_3");
  kg::SymTensor e = scale(d, 1.0);
  EXPECT_EQ(e.name(), "scale_4");
  kg::SymTensor f = kg::nn::linear(e, 4);
  kg::SymTensor f2 = kg::nn::linear(f, 4);
  EXPECT_EQ(f.name(), "linear");
  EXPECT_EQ(f2.name(), "linear_1");
  {
    kg::NameScope s(*g, "blk");
    EXPECT_EQ(scale(f2, 1.0).name(), "blk.scale");
    EXPECT_EQ(scale(f2, 1.0).name(), "blk.scale_1");
  }
  // An op name without a namespace is its own stem.
  class Plain final : public kg::CustomOp {
   public:
    std::string name() const override { return "plain"; }
    kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  };
  EXPECT_EQ(x.record_custom(kg::CustomData::make<Plain>()).name(), "plain");
  EXPECT_EQ(x.record_custom(kg::CustomData::make<Plain>()).name(), "plain_1");

  std::set<std::string> names;
  for (const auto& n : g->nodes()) EXPECT_TRUE(names.insert(n.name).second) << "duplicate " << n.name;
  EXPECT_EQ(names.size(), g->nodes().size());
  for (const auto& n : g->nodes()) EXPECT_EQ(g->find(n.name), n.id);
}

TEST(Graph, DuplicateExplicitNameNamesBothNodes) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 4}, "x");
  kg::SymTensor fc = kg::nn::linear(x, 4, "fc");
  const std::size_t before = g->nodes().size();
  expect_error([&] { scale(fc, 2.0, "fc"); }, {"[test.scale @ fc]", "'fc'", "already used", "nn.linear"});
  expect_error([&] { scale(x, 2.0, "x"); }, {"[test.scale @ x]", "'x'", "already used", "input"});
  expect_error([&] { kg::nn::linear(fc, 3, "fc"); }, {"'fc'", "already used", "nn.linear"});
  {
    kg::NameScope s(*g, "blk");
    scale(x, 1.0, "a");
    expect_error([&] { scale(x, 1.0, "a"); }, {"[test.scale @ blk.a]", "'blk.a'", "test.scale"});
  }
  // Failed records leave the graph as it was.
  EXPECT_EQ(g->nodes().size(), before + 1);
  // The same short name in another scope is fine.
  kg::NameScope other(*g, "other");
  EXPECT_EQ(scale(x, 1.0, "fc").name(), "other.fc");
}

TEST(Graph, TensorFromAnotherGraphIsAnError) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 4}, "x");
  auto [y, g2] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 4}, "y");
  expect_error([&] { x.record_custom(kg::CustomData::make<ScaleOp>(1.0), {y}, std::nullopt, "mix"); },
               {"[test.scale @ mix]", "input 1", "'y'", "another graph"});
  expect_error([&] { g->record(kg::CustomData::make<ScaleOp>(1.0), {y}, std::nullopt, "mix"); },
               {"[test.scale @ mix]", "input 0", "'y'", "another graph"});
  EXPECT_EQ(g->nodes().size(), 1u);
  EXPECT_EQ(g2->nodes().size(), 1u);
}

TEST(Graph, EmptySymTensorIsAnError) {
  kg::SymTensor e;
  EXPECT_FALSE(e.valid());
  EXPECT_EQ(e.node(), -1);
  expect_error([&] { e.record_custom(kg::CustomData::make<ScaleOp>(1.0)); },
               {"empty", "default-constructed"});
  expect_error([&] { (void)e.shape(); }, {"empty"});
  expect_error([&] { (void)e.dtype(); }, {"empty"});
  expect_error([&] { (void)e.name(); }, {"empty"});
  expect_error([&] { kg::nn::linear(e, 3); }, {"empty"});
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 4}, "x");
  expect_error(
      [&] {
        x.record_custom(kg::CustomData::make<ScaleOp>(1.0), {x, e}, std::nullopt, "s");
      },
      {"[test.scale @ s]", "input 2", "empty tensor"});
  EXPECT_EQ(g->nodes().size(), 1u);
  expect_error([] { kg::CustomData d(nullptr); }, {"null op"});
}

TEST(Graph, ShapeInferenceErrorsArePrefixedWithOpAndNode) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 4}, "x");
  kg::NameScope s(*g, "head");
  expect_error([&] { x.record_custom(kg::CustomData::make<FailingOp>(true), {}, std::nullopt, "decode"); },
               {"[test.op @ head.decode] wants rank 3, got [batch, 4]"});
  // A non-kg exception from a user's op is wrapped, not let through.
  expect_error([&] { x.record_custom(kg::CustomData::make<FailingOp>(false)); },
               {"[test.op @ head.op] shape inference failed: vector index 9 >= 2"});
  // Errors from infer_output_dtype get the same prefix.
  kg::SymTensor flags = g->input(kg::DType::Bool, {2, 2}, "flags");
  expect_error([&] { flags.record_custom(kg::CustomData::make<ArgOp>(), {}, std::nullopt, "am"); },
               {"[test.argmax @ head.am] bool inputs have no order"});
  // A failed node takes nothing: the name is still free and the graph unchanged.
  const std::size_t n = g->nodes().size();
  EXPECT_EQ(scale(x, 1.0, "decode").name(), "head.decode");
  EXPECT_EQ(g->nodes().size(), n + 1);
}

TEST(Graph, OutputDtypeInferredOrExplicit) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F64, {kg::Dim::named("batch"), 5}, "x");
  // Default: the first input's dtype.
  EXPECT_EQ(scale(x, 2.0).dtype(), kg::DType::F64);
  kg::SymTensor idx = x.record_custom(kg::CustomData::make<ArgOp>(), {}, std::nullopt, "idx");
  EXPECT_EQ(idx.dtype(), kg::DType::I64);
  EXPECT_EQ(idx.shape().to_string(), "[batch, 1]");
  kg::SymTensor idx32 = x.record_custom(kg::CustomData::make<ArgOp>(), {}, kg::DType::I32, "idx32");
  EXPECT_EQ(idx32.dtype(), kg::DType::I32);
  EXPECT_EQ(g->node(idx32.node()).dtype, kg::DType::I32);
  // An explicit dtype bypasses infer_output_dtype, which would reject a bool input.
  kg::SymTensor flags = g->input(kg::DType::Bool, {3, 4}, "flags");
  EXPECT_EQ(flags.record_custom(kg::CustomData::make<ArgOp>(), {}, kg::DType::I16).dtype(), kg::DType::I16);
  EXPECT_EQ(kg::CustomData::make<SourceOp>()->infer_output_dtype({kg::DType::U8}), kg::DType::U8);
  expect_error([&] { g->record(kg::CustomData::make<SourceOp>(), {}, std::nullopt, "src"); },
               {"[test.source @ src]", "no inputs", "output dtype"});
  kg::SymTensor src = g->record(kg::CustomData::make<SourceOp>(), {}, kg::DType::F32, "src");
  EXPECT_EQ(src.dtype(), kg::DType::F32);
  EXPECT_TRUE(g->node(src.node()).inputs.empty());
  EXPECT_EQ(src.shape().to_string(), "[4]");
}

TEST(Graph, ParameterSpecsAreValidated) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 4}, "x");
  using PS = std::vector<kg::ParamSpec>;
  kg::SymTensor ok =
      x.record_custom(kg::CustomData::make<ParamOp>(
                          PS{{"w", {2, 3}, kg::DType::F32, kg::ParamInit::constant(1), true},
                             {"running_mean", {3}, kg::DType::F32, kg::ParamInit::constant(0), false}}),
                      {}, std::nullopt, "p");
  const auto& params = g->node(ok.node()).params;
  ASSERT_EQ(params.size(), 2u);
  EXPECT_EQ(params[0].name, "p.w");
  EXPECT_EQ(params[1].name, "p.running_mean");
  EXPECT_FALSE(params[1].trainable);
  expect_error(
      [&] {
        x.record_custom(kg::CustomData::make<ParamOp>(PS{{"w", {2}}, {"w", {3}}}), {}, std::nullopt, "q");
      },
      {"[test.params @ q]", "unique", "'q.w'"});
  expect_error(
      [&] {
        x.record_custom(kg::CustomData::make<ParamOp>(PS{{"", {2}}}), {}, std::nullopt, "q");
      },
      {"[test.params @ q] parameter 0 has an empty name"});
  expect_error(
      [&] {
        x.record_custom(kg::CustomData::make<ParamOp>(PS{{"w", {2, -1}}}), {}, std::nullopt, "q");
      },
      {"[test.params @ q]", "'q.w'", "negative"});
  // Init data must be exactly shape × dtype size: checked when the op is recorded, naming the
  // parameter (too short, too long, and of another element type's width).
  kg::SymTensor data_ok = x.record_custom(
      kg::CustomData::make<ParamOp>(
          PS{{"w", {2, 2}, kg::DType::F32, kg::ParamInit::from_values(std::vector<float>{1, 2, 3, 4}), true}}),
      {}, std::nullopt, "d");
  const auto& dp = g->node(data_ok.node()).params;
  ASSERT_EQ(dp.size(), 1u);
  EXPECT_EQ(dp[0].init.data.size(), 16u);
  expect_error(
      [&] {
        x.record_custom(kg::CustomData::make<ParamOp>(PS{
                            {"w", {4}, kg::DType::F32, kg::ParamInit::from_values(std::vector<float>{1, 2, 3}), true}}),
                        {}, std::nullopt, "q");
      },
      {"[test.params @ q] parameter 'q.w'", "init data is 12 bytes", "[4]", "f32", "needs 16"});
  expect_error(
      [&] {
        x.record_custom(
            kg::CustomData::make<ParamOp>(PS{{"b", {2}, kg::DType::F32,
                                              kg::ParamInit::from_values(std::vector<float>{1, 2, 3}), false}}),
            {}, std::nullopt, "q");
      },
      {"[test.params @ q] parameter 'q.b'", "init data is 12 bytes", "[2]", "needs 8"});
  expect_error(
      [&] {
        x.record_custom(kg::CustomData::make<ParamOp>(PS{{"w", {3}, kg::DType::F32,
                                                          kg::ParamInit::from_values(std::vector<double>{1, 2, 3}),
                                                          true}}),
                        {}, std::nullopt, "q");
      },
      {"[test.params @ q] parameter 'q.w'", "init data is 24 bytes", "[3]", "needs 12"});
  EXPECT_EQ(g->nodes().size(), 3u);
}

// parameters() is given the inputs' recorded shapes, so a parameter can follow them.
class BiasOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.bias"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>& in) const override {
    seen_.push_back(in);
    const kg::Dim& c = in.at(0)[in.at(0).rank() - 1];
    if (!c.is_static()) throw kg::Error("the last dim must be static, got " + in.at(0).to_string());
    return {{"bias", {c.size()}, kg::DType::F32, kg::ParamInit::constant(0.5), true}};
  }
  mutable std::vector<std::vector<kg::Shape>> seen_;
};

TEST(Graph, ParametersFollowTheRecordedInputShapes) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 7}, "x");
  auto op = std::make_shared<BiasOp>();
  kg::SymTensor y = x.record_custom(kg::CustomData(op), {}, std::nullopt, "b");
  ASSERT_EQ(op->seen_.size(), 1u);
  ASSERT_EQ(op->seen_[0].size(), 1u);
  EXPECT_EQ(op->seen_[0][0].to_string(), "[batch, 7]");
  const auto& p = g->node(y.node()).params;
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].name, "b.bias");
  EXPECT_EQ(p[0].shape, (std::vector<std::int64_t>{7}));
  kg::Model m(g, {y});
  ASSERT_EQ(m.parameters().size(), 1u);
  EXPECT_EQ(m.parameters()[0].name, "b.bias");
  EXPECT_EQ(m.parameters()[0].shape, (std::vector<std::int64_t>{7}));
  // An error from parameters() names the op and the node.
  auto [z, g2] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), kg::dynamic}, "z");
  expect_error([&] { z.record_custom(kg::CustomData::make<BiasOp>(), {}, std::nullopt, "b"); },
               {"[test.bias @ b]", "the last dim must be static", "[batch, ?]"});
}

TEST(Graph, CustomDataHandle) {
  kg::CustomData d = kg::CustomData::make<ParamOp>(std::vector<kg::ParamSpec>{{"w", {1}}});
  kg::CustomData copy = d;
  EXPECT_EQ(&copy.op(), &d.op());
  EXPECT_EQ(d.name(), "test.params");
  EXPECT_NE(d.as<ParamOp>(), nullptr);
  EXPECT_EQ(d.as<ScaleOp>(), nullptr);
  std::ostringstream os;
  os << d << " " << kg::CustomData::make<ScaleOp>(1.0);
  EXPECT_EQ(os.str(), "test.params(n=1) test.scale");
  // A custom op with no CPU implementation says so.
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {2}, "x");
  kg::Tensor in = kg::Tensor::zeros(kg::DType::F32, {2});
  kg::Tensor out = kg::Tensor::zeros(kg::DType::F32, {2});
  kg::CpuContext ctx({&in, 1}, {}, out, false, 0);
  expect_error([&] { kg::CustomData::make<SourceOp>()->cpu_forward(ctx); }, {"has no CPU implementation"});
}

TEST(Graph, AddNodeChecksInputsAndNames) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 4}, "x");
  kg::SymTensor a = scale(x, 1.0, "a");
  kg::Node n = g->node(a.node());
  n.name = "b";
  int id = g->add_node(n);
  EXPECT_EQ(id, 2);
  EXPECT_EQ(g->node(id).name, "b");
  EXPECT_EQ(g->find("b"), 2);
  kg::Node dup = n;
  expect_error([&] { g->add_node(dup); }, {"[test.scale @ b]", "name already used"});
  kg::Node fwd = n;
  fwd.name = "c";
  fwd.inputs = {5};
  expect_error([&] { g->add_node(fwd); }, {"[test.scale @ c]", "input 5", "not an earlier node"});
  kg::Node in = g->node(x.node());
  in.name = "x2";
  expect_error([&] { g->add_node(in); }, {"only op nodes"});
  EXPECT_EQ(g->nodes().size(), 3u);
}
