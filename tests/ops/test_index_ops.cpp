// The index_ops family: every op against a naive reference written here, through check_op (shape
// inference at several batch sizes, cpu_forward on poisoned outputs, the kernel under the
// emulator in checked mode, and a GPU where there is one), for every element width and for i64
// and bool data; shape inference with dynamic dims; and every error path.
#include <cstring>
#include <functional>
#include <limits>
#include <optional>

#include "backend/emu/executor.hpp"
#include "ops/index_ops.hpp"
#include "support/gpu_util.hpp"
#include "support/test_util.hpp"

using kg::ops::DimRef;
using kg::ops::PadMode;
using kg_test::fresh_seed;

namespace {

using Idx = std::vector<std::int64_t>;
constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();

const kg::DType kEveryDtype[] = {kg::DType::Bool, kg::DType::I8, kg::DType::I16, kg::DType::I32,
                                 kg::DType::I64,  kg::DType::U8, kg::DType::F16, kg::DType::BF16,
                                 kg::DType::F32,  kg::DType::F64};
// One dtype of each width, and i64 and bool.
const kg::DType kWidths[] = {kg::DType::Bool, kg::DType::BF16, kg::DType::F32, kg::DType::I64};

Idx unflatten(std::int64_t flat, const Idx& shape) {
  Idx idx(shape.size(), 0);
  for (std::size_t d = shape.size(); d-- > 0;) {
    idx[d] = flat % shape[d];
    flat /= shape[d];
  }
  return idx;
}
std::int64_t flatten(const Idx& idx, const Idx& shape) {
  std::int64_t f = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) f = f * shape[d] + idx[d];
  return f;
}

// Random values of any dtype: floats in [-4, 4), integers over a wide range (i64 within 2^40, so
// that doubles compare them exactly), bool 0 or 1.
kg::Tensor random_any(std::mt19937_64& rng, kg::DType dt, const Idx& shape) {
  if (kg::is_floating(dt)) return kg_test::random_tensor(rng, dt, shape, -4, 4);
  kg::Tensor t = kg::Tensor::empty(dt, shape);
  std::int64_t lo = -(std::int64_t{1} << 40), hi = std::int64_t{1} << 40;
  if (dt == kg::DType::Bool) lo = 0, hi = 1;
  if (dt == kg::DType::U8) lo = 0, hi = 255;
  if (dt == kg::DType::I8) lo = -128, hi = 127;
  if (dt == kg::DType::I16) lo = -32768, hi = 32767;
  if (dt == kg::DType::I32) lo = -2000000000, hi = 2000000000;
  std::uniform_int_distribution<std::int64_t> u(lo, hi);
  const std::size_t w = kg::dtype_size(dt);
  // Never an element whose every byte is 0xA5: the GPU's checked mode poisons integer outputs
  // with that byte and would take such an element for one left unwritten.
  auto poison_like = [w](std::int64_t v) {
    for (std::size_t k = 0; k < w; ++k)
      if (((v >> (8 * k)) & 0xFF) != 0xA5) return false;
    return true;
  };
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    std::int64_t v = u(rng);
    while (poison_like(v)) v = u(rng);
    std::memcpy(static_cast<char*>(t.raw()) + static_cast<std::size_t>(i) * w, &v, w);  // little-endian
  }
  return t;
}

// Random indices of `dt` (i32 or i64) in [lo, hi].
kg::Tensor random_indices(std::mt19937_64& rng, kg::DType dt, const Idx& shape, std::int64_t lo,
                          std::int64_t hi) {
  std::uniform_int_distribution<std::int64_t> u(lo, hi);
  std::vector<std::int64_t> v(static_cast<std::size_t>(kg::numel_of(shape)));
  for (auto& e : v) e = u(rng);
  if (dt == kg::DType::I64) return kg::Tensor::from_vector<std::int64_t>(shape, v);
  return kg::Tensor::from_vector<std::int32_t>(shape, std::vector<std::int32_t>(v.begin(), v.end()));
}

std::int64_t index_value(const kg::Tensor& t, std::int64_t i) { return static_cast<std::int64_t>(t.item(i)); }

// The tensor of `out_shape` whose element at each index is x's element at the flat offset
// `src(index)`, or `fill` where src gives nothing. Elements are copied as bytes.
kg::Tensor build_ref(kg::DType dt, const Idx& out_shape, const kg::Tensor* x,
                     const std::function<std::optional<std::int64_t>(const Idx&)>& src, double fill = 0) {
  kg::Tensor y = kg::Tensor::empty(dt, out_shape);
  kg::Tensor c = kg::Tensor::empty(dt, {});
  c.fill(fill);
  const std::size_t w = kg::dtype_size(dt);
  for (std::int64_t f = 0; f < y.numel(); ++f) {
    const auto s = src(unflatten(f, out_shape));
    const void* from = s ? static_cast<const char*>(x->raw()) + static_cast<std::size_t>(*s) * w : c.raw();
    std::memcpy(static_cast<char*>(y.raw()) + static_cast<std::size_t>(f) * w, from, w);
  }
  return y;
}

// Byte-for-byte equality with the reference.
::testing::AssertionResult same_bytes(const kg::Tensor& got, const kg::Tensor& want) {
  if (got.shape() != want.shape() || got.dtype() != want.dtype())
    return ::testing::AssertionFailure()
           << "got " << kg::sizes_to_string(got.shape()) << " " << kg::dtype_name(got.dtype())
           << ", expected " << kg::sizes_to_string(want.shape()) << " " << kg::dtype_name(want.dtype());
  const std::size_t w = kg::dtype_size(got.dtype());
  for (std::int64_t i = 0; i < got.numel(); ++i)
    if (std::memcmp(static_cast<const char*>(got.raw()) + i * w, static_cast<const char*>(want.raw()) + i * w,
                    w))
      return ::testing::AssertionFailure()
             << "element " << i << " " << kg::sizes_to_string(unflatten(i, got.shape())) << ": got "
             << got.item(i) << ", expected " << want.item(i);
  return ::testing::AssertionSuccess();
}

using Reference = std::function<kg::Tensor(const std::vector<kg::Tensor>&)>;
using MakeInput = std::function<kg::Tensor(int, const Idx&)>;

// check_op at `batches` (every dynamic dim takes each size), exact comparisons against `ref`;
// inputs from `make` where it gives one (random values otherwise); the emulated kernel must have
// run at every batch size.
void check(const kg::CustomData& op, const std::vector<kg::Shape>& shapes,
           const std::vector<kg::DType>& dtypes, const Reference& ref, std::mt19937_64& rng,
           const MakeInput& make = {}, const Idx& batches = {1, 3}) {
  kg::testing::CheckOpOptions o;
  o.seed = rng() | 1;
  o.batch_sizes = batches;
  o.rtol = o.atol = 0;  // copies are exact
  o.reruns = 1;
  o.make_input = [&](int i, const Idx& s) {
    if (make) {
      kg::Tensor t = make(i, s);
      if (t.defined() && t.numel() == kg::numel_of(s) && t.rank() == s.size()) return t;
    }
    return random_any(rng, dtypes[static_cast<std::size_t>(i)], s);
  };
  o.reference = [&](const std::vector<kg::Tensor>& in, const std::map<std::string, kg::Tensor>&) {
    return ref(in);
  };
  const kg::testing::CheckOpReport r = kg::testing::check_op(op, shapes, dtypes, o);
  EXPECT_TRUE(r.ok) << r.to_string();
  const auto n = static_cast<int>(batches.size());
  EXPECT_EQ(kg_test::count_lines(r, "PASS batch", {"emulator"}), n) << r.to_string();
  EXPECT_EQ(kg_test::count_lines(r, "PASS batch", {"reference"}), n) << r.to_string();
}

// The output shape of `op` recorded on inputs of `shapes` (f32 unless `dtypes` says otherwise).
std::string shape_of(const kg::CustomData& op, const std::vector<kg::Shape>& shapes,
                     std::vector<kg::DType> dtypes = {}) {
  auto g = kg::Graph::create();
  std::vector<kg::SymTensor> xs;
  for (std::size_t i = 0; i < shapes.size(); ++i)
    xs.push_back(g->input(i < dtypes.size() ? dtypes[i] : kg::DType::F32, shapes[i]));
  return g->record(op, xs).shape().to_string();
}

// Records `op` on inputs of `shapes` and `dtypes` as node "n", expecting an error with `parts`.
void expect_record_error(const kg::CustomData& op, const std::vector<kg::Shape>& shapes,
                         const std::vector<kg::DType>& dtypes, std::vector<std::string> parts) {
  auto g = kg::Graph::create();
  std::vector<kg::SymTensor> xs;
  for (std::size_t i = 0; i < shapes.size(); ++i) xs.push_back(g->input(dtypes.at(i), shapes[i]));
  parts.insert(parts.begin(), "[" + op.name() + " @ n]");
  kg_test::expect_error([&] { g->record(op, xs, std::nullopt, "n"); }, parts);
}

// Runs `op` on the CPU device on concrete `inputs` (recorded with static shapes).
kg::Tensor run_cpu(const kg::CustomData& op, const std::vector<kg::Tensor>& inputs) {
  auto g = kg::Graph::create();
  std::vector<kg::SymTensor> xs;
  std::vector<Idx> shapes;
  for (const auto& t : inputs) {
    xs.push_back(g->input(t.dtype(), kg::Shape::of(t.shape())));
    shapes.push_back(t.shape());
  }
  kg::Model m(g, {g->record(op, xs, std::nullopt, "n")});
  return m.load(kg::Device::cpu(), shapes).forward(inputs).at(0);
}

// The same through the CUDA emulator (checked mode).
kg::Tensor run_emulated(const kg::CustomData& op, const std::vector<kg::Tensor>& inputs) {
  auto g = kg::Graph::create();
  std::vector<kg::SymTensor> xs;
  for (const auto& t : inputs) xs.push_back(g->input(t.dtype(), kg::Shape::of(t.shape())));
  kg::Model m(g, {g->record(op, xs, std::nullopt, "n")});
  return kg::emu::run_model(m, inputs, {}, /*checked=*/true).at(0);
}

// ---- references ----

kg::Tensor gather_ref(const kg::Tensor& data, const kg::Tensor& idx, std::int64_t axis) {
  const Idx& ds = data.shape();
  const auto a = static_cast<std::size_t>(axis < 0 ? axis + static_cast<std::int64_t>(ds.size()) : axis);
  const std::size_t ri = idx.rank();
  Idx os(ds.begin(), ds.begin() + static_cast<std::ptrdiff_t>(a));
  os.insert(os.end(), idx.shape().begin(), idx.shape().end());
  os.insert(os.end(), ds.begin() + static_cast<std::ptrdiff_t>(a) + 1, ds.end());
  return build_ref(data.dtype(), os, &data, [&](const Idx& o) {
    Idx at(o.begin() + static_cast<std::ptrdiff_t>(a), o.begin() + static_cast<std::ptrdiff_t>(a + ri));
    std::int64_t k = index_value(idx, flatten(at, idx.shape()));
    if (k < 0) k += ds[a];
    Idx d(o.begin(), o.begin() + static_cast<std::ptrdiff_t>(a));
    d.push_back(k);
    d.insert(d.end(), o.begin() + static_cast<std::ptrdiff_t>(a + ri), o.end());
    return flatten(d, ds);
  });
}

kg::Tensor gather_elements_ref(const kg::Tensor& data, const kg::Tensor& idx, std::int64_t axis) {
  const auto a = static_cast<std::size_t>(axis < 0 ? axis + static_cast<std::int64_t>(data.rank()) : axis);
  return build_ref(data.dtype(), idx.shape(), &data, [&](const Idx& o) {
    Idx d = o;
    std::int64_t k = index_value(idx, flatten(o, idx.shape()));
    d[a] = k < 0 ? k + data.shape()[a] : k;
    return flatten(d, data.shape());
  });
}

// x broadcast to out_shape (numpy rules: x aligned to the right, its 1s repeated).
kg::Tensor expand_ref(const kg::Tensor& x, const Idx& out_shape) {
  const std::size_t lead = out_shape.size() - x.rank();
  return build_ref(x.dtype(), out_shape, &x, [&](const Idx& o) {
    Idx d(x.rank());
    for (std::size_t i = 0; i < x.rank(); ++i) d[i] = x.shape()[i] == 1 ? 0 : o[i + lead];
    return flatten(d, x.shape());
  });
}

kg::Tensor tile_ref(const kg::Tensor& x, const Idx& reps) {
  Idx os;
  for (std::size_t i = 0; i < x.rank(); ++i) os.push_back(x.shape()[i] * reps[i]);
  return build_ref(x.dtype(), os, &x, [&](const Idx& o) {
    Idx d(x.rank());
    for (std::size_t i = 0; i < x.rank(); ++i) d[i] = o[i] % x.shape()[i];
    return flatten(d, x.shape());
  });
}

// numpy.pad's modes, one index at a time; nullopt for the constant.
std::optional<std::int64_t> pad_index(std::int64_t k, std::int64_t n, PadMode mode) {
  if (k >= 0 && k < n) return k;
  switch (mode) {
    case PadMode::Constant:
      return std::nullopt;
    case PadMode::Edge:
      return k < 0 ? 0 : n - 1;
    case PadMode::Wrap:
      while (k < 0) k += n;
      while (k >= n) k -= n;
      return k;
    case PadMode::Reflect:
      return k < 0 ? -k : (n - 1) - (k - (n - 1));
  }
  return std::nullopt;
}

kg::Tensor pad_ref(const kg::Tensor& x, const Idx& begin, const Idx& end, PadMode mode, double value) {
  Idx os;
  for (std::size_t i = 0; i < x.rank(); ++i) os.push_back(x.shape()[i] + begin[i] + end[i]);
  return build_ref(
      x.dtype(), os, &x,
      [&](const Idx& o) -> std::optional<std::int64_t> {
        Idx d(x.rank());
        for (std::size_t i = 0; i < x.rank(); ++i) {
          const auto k = pad_index(o[i] - begin[i], x.shape()[i], mode);
          if (!k) return std::nullopt;
          d[i] = *k;
        }
        return flatten(d, x.shape());
      },
      value);
}

// The indices an ONNX Slice takes from a dim of n, by the spec's words: negative bounds count
// from the end; starts are clamped into [0, n] (positive steps) or [0, n-1] (negative), ends
// into [0, n] or [-1, n-1]; then every step from start while short of end.
Idx onnx_taken(std::int64_t n, std::int64_t start, std::int64_t end, std::int64_t step) {
  if (start < 0) start += n;
  if (end < 0) end += n;
  if (step > 0) {
    start = std::min(std::max<std::int64_t>(start, 0), n);
    end = std::min(std::max<std::int64_t>(end, 0), n);
  } else {
    start = std::min(std::max<std::int64_t>(start, 0), n - 1);
    end = std::min(std::max<std::int64_t>(end, -1), n - 1);
  }
  Idx taken;
  for (std::int64_t i = start; step > 0 ? i < end : i > end;) {
    taken.push_back(i);
    if (__builtin_add_overflow(i, step, &i)) break;  // a step past the int64 range ends the walk
  }
  return taken;
}

struct SliceArgs {
  Idx starts, ends, axes, steps;
};

kg::Tensor slice_ref(const kg::Tensor& x, const SliceArgs& s) {
  const auto r = static_cast<std::int64_t>(x.rank());
  std::vector<Idx> taken(x.rank());
  for (std::size_t d = 0; d < x.rank(); ++d)
    for (std::int64_t i = 0; i < x.shape()[d]; ++i) taken[d].push_back(i);
  for (std::size_t i = 0; i < s.starts.size(); ++i) {
    const std::int64_t axis = s.axes.empty() ? static_cast<std::int64_t>(i) : s.axes[i];
    const auto d = static_cast<std::size_t>(axis < 0 ? axis + r : axis);
    taken[d] = onnx_taken(x.shape()[d], s.starts[i], s.ends[i], s.steps.empty() ? 1 : s.steps[i]);
  }
  Idx os;
  for (const auto& t : taken) os.push_back(static_cast<std::int64_t>(t.size()));
  return build_ref(x.dtype(), os, &x, [&](const Idx& o) {
    Idx d(x.rank());
    for (std::size_t i = 0; i < x.rank(); ++i) d[i] = taken[i][static_cast<std::size_t>(o[i])];
    return flatten(d, x.shape());
  });
}

kg::Tensor range_ref(kg::DType dt, std::int64_t start, std::int64_t limit, std::int64_t delta) {
  std::vector<double> v;
  for (std::int64_t x = start; delta > 0 ? x < limit : x > limit; x += delta)
    v.push_back(static_cast<double>(x));
  kg::Tensor t = kg::Tensor::from_vector<double>({static_cast<std::int64_t>(v.size())}, v);
  if (dt == kg::DType::F64) return t;
  if (kg::is_floating(dt)) return t.to(dt);
  kg::Tensor o = kg::Tensor::empty(dt, t.shape());
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (dt == kg::DType::I64)
      o.data<std::int64_t>()[i] = static_cast<std::int64_t>(v[i]);
    else
      o.data<std::int32_t>()[i] = static_cast<std::int32_t>(v[i]);
  }
  return o;
}

}  // namespace

// ---- index.gather ----

TEST(IndexGather, EmbeddingLookup) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // [vocab 50, hidden 16] f32 table, [batch, seq 7] i64 token ids (some negative: from the end).
  const kg::Dim B = kg::Dim::named("batch");
  EXPECT_EQ(shape_of(kg::ops::gather_op(0), {{50, 16}, {B, 7}}, {kg::DType::F32, kg::DType::I64}),
            "[batch, 7, 16]");
  check(
      kg::ops::gather_op(0), {{50, 16}, {B, 7}}, {kg::DType::F32, kg::DType::I64},
      [](const auto& in) { return gather_ref(in[0], in[1], 0); }, rng,
      [&](int i, const Idx& s) {
        return i == 1 ? random_indices(rng, kg::DType::I64, s, -50, 49) : kg::Tensor{};
      });
  // Through the recording function, at a larger batch.
  kg::Tensor table = random_any(rng, kg::DType::F32, {50, 16});
  kg::Tensor ids = random_indices(rng, kg::DType::I64, {9, 7}, 0, 49);
  auto out = kg_test::run_graph(
      [](const std::vector<kg::SymTensor>& in) {
        return std::vector<kg::SymTensor>{kg::ops::gather(in[0], in[1], 0, "embed")};
      },
      {table, ids}, {}, /*dynamic_batch=*/false);
  EXPECT_TRUE(same_bytes(out[0], gather_ref(table, ids, 0)));
}

TEST(IndexGather, MiddleAxisNegativeIndicesEveryDtype) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Dim B = kg::Dim::named("batch");
  for (kg::DType dt : kEveryDtype) {
    for (kg::DType it : {kg::DType::I32, kg::DType::I64}) {
      if (it == kg::DType::I32 && dt != kg::DType::F16 && dt != kg::DType::I8) continue;  // i32 in two widths
      SCOPED_TRACE(::testing::Message()
                   << kg::dtype_name(dt) << " data, " << kg::dtype_name(it) << " indices");
      // data [batch, 5, 3] along axis 1 with indices [2, 4] in [-5, 5).
      check(
          kg::ops::gather_op(1), {{B, 5, 3}, {2, 4}}, {dt, it},
          [](const auto& in) { return gather_ref(in[0], in[1], 1); }, rng,
          [&](int i, const Idx& s) { return i == 1 ? random_indices(rng, it, s, -5, 4) : kg::Tensor{}; });
    }
  }
  // The last axis, counted from the end, of i64 and bool data; indices of a dynamic batch.
  for (kg::DType dt : {kg::DType::I64, kg::DType::Bool}) {
    SCOPED_TRACE(kg::dtype_name(dt));
    EXPECT_EQ(shape_of(kg::ops::gather_op(-1), {{4, 6}, {B, 3}}, {dt, kg::DType::I64}), "[4, batch, 3]");
    check(
        kg::ops::gather_op(-1), {{4, 6}, {B, 3}}, {dt, kg::DType::I64},
        [](const auto& in) { return gather_ref(in[0], in[1], -1); }, rng,
        [&](int i, const Idx& s) {
          return i == 1 ? random_indices(rng, kg::DType::I64, s, -6, 5) : kg::Tensor{};
        });
  }
}

TEST(IndexGather, ScalarIndices) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Dim B = kg::Dim::named("batch");
  // A rank-0 index removes the axis: data [batch, 6, 2], index [] on axis 1 -> [batch, 2].
  EXPECT_EQ(shape_of(kg::ops::gather_op(1), {{B, 6, 2}, kg::Shape{}}, {kg::DType::F32, kg::DType::I64}),
            "[batch, 2]");
  for (kg::DType it : {kg::DType::I32, kg::DType::I64})
    check(
        kg::ops::gather_op(1), {{B, 6, 2}, kg::Shape{}}, {kg::DType::F64, it},
        [](const auto& in) { return gather_ref(in[0], in[1], 1); }, rng,
        [&](int i, const Idx& s) { return i == 1 ? random_indices(rng, it, s, -6, 5) : kg::Tensor{}; });
  // 1-D data and a scalar index: a scalar.
  EXPECT_EQ(shape_of(kg::ops::gather_op(0), {{7}, kg::Shape{}}, {kg::DType::I64, kg::DType::I32}), "[]");
  kg::Tensor x = kg::Tensor::from_vector<std::int64_t>({7}, {10, 11, 12, 13, 14, 15, 16});
  kg::Tensor y = run_cpu(kg::ops::gather_op(0), {x, kg::Tensor::from_vector<std::int32_t>({}, {-2})});
  ASSERT_EQ(y.rank(), 0u);
  EXPECT_EQ(y.data<std::int64_t>()[0], 15);
}

TEST(IndexGather, OutOfRangeIsAnErrorOnTheCpuAndClampedOnTheGpu) {
  kg::Tensor data = kg::Tensor::from_vector<float>({3, 2}, {0, 1, 10, 11, 20, 21});
  for (std::int64_t bad : {3, -4}) {
    SCOPED_TRACE(bad);
    kg::Tensor idx = kg::Tensor::from_vector<std::int64_t>({2, 2}, {0, 2, -1, bad});
    kg_test::expect_error(
        [&] {
          run_cpu(kg::ops::gather_op(0), {data, idx});
        },
        {"[index.gather @ n]", "index " + std::to_string(bad) + " at [1, 1] of indices [2, 2]",
         "out of range for axis 0 of data [3, 2] (size 3)", "valid indices are in [-3, 3)"});
    // The kernel clamps into [0, 3): a bad index never reads outside the data.
    kg::Tensor got = run_emulated(kg::ops::gather_op(0), {data, idx});
    const float want_last = bad > 0 ? 20.f : 0.f;
    EXPECT_EQ(got.shape(), (Idx{2, 2, 2}));
    const std::vector<float> want{0, 1, 20, 21, 20, 21, want_last, want_last + 1};
    for (std::size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got.data<float>()[i], want[i]) << i;
  }
  // The i32 path checks too.
  kg_test::expect_error(
      [&] {
        run_cpu(kg::ops::gather_op(1), {data, kg::Tensor::from_vector<std::int32_t>({1}, {2})});
      },
      {"[index.gather @ n]", "index 2 at [0] of indices [1]", "axis 1 of data [3, 2] (size 2)", "[-2, 2)"});
  // An empty axis has no valid index: the CPU names the index, the GPU launch refuses.
  kg::Tensor empty = kg::Tensor::empty(kg::DType::F32, {0, 2});
  kg::Tensor zero = kg::Tensor::from_vector<std::int64_t>({1}, {0});
  kg_test::expect_error(
      [&] {
        run_cpu(kg::ops::gather_op(0), {empty, zero});
      },
      {"index 0 at [0]", "(size 0)", "[0, 0)"});
  const kg::Tensor zeros = run_emulated(kg::ops::gather_op(0), {empty, zero});  // the GPU writes zeros
  EXPECT_TRUE(same_bytes(zeros, kg::Tensor::zeros(kg::DType::F32, {1, 2})));
  kg::Tensor empty3 = kg::Tensor::empty(kg::DType::I16, {2, 0});
  kg::Tensor zero3 = kg::Tensor::from_vector<std::int32_t>({2, 1}, {0, 0});
  kg_test::expect_error(
      [&] {
        run_cpu(kg::ops::gather_elements_op(1), {empty3, zero3});
      },
      {"[index.gather_elements @ n]", "index 0 at [0, 0]", "(size 0)"});
  EXPECT_TRUE(same_bytes(run_emulated(kg::ops::gather_elements_op(1), {empty3, zero3}),
                         kg::Tensor::zeros(kg::DType::I16, {2, 1})));
}

TEST(IndexGather, RejectsBadInputs) {
  using kg::DType;
  expect_record_error(kg::ops::gather_op(0), {{4, 3}, {2}}, {DType::F32, DType::F32},
                      {"expects i32 or i64 indices, got f32"});
  expect_record_error(kg::ops::gather_op(0), {{4, 3}, {2}}, {DType::F32, DType::I16}, {"got i16"});
  expect_record_error(kg::ops::gather_op(2), {{4, 3}, {2}}, {DType::F32, DType::I64},
                      {"axis 2 is out of range for rank 2"});
  expect_record_error(kg::ops::gather_op(-3), {{4, 3}, {2}}, {DType::F32, DType::I64}, {"axis -3", "rank 2"});
  expect_record_error(kg::ops::gather_op(0), {kg::Shape{}, {2}}, {DType::F32, DType::I64},
                      {"cannot gather from a scalar data []"});
  expect_record_error(kg::ops::gather_op(0), {{4, 3}}, {DType::F32}, {"expects 2 input(s), got 1"});
}

// ---- index.gather_elements ----

TEST(IndexGatherElements, MatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Dim B = kg::Dim::named("batch");
  struct Case {
    kg::Shape data, idx;
    std::int64_t axis;
  };
  // Indices as large as the data, smaller in the other dims, larger along the axis; the batch
  // dim dynamic in both.
  const std::vector<Case> cases = {
      {{B, 4, 3}, {B, 4, 3}, 0}, {{B, 4, 3}, {B, 6, 2}, 1}, {{B, 4, 3}, {B, 2, 5}, -1}, {{5}, {8}, 0}};
  for (const Case& c : cases) {
    for (kg::DType dt : kWidths) {
      const kg::DType it = dt == kg::DType::F32 ? kg::DType::I32 : kg::DType::I64;
      SCOPED_TRACE(::testing::Message() << "data " << c.data.to_string() << " indices " << c.idx.to_string()
                                        << " axis " << c.axis << " " << kg::dtype_name(dt));
      EXPECT_EQ(shape_of(kg::ops::gather_elements_op(c.axis), {c.data, c.idx}, {dt, it}), c.idx.to_string());
      const std::int64_t axis = c.axis;
      check(
          kg::ops::gather_elements_op(c.axis), {c.data, c.idx}, {dt, it},
          [axis](const auto& in) { return gather_elements_ref(in[0], in[1], axis); }, rng,
          [&](int i, const Idx& s) -> kg::Tensor {
            if (i != 1) return {};
            const std::size_t a =
                static_cast<std::size_t>(axis < 0 ? axis + static_cast<std::int64_t>(s.size()) : axis);
            const std::int64_t n = c.data[a].is_static() ? c.data[a].size() : s[0];
            return random_indices(rng, it, s, -n, n - 1);
          });
    }
  }
}

TEST(IndexGatherElements, RejectsBadInputs) {
  using kg::DType;
  expect_record_error(kg::ops::gather_elements_op(0), {{4, 3}, {4}}, {DType::F32, DType::I64},
                      {"indices [4] have rank 1 but data [4, 3] has rank 2"});
  expect_record_error(
      kg::ops::gather_elements_op(0), {{4, 3}, {2, 5}}, {DType::F32, DType::I64},
      {"indices [2, 5] are larger than data [4, 3] in dim 1 (5 vs 3); only axis 0 may be larger"});
  expect_record_error(kg::ops::gather_elements_op(2), {{4, 3}, {4, 3}}, {DType::F32, DType::I64},
                      {"axis 2 is out of range for rank 2"});
  expect_record_error(kg::ops::gather_elements_op(0), {{4, 3}, {4, 3}}, {DType::F32, DType::F64},
                      {"expects i32 or i64 indices, got f64"});
  expect_record_error(kg::ops::gather_elements_op(0), {kg::Shape{}, kg::Shape{}}, {DType::F32, DType::I64},
                      {"cannot gather from a scalar"});
  kg::Tensor data = kg::Tensor::from_vector<float>({2, 3}, {0, 1, 2, 3, 4, 5});
  kg_test::expect_error(
      [&] {
        run_cpu(kg::ops::gather_elements_op(1),
                {data, kg::Tensor::from_vector<std::int32_t>({2, 2}, {0, 1, -4, 2})});
      },
      {"[index.gather_elements @ n]", "index -4 at [1, 0] of indices [2, 2]",
       "axis 1 of data [2, 3] (size 3)", "[-3, 3)"});
}

// ---- index.expand ----

TEST(IndexExpand, BroadcastsBothWays) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto c = [](std::int64_t v) { return DimRef::constant(v); };
  // [3, 1] to [2, 1, 4]: the input's 3 and the shape's 2 and 4 all survive.
  EXPECT_EQ(shape_of(kg::ops::expand_op({c(2), c(1), c(4)}), {{3, 1}}), "[2, 3, 4]");
  // A shorter shape than the input: the input's rank.
  EXPECT_EQ(shape_of(kg::ops::expand_op({c(3), c(1)}), {{2, 1, 1}}), "[2, 3, 1]");
  for (kg::DType dt : kWidths) {
    SCOPED_TRACE(kg::dtype_name(dt));
    check(
        kg::ops::expand_op({c(2), c(1), c(4)}), {{3, 1}}, {dt},
        [](const auto& in) {
          return expand_ref(in[0], {2, 3, 4});
        },
        rng);
    check(
        kg::ops::expand_op({c(3), c(1)}), {{2, 1, 5}}, {dt},
        [](const auto& in) {
          return expand_ref(in[0], {2, 3, 5});
        },
        rng);
  }
  // Every dim kept ([1] to [1]) and a scalar expanded.
  check(
      kg::ops::expand_op({c(4), c(1)}), {kg::Shape{}}, {kg::DType::I16},
      [](const auto& in) {
        return expand_ref(in[0], {4, 1});
      },
      rng);
}

TEST(IndexExpand, ToTheDynamicBatchOfASource) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Dim B = kg::Dim::named("batch");
  // x [1, 8] to [src.dim0, 8] with src [batch, 5]: [batch, 8].
  const std::vector<DimRef> shape{DimRef::of(1, 0), DimRef::constant(8)};
  EXPECT_EQ(shape_of(kg::ops::expand_op(shape), {{1, 8}, {B, 5}}), "[batch, 8]");
  for (kg::DType dt : {kg::DType::F32, kg::DType::I64, kg::DType::Bool}) {
    SCOPED_TRACE(kg::dtype_name(dt));
    check(
        kg::ops::expand_op(shape), {{1, 8}, {B, 5}}, {dt, kg::DType::F32},
        [](const auto& in) {
          return expand_ref(in[0], {in[1].shape()[0], 8});
        },
        rng);
  }
  // A dynamic x against the source's dim and against constants.
  EXPECT_EQ(shape_of(kg::ops::expand_op({DimRef::of(0, 0), DimRef::constant(3)}), {{B, 1}}), "[batch, 3]");
  EXPECT_EQ(shape_of(kg::ops::expand_op({DimRef::constant(4), DimRef::constant(1)}), {{B, 1}}), "[4, 1]");
  EXPECT_EQ(shape_of(kg::ops::expand_op({DimRef::of(1, 0)}), {{3}, {B}}), "[3]");
  EXPECT_EQ(shape_of(kg::ops::expand_op({DimRef::of(1, 0)}), {{kg::dynamic}, {B}}), "[?]");
  EXPECT_EQ(shape_of(kg::ops::expand_op({DimRef::of(1, 0)}), {{B}, {B}}), "[batch]");
  // Through the recording function: x [1, 8] expanded to the batch of a second tensor.
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {1, 8}, "x");
  auto src = g->input(kg::DType::F32, {B, 2}, "src");
  auto y = kg::ops::expand(x, shape, {src}, "e");
  EXPECT_EQ(y.shape().to_string(), "[batch, 8]");
  EXPECT_EQ(g->node(y.node()).op_name(), "index.expand");
  kg::Model m(g, {y});
  kg::Tensor xv = random_any(rng, kg::DType::F32, {1, 8}), sv = random_any(rng, kg::DType::F32, {6, 2});
  EXPECT_TRUE(
      same_bytes(m.load(kg::Device::cpu(), {{1, 8}, {6, 2}}).forward({xv, sv})[0], expand_ref(xv, {6, 8})));
}

TEST(IndexExpand, RejectsBadShapes) {
  using kg::DType;
  auto c = [](std::int64_t v) { return DimRef::constant(v); };
  expect_record_error(kg::ops::expand_op({c(4)}), {{3, 2}}, {DType::F32},
                      {"cannot expand [3, 2] to [4]: output dim 1 is 2 in the input and 4 in the shape"});
  expect_record_error(kg::ops::expand_op({c(2), c(-1)}), {{3}}, {DType::F32},
                      {"shape [2, -1] has a negative size -1"});
  expect_record_error(kg::ops::expand_op({DimRef::of(2, 0)}), {{3}, {4}}, {DType::F32, DType::F32},
                      {"a size refers to input 2 but the op has 2 inputs"});
  expect_record_error(kg::ops::expand_op({DimRef::of(1, 3)}), {{3}, {4}}, {DType::F32, DType::F32},
                      {"a size refers to dim 3 of input 1 [4], which has rank 1"});
  // A dynamic dim that disagrees at load.
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("n"), 1}, "x");
  auto y = kg::ops::expand(x, {c(3), c(2)}, {}, "e");
  EXPECT_EQ(y.shape().to_string(), "[3, 2]");
  kg::Model m(g, {y});
  kg_test::expect_error(
      [&] {
        m.load(kg::Device::cpu(), {{4, 1}});
      },
      {"[index.expand @ e]", "cannot expand [4, 1] to [3, 2]", "4 in the input and 3 in the shape"});
}

// ---- index.tile ----

TEST(IndexTile, MatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Dim B = kg::Dim::named("batch");
  EXPECT_EQ(shape_of(kg::ops::tile_op({1, 3}), {{B, 2}}), "[batch, 6]");
  EXPECT_EQ(shape_of(kg::ops::tile_op({2, 3}), {{B, 2}}), "[?, 6]");
  EXPECT_EQ(shape_of(kg::ops::tile_op({0, 1}), {{B, 2}}), "[0, 2]");
  for (kg::DType dt : kWidths) {
    SCOPED_TRACE(kg::dtype_name(dt));
    const Idx reps{2, 1, 3};
    check(
        kg::ops::tile_op(reps), {{B, 3, 2}}, {dt}, [&](const auto& in) { return tile_ref(in[0], reps); },
        rng);
  }
  check(
      kg::ops::tile_op({3, 0}), {{2, 5}}, {kg::DType::I8},
      [](const auto& in) {
        return tile_ref(in[0], {3, 0});
      },
      rng);
  check(
      kg::ops::tile_op({}), {kg::Shape{}}, {kg::DType::F16}, [](const auto& in) { return in[0].clone(); },
      rng);
  // Through the recording function.
  kg::Tensor x = random_any(rng, kg::DType::I64, {2, 3});
  auto out = kg_test::run_op([](const kg::SymTensor& t) { return kg::ops::tile(t, {2, 2}, "t"); }, x);
  EXPECT_TRUE(same_bytes(out, tile_ref(x, {2, 2})));
}

TEST(IndexTile, RejectsBadRepeats) {
  expect_record_error(kg::ops::tile_op({2}), {{3, 2}}, {kg::DType::F32},
                      {"repeats [2] have 1 entries for an input of rank 2 [3, 2]"});
  expect_record_error(kg::ops::tile_op({2, -1}), {{3, 2}}, {kg::DType::F32},
                      {"repeats [2, -1] have a negative entry -1 at 1"});
}

// ---- index.pad ----

TEST(IndexPad, EveryModeAndNegativePads) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Dim B = kg::Dim::named("batch");
  struct Case {
    Idx begin, end;
  };
  // [batch, 4, 5]: pads in the last two dims, some crops (negative), the batch dim untouched or
  // cropped and padded by the same amount (its size kept).
  const std::vector<Case> cases = {{{0, 1, 2}, {0, 3, 1}}, {{0, -1, 4}, {0, 2, -2}}, {{1, 0, 0}, {-1, 0, 3}}};
  for (PadMode mode : {PadMode::Constant, PadMode::Reflect, PadMode::Edge, PadMode::Wrap}) {
    for (const Case& c : cases) {
      for (kg::DType dt : kWidths) {
        if (dt != kg::DType::F32 && &c != &cases[0]) continue;  // every case in f32, one in the others
        SCOPED_TRACE(::testing::Message()
                     << kg::ops::pad_mode_name(mode) << " begin " << kg::sizes_to_string(c.begin) << " end "
                     << kg::sizes_to_string(c.end) << " " << kg::dtype_name(dt));
        const double value = dt == kg::DType::Bool ? 1 : -3;
        EXPECT_EQ(shape_of(kg::ops::pad_op(c.begin, c.end, mode, value), {{B, 4, 5}}, {dt}),
                  kg::Shape({B, 4 + c.begin[1] + c.end[1], 5 + c.begin[2] + c.end[2]}).to_string());
        // Batch sizes from 2: a reflect pad of the batch dim needs it.
        check(kg::ops::pad_op(c.begin, c.end, mode, value), {{B, 4, 5}}, {dt},
              [&](const auto& in) { return pad_ref(in[0], c.begin, c.end, mode, value); }, rng, {}, {2, 3});
      }
    }
  }
  // Wrap around more than once, and a constant pad of an empty dim.
  check(
      kg::ops::pad_op({7, 0}, {5, 1}, PadMode::Wrap, 0), {{3, 2}}, {kg::DType::I16},
      [](const auto& in) {
        return pad_ref(in[0], {7, 0}, {5, 1}, PadMode::Wrap, 0);
      },
      rng);
  check(
      kg::ops::pad_op({1, 2}, {0, 1}, PadMode::Constant, 0.5), {{0, 2}}, {kg::DType::F16},
      [](const auto& in) {
        return pad_ref(in[0], {1, 2}, {0, 1}, PadMode::Constant, 0.5);
      },
      rng);
  // Shape inference with a dynamic dim padded.
  EXPECT_EQ(shape_of(kg::ops::pad_op({1, 0}, {0, 0}, PadMode::Edge, 0), {{B, 3}}), "[?, 3]");
  EXPECT_EQ(shape_of(kg::ops::pad_op({2, 0}, {-2, 0}, PadMode::Constant, 0), {{B, 3}}), "[batch, 3]");
  // Through the recording function, i64 with a large constant.
  kg::Tensor x = random_any(rng, kg::DType::I64, {2, 3});
  auto out = kg_test::run_op(
      [](const kg::SymTensor& t) {
        return kg::ops::pad(t, {0, 2}, {0, 1}, PadMode::Constant, -123456789, "p");
      },
      x);
  EXPECT_TRUE(same_bytes(out, pad_ref(x, {0, 2}, {0, 1}, PadMode::Constant, -123456789)));
}

TEST(IndexPad, RejectsBadPads) {
  using kg::DType;
  expect_record_error(kg::ops::pad_op({1}, {1, 1}, PadMode::Constant, 0), {{3, 2}}, {DType::F32},
                      {"pads begin [1] and end [1, 1] have 1 and 2 entries for an input of rank 2 [3, 2]"});
  expect_record_error(kg::ops::pad_op({0, -2}, {0, -1}, PadMode::Constant, 0), {{3, 2}}, {DType::F32},
                      {"pads -2 and -1 crop dim 1 of [3, 2] (size 2) to -1 elements"});
  expect_record_error(
      kg::ops::pad_op({3, 0}, {0, 0}, PadMode::Reflect, 0), {{3, 2}}, {DType::F32},
      {"reflect padding needs each pad below the dim (pad < dim): dim 0 of [3, 2] has size 3 and is "
       "padded by 3 before and 0 after"});
  expect_record_error(kg::ops::pad_op({0, 0}, {0, 2}, PadMode::Reflect, 0), {{3, 2}}, {DType::F32},
                      {"dim 1 of [3, 2] has size 2 and is padded by 0 before and 2 after"});
  expect_record_error(kg::ops::pad_op({1, 0}, {0, 0}, PadMode::Edge, 0), {{0, 2}}, {DType::F32},
                      {"edge padding cannot fill dim 0 of [0, 2]: it is empty"});
  expect_record_error(kg::ops::pad_op({0, 0}, {1, 0}, PadMode::Wrap, 0), {{0, 2}}, {DType::F32},
                      {"wrap padding cannot fill dim 0"});
  expect_record_error(
      kg::ops::pad_op({1, 0}, {0, 0}, PadMode::Constant, 3.5), {{3, 2}}, {DType::I32},
      {"the constant pad value 3.5 is not a value of i32 (an integer in [-2147483648, 2147483647])"});
  expect_record_error(kg::ops::pad_op({1, 0}, {0, 0}, PadMode::Constant, 2), {{3, 2}}, {DType::Bool},
                      {"the constant pad value 2 is not a value of bool (0 or 1)"});
  expect_record_error(kg::ops::pad_op({1, 0}, {0, 0}, PadMode::Constant, 300), {{3, 2}}, {DType::U8},
                      {"300 is not a value of u8 (an integer in [0, 255])"});
  // Reflect against a dynamic dim: checked at load, with the size.
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("n"), 2}, "x");
  kg::Model m(g, {kg::ops::pad(x, {2, 0}, {0, 0}, PadMode::Reflect, 0, "p")});
  kg_test::expect_error(
      [&] {
        m.load(kg::Device::cpu(), {{2, 2}});
      },
      {"[index.pad @ p]", "dim 0 of [2, 2] has size 2 and is padded by 2 before"});
}

// ---- index.slice ----

TEST(IndexSlice, ShapeInferenceFollowsTheOnnxSpec) {
  // Against the spec's clamping, every combination on a dim of 10.
  const Idx bounds{kMin, -15, -10, -3, -1, 0, 2, 9, 10, 15, kMax};
  for (std::int64_t start : bounds)
    for (std::int64_t end : bounds)
      for (std::int64_t step : {kMin, std::int64_t{-7}, std::int64_t{-2}, std::int64_t{-1}, std::int64_t{1},
                                std::int64_t{3}, kMax}) {
        const auto want = static_cast<std::int64_t>(onnx_taken(10, start, end, step).size());
        EXPECT_EQ(shape_of(kg::ops::slice_axes_op({start}, {end}, {1}, {step}), {{4, 10}}),
                  kg::Shape({4, want}).to_string())
            << start << ":" << end << ":" << step;
      }
  // Worked by hand: negative steps walk backwards; a start before the beginning is clamped to 0
  // for a negative step (the spec's [0, dim-1]), so it takes one element.
  EXPECT_EQ(onnx_taken(5, kMax, kMin, -1), (Idx{4, 3, 2, 1, 0}));
  EXPECT_EQ(onnx_taken(5, -10, kMin, -1), (Idx{0}));
  EXPECT_EQ(onnx_taken(5, 3, 0, -2), (Idx{3, 1}));
  EXPECT_EQ(onnx_taken(5, -2, kMax, 1), (Idx{3, 4}));
  EXPECT_EQ(onnx_taken(0, 0, kMax, 1), Idx{});
  EXPECT_EQ(shape_of(kg::ops::slice_axes_op({0}, {kMax}, {0}, {-1}), {{0, 3}}), "[0, 3]");
}

TEST(IndexSlice, DynamicDims) {
  const kg::Dim B = kg::Dim::named("batch");
  auto sl = [&](Idx starts, Idx ends, Idx axes, Idx steps) {
    return shape_of(kg::ops::slice_axes_op(starts, ends, axes, steps), {{B, 10}});
  };
  EXPECT_EQ(sl({0}, {kMax}, {0}, {1}), "[batch, 10]");
  EXPECT_EQ(sl({kMin}, {kMax}, {0}, {1}), "[batch, 10]");
  EXPECT_EQ(sl({-1}, {kMin}, {0}, {-1}), "[batch, 10]");  // reversed whole
  EXPECT_EQ(sl({kMax}, {kMin}, {0}, {-1}), "[batch, 10]");
  EXPECT_EQ(sl({1}, {kMax}, {0}, {1}), "[?, 10]");
  EXPECT_EQ(sl({0}, {kMax}, {0}, {2}), "[?, 10]");
  EXPECT_EQ(sl({0}, {kMin}, {0}, {-1}), "[?, 10]");
  EXPECT_EQ(sl({5}, {2}, {0}, {1}), "[0, 10]");
  EXPECT_EQ(sl({2}, {5}, {0}, {-1}), "[0, 10]");
  EXPECT_EQ(sl({1, -3}, {kMax, kMax}, {-1, 0}, {2, 1}), "[?, 5]");
  EXPECT_EQ(sl({8}, {1}, {1}, {-3}), "[batch, 3]");
  EXPECT_EQ(sl({2}, {8}, {}, {}), "[?, 10]");  // axes and steps default to 0.. and 1
  EXPECT_EQ(sl({}, {}, {}, {}), "[batch, 10]");
}

TEST(IndexSlice, MatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Dim B = kg::Dim::named("batch");
  // On [batch, 6, 5, 4]: negative steps, clamped bounds, INT64_MAX / INT64_MIN ends, several
  // axes at once (negative axes among them), the dynamic batch dim sliced.
  const std::vector<SliceArgs> cases = {
      {{0}, {kMax}, {1}, {-1}},
      {{kMax}, {kMin}, {-1}, {-1}},
      {{-2, 1}, {-100, kMax}, {2, 3}, {-2, 2}},
      {{-9, 100, 3}, {9, -100, kMax}, {1, -2, 0}, {1, -1, 1}},
      {{1, 4, -1}, {kMax, 0, kMin}, {0, 1, 3}, {2, -3, -1}},
      {{2, 0}, {kMax, 3}, {}, {}},
      {{3}, {1}, {2}, {1}},  // empty
  };
  for (const SliceArgs& c : cases) {
    for (kg::DType dt : kWidths) {
      if (dt != kg::DType::F32 && &c != &cases[4]) continue;  // every case in f32, one in the others
      SCOPED_TRACE(::testing::Message()
                   << "starts " << kg::sizes_to_string(c.starts) << " ends " << kg::sizes_to_string(c.ends)
                   << " axes " << kg::sizes_to_string(c.axes) << " steps " << kg::sizes_to_string(c.steps)
                   << " " << kg::dtype_name(dt));
      check(
          kg::ops::slice_axes_op(c.starts, c.ends, c.axes, c.steps), {{B, 6, 5, 4}}, {dt},
          [&](const auto& in) { return slice_ref(in[0], c); }, rng);
    }
  }
  // Through the recording function, on i64 data.
  kg::Tensor x = random_any(rng, kg::DType::I64, {7, 5});
  const SliceArgs s{{-1, 4}, {kMin, -10}, {0, 1}, {-2, -1}};
  auto out = kg_test::run_op(
      [&](const kg::SymTensor& t) { return kg::ops::slice_axes(t, s.starts, s.ends, s.axes, s.steps, "s"); },
      x);
  EXPECT_TRUE(same_bytes(out, slice_ref(x, s)));
}

TEST(IndexSlice, RejectsBadArguments) {
  using kg::DType;
  expect_record_error(kg::ops::slice_axes_op({0, 1}, {2}, {}, {}), {{3, 2}}, {DType::F32},
                      {"starts [0, 1], ends [2], axes [] and steps [] must have the same length"});
  expect_record_error(kg::ops::slice_axes_op({0}, {2}, {0, 1}, {}), {{3, 2}}, {DType::F32},
                      {"must have the same length"});
  expect_record_error(kg::ops::slice_axes_op({0}, {2}, {0}, {0}), {{3, 2}}, {DType::F32},
                      {"steps [0] have a 0 at 0; a step is non-zero"});
  expect_record_error(kg::ops::slice_axes_op({0}, {2}, {2}, {1}), {{3, 2}}, {DType::F32},
                      {"axis 2 is out of range for rank 2"});
  expect_record_error(kg::ops::slice_axes_op({0, 0}, {2, 2}, {1, -1}, {1, 1}), {{3, 2}}, {DType::F32},
                      {"axes [1, -1] name dim 1 twice; each axis is sliced once"});
  expect_record_error(kg::ops::slice_axes_op({0}, {1}, {0}, {1}), {kg::Shape{}}, {DType::F32},
                      {"cannot slice a scalar []"});
}

// ---- index.range ----

TEST(IndexRange, DynamicLimitAndConstants) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Dim B = kg::Dim::named("batch");
  // Positions 0 .. seq of a [batch, seq] source: the output keeps the source's symbol.
  const kg::Dim S = kg::Dim::named("seq");
  EXPECT_EQ(shape_of(kg::ops::range_op(kg::DType::I64, 0, DimRef::of(0, 1), 1), {{B, S}}), "[seq]");
  EXPECT_EQ(shape_of(kg::ops::range_op(kg::DType::I64, 1, DimRef::of(0, 1), 1), {{B, S}}), "[?]");
  EXPECT_EQ(shape_of(kg::ops::range_op(kg::DType::F32, 2, DimRef::constant(11), 3), {{B}}), "[3]");
  EXPECT_EQ(shape_of(kg::ops::range_op(kg::DType::I32, 2, DimRef::constant(-5), -2), {{B}}), "[4]");
  EXPECT_EQ(shape_of(kg::ops::range_op(kg::DType::I32, 2, DimRef::constant(5), -2), {{B}}), "[0]");
  for (kg::DType dt : {kg::DType::I32, kg::DType::I64, kg::DType::F32, kg::DType::F64}) {
    SCOPED_TRACE(kg::dtype_name(dt));
    // The limit is the batch dim of the source: its data is never read.
    check(
        kg::ops::range_op(dt, 0, DimRef::of(0, 0), 1), {{B, 3}}, {kg::DType::F32},
        [dt](const auto& in) { return range_ref(dt, 0, in[0].shape()[0], 1); }, rng);
    check(
        kg::ops::range_op(dt, -7, DimRef::of(1, 0), 2), {{4}, {B, 2}}, {kg::DType::Bool, kg::DType::I64},
        [dt](const auto& in) { return range_ref(dt, -7, in[1].shape()[0], 2); }, rng);
    check(
        kg::ops::range_op(dt, 20, DimRef::constant(-3), -3), {{2}}, {kg::DType::F32},
        [dt](const auto&) { return range_ref(dt, 20, -3, -3); }, rng);
  }
  // Through the recording function: positions for a batch of sequences.
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {B, S}, "x");
  auto pos = kg::ops::range(kg::DType::I64, 0, DimRef::of(0, 1), 1, {x}, "pos");
  EXPECT_EQ(pos.dtype(), kg::DType::I64);
  kg::Model m(g, {pos});
  const kg::Tensor got =
      m.load(kg::Device::cpu(), {{2, 6}}).forward({random_any(rng, kg::DType::F32, {2, 6})})[0];
  EXPECT_TRUE(same_bytes(got, range_ref(kg::DType::I64, 0, 6, 1)));
}

TEST(IndexRange, RejectsBadArguments) {
  using kg::DType;
  expect_record_error(kg::ops::range_op(DType::I64, 0, DimRef::constant(5), 0), {{2}}, {DType::F32},
                      {"delta must be non-zero, got 0"});
  expect_record_error(kg::ops::range_op(DType::BF16, 0, DimRef::constant(5), 1), {{2}}, {DType::F32},
                      {"supports i32, i64, f32 and f64, got bf16"});
  expect_record_error(kg::ops::range_op(DType::I32, 2147483640, DimRef::constant(2147483660), 5), {{2}},
                      {DType::F32},
                      {"the i32 range from 2147483640 in steps of 5 (4 values) leaves the i32 range "
                       "[-2147483648, 2147483647]"});
  expect_record_error(kg::ops::range_op(DType::I64, 0, DimRef::of(1, 0), 1), {{2}}, {DType::F32},
                      {"a size refers to input 1 but the op has 1 inputs"});
  expect_record_error(kg::ops::range_op(DType::I64, kMin, DimRef::constant(kMax), 1), {{2}}, {DType::F32},
                      {"has more than 2^63 elements"});
  kg_test::expect_error([] { kg::ops::range(DType::I64, 0, DimRef::constant(3), 1, {}); },
                        {"[index.range] needs at least one source tensor"});
}

// ---- index.constant_of_shape ----

TEST(IndexConstantOfShape, FillsEveryDtype) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Dim B = kg::Dim::named("batch");
  const std::vector<DimRef> shape{DimRef::of(0, 0), DimRef::constant(3), DimRef::of(1, 1)};
  EXPECT_EQ(shape_of(kg::ops::constant_of_shape_op(shape, kg::DType::I64, 7), {{B, 2}, {4, 5}}),
            "[batch, 3, 5]");
  for (kg::DType dt : kEveryDtype) {
    const double value = dt == kg::DType::Bool ? 1
                         : kg::is_floating(dt) ? -2.5
                         : dt == kg::DType::U8 ? 7
                                               : -7;
    SCOPED_TRACE(kg::dtype_name(dt));
    check(
        kg::ops::constant_of_shape_op(shape, dt, value), {{B, 2}, {4, 5}}, {kg::DType::F32, kg::DType::I32},
        [&](const auto& in) {
          return build_ref(
              dt, {in[0].shape()[0], 3, 5}, nullptr, [](const Idx&) { return std::nullopt; }, value);
        },
        rng);
  }
  // A scalar, and through the recording function.
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {B, 2}, "x");
  auto zeros = kg::ops::constant_of_shape({}, {x}, kg::DType::F64, 0.25, "c");
  EXPECT_EQ(zeros.shape().to_string(), "[]");
  EXPECT_EQ(zeros.dtype(), kg::DType::F64);
  kg::Model m(g, {zeros});
  EXPECT_EQ(
      m.load(kg::Device::cpu(), {{3, 2}}).forward({kg::Tensor::zeros(kg::DType::F32, {3, 2})})[0].item(0),
      0.25);
}

TEST(IndexConstantOfShape, RejectsBadArguments) {
  using kg::DType;
  expect_record_error(
      kg::ops::constant_of_shape_op({DimRef::constant(2), DimRef::constant(-1)}, DType::F32, 0), {{2}},
      {DType::F32}, {"shape [2, -1] has a negative size -1 at 1"});
  expect_record_error(kg::ops::constant_of_shape_op({DimRef::constant(2)}, DType::I8, 200), {{2}},
                      {DType::F32}, {"value 200 is not a value of i8 (an integer in [-128, 127])"});
  expect_record_error(kg::ops::constant_of_shape_op({DimRef::of(0, 1)}, DType::F32, 0), {{2}}, {DType::F32},
                      {"a size refers to dim 1 of input 0 [2], which has rank 1"});
  kg_test::expect_error([] { kg::ops::constant_of_shape({DimRef::constant(3)}, {}, DType::F32, 1); },
                        {"[index.constant_of_shape] needs at least one source tensor"});
}

// ---- index.shape ----

TEST(IndexShapeTensor, SizesOfItsSources) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Dim B = kg::Dim::named("batch");
  const std::vector<DimRef> dims{DimRef::of(0, 0), DimRef::of(0, 2), DimRef::constant(5), DimRef::of(1, 0)};
  EXPECT_EQ(shape_of(kg::ops::shape_tensor_op(dims), {{B, 2, 3}, {7}}), "[4]");
  auto values_of = [](const std::vector<DimRef>& d, const std::vector<kg::Tensor>& in) {
    std::vector<std::int64_t> v;
    for (const DimRef& r : d)
      v.push_back(r.is_constant()
                      ? r.value
                      : in[static_cast<std::size_t>(r.input)].shape()[static_cast<std::size_t>(r.axis)]);
    return kg::Tensor::from_vector<std::int64_t>({static_cast<std::int64_t>(v.size())}, v);
  };
  check(
      kg::ops::shape_tensor_op(dims), {{B, 2, 3}, {7}}, {kg::DType::F16, kg::DType::Bool},
      [&](const auto& in) { return values_of(dims, in); }, rng);
  // More sizes than one launch writes (8), and none at all.
  std::vector<DimRef> many;
  for (int i = 0; i < 19; ++i) many.push_back(i % 3 == 0 ? DimRef::of(0, i % 2) : DimRef::constant(100 + i));
  check(
      kg::ops::shape_tensor_op(many), {{B, 6}}, {kg::DType::I64},
      [&](const auto& in) { return values_of(many, in); }, rng);
  check(
      kg::ops::shape_tensor_op({}), {{B}}, {kg::DType::F32},
      [&](const auto& in) { return values_of({}, in); }, rng);
  // Through the recording function.
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {B, 3}, "x");
  auto s = kg::ops::shape_tensor({DimRef::of(0, 0), DimRef::of(0, 1)}, {x}, "shape");
  EXPECT_EQ(s.dtype(), kg::DType::I64);
  EXPECT_EQ(s.shape().to_string(), "[2]");
  kg::Model m(g, {s});
  const kg::Tensor got =
      m.load(kg::Device::cpu(), {{5, 3}}).forward({kg::Tensor::zeros(kg::DType::F32, {5, 3})})[0];
  EXPECT_TRUE(same_bytes(got, kg::Tensor::from_vector<std::int64_t>({2}, {5, 3})));
  expect_record_error(kg::ops::shape_tensor_op({DimRef::of(0, 4)}), {{2}}, {kg::DType::F32},
                      {"a size refers to dim 4 of input 0 [2], which has rank 1"});
  expect_record_error(kg::ops::shape_tensor_op({DimRef::constant(-2)}), {{2}}, {kg::DType::F32},
                      {"dims [-2] has a negative size -2 at 0"});
  kg_test::expect_error([] { kg::ops::shape_tensor({DimRef::constant(3)}, {}); },
                        {"[index.shape] needs at least one source tensor"});
}

// Ops whose inputs are shape sources only never read them: given inputs without data, they run.
TEST(IndexOps, ShapeSourcesAreNotRead) {
  const std::vector<kg::Tensor> in{kg::Tensor::wrap(nullptr, kg::DType::F32, {3, 4}),
                                   kg::Tensor::wrap(nullptr, kg::DType::I64, {2})};
  auto run = [&](const kg::CustomData& op, kg::DType dt, Idx shape) {
    kg::Tensor out = kg::Tensor::zeros(dt, shape);
    kg::CpuContext ctx(in, {}, out, false, 0);
    op->cpu_forward(ctx);
    return out;
  };
  EXPECT_TRUE(same_bytes(run(kg::ops::range_op(kg::DType::I64, 0, DimRef::of(0, 1), 1), kg::DType::I64, {4}),
                         range_ref(kg::DType::I64, 0, 4, 1)));
  EXPECT_EQ(
      run(kg::ops::constant_of_shape_op({DimRef::of(1, 0)}, kg::DType::F32, 2), kg::DType::F32, {2}).item(1),
      2);
  EXPECT_TRUE(
      same_bytes(run(kg::ops::shape_tensor_op({DimRef::of(0, 1), DimRef::of(1, 0)}), kg::DType::I64, {2}),
                 kg::Tensor::from_vector<std::int64_t>({2}, {4, 2})));
  // Their dtype is their own, whatever the sources'.
  EXPECT_EQ(kg::ops::range_op(kg::DType::F64, 0, DimRef::constant(2), 1)->infer_output_dtype({kg::DType::I8}),
            kg::DType::F64);
  EXPECT_EQ(kg::ops::constant_of_shape_op({}, kg::DType::Bool, 1)->infer_output_dtype({kg::DType::F32}),
            kg::DType::Bool);
  EXPECT_EQ(kg::ops::shape_tensor_op({})->infer_output_dtype({kg::DType::F32}), kg::DType::I64);
}

// ---- the GPU lowering ----

// Every op of the family in one graph: compiled with NVRTC for sm_90 where NVRTC is present, its
// launches checked against the kernels' signatures, emulated against the CPU, and run on a GPU
// where there is one.
TEST(IndexOps, GpuLoweringCompilesAndMatchesTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t batch : {1, 5}) {
    SCOPED_TRACE(batch);
    kg::Tensor x = random_any(rng, kg::DType::F32, {batch, 4, 3});
    kg::Tensor idx = random_indices(rng, kg::DType::I64, {batch, 2, 3}, -4, 3);
    kg_test::check_lowering(
        [](const std::vector<kg::SymTensor>& in) {
          const auto& x = in[0];
          return std::vector<kg::SymTensor>{
              kg::ops::gather(x, in[1], 1),
              kg::ops::gather_elements(x, in[1], 1),
              kg::ops::expand(kg::ops::slice_axes(x, {0}, {1}, {0}, {1}),
                              {DimRef::of(1, 0), DimRef::constant(4), DimRef::constant(3)}, {x}),
              kg::ops::tile(x, {1, 2, 2}),
              kg::ops::pad(x, {0, 2, 1}, {0, -1, 2}, PadMode::Reflect, 0),
              kg::ops::pad(x, {0, 1, 1}, {0, 1, 1}, PadMode::Constant, 9),
              kg::ops::slice_axes(x, {kMax, 1}, {kMin, kMax}, {1, 2}, {-1, 2}),
              kg::ops::range(kg::DType::F32, 3, DimRef::of(0, 0), -1, {x}),
              kg::ops::constant_of_shape({DimRef::of(0, 0), DimRef::constant(2)}, {x}, kg::DType::F64, 1.5),
              kg::ops::shape_tensor({DimRef::of(0, 0), DimRef::of(0, 2)}, {x}),
          };
        },
        {x, idx}, 0, 0);
  }
}

// More dims than one launch of the index map or gather_elements kernels takes (8, after
// merging): one launch per index of the leading dims, each writing its block of the output.
TEST(IndexOps, ManyDimsTakeSeveralLaunches) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // Every dim of [2]*9 padded by edge: nothing merges, 3 launches of [3]*8.
  const Idx shape(9, 2), begin(9, 1), end(9, 0);
  kg::Tensor x = random_any(rng, kg::DType::F32, shape);
  const auto edge = kg::ops::pad_op(begin, end, PadMode::Edge, 0);
  const kg::Tensor want = pad_ref(x, begin, end, PadMode::Edge, 0);
  EXPECT_TRUE(same_bytes(run_cpu(edge, {x}), want));
  EXPECT_TRUE(same_bytes(run_emulated(edge, {x}), want));
  // A constant pad of [1]*10 to [2]*10: 4 launches, 3 of them wholly the constant.
  kg::Tensor ones = random_any(rng, kg::DType::I64, Idx(10, 1));
  const auto cpad = kg::ops::pad_op(Idx(10, 1), Idx(10, 0), PadMode::Constant, 5);
  EXPECT_TRUE(
      same_bytes(run_emulated(cpad, {ones}), pad_ref(ones, Idx(10, 1), Idx(10, 0), PadMode::Constant, 5)));
  check(
      cpad, {kg::Shape::of(Idx(10, 1))}, {kg::DType::U8},
      [](const auto& in) { return pad_ref(in[0], Idx(10, 1), Idx(10, 0), PadMode::Constant, 5); }, rng);
  // gather_elements on 9 dims whose indices are smaller than the data in every dim (nothing
  // merges), gathering along a leading dim and along the last.
  kg::Tensor data = random_any(rng, kg::DType::F64, Idx(9, 3));
  for (std::int64_t axis : {0, 8}) {
    SCOPED_TRACE(axis);
    kg::Tensor idx = random_indices(rng, kg::DType::I32, Idx(9, 2), -3, 2);
    const auto op = kg::ops::gather_elements_op(axis);
    EXPECT_TRUE(same_bytes(run_emulated(op, {data, idx}), gather_elements_ref(data, idx, axis)));
    EXPECT_TRUE(same_bytes(run_cpu(op, {data, idx}), gather_elements_ref(data, idx, axis)));
  }
}
