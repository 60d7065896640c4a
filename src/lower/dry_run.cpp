#include "lower/dry_run.hpp"

#include "runtime/plan_builder.hpp"
#include "runtime/shape_binding.hpp"

namespace kg::lower {

DryRun dry_run(const Model& model, const std::vector<std::vector<std::int64_t>>& input_shapes, int arch,
               std::uint64_t seed) {
  DryRun r;
  std::vector<int> outs;
  for (const auto& o : model.outputs()) outs.push_back(o.second);
  auto bound = runtime::bind_shapes(model.graph(), model.live_nodes(), input_shapes);
  r.plan = runtime::build_plan(model.graph(), model.live_nodes(), outs, bound, seed);
  r.lowered = lower_model(model);
  r.launches = size_launches(model.graph(), r.lowered, r.plan, seed);
  // Addresses that look like device memory: a 256-byte aligned arena, inputs and parameters
  // above it.
  const DevicePtr arena = 0x7f0000000000ull;
  DevicePtr next = arena + ((r.launches.arena_bytes + 255) / 256 + 1) * 256;
  std::vector<DevicePtr> inputs;
  for (int id : model.graph().inputs()) {
    inputs.push_back(next);
    next += (r.plan.values[static_cast<std::size_t>(id)].bytes() / 256 + 1) * 256;
  }
  std::vector<std::vector<DevicePtr>> params;
  for (const auto& s : r.plan.steps) {
    std::vector<DevicePtr> p;
    for (const auto& t : s.params) {
      p.push_back(next);
      next += (t.nbytes() / 256 + 1) * 256;
    }
    params.push_back(p);
  }
  pack_launches(r.launches, model.graph(), r.lowered, r.plan, arch, arena, inputs, params);
  return r;
}

}  // namespace kg::lower
