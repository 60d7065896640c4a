// Runs a plan's steps on the CPU, in topological order. An op without a CPU implementation (the
// default CustomOp::cpu_forward) runs its lowered kernel through the CUDA emulator instead.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "backend/cpu/thread_pool.hpp"
#include "kg/model.hpp"
#include "runtime/plan.hpp"

namespace kg::cpu {

class Executor {
 public:
  // `threads` 0: the process-wide pool.
  explicit Executor(int threads);
  // Executes every step. `inputs` are the bound model inputs, `arena` the activation bytes.
  // Errors from an op are rethrown prefixed with its node's label.
  void run(const Graph& graph, runtime::Plan& plan, const std::vector<Tensor>& inputs, void* arena,
           bool training, std::uint64_t seed, std::vector<NodeTime>* profile);
  // Runs the backward steps of plan.training: seeds the loss gradient with 1, runs each op's
  // backward (CPU, else its lowered backward kernels through the emulator) and sums gradients.
  // `param_grads[s][p]` is the gradient of plan.steps[s]'s parameter p (undefined when not
  // trainable); with `accumulate_params` contributions are added to it, else written. `seed`
  // and `training` must be the forward's.
  void run_backward(const Graph& graph, runtime::Plan& plan, const std::vector<Tensor>& inputs, void* arena,
                    std::vector<std::vector<Tensor>>& param_grads, bool accumulate_params, bool training,
                    std::uint64_t seed, std::vector<NodeTime>* profile);
  // The tensor of a node's output (a view into the arena or an input).
  static Tensor value_tensor(const runtime::Plan& plan, int node, const std::vector<Tensor>& inputs,
                             void* arena);
  ThreadPool& pool() { return own_ ? *own_ : ThreadPool::global(); }

  // What an emulated node keeps between runs (its lowering, compiled kernel, parameters).
  struct EmulatedNode;
  // The lowering and backward source of an op whose backward runs emulated, taken once.
  struct EmulatedBackward {
    Lowered lowered;
    std::string source;
  };

 private:
  std::unique_ptr<ThreadPool> own_;
  std::map<int, std::shared_ptr<EmulatedNode>> emulated_;  // by node id
  std::map<int, EmulatedBackward> emulated_backward_;  // by node id
};

}  // namespace kg::cpu
