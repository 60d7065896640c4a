// Vendor-library calls (RuntimeOp::library_call): what the built-in GEMM and convolution ops
// describe, computed by its definition over host addresses (the emulator's library reference)
// and compared with the ops' CPU forward; forward_device on the cpu; and, on a machine with a GPU, whole
// models with cuBLASLt and cuDNN against the CPU (TF32 off and on, tuned, turned off, on device buffers).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "backend/cuda/context.hpp"
#include "backend/emu/executor.hpp"
#include "backend/emu/library_reference.hpp"
#include "kg/kg.hpp"
#include "kg/models.hpp"
#include "lower/lowering.hpp"
#include "support/test_util.hpp"

using kg_test::all_close;
using kg_test::expect_error;
using kg_test::fresh_seed;
using kg_test::random_tensor;

namespace {

using BuildFn = std::function<kg::SymTensor(const kg::SymTensor&)>;

// A one-op model over an input of `shape` (batch dim dynamic).
kg::Model one_op_model(const std::vector<std::int64_t>& shape, const BuildFn& build,
                       kg::LoweringMode mode = kg::LoweringMode::Inference) {
  auto g = kg::Graph::create();
  kg::Shape s = kg::Shape::of(shape);
  s[0] = kg::Dim::named("batch");
  kg::SymTensor x = g->input(kg::DType::F32, s, "x");
  return kg::Model(g, {build(x)}, mode);
}

kg::DevicePtr host(const kg::Tensor& t) {
  return static_cast<kg::DevicePtr>(reinterpret_cast<std::uintptr_t>(t.raw()));
}

// Loads `model` on the cpu for `input`, then asks its only op node for a library call over host
// buffers holding the same input and parameters. Returns the call (run by the reference into
// `out`, a NaN-filled output) and the CPU forward's output.
struct Described {
  std::optional<kg::LibraryCall> call;
  kg::Tensor out, want;
  std::vector<float> scratch;
};
Described describe_and_run(const kg::Model& model, const kg::Tensor& input) {
  kg::LoadedModel cpu = model.load(kg::Device::cpu(), {input.shape()});
  Described d;
  d.want = cpu.forward({input}).at(0);
  kg::lower::LowerTarget target;
  target.concrete.resize(model.graph().nodes().size());
  target.concrete[static_cast<std::size_t>(model.graph().inputs()[0])] = input.shape();
  const int out_node = model.outputs().at(0).second;
  target.concrete[static_cast<std::size_t>(out_node)] = d.want.shape();
  const auto lowered = kg::lower::lower_model(model, target);
  const kg::lower::Executable* e = nullptr;
  for (const auto& x : lowered.executables)
    if (x.node == out_node) e = &x;
  EXPECT_NE(e, nullptr);
  if (!e) return d;
  const kg::Node& n = model.graph().node(out_node);
  std::vector<kg::Tensor> params;
  kg::LaunchTensors t;
  t.inputs.push_back({host(input), input.shape(), input.dtype()});
  for (const auto& p : n.params) {
    params.push_back(cpu.parameter(p.name));
    t.params.push_back({host(params.back()), params.back().shape(), params.back().dtype()});
  }
  d.out = kg::Tensor::empty(d.want.dtype(), d.want.shape());
  float* o = d.out.data<float>();
  std::fill(o, o + d.out.numel(), NAN);
  t.output = {host(d.out), d.out.shape(), d.out.dtype()};
  // The op's scratch (the im2col columns of a convolution's GEMM form), left for the prologue.
  if (const std::size_t bytes = e->runtime_op->scratch_bytes(t); bytes > 0) {
    d.scratch.resize(bytes / sizeof(float) + 1);
    t.scratch = static_cast<kg::DevicePtr>(reinterpret_cast<std::uintptr_t>(d.scratch.data()));
  }
  d.call = e->runtime_op->library_call(t);
  if (d.call) kg::emu::run_library_reference(*d.call, "[test]");
  return d;
}

TEST(LibraryCall, LinearIsOneGemmWithItsBias) {
  std::mt19937_64 rng(fresh_seed());
  for (bool bias : {true, false}) {
    SCOPED_TRACE(bias ? "bias" : "no bias");
    const kg::Tensor x = random_tensor(rng, kg::DType::F32, {3, 5, 7});
    const Described d = describe_and_run(
        one_op_model(x.shape(), [&](const kg::SymTensor& v) { return kg::nn::linear(v, 6, "fc", bias); }), x);
    ASSERT_TRUE(d.call.has_value());
    const auto& g = std::get<kg::GemmCall>(d.call->call);
    EXPECT_EQ(g.m, 15);
    EXPECT_EQ(g.batch, 1);
    EXPECT_EQ(g.bias != 0, bias);
    EXPECT_TRUE(d.call->epilogue.empty());
    EXPECT_TRUE(all_close(d.out, d.want, 1e-5, 1e-6));
  }
}

TEST(LibraryCall, MatmulBatchesBroadcastsAndMerges) {
  std::mt19937_64 rng(fresh_seed());
  struct Case {
    std::vector<std::int64_t> a, b;
    std::int64_t batch;  // of the described call; 0: none described
  };
  // Both operands are model inputs.
  const std::vector<Case> cases = {
      {{4, 3, 5}, {5, 2}, 1},        // B shared: one GEMM of 12 rows
      {{4, 3, 5}, {4, 5, 2}, 4},     // a strided batch
      {{4, 3, 5}, {1, 5, 2}, 4},     // B broadcast over the batch: a batch with stride 0 for B
      {{2, 3, 5}, {5}, 1},           // a 1-D B: one column
      {{2, 3, 4, 5}, {3, 5, 2}, 0},  // B broadcast over the outer dim only: two levels, the kernel's
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(kg::sizes_to_string(c.a) + " x " + kg::sizes_to_string(c.b));
    auto g = kg::Graph::create();
    kg::Shape sa = kg::Shape::of(c.a);
    sa[0] = kg::Dim::named("batch");
    kg::SymTensor a = g->input(kg::DType::F32, sa, "a");
    kg::SymTensor b = g->input(kg::DType::F32, kg::Shape::of(c.b), "b");
    kg::Model model(g, {kg::matmul(a, b, "mm")});
    const kg::Tensor ta = random_tensor(rng, kg::DType::F32, c.a),
                     tb = random_tensor(rng, kg::DType::F32, c.b);
    kg::LoadedModel cpu = model.load(kg::Device::cpu(), {c.a, c.b});
    const kg::Tensor want = cpu.forward({ta, tb}).at(0);
    kg::lower::LowerTarget target;
    target.concrete.resize(model.graph().nodes().size());
    target.concrete[static_cast<std::size_t>(model.graph().inputs()[0])] = c.a;
    target.concrete[static_cast<std::size_t>(model.graph().inputs()[1])] = c.b;
    const int out_node = model.outputs().at(0).second;
    target.concrete[static_cast<std::size_t>(out_node)] = want.shape();
    const auto lowered = kg::lower::lower_model(model, target);
    ASSERT_EQ(lowered.executables.size(), 1u);
    kg::Tensor out = kg::Tensor::empty(kg::DType::F32, want.shape());
    std::fill(out.data<float>(), out.data<float>() + out.numel(), NAN);
    kg::LaunchTensors t;
    t.inputs = {{host(ta), c.a, kg::DType::F32}, {host(tb), c.b, kg::DType::F32}};
    t.output = {host(out), want.shape(), kg::DType::F32};
    const auto call = lowered.executables[0].runtime_op->library_call(t);
    if (c.batch == 0) {
      EXPECT_FALSE(call.has_value());
      continue;
    }
    ASSERT_TRUE(call.has_value());
    EXPECT_EQ(std::get<kg::GemmCall>(call->call).batch, c.batch);
    kg::emu::run_library_reference(*call, "[test]");
    EXPECT_TRUE(all_close(out, want, 1e-5, 1e-6));
  }
}

TEST(LibraryCall, ConvolutionDescribesTheConvolutionAndLeavesTheBiasToItsEpilogue) {
  std::mt19937_64 rng(fresh_seed());
  struct Case {
    std::vector<std::int64_t> x;
    std::int64_t out;
    kg::Size2 kernel;
    kg::nn::Conv2dOptions o;
  };
  const std::vector<Case> cases = {
      {{2, 3, 9, 8}, 4, 3, {1, 1, 1, 1, false}},
      {{1, 4, 11, 11}, 6, 5, {2, 2, 1, 2, true}},
      {{2, 4, 7, 9}, 4, {3, 1}, {1, {1, 0}, 2, 4, true}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(kg::sizes_to_string(c.x));
    const kg::Tensor x = random_tensor(rng, kg::DType::F32, c.x);
    const Described d = describe_and_run(
        one_op_model(c.x,
                     [&](const kg::SymTensor& v) { return kg::nn::conv2d(v, c.out, c.kernel, c.o, "conv"); }),
        x);
    ASSERT_TRUE(d.call.has_value());
    const auto& conv = std::get<kg::Conv2dCall>(d.call->call);
    EXPECT_EQ(conv.bias, 0u);
    EXPECT_EQ(d.call->epilogue.size(), c.o.bias ? 1u : 0u);
    if (c.o.bias) {
      // The library's part is the convolution without the bias: the output less the bias.
      const kg::Model model = one_op_model(
          c.x, [&](const kg::SymTensor& v) { return kg::nn::conv2d(v, c.out, c.kernel, c.o, "conv"); });
      kg::LoadedModel cpu = model.load(kg::Device::cpu(), {c.x});
      const kg::Tensor b = cpu.parameter("conv.bias");
      kg::Tensor want = d.want.clone();
      const std::int64_t hw = want.shape()[2] * want.shape()[3];
      for (std::int64_t i = 0; i < want.numel(); ++i)
        want.data<float>()[i] -= b.data<float>()[(i / hw) % c.out];
      EXPECT_TRUE(all_close(d.out, want, 1e-4, 1e-5));
    } else {
      EXPECT_TRUE(all_close(d.out, d.want, 1e-5, 1e-6));
    }
  }
}

// An NCHW f32 convolution with one group, a small output (at most 1024 pixels over the batch) and
// a reduction of 256 or more (ResNet's later layers at batch 1) is described as a GEMM per image,
// y[n] = w · cols[n], on the weights as they are and the columns an im2col prologue writes (the
// input itself for a 1×1 convolution without stride or padding), with its bias, BatchNorm,
// residual and activation as the epilogue launch. Run by the emulator (the GEMM by its definition,
// the prologue and epilogue launches emulated) against the CPU; larger outputs, shallower
// reductions and KG_CONV_GEMM_FORM=0 keep the convolution call.
TEST(LibraryCall, SmallNchwConvolutionsAreAGemmOverTheirColumns) {
  std::mt19937_64 rng(fresh_seed());
  struct Case {
    const char* what;
    std::vector<std::int64_t> x;
    std::int64_t out;
    kg::Size2 kernel;
    kg::nn::Conv2dOptions o;
    bool bn, relu, residual;
    bool gemm;      // described as the GEMM form
    bool im2col;    // with an im2col prologue
  };
  const std::vector<Case> cases = {
      {"3x3, bias", {1, 32, 6, 7}, 16, 3, {.padding = 1}, false, false, false, true, true},
      {"3x3, BatchNorm, ReLU, two images", {2, 32, 5, 5}, 24, 3, {.padding = 1, .bias = false}, true, true, false, true, true},
      {"3x3 stride 2, dilation 2, BatchNorm, residual, ReLU", {1, 40, 9, 8}, 8, 3,
       {.stride = 2, .padding = 2, .dilation = 2, .bias = false}, true, true, true, true, true},
      {"5x3, uneven padding", {2, 20, 6, 9}, 12, {5, 3}, {.padding = {1, 2}}, false, true, false, true, true},
      {"1x1: the input as the columns", {2, 256, 4, 3}, 8, 1, {}, false, false, false, true, false},
      {"1x1, BatchNorm", {1, 256, 5, 3}, 8, 1, {.bias = false}, true, false, false, true, false},
      {"1x1 stride 2", {1, 256, 7, 7}, 16, 1, {.stride = 2, .bias = false}, true, false, false, true, true},
      {"1024 pixels, the most", {1, 32, 32, 32}, 8, 3, {.padding = 1}, false, false, false, true, true},
      {"too many pixels", {1, 32, 33, 32}, 8, 3, {.padding = 1}, false, false, false, false, false},
      {"too shallow", {1, 16, 6, 6}, 8, 3, {.padding = 1}, false, false, false, false, false},
      {"groups", {1, 64, 6, 6}, 16, 3, {.padding = 1, .groups = 2}, false, false, false, false, false},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    const BuildFn build = [&](const kg::SymTensor& v) {
      kg::SymTensor y = kg::nn::conv2d(v, c.out, c.kernel, c.o, "conv");
      if (c.bn) y = kg::nn::batch_norm2d(y, "bn");
      if (c.residual) y = kg::add(y, kg::nn::conv2d(v, c.out, c.kernel, c.o, "side"), "add");
      return c.relu ? kg::relu(y, "relu") : y;
    };
    const kg::Model model = one_op_model(c.x, build);
    const kg::Tensor x = random_tensor(rng, kg::DType::F32, c.x);
    kg::LoadedModel cpu = model.load(kg::Device::cpu(), {c.x});
    std::map<std::string, kg::Tensor> params = cpu.state_dict();
    for (auto& [name, p] : params)  // statistics and scales around their identity, the rest small
      if (p.dtype() == kg::DType::F32)
        p = name.ends_with("running_var") || name.ends_with("bn.weight")
                ? random_tensor(rng, kg::DType::F32, p.shape(), 0.5, 1.5)
                : random_tensor(rng, kg::DType::F32, p.shape(), -0.2, 0.2);
    cpu.load_state_dict(params, false);
    const kg::Tensor want = cpu.forward({x}).at(0);
    int library_steps = 0;
    const kg::Tensor got = kg::emu::run_model(model, {x}, params, /*checked=*/true, true, &library_steps).at(0);
    EXPECT_EQ(library_steps, c.residual ? 2 : 1);
    EXPECT_TRUE(kg_test::all_written(got));
    EXPECT_TRUE(all_close(got, want, 1e-4, 1e-5));
    if (!c.bn && !c.relu && !c.residual) {
      const Described d = describe_and_run(model, x);
      ASSERT_TRUE(d.call.has_value());
      EXPECT_EQ(std::holds_alternative<kg::GemmCall>(d.call->call), c.gemm);
      if (const auto* g = std::get_if<kg::GemmCall>(&d.call->call)) {
        EXPECT_EQ(g->batch, c.x[0]);
        EXPECT_EQ(g->stride_a, 0);  // one set of weights for every image
        EXPECT_EQ(g->m, c.out);
        EXPECT_EQ(g->k, c.x[1] * c.kernel.h * c.kernel.w);
        EXPECT_EQ(d.call->prologue.size(), c.im2col ? 1u : 0u);
        EXPECT_EQ(d.call->epilogue.size(), c.o.bias ? 1u : 0u);
      }
    }
  }
  // Turned off by the environment: the convolution call.
  ::setenv("KG_CONV_GEMM_FORM", "0", 1);
  const std::vector<std::int64_t> shape{1, 32, 6, 7};
  const Described d = describe_and_run(
      one_op_model(shape, [](const kg::SymTensor& v) { return kg::nn::conv2d(v, 16, 3, {.padding = 1}, "conv"); }),
      random_tensor(rng, kg::DType::F32, shape));
  ::unsetenv("KG_CONV_GEMM_FORM");
  ASSERT_TRUE(d.call.has_value());
  EXPECT_TRUE(std::holds_alternative<kg::Conv2dCall>(d.call->call));
}

// dL/dW from the CPU's backward and dL/dx by the adjoint identity <dx, v> = <dy, A v> (A the op
// without its bias, run by the CPU forward) against the op's backward library calls computed by
// their definition: the calls overwrite dx and dW; the bias gradient stays a launch of its own.
TEST(LibraryCall, ConvolutionAndLinearBackwardsAreTheirGradients) {
  std::mt19937_64 rng(fresh_seed());
  struct Case {
    const char* name;
    std::vector<std::int64_t> x;
    BuildFn op;
  };
  const std::vector<Case> cases = {
      {"conv",
       {2, 4, 7, 6},
       [](const kg::SymTensor& v) {
         return kg::nn::conv2d(v, 6, 3, {2, 1, 1, 2, true}, "op");
       }},
      {"linear", {5, 7}, [](const kg::SymTensor& v) { return kg::nn::linear(v, 3, "op", true); }},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const kg::Tensor x = random_tensor(rng, kg::DType::F32, c.x);
    const kg::Model plain = one_op_model(c.x, c.op);
    kg::LoadedModel fwd = plain.load(kg::Device::cpu(), {c.x});
    const kg::Tensor y = fwd.forward({x}).at(0);
    const kg::Tensor target = random_tensor(rng, kg::DType::F32, y.shape());
    // Training: mse_loss(op(x), target), the same parameters.
    auto g = kg::Graph::create();
    kg::Shape sx = kg::Shape::of(c.x), sy = kg::Shape::of(y.shape());
    sx[0] = sy[0] = kg::Dim::named("batch");
    const kg::SymTensor xin = g->input(kg::DType::F32, sx, "x"), tin = g->input(kg::DType::F32, sy, "t");
    const kg::Model train(g, {kg::mse_loss(c.op(xin), tin, "loss")}, kg::LoweringMode::Training);
    kg::LoadedModel tm = train.load(kg::Device::cpu(), {c.x, y.shape()});
    tm.load_state_dict(fwd.state_dict());
    tm.forward({x, target});
    tm.backward();
    const kg::Tensor dw_ref = tm.grad("op.weight");
    // dL/dy of the mean squared error.
    kg::Tensor dy = kg::Tensor::empty(kg::DType::F32, y.shape());
    for (std::int64_t i = 0; i < y.numel(); ++i)
      dy.data<float>()[i] =
          static_cast<float>(2.0 * (y.item(i) - target.item(i)) / static_cast<double>(y.numel()));

    kg::lower::LowerTarget lt;
    lt.concrete.resize(plain.graph().nodes().size());
    lt.concrete[static_cast<std::size_t>(plain.graph().inputs()[0])] = c.x;
    const int node = plain.outputs().at(0).second;
    lt.concrete[static_cast<std::size_t>(node)] = y.shape();
    const auto lowered = kg::lower::lower_model(plain, lt);
    ASSERT_EQ(lowered.executables.size(), 1u);
    const kg::Tensor w = fwd.parameter("op.weight"), b = fwd.parameter("op.bias");
    kg::Tensor dx = kg::Tensor::empty(kg::DType::F32, c.x), dw = kg::Tensor::empty(kg::DType::F32, w.shape()),
               db = kg::Tensor::empty(kg::DType::F32, b.shape());
    for (kg::Tensor* t : {&dx, &dw, &db}) std::fill(t->data<float>(), t->data<float>() + t->numel(), NAN);
    kg::LaunchTensors t;
    t.inputs = {{host(x), c.x, kg::DType::F32}};
    t.params = {{host(w), w.shape(), kg::DType::F32}, {host(b), b.shape(), kg::DType::F32}};
    t.output = {0, y.shape(), kg::DType::F32};
    t.grad_output = {host(dy), y.shape(), kg::DType::F32};
    t.grad_inputs = {{host(dx), c.x, kg::DType::F32}};
    t.grad_params = {{host(dw), w.shape(), kg::DType::F32}, {host(db), b.shape(), kg::DType::F32}};
    const auto described = lowered.executables[0].runtime_op->backward_library_calls(t);
    ASSERT_TRUE(described.has_value());
    ASSERT_EQ(described->calls.size(), 2u);
    EXPECT_EQ(described->launches.size(), 1u);  // the bias gradient
    for (const auto& call : described->calls) kg::emu::run_library_reference(call, "[test]");
    EXPECT_TRUE(all_close(dw, dw_ref, 1e-4, 1e-6));
    // <dx, v> = <dy, A v>.
    const kg::Tensor v = random_tensor(rng, kg::DType::F32, c.x);
    auto state = fwd.state_dict();
    state["op.bias"] = kg::Tensor::zeros(kg::DType::F32, b.shape());
    fwd.load_state_dict(state);
    const kg::Tensor av = fwd.forward({v}).at(0);
    double lhs = 0, rhs = 0, scale = 0;
    for (std::int64_t i = 0; i < v.numel(); ++i) {
      lhs += dx.item(i) * v.item(i);
      scale += std::abs(dx.item(i) * v.item(i));
    }
    for (std::int64_t i = 0; i < av.numel(); ++i) rhs += dy.item(i) * av.item(i);
    EXPECT_NEAR(lhs, rhs, 1e-5 * scale + 1e-9);
    // Gradients nobody wants get no call.
    t.grad_inputs[0].ptr = 0;
    t.grad_params[1].ptr = 0;
    const auto fewer = lowered.executables[0].runtime_op->backward_library_calls(t);
    ASSERT_TRUE(fewer.has_value());
    EXPECT_EQ(fewer->calls.size(), 1u);
    EXPECT_TRUE(fewer->launches.empty());
  }
}

// nn.matmul's gradients as cuBLASLt calls, run by the emulator's library reference over host
// buffers, against dA = dY·Bᵀ and dB = Aᵀ·dY summed in double; broadcast operands get no call.
TEST(LibraryCall, MatmulBackwardIsItsGradients) {
  std::mt19937_64 rng(fresh_seed());
  struct Case {
    const char* name;
    std::vector<std::int64_t> a, b;
    bool described;
  };
  const std::vector<Case> cases = {
      {"2-D", {3, 5}, {5, 4}, true},
      {"B without batch dims: one GEMM", {2, 3, 5}, {5, 4}, true},
      {"a vector B", {2, 3, 5}, {5}, true},
      {"batched", {2, 3, 5}, {2, 5, 4}, true},
      {"two batch levels", {2, 2, 3, 5}, {2, 2, 5, 4}, true},  // merged into one level
      {"A broadcast", {3, 5}, {2, 5, 4}, false},
      {"B broadcast over one of two levels", {2, 3, 3, 5}, {1, 3, 5, 4}, false},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const kg::Tensor a = random_tensor(rng, kg::DType::F32, c.a), b = random_tensor(rng, kg::DType::F32, c.b);
    auto g = kg::Graph::create();
    const kg::SymTensor ain = g->input(kg::DType::F32, kg::Shape::of(c.a), "a");
    const kg::SymTensor bin = g->input(kg::DType::F32, kg::Shape::of(c.b), "b");
    const kg::Model model(g, {kg::matmul(ain, bin, "mm")});
    const kg::Tensor y = model.load(kg::Device::cpu(), {c.a, c.b}).forward({a, b}).at(0);
    const kg::Tensor dy = random_tensor(rng, kg::DType::F32, y.shape());
    kg::lower::LowerTarget lt;
    lt.concrete.resize(model.graph().nodes().size());
    lt.concrete[static_cast<std::size_t>(model.graph().inputs()[0])] = c.a;
    lt.concrete[static_cast<std::size_t>(model.graph().inputs()[1])] = c.b;
    lt.concrete[static_cast<std::size_t>(model.outputs().at(0).second)] = y.shape();
    const auto lowered = kg::lower::lower_model(model, lt);
    ASSERT_EQ(lowered.executables.size(), 1u);
    kg::Tensor da = kg_test::nan_tensor(kg::DType::F32, c.a), db = kg_test::nan_tensor(kg::DType::F32, c.b);
    kg::LaunchTensors t;
    t.inputs = {{host(a), c.a, kg::DType::F32}, {host(b), c.b, kg::DType::F32}};
    t.output = {0, y.shape(), kg::DType::F32};
    t.grad_output = {host(dy), y.shape(), kg::DType::F32};
    t.grad_inputs = {{host(da), c.a, kg::DType::F32}, {host(db), c.b, kg::DType::F32}};
    const auto described = lowered.executables[0].runtime_op->backward_library_calls(t);
    ASSERT_EQ(described.has_value(), c.described);
    if (!described) continue;
    ASSERT_EQ(described->calls.size(), 2u);
    EXPECT_TRUE(described->launches.empty());
    for (const auto& call : described->calls) kg::emu::run_library_reference(call, "[test]");
    // The reference: batch entries e of the output, A and B each read at their own entry.
    const std::int64_t k = c.a.back(), m = c.a.size() >= 2 ? c.a[c.a.size() - 2] : 1;
    const std::int64_t n = c.b.size() >= 2 ? c.b.back() : 1;
    const std::int64_t entries = y.numel() / (m * n);
    const std::int64_t a_entries = a.numel() / (m * k), b_entries = b.numel() / (k * n);
    std::vector<double> want_a(static_cast<std::size_t>(a.numel()), 0.0), want_b(static_cast<std::size_t>(b.numel()), 0.0);
    for (std::int64_t e = 0; e < entries; ++e) {
      const std::int64_t ea = a_entries == 1 ? 0 : e, eb = b_entries == 1 ? 0 : e;
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j) {
          const double d = dy.item((e * m + i) * n + j);
          for (std::int64_t p = 0; p < k; ++p) {
            want_a[static_cast<std::size_t>((ea * m + i) * k + p)] += d * b.item((eb * k + p) * n + j);
            want_b[static_cast<std::size_t>((eb * k + p) * n + j)] += d * a.item((ea * m + i) * k + p);
          }
        }
    }
    EXPECT_TRUE(kg_test::matches(da, want_a, 1e-5, 1e-6));
    EXPECT_TRUE(kg_test::matches(db, want_b, 1e-5, 1e-6));
    // A gradient nobody wants gets no call.
    t.grad_inputs[0].ptr = 0;
    const auto fewer = lowered.executables[0].runtime_op->backward_library_calls(t);
    ASSERT_TRUE(fewer.has_value());
    EXPECT_EQ(fewer->calls.size(), 1u);
  }
}

TEST(ForwardDevice, CpuReadsHostAddressesInPlace) {
  std::mt19937_64 rng(fresh_seed());
  kg::Model model = kg::models::build("lenet5");
  kg::LoadedModel m = model.load(kg::Device::cpu(), {kg::models::input_shape("lenet5", 3)});
  const kg::Tensor x = random_tensor(rng, kg::DType::F32, kg::models::input_shape("lenet5", 3));
  const kg::Tensor want = m.forward({x}).at(0);
  const auto outs = m.forward_device({{host(x), x.shape(), x.dtype()}});
  ASSERT_EQ(outs.size(), 1u);
  EXPECT_EQ(outs[0].shape, want.shape());
  const kg::Tensor got = kg::Tensor::wrap(reinterpret_cast<void*>(static_cast<std::uintptr_t>(outs[0].ptr)),
                                          outs[0].dtype, outs[0].shape);
  EXPECT_TRUE(all_close(got, want, 0, 0));
  EXPECT_GE(m.last_device_ms(), 0.0);
  // Bad calls name what is wrong.
  expect_error([&] { m.forward_device({}); }, {"forward_device", "1 input(s)", "0 tensor(s)"});
  expect_error(
      [&] {
        m.forward_device({{host(x), {3, 1, 28, 27}, kg::DType::F32}});
      },
      {"forward_device", "was loaded as [3, 1, 28, 28]", "[3, 1, 28, 27]"});
  expect_error([&] { m.forward_device({{0, x.shape(), x.dtype()}}); }, {"forward_device", "null address"});
}

// ---- on a machine with a GPU ----

#define SKIP_WITHOUT_GPU() \
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no CUDA GPU on this machine"

// A small residual CNN (convolutions with BatchNorm, a residual add, ReLU, pooling, a linear head):
// in inference its convolutions become fused ones with epilogues.
kg::Model small_cnn() {
  auto g = kg::Graph::create();
  kg::SymTensor x = g->input(kg::DType::F32, {kg::Dim::named("batch"), 3, 32, 32}, "x");
  kg::SymTensor h =
      kg::relu(kg::nn::batch_norm2d(kg::nn::conv2d(x, 16, 3, {1, 1, 1, 1, false}, "c1"), "bn1"));
  kg::SymTensor r = kg::nn::batch_norm2d(kg::nn::conv2d(h, 16, 3, {1, 1, 1, 1, false}, "c2"), "bn2");
  h = kg::relu(kg::add(r, h));
  h = kg::nn::conv2d(h, 32, 3, {2, 1, 1, 1, true}, "c3");
  h = kg::relu(h);
  h = kg::flatten(kg::max_pool2d(h, 2));
  return kg::Model(g, {kg::nn::linear(h, 10, "fc")});
}

std::map<std::string, kg::Tensor> random_state(const kg::LoadedModel& m, std::mt19937_64& rng) {
  std::map<std::string, kg::Tensor> w;
  for (const auto& p : m.parameters()) {
    if (!kg::is_floating(p.dtype)) continue;  // BatchNorm's batch counter
    const bool var = p.name.find("running_var") != std::string::npos;
    w.emplace(p.name, var ? random_tensor(rng, p.dtype, p.shape, 0.5, 1.5)
                          : random_tensor(rng, p.dtype, p.shape, -0.5, 0.5));
  }
  return w;
}

// The largest |element| of `t`: the scale that an absolute tolerance is measured against, where
// an element's error comes from sums of much larger terms (reduced-precision products, deep chains).
double max_abs(const kg::Tensor& t) {
  double m = 0;
  for (std::int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(t.item(i)));
  return m;
}

// The CPU's output for a random f32 input of `shape`, with random weights (random_state) that the
// GPU loads get too.
struct CpuReference {
  std::map<std::string, kg::Tensor> weights;
  kg::Tensor input, output;
};
CpuReference cpu_reference(const kg::Model& model, const std::vector<std::int64_t>& shape, std::mt19937_64& rng) {
  kg::LoadedModel cpu = model.load(kg::Device::cpu(), {shape});
  CpuReference r;
  r.weights = random_state(cpu, rng);
  cpu.load_state_dict(r.weights, false);
  r.input = random_tensor(rng, kg::DType::F32, shape);
  r.output = cpu.forward({r.input}).at(0);
  return r;
}

TEST(LibraryCallGpu, CnnWithVendorLibrariesMatchesTheCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(fresh_seed());
  const kg::Model model = small_cnn();
  const std::vector<std::int64_t> shape{4, 3, 32, 32};
  const CpuReference ref = cpu_reference(model, shape, rng);
  const auto& w = ref.weights;
  const kg::Tensor& x = ref.input;
  const kg::Tensor& want = ref.output;
  struct Mode {
    const char* name;
    bool vendor, tf32, tune, graph;
    double rtol;
  };
  for (const Mode& md :
       {Mode{"own kernels", false, false, false, true, 1e-4}, Mode{"vendor", true, false, false, true, 1e-4},
        Mode{"vendor, eager", true, false, false, false, 1e-4},
        Mode{"vendor, tuned", true, false, true, true, 1e-4},
        Mode{"vendor, tf32", true, true, false, true, 3e-2}}) {
    SCOPED_TRACE(md.name);
    kg::LoadOptions o;
    o.vendor_libraries = md.vendor;
    o.tf32 = md.tf32;
    o.tune = md.tune;
    o.cuda_graph = md.graph;
    o.poison_buffers = true;
    kg::LoadedModel gpu = model.load(kg::Device::cuda(), {shape}, o);
    gpu.load_state_dict(w, false);
    for (int run = 0; run < 2; ++run) {
      const kg::Tensor got = gpu.forward({x}).at(0);
      // TF32 rounds every product's inputs to 11 bits: an output's error is about 1e-3 of the
      // output's scale (the fc layer sums 2048 products), whatever the element's own size.
      EXPECT_TRUE(all_close(got, want, md.rtol, md.tf32 ? 1e-2 * max_abs(want) : md.rtol * 0.1));
      EXPECT_GT(gpu.last_device_ms(), 0.0);
    }
  }
}

TEST(LibraryCallGpu, TrainingGradientsWithVendorLibrariesMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(fresh_seed());
  auto g = kg::Graph::create();
  const kg::SymTensor x = g->input(kg::DType::F32, {kg::Dim::named("batch"), 3, 12, 12}, "x");
  const kg::SymTensor t = g->input(kg::DType::F32, {kg::Dim::named("batch"), 5}, "t");
  kg::SymTensor h = kg::relu(kg::nn::conv2d(x, 8, 3, {1, 1, 1, 1, true}, "c1"));
  h = kg::relu(kg::nn::conv2d(h, 8, 3, {2, 1, 1, 2, true}, "c2"));
  const kg::SymTensor y = kg::nn::linear(kg::flatten(h), 5, "fc");
  const kg::Model model(g, {kg::mse_loss(y, t, "loss")}, kg::LoweringMode::Training);
  const std::vector<std::vector<std::int64_t>> shapes{{6, 3, 12, 12}, {6, 5}};
  const kg::Tensor xv = random_tensor(rng, kg::DType::F32, shapes[0]),
                   tv = random_tensor(rng, kg::DType::F32, shapes[1]);
  kg::LoadedModel cpu = model.load(kg::Device::cpu(), shapes);
  cpu.forward({xv, tv});
  cpu.backward();
  const auto want = cpu.gradients();
  for (bool vendor : {false, true}) {
    SCOPED_TRACE(vendor ? "vendor libraries" : "own kernels");
    kg::LoadOptions o;
    o.vendor_libraries = vendor;
    kg::LoadedModel gpu = model.load(kg::Device::cuda(), shapes, o);
    gpu.load_state_dict(cpu.state_dict());
    for (bool accumulate : {false, true}) {  // the second backward adds into the first's gradients
      gpu.forward({xv, tv});
      gpu.backward();
      const auto got = gpu.gradients();
      ASSERT_EQ(got.size(), want.size());
      for (const auto& [name, w] : want) {
        SCOPED_TRACE(name);
        kg::Tensor expect = w.clone();
        if (accumulate)
          for (std::int64_t i = 0; i < expect.numel(); ++i) expect.data<float>()[i] *= 2;
        EXPECT_TRUE(all_close(got.at(name), expect, 1e-4, 1e-6));
      }
    }
  }
}

// A batched matmul between two layers' outputs: its gradients on cuBLASLt (both operands'),
// against the CPU's backward.
TEST(LibraryCallGpu, MatmulGradientsWithVendorLibrariesMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(fresh_seed());
  auto g = kg::Graph::create();
  const kg::SymTensor x = g->input(kg::DType::F32, {kg::Dim::named("batch"), 6}, "x");
  const kg::SymTensor t = g->input(kg::DType::F32, {kg::Dim::named("batch"), 6}, "t");
  const kg::SymTensor p = kg::reshape(kg::nn::linear(x, 12, "p"), {0, 3, 4}, "p3");
  const kg::SymTensor q = kg::reshape(kg::nn::linear(x, 8, "q"), {0, 4, 2}, "q3");
  const kg::SymTensor y = kg::flatten(kg::matmul(p, q, "mm"), 1, -1, "flat");
  const kg::Model model(g, {kg::mse_loss(y, t, "loss")}, kg::LoweringMode::Training);
  const std::vector<std::vector<std::int64_t>> shapes{{5, 6}, {5, 6}};
  const kg::Tensor xv = random_tensor(rng, kg::DType::F32, shapes[0]),
                   tv = random_tensor(rng, kg::DType::F32, shapes[1]);
  kg::LoadedModel cpu = model.load(kg::Device::cpu(), shapes);
  cpu.forward({xv, tv});
  cpu.backward();
  const auto want = cpu.gradients();
  kg::LoadedModel gpu = model.load(kg::Device::cuda(), shapes);
  gpu.load_state_dict(cpu.state_dict());
  gpu.forward({xv, tv});
  gpu.backward();
  const auto got = gpu.gradients();
  for (const auto& [name, w] : want) EXPECT_TRUE(all_close(got.at(name), w, 1e-4, 1e-6)) << name;
}

TEST(LibraryCallGpu, ForwardDeviceReadsAndReturnsDeviceBuffers) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(fresh_seed());
  const kg::Model model = small_cnn();
  const std::vector<std::int64_t> shape{2, 3, 32, 32};
  kg::LoadedModel gpu = model.load(kg::Device::cuda(), {shape});
  const kg::Tensor x = random_tensor(rng, kg::DType::F32, shape);
  const kg::Tensor want = gpu.forward({x}).at(0);
  kg::cuda::Context& ctx = kg::cuda::Context::get(0);
  kg::cuda::DeviceBuffer dx(ctx, x.nbytes());
  ctx.upload(dx.ptr(), x.raw(), x.nbytes());
  const auto outs = gpu.forward_device({{dx.ptr(), shape, kg::DType::F32}});
  ASSERT_EQ(outs.size(), 1u);
  kg::Tensor got = kg::Tensor::empty(outs[0].dtype, outs[0].shape);
  ctx.download(got.raw(), outs[0].ptr, got.nbytes());
  EXPECT_TRUE(all_close(got, want, 0, 0));
  EXPECT_GT(gpu.last_device_ms(), 0.0);
}

// On the GPU, a batch-1 model's deep convolutions over few pixels run as cuBLASLt GEMMs (the
// profile's tactic says so; a 1×1 one over its input as it is), a shallow one over many pixels on
// cuDNN, and the output matches the CPU with the CUDA graph, eagerly and tuned; with
// KG_CONV_GEMM_FORM=0 every one runs on cuDNN.
TEST(LibraryCallGpu, SmallNchwConvolutionsRunAsGemmsAndMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(fresh_seed());
  auto g = kg::Graph::create();
  kg::Shape s{kg::Dim::named("batch"), 16, 40, 40};
  kg::SymTensor x = g->input(kg::DType::F32, s, "x");
  auto cbr = [](const kg::SymTensor& in, std::int64_t out, kg::nn::Conv2dOptions o, const std::string& name) {
    return kg::relu(kg::nn::batch_norm2d(kg::nn::conv2d(in, out, 3, o, name + ".conv"), name + ".bn"), name + ".relu");
  };
  kg::SymTensor y = cbr(x, 32, {.padding = 1, .bias = false}, "a");                 // K 144, 1600 px: cuDNN
  y = cbr(y, 64, {.stride = 2, .padding = 1, .bias = false}, "b");                  // K 288, 400 px: GEMM
  kg::SymTensor r = cbr(y, 64, {.padding = 1, .bias = false}, "c");                 // K 576, 400 px: GEMM
  y = kg::relu(kg::add(kg::nn::conv2d(r, 64, 3, {.padding = 1}, "d"), y, "add"), "out");  // bias + residual
  y = cbr(y, 256, {.padding = 1, .bias = false}, "f");                             // K 576, 400 px: GEMM
  y = kg::nn::conv2d(y, 8, 1, {}, "e");  // 1x1, K 256: a GEMM over the input itself
  const kg::Model model(g, {y});
  // A deep chain of convolutions: the error is measured against the output's scale.
  auto close = [](const kg::Tensor& got, const kg::Tensor& want) {
    return all_close(got, want, 1e-4, 1e-4 * max_abs(want));
  };
  for (int mode = 0; mode < 4; ++mode) {
    const bool cudnn_only = mode == 2, tuned = mode == 3;
    SCOPED_TRACE(mode == 0 ? "cuda graph" : mode == 1 ? "eager" : mode == 2 ? "KG_CONV_GEMM_FORM=0" : "tuned");
    // The tuned load runs batch 2 (800 pixels: still GEMMs): what it keeps in the tuning cache is
    // for other shapes than the batch-1 loads, whose tactics are checked (in this run or a later
    // one with the same cache folder).
    const std::vector<std::int64_t> shape{tuned ? 2 : 1, 16, 40, 40};
    const CpuReference ref = cpu_reference(model, shape, rng);
    kg::LoadOptions o;
    o.cuda_graph = mode != 1;
    o.tune = tuned;
    o.poison_buffers = true;
    o.profile = true;
    if (cudnn_only) ::setenv("KG_CONV_GEMM_FORM", "0", 1);
    kg::LoadedModel gpu = model.load(kg::Device::cuda(), {shape}, o);
    if (cudnn_only) ::unsetenv("KG_CONV_GEMM_FORM");
    gpu.load_state_dict(ref.weights, false);
    const kg::Tensor got = gpu.forward({ref.input}).at(0);
    EXPECT_TRUE(kg_test::all_written(got));
    EXPECT_TRUE(close(got, ref.output));
    if (tuned) continue;  // a tuned load may keep the op's own kernels
    std::map<std::string, std::string> tactic;
    for (const auto& t : gpu.profile()) tactic[t.node] = t.kernel;
    for (const std::string node : {"a.conv", "b.conv", "c.conv", "d", "f.conv", "e"}) {
      const bool gemm = !cudnn_only && node != "a.conv";
      const std::string found = tactic.count(node) ? tactic.at(node) : "(not profiled)";
      EXPECT_NE(found.find(gemm ? "cublasLt" : "cudnn"), std::string::npos) << node << ": " << found;
    }
  }
}

TEST(LibraryCallGpu, TurnedOffByTheEnvironment) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(fresh_seed());
  const kg::Model model = small_cnn();
  const std::vector<std::int64_t> shape{2, 3, 32, 32};
  const kg::Tensor x = random_tensor(rng, kg::DType::F32, shape);
  kg::LoadedModel cpu = model.load(kg::Device::cpu(), {shape});
  const kg::Tensor want = cpu.forward({x}).at(0);
  ::setenv("KG_NO_VENDOR", "1", 1);
  kg::LoadedModel gpu = model.load(kg::Device::cuda(), {shape});
  ::unsetenv("KG_NO_VENDOR");
  gpu.load_state_dict(cpu.state_dict(), false);
  EXPECT_TRUE(all_close(gpu.forward({x}).at(0), want, 1e-4, 1e-5));
}

}  // namespace
