#include "lower/dry_run.hpp"

#include <map>
#include <optional>

#include "kg/error.hpp"
#include "plan/plan_builder.hpp"
#include "plan/shape_binding.hpp"

namespace kg::lower {
namespace {

// Addresses that look like device memory, 256-byte aligned, one region per buffer.
class FakeAddresses {
 public:
  DevicePtr next(std::size_t bytes) {
    const DevicePtr p = next_;
    next_ += (bytes / 256 + 1) * 256;
    return p;
  }

 private:
  DevicePtr next_ = 0x7f0000000000ull;
};

}  // namespace

DryRun dry_run(const Model& model, const std::vector<std::vector<std::int64_t>>& input_shapes, int arch,
               std::uint64_t seed) {
  DryRun r;
  std::vector<int> outs;
  for (const auto& o : model.outputs()) outs.push_back(o.second);
  auto bound = plan::bind_shapes(model.graph(), model.live_nodes(), input_shapes);
  r.plan = plan::build_plan(model.graph(), model.live_nodes(), outs, bound, seed);
  r.lowered = lower_model(model, LowerTarget{bound.node_shapes, arch, true});
  r.launches = size_launches(model.graph(), r.lowered, r.plan);
  FakeAddresses fake;
  const DevicePtr arena = fake.next(r.launches.arena_bytes);
  std::vector<DevicePtr> inputs;
  for (int id : model.graph().inputs())
    inputs.push_back(fake.next(r.plan.values[static_cast<std::size_t>(id)].bytes()));
  std::vector<std::vector<DevicePtr>> params;
  for (const auto& s : r.plan.steps) {
    std::vector<DevicePtr> p;
    for (const auto& t : s.params) p.push_back(fake.next(t.nbytes()));
    params.push_back(p);
  }
  pack_launches(r.launches, model.graph(), r.lowered, r.plan, arch, arena, inputs, params);
  return r;
}

void check_lowered(const Graph& graph, const LoweredGraph& lowered, const plan::Plan& plan) {
  FakeAddresses fake;
  std::map<int, const plan::BackwardStep*> backward;
  for (const auto& b : plan.training.steps) backward[b.node] = &b;
  for (const auto& e : lowered.executables) {
    if (e.view || !e.lowered) continue;
    const Node& n = graph.node(e.node);
    const std::string label = n.label();
    std::size_t si = 0;
    while (si < plan.steps.size() && plan.steps[si].node != e.node) ++si;
    if (si == plan.steps.size()) continue;
    try {
      LaunchTensors t = shape_tensors(n, plan, si);
      const RuntimeOp& rt = *e.runtime_op;
      const std::size_t scratch = rt.scratch_bytes(t);  // sized with every address 0
      for (auto& x : t.inputs) x.ptr = fake.next(static_cast<std::size_t>(x.numel()) * dtype_size(x.dtype));
      for (auto& x : t.params) x.ptr = fake.next(static_cast<std::size_t>(x.numel()) * dtype_size(x.dtype));
      t.output.ptr = fake.next(static_cast<std::size_t>(t.output.numel()) * dtype_size(t.output.dtype));
      if (scratch) t.scratch = fake.next(scratch);
      const KernelModule m = make_module(e.name, e.source, e.entry_point, 0);
      check_launches(m, rt.launches(t), label, "", &t);
      if (rt.depends_on_run() && lowered.mode == LoweringMode::Training) {
        // The train-mode launches too, unless the op refuses train mode at these shapes (a
        // BatchNorm over one value per channel): a train-mode run then reports that.
        t.training = true;
        t.seed = 1;
        std::optional<std::vector<Launch>> train;
        try {
          train = rt.launches(t);
        } catch (const std::exception&) {
        }
        if (train) check_launches(m, std::move(*train), label, "", &t);
      }
      // The backward launches too, also of an op that has a CPU backward (the CPU runs that one,
      // but a GPU and checked mode run the kernels).
      auto b = backward.find(e.node);
      if (b == backward.end() || e.backward_source.empty()) continue;
      LaunchTensors bt = shape_tensors(n, plan, si);
      bt.training = lowered.mode == LoweringMode::Training;
      bt.grad_output = {0, t.output.shape, t.output.dtype};
      for (const auto& x : t.inputs) bt.grad_inputs.push_back({0, x.shape, x.dtype});
      for (const auto& x : t.params) bt.grad_params.push_back({0, x.shape, x.dtype});
      // An op with a CPU backward may refuse its lowered backward at these dtypes or shapes (a
      // 16-bit pool in training): the cpu runs its CPU backward, which reports that itself when
      // the backward runs. What the RuntimeOp does describe is checked.
      const bool cpu_backward = n.op->op().has_cpu_backward();
      std::size_t bscratch = 0;
      try {
        bscratch = rt.backward_scratch_bytes(bt);  // sized with every address 0
      } catch (const std::exception&) {
        if (!cpu_backward) throw;
        continue;
      }
      if (b->second->saves.inputs)
        for (std::size_t i = 0; i < t.inputs.size(); ++i) bt.inputs[i].ptr = t.inputs[i].ptr;
      for (std::size_t p = 0; p < t.params.size(); ++p) bt.params[p].ptr = t.params[p].ptr;
      if (b->second->saves.output) bt.output.ptr = t.output.ptr;
      bt.grad_output.ptr = fake.next(static_cast<std::size_t>(t.output.numel()) * dtype_size(t.output.dtype));
      for (std::size_t i = 0; i < t.inputs.size(); ++i)
        if (i < b->second->inputs.size() && b->second->inputs[i].root >= 0)
          bt.grad_inputs[i].ptr = fake.next(static_cast<std::size_t>(t.inputs[i].numel()) * dtype_size(t.inputs[i].dtype));
      for (std::size_t p = 0; p < t.params.size(); ++p)
        if (p < b->second->want_param.size() && b->second->want_param[p])
          bt.grad_params[p].ptr = fake.next(static_cast<std::size_t>(t.params[p].numel()) * dtype_size(t.params[p].dtype));
      if (bscratch) bt.scratch = fake.next(bscratch);
      const KernelModule bm = make_module(e.name + ".backward", e.backward_source, "", 0);
      std::vector<Launch> launches;
      try {
        launches = rt.backward_launches(bt);
      } catch (const std::exception&) {
        if (!cpu_backward) throw;
        continue;
      }
      check_launches(bm, std::move(launches), label, "backward", &bt);
    } catch (const Error& err) {
      throw labelled(label, err);
    } catch (const std::exception& err) {
      throw Error(label + " RuntimeOp failed: " + err.what());
    }
  }
}

}  // namespace kg::lower
