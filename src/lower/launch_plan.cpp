#include "lower/launch_plan.hpp"

#include <random>

#include "compile/compiler.hpp"
#include "kg/error.hpp"
#include "runtime/plan_builder.hpp"
#include "util/str.hpp"

namespace kg::lower {
namespace {

std::string shapes_text(const std::vector<std::vector<std::int64_t>>& shapes) {
  std::vector<std::string> t;
  for (const auto& s : shapes) t.push_back(sizes_to_string(s));
  return util::join(t, ", ");
}

runtime::Step& step_for(runtime::Plan& plan, int node) {
  for (auto& s : plan.steps)
    if (s.node == node) return s;
  throw Error(util::cat("lowering: node ", node, " has no step in the plan"));
}

std::vector<std::vector<std::int64_t>> input_shapes(const Node& n, const runtime::Plan& plan) {
  std::vector<std::vector<std::int64_t>> v;
  for (int in : n.inputs) v.push_back(plan.values[static_cast<std::size_t>(in)].shape);
  return v;
}

}  // namespace

RuntimeOpSizes consult_runtime_op(const Node& n, const RuntimeOp& rt,
                                  const std::vector<std::vector<std::int64_t>>& in_shapes,
                                  const std::vector<std::int64_t>& out_shape,
                                  const std::vector<ParamSpec>& specs, std::mt19937_64& rng) {
  const std::string label = n.label();
  RuntimeOpSizes r;
  const int n_act = rt.n_activation_inputs();
  if (n_act < 0 || n_act > static_cast<int>(in_shapes.size()))
    throw Error(util::cat(label, " n_activation_inputs() is ", n_act, " but the node has ", in_shapes.size(),
                          " inputs"));
  if (auto real = rt.compute_concrete_output_shape(in_shapes); real && *real != out_shape)
    throw Error(util::cat(label, " infer_output_shape says ", sizes_to_string(out_shape), " for inputs ",
                          shapes_text(in_shapes),
                          " but the kernel (RuntimeOp::compute_concrete_output_shape) writes ",
                          sizes_to_string(*real)));

  // The op's own parameters must be what the RuntimeOp expects; an op without them gets the
  // RuntimeOp's, named after the node.
  const auto shapes = rt.param_shapes(in_shapes, out_shape);
  if (!specs.empty()) {
    bool same = shapes.size() == specs.size();
    for (std::size_t i = 0; same && i < shapes.size(); ++i) same = shapes[i] == specs[i].shape;
    if (!same) {
      std::vector<std::vector<std::int64_t>> declared;
      for (const auto& s : specs) declared.push_back(s.shape);
      throw Error(util::cat(label, " RuntimeOp::param_shapes gives [", shapes_text(shapes),
                            "] but the op declares [", shapes_text(declared), "]"));
    }
  } else {
    const auto names = rt.param_names();
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      ParamSpec spec;
      spec.name = n.name + "." + (i < names.size() ? names[i] : util::cat("param", i));
      spec.shape = shapes[i];
      spec.dtype = rt.param_dtype(static_cast<int>(i));
      spec.trainable = false;
      if (auto init = rt.param_init_data(static_cast<int>(i))) {
        check_param_init(init->size(), spec.shape, spec.dtype, spec.name, label);
        spec.init = ParamInit::from_bytes(std::move(*init));
      } else {
        spec.init = ParamInit::constant(0.0);
      }
      Tensor t = Tensor::empty(spec.dtype, spec.shape);
      runtime::init_param(t, spec, n, rng);
      r.new_specs.push_back(std::move(spec));
      r.new_params.push_back(t);
    }
  }
  r.row_stride = rt.forward_output_row_stride(out_shape);
  const std::int64_t last = out_shape.empty() ? 1 : out_shape.back();
  if (r.row_stride < last)
    throw Error(util::cat(label, " forward_output_row_stride ", r.row_stride,
                          " is smaller than the row length ", last));
  r.scratch_bytes = rt.scratch_bytes(in_shapes, out_shape);
  return r;
}

DevicePtr value_address(const runtime::Plan& plan, int node, DevicePtr arena,
                        const std::vector<DevicePtr>& inputs) {
  const auto& v = plan.values[static_cast<std::size_t>(node)];
  if (v.input_index >= 0) return inputs.at(static_cast<std::size_t>(v.input_index));
  return arena + v.offset;
}

LaunchPlan size_launches(const Graph& graph, const LoweredGraph& lowered, runtime::Plan& plan,
                         std::uint64_t seed) {
  LaunchPlan lp;
  const std::size_t nn = graph.nodes().size();
  lp.row_stride.assign(nn, 0);
  lp.value_bytes.assign(nn, 0);
  for (int id : plan.live) {
    const auto& v = plan.values[static_cast<std::size_t>(id)];
    lp.value_bytes[static_cast<std::size_t>(id)] = v.bytes();
    lp.row_stride[static_cast<std::size_t>(id)] = v.shape.empty() ? 1 : v.shape.back();
  }
  std::vector<runtime::BufferRequest> scratch_reqs;
  std::vector<std::size_t> scratch_step;
  std::mt19937_64 rng(seed ^ 0x5bd1e995u);
  for (const auto& e : lowered.executables) {
    if (e.view) continue;
    const Node& n = graph.node(e.node);
    const std::string label = n.label();
    try {
      runtime::Step& step = step_for(plan, e.node);
      const RuntimeOp& rt = *e.runtime_op;
      const auto& out_shape = plan.values[static_cast<std::size_t>(e.node)].shape;
      const auto in_shapes = input_shapes(n, plan);

      RuntimeOpSizes sizes = consult_runtime_op(n, rt, in_shapes, out_shape, step.specs, rng);
      for (std::size_t i = 0; i < sizes.new_specs.size(); ++i) {
        plan.memory.param_bytes += sizes.new_params[i].nbytes();
        step.specs.push_back(std::move(sizes.new_specs[i]));
        step.params.push_back(sizes.new_params[i]);
      }
      const std::int64_t rs = sizes.row_stride;
      const std::int64_t last = out_shape.empty() ? 1 : out_shape.back();
      if (rs != last && plan.values[static_cast<std::size_t>(e.node)].root != e.node)
        throw Error(label + " a padded row stride needs the node to own its buffer");
      lp.row_stride[static_cast<std::size_t>(e.node)] = rs;
      if (last > 0)
        lp.value_bytes[static_cast<std::size_t>(e.node)] =
            static_cast<std::size_t>(numel_of(out_shape) / last * rs) *
            dtype_size(plan.values[static_cast<std::size_t>(e.node)].dtype);

      StepLaunches sl;
      sl.node = e.node;
      sl.label = label;
      sl.kernel_name = e.name;
      sl.scratch_bytes = sizes.scratch_bytes;
      if (sl.scratch_bytes) {
        const int at = plan.step_of[static_cast<std::size_t>(e.node)];
        scratch_reqs.push_back({sl.scratch_bytes, at, at});
        scratch_step.push_back(lp.steps.size());
      }
      lp.steps.push_back(std::move(sl));
    } catch (const Error& err) {
      throw labelled(label, err);
    } catch (const std::exception& err) {
      throw Error(label + " RuntimeOp failed: " + err.what());
    }
  }
  auto offsets = runtime::place_in_arena(
      plan, graph, [&](int id) { return lp.value_bytes[static_cast<std::size_t>(id)]; }, scratch_reqs);
  for (std::size_t i = 0; i < offsets.size(); ++i) lp.steps[scratch_step[i]].scratch_offset = offsets[i];
  lp.arena_bytes = plan.memory.arena_bytes;
  return lp;
}

void pack_launches(LaunchPlan& lp, const Graph& graph, const LoweredGraph& lowered, const runtime::Plan& plan,
                   int arch, DevicePtr arena, const std::vector<DevicePtr>& inputs,
                   const std::vector<std::vector<DevicePtr>>& params) {
  std::size_t k = 0;
  for (const auto& e : lowered.executables) {
    if (e.view) continue;
    StepLaunches& sl = lp.steps.at(k++);
    try {
      const Node& n = graph.node(e.node);
      const RuntimeOp& rt = *e.runtime_op;
      const auto& out_val = plan.values[static_cast<std::size_t>(e.node)];
      std::size_t si = 0;
      while (si < plan.steps.size() && plan.steps[si].node != e.node) ++si;
      const runtime::Step& step = plan.steps.at(si);

      const compile::CompileResult compiled = compile::Compiler::global().compile(e.name, e.source, arch);
      const auto entries = compile::parse_ptx_entries(compiled.ptx);
      const compile::PtxEntry& entry = resolve_entry(entries, e.entry_point, sl.label);
      sl.ptx = compiled.ptx;
      sl.entry = entry.name;
      sl.entry_info = entry;
      sl.arg_names = compile::kernel_param_names(e.source, e.entry_point.empty() ? entry.name : e.entry_point);

      std::vector<DeviceTensor> ins;
      for (int in : n.inputs) {
        const auto& v = plan.values[static_cast<std::size_t>(in)];
        ins.push_back({value_address(plan, in, arena, inputs), v.shape, v.dtype});
      }
      ins.resize(static_cast<std::size_t>(rt.n_activation_inputs()));
      std::vector<DeviceTensor> prm;
      const auto& paddr = params.at(si);
      for (std::size_t i = 0; i < step.specs.size(); ++i)
        prm.push_back({paddr.at(i), step.specs[i].shape, step.specs[i].dtype});
      sl.runtime_op = e.runtime_op;
      sl.depends_on_run = rt.depends_on_run();
      sl.inputs = std::move(ins);
      sl.params = std::move(prm);
      sl.output = {value_address(plan, e.node, arena, inputs), out_val.shape, out_val.dtype};
      sl.scratch = sl.scratch_bytes ? arena + sl.scratch_offset : 0;
      sl.row_stride = lp.row_stride[static_cast<std::size_t>(e.node)];
      pack_step(sl, RunInfo{});
    } catch (const Error& err) {
      throw labelled(sl.label, err);
    } catch (const std::exception& err) {
      throw Error(sl.label + " RuntimeOp failed: " + err.what());
    }
  }
}

void pack_step(StepLaunches& sl, const RunInfo& run) {
  const RuntimeOp& rt = *sl.runtime_op;
  const auto& shape = sl.output.shape;
  try {
    const int nl = rt.n_launches_for_run(run, shape);
    if (nl < 1) throw Error(util::cat(sl.label, " n_launches is ", nl));
    sl.launches.clear();
    for (int l = 0; l < nl; ++l) {
      LaunchSpec L;
      L.grid = rt.grid_for_run(run, l, shape);
      L.block = rt.block_for_launch(l);
      L.shared = rt.dynamic_shared_bytes(shape);
      check_grid(L.grid, shape, sl.label, l);
      check_block(sl.entry_info, L.block, sl.label, l);
      rt.pack_args_for_run(run, l, sl.inputs, sl.params, sl.output, shape, sl.row_stride, sl.scratch, L.args);
      check_args(sl.entry_info, L.args, sl.arg_names, sl.label, l);
      sl.launches.push_back(std::move(L));
    }
  } catch (const Error& err) {
    throw labelled(sl.label, err);
  } catch (const std::exception& err) {
    throw Error(sl.label + " RuntimeOp failed: " + err.what());
  }
}

}  // namespace kg::lower
