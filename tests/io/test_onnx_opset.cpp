// Opsets 19 to 21 of the standard domain: files that import them are accepted, and the ops whose
// semantics changed in them follow their new versions (Gelu, a new op of opset 20, in both
// approximations; Cast with saturate; GroupNormalization 18 and 21, scale and bias per group or
// per channel; ReduceMax and ReduceMin of bool from opset 20; Reshape at opset 21). Each value is
// checked against a naive reference computed here. A newer opset, an op the importer does not
// know and a type it does not have are refused with what to do. Models are built with the
// protobuf schema.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kg/onnx.hpp"
#include "support/onnx_builder.hpp"
#include "support/test_util.hpp"

using kg_test::OnnxBuilder;

namespace {

kg::Tensor random_f32(std::mt19937_64& rng, std::vector<std::int64_t> shape, double lo = -3.0, double hi = 3.0) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  std::uniform_real_distribution<float> u(static_cast<float>(lo), static_cast<float>(hi));
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = u(rng);
  return kg::Tensor::from_vector<float>(std::move(shape), v);
}

kg::Tensor i64s(std::vector<std::int64_t> v) {
  const auto n = static_cast<std::int64_t>(v.size());
  return kg::Tensor::from_vector<std::int64_t>({n}, v);
}

kg::Model import_model(const OnnxBuilder& m, const std::string& name = "opset.onnx") {
  return kg::onnx::import_bytes(m.bytes(), name);
}

// Runs a one-input model on the CPU (buffers poisoned: an element left unwritten shows).
kg::Tensor run1(const kg::Model& model, const kg::Tensor& x) {
  kg::LoadOptions o;
  o.poison_buffers = true;
  kg::LoadedModel lm = model.load(kg::Device::cpu(), {x.shape()}, o);
  return lm.forward({x}).at(0);
}

std::vector<double> values_of(const kg::Tensor& t) {
  std::vector<double> v;
  for (std::int64_t i = 0; i < t.numel(); ++i) v.push_back(t.item(i));
  return v;
}

// Every element equal to the expected one (infinities included, which a tolerance cannot compare).
void expect_exactly(const kg::Tensor& got, const std::vector<double>& want) {
  ASSERT_EQ(got.numel(), static_cast<std::int64_t>(want.size()));
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got.item(static_cast<std::int64_t>(i)), want[i]) << "element " << i;
}

// A model of one node of `op` reading x (f32 [2, 5]) and writing y.
OnnxBuilder one_node(int opset, const std::string& op, kg::DType out = kg::DType::F32) {
  OnnxBuilder m(opset);
  m.input("x", kg::DType::F32, {std::int64_t{2}, std::int64_t{5}});
  m.node(op, {"x"}, {"y"}, "/" + op);
  m.output("y", out);
  return m;
}

}  // namespace

// A plain model at each opset the importer now knows imports and runs.
TEST(OnnxOpset, OpsetsNineteenToTwentyOneAreAccepted) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  for (int opset : {19, 20, 21}) {
    SCOPED_TRACE(opset);
    const kg::Model model = import_model(one_node(opset, "Relu"));
    const kg::Tensor x = random_f32(rng, {2, 5});
    std::vector<double> want;
    for (double v : values_of(x)) want.push_back(std::max(v, 0.0));
    EXPECT_TRUE(kg_test::matches(run1(model, x), want, 0.0, 0.0));
  }
}

// Gelu (opset 20): "none" is 0.5 x (1 + erf(x/√2)), "tanh" 0.5 x (1 + tanh(√(2/π)(x + 0.044715 x³))),
// each against the formula in double; an unknown approximation, and Gelu at opset 18 (where the
// standard has no such op), are refused.
TEST(OnnxOpset, GeluMatchesBothFormulas) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  const double k = std::sqrt(2.0 / M_PI);
  for (int opset : {20, 21}) {
    for (const std::string approx : {"", "none", "tanh"}) {
      SCOPED_TRACE(opset);
      SCOPED_TRACE("approximate '" + approx + "'");
      OnnxBuilder m = one_node(opset, "Gelu");
      if (!approx.empty()) OnnxBuilder::attr(*m.graph().mutable_node(0), "approximate", approx);
      const kg::Model model = import_model(m);
      const kg::Tensor x = random_f32(rng, {2, 5}, -6.0, 6.0);
      std::vector<double> want;
      for (double v : values_of(x)) {
        const double f = static_cast<double>(static_cast<float>(v));
        want.push_back(approx == "tanh" ? 0.5 * f * (1.0 + std::tanh(k * (f + 0.044715 * f * f * f)))
                                        : 0.5 * f * (1.0 + std::erf(f / std::sqrt(2.0))));
      }
      EXPECT_TRUE(kg_test::matches(run1(model, x), want, 1e-5, 1e-6));
    }
  }
  OnnxBuilder fast = one_node(20, "Gelu");
  OnnxBuilder::attr(*fast.graph().mutable_node(0), "approximate", std::string("fast"));
  kg_test::expect_error([&] { import_model(fast); }, {"Gelu", "approximate 'fast'", "\"none\" or \"tanh\""});
  kg_test::expect_error([&] { import_model(one_node(18, "Gelu")); }, {"Gelu", "opset 20 and later", "imports opset 18"});
}

// Cast and CastLike at opset 19 take saturate, which only applies to float 8 targets: f32 to f16
// still overflows to ±inf with saturate 1 or 0, f32 to i32 truncates and to bool tests for zero.
// A float 8 or 4-bit target is refused by its name; saturate 2 is refused.
TEST(OnnxOpset, CastWithSaturateConvertsAsTheStandardSays) {
  const std::vector<float> xs{1.5f, -2.25f, 1e5f, -1e5f, 65504.0f, 0.0f, -0.75f, 3.99f, -3.99f, 1e-30f};
  const kg::Tensor x = kg::Tensor::from_vector<float>({2, 5}, xs);
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    kg::DType to;
    int onnx_to;
    std::vector<double> want;
  };
  const std::vector<Case> cases{
      {kg::DType::F16, 10, {1.5, -2.25, inf, -inf, 65504.0, 0.0, -0.75, 3.990234375, -3.990234375, 0.0}},
      {kg::DType::I32, 6, {1, -2, 100000, -100000, 65504, 0, 0, 3, -3, 0}},
      {kg::DType::Bool, 9, {1, 1, 1, 1, 1, 0, 1, 1, 1, 1}},
  };
  for (int opset : {19, 21}) {
    for (std::int64_t saturate : {0, 1}) {
      for (const Case& k : cases) {
        SCOPED_TRACE(testing::Message() << "opset " << opset << " saturate " << saturate << " to "
                                        << kg::dtype_name(k.to));
        OnnxBuilder m = one_node(opset, "Cast", k.to);
        OnnxBuilder::attr(*m.graph().mutable_node(0), "to", std::int64_t{k.onnx_to});
        OnnxBuilder::attr(*m.graph().mutable_node(0), "saturate", saturate);
        const kg::Tensor y = run1(import_model(m), x);
        EXPECT_EQ(y.dtype(), k.to);
        expect_exactly(y, k.want);
      }
    }
  }
  {
    // CastLike takes the target's dtype from its second input.
    OnnxBuilder m(19);
    m.input("x", kg::DType::F32, {std::int64_t{2}, std::int64_t{5}});
    m.initializer("like", kg::Tensor::from_vector<std::int32_t>({1}, {0}));
    auto& n = m.node("CastLike", {"x", "like"}, {"y"}, "/castlike");
    OnnxBuilder::attr(n, "saturate", std::int64_t{1});
    m.output("y", kg::DType::I32);
    expect_exactly(run1(import_model(m), x), cases[1].want);
  }
  for (const auto& [code, name] : std::vector<std::pair<int, std::string>>{{17, "FLOAT8E4M3FN"}, {19, "FLOAT8E5M2"},
                                                                          {21, "UINT4"}, {22, "INT4"}}) {
    OnnxBuilder m = one_node(21, "Cast");
    OnnxBuilder::attr(*m.graph().mutable_node(0), "to", std::int64_t{code});
    kg_test::expect_error([&] { import_model(m); }, {"/Cast", "casts to " + name, "not supported", "no float 8, 4-bit"});
  }
  OnnxBuilder bad = one_node(19, "Cast");
  OnnxBuilder::attr(*bad.graph().mutable_node(0), "to", std::int64_t{1});
  OnnxBuilder::attr(*bad.graph().mutable_node(0), "saturate", std::int64_t{2});
  kg_test::expect_error([&] { import_model(bad); }, {"/Cast", "saturate 2", "0 or 1"});
}

namespace {

// GroupNormalization by its definition, in double: x [N, C, S] (S the product of the spatial
// dims), `groups` groups of C/groups channels; scale and bias per channel (`per_channel`) or per
// group.
std::vector<double> group_norm_reference(const kg::Tensor& x, std::int64_t groups, const kg::Tensor& scale,
                                         const kg::Tensor& bias, double eps, bool per_channel) {
  const std::int64_t n = x.dim(0), c = x.dim(1), s = x.numel() / (n * c), cg = c / groups;
  std::vector<double> y(static_cast<std::size_t>(x.numel()));
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t g = 0; g < groups; ++g) {
      const std::int64_t first = (i * c + g * cg) * s, count = cg * s;
      double mean = 0.0, var = 0.0;
      for (std::int64_t k = 0; k < count; ++k) mean += x.item(first + k);
      mean /= static_cast<double>(count);
      for (std::int64_t k = 0; k < count; ++k) var += (x.item(first + k) - mean) * (x.item(first + k) - mean);
      var /= static_cast<double>(count);
      for (std::int64_t k = 0; k < count; ++k) {
        const std::int64_t ch = g * cg + k / s, a = per_channel ? ch : g;
        y[static_cast<std::size_t>(first + k)] =
            (x.item(first + k) - mean) / std::sqrt(var + eps) * scale.item(a) + bias.item(a);
      }
    }
  return y;
}

OnnxBuilder group_norm_model(int opset, std::int64_t groups, const kg::Tensor& scale, const kg::Tensor& bias,
                             const std::vector<OnnxBuilder::DimSpec>& dims, float eps) {
  OnnxBuilder m(opset);
  m.input("x", kg::DType::F32, dims);
  m.initializer("gn.scale", scale);
  m.initializer("gn.bias", bias);
  auto& n = m.node("GroupNormalization", {"x", "gn.scale", "gn.bias"}, {"y"}, "/gn");
  OnnxBuilder::attr(n, "num_groups", groups);
  OnnxBuilder::attr(n, "epsilon", eps);
  m.output("y");
  return m;
}

}  // namespace

// GroupNormalization 21 (scale and bias per channel, stash_type) and 18 (per group), on 4-D and
// 3-D inputs with a dynamic batch, against the definition. Mismatched scales and groups that do
// not divide the channels are refused.
TEST(OnnxOpset, GroupNormalizationFollowsVersions18And21) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  const std::int64_t channels = 6;
  for (const auto& [opset, groups] : std::vector<std::pair<int, std::int64_t>>{{21, 3}, {21, 2}, {21, 6}, {18, 3}, {20, 1}}) {
    for (bool four_d : {true, false}) {
      SCOPED_TRACE(testing::Message() << "opset " << opset << " groups " << groups << (four_d ? " 4-D" : " 3-D"));
      const bool per_channel = opset >= 21;
      const std::int64_t affine = per_channel ? channels : groups;
      const kg::Tensor scale = random_f32(rng, {affine}, 0.5, 2.0), bias = random_f32(rng, {affine});
      std::vector<OnnxBuilder::DimSpec> dims{std::string("batch"), channels, std::int64_t{3}};
      if (four_d) dims.push_back(std::int64_t{4});
      OnnxBuilder m = group_norm_model(opset, groups, scale, bias, dims, 1e-3f);
      if (opset >= 21) OnnxBuilder::attr(*m.graph().mutable_node(0), "stash_type", std::int64_t{1});
      const kg::Model model = import_model(m);
      for (std::int64_t batch : {1, 3}) {
        std::vector<std::int64_t> shape{batch, channels, 3};
        if (four_d) shape.push_back(4);
        const kg::Tensor x = random_f32(rng, shape);
        const auto want = group_norm_reference(x, groups, scale, bias, static_cast<double>(1e-3f), per_channel);
        EXPECT_TRUE(kg_test::matches(run1(model, x), want, 1e-4, 1e-5));
      }
    }
  }
  {
    // f16 (the normalisation runs in f32, stash_type 1): against the definition on the f16 values.
    SCOPED_TRACE("f16");
    const kg::Tensor scale = random_f32(rng, {channels}, 0.5, 2.0).to(kg::DType::F16),
                     bias = random_f32(rng, {channels}).to(kg::DType::F16);
    OnnxBuilder m(21);
    m.input("x", kg::DType::F16, {std::string("batch"), channels, std::int64_t{4}});
    m.initializer("gn.scale", scale);
    m.initializer("gn.bias", bias);
    auto& n = m.node("GroupNormalization", {"x", "gn.scale", "gn.bias"}, {"y"}, "/gn");
    OnnxBuilder::attr(n, "num_groups", std::int64_t{2});
    m.output("y", kg::DType::F16);
    const kg::Tensor x = random_f32(rng, {2, channels, 4}).to(kg::DType::F16);
    const kg::Tensor y = run1(import_model(m), x);
    EXPECT_EQ(y.dtype(), kg::DType::F16);
    EXPECT_TRUE(kg_test::matches(y, group_norm_reference(x, 2, scale, bias, 1e-5, true), 2e-3, 2e-3));
  }
  const kg::Tensor s3 = random_f32(rng, {3}), s6 = random_f32(rng, {6});
  const std::vector<OnnxBuilder::DimSpec> dims{std::string("batch"), channels, std::int64_t{5}};
  kg_test::expect_error([&] { import_model(group_norm_model(21, 3, s3, s3, dims, 1e-5f)); },
                        {"/gn", "scale of [6] (one per channel at opset 21), got [3]"});
  kg_test::expect_error([&] { import_model(group_norm_model(18, 3, s6, s6, dims, 1e-5f)); },
                        {"/gn", "scale of [3] (one per group at opset 18), got [6]"});
  kg_test::expect_error([&] { import_model(group_norm_model(21, 4, s6, s6, dims, 1e-5f)); },
                        {"/gn", "num_groups 4", "does not divide the 6 channels"});
}

// ReduceMax and ReduceMin of bool (opset 20: False < True, so any and all), with the axes as an
// input; f32 at opset 20 as before; bool at opset 18 is refused.
TEST(OnnxOpset, ReduceMaxAndMinTakeBoolAtOpset20) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  const std::int64_t rows = 4, cols = 5;
  auto model = [&](int opset, const std::string& op, kg::DType dt) {
    OnnxBuilder m(opset);
    m.input("x", dt, {std::string("batch"), cols});
    m.initializer("axes", i64s({1}));
    auto& n = m.node(op, {"x", "axes"}, {"y"}, "/reduce");
    OnnxBuilder::attr(n, "keepdims", std::int64_t{0});
    m.output("y", dt);
    return m;
  };
  kg::Tensor b = kg::Tensor::empty(kg::DType::Bool, {rows, cols});
  auto* p = static_cast<std::uint8_t*>(b.raw());
  for (std::int64_t i = 0; i < rows * cols; ++i) p[i] = 0;
  for (std::int64_t j = 0; j < cols; ++j) p[1 * cols + j] = 1;  // row 1 all true
  p[2 * cols + 3] = 1;                                          // row 2 one true
  for (std::int64_t i = 0; i < rows * cols; ++i)
    if (i >= 3 * cols) p[i] = rng() % 2;
  for (const std::string op : {"ReduceMax", "ReduceMin"}) {
    SCOPED_TRACE(op);
    const kg::Tensor y = run1(import_model(model(20, op, kg::DType::Bool)), b);
    EXPECT_EQ(y.dtype(), kg::DType::Bool);
    std::vector<double> want;
    for (std::int64_t i = 0; i < rows; ++i) {
      bool any = false, all = true;
      for (std::int64_t j = 0; j < cols; ++j) {
        any = any || p[i * cols + j];
        all = all && p[i * cols + j];
      }
      want.push_back(op == "ReduceMax" ? any : all);
    }
    EXPECT_TRUE(kg_test::matches(y, want, 0.0, 0.0));
    const kg::Tensor x = random_f32(rng, {rows, cols});
    std::vector<double> fwant;
    for (std::int64_t i = 0; i < rows; ++i) {
      double r = x.item(i * cols);
      for (std::int64_t j = 1; j < cols; ++j)
        r = op == "ReduceMax" ? std::max(r, x.item(i * cols + j)) : std::min(r, x.item(i * cols + j));
      fwant.push_back(r);
    }
    EXPECT_TRUE(kg_test::matches(run1(import_model(model(20, op, kg::DType::F32)), x), fwant, 0.0, 0.0));
    kg_test::expect_error([&] { import_model(model(18, op, kg::DType::Bool)); },
                          {"/reduce", "bool input from opset 20", "imports opset 18"});
  }
}

// Reshape at opset 21 (new types only): [batch, 3, 4] to [0, -1] and, with allowzero, to an
// explicit shape; the data keeps its order.
TEST(OnnxOpset, ReshapeAtOpset21KeepsTheData) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  for (std::int64_t allowzero : {0, 1}) {
    SCOPED_TRACE(allowzero);
    OnnxBuilder m(21);
    m.input("x", kg::DType::F32, {std::string("batch"), std::int64_t{3}, std::int64_t{4}});
    m.initializer("shape", allowzero ? i64s({2, 12}) : i64s({0, -1}));
    auto& n = m.node("Reshape", {"x", "shape"}, {"y"}, "/reshape");
    OnnxBuilder::attr(n, "allowzero", allowzero);
    m.output("y");
    const kg::Tensor x = random_f32(rng, {2, 3, 4});
    const kg::Tensor y = run1(import_model(m), x);
    EXPECT_EQ(y.shape(), (std::vector<std::int64_t>{2, 12}));
    EXPECT_TRUE(kg_test::matches(y, values_of(x), 0.0, 0.0));
  }
}

// A file of a newer opset than the importer knows says what to do; so does an op it has no
// converter for (DFT and GridSample are ops of opset 20; ImageDecoder too).
TEST(OnnxOpset, ANewerOpsetOrAnUnknownOpIsRefusedWithWhatToDo) {
  kg_test::expect_error([&] { import_model(one_node(22, "Relu"), "new.onnx"); },
                        {"new.onnx", "imports opset 22 of the standard domain", "knows opsets 1 to 21",
                         "opset_version=21", "onnx.version_converter.convert_version(model, 21)"});
  for (const std::string op : {"DFT", "GridSample", "ImageDecoder", "NoSuchOp"}) {
    kg_test::expect_error([&] { import_model(one_node(21, op)); },
                          {"opset.onnx", "1 op type(s) cannot be imported", "ai.onnx " + op + ": 1 node(s), first '/" + op + "'",
                           "no converter for these ai.onnx ops", "kg::onnx::supported_ops()", "kg::onnx::OpRegistry"});
  }
}

// Pad's wrap mode (opset 19) against the wrapped indices; IsInf and IsNaN of a bf16 input
// (opset 20) against std::isinf and std::isnan.
TEST(OnnxOpset, PadWrapAndBf16IsInfAndIsNaN) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  {
    OnnxBuilder m(19);
    m.input("x", kg::DType::F32, {std::int64_t{2}, std::int64_t{3}});
    m.initializer("pads", i64s({0, 1, 0, 2}));
    auto& n = m.node("Pad", {"x", "pads"}, {"y"}, "/pad");
    OnnxBuilder::attr(n, "mode", std::string("wrap"));
    m.output("y");
    const kg::Tensor x = random_f32(rng, {2, 3});
    const kg::Tensor y = run1(import_model(m), x);
    ASSERT_EQ(y.shape(), (std::vector<std::int64_t>{2, 6}));
    std::vector<double> want;
    for (std::int64_t r = 0; r < 2; ++r)
      for (std::int64_t j = -1; j < 5; ++j) want.push_back(x.item(r * 3 + (j + 3) % 3));
    EXPECT_TRUE(kg_test::matches(y, want, 0.0, 0.0));
  }
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> xs{1.0f, inf, -inf, nan, 0.0f, -2.5f};
  const kg::Tensor x = kg::Tensor::from_vector<float>({2, 3}, xs).to(kg::DType::BF16);
  for (const std::string op : {"IsInf", "IsNaN"}) {
    SCOPED_TRACE(op);
    OnnxBuilder m(20);
    auto* in = m.graph().add_input();
    in->set_name("x");
    auto* tt = in->mutable_type()->mutable_tensor_type();
    tt->set_elem_type(::onnx::TensorProto::BFLOAT16);
    tt->mutable_shape()->add_dim()->set_dim_value(2);
    tt->mutable_shape()->add_dim()->set_dim_value(3);
    m.node(op, {"x"}, {"y"}, "/" + op);
    m.output("y", kg::DType::Bool);
    const kg::Tensor y = run1(import_model(m), x);
    EXPECT_EQ(y.dtype(), kg::DType::Bool);
    std::vector<double> want;
    for (float v : xs) want.push_back(op == "IsInf" ? std::isinf(v) : std::isnan(v));
    expect_exactly(y, want);
  }
}

// Resize's half_pixel_symmetric (opset 19), linear, at a scale whose output width is fractional
// (5 × 1.7 = 8.5, 8 written): against the standard's formula, which differs from half_pixel's by
// the offset that centres the 8 written values.
TEST(OnnxOpset, ResizeHalfPixelSymmetricCentresAFractionalOutputWidth) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  const std::int64_t w = 5;
  const double scale = 1.7;
  for (const std::string mode : {"half_pixel_symmetric", "half_pixel"}) {
    SCOPED_TRACE(mode);
    OnnxBuilder m(19);
    m.input("x", kg::DType::F32, {std::int64_t{1}, std::int64_t{1}, std::int64_t{1}, w});
    m.initializer("scales", kg::Tensor::from_vector<float>({4}, {1.0f, 1.0f, 1.0f, static_cast<float>(scale)}));
    auto& n = m.node("Resize", {"x", "", "scales"}, {"y"}, "/resize");
    OnnxBuilder::attr(n, "mode", std::string("linear"));
    OnnxBuilder::attr(n, "coordinate_transformation_mode", mode);
    m.output("y");
    const kg::Tensor x = random_f32(rng, {1, 1, 1, w});
    const kg::Tensor y = run1(import_model(m), x);
    const double s = static_cast<double>(static_cast<float>(scale));
    const double width = static_cast<double>(w) * s;
    const auto out = static_cast<std::int64_t>(std::floor(width));
    ASSERT_EQ(y.shape(), (std::vector<std::int64_t>{1, 1, 1, out}));
    const double offset = mode == "half_pixel" ? 0.0 : (static_cast<double>(w) / 2.0) * (1.0 - static_cast<double>(out) / width);
    std::vector<double> want;
    for (std::int64_t i = 0; i < out; ++i) {
      const double at = offset + (static_cast<double>(i) + 0.5) / s - 0.5;
      const double f = std::floor(at);
      const auto clamp = [&](double k) { return static_cast<std::int64_t>(std::clamp(k, 0.0, static_cast<double>(w - 1))); };
      want.push_back((1.0 - (at - f)) * x.item(clamp(f)) + (at - f) * x.item(clamp(f + 1.0)));
    }
    EXPECT_TRUE(kg_test::matches(y, want, 1e-5, 1e-6));
  }
}
