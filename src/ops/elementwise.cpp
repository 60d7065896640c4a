// The elementwise op family: activations (one op class driven by the UnaryFn table), dropout,
// and arithmetic with numpy broadcasting (one class for tensor ⊙ tensor, one for tensor ⊙ scalar).
// On the GPU (elementwise.cu) every op has its own entry, named in the tables; two RuntimeOps
// launch them all: one for y = f(x), one for broadcasting tensor ⊙ tensor.
#include "ops/elementwise.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <iterator>
#include <vector>

#include "kg/ops.hpp"
#include "ops/gpu_util.hpp"
#include "ops/op_util.hpp"

namespace kg::ops {
namespace {

// Elements per parallel chunk: large enough that scheduling costs little next to the work.
constexpr std::int64_t kGrain = 16 * 1024;

// The shortest text that reads back as the same double ("0.1", "2.5", "1e-05").
std::string format_double(double v) {
  char buf[32];
  auto res = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, res.ptr);
}

// The tables are indexed by their enums.
constexpr bool tables_in_enum_order() {
  for (std::size_t i = 0; i < std::size(kUnaryOps); ++i)
    if (static_cast<std::size_t>(kUnaryOps[i].fn) != i) return false;
  for (std::size_t i = 0; i < std::size(kBinaryOps); ++i)
    if (static_cast<std::size_t>(kBinaryOps[i].fn) != i) return false;
  return std::size(kUnaryOps) == static_cast<std::size_t>(UnaryFn::Tanh) + 1 &&
         std::size(kBinaryOps) == static_cast<std::size_t>(BinaryFn::Div) + 1;
}
static_assert(tables_in_enum_order());

const UnaryEntry& unary_entry(UnaryFn fn) { return kUnaryOps[static_cast<std::size_t>(fn)]; }
const BinaryEntry& binary_entry(BinaryFn fn) { return kBinaryOps[static_cast<std::size_t>(fn)]; }

// ---- GPU launches ----

constexpr unsigned kGpuThreads = 256;  // KG_EW_THREADS
constexpr std::int64_t kUnroll = 4;    // KG_UNROLL

// One thread per kUnroll 16-byte packs of output (kg_for_each_unrolled over the kernels'
// vector width), in grid-stride loops.
Dim3 elementwise_grid(const std::vector<std::int64_t>& out, DType dtype) {
  const auto per_thread = static_cast<std::int64_t>(16 / dtype_size(dtype)) * kUnroll;
  return grid_1d((numel_of(out) + per_thread - 1) / per_thread, kGpuThreads);
}

// y = f(x) over numel(y) elements: kernel(x, y, n) or, with a scalar, kernel(x, y, n, scalar).
class MapRuntime final : public RuntimeOp {
 public:
  MapRuntime(DType dtype, std::optional<double> scalar) : dtype_(dtype), scalar_(scalar) {}
  int n_activation_inputs() const override { return 1; }
  std::vector<std::vector<std::int64_t>> param_shapes(const std::vector<std::vector<std::int64_t>>&,
                                                      const std::vector<std::int64_t>&) const override {
    return {};
  }
  void pack_args(const std::vector<DeviceTensor>& inputs, const std::vector<DeviceTensor>&,
                 const DeviceTensor& output, const std::vector<std::int64_t>& shape, std::int64_t,
                 ArgVisitor& v) const override {
    v.pointer(inputs[0].ptr);
    v.pointer(output.ptr);
    v.i64(numel_of(shape));
    if (scalar_) v.f64(*scalar_);
  }
  Dim3 block() const override { return {kGpuThreads, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>& shape) const override { return elementwise_grid(shape, dtype_); }

 private:
  DType dtype_;
  std::optional<double> scalar_;
};

// The kernel source of one op: elementwise.cu without its own entries, followed by the op's
// entry, which passes its parameters to an entry body of that file.
std::string entry_source(const std::string& entry, const std::string& params, const std::string& call) {
  return util::cat("#define KG_EW_ONE_ENTRY\n", kernel_file("elementwise.cu"),
                   "\nextern \"C\" __global__ void __launch_bounds__(KG_EW_THREADS)\n    ", entry, "(",
                   params, ") {\n  ", call, ";\n}\n");
}

const char* c_type(DType t) { return t == DType::F64 ? "double" : "float"; }

// The lowering of y = f(x): entry(x, y, n) calling body(x, y, n), or with a scalar argument
// `scalar_name` appended to both.
Lowered map_lowering(const std::string& op_name, const std::string& entry, DType dtype,
                     const std::string& body, const char* scalar_name, std::optional<double> scalar) {
  const char* t = c_type(dtype);
  std::string params = util::cat("const ", t, "* __restrict__ x, ", t, "* __restrict__ y, long long n");
  std::string args = "x, y, n";
  if (scalar) {
    params += util::cat(", double ", scalar_name);
    args += util::cat(", ", scalar_name);
  }
  return Lowered{op_name, entry_source(entry, params, util::cat(body, "(", args, ")")), entry,
                 std::make_shared<MapRuntime>(dtype, scalar)};
}

// y = a ⊙ b with broadcasting: kernel(a, b, y, n, KgBroadcast).
class BroadcastRuntime final : public RuntimeOp {
 public:
  BroadcastRuntime(DType dtype, const char* op_name) : dtype_(dtype), op_name_(op_name) {}
  int n_activation_inputs() const override { return 2; }
  std::vector<std::vector<std::int64_t>> param_shapes(const std::vector<std::vector<std::int64_t>>&,
                                                      const std::vector<std::int64_t>&) const override {
    return {};
  }
  void pack_args(const std::vector<DeviceTensor>& inputs, const std::vector<DeviceTensor>&,
                 const DeviceTensor& output, const std::vector<std::int64_t>& shape, std::int64_t,
                 ArgVisitor& v) const override {
    const GpuBroadcast bc = gpu_broadcast(inputs[0].shape, inputs[1].shape, shape, op_name_);
    v.pointer(inputs[0].ptr);
    v.pointer(inputs[1].ptr);
    v.pointer(output.ptr);
    v.i64(numel_of(shape));
    v.bytes(&bc, sizeof bc);
  }
  Dim3 block() const override { return {kGpuThreads, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>& shape) const override { return elementwise_grid(shape, dtype_); }

 private:
  DType dtype_;
  const char* op_name_;
};

// ---- unary activations ----

class UnaryOp final : public CustomOp {
 public:
  UnaryOp(UnarySpec spec, DType dtype) : spec_(spec), dtype_(dtype) {}
  std::string name() const override { return unary_entry(spec_.fn).op_name; }
  std::string attributes() const override {
    switch (spec_.fn) {
      case UnaryFn::LeakyRelu:
        return "negative_slope=" + format_double(spec_.param);
      case UnaryFn::GeluErf:
        return "approximate=none";
      case UnaryFn::GeluTanh:
        return "approximate=tanh";
      default:
        return {};
    }
  }
  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    if (spec_.fn == UnaryFn::LeakyRelu && !std::isfinite(spec_.param))
      throw Error(util::cat("negative_slope must be finite, got ", spec_.param));
    return in[0];
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override { return require_float(in); }

  std::optional<Lowered> lower() const override {
    const UnaryEntry& e = unary_entry(spec_.fn);
    return map_lowering(name(), entry_for(e.kernel, dtype_), dtype_,
                        util::cat("kg_unary_entry<", e.device_fn, ">"), "param", spec_.param);
  }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    dispatch_float(x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data<T>();
      T* yp = ctx.output.data<T>();
      ctx.parallel_for(x.numel(), kGrain,
                       [&](std::int64_t b, std::int64_t e) { apply_unary<T>(spec_, xp + b, yp + b, e - b); });
    });
  }

  const UnarySpec& spec() const { return spec_; }

 private:
  UnarySpec spec_;
  DType dtype_;  // the input's, for the kernel entry
};

// ---- dropout ----

// A counter-based random stream: element i of a run gets the same 64 bits however the work
// is split across threads (splitmix64 of seed and index).
inline std::uint64_t mix(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// y = x * (mask / (1 - p)) over [b, e), as PyTorch computes it (a dropped infinity gives NaN).
// Element i is kept when the top 32 bits of its random word are >= threshold = p * 2^32.
template <class T>
void dropout_range(const T* x, T* y, std::int64_t b, std::int64_t e, std::uint64_t seed,
                   std::uint64_t threshold, T scale) {
  for (std::int64_t i = b; i < e; ++i) {
    const bool keep = (mix(seed, static_cast<std::uint64_t>(i)) >> 32) >= threshold;
    y[i] = x[i] * (keep ? scale : T(0));
  }
}

class DropoutOp final : public CustomOp {
 public:
  DropoutOp(double p, DType dtype) : p_(p), dtype_(dtype) {}
  std::string name() const override { return "nn.dropout"; }
  std::string attributes() const override { return "p=" + format_double(p_); }
  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    if (!(p_ >= 0.0 && p_ < 1.0)) throw Error(util::cat("p must be in [0, 1), got ", p_));
    return in[0];
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override { return require_float(in); }

  // The GPU kernel is inference dropout, a copy: lower() has no mode, and the CUDA backend runs
  // inference only. Training on the GPU will need a masking kernel seeded per run.
  std::optional<Lowered> lower() const override {
    return map_lowering(name(), entry_for("kg_dropout", dtype_), dtype_, "kg_dropout_entry", nullptr,
                        std::nullopt);
  }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    const bool active = ctx.training && p_ > 0.0;
    const std::uint64_t seed = ctx.seed;
    const auto threshold = static_cast<std::uint64_t>(std::ldexp(p_, 32));
    dispatch_float(x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data<T>();
      T* yp = ctx.output.data<T>();
      const T scale = static_cast<T>(1.0 / (1.0 - p_));
      ctx.parallel_for(x.numel(), kGrain, [&](std::int64_t b, std::int64_t e) {
        if (!active) {
          std::memcpy(yp + b, xp + b, static_cast<std::size_t>(e - b) * sizeof(T));
          return;
        }
        dropout_range(xp, yp, b, e, seed, threshold, scale);
      });
    });
  }

 private:
  double p_;
  DType dtype_;
};

// ---- broadcasting walk ----

// The output's index space as few dims as possible: size-1 output dims dropped, and
// neighbours merged where both operands step through them contiguously (or both broadcast
// them). A stride is 0 where the operand is broadcast. Outermost dim first; never empty.
struct BroadcastPlan {
  std::vector<std::int64_t> size, stride_a, stride_b;
};

// Row-major strides of `in` aligned to the output's rank, 0 on broadcast dims.
std::vector<std::int64_t> aligned_strides(const std::vector<std::int64_t>& in, std::size_t rank) {
  std::vector<std::int64_t> s(rank, 0);
  std::int64_t acc = 1;
  const std::size_t lead = rank - in.size();
  for (std::size_t k = in.size(); k-- > 0;) {
    if (in[k] != 1) s[lead + k] = acc;
    acc *= in[k];
  }
  return s;
}

BroadcastPlan plan_broadcast(const std::vector<std::int64_t>& a, const std::vector<std::int64_t>& b,
                             const std::vector<std::int64_t>& out) {
  const std::vector<std::int64_t> sa = aligned_strides(a, out.size()), sb = aligned_strides(b, out.size());
  BroadcastPlan p;
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (out[i] == 1) continue;
    if (!p.size.empty() && p.stride_a.back() == sa[i] * out[i] && p.stride_b.back() == sb[i] * out[i]) {
      p.size.back() *= out[i];
      p.stride_a.back() = sa[i];
      p.stride_b.back() = sb[i];
    } else {
      p.size.push_back(out[i]);
      p.stride_a.push_back(sa[i]);
      p.stride_b.push_back(sb[i]);
    }
  }
  if (p.size.empty()) {  // a single element
    p.size.push_back(1);
    p.stride_a.push_back(0);
    p.stride_b.push_back(0);
  }
  return p;
}

// y[k] = a[k*sa] ⊙ b[k*sb] for k < n, where the inner strides are 1 or 0 (broadcast). The three
// cases are separate loops so each vectorises.
template <BinaryFn F, class T>
inline void binary_row(const T* a, const T* b, T* y, std::int64_t n, std::int64_t sa, std::int64_t sb) {
  if (sa != 0 && sb != 0) {
    for (std::int64_t k = 0; k < n; ++k) y[k] = binary_fn<F, T>(a[k], b[k]);
  } else if (sb == 0) {
    const T s = *b;
    for (std::int64_t k = 0; k < n; ++k) y[k] = binary_fn<F, T>(a[k], s);
  } else {
    const T s = *a;
    for (std::int64_t k = 0; k < n; ++k) y[k] = binary_fn<F, T>(s, b[k]);
  }
}

// y = a ⊙ b over the output's elements [begin, end): locate `begin` in the plan's outer dims,
// then run the inner dim row by row, carrying the outer index like an odometer.
template <BinaryFn F, class T>
void binary_range(const BroadcastPlan& p, const T* a, const T* b, T* y, std::int64_t begin,
                  std::int64_t end) {
  const std::size_t outer = p.size.size() - 1;
  const std::int64_t inner = p.size[outer], isa = p.stride_a[outer], isb = p.stride_b[outer];
  std::vector<std::int64_t> idx(outer, 0);
  std::int64_t off_a = 0, off_b = 0, col = begin % inner;
  for (std::int64_t r = begin / inner, d = static_cast<std::int64_t>(outer) - 1; d >= 0; --d) {
    const auto du = static_cast<std::size_t>(d);
    idx[du] = r % p.size[du];
    r /= p.size[du];
    off_a += idx[du] * p.stride_a[du];
    off_b += idx[du] * p.stride_b[du];
  }
  for (std::int64_t i = begin; i < end;) {
    const std::int64_t n = std::min(inner - col, end - i);
    binary_row<F, T>(a + off_a + col * isa, b + off_b + col * isb, y + i, n, isa, isb);
    i += n;
    col = 0;
    for (std::size_t d = outer; d-- > 0;) {
      off_a += p.stride_a[d];
      off_b += p.stride_b[d];
      if (++idx[d] < p.size[d]) break;
      off_a -= p.stride_a[d] * p.size[d];
      off_b -= p.stride_b[d] * p.size[d];
      idx[d] = 0;
    }
  }
}

class BinaryOp final : public CustomOp {
 public:
  BinaryOp(BinaryFn fn, DType dtype) : fn_(fn), dtype_(dtype) {}
  std::string name() const override { return binary_entry(fn_).op_name; }
  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 2);
    return broadcast_shapes(in[0], in[1]);
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override { return require_float(in); }

  std::optional<Lowered> lower() const override {
    const BinaryEntry& e = binary_entry(fn_);
    const std::string entry = entry_for(e.kernel, dtype_);
    const char* t = c_type(dtype_);
    const std::string params = util::cat("const ", t, "* __restrict__ a, const ", t, "* __restrict__ b, ", t,
                                         "* __restrict__ y, long long n, KgBroadcast bc");
    const std::string call = util::cat("kg_binary_entry<", e.device_fn, ">(a, b, y, n, bc)");
    return Lowered{e.op_name, entry_source(entry, params, call), entry,
                   std::make_shared<BroadcastRuntime>(dtype_, e.op_name)};
  }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& a = ctx.inputs[0];
    const Tensor& b = ctx.inputs[1];
    const std::int64_t n = ctx.output.numel();
    if (n == 0) return;
    const BroadcastPlan plan = plan_broadcast(a.shape(), b.shape(), ctx.output.shape());
    dispatch_float(a.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* ap = a.data<T>();
      const T* bp = b.data<T>();
      T* yp = ctx.output.data<T>();
      visit_binary(fn_, [&](auto f) {
        constexpr BinaryFn F = decltype(f)::value;
        ctx.parallel_for(n, kGrain, [&](std::int64_t lo, std::int64_t hi) {
          binary_range<F, T>(plan, ap, bp, yp, lo, hi);
        });
      });
    });
  }

 private:
  BinaryFn fn_;
  DType dtype_;  // of both inputs
};

// x ⊙ s, or s ⊙ x when `reversed` (rsub, rdiv).
class ScalarOp final : public CustomOp {
 public:
  ScalarOp(BinaryFn fn, double scalar, bool reversed, DType dtype)
      : fn_(fn), scalar_(scalar), reversed_(reversed), dtype_(dtype) {}
  std::string name() const override {
    const BinaryEntry& e = binary_entry(fn_);
    return reversed_ && e.rscalar_op_name ? e.rscalar_op_name : e.scalar_op_name;  // add, mul commute
  }
  std::string attributes() const override { return "scalar=" + format_double(scalar_); }
  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    return in[0];
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override { return require_float(in); }

  std::optional<Lowered> lower() const override {
    const BinaryEntry& e = binary_entry(fn_);
    const bool rev = reversed_ && e.rscalar_kernel;  // add and mul commute
    return map_lowering(name(), entry_for(rev ? e.rscalar_kernel : e.scalar_kernel, dtype_), dtype_,
                        util::cat("kg_scalar_entry<", e.device_fn, ", ", rev ? "true" : "false", ">"), "s",
                        scalar_);
  }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    dispatch_float(x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data<T>();
      T* yp = ctx.output.data<T>();
      const T s = static_cast<T>(scalar_);
      visit_binary(fn_, [&](auto f) {
        constexpr BinaryFn F = decltype(f)::value;
        ctx.parallel_for(x.numel(), kGrain, [&](std::int64_t lo, std::int64_t hi) {
          if (reversed_)
            binary_row<F, T>(&s, xp + lo, yp + lo, hi - lo, 0, 1);
          else
            binary_row<F, T>(xp + lo, &s, yp + lo, hi - lo, 1, 0);
        });
      });
    });
  }

 private:
  BinaryFn fn_;
  double scalar_;
  bool reversed_;
  DType dtype_;
};

SymTensor record_unary(const SymTensor& x, UnaryFn fn, double param, const std::string& name) {
  return x.record_custom(CustomData::make<UnaryOp>(UnarySpec{fn, param}, x.dtype()), {}, std::nullopt, name);
}

SymTensor record_binary(const SymTensor& a, const SymTensor& b, BinaryFn fn, const std::string& name) {
  return a.record_custom(CustomData::make<BinaryOp>(fn, a.dtype()), {b}, std::nullopt, name);
}

SymTensor record_scalar(const SymTensor& x, double s, BinaryFn fn, bool reversed, const std::string& name) {
  return x.record_custom(CustomData::make<ScalarOp>(fn, s, reversed, x.dtype()), {}, std::nullopt, name);
}

}  // namespace

std::optional<UnarySpec> unary_spec(const CustomOp& op) {
  if (const auto* u = dynamic_cast<const UnaryOp*>(&op)) return u->spec();
  return std::nullopt;
}

template <class T>
void apply_unary(const UnarySpec& spec, const T* x, T* y, std::int64_t n) {
  const T param = static_cast<T>(spec.param);
  visit_unary(spec.fn, [&](auto f) {
    constexpr UnaryFn F = decltype(f)::value;
    for (std::int64_t i = 0; i < n; ++i) y[i] = unary_fn<F, T>(x[i], param);
  });
}

template void apply_unary<float>(const UnarySpec&, const float*, float*, std::int64_t);
template void apply_unary<double>(const UnarySpec&, const double*, double*, std::int64_t);

GpuBroadcast gpu_broadcast(const std::vector<std::int64_t>& a, const std::vector<std::int64_t>& b,
                           const std::vector<std::int64_t>& out, const char* op_name) {
  GpuBroadcast g;
  const std::int64_t n = numel_of(out);
  if (n == 0) return g;  // nothing to write
  const BroadcastPlan p = plan_broadcast(a, b, out);
  const std::size_t rank = p.size.size();
  if (rank == 1 && p.stride_a[0] != 0 && p.stride_b[0] != 0) {
    g.mode = GpuBroadcastMode::Same;
    return g;
  }
  if (rank == 1 && (p.stride_a[0] != 0) != (p.stride_b[0] != 0)) {
    g.mode = p.stride_a[0] != 0 ? GpuBroadcastMode::ScalarB : GpuBroadcastMode::ScalarA;
    return g;
  }
  // Per channel: one operand is the whole output; the other steps through one merged dim.
  auto channel = [&](const std::vector<std::int64_t>& full, const std::vector<std::int64_t>& part_strides) {
    if (numel_of(full) != n) return false;
    std::size_t k = rank, nonzero = 0;
    for (std::size_t d = 0; d < rank; ++d)
      if (part_strides[d] != 0) k = d, ++nonzero;
    if (nonzero != 1 || part_strides[k] != 1) return false;
    std::int64_t inner = 1;
    for (std::size_t d = k + 1; d < rank; ++d) inner *= p.size[d];
    g.size[0] = fast_div(inner);
    g.size[1] = fast_div(p.size[k]);
    return true;
  };
  if (channel(a, p.stride_b)) {
    g.mode = GpuBroadcastMode::ChannelB;
    return g;
  }
  if (channel(b, p.stride_a)) {
    g.mode = GpuBroadcastMode::ChannelA;
    return g;
  }
  if (rank > static_cast<std::size_t>(kGpuBroadcastMaxDims))
    throw Error(util::cat(op_name, ": broadcasting ", sizes_to_string(a), " with ", sizes_to_string(b),
                          " to ", sizes_to_string(out), " needs ", rank,
                          " dims after merging; the GPU kernel handles up to ", kGpuBroadcastMaxDims));
  g.mode = GpuBroadcastMode::General;
  g.rank = static_cast<std::int32_t>(rank);
  for (std::size_t d = 0; d < rank; ++d) {  // innermost first
    const std::size_t src = rank - 1 - d;
    g.size[d] = fast_div(p.size[src]);
    g.stride_a[d] = p.stride_a[src];
    g.stride_b[d] = p.stride_b[src];
  }
  return g;
}

}  // namespace kg::ops

namespace kg {

using ops::BinaryFn;
using ops::UnaryFn;

SymTensor relu(const SymTensor& x, const std::string& name) {
  return ops::record_unary(x, UnaryFn::Relu, 0.0, name);
}
SymTensor leaky_relu(const SymTensor& x, double negative_slope, const std::string& name) {
  return ops::record_unary(x, UnaryFn::LeakyRelu, negative_slope, name);
}
SymTensor silu(const SymTensor& x, const std::string& name) {
  return ops::record_unary(x, UnaryFn::Silu, 0.0, name);
}
SymTensor gelu(const SymTensor& x, GeluApprox approx, const std::string& name) {
  return ops::record_unary(x, approx == GeluApprox::Tanh ? UnaryFn::GeluTanh : UnaryFn::GeluErf, 0.0, name);
}
SymTensor sigmoid(const SymTensor& x, const std::string& name) {
  return ops::record_unary(x, UnaryFn::Sigmoid, 0.0, name);
}
SymTensor tanh(const SymTensor& x, const std::string& name) {
  return ops::record_unary(x, UnaryFn::Tanh, 0.0, name);
}
SymTensor dropout(const SymTensor& x, double p, const std::string& name) {
  return x.record_custom(CustomData::make<ops::DropoutOp>(p, x.dtype()), {}, std::nullopt, name);
}

SymTensor add(const SymTensor& a, const SymTensor& b, const std::string& name) {
  return ops::record_binary(a, b, BinaryFn::Add, name);
}
SymTensor sub(const SymTensor& a, const SymTensor& b, const std::string& name) {
  return ops::record_binary(a, b, BinaryFn::Sub, name);
}
SymTensor mul(const SymTensor& a, const SymTensor& b, const std::string& name) {
  return ops::record_binary(a, b, BinaryFn::Mul, name);
}
SymTensor div(const SymTensor& a, const SymTensor& b, const std::string& name) {
  return ops::record_binary(a, b, BinaryFn::Div, name);
}

SymTensor add(const SymTensor& a, double b, const std::string& name) {
  return ops::record_scalar(a, b, BinaryFn::Add, false, name);
}
SymTensor sub(const SymTensor& a, double b, const std::string& name) {
  return ops::record_scalar(a, b, BinaryFn::Sub, false, name);
}
SymTensor mul(const SymTensor& a, double b, const std::string& name) {
  return ops::record_scalar(a, b, BinaryFn::Mul, false, name);
}
SymTensor div(const SymTensor& a, double b, const std::string& name) {
  return ops::record_scalar(a, b, BinaryFn::Div, false, name);
}
SymTensor rsub(const SymTensor& a, double b, const std::string& name) {
  return ops::record_scalar(a, b, BinaryFn::Sub, true, name);
}
SymTensor rdiv(const SymTensor& a, double b, const std::string& name) {
  return ops::record_scalar(a, b, BinaryFn::Div, true, name);
}

}  // namespace kg
