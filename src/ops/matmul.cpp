// nn.matmul: torch.matmul semantics (1-D and 2-D operands, batched operands whose leading dims
// broadcast), computed with one GEMM per batch entry or one GEMM when B is shared.
#include <algorithm>

#include "kg/ops.hpp"
#include "ops/blas.hpp"
#include "ops/gpu_util.hpp"
#include "ops/op_util.hpp"

namespace kg::ops {
namespace {

constexpr std::size_t kMaxBatchLevels = 8;  // KG_MATMUL_MAX_LEVELS in matmul.cu

// Laid out as the kernel's KgMatmulBatch.
struct MatmulBatchArgs {
  std::int64_t batches = 1;
  std::int64_t levels = 0;
  std::int64_t size[kMaxBatchLevels] = {};
  std::int64_t stride_a[kMaxBatchLevels] = {};
  std::int64_t stride_b[kMaxBatchLevels] = {};
};
static_assert(sizeof(MatmulBatchArgs) == 16 + 3 * 8 * kMaxBatchLevels);

// The GPU half: the tiled GEMM once per output batch entry, the operands' entries found through
// the broadcast levels. When B has no batch dims and A has some, A's matrices follow each other
// and the whole product is one GEMM of batches * m rows.
class MatmulRuntime final : public RuntimeOp {
 public:
  static constexpr unsigned kThreads = 256;  // KG_GEMM_THREADS
  static constexpr std::int64_t kTile = 64;  // KG_GEMM_BM, KG_GEMM_BN
  static constexpr std::int64_t kMaxGridYZ = 65535;

  MatmulRuntime(std::size_t rank_a, std::size_t rank_b) : rank_a_(rank_a), rank_b_(rank_b) {}
  int n_activation_inputs() const override { return 2; }
  std::vector<std::vector<std::int64_t>> param_shapes(const std::vector<std::vector<std::int64_t>>&,
                                                      const std::vector<std::int64_t>&) const override {
    return {};
  }

  void pack_args(const std::vector<DeviceTensor>& inputs, const std::vector<DeviceTensor>&,
                 const DeviceTensor& output, const std::vector<std::int64_t>& out_shape, std::int64_t,
                 ArgVisitor& v) const override {
    const auto &sa = inputs[0].shape, &sb = inputs[1].shape;
    const std::int64_t m = sa.size() >= 2 ? sa[sa.size() - 2] : 1, k = sa.back();
    const std::int64_t n = sb.size() >= 2 ? sb.back() : 1;
    MatmulBatchArgs batch;
    std::int64_t rows = m;
    if (merged()) {
      rows = m * batch_count(out_shape);
    } else {
      // Right-aligned batch dims; strides in elements, 0 along broadcast dims.
      std::vector<std::int64_t> ba(sa.begin(), sa.end() - std::min<std::ptrdiff_t>(2, std::ssize(sa)));
      std::vector<std::int64_t> bb(sb.begin(), sb.end() - std::min<std::ptrdiff_t>(2, std::ssize(sb)));
      const std::size_t r = std::max(ba.size(), bb.size());
      ba.insert(ba.begin(), r - ba.size(), 1);
      bb.insert(bb.begin(), r - bb.size(), 1);
      std::vector<std::int64_t> size, st_a, st_b;  // innermost first while building
      std::int64_t step_a = m * k, step_b = k * n;
      for (std::size_t i = r; i-- > 0;) {
        const std::int64_t s = std::max(ba[i], bb[i]);
        const std::int64_t sta = ba[i] == 1 ? 0 : step_a, stb = bb[i] == 1 ? 0 : step_b;
        step_a *= ba[i];
        step_b *= bb[i];
        if (s == 1) continue;
        // Merge with the level inside it when both operands step through the pair as one dim.
        if (!size.empty() && sta == st_a.back() * size.back() && stb == st_b.back() * size.back()) {
          size.back() *= s;
          continue;
        }
        size.push_back(s);
        st_a.push_back(sta);
        st_b.push_back(stb);
      }
      if (size.size() > kMaxBatchLevels)
        throw Error(util::cat("nn.matmul: operands ", sizes_to_string(sa), " and ", sizes_to_string(sb),
                              " need ", size.size(), " broadcast batch levels; the GPU kernel handles ",
                              kMaxBatchLevels));
      batch.levels = static_cast<std::int64_t>(size.size());
      for (std::size_t l = 0; l < size.size(); ++l) {
        const std::size_t at = size.size() - 1 - l;  // outermost first
        batch.size[l] = size[at];
        batch.stride_a[l] = st_a[at];
        batch.stride_b[l] = st_b[at];
        batch.batches *= size[at];
      }
    }
    v.pointer(inputs[0].ptr);
    v.pointer(inputs[1].ptr);
    v.pointer(output.ptr);
    v.i64(rows);
    v.i64(n);
    v.i64(k);
    v.i64(k);  // A(m, k) = a[m*k + k]
    v.i64(1);
    v.i64(sb.size() >= 2 ? n : 1);  // B(k, n) = b[k*n + n]; a 1-D B is one column
    v.i64(1);
    v.bytes(&batch, sizeof batch);
  }

  Dim3 block() const override { return {kThreads, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>& out_shape) const override {
    const std::int64_t r = std::ssize(out_shape);
    const std::int64_t n = rank_b_ >= 2 ? out_shape.back() : 1;
    const std::int64_t m = rank_a_ >= 2 ? out_shape[static_cast<std::size_t>(r - 1 - (rank_b_ >= 2))] : 1;
    std::int64_t batches = batch_count(out_shape), rows = m;
    if (merged()) {
      rows *= batches;
      batches = 1;
    }
    auto tiles = [](std::int64_t v) { return (v + kTile - 1) / kTile; };
    return {static_cast<unsigned>(std::max<std::int64_t>(tiles(n), 1)),
            static_cast<unsigned>(std::clamp<std::int64_t>(tiles(rows), 1, kMaxGridYZ)),
            static_cast<unsigned>(std::clamp<std::int64_t>(batches, 1, kMaxGridYZ))};
  }

 private:
  bool merged() const { return rank_a_ >= 3 && rank_b_ <= 2; }
  // Output batch entries: the output dims before the matrix dims.
  std::int64_t batch_count(const std::vector<std::int64_t>& out_shape) const {
    const std::size_t matrix_dims = (rank_a_ >= 2) + (rank_b_ >= 2);
    std::int64_t b = 1;
    for (std::size_t i = 0; i + matrix_dims < out_shape.size(); ++i) b *= out_shape[i];
    return b;
  }
  std::size_t rank_a_, rank_b_;
};

class MatmulOp final : public CustomOp {
 public:
  MatmulOp(std::size_t rank_a, std::size_t rank_b, DType dtype)
      : rank_a_(rank_a), rank_b_(rank_b), dtype_(dtype) {}
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
  DType infer_output_dtype(const std::vector<DType>& in) const override { return require_float(in); }

  std::optional<Lowered> lower() const override {
    return Lowered{"nn.matmul", kernel_file("matmul.cu"), entry_for("kg_matmul", dtype_),
                   std::make_shared<MatmulRuntime>(rank_a_, rank_b_)};
  }

  void cpu_forward(CpuContext& ctx) const override {
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
  // Operand ranks and dtype at record time: the GPU lowering sizes its grid from them.
  std::size_t rank_a_, rank_b_;
  DType dtype_;
};

}  // namespace
}  // namespace kg::ops

namespace kg {

SymTensor matmul(const SymTensor& a, const SymTensor& b, const std::string& name) {
  return a.record_custom(CustomData::make<ops::MatmulOp>(a.shape().rank(), b.shape().rank(), a.dtype()), {b},
                         std::nullopt, name);
}

}  // namespace kg
