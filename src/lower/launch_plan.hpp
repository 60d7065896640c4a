// Turning a lowered graph into launches, without touching a device: scratch sizes, then
// compilation (for a GPU), entry resolution, and the launches each RuntimeOp describes, checked
// against the kernel's CUDA signature on every device and against its PTX on a GPU. The CUDA
// backend runs the result on a GPU; with made-up addresses the same checks run at load on the CPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "compile/cuda_source.hpp"
#include "compile/ptx.hpp"
#include "kg/model.hpp"
#include "lower/launch_check.hpp"
#include "lower/lowering.hpp"
#include "plan/plan.hpp"

namespace kg::lower {

// A kernel module as the checks and launches need it: the source's signatures always, the PTX
// and its entries when compiled for a GPU (arch > 0).
struct KernelModule {
  std::string name;           // the kernel name in errors and caches
  std::string source;         // CUDA C++ (or PTX)
  std::string default_entry;  // Launch::entry "" means this one ("" = the only one)
  const std::vector<compile::KernelSignature>* kernels = nullptr;  // empty for a PTX source
  std::string ptx;
  std::vector<compile::PtxEntry> ptx_entries;
};

// Parses (and, for arch > 0, compiles through the shared compiler and its caches) `source`.
KernelModule make_module(const std::string& name, const std::string& source, const std::string& default_entry,
                         int arch);

// A launch after the checks: the entry resolved (its name in the source, and in the PTX when
// compiled).
struct CheckedLaunch {
  Launch launch;
  std::string entry;      // the __global__ function's name in the source
  std::string ptx_entry;  // its PTX name ("" when not compiled)
};

// Checks every launch of `launches` against `module` (see check_launch; on a GPU also the PTX
// parameter list and .reqntid/.maxntid). `what` is "" for the forward, "backward" for the
// backward. With `tensors` (what the launches were described for), pointer arguments are also
// checked against the dtypes of the tensors they point into (check_pointees). An empty list is
// an error.
std::vector<CheckedLaunch> check_launches(const KernelModule& module, std::vector<Launch> launches,
                                          const std::string& label, const std::string& what,
                                          const LaunchTensors* tensors = nullptr);

// True when both lists launch the same entries with the same grids, blocks, shared memory and
// argument bytes: a CUDA graph captured from one replays the other.
bool same_launches(const std::vector<CheckedLaunch>& a, const std::vector<CheckedLaunch>& b);

struct StepLaunches {
  int node = -1;
  std::string label;  // "[op @ node]"
  KernelModule module;
  std::vector<CheckedLaunch> launches;
  std::size_t scratch_bytes = 0;
  std::size_t scratch_offset = 0;  // in the arena
  std::shared_ptr<RuntimeOp> runtime_op;
  bool depends_on_run = false;
  LaunchTensors tensors;  // addresses and shapes; training and seed set per run
  // The forward as a vendor-library call (RuntimeOp::library_call), for ops whose launches do not
  // depend on the run; its prologue and epilogue launches checked against the module like the
  // others.
  std::optional<LibraryCall> library;
  std::vector<CheckedLaunch> prologue, epilogue;
};

struct LaunchPlan {
  std::vector<StepLaunches> steps;  // one per lowered non-view executable, in order
  std::size_t arena_bytes = 0;
};

// The tensors of node `n` with every address 0: what RuntimeOp sizing sees.
LaunchTensors shape_tensors(const Node& n, const plan::Plan& plan, std::size_t step);

// Phase 1: sizes each RuntimeOp's scratch and places activations and scratch in one arena
// (plan.memory filled).
LaunchPlan size_launches(const Graph& graph, const LoweredGraph& lowered, plan::Plan& plan);

// Phase 2: builds every kernel module for `arch` (0: parse only, as on the CPU), and describes
// and checks every launch for the given addresses. `params[i]` are the addresses of
// plan.steps[i]'s parameters.
void pack_launches(LaunchPlan& lp, const Graph& graph, const LoweredGraph& lowered, const plan::Plan& plan,
                   int arch, DevicePtr arena, const std::vector<DevicePtr>& inputs,
                   const std::vector<std::vector<DevicePtr>>& params);

// Describes and checks the launches of one step (already through pack_launches) for a run.
void pack_step(StepLaunches& sl, bool training, std::uint64_t seed);

// The address of a node's output for the given arena and input addresses.
DevicePtr value_address(const plan::Plan& plan, int node, DevicePtr arena,
                        const std::vector<DevicePtr>& inputs);

}  // namespace kg::lower
