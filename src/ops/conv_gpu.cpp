// nn.conv2d and nn.fused_conv2d on the GPU: choosing the kernel of conv.cu and launching it.
#include "ops/conv_gpu.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "ops/conv_shared.cuh"
#include "ops/gpu_util.hpp"
#include "ops/op_util.hpp"

namespace kg::ops {
namespace {

constexpr unsigned kConvThreads = KG_CONV_THREADS;

// tiled: output columns per thread, most output channels per block, most kernel size, and the
// shared memory a block may take (the default limit without opting in).
constexpr std::int64_t kTiledColumns = 2;
constexpr std::int64_t kTiledMaxChannels = 64;
constexpr std::int64_t kTiledMaxKernel = 7;
constexpr std::int64_t kTiledSharedBytes = 48 * 1024;
// tiled: at small batches, tiles shrink until there are about this many blocks.
constexpr std::int64_t kTiledMinBlocks = 96;

// The backward launches, in this order (an unwanted gradient's launch is one idle block): dx, dw
// by ranges of images, the sum of dw's ranges (idle with one range), db with a bias.
enum ConvBackwardLaunch { kGradInput, kGradWeight, kGradWeightSum, kGradBias };
constexpr unsigned kConvBackwardThreads = KG_CONV_BWD_THREADS;
constexpr std::int64_t kConvBackwardMaxBlocks = 65535LL * 32;  // the kernels loop over the rest

// Output channels per thread (direct and tiled): a divisor of the group's count when 4 or 2 is
// one, else 4 (some threads' last channels idle) unless the group has fewer than 3.
std::int64_t channels_per_thread(std::int64_t og) {
  if (og % 4 == 0) return 4;
  if (og % 2 == 0) return 2;
  return og >= 3 ? 4 : 1;
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// The kernel parameters, as in conv.cu's entries.
std::string entry_params(const char* t) {
  return util::cat("const ", t, "* __restrict__ x, const ", t, "* __restrict__ w, const ", t,
                   "* __restrict__ bias, const ", t, "* __restrict__ bn_weight, const ", t,
                   "* __restrict__ bn_bias, const ", t, "* __restrict__ bn_mean, const ", t,
                   "* __restrict__ bn_var, const ", t, "* __restrict__ residual, ", t,
                   "* __restrict__ y, KgConvShape s, double bn_eps, double act_param");
}

// conv.cu without its entries: everything before its "---- entries ----" line.
std::string conv_body() {
  const std::string all =
      kernel_file("conv.cu");  // a copy: GCC 13 warns on the reference (-Wdangling-reference)
  const std::size_t at = all.find("\n// ---- entries ----");
  if (at == std::string::npos) throw Error("conv.cu has no \"---- entries ----\" line to cut at");
  return all.substr(0, at + 1);
}

// How the tiled kernel covers an output [n, o, ho, wo] (see conv.cu).
struct TilePlan {
  std::int64_t tile_h = 1, tile_w = 1, cc = 1, och = 1, tiles_w = 1, tiles_h = 1, chunks = 1;
  std::size_t shared = 0;
  std::int64_t blocks_per_image(std::int64_t groups) const { return groups * chunks * tiles_h * tiles_w; }
};

TilePlan tile_plan(const ConvGpuConfig& cfg, const std::vector<std::int64_t>& out) {
  const std::int64_t n = out[0], ho = out[2], wo = out[3];
  const std::int64_t groups = cfg.options.groups, og = cfg.out_channels / groups,
                     cg = cfg.in_channels / groups;
  const std::int64_t kh = cfg.kernel.h, kw = cfg.kernel.w, ocb = channels_per_thread(og);
  // Shared memory holds the compute type (16-bit elements are widened to float as they are staged).
  const std::int64_t esize = cfg.dtype == DType::F64 ? 8 : 4;
  TilePlan t;
  const std::int64_t ogp = ceil_div(og, ocb) * ocb;
  t.och = std::min(ogp, kTiledMaxChannels);
  t.chunks = ceil_div(ogp, t.och);
  // Threads: och / ocb channel blocks × tile_h rows × tcb column blocks, at most 256.
  const std::int64_t spatial = static_cast<std::int64_t>(kConvThreads) / (t.och / ocb);
  const std::int64_t tcb = std::clamp<std::int64_t>(ceil_div(wo, kTiledColumns), 1, spatial);
  t.tile_w = tcb * kTiledColumns;
  t.tiles_w = std::max<std::int64_t>(ceil_div(wo, t.tile_w), 1);
  t.tile_h = std::clamp<std::int64_t>(spatial / tcb, 1, std::max<std::int64_t>(ho, 1));
  auto tiles_h = [&] { return std::max<std::int64_t>(ceil_div(ho, t.tile_h), 1); };
  while (t.tile_h > 1 && n * groups * t.chunks * tiles_h() * t.tiles_w < kTiledMinBlocks)
    t.tile_h = ceil_div(t.tile_h, 2);
  t.tiles_h = tiles_h();
  // Input channels staged at a time: as many as fit.
  const std::int64_t window = (t.tile_h + kh - 1) * (t.tile_w + kw - 1), weights = kh * kw * t.och;
  constexpr std::int64_t align = KG_CONV_SMEM_ALIGN;  // the window's rounding, room left for it
  t.cc = std::clamp<std::int64_t>((kTiledSharedBytes / esize - align) / (window + weights), 1,
                                  std::max<std::int64_t>(cg, 1));
  t.shared =
      static_cast<std::size_t>(ceil_div(t.cc * window * esize, align) * align + t.cc * weights * esize);
  return t;
}

// The NCHW GEMM form (ConvRuntime::nchw_gemm): a reduction at least this deep, and at most this
// many output pixels over the batch (its columns then take at most K · this many elements).
// Measured on an H100 at batch 1 (ResNet-18, f32): over 784, 196 and 49 pixels the GEMM form took
// 0.032, 0.029 and 0.029 ms where cuDNN took 0.044, 0.079 and 0.164; over 3136 it took 0.041
// against cuDNN's 0.028.
constexpr std::int64_t kNchwGemmMinK = 256;
constexpr std::int64_t kNchwGemmMaxPixels = 1024;

// KG_CONV_GEMM_FORM=0 keeps every NCHW convolution on cuDNN (for comparison).
bool nchw_gemm_disabled() {
  const char* v = std::getenv("KG_CONV_GEMM_FORM");
  return v && std::string(v) == "0";
}

// Launches cover whole images and fewer than 2^31 items (direct: pixels × channel blocks; gemm:
// pixels; tiled: blocks) each, so that the kernels' index math stays in 32 bits.
constexpr std::int64_t kMaxItemsPerLaunch = (std::int64_t{1} << 31) - 1;

class ConvRuntime final : public RuntimeOp {
 public:
  ConvRuntime(ConvGpuConfig cfg, ConvGpuAlgo algo, std::string label, bool backward)
      : cfg_(std::move(cfg)), algo_(algo), label_(std::move(label)), backward_(backward) {}

  // One launch per range of whole images (see kMaxItemsPerLaunch). On tensor cores (NhwcMma) a
  // launch of the filter entry first lays the weights out [O, K] in the scratch with the scale
  // folded in, and the shift after them (as the library call's prologue does).
  std::vector<Launch> launches(const LaunchTensors& t) const override {
    const auto& shape = t.output.shape;
    const int n = static_cast<int>(std::max<std::int64_t>(ceil_div(shape[0], images_per_launch(shape)), 1));
    const std::size_t shared = algo_ == ConvGpuAlgo::Tiled ? tile_plan(cfg_, shape).shared : 0;
    std::vector<Launch> v;
    if (algo_ == ConvGpuAlgo::NhwcMma) {
      const auto in = nchw(t.inputs.at(0).shape);
      const KgConvShape s = mma_geometry(shape[0], in, nchw(shape));
      v.push_back(entry_launch(t, filter_entry_, cfg_.out_channels * s.gemm_k + cfg_.out_channels, 0,
                               t.params.at(0).ptr, cfg_.options.bias ? t.params.at(1).ptr : 0, cfg_.batch_norm, 0,
                               t.scratch, s));
    }
    for (int l = 0; l < n; ++l) {
      Launch L;
      L.grid = forward_grid(l, shape, nchw(t.inputs.at(0).shape));
      L.block = {kConvThreads, 1, 1};
      L.shared_bytes = shared;
      pack(l, t, L.args);
      v.push_back(std::move(L));
    }
    return v;
  }

  // The convolution for cuDNN, and the rest (bias, folded BatchNorm, residual, activation) as
  // one launch of the module's epilogue entry over the library's output.
  // 16-bit convolutions too: the library computes in f32 and rounds its output, which the epilogue
  // then reads in place and computes on in float.
  // Channels-last: a prologue launch first writes into the scratch the weights laid out
  // [O, kh, kw, C/groups] with a BatchNorm's scale folded in and the per-channel shift (bias,
  // BatchNorm) after them; with an input channel count cuDNN's tensor cores do not take (not a
  // multiple of 8, one group), the weights' and, by a second launch, the input's channels are
  // padded with zeros to a multiple of 8. The epilogue then adds the shift and the residual and
  // applies the activation; the call also describes it (Conv2dCall::fusable) where the activation
  // is a ReLU or none, so that cuDNN can run it inside the convolution's kernel.
  std::optional<LibraryCall> library_call(const LaunchTensors& t) const override {
    if (!is_floating(cfg_.dtype)) return std::nullopt;
    const auto in = nchw(t.inputs.at(0).shape);
    const auto out = nchw(t.output.shape);
    const auto& op = cfg_.options;
    const bool last = cfg_.channels_last;
    if (last && !t.scratch) return std::nullopt;
    const bool epilogue = op.bias || cfg_.batch_norm || cfg_.residual || cfg_.activation || cfg_.activation_form;
    // Arguments of an entry: its pointers, then the geometry and the scalars.
    auto launch = [&](const std::string& entry, std::int64_t items, DevicePtr x, DevicePtr w, DevicePtr bias,
                      bool with_bn, DevicePtr residual, DevicePtr y) {
      return entry_launch(t, entry, items, x, w, bias, with_bn, residual, y, geometry(out[0], in, out));
    };
    const DevicePtr bias = op.bias ? t.params[1].ptr : 0;
    const DevicePtr residual = cfg_.residual ? t.inputs.at(1).ptr : 0;
    if (!last) {
      LibraryCall call{conv_call(t.inputs[0].ptr, t.params.at(0).ptr, t.output.ptr, in, out), {}};
      const std::int64_t k = nchw_gemm(in, out);
      const bool cols_are_input = nchw_gemm_reads_input();
      if (k && (cols_are_input || t.scratch)) {
        // The GEMM form instead. Per image, y[n] [O, OH·OW] = w [O, K] · cols[n] [K, OH·OW]: the
        // weights as they are, the columns written by the im2col prologue into the scratch (or the
        // input itself for a 1×1 convolution without stride or padding).
        const std::int64_t pixels = out[2] * out[3];
        GemmCall g;
        g.dtype = cfg_.dtype;
        g.a = t.params.at(0).ptr;
        g.b = cols_are_input ? t.inputs[0].ptr : t.scratch;
        g.c = t.output.ptr;
        g.m = out[1];
        g.n = pixels;
        g.k = k;
        g.lda = k;
        g.ldb = pixels;
        g.ldc = pixels;
        g.batch = out[0];
        g.stride_a = 0;
        g.stride_b = k * pixels;
        g.stride_c = out[1] * pixels;
        call.call = g;
        if (!cols_are_input)
          call.prologue.push_back(launch(im2col_entry_, out[0] * k * pixels, t.inputs[0].ptr, 0, 0, false, 0, t.scratch));
      }
      if (epilogue)
        call.epilogue.push_back(
            launch(epilogue_entry_, epilogue_items(out, last), 0, 0, bias, cfg_.batch_norm, residual, t.output.ptr));
      return call;
    }
    const LastScratch ls = last_scratch(t);
    if (ls.gemm_k) {
      // im2col rows times the weights' rows; the shift (and a ReLU) as cuBLASLt's epilogue where
      // nothing else follows.
      const bool in_gemm = !cfg_.residual && !cfg_.activation_form &&
                           (!cfg_.activation || cfg_.activation->fn == UnaryFn::Relu);
      const bool rows_are_input = gemm_reads_input(in);
      GemmCall g;
      g.dtype = cfg_.dtype;
      g.a = rows_are_input ? t.inputs[0].ptr : t.scratch + ls.input;
      g.b = t.scratch;
      g.c = t.output.ptr;
      g.bias = in_gemm ? t.scratch + ls.shift : 0;
      g.relu = in_gemm && cfg_.activation;
      g.trans_b = true;
      g.m = out[0] * out[2] * out[3];
      g.n = out[1];
      g.k = ls.gemm_k;
      g.lda = ls.gemm_k;
      g.ldb = ls.gemm_k;
      g.ldc = out[1];
      LibraryCall call{g, {}};
      // The tensor-core kernel's few-channel path reads the input once instead of writing and
      // reading the im2col rows: run it unless a tuned load finds otherwise.
      call.own_first = algo_ == ConvGpuAlgo::NhwcMma && patch_plan(in, out).has_value();
      call.prologue.push_back(launch(filter_entry_, ls.filter_elems + out[1], 0, t.params.at(0).ptr, bias,
                                     cfg_.batch_norm, 0, t.scratch));
      // One thread per 16 bytes of the rows.
      const std::int64_t per_thread = 16 / static_cast<std::int64_t>(dtype_size(cfg_.dtype));
      if (!rows_are_input)
        call.prologue.push_back(launch(im2col_entry_, g.m * g.k / per_thread, t.inputs[0].ptr, 0, 0, false, 0, g.a));
      if (epilogue && !in_gemm)
        call.epilogue.push_back(
            launch(epilogue_entry_, epilogue_items(out, last), 0, 0, t.scratch + ls.shift, false, residual, t.output.ptr));
      return call;
    }
    std::vector<std::int64_t> padded = in;
    padded[1] = ls.channels;
    Conv2dCall conv = conv_call(ls.input ? t.scratch + ls.input : t.inputs[0].ptr, t.scratch, t.output.ptr, padded, out);
    // What the epilogue launch computes, for a library that fuses it (a ReLU, or no activation).
    if (epilogue && !cfg_.activation_form && (!cfg_.activation || cfg_.activation->fn == UnaryFn::Relu))
      conv.fusable = Conv2dCall::Fusable{t.scratch + ls.shift, residual, cfg_.activation.has_value()};
    LibraryCall call{conv, {}};
    call.own_first = algo_ == ConvGpuAlgo::NhwcMma && patch_plan(in, out).has_value();  // as in the GEMM form
    call.prologue.push_back(launch(filter_entry_, ls.filter_elems + out[1], 0, t.params.at(0).ptr, bias,
                                   cfg_.batch_norm, 0, t.scratch));
    if (ls.input)
      call.prologue.push_back(launch(pad_entry_, numel_of(padded), t.inputs[0].ptr, 0, 0, false, 0, t.scratch + ls.input));
    if (epilogue)
      call.epilogue.push_back(
          launch(epilogue_entry_, epilogue_items(out, last), 0, 0, t.scratch + ls.shift, false, residual, t.output.ptr));
    return call;
  }
  // Threads of the epilogue launch over `out` (NCHW sizes): one per 16-byte pack where
  // kg_conv2d_epilogue moves packs (NCHW planes of whole packs; channels-last, whose scale the
  // prologue folds, with whole packs of channels), one per element otherwise.
  std::int64_t epilogue_items(const std::vector<std::int64_t>& out, bool channels_last) const {
    const std::int64_t v = 16 / static_cast<std::int64_t>(dtype_size(cfg_.dtype)), n = numel_of(out);
    return (channels_last ? out[1] % v : (out[2] * out[3]) % v) == 0 ? n / v : n;
  }
  // A launch of one of the module's entries over `items` threads (the epilogue, filter, pad and
  // im2col entries loop over their work): the pointers, with the BatchNorm's parameters where
  // `with_bn`, then the geometry and the scalars, as every entry takes them.
  Launch entry_launch(const LaunchTensors& t, const std::string& entry, std::int64_t items, DevicePtr x, DevicePtr w,
                      DevicePtr bias, bool with_bn, DevicePtr residual, DevicePtr y, const KgConvShape& s) const {
    const std::size_t bn = cfg_.options.bias ? 2 : 1;
    Launch L;
    L.entry = entry;
    L.block = {kConvThreads, 1, 1};
    L.grid = grid_1d(items, kConvThreads);
    L.args.pointer(x);
    L.args.pointer(w);
    L.args.pointer(bias);
    for (std::size_t i = 0; i < 4; ++i) L.args.pointer(with_bn ? t.params.at(bn + i).ptr : 0);
    L.args.pointer(residual);
    L.args.pointer(y);
    L.args.bytes(&s, sizeof s);
    L.args.f64(cfg_.bn_eps);
    L.args.f64(cfg_.activation ? cfg_.activation->param : 0.0);
    return L;
  }

  // dx by cuDNN's backward data, dw by its backward filter, db by the backward module's kernel.
  std::optional<LibraryBackward> backward_library_calls(const LaunchTensors& t) const override {
    if (!backward_ || (cfg_.dtype != DType::F32 && cfg_.dtype != DType::F64)) return std::nullopt;
    const auto& in = t.inputs.at(0).shape;
    const auto& out = t.grad_output.shape;
    LibraryBackward b;
    if (t.grad_inputs.at(0).ptr) {
      Conv2dCall c = conv_call(t.grad_inputs[0].ptr, t.params.at(0).ptr, t.grad_output.ptr, in, out);
      c.pass = Conv2dCall::Pass::BackwardData;
      b.calls.push_back({c, {}});
    }
    if (t.grad_params.at(0).ptr) {
      if (!t.inputs[0].ptr) return std::nullopt;  // the input was not saved
      Conv2dCall c = conv_call(t.inputs[0].ptr, t.grad_params[0].ptr, t.grad_output.ptr, in, out);
      c.pass = Conv2dCall::Pass::BackwardFilter;
      b.calls.push_back({c, {}});
    }
    if (cfg_.options.bias && t.grad_params.at(1).ptr)
      b.launches.push_back(backward_launches(t).at(kGradBias));
    return b;
  }

  // The module's entry that applies the epilogue alone (see library_call()).
  void set_epilogue_entry(std::string entry) { epilogue_entry_ = std::move(entry); }
  // Channels-last: the entry that lays the weights out for the library (see library_call()).
  void set_filter_entry(std::string entry) { filter_entry_ = std::move(entry); }
  // Channels-last: the library's weights, shift and padded input (see library_call()).
  std::size_t scratch_bytes(const LaunchTensors& t) const override {
    if (cfg_.channels_last) return last_scratch(t).bytes;
    const auto in = nchw(t.inputs.at(0).shape);
    const auto out = nchw(t.output.shape);
    const std::int64_t k = nchw_gemm(in, out);
    if (!k || nchw_gemm_reads_input()) return 0;
    return static_cast<std::size_t>(out[0] * k * out[2] * out[3]) * dtype_size(cfg_.dtype);
  }
  void set_pad_entry(std::string entry) { pad_entry_ = std::move(entry); }
  void set_im2col_entry(std::string entry) { im2col_entry_ = std::move(entry); }

  // ---- backward (conv_backward.cu): dx, dw, the sum of dw's ranges, then db with a bias ----
  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    if (!backward_) return {};
    std::vector<Launch> v;
    for (int l = kGradInput; l <= (cfg_.options.bias ? kGradBias : kGradWeightSum); ++l) {
      Launch L;
      L.entry = backward_entry(l);
      L.grid = backward_grid(l, t);
      L.block = {kConvBackwardThreads, 1, 1};
      pack_backward(l, t, L.args);
      v.push_back(std::move(L));
    }
    return v;
  }
  // Partial weight sums, one per weight element and range of images.
  std::size_t backward_scratch_bytes(const LaunchTensors& t) const override {
    const std::int64_t chunks = weight_chunks(t);
    return chunks > 1 ? static_cast<std::size_t>(weights(t) * chunks) * dtype_size(cfg_.dtype) : 0;
  }

 private:
  // The convolution between x [in] and y [out] with weights w, for a vendor library.
  Conv2dCall conv_call(DevicePtr x, DevicePtr w, DevicePtr y, const std::vector<std::int64_t>& in,
                       const std::vector<std::int64_t>& out) const {
    const auto& op = cfg_.options;
    Conv2dCall c;
    c.dtype = cfg_.dtype;
    c.x = x;
    c.w = w;
    c.y = y;
    c.batch = in[0];
    c.in_channels = in[1];
    c.height = in[2];
    c.width = in[3];
    c.out_channels = out[1];
    c.kernel_h = cfg_.kernel.h;
    c.kernel_w = cfg_.kernel.w;
    c.out_height = out[2];
    c.out_width = out[3];
    c.pad_h = op.padding.h;
    c.pad_w = op.padding.w;
    c.stride_h = op.stride.h;
    c.stride_w = op.stride.w;
    c.dilation_h = op.dilation.h;
    c.dilation_w = op.dilation.w;
    c.groups = op.groups;
    c.channels_last = cfg_.channels_last;
    return c;
  }
  // Where the channels-last library path keeps its data in the scratch (byte offsets, each a
  // multiple of KG_CONV_SCRATCH_ALIGN): the weights [O, kh, kw, channels] at 0, the shift [O] after them, and the
  // input padded to `channels` (0 when it is not padded).
  // With the GEMM form (gemm_k > 0) the weights are [O, gemm_k] instead and `input` holds the
  // im2col rows [N·OH·OW, gemm_k].
  struct LastScratch {
    std::int64_t channels = 0;  // input channels the library sees
    std::int64_t filter_elems = 0;
    std::int64_t gemm_k = 0;
    std::size_t shift = 0, input = 0, bytes = 0;
  };
  LastScratch last_scratch(const LaunchTensors& t) const {
    const auto in = nchw(t.inputs.at(0).shape);
    const auto out = nchw(t.output.shape);
    const auto esize = dtype_size(cfg_.dtype);
    auto align = scratch_align;
    LastScratch ls;
    ls.channels = padded_channels(in[1]);
    ls.gemm_k = gemm_k(in, out);
    const std::int64_t cg = cfg_.options.groups == 1 ? ls.channels : in[1] / cfg_.options.groups;
    ls.filter_elems = ls.gemm_k ? cfg_.out_channels * ls.gemm_k : cfg_.out_channels * cfg_.kernel.h * cfg_.kernel.w * cg;
    ls.shift = align(static_cast<std::size_t>(ls.filter_elems) * esize);
    ls.bytes = ls.shift + align(static_cast<std::size_t>(cfg_.out_channels) * esize);
    if (ls.gemm_k && !gemm_reads_input(in)) {
      ls.input = ls.bytes;
      ls.bytes += align(static_cast<std::size_t>(out[0] * out[2] * out[3] * ls.gemm_k) * esize);
    } else if (!ls.gemm_k && ls.channels != in[1]) {
      ls.input = ls.bytes;
      ls.bytes += align(static_cast<std::size_t>(in[0] * ls.channels * in[2] * in[3]) * esize);
    }
    return ls;
  }
  // The GEMM form of a channels-last convolution: out [N·OH·OW, O] = rows [N·OH·OW, K] · Wᵀ on
  // cuBLASLt, the rows being the input's windows laid out by the im2col prologue (or the input
  // itself for a 1×1, stride-1, unpadded convolution). Two cases:
  //  - few input channels (C not a multiple of 8: ResNet's 7×7 stem over 3 channels), K = kh·kw·C
  //    rounded up to 8. cuDNN reached about 20 TFLOP/s there with the channels padded to 8, where
  //    the GEMM's rows are 8/3 times shorter than the padded convolution's;
  //  - 1×1 unpadded convolutions with C a multiple of 8 (ResNet's strided downsampling shortcuts),
  //    K = C: the rows are the subsampled pixels. cuDNN's heuristic choice for the first of them
  //    ran at 9 TFLOP/s.
  // For one group, O a multiple of 8 (the library's row alignment) and an im2col matrix of at most
  // 2 GiB; 0 (cuDNN) otherwise.
  std::int64_t gemm_k(const std::vector<std::int64_t>& in, const std::vector<std::int64_t>& out) const {
    const auto& op = cfg_.options;
    if (!cfg_.channels_last || op.groups != 1 || cfg_.out_channels % 8 != 0) return 0;
    const bool one_by_one = cfg_.kernel.h == 1 && cfg_.kernel.w == 1 && op.padding.h == 0 && op.padding.w == 0;
    std::int64_t k = 0;
    if (in.at(1) % 8 != 0)
      k = (cfg_.kernel.h * cfg_.kernel.w * in[1] + 7) / 8 * 8;
    else if (one_by_one)
      k = in[1];
    else
      return 0;
    if (gemm_reads_input(in)) return k;
    const double bytes = double(out.at(0)) * double(out[2]) * double(out[3]) * double(k) * double(dtype_size(cfg_.dtype));
    return bytes <= double(std::int64_t{2} << 30) ? k : 0;
  }
  // The GEMM form of an NCHW f32 convolution with one group, for small outputs over deep
  // reductions (batch 1 in ResNet's later layers): per image, y[n] [O, OH·OW] = w [O, K] ·
  // cols[n] [K, OH·OW] with K = C·kh·kw, on cuBLASLt, which splits such a product's reduction
  // over the GPU where cuDNN's convolutions cover the few output tiles with few blocks. The
  // reduction length K, or 0 (cuDNN) where it does not apply or KG_CONV_GEMM_FORM=0.
  std::int64_t nchw_gemm(const std::vector<std::int64_t>& in, const std::vector<std::int64_t>& out) const {
    const auto& op = cfg_.options;
    if (cfg_.channels_last || cfg_.dtype != DType::F32 || op.groups != 1 || im2col_entry_.empty()) return 0;
    const std::int64_t k = in.at(1) * cfg_.kernel.h * cfg_.kernel.w;
    const std::int64_t pixels = out.at(0) * out.at(2) * out.at(3);
    if (k < kNchwGemmMinK || pixels > kNchwGemmMaxPixels || pixels == 0) return 0;
    if (nchw_gemm_disabled()) return 0;
    return k;
  }
  // The NCHW GEMM form's columns are the input itself: a 1×1 convolution without stride,
  // padding or dilation.
  bool nchw_gemm_reads_input() const {
    const auto& op = cfg_.options;
    return cfg_.kernel.h == 1 && cfg_.kernel.w == 1 && op.padding.h == 0 && op.padding.w == 0 && op.stride.h == 1 &&
           op.stride.w == 1;
  }
  // The GEMM form's rows are the input as it is: a 1×1, stride-1, unpadded convolution whose
  // channels are a multiple of 8.
  bool gemm_reads_input(const std::vector<std::int64_t>& in) const {
    const auto& op = cfg_.options;
    return cfg_.kernel.h == 1 && cfg_.kernel.w == 1 && op.padding.h == 0 && op.padding.w == 0 && op.stride.h == 1 &&
           op.stride.w == 1 && in.at(1) % 8 == 0;
  }
  // The reduction length of the tensor-core kernel's general path: kh·kw·C rounded up to a
  // multiple of 8.
  std::int64_t mma_k(const std::vector<std::int64_t>& in) const {
    return (cfg_.kernel.h * cfg_.kernel.w * in.at(1) + 7) / 8 * 8;
  }
  // The few-channel path of the tensor-core kernel (conv.cu, KgConvShape's patch_* fields): the
  // tile of KG_IG_BM output pixels and its input patch, and the block's shared memory: the patch
  // [patch_h][patch_w][cp] at 0, the weights [KG_IG_BN][ldb] at b_at, the k table (8 bytes per
  // 16-wide step and lane column) at k_at.
  struct PatchPlan {
    std::int64_t tile_h = 0, tile_w = 0, tiles_h = 0, tiles_w = 0, patch_h = 0, patch_w = 0;
    std::int64_t cp = 0, k = 0, ldb = 0, b_at = 0, k_at = 0, bytes = 0;
  };
  // For C not a multiple of 8 (ResNet's 3-channel stem), where it fits in KG_IG_SMEM: the tile
  // shape (rows × columns, a power of 2 each) that covers the output with the fewest wasted
  // pixels, and of those the smallest patch. The channels are padded to even (cp), k = kh·kw·cp
  // rounded up to a whole step of 16, and the weights' row length ldb is k or k + 16, the one
  // that is 16 more than a multiple of 32 elements: then the 8-byte B reads of a half-warp (4
  // rows of 32 bytes) fall in 32 different banks.
  std::optional<PatchPlan> patch_plan(const std::vector<std::int64_t>& in, const std::vector<std::int64_t>& out) const {
    const std::int64_t c = in.at(1);
    if (c % 8 == 0) return std::nullopt;
    const auto& op = cfg_.options;
    const std::int64_t esize = static_cast<std::int64_t>(dtype_size(cfg_.dtype));
    const std::int64_t oh = std::max<std::int64_t>(out.at(2), 1), ow = std::max<std::int64_t>(out.at(3), 1);
    PatchPlan p;
    p.cp = c + c % 2;
    p.k = (cfg_.kernel.h * cfg_.kernel.w * p.cp + 15) / 16 * 16;
    p.ldb = p.k % 32 == 16 ? p.k : p.k + 16;
    std::optional<PatchPlan> best;
    std::int64_t best_covered = 0;
    for (std::int64_t tw = KG_IG_BM; tw >= 8; tw /= 2) {
      PatchPlan q = p;
      q.tile_w = tw;
      q.tile_h = KG_IG_BM / tw;
      q.tiles_w = ceil_div(ow, q.tile_w);
      q.tiles_h = ceil_div(oh, q.tile_h);
      q.patch_h = (q.tile_h - 1) * op.stride.h + (cfg_.kernel.h - 1) * op.dilation.h + 1;
      q.patch_w = (q.tile_w - 1) * op.stride.w + (cfg_.kernel.w - 1) * op.dilation.w + 1;
      q.b_at = ceil_div(q.patch_h * q.patch_w * q.cp * esize, 16) * 16;
      q.k_at = q.b_at + KG_IG_BN * q.ldb * esize;
      q.bytes = q.k_at + q.k / 16 * 4 * 8;
      if (q.bytes > KG_IG_SMEM) continue;
      const std::int64_t covered = q.tiles_w * q.tile_w * q.tiles_h * q.tile_h;
      if (!best || covered < best_covered || (covered == best_covered && q.bytes < best->bytes)) {
        best = q;
        best_covered = covered;
      }
    }
    return best;
  }
  // The tiles a block of the few-channel path computes in turn (reusing its staged weights):
  // more where there are many, so that a large batch still has about 8 waves of blocks or more.
  static std::int64_t patch_tiles(const PatchPlan& p, std::int64_t images) {
    const std::int64_t tiles = images * p.tiles_h * p.tiles_w;
    return tiles >= 8192 ? 4 : tiles >= 2048 ? 2 : 1;
  }
  // The geometry of the tensor-core kernel (and of its filter launch) over n images: its k order
  // (gemm_k, gemm_c) and, on the few-channel path, the patch plan.
  KgConvShape mma_geometry(std::int64_t n, const std::vector<std::int64_t>& in,
                           const std::vector<std::int64_t>& out) const {
    KgConvShape s = geometry(n, in, out);
    s.gemm_k = mma_k(in);
    s.gemm_c = in.at(1);
    if (const std::optional<PatchPlan> p = patch_plan(in, out)) {
      s.gemm_k = p->k;
      s.gemm_c = p->cp;
      s.tile_h = p->tile_h;
      s.tile_w = p->tile_w;
      s.tiles_h = p->tiles_h;
      s.tiles_w = p->tiles_w;
      s.patch_h = p->patch_h;
      s.patch_w = p->patch_w;
      s.patch_tiles = patch_tiles(*p, n);
      s.patch_ldb = p->ldb;
      s.patch_b = p->b_at;
      s.patch_k = p->k_at;
    }
    return s;
  }
  // Where the filter launch puts the shift after [O, k] weights (kg_conv_shift_offset in conv.cu).
  DevicePtr mma_shift_offset(std::int64_t k) const {
    return scratch_align(static_cast<std::size_t>(cfg_.out_channels * k) * dtype_size(cfg_.dtype));
  }
  // `bytes` rounded up to where the next part of the scratch may start.
  static std::size_t scratch_align(std::size_t bytes) {
    return (bytes + KG_CONV_SCRATCH_ALIGN - 1) / KG_CONV_SCRATCH_ALIGN * KG_CONV_SCRATCH_ALIGN;
  }
  // The input channels cuDNN sees in channels-last: a multiple of 8 (what its tensor cores take),
  // zero-padded, for one group; the input's own count otherwise.
  std::int64_t padded_channels(std::int64_t c) const {
    return cfg_.options.groups == 1 && c % 8 != 0 ? (c + 7) / 8 * 8 : c;
  }
  // A shape in NCHW order: channels-last [N, H, W, C] permuted, NCHW as it is.
  std::vector<std::int64_t> nchw(const std::vector<std::int64_t>& s) const {
    if (!cfg_.channels_last) return s;
    return {s.at(0), s.at(3), s.at(1), s.at(2)};
  }

  // Arguments of forward launch `launch`: its images' base pointers, then the geometry.
  void pack(int launch, const LaunchTensors& t, ArgVisitor& v) const {
    const auto& shape = t.output.shape;
    const auto [first, count] = images_of(launch, shape);
    const auto in = nchw(t.inputs[0].shape);
    const auto esize = static_cast<DevicePtr>(dtype_size(cfg_.dtype));
    const auto in_image = static_cast<DevicePtr>(in[1] * in[2] * in[3]) * esize;
    const auto out_image = static_cast<DevicePtr>(shape[1] * shape[2] * shape[3]) * esize;
    const auto at = static_cast<DevicePtr>(first);
    const std::size_t bn = cfg_.options.bias ? 2 : 1;
    if (algo_ == ConvGpuAlgo::NhwcMma) {
      // The weights and the shift as the filter launch laid them out in the scratch.
      const KgConvShape s = mma_geometry(count, in, nchw(shape));
      v.pointer(t.inputs[0].ptr + at * in_image);
      v.pointer(t.scratch);
      v.pointer(t.scratch ? t.scratch + mma_shift_offset(s.gemm_k) : 0);
      for (std::size_t i = 0; i < 4; ++i) v.pointer(0);
      v.pointer(cfg_.residual ? t.inputs[1].ptr + at * out_image : 0);
      v.pointer(t.output.ptr + at * out_image);
      v.bytes(&s, sizeof s);
      v.f64(cfg_.bn_eps);
      v.f64(cfg_.activation ? cfg_.activation->param : 0.0);
      return;
    }
    v.pointer(t.inputs[0].ptr + at * in_image);
    v.pointer(t.params[0].ptr);
    v.pointer(cfg_.options.bias ? t.params[1].ptr : 0);
    for (std::size_t i = 0; i < 4; ++i) v.pointer(cfg_.batch_norm ? t.params[bn + i].ptr : 0);
    v.pointer(cfg_.residual ? t.inputs[1].ptr + at * out_image : 0);
    v.pointer(t.output.ptr + at * out_image);
    const KgConvShape s = geometry(count, in, nchw(shape));
    v.bytes(&s, sizeof s);
    v.f64(cfg_.bn_eps);
    v.f64(cfg_.activation ? cfg_.activation->param : 0.0);
  }
  Dim3 forward_grid(int launch, const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& in_nchw) const {
    const std::int64_t n = images_of(launch, shape).second;
    const std::int64_t og = shape[1] / cfg_.options.groups;
    switch (algo_) {
      case ConvGpuAlgo::Gemm: {  // a tile per block: pixel tiles (x), channel tiles (y), groups (z)
        const std::int64_t pixels = n * shape[2] * shape[3], groups = cfg_.options.groups;
        auto dim = [&](std::int64_t blocks, char axis, const auto&... work) {
          return grid_dim(blocks, axis, util::cat("launch ", launch, " of the gemm kernel over ", work...));
        };
        return {dim(ceil_div(pixels, KG_CONV_BN), 'x', pixels, " output pixels in tiles of ", KG_CONV_BN),
                dim(ceil_div(og, KG_CONV_BM), 'y', og, " output channels a group in tiles of ", KG_CONV_BM),
                dim(groups, 'z', groups, " groups")};
      }
      case ConvGpuAlgo::Tiled:  // a block per tile
        return {grid_dim(n * items_per_image(shape), 'x',
                         util::cat("launch ", launch, " of the tiled kernel over ", n, " images of ",
                                   items_per_image(shape), " tiles")),
                1, 1};
      case ConvGpuAlgo::NhwcMma: {  // a tile per block: pixel tiles (x), channel tiles (y)
        const auto out = nchw(shape);
        const std::int64_t pixels = n * out[2] * out[3];
        auto dim = [&](std::int64_t blocks, char axis, const auto&... work) {
          return grid_dim(blocks, axis, util::cat("launch ", launch, " of the tensor-core kernel over ", work...));
        };
        if (const std::optional<PatchPlan> p = patch_plan(in_nchw, out)) {  // patch_tiles tiles a block
          const std::int64_t tiles = n * p->tiles_h * p->tiles_w, per = patch_tiles(*p, n);
          return {dim(ceil_div(tiles, per), 'x', tiles, " tiles of ", p->tile_h, " x ", p->tile_w, " pixels, ", per,
                      " a block"),
                  dim(ceil_div(out[1], KG_IG_BN), 'y', out[1], " output channels in tiles of ", KG_IG_BN), 1};
        }
        return {dim(ceil_div(pixels, KG_IG_BM), 'x', pixels, " output pixels in tiles of ", KG_IG_BM),
                dim(ceil_div(out[1], KG_IG_BN), 'y', out[1], " output channels in tiles of ", KG_IG_BN),
                1};
      }
      case ConvGpuAlgo::Direct:
      case ConvGpuAlgo::Nhwc:
        break;
    }
    return grid_1d(n * items_per_image(shape), kConvThreads);
  }

  // What one image takes: pixels × channel blocks (direct), pixels (gemm), blocks (tiled) or
  // output elements (channels-last).
  std::int64_t items_per_image(const std::vector<std::int64_t>& shape) const {
    const std::int64_t pixels = shape[2] * shape[3], groups = cfg_.options.groups;
    switch (algo_) {
      case ConvGpuAlgo::Nhwc:
      case ConvGpuAlgo::NhwcMma:
        return shape[1] * shape[2] * shape[3];
      case ConvGpuAlgo::Gemm:
        return pixels;
      case ConvGpuAlgo::Tiled:
        return tile_plan(cfg_, shape).blocks_per_image(groups);
      case ConvGpuAlgo::Direct:
        break;
    }
    const std::int64_t og = shape[1] / groups, ocb = channels_per_thread(og);
    return groups * ceil_div(og, ocb) * pixels;
  }
  std::int64_t images_per_launch(const std::vector<std::int64_t>& shape) const {
    const std::int64_t per_image = items_per_image(shape);
    if (per_image > kMaxItemsPerLaunch)
      throw Error(util::cat(label_, " one image of output ", sizes_to_string(shape), " has ", per_image,
                            " items for the GPU kernel, more than its limit of ", kMaxItemsPerLaunch));
    return per_image == 0 ? std::max<std::int64_t>(shape[0], 1) : kMaxItemsPerLaunch / per_image;
  }
  // The first image and the image count of a launch.
  std::pair<std::int64_t, std::int64_t> images_of(int launch, const std::vector<std::int64_t>& shape) const {
    const std::int64_t per = images_per_launch(shape), first = launch * per;
    return {first, std::clamp<std::int64_t>(shape[0] - first, 0, per)};
  }
  KgConvShape geometry(std::int64_t n, const std::vector<std::int64_t>& in,
                       const std::vector<std::int64_t>& out) const {
    const auto& op = cfg_.options;
    KgConvShape s{};
    s.n = n;
    s.c = in[1];
    s.h = in[2];
    s.w = in[3];
    s.o = out[1];
    s.ho = out[2];
    s.wo = out[3];
    s.kh = cfg_.kernel.h;
    s.kw = cfg_.kernel.w;
    s.sh = op.stride.h;
    s.sw = op.stride.w;
    s.ph = op.padding.h;
    s.pw = op.padding.w;
    s.dh = op.dilation.h;
    s.dw = op.dilation.w;
    s.groups = op.groups;
    s.ocb = channels_per_thread(cfg_.out_channels / op.groups);
    s.nhwc = cfg_.channels_last ? 1 : 0;
    s.cpad = cfg_.channels_last ? padded_channels(s.c) : s.c;
    s.gemm_k = gemm_k(in, out);
    s.gemm_c = s.c;
    if (algo_ == ConvGpuAlgo::Tiled) {
      const TilePlan t = tile_plan(cfg_, out);
      s.tile_h = t.tile_h;
      s.tile_w = t.tile_w;
      s.cc = t.cc;
      s.och = t.och;
      s.tiles_w = t.tiles_w;
      s.tiles_h = t.tiles_h;
      s.chunks = t.chunks;
    }
    return s;
  }

  std::string backward_entry(int launch) const {
    const char* what = launch == kGradInput       ? "input"
                       : launch == kGradWeight    ? "weight"
                       : launch == kGradWeightSum ? "weight_sum"
                                                  : "bias";
    return entry_for(util::cat("kg_conv2d_backward_", what), cfg_.dtype);
  }
  void pack_backward(int launch, const LaunchTensors& t, ArgVisitor& v) const {
    switch (launch) {
      case kGradInput:
        v.pointer(t.grad_output.ptr);
        v.pointer(t.params[0].ptr);
        v.pointer(t.grad_inputs[0].ptr);
        break;
      case kGradWeight:
        v.pointer(t.inputs[0].ptr);
        v.pointer(t.grad_output.ptr);
        v.pointer(t.grad_params[0].ptr);
        v.pointer(weight_chunks(t) > 1 ? t.scratch : 0);
        v.i64(weight_chunks(t));
        break;
      case kGradWeightSum:
        v.pointer(weight_chunks(t) > 1 ? t.scratch : 0);
        v.pointer(t.grad_params[0].ptr);
        v.i64(weights(t));
        v.i64(weight_chunks(t));
        return;  // no shape
      default:
        v.pointer(t.grad_output.ptr);
        v.pointer(t.grad_params[1].ptr);
        break;
    }
    const KgConvGradShape s = grad_geometry(t);
    v.bytes(&s, sizeof s);
  }
  // An unwanted gradient's launch is one block, which returns at once.
  Dim3 backward_grid(int launch, const LaunchTensors& t) const {
    if (wanted(launch, t).ptr == 0) return {1, 1, 1};
    const KgConvGradShape s = grad_geometry(t);
    std::int64_t items = 0;
    switch (launch) {
      case kGradInput:  // a thread per input element
        return grid_1d(s.n * s.c * s.h * s.w, kConvBackwardThreads);
      case kGradWeight:  // a block per weight element and range of images
        return {static_cast<unsigned>(std::clamp<std::int64_t>(weights(t), 1, kConvBackwardMaxBlocks)),
                grid_dim(weight_chunks(t), 'y',
                         util::cat("the weight-gradient launch over ", weight_chunks(t), " image ranges")),
                1};
      case kGradWeightSum:  // a thread per weight element (one idle block with one range)
        return weight_chunks(t) > 1 ? grid_1d(weights(t), kConvBackwardThreads) : Dim3{1, 1, 1};
      default:  // a block per output channel
        items = s.o;
        break;
    }
    return {static_cast<unsigned>(std::clamp<std::int64_t>(items, 1, kConvBackwardMaxBlocks)), 1, 1};
  }

  // The gradient launch `launch` writes.
  static const DeviceTensor& wanted(int launch, const LaunchTensors& t) {
    return launch == kGradInput ? t.grad_inputs.at(0) : t.grad_params.at(launch == kGradBias ? 1 : 0);
  }
  static std::int64_t weights(const LaunchTensors& t) { return numel_of(t.grad_params.at(0).shape); }
  // Ranges of images the weight gradient is split into: enough blocks to fill a large GPU
  // (about 2048), never more ranges than images, and few enough (image, pixel) pairs in a range
  // for the kernel's 32-bit indices.
  std::int64_t weight_chunks(const LaunchTensors& t) const {
    const auto& out = t.grad_output.shape;
    const std::int64_t n = out.at(0), hwo = out.at(2) * out.at(3), w = std::max<std::int64_t>(weights(t), 1);
    constexpr std::int64_t kMaxItems = std::numeric_limits<std::int32_t>::max();
    const std::int64_t max_chunks = std::clamp<std::int64_t>(n, 1, 65535);
    const std::int64_t per_range = std::max<std::int64_t>(kMaxItems / std::max<std::int64_t>(hwo, 1), 1);
    const std::int64_t chunks = std::clamp<std::int64_t>(
        std::max((2048 + w - 1) / w, (n + per_range - 1) / per_range), 1, max_chunks);
    if (hwo > kMaxItems || (n + chunks - 1) / chunks * hwo > kMaxItems)
      throw Error(util::cat(label_, " backward: ", n, " images of ", out[2], " x ", out[3],
                            " output pixels are beyond the weight-gradient kernel's 32-bit indices"));
    return chunks;
  }
  KgConvGradShape grad_geometry(const LaunchTensors& t) const {
    const auto& in = t.inputs.at(0).shape;
    const auto& out = t.grad_output.shape;
    const auto& op = cfg_.options;
    return KgConvGradShape{in[0],        in[1],         in[2],         in[3],       out[1],      out[2],
                           out[3],       cfg_.kernel.h, cfg_.kernel.w, op.stride.h, op.stride.w, op.padding.h,
                           op.padding.w, op.dilation.h, op.dilation.w, op.groups};
  }

  ConvGpuConfig cfg_;
  ConvGpuAlgo algo_;
  std::string label_;  // "[nn.conv2d]", for errors
  bool backward_;      // a plain convolution: its backward kernels apply
  std::string epilogue_entry_;
  std::string filter_entry_;
  std::string pad_entry_;
  std::string im2col_entry_;
};

}  // namespace

ConvGpuAlgo conv_gpu_algo(const ConvGpuConfig& cfg) {
  if (cfg.channels_last)
    return is_half_float(cfg.dtype) && cfg.options.groups == 1 ? ConvGpuAlgo::NhwcMma : ConvGpuAlgo::Nhwc;
  const auto& op = cfg.options;
  const std::int64_t og = cfg.out_channels / op.groups;
  const std::int64_t kdim = cfg.in_channels / op.groups * cfg.kernel.h * cfg.kernel.w;
  // A channel tile at least half full, a reduction of two k slices or more, and a grid z within
  // the launch limit.
  if (og >= KG_CONV_BM / 2 && kdim >= 2 * KG_CONV_BK && op.groups <= 65535) return ConvGpuAlgo::Gemm;
  const bool unit = op.stride.h == 1 && op.stride.w == 1 && op.dilation.h == 1 && op.dilation.w == 1;
  if (unit && cfg.kernel.h <= kTiledMaxKernel && cfg.kernel.w <= kTiledMaxKernel) return ConvGpuAlgo::Tiled;
  return ConvGpuAlgo::Direct;
}

Lowered lower_conv(const ConvGpuConfig& cfg, const std::string& op_name) {
  const ConvGpuAlgo algo = conv_gpu_algo(cfg);
  // The backward kernels compute a plain f32 or f64 convolution's gradients: no fused epilogue,
  // no 16-bit dtype (inference only).
  const bool activated = cfg.activation || cfg.activation_form;
  const bool backward =
      !cfg.batch_norm && !cfg.residual && !activated && !is_half_float(cfg.dtype) && !cfg.channels_last;
  auto rt = std::make_shared<ConvRuntime>(cfg, algo, "[" + op_name + "]", backward);
  const char* algo_name = algo == ConvGpuAlgo::Gemm    ? "gemm"
                          : algo == ConvGpuAlgo::Tiled ? "tiled"
                          : algo == ConvGpuAlgo::Nhwc  ? "nhwc"
                          : algo == ConvGpuAlgo::NhwcMma ? "nhwc_mma"
                                                       : "direct";
  if (!activated && algo != ConvGpuAlgo::Tiled && algo != ConvGpuAlgo::Nhwc && algo != ConvGpuAlgo::NhwcMma) {
    rt->set_epilogue_entry(entry_for("kg_conv2d_epilogue", cfg.dtype));
    if (cfg.dtype == DType::F32) rt->set_im2col_entry("kg_conv2d_im2col_nchw_f32");
    return Lowered{op_name, kernel_file("conv.cu"), entry_for(util::cat("kg_conv2d_", algo_name), cfg.dtype),
                   rt};
  }
  // One entry of its own, calling conv.cu's body with the tiled kernel's template arguments and
  // the activation, whose formula comes from elementwise.cu (without that file's entries). The
  // kernels take the element type `t`; the functors work in its compute type `ct` (float for the
  // 16-bit types, so an activation's device function written for float serves them too).
  const char* t = device_type(cfg.dtype);
  const char* ct = device_compute_type(cfg.dtype);
  std::string stem = activated ? "kg_fused_conv2d_" : "kg_conv2d_";
  std::string body = util::cat("kg_conv2d_", algo_name, "<", t);
  if (algo == ConvGpuAlgo::Tiled) {
    const std::int64_t ocb = channels_per_thread(cfg.out_channels / cfg.options.groups);
    stem += util::cat("tiled_", cfg.kernel.h, "x", cfg.kernel.w, "_", ocb);
    body += util::cat(", ", cfg.kernel.h, ", ", cfg.kernel.w, ", ", ocb, ", ", kTiledColumns);
  } else {
    stem += algo_name;
  }
  std::string source, functor = util::cat("KgConvIdentity<", ct, ">()");
  if (cfg.activation) {
    const UnaryEntry& act = kUnaryOps[static_cast<std::size_t>(cfg.activation->fn)];
    stem += util::cat("_", std::string(act.kernel).substr(3));  // "kg_relu" -> "relu"
  } else if (cfg.activation_form) {
    // Named by a hash of the form, so that two activations never share an entry.
    stem += "_act" + hex_hash(cfg.activation_form->device_source + "/" + cfg.activation_form->function);
  }
  if (activated) {
    // The formulas a form may call: elementwise.cu's (without its entries) and pointwise.cuh's.
    source = util::cat("#define KG_EW_ONE_ENTRY\n", kernel_file("elementwise.cu"),
                       "\n#include \"pointwise.cuh\"\n");
    functor = util::cat("KgConvActivation<", ct, ">{(", ct, ")act_param}");
  }
  const std::string entry = entry_for(stem, cfg.dtype);
  source += conv_body();
  if (cfg.activation)
    source +=
        util::cat("\ntemplate <class T>\nstruct KgConvActivation {\n  T param;\n",
                  "  __device__ __forceinline__ T operator()(T v) const { return kg_unary_fn<",
                  kUnaryOps[static_cast<std::size_t>(cfg.activation->fn)].device_fn, ">(v, param); }\n};\n");
  else if (cfg.activation_form)
    source +=
        util::cat("\nnamespace kg_act {\n", cfg.activation_form->device_source,
                  "\n}  // namespace kg_act\ntemplate <class T>\nstruct KgConvActivation {\n  T param;\n",
                  "  __device__ __forceinline__ T operator()(T v) const { return (T)kg_act::",
                  cfg.activation_form->function, "(v); }\n};\n");
  // The tensor-core kernel asks for two resident blocks per SM (at most 128 registers a thread):
  // left to itself, the driver's JIT gave it more and so one block of 8 warps per SM.
  source += util::cat(
      "\nextern \"C\" __global__ void __launch_bounds__(KG_CONV_THREADS",
      algo == ConvGpuAlgo::NhwcMma ? ", 2" : "", ")\n    ", entry, "(", entry_params(t),
      ") {\n  ", body,
      ">(x, w, y, s, kg_conv_epilogue(bias, bn_weight, bn_bias, bn_mean, bn_var, residual, bn_eps),\n",
      "      ", functor, ");\n}\n");
  // The epilogue alone, for the library call (ConvRuntime::library_call).
  const std::string epilogue = entry_for(stem + "_epilogue", cfg.dtype);
  source +=
      util::cat("\nextern \"C\" __global__ void __launch_bounds__(KG_CONV_THREADS)\n    ", epilogue, "(",
                entry_params(t), ") {\n  kg_conv2d_epilogue<", t,
                ">(y, s, kg_conv_epilogue(bias, bn_weight, bn_bias, bn_mean, bn_var, residual, bn_eps),\n",
                "      ", functor, ");\n}\n");
  rt->set_epilogue_entry(epilogue);
  if (cfg.channels_last) {
    // The weights and the shift laid out for the library, and the input's channels padded (the
    // call's prologue).
    const std::string filter = entry_for(stem + "_filter", cfg.dtype);
    source += util::cat("\nextern \"C\" __global__ void __launch_bounds__(KG_CONV_THREADS)\n    ", filter, "(",
                        entry_params(t), ") {\n  kg_conv2d_filter_nhwc<", t,
                        ">(w, y, s, kg_conv_epilogue(bias, bn_weight, bn_bias, bn_mean, bn_var, residual, bn_eps));\n}\n");
    rt->set_filter_entry(filter);
    const std::string pad = entry_for(stem + "_pad", cfg.dtype);
    source += util::cat("\nextern \"C\" __global__ void __launch_bounds__(KG_CONV_THREADS)\n    ", pad, "(",
                        entry_params(t), ") {\n  kg_conv2d_pad_channels<", t, ">(x, y, s);\n}\n");
    rt->set_pad_entry(pad);
    const std::string im2col = entry_for(stem + "_im2col", cfg.dtype);
    source += util::cat("\nextern \"C\" __global__ void __launch_bounds__(KG_CONV_THREADS)\n    ", im2col, "(",
                        entry_params(t), ") {\n  kg_conv2d_im2col_nhwc<", t, ">(x, y, s);\n}\n");
    rt->set_im2col_entry(im2col);
  } else if (cfg.dtype == DType::F32) {
    // The NCHW GEMM form's columns (see ConvRuntime::nchw_gemm).
    const std::string im2col = entry_for(stem + "_im2col", cfg.dtype);
    source += util::cat("\nextern \"C\" __global__ void __launch_bounds__(KG_CONV_THREADS)\n    ", im2col, "(",
                        entry_params(t), ") {\n  kg_conv2d_im2col_nchw<", t, ">(x, y, s);\n}\n");
    rt->set_im2col_entry(im2col);
  }
  return Lowered{op_name, std::move(source), entry, rt};
}

std::string conv2d_backward_source() { return kernel_file("conv_backward.cu"); }

}  // namespace kg::ops
