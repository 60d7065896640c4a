// Lowering a model without running it: every launch described and checked against made-up
// device addresses. For a GPU architecture every kernel is also compiled with NVRTC and checked
// against its PTX (`kgraph compile` and the tests use that); for the CPU (arch 0) the checks run
// against the CUDA signatures, at every load.
#pragma once

#include <cstdint>
#include <vector>

#include "kg/model.hpp"
#include "lower/launch_plan.hpp"
#include "plan/plan.hpp"

namespace kg::lower {

struct DryRun {
  plan::Plan plan;
  LoweredGraph lowered;
  LaunchPlan launches;
};

// Binds `input_shapes`, lowers, sizes and packs every launch for compute capability `arch`.
DryRun dry_run(const Model& model, const std::vector<std::vector<std::int64_t>>& input_shapes, int arch,
               std::uint64_t seed = 0);

// Describes every lowered node's launches with made-up addresses and checks them against the
// kernels' CUDA signatures and the dtypes of the tensors their pointers point into: forward (both
// modes for run-dependent launches of a training model) and, for every step of the training plan
// whose op has a lowered backward (with or without a CPU one), backward. A dry pack costs
// microseconds per node; the first failure is an error naming the op and the node.
void check_lowered(const Graph& graph, const LoweredGraph& lowered, const plan::Plan& plan);

}  // namespace kg::lower
