// What runs a loaded model, whatever the device: the cpu backend and the cuda backend implement
// this one interface (cpu::make_executor, cuda::make_executor), and LoadedModel talks to it alone.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string_view>
#include <vector>

#include "backend/comm/gradient_sync.hpp"
#include "kg/error.hpp"
#include "kg/model.hpp"

namespace kg::backend {

// True when KG_NO_VENDOR is set to anything but "" or "0": every op then runs on kernelgraph's
// own kernels (no cuBLASLt or cuDNN on cuda, no oneDNN on the cpu), as with
// LoadOptions::vendor_libraries = false.
inline bool vendor_libraries_disabled_by_env() {
  const char* v = std::getenv("KG_NO_VENDOR");
  return v && *v && std::string_view(v) != "0";
}

class Executor {
 public:
  virtual ~Executor() = default;
  // Runs every step on `inputs` (graph-input order, the loaded shapes) and returns the outputs.
  // `seed` is the run's (see plan::node_seed).
  virtual std::vector<Tensor> run(const std::vector<Tensor>& inputs, bool training, std::uint64_t seed,
                                  std::vector<NodeTime>* profile) = 0;
  // Runs every step on inputs already in the device's memory (cuda only: the cpu path is
  // LoadedModel's) and returns views of the output buffers, valid until the next run.
  virtual std::vector<DeviceTensor> run_device(const std::vector<DeviceTensor>&, bool, std::uint64_t,
                                               std::vector<NodeTime>*) {
    throw Error("forward_device: this backend runs on host tensors");
  }
  // Device time of the last run in ms, or a negative value where the backend has no clock of its own.
  virtual double last_device_ms() const { return -1; }
  // Forward and backward runs replayed from a CUDA graph so far (0 where there is none).
  virtual std::int64_t cuda_graph_replays() const { return 0; }
  // Host parameter values (plan.steps[].params) to the device's copy, and back (no-ops where the
  // host tensors are the parameters).
  virtual void upload_params() = 0;
  virtual void download_params() = 0;

  // ---- training (plan.training.enabled) ----
  // The backward of the last run: parameter gradients written, or added with `accumulate_params`.
  // `seed` and `training` are the forward's. With `sync` (data-parallel training), each plan
  // step's parameter gradients are handed to it as they become final, and sync->finish() runs
  // after the last.
  virtual void backward(bool accumulate_params, std::uint64_t seed, bool training,
                        std::vector<NodeTime>* profile, comm::GradientSync* sync) = 0;
  // What averages this backend's parameter gradients over `group`'s ranks: MPI on host memory,
  // NCCL on a GPU's.
  virtual std::unique_ptr<comm::GradientSync> make_gradient_sync(comm::Group& group,
                                                                 std::size_t bucket_bytes) = 0;
  // Zeroes the parameter gradients where this backend keeps them (host tensors, device memory).
  virtual void zero_grad() = 0;
  // One optimiser update at step `step` (1-based); state starts at zero after reset_optimizer.
  virtual void step(const OptimizerOptions& options, std::int64_t step) = 0;
  virtual void reset_optimizer(const OptimizerOptions& options) = 0;
  // The device's gradients and optimiser state into / from the host tensors of LoadedModel.
  virtual void download_grads(std::vector<std::vector<Tensor>>& grads) = 0;
  virtual void download_slots(std::vector<std::vector<std::vector<Tensor>>>& slots) = 0;
  virtual void upload_slots(const std::vector<std::vector<std::vector<Tensor>>>& slots) = 0;
};

}  // namespace kg::backend
