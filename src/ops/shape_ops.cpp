// Shape ops. nn.flatten and nn.reshape are views of their input's bytes; nn.permute (also
// transpose), nn.concat and nn.slice copy into a new buffer. All of them move elements by their
// width (the _u8 ... _u64 kernels, dispatch_width on the CPU), so every dtype works alike and
// each op computes in f16 and bf16 (CustomOp::computes_in) as it is.
#include "ops/shape_ops_shared.cuh"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <limits>
#include <numeric>
#include <optional>

#include "kg/ops.hpp"
#include "ops/divider.hpp"
#include "ops/gpu_util.hpp"
#include "ops/op_util.hpp"
#include "ops/shape_ops.hpp"

namespace kg::ops {
namespace {

constexpr unsigned kCopyThreads = KG_COPY_THREADS;

// Copies the input's bytes when the runtime did not alias the output to it.
void copy_view(CpuContext& ctx) {
  const Tensor& x = ctx.inputs[0];
  if (ctx.output.raw() != x.raw()) std::memcpy(ctx.output.raw(), x.raw(), x.nbytes());
}

// Product of dims; dynamic when any is. A single dynamic dim among static 1s keeps its symbol.
Dim dim_product(const std::vector<Dim>& dims) {
  std::int64_t known = 1;
  int dynamic_count = 0;
  const Dim* last_dynamic = nullptr;
  for (const Dim& d : dims) {
    if (d.is_dynamic()) {
      ++dynamic_count;
      last_dynamic = &d;
    } else {
      known *= d.size();
    }
  }
  if (dynamic_count == 0) return Dim(known);
  if (dynamic_count == 1 && known == 1) return *last_dynamic;
  return Dim(dynamic);
}

// ---- nn.flatten ----

class FlattenOp final : public CustomOp {
 public:
  FlattenOp(std::int64_t start, std::int64_t end) : start_(start), end_(end) {}
  std::string name() const override { return "nn.flatten"; }
  std::string attributes() const override { return util::cat("start_dim=", start_, " end_dim=", end_); }
  bool is_view() const override { return true; }
  bool computes_in(DType t) const override { return is_half_float(t); }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    const Shape& x = in[0];
    // A scalar flattens to one element, as in PyTorch.
    const std::size_t rank = std::max<std::size_t>(x.rank(), 1);
    const Shape src = x.rank() == 0 ? Shape{1} : x;
    const auto s = static_cast<std::size_t>(normalize_dim(start_, rank, "start_dim"));
    const auto e = static_cast<std::size_t>(normalize_dim(end_, rank, "end_dim"));
    if (s > e)
      throw Error(util::cat("start_dim ", start_, " (dim ", s, ") comes after end_dim ", end_, " (dim ", e,
                            ") for input ", x.to_string()));
    Shape out;
    for (std::size_t i = 0; i < s; ++i) out.push_back(src[i]);
    out.push_back(dim_product(std::vector<Dim>(src.begin() + static_cast<std::ptrdiff_t>(s),
                                               src.begin() + static_cast<std::ptrdiff_t>(e) + 1)));
    for (std::size_t i = e + 1; i < src.rank(); ++i) out.push_back(src[i]);
    return out;
  }

  void cpu_forward(CpuContext& ctx) const override { copy_view(ctx); }

 private:
  std::int64_t start_, end_;
};

// ---- nn.reshape ----

class ReshapeOp final : public CustomOp {
 public:
  explicit ReshapeOp(std::vector<std::int64_t> sizes) : sizes_(std::move(sizes)) {}
  std::string name() const override { return "nn.reshape"; }
  std::string attributes() const override { return util::cat("sizes=", sizes_to_string(sizes_)); }
  bool is_view() const override { return true; }
  bool computes_in(DType t) const override { return is_half_float(t); }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    const Shape& x = in[0];
    int infer_at = -1;
    for (std::size_t i = 0; i < sizes_.size(); ++i) {
      const std::int64_t s = sizes_[i];
      if (s == -1) {
        if (infer_at >= 0)
          throw Error(util::cat("sizes ", sizes_to_string(sizes_), " have two -1 entries (", infer_at,
                                " and ", i, "); at most one size can be inferred"));
        infer_at = static_cast<int>(i);
      } else if (s < -1) {
        throw Error(util::cat("sizes ", sizes_to_string(sizes_), " have an invalid entry ", s, " at ", i));
      } else if (s == 0 && i >= x.rank()) {
        throw Error(util::cat("sizes ", sizes_to_string(sizes_), " copy dim ", i,
                              " (a 0 entry) but the input ", x.to_string(), " has rank ", x.rank()));
      }
    }
    // Output dims; a 0 copies the input's dim at that position, dynamic or not.
    Shape out;
    std::vector<bool> input_dim_used(x.rank(), false);
    std::int64_t target_known = 1;
    for (std::size_t i = 0; i < sizes_.size(); ++i) {
      if (sizes_[i] == 0) {
        out.push_back(x[i]);
        if (x[i].is_dynamic())
          input_dim_used[i] = true;  // the same unknown on both sides cancels
        else
          target_known *= x[i].size();
      } else if (sizes_[i] > 0) {
        out.push_back(Dim(sizes_[i]));
        target_known *= sizes_[i];
      } else {
        out.push_back(Dim(dynamic));  // replaced below
      }
    }
    // What the input has beyond the cancelled dims: a known product and dynamic dims left.
    std::int64_t input_known = 1;
    std::vector<const Dim*> input_dynamic;
    for (std::size_t i = 0; i < x.rank(); ++i) {
      if (x[i].is_static())
        input_known *= x[i].size();
      else if (!input_dim_used[i])
        input_dynamic.push_back(&x[i]);
    }
    const std::string what = util::cat("cannot reshape ", x.to_string(), " into ", sizes_to_string(sizes_));
    if (infer_at >= 0) {
      auto& slot = out[static_cast<std::size_t>(infer_at)];
      if (target_known == 0)
        throw Error(util::cat(what, ": the other sizes multiply to 0, so -1 could be any size"));
      if (input_dynamic.empty()) {
        if (input_known % target_known != 0)
          throw Error(util::cat(what, ": ", input_known, " elements are not divisible by ", target_known));
        slot = Dim(input_known / target_known);
      } else if (input_dynamic.size() == 1 && input_known == target_known) {
        slot = *input_dynamic[0];  // -1 stands for exactly that unknown
      }                            // else: unknowable until load, stays dynamic
    } else if (input_dynamic.empty() && input_known != target_known) {
      throw Error(util::cat(what, ": ", input_known, " elements vs ", target_known));
    }
    return out;
  }

  void cpu_forward(CpuContext& ctx) const override { copy_view(ctx); }

 private:
  std::vector<std::int64_t> sizes_;
};


// ---- nn.permute (transpose too) ----

class PermuteOp final : public CustomOp {
 public:
  explicit PermuteOp(std::vector<std::int64_t> dims) : dims_(std::move(dims)) {}
  // The permutation with its elements converted to `to` (f32, f16 or bf16, from any of them) as
  // they are copied: a cast and a layout change in one pass (passes/channels_last.cpp). Inference
  // only: it has no backward.
  PermuteOp(std::vector<std::int64_t> dims, DType to) : dims_(std::move(dims)), to_(to) {
    if (!converts_between(to, to))
      throw Error(util::cat("nn.permute converts to f32, f16 or bf16, not ", dtype_name(to)));
  }
  // The dtypes a converting permute reads and writes.
  static bool converts_between(DType from, DType to) {
    auto ok = [](DType t) { return t == DType::F32 || t == DType::F16 || t == DType::BF16; };
    return ok(from) && ok(to);
  }
  // transpose(dim0, dim1): the permutation is built once the rank is known.
  PermuteOp(std::int64_t dim0, std::int64_t dim1) : transpose_(true), t0_(dim0), t1_(dim1) {}
  std::string name() const override { return "nn.permute"; }
  std::string attributes() const override {
    const std::string to = to_ ? util::cat(",to=", dtype_name(*to_)) : "";
    return transpose_ ? util::cat("transpose=", t0_, ",", t1_) : util::cat("dims=", sizes_to_string(dims_), to);
  }
  bool computes_in(DType t) const override { return is_half_float(t); }
  DType infer_output_dtype(const std::vector<DType>& in) const override {
    if (in.size() != 1) throw Error(util::cat("expects 1 input(s), got ", in.size()));
    if (to_ && !converts_between(in[0], *to_))
      throw Error(util::cat("converts f32, f16 or bf16 to ", dtype_name(*to_), ", not ", dtype_name(in[0])));
    return to_ ? *to_ : in[0];
  }
  // The dtype the elements are converted to, if any.
  std::optional<DType> converts_to() const { return to_; }

  // The permutation for an input of `rank` dims: output dim i is input dim perm[i].
  std::vector<std::size_t> perm(std::size_t rank) const {
    std::vector<std::size_t> p(rank);
    if (transpose_) {
      std::iota(p.begin(), p.end(), std::size_t{0});
      std::swap(p[static_cast<std::size_t>(normalize_dim(t0_, rank, "dim0"))],
                p[static_cast<std::size_t>(normalize_dim(t1_, rank, "dim1"))]);
      return p;
    }
    if (dims_.size() != rank)
      throw Error(util::cat("dims ", sizes_to_string(dims_), " have ", dims_.size(),
                            " entries for an input of rank ", rank));
    std::vector<bool> seen(rank, false);
    for (std::size_t i = 0; i < rank; ++i) {
      const auto d = static_cast<std::size_t>(normalize_dim(dims_[i], rank));
      if (seen[d])
        throw Error(util::cat("dims ", sizes_to_string(dims_), " name dim ", d,
                              " twice; a permutation names each once"));
      seen[d] = true;
      p[i] = d;
    }
    return p;
  }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    const Shape& x = in[0];
    if (transpose_ && x.rank() == 0)
      throw Error(util::cat("transpose needs an input of rank >= 1, got a scalar ", x.to_string()));
    Shape out;
    for (std::size_t d : perm(x.rank())) out.push_back(x[d]);
    return out;
  }

  std::optional<Lowered> lower(const LowerContext& ctx) const override;
  std::string lower_backward_source(const LowerContext&) const override {
    return to_ ? std::string() : kernel_file("shape_ops.cu");
  }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    if (!to_ || *to_ == x.dtype()) {
      permute_copy(ctx, x, perm(x.rank()), ctx.output.raw());
      return;
    }
    // Permuted in the input's dtype, then converted.
    Tensor t = Tensor::empty(x.dtype(), ctx.output.shape());
    permute_copy(ctx, x, perm(x.rank()), t.raw());
    const Tensor c = t.to(*to_);
    std::memcpy(ctx.output.raw(), c.raw(), c.nbytes());
  }

  bool has_cpu_backward() const override { return !to_; }
  BackwardSaves backward_saves() const override { return {false, false}; }  // shapes only
  // dx = dy permuted back by the inverse permutation.
  void cpu_backward(CpuBackwardContext& ctx) const override {
    if (!ctx.wants_input_grad(0)) return;
    permute_copy(ctx, ctx.grad_output, inverse_perm(ctx.grad_inputs[0].rank()), ctx.grad_inputs[0].raw());
  }

  // The inverse permutation for rank `rank`, and the op that applies it (the backward's copy).
  std::vector<std::size_t> inverse_perm(std::size_t rank) const {
    const std::vector<std::size_t> p = perm(rank);
    std::vector<std::size_t> q(rank);
    for (std::size_t i = 0; i < rank; ++i) q[p[i]] = i;
    return q;
  }
  PermuteOp inverse(std::size_t rank) const {
    std::vector<std::int64_t> dims;
    for (std::size_t d : inverse_perm(rank)) dims.push_back(static_cast<std::int64_t>(d));
    return PermuteOp(std::move(dims));
  }

 private:
  // When p, with runs of input dims that stay together merged, swaps the last two merged dims
  // ([N, C, H, W] to [N, H, W, C] and back: [N][C][H*W] to [N][H*W][C]), copies x as that batch
  // of 2D transposes in square tiles, so that both sides are read and written in cache lines,
  // and returns true; false for other permutations.
  static bool batched_transpose(const CpuContext& ctx, const Tensor& x, const std::vector<std::size_t>& p,
                                void* out) {
    const auto& s = x.shape();
    const std::size_t r = s.size();
    // Groups of consecutive output dims that read consecutive input dims.
    std::vector<std::pair<std::size_t, std::size_t>> groups;  // input dims [first, last]
    for (std::size_t i = 0; i < r; ++i) {
      if (!groups.empty() && p[i] == groups.back().second + 1)
        groups.back().second = p[i];
      else
        groups.emplace_back(p[i], p[i]);
    }
    const std::size_t k = groups.size();
    if (k < 2) return false;
    for (std::size_t i = 0; i + 2 < k; ++i)  // a leading batch, in order
      if (groups[i].first != (i == 0 ? 0 : groups[i - 1].second + 1)) return false;
    const auto& gy = groups[k - 2];  // the output's second-to-last group: the input's last
    const auto& gx = groups[k - 1];
    if (gy.second != r - 1 || gx.second + 1 != gy.first ||
        gx.first != (k == 2 ? 0 : groups[k - 3].second + 1))
      return false;
    auto extent = [&](std::pair<std::size_t, std::size_t> g) {
      std::int64_t n = 1;
      for (std::size_t d = g.first; d <= g.second; ++d) n *= s[d];
      return n;
    };
    const std::int64_t X = extent(gx), Y = extent(gy), B = x.numel() / std::max<std::int64_t>(X * Y, 1);
    if (X <= 1 || Y <= 1) return false;  // no transpose at all: the generic copy is a memcpy per row
    constexpr std::int64_t kT = 32;
    const std::int64_t ytiles = (Y + kT - 1) / kT;
    dispatch_width(dtype_size(x.dtype()), [&](auto zero) {
      using E = decltype(zero);
      const E* src = static_cast<const E*>(x.raw());
      E* dst = static_cast<E*>(out);
      const std::int64_t grain = std::max<std::int64_t>(1, 16384 / (kT * X));
      ctx.parallel_for(B * ytiles, grain, [&](std::int64_t t0, std::int64_t t1) {
        for (std::int64_t t = t0; t < t1; ++t) {
          const std::int64_t b = t / ytiles, y0 = t % ytiles * kT, y1 = std::min(Y, y0 + kT);
          const E* sb = src + b * X * Y;
          E* db = dst + b * X * Y;
          for (std::int64_t x0 = 0; x0 < X; x0 += kT) {
            const std::int64_t x1 = std::min(X, x0 + kT);
            for (std::int64_t yy = y0; yy < y1; ++yy)
              for (std::int64_t xx = x0; xx < x1; ++xx) db[yy * X + xx] = sb[xx * Y + yy];
          }
        }
      });
    });
    return true;
  }

  // dst = x permuted by p (output dim i is x's dim p[i]).
  static void permute_copy(const CpuContext& ctx, const Tensor& x, const std::vector<std::size_t>& p,
                           void* out) {
    const auto& s = x.shape();
    const std::size_t r = s.size();
    const std::int64_t total = x.numel();
    if (total == 0) return;
    if (r == 0) {
      std::memcpy(out, x.raw(), x.nbytes());
      return;
    }
    std::vector<std::int64_t> in_stride(r), out_shape(r), src_stride(r);
    std::int64_t st = 1;
    for (std::size_t i = r; i-- > 0;) {
      in_stride[i] = st;
      st *= s[i];
    }
    for (std::size_t i = 0; i < r; ++i) {
      out_shape[i] = s[p[i]];
      src_stride[i] = in_stride[p[i]];  // input step per output step along output dim i
    }
    if (batched_transpose(ctx, x, p, out)) return;
    const std::int64_t last = out_shape[r - 1], rows = total / last, last_stride = src_stride[r - 1];
    dispatch_width(dtype_size(x.dtype()), [&](auto zero) {
      using E = decltype(zero);
      const E* src = static_cast<const E*>(x.raw());
      E* dst = static_cast<E*>(out);
      ctx.parallel_for(rows, std::max<std::int64_t>(1, 16384 / last), [&](std::int64_t r0, std::int64_t r1) {
        for (std::int64_t row = r0; row < r1; ++row) {
          std::int64_t off = 0, rem = row;
          for (std::size_t i = r - 1; i-- > 0;) {
            off += (rem % out_shape[i]) * src_stride[i];
            rem /= out_shape[i];
          }
          E* o = dst + row * last;
          if (last_stride == 1) {
            std::memcpy(o, src + off, static_cast<std::size_t>(last) * sizeof(E));
          } else {
            for (std::int64_t j = 0; j < last; ++j) o[j] = src[off + j * last_stride];
          }
        }
      });
    });
  }

  std::vector<std::int64_t> dims_;
  std::optional<DType> to_;
  bool transpose_ = false;
  std::int64_t t0_ = 0, t1_ = 0;
};

constexpr std::int64_t kTiledMin = 16;  // both tiled dims at least this long

// nn.permute on the GPU: see shape_ops.cu for the gather, tiled and rows paths. `dtype` picks the
// kernel's element width.
class PermuteRuntime final : public RuntimeOp {
 public:
  PermuteRuntime(PermuteOp op, DType dtype) : op_(std::move(op)), dtype_(dtype) {}
  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    const KgPermuteArgs args = plan(t.output.shape);
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.output.ptr);
    v.bytes(&args, sizeof args);
  }
  Dim3 block() const override { return {kCopyThreads, 1, 1}; }

  // Backward: the same copy kernel with the inverse permutation, dy -> dx.
  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    const PermuteRuntime inv = inverse(t);
    const KgPermuteArgs args = inv.plan(t.grad_inputs.at(0).shape);
    return {{width_entry("kg_permute", dtype_),
             inv.grid(t.grad_inputs.at(0).shape),
             {kCopyThreads, 1, 1},
             0,
             {t.grad_output, t.grad_inputs.at(0), raw_bytes(&args, sizeof args)}}};
  }

  Dim3 grid(const std::vector<std::int64_t>& shape) const override {
    const KgPermuteArgs a = plan(shape);
    if (a.tiled_p == -2) return grid_1d(a.total / a.size[a.rank - 1].d, kCopyThreads);
    if (a.tiled_p < 0) return grid_1d((a.total + KG_UNROLL - 1) / KG_UNROLL, kCopyThreads);
    const std::int64_t tiles =
        a.tiles_a.d * a.tiles_b.d * (a.total / (a.size[a.tiled_p].d * a.size[a.rank - 1].d));
    return {static_cast<unsigned>(std::clamp<std::int64_t>(tiles, 1, 65535LL * 32)), 1, 1};
  }

  // The copy as the kernel sees it, from the output shape: size-1 dims dropped, output dims that
  // are adjacent in the input too merged, and the path chosen.
  KgPermuteArgs plan(const std::vector<std::int64_t>& out_shape) const {
    const std::size_t r = out_shape.size();
    const std::vector<std::size_t> p = op_.perm(r);
    std::vector<std::int64_t> in_shape(r), in_stride(r);
    for (std::size_t i = 0; i < r; ++i) in_shape[p[i]] = out_shape[i];
    std::int64_t st = 1;
    for (std::size_t i = r; i-- > 0;) {
      in_stride[i] = st;
      st *= in_shape[i];
    }
    std::vector<std::int64_t> size, src;
    for (std::size_t i = 0; i < r; ++i) {
      const std::int64_t n = out_shape[i], stride = in_stride[p[i]];
      if (n == 1) continue;
      if (!size.empty() && src.back() == stride * n) {
        size.back() *= n;
        src.back() = stride;
      } else {
        size.push_back(n);
        src.push_back(stride);
      }
    }
    if (size.empty()) {
      size.push_back(1);
      src.push_back(1);
    }
    if (size.size() > static_cast<std::size_t>(KG_PERMUTE_MAX_DIMS))
      throw Error(util::cat("nn.permute: output ", sizes_to_string(out_shape), " needs ", size.size(),
                            " dims after merging; the GPU kernel handles ", KG_PERMUTE_MAX_DIMS));
    KgPermuteArgs a{};
    a.tiled_p = -1;
    a.tiles_a = a.tiles_b = kg_divider(1);
    std::fill(std::begin(a.size), std::end(a.size), kg_divider(1));
    a.rank = std::ssize(size);
    a.total = numel_of(out_shape);
    std::int64_t dst = 1;
    for (std::size_t i = size.size(); i-- > 0;) {
      a.size[i] = kg_divider(size[i]);
      a.src_stride[i] = src[i];
      a.dst_stride[i] = dst;
      dst *= size[i];
    }
    // The input's last dim is the output dim of stride 1; tile when it is not the output's last.
    if (src.back() != 1 && size.back() >= kTiledMin) {
      for (std::size_t i = 0; i + 1 < size.size(); ++i)
        if (src[i] == 1 && size[i] >= kTiledMin) a.tiled_p = static_cast<std::int64_t>(i);
    }
    // A short last dim whose neighbour is the input's last dim: a row per thread.
    const std::size_t n = size.size();
    if (a.tiled_p < 0 && n >= 2 && src.back() != 1 && size.back() < KG_PERMUTE_ROW_MAX && src[n - 2] == 1)
      a.tiled_p = -2;
    if (a.tiled_p >= 0) {
      a.tiles_a = kg_divider((size[static_cast<std::size_t>(a.tiled_p)] + KG_TILE - 1) / KG_TILE);
      a.tiles_b = kg_divider((size.back() + KG_TILE - 1) / KG_TILE);
    }
    return a;
  }

 private:
  PermuteRuntime inverse(const LaunchTensors& t) const {
    return PermuteRuntime(op_.inverse(t.grad_inputs.at(0).shape.size()), dtype_);
  }
  PermuteOp op_;
  DType dtype_;
};

std::optional<Lowered> PermuteOp::lower(const LowerContext& ctx) const {
  const DType from = ctx.input_dtypes.at(0);
  auto rt = std::make_shared<PermuteRuntime>(*this, ctx.output_dtype);
  if (!to_ || *to_ == from)
    return Lowered{"nn.permute", kernel_file("shape_ops.cu"), width_entry("kg_permute", ctx.output_dtype), rt};
  // A converting copy: shape_ops.cu's kernels without their entries, and one entry of its own.
  const std::string entry = util::cat("kg_permute_", dtype_name(from), "_to_", dtype_name(*to_));
  return Lowered{"nn.permute",
                 util::cat(without_entries(kernel_file("shape_ops.cu")),
                           "\nextern \"C\" __global__ void __launch_bounds__(KG_COPY_THREADS)\n    ", entry, "(const ",
                           device_type(from), "* __restrict__ src, ", device_type(*to_),
                           "* __restrict__ dst, KgPermuteArgs p) {\n  kg_permute<", device_type(from), ", ",
                           device_type(*to_), ">(src, dst, p);\n}\n"),
                 entry, rt};
}

// Copies `total` output bytes in parallel blocks; `piece(p, &src, &avail)` gives the source of
// output byte p and how many bytes from there are contiguous in both.
template <class F>
void parallel_gather(CpuContext& ctx, std::byte* dst, std::int64_t total, const F& piece) {
  ctx.parallel_for(total, 1 << 16, [&](std::int64_t b0, std::int64_t b1) {
    std::int64_t p = b0;
    while (p < b1) {
      const std::byte* src = nullptr;
      std::int64_t avail = 0;
      piece(p, &src, &avail);
      const std::int64_t len = std::min(avail, b1 - p);
      std::memcpy(dst + p, src, static_cast<std::size_t>(len));
      p += len;
    }
  });
}

// ---- nn.concat ----

constexpr std::size_t kConcatMax = KG_CONCAT_MAX;

// nn.concat on the GPU: one launch per 16 inputs; within a launch, blockIdx.y picks the input.
// The backward launches are laid out the same way, kg_concat_backward(dy, args) with args.src
// naming the input gradients.
class ConcatRuntime final : public RuntimeOp {
 public:
  ConcatRuntime(std::int64_t dim, DType dtype) : dim_(dim), dtype_(dtype) {}
  std::vector<Launch> launches(const LaunchTensors& t) const override {
    return copies("", t.inputs, t.output);
  }
  // The forward's launches with the gradients in the inputs' places: (dy, args).
  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    return copies(width_entry("kg_concat_backward", dtype_), t.grad_inputs, t.grad_output);
  }

 private:
  // entry(out, args) per kConcatMax inputs, `out` being the output (forward) or dy (backward).
  std::vector<Launch> copies(const std::string& entry, const std::vector<DeviceTensor>& inputs,
                             const DeviceTensor& out) const {
    std::vector<Launch> l;
    for (std::size_t first = 0; first < inputs.size(); first += kConcatMax) {
      const KgConcatArgs a = pack(first, inputs, out.shape);
      const std::size_t count = std::min(kConcatMax, inputs.size() - first);
      // The blocks of each input stride over its elements; 1024 blocks fill the GPU.
      // blockIdx.y picks the input: at most kConcatMax of them.
      const auto inputs_here = static_cast<std::int64_t>(count);
      const unsigned y = grid_dim(inputs_here, 'y', util::cat("a launch of ", inputs_here, " inputs"));
      const Dim3 grid{grid_1d((numel_of(out.shape) + KG_UNROLL - 1) / KG_UNROLL, kCopyThreads, 1024).x, y, 1};
      l.push_back({entry, grid, {kCopyThreads, 1, 1}, 0, {out, raw_bytes(&a, sizeof a)}});
    }
    return l;
  }
  KgConcatArgs pack(std::size_t first, const std::vector<DeviceTensor>& inputs,
                    const std::vector<std::int64_t>& shape) const {
    const auto d = static_cast<std::size_t>(normalize_dim(dim_, shape.size()));
    KgConcatArgs a{};
    std::fill(std::begin(a.chunk_div), std::end(a.chunk_div), kg_divider(1));
    std::int64_t inner = 1;
    a.outer = 1;
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (i < d) a.outer *= shape[i];
      if (i > d) inner *= shape[i];
    }
    a.row = shape[d] * inner;
    std::int64_t offset = 0;
    for (std::size_t k = 0; k < inputs.size() && k < first + kConcatMax; ++k) {
      const std::int64_t chunk = inputs[k].shape[d] * inner;
      if (k >= first) {
        const std::size_t j = k - first;
        a.src[j] = inputs[k].ptr;
        a.chunk[j] = chunk;
        a.offset[j] = offset;
        a.chunk_div[j] = kg_divider(chunk);
      }
      offset += chunk;
    }
    return a;
  }
  std::int64_t dim_;
  DType dtype_;
};

class ConcatOp final : public CustomOp {
 public:
  explicit ConcatOp(std::int64_t dim) : dim_(dim) {}
  std::string name() const override { return "nn.concat"; }
  std::string attributes() const override { return util::cat("dim=", dim_); }
  bool computes_in(DType t) const override { return is_half_float(t); }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    if (in.empty()) throw Error("expects at least one input, got none");
    const Shape& first = in[0];
    if (first.rank() == 0)
      throw Error(util::cat("cannot concatenate scalars (input 0 is ", first.to_string(), ")"));
    const auto d = static_cast<std::size_t>(normalize_dim(dim_, first.rank()));
    Shape out = first;
    std::vector<Dim> along{first[d]};
    for (std::size_t k = 1; k < in.size(); ++k) {
      const Shape& s = in[k];
      if (s.rank() != first.rank())
        throw Error(util::cat("input ", k, " ", s.to_string(), " has rank ", s.rank(), " but input 0 ",
                              first.to_string(), " has rank ", first.rank()));
      for (std::size_t i = 0; i < s.rank(); ++i) {
        if (i == d) continue;
        const Dim &a = out[i], &b = s[i];
        if (a.is_static() && b.is_static()) {
          if (a.size() != b.size())
            throw Error(util::cat("input ", k, " ", s.to_string(), " differs from input 0 ",
                                  first.to_string(), " in dim ", i, " (", b.size(), " vs ", a.size(),
                                  "); only dim ", d, " may differ"));
        } else if (a.is_dynamic() && b.is_static()) {
          out[i] = b;  // the dynamic one must be this size at load
        }
      }
      along.push_back(s[d]);
    }
    // Sum along the concatenated dim: dynamic when any part is.
    std::int64_t sum = 0;
    bool dyn = false;
    for (const Dim& a : along) {
      if (a.is_dynamic())
        dyn = true;
      else
        sum += a.size();
    }
    out[d] = dyn ? Dim(dynamic) : Dim(sum);
    return out;
  }

  DType infer_output_dtype(const std::vector<DType>& in) const override {
    for (std::size_t k = 1; k < in.size(); ++k)
      if (in[k] != in[0])
        throw Error(util::cat("inputs must share one dtype: input 0 is ", dtype_name(in[0]), ", input ", k,
                              " is ", dtype_name(in[k])));
    return CustomOp::infer_output_dtype(in);
  }

  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    return Lowered{"nn.concat", kernel_file("shape_ops.cu"), width_entry("kg_concat", ctx.output_dtype),
                   std::make_shared<ConcatRuntime>(dim_, ctx.output_dtype)};
  }
  std::string lower_backward_source(const LowerContext&) const override {
    return kernel_file("shape_ops.cu");
  }

  bool has_cpu_backward() const override { return true; }
  BackwardSaves backward_saves() const override { return {false, false}; }  // shapes only
  // Input k's gradient: its chunk of every row of dy.
  void cpu_backward(CpuBackwardContext& ctx) const override {
    const auto& s0 = ctx.grad_output.shape();
    const auto d = static_cast<std::size_t>(normalize_dim(dim_, s0.size()));
    const std::int64_t es = static_cast<std::int64_t>(dtype_size(ctx.grad_output.dtype()));
    std::int64_t outer = 1, inner = 1;
    for (std::size_t i = 0; i < s0.size(); ++i) {
      if (i < d) outer *= s0[i];
      if (i > d) inner *= s0[i];
    }
    const std::int64_t row = s0[d] * inner * es;
    const auto* dy = static_cast<const std::byte*>(ctx.grad_output.raw());
    std::int64_t start = 0;
    for (std::size_t k = 0; k < ctx.grad_inputs.size(); ++k) {
      const std::int64_t chunk = ctx.grad_inputs[k].shape()[d] * inner * es;
      if (ctx.wants_input_grad(k) && chunk > 0 && outer > 0) {
        auto* dst = static_cast<std::byte*>(ctx.grad_inputs[k].raw());
        parallel_gather(ctx, dst, outer * chunk,
                        [&](std::int64_t p, const std::byte** src, std::int64_t* avail) {
                          const std::int64_t o = p / chunk, off = p % chunk;
                          *src = dy + o * row + start + off;
                          *avail = chunk - off;
                        });
      }
      start += chunk;
    }
  }

  void cpu_forward(CpuContext& ctx) const override {
    const auto& s0 = ctx.inputs[0].shape();
    const auto d = static_cast<std::size_t>(normalize_dim(dim_, s0.size()));
    const std::int64_t es = static_cast<std::int64_t>(dtype_size(ctx.output.dtype()));
    std::int64_t outer = 1, inner = 1;
    for (std::size_t i = 0; i < s0.size(); ++i) {
      if (i < d) outer *= s0[i];
      if (i > d) inner *= s0[i];
    }
    // Each output row (one outer index) is the inputs' chunks side by side.
    std::vector<std::int64_t> chunk, start;
    std::int64_t row = 0;
    for (const Tensor& t : ctx.inputs) {
      start.push_back(row);
      chunk.push_back(t.shape()[d] * inner * es);
      row += chunk.back();
    }
    if (row == 0 || outer == 0) return;
    auto* dst = static_cast<std::byte*>(ctx.output.raw());
    parallel_gather(ctx, dst, outer * row, [&](std::int64_t p, const std::byte** src, std::int64_t* avail) {
      const std::int64_t o = p / row, within = p % row;
      const auto k =
          static_cast<std::size_t>(std::upper_bound(start.begin(), start.end(), within) - start.begin() - 1);
      // Empty chunks share a start with the next input; upper_bound lands past them.
      const std::int64_t off = within - start[k];
      *src = static_cast<const std::byte*>(ctx.inputs[k].raw()) + o * chunk[k] + off;
      *avail = chunk[k] - off;
    });
  }

 private:
  std::int64_t dim_;
};

// ---- nn.slice ----

// Python's rule for one slice bound against a known size.
std::int64_t clamp_bound(std::int64_t v, std::int64_t size) {
  if (v < 0) v += size;
  return std::clamp<std::int64_t>(v, 0, size);
}

// nn.slice on the GPU: out[o, j, r] = in[o, begin + j*step, r], gathered element by element.
// Backward: kg_slice_backward(dy, dx, numel(dx), inner, size, step, begin, len) writes all of dx.
class SliceRuntime final : public RuntimeOp {
 public:
  SliceRuntime(std::int64_t dim, std::int64_t start, std::int64_t step, DType dtype)
      : dim_(dim), start_(start), step_(step), dtype_(dtype) {}
  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    const auto& in = t.inputs[0].shape;
    const auto& shape = t.output.shape;
    const auto d = static_cast<std::size_t>(normalize_dim(dim_, in.size()));
    std::int64_t inner = 1;
    for (std::size_t i = d + 1; i < in.size(); ++i) inner *= in[i];
    const std::int64_t size = in[d], len = shape[d], begin = clamp_bound(start_, size);
    // A step-1 slice takes len * inner contiguous elements per outer index.
    const std::int64_t run = step_ == 1 ? len * inner : inner, per = step_ == 1 ? 1 : len;
    const KgDivider run_div = kg_divider(run), per_div = kg_divider(per);
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.output.ptr);
    v.i64(numel_of(shape));
    v.bytes(&run_div, sizeof run_div);
    v.bytes(&per_div, sizeof per_div);
    v.i64(size * inner);
    v.i64(begin * inner);
    v.i64(step_ * inner);
  }
  Dim3 block() const override { return {kCopyThreads, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>& shape) const override {
    return grid_1d((numel_of(shape) + KG_UNROLL - 1) / KG_UNROLL, kCopyThreads);
  }

  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    const auto& in = t.grad_inputs.at(0).shape;
    const auto d = static_cast<std::size_t>(normalize_dim(dim_, in.size()));
    std::int64_t inner = 1;
    for (std::size_t i = d + 1; i < in.size(); ++i) inner *= in[i];
    const std::int64_t size = in[d], len = t.grad_output.shape.at(d);
    const KgDivider inner_div = kg_divider(inner), size_div = kg_divider(size), step_div = kg_divider(step_);
    return {{width_entry("kg_slice_backward", dtype_),
             grid(in),
             {kCopyThreads, 1, 1},
             0,
             {t.grad_output, t.grad_inputs.at(0), numel_of(in), raw_bytes(&inner_div, sizeof inner_div),
              raw_bytes(&size_div, sizeof size_div), raw_bytes(&step_div, sizeof step_div),
              clamp_bound(start_, size), len}}};
  }

 private:
  std::int64_t dim_, start_, step_;
  DType dtype_;
};

class SliceOp final : public CustomOp {
 public:
  SliceOp(std::int64_t dim, std::int64_t start, std::int64_t end, std::int64_t step)
      : dim_(dim), start_(start), end_(end), step_(step) {}
  std::string name() const override { return "nn.slice"; }
  std::string attributes() const override {
    return util::cat("dim=", dim_, " start=", start_, " end=", end_, " step=", step_);
  }
  bool computes_in(DType t) const override { return is_half_float(t); }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    const Shape& x = in[0];
    if (step_ <= 0) throw Error(util::cat("step must be positive, got ", step_));
    if (x.rank() == 0) throw Error(util::cat("cannot slice a scalar ", x.to_string()));
    const auto d = static_cast<std::size_t>(normalize_dim(dim_, x.rank()));
    Shape out = x;
    const Dim& D = x[d];
    if (D.is_static()) {
      out[d] = Dim(length(D.size()));
    } else if (start_ == 0 && end_ == std::numeric_limits<std::int64_t>::max() && step_ == 1) {
      out[d] = D;  // the whole dim
    } else if (start_ >= 0 && end_ >= 0 && end_ <= start_) {
      out[d] = Dim(0);  // empty whatever the size
    } else {
      out[d] = Dim(dynamic);  // depends on the size, known at load
    }
    return out;
  }

  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    return Lowered{"nn.slice", kernel_file("shape_ops.cu"), width_entry("kg_slice", ctx.output_dtype),
                   std::make_shared<SliceRuntime>(dim_, start_, step_, ctx.output_dtype)};
  }
  std::string lower_backward_source(const LowerContext&) const override {
    return kernel_file("shape_ops.cu");
  }

  bool has_cpu_backward() const override { return true; }
  BackwardSaves backward_saves() const override { return {false, false}; }  // shapes only
  // dx[o, s, r] = dy[o, j, r] where s = begin + j*step, 0 elsewhere: one pass over dx's rows.
  void cpu_backward(CpuBackwardContext& ctx) const override {
    if (!ctx.wants_input_grad(0)) return;
    Tensor& dx = ctx.grad_inputs[0];
    const auto& s = dx.shape();
    const auto d = static_cast<std::size_t>(normalize_dim(dim_, s.size()));
    const std::int64_t es = static_cast<std::int64_t>(dtype_size(dx.dtype()));
    std::int64_t outer = 1, inner = 1;
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (i < d) outer *= s[i];
      if (i > d) inner *= s[i];
    }
    const std::int64_t size = s[d], len = ctx.grad_output.shape()[d], begin = clamp_bound(start_, size);
    const std::int64_t row = inner * es;
    if (outer * size * row == 0) return;
    const auto* dy = static_cast<const std::byte*>(ctx.grad_output.raw());
    auto* dst = static_cast<std::byte*>(dx.raw());
    ctx.parallel_for(
        outer * size, std::max<std::int64_t>(1, 65536 / row), [&](std::int64_t q0, std::int64_t q1) {
          for (std::int64_t q = q0; q < q1; ++q) {
            const std::int64_t o = q / size, off = q % size - begin;
            std::byte* out = dst + q * row;
            if (off >= 0 && off % step_ == 0 && off / step_ < len)
              std::memcpy(out, dy + (o * len + off / step_) * row, static_cast<std::size_t>(row));
            else
              std::memset(out, 0, static_cast<std::size_t>(row));
          }
        });
  }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    const auto& s = x.shape();
    const auto d = static_cast<std::size_t>(normalize_dim(dim_, s.size()));
    const std::int64_t es = static_cast<std::int64_t>(dtype_size(x.dtype()));
    std::int64_t outer = 1, inner = 1;
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (i < d) outer *= s[i];
      if (i > d) inner *= s[i];
    }
    const std::int64_t size = s[d], len = length(size), begin = clamp_bound(start_, size);
    const std::int64_t total = outer * len * inner * es;
    if (total == 0) return;
    const auto* src0 = static_cast<const std::byte*>(x.raw());
    auto* dst = static_cast<std::byte*>(ctx.output.raw());
    const std::int64_t inner_bytes = inner * es, out_row = len * inner_bytes;
    if (step_ == 1) {
      // Each outer index takes one contiguous run.
      parallel_gather(ctx, dst, total, [&](std::int64_t p, const std::byte** src, std::int64_t* avail) {
        const std::int64_t o = p / out_row, within = p % out_row;
        *src = src0 + (o * size + begin) * inner_bytes + within;
        *avail = out_row - within;
      });
    } else if (inner > 1) {
      parallel_gather(ctx, dst, total, [&](std::int64_t p, const std::byte** src, std::int64_t* avail) {
        const std::int64_t o = p / out_row, j = (p % out_row) / inner_bytes, r = p % inner_bytes;
        *src = src0 + (o * size + begin + j * step_) * inner_bytes + r;
        *avail = inner_bytes - r;
      });
    } else {
      // Single strided elements: a typed loop.
      dispatch_width(static_cast<std::size_t>(es), [&](auto zero) {
        using E = decltype(zero);
        const E* sp = static_cast<const E*>(x.raw());
        E* dp = static_cast<E*>(ctx.output.raw());
        ctx.parallel_for(outer, std::max<std::int64_t>(1, 16384 / len),
                         [&](std::int64_t o0, std::int64_t o1) {
                           for (std::int64_t o = o0; o < o1; ++o)
                             for (std::int64_t j = 0; j < len; ++j)
                               dp[o * len + j] = sp[o * size + begin + j * step_];
                         });
      });
    }
  }

 private:
  // Elements taken from a dim of `size`.
  std::int64_t length(std::int64_t size) const {
    const std::int64_t b = clamp_bound(start_, size), e = clamp_bound(end_, size);
    return e > b ? (e - b + step_ - 1) / step_ : 0;
  }

  std::int64_t dim_, start_, end_, step_;
};

}  // namespace

CustomData permute_op(std::vector<std::int64_t> dims) { return CustomData::make<PermuteOp>(std::move(dims)); }
CustomData permute_op(std::vector<std::int64_t> dims, DType to) {
  return CustomData::make<PermuteOp>(std::move(dims), to);
}

bool permute_keeps_dim0(const CustomOp& op, std::size_t rank) {
  const auto* p = dynamic_cast<const PermuteOp*>(&op);
  return p && rank > 0 && p->perm(rank)[0] == 0;
}

std::optional<std::vector<std::int64_t>> permute_dims(const CustomOp& op, std::size_t rank) {
  const auto* p = dynamic_cast<const PermuteOp*>(&op);
  if (!p || p->converts_to()) return std::nullopt;
  std::vector<std::int64_t> dims;
  for (std::size_t d : p->perm(rank)) dims.push_back(static_cast<std::int64_t>(d));
  return dims;
}

}  // namespace kg::ops

namespace kg {

SymTensor flatten(const SymTensor& x, std::int64_t start_dim, std::int64_t end_dim, const std::string& name) {
  return x.record_custom(CustomData::make<ops::FlattenOp>(start_dim, end_dim), {}, std::nullopt, name);
}

SymTensor reshape(const SymTensor& x, const std::vector<std::int64_t>& sizes, const std::string& name) {
  return x.record_custom(CustomData::make<ops::ReshapeOp>(sizes), {}, std::nullopt, name);
}

SymTensor transpose(const SymTensor& x, std::int64_t dim0, std::int64_t dim1, const std::string& name) {
  return x.record_custom(CustomData::make<ops::PermuteOp>(dim0, dim1), {}, std::nullopt, name);
}

SymTensor permute(const SymTensor& x, const std::vector<std::int64_t>& dims, const std::string& name) {
  return x.record_custom(CustomData::make<ops::PermuteOp>(dims), {}, std::nullopt, name);
}

SymTensor concat(const std::vector<SymTensor>& xs, std::int64_t dim, const std::string& name) {
  if (xs.empty()) throw Error("[nn.concat] needs at least one tensor, got none");
  return xs[0].record_custom(CustomData::make<ops::ConcatOp>(dim), {xs.begin() + 1, xs.end()}, std::nullopt,
                             name);
}

SymTensor slice(const SymTensor& x, std::int64_t dim, std::int64_t start, std::int64_t end, std::int64_t step,
                const std::string& name) {
  return x.record_custom(CustomData::make<ops::SliceOp>(dim, start, end, step), {}, std::nullopt, name);
}

}  // namespace kg
