// nn.batch_norm2d and nn.layer_norm.
#include "ops/norm.hpp"

#include <algorithm>
#include <cmath>

#include "kg/ops.hpp"
#include "ops/divider.hpp"
#include "ops/gpu_util.hpp"
#include "ops/norm_shared.cuh"
#include "ops/op_util.hpp"
#include "ops/prologue.hpp"

namespace kg::ops {
namespace {

constexpr unsigned kNormThreads = KG_NORM_THREADS;
constexpr std::int64_t kMaxBlocks = 65535LL * 32;  // grid-stride loops take the rest

// The ranges each channel's M = N*H*W values are cut into for the batch-norm kernels' partial
// sums (norm_shared.cuh): enough blocks to fill the GPU, none under KG_BN_MIN_CHUNK values.
std::int64_t bn_chunks(const std::vector<std::int64_t>& shape) {
  const std::int64_t c = std::max<std::int64_t>(shape.at(1), 1), m = shape.at(0) * shape.at(2) * shape.at(3);
  const std::int64_t want = (KG_BN_TARGET_BLOCKS + c - 1) / c;
  return std::clamp<std::int64_t>(std::min(want, m / KG_BN_MIN_CHUNK), 1, std::max<std::int64_t>(m, 1));
}

// Bytes of `head` values of `dtype`, rounded up to a multiple of 8 (the partials are doubles).
std::size_t aligned_head(std::int64_t head, DType dtype) {
  return (static_cast<std::size_t>(head) * dtype_size(dtype) + 7) / 8 * 8;
}

// nn.batch_norm2d on the GPU, one kernel entry for both modes (its `training` argument, packed per
// run), its phases in norm.cu: in train mode launch 0 writes per-(channel, range) partial moments,
// launch 1 turns them into a per-channel scale and shift (in scratch), updating the running
// statistics and num_batches_tracked in place; in inference launch 1 (the first) takes the
// running statistics. The last launch applies scale and shift elementwise. Backward
// (norm_backward.cu): partial sums per (channel, range), then dw, db and the coefficients of dx
// per channel, then (when dx is wanted) dx elementwise; `training_` picks batch or running
// statistics.
class BatchNorm2dRuntime final : public RuntimeOp {
 public:
  BatchNorm2dRuntime(std::int64_t channels, double eps, double momentum, DType dtype, bool training)
      : c_(channels), eps_(eps), momentum_(momentum), dtype_(dtype), training_(training) {}
  std::size_t scratch_bytes(const LaunchTensors& t) const override {
    return aligned_head(KG_BN_SCALE_SHIFT * c_, dtype_) +
           sizeof(double) * KG_BN_FWD_PARTIALS * static_cast<std::size_t>(c_ * bn_chunks(t.output.shape));
  }

  bool supports_train_mode() const override { return true; }
  bool depends_on_run() const override { return true; }
  std::vector<Launch> launches(const LaunchTensors& t) const override {
    const auto& shape = t.output.shape;
    if (t.training && shape.at(0) * shape.at(2) * shape.at(3) <= 1)
      throw Error(util::cat("nn.batch_norm2d: training mode needs more than 1 value per channel, got input ",
                            sizes_to_string(shape)));
    const std::int64_t chunks = bn_chunks(shape);
    const DevicePtr partials = t.scratch ? t.scratch + aligned_head(KG_BN_SCALE_SHIFT * c_, dtype_) : 0;
    std::vector<Launch> ls;
    for (int phase = t.training ? 0 : 1; phase < 3; ++phase) {
      Launch L;
      L.block = {kNormThreads, 1, 1};
      L.grid = phase == 0 ? range_blocks(chunks) : phase == 1 ? grid_1d(c_, kNormThreads) : elementwise_grid(shape);
      L.args.pointer(t.inputs.at(0).ptr);
      for (std::size_t i = 0; i < 5; ++i) L.args.pointer(t.params.at(i).ptr);
      L.args.pointer(t.output.ptr);
      L.args.pointer(t.scratch);
      L.args.pointer(partials);
      L.args.i64(numel_of(shape));
      L.args.i64(c_);
      L.args.i64(chunks);
      L.args.f64(eps_);
      L.args.f64(momentum_);
      L.args.i32(t.training ? 1 : 0);
      L.args.i32(phase);
      const KgDivider hw = kg_divider(shape[2] * shape[3]), c = kg_divider(c_);
      L.args.bytes(&hw, sizeof hw);
      L.args.bytes(&c, sizeof c);
      ls.push_back(std::move(L));
    }
    return ls;
  }

  std::size_t backward_scratch_bytes(const LaunchTensors& t) const override {
    return aligned_head(KG_BN_COEFS * c_, dtype_) +
           sizeof(double) * KG_BN_BWD_PARTIALS * static_cast<std::size_t>(c_ * bn_chunks(t.grad_output.shape));
  }
  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    const auto& shape = t.grad_output.shape;
    const std::int64_t chunks = bn_chunks(shape);
    const DevicePtr partials = t.scratch ? t.scratch + aligned_head(KG_BN_COEFS * c_, dtype_) : 0;
    std::vector<Launch> ls(t.grad_inputs.at(0).ptr ? 3 : 2);
    for (std::size_t phase = 0; phase < ls.size(); ++phase) {
      Launch& L = ls[phase];
      L.entry = entry_for("kg_batch_norm2d_backward", dtype_);
      L.block = {kNormThreads, 1, 1};
      L.grid = phase == 0 ? range_blocks(chunks) : phase == 1 ? grid_1d(c_, kNormThreads) : elementwise_grid(shape);
      const KgDivider hw = kg_divider(shape.at(2) * shape.at(3)), c = kg_divider(c_);
      L.args = {t.inputs.at(0),
                t.params.at(0),
                t.params.at(2),
                t.params.at(3),
                t.grad_output,
                t.grad_inputs.at(0),
                t.grad_params.at(0),
                t.grad_params.at(1),
                ptr(t.scratch),
                ptr(partials),
                shape.at(0),
                c_,
                chunks,
                eps_,
                static_cast<std::int32_t>(training_ && t.training ? 1 : 0),
                static_cast<std::int32_t>(phase),
                raw_bytes(&hw, sizeof hw),
                raw_bytes(&c, sizeof c)};
    }
    return ls;
  }

 private:
  // A block per (channel, range).
  Dim3 range_blocks(std::int64_t chunks) const {
    return {static_cast<unsigned>(std::clamp<std::int64_t>(c_ * chunks, 1, kMaxBlocks)), 1, 1};
  }
  // kg_for_each_unrolled over every element, in 16-byte packs when H*W is a multiple of one (the
  // kernels fall back to single values, with the same grid, on an unaligned buffer).
  Dim3 elementwise_grid(const std::vector<std::int64_t>& shape) const {
    const auto pack = static_cast<std::int64_t>(KG_PACK_BYTES / dtype_size(dtype_));
    const std::int64_t per_thread = (shape.at(2) * shape.at(3) % pack == 0 ? pack : 1) * KG_UNROLL;
    return grid_1d((numel_of(shape) + per_thread - 1) / per_thread, kNormThreads);
  }
  std::int64_t c_;
  double eps_, momentum_;
  DType dtype_;
  bool training_;
};

// nn.layer_norm on the GPU: one warp per row up to KG_LN_WARP_MAX elements (KG_NORM_THREADS / 32
// rows per block), else one block per row.
// Backward (norm_backward.cu): launch 0 as the forward's rows, writing dx and each row's mean and
// 1/std (in scratch, affine only); launch 1 (affine, when dw or db is wanted) sums dw and db over
// the rows in blocks of KG_LN_COLS columns.
class LayerNormRuntime final : public RuntimeOp {
 public:
  LayerNormRuntime(std::vector<std::int64_t> normalized_shape, double eps, bool affine, DType dtype)
      : shape_(std::move(normalized_shape)),
        inner_(numel_of(shape_)),
        eps_(eps),
        affine_(affine),
        dtype_(dtype) {}
  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    v.pointer(t.inputs.at(0).ptr);
    v.pointer(affine_ ? t.params.at(0).ptr : 0);
    v.pointer(affine_ ? t.params.at(1).ptr : 0);
    v.pointer(t.output.ptr);
    v.i64(rows(t.output.shape));
    v.i64(inner_);
    v.f64(eps_);
  }
  Dim3 block() const override { return {kNormThreads, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>& shape) const override {
    const std::int64_t r = rows(shape);
    // Shorter rows take a warp each.
    constexpr std::int64_t kRowsPerBlock = kNormThreads / 32;
    const std::int64_t blocks = inner_ <= KG_LN_WARP_MAX ? (r + kRowsPerBlock - 1) / kRowsPerBlock : r;
    return {static_cast<unsigned>(std::clamp<std::int64_t>(blocks, 1, kMaxBlocks)), 1, 1};
  }

  std::size_t backward_scratch_bytes(const LaunchTensors& t) const override {
    return affine_ ? static_cast<std::size_t>(KG_LN_STATS * rows(t.grad_output.shape)) * dtype_size(dtype_)
                   : 0;
  }
  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    const DevicePtr stats = affine_ ? t.scratch : 0;
    const std::int64_t r = rows(t.grad_output.shape);
    std::vector<Launch> ls(1);
    ls[0].entry = entry_for("kg_layer_norm_backward", dtype_);
    ls[0].block = block();
    ls[0].grid = grid(t.grad_output.shape);
    const DevicePtr w = affine_ ? t.params.at(0).ptr : 0;
    ls[0].args = {t.inputs.at(0), ptr(w), t.grad_output, t.grad_inputs.at(0), ptr(stats), r, inner_, eps_};
    if (affine_ && (t.grad_params.at(0).ptr || t.grad_params.at(1).ptr)) {
      Launch L;
      L.entry = entry_for("kg_layer_norm_param_backward", dtype_);
      L.block = block();
      const std::int64_t col_blocks = (inner_ + KG_LN_COLS - 1) / KG_LN_COLS;
      L.grid = {static_cast<unsigned>(std::clamp<std::int64_t>(col_blocks, 1, kMaxBlocks)), 1, 1};
      const DeviceTensor &dw = t.grad_params.at(0), &db = t.grad_params.at(1);
      L.args = {t.inputs.at(0), t.grad_output, ptr(stats), dw, db, r, inner_};
      ls.push_back(std::move(L));
    }
    return ls;
  }

 private:
  std::int64_t rows(const std::vector<std::int64_t>& shape) const { return numel_of(shape) / inner_; }
  std::vector<std::int64_t> shape_;
  std::int64_t inner_;
  double eps_;
  bool affine_;
  DType dtype_;
};

}  // namespace

// ---- nn.batch_norm2d ----

BatchNorm2dOp::BatchNorm2dOp(std::int64_t channels, double eps, double momentum, DType dtype)
    : channels_(channels), eps_(eps), momentum_(momentum), dtype_(dtype) {}

std::string BatchNorm2dOp::attributes() const { return util::cat("eps=", eps_, " momentum=", momentum_); }

Shape BatchNorm2dOp::infer_output_shape(const std::vector<Shape>& in) const {
  require_inputs(in, 1);
  const Shape& x = in[0];
  require_rank(x, 4, "[N, C, H, W]");
  if (channels_ < 0 || x[1].is_dynamic())
    throw Error(
        util::cat("needs a known channel count (dim 1) to size its parameters, got input ", x.to_string()));
  if (x[1].size() != channels_)
    throw Error(util::cat("expects C = ", channels_, " channels (dim 1), got input ", x.to_string()));
  return x;
}

DType BatchNorm2dOp::infer_output_dtype(const std::vector<DType>& in) const {
  DType t = require_float(in);
  if (t != dtype_)
    throw Error(util::cat("input is ", dtype_name(t), " but the parameters are ", dtype_name(dtype_)));
  return t;
}

std::vector<ParamSpec> BatchNorm2dOp::parameters(const std::vector<Shape>&) const {
  return {
      {"weight", {channels_}, dtype_, ParamInit::constant(1.0), true},
      {"bias", {channels_}, dtype_, ParamInit::constant(0.0), true},
      {"running_mean", {channels_}, dtype_, ParamInit::constant(0.0), false},
      {"running_var", {channels_}, dtype_, ParamInit::constant(1.0), false},
      {"num_batches_tracked", {}, DType::I64, ParamInit::constant(0.0), false},
  };
}

// One entry for both modes, selected per run (BatchNorm2dRuntime::launches).
std::optional<Lowered> BatchNorm2dOp::lower(const LowerContext&) const {
  return Lowered{"nn.batch_norm2d", kernel_file("norm.cu"), entry_for("kg_batch_norm2d", dtype_),
                 batch_norm2d_runtime(channels_, eps_, dtype_, true, momentum_)};
}

std::string BatchNorm2dOp::lower_backward_source(const LowerContext&) const {
  return kernel_file("norm_backward.cu");
}

std::shared_ptr<RuntimeOp> batch_norm2d_runtime(std::int64_t channels, double eps, DType dtype, bool training,
                                                double momentum) {
  return std::make_shared<BatchNorm2dRuntime>(channels, eps, momentum, dtype, training);
}

void BatchNorm2dOp::cpu_forward(CpuContext& ctx) const {
  const Tensor& x = ctx.inputs[0];
  const std::int64_t n = x.dim(0), c = x.dim(1), hw = x.dim(2) * x.dim(3);
  dispatch_float(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data<T>();
    const T* w = ctx.params[0].data<T>();
    const T* b = ctx.params[1].data<T>();
    T* y = ctx.output.data<T>();
    std::vector<double> mean(static_cast<std::size_t>(c)), var(static_cast<std::size_t>(c));
    if (ctx.training) {
      const std::int64_t count = n * hw;
      if (count <= 1)
        throw Error(util::cat("training mode needs more than 1 value per channel, got input ",
                              sizes_to_string(x.shape())));
      // Batch statistics per channel, two passes in double; the biased variance normalises.
      ctx.parallel_for(c, std::max<std::int64_t>(1, 16384 / std::max<std::int64_t>(count, 1)),
                       [&](std::int64_t c0, std::int64_t c1) {
                         for (std::int64_t ch = c0; ch < c1; ++ch) {
                           double s = 0;
                           for (std::int64_t i = 0; i < n; ++i) {
                             const T* p = xp + (i * c + ch) * hw;
                             for (std::int64_t j = 0; j < hw; ++j) s += p[j];
                           }
                           const double m = s / static_cast<double>(count);
                           double v = 0;
                           for (std::int64_t i = 0; i < n; ++i) {
                             const T* p = xp + (i * c + ch) * hw;
                             for (std::int64_t j = 0; j < hw; ++j) v += (p[j] - m) * (p[j] - m);
                           }
                           mean[static_cast<std::size_t>(ch)] = m;
                           var[static_cast<std::size_t>(ch)] = v / static_cast<double>(count);
                         }
                       });
      // The running statistics, as PyTorch updates them (the unbiased variance).
      Tensor running_mean = ctx.params[2], running_var = ctx.params[3], tracked = ctx.params[4];
      T* rm = running_mean.data<T>();
      T* rv = running_var.data<T>();
      const double unbias = static_cast<double>(count) / static_cast<double>(count - 1);
      for (std::int64_t ch = 0; ch < c; ++ch) {
        const auto k = static_cast<std::size_t>(ch);
        rm[ch] = static_cast<T>((1.0 - momentum_) * rm[ch] + momentum_ * mean[k]);
        rv[ch] = static_cast<T>((1.0 - momentum_) * rv[ch] + momentum_ * var[k] * unbias);
      }
      tracked.data<std::int64_t>()[0] += 1;
    } else {
      const T* rm = ctx.params[2].data<T>();
      const T* rv = ctx.params[3].data<T>();
      for (std::int64_t ch = 0; ch < c; ++ch) {
        mean[static_cast<std::size_t>(ch)] = rm[ch];
        var[static_cast<std::size_t>(ch)] = rv[ch];
      }
    }
    // y = x * scale + shift per channel.
    std::vector<T> scale(static_cast<std::size_t>(c)), shift(static_cast<std::size_t>(c));
    for (std::int64_t ch = 0; ch < c; ++ch) {
      const auto k = static_cast<std::size_t>(ch);
      const double s = static_cast<double>(w[ch]) / std::sqrt(var[k] + eps_);
      scale[k] = static_cast<T>(s);
      shift[k] = static_cast<T>(static_cast<double>(b[ch]) - mean[k] * s);
    }
    ctx.parallel_for(n * c, std::max<std::int64_t>(1, 32768 / std::max<std::int64_t>(hw, 1)),
                     [&](std::int64_t p0, std::int64_t p1) {
                       for (std::int64_t p = p0; p < p1; ++p) {
                         const auto k = static_cast<std::size_t>(p % c);
                         const T sc = scale[k], sh = shift[k];
                         const T* src = xp + p * hw;
                         T* dst = y + p * hw;
                         for (std::int64_t j = 0; j < hw; ++j) dst[j] = src[j] * sc + sh;
                       }
                     });
  });
}

void BatchNorm2dOp::cpu_backward(CpuBackwardContext& ctx) const {
  const Tensor& x = ctx.inputs[0];
  const std::int64_t n = x.dim(0), c = x.dim(1), hw = x.dim(2) * x.dim(3), count = n * hw;
  if (ctx.training && count <= 1)
    throw Error(util::cat("training mode needs more than 1 value per channel, got input ",
                          sizes_to_string(x.shape())));
  const bool want_dx = ctx.wants_input_grad(0), want_dw = ctx.wants_param_grad(0),
             want_db = ctx.wants_param_grad(1);
  dispatch_float(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data<T>();
    const T* dy = ctx.grad_output.data<T>();
    const T* w = ctx.params[0].data<T>();
    const T* rm = ctx.params[2].data<T>();
    const T* rv = ctx.params[3].data<T>();
    T* dx = want_dx ? ctx.grad_inputs[0].data<T>() : nullptr;
    T* dw = want_dw ? ctx.grad_params[0].data<T>() : nullptr;
    T* db = want_db ? ctx.grad_params[1].data<T>() : nullptr;
    // Per channel, sums in double: db = Σ dy, dw = Σ dy x̂; in training
    // dx = w r (dy - db / M - x̂ dw / M) with r = 1 / sqrt(var + eps), else dx = w r dy.
    ctx.parallel_for(c, std::max<std::int64_t>(1, 16384 / std::max<std::int64_t>(count, 1)),
                     [&](std::int64_t c0, std::int64_t c1) {
                       for (std::int64_t ch = c0; ch < c1; ++ch) {
                         double mean = 0, r = 0;
                         if (ctx.training) {
                           double s = 0;
                           for (std::int64_t i = 0; i < n; ++i) {
                             const T* p = xp + (i * c + ch) * hw;
                             for (std::int64_t j = 0; j < hw; ++j) s += p[j];
                           }
                           mean = s / static_cast<double>(count);
                           double v = 0;
                           for (std::int64_t i = 0; i < n; ++i) {
                             const T* p = xp + (i * c + ch) * hw;
                             for (std::int64_t j = 0; j < hw; ++j) v += (p[j] - mean) * (p[j] - mean);
                           }
                           r = 1.0 / std::sqrt(v / static_cast<double>(count) + eps_);
                         } else {
                           mean = rm[ch];
                           r = 1.0 / std::sqrt(static_cast<double>(rv[ch]) + eps_);
                         }
                         double sdy = 0, sdyx = 0;
                         for (std::int64_t i = 0; i < n; ++i) {
                           const T* p = xp + (i * c + ch) * hw;
                           const T* g = dy + (i * c + ch) * hw;
                           for (std::int64_t j = 0; j < hw; ++j) {
                             sdy += g[j];
                             sdyx += g[j] * (p[j] - mean);
                           }
                         }
                         sdyx *= r;
                         if (db) db[ch] = static_cast<T>(sdy);
                         if (dw) dw[ch] = static_cast<T>(sdyx);
                         if (!dx) continue;
                         const double a = static_cast<double>(w[ch]) * r;
                         const double mdy = ctx.training ? sdy / static_cast<double>(count) : 0.0;
                         const double mdyx = ctx.training ? sdyx / static_cast<double>(count) : 0.0;
                         for (std::int64_t i = 0; i < n; ++i) {
                           const T* p = xp + (i * c + ch) * hw;
                           const T* g = dy + (i * c + ch) * hw;
                           T* d = dx + (i * c + ch) * hw;
                           for (std::int64_t j = 0; j < hw; ++j)
                             d[j] = static_cast<T>(a * (g[j] - mdy - (p[j] - mean) * r * mdyx));
                         }
                       }
                     });
  });
}

double batch_norm_eps(const CustomOp& op) {
  const auto* bn = dynamic_cast<const BatchNorm2dOp*>(&op);
  if (!bn) throw Error(util::cat("batch_norm_eps: op ", op.name(), " is not nn.batch_norm2d"));
  return bn->eps();
}

// ---- nn.layer_norm ----

namespace {

class LayerNormOp final : public CustomOp, public PrologueReduction {
 public:
  LayerNormOp(std::vector<std::int64_t> normalized_shape, double eps, bool affine, DType dtype)
      : shape_(std::move(normalized_shape)), eps_(eps), affine_(affine), dtype_(dtype) {}
  std::string name() const override { return "nn.layer_norm"; }
  std::string attributes() const override {
    return util::cat("normalized_shape=", sizes_to_string(shape_), " eps=", eps_,
                     affine_ ? "" : " elementwise_affine=false");
  }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    const Shape& x = in[0];
    if (shape_.empty()) throw Error("normalized_shape must have at least one dim, got []");
    for (auto s : shape_)
      if (s <= 0)
        throw Error(util::cat("normalized_shape ", sizes_to_string(shape_), " must have positive sizes"));
    if (x.rank() < shape_.size())
      throw Error(util::cat("normalized_shape ", sizes_to_string(shape_), " has ", shape_.size(),
                            " dims but the input ", x.to_string(), " has rank ", x.rank()));
    const std::size_t off = x.rank() - shape_.size();
    for (std::size_t i = 0; i < shape_.size(); ++i) {
      const Dim& d = x[off + i];
      // A dynamic trailing dim is checked again at load, when it is known.
      if (d.is_static() && d.size() != shape_[i])
        throw Error(util::cat("normalized_shape ", sizes_to_string(shape_),
                              " does not match the trailing dims of input ", x.to_string(), " (dim ", off + i,
                              " is ", d.size(), ", expected ", shape_[i], ")"));
    }
    return x;
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override {
    DType t = require_float(in);
    if (affine_ && t != dtype_)
      throw Error(util::cat("input is ", dtype_name(t), " but the parameters are ", dtype_name(dtype_)));
    return t;
  }

  std::vector<ParamSpec> parameters(const std::vector<Shape>&) const override {
    if (!affine_) return {};
    return {{"weight", shape_, dtype_, ParamInit::constant(1.0), true},
            {"bias", shape_, dtype_, ParamInit::constant(0.0), true}};
  }

  std::optional<Lowered> lower(const LowerContext&) const override {
    return Lowered{"nn.layer_norm", kernel_file("norm.cu"), entry_for("kg_layer_norm", dtype_),
                   std::make_shared<LayerNormRuntime>(shape_, eps_, affine_, dtype_)};
  }
  std::string lower_backward_source(const LowerContext&) const override {
    return kernel_file("norm_backward.cu");
  }

  // A folded prologue (ops/fused_reduction): the same kernel body and runtime, the input read
  // through the prologue's loader.
  bool takes_prologue(DType t) const override { return t == DType::F32 || t == DType::F64; }
  std::optional<Lowered> lower_with_prologue(const LowerContext& ctx, const PrologueCode& code) const override {
    if (!takes_prologue(ctx.output_dtype) || (affine_ && ctx.output_dtype != dtype_)) return std::nullopt;
    const char* t = device_type(ctx.output_dtype);
    std::string src = util::cat(code.head, without_entries(kernel_file("norm.cu")), "\n", code.source,
                                "\nextern \"C\" __global__ void __launch_bounds__(KG_NORM_THREADS)\n    ",
                                code.entry, "(", code.params, ", const ", t, "* __restrict__ w, const ", t,
                                "* __restrict__ b, ", t,
                                "* __restrict__ y, long long rows, long long inner, double eps) {\n  kg_layer_norm<",
                                t, ">(", code.loader, ", w, b, y, rows, inner, eps);\n}\n");
    return Lowered{"nn.layer_norm", std::move(src), code.entry,
                   std::make_shared<LayerNormRuntime>(shape_, eps_, affine_, ctx.output_dtype)};
  }

  bool has_cpu_backward() const override { return true; }
  // Reads the input (the statistics are computed again), not the output.
  BackwardSaves backward_saves() const override { return {true, false}; }
  // With x̂ = (x - mean) / sqrt(var + eps) per row and g = dy w (dy without affine):
  // dx = (g - mean(g) - x̂ mean(g x̂)) / sqrt(var + eps), dw = Σ_rows dy x̂, db = Σ_rows dy.
  void cpu_backward(CpuBackwardContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    const std::int64_t inner = numel_of(shape_);
    const std::int64_t rows = x.numel() / inner;
    const bool want_dx = ctx.wants_input_grad(0);
    const bool want_dw = affine_ && ctx.wants_param_grad(0), want_db = affine_ && ctx.wants_param_grad(1);
    dispatch_float(x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data<T>();
      const T* dy = ctx.grad_output.data<T>();
      const T* w = affine_ ? ctx.params[0].data<T>() : nullptr;
      std::vector<double> mean(static_cast<std::size_t>(rows)), rstd(static_cast<std::size_t>(rows));
      ctx.parallel_for(rows, std::max<std::int64_t>(1, 16384 / inner), [&](std::int64_t r0, std::int64_t r1) {
        for (std::int64_t r = r0; r < r1; ++r) {
          const T* src = xp + r * inner;
          const T* g0 = dy + r * inner;
          double s = 0;
          for (std::int64_t j = 0; j < inner; ++j) s += src[j];
          const double m = s / static_cast<double>(inner);
          double v = 0;
          for (std::int64_t j = 0; j < inner; ++j) v += (src[j] - m) * (src[j] - m);
          const double iv = 1.0 / std::sqrt(v / static_cast<double>(inner) + eps_);
          mean[static_cast<std::size_t>(r)] = m;
          rstd[static_cast<std::size_t>(r)] = iv;
          if (!want_dx) continue;
          double sg = 0, sgx = 0;
          for (std::int64_t j = 0; j < inner; ++j) {
            const double g = w ? static_cast<double>(g0[j]) * w[j] : static_cast<double>(g0[j]);
            sg += g;
            sgx += g * ((src[j] - m) * iv);
          }
          const double mg = sg / static_cast<double>(inner), mgx = sgx / static_cast<double>(inner);
          T* dx = ctx.grad_inputs[0].data<T>() + r * inner;
          for (std::int64_t j = 0; j < inner; ++j) {
            const double g = w ? static_cast<double>(g0[j]) * w[j] : static_cast<double>(g0[j]);
            dx[j] = static_cast<T>(iv * (g - mg - ((src[j] - m) * iv) * mgx));
          }
        }
      });
      if (!want_dw && !want_db) return;
      // Per column over the rows: blocks of adjacent columns, each summed in row order.
      T* dw = want_dw ? ctx.grad_params[0].data<T>() : nullptr;
      T* db = want_db ? ctx.grad_params[1].data<T>() : nullptr;
      constexpr std::int64_t kBlock = 256;
      const std::int64_t blocks = (inner + kBlock - 1) / kBlock;
      ctx.parallel_for(blocks, std::max<std::int64_t>(1, 16384 / std::max<std::int64_t>(1, rows * kBlock)),
                       [&](std::int64_t b0, std::int64_t b1) {
                         std::vector<double> sw(kBlock), sb(kBlock);
                         for (std::int64_t b = b0; b < b1; ++b) {
                           const std::int64_t j0 = b * kBlock, n = std::min(kBlock, inner - j0);
                           std::fill(sw.begin(), sw.end(), 0.0);
                           std::fill(sb.begin(), sb.end(), 0.0);
                           for (std::int64_t r = 0; r < rows; ++r) {
                             const T* src = xp + r * inner + j0;
                             const T* g = dy + r * inner + j0;
                             const double m = mean[static_cast<std::size_t>(r)],
                                          iv = rstd[static_cast<std::size_t>(r)];
                             for (std::int64_t j = 0; j < n; ++j) {
                               sb[static_cast<std::size_t>(j)] += g[j];
                               sw[static_cast<std::size_t>(j)] += g[j] * ((src[j] - m) * iv);
                             }
                           }
                           for (std::int64_t j = 0; j < n; ++j) {
                             if (dw) dw[j0 + j] = static_cast<T>(sw[static_cast<std::size_t>(j)]);
                             if (db) db[j0 + j] = static_cast<T>(sb[static_cast<std::size_t>(j)]);
                           }
                         }
                       });
    });
  }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    const std::int64_t inner = numel_of(shape_);
    const std::int64_t rows = x.numel() / inner;
    dispatch_float(x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data<T>();
      const T* w = affine_ ? ctx.params[0].data<T>() : nullptr;
      const T* b = affine_ ? ctx.params[1].data<T>() : nullptr;
      T* y = ctx.output.data<T>();
      ctx.parallel_for(rows, std::max<std::int64_t>(1, 16384 / inner), [&](std::int64_t r0, std::int64_t r1) {
        for (std::int64_t r = r0; r < r1; ++r) {
          const T* src = xp + r * inner;
          T* dst = y + r * inner;
          double s = 0;
          for (std::int64_t j = 0; j < inner; ++j) s += src[j];
          const double mean = s / static_cast<double>(inner);
          double v = 0;
          for (std::int64_t j = 0; j < inner; ++j) v += (src[j] - mean) * (src[j] - mean);
          const double inv = 1.0 / std::sqrt(v / static_cast<double>(inner) + eps_);
          const T m = static_cast<T>(mean), iv = static_cast<T>(inv);
          if (affine_) {
            for (std::int64_t j = 0; j < inner; ++j) dst[j] = (src[j] - m) * iv * w[j] + b[j];
          } else {
            for (std::int64_t j = 0; j < inner; ++j) dst[j] = (src[j] - m) * iv;
          }
        }
      });
    });
  }

 private:
  std::vector<std::int64_t> shape_;
  double eps_;
  bool affine_;
  DType dtype_;
};

}  // namespace
}  // namespace kg::ops

namespace kg::nn {

SymTensor batch_norm2d(const SymTensor& x, const std::string& name, double eps, double momentum) {
  if (!(eps >= 0)) throw Error(util::cat("[nn.batch_norm2d] eps must be non-negative, got ", eps));
  const Shape& s = x.shape();
  // An unknown channel count or a wrong rank is reported by the op with its node's name.
  const std::int64_t channels = s.rank() == 4 && s[1].is_static() ? s[1].size() : -1;
  return x.record_custom(CustomData::make<ops::BatchNorm2dOp>(channels, eps, momentum, x.dtype()), {},
                         std::nullopt, name);
}

SymTensor layer_norm(const SymTensor& x, const std::vector<std::int64_t>& normalized_shape,
                     const std::string& name, double eps, bool elementwise_affine) {
  if (!(eps >= 0)) throw Error(util::cat("[nn.layer_norm] eps must be non-negative, got ", eps));
  return x.record_custom(
      CustomData::make<ops::LayerNormOp>(normalized_shape, eps, elementwise_affine, x.dtype()), {},
      std::nullopt, name);
}

}  // namespace kg::nn
