// Turning a lowered graph into launches, without touching a device: sizes (row strides,
// scratch, RuntimeOp parameters), then compilation, entry resolution, grids, blocks and packed,
// checked arguments for given base addresses. The CUDA backend runs the result on a GPU; with
// made-up addresses it checks a model's kernels on a machine without one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "compile/ptx.hpp"
#include "kg/model.hpp"
#include "lower/launch_check.hpp"
#include "lower/lowering.hpp"
#include "runtime/plan.hpp"

namespace kg::lower {

struct LaunchSpec {
  Dim3 grid, block;
  std::size_t shared = 0;
  ArgPack args;
};

struct StepLaunches {
  int node = -1;
  std::string label;        // "[op @ node]"
  std::string kernel_name;  // Lowered::name
  std::string ptx;
  std::string entry;  // the PTX entry name
  std::size_t scratch_bytes = 0;
  std::size_t scratch_offset = 0;  // in the arena
  std::vector<LaunchSpec> launches;
  // What packing needs again for a RuntimeOp whose launches depend on the run.
  std::shared_ptr<RuntimeOp> runtime_op;
  bool depends_on_run = false;
  compile::PtxEntry entry_info;
  std::vector<std::string> arg_names;
  std::vector<DeviceTensor> inputs, params;
  DeviceTensor output;
  DevicePtr scratch = 0;
  std::int64_t row_stride = 0;
};

struct LaunchPlan {
  std::vector<StepLaunches> steps;       // one per non-view executable, in order
  std::vector<std::int64_t> row_stride;  // by node id: elements between output rows
  std::vector<std::size_t> value_bytes;  // by node id: buffer bytes (padded rows included)
  std::size_t arena_bytes = 0;
};

// What a RuntimeOp says about one node at concrete shapes, checked against the graph.
struct RuntimeOpSizes {
  std::vector<ParamSpec> new_specs;  // parameters the RuntimeOp declares for an op without its own
  std::vector<Tensor> new_params;    // their initial values (param_init_data, else zeros)
  std::int64_t row_stride = 0;       // elements between output rows
  std::size_t scratch_bytes = 0;
};

// Checks the RuntimeOp of node `n` (activation inputs, concrete output shape, parameter shapes
// against `specs`, the node's own) and sizes its output rows and scratch. Errors name the node.
RuntimeOpSizes consult_runtime_op(const Node& n, const RuntimeOp& rt,
                                  const std::vector<std::vector<std::int64_t>>& in_shapes,
                                  const std::vector<std::int64_t>& out_shape,
                                  const std::vector<ParamSpec>& specs, std::mt19937_64& rng);

// Phase 1: checks each RuntimeOp against the graph (activation inputs, concrete output shape,
// parameter shapes), adds RuntimeOp-declared parameters to `plan` (param_init_data checked),
// sizes row strides and scratch, and places everything in one arena (plan.memory filled).
LaunchPlan size_launches(const Graph& graph, const LoweredGraph& lowered, runtime::Plan& plan,
                         std::uint64_t seed);

// Phase 2: compiles every kernel for `arch` (through the shared compiler and its caches),
// resolves entry points, and sizes and packs every launch for the given addresses, checking
// grids, blocks and arguments. `params[i]` are the addresses of plan.steps[i]'s parameters.
void pack_launches(LaunchPlan& lp, const Graph& graph, const LoweredGraph& lowered, const runtime::Plan& plan,
                   int arch, DevicePtr arena, const std::vector<DevicePtr>& inputs,
                   const std::vector<std::vector<DevicePtr>>& params);

// Sizes and packs the launches of one step (already through pack_launches) for `run`, with the
// same checks: grids, blocks and arguments against the PTX.
void pack_step(StepLaunches& sl, const RunInfo& run);

// The address of a node's output for the given arena and input addresses.
DevicePtr value_address(const runtime::Plan& plan, int node, DevicePtr arena,
                        const std::vector<DevicePtr>& inputs);

}  // namespace kg::lower
