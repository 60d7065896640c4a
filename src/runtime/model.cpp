#include "kg/model.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>

#include "backend/cpu/executor.hpp"
#include "backend/cuda/executor.hpp"
#include "kg/cuda.hpp"
#include "kg/error.hpp"
#include "lower/dry_run.hpp"
#include "lower/lowering.hpp"
#include "ops/dnnl.hpp"
#include "passes/dead_nodes.hpp"
#include "passes/passes.hpp"
#include "plan/autograd.hpp"
#include "runtime/batch_slices.hpp"
#include "runtime/loaded_model_impl.hpp"
#include "plan/plan_builder.hpp"
#include "plan/shape_binding.hpp"
#include "util/str.hpp"

namespace kg {

namespace {

// Says once per process, when the graph has a convolution, that oneDNN is missing.
void note_cpu_library_missing(const Graph& graph) {
  static std::once_flag once;
  for (const auto& n : graph.nodes()) {
    if (n.kind != Node::Kind::Op) continue;
    const std::string op = n.op_name();
    if (op != "nn.conv2d" && op != "nn.fused_conv2d") continue;
    std::call_once(once, [] {
      std::fprintf(stderr, "kernelgraph: oneDNN is not available (%s); convolutions run on kernelgraph's own kernels\n",
                   ops::dnnl::unavailable_reason().c_str());
    });
    return;
  }
}

}  // namespace

// ---- Device ----

bool Device::cuda_available() { return cuda::available(); }

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

std::string Device::to_string() const { return kind == Kind::Cpu ? "cpu" : util::cat("cuda:", index); }

std::string MemoryPlan::to_string() const {
  return util::cat(
      "activations ", util::format_bytes(arena_bytes), " in ", buffers, " buffers (",
      util::format_bytes(unshared_bytes), " without reuse), parameters ", util::format_bytes(param_bytes),
      grad_bytes ? ", parameter gradients " + util::format_bytes(grad_bytes) : std::string(),
      optimizer_bytes ? ", optimizer state " + util::format_bytes(optimizer_bytes) : std::string(), ", peak ",
      util::format_bytes(peak_bytes));
}

// ---- Model ----

Model::Model(std::shared_ptr<Graph> graph, std::vector<std::pair<std::string, SymTensor>> outputs,
             LoweringMode mode, const ModelOptions& options)
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
  fused_ = options.fusion && passes::fusion_enabled_by_env();
  passes::GraphAndOutputs opt = passes::optimize(recorded_, ids, mode_, options);
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

Model::Model(std::shared_ptr<Graph> graph, const std::vector<SymTensor>& outputs, LoweringMode mode,
             const ModelOptions& options)
    : Model(std::move(graph), name_outputs(outputs), mode, options) {}

std::vector<ParamInfo> Model::parameters() const {
  std::vector<ParamInfo> out;
  for (int id : live_) {
    const Node& n = graph_->node(id);
    for (const auto& p : n.params) out.push_back({p.name, p.shape, p.dtype, p.trainable, id});
  }
  return out;
}

LoadedModel Model::load(Device device, const std::vector<std::vector<std::int64_t>>& input_shapes,
                        const LoadOptions& options) const {
  auto impl = std::make_shared<LoadedModel::Impl>();
  impl->mode = mode_;
  impl->device = device;
  impl->options = options;
  for (auto& o : outputs_) impl->output_names.push_back(o.first);
  std::vector<int> outs;
  for (auto& o : outputs_) outs.push_back(o.second);
  const bool cuda = device.kind == Device::Kind::Cuda;

  // Shapes are bound on the model's graph first, so that a wrong input is reported in the
  // layout the user recorded.
  plan::BoundShapes bound = plan::bind_shapes(*graph_, live_, input_shapes);
  // The graph this load runs: the model's, or on the CPU its channels-last form (oneDNN).
  std::shared_ptr<Graph> graph = graph_;
  std::vector<int> live = live_;
  if (options.precision != DType::F32) {
    if (!is_half_float(options.precision))
      throw Error(util::cat("LoadOptions::precision: a model loads in f32 (as recorded), f16 or bf16, not ",
                            dtype_name(options.precision)));
    if (mode_ == LoweringMode::Training)
      throw Error(util::cat("LoadOptions::precision: ", dtype_name(options.precision),
                            " is for inference; this model was lowered for training (it trains in f32)"));
    passes::GraphAndOutputs low = passes::reduce_precision(graph, outs, options.precision);
    if (low.graph != graph) {
      graph = low.graph;
      outs = low.outputs;
      live = passes::live_nodes(*graph, outs);
      bound = plan::bind_shapes(*graph, live, input_shapes);
    }
  }
  // On cuda only where cuDNN runs the convolutions: the channels-last op's own kernel is a
  // reference, not a fast path.
  if (mode_ == LoweringMode::Inference && !options.checked && options.vendor_libraries && options.channels_last &&
      !backend::vendor_libraries_disabled_by_env() && (!cuda || cuda::convolution_library_available())) {
    passes::ChannelsLastTarget target;
    target.gpu = cuda;
    target.tf32 = options.tf32;
    passes::GraphAndOutputs cl = passes::channels_last(graph, outs, options.tune, target);
    if (cl.graph != graph) {
      graph = cl.graph;
      outs = cl.outputs;
      live = passes::live_nodes(*graph, outs);
      bound = plan::bind_shapes(*graph, live, input_shapes);
    } else if (!cuda && !ops::dnnl::available()) {
      note_cpu_library_missing(*graph);
    }
  }
  impl->graph = graph;

  impl->plan = plan::build_plan(*graph, live, outs, bound, options.seed);
  int loss = -1;
  if (mode_ == LoweringMode::Training) {
    loss = plan::find_loss(*graph_, outputs_, bound, options.loss);
    for (auto& o : outputs_)
      if (o.second == loss) impl->loss_name = o.first;
  } else if (!options.loss.empty()) {
    throw Error("LoadOptions::loss names '" + options.loss + "' but the model was lowered for inference");
  }
  // Lowering happens here, for every device: with the concrete shapes, for the GPU's
  // architecture or for the emulator.
  lower::LowerTarget target;
  target.concrete = bound.node_shapes;
  target.sm = cuda ? cuda::device_arch(device.index) : 0;
  target.require_all = cuda || options.checked;
  lower::LoweredGraph lowered = lower::lower_graph(*graph, live, mode_, target);
  std::map<int, const lower::Executable*> by_node;
  for (const auto& e : lowered.executables) by_node[e.node] = &e;
  auto lowered_backward = [&](const Node& n) {
    auto it = by_node.find(n.id);
    return it != by_node.end() && it->second->lowered && !it->second->backward_source.empty();
  };
  if (cuda) {
    plan::plan_training(*graph, impl->plan, loss, impl->loss_name, lowered_backward);
    impl->exec = cuda::make_executor(device.index, *graph, lowered, impl->plan, options);
  } else {
    plan::plan_training(*graph, impl->plan, loss, impl->loss_name,
                        [&](const Node& n) { return n.op->op().has_cpu_backward() || lowered_backward(n); });
    // Every lowered op's launches are checked against its kernels' CUDA signatures, whether or
    // not the cpu runs them.
    lower::check_lowered(*graph, lowered, impl->plan);
    impl->exec = cpu::make_executor(*graph, impl->plan, std::move(lowered), options, impl->grads, impl->slots);
  }
  if (impl->plan.training.enabled) init_training_state(*impl);
  if (options.process_group) init_data_parallel(*impl);
  LoadedModel full(impl);
  // Batch slices: timed with LoadOptions::tune, or one size forced by KG_BATCH_SLICE (for
  // tests and comparisons; ignored where it does not divide the batch).
  const std::int64_t forced = runtime::forced_slice();
  if (cuda || (!options.tune && forced == 0) || mode_ != LoweringMode::Inference || options.checked ||
      input_shapes.empty() || input_shapes[0].empty() ||
      !runtime::per_sample(*graph, live, bound, input_shapes[0][0]))
    return full;
  return fastest_slices(full, device, input_shapes, options);
}

LoadedModel Model::fastest_slices(LoadedModel& full, Device device,
                                  const std::vector<std::vector<std::int64_t>>& input_shapes,
                                  const LoadOptions& options) const {
  // One warm-up forward (a tuned load's oneDNN timing happens there), then the fastest of at
  // least two and at most five timed ones, as many as fit in about 0.3 s.
  std::vector<Tensor> zeros;
  for (std::size_t k = 0; k < input_shapes.size(); ++k)
    zeros.push_back(Tensor::zeros(full.impl_->plan.values[static_cast<std::size_t>(
                                                              full.impl_->graph->inputs()[k])].dtype,
                                  input_shapes[k]));
  auto time = [&](LoadedModel& lm) {
    lm.forward(zeros);
    double best = 0, spent = 0;
    for (int k = 0; k < 5 && (k < 2 || spent < 300); ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      lm.forward(zeros);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      best = k == 0 ? ms : std::min(best, ms);
      spent += ms;
    }
    return best;
  };
  const std::int64_t batch = input_shapes[0][0];
  auto sliced = [&](std::int64_t s) {
    std::vector<std::vector<std::int64_t>> shapes = input_shapes;
    for (auto& sh : shapes) sh[0] = s;
    LoadOptions o = options;
    o.tune = false;
    LoadedModel part = load(device, shapes, o);  // its batch is the slice: no slices again
    part.impl_->batch = batch;
    part.impl_->slice = s;
    part.impl_->batch_input_shapes = input_shapes;
    part.impl_->batch_output_shapes = full.output_shapes();
    return part;
  };
  const std::int64_t forced = runtime::forced_slice();
  if (forced > 0) {
    if (forced >= batch || batch % forced != 0) return full;
    return sliced(forced);
  }
  LoadedModel best = full;
  double best_ms = time(full);
  for (std::int64_t s : runtime::slice_candidates(batch)) {
    LoadedModel part = sliced(s);
    const double ms = time(part);
    if (ms < 0.9 * best_ms) {  // a clear win only (10%): the whole batch otherwise
      best_ms = ms;
      best = part;
    }
  }
  best.impl_->runs = 0;
  best.impl_->last_profile.clear();
  return best;
}

}  // namespace kg
