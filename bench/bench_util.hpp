// Helpers the benchmark programs share: integer flags, the optimiser flags and the summary of
// timed runs.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "kg/error.hpp"
#include "kg/model.hpp"
#include "kg/runtime_op.hpp"
#include "kg/tensor.hpp"
#if defined(KG_HAVE_CUDA)
#include "backend/cuda/context.hpp"  // private: events and copies on the models' stream
#endif

namespace kg_bench {

// The program's usage message; it exits and does not return.
using UsageFn = void (*)(const std::string& why);

// The integer value of `flag`, at least `lo`; anything else is a usage error.
inline long parse_int(const std::string& flag, const std::string& v, long lo, UsageFn usage) {
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n < lo) usage(flag + " wants an integer >= " + std::to_string(lo) + ", got '" + v + "'");
  return n;
}

// The value of `flag` as a finite number >= 0; anything else is a usage error.
inline double parse_double(const std::string& flag, const std::string& v, UsageFn usage) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !std::isfinite(x) || x < 0)
    usage(flag + " wants a finite number >= 0, got '" + v + "'");
  return x;
}

// A comma-separated list of batch sizes (each >= 1, at least one).
inline std::vector<std::int64_t> parse_batches(const std::string& flag, const std::string& v, UsageFn usage) {
  std::vector<std::int64_t> out;
  std::stringstream ss(v);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(parse_int(flag, item, 1, usage));
  if (out.empty()) usage(flag + " needs at least one batch size");
  return out;
}

// The optimiser of the training benchmarks' flags: "sgd" (lr 0.01 unless given, with the given
// momentum) or "adamw" (lr `adamw_lr` unless given); a negative lr or weight decay means "not
// given" (weight decay 0 for SGD, 0.01 for AdamW).
inline kg::OptimizerOptions optimizer_options(const std::string& kind, double lr, double momentum,
                                              double weight_decay, double adamw_lr) {
  if (kind == "adamw") return kg::OptimizerOptions::adamw(lr >= 0 ? lr : adamw_lr, weight_decay >= 0 ? weight_decay : 0.01);
  return kg::OptimizerOptions::sgd(lr >= 0 ? lr : 0.01, momentum, weight_decay >= 0 ? weight_decay : 0.0);
}

// One line for logs and file metadata: "SGD lr 0.01 momentum 0.9 weight decay 0", "AdamW lr ...".
inline std::string describe(const kg::OptimizerOptions& o) {
  char buf[160];
  if (o.kind == kg::OptimizerOptions::Kind::AdamW)
    std::snprintf(buf, sizeof buf, "AdamW lr %g weight decay %g betas (%g, %g) eps %g", o.lr, o.weight_decay,
                  o.beta1, o.beta2, o.eps);
  else
    std::snprintf(buf, sizeof buf, "SGD lr %g momentum %g weight decay %g", o.lr, o.momentum, o.weight_decay);
  return buf;
}

// Median, minimum and 90th percentile of run times.
struct Timing {
  double median = 0, min = 0, p90 = 0;
};

inline Timing summarise(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  const std::size_t n = ms.size();
  Timing t;
  if (n == 0) return t;
  t.median = n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
  t.min = ms.front();
  t.p90 = ms[std::min(n - 1, static_cast<std::size_t>(std::ceil(0.9 * static_cast<double>(n))) - 1)];
  return t;
}

// Device time of the work issued between start() and stop_ms(): CUDA events on the stream that
// loaded models on device `device` use (so idle gaps while the host prepares the next launch count
// too), or the wall time on the cpu.
class StreamTimer {
 public:
  StreamTimer(bool cuda, int device) : cuda_(cuda), device_(device) {
    if (!cuda_) return;
#if defined(KG_HAVE_CUDA)
    auto& ctx = kg::cuda::Context::get(device_);
    ctx.make_current();
    const auto& d = ctx.driver();
    d.check(d.cuEventCreate(&start_, CU_EVENT_DEFAULT), "cuEventCreate");
    d.check(d.cuEventCreate(&end_, CU_EVENT_DEFAULT), "cuEventCreate");
#else
    throw kg::Error("StreamTimer: this build has no CUDA path");
#endif
  }
  ~StreamTimer() {
#if defined(KG_HAVE_CUDA)
    if (!cuda_) return;
    const auto& d = kg::cuda::Context::get(device_).driver();
    if (start_) d.cuEventDestroy(start_);
    if (end_) d.cuEventDestroy(end_);
#endif
  }
  StreamTimer(const StreamTimer&) = delete;
  StreamTimer& operator=(const StreamTimer&) = delete;

  void start() {
    t0_ = std::chrono::steady_clock::now();
#if defined(KG_HAVE_CUDA)
    if (cuda_) {
      auto& ctx = kg::cuda::Context::get(device_);
      ctx.make_current();
      ctx.driver().check(ctx.driver().cuEventRecord(start_, ctx.stream()), "cuEventRecord");
    }
#endif
  }
  // Waits for the work and returns its time in ms.
  double stop_ms() {
#if defined(KG_HAVE_CUDA)
    if (cuda_) {
      auto& ctx = kg::cuda::Context::get(device_);
      ctx.make_current();
      const auto& d = ctx.driver();
      d.check(d.cuEventRecord(end_, ctx.stream()), "cuEventRecord");
      d.check(d.cuEventSynchronize(end_), "cuEventSynchronize");
      float ms = 0;
      d.check(d.cuEventElapsedTime(&ms, start_, end_), "cuEventElapsedTime");
      return ms;
    }
#endif
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count();
  }

 private:
  bool cuda_;
  int device_;
  std::chrono::steady_clock::time_point t0_;
#if defined(KG_HAVE_CUDA)
  CUevent start_ = nullptr, end_ = nullptr;
#endif
};

// A host copy of a tensor in device memory (LoadedModel::forward_device's outputs): from device
// `device` when `cuda`, else `t.ptr` is a host address. Waits for earlier work on the stream.
inline kg::Tensor to_host(const kg::DeviceTensor& t, bool cuda, int device) {
  kg::Tensor out = kg::Tensor::empty(t.dtype, t.shape);
  if (out.nbytes() == 0) return out;
  if (!cuda) {
    std::memcpy(out.raw(), reinterpret_cast<const void*>(static_cast<std::uintptr_t>(t.ptr)), out.nbytes());
    return out;
  }
#if defined(KG_HAVE_CUDA)
  auto& ctx = kg::cuda::Context::get(device);
  ctx.download(out.raw(), t.ptr, out.nbytes());
  return out;
#else
  (void)device;
  throw kg::Error("to_host: this build has no CUDA path");
#endif
}

// A DeviceTensor for a host tensor on the cpu (its own address): what forward_device takes there.
inline kg::DeviceTensor host_device_tensor(kg::Tensor& t) {
  return kg::DeviceTensor{static_cast<kg::DevicePtr>(reinterpret_cast<std::uintptr_t>(t.raw())), t.shape(),
                          t.dtype()};
}

}  // namespace kg_bench
