#ifdef KG_HAVE_CUDA
#include "backend/cuda/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <variant>

#include "compile/compiler.hpp"
#include "compile/embedded_sources.hpp"
#include "compile/ptx.hpp"
#include "kg/error.hpp"
#include "lower/launch_plan.hpp"
#include "plan/optimizer.hpp"
#include "util/str.hpp"

namespace kg::cuda {

namespace {
constexpr unsigned kThreads = 256;
}  // namespace

Trainer::Trainer(Context& ctx, const Graph& graph, const lower::LoweredGraph& lowered, const plan::Plan& plan,
                 DevicePtr arena, std::vector<DevicePtr> inputs, std::vector<std::vector<DevicePtr>> params,
                 bool checked, std::optional<VendorOptions> vendor, bool cuda_graph)
    : ctx_(ctx),
      graph_(graph),
      plan_(plan),
      arena_(arena),
      params_(std::move(params)),
      checked_(checked),
      cuda_graph_(cuda_graph && !checked) {
  const plan::TrainingPlan& tp = plan.training;
  // Runtime kernels.
  {
    const std::string& src = compile::kernel_source("train.cu");
    const auto compiled = compile::Compiler::global().compile("kg.train", src, ctx_.arch());
    fill_ = ctx_.function(compiled.ptx, "kg_fill_f32", "[kg.train]");
    add_ = ctx_.function(compiled.ptx, "kg_add_f32", "[kg.train]");
    sgd_ = ctx_.function(compiled.ptx, "kg_sgd_f32", "[kg.train]");
    adamw_ = ctx_.function(compiled.ptx, "kg_adamw_f32", "[kg.train]");
  }
  // Parameter gradients, for the parameters some backward step wants.
  grads_.resize(plan.steps.size());
  for (std::size_t s = 0; s < plan.steps.size(); ++s) grads_[s].resize(plan.steps[s].specs.size());
  for (const auto& b : tp.steps) {
    const auto& st = plan.steps[static_cast<std::size_t>(b.step)];
    for (std::size_t p = 0; p < b.want_param.size(); ++p) {
      if (!b.want_param[p]) continue;
      if (st.specs[p].dtype != DType::F32)
        throw Error(util::cat(graph.node(b.node).label(), " parameter '", st.specs[p].name, "' is ",
                              dtype_name(st.specs[p].dtype), "; training on cuda supports f32 parameters"));
      grads_[static_cast<std::size_t>(b.step)][p] = DeviceBuffer(ctx_, st.params[p].nbytes());
    }
  }
  zero_grad();

  std::map<int, const lower::Executable*> by_node;
  for (const auto& e : lowered.executables) by_node[e.node] = &e;
  auto grad_addr = [&](int node) {
    return arena + plan::grad_offset_of(plan, node);
  };
  for (const auto& b : tp.steps) {
    const Node& n = graph.node(b.node);
    const lower::Executable& e = *by_node.at(b.node);
    Backward bw;
    bw.step = &b;
    bw.label = n.label() + " backward";
    bw.rt = e.runtime_op;
    try {
      const auto& st = plan.steps[static_cast<std::size_t>(b.step)];
      LaunchTensors& t = bw.tensors;
      for (std::size_t i = 0; i < n.inputs.size(); ++i) {
        const int in = n.inputs[i];
        const auto& v = plan.values[static_cast<std::size_t>(in)];
        t.inputs.push_back(
            {b.saves.inputs ? lower::value_address(plan, in, arena, inputs) : 0, v.shape, v.dtype});
        const plan::GradTarget& g = b.inputs[i];
        DevicePtr gp = g.root < 0 ? 0 : g.accumulate ? arena + g.temp_offset : grad_addr(in);
        if (g.root >= 0 && v.dtype != DType::F32)
          throw Error(util::cat("input ", i, " is ", dtype_name(v.dtype),
                                "; training on cuda supports f32 activations"));
        t.grad_inputs.push_back({gp, v.shape, v.dtype});
      }
      const auto& pa = params_.at(static_cast<std::size_t>(b.step));
      for (std::size_t p = 0; p < st.specs.size(); ++p) {
        t.params.push_back({pa.at(p), st.specs[p].shape, st.specs[p].dtype});
        const bool want = p < b.want_param.size() && b.want_param[p];
        bw.direct_param_grads.push_back(want ? grads_[static_cast<std::size_t>(b.step)][p].ptr() : 0);
        bw.temp_param_grads.push_back(want ? arena + b.param_temp_offsets[p] : 0);
        t.grad_params.push_back({bw.direct_param_grads.back(), st.specs[p].shape, st.specs[p].dtype});
      }
      const auto& ov = plan.values[static_cast<std::size_t>(b.node)];
      t.output = {b.saves.output ? lower::value_address(plan, b.node, arena, inputs) : 0, ov.shape, ov.dtype};
      t.grad_output = {grad_addr(b.node), ov.shape, ov.dtype};
      const std::size_t sb = bw.rt->backward_scratch_bytes(t);
      if (sb > 0) {
        bw.scratch = DeviceBuffer(ctx_, sb);
        t.scratch = bw.scratch.ptr();
      }
      bw.module = lower::make_module(e.name + ".backward", e.backward_source, "", ctx_.arch());
      // The launches as the first run will describe them, checked now.
      for (const auto& L :
           lower::check_launches(bw.module, bw.rt->backward_launches(t), n.label(), "backward", &t))
        bw.fns[L.ptx_entry] = ctx_.function(bw.module.ptx, L.ptx_entry, bw.label);
      if (vendor) plan_library(bw, *vendor);
    } catch (const Error& err) {
      throw lower::labelled(bw.label, err);
    } catch (const std::exception& err) {
      throw Error(bw.label + " RuntimeOp failed: " + err.what());
    }
    steps_.push_back(std::move(bw));
  }
  std::size_t workspace = 0;
  for (const auto& bw : steps_)
    for (const auto& lib : bw.library)
      for (const auto& p : lib.plans) workspace = std::max(workspace, p->workspace_bytes());
  if (workspace) workspace_ = DeviceBuffer(ctx_, workspace);
}

void Trainer::plan_library(Backward& bw, const VendorOptions& vendor) {
  LaunchTensors& t = bw.tensors;
  std::vector<Backward::Library> paths;
  for (const auto* grads : {&bw.direct_param_grads, &bw.temp_param_grads}) {
    for (std::size_t p = 0; p < t.grad_params.size(); ++p) t.grad_params[p].ptr = (*grads)[p];
    const auto described = bw.rt->backward_library_calls(t);
    if (!described) break;
    Backward::Library lib;
    for (const LibraryCall& call : described->calls) {
      std::unique_ptr<VendorPlan> p;
      if (const auto* g = std::get_if<GemmCall>(&call.call)) {
        if (const BlasLt* l = BlasLt::get()) p = l->plan(*g, vendor, ctx_.stream(), bw.label);
      } else if (const auto* c = std::get_if<Conv2dCall>(&call.call)) {
        if (const Dnn* l = Dnn::get()) p = l->plan(*c, vendor, ctx_.stream(), bw.label);
      }
      if (!p) break;
      lib.plans.push_back(std::move(p));
      lib.epilogues.push_back(
          call.epilogue.empty()
              ? std::vector<lower::CheckedLaunch>{}
              : lower::check_launches(bw.module, call.epilogue, bw.label, "backward library-call epilogue"));
    }
    if (lib.plans.size() != described->calls.size()) break;  // a call no library takes: the launches serve
    if (!described->launches.empty())
      lib.launches = lower::check_launches(bw.module, described->launches, bw.label, "backward");
    paths.push_back(std::move(lib));
  }
  for (std::size_t p = 0; p < t.grad_params.size(); ++p) t.grad_params[p].ptr = bw.direct_param_grads[p];
  if (paths.size() == 2) bw.library = std::move(paths);
}

void Trainer::launch_checked(Backward& bw, const lower::CheckedLaunch& L) {
  auto f = bw.fns.find(L.ptx_entry);
  if (f == bw.fns.end())
    f = bw.fns.emplace(L.ptx_entry, ctx_.function(bw.module.ptx, L.ptx_entry, bw.label)).first;
  auto kp = L.launch.args.kernel_params();
  ctx_.launch(f->second, L.launch.grid, L.launch.block, L.launch.shared_bytes, kp.data(),
              util::cat(bw.label, " kernel '", bw.module.name, "' entry '", L.entry, "'"));
}

void Trainer::launch_1d(CUfunction f, std::int64_t n, void** params, const std::string& label) {
  const auto blocks =
      static_cast<unsigned>(std::clamp<std::int64_t>((n + kThreads - 1) / kThreads, 1, 65535));
  ctx_.launch(f, Dim3{blocks, 1, 1}, Dim3{kThreads, 1, 1}, 0, params, label);
}

void Trainer::add(DevicePtr dst, DevicePtr src, std::int64_t n, const std::string& label) {
  long long nn = n;
  void* p[] = {&dst, &src, &nn};
  launch_1d(add_, n, p, label);
}

Trainer::~Trainer() {
  for (Captured& c : captured_) release(c);
}

void Trainer::release(Captured& c) {
  const Driver& d = ctx_.driver();
  if (c.exec) d.cuGraphExecDestroy(c.exec);
  if (c.graph) d.cuGraphDestroy(c.graph);
  c.exec = nullptr;
  c.graph = nullptr;
}

std::vector<std::vector<lower::CheckedLaunch>> Trainer::describe(bool accumulate_params, std::uint64_t seed,
                                                                 bool training) {
  std::vector<std::vector<lower::CheckedLaunch>> out(steps_.size());
  for (std::size_t s = 0; s < steps_.size(); ++s) {
    Backward& bw = steps_[s];
    LaunchTensors& t = bw.tensors;
    for (std::size_t p = 0; p < t.grad_params.size(); ++p)
      t.grad_params[p].ptr = accumulate_params ? bw.temp_param_grads[p] : bw.direct_param_grads[p];
    t.seed = plan::node_seed(seed, bw.step->node);
    t.training = training;
    if (!bw.library.empty()) continue;
    try {
      out[s] = lower::check_launches(bw.module, bw.rt->backward_launches(t), graph_.node(bw.step->node).label(),
                                     "backward");
    } catch (const Error& err) {
      throw lower::labelled(bw.label, err);
    }
  }
  return out;
}

void Trainer::prepare(std::uint64_t seed, bool training) {
  prepared_.reset();
  Prepared p;
  p.accumulate_params = last_accumulate_;
  p.seed = seed;
  p.training = training;
  try {
    p.launches = describe(p.accumulate_params, seed, training);
  } catch (const Error&) {
    return;  // backward() describes again and reports it
  }
  prepared_ = std::move(p);
}

void Trainer::backward(bool accumulate_params, std::uint64_t seed, bool training,
                       std::vector<NodeTime>* profile, comm::GradientSync* sync) {
  ctx_.make_current();
  last_accumulate_ = accumulate_params;
  std::vector<std::vector<lower::CheckedLaunch>> launches;
  if (prepared_ && prepared_->accumulate_params == accumulate_params && prepared_->seed == seed &&
      prepared_->training == training)
    launches = std::move(prepared_->launches);
  else
    launches = describe(accumulate_params, seed, training);
  prepared_.reset();
  if (cuda_graph_ && !profile && !sync) {
    Captured& c = captured_[accumulate_params ? 1 : 0];
    bool same = c.described && c.launches.size() == launches.size();
    for (std::size_t s = 0; same && s < launches.size(); ++s) same = lower::same_launches(c.launches[s], launches[s]);
    if (same && c.exec) {
      const Driver& d = ctx_.driver();
      d.check(d.cuGraphLaunch(c.exec, ctx_.stream()), "backward: cuGraphLaunch");
      ++graph_replays_;
      return;
    }
    if (same && capture_and_launch(c, accumulate_params)) {
      ++graph_replays_;
      return;
    }
    // New launches (the first run, a new seed, train mode switched): run them one by one, and
    // capture them if the next run describes the same.
    release(c);
    c.launches = std::move(launches);
    c.described = true;
    enqueue(accumulate_params, c.launches, profile, sync);
    return;
  }
  enqueue(accumulate_params, launches, profile, sync);
}

bool Trainer::capture_and_launch(Captured& c, bool accumulate_params) {
  const Driver& d = ctx_.driver();
  d.check(d.cuStreamBeginCapture(ctx_.stream(), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
          "backward: cuStreamBeginCapture");
  CUgraph g = nullptr;
  try {
    enqueue(accumulate_params, c.launches, nullptr, nullptr);
  } catch (const Error&) {
    // A library call that cannot be captured: end the capture, keep running step by step.
    d.cuStreamEndCapture(ctx_.stream(), &g);
    if (g) d.cuGraphDestroy(g);
    cuda_graph_ = false;
    return false;
  }
  CUresult r = d.cuStreamEndCapture(ctx_.stream(), &g);
  CUgraphExec exec = nullptr;
  if (r == CUDA_SUCCESS) r = d.cuGraphInstantiateWithFlags(&exec, g, 0);
  if (r != CUDA_SUCCESS) {
    if (g) d.cuGraphDestroy(g);
    cuda_graph_ = false;
    return false;
  }
  c.graph = g;
  c.exec = exec;
  d.check(d.cuGraphLaunch(c.exec, ctx_.stream()), "backward: cuGraphLaunch");
  return true;
}

void Trainer::enqueue(bool accumulate_params, const std::vector<std::vector<lower::CheckedLaunch>>& launches,
                      std::vector<NodeTime>* profile, comm::GradientSync* sync) {
  const plan::TrainingPlan& tp = plan_.training;
  for (int r : tp.zero_roots)
    ctx_.fill_bytes_async(arena_ + tp.grad_offset[static_cast<std::size_t>(r)], 0,
                          plan_.values[static_cast<std::size_t>(r)].bytes());
  {
    const auto& lv = plan_.values[static_cast<std::size_t>(tp.loss_node)];
    if (lv.dtype != DType::F32)
      throw Error("training on cuda needs an f32 loss, got " + std::string(dtype_name(lv.dtype)));
    DevicePtr lp = arena_ + plan::grad_offset_of(plan_, tp.loss_node);
    float one = 1.0f;
    long long n = numel_of(lv.shape);
    void* p[] = {&lp, &one, &n};
    launch_1d(fill_, n, p, "[kg.train loss seed]");
  }
  for (std::size_t s = 0; s < steps_.size(); ++s) {
    Backward& bw = steps_[s];
    const plan::BackwardStep& b = *bw.step;
    const Node& n = graph_.node(b.node);
    auto t0 = std::chrono::steady_clock::now();
    if (profile) ctx_.synchronize();
    const LaunchTensors& t = bw.tensors;
    try {
      if (!bw.library.empty()) {
        const Backward::Library& lib = bw.library[accumulate_params ? 1 : 0];
        for (std::size_t c = 0; c < lib.plans.size(); ++c) {
          lib.plans[c]->run(ctx_.stream(), workspace_.ptr(), bw.label);
          if (!lib.plans[c]->fused_epilogue())
            for (const auto& L : lib.epilogues[c]) launch_checked(bw, L);
        }
        for (const auto& L : lib.launches) launch_checked(bw, L);
      } else {
        for (const auto& L : launches[s]) launch_checked(bw, L);
      }
      if (checked_) ctx_.synchronize(bw.label);
    } catch (const Error& err) {
      throw lower::labelled(bw.label, err);
    }
    for (std::size_t i = 0; i < b.inputs.size(); ++i) {
      const plan::GradTarget& g = b.inputs[i];
      if (g.root < 0 || !g.accumulate) continue;
      const auto& v = plan_.values[static_cast<std::size_t>(n.inputs[i])];
      add(arena_ + plan::grad_offset_of(plan_, n.inputs[i]), arena_ + g.temp_offset, numel_of(v.shape),
          bw.label + " gradient sum");
    }
    if (accumulate_params)
      for (std::size_t p = 0; p < bw.direct_param_grads.size(); ++p)
        if (bw.direct_param_grads[p])
          add(bw.direct_param_grads[p], bw.temp_param_grads[p], numel_of(t.grad_params[p].shape),
              bw.label + " parameter gradient sum");
    if (profile) {
      ctx_.synchronize();
      std::string kernel = bw.module.name;
      if (!bw.library.empty())
        for (const auto& p : bw.library[0].plans) kernel += "; " + p->describe();
      profile->push_back(
          {n.name, n.op_name() + " (backward)",
           std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(), kernel});
    }
    if (sync) sync->ready(static_cast<std::size_t>(b.step));
  }
  if (sync) sync->finish();
}

std::vector<std::vector<DeviceTensor>> Trainer::gradient_tensors() const {
  std::vector<std::vector<DeviceTensor>> out(grads_.size());
  for (std::size_t s = 0; s < grads_.size(); ++s)
    for (std::size_t p = 0; p < grads_[s].size(); ++p) {
      const ParamSpec& spec = plan_.steps[s].specs[p];
      out[s].push_back(DeviceTensor{grads_[s][p].ptr(), spec.shape, spec.dtype});
    }
  return out;
}

void Trainer::zero_grad() {
  ctx_.make_current();
  for (auto& row : grads_)
    for (auto& g : row)
      if (g.ptr()) ctx_.fill_bytes_async(g.ptr(), 0, g.bytes());
}

void Trainer::reset_optimizer(const OptimizerOptions& options) {
  ctx_.make_current();
  const std::size_t n_slots = plan::optimizer_slots(options).size();
  slots_.clear();
  slots_.resize(grads_.size());
  for (std::size_t s = 0; s < grads_.size(); ++s) {
    slots_[s].resize(grads_[s].size());
    for (std::size_t p = 0; p < grads_[s].size(); ++p) {
      if (!grads_[s][p].ptr()) continue;
      for (std::size_t k = 0; k < n_slots; ++k) {
        slots_[s][p].emplace_back(ctx_, grads_[s][p].bytes());
        ctx_.fill_bytes_async(slots_[s][p].back().ptr(), 0, grads_[s][p].bytes());
      }
    }
  }
}

void Trainer::step(const OptimizerOptions& o, std::int64_t step) {
  ctx_.make_current();
  for (std::size_t s = 0; s < grads_.size(); ++s)
    for (std::size_t p = 0; p < grads_[s].size(); ++p) {
      if (!grads_[s][p].ptr()) continue;
      DevicePtr param = params_[s][p], grad = grads_[s][p].ptr();
      long long n = static_cast<long long>(grads_[s][p].bytes() / sizeof(float));
      float lr = static_cast<float>(o.lr), wd = static_cast<float>(o.weight_decay);
      const std::string label = "[optimizer @ " + plan_.steps[s].specs[p].name + "]";
      if (o.kind == OptimizerOptions::Kind::Sgd) {
        DevicePtr buf = slots_.at(s).at(p).empty() ? 0 : slots_[s][p][0].ptr();
        float mom = static_cast<float>(o.momentum);
        int first = step == 1 ? 1 : 0;
        void* a[] = {&param, &grad, &buf, &lr, &wd, &mom, &first, &n};
        launch_1d(sgd_, n, a, label);
      } else {
        DevicePtr m = slots_.at(s).at(p).at(0).ptr(), v = slots_[s][p].at(1).ptr();
        float b1 = static_cast<float>(o.beta1), b2 = static_cast<float>(o.beta2),
              eps = static_cast<float>(o.eps);
        float c1 = static_cast<float>(1.0 - std::pow(o.beta1, static_cast<double>(step)));
        float c2 = static_cast<float>(std::sqrt(1.0 - std::pow(o.beta2, static_cast<double>(step))));
        void* a[] = {&param, &grad, &m, &v, &lr, &wd, &b1, &b2, &c1, &c2, &eps, &n};
        launch_1d(adamw_, n, a, label);
      }
    }
}

void Trainer::download_grads(std::vector<std::vector<Tensor>>& grads) {
  ctx_.make_current();
  ctx_.synchronize();
  for (std::size_t s = 0; s < grads_.size(); ++s)
    for (std::size_t p = 0; p < grads_[s].size(); ++p)
      if (grads_[s][p].ptr()) ctx_.download(grads[s][p].raw(), grads_[s][p].ptr(), grads_[s][p].bytes());
}

void Trainer::download_slots(std::vector<std::vector<std::vector<Tensor>>>& slots) {
  ctx_.make_current();
  ctx_.synchronize();
  for (std::size_t s = 0; s < slots_.size(); ++s)
    for (std::size_t p = 0; p < slots_[s].size(); ++p)
      for (std::size_t k = 0; k < slots_[s][p].size(); ++k)
        ctx_.download(slots[s][p][k].raw(), slots_[s][p][k].ptr(), slots_[s][p][k].bytes());
}

void Trainer::upload_slots(const std::vector<std::vector<std::vector<Tensor>>>& slots) {
  ctx_.make_current();
  for (std::size_t s = 0; s < slots_.size(); ++s)
    for (std::size_t p = 0; p < slots_[s].size(); ++p)
      for (std::size_t k = 0; k < slots_[s][p].size(); ++k)
        ctx_.upload(slots_[s][p][k].ptr(), slots[s][p][k].raw(), slots_[s][p][k].bytes());
}

}  // namespace kg::cuda
#endif
