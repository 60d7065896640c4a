#include "backend/cuda/executor.hpp"

#include <chrono>
#include <cstring>
#include <algorithm>

#include "kg/error.hpp"
#include "kg/runtime_op.hpp"
#include "lower/lowering.hpp"
#include "util/str.hpp"

#ifdef KG_HAVE_CUDA
#include "backend/cuda/context.hpp"
#include "backend/cuda/trainer.hpp"
#include "lower/launch_plan.hpp"
#endif

namespace kg::cuda {

#ifndef KG_HAVE_CUDA

bool available() { return false; }

std::unique_ptr<Executor> make_executor(int, const Graph&, const lower::LoweredGraph&, runtime::Plan&,
                                        const LoadOptions&) {
  throw Error("device cuda: this build has no CUDA path (configured without the CUDA toolkit)");
}

#else

bool available() { return Driver::get() != nullptr; }

namespace {

class GpuExecutor final : public Executor {
 public:
  GpuExecutor(int device, const Graph& graph, const lower::LoweredGraph& lowered, runtime::Plan& plan,
              const LoadOptions& options);
  ~GpuExecutor() override;
  std::vector<Tensor> run(const std::vector<Tensor>& inputs, bool training, std::uint64_t seed,
                          std::vector<NodeTime>* profile) override;
  void upload_params() override;
  void download_params() override;
  void backward(bool accumulate_params, std::uint64_t seed, bool training, std::vector<NodeTime>* profile) override {
    trainer().backward(accumulate_params, seed, training, profile);
  }
  void zero_grad() override { trainer().zero_grad(); }
  void step(const OptimizerOptions& o, std::int64_t step) override { trainer().step(o, step); }
  void reset_optimizer(const OptimizerOptions& o) override { trainer().reset_optimizer(o); }
  void download_grads(std::vector<std::vector<Tensor>>& g) override { trainer().download_grads(g); }
  void download_slots(std::vector<std::vector<std::vector<Tensor>>>& s) override { trainer().download_slots(s); }
  void upload_slots(const std::vector<std::vector<std::vector<Tensor>>>& s) override { trainer().upload_slots(s); }

 private:
  struct Step {
    const runtime::Step* plan_step;
    CUfunction fn = nullptr;
    std::vector<DeviceBuffer> params;
    std::vector<std::vector<void*>> kparams;  // per launch, into lp_.steps[i].launches[l].args
  };
  DevicePtr value_ptr(int node) const;
  void launch_all();
  // Packs the launches that depend on the run again; true when any was.
  bool repack_for_run(bool training, std::uint64_t seed);
  Trainer& trainer() {
    if (!trainer_) throw Error("cuda: the model has no training plan");
    return *trainer_;
  }

  Context& ctx_;
  const Graph& graph_;
  runtime::Plan& plan_;
  LoadOptions options_;
  lower::LaunchPlan lp_;
  DeviceBuffer arena_;
  std::vector<DeviceBuffer> inputs_;
  std::vector<DevicePtr> input_ptrs_;
  std::vector<Step> steps_;
  CUgraph graph_handle_ = nullptr;
  CUgraphExec graph_exec_ = nullptr;
  std::vector<std::string> eval_only_;  // labels of ops whose kernels have no train mode
  bool any_run_dependent_ = false;
  bool packed_training_ = false;        // the mode the run-dependent launches are packed for
  std::unique_ptr<Trainer> trainer_;
};

GpuExecutor::GpuExecutor(int device, const Graph& graph, const lower::LoweredGraph& lowered, runtime::Plan& plan,
                         const LoadOptions& options)
    : ctx_(Context::get(device)), graph_(graph), plan_(plan), options_(options) {
  lp_ = lower::size_launches(graph, lowered, plan, options.seed);
  arena_ = DeviceBuffer(ctx_, std::max<std::size_t>(lp_.arena_bytes, 1));
  for (int id : graph.inputs()) {
    inputs_.emplace_back(ctx_, plan.values[static_cast<std::size_t>(id)].bytes());
    input_ptrs_.push_back(inputs_.back().ptr());
  }
  std::vector<std::vector<DevicePtr>> param_ptrs;
  for (const auto& ps : plan.steps) {
    Step st;
    st.plan_step = &ps;
    std::vector<DevicePtr> ptrs;
    for (const Tensor& t : ps.params) {
      st.params.emplace_back(ctx_, t.nbytes());
      ctx_.upload(st.params.back().ptr(), t.raw(), t.nbytes());
      ptrs.push_back(st.params.back().ptr());
    }
    param_ptrs.push_back(ptrs);
    steps_.push_back(std::move(st));
  }
  lower::pack_launches(lp_, graph, lowered, plan, ctx_.arch(), arena_.ptr(), input_ptrs_, param_ptrs);
  // Functions and kernel-parameter arrays, matched to the plan's steps by node.
  std::vector<Step> ordered;
  for (auto& sl : lp_.steps) {
    auto it = std::find_if(steps_.begin(), steps_.end(), [&](const Step& s) { return s.plan_step->node == sl.node; });
    Step st = std::move(*it);
    st.fn = ctx_.function(sl.ptx, sl.entry, sl.label);
    for (auto& L : sl.launches) st.kparams.push_back(L.args.kernel_params());
    ordered.push_back(std::move(st));
  }
  steps_ = std::move(ordered);
  for (const auto& e : lowered.executables)
    if (!e.view && !e.runtime_op->supports_train_mode()) eval_only_.push_back(graph.node(e.node).label());
  for (const auto& sl : lp_.steps) any_run_dependent_ = any_run_dependent_ || sl.depends_on_run;
  if (plan.training.enabled)
    trainer_ = std::make_unique<Trainer>(ctx_, graph, lowered, plan, arena_.ptr(), input_ptrs_, param_ptrs);
}

GpuExecutor::~GpuExecutor() {
  const Driver& d = ctx_.driver();
  if (graph_exec_) d.cuGraphExecDestroy(graph_exec_);
  if (graph_handle_) d.cuGraphDestroy(graph_handle_);
}

DevicePtr GpuExecutor::value_ptr(int node) const { return lower::value_address(plan_, node, arena_.ptr(), input_ptrs_); }

void GpuExecutor::launch_all() {
  for (std::size_t i = 0; i < steps_.size(); ++i) {
    auto& sl = lp_.steps[i];
    for (std::size_t l = 0; l < sl.launches.size(); ++l) {
      const auto& L = sl.launches[l];
      ctx_.launch(steps_[i].fn, L.grid, L.block, L.shared, steps_[i].kparams[l].data(), sl.label);
    }
  }
}

bool GpuExecutor::repack_for_run(bool training, std::uint64_t seed) {
  if (!any_run_dependent_ || (!training && !packed_training_)) return false;
  for (std::size_t i = 0; i < steps_.size(); ++i) {
    auto& sl = lp_.steps[i];
    if (!sl.depends_on_run) continue;
    // Eval-mode launches take no seed, so they stay the same from run to run (and in a CUDA graph).
    lower::pack_step(sl, RunInfo{training, training ? runtime::node_seed(seed, sl.node) : 0});
    steps_[i].kparams.clear();
    for (auto& L : sl.launches) steps_[i].kparams.push_back(L.args.kernel_params());
  }
  packed_training_ = training;
  return true;
}

std::vector<Tensor> GpuExecutor::run(const std::vector<Tensor>& inputs, bool training, std::uint64_t seed,
                                     std::vector<NodeTime>* profile) {
  if (training && !eval_only_.empty())
    throw Error(eval_only_.front() + " cuda: this op's kernels implement inference behaviour only; a train-mode run "
                                     "(set_training(true)) needs it on the cpu device");
  ctx_.make_current();
  const Driver& d = ctx_.driver();
  if (repack_for_run(training, seed) && graph_exec_) {  // the captured graph holds the old arguments
    d.cuGraphExecDestroy(graph_exec_);
    d.cuGraphDestroy(graph_handle_);
    graph_exec_ = nullptr;
    graph_handle_ = nullptr;
  }
  for (std::size_t k = 0; k < inputs.size(); ++k) ctx_.upload_async(inputs_[k].ptr(), inputs[k].raw(), inputs[k].nbytes());
  if (options_.poison_buffers) ctx_.fill_bytes_async(arena_.ptr(), 0xFF, arena_.bytes());
  if (profile) {
    for (std::size_t i = 0; i < steps_.size(); ++i) {
      auto& sl = lp_.steps[i];
      ctx_.synchronize();
      auto t0 = std::chrono::steady_clock::now();
      for (std::size_t l = 0; l < sl.launches.size(); ++l) {
        const auto& L = sl.launches[l];
        ctx_.launch(steps_[i].fn, L.grid, L.block, L.shared, steps_[i].kparams[l].data(), sl.label);
      }
      ctx_.synchronize();
      const Node& n = graph_.node(sl.node);
      profile->push_back({n.name, n.op_name(),
                          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count()});
    }
  } else if (options_.cuda_graph && !(training && any_run_dependent_)) {
    if (!graph_exec_) {
      d.check(d.cuStreamBeginCapture(ctx_.stream(), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
      try {
        launch_all();
      } catch (...) {
        CUgraph g = nullptr;
        d.cuStreamEndCapture(ctx_.stream(), &g);
        if (g) d.cuGraphDestroy(g);
        throw;
      }
      d.check(d.cuStreamEndCapture(ctx_.stream(), &graph_handle_), "cuStreamEndCapture");
      d.check(d.cuGraphInstantiateWithFlags(&graph_exec_, graph_handle_, 0), "cuGraphInstantiateWithFlags");
    }
    d.check(d.cuGraphLaunch(graph_exec_, ctx_.stream()), "cuGraphLaunch");
  } else {
    launch_all();
  }
  std::vector<Tensor> outs;
  std::vector<std::pair<Tensor, std::size_t>> padded;
  for (int o : plan_.outputs) {
    const auto& v = plan_.values[static_cast<std::size_t>(o)];
    const std::int64_t last = v.shape.empty() ? 1 : v.shape.back();
    const std::int64_t rs = lp_.row_stride[static_cast<std::size_t>(o)];
    if (rs == last || last == 0) {
      Tensor t = Tensor::empty(v.dtype, v.shape);
      ctx_.download_async(t.raw(), value_ptr(o), t.nbytes());
      outs.push_back(t);
    } else {
      Tensor raw = Tensor::empty(v.dtype, {numel_of(v.shape) / last, rs});
      ctx_.download_async(raw.raw(), value_ptr(o), raw.nbytes());
      padded.emplace_back(raw, outs.size());
      outs.push_back(Tensor::empty(v.dtype, v.shape));
    }
  }
  ctx_.synchronize();
  for (auto& [raw, idx] : padded) {
    Tensor& t = outs[idx];
    const std::size_t row = static_cast<std::size_t>(t.shape().back()) * dtype_size(t.dtype());
    const std::size_t stride = static_cast<std::size_t>(raw.shape().back()) * dtype_size(t.dtype());
    for (std::int64_t r = 0; r < raw.shape()[0]; ++r)
      std::memcpy(static_cast<std::byte*>(t.raw()) + static_cast<std::size_t>(r) * row,
                  static_cast<const std::byte*>(raw.raw()) + static_cast<std::size_t>(r) * stride, row);
  }
  return outs;
}

void GpuExecutor::upload_params() {
  ctx_.make_current();
  for (auto& st : steps_)
    for (std::size_t k = 0; k < st.params.size(); ++k)
      ctx_.upload(st.params[k].ptr(), st.plan_step->params[k].raw(), st.plan_step->params[k].nbytes());
}

void GpuExecutor::download_params() {
  ctx_.make_current();
  ctx_.synchronize();
  for (auto& st : steps_)
    for (std::size_t k = 0; k < st.params.size(); ++k) {
      Tensor t = st.plan_step->params[k];  // shares storage with the plan's tensor
      ctx_.download(t.raw(), st.params[k].ptr(), t.nbytes());
    }
}

}  // namespace

std::unique_ptr<Executor> make_executor(int device, const Graph& graph, const lower::LoweredGraph& lowered,
                                        runtime::Plan& plan, const LoadOptions& options) {
  return std::make_unique<GpuExecutor>(device, graph, lowered, plan, options);
}

#endif

}  // namespace kg::cuda
