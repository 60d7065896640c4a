#include "backend/cpu/executor.hpp"

#include <chrono>
#include <cstring>
#include <functional>
#include <optional>
#include <random>

#include "backend/emu/executor.hpp"
#include "backend/emu/host_jit.hpp"
#include "backend/poison.hpp"
#include "graph/no_cpu_impl.hpp"
#include "kg/error.hpp"
#include "kg/runtime_op.hpp"
#include "lower/launch_check.hpp"
#include "lower/launch_plan.hpp"
#include "plan/optimizer.hpp"
#include "plan/plan_builder.hpp"
#include "util/str.hpp"

namespace kg::cpu {

// A lowered node run through the CUDA emulator (an op without a CPU implementation, or every
// lowered op in checked mode): its kernel module compiled once (the first launch goes through
// emu::launch and its checks; later unchecked ones straight to the emulator's grid runner), and
// its scratch buffer kept for the next run.
struct Executor::EmulatedNode {
  const lower::Executable* exe = nullptr;
  lower::KernelModule module;
  std::shared_ptr<const emu::JitModule> jit;
  bool launched = false;  // the checked first launch is done
  Tensor scratch;         // U8
};

namespace {

class PoolContext final : public CpuContext {
 public:
  PoolContext(std::span<const Tensor> in, std::span<const Tensor> ps, Tensor out, bool train,
              std::uint64_t seed, ThreadPool& pool)
      : CpuContext(in, ps, std::move(out), train, seed), pool_(pool) {}
  void parallel_for(std::int64_t n, std::int64_t grain, const RangeFn& fn) const override {
    pool_.parallel_for(n, grain, fn);
  }

 private:
  ThreadPool& pool_;
};

DevicePtr host_address(const Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.raw()); }

DeviceTensor device_tensor(const Tensor& t) { return {host_address(t), t.shape(), t.dtype()}; }

using backend::poison_byte;

const unsigned char* bytes_of(const Tensor& t) { return static_cast<const unsigned char*>(t.raw()); }

// Fills `t` with `byte` (checked mode's poison).
void fill_with(const Tensor& t, unsigned char byte) {
  if (t.nbytes()) std::memset(const_cast<void*>(t.raw()), byte, t.nbytes());
}

// After a checked run of launches that were given `outputs` poisoned: the first element one of
// them did not write (backend::find_unwritten; `rerun` runs the launches again).
std::optional<backend::Unwritten> find_unwritten(const std::vector<const Tensor*>& outputs,
                                                 const std::function<void()>& rerun) {
  std::vector<backend::CheckedOutput> after;
  for (const Tensor* t : outputs) after.push_back({bytes_of(*t), t->numel(), t->dtype()});
  return backend::find_unwritten(after, [&](unsigned char byte) {
    for (const Tensor* t : outputs) fill_with(*t, byte);
    rerun();
    std::vector<const unsigned char*> bytes;
    for (const Tensor* t : outputs) bytes.push_back(bytes_of(*t));
    return bytes;
  });
}

std::string index_text(std::int64_t flat, const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> idx(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    idx[d] = shape[d] ? flat % shape[d] : 0;
    flat = shape[d] ? flat / shape[d] : 0;
  }
  return sizes_to_string(idx);
}

std::shared_ptr<Executor::EmulatedNode> prepare(const Node& n, const lower::Executable* exe) {
  const std::string label = n.label();
  if (!exe || !exe->lowered)
    throw Error(label +
                " has no CPU implementation (override CustomOp::cpu_forward) and no lowering to run "
                "through the CUDA emulator instead (CustomOp::lower() returns nothing)");
  auto e = std::make_shared<Executor::EmulatedNode>();
  e->exe = exe;
  e->module = lower::make_module(exe->name, exe->source, exe->entry_point, 0);
  try {
    e->jit = emu::HostJit::global().load(exe->name, exe->source);
  } catch (const Error& err) {
    throw lower::labelled(label, err);
  }
  return e;
}

// The buffers a checked launch may touch, named for its errors.
std::vector<emu::HostBuffer> launch_buffers(const Node& n, const Graph& graph, const std::vector<Tensor>& ins,
                                            const std::vector<Tensor>& params,
                                            const std::vector<ParamSpec>& specs, const Tensor& out,
                                            const Tensor* grad_out, const std::vector<Tensor>* grad_in,
                                            const std::vector<Tensor>* grad_params, const Tensor& scratch) {
  std::vector<emu::HostBuffer> b;
  auto add = [&](const Tensor& t, std::string name) {
    if (t.raw() && t.nbytes()) b.push_back({host_address(t), t.nbytes(), std::move(name)});
  };
  for (std::size_t i = 0; i < ins.size(); ++i)
    add(ins[i], util::cat("input ", i, " '", graph.node(n.inputs[i]).name, "'"));
  for (std::size_t i = 0; i < params.size(); ++i) add(params[i], "parameter '" + specs[i].name + "'");
  add(out, "output '" + n.name + "'");
  if (grad_out) add(*grad_out, "output gradient");
  if (grad_in)
    for (std::size_t i = 0; i < grad_in->size(); ++i) add((*grad_in)[i], util::cat("gradient of input ", i));
  if (grad_params)
    for (std::size_t i = 0; i < grad_params->size(); ++i)
      add((*grad_params)[i], "gradient of parameter '" + specs[i].name + "'");
  add(scratch, "scratch");
  return b;
}

// Describes, checks and runs every launch of the node's kernel on the emulator, with host
// addresses. In checked mode the output is poisoned first and verified after.
void run_emulated(Executor::EmulatedNode& e, const Node& n, const Graph& graph, const plan::Step& step,
                  const std::vector<Tensor>& ins, Tensor& out, bool training, std::uint64_t seed,
                  bool checked, ThreadPool& pool) {
  const std::string label = n.label();
  const RuntimeOp& rt = *e.exe->runtime_op;
  LaunchTensors t;
  for (const auto& x : ins) t.inputs.push_back(device_tensor(x));
  for (std::size_t i = 0; i < step.params.size(); ++i)
    t.params.push_back({host_address(step.params[i]), step.specs[i].shape, step.specs[i].dtype});
  t.output = device_tensor(out);
  t.training = training;
  t.seed = seed;
  if (!e.launched || checked) {
    LaunchTensors sizing = t;
    for (auto& x : sizing.inputs) x.ptr = 0;
    for (auto& x : sizing.params) x.ptr = 0;
    sizing.output.ptr = 0;
    const std::size_t sb = rt.scratch_bytes(sizing);
    if (sb > 0 && static_cast<std::size_t>(e.scratch.numel()) < sb)
      e.scratch = Tensor::empty(DType::U8, {static_cast<std::int64_t>(sb)});
  }
  t.scratch = e.scratch.numel() > 0 ? host_address(e.scratch) : 0;
  const auto launches = lower::check_launches(e.module, rt.launches(t), label, "");
  if (checked) fill_with(out, poison_byte(out.dtype()));
  emu::LaunchOptions o;
  o.label = label;
  o.checked = checked;
  o.pool = &pool;
  if (checked)
    o.buffers =
        launch_buffers(n, graph, ins, step.params, step.specs, out, nullptr, nullptr, nullptr, e.scratch);
  for (const auto& L : launches) {
    if (!e.launched || checked) {
      emu::launch(e.exe->name, e.exe->source, L.entry, L.launch.grid, L.launch.block, L.launch.shared_bytes,
                  L.launch.args, o);
      continue;
    }
    std::vector<std::vector<std::byte>> bytes;
    for (const auto& a : L.launch.args.args()) bytes.push_back(a.data());
    std::vector<void*> ptrs;
    for (auto& b : bytes) ptrs.push_back(b.data());
    emu::GridLaunch gl;
    gl.kernel = &e.jit->find(L.entry, label);
    gl.grid = L.launch.grid;
    gl.block = L.launch.block;
    gl.shared = L.launch.shared_bytes;
    gl.args = ptrs.data();
    gl.label = label;
    gl.pool = &pool;
    emu::run_grid(gl);
  }
  e.launched = true;
  if (checked) {
    const auto unwritten = find_unwritten({&out}, [&] {
      for (const auto& L : launches)
        emu::launch(e.exe->name, e.exe->source, L.entry, L.launch.grid, L.launch.block, L.launch.shared_bytes,
                    L.launch.args, o);
    });
    if (unwritten) {
      const std::int64_t bad = unwritten->element;
      throw Error(util::cat(label, " kernel '", e.exe->name, "': output '", n.name, "' ",
                            sizes_to_string(out.shape()), " element ", bad, " (index ",
                            index_text(bad, out.shape()), ") was not written (", out.numel(),
                            " elements; every one must be); is infer_output_shape larger than what the "
                            "kernel writes?"));
    }
  }
}

// The backward twin of PoolContext.
class PoolBackwardContext final : public CpuBackwardContext {
 public:
  PoolBackwardContext(std::span<const Tensor> in, std::span<const Tensor> ps, Tensor out, Tensor grad_out,
                      std::span<Tensor> grad_in, std::span<Tensor> grad_ps, bool train, std::uint64_t seed,
                      ThreadPool& pool)
      : CpuBackwardContext(in, ps, std::move(out), std::move(grad_out), grad_in, grad_ps, train, seed),
        pool_(pool) {}
  void parallel_for(std::int64_t n, std::int64_t grain, const RangeFn& fn) const override {
    pool_.parallel_for(n, grain, fn);
  }

 private:
  ThreadPool& pool_;
};

template <class T>
void add_span(T* dst, const T* src, std::int64_t b, std::int64_t e) {
  for (std::int64_t i = b; i < e; ++i) dst[i] += src[i];
}

// dst += src (same dtype and element count; float dtypes).
void add_into(const Tensor& dst_t, const Tensor& src, ThreadPool& pool) {
  Tensor dst = dst_t;
  const std::int64_t n = dst.numel();
  if (src.numel() != n || src.dtype() != dst.dtype())
    throw Error(util::cat("gradient sum: ", sizes_to_string(src.shape()), " ", dtype_name(src.dtype()),
                          " into ", sizes_to_string(dst.shape()), " ", dtype_name(dst.dtype())));
  switch (dst.dtype()) {
    case DType::F32: {
      float* d = dst.data<float>();
      const float* s = src.data<float>();
      pool.parallel_for(n, 1 << 15, [&](std::int64_t b, std::int64_t e) { add_span(d, s, b, e); });
      return;
    }
    case DType::F64: {
      double* d = dst.data<double>();
      const double* s = src.data<double>();
      pool.parallel_for(n, 1 << 15, [&](std::int64_t b, std::int64_t e) { add_span(d, s, b, e); });
      return;
    }
    default:
      for (std::int64_t i = 0; i < n; ++i) {
        Tensor one = Tensor::wrap(
            static_cast<std::byte*>(dst.raw()) + static_cast<std::size_t>(i) * dtype_size(dst.dtype()),
            dst.dtype(), {});
        one.fill(dst.item(i) + src.item(i));
      }
  }
}

// Runs the lowered backward kernels of an op through the emulator (checked in checked mode).
void run_emulated_backward(const Node& n, const Graph& graph, const lower::Executable& exe,
                           const lower::KernelModule& module, const std::vector<Tensor>& ins,
                           const std::vector<Tensor>& params, const std::vector<ParamSpec>& specs,
                           const Tensor& out, const Tensor& grad_out, std::vector<Tensor>& grad_in,
                           std::vector<Tensor>& grad_params, std::uint64_t seed, bool training,
                           bool checked, ThreadPool& pool) {
  const std::string label = n.label();
  const RuntimeOp& rt = *exe.runtime_op;
  LaunchTensors bt;
  for (const auto& t : ins) bt.inputs.push_back(device_tensor(t));
  for (std::size_t i = 0; i < params.size(); ++i)
    bt.params.push_back({host_address(params[i]), specs[i].shape, specs[i].dtype});
  bt.output = device_tensor(out);
  bt.grad_output = device_tensor(grad_out);
  for (const auto& t : grad_in) bt.grad_inputs.push_back(device_tensor(t));
  for (const auto& t : grad_params) bt.grad_params.push_back(device_tensor(t));
  bt.seed = seed;
  bt.training = training;
  Tensor scratch;
  if (const std::size_t sb = rt.backward_scratch_bytes(bt); sb > 0) {
    scratch = Tensor::empty(DType::U8, {static_cast<std::int64_t>(sb)});
    bt.scratch = host_address(scratch);
  }
  const auto launches = lower::check_launches(module, rt.backward_launches(bt), label, "backward");
  std::vector<const Tensor*> wanted;
  for (const auto& t : grad_in)
    if (t.raw()) wanted.push_back(&t);
  for (const auto& t : grad_params)
    if (t.raw()) wanted.push_back(&t);
  if (checked)
    for (const Tensor* t : wanted) fill_with(*t, poison_byte(t->dtype()));
  emu::LaunchOptions o;
  o.label = label + " backward";
  o.checked = checked;
  o.pool = &pool;
  if (checked)
    o.buffers = launch_buffers(n, graph, ins, params, specs, out, &grad_out, &grad_in, &grad_params, scratch);
  auto run_all = [&] {
    for (const auto& L : launches)
      emu::launch(module.name, module.source, L.entry, L.launch.grid, L.launch.block, L.launch.shared_bytes,
                  L.launch.args, o);
  };
  run_all();
  if (!checked) return;
  if (const auto unwritten = find_unwritten(wanted, run_all)) {
    const Tensor& g = *wanted[unwritten->output];
    const std::int64_t bad = unwritten->element;
    throw Error(util::cat(label, " backward kernel '", module.name, "': gradient ", sizes_to_string(g.shape()),
                          " element ", bad, " (index ", index_text(bad, g.shape()),
                          ") was not written; a backward overwrites every element of each wanted gradient"));
  }
}

}  // namespace

void Executor::run_backward(const Graph& graph, plan::Plan& plan, const std::vector<Tensor>& inputs,
                            void* arena, std::vector<std::vector<Tensor>>& param_grads,
                            bool accumulate_params, bool training, std::uint64_t seed,
                            std::vector<NodeTime>* profile) {
  using clock = std::chrono::steady_clock;
  const plan::TrainingPlan& tp = plan.training;
  auto* base = static_cast<std::byte*>(arena);
  auto grad_of = [&](int node) {
    const auto& v = plan.values[static_cast<std::size_t>(node)];
    return Tensor::wrap(base + tp.grad_offset[static_cast<std::size_t>(v.root)], v.dtype, v.shape);
  };
  for (int r : tp.zero_roots)
    std::memset(base + tp.grad_offset[static_cast<std::size_t>(r)], 0,
                plan.values[static_cast<std::size_t>(r)].bytes());
  grad_of(tp.loss_node).fill(1.0);

  std::vector<Tensor> ins, grad_in, grad_params;
  for (const plan::BackwardStep& b : tp.steps) {
    const Node& n = graph.node(b.node);
    const plan::Step& step = plan.steps[static_cast<std::size_t>(b.step)];
    auto t0 = clock::now();
    ins.clear();
    grad_in.clear();
    grad_params.clear();
    for (std::size_t i = 0; i < n.inputs.size(); ++i) {
      const int in = n.inputs[i];
      const auto& v = plan.values[static_cast<std::size_t>(in)];
      ins.push_back(b.saves.inputs ? value_tensor(plan, in, inputs, arena)
                                   : Tensor::wrap(nullptr, v.dtype, v.shape));
      const plan::GradTarget& g = b.inputs[i];
      if (g.root < 0)
        grad_in.push_back(Tensor::wrap(nullptr, v.dtype, v.shape));
      else if (g.accumulate)
        grad_in.push_back(Tensor::wrap(base + g.temp_offset, v.dtype, v.shape));
      else
        grad_in.push_back(grad_of(in));
    }
    const auto& ov = plan.values[static_cast<std::size_t>(b.node)];
    Tensor out = b.saves.output ? value_tensor(plan, b.node, inputs, arena)
                                : Tensor::wrap(nullptr, ov.dtype, ov.shape);
    std::vector<Tensor>& pg = param_grads[static_cast<std::size_t>(b.step)];
    for (std::size_t p = 0; p < step.specs.size(); ++p) {
      const auto& spec = step.specs[p];
      if (p >= b.want_param.size() || !b.want_param[p])
        grad_params.push_back(Tensor::wrap(nullptr, spec.dtype, spec.shape));
      else if (accumulate_params)
        grad_params.push_back(Tensor::wrap(base + b.param_temp_offsets[p], spec.dtype, spec.shape));
      else
        grad_params.push_back(pg[p]);
    }
    const std::uint64_t s = plan::node_seed(seed, b.node);
    try {
      const lower::Executable* exe = executable(b.node);
      const bool lowered_backward = exe && exe->lowered && !exe->backward_source.empty();
      if (n.op->op().has_cpu_backward() && !(checked_ && lowered_backward)) {
        PoolBackwardContext ctx(ins, step.params, out, grad_of(b.node), grad_in, grad_params, training, s,
                                pool());
        n.op->op().cpu_backward(ctx);
      } else {
        if (!lowered_backward)
          throw Error(n.label() +
                      " has no backward (CustomOp::cpu_backward, or lower_backward_source() with "
                      "RuntimeOp::backward_launches())");
        auto eb = emulated_backward_.find(b.node);
        if (eb == emulated_backward_.end())
          eb = emulated_backward_
                   .emplace(b.node, lower::make_module(exe->name + ".backward", exe->backward_source, "", 0))
                   .first;
        run_emulated_backward(n, graph, *exe, eb->second, ins, step.params, step.specs, out, grad_of(b.node),
                              grad_in, grad_params, s, training, checked_, pool());
      }
    } catch (const Error& e) {
      const std::string what = e.what();
      throw Error(what.rfind(n.label(), 0) == 0 ? what : n.label() + " backward: " + what);
    } catch (const std::exception& e) {
      throw Error(n.label() + " backward failed: " + e.what());
    }
    for (std::size_t i = 0; i < n.inputs.size(); ++i)
      if (b.inputs[i].root >= 0 && b.inputs[i].accumulate) add_into(grad_of(n.inputs[i]), grad_in[i], pool());
    if (accumulate_params)
      for (std::size_t p = 0; p < step.specs.size(); ++p)
        if (p < b.want_param.size() && b.want_param[p]) add_into(pg[p], grad_params[p], pool());
    if (profile)
      profile->push_back({n.name, n.op_name() + " (backward)",
                          std::chrono::duration<double, std::milli>(clock::now() - t0).count()});
  }
}

Executor::Executor(int threads, lower::LoweredGraph lowered, bool checked)
    : lowered_(std::move(lowered)), checked_(checked) {
  // 0 takes the shared pool (a thread per core); a negative count is refused here, not taken as 0.
  if (threads < 0)
    throw Error(util::cat("LoadOptions::threads is ", threads, "; expected 0 (one per core) to ",
                          ThreadPool::kMaxThreads));
  if (threads > 0) own_ = std::make_unique<ThreadPool>(threads);
  for (const auto& e : lowered_.executables) by_node_[e.node] = &e;
}

const lower::Executable* Executor::executable(int node) const {
  auto it = by_node_.find(node);
  return it == by_node_.end() ? nullptr : it->second;
}

Tensor Executor::value_tensor(const plan::Plan& plan, int node, const std::vector<Tensor>& inputs,
                              void* arena) {
  const auto& v = plan.values.at(static_cast<std::size_t>(node));
  if (v.input_index >= 0) {
    const Tensor& in = inputs.at(static_cast<std::size_t>(v.input_index));
    return Tensor::wrap(const_cast<void*>(in.raw()), v.dtype, v.shape);
  }
  return Tensor::wrap(static_cast<std::byte*>(arena) + v.offset, v.dtype, v.shape);
}

void Executor::run(const Graph& graph, plan::Plan& plan, const std::vector<Tensor>& inputs, void* arena,
                   bool training, std::uint64_t seed, std::vector<NodeTime>* profile) {
  using clock = std::chrono::steady_clock;
  std::vector<Tensor> ins;
  for (auto& step : plan.steps) {
    const Node& n = graph.node(step.node);
    ins.clear();
    for (int in : n.inputs) ins.push_back(value_tensor(plan, in, inputs, arena));
    Tensor out = value_tensor(plan, step.node, inputs, arena);
    auto t0 = clock::now();
    auto emulated = emulated_.find(step.node);
    const lower::Executable* exe = executable(step.node);
    // Checked mode runs every lowered op's kernels; otherwise the op's CPU implementation runs
    // and its kernels only when it has none.
    bool emulate = emulated != emulated_.end() || checked_;
    if (!emulate) {
      PoolContext ctx(ins, step.params, out, training, plan::node_seed(seed, step.node), pool());
      try {
        n.op->op().cpu_forward(ctx);
      } catch (const NoCpuImplementation&) {
        emulate = true;
      } catch (const Error& e) {
        throw lower::labelled(n.label(), e);
      } catch (const std::exception& e) {
        throw Error(n.label() + " cpu_forward failed: " + e.what());
      }
    }
    if (emulate) {
      try {
        if (emulated == emulated_.end()) emulated = emulated_.emplace(step.node, prepare(n, exe)).first;
        run_emulated(*emulated->second, n, graph, step, ins, out, training,
                     training ? plan::node_seed(seed, step.node) : 0, checked_, pool());
      } catch (const Error& e) {
        throw lower::labelled(n.label(), e);
      } catch (const std::exception& e) {
        throw Error(n.label() + " emulated kernel failed: " + e.what());
      }
    }
    if (profile)
      profile->push_back(
          {n.name, n.op_name(), std::chrono::duration<double, std::milli>(clock::now() - t0).count()});
  }
}

namespace {

class CpuModelExecutor final : public backend::Executor {
 public:
  CpuModelExecutor(const Graph& graph, plan::Plan& plan, lower::LoweredGraph lowered, const LoadOptions& options,
                   std::vector<std::vector<Tensor>>& grads, std::vector<std::vector<std::vector<Tensor>>>& slots)
      : graph_(graph),
        plan_(plan),
        options_(options),
        grads_(grads),
        slots_(slots),
        exec_(options.threads, std::move(lowered), options.checked) {
    plan::place_in_arena(
        plan_, graph_, [&](int id) { return plan_.values[static_cast<std::size_t>(id)].bytes(); }, {});
    arena_ = Tensor::empty(DType::U8, {static_cast<std::int64_t>(std::max<std::size_t>(plan_.memory.arena_bytes, 1))});
  }

  std::vector<Tensor> run(const std::vector<Tensor>& inputs, bool training, std::uint64_t seed,
                          std::vector<NodeTime>* profile) override {
    void* arena = arena_.raw();
    if (options_.poison_buffers) std::memset(arena, 0xFF, arena_.nbytes());
    exec_.run(graph_, plan_, inputs, arena, training, seed, profile);
    if (plan_.training.enabled) last_inputs_ = inputs;  // handles: the backward reads saved inputs
    std::vector<Tensor> outs;
    for (int o : plan_.outputs) outs.push_back(cpu::Executor::value_tensor(plan_, o, inputs, arena).clone());
    return outs;
  }
  void upload_params() override {}
  void download_params() override {}

  void backward(bool accumulate_params, std::uint64_t seed, bool training, std::vector<NodeTime>* profile) override {
    exec_.run_backward(graph_, plan_, last_inputs_, arena_.raw(), grads_, accumulate_params, training, seed, profile);
    last_inputs_.clear();
  }
  void zero_grad() override {}  // the host gradients are LoadedModel's, zeroed there
  void step(const OptimizerOptions& options, std::int64_t step) override {
    for (std::size_t s = 0; s < plan_.steps.size(); ++s)
      for (std::size_t p = 0; p < plan_.steps[s].specs.size(); ++p)
        if (grads_[s][p].raw() != nullptr) {
          Tensor param = plan_.steps[s].params[p];
          plan::optimizer_update_cpu(options, step, param, grads_[s][p], slots_[s][p]);
        }
  }
  void reset_optimizer(const OptimizerOptions&) override {}  // LoadedModel zeroes the host state
  void download_grads(std::vector<std::vector<Tensor>>&) override {}
  void download_slots(std::vector<std::vector<std::vector<Tensor>>>&) override {}
  void upload_slots(const std::vector<std::vector<std::vector<Tensor>>>&) override {}

 private:
  const Graph& graph_;
  plan::Plan& plan_;
  LoadOptions options_;
  std::vector<std::vector<Tensor>>& grads_;
  std::vector<std::vector<std::vector<Tensor>>>& slots_;
  cpu::Executor exec_;
  Tensor arena_;                    // activation bytes
  std::vector<Tensor> last_inputs_;  // the last forward's inputs (the backward reads them)
};

}  // namespace

std::unique_ptr<backend::Executor> make_executor(const Graph& graph, plan::Plan& plan, lower::LoweredGraph lowered,
                                                 const LoadOptions& options, std::vector<std::vector<Tensor>>& grads,
                                                 std::vector<std::vector<std::vector<Tensor>>>& slots) {
  return std::make_unique<CpuModelExecutor>(graph, plan, std::move(lowered), options, grads, slots);
}

}  // namespace kg::cpu
