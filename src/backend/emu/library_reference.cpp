#include "backend/emu/library_reference.hpp"

#include <algorithm>
#include <cstdint>
#include <variant>
#include <vector>

#include "kg/error.hpp"
#include "util/half.hpp"
#include "util/str.hpp"

namespace kg::emu {
namespace {

// A 16-bit float element (bfloat16 when Bf, else IEEE half): read as a double, written rounded to
// nearest even, so the call's sums stay in double whatever the storage.
template <bool Bf>
struct Half16 {
  std::uint16_t bits;
  Half16() = default;
  explicit Half16(double v)
      : bits(Bf ? util::float_to_bf16(static_cast<float>(v)) : util::float_to_half(static_cast<float>(v))) {}
  explicit operator double() const { return Bf ? util::bf16_to_float(bits) : util::half_to_float(bits); }
};

template <class T>
T* at(DevicePtr p) {
  return reinterpret_cast<T*>(static_cast<std::uintptr_t>(p));
}

template <class T>
void gemm(const GemmCall& g) {
  const T *a = at<T>(g.a), *b = at<T>(g.b), *bias = at<T>(g.bias);
  T* c = at<T>(g.c);
  for (std::int64_t i = 0; i < g.batch; ++i)
    for (std::int64_t r = 0; r < g.m; ++r)
      for (std::int64_t col = 0; col < g.n; ++col) {
        double s = 0;
        for (std::int64_t k = 0; k < g.k; ++k) {
          const T av = g.trans_a ? a[i * g.stride_a + k * g.lda + r] : a[i * g.stride_a + r * g.lda + k];
          const T bv = g.trans_b ? b[i * g.stride_b + col * g.ldb + k] : b[i * g.stride_b + k * g.ldb + col];
          s += static_cast<double>(av) * static_cast<double>(bv);
        }
        if (bias) s += static_cast<double>(bias[col]);
        if (g.relu) s = std::max(s, 0.0);
        c[i * g.stride_c + r * g.ldc + col] = static_cast<T>(s);
      }
}

// Calls f(n, o, oh, ow, ci, ih, iw, kh, kw) for every product term of the convolution `c`.
template <class F>
void for_each_term(const Conv2dCall& c, F&& f) {
  const std::int64_t cg = c.in_channels / c.groups, og = c.out_channels / c.groups;
  for (std::int64_t n = 0; n < c.batch; ++n)
    for (std::int64_t o = 0; o < c.out_channels; ++o) {
      const std::int64_t first = o / og * cg;
      for (std::int64_t oh = 0; oh < c.out_height; ++oh)
        for (std::int64_t ow = 0; ow < c.out_width; ++ow)
          for (std::int64_t ci = 0; ci < cg; ++ci)
            for (std::int64_t kh = 0; kh < c.kernel_h; ++kh) {
              const std::int64_t ih = oh * c.stride_h - c.pad_h + kh * c.dilation_h;
              if (ih < 0 || ih >= c.height) continue;
              for (std::int64_t kw = 0; kw < c.kernel_w; ++kw) {
                const std::int64_t iw = ow * c.stride_w - c.pad_w + kw * c.dilation_w;
                if (iw < 0 || iw >= c.width) continue;
                f(n, o, oh, ow, ci, first + ci, ih, iw, kh, kw);
              }
            }
    }
}

// The forward, or one of its backward passes (Conv2dCall::Pass), with f64 sums; with `fuse`, a
// forward's fusable epilogue too (shift, residual, ReLU) before the one rounding.
template <class T>
void conv(const Conv2dCall& c, bool fuse) {
  T *x = at<T>(c.x), *w = at<T>(c.w), *y = at<T>(c.y);
  const T* bias = at<T>(c.bias);
  const std::int64_t cg = c.in_channels / c.groups;
  // Element offsets in NCHW (x, y) and [O, C/g, kh, kw] (w), or channels-last: [N, H, W, C] and
  // [O, kh, kw, C/g].
  const bool last = c.channels_last;
  auto xi = [&](std::int64_t n, std::int64_t ch, std::int64_t ih, std::int64_t iw) {
    return last ? ((n * c.height + ih) * c.width + iw) * c.in_channels + ch
                : ((n * c.in_channels + ch) * c.height + ih) * c.width + iw;
  };
  auto wi = [&](std::int64_t o, std::int64_t ci, std::int64_t kh, std::int64_t kw) {
    return last ? ((o * c.kernel_h + kh) * c.kernel_w + kw) * cg + ci
                : ((o * cg + ci) * c.kernel_h + kh) * c.kernel_w + kw;
  };
  auto yi = [&](std::int64_t n, std::int64_t o, std::int64_t oh, std::int64_t ow) {
    return last ? ((n * c.out_height + oh) * c.out_width + ow) * c.out_channels + o
                : ((n * c.out_channels + o) * c.out_height + oh) * c.out_width + ow;
  };
  using Pass = Conv2dCall::Pass;
  const std::int64_t outputs = c.pass == Pass::Forward ? c.batch * c.out_channels * c.out_height * c.out_width
                               : c.pass == Pass::BackwardData ? c.batch * c.in_channels * c.height * c.width
                                                              : c.out_channels * cg * c.kernel_h * c.kernel_w;
  std::vector<double> sum(static_cast<std::size_t>(outputs), 0.0);
  for_each_term(c, [&](std::int64_t n, std::int64_t o, std::int64_t oh, std::int64_t ow, std::int64_t ci,
                       std::int64_t ch, std::int64_t ih, std::int64_t iw, std::int64_t kh, std::int64_t kw) {
    switch (c.pass) {
      case Pass::Forward:
        sum[static_cast<std::size_t>(yi(n, o, oh, ow))] +=
            static_cast<double>(x[xi(n, ch, ih, iw)]) * static_cast<double>(w[wi(o, ci, kh, kw)]);
        break;
      case Pass::BackwardData:
        sum[static_cast<std::size_t>(xi(n, ch, ih, iw))] +=
            static_cast<double>(y[yi(n, o, oh, ow)]) * static_cast<double>(w[wi(o, ci, kh, kw)]);
        break;
      case Pass::BackwardFilter:
        sum[static_cast<std::size_t>(wi(o, ci, kh, kw))] +=
            static_cast<double>(y[yi(n, o, oh, ow)]) * static_cast<double>(x[xi(n, ch, ih, iw)]);
        break;
    }
  });
  T* out = c.pass == Pass::Forward ? y : c.pass == Pass::BackwardData ? x : w;
  const std::int64_t hwo = c.out_height * c.out_width;
  const bool fused = fuse && c.pass == Pass::Forward && c.fusable;
  const T* shift = fused ? at<T>(c.fusable->shift) : nullptr;
  const T* residual = fused ? at<T>(c.fusable->residual) : nullptr;
  for (std::int64_t i = 0; i < outputs; ++i) {
    double v = sum[static_cast<std::size_t>(i)];
    const std::int64_t o = last ? i % c.out_channels : (i / hwo) % c.out_channels;
    if (c.pass == Pass::Forward && bias) v += static_cast<double>(bias[o]);
    if (shift) v += static_cast<double>(shift[o]);
    if (residual) v += static_cast<double>(residual[i]);
    if (fused && c.fusable->relu) v = std::max(v, 0.0);
    out[i] = static_cast<T>(v);
  }
}

}  // namespace

bool run_library_reference(const LibraryCall& call, const std::string& label, bool fuse) {
  bool fused = false;
  std::visit(
      [&](const auto& c) {
        using Call = std::decay_t<decltype(c)>;
        auto run = [&](auto zero) {
          using T = decltype(zero);
          if constexpr (std::is_same_v<Call, GemmCall>) {
            gemm<T>(c);
          } else {
            conv<T>(c, fuse);
            fused = fuse && c.pass == Conv2dCall::Pass::Forward && c.fusable.has_value();
          }
        };
        if (c.dtype == DType::F32)
          run(float{});
        else if (c.dtype == DType::F64)
          run(double{});
        else if (c.dtype == DType::F16)
          run(Half16<false>{});
        else if (c.dtype == DType::BF16)
          run(Half16<true>{});
        else
          throw Error(util::cat(label, " the emulator's library reference takes f32, f64, f16 and bf16 calls, not ",
                                dtype_name(c.dtype)));
      },
      call.call);
  return fused;
}

}  // namespace kg::emu
