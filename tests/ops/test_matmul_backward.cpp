// The backward of nn.matmul (torch.matmul semantics): the CPU backward against central finite
// differences in f64 and the backward kernels under the CUDA emulator against it
// (kg::testing::check_gradients) for 1-D, 2-D and batched operands whose batch dims broadcast;
// the CPU backward against a naive reference that reduces over the broadcast dims, with one
// gradient not wanted; and the limit of the GPU kernel's broadcast levels.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "kg/runtime_op.hpp"
#include "kg/testing.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

using kg_test::matches;

using Sizes = std::vector<std::int64_t>;

kg::CustomData matmul_op(const Sizes& sa, const Sizes& sb, kg::DType dtype) {
  auto g = kg::Graph::create();
  kg::SymTensor a = g->input(dtype, kg::Shape::of(sa));
  kg::SymTensor b = g->input(dtype, kg::Shape::of(sb));
  kg::SymTensor c = kg::matmul(a, b, "mm");
  return *g->node(c.node()).op;
}

// What the lowering tells the op about a node C = A B of these operands, lowered for training.
kg::LowerContext lower_context(const Sizes& sa, const Sizes& sb, const Sizes& sc, kg::DType dtype) {
  kg::LowerContext lc;
  lc.node = "mm";
  lc.input_dtypes = {dtype, dtype};
  lc.output_dtype = dtype;
  lc.input_shapes = {kg::Shape::of(sa), kg::Shape::of(sb)};
  lc.output_shape = kg::Shape::of(sc);
  lc.concrete_input_shapes = {sa, sb};
  lc.concrete_output_shape = sc;
  lc.mode = kg::LoweringMode::Training;
  return lc;
}

kg::Tensor nan_tensor(kg::DType dtype, Sizes shape) {
  kg::Tensor t = kg::Tensor::empty(dtype, std::move(shape));
  t.fill(std::numeric_limits<double>::quiet_NaN());
  return t;
}

// dA and dB in double by the definition: every output batch entry adds dC Bᵀ to the A matrix it
// read and Aᵀ dC to the B matrix it read (right-aligned batch dims, size 1 broadcast).
std::pair<std::vector<double>, std::vector<double>> naive_backward(const kg::Tensor& a, const kg::Tensor& b,
                                                                   const kg::Tensor& dc) {
  const Sizes &sa = a.shape(), &sb = b.shape();
  const std::int64_t m = sa.size() >= 2 ? sa[sa.size() - 2] : 1, k = sa.back(), n = sb.size() >= 2 ? sb.back() : 1;
  Sizes ba(sa.begin(), sa.end() - std::min<std::ptrdiff_t>(2, std::ssize(sa)));
  Sizes bb(sb.begin(), sb.end() - std::min<std::ptrdiff_t>(2, std::ssize(sb)));
  const std::size_t r = std::max(ba.size(), bb.size());
  ba.insert(ba.begin(), r - ba.size(), 1);
  bb.insert(bb.begin(), r - bb.size(), 1);
  Sizes ob(r);
  std::int64_t batches = 1;
  for (std::size_t d = 0; d < r; ++d) batches *= (ob[d] = std::max(ba[d], bb[d]));
  std::vector<double> da(static_cast<std::size_t>(a.numel())), db(static_cast<std::size_t>(b.numel()));
  for (std::int64_t z = 0; z < batches; ++z) {
    std::int64_t rem = z, ia = 0, ib = 0, sta = 1, stb = 1;
    for (std::size_t d = r; d-- > 0;) {
      const std::int64_t c = rem % ob[d];
      rem /= ob[d];
      if (ba[d] != 1) ia += c * sta;
      if (bb[d] != 1) ib += c * stb;
      sta *= ba[d];
      stb *= bb[d];
    }
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        const double g = dc.item((z * m + i) * n + j);
        for (std::int64_t t = 0; t < k; ++t) {
          da[static_cast<std::size_t>((ia * m + i) * k + t)] += g * b.item((ib * k + t) * n + j);
          db[static_cast<std::size_t>((ib * k + t) * n + j)] += g * a.item((ia * m + i) * k + t);
        }
      }
  }
  return {da, db};
}

// Runs the CPU backward with the wanted gradients NaN-poisoned and compares with the reference.
void check_against_naive(const Sizes& sa, const Sizes& sb, kg::DType dt, std::mt19937_64& rng, bool want_a,
                         bool want_b) {
  SCOPED_TRACE(kg::sizes_to_string(sa) + " x " + kg::sizes_to_string(sb) + " " + std::string(kg::dtype_name(dt)) +
               " want dA/dB=" + std::to_string(want_a) + std::to_string(want_b));
  const kg::CustomData op = matmul_op(sa, sb, dt);
  const Sizes out = op->infer_output_shape({kg::Shape::of(sa), kg::Shape::of(sb)}).sizes();
  std::vector<kg::Tensor> inputs{kg_test::random_tensor(rng, dt, sa), kg_test::random_tensor(rng, dt, sb)};
  const kg::Tensor dc = kg_test::random_tensor(rng, dt, out);
  std::vector<kg::Tensor> grads{want_a ? nan_tensor(dt, sa) : kg::Tensor::wrap(nullptr, dt, sa),
                                want_b ? nan_tensor(dt, sb) : kg::Tensor::wrap(nullptr, dt, sb)};
  std::vector<kg::Tensor> no_params, no_param_grads;
  kg::CpuBackwardContext ctx(inputs, no_params, kg::Tensor::wrap(nullptr, dt, out), dc, grads, no_param_grads,
                             true, 0);
  op->cpu_backward(ctx);
  const auto [da, db] = naive_backward(inputs[0], inputs[1], dc);
  const double tol = dt == kg::DType::F32 ? 1e-4 : 1e-11;
  if (want_a) {
    EXPECT_TRUE(matches(grads[0], da, tol, tol)) << "gradient of A";
  }
  if (want_b) {
    EXPECT_TRUE(matches(grads[1], db, tol, tol)) << "gradient of B";
  }
}

// Operand pairs: 1-D, 2-D, one shared B, batch dims that broadcast on either side or both.
const std::vector<std::pair<Sizes, Sizes>>& operand_cases() {
  static const std::vector<std::pair<Sizes, Sizes>> cases = {
      {{3, 5}, {5, 4}},          {{2, 3, 5}, {5, 4}},       {{5}, {5, 4}},
      {{3, 5}, {5}},             {{5}, {2, 5, 3}},          {{2, 1, 3, 5}, {4, 5, 2}},
      {{3, 5}, {2, 5, 4}},       {{2, 3, 5}, {2, 5, 4}},    {{3, 1, 2, 4}, {1, 2, 4, 3}},
      {{2, 3, 2, 5}, {3, 5, 1}}, {{5}, {5}},
  };
  return cases;
}

}  // namespace

TEST(MatmulBackward, MatchesFiniteDifferencesAndEmulatedKernels) {
  const auto seed = fresh_seed();
  for (const auto& [sa, sb] : operand_cases()) {
    for (kg::DType dt : {kg::DType::F64, kg::DType::F32}) {
      SCOPED_TRACE(kg::sizes_to_string(sa) + " x " + kg::sizes_to_string(sb) + " " + std::string(kg::dtype_name(dt)));
      kg::testing::GradCheckOptions o;
      o.seed = seed;
      const auto rep = kg::testing::check_gradients(matmul_op(sa, sb, dt), {sa, sb}, {dt, dt}, o);
      EXPECT_TRUE(rep.ok) << rep.to_string();
    }
  }
}

TEST(MatmulBackward, EmulatedKernelsCoverSeveralTiles) {
  // Gradient matrices larger than one 64x64 tile, a reduction over several 16-deep slices and a
  // broadcast A summed over 3 output entries.
  kg::testing::GradCheckOptions o;
  o.seed = fresh_seed();
  o.max_elements = 16;
  const auto rep =
      kg::testing::check_gradients(matmul_op({70, 33}, {3, 33, 66}, kg::DType::F32), {{70, 33}, {3, 33, 66}},
                                   {kg::DType::F32, kg::DType::F32}, o);
  EXPECT_TRUE(rep.ok) << rep.to_string();
}

TEST(MatmulBackward, CpuBackwardMatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& [sa, sb] : operand_cases())
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) check_against_naive(sa, sb, dt, rng, true, true);
  // Larger products take the BLAS's own threads.
  check_against_naive({2, 70, 80}, {80, 90}, kg::DType::F32, rng, true, true);
  check_against_naive({2, 1, 70, 80}, {3, 80, 65}, kg::DType::F32, rng, true, true);
  // One gradient not wanted.
  check_against_naive({2, 1, 3, 5}, {4, 5, 2}, kg::DType::F64, rng, true, false);
  check_against_naive({2, 1, 3, 5}, {4, 5, 2}, kg::DType::F64, rng, false, true);
  check_against_naive({2, 3, 5}, {5, 4}, kg::DType::F64, rng, false, true);
}

TEST(MatmulBackward, ManyBroadcastLevelsOnTheCpuButNotOnTheGpu) {
  // Batch dims that alternate which operand broadcasts: ten levels that cannot merge.
  const Sizes sa = {2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 3}, sb = {1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 3, 2};
  std::mt19937_64 rng(fresh_seed());
  check_against_naive(sa, sb, kg::DType::F64, rng, true, true);

  const kg::CustomData op = matmul_op(sa, sb, kg::DType::F32);
  const Sizes sc = {2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2};
  const auto lowered = op->lower(lower_context(sa, sb, sc, kg::DType::F32));
  ASSERT_TRUE(lowered && lowered->runtime_op);
  kg::LaunchTensors t;
  t.inputs = {{0x1000, sa, kg::DType::F32}, {0x2000, sb, kg::DType::F32}};
  t.output = {0, sc, kg::DType::F32};
  t.grad_output = {0x3000, t.output.shape, kg::DType::F32};
  t.grad_inputs = {{0x4000, sa, kg::DType::F32}, {0x5000, sb, kg::DType::F32}};
  kg_test::expect_error([&] { lowered->runtime_op->backward_launches(t); },
                        {"nn.matmul", "10 broadcast batch levels", "handles 8"});
}

TEST(MatmulBackward, RuntimeOpLaunches) {
  const kg::CustomData op = matmul_op({2, 1, 3, 5}, {4, 5, 2}, kg::DType::F32);
  EXPECT_TRUE(op->has_cpu_backward());
  EXPECT_TRUE(op->backward_saves().inputs);
  EXPECT_FALSE(op->backward_saves().output);
  const kg::LowerContext lc = lower_context({2, 1, 3, 5}, {4, 5, 2}, {2, 4, 3, 2}, kg::DType::F32);
  const auto lowered = op->lower(lc);
  ASSERT_TRUE(lowered && lowered->runtime_op);
  EXPECT_EQ(lowered->entry_point, "kg_matmul_f32");
  EXPECT_FALSE(op->lower_backward_source(lc).empty());
  const kg::RuntimeOp& rt = *lowered->runtime_op;
  kg::LaunchTensors t;
  t.inputs = {{0x1000, {2, 1, 3, 5}, kg::DType::F32}, {0x2000, {4, 5, 2}, kg::DType::F32}};
  t.output = {0, {2, 4, 3, 2}, kg::DType::F32};
  t.grad_output = {0x3000, {2, 4, 3, 2}, kg::DType::F32};
  t.grad_inputs = {{0x4000, {2, 1, 3, 5}, kg::DType::F32}, {0x5000, {4, 5, 2}, kg::DType::F32}};
  t.training = true;
  const std::vector<kg::Launch> ls = rt.backward_launches(t);
  ASSERT_EQ(ls.size(), 2u);
  EXPECT_EQ(ls[0].entry, "kg_matmul_backward_a_f32");
  EXPECT_EQ(ls[1].entry, "kg_matmul_backward_b_f32");
  EXPECT_EQ(ls[0].grid.z, 2u);       // A's two matrices, each summed over 4 output entries
  EXPECT_EQ(ls[1].grid.z, 4u);       // B's four, each summed over 2
  ASSERT_EQ(ls[0].args.size(), 7u);  // dc, b, da, m, n, k, the batch walk
  EXPECT_EQ(ls[0].args.args()[6].kind(), kg::KernelArg::Kind::Bytes);
  t.grad_inputs[0].ptr = 0;
  const kg::Dim3 idle = rt.backward_launches(t).at(0).grid;
  EXPECT_EQ(idle.x * idle.y * idle.z, 1u);
  // The entries follow the node's dtype.
  const auto f64 = op->lower(lower_context({2, 1, 3, 5}, {4, 5, 2}, {2, 4, 3, 2}, kg::DType::F64));
  ASSERT_TRUE(f64 && f64->runtime_op);
  EXPECT_EQ(f64->entry_point, "kg_matmul_f64");
  EXPECT_EQ(f64->runtime_op->backward_launches(t).at(1).entry, "kg_matmul_backward_b_f64");
}
