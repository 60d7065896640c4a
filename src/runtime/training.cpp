// LoadedModel's training half: backward, gradients, optimiser steps and checkpoints.
#include <chrono>

#include "kg/distributed.hpp"
#include "kg/error.hpp"
#include "kg/io.hpp"
#include "kg/model.hpp"
#include "runtime/loaded_model_impl.hpp"
#include "plan/optimizer.hpp"
#include "util/str.hpp"

namespace kg {

OptimizerOptions OptimizerOptions::sgd(double lr, double momentum, double weight_decay) {
  OptimizerOptions o;
  o.kind = Kind::Sgd;
  o.lr = lr;
  o.momentum = momentum;
  o.weight_decay = weight_decay;
  return o;
}

OptimizerOptions OptimizerOptions::adamw(double lr, double weight_decay, double beta1, double beta2, double eps) {
  OptimizerOptions o;
  o.kind = Kind::AdamW;
  o.lr = lr;
  o.weight_decay = weight_decay;
  o.beta1 = beta1;
  o.beta2 = beta2;
  o.eps = eps;
  return o;
}

namespace {

using Impl = LoadedModel::Impl;

void require_training(const Impl& m, const char* what) {
  if (m.mode != LoweringMode::Training)
    throw Error(util::cat(what, ": this model was lowered for inference; build the Model with "
                                "LoweringMode::Training to train it"));
  if (!m.plan.training.enabled)
    throw Error(util::cat(what, ": the model has no loss output (name one with LoadOptions::loss, or give the "
                                "model exactly one scalar output)"));
}

// Visits every trainable parameter: (plan step index, parameter index, spec).
template <class F> void each_trainable(const Impl& m, F&& f) {
  for (std::size_t s = 0; s < m.plan.steps.size(); ++s) {
    const auto& st = m.plan.steps[s];
    for (std::size_t p = 0; p < st.specs.size(); ++p)
      if (m.grads[s][p].raw() != nullptr) f(s, p, st.specs[p]);
  }
}

void sync_grads(Impl& m) {
  m.exec->download_grads(m.grads);
}

}  // namespace

// Called by Model::load for models with a loss: host gradients (zero) for trainable parameters.
void init_training_state(Impl& m) {
  m.grads.clear();
  for (const auto& st : m.plan.steps) m.grads.emplace_back(st.specs.size());
  // Parameters a RuntimeOp declares for itself (added at load, after the backward plan) get none.
  for (const auto& b : m.plan.training.steps) {
    const auto& st = m.plan.steps[static_cast<std::size_t>(b.step)];
    for (std::size_t p = 0; p < b.want_param.size(); ++p)
      if (b.want_param[p]) m.grads[static_cast<std::size_t>(b.step)][p] = Tensor::zeros(st.specs[p].dtype, st.specs[p].shape);
  }
  m.grads_fresh = true;
  std::size_t bytes = 0;
  for (const auto& row : m.grads)
    for (const auto& g : row) bytes += g.raw() ? g.nbytes() : 0;
  m.plan.memory.grad_bytes = bytes;
  m.plan.memory.peak_bytes += bytes;
}

void init_data_parallel(Impl& m) {
  ProcessGroup& group = *m.options.process_group;
  if (m.mode != LoweringMode::Training || !m.plan.training.enabled)
    throw Error("LoadOptions::process_group is for data-parallel training: the model must be lowered with "
                "LoweringMode::Training and have a loss");
  if (m.options.bucket_bytes == 0) throw Error("LoadOptions::bucket_bytes is 0; expected a size in bytes");
  // Every rank starts from rank 0's parameters (trainable or not: BatchNorm's statistics too).
  for (auto& st : m.plan.steps)
    for (auto& p : st.params)
      if (p.raw() && p.nbytes()) group.broadcast(p.raw(), p.nbytes(), 0);
  m.exec->upload_params();
  m.sync = m.exec->make_gradient_sync(group.impl(), m.options.bucket_bytes);
}

std::string LoadedModel::loss_name() const { return impl_->loss_name; }

void LoadedModel::backward() {
  Impl& m = *impl_;
  require_training(m, "backward");
  if (!m.forward_ready)
    throw Error("backward: no forward() has run since the last backward (the activations it needs are gone)");
  m.forward_ready = false;
  const bool accumulate = !m.grads_fresh;
  std::vector<NodeTime>* prof = m.options.profile ? &m.last_profile : nullptr;
  m.exec->backward(accumulate, m.last_seed, m.last_training, prof, m.sync.get());
  m.grads_fresh = false;
}

void LoadedModel::zero_grad() {
  Impl& m = *impl_;
  require_training(m, "zero_grad");
  // The backend zeroes the gradients where they live: the host tensors on the CPU, device memory
  // on a GPU (whose host copies are only written by a download, so they are left alone: zeroing
  // them cost milliseconds of host time per step, with the GPU idle).
  m.exec->zero_grad();
  m.grads_fresh = true;
}

void LoadedModel::set_optimizer(const OptimizerOptions& options) {
  Impl& m = *impl_;
  require_training(m, "set_optimizer");
  plan::check_optimizer(options);
  m.optimizer = options;
  m.have_optimizer = true;
  m.optimizer_steps = 0;
  const auto names = plan::optimizer_slots(options);
  m.slots.assign(m.plan.steps.size(), {});
  for (std::size_t s = 0; s < m.plan.steps.size(); ++s) m.slots[s].resize(m.plan.steps[s].specs.size());
  std::size_t bytes = 0;
  each_trainable(m, [&](std::size_t s, std::size_t p, const ParamSpec& spec) {
    for (std::size_t k = 0; k < names.size(); ++k) {
      m.slots[s][p].push_back(Tensor::zeros(spec.dtype, spec.shape));
      bytes += m.slots[s][p].back().nbytes();
    }
  });
  m.plan.memory.peak_bytes += bytes - m.plan.memory.optimizer_bytes;
  m.plan.memory.optimizer_bytes = bytes;
  m.exec->reset_optimizer(options);
}

void LoadedModel::set_learning_rate(double lr) {
  Impl& m = *impl_;
  if (!m.have_optimizer) throw Error("set_learning_rate: no optimizer set (call set_optimizer first)");
  OptimizerOptions o = m.optimizer;
  o.lr = lr;
  plan::check_optimizer(o);
  m.optimizer = o;
}

void LoadedModel::step() {
  Impl& m = *impl_;
  require_training(m, "step");
  if (!m.have_optimizer) throw Error("step: no optimizer set (call set_optimizer first)");
  ++m.optimizer_steps;
  m.exec->step(m.optimizer, m.optimizer_steps);
}

Tensor LoadedModel::grad(const std::string& name) const {
  Impl& m = *impl_;
  require_training(m, "grad");
  sync_grads(m);
  for (std::size_t s = 0; s < m.plan.steps.size(); ++s) {
    const auto& st = m.plan.steps[s];
    for (std::size_t p = 0; p < st.specs.size(); ++p) {
      if (st.specs[p].name != name) continue;
      if (m.grads[s][p].raw() == nullptr)
        throw Error("grad: parameter '" + name + "' has no gradient (it is not trainable, or the loss does not depend on it)");
      return m.grads[s][p].clone();
    }
  }
  throw Error("grad: no parameter named '" + name + "' in the model");
}

std::map<std::string, Tensor> LoadedModel::gradients() const {
  Impl& m = *impl_;
  require_training(m, "gradients");
  sync_grads(m);
  std::map<std::string, Tensor> out;
  each_trainable(m, [&](std::size_t s, std::size_t p, const ParamSpec& spec) { out.emplace(spec.name, m.grads[s][p].clone()); });
  return out;
}

std::map<std::string, Tensor> LoadedModel::optimizer_state() const {
  Impl& m = *impl_;
  if (!m.have_optimizer) throw Error("optimizer_state: no optimizer set (call set_optimizer first)");
  m.exec->download_slots(m.slots);
  std::map<std::string, Tensor> out;
  const auto names = plan::optimizer_slots(m.optimizer);
  each_trainable(m, [&](std::size_t s, std::size_t p, const ParamSpec& spec) {
    for (std::size_t k = 0; k < names.size(); ++k) out.emplace(spec.name + "." + names[k], m.slots[s][p][k].clone());
  });
  out.emplace("step", Tensor::from_vector<std::int64_t>({}, {m.optimizer_steps}));
  return out;
}

void LoadedModel::load_optimizer_state(const std::map<std::string, Tensor>& state) {
  Impl& m = *impl_;
  if (!m.have_optimizer) throw Error("load_optimizer_state: no optimizer set (call set_optimizer first)");
  const auto names = plan::optimizer_slots(m.optimizer);
  std::vector<std::string> problems;
  std::map<std::string, bool> used;
  for (auto& [k, v] : state) used[k] = false;
  auto it = state.find("step");
  if (it == state.end() || it->second.numel() != 1 || is_floating(it->second.dtype()))
    problems.push_back("step: missing or not an integer scalar");
  else
    used["step"] = true;
  each_trainable(m, [&](std::size_t, std::size_t, const ParamSpec& spec) {
    for (const auto& slot : names) {
      const std::string key = spec.name + "." + slot;
      auto f = state.find(key);
      if (f == state.end())
        problems.push_back(key + ": missing");
      else if (f->second.shape() != spec.shape || !is_floating(f->second.dtype()))
        problems.push_back(util::cat(key, ": ", sizes_to_string(f->second.shape()), " ", dtype_name(f->second.dtype()),
                                     ", expected ", sizes_to_string(spec.shape), " ", dtype_name(spec.dtype)));
      else
        used[key] = true;
    }
  });
  for (auto& [k, u] : used)
    if (!u && k != "step") problems.push_back(k + ": not state of this optimizer");
  if (!problems.empty()) {
    std::string msg = "optimizer state does not match the model and optimizer:";
    for (const auto& p : problems) msg += "\n  " + p;
    throw Error(msg);
  }
  m.optimizer_steps = static_cast<std::int64_t>(state.at("step").item(0));
  each_trainable(m, [&](std::size_t s, std::size_t p, const ParamSpec& spec) {
    for (std::size_t k = 0; k < names.size(); ++k) {
      const Tensor& src = state.at(spec.name + "." + names[k]);
      Tensor conv = src.dtype() == spec.dtype ? src : src.to(spec.dtype);
      std::memcpy(m.slots[s][p][k].raw(), conv.raw(), conv.nbytes());
    }
  });
  m.exec->upload_slots(m.slots);
}

void LoadedModel::save_checkpoint(const std::string& path, const std::map<std::string, std::string>& metadata) const {
  std::map<std::string, Tensor> all = state_dict();
  if (impl_->have_optimizer)
    for (auto& [k, v] : optimizer_state()) all.emplace("optimizer/" + k, v);
  write_safetensors(path, all, metadata);
}

std::map<std::string, std::string> LoadedModel::load_checkpoint(const std::string& path) {
  std::map<std::string, std::string> meta;
  auto tensors = read_safetensors(path, &meta);
  std::map<std::string, Tensor> params, optim;
  const std::string prefix = "optimizer/";
  for (auto& [k, v] : tensors) {
    if (k.rfind(prefix, 0) == 0)
      optim.emplace(k.substr(prefix.size()), v);
    else
      params.emplace(k, v);
  }
  try {
    load_state_dict(params, true);
    if (impl_->have_optimizer) {
      if (optim.empty()) throw Error("the checkpoint has no optimizer state");
      load_optimizer_state(optim);
    }
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  }
  return meta;
}

}  // namespace kg
