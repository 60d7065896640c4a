// The elementwise op family: activations (one op class driven by the UnaryFn table), dropout,
// and arithmetic with numpy broadcasting (one class for tensor ⊙ tensor, one for tensor ⊙ scalar).
#include "ops/elementwise.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <iterator>
#include <vector>

#include "kg/ops.hpp"
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

// ---- unary activations ----

class UnaryOp final : public CustomOp {
 public:
  explicit UnaryOp(UnarySpec spec) : spec_(spec) {}
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
  explicit DropoutOp(double p) : p_(p) {}
  std::string name() const override { return "nn.dropout"; }
  std::string attributes() const override { return "p=" + format_double(p_); }
  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    if (!(p_ >= 0.0 && p_ < 1.0)) throw Error(util::cat("p must be in [0, 1), got ", p_));
    return in[0];
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override { return require_float(in); }

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
  explicit BinaryOp(BinaryFn fn) : fn_(fn) {}
  std::string name() const override { return binary_entry(fn_).op_name; }
  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 2);
    return broadcast_shapes(in[0], in[1]);
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override { return require_float(in); }

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
};

// x ⊙ s, or s ⊙ x when `reversed` (rsub, rdiv).
class ScalarOp final : public CustomOp {
 public:
  ScalarOp(BinaryFn fn, double scalar, bool reversed) : fn_(fn), scalar_(scalar), reversed_(reversed) {}
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
};

SymTensor record_unary(const SymTensor& x, UnaryFn fn, double param, const std::string& name) {
  return x.record_custom(CustomData::make<UnaryOp>(UnarySpec{fn, param}), {}, std::nullopt, name);
}

SymTensor record_binary(const SymTensor& a, const SymTensor& b, BinaryFn fn, const std::string& name) {
  return a.record_custom(CustomData::make<BinaryOp>(fn), {b}, std::nullopt, name);
}

SymTensor record_scalar(const SymTensor& x, double s, BinaryFn fn, bool reversed, const std::string& name) {
  return x.record_custom(CustomData::make<ScalarOp>(fn, s, reversed), {}, std::nullopt, name);
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
  return x.record_custom(CustomData::make<ops::DropoutOp>(p), {}, std::nullopt, name);
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
