// The vendor libraries of the CUDA toolkit that run a RuntimeOp's LibraryCall: cuBLASLt for a
// GemmCall and cuDNN for a Conv2dCall. Each is opened with dlopen at first use (no symbol of either
// is linked), so one binary runs without them: get() is then null, and the op's own kernels serve.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <memory>
#include <string>

#include "compile/tuning_cache.hpp"
#include "kg/runtime_op.hpp"

namespace kg::cuda {

// How a library call is planned.
struct VendorOptions {
  // f32 products may round their inputs to TF32 on tensor cores (PyTorch's allow_tf32).
  bool tf32 = false;
  // Time each candidate algorithm on the call's own buffers and keep the fastest (otherwise the
  // library's heuristic first choice is kept). Planning then writes the output buffer.
  bool tune = false;
  // The most workspace one call may use.
  std::size_t max_workspace_bytes = std::size_t{64} << 20;  // the executor sets its own
  // Where measured choices are kept: a tuned plan measures only what it does not find there and
  // stores what won; an untuned plan takes a stored choice where there is one (and the heuristic's
  // otherwise). Null: nothing is kept. `device_scope` names the device and driver the choices hold
  // for ("NVIDIA H200 sm_90 driver 13000"); each library adds its version.
  compile::TuningCache* cache = nullptr;
  std::string device_scope;
};

// What a call's measured choice depends on besides the device and the library: its shapes,
// dtype, layout and options (not its addresses). Keys of the tuning cache.
std::string tuning_key(const GemmCall& g, bool tf32);
std::string tuning_key(const Conv2dCall& c, bool tf32);

// One planned call: descriptors and the chosen algorithm for the call's shapes and addresses.
class VendorPlan {
 public:
  virtual ~VendorPlan() = default;
  // Workspace bytes run() needs (at most VendorOptions::max_workspace_bytes).
  virtual std::size_t workspace_bytes() const = 0;
  // What was chosen, for `kgraph inspect` and profiles, e.g. "cublasLt algo 21 tile 128x128".
  virtual std::string describe() const = 0;
  // Enqueues the call on `stream` (capturable into a CUDA graph); `workspace` holds at least
  // workspace_bytes(). Throws kg::Error naming `label` and the library status on failure.
  virtual void run(CUstream stream, DevicePtr workspace, const std::string& label) const = 0;
  // The call computes its convolution's fusable epilogue (Conv2dCall::fusable) too, so the
  // LibraryCall's epilogue launches must not run after it.
  virtual bool fused_epilogue() const { return false; }
};

// The context of the device must be current for every call below.
class BlasLt {
 public:
  // The library, or nullptr when it cannot be used (not found, too old, no handle); why in
  // unavailable_reason().
  static const BlasLt* get();
  static const std::string& unavailable_reason();
  // A plan for `g`, or nullptr when the library has no algorithm for it (a dtype it does not
  // take, strides it refuses): the op's kernels then serve. Errors of the library are kg::Error
  // naming `label`.
  virtual std::unique_ptr<VendorPlan> plan(const GemmCall& g, const VendorOptions& o, CUstream stream,
                                           const std::string& label) const = 0;
  virtual ~BlasLt() = default;
};

class Dnn {
 public:
  static const Dnn* get();
  static const std::string& unavailable_reason();
  // As BlasLt::plan, for a convolution.
  virtual std::unique_ptr<VendorPlan> plan(const Conv2dCall& c, const VendorOptions& o, CUstream stream,
                                           const std::string& label) const = 0;
  virtual ~Dnn() = default;
};

}  // namespace kg::cuda
