// The executable plan of a loaded model: values (node outputs) with their storage, and steps.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kg/model.hpp"

namespace kg::runtime {

// Where a node's output lives.
struct Value {
  std::vector<std::int64_t> shape;
  DType dtype = DType::F32;
  int root = -1;          // node id owning the storage (itself unless a view)
  int input_index = -1;   // graph-input position when the storage is a model input
  std::size_t offset = 0; // arena offset when it is not an input
  std::size_t bytes() const { return static_cast<std::size_t>(numel_of(shape)) * dtype_size(dtype); }
};

// One op node to execute.
struct Step {
  int node = -1;
  std::vector<ParamSpec> specs;  // full names; the node's, plus any its RuntimeOp declares on cuda
  std::vector<Tensor> params;    // host values, one per spec
};

struct Plan {
  std::vector<Value> values;  // by node id (dead nodes have root -1)
  std::vector<Step> steps;    // topological order; view nodes are not steps
  std::vector<int> outputs;   // node ids of the model outputs
  std::vector<int> live;      // node ids in execution order (inputs included)
  std::vector<int> first, last;  // by node id: lifetime of a storage root in live-order steps
  std::vector<int> step_of;      // by node id: position in `live`
  MemoryPlan memory;
};

}  // namespace kg::runtime
