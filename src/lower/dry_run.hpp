// Lowering a model for a GPU architecture without a GPU: every kernel compiled with NVRTC and
// every launch sized, packed and checked against made-up device addresses. `kgraph compile`
// and the tests use it; the CUDA backend does the same with real addresses.
#pragma once

#include <cstdint>
#include <vector>

#include "kg/model.hpp"
#include "lower/launch_plan.hpp"
#include "runtime/plan.hpp"

namespace kg::lower {

struct DryRun {
  runtime::Plan plan;
  LoweredGraph lowered;
  LaunchPlan launches;
};

// Binds `input_shapes`, lowers, sizes and packs every launch for compute capability `arch`.
DryRun dry_run(const Model& model, const std::vector<std::vector<std::int64_t>>& input_shapes, int arch,
               std::uint64_t seed = 0);

}  // namespace kg::lower
