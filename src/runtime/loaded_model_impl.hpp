// What a LoadedModel holds.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/comm/gradient_sync.hpp"
#include "backend/executor.hpp"
#include "kg/model.hpp"
#include "plan/plan.hpp"

namespace kg {

struct LoadedModel::Impl {
  std::shared_ptr<Graph> graph;
  Device device;
  LoweringMode mode = LoweringMode::Inference;
  LoadOptions options;
  std::vector<std::string> output_names;
  plan::Plan plan;
  std::unique_ptr<backend::Executor> exec;  // the device's backend
  bool training = false;
  std::uint64_t runs = 0;
  std::vector<NodeTime> last_profile;
  double last_wall_ms = 0;             // of the last forward, for backends without a device clock
  std::vector<Tensor> device_outputs;  // cpu: what the last forward_device returned views of
  // Batch slices (cpu inference, chosen by LoadOptions::tune): the plan is for `slice` samples
  // and a forward runs it batch / slice times over the inputs' rows. 0: the plan is the batch's.
  std::int64_t batch = 0, slice = 0;
  std::vector<std::vector<std::int64_t>> batch_input_shapes, batch_output_shapes;

  // ---- training (plan.training.enabled) ----
  std::string loss_name;
  // Host gradients and optimiser state, per plan step and parameter (undefined tensors for
  // parameters without a gradient). The cpu backend works on them; cuda's mirror the device's
  // when asked for.
  std::vector<std::vector<Tensor>> grads;
  std::vector<std::vector<std::vector<Tensor>>> slots;  // per step, parameter, slot
  bool grads_fresh = true;     // zero since zero_grad(): backward writes instead of adding
  bool forward_ready = false;  // a forward ran since the last backward
  std::uint64_t last_seed = 0;
  bool last_training = false;
  bool have_optimizer = false;
  OptimizerOptions optimizer;
  std::int64_t optimizer_steps = 0;

  // ---- data-parallel training (LoadOptions::process_group) ----
  // Declared last: it refers to the executor's gradients and goes before them.
  std::unique_ptr<comm::GradientSync> sync;
};

// Zeroed host gradients for every trainable parameter a backward step reaches.
void init_training_state(LoadedModel::Impl& m);
// Data-parallel training: rank 0's parameters on every rank, and the gradient sync.
void init_data_parallel(LoadedModel::Impl& m);

}  // namespace kg
