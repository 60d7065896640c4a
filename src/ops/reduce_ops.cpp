// The reduction family: reduce.<fn> over a set of axes, reduce.argmax / reduce.argmin along one
// axis and reduce.cumsum along one axis (see reduce_ops.hpp for the rules). The CPU and the GPU
// (reduce_ops.cu) see a reduction the same way: the input's dims split into kept and reduced ones,
// size-1 dims dropped and adjacent dims of one kind merged (ReducePlan), so that any set of axes
// is one loop over the outputs and one over their reduced elements.
#include "ops/reduce_ops.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>

#include "ops/divider.hpp"
#include "ops/gpu_util.hpp"
#include "ops/op_util.hpp"
#include "ops/prologue.hpp"
#include "ops/reduce_ops_shared.cuh"

namespace kg::ops {
namespace {

constexpr unsigned kThreads = KG_REDUCE_THREADS;

// ---- names and dtypes ----

struct FnEntry {
  ReduceFn fn;
  const char* op_name;  // "reduce.sum"
  const char* kernel;   // the GPU entry's stem, "kg_reduce_sum" (+ "_f32", "_f64", "_i32", "_i64")
  const char* code;     // the function's code in reduce_ops.cu, "KG_RSUM"
  bool ints;            // i32 and i64 are accepted too
};

// One row per function, in ReduceFn order.
constexpr FnEntry kFns[] = {
    {ReduceFn::Sum, "reduce.sum", "kg_reduce_sum", "KG_RSUM", true},
    {ReduceFn::Mean, "reduce.mean", "kg_reduce_mean", "KG_RMEAN", false},
    {ReduceFn::Max, "reduce.max", "kg_reduce_max", "KG_RMAX", true},
    {ReduceFn::Min, "reduce.min", "kg_reduce_min", "KG_RMIN", true},
    {ReduceFn::Prod, "reduce.prod", "kg_reduce_prod", "KG_RPROD", true},
    {ReduceFn::L1, "reduce.l1", "kg_reduce_l1", "KG_RL1", true},
    {ReduceFn::L2, "reduce.l2", "kg_reduce_l2", "KG_RL2", false},
    {ReduceFn::SumSquare, "reduce.sum_square", "kg_reduce_sum_square", "KG_RSUM_SQUARE", true},
    {ReduceFn::LogSum, "reduce.log_sum", "kg_reduce_log_sum", "KG_RLOG_SUM", false},
    {ReduceFn::LogSumExp, "reduce.log_sum_exp", "kg_reduce_log_sum_exp", "KG_RLOG_SUM_EXP", false},
};

const FnEntry& fn_entry(ReduceFn fn) {
  const auto i = static_cast<std::size_t>(fn);
  if (i >= std::size(kFns)) throw Error(util::cat("unknown ReduceFn ", i));
  return kFns[i];
}

// The kernel entry for a dtype: "<stem>_f32", "_f64", "_i32" or "_i64".
std::string entry_of(const std::string& stem, DType t) {
  switch (t) {
    case DType::F32:
      return stem + "_f32";
    case DType::F64:
      return stem + "_f64";
    case DType::I32:
      return stem + "_i32";
    case DType::I64:
      return stem + "_i64";
    default:
      throw Error(util::cat(stem, ": no kernel for ", dtype_name(t)));
  }
}

// The kernels' element type for a dtype.
const char* c_type(DType t) {
  switch (t) {
    case DType::F32:
      return "float";
    case DType::F64:
      return "double";
    case DType::I32:
      return "int";
    default:
      return "long long";
  }
}

// The kernel source of one op: reduce_ops.cu without its own entries, followed by the op's one
// entry, which passes its parameters to one of the file's bodies.
std::string entry_source(const std::string& entry, const std::string& params, const std::string& call) {
  return util::cat("#define KG_REDUCE_ONE_ENTRY\n", kernel_file("reduce_ops.cu"),
                   "\nextern \"C\" __global__ void __launch_bounds__(KG_REDUCE_THREADS)\n    ", entry, "(",
                   params, ") {\n  ", call, ";\n}\n");
}

// The one input's dtype, when it is f32 or f64 (or i32 and i64 with `ints`).
DType require_dtype(const std::vector<DType>& in, bool ints) {
  if (in.size() != 1) throw Error(util::cat("expects 1 input, got ", in.size()));
  const DType t = in[0];
  const bool ok = t == DType::F32 || t == DType::F64 || (ints && (t == DType::I32 || t == DType::I64));
  if (!ok)
    throw Error(util::cat("supports ", ints ? "f32, f64, i32 and i64" : "f32 and f64", " inputs, got ",
                          dtype_name(t)));
  return t;
}

// Calls fn(T{}) with T the element type of an f32, f64, i32 or i64 tensor.
template <class F>
void dispatch_dtype(DType t, F&& fn) {
  switch (t) {
    case DType::F32:
      fn(float{});
      return;
    case DType::F64:
      fn(double{});
      return;
    case DType::I32:
      fn(std::int32_t{});
      return;
    case DType::I64:
      fn(std::int64_t{});
      return;
    default:
      throw Error(util::cat("CPU implementation supports f32, f64, i32 and i64, got ", dtype_name(t)));
  }
}

// Calls fn(std::integral_constant<ReduceFn, F>{}) for the runtime value `f`.
template <class Fn>
void visit_fn(ReduceFn f, Fn&& fn) {
  using R = ReduceFn;
  switch (f) {
    case R::Sum:
      return fn(std::integral_constant<R, R::Sum>{});
    case R::Mean:
      return fn(std::integral_constant<R, R::Mean>{});
    case R::Max:
      return fn(std::integral_constant<R, R::Max>{});
    case R::Min:
      return fn(std::integral_constant<R, R::Min>{});
    case R::Prod:
      return fn(std::integral_constant<R, R::Prod>{});
    case R::L1:
      return fn(std::integral_constant<R, R::L1>{});
    case R::L2:
      return fn(std::integral_constant<R, R::L2>{});
    case R::SumSquare:
      return fn(std::integral_constant<R, R::SumSquare>{});
    case R::LogSum:
      return fn(std::integral_constant<R, R::LogSum>{});
    case R::LogSumExp:
      break;
  }
  return fn(std::integral_constant<R, R::LogSumExp>{});
}

std::string bool_text(bool b) { return b ? "true" : "false"; }

// ---- axes ----

// Which dims of an input of rank `rank` (`shape` for messages) `axes` reduce; empty axes reduce
// every dim.
std::vector<bool> reduced_dims(const std::vector<std::int64_t>& axes, std::size_t rank,
                               const std::string& shape) {
  std::vector<bool> mask(rank, axes.empty());
  std::vector<std::int64_t> named_by(rank, 0);
  const auto r = static_cast<std::int64_t>(rank);
  for (const std::int64_t a : axes) {
    const std::int64_t d = a < 0 ? a + r : a;
    if (d < 0 || d >= r)
      throw Error(util::cat("axis ", a, " is out of range for input ", shape, " of rank ", rank, " (axes ",
                            sizes_to_string(axes), ")"));
    const auto u = static_cast<std::size_t>(d);
    if (mask[u])
      throw Error(util::cat("axes ", sizes_to_string(axes), " name dim ", d, " twice (as ", named_by[u],
                            " and ", a, "); each dim may be reduced once"));
    mask[u] = true;
    named_by[u] = a;
  }
  return mask;
}

// The output shape: reduced dims dropped, or kept as 1 with keepdims.
Shape reduced_shape(const Shape& x, const std::vector<bool>& mask, bool keepdims) {
  Shape out;
  for (std::size_t i = 0; i < x.rank(); ++i) {
    if (!mask[i])
      out.push_back(x[i]);
    else if (keepdims)
      out.push_back(Dim(1));
  }
  return out;
}

// The one axis of arg-max/min and cumsum, checked against the input.
std::size_t single_axis(std::int64_t axis, const Shape& x) {
  const auto r = static_cast<std::int64_t>(x.rank());
  const std::int64_t d = axis < 0 ? axis + r : axis;
  if (d < 0 || d >= r)
    throw Error(
        util::cat("axis ", axis, " is out of range for input ", x.to_string(), " of rank ", x.rank()));
  return static_cast<std::size_t>(d);
}

// ---- the plan: kept and reduced dims after merging ----

struct ReducePlan {
  // Outermost first: kept dims (the output's order) and reduced dims, with their input strides.
  std::vector<std::int64_t> kept, kept_stride, red, red_stride;
  std::int64_t outputs = 1, count = 1, numel = 1;
};

ReducePlan reduce_plan(const std::vector<std::int64_t>& shape, const std::vector<bool>& reduced) {
  ReducePlan p;
  const std::size_t r = shape.size();
  std::vector<std::int64_t> stride(r);
  for (std::size_t i = r; i-- > 0;) {
    stride[i] = p.numel;
    p.numel *= shape[i];
  }
  int last = -1;  // the kind of the last dim taken: 0 kept, 1 reduced
  for (std::size_t i = 0; i < r; ++i) {
    (reduced[i] ? p.count : p.outputs) *= shape[i];
    if (shape[i] == 1) continue;
    const int kind = reduced[i] ? 1 : 0;
    auto& sizes = kind ? p.red : p.kept;
    auto& strides = kind ? p.red_stride : p.kept_stride;
    if (last == kind) {  // adjacent but for size-1 dims: one dim
      sizes.back() *= shape[i];
      strides.back() = stride[i];
    } else {
      sizes.push_back(shape[i]);
      strides.push_back(stride[i]);
    }
    last = kind;
  }
  if (p.count == 0) p.red.clear(), p.red_stride.clear();
  if (p.outputs == 0) p.kept.clear(), p.kept_stride.clear();
  return p;
}

// Blocks of the block and columns layouts, before any split.
std::int64_t layout_blocks(const KgReduceArgs& a) {
  return a.mode == KG_REDUCE_BY_BLOCK
             ? a.outputs
             : a.outputs / a.width * ((a.width + KG_REDUCE_COLUMNS - 1) / KG_REDUCE_COLUMNS);
}

// The plan as the kernels take it, and who reduces each output element.
KgReduceArgs gpu_args(const ReducePlan& p, const std::string& op_name,
                      const std::vector<std::int64_t>& shape) {
  constexpr std::size_t max_dims = KG_REDUCE_MAX_DIMS;
  if (p.kept.size() > max_dims || p.red.size() > max_dims)
    throw Error(util::cat(op_name, ": input ", sizes_to_string(shape), " has ", p.kept.size(), " kept and ",
                          p.red.size(), " reduced dims after merging; the GPU kernel handles ", max_dims,
                          " of each"));
  KgReduceArgs a{};
  a.outputs = p.outputs;
  a.count = p.count;
  a.width = p.kept.empty() ? 1 : p.kept.back();
  const bool columns = !p.kept.empty() && p.kept_stride.back() == 1 && a.width >= KG_REDUCE_COLUMNS;
  a.mode = p.count < KG_REDUCE_WARP_MIN    ? KG_REDUCE_BY_THREAD
           : columns                       ? KG_REDUCE_BY_COLUMNS
           : p.count < KG_REDUCE_BLOCK_MIN ? KG_REDUCE_BY_WARP
                                           : KG_REDUCE_BY_BLOCK;
  a.small = p.numel < (std::int64_t{1} << 31) ? 1 : 0;
  // Too few blocks for the GPU: split each output's elements into shares reduced by blocks of
  // their own, so that about KG_REDUCE_SPLIT_BLOCKS blocks run (see reduce_ops_shared.cuh).
  a.stage = KG_REDUCE_STAGE_WHOLE;
  a.splits = 1;
  a.chunk = p.count;
  if ((a.mode == KG_REDUCE_BY_BLOCK || a.mode == KG_REDUCE_BY_COLUMNS) && p.outputs > 0) {
    const std::int64_t blocks = layout_blocks(a);
    const std::int64_t min_share =
        a.mode == KG_REDUCE_BY_BLOCK ? KG_REDUCE_SPLIT_MIN : KG_REDUCE_SPLIT_MIN_ROWS;
    const std::int64_t splits = std::min((KG_REDUCE_SPLIT_BLOCKS + blocks - 1) / blocks, p.count / min_share);
    if (blocks < KG_REDUCE_SPLIT_BLOCKS && splits > 1) {
      a.chunk = (p.count + splits - 1) / splits;
      a.splits = (p.count + a.chunk - 1) / a.chunk;  // no empty share
      a.stage = KG_REDUCE_STAGE_PARTIAL;
    }
  }
  a.kept_rank = std::ssize(p.kept);
  a.red_rank = std::ssize(p.red);
  for (std::size_t d = 0; d < max_dims; ++d) {
    a.kept[d] = kg_divider(d < p.kept.size() ? p.kept[d] : 1);
    a.kept_stride[d] = d < p.kept.size() ? p.kept_stride[d] : 0;
    a.red[d] = kg_divider(d < p.red.size() ? p.red[d] : 1);
    a.red_stride[d] = d < p.red.size() ? p.red_stride[d] : 0;
  }
  return a;
}

Dim3 gpu_grid(const KgReduceArgs& a) {
  if (a.stage == KG_REDUCE_STAGE_COMBINE || a.mode == KG_REDUCE_BY_THREAD)
    return grid_1d(a.outputs, kThreads);
  if (a.mode == KG_REDUCE_BY_WARP) return grid_1d(a.outputs, kThreads / 32);
  return {static_cast<unsigned>(std::clamp<std::int64_t>(layout_blocks(a) * a.splits, 1, 65535LL * 32)), 1,
          1};
}

// ---- the CPU's folds (the same as the kernels') ----

template <class T>
bool is_nan_value(T v) {
  if constexpr (std::is_integral_v<T>)
    return false;
  else
    return std::isnan(v);
}

// reduce.<fn> for F other than LogSumExp: floats in double; integers in unsigned 64 bits, whose low
// bits are the wrapped result in the element's width, or (Max, Min) signed 64 bits.
template <class T, ReduceFn F>
struct HostReduce {
  static constexpr bool is_int = std::is_integral_v<T>;
  static constexpr bool ordered = F == ReduceFn::Max || F == ReduceFn::Min;
  using Acc = std::conditional_t<is_int, std::conditional_t<ordered, std::int64_t, std::uint64_t>, double>;

  static Acc init() {
    if constexpr (F == ReduceFn::Max)
      return is_int ? Acc(std::numeric_limits<T>::lowest()) : -std::numeric_limits<Acc>::infinity();
    else if constexpr (F == ReduceFn::Min)
      return is_int ? Acc(std::numeric_limits<T>::max()) : std::numeric_limits<Acc>::infinity();
    else if constexpr (F == ReduceFn::Prod)
      return Acc(1);
    else
      return Acc(0);
  }
  static Acc value(T x) {
    if constexpr (is_int) {
      if constexpr (ordered) {
        return static_cast<std::int64_t>(x);
      } else {
        const auto u = static_cast<std::uint64_t>(static_cast<std::int64_t>(x));
        if constexpr (F == ReduceFn::L1)
          return x < 0 ? std::uint64_t{0} - u : u;
        else if constexpr (F == ReduceFn::SumSquare)
          return u * u;
        else
          return u;
      }
    } else {
      const auto d = static_cast<double>(x);
      if constexpr (F == ReduceFn::L1)
        return std::fabs(d);
      else if constexpr (F == ReduceFn::L2 || F == ReduceFn::SumSquare)
        return d * d;
      else
        return d;
    }
  }
  static Acc combine(Acc a, Acc b) {
    if constexpr (F == ReduceFn::Max)
      return (b > a || is_nan_value(b)) ? b : a;
    else if constexpr (F == ReduceFn::Min)
      return (b < a || is_nan_value(b)) ? b : a;
    else if constexpr (F == ReduceFn::Prod)
      return a * b;
    else
      return a + b;
  }
  static T finish(Acc a, std::int64_t count) {
    if constexpr (is_int) {
      return static_cast<T>(static_cast<std::int64_t>(a));
    } else if constexpr (F == ReduceFn::Mean) {
      return static_cast<T>(a / static_cast<double>(count));
    } else if constexpr (F == ReduceFn::L2) {
      return static_cast<T>(std::sqrt(a));
    } else if constexpr (F == ReduceFn::LogSum) {
      return static_cast<T>(std::log(a));
    } else {
      return static_cast<T>(a);
    }
  }
};

// Calls fn(offset, n, step) for the runs of reduced elements in order: the innermost reduced dim
// as a run of n elements `step` apart, from each offset of the outer reduced dims (odometer order).
template <class Fn>
void for_each_run(const ReducePlan& p, std::vector<std::int64_t>& idx, Fn&& fn) {
  if (p.count == 0) return;
  if (p.red.empty()) {
    fn(std::int64_t{0}, std::int64_t{1}, std::int64_t{1});
    return;
  }
  const std::size_t outer = p.red.size() - 1;
  const std::int64_t n = p.red.back(), step = p.red_stride.back();
  idx.assign(outer, 0);
  std::int64_t off = 0;
  for (std::int64_t k = 0, runs = p.count / n; k < runs; ++k) {
    fn(off, n, step);
    for (std::size_t d = outer; d-- > 0;) {
      off += p.red_stride[d];
      if (++idx[d] < p.red[d]) break;
      off -= p.red[d] * p.red_stride[d];
      idx[d] = 0;
    }
  }
}

// Outputs reduced together on one thread: side by side in memory when the innermost input dim is
// kept, so each pass over the reduced elements reads contiguous memory.
constexpr std::int64_t kTile = 256;

template <class T, ReduceFn F>
void reduce_cpu(const CpuContext& ctx, const T* x, T* y, const ReducePlan& p) {
  if (p.outputs == 0) return;
  constexpr bool lse = F == ReduceFn::LogSumExp;
  using R = HostReduce<T, lse ? ReduceFn::Max : F>;
  using Acc = typename R::Acc;
  const bool inner_kept = !p.kept.empty() && p.kept_stride.back() == 1;
  const std::int64_t w = inner_kept ? p.kept.back() : 1;
  const std::size_t row_rank = p.kept.size() - (inner_kept ? 1 : 0);
  const std::int64_t tiles = (w + kTile - 1) / kTile, rows = p.outputs / w;
  const std::int64_t work = std::max<std::int64_t>(1, p.count * std::min(w, kTile));
  ctx.parallel_for(
      rows * tiles, std::max<std::int64_t>(1, 65536 / work), [&](std::int64_t t0, std::int64_t t1) {
        std::array<Acc, kTile> acc;
        std::array<double, kTile> shift, sum;
        std::vector<std::int64_t> idx;
        for (std::int64_t t = t0; t < t1; ++t) {
          const std::int64_t row = t / tiles, j0 = (t % tiles) * kTile, n = std::min(kTile, w - j0);
          std::int64_t base = j0, rem = row;
          for (std::size_t d = row_rank; d-- > 0;) {
            base += (rem % p.kept[d]) * p.kept_stride[d];
            rem /= p.kept[d];
          }
          const T* src = x + base;
          for (std::int64_t j = 0; j < n; ++j) acc[static_cast<std::size_t>(j)] = R::init();
          for_each_run(p, idx, [&](std::int64_t off, std::int64_t len, std::int64_t step) {
            for (std::int64_t i = 0; i < len; ++i) {
              const T* s = src + off + i * step;
              for (std::int64_t j = 0; j < n; ++j)
                acc[static_cast<std::size_t>(j)] =
                    R::combine(acc[static_cast<std::size_t>(j)], R::value(s[j]));
            }
          });
          T* dst = y + row * w + j0;
          if constexpr (lse) {
            // acc holds the maxima: the sum of exp(x - max) follows, unless the max is NaN or +inf.
            for (std::int64_t j = 0; j < n; ++j) {
              const double m = acc[static_cast<std::size_t>(j)];
              shift[static_cast<std::size_t>(j)] = std::isinf(m) && m < 0 ? 0.0 : m;
              sum[static_cast<std::size_t>(j)] = 0;
            }
            for_each_run(p, idx, [&](std::int64_t off, std::int64_t len, std::int64_t step) {
              for (std::int64_t i = 0; i < len; ++i) {
                const T* s = src + off + i * step;
                for (std::int64_t j = 0; j < n; ++j)
                  sum[static_cast<std::size_t>(j)] +=
                      std::exp(static_cast<double>(s[j]) - shift[static_cast<std::size_t>(j)]);
              }
            });
            for (std::int64_t j = 0; j < n; ++j) {
              const auto u = static_cast<std::size_t>(j);
              const double m = acc[u];
              dst[j] =
                  static_cast<T>(std::isnan(m) || (std::isinf(m) && m > 0) ? m : shift[u] + std::log(sum[u]));
            }
          } else {
            for (std::int64_t j = 0; j < n; ++j)
              dst[j] = R::finish(acc[static_cast<std::size_t>(j)], p.count);
          }
        }
      });
}

// The input viewed as [outer, n, inner] along dim d.
struct AxisExtents {
  std::int64_t outer = 1, n = 1, inner = 1;
};

AxisExtents axis_extents(const std::vector<std::int64_t>& shape, std::size_t d) {
  AxisExtents e;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i < d)
      e.outer *= shape[i];
    else if (i == d)
      e.n = shape[i];
    else
      e.inner *= shape[i];
  }
  return e;
}

// True when value v at index i wins over the best so far (bv at bi): NaN over any number, then
// the larger (smaller) value, then on a tie the first (last) index. As the kernels' KgArgOp.
template <class T>
bool arg_wins(T v, std::int64_t i, T bv, std::int64_t bi, bool is_max, bool last) {
  const bool vn = is_nan_value(v), bn = is_nan_value(bv);
  if (vn != bn) return vn;
  if (vn || v == bv) return last ? i > bi : i < bi;
  return is_max ? v > bv : v < bv;
}

template <class T>
void arg_reduce_cpu(const CpuContext& ctx, const T* x, std::int64_t* y, const AxisExtents& e, bool is_max,
                    bool last) {
  const std::int64_t tiles = (e.inner + kTile - 1) / kTile;
  const std::int64_t work = std::max<std::int64_t>(1, e.n * std::min(e.inner, kTile));
  ctx.parallel_for(
      e.outer * tiles, std::max<std::int64_t>(1, 65536 / work), [&](std::int64_t t0, std::int64_t t1) {
        std::array<T, kTile> best;
        std::array<std::int64_t, kTile> at;
        for (std::int64_t t = t0; t < t1; ++t) {
          const std::int64_t o = t / tiles, j0 = (t % tiles) * kTile, w = std::min(kTile, e.inner - j0);
          const T* src = x + o * e.n * e.inner + j0;
          for (std::int64_t j = 0; j < w; ++j) {
            best[static_cast<std::size_t>(j)] = src[j];
            at[static_cast<std::size_t>(j)] = 0;
          }
          for (std::int64_t i = 1; i < e.n; ++i)
            for (std::int64_t j = 0; j < w; ++j) {
              const auto u = static_cast<std::size_t>(j);
              const T v = src[i * e.inner + j];
              if (arg_wins(v, i, best[u], at[u], is_max, last)) best[u] = v, at[u] = i;
            }
          std::int64_t* dst = y + o * e.inner + j0;
          for (std::int64_t j = 0; j < w; ++j) dst[j] = at[static_cast<std::size_t>(j)];
        }
      });
}

template <class T>
void cumsum_cpu(const CpuContext& ctx, const T* x, T* y, const AxisExtents& e, bool exclusive, bool reverse) {
  using Acc = std::conditional_t<std::is_integral_v<T>, std::uint64_t, double>;
  auto widen = [](T v) {
    if constexpr (std::is_integral_v<T>)
      return static_cast<std::uint64_t>(static_cast<std::int64_t>(v));
    else
      return static_cast<double>(v);
  };
  auto narrow = [](Acc s) {
    if constexpr (std::is_integral_v<T>)
      return static_cast<T>(static_cast<std::int64_t>(s));
    else
      return static_cast<T>(s);
  };
  const std::int64_t tiles = (e.inner + kTile - 1) / kTile;
  const std::int64_t work = std::max<std::int64_t>(1, e.n * std::min(e.inner, kTile));
  ctx.parallel_for(
      e.outer * tiles, std::max<std::int64_t>(1, 65536 / work), [&](std::int64_t t0, std::int64_t t1) {
        std::array<Acc, kTile> sum;
        for (std::int64_t t = t0; t < t1; ++t) {
          const std::int64_t o = t / tiles, j0 = (t % tiles) * kTile, w = std::min(kTile, e.inner - j0);
          const std::int64_t base = o * e.n * e.inner + j0;
          for (std::int64_t j = 0; j < w; ++j) sum[static_cast<std::size_t>(j)] = Acc(0);
          for (std::int64_t p = 0; p < e.n; ++p) {
            const std::int64_t k = base + (reverse ? e.n - 1 - p : p) * e.inner;
            for (std::int64_t j = 0; j < w; ++j) {
              Acc& s = sum[static_cast<std::size_t>(j)];
              const Acc v = widen(x[k + j]);
              if (exclusive) {
                y[k + j] = narrow(s);
                s += v;
              } else {
                s += v;
                y[k + j] = narrow(s);
              }
            }
          }
        }
      });
}

// ---- the GPU half ----

// reduce.<fn> and arg-max/min: a launch of `entry` over the plan of the input's concrete shape, and
// a second one combining the partials when the reduction is split. `select_last` >= 0 is
// arg-max/min's extra argument.
class ReduceRuntime final : public RuntimeOp {
 public:
  ReduceRuntime(std::vector<std::int64_t> axes, std::string op_name, std::string entry, int select_last)
      : axes_(std::move(axes)),
        op_name_(std::move(op_name)),
        entry_(std::move(entry)),
        select_last_(select_last) {}

  // One launch, or for a split reduction the partials' launch and the combining one.
  std::vector<Launch> launches(const LaunchTensors& t) const override {
    const KgReduceArgs a = args(t);
    std::vector<Launch> v;
    v.push_back(launch(t, a));
    if (a.stage == KG_REDUCE_STAGE_PARTIAL) {
      KgReduceArgs c = a;
      c.stage = KG_REDUCE_STAGE_COMBINE;
      v.push_back(launch(t, c));
    }
    return v;
  }
  // A split reduction's partials.
  std::size_t scratch_bytes(const LaunchTensors& t) const override {
    const KgReduceArgs a = args(t);
    if (a.stage == KG_REDUCE_STAGE_WHOLE) return 0;
    return static_cast<std::size_t>(a.outputs * a.splits) * KG_REDUCE_PART_BYTES;
  }

 private:
  KgReduceArgs args(const LaunchTensors& t) const {
    const auto& shape = t.inputs.at(0).shape;
    return gpu_args(reduce_plan(shape, reduced_dims(axes_, shape.size(), sizes_to_string(shape))), op_name_,
                    shape);
  }
  Launch launch(const LaunchTensors& t, const KgReduceArgs& a) const {
    Launch l;
    l.entry = entry_;
    l.grid = gpu_grid(a);
    l.block = {kThreads, 1, 1};
    l.args = {t.inputs[0], t.output, raw_bytes(&a, sizeof a)};
    if (select_last_ >= 0) l.args.add(KernelArg(std::int32_t{select_last_}));
    l.args.add(ptr(a.stage == KG_REDUCE_STAGE_WHOLE ? 0 : t.scratch));
    return l;
  }

  std::vector<std::int64_t> axes_;
  std::string op_name_, entry_;
  int select_last_;
};

class CumsumRuntime final : public RuntimeOp {
 public:
  CumsumRuntime(std::int64_t axis, bool exclusive, bool reverse, std::string entry)
      : axis_(axis), exclusive_(exclusive), reverse_(reverse), entry_(std::move(entry)) {}

  std::vector<Launch> launches(const LaunchTensors& t) const override {
    const auto& shape = t.inputs.at(0).shape;
    const AxisExtents e =
        axis_extents(shape, static_cast<std::size_t>(normalize_dim(axis_, shape.size(), "axis")));
    const std::int64_t lines = e.outer * e.inner;
    KgCumsumArgs a{};
    a.outer = e.outer;
    a.n = e.n;
    a.inner = e.inner;
    a.exclusive = exclusive_ ? 1 : 0;
    a.reverse = reverse_ ? 1 : 0;
    a.by_block = e.n > KG_CUMSUM_SERIAL_MAX && (e.inner == 1 || lines < KG_CUMSUM_FEW_LINES) ? 1 : 0;
    Launch l;
    l.entry = entry_;
    l.grid = a.by_block ? Dim3{static_cast<unsigned>(std::clamp<std::int64_t>(lines, 1, 65535LL * 32)), 1, 1}
                        : grid_1d(lines, kThreads);
    l.block = {kThreads, 1, 1};
    l.args = {t.inputs[0], t.output, raw_bytes(&a, sizeof a)};
    std::vector<Launch> v;
    v.push_back(std::move(l));
    return v;
  }

 private:
  std::int64_t axis_;
  bool exclusive_, reverse_;
  std::string entry_;
};

// ---- reduce.<fn> ----

class ReduceOp final : public CustomOp, public PrologueReduction {
 public:
  ReduceOp(ReduceFn fn, std::vector<std::int64_t> axes, bool keepdims)
      : fn_(fn), axes_(std::move(axes)), keepdims_(keepdims) {
    fn_entry(fn_);  // an unknown function is an error here
  }
  std::string name() const override { return fn_entry(fn_).op_name; }
  std::string attributes() const override {
    return util::cat("axes=", axes_.empty() ? std::string("all") : sizes_to_string(axes_),
                     " keepdims=", bool_text(keepdims_));
  }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    return reduced_shape(in[0], reduced_dims(axes_, in[0].rank(), in[0].to_string()), keepdims_);
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override {
    return require_dtype(in, fn_entry(fn_).ints);
  }

  // More kept or reduced dims than the kernel takes (after merging; only past rank 16) is an
  // error for a GPU, and leaves the op to its cpu_forward on the CPU.
  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    if (too_many_dims_for_emulator(ctx)) return std::nullopt;
    const DType dt = ctx.input_dtypes.at(0);
    const std::string entry = entry_of(fn_entry(fn_).kernel, dt), t = c_type(dt);
    return Lowered{name(),
                   entry_source(entry,
                                util::cat("const ", t, "* __restrict__ x, ", t,
                                          "* __restrict__ y, KgReduceArgs a, void* __restrict__ part"),
                                util::cat("kg_reduce<", t, ", ", fn_entry(fn_).code, ">(kg_load_ptr(x), y, a, part)")),
                   entry, std::make_shared<ReduceRuntime>(axes_, name(), entry, -1)};
  }

  // A folded prologue (ops/fused_reduction), for float inputs: the same kernel body and runtime,
  // the input read through the prologue's loader.
  bool takes_prologue(DType t) const override { return t == DType::F32 || t == DType::F64; }
  std::optional<Lowered> lower_with_prologue(const LowerContext& ctx, const PrologueCode& code) const override {
    const DType dt = ctx.input_dtypes.at(0);
    if (!takes_prologue(dt) || too_many_dims_for_emulator(ctx)) return std::nullopt;
    const std::string t = c_type(dt);
    std::string src = util::cat(code.head, "#define KG_REDUCE_ONE_ENTRY\n", kernel_file("reduce_ops.cu"), "\n",
                                code.source, "\nextern \"C\" __global__ void __launch_bounds__(KG_REDUCE_THREADS)\n    ",
                                code.entry, "(", code.params, ", ", t,
                                "* __restrict__ y, KgReduceArgs a, void* __restrict__ part) {\n  kg_reduce<", t, ", ",
                                fn_entry(fn_).code, ">(", code.loader, ", y, a, part);\n}\n");
    return Lowered{name(), std::move(src), code.entry,
                   std::make_shared<ReduceRuntime>(axes_, name(), code.entry, -1)};
  }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    const ReducePlan p = reduce_plan(x.shape(), reduced_dims(axes_, x.rank(), sizes_to_string(x.shape())));
    reduce_plan_cpu(ctx, x, p);
  }

 private:
  // Under the emulator, more merged dims than the kernel takes leaves the op to its cpu_forward.
  bool too_many_dims_for_emulator(const LowerContext& ctx) const {
    if (!ctx.emulated() || ctx.concrete_input_shapes.empty()) return false;
    const auto& shape = ctx.concrete_input_shapes[0];
    const ReducePlan p = reduce_plan(shape, reduced_dims(axes_, shape.size(), sizes_to_string(shape)));
    constexpr std::size_t max_dims = KG_REDUCE_MAX_DIMS;
    return p.kept.size() > max_dims || p.red.size() > max_dims;
  }
  void reduce_plan_cpu(CpuContext& ctx, const Tensor& x, const ReducePlan& p) const {
    dispatch_dtype(x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      visit_fn(fn_, [&](auto f) {
        constexpr ReduceFn F = decltype(f)::value;
        if constexpr (std::is_integral_v<T> && (F == ReduceFn::Mean || F == ReduceFn::L2 ||
                                                F == ReduceFn::LogSum || F == ReduceFn::LogSumExp))
          throw Error(util::cat("supports f32 and f64 inputs, got ", dtype_name(x.dtype())));
        else
          reduce_cpu<T, F>(ctx, x.data<T>(), ctx.output.data<T>(), p);
      });
    });
  }

  ReduceFn fn_;
  std::vector<std::int64_t> axes_;
  bool keepdims_;
};

// ---- reduce.argmax, reduce.argmin ----

class ArgReduceOp final : public CustomOp {
 public:
  ArgReduceOp(bool is_max, std::int64_t axis, bool keepdims, bool select_last)
      : is_max_(is_max), axis_(axis), keepdims_(keepdims), select_last_(select_last) {}
  std::string name() const override { return is_max_ ? "reduce.argmax" : "reduce.argmin"; }
  std::string attributes() const override {
    return util::cat("axis=", axis_, " keepdims=", bool_text(keepdims_),
                     " select_last_index=", bool_text(select_last_));
  }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    const Shape& x = in[0];
    const std::size_t d = single_axis(axis_, x);
    if (x[d].is_static() && x[d].size() == 0)
      throw Error(util::cat("axis ", axis_, " (dim ", d, ") of input ", x.to_string(),
                            " is empty: there is no ", is_max_ ? "largest" : "smallest",
                            " element to give the index of"));
    std::vector<bool> mask(x.rank(), false);
    mask[d] = true;
    return reduced_shape(x, mask, keepdims_);
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override {
    require_dtype(in, true);
    return DType::I64;
  }

  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    const DType dt = ctx.input_dtypes.at(0);
    const std::string entry = entry_of(is_max_ ? "kg_argmax" : "kg_argmin", dt), t = c_type(dt);
    return Lowered{
        name(),
        entry_source(
            entry,
            util::cat("const ", t, "* __restrict__ x, long long* __restrict__ y, KgReduceArgs a, ",
                      "int select_last, void* __restrict__ part"),
            util::cat("kg_arg_reduce<", t, ", ", bool_text(is_max_), ">(kg_load_ptr(x), y, a, select_last, part)")),
        entry,
        std::make_shared<ReduceRuntime>(std::vector<std::int64_t>{axis_}, name(), entry,
                                        select_last_ ? 1 : 0)};
  }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    const AxisExtents e = axis_extents(x.shape(), single_axis(axis_, Shape::of(x.shape())));
    if (e.outer * e.inner == 0) return;
    dispatch_dtype(x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      arg_reduce_cpu<T>(ctx, x.data<T>(), ctx.output.data<std::int64_t>(), e, is_max_, select_last_);
    });
  }

 private:
  bool is_max_;
  std::int64_t axis_;
  bool keepdims_, select_last_;
};

// ---- reduce.cumsum ----

class CumsumOp final : public CustomOp {
 public:
  CumsumOp(std::int64_t axis, bool exclusive, bool reverse)
      : axis_(axis), exclusive_(exclusive), reverse_(reverse) {}
  std::string name() const override { return "reduce.cumsum"; }
  std::string attributes() const override {
    return util::cat("axis=", axis_, " exclusive=", bool_text(exclusive_), " reverse=", bool_text(reverse_));
  }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    single_axis(axis_, in[0]);
    return in[0];
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override { return require_dtype(in, true); }

  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    const DType dt = ctx.input_dtypes.at(0);
    const std::string entry = entry_of("kg_cumsum", dt), t = c_type(dt);
    return Lowered{
        name(),
        entry_source(entry,
                     util::cat("const ", t, "* __restrict__ x, ", t, "* __restrict__ y, KgCumsumArgs a"),
                     util::cat("kg_cumsum<", t, ">(x, y, a)")),
        entry, std::make_shared<CumsumRuntime>(axis_, exclusive_, reverse_, entry)};
  }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    const AxisExtents e = axis_extents(x.shape(), single_axis(axis_, Shape::of(x.shape())));
    if (x.numel() == 0) return;
    dispatch_dtype(x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      cumsum_cpu<T>(ctx, x.data<T>(), ctx.output.data<T>(), e, exclusive_, reverse_);
    });
  }

 private:
  std::int64_t axis_;
  bool exclusive_, reverse_;
};

}  // namespace

std::string reduce_op_name(ReduceFn fn) { return fn_entry(fn).op_name; }

CustomData reduce_op(ReduceFn fn, const std::vector<std::int64_t>& axes, bool keepdims) {
  return CustomData::make<ReduceOp>(fn, axes, keepdims);
}

SymTensor reduce(ReduceFn fn, const SymTensor& x, const std::vector<std::int64_t>& axes, bool keepdims,
                 const std::string& name) {
  return x.record_custom(reduce_op(fn, axes, keepdims), {}, std::nullopt, name);
}

CustomData arg_reduce_op(bool is_max, std::int64_t axis, bool keepdims, bool select_last_index) {
  return CustomData::make<ArgReduceOp>(is_max, axis, keepdims, select_last_index);
}

SymTensor arg_reduce(bool is_max, const SymTensor& x, std::int64_t axis, bool keepdims,
                     bool select_last_index, const std::string& name) {
  return x.record_custom(arg_reduce_op(is_max, axis, keepdims, select_last_index), {}, std::nullopt, name);
}

CustomData cumsum_op(std::int64_t axis, bool exclusive, bool reverse) {
  return CustomData::make<CumsumOp>(axis, exclusive, reverse);
}

SymTensor cumsum(const SymTensor& x, std::int64_t axis, bool exclusive, bool reverse,
                 const std::string& name) {
  return x.record_custom(cumsum_op(axis, exclusive, reverse), {}, std::nullopt, name);
}

}  // namespace kg::ops
