#include "ops/dnnl.hpp"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <unordered_map>
#include <vector>

#include "kg/error.hpp"
#include "util/str.hpp"

#if KG_HAVE_DNNL
#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace kg::ops::dnnl {

namespace {
std::atomic<std::uint64_t> g_generation{1};
}  // namespace

std::uint64_t parameters_generation() { return g_generation.load(std::memory_order_acquire); }
void parameters_changed() { g_generation.fetch_add(1, std::memory_order_acq_rel); }

#if KG_HAVE_DNNL

namespace {

using ::dnnl::algorithm;
using ::dnnl::memory;
using tag = ::dnnl::memory::format_tag;
using dt = ::dnnl::memory::data_type;

struct Runtime {
  std::unique_ptr<::dnnl::engine> engine;
  std::string why_not;
};

const Runtime& runtime() {
  static const Runtime r = [] {
    Runtime out;
    try {
      out.engine = std::make_unique<::dnnl::engine>(::dnnl::engine::kind::cpu, 0);
    } catch (const std::exception& e) {
      out.why_not = std::string("oneDNN's CPU engine did not start: ") + e.what();
    }
    return out;
  }();
  return r;
}

const ::dnnl::engine& engine() {
  const Runtime& r = runtime();
  if (!r.engine) throw Error(r.why_not);
  return *r.engine;
}

// One in-order CPU stream per calling thread (cheap; primitives run on the caller's OpenMP team).
::dnnl::stream& stream() {
  thread_local ::dnnl::stream s(engine());
  return s;
}

algorithm eltwise_of(Act a) {
  switch (a) {
    case Act::Relu:
    case Act::LeakyRelu:
      return algorithm::eltwise_relu;
    case Act::Silu:
      return algorithm::eltwise_swish;
    case Act::GeluErf:
      return algorithm::eltwise_gelu_erf;
    case Act::GeluTanh:
      return algorithm::eltwise_gelu_tanh;
    case Act::Sigmoid:
      return algorithm::eltwise_logistic;
    case Act::Tanh:
      return algorithm::eltwise_tanh;
    case Act::Clip:
      return algorithm::eltwise_clip;
    case Act::None:
      break;
  }
  return algorithm::undef;
}

memory::dims nhwc_dims(std::int64_t n, std::int64_t c, std::int64_t h, std::int64_t w) {
  return {n, c, h, w};
}

// The far-side padding that makes a window of k (dilated by d) with stride s and near padding p
// produce `out` positions from `in`.
std::int64_t far_padding(std::int64_t in, std::int64_t out, std::int64_t k, std::int64_t s, std::int64_t p,
                         std::int64_t d) {
  return (out - 1) * s + (k - 1) * d + 1 - in - p;
}

}  // namespace

bool available() { return runtime().engine != nullptr; }
const std::string& unavailable_reason() { return runtime().why_not; }

struct Conv::Impl {
  ConvShape s;
  ::dnnl::convolution_forward::primitive_desc pd;
  ::dnnl::convolution_forward prim;
  memory weights, bias;
  memory::desc src_md, dst_md, w_user_md;
  bool have_weights = false;
  // Tuning: the other implementations to time at the first run, and the weights (scaled, in
  // the user's layout) to convert for each; cleared once the choice is made.
  std::vector<::dnnl::convolution_forward::primitive_desc> candidates;
  std::vector<float> user_weights;
  std::string tuned;  // the candidates' times, for impl()

  // dst (the primitive's or a candidate's weights memory) = the user's weights `src`, converted.
  void convert_weights(const float* src, memory& dst) {
    memory user(w_user_md, engine(), const_cast<float*>(src));
    ::dnnl::reorder(user, dst).execute(stream(), user, dst);
    stream().wait();
  }
};

namespace {

// Implementations worth timing: oneDNN's reference and GEMM-based fallbacks and its SSE4.1
// kernels are never the fastest on a machine with AVX2 or AVX-512.
bool worth_timing(const std::string& impl) {
  return impl.find("ref") == std::string::npos && impl.find("gemm") == std::string::npos &&
         impl.find("sse41") == std::string::npos;
}

}  // namespace

Conv::Conv(const ConvShape& s) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.s = s;
  try {
    m.src_md = memory::desc(nhwc_dims(s.n, s.c, s.h, s.w), dt::f32, tag::nhwc);
    m.dst_md = memory::desc(nhwc_dims(s.n, s.o, s.oh, s.ow), dt::f32, tag::nhwc);
    const memory::dims wdims = s.groups == 1
                                   ? memory::dims{s.o, s.c, s.kh, s.kw}
                                   : memory::dims{s.groups, s.o / s.groups, s.c / s.groups, s.kh, s.kw};
    m.w_user_md = memory::desc(wdims, dt::f32, s.groups == 1 ? tag::oihw : tag::goihw);
    const memory::desc w_any(wdims, dt::f32, tag::any);
    const memory::desc b_md({s.o}, dt::f32, tag::x);
    const memory::dims strides{s.sh, s.sw}, dil{s.dh - 1, s.dw - 1}, pad_l{s.ph, s.pw},
        pad_r{far_padding(s.h, s.oh, s.kh, s.sh, s.ph, s.dh), far_padding(s.w, s.ow, s.kw, s.sw, s.pw, s.dw)};
    ::dnnl::post_ops po;
    if (s.residual) po.append_binary(algorithm::binary_add, m.dst_md);
    if (s.act != Act::None) po.append_eltwise(1.f, eltwise_of(s.act), s.alpha, s.beta);
    ::dnnl::primitive_attr attr;
    attr.set_post_ops(po);
    ::dnnl::convolution_forward::desc d(::dnnl::prop_kind::forward_inference, algorithm::convolution_direct,
                                        m.src_md, w_any, b_md, m.dst_md, strides, dil, pad_l, pad_r);
    m.pd = ::dnnl::convolution_forward::primitive_desc(d, attr, engine());
    if (s.tune) {
      ::dnnl::convolution_forward::primitive_desc it = m.pd;
      do {
        if (worth_timing(it.impl_info_str())) m.candidates.push_back(it);
      } while (it.next_impl() && m.candidates.size() < 6);
      if (m.candidates.size() < 2) m.candidates.clear();  // nothing to choose between
      if (!m.candidates.empty()) m.pd = m.candidates.front();
    }
    m.prim = ::dnnl::convolution_forward(m.pd);
    m.weights = memory(m.pd.weights_desc(), engine());
    m.bias = memory(b_md, engine());
  } catch (const ::dnnl::error& e) {
    throw Error(util::cat("oneDNN has no convolution for input [", s.n, ", ", s.h, ", ", s.w, ", ", s.c,
                          "] (NHWC), ", s.o, " outputs, kernel ", s.kh, "x", s.kw, ", groups ", s.groups,
                          ": ", e.what()));
  }
}

Conv::~Conv() = default;

void Conv::set_weights(const float* oihw, const float* scale, const float* bias) {
  Impl& m = *impl_;
  const ConvShape& s = m.s;
  const std::int64_t per_out = s.c / s.groups * s.kh * s.kw;
  std::vector<float> scaled;
  const float* src = oihw;
  if (scale) {
    scaled.assign(oihw, oihw + s.o * per_out);
    for (std::int64_t o = 0; o < s.o; ++o)
      for (std::int64_t k = 0; k < per_out; ++k)
        scaled[static_cast<std::size_t>(o * per_out + k)] *= scale[o];
    src = scaled.data();
  }
  if (!m.candidates.empty()) m.user_weights.assign(src, src + s.o * per_out);
  m.convert_weights(src, m.weights);
  float* b = static_cast<float*>(m.bias.get_data_handle());
  for (std::int64_t o = 0; o < s.o; ++o) b[o] = bias ? bias[o] : 0.f;
  m.have_weights = true;
}

void Conv::run(const float* src, const float* residual, float* dst) {
  Impl& m = *impl_;
  if (!m.have_weights) throw Error("oneDNN convolution run before its weights were set");
  memory src_m(m.src_md, engine(), const_cast<float*>(src));
  memory dst_m(m.dst_md, engine(), dst);
  std::unordered_map<int, memory> args{
      {DNNL_ARG_SRC, src_m}, {DNNL_ARG_WEIGHTS, m.weights}, {DNNL_ARG_BIAS, m.bias}, {DNNL_ARG_DST, dst_m}};
  if (m.s.residual)
    args.emplace(DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1,
                 memory(m.dst_md, engine(), const_cast<float*>(residual)));
  if (!m.candidates.empty()) {
    // Each candidate, with the weights in its own layout: one run to warm it up, then the
    // faster of two timed runs. A candidate slower than twice the best so far is not run again.
    double best_ms = 0;
    std::size_t best = 0;
    std::vector<::dnnl::convolution_forward> prims;
    std::vector<memory> weights;
    for (std::size_t i = 0; i < m.candidates.size(); ++i) {
      prims.emplace_back(m.candidates[i]);
      weights.emplace_back(m.candidates[i].weights_desc(), engine());
      m.convert_weights(m.user_weights.data(), weights.back());
      args[DNNL_ARG_WEIGHTS] = weights.back();
      double ms = 0;
      for (int rep = 0; rep < 3; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        prims.back().execute(stream(), args);
        stream().wait();
        const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (rep == 1 || (rep == 2 && t < ms)) ms = t;
        if (rep == 0 && i > 0 && t > 2 * best_ms) {
          ms = t;
          break;
        }
      }
      char t[32];
      std::snprintf(t, sizeof t, " %.3f ms", ms);
      m.tuned += util::cat(i ? ", " : "", m.candidates[i].impl_info_str(), t);
      if (i == 0 || ms < best_ms) {
        best_ms = ms;
        best = i;
      }
    }
    m.pd = m.candidates[best];
    m.prim = prims[best];
    m.weights = weights[best];
    args[DNNL_ARG_WEIGHTS] = m.weights;
    m.candidates.clear();
    m.user_weights.clear();
    m.user_weights.shrink_to_fit();
  }
  m.prim.execute(stream(), args);
  stream().wait();
}

std::string Conv::impl() const {
  const std::string chosen = impl_->pd.impl_info_str();
  return impl_->tuned.empty() ? chosen : chosen + ", tuned: " + impl_->tuned;
}

struct Pool::Impl {
  PoolShape s;
  ::dnnl::pooling_v2_forward::primitive_desc pd;
  ::dnnl::pooling_v2_forward prim;
  memory::desc src_md, dst_md;
};

Pool::Pool(const PoolShape& s) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.s = s;
  try {
    m.src_md = memory::desc(nhwc_dims(s.n, s.c, s.h, s.w), dt::f32, tag::nhwc);
    m.dst_md = memory::desc(nhwc_dims(s.n, s.c, s.oh, s.ow), dt::f32, tag::nhwc);
    const algorithm alg = s.kind == PoolShape::Kind::Max             ? algorithm::pooling_max
                          : s.kind == PoolShape::Kind::AvgIncludePad ? algorithm::pooling_avg_include_padding
                                                                     : algorithm::pooling_avg_exclude_padding;
    const memory::dims strides{s.sh, s.sw}, kernel{s.kh, s.kw}, dil{s.dh - 1, s.dw - 1}, pad_l{s.ph, s.pw},
        pad_r{far_padding(s.h, s.oh, s.kh, s.sh, s.ph, s.dh), far_padding(s.w, s.ow, s.kw, s.sw, s.pw, s.dw)};
    ::dnnl::pooling_v2_forward::desc d(::dnnl::prop_kind::forward_inference, alg, m.src_md, m.dst_md, strides,
                                       kernel, dil, pad_l, pad_r);
    m.pd = ::dnnl::pooling_v2_forward::primitive_desc(d, engine());
    m.prim = ::dnnl::pooling_v2_forward(m.pd);
  } catch (const ::dnnl::error& e) {
    throw Error(util::cat("oneDNN has no pooling for input [", s.n, ", ", s.h, ", ", s.w, ", ", s.c,
                          "] (NHWC), window ", s.kh, "x", s.kw, ": ", e.what()));
  }
}

Pool::~Pool() = default;

void Pool::run(const float* src, float* dst) {
  Impl& m = *impl_;
  memory src_m(m.src_md, engine(), const_cast<float*>(src));
  memory dst_m(m.dst_md, engine(), dst);
  m.prim.execute(stream(), {{DNNL_ARG_SRC, src_m}, {DNNL_ARG_DST, dst_m}});
  stream().wait();
}

std::string Pool::impl() const { return impl_->pd.impl_info_str(); }

#else  // no oneDNN in this build

bool available() { return false; }
const std::string& unavailable_reason() {
  static const std::string why = "kernelgraph was built without oneDNN (libdnnl-dev)";
  return why;
}

struct Conv::Impl {};
Conv::Conv(const ConvShape&) { throw Error(unavailable_reason()); }
Conv::~Conv() = default;
void Conv::set_weights(const float*, const float*, const float*) { throw Error(unavailable_reason()); }
void Conv::run(const float*, const float*, float*) { throw Error(unavailable_reason()); }
std::string Conv::impl() const { return ""; }

struct Pool::Impl {};
Pool::Pool(const PoolShape&) { throw Error(unavailable_reason()); }
Pool::~Pool() = default;
void Pool::run(const float*, float*) { throw Error(unavailable_reason()); }
std::string Pool::impl() const { return ""; }

#endif

}  // namespace kg::ops::dnnl
