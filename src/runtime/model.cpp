#include <algorithm>
#include <random>
#include <set>

#include "backend/cpu/executor.hpp"
#include "kg/error.hpp"
#include "kg/model.hpp"
#include "passes/dead_nodes.hpp"
#include "passes/passes.hpp"
#include "runtime/loaded_model_impl.hpp"
#include "runtime/memory_plan.hpp"
#include "runtime/shape_binding.hpp"
#include "util/str.hpp"

namespace kg {

// ---- Device ----

bool Device::cuda_available() { return false; }

Device Device::parse(const std::string& s) {
  if (s == "cpu") return cpu();
  if (s == "auto") return cuda_available() ? cuda() : cpu();
  if (s == "cuda") return cuda();
  if (s.rfind("cuda:", 0) == 0) {
    try {
      std::size_t used = 0;
      int idx = std::stoi(s.substr(5), &used);
      if (used == s.size() - 5 && idx >= 0) return cuda(idx);
    } catch (const std::exception&) {
    }
  }
  throw Error("unknown device '" + s + "' (expected cpu, cuda, cuda:N or auto)");
}

std::string Device::to_string() const {
  return kind == Kind::Cpu ? "cpu" : util::cat("cuda:", index);
}

std::string MemoryPlan::to_string() const {
  return util::cat("activations ", util::format_bytes(arena_bytes), " in ", buffers,
                   " buffers (", util::format_bytes(unshared_bytes), " without reuse), parameters ",
                   util::format_bytes(param_bytes), ", peak ", util::format_bytes(peak_bytes));
}

// ---- Model ----

Model::Model(std::shared_ptr<Graph> graph, std::vector<std::pair<std::string, SymTensor>> outputs,
             LoweringMode mode)
    : recorded_(std::move(graph)), mode_(mode) {
  if (!recorded_) throw Error("Model: null graph");
  if (outputs.empty()) throw Error("Model: name at least one output");
  std::set<std::string> names;
  for (auto& [name, t] : outputs) {
    if (!t.valid() || t.graph_ptr() != recorded_)
      throw Error("Model: output '" + name + "' is not a tensor of this graph");
    if (!names.insert(name).second) throw Error("Model: output name '" + name + "' is used twice");
    outputs_.emplace_back(name, t.node());
  }
  std::vector<int> ids;
  for (auto& o : outputs_) ids.push_back(o.second);
  passes::GraphAndOutputs opt = passes::optimize(recorded_, ids, mode_);
  graph_ = opt.graph;
  for (std::size_t i = 0; i < outputs_.size(); ++i) outputs_[i].second = opt.outputs[i];
  live_ = passes::live_nodes(*graph_, opt.outputs);
}

namespace {
std::vector<std::pair<std::string, SymTensor>> name_outputs(const std::vector<SymTensor>& outs) {
  std::vector<std::pair<std::string, SymTensor>> v;
  for (std::size_t i = 0; i < outs.size(); ++i)
    v.emplace_back(outs.size() == 1 ? "output" : util::cat("output", i), outs[i]);
  return v;
}
}  // namespace

Model::Model(std::shared_ptr<Graph> graph, const std::vector<SymTensor>& outputs, LoweringMode mode)
    : Model(std::move(graph), name_outputs(outputs), mode) {}

std::vector<ParamInfo> Model::parameters() const {
  std::vector<ParamInfo> out;
  for (int id : live_) {
    const Node& n = graph_->node(id);
    for (const auto& p : n.params)
      out.push_back({p.name, p.shape, p.dtype, p.trainable, id});
  }
  return out;
}

namespace {

void init_param(Tensor& t, const ParamSpec& spec, const Node& node, std::mt19937_64& rng) {
  const ParamInit& in = spec.init;
  const std::int64_t n = t.numel();
  switch (in.kind) {
    case ParamInit::Kind::Constant: t.fill(in.a); return;
    case ParamInit::Kind::Data:
      if (in.data.size() != t.nbytes())
        throw Error(util::cat(node.label(), " parameter '", spec.name, "' init data has ",
                              in.data.size(), " bytes; ", sizes_to_string(spec.shape), " × ",
                              dtype_name(spec.dtype), " needs ", t.nbytes()));
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

}  // namespace

LoadedModel Model::load(Device device, const std::vector<std::vector<std::int64_t>>& input_shapes,
                        const LoadOptions& options) const {
  if (device.kind == Device::Kind::Cuda)
    throw Error("device " + device.to_string() +
                ": this build has no CUDA backend yet; load the model on cpu");
  auto impl = std::make_shared<LoadedModel::Impl>();
  impl->graph = graph_;
  impl->mode = mode_;
  impl->device = device;
  impl->options = options;
  for (auto& o : outputs_) impl->output_names.push_back(o.first);

  runtime::BoundShapes bound = runtime::bind_shapes(*graph_, live_, input_shapes);
  runtime::Plan& plan = impl->plan;
  plan.values.resize(graph_->nodes().size());
  for (auto& o : outputs_) plan.outputs.push_back(o.second);

  // Values: storage roots and views.
  for (int id : live_) {
    const Node& n = graph_->node(id);
    auto& v = plan.values[static_cast<std::size_t>(id)];
    v.shape = bound.node_shapes[static_cast<std::size_t>(id)];
    v.dtype = n.dtype;
    v.root = id;
    if (n.kind == Node::Kind::Input) {
      v.input_index = static_cast<int>(std::find(graph_->inputs().begin(), graph_->inputs().end(), id) -
                                       graph_->inputs().begin());
    } else if (n.op->op().is_view()) {
      const auto& src = plan.values[static_cast<std::size_t>(n.inputs.at(0))];
      if (src.bytes() != v.bytes() || src.dtype != v.dtype)
        throw Error(util::cat(n.label(), " is a view but its output (", sizes_to_string(v.shape), " ",
                              dtype_name(v.dtype), ") does not have its input's bytes (",
                              sizes_to_string(src.shape), " ", dtype_name(src.dtype), ")"));
      v.root = src.root;
      v.input_index = src.input_index;
    }
  }

  // Liveness of each root buffer in step order, then placement in the arena.
  std::vector<int> first(graph_->nodes().size(), -1), last(graph_->nodes().size(), -1);
  int step = 0;
  for (int id : live_) {
    const Node& n = graph_->node(id);
    auto r = static_cast<std::size_t>(plan.values[static_cast<std::size_t>(id)].root);
    if (first[r] < 0) first[r] = step;
    last[r] = std::max(last[r], step);
    for (int in : n.inputs) {
      auto ri = static_cast<std::size_t>(plan.values[static_cast<std::size_t>(in)].root);
      last[ri] = std::max(last[ri], step);
    }
    ++step;
  }
  for (int o : plan.outputs) last[static_cast<std::size_t>(plan.values[static_cast<std::size_t>(o)].root)] = step;
  std::vector<runtime::BufferRequest> reqs;
  std::vector<int> req_node;
  for (int id : live_) {
    const auto& v = plan.values[static_cast<std::size_t>(id)];
    if (v.root != id || v.input_index >= 0) continue;
    reqs.push_back({v.bytes(), first[static_cast<std::size_t>(id)], last[static_cast<std::size_t>(id)]});
    req_node.push_back(id);
  }
  runtime::Placement placement = runtime::plan_buffers(reqs);
  for (std::size_t i = 0; i < reqs.size(); ++i)
    plan.values[static_cast<std::size_t>(req_node[i])].offset = placement.offsets[i];
  for (int id : live_) {
    auto& v = plan.values[static_cast<std::size_t>(id)];
    if (v.root != id) v.offset = plan.values[static_cast<std::size_t>(v.root)].offset;
  }
  plan.memory.arena_bytes = placement.arena_bytes;
  plan.memory.unshared_bytes = placement.unshared_bytes;
  plan.memory.buffers = static_cast<int>(reqs.size());
  impl->arena = Tensor::empty(DType::U8, {static_cast<std::int64_t>(std::max<std::size_t>(placement.arena_bytes, 1))});

  // Parameters, initialised like PyTorch's defaults.
  std::mt19937_64 rng(options.seed);
  for (int id : live_) {
    const Node& n = graph_->node(id);
    if (n.kind == Node::Kind::Input || n.op->op().is_view()) continue;
    runtime::Step s;
    s.node = id;
    for (const auto& p : n.params) {
      Tensor t = Tensor::empty(p.dtype, p.shape);
      init_param(t, p, n, rng);
      plan.memory.param_bytes += t.nbytes();
      s.params.push_back(t);
    }
    plan.steps.push_back(std::move(s));
  }
  std::size_t out_bytes = 0;
  for (int o : plan.outputs) out_bytes += plan.values[static_cast<std::size_t>(o)].bytes();
  plan.memory.peak_bytes = plan.memory.arena_bytes + plan.memory.param_bytes + out_bytes;
  impl->executor = std::make_unique<cpu::Executor>(options.threads);
  return LoadedModel(impl);
}

}  // namespace kg
