// Parameters of a loaded model: state_dict, load_state_dict (strict and not), dtype
// conversion, save_weights/load_weights through safetensors, default initialisation.
#include <unistd.h>

#include <cmath>
#include <filesystem>

#include "support/test_util.hpp"

using kg_test::expect_error;
using kg_test::fresh_seed;

namespace {

// y = x * x elementwise (no parameters), between the linear layers; f32 and f64.
class SquareOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.square"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  void cpu_forward(kg::CpuContext& ctx) const override {
    if (ctx.output.dtype() == kg::DType::F64) {
      const double* x = ctx.inputs[0].data<double>();
      double* y = ctx.output.data<double>();
      for (std::int64_t i = 0; i < ctx.output.numel(); ++i) y[i] = x[i] * x[i];
    } else {
      const float* x = ctx.inputs[0].data<float>();
      float* y = ctx.output.data<float>();
      for (std::int64_t i = 0; i < ctx.output.numel(); ++i) y[i] = x[i] * x[i];
    }
  }
};

// x [batch, 6] -> enc.fc (5, bias) -> square -> head (2, no bias).
kg::Model two_layer(kg::DType dt) {
  auto [x, g] = kg::SymTensor::input(dt, {kg::Dim::named("batch"), 6}, "x");
  kg::SymTensor h;
  {
    kg::NameScope s(*g, "enc");
    h = kg::nn::linear(x, 5, "fc");
  }
  h = h.record_custom(kg::CustomData::make<SquareOp>());
  return kg::Model(g, {kg::nn::linear(h, 2, "head", false)});
}

// The reference forward of two_layer in double.
kg::Tensor reference(const kg::Tensor& x, const std::map<std::string, kg::Tensor>& p) {
  const kg::Tensor &w1 = p.at("enc.fc.weight"), &b1 = p.at("enc.fc.bias"), &w2 = p.at("head.weight");
  const std::int64_t n = x.dim(0);
  kg::Tensor y = kg::Tensor::empty(kg::DType::F64, {n, 2});
  for (std::int64_t r = 0; r < n; ++r) {
    double h[5];
    for (int j = 0; j < 5; ++j) {
      double s = b1.item(j);
      for (int k = 0; k < 6; ++k) s += x.item(r * 6 + k) * w1.item(j * 6 + k);
      h[j] = s * s;
    }
    for (int j = 0; j < 2; ++j) {
      double s = 0;
      for (int k = 0; k < 5; ++k) s += h[k] * w2.item(j * 5 + k);
      y.data<double>()[r * 2 + j] = s;
    }
  }
  return y;
}

std::map<std::string, kg::Tensor> random_params(std::mt19937_64& rng, kg::DType dt) {
  return {{"enc.fc.weight", kg_test::random_tensor(rng, dt, {5, 6})},
          {"enc.fc.bias", kg_test::random_tensor(rng, dt, {5})},
          {"head.weight", kg_test::random_tensor(rng, dt, {2, 5})}};
}

::testing::AssertionResult same_values(const kg::Tensor& a, const kg::Tensor& b) {
  if (a.shape() != b.shape())
    return ::testing::AssertionFailure()
           << kg::sizes_to_string(a.shape()) << " vs " << kg::sizes_to_string(b.shape());
  for (std::int64_t i = 0; i < a.numel(); ++i)
    if (!(a.item(i) == b.item(i)))
      return ::testing::AssertionFailure() << "element " << i << ": " << a.item(i) << " vs " << b.item(i);
  return ::testing::AssertionSuccess();
}

// A fresh file path in the temporary directory, removed with the object.
struct TempFile {
  std::string path;
  explicit TempFile(const std::string& stem) {
    path =
        (std::filesystem::temp_directory_path() / ("kg_weights_" + stem + "_" + std::to_string(::getpid()) +
                                                   "_" + std::to_string(fresh_seed()) + ".safetensors"))
            .string();
  }
  ~TempFile() { std::filesystem::remove(path); }
};

}  // namespace

TEST(Weights, StateDictNamesShapesAndCopies) {
  kg::Model model = two_layer(kg::DType::F32);
  kg::LoadedModel m = model.load(kg::Device::cpu(), {{3, 6}});
  auto sd = m.state_dict();
  ASSERT_EQ(sd.size(), 3u);
  EXPECT_EQ(sd.at("enc.fc.weight").shape(), (std::vector<std::int64_t>{5, 6}));
  EXPECT_EQ(sd.at("enc.fc.bias").shape(), (std::vector<std::int64_t>{5}));
  EXPECT_EQ(sd.at("head.weight").shape(), (std::vector<std::int64_t>{2, 5}));
  for (const auto& [name, t] : sd) EXPECT_EQ(t.dtype(), kg::DType::F32) << name;
  auto infos = m.parameters();
  ASSERT_EQ(infos.size(), 3u);
  EXPECT_EQ(infos[0].name, "enc.fc.weight");
  EXPECT_EQ(infos[1].name, "enc.fc.bias");
  EXPECT_EQ(infos[2].name, "head.weight");
  EXPECT_TRUE(infos[0].trainable);
  EXPECT_EQ(infos[2].shape, (std::vector<std::int64_t>{2, 5}));
  // state_dict is a copy; parameter() shares the model's storage.
  const double before = m.parameter("enc.fc.bias").item(0);
  sd.at("enc.fc.bias").fill(42.0);
  EXPECT_EQ(m.parameter("enc.fc.bias").item(0), before);
  kg::Tensor live = m.parameter("enc.fc.bias");
  live.fill(0.25);
  EXPECT_EQ(m.state_dict().at("enc.fc.bias").item(4), 0.25);
  expect_error([&] { m.parameter("nope"); }, {"no parameter named 'nope'"});
  expect_error([&] { m.parameter("enc.fc"); }, {"no parameter named 'enc.fc'"});
}

TEST(Weights, DefaultInitFollowsPyTorchBounds) {
  kg::Model model = two_layer(kg::DType::F32);
  kg::LoadOptions a, b;
  a.seed = 1;
  b.seed = 2;
  kg::LoadedModel m1 = model.load(kg::Device::cpu(), {{1, 6}}, a);
  kg::LoadedModel m1b = model.load(kg::Device::cpu(), {{4, 6}}, a);
  kg::LoadedModel m2 = model.load(kg::Device::cpu(), {{1, 6}}, b);
  for (const auto& [name, t] : m1.state_dict()) {
    SCOPED_TRACE(name);
    const double bound = 1.0 / std::sqrt(name.rfind("head", 0) == 0 ? 5.0 : 6.0);
    double lo = 1e9, hi = -1e9;
    for (std::int64_t i = 0; i < t.numel(); ++i) {
      lo = std::min(lo, t.item(i));
      hi = std::max(hi, t.item(i));
    }
    EXPECT_GE(lo, -bound);
    EXPECT_LE(hi, bound);
    EXPECT_LT(lo, hi);                                 // not constant
    EXPECT_TRUE(same_values(t, m1b.parameter(name)));  // same seed, same values
    EXPECT_FALSE(same_values(t, m2.parameter(name)));  // another seed, other values
  }
}

TEST(Weights, LoadStateDictSetsValuesUsedByForward) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
    kg::LoadedModel m = two_layer(dt).load(kg::Device::cpu(), {{7, 6}});
    auto p = random_params(rng, dt);
    m.load_state_dict(p);
    for (const auto& [name, t] : p) EXPECT_TRUE(same_values(m.parameter(name), t)) << name;
    kg::Tensor x = kg_test::random_tensor(rng, dt, {7, 6});
    EXPECT_TRUE(
        kg_test::all_close(m.forward({x})[0], reference(x, p), dt == kg::DType::F32 ? 1e-5 : 1e-12, 1e-6));
    // The model keeps its own copy: changing the source afterwards changes nothing.
    p.at("head.weight").fill(0.0);
    EXPECT_FALSE(same_values(m.parameter("head.weight"), p.at("head.weight")));
  }
}

TEST(Weights, SaveAndLoadRoundTrip) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
    TempFile file("roundtrip");
    kg::Model model = two_layer(dt);
    kg::LoadedModel src = model.load(kg::Device::cpu(), {{2, 6}});
    auto p = random_params(rng, dt);
    src.load_state_dict(p);
    src.save_weights(file.path);

    // The file holds exactly the parameters, by PyTorch name, with their dtype and values.
    auto onfile = kg::read_safetensors(file.path);
    ASSERT_EQ(onfile.size(), 3u);
    for (const auto& [name, t] : p) {
      ASSERT_TRUE(onfile.count(name)) << name;
      EXPECT_EQ(onfile.at(name).dtype(), dt);
      EXPECT_TRUE(same_values(onfile.at(name), t)) << name;
    }

    // Another load (other batch, other seed) takes them back.
    kg::LoadOptions opt;
    opt.seed = 99;
    kg::LoadedModel dst = model.load(kg::Device::cpu(), {{5, 6}}, opt);
    EXPECT_FALSE(same_values(dst.parameter("head.weight"), p.at("head.weight")));
    dst.load_weights(file.path);
    for (const auto& [name, t] : p) EXPECT_TRUE(same_values(dst.parameter(name), t)) << name;
    kg::Tensor x = kg_test::random_tensor(rng, dt, {5, 6});
    EXPECT_TRUE(
        kg_test::all_close(dst.forward({x})[0], reference(x, p), dt == kg::DType::F32 ? 1e-5 : 1e-12, 1e-6));
    // state_dict -> load_state_dict round trip as well.
    kg::LoadedModel third = model.load(kg::Device::cpu(), {{1, 6}}, opt);
    third.load_state_dict(dst.state_dict());
    for (const auto& [name, t] : p) EXPECT_TRUE(same_values(third.parameter(name), t)) << name;
  }
}

TEST(Weights, StrictLoadListsEveryProblemAtOnce) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  kg::LoadedModel m = two_layer(kg::DType::F32).load(kg::Device::cpu(), {{2, 6}});
  const auto before = m.state_dict();
  auto p = random_params(rng, kg::DType::F32);
  p.erase("head.weight");                                                    // missing
  p["extra.thing"] = kg_test::random_tensor(rng, kg::DType::F32, {3});       // extra
  p["enc.fc.weight"] = kg_test::random_tensor(rng, kg::DType::F32, {5, 7});  // mis-shaped
  int errors = 0;
  try {
    m.load_state_dict(p);
  } catch (const kg::Error& e) {
    ++errors;
    const std::string msg = e.what();
    for (const char* part : {"missing from the weights (1)", "head.weight [2, 5] f32", "not in the model (1)",
                             "extra.thing [3] f32", "wrong shape or dtype (1)",
                             "enc.fc.weight: file has [5, 7] f32, model has [5, 6] f32"})
      EXPECT_NE(msg.find(part), std::string::npos) << "lacks '" << part << "':\n" << msg;
    EXPECT_EQ(msg.find("enc.fc.bias"), std::string::npos) << msg;  // the good one is not listed
  }
  EXPECT_EQ(errors, 1);
  // Nothing was changed by the failed load, not even the tensor that matched.
  for (const auto& [name, t] : before) EXPECT_TRUE(same_values(m.parameter(name), t)) << name;

  // The same through a file: the error also names the file.
  TempFile file("strict");
  kg::write_safetensors(file.path, p);
  expect_error(
      [&] { m.load_weights(file.path); },
      {file.path, "head.weight [2, 5] f32", "extra.thing [3] f32", "enc.fc.weight: file has [5, 7] f32"});

  // Not strict: missing and extra are fine, a mis-shaped tensor is still an error.
  expect_error([&] { m.load_state_dict(p, false); }, {"wrong shape or dtype (1)", "enc.fc.weight"});
  for (const auto& [name, t] : before) EXPECT_TRUE(same_values(m.parameter(name), t)) << name;
  p["enc.fc.weight"] = kg_test::random_tensor(rng, kg::DType::F32, {5, 6});
  m.load_state_dict(p, false);
  EXPECT_TRUE(same_values(m.parameter("enc.fc.weight"), p.at("enc.fc.weight")));
  EXPECT_TRUE(same_values(m.parameter("enc.fc.bias"), p.at("enc.fc.bias")));
  EXPECT_TRUE(same_values(m.parameter("head.weight"), before.at("head.weight")));
  // Strict with only the missing one.
  p.erase("extra.thing");
  expect_error([&] { m.load_state_dict(p); }, {"missing from the weights (1)", "head.weight"});
}

TEST(Weights, FloatDtypesAreConverted) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  kg::LoadedModel m = two_layer(kg::DType::F32).load(kg::Device::cpu(), {{2, 6}});
  // f64 file into f32 parameters: each value rounded to float.
  auto p64 = random_params(rng, kg::DType::F64);
  TempFile file("f64");
  kg::write_safetensors(file.path, p64);
  m.load_weights(file.path);
  for (const auto& [name, t] : p64) {
    kg::Tensor got = m.parameter(name);
    ASSERT_EQ(got.dtype(), kg::DType::F32);
    for (std::int64_t i = 0; i < t.numel(); ++i)
      EXPECT_EQ(got.data<float>()[i], static_cast<float>(t.data<double>()[i])) << name << " " << i;
  }
  // f16 and bf16 into f32: exact, as every half value is a float.
  for (kg::DType half : {kg::DType::F16, kg::DType::BF16}) {
    auto p = random_params(rng, half);
    m.load_state_dict(p);
    for (const auto& [name, t] : p) EXPECT_TRUE(same_values(m.parameter(name), t)) << name;
  }
  // f32 into an f64 model.
  kg::LoadedModel m64 = two_layer(kg::DType::F64).load(kg::Device::cpu(), {{2, 6}});
  auto p32 = random_params(rng, kg::DType::F32);
  m64.load_state_dict(p32);
  for (const auto& [name, t] : p32) {
    EXPECT_EQ(m64.parameter(name).dtype(), kg::DType::F64);
    EXPECT_TRUE(same_values(m64.parameter(name), t)) << name;
  }
}

TEST(Weights, IntegerIntoFloatIsAnError) {
  kg::LoadedModel m = two_layer(kg::DType::F32).load(kg::Device::cpu(), {{2, 6}});
  const auto before = m.state_dict();
  auto p = m.state_dict();
  p["enc.fc.weight"] = kg::Tensor::zeros(kg::DType::I32, {5, 6});
  p["head.weight"] = kg::Tensor::zeros(kg::DType::I64, {2, 5});
  expect_error([&] { m.load_state_dict(p); },
               {"wrong shape or dtype (2)", "enc.fc.weight: file has [5, 6] i32, model has [5, 6] f32",
                "head.weight: file has [2, 5] i64, model has [2, 5] f32"});
  for (const auto& [name, t] : before) EXPECT_TRUE(same_values(m.parameter(name), t)) << name;
  expect_error([&] { m.load_weights("/nonexistent/dir/w.safetensors"); },
               {"/nonexistent/dir/w.safetensors", "does not exist"});
}
