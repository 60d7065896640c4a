// nn.resize (ONNX Resize) on the CPU, and its lowering to resize.cu.
//
// The concrete resize is planned once per run from the input and output sizes (ResizeArgs, the
// kernel's argument too): per dim the input and output lengths, the scale of the coordinates,
// the real output length scale * in (align_corners divides by it, as the ONNX reference does)
// and half_pixel_symmetric's offset. The CPU then tabulates each dim's taps (input offsets and
// weights) per output index and walks the output row by row (all dims but the last fixed),
// forming the products of the fixed dims' taps once per row. The formulas and the order of the
// sums are the kernel's, so the emulated kernel matches the CPU bit for bit.
#include "ops/resize.hpp"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kg/runtime_op.hpp"
#include "ops/gpu_util.hpp"
#include "ops/op_util.hpp"

namespace kg::ops {
namespace {

constexpr unsigned kResizeThreads = 256;  // resize.cu's KG_RESIZE_THREADS
constexpr std::size_t kMaxDims = 8;       // resize.cu's KG_RESIZE_MAX_DIMS

// resize.cu's KgResizeArgs, member for member (every member is 8 bytes wide, so the layouts
// agree); the enum values are the kernel's.
struct ResizeArgs {
  std::int64_t rank, total, mode, rounding, coord, exclude_outside;
  double cubic_a;
  std::int64_t in[kMaxDims], out[kMaxDims], in_stride[kMaxDims], identity[kMaxDims];
  double scale[kMaxDims], span[kMaxDims], offset[kMaxDims];
};
static_assert(sizeof(ResizeArgs) == 7 * 8 + 7 * kMaxDims * 8,
              "ResizeArgs must match resize.cu's KgResizeArgs");

enum Coord : std::int64_t {
  kHalfPixel,
  kPytorchHalfPixel,
  kAlignCorners,
  kAsymmetric,
  kTfHalfPixelForNn,
  kHalfPixelSymmetric
};
constexpr const char* kCoordNames[] = {"half_pixel", "pytorch_half_pixel",   "align_corners",
                                       "asymmetric", "tf_half_pixel_for_nn", "half_pixel_symmetric"};
constexpr const char* kRoundingNames[] = {"round_prefer_floor", "round_prefer_ceil", "floor", "ceil"};
constexpr const char* kModeNames[] = {"nearest", "linear", "cubic"};

// The index of `s` among `names`, or -1.
template <std::size_t N>
std::int64_t find_name(const char* const (&names)[N], const std::string& s) {
  for (std::size_t i = 0; i < N; ++i)
    if (s == names[i]) return static_cast<std::int64_t>(i);
  return -1;
}

template <std::size_t N>
std::string name_list(const char* const (&names)[N]) {
  return util::join(std::vector<std::string>(std::begin(names), std::end(names)), ", ");
}

// ---- the per-dim arithmetic (resize.cu's, expression for expression) ----

double input_coord(const ResizeArgs& a, std::size_t d, std::int64_t o) {
  const double x = static_cast<double>(o), s = a.scale[d];
  switch (a.coord) {
    case kHalfPixel:
      return (x + 0.5) / s - 0.5;
    case kPytorchHalfPixel:
      return a.out[d] == 1 ? 0.0 : (x + 0.5) / s - 0.5;
    case kAlignCorners:
      return a.span[d] == 1.0 ? 0.0 : x * static_cast<double>(a.in[d] - 1) / (a.span[d] - 1.0);
    case kAsymmetric:
      return x / s;
    case kTfHalfPixelForNn:
      return (x + 0.5) / s;
    default:
      return a.offset[d] + (x + 0.5) / s - 0.5;
  }
}

// The taps of output index o along dim d: input indices clamped into the input, and weights.
int taps(const ResizeArgs& a, std::size_t d, std::int64_t o, std::int64_t* idx, double* wt) {
  const std::int64_t n = a.in[d];
  auto clamp = [n](std::int64_t i) { return i < 0 ? 0 : i >= n ? n - 1 : i; };
  const double xo = input_coord(a, d, o), f = std::floor(xo);
  if (a.mode == 0) {
    auto i = static_cast<std::int64_t>(f);
    if (xo != f) {
      const double r = xo - f;
      if (a.rounding == 0)
        i += r > 0.5 ? 1 : 0;
      else if (a.rounding == 1)
        i += r >= 0.5 ? 1 : 0;
      else if (a.rounding == 3)
        i += 1;
    }
    idx[0] = clamp(i);
    wt[0] = 1.0;
    return 1;
  }
  // The left neighbour and the distance r in (0, 1] from it (an integer coordinate is the right
  // end of the interval left of it, as in the ONNX reference).
  const std::int64_t left = xo == f ? static_cast<std::int64_t>(f) - 1 : static_cast<std::int64_t>(f);
  const double r = xo == f ? 1.0 : xo - f;
  int nt;
  std::int64_t first;
  if (a.mode == 1) {
    nt = 2;
    first = left;
    wt[0] = 1.0 - r;
    wt[1] = r;
  } else {
    nt = 4;
    first = left - 1;
    const double A = a.cubic_a, q = 1.0 - r;
    wt[0] = ((A * (r + 1.0) - 5.0 * A) * (r + 1.0) + 8.0 * A) * (r + 1.0) - 4.0 * A;
    wt[1] = ((A + 2.0) * r - (A + 3.0)) * r * r + 1.0;
    wt[2] = ((A + 2.0) * q - (A + 3.0)) * q * q + 1.0;
    wt[3] = ((A * (q + 1.0) - 5.0 * A) * (q + 1.0) + 8.0 * A) * (q + 1.0) - 4.0 * A;
  }
  if (a.exclude_outside) {
    double sum = 0.0;
    for (int k = 0; k < nt; ++k) {
      if (first + k < 0 || first + k >= n) wt[k] = 0.0;
      sum += wt[k];
    }
    if (sum != 0.0)
      for (int k = 0; k < nt; ++k) wt[k] = wt[k] / sum;
  }
  for (int k = 0; k < nt; ++k) idx[k] = clamp(first + k);
  return nt;
}

// The concrete resize of `spec` (already checked) for these input and output sizes.
ResizeArgs plan(const ResizeSpec& spec, const std::vector<std::int64_t>& in,
                const std::vector<std::int64_t>& out) {
  ResizeArgs a{};
  const std::size_t r = in.size();
  a.rank = static_cast<std::int64_t>(r);
  a.total = numel_of(out);
  a.mode = static_cast<std::int64_t>(spec.mode);
  a.rounding = find_name(kRoundingNames, spec.nearest_mode);
  a.coord = find_name(kCoordNames, spec.coordinate_transformation_mode);
  a.exclude_outside = spec.exclude_outside ? 1 : 0;
  a.cubic_a = spec.cubic_coeff_a;
  for (std::size_t d = 0; d < kMaxDims; ++d) {
    a.in[d] = a.out[d] = a.in_stride[d] = a.identity[d] = 1;
    a.scale[d] = a.span[d] = 1.0;
    a.offset[d] = 0.0;
  }
  std::int64_t stride = 1;
  for (std::size_t d = r; d-- > 0;) {
    a.in_stride[d] = stride;
    stride *= in[d];
  }
  for (std::size_t d = 0; d < r; ++d) {
    a.in[d] = in[d];
    a.out[d] = out[d];
    double s = 1.0;
    if (!spec.scales.empty())
      s = spec.scales[d];
    else if (spec.sizes[d] != -1 && in[d] > 0)
      s = static_cast<double>(out[d]) / static_cast<double>(in[d]);
    a.scale[d] = s;
    a.span[d] = s * static_cast<double>(in[d]);
    // The ONNX reference: adjustment = out / span, center = in / 2, offset = center * (1 - adjustment).
    a.offset[d] =
        in[d] > 0 ? static_cast<double>(in[d]) / 2 * (1 - static_cast<double>(out[d]) / a.span[d]) : 0.0;
    a.identity[d] = s == 1.0 && out[d] == in[d] ? 1 : 0;
  }
  return a;
}

// ---- the GPU half ----

// One launch of resize.cu's entry for the dtype: a thread per output element.
class ResizeRuntime final : public RuntimeOp {
 public:
  explicit ResizeRuntime(ResizeSpec spec) : spec_(std::move(spec)) {}
  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    const ResizeArgs a = plan(spec_, t.inputs.at(0).shape, t.output.shape);
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.output.ptr);
    v.bytes(&a, sizeof a);
  }
  Dim3 block() const override { return {kResizeThreads, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>& shape) const override {
    return grid_1d(numel_of(shape), kResizeThreads);
  }

 private:
  ResizeSpec spec_;
};

// ---- nn.resize ----

class ResizeOp final : public CustomOp {
 public:
  explicit ResizeOp(ResizeSpec spec) : spec_(std::move(spec)) {}
  std::string name() const override { return "nn.resize"; }
  // "mode=linear coordinate_transformation_mode=half_pixel scales=[1, 1, 2, 2]", with
  // nearest_mode for nearest and cubic_coeff_a / exclude_outside for cubic.
  std::string attributes() const override {
    const auto m = static_cast<std::size_t>(spec_.mode);
    std::string s = util::cat("mode=", m < 3 ? kModeNames[m] : "?",
                              " coordinate_transformation_mode=", spec_.coordinate_transformation_mode);
    if (spec_.mode == ResizeSpec::Mode::Nearest) s += " nearest_mode=" + spec_.nearest_mode;
    if (spec_.mode == ResizeSpec::Mode::Cubic)
      s += util::cat(" cubic_coeff_a=", spec_.cubic_coeff_a,
                     spec_.exclude_outside ? " exclude_outside=1" : "");
    if (!spec_.scales.empty()) s += " scales=[" + util::join(spec_.scales, ", ") + "]";
    if (!spec_.sizes.empty()) s += " sizes=" + sizes_to_string(spec_.sizes);
    return s;
  }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    check_spec();
    const Shape& x = in[0];
    if (x.rank() == 0) throw Error(util::cat("expects an input of rank >= 1, got a scalar ", x.to_string()));
    if (x.rank() > kMaxDims)
      throw Error(
          util::cat("supports inputs of rank 1 to ", kMaxDims, ", got ", x.rank(), "-D ", x.to_string()));
    const bool by_scale = !spec_.scales.empty();
    const std::size_t given = by_scale ? spec_.scales.size() : spec_.sizes.size();
    if (given != x.rank())
      throw Error(util::cat("has ", given, by_scale ? " scales" : " sizes", " for the ", x.rank(),
                            "-D input ", x.to_string(), "; it needs one per dim"));
    Shape out;
    for (std::size_t d = 0; d < x.rank(); ++d) {
      const Dim& dim = x[d];
      if (by_scale) {
        const double s = spec_.scales[d];
        if (!(s > 0.0) || !std::isfinite(s))
          throw Error(util::cat("scale ", s, " of dim ", d, " must be positive and finite (scales ",
                                scales_text(), ")"));
        if (s == 1.0) {
          out.push_back(dim);
          continue;
        }
        if (dim.is_dynamic())
          throw Error(util::cat("dim ", d, " of the input ", x.to_string(), " is dynamic but its scale is ",
                                s, "; only a dim kept at its size (scale 1) may be dynamic"));
        const double o = std::floor(static_cast<double>(dim.size()) * s);
        if (o >= 9.0e18)
          throw Error(util::cat("dim ", d, " of ", dim.size(), " scaled by ", s, " is too large (", o, ")"));
        out.push_back(Dim(static_cast<std::int64_t>(o)));
      } else {
        const std::int64_t s = spec_.sizes[d];
        if (s == -1) {
          out.push_back(dim);
          continue;
        }
        if (s <= 0)
          throw Error(util::cat("size ", s, " of dim ", d,
                                " must be positive, or -1 to keep the input's (sizes ",
                                sizes_to_string(spec_.sizes), ")"));
        if (dim.is_dynamic())
          throw Error(util::cat("dim ", d, " of the input ", x.to_string(), " is dynamic but its size is ", s,
                                "; only a dim kept at its size (size -1) may be dynamic"));
        out.push_back(Dim(s));
      }
      if (dim.size() == 0 && out[d].size() > 0)
        throw Error(util::cat("dim ", d, " of the input ", x.to_string(), " is empty but its output size is ",
                              out[d].size(), ": there is nothing to sample"));
    }
    return out;
  }

  DType infer_output_dtype(const std::vector<DType>& in) const override { return require_float(in); }

  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    return Lowered{name(), kernel_file("resize.cu"), entry_for("kg_resize", ctx.output_dtype),
                   std::make_shared<ResizeRuntime>(spec_)};
  }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    const ResizeArgs a = plan(spec_, x.shape(), ctx.output.shape());
    if (a.total == 0) return;
    const auto r = static_cast<std::size_t>(a.rank);
    // Per dim and output index: nt[d] taps as input offsets and weights.
    std::vector<int> nt(r);
    std::vector<std::vector<std::int64_t>> toff(r);
    std::vector<std::vector<double>> twt(r);
    for (std::size_t d = 0; d < r; ++d) {
      nt[d] = a.identity[d] ? 1 : a.mode == 0 ? 1 : a.mode == 1 ? 2 : 4;
      const auto k = static_cast<std::size_t>(nt[d]);
      toff[d].resize(static_cast<std::size_t>(a.out[d]) * k);
      twt[d].resize(toff[d].size());
      for (std::int64_t o = 0; o < a.out[d]; ++o) {
        std::int64_t idx[4];
        double wt[4];
        if (a.identity[d]) {
          idx[0] = o;
          wt[0] = 1.0;
        } else {
          taps(a, d, o, idx, wt);
        }
        for (std::size_t j = 0; j < k; ++j) {
          toff[d][static_cast<std::size_t>(o) * k + j] = idx[j] * a.in_stride[d];
          twt[d][static_cast<std::size_t>(o) * k + j] = wt[j];
        }
      }
    }
    const std::size_t last = r - 1;
    const std::int64_t len = a.out[last], rows = a.total / len;
    const auto nl = static_cast<std::size_t>(nt[last]);
    dispatch_float(x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data<T>();
      T* yp = ctx.output.data<T>();
      ctx.parallel_for(rows, std::max<std::int64_t>(1, 16384 / len), [&](std::int64_t b, std::int64_t e) {
        // The row's combinations of one tap per fixed dim (dim 0 slowest): offset and weight.
        std::vector<std::pair<std::int64_t, double>> combos, next;
        for (std::int64_t row = b; row < e; ++row) {
          combos.assign(1, {0, 1.0});
          std::int64_t rem = row, div = rows;
          for (std::size_t d = 0; d < last; ++d) {
            div /= a.out[d];
            const auto o = static_cast<std::size_t>(rem / div);
            rem %= div;
            const auto k = static_cast<std::size_t>(nt[d]);
            next.clear();
            for (const auto& [off, w] : combos)
              for (std::size_t j = 0; j < k; ++j)
                next.emplace_back(off + toff[d][o * k + j], w * twt[d][o * k + j]);
            combos.swap(next);
          }
          T* y = yp + row * len;
          const std::int64_t* lo = toff[last].data();
          const double* lw = twt[last].data();
          if (a.mode == 0) {
            const T* src = xp + combos[0].first;
            for (std::int64_t j = 0; j < len; ++j) y[j] = src[lo[j]];
            continue;
          }
          for (std::int64_t j = 0; j < len; ++j) {
            double acc = 0.0;
            const std::size_t at = static_cast<std::size_t>(j) * nl;
            for (const auto& [off, w] : combos)
              for (std::size_t t = 0; t < nl; ++t)
                acc += (w * lw[at + t]) * static_cast<double>(xp[off + lo[at + t]]);
            y[j] = static_cast<T>(acc);
          }
        }
      });
    });
  }

 private:
  void check_spec() const {
    const auto m = static_cast<int>(spec_.mode);
    if (m < 0 || m > 2) throw Error(util::cat("mode ", m, " is not Nearest, Linear or Cubic"));
    const std::string& c = spec_.coordinate_transformation_mode;
    if (c == "tf_crop_and_resize")
      throw Error(
          "coordinate_transformation_mode 'tf_crop_and_resize' is not supported: it needs the roi input "
          "and extrapolation_value");
    if (find_name(kCoordNames, c) < 0)
      throw Error(
          util::cat("coordinate_transformation_mode '", c, "' is not one of ", name_list(kCoordNames)));
    if (find_name(kRoundingNames, spec_.nearest_mode) < 0)
      throw Error(
          util::cat("nearest_mode '", spec_.nearest_mode, "' is not one of ", name_list(kRoundingNames)));
    if (!std::isfinite(spec_.cubic_coeff_a))
      throw Error(util::cat("cubic_coeff_a must be finite, got ", spec_.cubic_coeff_a));
    if (spec_.scales.empty() == spec_.sizes.empty())
      throw Error(spec_.scales.empty() ? "needs scales or sizes, got neither"
                                       : util::cat("takes scales or sizes, not both (scales ", scales_text(),
                                                   ", sizes ", sizes_to_string(spec_.sizes), ")"));
  }

  std::string scales_text() const { return "[" + util::join(spec_.scales, ", ") + "]"; }

  ResizeSpec spec_;
};

}  // namespace

CustomData resize_op(const ResizeSpec& spec) { return CustomData::make<ResizeOp>(spec); }

SymTensor resize(const SymTensor& x, const ResizeSpec& spec, const std::string& name) {
  return x.record_custom(resize_op(spec), {}, std::nullopt, name);
}

}  // namespace kg::ops
