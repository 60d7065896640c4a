#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "compile/compiler.hpp"
#include "lower/dry_run.hpp"
#include "ops/reduce_ops.hpp"
#include "support/gpu_util.hpp"
#include "support/test_util.hpp"

using kg::ops::ReduceFn;
using kg_test::fresh_seed;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

const ReduceFn kEveryFn[] = {ReduceFn::Sum,    ReduceFn::Mean,     ReduceFn::Max, ReduceFn::Min,
                             ReduceFn::Prod,   ReduceFn::L1,       ReduceFn::L2,  ReduceFn::SumSquare,
                             ReduceFn::LogSum, ReduceFn::LogSumExp};
const ReduceFn kIntFns[] = {ReduceFn::Sum,  ReduceFn::Max, ReduceFn::Min,
                            ReduceFn::Prod, ReduceFn::L1,  ReduceFn::SumSquare};

// Element i of an integer tensor, exactly.
std::int64_t int_at(const kg::Tensor& t, std::int64_t i) {
  if (t.dtype() == kg::DType::I32) return t.data<std::int32_t>()[i];
  return t.data<std::int64_t>()[i];
}

// The input elements that reduce into each output element, in input order: output index from the
// input's multi-index with the reduced dims dropped.
template <class V, class Get>
std::vector<std::vector<V>> buckets(const kg::Tensor& x, const std::vector<bool>& reduced, Get get) {
  const auto& s = x.shape();
  std::int64_t outputs = 1;
  for (std::size_t d = 0; d < s.size(); ++d)
    if (!reduced[d]) outputs *= s[d];
  std::vector<std::vector<V>> b(static_cast<std::size_t>(outputs));
  std::vector<std::int64_t> idx(s.size());
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    std::int64_t rem = i;
    for (std::size_t d = s.size(); d-- > 0;) {
      idx[d] = rem % s[d];
      rem /= s[d];
    }
    std::int64_t o = 0;
    for (std::size_t d = 0; d < s.size(); ++d)
      if (!reduced[d]) o = o * s[d] + idx[d];
    b[static_cast<std::size_t>(o)].push_back(get(i));
  }
  return b;
}

std::vector<bool> mask_of(std::size_t rank, const std::vector<std::int64_t>& axes) {
  std::vector<bool> m(rank, axes.empty());
  for (std::int64_t a : axes)
    m[static_cast<std::size_t>(a < 0 ? a + static_cast<std::int64_t>(rank) : a)] = true;
  return m;
}

std::vector<std::int64_t> out_shape(const std::vector<std::int64_t>& s, const std::vector<bool>& m,
                                    bool keepdims) {
  std::vector<std::int64_t> o;
  for (std::size_t d = 0; d < s.size(); ++d)
    if (!m[d])
      o.push_back(s[d]);
    else if (keepdims)
      o.push_back(1);
  return o;
}

// fn over a list of values, in double (numpy's results for empty lists).
double naive_fn(ReduceFn fn, const std::vector<double>& v) {
  double sum = 0, abs = 0, sq = 0, prod = 1, mx = -kInf, mn = kInf;
  bool nan = false;
  for (double e : v) {
    sum += e;
    abs += std::abs(e);
    sq += e * e;
    prod *= e;
    nan = nan || std::isnan(e);
    mx = std::max(mx, e);
    mn = std::min(mn, e);
  }
  switch (fn) {
    case ReduceFn::Sum:
      return sum;
    case ReduceFn::Mean:
      return v.empty() ? kNan : sum / static_cast<double>(v.size());
    case ReduceFn::Max:
      return nan ? kNan : mx;
    case ReduceFn::Min:
      return nan ? kNan : mn;
    case ReduceFn::Prod:
      return prod;
    case ReduceFn::L1:
      return abs;
    case ReduceFn::L2:
      return std::sqrt(sq);
    case ReduceFn::SumSquare:
      return sq;
    case ReduceFn::LogSum:
      return std::log(sum);
    case ReduceFn::LogSumExp: {
      if (nan) return kNan;
      if (v.empty() || mx == -kInf) return -kInf;
      if (mx == kInf) return kInf;
      double s = 0;
      for (double e : v) s += std::exp(e - mx);
      return mx + std::log(s);
    }
  }
  return kNan;
}

// fn over integers of `dt`, wrapping like two's complement in the dtype's width.
std::int64_t naive_int_fn(ReduceFn fn, const std::vector<std::int64_t>& v, kg::DType dt) {
  const bool i32 = dt == kg::DType::I32;
  std::uint64_t sum = 0, abs = 0, sq = 0, prod = 1;
  std::int64_t mx = i32 ? std::numeric_limits<std::int32_t>::min() : std::numeric_limits<std::int64_t>::min();
  std::int64_t mn = i32 ? std::numeric_limits<std::int32_t>::max() : std::numeric_limits<std::int64_t>::max();
  for (std::int64_t e : v) {
    const auto u = static_cast<std::uint64_t>(e);
    sum += u;
    abs += e < 0 ? ~u + 1 : u;
    sq += u * u;
    prod *= u;
    mx = std::max(mx, e);
    mn = std::min(mn, e);
  }
  std::uint64_t r = 0;
  switch (fn) {
    case ReduceFn::Sum:
      r = sum;
      break;
    case ReduceFn::Prod:
      r = prod;
      break;
    case ReduceFn::L1:
      r = abs;
      break;
    case ReduceFn::SumSquare:
      r = sq;
      break;
    case ReduceFn::Max:
      return mx;
    case ReduceFn::Min:
      return mn;
    default:
      ADD_FAILURE() << "not an integer function";
  }
  return i32 ? static_cast<std::int32_t>(static_cast<std::uint32_t>(r)) : static_cast<std::int64_t>(r);
}

// The reduction of x over `axes` in double (floats) or exactly in the input's dtype (integers).
kg::Tensor naive_reduce(ReduceFn fn, const kg::Tensor& x, const std::vector<std::int64_t>& axes,
                        bool keepdims) {
  const auto m = mask_of(x.rank(), axes);
  const auto shape = out_shape(x.shape(), m, keepdims);
  if (kg::is_floating(x.dtype())) {
    const auto b = buckets<double>(x, m, [&](std::int64_t i) { return x.item(i); });
    kg::Tensor y = kg::Tensor::empty(kg::DType::F64, shape);
    for (std::size_t o = 0; o < b.size(); ++o) y.data<double>()[o] = naive_fn(fn, b[o]);
    return y;
  }
  const auto b = buckets<std::int64_t>(x, m, [&](std::int64_t i) { return int_at(x, i); });
  kg::Tensor y = kg::Tensor::empty(x.dtype(), shape);
  for (std::size_t o = 0; o < b.size(); ++o) {
    const std::int64_t v = naive_int_fn(fn, b[o], x.dtype());
    if (x.dtype() == kg::DType::I32)
      y.data<std::int32_t>()[o] = static_cast<std::int32_t>(v);
    else
      y.data<std::int64_t>()[o] = v;
  }
  return y;
}

// The index of the max (min) along `axis`: NaN wins, ties the first (last) index.
kg::Tensor naive_arg(bool is_max, const kg::Tensor& x, std::int64_t axis, bool keepdims, bool last) {
  const auto d = static_cast<std::size_t>(axis < 0 ? axis + static_cast<std::int64_t>(x.rank()) : axis);
  std::vector<bool> m(x.rank(), false);
  m[d] = true;
  const bool fl = kg::is_floating(x.dtype());
  // Values as long double keep every i64 exact.
  const auto b = buckets<long double>(x, m, [&](std::int64_t i) {
    return fl ? static_cast<long double>(x.item(i)) : static_cast<long double>(int_at(x, i));
  });
  kg::Tensor y = kg::Tensor::empty(kg::DType::I64, out_shape(x.shape(), m, keepdims));
  for (std::size_t o = 0; o < b.size(); ++o) {
    std::int64_t best = -1;
    for (std::size_t i = 0; i < b[o].size(); ++i) {
      const long double v = b[o][i];
      if (best < 0) {
        best = static_cast<std::int64_t>(i);
        continue;
      }
      const long double bv = b[o][static_cast<std::size_t>(best)];
      bool take;
      if (std::isnan(v) || std::isnan(bv))
        take = std::isnan(v) && (!std::isnan(bv) || last);
      else if (v == bv)
        take = last;
      else
        take = is_max ? v > bv : v < bv;
      if (take) best = static_cast<std::int64_t>(i);
    }
    y.data<std::int64_t>()[o] = best;
  }
  return y;
}

// Cumulative sums along `axis` in double (floats) or wrapping in the dtype (integers).
kg::Tensor naive_cumsum(const kg::Tensor& x, std::int64_t axis, bool exclusive, bool reverse) {
  const auto& s = x.shape();
  const auto d = static_cast<std::size_t>(axis < 0 ? axis + static_cast<std::int64_t>(s.size()) : axis);
  std::int64_t outer = 1, n = s[d], inner = 1;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i < d) outer *= s[i];
    if (i > d) inner *= s[i];
  }
  const bool fl = kg::is_floating(x.dtype());
  kg::Tensor y = kg::Tensor::empty(fl ? kg::DType::F64 : x.dtype(), s);
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t j = 0; j < inner; ++j)
      for (std::int64_t i = 0; i < n; ++i) {
        double fs = 0;
        std::uint64_t is = 0;
        for (std::int64_t k = 0; k < n; ++k) {
          const bool in = reverse ? (exclusive ? k > i : k >= i) : (exclusive ? k < i : k <= i);
          if (!in) continue;
          const std::int64_t at = (o * n + k) * inner + j;
          if (fl)
            fs += x.item(at);
          else
            is += static_cast<std::uint64_t>(int_at(x, at));
        }
        const std::int64_t at = (o * n + i) * inner + j;
        if (fl)
          y.data<double>()[at] = fs;
        else if (x.dtype() == kg::DType::I32)
          y.data<std::int32_t>()[at] = static_cast<std::int32_t>(static_cast<std::uint32_t>(is));
        else
          y.data<std::int64_t>()[at] = static_cast<std::int64_t>(is);
      }
  return y;
}

// Integers exactly equal, element by element (shapes and dtypes too).
::testing::AssertionResult same_ints(const kg::Tensor& got, const kg::Tensor& want) {
  if (got.shape() != want.shape() || got.dtype() != want.dtype())
    return ::testing::AssertionFailure()
           << "got " << kg::sizes_to_string(got.shape()) << " " << kg::dtype_name(got.dtype()) << ", want "
           << kg::sizes_to_string(want.shape()) << " " << kg::dtype_name(want.dtype());
  for (std::int64_t i = 0; i < got.numel(); ++i)
    if (int_at(got, i) != int_at(want, i))
      return ::testing::AssertionFailure()
             << "element " << i << ": got " << int_at(got, i) << ", want " << int_at(want, i);
  return ::testing::AssertionSuccess();
}

// Random integers of i32 or i64 in [lo, hi].
kg::Tensor random_ints(std::mt19937_64& rng, kg::DType dt, const std::vector<std::int64_t>& shape,
                       std::int64_t lo, std::int64_t hi) {
  std::uniform_int_distribution<std::int64_t> u(lo, hi);
  kg::Tensor t = kg::Tensor::empty(dt, shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    if (dt == kg::DType::I32)
      t.data<std::int32_t>()[i] = static_cast<std::int32_t>(u(rng));
    else
      t.data<std::int64_t>()[i] = u(rng);
  }
  return t;
}

kg::Tensor run_reduce(ReduceFn fn, const kg::Tensor& x, const std::vector<std::int64_t>& axes, bool keepdims,
                      bool check_written = true) {
  return kg_test::run_graph(
      [&](const std::vector<kg::SymTensor>& xs) {
        return std::vector<kg::SymTensor>{kg::ops::reduce(fn, xs[0], axes, keepdims, "r")};
      },
      {x}, {}, true, check_written)[0];
}

std::string shape_after(const kg::Shape& in, const std::function<kg::SymTensor(const kg::SymTensor&)>& op,
                        kg::DType dt = kg::DType::F32) {
  auto [x, g] = kg::SymTensor::input(dt, in);
  return op(x).shape().to_string();
}

// Tolerances against a double reference: f32 results are double sums rounded once.
double tol_of(kg::DType dt) { return dt == kg::DType::F32 ? 1e-6 : 1e-12; }

// Inputs each function is defined on: positive for LogSum, moderate for Prod.
kg::Tensor input_for(ReduceFn fn, std::mt19937_64& rng, kg::DType dt,
                     const std::vector<std::int64_t>& shape) {
  if (fn == ReduceFn::LogSum) return kg_test::random_tensor(rng, dt, shape, 0.1, 2.0);
  if (fn == ReduceFn::Prod) return kg_test::random_tensor(rng, dt, shape, -1.5, 1.5);
  if (fn == ReduceFn::LogSumExp) return kg_test::random_tensor(rng, dt, shape, -30, 30);
  return kg_test::random_tensor(rng, dt, shape);
}

// kg_test::check_lowering for outputs that are NaN by design (Mean over an empty axis, NaN
// inputs): its GPU comparison takes every NaN for an element never written, so here the GPU runs
// in checked mode, which tells unwritten elements by their poison bytes, and NaN matches NaN.
void check_lowering_nan(const kg_test::BuildFn& build, const std::vector<kg::Tensor>& inputs, double rtol,
                        double atol) {
  auto graph = kg::Graph::create();
  std::vector<kg::SymTensor> xs;
  std::vector<std::vector<std::int64_t>> shapes;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    kg::Shape s = kg::Shape::of(inputs[i].shape());
    if (s.rank() > 0) s[0] = kg::Dim::named("batch");
    xs.push_back(graph->input(inputs[i].dtype(), s, "x" + std::to_string(i)));
    shapes.push_back(inputs[i].shape());
  }
  kg::Model model(graph, build(xs));
  kg::lower::dry_run(model, shapes, kg::compile::Compiler::available() ? 90 : 0);
  kg::LoadedModel cpu = model.load(kg::Device::cpu(), shapes);
  const std::vector<kg::Tensor> want = cpu.forward(inputs);
  kg_test::check_emulated(model, inputs, cpu.state_dict(), want, rtol, atol);
  if (!kg::Device::cuda_available()) return;
  kg::LoadOptions checked;
  checked.checked = true;
  const std::vector<kg::Tensor> got = model.load(kg::Device::cuda(), shapes, checked).forward(inputs);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(kg_test::all_close(got[i], want[i], rtol, atol))
        << "GPU output " << i << " differs from the CPU";
}

kg::SymTensor reduce_of(ReduceFn fn, const kg::SymTensor& x, std::vector<std::int64_t> axes, bool keepdims) {
  return kg::ops::reduce(fn, x, axes, keepdims);
}

}  // namespace

// ---- shapes, names, attributes ----

TEST(ReduceOps, ShapeInference) {
  const kg::Dim B = kg::Dim::named("batch");
  auto red = [](std::vector<std::int64_t> axes, bool keep) {
    return [=](const kg::SymTensor& t) { return kg::ops::reduce(ReduceFn::Sum, t, axes, keep); };
  };
  EXPECT_EQ(shape_after({B, 3, 4, 5}, red({}, false)), "[]");
  EXPECT_EQ(shape_after({B, 3, 4, 5}, red({}, true)), "[1, 1, 1, 1]");
  EXPECT_EQ(shape_after({B, 3, 4, 5}, red({3}, false)), "[batch, 3, 4]");
  EXPECT_EQ(shape_after({B, 3, 4, 5}, red({-1}, true)), "[batch, 3, 4, 1]");
  EXPECT_EQ(shape_after({B, 3, 4, 5}, red({0}, false)), "[3, 4, 5]");
  EXPECT_EQ(shape_after({B, 3, 4, 5}, red({0}, true)), "[1, 3, 4, 5]");
  EXPECT_EQ(shape_after({B, 3, 4, 5}, red({1, 3}, false)), "[batch, 4]");
  EXPECT_EQ(shape_after({B, 3, 4, 5}, red({-3, -1}, true)), "[batch, 1, 4, 1]");
  EXPECT_EQ(shape_after({B, kg::dynamic, 4}, red({2}, false)), "[batch, ?]");
  EXPECT_EQ(shape_after({B, kg::dynamic, 4}, red({1}, true)), "[batch, 1, 4]");
  EXPECT_EQ(shape_after(kg::Shape{}, red({}, false)), "[]");
  EXPECT_EQ(shape_after(kg::Shape{}, red({}, true)), "[]");
  EXPECT_EQ(shape_after({B, 0, 4}, red({1}, false)), "[batch, 4]");

  auto arg = [](std::int64_t axis, bool keep) {
    return [=](const kg::SymTensor& t) { return kg::ops::arg_reduce(true, t, axis, keep, false); };
  };
  EXPECT_EQ(shape_after({B, 3, 4}, arg(1, false)), "[batch, 4]");
  EXPECT_EQ(shape_after({B, 3, 4}, arg(-1, true)), "[batch, 3, 1]");
  EXPECT_EQ(shape_after({B, 3, 4}, arg(0, false)), "[3, 4]");
  EXPECT_EQ(shape_after({B, kg::dynamic}, arg(1, true)), "[batch, 1]");
  EXPECT_EQ(shape_after({B, 3, kg::dynamic},
                        [](const kg::SymTensor& t) { return kg::ops::cumsum(t, 1, true, true); }),
            "[batch, 3, ?]");

  auto [x, g] = kg::SymTensor::input(kg::DType::F64, {B, 3, 4});
  const char* names[] = {"reduce.sum",     "reduce.mean",       "reduce.max", "reduce.min",
                         "reduce.prod",    "reduce.l1",         "reduce.l2",  "reduce.sum_square",
                         "reduce.log_sum", "reduce.log_sum_exp"};
  for (std::size_t i = 0; i < std::size(kEveryFn); ++i) {
    auto y = kg::ops::reduce(kEveryFn[i], x, {1}, false);
    EXPECT_EQ(g->node(y.node()).op_name(), names[i]);
    EXPECT_EQ(kg::ops::reduce_op_name(kEveryFn[i]), names[i]);
    EXPECT_EQ(y.dtype(), kg::DType::F64);
  }
  EXPECT_EQ(kg::ops::reduce_op(ReduceFn::Mean, {0, -1}, true)->attributes(), "axes=[0, -1] keepdims=true");
  EXPECT_EQ(kg::ops::reduce_op(ReduceFn::Max, {}, false)->attributes(), "axes=all keepdims=false");
  auto am = kg::ops::arg_reduce(true, x, -1, true, true, "am");
  auto an = kg::ops::arg_reduce(false, x, 1, false, false, "an");
  EXPECT_EQ(g->node(am.node()).op_name(), "reduce.argmax");
  EXPECT_EQ(g->node(an.node()).op_name(), "reduce.argmin");
  EXPECT_EQ(am.dtype(), kg::DType::I64);
  EXPECT_EQ(kg::ops::arg_reduce_op(true, -1, true, true)->attributes(),
            "axis=-1 keepdims=true select_last_index=true");
  auto cs = kg::ops::cumsum(x, 1, true, false, "cs");
  EXPECT_EQ(g->node(cs.node()).op_name(), "reduce.cumsum");
  EXPECT_EQ(cs.dtype(), kg::DType::F64);
  EXPECT_EQ(kg::ops::cumsum_op(1, true, false)->attributes(), "axis=1 exclusive=true reverse=false");
  auto [i, g2] = kg::SymTensor::input(kg::DType::I32, {B, 3});
  EXPECT_EQ(kg::ops::reduce(ReduceFn::Prod, i, {1}, false).dtype(), kg::DType::I32);
  EXPECT_EQ(kg::ops::cumsum(i, 0, false, false).dtype(), kg::DType::I32);
  EXPECT_EQ(kg::ops::arg_reduce(false, i, 0, false, false).dtype(), kg::DType::I64);
}

TEST(ReduceOps, RejectsBadInputs) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 4, 5});
  kg_test::expect_error([&] { kg::ops::reduce(ReduceFn::Sum, x, {3}, false, "r"); },
                        {"[reduce.sum @ r]", "axis 3 is out of range", "[?, 4, 5]", "rank 3", "axes [3]"});
  kg_test::expect_error(
      [&] {
        kg::ops::reduce(ReduceFn::Mean, x, {0, -4}, true, "r");
      },
      {"[reduce.mean @ r]", "axis -4 is out of range", "rank 3"});
  kg_test::expect_error(
      [&] {
        kg::ops::reduce(ReduceFn::Max, x, {1, -2}, false, "r");
      },
      {"[reduce.max @ r]", "axes [1, -2]", "dim 1 twice", "as 1 and -2"});
  kg_test::expect_error(
      [&] {
        kg::ops::reduce(ReduceFn::Min, x, {2, 2}, false, "r");
      },
      {"[reduce.min @ r]", "axes [2, 2]", "dim 2 twice"});
  auto [s, g1] = kg::SymTensor::input(kg::DType::F32, kg::Shape{});
  kg_test::expect_error([&] { kg::ops::reduce(ReduceFn::Sum, s, {0}, false, "r"); },
                        {"[reduce.sum @ r]", "axis 0 is out of range", "rank 0"});
  kg_test::expect_error([&] { kg::ops::arg_reduce(true, s, 0, false, false, "a"); },
                        {"[reduce.argmax @ a]", "axis 0 is out of range", "rank 0"});
  kg_test::expect_error([&] { kg::ops::arg_reduce(true, x, 3, false, false, "a"); },
                        {"[reduce.argmax @ a]", "axis 3 is out of range", "[?, 4, 5]", "rank 3"});
  kg_test::expect_error([&] { kg::ops::arg_reduce(false, x, -4, false, false, "a"); },
                        {"[reduce.argmin @ a]", "axis -4 is out of range"});
  kg_test::expect_error([&] { kg::ops::cumsum(x, 3, false, false, "c"); },
                        {"[reduce.cumsum @ c]", "axis 3 is out of range", "rank 3"});
  kg_test::expect_error([&] { kg::ops::cumsum(s, 0, false, false, "c"); },
                        {"[reduce.cumsum @ c]", "axis 0 is out of range", "rank 0"});

  // An empty axis has no arg-max: at record time when known, at load when the batch is 0.
  auto [e, g2] = kg::SymTensor::input(kg::DType::F32, {3, 0, 2});
  kg_test::expect_error([&] { kg::ops::arg_reduce(true, e, 1, false, false, "a"); },
                        {"[reduce.argmax @ a]", "axis 1 (dim 1) of input [3, 0, 2] is empty", "largest"});
  kg_test::expect_error([&] { kg::ops::arg_reduce(false, e, -2, true, false, "a"); },
                        {"[reduce.argmin @ a]", "axis -2 (dim 1)", "is empty", "smallest"});
  auto [d, g3] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3}, "x");
  auto am = kg::ops::arg_reduce(true, d, 0, false, false, "a");
  kg::Model model(g3, {am});
  kg_test::expect_error(
      [&] {
        model.load(kg::Device::cpu(), {{0, 3}});
      },
      {"reduce.argmax", "a]", "axis 0 (dim 0) of input [0, 3] is empty"});

  // Dtypes: f32, f64 everywhere; i32, i64 only where the integer result is exact.
  auto [i, g4] = kg::SymTensor::input(kg::DType::I32, {kg::dynamic, 4});
  for (ReduceFn fn : {ReduceFn::Mean, ReduceFn::L2, ReduceFn::LogSum, ReduceFn::LogSumExp}) {
    const std::string label = "[" + kg::ops::reduce_op_name(fn) + " @ r]";
    kg_test::expect_error([&] { kg::ops::reduce(fn, i, {1}, false, "r"); },
                          {label, "supports f32 and f64 inputs, got i32"});
  }
  auto [h, g5] = kg::SymTensor::input(kg::DType::I16, {kg::dynamic, 4});
  kg_test::expect_error([&] { kg::ops::reduce(ReduceFn::Sum, h, {1}, false, "r"); },
                        {"[reduce.sum @ r]", "supports f32, f64, i32 and i64 inputs, got i16"});
  auto [f, g6] = kg::SymTensor::input(kg::DType::F16, {kg::dynamic, 4});
  kg_test::expect_error([&] { kg::ops::reduce(ReduceFn::L2, f, {1}, false, "r"); },
                        {"[reduce.l2 @ r]", "supports f32 and f64 inputs, got f16"});
  auto [b, g7] = kg::SymTensor::input(kg::DType::Bool, {kg::dynamic, 4});
  kg_test::expect_error([&] { kg::ops::arg_reduce(true, b, 1, false, false, "a"); },
                        {"[reduce.argmax @ a]", "supports f32, f64, i32 and i64 inputs, got bool"});
  kg_test::expect_error([&] { kg::ops::cumsum(b, 1, false, false, "c"); },
                        {"[reduce.cumsum @ c]", "supports f32, f64, i32 and i64 inputs, got bool"});
  kg_test::expect_error([] { kg::ops::reduce_op(static_cast<ReduceFn>(42), {}, false); },
                        {"unknown ReduceFn 42"});
}

// ---- reduce.<fn> on the CPU ----

TEST(ReduceOps, EveryFunctionMatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // All axes, one inner, one outer (the dynamic batch), two non-adjacent, negative ones, and a
  // middle pair.
  const std::vector<std::vector<std::int64_t>> axes_sets = {{}, {3}, {0}, {1, 3}, {-1, -3}, {-3, -2}, {0, 2}};
  for (std::int64_t batch : {1, 6}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      for (ReduceFn fn : kEveryFn) {
        const kg::Tensor x = input_for(fn, rng, dt, {batch, 5, 3, 7});
        for (const auto& axes : axes_sets)
          for (bool keep : {false, true}) {
            SCOPED_TRACE(::testing::Message()
                         << kg::ops::reduce_op_name(fn) << " batch " << batch << " " << kg::dtype_name(dt)
                         << " axes " << kg::sizes_to_string(axes) << (keep ? " keepdims" : ""));
            const kg::Tensor y = run_reduce(fn, x, axes, keep);
            EXPECT_EQ(y.dtype(), dt);
            EXPECT_TRUE(kg_test::all_close(y, naive_reduce(fn, x, axes, keep), tol_of(dt), tol_of(dt)));
          }
      }
    }
  }
}

TEST(ReduceOps, IntegersAreExactAndWrap) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : {kg::DType::I32, kg::DType::I64}) {
    const std::int64_t hi = dt == kg::DType::I32 ? std::numeric_limits<std::int32_t>::max()
                                                 : std::numeric_limits<std::int64_t>::max();
    // Full-range values overflow every sum and product; small ones keep them exact without wrap.
    for (std::int64_t range : {hi, std::int64_t{5}}) {
      const kg::Tensor x = random_ints(rng, dt, {4, 6, 5}, -range - (range == hi ? 1 : 0), range);
      for (ReduceFn fn : kIntFns)
        for (const auto& axes : std::vector<std::vector<std::int64_t>>{{}, {2}, {0}, {0, 2}, {-2}})
          for (bool keep : {false, true}) {
            SCOPED_TRACE(::testing::Message() << kg::ops::reduce_op_name(fn) << " " << kg::dtype_name(dt)
                                              << " range " << range << " axes " << kg::sizes_to_string(axes));
            EXPECT_TRUE(same_ints(run_reduce(fn, x, axes, keep), naive_reduce(fn, x, axes, keep)));
          }
    }
  }
  // The extremes: |min| wraps to min, and min * -1 too.
  const kg::Tensor m =
      kg::Tensor::from_vector<std::int32_t>({1, 2}, {std::numeric_limits<std::int32_t>::min(), -1});
  EXPECT_EQ(int_at(run_reduce(ReduceFn::L1, m, {0}, false), 0), std::numeric_limits<std::int32_t>::min());
  EXPECT_EQ(int_at(run_reduce(ReduceFn::Prod, m, {1}, false), 0), std::numeric_limits<std::int32_t>::min());
  EXPECT_EQ(int_at(run_reduce(ReduceFn::Sum, m, {1}, false), 0), std::numeric_limits<std::int32_t>::max());
}

TEST(ReduceOps, ScalarInput) {
  const kg::Tensor x = kg::Tensor::from_vector<double>({}, {-2.5});
  for (ReduceFn fn : kEveryFn) {
    SCOPED_TRACE(kg::ops::reduce_op_name(fn));
    const kg::Tensor y = run_reduce(fn, x, {}, false, false);
    ASSERT_EQ(y.rank(), 0u);
    const double want = naive_fn(fn, {-2.5});
    if (std::isnan(want))
      EXPECT_TRUE(std::isnan(y.item(0)));
    else
      EXPECT_DOUBLE_EQ(y.item(0), want);
  }
}

TEST(ReduceOps, EmptyAxisGivesTheIdentity) {
  // [batch, 0, 3] reduced over dim 1, and every dim; numpy's values.
  const kg::Tensor x = kg::Tensor::zeros(kg::DType::F32, {2, 0, 3});
  const std::vector<std::pair<ReduceFn, double>> want = {
      {ReduceFn::Sum, 0},          {ReduceFn::Mean, kNan},   {ReduceFn::Max, -kInf},
      {ReduceFn::Min, kInf},       {ReduceFn::Prod, 1},      {ReduceFn::L1, 0},
      {ReduceFn::L2, 0},           {ReduceFn::SumSquare, 0}, {ReduceFn::LogSum, -kInf},
      {ReduceFn::LogSumExp, -kInf}};
  for (const auto& [fn, v] : want)
    for (const auto& axes : std::vector<std::vector<std::int64_t>>{{1}, {}, {-2, 0}}) {
      SCOPED_TRACE(::testing::Message()
                   << kg::ops::reduce_op_name(fn) << " axes " << kg::sizes_to_string(axes));
      const kg::Tensor y = run_reduce(fn, x, axes, false, false);
      const std::int64_t n = axes.size() == 1 ? 6 : axes.empty() ? 1 : 3;
      ASSERT_EQ(y.numel(), n);
      for (std::int64_t i = 0; i < n; ++i) {
        if (std::isnan(v))
          EXPECT_TRUE(std::isnan(y.item(i))) << y.item(i);
        else
          EXPECT_EQ(y.item(i), v);
      }
    }
  // Integers: the lowest and highest values of the dtype.
  const kg::Tensor xi = kg::Tensor::zeros(kg::DType::I32, {2, 0});
  EXPECT_EQ(int_at(run_reduce(ReduceFn::Max, xi, {1}, false), 1), std::numeric_limits<std::int32_t>::min());
  EXPECT_EQ(int_at(run_reduce(ReduceFn::Min, xi, {1}, false), 0), std::numeric_limits<std::int32_t>::max());
  EXPECT_EQ(int_at(run_reduce(ReduceFn::Prod, xi, {1}, false), 0), 1);
  const kg::Tensor xl = kg::Tensor::zeros(kg::DType::I64, {0, 2});
  EXPECT_EQ(int_at(run_reduce(ReduceFn::Max, xl, {0}, true), 0), std::numeric_limits<std::int64_t>::min());
  EXPECT_EQ(int_at(run_reduce(ReduceFn::Sum, xl, {0}, true), 1), 0);
  // Reducing a non-empty axis of an empty tensor gives an empty output.
  EXPECT_EQ(run_reduce(ReduceFn::Sum, x, {2}, true).shape(), (std::vector<std::int64_t>{2, 0, 1}));
}

TEST(ReduceOps, MaxAndMinPropagateNan) {
  kg::Tensor x = kg::Tensor::from_vector<float>({2, 4}, {1, NAN, 3, -2, 5, 6, -7, 8});
  auto y = run_reduce(ReduceFn::Max, x, {1}, false, false);
  EXPECT_TRUE(std::isnan(y.item(0)));
  EXPECT_EQ(y.item(1), 8);
  y = run_reduce(ReduceFn::Min, x, {1}, false, false);
  EXPECT_TRUE(std::isnan(y.item(0)));
  EXPECT_EQ(y.item(1), -7);
  y = run_reduce(ReduceFn::Max, x, {0}, false, false);
  EXPECT_EQ(y.item(0), 5);
  EXPECT_TRUE(std::isnan(y.item(1)));
  for (ReduceFn fn : {ReduceFn::Sum, ReduceFn::LogSumExp, ReduceFn::L2}) {
    y = run_reduce(fn, x, {}, false, false);
    EXPECT_TRUE(std::isnan(y.item(0))) << kg::ops::reduce_op_name(fn);
  }
  // A NaN first and last in a row, and infinities.
  x = kg::Tensor::from_vector<double>({3, 3}, {NAN, 1, 2, 1, 2, NAN, -INFINITY, INFINITY, 0});
  y = run_reduce(ReduceFn::Min, x, {1}, false, false);
  EXPECT_TRUE(std::isnan(y.item(0)) && std::isnan(y.item(1)));
  EXPECT_EQ(y.item(2), -kInf);
  y = run_reduce(ReduceFn::LogSumExp, x, {1}, false, false);
  EXPECT_EQ(y.item(2), kInf);
}

TEST(ReduceOps, MillionElementMeanIsAccurate) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (double lo : {0.0, -1.0}) {
    const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {1000, 1000}, lo, 1.0);
    double s = 0;
    for (std::int64_t i = 0; i < x.numel(); ++i) s += x.data<float>()[i];
    const double mean = s / 1e6;
    const kg::Tensor y = run_reduce(ReduceFn::Mean, x, {}, false);
    EXPECT_NEAR(y.item(0), mean, 1e-6 * std::abs(mean)) << "lo " << lo;
    // The kernel (one block of 256 threads, under emulation) agrees too.
    kg_test::check_lowering(
        [](const std::vector<kg::SymTensor>& xs) {
          return std::vector<kg::SymTensor>{kg::ops::reduce(ReduceFn::Mean, xs[0], {0, 1}, true)};
        },
        {x}, 1e-6, 0);
  }
}

// ---- arg-max/min and cumsum on the CPU ----

TEST(ArgReduce, MatchesNaiveReferenceWithTies) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64, kg::DType::I32, kg::DType::I64}) {
    // Integers in {-1, 0, 1} tie everywhere; the floats are rounded to tenths so that they tie too.
    kg::Tensor x = kg::is_floating(dt) ? kg_test::random_tensor(rng, kg::DType::F64, {5, 6, 7}, -0.3, 0.3)
                                       : random_ints(rng, dt, {5, 6, 7}, -1, 1);
    if (kg::is_floating(dt)) {
      for (std::int64_t i = 0; i < x.numel(); ++i)
        x.data<double>()[i] = std::round(x.data<double>()[i] * 10) / 10;
      x = x.to(dt);
    }
    for (bool is_max : {true, false})
      for (std::int64_t axis : {0, 1, 2, -1, -3})
        for (bool keep : {false, true})
          for (bool last : {false, true}) {
            SCOPED_TRACE(::testing::Message()
                         << (is_max ? "argmax " : "argmin ") << kg::dtype_name(dt) << " axis " << axis
                         << (keep ? " keepdims" : "") << (last ? " last" : ""));
            const kg::Tensor y = kg_test::run_op(
                [&](const kg::SymTensor& t) { return kg::ops::arg_reduce(is_max, t, axis, keep, last); }, x);
            EXPECT_TRUE(same_ints(y, naive_arg(is_max, x, axis, keep, last)));
          }
  }
  // Explicit ties and NaN: numpy takes NaN as the max and the min.
  const kg::Tensor t = kg::Tensor::from_vector<float>({2, 5}, {3, 1, 3, 1, 2, 0, NAN, 4, NAN, -1});
  auto arg = [&](bool is_max, bool last) {
    return kg_test::run_op(
        [&](const kg::SymTensor& s) { return kg::ops::arg_reduce(is_max, s, 1, false, last); }, t);
  };
  EXPECT_TRUE(same_ints(arg(true, false), kg::Tensor::from_vector<std::int64_t>({2}, {0, 1})));
  EXPECT_TRUE(same_ints(arg(true, true), kg::Tensor::from_vector<std::int64_t>({2}, {2, 3})));
  EXPECT_TRUE(same_ints(arg(false, false), kg::Tensor::from_vector<std::int64_t>({2}, {1, 1})));
  EXPECT_TRUE(same_ints(arg(false, true), kg::Tensor::from_vector<std::int64_t>({2}, {3, 3})));
}

TEST(Cumsum, MatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64, kg::DType::I32, kg::DType::I64}) {
    const kg::Tensor x = kg::is_floating(dt) ? kg_test::random_tensor(rng, dt, {4, 9, 5})
                         : dt == kg::DType::I32
                             ? random_ints(rng, dt, {4, 9, 5}, -(1LL << 31), (1LL << 31) - 1)
                             : random_ints(rng, dt, {4, 9, 5}, -1000, 1000);
    for (std::int64_t axis : {1, -2, 0, 2})
      for (bool exclusive : {false, true})
        for (bool reverse : {false, true}) {
          SCOPED_TRACE(::testing::Message()
                       << kg::dtype_name(dt) << " axis " << axis << (exclusive ? " exclusive" : "")
                       << (reverse ? " reverse" : ""));
          const kg::Tensor y = kg_test::run_op(
              [&](const kg::SymTensor& t) { return kg::ops::cumsum(t, axis, exclusive, reverse); }, x);
          const kg::Tensor want = naive_cumsum(x, axis, exclusive, reverse);
          if (kg::is_floating(dt))
            EXPECT_TRUE(kg_test::all_close(y, want, tol_of(dt), tol_of(dt)));
          else
            EXPECT_TRUE(same_ints(y, want));
        }
  }
  // By hand: [1, 2, 3, 4] in the four modes.
  const kg::Tensor v = kg::Tensor::from_vector<std::int64_t>({1, 4}, {1, 2, 3, 4});
  auto cs = [&](bool exclusive, bool reverse) {
    return kg_test::run_op([&](const kg::SymTensor& t) { return kg::ops::cumsum(t, -1, exclusive, reverse); },
                           v);
  };
  EXPECT_TRUE(same_ints(cs(false, false), kg::Tensor::from_vector<std::int64_t>({1, 4}, {1, 3, 6, 10})));
  EXPECT_TRUE(same_ints(cs(true, false), kg::Tensor::from_vector<std::int64_t>({1, 4}, {0, 1, 3, 6})));
  EXPECT_TRUE(same_ints(cs(false, true), kg::Tensor::from_vector<std::int64_t>({1, 4}, {10, 9, 7, 4})));
  EXPECT_TRUE(same_ints(cs(true, true), kg::Tensor::from_vector<std::int64_t>({1, 4}, {9, 7, 4, 0})));
}

// ---- the kernels, under the emulator (and on a GPU when there is one) ----

TEST(ReduceOps, KernelsMatchTheCpuInEveryLayout) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    std::vector<std::int64_t> shape;
    std::vector<std::int64_t> axes;
  };
  // One thread per output (few reduced elements), a warp (32 to 1023), a block (1024 or more),
  // columns (the innermost dim kept and 32 or more long); inner, outer, non-adjacent and all axes.
  const std::vector<Case> cases = {
      {{3, 5, 4, 6}, {1, 3}},     // thread, non-adjacent
      {{3, 5, 4, 6}, {}},         // thread at batch 3 only; warp for 360 elements
      {{3, 40, 7}, {1}},          // warp, strided
      {{3, 7, 50}, {-1}},         // warp, contiguous
      {{3, 30, 70}, {1, 2}},      // block
      {{5, 300, 2}, {0, 1}},      // block, outer axes with the batch
      {{3, 2, 1, 9, 1}, {0, 3}},  // size-1 dims dropped
      {{3, 50, 40}, {1}},         // columns, one partial tile per row
      {{5, 300, 33}, {0, 1}},     // columns over 1500 elements
      {{3, 3, 3000}, {1, 2}},     // a block per share of 4500 (split in two)
      {{600, 40}, {0}},           // columns, split in two shares of 300 rows
  };
  for (const Case& c : cases)
    for (ReduceFn fn : kEveryFn) {
      const kg::DType dt = fn == ReduceFn::Sum || fn == ReduceFn::LogSumExp ? kg::DType::F64 : kg::DType::F32;
      SCOPED_TRACE(::testing::Message() << kg::ops::reduce_op_name(fn) << " " << kg::sizes_to_string(c.shape)
                                        << " axes " << kg::sizes_to_string(c.axes));
      const kg::Tensor x = input_for(fn, rng, dt, c.shape);
      const bool keep = c.axes.size() == 1;
      kg_test::check_lowering(
          [&](const std::vector<kg::SymTensor>& xs) {
            return std::vector<kg::SymTensor>{reduce_of(fn, xs[0], c.axes, keep)};
          },
          {x}, 1e-5, 1e-6);
    }
  // Integers, exactly, with values that wrap: every function in i32, three in i64 (one kernel
  // module per function and dtype: each is compiled once).
  for (kg::DType dt : {kg::DType::I32, kg::DType::I64})
    for (ReduceFn fn : kIntFns)
      for (const Case& c : {cases[0], cases[3], cases[4], cases[9], cases[10]}) {
        if (dt == kg::DType::I64 && fn != ReduceFn::Sum && fn != ReduceFn::Max && fn != ReduceFn::Prod)
          continue;
        SCOPED_TRACE(::testing::Message() << kg::ops::reduce_op_name(fn) << " " << kg::dtype_name(dt) << " "
                                          << kg::sizes_to_string(c.shape));
        const kg::Tensor x = random_ints(rng, dt, c.shape, -3'000'000'000LL, 3'000'000'000LL);
        kg_test::check_lowering(
            [&](const std::vector<kg::SymTensor>& xs) {
              return std::vector<kg::SymTensor>{reduce_of(fn, xs[0], c.axes, false)};
            },
            {x}, 0, 0);
      }
}

TEST(ReduceOps, KernelsHandleEmptyAxesAndNan) {
  const kg::Tensor e = kg::Tensor::zeros(kg::DType::F32, {2, 0, 3});
  for (ReduceFn fn : kEveryFn) {
    SCOPED_TRACE(kg::ops::reduce_op_name(fn));
    check_lowering_nan(
        [&](const std::vector<kg::SymTensor>& xs) {
          return std::vector<kg::SymTensor>{reduce_of(fn, xs[0], {1}, false), reduce_of(fn, xs[0], {}, true)};
        },
        {e}, 0, 0);
  }
  check_lowering_nan(
      [&](const std::vector<kg::SymTensor>& xs) {
        return std::vector<kg::SymTensor>{reduce_of(ReduceFn::Max, xs[0], {1}, false),
                                          reduce_of(ReduceFn::Prod, xs[0], {0}, false)};
      },
      {kg::Tensor::zeros(kg::DType::I64, {3, 0})}, 0, 0);
  // NaN in the thread, warp and block layouts.
  std::mt19937_64 rng(fresh_seed());
  // NaN in the thread, warp and block layouts (along rows), and in columns (along dim 0).
  for (std::int64_t n : {5, 100, 2000, 9000})
    for (std::int64_t axis : {1, 0}) {
      const std::vector<std::int64_t> shape =
          axis == 1 ? std::vector<std::int64_t>{3, n} : std::vector<std::int64_t>{n, 40};
      if (axis == 0 && n == 5) continue;
      kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, shape);
      x.data<float>()[axis == 1 ? n + n / 2 : 40 * (n / 2) + 7] = NAN;  // row 1, or column 7
      x.data<float>()[axis == 1 ? 2 * n - 1 : 40 * n - 1] = INFINITY;   // the last row or column
      SCOPED_TRACE(::testing::Message() << "n " << n << " axis " << axis);
      check_lowering_nan(
          [&](const std::vector<kg::SymTensor>& xs) {
            return std::vector<kg::SymTensor>{reduce_of(ReduceFn::Max, xs[0], {axis}, false),
                                              reduce_of(ReduceFn::Min, xs[0], {axis}, false),
                                              reduce_of(ReduceFn::LogSumExp, xs[0], {axis}, false),
                                              kg::ops::arg_reduce(true, xs[0], axis, false, false),
                                              kg::ops::arg_reduce(false, xs[0], axis, false, true)};
          },
          {x}, 1e-5, 1e-6);
    }
}

TEST(ArgReduce, KernelsMatchTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64, kg::DType::I32, kg::DType::I64})
    for (const auto& [shape, axis] :
         std::vector<std::pair<std::vector<std::int64_t>, std::int64_t>>{{{3, 6, 5}, 1},
                                                                         {{3, 6, 5}, 0},
                                                                         {{3, 70}, -1},
                                                                         {{2, 1500, 3}, 1},
                                                                         {{3, 1, 4}, 1},
                                                                         {{2, 100, 40}, 1},
                                                                         {{2, 9000}, 1},
                                                                         {{600, 40}, 0}}) {
      SCOPED_TRACE(::testing::Message()
                   << kg::dtype_name(dt) << " " << kg::sizes_to_string(shape) << " axis " << axis);
      // Few distinct values, so that ties decide; many for the long axis, so that the winner
      // lies anywhere (in any warp of the block).
      const std::int64_t v = shape[1] > 1000 ? 100000 : 2;
      const kg::Tensor x = kg::is_floating(dt) ? random_ints(rng, kg::DType::I64, shape, -v, v).to(dt)
                                               : random_ints(rng, dt, shape, -v, v);
      // argmax in every dtype, argmin in two (the same body with the other comparison).
      const bool min_too = dt == kg::DType::F32 || dt == kg::DType::I64;
      kg_test::check_lowering(
          [&](const std::vector<kg::SymTensor>& xs) {
            std::vector<kg::SymTensor> ys{kg::ops::arg_reduce(true, xs[0], axis, false, false),
                                          kg::ops::arg_reduce(true, xs[0], axis, true, true)};
            if (min_too) {
              ys.push_back(kg::ops::arg_reduce(false, xs[0], axis, false, false));
              ys.push_back(kg::ops::arg_reduce(false, xs[0], axis, false, true));
            }
            return ys;
          },
          {x}, 0, 0);
    }
}

TEST(Cumsum, KernelsMatchTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // Short lines (a thread each, strided and contiguous), long contiguous lines and few long
  // strided ones (a block each).
  const std::vector<std::pair<std::vector<std::int64_t>, std::int64_t>> cases = {
      {{3, 9, 5}, 1}, {{3, 9, 5}, -1}, {{2, 700}, 1}, {{2, 600, 3}, 1}, {{3, 4}, 0}};
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64, kg::DType::I32, kg::DType::I64})
    for (const auto& [shape, axis] : cases)
      for (int mode = 0; mode < 4; ++mode) {
        const bool exclusive = mode & 1, reverse = mode & 2;
        if (dt != kg::DType::F32 && mode != 3 && shape.size() != 2) continue;  // every mode in f32
        SCOPED_TRACE(::testing::Message()
                     << kg::dtype_name(dt) << " " << kg::sizes_to_string(shape) << " axis " << axis
                     << (exclusive ? " exclusive" : "") << (reverse ? " reverse" : ""));
        const kg::Tensor x = kg::is_floating(dt)
                                 ? kg_test::random_tensor(rng, dt, shape)
                                 : random_ints(rng, dt, shape, -3'000'000'000LL, 3'000'000'000LL);
        kg_test::check_lowering(
            [&](const std::vector<kg::SymTensor>& xs) {
              return std::vector<kg::SymTensor>{kg::ops::cumsum(xs[0], axis, exclusive, reverse)};
            },
            {x}, kg::is_floating(dt) ? 1e-5 : 0, kg::is_floating(dt) ? 1e-6 : 0);
      }
}

TEST(ReduceOps, GpuPicksTheLayout) {
  if (!kg::compile::Compiler::available()) GTEST_SKIP() << "built without NVRTC";
  auto launches_of = [](kg::SymTensor (*op)(const kg::SymTensor&), std::vector<std::int64_t> shape) {
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, kg::Shape::of(shape), "x");
    auto dry = kg::lower::dry_run(kg::Model(g, {op(x)}), {shape}, 90);
    return dry.launches.steps.at(0).launches;
  };
  auto grids = [&](kg::SymTensor (*op)(const kg::SymTensor&), std::vector<std::int64_t> shape) {
    std::vector<unsigned> v;
    for (const auto& l : launches_of(op, shape)) v.push_back(l.launch.grid.x);
    return v;
  };
  using G = std::vector<unsigned>;
  auto sum_last = [](const kg::SymTensor& t) { return kg::ops::reduce(ReduceFn::Sum, t, {-1}, false); };
  EXPECT_EQ(launches_of(sum_last, {1000, 31}).at(0).entry, "kg_reduce_sum_f32");
  EXPECT_EQ(grids(sum_last, {1000, 31}), G{4});       // a thread per output
  EXPECT_EQ(grids(sum_last, {1000, 32}), G{125});     // a warp per output
  EXPECT_EQ(grids(sum_last, {1000, 1024}), G{1000});  // a block per output
  auto sum_first = [](const kg::SymTensor& t) { return kg::ops::reduce(ReduceFn::Sum, t, {0}, false); };
  EXPECT_EQ(grids(sum_first, {31, 1000}), G{4});   // a thread per output
  EXPECT_EQ(grids(sum_first, {32, 1000}), G{32});  // columns: 32 outputs per block
  EXPECT_EQ(grids(sum_first, {5000, 31}), G{31});  // too narrow for columns
  // Few outputs of many elements: shares of their own, then one thread per output combines them.
  auto sum_all = [](const kg::SymTensor& t) { return kg::ops::reduce(ReduceFn::Sum, t, {}, false); };
  EXPECT_EQ(grids(sum_all, {1 << 20}), (G{256, 1}));         // 256 shares of 4096
  EXPECT_EQ(grids(sum_first, {4096, 4096}), (G{1024, 16}));  // 128 tiles of columns, 8 shares each
  EXPECT_EQ(grids(sum_first, {300, 4096}), G{128});          // too few rows to split
  auto am = [](const kg::SymTensor& t) { return kg::ops::arg_reduce(false, t, 0, false, false); };
  EXPECT_EQ(launches_of(am, {40, 3}).at(0).entry, "kg_argmin_f32");
  EXPECT_EQ(grids(am, {1 << 16, 2}), (G{32, 1}));  // 2 outputs, 16 shares each
  auto cs = [](const kg::SymTensor& t) { return kg::ops::cumsum(t, 1, false, false); };
  EXPECT_EQ(grids(cs, {8, 256}), G{1});  // a thread per line
  EXPECT_EQ(grids(cs, {8, 257}), G{8});  // a block per line
  // Kept and reduced dims alternating nine times: more than the kernel takes.
  std::vector<std::int64_t> shape(18, 2);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, kg::Shape::of(shape), "x");
  auto y = kg::ops::reduce(ReduceFn::Sum, x, {1, 3, 5, 7, 9, 11, 13, 15, 17}, false, "r");
  kg_test::expect_error([&] { kg::lower::dry_run(kg::Model(g, {y}), {shape}, 90); },
                        {"reduce.sum", "9 kept and 9 reduced dims after merging", "handles 8 of each"});
  // The CPU takes any number (the op then runs its cpu_forward).
  const kg::Tensor ones = kg::Tensor::zeros(kg::DType::F32, shape);
  auto [x2, g2] = kg::SymTensor::input(kg::DType::F32, kg::Shape::of(shape), "x");
  auto y2 = kg::ops::reduce(ReduceFn::Sum, x2, {1, 3, 5, 7, 9, 11, 13, 15, 17}, false, "r");
  kg::Model m(g2, {y2});
  EXPECT_EQ(m.load(kg::Device::cpu(), {shape}).forward({ones}).at(0).numel(), 512);
}

// ---- check_op: shapes at several batch sizes, the CPU against a naive reference, the kernel ----

TEST(ReduceOps, CheckOp) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const kg::Dim B = kg::Dim::named("batch");
  struct Case {
    ReduceFn fn;
    kg::DType dt;
    std::vector<std::int64_t> axes;
    bool keep;
  };
  for (const Case& c :
       {Case{ReduceFn::Sum, kg::DType::F32, {1}, true}, Case{ReduceFn::Sum, kg::DType::F64, {}, false},
        Case{ReduceFn::Mean, kg::DType::F32, {0}, false}, Case{ReduceFn::Max, kg::DType::I32, {0, 2}, false},
        Case{ReduceFn::LogSumExp, kg::DType::F32, {-1}, false},
        Case{ReduceFn::L2, kg::DType::F32, {0, -1}, true},
        Case{ReduceFn::Prod, kg::DType::I64, {1, 2}, false}}) {
    SCOPED_TRACE(::testing::Message() << kg::ops::reduce_op_name(c.fn) << " " << kg::dtype_name(c.dt));
    kg::testing::CheckOpOptions o;
    o.seed = seed;
    o.batch_sizes = {1, 4};
    if (!kg::is_floating(c.dt)) o.rtol = o.atol = 0;
    o.reference = [&](const std::vector<kg::Tensor>& in, const std::map<std::string, kg::Tensor>&) {
      const kg::Tensor r = naive_reduce(c.fn, in[0], c.axes, c.keep);
      return kg::is_floating(c.dt) ? r.to(c.dt) : r;
    };
    auto r = kg::testing::check_op(kg::ops::reduce_op(c.fn, c.axes, c.keep), {{B, 6, 35}}, {c.dt}, o);
    EXPECT_TRUE(r.ok) << r.to_string();
    EXPECT_EQ(kg_test::count_lines(r, "PASS batch 4, emulator"), 1) << r.to_string();
  }
}

TEST(ArgReduce, CheckOp) {
  const auto seed = fresh_seed();
  const kg::Dim B = kg::Dim::named("batch");
  for (const auto& [is_max, dt, axis, last] :
       std::vector<std::tuple<bool, kg::DType, std::int64_t, bool>>{{true, kg::DType::F32, 1, false},
                                                                    {false, kg::DType::I64, 0, true},
                                                                    {true, kg::DType::F64, -1, true}}) {
    SCOPED_TRACE(::testing::Message()
                 << (is_max ? "argmax " : "argmin ") << kg::dtype_name(dt) << " axis " << axis);
    kg::testing::CheckOpOptions o;
    o.seed = seed;
    o.batch_sizes = {1, 5};
    o.rtol = o.atol = 0;
    o.reference = [&](const std::vector<kg::Tensor>& in, const std::map<std::string, kg::Tensor>&) {
      return naive_arg(is_max, in[0], axis, true, last);
    };
    auto r = kg::testing::check_op(kg::ops::arg_reduce_op(is_max, axis, true, last), {{B, 40, 3}}, {dt}, o);
    EXPECT_TRUE(r.ok) << r.to_string();
    EXPECT_EQ(kg_test::count_lines(r, "PASS batch 5, emulator"), 1) << r.to_string();
  }
}

TEST(Cumsum, CheckOp) {
  const auto seed = fresh_seed();
  const kg::Dim B = kg::Dim::named("batch");
  for (const auto& [dt, axis, exclusive, reverse] :
       std::vector<std::tuple<kg::DType, std::int64_t, bool, bool>>{{kg::DType::F64, 1, true, true},
                                                                    {kg::DType::F32, -1, false, true},
                                                                    {kg::DType::I32, 0, true, false}}) {
    SCOPED_TRACE(::testing::Message() << kg::dtype_name(dt) << " axis " << axis);
    kg::testing::CheckOpOptions o;
    o.seed = seed;
    o.batch_sizes = {1, 6};
    if (!kg::is_floating(dt)) o.rtol = o.atol = 0;
    o.reference = [&](const std::vector<kg::Tensor>& in, const std::map<std::string, kg::Tensor>&) {
      const kg::Tensor r = naive_cumsum(in[0], axis, exclusive, reverse);
      return kg::is_floating(dt) ? r.to(dt) : r;
    };
    auto r = kg::testing::check_op(kg::ops::cumsum_op(axis, exclusive, reverse), {{B, 7, 4}}, {dt}, o);
    EXPECT_TRUE(r.ok) << r.to_string();
    EXPECT_EQ(kg_test::count_lines(r, "PASS batch 6, emulator"), 1) << r.to_string();
  }
}
