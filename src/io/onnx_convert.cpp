// Converters of the standard ONNX ops into kernelgraph ops. Each takes a node's inputs as values
// (graph tensors, constants, or symbolic shape values) and returns its outputs. Shape arithmetic
// (Shape, Gather, Concat, Unsqueeze, Slice, arithmetic on sizes) stays symbolic, so Reshape,
// Expand, Range and ConstantOfShape keep an exported model's dynamic batch.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "io/onnx_importer.hpp"
#include "io/onnx_tensor.hpp"
#include "kg/ops.hpp"
#include "ops/constant.hpp"
#include "ops/conv_transpose.hpp"
#include "ops/index_ops.hpp"
#include "ops/pointwise.hpp"
#include "ops/reduce_ops.hpp"
#include "ops/resize.hpp"
#include "ops/view.hpp"
#include "util/str.hpp"

namespace kg::onnx::detail {

// ---- checked arithmetic ----

std::int64_t checked_add(const NodeContext& c, std::int64_t a, std::int64_t b, const char* what) {
  std::int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) c.fail(util::cat(what, ": ", a, " + ", b, " does not fit in 64 bits"));
  return r;
}
std::int64_t checked_sub(const NodeContext& c, std::int64_t a, std::int64_t b, const char* what) {
  std::int64_t r = 0;
  if (__builtin_sub_overflow(a, b, &r)) c.fail(util::cat(what, ": ", a, " - ", b, " does not fit in 64 bits"));
  return r;
}
std::int64_t checked_mul(const NodeContext& c, std::int64_t a, std::int64_t b, const char* what) {
  std::int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) c.fail(util::cat(what, ": ", a, " × ", b, " does not fit in 64 bits"));
  return r;
}
std::int64_t checked_div(const NodeContext& c, std::int64_t a, std::int64_t b, const char* what) {
  if (b == 0) c.fail(util::cat(what, ": ", a, " / 0 divides by zero"));
  if (a == std::numeric_limits<std::int64_t>::min() && b == -1)
    c.fail(util::cat(what, ": ", a, " / -1 does not fit in 64 bits"));
  return a / b;
}
std::int64_t checked_int(const NodeContext& c, double v, const char* what) {
  // 2^63 is exactly representable; every double below it converts.
  if (!(v >= -9223372036854775808.0 && v < 9223372036854775808.0))
    c.fail(util::cat(what, " ", v, " is not an integer of 64 bits"));
  return static_cast<std::int64_t>(v);
}

std::string quote_name(const std::string& name) { return "'" + util::printable(name) + "'"; }

namespace {

using ops::DimRef;
using ops::PointwiseFn;
using ops::ReduceFn;
using ops::view;
using Values = std::vector<Value>;

constexpr std::int64_t kMaxI64 = std::numeric_limits<std::int64_t>::max();
__extension__ using Int128 = __int128;  // exact spans of two i64s

std::int64_t norm_axis(NodeContext& c, std::int64_t axis, std::size_t rank, const char* what = "axis") {
  const auto r = static_cast<std::int64_t>(rank);
  if (axis < -r || axis >= r) c.fail(util::cat(what, " ", axis, " is out of range for rank ", rank));
  return axis < 0 ? axis + r : axis;
}

bool is_float_type(DType t) { return t == DType::F32 || t == DType::F64; }

// Binds parameter `index` of the node behind `t` to the value `v` (an initializer keeps its ONNX
// name; another constant gets "<node>.<what>"), converting floats to the parameter's dtype.
void bind(NodeContext& c, const SymTensor& t, std::size_t index, Value& v, const char* what) {
  if (v.graph_input)
    throw NeedsValue(util::cat(c.label, " needs its ", what, " (input ", quote_name(v.name), ", a graph input) known at import; "
                               "give its value in ImportOptions::input_values"),
                     {v.name});
  if (!v.is_constant()) c.fail(util::cat("needs its ", what, " (input ", quote_name(v.name), ") to be an initializer"));
  const Node& n = c.graph().node(t.node());
  const ParamSpec& p = n.params.at(index);
  Tensor data = *v.constant;
  if (numel_of(data.shape()) != numel_of(p.shape))
    c.fail(util::cat(what, " ", quote_name(v.name), " is ", sizes_to_string(data.shape()), " but the op needs ",
                     sizes_to_string(p.shape)));
  if (data.dtype() != p.dtype) {
    if (!is_floating(data.dtype()) || !is_floating(p.dtype))
      c.fail(util::cat(what, " ", quote_name(v.name), " is ", dtype_name(data.dtype()), ", expected ", dtype_name(p.dtype)));
    data = data.to(p.dtype);
  }
  std::vector<std::byte> bytes(data.nbytes());
  if (!bytes.empty()) std::memcpy(bytes.data(), data.raw(), bytes.size());
  const std::string name = v.initializer && !v.name.empty() ? v.name : util::cat(n.name, ".", what);
  c.graph().bind_param(t.node(), index, name, ParamInit::from_bytes(std::move(bytes)));
}

// A float scalar held by a constant of one element.
std::optional<double> scalar_constant(const Value& v) {
  if (!v.is_constant() || v.constant->numel() != 1) return std::nullopt;
  return v.constant->item(0);
}

// A pointwise op; f16 and bf16 inputs are computed in f32 and the result cast back.
SymTensor pw(NodeContext& c, PointwiseFn fn, std::vector<SymTensor> xs, const std::vector<double>& attrs = {},
             const std::string& suffix = "") {
  std::optional<DType> half;
  for (const auto& x : xs)
    if (x.dtype() == DType::F16 || x.dtype() == DType::BF16) half = x.dtype();
  if (!half) return ops::pointwise(fn, xs, attrs, c.node_name(suffix));
  for (std::size_t i = 0; i < xs.size(); ++i)
    if (xs[i].dtype() == *half) xs[i] = ops::cast(xs[i], DType::F32, c.node_name(util::cat("f32_", i)));
  SymTensor y = ops::pointwise(fn, xs, attrs, c.node_name("f32"));
  return y.dtype() == DType::F32 ? ops::cast(y, *half, c.node_name(suffix)) : y;
}

// A constant made at import, as a tensor of the graph.
SymTensor materialize_value(NodeContext& c, Value& v, const std::string& what) {
  return materialize(c.importer(), v, c.node_name(what));
}

// x's dims, as the op's input `input` (0: the op's own data input).
std::vector<DimRef> dims_of_x(const SymTensor& x, int input = 0) {
  std::vector<DimRef> r;
  for (std::size_t i = 0; i < x.rank(); ++i) r.push_back(DimRef::of(input, static_cast<int>(i)));
  return r;
}

// Product of x's dims [b, e) as one DimRef: static, a single dim, or nullopt.
std::optional<DimRef> dim_product(NodeContext& c, const SymTensor& x, std::size_t b, std::size_t e) {
  std::int64_t known = 1;
  int dyn = -1, ndyn = 0;
  for (std::size_t i = b; i < e; ++i) {
    const Dim& d = x.shape()[i];
    if (d.is_static()) known = checked_mul(c, known, d.size(), "the product of the flattened dims");
    else dyn = static_cast<int>(i), ++ndyn;
  }
  if (ndyn == 0) return DimRef::constant(known);
  if (ndyn == 1 && known == 1) return DimRef::of(0, dyn);
  return std::nullopt;
}

// ---- shape arithmetic ----

Values shape_op(NodeContext& c) {
  Value& x = c.in(0);
  const Shape s = x.shape();
  const auto r = static_cast<std::int64_t>(s.rank());
  std::int64_t start = c.attrs.get_int("start", 0), end = c.attrs.get_int("end", r);
  if (start < 0) start += r;
  if (end < 0) end += r;
  start = std::clamp<std::int64_t>(start, 0, r);
  end = std::clamp<std::int64_t>(end, 0, r);
  std::vector<SymDim> d;
  for (std::int64_t i = start; i < end; ++i) {
    const Dim& dim = s[static_cast<std::size_t>(i)];
    if (dim.is_static()) d.push_back(SymDim::known(dim.size()));
    else d.push_back(SymDim::dim_of(x.tensor, static_cast<int>(i)));
  }
  return {dims_value(std::move(d))};
}

Values size_op(NodeContext& c) {
  const Shape s = c.in(0).shape();
  std::int64_t n = 1;
  for (const Dim& d : s) {
    if (d.is_dynamic()) return {dims_value({SymDim::unknown()}, true)};
    n = checked_mul(c, n, d.size(), "the element count");
  }
  return {constant_value(Tensor::from_vector<std::int64_t>({}, {n}))};
}

// Elementwise arithmetic on shape values (broadcasting a scalar); nullopt when not both are.
std::optional<Value> dims_arith(NodeContext& c, const char* op) {
  if (!c.in(0).dims && !c.in(1).dims) return std::nullopt;
  auto a = c.dims(0), b = c.dims(1);
  if (!a || !b) return std::nullopt;
  const bool scalar = (c.in(0).shape().rank() == 0) && (c.in(1).shape().rank() == 0);
  const std::size_t n = std::max(a->size(), b->size());
  if ((a->size() != n && a->size() != 1) || (b->size() != n && b->size() != 1)) return std::nullopt;
  std::vector<SymDim> out;
  const std::string o = op;
  for (std::size_t i = 0; i < n; ++i) {
    const SymDim& x = (*a)[a->size() == 1 ? 0 : i];
    const SymDim& y = (*b)[b->size() == 1 ? 0 : i];
    if (x.is_known() && y.is_known()) {
      std::int64_t v = 0;
      if (o == "Add") v = checked_add(c, x.value, y.value, "a size");
      else if (o == "Sub") v = checked_sub(c, x.value, y.value, "a size");
      else if (o == "Mul") v = checked_mul(c, x.value, y.value, "a size");
      else v = checked_div(c, x.value, y.value, "a size");
      out.push_back(SymDim::known(v));
    } else if ((o == "Mul" || o == "Div") && y.is_known() && y.value == 1) {
      out.push_back(x);
    } else if (o == "Mul" && x.is_known() && x.value == 1) {
      out.push_back(y);
    } else if ((o == "Add" || o == "Sub") && y.is_known() && y.value == 0) {
      out.push_back(x);
    } else if (o == "Add" && x.is_known() && x.value == 0) {
      out.push_back(y);
    } else {
      out.push_back(SymDim::unknown());
    }
  }
  return dims_value(std::move(out), scalar);
}

// ---- elementwise ----

// a ⊙ b for Add, Sub, Mul, Div on float tensors (the elementwise family, with its backward).
SymTensor float_arith(const std::string& o, const SymTensor& a, const SymTensor& b, const std::string& name) {
  if (o == "Add") return add(a, b, name);
  if (o == "Sub") return sub(a, b, name);
  if (o == "Mul") return mul(a, b, name);
  return div(a, b, name);
}
// x ⊙ s, or s ⊙ x when `scalar_first`, for a one-element constant s.
SymTensor scalar_arith(const std::string& o, const SymTensor& x, double s, bool scalar_first,
                       const std::string& name) {
  if (o == "Add") return add(x, s, name);
  if (o == "Mul") return mul(x, s, name);
  if (o == "Sub") return scalar_first ? rsub(x, s, name) : sub(x, s, name);
  return scalar_first ? rdiv(x, s, name) : div(x, s, name);
}

Converter binary(PointwiseFn pf, const char* onnx) {
  return [pf, onnx](NodeContext& c) -> Values {
    const std::string o = onnx;
    if (c.opset < 7 && c.attrs.get_int("broadcast", 0) != 0) {
      // Before opset 7: b is aligned with a at `axis` (default: its trailing dims).
      SymTensor x = c.tensor(0), y = c.tensor(1);
      const auto ra = static_cast<std::int64_t>(x.rank()), rb = static_cast<std::int64_t>(y.rank());
      const std::int64_t axis = c.attrs.get_int("axis", ra - rb);
      if (axis < 0 || axis > ra - rb) c.fail(util::cat("broadcast axis ", axis, " does not fit ", y.shape().to_string(), " into ", x.shape().to_string()));
      std::vector<DimRef> refs = dims_of_x(y);
      for (std::int64_t i = axis + rb; i < ra; ++i) refs.push_back(DimRef::constant(1));
      y = view(y, refs, {}, c.node_name("aligned"));
      const std::string name = c.node_name();
      const bool arith = o == "Add" || o == "Sub" || o == "Mul" || o == "Div";
      if (arith && x.dtype() == y.dtype() && is_float_type(x.dtype())) return {tensor_value(float_arith(o, x, y, name))};
      return {tensor_value(ops::pointwise(pf, {x, y}, {}, name))};
    }
    if (auto d = dims_arith(c, onnx)) return {*d};
    Value &a = c.in(0), &b = c.in(1);
    if (o == "Pow" && a.dtype() != b.dtype()) {
      // Pow(T, T1) → T: computed in f64.
      SymTensor x = c.tensor(0), y = c.tensor(1);
      const DType out = x.dtype();
      SymTensor xd = x.dtype() == DType::F64 ? x : ops::cast(x, DType::F64, c.node_name("base_f64"));
      SymTensor yd = y.dtype() == DType::F64 ? y : ops::cast(y, DType::F64, c.node_name("exp_f64"));
      SymTensor r = ops::pointwise(PointwiseFn::Pow, {xd, yd}, {}, c.node_name(out == DType::F64 ? "" : "f64"));
      return {tensor_value(out == DType::F64 ? r : ops::cast(r, out, c.node_name()))};
    }
    const bool arith = o == "Add" || o == "Sub" || o == "Mul" || o == "Div";
    if (arith && a.dtype() == b.dtype() && is_float_type(a.dtype())) {
      const std::string name = c.node_name();
      // A one-element constant that does not raise the rank: the scalar form.
      auto sb = scalar_constant(b);
      if (sb && !b.initializer && b.shape().rank() <= a.shape().rank())
        return {tensor_value(scalar_arith(o, c.tensor(0), *sb, false, name))};
      auto sa = scalar_constant(a);
      if (sa && !a.initializer && a.shape().rank() <= b.shape().rank())
        return {tensor_value(scalar_arith(o, c.tensor(1), *sa, true, name))};
      SymTensor x = c.tensor(0), y = c.tensor(1);
      return {tensor_value(float_arith(o, x, y, name))};
    }
    SymTensor x = c.tensor(0), y = c.tensor(1);
    return {tensor_value(pw(c, pf, {x, y}))};
  };
}

Converter unary(PointwiseFn pf, std::vector<std::pair<std::string, double>> attrs = {}) {
  return [pf, attrs](NodeContext& c) -> Values {
    std::vector<double> a;
    for (const auto& [name, def] : attrs) a.push_back(c.attrs.get_float(name, def));
    SymTensor x = c.tensor(0);
    const std::string name = c.node_name();
    if (is_float_type(x.dtype())) {
      if (pf == PointwiseFn::Relu) return {tensor_value(relu(x, name))};
      if (pf == PointwiseFn::Sigmoid) return {tensor_value(sigmoid(x, name))};
      if (pf == PointwiseFn::Tanh) return {tensor_value(tanh(x, name))};
      if (pf == PointwiseFn::LeakyRelu) return {tensor_value(leaky_relu(x, a.at(0), name))};
    }
    (void)name;
    return {tensor_value(pw(c, pf, {x}, a))};
  };
}

Values clip_op(NodeContext& c) {
  double lo = -std::numeric_limits<double>::infinity(), hi = std::numeric_limits<double>::infinity();
  if (c.opset < 11) {
    lo = c.attrs.get_float("min", lo);
    hi = c.attrs.get_float("max", hi);
  } else {
    if (c.has_input(1)) lo = c.scalar(1, "the minimum");
    if (c.has_input(2)) hi = c.scalar(2, "the maximum");
  }
  SymTensor x = c.tensor(0);
  return {tensor_value(pw(c, PointwiseFn::Clip, {x}, {lo, hi}))};
}

// Max, Min, Sum, Mean over any number of inputs.
Converter variadic(PointwiseFn pf, bool mean) {
  return [pf, mean](NodeContext& c) -> Values {
    std::vector<SymTensor> xs;
    for (std::size_t i = 0; i < c.num_inputs(); ++i)
      if (c.has_input(i)) xs.push_back(c.tensor(i));
    if (xs.empty()) c.fail("needs at least one input");
    SymTensor acc = xs[0];
    for (std::size_t i = 1; i < xs.size(); ++i) {
      const std::string name = c.node_name(i + 1 == xs.size() && !mean ? "" : util::cat("acc", i));
      if (pf == PointwiseFn::Add && is_float_type(acc.dtype()) && acc.dtype() == xs[i].dtype())
        acc = add(acc, xs[i], name);
      else
        acc = pw(c, pf, {acc, xs[i]}, {}, i + 1 == xs.size() && !mean ? "" : util::cat("acc", i));
    }
    if (xs.size() == 1) acc = view(acc, dims_of_x(acc), {}, c.node_name());
    if (mean) acc = div(acc, static_cast<double>(xs.size()), c.node_name());
    return {tensor_value(acc)};
  };
}

Values where_op(NodeContext& c) {
  // Selecting between shape values with a known condition stays symbolic.
  if (c.in(0).is_constant() && (c.in(1).dims || c.in(2).dims)) {
    auto x = c.dims(1), y = c.dims(2);
    const Tensor& cond = *c.in(0).constant;
    const auto fits = [](std::size_t k, std::size_t n) { return k == n || k == 1; };
    const std::size_t n = x && y ? std::max({x->size(), y->size(), static_cast<std::size_t>(cond.numel())}) : 0;
    if (x && y && cond.rank() <= 1 && fits(x->size(), n) && fits(y->size(), n) &&
        fits(static_cast<std::size_t>(cond.numel()), n)) {
      std::vector<SymDim> out;
      for (std::size_t i = 0; i < n; ++i) {
        const bool take = cond.item(static_cast<std::int64_t>(cond.numel() == 1 ? 0 : i)) != 0;
        const auto& src = take ? *x : *y;
        out.push_back(src[src.size() == 1 ? 0 : i]);
      }
      return {dims_value(std::move(out))};
    }
  }
  SymTensor cond = c.tensor(0), x = c.tensor(1), y = c.tensor(2);
  return {tensor_value(ops::pointwise(PointwiseFn::Where, {cond, x, y}, {}, c.node_name()))};
}

// Comparisons of shape values with constants, decided at import where possible.
Converter compare(PointwiseFn pf) {
  return [pf](NodeContext& c) -> Values {
    if ((c.in(0).dims || c.in(1).dims) && pf == PointwiseFn::Equal) {
      auto a = c.dims(0), b = c.dims(1);
      const std::size_t n = a && b ? std::max(a->size(), b->size()) : 0;
      if (a && b && (a->size() == n || a->size() == 1) && (b->size() == n || b->size() == 1)) {
        std::vector<std::uint8_t> out;
        bool decided = true;
        for (std::size_t i = 0; i < n && decided; ++i) {
          const SymDim& x = (*a)[a->size() == 1 ? 0 : i];
          const SymDim& y = (*b)[b->size() == 1 ? 0 : i];
          if (x.is_known() && y.is_known()) out.push_back(x.value == y.value);
          else if (x.is_known() && x.value < 0) out.push_back(0);  // sizes are never negative
          else if (y.is_known() && y.value < 0) out.push_back(0);
          else decided = false;
        }
        if (decided) {
          Tensor t = Tensor::empty(DType::Bool, {static_cast<std::int64_t>(n)});
          std::memcpy(t.raw(), out.data(), out.size());
          return {constant_value(t)};
        }
      }
    }
    SymTensor x = c.tensor(0), y = c.tensor(1);
    return {tensor_value(ops::pointwise(pf, {x, y}, {}, c.node_name()))};
  };
}

// Cast and CastLike from opset 19 take `saturate` (default 1), which only applies when the target
// is a float 8 type; kernelgraph has no float 8 (nor the 4-bit types of opset 21), so a target it
// has ignores it and any other target is refused. Its value is still checked: 0 or 1.
void check_saturate(NodeContext& c) {
  if (!c.attrs.has("saturate")) return;
  const std::int64_t s = c.attrs.get_int("saturate");
  if (s != 0 && s != 1) c.fail(util::cat("has saturate ", s, "; it is 0 or 1"));
}

Values cast_op(NodeContext& c) {
  check_saturate(c);
  const int to = static_cast<int>(c.attrs.get_int("to"));
  const auto dt = dtype_of(to);
  if (!dt)
    c.fail(util::cat("casts to ", onnx_type_name(to), ", which is not supported (kernelgraph has f32, f64, f16, "
                     "bf16, i8, i16, i32, i64, u8 and bool; no float 8, 4-bit or string types)"));
  Value& x = c.in(0);
  if (x.dims && !is_floating(*dt) && *dt != DType::Bool) {
    Value v = x;
    return {v};
  }
  SymTensor t = c.tensor(0);
  if (t.dtype() == *dt) return {tensor_value(view(t, dims_of_x(t), {}, c.node_name()))};
  return {tensor_value(ops::cast(t, *dt, c.node_name()))};
}

Values cast_like_op(NodeContext& c) {
  check_saturate(c);
  const DType to = c.in(1).dtype();
  SymTensor t = c.tensor(0);
  if (t.dtype() == to) return {tensor_value(view(t, dims_of_x(t), {}, c.node_name()))};
  return {tensor_value(ops::cast(t, to, c.node_name()))};
}

Values identity_op(NodeContext& c) {
  Value v = c.in(0);
  v.name.clear();
  v.initializer = false;
  // A new node keeps names one-to-one with ONNX values (a graph output may be an Identity).
  if (v.tensor.valid() && !v.constant && !v.dims) v.tensor = view(v.tensor, dims_of_x(v.tensor), {}, c.node_name());
  return {v};
}

Values constant_op(NodeContext& c) {
  const auto& a = c.attrs;
  if (a.has("value")) return {constant_value(a.get_tensor("value"))};
  if (a.has("value_float")) return {constant_value(Tensor::from_vector<float>({}, {static_cast<float>(a.get_float("value_float"))}))};
  if (a.has("value_int")) return {constant_value(Tensor::from_vector<std::int64_t>({}, {a.get_int("value_int")}))};
  if (a.has("value_floats")) {
    std::vector<float> v;
    for (double f : a.get_floats("value_floats")) v.push_back(static_cast<float>(f));
    return {constant_value(Tensor::from_vector<float>({static_cast<std::int64_t>(v.size())}, v))};
  }
  if (a.has("value_ints")) {
    auto v = a.get_ints("value_ints");
    return {constant_value(Tensor::from_vector<std::int64_t>({static_cast<std::int64_t>(v.size())}, v))};
  }
  c.fail("has no supported value attribute (value, value_float(s), value_int(s)); strings and sparse tensors "
         "are not supported");
}

// ---- shape and data movement ----

std::vector<std::int64_t> axes_arg(NodeContext& c, std::size_t input, int since_opset) {
  if (c.opset >= since_opset) return c.has_input(input) ? c.ints(input, "the axes") : std::vector<std::int64_t>{};
  return c.attrs.get_ints("axes", {});
}

Values unsqueeze_op(NodeContext& c) {
  auto axes = axes_arg(c, 1, 13);
  Value& x = c.in(0);
  const std::size_t out_rank = x.shape().rank() + axes.size();
  std::vector<bool> is_new(out_rank, false);
  for (auto a : axes) {
    const auto k = static_cast<std::size_t>(norm_axis(c, a, out_rank));
    if (is_new[k]) c.fail(util::cat("repeats axis ", a));
    is_new[k] = true;
  }
  if (x.dims && x.scalar_dims && out_rank == 1) {
    Value v = dims_value(*x.dims, false);
    return {v};
  }
  SymTensor t = c.tensor(0);
  std::vector<DimRef> refs;
  int next = 0;
  for (std::size_t i = 0; i < out_rank; ++i)
    refs.push_back(is_new[i] ? DimRef::constant(1) : DimRef::of(0, next++));
  return {tensor_value(view(t, refs, {}, c.node_name()))};
}

Values squeeze_op(NodeContext& c) {
  auto axes = axes_arg(c, 1, 13);
  Value& x = c.in(0);
  const Shape s = x.shape();
  std::vector<bool> drop(s.rank(), false);
  if (axes.empty()) {
    for (std::size_t i = 0; i < s.rank(); ++i) drop[i] = s[i].is_static() && s[i].size() == 1;
  } else {
    for (auto a : axes) {
      const auto k = static_cast<std::size_t>(norm_axis(c, a, s.rank()));
      if (s[k].is_static() && s[k].size() != 1)
        c.fail(util::cat("squeezes axis ", a, " of size ", s[k].size(), " in ", s.to_string()));
      drop[k] = true;
    }
  }
  if (x.dims && s.rank() == 1 && drop[0]) return {dims_value(*x.dims, true)};
  SymTensor t = c.tensor(0);
  std::vector<DimRef> refs;
  for (std::size_t i = 0; i < s.rank(); ++i)
    if (!drop[i]) refs.push_back(DimRef::of(0, static_cast<int>(i)));
  return {tensor_value(view(t, refs, {}, c.node_name()))};
}

Values flatten_op(NodeContext& c) {
  SymTensor x = c.tensor(0);
  const std::size_t r = x.rank();
  std::int64_t axis = c.attrs.get_int("axis", 1);
  if (axis < 0) axis += static_cast<std::int64_t>(r);
  if (axis < 0 || axis > static_cast<std::int64_t>(r)) c.fail(util::cat("axis ", c.attrs.get_int("axis", 1), " is out of range for rank ", r));
  auto a = dim_product(c, x, 0, static_cast<std::size_t>(axis));
  auto b = dim_product(c, x, static_cast<std::size_t>(axis), r);
  if (!a && !b) c.fail(util::cat("cannot flatten ", x.shape().to_string(), " at ", axis, ": both sides have several dynamic dims"));
  std::vector<DimRef> refs{a ? *a : DimRef::constant(-1), b ? *b : DimRef::constant(-1)};
  if (a && b && !a->is_constant() && !b->is_constant()) refs[1] = DimRef::constant(-1);
  return {tensor_value(view(x, refs, {}, c.node_name()))};
}

// Input i as a shape (a 1-D integer tensor known at import, or a symbolic shape value). Anything
// else is an error naming what it is; a value computed at run time is the "known at import" error.
std::vector<SymDim> shape_arg(NodeContext& c, std::size_t i, const char* what) {
  if (auto d = c.dims(i)) {
    if (c.in(i).is_constant() && c.in(i).constant->rank() > 1)
      c.fail(util::cat(what, " must be a 1-D integer tensor, got ", sizes_to_string(c.in(i).constant->shape())));
    return *d;
  }
  const Tensor& t = c.constant(i, what);  // throws for values computed at run time
  c.fail(util::cat(what, " must be a 1-D integer tensor, got ", dtype_name(t.dtype()), " ",
                   sizes_to_string(t.shape())));
}

// Turns a target shape into DimRefs over x (input 0) and extra sources.
std::vector<DimRef> target_refs(NodeContext& c, const SymTensor& x, const std::vector<SymDim>& d, bool zero_copies,
                                std::vector<SymTensor>& sources) {
  std::vector<DimRef> refs;
  bool inferred = false;
  for (std::size_t j = 0; j < d.size(); ++j) {
    const SymDim& s = d[j];
    if (s.is_known()) {
      if (s.value == 0 && zero_copies) {
        if (j >= x.rank()) c.fail(util::cat("copies dim ", j, " (a 0) of ", x.shape().to_string()));
        refs.push_back(DimRef::of(0, static_cast<int>(j)));
      } else if (s.value == -1) {
        if (inferred) c.fail("has two -1 sizes");
        inferred = true;
        refs.push_back(DimRef::constant(-1));
      } else if (s.value < 0) {
        c.fail(util::cat("has an invalid size ", s.value));
      } else {
        refs.push_back(DimRef::constant(s.value));
      }
    } else if (s.kind == SymDim::Kind::DimOf) {
      if (s.src.node() == x.node()) {
        refs.push_back(DimRef::of(0, s.axis));
        continue;
      }
      const Dim& want = s.src.shape()[static_cast<std::size_t>(s.axis)];
      int found = -1;
      for (std::size_t k = 0; k < x.rank(); ++k)
        if (!want.symbol().empty() && x.shape()[k] == want) found = static_cast<int>(k);
      if (found >= 0) {
        refs.push_back(DimRef::of(0, found));
        continue;
      }
      int idx = -1;
      for (std::size_t k = 0; k < sources.size(); ++k)
        if (sources[k].node() == s.src.node()) idx = static_cast<int>(k);
      if (idx < 0) idx = static_cast<int>(sources.size()), sources.push_back(s.src);
      refs.push_back(DimRef::of(1 + idx, s.axis));
    } else {
      if (inferred) c.fail("has more than one size known only at run time");
      inferred = true;
      refs.push_back(DimRef::constant(-1));
    }
  }
  return refs;
}

Values reshape_op(NodeContext& c) {
  const auto d = std::optional<std::vector<SymDim>>(shape_arg(c, 1, "the target shape"));
  // A shape value reshaped to 1-D ([-1] or [n]) stays a shape value.
  if (c.in(0).dims && d->size() == 1 && d->at(0).is_known() &&
      (d->at(0).value == -1 || d->at(0).value == static_cast<std::int64_t>(c.in(0).dims->size())))
    return {dims_value(*c.in(0).dims)};
  SymTensor x = c.tensor(0);
  const bool allowzero = c.attrs.get_int("allowzero", 0) != 0;
  std::vector<SymTensor> sources;
  auto refs = target_refs(c, x, *d, !allowzero, sources);
  return {tensor_value(view(x, refs, sources, c.node_name()))};
}

Values expand_op(NodeContext& c) {
  const auto d = std::optional<std::vector<SymDim>>(shape_arg(c, 1, "the target shape"));
  SymTensor x = c.tensor(0);
  std::vector<SymTensor> sources;
  auto refs = c.dim_refs(*d, sources, 1);
  if (!refs) c.fail("has a target size known only at run time");
  return {tensor_value(ops::expand(x, *refs, sources, c.node_name()))};
}

Values constant_of_shape_op(NodeContext& c) {
  DType dt = DType::F32;
  double value = 0.0;
  if (c.attrs.has("value")) {
    Tensor v = c.attrs.get_tensor("value");
    if (v.numel() != 1) c.fail(util::cat("value must have one element, got ", sizes_to_string(v.shape())));
    dt = v.dtype();
    value = v.item(0);
  }
  const auto d = std::optional<std::vector<SymDim>>(shape_arg(c, 0, "the shape"));
  std::vector<SymTensor> sources;
  auto refs = c.dim_refs(*d, sources, 0);
  if (!refs) c.fail("has a size known only at run time");
  if (sources.empty()) {
    std::vector<std::int64_t> sizes;
    std::int64_t numel = 1;
    for (auto& r : *refs) {
      if (r.value < 0) c.fail(util::cat("has a negative size ", r.value));
      numel = checked_mul(c, numel, r.value, "the element count");
      sizes.push_back(r.value);
    }
    const std::int64_t nbytes = checked_mul(c, numel, static_cast<std::int64_t>(dtype_size(dt)), "the byte count");
    check_memory(c.label, static_cast<std::uint64_t>(nbytes),
                 util::cat("the constant ", sizes_to_string(sizes), " ", dtype_name(dt), " it makes at import"));
    Tensor t = Tensor::empty(dt, sizes);
    t.fill(value);
    return {constant_value(t)};
  }
  return {tensor_value(ops::constant_of_shape(*refs, sources, dt, value, c.node_name()))};
}

Values range_op(NodeContext& c) {
  const Value& limit = c.in(1);
  if (limit.graph_input || c.in(0).graph_input || c.in(2).graph_input) {
    c.constant(0, "the start");
    c.constant(1, "the limit");
    c.constant(2, "the delta");
  }
  if (c.in(0).is_constant() && limit.is_constant() && c.in(2).is_constant()) {
    // Known at import: computed here, in the inputs' type.
    const DType dt = c.in(0).dtype();
    constexpr std::int64_t kMaxRange = std::int64_t{1} << 31;
    std::int64_t n = 0;
    if (!is_floating(dt)) {
      // Integers exactly: n = ceil((limit - start) / delta) and start + i*delta in 128 bits
      // (the span of two i64s does not fit in 64).
      const auto si = c.ints(0, "the start"), li = c.ints(1, "the limit"), di = c.ints(2, "the delta");
      if (si.size() != 1 || li.size() != 1 || di.size() != 1) c.fail("start, limit and delta must be scalars");
      if (di[0] == 0) c.fail("has a zero delta");
      const Int128 span = static_cast<Int128>(li[0]) - si[0], d = di[0];
      const Int128 count = span == 0 || (span > 0) != (d > 0) ? 0 : (span + d - (d > 0 ? 1 : -1)) / d;
      if (count > kMaxRange)
        c.fail(util::cat("from ", si[0], " to ", li[0], " in steps of ", di[0], " would have more than ", kMaxRange,
                         " elements"));
      n = static_cast<std::int64_t>(count);
      check_memory(c.label, static_cast<std::uint64_t>(n) * 8, util::cat("the range of ", n, " elements it makes at import"));
      Tensor ti = Tensor::empty(DType::I64, {n});
      for (std::int64_t i = 0; i < n; ++i)
        ti.data<std::int64_t>()[i] = static_cast<std::int64_t>(si[0] + static_cast<Int128>(i) * di[0]);
      return {constant_value(dt == DType::I64 ? ti : ti.to(dt))};
    }
    const double s = c.scalar(0, "the start"), l = c.scalar(1, "the limit"), d = c.scalar(2, "the delta");
    if (d == 0) c.fail("has a zero delta");
    const double count = std::ceil((l - s) / d);
    if (!(std::isfinite(s) && std::isfinite(l) && std::isfinite(d)) || std::isnan(count))
      c.fail(util::cat("from ", s, " to ", l, " in steps of ", d, " has no finite length"));
    if (count > static_cast<double>(kMaxRange))
      c.fail(util::cat("from ", s, " to ", l, " in steps of ", d, " would have ", count, " elements, more than ",
                       kMaxRange));
    n = count > 0 ? static_cast<std::int64_t>(count) : 0;
    check_memory(c.label, static_cast<std::uint64_t>(n) * 8, util::cat("the range of ", n, " elements it makes at import"));
    Tensor tmp = Tensor::empty(DType::F64, {n});
    for (std::int64_t i = 0; i < n; ++i) tmp.data<double>()[i] = s + static_cast<double>(i) * d;
    return {constant_value(dt == DType::F64 ? tmp : tmp.to(dt))};
  }
  if (!limit.dims || limit.dims->size() != 1 || (*limit.dims)[0].kind != SymDim::Kind::DimOf)
    c.fail("has a limit that depends on the data: data-dependent output shapes are not supported");
  const Tensor& s = c.constant(0, "the start");
  const Tensor& dl = c.constant(2, "the delta");
  const SymDim& l = (*limit.dims)[0];
  DType dt = c.in(0).dtype();
  if (s.numel() != 1 || dl.numel() != 1) c.fail("start and delta must be scalars");
  return {tensor_value(ops::range(dt, checked_int(c, s.item(0), "the start"), DimRef::of(0, l.axis),
                                  checked_int(c, dl.item(0), "the delta"), {l.src}, c.node_name()))};
}

Values transpose_op(NodeContext& c) {
  SymTensor x = c.tensor(0);
  std::vector<std::int64_t> perm = c.attrs.get_ints("perm", {});
  if (perm.empty())
    for (std::size_t i = x.rank(); i-- > 0;) perm.push_back(static_cast<std::int64_t>(i));
  return {tensor_value(permute(x, perm, c.node_name()))};
}

Values concat_op(NodeContext& c) {
  const std::int64_t axis = c.attrs.get_int("axis");
  bool any_dims = false, all_dims = true;
  for (std::size_t i = 0; i < c.num_inputs(); ++i) {
    if (!c.has_input(i)) continue;
    any_dims = any_dims || c.in(i).dims.has_value();
    all_dims = all_dims && c.dims(i).has_value();
  }
  if (any_dims && all_dims) {
    std::vector<SymDim> out;
    for (std::size_t i = 0; i < c.num_inputs(); ++i)
      if (c.has_input(i)) {
        auto d = *c.dims(i);
        out.insert(out.end(), d.begin(), d.end());
      }
    return {dims_value(std::move(out))};
  }
  std::vector<SymTensor> xs;
  for (std::size_t i = 0; i < c.num_inputs(); ++i)
    if (c.has_input(i)) xs.push_back(c.tensor(i));
  if (xs.empty()) c.fail("has no inputs");
  const std::int64_t a = norm_axis(c, axis, xs[0].rank());
  // Empty inputs (a 0-size concat dim) are dropped.
  std::vector<SymTensor> kept;
  for (auto& t : xs)
    if (!(t.shape()[static_cast<std::size_t>(a)].is_static() && t.shape()[static_cast<std::size_t>(a)].size() == 0))
      kept.push_back(t);
  if (kept.empty()) kept.push_back(xs[0]);
  if (kept.size() == 1) return {tensor_value(view(kept[0], dims_of_x(kept[0]), {}, c.node_name()))};
  return {tensor_value(concat(kept, a, c.node_name()))};
}

Values gather_op(NodeContext& c) {
  const std::int64_t axis = c.attrs.get_int("axis", 0);
  if (c.in(0).dims && c.in(1).is_constant()) {
    const auto& d = *c.in(0).dims;
    const Tensor& idx = *c.in(1).constant;
    if (axis != 0) c.fail("gathers a shape value along an axis other than 0");
    if (is_floating(idx.dtype()) || idx.rank() > 1)
      c.fail(util::cat("gathers a shape value with ", dtype_name(idx.dtype()), " ", sizes_to_string(idx.shape()),
                       " indices; they must be integers of rank 0 or 1"));
    const std::vector<std::int64_t> ids = c.ints(1, "the indices");
    std::vector<SymDim> out;
    for (std::int64_t k = 0; k < idx.numel(); ++k) {
      auto i = ids[static_cast<std::size_t>(k)];
      if (i < 0) i += static_cast<std::int64_t>(d.size());
      if (i < 0 || i >= static_cast<std::int64_t>(d.size()))
        c.fail(util::cat("index ", ids[static_cast<std::size_t>(k)], " is out of range for a shape of ", d.size(), " dims"));
      out.push_back(d[static_cast<std::size_t>(i)]);
    }
    return {dims_value(std::move(out), idx.rank() == 0)};
  }
  SymTensor data = c.tensor(0), idx = c.tensor(1);
  return {tensor_value(ops::gather(data, idx, norm_axis(c, axis, data.rank()), c.node_name()))};
}

Values gather_elements_op(NodeContext& c) {
  SymTensor data = c.tensor(0), idx = c.tensor(1);
  return {tensor_value(ops::gather_elements(data, idx, norm_axis(c, c.attrs.get_int("axis", 0), data.rank()), c.node_name()))};
}

Values slice_op(NodeContext& c) {
  std::vector<std::int64_t> starts, ends, axes, steps;
  struct DynamicEnd {
    std::int64_t axis, start;
    SymDim end;
    std::int64_t step;
  };
  std::vector<DynamicEnd> dynamic_ends;
  Value& x = c.in(0);
  const std::size_t rank = x.shape().rank();
  if (c.opset < 10) {
    starts = c.attrs.get_ints("starts");
    ends = c.attrs.get_ints("ends");
    axes = c.attrs.get_ints("axes", {});
  } else {
    starts = c.ints(1, "the starts");
    // An end that is the sliced dim itself (x[:, :x.shape[1]]) means "to the end". The ends are a
    // 1-D integer tensor (shape_arg refuses floats and higher ranks, naming them).
    const auto ed = std::optional<std::vector<SymDim>>(shape_arg(c, 2, "the ends"));
    axes = c.has_input(3) ? c.ints(3, "the axes") : std::vector<std::int64_t>{};
    if (c.has_input(4)) steps = c.ints(4, "the steps");
    if (ed->size() != starts.size() || (!axes.empty() && axes.size() != starts.size()) ||
        (!steps.empty() && steps.size() != starts.size()))
      c.fail(util::cat("has ", starts.size(), " starts, ", ed->size(), " ends, ", axes.size(), " axes and ",
                       steps.size(), " steps; they must agree"));
    for (std::size_t i = 0; i < ed->size(); ++i) {
      const SymDim& e = (*ed)[i];
      if (e.is_known()) {
        ends.push_back(e.value);
        continue;
      }
      const std::int64_t ax = axes.empty() ? static_cast<std::int64_t>(i) : norm_axis(c, axes[i], rank);
      if (e.kind == SymDim::Kind::DimOf && x.tensor.valid() &&
          e.src.shape()[static_cast<std::size_t>(e.axis)] == x.shape()[static_cast<std::size_t>(ax)] &&
          !x.shape()[static_cast<std::size_t>(ax)].symbol().empty()) {
        ends.push_back(kMaxI64);
      } else if (e.kind == SymDim::Kind::DimOf && !x.dims && i < starts.size() && starts[i] >= 0 &&
                 (steps.empty() || steps[i] > 0)) {
        // x[start:n:step] with n a run-time dim (a buffer cut to the sequence length): a gather of
        // range(start, n, step), which follows n at load.
        dynamic_ends.push_back({ax, starts[i], e, steps.empty() ? 1 : steps[i]});
        ends.push_back(kMaxI64);
        starts[i] = 0;
        if (!steps.empty()) steps[i] = 1;
      } else {
        c.fail(util::cat("has an end (", e.to_string(), ") known only at run time"));
      }
    }
  }
  if (axes.empty())
    for (std::size_t i = 0; i < starts.size(); ++i) axes.push_back(static_cast<std::int64_t>(i));
  if (steps.empty()) steps.assign(starts.size(), 1);
  if (starts.size() != ends.size() || axes.size() != starts.size() || steps.size() != starts.size())
    c.fail(util::cat("has ", starts.size(), " starts, ", ends.size(), " ends, ", axes.size(), " axes and ", steps.size(),
                     " steps; they must agree"));
  if (x.dims) {
    if (axes.size() != 1 || norm_axis(c, axes[0], 1) != 0) c.fail("slices a shape value on an axis other than 0");
    const auto& d = *x.dims;
    const auto n = static_cast<std::int64_t>(d.size());
    std::int64_t st = steps[0], b = starts[0], e = ends[0];
    if (st == 0) c.fail("has a zero step");
    if (st == std::numeric_limits<std::int64_t>::min()) st = -n - 1;  // the same slice, with -st representable
    auto clampi = [&](std::int64_t v, bool start) {
      if (v < 0) v += n;
      if (st > 0) return std::clamp<std::int64_t>(v, 0, n);
      return std::clamp<std::int64_t>(v, -1, n - 1) + (start ? 0 : 0);
    };
    b = clampi(b, true);
    e = clampi(e, false);
    std::vector<SymDim> out;
    for (std::int64_t i = b; st > 0 ? i < e : i > e;) {
      out.push_back(d[static_cast<std::size_t>(i)]);
      if (__builtin_add_overflow(i, st, &i)) break;  // past the end either way
    }
    return {dims_value(std::move(out))};
  }
  SymTensor t = c.tensor(0);
  for (const auto& d : dynamic_ends) {
    SymTensor idx = ops::range(DType::I64, d.start, DimRef::of(0, d.end.axis), d.step, {d.end.src},
                               c.node_name(util::cat("range", d.axis)));
    t = ops::gather(t, idx, d.axis, c.node_name(util::cat("take", d.axis)));
  }
  return {tensor_value(ops::slice_axes(t, starts, ends, axes, steps, c.node_name()))};
}

Values split_op(NodeContext& c) {
  SymTensor x = c.tensor(0);
  const auto axis = static_cast<std::size_t>(norm_axis(c, c.attrs.get_int("axis", 0), x.rank()));
  std::vector<std::int64_t> sizes;
  if (c.opset >= 13 && c.has_input(1)) sizes = c.ints(1, "the split sizes");
  else if (c.opset < 13) sizes = c.attrs.get_ints("split", {});
  const auto n = static_cast<std::int64_t>(c.node.output_size());
  if (n == 0) c.fail("has no outputs");
  const Dim& D = x.shape()[axis];
  if (sizes.empty()) {
    if (D.is_dynamic()) c.fail(util::cat("splits the dynamic dim ", D.to_string(), " into equal parts"));
    const std::int64_t parts = c.attrs.get_int("num_outputs", n);
    if (parts != n) c.fail(util::cat("has num_outputs ", parts, " but ", n, " outputs"));
    // ceil(D / parts) parts, the last one smaller when D does not divide.
    const std::int64_t chunk = D.size() / parts + (D.size() % parts != 0 ? 1 : 0);
    for (std::int64_t i = 0, left = D.size(); i < parts; ++i, left -= std::min(chunk, left))
      sizes.push_back(std::min(chunk, left));
  }
  if (static_cast<std::int64_t>(sizes.size()) != n)
    c.fail(util::cat("has ", n, " outputs but ", sizes.size(), " split sizes"));
  std::int64_t total = 0;
  for (std::int64_t s : sizes) {
    if (s < 0) c.fail(util::cat("has a negative split size in ", sizes_to_string(sizes)));
    total = checked_add(c, total, s, "the sum of the split sizes");
  }
  if (D.is_static() && total != D.size())
    c.fail(util::cat("split sizes ", sizes_to_string(sizes), " add up to ", total, " but the dim is ", D.size()));
  Values out;
  std::int64_t at = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    out.push_back(tensor_value(ops::slice_axes(x, {at}, {at + sizes[i]}, {static_cast<std::int64_t>(axis)}, {1},
                                               c.node_name(util::cat("out", i)))));
    at += sizes[i];
  }
  return out;
}

Values tile_op(NodeContext& c) {
  SymTensor x = c.tensor(0);
  const auto repeats = c.ints(1, "the repeats");
  if (repeats.size() != x.rank())
    c.fail(util::cat("has ", repeats.size(), " repeats for an input of rank ", x.rank(), " ", x.shape().to_string()));
  for (std::size_t i = 0; i < repeats.size(); ++i) {
    if (repeats[i] < 0) c.fail(util::cat("has a negative repeat in ", sizes_to_string(repeats)));
    if (x.shape()[i].is_static()) (void)checked_mul(c, x.shape()[i].size(), repeats[i], "a tiled dim");
  }
  return {tensor_value(ops::tile(x, repeats, c.node_name()))};
}

Values pad_op(NodeContext& c) {
  Value& xv = c.in(0);
  const std::size_t r = xv.shape().rank();
  std::vector<std::int64_t> pads;
  double value = 0.0;
  if (c.opset < 11) {
    pads = c.attrs.get_ints("pads");
    value = c.attrs.get_float("value", 0.0);
  } else {
    pads = c.ints(1, "the pads");
    if (c.has_input(2)) value = c.scalar(2, "the constant value");
  }
  std::vector<std::int64_t> axes;
  if (c.has_input(3)) axes = c.ints(3, "the axes");
  if (axes.empty())
    for (std::size_t i = 0; i < r; ++i) axes.push_back(static_cast<std::int64_t>(i));
  if (pads.size() != 2 * axes.size()) c.fail(util::cat("has ", pads.size(), " pads for ", axes.size(), " axes"));
  std::vector<std::int64_t> begin(r, 0), end(r, 0);
  for (std::size_t i = 0; i < axes.size(); ++i) {
    const auto a = static_cast<std::size_t>(norm_axis(c, axes[i], r));
    begin[a] = pads[i];
    end[a] = pads[i + axes.size()];
  }
  const std::string mode = c.attrs.get_string("mode", "constant");
  ops::PadMode m = ops::PadMode::Constant;
  if (mode == "reflect") m = ops::PadMode::Reflect;
  else if (mode == "edge") m = ops::PadMode::Edge;
  else if (mode == "wrap") m = ops::PadMode::Wrap;
  else if (mode != "constant") c.fail("has an unknown mode " + quote_name(mode));
  SymTensor x = c.tensor(0);
  for (std::size_t i = 0; i < r; ++i) {
    const std::int64_t total = checked_add(c, begin[i], end[i], "the pads of a dim");
    if (x.shape()[i].is_static() && checked_add(c, x.shape()[i].size(), total, "a padded dim") < 0)
      c.fail(util::cat("pads ", sizes_to_string(pads), " remove more than dim ", i, " of ", x.shape().to_string(), " holds"));
  }
  return {tensor_value(ops::pad(x, begin, end, m, value, c.node_name()))};
}

// ---- linear algebra ----

Values matmul_op(NodeContext& c) {
  SymTensor a = c.tensor(0), b = c.tensor(1);
  return {tensor_value(matmul(a, b, c.node_name()))};
}

Values gemm_op(NodeContext& c) {
  const double alpha = c.attrs.get_float("alpha", 1.0), beta = c.attrs.get_float("beta", 1.0);
  const bool ta = c.attrs.get_int("transA", 0) != 0, tb = c.attrs.get_int("transB", 0) != 0;
  Value& bv = c.in(1);
  const bool has_c = c.has_input(2);
  // The Linear form: x · Wᵀ + b with W and b initializers, as PyTorch exports nn.Linear.
  if (!ta && tb && alpha == 1.0 && beta == 1.0 && bv.is_constant() && bv.initializer && bv.constant->rank() == 2 &&
      (!has_c || (c.in(2).is_constant() && c.in(2).initializer && c.in(2).constant->rank() == 1 &&
                  c.in(2).constant->dim(0) == bv.constant->dim(0))) &&
      is_float_type(c.in(0).dtype())) {
    SymTensor x = c.tensor(0);
    if (x.rank() == 2 && x.shape()[1].is_static() && x.shape()[1].size() == bv.constant->dim(1)) {
      SymTensor y = nn::linear(x, bv.constant->dim(0), c.node_name(), has_c);
      bind(c, y, 0, bv, "weight");
      if (has_c) bind(c, y, 1, c.in(2), "bias");
      return {tensor_value(y)};
    }
  }
  SymTensor a = c.tensor(0), b = c.tensor(1);
  if (ta) a = permute(a, {1, 0}, c.node_name("a_t"));
  if (tb) b = permute(b, {1, 0}, c.node_name("b_t"));
  const bool more = alpha != 1.0 || (has_c && beta != 0.0);
  SymTensor y = matmul(a, b, c.node_name(more ? "mm" : ""));
  if (alpha != 1.0) y = mul(y, alpha, c.node_name(has_c ? "alpha" : ""));
  if (has_c && beta != 0.0) {
    SymTensor cc = c.tensor(2);
    if (beta != 1.0) cc = mul(cc, beta, c.node_name("beta"));
    y = add(y, cc, c.node_name());
  }
  return {tensor_value(y)};
}

// Two-operand einsum equations that are (batched) matrix products, such as "bij,bjk->bik",
// "bhqd,bhkd->bhqk" or "ij,jk": permuted into [batch..., m, k] · [batch..., k, n].
Values einsum_op(NodeContext& c) {
  std::string eq = c.attrs.get_string("equation");
  eq.erase(std::remove(eq.begin(), eq.end(), ' '), eq.end());
  const auto arrow = eq.find("->");
  const auto comma = eq.find(',');
  if (comma == std::string::npos || arrow == std::string::npos || c.num_inputs() != 2)
    c.fail("equation " + quote_name(eq) + " is not supported (two operands with an explicit output, one matrix product)");
  const std::string A = eq.substr(0, comma), B = eq.substr(comma + 1, arrow - comma - 1), O = eq.substr(arrow + 2);
  std::string batch, m, n, k;
  for (char ch : O) {
    const bool ia = A.find(ch) != std::string::npos, ib = B.find(ch) != std::string::npos;
    if (ia && ib) batch += ch;
    else if (ia) m += ch;
    else if (ib) n += ch;
  }
  for (char ch : A)
    if (B.find(ch) != std::string::npos && O.find(ch) == std::string::npos) k += ch;
  if (m.size() > 1 || n.size() > 1 || k.size() != 1 || A.size() != batch.size() + m.size() + 1 ||
      B.size() != batch.size() + n.size() + 1 || O.size() != batch.size() + m.size() + n.size())
    c.fail("equation " + quote_name(eq) + " is not supported (two operands with an explicit output, one matrix product)");
  auto perm_for = [](const std::string& from, const std::string& to) {
    std::vector<std::int64_t> p;
    for (char ch : to) p.push_back(static_cast<std::int64_t>(from.find(ch)));
    return p;
  };
  auto is_identity = [](const std::vector<std::int64_t>& p) {
    for (std::size_t i = 0; i < p.size(); ++i)
      if (p[i] != static_cast<std::int64_t>(i)) return false;
    return true;
  };
  SymTensor a = c.tensor(0), b = c.tensor(1);
  const std::string a_to = batch + m + k, b_to = batch + k + n;
  auto pa = perm_for(A, a_to), pb = perm_for(B, b_to);
  if (!is_identity(pa)) a = permute(a, pa, c.node_name("a"));
  if (!is_identity(pb)) b = permute(b, pb, c.node_name("b"));
  const std::string prod = batch + m + n;
  auto po = perm_for(prod, O);
  SymTensor y = matmul(a, b, c.node_name(is_identity(po) ? "" : "mm"));
  if (!is_identity(po)) y = permute(y, po, c.node_name());
  return {tensor_value(y)};
}

// ---- convolution and pooling ----

struct Window {
  std::vector<std::int64_t> kernel, strides, dilations, pads_begin, pads_end;
};

// Kernel, strides, dilations and pads of a Conv/Pool node over `spatial` dims, auto_pad applied
// to the input's static spatial sizes.
// The kernel, strides, dilations and pads of a window over the spatial dims of `x` ([N, C,
// spatial...]): one entry per spatial dim (two for pads), kernel, strides and dilations positive,
// pads not negative. Checked before any of them is used as an index or a divisor.
void check_window(NodeContext& c, const Shape& x, const std::vector<std::int64_t>& kernel,
                  const std::vector<std::int64_t>& strides, const std::vector<std::int64_t>& dilations,
                  const std::vector<std::int64_t>& pads) {
  if (x.rank() < 3) c.fail(util::cat("expects an input [N, C, spatial...], got ", x.to_string()));
  const std::size_t sp = x.rank() - 2;
  if (kernel.size() != sp)
    c.fail(util::cat("kernel_shape ", sizes_to_string(kernel), " has ", kernel.size(), " dims for the ", sp,
                     " spatial dims of the input ", x.to_string()));
  if (strides.size() != sp || dilations.size() != sp || pads.size() != 2 * sp)
    c.fail(util::cat("strides ", sizes_to_string(strides), ", dilations ", sizes_to_string(dilations), " and pads ",
                     sizes_to_string(pads), " must have ", sp, ", ", sp, " and ", 2 * sp, " entries for the input ",
                     x.to_string()));
  auto positive = [&](const std::vector<std::int64_t>& v, const char* what) {
    for (std::int64_t k : v)
      if (k < 1) c.fail(util::cat(what, " ", sizes_to_string(v), " must be positive"));
  };
  positive(kernel, "kernel_shape");
  positive(strides, "strides");
  positive(dilations, "dilations");
  for (std::int64_t p : pads)
    if (p < 0) c.fail(util::cat("pads ", sizes_to_string(pads), " must not be negative"));
  // A padded static dim, with either pad taken twice (the ops pad symmetrically), must fit.
  for (std::size_t i = 0; i < sp; ++i) {
    if (!x[2 + i].is_static()) continue;
    const std::int64_t most = std::max(pads[i], pads[i + sp]);
    (void)checked_add(c, checked_add(c, x[2 + i].size(), most, "a padded dim"), most, "a padded dim");
  }
  // The extent of a dilated kernel, (kernel - 1) * dilation + 1, must fit.
  for (std::size_t i = 0; i < sp; ++i)
    (void)checked_add(c, checked_mul(c, kernel[i] - 1, dilations[i], "a dilated kernel"), 1, "a dilated kernel");
}

// Kernel, strides, dilations and pads of a Conv/Pool node over `spatial` dims, auto_pad applied
// to the input's static spatial sizes.
Window window(NodeContext& c, const Shape& x, std::vector<std::int64_t> kernel) {
  const std::size_t sp = kernel.size();
  Window w;
  w.kernel = kernel;
  w.strides = c.attrs.get_ints("strides", std::vector<std::int64_t>(sp, 1));
  w.dilations = c.attrs.get_ints("dilations", std::vector<std::int64_t>(sp, 1));
  auto pads = c.attrs.get_ints("pads", std::vector<std::int64_t>(2 * sp, 0));
  check_window(c, x, kernel, w.strides, w.dilations, pads);
  w.pads_begin.assign(pads.begin(), pads.begin() + static_cast<std::ptrdiff_t>(sp));
  w.pads_end.assign(pads.begin() + static_cast<std::ptrdiff_t>(sp), pads.end());
  const std::string ap = c.attrs.get_string("auto_pad", "NOTSET");
  if (ap == "SAME_UPPER" || ap == "SAME_LOWER") {
    for (std::size_t i = 0; i < sp; ++i) {
      const Dim& d = x[2 + i];
      if (d.is_dynamic()) c.fail(util::cat("auto_pad ", ap, " needs static spatial dims, got ", x.to_string()));
      // out = ceil(d / stride); total = max(0, (out - 1) * stride + (kernel - 1) * dilation + 1 - d).
      const std::int64_t out = d.size() / w.strides[i] + (d.size() % w.strides[i] != 0 ? 1 : 0);
      const std::int64_t extent = (kernel[i] - 1) * w.dilations[i] + 1;  // checked by check_window
      const std::int64_t covered =
          checked_add(c, checked_mul(c, std::max<std::int64_t>(out - 1, 0), w.strides[i], "the SAME padding"), extent,
                      "the SAME padding");
      const std::int64_t total = std::max<std::int64_t>(0, covered - d.size());
      const std::int64_t small = total / 2, big = total - small;
      w.pads_begin[i] = ap == "SAME_UPPER" ? small : big;
      w.pads_end[i] = ap == "SAME_UPPER" ? big : small;
    }
  } else if (ap == "VALID") {
    std::fill(w.pads_begin.begin(), w.pads_begin.end(), 0);
    std::fill(w.pads_end.begin(), w.pads_end.end(), 0);
  } else if (ap != "NOTSET") {
    c.fail("has an unknown auto_pad " + quote_name(ap));
  }
  return w;
}

// Brings a 1-D spatial input [N, C, L] to [N, C, 1, L] (and windows to 2-D); 2-D passes.
SymTensor to_2d(NodeContext& c, const SymTensor& x, Window& w) {
  if (x.rank() == 4) return x;
  if (x.rank() != 3)
    c.fail(util::cat("input ", x.shape().to_string(), ": 3-D and higher spatial inputs are not supported (1-D and 2-D are)"));
  for (auto* v : {&w.kernel, &w.strides, &w.dilations}) v->insert(v->begin(), 1);
  w.pads_begin.insert(w.pads_begin.begin(), 0);
  w.pads_end.insert(w.pads_end.begin(), 0);
  return view(x, {DimRef::of(0, 0), DimRef::of(0, 1), DimRef::constant(1), DimRef::of(0, 2)}, {}, c.node_name("2d"));
}
SymTensor from_2d(NodeContext& c, const SymTensor& y, std::size_t rank) {
  if (rank == 4) return y;
  return view(y, {DimRef::of(0, 0), DimRef::of(0, 1), DimRef::of(0, 3)}, {}, c.node_name());
}

// Explicit padding where begin and end differ (the ops pad symmetrically), or where a pool's pad
// exceeds half its kernel (which the pooling ops refuse).
SymTensor pad_asymmetric(NodeContext& c, SymTensor x, Window& w, double value, bool pool = false) {
  bool sym = true;
  for (std::size_t i = 0; i < w.pads_begin.size(); ++i) {
    sym = sym && w.pads_begin[i] == w.pads_end[i];
    if (pool && w.pads_begin[i] > w.kernel[i] / 2) sym = false;  // pad * 2 > kernel, without overflow
  }
  if (sym) return x;
  std::vector<std::int64_t> b(x.rank(), 0), e(x.rank(), 0);
  for (std::size_t i = 0; i < w.pads_begin.size(); ++i) {
    b[2 + i] = w.pads_begin[i];
    e[2 + i] = w.pads_end[i];
  }
  std::fill(w.pads_begin.begin(), w.pads_begin.end(), 0);
  std::fill(w.pads_end.begin(), w.pads_end.end(), 0);
  return ops::pad(x, b, e, ops::PadMode::Constant, value, c.node_name("pad"));
}

Values conv_op(NodeContext& c) {
  SymTensor x0 = c.tensor(0);
  Value& wv = c.in(1);
  if (wv.graph_input) c.constant(1, "its weight");
  if (!wv.is_constant()) c.fail("needs its weight (input " + quote_name(wv.name) + ") to be an initializer");
  const Tensor& W = *wv.constant;
  if (W.rank() != x0.rank() || W.rank() < 3)
    c.fail(util::cat("weight ", sizes_to_string(W.shape()), " does not match the input ", x0.shape().to_string()));
  std::vector<std::int64_t> k(W.shape().begin() + 2, W.shape().end());
  if (c.attrs.get_int("group", 1) < 1) c.fail(util::cat("group ", c.attrs.get_int("group", 1), " must be positive"));
  if (c.attrs.has("kernel_shape") && c.attrs.get_ints("kernel_shape") != k)
    c.fail(util::cat("kernel_shape ", sizes_to_string(c.attrs.get_ints("kernel_shape")), " differs from the weight's ", sizes_to_string(k)));
  Window w = window(c, x0.shape(), k);
  SymTensor x = to_2d(c, x0, w);
  x = pad_asymmetric(c, x, w, 0.0);
  nn::Conv2dOptions o;
  o.stride = Size2(w.strides[0], w.strides[1]);
  o.padding = Size2(w.pads_begin[0], w.pads_begin[1]);
  o.dilation = Size2(w.dilations[0], w.dilations[1]);
  o.groups = c.attrs.get_int("group", 1);
  o.bias = c.has_input(2);
  SymTensor y = nn::conv2d(x, W.dim(0), Size2(w.kernel[0], w.kernel[1]), o, c.node_name(x0.rank() == 4 ? "" : "conv"));
  bind(c, y, 0, wv, "weight");
  if (o.bias) bind(c, y, 1, c.in(2), "bias");
  return {tensor_value(from_2d(c, y, x0.rank()))};
}

Values conv_transpose_op(NodeContext& c) {
  SymTensor x0 = c.tensor(0);
  Value& wv = c.in(1);
  if (wv.graph_input) c.constant(1, "its weight");
  if (!wv.is_constant()) c.fail("needs its weight (input " + quote_name(wv.name) + ") to be an initializer");
  const Tensor& W = *wv.constant;
  if (W.rank() != x0.rank() || W.rank() < 3)
    c.fail(util::cat("weight ", sizes_to_string(W.shape()), " does not match the input ", x0.shape().to_string()));
  const std::int64_t groups = c.attrs.get_int("group", 1);
  if (groups < 1) c.fail(util::cat("group ", groups, " must be positive"));
  std::vector<std::int64_t> k(W.shape().begin() + 2, W.shape().end());
  const std::size_t sp = k.size();
  Window w;
  w.kernel = k;
  w.strides = c.attrs.get_ints("strides", std::vector<std::int64_t>(sp, 1));
  w.dilations = c.attrs.get_ints("dilations", std::vector<std::int64_t>(sp, 1));
  auto pads = c.attrs.get_ints("pads", std::vector<std::int64_t>(2 * sp, 0));
  auto outpad = c.attrs.get_ints("output_padding", std::vector<std::int64_t>(sp, 0));
  if (outpad.size() != sp)
    c.fail(util::cat("output_padding ", sizes_to_string(outpad), " must have ", sp, " entries"));
  check_window(c, x0.shape(), k, w.strides, w.dilations, pads);
  for (std::int64_t p : outpad)
    if (p < 0) c.fail(util::cat("output_padding ", sizes_to_string(outpad), " must not be negative"));
  w.pads_begin.assign(pads.begin(), pads.begin() + static_cast<std::ptrdiff_t>(sp));
  w.pads_end.assign(pads.begin() + static_cast<std::ptrdiff_t>(sp), pads.end());
  const std::string ap = c.attrs.get_string("auto_pad", "NOTSET");
  auto out_shape = c.attrs.get_ints("output_shape", {});
  if (!out_shape.empty() || ap == "SAME_UPPER" || ap == "SAME_LOWER") {
    // Pads that give the asked output size (output_shape, or in*stride for SAME).
    if (out_shape.size() > sp) out_shape.erase(out_shape.begin(), out_shape.end() - static_cast<std::ptrdiff_t>(sp));
    if (!out_shape.empty() && out_shape.size() != sp)
      c.fail(util::cat("output_shape ", sizes_to_string(c.attrs.get_ints("output_shape")), " has fewer than the ", sp,
                       " spatial dims"));
    for (std::int64_t o : out_shape)
      if (o < 0) c.fail(util::cat("output_shape ", sizes_to_string(out_shape), " must not be negative"));
    for (std::size_t i = 0; i < sp; ++i) {
      const Dim& d = x0.shape()[2 + i];
      if (d.is_dynamic()) c.fail("output_shape and auto_pad need static spatial dims");
      const char* what = "the output size";
      const std::int64_t want = out_shape.empty() ? checked_mul(c, d.size(), w.strides[i], what) : out_shape[i];
      // stride * (d - 1) + output_padding + (kernel - 1) * dilation + 1 - want
      const std::int64_t full = checked_add(
          c, checked_add(c, checked_mul(c, w.strides[i], std::max<std::int64_t>(d.size() - 1, 0), what), outpad[i], what),
          (k[i] - 1) * w.dilations[i] + 1, what);
      std::int64_t total = checked_sub(c, full, want, what);
      if (total < 0) outpad[i] = checked_sub(c, outpad[i], total, what), total = 0;  // a larger output than the kernel covers: extra zeros
      const std::int64_t small = total / 2, big = total - small;
      const bool upper = ap != "SAME_LOWER";
      w.pads_begin[i] = upper ? small : big;
      w.pads_end[i] = upper ? big : small;
    }
  } else if (ap == "VALID") {
    std::fill(w.pads_begin.begin(), w.pads_begin.end(), 0);
    std::fill(w.pads_end.begin(), w.pads_end.end(), 0);
  }
  SymTensor x = to_2d(c, x0, w);
  if (sp == 1) outpad.insert(outpad.begin(), 0);
  ops::ConvTranspose2dOptions o;
  o.stride_h = w.strides[0], o.stride_w = w.strides[1];
  o.pad_top = w.pads_begin[0], o.pad_left = w.pads_begin[1], o.pad_bottom = w.pads_end[0], o.pad_right = w.pads_end[1];
  o.output_padding_h = outpad[0], o.output_padding_w = outpad[1];
  o.dilation_h = w.dilations[0], o.dilation_w = w.dilations[1];
  o.groups = groups;
  o.bias = c.has_input(2);
  SymTensor y = ops::conv_transpose2d(x, checked_mul(c, W.dim(1), groups, "the output channels"), w.kernel[0], w.kernel[1], o,
                                      c.node_name(x0.rank() == 4 ? "" : "convt"));
  bind(c, y, 0, wv, "weight");
  if (o.bias) bind(c, y, 1, c.in(2), "bias");
  return {tensor_value(from_2d(c, y, x0.rank()))};
}

Converter pool(bool is_max) {
  return [is_max](NodeContext& c) -> Values {
    SymTensor x0 = c.tensor(0);
    if (c.node.output_size() > 1 && !c.node.output(1).empty()) c.fail("returns indices, which is not supported");
    Window w = window(c, x0.shape(), c.attrs.get_ints("kernel_shape"));
    SymTensor x = to_2d(c, x0, w);
    const bool ceil_mode = c.attrs.get_int("ceil_mode", 0) != 0;
    const std::string name = c.node_name(x0.rank() == 4 ? "" : "pool");
    SymTensor y;
    if (is_max) {
      if (c.attrs.get_int("storage_order", 0) != 0) c.fail("storage_order 1 is not supported");
      x = pad_asymmetric(c, x, w, -std::numeric_limits<double>::infinity(), true);
      y = max_pool2d(x, Size2(w.kernel[0], w.kernel[1]), Size2(w.strides[0], w.strides[1]),
                     Size2(w.pads_begin[0], w.pads_begin[1]), Size2(w.dilations[0], w.dilations[1]), ceil_mode, name);
    } else {
      const bool include = c.attrs.get_int("count_include_pad", 0) != 0;
      for (auto d : w.dilations)
        if (d != 1) c.fail("AveragePool with dilations (an attribute from opset 19) is not supported");
      bool sym = true;
      for (std::size_t i = 0; i < w.pads_begin.size(); ++i)
        sym = sym && w.pads_begin[i] == w.pads_end[i] && w.pads_begin[i] <= w.kernel[i] / 2;
      if (!sym && !include)
        c.fail("pads that differ at both ends or exceed half the kernel, with count_include_pad 0, are not supported");
      x = pad_asymmetric(c, x, w, 0.0, true);
      y = avg_pool2d(x, Size2(w.kernel[0], w.kernel[1]), Size2(w.strides[0], w.strides[1]),
                     Size2(w.pads_begin[0], w.pads_begin[1]), ceil_mode, include, name);
    }
    return {tensor_value(from_2d(c, y, x0.rank()))};
  };
}

Converter global_pool(ReduceFn fn) {
  return [fn](NodeContext& c) -> Values {
    SymTensor x = c.tensor(0);
    if (x.rank() < 3) c.fail(util::cat("expects [N, C, spatial...], got ", x.shape().to_string()));
    if (fn == ReduceFn::Mean && x.rank() == 4 && is_float_type(x.dtype()))
      return {tensor_value(global_avg_pool(x, c.node_name()))};
    std::vector<std::int64_t> axes;
    for (std::size_t i = 2; i < x.rank(); ++i) axes.push_back(static_cast<std::int64_t>(i));
    return {tensor_value(ops::reduce(fn, x, axes, true, c.node_name()))};
  };
}

// ---- normalisation ----

Values batch_norm_op(NodeContext& c) {
  if (c.attrs.get_int("training_mode", 0) != 0) c.fail("training_mode 1 is not supported (import for inference)");
  SymTensor x0 = c.tensor(0);
  if (x0.rank() < 2 || x0.rank() > 4)
    c.fail(util::cat("input ", x0.shape().to_string(), ": ranks above 4 are not supported ([N, C], [N, C, L], [N, C, H, W] are)"));
  SymTensor x = x0;
  if (x0.rank() != 4) {
    std::vector<DimRef> r{DimRef::of(0, 0), DimRef::of(0, 1), x0.rank() == 3 ? DimRef::of(0, 2) : DimRef::constant(1),
                          DimRef::constant(1)};
    x = view(x0, r, {}, c.node_name("4d"));
  }
  const double eps = c.attrs.get_float("epsilon", 1e-5), momentum = c.attrs.get_float("momentum", 0.9);
  SymTensor y = nn::batch_norm2d(x, c.node_name(x0.rank() == 4 ? "" : "bn"), eps, 1.0 - momentum);
  bind(c, y, 0, c.in(1), "weight");
  bind(c, y, 1, c.in(2), "bias");
  bind(c, y, 2, c.in(3), "running_mean");
  bind(c, y, 3, c.in(4), "running_var");
  if (x0.rank() != 4) {
    std::vector<DimRef> r;
    for (std::size_t i = 0; i < x0.rank(); ++i) r.push_back(DimRef::of(0, static_cast<int>(i)));
    y = view(y, r, {}, c.node_name());  // y's first dims are x0's
  }
  return {tensor_value(y)};
}

Values layer_norm_op(NodeContext& c) {
  SymTensor x = c.tensor(0);
  const auto axis = static_cast<std::size_t>(norm_axis(c, c.attrs.get_int("axis", -1), x.rank()));
  std::vector<std::int64_t> shape;
  for (std::size_t i = axis; i < x.rank(); ++i) {
    if (x.shape()[i].is_dynamic()) c.fail(util::cat("normalises over a dynamic dim of ", x.shape().to_string()));
    shape.push_back(x.shape()[i].size());
  }
  const double eps = c.attrs.get_float("epsilon", 1e-5);
  if (c.attrs.get_int("stash_type", 1) != 1) c.fail("stash_type other than 1 (f32) is not supported");
  const bool half = x.dtype() == DType::F16 || x.dtype() == DType::BF16;
  SymTensor xf = half ? ops::cast(x, DType::F32, c.node_name("f32")) : x;
  SymTensor y = nn::layer_norm(xf, shape, c.node_name(half ? "ln" : ""), eps, true);
  if (c.in(1).graph_input) c.constant(1, "the scale");
  if (c.has_input(2) && c.in(2).graph_input) c.constant(2, "the bias");
  bind(c, y, 0, c.in(1), "weight");
  if (c.has_input(2)) bind(c, y, 1, c.in(2), "bias");
  if (half) y = ops::cast(y, x.dtype(), c.node_name());
  Values out{tensor_value(y)};
  // The optional Mean and InvStdDev outputs (over the normalised dims, kept as 1s).
  const bool want_stats = (c.node.output_size() > 1 && !c.node.output(1).empty()) ||
                          (c.node.output_size() > 2 && !c.node.output(2).empty());
  if (want_stats) {
    std::vector<std::int64_t> axes;
    for (std::size_t i = axis; i < x.rank(); ++i) axes.push_back(static_cast<std::int64_t>(i));
    SymTensor mean = ops::reduce(ReduceFn::Mean, xf, axes, true, c.node_name("mean"));
    SymTensor d = sub(xf, mean, c.node_name("centred"));
    SymTensor var = ops::reduce(ReduceFn::Mean, mul(d, d, c.node_name("sq")), axes, true, c.node_name("var"));
    SymTensor inv = ops::pointwise(PointwiseFn::Reciprocal,
                                   {ops::pointwise(PointwiseFn::Sqrt, {add(var, eps, c.node_name("var_eps"))}, {},
                                                   c.node_name("std"))},
                                   {}, c.node_name("inv_std"));
    out.push_back(tensor_value(mean));
    out.push_back(tensor_value(inv));
  }
  return out;
}

// (x - mean) / sqrt(var + eps) over `axes` (kept), the statistics of each slice the other dims
// pick: the normalisation of InstanceNormalization and GroupNormalization.
SymTensor normalized(NodeContext& c, const SymTensor& x, const std::vector<std::int64_t>& axes, double eps) {
  SymTensor mean = ops::reduce(ReduceFn::Mean, x, axes, true, c.node_name("mean"));
  SymTensor d = sub(x, mean, c.node_name("centred"));
  SymTensor var = ops::reduce(ReduceFn::Mean, mul(d, d, c.node_name("sq")), axes, true, c.node_name("var"));
  SymTensor inv = ops::pointwise(PointwiseFn::Reciprocal,
                                 {ops::pointwise(PointwiseFn::Sqrt, {add(var, eps, c.node_name("var_eps"))}, {},
                                                 c.node_name("std"))},
                                 {}, c.node_name("inv_std"));
  return mul(d, inv, c.node_name("normed"));
}

// (x - mean) / sqrt(var + eps) * scale + bias over each sample's and channel's spatial dims.
Values instance_norm_op(NodeContext& c) {
  SymTensor x = c.tensor(0);
  if (x.rank() < 3) c.fail(util::cat("expects [N, C, spatial...], got ", x.shape().to_string()));
  std::vector<std::int64_t> axes;
  for (std::size_t i = 2; i < x.rank(); ++i) axes.push_back(static_cast<std::int64_t>(i));
  const double eps = c.attrs.get_float("epsilon", 1e-5);
  SymTensor n = normalized(c, x, axes, eps);
  std::vector<DimRef> per_channel{DimRef::of(0, 0)};
  for (std::size_t i = 2; i < x.rank(); ++i) per_channel.push_back(DimRef::constant(1));
  SymTensor scale = view(c.tensor(1), per_channel, {}, c.node_name("scale"));
  SymTensor bias = view(c.tensor(2), per_channel, {}, c.node_name("bias"));
  return {tensor_value(add(mul(n, scale, c.node_name("scaled")), bias, c.node_name()))};
}

Converter softmax_like(bool log) {
  return [log](NodeContext& c) -> Values {
    SymTensor x = c.tensor(0);
    const std::int64_t def = c.opset >= 13 ? -1 : 1;
    const std::int64_t axis = norm_axis(c, c.attrs.get_int("axis", def), std::max<std::size_t>(x.rank(), 1));
    if (c.opset >= 13 || axis == static_cast<std::int64_t>(x.rank()) - 1) {
      return {tensor_value(log ? log_softmax(x, axis, c.node_name()) : softmax(x, axis, c.node_name()))};
    }
    // Before opset 13: over the flattened dims [axis, rank).
    auto a = dim_product(c, x, 0, static_cast<std::size_t>(axis));
    auto b = dim_product(c, x, static_cast<std::size_t>(axis), x.rank());
    if (!b || !b->is_constant()) c.fail("softmax over flattened dynamic dims is not supported");
    SymTensor f = view(x, {a ? *a : DimRef::constant(-1), *b}, {}, c.node_name("2d"));
    SymTensor y = log ? log_softmax(f, -1, c.node_name("sm")) : softmax(f, -1, c.node_name("sm"));
    return {tensor_value(view(y, dims_of_x(x, 1), {x}, c.node_name()))};
  };
}

// ---- reductions ----

Converter reduce(ReduceFn fn, int axes_input_since) {
  return [fn, axes_input_since](NodeContext& c) -> Values {
    std::vector<std::int64_t> axes = axes_arg(c, 1, axes_input_since);
    const bool keep = c.attrs.get_int("keepdims", 1) != 0;
    const bool noop = c.attrs.get_int("noop_with_empty_axes", 0) != 0;
    if (fn == ReduceFn::Prod && c.in(0).dims && axes.empty()) {
      std::int64_t p = 1;
      for (const auto& d : *c.in(0).dims) {
        if (!d.is_known()) return {dims_value({SymDim::unknown()}, !keep)};
        p = checked_mul(c, p, d.value, "the product of the sizes");
      }
      return {dims_value({SymDim::known(p)}, !keep)};
    }
    SymTensor x = c.tensor(0);
    if (axes.empty() && noop) return {tensor_value(view(x, dims_of_x(x), {}, c.node_name()))};
    if (x.dtype() == DType::Bool) {
      // ReduceMax and ReduceMin take bool from opset 20 (False < True): any and all. They run on
      // 0/1 as i32; over no elements max gives the lowest i32 and min the highest, so "> 0" gives
      // the empty reduction's False and True.
      if (fn != ReduceFn::Max && fn != ReduceFn::Min) c.fail("takes no bool input (ReduceMax and ReduceMin do, from opset 20)");
      if (c.opset < 20)
        c.fail(util::cat("takes a bool input from opset 20; the file imports opset ", c.opset));
      SymTensor r = ops::reduce(fn, ops::cast(x, DType::I32, c.node_name("i32")), axes, keep, c.node_name("i32_r"));
      Value zero = constant_value(Tensor::zeros(DType::I32, {}));
      return {tensor_value(
          ops::pointwise(PointwiseFn::Greater, {r, materialize_value(c, zero, "zero")}, {}, c.node_name()))};
    }
    return {tensor_value(ops::reduce(fn, x, axes, keep, c.node_name()))};
  };
}

Converter arg_reduce(bool is_max) {
  return [is_max](NodeContext& c) -> Values {
    SymTensor x = c.tensor(0);
    return {tensor_value(ops::arg_reduce(is_max, x, c.attrs.get_int("axis", 0), c.attrs.get_int("keepdims", 1) != 0,
                                         c.attrs.get_int("select_last_index", 0) != 0, c.node_name()))};
  };
}

Values cumsum_op(NodeContext& c) {
  SymTensor x = c.tensor(0);
  const auto axis = c.ints(1, "the axis");
  if (axis.size() != 1) c.fail("axis must be one value");
  return {tensor_value(ops::cumsum(x, axis[0], c.attrs.get_int("exclusive", 0) != 0,
                                   c.attrs.get_int("reverse", 0) != 0, c.node_name()))};
}

// ---- resize ----

Values resize_op(NodeContext& c) {
  SymTensor x = c.tensor(0);
  ops::ResizeSpec spec;
  const std::string mode = c.attrs.get_string("mode", "nearest");
  if (mode == "nearest") spec.mode = ops::ResizeSpec::Mode::Nearest;
  else if (mode == "linear" || mode == "bilinear") spec.mode = ops::ResizeSpec::Mode::Linear;
  else if (mode == "cubic" || mode == "bicubic") spec.mode = ops::ResizeSpec::Mode::Cubic;
  else c.fail("has an unknown mode " + quote_name(mode));
  const bool upsample = c.node.op_type() == "Upsample";
  spec.coordinate_transformation_mode =
      upsample || c.opset < 11 ? "asymmetric" : c.attrs.get_string("coordinate_transformation_mode", "half_pixel");
  spec.nearest_mode = upsample || c.opset < 11 ? "floor" : c.attrs.get_string("nearest_mode", "round_prefer_floor");
  spec.cubic_coeff_a = c.attrs.get_float("cubic_coeff_a", -0.75);
  spec.exclude_outside = c.attrs.get_int("exclude_outside", 0) != 0;
  if (c.attrs.get_int("antialias", 0) != 0) c.fail("antialias is not supported");
  if (c.attrs.has("axes")) c.fail("the axes attribute is not supported");
  if (c.attrs.get_string("keep_aspect_ratio_policy", "stretch") != "stretch")
    c.fail("keep_aspect_ratio_policy other than stretch is not supported");
  const std::size_t scales_at = (upsample || c.opset < 11) ? 1 : 2, sizes_at = 3;
  if (upsample && c.opset < 9) {
    for (double s : c.attrs.get_floats("scales")) spec.scales.push_back(s);
  } else if (c.has_input(scales_at) && c.constant(scales_at, "the scales").numel() > 0) {
    const Tensor& s = c.constant(scales_at, "the scales");
    for (std::int64_t i = 0; i < s.numel(); ++i) spec.scales.push_back(s.item(i));
  } else if (c.has_input(sizes_at)) {
    const auto d = std::optional<std::vector<SymDim>>(shape_arg(c, sizes_at, "the sizes"));
    for (std::size_t i = 0; i < d->size(); ++i) {
      const SymDim& s = (*d)[i];
      if (s.is_known()) spec.sizes.push_back(s.value);
      else if (s.kind == SymDim::Kind::DimOf && i < x.rank() && s.src.shape()[static_cast<std::size_t>(s.axis)] == x.shape()[i])
        spec.sizes.push_back(-1);
      else c.fail("has an output size known only at run time");
    }
  } else {
    c.fail("has neither scales nor sizes");
  }
  if (spec.coordinate_transformation_mode == "tf_crop_and_resize") c.fail("tf_crop_and_resize is not supported");
  return {tensor_value(ops::resize(x, spec, c.node_name()))};
}

// Trilu: the upper (j - i >= k) or lower (j - i <= k) triangle of the last two dims, zeros elsewhere,
// as Where(mask, x, 0) with the mask made at import.
Values trilu_op(NodeContext& c) {
  SymTensor x = c.tensor(0);
  if (x.rank() < 2) c.fail(util::cat("needs rank >= 2, got ", x.shape().to_string()));
  const Dim &M = x.shape()[x.rank() - 2], &N = x.shape()[x.rank() - 1];
  if (M.is_dynamic() || N.is_dynamic()) c.fail("dynamic matrix dims are not supported");
  std::int64_t k = 0;
  if (c.has_input(1)) {
    const auto ks = c.ints(1, "k");
    if (ks.size() != 1) c.fail(util::cat("k must be one integer, got ", ks.size()));
    k = ks[0];
  }
  const bool upper = c.attrs.get_int("upper", 1) != 0;
  const std::int64_t cells = checked_mul(c, M.size(), N.size(), "the mask's size");
  check_memory(c.label, static_cast<std::uint64_t>(cells), util::cat("the ", M.size(), " × ", N.size(), " mask it makes at import"));
  Tensor mask = Tensor::empty(DType::Bool, {M.size(), N.size()});
  auto* m = static_cast<std::uint8_t*>(mask.raw());
  for (std::int64_t i = 0; i < M.size(); ++i)
    for (std::int64_t j = 0; j < N.size(); ++j) {
      const std::int64_t diag = j - i;  // both in [0, 2^63): no overflow
      m[i * N.size() + j] = upper ? (diag >= k) : (diag <= k);
    }
  Value mv = constant_value(mask), zv = constant_value(Tensor::zeros(x.dtype(), {}));
  SymTensor mt = materialize_value(c, mv, "mask"), zt = materialize_value(c, zv, "zero");
  return {tensor_value(ops::pointwise(PointwiseFn::Where, {mt, x, zt}, {}, c.node_name()))};
}

// Hardmax: 1 at the first maximum along the axis, 0 elsewhere (opset < 13: over the flattened
// dims [axis, rank), as a 2-D [outer, inner]).
Values hardmax_op(NodeContext& c) {
  SymTensor x0 = c.tensor(0);
  const std::int64_t def = c.opset >= 13 ? -1 : 1;
  std::int64_t axis = norm_axis(c, c.attrs.get_int("axis", def), x0.rank());
  SymTensor x = x0;
  if (c.opset < 13) {
    auto a = dim_product(c, x0, 0, static_cast<std::size_t>(axis));
    auto b = dim_product(c, x0, static_cast<std::size_t>(axis), x0.rank());
    if (!b || !b->is_constant()) c.fail("over flattened dynamic dims is not supported");
    x = view(x0, {a ? *a : DimRef::constant(-1), *b}, {}, c.node_name("2d"));
    axis = 1;
  }
  const Dim& n = x.shape()[static_cast<std::size_t>(axis)];
  if (n.is_dynamic()) c.fail("a dynamic reduced dim is not supported");
  SymTensor am = ops::arg_reduce(true, x, axis, true, false, c.node_name("argmax"));
  check_memory(c.label, static_cast<std::uint64_t>(checked_mul(c, n.size(), 8, "the index's bytes")),
               util::cat("the index of ", n.size(), " elements it makes at import"));
  std::vector<std::int64_t> idx(static_cast<std::size_t>(n.size()));
  std::iota(idx.begin(), idx.end(), 0);
  std::vector<std::int64_t> shape(x.rank(), 1);
  shape[static_cast<std::size_t>(axis)] = n.size();
  Value iv = constant_value(Tensor::from_vector<std::int64_t>(shape, idx));
  SymTensor it = materialize_value(c, iv, "index");
  SymTensor hit = ops::pointwise(PointwiseFn::Equal, {it, am}, {}, c.node_name("hit"));
  SymTensor y = ops::cast(hit, x.dtype(), c.node_name(c.opset < 13 ? "flat" : ""));
  if (c.opset < 13) y = view(y, dims_of_x(x0, 1), {x0}, c.node_name());
  return {tensor_value(y)};
}

// -input[n, target[n, d...], d...] * weight[target], 0 where target == ignore_index, reduced
// ("none", "sum", or "mean": the sum over the sum of the applied weights). `logp` is [N, C, d...].
SymTensor nll(NodeContext& c, const SymTensor& logp, const SymTensor& target, std::optional<SymTensor> weight,
              const std::string& reduction, std::optional<std::int64_t> ignore, const std::string& suffix) {
  if (logp.rank() < 2 || target.rank() + 1 != logp.rank())
    c.fail(util::cat("input ", logp.shape().to_string(), " and target ", target.shape().to_string(), " do not match"));
  const DType ft = logp.dtype();
  SymTensor t = target.dtype() == DType::I64 ? target : ops::cast(target, DType::I64, c.node_name("target_i64"));
  std::optional<SymTensor> keep;  // 1 where the target counts
  if (ignore) {
    Value iv = constant_value(Tensor::from_vector<std::int64_t>({}, {*ignore}));
    SymTensor it = materialize_value(c, iv, "ignore_index");
    SymTensor is_ignored = ops::pointwise(PointwiseFn::Equal, {t, it}, {}, c.node_name("ignored"));
    Value zv = constant_value(Tensor::from_vector<std::int64_t>({}, {0}));
    t = ops::pointwise(PointwiseFn::Where, {is_ignored, materialize_value(c, zv, "zero_index"), t}, {},
                       c.node_name("safe_target"));
    keep = ops::cast(ops::pointwise(PointwiseFn::Not, {is_ignored}, {}, c.node_name("counted")), ft,
                     c.node_name("keep"));
  }
  std::vector<DimRef> with_c{DimRef::of(0, 0), DimRef::constant(1)};
  for (std::size_t i = 1; i < t.rank(); ++i) with_c.push_back(DimRef::of(0, static_cast<int>(i)));
  SymTensor picked = ops::gather_elements(logp, view(t, with_c, {}, c.node_name("target_c")), 1, c.node_name("picked"));
  std::vector<DimRef> without_c{DimRef::of(0, 0)};
  for (std::size_t i = 2; i < picked.rank(); ++i) without_c.push_back(DimRef::of(0, static_cast<int>(i)));
  SymTensor loss = ops::pointwise(PointwiseFn::Neg, {view(picked, without_c, {}, c.node_name("picked_n"))}, {},
                                  c.node_name("neg"));
  std::optional<SymTensor> w;
  if (weight) w = ops::gather(*weight, t, 0, c.node_name("weight_t"));
  if (keep) w = w ? mul(*w, *keep, c.node_name("weight_kept")) : *keep;
  if (w) loss = mul(loss, *w, c.node_name(reduction == "none" ? suffix : "weighted"));
  if (reduction == "none") return loss;
  std::vector<std::int64_t> all;
  for (std::size_t i = 0; i < loss.rank(); ++i) all.push_back(static_cast<std::int64_t>(i));
  SymTensor total = ops::reduce(ReduceFn::Sum, loss, all, false, c.node_name(reduction == "sum" ? suffix : "total"));
  if (reduction == "sum") return total;
  if (reduction != "mean") c.fail("has an unknown reduction " + quote_name(reduction));
  if (!w) return ops::reduce(ReduceFn::Mean, loss, all, false, c.node_name(suffix));
  SymTensor wsum = ops::reduce(ReduceFn::Sum, *w, all, false, c.node_name("weight_sum"));
  return div(total, wsum, c.node_name(suffix));
}

Values nll_op(NodeContext& c) {
  SymTensor x = c.tensor(0), t = c.tensor(1);
  std::optional<SymTensor> w;
  if (c.has_input(2)) w = c.tensor(2);
  std::optional<std::int64_t> ignore;
  if (c.attrs.has("ignore_index")) ignore = c.attrs.get_int("ignore_index");
  return {tensor_value(nll(c, x, t, w, c.attrs.get_string("reduction", "mean"), ignore, ""))};
}

Values softmax_cross_entropy_op(NodeContext& c) {
  SymTensor x = c.tensor(0), t = c.tensor(1);
  std::optional<SymTensor> w;
  if (c.has_input(2)) w = c.tensor(2);
  std::optional<std::int64_t> ignore;
  if (c.attrs.has("ignore_index")) ignore = c.attrs.get_int("ignore_index");
  if (x.rank() < 2) c.fail(util::cat("needs [N, C, ...] scores, got ", x.shape().to_string()));
  SymTensor logp = log_softmax(x, 1, c.node_name("log_prob"));
  Values out{tensor_value(nll(c, logp, t, w, c.attrs.get_string("reduction", "mean"), ignore, ""))};
  if (c.node.output_size() > 1 && !c.node.output(1).empty()) out.push_back(tensor_value(logp));
  return out;
}

Values dropout_op(NodeContext& c) {
  if (c.node.output_size() > 1 && !c.node.output(1).empty()) c.fail("returns its mask, which is not supported");
  if (c.has_input(2) && c.scalar(2, "training_mode") != 0)
    c.fail("training_mode true is not supported (import for inference)");
  SymTensor x = c.tensor(0);
  return {tensor_value(view(x, dims_of_x(x), {}, c.node_name()))};
}

// ---- ops of opsets 18 to 21 ----

// Gelu (opset 20): 0.5 x (1 + erf(x / √2)), or with approximate="tanh" 0.5 x (1 + tanh(√(2/π)
// (x + 0.044715 x³))): nn.gelu. f16 and bf16 are computed in f32 and cast back.
Values gelu_op(NodeContext& c) {
  if (c.opset < 20)
    c.fail(util::cat("is an op of opset 20 and later, but the file imports opset ", c.opset,
                     " (exporters write Gelu at opset 20 or later, and an Erf formula before)"));
  const std::string approx = c.attrs.get_string("approximate", "none");
  GeluApprox a = GeluApprox::Erf;
  if (approx == "tanh") a = GeluApprox::Tanh;
  else if (approx != "none") c.fail("has approximate " + quote_name(approx) + "; it is \"none\" or \"tanh\"");
  SymTensor x = c.tensor(0);
  if (is_float_type(x.dtype())) return {tensor_value(gelu(x, a, c.node_name()))};
  if (x.dtype() != DType::F16 && x.dtype() != DType::BF16)
    c.fail(util::cat("takes a float tensor, got ", dtype_name(x.dtype())));
  SymTensor y = gelu(ops::cast(x, DType::F32, c.node_name("f32_in")), a, c.node_name("f32"));
  return {tensor_value(ops::cast(y, x.dtype(), c.node_name()))};
}

// GroupNormalization: x [N, C, D...] seen as [N, G, C/G, D1·D2·…], each (instance, group)
// normalised to zero mean and unit variance, then scaled and shifted. Opset 18 gives a scale and
// bias per group ([G]); opset 21 per channel ([C]) and `stash_type`, the precision of the
// normalisation (1: f32, the default). The normalisation runs in f32 for f16 and bf16 inputs
// (kernelgraph reduces in f32 or f64) and in the input's dtype for f32 and f64, whatever
// stash_type says; the result is cast back to the input's dtype.
Values group_norm_op(NodeContext& c) {
  if (c.opset < 18)
    c.fail(util::cat("is an op of opset 18 and later, but the file imports opset ", c.opset));
  SymTensor x = c.tensor(0);
  const DType dt = x.dtype();
  if (!is_float_type(dt) && dt != DType::F16 && dt != DType::BF16)
    c.fail(util::cat("takes a float tensor, got ", dtype_name(dt)));
  if (x.rank() < 2) c.fail(util::cat("expects [N, C, D...], got ", x.shape().to_string()));
  const std::int64_t groups = c.attrs.get_int("num_groups");
  const double eps = c.attrs.get_float("epsilon", 1e-5);
  const bool per_channel = c.opset >= 21;
  if (per_channel) {
    const std::int64_t stash = c.attrs.get_int("stash_type", 1);
    // TensorProto element types: FLOAT 1, FLOAT16 10, DOUBLE 11, BFLOAT16 16.
    if (stash != 1 && stash != 10 && stash != 11 && stash != 16)
      c.fail(util::cat("has stash_type ", stash, " (", onnx_type_name(static_cast<int>(stash)),
                       "); it is a float type: 1 (FLOAT), 10, 11 or 16"));
  } else if (c.attrs.has("stash_type")) {
    c.fail(util::cat("has stash_type, an attribute of GroupNormalization 21; the file imports opset ", c.opset));
  }
  const Dim& cd = x.shape()[1];
  if (!cd.is_static()) c.fail(util::cat("needs a static channel dim, got ", x.shape().to_string()));
  const std::int64_t channels = cd.size();
  if (groups <= 0 || channels % groups != 0)
    c.fail(util::cat("has num_groups ", groups, ", which does not divide the ", channels, " channels of ",
                     x.shape().to_string()));
  const std::int64_t per_group = channels / groups;
  const std::int64_t affine = per_channel ? channels : groups;
  for (std::size_t i = 1; i <= 2; ++i) {
    const Shape s = c.in(i).shape();
    if (s.rank() != 1 || !s[0].is_static() || s[0].size() != affine)
      c.fail(util::cat("takes a ", i == 1 ? "scale" : "bias", " of [", affine, "] (one per ",
                       per_channel ? "channel" : "group", " at opset ", c.opset, "), got ", s.to_string()));
  }
  const bool half = !is_float_type(dt);
  SymTensor xf = half ? ops::cast(x, DType::F32, c.node_name("f32_in")) : x;
  // [N, G, C/G, rest]: rest is 1 for a 2-D input.
  std::vector<DimRef> grouped{DimRef::of(0, 0), DimRef::constant(groups), DimRef::constant(per_group)};
  std::optional<DimRef> rest = dim_product(c, x, 2, x.rank());
  grouped.push_back(rest ? *rest : DimRef::constant(-1));
  SymTensor g = view(xf, grouped, {}, c.node_name("grouped"));
  const std::vector<std::int64_t> axes{2, 3};
  SymTensor n = normalized(c, g, axes, eps);
  // The scale and bias as [G, C/G, 1] (per channel) or [G, 1, 1] (per group).
  auto affine_view = [&](std::size_t i, const char* what) {
    SymTensor t = c.tensor(i);
    if (t.dtype() != xf.dtype()) t = ops::cast(t, xf.dtype(), c.node_name(util::cat(what, "_f32")));
    std::vector<DimRef> r{DimRef::constant(groups), DimRef::constant(per_channel ? per_group : 1), DimRef::constant(1)};
    return view(t, r, {}, c.node_name(what));
  };
  SymTensor y = add(mul(n, affine_view(1, "scale"), c.node_name("scaled")), affine_view(2, "bias"),
                    c.node_name("shifted"));
  y = view(y, dims_of_x(x, 1), {x}, c.node_name(half ? "f32" : ""));
  if (half) y = ops::cast(y, dt, c.node_name());
  return {tensor_value(y)};
}

}  // namespace

const std::map<std::string, Converter>& standard_converters() {
  static const std::map<std::string, Converter> table = [] {
    using P = PointwiseFn;
    std::map<std::string, Converter> t;
    t["Add"] = binary(P::Add, "Add");
    t["Sub"] = binary(P::Sub, "Sub");
    t["Mul"] = binary(P::Mul, "Mul");
    t["Div"] = binary(P::Div, "Div");
    t["Pow"] = binary(P::Pow, "Pow");
    t["Mod"] = [](NodeContext& c) -> Values {
      SymTensor a = c.tensor(0), b = c.tensor(1);
      return {tensor_value(pw(c, c.attrs.get_int("fmod", 0) ? P::FMod : P::Mod, {a, b}))};
    };
    t["PRelu"] = [](NodeContext& c) -> Values {
      SymTensor x = c.tensor(0), slope = c.tensor(1);
      // A per-channel slope [C] (older exports) applies along dim 1.
      if (slope.rank() == 1 && x.rank() > 2 && slope.shape()[0].is_static() && x.shape()[1] == slope.shape()[0] &&
          !(x.shape()[x.rank() - 1] == slope.shape()[0])) {
        std::vector<DimRef> r{DimRef::of(0, 0)};
        for (std::size_t i = 2; i < x.rank(); ++i) r.push_back(DimRef::constant(1));
        slope = view(slope, r, {}, c.node_name("slope"));
      }
      return {tensor_value(pw(c, P::PRelu, {x, slope}))};
    };
    t["And"] = binary(P::And, "And");
    t["Or"] = binary(P::Or, "Or");
    t["Xor"] = binary(P::Xor, "Xor");
    t["BitwiseAnd"] = binary(P::BitwiseAnd, "BitwiseAnd");
    t["BitwiseOr"] = binary(P::BitwiseOr, "BitwiseOr");
    t["BitwiseXor"] = binary(P::BitwiseXor, "BitwiseXor");
    t["Equal"] = compare(P::Equal);
    t["Less"] = compare(P::Less);
    t["LessOrEqual"] = compare(P::LessOrEqual);
    t["Greater"] = compare(P::Greater);
    t["GreaterOrEqual"] = compare(P::GreaterOrEqual);
    t["Max"] = variadic(P::Max, false);
    t["Min"] = variadic(P::Min, false);
    t["Sum"] = variadic(P::Add, false);
    t["Mean"] = variadic(P::Add, true);
    t["Where"] = where_op;
    const std::pair<const char*, P> unaries[] = {
        {"Neg", P::Neg}, {"Abs", P::Abs}, {"Exp", P::Exp}, {"Log", P::Log}, {"Sqrt", P::Sqrt},
        {"Reciprocal", P::Reciprocal}, {"Erf", P::Erf}, {"Sin", P::Sin}, {"Cos", P::Cos}, {"Tan", P::Tan},
        {"Asin", P::Asin}, {"Acos", P::Acos}, {"Atan", P::Atan}, {"Sinh", P::Sinh}, {"Cosh", P::Cosh},
        {"Asinh", P::Asinh}, {"Acosh", P::Acosh}, {"Atanh", P::Atanh}, {"Floor", P::Floor}, {"Ceil", P::Ceil},
        {"Round", P::Round}, {"Sign", P::Sign}, {"IsNaN", P::IsNaN}, {"Not", P::Not}, {"Relu", P::Relu},
        {"Sigmoid", P::Sigmoid}, {"Tanh", P::Tanh}, {"Softplus", P::Softplus}, {"Softsign", P::Softsign},
        {"HardSwish", P::HardSwish}, {"Mish", P::Mish}};
    for (const auto& [name, fn] : unaries) t[name] = unary(fn);
    t["IsInf"] = [](NodeContext& c) -> Values {
      if (c.attrs.get_int("detect_negative", 1) == 0 || c.attrs.get_int("detect_positive", 1) == 0)
        c.fail("detect_negative/detect_positive 0 are not supported");
      SymTensor x = c.tensor(0);
      // Opset 20 adds bf16 (f16 and bf16 are tested in f32: the same infinities).
      return {tensor_value(pw(c, P::IsInf, {x}))};
    };
    t["Elu"] = unary(P::Elu, {{"alpha", 1.0}});
    t["Celu"] = unary(P::Celu, {{"alpha", 1.0}});
    t["Selu"] = unary(P::Selu, {{"alpha", 1.67326319217681884765625}, {"gamma", 1.05070102214813232421875}});
    t["LeakyRelu"] = unary(P::LeakyRelu, {{"alpha", 0.01}});
    t["HardSigmoid"] = unary(P::HardSigmoid, {{"alpha", 0.2}, {"beta", 0.5}});
    t["ThresholdedRelu"] = unary(P::ThresholdedRelu, {{"alpha", 1.0}});
    t["Clip"] = clip_op;
    t["Cast"] = cast_op;
    t["CastLike"] = cast_like_op;
    t["Identity"] = identity_op;
    t["Constant"] = constant_op;
    t["Shape"] = shape_op;
    t["Size"] = size_op;
    t["Unsqueeze"] = unsqueeze_op;
    t["Squeeze"] = squeeze_op;
    t["Flatten"] = flatten_op;
    t["Reshape"] = reshape_op;
    t["Expand"] = expand_op;
    t["ConstantOfShape"] = constant_of_shape_op;
    t["Range"] = range_op;
    t["Transpose"] = transpose_op;
    t["Concat"] = concat_op;
    t["Gather"] = gather_op;
    t["GatherElements"] = gather_elements_op;
    t["Slice"] = slice_op;
    t["Split"] = split_op;
    t["Tile"] = tile_op;
    t["Pad"] = pad_op;
    t["MatMul"] = matmul_op;
    t["Gemm"] = gemm_op;
    t["Einsum"] = einsum_op;
    t["Conv"] = conv_op;
    t["ConvTranspose"] = conv_transpose_op;
    t["MaxPool"] = pool(true);
    t["AveragePool"] = pool(false);
    t["GlobalAveragePool"] = global_pool(ReduceFn::Mean);
    t["GlobalMaxPool"] = global_pool(ReduceFn::Max);
    t["BatchNormalization"] = batch_norm_op;
    t["LayerNormalization"] = layer_norm_op;
    t["InstanceNormalization"] = instance_norm_op;
    t["GroupNormalization"] = group_norm_op;
    t["Gelu"] = gelu_op;
    t["Softmax"] = softmax_like(false);
    t["LogSoftmax"] = softmax_like(true);
    t["ReduceSum"] = reduce(ReduceFn::Sum, 13);
    t["ReduceMean"] = reduce(ReduceFn::Mean, 18);
    t["ReduceMax"] = reduce(ReduceFn::Max, 18);
    t["ReduceMin"] = reduce(ReduceFn::Min, 18);
    t["ReduceProd"] = reduce(ReduceFn::Prod, 18);
    t["ReduceL1"] = reduce(ReduceFn::L1, 18);
    t["ReduceL2"] = reduce(ReduceFn::L2, 18);
    t["ReduceSumSquare"] = reduce(ReduceFn::SumSquare, 18);
    t["ReduceLogSum"] = reduce(ReduceFn::LogSum, 18);
    t["ReduceLogSumExp"] = reduce(ReduceFn::LogSumExp, 18);
    t["ArgMax"] = arg_reduce(true);
    t["ArgMin"] = arg_reduce(false);
    t["CumSum"] = cumsum_op;
    t["Resize"] = resize_op;
    t["Upsample"] = resize_op;
    t["Dropout"] = dropout_op;
    t["Trilu"] = trilu_op;
    t["NegativeLogLikelihoodLoss"] = nll_op;
    t["SoftmaxCrossEntropyLoss"] = softmax_cross_entropy_op;
    t["Hardmax"] = hardmax_op;
    return t;
  }();
  return table;
}

}  // namespace kg::onnx::detail
