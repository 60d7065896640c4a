// The pointwise family's elementwise forms (ops/pointwise.hpp, docs/fusion.md): chains of pw.*
// functions fuse into one kg.fused_elementwise node and give the unfused values on the CPU (the
// forms' CPU functions) and under the CUDA emulator (their device sources in the generated
// kernels, checked mode); a pw.clip after a convolution becomes its epilogue; functions with bool
// results, Where and the bitwise ops have no form and stay their own nodes.
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <set>

#include "compile/compiler.hpp"
#include "lower/dry_run.hpp"
#include "ops/pointwise.hpp"
#include "support/test_util.hpp"

using kg::DType;
using kg::ops::PointwiseFn;
using kg_test::fresh_seed;
using F = PointwiseFn;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

int count_ops(const kg::Model& m, const std::string& op = "") {
  int n = 0;
  for (int id : m.live_nodes()) {
    const kg::Node& node = m.graph().node(id);
    n += node.kind == kg::Node::Kind::Op && (op.empty() || node.op_name() == op);
  }
  return n;
}

// The kernels a model launches: its op nodes but a fused group's extra outputs (kg.group_output
// nodes are views of the group's buffers).
int count_kernels(const kg::Model& m) { return count_ops(m) - count_ops(m, "kg.group_output"); }

kg::SymTensor pw(PointwiseFn fn, const std::vector<kg::SymTensor>& xs, const std::vector<double>& attrs = {},
                 const std::string& name = "") {
  return kg::ops::pointwise(fn, xs, attrs, name);
}

// "pw.clip min=0 max=6 f32"
std::string label(PointwiseFn fn, const std::vector<double>& attrs, DType dt) {
  const std::string a = kg::ops::pointwise_op(fn, attrs)->attributes();
  return std::string(kg::ops::pointwise_name(fn)) + (a.empty() ? "" : " " + a) + " " + std::string(kg::dtype_name(dt));
}

double tolerance(DType dt) { return dt == DType::F32 ? 2e-5 : 1e-11; }

// Runs the graph fused and unfused with the same inputs: the fused model on the CPU (the forms'
// CPU functions) and checked under the emulator (the generated kernels). Expects the unfused
// outputs and returns the fused model.
kg::Model compare(const std::shared_ptr<kg::Graph>& g, const std::vector<kg::SymTensor>& outs,
                  const std::vector<kg::Tensor>& inputs, double tol) {
  std::vector<std::vector<std::int64_t>> shapes;
  for (const auto& t : inputs) shapes.push_back(t.shape());
  kg::Model fused(g, outs);
  kg::Model plain(g, outs, kg::LoweringMode::Inference, {.fusion = false});
  kg::LoadOptions poisoned;
  poisoned.poison_buffers = true;
  kg::LoadOptions checked;
  checked.checked = true;
  const auto want = plain.load(kg::Device::cpu(), shapes, poisoned).forward(inputs);
  const auto got_cpu = fused.load(kg::Device::cpu(), shapes, poisoned).forward(inputs);
  const auto got_emu = fused.load(kg::Device::cpu(), shapes, checked).forward(inputs);
  EXPECT_EQ(got_cpu.size(), want.size());
  EXPECT_EQ(got_emu.size(), want.size());
  for (std::size_t i = 0; i < want.size() && i < got_cpu.size() && i < got_emu.size(); ++i) {
    SCOPED_TRACE("output " + std::to_string(i));
    EXPECT_TRUE(kg_test::all_written(want[i]));
    EXPECT_TRUE(kg_test::all_written(got_cpu[i]));
    EXPECT_TRUE(kg_test::all_close(got_cpu[i], want[i], tol, tol));
    EXPECT_TRUE(kg_test::all_close(got_emu[i], want[i], tol, tol));
  }
  return fused;
}

// One use of each function with a float result, on inputs in its domain: the graph inputs are
// x (any value), unit (|v| < 1), pos (positive), big (> 1), a row of any values and a row of
// positive values (both broadcast against x).
struct Inputs {
  kg::SymTensor x, unit, pos, big, row, row_pos;
};

struct Use {
  PointwiseFn fn;
  std::vector<double> attrs;
  std::function<std::vector<kg::SymTensor>(const Inputs&)> args;
};

std::vector<Use> float_uses() {
  auto x = [](const Inputs& i) { return std::vector<kg::SymTensor>{i.x}; };
  auto unit = [](const Inputs& i) { return std::vector<kg::SymTensor>{i.unit}; };
  auto pos = [](const Inputs& i) { return std::vector<kg::SymTensor>{i.pos}; };
  auto x_row = [](const Inputs& i) { return std::vector<kg::SymTensor>{i.x, i.row}; };
  auto row_x = [](const Inputs& i) { return std::vector<kg::SymTensor>{i.row, i.x}; };
  auto x_row_pos = [](const Inputs& i) { return std::vector<kg::SymTensor>{i.x, i.row_pos}; };
  return {
      {F::Neg, {}, x},
      {F::Abs, {}, x},
      {F::Exp, {}, x},
      {F::Log, {}, pos},
      {F::Sqrt, {}, pos},
      {F::Reciprocal, {}, pos},
      {F::Erf, {}, x},
      {F::Sin, {}, x},
      {F::Cos, {}, x},
      {F::Tan, {}, unit},
      {F::Asin, {}, unit},
      {F::Acos, {}, unit},
      {F::Atan, {}, x},
      {F::Sinh, {}, x},
      {F::Cosh, {}, x},
      {F::Asinh, {}, x},
      {F::Acosh, {}, [](const Inputs& i) { return std::vector<kg::SymTensor>{i.big}; }},
      {F::Atanh, {}, unit},
      {F::Floor, {}, x},
      {F::Ceil, {}, x},
      {F::Round, {}, x},
      {F::Sign, {}, x},
      {F::Relu, {}, x},
      {F::Sigmoid, {}, x},
      {F::Tanh, {}, x},
      {F::Softplus, {}, x},
      {F::Softsign, {}, x},
      {F::Elu, {0.7}, x},
      {F::Selu, {1.67, 1.05}, x},
      {F::Celu, {1.3}, x},
      {F::LeakyRelu, {0.15}, x},
      {F::HardSigmoid, {0.3, 0.4}, x},
      {F::HardSwish, {}, x},
      {F::ThresholdedRelu, {0.45}, x},
      {F::Mish, {}, x},
      {F::Clip, {-0.6, 0.85}, x},
      {F::Clip, {-kInf, 0.3}, x},
      {F::Clip, {-0.2, kInf}, x},
      {F::Identity, {}, x},
      {F::Add, {}, x_row},
      {F::Sub, {}, row_x},
      {F::Mul, {}, x_row},
      {F::Div, {}, x_row_pos},
      {F::Pow, {}, [](const Inputs& i) { return std::vector<kg::SymTensor>{i.pos, i.row}; }},
      {F::Max, {}, x_row},
      {F::Min, {}, row_x},
      {F::Mod, {}, x_row_pos},
      {F::FMod, {}, x_row_pos},
      {F::PRelu, {}, x_row},
  };
}

struct Recorded {
  std::shared_ptr<kg::Graph> graph;
  Inputs in;
};

Recorded record_inputs(DType dt) {
  auto [x, g] = kg::SymTensor::input(dt, {kg::Dim::named("batch"), 4, 5}, "x");
  Inputs in{x,
            g->input(dt, {kg::Dim::named("batch"), 4, 5}, "unit"),
            g->input(dt, {kg::Dim::named("batch"), 4, 5}, "pos"),
            g->input(dt, {kg::Dim::named("batch"), 4, 5}, "big"),
            g->input(dt, {5}, "row"),
            g->input(dt, {5}, "row_pos")};
  return {g, in};
}

std::vector<kg::Tensor> random_inputs(std::mt19937_64& rng, DType dt, std::int64_t batch) {
  const std::vector<std::int64_t> full{batch, 4, 5};
  return {kg_test::random_tensor(rng, dt, full, -3.0, 3.0),   kg_test::random_tensor(rng, dt, full, -0.9, 0.9),
          kg_test::random_tensor(rng, dt, full, 0.1, 3.0),    kg_test::random_tensor(rng, dt, full, 1.1, 3.0),
          kg_test::random_tensor(rng, dt, {5}, -3.0, 3.0),    kg_test::random_tensor(rng, dt, {5}, 0.5, 2.0)};
}

}  // namespace

// Each float function followed by pw.neg is one fused node whose CPU form gives the unfused values
// (the same scalar function: equal to rounding), for f32 and f64.
TEST(PointwiseFusion, EveryFloatFunctionFusesWithTheUnfusedValuesOnTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (DType dt : {DType::F32, DType::F64}) {
    for (const Use& u : float_uses()) {
      SCOPED_TRACE(label(u.fn, u.attrs, dt));
      auto [g, in] = record_inputs(dt);
      auto y = pw(F::Neg, {pw(u.fn, u.args(in), u.attrs, "f")}, {}, "out");
      kg::Model fused(g, {y});
      kg::Model plain(g, {y}, kg::LoweringMode::Inference, {.fusion = false});
      EXPECT_EQ(count_ops(plain), 2);
      EXPECT_EQ(count_ops(fused), 1);
      EXPECT_EQ(count_ops(fused, "kg.fused_elementwise"), 1);
      const auto inputs = random_inputs(rng, dt, 3);
      std::vector<std::vector<std::int64_t>> shapes;
      for (const auto& t : inputs) shapes.push_back(t.shape());
      kg::LoadOptions poisoned;
      poisoned.poison_buffers = true;
      const auto want = plain.load(kg::Device::cpu(), shapes, poisoned).forward(inputs)[0];
      const auto got = fused.load(kg::Device::cpu(), shapes, poisoned).forward(inputs)[0];
      EXPECT_TRUE(kg_test::all_written(want));
      EXPECT_TRUE(kg_test::all_close(got, want, dt == DType::F32 ? 1e-6 : 1e-14, 1e-7));
    }
  }
}

// Every float function in one group (a sum of them all over six inputs, two of them broadcast
// rows): the generated kernel, with each function's device source, gives the unfused values under
// the emulator.
TEST(PointwiseFusion, EveryFloatFunctionInOneGeneratedKernel) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (DType dt : {DType::F32, DType::F64}) {
    SCOPED_TRACE(std::string(kg::dtype_name(dt)));
    auto [g, in] = record_inputs(dt);
    const std::vector<Use> uses = float_uses();
    kg::SymTensor sum;
    for (std::size_t k = 0; k < uses.size(); ++k) {
      const kg::SymTensor v = pw(uses[k].fn, uses[k].args(in), uses[k].attrs, "f" + std::to_string(k));
      sum = k == 0 ? pw(F::Add, {v, in.x}) : pw(F::Add, {sum, v});
    }
    kg::Model m = compare(g, {sum}, random_inputs(rng, dt, 2), tolerance(dt));
    EXPECT_EQ(count_ops(m), 1);
    EXPECT_EQ(count_ops(m, "kg.fused_elementwise"), 1);
  }
}

// Random chains of unary and binary pw functions over inputs that broadcast in several ways (a
// scalar, a channel vector, a row, a full tensor): fewer kernels, the same values fused and
// unfused. (Kernels, not nodes: a group with two outputs adds a view node for the second, so a
// graph of 4 nodes fused into 2 kernels still has 4 nodes, as with seed 11473901723876400179.)
TEST(PointwiseFusion, RandomBroadcastingChainsAgreeFusedAndUnfused) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 8; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const DType dt = trial % 3 == 2 ? DType::F64 : DType::F32;
    auto [x, g] = kg::SymTensor::input(dt, {kg::Dim::named("batch"), 3, 5, 6}, "x");
    std::vector<kg::SymTensor> values{x, g->input(dt, {3, 1, 1}, "c"), g->input(dt, {1}, "s"),
                                      g->input(dt, {6}, "row"), g->input(dt, {kg::Dim::named("batch"), 3, 5, 6}, "y")};
    std::uniform_int_distribution<int> pick_op(0, 13);
    std::uniform_real_distribution<double> bound(-1.0, 1.0);
    // Every value stays within a few hundred: products and quotients take a bounded factor, exp
    // and pow bounded arguments, the base of pow is positive.
    for (int k = 0; k < 10; ++k) {
      auto pick = [&] { return values[std::uniform_int_distribution<std::size_t>(0, values.size() - 1)(rng)]; };
      const std::string name = "n" + std::to_string(k);
      const kg::SymTensor a = pick(), b = pick();
      kg::SymTensor v;
      switch (pick_op(rng)) {
        case 0: v = pw(F::Add, {a, b}, {}, name); break;
        case 1: v = pw(F::Sub, {a, b}, {}, name); break;
        case 2: v = pw(F::Mul, {a, pw(F::Tanh, {b})}, {}, name); break;
        case 3: v = pw(F::Div, {a, pw(F::Exp, {pw(F::Tanh, {b})})}, {}, name); break;
        case 4: v = pw(F::Max, {a, b}, {}, name); break;
        case 5: v = pw(F::Min, {a, b}, {}, name); break;
        case 6: v = pw(F::Pow, {pw(F::Exp, {pw(F::Clip, {a}, {-1.5, 1.5})}), pw(F::Tanh, {b})}, {}, name); break;
        case 7: v = pw(F::Relu, {a}, {}, name); break;
        case 8: v = pw(F::Sigmoid, {a}, {}, name); break;
        case 9: {
          const double lo = bound(rng), hi = lo + 0.5 + bound(rng) * 0.4;
          v = pw(F::Clip, {a}, {trial % 2 ? -kInf : lo, hi}, name);
          break;
        }
        case 10: v = pw(F::Exp, {pw(F::Clip, {a}, {-kInf, 2.0})}, {}, name); break;
        case 11: v = pw(F::LeakyRelu, {a}, {0.25}, name); break;
        case 12: v = pw(F::HardSigmoid, {a}, {0.2, 0.5}, name); break;
        default: v = pw(F::Elu, {pw(F::Neg, {a})}, {1.2}, name); break;
      }
      values.push_back(v);
    }
    // Two outputs: the last value broadcast against x (the full shape), and one more.
    std::vector<kg::SymTensor> outs{pw(F::Add, {values.back(), x}, {}, "out0"), values[values.size() - 3]};
    const std::vector<std::vector<std::int64_t>> shapes{{2, 3, 5, 6}, {3, 1, 1}, {1}, {6}, {2, 3, 5, 6}};
    std::vector<kg::Tensor> inputs;
    for (const auto& s : shapes) inputs.push_back(kg_test::random_tensor(rng, dt, s, -2.0, 2.0));
    kg::Model m = compare(g, outs, inputs, tolerance(dt));
    kg::Model plain(g, outs, kg::LoweringMode::Inference, {.fusion = false});
    EXPECT_LT(count_kernels(m), count_ops(plain));
    EXPECT_GE(count_ops(m, "kg.fused_elementwise"), 1);
  }
}

// relu6 written as ONNX writes it (Clip after Conv) becomes the convolution's epilogue; so does a
// Clip with an open side, and a sigmoid in f64.
TEST(PointwiseFusion, AClipAfterAConvolutionIsItsEpilogue) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    DType dt;
    PointwiseFn fn;
    std::vector<double> attrs;
  };
  for (const Case& c : {Case{DType::F32, F::Clip, {0.0, 6.0}}, Case{DType::F32, F::Clip, {-0.25, 0.3}},
                        Case{DType::F32, F::Clip, {-kInf, 0.1}}, Case{DType::F64, F::Sigmoid, {}}}) {
    SCOPED_TRACE(label(c.fn, c.attrs, c.dt));
    auto [x, g] = kg::SymTensor::input(c.dt, {kg::Dim::named("batch"), 3, 9, 9}, "x");
    auto y = pw(c.fn, {kg::nn::conv2d(x, 8, 3, {.padding = 1}, "conv")}, c.attrs, "act");
    kg::Model fused(g, {y});
    kg::Model plain(g, {y}, kg::LoweringMode::Inference, {.fusion = false});
    EXPECT_EQ(count_ops(plain), 2);
    EXPECT_EQ(count_ops(fused), 1);
    ASSERT_EQ(count_ops(fused, "nn.fused_conv2d"), 1);
    for (int id : fused.live_nodes()) {
      const kg::Node& n = fused.graph().node(id);
      if (n.kind != kg::Node::Kind::Op) continue;
      EXPECT_NE(n.op->op().attributes().find(kg::ops::pointwise_name(c.fn)), std::string::npos)
          << n.op->op().attributes();
    }
    const std::vector<std::vector<std::int64_t>> shapes{{2, 3, 9, 9}};
    auto mp = plain.load(kg::Device::cpu(), shapes);
    std::map<std::string, kg::Tensor> params;
    for (const auto& info : plain.parameters()) params[info.name] = kg_test::random_tensor(rng, c.dt, info.shape);
    mp.load_state_dict(params);
    const auto in = kg_test::random_tensor(rng, c.dt, shapes[0]);
    const auto want = mp.forward({in})[0];
    kg::LoadOptions checked;
    checked.checked = true;
    for (const kg::LoadOptions& opt : {kg::LoadOptions{}, checked}) {
      SCOPED_TRACE(opt.checked ? "emulated kernels" : "cpu");
      auto mf = fused.load(kg::Device::cpu(), shapes, opt);
      mf.load_state_dict(params);
      const auto got = mf.forward({in})[0];
      EXPECT_TRUE(kg_test::all_written(got));
      EXPECT_TRUE(kg_test::all_close(got, want, 1e-5, 1e-5));
    }
    if (c.fn == F::Clip) {  // the bounds are reached, so a wrong one shows
      int at_bound = 0;
      for (std::int64_t i = 0; i < want.numel(); ++i) {
        const double v = want.item(i);
        at_bound += v == static_cast<double>(static_cast<float>(c.attrs[0])) ||
                    v == static_cast<double>(static_cast<float>(c.attrs[1]));
      }
      EXPECT_GT(at_bound, 0);
    }
  }
}

// Comparisons (bool results), IsNaN, Where, the logical and bitwise ops have no form, nor does any
// function on integers; the float forms have no derivative (the family has no backward).
TEST(PointwiseFusion, OnlyFloatResultsOfTheInputsDtypeHaveForms) {
  const std::set<PointwiseFn> none{F::IsNaN,   F::IsInf,          F::Not, F::Equal, F::Less,       F::LessOrEqual,
                                   F::Greater, F::GreaterOrEqual, F::And, F::Or,    F::Xor,        F::BitwiseAnd,
                                   F::BitwiseOr, F::BitwiseXor,   F::Where};
  for (int k = 0; k <= static_cast<int>(F::Where); ++k) {
    const auto fn = static_cast<PointwiseFn>(k);
    SCOPED_TRACE(kg::ops::pointwise_name(fn));
    const int attrs = fn == F::Selu || fn == F::HardSigmoid || fn == F::Clip                            ? 2
                      : fn == F::Elu || fn == F::Celu || fn == F::LeakyRelu || fn == F::ThresholdedRelu ? 1
                                                                                                        : 0;
    const kg::CustomData op = kg::ops::pointwise_op(fn, std::vector<double>(static_cast<std::size_t>(attrs), 0.5));
    const std::size_t n = static_cast<std::size_t>(kg::ops::pointwise_arity(fn));
    for (DType dt : {DType::F32, DType::F64}) {
      const auto form = op->elementwise_form(std::vector<DType>(n, dt));
      EXPECT_EQ(form.has_value(), !none.contains(fn)) << std::string(kg::dtype_name(dt));
      if (!form) continue;
      EXPECT_EQ(form->function, "f");
      EXPECT_TRUE(form->cpu);
      EXPECT_TRUE(form->derivative.empty());
      EXPECT_FALSE(form->cpu_derivative);
    }
    for (DType dt : {DType::I32, DType::I64, DType::U8, DType::Bool, DType::F16})
      EXPECT_FALSE(op->elementwise_form(std::vector<DType>(n, dt)).has_value()) << std::string(kg::dtype_name(dt));
    if (n == 2) {
      EXPECT_FALSE(op->elementwise_form({DType::F32, DType::F64}).has_value());
    }
    EXPECT_FALSE(op->elementwise_form(std::vector<DType>(n + 1, DType::F32)).has_value());
  }
}

// A comparison splits a chain: the float functions before it fuse, the comparison stays its own
// node (bool output), and the values agree.
TEST(PointwiseFusion, AComparisonIsNotFused) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(DType::F32, {kg::Dim::named("batch"), 7}, "x");
  auto y = g->input(DType::F32, {7}, "y");
  auto t = pw(F::Mul, {pw(F::Sigmoid, {x}, {}, "sig"), y}, {}, "mul");
  auto c = pw(F::Less, {t, pw(F::Relu, {y}, {}, "ry")}, {}, "less");
  const std::vector<kg::Tensor> inputs{kg_test::random_tensor(rng, DType::F32, {5, 7}, -2.0, 2.0),
                                       kg_test::random_tensor(rng, DType::F32, {7}, -2.0, 2.0)};
  kg::Model fused(g, {c});
  kg::Model plain(g, {c}, kg::LoweringMode::Inference, {.fusion = false});
  EXPECT_EQ(count_ops(plain), 4);
  EXPECT_EQ(count_ops(fused), 3);  // sigmoid and mul in one group; relu alone; less
  EXPECT_EQ(count_ops(fused, "kg.fused_elementwise"), 1);
  EXPECT_EQ(count_ops(fused, "pw.less"), 1);
  EXPECT_EQ(count_ops(fused, "pw.relu"), 1);
  const auto want = plain.load(kg::Device::cpu(), {{5, 7}, {7}}).forward(inputs)[0];
  ASSERT_EQ(want.dtype(), DType::Bool);
  kg::LoadOptions checked;
  checked.checked = true;
  for (const kg::LoadOptions& opt : {kg::LoadOptions{}, checked}) {
    SCOPED_TRACE(opt.checked ? "emulated kernels" : "cpu");
    const auto got = fused.load(kg::Device::cpu(), {{5, 7}, {7}}, opt).forward(inputs)[0];
    ASSERT_EQ(got.dtype(), DType::Bool);
    ASSERT_EQ(got.numel(), want.numel());
    for (std::int64_t i = 0; i < want.numel(); ++i) EXPECT_EQ(got.item(i), want.item(i)) << i;
  }
}

// Where NVRTC is present: the generated group of every float function and a Clip epilogue compile
// for sm_90 (the group's module includes pointwise.cuh, the epilogue's through the form's source).
TEST(PointwiseFusion, GeneratedKernelsCompileWithNvrtc) {
  if (!kg::compile::Compiler::available())
    GTEST_SKIP() << "no NVRTC: " << kg::compile::Compiler::unavailable_reason();
  for (DType dt : {DType::F32, DType::F64}) {
    SCOPED_TRACE(std::string(kg::dtype_name(dt)));
    auto [g, in] = record_inputs(dt);
    kg::SymTensor sum = in.x;
    for (const Use& u : float_uses()) sum = pw(F::Add, {sum, pw(u.fn, u.args(in), u.attrs)});
    const kg::Model m(g, {sum});
    EXPECT_EQ(count_ops(m, "kg.fused_elementwise"), 1);
    EXPECT_NO_THROW(kg::lower::dry_run(m, {{2, 4, 5}, {2, 4, 5}, {2, 4, 5}, {2, 4, 5}, {5}, {5}}, 90));
    auto [x, gc] = kg::SymTensor::input(dt, {kg::Dim::named("batch"), 3, 9, 9}, "x");
    const kg::Model conv(gc, {pw(F::Clip, {kg::nn::conv2d(x, 8, 3, {.padding = 1})}, {-kInf, 6.0})});
    EXPECT_EQ(count_ops(conv, "nn.fused_conv2d"), 1);
    EXPECT_NO_THROW(kg::lower::dry_run(conv, {{2, 3, 9, 9}}, 90));
  }
}
