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
  // every call can be planned. With `cuda_graph`, a backward whose launches are the same as the
  // previous run's is captured into a CUDA graph and replayed while they stay the same.
  Trainer(Context& ctx, const Graph& graph, const lower::LoweredGraph& lowered, const plan::Plan& plan,
          DevicePtr arena, std::vector<DevicePtr> inputs, std::vector<std::vector<DevicePtr>> params,
          bool checked, std::optional<VendorOptions> vendor, bool cuda_graph);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Describes the next backward's launches ahead (for the seed and mode of the forward just
  // enqueued, and the parameter-gradient mode of the last backward), so that backward() only
  // compares and launches them: the executor calls it while the GPU runs the forward.
  void prepare(std::uint64_t seed, bool training);
  // With `sync`, each step's parameter gradients are handed to it once their work is enqueued
  // (never from a CUDA graph).
  void backward(bool accumulate_params, std::uint64_t seed, bool training, std::vector<NodeTime>* profile,
                comm::GradientSync* sync);
  // Backward runs replayed from a CUDA graph so far (for tests and benchmarks).
  std::int64_t graph_replays() const { return graph_replays_; }
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
  // A backward as one CUDA graph, for one value of accumulate_params: the launches it was
  // captured with (per step; empty for library steps), and whether they were seen twice in a row.
  struct Captured {
    std::vector<std::vector<lower::CheckedLaunch>> launches;
    bool described = false;
    CUgraph graph = nullptr;
    CUgraphExec exec = nullptr;
  };
  // The launches of every step for this run (library steps: none).
  std::vector<std::vector<lower::CheckedLaunch>> describe(bool accumulate_params, std::uint64_t seed,
                                                          bool training);
  // Enqueues the whole backward on the stream.
  void enqueue(bool accumulate_params, const std::vector<std::vector<lower::CheckedLaunch>>& launches,
               std::vector<NodeTime>* profile, comm::GradientSync* sync);
  // Captures enqueue() into c and launches it; false (nothing enqueued, graphs off from now on) when
  // the driver or a library refuses the capture.
  bool capture_and_launch(Captured& c, bool accumulate_params);
  void release(Captured& c);
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
  bool cuda_graph_ = true;
  Captured captured_[2];  // by accumulate_params
  // What prepare() described, and for which arguments.
  struct Prepared {
    bool accumulate_params = false, training = false;
    std::uint64_t seed = 0;
    std::vector<std::vector<lower::CheckedLaunch>> launches;
  };
  std::optional<Prepared> prepared_;
  bool last_accumulate_ = false;  // the last backward's accumulate_params
  std::int64_t graph_replays_ = 0;
  CUfunction fill_ = nullptr, add_ = nullptr, sgd_ = nullptr, adamw_ = nullptr;
  DeviceBuffer workspace_;  // shared by the library calls
};

}  // namespace kg::cuda
