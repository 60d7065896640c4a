// nn.softmax and nn.log_softmax over one dim, numerically stable (the max is subtracted).
#include "ops/softmax_shared.cuh"

#include <algorithm>
#include <array>
#include <cmath>

#include "kg/ops.hpp"
#include "ops/gpu_util.hpp"
#include "ops/op_util.hpp"
#include "ops/prologue.hpp"
#include "ops/softmax.hpp"

namespace kg::ops {
namespace {

// The input as [outer, n, inner] with the softmax over n.
struct SoftmaxExtents {
  std::int64_t outer = 1, n = 1, inner = 1;
};

SoftmaxExtents softmax_extents(const std::vector<std::int64_t>& shape, std::int64_t dim) {
  SoftmaxExtents e;
  if (shape.empty()) return e;  // a scalar: one element
  const auto d = static_cast<std::size_t>(normalize_dim(dim, shape.size()));
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i < d)
      e.outer *= shape[i];
    else if (i == d)
      e.n = shape[i];
    else
      e.inner *= shape[i];
  }
  return e;
}

// The GPU half: see softmax.cu for the three row layouts. The backward (softmax_backward.cu)
// takes the same layout: kernel(y, dy, dx, outer, n, inner).
class SoftmaxRuntime final : public RuntimeOp {
 public:
  static constexpr unsigned kThreads = KG_SOFTMAX_THREADS;

  SoftmaxRuntime(std::int64_t dim, std::string backward_entry)
      : dim_(dim), backward_entry_(std::move(backward_entry)) {}
  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    const SoftmaxExtents e = softmax_extents(t.output.shape, dim_);
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.output.ptr);
    v.i64(e.outer);
    v.i64(e.n);
    v.i64(e.inner);
  }
  Dim3 block() const override { return {kThreads, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>& shape) const override {
    const SoftmaxExtents e = softmax_extents(shape, dim_);
    if (e.inner > 1) {
      // Blocks of `width` adjacent columns: a power of two from 2 to KG_SOFTMAX_COLUMNS
      // (kg_softmax_width).
      std::int64_t width = 2;
      while (width < KG_SOFTMAX_COLUMNS && width < e.inner) width *= 2;
      const std::int64_t blocks = e.outer * ((e.inner + width - 1) / width);
      return {static_cast<unsigned>(std::clamp<std::int64_t>(blocks, 1, 65535LL * 32)), 1, 1};
    }
    const std::int64_t rows_per_block = e.n <= KG_SOFTMAX_WARP_MAX ? kThreads / 32 : 1;
    return {static_cast<unsigned>(
                std::clamp<std::int64_t>((e.outer + rows_per_block - 1) / rows_per_block, 1, 65535LL * 32)),
            1, 1};
  }

  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    const SoftmaxExtents e = softmax_extents(t.grad_output.shape, dim_);
    return {{backward_entry_,
             grid(t.grad_output.shape),
             {kThreads, 1, 1},
             0,
             {t.output, t.grad_output, t.grad_inputs.at(0), e.outer, e.n, e.inner}}};
  }

 private:
  std::int64_t dim_;
  std::string backward_entry_;
};

class SoftmaxOp final : public CustomOp, public PrologueReduction {
 public:
  SoftmaxOp(std::int64_t dim, bool log) : dim_(dim), log_(log) {}
  std::string name() const override { return log_ ? "nn.log_softmax" : "nn.softmax"; }
  std::optional<std::int64_t> softmax_dim() const { return log_ ? std::nullopt : std::optional<std::int64_t>(dim_); }
  std::string attributes() const override { return util::cat("dim=", dim_); }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    // A scalar behaves as one element along dim 0 (or -1), as in PyTorch.
    normalize_dim(dim_, std::max<std::size_t>(in[0].rank(), 1));
    return in[0];
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override { return require_float(in); }

  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    const DType dtype = ctx.output_dtype;
    return Lowered{name(), kernel_file("softmax.cu"),
                   entry_for(log_ ? "kg_log_softmax" : "kg_softmax", dtype),
                   std::make_shared<SoftmaxRuntime>(
                       dim_, entry_for(log_ ? "kg_log_softmax_backward" : "kg_softmax_backward", dtype))};
  }
  std::string lower_backward_source(const LowerContext&) const override {
    return kernel_file("softmax_backward.cu");
  }

  // A folded prologue (ops/fused_reduction): the same kernel body and runtime, the input read
  // through the prologue's loader.
  bool takes_prologue(DType t) const override { return t == DType::F32 || t == DType::F64; }
  std::optional<Lowered> lower_with_prologue(const LowerContext& ctx, const PrologueCode& code) const override {
    const DType dtype = ctx.output_dtype;
    if (!takes_prologue(dtype)) return std::nullopt;
    const char* t = device_type(dtype);
    std::string src = util::cat(code.head, without_entries(kernel_file("softmax.cu")), "\n", code.source,
                                "\nextern \"C\" __global__ void __launch_bounds__(KG_SOFTMAX_THREADS)\n    ",
                                code.entry, "(", code.params, ", ", t,
                                "* __restrict__ y, long long outer, long long n, long long inner) {\n  kg_softmax<",
                                t, ", ", log_ ? "true" : "false", ">(", code.loader, ", y, outer, n, inner);\n}\n");
    return Lowered{name(), std::move(src), code.entry,
                   std::make_shared<SoftmaxRuntime>(
                       dim_, entry_for(log_ ? "kg_log_softmax_backward" : "kg_softmax_backward", dtype))};
  }

  bool has_cpu_backward() const override { return true; }
  // Both derivatives are functions of the output.
  BackwardSaves backward_saves() const override { return {false, true}; }
  // softmax: dx = y (dy - Σ dy y); log_softmax: dx = dy - exp(y) Σ dy; the sums in double.
  void cpu_backward(CpuBackwardContext& ctx) const override {
    if (!ctx.wants_input_grad(0)) return;
    const SoftmaxExtents e = softmax_extents(ctx.grad_output.shape(), dim_);
    if (e.outer * e.n * e.inner == 0) return;
    dispatch_float(ctx.grad_output.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* y = ctx.output.data<T>();
      const T* dy = ctx.grad_output.data<T>();
      T* dx = ctx.grad_inputs[0].data<T>();
      const std::int64_t n = e.n, inner = e.inner;
      // One softmax of n elements `inner` apart, at y + base.
      auto row = [&](std::int64_t base) {
        double s = 0;
        for (std::int64_t i = 0; i < n; ++i) {
          const std::int64_t k = base + i * inner;
          s += log_ ? static_cast<double>(dy[k]) : static_cast<double>(dy[k]) * y[k];
        }
        const T sum = static_cast<T>(s);
        if (log_)
          for (std::int64_t i = 0; i < n; ++i) {
            const std::int64_t k = base + i * inner;
            dx[k] = dy[k] - std::exp(y[k]) * sum;
          }
        else
          for (std::int64_t i = 0; i < n; ++i) {
            const std::int64_t k = base + i * inner;
            dx[k] = y[k] * (dy[k] - sum);
          }
      };
      if (inner == 1) {
        ctx.parallel_for(e.outer, std::max<std::int64_t>(1, 8192 / n), [&](std::int64_t r0, std::int64_t r1) {
          for (std::int64_t r = r0; r < r1; ++r) row(r * n);
        });
        return;
      }
      // Elements of one softmax are `inner` apart: adjacent columns side by side, so that each pass
      // over the n rows reads contiguous memory.
      constexpr std::int64_t kBlock = 256;
      const std::int64_t blocks = (inner + kBlock - 1) / kBlock;
      ctx.parallel_for(e.outer * blocks, std::max<std::int64_t>(1, 8192 / (n * std::min(inner, kBlock))),
                       [&](std::int64_t t0, std::int64_t t1) {
                         std::array<double, kBlock> sum;
                         for (std::int64_t t = t0; t < t1; ++t) {
                           const std::int64_t o = t / blocks, j0 = (t % blocks) * kBlock;
                           const std::int64_t w = std::min(kBlock, inner - j0);
                           const std::int64_t base = o * n * inner + j0;
                           for (std::int64_t j = 0; j < w; ++j) sum[static_cast<std::size_t>(j)] = 0;
                           for (std::int64_t i = 0; i < n; ++i) {
                             const T* yr = y + base + i * inner;
                             const T* dyr = dy + base + i * inner;
                             for (std::int64_t j = 0; j < w; ++j)
                               sum[static_cast<std::size_t>(j)] +=
                                   log_ ? static_cast<double>(dyr[j]) : static_cast<double>(dyr[j]) * yr[j];
                           }
                           for (std::int64_t i = 0; i < n; ++i) {
                             const std::int64_t k = base + i * inner;
                             for (std::int64_t j = 0; j < w; ++j) {
                               const T s = static_cast<T>(sum[static_cast<std::size_t>(j)]);
                               dx[k + j] =
                                   log_ ? dy[k + j] - std::exp(y[k + j]) * s : y[k + j] * (dy[k + j] - s);
                             }
                           }
                         }
                       });
    });
  }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    const auto& shape = x.shape();
    const std::size_t d = shape.empty() ? 0 : static_cast<std::size_t>(normalize_dim(dim_, shape.size()));
    std::int64_t outer = 1, n = 1, inner = 1;
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (i < d)
        outer *= shape[i];
      else if (i == d)
        n = shape[i];
      else
        inner *= shape[i];
    }
    if (outer * n * inner == 0) return;
    dispatch_float(x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data<T>();
      T* y = ctx.output.data<T>();
      if (inner == 1)
        contiguous(ctx, xp, y, outer, n);
      else
        strided(ctx, xp, y, outer, n, inner);
    });
  }

 private:
  // Rows of n contiguous elements.
  template <class T>
  void contiguous(CpuContext& ctx, const T* xp, T* y, std::int64_t rows, std::int64_t n) const {
    ctx.parallel_for(rows, std::max<std::int64_t>(1, 8192 / n), [&](std::int64_t r0, std::int64_t r1) {
      for (std::int64_t r = r0; r < r1; ++r) {
        const T* src = xp + r * n;
        T* dst = y + r * n;
        T m = src[0];
        for (std::int64_t i = 1; i < n; ++i) m = std::max(m, src[i]);
        if (std::isinf(m) && m < 0) m = 0;  // a row of -inf: exp(-inf - 0) = 0 everywhere
        double sum = 0;
        if (log_) {
          for (std::int64_t i = 0; i < n; ++i) sum += std::exp(src[i] - m);
          // (x - max) - log(sum): adding max to the log first would round it at max's scale.
          const T ls = static_cast<T>(std::log(sum));
          for (std::int64_t i = 0; i < n; ++i) dst[i] = (src[i] - m) - ls;
        } else {
          for (std::int64_t i = 0; i < n; ++i) {
            const T e = std::exp(src[i] - m);
            dst[i] = e;
            sum += e;
          }
          const T inv = static_cast<T>(1.0 / sum);
          for (std::int64_t i = 0; i < n; ++i) dst[i] *= inv;
        }
      }
    });
  }

  // Elements of one softmax are `inner` apart: each task takes a block of adjacent columns so
  // that every pass over the n rows reads contiguous memory.
  template <class T>
  void strided(CpuContext& ctx, const T* xp, T* y, std::int64_t outer, std::int64_t n,
               std::int64_t inner) const {
    constexpr std::int64_t kBlock = 256;
    const std::int64_t blocks = (inner + kBlock - 1) / kBlock;
    ctx.parallel_for(outer * blocks, std::max<std::int64_t>(1, 8192 / (n * std::min(inner, kBlock))),
                     [&](std::int64_t t0, std::int64_t t1) {
                       std::array<T, kBlock> mx;
                       std::array<double, kBlock> sum;
                       for (std::int64_t t = t0; t < t1; ++t) {
                         const std::int64_t o = t / blocks, j0 = (t % blocks) * kBlock;
                         const std::int64_t w = std::min(kBlock, inner - j0);
                         const T* src = xp + o * n * inner + j0;
                         T* dst = y + o * n * inner + j0;
                         for (std::int64_t j = 0; j < w; ++j) mx[j] = src[j];
                         for (std::int64_t i = 1; i < n; ++i)
                           for (std::int64_t j = 0; j < w; ++j) mx[j] = std::max(mx[j], src[i * inner + j]);
                         for (std::int64_t j = 0; j < w; ++j) {
                           if (std::isinf(mx[j]) && mx[j] < 0) mx[j] = 0;
                           sum[j] = 0;
                         }
                         for (std::int64_t i = 0; i < n; ++i)
                           for (std::int64_t j = 0; j < w; ++j) {
                             const T e = std::exp(src[i * inner + j] - mx[j]);
                             if (!log_) dst[i * inner + j] = e;
                             sum[j] += e;
                           }
                         if (log_) {
                           std::array<T, kBlock> ls;
                           for (std::int64_t j = 0; j < w; ++j) ls[j] = static_cast<T>(std::log(sum[j]));
                           for (std::int64_t i = 0; i < n; ++i)
                             for (std::int64_t j = 0; j < w; ++j)
                               dst[i * inner + j] = (src[i * inner + j] - mx[j]) - ls[j];
                         } else {
                           for (std::int64_t j = 0; j < w; ++j) sum[j] = 1.0 / sum[j];
                           for (std::int64_t i = 0; i < n; ++i)
                             for (std::int64_t j = 0; j < w; ++j)
                               dst[i * inner + j] = static_cast<T>(dst[i * inner + j] * sum[j]);
                         }
                       }
                     });
  }

  std::int64_t dim_;
  bool log_;
};

}  // namespace

std::optional<std::int64_t> softmax_dim(const CustomOp& op) {
  const auto* s = dynamic_cast<const SoftmaxOp*>(&op);
  return s ? s->softmax_dim() : std::nullopt;
}

}  // namespace kg::ops

namespace kg {

SymTensor softmax(const SymTensor& x, std::int64_t dim, const std::string& name) {
  return x.record_custom(CustomData::make<ops::SoftmaxOp>(dim, false), {}, std::nullopt, name);
}

SymTensor log_softmax(const SymTensor& x, std::int64_t dim, const std::string& name) {
  return x.record_custom(CustomData::make<ops::SoftmaxOp>(dim, true), {}, std::nullopt, name);
}

}  // namespace kg
