// The executable plan of a loaded model: values (node outputs) with their storage, and steps.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kg/model.hpp"
#include "plan/memory_plan.hpp"

namespace kg::plan {

// The seed an op node gets in the run seeded `seed`: its CPU forward and backward, its
// run-dependent launches and its backward launches all see this one.
inline std::uint64_t node_seed(std::uint64_t seed, int node) {
  return seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(node);
}

// Where a node's output lives.
struct Value {
  std::vector<std::int64_t> shape;
  DType dtype = DType::F32;
  int root = -1;          // node id owning the storage (itself unless a view)
  int input_index = -1;   // graph-input position when the storage is a model input
  std::size_t offset = 0; // arena offset when it is not an input
  std::size_t view_bytes = 0;  // a view of a part of its input: where it starts in the root's bytes
  std::size_t bytes() const { return static_cast<std::size_t>(numel_of(shape)) * dtype_size(dtype); }
};

// One op node to execute.
struct Step {
  int node = -1;
  std::vector<ParamSpec> specs;  // full names; the node's, plus any its RuntimeOp declares on cuda
  std::vector<Tensor> params;    // host values, one per spec
};

// A gradient contribution of one backward step to one of its inputs.
struct GradTarget {
  int root = -1;                 // storage root whose gradient it is (-1: not wanted)
  bool accumulate = false;       // written into `temp_offset`, then added to the root's gradient
  std::size_t temp_offset = 0;   // arena offset of the temporary (when accumulate)
};

// One op's backward, in the order backward runs (reverse topological).
struct BackwardStep {
  int step = -1;                     // index in Plan::steps
  int node = -1;
  std::vector<GradTarget> inputs;    // one per node input
  std::vector<bool> want_param;      // one per parameter spec (trainable and needed)
  std::vector<std::size_t> param_temp_offsets;  // per parameter: arena temporary (accumulation)
  BackwardSaves saves;
};

// The backward half of a plan (models lowered for training that have a loss).
struct TrainingPlan {
  bool enabled = false;
  int loss_node = -1;                    // node id of the loss output
  std::vector<BackwardStep> steps;
  std::vector<std::size_t> grad_offset;  // by root node id: arena offset of its gradient
  std::vector<char> has_grad;            // by root node id
  std::vector<int> zero_roots;           // gradients read but never written: zeroed first
  // Arena requests of the gradients and temporaries (placed by place_in_arena), and where
  // each offset goes: a root's gradient, an input temporary, a parameter temporary.
  struct Target {
    enum class Kind { Grad, InputTemp, ParamTemp } kind;
    int a = 0, b = 0;  // root id; or backward step and input/parameter index
  };
  std::vector<BufferRequest> requests;
  std::vector<Target> targets;
};

struct Plan {
  std::vector<Value> values;  // by node id (dead nodes have root -1)
  std::vector<Step> steps;    // topological order; view nodes are not steps
  std::vector<int> outputs;   // node ids of the model outputs
  std::vector<int> live;      // node ids in execution order (inputs included)
  std::vector<int> first, last;  // by node id: lifetime of a storage root in live-order steps
  std::vector<int> step_of;      // by node id: position in `live`
  MemoryPlan memory;
  TrainingPlan training;
};

// The arena offset of the gradient of node `id`'s value: its storage root's gradient, at the
// value's place in the root (a view of a part of a packed value has its part of the gradient).
inline std::size_t grad_offset_of(const Plan& plan, int id) {
  const Value& v = plan.values[static_cast<std::size_t>(id)];
  return plan.training.grad_offset[static_cast<std::size_t>(v.root)] + v.view_bytes;
}

}  // namespace kg::plan
