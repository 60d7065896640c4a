// The channels-last pass for a GPU: which nodes it rewrites (16-bit convolutions, f32 ones only
// with TF32, the pooling between them, permutes at the edges, names and parameters kept), the
// rewritten graph's kernels under the emulator (the convolution's own channels-last kernel, and
// its library call by the library's definition with the weights laid out by the call's
// prologue) against the NCHW model on the CPU, the errors of the channels-last ops on the CPU,
// and, on a machine with a GPU, whole models with cuDNN in channels-last against the CPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <string>

#include "backend/cuda/executor.hpp"
#include "backend/emu/executor.hpp"
#include "compile/compiler.hpp"
#include "kg/kg.hpp"
#include "kg/models.hpp"
#include "lower/dry_run.hpp"
#include "lower/lowering.hpp"
#include "ops/conv_dnnl.hpp"
#include "passes/passes.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

// A small residual CNN with every node kind ResNet-18 has: conv → BatchNorm → ReLU, a max pool,
// a basic block with an identity and one with a strided projection, a global average pool, a
// flatten and a linear layer.
kg::SymTensor small_resnet(const kg::SymTensor& x) {
  using kg::nn::batch_norm2d;
  using kg::nn::conv2d;
  auto cbr = [](const kg::SymTensor& in, std::int64_t out, kg::Size2 k, kg::nn::Conv2dOptions o,
                const std::string& name, bool relu = true) {
    kg::SymTensor y = batch_norm2d(conv2d(in, out, k, o, name + ".conv"), name + ".bn");
    return relu ? kg::relu(y, name + ".relu") : y;
  };
  kg::SymTensor y = cbr(x, 8, 3, {.stride = 1, .padding = 1, .bias = false}, "stem");
  y = kg::max_pool2d(y, 3, 2, 1, 1, false, "pool");
  kg::SymTensor a = cbr(y, 8, 3, {.padding = 1, .bias = false}, "b1.a");
  a = cbr(a, 8, 3, {.padding = 1, .bias = false}, "b1.b", false);
  y = kg::relu(kg::add(a, y, "b1.add"), "b1.out");
  kg::SymTensor b = cbr(y, 16, 3, {.stride = 2, .padding = 1, .bias = false}, "b2.a");
  b = cbr(b, 16, 3, {.padding = 1}, "b2.b", false);
  kg::SymTensor down = cbr(y, 16, 1, {.stride = 2, .bias = false}, "b2.down", false);
  y = kg::relu(kg::add(b, down, "b2.add"), "b2.out");
  y = kg::flatten(kg::global_avg_pool(y, "gap"), 1, -1, "flat");
  return kg::nn::linear(y, 5, "fc");
}

kg::Model make_model(const std::function<kg::SymTensor(const kg::SymTensor&)>& build, std::int64_t c,
                     std::int64_t h, std::int64_t w) {
  auto [x, graph] = kg::SymTensor::input(kg::DType::F32, kg::Shape{kg::Dim::named("batch"), c, h, w}, "x");
  (void)graph;
  kg::SymTensor y = build(x);
  return kg::Model(y.graph_ptr(), {y}, kg::LoweringMode::Inference);
}

// Random parameters that keep activations of a deep network in range (f16's included): weights
// uniform within ±1/sqrt(fan-in) as PyTorch initialises them, BatchNorm statistics and affine
// parameters around their identity.
std::map<std::string, kg::Tensor> random_params(const kg::Model& m, std::mt19937_64& rng) {
  std::map<std::string, kg::Tensor> p;
  for (const auto& info : m.parameters()) {
    if (info.dtype != kg::DType::F32) continue;
    const bool var = info.name.ends_with("running_var");
    double lo = var ? 0.5 : -0.5, hi = var ? 1.5 : 0.5;
    if (info.shape.size() >= 2) {
      std::int64_t fan_in = 1;
      for (std::size_t k = 1; k < info.shape.size(); ++k) fan_in *= info.shape[k];
      hi = 1.0 / std::sqrt(static_cast<double>(fan_in));
      lo = -hi;
    } else if (info.name.ends_with("bn.weight") || info.name.ends_with("bn1.weight") ||
               info.name.ends_with("bn2.weight") || info.name.ends_with("downsample.1.weight")) {
      lo = 0.5, hi = 1.5;
    }
    p[info.name] = kg_test::random_tensor(rng, info.dtype, info.shape, lo, hi);
  }
  return p;
}

// The model's optimised graph, optionally in a reduced precision, rewritten by the pass for `target`;
// as a model of its own.
kg::Model rewritten(const kg::Model& m, kg::passes::ChannelsLastTarget target, kg::DType precision = kg::DType::F32) {
  auto g = std::make_shared<kg::Graph>(m.graph());
  std::vector<int> outs;
  for (const auto& o : m.outputs()) outs.push_back(o.second);
  kg::passes::GraphAndOutputs r{g, outs};
  if (precision != kg::DType::F32) r = kg::passes::reduce_precision(r.graph, r.outputs, precision);
  r = kg::passes::channels_last(r.graph, r.outputs, false, target);
  std::vector<kg::SymTensor> ys;
  for (int o : r.outputs) ys.emplace_back(r.graph, o);
  return kg::Model(r.graph, ys, kg::LoweringMode::Inference);
}

// Op name → count, over the live nodes.
std::map<std::string, int> op_counts(const kg::Model& m) {
  std::map<std::string, int> c;
  for (int id : m.live_nodes()) {
    const kg::Node& n = m.graph().node(id);
    if (n.kind == kg::Node::Kind::Op) ++c[n.op->op().name()];
  }
  return c;
}

std::vector<std::string> param_names(const kg::Model& m) {
  std::vector<std::string> v;
  for (const auto& p : m.parameters()) v.push_back(p.name);
  std::sort(v.begin(), v.end());
  return v;
}

double max_abs(const kg::Tensor& t) {
  const kg::Tensor d = t.to(kg::DType::F64);
  double m = 0;
  for (std::int64_t i = 0; i < d.numel(); ++i) m = std::max(m, std::abs(d.data<double>()[i]));
  return m;
}
// The same over the finite elements.
double max_abs_finite(const kg::Tensor& t) {
  const kg::Tensor d = t.to(kg::DType::F64);
  double m = 0;
  for (std::int64_t i = 0; i < d.numel(); ++i)
    if (std::isfinite(d.data<double>()[i])) m = std::max(m, std::abs(d.data<double>()[i]));
  return m;
}

// The recorded (NCHW) model's output on the CPU with its own kernels: the reference.
kg::Tensor nchw_cpu_output(const kg::Model& m, const kg::Tensor& x, const std::map<std::string, kg::Tensor>& params) {
  kg::LoadOptions plain;
  plain.vendor_libraries = false;
  kg::LoadedModel cpu = m.load(kg::Device::cpu(), {x.shape()}, plain);
  cpu.load_state_dict(params, false);
  return cpu.forward({x}).at(0);
}

std::map<std::string, kg::Tensor> converted(const std::map<std::string, kg::Tensor>& p, kg::DType t) {
  std::map<std::string, kg::Tensor> out;
  for (const auto& [k, v] : p) out[k] = v.to(t);
  return out;
}

// The rewritten model on the GPU with its own kernels only (no vendor library), every buffer
// poisoned first: its output for `x`.
kg::Tensor own_kernels_on_gpu(const kg::Model& r, const kg::Tensor& x, const std::map<std::string, kg::Tensor>& params) {
  kg::LoadOptions o;
  o.vendor_libraries = false;
  o.poison_buffers = true;
  kg::LoadedModel gpu = r.load(kg::Device::cuda(), {x.shape()}, o);
  gpu.load_state_dict(params, false);
  return gpu.forward({x}).at(0);
}

}  // namespace

TEST(ChannelsLastGpu, RewritesHalfConvolutionsAndTheirPoolingKeepingNamesAndParameters) {
  const kg::Model m = make_model(small_resnet, 3, 16, 16);
  const kg::Model r = rewritten(m, {.gpu = true}, kg::DType::BF16);
  const auto ops = op_counts(r);
  EXPECT_EQ(ops.count("nn.fused_conv2d"), 0u);
  EXPECT_EQ(ops.at("nn.conv2d_nhwc"), 6);  // every convolution, each with its BatchNorm folded in
  EXPECT_EQ(ops.at("nn.max_pool2d_nhwc"), 1);
  EXPECT_EQ(ops.at("nn.global_avg_pool_nhwc"), 1);
  // One conversion in and one out (before the flatten). The input's cast to bf16, which only the
  // region reads, is folded into the first: it reads the f32 input and writes bf16.
  EXPECT_EQ(ops.at("nn.permute"), 2);
  // Casts of the model's input, in a graph.
  auto input_casts = [](const kg::Model& g) {
    int c = 0;
    for (int id : g.live_nodes()) {
      const kg::Node& n = g.graph().node(id);
      if (n.kind == kg::Node::Kind::Op && n.op->op().name() == "pw.cast" &&
          g.graph().node(n.inputs.at(0)).kind == kg::Node::Kind::Input)
        ++c;
    }
    return c;
  };
  EXPECT_EQ(input_casts(r), 0);
  int converting = 0;
  for (int id : r.live_nodes()) {
    const kg::Node& n = r.graph().node(id);
    if (n.kind != kg::Node::Kind::Op || n.op->op().name() != "nn.permute") continue;
    const kg::Node& in = r.graph().node(n.inputs.at(0));
    if (in.dtype == kg::DType::F32 && n.dtype == kg::DType::BF16) {
      ++converting;
      EXPECT_EQ(in.kind, kg::Node::Kind::Input) << n.name;
      EXPECT_NE(n.op->op().attributes().find("to=bf16"), std::string::npos) << n.op->op().attributes();
    }
  }
  EXPECT_EQ(converting, 1);
  // A cast that something outside the region reads too stays a cast.
  const kg::Model both = make_model(
      [](const kg::SymTensor& x) {
        const kg::SymTensor y = kg::nn::conv2d(x, 8, 3, {.padding = 1}, "conv");
        return kg::add(kg::global_avg_pool(y, "gap"), kg::global_avg_pool(x, "gap_x"), "add");
      },
      8, 9, 9);
  EXPECT_EQ(input_casts(rewritten(both, {.gpu = true}, kg::DType::BF16)), 1);
  EXPECT_EQ(param_names(r), param_names(m));
  for (int id : r.live_nodes()) {
    const kg::Node& n = r.graph().node(id);
    if (n.kind == kg::Node::Kind::Op && n.op->op().name() == "nn.conv2d_nhwc") {
      EXPECT_EQ(n.dtype, kg::DType::BF16) << n.name;
      EXPECT_GE(m.graph().find(n.name), 0) << n.name << " is not a node of the model";
    }
  }
}

TEST(ChannelsLastGpu, StrictF32StaysNchwAndTf32Converts) {
  const kg::Model m = make_model(small_resnet, 3, 16, 16);
  EXPECT_EQ(op_counts(rewritten(m, {.gpu = true})).count("nn.conv2d_nhwc"), 0u);
  EXPECT_EQ(op_counts(rewritten(m, {.gpu = true, .tf32 = true})).at("nn.conv2d_nhwc"), 6);
}

// Every kernel of the rewritten f32 graph (the channels-last convolution, pooling and permute
// kernels) under the checked emulator, then the library path (prologue, the call by its
// definition, epilogue), against the recorded NCHW model on the CPU.
TEST(ChannelsLastGpu, EmulatedKernelsAndLibraryPathMatchTheNchwModel) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Model m = make_model(small_resnet, 3, 11, 13);
  const kg::Model r = rewritten(m, {.gpu = true, .tf32 = true});
  ASSERT_EQ(op_counts(r).at("nn.conv2d_nhwc"), 6);
  const auto params = random_params(m, rng);
  const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {2, 3, 11, 13});
  const kg::Tensor want = nchw_cpu_output(m, x, params);
  const double tol = 1e-5 * std::max(1.0, max_abs(want));

  const kg::Tensor own = kg::emu::run_model(r, {x}, params, /*checked=*/true).at(0);
  EXPECT_TRUE(kg_test::all_written(own));
  EXPECT_TRUE(kg_test::all_close(own, want, 1e-4, tol));

  int library_steps = 0;
  const kg::Tensor lib = kg::emu::run_model(r, {x}, params, true, /*library_calls=*/true, &library_steps).at(0);
  EXPECT_EQ(library_steps, 6 + 1);  // the convolutions and the linear layer
  EXPECT_TRUE(kg_test::all_written(lib));
  EXPECT_TRUE(kg_test::all_close(lib, want, 1e-4, tol));
}

// One convolution (with its BatchNorm and ReLU fused) on each library form of the channels-last
// convolution, under the emulator against the f32 CPU, in f32 and bf16: the GEMM form (few input
// channels: ResNet's stem; 1×1 convolutions, strided or reading the input as it is), with its
// shift and ReLU in the GEMM's epilogue or in the op's; input
// channels padded for cuDNN (output channels not a multiple of 8); plain cuDNN; groups. And the
// op's own kernel, checked.
TEST(ChannelsLastGpu, EveryLibraryFormOfOneConvolutionMatchesTheCpu) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Conf {
    const char* what;
    std::int64_t c, o;
    kg::Size2 k;
    kg::nn::Conv2dOptions opt;
    bool bn, relu;
    bool cudnn;  // a cuDNN form, whose call describes its epilogue as fusable
  };
  const std::vector<Conf> confs = {
      {"gemm form, shift and relu in the gemm", 3, 16, 7, {.stride = 2, .padding = 3, .bias = false}, true, true, false},
      {"gemm form, shift in the gemm", 3, 8, 3, {.padding = 1}, true, false, false},
      {"gemm form, 1x1 stride 2: subsampled rows", 16, 24, 1, {.stride = 2, .bias = false}, true, false, false},
      {"gemm form, 1x1: the input as the rows", 16, 8, 1, {}, true, true, false},
      {"channels padded for cudnn", 5, 6, 3, {.padding = 1}, false, true, true},
      {"cudnn", 16, 24, 3, {.stride = 2, .padding = 1, .bias = false}, true, true, true},
      {"cudnn, shift alone", 16, 24, 3, {.padding = 1}, false, false, true},
      {"groups", 8, 16, 3, {.padding = 1, .groups = 2}, false, true, true},
  };
  for (const Conf& f : confs) {
    SCOPED_TRACE(f.what);
    const kg::Model m = make_model(
        [&](const kg::SymTensor& x) {
          kg::SymTensor y = kg::nn::conv2d(x, f.o, f.k, f.opt, "conv");
          if (f.bn) y = kg::nn::batch_norm2d(y, "bn");
          return f.relu ? kg::relu(y, "relu") : y;
        },
        f.c, 13, 12);
    const auto params = random_params(m, rng);
    const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {2, f.c, 13, 12});
    const kg::Tensor want = nchw_cpu_output(m, x, params);
    const double scale = std::max(1e-3, max_abs(want));
    for (kg::DType t : {kg::DType::F32, kg::DType::BF16}) {
      SCOPED_TRACE(kg::dtype_name(t));
      const kg::Model r = rewritten(m, {.gpu = true, .tf32 = true}, t);
      ASSERT_EQ(op_counts(r).at("nn.conv2d_nhwc"), 1);
      const auto p = t == kg::DType::F32 ? params : converted(params, t);
      // f32: sums in another order; bf16: inputs, weights and output rounded to 8 bits.
      const double tol = (t == kg::DType::F32 ? 1e-5 : 2e-2) * scale;
      int library_steps = 0;
      const kg::Tensor lib = kg::emu::run_model(r, {x}, p, true, true, &library_steps).at(0);
      EXPECT_EQ(library_steps, 1);
      EXPECT_TRUE(kg_test::all_written(lib));
      EXPECT_TRUE(kg_test::all_close(lib, want, 0.0, tol));
      // The call's fusable epilogue computed by the reference in place of the epilogue launch, as
      // cuDNN's fused graph does: described by the cuDNN forms, not by the GEMM forms.
      int fused = 0;
      const kg::Tensor lib_fused = kg::emu::run_model(r, {x}, p, true, true, &library_steps, &fused).at(0);
      EXPECT_EQ(fused, f.cudnn ? 1 : 0);
      EXPECT_TRUE(kg_test::all_written(lib_fused));
      EXPECT_TRUE(kg_test::all_close(lib_fused, want, 0.0, tol));
      const kg::Tensor own = kg::emu::run_model(r, {x}, p, true).at(0);
      EXPECT_TRUE(kg_test::all_close(own, want, 0.0, tol));
    }
  }
}

// The tensor-core kernel of a 16-bit channels-last convolution (an implicit GEMM on
// mma.m16n8k16, its fragments exchanged through shared memory under the emulator), checked under
// the emulator against the f32 CPU, in bf16 and f16: partial pixel, channel and k tiles; few input
// channels (an input patch per tile of output pixels, or read element by element where the patch
// and the weights do not fit in shared memory) and channels in packs of 8; an odd channel count; stride, padding and dilation;
// output rows longer than a tile; a residual branch (a second convolution of the same shape) added before
// the ReLU.
TEST(ChannelsLastGpu, TensorCoreKernelMatchesTheCpu) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Conf {
    const char* what;
    std::int64_t c, o;
    kg::Size2 k;
    kg::nn::Conv2dOptions opt;
    std::int64_t batch, h, w;
    bool bn, residual, relu;
  };
  const std::vector<Conf> confs = {
      {"stem-like: 3 channels, 7x7/2, 72 out", 3, 72, 7, {.stride = 2, .padding = 3, .bias = false}, 3, 23, 21, true,
       false, true},
      {"packed channels, dilation, residual", 24, 40, 3, {.padding = 2, .dilation = 2, .bias = false}, 2, 9, 10, true,
       true, true},
      {"20 channels as a patch, 13 out", 20, 13, 3, {.padding = 1}, 2, 11, 9, false, false, false},
      {"12 channels element by element (the patch's weights do not fit)", 12, 16, 5, {.padding = 2}, 2, 7, 9, true,
       false, true},
      {"5 channels, odd: a padding channel; 4x8 output", 5, 8, 3, {.stride = {2, 1}, .padding = 1}, 3, 8, 8, false,
       false, true},
      {"3 channels, output rows of two tiles", 3, 16, 3, {.padding = 1, .dilation = {1, 2}}, 2, 3, 140, true, false,
       true},
      {"1x1, 128 out, many pixels", 64, 128, 1, {}, 5, 8, 9, false, false, true},
      {"5x5/2 with bias", 16, 8, 5, {.stride = 2, .padding = 2}, 2, 12, 13, false, false, false},
  };
  for (const Conf& f : confs) {
    SCOPED_TRACE(f.what);
    const kg::Model m = make_model(
        [&](const kg::SymTensor& x) {
          kg::SymTensor y = kg::nn::conv2d(x, f.o, f.k, f.opt, "conv");
          if (f.bn) y = kg::nn::batch_norm2d(y, "bn");
          if (f.residual) y = kg::add(y, kg::nn::conv2d(x, f.o, f.k, f.opt, "side"), "add");
          return f.relu ? kg::relu(y, "relu") : y;
        },
        f.c, f.h, f.w);
    const auto params = random_params(m, rng);
    const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {f.batch, f.c, f.h, f.w});
    const kg::Tensor want = nchw_cpu_output(m, x, params);
    const double scale = std::max(1e-3, max_abs(want));
    for (kg::DType t : {kg::DType::BF16, kg::DType::F16}) {
      SCOPED_TRACE(kg::dtype_name(t));
      const kg::Model r = rewritten(m, {.gpu = true}, t);
      ASSERT_EQ(op_counts(r).at("nn.conv2d_nhwc"), f.residual ? 2 : 1);
      // Every convolution lowers to the tensor-core kernel.
      for (int id : r.live_nodes()) {
        const kg::Node& n = r.graph().node(id);
        if (n.kind != kg::Node::Kind::Op || n.op->op().name() != "nn.conv2d_nhwc") continue;
        const std::optional<kg::Lowered> l =
            n.op->op().lower(kg::lower::lower_context(r, id, kg::lower::LowerTarget{{}, 90, true}));
        ASSERT_TRUE(l.has_value());
        EXPECT_NE(l->entry_point.find("nhwc_mma"), std::string::npos) << l->entry_point;
      }
      // With NVRTC, every kernel compiled to PTX for sm_90 (the device code the emulator
      // replaces: the mma and pair-rounding asm) and its launches checked against the PTX.
      if (kg::compile::Compiler::available()) kg::lower::dry_run(r, {x.shape()}, 90);
      // Inputs, weights and output rounded to 8 (bf16) or 11 (f16) bits, sums in f32.
      const double tol = (t == kg::DType::BF16 ? 2e-2 : 4e-3) * scale;
      const kg::Tensor own = kg::emu::run_model(r, {x}, converted(params, t), true).at(0);
      EXPECT_TRUE(kg_test::all_written(own));
      EXPECT_TRUE(kg_test::all_close(own, want, 0.0, tol));
      if (!kg::Device::cuda_available()) continue;
      // On the GPU, the rewritten model on its own kernels: the mma instruction itself.
      const kg::Tensor got = own_kernels_on_gpu(r, x, converted(params, t));
      EXPECT_TRUE(kg_test::all_written(got));
      EXPECT_TRUE(kg_test::all_close(got, want, 0.0, tol));
    }
  }
}

// The few-channel path's last k step reaches past kh·kw·CP (5 channels padded to 6: k = 54 of a
// 64-wide reduction); those registers must be zero, not a read of the window's first tap times a
// zero weight: with an infinite input there, inf · 0 would make a NaN where the convolution gives
// ±inf. One input element is +inf, at a pixel that is some outputs' window origin; the outputs
// must match the CPU's, infinities included, under the emulator and on a GPU.
TEST(ChannelsLastGpu, TensorCorePaddingMakesNoNaNOfAnInfiniteInput) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Model m = make_model(
      [](const kg::SymTensor& x) { return kg::nn::conv2d(x, 8, 3, {.padding = 1, .bias = false}, "conv"); }, 5, 6,
      6);
  const auto params = random_params(m, rng);
  kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {1, 5, 6, 6});
  x.data<float>()[2 * 6 + 2] = std::numeric_limits<float>::infinity();  // channel 0, pixel (2, 2)
  const kg::Tensor want = nchw_cpu_output(m, x, params);
  int infinite = 0;
  for (std::int64_t i = 0; i < want.numel(); ++i) infinite += std::isinf(want.item(i)) ? 1 : 0;
  ASSERT_EQ(infinite, 8 * 9);  // every channel of the 9 outputs whose window holds the pixel
  const kg::Model r = rewritten(m, {.gpu = true}, kg::DType::BF16);
  const auto p = converted(params, kg::DType::BF16);
  const double tol = 2e-2 * std::max(1.0, max_abs_finite(want));
  EXPECT_TRUE(kg_test::all_close(kg::emu::run_model(r, {x}, p, true).at(0), want, 0.0, tol));
  if (kg::Device::cuda_available()) {
    EXPECT_TRUE(kg_test::all_close(own_kernels_on_gpu(r, x, p), want, 0.0, tol));
  }
}

// ResNet's stem (3 channels, 7×7/2, BatchNorm, ReLU) on the tensor-core kernel at batches large
// enough that a block of its few-channel path computes two and four tiles in turn, the last
// block's share partial (98 tiles an image), on the GPU against the f32 CPU.
TEST(ChannelsLastGpu, TensorCoreStemAtLargeBatchesMatchesTheCpu) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "needs a GPU";
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Model m = make_model(
      [](const kg::SymTensor& x) {
        const kg::SymTensor y = kg::nn::conv2d(x, 64, 7, {.stride = 2, .padding = 3, .bias = false}, "conv1");
        return kg::relu(kg::nn::batch_norm2d(y, "bn1"), "relu");
      },
      3, 224, 224);
  const auto params = random_params(m, rng);
  for (std::int64_t batch : {23, 85}) {
    SCOPED_TRACE("batch " + std::to_string(batch));
    const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {batch, 3, 224, 224});
    const kg::Tensor want = nchw_cpu_output(m, x, params);
    const double tol = 2e-2 * std::max(1e-3, max_abs(want));
    const kg::Model r = rewritten(m, {.gpu = true}, kg::DType::BF16);
    const kg::Tensor got = own_kernels_on_gpu(r, x, converted(params, kg::DType::BF16));
    EXPECT_TRUE(kg_test::all_written(got));
    EXPECT_TRUE(kg_test::all_close(got, want, 0.0, tol));
  }
}

// The same in bf16, on a ResNet-18 at 32 × 32: the library path under the emulator against the
// f32 model on the CPU, within bf16's rounding through 18 layers.
TEST(ChannelsLastGpu, Bf16ResNet18LibraryPathMatchesTheF32Cpu) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Model m = make_model([](const kg::SymTensor& x) { return kg::models::resnet18(x, 10); }, 3, 32, 32);
  const kg::Model r = rewritten(m, {.gpu = true}, kg::DType::BF16);
  ASSERT_EQ(op_counts(r).at("nn.conv2d_nhwc"), 20);
  EXPECT_EQ(op_counts(r).at("nn.max_pool2d_nhwc"), 1);
  const auto params = random_params(m, rng);
  const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {2, 3, 32, 32});
  const kg::Tensor want = nchw_cpu_output(m, x, params);
  int library_steps = 0;
  const kg::Tensor got =
      kg::emu::run_model(r, {x}, converted(params, kg::DType::BF16), false, true, &library_steps).at(0);
  EXPECT_EQ(library_steps, 21);
  EXPECT_TRUE(kg_test::all_written(got));
  // bf16 keeps 8 bits: a few percent of the output's scale after 18 layers of random weights.
  EXPECT_TRUE(kg_test::all_close(got, want, 0.0, 0.08 * max_abs(want)));
  // With the sixteen 3×3 convolutions' epilogues (shift, the residual in every second one, ReLU)
  // fused into their calls, as cuDNN's graphs run them; the stem and the 1×1 downsampling
  // convolutions are GEMM forms.
  int fused = 0;
  const kg::Tensor got_fused =
      kg::emu::run_model(r, {x}, converted(params, kg::DType::BF16), false, true, &library_steps, &fused).at(0);
  EXPECT_EQ(fused, 16);
  EXPECT_TRUE(kg_test::all_written(got_fused));
  EXPECT_TRUE(kg_test::all_close(got_fused, want, 0.0, 0.08 * max_abs(want)));
}

// The channels-last max pool's kernel, in 16-byte packs of channels (8 channels of f32: two
// packs) and one channel at a time (6), with NaN inputs: a NaN in a window wins, as in NCHW.
// Square and non-square windows.
TEST(ChannelsLastGpu, EmulatedMaxPoolMatchesNchwWithNaNs) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Size2 windows[] = {{3, 3}, {2, 4}, {4, 3}};
  for (std::int64_t channels : {8, 6}) {
    for (const kg::Size2& k : windows) {
      SCOPED_TRACE(std::to_string(channels) + " channels, window " + std::to_string(k.h) + "x" +
                   std::to_string(k.w));
      const kg::Model m = make_model(
          [&](const kg::SymTensor& x) {
            kg::SymTensor y = kg::nn::conv2d(x, channels, 1, {}, "conv");
            return kg::max_pool2d(y, k, 2, 1, 1, false, "pool");
          },
          2, 9, 10);
      const kg::Model r = rewritten(m, {.gpu = true, .tf32 = true});
      ASSERT_EQ(op_counts(r).at("nn.max_pool2d_nhwc"), 1);
      const auto params = random_params(m, rng);
      kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {2, 2, 9, 10});
      for (std::int64_t i : {3, 47, 200, 301}) x.data<float>()[i] = NAN;
      const kg::Tensor want = nchw_cpu_output(m, x, params);
      const kg::Tensor got = kg::emu::run_model(r, {x}, params, /*checked=*/true).at(0);
      ASSERT_EQ(got.shape(), want.shape());
      int nans = 0;
      for (std::int64_t i = 0; i < want.numel(); ++i) {
        const float w = want.data<float>()[i], g = got.data<float>()[i];
        if (std::isnan(w)) {
          ++nans;
          EXPECT_TRUE(std::isnan(g)) << "element " << i;
        } else {
          EXPECT_NEAR(g, w, 1e-5 * (1 + std::abs(w))) << "element " << i;
        }
      }
      EXPECT_GT(nans, 0);
    }
  }
}

TEST(ChannelsLastGpu, HalfChannelsLastOpsOnTheCpuAreAnErrorNamingTheNode) {
  const kg::Model m = make_model(small_resnet, 3, 8, 8);
  const kg::Model r = rewritten(m, {.gpu = true}, kg::DType::BF16);
  kg::LoadOptions o;
  o.vendor_libraries = false;
  kg::LoadedModel lm = r.load(kg::Device::cpu(), {{1, 3, 8, 8}}, o);
  kg_test::expect_error([&] { lm.forward({kg::Tensor::zeros(kg::DType::F32, {1, 3, 8, 8})}); },
                        {"nn.conv2d_nhwc", "stem.conv", "runs f32 only on the CPU", "bf16"});
}

TEST(ChannelsLastGpu, MixedDtypesAreRefused) {
  const kg::ops::Conv2dOp c(4, 4, 3, {.padding = 1}, kg::DType::F32);
  const kg::ops::ChannelsLastConvOp op(c, kg::ops::ConvEpilogueSpec{.residual = true}, {});
  EXPECT_EQ(op.infer_output_dtype({kg::DType::BF16, kg::DType::BF16}), kg::DType::BF16);
  kg_test::expect_error([&] { op.infer_output_dtype({kg::DType::BF16, kg::DType::F32}); },
                        {"one dtype", "f32", "bf16"});
  kg_test::expect_error([&] { op.infer_output_dtype({kg::DType::I32, kg::DType::I32}); }, {"i32"});
}

// ---- on a GPU ----

namespace {

bool cudnn_here() { return kg::Device::cuda_available() && kg::cuda::convolution_library_available(); }

// The node ops and kernels of one profiled forward.
std::vector<kg::NodeTime> profiled(const kg::Model& m, const kg::Tensor& x, const std::map<std::string, kg::Tensor>& p,
                                   kg::LoadOptions o) {
  o.profile = true;
  kg::LoadedModel lm = m.load(kg::Device::cuda(), {x.shape()}, o);
  lm.load_state_dict(p, false);
  lm.forward({x});
  return lm.profile();
}

}  // namespace

TEST(ChannelsLastGpu, CudnnChannelsLastMatchesTheCpuInBf16F16AndTf32) {
  if (!cudnn_here()) GTEST_SKIP() << "needs a GPU with cuDNN";
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (bool resnet : {false, true}) {
    SCOPED_TRACE(resnet ? "resnet18" : "small resnet");
    const kg::Model m = resnet ? make_model([](const kg::SymTensor& x) { return kg::models::resnet18(x, 10); }, 3, 64, 64)
                               : make_model(small_resnet, 3, 19, 17);
    const auto params = random_params(m, rng);
    const std::vector<std::int64_t> shape = resnet ? std::vector<std::int64_t>{4, 3, 64, 64}
                                                   : std::vector<std::int64_t>{3, 3, 19, 17};
    const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, shape);
    const kg::Tensor want = nchw_cpu_output(m, x, params);
    const double scale = std::max(1.0, max_abs(want));
    struct Mode {
      const char* name;
      kg::DType precision;
      bool tf32;
      double tol;  // of the output's scale
    };
    for (const Mode& mode : {Mode{"bf16", kg::DType::BF16, false, 0.08}, Mode{"f16", kg::DType::F16, false, 0.02},
                             Mode{"tf32", kg::DType::F32, true, 0.01}}) {
      SCOPED_TRACE(mode.name);
      kg::LoadOptions o;
      o.precision = mode.precision;
      o.tf32 = mode.tf32;
      o.poison_buffers = true;
      kg::LoadedModel gpu = m.load(kg::Device::cuda(), {shape}, o);
      gpu.load_state_dict(params, false);
      const kg::Tensor got = gpu.forward({x}).at(0);
      EXPECT_TRUE(kg_test::all_written(got));
      EXPECT_TRUE(kg_test::all_close(got, want, 0.0, mode.tol * scale));
      // It ran channels-last: the 1×1 downsampling convolutions as GEMMs on cuBLASLt, the stem
      // (3 input channels) on our tensor-core kernel in f16 and bf16 and as a GEMM on cuBLASLt in
      // TF32, the rest on cuDNN.
      // In f16 and bf16 every cuDNN convolution runs as a fused graph (its shift, residual and
      // ReLU in the library's kernel); the description says why where one does not.
      int nhwc = 0, on_cudnn = 0, on_cublas = 0, on_own = 0, fused = 0;
      for (const auto& t : profiled(m, x, params, o)) {
        if (t.op != "nn.conv2d_nhwc") continue;
        ++nhwc;
        const bool on_graph = t.kernel.find("cudnn graph") != std::string::npos;
        if (t.kernel.find("cudnn") != std::string::npos && t.kernel.find("nhwc") != std::string::npos) ++on_cudnn;
        if (on_graph && t.kernel.find("fused") != std::string::npos) ++fused;
        if (mode.precision != kg::DType::F32 && t.kernel.find("cudnn") != std::string::npos && !on_graph)
          ADD_FAILURE() << t.node << ": " << t.kernel;
        if (t.kernel.find("cublasLt") != std::string::npos) ++on_cublas;
        if (t.kernel == "nn.conv2d_nhwc") ++on_own;
      }
      const int stem_own = mode.precision == kg::DType::F32 ? 0 : 1;
      EXPECT_EQ(nhwc, resnet ? 20 : 6);
      EXPECT_EQ(on_own, stem_own);
      EXPECT_EQ(on_cublas, (resnet ? 4 : 2) - stem_own);
      EXPECT_EQ(on_cudnn + on_cublas + on_own, nhwc);
      EXPECT_EQ(fused, mode.precision == kg::DType::F32 ? 0 : on_cudnn);
      // Turned off, the same model runs NCHW and agrees.
      kg::LoadOptions off = o;
      off.channels_last = false;
      for (const auto& t : profiled(m, x, params, off)) EXPECT_NE(t.op, "nn.conv2d_nhwc");
    }
  }
}

// KG_CUDNN_FUSION=0: the same bf16 model on cuDNN's legacy calls, each followed by the op's
// epilogue kernel, which says why it is not fused, and the output as with the fused graphs.
TEST(ChannelsLastGpu, CudnnFusionTurnedOffRunsTheEpilogueKernels) {
  if (!cudnn_here()) GTEST_SKIP() << "needs a GPU with cuDNN";
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Model m = make_model(small_resnet, 3, 19, 17);
  const auto params = random_params(m, rng);
  const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {3, 3, 19, 17});
  const kg::Tensor want = nchw_cpu_output(m, x, params);
  kg::LoadOptions o;
  o.precision = kg::DType::BF16;
  o.poison_buffers = true;
  ::setenv("KG_CUDNN_FUSION", "0", 1);
  const std::vector<kg::NodeTime> unfused = profiled(m, x, params, o);
  kg::LoadedModel gpu = m.load(kg::Device::cuda(), {x.shape()}, o);
  ::unsetenv("KG_CUDNN_FUSION");
  gpu.load_state_dict(params, false);
  const kg::Tensor got = gpu.forward({x}).at(0);
  EXPECT_TRUE(kg_test::all_written(got));
  EXPECT_TRUE(kg_test::all_close(got, want, 0.0, 0.08 * std::max(1.0, max_abs(want))));
  int legacy = 0;
  for (const auto& t : unfused) {
    if (t.op != "nn.conv2d_nhwc" || t.kernel.find("cudnn") == std::string::npos) continue;
    ++legacy;
    EXPECT_EQ(t.kernel.find("cudnn graph"), std::string::npos) << t.node << ": " << t.kernel;
    EXPECT_NE(t.kernel.find("epilogue not fused: turned off by KG_CUDNN_FUSION=0"), std::string::npos)
        << t.node << ": " << t.kernel;
  }
  EXPECT_GT(legacy, 0);
}
