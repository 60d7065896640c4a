// nn.conv_transpose2d on the CPU, and its lowering to conv_transpose.cu.
//
// Output pixel (oy, ox) of channel o = g * og + m (group g) is
//   bias[o] + sum over the group's input channels c, taps (ky, kx) and input pixels (iy, ix)
//   with oy = iy * sh - pad_top + ky * dh and ox = ix * sw - pad_left + kx * dw
//   of x[c, iy, ix] * w[c, m, ky, kx].
// Two CPU algorithms, both splitting the work over the runtime's threads:
//
// - Gemm (the usual case): per group, a block of input pixels (whole images, or rows of one
//   image) becomes the column matrix col[(m, ky, kx), pixel] = W_gᵀ · X_g, one BLAS GEMM
//   (threaded by the library) with depth Cin/groups; then col2im adds every column entry into the
//   output pixel it maps to, in parallel over (image, output channel) planes, which no two
//   workers share.
// - Direct (few channels per group, e.g. depthwise, where a GEMM of depth 1 or 2 would be mostly
//   overhead): a scatter loop per output plane over its group's input channels and taps, in
//   parallel over the planes.
//
// Both start every plane at the bias and accumulate in the tensor's dtype, as PyTorch does.
// On the GPU (conv_transpose.cu) a thread per output element gathers the input pixels that map
// to it.
#include "ops/conv_transpose.hpp"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "kg/runtime_op.hpp"
#include "ops/blas.hpp"
#include "ops/gpu_util.hpp"
#include "ops/op_util.hpp"

namespace kg::ops {
namespace {

constexpr unsigned kConvTransposeThreads = 256;  // conv_transpose.cu's __launch_bounds__

// The concrete geometry of one run.
struct Geom {
  std::int64_t n = 0, c = 0, h = 0, w = 0;  // input
  std::int64_t o = 0, ho = 0, wo = 0;       // output channels and size
  std::int64_t kh = 0, kw = 0, sh = 1, sw = 1, pt = 0, pl = 0, dh = 1, dw = 1, groups = 1;

  std::int64_t cg() const { return c / groups; }
  std::int64_t og() const { return o / groups; }
  std::int64_t taps() const { return kh * kw; }
};

// "3" or "3x2".
std::string pair_text(std::int64_t a, std::int64_t b) { return a == b ? util::cat(a) : util::cat(a, "x", b); }

// Output columns ix * sw + ox0 inside [0, wo) for ix in [0, w): ix in [lo, hi) (hi <= lo: none).
void column_range(std::int64_t ox0, std::int64_t sw, std::int64_t w, std::int64_t wo, std::int64_t& lo,
                  std::int64_t& hi) {
  lo = ox0 >= 0 ? 0 : (-ox0 + sw - 1) / sw;
  hi = wo - 1 - ox0 < 0 ? 0 : std::min(w, (wo - 1 - ox0) / sw + 1);
}

// Output planes per parallel chunk so that a chunk does about 64K multiply-adds.
std::int64_t plane_grain(std::int64_t work_per_plane) {
  return std::max<std::int64_t>(1, 65536 / std::max<std::int64_t>(work_per_plane, 1));
}

// Every output plane at its channel's bias (or 0).
template <class T>
void fill_bias(const Geom& g, const T* bias, T* y, const CpuContext& ctx) {
  const std::int64_t p = g.ho * g.wo;
  ctx.parallel_for(g.n * g.o, plane_grain(p), [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t pl = b; pl < e; ++pl)
      std::fill(y + pl * p, y + (pl + 1) * p, bias ? bias[pl % g.o] : T(0));
  });
}

// Adds x_row[ix] * wv into out_row[ix * sw + ox0] for the input columns that land in the row.
template <class T>
inline void scatter_row(const T* x_row, T wv, T* out_row, std::int64_t ox0, const Geom& g) {
  std::int64_t lo, hi;
  column_range(ox0, g.sw, g.w, g.wo, lo, hi);
  if (g.sw == 1) {
    T* o = out_row + ox0;
    for (std::int64_t ix = lo; ix < hi; ++ix) o[ix] += x_row[ix] * wv;
  } else {
    for (std::int64_t ix = lo; ix < hi; ++ix) out_row[ix * g.sw + ox0] += x_row[ix] * wv;
  }
}

// ---- Direct: a scatter loop per output plane ----

template <class T>
void conv_transpose_direct(const Geom& g, const T* x, const T* w, T* y, const CpuContext& ctx) {
  const std::int64_t cg = g.cg(), og = g.og(), hw = g.h * g.w, p = g.ho * g.wo;
  ctx.parallel_for(g.n * g.o, plane_grain(cg * hw * g.taps()), [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t pl = b; pl < e; ++pl) {
      const std::int64_t img = pl / g.o, o = pl % g.o, grp = o / og, m = o % og;
      T* out = y + pl * p;
      for (std::int64_t ic = 0; ic < cg; ++ic) {
        const std::int64_t c = grp * cg + ic;
        const T* xc = x + (img * g.c + c) * hw;
        const T* wc = w + (c * og + m) * g.taps();
        for (std::int64_t iy = 0; iy < g.h; ++iy)
          for (std::int64_t ky = 0; ky < g.kh; ++ky) {
            const std::int64_t oy = iy * g.sh - g.pt + ky * g.dh;
            if (oy < 0 || oy >= g.ho) continue;
            for (std::int64_t kx = 0; kx < g.kw; ++kx)
              scatter_row(xc + iy * g.w, wc[ky * g.kw + kx], out + oy * g.wo, kx * g.dw - g.pl, g);
          }
      }
    }
  });
}

// ---- Gemm: column blocks and col2im ----

// Elements of the column buffer of one block (about 8 MiB).
template <class T>
constexpr std::int64_t col_budget() {
  return static_cast<std::int64_t>((8u << 20) / sizeof(T));
}

template <class T>
void conv_transpose_gemm(const Geom& g, const T* x, const T* w, T* y, const CpuContext& ctx) {
  const std::int64_t cg = g.cg(), og = g.og(), hw = g.h * g.w, p = g.ho * g.wo;
  const std::int64_t rows_m = og * g.taps();  // col rows: (m, ky, kx), the weight's own order
  if (hw == 0 || rows_m == 0) return;
  // A block is `imgs` whole images, or `band` input rows of one image.
  const std::int64_t per_image = rows_m * hw;
  const std::int64_t imgs =
      per_image <= col_budget<T>() ? std::max<std::int64_t>(1, col_budget<T>() / per_image) : 0;
  const std::int64_t band = imgs > 0 ? g.h : std::max<std::int64_t>(1, col_budget<T>() / (rows_m * g.w));
  std::vector<T> col, gathered;
  for (std::int64_t grp = 0; grp < g.groups; ++grp) {
    const T* wg = w + grp * cg * rows_m;  // [cg, rows_m]
    for (std::int64_t img0 = 0; img0 < g.n; img0 += std::max<std::int64_t>(imgs, 1)) {
      const std::int64_t nimg = imgs > 0 ? std::min(imgs, g.n - img0) : 1;
      for (std::int64_t row0 = 0; row0 < g.h; row0 += band) {
        const std::int64_t nrows = std::min(band, g.h - row0);
        const std::int64_t cols = nimg * nrows * g.w;  // the block's input pixels
        // B = the block's input as [cg, cols]: in place within one image, else gathered.
        const T* bmat = x + (img0 * g.c + grp * cg) * hw + row0 * g.w;
        std::int64_t ldb = hw;
        if (nimg > 1) {
          gathered.resize(static_cast<std::size_t>(cg * cols));
          ctx.parallel_for(cg * nimg, plane_grain(hw), [&](std::int64_t b, std::int64_t e) {
            for (std::int64_t k = b; k < e; ++k) {
              const std::int64_t ic = k / nimg, i = k % nimg;
              const T* src = x + ((img0 + i) * g.c + grp * cg + ic) * hw;
              std::copy(src, src + hw, gathered.data() + ic * cols + i * hw);
            }
          });
          bmat = gathered.data();
          ldb = cols;
        }
        col.resize(static_cast<std::size_t>(rows_m * cols));
        gemm(true, false, rows_m, cols, cg, T(1), wg, rows_m, bmat, ldb, T(0), col.data(), cols);
        // col2im: plane (image i, channel m) takes rows (m, ky, kx) of the block's columns of image i.
        ctx.parallel_for(nimg * og, plane_grain(g.taps() * nrows * g.w), [&](std::int64_t b, std::int64_t e) {
          for (std::int64_t u = b; u < e; ++u) {
            const std::int64_t i = u / og, m = u % og;
            T* out = y + ((img0 + i) * g.o + grp * og + m) * p;
            for (std::int64_t ky = 0; ky < g.kh; ++ky)
              for (std::int64_t kx = 0; kx < g.kw; ++kx) {
                const T* crow = col.data() + ((m * g.kh + ky) * g.kw + kx) * cols + i * nrows * g.w;
                for (std::int64_t r = 0; r < nrows; ++r) {
                  const std::int64_t oy = (row0 + r) * g.sh - g.pt + ky * g.dh;
                  if (oy < 0 || oy >= g.ho) continue;
                  scatter_row(crow + r * g.w, T(1), out + oy * g.wo, kx * g.dw - g.pl, g);
                }
              }
          }
        });
      }
    }
  }
}

// ---- the GPU half ----

// One launch of conv_transpose.cu's entry for the dtype: a thread per output element in a
// grid-stride loop.
class ConvTransposeRuntime final : public RuntimeOp {
 public:
  ConvTransposeRuntime(std::int64_t kh, std::int64_t kw, const ConvTranspose2dOptions& o)
      : kh_(kh), kw_(kw), o_(o) {}
  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    const auto& in = t.inputs.at(0).shape;
    const auto& out = t.output.shape;
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.params.at(0).ptr);
    v.pointer(o_.bias ? t.params.at(1).ptr : 0);
    v.pointer(t.output.ptr);
    for (std::int64_t s : {in[0], in[1], in[2], in[3], out[1], out[2], out[3], kh_, kw_, o_.stride_h,
                           o_.stride_w, o_.pad_top, o_.pad_left, o_.dilation_h, o_.dilation_w, o_.groups})
      v.i64(s);
  }
  Dim3 block() const override { return {kConvTransposeThreads, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>& shape) const override {
    return grid_1d(numel_of(shape), kConvTransposeThreads);
  }

 private:
  std::int64_t kh_, kw_;
  ConvTranspose2dOptions o_;
};

// ---- nn.conv_transpose2d ----

class ConvTranspose2dOp final : public CustomOp {
 public:
  ConvTranspose2dOp(std::int64_t out_channels, std::int64_t kh, std::int64_t kw,
                    const ConvTranspose2dOptions& o, DType dtype)
      : out_(out_channels), kh_(kh), kw_(kw), o_(o), dtype_(dtype) {}

  std::string name() const override { return "nn.conv_transpose2d"; }
  // "out=16 k=3 s=2 pads=1,1,1,1", with "output_padding=", "d=", "groups=" and "bias=false"
  // when not the default. Pads are ONNX's order: top, left, bottom, right.
  std::string attributes() const override {
    std::string s =
        util::cat("out=", out_, " k=", pair_text(kh_, kw_), " s=", pair_text(o_.stride_h, o_.stride_w),
                  " pads=", o_.pad_top, ",", o_.pad_left, ",", o_.pad_bottom, ",", o_.pad_right);
    if (o_.output_padding_h != 0 || o_.output_padding_w != 0)
      s += " output_padding=" + pair_text(o_.output_padding_h, o_.output_padding_w);
    if (o_.dilation_h != 1 || o_.dilation_w != 1) s += " d=" + pair_text(o_.dilation_h, o_.dilation_w);
    if (o_.groups != 1) s += util::cat(" groups=", o_.groups);
    if (!o_.bias) s += " bias=false";
    return s;
  }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    checked_channels(in[0]);
    const Shape& x = in[0];
    return Shape{x[0], Dim(out_),
                 out_dim(x[2], kh_, o_.stride_h, o_.pad_top, o_.pad_bottom, o_.output_padding_h,
                         o_.dilation_h, "height"),
                 out_dim(x[3], kw_, o_.stride_w, o_.pad_left, o_.pad_right, o_.output_padding_w,
                         o_.dilation_w, "width")};
  }

  DType infer_output_dtype(const std::vector<DType>& in) const override {
    const DType t = require_float(in);
    if (t != dtype_)
      throw Error(util::cat("input is ", dtype_name(t), " but the parameters are ", dtype_name(dtype_)));
    return t;
  }

  std::vector<ParamSpec> parameters(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    const std::int64_t c = checked_channels(in[0]);
    // PyTorch: kaiming_uniform(a=sqrt(5)) on the [Cin, Cout/groups, kh, kw] weight, whose fan-in
    // is weight.size(1) * kh * kw, gives U(-1/sqrt(fan_in), 1/sqrt(fan_in)); the bias the same.
    const std::int64_t og = out_ / o_.groups;
    const std::int64_t fan_in = og * kh_ * kw_;
    const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    std::vector<ParamSpec> p{{"weight", {c, og, kh_, kw_}, dtype_, ParamInit::uniform(-bound, bound), true}};
    if (o_.bias) p.push_back({"bias", {out_}, dtype_, ParamInit::uniform(-bound, bound), true});
    return p;
  }

  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    return Lowered{name(), kernel_file("conv_transpose.cu"),
                   entry_for("kg_conv_transpose2d", ctx.output_dtype),
                   std::make_shared<ConvTransposeRuntime>(kh_, kw_, o_)};
  }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    Geom g;
    g.n = x.dim(0), g.c = x.dim(1), g.h = x.dim(2), g.w = x.dim(3);
    g.o = ctx.output.dim(1), g.ho = ctx.output.dim(2), g.wo = ctx.output.dim(3);
    g.kh = kh_, g.kw = kw_, g.sh = o_.stride_h, g.sw = o_.stride_w, g.pt = o_.pad_top, g.pl = o_.pad_left;
    g.dh = o_.dilation_h, g.dw = o_.dilation_w, g.groups = o_.groups;
    dispatch_float(x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      T* y = ctx.output.data<T>();
      fill_bias<T>(g, o_.bias ? ctx.params[1].data<T>() : nullptr, y, ctx);
      if (g.n == 0 || g.cg() == 0) return;
      if (g.cg() * g.og() <= 16)
        conv_transpose_direct<T>(g, x.data<T>(), ctx.params[0].data<T>(), y, ctx);
      else
        conv_transpose_gemm<T>(g, x.data<T>(), ctx.params[0].data<T>(), y, ctx);
    });
  }

 private:
  // Checks the configuration and the input; returns the input's channel count.
  std::int64_t checked_channels(const Shape& x) const {
    if (out_ <= 0) throw Error(util::cat("out_channels must be positive, got ", out_));
    if (kh_ <= 0 || kw_ <= 0) throw Error(util::cat("kernel size must be positive, got ", kh_, "x", kw_));
    if (o_.stride_h <= 0 || o_.stride_w <= 0)
      throw Error(util::cat("stride must be positive, got ", o_.stride_h, "x", o_.stride_w));
    if (o_.dilation_h <= 0 || o_.dilation_w <= 0)
      throw Error(util::cat("dilation must be positive, got ", o_.dilation_h, "x", o_.dilation_w));
    if (o_.pad_top < 0 || o_.pad_left < 0 || o_.pad_bottom < 0 || o_.pad_right < 0)
      throw Error(util::cat("pads must be non-negative, got top ", o_.pad_top, ", left ", o_.pad_left,
                            ", bottom ", o_.pad_bottom, ", right ", o_.pad_right));
    if (o_.output_padding_h < 0 || o_.output_padding_w < 0)
      throw Error(util::cat("output_padding must be non-negative, got ", o_.output_padding_h, "x",
                            o_.output_padding_w));
    // PyTorch's rule: each output padding is smaller than the stride or the dilation.
    if ((o_.output_padding_h >= o_.stride_h && o_.output_padding_h >= o_.dilation_h) ||
        (o_.output_padding_w >= o_.stride_w && o_.output_padding_w >= o_.dilation_w))
      throw Error(util::cat("output_padding ", o_.output_padding_h, "x", o_.output_padding_w,
                            " must be smaller than the stride ", o_.stride_h, "x", o_.stride_w,
                            " or the dilation ", o_.dilation_h, "x", o_.dilation_w));
    if (o_.groups <= 0) throw Error(util::cat("groups must be positive, got ", o_.groups));
    require_rank(x, 4, "[N, C, H, W]");
    if (x[1].is_dynamic())
      throw Error(util::cat("needs a known channel count (dim 1) to size its weight, got ", x.to_string()));
    const std::int64_t c = x[1].size();
    if (c % o_.groups != 0)
      throw Error(util::cat("in_channels ", c, " is not divisible by groups ", o_.groups));
    if (out_ % o_.groups != 0)
      throw Error(util::cat("out_channels ", out_, " is not divisible by groups ", o_.groups));
    return c;
  }

  // stride * (in - 1) + output_padding + dilation * (k - 1) + 1 - pad_begin - pad_end; dynamic
  // when the input's dim is.
  static Dim out_dim(const Dim& in, std::int64_t k, std::int64_t stride, std::int64_t pad0, std::int64_t pad1,
                     std::int64_t out_pad, std::int64_t dilation, const char* what) {
    if (in.is_dynamic()) return Dim(dynamic);
    const std::int64_t out = stride * (in.size() - 1) + out_pad + dilation * (k - 1) + 1 - pad0 - pad1;
    if (out <= 0)
      throw Error(util::cat("output ", what, " ", stride, "*(", in.size(), "-1) + ", out_pad, " + ", dilation,
                            "*(", k, "-1) + 1 - ", pad0, " - ", pad1, " = ", out, " is not positive (input ",
                            what, " ", in.size(), ", stride ", stride, ", output_padding ", out_pad,
                            ", dilation ", dilation, ", kernel ", k, ", pads ", pad0, " and ", pad1, ")"));
    return Dim(out);
  }

  std::int64_t out_, kh_, kw_;
  ConvTranspose2dOptions o_;
  DType dtype_;  // of the parameters: the input's
};

}  // namespace

CustomData conv_transpose2d_op(std::int64_t out_channels, std::int64_t kh, std::int64_t kw,
                               const ConvTranspose2dOptions& o, DType dtype) {
  return CustomData::make<ConvTranspose2dOp>(out_channels, kh, kw, o, dtype);
}

SymTensor conv_transpose2d(const SymTensor& x, std::int64_t out_channels, std::int64_t kh, std::int64_t kw,
                           const ConvTranspose2dOptions& o, const std::string& name) {
  return x.record_custom(conv_transpose2d_op(out_channels, kh, kw, o, x.dtype()), {}, std::nullopt, name);
}

}  // namespace kg::ops
