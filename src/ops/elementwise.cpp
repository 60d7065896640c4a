// The elementwise op family: activations (one op class driven by the UnaryFn table), dropout,
// and arithmetic with numpy broadcasting (one class for tensor ⊙ tensor, one for tensor ⊙ scalar).
// On the GPU (elementwise.cu) every op has its own entry, named in the tables; RuntimeOps launch
// them: one for y = f(x), one for dropout, one for broadcasting tensor ⊙ tensor. Each op's
// backward has its own entry too (elementwise_backward.cu, "<stem>_backward"), launched by the
// same RuntimeOps.
#include "ops/elementwise.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <iterator>
#include <vector>

#include "kg/ops.hpp"
#include "ops/divider.hpp"
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

constexpr unsigned kGpuThreads = KG_EW_THREADS;

// One thread per KG_UNROLL packs of KG_EW_PACK_BYTES bytes of output (kg_for_each_unrolled over
// the kernels' vector width), in grid-stride loops.
Dim3 elementwise_grid(const std::vector<std::int64_t>& out, DType dtype) {
  const auto per_thread = static_cast<std::int64_t>(KG_EW_PACK_BYTES / dtype_size(dtype)) * KG_UNROLL;
  return grid_1d((numel_of(out) + per_thread - 1) / per_thread, kGpuThreads);
}

// A launch of `entry` with the kernels' block.
Launch ew_launch(std::string entry, Dim3 grid, KernelArgs args) {
  return {std::move(entry), grid, {kGpuThreads, 1, 1}, 0, std::move(args)};
}

// The backward launch of a map: entry(s, dy, dx, n, param), where s is the tensor the derivative
// reads (the forward's input or output; null when it reads neither).
struct MapBackward {
  enum class Saved { None, Input, Output };
  std::string entry;
  Saved saved = Saved::None;
  double param = 0.0;
};

// y = f(x) over numel(y) elements: kernel(x, y, n) or, with a scalar, kernel(x, y, n, scalar).
class MapRuntime final : public RuntimeOp {
 public:
  MapRuntime(DType dtype, std::optional<double> scalar, MapBackward backward)
      : dtype_(dtype), scalar_(scalar), backward_(std::move(backward)) {}
  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.output.ptr);
    v.i64(t.output.numel());
    if (scalar_) v.f64(*scalar_);
  }
  Dim3 block() const override { return {kGpuThreads, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>& shape) const override { return elementwise_grid(shape, dtype_); }

  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    using S = MapBackward::Saved;
    const DevicePtr s = backward_.saved == S::Input    ? t.inputs.at(0).ptr
                        : backward_.saved == S::Output ? t.output.ptr
                                                       : DevicePtr{0};
    return {ew_launch(backward_.entry, elementwise_grid(t.grad_output.shape, dtype_),
                      {ptr(s), t.grad_output, t.grad_inputs.at(0), t.grad_output.numel(), backward_.param})};
  }

 private:
  DType dtype_;
  std::optional<double> scalar_;
  MapBackward backward_;
};

// The kernel source of one op: elementwise.cu (elementwise_backward.cu for a backward) without
// its own entries, followed by the op's entry, which passes its parameters to an entry body of
// elementwise.cuh.
std::string entry_source(const std::string& entry, const std::string& params, const std::string& call,
                         const char* file = "elementwise.cu") {
  return util::cat("#define KG_EW_ONE_ENTRY\n", kernel_file(file),
                   "\nextern \"C\" __global__ void __launch_bounds__(KG_EW_THREADS)\n    ", entry, "(",
                   params, ") {\n  ", call, ";\n}\n");
}

const char* c_type(DType t) { return t == DType::F64 ? "double" : "float"; }

// The lowering of y = f(x): entry(x, y, n) calling body(x, y, n), or with a scalar argument
// `scalar_name` appended to both.
Lowered map_lowering(const std::string& op_name, const std::string& entry, DType dtype,
                     const std::string& body, const char* scalar_name, std::optional<double> scalar,
                     MapBackward backward) {
  const char* t = c_type(dtype);
  std::string params = util::cat("const ", t, "* __restrict__ x, ", t, "* __restrict__ y, long long n");
  std::string args = "x, y, n";
  if (scalar) {
    params += util::cat(", double ", scalar_name);
    args += util::cat(", ", scalar_name);
  }
  return Lowered{op_name, entry_source(entry, params, util::cat(body, "(", args, ")")), entry,
                 std::make_shared<MapRuntime>(dtype, scalar, std::move(backward))};
}

// The backward source of a map: entry(s, dy, dx, n, param) calling body(s, dy, dx, n, param).
std::string map_backward_source(const std::string& entry, DType dtype, const std::string& body) {
  const char* t = c_type(dtype);
  return entry_source(entry,
                      util::cat("const ", t, "* __restrict__ s, const ", t, "* __restrict__ dy, ", t,
                                "* __restrict__ dx, long long n, double param"),
                      util::cat(body, "(s, dy, dx, n, param)"), "elementwise_backward.cu");
}

// How the backward kernel sums the output's contributions into the gradient of operand `which`
// (0: a, 1: b) of out = broadcast(a, b): the KgReduce of elementwise_shared.cuh.
KgReduce gpu_reduce(int which, const std::vector<std::int64_t>& a, const std::vector<std::int64_t>& b,
                    const std::vector<std::int64_t>& out, const char* op_name);

// Blocks of a reduction's phase 0 (one per `width` elements of the gradient and split) or
// phase 1 (a thread per element).
Dim3 reduce_grid(const KgReduce& p, int phase) {
  if (phase == 1) return grid_1d(p.m, kGpuThreads);
  const std::int64_t tiles = (p.m + p.width - 1) / p.width;
  return {static_cast<unsigned>(std::clamp<std::int64_t>(tiles * p.splits, 1, 65535LL * 32)), 1, 1};
}

// y = a ⊙ b with broadcasting: kernel(a, b, y, n, KgBroadcast). Backward: for each wanted operand
// i, kernel(dy, a, b, g, scratch, KgReduce, i, phase) with phase 0, then phase 1 when its
// reduction is split (the partial sums in scratch).
class BroadcastRuntime final : public RuntimeOp {
 public:
  BroadcastRuntime(DType dtype, const char* op_name, std::string backward_entry)
      : dtype_(dtype), op_name_(op_name), backward_entry_(std::move(backward_entry)) {}
  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    const KgBroadcast bc = gpu_broadcast(t.inputs[0].shape, t.inputs[1].shape, t.output.shape, op_name_);
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.inputs[1].ptr);
    v.pointer(t.output.ptr);
    v.i64(t.output.numel());
    v.bytes(&bc, sizeof bc);
  }
  Dim3 block() const override { return {kGpuThreads, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>& shape) const override { return elementwise_grid(shape, dtype_); }

  std::size_t backward_scratch_bytes(const LaunchTensors& t) const override {
    std::size_t bytes = 0;
    for (int which = 0; which < 2; ++which) {
      const KgReduce p = plan(which, t);
      if (p.splits > 1)
        bytes = std::max(bytes, static_cast<std::size_t>(p.splits * p.m) * dtype_size(dtype_));
    }
    return bytes;
  }
  // The wanted operands in order (operand 0 when neither is), phase 1 after phase 0 where the
  // reduction is split.
  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    std::vector<Launch> l;
    for (int which = 0; which < 2; ++which) {
      if (t.grad_inputs.size() > static_cast<std::size_t>(which) &&
          t.grad_inputs[static_cast<std::size_t>(which)].ptr == 0)
        continue;
      const KgReduce p = plan(which, t);
      l.push_back(reduce_launch(t, which, 0, p));
      if (p.splits > 1) l.push_back(reduce_launch(t, which, 1, p));
    }
    if (l.empty()) l.push_back(reduce_launch(t, 0, 0, plan(0, t)));
    return l;
  }

 private:
  KgReduce plan(int which, const LaunchTensors& t) const {
    return gpu_reduce(which, t.inputs.at(0).shape, t.inputs.at(1).shape, t.grad_output.shape, op_name_);
  }
  Launch reduce_launch(const LaunchTensors& t, int which, int phase, const KgReduce& p) const {
    return ew_launch(
        backward_entry_, reduce_grid(p, phase),
        {t.grad_output, t.inputs.at(0), t.inputs.at(1), t.grad_inputs.at(static_cast<std::size_t>(which)),
         ptr(p.splits > 1 ? t.scratch : DevicePtr{0}), raw_bytes(&p, sizeof p), which, phase});
  }
  DType dtype_;
  const char* op_name_;
  std::string backward_entry_;
};

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

  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    const DType dtype = ctx.output_dtype;
    const UnaryEntry& e = unary_entry(spec_.fn);
    MapBackward bwd{backward_entry(dtype),
                    uses_output() ? MapBackward::Saved::Output : MapBackward::Saved::Input, spec_.param};
    return map_lowering(name(), entry_for(e.kernel, dtype), dtype,
                        util::cat("kg_unary_entry<", e.device_fn, ">"), "param", spec_.param, std::move(bwd));
  }
  std::string lower_backward_source(const LowerContext& ctx) const override {
    return map_backward_source(backward_entry(ctx.output_dtype), ctx.output_dtype,
                               util::cat("kg_unary_backward_entry<", unary_entry(spec_.fn).device_fn, ">"));
  }

  bool has_cpu_backward() const override { return true; }
  // Relu, sigmoid and tanh differentiate through their output; the others through the input.
  BackwardSaves backward_saves() const override { return {!uses_output(), uses_output()}; }
  void cpu_backward(CpuBackwardContext& ctx) const override {
    if (!ctx.wants_input_grad(0)) return;
    const Tensor& saved = uses_output() ? ctx.output : ctx.inputs[0];
    dispatch_float(ctx.grad_output.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* sp = saved.data<T>();
      const T* dy = ctx.grad_output.data<T>();
      T* dx = ctx.grad_inputs[0].data<T>();
      const T param = static_cast<T>(spec_.param);
      visit_unary(spec_.fn, [&](auto f) {
        constexpr UnaryFn F = decltype(f)::value;
        ctx.parallel_for(ctx.grad_output.numel(), kGrain, [&](std::int64_t b, std::int64_t e) {
          for (std::int64_t i = b; i < e; ++i) dx[i] = unary_grad<F, T>(sp[i], dy[i], param);
        });
      });
    });
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

  // f(x) = kg_unary_fn<F>(x, param); f'(x) from kg_unary_grad with dy = 1 (every derivative there
  // is linear in dy), through the output where the op's backward reads it.
  std::optional<ElementwiseForm> elementwise_form(const std::vector<DType>& in) const override {
    if (in.size() != 1 || (in[0] != DType::F32 && in[0] != DType::F64)) return std::nullopt;
    const UnaryEntry& e = unary_entry(spec_.fn);
    const std::string param = device_literal(spec_.param);
    ElementwiseForm f;
    f.function = "f";
    f.derivative = "d";
    f.device_source = util::cat(
        "template <class T> __device__ __forceinline__ T f(T x) { return kg_unary_fn<", e.device_fn, ">(x, (T)", param,
        "); }\ntemplate <class T> __device__ __forceinline__ T d(int, T x, T y) { return kg_unary_grad<", e.device_fn,
        ">(", uses_output() ? "y" : "x", ", (T)1, (T)", param, "); }\n");
    const UnarySpec spec = spec_;
    f.cpu = [spec](const ElementwiseSpan& s) {
      dispatch_float(s.dtype, [&](auto zero) {
        using T = decltype(zero);
        apply_unary<T>(spec, static_cast<const T*>(s.inputs[0]), static_cast<T*>(s.result), s.n);
      });
    };
    const bool through_output = uses_output();
    f.cpu_derivative = [spec, through_output](const ElementwiseSpan& s) {
      dispatch_float(s.dtype, [&](auto zero) {
        using T = decltype(zero);
        const T* src = static_cast<const T*>(through_output ? s.output : s.inputs[0]);
        T* r = static_cast<T*>(s.result);
        const T param = static_cast<T>(spec.param);
        visit_unary(spec.fn, [&](auto fn) {
          constexpr UnaryFn F = decltype(fn)::value;
          for (std::int64_t i = 0; i < s.n; ++i) r[i] = unary_grad<F, T>(src[i], T(1), param);
        });
      });
    };
    return f;
  }

  const UnarySpec& spec() const { return spec_; }

 private:
  bool uses_output() const { return unary_grad_uses_output(spec_.fn); }
  std::string backward_entry(DType dtype) const {
    return entry_for(std::string(unary_entry(spec_.fn).kernel) + "_backward", dtype);
  }
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
// The backward is the same function of dy: dx = dy * (mask / (1 - p)).
template <class T>
void dropout_range(const T* x, T* y, std::int64_t b, std::int64_t e, std::uint64_t seed,
                   std::uint64_t threshold, T scale) {
  for (std::int64_t i = b; i < e; ++i) {
    const bool keep = (mix(seed, static_cast<std::uint64_t>(i)) >> 32) >= threshold;
    y[i] = x[i] * (keep ? scale : T(0));
  }
}

// nn.dropout on the GPU. Forward: kernel(x, y, n, seed, threshold, scale, training), one entry
// for both modes, described again on every run: in a train-mode run the mask drawn from the
// run's seed, the one cpu_forward draws from ctx.seed; otherwise a copy. Backward:
// kg_dropout_backward(dy, dx, n, seed, threshold, scale, training), the forward's mask drawn again
// from the forward's seed when `training` and the run trains.
class DropoutRuntime final : public RuntimeOp {
 public:
  DropoutRuntime(double p, DType dtype, bool training) : p_(p), dtype_(dtype), training_(training) {}
  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.output.ptr);
    v.i64(t.output.numel());
    v.i64(static_cast<std::int64_t>(t.seed));  // the kernel takes the bits back as unsigned
    v.i64(threshold());
    v.f64(1.0 / (1.0 - p_));
    v.i32(t.training && p_ > 0.0 ? 1 : 0);
  }
  Dim3 block() const override { return {kGpuThreads, 1, 1}; }
  Dim3 grid(const std::vector<std::int64_t>& shape) const override { return elementwise_grid(shape, dtype_); }

  bool supports_train_mode() const override { return true; }
  bool depends_on_run() const override { return true; }

  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    return {ew_launch(
        entry_for("kg_dropout_backward", dtype_), elementwise_grid(t.grad_output.shape, dtype_),
        {t.grad_output, t.grad_inputs.at(0), t.grad_output.numel(), static_cast<std::int64_t>(t.seed),
         threshold(), 1.0 / (1.0 - p_), training_ && t.training && p_ > 0.0 ? 1 : 0})};
  }

 private:
  // Element i is kept when the top 32 bits of its random word are >= p * 2^32.
  std::int64_t threshold() const { return static_cast<std::int64_t>(std::ldexp(p_, 32)); }
  double p_;
  DType dtype_;
  bool training_;
};

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

  // One GPU entry for both modes, selected per run by its `training` argument (DropoutRuntime).
  // The backward kernel is built for training and follows the forward's mode
  // (LaunchTensors::training).
  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    const DType dtype = ctx.output_dtype;
    const char* t = c_type(dtype);
    const std::string entry = entry_for("kg_dropout", dtype);
    const std::string params = util::cat("const ", t, "* __restrict__ x, ", t,
                                         "* __restrict__ y, long long n, long long seed, "
                                         "long long threshold, double scale, int training");
    return Lowered{name(),
                   entry_source(entry, params, "kg_dropout_entry(x, y, n, seed, threshold, scale, training)"),
                   entry, dropout_runtime(p_, dtype, true)};
  }
  std::string lower_backward_source(const LowerContext& ctx) const override {
    const char* t = c_type(ctx.output_dtype);
    return entry_source(entry_for("kg_dropout_backward", ctx.output_dtype),
                        util::cat("const ", t, "* __restrict__ dy, ", t,
                                  "* __restrict__ dx, long long n, long long seed, long long threshold, "
                                  "double scale, int training"),
                        "kg_dropout_backward_entry(dy, dx, n, seed, threshold, scale, training)",
                        "elementwise_backward.cu");
  }

  bool has_cpu_backward() const override { return true; }
  BackwardSaves backward_saves() const override { return {false, false}; }
  // dx = dy * (mask / (1 - p)) with the forward's mask (drawn again from the same seed) in
  // training; dx = dy in inference.
  void cpu_backward(CpuBackwardContext& ctx) const override {
    if (!ctx.wants_input_grad(0)) return;
    const bool active = ctx.training && p_ > 0.0;
    const std::uint64_t seed = ctx.seed;
    const auto threshold = static_cast<std::uint64_t>(std::ldexp(p_, 32));
    dispatch_float(ctx.grad_output.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* dy = ctx.grad_output.data<T>();
      T* dx = ctx.grad_inputs[0].data<T>();
      const T scale = static_cast<T>(1.0 / (1.0 - p_));
      ctx.parallel_for(ctx.grad_output.numel(), kGrain, [&](std::int64_t b, std::int64_t e) {
        if (!active) {
          std::memcpy(dx + b, dy + b, static_cast<std::size_t>(e - b) * sizeof(T));
          return;
        }
        dropout_range(dy, dx, b, e, seed, threshold, scale);
      });
    });
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

KgReduce gpu_reduce(int which, const std::vector<std::int64_t>& a, const std::vector<std::int64_t>& b,
                    const std::vector<std::int64_t>& out, const char* op_name) {
  KgReduce g{};
  std::fill(std::begin(g.kept_size), std::end(g.kept_size), kg_divider(1));
  std::fill(std::begin(g.red_size), std::end(g.red_size), kg_divider(1));
  g.width = 1;
  g.splits = 1;
  const std::vector<std::int64_t>& target = which == 0 ? a : b;
  g.m = numel_of(target);
  const std::int64_t n = numel_of(out);
  auto pow2 = [](std::int64_t v, std::int64_t cap) {
    std::int64_t w = 1;
    while (w < v && w < cap) w *= 2;
    return w;
  };
  if (n == 0 || g.m == 0) {  // a gradient of zeros (or nothing to write)
    g.width = static_cast<std::int32_t>(kGpuThreads);
    return g;
  }
  g.r = n / g.m;
  // The output's dims, outermost first, merged where every stride continues and the target
  // keeps (or reduces) both.
  struct Run {
    std::int64_t size, so, sa, sb;
    bool reduced;
  };
  const std::size_t rank = out.size(), lead = rank - target.size();
  const std::vector<std::int64_t> sa = aligned_strides(a, rank), sb = aligned_strides(b, rank);
  std::vector<std::int64_t> so(rank, 1);
  for (std::size_t d = rank; d-- > 1;) so[d - 1] = so[d] * out[d];
  std::vector<Run> runs;
  for (std::size_t d = 0; d < rank; ++d) {
    if (out[d] == 1) continue;
    const bool reduced = d < lead || target[d - lead] == 1;
    if (!runs.empty()) {
      Run& p = runs.back();
      if (p.reduced == reduced && p.so == so[d] * out[d] && p.sa == sa[d] * out[d] &&
          p.sb == sb[d] * out[d]) {
        p.size *= out[d];
        p.so = so[d];
        p.sa = sa[d];
        p.sb = sb[d];
        continue;
      }
    }
    runs.push_back({out[d], so[d], sa[d], sb[d], reduced});
  }
  for (std::size_t i = runs.size(); i-- > 0;) {  // innermost first
    const Run& r = runs[i];
    std::int32_t& k = r.reduced ? g.red_rank : g.kept_rank;
    if (k >= KG_EW_MAX_DIMS)
      throw Error(util::cat(op_name, " backward: the gradient of ", sizes_to_string(target), " from ",
                            sizes_to_string(out), " needs more than ", KG_EW_MAX_DIMS, " ",
                            r.reduced ? "reduced" : "kept", " dims after merging; the GPU kernel handles ",
                            KG_EW_MAX_DIMS));
    const auto u = static_cast<std::size_t>(k++);
    (r.reduced ? g.red_size : g.kept_size)[u] = kg_divider(r.size);
    (r.reduced ? g.red_so : g.kept_so)[u] = r.so;
    (r.reduced ? g.red_sa : g.kept_sa)[u] = r.sa;
    (r.reduced ? g.red_sb : g.kept_sb)[u] = r.sb;
  }
  // Enough groups of threads to split each sum; adjacent elements side by side when the target
  // keeps the innermost dim (coalesced reads).
  std::int64_t width = static_cast<std::int64_t>(kGpuThreads) / pow2(g.r, kGpuThreads);
  if (g.r > 1 && !runs.empty() && !runs.back().reduced) width = std::max(width, pow2(runs.back().size, 32));
  g.width = static_cast<std::int32_t>(width);
  // Split long reductions over several blocks when the target's tiles alone are too few for the
  // GPU (about 2048 blocks), keeping at least 64 elements per thread and split.
  const std::int64_t tiles = (g.m + width - 1) / width,
                     groups = static_cast<std::int64_t>(kGpuThreads) / width;
  const std::int64_t splits = std::clamp<std::int64_t>(
      std::min<std::int64_t>((2048 + tiles - 1) / tiles, g.r / (groups * 64)), 1, 4096);
  g.chunk = (g.r + splits - 1) / splits;
  g.splits = static_cast<std::int32_t>((g.r + g.chunk - 1) / g.chunk);
  return g;
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

}  // namespace

// The output's dims are merged into runs that `target` keeps or reduces. Each task owns a block of
// target elements and sums in a fixed order (in double), so the result does not depend on the
// threads.
template <class T>
void sum_to_shape(const CpuContext& ctx, const T* src, const std::vector<std::int64_t>& out,
                  const std::vector<std::int64_t>& target, T* dst, bool negate) {
  const std::int64_t m = numel_of(target);
  if (m == 0) return;
  if (numel_of(out) == 0) {  // nothing reaches the target: its gradient is zero
    std::fill(dst, dst + m, T(0));
    return;
  }
  struct Run {
    std::int64_t size, stride;  // stride: src elements per step
    bool reduced;
  };
  std::vector<Run> runs;
  const std::size_t lead = out.size() - target.size();
  std::int64_t stride = numel_of(out);
  for (std::size_t d = 0; d < out.size(); ++d) {
    stride /= out[d];
    if (out[d] == 1) continue;
    const bool reduced = d < lead || target[d - lead] == 1;
    if (!runs.empty() && runs.back().reduced == reduced) {
      runs.back().size *= out[d];
      runs.back().stride = stride;
    } else {
      runs.push_back({out[d], stride, reduced});
    }
  }
  if (runs.empty()) runs.push_back({1, 1, false});
  // The innermost run: columns summed side by side (kept) or one contiguous sum (reduced).
  const Run inner = runs.back();
  runs.pop_back();
  std::vector<Run> kept, red;
  for (const Run& r : runs) (r.reduced ? red : kept).push_back(r);
  const std::int64_t cols = inner.reduced ? 1 : inner.size, len = inner.reduced ? inner.size : 1;
  constexpr std::int64_t kCols = 512;
  const std::int64_t chunks = (cols + kCols - 1) / kCols, outer = m / cols;
  const std::int64_t per_target = numel_of(out) / m;
  ctx.parallel_for(
      outer * chunks,
      std::max<std::int64_t>(1, kGrain / std::max<std::int64_t>(1, per_target * std::min(cols, kCols))),
      [&](std::int64_t t0, std::int64_t t1) {
        std::vector<double> acc(static_cast<std::size_t>(std::min(cols, kCols)));
        std::vector<std::int64_t> idx(red.size());
        for (std::int64_t t = t0; t < t1; ++t) {
          const std::int64_t o = t / chunks, c0 = (t % chunks) * kCols;
          const std::int64_t w = std::min(kCols, cols - c0);
          std::int64_t base = 0;
          for (std::int64_t rem = o, k = std::ssize(kept) - 1; k >= 0; --k) {
            const Run& r = kept[static_cast<std::size_t>(k)];
            base += (rem % r.size) * r.stride;
            rem /= r.size;
          }
          std::fill(acc.begin(), acc.begin() + w, 0.0);
          std::fill(idx.begin(), idx.end(), 0);
          std::int64_t off = 0;
          while (true) {
            const T* p = src + base + off + c0;
            if (inner.reduced) {
              double s = 0;
              for (std::int64_t j = 0; j < len; ++j) s += static_cast<double>(p[j]);
              acc[0] += s;
            } else {
              for (std::int64_t j = 0; j < w; ++j) acc[static_cast<std::size_t>(j)] += p[j];
            }
            std::size_t k = red.size();
            while (k-- > 0) {  // odometer over the outer reduced runs
              off += red[k].stride;
              if (++idx[k] < red[k].size) break;
              off -= red[k].stride * red[k].size;
              idx[k] = 0;
            }
            if (k == static_cast<std::size_t>(-1)) break;
          }
          T* d = dst + o * cols + c0;
          for (std::int64_t j = 0; j < w; ++j) {
            const double v = acc[static_cast<std::size_t>(j)];
            d[j] = static_cast<T>(negate ? -v : v);
          }
        }
      });
}

template void sum_to_shape<float>(const CpuContext&, const float*, const std::vector<std::int64_t>&,
                                  const std::vector<std::int64_t>&, float*, bool);
template void sum_to_shape<double>(const CpuContext&, const double*, const std::vector<std::int64_t>&,
                                   const std::vector<std::int64_t>&, double*, bool);

// nn.add's reduction (KgReduce, kg_binary_backward_entry<KG_ADD>) with dy summed onto operand a,
// the target; b is the output's shape, so it is broadcast nowhere.
std::size_t gpu_sum_to_shape_scratch(const std::vector<std::int64_t>& out, const std::vector<std::int64_t>& target,
                                     DType dtype, const char* op_name) {
  const KgReduce p = gpu_reduce(0, target, out, out, op_name);
  return p.splits > 1 ? static_cast<std::size_t>(p.splits * p.m) * dtype_size(dtype) : 0;
}

std::vector<Launch> gpu_sum_to_shape(const std::string& entry, DevicePtr src, DevicePtr dst, DevicePtr partial,
                                     const std::vector<std::int64_t>& out, const std::vector<std::int64_t>& target,
                                     const char* op_name) {
  const KgReduce p = gpu_reduce(0, target, out, out, op_name);
  std::vector<Launch> l;
  for (int phase = 0; phase < (p.splits > 1 ? 2 : 1); ++phase)
    l.push_back(ew_launch(entry, reduce_grid(p, phase),
                          {ptr(src), ptr(0), ptr(0), ptr(dst), ptr(p.splits > 1 ? partial : DevicePtr{0}),
                           raw_bytes(&p, sizeof p), 0, phase}));
  return l;
}

namespace {

class BinaryOp final : public CustomOp {
 public:
  explicit BinaryOp(BinaryFn fn) : fn_(fn) {}
  std::string name() const override { return binary_entry(fn_).op_name; }
  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 2);
    return broadcast_shapes(in[0], in[1]);
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override { return require_float(in); }

  // The kernels of the inputs' (and output's) dtype.
  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    const DType dtype = ctx.output_dtype;
    const BinaryEntry& e = binary_entry(fn_);
    const std::string entry = entry_for(e.kernel, dtype);
    const char* t = c_type(dtype);
    const std::string params = util::cat("const ", t, "* __restrict__ a, const ", t, "* __restrict__ b, ", t,
                                         "* __restrict__ y, long long n, KgBroadcast bc");
    const std::string call = util::cat("kg_binary_entry<", e.device_fn, ">(a, b, y, n, bc)");
    return Lowered{e.op_name, entry_source(entry, params, call), entry,
                   std::make_shared<BroadcastRuntime>(dtype, e.op_name, backward_entry(dtype))};
  }
  std::string lower_backward_source(const LowerContext& ctx) const override {
    const char* t = c_type(ctx.output_dtype);
    const std::string params = util::cat(
        "const ", t, "* __restrict__ dy, const ", t, "* __restrict__ a, const ", t, "* __restrict__ b, ", t,
        "* __restrict__ g, ", t, "* __restrict__ partial, KgReduce p, int which, int phase");
    return entry_source(backward_entry(ctx.output_dtype), params,
                        util::cat("kg_binary_backward_entry<", binary_entry(fn_).device_fn,
                                  ">(dy, a, b, g, partial, p, which, phase)"),
                        "elementwise_backward.cu");
  }

  bool has_cpu_backward() const override { return true; }
  // add and sub need only shapes; mul and div read both operands.
  BackwardSaves backward_saves() const override {
    const bool reads = fn_ == BinaryFn::Mul || fn_ == BinaryFn::Div;
    return {reads, false};
  }
  // The gradient of each wanted operand: the contributions dy ∂y/∂operand over the output
  // (computed with the forward's broadcasting loops), summed over the operand's broadcast dims.
  void cpu_backward(CpuBackwardContext& ctx) const override {
    const auto& out = ctx.grad_output.shape();
    const std::int64_t n = numel_of(out);
    dispatch_float(ctx.grad_output.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* dy = ctx.grad_output.data<T>();
      // y[i] = u[i] ⊙ v[broadcast] over the output, u being output-shaped.
      auto apply = [&](auto f, const T* u, const Tensor& v, T* y) {
        constexpr BinaryFn F = decltype(f)::value;
        const BroadcastPlan plan = plan_broadcast(out, v.shape(), out);
        const T* vp = v.data<T>();
        ctx.parallel_for(
            n, kGrain, [&](std::int64_t lo, std::int64_t hi) { binary_range<F, T>(plan, u, vp, y, lo, hi); });
      };
      using Mul = std::integral_constant<BinaryFn, BinaryFn::Mul>;
      using Div = std::integral_constant<BinaryFn, BinaryFn::Div>;
      std::vector<T> tmp;
      for (std::size_t which = 0; which < 2; ++which) {
        if (!ctx.wants_input_grad(which)) continue;
        const auto& target = ctx.grad_inputs[which].shape();
        T* g = ctx.grad_inputs[which].data<T>();
        const bool reduce = numel_of(target) != n;
        const bool negate = (fn_ == BinaryFn::Sub && which == 1) || (fn_ == BinaryFn::Div && which == 1);
        const T* contrib = dy;  // add, sub: dy itself
        if (fn_ == BinaryFn::Mul || fn_ == BinaryFn::Div) {
          T* c = g;
          if (reduce) {
            tmp.resize(static_cast<std::size_t>(n));
            c = tmp.data();
          }
          const Tensor& a = ctx.inputs[0];
          const Tensor& b = ctx.inputs[1];
          if (fn_ == BinaryFn::Mul) {
            apply(Mul{}, dy, which == 0 ? b : a, c);  // dy * other
          } else if (which == 0) {
            apply(Div{}, dy, b, c);  // dy / b
          } else {
            apply(Mul{}, dy, a, c);  // -((dy * a) / b) / b, negated below
            apply(Div{}, c, b, c);
            apply(Div{}, c, b, c);
          }
          contrib = c;
        }
        if (reduce) {
          sum_to_shape<T>(ctx, contrib, out, target, g, negate);
        } else {
          ctx.parallel_for(n, kGrain, [&](std::int64_t lo, std::int64_t hi) {
            if (negate)
              for (std::int64_t i = lo; i < hi; ++i) g[i] = -contrib[i];
            else if (contrib != g)
              std::memcpy(g + lo, contrib + lo, static_cast<std::size_t>(hi - lo) * sizeof(T));
          });
        }
      }
    });
  }

  // f(a, b) = a ⊙ b; df/da and df/db as the backward computes them.
  std::optional<ElementwiseForm> elementwise_form(const std::vector<DType>& in) const override {
    if (in.size() != 2 || in[0] != in[1] || (in[0] != DType::F32 && in[0] != DType::F64)) return std::nullopt;
    static constexpr const char* kDerivative[] = {
        "(T)1", "i == 0 ? (T)1 : (T)-1", "i == 0 ? b : a", "i == 0 ? (T)1 / b : -((a / b) / b)"};
    ElementwiseForm f;
    f.function = "f";
    f.derivative = "d";
    f.device_source = util::cat("template <class T> __device__ __forceinline__ T f(T a, T b) { return kg_binary_fn<",
                                binary_entry(fn_).device_fn,
                                ">(a, b); }\ntemplate <class T> __device__ __forceinline__ T d(int i, T a, T b, T) { "
                                "return ",
                                kDerivative[static_cast<int>(fn_)], "; }\n");
    visit_binary(fn_, [&](auto fn) {
      constexpr BinaryFn F = decltype(fn)::value;
      f.cpu = ElementwiseForm::cpu_map<2>([](auto a, auto b) { return binary_fn<F>(a, b); });
      f.cpu_derivative = ElementwiseForm::cpu_map_derivative<2>([](int i, auto a, auto b, auto) {
        using T = decltype(a);
        if constexpr (F == BinaryFn::Add) return T(1);
        else if constexpr (F == BinaryFn::Sub) return i == 0 ? T(1) : T(-1);
        else if constexpr (F == BinaryFn::Mul) return i == 0 ? b : a;
        else return i == 0 ? T(1) / b : -((a / b) / b);
      });
    });
    return f;
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
  std::string backward_entry(DType dtype) const {
    return entry_for(std::string(binary_entry(fn_).kernel) + "_backward", dtype);
  }
  BinaryFn fn_;

 public:
  BinaryFn fn() const { return fn_; }
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

  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    const DType dtype = ctx.output_dtype;
    const BinaryEntry& e = binary_entry(fn_);
    const bool rev = reversed_ && e.rscalar_kernel;  // add and mul commute
    MapBackward bwd{backward_entry(dtype),
                    reads_input() ? MapBackward::Saved::Input : MapBackward::Saved::None, scalar_};
    return map_lowering(name(), entry_for(rev ? e.rscalar_kernel : e.scalar_kernel, dtype), dtype,
                        util::cat("kg_scalar_entry<", e.device_fn, ", ", rev ? "true" : "false", ">"), "s",
                        scalar_, std::move(bwd));
  }
  std::string lower_backward_source(const LowerContext& ctx) const override {
    const BinaryEntry& e = binary_entry(fn_);
    return map_backward_source(
        backward_entry(ctx.output_dtype), ctx.output_dtype,
        util::cat("kg_scalar_backward_entry<", e.device_fn, ", ", reversed() ? "true" : "false", ">"));
  }

  bool has_cpu_backward() const override { return true; }
  // Only s / x reads x; the others need the shape alone.
  BackwardSaves backward_saves() const override { return {reads_input(), false}; }
  void cpu_backward(CpuBackwardContext& ctx) const override {
    if (!ctx.wants_input_grad(0)) return;
    dispatch_float(ctx.grad_output.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* dy = ctx.grad_output.data<T>();
      const T* xp = reads_input() ? ctx.inputs[0].data<T>() : nullptr;
      T* dx = ctx.grad_inputs[0].data<T>();
      const T s = static_cast<T>(scalar_);
      const bool neg = fn_ == BinaryFn::Sub && reversed();
      ctx.parallel_for(ctx.grad_output.numel(), kGrain, [&](std::int64_t lo, std::int64_t hi) {
        switch (fn_) {
          case BinaryFn::Add:
          case BinaryFn::Sub:
            for (std::int64_t i = lo; i < hi; ++i) dx[i] = neg ? -dy[i] : dy[i];
            break;
          case BinaryFn::Mul:
            for (std::int64_t i = lo; i < hi; ++i) dx[i] = dy[i] * s;
            break;
          case BinaryFn::Div:
            if (reversed())
              for (std::int64_t i = lo; i < hi; ++i) dx[i] = -(dy[i] * ((s / xp[i]) / xp[i]));
            else
              for (std::int64_t i = lo; i < hi; ++i) dx[i] = dy[i] / s;
            break;
        }
      });
    });
  }

  // f(x) = x ⊙ s (or s ⊙ x); f'(x) as the backward computes it.
  std::optional<ElementwiseForm> elementwise_form(const std::vector<DType>& in) const override {
    if (in.size() != 1 || (in[0] != DType::F32 && in[0] != DType::F64)) return std::nullopt;
    const bool rev = reversed();
    const std::string s = util::cat("(T)", device_literal(scalar_));
    const char* op = binary_entry(fn_).device_fn;
    std::string derivative;
    switch (fn_) {
      case BinaryFn::Add: derivative = "(T)1"; break;
      case BinaryFn::Sub: derivative = rev ? "(T)-1" : "(T)1"; break;
      case BinaryFn::Mul: derivative = s; break;
      case BinaryFn::Div: derivative = rev ? util::cat("-((", s, " / x) / x)") : util::cat("(T)1 / ", s); break;
    }
    ElementwiseForm f;
    f.function = "f";
    f.derivative = "d";
    f.device_source = util::cat("template <class T> __device__ __forceinline__ T f(T x) { return kg_binary_fn<", op,
                                ">(", rev ? s + ", x" : "x, " + s, "); }\ntemplate <class T> __device__ __forceinline__ "
                                "T d(int, T x, T) { return ", derivative, "; }\n");
    const double sv = scalar_;
    const BinaryFn bf = fn_;
    visit_binary(fn_, [&](auto fn) {
      using Fn = decltype(fn);
      f.cpu = ElementwiseForm::cpu_map<1>([sv, rev](auto x) {
        using T = decltype(x);
        return rev ? binary_fn<Fn::value>(static_cast<T>(sv), x) : binary_fn<Fn::value>(x, static_cast<T>(sv));
      });
    });
    f.cpu_derivative = ElementwiseForm::cpu_map_derivative<1>([sv, rev, bf](int, auto x, auto) {
      using T = decltype(x);
      const T c = static_cast<T>(sv);
      switch (bf) {
        case BinaryFn::Add: return T(1);
        case BinaryFn::Sub: return rev ? T(-1) : T(1);
        case BinaryFn::Mul: return c;
        case BinaryFn::Div: break;
      }
      return rev ? -((c / x) / x) : T(1) / c;
    });
    return f;
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
  // True for s - x and s / x (add and mul commute: their reversed forms are the plain ones).
  bool reversed() const { return reversed_ && binary_entry(fn_).rscalar_kernel != nullptr; }
  bool reads_input() const { return fn_ == BinaryFn::Div && reversed(); }
  std::string backward_entry(DType dtype) const {
    const BinaryEntry& e = binary_entry(fn_);
    return entry_for(std::string(reversed() ? e.rscalar_kernel : e.scalar_kernel) + "_backward", dtype);
  }
  BinaryFn fn_;
  double scalar_;
  bool reversed_;

 public:
  ScalarSpec spec() const { return {fn_, scalar_, reversed()}; }
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

std::shared_ptr<RuntimeOp> dropout_runtime(double p, DType dtype, bool training) {
  return std::make_shared<DropoutRuntime>(p, dtype, training);
}

std::optional<UnarySpec> unary_spec(const CustomOp& op) {
  if (const auto* u = dynamic_cast<const UnaryOp*>(&op)) return u->spec();
  return std::nullopt;
}

std::optional<BinaryFn> binary_fn(const CustomOp& op) {
  if (const auto* b = dynamic_cast<const BinaryOp*>(&op)) return b->fn();
  return std::nullopt;
}

std::optional<ScalarSpec> scalar_spec(const CustomOp& op) {
  if (const auto* s = dynamic_cast<const ScalarOp*>(&op)) return s->spec();
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

KgBroadcast gpu_broadcast(const std::vector<std::int64_t>& a, const std::vector<std::int64_t>& b,
                          const std::vector<std::int64_t>& out, const char* op_name) {
  KgBroadcast g{};
  std::fill(std::begin(g.size), std::end(g.size), kg_divider(1));
  const std::int64_t n = numel_of(out);
  if (n == 0) return g;  // nothing to write
  const BroadcastPlan p = plan_broadcast(a, b, out);
  const std::size_t rank = p.size.size();
  if (rank == 1 && p.stride_a[0] != 0 && p.stride_b[0] != 0) {
    g.mode = KG_BCAST_SAME;
    return g;
  }
  if (rank == 1 && (p.stride_a[0] != 0) != (p.stride_b[0] != 0)) {
    g.mode = p.stride_a[0] != 0 ? KG_BCAST_SCALAR_B : KG_BCAST_SCALAR_A;
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
    g.size[0] = kg_divider(inner);
    g.size[1] = kg_divider(p.size[k]);
    return true;
  };
  if (channel(a, p.stride_b)) {
    g.mode = KG_BCAST_CHANNEL_B;
    return g;
  }
  if (channel(b, p.stride_a)) {
    g.mode = KG_BCAST_CHANNEL_A;
    return g;
  }
  if (rank > static_cast<std::size_t>(KG_EW_MAX_DIMS))
    throw Error(util::cat(op_name, ": broadcasting ", sizes_to_string(a), " with ", sizes_to_string(b),
                          " to ", sizes_to_string(out), " needs ", rank,
                          " dims after merging; the GPU kernel handles up to ", KG_EW_MAX_DIMS));
  g.mode = KG_BCAST_GENERAL;
  g.rank = static_cast<std::int32_t>(rank);
  for (std::size_t d = 0; d < rank; ++d) {  // innermost first
    const std::size_t src = rank - 1 - d;
    g.size[d] = kg_divider(p.size[src]);
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
