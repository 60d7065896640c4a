#include "backend/cuda/executor.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <variant>

#include "kg/error.hpp"
#include "kg/runtime_op.hpp"
#include "lower/lowering.hpp"
#include "util/str.hpp"

#ifdef KG_HAVE_CUDA
#include "backend/cuda/context.hpp"
#include "backend/cuda/nccl.hpp"
#include "backend/cuda/trainer.hpp"
#include "backend/cuda/vendor.hpp"
#include "backend/poison.hpp"
#include "compile/compiler.hpp"
#include "lower/launch_plan.hpp"
#include "plan/plan_builder.hpp"
#include "util/memory.hpp"
#endif

namespace kg::cuda {

#ifndef KG_HAVE_CUDA

bool available() { return false; }
bool convolution_library_available() { return false; }

std::unique_ptr<backend::Executor> make_executor(int, const Graph&, const lower::LoweredGraph&, plan::Plan&,
                                                 const LoadOptions&) {
  throw Error("device cuda: this build has no CUDA path (configured without the CUDA toolkit)");
}

#else

bool available() { return Driver::get() != nullptr; }
bool convolution_library_available() { return Dnn::get() != nullptr; }

namespace {

// Checked mode: bytes of canaries before and after the arena.
constexpr std::size_t kGuardBytes = 1 << 16;

// The plan against the device's free memory, before anything of the model is allocated on it
// (unless KG_NO_MEMORY_CHECK=1): the arena block, the inputs, the parameters and, for training,
// the parameter gradients the trainer allocates.
void check_device_memory(const Context& ctx, const Graph& graph, const plan::Plan& plan,
                         std::size_t arena_block) {
  if (util::memory_check_disabled()) return;
  auto add = [](std::uint64_t& sum, std::uint64_t b) {  // saturating: a sum past 2^64 fits no GPU
    sum = util::checked_add(sum, b).value_or(std::numeric_limits<std::uint64_t>::max());
  };
  plan::DeviceMemoryNeed need;
  need.activations = arena_block;
  for (int id : graph.inputs()) add(need.inputs, plan.values[static_cast<std::size_t>(id)].bytes());
  for (const auto& st : plan.steps)
    for (const Tensor& t : st.params) add(need.parameters, t.nbytes());
  if (plan.training.enabled)
    for (const auto& b : plan.training.steps)
      for (std::size_t p = 0; p < b.want_param.size(); ++p)
        if (b.want_param[p])
          add(need.gradients, plan.steps[static_cast<std::size_t>(b.step)].params[p].nbytes());
  const auto info = ctx.memory_info();
  if (auto e = plan::device_memory_shortfall(need, info.free, info.total, util::cat("cuda:", ctx.index()),
                                             plan::describe_inputs(plan, graph)))
    throw Error(*e);
}

// Once per process and library: why its calls run on our own kernels instead.
void note_unavailable(const char* library, const std::string& reason, const char* what) {
  static std::mutex mu;
  static std::vector<std::string> noted;
  std::lock_guard<std::mutex> lock(mu);
  if (std::find(noted.begin(), noted.end(), library) != noted.end()) return;
  noted.emplace_back(library);
  std::fprintf(stderr, "kernelgraph: %s is not available (%s); %s run on kernelgraph's own kernels\n",
               library, reason.c_str(), what);
}

bool vendor_disabled_by_env() { return backend::vendor_libraries_disabled_by_env(); }

class GpuExecutor final : public backend::Executor {
 public:
  GpuExecutor(int device, const Graph& graph, const lower::LoweredGraph& lowered, plan::Plan& plan,
              const LoadOptions& options);
  ~GpuExecutor() override;
  std::vector<Tensor> run(const std::vector<Tensor>& inputs, bool training, std::uint64_t seed,
                          std::vector<NodeTime>* profile) override;
  std::vector<DeviceTensor> run_device(const std::vector<DeviceTensor>& inputs, bool training,
                                       std::uint64_t seed, std::vector<NodeTime>* profile) override;
  double last_device_ms() const override;
  std::int64_t cuda_graph_replays() const override {
    return graph_replays_ + (trainer_ ? trainer_->graph_replays() : 0);
  }
  void upload_params() override;
  void download_params() override;
  void backward(bool accumulate_params, std::uint64_t seed, bool training, std::vector<NodeTime>* profile,
                comm::GradientSync* sync) override {
    trainer().backward(accumulate_params, seed, training, profile, sync);
  }
  std::unique_ptr<comm::GradientSync> make_gradient_sync(comm::Group& group, std::size_t bucket_bytes) override {
    return make_nccl_sync(ctx_, group, trainer().gradient_tensors(), bucket_bytes);
  }
  void zero_grad() override { trainer().zero_grad(); }
  void step(const OptimizerOptions& o, std::int64_t step) override { trainer().step(o, step); }
  void reset_optimizer(const OptimizerOptions& o) override { trainer().reset_optimizer(o); }
  void download_grads(std::vector<std::vector<Tensor> >& g) override { trainer().download_grads(g); }
  void download_slots(std::vector<std::vector<std::vector<Tensor> > >& s) override {
    trainer().download_slots(s);
  }
  void upload_slots(const std::vector<std::vector<std::vector<Tensor> > >& s) override {
    trainer().upload_slots(s);
  }

 private:
  struct Step {
    const plan::Step* plan_step;
    std::vector<CUfunction> fns;  // per launch
    std::vector<DeviceBuffer> params;
    std::vector<std::vector<void*> > kparams;  // per launch, into lp_.steps[i].launches[l].args
    // The vendor-library tactic, when chosen: the prologue launches, the planned call, then the
    // epilogue launches.
    std::unique_ptr<VendorPlan> vendor;
    std::vector<CUfunction> prologue_fns, epilogue_fns;
    std::vector<std::vector<void*> > prologue_kparams, epilogue_kparams;
    // What a tuned load measured for the choice, e.g. " (own 0.412 ms, library 0.330 ms)".
    std::string measured;
  };
  // How library calls are planned (tf32, tuning, the workspace limit), or nothing when they are off.
  std::optional<VendorOptions> vendor_options() const;
  // Chooses, for every step with a library call, the vendor library or the op's kernels.
  void plan_vendor_calls();
  // Median device time in ms of `reps` runs of step i as it is set up now.
  double time_step(std::size_t i, int reps);
  // Before a tactic is timed: step i's floating-point inputs (activations and model inputs, not
  // parameters) filled with uniform values in [-1, 1), so that the timing does not run on whatever
  // fresh device memory holds (often zeros, which tensor cores run faster than real data).
  void fill_inputs_for_timing(std::size_t i);
  // Input copies (when given), the launches of a run and the events around them.
  void execute(bool training, std::uint64_t seed, std::vector<NodeTime>* profile,
               const std::vector<DeviceTensor>* device_inputs);
  DevicePtr value_ptr(int node) const;
  void bind_launches(std::size_t i);
  void launch_step(std::size_t i);
  void launch_all();
  // Checked mode: poisons step i's output, runs it, and verifies that it wrote every output
  // element and no arena byte outside its output and scratch (guards included).
  void launch_checked(std::size_t i);
  // Packs the launches that depend on the run again; true when any of them changed.
  bool repack_for_run(bool training, std::uint64_t seed);
  Trainer& trainer() {
    if (!trainer_) throw Error("cuda: the model has no training plan");
    return *trainer_;
  }

  Context& ctx_;
  const Graph& graph_;
  plan::Plan& plan_;
  LoadOptions options_;
  lower::LaunchPlan lp_;
  DeviceBuffer arena_block_;  // the arena, with guard bytes before and after it in checked mode
  DevicePtr arena_ = 0;
  std::size_t guard_ = 0;
  std::vector<DeviceBuffer> inputs_;
  std::vector<DevicePtr> input_ptrs_;
  std::vector<Step> steps_;
  CUgraph graph_handle_ = nullptr;
  CUgraphExec graph_exec_ = nullptr;
  std::int64_t graph_replays_ = 0;  // forward runs launched from graph_exec_
  std::vector<std::string> eval_only_;  // labels of ops whose kernels have no train mode
  bool any_run_dependent_ = false;
  bool packed_training_ = false;  // the mode the run-dependent launches are packed for
  std::unique_ptr<Trainer> trainer_;
  DeviceBuffer workspace_;  // shared by the vendor calls, which run one after another
  CUevent start_ = nullptr, stop_ = nullptr;
  std::vector<CUevent> node_events_;  // a profiled run's, two per step
  bool timed_ = false;  // the events hold a run
};

GpuExecutor::GpuExecutor(int device, const Graph& graph, const lower::LoweredGraph& lowered, plan::Plan& plan,
                         const LoadOptions& options)
    : ctx_(Context::get(device)), graph_(graph), plan_(plan), options_(options) {
  lp_ = lower::size_launches(graph, lowered, plan);
  guard_ = options.checked ? kGuardBytes : 0;
  check_device_memory(ctx_, graph, plan, lp_.arena_bytes + 2 * guard_);
  arena_block_ = DeviceBuffer(ctx_, std::max<std::size_t>(lp_.arena_bytes, 1) + 2 * guard_);
  arena_ = arena_block_.ptr() + guard_;
  for (int id : graph.inputs()) {
    inputs_.emplace_back(ctx_, plan.values[static_cast<std::size_t>(id)].bytes());
    input_ptrs_.push_back(inputs_.back().ptr());
  }
  std::vector<std::vector<DevicePtr> > param_ptrs;
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
  lower::pack_launches(lp_, graph, lowered, plan, ctx_.arch(), arena_, input_ptrs_, param_ptrs);
  // Functions and kernel-parameter arrays, matched to the plan's steps by node.
  std::vector<Step> ordered;
  for (auto& sl : lp_.steps) {
    auto it = std::find_if(steps_.begin(), steps_.end(),
                           [&](const Step& s) { return s.plan_step->node == sl.node; });
    ordered.push_back(std::move(*it));
  }
  steps_ = std::move(ordered);
  for (std::size_t i = 0; i < steps_.size(); ++i) bind_launches(i);
  const Driver& d = ctx_.driver();
  d.check(d.cuEventCreate(&start_, CU_EVENT_DEFAULT), "cuEventCreate");
  d.check(d.cuEventCreate(&stop_, CU_EVENT_DEFAULT), "cuEventCreate");
  plan_vendor_calls();
  for (const auto& e : lowered.executables)
    if (!e.view && e.lowered && !e.runtime_op->supports_train_mode())
      eval_only_.push_back(graph.node(e.node).label());
  for (const auto& sl : lp_.steps) any_run_dependent_ = any_run_dependent_ || sl.depends_on_run;
  if (plan.training.enabled)
    trainer_ = std::make_unique<Trainer>(ctx_, graph, lowered, plan, arena_, input_ptrs_, param_ptrs,
                                         options.checked, vendor_options(), options.cuda_graph);
}

GpuExecutor::~GpuExecutor() {
  const Driver& d = ctx_.driver();
  if (graph_exec_) d.cuGraphExecDestroy(graph_exec_);
  if (graph_handle_) d.cuGraphDestroy(graph_handle_);
  if (start_) d.cuEventDestroy(start_);
  if (stop_) d.cuEventDestroy(stop_);
  for (CUevent e : node_events_) d.cuEventDestroy(e);
}

std::optional<VendorOptions> GpuExecutor::vendor_options() const {
  // Checked mode is there to check the op's own kernels.
  if (!options_.vendor_libraries || options_.checked || vendor_disabled_by_env()) return std::nullopt;
  VendorOptions vo;
  vo.tf32 = options_.tf32;
  vo.tune = options_.tune;
  // The fastest algorithms of large convolutions want large workspaces (hundreds of MB at batch
  // 256): up to 1 GiB, and never more than an eighth of what the device has free after the plan.
  vo.max_workspace_bytes = std::min<std::size_t>(std::size_t{1} << 30, ctx_.memory_info().free / 8);
  vo.cache = &compile::TuningCache::global();
  vo.device_scope = util::cat(ctx_.name(), " sm_", ctx_.arch(), " driver ", ctx_.driver_version());
  return vo;
}

void GpuExecutor::plan_vendor_calls() {
  const std::optional<VendorOptions> options = vendor_options();
  if (!options) return;
  const VendorOptions& vo = *options;
  std::size_t workspace = 0;
  std::vector<std::size_t> chosen;
  for (std::size_t i = 0; i < steps_.size(); ++i) {
    const auto& sl = lp_.steps[i];
    if (!sl.library) continue;
    std::unique_ptr<VendorPlan> p;
    if (const auto* g = std::get_if<GemmCall>(&sl.library->call)) {
      const BlasLt* lib = BlasLt::get();
      if (!lib) {
        note_unavailable("cuBLASLt", BlasLt::unavailable_reason(), "matrix products");
        continue;
      }
      p = lib->plan(*g, vo, ctx_.stream(), sl.label);
    } else if (const auto* c = std::get_if<Conv2dCall>(&sl.library->call)) {
      const Dnn* lib = Dnn::get();
      if (!lib) {
        note_unavailable("cuDNN", Dnn::unavailable_reason(), "convolutions");
        continue;
      }
      p = lib->plan(*c, vo, ctx_.stream(), sl.label);
    }
    if (!p) continue;
    Step& st = steps_[i];
    st.vendor = std::move(p);
    for (const auto& L : sl.prologue) {
      st.prologue_fns.push_back(ctx_.function(sl.module.ptx, L.ptx_entry, sl.label));
      st.prologue_kparams.push_back(L.launch.args.kernel_params());
    }
    for (const auto& L : sl.epilogue) {
      st.epilogue_fns.push_back(ctx_.function(sl.module.ptx, L.ptx_entry, sl.label));
      st.epilogue_kparams.push_back(L.launch.args.kernel_params());
    }
    workspace = std::max(workspace, st.vendor->workspace_bytes());
    chosen.push_back(i);
  }
  if (workspace) workspace_ = DeviceBuffer(ctx_, workspace);
  // The library (with its epilogue) against the op's kernels, measured on the model's own buffers
  // by a tuned load and kept in the tuning cache; an untuned load takes a kept verdict.
  const std::string scope = vo.device_scope + " tactics";
  for (std::size_t i : chosen) {
    Step& st = steps_[i];
    const auto& sl = lp_.steps[i];
    const std::string key =
        util::cat(sl.module.name, " ", compile::content_hash(sl.module.ptx).substr(0, 16), " ",
                  std::visit([&](const auto& call) { return tuning_key(call, vo.tf32); }, sl.library->call),
                  " epilogue", sl.epilogue.size(), st.vendor->fused_epilogue() ? " fused" : "",
                  sl.prologue.empty() ? "" : util::cat(" prologue", sl.prologue.size()));
    const std::optional<std::string> kept = vo.cache->find(scope, key);
    if (kept == "own") {
      st.vendor.reset();
      continue;
    }
    if (kept == "library") continue;
    if (!options_.tune) {
      if (!kept && sl.library->own_first) st.vendor.reset();
      continue;
    }
    fill_inputs_for_timing(i);
    const double vendor_ms = time_step(i, 5);
    auto plan = std::move(st.vendor);
    const double own_ms = time_step(i, 5);
    if (vendor_ms <= own_ms) st.vendor = std::move(plan);
    char measured[96];
    std::snprintf(measured, sizeof measured, " (own %.3f ms, library %.3f ms)", own_ms, vendor_ms);
    st.measured = measured;
    vo.cache->store(scope, key, st.vendor ? "library" : "own");
  }
}

void GpuExecutor::fill_inputs_for_timing(std::size_t i) {
  std::mt19937_64 rng(0x74'6163'7469'63ULL + i);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (int id : graph_.node(lp_.steps[i].node).inputs) {
    const plan::Value& v = plan_.values[static_cast<std::size_t>(id)];
    if (!is_floating(v.dtype) || v.bytes() == 0) continue;
    Tensor t = Tensor::empty(DType::F32, v.shape);
    float* p = t.data<float>();
    for (std::int64_t e = 0; e < t.numel(); ++e) p[e] = uniform(rng);
    if (v.dtype != DType::F32) t = t.to(v.dtype);
    ctx_.upload(value_ptr(id), t.raw(), t.nbytes());
  }
}

double GpuExecutor::time_step(std::size_t i, int reps) {
  const Driver& d = ctx_.driver();
  launch_step(i);  // warm-up
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    d.check(d.cuEventRecord(start_, ctx_.stream()), "cuEventRecord");
    launch_step(i);
    d.check(d.cuEventRecord(stop_, ctx_.stream()), "cuEventRecord");
    d.check(d.cuEventSynchronize(stop_), "cuEventSynchronize");
    float t = 0;
    d.check(d.cuEventElapsedTime(&t, start_, stop_), "cuEventElapsedTime");
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

DevicePtr GpuExecutor::value_ptr(int node) const {
  return lower::value_address(plan_, node, arena_, input_ptrs_);
}

void GpuExecutor::bind_launches(std::size_t i) {
  auto& sl = lp_.steps[i];
  Step& st = steps_[i];
  st.fns.clear();
  st.kparams.clear();
  for (auto& L : sl.launches) {
    st.fns.push_back(ctx_.function(sl.module.ptx, L.ptx_entry, sl.label));
    st.kparams.push_back(L.launch.args.kernel_params());
  }
}

void GpuExecutor::launch_step(std::size_t i) {
  auto& sl = lp_.steps[i];
  if (const Step& st = steps_[i]; st.vendor) {
    for (std::size_t l = 0; l < sl.prologue.size(); ++l) {
      const Launch& L = sl.prologue[l].launch;
      ctx_.launch(st.prologue_fns[l], L.grid, L.block, L.shared_bytes,
                  const_cast<void**>(st.prologue_kparams[l].data()),
                  util::cat(sl.label, " kernel '", sl.module.name, "' entry '", sl.prologue[l].entry, "'"));
    }
    st.vendor->run(ctx_.stream(), workspace_.ptr(), sl.label);
    if (st.vendor->fused_epilogue()) return;
    for (std::size_t l = 0; l < sl.epilogue.size(); ++l) {
      const Launch& L = sl.epilogue[l].launch;
      ctx_.launch(st.epilogue_fns[l], L.grid, L.block, L.shared_bytes,
                  const_cast<void**>(st.epilogue_kparams[l].data()),
                  util::cat(sl.label, " kernel '", sl.module.name, "' entry '", sl.epilogue[l].entry, "'"));
    }
    return;
  }
  for (std::size_t l = 0; l < sl.launches.size(); ++l) {
    const Launch& L = sl.launches[l].launch;
    ctx_.launch(steps_[i].fns[l], L.grid, L.block, L.shared_bytes, steps_[i].kparams[l].data(),
                util::cat(sl.label, " kernel '", sl.module.name, "' entry '", sl.launches[l].entry, "'"));
  }
}

void GpuExecutor::launch_all() {
  for (std::size_t i = 0; i < steps_.size(); ++i) {
    if (options_.checked)
      launch_checked(i);
    else
      launch_step(i);
  }
}

void GpuExecutor::launch_checked(std::size_t i) {
  auto& sl = lp_.steps[i];
  const auto& ov = plan_.values[static_cast<std::size_t>(sl.node)];
  const bool in_arena = ov.input_index < 0;
  const std::size_t total = arena_block_.bytes();
  const std::size_t out_lo = guard_ + ov.offset, out_hi = out_lo + ov.bytes();
  const unsigned char poison = backend::poison_byte(ov.dtype);
  const std::string kernel = util::cat(sl.label, " kernel '", sl.module.name, "'");
  if (in_arena && ov.bytes()) ctx_.fill_bytes_async(value_ptr(sl.node), poison, ov.bytes());
  std::vector<unsigned char> before(total), after(total);
  ctx_.download(before.data(), arena_block_.ptr(), total);
  try {
    launch_step(i);
    ctx_.synchronize(kernel);
  } catch (const Error& e) {
    const std::string what = e.what();
    throw Error(what.rfind(kernel, 0) == 0 ? what : kernel + " failed in checked mode: " + what);
  }
  ctx_.download(after.data(), arena_block_.ptr(), total);
  const std::size_t s_lo = guard_ + sl.scratch_offset, s_hi = s_lo + sl.scratch_bytes;
  // The first changed byte outside the output and the scratch: memcmp over the ranges between
  // them, then the byte within the first range that differs.
  std::vector<std::pair<std::size_t, std::size_t> > allowed;
  if (in_arena) allowed.emplace_back(out_lo, out_hi);
  if (sl.scratch_bytes) allowed.emplace_back(s_lo, s_hi);
  std::sort(allowed.begin(), allowed.end());
  std::vector<std::pair<std::size_t, std::size_t> > ranges;
  std::size_t from = 0;
  for (const auto& [lo, hi] : allowed) {
    if (lo > from) ranges.emplace_back(from, lo);
    from = std::max(from, hi);
  }
  if (from < total) ranges.emplace_back(from, total);
  for (const auto& [lo, hi] : ranges) {
    if (std::memcmp(before.data() + lo, after.data() + lo, hi - lo) == 0) continue;
    std::size_t b = lo;
    while (before[b] == after[b]) ++b;
    const std::size_t es = dtype_size(ov.dtype);
    std::string where;
    if (b < guard_) {
      where = util::cat("the guard before the arena, ", guard_ - b, " bytes before it");
    } else if (b >= guard_ + lp_.arena_bytes) {
      where = util::cat("the guard after the arena, byte ", b - guard_ - lp_.arena_bytes, " past its end");
    } else {
      where = util::cat("arena byte ", b - guard_);
      for (int id : plan_.live) {
        const auto& v = plan_.values[static_cast<std::size_t>(id)];
        if (v.root != id || v.input_index >= 0) continue;
        if (b - guard_ >= v.offset && b - guard_ < v.offset + v.bytes()) {
          where += util::cat(", inside the buffer of '", graph_.node(id).name, "'");
          break;
        }
      }
    }
    if (in_arena && b >= out_hi)
      throw Error(util::cat(kernel, " wrote past the end of its output '", graph_.node(sl.node).name, "' ",
                            sizes_to_string(ov.shape), " (", numel_of(ov.shape), " elements): element ",
                            numel_of(ov.shape) + static_cast<std::int64_t>((b - out_hi) / es), ", at ",
                            where));
    if (in_arena && b < out_lo)
      throw Error(util::cat(kernel, " wrote before the start of its output '", graph_.node(sl.node).name,
                            "' (", (out_lo - b + es - 1) / es, " elements before it), at ", where));
    throw Error(util::cat(kernel, " wrote outside its output, at ", where));
  }
  if (!in_arena) return;
  // Elements still holding the poison: run the step again over a second poison to tell a kernel
  // that wrote the poison's value from one that wrote nothing (backend::find_unwritten).
  const auto unwritten = backend::find_unwritten(
      {{after.data() + out_lo, numel_of(ov.shape), ov.dtype}}, [&](unsigned char byte) {
        ctx_.fill_bytes_async(value_ptr(sl.node), byte, ov.bytes());
        try {
          launch_step(i);
          ctx_.synchronize(kernel);
        } catch (const Error& e) {
          throw Error(kernel + " failed when run again in checked mode: " + e.what());
        }
        ctx_.download(after.data() + out_lo, value_ptr(sl.node), ov.bytes());
        return std::vector<const unsigned char*>{after.data() + out_lo};
      });
  if (unwritten)
    throw Error(util::cat(kernel, ": output '", graph_.node(sl.node).name, "' ", sizes_to_string(ov.shape),
                          " element ", unwritten->element, " was not written (", numel_of(ov.shape),
                          " elements; every one must be); is infer_output_shape larger than what the kernel "
                          "writes?"));
}

bool GpuExecutor::repack_for_run(bool training, std::uint64_t seed) {
  if (!any_run_dependent_ || (!training && !packed_training_)) return false;
  bool changed = false;
  for (std::size_t i = 0; i < steps_.size(); ++i) {
    auto& sl = lp_.steps[i];
    if (!sl.depends_on_run) continue;
    // Eval-mode launches take no seed, so they stay the same from run to run (and in a CUDA graph).
    std::vector<lower::CheckedLaunch> before = std::move(sl.launches);
    lower::pack_step(sl, training, training ? plan::node_seed(seed, sl.node) : 0);
    if (lower::same_launches(before, sl.launches)) {
      sl.launches = std::move(before);  // the bound kernel parameters point into these
      continue;
    }
    bind_launches(i);
    changed = true;
  }
  packed_training_ = training;
  return changed;
}

void GpuExecutor::execute(bool training, std::uint64_t seed, std::vector<NodeTime>* profile,
                          const std::vector<DeviceTensor>* device_inputs) {
  const Driver& d = ctx_.driver();
  // Launches that changed for this run (a new seed for Dropout, train mode switched): the captured
  // graph holds the old arguments, and this run's launches go one by one. Launches that stay the
  // same from run to run (BatchNorm in train mode) are captured at the next run and replayed.
  const bool repacked = repack_for_run(training, seed);
  if (repacked && graph_exec_) {
    d.cuGraphExecDestroy(graph_exec_);
    d.cuGraphDestroy(graph_handle_);
    graph_exec_ = nullptr;
    graph_handle_ = nullptr;
  }
  timed_ = false;
  d.check(d.cuEventRecord(start_, ctx_.stream()), "cuEventRecord");
  if (device_inputs)
    for (std::size_t k = 0; k < device_inputs->size(); ++k) {
      const DeviceTensor& t = (*device_inputs)[k];
      const std::size_t bytes = static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype);
      if (bytes && t.ptr != inputs_[k].ptr())
        d.check(d.cuMemcpyDtoDAsync(inputs_[k].ptr(), t.ptr, bytes, ctx_.stream()),
                "forward_device: input copy");
    }
  if (options_.poison_buffers) ctx_.fill_bytes_async(arena_, 0xFF, lp_.arena_bytes);
  if (profile) {
    // Each node between two events of its own, launched back to back without the CUDA graph: its
    // time is the device's, not a host clock's around a synchronisation.
    while (node_events_.size() < 2 * steps_.size()) {
      CUevent e = nullptr;
      d.check(d.cuEventCreate(&e, CU_EVENT_DEFAULT), "cuEventCreate");
      node_events_.push_back(e);
    }
    // Unchecked, the launches and their events are captured into a CUDA graph and replayed once,
    // so the host's time between launches (and before the first) is not in any node's time.
    const bool capture = !options_.checked && !steps_.empty();
    if (capture)
      d.check(d.cuStreamBeginCapture(ctx_.stream(), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
    CUgraph graph = nullptr;
    try {
      // Under capture an event becomes a node of the graph only when recorded as external.
      auto record = [&](CUevent e) {
        d.check(capture ? d.cuEventRecordWithFlags(e, ctx_.stream(), CU_EVENT_RECORD_EXTERNAL)
                        : d.cuEventRecord(e, ctx_.stream()),
                "cuEventRecord");
      };
      for (std::size_t i = 0; i < steps_.size(); ++i) {
        record(node_events_[2 * i]);
        if (options_.checked)
          launch_checked(i);
        else
          launch_step(i);
        record(node_events_[2 * i + 1]);
      }
    } catch (...) {
      if (capture) {
        d.cuStreamEndCapture(ctx_.stream(), &graph);
        if (graph) d.cuGraphDestroy(graph);
      }
      throw;
    }
    if (capture) {
      d.check(d.cuStreamEndCapture(ctx_.stream(), &graph), "cuStreamEndCapture");
      CUgraphExec exec = nullptr;
      CUresult r = d.cuGraphInstantiateWithFlags(&exec, graph, 0);
      if (r == CUDA_SUCCESS) r = d.cuGraphLaunch(exec, ctx_.stream());
      if (r == CUDA_SUCCESS) r = d.cuStreamSynchronize(ctx_.stream());
      if (exec) d.cuGraphExecDestroy(exec);
      d.cuGraphDestroy(graph);
      d.check(r, "profiled run (a CUDA graph of the nodes and their events)");
    } else if (!steps_.empty()) {
      d.check(d.cuEventSynchronize(node_events_[2 * steps_.size() - 1]), "cuEventSynchronize");
    }
    for (std::size_t i = 0; i < steps_.size(); ++i) {
      float ms = 0;
      d.check(d.cuEventElapsedTime(&ms, node_events_[2 * i], node_events_[2 * i + 1]), "cuEventElapsedTime");
      const Node& n = graph_.node(lp_.steps[i].node);
      profile->push_back({n.name, n.op_name(), static_cast<double>(ms),
                          (steps_[i].vendor ? steps_[i].vendor->describe() : lp_.steps[i].module.name) +
                              steps_[i].measured});
    }
  } else if (options_.cuda_graph && !options_.checked && !repacked) {
    if (!graph_exec_) {
      d.check(d.cuStreamBeginCapture(ctx_.stream(), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
              "cuStreamBeginCapture");
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
    ++graph_replays_;
  } else {
    launch_all();
  }
  d.check(d.cuEventRecord(stop_, ctx_.stream()), "cuEventRecord");
  timed_ = true;
  // While the GPU runs the forward, the host describes the backward that usually follows, which
  // then only has to be launched: otherwise the GPU would idle through that work between the
  // forward's end (run and run_device wait for it) and the backward's first launch.
  if (trainer_ && !profile) trainer_->prepare(seed, training);
}

std::vector<Tensor> GpuExecutor::run(const std::vector<Tensor>& inputs, bool training, std::uint64_t seed,
                                     std::vector<NodeTime>* profile) {
  if (training && !eval_only_.empty())
    throw Error(eval_only_.front() +
                " cuda: this op's kernels implement inference behaviour only; a train-mode run "
                "(set_training(true)) needs it on the cpu device");
  ctx_.make_current();
  for (std::size_t k = 0; k < inputs.size(); ++k)
    ctx_.upload_async(inputs_[k].ptr(), inputs[k].raw(), inputs[k].nbytes());
  execute(training, seed, profile, nullptr);
  std::vector<Tensor> outs;
  for (int o : plan_.outputs) {
    const auto& v = plan_.values[static_cast<std::size_t>(o)];
    Tensor t = Tensor::empty(v.dtype, v.shape);
    ctx_.download_async(t.raw(), value_ptr(o), t.nbytes());
    outs.push_back(t);
  }
  ctx_.synchronize();
  return outs;
}

std::vector<DeviceTensor> GpuExecutor::run_device(const std::vector<DeviceTensor>& inputs, bool training,
                                                  std::uint64_t seed, std::vector<NodeTime>* profile) {
  if (training && !eval_only_.empty())
    throw Error(eval_only_.front() +
                " cuda: this op's kernels implement inference behaviour only; a train-mode run "
                "(set_training(true)) needs it on the cpu device");
  ctx_.make_current();
  execute(training, seed, profile, &inputs);
  std::vector<DeviceTensor> outs;
  for (int o : plan_.outputs) {
    const auto& v = plan_.values[static_cast<std::size_t>(o)];
    outs.push_back({value_ptr(o), v.shape, v.dtype});
  }
  ctx_.synchronize();
  return outs;
}

double GpuExecutor::last_device_ms() const {
  if (!timed_) return 0;
  const Driver& d = ctx_.driver();
  d.check(d.cuEventSynchronize(stop_), "cuEventSynchronize");
  float ms = 0;
  d.check(d.cuEventElapsedTime(&ms, start_, stop_), "cuEventElapsedTime");
  return ms;
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

std::unique_ptr<backend::Executor> make_executor(int device, const Graph& graph,
                                                 const lower::LoweredGraph& lowered, plan::Plan& plan,
                                                 const LoadOptions& options) {
  return std::make_unique<GpuExecutor>(device, graph, lowered, plan, options);
}

#endif

}  // namespace kg::cuda
