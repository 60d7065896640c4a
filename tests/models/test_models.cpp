// The model zoo: parameter names and shapes against PyTorch/torchvision, LeNet-5 against
// PyTorch's logits, ResNet-18 against a naive double-precision forward, and every model at
// batch 1 and 7.
#include <nlohmann/json.hpp>

#include "kg/models.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

// expect_error with the statement in the failure trace.
#define EXPECT_KG_ERROR(stmt, ...)                     \
  do {                                                 \
    SCOPED_TRACE(#stmt);                               \
    kg_test::expect_error([&] { stmt; }, __VA_ARGS__); \
  } while (0)

namespace {

using Shape = std::vector<std::int64_t>;

// The fixture's metadata "params": [[name, shape], ...] in state_dict order.
std::vector<std::pair<std::string, Shape>> fixture_params(const std::string& file) {
  std::map<std::string, std::string> meta;
  kg_test::fixture(file, &meta);
  std::vector<std::pair<std::string, Shape>> out;
  for (const auto& e : nlohmann::json::parse(meta.at("params")))
    out.emplace_back(e[0].get<std::string>(), e[1].get<Shape>());
  return out;
}

std::vector<std::pair<std::string, Shape>> model_params(const kg::Model& model) {
  std::vector<std::pair<std::string, Shape>> out;
  for (const auto& p : model.parameters()) out.emplace_back(p.name, p.shape);
  return out;
}

// Where two parameter lists first differ.
std::string first_difference(const std::vector<std::pair<std::string, Shape>>& got,
                             const std::vector<std::pair<std::string, Shape>>& want) {
  auto show = [](const std::vector<std::pair<std::string, Shape>>& ps, std::size_t i) {
    return i < ps.size() ? ps[i].first + " " + kg::sizes_to_string(ps[i].second) : std::string("(end)");
  };
  for (std::size_t i = 0; i < std::max(got.size(), want.size()); ++i)
    if (i >= got.size() || i >= want.size() || got[i] != want[i])
      return "parameter " + std::to_string(i) + ": got " + show(got, i) + ", want " + show(want, i) + " (" +
             std::to_string(got.size()) + " vs " + std::to_string(want.size()) + " parameters)";
  return "none";
}

kg::LoadedModel load_poisoned(const kg::Model& model, const Shape& input_shape) {
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  return model.load(kg::Device::cpu(), {input_shape}, opt);
}

// ---- a naive double-precision ResNet-18 (torchvision's structure, eval mode) ----

struct Act {  // [n, c, h, w]
  std::int64_t n = 0, c = 0, h = 0, w = 0;
  std::vector<double> v;
  double& at(std::int64_t i, std::int64_t ch, std::int64_t y, std::int64_t x) {
    return v[static_cast<std::size_t>(((i * c + ch) * h + y) * w + x)];
  }
  double at(std::int64_t i, std::int64_t ch, std::int64_t y, std::int64_t x) const {
    return v[static_cast<std::size_t>(((i * c + ch) * h + y) * w + x)];
  }
};

Act make_act(std::int64_t n, std::int64_t c, std::int64_t h, std::int64_t w, double fill) {
  return {n, c, h, w, std::vector<double>(static_cast<std::size_t>(n * c * h * w), fill)};
}

using Params = std::map<std::string, kg::Tensor>;

Act conv(const Act& x, const kg::Tensor& wt, std::int64_t stride, std::int64_t pad) {
  const std::int64_t oc = wt.dim(0), k = wt.dim(2);
  const std::int64_t oh = (x.h + 2 * pad - k) / stride + 1, ow = (x.w + 2 * pad - k) / stride + 1;
  Act y = make_act(x.n, oc, oh, ow, 0.0);
  for (std::int64_t i = 0; i < x.n; ++i)
    for (std::int64_t o = 0; o < oc; ++o)
      for (std::int64_t yy = 0; yy < oh; ++yy)
        for (std::int64_t xx = 0; xx < ow; ++xx) {
          double s = 0;
          for (std::int64_t c = 0; c < x.c; ++c)
            for (std::int64_t ky = 0; ky < k; ++ky) {
              const std::int64_t iy = yy * stride - pad + ky;
              if (iy < 0 || iy >= x.h) continue;
              for (std::int64_t kx = 0; kx < k; ++kx) {
                const std::int64_t ix = xx * stride - pad + kx;
                if (ix < 0 || ix >= x.w) continue;
                s += x.at(i, c, iy, ix) * wt.item(((o * x.c + c) * k + ky) * k + kx);
              }
            }
          y.at(i, o, yy, xx) = s;
        }
  return y;
}

Act bn(Act x, const Params& p, const std::string& name) {
  const kg::Tensor &g = p.at(name + ".weight"), &b = p.at(name + ".bias");
  const kg::Tensor &mu = p.at(name + ".running_mean"), &var = p.at(name + ".running_var");
  for (std::int64_t i = 0; i < x.n; ++i)
    for (std::int64_t c = 0; c < x.c; ++c) {
      const double scale = g.item(c) / std::sqrt(var.item(c) + 1e-5);
      for (std::int64_t y = 0; y < x.h; ++y)
        for (std::int64_t z = 0; z < x.w; ++z)
          x.at(i, c, y, z) = (x.at(i, c, y, z) - mu.item(c)) * scale + b.item(c);
    }
  return x;
}

Act relu(Act x) {
  for (double& e : x.v) e = std::max(e, 0.0);
  return x;
}

Act maxpool3s2p1(const Act& x) {
  const std::int64_t oh = (x.h + 2 - 3) / 2 + 1, ow = (x.w + 2 - 3) / 2 + 1;
  Act y = make_act(x.n, x.c, oh, ow, -INFINITY);
  for (std::int64_t i = 0; i < x.n; ++i)
    for (std::int64_t c = 0; c < x.c; ++c)
      for (std::int64_t yy = 0; yy < oh; ++yy)
        for (std::int64_t xx = 0; xx < ow; ++xx)
          for (std::int64_t ky = 0; ky < 3; ++ky)
            for (std::int64_t kx = 0; kx < 3; ++kx) {
              const std::int64_t iy = yy * 2 - 1 + ky, ix = xx * 2 - 1 + kx;
              if (iy >= 0 && iy < x.h && ix >= 0 && ix < x.w)
                y.at(i, c, yy, xx) = std::max(y.at(i, c, yy, xx), x.at(i, c, iy, ix));
            }
  return y;
}

Act basic_block(const Act& x, const Params& p, const std::string& name, std::int64_t stride) {
  Act h = relu(bn(conv(x, p.at(name + ".conv1.weight"), stride, 1), p, name + ".bn1"));
  h = bn(conv(h, p.at(name + ".conv2.weight"), 1, 1), p, name + ".bn2");
  Act identity = p.count(name + ".downsample.0.weight")
                     ? bn(conv(x, p.at(name + ".downsample.0.weight"), stride, 0), p, name + ".downsample.1")
                     : x;
  for (std::size_t i = 0; i < h.v.size(); ++i) h.v[i] += identity.v[i];
  return relu(h);
}

kg::Tensor naive_resnet18(const kg::Tensor& input, const Params& p) {
  Act x = make_act(input.dim(0), input.dim(1), input.dim(2), input.dim(3), 0.0);
  for (std::size_t i = 0; i < x.v.size(); ++i) x.v[i] = input.item(static_cast<std::int64_t>(i));
  x = maxpool3s2p1(relu(bn(conv(x, p.at("conv1.weight"), 2, 3), p, "bn1")));
  for (int l = 1; l <= 4; ++l) {
    const std::string layer = "layer" + std::to_string(l);
    x = basic_block(x, p, layer + ".0", l == 1 ? 1 : 2);
    x = basic_block(x, p, layer + ".1", 1);
  }
  const kg::Tensor &w = p.at("fc.weight"), &b = p.at("fc.bias");
  const std::int64_t classes = w.dim(0);
  kg::Tensor out = kg::Tensor::empty(kg::DType::F64, {x.n, classes});
  for (std::int64_t i = 0; i < x.n; ++i)
    for (std::int64_t j = 0; j < classes; ++j) {
      double s = b.item(j);
      for (std::int64_t c = 0; c < x.c; ++c) {
        double mean = 0;
        for (std::int64_t y = 0; y < x.h; ++y)
          for (std::int64_t z = 0; z < x.w; ++z) mean += x.at(i, c, y, z);
        s += mean / static_cast<double>(x.h * x.w) * w.item(j * x.c + c);
      }
      out.data<double>()[i * classes + j] = s;
    }
  return out;
}

// Random weights for every float parameter of a loaded model: convs and linears scaled by
// their fan-in so activations keep their size through the depth, BatchNorm with non-trivial
// running statistics. Integer buffers (num_batches_tracked) keep their values.
Params random_weights(const kg::LoadedModel& m, std::mt19937_64& rng) {
  Params out = m.state_dict();
  for (auto& [name, t] : out) {
    if (t.dtype() != kg::DType::F32) continue;
    auto ends_with = [&](const std::string& s) {
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    const bool is_bn = out.count(name.substr(0, name.rfind('.')) + ".running_var") > 0;
    if (is_bn && ends_with(".weight"))
      t = kg_test::random_tensor(rng, kg::DType::F32, t.shape(), 0.5, 1.5);
    else if (is_bn && ends_with(".running_var"))
      t = kg_test::random_tensor(rng, kg::DType::F32, t.shape(), 0.5, 2.0);
    else if (is_bn)  // bias, running_mean
      t = kg_test::random_tensor(rng, kg::DType::F32, t.shape(), -0.5, 0.5);
    else {
      const double fan_in = t.rank() > 1 ? static_cast<double>(t.numel() / t.dim(0)) : 16.0;
      const double bound = std::sqrt(6.0 / fan_in);
      t = kg_test::random_tensor(rng, kg::DType::F32, t.shape(), -bound, bound);
    }
  }
  return out;
}

}  // namespace

TEST(Models, Registry) {
  EXPECT_EQ(kg::models::names(), (std::vector<std::string>{"lenet5", "resnet18", "lenet5-tanh", "resnet18-swish"}));
  EXPECT_EQ(kg::models::input_shape("lenet5", 5), (Shape{5, 1, 28, 28}));
  EXPECT_EQ(kg::models::input_shape("resnet18", 3), (Shape{3, 3, 224, 224}));
  for (const auto& name : kg::models::names()) {
    kg::Model model = kg::models::build(name);
    ASSERT_EQ(model.outputs().size(), 1u);
    EXPECT_EQ(model.outputs()[0].first, "logits");
    const auto& in = model.graph().node(model.graph().inputs().at(0));
    EXPECT_EQ(in.shape[0].symbol(), "batch") << name;
    EXPECT_EQ(in.shape.rank(), kg::models::input_shape(name, 1).size()) << name;
    for (std::size_t d = 1; d < in.shape.rank(); ++d)
      EXPECT_EQ(in.shape[d].size(), kg::models::input_shape(name, 1)[d]) << name << " dim " << d;
  }
}

TEST(Models, RejectsBadArguments) {
  EXPECT_KG_ERROR(kg::models::build("vgg16"), {"unknown model 'vgg16'", "lenet5, resnet18"});
  EXPECT_KG_ERROR(kg::models::input_shape("alexnet", 1), {"unknown model 'alexnet'", "lenet5"});
  EXPECT_KG_ERROR(kg::models::input_shape("lenet5", 0), {"lenet5", "batch must be positive", "0"});
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 1, 28, 28});
  EXPECT_KG_ERROR(kg::models::lenet5(x, 0), {"lenet5", "num_classes must be positive", "0"});
  EXPECT_KG_ERROR(kg::models::resnet18(x), {"resnet18", "[N, 3, H, W]", "[batch, 1, 28, 28]", "'input'"});
  auto [r, g2] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, 64, 64});
  EXPECT_KG_ERROR(kg::models::resnet18(r, -3), {"resnet18", "num_classes must be positive", "-3"});
  // A 32x32 image would reach the classifier as 16*6*6 = 576 features where LeNet-5 has 400.
  auto [big, g3] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 1, 32, 32});
  EXPECT_KG_ERROR(kg::models::lenet5(big), {"lenet5", "[N, 1, 28, 28]", "[batch, 1, 32, 32]", "'input'"});
  auto [rgb, g4] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, 28, 28});
  EXPECT_KG_ERROR(kg::models::lenet5(rgb), {"lenet5", "[N, 1, 28, 28]", "[batch, 3, 28, 28]"});
}

TEST(Models, Lenet5ParametersMatchPyTorch) {
  const auto want = fixture_params("models_lenet5.safetensors");
  ASSERT_FALSE(want.empty());
  const auto got = model_params(kg::models::build("lenet5"));
  EXPECT_TRUE(got == want) << first_difference(got, want);
}

TEST(Models, Resnet18ParametersMatchTorchvision) {
  const auto want = fixture_params("models_resnet18.safetensors");
  ASSERT_FALSE(want.empty());
  for (auto mode : {kg::LoweringMode::Inference, kg::LoweringMode::Training}) {
    SCOPED_TRACE(mode == kg::LoweringMode::Inference ? "inference lowering" : "training lowering");
    kg::Model model = kg::models::build("resnet18", mode);
    auto got = model_params(model), expected = want;
    if (mode == kg::LoweringMode::Inference) {
      // The fused graph may place a block's residual branch before the convolution it is added
      // to, so only the set of names and shapes is PyTorch's; Training keeps the recorded order.
      std::sort(got.begin(), got.end());
      std::sort(expected.begin(), expected.end());
    }
    EXPECT_TRUE(got == expected) << first_difference(got, expected);
    for (const auto& p : model.parameters()) {
      const bool counter = p.name.ends_with(".num_batches_tracked");
      EXPECT_EQ(p.dtype, counter ? kg::DType::I64 : kg::DType::F32) << p.name;
      EXPECT_EQ(p.trainable,
                !counter && !p.name.ends_with(".running_mean") && !p.name.ends_with(".running_var"))
          << p.name;
    }
  }
}

TEST(Models, Lenet5MatchesPyTorchLogits) {
  Params f = kg_test::fixture("models_lenet5.safetensors");
  const kg::Tensor x = f.at("x"), want = f.at("logits");
  f.erase("x");
  f.erase("logits");
  kg::LoadedModel m = load_poisoned(kg::models::build("lenet5"), x.shape());
  m.load_state_dict(f, /*strict=*/true);
  const auto out = m.forward({x});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(kg_test::all_written(out[0]));
  EXPECT_TRUE(kg_test::all_close(out[0], want, 1e-4, 1e-5));
}

TEST(Models, Resnet18MatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // ResNet-18 takes any image size; 40x40 keeps the double-precision reference quick and still
  // leaves a 2x2 map at layer4. Both lowerings: Inference folds BatchNorm into the convolutions,
  // Training keeps it (run here in eval mode).
  const Shape shape{2, 3, 40, 40};
  const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, shape);
  for (auto mode : {kg::LoweringMode::Inference, kg::LoweringMode::Training}) {
    SCOPED_TRACE(mode == kg::LoweringMode::Inference ? "inference lowering" : "training lowering");
    auto graph = kg::Graph::create();
    kg::SymTensor in = graph->input(kg::DType::F32, {kg::Dim::named("batch"), 3, 40, 40}, "input");
    kg::Model model(graph, std::vector<kg::SymTensor>{kg::models::resnet18(in, 37)}, mode);
    kg::LoadedModel m = load_poisoned(model, shape);
    const Params weights = random_weights(m, rng);
    m.load_state_dict(weights, /*strict=*/true);
    m.set_training(false);
    const auto out = m.forward({x});
    ASSERT_EQ(out.size(), 1u);
    EXPECT_TRUE(kg_test::all_written(out[0]));
    const kg::Tensor want = naive_resnet18(x, weights);
    double scale = 0;
    for (std::int64_t i = 0; i < want.numel(); ++i) scale = std::max(scale, std::abs(want.item(i)));
    ASSERT_GT(scale, 1e-3) << "the reference logits vanished; the test would prove nothing";
    EXPECT_TRUE(kg_test::all_close(out[0], want, 1e-3, 1e-4 * scale));
  }
}

TEST(Models, ZooRunsAtBatch1And7) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& name : kg::models::names()) {
    SCOPED_TRACE(name);
    kg::Model model = kg::models::build(name);
    const kg::Tensor x7 = kg_test::random_tensor(rng, kg::DType::F32, kg::models::input_shape(name, 7));
    kg::LoadedModel m7 = load_poisoned(model, x7.shape());
    m7.load_state_dict(random_weights(m7, rng), /*strict=*/true);
    const kg::Tensor y7 = m7.forward({x7})[0];
    ASSERT_EQ(y7.shape(), (Shape{7, name.starts_with("resnet18") ? 1000 : 10}));
    EXPECT_TRUE(kg_test::all_written(y7));
    // Batch 1 with the same weights, on sample 4 of the batch: each sample's logits depend on
    // that sample only.
    kg::LoadedModel m1 = load_poisoned(model, kg::models::input_shape(name, 1));
    m1.load_state_dict(m7.state_dict(), /*strict=*/true);
    const std::int64_t per = x7.numel() / 7, classes = y7.dim(1);
    kg::Tensor x1 = kg::Tensor::empty(kg::DType::F32, kg::models::input_shape(name, 1));
    std::copy_n(x7.data<float>() + 4 * per, per, x1.data<float>());
    const kg::Tensor y1 = m1.forward({x1})[0];
    ASSERT_EQ(y1.shape(), (Shape{1, classes}));
    EXPECT_TRUE(kg_test::all_written(y1));
    kg::Tensor row = kg::Tensor::empty(kg::DType::F32, {1, classes});
    std::copy_n(y7.data<float>() + 4 * classes, classes, row.data<float>());
    double scale = 0;
    for (std::int64_t i = 0; i < row.numel(); ++i) scale = std::max(scale, std::abs(row.item(i)));
    EXPECT_TRUE(kg_test::all_close(y1, row, 1e-4, 1e-5 * scale));
  }
}
