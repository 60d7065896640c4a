#include <cmath>
#include <sstream>

#include "ops/conv_transpose.hpp"
#include "support/gpu_util.hpp"
#include "support/test_util.hpp"

using kg::ops::ConvTranspose2dOptions;
using kg_test::fresh_seed;

namespace {

struct CtCfg {
  std::int64_t c, h, w, out, kh, kw;
  ConvTranspose2dOptions o;

  std::string text() const {
    std::ostringstream os;
    os << "c=" << c << " h=" << h << " w=" << w << " out=" << out << " k=" << kh << "x" << kw
       << " s=" << o.stride_h << "x" << o.stride_w << " pads=" << o.pad_top << "," << o.pad_left << ","
       << o.pad_bottom << "," << o.pad_right << " output_padding=" << o.output_padding_h << "x"
       << o.output_padding_w << " d=" << o.dilation_h << "x" << o.dilation_w << " groups=" << o.groups
       << " bias=" << o.bias;
    return os.str();
  }
  // Written out from the definition (not through the op).
  std::int64_t ho(std::int64_t in) const {
    return o.stride_h * (in - 1) + o.output_padding_h + o.dilation_h * (kh - 1) + 1 - o.pad_top -
           o.pad_bottom;
  }
  std::int64_t wo(std::int64_t in) const {
    return o.stride_w * (in - 1) + o.output_padding_w + o.dilation_w * (kw - 1) + 1 - o.pad_left -
           o.pad_right;
  }
};

ConvTranspose2dOptions opts(std::int64_t sh, std::int64_t sw, std::int64_t pt, std::int64_t pl,
                            std::int64_t pb, std::int64_t pr, std::int64_t oph = 0, std::int64_t opw = 0,
                            std::int64_t dh = 1, std::int64_t dw = 1, std::int64_t groups = 1,
                            bool bias = true) {
  ConvTranspose2dOptions o;
  o.stride_h = sh, o.stride_w = sw, o.pad_top = pt, o.pad_left = pl, o.pad_bottom = pb, o.pad_right = pr;
  o.output_padding_h = oph, o.output_padding_w = opw, o.dilation_h = dh, o.dilation_w = dw;
  o.groups = groups, o.bias = bias;
  return o;
}

// The scatter definition in double: every input pixel x[n, c, iy, ix] adds x * w[c, m, ky, kx]
// into y[n, g*og + m, iy*sh - pad_top + ky*dh, ix*sw - pad_left + kx*dw] for each output channel
// m of its group g (when that lands inside the output), on top of the bias.
kg::Tensor naive_conv_transpose(const kg::Tensor& x, const kg::Tensor& w, const kg::Tensor* b,
                                const CtCfg& cfg) {
  const std::int64_t n = x.dim(0), c = x.dim(1), h = x.dim(2), wd = x.dim(3);
  const std::int64_t ho = cfg.ho(h), wo = cfg.wo(wd), o = cfg.out;
  const std::int64_t cg = c / cfg.o.groups, og = o / cfg.o.groups;
  kg::Tensor y = kg::Tensor::zeros(kg::DType::F64, {n, o, ho, wo});
  double* yp = y.data<double>();
  for (std::int64_t img = 0; img < n; ++img)
    for (std::int64_t oc = 0; oc < o; ++oc)
      for (std::int64_t p = 0; p < ho * wo; ++p) yp[(img * o + oc) * ho * wo + p] = b ? b->item(oc) : 0.0;
  for (std::int64_t img = 0; img < n; ++img)
    for (std::int64_t ci = 0; ci < c; ++ci)
      for (std::int64_t iy = 0; iy < h; ++iy)
        for (std::int64_t ix = 0; ix < wd; ++ix) {
          const double v = x.item(((img * c + ci) * h + iy) * wd + ix);
          const std::int64_t grp = ci / cg;
          for (std::int64_t m = 0; m < og; ++m)
            for (std::int64_t ky = 0; ky < cfg.kh; ++ky)
              for (std::int64_t kx = 0; kx < cfg.kw; ++kx) {
                const std::int64_t oy = iy * cfg.o.stride_h - cfg.o.pad_top + ky * cfg.o.dilation_h;
                const std::int64_t ox = ix * cfg.o.stride_w - cfg.o.pad_left + kx * cfg.o.dilation_w;
                if (oy < 0 || oy >= ho || ox < 0 || ox >= wo) continue;
                yp[((img * o + grp * og + m) * ho + oy) * wo + ox] +=
                    v * w.item(((ci * og + m) * cfg.kh + ky) * cfg.kw + kx);
              }
        }
  return y;
}

// Records the op on an input declared [batch, C, H, W] (H and W dynamic when `dynamic_hw`),
// loads it for x's shape with poisoned buffers, sets the parameters and runs it.
kg::Tensor run_ct(const kg::Tensor& x, const CtCfg& cfg, const std::map<std::string, kg::Tensor>& params,
                  bool dynamic_hw) {
  auto g = kg::Graph::create();
  kg::Shape s{kg::Dim::named("batch"), x.dim(1), dynamic_hw ? kg::Dim(kg::dynamic) : kg::Dim(x.dim(2)),
              dynamic_hw ? kg::Dim(kg::dynamic) : kg::Dim(x.dim(3))};
  auto in = g->input(x.dtype(), s, "x");
  auto y = kg::ops::conv_transpose2d(in, cfg.out, cfg.kh, cfg.kw, cfg.o, "ct");
  kg::Model model(g, {y});
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  kg::LoadedModel m = model.load(kg::Device::cpu(), {x.shape()}, opt);
  m.load_state_dict(params);
  kg::Tensor out = m.forward({x})[0];
  EXPECT_TRUE(kg_test::all_written(out)) << "the transposed convolution left output elements unwritten";
  return out;
}

// Random parameters of cfg's shapes under the node name "ct".
std::map<std::string, kg::Tensor> random_params(std::mt19937_64& rng, kg::DType dt, const CtCfg& cfg) {
  std::map<std::string, kg::Tensor> p{
      {"ct.weight",
       kg_test::random_tensor(rng, dt, {cfg.c, cfg.out / cfg.o.groups, cfg.kh, cfg.kw}, -0.5, 0.5)}};
  if (cfg.o.bias) p["ct.bias"] = kg_test::random_tensor(rng, dt, {cfg.out});
  return p;
}

}  // namespace

TEST(ConvTranspose2d, ShapeInference) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 16, 7, 9});
  // DCGAN-style upsampling: 2*(7-1) + 4 - 1 - 1 = 14.
  auto y = kg::ops::conv_transpose2d(x, 8, 4, 4, opts(2, 2, 1, 1, 1, 1), "up");
  EXPECT_EQ(y.shape().to_string(), "[batch, 8, 14, 18]");
  const kg::Node& node = g->node(y.node());
  EXPECT_EQ(node.op->name(), "nn.conv_transpose2d");
  EXPECT_EQ(node.op->op().attributes(), "out=8 k=4 s=2 pads=1,1,1,1");
  ASSERT_EQ(node.params.size(), 2u);
  EXPECT_EQ(node.params[0].name, "up.weight");
  EXPECT_EQ(node.params[0].shape, (std::vector<std::int64_t>{16, 8, 4, 4}));
  EXPECT_EQ(node.params[1].name, "up.bias");
  EXPECT_EQ(node.params[1].shape, (std::vector<std::int64_t>{8}));
  // PyTorch's default: the fan-in of a [Cin, Cout/groups, kh, kw] weight is Cout/groups * kh * kw.
  for (const auto& p : node.params) {
    EXPECT_EQ(p.init.kind, kg::ParamInit::Kind::Uniform);
    EXPECT_DOUBLE_EQ(p.init.b, 1.0 / std::sqrt(8.0 * 16.0));
    EXPECT_DOUBLE_EQ(p.init.a, -p.init.b);
    EXPECT_TRUE(p.trainable);
    EXPECT_EQ(p.dtype, kg::DType::F32);
  }

  // Asymmetric pads, output padding, dilation, groups, no bias; f64 parameters.
  auto [d, g2] = kg::SymTensor::input(kg::DType::F64, {kg::dynamic, 6, kg::dynamic, 5});
  auto z = kg::ops::conv_transpose2d(d, 9, 3, 2, opts(3, 2, 0, 1, 2, 0, 2, 1, 1, 2, 3, false), "z");
  // H dynamic; W: 2*(5-1) + 1 + 2*(2-1) + 1 - 1 - 0 = 11.
  EXPECT_EQ(z.shape().to_string(), "[?, 9, ?, 11]");
  const kg::Node& zn = g2->node(z.node());
  EXPECT_EQ(zn.op->op().attributes(),
            "out=9 k=3x2 s=3x2 pads=0,1,2,0 output_padding=2x1 d=1x2 groups=3 bias=false");
  ASSERT_EQ(zn.params.size(), 1u);
  EXPECT_EQ(zn.params[0].shape, (std::vector<std::int64_t>{6, 3, 3, 2}));
  EXPECT_EQ(zn.params[0].dtype, kg::DType::F64);
  EXPECT_DOUBLE_EQ(zn.params[0].init.b, 1.0 / std::sqrt(3.0 * 6.0));
  // The concrete height at load: 3*(4-1) + 2 + 1*(3-1) + 1 - 0 - 2 = 12.
  EXPECT_EQ(zn.op->op().infer_output_shape({kg::Shape{2, 6, 4, 5}}).to_string(), "[2, 9, 12, 11]");

  // The op on its own, as an importer builds it.
  auto op = kg::ops::conv_transpose2d_op(4, 1, 1, {}, kg::DType::F64);
  EXPECT_EQ(op->infer_output_shape({kg::Shape{kg::Dim::named("n"), 2, 3, 3}}).to_string(), "[n, 4, 3, 3]");
  EXPECT_EQ(op->infer_output_dtype({kg::DType::F64}), kg::DType::F64);
  EXPECT_EQ(op->parameters({kg::Shape{1, 2, 3, 3}}).at(0).shape, (std::vector<std::int64_t>{2, 4, 1, 1}));
}

TEST(ConvTranspose2d, RejectsBadInputs) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 6, 5, 5});
  auto ct = [&](std::int64_t out, std::int64_t kh, std::int64_t kw, const ConvTranspose2dOptions& o) {
    kg::ops::conv_transpose2d(x, out, kh, kw, o, "ct");
  };
  const std::string at = "[nn.conv_transpose2d @ ct]";
  kg_test::expect_error([&] { ct(0, 3, 3, {}); }, {at, "out_channels must be positive, got 0"});
  kg_test::expect_error([&] { ct(4, 0, 3, {}); }, {at, "kernel size must be positive, got 0x3"});
  kg_test::expect_error([&] { ct(4, 3, 3, opts(1, 0, 0, 0, 0, 0)); },
                        {at, "stride must be positive, got 1x0"});
  kg_test::expect_error([&] { ct(4, 3, 3, opts(-2, 1, 0, 0, 0, 0)); },
                        {at, "stride must be positive, got -2x1"});
  kg_test::expect_error([&] { ct(4, 3, 3, opts(1, 1, 0, 0, 0, 0, 0, 0, 0, 1)); },
                        {at, "dilation must be positive, got 0x1"});
  kg_test::expect_error([&] { ct(4, 3, 3, opts(1, 1, 0, 0, -1, 0)); },
                        {at, "pads must be non-negative, got top 0, left 0, bottom -1, right 0"});
  kg_test::expect_error([&] { ct(4, 3, 3, opts(2, 2, 0, 0, 0, 0, -1, 0)); },
                        {at, "output_padding must be non-negative, got -1x0"});
  // PyTorch's rule: smaller than the stride or the dilation.
  kg_test::expect_error([&] { ct(4, 3, 3, opts(2, 2, 0, 0, 0, 0, 2, 0)); },
                        {at, "output_padding 2x0 must be smaller than the stride 2x2 or the dilation 1x1"});
  kg_test::expect_error([&] { ct(4, 3, 3, opts(1, 1, 0, 0, 0, 0, 0, 1)); },
                        {at, "output_padding 0x1 must be smaller than the stride 1x1 or the dilation 1x1"});
  // ... but smaller than the dilation alone is allowed (stride 1, dilation 2, output_padding 1).
  EXPECT_EQ(kg::ops::conv_transpose2d(x, 4, 3, 3, opts(1, 1, 0, 0, 0, 0, 1, 0, 2, 1)).shape().to_string(),
            "[?, 4, 10, 7]");
  kg_test::expect_error([&] { ct(4, 3, 3, opts(1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0)); },
                        {at, "groups must be positive, got 0"});
  kg_test::expect_error([&] { ct(4, 3, 3, opts(1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 4)); },
                        {at, "in_channels 6 is not divisible by groups 4"});
  kg_test::expect_error([&] { ct(4, 3, 3, opts(1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 3)); },
                        {at, "out_channels 4 is not divisible by groups 3"});
  // 1*(5-1) + 0 + 1*(3-1) + 1 - 4 - 4 = -1.
  kg_test::expect_error([&] { ct(4, 3, 3, opts(1, 1, 4, 0, 4, 0)); },
                        {at, "output height 1*(5-1) + 0 + 1*(3-1) + 1 - 4 - 4 = -1 is not positive",
                         "input height 5, stride 1, output_padding 0, dilation 1, kernel 3, pads 4 and 4"});
  kg_test::expect_error([&] { ct(4, 3, 3, opts(1, 1, 0, 3, 0, 4)); },
                        {at, "output width 1*(5-1) + 0 + 1*(3-1) + 1 - 3 - 4 = 0 is not positive"});

  auto [flat, g1] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 6, 5});
  kg_test::expect_error([&] { kg::ops::conv_transpose2d(flat, 4, 3, 3, {}, "ct"); },
                        {at, "expects a 4-D input [N, C, H, W], got 3-D [?, 6, 5]"});
  auto [dc, g2] = kg::SymTensor::input(kg::DType::F32, {2, kg::dynamic, 5, 5});
  kg_test::expect_error([&] { kg::ops::conv_transpose2d(dc, 4, 3, 3, {}, "ct"); },
                        {at, "needs a known channel count (dim 1) to size its weight, got [2, ?, 5, 5]"});
  auto [i, g3] = kg::SymTensor::input(kg::DType::I32, {2, 6, 5, 5});
  kg_test::expect_error([&] { kg::ops::conv_transpose2d(i, 4, 3, 3, {}, "ct"); }, {at, "f32 and f64", "i32"});
  // Parameters of another dtype than the input.
  auto [f, g4] = kg::SymTensor::input(kg::DType::F64, {2, 6, 5, 5});
  kg_test::expect_error(
      [&] {
        f.record_custom(kg::ops::conv_transpose2d_op(4, 3, 3, {}, kg::DType::F32), {}, std::nullopt, "ct");
      },
      {at, "input is f64 but the parameters are f32"});

  // A dynamic height too small for the pads is reported at load.
  auto [d, g5] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 2, kg::dynamic, 4});
  auto y = kg::ops::conv_transpose2d(d, 3, 2, 2, opts(1, 1, 2, 0, 2, 0), "ct");
  kg::Model model(g5, {y});
  kg_test::expect_error(
      [&] {
        model.load(kg::Device::cpu(), {{1, 2, 2, 4}});
      },
      {at, "output height 1*(2-1) + 0 + 1*(2-1) + 1 - 2 - 2 = -1 is not positive"});
}

TEST(ConvTranspose2d, MatchesNaiveScatterReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // Channels per group: cg * og <= 16 takes the direct scatter, more the GEMM + col2im.
  const std::vector<CtCfg> configs = {
      {8, 5, 6, 6, 3, 3, opts(1, 1, 0, 0, 0, 0)},                   // plain 3x3, GEMM
      {8, 6, 5, 4, 4, 4, opts(2, 2, 1, 1, 1, 1)},                   // stride 2 (DCGAN)
      {6, 5, 7, 5, 3, 3, opts(2, 3, 0, 2, 1, 0, 1, 2)},             // asymmetric pads, output padding
      {6, 4, 5, 8, 3, 2, opts(2, 1, 1, 0, 0, 1, 1, 1, 2, 3)},       // dilation; output_padding_w = stride_w
      {12, 5, 5, 9, 3, 3, opts(2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 3)},   // groups (cg 4, og 3: direct)
      {12, 5, 5, 18, 2, 3, opts(1, 2, 0, 1, 1, 0, 0, 1, 1, 1, 2)},  // groups (cg 6, og 9: GEMM)
      {5, 6, 7, 5, 3, 3, opts(2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 5)},    // depthwise
      {4, 5, 4, 8, 3, 3, opts(1, 1, 1, 1, 1, 1, 0, 0, 2, 2, 4, false)},  // depthwise x2, dilated, no bias
      {7, 4, 4, 5, 1, 1, opts(1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, false)},  // 1x1, no bias
      {3, 3, 3, 6, 5, 5, opts(3, 3, 4, 4, 4, 4, 2, 2)},                  // pads crop most of the taps
      {16, 2, 3, 12, 3, 3, opts(2, 2, 0, 0, 0, 0)},                      // more channels than pixels
  };
  for (const CtCfg& cfg : configs) {
    for (std::int64_t batch : {1, 3, 8}) {
      for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
        SCOPED_TRACE(cfg.text() + " batch " + std::to_string(batch) + " " + std::string(kg::dtype_name(dt)));
        kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, cfg.c, cfg.h, cfg.w});
        auto params = random_params(rng, dt, cfg);
        kg::Tensor y = run_ct(x, cfg, params, batch == 3);
        const kg::Tensor* b = cfg.o.bias ? &params.at("ct.bias") : nullptr;
        EXPECT_TRUE(kg_test::all_close(y, naive_conv_transpose(x, params.at("ct.weight"), b, cfg),
                                       dt == kg::DType::F32 ? 1e-5 : 1e-12,
                                       dt == kg::DType::F32 ? 1e-5 : 1e-12));
      }
    }
  }
}

// Images large enough that the GEMM's column matrix is built a band of input rows at a time,
// and small ones batched several images to a GEMM.
TEST(ConvTranspose2d, GemmBlocksMatchNaiveScatterReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<std::pair<CtCfg, std::int64_t>> cases = {
      // 32 * 16 col rows x 128*136 pixels > 2M floats: bands of rows.
      {{4, 128, 136, 32, 4, 4, opts(2, 2, 1, 1, 1, 1)}, 1},
      {{6, 3, 4, 8, 3, 3, opts(1, 1, 0, 0, 0, 0)}, 37},
  };
  for (const auto& [cfg, batch] : cases) {
    SCOPED_TRACE(cfg.text() + " batch " + std::to_string(batch));
    kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {batch, cfg.c, cfg.h, cfg.w});
    auto params = random_params(rng, kg::DType::F32, cfg);
    kg::Tensor y = run_ct(x, cfg, params, false);
    EXPECT_TRUE(kg_test::all_close(
        y, naive_conv_transpose(x, params.at("ct.weight"), &params.at("ct.bias"), cfg), 1e-5, 1e-5));
  }
}

// check_op: shapes at several batch sizes, the CPU against the naive reference, the kernel
// under the emulator (checked mode, both thread orders) and on a GPU when there is one.
TEST(ConvTranspose2d, CheckOpWithEmulatedKernel) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<CtCfg> configs = {
      {4, 3, 4, 6, 3, 3, opts(2, 2, 1, 0, 0, 1, 1, 1)},
      {6, 4, 3, 3, 2, 3, opts(1, 2, 0, 1, 1, 0, 0, 1, 2, 1, 3, false)},
      {3, 3, 3, 3, 3, 3, opts(2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 3)},
  };
  for (const CtCfg& cfg : configs) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      SCOPED_TRACE(cfg.text() + " " + std::string(kg::dtype_name(dt)));
      kg::testing::CheckOpOptions o;
      o.seed = seed;
      o.batch_sizes = {1, 2};
      o.rtol = dt == kg::DType::F32 ? 1e-5 : 1e-12;
      o.atol = dt == kg::DType::F32 ? 1e-5 : 1e-12;
      o.reference = [&](const std::vector<kg::Tensor>& in, const std::map<std::string, kg::Tensor>& p) {
        return naive_conv_transpose(in[0], p.at("weight"), cfg.o.bias ? &p.at("bias") : nullptr, cfg);
      };
      auto r = kg::testing::check_op(kg::ops::conv_transpose2d_op(cfg.out, cfg.kh, cfg.kw, cfg.o, dt),
                                     {{kg::Dim::named("n"), cfg.c, cfg.h, cfg.w}}, {dt}, o);
      EXPECT_TRUE(r.ok) << r.to_string();
      EXPECT_EQ(kg_test::count_lines(r, "PASS batch 2, emulator"), 1) << r.to_string();
      EXPECT_EQ(kg_test::count_lines(r, "PASS batch 2, reference"), 1) << r.to_string();
    }
  }
}

// The kernel compiled with NVRTC for sm_90 where NVRTC is present (its launches checked against
// the PTX), emulated against the CPU, and run on a GPU when there is one, on larger shapes.
TEST(ConvTranspose2d, LowersForTheGpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<CtCfg> configs = {
      {16, 9, 11, 8, 4, 4, opts(2, 2, 1, 1, 1, 1)},
      {12, 7, 6, 12, 3, 3, opts(2, 1, 0, 1, 2, 0, 1, 0, 1, 2, 12)},
      {6, 5, 5, 9, 3, 2, opts(3, 2, 2, 0, 1, 1, 2, 1, 1, 1, 3, false)},
  };
  for (const CtCfg& cfg : configs)
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      SCOPED_TRACE(cfg.text() + " " + std::string(kg::dtype_name(dt)));
      kg_test::check_lowering(
          [&](const std::vector<kg::SymTensor>& xs) {
            return std::vector<kg::SymTensor>{
                kg::ops::conv_transpose2d(xs[0], cfg.out, cfg.kh, cfg.kw, cfg.o)};
          },
          {kg_test::random_tensor(rng, dt, {3, cfg.c, cfg.h, cfg.w})}, dt == kg::DType::F32 ? 1e-5 : 1e-12,
          dt == kg::DType::F32 ? 1e-5 : 1e-12);
    }
}
