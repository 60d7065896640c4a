// Losses: nn.cross_entropy (mean over rows of logsumexp(logits) - logits[label], integer labels)
// and nn.mse_loss (mean of squared differences). Both give a scalar [] that a backward pass
// starts from, and both have CPU and GPU backwards (loss.cu).
//
// An invalid label (outside [0, C)) is an error on the CPU naming the row, the label and C. A
// kernel cannot raise one: on a GPU (and under emulation) the loss of a batch holding such a
// label is NaN, and so is that row's gradient.
#include "ops/loss_shared.cuh"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kg/ops.hpp"
#include "ops/gpu_util.hpp"
#include "ops/op_util.hpp"

namespace kg::ops {
namespace {

constexpr unsigned kLossThreads = KG_LOSS_THREADS;

// The label of row `r` as an integer, whatever its dtype.
std::int64_t label_at(const Tensor& labels, std::int64_t r) {
  return labels.dtype() == DType::I32 ? labels.data<std::int32_t>()[r] : labels.data<std::int64_t>()[r];
}

std::string label_suffix(DType t) { return t == DType::I32 ? "_i32" : "_i64"; }

// ---- cross-entropy ----

class CrossEntropyRuntime final : public RuntimeOp {
 public:
  CrossEntropyRuntime(DType dtype, DType label_dtype) : dtype_(dtype), label_dtype_(label_dtype) {}
  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.inputs[1].ptr);
    v.pointer(t.output.ptr);
    v.i64(t.inputs[0].shape.at(0));
    v.i64(t.inputs[0].shape.at(1));
  }
  Dim3 block() const override { return {kLossThreads, 1, 1}; }
  // One block: a deterministic reduction over every row.
  Dim3 grid(const std::vector<std::int64_t>&) const override { return {1, 1, 1}; }

  // A warp per row, 8 rows per block; one idle block when the gradient is not wanted.
  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    const std::int64_t n = t.inputs.at(0).shape.at(0), c = t.inputs.at(0).shape.at(1);
    const Dim3 grid = t.grad_inputs.at(0).ptr == 0 ? Dim3{1, 1, 1} : grid_1d(n, kLossThreads / 32);
    return {{entry_for("kg_cross_entropy_backward", dtype_) + label_suffix(label_dtype_),
             grid,
             {kLossThreads, 1, 1},
             0,
             {t.inputs.at(0), t.inputs.at(1), t.grad_output, t.grad_inputs.at(0), n, c}}};
  }

 private:
  DType dtype_, label_dtype_;
};

class CrossEntropyOp final : public CustomOp {
 public:
  std::string name() const override { return "nn.cross_entropy"; }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 2);
    if (in[0].rank() != 2)
      throw Error(util::cat("expects logits [N, C], got ", in[0].rank(), "-D ", in[0].to_string()));
    if (in[1].rank() != 1)
      throw Error(util::cat("expects labels [N], got ", in[1].rank(), "-D ", in[1].to_string()));
    const Dim &n = in[0][0], &m = in[1][0];
    // Known sizes must agree now; dynamic ones are compared at load, with every size known.
    if (n.is_static() && m.is_static() && n.size() != m.size())
      throw Error(util::cat("logits ", in[0].to_string(), " and labels ", in[1].to_string(),
                            " disagree on N (", n.to_string(), " rows vs ", m.to_string(), " labels)"));
    return Shape{};
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override {
    if (in.size() != 2) throw Error(util::cat("expects 2 input(s), got ", in.size()));
    if (in[0] != DType::F32 && in[0] != DType::F64)
      throw Error(util::cat("expects f32 or f64 logits, got ", dtype_name(in[0])));
    if (in[1] != DType::I32 && in[1] != DType::I64)
      throw Error(util::cat("expects integer class labels (i32 or i64), got ", dtype_name(in[1])));
    return in[0];
  }

  // The kernels of the logits' dtype (the output's) and the labels'.
  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    const DType dtype = ctx.output_dtype, label_dtype = ctx.input_dtypes.at(1);
    return Lowered{name(), kernel_file("loss.cu"),
                   entry_for("kg_cross_entropy", dtype) + label_suffix(label_dtype),
                   std::make_shared<CrossEntropyRuntime>(dtype, label_dtype)};
  }
  std::string lower_backward_source(const LowerContext&) const override { return kernel_file("loss.cu"); }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    const Tensor& labels = ctx.inputs[1];
    const std::int64_t n = x.dim(0), c = x.dim(1);
    check_labels(labels, n, c);
    dispatch_float(x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data<T>();
      double sum = 0;  // rows in order: the same sum on every run
      for (std::int64_t r = 0; r < n; ++r) {
        const T* row = xp + r * c;
        double m, s;
        row_stats(row, c, m, s);
        sum += (m + std::log(s)) - static_cast<double>(row[label_at(labels, r)]);
      }
      ctx.output.data<T>()[0] =
          static_cast<T>(n > 0 ? sum / static_cast<double>(n) : std::numeric_limits<double>::quiet_NaN());
    });
  }

  bool has_cpu_backward() const override { return true; }
  BackwardSaves backward_saves() const override { return {true, false}; }
  void cpu_backward(CpuBackwardContext& ctx) const override {
    if (!ctx.wants_input_grad(0)) return;  // labels get no gradient
    const Tensor& x = ctx.inputs[0];
    const Tensor& labels = ctx.inputs[1];
    const std::int64_t n = x.dim(0), c = x.dim(1);
    check_labels(labels, n, c);
    dispatch_float(x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data<T>();
      T* dx = ctx.grad_inputs[0].data<T>();
      const double scale = static_cast<double>(ctx.grad_output.data<T>()[0]) / static_cast<double>(n);
      ctx.parallel_for(n, std::max<std::int64_t>(1, 4096 / std::max<std::int64_t>(c, 1)),
                       [&](std::int64_t r0, std::int64_t r1) {
                         for (std::int64_t r = r0; r < r1; ++r) {
                           const T* row = xp + r * c;
                           T* drow = dx + r * c;
                           double m, s;
                           row_stats(row, c, m, s);
                           const std::int64_t label = label_at(labels, r);
                           for (std::int64_t j = 0; j < c; ++j) {
                             const double p = std::exp(static_cast<double>(row[j]) - m) / s;
                             drow[j] = static_cast<T>(scale * (p - (j == label ? 1.0 : 0.0)));
                           }
                         }
                       });
    });
  }

 private:
  // A row's maximum (0 for a row of -inf) and sum of exp(x - max).
  template <class T>
  static void row_stats(const T* row, std::int64_t c, double& m, double& s) {
    m = -std::numeric_limits<double>::infinity();
    for (std::int64_t j = 0; j < c; ++j) m = std::max(m, static_cast<double>(row[j]));
    if (std::isinf(m) && m < 0) m = 0;
    s = 0;
    for (std::int64_t j = 0; j < c; ++j) s += std::exp(static_cast<double>(row[j]) - m);
  }
  static void check_labels(const Tensor& labels, std::int64_t n, std::int64_t c) {
    for (std::int64_t r = 0; r < n; ++r) {
      const std::int64_t l = label_at(labels, r);
      if (l < 0 || l >= c)
        throw Error(util::cat("row ", r, " has label ", l, ", outside [0, ", c, ") for C = ", c, " classes"));
    }
  }
};

// ---- mean squared error ----

class MseRuntime final : public RuntimeOp {
 public:
  explicit MseRuntime(DType dtype) : dtype_(dtype) {}
  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.inputs[1].ptr);
    v.pointer(t.output.ptr);
    v.i64(t.inputs[0].numel());
  }
  Dim3 block() const override { return {kLossThreads, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>&) const override { return {1, 1, 1}; }

  // A thread per element; one idle block when neither gradient is wanted.
  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    const std::int64_t n = t.inputs.at(0).numel();
    const bool idle = t.grad_inputs.at(0).ptr == 0 && t.grad_inputs.at(1).ptr == 0;
    return {{entry_for("kg_mse_loss_backward", dtype_),
             idle ? Dim3{1, 1, 1} : grid_1d(n, kLossThreads),
             {kLossThreads, 1, 1},
             0,
             {t.inputs.at(0), t.inputs.at(1), t.grad_output, t.grad_inputs.at(0), t.grad_inputs.at(1), n}}};
  }

 private:
  DType dtype_;
};

class MseLossOp final : public CustomOp {
 public:
  std::string name() const override { return "nn.mse_loss"; }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 2);
    bool same = in[0].rank() == in[1].rank();
    for (std::size_t d = 0; same && d < in[0].rank(); ++d) {
      const Dim &a = in[0][d], &b = in[1][d];
      if (a.is_static() && b.is_static()) same = a.size() == b.size();  // dynamic: compared at load
    }
    if (!same)
      throw Error(util::cat("prediction ", in[0].to_string(), " and target ", in[1].to_string(),
                            " must have the same shape"));
    return Shape{};
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override { return require_float(in); }

  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    return Lowered{name(), kernel_file("loss.cu"), entry_for("kg_mse_loss", ctx.output_dtype),
                   std::make_shared<MseRuntime>(ctx.output_dtype)};
  }
  std::string lower_backward_source(const LowerContext&) const override { return kernel_file("loss.cu"); }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor &p = ctx.inputs[0], &t = ctx.inputs[1];
    check_same(p, t);
    dispatch_float(p.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T *pp = p.data<T>(), *tp = t.data<T>();
      const std::int64_t n = p.numel();
      double sum = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        const double d = static_cast<double>(pp[i]) - static_cast<double>(tp[i]);
        sum += d * d;
      }
      ctx.output.data<T>()[0] =
          static_cast<T>(n > 0 ? sum / static_cast<double>(n) : std::numeric_limits<double>::quiet_NaN());
    });
  }

  bool has_cpu_backward() const override { return true; }
  BackwardSaves backward_saves() const override { return {true, false}; }
  void cpu_backward(CpuBackwardContext& ctx) const override {
    const Tensor &p = ctx.inputs[0], &t = ctx.inputs[1];
    check_same(p, t);
    const bool want_p = ctx.wants_input_grad(0), want_t = ctx.wants_input_grad(1);
    if (!want_p && !want_t) return;
    dispatch_float(p.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T *pp = p.data<T>(), *tp = t.data<T>();
      T* dp = want_p ? ctx.grad_inputs[0].data<T>() : nullptr;
      T* dt = want_t ? ctx.grad_inputs[1].data<T>() : nullptr;
      const std::int64_t n = p.numel();
      const double scale = 2.0 * static_cast<double>(ctx.grad_output.data<T>()[0]) / static_cast<double>(n);
      ctx.parallel_for(n, 4096, [&](std::int64_t i0, std::int64_t i1) {
        for (std::int64_t i = i0; i < i1; ++i) {
          const double g = scale * (static_cast<double>(pp[i]) - static_cast<double>(tp[i]));
          if (dp) dp[i] = static_cast<T>(g);
          if (dt) dt[i] = static_cast<T>(-g);
        }
      });
    });
  }

 private:
  static void check_same(const Tensor& p, const Tensor& t) {
    if (p.shape() != t.shape())
      throw Error(util::cat("prediction ", sizes_to_string(p.shape()), " and target ",
                            sizes_to_string(t.shape()), " must have the same shape"));
  }
};

}  // namespace
}  // namespace kg::ops

namespace kg {

SymTensor cross_entropy(const SymTensor& logits, const SymTensor& labels, const std::string& name) {
  return logits.record_custom(CustomData::make<ops::CrossEntropyOp>(), {labels}, std::nullopt, name);
}

SymTensor mse_loss(const SymTensor& prediction, const SymTensor& target, const std::string& name) {
  return prediction.record_custom(CustomData::make<ops::MseLossOp>(), {target}, std::nullopt, name);
}

}  // namespace kg
