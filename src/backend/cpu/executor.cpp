#include "backend/cpu/executor.hpp"

#include <dlfcn.h>

#include <atomic>
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
// lowered op in checked mode): its kernel module compiled once, and its scratch buffer kept for
// the next run. Every launch, checked or not, runs on guarded copies of the node's buffers, so a
// kernel's stray access is an error naming it rather than corrupted host memory.
struct Executor::EmulatedNode {
  const lower::Executable* exe = nullptr;
  lower::KernelModule module;
  std::shared_ptr<const emu::JitModule> jit;
  bool launched = false;  // the first launch is done (the scratch is sized)
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
// addresses, on guarded copies of the node's buffers. In checked mode the output is poisoned
// first and verified after, and each launch runs in both thread orders.
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
  const auto launches = lower::check_launches(e.module, rt.launches(t), label, "", &t);
  if (checked) fill_with(out, poison_byte(out.dtype()));
  emu::LaunchOptions o;
  o.label = label;
  o.checked = checked;
  o.guarded = true;
  o.pool = &pool;
  o.buffers = launch_buffers(n, graph, ins, step.params, step.specs, out, nullptr, nullptr, nullptr, e.scratch);
  for (const auto& L : launches)
    emu::launch(*e.jit, L.entry, L.launch.grid, L.launch.block, L.launch.shared_bytes, L.launch.args, o);
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
                           std::vector<Tensor>& grad_params, std::uint64_t seed, bool training, bool checked,
                           ThreadPool& pool) {
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
  const auto launches = lower::check_launches(module, rt.backward_launches(bt), label, "backward", &bt);
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
  o.guarded = true;
  o.pool = &pool;
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
    throw Error(util::cat(label, " backward kernel '", module.name, "': gradient ",
                          sizes_to_string(g.shape()), " element ", bad, " (index ",
                          index_text(bad, g.shape()),
                          ") was not written; a backward overwrites every element of each wanted gradient"));
  }
}

}  // namespace

void Executor::run_backward(const Graph& graph, plan::Plan& plan, const std::vector<Tensor>& inputs,
                            void* arena, std::vector<std::vector<Tensor>>& param_grads,
                            bool accumulate_params, bool training, std::uint64_t seed,
                            std::vector<NodeTime>* profile, comm::GradientSync* sync) {
  using clock = std::chrono::steady_clock;
  configure_library_threads();
  const plan::TrainingPlan& tp = plan.training;
  auto* base = static_cast<std::byte*>(arena);
  auto grad_of = [&](int node) {
    const auto& v = plan.values[static_cast<std::size_t>(node)];
    return Tensor::wrap(base + plan::grad_offset_of(plan, node), v.dtype, v.shape);
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
    if (sync) sync->ready(static_cast<std::size_t>(b.step));
    if (profile)
      profile->push_back({n.name, n.op_name() + " (backward)",
                          std::chrono::duration<double, std::milli>(clock::now() - t0).count()});
  }
  if (sync) sync->finish();
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

// A step's tensors and what it runs, built by prepare_steps for one plan and arena. The tensors
// the op sees live here between runs: a run rebinds only those of model inputs and moves the
// output into the op's context and back, so it allocates nothing.
struct Executor::Prepared {
  // A model input feeding a tensor: rebound to the run's input each run.
  struct Bound {
    Tensor* tensor;
    int input;  // model input index
    const plan::Value* value;
    Tensor unbound;      // the value's shape and dtype without data, to drop the input after a run
    bool holds = false;  // *tensor is a copy of the input (and keeps its storage alive)
  };
  const Node* node = nullptr;
  const plan::Step* step = nullptr;
  const plan::Value* out_value = nullptr;
  const lower::Executable* exe = nullptr;
  EmulatedNode* emulated = nullptr;  // set once the op runs through the emulator
  std::vector<Tensor> ins;
  Tensor out;
  std::vector<Bound> bound;  // the tensors of ins and out that model inputs feed
};

Executor::~Executor() = default;

namespace {

// The run's model input as the tensor of `value` (a view of the input may have its own shape):
// the input itself where shape and dtype agree (assigned into `t`, whose storage is reused), else
// a wrap of its data, rebuilt only when the address changes. True when `t` holds the input.
bool bind_input(Tensor& t, const Tensor& in, const plan::Value& value) {
  if (in.dtype() == value.dtype && in.shape() == value.shape) {
    t = in;
    return true;
  }
  if (t.raw() != in.raw() || t.dtype() != value.dtype || t.shape() != value.shape)
    t = Tensor::wrap(const_cast<void*>(in.raw()), value.dtype, value.shape);
  return false;
}

using OmpSetNumThreads = void (*)(int);
using BlasSetNumThreads = void (*)(int);

// The libraries' setters, looked up in the process (absent: that library is not loaded, and there
// is nothing to set). OpenMP is oneDNN's runtime, loaded with it.
OmpSetNumThreads omp_set_num_threads_fn() {
  static const auto fn = reinterpret_cast<OmpSetNumThreads>(::dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  return fn;
}
BlasSetNumThreads openblas_set_num_threads_fn() {
  static const auto fn =
      reinterpret_cast<BlasSetNumThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  return fn;
}

}  // namespace

void Executor::configure_library_threads() {
  const int n = pool().size();
  // OpenMP's count is the calling thread's (its nthreads ICV): set on each thread that runs.
  thread_local int omp_threads = 0;
  if (omp_threads != n) {
    if (const auto set = omp_set_num_threads_fn()) set(n);
    omp_threads = n;
  }
  // OpenBLAS's is the process's: set when it changes (models with other counts may run between).
  static std::atomic<int> blas_threads{0};
  if (blas_threads.load(std::memory_order_relaxed) != n && blas_threads.exchange(n) != n)
    if (const auto set = openblas_set_num_threads_fn()) set(n);
}

void Executor::prepare_steps(const Graph& graph, const plan::Plan& plan, void* arena) {
  prepared_.clear();
  prepared_for_ = {};
  std::vector<Prepared> steps(plan.steps.size());
  for (std::size_t i = 0; i < plan.steps.size(); ++i) {
    const plan::Step& step = plan.steps[i];
    Prepared& p = steps[i];
    p.node = &graph.node(step.node);
    p.step = &step;
    p.out_value = &plan.values.at(static_cast<std::size_t>(step.node));
    p.exe = executable(step.node);
    auto em = emulated_.find(step.node);
    p.emulated = em == emulated_.end() ? nullptr : em->second.get();
    p.ins.resize(p.node->inputs.size());
    auto place = [&](Tensor& t, int node) {
      const plan::Value& v = plan.values.at(static_cast<std::size_t>(node));
      if (v.input_index >= 0)
        p.bound.push_back({&t, v.input_index, &v, Tensor::wrap(nullptr, v.dtype, v.shape)});
      else
        t = Tensor::wrap(static_cast<std::byte*>(arena) + v.offset, v.dtype, v.shape);
    };
    for (std::size_t k = 0; k < p.ins.size(); ++k) place(p.ins[k], p.node->inputs[k]);
    place(p.out, step.node);
  }
  // The tensors are addressed by pointer from here on: the vector is not resized again.
  prepared_ = std::move(steps);
  prepared_for_ = {&graph, &plan, arena};
}

void Executor::run(const Graph& graph, plan::Plan& plan, const std::vector<Tensor>& inputs, void* arena,
                   bool training, std::uint64_t seed, std::vector<NodeTime>* profile) {
  using clock = std::chrono::steady_clock;
  configure_library_threads();
  if (prepared_for_.graph != &graph || prepared_for_.plan != &plan || prepared_for_.arena != arena ||
      prepared_.size() != plan.steps.size())
    prepare_steps(graph, plan, arena);
  for (auto& p : prepared_)
    for (auto& b : p.bound) {
      if (b.input < 0 || static_cast<std::size_t>(b.input) >= inputs.size())
        throw Error(util::cat(p.node->label(), ": model input ", b.input, " was not given (", inputs.size(),
                              " inputs)"));
      b.holds = bind_input(*b.tensor, inputs[static_cast<std::size_t>(b.input)], *b.value);
    }
  // After the run (or an error) the tensors keep no reference to the caller's inputs.
  struct Unbind {
    std::vector<Prepared>& steps;
    ~Unbind() {
      for (auto& p : steps)
        for (auto& b : p.bound)
          if (b.holds) {
            *b.tensor = b.unbound;
            b.holds = false;
          }
    }
  } unbind{prepared_};
  if (profile) profile->reserve(profile->size() + prepared_.size());
  for (auto& p : prepared_) {
    const Node& n = *p.node;
    const plan::Step& step = *p.step;
    const auto t0 = profile ? clock::now() : clock::time_point{};
    // Checked mode runs every lowered op's kernels; otherwise the op's CPU implementation runs
    // and its kernels only when it has none.
    bool emulate = p.emulated != nullptr || checked_;
    if (!emulate) {
      PoolContext ctx(p.ins, step.params, std::move(p.out), training, plan::node_seed(seed, step.node),
                      pool());
      // The output goes back to the step whatever happens.
      struct Restore {
        Tensor& to;
        Tensor& from;
        ~Restore() { to = std::move(from); }
      } restore{p.out, ctx.output};
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
    if (p.out.dtype() != p.out_value->dtype || p.out.shape() != p.out_value->shape)  // an op replaced it
      p.out = value_tensor(plan, step.node, inputs, arena);
    if (emulate) {
      try {
        if (!p.emulated) {
          auto em = emulated_.find(step.node);
          if (em == emulated_.end()) em = emulated_.emplace(step.node, prepare(n, p.exe)).first;
          p.emulated = em->second.get();
        }
        run_emulated(*p.emulated, n, graph, step, p.ins, p.out, training,
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
  CpuModelExecutor(const Graph& graph, plan::Plan& plan, lower::LoweredGraph lowered,
                   const LoadOptions& options, std::vector<std::vector<Tensor>>& grads,
                   std::vector<std::vector<std::vector<Tensor>>>& slots)
      : graph_(graph),
        plan_(plan),
        options_(options),
        grads_(grads),
        slots_(slots),
        exec_(options.threads, std::move(lowered), options.checked) {
    plan::place_in_arena(plan_, graph_,
                         [&](int id) { return plan_.values[static_cast<std::size_t>(id)].bytes(); }, {});
    arena_ = Tensor::empty(DType::U8,
                           {static_cast<std::int64_t>(std::max<std::size_t>(plan_.memory.arena_bytes, 1))});
  }

  std::vector<Tensor> run(const std::vector<Tensor>& inputs, bool training, std::uint64_t seed,
                          std::vector<NodeTime>* profile) override {
    void* arena = arena_.raw();
    if (options_.poison_buffers) std::memset(arena, 0xFF, arena_.nbytes());
    exec_.run(graph_, plan_, inputs, arena, training, seed, profile);
    if (plan_.training.enabled) last_inputs_ = inputs;  // handles: the backward reads saved inputs
    // The outputs are copies (the arena is the next run's): what a run allocates is these.
    std::vector<Tensor> outs;
    outs.reserve(plan_.outputs.size());
    for (int o : plan_.outputs) {
      const plan::Value& v = plan_.values[static_cast<std::size_t>(o)];
      const void* src = v.input_index >= 0 ? inputs.at(static_cast<std::size_t>(v.input_index)).raw()
                                           : static_cast<const std::byte*>(arena) + v.offset;
      Tensor t = Tensor::empty(v.dtype, v.shape);
      if (t.nbytes()) std::memcpy(t.raw(), src, t.nbytes());
      outs.push_back(std::move(t));
    }
    return outs;
  }
  void upload_params() override {}
  void download_params() override {}

  void backward(bool accumulate_params, std::uint64_t seed, bool training, std::vector<NodeTime>* profile,
                comm::GradientSync* sync) override {
    exec_.run_backward(graph_, plan_, last_inputs_, arena_.raw(), grads_, accumulate_params, training, seed,
                       profile, sync);
    last_inputs_.clear();
  }
  std::unique_ptr<comm::GradientSync> make_gradient_sync(comm::Group& group, std::size_t bucket_bytes) override {
    return comm::make_host_sync(group, grads_, bucket_bytes);
  }
  // The parameter gradients are LoadedModel's host tensors, which the backward adds into.
  void zero_grad() override {
    for (auto& row : grads_)
      for (Tensor& g : row)
        if (g.raw() != nullptr) std::memset(g.raw(), 0, g.nbytes());
  }
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
  Tensor arena_;                     // activation bytes
  std::vector<Tensor> last_inputs_;  // the last forward's inputs (the backward reads them)
};

}  // namespace

std::unique_ptr<backend::Executor> make_executor(const Graph& graph, plan::Plan& plan,
                                                 lower::LoweredGraph lowered, const LoadOptions& options,
                                                 std::vector<std::vector<Tensor>>& grads,
                                                 std::vector<std::vector<std::vector<Tensor>>>& slots) {
  return std::make_unique<CpuModelExecutor>(graph, plan, std::move(lowered), options, grads, slots);
}

}  // namespace kg::cpu
