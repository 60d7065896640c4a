// Runs a lowered plan on a GPU: compiled kernels, device buffers, checked argument packs, and
// optional CUDA-graph replay. This header needs no CUDA headers.
#pragma once

#include <memory>
#include <vector>

#include "backend/executor.hpp"
#include "kg/model.hpp"
#include "plan/plan.hpp"

namespace kg::lower {
struct LoweredGraph;
}

namespace kg::cuda {

// True when a GPU is usable by this build on this machine.
bool available();
// True when cuDNN opens here (convolutions can take its tensor-core algorithms).
bool convolution_library_available();

// Compiles every executable for the device's architecture, checks the launches, plans and
// allocates device memory and uploads parameters; fills plan.memory. With LoadOptions::checked
// every launch is verified (guard canaries, poisoned outputs) after it runs.
std::unique_ptr<backend::Executor> make_executor(int device, const Graph& graph, const lower::LoweredGraph& lowered,
                                        plan::Plan& plan, const LoadOptions& options);

}  // namespace kg::cuda
