// Backward of the elementwise family: activations, dropout, broadcasting tensor ⊙ tensor and the
// scalar forms. The CPU backward against central finite differences in f64 and against closed
// forms / naive loops in f32; the CUDA backward kernels under the emulator (checked mode) against
// the CPU backward; every gradient element written (NaN-poisoned buffers); dropout's gradient mask
// equal to the forward's.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "kg/kg.hpp"
#include "ops/backward_check.hpp"
#include "ops/elementwise.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;
using kg_test::random_tensor;
namespace bwd = kg_test::bwd;

namespace {

using V = std::vector<kg::SymTensor>;
using Build = std::function<kg::SymTensor(const V&)>;

struct UnaryCase {
  const char* name;
  Build build;
  // dy * f'(x), in double.
  std::function<double(double)> derivative;
};

std::vector<UnaryCase> unary_cases() {
  const double pi = 3.14159265358979323846;
  auto sig = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  return {
      {"relu", [](const V& x) { return kg::relu(x[0]); }, [](double x) { return x > 0 ? 1.0 : 0.0; }},
      {"leaky_relu", [](const V& x) { return kg::leaky_relu(x[0], 0.2); },
       [](double x) { return x > 0 ? 1.0 : 0.2; }},
      {"leaky_relu_negative_slope", [](const V& x) { return kg::leaky_relu(x[0], -0.3); },
       [](double x) { return x > 0 ? 1.0 : -0.3; }},
      {"silu", [](const V& x) { return kg::silu(x[0]); },
       [sig](double x) { return sig(x) * (1 + x * (1 - sig(x))); }},
      {"gelu_erf", [](const V& x) { return kg::gelu(x[0]); },
       [pi](double x) {
         return 0.5 * (1 + std::erf(x / std::sqrt(2.0))) + x * std::exp(-x * x / 2) / std::sqrt(2 * pi);
       }},
      {"gelu_tanh", [](const V& x) { return kg::gelu(x[0], kg::GeluApprox::Tanh); },
       [pi](double x) {
         // d/dx of 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
         const double c = std::sqrt(2 / pi), u = c * (x + 0.044715 * x * x * x), t = std::tanh(u);
         return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x);
       }},
      {"sigmoid", [](const V& x) { return kg::sigmoid(x[0]); },
       [sig](double x) { return sig(x) * (1 - sig(x)); }},
      {"tanh", [](const V& x) { return kg::tanh(x[0]); },
       [](double x) { return 1 - std::tanh(x) * std::tanh(x); }},
  };
}

using bwd::lower_context;

bwd::Problem problem(const std::vector<std::vector<std::int64_t>>& shapes, kg::DType dtype,
                     const Build& build, std::mt19937_64& rng, double lo = -2.0, double hi = 2.0) {
  bwd::Problem p{bwd::record_op(shapes, dtype, build), {}, {}, true, rng()};
  for (const auto& s : shapes) p.inputs.push_back(random_tensor(rng, dtype, s, lo, hi));
  p.params = bwd::make_params(p, rng);
  return p;
}

}  // namespace

TEST(ElementwiseBackward, UnaryMatchesFiniteDifferencesAndKernels) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& c : unary_cases()) {
    SCOPED_TRACE(c.name);
    for (const auto& shape : std::vector<std::vector<std::int64_t>>{{3, 5, 7}, {1}, {130}}) {
      bwd::check_f64(problem({shape}, kg::DType::F64, c.build, rng, -3.0, 3.0));
    }
  }
}

TEST(ElementwiseBackward, UnaryF32AgainstClosedForms) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& c : unary_cases()) {
    SCOPED_TRACE(c.name);
    // 1027 elements: 16-byte packs and a scalar remainder in the kernel.
    bwd::Problem p = problem({{1027}}, kg::DType::F32, c.build, rng, -4.0, 4.0);
    const kg::Tensor y = bwd::forward(p);
    const kg::Tensor dy = random_tensor(rng, kg::DType::F32, y.shape());
    kg::Tensor want = kg::Tensor::empty(kg::DType::F32, y.shape());
    for (std::int64_t i = 0; i < y.numel(); ++i)
      want.data<float>()[i] = static_cast<float>(dy.item(i) * c.derivative(p.inputs[0].item(i)));
    const bwd::Grads cpu = bwd::cpu_backward(p, y, dy, bwd::want_all(p));
    EXPECT_TRUE(kg_test::all_written(cpu.inputs[0]));
    EXPECT_TRUE(kg_test::all_close(cpu.inputs[0], want, 2e-5, 2e-6)) << "CPU backward vs the closed form";
    const bwd::Grads emu = bwd::emulated_backward(p, y, dy, bwd::want_all(p));
    EXPECT_TRUE(kg_test::all_written(emu.inputs[0]));
    EXPECT_TRUE(kg_test::all_close(emu.inputs[0], want, 2e-5, 2e-6))
        << "emulated backward vs the closed form";
  }
}

TEST(ElementwiseBackward, ActivationsSaveWhatTheirDerivativeReads) {
  std::mt19937_64 rng(1);
  for (const auto& c : unary_cases()) {
    SCOPED_TRACE(c.name);
    const kg::CustomData op = bwd::record_op({{4}}, kg::DType::F32, c.build);
    const kg::BackwardSaves s = op->backward_saves();
    const bool from_output =
        std::string(c.name) == "relu" || std::string(c.name) == "sigmoid" || std::string(c.name) == "tanh";
    EXPECT_EQ(s.output, from_output);
    EXPECT_EQ(s.inputs, !from_output);
    EXPECT_TRUE(op->has_cpu_backward());
    EXPECT_FALSE(op->lower_backward_source(lower_context(op, {{4}}, kg::DType::F32)).empty());
  }
}

namespace {

struct BinaryCase {
  const char* name;
  Build build;
  // The contributions dy * ∂y/∂a and dy * ∂y/∂b.
  double (*da)(double a, double b, double dy);
  double (*db)(double a, double b, double dy);
};

std::vector<BinaryCase> binary_cases() {
  return {
      {"add", [](const V& x) { return kg::add(x[0], x[1]); }, [](double, double, double g) { return g; },
       [](double, double, double g) { return g; }},
      {"sub", [](const V& x) { return kg::sub(x[0], x[1]); }, [](double, double, double g) { return g; },
       [](double, double, double g) { return -g; }},
      {"mul", [](const V& x) { return kg::mul(x[0], x[1]); },
       [](double, double b, double g) { return g * b; }, [](double a, double, double g) { return g * a; }},
      {"div", [](const V& x) { return kg::div(x[0], x[1]); },
       [](double, double b, double g) { return g / b; },
       [](double a, double b, double g) { return -g * a / (b * b); }},
  };
}

// Broadcast pairs: same shape, scalar-like, per-channel, both broadcast, fewer dims, rank 0.
const std::vector<std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>>>& broadcast_pairs() {
  static const std::vector<std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>>> v = {
      {{2, 3, 4}, {2, 3, 4}},
      {{2, 3, 4}, {1}},
      {{2, 3, 4}, {3, 1}},
      {{2, 3, 4}, {4}},
      {{3, 1}, {2, 3, 4}},
      {{1, 3, 1}, {2, 1, 4}},
      {{2, 1, 4, 1}, {1, 3, 1, 5}},
      {{2, 3, 4}, {}},
      {{5}, {1, 1}},
      {{2, 1, 3, 1, 2}, {1, 2, 1, 2, 1}},
  };
  return v;
}

// Inputs with the divisor away from zero.
bwd::Problem binary_problem(const BinaryCase& c, const std::vector<std::int64_t>& a,
                            const std::vector<std::int64_t>& b, kg::DType dtype, std::mt19937_64& rng) {
  bwd::Problem p{bwd::record_op({a, b}, dtype, c.build), {}, {}, true, rng()};
  p.inputs.push_back(random_tensor(rng, dtype, a, -2.0, 2.0));
  kg::Tensor bt = random_tensor(rng, dtype, b, 0.5, 2.0);
  for (std::int64_t i = 0; i < bt.numel(); ++i)
    if (rng() & 1) {
      if (dtype == kg::DType::F32)
        bt.data<float>()[i] = -bt.data<float>()[i];
      else
        bt.data<double>()[i] = -bt.data<double>()[i];
    }
  p.inputs.push_back(bt);
  return p;
}

// Naive reference: every output element's contribution added into the operand element it read,
// in f64. `magnitude`, when given, receives per operand the largest sum of |contribution| over its
// elements: the scale of the rounding error of the same sum in f32, in any order.
std::vector<kg::Tensor> naive_binary_grads(const BinaryCase& c, const kg::Tensor& a, const kg::Tensor& b,
                                           const kg::Tensor& dy, std::array<double, 2>* magnitude = nullptr) {
  const auto& out = dy.shape();
  const std::size_t r = out.size();
  std::vector<double> ga(static_cast<std::size_t>(a.numel()), 0.0),
      gb(static_cast<std::size_t>(b.numel()), 0.0), abs_a(ga.size(), 0.0), abs_b(gb.size(), 0.0);
  auto index_in = [&](const std::vector<std::int64_t>& s, const std::vector<std::int64_t>& idx) {
    std::int64_t off = 0;
    const std::size_t lead = r - s.size();
    for (std::size_t d = 0; d < s.size(); ++d) off = off * s[d] + (s[d] == 1 ? 0 : idx[lead + d]);
    return off;
  };
  std::vector<std::int64_t> idx(r, 0);
  for (std::int64_t i = 0; i < dy.numel(); ++i) {
    std::int64_t rem = i;
    for (std::size_t d = r; d-- > 0;) {
      idx[d] = rem % out[d];
      rem /= out[d];
    }
    const std::int64_t ia = index_in(a.shape(), idx), ib = index_in(b.shape(), idx);
    const double da = c.da(a.item(ia), b.item(ib), dy.item(i)), db = c.db(a.item(ia), b.item(ib), dy.item(i));
    ga[static_cast<std::size_t>(ia)] += da;
    gb[static_cast<std::size_t>(ib)] += db;
    abs_a[static_cast<std::size_t>(ia)] += std::abs(da);
    abs_b[static_cast<std::size_t>(ib)] += std::abs(db);
  }
  if (magnitude)
    *magnitude = {*std::max_element(abs_a.begin(), abs_a.end()), *std::max_element(abs_b.begin(), abs_b.end())};
  kg::Tensor ta = kg::Tensor::empty(a.dtype(), a.shape()), tb = kg::Tensor::empty(b.dtype(), b.shape());
  for (std::size_t k = 0; k < ga.size(); ++k) {
    kg::Tensor one =
        kg::Tensor::wrap(static_cast<std::byte*>(ta.raw()) + k * kg::dtype_size(a.dtype()), a.dtype(), {});
    one.fill(ga[k]);
  }
  for (std::size_t k = 0; k < gb.size(); ++k) {
    kg::Tensor one =
        kg::Tensor::wrap(static_cast<std::byte*>(tb.raw()) + k * kg::dtype_size(b.dtype()), b.dtype(), {});
    one.fill(gb[k]);
  }
  return {ta, tb};
}

}  // namespace

TEST(ElementwiseBackward, BinaryBroadcastMatchesFiniteDifferencesAndKernels) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& c : binary_cases()) {
    SCOPED_TRACE(c.name);
    for (const auto& [a, b] : broadcast_pairs()) {
      SCOPED_TRACE(kg::sizes_to_string(a) + " with " + kg::sizes_to_string(b));
      bwd::check_f64(binary_problem(c, a, b, kg::DType::F64, rng));
    }
  }
}

TEST(ElementwiseBackward, BinaryF32AgainstNaiveLoops) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // Small pairs, and large ones: many rows into one bias-like row (more columns than a CPU task
  // takes at once), a long contiguous reduction, a per-channel reduction over [N, C, H, W], and
  // a reduction long enough for the GPU to split it over blocks (two phases).
  auto pairs = broadcast_pairs();
  pairs.push_back({{3, 1100}, {1100}});
  pairs.push_back({{2000}, {1}});
  pairs.push_back({{4, 6, 9, 11}, {6, 1, 1}});
  pairs.push_back({{37, 33}, {37, 1}});
  pairs.push_back({{20000, 3}, {3}});  // a long reduction split over blocks on the GPU
  for (const auto& c : binary_cases()) {
    SCOPED_TRACE(c.name);
    for (const auto& [a, b] : pairs) {
      SCOPED_TRACE(kg::sizes_to_string(a) + " with " + kg::sizes_to_string(b));
      const bwd::Problem p = binary_problem(c, a, b, kg::DType::F32, rng);
      const kg::Tensor y = bwd::forward(p);
      const kg::Tensor dy = random_tensor(rng, kg::DType::F32, y.shape());
      std::array<double, 2> magnitude{};
      const auto want = naive_binary_grads(c, p.inputs[0], p.inputs[1], dy, &magnitude);
      // Both gradients, then each alone (the other passed as a null pointer / no data).
      for (const auto& w :
           std::vector<bwd::Wants>{{{true, true}, {}}, {{true, false}, {}}, {{false, true}, {}}}) {
        const bwd::Grads cpu = bwd::cpu_backward(p, y, dy, w);
        const bwd::Grads emu = bwd::emulated_backward(p, y, dy, w);
        for (std::size_t k = 0; k < 2; ++k) {
          if (!w.inputs[k]) {
            EXPECT_EQ(emu.inputs[k].raw(), nullptr);
            continue;
          }
          SCOPED_TRACE(k == 0 ? "gradient of a" : "gradient of b");
          // A long f32 sum whose terms cancel (a gradient near 0 from 20000 terms of about 1)
          // is off by a few f32 roundings of the terms' magnitude: 3e-5 against 1e4 was seen.
          // 2^-24 times that magnitude is still far below a lost or doubled term.
          const double atol = 1e-5 + std::ldexp(magnitude[k], -24);
          EXPECT_TRUE(kg_test::all_written(cpu.inputs[k]));
          EXPECT_TRUE(kg_test::all_close(cpu.inputs[k], want[k], 1e-5, atol)) << "CPU backward vs naive loops";
          EXPECT_TRUE(kg_test::all_written(emu.inputs[k]));
          EXPECT_TRUE(kg_test::all_close(emu.inputs[k], want[k], 1e-4, atol)) << "emulated backward vs naive loops";
        }
      }
    }
  }
}

TEST(ElementwiseBackward, BinarySavesOnlyWhatItReads) {
  for (const auto& c : binary_cases()) {
    SCOPED_TRACE(c.name);
    const kg::CustomData op = bwd::record_op({{2, 3}, {3}}, kg::DType::F32, c.build);
    const bool reads = std::string(c.name) == "mul" || std::string(c.name) == "div";
    EXPECT_EQ(op->backward_saves().inputs, reads);
    EXPECT_FALSE(op->backward_saves().output);
    // One launch per wanted operand (these reductions are short: not split).
    kg::LaunchTensors t;
    t.inputs = {{0, {2, 3}, kg::DType::F32}, {0, {3}, kg::DType::F32}};
    t.output = {0, {2, 3}, kg::DType::F32};
    t.grad_output = {16, {2, 3}, kg::DType::F32};
    t.grad_inputs = {{16, {2, 3}, kg::DType::F32}, {16, {3}, kg::DType::F32}};
    const auto rt = op->lower(lower_context(op, {{2, 3}, {3}}, kg::DType::F32))->runtime_op;
    const std::vector<kg::Launch> both = rt->backward_launches(t);
    ASSERT_EQ(both.size(), 2u);
    EXPECT_EQ(both[0].entry, both[1].entry);
    EXPECT_EQ(both[0].entry.substr(both[0].entry.size() - 13), "_backward_f32");
    EXPECT_EQ(both[0].args.size(), 8u);  // dy, a, b, g, partial, the reduction, which, phase
    EXPECT_EQ(rt->backward_scratch_bytes(t), 0u);
    t.grad_inputs[0].ptr = 0;
    EXPECT_EQ(rt->backward_launches(t).size(), 1u);
  }
}

TEST(ElementwiseBackward, GpuSplitsLongReductionsIntoTwoPhases) {
  // The bias of [N, 3]: three elements, each summing N values.
  const kg::CustomData op =
      bwd::record_op({{20000, 3}, {3}}, kg::DType::F32, [](const V& x) { return kg::add(x[0], x[1]); });
  const auto rt = op->lower(lower_context(op, {{20000, 3}, {3}}, kg::DType::F32))->runtime_op;
  kg::LaunchTensors t;
  t.inputs = {{0, {20000, 3}, kg::DType::F32}, {0, {3}, kg::DType::F32}};
  t.output = {0, {20000, 3}, kg::DType::F32};
  t.grad_output = {16, {20000, 3}, kg::DType::F32};
  t.grad_inputs = {{0, {20000, 3}, kg::DType::F32}, {16, {3}, kg::DType::F32}};
  const std::vector<kg::Launch> ls = rt->backward_launches(t);
  ASSERT_EQ(ls.size(), 2u);  // phase 0 over blocks, phase 1 adding their sums
  EXPECT_GT(ls[0].grid.x, 1u);
  EXPECT_EQ(ls[0].block.x, 256u);
  EXPECT_GT(rt->backward_scratch_bytes(t), 3 * sizeof(float));
}

TEST(ElementwiseBackward, GpuReductionNamesTheOpBeyondEightMergedDims) {
  // Operands that alternate between broadcast and not in 18 dims: nothing merges.
  std::vector<std::int64_t> a, b, out;
  for (int d = 0; d < 18; ++d) {
    a.push_back(d % 2 ? 1 : 2);
    b.push_back(d % 2 ? 2 : 1);
    out.push_back(2);
  }
  const kg::CustomData op =
      bwd::record_op({a, b}, kg::DType::F32, [](const V& x) { return kg::add(x[0], x[1]); });
  const auto rt = op->lower(lower_context(op, {a, b}, kg::DType::F32))->runtime_op;
  kg::LaunchTensors t;
  t.inputs = {{0, a, kg::DType::F32}, {0, b, kg::DType::F32}};
  t.output = {0, out, kg::DType::F32};
  t.grad_inputs = {{16, a, kg::DType::F32}, {16, b, kg::DType::F32}};
  t.grad_output = {16, out, kg::DType::F32};
  kg_test::expect_error([&] { rt->backward_launches(t); },
                        {"nn.add", "backward", "more than 8", "dims after merging"});
}

TEST(ElementwiseBackward, ScalarFormsMatchFiniteDifferencesAndClosedForms) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const double s = 1.75;
  struct C {
    const char* name;
    Build build;
    double (*d)(double x, double s);
  };
  const std::vector<C> cases = {
      {"add", [s](const V& x) { return kg::add(x[0], s); }, [](double, double) { return 1.0; }},
      {"radd", [s](const V& x) { return s + x[0]; }, [](double, double) { return 1.0; }},
      {"sub", [s](const V& x) { return kg::sub(x[0], s); }, [](double, double) { return 1.0; }},
      {"rsub", [s](const V& x) { return kg::rsub(x[0], s); }, [](double, double) { return -1.0; }},
      {"mul", [s](const V& x) { return kg::mul(x[0], s); }, [](double, double k) { return k; }},
      {"div", [s](const V& x) { return kg::div(x[0], s); }, [](double, double k) { return 1.0 / k; }},
      {"rdiv", [s](const V& x) { return kg::rdiv(x[0], s); },
       [](double x, double k) { return -k / (x * x); }},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    // f64: finite differences (inputs away from zero for rdiv) and kernels.
    bwd::Problem p = problem({{3, 43}}, kg::DType::F64, c.build, rng, 0.5, 2.0);
    bwd::check_f64(p);
    // f32: the closed form.
    bwd::Problem q = problem({{1029}}, kg::DType::F32, c.build, rng, 0.5, 2.0);
    const kg::Tensor y = bwd::forward(q);
    const kg::Tensor dy = random_tensor(rng, kg::DType::F32, y.shape());
    kg::Tensor want = kg::Tensor::empty(kg::DType::F32, y.shape());
    for (std::int64_t i = 0; i < y.numel(); ++i)
      want.data<float>()[i] = static_cast<float>(dy.item(i) * c.d(q.inputs[0].item(i), s));
    const auto w = bwd::want_all(q);
    const bwd::Grads cpu = bwd::cpu_backward(q, y, dy, w);
    EXPECT_TRUE(kg_test::all_written(cpu.inputs[0]));
    EXPECT_TRUE(kg_test::all_close(cpu.inputs[0], want, 1e-5, 1e-6));
    const bwd::Grads emu = bwd::emulated_backward(q, y, dy, w);
    EXPECT_TRUE(kg_test::all_written(emu.inputs[0]));
    EXPECT_TRUE(kg_test::all_close(emu.inputs[0], want, 1e-5, 1e-6));
    EXPECT_EQ(q.op->backward_saves().inputs, std::string(c.name) == "rdiv");
  }
}

TEST(ElementwiseBackward, DropoutTrainGradientMaskIsTheForwardMask) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const double prob : {0.3, 0.75}) {
    SCOPED_TRACE("p " + std::to_string(prob));
    bwd::Problem p = problem(
        {{8, 301}}, kg::DType::F32, [prob](const V& x) { return kg::dropout(x[0], prob); }, rng, 0.5,
        1.5);  // no zero inputs: a zero output is a dropped element
    const kg::Tensor y = bwd::forward(p);
    const kg::Tensor dy = random_tensor(rng, kg::DType::F32, y.shape(), 0.5, 1.5);
    const auto w = bwd::want_all(p);
    const bwd::Grads cpu = bwd::cpu_backward(p, y, dy, w);
    const bwd::Grads emu = bwd::emulated_backward(p, y, dy, w);
    const float scale = static_cast<float>(1.0 / (1.0 - prob));
    std::int64_t dropped = 0;
    for (std::int64_t i = 0; i < y.numel(); ++i) {
      const float yi = y.data<float>()[i], gi = cpu.inputs[0].data<float>()[i];
      if (yi == 0.0f) {
        ++dropped;
        ASSERT_EQ(gi, 0.0f) << "element " << i << " was dropped in the forward";
      } else {
        ASSERT_EQ(gi, dy.data<float>()[i] * scale) << "element " << i << " was kept in the forward";
      }
    }
    // The fraction dropped is about p.
    EXPECT_NEAR(static_cast<double>(dropped) / static_cast<double>(y.numel()), prob, 0.05);
    EXPECT_EQ(std::memcmp(emu.inputs[0].raw(), cpu.inputs[0].raw(), cpu.inputs[0].nbytes()), 0)
        << "the GPU backward draws another mask than the CPU";

    // The training forward kernel draws the CPU forward's mask too.
    kg::Tensor gy = bwd::poisoned(kg::DType::F32, y.shape());
    kg::KernelArgs pack;
    pack.pointer(bwd::address(p.inputs[0]));
    pack.pointer(bwd::address(gy));
    pack.i64(y.numel());
    pack.i64(static_cast<std::int64_t>(p.seed));
    pack.i64(static_cast<std::int64_t>(std::ldexp(prob, 32)));
    pack.f64(1.0 / (1.0 - prob));
    const std::string source =
        "#define KG_EW_ONE_ENTRY\n" + kg::compile::kernel_source("elementwise_backward.cu") +
        "\nextern \"C\" __global__ void __launch_bounds__(KG_EW_THREADS) train_f32(const float* x, float* y, "
        "long long n, long long seed, long long threshold, double scale) {\n"
        "  kg_dropout_train_entry(x, y, n, seed, threshold, scale);\n}\n";
    kg::emu::launch("dropout_train", source, "train_f32", {4, 1, 1}, {256, 1, 1}, 0, pack);
    EXPECT_EQ(std::memcmp(gy.raw(), y.raw(), y.nbytes()), 0) << "the GPU training forward draws another mask";
  }
}

TEST(ElementwiseBackward, DropoutEvalAndZeroProbabilityAreTheIdentity) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const bool training : {false, true}) {
    const double prob = training ? 0.0 : 0.4;
    bwd::Problem p = problem(
        {{5, 77}}, kg::DType::F32, [prob](const V& x) { return kg::dropout(x[0], prob); }, rng);
    p.training = training;
    const kg::Tensor y = bwd::forward(p);
    const kg::Tensor dy = random_tensor(rng, kg::DType::F32, y.shape());
    const auto w = bwd::want_all(p);
    const bwd::Grads cpu = bwd::cpu_backward(p, y, dy, w);
    EXPECT_EQ(std::memcmp(cpu.inputs[0].raw(), dy.raw(), dy.nbytes()), 0);
    // The kernel in inference mode (a RuntimeOp built for it), and with p = 0 in training.
    const bwd::Grads emu =
        bwd::emulated_backward(p, y, dy, w, kg::ops::dropout_runtime(prob, kg::DType::F32, training));
    EXPECT_EQ(std::memcmp(emu.inputs[0].raw(), dy.raw(), dy.nbytes()), 0);
  }
}

TEST(ElementwiseBackward, DropoutTrainMatchesFiniteDifferences) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  bwd::check_f64(problem(
      {{4, 33}}, kg::DType::F64, [](const V& x) { return kg::dropout(x[0], 0.5); }, rng));
  bwd::Problem eval = problem(
      {{4, 33}}, kg::DType::F64, [](const V& x) { return kg::dropout(x[0], 0.5); }, rng);
  eval.training = false;
  // The op's kernel runs in training mode; inference is checked on the CPU here.
  bwd::check_f64(eval, false);
}

TEST(ElementwiseBackward, GradientCheckerPasses) {
  using S = std::vector<std::vector<std::int64_t>>;
  const struct {
    const char* name;
    S shapes;
    Build build;
    bool training;
  } cases[] = {
      {"gelu", {{3, 11}}, [](const V& x) { return kg::gelu(x[0]); }, true},
      {"leaky_relu", {{3, 11}}, [](const V& x) { return kg::leaky_relu(x[0], 0.1); }, true},
      {"mul_broadcast", {{2, 3, 4}, {3, 1}}, [](const V& x) { return kg::mul(x[0], x[1]); }, true},
      {"sub_broadcast", {{2, 1, 4}, {3, 1}}, [](const V& x) { return kg::sub(x[0], x[1]); }, true},
      {"rsub", {{6}}, [](const V& x) { return kg::rsub(x[0], 3.0); }, true},
      {"dropout_train", {{4, 9}}, [](const V& x) { return kg::dropout(x[0], 0.4); }, true},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    for (const kg::DType dt : {kg::DType::F64, kg::DType::F32}) {
      bwd::check_with_checker(bwd::record_op(c.shapes, dt, c.build), c.shapes, dt, c.training);
    }
  }
  // Dropout in inference: the CPU backward (the kernel runs in training mode).
  bwd::check_with_checker(
      bwd::record_op({{4, 9}}, kg::DType::F64, [](const V& x) { return kg::dropout(x[0], 0.4); }), {{4, 9}},
      kg::DType::F64, false, false);
}
