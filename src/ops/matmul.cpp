// nn.matmul: torch.matmul semantics (1-D and 2-D operands, batched operands whose leading dims
// broadcast), computed with one GEMM per batch entry or one GEMM when B is shared. The backward
// is dA = dC Bᵀ and dB = Aᵀ dC per output batch entry, summed over the entries that share an
// operand's matrix (its broadcast dims). The forward also computes in f16 and bf16 (stored
// 16-bit, summed in f32); the backward takes f32 and f64 only.
#include <algorithm>

#include "kg/ops.hpp"
#include "ops/blas.hpp"
#include "ops/epilogue.hpp"
#include "ops/gemm_shared.cuh"
#include "ops/gpu_util.hpp"
#include "ops/matmul.hpp"
#include "ops/matmul_shared.cuh"
#include "ops/op_util.hpp"

namespace kg::ops {
namespace {

constexpr std::size_t kMaxBatchLevels = KG_MATMUL_MAX_LEVELS;

// The matrix sizes of C = A B: A as [m, k], B as [k, n] (a 1-D A is one row, a 1-D B one column).
struct MatmulSizes {
  std::int64_t m, k, n;
};
MatmulSizes matmul_sizes(const std::vector<std::int64_t>& sa, const std::vector<std::int64_t>& sb) {
  return {sa.size() >= 2 ? sa[sa.size() - 2] : 1, sa.back(), sb.size() >= 2 ? sb.back() : 1};
}

// The output batch entries as broadcast levels (outermost first), adjacent dims that both
// operands step through alike merged; strides in elements, 0 where an operand is broadcast.
struct Levels {
  std::vector<std::int64_t> size, stride_a, stride_b;
  std::int64_t batches() const {
    std::int64_t b = 1;
    for (std::int64_t s : size) b *= s;
    return b;
  }
};
Levels broadcast_levels(const std::vector<std::int64_t>& sa, const std::vector<std::int64_t>& sb) {
  const auto [m, k, n] = matmul_sizes(sa, sb);
  // Right-aligned batch dims.
  std::vector<std::int64_t> ba(sa.begin(), sa.end() - std::min<std::ptrdiff_t>(2, std::ssize(sa)));
  std::vector<std::int64_t> bb(sb.begin(), sb.end() - std::min<std::ptrdiff_t>(2, std::ssize(sb)));
  const std::size_t r = std::max(ba.size(), bb.size());
  ba.insert(ba.begin(), r - ba.size(), 1);
  bb.insert(bb.begin(), r - bb.size(), 1);
  Levels lv;  // innermost first while building
  std::int64_t step_a = m * k, step_b = k * n;
  for (std::size_t i = r; i-- > 0;) {
    const std::int64_t s = std::max(ba[i], bb[i]);
    const std::int64_t sta = ba[i] == 1 ? 0 : step_a, stb = bb[i] == 1 ? 0 : step_b;
    step_a *= ba[i];
    step_b *= bb[i];
    if (s == 1) continue;
    // Merge with the level inside it when both operands step through the pair as one dim.
    if (!lv.size.empty() && sta == lv.stride_a.back() * lv.size.back() &&
        stb == lv.stride_b.back() * lv.size.back()) {
      lv.size.back() *= s;
      continue;
    }
    lv.size.push_back(s);
    lv.stride_a.push_back(sta);
    lv.stride_b.push_back(stb);
  }
  std::reverse(lv.size.begin(), lv.size.end());
  std::reverse(lv.stride_a.begin(), lv.stride_a.end());
  std::reverse(lv.stride_b.begin(), lv.stride_b.end());
  return lv;
}

// The levels for the GPU kernel, which takes at most kMaxBatchLevels.
void check_gpu_levels(const Levels& lv, const std::vector<std::int64_t>& sa,
                      const std::vector<std::int64_t>& sb) {
  if (lv.size.size() > kMaxBatchLevels)
    throw Error(util::cat("nn.matmul: operands ", sizes_to_string(sa), " and ", sizes_to_string(sb), " need ",
                          lv.size.size(), " broadcast batch levels; the GPU kernel handles ",
                          kMaxBatchLevels));
}

// One output batch entry and no levels (the product as one GEMM).
KgMatmulBatch single_batch() {
  KgMatmulBatch b{};
  b.batches = 1;
  return b;
}

KgMatmulBatch batch_levels(const std::vector<std::int64_t>& sa, const std::vector<std::int64_t>& sb) {
  const Levels lv = broadcast_levels(sa, sb);
  check_gpu_levels(lv, sa, sb);
  KgMatmulBatch batch = single_batch();
  batch.levels = std::ssize(lv.size);
  for (std::size_t l = 0; l < lv.size.size(); ++l) {
    batch.size[l] = lv.size[l];
    batch.stride_a[l] = lv.stride_a[l];
    batch.stride_b[l] = lv.stride_b[l];
    batch.batches *= lv.size[l];
  }
  return batch;
}

// A gradient's view of the levels: its own operand's matrices (`entries`, over the levels where
// that operand is not broadcast) and, for each, the output batch entries that use it (`reps`,
// over the other levels).
struct GradLevels {
  std::vector<std::int64_t> size, stride_own, stride_other;
  std::int64_t entries = 1, reps = 1;
};
GradLevels grad_levels(const Levels& lv, bool grad_a) {
  GradLevels g;
  g.size = lv.size;
  g.stride_own = grad_a ? lv.stride_a : lv.stride_b;
  g.stride_other = grad_a ? lv.stride_b : lv.stride_a;
  for (std::size_t l = 0; l < g.size.size(); ++l) (g.stride_own[l] != 0 ? g.entries : g.reps) *= g.size[l];
  return g;
}

// Output batch entry z and the offsets of the own and the other operand's matrices for (own
// matrix e, use r): the levels where the own stride is non-zero take their coordinates from e,
// the others from r (as kg_matmul_grad_entry in matmul_backward.cu).
struct GradEntry {
  std::int64_t z = 0, own = 0, other = 0;
};
GradEntry grad_entry(const GradLevels& g, std::int64_t e, std::int64_t r) {
  GradEntry out;
  std::int64_t zmul = 1;
  for (std::size_t l = g.size.size(); l-- > 0;) {
    std::int64_t c;
    if (g.stride_own[l] != 0) {
      c = e % g.size[l];
      e /= g.size[l];
    } else {
      c = r % g.size[l];
      r /= g.size[l];
    }
    out.z += c * zmul;
    zmul *= g.size[l];
    out.own += c * g.stride_own[l];
    out.other += c * g.stride_other[l];
  }
  return out;
}

// One matrix used once and no levels (each gradient as one GEMM).
KgMatmulGradBatch single_grad_batch() {
  KgMatmulGradBatch g{};
  g.entries = 1;
  g.reps = 1;
  return g;
}

KgMatmulGradBatch grad_batch_args(const GradLevels& g) {
  KgMatmulGradBatch a{};
  a.entries = g.entries;
  a.reps = g.reps;
  a.levels = std::ssize(g.size);
  for (std::size_t l = 0; l < g.size.size(); ++l) {
    a.size[l] = g.size[l];
    a.stride_own[l] = g.stride_own[l];
    a.stride_other[l] = g.stride_other[l];
  }
  return a;
}

// True when B has no batch dims and A's matrices follow each other (A is never broadcast): the
// product is then one GEMM of batches * m rows, and so are both gradients.
bool single_gemm(const Levels& lv) {
  for (std::size_t l = 0; l < lv.size.size(); ++l)
    if (lv.stride_b[l] != 0 || lv.stride_a[l] == 0) return false;
  return true;
}

// The GPU half: the tiled GEMM once per output batch entry, the operands' entries found through
// the broadcast levels. When B has no batch dims and A has some, A's matrices follow each other
// and the whole product is one GEMM of batches * m rows.
class MatmulRuntime final : public RuntimeOp {
 public:
  static constexpr std::int64_t kMaxGridYZ = 65535;

  // `entry`: the forward entry's name, for errors (kg_matmul_<dtype> unless given).
  MatmulRuntime(std::size_t rank_a, std::size_t rank_b, DType dtype, std::string entry = "")
      : rank_a_(rank_a), rank_b_(rank_b), dtype_(dtype), entry_(entry.empty() ? entry_for("kg_matmul", dtype) : entry) {}

  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    const auto &sa = t.inputs.at(0).shape, &sb = t.inputs.at(1).shape;
    const std::int64_t m = sa.size() >= 2 ? sa[sa.size() - 2] : 1, k = sa.back();
    const std::int64_t n = sb.size() >= 2 ? sb.back() : 1;
    KgMatmulBatch batch = single_batch();
    std::int64_t rows = m;
    if (merged()) {
      rows = m * batch_count(t.output.shape);
    } else {
      batch = batch_levels(sa, sb);
    }
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.inputs[1].ptr);
    v.pointer(t.output.ptr);
    v.i64(rows);
    v.i64(n);
    v.i64(k);
    v.i64(k);  // A(m, k) = a[m*k + k]
    v.i64(1);
    v.i64(sb.size() >= 2 ? n : 1);  // B(k, n) = b[k*n + n]; a 1-D B is one column
    v.i64(1);
    v.bytes(&batch, sizeof batch);
  }

  Dim3 block() const override { return {KG_GEMM_THREADS, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>& out_shape) const override {
    const std::int64_t r = std::ssize(out_shape);
    const std::int64_t n = rank_b_ >= 2 ? out_shape.back() : 1;
    const std::int64_t m = rank_a_ >= 2 ? out_shape[static_cast<std::size_t>(r - 1 - (rank_b_ >= 2))] : 1;
    std::int64_t batches = batch_count(out_shape), rows = m;
    if (merged()) {
      rows *= batches;
      batches = 1;
    }
    // n: a tile per block (y and z are looped over in the kernel).
    return {grid_dim(tiles_of(n, KG_GEMM_BN), 'x',
                     util::cat("launch 0 of kernel '", entry_, "' over ", n,
                               " columns in tiles of ", KG_GEMM_BN)),
            tiles(rows, KG_GEMM_BM, kMaxGridYZ),
            static_cast<unsigned>(std::clamp<std::int64_t>(batches, 1, kMaxGridYZ))};
  }

  // The product for cuBLASLt: one GEMM, or a strided batch of them over one broadcast level
  // (more levels: the kernel's walk serves).
  std::optional<LibraryCall> library_call(const LaunchTensors& t) const override {
    const auto &sa = t.inputs.at(0).shape, &sb = t.inputs.at(1).shape;
    const auto [m, k, n] = matmul_sizes(sa, sb);
    GemmCall g;
    g.dtype = dtype_;
    g.a = t.inputs[0].ptr;
    g.b = t.inputs[1].ptr;
    g.c = t.output.ptr;
    g.m = m;
    g.n = n;
    g.k = k;
    g.lda = k;
    g.ldb = n;
    g.ldc = n;
    if (merged()) {
      g.m = m * batch_count(t.output.shape);
    } else {
      const Levels lv = broadcast_levels(sa, sb);
      if (lv.size.size() > 1) return std::nullopt;
      if (lv.size.size() == 1) {
        g.batch = lv.size[0];
        g.stride_a = lv.stride_a[0];
        g.stride_b = lv.stride_b[0];
        g.stride_c = m * n;
      }
    }
    if (g.m == 0 || g.n == 0 || g.batch == 0) return std::nullopt;
    if (g.k == 0) return std::nullopt;  // an all-zero output: the kernel writes it
    return LibraryCall{g, {}};
  }

  // The gradients for cuBLASLt: dA = dY · Bᵀ and dB = Aᵀ · dY, each one GEMM (B without batch
  // dims: every entry of A is rows of one product) or a strided batch over one level where
  // neither operand is broadcast. A broadcast operand's gradient is a sum over the entries that
  // read it, which the backward kernels do: nullopt then, and in 16-bit (no backward there).
  std::optional<LibraryBackward> backward_library_calls(const LaunchTensors& t) const override {
    if (is_half_float(dtype_)) return std::nullopt;
    const auto &sa = t.inputs.at(0).shape, &sb = t.inputs.at(1).shape;
    const auto [m, k, n] = matmul_sizes(sa, sb);
    const Levels lv = broadcast_levels(sa, sb);
    std::int64_t rows = m, batch = 1, stride_a = 0, stride_b = 0;
    if (single_gemm(lv)) {
      rows = m * lv.batches();
    } else if (lv.size.size() == 1 && lv.stride_a[0] != 0 && lv.stride_b[0] != 0) {
      batch = lv.size[0];
      stride_a = lv.stride_a[0];
      stride_b = lv.stride_b[0];
    } else {
      return std::nullopt;
    }
    if (rows == 0 || n == 0 || k == 0 || batch == 0) return std::nullopt;
    const DeviceTensor &da = t.grad_inputs.at(0), &db = t.grad_inputs.at(1);
    if ((da.ptr && !t.inputs[1].ptr) || (db.ptr && !t.inputs[0].ptr)) return std::nullopt;  // not saved
    LibraryBackward b;
    auto gemm = [&] {
      GemmCall g;
      g.dtype = dtype_;
      g.batch = batch;
      return g;
    };
    if (da.ptr) {  // [rows, k] = [rows, n] · ([k, n] stored)ᵀ
      GemmCall g = gemm();
      g.a = t.grad_output.ptr;
      g.b = t.inputs[1].ptr;
      g.trans_b = true;
      g.c = da.ptr;
      g.m = rows;
      g.n = k;
      g.k = n;
      g.lda = n;
      g.ldb = n;
      g.ldc = k;
      g.stride_a = m * n;
      g.stride_b = stride_b;
      g.stride_c = stride_a;
      b.calls.push_back({g, {}});
    }
    if (db.ptr) {  // [k, n] = ([rows, k] stored)ᵀ · [rows, n]
      GemmCall g = gemm();
      g.a = t.inputs[0].ptr;
      g.trans_a = true;
      g.b = t.grad_output.ptr;
      g.c = db.ptr;
      g.m = k;
      g.n = n;
      g.k = rows;
      g.lda = k;
      g.ldb = n;
      g.ldc = n;
      g.stride_a = stride_a;
      g.stride_b = m * n;
      g.stride_c = stride_b;
      b.calls.push_back({g, {}});
    }
    return b;
  }

  // ---- backward (matmul_backward.cu): launch 0 writes dA, launch 1 dB ----
  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    require_gemm_backward("nn.matmul", dtype_);
    std::vector<Launch> ls;
    for (int launch = 0; launch < 2; ++launch) {
      const GradLaunch g = grad_launch(launch, t);
      const DeviceTensor& grad = t.grad_inputs.at(static_cast<std::size_t>(launch));
      const DeviceTensor& other = t.inputs.at(launch == 0 ? 1 : 0);
      Launch L;
      L.entry = entry_for(launch == 0 ? "kg_matmul_backward_a" : "kg_matmul_backward_b", dtype_);
      L.block = {KG_GEMM_THREADS, 1, 1};
      // The gradient's matrices: [m, k] for dA, [k, n] for dB. Not wanted: one idle block.
      const std::int64_t rows = launch == 0 ? g.m : g.k, cols = launch == 0 ? g.k : g.n;
      if (grad.ptr != 0)
        L.grid = {tiles(cols, KG_GEMM_BN, kMaxGridX), tiles(rows, KG_GEMM_BM, kMaxGridYZ),
                  static_cast<unsigned>(std::clamp<std::int64_t>(g.batch.entries, 1, kMaxGridYZ))};
      L.args = {t.grad_output, other, grad, g.m, g.n, g.k, raw_bytes(&g.batch, sizeof g.batch)};
      ls.push_back(std::move(L));
    }
    return ls;
  }

 private:
  static constexpr std::int64_t kMaxGridX = 65535LL * 32;  // the kernels loop over further tiles
  static unsigned tiles(std::int64_t v, std::int64_t tile, std::int64_t cap) {
    return static_cast<unsigned>(std::clamp<std::int64_t>((v + tile - 1) / tile, 1, cap));
  }
  // The sizes and batch walk of a backward launch. When the product is one GEMM, so is each
  // gradient: m covers every batch entry's rows and there are no levels.
  struct GradLaunch {
    std::int64_t m, n, k;
    KgMatmulGradBatch batch;
  };
  GradLaunch grad_launch(int launch, const LaunchTensors& t) const {
    const auto &sa = t.inputs.at(0).shape, &sb = t.inputs.at(1).shape;
    const auto [m, k, n] = matmul_sizes(sa, sb);
    const Levels lv = broadcast_levels(sa, sb);
    check_gpu_levels(lv, sa, sb);
    if (single_gemm(lv)) return {m * lv.batches(), n, k, single_grad_batch()};
    return {m, n, k, grad_batch_args(grad_levels(lv, launch == 0))};
  }

  bool merged() const { return rank_a_ >= 3 && rank_b_ <= 2; }
  // Output batch entries: the output dims before the matrix dims.
  std::int64_t batch_count(const std::vector<std::int64_t>& out_shape) const {
    const std::size_t matrix_dims = (rank_a_ >= 2) + (rank_b_ >= 2);
    std::int64_t b = 1;
    for (std::size_t i = 0; i + matrix_dims < out_shape.size(); ++i) b *= out_shape[i];
    return b;
  }
  std::size_t rank_a_, rank_b_;
  DType dtype_;  // of the kernel entries
  std::string entry_;
};

class MatmulOp final : public CustomOp, public EpilogueGemm {
 public:
  MatmulOp(std::size_t rank_a, std::size_t rank_b) : rank_a_(rank_a), rank_b_(rank_b) {}
  std::string name() const override { return "nn.matmul"; }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 2);
    const Shape &a = in[0], &b = in[1];
    if (a.rank() == 0 || b.rank() == 0)
      throw Error(util::cat("needs operands of rank >= 1, got ", a.to_string(), " and ", b.to_string()));
    const Dim& ka = a[a.rank() - 1];
    const Dim& kb = b.rank() == 1 ? b[0] : b[b.rank() - 2];
    if (ka.is_static() && kb.is_static() && ka.size() != kb.size())
      throw Error(util::cat("cannot multiply ", a.to_string(), " by ", b.to_string(), ": inner dims ",
                            ka.size(), " and ", kb.size(), " differ"));
    // Leading (batch) dims broadcast; a 1-D operand has none.
    Shape batch_a, batch_b;
    for (std::size_t i = 0; i + 2 < a.rank(); ++i) batch_a.push_back(a[i]);
    for (std::size_t i = 0; i + 2 < b.rank(); ++i) batch_b.push_back(b[i]);
    Shape out;
    try {
      out = broadcast_shapes(batch_a, batch_b);
    } catch (const Error& e) {
      throw Error(
          util::cat("cannot multiply ", a.to_string(), " by ", b.to_string(), ": batch dims ", e.what()));
    }
    if (a.rank() >= 2) out.push_back(a[a.rank() - 2]);
    if (b.rank() >= 2) out.push_back(b[b.rank() - 1]);
    return out;
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override { return gemm_dtype(in); }
  bool computes_in(DType t) const override { return is_half_float(t); }

  // The entries are the output dtype's.
  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    return Lowered{"nn.matmul", kernel_file("matmul.cu"), entry_for("kg_matmul", ctx.output_dtype),
                   std::make_shared<MatmulRuntime>(rank_a_, rank_b_, ctx.output_dtype)};
  }
  std::string lower_backward_source(const LowerContext& ctx) const override {
    require_gemm_backward(name(), ctx.output_dtype);
    return kernel_file("matmul_backward.cu");
  }

  // A fused epilogue (ops/fused_gemm): the same tiled GEMM and runtime, each output element
  // stored through the epilogue.
  bool takes_epilogue(DType t) const override { return is_floating(t); }
  std::optional<Lowered> lower_with_epilogue(const LowerContext& ctx, const EpilogueCode& code) const override {
    const DType dtype = ctx.output_dtype;
    if (!takes_epilogue(dtype)) return std::nullopt;
    const char* t = device_type(dtype);
    std::string src = util::cat(
        code.head, without_entries(kernel_file("matmul.cu")), "\n", code.source,
        "\nextern \"C\" __global__ void __launch_bounds__(KG_GEMM_THREADS)\n    ", code.entry, "(const ", t,
        "* __restrict__ a, const ", t, "* __restrict__ b, ", t,
        "* __restrict__ c, long long m, long long n, long long k, long long sam, long long sak, long long sbk, "
        "long long sbn, KgMatmulBatch batch",
        code.params, ") {\n  kg_matmul<", t, ">(a, b, c, m, n, k, sam, sak, sbk, sbn, batch, ", code.epilogue,
        ");\n}\n");
    return Lowered{name(), std::move(src), code.entry,
                   std::make_shared<MatmulRuntime>(rank_a_, rank_b_, dtype, code.entry)};
  }

  // dA = dC Bᵀ and dB = Aᵀ dC per output batch entry, each gradient matrix summed over the
  // entries that share it, in order; a gradient's matrices are spread over the threads.
  bool has_cpu_backward() const override { return true; }
  BackwardSaves backward_saves() const override { return {true, false}; }
  void cpu_backward(CpuBackwardContext& ctx) const override {
    require_gemm_backward(name(), ctx.grad_output.dtype());
    const Tensor &a = ctx.inputs[0], &b = ctx.inputs[1];
    const auto [m, k, n] = matmul_sizes(a.shape(), b.shape());
    const Levels lv = broadcast_levels(a.shape(), b.shape());
    dispatch_float(ctx.grad_output.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* dc = ctx.grad_output.data<T>();
      for (std::size_t which = 0; which < 2; ++which) {
        if (!ctx.wants_input_grad(which)) continue;
        const bool grad_a = which == 0;
        Tensor& gt = ctx.grad_inputs[which];
        T* g = gt.data<T>();
        const T* other = (grad_a ? b : a).template data<T>();
        const GradLevels gl = grad_levels(lv, grad_a);
        // The reduction each gradient element takes: n for dA, m per use for dB.
        if ((grad_a ? n : m) == 0 || gl.reps == 0 || gl.entries == 0) {
          std::fill(g, g + gt.numel(), T(0));
          continue;
        }
        if (single_gemm(lv)) {
          const std::int64_t rows = m * lv.batches();
          if (grad_a)  // dA [rows, k] = dC [rows, n] · Bᵀ
            gemm(false, true, rows, k, n, T(1), dc, n, other, n, T(0), g, k);
          else  // dB [k, n] = Aᵀ [k, rows] · dC [rows, n]
            gemm(true, false, k, n, rows, T(1), other, k, dc, n, T(0), g, n);
          continue;
        }
        auto one = [&](std::int64_t e) {
          for (std::int64_t r = 0; r < gl.reps; ++r) {
            const GradEntry at = grad_entry(gl, e, r);
            const T beta = r == 0 ? T(0) : T(1);
            if (grad_a)
              gemm(false, true, m, k, n, T(1), dc + at.z * m * n, n, other + at.other, n, beta, g + at.own,
                   k);
            else
              gemm(true, false, k, n, m, T(1), other + at.other, k, dc + at.z * m * n, n, beta, g + at.own,
                   n);
          }
        };
        if (m * n * k >= 64 * 64 * 64) {
          for (std::int64_t e = 0; e < gl.entries; ++e) one(e);  // the BLAS threads each product
        } else {
          ctx.parallel_for(gl.entries,
                           std::max<std::int64_t>(1, 65536 / std::max<std::int64_t>(m * n * k * gl.reps, 1)),
                           [&](std::int64_t e0, std::int64_t e1) {
                             for (std::int64_t e = e0; e < e1; ++e) one(e);
                           });
        }
      }
    });
  }

  void cpu_forward(CpuContext& ctx) const override {
    // 16-bit: the f32 form on f32 copies, the output rounded back.
    if (is_half_float(ctx.output.dtype()))
      return cpu_forward_in_f32(ctx, [&](CpuContext& c) { cpu_forward(c); });
    const Tensor &a = ctx.inputs[0], &b = ctx.inputs[1];
    const auto &sa = a.shape(), &sb = b.shape();
    // A as [batch_a..., m, k] and B as [batch_b..., k, n]; a 1-D A is one row, a 1-D B one column.
    const std::int64_t m = sa.size() >= 2 ? sa[sa.size() - 2] : 1;
    const std::int64_t k = sa.back();
    const std::int64_t n = sb.size() >= 2 ? sb.back() : 1;
    std::vector<std::int64_t> ba(sa.begin(), sa.end() - std::min<std::ptrdiff_t>(2, std::ssize(sa)));
    std::vector<std::int64_t> bb(sb.begin(), sb.end() - std::min<std::ptrdiff_t>(2, std::ssize(sb)));
    const std::size_t r = std::max(ba.size(), bb.size());
    ba.insert(ba.begin(), r - ba.size(), 1);
    bb.insert(bb.begin(), r - bb.size(), 1);
    // Batch strides in matrices, 0 along broadcast dims.
    std::vector<std::int64_t> out_batch(r), stride_a(r), stride_b(r);
    std::int64_t step_a = 1, step_b = 1, batches = 1;
    for (std::size_t i = r; i-- > 0;) {
      out_batch[i] = std::max(ba[i], bb[i]);
      stride_a[i] = ba[i] == 1 ? 0 : step_a;
      stride_b[i] = bb[i] == 1 ? 0 : step_b;
      step_a *= ba[i];
      step_b *= bb[i];
      batches *= out_batch[i];
    }
    const bool b_shared =
        std::all_of(stride_b.begin(), stride_b.end(), [](std::int64_t s) { return s == 0; });
    const bool a_full = step_a == batches;  // A is not broadcast: its matrices follow each other

    dispatch_float(a.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* ap = a.data<T>();
      const T* bp = b.data<T>();
      T* cp = ctx.output.data<T>();
      if (m == 0 || n == 0 || batches == 0) return;
      if (k == 0) {
        std::fill(cp, cp + batches * m * n, T(0));
        return;
      }
      if (b_shared && a_full) {
        // [batches * m, k] × [k, n] in one call.
        gemm(false, false, batches * m, n, k, T(1), ap, k, bp, n, T(0), cp, n);
        return;
      }
      auto one = [&](std::int64_t idx) {
        std::int64_t oa = 0, ob = 0, rem = idx;
        for (std::size_t i = r; i-- > 0;) {
          const std::int64_t c = rem % out_batch[i];
          rem /= out_batch[i];
          oa += c * stride_a[i];
          ob += c * stride_b[i];
        }
        gemm(false, false, m, n, k, T(1), ap + oa * m * k, k, bp + ob * k * n, n, T(0), cp + idx * m * n, n);
      };
      if (m * n * k >= 64 * 64 * 64) {
        // Large matrices: the BLAS spreads each product over its own threads.
        for (std::int64_t i = 0; i < batches; ++i) one(i);
      } else {
        ctx.parallel_for(batches, std::max<std::int64_t>(1, 65536 / (m * n * k)),
                         [&](std::int64_t i0, std::int64_t i1) {
                           for (std::int64_t i = i0; i < i1; ++i) one(i);
                         });
      }
    });
  }

 private:
  // Operand ranks at record time: the GPU lowering sizes its grid from them.
  std::size_t rank_a_, rank_b_;
};

}  // namespace

bool is_matmul(const CustomOp& op) { return dynamic_cast<const MatmulOp*>(&op) != nullptr; }

}  // namespace kg::ops

namespace kg {

SymTensor matmul(const SymTensor& a, const SymTensor& b, const std::string& name) {
  return a.record_custom(CustomData::make<ops::MatmulOp>(a.shape().rank(), b.shape().rank()), {b},
                         std::nullopt, name);
}

}  // namespace kg
