// Backward of nn.softmax and nn.log_softmax over any dim: the CPU backward against finite
// differences (f64) and against the explicit Jacobian (f32), the CUDA backward kernels under the
// emulator in each of their row layouts (a warp per row, a block per row, columns), every
// gradient element written.
#include <gtest/gtest.h>

#include <cmath>

#include "kg/kg.hpp"
#include "ops/backward_check.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;
using kg_test::random_tensor;
namespace bwd = kg_test::bwd;

namespace {

using V = std::vector<kg::SymTensor>;

struct Config {
  std::vector<std::int64_t> shape;
  std::int64_t dim;
};

// Rows (inner 1, short and longer than a warp's limit), columns (inner > 1, more than one tile
// of 32), the first dim, a scalar.
const std::vector<Config>& configs() {
  static const std::vector<Config> v = {
      {{5}, 0},       {{3, 7}, -1},   {{3, 7}, 0},  {{2, 3, 4}, 1}, {{2, 3, 40}, 1},
      {{4, 3, 2}, 0}, {{2, 1100}, 1}, {{6, 1}, -1}, {{}, 0},
  };
  return v;
}

using bwd::lower_context;

kg::CustomData softmax_op(const Config& c, bool log, kg::DType dtype) {
  return bwd::record_op({c.shape}, dtype, [&](const V& x) {
    return log ? kg::log_softmax(x[0], c.dim) : kg::softmax(x[0], c.dim);
  });
}

// dx = Jᵀ dy with the softmax's Jacobian written out, in double: J[i][j] = dy_i/dx_j over one
// softmax (s = softmax): s_i (δ_ij - s_j), or δ_ij - s_j for log_softmax.
kg::Tensor jacobian_reference(const kg::Tensor& x, const kg::Tensor& dy, std::int64_t dim, bool log) {
  const auto& s = x.shape();
  std::int64_t outer = 1, n = 1, inner = 1;
  const std::size_t d = s.empty() ? 0 : static_cast<std::size_t>(dim < 0 ? dim + std::ssize(s) : dim);
  for (std::size_t i = 0; i < s.size(); ++i) (i < d ? outer : i == d ? n : inner) *= s[i];
  kg::Tensor dx = kg::Tensor::empty(kg::DType::F32, s);
  std::vector<double> sm(static_cast<std::size_t>(n));
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t r = 0; r < inner; ++r) {
      auto at = [&](std::int64_t i) { return (o * n + i) * inner + r; };
      double mx = -INFINITY, sum = 0;
      for (std::int64_t i = 0; i < n; ++i) mx = std::max(mx, x.item(at(i)));
      for (std::int64_t i = 0; i < n; ++i) sum += std::exp(x.item(at(i)) - mx);
      for (std::int64_t i = 0; i < n; ++i)
        sm[static_cast<std::size_t>(i)] = std::exp(x.item(at(i)) - mx) / sum;
      for (std::int64_t j = 0; j < n; ++j) {
        double g = 0;
        for (std::int64_t i = 0; i < n; ++i) {
          const double sj = sm[static_cast<std::size_t>(j)], si = sm[static_cast<std::size_t>(i)];
          const double jac = log ? (i == j) - sj : si * ((i == j) - sj);
          g += jac * dy.item(at(i));
        }
        dx.data<float>()[at(j)] = static_cast<float>(g);
      }
    }
  return dx;
}

}  // namespace

TEST(SoftmaxBackward, MatchesFiniteDifferencesAndKernels) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const bool log : {false, true}) {
    for (const auto& c : configs()) {
      SCOPED_TRACE(std::string(log ? "log_softmax " : "softmax ") + kg::sizes_to_string(c.shape) + " dim " +
                   std::to_string(c.dim));
      bwd::Problem p{softmax_op(c, log, kg::DType::F64),
                     {random_tensor(rng, kg::DType::F64, c.shape, -3, 3)},
                     {},
                     true,
                     rng()};
      bwd::check_f64(p);
    }
  }
}

TEST(SoftmaxBackward, F32AgainstTheJacobian) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const bool log : {false, true}) {
    for (const auto& c : configs()) {
      SCOPED_TRACE(std::string(log ? "log_softmax " : "softmax ") + kg::sizes_to_string(c.shape) + " dim " +
                   std::to_string(c.dim));
      bwd::Problem p{softmax_op(c, log, kg::DType::F32),
                     {random_tensor(rng, kg::DType::F32, c.shape, -3, 3)},
                     {},
                     true,
                     rng()};
      const kg::Tensor y = bwd::forward(p);
      const kg::Tensor dy = random_tensor(rng, kg::DType::F32, y.shape());
      const kg::Tensor want = jacobian_reference(p.inputs[0], dy, c.dim, log);
      const auto w = bwd::want_all(p);
      const bwd::Grads cpu = bwd::cpu_backward(p, y, dy, w);
      EXPECT_TRUE(kg_test::all_written(cpu.inputs[0]));
      EXPECT_TRUE(kg_test::all_close(cpu.inputs[0], want, 1e-4, 1e-6)) << "CPU backward vs the Jacobian";
      const bwd::Grads emu = bwd::emulated_backward(p, y, dy, w);
      EXPECT_TRUE(kg_test::all_written(emu.inputs[0]));
      EXPECT_TRUE(kg_test::all_close(emu.inputs[0], want, 1e-4, 1e-6)) << "emulated backward vs the Jacobian";
    }
  }
}

TEST(SoftmaxBackward, SavesTheOutputOnly) {
  for (const bool log : {false, true}) {
    const kg::CustomData op = softmax_op({{2, 3}, 1}, log, kg::DType::F32);
    EXPECT_TRUE(op->has_cpu_backward());
    EXPECT_FALSE(op->backward_saves().inputs);
    EXPECT_TRUE(op->backward_saves().output);
    const kg::LowerContext lc = lower_context(op, {{2, 3}}, kg::DType::F32);
    EXPECT_FALSE(op->lower_backward_source(lc).empty());
    // One backward launch: (y, dy, dx, outer, n, inner).
    const auto lowered = op->lower(lc);
    ASSERT_TRUE(lowered && lowered->runtime_op);
    kg::LaunchTensors t;
    t.inputs = {{0, {2, 3}, kg::DType::F32}};
    t.output = {0x1000, {2, 3}, kg::DType::F32};
    t.grad_output = {0x2000, {2, 3}, kg::DType::F32};
    t.grad_inputs = {{0x3000, {2, 3}, kg::DType::F32}};
    const std::vector<kg::Launch> ls = lowered->runtime_op->backward_launches(t);
    ASSERT_EQ(ls.size(), 1u);
    EXPECT_EQ(ls[0].entry, log ? "kg_log_softmax_backward_f32" : "kg_softmax_backward_f32");
    EXPECT_EQ(ls[0].args.size(), 6u);
  }
}

TEST(SoftmaxBackward, GradientCheckerPasses) {
  for (const bool log : {false, true}) {
    for (const Config& c : {Config{{3, 9}, -1}, Config{{2, 5, 3}, 1}}) {
      SCOPED_TRACE(std::string(log ? "log_softmax " : "softmax ") + kg::sizes_to_string(c.shape));
      for (const kg::DType dt : {kg::DType::F64, kg::DType::F32})
        bwd::check_with_checker(softmax_op(c, log, dt), {c.shape}, dt);
    }
  }
}
