#include "backend/cpu/executor.hpp"

#include <chrono>
#include <cstring>
#include <optional>
#include <random>

#include "backend/emu/executor.hpp"
#include "backend/emu/host_jit.hpp"
#include "graph/no_cpu_impl.hpp"
#include "kg/error.hpp"
#include "kg/runtime_op.hpp"
#include "lower/launch_check.hpp"
#include "lower/launch_plan.hpp"
#include "runtime/plan_builder.hpp"
#include "util/str.hpp"

namespace kg::cpu {

// An op without a CPU implementation, run through the CUDA emulator: the lowering taken once,
// the kernel compiled once (the first launch goes through emu::launch and its checks; later ones
// straight to the emulator's grid runner), the parameters a RuntimeOp declares for itself
// initialised once, and scratch and padded-output buffers kept for the next run.
struct Executor::EmulatedNode {
  Lowered lowered;
  std::shared_ptr<const emu::JitModule> module;
  const emu::KernelEntry* kernel = nullptr;
  bool launched = false;           // the checked first launch is done
  std::vector<Tensor> own_params;  // declared by the RuntimeOp when the op declares none
  std::vector<ParamSpec> own_specs;
  Tensor scratch;  // U8
  Tensor padded;   // output with the RuntimeOp's row stride, when it pads
  std::int64_t row_stride = 0;
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

// Lowers the node and checks its RuntimeOp against the concrete shapes, as the GPU path does at
// load: activation inputs, the concrete output shape, parameter shapes; parameters the RuntimeOp
// declares for itself are created from param_init_data (else zeros).
std::shared_ptr<Executor::EmulatedNode> prepare(const Node& n, const runtime::Step& step,
                                                const std::vector<Tensor>& ins, const Tensor& out) {
  const std::string label = n.label();
  std::optional<Lowered> l = n.op->op().lower();
  if (!l)
    throw Error(label +
                " has no CPU implementation (override CustomOp::cpu_forward) and no lowering to run "
                "through the CUDA emulator instead (CustomOp::lower() returns nothing)");
  if (!l->runtime_op) throw Error(label + " lower() returned no RuntimeOp");
  if (l->source.empty()) throw Error(label + " lower() returned an empty kernel source");
  if (l->name.empty()) l->name = n.op->name();
  auto e = std::make_shared<Executor::EmulatedNode>();
  e->lowered = std::move(*l);
  const RuntimeOp& rt = *e->lowered.runtime_op;

  std::vector<std::vector<std::int64_t>> in_shapes;
  for (const auto& t : ins) in_shapes.push_back(t.shape());
  const auto& out_shape = out.shape();
  std::mt19937_64 rng(0);
  lower::RuntimeOpSizes sizes = lower::consult_runtime_op(n, rt, in_shapes, out_shape, step.specs, rng);
  e->own_specs = std::move(sizes.new_specs);
  e->own_params = std::move(sizes.new_params);
  const std::int64_t last = out_shape.empty() ? 1 : out_shape.back();
  e->row_stride = sizes.row_stride;
  if (e->row_stride != last && last > 0)
    e->padded = Tensor::empty(out.dtype(), {numel_of(out_shape) / last, e->row_stride});
  if (sizes.scratch_bytes > 0)
    e->scratch = Tensor::empty(DType::U8, {static_cast<std::int64_t>(sizes.scratch_bytes)});
  try {
    e->module = emu::HostJit::global().load(e->lowered.name, e->lowered.source);
    e->kernel = &e->module->find(e->lowered.entry_point, label);
  } catch (const Error& err) {
    const std::string what = err.what();
    throw Error(what.rfind(label, 0) == 0 ? what : label + " " + what);
  }
  return e;
}

// Packs and runs every launch of the node's kernel on the emulator, with host addresses.
void run_emulated(Executor::EmulatedNode& e, const Node& n, const runtime::Step& step,
                  const std::vector<Tensor>& ins, Tensor& out, const RunInfo& run) {
  const std::string label = n.label();
  const RuntimeOp& rt = *e.lowered.runtime_op;
  const auto& out_shape = out.shape();
  std::vector<DeviceTensor> dins;
  for (const auto& t : ins) dins.push_back({host_address(t), t.shape(), t.dtype()});
  dins.resize(static_cast<std::size_t>(rt.n_activation_inputs()));
  const std::vector<Tensor>& params = step.specs.empty() ? e.own_params : step.params;
  const std::vector<ParamSpec>& specs = step.specs.empty() ? e.own_specs : step.specs;
  std::vector<DeviceTensor> dparams;
  for (std::size_t i = 0; i < params.size(); ++i)
    dparams.push_back({host_address(params[i]), specs[i].shape, specs[i].dtype});
  const bool padded = e.padded.raw() != nullptr;
  const Tensor& target = padded ? e.padded : out;
  const DeviceTensor dout{host_address(target), out_shape, out.dtype()};
  const DevicePtr scratch = e.scratch.numel() > 0 ? host_address(e.scratch) : 0;

  const int nl = rt.n_launches_for_run(run, out_shape);
  if (nl < 1) throw Error(util::cat(label, " n_launches is ", nl));
  for (int i = 0; i < nl; ++i) {
    const Dim3 grid = rt.grid_for_run(run, i, out_shape), block = rt.block_for_launch(i);
    const std::size_t shared = rt.dynamic_shared_bytes(out_shape);
    lower::check_grid(grid, out_shape, label, i);
    lower::ArgPack pack;
    rt.pack_args_for_run(run, i, dins, dparams, dout, out_shape, e.row_stride, scratch, pack);
    if (!e.launched) {
      emu::LaunchOptions o;
      o.label = label;
      emu::launch(e.lowered.name, e.lowered.source, e.lowered.entry_point, grid, block, shared, pack, o);
      continue;
    }
    std::vector<std::vector<std::byte>> bytes;
    for (const auto& a : pack.args()) bytes.push_back(a.data);
    std::vector<void*> ptrs;
    for (auto& b : bytes) ptrs.push_back(b.data());
    emu::GridLaunch gl;
    gl.kernel = e.kernel;
    gl.grid = grid;
    gl.block = block;
    gl.shared = shared;
    gl.args = ptrs.data();
    gl.label = label;
    emu::run_grid(gl);
  }
  e.launched = true;
  if (padded) {
    const std::int64_t last = out_shape.back();
    const std::size_t row = static_cast<std::size_t>(last) * dtype_size(out.dtype());
    const std::size_t stride = static_cast<std::size_t>(e.row_stride) * dtype_size(out.dtype());
    const auto* src = static_cast<const std::byte*>(target.raw());
    auto* dst = static_cast<std::byte*>(out.raw());
    for (std::int64_t r = 0; r < out.numel() / last; ++r)
      std::memcpy(dst + static_cast<std::size_t>(r) * row, src + static_cast<std::size_t>(r) * stride, row);
  }
}

// The backward twin of PoolContext.
class PoolBackwardContext final : public CpuBackwardContext {
 public:
  PoolBackwardContext(std::span<const Tensor> in, std::span<const Tensor> ps, Tensor out, Tensor grad_out,
                      std::span<Tensor> grad_in, std::span<Tensor> grad_ps, bool train, std::uint64_t seed,
                      ThreadPool& pool)
      : CpuBackwardContext(in, ps, std::move(out), std::move(grad_out), grad_in, grad_ps, train, seed), pool_(pool) {}
  void parallel_for(std::int64_t n, std::int64_t grain, const RangeFn& fn) const override {
    pool_.parallel_for(n, grain, fn);
  }

 private:
  ThreadPool& pool_;
};

template <class T> void add_span(T* dst, const T* src, std::int64_t b, std::int64_t e) {
  for (std::int64_t i = b; i < e; ++i) dst[i] += src[i];
}

// dst += src (same dtype and element count; float dtypes).
void add_into(const Tensor& dst_t, const Tensor& src, ThreadPool& pool) {
  Tensor dst = dst_t;
  const std::int64_t n = dst.numel();
  if (src.numel() != n || src.dtype() != dst.dtype())
    throw Error(util::cat("gradient sum: ", sizes_to_string(src.shape()), " ", dtype_name(src.dtype()), " into ",
                          sizes_to_string(dst.shape()), " ", dtype_name(dst.dtype())));
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
        Tensor one = Tensor::wrap(static_cast<std::byte*>(dst.raw()) + static_cast<std::size_t>(i) * dtype_size(dst.dtype()),
                                  dst.dtype(), {});
        one.fill(dst.item(i) + src.item(i));
      }
  }
}

// Runs the lowered backward kernels of an op without a CPU backward through the emulator.
// The lowering and backward source of an op without a CPU backward, checked.
Executor::EmulatedBackward prepare_backward(const Node& n) {
  const std::string label = n.label();
  std::optional<Lowered> l = n.op->op().lower();
  if (!l || !l->runtime_op || !l->runtime_op->has_backward())
    throw Error(label + " has no backward (CustomOp::cpu_backward, or RuntimeOp::has_backward with "
                        "lower_backward_source())");
  std::string source = n.op->op().lower_backward_source();
  if (source.empty()) throw Error(label + " RuntimeOp::has_backward() is true but lower_backward_source() is empty");
  if (l->name.empty()) l->name = n.op->name();
  return {std::move(*l), std::move(source)};
}

void run_emulated_backward(const Node& n, const Executor::EmulatedBackward& eb, const std::vector<Tensor>& ins,
                           const std::vector<Tensor>& params, const std::vector<ParamSpec>& specs, const Tensor& out,
                           const Tensor& grad_out, std::vector<Tensor>& grad_in, std::vector<Tensor>& grad_params,
                           std::uint64_t seed, bool training) {
  const std::string label = n.label();
  const RuntimeOp& rt = *eb.lowered.runtime_op;
  const std::string& source = eb.source;
  auto dev = [](const Tensor& t) { return DeviceTensor{host_address(t), t.shape(), t.dtype()}; };
  BackwardTensors bt;
  for (const auto& t : ins) bt.inputs.push_back(dev(t));
  bt.inputs.resize(static_cast<std::size_t>(rt.n_activation_inputs()));
  for (std::size_t i = 0; i < params.size(); ++i) bt.params.push_back({host_address(params[i]), specs[i].shape, specs[i].dtype});
  bt.output = dev(out);
  bt.grad_output = dev(grad_out);
  for (const auto& t : grad_in) bt.grad_inputs.push_back(dev(t));
  bt.grad_inputs.resize(bt.inputs.size());
  for (const auto& t : grad_params) bt.grad_params.push_back(dev(t));
  bt.seed = seed;
  bt.training = training;
  Tensor scratch;
  const std::size_t sb = rt.backward_scratch_bytes(bt);
  if (sb > 0) {
    scratch = Tensor::empty(DType::U8, {static_cast<std::int64_t>(sb)});
    bt.scratch = host_address(scratch);
  }
  const int nl = rt.n_backward_launches(bt);
  if (nl < 1) throw Error(util::cat(label, " n_backward_launches is ", nl));
  const std::string name = eb.lowered.name + ".backward";
  for (int i = 0; i < nl; ++i) {
    const Dim3 grid = rt.backward_grid(i, bt), block = rt.backward_block(i);
    lower::check_grid(grid, bt.grad_output.shape, label + " backward", i);
    lower::ArgPack pack;
    rt.pack_backward_args(i, bt, pack);
    emu::LaunchOptions o;
    o.label = label + " backward";
    emu::launch(name, source, rt.backward_entry_point(i), grid, block, rt.backward_dynamic_shared_bytes(i, bt), pack, o);
  }
}

}  // namespace

void Executor::run_backward(const Graph& graph, runtime::Plan& plan, const std::vector<Tensor>& inputs, void* arena,
                            std::vector<std::vector<Tensor>>& param_grads, bool accumulate_params, bool training,
                            std::uint64_t seed, std::vector<NodeTime>* profile) {
  using clock = std::chrono::steady_clock;
  const runtime::TrainingPlan& tp = plan.training;
  auto* base = static_cast<std::byte*>(arena);
  auto grad_of = [&](int node) {
    const auto& v = plan.values[static_cast<std::size_t>(node)];
    return Tensor::wrap(base + tp.grad_offset[static_cast<std::size_t>(v.root)], v.dtype, v.shape);
  };
  for (int r : tp.zero_roots) std::memset(base + tp.grad_offset[static_cast<std::size_t>(r)], 0,
                                          plan.values[static_cast<std::size_t>(r)].bytes());
  grad_of(tp.loss_node).fill(1.0);

  std::vector<Tensor> ins, grad_in, grad_params;
  for (const runtime::BackwardStep& b : tp.steps) {
    const Node& n = graph.node(b.node);
    const runtime::Step& step = plan.steps[static_cast<std::size_t>(b.step)];
    auto t0 = clock::now();
    ins.clear();
    grad_in.clear();
    grad_params.clear();
    for (std::size_t i = 0; i < n.inputs.size(); ++i) {
      const int in = n.inputs[i];
      const auto& v = plan.values[static_cast<std::size_t>(in)];
      ins.push_back(b.saves.inputs ? value_tensor(plan, in, inputs, arena) : Tensor::wrap(nullptr, v.dtype, v.shape));
      const runtime::GradTarget& g = b.inputs[i];
      if (g.root < 0)
        grad_in.push_back(Tensor::wrap(nullptr, v.dtype, v.shape));
      else if (g.accumulate)
        grad_in.push_back(Tensor::wrap(base + g.temp_offset, v.dtype, v.shape));
      else
        grad_in.push_back(grad_of(in));
    }
    const auto& ov = plan.values[static_cast<std::size_t>(b.node)];
    Tensor out = b.saves.output ? value_tensor(plan, b.node, inputs, arena) : Tensor::wrap(nullptr, ov.dtype, ov.shape);
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
    const std::uint64_t s = runtime::node_seed(seed, b.node);
    try {
      if (n.op->op().has_cpu_backward()) {
        PoolBackwardContext ctx(ins, step.params, out, grad_of(b.node), grad_in, grad_params, training, s, pool());
        n.op->op().cpu_backward(ctx);
      } else {
        auto eb = emulated_backward_.find(b.node);
        if (eb == emulated_backward_.end()) eb = emulated_backward_.emplace(b.node, prepare_backward(n)).first;
        run_emulated_backward(n, eb->second, ins, step.params, step.specs, out, grad_of(b.node), grad_in, grad_params,
                              s, training);
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

Executor::Executor(int threads) {
  if (threads > 0) own_ = std::make_unique<ThreadPool>(threads);
}

Tensor Executor::value_tensor(const runtime::Plan& plan, int node, const std::vector<Tensor>& inputs,
                              void* arena) {
  const auto& v = plan.values.at(static_cast<std::size_t>(node));
  if (v.input_index >= 0) {
    const Tensor& in = inputs.at(static_cast<std::size_t>(v.input_index));
    return Tensor::wrap(const_cast<void*>(in.raw()), v.dtype, v.shape);
  }
  return Tensor::wrap(static_cast<std::byte*>(arena) + v.offset, v.dtype, v.shape);
}

void Executor::run(const Graph& graph, runtime::Plan& plan, const std::vector<Tensor>& inputs, void* arena,
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
    bool emulate = emulated != emulated_.end();
    if (!emulate) {
      PoolContext ctx(ins, step.params, out, training, runtime::node_seed(seed, step.node), pool());
      try {
        n.op->op().cpu_forward(ctx);
      } catch (const NoCpuImplementation&) {
        emulate = true;
      } catch (const Error& e) {
        throw Error(n.label() + " " + e.what());
      } catch (const std::exception& e) {
        throw Error(n.label() + " cpu_forward failed: " + e.what());
      }
    }
    if (emulate) {
      try {
        if (emulated == emulated_.end())
          emulated = emulated_.emplace(step.node, prepare(n, step, ins, out)).first;
        run_emulated(*emulated->second, n, step, ins, out,
                     RunInfo{training, training ? runtime::node_seed(seed, step.node) : 0});
      } catch (const Error& e) {
        const std::string what = e.what();
        throw Error(what.rfind(n.label(), 0) == 0 ? what : n.label() + " " + what);
      } catch (const std::exception& e) {
        throw Error(n.label() + " emulated kernel failed: " + e.what());
      }
    }
    if (profile)
      profile->push_back(
          {n.name, n.op_name(), std::chrono::duration<double, std::milli>(clock::now() - t0).count()});
  }
}

}  // namespace kg::cpu
