// The training half of the CUDA backend: backward launches of every op (from its
// lower_backward_source() and RuntimeOp), gradient sums, parameter gradients and optimiser
// state in device memory, and optimiser updates. Built only with the CUDA path.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/comm/gradient_sync.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/vendor.hpp"
#include "kg/model.hpp"
#include "lower/launch_plan.hpp"
#include "lower/lowering.hpp"
#include "plan/plan.hpp"

namespace kg::cuda {

class Trainer {
 public:
  // Compiles every backward source for the device, checks entries and blocks, and allocates
  // gradients. `params[s]` are the device addresses of plan.steps[s]'s parameters.
  // With `vendor`, an op whose backward describes library calls runs them (cuBLASLt, cuDNN) when
  // every call can be planned.
  Trainer(Context& ctx, const Graph& graph, const lower::LoweredGraph& lowered, const plan::Plan& plan,
          DevicePtr arena, std::vector<DevicePtr> inputs, std::vector<std::vector<DevicePtr>> params,
          bool checked, std::optional<VendorOptions> vendor);

  // With `sync`, each step's parameter gradients are handed to it once their work is enqueued.
  void backward(bool accumulate_params, std::uint64_t seed, bool training, std::vector<NodeTime>* profile,
                comm::GradientSync* sync);
  // The parameter gradients per plan step and parameter (ptr 0 where there is none).
  std::vector<std::vector<DeviceTensor>> gradient_tensors() const;
  void zero_grad();
  void reset_optimizer(const OptimizerOptions& options);
  void step(const OptimizerOptions& options, std::int64_t step);
  void download_grads(std::vector<std::vector<Tensor>>& grads);
  void download_slots(std::vector<std::vector<std::vector<Tensor>>>& slots);
  void upload_slots(const std::vector<std::vector<std::vector<Tensor>>>& slots);

 private:
  struct Backward {
    const plan::BackwardStep* step = nullptr;
    std::string label;
    std::shared_ptr<RuntimeOp> rt;
    lower::KernelModule module;             // the backward source, compiled
    std::map<std::string, CUfunction> fns;  // by PTX entry
    DeviceBuffer scratch;
    LaunchTensors tensors;  // addresses; parameter gradients filled per run
    std::vector<DevicePtr> direct_param_grads, temp_param_grads;
    // The vendor-library path, planned for the parameter gradients written directly [0] and into
    // the temporaries that are then added [1]; empty when the op runs its backward launches.
    struct Library {
      std::vector<std::unique_ptr<VendorPlan>> plans;
      std::vector<std::vector<lower::CheckedLaunch>> epilogues;  // per call
      std::vector<lower::CheckedLaunch> launches;
    };
    std::vector<Library> library;
  };
  // Plans bw's library path for both parameter-gradient addresses, or leaves it empty.
  void plan_library(Backward& bw, const VendorOptions& vendor);
  void launch_checked(Backward& bw, const lower::CheckedLaunch& L);
  void add(DevicePtr dst, DevicePtr src, std::int64_t n, const std::string& label);
  void launch_1d(CUfunction f, std::int64_t n, void** params, const std::string& label);

  Context& ctx_;
  const Graph& graph_;
  const plan::Plan& plan_;
  DevicePtr arena_;
  std::vector<Backward> steps_;
  std::vector<std::vector<DeviceBuffer>> grads_;               // per plan step, parameter
  std::vector<std::vector<std::vector<DeviceBuffer>>> slots_;  // per plan step, parameter, slot
  std::vector<std::vector<DevicePtr>> params_;
  bool checked_ = false;  // synchronise after each backward step, so a fault names its op
  CUfunction fill_ = nullptr, add_ = nullptr, sgd_ = nullptr, adamw_ = nullptr;
  DeviceBuffer workspace_;  // shared by the library calls
};

}  // namespace kg::cuda
