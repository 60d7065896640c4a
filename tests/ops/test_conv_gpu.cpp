// The GPU lowering of nn.conv2d and nn.fused_conv2d: every kernel variant compiled and every
// launch checked (a dry run at sm_90), run through the CUDA emulator and, where a GPU is
// present, run on it; compared with the CPU (plain convolutions) or with a naive
// double-precision reference (fused epilogues, with random BatchNorm statistics; the CPU's fused
// path is compared with the same reference).
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>

#include "compile/compiler.hpp"
#include "compile/ptx.hpp"
#include "lower/dry_run.hpp"
#include "ops/conv_gpu.hpp"
#include "support/gpu_util.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

struct ConvCfg {
  std::int64_t c, h, w, out;
  kg::Size2 kernel, stride = 1, padding = 0, dilation = 1;
  std::int64_t groups = 1;
  bool bias = true;

  kg::nn::Conv2dOptions options() const { return {stride, padding, dilation, groups, bias}; }
  kg::ops::ConvGpuConfig gpu_config(kg::DType dtype = kg::DType::F32) const {
    kg::ops::ConvGpuConfig g;
    g.in_channels = c;
    g.out_channels = out;
    g.kernel = kernel;
    g.options = options();
    g.dtype = dtype;
    return g;
  }
  std::string text() const {
    std::ostringstream os;
    os << "c=" << c << " h=" << h << " w=" << w << " out=" << out << " k=" << kernel.h << "x" << kernel.w
       << " s=" << stride.h << "x" << stride.w << " p=" << padding.h << "x" << padding.w
       << " d=" << dilation.h << "x" << dilation.w << " groups=" << groups << " bias=" << bias;
    return os.str();
  }
};

std::int64_t out_size(std::int64_t in, std::int64_t k, std::int64_t s, std::int64_t p, std::int64_t d) {
  return (in + 2 * p - d * (k - 1) - 1) / s + 1;
}

// y[n, o, i, j] = b[o] + sum over the group's channels and taps of w * x, in double.
std::vector<double> naive_conv(const kg::Tensor& x, const kg::Tensor& w, const kg::Tensor* b,
                               const ConvCfg& cfg) {
  const std::int64_t n = x.dim(0), c = x.dim(1), h = x.dim(2), wd = x.dim(3);
  const std::int64_t o = cfg.out, kh = cfg.kernel.h, kw = cfg.kernel.w;
  const std::int64_t ho = out_size(h, kh, cfg.stride.h, cfg.padding.h, cfg.dilation.h);
  const std::int64_t wo = out_size(wd, kw, cfg.stride.w, cfg.padding.w, cfg.dilation.w);
  const std::int64_t cg = c / cfg.groups, og = o / cfg.groups;
  std::vector<double> y(static_cast<std::size_t>(n * o * ho * wo));
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
                s += w.item(((oc * cg + ci) * kh + ky) * kw + kx) *
                     x.item(((img * c + chan) * h + iy) * wd + ix);
              }
          y[static_cast<std::size_t>(((img * o + oc) * ho + i) * wo + j)] = s;
        }
  return y;
}

// Dry-runs a model at these input shapes for sm_90 (every kernel compiled, every launch checked
// against its PTX) and returns its step count; 0 without NVRTC.
std::size_t dry_run_steps(const kg::Model& model, const std::vector<std::vector<std::int64_t>>& shapes) {
  if (!kg::compile::Compiler::available()) return 0;
  return kg::lower::dry_run(model, shapes, 90).launches.steps.size();
}

// The lowering of the model's only op node for sm_90, with the node's dtypes and recorded shapes
// (no concrete shapes).
kg::Lowered lower_op(const kg::Model& model) {
  const kg::Graph& g = model.graph();
  for (int id : model.live_nodes()) {
    const kg::Node& n = g.node(id);
    if (n.kind != kg::Node::Kind::Op) continue;
    const kg::LowerContext ctx = kg::lower::lower_context(model, id, kg::lower::LowerTarget{{}, 90, true});
    std::optional<kg::Lowered> l = n.op->op().lower(ctx);
    if (!l || !l->runtime_op) throw kg::Error(n.label() + " has no lowering");
    return *l;
  }
  throw kg::Error("the model has no op node");
}

// Made-up addresses and the sizes of a convolution's tensors at this batch: what launches() reads.
kg::LaunchTensors conv_tensors(const ConvCfg& cfg, std::int64_t batch, kg::DType dtype) {
  constexpr kg::DevicePtr kApart = kg::DevicePtr{1} << 40;
  const std::int64_t ho = out_size(cfg.h, cfg.kernel.h, cfg.stride.h, cfg.padding.h, cfg.dilation.h);
  const std::int64_t wo = out_size(cfg.w, cfg.kernel.w, cfg.stride.w, cfg.padding.w, cfg.dilation.w);
  kg::LaunchTensors t;
  t.inputs = {{kApart, {batch, cfg.c, cfg.h, cfg.w}, dtype}};
  t.params = {{2 * kApart, {cfg.out, cfg.c / cfg.groups, cfg.kernel.h, cfg.kernel.w}, dtype}};
  if (cfg.bias) t.params.push_back({3 * kApart, {cfg.out}, dtype});
  t.output = {4 * kApart, {batch, cfg.out, ho, wo}, dtype};
  return t;
}

// The op names of the nodes that run (inputs excluded).
std::vector<std::string> live_ops(const kg::Model& model) {
  std::vector<std::string> ops;
  for (int id : model.live_nodes()) {
    const kg::Node& n = model.graph().node(id);
    if (n.kind == kg::Node::Kind::Op) ops.push_back(n.op_name());
  }
  return ops;
}

// Random values for every float parameter of the model, by name: weights and biases in
// [-0.3, 0.3), BatchNorm weights in [0.5, 1.5), biases and means in [-0.5, 0.5), variances in
// [0.5, 2).
std::map<std::string, kg::Tensor> random_params(const kg::Model& model, std::mt19937_64& rng) {
  std::map<std::string, kg::Tensor> out;
  for (const kg::ParamInfo& p : model.parameters()) {
    if (p.dtype != kg::DType::F32 && p.dtype != kg::DType::F64) continue;
    auto ends = [&](const std::string& s) {
      return p.name.size() >= s.size() && p.name.compare(p.name.size() - s.size(), s.size(), s) == 0;
    };
    const bool bn = p.name.find("bn") != std::string::npos;
    double lo = -0.3, hi = 0.3;
    if (bn && ends(".weight")) lo = 0.5, hi = 1.5;
    if (bn && (ends(".bias") || ends(".running_mean"))) lo = -0.5, hi = 0.5;
    if (ends(".running_var")) lo = 0.5, hi = 2.0;
    out[p.name] = kg_test::random_tensor(rng, p.dtype, p.shape, lo, hi);
  }
  return out;
}

// ---- the fused epilogue's reference ----

enum class Act { None, Relu, LeakyRelu, Silu, GeluErf, GeluTanh, Sigmoid, Tanh };

const char* act_name(Act a) {
  switch (a) {
    case Act::None:
      return "none";
    case Act::Relu:
      return "relu";
    case Act::LeakyRelu:
      return "leaky_relu";
    case Act::Silu:
      return "silu";
    case Act::GeluErf:
      return "gelu_erf";
    case Act::GeluTanh:
      return "gelu_tanh";
    case Act::Sigmoid:
      return "sigmoid";
    case Act::Tanh:
      return "tanh";
  }
  return "?";
}

constexpr double kLeakySlope = 0.2;

double act_ref(Act a, double v) {
  switch (a) {
    case Act::None:
      return v;
    case Act::Relu:
      return v < 0 ? 0 : v;
    case Act::LeakyRelu:
      return v < 0 ? v * kLeakySlope : v;
    case Act::Silu:
      return v / (1 + std::exp(-v));
    case Act::GeluErf:
      return 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
    case Act::GeluTanh:
      return 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
    case Act::Sigmoid:
      return 1 / (1 + std::exp(-v));
    case Act::Tanh:
      return std::tanh(v);
  }
  return v;
}

kg::SymTensor record_act(Act a, const kg::SymTensor& x) {
  switch (a) {
    case Act::None:
      return x;
    case Act::Relu:
      return kg::relu(x, "act");
    case Act::LeakyRelu:
      return kg::leaky_relu(x, kLeakySlope, "act");
    case Act::Silu:
      return kg::silu(x, "act");
    case Act::GeluErf:
      return kg::gelu(x, kg::GeluApprox::Erf, "act");
    case Act::GeluTanh:
      return kg::gelu(x, kg::GeluApprox::Tanh, "act");
    case Act::Sigmoid:
      return kg::sigmoid(x, "act");
    case Act::Tanh:
      return kg::tanh(x, "act");
  }
  return x;
}

// conv → [batch_norm2d] → [add residual, on either side] → [activation].
struct FusedCase {
  ConvCfg conv;
  bool bn;
  int residual;  // 0: none; 1: add(conv, r); 2: add(r, conv)
  Act act;
  kg::ops::ConvGpuAlgo algo;
  kg::DType dtype = kg::DType::F32;

  std::string text() const {
    return conv.text() + (bn ? " +bn" : "") + (residual ? " +add" : "") + " act=" + act_name(act) + " " +
           std::string(kg::dtype_name(dtype));
  }
};

// The reference output of `fc` in double.
kg::Tensor fused_ref(const FusedCase& fc, const kg::Tensor& x, const kg::Tensor* res,
                     const std::map<std::string, kg::Tensor>& p) {
  const kg::Tensor* bias = fc.conv.bias ? &p.at("conv.bias") : nullptr;
  std::vector<double> y = naive_conv(x, p.at("conv.weight"), bias, fc.conv);
  const std::int64_t o = fc.conv.out;
  const std::int64_t plane = static_cast<std::int64_t>(y.size()) / (x.dim(0) * o);
  kg::Tensor out = kg::Tensor::empty(
      kg::DType::F64,
      {x.dim(0), o,
       out_size(x.dim(2), fc.conv.kernel.h, fc.conv.stride.h, fc.conv.padding.h, fc.conv.dilation.h),
       out_size(x.dim(3), fc.conv.kernel.w, fc.conv.stride.w, fc.conv.padding.w, fc.conv.dilation.w)});
  for (std::size_t i = 0; i < y.size(); ++i) {
    const auto ch = static_cast<std::int64_t>(i) / plane % o;
    double v = y[i];
    if (fc.bn)
      v = (v - p.at("bn.running_mean").item(ch)) / std::sqrt(p.at("bn.running_var").item(ch) + 1e-5) *
              p.at("bn.weight").item(ch) +
          p.at("bn.bias").item(ch);
    if (res) v += res->item(static_cast<std::int64_t>(i));
    out.data<double>()[i] = act_ref(fc.act, v);
  }
  return out;
}

void check_fused(const FusedCase& fc, std::mt19937_64& rng) {
  SCOPED_TRACE(fc.text());
  const ConvCfg& cc = fc.conv;
  auto g = kg::Graph::create();
  const kg::Shape xs{kg::Dim::named("batch"), cc.c, cc.h, cc.w};
  auto x = g->input(fc.dtype, xs, "x");
  const std::int64_t ho = out_size(cc.h, cc.kernel.h, cc.stride.h, cc.padding.h, cc.dilation.h);
  const std::int64_t wo = out_size(cc.w, cc.kernel.w, cc.stride.w, cc.padding.w, cc.dilation.w);
  std::optional<kg::SymTensor> r;
  if (fc.residual) r = g->input(fc.dtype, kg::Shape{kg::Dim::named("batch"), cc.out, ho, wo}, "r");
  kg::SymTensor y = kg::nn::conv2d(x, cc.out, cc.kernel, cc.options(), "conv");
  if (fc.bn) y = kg::nn::batch_norm2d(y, "bn");
  if (fc.residual == 1) y = kg::add(y, *r, "add");
  if (fc.residual == 2) y = kg::add(*r, y, "add");
  y = record_act(fc.act, y);
  kg::Model model(g, {y});
  // The pass fused the chain into one node.
  ASSERT_EQ(live_ops(model), std::vector<std::string>{"nn.fused_conv2d"});
  EXPECT_EQ(kg::ops::conv_gpu_algo(cc.gpu_config(fc.dtype)), fc.algo);

  // The entry the lowering picks.
  const kg::Lowered lowered = lower_op(model);
  std::string algo = fc.algo == kg::ops::ConvGpuAlgo::Gemm ? "gemm" : "direct";
  if (fc.algo == kg::ops::ConvGpuAlgo::Tiled) {
    // Channels per thread: 4 or 2 when they divide the group's channels.
    const std::int64_t og = cc.out / cc.groups, ocb = og % 4 == 0 ? 4 : og % 2 == 0 ? 2 : og >= 3 ? 4 : 1;
    algo = "tiled_" + std::to_string(cc.kernel.h) + "x" + std::to_string(cc.kernel.w) + "_" +
           std::to_string(ocb);
  }
  const std::string stem =
      fc.act == Act::None ? "kg_conv2d_" + algo : "kg_fused_conv2d_" + algo + "_" + act_name(fc.act);
  EXPECT_EQ(lowered.entry_point, stem + (fc.dtype == kg::DType::F64 ? "_f64" : "_f32"));
  // A module of its own holds its entry and the epilogue entry of its library call, and in f32
  // the im2col entry of its GEMM form (not elementwise.cu's entries).
  if ((fc.act != Act::None || fc.algo == kg::ops::ConvGpuAlgo::Tiled) && kg::compile::Compiler::available()) {
    const std::string ptx = kg::compile::Compiler::global().compile(lowered.name, lowered.source, 90).ptx;
    const auto entries = kg::compile::parse_ptx_entries(ptx);
    const bool f32 = fc.dtype == kg::DType::F32;
    ASSERT_EQ(entries.size(), f32 ? 3u : 2u);
    const std::string suffix = f32 ? "_f32" : "_f64";
    EXPECT_EQ(entries[0].name + entries[1].name + (f32 ? entries[2].name : ""),
              lowered.entry_point + stem + "_epilogue" + suffix + (f32 ? stem + "_im2col" + suffix : ""));
  }

  const auto params = random_params(model, rng);
  for (std::int64_t batch : {1, 7, 19}) {
    SCOPED_TRACE("batch " + std::to_string(batch));
    std::vector<kg::Tensor> inputs{kg_test::random_tensor(rng, fc.dtype, {batch, cc.c, cc.h, cc.w})};
    std::vector<std::vector<std::int64_t>> shapes{inputs[0].shape()};
    if (fc.residual) {
      inputs.push_back(kg_test::random_tensor(rng, fc.dtype, {batch, cc.out, ho, wo}));
      shapes.push_back(inputs[1].shape());
    }
    if (kg::compile::Compiler::available()) {
      ASSERT_EQ(dry_run_steps(model, shapes), 1u);
    }
    const kg::Tensor want = fused_ref(fc, inputs[0], fc.residual ? &inputs[1] : nullptr, params);
    // f32: the kernels sum in another order than the reference (and the CPU).
    const double rtol = fc.dtype == kg::DType::F32 ? 1e-4 : 1e-10;
    const double atol = fc.dtype == kg::DType::F32 ? 2e-5 : 1e-12;
    kg::LoadOptions opt;
    opt.poison_buffers = true;
    kg::LoadedModel cpu = model.load(kg::Device::cpu(), shapes, opt);
    cpu.load_state_dict(params, false);
    const kg::Tensor got_cpu = cpu.forward(inputs)[0];
    EXPECT_TRUE(kg_test::all_close(got_cpu, want, rtol, atol)) << "CPU";
    kg_test::check_emulated(model, inputs, params, {want}, rtol, atol);
    if (!kg::Device::cuda_available()) continue;
    kg::LoadedModel gpu = model.load(kg::Device::cuda(), shapes, opt);
    gpu.load_state_dict(params, false);
    const kg::Tensor got = gpu.forward(inputs)[0];
    EXPECT_TRUE(kg_test::all_written(got)) << "the GPU kernel left output elements unwritten";
    EXPECT_TRUE(kg_test::all_close(got, want, rtol, atol)) << "GPU";
    EXPECT_TRUE(kg_test::all_close(got, got_cpu, rtol, atol)) << "GPU vs CPU";
  }
}

}  // namespace

TEST(Conv2d, GpuLoweringCompilesAndMatchesTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<ConvCfg> configs = {
      // tiled (stride 1, no dilation)
      {1, 28, 28, 6, 5, 1, 2},              // LeNet's first layer: 2 channels per thread
      {6, 14, 14, 16, 5},                   // LeNet's second: 4 per thread
      {3, 9, 10, 5, 3, 1, 1},               // 5 channels: 4 per thread, the last idle
      {3, 9, 10, 8, {3, 2}, 1, {1, 0}},     // rectangular kernel
      {6, 9, 10, 4, 3, 1, 1, 1, 2},         // groups
      {8, 9, 10, 8, 3, 1, 1, 1, 8, false},  // depthwise, no bias: 1 channel per thread
      {5, 7, 8, 3, 1},                      // 1x1
      {8, 6, 7, 80, 1},                     // 80 channels: two chunks of 64
      {20, 12, 9, 16, 7, 1, 3},             // 7x7, input channels staged in several chunks
      // direct
      {3, 9, 10, 8, {3, 2}, {2, 1}, {1, 2}},  // rectangular kernel, stride and padding
      {4, 11, 9, 6, 3, 1, 2, 2},              // dilation
      {6, 9, 10, 4, 3, 2, 1, 1, 2},           // groups
      {4, 9, 10, 8, 3, 2, 1, 1, 4},           // depthwise with 2 outputs per channel
      {3, 12, 11, 6, 9, 1, 4},                // a kernel larger than the tiled kernel's 7x7
      // implicit GEMM
      {16, 9, 10, 64, 3, 1, 1},
      {24, 10, 9, 40, {3, 2}, {2, 1}, {1, 0}, {2, 1}},  // partial tiles, all options
      {64, 6, 7, 64, 3, 1, 1, 1, 2, false},             // per group (grid z), no bias
      {48, 5, 6, 96, 1},                                // over a 1x1 convolution
  };
  for (const ConvCfg& cfg : configs) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      for (std::int64_t batch : {1, 7, 33}) {
        SCOPED_TRACE(cfg.text() + " " + std::string(kg::dtype_name(dt)) + " batch " + std::to_string(batch));
        kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, cfg.c, cfg.h, cfg.w});
        // f32: the GPU sums in another order than the CPU's GEMM.
        kg_test::check_lowering(
            [&](const std::vector<kg::SymTensor>& xs) {
              return std::vector<kg::SymTensor>{
                  kg::nn::conv2d(xs[0], cfg.out, cfg.kernel, cfg.options(), "conv")};
            },
            {x}, dt == kg::DType::F32 ? 1e-4 : 1e-10, dt == kg::DType::F32 ? 1e-5 : 1e-12);
      }
    }
  }
}

TEST(Conv2d, GpuKernelChoiceAndGrid) {
  using kg::ops::ConvGpuAlgo;
  const ConvCfg lenet1{1, 28, 28, 6, 5, 1, 2}, lenet2{6, 14, 14, 16, 5};
  const ConvCfg resnet{64, 56, 56, 64, 3, 1, 1, 1, 1, false}, stem{3, 224, 224, 64, 7, 2, 3, 1, 1, false};
  const ConvCfg depthwise{32, 14, 14, 32, 3, 1, 1, 1, 32}, depthwise_s2{32, 14, 14, 32, 3, 2, 1, 1, 32};
  const ConvCfg thin{16, 8, 8, 64, 1}, dilated{3, 9, 9, 8, 3, 1, 2, 2}, big{3, 20, 20, 8, 9, 1, 4};
  auto algo = [](const ConvCfg& c) { return kg::ops::conv_gpu_algo(c.gpu_config()); };
  EXPECT_EQ(algo(lenet1), ConvGpuAlgo::Tiled);
  EXPECT_EQ(algo(lenet2), ConvGpuAlgo::Tiled);
  EXPECT_EQ(algo(resnet), ConvGpuAlgo::Gemm);
  EXPECT_EQ(algo(stem), ConvGpuAlgo::Gemm);
  EXPECT_EQ(algo(depthwise), ConvGpuAlgo::Tiled);
  EXPECT_EQ(algo(depthwise_s2), ConvGpuAlgo::Direct);
  EXPECT_EQ(algo(thin), ConvGpuAlgo::Tiled);  // a 16-deep reduction is too shallow for the GEMM
  EXPECT_EQ(algo(dilated), ConvGpuAlgo::Direct);
  EXPECT_EQ(algo(big), ConvGpuAlgo::Direct);

  // The entry and the only launch of a convolution at this batch (compiled and checked for sm_90
  // where NVRTC is available).
  auto launch_of = [](const ConvCfg& cfg, std::int64_t batch, kg::DType dt) {
    auto g = kg::Graph::create();
    auto x = g->input(dt, kg::Shape{kg::Dim::named("batch"), cfg.c, cfg.h, cfg.w}, "x");
    kg::Model model(g, {kg::nn::conv2d(x, cfg.out, cfg.kernel, cfg.options(), "conv")});
    if (kg::compile::Compiler::available()) {
      EXPECT_EQ(dry_run_steps(model, {{batch, cfg.c, cfg.h, cfg.w}}), 1u);
    }
    const kg::Lowered lowered = lower_op(model);
    std::vector<kg::Launch> launches = lowered.runtime_op->launches(conv_tensors(cfg, batch, dt));
    EXPECT_EQ(launches.size(), 1u);
    EXPECT_EQ(launches.at(0).entry, "");  // the module's entry point
    return std::make_pair(lowered.entry_point, launches.at(0));
  };
  // LeNet's first layer: 3 blocks of 2 channels × 6 rows × 14 pairs of columns a block, 5 row
  // tiles an image; shared memory for a 10 × 32 input window and 25 × 6 weights.
  auto [e1, l1] = launch_of(lenet1, 256, kg::DType::F32);
  EXPECT_EQ(e1, "kg_conv2d_tiled_5x5_2_f32");
  EXPECT_EQ(l1.grid.x, 256u * 5);
  EXPECT_EQ(l1.block.x, 256u);
  EXPECT_EQ(l1.shared_bytes, 320u * 4 + 150 * 4);
  // LeNet's second at batch 3: the 10-row tile halves down to 1 row to make more blocks.
  auto [e2, l2] = launch_of(lenet2, 3, kg::DType::F64);
  EXPECT_EQ(e2, "kg_conv2d_tiled_5x5_4_f64");
  EXPECT_EQ(l2.grid.x, 3u * 10);
  EXPECT_EQ(l2.shared_bytes, (5u * 14 * 6 + 25 * 16 * 6) * 8);
  // 2 × 56 × 56 pixels in tiles of 64, one channel tile, one group.
  auto [e3, l3] = launch_of(resnet, 2, kg::DType::F32);
  EXPECT_EQ(e3, "kg_conv2d_gemm_f32");
  EXPECT_EQ(l3.grid.x, 98u);
  EXPECT_EQ(l3.grid.y, 1u);
  EXPECT_EQ(l3.grid.z, 1u);
  EXPECT_EQ(l3.shared_bytes, 0u);
  auto [e4, l4] = launch_of({64, 6, 7, 128, 3, 1, 1, 1, 2}, 5, kg::DType::F32);
  EXPECT_EQ(e4, "kg_conv2d_gemm_f32");
  EXPECT_EQ(l4.grid.x, (5u * 42 + 63) / 64);
  EXPECT_EQ(l4.grid.y, 1u);
  EXPECT_EQ(l4.grid.z, 2u);
  // Direct: 7 images × 2 blocks of 4 channels × 81 pixels.
  auto [e5, l5] = launch_of(dilated, 7, kg::DType::F32);
  EXPECT_EQ(e5, "kg_conv2d_direct_f32");
  EXPECT_EQ(l5.grid.x, (7u * 2 * 81 + 255) / 256);

  // Launches cover fewer than 2^31 items each (the kernels divide in 32 bits): this direct
  // convolution has 3 × 14 × 14 items per image, so 3652183 images per launch.
  const ConvCfg s2{1, 28, 28, 6, 5, 2, 2};
  EXPECT_EQ(algo(s2), ConvGpuAlgo::Direct);
  auto g = kg::Graph::create();
  auto x = g->input(kg::DType::F32, kg::Shape{kg::Dim::named("batch"), 1, 28, 28}, "x");
  kg::Model model(g, {kg::nn::conv2d(x, s2.out, s2.kernel, s2.options(), "conv")});
  const std::int64_t batch = 4000000, per_launch = ((std::int64_t{1} << 31) - 1) / (3 * 196);
  ASSERT_EQ(per_launch, 3652183);
  if (kg::compile::Compiler::available()) {
    ASSERT_EQ(dry_run_steps(model, {{batch, 1, 28, 28}}), 1u);
  }
  const std::vector<kg::Launch> launches =
      lower_op(model).runtime_op->launches(conv_tensors(s2, batch, kg::DType::F32));
  ASSERT_EQ(launches.size(), 2u);
  auto arg = [&](int launch, std::size_t i) {
    std::uint64_t v = 0;  // the argument's first 8 bytes: a pointer, or KgConvShape::n
    std::memcpy(&v, launches[static_cast<std::size_t>(launch)].args.args().at(i).data().data(), 8);
    return v;
  };
  EXPECT_EQ(arg(1, 0) - arg(0, 0), static_cast<std::uint64_t>(per_launch * 784 * 4));      // x
  EXPECT_EQ(arg(1, 8) - arg(0, 8), static_cast<std::uint64_t>(per_launch * 6 * 196 * 4));  // y
  EXPECT_EQ(arg(1, 1), arg(0, 1));                                                         // weight
  EXPECT_EQ(arg(0, 9), static_cast<std::uint64_t>(per_launch));
  EXPECT_EQ(arg(1, 9), static_cast<std::uint64_t>(batch - per_launch));
  EXPECT_EQ(launches[1].grid.x, static_cast<unsigned>(((batch - per_launch) * 3 * 196 + 255) / 256));
}

TEST(Conv2d, GpuFusedEpiloguesMatchReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  using kg::ops::ConvGpuAlgo;
  const ConvCfg small{3, 9, 10, 6, 3, 1, 1};               // tiled
  const ConvCfg lenet{1, 12, 12, 6, 5, 1, 2};              // tiled, LeNet's shape
  const ConvCfg strided{3, 9, 10, 5, 3, 2, 1};             // direct
  const ConvCfg wide{16, 8, 9, 48, 3, 2, 1, 1, 1, false};  // implicit GEMM
  const ConvCfg wide_bias{16, 7, 6, 64, 3, 1, 1};          // implicit GEMM with a bias
  const ConvGpuAlgo T = ConvGpuAlgo::Tiled, D = ConvGpuAlgo::Direct, G = ConvGpuAlgo::Gemm;
  const std::vector<FusedCase> cases = {
      {lenet, false, 0, Act::Relu, T},
      {small, true, 0, Act::Relu, T},
      {strided, true, 0, Act::Relu, D},
      {wide, true, 0, Act::Relu, G},
      {wide, true, 1, Act::Relu, G},
      {wide_bias, true, 2, Act::Relu, G},
      {small, true, 1, Act::Relu, T},
      {strided, false, 2, Act::Relu, D},
      {small, true, 0, Act::None, T},
      {strided, true, 0, Act::None, D},
      {wide, true, 0, Act::None, G},
      {small, false, 1, Act::None, T},
      {wide_bias, true, 1, Act::None, G},
      {small, true, 0, Act::LeakyRelu, T},
      {wide, true, 0, Act::Silu, G},
      {strided, false, 0, Act::GeluErf, D},
      {wide_bias, true, 0, Act::GeluTanh, G},
      {small, true, 2, Act::Sigmoid, T},
      {wide, false, 0, Act::Tanh, G},
      {small, true, 1, Act::Relu, T, kg::DType::F64},
      {strided, true, 1, Act::Tanh, D, kg::DType::F64},
      {wide_bias, true, 2, Act::Relu, G, kg::DType::F64},
      {wide, true, 0, Act::None, G, kg::DType::F64},
  };
  for (const FusedCase& fc : cases) check_fused(fc, rng);
}
