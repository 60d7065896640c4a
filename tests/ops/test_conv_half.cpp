// nn.conv2d and nn.fused_conv2d in f16 and bf16 (inference): recorded with 16-bit inputs, run
// on the CPU with poisoned buffers and compared with a naive direct convolution in double on the
// same rounded values; their lowering (kg_f16 / kg_bf16 kernels computing in float, and the
// 16-bit library call with its epilogue) dry-run, emulated and, where a GPU is present, run on
// it against the CPU. Also the precision pass's route (an f32 model loaded in f16 or bf16), and
// the errors: mixed dtypes, and a 16-bit convolution in a model lowered for training.
//
// Tolerances, per dtype, with u its unit roundoff (2^-11 for f16, 2^-8 for bf16):
// - CPU against the reference: the CPU computes in f32 and rounds once, so it is within u of the
//   exact value (rtol 1.05 u), plus f32 summation error (atol 1e-5; the values are of order 1).
// - emulator and GPU against the CPU (check_lowering): another summation order can round to the
//   neighbouring 16-bit value (2 u), and the library path rounds the convolution before its
//   epilogue reads it back (u times the pre-epilogue magnitude, a few units here): f16 rtol 2e-3,
//   atol 4e-3; bf16 rtol 1e-2, atol 2e-2.
#include <cmath>
#include <functional>
#include <random>
#include <sstream>

#include "backend/emu/executor.hpp"
#include "lower/lowering.hpp"
#include "ops/conv.hpp"
#include "ops/conv_gpu.hpp"
#include "support/gpu_util.hpp"
#include "support/test_util.hpp"

using kg::DType;
using kg_test::fresh_seed;

namespace {

constexpr DType kHalfTypes[] = {DType::F16, DType::BF16};

double unit_roundoff(DType t) { return t == DType::F16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8); }

struct Tol {
  double rtol, atol;
};
Tol cpu_tol(DType t) { return {1.05 * unit_roundoff(t), 1e-5}; }
Tol lowering_tol(DType t) { return t == DType::F16 ? Tol{2e-3, 4e-3} : Tol{1e-2, 2e-2}; }

struct Geom {
  std::int64_t c, h, w, out;
  kg::Size2 kernel, stride = 1, padding = 0, dilation = 1;
  std::int64_t groups = 1;
  bool bias = true;

  kg::nn::Conv2dOptions options() const { return {stride, padding, dilation, groups, bias}; }
  std::int64_t ho() const { return (h + 2 * padding.h - dilation.h * (kernel.h - 1) - 1) / stride.h + 1; }
  std::int64_t wo() const { return (w + 2 * padding.w - dilation.w * (kernel.w - 1) - 1) / stride.w + 1; }
  std::int64_t kdim() const { return c / groups * kernel.h * kernel.w; }
  kg::ops::ConvGpuConfig gpu_config(DType dtype) const {
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

// What follows the convolution in the reference, all in double.
struct RefEpilogue {
  const kg::Tensor* bias = nullptr;
  const kg::Tensor *gamma = nullptr, *beta = nullptr, *mean = nullptr, *var = nullptr;  // a batch norm
  double eps = 1e-5;
  const kg::Tensor* residual = nullptr;
  std::function<double(double)> act;
};

// y[n, o, i, j] = epilogue(sum over the group's channels and taps of w * x), in double from the
// tensors' own (rounded) values.
std::vector<double> reference(const Geom& g, const kg::Tensor& x, const kg::Tensor& w,
                              const RefEpilogue& ep) {
  const std::int64_t n = x.dim(0), ho = g.ho(), wo = g.wo(), cg = g.c / g.groups, og = g.out / g.groups;
  std::vector<double> y(static_cast<std::size_t>(n * g.out * ho * wo));
  for (std::int64_t img = 0; img < n; ++img)
    for (std::int64_t oc = 0; oc < g.out; ++oc)
      for (std::int64_t i = 0; i < ho; ++i)
        for (std::int64_t j = 0; j < wo; ++j) {
          double s = 0;
          for (std::int64_t ci = 0; ci < cg; ++ci)
            for (std::int64_t ky = 0; ky < g.kernel.h; ++ky)
              for (std::int64_t kx = 0; kx < g.kernel.w; ++kx) {
                const std::int64_t iy = i * g.stride.h - g.padding.h + ky * g.dilation.h;
                const std::int64_t ix = j * g.stride.w - g.padding.w + kx * g.dilation.w;
                if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
                const std::int64_t chan = oc / og * cg + ci;
                s += w.item(((oc * cg + ci) * g.kernel.h + ky) * g.kernel.w + kx) *
                     x.item(((img * g.c + chan) * g.h + iy) * g.w + ix);
              }
          if (ep.bias) s += ep.bias->item(oc);
          if (ep.gamma)
            s = (s - ep.mean->item(oc)) / std::sqrt(ep.var->item(oc) + ep.eps) * ep.gamma->item(oc) +
                ep.beta->item(oc);
          const std::int64_t at = ((img * g.out + oc) * ho + i) * wo + j;
          if (ep.residual) s += ep.residual->item(at);
          y[static_cast<std::size_t>(at)] = ep.act ? ep.act(s) : s;
        }
  return y;
}

// The lowering of the model's only op node, for sm_90 at these input shapes.
kg::Lowered lower_only_op(const kg::Model& model) {
  for (int id : model.live_nodes()) {
    const kg::Node& n = model.graph().node(id);
    if (n.kind != kg::Node::Kind::Op) continue;
    std::optional<kg::Lowered> l =
        n.op->op().lower(kg::lower::lower_context(model, id, kg::lower::LowerTarget{{}, 90, true}));
    if (!l || !l->runtime_op) throw kg::Error(n.label() + " has no lowering");
    return *l;
  }
  throw kg::Error("the model has no op node");
}

// The entry stem of the convolution's own kernel, without the dtype suffix.
std::string algo_stem(const Geom& g, DType dtype) {
  switch (kg::ops::conv_gpu_algo(g.gpu_config(dtype))) {
    case kg::ops::ConvGpuAlgo::Gemm:
      return "gemm";
    case kg::ops::ConvGpuAlgo::Direct:
      return "direct";
    case kg::ops::ConvGpuAlgo::Nhwc:
      return "nhwc";
    case kg::ops::ConvGpuAlgo::NhwcMma:
      return "nhwc_mma";
    case kg::ops::ConvGpuAlgo::Tiled:
      break;
  }
  const std::int64_t og = g.out / g.groups, ocb = og % 4 == 0 ? 4 : og % 2 == 0 ? 2 : og >= 3 ? 4 : 1;
  return "tiled_" + std::to_string(g.kernel.h) + "x" + std::to_string(g.kernel.w) + "_" + std::to_string(ocb);
}

std::string suffix(DType t) { return "_" + std::string(kg::dtype_name(t)); }

// Made-up addresses and sizes of a convolution's tensors: what launches() and library_call() read.
kg::LaunchTensors conv_tensors(const Geom& g, std::int64_t batch, DType dtype) {
  constexpr kg::DevicePtr kApart = kg::DevicePtr{1} << 40;
  kg::LaunchTensors t;
  t.inputs = {{kApart, {batch, g.c, g.h, g.w}, dtype}};
  t.params = {{2 * kApart, {g.out, g.c / g.groups, g.kernel.h, g.kernel.w}, dtype}};
  if (g.bias) t.params.push_back({3 * kApart, {g.out}, dtype});
  t.output = {4 * kApart, {batch, g.out, g.ho(), g.wo()}, dtype};
  return t;
}

const std::vector<Geom>& geometries() {
  static const std::vector<Geom> all = {
      {3, 9, 10, 8, 3, 1, 1},                          // tiled 3x3, padding
      {4, 9, 10, 6, 3, 2, 1},                          // direct: stride 2
      {6, 9, 10, 4, 3, 1, 1, 1, 2},                    // tiled, groups
      {8, 9, 10, 8, 3, 2, 1, 1, 8, false},             // depthwise, stride 2, no bias
      {8, 7, 8, 8, 3, 1, 1, 1, 8},                     // depthwise, tiled
      {5, 7, 8, 3, 1},                                 // 1x1
      {4, 11, 9, 6, 3, 1, 2, 2, 1, false},             // dilation, no bias
      {16, 9, 10, 64, 3, 1, 1},                        // implicit GEMM
      {24, 6, 7, 40, {3, 2}, {2, 1}, {1, 0}, {2, 1}},  // GEMM with partial tiles, all options
      {48, 5, 6, 96, 1, 1, 0, 1, 1, false},            // GEMM over a 1x1 convolution, no bias
  };
  return all;
}

// Random parameters for every floating parameter of a loaded model, rounded to its dtype: weights
// and biases in [-b, b) with b = 1/sqrt(fan_in) (the layer's default), BatchNorm weights in
// [0.5, 1.5), biases and means in [-0.5, 0.5), variances in [0.5, 2).
std::map<std::string, kg::Tensor> random_params(const kg::Model& model, const Geom& g, std::mt19937_64& rng,
                                                DType dtype) {
  std::map<std::string, kg::Tensor> out;
  const double b = 1.0 / std::sqrt(static_cast<double>(g.kdim()));
  for (const kg::ParamInfo& p : model.parameters()) {
    if (!kg::is_floating(p.dtype)) continue;
    auto ends = [&](const std::string& s) {
      return p.name.size() >= s.size() && p.name.compare(p.name.size() - s.size(), s.size(), s) == 0;
    };
    const bool bn = p.name.find("bn.") != std::string::npos;
    double lo = -b, hi = b;
    if (bn && ends(".weight")) lo = 0.5, hi = 1.5;
    if (bn && (ends(".bias") || ends(".running_mean"))) lo = -0.5, hi = 0.5;
    if (ends(".running_var")) lo = 0.5, hi = 2.0;
    out[p.name] = kg_test::random_tensor(rng, dtype, p.shape, lo, hi);
  }
  return out;
}

// Runs `model` on the CPU with poisoned buffers and `params`; checks every element was written.
kg::Tensor run_cpu(const kg::Model& model, const std::vector<kg::Tensor>& inputs,
                   const std::map<std::string, kg::Tensor>& params, DType precision = DType::F32) {
  std::vector<std::vector<std::int64_t>> shapes;
  for (const auto& t : inputs) shapes.push_back(t.shape());
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  opt.precision = precision;
  kg::LoadedModel m = model.load(kg::Device::cpu(), shapes, opt);
  m.load_state_dict(params, false);
  kg::Tensor got = m.forward(inputs).at(0);
  EXPECT_TRUE(kg_test::all_written(got)) << "the CPU left output elements unwritten";
  return got;
}

// The emulated and GPU runs of the model `build` makes, against the CPU: check_lowering, and
// before it the op's own kernels alone under the emulator in checked mode (every buffer guarded,
// threads in both orders), so that they are compared with the CPU whichever path check_lowering's
// emulated run takes first.
void check_half_lowering(const kg_test::BuildFn& build, const std::vector<kg::Tensor>& inputs, DType dt) {
  const Tol t = lowering_tol(dt);
  {
    SCOPED_TRACE("own kernels, emulated");
    auto graph = kg::Graph::create();
    std::vector<kg::SymTensor> xs;
    std::vector<std::vector<std::int64_t>> shapes;
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      kg::Shape s = kg::Shape::of(inputs[i].shape());
      s[0] = kg::Dim::named("batch");
      xs.push_back(graph->input(inputs[i].dtype(), s, "x" + std::to_string(i)));
      shapes.push_back(inputs[i].shape());
    }
    kg::Model model(graph, build(xs));
    kg::LoadOptions opt;
    opt.poison_buffers = true;
    kg::LoadedModel cpu = model.load(kg::Device::cpu(), shapes, opt);
    const kg::Tensor want = cpu.forward(inputs).at(0);
    const kg::Tensor got =
        kg::emu::run_model(model, inputs, cpu.state_dict(), /*checked=*/true, /*library_calls=*/false).at(0);
    EXPECT_EQ(got.dtype(), dt);
    EXPECT_TRUE(kg_test::all_written(got)) << "the kernel left output elements unwritten";
    EXPECT_TRUE(kg_test::all_close(got, want, t.rtol, t.atol));
  }
  kg_test::check_lowering(build, inputs, t.rtol, t.atol);
}

// ---- fused convolutions, built as the fusion pass builds them ----

// A user's activation given by its per-element form only: softsign, x / (1 + |x|), whose device
// function is written for float (and double) as a user writes it.
kg::ElementwiseForm softsign_form() {
  kg::ElementwiseForm f;
  f.device_source =
      "__device__ __forceinline__ float softsign(float v) { return v / (1.0f + fabsf(v)); }\n"
      "__device__ __forceinline__ double softsign(double v) { return v / (1.0 + fabs(v)); }\n";
  f.function = "softsign";
  f.cpu = kg::ElementwiseForm::cpu_map<1>([](auto v) { return v / (decltype(v)(1) + std::abs(v)); });
  return f;
}
double softsign(double v) { return v / (1 + std::abs(v)); }

enum class Act { None, Relu, Softsign };

struct FusedCase {
  Geom conv;
  bool bn;
  bool residual;
  Act act;

  std::string text() const {
    return conv.text() + (bn ? " +bn" : "") + (residual ? " +add" : "") +
           (act == Act::Relu       ? " +relu"
            : act == Act::Softsign ? " +softsign"
                                   : "");
  }
};

// The fused op of `fc` with parameters declared in `param_dtype`, named as the fusion pass names
// them under the node ("weight", "bias", "bn.weight", ...).
kg::CustomData fused_op(const FusedCase& fc, DType dtype, DType param_dtype) {
  const Geom& g = fc.conv;
  kg::ops::Conv2dOp conv(g.c, g.out, g.kernel, g.options(), dtype);
  kg::ops::ConvEpilogueSpec spec;
  spec.batch_norm = fc.bn;
  spec.residual = fc.residual;
  if (fc.act == Act::Relu) spec.activation = kg::ops::UnarySpec{kg::ops::UnaryFn::Relu, 0.0};
  if (fc.act == Act::Softsign) {
    spec.activation_form = softsign_form();
    spec.activation_op = "test.softsign";
  }
  const double b = 1.0 / std::sqrt(static_cast<double>(g.kdim()));
  std::vector<kg::ParamSpec> params{{"weight",
                                     {g.out, g.c / g.groups, g.kernel.h, g.kernel.w},
                                     param_dtype,
                                     kg::ParamInit::uniform(-b, b),
                                     true}};
  if (g.bias) params.push_back({"bias", {g.out}, param_dtype, kg::ParamInit::uniform(-b, b), true});
  if (fc.bn) {
    params.push_back({"bn.weight", {g.out}, param_dtype, kg::ParamInit::uniform(0.5, 1.5), true});
    params.push_back({"bn.bias", {g.out}, param_dtype, kg::ParamInit::uniform(-0.5, 0.5), true});
    params.push_back({"bn.running_mean", {g.out}, param_dtype, kg::ParamInit::uniform(-0.5, 0.5), false});
    params.push_back({"bn.running_var", {g.out}, param_dtype, kg::ParamInit::uniform(0.5, 2.0), false});
    params.push_back({"bn.num_batches_tracked", {}, DType::I64, kg::ParamInit::constant(0), false});
  }
  return kg::CustomData::make<kg::ops::FusedConv2dOp>(conv, spec, params);
}

kg::SymTensor record_fused(const FusedCase& fc, const std::vector<kg::SymTensor>& xs, DType param_dtype) {
  std::vector<kg::SymTensor> others;
  if (fc.residual) others.push_back(xs.at(1));
  return xs[0].record_custom(fused_op(fc, xs[0].dtype(), param_dtype), others, std::nullopt, "conv");
}

}  // namespace

TEST(Conv2dHalf, MatchesDirectReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const Geom& g : geometries()) {
    for (DType dt : kHalfTypes) {
      SCOPED_TRACE(g.text() + " " + std::string(kg::dtype_name(dt)));
      auto graph = kg::Graph::create();
      auto x = graph->input(dt, kg::Shape{kg::Dim::named("batch"), g.c, g.h, g.w}, "x");
      kg::SymTensor y = kg::nn::conv2d(x, g.out, g.kernel, g.options(), "conv");
      ASSERT_EQ(y.dtype(), dt);
      kg::Model model(graph, {y});
      // The parameters are declared in the input's dtype.
      for (const kg::ParamInfo& p : model.parameters()) EXPECT_EQ(p.dtype, dt) << p.name;
      // The op's own kernel in 16-bit storage.
      const kg::Lowered lowered = lower_only_op(model);
      EXPECT_EQ(lowered.entry_point, "kg_conv2d_" + algo_stem(g, dt) + suffix(dt));

      const auto params = random_params(model, g, rng, dt);
      const kg::Tensor* bias = g.bias ? &params.at("conv.bias") : nullptr;
      for (std::int64_t batch : {1, 3}) {
        SCOPED_TRACE("batch " + std::to_string(batch));
        const kg::Tensor xin = kg_test::random_tensor(rng, dt, {batch, g.c, g.h, g.w});
        const kg::Tensor got = run_cpu(model, {xin}, params);
        ASSERT_EQ(got.dtype(), dt);
        RefEpilogue ep;
        ep.bias = bias;
        const Tol t = cpu_tol(dt);
        EXPECT_TRUE(kg_test::matches(got, reference(g, xin, params.at("conv.weight"), ep), t.rtol, t.atol));
      }
      check_half_lowering(
          [&](const std::vector<kg::SymTensor>& xs) {
            return std::vector<kg::SymTensor>{kg::nn::conv2d(xs[0], g.out, g.kernel, g.options(), "conv")};
          },
          {kg_test::random_tensor(rng, dt, {2, g.c, g.h, g.w})}, dt);
    }
  }
}

TEST(Conv2dHalf, FusedEpiloguesMatchReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<FusedCase> cases = {
      {{8, 9, 10, 8, 3, 1, 1}, true, true, Act::Relu},                // tiled: bn + add + relu
      {{4, 9, 10, 6, 3, 2, 1, 1, 1, false}, true, false, Act::Relu},  // direct, no bias: bn + relu
      {{6, 9, 10, 6, 3, 1, 1, 1, 6}, false, true, Act::Softsign},     // depthwise: add + user's activation
      {{16, 9, 10, 64, 3, 1, 1}, true, true, Act::Relu},              // gemm: bn + add + relu
      {{24, 6, 7, 40, 3, 2, 1, 1, 1, false}, true, false, Act::Softsign},  // gemm: bn + user's activation
      {{5, 7, 8, 3, 1}, true, true, Act::None},                            // 1x1: bn + add, no activation
  };
  for (const FusedCase& fc : cases) {
    for (DType dt : kHalfTypes) {
      SCOPED_TRACE(fc.text() + " " + std::string(kg::dtype_name(dt)));
      const Geom& g = fc.conv;
      auto graph = kg::Graph::create();
      std::vector<kg::SymTensor> xs{graph->input(dt, kg::Shape{kg::Dim::named("batch"), g.c, g.h, g.w}, "x")};
      if (fc.residual)
        xs.push_back(graph->input(dt, kg::Shape{kg::Dim::named("batch"), g.out, g.ho(), g.wo()}, "r"));
      // Declared in f32, as the fusion pass leaves an f32 model: the graph converts the floating
      // parameters for a node computing in the input's dtype.
      kg::SymTensor y = record_fused(fc, xs, DType::F32);
      ASSERT_EQ(y.dtype(), dt);
      kg::Model model(graph, {y});
      for (const kg::ParamInfo& p : model.parameters()) {
        if (kg::is_floating(p.dtype)) {
          EXPECT_EQ(p.dtype, dt) << p.name;
        }
      }

      // The fused module's entry and its epilogue entry (the library call's), in 16-bit storage.
      const kg::Lowered lowered = lower_only_op(model);
      std::string stem = "kg_conv2d_" + algo_stem(g, dt);
      if (fc.act != Act::None) {
        stem = "kg_fused_conv2d_" + algo_stem(g, dt) + (fc.act == Act::Relu ? "_relu" : "_act");
        EXPECT_EQ(lowered.entry_point.rfind(stem, 0), 0u) << lowered.entry_point;
      } else {
        EXPECT_EQ(lowered.entry_point, stem + suffix(dt));
      }
      EXPECT_EQ(lowered.entry_point.substr(lowered.entry_point.size() - suffix(dt).size()), suffix(dt));

      const auto params = random_params(model, g, rng, dt);
      for (std::int64_t batch : {1, 3}) {
        SCOPED_TRACE("batch " + std::to_string(batch));
        std::vector<kg::Tensor> inputs{kg_test::random_tensor(rng, dt, {batch, g.c, g.h, g.w})};
        if (fc.residual) inputs.push_back(kg_test::random_tensor(rng, dt, {batch, g.out, g.ho(), g.wo()}));
        const kg::Tensor got = run_cpu(model, inputs, params);
        ASSERT_EQ(got.dtype(), dt);
        RefEpilogue ep;
        if (g.bias) ep.bias = &params.at("conv.bias");
        if (fc.bn) {
          ep.gamma = &params.at("conv.bn.weight");
          ep.beta = &params.at("conv.bn.bias");
          ep.mean = &params.at("conv.bn.running_mean");
          ep.var = &params.at("conv.bn.running_var");
        }
        if (fc.residual) ep.residual = &inputs[1];
        if (fc.act == Act::Relu) ep.act = [](double v) { return v < 0 ? 0.0 : v; };
        if (fc.act == Act::Softsign) ep.act = softsign;
        const Tol t = cpu_tol(dt);
        EXPECT_TRUE(
            kg_test::matches(got, reference(g, inputs[0], params.at("conv.weight"), ep), t.rtol, t.atol));
      }
      std::vector<kg::Tensor> inputs{kg_test::random_tensor(rng, dt, {2, g.c, g.h, g.w})};
      if (fc.residual) inputs.push_back(kg_test::random_tensor(rng, dt, {2, g.out, g.ho(), g.wo()}));
      check_half_lowering(
          [&](const std::vector<kg::SymTensor>& in) {
            return std::vector<kg::SymTensor>{record_fused(fc, in, dt)};
          },
          inputs, dt);
    }
  }
}

// The precision pass's route: an f32 model (conv → batch norm → add → relu, fused into one node
// when the model is made) loaded in f16 or bf16 runs the fused convolution in that dtype, its
// parameters converted at load.
TEST(Conv2dHalf, F32ModelLoadedInHalfPrecision) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const Geom g{8, 9, 10, 8, 3, 1, 1};
  auto graph = kg::Graph::create();
  auto x = graph->input(DType::F32, kg::Shape{kg::Dim::named("batch"), g.c, g.h, g.w}, "x");
  auto r = graph->input(DType::F32, kg::Shape{kg::Dim::named("batch"), g.out, g.ho(), g.wo()}, "r");
  kg::SymTensor y = kg::nn::conv2d(x, g.out, g.kernel, g.options(), "conv");
  y = kg::relu(kg::add(kg::nn::batch_norm2d(y, "bn"), r, "add"), "act");
  kg::Model model(graph, {y});
  std::vector<std::string> ops;
  for (int id : model.live_nodes())
    if (model.graph().node(id).kind == kg::Node::Kind::Op) ops.push_back(model.graph().node(id).op_name());
  ASSERT_EQ(ops, std::vector<std::string>{"nn.fused_conv2d"});
  const auto f32_params = random_params(model, g, rng, DType::F32);
  for (DType dt : kHalfTypes) {
    SCOPED_TRACE(kg::dtype_name(dt));
    const std::vector<kg::Tensor> inputs{kg_test::random_tensor(rng, DType::F32, {2, g.c, g.h, g.w}),
                                         kg_test::random_tensor(rng, DType::F32, {2, g.out, g.ho(), g.wo()})};
    kg::LoadOptions opt;
    opt.poison_buffers = true;
    opt.precision = dt;
    kg::LoadedModel m = model.load(kg::Device::cpu(), {inputs[0].shape(), inputs[1].shape()}, opt);
    m.load_state_dict(f32_params, false);
    // The parameters the node computes with: converted to the dtype.
    const std::map<std::string, kg::Tensor> p = m.state_dict();
    EXPECT_EQ(p.at("conv.weight").dtype(), dt);
    EXPECT_EQ(p.at("bn.running_var").dtype(), dt);
    const kg::Tensor got = m.forward(inputs).at(0);
    EXPECT_EQ(got.dtype(), DType::F32);  // the model's output keeps its recorded dtype
    EXPECT_TRUE(kg_test::all_written(got));
    // The reference on the values the node sees: inputs and parameters rounded to the dtype.
    const kg::Tensor xr = inputs[0].to(dt), rr = inputs[1].to(dt);
    RefEpilogue ep;
    ep.bias = &p.at("conv.bias");
    ep.gamma = &p.at("bn.weight");
    ep.beta = &p.at("bn.bias");
    ep.mean = &p.at("bn.running_mean");
    ep.var = &p.at("bn.running_var");
    ep.residual = &rr;
    ep.act = [](double v) { return v < 0 ? 0.0 : v; };
    const Tol t = cpu_tol(dt);
    EXPECT_TRUE(kg_test::matches(got, reference(g, xr, p.at("conv.weight"), ep), t.rtol, t.atol));
  }
}

// The vendor path in 16-bit: the convolution for cuDNN in the node's dtype, then the epilogue
// entry of the same storage type over its output. And the tiled kernel stages float in shared
// memory whatever the storage.
TEST(Conv2dHalf, LibraryCallAndLaunchesIn16Bit) {
  for (DType dt : kHalfTypes) {
    SCOPED_TRACE(kg::dtype_name(dt));
    // A plain convolution with a bias: the bias is the epilogue.
    const Geom plain{16, 9, 10, 64, 3, 1, 1};
    const kg::Lowered l = kg::ops::lower_conv(plain.gpu_config(dt), "nn.conv2d");
    EXPECT_EQ(l.entry_point, "kg_conv2d_gemm" + suffix(dt));
    const kg::LaunchTensors t = conv_tensors(plain, 2, dt);
    std::optional<kg::LibraryCall> call = l.runtime_op->library_call(t);
    ASSERT_TRUE(call.has_value());
    const auto* conv = std::get_if<kg::Conv2dCall>(&call->call);
    ASSERT_NE(conv, nullptr);
    EXPECT_EQ(conv->dtype, dt);
    EXPECT_EQ(conv->x, t.inputs[0].ptr);
    EXPECT_EQ(conv->y, t.output.ptr);
    ASSERT_EQ(call->epilogue.size(), 1u);
    EXPECT_EQ(call->epilogue[0].entry, "kg_conv2d_epilogue" + suffix(dt));
    // A thread per element: a 9 × 10 plane does not hold whole 16-byte packs.
    EXPECT_EQ(call->epilogue[0].grid.x, (2u * 64 * 90 + 255) / 256);
    // No backward in 16-bit: neither the library's nor the kernels'.
    EXPECT_FALSE(l.runtime_op->backward_library_calls(t).has_value());

    // A 12 × 12 plane holds 18 packs of 8: the epilogue takes a thread per pack.
    const Geom packed{16, 12, 12, 64, 3, 1, 1};
    call = kg::ops::lower_conv(packed.gpu_config(dt), "nn.conv2d").runtime_op->library_call(conv_tensors(packed, 2, dt));
    ASSERT_TRUE(call.has_value());
    ASSERT_EQ(call->epilogue.size(), 1u);
    EXPECT_EQ(call->epilogue[0].grid.x, (2u * 64 * 144 / 8 + 255) / 256);

    // Without a bias or epilogue: the library call alone.
    const Geom nobias{16, 9, 10, 64, 3, 1, 1, 1, 1, false};
    call = kg::ops::lower_conv(nobias.gpu_config(dt), "nn.conv2d")
               .runtime_op->library_call(conv_tensors(nobias, 2, dt));
    ASSERT_TRUE(call.has_value());
    EXPECT_TRUE(call->epilogue.empty());

    // A fused relu on the tiled kernel: one module with both entries.
    kg::ops::ConvGpuConfig fused = Geom{6, 14, 14, 16, 5}.gpu_config(dt);
    fused.activation = kg::ops::UnarySpec{kg::ops::UnaryFn::Relu, 0.0};
    const kg::Lowered lf = kg::ops::lower_conv(fused, "nn.fused_conv2d");
    EXPECT_EQ(lf.entry_point, "kg_fused_conv2d_tiled_5x5_4_relu" + suffix(dt));
    const kg::LaunchTensors tf = conv_tensors(Geom{6, 14, 14, 16, 5}, 3, dt);
    call = lf.runtime_op->library_call(tf);
    ASSERT_TRUE(call.has_value());
    ASSERT_EQ(call->epilogue.size(), 1u);
    EXPECT_EQ(call->epilogue[0].entry, "kg_fused_conv2d_tiled_5x5_4_relu_epilogue" + suffix(dt));
    // The tiled launch's shared memory holds floats: the same as the f32 kernel's.
    const std::vector<kg::Launch> half = lf.runtime_op->launches(tf);
    fused.dtype = DType::F32;
    const std::vector<kg::Launch> single =
        kg::ops::lower_conv(fused, "nn.fused_conv2d")
            .runtime_op->launches(conv_tensors(Geom{6, 14, 14, 16, 5}, 3, DType::F32));
    ASSERT_EQ(half.size(), 1u);
    ASSERT_EQ(single.size(), 1u);
    EXPECT_EQ(half[0].shared_bytes, single[0].shared_bytes);
    EXPECT_EQ(half[0].grid.x, single[0].grid.x);
  }
}

// The vendor path as a GPU with the libraries runs it, emulated on host memory: the convolution
// alone rounded to the dtype (what cuDNN gives, computing in f32), then the op's epilogue
// launches over it in place, in 16-bit storage computing in float. Compared with the reference at
// the lowering tolerance (the result is rounded twice).
TEST(Conv2dHalf, LibraryPathEpilogueEmulated) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<FusedCase> cases = {
      {{16, 9, 10, 64, 3, 1, 1}, false, false, Act::None},  // the bias alone
      {{8, 9, 10, 8, 3, 1, 1}, true, true, Act::Relu},      // bn + add + relu
      {{6, 9, 10, 6, 3, 2, 1, 1, 6, false},
       true,
       true,
       Act::Softsign},  // no bias: bn + add + user's activation
  };
  auto ptr = [](const kg::Tensor& t) {
    return static_cast<kg::DevicePtr>(reinterpret_cast<std::uintptr_t>(t.raw()));
  };
  for (const FusedCase& fc : cases) {
    for (DType dt : kHalfTypes) {
      SCOPED_TRACE(fc.text() + " " + std::string(kg::dtype_name(dt)));
      const Geom& g = fc.conv;
      const std::int64_t batch = 2;
      kg::ops::ConvGpuConfig cfg = g.gpu_config(dt);
      cfg.batch_norm = fc.bn;
      cfg.residual = fc.residual;
      if (fc.act == Act::Relu) cfg.activation = kg::ops::UnarySpec{kg::ops::UnaryFn::Relu, 0.0};
      if (fc.act == Act::Softsign) cfg.activation_form = softsign_form();
      const kg::Lowered l = kg::ops::lower_conv(cfg, "nn.fused_conv2d");

      const double b = 1.0 / std::sqrt(static_cast<double>(g.kdim()));
      const kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, g.c, g.h, g.w});
      const kg::Tensor w =
          kg_test::random_tensor(rng, dt, {g.out, g.c / g.groups, g.kernel.h, g.kernel.w}, -b, b);
      const kg::Tensor bias = kg_test::random_tensor(rng, dt, {g.out}, -b, b);
      const kg::Tensor gamma = kg_test::random_tensor(rng, dt, {g.out}, 0.5, 1.5);
      const kg::Tensor beta = kg_test::random_tensor(rng, dt, {g.out}, -0.5, 0.5);
      const kg::Tensor mean = kg_test::random_tensor(rng, dt, {g.out}, -0.5, 0.5);
      const kg::Tensor var = kg_test::random_tensor(rng, dt, {g.out}, 0.5, 2.0);
      const kg::Tensor res = kg_test::random_tensor(rng, dt, {batch, g.out, g.ho(), g.wo()});
      // The library's output: the convolution alone, rounded once to the dtype.
      const std::vector<std::int64_t> out_shape{batch, g.out, g.ho(), g.wo()};
      kg::Tensor y = kg::Tensor::from_vector(out_shape, reference(g, x, w, RefEpilogue{})).to(dt);

      kg::LaunchTensors t;
      t.inputs = {{ptr(x), x.shape(), dt}};
      if (fc.residual) t.inputs.push_back({ptr(res), res.shape(), dt});
      t.params = {{ptr(w), w.shape(), dt}};
      if (g.bias) t.params.push_back({ptr(bias), bias.shape(), dt});
      if (fc.bn)
        for (const kg::Tensor* p : {&gamma, &beta, &mean, &var})
          t.params.push_back({ptr(*p), p->shape(), dt});
      t.output = {ptr(y), out_shape, dt};
      const std::optional<kg::LibraryCall> call = l.runtime_op->library_call(t);
      ASSERT_TRUE(call.has_value());
      const auto* conv = std::get_if<kg::Conv2dCall>(&call->call);
      ASSERT_NE(conv, nullptr);
      EXPECT_EQ(conv->dtype, dt);
      EXPECT_EQ(conv->w, ptr(w));
      EXPECT_EQ(conv->y, ptr(y));
      ASSERT_EQ(call->epilogue.size(), 1u);
      for (const kg::Launch& L : call->epilogue)
        kg::emu::launch(l.name, l.source, L.entry, L.grid, L.block, L.shared_bytes, L.args);

      RefEpilogue ep;
      if (g.bias) ep.bias = &bias;
      if (fc.bn) {
        ep.gamma = &gamma;
        ep.beta = &beta;
        ep.mean = &mean;
        ep.var = &var;
      }
      if (fc.residual) ep.residual = &res;
      if (fc.act == Act::Relu) ep.act = [](double v) { return v < 0 ? 0.0 : v; };
      if (fc.act == Act::Softsign) ep.act = softsign;
      const Tol lt = lowering_tol(dt);
      EXPECT_TRUE(kg_test::matches(y, reference(g, x, w, ep), lt.rtol, lt.atol));
    }
  }
}

TEST(Conv2dHalf, MixedDtypesAreErrors) {
  const Geom g{3, 8, 8, 4, 3, 1, 1};
  // An f32 input with a bf16 convolution's parameters.
  {
    auto graph = kg::Graph::create();
    auto x = graph->input(DType::F32, kg::Shape{1, g.c, g.h, g.w}, "x");
    kg_test::expect_error(
        [&] {
          x.record_custom(
              kg::CustomData::make<kg::ops::Conv2dOp>(g.c, g.out, g.kernel, g.options(), DType::BF16), {},
              std::nullopt, "conv");
        },
        {"nn.conv2d", "conv", "f32", "bf16"});
  }
  // f16 parameters on a bf16 input: only f32 parameters are converted.
  {
    auto graph = kg::Graph::create();
    auto x = graph->input(DType::BF16, kg::Shape{1, g.c, g.h, g.w}, "x");
    kg_test::expect_error(
        [&] {
          x.record_custom(
              kg::CustomData::make<kg::ops::Conv2dOp>(g.c, g.out, g.kernel, g.options(), DType::F16), {},
              std::nullopt, "conv");
        },
        {"nn.conv2d", "bf16", "f16"});
  }
  // A fused convolution: an f32 input with a bf16 residual, and an f32 input with bf16 parameters.
  const FusedCase fc{g, true, true, Act::Relu};
  {
    auto graph = kg::Graph::create();
    std::vector<kg::SymTensor> xs{graph->input(DType::F32, kg::Shape{1, g.c, g.h, g.w}, "x"),
                                  graph->input(DType::BF16, kg::Shape{1, g.out, g.ho(), g.wo()}, "r")};
    kg_test::expect_error([&] { record_fused(fc, xs, DType::F32); }, {"nn.fused_conv2d", "f32", "bf16"});
  }
  {
    auto graph = kg::Graph::create();
    std::vector<kg::SymTensor> xs{graph->input(DType::F32, kg::Shape{1, g.c, g.h, g.w}, "x"),
                                  graph->input(DType::F32, kg::Shape{1, g.out, g.ho(), g.wo()}, "r")};
    kg_test::expect_error(
        [&] { xs[0].record_custom(fused_op(fc, DType::F32, DType::BF16), {xs[1]}, std::nullopt, "conv"); },
        {"nn.fused_conv2d", "f32", "bf16"});
  }
}

// 16-bit convolutions are for inference: in a model lowered for training the load fails with an
// error naming the op and the dtype, on the CPU as on a GPU.
TEST(Conv2dHalf, TrainingIsAnError) {
  const Geom g{3, 8, 8, 4, 3, 1, 1};
  for (DType dt : kHalfTypes) {
    SCOPED_TRACE(kg::dtype_name(dt));
    auto graph = kg::Graph::create();
    auto x = graph->input(dt, kg::Shape{kg::Dim::named("batch"), g.c, g.h, g.w}, "x");
    kg::Model model(graph, {kg::nn::conv2d(x, g.out, g.kernel, g.options(), "conv")},
                    kg::LoweringMode::Training);
    const std::string name(kg::dtype_name(dt));
    kg_test::expect_error(
        [&] {
          model.load(kg::Device::cpu(), {{2, g.c, g.h, g.w}});
        },
        {"nn.conv2d", "conv", name, "inference"});
    if (kg::Device::cuda_available())
      kg_test::expect_error(
          [&] {
            model.load(kg::Device::cuda(), {{2, g.c, g.h, g.w}});
          },
          {"nn.conv2d", "conv", name, "inference"});
  }
}
