#include "ops/conv_dnnl.hpp"

#include <algorithm>
#include <cmath>

#include "kg/error.hpp"
#include "ops/dnnl.hpp"
#include "ops/op_util.hpp"
#include "util/str.hpp"

namespace kg::ops {

namespace {

// [N, H, W, C] → [N, C, H, W] and back, for symbolic shapes.
Shape to_nchw(const Shape& s) { return Shape(std::vector<Dim>{s[0], s[3], s[1], s[2]}); }
Shape to_nhwc(const Shape& s) { return Shape(std::vector<Dim>{s[0], s[2], s[3], s[1]}); }

// The oneDNN post-op activation for a built-in activation; None when oneDNN has none for it
// (then it is applied after the convolution).
dnnl::Act act_of(const std::optional<UnarySpec>& a, float& alpha) {
  alpha = 0.f;
  if (!a) return dnnl::Act::None;
  switch (a->fn) {
    case UnaryFn::Relu:
      return dnnl::Act::Relu;
    case UnaryFn::LeakyRelu:
      alpha = static_cast<float>(a->param);
      return dnnl::Act::LeakyRelu;
    case UnaryFn::Silu:
      alpha = 1.f;  // x * sigmoid(alpha * x)
      return dnnl::Act::Silu;
    case UnaryFn::GeluErf:
      return dnnl::Act::GeluErf;
    case UnaryFn::GeluTanh:
      return dnnl::Act::GeluTanh;
    case UnaryFn::Sigmoid:
      return dnnl::Act::Sigmoid;
    case UnaryFn::Tanh:
      return dnnl::Act::Tanh;
  }
  return dnnl::Act::None;
}

}  // namespace

struct ChannelsLastConvOp::State {
  std::vector<std::int64_t> input;  // the bound input sizes
  std::unique_ptr<dnnl::Conv> conv;
  const void* weights = nullptr;  // the parameter memory the converted weights came from
  std::uint64_t generation = 0;
};

ChannelsLastConvOp::ChannelsLastConvOp(Conv2dOp conv, ConvEpilogueSpec spec, std::vector<ParamSpec> params,
                                       bool tune)
    : conv_(std::move(conv)), spec_(std::move(spec)), params_(std::move(params)), tune_(tune) {}

ChannelsLastConvOp::~ChannelsLastConvOp() = default;

bool ChannelsLastConvOp::supports(const Conv2dOp& conv) {
  return conv.dtype() == DType::F32 && dnnl::available();
}

std::string ChannelsLastConvOp::attributes() const {
  std::string a =
      spec_.fused_nodes.empty() ? conv_.attributes() : FusedConv2dOp(conv_, spec_, params_).attributes();
  a += " layout=nhwc";
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ && state_->conv) a += " impl=onednn:" + state_->conv->impl();
  return a;
}

Shape ChannelsLastConvOp::infer_output_shape(const std::vector<Shape>& in) const {
  require_inputs(in, spec_.residual ? 2 : 1);
  require_rank(in[0], 4, "[N, H, W, C]");
  const Shape out = to_nhwc(conv_.infer_output_shape({to_nchw(in[0])}));
  if (spec_.residual && !(in[1] == out))
    throw Error(util::cat("the residual ", in[1].to_string(), " must have the convolution's output shape ",
                          out.to_string()));
  return out;
}

DType ChannelsLastConvOp::infer_output_dtype(const std::vector<DType>& in) const {
  if (in.empty()) throw Error("takes an input, got none");
  for (DType t : in) {
    if (t != DType::F32 && !is_half_float(t))
      throw Error(util::cat("runs on f32, f16 or bf16 inputs, got ", dtype_name(t)));
    if (t != in[0])
      throw Error(util::cat("runs on inputs of one dtype, got ", dtype_name(in[0]), " and ", dtype_name(t)));
  }
  return in[0];
}

std::optional<Lowered> ChannelsLastConvOp::lower(const LowerContext& ctx) const {
  ConvGpuConfig cfg = conv_gpu_config(conv_, spec_, ctx.output_dtype);
  cfg.channels_last = true;
  return lower_conv(cfg, name());
}

void ChannelsLastConvOp::cpu_forward(CpuContext& ctx) const {
  if (ctx.training)
    throw Error("runs for inference only; the channels-last pass does not rewrite training graphs");
  if (ctx.inputs[0].dtype() != DType::F32)
    throw Error(util::cat("runs f32 only on the CPU (oneDNN), got ", dtype_name(ctx.inputs[0].dtype()),
                          "; the channels-last pass rewrites 16-bit convolutions for the GPU alone"));
  const Tensor& x = ctx.inputs[0];
  const auto in = x.shape();
  const auto out = ctx.output.shape();
  const bool has_bias = conv_.options().bias;
  std::lock_guard<std::mutex> lock(mu_);
  if (!state_ || state_->input != in) {
    auto st = std::make_unique<State>();
    st->input = in;
    const auto& o = conv_.options();
    dnnl::ConvShape s;
    s.n = in[0], s.h = in[1], s.w = in[2], s.c = in[3];
    s.o = out[3], s.oh = out[1], s.ow = out[2];
    s.kh = conv_.kernel().h, s.kw = conv_.kernel().w;
    s.sh = o.stride.h, s.sw = o.stride.w, s.ph = o.padding.h, s.pw = o.padding.w;
    s.dh = o.dilation.h, s.dw = o.dilation.w, s.groups = o.groups;
    s.residual = spec_.residual;
    s.tune = tune_;
    s.act = act_of(spec_.activation, s.alpha);
    if (spec_.clip) {  // ReLU6 and the like: a clip post-op instead of the form after
      s.act = dnnl::Act::Clip;
      s.alpha = static_cast<float>(std::max(spec_.clip->first, -3.0e38));
      s.beta = static_cast<float>(std::min(spec_.clip->second, 3.0e38));
    }
    st->conv = std::make_unique<dnnl::Conv>(s);
    state_ = std::move(st);
  }
  State& st = *state_;
  const Tensor& w = ctx.params[0];
  if (st.weights != w.raw() || st.generation != dnnl::parameters_generation()) {
    const std::int64_t oc = out[3];
    const float* bias = has_bias ? ctx.params[1].data<float>() : nullptr;
    if (!spec_.batch_norm) {
      st.conv->set_weights(w.data<float>(), nullptr, bias);
    } else {
      // y = (conv + bias - mean) * s + beta with s = gamma / sqrt(var + eps): s goes into the
      // weights, the rest into the bias.
      const std::size_t at = has_bias ? 2 : 1;
      const float* gamma = ctx.params[at].data<float>();
      const float* beta = ctx.params[at + 1].data<float>();
      const float* mean = ctx.params[at + 2].data<float>();
      const float* var = ctx.params[at + 3].data<float>();
      std::vector<float> scale(static_cast<std::size_t>(oc)), shift(static_cast<std::size_t>(oc));
      for (std::int64_t c = 0; c < oc; ++c) {
        const double sc =
            static_cast<double>(gamma[c]) / std::sqrt(static_cast<double>(var[c]) + spec_.bn_eps);
        const double b = bias ? static_cast<double>(bias[c]) : 0.0;
        scale[static_cast<std::size_t>(c)] = static_cast<float>(sc);
        shift[static_cast<std::size_t>(c)] =
            static_cast<float>(static_cast<double>(beta[c]) + (b - mean[c]) * sc);
      }
      st.conv->set_weights(w.data<float>(), scale.data(), shift.data());
    }
    st.weights = w.raw();
    st.generation = dnnl::parameters_generation();
  }
  float* y = ctx.output.data<float>();
  st.conv->run(x.data<float>(), spec_.residual ? ctx.inputs[1].data<float>() : nullptr, y);
  // A built-in activation without a oneDNN post-op, or a user's activation: its CPU form, in
  // place, in blocks that stay in cache.
  float alpha = 0.f;
  const bool act_after = spec_.activation && act_of(spec_.activation, alpha) == dnnl::Act::None;
  const bool form_after = spec_.activation_form && !spec_.clip;
  if (!act_after && !form_after) return;
  const std::int64_t n = ctx.output.numel();
  constexpr std::int64_t kBlock = 16384;
  ctx.parallel_for((n + kBlock - 1) / kBlock, 1, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) {
      float* p = y + i * kBlock;
      const std::int64_t m = std::min(kBlock, n - i * kBlock);
      if (act_after) apply_unary<float>(*spec_.activation, p, p, m);
      if (form_after) {
        const void* ins[1] = {p};
        spec_.activation_form->cpu(ElementwiseSpan{DType::F32, ins, nullptr, p, m, 0});
      }
    }
  });
}

}  // namespace kg::ops
