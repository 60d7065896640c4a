#include "plan/plan_builder.hpp"

#include <algorithm>

#include "kg/error.hpp"
#include "util/memory.hpp"
#include "util/str.hpp"

namespace kg::plan {

void init_param(Tensor& t, const ParamSpec& spec, const Node& node, std::mt19937_64& rng) {
  const ParamInit& in = spec.init;
  const std::int64_t n = t.numel();
  switch (in.kind) {
    case ParamInit::Kind::Constant: t.fill(in.a); return;
    case ParamInit::Kind::Data:
      if (in.data.size() != t.nbytes())
        throw Error(util::cat(node.label(), " parameter '", spec.name, "' init data has ", in.data.size(), " bytes; ",
                              sizes_to_string(spec.shape), " × ", dtype_name(spec.dtype), " needs ", t.nbytes()));
      std::copy(in.data.begin(), in.data.end(), static_cast<std::byte*>(t.raw()));
      return;
    case ParamInit::Kind::Uniform:
    case ParamInit::Kind::Normal: {
      if (!is_floating(spec.dtype))
        throw Error(util::cat(node.label(), " parameter '", spec.name, "': random init needs a float dtype"));
      Tensor tmp = Tensor::empty(DType::F64, t.shape());
      double* d = tmp.data<double>();
      if (in.kind == ParamInit::Kind::Uniform) {
        std::uniform_real_distribution<double> u(in.a, in.b);
        for (std::int64_t i = 0; i < n; ++i) d[i] = u(rng);
      } else {
        std::normal_distribution<double> nd(in.a, in.b);
        for (std::int64_t i = 0; i < n; ++i) d[i] = nd(rng);
      }
      t = tmp.to(spec.dtype);
      return;
    }
  }
}

Plan build_plan(const Graph& graph, const std::vector<int>& live, const std::vector<int>& outputs,
                const BoundShapes& bound, std::uint64_t seed) {
  Plan plan;
  const std::size_t nn = graph.nodes().size();
  plan.values.resize(nn);
  plan.outputs = outputs;
  plan.live = live;

  // Values: storage roots and views.
  for (int id : live) {
    const Node& n = graph.node(id);
    auto& v = plan.values[static_cast<std::size_t>(id)];
    v.shape = bound.node_shapes[static_cast<std::size_t>(id)];
    v.dtype = n.dtype;
    v.root = id;
    // Every size below (v.bytes()) is then known to fit in 63 bits.
    (void)checked_bytes(v.shape, v.dtype, n.label() + " output");
    if (n.kind == Node::Kind::Input) {
      v.input_index =
          static_cast<int>(std::find(graph.inputs().begin(), graph.inputs().end(), id) - graph.inputs().begin());
    } else if (n.op->op().is_view()) {
      const auto& src = plan.values[static_cast<std::size_t>(n.inputs.at(0))];
      const std::optional<std::int64_t> part = n.op->op().view_offset(src.shape);
      if (!part) {
        if (src.bytes() != v.bytes() || src.dtype != v.dtype)
          throw Error(util::cat(n.label(), " is a view but its output (", sizes_to_string(v.shape), " ",
                                dtype_name(v.dtype), ") does not have its input's bytes (",
                                sizes_to_string(src.shape), " ", dtype_name(src.dtype), ")"));
      } else {
        // A part of its input: elements [*part, *part + numel) of it, in its dtype.
        const std::int64_t count = numel_of(v.shape), have = numel_of(src.shape);
        if (src.dtype != v.dtype || *part < 0 || *part > have || count > have - *part)
          throw Error(util::cat(n.label(), " is a view of elements [", *part, ", ", *part + count, ") of its input ",
                                sizes_to_string(src.shape), " ", dtype_name(src.dtype), " (", have,
                                " elements) as ", sizes_to_string(v.shape), " ", dtype_name(v.dtype),
                                ", which do not lie in it"));
        if (src.input_index >= 0)
          throw Error(util::cat(n.label(), " is a view of a part of model input '",
                                graph.node(src.root).name, "'; a part can only be taken of a computed value"));
        v.view_bytes = src.view_bytes + static_cast<std::size_t>(*part) * dtype_size(v.dtype);
      }
      if (!part) v.view_bytes = src.view_bytes;
      v.root = src.root;
      v.input_index = src.input_index;
    }
  }

  // Lifetimes of each storage root, in step order (outputs live to the end).
  plan.first.assign(nn, -1);
  plan.last.assign(nn, -1);
  plan.step_of.assign(nn, -1);
  int step = 0;
  for (int id : live) {
    const Node& n = graph.node(id);
    plan.step_of[static_cast<std::size_t>(id)] = step;
    auto r = static_cast<std::size_t>(plan.values[static_cast<std::size_t>(id)].root);
    if (plan.first[r] < 0) plan.first[r] = step;
    plan.last[r] = std::max(plan.last[r], step);
    for (int in : n.inputs) {
      auto ri = static_cast<std::size_t>(plan.values[static_cast<std::size_t>(in)].root);
      plan.last[ri] = std::max(plan.last[ri], step);
    }
    ++step;
  }
  for (int o : plan.outputs) plan.last[static_cast<std::size_t>(plan.values[static_cast<std::size_t>(o)].root)] = step;

  // Steps with their parameters.
  std::mt19937_64 rng(seed);
  for (int id : live) {
    const Node& n = graph.node(id);
    if (n.kind == Node::Kind::Input || n.op->op().is_view()) continue;
    Step s;
    s.node = id;
    s.specs = n.params;
    for (const auto& p : n.params) {
      (void)checked_bytes(p.shape, p.dtype, util::cat(n.label(), " parameter '", p.name, "'"));
      Tensor t = Tensor::empty(p.dtype, p.shape);
      init_param(t, p, n, rng);
      plan.memory.param_bytes += t.nbytes();
      s.params.push_back(t);
    }
    plan.steps.push_back(std::move(s));
  }
  return plan;
}

std::string describe_inputs(const Plan& plan, const Graph& graph) {
  std::vector<std::string> inputs;
  for (int id : graph.inputs()) {
    const auto& v = plan.values[static_cast<std::size_t>(id)];
    inputs.push_back(util::cat("'", graph.node(id).name, "' ", sizes_to_string(v.shape)));
  }
  return util::cat("input", inputs.size() == 1 ? " " : "s ", util::join(inputs, ", "));
}

namespace {

// The plan's peak against the memory this process can have, before the arena is allocated.
void check_host_memory(const Plan& plan, const Graph& graph) {
  if (util::memory_check_disabled()) return;
  const auto avail = util::available_memory();
  if (!avail || plan.memory.peak_bytes <= avail->bytes) return;
  throw Error(util::cat("the memory plan for ", describe_inputs(plan, graph), " needs ", plan.memory.peak_bytes, " bytes (", util::format_bytes(plan.memory.peak_bytes),
                        ": activations ", plan.memory.arena_bytes, ", parameters ", plan.memory.param_bytes,
                        ", outputs ", plan.memory.peak_bytes - plan.memory.arena_bytes - plan.memory.param_bytes,
                        ") but ", avail->bytes, " bytes (", util::format_bytes(avail->bytes), ") are available (",
                        avail->source, "); use a smaller batch, or set KG_NO_MEMORY_CHECK=1 to allocate anyway"));
}

}  // namespace

std::vector<std::size_t> place_in_arena(Plan& plan, const Graph& graph, const std::function<std::size_t(int)>& bytes_of,
                                        const std::vector<BufferRequest>& extra) {
  std::vector<BufferRequest> reqs;
  std::vector<int> req_node;
  for (int id : plan.live) {
    const auto& v = plan.values[static_cast<std::size_t>(id)];
    if (v.root != id || v.input_index >= 0) continue;
    reqs.push_back({bytes_of(id), plan.first[static_cast<std::size_t>(id)], plan.last[static_cast<std::size_t>(id)]});
    req_node.push_back(id);
  }
  const std::size_t n_values = reqs.size();
  reqs.insert(reqs.end(), extra.begin(), extra.end());
  TrainingPlan& tp = plan.training;
  const std::size_t n_before_training = reqs.size();
  reqs.insert(reqs.end(), tp.requests.begin(), tp.requests.end());
  Placement placement = plan_buffers(reqs);
  for (std::size_t k = 0; k < tp.targets.size(); ++k) {
    const std::size_t off = placement.offsets[n_before_training + k];
    const auto& t = tp.targets[k];
    const auto a = static_cast<std::size_t>(t.a), b = static_cast<std::size_t>(t.b);
    switch (t.kind) {
      case TrainingPlan::Target::Kind::Grad: tp.grad_offset[a] = off; break;
      case TrainingPlan::Target::Kind::InputTemp: tp.steps[a].inputs[b].temp_offset = off; break;
      case TrainingPlan::Target::Kind::ParamTemp: tp.steps[a].param_temp_offsets[b] = off; break;
    }
  }
  for (std::size_t i = 0; i < n_values; ++i)
    plan.values[static_cast<std::size_t>(req_node[i])].offset = placement.offsets[i];
  for (int id : plan.live) {
    auto& v = plan.values[static_cast<std::size_t>(id)];
    if (v.root != id) v.offset = plan.values[static_cast<std::size_t>(v.root)].offset + v.view_bytes;
  }
  plan.memory.arena_bytes = placement.arena_bytes;
  plan.memory.unshared_bytes = placement.unshared_bytes;
  plan.memory.buffers = static_cast<int>(reqs.size());
  auto sum = [&](std::size_t a, std::size_t b) {
    const auto r = util::checked_add(a, b);
    if (!r) throw Error(util::cat("memory plan: the peak (", a, " + ", b, " bytes) overflows 64 bits"));
    return static_cast<std::size_t>(*r);
  };
  std::size_t out_bytes = 0;
  for (int o : plan.outputs) out_bytes = sum(out_bytes, plan.values[static_cast<std::size_t>(o)].bytes());
  plan.memory.peak_bytes = sum(sum(plan.memory.arena_bytes, plan.memory.param_bytes), out_bytes);
  if (!ArenaNotOnHost::active()) check_host_memory(plan, graph);
  return std::vector<std::size_t>(placement.offsets.begin() + static_cast<std::ptrdiff_t>(n_values),
                                  placement.offsets.begin() + static_cast<std::ptrdiff_t>(n_before_training));
}

}  // namespace kg::plan
