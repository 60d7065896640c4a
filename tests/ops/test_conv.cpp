#include <cmath>
#include <sstream>

#include "ops/conv.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

struct ConvCfg {
  std::int64_t c, h, w, out;
  kg::Size2 kernel, stride = 1, padding = 0, dilation = 1;
  std::int64_t groups = 1;
  bool bias = true;

  kg::nn::Conv2dOptions options() const { return {stride, padding, dilation, groups, bias}; }
  std::string text() const {
    std::ostringstream os;
    os << "c=" << c << " h=" << h << " w=" << w << " out=" << out << " k=" << kernel.h << "x" << kernel.w
       << " s=" << stride.h << "x" << stride.w << " p=" << padding.h << "x" << padding.w
       << " d=" << dilation.h << "x" << dilation.w << " groups=" << groups << " bias=" << bias;
    return os.str();
  }
};

// The textbook definition in double: y[n, o, i, j] = b[o] + sum over the group's channels and
// the kernel taps of w[o, c, ky, kx] * x[n, g*C/G + c, i*s - p + ky*d, j*s - p + kx*d].
kg::Tensor naive_conv(const kg::Tensor& x, const kg::Tensor& w, const kg::Tensor* b, const ConvCfg& cfg) {
  const std::int64_t n = x.dim(0), c = x.dim(1), h = x.dim(2), wd = x.dim(3);
  const std::int64_t o = cfg.out, kh = cfg.kernel.h, kw = cfg.kernel.w;
  const std::int64_t ho = (h + 2 * cfg.padding.h - cfg.dilation.h * (kh - 1) - 1) / cfg.stride.h + 1;
  const std::int64_t wo = (wd + 2 * cfg.padding.w - cfg.dilation.w * (kw - 1) - 1) / cfg.stride.w + 1;
  const std::int64_t cg = c / cfg.groups, og = o / cfg.groups;
  kg::Tensor y = kg::Tensor::empty(kg::DType::F64, {n, o, ho, wo});
  const kg::Tensor xd = x.to(kg::DType::F64), wdd = w.to(kg::DType::F64);
  const double* xp = xd.data<double>();
  const double* wp = wdd.data<double>();
  double* yp = y.data<double>();
  for (std::int64_t img = 0; img < n; ++img)
    for (std::int64_t oc = 0; oc < o; ++oc)
      for (std::int64_t i = 0; i < ho; ++i)
        for (std::int64_t j = 0; j < wo; ++j) {
          double s = b ? b->item(oc) : 0.0;
          for (std::int64_t ci = 0; ci < cg; ++ci)
            for (std::int64_t ky = 0; ky < kh; ++ky)
              for (std::int64_t kx = 0; kx < kw; ++kx) {
                const std::int64_t iy = i * cfg.stride.h - cfg.padding.h + ky * cfg.dilation.h;
                const std::int64_t ix = j * cfg.stride.w - cfg.padding.w + kx * cfg.dilation.w;
                if (iy < 0 || iy >= h || ix < 0 || ix >= wd) continue;
                const std::int64_t chan = oc / og * cg + ci;
                s += wp[((oc * cg + ci) * kh + ky) * kw + kx] * xp[((img * c + chan) * h + iy) * wd + ix];
              }
          yp[((img * o + oc) * ho + i) * wo + j] = s;
        }
  return y;
}

// Records conv2d on an input declared [batch, C, H, W] (H and W dynamic when `dynamic_hw`),
// loads it for x's shape with poisoned buffers and runs it.
kg::Tensor run_conv(const kg::Tensor& x, const ConvCfg& cfg, const std::map<std::string, kg::Tensor>& params,
                    bool dynamic_hw) {
  auto g = kg::Graph::create();
  kg::Shape s{kg::Dim::named("batch"), x.dim(1), dynamic_hw ? kg::Dim(kg::dynamic) : kg::Dim(x.dim(2)),
              dynamic_hw ? kg::Dim(kg::dynamic) : kg::Dim(x.dim(3))};
  auto in = g->input(x.dtype(), s, "x");
  auto y = kg::nn::conv2d(in, cfg.out, cfg.kernel, cfg.options(), "conv");
  kg::Model model(g, {y});
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  kg::LoadedModel m = model.load(kg::Device::cpu(), {x.shape()}, opt);
  m.load_state_dict(params);
  kg::Tensor out = m.forward({x})[0];
  EXPECT_TRUE(kg_test::all_written(out)) << "the convolution left output elements unwritten";
  return out;
}

// Runs one CPU algorithm directly on host tensors, with a NaN-filled output.
kg::Tensor run_algo(kg::ops::ConvAlgo algo, const kg::Tensor& x, const kg::Tensor& w, const kg::Tensor* b,
                    const ConvCfg& cfg) {
  kg::ops::Conv2dOp op(cfg.c, cfg.out, cfg.kernel, cfg.options(), x.dtype());
  const kg::Shape out = op.infer_output_shape({kg::Shape::of(x.shape())});
  kg::Tensor y = kg::Tensor::empty(x.dtype(), out.sizes());
  y.fill(std::nan(""));
  std::vector<kg::Tensor> ins{x}, ps{w};
  if (b) ps.push_back(*b);
  kg::CpuContext ctx(ins, ps, y, false, 0);
  kg::ops::conv2d_cpu(op, algo, ctx);
  EXPECT_TRUE(kg_test::all_written(y)) << "the algorithm left output elements unwritten";
  return y;
}

const char* algo_name(kg::ops::ConvAlgo a) {
  switch (a) {
    case kg::ops::ConvAlgo::Auto:
      return "auto";
    case kg::ops::ConvAlgo::Gemm:
      return "gemm";
    case kg::ops::ConvAlgo::Depthwise:
      return "depthwise";
    case kg::ops::ConvAlgo::Direct:
      return "direct";
    case kg::ops::ConvAlgo::Packed:
      return "packed";
    case kg::ops::ConvAlgo::Rows:
      return "rows";
  }
  return "?";
}

std::vector<std::int64_t> pair_of(const std::string& s) {
  const auto comma = s.find(',');
  return {std::stoll(s.substr(0, comma)), std::stoll(s.substr(comma + 1))};
}

}  // namespace

TEST(Conv2d, ShapeInference) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, 224, 224});
  kg::SymTensor y;
  {
    kg::NameScope scope(x, "features");
    y = kg::nn::conv2d(x, 64, 7, {.stride = 2, .padding = 3, .bias = false}, "0");
  }
  EXPECT_EQ(y.shape().to_string(), "[batch, 64, 112, 112]");
  EXPECT_EQ(y.name(), "features.0");
  const auto& params = g->node(y.node()).params;
  ASSERT_EQ(params.size(), 1u);
  EXPECT_EQ(params[0].name, "features.0.weight");
  EXPECT_EQ(params[0].shape, (std::vector<std::int64_t>{64, 3, 7, 7}));
  EXPECT_EQ(params[0].init.kind, kg::ParamInit::Kind::Uniform);
  EXPECT_DOUBLE_EQ(params[0].init.b, 1.0 / std::sqrt(3.0 * 49.0));
  EXPECT_DOUBLE_EQ(params[0].init.a, -params[0].init.b);
  EXPECT_EQ(g->node(y.node()).op->op().attributes(), "in=3 out=64 k=7 s=2 p=3 bias=false");

  // Grouped, rectangular, strided, dilated: weight [out, in/groups, kh, kw] and a bias.
  auto z = kg::nn::conv2d(y, 32, {3, 5},
                          {.stride = {2, 1}, .padding = {1, 2}, .dilation = {2, 1}, .groups = 4}, "grouped");
  // H: (112 + 2 - 2*2 - 1)/2 + 1 = 55; W: (112 + 4 - 4 - 1)/1 + 1 = 112.
  EXPECT_EQ(z.shape().to_string(), "[batch, 32, 55, 112]");
  const auto& zp = g->node(z.node()).params;
  ASSERT_EQ(zp.size(), 2u);
  EXPECT_EQ(zp[0].shape, (std::vector<std::int64_t>{32, 16, 3, 5}));
  EXPECT_EQ(zp[1].name, "grouped.bias");
  EXPECT_EQ(zp[1].shape, (std::vector<std::int64_t>{32}));
  EXPECT_DOUBLE_EQ(zp[1].init.b, 1.0 / std::sqrt(16.0 * 15.0));
  EXPECT_EQ(g->node(z.node()).op->op().attributes(), "in=64 out=32 k=3x5 s=2x1 p=1x2 d=2x1 groups=4");

  // Static batch, and dynamic H and W propagate.
  auto [s, g2] = kg::SymTensor::input(kg::DType::F64, {2, 8, 10, 9});
  EXPECT_EQ(kg::nn::conv2d(s, 4, 3).shape().to_string(), "[2, 4, 8, 7]");
  auto [d, g3] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 8, kg::dynamic, 20});
  auto dy = kg::nn::conv2d(d, 4, 3, {.stride = 2, .padding = 1});
  EXPECT_EQ(dy.shape().to_string(), "[?, 4, ?, 10]");
  EXPECT_EQ(dy.dtype(), kg::DType::F32);
}

TEST(Conv2d, RejectsBadInputs) {
  auto [flat, g0] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 784});
  kg_test::expect_error(
      [&] {
        kg::NameScope scope(flat, "features");
        kg::nn::conv2d(flat, 8, 3, {}, "0");
      },
      {"[nn.conv2d @ features.0]", "expects a 4-D input [N, C, H, W], got 2-D [?, 784]"});

  auto [unk, g1] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), kg::dynamic, 8, 8});
  kg_test::expect_error([&] { kg::nn::conv2d(unk, 8, 3, {}, "c"); },
                        {"[nn.conv2d @ c]", "known channel count", "[batch, ?, 8, 8]"});

  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 6, 8, 8});
  kg_test::expect_error([&] { kg::nn::conv2d(x, 8, 3, {.groups = 4}, "c"); },
                        {"[nn.conv2d @ c]", "in_channels 6 is not divisible by groups 4"});
  kg_test::expect_error([&] { kg::nn::conv2d(x, 4, 3, {.groups = 3}, "c"); },
                        {"[nn.conv2d @ c]", "out_channels 4 is not divisible by groups 3"});
  kg_test::expect_error([&] { kg::nn::conv2d(x, 4, 9, {}, "c"); },
                        {"[nn.conv2d @ c]", "input height of 8 with padding 0 is smaller than the window 9"});
  kg_test::expect_error(
      [&] {
        kg::nn::conv2d(x, 4, {1, 3}, {.dilation = 5}, "c");
      },
      {"[nn.conv2d @ c]", "input width of 8 with padding 0", "window 11 (kernel 3, dilation 5)"});
  kg_test::expect_error(
      [&] {
        kg::nn::conv2d(x, 4, 3, {.stride = {0, 1}}, "c");
      },
      {"[nn.conv2d @ c]", "stride must be positive, got 0x1"});
  kg_test::expect_error(
      [&] {
        kg::nn::conv2d(x, 4, 3, {.dilation = {1, -2}}, "c");
      },
      {"[nn.conv2d @ c]", "dilation must be positive, got 1x-2"});
  kg_test::expect_error(
      [&] {
        kg::nn::conv2d(x, 4, {3, 0}, {}, "c");
      },
      {"[nn.conv2d @ c]", "kernel size must be positive, got 3x0"});
  kg_test::expect_error(
      [&] {
        kg::nn::conv2d(x, 4, 3, {.padding = {-1, 0}}, "c");
      },
      {"[nn.conv2d @ c]", "padding must be non-negative, got -1x0"});
  kg_test::expect_error([&] { kg::nn::conv2d(x, 0, 3, {}, "c"); },
                        {"[nn.conv2d @ c]", "out_channels must be positive, got 0"});
  kg_test::expect_error([&] { kg::nn::conv2d(x, 6, 3, {.groups = 0}, "c"); },
                        {"[nn.conv2d @ c]", "groups must be positive, got 0"});

  auto [i, g4] = kg::SymTensor::input(kg::DType::I32, {kg::dynamic, 3, 8, 8});
  kg_test::expect_error([&] { kg::nn::conv2d(i, 4, 3, {}, "c"); }, {"[nn.conv2d @ c]", "f32 and f64", "i32"});

  // A dynamic height that turns out too small is reported at load, with the concrete shape.
  auto [dyn, g5] =
      kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, kg::dynamic, kg::dynamic});
  auto y = kg::nn::conv2d(dyn, 4, 5, {.padding = 1}, "c");
  EXPECT_EQ(y.shape().to_string(), "[batch, 4, ?, ?]");
  kg::Model model(g5, {y});
  kg_test::expect_error(
      [&] {
        model.load(kg::Device::cpu(), {{2, 3, 2, 9}});
      },
      {"[nn.conv2d @ c]", "[2, 3, 2, 9]", "input height of 2 with padding 1 is smaller than the window 5"});
  EXPECT_EQ(model.load(kg::Device::cpu(), {{2, 3, 3, 9}}).output_shapes()[0],
            (std::vector<std::int64_t>{2, 4, 1, 7}));
}

TEST(Conv2d, MatchesPyTorchFixtures) {
  for (const char* name :
       {"conv_basic", "conv_stride2", "conv_dilation", "conv_groups_nobias", "conv_depthwise",
        "conv_depthwise_x2", "conv_pointwise", "conv_pointwise_s2", "conv_rect", "conv_big_k_f64"}) {
    SCOPED_TRACE(name);
    std::map<std::string, std::string> meta;
    auto t = kg_test::fixture(std::string(name) + ".safetensors", &meta);
    const kg::Tensor& x = t.at("x");
    auto k = pair_of(meta.at("kernel")), s = pair_of(meta.at("stride")), p = pair_of(meta.at("padding")),
         d = pair_of(meta.at("dilation"));
    ConvCfg cfg{x.dim(1),
                x.dim(2),
                x.dim(3),
                std::stoll(meta.at("out_channels")),
                kg::Size2(k[0], k[1]),
                kg::Size2(s[0], s[1]),
                kg::Size2(p[0], p[1]),
                kg::Size2(d[0], d[1]),
                std::stoll(meta.at("groups")),
                meta.at("bias") == "1"};
    std::map<std::string, kg::Tensor> params{{"conv.weight", t.at("weight")}};
    if (cfg.bias) params["conv.bias"] = t.at("bias");
    for (bool dynamic_hw : {false, true}) {
      kg::Tensor y = run_conv(x, cfg, params, dynamic_hw);
      const bool f64 = x.dtype() == kg::DType::F64;
      EXPECT_TRUE(kg_test::all_close(y, t.at("y"), f64 ? 1e-12 : 1e-5, f64 ? 1e-12 : 1e-5));
    }
  }
}

TEST(Conv2d, MatchesNaiveReferenceAtSeveralBatches) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<ConvCfg> configs = {
      {3, 9, 7, 5, 3, 1, 1},                             // padded 3x3
      {4, 10, 11, 6, 3, 2, 1, 1, 1, false},              // strided, no bias
      {64, 14, 14, 4, 3, 1, 1},                          // K = 576: several pixel tiles per image
      {16, 24, 24, 5, 1},                                // 1x1 stride 1: no im2col, two tiles
      {8, 9, 9, 12, 1, 2},                               // 1x1 stride 2
      {6, 8, 9, 15, {3, 2}, {1, 2}, {2, 0}, {2, 1}, 3},  // grouped GEMMs, rectangular, dilated
      {6, 8, 9, 9, 3, 1, 1, 1, 3},                       // grouped, 3 outputs per group: direct loop
      {8, 9, 9, 8, 3, 2, 1, 1, 8},                       // depthwise
      {4, 7, 6, 8, 5, 1, 2, 1, 4, false},                // depthwise, channel multiplier 2
      {3, 5, 5, 2, 5, 1, 0},                             // window as large as the input
  };
  for (const ConvCfg& cfg : configs) {
    for (std::int64_t batch : {1, 7, 64}) {
      for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
        SCOPED_TRACE(cfg.text() + " batch " + std::to_string(batch) + " " + std::string(kg::dtype_name(dt)));
        kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, cfg.c, cfg.h, cfg.w});
        const double bound =
            1.0 / std::sqrt(static_cast<double>(cfg.c / cfg.groups * cfg.kernel.h * cfg.kernel.w));
        kg::Tensor w = kg_test::random_tensor(
            rng, dt, {cfg.out, cfg.c / cfg.groups, cfg.kernel.h, cfg.kernel.w}, -bound, bound);
        kg::Tensor b = kg_test::random_tensor(rng, dt, {cfg.out});
        std::map<std::string, kg::Tensor> params{{"conv.weight", w}};
        if (cfg.bias) params["conv.bias"] = b;
        kg::Tensor y = run_conv(x, cfg, params, batch == 7);
        EXPECT_TRUE(kg_test::all_close(y, naive_conv(x, w, cfg.bias ? &b : nullptr, cfg),
                                       dt == kg::DType::F32 ? 1e-4 : 1e-12,
                                       dt == kg::DType::F32 ? 1e-5 : 1e-12));
      }
    }
  }
}

// Each algorithm on shapes that reach its edges: output channels that are not a multiple of
// the kernel's 8-channel panels (and fewer than 8), pixel counts that leave partial 16- and
// 48-column tiles, more taps than one tap block (K > 256), strides and dilations that split
// the input into phases, a 1x1 strided convolution that reads one phase, blocks that span
// images, and both forms of Direct: in place (stride 1, "same" width) and transformed.
TEST(Conv2d, EveryAlgorithmMatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  using kg::ops::ConvAlgo;
  const std::vector<ConvCfg> configs = {
      {3, 7, 9, 5, 3, 1, 1},                           // 5 channels: one partial panel
      {40, 6, 7, 12, 3, 1, 1},                         // K = 360: two tap blocks; 12 channels
      {8, 11, 13, 16, 3, 2, 1},                        // stride 2: four phases
      {4, 12, 10, 9, {3, 2}, {2, 3}, {2, 1}, {2, 3}},  // mixed strides and dilations
      {6, 9, 9, 8, 1, 2},                              // 1x1 stride 2: one phase
      {16, 5, 7, 24, 1},                               // 1x1 stride 1: the input itself
      {12, 8, 8, 20, 3, 1, 1, 1, 2},                   // two groups of 10 channels
      {2, 20, 23, 8, 5, 2, 2, 1, 1, false},            // wide rows, no bias
      {5, 10, 12, 9, 3, 1, 0},                         // stride 1 without padding: transformed
      {4, 9, 11, 10, 3, 1, 2, 2},                      // dilated "same": in place
      {3, 6, 6, 8, {3, 5}, 1, {0, 2}},                 // in place, no vertical padding
      // Rows: its row form (one and two vectors per row chunk, several chunks, a partial
      // channel block) and its pixel form (a full and a partial block of 16 channels).
      {1, 28, 28, 6, 5, 1, 2},                     // LeNet-5's first layer: 6 channels, 2 vectors
      {6, 14, 14, 16, 5},                          // LeNet-5's second: pixel form, 10 pixels
      {3, 40, 37, 13, 3, 1, 1},                    // rows of 37: two chunks; blocks of 7 and 6
      {2, 9, 8, 20, 3, 1, 1},                      // pixel form, blocks of 16 and 4
      {4, 11, 19, 5, {3, 2}, {2, 1}, {1, 0}, {2, 1}},  // vertical stride and dilation
      {4, 8, 12, 6, 3, 1, 1, 1, 2},                // two groups
      {3, 7, 15, 16, 3, 1, 1},                     // pixel form, two chunks of 8 pixels
  };
  for (const ConvCfg& cfg : configs) {
    for (std::int64_t batch : {1, 7, 19}) {
      for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
        kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, cfg.c, cfg.h, cfg.w});
        kg::Tensor w = kg_test::random_tensor(
            rng, dt, {cfg.out, cfg.c / cfg.groups, cfg.kernel.h, cfg.kernel.w}, -0.2, 0.2);
        kg::Tensor b = kg_test::random_tensor(rng, dt, {cfg.out});
        const kg::Tensor want = naive_conv(x, w, cfg.bias ? &b : nullptr, cfg);
        for (ConvAlgo algo :
             {ConvAlgo::Gemm, ConvAlgo::Depthwise, ConvAlgo::Direct, ConvAlgo::Packed, ConvAlgo::Rows}) {
          if (!kg::ops::conv_algo_available(algo, dt)) continue;
          SCOPED_TRACE(cfg.text() + " batch " + std::to_string(batch) + " " +
                       std::string(kg::dtype_name(dt)) + " " + algo_name(algo));
          kg::Tensor y = run_algo(algo, x, w, cfg.bias ? &b : nullptr, cfg);
          EXPECT_TRUE(kg_test::all_close(y, want, dt == kg::DType::F32 ? 1e-4 : 1e-12,
                                         dt == kg::DType::F32 ? 1e-5 : 1e-12));
        }
      }
    }
  }
}

TEST(Conv2d, AlgorithmChoice) {
  using kg::ops::ConvAlgo;
  auto algo = [](std::int64_t c, std::int64_t hw, std::int64_t out, kg::Size2 k, kg::nn::Conv2dOptions o,
                 kg::DType dt = kg::DType::F32) {
    return kg::ops::conv_algo_for(kg::ops::Conv2dOp(c, out, k, o, dt), {2, c, hw, hw}, dt);
  };
  EXPECT_EQ(algo(32, 8, 32, 3, {.padding = 1, .groups = 32}), ConvAlgo::Depthwise);
  EXPECT_EQ(algo(32, 8, 128, 3, {.padding = 1, .groups = 32}), ConvAlgo::Depthwise);
  EXPECT_EQ(algo(64, 8, 64, 3, {.padding = 1}, kg::DType::F64), ConvAlgo::Gemm);
  if (!kg::ops::conv_algo_available(ConvAlgo::Direct, kg::DType::F32)) {
    EXPECT_EQ(algo(64, 56, 64, 3, {.padding = 1}), ConvAlgo::Gemm);
    return;
  }
  // Wide images: the few dropped columns of Direct cost less than gathering.
  EXPECT_EQ(algo(64, 56, 64, 3, {.padding = 1}), ConvAlgo::Direct);
  EXPECT_EQ(algo(3, 224, 64, 7, {.stride = 2, .padding = 3}), ConvAlgo::Direct);
  // 7x7 with many channels: Direct would drop 2 of every 9 columns.
  EXPECT_EQ(algo(512, 7, 512, 3, {.padding = 1}), ConvAlgo::Packed);
  // Few output channels with stride-1 columns: Rows.
  EXPECT_EQ(algo(1, 28, 6, 5, {.padding = 2}), ConvAlgo::Rows);
  EXPECT_EQ(algo(6, 14, 16, 5, {}), ConvAlgo::Rows);
  EXPECT_EQ(algo(3, 32, 16, 3, {.stride = 2, .padding = 1}), ConvAlgo::Direct);
}
