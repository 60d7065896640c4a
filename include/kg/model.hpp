// From a recorded graph to something that runs: Model (graph + named outputs, optimised) and
// LoadedModel (buffers planned and allocated for concrete shapes on a device).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kg/graph.hpp"
#include "kg/runtime_op.hpp"
#include "kg/tensor.hpp"

namespace kg {

class ProcessGroup;

// Where a model runs.
struct Device {
  enum class Kind { Cpu, Cuda };
  Kind kind = Kind::Cpu;
  int index = 0;

  static Device cpu() { return {Kind::Cpu, 0}; }
  static Device cuda(int index = 0) { return {Kind::Cuda, index}; }
  // "cpu", "cuda", "cuda:1", or "auto" (cuda when a GPU is usable, else cpu).
  static Device parse(const std::string& s);
  // True when a CUDA GPU can be used by this build on this machine.
  static bool cuda_available();
  std::string to_string() const;
};

// A parameter of a model: full dotted name, sizes, dtype.
struct ParamInfo {
  std::string name;
  std::vector<std::int64_t> shape;
  DType dtype;
  bool trainable;
  int node;
};

struct LoadOptions {
  // Checked mode, for finding a broken op inside a whole model. On the cpu every lowered op runs
  // its kernels under the CUDA emulator in checked mode (guard pages, both thread orders) instead
  // of its cpu_forward; on cuda every buffer a launch touches gets guard regions with canaries.
  // On both, outputs are poisoned before each launch and verified after it: a canary overwritten,
  // an output element left unwritten or a fault is an error naming the op, the node, the kernel,
  // the buffer and the first bad index. Every op then needs a lowering, also on the cpu (an op
  // without one fails to load with the "not handled" error). Slow; unchecked runs are not
  // affected.
  bool checked = false;
  // Fill every planned buffer with NaN (or 0xFF bytes for integers) before each forward, so a
  // test can tell which output elements an op never wrote.
  bool poison_buffers = false;
  // Record per-node times of each forward (LoadedModel::profile()): on cuda CUDA events around
  // each node's launches (run without the CUDA graph), on cpu a clock around each node.
  bool profile = false;
  // Seed of the default parameter initialisation.
  std::uint64_t seed = 0;
  // Worker threads for CPU ops (0: one per core).
  int threads = 0;
  // On cuda: capture the whole forward into a CUDA graph at the first run and replay it; in
  // training also the whole backward, from the second run whose launches are the same as the
  // previous one's. Not while profiling, in checked mode, in a run whose launches change (a new
  // Dropout seed each run), or with a process group (the gradients' all-reduce overlaps the
  // backward).
  bool cuda_graph = true;
  // On cuda: run the matrix products and convolutions that describe a library call with cuBLASLt
  // and cuDNN where those libraries are present (the op's own kernels otherwise). The environment
  // variable KG_NO_VENDOR=1 turns this off too.
  bool vendor_libraries = true;
  // On cuda: f32 matrix products and convolutions may round their inputs to TF32 on tensor cores
  // (PyTorch's allow_tf32). Off: full f32.
  bool tf32 = false;
  // In inference, with vendor_libraries: keep activations channels-last ([N, H, W, C]) from one
  // convolution to the next where the library is faster on them, converting at the edges only
  // (node and parameter names do not change). On the CPU the f32 convolutions (oneDNN); on cuda
  // the f16 and bf16 ones, and f32 ones with tf32 (cuDNN on tensor cores). Off: every
  // convolution runs on the layout the model was recorded in.
  bool channels_last = true;
  // Time each vendor algorithm on the model's own shapes and keep the fastest (otherwise the
  // library's first choice): on cuda at load (cuBLASLt, cuDNN); on the CPU at the first forward
  // (oneDNN's convolution implementations, so that run takes a few times longer). On the CPU
  // in inference, the load also times running the batch in slices of 1, 2, 4 or 8 samples (one
  // plan for the slice, run over the batch's rows) where every op computes each sample from that
  // sample alone, and keeps the fastest; that load runs a few forwards on zeros (docs/cpu.md).
  bool tune = false;
  // Inference in a reduced precision: DType::F16 or DType::BF16 runs every op that can compute in
  // it (CustomOp::computes_in, and every elementwise op through a generated kernel) with its f32
  // parameters converted at load, and keeps f32 for the others (softmax, norms, losses), with casts
  // between. Inputs and outputs keep their recorded dtypes; state_dict() gives the converted
  // parameters, and weights load into them from files of any float dtype. DType::F32 (the
  // default): as recorded. Not for models lowered for training.
  DType precision = DType::F32;
  // Models lowered for training: the scalar output that LoadedModel::backward() starts from.
  // Empty: the only output of rank 0 (none or several: backward() is unavailable).
  std::string loss;
  // Data-parallel training (kg/distributed.hpp, docs/distributed.md): this load is one rank of
  // the group. Every rank loads the same training model for its shard of the global batch; the
  // load starts from rank 0's parameters, and backward() leaves every gradient averaged over the
  // ranks (MPI on the cpu, NCCL on cuda), so the same step() keeps the ranks equal.
  std::shared_ptr<ProcessGroup> process_group;
  // The gradients averaged by one all-reduce: a bucket starts once this many bytes of gradients
  // are final, while the backward goes on.
  std::size_t bucket_bytes = std::size_t{25} << 20;
};

// An optimiser for LoadedModel::step(), with PyTorch's update rules and defaults.
struct OptimizerOptions {
  enum class Kind { Sgd, AdamW };
  Kind kind = Kind::Sgd;
  double lr = 0.01;
  double momentum = 0.0;      // SGD: v = momentum·v + g; p -= lr·v
  double weight_decay = 0.0;  // SGD: added to the gradient (L2); AdamW: decoupled, p -= lr·wd·p
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // AdamW
  static OptimizerOptions sgd(double lr, double momentum = 0.0, double weight_decay = 0.0);
  static OptimizerOptions adamw(double lr = 1e-3, double weight_decay = 0.01, double beta1 = 0.9,
                                double beta2 = 0.999, double eps = 1e-8);
};

// The memory plan of a loaded model.
struct MemoryPlan {
  std::size_t arena_bytes = 0;      // activation arena, buffers shared by liveness
  std::size_t unshared_bytes = 0;   // what the activations would take without sharing
  std::size_t param_bytes = 0;      // parameters and buffers
  std::size_t grad_bytes = 0;       // parameter gradients (models with a loss)
  std::size_t optimizer_bytes = 0;  // optimiser state (after set_optimizer)
  std::size_t peak_bytes = 0;       // arena + parameters + gradients + optimiser state + outputs
  int buffers = 0;                  // activation buffers placed in the arena
  std::string to_string() const;
};

// Per-node time of the last profiled forward.
struct NodeTime {
  std::string node;
  std::string op;
  double ms;
  // What ran on cuda: the kernel module, or the vendor library and its algorithm (the tactic).
  std::string kernel = {};
};

class LoadedModel;

// How a recorded graph is optimised when a Model is made from it.
struct ModelOptions {
  // The fusion passes: a convolution's epilogue (inference) and groups of elementwise ops, the
  // user's included, each generated as one kernel (docs/fusion.md). False keeps every node its own
  // kernel, for comparison; so does the environment variable KG_NO_FUSION=1.
  bool fusion = true;
  // Attention chains of an imported graph (MatMul, scale, mask, Softmax, MatMul) become one
  // nn.attention node (inference; docs/fusion.md). False keeps the chain; so does the environment
  // variable KG_NO_ATTENTION_FUSION=1.
  bool attention = true;
};

// What the graph is lowered for. Inference fuses patterns that are only valid without
// gradients (BatchNorm folded into the convolution before it); Training keeps every node.
// A recorded graph with its outputs named, after the optimisation passes.
class Model {
 public:
  // `outputs` name the values the model returns, in this order.
  Model(std::shared_ptr<Graph> graph, std::vector<std::pair<std::string, SymTensor>> outputs,
        LoweringMode mode = LoweringMode::Inference, const ModelOptions& options = {});
  Model(std::shared_ptr<Graph> graph, const std::vector<SymTensor>& outputs,
        LoweringMode mode = LoweringMode::Inference, const ModelOptions& options = {});

  // Binds every dynamic dim from `input_shapes` (one per graph input, in order), re-runs shape
  // inference with concrete sizes (an op whose shape disagrees is named), plans and allocates
  // buffers and initialises parameters. Can be called again for other shapes.
  LoadedModel load(Device device, const std::vector<std::vector<std::int64_t>>& input_shapes,
                   const LoadOptions& options = {}) const;

  // The optimised graph that runs, and the graph as recorded.
  const Graph& graph() const { return *graph_; }
  const Graph& recorded_graph() const { return *recorded_; }
  LoweringMode mode() const { return mode_; }
  const std::vector<std::pair<std::string, int>>& outputs() const { return outputs_; }
  // Every parameter of the nodes the outputs depend on, in node order.
  std::vector<ParamInfo> parameters() const;
  // Node ids the outputs depend on, in topological order.
  const std::vector<int>& live_nodes() const { return live_; }

  // A table: node, op, dotted name, dtype, symbolic shape, parameter bytes.
  std::string summary() const;
  // Graphviz DOT of the graph.
  std::string to_dot() const;

 private:
  std::shared_ptr<Graph> recorded_, graph_;
  LoweringMode mode_;
  bool fused_ = true;  // the fusion passes ran
  // The faster of `full` and the same model run in batch slices (LoadOptions::tune, cpu).
  LoadedModel fastest_slices(LoadedModel& full, Device device,
                             const std::vector<std::vector<std::int64_t>>& input_shapes,
                             const LoadOptions& options) const;
  std::vector<std::pair<std::string, int>> outputs_;
  std::vector<int> live_;
};

// A model loaded on a device for concrete input shapes.
class LoadedModel {
 public:
  struct Impl;
  explicit LoadedModel(std::shared_ptr<Impl> impl);

  // Runs the model. `inputs` are in graph-input order with the shapes given to load().
  std::vector<Tensor> forward(const std::vector<Tensor>& inputs);
  // Runs the model on inputs that are already in the device's memory (on cuda, addresses in the
  // loaded device's memory; on cpu, host addresses), with the dtypes and shapes given to load().
  // Returns the outputs as views of the model's own buffers: valid until the next run, not to be
  // freed. Nothing is copied to or from the host; on cuda the call returns when the outputs are
  // ready.
  std::vector<DeviceTensor> forward_device(const std::vector<DeviceTensor>& inputs);
  // Time of the last forward on the device, in ms: on cuda, CUDA events around its launches (and
  // forward_device's copies of the inputs into the model's buffers; host copies excluded); on
  // cpu, the wall time of the run.
  double last_device_ms() const;
  // Forward and backward runs so far that were replayed from a CUDA graph (LoadOptions::
  // cuda_graph; 0 off the GPU).
  std::int64_t cuda_graph_replays() const;
  // Train mode (Dropout, BatchNorm batch statistics) or inference mode (default).
  void set_training(bool training);

  Device device() const;
  // Names of the outputs, in order.
  std::vector<std::string> output_names() const;
  // Concrete shapes of the inputs and outputs.
  std::vector<std::vector<std::int64_t>> input_shapes() const;
  std::vector<std::vector<std::int64_t>> output_shapes() const;
  // The memory plan.
  const MemoryPlan& memory_plan() const;
  // The graph this load runs: the model's, rewritten by the load's passes where they apply
  // (LoadOptions::precision's casts and 16-bit nodes, the CPU's channels-last region).
  const Graph& graph() const;
  // Per-node times of the last forward (empty unless LoadOptions::profile).
  std::vector<NodeTime> profile() const;

  // Parameters by full dotted name. On the cpu parameter() shares the model's storage: a write
  // into it before the next forward is seen by that forward (load_state_dict is the way to
  // change parameters later).
  std::vector<ParamInfo> parameters() const;
  Tensor parameter(const std::string& name) const;
  // Copies of every parameter, by name.
  std::map<std::string, Tensor> state_dict() const;
  // Replaces parameters by name. With `strict`, a missing, extra or mis-shaped tensor is an
  // error that lists all of them; float tensors are converted to the parameter's dtype.
  void load_state_dict(const std::map<std::string, Tensor>& tensors, bool strict = true);
  // Loads parameters from a safetensors file (strict).
  void load_weights(const std::string& path);
  // Writes every parameter to a safetensors file.
  void save_weights(const std::string& path) const;

  // ---- training (a Model lowered with LoweringMode::Training) ----
  // The output backward() starts from (LoadOptions::loss), or "" when there is none.
  std::string loss_name() const;
  // Adds the gradient of the loss of the last forward() to every trainable parameter's
  // gradient (zero_grad() clears them). Throws when no forward has run since the last
  // backward, or when the model has no loss.
  void backward();
  // Sets every parameter gradient to zero.
  void zero_grad();
  // Chooses the optimiser (its state starts empty) and changes the learning rate.
  void set_optimizer(const OptimizerOptions& options);
  void set_learning_rate(double lr);
  // One optimiser update of every trainable parameter from its gradient.
  void step();
  // The gradient of a trainable parameter, and all of them by name.
  Tensor grad(const std::string& name) const;
  std::map<std::string, Tensor> gradients() const;
  // Optimiser state ("<param>.momentum_buffer", "<param>.exp_avg", "<param>.exp_avg_sq",
  // "step") and its restoration (names and shapes must match the optimiser set).
  std::map<std::string, Tensor> optimizer_state() const;
  void load_optimizer_state(const std::map<std::string, Tensor>& state);
  // A checkpoint: parameters, optimiser state under "optimizer/<name>", and `metadata`, in one
  // safetensors file. load_checkpoint restores both and returns the metadata.
  void save_checkpoint(const std::string& path,
                       const std::map<std::string, std::string>& metadata = {}) const;
  std::map<std::string, std::string> load_checkpoint(const std::string& path);

 private:
  friend class Model;  // a tuned load sets up batch slices on the model it returns
  std::shared_ptr<Impl> impl_;
};

}  // namespace kg
