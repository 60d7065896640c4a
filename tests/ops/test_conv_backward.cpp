// The backward of nn.conv2d: the CPU backward against central finite differences in f64 and
// the backward kernels under the CUDA emulator against the CPU backward
// (kg::testing::check_gradients), over strides, padding, dilation, groups and bias; the f32 CPU
// backward against a naive reference on NaN-poisoned gradients, with every gradient and with
// some not wanted; and the RuntimeOp's backward launches.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <sstream>

#include "backend/emu/executor.hpp"
#include "kg/testing.hpp"
#include "ops/conv.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

using kg_test::nan_tensor;
using kg_test::matches;

struct Cfg {
  std::int64_t n, c, h, w, out;
  kg::Size2 kernel, stride = 1, padding = 0, dilation = 1;
  std::int64_t groups = 1;
  bool bias = true;

  kg::nn::Conv2dOptions options() const { return {stride, padding, dilation, groups, bias}; }
  kg::CustomData op(kg::DType dtype) const {
    return kg::CustomData::make<kg::ops::Conv2dOp>(c, out, kernel, options(), dtype);
  }
  std::vector<std::int64_t> input_shape() const { return {n, c, h, w}; }
  // What the lowering of a training model tells the op at these shapes.
  kg::LowerContext lower_context(kg::DType dtype) const {
    kg::LowerContext ctx;
    ctx.node = "conv";
    ctx.input_dtypes = {dtype};
    ctx.output_dtype = dtype;
    ctx.input_shapes = {kg::Shape::of(input_shape())};
    ctx.output_shape = op(dtype)->infer_output_shape(ctx.input_shapes);
    ctx.concrete_input_shapes = {input_shape()};
    ctx.concrete_output_shape = ctx.output_shape.sizes();
    ctx.mode = kg::LoweringMode::Training;
    return ctx;
  }
  std::string text() const {
    std::ostringstream os;
    os << "n=" << n << " c=" << c << " h=" << h << " w=" << w << " out=" << out << " k=" << kernel.h << "x"
       << kernel.w << " s=" << stride.h << "x" << stride.w << " p=" << padding.h << "x" << padding.w
       << " d=" << dilation.h << "x" << dilation.w << " groups=" << groups << " bias=" << bias;
    return os.str();
  }
};

// Small configurations for the finite-difference and emulator checks.
std::vector<Cfg> small_configs() {
  return {
      {2, 3, 7, 6, 4, 3},                                          // plain 3x3
      {2, 3, 7, 7, 5, 3, 1, 1},                                    // "same" padding
      {2, 2, 9, 8, 3, {3, 2}, {2, 3}, {1, 0}},                     // strided, rectangular
      {2, 4, 9, 9, 6, 3, 2, 1, 2, 2},                              // dilated, grouped
      {2, 4, 6, 5, 4, 3, 1, 1, 1, 4, false},                       // depthwise, no bias
      {3, 6, 5, 5, 4, 1},                                          // pointwise (1x1)
      {2, 1, 12, 12, 3, 5, 1, 2},                                  // LeNet's first layer, smaller
      {2, 3, 5, 4, 2, 2, 3, 0, 1, 1, false},                       // stride > kernel: skipped inputs
      {1, 2, 4, 4, 2, 3, 1, 2},                                    // padding wider than the image reach
      {2, 3, 5, 5, 4, 1, 1, 1},                                    // 1x1 with padding: taps off the image
  };
}

kg::testing::CheckOpReport gradients(const Cfg& cfg, kg::DType dtype, std::uint64_t seed) {
  kg::testing::GradCheckOptions o;
  o.seed = seed;
  return kg::testing::check_gradients(cfg.op(dtype), {cfg.input_shape()}, {dtype}, o);
}

// The gradients in double, by the definition: for y[n, o, i, j] = b[o] + sum over the group's
// channels c and the taps of w[o, c, ky, kx] * x[n, g*C/G + c, i*s - p + ky*d, j*s - p + kx*d],
// dx, dw and db accumulate dy[n, o, i, j] times the other factor.
struct Grads {
  std::vector<double> dx, dw, db;
};
Grads naive_backward(const Cfg& cfg, const kg::Tensor& x, const kg::Tensor& w, const kg::Tensor& dy) {
  const std::int64_t ho = dy.dim(2), wo = dy.dim(3), cg = cfg.c / cfg.groups, og = cfg.out / cfg.groups;
  Grads g;
  g.dx.assign(static_cast<std::size_t>(x.numel()), 0.0);
  g.dw.assign(static_cast<std::size_t>(w.numel()), 0.0);
  g.db.assign(static_cast<std::size_t>(cfg.out), 0.0);
  for (std::int64_t n = 0; n < cfg.n; ++n)
    for (std::int64_t o = 0; o < cfg.out; ++o)
      for (std::int64_t i = 0; i < ho; ++i)
        for (std::int64_t j = 0; j < wo; ++j) {
          const double d = dy.item(((n * cfg.out + o) * ho + i) * wo + j);
          g.db[static_cast<std::size_t>(o)] += d;
          for (std::int64_t c = 0; c < cg; ++c)
            for (std::int64_t ky = 0; ky < cfg.kernel.h; ++ky)
              for (std::int64_t kx = 0; kx < cfg.kernel.w; ++kx) {
                const std::int64_t iy = i * cfg.stride.h - cfg.padding.h + ky * cfg.dilation.h;
                const std::int64_t ix = j * cfg.stride.w - cfg.padding.w + kx * cfg.dilation.w;
                if (iy < 0 || iy >= cfg.h || ix < 0 || ix >= cfg.w) continue;
                const std::int64_t xi = ((n * cfg.c + o / og * cg + c) * cfg.h + iy) * cfg.w + ix;
                const std::int64_t wi = ((o * cg + c) * cfg.kernel.h + ky) * cfg.kernel.w + kx;
                g.dx[static_cast<std::size_t>(xi)] += d * w.item(wi);
                g.dw[static_cast<std::size_t>(wi)] += d * x.item(xi);
              }
        }
  return g;
}

// Runs the op's CPU backward on f32 tensors with the gradients in `want` (input, weight, bias)
// poisoned with NaN and the others undefined, and checks them against the naive reference.
void check_against_naive(const Cfg& cfg, std::mt19937_64& rng, std::array<bool, 3> want) {
  SCOPED_TRACE(cfg.text() + " want dx/dw/db=" + std::to_string(want[0]) + std::to_string(want[1]) +
               std::to_string(want[2]));
  const kg::DType f32 = kg::DType::F32;
  const kg::CustomData op = cfg.op(f32);
  const kg::Shape out_shape = op->infer_output_shape({kg::Shape::of(cfg.input_shape())});
  std::vector<kg::Tensor> inputs{kg_test::random_tensor(rng, f32, cfg.input_shape())};
  std::vector<kg::Tensor> params;
  for (const kg::ParamSpec& p : op->parameters({kg::Shape::of(cfg.input_shape())}))
    params.push_back(kg_test::random_tensor(rng, f32, p.shape));
  const kg::Tensor dy = kg_test::random_tensor(rng, f32, out_shape.sizes());
  const kg::Tensor output = kg::Tensor::wrap(nullptr, f32, out_shape.sizes());  // not saved
  std::vector<kg::Tensor> grad_in{want[0] ? nan_tensor(f32, cfg.input_shape())
                                          : kg::Tensor::wrap(nullptr, f32, cfg.input_shape())};
  std::vector<kg::Tensor> grad_params;
  for (std::size_t k = 0; k < params.size(); ++k)
    grad_params.push_back(want[k + 1] ? nan_tensor(f32, params[k].shape())
                                      : kg::Tensor::wrap(nullptr, f32, params[k].shape()));
  kg::CpuBackwardContext ctx(inputs, params, output, dy, grad_in, grad_params, true, 0);
  op->cpu_backward(ctx);

  const Grads ref = naive_backward(cfg, inputs[0], params[0], dy);
  // f32 sums of up to a few thousand products of values in [-1, 1].
  const double rtol = 1e-4, atol = 1e-4;
  if (want[0]) {
    EXPECT_TRUE(matches(grad_in[0], ref.dx, rtol, atol)) << "input gradient";
  }
  if (want[1]) {
    EXPECT_TRUE(matches(grad_params[0], ref.dw, rtol, atol)) << "weight gradient";
  }
  if (cfg.bias && want[2]) {
    EXPECT_TRUE(matches(grad_params[1], ref.db, rtol, atol)) << "bias gradient";
  }
  // An unwanted gradient stays without storage.
  if (!want[0]) {
    EXPECT_EQ(grad_in[0].raw(), nullptr);
  }
}

}  // namespace

TEST(ConvBackward, MatchesFiniteDifferencesAndEmulatedKernelsInF64) {
  const auto seed = fresh_seed();
  for (const Cfg& cfg : small_configs()) {
    SCOPED_TRACE(cfg.text());
    const auto rep = gradients(cfg, kg::DType::F64, seed);
    EXPECT_TRUE(rep.ok) << rep.to_string();
  }
}

TEST(ConvBackward, EmulatedKernelsMatchTheCpuInF32) {
  // An f32 op refuses f64 copies, so the finite differences run in f32 with wider tolerances;
  // what this adds is the f32 kernels against the f32 CPU backward.
  const auto seed = fresh_seed();
  for (const Cfg& cfg : {small_configs()[0], small_configs()[3], small_configs()[5]}) {
    SCOPED_TRACE(cfg.text());
    const auto rep = gradients(cfg, kg::DType::F32, seed);
    EXPECT_TRUE(rep.ok) << rep.to_string();
  }
}

TEST(ConvBackward, F32CpuBackwardMatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<Cfg> cfgs = {
      {8, 6, 14, 14, 16, 5},                          // LeNet's second convolution
      {4, 1, 28, 28, 6, 5, 1, 2},                     // LeNet's first
      {3, 64, 20, 20, 8, 3, 1, 1},                    // a deep reduction: several pixel tiles per image
      {20, 3, 9, 9, 4, 3, 2, 1},                      // more images than weight-gradient partials
      {2, 8, 10, 10, 8, 3, 1, 1, 1, 8},               // depthwise
      {3, 16, 6, 7, 12, 1},                           // pointwise
      {2, 6, 11, 9, 6, {3, 2}, {2, 1}, {1, 1}, {2, 1}, 3, false},  // everything at once
      {1, 2, 1, 1, 3, 3, 1, 1},                       // a 1x1 image under a 3x3 kernel
  };
  for (const Cfg& cfg : cfgs) check_against_naive(cfg, rng, {true, true, true});
  // Some gradients not wanted (e.g. the first layer's input).
  check_against_naive(cfgs[0], rng, {false, true, true});
  check_against_naive(cfgs[0], rng, {true, false, false});
  check_against_naive(cfgs[5], rng, {false, true, false});
  check_against_naive(cfgs[2], rng, {true, false, true});
  check_against_naive(cfgs[3], rng, {true, false, false});  // strided: dx by col2im only
  check_against_naive({2, 3, 5, 5, 4, 1, 1, 1}, rng, {true, true, false});  // padded 1x1: not a flipped convolution
}

TEST(ConvBackward, EmulatedKernelsSkipAGradientNotWanted) {
  // The input's gradient not wanted (ptr 0): its launch is one idle block, the others still
  // write every element of theirs.
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const Cfg cfg{2, 3, 7, 6, 4, 3, 2, 1};
  const kg::DType f64 = kg::DType::F64;
  const kg::CustomData op = cfg.op(f64);
  const kg::Shape out_shape = op->infer_output_shape({kg::Shape::of(cfg.input_shape())});
  const kg::Tensor x = kg_test::random_tensor(rng, f64, cfg.input_shape());
  const kg::Tensor w = kg_test::random_tensor(rng, f64, {4, 3, 3, 3});
  const kg::Tensor b = kg_test::random_tensor(rng, f64, {4});
  const kg::Tensor dy = kg_test::random_tensor(rng, f64, out_shape.sizes());
  kg::Tensor dw = nan_tensor(f64, {4, 3, 3, 3}), db = nan_tensor(f64, {4});

  const kg::LowerContext ctx = cfg.lower_context(f64);
  const auto lowered = op->lower(ctx);
  ASSERT_TRUE(lowered && lowered->runtime_op);
  const kg::RuntimeOp& rt = *lowered->runtime_op;
  auto dev = [](const kg::Tensor& t) {
    return kg::DeviceTensor{reinterpret_cast<kg::DevicePtr>(t.raw()), t.shape(), t.dtype()};
  };
  kg::LaunchTensors t;
  t.inputs = {dev(x)};
  t.params = {dev(w), dev(b)};
  t.output = {0, out_shape.sizes(), f64};
  t.grad_output = dev(dy);
  t.grad_inputs = {{0, cfg.input_shape(), f64}};
  t.grad_params = {dev(dw), dev(db)};
  t.training = true;
  kg::Tensor scratch = kg::Tensor::empty(kg::DType::U8, {static_cast<std::int64_t>(std::max<std::size_t>(rt.backward_scratch_bytes(t), 1))});
  t.scratch = reinterpret_cast<kg::DevicePtr>(scratch.raw());
  kg::emu::LaunchOptions opt;
  opt.checked = true;
  for (const auto& [tensor, name] : std::vector<std::pair<const kg::Tensor*, std::string>>{
           {&x, "x"}, {&w, "w"}, {&dy, "dy"}, {&dw, "dw"}, {&db, "db"}, {&scratch, "scratch"}})
    opt.buffers.push_back({reinterpret_cast<kg::DevicePtr>(tensor->raw()), tensor->nbytes(), name});
  const std::string source = op->lower_backward_source(ctx);
  for (const kg::Launch& l : rt.backward_launches(t))
    kg::emu::launch("nn.conv2d.backward", source, l.entry, l.grid, l.block, l.shared_bytes, l.args, opt);
  const Grads ref = naive_backward(cfg, x, w, dy);
  EXPECT_TRUE(matches(dw, ref.dw, 1e-12, 1e-12)) << "weight gradient";
  EXPECT_TRUE(matches(db, ref.db, 1e-12, 1e-12)) << "bias gradient";
}

TEST(ConvBackward, EmptyBatchWritesZeroParameterGradients) {
  const Cfg cfg{0, 3, 5, 5, 4, 3};
  const kg::DType f64 = kg::DType::F64;
  const kg::CustomData op = cfg.op(f64);
  std::vector<kg::Tensor> inputs{kg::Tensor::empty(f64, cfg.input_shape())};
  std::vector<kg::Tensor> params{kg::Tensor::zeros(f64, {4, 3, 3, 3}), kg::Tensor::zeros(f64, {4})};
  const kg::Tensor dy = kg::Tensor::empty(f64, {0, 4, 3, 3});
  std::vector<kg::Tensor> grad_in{kg::Tensor::empty(f64, cfg.input_shape())};
  std::vector<kg::Tensor> grad_params{nan_tensor(f64, {4, 3, 3, 3}), nan_tensor(f64, {4})};
  kg::CpuBackwardContext ctx(inputs, params, kg::Tensor::wrap(nullptr, f64, {0, 4, 3, 3}), dy, grad_in,
                             grad_params, true, 0);
  op->cpu_backward(ctx);
  for (const kg::Tensor& g : grad_params)
    for (std::int64_t i = 0; i < g.numel(); ++i) EXPECT_EQ(g.item(i), 0.0);
}

TEST(ConvBackward, DeclaresWhatItNeeds) {
  const Cfg cfg{2, 3, 7, 6, 4, 3};
  const kg::CustomData op = cfg.op(kg::DType::F32);
  EXPECT_TRUE(op->has_cpu_backward());
  EXPECT_TRUE(op->backward_saves().inputs);
  EXPECT_FALSE(op->backward_saves().output);
  EXPECT_NE(
      op->lower_backward_source(cfg.lower_context(kg::DType::F32)).find("kg_conv2d_backward_weight_f32"),
      std::string::npos);
}

TEST(ConvBackward, RuntimeOpLaunchesOneKernelPerGradient) {
  const Cfg cfg{2, 4, 9, 9, 6, 3, 2, 1, 2, 2};
  const kg::LowerContext ctx = cfg.lower_context(kg::DType::F32);
  ASSERT_FALSE(cfg.op(kg::DType::F32)->lower_backward_source(ctx).empty());
  const auto lowered = cfg.op(kg::DType::F32)->lower(ctx);
  ASSERT_TRUE(lowered && lowered->runtime_op);
  const kg::RuntimeOp& rt = *lowered->runtime_op;
  kg::LaunchTensors t;
  t.inputs = {{0x1000, {2, 4, 9, 9}, kg::DType::F32}};
  t.params = {{0x2000, {6, 2, 3, 3}, kg::DType::F32}, {0x3000, {6}, kg::DType::F32}};
  t.output = {0, {2, 6, 4, 4}, kg::DType::F32};
  t.grad_output = {0x4000, {2, 6, 4, 4}, kg::DType::F32};
  t.grad_inputs = {{0x5000, {2, 4, 9, 9}, kg::DType::F32}};
  t.grad_params = {{0x6000, {6, 2, 3, 3}, kg::DType::F32}, {0x7000, {6}, kg::DType::F32}};
  t.training = true;
  const std::vector<kg::Launch> ls = rt.backward_launches(t);
  ASSERT_EQ(ls.size(), 4u);
  EXPECT_EQ(ls[0].entry, "kg_conv2d_backward_input_f32");
  EXPECT_EQ(ls[1].entry, "kg_conv2d_backward_weight_f32");
  EXPECT_EQ(ls[2].entry, "kg_conv2d_backward_weight_sum_f32");
  EXPECT_EQ(ls[3].entry, "kg_conv2d_backward_bias_f32");
  for (const kg::Launch& l : ls) EXPECT_EQ(l.block.x, 256u);
  EXPECT_EQ(ls[0].grid.x, 3u);    // 648 input elements, 256 threads a block
  EXPECT_EQ(ls[1].grid.x, 108u);  // a block per weight element ...
  EXPECT_EQ(ls[1].grid.y, 2u);    // ... and image (2048 blocks wanted, 2 images)
  EXPECT_EQ(ls[2].grid.x, 1u);    // the sum of the two ranges: a thread per weight
  EXPECT_EQ(ls[3].grid.x, 6u);    // a block per channel
  EXPECT_EQ(rt.backward_scratch_bytes(t), 108u * 2u * 4u);  // the partial sums
  ASSERT_EQ(ls[1].args.size(), 6u);  // x, dy, dw, partial, chunks, shape
  // A gradient nobody wants: its launch is one block, which returns at once.
  t.grad_inputs[0].ptr = 0;
  const kg::Dim3 idle = rt.backward_launches(t).at(0).grid;
  EXPECT_EQ(idle.x * idle.y * idle.z, 1u);
  // Images whose output pixels overflow the weight-gradient kernel's 32-bit indices are refused.
  kg::LaunchTensors huge = t;
  huge.grad_output.shape = {1, 6, 50000, 50000};
  kg_test::expect_error([&] { rt.backward_launches(huge); }, {"[nn.conv2d]", "50000 x 50000", "32-bit"});
  // Without a bias there is no bias launch.
  Cfg nb = cfg;
  nb.bias = false;
  EXPECT_EQ(
      nb.op(kg::DType::F32)->lower(nb.lower_context(kg::DType::F32))->runtime_op->backward_launches(t).size(),
      3u);
}

TEST(ConvBackward, FusedConvolutionHasNoBackward) {
  const Cfg cfg{2, 3, 7, 6, 4, 3};
  kg::ops::ConvEpilogueSpec spec;
  spec.activation = kg::ops::UnarySpec{kg::ops::UnaryFn::Relu, 0.0};
  const kg::ops::Conv2dOp conv(3, 4, 3, cfg.options(), kg::DType::F32);
  const auto fused = kg::CustomData::make<kg::ops::FusedConv2dOp>(
      conv, spec, conv.parameters({kg::Shape::of(cfg.input_shape())}));
  EXPECT_FALSE(fused->has_cpu_backward());
  kg::LowerContext ctx = cfg.lower_context(kg::DType::F32);
  ctx.mode = kg::LoweringMode::Inference;
  EXPECT_TRUE(fused->lower(ctx).has_value());
  EXPECT_TRUE(fused->lower_backward_source(ctx).empty());
}
