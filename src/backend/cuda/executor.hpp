// Runs a lowered plan on a GPU: compiled kernels, device buffers, checked argument packs, and
// optional CUDA-graph replay. This header needs no CUDA headers.
#pragma once

#include <memory>
#include <vector>

#include "kg/model.hpp"
#include "plan/plan.hpp"

namespace kg::lower {
struct LoweredGraph;
}

namespace kg::cuda {

// True when a GPU is usable by this build on this machine.
bool available();

class Executor {
 public:
  virtual ~Executor() = default;
  // Uploads inputs, runs every step, downloads the outputs.
  // `seed` is the run's (see plan::node_seed).
  virtual std::vector<Tensor> run(const std::vector<Tensor>& inputs, bool training, std::uint64_t seed,
                                  std::vector<NodeTime>* profile) = 0;
  // Copies host parameter values (plan.steps[].params) to the device.
  virtual void upload_params() = 0;
  // Copies device parameter values back to the host tensors.
  virtual void download_params() = 0;

  // ---- training (plan.training.enabled) ----
  // Runs the backward of the last run (see cpu::Executor::run_backward).
  virtual void backward(bool accumulate_params, std::uint64_t seed, bool training,
                        std::vector<NodeTime>* profile) = 0;
  virtual void zero_grad() = 0;
  // One optimiser update at step `step` (1-based); state starts at zero after reset_optimizer.
  virtual void step(const OptimizerOptions& options, std::int64_t step) = 0;
  virtual void reset_optimizer(const OptimizerOptions& options) = 0;
  // Device gradients and optimiser state into / from host tensors shaped like the impl's.
  virtual void download_grads(std::vector<std::vector<Tensor>>& grads) = 0;
  virtual void download_slots(std::vector<std::vector<std::vector<Tensor>>>& slots) = 0;
  virtual void upload_slots(const std::vector<std::vector<std::vector<Tensor>>>& slots) = 0;
};

// Compiles every executable for the device's architecture, checks the launches, plans and
// allocates device memory and uploads parameters; fills plan.memory. With LoadOptions::checked
// every launch is verified (guard canaries, poisoned outputs) after it runs.
std::unique_ptr<Executor> make_executor(int device, const Graph& graph, const lower::LoweredGraph& lowered,
                                        plan::Plan& plan, const LoadOptions& options);

}  // namespace kg::cuda
