#ifdef KG_HAVE_CUDA
// cuDNN's graph API for a forward convolution together with the epilogue that follows it in the
// op (Conv2dCall::fusable): one operation graph, convolution → add the shift → add the residual →
// ReLU, the intermediates virtual f32 tensors, so that the library's fused engines compute the
// whole in one kernel and the output is written once. The legacy API (cudnn.cpp) has no such
// fusion: there the op's epilogue launch reads and writes the output a second time.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/cudnn_api.hpp"
#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::cuda {
namespace {

// cuDNN 9.8 deprecated the handle attributes in favour of device-property descriptors; every
// cuDNN 9 still takes them, and the plan runs on the handle anyway.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
constexpr cudnnBackendAttributeName_t kGraphHandle = CUDNN_ATTR_OPERATIONGRAPH_HANDLE;
constexpr cudnnBackendAttributeName_t kPlanHandle = CUDNN_ATTR_EXECUTION_PLAN_HANDLE;
#pragma GCC diagnostic pop

// A backend descriptor, destroyed with its owner. Failures throw kg::Error naming the function,
// the descriptor's role and the status.
class Desc {
 public:
  Desc(const DnnApi& f, cudnnBackendDescriptorType_t type, std::string what) : f_(&f), what_(std::move(what)) {
    ok(f.cudnnBackendCreateDescriptor(type, &d_), "cudnnBackendCreateDescriptor");
  }
  Desc(Desc&& o) noexcept : f_(o.f_), d_(std::exchange(o.d_, nullptr)), what_(std::move(o.what_)) {}
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  Desc& operator=(Desc&&) = delete;
  ~Desc() {
    if (d_) f_->cudnnBackendDestroyDescriptor(d_);
  }
  template <class V>
  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const V* values,
            std::int64_t count = 1) {
    ok(f_->cudnnBackendSetAttribute(d_, name, type, count, values), "cudnnBackendSetAttribute");
    return *this;
  }
  Desc& set_desc(cudnnBackendAttributeName_t name, const Desc& other) {
    cudnnBackendDescriptor_t d = other.get();
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, &d);
  }
  Desc& finalize() {
    ok(f_->cudnnBackendFinalize(d_), "cudnnBackendFinalize");
    return *this;
  }
  cudnnBackendDescriptor_t get() const { return d_; }
  void ok(cudnnStatus_t s, const char* fn) const {
    if (s == CUDNN_STATUS_SUCCESS) return;
    const char* name = f_->cudnnGetErrorString(s);
    throw Error(util::cat(fn, " (", what_, "): ", name ? name : "unknown status"));
  }

 private:
  const DnnApi* f_;
  cudnnBackendDescriptor_t d_ = nullptr;
  std::string what_;
};

// The largest power of two up to 16 that divides the address.
std::int64_t alignment(DevicePtr p) {
  std::int64_t a = 16;
  while (a > 1 && p % static_cast<DevicePtr>(a)) a /= 2;
  return a;
}

// Unique ids of the graph's tensors.
enum Uid : std::int64_t { kX = 1, kW = 2, kShift = 3, kResidual = 4, kY = 5, kConv = 101, kShifted = 102, kSum = 103 };

// A 4-d tensor given in NCHW order [n, c, h, w], stored channels-last ([n, h, w, c]) or not.
Desc tensor(const DnnApi& f, std::int64_t uid, cudnnDataType_t type, std::array<std::int64_t, 4> d, bool last,
            std::int64_t align, bool is_virtual) {
  const std::array<std::int64_t, 4> strides =
      last ? std::array<std::int64_t, 4>{d[1] * d[2] * d[3], 1, d[3] * d[1], d[1]}
           : std::array<std::int64_t, 4>{d[1] * d[2] * d[3], d[2] * d[3], d[3], 1};
  Desc t(f, CUDNN_BACKEND_TENSOR_DESCRIPTOR, util::cat("tensor ", uid));
  const bool v = is_virtual;
  t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, &type)
      .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, d.data(), 4)
      .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.data(), 4)
      .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, &uid)
      .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, &align)
      .set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, &v)
      .finalize();
  return t;
}

// A pointwise operation y = x <mode> b (b null: y = mode(x)), in f32.
Desc pointwise(const DnnApi& f, std::deque<Desc>& keep, cudnnPointwiseMode_t mode, const Desc& x, const Desc* b,
               const Desc& y, const char* what) {
  const cudnnDataType_t prec = CUDNN_DATA_FLOAT;
  keep.emplace_back(f, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, util::cat(what, " mode"));
  keep.back()
      .set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, &mode)
      .set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, &prec)
      .finalize();
  Desc op(f, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, what);
  op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, keep.back())
      .set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x)
      .set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
  if (b) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b);
  op.finalize();
  return op;
}

// One engine configuration of the heuristic's list, built into an execution plan.
struct Candidate {
  std::size_t position = 0;  // in the heuristic's list
  std::int64_t engine = -1;  // the engine's global index
  std::int64_t workspace = 0;
  std::shared_ptr<Desc> plan;
};

// The execution plan of the fused graph and what running it needs.
class GraphPlan final : public VendorPlan {
 public:
  GraphPlan(const DnnApi& f, DnnHandle& h, std::deque<Desc> keep, Candidate chosen, std::vector<std::int64_t> uids,
            std::vector<void*> ptrs, std::string description)
      : f_(f), h_(h), keep_(std::move(keep)), chosen_(std::move(chosen)), uids_(std::move(uids)),
        ptrs_(std::move(ptrs)), description_(std::move(description)) {}
  std::size_t workspace_bytes() const override { return static_cast<std::size_t>(chosen_.workspace); }
  std::string describe() const override { return description_; }
  bool fused_epilogue() const override { return true; }
  void run(CUstream stream, DevicePtr workspace, const std::string& label) const override {
    std::lock_guard<std::mutex> lk(h_.mu);
    dnn_check(f_, f_.cudnnSetStream(h_.h, stream), label, "cudnnSetStream");
    // The variant pack binds the addresses, the workspace's included: built at the first run and
    // again only if the workspace moves.
    if (!pack_ || pack_workspace_ != workspace) {
      try {
        pack_ = std::make_unique<Desc>(variant_pack(f_, uids_, ptrs_, workspace));
      } catch (const Error& e) {
        throw Error(util::cat(label, " cuDNN graph: ", e.what()));
      }
      pack_workspace_ = workspace;
    }
    dnn_check(f_, f_.cudnnBackendExecute(h_.h, chosen_.plan->get(), pack_->get()), label, "cudnnBackendExecute");
  }
  static Desc variant_pack(const DnnApi& f, const std::vector<std::int64_t>& uids, const std::vector<void*>& ptrs,
                           DevicePtr workspace) {
    void* ws = workspace ? reinterpret_cast<void*>(workspace) : nullptr;
    Desc vp(f, CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack");
    vp.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids.data(), static_cast<std::int64_t>(uids.size()))
        .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, ptrs.data(),
             static_cast<std::int64_t>(ptrs.size()))
        .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, &ws)
        .finalize();
    return vp;
  }

 private:
  const DnnApi& f_;
  DnnHandle& h_;
  std::deque<Desc> keep_;  // the graph's descriptors, alive as long as the plan
  Candidate chosen_;
  std::vector<std::int64_t> uids_;
  std::vector<void*> ptrs_;
  std::string description_;
  mutable std::unique_ptr<Desc> pack_;
  mutable DevicePtr pack_workspace_ = 0;
};

// The engine's global index and whether its numerical notes allow it (no reduction in reduced
// precision: the op's own kernels and PyTorch's sum in f32); -1 and true when cuDNN does not say.
std::pair<std::int64_t, bool> engine_info(const DnnApi& f, cudnnBackendDescriptor_t cfg) {
  try {
    Desc engine(f, CUDNN_BACKEND_ENGINE_DESCRIPTOR, "engine");
    cudnnBackendDescriptor_t e = engine.get();
    std::int64_t n = 0;
    if (f.cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &e) !=
            CUDNN_STATUS_SUCCESS ||
        n != 1)
      return {-1, true};
    std::int64_t index = -1;
    f.cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &index);
    std::array<cudnnBackendNumericalNote_t, CUDNN_NUMERICAL_NOTE_TYPE_COUNT> notes{};
    std::int64_t count = 0;
    if (f.cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                   static_cast<std::int64_t>(notes.size()), &count, notes.data()) != CUDNN_STATUS_SUCCESS)
      count = 0;
    for (std::int64_t i = 0; i < std::min<std::int64_t>(count, static_cast<std::int64_t>(notes.size())); ++i)
      if (notes[static_cast<std::size_t>(i)] == CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION) return {index, false};
    return {index, true};
  } catch (const Error&) {
    return {-1, true};
  }
}

// Median device time in ms of `reps` runs of `plan` after one warm-up.
double time_plan(const Driver& d, const DnnApi& f, DnnHandle& h, CUstream stream, const Desc& plan, const Desc& pack,
                 int reps, const std::string& label) {
  CUevent start = nullptr, stop = nullptr;
  d.check(d.cuEventCreate(&start, CU_EVENT_DEFAULT), label + " cuDNN tuning: cuEventCreate");
  d.check(d.cuEventCreate(&stop, CU_EVENT_DEFAULT), label + " cuDNN tuning: cuEventCreate");
  std::vector<float> ms;
  try {
    std::lock_guard<std::mutex> lk(h.mu);
    dnn_check(f, f.cudnnSetStream(h.h, stream), label, "cudnnSetStream");
    dnn_check(f, f.cudnnBackendExecute(h.h, plan.get(), pack.get()), label, "cudnnBackendExecute");
    for (int r = 0; r < reps; ++r) {
      d.check(d.cuEventRecord(start, stream), label + " cuDNN tuning: cuEventRecord");
      dnn_check(f, f.cudnnBackendExecute(h.h, plan.get(), pack.get()), label, "cudnnBackendExecute");
      d.check(d.cuEventRecord(stop, stream), label + " cuDNN tuning: cuEventRecord");
      d.check(d.cuEventSynchronize(stop), label + " cuDNN tuning: cuEventSynchronize");
      float t = 0;
      d.check(d.cuEventElapsedTime(&t, start, stop), label + " cuDNN tuning: cuEventElapsedTime");
      ms.push_back(t);
    }
  } catch (...) {
    d.cuEventDestroy(start);
    d.cuEventDestroy(stop);
    throw;
  }
  d.cuEventDestroy(start);
  d.cuEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// How many of the heuristic's configurations a tuned plan times.
constexpr std::size_t kTunedCandidates = 4;

}  // namespace

std::unique_ptr<VendorPlan> plan_fused_forward(const Driver& d, const DnnApi& f, DnnHandle& h, const Conv2dCall& c,
                                               const VendorOptions& o, CUstream stream, const std::string& label,
                                               std::string& why) {
  if (c.pass != Conv2dCall::Pass::Forward || !c.fusable) {
    why = "no fusable epilogue";
    return nullptr;
  }
  if (const char* env = std::getenv("KG_CUDNN_FUSION"); env && std::strcmp(env, "0") == 0) {
    why = "turned off by KG_CUDNN_FUSION=0";
    return nullptr;
  }
  cudnnDataType_t data;
  if (c.dtype == DType::BF16)
    data = CUDNN_DATA_BFLOAT16;
  else if (c.dtype == DType::F16)
    data = CUDNN_DATA_HALF;
  else {
    why = util::cat(dtype_name(c.dtype), " (the fused graph is planned for f16 and bf16)");
    return nullptr;
  }
  const Conv2dCall::Fusable& e = *c.fusable;
  if (!e.shift) {
    why = "no shift";
    return nullptr;
  }
  const bool last = c.channels_last;
  const std::array<std::int64_t, 4> xd{c.batch, c.in_channels, c.height, c.width};
  const std::array<std::int64_t, 4> wd{c.out_channels, c.in_channels / c.groups, c.kernel_h, c.kernel_w};
  const std::array<std::int64_t, 4> yd{c.batch, c.out_channels, c.out_height, c.out_width};
  const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
  try {
    // Descriptors the plan keeps alive (a deque: references to them stay valid as it grows).
    std::deque<Desc> keep;
    auto add = [&](Desc dsc) -> const Desc& {
      keep.push_back(std::move(dsc));
      return keep.back();
    };
    const Desc& x = add(tensor(f, kX, data, xd, last, alignment(c.x), false));
    const Desc& w = add(tensor(f, kW, data, wd, last, alignment(c.w), false));
    const Desc& conv_out = add(tensor(f, kConv, f32, yd, last, 16, true));
    const Desc& shift =
        add(tensor(f, kShift, data, {1, c.out_channels, 1, 1}, last, alignment(e.shift), false));
    const bool has_residual = e.residual != 0;
    // The graph's output is whichever tensor comes last: after the ReLU, the residual or the shift.
    const int stages = 1 + (has_residual ? 1 : 0) + (e.relu ? 1 : 0);
    auto stage_out = [&](int stage, std::int64_t uid) -> const Desc& {
      if (stage == stages) return add(tensor(f, kY, data, yd, last, alignment(c.y), false));
      return add(tensor(f, uid, f32, yd, last, 16, true));
    };
    Desc conv(f, CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, "convolution");
    {
      const std::int64_t dims = 2;
      const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
      const std::int64_t pad[2] = {c.pad_h, c.pad_w}, stride[2] = {c.stride_h, c.stride_w},
                         dil[2] = {c.dilation_h, c.dilation_w};
      conv.set(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, &dims)
          .set(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &f32)
          .set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, &mode)
          .set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, pad, 2)
          .set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, pad, 2)
          .set(CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, dil, 2)
          .set(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, stride, 2)
          .finalize();
    }
    const Desc& conv_desc = add(std::move(conv));
    std::vector<cudnnBackendDescriptor_t> ops;
    {
      const float alpha = 1.0f, beta = 0.0f;
      Desc op(f, CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR, "convolution forward");
      op.set_desc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, x)
          .set_desc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, w)
          .set_desc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, conv_out)
          .set_desc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, conv_desc)
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, CUDNN_TYPE_FLOAT, &alpha)
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, CUDNN_TYPE_FLOAT, &beta)
          .finalize();
      ops.push_back(add(std::move(op)).get());
    }
    int stage = 1;
    const Desc* cur = &stage_out(stage, kShifted);
    ops.push_back(add(pointwise(f, keep, CUDNN_POINTWISE_ADD, conv_out, &shift, *cur, "add the shift")).get());
    if (has_residual) {
      const Desc& residual = add(tensor(f, kResidual, data, yd, last, alignment(e.residual), false));
      const Desc* next = &stage_out(++stage, kSum);
      ops.push_back(add(pointwise(f, keep, CUDNN_POINTWISE_ADD, *cur, &residual, *next, "add the residual")).get());
      cur = next;
    }
    if (e.relu) {
      const Desc* next = &stage_out(++stage, 0);
      ops.push_back(add(pointwise(f, keep, CUDNN_POINTWISE_RELU_FWD, *cur, nullptr, *next, "relu")).get());
    }
    Desc graph(f, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    graph.set(kGraphHandle, CUDNN_TYPE_HANDLE, &h.h)
        .set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops.data(),
             static_cast<std::int64_t>(ops.size()))
        .finalize();
    const Desc& graph_desc = add(std::move(graph));

    Desc heur(f, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "engine heuristic");
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph_desc)
        .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, &mode)
        .finalize();
    std::int64_t count = 0;
    heur.ok(f.cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0,
                                       &count, nullptr),
            "cudnnBackendGetAttribute");
    if (count <= 0) {
      why = "cuDNN's heuristic offers no engine for the fused graph";
      return nullptr;
    }
    std::vector<Desc> cfgs;
    std::vector<cudnnBackendDescriptor_t> cfg_ptrs;
    for (std::int64_t i = 0; i < count; ++i) {
      cfgs.emplace_back(f, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine configuration");
      cfg_ptrs.push_back(cfgs.back().get());
    }
    std::int64_t got = 0;
    heur.ok(f.cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count,
                                       &got, cfg_ptrs.data()),
            "cudnnBackendGetAttribute");
    while (static_cast<std::int64_t>(cfgs.size()) > std::max<std::int64_t>(got, 0)) cfgs.pop_back();

    // The configurations in the heuristic's order that build within the workspace limit.
    const std::string scope = util::cat(o.device_scope, " cudnn ", f.cudnnGetVersion());
    const std::string key = util::cat(tuning_key(c, o.tf32), " fused shift", has_residual ? " residual" : "",
                                      e.relu ? " relu" : "");
    const std::optional<int> kept_at = o.cache ? parse_kept_number(o.cache->find(scope, key), "graph ") : std::nullopt;
    const bool kept = kept_at.has_value();
    const std::size_t kept_position = static_cast<std::size_t>(kept_at.value_or(0));
    const std::size_t wanted = kept ? kept_position + 1 : o.tune ? kTunedCandidates : 1;
    std::vector<Candidate> built;
    std::string last_refusal;
    for (std::size_t i = 0; i < cfgs.size() && built.size() < wanted; ++i) {
      const auto [engine, allowed] = engine_info(f, cfgs[i].get());
      if (!allowed) continue;
      auto plan = std::make_shared<Desc>(f, CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan");
      try {
        plan->set(kPlanHandle, CUDNN_TYPE_HANDLE, &h.h).set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfgs[i]).finalize();
      } catch (const Error& err) {
        last_refusal = err.what();
        continue;
      }
      std::int64_t ws = 0, n = 0;
      plan->ok(f.cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                          &n, &ws),
               "cudnnBackendGetAttribute");
      if (ws < 0 || static_cast<std::size_t>(ws) > o.max_workspace_bytes) continue;
      built.push_back({i, engine, ws, std::move(plan)});
    }
    if (built.empty()) {
      why = util::cat("none of the ", cfgs.size(), " engine configurations of cuDNN's heuristic builds",
                      last_refusal.empty() ? std::string() : " (last: " + last_refusal + ")");
      return nullptr;
    }
    std::vector<std::int64_t> uids{kX, kW, kShift, kY};
    std::vector<void*> ptrs{reinterpret_cast<void*>(c.x), reinterpret_cast<void*>(c.w),
                            reinterpret_cast<void*>(e.shift), reinterpret_cast<void*>(c.y)};
    if (has_residual) {
      uids.push_back(kResidual);
      ptrs.push_back(reinterpret_cast<void*>(e.residual));
    }
    std::size_t pick = 0;
    std::string how;
    if (kept && built.back().position == kept_position) {
      pick = built.size() - 1;
      how = " (tuned, cached)";
    } else if (o.tune && built.size() > 1) {
      // Time each on the call's own buffers (this writes y), with room for the largest workspace.
      std::int64_t largest = 0;
      for (const auto& b : built) largest = std::max(largest, b.workspace);
      CUdeviceptr ws = 0;
      if (largest) d.check(d.cuMemAlloc(&ws, static_cast<std::size_t>(largest)), label + " cuDNN tuning: cuMemAlloc");
      double best = 0;
      try {
        for (std::size_t i = 0; i < built.size(); ++i) {
          const Desc pack = GraphPlan::variant_pack(f, uids, ptrs, ws);
          const double ms = time_plan(d, f, h, stream, *built[i].plan, pack, 3, label);
          if (i == 0 || ms < best) best = ms, pick = i;
        }
      } catch (...) {
        d.cuStreamSynchronize(stream);
        if (ws) d.cuMemFree(ws);
        throw;
      }
      d.cuStreamSynchronize(stream);
      if (ws) d.cuMemFree(ws);
      how = util::cat(" (tuned over ", built.size(), ")");
    }
    if (o.cache && o.tune && how != " (tuned, cached)")
      o.cache->store(scope, key, util::cat("graph ", built[pick].position));
    const Candidate& chosen = built[pick];
    // The plan's engine configuration lives as long as the plan, as the graph's descriptors do.
    keep.push_back(std::move(cfgs[chosen.position]));
    std::string description = util::cat(
        "cudnn graph ", dtype_name(c.dtype), last ? " nhwc" : "", " engine ", chosen.engine, " (heuristic's #",
        chosen.position + 1, " of ", cfgs.size(), ")", how, ", conv+shift", has_residual ? "+residual" : "",
        e.relu ? "+relu" : "", " fused, ", chosen.workspace, " B workspace");
    return std::make_unique<GraphPlan>(f, h, std::move(keep), chosen, std::move(uids), std::move(ptrs),
                                       std::move(description));
  } catch (const Error& err) {
    why = err.what();
    return nullptr;
  }
}

}  // namespace kg::cuda

#endif  // KG_HAVE_CUDA
