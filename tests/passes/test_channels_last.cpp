// The channels-last pass for the CPU (oneDNN): a model loaded with it computes what the same
// model computes on kernelgraph's own NCHW kernels (vendor libraries off), for every kind of
// convolution, epilogue and pooling it rewrites, on fresh random inputs and parameters; where
// it does and does not apply; and what happens when parameters change after load.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <string>

#include "kg/models.hpp"
#include "kg/testing.hpp"
#include "ops/conv.hpp"
#include "ops/conv_dnnl.hpp"
#include "ops/dnnl.hpp"
#include "ops/pointwise.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

using Build = std::function<kg::SymTensor(const kg::SymTensor&)>;

struct Case {
  kg::Model model;
  std::vector<std::int64_t> input;
};

Case make(const Build& build, std::vector<std::int64_t> input, bool fusion = true) {
  std::vector<kg::Dim> dims{kg::Dim::named("batch")};
  for (std::size_t i = 1; i < input.size(); ++i) dims.push_back(input[i]);
  auto [x, graph] = kg::SymTensor::input(kg::DType::F32, kg::Shape(dims), "x");
  (void)graph;
  kg::SymTensor y = build(x);
  return {kg::Model(y.graph_ptr(), {y}, kg::LoweringMode::Inference, {.fusion = fusion}), std::move(input)};
}

std::map<std::string, kg::Tensor> random_params(const kg::Model& m, std::mt19937_64& rng) {
  std::map<std::string, kg::Tensor> p;
  for (const auto& info : m.parameters()) {
    if (info.dtype != kg::DType::F32) continue;
    const bool var = info.name.ends_with("running_var");
    p[info.name] = kg_test::random_tensor(rng, info.dtype, info.shape, var ? 0.5 : -0.5, var ? 1.5 : 0.5);
  }
  return p;
}

// The op names of a loaded model's nodes, from a profiled run.
std::vector<std::string> ops_run(kg::LoadedModel& lm, const kg::Tensor& x) {
  lm.forward({x});
  std::vector<std::string> v;
  for (const auto& t : lm.profile()) v.push_back(t.op);
  return v;
}

int count(const std::vector<std::string>& v, const std::string& s) {
  return static_cast<int>(std::count(v.begin(), v.end(), s));
}

kg::LoadOptions options(bool vendor) {
  kg::LoadOptions o;
  o.vendor_libraries = vendor;
  o.poison_buffers = true;  // an element left unwritten stays NaN and fails the comparison
  o.profile = true;
  return o;
}

// Loads `c` with and without oneDNN, the same random parameters in both, and compares the
// outputs on a fresh random input. Returns the op names the oneDNN load ran. `atol_of_max`
// raises the absolute tolerance to that fraction of the largest |output|: through a deep
// network of random weights, float rounding grows with the activations, not with each output.
std::vector<std::string> compare(const Case& c, double rtol = 2e-4, double atol = 2e-5, double atol_of_max = 0) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const auto params = random_params(c.model, rng);
  const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, c.input, -1.0, 1.0);
  kg::LoadedModel ours = c.model.load(kg::Device::cpu(), {c.input}, options(false));
  kg::LoadedModel onednn = c.model.load(kg::Device::cpu(), {c.input}, options(true));
  ours.load_state_dict(params, false);
  onednn.load_state_dict(params, false);
  const auto want = ours.forward({x});
  const auto ran = ops_run(onednn, x);
  const auto got = onednn.forward({x});
  EXPECT_EQ(got[0].shape(), want[0].shape());
  EXPECT_TRUE(kg_test::all_written(got[0]));
  double largest = 0;
  const kg::Tensor w = want[0].to(kg::DType::F64);
  for (std::int64_t i = 0; i < w.numel(); ++i) largest = std::max(largest, std::abs(w.data<double>()[i]));
  EXPECT_TRUE(kg_test::all_close(got[0], want[0], rtol, std::max(atol, atol_of_max * largest)));
  return ran;
}

#define REQUIRE_ONEDNN() \
  if (!kg::ops::dnnl::available()) GTEST_SKIP() << kg::ops::dnnl::unavailable_reason()

kg::SymTensor conv(const kg::SymTensor& x, std::int64_t out, kg::Size2 k, kg::nn::Conv2dOptions o,
                   const std::string& name) {
  return kg::nn::conv2d(x, out, k, o, name);
}

// True when our own NCHW kernel's Rows algorithm serves this f32 convolution (few output channels,
// where it beats oneDNN): the pass then keeps it out of a region that its NCHW input would start.
// Rows needs AVX-512, so on other CPUs every such convolution converts.
bool on_rows_kernel(std::int64_t c, std::int64_t o, kg::Size2 k, kg::nn::Conv2dOptions opt, std::int64_t h,
                    std::int64_t w) {
  return kg::ops::conv_algo_for(kg::ops::Conv2dOp(c, o, k, opt, kg::DType::F32), {1, c, h, w}, kg::DType::F32) ==
         kg::ops::ConvAlgo::Rows;
}

}  // namespace

TEST(ChannelsLast, ConvolutionsOfEveryShapeMatchOurKernels) {
  REQUIRE_ONEDNN();
  struct Conf {
    std::int64_t c, o, h, w;
    kg::Size2 k;
    kg::nn::Conv2dOptions opt;
    bool few_channels = false;  // few output channels: our Rows kernel, where the CPU has it
  };
  const std::vector<Conf> confs = {
      {3, 24, 13, 11, 3, {.stride = 1, .padding = 1}},
      {4, 6, 9, 9, 5, {.stride = 2, .padding = 2, .bias = false}},
      {8, 24, 10, 7, 3, {.stride = 1, .padding = 2, .dilation = 2}},
      {8, 12, 8, 8, 3, {.stride = 1, .padding = 1, .groups = 4}},
      {16, 16, 7, 9, 3, {.stride = 2, .padding = 1, .groups = 16}},  // depthwise
      {6, 10, 6, 6, 1, {.stride = 2, .padding = 0}},
      {5, 20, 12, 9, {3, 1}, {.stride = {2, 1}, .padding = {1, 0}}},
      {1, 6, 28, 28, 5, {.stride = 1, .padding = 2}, true},  // LeNet-5's first layer
      {6, 16, 14, 14, 5, {}, true},                          // and its second
  };
  for (const auto& f : confs) {
    SCOPED_TRACE(kg::ops::Conv2dOp(f.c, f.o, f.k, f.opt, kg::DType::F32).attributes());
    Case c =
        make([&](const kg::SymTensor& x) { return conv(x, f.o, f.k, f.opt, "conv"); }, {3, f.c, f.h, f.w});
    const auto ran = compare(c);
    const bool stays_nchw = on_rows_kernel(f.c, f.o, f.k, f.opt, f.h, f.w);
    if (!f.few_channels) {
      EXPECT_FALSE(stays_nchw);
    }
    EXPECT_EQ(count(ran, "nn.conv2d_nhwc"), stays_nchw ? 0 : 1);
    EXPECT_EQ(count(ran, "nn.permute"), stays_nchw ? 0 : 2);  // the input in, the output back
  }
}

// A convolution with few output channels stays NCHW on our kernel only where its input is NCHW;
// inside a region (MobileNetV2's projections) it converts with the rest.
TEST(ChannelsLast, FewChannelsStayOnOurKernelOnlyAtTheRegionsEdge) {
  REQUIRE_ONEDNN();
  Case inside = make(
      [](const kg::SymTensor& x) {
        kg::SymTensor a = kg::relu(conv(x, 24, 3, {.stride = 2, .padding = 1}, "expand"), "r");
        return conv(a, 16, 1, {}, "project");
      },
      {2, 3, 12, 12});
  const auto ran = compare(inside);
  EXPECT_EQ(count(ran, "nn.conv2d_nhwc"), 2);
  EXPECT_EQ(count(ran, "nn.permute"), 2);
  Case first = make(
      [](const kg::SymTensor& x) {
        kg::SymTensor a = kg::relu(conv(x, 16, 1, {}, "project"), "r");
        return conv(a, 24, 3, {.stride = 2, .padding = 1}, "expand");
      },
      {2, 3, 12, 12});
  const auto ran2 = compare(first);
  // "project" reads the NCHW input: it stays there where Rows serves it.
  const bool project_stays = on_rows_kernel(3, 16, 1, {}, 12, 12);
  EXPECT_EQ(count(ran2, "nn.conv2d_nhwc"), project_stays ? 1 : 2);
  EXPECT_EQ(count(ran2, "nn.permute"), 2);
}

TEST(ChannelsLast, FusedEpiloguesMatchOurKernels) {
  REQUIRE_ONEDNN();
  using Act = std::function<kg::SymTensor(const kg::SymTensor&)>;
  const std::vector<std::pair<std::string, Act>> acts = {
      {"relu", [](const kg::SymTensor& t) { return kg::relu(t, "act"); }},
      {"leaky_relu", [](const kg::SymTensor& t) { return kg::leaky_relu(t, 0.2, "act"); }},
      {"silu", [](const kg::SymTensor& t) { return kg::silu(t, "act"); }},
      {"gelu", [](const kg::SymTensor& t) { return kg::gelu(t, kg::GeluApprox::Erf, "act"); }},
      {"gelu_tanh", [](const kg::SymTensor& t) { return kg::gelu(t, kg::GeluApprox::Tanh, "act"); }},
      {"sigmoid", [](const kg::SymTensor& t) { return kg::sigmoid(t, "act"); }},
      {"tanh", [](const kg::SymTensor& t) { return kg::tanh(t, "act"); }},
      {"user swish", [](const kg::SymTensor& t) { return kg::models::swish(t, "act"); }},
      {"user scaled tanh", [](const kg::SymTensor& t) { return kg::models::scaled_tanh(t, "act"); }},
      // ONNX's Clip (ReLU6): a oneDNN clip post-op in place of its form.
      {"clip", [](const kg::SymTensor& t) { return kg::ops::pointwise(kg::ops::PointwiseFn::Clip, {t}, {0.0, 0.5}, "act"); }},
      {"clip open below",
       [](const kg::SymTensor& t) {
         return kg::ops::pointwise(kg::ops::PointwiseFn::Clip, {t}, {-std::numeric_limits<double>::infinity(), 0.25},
                                   "act");
       }},
  };
  for (const auto& [label, act] : acts) {
    SCOPED_TRACE(label);
    // conv → batch norm → add(residual) → activation: one fused node, all of it in oneDNN (or
    // the user's form after it).
    Case c = make(
        [&](const kg::SymTensor& x) {
          kg::SymTensor a = kg::relu(conv(x, 24, 3, {.padding = 1}, "stem"), "stem_relu");
          kg::SymTensor b = kg::nn::batch_norm2d(conv(a, 24, 3, {.padding = 1, .bias = false}, "conv"), "bn");
          return act(kg::add(b, a, "residual"));
        },
        {2, 5, 9, 10});
    const auto ran = compare(c);
    EXPECT_EQ(count(ran, "nn.conv2d_nhwc"), 2);
    EXPECT_EQ(count(ran, "nn.fused_conv2d"), 0);
  }
}

TEST(ChannelsLast, PoolingAndElementwiseStayInTheRegion) {
  REQUIRE_ONEDNN();
  // Unfused: the relus and the add are elementwise nodes between convolutions; the pools follow
  // a convolution. Only the model's edges convert.
  Case c = make(
      [](const kg::SymTensor& x) {
        kg::SymTensor a = kg::relu(conv(x, 24, 3, {.padding = 1}, "c1"), "r1");
        kg::SymTensor p = kg::max_pool2d(a, 3, 2, 1, 1, true, "max");  // padded, ceil mode
        kg::SymTensor b = kg::relu(conv(p, 24, 3, {.padding = 1}, "c2"), "r2");
        kg::SymTensor s = kg::add(b, p, "sum");
        kg::SymTensor q = kg::avg_pool2d(s, 2, 2, 1, false, false, "avg");  // padding not counted
        kg::SymTensor r = kg::avg_pool2d(q, 2, 1, 0, false, true, "avg2");
        return kg::global_avg_pool(r, "gap");
      },
      {3, 4, 15, 14}, /*fusion=*/false);
  const auto ran = compare(c);
  EXPECT_EQ(count(ran, "nn.conv2d_nhwc"), 2);
  EXPECT_EQ(count(ran, "nn.max_pool2d_nhwc"), 1);
  EXPECT_EQ(count(ran, "nn.avg_pool2d_nhwc"), 2);
  EXPECT_EQ(count(ran, "nn.global_avg_pool_nhwc"), 1);
  EXPECT_EQ(count(ran, "nn.relu"), 2);
  EXPECT_EQ(count(ran, "nn.permute"), 2);
}

TEST(ChannelsLast, AConsumerOutsideTheRegionGetsNchw) {
  REQUIRE_ONEDNN();
  // Flatten reads NCHW order: one conversion back before it, and the zoo models run as before.
  // LeNet-5's convolutions have few channels: where Rows serves them they stay on our kernels, and
  // nothing converts; elsewhere both convert, with the input and the flatten's conversions.
  const auto ran =
      compare(make([](const kg::SymTensor& x) { return kg::models::lenet5(x); }, {4, 1, 28, 28}));
  const bool lenet_stays = on_rows_kernel(1, 6, 5, {.stride = 1, .padding = 2}, 28, 28);
  EXPECT_EQ(count(ran, "nn.conv2d_nhwc"), lenet_stays ? 0 : 2);
  EXPECT_EQ(count(ran, "nn.permute"), lenet_stays ? 0 : 2);
  Case small = make([](const kg::SymTensor& x) { return kg::models::resnet18(x, 10); }, {2, 3, 40, 48});
  const auto r18 = compare(small, 1e-3, 1e-4, 1e-3);
  EXPECT_EQ(count(r18, "nn.conv2d_nhwc"), 20);
  EXPECT_EQ(count(r18, "nn.permute"), 2);  // the input; global pooling's [N, 1, 1, C] to flatten
}

TEST(ChannelsLast, TrainingCheckedModeAndNoVendorKeepTheRecordedLayout) {
  REQUIRE_ONEDNN();
  Case c = make([](const kg::SymTensor& x) { return kg::relu(conv(x, 24, 3, {.padding = 1}, "c"), "r"); },
                {2, 3, 6, 6});
  const kg::Tensor x = kg::Tensor::zeros(kg::DType::F32, {2, 3, 6, 6});
  auto on = c.model.load(kg::Device::cpu(), {c.input}, options(true));
  EXPECT_EQ(count(ops_run(on, x), "nn.conv2d_nhwc"), 1);  // what the cases below turn off
  kg::LoadOptions off = options(false);
  auto a = c.model.load(kg::Device::cpu(), {c.input}, off);
  EXPECT_EQ(count(ops_run(a, x), "nn.conv2d_nhwc"), 0);
  kg::LoadOptions checked = options(true);
  checked.checked = true;
  auto b = c.model.load(kg::Device::cpu(), {c.input}, checked);
  EXPECT_EQ(count(ops_run(b, x), "nn.conv2d_nhwc"), 0);
  setenv("KG_NO_VENDOR", "1", 1);
  auto d = c.model.load(kg::Device::cpu(), {c.input}, options(true));
  unsetenv("KG_NO_VENDOR");
  EXPECT_EQ(count(ops_run(d, x), "nn.conv2d_nhwc"), 0);
  auto [t, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, 6, 6}, "x");
  (void)g;
  kg::SymTensor y = kg::relu(conv(t, 24, 3, {.padding = 1}, "c"), "r");
  kg::Model train(y.graph_ptr(), {y}, kg::LoweringMode::Training);
  auto e = train.load(kg::Device::cpu(), {c.input}, options(true));
  EXPECT_EQ(count(ops_run(e, x), "nn.conv2d_nhwc"), 0);
}

TEST(ChannelsLast, ChangedParametersReachTheConvertedWeights) {
  REQUIRE_ONEDNN();
  Case c = make(
      [](const kg::SymTensor& x) { return kg::nn::batch_norm2d(conv(x, 24, 3, {.padding = 1}, "c"), "bn"); },
      {2, 3, 7, 7});
  std::mt19937_64 rng(fresh_seed());
  const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, c.input);
  kg::LoadedModel ours = c.model.load(kg::Device::cpu(), {c.input}, options(false));
  kg::LoadedModel onednn = c.model.load(kg::Device::cpu(), {c.input}, options(true));
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const auto p = random_params(c.model, rng);
    ours.load_state_dict(p, false);
    onednn.load_state_dict(p, false);  // after a forward that converted the old weights
    EXPECT_TRUE(kg_test::all_close(onednn.forward({x})[0], ours.forward({x})[0], 2e-4, 2e-5));
  }
  // A write through parameter() before the next forward is seen by it.
  kg::Tensor w = onednn.parameter("c.weight");
  kg::Tensor w2 = ours.parameter("c.weight");
  for (std::int64_t i = 0; i < w.numel(); ++i)
    w.data<float>()[i] = w2.data<float>()[i] = 0.01f * static_cast<float>(i % 7);
  EXPECT_TRUE(kg_test::all_close(onednn.forward({x})[0], ours.forward({x})[0], 2e-4, 2e-5));
}

TEST(ChannelsLast, TheOpRefusesWhatItCannotRun) {
  REQUIRE_ONEDNN();
  kg::ops::Conv2dOp c(3, 4, 3, {.padding = 1}, kg::DType::F32);
  kg::ops::ChannelsLastConvOp op(c, {}, {});
  kg_test::expect_error([&] { op.infer_output_shape({kg::Shape{2, 6, 6}}); }, {"[N, H, W, C]"});
  // The channel count is the last dim: 6 channels where 3 were recorded.
  kg_test::expect_error(
      [&] {
        op.infer_output_shape({kg::Shape{2, 6, 6, 6}});
      },
      {"expects 3 input channels"});
  kg_test::expect_error([&] { op.infer_output_dtype({kg::DType::F64}); }, {"f32, f16 or bf16", "f64"});
  EXPECT_EQ(op.infer_output_shape({kg::Shape{2, 6, 5, 3}}), (kg::Shape{2, 6, 5, 4}));
  EXPECT_FALSE(kg::ops::ChannelsLastConvOp::supports(kg::ops::Conv2dOp(3, 4, 3, {}, kg::DType::F64)));
}

// LoadOptions::tune: the first run times oneDNN's implementations of the convolution (a 1x1 one
// has several), keeps the fastest, says so in the op's attributes, and computes what our NCHW
// kernel computes, on that run and the next.
TEST(ChannelsLast, TuningKeepsTheFastestImplementationAndTheResult) {
  REQUIRE_ONEDNN();
  std::mt19937_64 rng(fresh_seed());
  const kg::ops::Conv2dOp c(16, 24, 1, {}, kg::DType::F32);
  const std::vector<std::int64_t> nchw{2, 16, 9, 7};
  const auto specs = c.parameters({kg::Shape::of(nchw)});
  kg::ops::ChannelsLastConvOp op(c, {}, specs, /*tune=*/true);
  const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, nchw, -1.0, 1.0);
  std::vector<kg::Tensor> params;
  for (const auto& p : specs) params.push_back(kg_test::random_tensor(rng, kg::DType::F32, p.shape, -0.3, 0.3));
  // The reference: our NCHW kernel.
  kg::Tensor want = kg::Tensor::empty(kg::DType::F32, {2, 24, 9, 7});
  {
    std::vector<kg::Tensor> ins{x};
    kg::CpuContext ctx(ins, params, want, false, 0);
    kg::ops::conv2d_cpu(c, kg::ops::ConvAlgo::Auto, ctx);
  }
  // The same through oneDNN, on [N, H, W, C].
  kg::Tensor xl = kg::Tensor::empty(kg::DType::F32, {2, 9, 7, 16});
  for (std::int64_t n = 0; n < 2; ++n)
    for (std::int64_t ch = 0; ch < 16; ++ch)
      for (std::int64_t i = 0; i < 63; ++i)
        xl.data<float>()[(n * 63 + i) * 16 + ch] = x.data<float>()[(n * 16 + ch) * 63 + i];
  for (int run = 0; run < 2; ++run) {
    SCOPED_TRACE("run " + std::to_string(run));
    kg::Tensor y = kg::Tensor::empty(kg::DType::F32, {2, 9, 7, 24});
    y.fill(std::nan(""));
    std::vector<kg::Tensor> ins{xl};
    kg::CpuContext ctx(ins, params, y, false, 0);
    op.cpu_forward(ctx);
    EXPECT_TRUE(kg_test::all_written(y));
    double worst = 0;
    for (std::int64_t n = 0; n < 2; ++n)
      for (std::int64_t o = 0; o < 24; ++o)
        for (std::int64_t i = 0; i < 63; ++i)
          worst = std::max(worst, static_cast<double>(std::abs(y.data<float>()[(n * 63 + i) * 24 + o] -
                                                                want.data<float>()[(n * 24 + o) * 63 + i])));
    EXPECT_LT(worst, 1e-4);
  }
  EXPECT_NE(op.attributes().find("tuned: "), std::string::npos) << op.attributes();
}
