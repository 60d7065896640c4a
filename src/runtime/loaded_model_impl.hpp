// What a LoadedModel holds.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/executor.hpp"
#include "backend/cuda/executor.hpp"
#include "kg/model.hpp"
#include "runtime/plan.hpp"

namespace kg {

struct LoadedModel::Impl {
  std::shared_ptr<Graph> graph;
  Device device;
  LoweringMode mode = LoweringMode::Inference;
  LoadOptions options;
  std::vector<std::string> output_names;
  runtime::Plan plan;
  Tensor arena;  // activation bytes
  std::unique_ptr<cpu::Executor> executor;      // device cpu
  std::unique_ptr<cuda::Executor> cuda;         // device cuda
  bool training = false;
  std::uint64_t runs = 0;
  std::vector<NodeTime> last_profile;
};

}  // namespace kg
