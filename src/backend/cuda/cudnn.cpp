#ifdef KG_HAVE_CUDA
// cuDNN 9 for a Conv2dCall: the library opened with dlopen, one handle per CUDA context, created
// at first use. A forward with a fusable epilogue is first offered to the graph API
// (cudnn_graph.cpp); everything else runs through the legacy convolution API.
#include <cudnn.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <vector>

#include "backend/cuda/cudnn_api.hpp"
#include "backend/cuda/driver.hpp"
#include "backend/cuda/vendor.hpp"
#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::cuda {

void dnn_check(const DnnApi& f, cudnnStatus_t s, const std::string& label, const char* fn) {
  if (s == CUDNN_STATUS_SUCCESS) return;
  const char* name = f.cudnnGetErrorString(s);
  throw Error(util::cat(label, " cuDNN ", fn, ": ", name ? name : "unknown status", " (status ",
                        static_cast<int>(s), ")"));
}

std::optional<int> parse_kept_number(const std::optional<std::string>& text, std::string_view prefix) {
  if (!text || text->size() <= prefix.size() || text->size() > prefix.size() + 3 ||
      text->compare(0, prefix.size(), prefix) != 0)
    return std::nullopt;
  int v = 0;
  for (std::size_t i = prefix.size(); i < text->size(); ++i) {
    const char ch = (*text)[i];
    if (ch < '0' || ch > '9') return std::nullopt;
    v = v * 10 + (ch - '0');
  }
  return v;
}

namespace {

class DnnPlan;

// The loaded library and its handles, one per CUDA context.
class DnnImpl final : public Dnn {
 public:
  DnnImpl(const Driver& d, const DnnApi& f) : d_(d), f_(f) {}
  std::unique_ptr<VendorPlan> plan(const Conv2dCall& c, const VendorOptions& o, CUstream stream,
                                   const std::string& label) const override;
  // The algorithm of a backward pass for `p`'s descriptors (plan() made them).
  std::unique_ptr<VendorPlan> plan_backward(std::unique_ptr<DnnPlan> p, const Conv2dCall& c,
                                            const VendorOptions& o, CUstream stream,
                                            const std::string& label) const;

  void check(cudnnStatus_t s, const std::string& label, const char* fn) const { dnn_check(f_, s, label, fn); }
  // The handle of the current context, created at first use. Handles live for the process:
  // destroying them at exit may run after the driver is gone.
  DnnHandle& handle(const std::string& label) const {
    CUcontext ctx = nullptr;
    d_.check(d_.cuCtxGetCurrent(&ctx), label + " cuDNN: cuCtxGetCurrent");
    if (!ctx) throw Error(label + " cuDNN: no CUDA context is current");
    std::lock_guard<std::mutex> lk(mu_);
    std::unique_ptr<DnnHandle>& h = handles_[ctx];
    if (!h) {
      auto fresh = std::make_unique<DnnHandle>();
      check(f_.cudnnCreate(&fresh->h), label, "cudnnCreate");
      h = std::move(fresh);
    }
    return *h;
  }
  const DnnApi& api() const { return f_; }

 private:
  const Driver& d_;
  DnnApi f_;
  mutable std::mutex mu_;
  mutable std::map<CUcontext, std::unique_ptr<DnnHandle>> handles_;
};

// One planned convolution (and bias); owns its descriptors.
class DnnPlan final : public VendorPlan {
 public:
  DnnPlan(const DnnImpl& dnn, DnnHandle& h) : dnn_(dnn), h_(h) {}
  ~DnnPlan() override {
    const DnnApi& f = dnn_.api();
    for (cudnnTensorDescriptor_t t : {x_desc_, y_desc_, bias_desc_})
      if (t) f.cudnnDestroyTensorDescriptor(t);
    if (w_desc_) f.cudnnDestroyFilterDescriptor(w_desc_);
    if (conv_desc_) f.cudnnDestroyConvolutionDescriptor(conv_desc_);
  }
  std::size_t workspace_bytes() const override { return workspace_; }
  std::string describe() const override { return description_; }
  void run(CUstream stream, DevicePtr workspace, const std::string& label) const override {
    const DnnApi& f = dnn_.api();
    std::lock_guard<std::mutex> lk(h_.mu);
    dnn_.check(f.cudnnSetStream(h_.h, stream), label, "cudnnSetStream");
    if (pass_ == Conv2dCall::Pass::BackwardData) {
      dnn_.check(backward_data(data_algo_, workspace, workspace_), label, "cudnnConvolutionBackwardData");
      return;
    }
    if (pass_ == Conv2dCall::Pass::BackwardFilter) {
      dnn_.check(backward_filter(filter_algo_, workspace, workspace_), label,
                 "cudnnConvolutionBackwardFilter");
      return;
    }
    dnn_.check(forward(algo_, workspace, workspace_), label, "cudnnConvolutionForward");
    if (bias_)
      dnn_.check(f.cudnnAddTensor(h_.h, one(), bias_desc_, reinterpret_cast<const void*>(bias_), one(),
                                  y_desc_, reinterpret_cast<void*>(y_)),
                 label, "cudnnAddTensor");
  }
  // y = conv(x, w) with `algo` on the handle's stream.
  cudnnStatus_t forward(cudnnConvolutionFwdAlgo_t algo, DevicePtr workspace, std::size_t ws_bytes) const {
    return dnn_.api().cudnnConvolutionForward(h_.h, one(), x_desc_, reinterpret_cast<const void*>(x_),
                                              w_desc_, reinterpret_cast<const void*>(w_), conv_desc_, algo,
                                              ws_bytes ? reinterpret_cast<void*>(workspace) : nullptr,
                                              ws_bytes, zero(), y_desc_, reinterpret_cast<void*>(y_));
  }
  // x = dL/dx from y = dL/dy and w.
  cudnnStatus_t backward_data(cudnnConvolutionBwdDataAlgo_t algo, DevicePtr workspace,
                              std::size_t ws_bytes) const {
    return dnn_.api().cudnnConvolutionBackwardData(
        h_.h, one(), w_desc_, reinterpret_cast<const void*>(w_), y_desc_, reinterpret_cast<const void*>(y_),
        conv_desc_, algo, ws_bytes ? reinterpret_cast<void*>(workspace) : nullptr, ws_bytes, zero(), x_desc_,
        reinterpret_cast<void*>(x_));
  }
  // w = dL/dw from x and y = dL/dy.
  cudnnStatus_t backward_filter(cudnnConvolutionBwdFilterAlgo_t algo, DevicePtr workspace,
                                std::size_t ws_bytes) const {
    return dnn_.api().cudnnConvolutionBackwardFilter(
        h_.h, one(), x_desc_, reinterpret_cast<const void*>(x_), y_desc_, reinterpret_cast<const void*>(y_),
        conv_desc_, algo, ws_bytes ? reinterpret_cast<void*>(workspace) : nullptr, ws_bytes, zero(), w_desc_,
        reinterpret_cast<void*>(w_));
  }
  // Scaling factors: double for double data, float otherwise.
  const void* one() const { return f64_ ? static_cast<const void*>(&one_d_) : &one_f_; }
  const void* zero() const { return f64_ ? static_cast<const void*>(&zero_d_) : &zero_f_; }

  cudnnTensorDescriptor_t x_desc_ = nullptr, y_desc_ = nullptr, bias_desc_ = nullptr;
  cudnnFilterDescriptor_t w_desc_ = nullptr;
  cudnnConvolutionDescriptor_t conv_desc_ = nullptr;
  cudnnConvolutionFwdAlgo_t algo_ = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;
  Conv2dCall::Pass pass_ = Conv2dCall::Pass::Forward;
  cudnnConvolutionBwdDataAlgo_t data_algo_ = CUDNN_CONVOLUTION_BWD_DATA_ALGO_0;
  cudnnConvolutionBwdFilterAlgo_t filter_algo_ = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0;
  DevicePtr x_ = 0, w_ = 0, y_ = 0, bias_ = 0;
  bool f64_ = false;
  float one_f_ = 1.0f, zero_f_ = 0.0f;
  double one_d_ = 1.0, zero_d_ = 0.0;
  std::size_t workspace_ = 0;
  std::string description_;

 private:
  const DnnImpl& dnn_;
  DnnHandle& h_;
};

// The legacy API's name of a forward algorithm.
const char* algo_name(cudnnConvolutionFwdAlgo_t a) {
  switch (a) {
    case CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM:
      return "implicit_gemm";
    case CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM:
      return "implicit_precomp_gemm";
    case CUDNN_CONVOLUTION_FWD_ALGO_GEMM:
      return "gemm";
    case CUDNN_CONVOLUTION_FWD_ALGO_DIRECT:
      return "direct";
    case CUDNN_CONVOLUTION_FWD_ALGO_FFT:
      return "fft";
    case CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING:
      return "fft_tiling";
    case CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD:
      return "winograd";
    case CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED:
      return "winograd_nonfused";
    default:
      return "unknown";
  }
}

// Device memory for tuning, released however planning ends.
struct TuneWorkspace {
  const Driver& d;
  CUstream stream;
  CUdeviceptr ws = 0;
  ~TuneWorkspace() {
    d.cuStreamSynchronize(stream);
    if (ws) d.cuMemFree(ws);
  }
};

}  // namespace

std::string tuning_key(const Conv2dCall& c, bool tf32) {
  const char* pass = c.pass == Conv2dCall::Pass::Forward ? "fwd" : c.pass == Conv2dCall::Pass::BackwardData ? "bwd-data" : "bwd-filter";
  return util::cat("conv ", pass, " ", dtype_name(c.dtype), c.dtype == DType::F32 && tf32 ? "/tf32" : "", " x",
                   c.batch, ",", c.in_channels, ",", c.height, ",", c.width, " w", c.out_channels, ",", c.kernel_h,
                   ",", c.kernel_w, " y", c.out_height, ",", c.out_width, " pad", c.pad_h, ",", c.pad_w, " stride",
                   c.stride_h, ",", c.stride_w, " dil", c.dilation_h, ",", c.dilation_w, " groups", c.groups,
                   c.bias ? " bias" : "", c.channels_last ? " nhwc" : "");
}

namespace {

std::unique_ptr<VendorPlan> DnnImpl::plan(const Conv2dCall& c, const VendorOptions& o, CUstream stream,
                                          const std::string& label) const {
  cudnnDataType_t data;
  cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  cudnnMathType_t math = CUDNN_TENSOR_OP_MATH;
  switch (c.dtype) {
    case DType::F32:
      math = o.tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
      data = CUDNN_DATA_FLOAT;
      break;
    case DType::F16:
      data = CUDNN_DATA_HALF;
      break;
    case DType::BF16:
      data = CUDNN_DATA_BFLOAT16;
      break;
    case DType::F64:
      data = compute = CUDNN_DATA_DOUBLE;
      math = CUDNN_DEFAULT_MATH;
      break;
    default:
      return nullptr;
  }
  const std::int64_t sizes[] = {c.batch,    c.in_channels, c.height,     c.width,     c.out_channels,
                                c.kernel_h, c.kernel_w,    c.out_height, c.out_width, c.stride_h,
                                c.stride_w, c.dilation_h,  c.dilation_w, c.groups};
  const std::int64_t int_max = std::numeric_limits<std::int32_t>::max();
  for (std::int64_t s : sizes)
    if (s <= 0 || s > int_max) return nullptr;
  if (c.pad_h < 0 || c.pad_w < 0 || c.pad_h > int_max || c.pad_w > int_max) return nullptr;
  // The legacy descriptors index with int: every tensor must have fewer than 2^31 elements.
  const double x_elems = double(c.batch) * double(c.in_channels) * double(c.height) * double(c.width);
  const double y_elems =
      double(c.batch) * double(c.out_channels) * double(c.out_height) * double(c.out_width);
  const double w_elems =
      double(c.out_channels) * double(c.in_channels) * double(c.kernel_h) * double(c.kernel_w);
  if (std::max({x_elems, y_elems, w_elems}) > double(int_max)) return nullptr;
  if (c.in_channels % c.groups || c.out_channels % c.groups)
    throw Error(util::cat(label, " cuDNN: ", c.in_channels, " input and ", c.out_channels,
                          " output channels are not divisible by ", c.groups, " groups"));
  if (!c.x || !c.w || !c.y) return nullptr;
  auto i32 = [](std::int64_t v) { return static_cast<int>(v); };

  DnnHandle& hd = handle(label);
  // Why a fusable epilogue was not fused, for the description.
  std::string unfused;
  if (c.pass == Conv2dCall::Pass::Forward && c.fusable)
    if (auto fused = plan_fused_forward(d_, f_, hd, c, o, stream, label, unfused)) return fused;
  const cudnnHandle_t h = hd.h;
  auto p = std::make_unique<DnnPlan>(*this, hd);
  p->x_ = c.x;
  p->w_ = c.w;
  p->y_ = c.y;
  p->bias_ = c.bias;
  p->f64_ = c.dtype == DType::F64;
  check(f_.cudnnCreateTensorDescriptor(&p->x_desc_), label, "cudnnCreateTensorDescriptor");
  check(f_.cudnnCreateTensorDescriptor(&p->y_desc_), label, "cudnnCreateTensorDescriptor");
  check(f_.cudnnCreateFilterDescriptor(&p->w_desc_), label, "cudnnCreateFilterDescriptor");
  check(f_.cudnnCreateConvolutionDescriptor(&p->conv_desc_), label, "cudnnCreateConvolutionDescriptor");
  // Channels-last: x, y and the filter all NHWC (the filter [O, kh, kw, C/g]); the sizes are
  // given in NCHW order either way.
  const cudnnTensorFormat_t format = c.channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
  check(f_.cudnnSetTensor4dDescriptor(p->x_desc_, format, data, i32(c.batch), i32(c.in_channels),
                                      i32(c.height), i32(c.width)),
        label, "cudnnSetTensor4dDescriptor");
  check(f_.cudnnSetFilter4dDescriptor(p->w_desc_, data, format, i32(c.out_channels),
                                      i32(c.in_channels / c.groups), i32(c.kernel_h), i32(c.kernel_w)),
        label, "cudnnSetFilter4dDescriptor");
  check(f_.cudnnSetConvolution2dDescriptor(p->conv_desc_, i32(c.pad_h), i32(c.pad_w), i32(c.stride_h),
                                           i32(c.stride_w), i32(c.dilation_h), i32(c.dilation_w),
                                           CUDNN_CROSS_CORRELATION, compute),
        label, "cudnnSetConvolution2dDescriptor");
  check(f_.cudnnSetConvolutionGroupCount(p->conv_desc_, i32(c.groups)), label,
        "cudnnSetConvolutionGroupCount");
  check(f_.cudnnSetConvolutionMathType(p->conv_desc_, math), label, "cudnnSetConvolutionMathType");
  // The call's output shape must be the convolution's: a mismatch is a bug in the op's description.
  int on = 0, oc = 0, oh = 0, ow = 0;
  check(f_.cudnnGetConvolution2dForwardOutputDim(p->conv_desc_, p->x_desc_, p->w_desc_, &on, &oc, &oh, &ow),
        label, "cudnnGetConvolution2dForwardOutputDim");
  if (on != c.batch || oc != c.out_channels || oh != c.out_height || ow != c.out_width)
    throw Error(util::cat(label, " cuDNN: the call's output is [", c.batch, ", ", c.out_channels, ", ",
                          c.out_height, ", ", c.out_width, "] but the convolution of [", c.batch, ", ",
                          c.in_channels, ", ", c.height, ", ", c.width, "] gives [", on, ", ", oc, ", ", oh,
                          ", ", ow, "]"));
  check(f_.cudnnSetTensor4dDescriptor(p->y_desc_, format, data, on, oc, oh, ow), label,
        "cudnnSetTensor4dDescriptor");
  if (c.bias) {
    check(f_.cudnnCreateTensorDescriptor(&p->bias_desc_), label, "cudnnCreateTensorDescriptor");
    check(f_.cudnnSetTensor4dDescriptor(p->bias_desc_, format, data, 1, oc, 1, 1), label,
          "cudnnSetTensor4dDescriptor");
  }

  p->pass_ = c.pass;
  if (c.pass != Conv2dCall::Pass::Forward) return plan_backward(std::move(p), c, o, stream, label);
  // Strict f32 takes no algorithm that runs on tensor cores.
  auto allowed = [&](const cudnnConvolutionFwdAlgoPerf_t& r) {
    if (r.status != CUDNN_STATUS_SUCCESS || r.memory > o.max_workspace_bytes) return false;
    return !(c.dtype == DType::F32 && !o.tf32 && r.mathType != CUDNN_FMA_MATH &&
             r.mathType != CUDNN_DEFAULT_MATH);
  };
  int max_count = 0;
  check(f_.cudnnGetConvolutionForwardAlgorithmMaxCount(h, &max_count), label,
        "cudnnGetConvolutionForwardAlgorithmMaxCount");
  std::vector<cudnnConvolutionFwdAlgoPerf_t> perf(static_cast<std::size_t>(std::max(max_count, 1)));
  int found = 0;
  check(f_.cudnnGetConvolutionForwardAlgorithm_v7(h, p->x_desc_, p->w_desc_, p->conv_desc_, p->y_desc_,
                                                  static_cast<int>(perf.size()), &found, perf.data()),
        label, "cudnnGetConvolutionForwardAlgorithm_v7");
  const cudnnConvolutionFwdAlgoPerf_t* best = nullptr;
  std::size_t largest = 0;
  for (int i = 0; i < found; ++i) {
    if (!allowed(perf[i])) continue;
    if (!best) best = &perf[i];
    largest = std::max(largest, perf[i].memory);
  }
  if (!best) return nullptr;
  cudnnConvolutionFwdAlgo_t algo = best->algo;
  bool tuned = false, cached = false;
  const std::string scope = util::cat(o.device_scope, " cudnn ", f_.cudnnGetVersion());
  const std::string key = tuning_key(c, o.tf32);
  if (o.cache)
    if (auto a = parse_kept_number(o.cache->find(scope, key))) {
      std::size_t need = 0;
      const auto cand = static_cast<cudnnConvolutionFwdAlgo_t>(*a);
      if (f_.cudnnGetConvolutionForwardWorkspaceSize(h, p->x_desc_, p->w_desc_, p->conv_desc_, p->y_desc_, cand,
                                                     &need) == CUDNN_STATUS_SUCCESS &&
          need <= o.max_workspace_bytes)
        algo = cand, cached = true;
    }
  if (o.tune && !cached) {
    // Time the algorithms on the call's own buffers (this writes y), with room for the largest
    // workspace that the heuristic's candidates need.
    TuneWorkspace t{d_, stream};
    d_.check(d_.cuMemAlloc(&t.ws, std::max<std::size_t>(largest, 1)),
             label + " cuDNN tuning: cuMemAlloc of the workspace");
    std::vector<cudnnConvolutionFwdAlgoPerf_t> timed(perf.size());
    int n_timed = 0;
    {
      std::lock_guard<std::mutex> lk(hd.mu);
      check(f_.cudnnSetStream(h, stream), label, "cudnnSetStream");
      check(f_.cudnnFindConvolutionForwardAlgorithmEx(h, p->x_desc_, reinterpret_cast<const void*>(c.x),
                                                      p->w_desc_, reinterpret_cast<const void*>(c.w),
                                                      p->conv_desc_, p->y_desc_, reinterpret_cast<void*>(c.y),
                                                      static_cast<int>(timed.size()), &n_timed, timed.data(),
                                                      reinterpret_cast<void*>(t.ws), largest),
            label, "cudnnFindConvolutionForwardAlgorithmEx");
    }
    for (int i = 0; i < n_timed; ++i)
      if (allowed(timed[i]) && timed[i].memory <= largest) {
        algo = timed[i].algo;
        tuned = true;
        break;
      }
  }
  p->algo_ = algo;
  if (o.cache && o.tune && !cached) o.cache->store(scope, key, std::to_string(static_cast<int>(algo)));
  std::size_t ws = 0;
  check(f_.cudnnGetConvolutionForwardWorkspaceSize(h, p->x_desc_, p->w_desc_, p->conv_desc_, p->y_desc_, algo,
                                                   &ws),
        label, "cudnnGetConvolutionForwardWorkspaceSize");
  if (ws > o.max_workspace_bytes) return nullptr;
  p->workspace_ = ws;
  p->description_ = util::cat("cudnn ", dtype_name(c.dtype), c.dtype == DType::F32 && o.tf32 ? "/tf32" : "",
                              c.channels_last ? " nhwc" : "", " ", algo_name(algo), cached ? " (tuned, cached)" : tuned ? " (tuned)" : "", ", ", ws,
                              " B workspace", unfused.empty() ? "" : "; epilogue not fused: " + unfused);
  return p;
}

std::unique_ptr<VendorPlan> DnnImpl::plan_backward(std::unique_ptr<DnnPlan> p, const Conv2dCall& c,
                                                   const VendorOptions& o, CUstream stream,
                                                   const std::string& label) const {
  const bool data = c.pass == Conv2dCall::Pass::BackwardData;
  DnnHandle& hd = handle(label);
  const cudnnHandle_t h = hd.h;
  // The first (or, tuned, the fastest) algorithm that succeeds within the workspace limit; strict
  // f32 takes none that runs on tensor cores.
  auto pick = [&](auto& perf, int found) -> int {
    for (int i = 0; i < found; ++i) {
      const auto& r = perf[static_cast<std::size_t>(i)];
      if (r.status != CUDNN_STATUS_SUCCESS || r.memory > o.max_workspace_bytes) continue;
      if (c.dtype == DType::F32 && !o.tf32 && r.mathType != CUDNN_FMA_MATH &&
          r.mathType != CUDNN_DEFAULT_MATH)
        continue;
      return i;
    }
    return -1;
  };
  auto largest_of = [&](auto& perf, int found) {
    std::size_t m = 1;
    for (int i = 0; i < found; ++i)
      if (perf[static_cast<std::size_t>(i)].status == CUDNN_STATUS_SUCCESS &&
          perf[static_cast<std::size_t>(i)].memory <= o.max_workspace_bytes)
        m = std::max(m, perf[static_cast<std::size_t>(i)].memory);
    return m;
  };
  std::size_t ws = 0;
  bool tuned = false, cached = false;
  const char* what = data ? "backward data" : "backward filter";
  const std::string scope = util::cat(o.device_scope, " cudnn ", f_.cudnnGetVersion());
  const std::string key = tuning_key(c, o.tf32);
  // A stored choice (-1: none).
  const int stored = o.cache ? parse_kept_number(o.cache->find(scope, key)).value_or(-1) : -1;
  if (data) {
    int max_count = 0;
    check(f_.cudnnGetConvolutionBackwardDataAlgorithmMaxCount(h, &max_count), label,
          "cudnnGetConvolutionBackwardDataAlgorithmMaxCount");
    std::vector<cudnnConvolutionBwdDataAlgoPerf_t> perf(static_cast<std::size_t>(std::max(max_count, 1)));
    int found = 0;
    check(f_.cudnnGetConvolutionBackwardDataAlgorithm_v7(h, p->w_desc_, p->y_desc_, p->conv_desc_, p->x_desc_,
                                                         static_cast<int>(perf.size()), &found, perf.data()),
          label, "cudnnGetConvolutionBackwardDataAlgorithm_v7");
    int best = pick(perf, found);
    if (best < 0) return nullptr;
    p->data_algo_ = perf[static_cast<std::size_t>(best)].algo;
    if (stored >= 0) {
      std::size_t need = 0;
      const auto cand = static_cast<cudnnConvolutionBwdDataAlgo_t>(stored);
      if (f_.cudnnGetConvolutionBackwardDataWorkspaceSize(h, p->w_desc_, p->y_desc_, p->conv_desc_, p->x_desc_,
                                                          cand, &need) == CUDNN_STATUS_SUCCESS &&
          need <= o.max_workspace_bytes)
        p->data_algo_ = cand, cached = true;
    }
    if (o.tune && !cached) {
      const std::size_t largest = largest_of(perf, found);
      TuneWorkspace t{d_, stream};
      d_.check(d_.cuMemAlloc(&t.ws, largest), label + " cuDNN tuning: cuMemAlloc of the workspace");
      std::vector<cudnnConvolutionBwdDataAlgoPerf_t> timed(perf.size());
      int n = 0;
      std::lock_guard<std::mutex> lk(hd.mu);
      check(f_.cudnnSetStream(h, stream), label, "cudnnSetStream");
      check(f_.cudnnFindConvolutionBackwardDataAlgorithmEx(
                h, p->w_desc_, reinterpret_cast<const void*>(c.w), p->y_desc_,
                reinterpret_cast<const void*>(c.y), p->conv_desc_, p->x_desc_, reinterpret_cast<void*>(c.x),
                static_cast<int>(timed.size()), &n, timed.data(), reinterpret_cast<void*>(t.ws), largest),
            label, "cudnnFindConvolutionBackwardDataAlgorithmEx");
      if (int i = pick(timed, n); i >= 0)
        p->data_algo_ = timed[static_cast<std::size_t>(i)].algo, tuned = true;
    }
    check(f_.cudnnGetConvolutionBackwardDataWorkspaceSize(h, p->w_desc_, p->y_desc_, p->conv_desc_,
                                                          p->x_desc_, p->data_algo_, &ws),
          label, "cudnnGetConvolutionBackwardDataWorkspaceSize");
  } else {
    int max_count = 0;
    check(f_.cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(h, &max_count), label,
          "cudnnGetConvolutionBackwardFilterAlgorithmMaxCount");
    std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> perf(static_cast<std::size_t>(std::max(max_count, 1)));
    int found = 0;
    check(
        f_.cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, p->x_desc_, p->y_desc_, p->conv_desc_, p->w_desc_,
                                                         static_cast<int>(perf.size()), &found, perf.data()),
        label, "cudnnGetConvolutionBackwardFilterAlgorithm_v7");
    int best = pick(perf, found);
    if (best < 0) return nullptr;
    p->filter_algo_ = perf[static_cast<std::size_t>(best)].algo;
    if (stored >= 0) {
      std::size_t need = 0;
      const auto cand = static_cast<cudnnConvolutionBwdFilterAlgo_t>(stored);
      if (f_.cudnnGetConvolutionBackwardFilterWorkspaceSize(h, p->x_desc_, p->y_desc_, p->conv_desc_, p->w_desc_,
                                                            cand, &need) == CUDNN_STATUS_SUCCESS &&
          need <= o.max_workspace_bytes)
        p->filter_algo_ = cand, cached = true;
    }
    if (o.tune && !cached) {
      const std::size_t largest = largest_of(perf, found);
      TuneWorkspace t{d_, stream};
      d_.check(d_.cuMemAlloc(&t.ws, largest), label + " cuDNN tuning: cuMemAlloc of the workspace");
      std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> timed(perf.size());
      int n = 0;
      std::lock_guard<std::mutex> lk(hd.mu);
      check(f_.cudnnSetStream(h, stream), label, "cudnnSetStream");
      check(f_.cudnnFindConvolutionBackwardFilterAlgorithmEx(
                h, p->x_desc_, reinterpret_cast<const void*>(c.x), p->y_desc_,
                reinterpret_cast<const void*>(c.y), p->conv_desc_, p->w_desc_, reinterpret_cast<void*>(c.w),
                static_cast<int>(timed.size()), &n, timed.data(), reinterpret_cast<void*>(t.ws), largest),
            label, "cudnnFindConvolutionBackwardFilterAlgorithmEx");
      if (int i = pick(timed, n); i >= 0)
        p->filter_algo_ = timed[static_cast<std::size_t>(i)].algo, tuned = true;
    }
    check(f_.cudnnGetConvolutionBackwardFilterWorkspaceSize(h, p->x_desc_, p->y_desc_, p->conv_desc_,
                                                            p->w_desc_, p->filter_algo_, &ws),
          label, "cudnnGetConvolutionBackwardFilterWorkspaceSize");
  }
  if (ws > o.max_workspace_bytes) return nullptr;
  p->workspace_ = ws;
  const int chosen = data ? static_cast<int>(p->data_algo_) : static_cast<int>(p->filter_algo_);
  if (o.cache && o.tune && !cached) o.cache->store(scope, key, std::to_string(chosen));
  p->description_ = util::cat("cudnn ", dtype_name(c.dtype), c.dtype == DType::F32 && o.tf32 ? "/tf32" : "", " ",
                              what, " algo ", chosen, cached ? " (tuned, cached)" : tuned ? " (tuned)" : "", ", ", ws,
                              " B workspace");
  return p;
}

struct DnnLoaded {
  std::unique_ptr<DnnImpl> impl;
  std::string reason;
};

DnnLoaded load_dnn() {
  DnnLoaded l;
  const Driver* d = Driver::get();
  if (!d) {
    l.reason = "CUDA is not available: " + Driver::unavailable_reason();
    return l;
  }
  void* lib = ::dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
  const char* err = lib ? nullptr : ::dlerror();
  const std::string why = err ? err : "?";
  if (!lib) lib = ::dlopen("libcudnn.so", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    l.reason = util::cat("cuDNN not found (libcudnn.so.9 could not be opened: ", why, ")");
    return l;
  }
  DnnApi f;
#define KG_RESOLVE(name)                                                \
  f.name = reinterpret_cast<decltype(f.name)>(::dlsym(lib, #name));     \
  if (!f.name) {                                                        \
    l.reason = "cuDNN lacks " #name " (a library older than cuDNN 9?)"; \
    return l;                                                           \
  }
  KG_CUDNN_FUNCTIONS(KG_RESOLVE)
#undef KG_RESOLVE
  const std::size_t version = f.cudnnGetVersion();
  if (version < 90000) {
    l.reason = util::cat("cuDNN ", version, " is too old (9.0 or newer is needed)");
    return l;
  }
  auto impl = std::make_unique<DnnImpl>(*d, f);
  // With a context current, its handle shows now whether the library works on this device.
  CUcontext ctx = nullptr;
  if (d->cuCtxGetCurrent(&ctx) == CUDA_SUCCESS && ctx) {
    try {
      impl->handle("Dnn::get");
    } catch (const Error& e) {
      l.reason = e.what();
      return l;
    }
  }
  l.impl = std::move(impl);
  return l;
}

const DnnLoaded& dnn_loaded() {
  static const DnnLoaded l = load_dnn();
  return l;
}

}  // namespace

const Dnn* Dnn::get() { return dnn_loaded().impl.get(); }
const std::string& Dnn::unavailable_reason() { return dnn_loaded().reason; }

}  // namespace kg::cuda

#endif  // KG_HAVE_CUDA
