// The backward of the pooling family: the CPU backward against central finite differences in
// f64 and the backward kernels under the CUDA emulator against it (kg::testing::check_gradients)
// for max pooling (padding, dilation, ceil mode), average pooling (count_include_pad, ceil
// mode), the global average and nearest upsampling; max pooling's choice of tap on ties and NaN
// against PyTorch's rule, on the CPU and in the emulated kernels; and the RuntimeOp's backward
// launches and scratch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>

#include "kg/runtime_op.hpp"
#include "kg/testing.hpp"
#include "ops/backward_check.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

using Sizes = std::vector<std::int64_t>;
using Build = std::function<kg::SymTensor(const kg::SymTensor&)>;

kg::CustomData pool_op(const Build& build, const Sizes& shape, kg::DType dtype) {
  auto g = kg::Graph::create();
  kg::SymTensor y = build(g->input(dtype, kg::Shape::of(shape)));
  return *g->node(y.node()).op;
}

struct Case {
  std::string name;
  Sizes shape;
  Build build;
};

std::vector<Case> cases() {
  return {
      {"max 2x2 (LeNet)", {2, 3, 8, 8}, [](const kg::SymTensor& x) { return kg::max_pool2d(x, 2); }},
      {"max 3x3 s2 p1", {2, 2, 9, 8}, [](const kg::SymTensor& x) { return kg::max_pool2d(x, 3, 2, 1); }},
      {"max 3x3 s1 overlapping", {1, 2, 6, 7}, [](const kg::SymTensor& x) { return kg::max_pool2d(x, 3, 1); }},
      {"max dilated ceil", {2, 2, 9, 10},
       [](const kg::SymTensor& x) { return kg::max_pool2d(x, 3, 2, 1, 2, true); }},
      {"max rectangular ceil", {1, 3, 7, 6},
       [](const kg::SymTensor& x) { return kg::max_pool2d(x, {2, 3}, {2, 2}, {1, 0}, 1, true); }},
      {"avg 2x2", {2, 3, 8, 6}, [](const kg::SymTensor& x) { return kg::avg_pool2d(x, 2); }},
      {"avg 3x3 s2 p1 count_include_pad", {2, 2, 9, 9},
       [](const kg::SymTensor& x) { return kg::avg_pool2d(x, 3, 2, 1, false, true); }},
      {"avg 3x3 s2 p1 exclude pad ceil", {2, 2, 9, 8},
       [](const kg::SymTensor& x) { return kg::avg_pool2d(x, 3, 2, 1, true, false); }},
      {"avg ceil count_include_pad", {1, 2, 7, 7},
       [](const kg::SymTensor& x) { return kg::avg_pool2d(x, 2, 2, 1, true, true); }},
      {"global avg", {3, 4, 5, 6}, [](const kg::SymTensor& x) { return kg::global_avg_pool(x); }},
      {"upsample 2", {2, 3, 3, 4}, [](const kg::SymTensor& x) { return kg::upsample_nearest2d(x, 2); }},
      {"upsample 2x3", {1, 2, 4, 3}, [](const kg::SymTensor& x) { return kg::upsample_nearest2d(x, {2, 3}); }},
  };
}

// Distinct values 0.01 apart in a random order, so that no perturbation of a finite-difference
// step changes which tap a max pooling window picks.
kg::Tensor spread_values(std::mt19937_64& rng, kg::DType dtype, const Sizes& shape) {
  kg::Tensor t = kg::Tensor::empty(dtype, shape);
  std::vector<std::int64_t> order(static_cast<std::size_t>(t.numel()));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  kg::Tensor d = kg::Tensor::empty(kg::DType::F64, shape);
  for (std::size_t i = 0; i < order.size(); ++i)
    d.data<double>()[i] = 0.01 * static_cast<double>(order[i]) - 0.005 * static_cast<double>(order.size());
  return d.to(dtype);
}

// dx of max pooling by its definition, for one plane: each window's gradient to its first largest
// tap, or to its last NaN (PyTorch's rule).
std::vector<double> naive_max_backward(const kg::Tensor& x, const kg::Tensor& dy, std::int64_t k, std::int64_t s,
                                       std::int64_t p) {
  const std::int64_t h = x.dim(2), w = x.dim(3), ho = dy.dim(2), wo = dy.dim(3);
  std::vector<double> dx(static_cast<std::size_t>(x.numel()));
  for (std::int64_t oy = 0; oy < ho; ++oy)
    for (std::int64_t ox = 0; ox < wo; ++ox) {
      std::int64_t pick = -1;
      double best = -std::numeric_limits<double>::infinity();
      for (std::int64_t ky = 0; ky < k; ++ky)
        for (std::int64_t kx = 0; kx < k; ++kx) {
          const std::int64_t iy = oy * s - p + ky, ix = ox * s - p + kx;
          if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;
          const double v = x.item(iy * w + ix);
          if (pick < 0 || v > best || std::isnan(v)) {
            best = v;
            pick = iy * w + ix;
          }
        }
      dx[static_cast<std::size_t>(pick)] += dy.item(oy * wo + ox);
    }
  return dx;
}

// Plane `pl` of an [N, C, H, W] tensor as a [1, 1, H, W] f64 tensor.
kg::Tensor plane_of(const kg::Tensor& t, std::int64_t pl) {
  const std::int64_t hw = t.dim(2) * t.dim(3);
  kg::Tensor p = kg::Tensor::empty(kg::DType::F64, {1, 1, t.dim(2), t.dim(3)});
  for (std::int64_t i = 0; i < hw; ++i) p.data<double>()[i] = t.item(pl * hw + i);
  return p;
}

// The CPU backward of `op` for input x and output gradient dy, dx poisoned with NaN first.
kg::Tensor cpu_dx(const kg::CustomData& op, const kg::Tensor& x, const kg::Tensor& dy) {
  std::vector<kg::Tensor> inputs{x}, no_params, no_grads;
  std::vector<kg::Tensor> dx{kg::Tensor::empty(x.dtype(), x.shape())};
  dx[0].fill(std::numeric_limits<double>::quiet_NaN());
  kg::CpuBackwardContext ctx(inputs, no_params, kg::Tensor::wrap(nullptr, dy.dtype(), dy.shape()), dy, dx,
                             no_grads, true, 0);
  op->cpu_backward(ctx);
  return dx[0];
}

}  // namespace

TEST(PoolBackward, MatchesFiniteDifferencesAndEmulatedKernels) {
  const auto seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (const Case& c : cases()) {
    for (kg::DType dt : {kg::DType::F64, kg::DType::F32}) {
      SCOPED_TRACE(c.name + " " + std::string(kg::dtype_name(dt)));
      kg::testing::GradCheckOptions o;
      o.seed = seed;
      o.make_input = [&](int, const Sizes& shape) { return spread_values(rng, dt, shape); };
      const auto rep = kg::testing::check_gradients(pool_op(c.build, c.shape, dt), {c.shape}, {dt}, o);
      EXPECT_TRUE(rep.ok) << rep.to_string();
    }
  }
}

TEST(PoolBackward, SavesOnlyWhatItReads) {
  const Sizes shape{1, 1, 4, 4};
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const kg::CustomData op = pool_op(c.build, shape, kg::DType::F32);
    EXPECT_TRUE(op->has_cpu_backward());
    EXPECT_EQ(op->backward_saves().inputs, c.name.rfind("max", 0) == 0);  // only max pooling reads x
    EXPECT_FALSE(op->backward_saves().output);
  }
}

TEST(PoolBackward, MaxPoolSendsTiesToTheFirstAndNanToTheLast) {
  // One 3x3 window over a 3x3 plane, then four 2x2 windows over a 4x4 plane.
  const kg::CustomData one = pool_op([](const kg::SymTensor& x) { return kg::max_pool2d(x, 3); }, {1, 1, 3, 3},
                                     kg::DType::F32);
  const kg::Tensor dy = kg::Tensor::from_vector<float>({1, 1, 1, 1}, {2.5f});
  auto grad_at = [&](std::vector<float> values) {
    const kg::Tensor dx = cpu_dx(one, kg::Tensor::from_vector<float>({1, 1, 3, 3}, values), dy);
    std::vector<double> v;
    for (std::int64_t i = 0; i < dx.numel(); ++i) v.push_back(dx.item(i));
    return v;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(grad_at({0, 7, 1, 7, 2, 3, 4, 5, 6}), (std::vector<double>{0, 2.5, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(grad_at({0, 7, nan, 7, 2, nan, 4, 5, 6}), (std::vector<double>{0, 0, 0, 0, 0, 2.5, 0, 0, 0}));
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(grad_at({-inf, -inf, -inf, -inf, -inf, -inf, -inf, -inf, -inf}),
            (std::vector<double>{2.5, 0, 0, 0, 0, 0, 0, 0, 0}));

  // Random planes with repeated values (ties everywhere) against the naive rule.
  std::mt19937_64 rng(fresh_seed());
  std::uniform_int_distribution<int> pick(0, 3);
  const kg::CustomData pool = pool_op([](const kg::SymTensor& x) { return kg::max_pool2d(x, 3, 2, 1); },
                                      {1, 1, 9, 8}, kg::DType::F64);
  kg::Tensor x = kg::Tensor::empty(kg::DType::F64, {1, 1, 9, 8});
  for (std::int64_t i = 0; i < x.numel(); ++i) x.data<double>()[i] = pick(rng);
  x.data<double>()[17] = std::numeric_limits<double>::quiet_NaN();
  const kg::Tensor g = kg_test::random_tensor(rng, kg::DType::F64, {1, 1, 5, 4});
  const kg::Tensor dx = cpu_dx(pool, x, g);
  const std::vector<double> want = naive_max_backward(x, g, 3, 2, 1);
  for (std::int64_t i = 0; i < dx.numel(); ++i)
    EXPECT_NEAR(dx.item(i), want[static_cast<std::size_t>(i)], 1e-12) << "element " << i;
}

TEST(PoolBackward, RuntimeOpLaunchesPicksThenTheGather) {
  const kg::CustomData op = pool_op([](const kg::SymTensor& x) { return kg::max_pool2d(x, 3, 2, 1); },
                                    {2, 3, 9, 9}, kg::DType::F64);
  kg::LowerContext lc;
  lc.input_dtypes = {kg::DType::F64};
  lc.output_dtype = kg::DType::F64;
  lc.input_shapes = {kg::Shape::of({2, 3, 9, 9})};
  lc.output_shape = kg::Shape::of({2, 3, 5, 5});
  lc.mode = kg::LoweringMode::Training;
  const auto lowered = op->lower(lc);
  ASSERT_TRUE(lowered && lowered->runtime_op);
  EXPECT_EQ(lowered->entry_point, "kg_max_pool2d_f64");  // the node's dtype
  const kg::RuntimeOp& rt = *lowered->runtime_op;
  kg::LaunchTensors t;
  t.inputs = {{0x1000, {2, 3, 9, 9}, kg::DType::F64}};
  t.output = {0, {2, 3, 5, 5}, kg::DType::F64};
  t.grad_output = {0x2000, {2, 3, 5, 5}, kg::DType::F64};
  t.grad_inputs = {{0x3000, {2, 3, 9, 9}, kg::DType::F64}};
  t.training = true;
  EXPECT_EQ(rt.backward_scratch_bytes(t), 4u * 150);  // an int32 pick per window
  t.scratch = 0x4000;
  const std::vector<kg::Launch> ls = rt.backward_launches(t);
  ASSERT_EQ(ls.size(), 2u);
  EXPECT_EQ(ls[0].entry, "kg_max_pool2d_picks_f64");
  EXPECT_EQ(ls[0].grid.x, 1u);  // 150 windows, a thread each
  ASSERT_EQ(ls[0].args.size(), 3u);  // x, the picks, the geometry
  EXPECT_EQ(ls[1].entry, "kg_max_pool2d_backward_f64");
  EXPECT_EQ(ls[1].grid.x, 2u);  // 486 input elements, a thread each
  EXPECT_EQ(ls[1].block.x, 256u);
  EXPECT_EQ(ls[1].args.size(), 4u);  // the picks, dy, dx, the geometry
  const std::string source = op->lower_backward_source(lc);
  EXPECT_NE(source.find("kg_max_pool2d_picks_f64"), std::string::npos);
  EXPECT_NE(source.find("kg_max_pool2d_backward_f64"), std::string::npos);
  t.grad_inputs[0].ptr = 0;  // not wanted: one idle block, no picks
  const std::vector<kg::Launch> idle = rt.backward_launches(t);
  ASSERT_EQ(idle.size(), 1u);
  EXPECT_EQ(idle[0].entry, "kg_max_pool2d_backward_f64");
  EXPECT_EQ(idle[0].grid.x, 1u);

  // The other pooling ops need no scratch and launch once.
  const kg::CustomData avg = pool_op([](const kg::SymTensor& x) { return kg::avg_pool2d(x, 3, 2, 1); },
                                     {2, 3, 9, 9}, kg::DType::F64);
  const auto avg_rt = avg->lower(lc)->runtime_op;
  EXPECT_EQ(avg_rt->backward_scratch_bytes(t), 0u);
  t.grad_inputs[0].ptr = 0x3000;
  EXPECT_EQ(avg_rt->backward_launches(t).size(), 1u);
}

TEST(PoolBackward, MaxPoolRefusesPlanesPast32BitIndices) {
  const std::vector<std::int64_t> in{1, 1, 50000, 50000}, out{1, 1, 25000, 25000};
  const kg::CustomData op = pool_op([](const kg::SymTensor& x) { return kg::max_pool2d(x, 2); }, in,
                                    kg::DType::F32);
  kg::LowerContext lc;
  lc.input_dtypes = {kg::DType::F32};
  lc.output_dtype = kg::DType::F32;
  lc.input_shapes = {kg::Shape::of(in)};
  lc.output_shape = kg::Shape::of(out);
  lc.mode = kg::LoweringMode::Training;
  const auto rt = op->lower(lc)->runtime_op;
  kg::LaunchTensors t;
  t.inputs = {{0x1000, in, kg::DType::F32}};
  t.output = {0, out, kg::DType::F32};
  t.grad_output = {0x2000, out, kg::DType::F32};
  t.grad_inputs = {{0x3000, in, kg::DType::F32}};
  t.scratch = 0x4000;
  kg_test::expect_error([&] { (void)rt->backward_launches(t); },
                        {"nn.max_pool2d", "32 bits", "50000 x 50000"});
}

// The emulated kernels (picks, then the gather) follow the tie and NaN rule of the CPU backward
// and of PyTorch: first largest, last NaN; a window of -inf gives its first tap. Every element of
// dx is written (poisoned first), overlapping windows included.
TEST(PoolBackward, EmulatedMaxPoolSendsTiesToTheFirstAndNanToTheLast) {
  std::mt19937_64 rng(fresh_seed());
  std::uniform_int_distribution<int> level(0, 3);
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
    for (int with_nan = 0; with_nan < 3; ++with_nan) {
      SCOPED_TRACE(std::string(kg::dtype_name(dt)) + " nan case " + std::to_string(with_nan));
      const Sizes shape{2, 3, 9, 8};
      kg::Tensor x = kg::Tensor::empty(kg::DType::F64, shape);
      for (std::int64_t i = 0; i < x.numel(); ++i) x.data<double>()[i] = level(rng);
      if (with_nan == 1) x.data<double>()[17] = x.data<double>()[19] = std::numeric_limits<double>::quiet_NaN();
      if (with_nan == 2)  // a whole plane of -inf
        for (std::int64_t i = 0; i < 72; ++i) x.data<double>()[72 + i] = -std::numeric_limits<double>::infinity();
      kg_test::bwd::Problem p{pool_op([](const kg::SymTensor& v) { return kg::max_pool2d(v, 3, 2, 1); }, shape, dt),
                              {x.to(dt)}};
      const kg::Tensor y = kg_test::bwd::forward(p);
      const kg::Tensor dy = kg_test::random_tensor(rng, dt, y.shape());
      const kg::Tensor got = kg_test::bwd::emulated_backward(p, y, dy, kg_test::bwd::want_all(p)).inputs[0];
      const kg::Tensor cpu = cpu_dx(p.op, p.inputs[0], dy);
      for (std::int64_t pl = 0; pl < 6; ++pl) {
        const std::vector<double> want =
            naive_max_backward(plane_of(p.inputs[0], pl), plane_of(dy, pl), 3, 2, 1);
        for (std::int64_t i = 0; i < 72; ++i) {
          const std::int64_t e = pl * 72 + i;
          // A tap picked by several windows sums their gradients, in an order of its own.
          const double w = want[static_cast<std::size_t>(i)], tol = (dt == kg::DType::F32 ? 1e-6 : 1e-14) * 4;
          EXPECT_NEAR(got.item(e), w, tol * (1 + std::abs(w))) << "plane " << pl << " element " << i;
          EXPECT_NEAR(got.item(e), cpu.item(e), tol * (1 + std::abs(w))) << "element " << e;
        }
      }
    }
  }
}
