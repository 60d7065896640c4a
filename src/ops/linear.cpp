// nn.linear: y = x Wᵀ + b over the last dim, and its backward: dx = dy W, dW = dyᵀ x and
// db = the column sums of dy, with x and dy seen as [rows, features]. The forward also computes
// in f16 and bf16 (stored 16-bit, summed in f32); the backward takes f32 and f64 only.
#include <algorithm>
#include <cmath>

#include "kg/ops.hpp"
#include "ops/blas.hpp"
#include "ops/epilogue.hpp"
#include "ops/gemm_shared.cuh"
#include "ops/gpu_util.hpp"
#include "ops/op_util.hpp"
#include "util/cpu.hpp"

namespace kg::ops {
namespace {

#if KG_HAVE_AVX512_PATHS
KG_AVX512_BEGIN
// The sum of a vector's lanes (through memory: GCC 12's _mm512_reduce_add_ps trips
// -Wmaybe-uninitialized).
inline float lane_sum(__m512 v) {
  alignas(64) float l[16];
  _mm512_store_ps(l, v);
  float s = 0;
  for (float e : l) s += e;
  return s;
}

// y[r, j] = b[j] + x[r, :] · w[j, :] in f32 with AVX-512: four output features per pass over
// the row, so each load of x feeds four multiply-adds.
void small_linear_avx512(const float* x, const float* w, const float* b, float* y, std::int64_t rows,
                         std::int64_t in, std::int64_t out) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (in % 16)) - 1);
  const std::int64_t full = in / 16 * 16;
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * in;
    std::int64_t j = 0;
    for (; j + 4 <= out; j += 4) {
      const float* w0 = w + j * in;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (std::int64_t k = 0; k < full; k += 16) {
        const __m512 xv = _mm512_loadu_ps(xr + k);
        a0 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w0 + k), a0);
        a1 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w0 + in + k), a1);
        a2 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w0 + 2 * in + k), a2);
        a3 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w0 + 3 * in + k), a3);
      }
      if (tail) {
        const __m512 xv = _mm512_maskz_loadu_ps(tail, xr + full);
        a0 = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(tail, w0 + full), a0);
        a1 = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(tail, w0 + in + full), a1);
        a2 = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(tail, w0 + 2 * in + full), a2);
        a3 = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(tail, w0 + 3 * in + full), a3);
      }
      const float bias[4] = {b ? b[j] : 0.0f, b ? b[j + 1] : 0.0f, b ? b[j + 2] : 0.0f, b ? b[j + 3] : 0.0f};
      y[r * out + j] = bias[0] + lane_sum(a0);
      y[r * out + j + 1] = bias[1] + lane_sum(a1);
      y[r * out + j + 2] = bias[2] + lane_sum(a2);
      y[r * out + j + 3] = bias[3] + lane_sum(a3);
    }
    for (; j < out; ++j) {
      const float* wj = w + j * in;
      __m512 a = _mm512_setzero_ps();
      for (std::int64_t k = 0; k < full; k += 16)
        a = _mm512_fmadd_ps(_mm512_loadu_ps(xr + k), _mm512_loadu_ps(wj + k), a);
      if (tail) a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, xr + full), _mm512_maskz_loadu_ps(tail, wj + full), a);
      y[r * out + j] = (b ? b[j] : 0.0f) + lane_sum(a);
    }
  }
}
KG_AVX512_END
#endif

// The backward launches (linear_backward.cu), in this order; an unwanted gradient's launch is
// one idle block.
enum LinearBackwardLaunch { kGradInput, kGradWeight, kGradBias };
constexpr std::int64_t kMaxGridYZ = 65535;  // the kernels loop over further tiles
constexpr std::int64_t kMaxBiasBlocks = 65535LL * 32;

// Tiles of `tile` covering n (at least 1, at most cap).
unsigned gemm_tiles(std::int64_t n, std::int64_t tile, std::int64_t cap) {
  return static_cast<unsigned>(std::clamp<std::int64_t>((n + tile - 1) / tile, 1, cap));
}

// The GPU half: one launch of the tiled GEMM with the bias in its epilogue; the backward takes
// two GEMM launches and a column reduction.
class LinearRuntime final : public RuntimeOp {
 public:
  // `entry`: the forward entry's name, for errors (kg_linear_<dtype> unless given).
  LinearRuntime(std::int64_t in, std::int64_t out, bool bias, DType dtype, std::string entry = "")
      : in_(in), out_(out), bias_(bias), dtype_(dtype), entry_(entry.empty() ? entry_for("kg_linear", dtype) : entry) {}
  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    v.pointer(t.inputs.at(0).ptr);
    v.pointer(t.params.at(0).ptr);
    v.pointer(bias_ ? t.params.at(1).ptr : 0);
    v.pointer(t.output.ptr);
    v.i64(rows(t.output.shape));
    v.i64(in_);
    v.i64(out_);
  }
  Dim3 block() const override { return {KG_GEMM_THREADS, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>& shape) const override {
    // A tile per block (kg_gemm_tile): the tile counts themselves, refused over the limits.
    const std::string launch = util::cat("launch 0 of kernel '", entry_, "'");
    const std::int64_t r = rows(shape);
    return {grid_dim(tiles_of(out_, KG_GEMM_BN), 'x',
                     util::cat(launch, " over ", out_, " output features in tiles of ", KG_GEMM_BN)),
            grid_dim(tiles_of(r, KG_GEMM_BM), 'y',
                     util::cat(launch, " over ", r, " rows in tiles of ", KG_GEMM_BM)),
            1};
  }

  // y [rows, out] = x [rows, in] · Wᵀ + b, for cuBLASLt.
  std::optional<LibraryCall> library_call(const LaunchTensors& t) const override {
    GemmCall g;
    g.dtype = dtype_;
    g.a = t.inputs.at(0).ptr;
    g.b = t.params.at(0).ptr;
    g.c = t.output.ptr;
    g.bias = bias_ ? t.params.at(1).ptr : 0;
    g.trans_b = true;
    g.m = rows(t.output.shape);
    g.n = out_;
    g.k = in_;
    g.lda = in_;
    g.ldb = in_;
    g.ldc = out_;
    if (g.m == 0 || in_ == 0) return std::nullopt;
    return LibraryCall{g, {}};
  }

  // dx = dy · W and dW = dyᵀ · x for cuBLASLt; db by the backward module's column sums. None in
  // 16-bit: the op has no backward there.
  std::optional<LibraryBackward> backward_library_calls(const LaunchTensors& t) const override {
    const std::int64_t r = rows(t.grad_output.shape);
    if (r == 0 || in_ == 0 || is_half_float(dtype_)) return std::nullopt;
    LibraryBackward b;
    if (t.grad_inputs.at(0).ptr) {  // [rows, in] = [rows, out] · [out, in]
      GemmCall g;
      g.dtype = dtype_;
      g.a = t.grad_output.ptr;
      g.b = t.params.at(0).ptr;
      g.c = t.grad_inputs[0].ptr;
      g.m = r;
      g.n = in_;
      g.k = out_;
      g.lda = out_;
      g.ldb = in_;
      g.ldc = in_;
      b.calls.push_back({g, {}});
    }
    if (t.grad_params.at(0).ptr) {                   // [out, in] = [rows, out]ᵀ · [rows, in]
      if (!t.inputs.at(0).ptr) return std::nullopt;  // the input was not saved
      GemmCall g;
      g.dtype = dtype_;
      g.a = t.grad_output.ptr;
      g.trans_a = true;
      g.b = t.inputs[0].ptr;
      g.c = t.grad_params[0].ptr;
      g.m = out_;
      g.n = in_;
      g.k = r;
      g.lda = out_;
      g.ldb = in_;
      g.ldc = in_;
      b.calls.push_back({g, {}});
    }
    if (bias_ && t.grad_params.at(1).ptr) b.launches.push_back(backward_launches(t).at(kGradBias));
    return b;
  }

  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    require_gemm_backward("nn.linear", dtype_);
    const std::int64_t r = rows(t.grad_output.shape);
    std::vector<Launch> ls;
    for (int l = kGradInput; l <= (bias_ ? kGradBias : kGradWeight); ++l) {
      const char* what = l == kGradInput ? "input" : l == kGradWeight ? "weight" : "bias";
      Launch L;
      L.entry = entry_for(util::cat("kg_linear_backward_", what), dtype_);
      L.block = {KG_GEMM_THREADS, 1, 1};
      const DeviceTensor& g =
          l == kGradInput ? t.grad_inputs.at(0) : t.grad_params.at(l == kGradWeight ? 0 : 1);
      switch (l) {
        case kGradInput:  // dx [rows, in]
          L.grid = {gemm_tiles(in_, KG_GEMM_BN, kMaxBiasBlocks), gemm_tiles(r, KG_GEMM_BM, kMaxGridYZ), 1};
          L.args = {t.grad_output, t.params.at(0), g, r, in_, out_};
          break;
        case kGradWeight:  // dW [out, in]
          L.grid = {gemm_tiles(in_, KG_GEMM_BN, kMaxBiasBlocks), gemm_tiles(out_, KG_GEMM_BM, kMaxGridYZ), 1};
          L.args = {t.inputs.at(0), t.grad_output, g, r, in_, out_};
          break;
        default:  // db [out]: a block per column
          L.grid = {static_cast<unsigned>(std::clamp<std::int64_t>(out_, 1, kMaxBiasBlocks)), 1, 1};
          L.args = {t.grad_output, g, r, out_};
          break;
      }
      if (g.ptr == 0) L.grid = {1, 1, 1};
      ls.push_back(std::move(L));
    }
    return ls;
  }

 private:
  std::int64_t rows(const std::vector<std::int64_t>& shape) const {
    return out_ ? numel_of(shape) / out_ : 0;
  }
  std::int64_t in_, out_;
  bool bias_;
  DType dtype_;  // of the kernel entries
  std::string entry_;
};

class LinearOp final : public CustomOp, public EpilogueGemm {
 public:
  LinearOp(std::int64_t in, std::int64_t out, bool bias, DType dtype)
      : in_(in), out_(out), bias_(bias), dtype_(dtype) {}
  std::string name() const override { return "nn.linear"; }
  std::string attributes() const override {
    return util::cat("in=", in_, " out=", out_, bias_ ? "" : " bias=false");
  }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    const Shape& x = in[0];
    if (x.rank() < 1) throw Error("expects an input of rank >= 1 [..., in_features], got a scalar");
    const Dim& last = x[x.rank() - 1];
    if (last.is_dynamic() || last.size() != in_)
      throw Error(util::cat("expects the last dim to be in_features = ", in_, ", got input ", x.to_string()));
    Shape out = x;
    out[out.rank() - 1] = Dim(out_);
    return out;
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override {
    const DType t = gemm_dtype(in);
    // Recorded in f32 and recorded again on a 16-bit input, the op computes in that dtype: the
    // graph re-declares its f32 parameters in it (computes_in).
    if (t != dtype_ && !(is_half_float(t) && dtype_ == DType::F32))
      throw Error(util::cat("input is ", dtype_name(t), " but the parameters are ", dtype_name(dtype_)));
    return t;
  }
  bool computes_in(DType t) const override { return is_half_float(t); }

  std::vector<ParamSpec> parameters(const std::vector<Shape>&) const override {
    // PyTorch: kaiming_uniform(a=sqrt(5)) gives U(-1/sqrt(in), 1/sqrt(in)); the bias the same.
    const double bound = in_ > 0 ? 1.0 / std::sqrt(static_cast<double>(in_)) : 0.0;
    std::vector<ParamSpec> p{{"weight", {out_, in_}, dtype_, ParamInit::uniform(-bound, bound), true}};
    if (bias_) p.push_back({"bias", {out_}, dtype_, ParamInit::uniform(-bound, bound), true});
    return p;
  }

  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    const DType t = node_dtype(ctx);
    return Lowered{"nn.linear", kernel_file("linear.cu"), entry_for("kg_linear", t),
                   std::make_shared<LinearRuntime>(in_, out_, bias_, t)};
  }
  std::string lower_backward_source(const LowerContext& ctx) const override {
    require_gemm_backward(name(), node_dtype(ctx));
    return kernel_file("linear_backward.cu");
  }

  // A fused epilogue (ops/fused_gemm): the same tiled GEMM and runtime, each output element
  // stored through the epilogue after the bias.
  bool takes_epilogue(DType t) const override { return is_floating(t); }
  std::optional<Lowered> lower_with_epilogue(const LowerContext& ctx, const EpilogueCode& code) const override {
    const DType dtype = node_dtype(ctx);
    if (!takes_epilogue(dtype)) return std::nullopt;
    const char* t = device_type(dtype);
    std::string src = util::cat(
        code.head, without_entries(kernel_file("linear.cu")), "\n", code.source,
        "\nextern \"C\" __global__ void __launch_bounds__(KG_GEMM_THREADS)\n    ", code.entry, "(const ", t,
        "* __restrict__ x, const ", t, "* __restrict__ w, const ", t, "* __restrict__ bias, ", t,
        "* __restrict__ y, long long rows, long long in, long long out", code.params, ") {\n  kg_linear<", t,
        ">(x, w, bias, y, rows, in, out, ", code.epilogue, ");\n}\n");
    return Lowered{name(), std::move(src), code.entry,
                   std::make_shared<LinearRuntime>(in_, out_, bias_, dtype, code.entry)};
  }

  // The input is read for the weight's gradient; the output is never read.
  bool has_cpu_backward() const override { return true; }
  BackwardSaves backward_saves() const override { return {true, false}; }

  void cpu_backward(CpuBackwardContext& ctx) const override {
    require_gemm_backward(name(), ctx.grad_output.dtype());
    const Tensor& dyt = ctx.grad_output;
    const std::int64_t rows = dyt.numel() / out_;
    dispatch_float(dyt.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* dy = dyt.data<T>();
      if (ctx.wants_input_grad(0)) {  // dx [rows, in] = dy [rows, out] · W [out, in]
        T* dx = ctx.grad_inputs[0].data<T>();
        gemm(false, false, rows, in_, out_, T(1), dy, out_, ctx.params[0].data<T>(), in_, T(0), dx, in_);
      }
      if (ctx.wants_param_grad(0)) {  // dW [out, in] = dyᵀ [out, rows] · x [rows, in]
        T* dw = ctx.grad_params[0].data<T>();
        if (rows == 0)
          std::fill(dw, dw + out_ * in_, T(0));
        else
          gemm(true, false, out_, in_, rows, T(1), dy, out_, ctx.inputs[0].data<T>(), in_, T(0), dw, in_);
      }
      if (bias_ && ctx.wants_param_grad(1)) {  // db [out]: the column sums, row by row
        T* db = ctx.grad_params[1].data<T>();
        std::fill(db, db + out_, T(0));
        for (std::int64_t r = 0; r < rows; ++r) {
          const T* row = dy + r * out_;
          for (std::int64_t j = 0; j < out_; ++j) db[j] += row[j];
        }
      }
    });
  }

  void cpu_forward(CpuContext& ctx) const override {
    // 16-bit: the f32 form on f32 copies, the output rounded back.
    if (is_half_float(ctx.output.dtype()))
      return cpu_forward_in_f32(ctx, [&](CpuContext& c) { cpu_forward(c); });
    const Tensor& x = ctx.inputs[0];
    const std::int64_t rows = x.numel() / std::max<std::int64_t>(in_, 1);
    dispatch_float(x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const Tensor& w = ctx.params[0];
      T* y = ctx.output.data<T>();
      if (rows * in_ * out_ <= kSmallGemm) {
        // A few rows (batch 1 inference): BLAS's call and thread start-up cost more than the
        // arithmetic, so take dot products directly, with the bias.
        small_linear(x.data<T>(), w.data<T>(), bias_ ? ctx.params[1].data<T>() : nullptr, y, rows);
        return;
      }
      gemm(false, true, rows, out_, in_, T(1), x.data<T>(), in_, w.data<T>(), in_, T(0), y, out_);
      if (bias_) {
        const T* bp = ctx.params[1].data<T>();
        ctx.parallel_for(rows, 256, [&](std::int64_t r0, std::int64_t r1) {
          for (std::int64_t r = r0; r < r1; ++r)
            for (std::int64_t j = 0; j < out_; ++j) y[r * out_ + j] += bp[j];
        });
      }
    });
  }

 private:
  static constexpr std::int64_t kSmallGemm = 1 << 17;  // multiply-adds below which BLAS is skipped

  // The dtype the node computes in, that of its kernel entries: the parameters' as declared, or
  // the 16-bit dtype the node was recorded in again (computes_in).
  DType node_dtype(const LowerContext& ctx) const {
    return is_half_float(ctx.output_dtype) ? ctx.output_dtype : dtype_;
  }

  // y[r, j] = b[j] + x[r, :] · w[j, :], with 16 independent partial sums so the loop vectorises.
  template <class T>
  void small_linear(const T* x, const T* w, const T* b, T* y, std::int64_t rows) const {
#if KG_HAVE_AVX512_PATHS
    if constexpr (std::is_same_v<T, float>) {
      if (util::cpu_has_avx512f()) return small_linear_avx512(x, w, b, y, rows, in_, out_);
    }
#endif
    constexpr int L = 16;
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * in_;
      for (std::int64_t j = 0; j < out_; ++j) {
        const T* wj = w + j * in_;
        T acc[L] = {};
        std::int64_t k = 0;
        for (; k + L <= in_; k += L)
          for (int l = 0; l < L; ++l) acc[l] += xr[k + l] * wj[k + l];
        T s = b ? b[j] : T(0);
        for (; k < in_; ++k) s += xr[k] * wj[k];
        for (int l = 0; l < L; ++l) s += acc[l];
        y[r * out_ + j] = s;
      }
    }
  }

  std::int64_t in_, out_;
  bool bias_;
  DType dtype_;  // of the parameters as declared: the input's at record time
};

}  // namespace
}  // namespace kg::ops

namespace kg::nn {

SymTensor linear(const SymTensor& x, std::int64_t out_features, const std::string& name, bool bias) {
  const Shape& s = x.shape();
  if (out_features <= 0)
    throw Error(util::cat("[nn.linear] out_features must be positive, got ", out_features));
  if (s.rank() < 1 || s[s.rank() - 1].is_dynamic())
    throw Error("[nn.linear] the input's last dim must be known to size the weight, got " + s.to_string() +
                " from '" + x.name() + "'");
  return x.record_custom(
      CustomData::make<ops::LinearOp>(s[s.rank() - 1].size(), out_features, bias, x.dtype()), {},
      std::nullopt, name);
}

}  // namespace kg::nn
