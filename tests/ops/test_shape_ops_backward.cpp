// Backward of the shape ops: permute (transpose), concat and slice (with steps). The CPU backward
// against finite differences (f64) and against naive index loops (f32), the CUDA backward kernels
// under the emulator (checked mode), every gradient element written; reshape and flatten are
// views with no backward of their own.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>

#include "kg/kg.hpp"
#include "ops/backward_check.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;
using kg_test::random_tensor;
namespace bwd = kg_test::bwd;

namespace {

using V = std::vector<kg::SymTensor>;
using Build = std::function<kg::SymTensor(const V&)>;

using bwd::lower_context;

bwd::Problem problem(const std::vector<std::vector<std::int64_t>>& shapes, kg::DType dtype,
                     const Build& build, std::mt19937_64& rng) {
  bwd::Problem p{bwd::record_op(shapes, dtype, build), {}, {}, true, rng()};
  for (const auto& s : shapes) p.inputs.push_back(random_tensor(rng, dtype, s));
  return p;
}

// Row-major strides of a shape.
std::vector<std::int64_t> strides(const std::vector<std::int64_t>& s) {
  std::vector<std::int64_t> st(s.size(), 1);
  for (std::size_t d = s.size(); d-- > 1;) st[d - 1] = st[d] * s[d];
  return st;
}

// Each element's multi-index.
std::vector<std::int64_t> unravel(std::int64_t i, const std::vector<std::int64_t>& s) {
  std::vector<std::int64_t> idx(s.size());
  for (std::size_t d = s.size(); d-- > 0;) {
    idx[d] = i % s[d];
    i /= s[d];
  }
  return idx;
}

struct PermuteCase {
  const char* name;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> perm;  // output dim i = input dim perm[i]
  Build build;
};

std::vector<PermuteCase> permute_cases() {
  return {
      {"permute 3d",
       {2, 3, 4},
       {2, 0, 1},
       [](const V& x) {
         return kg::permute(x[0], {2, 0, 1});
       }},
      {"permute negative dims",
       {2, 3, 4},
       {1, 2, 0},
       [](const V& x) {
         return kg::permute(x[0], {-2, -1, 0});
       }},
      {"transpose outer", {2, 3, 4}, {1, 0, 2}, [](const V& x) { return kg::transpose(x[0], 0, 1); }},
      {"transpose tiled", {2, 17, 18}, {0, 2, 1}, [](const V& x) { return kg::transpose(x[0], 1, 2); }},
      {"permute 4d",
       {2, 3, 4, 5},
       {0, 2, 3, 1},
       [](const V& x) {
         return kg::permute(x[0], {0, 2, 3, 1});
       }},
      {"permute with ones",
       {1, 3, 1, 5},
       {3, 2, 1, 0},
       [](const V& x) {
         return kg::permute(x[0], {3, 2, 1, 0});
       }},
      {"identity",
       {4, 5},
       {0, 1},
       [](const V& x) {
         return kg::permute(x[0], {0, 1});
       }},
  };
}

}  // namespace

TEST(PermuteBackward, MatchesFiniteDifferencesAndKernels) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& c : permute_cases()) {
    SCOPED_TRACE(c.name);
    bwd::check_f64(problem({c.shape}, kg::DType::F64, c.build, rng));
  }
}

TEST(PermuteBackward, F32AgainstIndexLoops) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& c : permute_cases()) {
    SCOPED_TRACE(c.name);
    const bwd::Problem p = problem({c.shape}, kg::DType::F32, c.build, rng);
    const kg::Tensor y = bwd::forward(p);
    const kg::Tensor dy = random_tensor(rng, kg::DType::F32, y.shape());
    // dx[idx] = dy[j] where output index j has j[i] = idx[perm[i]].
    kg::Tensor want = kg::Tensor::empty(kg::DType::F32, c.shape);
    const auto ost = strides(y.shape());
    for (std::int64_t i = 0; i < want.numel(); ++i) {
      const auto idx = unravel(i, c.shape);
      std::int64_t j = 0;
      for (std::size_t d = 0; d < c.perm.size(); ++d) j += idx[static_cast<std::size_t>(c.perm[d])] * ost[d];
      want.data<float>()[i] = dy.data<float>()[j];
    }
    const auto w = bwd::want_all(p);
    const bwd::Grads cpu = bwd::cpu_backward(p, y, dy, w);
    const bwd::Grads emu = bwd::emulated_backward(p, y, dy, w);
    EXPECT_TRUE(kg_test::all_close(cpu.inputs[0], want, 0, 0));
    EXPECT_TRUE(kg_test::all_close(emu.inputs[0], want, 0, 0));
  }
}

namespace {

struct ConcatCase {
  const char* name;
  std::vector<std::vector<std::int64_t>> shapes;
  std::int64_t dim;
};

std::vector<ConcatCase> concat_cases() {
  std::vector<std::vector<std::int64_t>> many;
  for (int k = 0; k < 17; ++k) many.push_back({2, 1 + k % 3});  // two launches of up to 16 inputs
  return {
      {"dim 0", {{2, 3}, {4, 3}}, 0},     {"dim 1 of three", {{2, 1, 4}, {2, 3, 4}, {2, 2, 4}}, 1},
      {"last dim", {{3, 2}, {3, 5}}, -1}, {"an empty input", {{2, 0, 3}, {2, 4, 3}}, 1},
      {"one input", {{3, 4}}, 1},         {"seventeen inputs", many, 1},
  };
}

Build concat_build(std::int64_t dim) {
  return [dim](const V& x) { return kg::concat(x, dim); };
}

}  // namespace

TEST(ConcatBackward, MatchesFiniteDifferencesAndKernels) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& c : concat_cases()) {
    SCOPED_TRACE(c.name);
    bwd::check_f64(problem(c.shapes, kg::DType::F64, concat_build(c.dim), rng));
  }
}

TEST(ConcatBackward, F32AgainstIndexLoopsWithSomeGradientsUnwanted) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& c : concat_cases()) {
    SCOPED_TRACE(c.name);
    const bwd::Problem p = problem(c.shapes, kg::DType::F32, concat_build(c.dim), rng);
    const kg::Tensor y = bwd::forward(p);
    const kg::Tensor dy = random_tensor(rng, kg::DType::F32, y.shape());
    const std::size_t rank = c.shapes[0].size();
    const auto d = static_cast<std::size_t>(c.dim < 0 ? c.dim + static_cast<std::int64_t>(rank) : c.dim);
    bwd::Wants w;
    for (std::size_t k = 0; k < c.shapes.size(); ++k) w.inputs.push_back(c.shapes.size() == 1 || k % 2 == 0);
    const bwd::Grads cpu = bwd::cpu_backward(p, y, dy, w);
    const bwd::Grads emu = bwd::emulated_backward(p, y, dy, w);
    const auto ost = strides(y.shape());
    std::int64_t offset = 0;
    for (std::size_t k = 0; k < c.shapes.size(); ++k) {
      SCOPED_TRACE("input " + std::to_string(k));
      if (w.inputs[k]) {
        kg::Tensor want = kg::Tensor::empty(kg::DType::F32, c.shapes[k]);
        for (std::int64_t i = 0; i < want.numel(); ++i) {
          auto idx = unravel(i, c.shapes[k]);
          idx[d] += offset;
          std::int64_t j = 0;
          for (std::size_t e = 0; e < rank; ++e) j += idx[e] * ost[e];
          want.data<float>()[i] = dy.data<float>()[j];
        }
        EXPECT_TRUE(kg_test::all_close(cpu.inputs[k], want, 0, 0));
        EXPECT_TRUE(kg_test::all_close(emu.inputs[k], want, 0, 0));
      }
      offset += c.shapes[k][d];
    }
  }
}

namespace {

struct SliceCase {
  const char* name;
  std::vector<std::int64_t> shape;
  std::int64_t dim, start, end, step;
};

constexpr std::int64_t kEnd = std::numeric_limits<std::int64_t>::max();

std::vector<SliceCase> slice_cases() {
  return {
      {"step 2", {3, 9}, 1, 1, 8, 2},
      {"step 1 contiguous", {4, 6, 3}, 1, 2, 5, 1},
      {"negative start", {7, 2}, 0, -3, kEnd, 1},
      {"step 3 inner dims", {2, 8, 3}, 1, 0, 8, 3},
      {"last dim step 4", {3, 10}, -1, 1, kEnd, 4},
      {"step past the end", {2, 5}, 1, 3, kEnd, 7},
      {"empty", {3, 6}, 1, 5, 2, 1},
      {"whole", {2, 3}, 0, 0, kEnd, 1},
  };
}

Build slice_build(const SliceCase& c) {
  return [c](const V& x) { return kg::slice(x[0], c.dim, c.start, c.end, c.step); };
}

}  // namespace

TEST(SliceBackward, MatchesFiniteDifferencesAndKernels) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& c : slice_cases()) {
    SCOPED_TRACE(c.name);
    bwd::check_f64(problem({c.shape}, kg::DType::F64, slice_build(c), rng));
  }
}

TEST(SliceBackward, F32ZeroOutsideTheSliceAndDyInside) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& c : slice_cases()) {
    SCOPED_TRACE(c.name);
    const bwd::Problem p = problem({c.shape}, kg::DType::F32, slice_build(c), rng);
    const kg::Tensor y = bwd::forward(p);
    const kg::Tensor dy = random_tensor(rng, kg::DType::F32, y.shape());
    // Python's slice rule, written out.
    const std::size_t d = static_cast<std::size_t>(c.dim < 0 ? c.dim + std::ssize(c.shape) : c.dim);
    const std::int64_t size = c.shape[d];
    auto clamp = [size](std::int64_t v) { return std::clamp<std::int64_t>(v < 0 ? v + size : v, 0, size); };
    const std::int64_t begin = clamp(c.start), end = clamp(c.end);
    kg::Tensor want = kg::Tensor::zeros(kg::DType::F32, c.shape);
    const auto ost = strides(y.shape());
    for (std::int64_t i = 0; i < want.numel(); ++i) {
      auto idx = unravel(i, c.shape);
      const std::int64_t s = idx[d];
      if (s < begin || s >= end || (s - begin) % c.step != 0) continue;
      idx[d] = (s - begin) / c.step;
      std::int64_t j = 0;
      for (std::size_t e = 0; e < idx.size(); ++e) j += idx[e] * ost[e];
      want.data<float>()[i] = dy.data<float>()[j];
    }
    const auto w = bwd::want_all(p);
    const bwd::Grads cpu = bwd::cpu_backward(p, y, dy, w);
    const bwd::Grads emu = bwd::emulated_backward(p, y, dy, w);
    EXPECT_TRUE(kg_test::all_close(cpu.inputs[0], want, 0, 0));
    EXPECT_TRUE(kg_test::all_close(emu.inputs[0], want, 0, 0));
  }
}

TEST(ShapeOpsBackward, CopiesSaveNothingAndViewsHaveNoBackward) {
  const std::vector<std::pair<std::vector<std::vector<std::int64_t>>, Build>> copies = {
      {{{2, 3}}, [](const V& x) { return kg::transpose(x[0], 0, 1); }},
      {{{2, 3}, {2, 3}}, [](const V& x) { return kg::concat(x, 0); }},
      {{{2, 3}}, [](const V& x) { return kg::slice(x[0], 1, 0, 2, 1); }},
  };
  for (const auto& [shapes, build] : copies) {
    const kg::CustomData op = bwd::record_op(shapes, kg::DType::F32, build);
    SCOPED_TRACE(op.name());
    EXPECT_TRUE(op->has_cpu_backward());
    EXPECT_FALSE(op->backward_saves().inputs);
    EXPECT_FALSE(op->backward_saves().output);
    EXPECT_FALSE(op->lower_backward_source(lower_context(op, shapes, kg::DType::F32)).empty());
  }
  for (const Build& view : std::vector<Build>{[](const V& x) { return kg::reshape(x[0], {6}); },
                                              [](const V& x) { return kg::flatten(x[0]); }}) {
    const kg::CustomData op = bwd::record_op({{2, 3}}, kg::DType::F32, view);
    SCOPED_TRACE(op.name());
    EXPECT_TRUE(op->is_view());
    EXPECT_FALSE(op->has_cpu_backward());
    EXPECT_TRUE(op->lower_backward_source(lower_context(op, {{2, 3}}, kg::DType::F32)).empty());
  }
}

TEST(ShapeOpsBackward, GradientCheckerPasses) {
  using S = std::vector<std::vector<std::int64_t>>;
  const struct {
    const char* name;
    S shapes;
    Build build;
  } cases[] = {
      {"permute",
       {{2, 3, 4}},
       [](const V& x) {
         return kg::permute(x[0], {1, 2, 0});
       }},
      {"transpose", {{3, 5}}, [](const V& x) { return kg::transpose(x[0], 0, 1); }},
      {"concat", {{2, 3}, {2, 2}}, [](const V& x) { return kg::concat(x, 1); }},
      {"slice", {{3, 10}}, [](const V& x) { return kg::slice(x[0], 1, 1, 9, 3); }},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    for (const kg::DType dt : {kg::DType::F64, kg::DType::F32})
      bwd::check_with_checker(bwd::record_op(c.shapes, dt, c.build), c.shapes, dt);
  }
}
