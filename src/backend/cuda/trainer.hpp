// The training half of the CUDA backend: backward launches of every op (from its
// lower_backward_source() and RuntimeOp), gradient sums, parameter gradients and optimiser
// state in device memory, and optimiser updates. Built only with the CUDA path.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/context.hpp"
#include "kg/model.hpp"
#include "lower/launch_check.hpp"
#include "lower/lowering.hpp"
#include "runtime/plan.hpp"

namespace kg::cuda {

class Trainer {
 public:
  // Compiles every backward source for the device, checks entries and blocks, and allocates
  // gradients. `params[s]` are the device addresses of plan.steps[s]'s parameters.
  Trainer(Context& ctx, const Graph& graph, const lower::LoweredGraph& lowered, const runtime::Plan& plan,
          DevicePtr arena, std::vector<DevicePtr> inputs, std::vector<std::vector<DevicePtr>> params);

  void backward(bool accumulate_params, std::uint64_t seed, bool training, std::vector<NodeTime>* profile);
  void zero_grad();
  void reset_optimizer(const OptimizerOptions& options);
  void step(const OptimizerOptions& options, std::int64_t step);
  void download_grads(std::vector<std::vector<Tensor>>& grads);
  void download_slots(std::vector<std::vector<std::vector<Tensor>>>& slots);
  void upload_slots(const std::vector<std::vector<std::vector<Tensor>>>& slots);

 private:
  struct Backward {
    const runtime::BackwardStep* step = nullptr;
    std::string label;
    std::shared_ptr<RuntimeOp> rt;
    std::vector<compile::PtxEntry> entries;
    std::vector<std::string> entry_names;      // per launch: PTX entry
    std::vector<std::vector<std::string>> arg_names;  // per launch: CUDA parameter names
    std::vector<CUfunction> fns;               // per launch
    DeviceBuffer scratch;
    BackwardTensors tensors;                   // addresses; params grads filled per run
    std::vector<DevicePtr> direct_param_grads, temp_param_grads;
  };
  void add(DevicePtr dst, DevicePtr src, std::int64_t n, const std::string& label);
  void launch_1d(CUfunction f, std::int64_t n, void** params, const std::string& label);

  Context& ctx_;
  const Graph& graph_;
  const runtime::Plan& plan_;
  DevicePtr arena_;
  std::vector<Backward> steps_;
  std::vector<std::vector<DeviceBuffer>> grads_;               // per plan step, parameter
  std::vector<std::vector<std::vector<DeviceBuffer>>> slots_;  // per plan step, parameter, slot
  std::vector<std::vector<DevicePtr>> params_;
  CUfunction fill_ = nullptr, add_ = nullptr, sgd_ = nullptr, adamw_ = nullptr;
};

}  // namespace kg::cuda
