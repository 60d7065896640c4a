// LoadedModel's training half: backward, gradients, optimiser steps and checkpoints.
#include "kg/error.hpp"
#include "kg/model.hpp"
#include "runtime/loaded_model_impl.hpp"

namespace kg {

namespace {
[[noreturn]] void pending(const char* what) { throw Error(std::string(what) + ": training runtime not built yet"); }
}  // namespace

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

std::string LoadedModel::loss_name() const { pending("loss_name"); }
void LoadedModel::backward() { pending("backward"); }
void LoadedModel::zero_grad() { pending("zero_grad"); }
void LoadedModel::set_optimizer(const OptimizerOptions&) { pending("set_optimizer"); }
void LoadedModel::set_learning_rate(double) { pending("set_learning_rate"); }
void LoadedModel::step() { pending("step"); }
Tensor LoadedModel::grad(const std::string&) const { pending("grad"); }
std::map<std::string, Tensor> LoadedModel::gradients() const { pending("gradients"); }
std::map<std::string, Tensor> LoadedModel::optimizer_state() const { pending("optimizer_state"); }
void LoadedModel::load_optimizer_state(const std::map<std::string, Tensor>&) { pending("load_optimizer_state"); }
void LoadedModel::save_checkpoint(const std::string&, const std::map<std::string, std::string>&) const {
  pending("save_checkpoint");
}
std::map<std::string, std::string> LoadedModel::load_checkpoint(const std::string&) { pending("load_checkpoint"); }

}  // namespace kg
