// Runs a plan's steps on the CPU, in topological order.
#pragma once

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
  // The tensor of a node's output (a view into the arena or an input).
  static Tensor value_tensor(const runtime::Plan& plan, int node, const std::vector<Tensor>& inputs,
                             void* arena);
  ThreadPool& pool() { return own_ ? *own_ : ThreadPool::global(); }

 private:
  std::unique_ptr<ThreadPool> own_;
};

}  // namespace kg::cpu
