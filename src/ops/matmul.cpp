// nn.matmul: torch.matmul semantics (1-D and 2-D operands, batched operands whose leading dims
// broadcast), computed with one GEMM per batch entry or one GEMM when B is shared.
#include <algorithm>

#include "kg/ops.hpp"
#include "ops/blas.hpp"
#include "ops/op_util.hpp"

namespace kg::ops {
namespace {

class MatmulOp final : public CustomOp {
 public:
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
};

}  // namespace
}  // namespace kg::ops

namespace kg {

SymTensor matmul(const SymTensor& a, const SymTensor& b, const std::string& name) {
  return a.record_custom(CustomData::make<ops::MatmulOp>(), {b}, std::nullopt, name);
}

}  // namespace kg
