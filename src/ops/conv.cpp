// nn.conv2d and nn.fused_conv2d on the CPU: the output is computed in tiles of output pixels.
// Each tile gathers its input patches (im2col, skipped for 1x1 stride-1 convolutions, whose
// input already is the GEMM operand), multiplies them by the weight with the BLAS GEMM and
// applies the epilogue (bias, folded BatchNorm, residual, activation) while the tile is in
// cache. Tiles of different images run on different threads with a single-threaded GEMM; a
// convolution that makes one tile only lets the BLAS library thread the GEMM instead.
#include "ops/conv.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>

#include "ops/blas.hpp"
#include "ops/op_util.hpp"

namespace kg::ops {
namespace {

// ---- geometry ----

struct ConvGeom {
  std::int64_t n = 0, c = 0, h = 0, w = 0;  // input
  std::int64_t o = 0, kh = 0, kw = 0;       // output channels, kernel
  std::int64_t sh = 1, sw = 1, ph = 0, pw = 0, dh = 1, dw = 1, groups = 1;
  std::int64_t ho = 0, wo = 0;  // output

  std::int64_t cg() const { return c / groups; }
  std::int64_t og() const { return o / groups; }
  std::int64_t kdim() const { return cg() * kh * kw; }  // GEMM depth per group
  std::int64_t pixels() const { return ho * wo; }
  // The input of a 1x1 stride-1 unpadded convolution is already the [C, H*W] GEMM operand.
  bool pointwise() const { return kh == 1 && kw == 1 && sh == 1 && sw == 1 && ph == 0 && pw == 0; }
  // Few output channels per group (depthwise): a direct loop beats a GEMM with M <= 4.
  bool direct() const { return groups > 1 && og() <= 4; }
};

// Per-channel affine, residual and activation applied after the convolution.
template <class T> struct Epilogue {
  const T* scale = nullptr;     // [O]; null: 1
  const T* shift = nullptr;     // [O]; null: 0
  const T* residual = nullptr;  // laid out like the output; null: none
  std::optional<UnarySpec> act;
};

// Rows [o0, o0 + rows) of one image's output tile: `y` points at row o0, column p0; rows are
// `ld` apart. `res` is the residual at the same position (or null).
template <class T>
void apply_epilogue(const Epilogue<T>& ep, std::int64_t o0, std::int64_t rows, std::int64_t cols, T* y,
                    const T* res, std::int64_t ld) {
  const bool relu = ep.act && ep.act->fn == UnaryFn::Relu;
  const bool other_act = ep.act && !relu;
  for (std::int64_t r = 0; r < rows; ++r) {
    T* row = y + r * ld;
    const T s = ep.scale ? ep.scale[o0 + r] : T(1);
    const T t = ep.shift ? ep.shift[o0 + r] : T(0);
    const T* rr = res ? res + r * ld : nullptr;
    if (rr && relu) {
      for (std::int64_t j = 0; j < cols; ++j) {
        const T v = row[j] * s + t + rr[j];
        row[j] = v < T(0) ? T(0) : v;
      }
    } else if (rr) {
      for (std::int64_t j = 0; j < cols; ++j) row[j] = row[j] * s + t + rr[j];
    } else if (relu) {
      for (std::int64_t j = 0; j < cols; ++j) {
        const T v = row[j] * s + t;
        row[j] = v < T(0) ? T(0) : v;
      }
    } else if (ep.scale || ep.shift) {
      for (std::int64_t j = 0; j < cols; ++j) row[j] = row[j] * s + t;
    }
    if (other_act) apply_unary<T>(*ep.act, row, row, cols);
  }
}

// ---- im2col of a tile ----

// col[k][j] for k = (c * kh + ky) * kw + kx over the group's channels and j over `cnt` output
// pixels starting at p0: the input value under kernel tap (ky, kx) for that pixel, 0 in the
// padding. `x` points at the group's first input channel.
template <class T>
void im2col_tile(const ConvGeom& g, const T* x, std::int64_t p0, std::int64_t cnt, T* col) {
  const std::int64_t cg = g.cg();
  for (std::int64_t c = 0; c < cg; ++c) {
    const T* plane = x + c * g.h * g.w;
    for (std::int64_t ky = 0; ky < g.kh; ++ky) {
      for (std::int64_t kx = 0; kx < g.kw; ++kx) {
        T* dst = col + ((c * g.kh + ky) * g.kw + kx) * cnt;
        std::int64_t j = 0, oy = p0 / g.wo, ox = p0 % g.wo;
        while (j < cnt) {
          const std::int64_t seg = std::min(g.wo - ox, cnt - j);
          const std::int64_t iy = oy * g.sh - g.ph + ky * g.dh;
          T* d = dst + j;
          if (iy < 0 || iy >= g.h) {
            std::fill(d, d + seg, T(0));
          } else {
            const T* row = plane + iy * g.w;
            // Output columns s in [lo, hi) read inside the row: 0 <= ix0 + s * sw < w.
            const std::int64_t ix0 = ox * g.sw - g.pw + kx * g.dw;
            std::int64_t lo = ix0 >= 0 ? 0 : (-ix0 + g.sw - 1) / g.sw;
            std::int64_t hi = ix0 >= g.w ? 0 : (g.w - ix0 + g.sw - 1) / g.sw;
            lo = std::min(lo, seg);
            hi = std::clamp(hi, lo, seg);
            std::fill(d, d + lo, T(0));
            if (g.sw == 1) {
              std::memcpy(d + lo, row + ix0 + lo, static_cast<std::size_t>(hi - lo) * sizeof(T));
            } else {
              const T* src = row + ix0;
              for (std::int64_t s = lo; s < hi; ++s) d[s] = src[s * g.sw];
            }
            std::fill(d + hi, d + seg, T(0));
          }
          j += seg;
          ++oy;
          ox = 0;
        }
      }
    }
  }
}

// ---- threading of the BLAS library ----

// OpenBLAS threads each GEMM itself; while tiles run on the runtime's threads, every GEMM must
// run on its calling thread, so the library is set to one thread for the duration.
class BlasSingleThreaded {
 public:
  BlasSingleThreaded() {
    std::lock_guard<std::mutex> lk(mu());
    if (depth()++ == 0) {
      saved() = openblas_get_num_threads();
      if (saved() != 1) openblas_set_num_threads(1);
    }
  }
  ~BlasSingleThreaded() {
    std::lock_guard<std::mutex> lk(mu());
    if (--depth() == 0 && saved() != 1) openblas_set_num_threads(saved());
  }
  BlasSingleThreaded(const BlasSingleThreaded&) = delete;
  BlasSingleThreaded& operator=(const BlasSingleThreaded&) = delete;

 private:
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static int& depth() {
    static int d = 0;
    return d;
  }
  static int& saved() {
    static int s = 1;
    return s;
  }
};

// ---- the convolution ----

// Output pixels per tile: the tile's im2col buffer stays within about half the L2 cache.
std::int64_t tile_pixels(const ConvGeom& g, std::size_t elem) {
  const std::int64_t p = g.pixels();
  if (g.pointwise()) return std::min<std::int64_t>(p, 512);
  const auto budget = static_cast<std::int64_t>((384 * 1024) / elem);
  std::int64_t nt = budget / std::max<std::int64_t>(g.kdim(), 1);
  nt = std::max<std::int64_t>(nt / 16 * 16, 64);
  if (nt >= p) return p;
  // Even tiles: the same count with the remainder spread out.
  const std::int64_t tiles = (p + nt - 1) / nt;
  return (p + tiles - 1) / tiles;
}

template <class T> std::vector<T>& scratch() {
  thread_local std::vector<T> buf;
  return buf;
}

// Depthwise-like convolution (one output channel per group): a direct loop per output plane.
template <class T>
void conv_direct(const ConvGeom& g, const T* x, const T* w, const Epilogue<T>& ep, T* y, const CpuContext& ctx) {
  const std::int64_t og = g.og(), cg = g.cg(), planes = g.n * g.o, p = g.pixels();
  ctx.parallel_for(planes, std::max<std::int64_t>(1, 4096 / std::max<std::int64_t>(p * cg * g.kh * g.kw, 1)),
                   [&](std::int64_t b, std::int64_t e) {
                     std::vector<double> acc(static_cast<std::size_t>(g.wo));
                     for (std::int64_t pl = b; pl < e; ++pl) {
                       const std::int64_t img = pl / g.o, oc = pl % g.o, grp = oc / og;
                       const T* xin = x + (img * g.c + grp * cg) * g.h * g.w;
                       const T* wk = w + oc * cg * g.kh * g.kw;
                       T* out = y + pl * p;
                       for (std::int64_t oy = 0; oy < g.ho; ++oy) {
                         std::fill(acc.begin(), acc.end(), 0.0);
                         for (std::int64_t c = 0; c < cg; ++c)
                           for (std::int64_t ky = 0; ky < g.kh; ++ky) {
                             const std::int64_t iy = oy * g.sh - g.ph + ky * g.dh;
                             if (iy < 0 || iy >= g.h) continue;
                             const T* row = xin + (c * g.h + iy) * g.w;
                             for (std::int64_t kx = 0; kx < g.kw; ++kx) {
                               const double wv = wk[(c * g.kh + ky) * g.kw + kx];
                               const std::int64_t ix0 = -g.pw + kx * g.dw;
                               for (std::int64_t ox = 0; ox < g.wo; ++ox) {
                                 const std::int64_t ix = ox * g.sw + ix0;
                                 if (ix >= 0 && ix < g.w) acc[static_cast<std::size_t>(ox)] += wv * row[ix];
                               }
                             }
                           }
                         for (std::int64_t ox = 0; ox < g.wo; ++ox)
                           out[oy * g.wo + ox] = static_cast<T>(acc[static_cast<std::size_t>(ox)]);
                       }
                       apply_epilogue(ep, oc, 1, p, out, ep.residual ? ep.residual + pl * p : nullptr, p);
                     }
                   });
}

template <class T>
void conv2d_forward(const ConvGeom& g, const T* x, const T* w, const Epilogue<T>& ep, T* y, const CpuContext& ctx) {
  if (g.n == 0 || g.o == 0 || g.pixels() == 0) return;
  if (g.direct()) return conv_direct(g, x, w, ep, y, ctx);
  const std::int64_t m = g.og(), k = g.kdim(), p = g.pixels();
  const std::int64_t nt = tile_pixels(g, sizeof(T));
  const std::int64_t tiles = (p + nt - 1) / nt;
  const std::int64_t items = g.n * g.groups * tiles;
  auto run = [&](std::int64_t b, std::int64_t e) {
    std::vector<T>& col = scratch<T>();
    for (std::int64_t it = b; it < e; ++it) {
      const std::int64_t img = it / (g.groups * tiles), grp = it / tiles % g.groups, t = it % tiles;
      const std::int64_t p0 = t * nt, cnt = std::min(nt, p - p0);
      const T* xin = x + (img * g.c + grp * g.cg()) * g.h * g.w;
      const std::int64_t out_off = (img * g.o + grp * m) * p + p0;
      const T* bmat = xin + p0;
      std::int64_t ldb = p;
      if (!g.pointwise()) {
        if (col.size() < static_cast<std::size_t>(k * cnt)) col.resize(static_cast<std::size_t>(k * cnt));
        im2col_tile(g, xin, p0, cnt, col.data());
        bmat = col.data();
        ldb = cnt;
      }
      gemm(false, false, m, cnt, k, T(1), w + grp * m * k, k, bmat, ldb, T(0), y + out_off, p);
      apply_epilogue(ep, grp * m, m, cnt, y + out_off, ep.residual ? ep.residual + out_off : nullptr, p);
    }
  };
  if (items == 1) {
    run(0, 1);  // one GEMM: the BLAS library threads it
    return;
  }
  BlasSingleThreaded single;
  ctx.parallel_for(items, 1, run);
}

ConvGeom geometry(const Conv2dOp& op, const std::vector<std::int64_t>& in, const std::vector<std::int64_t>& out) {
  ConvGeom g;
  g.n = in[0];
  g.c = in[1];
  g.h = in[2];
  g.w = in[3];
  g.o = op.out_channels();
  g.kh = op.kernel().h;
  g.kw = op.kernel().w;
  const auto& o = op.options();
  g.sh = o.stride.h;
  g.sw = o.stride.w;
  g.ph = o.padding.h;
  g.pw = o.padding.w;
  g.dh = o.dilation.h;
  g.dw = o.dilation.w;
  g.groups = o.groups;
  g.ho = out[2];
  g.wo = out[3];
  return g;
}

std::string size2_text(Size2 s) { return s.h == s.w ? util::cat(s.h) : util::cat(s.h, "x", s.w); }

}  // namespace

// ---- nn.conv2d ----

Conv2dOp::Conv2dOp(std::int64_t in_channels, std::int64_t out_channels, Size2 kernel,
                   const nn::Conv2dOptions& options, DType dtype)
    : in_(in_channels), out_(out_channels), kernel_(kernel), opt_(options), dtype_(dtype) {}

std::string Conv2dOp::attributes() const {
  std::string s = util::cat("in=", in_, " out=", out_, " k=", size2_text(kernel_), " s=", size2_text(opt_.stride),
                            " p=", size2_text(opt_.padding));
  if (opt_.dilation.h != 1 || opt_.dilation.w != 1) s += " d=" + size2_text(opt_.dilation);
  if (opt_.groups != 1) s += util::cat(" groups=", opt_.groups);
  if (!opt_.bias) s += " bias=false";
  return s;
}

Shape Conv2dOp::infer_output_shape(const std::vector<Shape>& in) const {
  require_inputs(in, 1);
  if (out_ <= 0) throw Error(util::cat("out_channels must be positive, got ", out_));
  if (kernel_.h <= 0 || kernel_.w <= 0)
    throw Error(util::cat("kernel size must be positive, got ", kernel_.h, "x", kernel_.w));
  if (opt_.stride.h <= 0 || opt_.stride.w <= 0)
    throw Error(util::cat("stride must be positive, got ", opt_.stride.h, "x", opt_.stride.w));
  if (opt_.dilation.h <= 0 || opt_.dilation.w <= 0)
    throw Error(util::cat("dilation must be positive, got ", opt_.dilation.h, "x", opt_.dilation.w));
  if (opt_.padding.h < 0 || opt_.padding.w < 0)
    throw Error(util::cat("padding must be non-negative, got ", opt_.padding.h, "x", opt_.padding.w));
  if (opt_.groups <= 0) throw Error(util::cat("groups must be positive, got ", opt_.groups));
  const Shape& x = in[0];
  require_rank(x, 4, "[N, C, H, W]");
  if (x[1].is_dynamic())
    throw Error(util::cat("needs a known channel count (dim 1) to size its weight, got ", x.to_string()));
  if (in_ >= 0 && x[1].size() != in_)
    throw Error(util::cat("expects ", in_, " input channels, got ", x.to_string()));
  const std::int64_t c = x[1].size();
  if (c % opt_.groups != 0)
    throw Error(util::cat("in_channels ", c, " is not divisible by groups ", opt_.groups));
  if (out_ % opt_.groups != 0)
    throw Error(util::cat("out_channels ", out_, " is not divisible by groups ", opt_.groups));
  Shape out{x[0], Dim(out_),
            window_out(x[2], kernel_.h, opt_.stride.h, opt_.padding.h, opt_.dilation.h, false, "input height"),
            window_out(x[3], kernel_.w, opt_.stride.w, opt_.padding.w, opt_.dilation.w, false, "input width")};
  return out;
}

DType Conv2dOp::infer_output_dtype(const std::vector<DType>& in) const {
  DType t = require_float(in);
  if (t != dtype_) throw Error(util::cat("input is ", dtype_name(t), " but the parameters are ", dtype_name(dtype_)));
  return t;
}

std::vector<ParamSpec> Conv2dOp::parameters() const {
  // PyTorch: kaiming_uniform(a=sqrt(5)) gives U(-1/sqrt(fan_in), 1/sqrt(fan_in)); the bias the same.
  const std::int64_t cg = in_ / opt_.groups;
  const std::int64_t fan_in = cg * kernel_.h * kernel_.w;
  const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
  std::vector<ParamSpec> p{
      {"weight", {out_, cg, kernel_.h, kernel_.w}, dtype_, ParamInit::uniform(-bound, bound), true}};
  if (opt_.bias) p.push_back({"bias", {out_}, dtype_, ParamInit::uniform(-bound, bound), true});
  return p;
}

void Conv2dOp::cpu_forward(CpuContext& ctx) const {
  const Tensor& x = ctx.inputs[0];
  const ConvGeom g = geometry(*this, x.shape(), ctx.output.shape());
  dispatch_float(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    Epilogue<T> ep;
    if (opt_.bias) ep.shift = ctx.params[1].data<T>();
    conv2d_forward<T>(g, x.data<T>(), ctx.params[0].data<T>(), ep, ctx.output.data<T>(), ctx);
  });
}

// ---- nn.fused_conv2d ----

FusedConv2dOp::FusedConv2dOp(Conv2dOp conv, ConvEpilogueSpec spec, std::vector<ParamSpec> params)
    : conv_(std::move(conv)), spec_(std::move(spec)), params_(std::move(params)) {}

std::string FusedConv2dOp::attributes() const {
  std::vector<std::string> parts;
  for (std::size_t i = 0; i < spec_.fused_nodes.size(); ++i) {
    std::string op = i < spec_.fused_ops.size() ? spec_.fused_ops[i] : "";
    parts.push_back(spec_.fused_nodes[i] + ":" + op);
  }
  std::string what;
  if (spec_.batch_norm) what += util::cat(" batch_norm(eps=", spec_.bn_eps, ")");
  if (spec_.residual) what += " add";
  if (spec_.activation) what += util::cat(" ", kUnaryOps[static_cast<std::size_t>(spec_.activation->fn)].op_name);
  return util::cat(conv_.attributes(), " epilogue=[", what.empty() ? "" : what.substr(1), "] fused=[",
                   util::join(parts, ", "), "]");
}

Shape FusedConv2dOp::infer_output_shape(const std::vector<Shape>& in) const {
  require_inputs(in, spec_.residual ? 2 : 1);
  Shape out = conv_.infer_output_shape({in[0]});
  if (spec_.residual && !(in[1] == out))
    throw Error(util::cat("the residual ", in[1].to_string(), " must have the convolution's output shape ",
                          out.to_string()));
  return out;
}

DType FusedConv2dOp::infer_output_dtype(const std::vector<DType>& in) const {
  DType t = require_float(in);
  return conv_.infer_output_dtype({t});
}

void FusedConv2dOp::cpu_forward(CpuContext& ctx) const {
  const Tensor& x = ctx.inputs[0];
  const ConvGeom g = geometry(conv_, x.shape(), ctx.output.shape());
  const bool has_bias = conv_.options().bias;
  const std::size_t bn_at = has_bias ? 2 : 1;
  const auto oc = static_cast<std::size_t>(g.o);
  dispatch_float(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* bias = has_bias ? ctx.params[1].data<T>() : nullptr;
    T* y = ctx.output.data<T>();
    Epilogue<T> ep;
    ep.residual = spec_.residual ? ctx.inputs[1].data<T>() : nullptr;
    ep.act = spec_.activation;
    std::vector<T> scale, shift;
    if (!spec_.batch_norm) {
      ep.shift = bias;
      conv2d_forward<T>(g, x.data<T>(), ctx.params[0].data<T>(), ep, y, ctx);
      return;
    }
    // Inference only: the lowering keeps batch norms unfused for training.
    if (ctx.training)
      throw Error("a batch norm fused for inference cannot run in train mode; lower the model for training");
    const T* gamma = ctx.params[bn_at].data<T>();
    const T* beta = ctx.params[bn_at + 1].data<T>();
    const T* mean = ctx.params[bn_at + 2].data<T>();
    const T* var = ctx.params[bn_at + 3].data<T>();
    // y = (conv + bias - mean) * s + beta with s = gamma / sqrt(var + eps), as one scale and shift.
    scale.resize(oc);
    shift.resize(oc);
    for (std::size_t c = 0; c < oc; ++c) {
      const double s = static_cast<double>(gamma[c]) / std::sqrt(static_cast<double>(var[c]) + spec_.bn_eps);
      const double b = bias ? static_cast<double>(bias[c]) : 0.0;
      scale[c] = static_cast<T>(s);
      shift[c] = static_cast<T>(static_cast<double>(beta[c]) + (b - static_cast<double>(mean[c])) * s);
    }
    ep.scale = scale.data();
    ep.shift = shift.data();
    conv2d_forward<T>(g, x.data<T>(), ctx.params[0].data<T>(), ep, y, ctx);
  });
}

}  // namespace kg::ops

namespace kg::nn {

SymTensor conv2d(const SymTensor& x, std::int64_t out_channels, Size2 kernel, const Conv2dOptions& options,
                 const std::string& name) {
  const Shape& s = x.shape();
  // An unusable input is reported by infer_output_shape, with the node's label.
  const std::int64_t in = s.rank() == 4 && s[1].is_static() ? s[1].size() : -1;
  return x.record_custom(CustomData::make<ops::Conv2dOp>(in, out_channels, kernel, options, x.dtype()), {},
                         std::nullopt, name);
}

}  // namespace kg::nn
