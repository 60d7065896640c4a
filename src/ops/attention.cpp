// nn.attention: scaled dot-product attention, out = softmax(scale · q kᵀ + mask) v over the keys,
// for q [batch..., Sq, D], k [batch..., Sk, D], v [batch..., Sk, Dv] → [batch..., Sq, Dv] (the
// batch dims, heads included, the same for all three). The mask is optional: additive (q's dtype)
// or bool (true = keep), either broadcastable to [batch..., Sq, Sk]; `causal` masks key j > query
// i (top-left aligned, as PyTorch's is_causal). The scale defaults to 1 / sqrt(D). A query row
// whose every key is masked (all -inf) gives zeros, as PyTorch's math path does since 2.5 (its
// older releases gave NaN).
//
// CPU: per (batch entry, block of query rows) the scores by one GEMM, the mask and a softmax per
// row (sums in double), the output by a second GEMM. GPU: attention.cu's online-softmax kernel.
// f16 and bf16 compute in f32 (inputs widened, output rounded once). Backward: on the CPU
// (f32, f64), by recomputing the probabilities.
#include "ops/attention.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <vector>

#include "kg/ops.hpp"
#include "ops/attention_shared.cuh"
#include "ops/blas.hpp"
#include "ops/gpu_util.hpp"
#include "ops/op_util.hpp"

namespace kg::ops {
namespace {

using Mask = AttentionSpec::Mask;

// True unless both dims are known and differ (dynamic ones are compared again at load).
bool dims_agree(const Dim& a, const Dim& b) { return !(a.is_static() && b.is_static() && a.size() != b.size()); }

// The concrete layout of one call: sizes, the mask's strides, the scale.
struct Layout {
  std::int64_t bh = 1, sq = 0, sk = 0, d = 0, dv = 0;
  std::vector<std::int64_t> size, mask_stride;  // batch dims of size > 1, outermost first
  std::int64_t mask_sq = 0, mask_sk = 0;
  double scale = 1;

  // The mask's element offset of batch entry b.
  std::int64_t mask_offset(std::int64_t b) const {
    std::int64_t off = 0;
    for (std::size_t l = size.size(); l-- > 0;) {
      off += (b % size[l]) * mask_stride[l];
      b /= size[l];
    }
    return off;
  }
};

Layout layout_of(const std::vector<std::int64_t>& q, const std::vector<std::int64_t>& k,
                 const std::vector<std::int64_t>& v, const std::vector<std::int64_t>* mask,
                 std::optional<double> scale) {
  Layout L;
  const std::size_t r = q.size();
  L.sq = q[r - 2];
  L.d = q[r - 1];
  L.sk = k[r - 2];
  L.dv = v[r - 1];
  L.scale = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(std::max<std::int64_t>(L.d, 1)));
  // The mask right-aligned with the scores [batch..., Sq, Sk]; contiguous strides, 0 where broadcast.
  std::vector<std::int64_t> m(r, 1), ms(r, 0);
  if (mask) {
    for (std::size_t i = 0; i < mask->size(); ++i) m[r - mask->size() + i] = (*mask)[i];
    std::int64_t step = 1;
    for (std::size_t i = r; i-- > 0;) {
      ms[i] = m[i] == 1 ? 0 : step;
      step *= m[i];
    }
  }
  for (std::size_t i = 0; i + 2 < r; ++i) {
    L.bh *= q[i];
    if (q[i] == 1) continue;
    L.size.push_back(q[i]);
    L.mask_stride.push_back(ms[i]);
  }
  L.mask_sq = ms[r - 2];
  L.mask_sk = ms[r - 1];
  return L;
}

class AttentionRuntime final : public RuntimeOp {
 public:
  AttentionRuntime(AttentionSpec spec, DType dtype) : spec_(spec), dtype_(dtype), entry_(entry_for("kg_attention", dtype)) {}

  KgAttnArgs args(const LaunchTensors& t) const {
    const std::vector<std::int64_t>* mask = spec_.mask == Mask::None ? nullptr : &t.inputs.at(3).shape;
    const Layout L = layout_of(t.inputs.at(0).shape, t.inputs.at(1).shape, t.inputs.at(2).shape, mask, spec_.scale);
    if (L.size.size() > KG_ATTN_MAX_LEVELS)
      throw Error(util::cat("nn.attention: q ", sizes_to_string(t.inputs[0].shape), " has ", L.size.size(),
                            " batch dims of size above 1; the GPU kernel takes ", KG_ATTN_MAX_LEVELS));
    KgAttnArgs a{};
    a.bh = L.bh;
    a.sq = L.sq;
    a.sk = L.sk;
    a.d = L.d;
    a.dv = L.dv;
    a.mask_kind = spec_.mask == Mask::Additive ? KG_ATTN_MASK_ADD : spec_.mask == Mask::Bool ? KG_ATTN_MASK_BOOL
                                                                                           : KG_ATTN_MASK_NONE;
    a.causal = spec_.causal ? 1 : 0;
    a.levels = std::ssize(L.size);
    for (std::size_t l = 0; l < L.size.size(); ++l) {
      a.size[l] = L.size[l];
      a.mask_stride[l] = L.mask_stride[l];
    }
    a.mask_sq = L.mask_sq;
    a.mask_sk = L.mask_sk;
    a.scale = L.scale;
    return a;
  }

  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    const KgAttnArgs a = args(t);
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.inputs[1].ptr);
    v.pointer(t.inputs[2].ptr);
    v.pointer(spec_.mask == Mask::None ? 0 : t.inputs[3].ptr);
    v.pointer(t.output.ptr);
    v.bytes(&a, sizeof a);
  }
  Dim3 block() const override { return {KG_ATTN_THREADS, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>& out) const override {
    std::int64_t bh = 1;
    for (std::size_t i = 0; i + 2 < out.size(); ++i) bh *= out[i];
    const std::int64_t rows = rows_per_block();
    const std::int64_t blocks = bh * tiles_of(out[out.size() - 2], rows);
    // The kernel loops over further blocks.
    return {static_cast<unsigned>(std::clamp<std::int64_t>(blocks, 1, 65535LL * 32)), 1, 1};
  }

  // ---- backward (attention_backward.cu, f32 and f64): row statistics, dq, then dk and dv ----
  std::size_t backward_scratch_bytes(const LaunchTensors& t) const override {
    std::int64_t rows = 1;
    for (std::size_t i = 0; i + 1 < t.inputs.at(0).shape.size(); ++i) rows *= t.inputs[0].shape[i];
    return static_cast<std::size_t>(2 * rows) * dtype_size(dtype_);
  }
  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    if (dtype_ != DType::F32 && dtype_ != DType::F64)
      throw Error(util::cat("nn.attention: the backward takes f32 and f64, not ", dtype_name(dtype_)));
    const KgAttnArgs a = args(t);
    const DevicePtr mask = spec_.mask == Mask::None ? 0 : t.inputs[3].ptr;
    DevicePtr dmask = 0;
    if (spec_.mask == Mask::Additive && t.grad_inputs.at(3).ptr) {
      if (t.grad_inputs[3].numel() != a.bh * a.sq * a.sk)
        throw Error(util::cat("nn.attention: the GPU backward gives the additive mask's gradient only for a mask of "
                              "the scores' full shape; the mask is ", sizes_to_string(t.grad_inputs[3].shape)));
      dmask = t.grad_inputs[3].ptr;
    }
    auto ptr_of = [](const DeviceTensor& d) { return kg::ptr(d.ptr); };
    const Dim3 block{KG_ATTN_THREADS, 1, 1};
    const std::int64_t warps = KG_ATTN_THREADS / 32;
    const Dim3 rows = grid_1d(a.bh * a.sq, static_cast<unsigned>(warps));
    const Dim3 keys = grid_1d(a.bh * a.sk, static_cast<unsigned>(warps));
    const KernelArg bytes = raw_bytes(&a, sizeof a);
    std::vector<Launch> ls;
    ls.push_back({entry_for("kg_attention_bwd_rows", dtype_), rows, block, 0,
                  {t.inputs[0], t.inputs[1], kg::ptr(mask), t.output, t.grad_output, kg::ptr(t.scratch), bytes}});
    ls.push_back({entry_for("kg_attention_bwd_dq", dtype_), rows, block, 0,
                  {t.inputs[0], t.inputs[1], t.inputs[2], kg::ptr(mask), t.grad_output, kg::ptr(t.scratch),
                   ptr_of(t.grad_inputs.at(0)), kg::ptr(dmask), bytes}});
    ls.push_back({entry_for("kg_attention_bwd_dkv", dtype_), keys, block, 0,
                  {t.inputs[0], t.inputs[1], t.inputs[2], kg::ptr(mask), t.grad_output, kg::ptr(t.scratch),
                   ptr_of(t.grad_inputs.at(1)), ptr_of(t.grad_inputs.at(2)), bytes}});
    return ls;
  }

 private:
  std::int64_t rows_per_block() const {
    return KG_ATTN_WARPS * (dtype_ == DType::F64 ? KG_ATTN_ROWS_PER_WARP_F64 : KG_ATTN_ROWS_PER_WARP);
  }
  AttentionSpec spec_;
  DType dtype_;
  std::string entry_;
};

class AttentionOp final : public CustomOp {
 public:
  explicit AttentionOp(AttentionSpec spec) : spec_(spec) {
    if (spec_.scale && !std::isfinite(*spec_.scale))
      throw Error(util::cat("nn.attention: the scale must be finite, got ", *spec_.scale));
  }
  const AttentionSpec& spec() const { return spec_; }
  std::string name() const override { return "nn.attention"; }
  std::string attributes() const override {
    std::string s = util::cat("mask=", spec_.mask == Mask::None       ? "none"
                                       : spec_.mask == Mask::Additive ? "additive"
                                                                      : "bool");
    if (spec_.causal) s += " causal";
    if (spec_.scale) {  // the shortest text that reads back exactly
      char buf[32];
      const auto r = std::to_chars(buf, buf + sizeof buf, *spec_.scale);
      s += " scale=" + std::string(buf, r.ptr);
    } else {
      s += " scale=1/sqrt(D)";
    }
    return s;
  }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, spec_.mask == Mask::None ? 3 : 4);
    const Shape &q = in[0], &k = in[1], &v = in[2];
    const std::string shapes =
        util::cat("q ", q.to_string(), ", k ", k.to_string(), ", v ", v.to_string());
    if (q.rank() < 2 || k.rank() != q.rank() || v.rank() != q.rank())
      throw Error(util::cat("q, k and v must have one rank of at least 2 ([batch..., S, D]); got ", shapes));
    const std::size_t r = q.rank();
    for (std::size_t i = 0; i + 2 < r; ++i)
      if (!dims_agree(q[i], k[i]) || !dims_agree(q[i], v[i]))
        throw Error(util::cat("q, k and v must have the same batch dims (every dim before the last two); dim ", i,
                              " differs: ", shapes));
    if (!dims_agree(q[r - 1], k[r - 1]))
      throw Error(util::cat("q and k must have the same last dim D; got ", shapes));
    if (!dims_agree(k[r - 2], v[r - 2]))
      throw Error(util::cat("k and v must have the same number of keys (dim -2); got ", shapes));
    Shape out;
    for (std::size_t i = 0; i + 2 < r; ++i) out.push_back(q[i]);
    out.push_back(q[r - 2]);
    out.push_back(v[r - 1]);
    if (spec_.mask != Mask::None) {
      Shape scores = out;
      scores[r - 1] = k[r - 2];
      const Shape& m = in[3];
      bool ok = m.rank() <= r;
      for (std::size_t i = 0; ok && i < m.rank(); ++i) {
        const Dim& md = m[i];
        const Dim& sd = scores[r - m.rank() + i];
        ok = (md.is_static() && md.size() == 1) || dims_agree(md, sd);
      }
      if (!ok)
        throw Error(util::cat("the mask ", m.to_string(), " does not broadcast to the scores [batch..., Sq, Sk] = ",
                              scores.to_string(), " (", shapes, ")"));
    }
    return out;
  }

  DType infer_output_dtype(const std::vector<DType>& in) const override {
    if (in.size() < 3) throw Error(util::cat("expects q, k and v, got ", in.size(), " input(s)"));
    const DType t = require_float_or_half({in[0], in[1], in[2]});
    if (spec_.mask == Mask::Bool && in.at(3) != DType::Bool)
      throw Error(util::cat("a boolean mask must be bool, got ", dtype_name(in[3])));
    if (spec_.mask == Mask::Additive && in.at(3) != t)
      throw Error(util::cat("an additive mask must have q's dtype ", dtype_name(t), ", got ", dtype_name(in[3])));
    return t;
  }
  bool computes_in(DType t) const override { return is_half_float(t); }

  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    // Head sizes past the kernel's shared-memory tiles have no GPU form.
    const auto& shapes = ctx.concrete_input_shapes;
    if (shapes.size() >= 3 && (shapes[0].back() > KG_ATTN_MAX_HEAD || shapes[2].back() > KG_ATTN_MAX_HEAD))
      return std::nullopt;
    return Lowered{name(), kernel_file("attention.cu"), entry_for("kg_attention", ctx.output_dtype),
                   std::make_shared<AttentionRuntime>(spec_, ctx.output_dtype)};
  }
  // f32 and f64 (the 16-bit forms are for inference).
  std::string lower_backward_source(const LowerContext& ctx) const override {
    const DType t = ctx.output_dtype;
    return t == DType::F32 || t == DType::F64 ? kernel_file("attention_backward.cu") : std::string();
  }
  // The GPU backward reads the output (Σ dO·O per row); the CPU one recomputes it.
  BackwardSaves backward_saves() const override { return {true, true}; }

  void cpu_forward(CpuContext& ctx) const override {
    if (is_half_float(ctx.output.dtype())) return cpu_forward_in_f32(ctx, [&](CpuContext& c) { cpu_forward(c); });
    const Tensor &q = ctx.inputs[0], &k = ctx.inputs[1], &v = ctx.inputs[2];
    const Tensor* mask = spec_.mask == Mask::None ? nullptr : &ctx.inputs[3];
    const std::vector<std::int64_t> ms = mask ? mask->shape() : std::vector<std::int64_t>{};
    const Layout L = layout_of(q.shape(), k.shape(), v.shape(), mask ? &ms : nullptr, spec_.scale);
    if (L.bh * L.sq * L.dv == 0) return;
    dispatch_float(ctx.output.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* qp = q.data<T>();
      const T* kp = k.data<T>();
      const T* vp = v.data<T>();
      T* op = ctx.output.data<T>();
      // Query rows in blocks, so that the scores of a block stay small.
      const std::int64_t rows = std::max<std::int64_t>(1, std::min<std::int64_t>(L.sq, 16384 / std::max<std::int64_t>(L.sk, 1)));
      const std::int64_t blocks = tiles_of(L.sq, rows);
      const std::int64_t work = rows * std::max<std::int64_t>(L.sk, 1) * (L.d + L.dv);
      ctx.parallel_for(L.bh * blocks, std::max<std::int64_t>(1, 65536 / std::max<std::int64_t>(work, 1)),
                       [&](std::int64_t t0, std::int64_t t1) {
                         std::vector<T> s(static_cast<std::size_t>(rows * L.sk));
                         for (std::int64_t t = t0; t < t1; ++t) {
                           const std::int64_t b = t / blocks, i0 = (t % blocks) * rows;
                           const std::int64_t n = std::min(rows, L.sq - i0);
                           block_forward<T>(L, b, i0, n, qp, kp, vp, mask, op, s.data());
                         }
                       });
    });
  }

  bool has_cpu_backward() const override { return true; }
  // dq, dk, dv (and an additive mask's gradient) by recomputing the probabilities, in double.
  void cpu_backward(CpuBackwardContext& ctx) const override {
    const Tensor &q = ctx.inputs[0], &k = ctx.inputs[1], &v = ctx.inputs[2];
    const Tensor* mask = spec_.mask == Mask::None ? nullptr : &ctx.inputs[3];
    const std::vector<std::int64_t> ms = mask ? mask->shape() : std::vector<std::int64_t>{};
    const Layout L = layout_of(q.shape(), k.shape(), v.shape(), mask ? &ms : nullptr, spec_.scale);
    const bool want_mask = spec_.mask == Mask::Additive && ctx.wants_input_grad(3);
    dispatch_float(ctx.grad_output.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* qp = q.data<T>();
      const T* kp = k.data<T>();
      const T* vp = v.data<T>();
      const T* dop = ctx.grad_output.data<T>();
      T* dq = ctx.wants_input_grad(0) ? ctx.grad_inputs[0].data<T>() : nullptr;
      T* dk = ctx.wants_input_grad(1) ? ctx.grad_inputs[1].data<T>() : nullptr;
      T* dv = ctx.wants_input_grad(2) ? ctx.grad_inputs[2].data<T>() : nullptr;
      // The scores' gradient over the whole [batch..., Sq, Sk], summed into the mask's shape after.
      std::vector<T> ds_all(want_mask ? static_cast<std::size_t>(L.bh * L.sq * L.sk) : 0);
      ctx.parallel_for(L.bh, 1, [&](std::int64_t b0, std::int64_t b1) {
        std::vector<double> p(static_cast<std::size_t>(L.sk)), dp(static_cast<std::size_t>(L.sk));
        std::vector<double> gk(static_cast<std::size_t>(L.sk * L.d)), gv(static_cast<std::size_t>(L.sk * L.dv));
        for (std::int64_t b = b0; b < b1; ++b) {
          const T* qb = qp + b * L.sq * L.d;
          const T* kb = kp + b * L.sk * L.d;
          const T* vb = vp + b * L.sk * L.dv;
          const T* dob = dop + b * L.sq * L.dv;
          std::fill(gk.begin(), gk.end(), 0.0);
          std::fill(gv.begin(), gv.end(), 0.0);
          for (std::int64_t i = 0; i < L.sq; ++i) {
            const bool any = probabilities<T>(L, b, i, qb, kb, mask, p.data());
            const T* doi = dob + i * L.dv;
            double di = 0;  // Σ_j p_j dp_j
            for (std::int64_t j = 0; j < L.sk; ++j) {
              double s = 0;
              if (any && p[j] != 0)
                for (std::int64_t c = 0; c < L.dv; ++c) s += static_cast<double>(doi[c]) * vb[j * L.dv + c];
              dp[j] = s;
              di += p[j] * s;
            }
            double* dqi = nullptr;
            std::vector<double> gq;
            if (dq) {
              gq.assign(static_cast<std::size_t>(L.d), 0.0);
              dqi = gq.data();
            }
            for (std::int64_t j = 0; j < L.sk; ++j) {
              const double ds = p[j] * (dp[j] - di);  // d loss / d (scaled score + mask)
              if (want_mask) ds_all[static_cast<std::size_t>((b * L.sq + i) * L.sk + j)] = static_cast<T>(ds);
              if (p[j] == 0) continue;
              for (std::int64_t c = 0; c < L.dv; ++c) gv[j * L.dv + c] += p[j] * doi[c];
              const double g = ds * L.scale;
              for (std::int64_t c = 0; c < L.d; ++c) {
                if (dqi) dqi[c] += g * kb[j * L.d + c];
                gk[j * L.d + c] += g * qb[i * L.d + c];
              }
            }
            if (dq)
              for (std::int64_t c = 0; c < L.d; ++c) dq[(b * L.sq + i) * L.d + c] = static_cast<T>(gq[c]);
          }
          if (dk)
            for (std::int64_t e = 0; e < L.sk * L.d; ++e) dk[b * L.sk * L.d + e] = static_cast<T>(gk[e]);
          if (dv)
            for (std::int64_t e = 0; e < L.sk * L.dv; ++e) dv[b * L.sk * L.dv + e] = static_cast<T>(gv[e]);
        }
      });
      if (want_mask) {
        std::vector<std::int64_t> full(q.shape().begin(), q.shape().end() - 2);
        full.push_back(L.sq);
        full.push_back(L.sk);
        sum_to_shape<T>(ctx, ds_all.data(), full, ms, ctx.grad_inputs[3].data<T>());
      }
    });
  }

 private:
  // True when key j is masked for query i of batch entry b by the causal flag or a bool mask; the
  // additive mask's value otherwise goes into `add`.
  template <class T>
  bool masked(const Layout& L, std::int64_t moff, std::int64_t i, std::int64_t j, const void* mask,
              double& add) const {
    add = 0;
    if (spec_.causal && j > i) return true;
    if (!mask) return false;
    const std::int64_t at = moff + i * L.mask_sq + j * L.mask_sk;
    if (spec_.mask == Mask::Bool) return static_cast<const unsigned char*>(mask)[at] == 0;
    add = static_cast<double>(static_cast<const T*>(mask)[at]);
    return false;
  }

  // Row i's probabilities over the keys (double); false when every key is masked (p all 0).
  template <class T>
  bool probabilities(const Layout& L, std::int64_t b, std::int64_t i, const T* qb, const T* kb, const Tensor* mask,
                     double* p) const {
    const std::int64_t moff = L.mask_offset(b);
    const void* mraw = mask ? mask->raw() : nullptr;
    double mx = -std::numeric_limits<double>::infinity();
    for (std::int64_t j = 0; j < L.sk; ++j) {
      double add;
      if (masked<T>(L, moff, i, j, mraw, add)) {
        p[j] = -std::numeric_limits<double>::infinity();
        continue;
      }
      double s = 0;
      for (std::int64_t c = 0; c < L.d; ++c) s += static_cast<double>(qb[i * L.d + c]) * kb[j * L.d + c];
      p[j] = s * L.scale + add;
      mx = std::max(mx, p[j]);
    }
    if (mx == -std::numeric_limits<double>::infinity()) {
      std::fill(p, p + L.sk, 0.0);
      return false;
    }
    double sum = 0;
    for (std::int64_t j = 0; j < L.sk; ++j) sum += (p[j] = std::exp(p[j] - mx));
    for (std::int64_t j = 0; j < L.sk; ++j) p[j] /= sum;
    return true;
  }

  // Rows i0 .. i0+n of batch entry b: scores S = scale · q kᵀ by one GEMM into s [n, Sk], the mask
  // and a softmax per row, then out = S v by a second GEMM.
  template <class T>
  void block_forward(const Layout& L, std::int64_t b, std::int64_t i0, std::int64_t n, const T* qp, const T* kp,
                     const T* vp, const Tensor* mask, T* op, T* s) const {
    const T* qb = qp + (b * L.sq + i0) * L.d;
    const T* kb = kp + b * L.sk * L.d;
    const T* vb = vp + b * L.sk * L.dv;
    T* ob = op + (b * L.sq + i0) * L.dv;
    if (L.sk == 0) {
      std::fill(ob, ob + n * L.dv, T(0));
      return;
    }
    if (L.d > 0)
      gemm(false, true, n, L.sk, L.d, static_cast<T>(L.scale), qb, L.d, kb, L.d, T(0), s, L.sk);
    else
      std::fill(s, s + n * L.sk, T(0));
    const std::int64_t moff = L.mask_offset(b);
    const void* mraw = mask ? mask->raw() : nullptr;
    const T neg_inf = -std::numeric_limits<T>::infinity();
    for (std::int64_t r = 0; r < n; ++r) {
      const std::int64_t i = i0 + r;
      T* row = s + r * L.sk;
      T mx = neg_inf;
      for (std::int64_t j = 0; j < L.sk; ++j) {
        double add;
        if (masked<T>(L, moff, i, j, mraw, add))
          row[j] = neg_inf;
        else
          row[j] += static_cast<T>(add);
        mx = std::max(mx, row[j]);
      }
      if (mx == neg_inf) {  // every key masked: zeros
        std::fill(row, row + L.sk, T(0));
        continue;
      }
      double sum = 0;
      for (std::int64_t j = 0; j < L.sk; ++j) sum += (row[j] = std::exp(row[j] - mx));
      const T inv = static_cast<T>(1.0 / sum);
      for (std::int64_t j = 0; j < L.sk; ++j) row[j] *= inv;
    }
    if (L.dv > 0) gemm(false, false, n, L.dv, L.sk, T(1), s, L.sk, vb, L.dv, T(0), ob, L.dv);
  }

  AttentionSpec spec_;
};

}  // namespace

CustomData attention_op(const AttentionSpec& spec) { return CustomData::make<AttentionOp>(spec); }

std::optional<AttentionSpec> attention_spec(const CustomOp& op) {
  if (const auto* a = dynamic_cast<const AttentionOp*>(&op)) return a->spec();
  return std::nullopt;
}

std::int64_t attention_max_head() { return KG_ATTN_MAX_HEAD; }

}  // namespace kg::ops

namespace kg::nn {

SymTensor attention(const SymTensor& q, const SymTensor& k, const SymTensor& v, const SymTensor& mask, bool causal,
                    std::optional<double> scale, const std::string& name) {
  ops::AttentionSpec spec;
  spec.causal = causal;
  spec.scale = scale;
  std::vector<SymTensor> others{k, v};
  if (mask.valid()) {
    spec.mask = mask.dtype() == DType::Bool ? ops::AttentionSpec::Mask::Bool : ops::AttentionSpec::Mask::Additive;
    others.push_back(mask);
  }
  return q.record_custom(ops::attention_op(spec), others, std::nullopt, name);
}

}  // namespace kg::nn
