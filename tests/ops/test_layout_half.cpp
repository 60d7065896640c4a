// Pooling and the data-movement ops computing in f16 and bf16: each op recorded on 16-bit inputs
// (fresh random values, rounded to the dtype), run on the CPU with poisoned buffers (every output
// element must be written) and compared with naive loops written here; then check_lowering (the
// kernels dry-run, run under the emulator in checked mode against the CPU, and on a GPU where
// there is one). Max pooling and every copy must be bit-exact; the averages must lie within one
// unit in the last place of the dtype (2^-10 relative for f16, 2^-7 for bf16) plus 1e-6 for the
// f32 sum's own rounding where values cancel, as each is summed in f32 and rounded once. Also
// which ops declare CustomOp::computes_in, the error of a 16-bit pool's backward in a training
// model, and the errors of mixed dtypes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "kg/runtime_op.hpp"
#include "ops/index_ops.hpp"
#include "ops/shape_ops.hpp"
#include "ops/view.hpp"
#include "support/gpu_util.hpp"
#include "support/test_util.hpp"

using kg::DType;
using kg::SymTensor;
using kg::Tensor;
using kg_test::fresh_seed;

namespace {

using Sizes = std::vector<std::int64_t>;
using Build = std::function<std::vector<SymTensor>(const std::vector<SymTensor>&)>;

const DType kHalves[] = {DType::F16, DType::BF16};

// The tolerance of an average in `dt` (see the file comment).
double ulp_rel(DType dt) { return dt == DType::F16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7); }
constexpr double kSumAtol = 1e-6;

// Random values of a 16-bit dtype in [lo, hi), rounded to it.
Tensor random_half(std::mt19937_64& rng, DType dt, const Sizes& shape, double lo = -1, double hi = 1) {
  return kg_test::random_tensor(rng, dt, shape, lo, hi);
}

// The stored 16-bit patterns of a tensor.
std::vector<std::uint16_t> bits_of(const Tensor& t) {
  std::vector<std::uint16_t> b(static_cast<std::size_t>(t.numel()));
  if (!b.empty()) std::memcpy(b.data(), t.raw(), b.size() * sizeof(std::uint16_t));
  return b;
}

::testing::AssertionResult same_bits(const Tensor& got, DType dt, const Sizes& shape,
                                     const std::vector<std::uint16_t>& want) {
  if (got.dtype() != dt)
    return ::testing::AssertionFailure()
           << "dtype " << kg::dtype_name(got.dtype()) << ", want " << kg::dtype_name(dt);
  if (got.shape() != shape)
    return ::testing::AssertionFailure()
           << "shape " << kg::sizes_to_string(got.shape()) << ", want " << kg::sizes_to_string(shape);
  const std::vector<std::uint16_t> g = bits_of(got);
  if (g.size() != want.size())
    return ::testing::AssertionFailure() << g.size() << " elements, want " << want.size();
  for (std::size_t i = 0; i < g.size(); ++i)
    if (g[i] != want[i])
      return ::testing::AssertionFailure()
             << "element " << i << ": bits 0x" << std::hex << g[i] << ", want 0x" << want[i];
  return ::testing::AssertionSuccess();
}

Sizes strides(const Sizes& shape) {
  Sizes s(shape.size());
  std::int64_t st = 1;
  for (std::size_t d = shape.size(); d-- > 0;) {
    s[d] = st;
    st *= shape[d];
  }
  return s;
}
Sizes unflatten(std::int64_t flat, const Sizes& shape) {
  Sizes idx(shape.size(), 0);
  for (std::size_t d = shape.size(); d-- > 0;) {
    idx[d] = flat % shape[d];
    flat /= shape[d];
  }
  return idx;
}

// Runs `build` on the CPU with poisoned buffers (every element must be written), then through
// check_lowering at the given tolerance (0: bit-exact values); returns the CPU outputs.
std::vector<Tensor> run_both(const Build& build, const std::vector<Tensor>& inputs, double rtol = 0,
                             double atol = 0) {
  std::vector<Tensor> out = kg_test::run_graph(build, inputs);
  kg_test::check_lowering(build, inputs, rtol, atol);
  return out;
}
Tensor run_one(const std::function<SymTensor(const SymTensor&)>& build, const Tensor& x, double rtol = 0,
               double atol = 0) {
  return run_both([&](const std::vector<SymTensor>& xs) { return std::vector<SymTensor>{build(xs[0])}; }, {x},
                  rtol, atol)[0];
}

// ---- pooling ----

struct PoolCase {
  std::string name;
  Sizes shape;
  std::int64_t kh, kw, sh, sw, ph, pw, dh, dw;
  bool ceil_mode, count_include_pad;
};

const PoolCase kPoolCases[] = {
    {"2x2 s2", {2, 3, 8, 10}, 2, 2, 2, 2, 0, 0, 1, 1, false, true},
    {"3x3 s2 p1", {1, 2, 9, 8}, 3, 3, 2, 2, 1, 1, 1, 1, false, true},
    {"3x3 s2 p1 exclude pad ceil", {2, 2, 9, 8}, 3, 3, 2, 2, 1, 1, 1, 1, true, false},
    {"3x3 s1 overlapping", {1, 3, 6, 7}, 3, 3, 1, 1, 0, 0, 1, 1, false, true},
    {"2x3 rectangular ceil", {1, 2, 7, 6}, 2, 3, 2, 2, 1, 0, 1, 1, true, true},
};

// Output size as PyTorch documents it.
std::int64_t pool_out(std::int64_t in, std::int64_t k, std::int64_t s, std::int64_t p, std::int64_t d,
                      bool ceil) {
  const double span = static_cast<double>(in + 2 * p - d * (k - 1) - 1) / static_cast<double>(s);
  auto out = static_cast<std::int64_t>(ceil ? std::ceil(span) : std::floor(span)) + 1;
  if (ceil && (out - 1) * s >= in + p) --out;
  return out;
}

// The max (NaN wins) or average of each window, in double, from the input's values.
std::vector<double> naive_pool(const Tensor& x, const PoolCase& c, bool max, Sizes* out_shape) {
  const std::int64_t n = x.dim(0), ch = x.dim(1), h = x.dim(2), w = x.dim(3);
  const std::int64_t ho = pool_out(h, c.kh, c.sh, c.ph, c.dh, c.ceil_mode);
  const std::int64_t wo = pool_out(w, c.kw, c.sw, c.pw, c.dw, c.ceil_mode);
  *out_shape = {n, ch, ho, wo};
  std::vector<double> y;
  for (std::int64_t pl = 0; pl < n * ch; ++pl)
    for (std::int64_t i = 0; i < ho; ++i)
      for (std::int64_t j = 0; j < wo; ++j) {
        double best = -std::numeric_limits<double>::infinity(), sum = 0;
        bool nan = false;
        std::int64_t inside = 0, padded = 0;
        for (std::int64_t ky = 0; ky < c.kh; ++ky)
          for (std::int64_t kx = 0; kx < c.kw; ++kx) {
            const std::int64_t iy = i * c.sh - c.ph + ky * c.dh, ix = j * c.sw - c.pw + kx * c.dw;
            if (iy < h + c.ph && ix < w + c.pw) ++padded;
            if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;
            const double v = x.item((pl * h + iy) * w + ix);
            nan = nan || std::isnan(v);
            best = std::max(best, v);
            sum += v;
            ++inside;
          }
        if (max)
          y.push_back(nan ? std::numeric_limits<double>::quiet_NaN() : best);
        else
          y.push_back(sum / static_cast<double>(c.count_include_pad ? padded : inside));
      }
  return y;
}

SymTensor record_pool(const SymTensor& x, const PoolCase& c, bool max) {
  if (max)
    return kg::max_pool2d(x, {c.kh, c.kw}, {c.sh, c.sw}, {c.ph, c.pw}, {c.dh, c.dw}, c.ceil_mode, "pool");
  return kg::avg_pool2d(x, {c.kh, c.kw}, {c.sh, c.sw}, {c.ph, c.pw}, c.ceil_mode, c.count_include_pad,
                        "pool");
}

TEST(LayoutHalf, MaxPool2dIsExact) {
  std::mt19937_64 rng(fresh_seed());
  for (DType dt : kHalves)
    for (const PoolCase& c : kPoolCases) {
      SCOPED_TRACE(std::string(kg::dtype_name(dt)) + " " + c.name);
      const Tensor x = random_half(rng, dt, c.shape, -4, 4);
      const Tensor y = run_one([&](const SymTensor& t) { return record_pool(t, c, true); }, x);
      Sizes shape;
      const std::vector<double> want = naive_pool(x, c, true, &shape);
      ASSERT_EQ(y.dtype(), dt);
      ASSERT_EQ(y.shape(), shape);
      for (std::int64_t i = 0; i < y.numel(); ++i)
        ASSERT_EQ(y.item(i), want[static_cast<std::size_t>(i)]) << "element " << i;
    }
}

TEST(LayoutHalf, MaxPool2dPropagatesNaN) {
  std::mt19937_64 rng(fresh_seed());
  const PoolCase c{"3x3 s2 p1", {1, 2, 9, 8}, 3, 3, 2, 2, 1, 1, 1, 1, false, true};
  for (DType dt : kHalves) {
    SCOPED_TRACE(kg::dtype_name(dt));
    Tensor x = random_half(rng, dt, c.shape);
    // A quiet NaN (not the poison's all-ones pattern) at a few places.
    const std::uint16_t qnan = dt == DType::F16 ? 0x7e00 : 0x7fc0;
    for (std::int64_t at : {0, 13, 77, 143}) static_cast<std::uint16_t*>(x.raw())[at] = qnan;
    auto build = [&](const std::vector<SymTensor>& xs) {
      return std::vector<SymTensor>{record_pool(xs[0], c, true)};
    };
    const Tensor y = kg_test::run_graph(build, {x}, {}, true, /*check_written=*/false)[0];
    std::vector<Tensor> outputs{y};
    if (!kg::Device::cuda_available()) {
      kg_test::check_lowering(build, {x}, 0, 0);
    } else {
      // check_lowering's all-written check reads a NaN output as unwritten, so the GPU's output is
      // checked below like the CPU's, element by element.
      auto graph = kg::Graph::create();
      const SymTensor in = graph->input(dt, kg::Shape::of(x.shape()), "x");
      kg::Model model(graph, build({in}));
      outputs.push_back(model.load(kg::Device::cuda(), {x.shape()}).forward({x})[0]);
    }
    Sizes shape;
    const std::vector<double> want = naive_pool(x, c, true, &shape);
    for (const Tensor& got : outputs) {
      ASSERT_EQ(got.shape(), shape);
      int nans = 0;
      for (std::int64_t i = 0; i < got.numel(); ++i) {
        const double w = want[static_cast<std::size_t>(i)];
        EXPECT_NE(bits_of(got)[static_cast<std::size_t>(i)], 0xFFFF) << "element " << i << " left unwritten";
        if (std::isnan(w)) {
          ++nans;
          EXPECT_TRUE(std::isnan(got.item(i))) << "element " << i;
        } else {
          EXPECT_EQ(got.item(i), w) << "element " << i;
        }
      }
      EXPECT_GT(nans, 0);
    }
  }
}

TEST(LayoutHalf, AvgPool2dWithinOneUlp) {
  std::mt19937_64 rng(fresh_seed());
  for (DType dt : kHalves)
    for (const PoolCase& c : kPoolCases) {
      SCOPED_TRACE(std::string(kg::dtype_name(dt)) + " " + c.name);
      const Tensor x = random_half(rng, dt, c.shape);
      const Tensor y =
          run_one([&](const SymTensor& t) { return record_pool(t, c, false); }, x, ulp_rel(dt), kSumAtol);
      Sizes shape;
      const std::vector<double> want = naive_pool(x, c, false, &shape);
      ASSERT_EQ(y.dtype(), dt);
      ASSERT_EQ(y.shape(), shape);
      EXPECT_TRUE(kg_test::matches(y, want, ulp_rel(dt), kSumAtol));
    }
}

TEST(LayoutHalf, GlobalAvgPoolWithinOneUlp) {
  std::mt19937_64 rng(fresh_seed());
  // Planes smaller than a warp, of several warps, and one with a ragged last step.
  const Sizes shapes[] = {{2, 3, 4, 5}, {1, 4, 14, 14}, {3, 2, 7, 9}};
  for (DType dt : kHalves)
    for (const Sizes& s : shapes) {
      SCOPED_TRACE(std::string(kg::dtype_name(dt)) + " " + kg::sizes_to_string(s));
      // Positive values: the mean keeps its magnitude, so the relative bound is the tight one.
      const Tensor x = random_half(rng, dt, s, 0.25, 4);
      const Tensor y =
          run_one([](const SymTensor& t) { return kg::global_avg_pool(t, "gap"); }, x, ulp_rel(dt), kSumAtol);
      const std::int64_t hw = s[2] * s[3];
      std::vector<double> want;
      for (std::int64_t pl = 0; pl < s[0] * s[1]; ++pl) {
        double sum = 0;
        for (std::int64_t k = 0; k < hw; ++k) sum += x.item(pl * hw + k);
        want.push_back(sum / static_cast<double>(hw));
      }
      ASSERT_EQ(y.shape(), (Sizes{s[0], s[1], 1, 1}));
      EXPECT_TRUE(kg_test::matches(y, want, ulp_rel(dt), kSumAtol));
    }
}

TEST(LayoutHalf, UpsampleNearest2dIsBitExact) {
  std::mt19937_64 rng(fresh_seed());
  const kg::Size2 scales[] = {kg::Size2(2), kg::Size2(2, 3)};
  for (DType dt : kHalves)
    for (kg::Size2 sc : scales) {
      SCOPED_TRACE(std::string(kg::dtype_name(dt)) + " scale " + std::to_string(sc.h) + "x" +
                   std::to_string(sc.w));
      const Sizes s{2, 3, 3, 4};
      const Tensor x = random_half(rng, dt, s);
      const Tensor y = run_one([&](const SymTensor& t) { return kg::upsample_nearest2d(t, sc, "up"); }, x);
      const Sizes os{s[0], s[1], s[2] * sc.h, s[3] * sc.w};
      const std::vector<std::uint16_t> xb = bits_of(x);
      std::vector<std::uint16_t> want;
      for (std::int64_t i = 0; i < kg::numel_of(os); ++i) {
        const Sizes o = unflatten(i, os);
        want.push_back(
            xb[static_cast<std::size_t>(((o[0] * s[1] + o[1]) * s[2] + o[2] / sc.h) * s[3] + o[3] / sc.w)]);
      }
      EXPECT_TRUE(same_bits(y, dt, os, want));
    }
}

// ---- views and copies ----

TEST(LayoutHalf, ViewsAreBitExact) {
  std::mt19937_64 rng(fresh_seed());
  for (DType dt : kHalves) {
    SCOPED_TRACE(kg::dtype_name(dt));
    const Sizes s{2, 3, 4, 5};
    const Tensor x = random_half(rng, dt, s);
    const std::vector<std::uint16_t> xb = bits_of(x);
    // Each view as an output, and once more feeding a copy (a slice taking everything), so that
    // a consumer reads the input's bytes through it.
    const auto outs = run_both(
        [](const std::vector<SymTensor>& xs) {
          const SymTensor f = kg::flatten(xs[0], 1, -1, "flat");
          const SymTensor r = kg::reshape(xs[0], {0, 12, -1}, "reshape");
          const SymTensor v =
              kg::ops::view(xs[0], {kg::ops::DimRef::of(0, 0), kg::ops::DimRef::constant(-1)}, {}, "view");
          return std::vector<SymTensor>{f, r, v, kg::slice(r, 1, 0, 12, 1, "after")};
        },
        {x});
    ASSERT_EQ(outs.size(), 4u);
    EXPECT_TRUE(same_bits(outs[0], dt, {2, 60}, xb));
    EXPECT_TRUE(same_bits(outs[1], dt, {2, 12, 5}, xb));
    EXPECT_TRUE(same_bits(outs[2], dt, {2, 60}, xb));
    EXPECT_TRUE(same_bits(outs[3], dt, {2, 12, 5}, xb));
  }
}

TEST(LayoutHalf, PermuteIsBitExact) {
  std::mt19937_64 rng(fresh_seed());
  struct Case {
    Sizes shape, perm;
  };
  // A gather, NCHW to NHWC and back, and transposes long enough for the tiled kernel path.
  const Case cases[] = {{{2, 3, 4, 5}, {0, 2, 3, 1}},
                        {{2, 5, 3, 4}, {0, 3, 1, 2}},
                        {{2, 3, 4, 5}, {3, 1, 0, 2}},
                        {{2, 20, 33}, {0, 2, 1}},
                        {{3, 17, 2, 18}, {0, 3, 2, 1}}};
  for (DType dt : kHalves)
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(kg::dtype_name(dt)) + " " + kg::sizes_to_string(c.shape) + " perm " +
                   kg::sizes_to_string(c.perm));
      const Tensor x = random_half(rng, dt, c.shape);
      const Tensor y = run_one([&](const SymTensor& t) { return kg::permute(t, c.perm, "perm"); }, x);
      Sizes os;
      for (std::int64_t d : c.perm) os.push_back(c.shape[static_cast<std::size_t>(d)]);
      const Sizes st = strides(c.shape);
      const std::vector<std::uint16_t> xb = bits_of(x);
      std::vector<std::uint16_t> want;
      for (std::int64_t i = 0; i < kg::numel_of(os); ++i) {
        const Sizes o = unflatten(i, os);
        std::int64_t off = 0;
        for (std::size_t d = 0; d < o.size(); ++d) off += o[d] * st[static_cast<std::size_t>(c.perm[d])];
        want.push_back(xb[static_cast<std::size_t>(off)]);
      }
      EXPECT_TRUE(same_bits(y, dt, os, want));
    }
  // transpose() records the same op.
  const Tensor x = random_half(rng, DType::F16, {2, 3, 4});
  const Tensor y = run_one([](const SymTensor& t) { return kg::transpose(t, 1, 2, "t"); }, x);
  std::vector<std::uint16_t> want;
  const std::vector<std::uint16_t> xb = bits_of(x);
  for (std::int64_t a = 0; a < 2; ++a)
    for (std::int64_t c = 0; c < 4; ++c)
      for (std::int64_t b = 0; b < 3; ++b) want.push_back(xb[static_cast<std::size_t>((a * 3 + b) * 4 + c)]);
  EXPECT_TRUE(same_bits(y, DType::F16, {2, 4, 3}, want));
}

// nn.permute converting its elements as it copies (the channels-last pass folds a cast into it):
// f32 to bf16 and f16, and back, and between the 16-bit types, on the gather and the tiled
// paths; against a naive permute of the input followed by the tensor's own conversion. Every
// output bit must match (each element is rounded once). Then its errors: a dtype it does not
// convert, and the backward it does not have.
TEST(LayoutHalf, ConvertingPermuteRoundsEachElementOnce) {
  std::mt19937_64 rng(fresh_seed());
  const std::pair<DType, DType> pairs[] = {{DType::F32, DType::BF16},
                                           {DType::F32, DType::F16},
                                           {DType::BF16, DType::F32},
                                           {DType::F16, DType::BF16}};
  struct Case {
    Sizes shape, perm;
  };
  // The rows path (NCHW → NHWC with few channels; a row of 15), the tiled path and the gather path.
  const Case cases[] = {{{2, 3, 4, 5}, {0, 2, 3, 1}}, {{2, 5, 3, 4}, {0, 3, 1, 2}}, {{2, 15, 40}, {0, 2, 1}},
                        {{3, 17, 2, 18}, {0, 3, 2, 1}}, {{4, 3, 5}, {2, 1, 0}}};
  for (const auto& [from, to] : pairs)
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(kg::dtype_name(from)) + " to " + std::string(kg::dtype_name(to)) + " " +
                   kg::sizes_to_string(c.shape) + " perm " + kg::sizes_to_string(c.perm));
      // Values with more bits than bf16 keeps, and a few of f16's subnormals.
      Tensor x = kg_test::random_tensor(rng, from, c.shape, -3, 3);
      if (from == DType::F32)
        for (std::int64_t i = 0; i < x.numel(); i += 7) x.data<float>()[i] *= 1e-6f;
      const Tensor y = run_one(
          [&](const SymTensor& t) {
            return t.record_custom(kg::ops::permute_op(c.perm, to), {}, std::nullopt, "perm");
          },
          x);
      Sizes os;
      for (std::int64_t d : c.perm) os.push_back(c.shape[static_cast<std::size_t>(d)]);
      Tensor permuted = Tensor::empty(from, os);
      const Sizes st = strides(c.shape);
      const std::size_t w = kg::dtype_size(from);
      for (std::int64_t i = 0; i < kg::numel_of(os); ++i) {
        const Sizes o = unflatten(i, os);
        std::int64_t off = 0;
        for (std::size_t d = 0; d < o.size(); ++d) off += o[d] * st[static_cast<std::size_t>(c.perm[d])];
        std::memcpy(static_cast<char*>(permuted.raw()) + i * w, static_cast<const char*>(x.raw()) + off * w, w);
      }
      const Tensor want = permuted.to(to);
      ASSERT_EQ(y.dtype(), to);
      ASSERT_EQ(y.shape(), os);
      EXPECT_EQ(std::memcmp(y.raw(), want.raw(), want.nbytes()), 0);
    }
  kg_test::expect_error([] { kg::ops::permute_op({0, 1}, DType::I32); }, {"nn.permute", "i32"});
  auto g = kg::Graph::create();
  const SymTensor i = g->input(DType::I64, kg::Shape::of({2, 3}), "i");
  kg_test::expect_error([&] { i.record_custom(kg::ops::permute_op({1, 0}, DType::BF16), {}, std::nullopt, "p"); },
                        {"nn.permute", "i64", "bf16"});
  // No backward: the lowered op has no backward source, the CPU none either.
  const kg::CustomData op = kg::ops::permute_op({1, 0}, DType::BF16);
  EXPECT_FALSE(op->has_cpu_backward());
  kg::LowerContext lc;
  lc.input_dtypes = {DType::F32};
  lc.output_dtype = DType::BF16;
  EXPECT_TRUE(op->lower_backward_source(lc).empty());
}

// Concatenation along `dim` by naive loops: output index i takes input k's element at the same
// index with dim shifted by the sizes before it.
std::vector<std::uint16_t> naive_concat(const std::vector<Tensor>& xs, std::size_t dim, Sizes* out_shape) {
  Sizes os = xs[0].shape();
  os[dim] = 0;
  for (const Tensor& t : xs) os[dim] += t.shape()[dim];
  *out_shape = os;
  std::vector<std::uint16_t> want;
  for (std::int64_t i = 0; i < kg::numel_of(os); ++i) {
    Sizes o = unflatten(i, os);
    std::size_t k = 0;
    while (o[dim] >= xs[k].shape()[dim]) o[dim] -= xs[k++].shape()[dim];
    const Sizes st = strides(xs[k].shape());
    std::int64_t off = 0;
    for (std::size_t d = 0; d < o.size(); ++d) off += o[d] * st[d];
    want.push_back(bits_of(xs[k])[static_cast<std::size_t>(off)]);
  }
  return want;
}

TEST(LayoutHalf, ConcatIsBitExact) {
  std::mt19937_64 rng(fresh_seed());
  for (DType dt : kHalves) {
    SCOPED_TRACE(kg::dtype_name(dt));
    // Three inputs along the channels (one empty), and 18 along the last dim: two launches.
    std::vector<Tensor> a{random_half(rng, dt, {2, 3, 4}), random_half(rng, dt, {2, 0, 4}),
                          random_half(rng, dt, {2, 5, 4})};
    std::vector<Tensor> b;
    for (int k = 0; k < 18; ++k) b.push_back(random_half(rng, dt, {2, 3, 1 + k % 3}));
    for (const auto& [xs, dim] : {std::pair{a, std::size_t{1}}, std::pair{b, std::size_t{2}}}) {
      SCOPED_TRACE(std::to_string(xs.size()) + " inputs");
      const Tensor y = run_both(
          [&, dim = dim](const std::vector<SymTensor>& ts) {
            return std::vector<SymTensor>{kg::concat(ts, static_cast<std::int64_t>(dim), "cat")};
          },
          xs)[0];
      Sizes os;
      const std::vector<std::uint16_t> want = naive_concat(xs, dim, &os);
      EXPECT_TRUE(same_bits(y, dt, os, want));
    }
  }
}

TEST(LayoutHalf, SliceIsBitExact) {
  std::mt19937_64 rng(fresh_seed());
  struct Case {
    std::int64_t dim, start, end, step;
  };
  // A contiguous run, strided rows, strided single elements, and negative bounds.
  const Case cases[] = {{1, 1, 4, 1}, {1, 0, 5, 2}, {2, 1, 6, 3}, {2, -5, -1, 1}};
  const Sizes s{2, 5, 7};
  for (DType dt : kHalves)
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(kg::dtype_name(dt)) + " dim " + std::to_string(c.dim) + " " +
                   std::to_string(c.start) + ":" + std::to_string(c.end) + ":" + std::to_string(c.step));
      const Tensor x = random_half(rng, dt, s);
      const Tensor y =
          run_one([&](const SymTensor& t) { return kg::slice(t, c.dim, c.start, c.end, c.step, "s"); }, x);
      const auto d = static_cast<std::size_t>(c.dim);
      const std::int64_t n = s[d], b = c.start < 0 ? c.start + n : c.start, e = c.end < 0 ? c.end + n : c.end;
      Sizes os = s;
      os[d] = (e - b + c.step - 1) / c.step;
      const std::vector<std::uint16_t> xb = bits_of(x);
      const Sizes st = strides(s);
      std::vector<std::uint16_t> want;
      for (std::int64_t i = 0; i < kg::numel_of(os); ++i) {
        Sizes o = unflatten(i, os);
        o[d] = b + o[d] * c.step;
        std::int64_t off = 0;
        for (std::size_t k = 0; k < o.size(); ++k) off += o[k] * st[k];
        want.push_back(xb[static_cast<std::size_t>(off)]);
      }
      EXPECT_TRUE(same_bits(y, dt, os, want));
    }
}

// ---- the index ops ----

Tensor indices(const std::vector<std::int64_t>& v, const Sizes& shape, DType dt) {
  if (dt == DType::I64) return Tensor::from_vector<std::int64_t>(shape, v);
  return Tensor::from_vector<std::int32_t>(shape, std::vector<std::int32_t>(v.begin(), v.end()));
}

TEST(LayoutHalf, GathersAreBitExact) {
  std::mt19937_64 rng(fresh_seed());
  for (DType dt : kHalves)
    for (DType it : {DType::I32, DType::I64}) {
      SCOPED_TRACE(std::string(kg::dtype_name(dt)) + " indices " + std::string(kg::dtype_name(it)));
      const Sizes s{2, 5, 3};
      const Tensor x = random_half(rng, dt, s);
      const std::vector<std::uint16_t> xb = bits_of(x);
      const Sizes st = strides(s);
      // index.gather along axis 1 with negative and repeated indices: [2, 2, 3, 3].
      const std::vector<std::int64_t> k{4, -1, 0, 0, 2, -5};
      const Tensor gi = indices(k, {2, 3}, it);
      const Tensor y = run_both(
          [](const std::vector<SymTensor>& ts) {
            return std::vector<SymTensor>{kg::ops::gather(ts[0], ts[1], 1, "g")};
          },
          {x, gi})[0];
      std::vector<std::uint16_t> want;
      for (std::int64_t o = 0; o < 2; ++o)
        for (std::int64_t j = 0; j < 6; ++j)
          for (std::int64_t r = 0; r < 3; ++r) {
            const std::int64_t kk = k[static_cast<std::size_t>(j)] < 0 ? k[static_cast<std::size_t>(j)] + 5
                                                                       : k[static_cast<std::size_t>(j)];
            want.push_back(xb[static_cast<std::size_t>(o * st[0] + kk * st[1] + r)]);
          }
      EXPECT_TRUE(same_bits(y, dt, {2, 2, 3, 3}, want));

      // index.gather_elements along axis 1: indices [2, 4, 3] in [-5, 5).
      std::uniform_int_distribution<std::int64_t> u(-5, 4);
      std::vector<std::int64_t> e(24);
      for (auto& v : e) v = u(rng);
      const Tensor ei = indices(e, {2, 4, 3}, it);
      const Tensor z = run_both(
          [](const std::vector<SymTensor>& ts) {
            return std::vector<SymTensor>{kg::ops::gather_elements(ts[0], ts[1], 1, "ge")};
          },
          {x, ei})[0];
      want.clear();
      for (std::int64_t i = 0; i < 24; ++i) {
        const Sizes o = unflatten(i, {2, 4, 3});
        std::int64_t kk = e[static_cast<std::size_t>(i)];
        if (kk < 0) kk += 5;
        want.push_back(xb[static_cast<std::size_t>(o[0] * st[0] + kk * st[1] + o[2])]);
      }
      EXPECT_TRUE(same_bits(z, dt, {2, 4, 3}, want));
    }
}

// An index map's expected output: out[i] = x[src(i)], or `fill` where src(i) is -1.
std::vector<std::uint16_t> naive_map(const Tensor& x, const Sizes& os,
                                     const std::function<std::int64_t(const Sizes&)>& src,
                                     std::uint16_t fill) {
  const std::vector<std::uint16_t> xb = bits_of(x);
  std::vector<std::uint16_t> want;
  for (std::int64_t i = 0; i < kg::numel_of(os); ++i) {
    const std::int64_t k = src(unflatten(i, os));
    want.push_back(k < 0 ? fill : xb[static_cast<std::size_t>(k)]);
  }
  return want;
}

// The 16-bit pattern of a value exactly representable in `dt` (the tests' pad constants).
std::uint16_t exact_bits(double v, DType dt) {
  Tensor t = Tensor::empty(dt, {1});
  t.fill(v);
  EXPECT_EQ(t.item(0), v) << v << " is not exact in " << kg::dtype_name(dt);
  return bits_of(t)[0];
}

TEST(LayoutHalf, IndexMapsAreBitExact) {
  std::mt19937_64 rng(fresh_seed());
  using kg::ops::PadMode;
  for (DType dt : kHalves) {
    SCOPED_TRACE(kg::dtype_name(dt));
    const Sizes s{2, 1, 4};
    const Sizes st = strides(s);
    const Tensor x = random_half(rng, dt, s);
    auto at = [&](std::int64_t a, std::int64_t b, std::int64_t c) {
      return a * st[0] + b * st[1] + c * st[2];
    };

    // index.expand to [3, 2, 5, 4] (a new leading dim, dim 1 broadcast).
    {
      const Tensor y = run_one(
          [](const SymTensor& t) {
            using kg::ops::DimRef;
            return kg::ops::expand(
                t, {DimRef::constant(3), DimRef::constant(2), DimRef::constant(5), DimRef::constant(4)}, {},
                "expand");
          },
          x);
      const Sizes os{3, 2, 5, 4};
      EXPECT_TRUE(same_bits(y, dt, os,
                            naive_map(
                                x, os, [&](const Sizes& o) { return at(o[1], 0, o[3]); }, 0)));
    }
    // index.tile by [2, 3, 2].
    {
      const Tensor y = run_one([](const SymTensor& t) { return kg::ops::tile(t, {2, 3, 2}, "tile"); }, x);
      const Sizes os{4, 3, 8};
      EXPECT_TRUE(same_bits(y, dt, os,
                            naive_map(
                                x, os, [&](const Sizes& o) { return at(o[0] % 2, 0, o[2] % 4); }, 0)));
    }
    // index.pad in every mode; the last dim padded by 2 before and 3 after (reflect: 2 and 3 < 4),
    // the first cropped by 1 before.
    const Sizes os{1, 1, 9};
    struct PadCase {
      PadMode mode;
      double value;
      std::function<std::int64_t(std::int64_t)> col;  // input column of output column c - 2, or -1
    };
    const PadCase pads[] = {
        {PadMode::Constant, -1.5, [](std::int64_t c) { return c >= 0 && c < 4 ? c : -1; }},
        {PadMode::Constant, 0.0, [](std::int64_t c) { return c >= 0 && c < 4 ? c : -1; }},
        {PadMode::Reflect, 0, [](std::int64_t c) { return c < 0   ? -c
                                                          : c > 3 ? 6 - c
                                                                  : c; }},
        {PadMode::Edge, 0, [](std::int64_t c) { return std::clamp<std::int64_t>(c, 0, 3); }},
        {PadMode::Wrap, 0, [](std::int64_t c) { return ((c % 4) + 4) % 4; }},
    };
    for (const PadCase& p : pads) {
      SCOPED_TRACE(std::string("pad ") + kg::ops::pad_mode_name(p.mode));
      const Tensor y = run_one(
          [&](const SymTensor& t) {
            return kg::ops::pad(t, {-1, 0, 2}, {0, 0, 3}, p.mode, p.value, "pad");
          },
          x);
      EXPECT_TRUE(same_bits(y, dt, os,
                            naive_map(
                                x, os,
                                [&](const Sizes& o) {
                                  const std::int64_t c = p.col(o[2] - 2);
                                  return c < 0 ? -1 : at(o[0] + 1, 0, c);
                                },
                                exact_bits(p.value, dt))));
    }
    // A constant that the dtype rounds: every padded element is the constant rounded to nearest.
    {
      const Tensor y = run_one(
          [](const SymTensor& t) {
            return kg::ops::pad(t, {0, 0, 1}, {0, 0, 0}, PadMode::Constant, 0.1, "pad");
          },
          x);
      Tensor rounded = Tensor::empty(DType::F32, {1});
      rounded.fill(0.1);
      const Tensor r = rounded.to(dt);  // 0.1 has no exact f32 or 16-bit value
      for (std::int64_t a = 0; a < 2; ++a)
        EXPECT_EQ(bits_of(y)[static_cast<std::size_t>(a * 5)], bits_of(r)[0]);
      const double v = y.item(0);
      EXPECT_LE(std::abs(v - 0.1), 0.1 * ulp_rel(dt) / 2) << "the constant is not rounded to nearest";
    }
    // index.slice over two axes, one walking backwards.
    {
      const Tensor y = run_one(
          [](const SymTensor& t) {
            return kg::ops::slice_axes(t, {1, -1}, {2, -5}, {0, 2}, {1, -2}, "slice");
          },
          x);
      const Sizes so{1, 1, 2};
      EXPECT_TRUE(same_bits(y, dt, so,
                            naive_map(
                                x, so, [&](const Sizes& o) { return at(1, 0, 3 - 2 * o[2]); }, 0)));
    }
  }
}

// ---- which ops compute in 16 bits ----

kg::CustomData op_of(const std::function<SymTensor(const SymTensor&)>& build, const Sizes& shape) {
  auto g = kg::Graph::create();
  const SymTensor y = build(g->input(DType::F16, kg::Shape::of(shape), "x"));
  return *g->node(y.node()).op;
}

TEST(LayoutHalf, OpsDeclareTheHalfDtypes) {
  using kg::ops::DimRef;
  const std::vector<std::pair<std::string, kg::CustomData>> computing = {
      {"max_pool2d", op_of([](const SymTensor& x) { return kg::max_pool2d(x, 2); }, {1, 1, 4, 4})},
      {"avg_pool2d", op_of([](const SymTensor& x) { return kg::avg_pool2d(x, 2); }, {1, 1, 4, 4})},
      {"global_avg_pool", op_of([](const SymTensor& x) { return kg::global_avg_pool(x); }, {1, 1, 4, 4})},
      {"upsample", op_of([](const SymTensor& x) { return kg::upsample_nearest2d(x, 2); }, {1, 1, 4, 4})},
      {"flatten", op_of([](const SymTensor& x) { return kg::flatten(x); }, {2, 3})},
      {"reshape", op_of(
                      [](const SymTensor& x) {
                        return kg::reshape(x, {3, 2});
                      },
                      {2, 3})},
      {"view", kg::ops::view_op({DimRef::constant(-1)})},
      {"permute", op_of(
                      [](const SymTensor& x) {
                        return kg::permute(x, {1, 0});
                      },
                      {2, 3})},
      {"concat", op_of(
                     [](const SymTensor& x) {
                       return kg::concat({x, x}, 0);
                     },
                     {2, 3})},
      {"slice", op_of([](const SymTensor& x) { return kg::slice(x, 0, 0, 1, 1); }, {2, 3})},
      {"gather", kg::ops::gather_op(0)},
      {"gather_elements", kg::ops::gather_elements_op(0)},
      {"expand", kg::ops::expand_op({DimRef::constant(2)})},
      {"tile", kg::ops::tile_op({2})},
      {"pad", kg::ops::pad_op({1}, {1}, kg::ops::PadMode::Constant, 0.5)},
      {"slice_axes", kg::ops::slice_axes_op({0}, {1}, {}, {})},
  };
  for (const auto& [what, op] : computing) {
    EXPECT_TRUE(op->computes_in(DType::F16)) << what;
    EXPECT_TRUE(op->computes_in(DType::BF16)) << what;
  }
  // The ops whose dtype is an attribute (or always i64) keep it: a cast follows them instead.
  EXPECT_FALSE(kg::ops::range_op(DType::F32, 0, DimRef::constant(4), 1)->computes_in(DType::F16));
  EXPECT_FALSE(
      kg::ops::constant_of_shape_op({DimRef::constant(2)}, DType::F32, 1.0)->computes_in(DType::F16));
  EXPECT_FALSE(kg::ops::shape_tensor_op({DimRef::constant(2)})->computes_in(DType::BF16));
}

// ---- errors ----

// x * w with one trainable 16-bit weight, computed in f32.
class HalfScaleOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.half_scale"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>&) const override {
    kg::ParamSpec p;
    p.name = "w";
    p.shape = {1};
    p.dtype = DType::F32;  // the graph keeps it in the node's 16-bit dtype (computes_in)
    p.init = kg::ParamInit::constant(1.0);
    return {p};
  }
  bool computes_in(DType t) const override { return kg::is_half_float(t); }
  void cpu_forward(kg::CpuContext& c) const override {
    const double w = c.params[0].item(0);
    Tensor y = Tensor::empty(DType::F32, c.output.shape());
    for (std::int64_t i = 0; i < y.numel(); ++i)
      y.data<float>()[i] = static_cast<float>(c.inputs[0].item(i) * w);
    const Tensor r = y.to(c.output.dtype());
    std::memcpy(c.output.raw(), r.raw(), r.nbytes());
  }
  bool has_cpu_backward() const override { return true; }
  void cpu_backward(kg::CpuBackwardContext& c) const override {
    const double w = c.params[0].item(0);
    double gw = 0;
    for (std::int64_t i = 0; i < c.grad_output.numel(); ++i)
      gw += c.grad_output.item(i) * c.inputs[0].item(i);
    if (c.wants_param_grad(0)) c.grad_params[0].fill(gw);
    if (c.wants_input_grad(0)) {
      Tensor g = c.grad_output.to(DType::F32);
      for (std::int64_t i = 0; i < g.numel(); ++i) g.data<float>()[i] *= static_cast<float>(w);
      const Tensor r = g.to(c.grad_inputs[0].dtype());
      std::memcpy(c.grad_inputs[0].raw(), r.raw(), r.nbytes());
    }
  }
};

// The f32 sum of a 16-bit tensor: a scalar loss.
class HalfSumOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.half_sum"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>&) const override {
    return kg::Shape(std::vector<kg::Dim>{});
  }
  DType infer_output_dtype(const std::vector<DType>&) const override { return DType::F32; }
  void cpu_forward(kg::CpuContext& c) const override {
    double s = 0;
    for (std::int64_t i = 0; i < c.inputs[0].numel(); ++i) s += c.inputs[0].item(i);
    c.output.data<float>()[0] = static_cast<float>(s);
  }
  bool has_cpu_backward() const override { return true; }
  kg::BackwardSaves backward_saves() const override { return {false, false}; }
  void cpu_backward(kg::CpuBackwardContext& c) const override {
    if (c.wants_input_grad(0)) c.grad_inputs[0].fill(c.grad_output.data<float>()[0]);
  }
};

TEST(LayoutHalf, PoolBackwardIn16BitIsAnError) {
  const std::vector<std::pair<std::string, std::function<SymTensor(const SymTensor&)>>> pools = {
      {"nn.max_pool2d", [](const SymTensor& x) { return kg::max_pool2d(x, 2, 0, 0, 1, false, "pool"); }},
      {"nn.avg_pool2d", [](const SymTensor& x) { return kg::avg_pool2d(x, 2, 0, 0, false, true, "pool"); }},
      {"nn.global_avg_pool", [](const SymTensor& x) { return kg::global_avg_pool(x, "pool"); }},
      {"nn.upsample_nearest2d", [](const SymTensor& x) { return kg::upsample_nearest2d(x, 2, "pool"); }},
  };
  std::mt19937_64 rng(fresh_seed());
  for (DType dt : kHalves)
    for (const auto& [op_name, pool] : pools) {
      SCOPED_TRACE(op_name + " " + std::string(kg::dtype_name(dt)));
      // loss = sum(pool(x * w)): the pool lies between the weight and the loss.
      auto [x, g] = SymTensor::input(dt, kg::Shape::of({1, 2, 4, 4}), "x");
      const SymTensor h = x.record_custom(kg::CustomData::make<HalfScaleOp>(), {}, std::nullopt, "scale");
      const SymTensor p = pool(h);
      const SymTensor loss = p.record_custom(kg::CustomData::make<HalfSumOp>(), {}, std::nullopt, "loss");
      kg::Model model(g, {{"loss", loss}}, kg::LoweringMode::Training);
      kg::LoadedModel m = model.load(kg::Device::cpu(), {{1, 2, 4, 4}});
      m.forward({random_half(rng, dt, {1, 2, 4, 4})});
      kg_test::expect_error([&] { m.backward(); }, {op_name, std::string(kg::dtype_name(dt)), "inference"});

      // The lowered backward (the GPU's and the emulator's) refuses the same way.
      const kg::CustomData op = *g->node(p.node()).op;
      kg::LowerContext lc;
      lc.input_dtypes = {dt};
      lc.output_dtype = dt;
      lc.mode = kg::LoweringMode::Training;
      const auto lowered = op->lower(lc);
      ASSERT_TRUE(lowered && lowered->runtime_op);
      EXPECT_EQ(lowered->entry_point.substr(lowered->entry_point.rfind('_') + 1), kg::dtype_name(dt));
      kg::LaunchTensors t;
      t.inputs = {{0x1000, {1, 2, 4, 4}, dt}};
      std::vector<std::int64_t> osz;
      for (const kg::Dim& d : p.shape()) osz.push_back(d.size());
      t.output = {0, osz, dt};
      t.grad_output = {0x2000, osz, dt};
      t.grad_inputs = {{0x3000, {1, 2, 4, 4}, dt}};
      t.training = true;
      kg_test::expect_error([&] { lowered->runtime_op->backward_launches(t); },
                            {op_name, std::string(kg::dtype_name(dt)), "inference"});
    }
}

TEST(LayoutHalf, MixedDtypesAreErrors) {
  auto g = kg::Graph::create();
  const SymTensor h = g->input(DType::F16, kg::Shape::of({2, 3}), "h");
  const SymTensor b = g->input(DType::BF16, kg::Shape::of({2, 3}), "b");
  const SymTensor f = g->input(DType::F32, kg::Shape::of({2, 3}), "f");
  kg_test::expect_error([&] { kg::concat({h, f}, 0, "cat"); }, {"nn.concat", "f16", "f32"});
  kg_test::expect_error([&] { kg::concat({b, h}, 1, "cat2"); }, {"nn.concat", "bf16", "f16"});
  // 16-bit indices are not indices.
  kg_test::expect_error([&] { kg::ops::gather(f, h, 0, "g"); }, {"index.gather", "f16"});
  kg_test::expect_error([&] { kg::ops::gather_elements(b, b, 0, "ge"); }, {"index.gather_elements", "bf16"});
  // A pool takes floating inputs only, 16-bit ones included.
  const SymTensor i = g->input(DType::I32, kg::Shape::of({1, 1, 4, 4}), "i");
  kg_test::expect_error([&] { kg::max_pool2d(i, 2, 0, 0, 1, false, "mp"); }, {"nn.max_pool2d", "i32"});
  kg_test::expect_error([&] { kg::global_avg_pool(i, "gap"); }, {"nn.global_avg_pool", "i32"});
}

}  // namespace
