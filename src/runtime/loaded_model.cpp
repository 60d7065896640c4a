#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <set>
#include <utility>

#include "kg/error.hpp"
#include "kg/io.hpp"
#include "kg/model.hpp"
#include "ops/dnnl.hpp"
#include "runtime/loaded_model_impl.hpp"
#include "util/str.hpp"

namespace kg {

LoadedModel::LoadedModel(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

Device LoadedModel::device() const { return impl_->device; }
std::vector<std::string> LoadedModel::output_names() const { return impl_->output_names; }
const MemoryPlan& LoadedModel::memory_plan() const { return impl_->plan.memory; }
const Graph& LoadedModel::graph() const { return *impl_->graph; }
std::vector<NodeTime> LoadedModel::profile() const { return impl_->last_profile; }
void LoadedModel::set_training(bool training) {
  if (training && impl_->mode != LoweringMode::Training)
    throw Error(
        "set_training: this model was lowered for inference (patterns such as BatchNorm were "
        "fused); build the Model with LoweringMode::Training to train it");
  impl_->training = training;
}

std::vector<std::vector<std::int64_t>> LoadedModel::input_shapes() const {
  if (impl_->slice) return impl_->batch_input_shapes;
  std::vector<std::vector<std::int64_t>> s;
  for (int id : impl_->graph->inputs()) s.push_back(impl_->plan.values[static_cast<std::size_t>(id)].shape);
  return s;
}

std::vector<std::vector<std::int64_t>> LoadedModel::output_shapes() const {
  if (impl_->slice) return impl_->batch_output_shapes;
  std::vector<std::vector<std::int64_t>> s;
  for (int id : impl_->plan.outputs) s.push_back(impl_->plan.values[static_cast<std::size_t>(id)].shape);
  return s;
}

namespace {
// The inputs of a forward against what the model was loaded for.
// `input(k)` gives input k's dtype and shape (a pointer: a forward copies no shape).
void check_inputs(
    const LoadedModel::Impl& m, const char* what, std::size_t count,
    const std::function<std::pair<DType, const std::vector<std::int64_t>*>(std::size_t)>& input) {
  const Graph& g = *m.graph;
  if (count != g.inputs().size())
    throw Error(util::cat(what, ": the model has ", g.inputs().size(), " input(s) but ", count,
                          " tensor(s) were given"));
  for (std::size_t k = 0; k < count; ++k) {
    const Node& n = g.node(g.inputs()[k]);
    const auto& v = m.plan.values[static_cast<std::size_t>(n.id)];
    const std::vector<std::int64_t>& want = m.slice ? m.batch_input_shapes[k] : v.shape;
    const auto [dtype, shape_ptr] = input(k);
    const std::vector<std::int64_t>& shape = *shape_ptr;
    if (dtype != v.dtype || shape != want)
      throw Error(util::cat(what, ": input '", n.name, "' was loaded as ", sizes_to_string(want), " ",
                            dtype_name(v.dtype), " but got ", sizes_to_string(shape), " ", dtype_name(dtype),
                            "; load the model again for new shapes"));
  }
}

// The bookkeeping of a forward around `run`.
template <class Run>
auto run_forward(LoadedModel::Impl& m, Run&& run) {
  ++m.runs;
  m.last_profile.clear();
  m.forward_ready = false;
  m.last_seed = m.options.seed + m.runs;
  m.last_training = m.training;
  const auto t0 = std::chrono::steady_clock::now();
  auto outs = run(m.options.profile ? &m.last_profile : nullptr);
  m.last_wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  m.forward_ready = m.plan.training.enabled;
  return outs;
}
}  // namespace

namespace {
// A forward in batch slices: each slice of rows of the inputs runs through the plan (made for
// m.slice samples) and its outputs are copied into their rows of the batch's outputs. The
// profile sums each node's time over the slices.
std::vector<Tensor> run_slices(LoadedModel::Impl& m, const std::vector<Tensor>& inputs, std::vector<NodeTime>* prof) {
  const std::int64_t count = m.batch / m.slice;
  std::vector<Tensor> outs;
  std::vector<NodeTime> slice_prof;
  for (std::int64_t s = 0; s < count; ++s) {
    std::vector<Tensor> part;
    for (const Tensor& x : inputs) {
      std::vector<std::int64_t> shape = x.shape();
      const std::size_t row = static_cast<std::size_t>(x.numel() / shape[0]) * dtype_size(x.dtype());
      shape[0] = m.slice;
      auto* base = static_cast<unsigned char*>(const_cast<void*>(x.raw()));
      part.push_back(Tensor::wrap(base + static_cast<std::size_t>(s * m.slice) * row, x.dtype(), std::move(shape)));
    }
    slice_prof.clear();
    std::vector<Tensor> got = m.exec->run(part, false, m.last_seed, prof ? &slice_prof : nullptr);
    if (outs.empty())
      for (std::size_t k = 0; k < got.size(); ++k) outs.push_back(Tensor::empty(got[k].dtype(), m.batch_output_shapes[k]));
    for (std::size_t k = 0; k < got.size(); ++k) {
      auto* dst = static_cast<unsigned char*>(const_cast<void*>(outs[k].raw()));
      std::memcpy(dst + static_cast<std::size_t>(s) * got[k].nbytes(), got[k].raw(), got[k].nbytes());
    }
    if (prof) {
      if (prof->empty()) *prof = slice_prof;
      else
        for (std::size_t i = 0; i < std::min(prof->size(), slice_prof.size()); ++i) (*prof)[i].ms += slice_prof[i].ms;
    }
  }
  return outs;
}
}  // namespace

std::vector<Tensor> LoadedModel::forward(const std::vector<Tensor>& inputs) {
  Impl& m = *impl_;
  check_inputs(m, "forward", inputs.size(), [&](std::size_t k) {
    return std::pair{inputs[k].dtype(), &inputs[k].shape()};
  });
  if (m.slice)
    return run_forward(m, [&](std::vector<NodeTime>* prof) { return run_slices(m, inputs, prof); });
  return run_forward(
      m, [&](std::vector<NodeTime>* prof) { return m.exec->run(inputs, m.training, m.last_seed, prof); });
}

std::vector<DeviceTensor> LoadedModel::forward_device(const std::vector<DeviceTensor>& inputs) {
  Impl& m = *impl_;
  check_inputs(m, "forward_device", inputs.size(), [&](std::size_t k) {
    return std::pair{inputs[k].dtype, &inputs[k].shape};
  });
  for (std::size_t k = 0; k < inputs.size(); ++k)
    if (inputs[k].ptr == 0 && inputs[k].numel() > 0)
      throw Error(util::cat("forward_device: input ", k, " has a null address"));
  if (m.device.kind == Device::Kind::Cuda)
    return run_forward(m, [&](std::vector<NodeTime>* prof) {
      return m.exec->run_device(inputs, m.training, m.last_seed, prof);
    });
  // The cpu: the addresses are host memory, read in place.
  std::vector<Tensor> host;
  for (const auto& t : inputs)
    host.push_back(
        Tensor::wrap(reinterpret_cast<void*>(static_cast<std::uintptr_t>(t.ptr)), t.dtype, t.shape));
  m.device_outputs = run_forward(m, [&](std::vector<NodeTime>* prof) {
    return m.slice ? run_slices(m, host, prof) : m.exec->run(host, m.training, m.last_seed, prof);
  });
  std::vector<DeviceTensor> outs;
  for (auto& t : m.device_outputs)
    outs.push_back({static_cast<DevicePtr>(reinterpret_cast<std::uintptr_t>(t.raw())), t.shape(), t.dtype()});
  return outs;
}

double LoadedModel::last_device_ms() const {
  const double ms = impl_->exec->last_device_ms();
  return ms >= 0 ? ms : impl_->last_wall_ms;
}

std::int64_t LoadedModel::cuda_graph_replays() const { return impl_->exec->cuda_graph_replays(); }

// ---- parameters and weights ----

std::vector<ParamInfo> LoadedModel::parameters() const {
  std::vector<ParamInfo> out;
  for (const auto& s : impl_->plan.steps)
    for (const auto& p : s.specs) out.push_back({p.name, p.shape, p.dtype, p.trainable, s.node});
  return out;
}

namespace {
struct ParamRef {
  const Node* node;
  const ParamSpec* spec;
  Tensor* tensor;
};
std::map<std::string, ParamRef> param_map(LoadedModel::Impl& m) {
  std::map<std::string, ParamRef> out;
  for (auto& s : m.plan.steps) {
    const Node& n = m.graph->node(s.node);
    for (std::size_t i = 0; i < s.specs.size(); ++i)
      out.emplace(s.specs[i].name, ParamRef{&n, &s.specs[i], &s.params[i]});
  }
  return out;
}
}  // namespace

Tensor LoadedModel::parameter(const std::string& name) const {
  impl_->exec->download_params();
  auto params = param_map(*impl_);
  auto it = params.find(name);
  if (it == params.end()) throw Error("no parameter named '" + name + "' in the model");
  // On the cpu the caller may write through the tensor: converted copies (oneDNN's weights) are
  // made again at the next forward.
  ops::dnnl::parameters_changed();
  return *it->second.tensor;
}

std::map<std::string, Tensor> LoadedModel::state_dict() const {
  impl_->exec->download_params();
  std::map<std::string, Tensor> out;
  for (auto& [name, ref] : param_map(*impl_)) out.emplace(name, ref.tensor->clone());
  return out;
}

void LoadedModel::load_state_dict(const std::map<std::string, Tensor>& tensors, bool strict) {
  auto params = param_map(*impl_);
  std::vector<std::string> missing, unexpected, mismatched;
  for (auto& [name, ref] : params) {
    auto it = tensors.find(name);
    if (it == tensors.end()) {
      missing.push_back(name + " " + sizes_to_string(ref.spec->shape) + " " +
                        std::string(dtype_name(ref.spec->dtype)));
      continue;
    }
    const Tensor& t = it->second;
    bool dtype_ok = t.dtype() == ref.spec->dtype || (is_floating(t.dtype()) && is_floating(ref.spec->dtype));
    if (t.shape() != ref.spec->shape || !dtype_ok)
      mismatched.push_back(util::cat(name, ": file has ", sizes_to_string(t.shape()), " ",
                                     dtype_name(t.dtype()), ", model has ", sizes_to_string(ref.spec->shape),
                                     " ", dtype_name(ref.spec->dtype)));
  }
  for (auto& [name, t] : tensors)
    if (!params.count(name))
      unexpected.push_back(name + " " + sizes_to_string(t.shape()) + " " +
                           std::string(dtype_name(t.dtype())));
  if (!mismatched.empty() || (strict && (!missing.empty() || !unexpected.empty()))) {
    std::string msg = "weights do not match the model's parameters:";
    auto section = [&](const char* title, const std::vector<std::string>& items) {
      if (items.empty()) return;
      msg += util::cat("\n  ", title, " (", items.size(), "):");
      for (const auto& s : items) msg += "\n    " + s;
    };
    section("missing from the weights", strict ? missing : std::vector<std::string>{});
    section("not in the model", strict ? unexpected : std::vector<std::string>{});
    section("wrong shape or dtype", mismatched);
    throw Error(msg);
  }
  for (auto& [name, ref] : params) {
    auto it = tensors.find(name);
    if (it == tensors.end()) continue;
    const Tensor& t = it->second;
    Tensor src = t.dtype() == ref.spec->dtype ? t : t.to(ref.spec->dtype);
    std::memcpy(ref.tensor->raw(), src.raw(), src.nbytes());
  }
  ops::dnnl::parameters_changed();
  impl_->exec->upload_params();
}

void LoadedModel::load_weights(const std::string& path) {
  auto tensors = read_safetensors(path);
  try {
    load_state_dict(tensors, true);
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  }
}

void LoadedModel::save_weights(const std::string& path) const { write_safetensors(path, state_dict()); }

}  // namespace kg
