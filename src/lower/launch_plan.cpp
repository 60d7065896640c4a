#include "lower/launch_plan.hpp"

#include <optional>

#include "compile/compiler.hpp"
#include "kg/error.hpp"
#include "plan/plan_builder.hpp"
#include "util/str.hpp"

namespace kg::lower {
namespace {

std::size_t step_index(const plan::Plan& plan, int node) {
  for (std::size_t i = 0; i < plan.steps.size(); ++i)
    if (plan.steps[i].node == node) return i;
  throw Error(util::cat("lowering: node ", node, " has no step in the plan"));
}

bool is_ptx(const std::string& source) {
  return source.find(".entry") != std::string::npos && source.find(".version") != std::string::npos &&
         source.find("__global__") == std::string::npos;
}

const std::vector<compile::KernelSignature>& no_kernels() {
  static const std::vector<compile::KernelSignature> none;
  return none;
}

}  // namespace

KernelModule make_module(const std::string& name, const std::string& source, const std::string& default_entry,
                         int arch) {
  KernelModule m;
  m.name = name;
  m.source = source;
  m.default_entry = default_entry;
  m.kernels = is_ptx(source) ? &no_kernels() : &source_kernels(source);
  if (arch > 0) {
    m.ptx = compile::Compiler::global().compile(name, source, arch).ptx;
    m.ptx_entries = compile::parse_ptx_entries(m.ptx);
  }
  return m;
}

std::vector<CheckedLaunch> check_launches(const KernelModule& m, std::vector<Launch> launches,
                                          const std::string& label, const std::string& what,
                                          const LaunchTensors* tensors) {
  if (launches.empty())
    throw Error(util::cat(label, " RuntimeOp::", what.empty() ? "launches()" : "backward_launches()",
                          " described no launch"));
  std::vector<CheckedLaunch> out;
  const bool source_known = !m.kernels->empty() || !is_ptx(m.source);
  const std::string where = what.empty() ? "" : " " + what;
  for (std::size_t i = 0; i < launches.size(); ++i) {
    CheckedLaunch c;
    c.launch = std::move(launches[i]);
    const int index = static_cast<int>(i);
    const std::string entry = c.launch.entry.empty() ? m.default_entry : c.launch.entry;
    std::vector<std::string> names;
    if (source_known) {
      const compile::KernelSignature& sig = resolve_source_entry(*m.kernels, entry, label, what);
      check_launch(sig, c.launch, label, index, what);
      if (tensors) check_pointees(sig, c.launch, *tensors, m.source, label, index, what);
      c.entry = sig.name;
      names = sig.param_names;
    } else {
      check_grid(c.launch.grid, {}, label + where, index, entry);
      check_shared(c.launch.shared_bytes, label + where, index, entry);
      c.entry = entry;
    }
    if (!m.ptx.empty()) {
      const compile::PtxEntry& pe = resolve_entry(m.ptx_entries, c.entry, label + where);
      check_block(pe, c.launch.block, label + where, index);
      check_args(pe, c.launch.args, names, label + where, index);
      c.ptx_entry = pe.name;
    }
    out.push_back(std::move(c));
  }
  return out;
}

bool same_launches(const std::vector<CheckedLaunch>& a, const std::vector<CheckedLaunch>& b) {
  if (a.size() != b.size()) return false;
  auto same_dim = [](const Dim3& x, const Dim3& y) { return x.x == y.x && x.y == y.y && x.z == y.z; };
  for (std::size_t i = 0; i < a.size(); ++i) {
    const Launch &x = a[i].launch, &y = b[i].launch;
    if (a[i].ptx_entry != b[i].ptx_entry || a[i].entry != b[i].entry || !same_dim(x.grid, y.grid) ||
        !same_dim(x.block, y.block) || x.shared_bytes != y.shared_bytes || x.args.size() != y.args.size())
      return false;
    for (std::size_t k = 0; k < x.args.size(); ++k)
      if (x.args.args()[k].kind() != y.args.args()[k].kind() || x.args.args()[k].data() != y.args.args()[k].data())
        return false;
  }
  return true;
}

DevicePtr value_address(const plan::Plan& plan, int node, DevicePtr arena,
                        const std::vector<DevicePtr>& inputs) {
  const auto& v = plan.values[static_cast<std::size_t>(node)];
  if (v.input_index >= 0) return inputs.at(static_cast<std::size_t>(v.input_index));
  return arena + v.offset;
}

LaunchTensors shape_tensors(const Node& n, const plan::Plan& plan, std::size_t step) {
  LaunchTensors t;
  for (int in : n.inputs) {
    const auto& v = plan.values[static_cast<std::size_t>(in)];
    t.inputs.push_back({0, v.shape, v.dtype});
  }
  for (const auto& s : plan.steps.at(step).specs) t.params.push_back({0, s.shape, s.dtype});
  const auto& ov = plan.values[static_cast<std::size_t>(n.id)];
  t.output = {0, ov.shape, ov.dtype};
  return t;
}

LaunchPlan size_launches(const Graph& graph, const LoweredGraph& lowered, plan::Plan& plan) {
  LaunchPlan lp;
  std::vector<plan::BufferRequest> scratch_reqs;
  std::vector<std::size_t> scratch_step;
  for (const auto& e : lowered.executables) {
    if (e.view || !e.lowered) continue;
    const Node& n = graph.node(e.node);
    StepLaunches sl;
    sl.node = e.node;
    sl.label = n.label();
    try {
      sl.tensors = shape_tensors(n, plan, step_index(plan, e.node));
      sl.scratch_bytes = e.runtime_op->scratch_bytes(sl.tensors);
    } catch (const Error& err) {
      throw labelled(sl.label, err);
    } catch (const std::exception& err) {
      throw Error(sl.label + " RuntimeOp::scratch_bytes failed: " + err.what());
    }
    if (sl.scratch_bytes) {
      const int at = plan.step_of[static_cast<std::size_t>(e.node)];
      scratch_reqs.push_back({sl.scratch_bytes, at, at});
      scratch_step.push_back(lp.steps.size());
    }
    lp.steps.push_back(std::move(sl));
  }
  // This arena is a GPU's or a dry run's, not the host's: no host memory check.
  const plan::ArenaNotOnHost not_on_host;
  auto offsets = plan::place_in_arena(
      plan, graph, [&](int id) { return plan.values[static_cast<std::size_t>(id)].bytes(); }, scratch_reqs);
  for (std::size_t i = 0; i < offsets.size(); ++i) lp.steps[scratch_step[i]].scratch_offset = offsets[i];
  lp.arena_bytes = plan.memory.arena_bytes;
  return lp;
}

void pack_launches(LaunchPlan& lp, const Graph& graph, const LoweredGraph& lowered, const plan::Plan& plan,
                   int arch, DevicePtr arena, const std::vector<DevicePtr>& inputs,
                   const std::vector<std::vector<DevicePtr>>& params) {
  std::size_t k = 0;
  for (const auto& e : lowered.executables) {
    if (e.view || !e.lowered) continue;
    StepLaunches& sl = lp.steps.at(k++);
    try {
      const Node& n = graph.node(e.node);
      const std::size_t si = step_index(plan, e.node);
      sl.module = make_module(e.name, e.source, e.entry_point, arch);
      for (std::size_t i = 0; i < n.inputs.size(); ++i)
        sl.tensors.inputs[i].ptr = value_address(plan, n.inputs[i], arena, inputs);
      const auto& paddr = params.at(si);
      for (std::size_t i = 0; i < sl.tensors.params.size(); ++i) sl.tensors.params[i].ptr = paddr.at(i);
      sl.tensors.output.ptr = value_address(plan, e.node, arena, inputs);
      sl.tensors.scratch = sl.scratch_bytes ? arena + sl.scratch_offset : 0;
      sl.runtime_op = e.runtime_op;
      sl.depends_on_run = e.runtime_op->depends_on_run();
      pack_step(sl, false, 0);
      if (sl.depends_on_run && lowered.mode == LoweringMode::Training) {
        // The train-mode launches are checked at load too, unless the op refuses train mode at
        // these shapes (a BatchNorm over one value per channel): a train-mode run reports that.
        LaunchTensors t = sl.tensors;
        t.training = true;
        t.seed = 1;
        std::optional<std::vector<Launch>> train;
        try {
          train = e.runtime_op->launches(t);
        } catch (const std::exception&) {
        }
        if (train) check_launches(sl.module, std::move(*train), sl.label, "", &t);
      }
    } catch (const Error& err) {
      throw labelled(sl.label, err);
    } catch (const std::exception& err) {
      throw Error(sl.label + " RuntimeOp failed: " + err.what());
    }
  }
}

void pack_step(StepLaunches& sl, bool training, std::uint64_t seed) {
  try {
    sl.tensors.training = training;
    sl.tensors.seed = seed;
    sl.launches = check_launches(sl.module, sl.runtime_op->launches(sl.tensors), sl.label, "", &sl.tensors);
  } catch (const Error& err) {
    throw labelled(sl.label, err);
  } catch (const std::exception& err) {
    throw Error(sl.label + " RuntimeOp::launches failed: " + err.what());
  }
  if (sl.depends_on_run) return;
  try {
    sl.library = sl.runtime_op->library_call(sl.tensors);
    sl.prologue.clear();
    sl.epilogue.clear();
    if (sl.library && !sl.library->prologue.empty())
      sl.prologue = check_launches(sl.module, sl.library->prologue, sl.label, "library-call prologue", &sl.tensors);
    if (sl.library && !sl.library->epilogue.empty())
      sl.epilogue = check_launches(sl.module, sl.library->epilogue, sl.label, "library-call epilogue", &sl.tensors);
  } catch (const Error& err) {
    throw labelled(sl.label, err);
  } catch (const std::exception& err) {
    throw Error(sl.label + " RuntimeOp::library_call failed: " + err.what());
  }
}

}  // namespace kg::lower
