// The backward of nn.linear: the CPU backward against central finite differences in f64 and the
// backward kernels under the CUDA emulator against it (kg::testing::check_gradients), with and
// without a bias and on inputs of rank 1 to 3; the f32 CPU backward against a naive reference on
// NaN-poisoned gradients, with some not wanted; and the RuntimeOp's backward launches.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "kg/runtime_op.hpp"
#include "kg/testing.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

using kg_test::nan_tensor;
using kg_test::matches;

// The nn.linear op recorded on an input of `shape` and `dtype`.
kg::CustomData linear_op(const std::vector<std::int64_t>& shape, std::int64_t out, bool bias, kg::DType dtype) {
  auto g = kg::Graph::create();
  kg::SymTensor x = g->input(dtype, kg::Shape::of(shape));
  kg::SymTensor y = kg::nn::linear(x, out, "fc", bias);
  return *g->node(y.node()).op;
}

struct Case {
  std::vector<std::int64_t> shape;
  std::int64_t out;
  bool bias;
};

}  // namespace

TEST(LinearBackward, MatchesFiniteDifferencesAndEmulatedKernels) {
  const auto seed = fresh_seed();
  const std::vector<Case> cases = {{{3, 12}, 7, true},     {{3, 12}, 7, false}, {{2, 3, 10}, 5, true},
                                   {{6}, 4, true},          {{1, 70}, 65, true}, {{130, 5}, 3, true}};
  for (const Case& c : cases) {
    for (kg::DType dt : {kg::DType::F64, kg::DType::F32}) {
      SCOPED_TRACE(kg::sizes_to_string(c.shape) + " -> " + std::to_string(c.out) + " bias=" +
                   std::to_string(c.bias) + " " + std::string(kg::dtype_name(dt)));
      kg::testing::GradCheckOptions o;
      o.seed = seed;
      const auto rep = kg::testing::check_gradients(linear_op(c.shape, c.out, c.bias, dt), {c.shape}, {dt}, o);
      EXPECT_TRUE(rep.ok) << rep.to_string();
    }
  }
}

TEST(LinearBackward, F32CpuBackwardMatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::DType f32 = kg::DType::F32;
  // LeNet's layers at batch 128, a 3-D input, a single row.
  const std::vector<Case> cases = {
      {{128, 400}, 120, true}, {{128, 120}, 84, true}, {{128, 84}, 10, true}, {{4, 5, 33}, 17, false},
      {{1, 9}, 3, true}};
  for (const Case& c : cases) {
    for (const std::array<bool, 3> want :
         {std::array<bool, 3>{true, true, true}, {false, true, true}, {true, false, false}}) {
      SCOPED_TRACE(kg::sizes_to_string(c.shape) + " -> " + std::to_string(c.out) + " want dx/dw/db=" +
                   std::to_string(want[0]) + std::to_string(want[1]) + std::to_string(want[2]));
      const std::int64_t in = c.shape.back(), rows = kg::numel_of(c.shape) / in;
      std::vector<std::int64_t> out_shape = c.shape;
      out_shape.back() = c.out;
      const kg::CustomData op = linear_op(c.shape, c.out, c.bias, f32);
      std::vector<kg::Tensor> inputs{kg_test::random_tensor(rng, f32, c.shape)};
      std::vector<kg::Tensor> params{kg_test::random_tensor(rng, f32, {c.out, in})};
      if (c.bias) params.push_back(kg_test::random_tensor(rng, f32, {c.out}));
      const kg::Tensor dy = kg_test::random_tensor(rng, f32, out_shape);
      std::vector<kg::Tensor> grad_in{want[0] ? nan_tensor(f32, c.shape) : kg::Tensor::wrap(nullptr, f32, c.shape)};
      std::vector<kg::Tensor> grad_params;
      for (std::size_t k = 0; k < params.size(); ++k)
        grad_params.push_back(want[k + 1] ? nan_tensor(f32, params[k].shape())
                                          : kg::Tensor::wrap(nullptr, f32, params[k].shape()));
      kg::CpuBackwardContext ctx(inputs, params, kg::Tensor::wrap(nullptr, f32, out_shape), dy, grad_in,
                                 grad_params, true, 0);
      op->cpu_backward(ctx);

      // dx[r, i] = sum_j dy[r, j] w[j, i]; dw[j, i] = sum_r dy[r, j] x[r, i]; db[j] = sum_r dy[r, j].
      std::vector<double> dx(static_cast<std::size_t>(rows * in)), dw(static_cast<std::size_t>(c.out * in)),
          db(static_cast<std::size_t>(c.out));
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t j = 0; j < c.out; ++j) {
          const double d = dy.item(r * c.out + j);
          db[static_cast<std::size_t>(j)] += d;
          for (std::int64_t i = 0; i < in; ++i) {
            dx[static_cast<std::size_t>(r * in + i)] += d * params[0].item(j * in + i);
            dw[static_cast<std::size_t>(j * in + i)] += d * inputs[0].item(r * in + i);
          }
        }
      if (want[0]) {
        EXPECT_TRUE(matches(grad_in[0], dx, 1e-4, 1e-4)) << "input gradient";
      }
      if (want[1]) {
        EXPECT_TRUE(matches(grad_params[0], dw, 1e-4, 1e-4)) << "weight gradient";
      }
      if (c.bias && want[2]) {
        EXPECT_TRUE(matches(grad_params[1], db, 1e-4, 1e-4)) << "bias gradient";
      }
    }
  }
}

TEST(LinearBackward, EmptyBatchWritesZeroParameterGradients) {
  const kg::DType f64 = kg::DType::F64;
  const kg::CustomData op = linear_op({0, 6}, 4, true, f64);
  std::vector<kg::Tensor> inputs{kg::Tensor::empty(f64, {0, 6})};
  std::vector<kg::Tensor> params{kg::Tensor::zeros(f64, {4, 6}), kg::Tensor::zeros(f64, {4})};
  std::vector<kg::Tensor> grad_in{kg::Tensor::empty(f64, {0, 6})};
  std::vector<kg::Tensor> grad_params{nan_tensor(f64, {4, 6}), nan_tensor(f64, {4})};
  kg::CpuBackwardContext ctx(inputs, params, kg::Tensor::wrap(nullptr, f64, {0, 4}), kg::Tensor::empty(f64, {0, 4}),
                             grad_in, grad_params, true, 0);
  op->cpu_backward(ctx);
  for (const kg::Tensor& g : grad_params)
    for (std::int64_t i = 0; i < g.numel(); ++i) EXPECT_EQ(g.item(i), 0.0);
}

TEST(LinearBackward, RuntimeOpLaunchesOneKernelPerGradient) {
  const kg::CustomData op = linear_op({2, 3, 70}, 65, true, kg::DType::F64);
  EXPECT_TRUE(op->has_cpu_backward());
  EXPECT_TRUE(op->backward_saves().inputs);
  EXPECT_FALSE(op->backward_saves().output);
  kg::LowerContext lc;
  lc.input_dtypes = {kg::DType::F64};
  lc.output_dtype = kg::DType::F64;
  lc.input_shapes = {kg::Shape::of({2, 3, 70})};
  lc.output_shape = kg::Shape::of({2, 3, 65});
  lc.mode = kg::LoweringMode::Training;
  const auto lowered = op->lower(lc);
  ASSERT_TRUE(lowered && lowered->runtime_op);
  const kg::RuntimeOp& rt = *lowered->runtime_op;
  EXPECT_NE(op->lower_backward_source(lc).find("kg_linear_backward_input_f64"), std::string::npos);
  kg::LaunchTensors t;
  const kg::DType f64 = kg::DType::F64;
  t.inputs = {{0x1000, {2, 3, 70}, f64}};
  t.params = {{0x2000, {65, 70}, f64}, {0x3000, {65}, f64}};
  t.output = {0, {2, 3, 65}, f64};
  t.grad_output = {0x4000, {2, 3, 65}, f64};
  t.grad_inputs = {{0x5000, {2, 3, 70}, f64}};
  t.grad_params = {{0x6000, {65, 70}, f64}, {0x7000, {65}, f64}};
  t.training = true;
  const std::vector<kg::Launch> ls = rt.backward_launches(t);
  ASSERT_EQ(ls.size(), 3u);
  EXPECT_EQ(ls[0].entry, "kg_linear_backward_input_f64");
  EXPECT_EQ(ls[1].entry, "kg_linear_backward_weight_f64");
  EXPECT_EQ(ls[2].entry, "kg_linear_backward_bias_f64");
  const kg::Dim3 gx = ls[0].grid, gw = ls[1].grid, gb = ls[2].grid;
  EXPECT_EQ(gx.x, 2u);  // 70 input features, 64-wide tiles
  EXPECT_EQ(gx.y, 1u);  // 6 rows
  EXPECT_EQ(gw.x, 2u);
  EXPECT_EQ(gw.y, 2u);  // 65 output features
  EXPECT_EQ(gb.x, 65u);
  for (const kg::Launch& l : ls) EXPECT_EQ(l.block.x, 256u);
  const kg::KernelArgs& args = ls[0].args;
  ASSERT_EQ(args.size(), 6u);  // dy, w, dx, rows, in, out
  EXPECT_EQ(args.args()[0].kind(), kg::KernelArg::Kind::Pointer);
  EXPECT_EQ(args.args()[3].kind(), kg::KernelArg::Kind::I64);
  std::int64_t rows = 0;
  std::memcpy(&rows, args.args()[3].data().data(), sizeof rows);
  EXPECT_EQ(rows, 6);
  EXPECT_EQ(ls[2].args.size(), 4u);  // dy, db, rows, out
  t.grad_params[0].ptr = 0;  // not wanted: one idle block
  const kg::Dim3 idle = rt.backward_launches(t).at(1).grid;
  EXPECT_EQ(idle.x * idle.y * idle.z, 1u);
}
