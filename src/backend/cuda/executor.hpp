// Runs a lowered plan on a GPU: compiled kernels, device buffers, checked argument packs, and
// optional CUDA-graph replay. This header needs no CUDA headers.
#pragma once

#include <memory>
#include <vector>

#include "kg/model.hpp"
#include "runtime/plan.hpp"

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
  virtual std::vector<Tensor> run(const std::vector<Tensor>& inputs, bool training,
                                  std::vector<NodeTime>* profile) = 0;
  // Copies host parameter values (plan.steps[].params) to the device.
  virtual void upload_params() = 0;
  // Copies device parameter values back to the host tensors.
  virtual void download_params() = 0;
};

// Compiles every executable for the device's architecture, checks the launches, plans and
// allocates device memory and uploads parameters. Adds RuntimeOp-declared parameters to
// `plan` and fills plan.memory.
std::unique_ptr<Executor> make_executor(int device, const Graph& graph, const lower::LoweredGraph& lowered,
                                        runtime::Plan& plan, const LoadOptions& options);

}  // namespace kg::cuda
