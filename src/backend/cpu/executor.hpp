// Runs a plan's steps on the CPU, in topological order. An op without a CPU implementation (the
// default CustomOp::cpu_forward) runs its lowered kernel through the CUDA emulator instead.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "backend/executor.hpp"
#include "kg/model.hpp"
#include "lower/launch_plan.hpp"
#include "lower/lowering.hpp"
#include "plan/plan.hpp"
#include "util/thread_pool.hpp"

namespace kg::cpu {

using util::ThreadPool;

class Executor {
 public:
  // `threads` 0: the process-wide pool. `lowered` is the model's lowering for the emulator (nodes
  // whose op gave none are marked so). `checked`: every lowered op runs its kernels under the
  // emulator in checked mode, outputs poisoned and verified (LoadOptions::checked).
  Executor(int threads, lower::LoweredGraph lowered, bool checked);
  ~Executor();
  // Executes every step. `inputs` are the bound model inputs, `arena` the activation bytes.
  // Errors from an op are rethrown prefixed with its node's label. The steps' tensors are built
  // at the first run for the plan and arena and reused after, so that a run allocates nothing
  // of its own (an op's implementation may). Before the steps, the calling thread's OpenMP
  // thread count (oneDNN's runtime) and OpenBLAS's are set to the pool's size.
  void run(const Graph& graph, plan::Plan& plan, const std::vector<Tensor>& inputs, void* arena,
           bool training, std::uint64_t seed, std::vector<NodeTime>* profile);
  // Runs the backward steps of plan.training: seeds the loss gradient with 1, runs each op's
  // backward (CPU, else its lowered backward kernels through the emulator) and sums gradients.
  // `param_grads[s][p]` is the gradient of plan.steps[s]'s parameter p (undefined when not
  // trainable); with `accumulate_params` contributions are added to it, else written. `seed`
  // and `training` must be the forward's.
  void run_backward(const Graph& graph, plan::Plan& plan, const std::vector<Tensor>& inputs, void* arena,
                    std::vector<std::vector<Tensor>>& param_grads, bool accumulate_params, bool training,
                    std::uint64_t seed, std::vector<NodeTime>* profile,
                    comm::GradientSync* sync = nullptr);
  // The tensor of a node's output (a view into the arena or an input).
  static Tensor value_tensor(const plan::Plan& plan, int node, const std::vector<Tensor>& inputs,
                             void* arena);
  ThreadPool& pool() { return own_ ? *own_ : ThreadPool::global(); }

  // What an emulated node keeps between runs (its kernel module, scratch).
  struct EmulatedNode;
  // A step's tensors and what it runs, kept between runs (executor.cpp).
  struct Prepared;

 private:
  const lower::Executable* executable(int node) const;
  void prepare_steps(const Graph& graph, const plan::Plan& plan, void* arena);
  // Sets the thread counts of the libraries an op may call (OpenMP, OpenBLAS) to the pool's.
  void configure_library_threads();
  std::unique_ptr<ThreadPool> own_;
  lower::LoweredGraph lowered_;
  std::map<int, const lower::Executable*> by_node_;
  bool checked_ = false;
  std::map<int, std::shared_ptr<EmulatedNode>> emulated_;  // by node id
  std::map<int, lower::KernelModule> emulated_backward_;   // by node id
  std::vector<Prepared> prepared_;                         // by step, for prepared_for_
  struct {
    const Graph* graph = nullptr;
    const plan::Plan* plan = nullptr;
    const void* arena = nullptr;
  } prepared_for_;
};

// The cpu backend behind backend::Executor: places the activations in a host arena (fills
// plan.memory) and runs the model with an Executor. Parameter gradients and optimiser state are
// the host tensors LoadedModel owns (`grads`, `slots`, filled by it after this returns; this
// keeps references), so their uploads and downloads are no-ops here.
std::unique_ptr<backend::Executor> make_executor(const Graph& graph, plan::Plan& plan,
                                                 lower::LoweredGraph lowered, const LoadOptions& options,
                                                 std::vector<std::vector<Tensor>>& grads,
                                                 std::vector<std::vector<std::vector<Tensor>>>& slots);

}  // namespace kg::cpu
