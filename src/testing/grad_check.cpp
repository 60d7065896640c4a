// kg::testing::check_gradients: an op's CPU backward against central finite differences of its
// CPU forward, then its lowered backward kernels (emulated, and on a GPU when there is one)
// against its CPU backward.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <span>

#include "backend/emu/executor.hpp"
#include "compile/compiler.hpp"
#include "graph/no_cpu_impl.hpp"
#include "kg/cuda.hpp"
#include "kg/error.hpp"
#include "kg/graph.hpp"
#include "kg/model.hpp"
#include "kg/runtime_op.hpp"
#include "kg/testing.hpp"
#include "lower/launch_plan.hpp"
#include "testing/check_util.hpp"
#include "util/half.hpp"
#include "util/str.hpp"

namespace kg::testing {
namespace {

using namespace detail;

// Writes `v` into element `i` of a float tensor.
void set_item(Tensor& t, std::int64_t i, double v) {
  const auto k = static_cast<std::size_t>(i);
  switch (t.dtype()) {
    case DType::F64:
      t.data<double>()[k] = v;
      return;
    case DType::F32:
      t.data<float>()[k] = static_cast<float>(v);
      return;
    case DType::F16:
      static_cast<std::uint16_t*>(t.raw())[k] = util::float_to_half(static_cast<float>(v));
      return;
    case DType::BF16:
      static_cast<std::uint16_t*>(t.raw())[k] = util::float_to_bf16(static_cast<float>(v));
      return;
    default:
      throw Error(util::cat("check_gradients: cannot perturb a ", dtype_name(t.dtype()), " tensor"));
  }
}

Tensor poisoned(DType dtype, const std::vector<std::int64_t>& shape, unsigned char byte = 0xFF) {
  Tensor t = Tensor::empty(dtype, shape);
  if (t.nbytes()) std::memset(t.raw(), byte, t.nbytes());
  return t;
}

// A tensor with the shape and dtype of `t` and no data (what the runtime passes for a tensor
// the backward did not ask to keep, and for a gradient nobody wants).
Tensor no_data(const Tensor& t) { return Tensor::wrap(nullptr, t.dtype(), t.shape()); }

// The float dtype the check runs in: f64 stays, every other float dtype becomes `to`.
std::vector<DType> with_float(const std::vector<DType>& dtypes, DType to) {
  std::vector<DType> r = dtypes;
  for (auto& d : r)
    if (is_floating(d)) d = to;
  return r;
}

// The op recorded on concrete inputs of one set of dtypes, with its inputs and parameters.
struct Setup {
  std::vector<DType> dtypes;
  std::string label;  // "[op @ node]"
  std::vector<std::int64_t> out_shape;
  DType out_dtype = DType::F32;
  std::vector<Tensor> inputs;
  std::vector<ParamSpec> specs;    // CustomOp::parameters()
  std::vector<std::string> names;  // their full dotted names
  std::vector<Tensor> params;
  Tensor grad_output;
  LowerContext context;  // what lower() is told (emulator target; sm_90 for the NVRTC check)
};

// Replays typed arguments into a visitor (for the by-hand kernel launcher).
void replay(const KernelArgs& args, ArgVisitor& v) {
  for (const auto& a : args.args()) {
    const auto* d = a.data().data();
    switch (a.kind()) {
      case KernelArg::Kind::Pointer: {
        DevicePtr p;
        std::memcpy(&p, d, sizeof p);
        v.pointer(p);
        break;
      }
      case KernelArg::Kind::I32: {
        std::int32_t x;
        std::memcpy(&x, d, sizeof x);
        v.i32(x);
        break;
      }
      case KernelArg::Kind::I64: {
        std::int64_t x;
        std::memcpy(&x, d, sizeof x);
        v.i64(x);
        break;
      }
      case KernelArg::Kind::U32: {
        std::uint32_t x;
        std::memcpy(&x, d, sizeof x);
        v.u32(x);
        break;
      }
      case KernelArg::Kind::F32: {
        float x;
        std::memcpy(&x, d, sizeof x);
        v.f32(x);
        break;
      }
      case KernelArg::Kind::F64: {
        double x;
        std::memcpy(&x, d, sizeof x);
        v.f64(x);
        break;
      }
      case KernelArg::Kind::Bytes:
        v.bytes(d, a.data().size());
        break;
    }
  }
}

// Records `op` on inputs of `shapes` × `dtypes`. Throws kg::Error when the op refuses them.
Setup record(const CustomOp& op, const CustomData& data, const std::vector<std::vector<std::int64_t>>& shapes,
             const std::vector<DType>& dtypes) {
  Setup s;
  s.dtypes = dtypes;
  auto graph = Graph::create();
  std::vector<SymTensor> xs;
  for (std::size_t i = 0; i < shapes.size(); ++i)
    xs.push_back(graph->input(dtypes[i], Shape::of(shapes[i]), util::cat("x", i)));
  SymTensor y = graph->record(data, xs);
  const Node& node = graph->node(y.node());
  s.label = node.label();
  if (!node.shape.is_concrete())
    throw Error(util::cat(s.label, " the output shape ", node.shape.to_string(),
                          " has a dynamic dim although every input size is known"));
  s.out_shape = node.shape.sizes();
  s.out_dtype = node.dtype;
  std::vector<Shape> in_shapes;
  for (const auto& v : shapes) in_shapes.push_back(Shape::of(v));
  // The parameters as recorded: a dtype that follows an input's resolved, a 16-bit node's narrowed.
  s.specs = op.parameters(in_shapes);
  for (std::size_t k = 0; k < s.specs.size() && k < node.params.size(); ++k) {
    s.specs[k].dtype = node.params[k].dtype;
    s.specs[k].init = node.params[k].init;
  }
  s.context.node = node.name;
  s.context.input_dtypes = dtypes;
  s.context.output_dtype = node.dtype;
  s.context.input_shapes = in_shapes;
  s.context.output_shape = node.shape;
  s.context.concrete_input_shapes = shapes;
  s.context.concrete_output_shape = s.out_shape;
  s.context.mode = LoweringMode::Training;
  for (std::size_t k = 0; k < s.specs.size(); ++k)
    s.names.push_back(k < node.params.size() ? node.params[k].name : s.specs[k].name);
  return s;
}

// Parameter values: trainable ones uniform in [-1, 1], the others by their ParamInit.
Tensor make_param(std::mt19937_64& rng, const ParamSpec& spec, const std::string& name,
                  const std::string& label) {
  if (spec.trainable && is_floating(spec.dtype)) return random_input(rng, spec.dtype, spec.shape);
  const ParamInit& init = spec.init;
  Tensor t = Tensor::empty(spec.dtype, spec.shape);
  switch (init.kind) {
    case ParamInit::Kind::Constant:
      t.fill(init.a);
      return t;
    case ParamInit::Kind::Data:
      if (init.data.size() != t.nbytes())
        throw Error(util::cat(label, " parameter '", name, "': ParamInit data holds ", init.data.size(),
                              " bytes but ", sizes_to_string(spec.shape), " ", dtype_name(spec.dtype), " is ",
                              t.nbytes(), " bytes"));
      if (t.nbytes()) std::memcpy(t.raw(), init.data.data(), t.nbytes());
      return t;
    case ParamInit::Kind::Uniform:
    case ParamInit::Kind::Normal: {
      Tensor d = Tensor::empty(DType::F64, spec.shape);
      std::uniform_real_distribution<double> u(init.a, init.b);
      std::normal_distribution<double> n(init.a, init.b > 0 ? init.b : 1.0);
      for (std::int64_t i = 0; i < d.numel(); ++i)
        d.data<double>()[static_cast<std::size_t>(i)] =
            init.kind == ParamInit::Kind::Uniform ? u(rng) : n(rng);
      return spec.dtype == DType::F64 ? d : d.to(spec.dtype);
    }
  }
  return t;
}

// The same values in other float dtypes (integer tensors are kept).
std::vector<Tensor> convert(const std::vector<Tensor>& ts, const std::vector<DType>& dtypes) {
  std::vector<Tensor> r;
  for (std::size_t i = 0; i < ts.size(); ++i)
    r.push_back(ts[i].dtype() == dtypes[i] ? ts[i].clone() : ts[i].to(dtypes[i]));
  return r;
}

// Which forward tensors the backward gets: their data, NaN-filled stand-ins, or none.
enum class Given { Data, Poison, Null };

// Memory for one lowered backward run: host copies (emulator) or device buffers (GPU).
class BackwardMemory {
 public:
  explicit BackwardMemory(bool gpu) : gpu_(gpu) {}
  // A buffer holding `t`'s values (or 0xFF bytes when `poison`), its DeviceTensor.
  DeviceTensor add(const Tensor& t, const std::string& name, bool poison) {
    Entry e;
    e.name = name;
    if (gpu_) {
      e.device = std::make_unique<cuda::DeviceTensorBuffer>(t.dtype(), t.shape());
      if (poison)
        e.device->fill_bytes(0xFF);
      else if (t.nbytes())
        e.device->upload(t);
      e.tensor = e.device->tensor();
    } else {
      // Host memory aligned like a device allocation.
      const std::size_t bytes = t.nbytes();
      e.host.reset(new std::byte[bytes + 256]);
      const auto p = reinterpret_cast<std::uintptr_t>(e.host.get());
      auto* data = reinterpret_cast<std::byte*>((p + 255) & ~std::uintptr_t(255));
      if (poison)
        std::memset(data, 0xFF, bytes);
      else if (bytes)
        std::memcpy(data, t.raw(), bytes);
      e.tensor = {reinterpret_cast<std::uintptr_t>(data), t.shape(), t.dtype()};
      e.bytes = bytes;
    }
    entries_.push_back(std::move(e));
    return entries_.back().tensor;
  }
  std::vector<emu::HostBuffer> host_buffers() const {
    std::vector<emu::HostBuffer> r;
    for (const auto& e : entries_) r.push_back({e.tensor.ptr, e.bytes, e.name});
    return r;
  }
  // The values of the buffer at address `ptr`.
  Tensor read(const DeviceTensor& d) const {
    if (numel_of(d.shape) == 0) return Tensor::empty(d.dtype, d.shape);
    for (const auto& e : entries_) {
      if (e.tensor.ptr != d.ptr) continue;
      if (gpu_) return e.device->download();
      Tensor t = Tensor::empty(d.dtype, d.shape);
      if (t.nbytes()) std::memcpy(t.raw(), reinterpret_cast<const void*>(d.ptr), t.nbytes());
      return t;
    }
    throw Error("check_gradients: no buffer at the address of a gradient");
  }

 private:
  struct Entry {
    std::string name;
    DeviceTensor tensor;
    std::size_t bytes = 0;
    std::unique_ptr<std::byte[]> host;
    std::unique_ptr<cuda::DeviceTensorBuffer> device;
  };
  bool gpu_;
  std::vector<Entry> entries_;
};

class GradChecker {
 public:
  GradChecker(CheckOpReport& report, const CustomData& op,
              const std::vector<std::vector<std::int64_t>>& shapes, const std::vector<DType>& dtypes,
              const GradCheckOptions& o, std::string prefix)
      : rep_(report, "[" + op.name() + "]"),
        data_(op),
        op_(op.op()),
        shapes_(shapes),
        dtypes_(dtypes),
        o_(o),
        prefix_(std::move(prefix)) {}

  void run();

 private:
  std::string at(const std::string& stage) const { return prefix_ + stage; }
  // "input 0" / "parameter 'fc.weight'".
  std::string tensor_name(const Setup& s, std::size_t k) const {
    return k < s.inputs.size() ? util::cat("input ", k)
                               : util::cat("parameter '", s.names[k - s.inputs.size()], "'");
  }
  bool wants(const Setup& s, std::size_t k) const {
    if (k < s.inputs.size()) return is_floating(s.inputs[k].dtype());
    const ParamSpec& p = s.specs[k - s.inputs.size()];
    return p.trainable && is_floating(p.dtype);
  }
  // The op's forward: its cpu_forward, or, for an op without one, its kernels run by the CUDA
  // emulator (so that finite differences have a forward to differentiate).
  Tensor forward(const Setup& s, const std::vector<Tensor>& inputs, const std::vector<Tensor>& params) const {
    Tensor out = poisoned(s.out_dtype, s.out_shape);
    if (!no_cpu_forward_) {
      try {
        CpuContext ctx(inputs, params, out, o_.training, op_seed_);
        op_.cpu_forward(ctx);
        return out;
      } catch (const NoCpuImplementation&) {
        no_cpu_forward_ = true;
      }
    }
    emulated_forward(s, inputs, params, out);
    return out;
  }
  void emulated_forward(const Setup& s, const std::vector<Tensor>& inputs, const std::vector<Tensor>& params,
                        Tensor& out) const;
  // sum(grad_output * forward(inputs, params)) in double.
  double objective(const Setup& s, const std::vector<Tensor>& inputs,
                   const std::vector<Tensor>& params) const {
    const Tensor y = forward(s, inputs, params);
    double sum = 0;
    for (std::int64_t i = 0; i < y.numel(); ++i) sum += s.grad_output.item(i) * y.item(i);
    return sum;
  }
  // The CPU backward. `given[k]` (k < inputs: input k; k == inputs: the output) says what a
  // tensor not asked for in backward_saves() is passed as. Returns one gradient per input then
  // per parameter; a gradient not wanted is an undefined Tensor.
  std::vector<Tensor> backward(const Setup& s, const Tensor& output, const std::vector<Given>& given) const;
  std::vector<Given> all_given(const Setup& s, Given g) const {
    return std::vector<Given>(s.inputs.size() + 1, g);
  }

  bool check_cpu(Setup& s);
  bool fd_check(Setup& s, const std::vector<Tensor>& grads, const std::vector<bool>& written,
                const std::string& where, const std::string& subject, const std::string& giver,
                double min_rtol, double min_atol);
  void check_lowered(const Setup& s, Setup& fd);
  // Runs the backward launches; the gradients (undefined where not wanted), or nullopt after a
  // failure line.
  std::optional<std::vector<Tensor>> run_lowered(const Setup& s, const Lowered& lowered, bool gpu);
  // Lowered gradients against the reference: the CPU backward (`want`), or finite differences
  // in `fd` when the op has no CPU backward.
  void judge_lowered(const Setup& s, Setup& fd, const std::vector<Tensor>& got,
                     const std::vector<Tensor>& want, bool gpu);
  void check_ptx(const Setup& s, const Lowered& lowered);
  // The backward's tensors in `mem`: inputs and output as the runtime passes them (address 0
  // for those not kept), gradients NaN-filled (address 0 for those not wanted), scratch.
  LaunchTensors backward_tensors(BackwardMemory& mem, const Setup& s, const RuntimeOp& rt) const;

  Reporter rep_;
  const CustomData& data_;
  const CustomOp& op_;
  std::vector<std::vector<std::int64_t>> shapes_;
  std::vector<DType> dtypes_;
  const GradCheckOptions& o_;
  std::string prefix_;
  std::uint64_t op_seed_ = 0;
  BackwardSaves saves_;
  mutable bool no_cpu_forward_ = false;  // cpu_forward threw NoCpuImplementation once
};

std::vector<Tensor> GradChecker::backward(const Setup& s, const Tensor& output,
                                          const std::vector<Given>& given) const {
  auto pass = [&](const Tensor& t, bool saved, Given g) {
    if (saved || g == Given::Data) return t;
    if (g == Given::Null) return no_data(t);
    // A stand-in: NaN for floats, zeros for integers (labels stay valid indices).
    Tensor p = poisoned(t.dtype(), t.shape(), is_floating(t.dtype()) ? 0xFF : 0x00);
    return p;
  };
  std::vector<Tensor> ins;
  for (std::size_t i = 0; i < s.inputs.size(); ++i) ins.push_back(pass(s.inputs[i], saves_.inputs, given[i]));
  const Tensor out = pass(output, saves_.output, given.back());
  std::vector<Tensor> grads;
  for (std::size_t k = 0; k < s.inputs.size() + s.params.size(); ++k) {
    const Tensor& like = k < s.inputs.size() ? s.inputs[k] : s.params[k - s.inputs.size()];
    grads.push_back(wants(s, k) ? poisoned(like.dtype(), like.shape()) : no_data(like));
  }
  std::span<Tensor> gi(grads.data(), s.inputs.size());
  std::span<Tensor> gp(grads.data() + s.inputs.size(), s.params.size());
  CpuBackwardContext ctx(ins, s.params, out, s.grad_output, gi, gp, o_.training, op_seed_);
  op_.cpu_backward(ctx);
  for (std::size_t k = 0; k < grads.size(); ++k)
    if (!wants(s, k)) grads[k] = Tensor();
  return grads;
}

void GradChecker::run() {
  const std::uint64_t seed =
      o_.seed != 0 ? o_.seed : (std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
  rep_.info(util::cat("gradient check of op ", op_.name(), ", seed ", seed,
                      " (GradCheckOptions::seed reproduces this run)"));
  if (shapes_.size() != dtypes_.size()) {
    rep_.fail(at("setup"), util::cat("check_gradients: ", shapes_.size(), " input shapes but ",
                                     dtypes_.size(), " dtypes"));
    return;
  }
  if (op_.is_view()) {
    rep_.skip(at("gradients"), "a view op: the runtime aliases its gradient (no backward)");
    return;
  }
  if (!op_.has_cpu_backward()) {
    // Without a CPU backward, a lowered backward is compared with finite differences.
    bool lowered_backward = false;
    try {
      const Setup s0 = record(op_, data_, shapes_, dtypes_);
      auto l = op_.lower(s0.context);
      lowered_backward = l && l->runtime_op && !op_.lower_backward_source(s0.context).empty();
    } catch (const std::exception&) {
    }
    if (!lowered_backward) {
      rep_.skip(at("gradients"),
                "the op has no CPU backward (CustomOp::has_cpu_backward() is false) and no lowered "
                "backward (lower_backward_source() is empty)");
      return;
    }
  }
  std::mt19937_64 rng(seed);
  op_seed_ = rng();
  saves_ = op_.backward_saves();

  // The op on the dtypes given, with inputs, parameters and an output gradient.
  Setup given;
  if (!rep_.guard(at("record"), [&] {
        given = record(op_, data_, shapes_, dtypes_);
        rep_.set_label(given.label);
        for (std::size_t i = 0; i < shapes_.size(); ++i) {
          Tensor t = o_.make_input ? o_.make_input(static_cast<int>(i), shapes_[i])
                                   : random_input(rng, dtypes_[i], shapes_[i]);
          if (t.shape() != shapes_[i] || t.dtype() != dtypes_[i])
            throw Error(util::cat("GradCheckOptions::make_input(", i, ", ", sizes_to_string(shapes_[i]),
                                  ") returned ", sizes_to_string(t.shape()), " ", dtype_name(t.dtype()),
                                  "; the input is ", sizes_to_string(shapes_[i]), " ",
                                  dtype_name(dtypes_[i])));
          given.inputs.push_back(t);
        }
        for (std::size_t k = 0; k < given.specs.size(); ++k)
          given.params.push_back(make_param(rng, given.specs[k], given.names[k], given.label));
        given.grad_output = random_input(rng, given.out_dtype, given.out_shape);
        if (!is_floating(given.out_dtype))
          throw Error(
              util::cat("the output is ", dtype_name(given.out_dtype), ": no gradient flows through it"));
      }))
    return;

  // Finite differences want f64: when some float dtype is narrower, the op is recorded on f64
  // copies of the same values, as a model with f64 inputs would record it (its parameters in the
  // dtypes it declares for them, never converted behind its back); if it refuses them, or gives
  // no f64 output, or its forward fails on them, the check runs in the dtypes given.
  Setup fd = given;
  bool promoted = false;
  std::string why_not;
  const std::vector<DType> f64 = with_float(dtypes_, DType::F64);
  if (f64 != dtypes_) {
    try {
      Setup s = record(op_, data_, shapes_, f64);
      if (s.out_dtype == DType::F64) {
        s.inputs = convert(given.inputs, f64);
        std::vector<DType> pd;
        for (const auto& p : s.specs) pd.push_back(p.dtype);
        s.params = convert(given.params, pd);
        s.grad_output = given.grad_output.to(DType::F64);
        forward(s, s.inputs, s.params);
        fd = std::move(s);
        promoted = true;
      } else {
        why_not = util::cat("on f64 inputs the op's output is ", dtype_name(s.out_dtype));
      }
    } catch (const std::exception& e) {
      why_not = util::cat("the op fails on f64 inputs: ", e.what());
    }
  }
  auto dtypes_text = [](const Setup& s) {
    std::vector<std::string> t;
    for (const auto& x : s.inputs) t.push_back(std::string(dtype_name(x.dtype())));
    std::string r = "inputs " + util::join(t, ", ");
    t.clear();
    for (std::size_t k = 0; k < s.params.size(); ++k)
      t.push_back(util::cat(s.names[k], " ", dtype_name(s.params[k].dtype())));
    if (!t.empty()) r += ", parameters " + util::join(t, ", ");
    return r + util::cat(", output ", dtype_name(s.out_dtype));
  };
  if (promoted)
    rep_.info(util::cat("finite differences in f64 (", dtypes_text(fd), "); the lowered backward in the dtypes given (",
                        dtypes_text(given), ")"));
  else if (f64 != dtypes_)
    rep_.info(util::cat("finite differences in the dtypes given (", dtypes_text(given), "), not f64 (", why_not,
                        "); step and tolerances widened for them"));
  else
    rep_.info(util::cat("finite differences in the dtypes given (", dtypes_text(given), ")"));

  if (op_.has_cpu_backward()) {
    check_cpu(fd);
  } else {
    try {
      forward(given, given.inputs, given.params);
    } catch (const NoCpuImplementation&) {
      rep_.skip(
          at("gradients"),
          "the op has neither a CPU backward nor a forward (CPU or lowered) to take finite differences of");
      return;
    } catch (const std::exception&) {
      // Reported by the finite differences.
    }
    rep_.skip(
        at("cpu_backward"),
        util::cat("the op has no CPU backward (CustomOp::has_cpu_backward() is false); its lowered "
                  "backward is compared with finite differences of its ",
                  no_cpu_forward_ ? "emulated forward kernels (it has no CPU forward)" : "CPU forward"));
  }
  // The lowered backward runs in the dtypes given, against the CPU backward in them.
  check_lowered(given, fd);
}

void GradChecker::emulated_forward(const Setup& s, const std::vector<Tensor>& inputs,
                                   const std::vector<Tensor>& params, Tensor& out) const {
  std::optional<Lowered> l = op_.lower(s.context);
  if (!l || !l->runtime_op) throw NoCpuImplementation();
  const RuntimeOp& rt = *l->runtime_op;
  auto dev = [](const Tensor& t) {
    return DeviceTensor{reinterpret_cast<std::uintptr_t>(t.raw()), t.shape(), t.dtype()};
  };
  LaunchTensors t;
  for (const auto& x : inputs) t.inputs.push_back({0, x.shape(), x.dtype()});
  for (const auto& x : params) t.params.push_back({0, x.shape(), x.dtype()});
  t.output = {0, out.shape(), out.dtype()};
  t.training = o_.training;
  t.seed = op_seed_;
  Tensor scratch;
  if (const std::size_t sb = rt.scratch_bytes(t); sb > 0)
    scratch = Tensor::zeros(DType::U8, {static_cast<std::int64_t>(sb)});
  for (std::size_t i = 0; i < inputs.size(); ++i) t.inputs[i] = dev(inputs[i]);
  for (std::size_t i = 0; i < params.size(); ++i) t.params[i] = dev(params[i]);
  t.output = dev(out);
  t.scratch = scratch.defined() ? dev(scratch).ptr : 0;
  const std::string name = l->name.empty() ? op_.name() : l->name;
  const lower::KernelModule module = lower::make_module(name, l->source, l->entry_point, 0);
  for (const auto& L : lower::check_launches(module, rt.launches(t), s.label, "", &t))
    emu::launch(name, l->source, L.entry, L.launch.grid, L.launch.block, L.launch.shared_bytes,
                L.launch.args);
}

bool GradChecker::check_cpu(Setup& s) {
  const std::size_t n_in = s.inputs.size();
  const std::size_t n = n_in + s.params.size();
  const std::string where = at("cpu_backward");
  // The forward, every output element written.
  Tensor y;
  if (!rep_.guard(at("cpu_forward"), [&] {
        y = forward(s, s.inputs, s.params);
        std::int64_t first = -1;
        if (const std::int64_t bad = count_nan(y, &first); bad > 0)
          throw Error(util::cat("cpu_forward left ", bad, " of ", y.numel(),
                                " output elements unwritten (NaN in a NaN-poisoned output; first at ",
                                index_text(first, s.out_shape), ")"));
      }))
    return false;

  // The backward with every forward tensor given, then with each tensor it did not ask to keep
  // replaced by a stand-in: a difference means it reads that tensor.
  std::vector<Tensor> grads;
  if (!rep_.guard(where, [&] { grads = backward(s, y, all_given(s, Given::Data)); })) return false;
  bool ok = true;
  for (std::size_t k = 0; k <= n_in; ++k) {
    const bool saved = k < n_in ? saves_.inputs : saves_.output;
    if (saved) continue;
    const std::string what = k < n_in ? util::cat("input ", k) : std::string("the output");
    std::vector<Given> g = all_given(s, Given::Data);
    g[k] = Given::Poison;
    std::vector<Tensor> other;
    try {
      other = backward(s, y, g);
    } catch (const std::exception& e) {
      rep_.fail(where, util::cat("reads ", what, ", which backward_saves() does not ask to keep (",
                                 k < n_in ? "inputs" : "output",
                                 " = false): with a stand-in for it the backward throws: ", e.what()));
      ok = false;
      continue;
    }
    for (std::size_t j = 0; j < n; ++j) {
      if (!grads[j].defined() || grads[j].raw() == nullptr) continue;
      const std::int64_t i = first_byte_difference(other[j], grads[j]);
      if (i < 0) continue;
      rep_.fail(where, util::cat("reads ", what, ", which backward_saves() does not ask to keep (",
                                 k < n_in ? "inputs" : "output",
                                 " = false; the runtime passes it without data): ", "the gradient of ",
                                 tensor_name(s, j), " changes at ", index_text(i, grads[j].shape()), " (",
                                 num(grads[j].item(i)), " -> ", num(other[j].item(i)),
                                 ") when that tensor's values change"));
      ok = false;
      break;
    }
  }
  // As the runtime calls it: tensors not kept have no data.
  if (ok && (!saves_.inputs || !saves_.output)) {
    std::vector<Tensor> null_run;
    if (!rep_.guard(where, [&] { null_run = backward(s, y, all_given(s, Given::Null)); })) return false;
    for (std::size_t j = 0; j < n; ++j) {
      if (!wants(s, j)) continue;
      if (const std::int64_t i = first_byte_difference(null_run[j], grads[j]); i >= 0) {
        rep_.fail(where, util::cat("the gradient of ", tensor_name(s, j), " at ",
                                   index_text(i, grads[j].shape()), " is ", num(null_run[j].item(i)),
                                   " when the tensors not kept are passed without "
                                   "data but ",
                                   num(grads[j].item(i)), " when they are passed with it"));
        ok = false;
        break;
      }
    }
  }

  // Every wanted gradient element written.
  std::vector<bool> written(n, true);
  std::vector<std::string> wanted;
  for (std::size_t j = 0; j < n; ++j) {
    if (!wants(s, j)) continue;
    wanted.push_back(tensor_name(s, j));
    std::int64_t first = -1;
    if (const std::int64_t bad = count_nan(grads[j], &first); bad > 0) {
      rep_.fail(where, util::cat("left ", bad, " of ", grads[j].numel(), " elements of the gradient of ",
                                 tensor_name(s, j), " unwritten (NaN in a NaN-poisoned gradient; first at ",
                                 index_text(first, grads[j].shape()), ")"));
      written[j] = false;
      ok = false;
    }
  }
  if (wanted.empty()) {
    rep_.skip(where, "no float input and no trainable parameter: no gradient to check");
    return ok;
  }

  return fd_check(s, grads, written, where, "the gradient of", "backward", 0, 0) && ok;
}

// The gradients `grads` (in the dtypes of `s`) against central differences of
// sum(grad_output * forward) at sampled elements of each wanted tensor.
bool GradChecker::fd_check(Setup& s, const std::vector<Tensor>& grads, const std::vector<bool>& written,
                           const std::string& where, const std::string& subject, const std::string& giver,
                           double min_rtol, double min_atol) {
  // Central differences of sum(grad_output * forward) at sampled elements.
  const bool wide = std::any_of(s.dtypes.begin(), s.dtypes.end(),
                                [](DType d) { return is_floating(d) && d != DType::F64; }) ||
                    (s.out_dtype != DType::F64);
  const double eps = wide ? std::max(o_.eps, s.out_dtype == DType::F32 ? 3e-3 : 3e-2) : o_.eps;
  const double rtol = std::max(wide ? std::max(o_.rtol, 1e-2) : o_.rtol, min_rtol);
  const double atol = std::max(wide ? std::max(o_.atol, 1e-3) : o_.atol, min_atol);
  const std::size_t n_in = s.inputs.size();
  const std::size_t n = n_in + s.params.size();
  bool ok = true;
  std::mt19937_64 pick(op_seed_ ^ 0x9e3779b97f4a7c15ull);
  std::vector<Tensor> ins = s.inputs, ps = s.params;
  for (auto& t : ins) t = t.clone();
  for (auto& t : ps) t = t.clone();
  const double f0 = objective(s, ins, ps);
  for (std::size_t j = 0; j < n; ++j) {
    if (!wants(s, j) || !written[j]) continue;
    const std::string stage = util::cat(where, ", ", tensor_name(s, j));
    rep_.guard(stage, [&] {
      Tensor& x = j < n_in ? ins[j] : ps[j - n_in];
      const Tensor& g = grads[j];
      const std::int64_t numel = x.numel();
      // Sampled elements: all of them, or the first, the last and random others.
      std::set<std::int64_t> picks;
      const std::int64_t limit = std::max<std::int64_t>(o_.max_elements, 2);
      if (numel <= limit) {
        for (std::int64_t i = 0; i < numel; ++i) picks.insert(i);
      } else {
        picks.insert(0);
        picks.insert(numel - 1);
        std::uniform_int_distribution<std::int64_t> u(0, numel - 1);
        while (static_cast<std::int64_t>(picks.size()) < limit) picks.insert(u(pick));
      }
      std::int64_t bad = 0, worst_at = -1, kinks = 0;
      double worst = 0, worst_ref = 0, max_diff = 0;
      for (const std::int64_t i : picks) {
        const double v = x.item(i);
        const double h = eps * std::max(1.0, std::abs(v));
        set_item(x, i, v + h);
        const double xp = x.item(i);
        const double fp = objective(s, ins, ps);
        set_item(x, i, v - h);
        const double xm = x.item(i);
        const double fm = objective(s, ins, ps);
        set_item(x, i, v);
        const double ref = (fp - fm) / (xp - xm);
        const double got = g.item(i);
        const double tol = atol + rtol * std::abs(ref);
        const double d = std::abs(got - ref);
        max_diff = std::max(max_diff, d);
        if (d <= tol) continue;
        // A non-differentiable point (ReLU at 0, a max with a near tie): the one-sided slopes
        // disagree and the backward may give either of them or a value between.
        const double right = (fp - f0) / (xp - v), left = (f0 - fm) / (v - xm);
        const double side_tol = atol + rtol * std::max(std::abs(left), std::abs(right));
        if (std::abs(right - left) > 10 * side_tol && got >= std::min(left, right) - side_tol &&
            got <= std::max(left, right) + side_tol) {
          ++kinks;
          continue;
        }
        ++bad;
        if (d / tol > worst) worst = d / tol, worst_at = i, worst_ref = ref;
      }
      const std::string tols = util::cat("rtol ", num(rtol), ", atol ", num(atol), ", step ", sci(eps));
      const std::string sampled = static_cast<std::int64_t>(picks.size()) == numel
                                      ? util::cat("all ", numel, " elements")
                                      : util::cat(picks.size(), " sampled elements of ", numel);
      const std::string shape = util::cat(sizes_to_string(x.shape()), " ", dtype_name(x.dtype()));
      if (bad == 0) {
        rep_.pass(stage,
                  util::cat(subject, " ", tensor_name(s, j), " (", shape,
                            ") matches central finite differences at ", sampled, " within ", tols,
                            " (max |diff| ", sci(max_diff), ")",
                            kinks ? util::cat("; ", kinks, " at a non-differentiable point accepted") : ""));
        return;
      }
      rep_.fail(stage, util::cat(subject, " ", tensor_name(s, j), " (", shape,
                                 ") differs from central finite differences at ", bad, " of ", sampled,
                                 "; worst at ", index_text(worst_at, x.shape()), ": ", giver, " gives ",
                                 num(g.item(worst_at)), ", finite differences give ", num(worst_ref),
                                 " (|diff| ", sci(std::abs(g.item(worst_at) - worst_ref)), ", ", tols, ")"));
      ok = false;
    });
  }
  return ok;
}

void GradChecker::check_lowered(const Setup& s, Setup& fd) {
  const std::string emu_at = at("emulator");
  const std::string gpu_at = at("gpu");
  std::optional<Lowered> lowered;
  if (!rep_.guard(at("lower"), [&] { lowered = op_.lower(s.context); })) return;
  auto skip_both = [&](const std::string& why) {
    rep_.skip(emu_at, why);
    rep_.skip(gpu_at, why);
  };
  if (!lowered) return skip_both("the op has no lowering (CustomOp::lower() returns nothing)");
  if (!lowered->runtime_op) {
    rep_.fail(at("lower"), "lower() returned no RuntimeOp");
    return;
  }
  if (op_.lower_backward_source(s.context).empty())
    return skip_both("the lowered op has no backward (lower_backward_source() is empty)");
  const bool emulate = o_.emulate, gpu = o_.gpu && Device::cuda_available();
  if (!emulate && !gpu) {
    rep_.skip(emu_at, "off (GradCheckOptions::emulate)");
    rep_.skip(gpu_at, o_.gpu ? "no usable GPU on this machine" : "off (GradCheckOptions::gpu)");
    return;
  }
  // The reference: the CPU backward in the dtypes given (none: finite differences).
  std::vector<Tensor> want;
  if (op_.has_cpu_backward() && !rep_.guard(at("lowered reference"), [&] {
        const Tensor y = forward(s, s.inputs, s.params);
        want = backward(s, y, all_given(s, Given::Data));
        for (std::size_t j = 0; j < want.size(); ++j) {
          std::int64_t first = -1;
          if (want[j].defined() && want[j].raw() && count_nan(want[j], &first) > 0)
            throw Error(util::cat("the CPU backward in the dtypes given leaves the gradient of ",
                                  tensor_name(s, j), " with NaN at ", index_text(first, want[j].shape()),
                                  "; the lowered backward is not compared"));
        }
      }))
    return;
  check_ptx(s, *lowered);
  bool emulated_ran = true;
  if (emulate) {
    auto got = run_lowered(s, *lowered, false);
    emulated_ran = got.has_value();
    if (got) judge_lowered(s, fd, *got, want, false);
  } else {
    rep_.skip(emu_at, "off (GradCheckOptions::emulate)");
  }
  if (gpu && !emulated_ran) {
    // A kernel that faults on a GPU leaves the CUDA context unusable for the rest of the process.
    rep_.skip(gpu_at, "not run: the emulated backward failed to run (see above)");
  } else if (gpu && !gpu_unusable().empty()) {
    rep_.skip(gpu_at, gpu_unusable());
  } else if (gpu) {
    if (auto got = run_lowered(s, *lowered, true)) judge_lowered(s, fd, *got, want, true);
  } else
    rep_.skip(gpu_at, o_.gpu ? "no usable GPU on this machine" : "off (GradCheckOptions::gpu)");
}

LaunchTensors GradChecker::backward_tensors(BackwardMemory& mem, const Setup& s, const RuntimeOp& rt) const {
  const std::size_t n_in = s.inputs.size();
  LaunchTensors t;
  t.seed = op_seed_;
  t.training = o_.training;
  const Tensor y = forward(s, s.inputs, s.params);
  for (std::size_t i = 0; i < n_in; ++i)
    t.inputs.push_back(saves_.inputs ? mem.add(s.inputs[i], util::cat("input ", i), false)
                                     : DeviceTensor{0, s.inputs[i].shape(), s.inputs[i].dtype()});
  for (std::size_t k = 0; k < s.params.size(); ++k)
    t.params.push_back(mem.add(s.params[k], util::cat("parameter '", s.names[k], "'"), false));
  t.output = saves_.output ? mem.add(y, "output", false) : DeviceTensor{0, y.shape(), y.dtype()};
  t.grad_output = mem.add(s.grad_output, "grad_output", false);
  for (std::size_t j = 0; j < n_in + s.params.size(); ++j) {
    const Tensor& like = j < n_in ? s.inputs[j] : s.params[j - n_in];
    DeviceTensor d = wants(s, j) ? mem.add(like, "gradient of " + tensor_name(s, j), true)
                                 : DeviceTensor{0, like.shape(), like.dtype()};
    (j < n_in ? t.grad_inputs : t.grad_params).push_back(d);
  }
  if (const std::size_t scratch = rt.backward_scratch_bytes(t); scratch > 0)
    t.scratch =
        mem.add(poisoned(DType::U8, {static_cast<std::int64_t>(scratch)}), "backward scratch", true).ptr;
  return t;
}

// The backward source compiled by NVRTC for sm_90 and each launch checked against the PTX
// (arguments, block, grid) without running: what a GPU would refuse at load.
void GradChecker::check_ptx(const Setup& s, const Lowered& lowered) {
  const std::string stage = at("nvrtc");
  if (cuda::compile_archs().empty()) {
    rep_.skip(stage, "NVRTC is not available: " + compile::Compiler::unavailable_reason());
    return;
  }
  const RuntimeOp& rt = *lowered.runtime_op;
  LowerContext ctx = s.context;
  ctx.sm = 90;
  const std::string source = op_.lower_backward_source(ctx);
  const std::string name = lowered.name + ".backward";
  rep_.guard(stage, [&] {
    BackwardMemory mem(false);
    const LaunchTensors t = backward_tensors(mem, s, rt);
    const lower::KernelModule module = lower::make_module(name, source, "", 0);
    const auto launches = lower::check_launches(module, rt.backward_launches(t), s.label, "backward", &t);
    std::set<std::string> entries;
    for (std::size_t l = 0; l < launches.size(); ++l) {
      const std::string label = util::cat(s.label, " backward launch ", l);
      const Launch& L = launches[l].launch;
      entries.insert(launches[l].entry);
      try {
        cuda::Kernel::compile_for_arch(name, source, launches[l].entry, 90)
            .check(L.grid, L.block, [&](ArgVisitor& v) { replay(L.args, v); });
      } catch (const Error& err) {
        throw Error(util::cat(label, ": ", err.what()));
      }
    }
    rep_.pass(
        stage,
        util::cat(
            launches.size(), " backward launch(es) of ", entries.size(),
            " kernel(s) compiled for sm_90 and checked against the CUDA signature and the PTX (arguments, "
            "block, grid)"));
  });
}

std::optional<std::vector<Tensor>> GradChecker::run_lowered(const Setup& s, const Lowered& lowered,
                                                            bool gpu) {
  const std::string stage = at(gpu ? "gpu" : "emulator");
  const RuntimeOp& rt = *lowered.runtime_op;
  const std::string source = op_.lower_backward_source(s.context);
  const std::string name = lowered.name + ".backward";
  const std::size_t n_in = s.inputs.size();
  std::optional<std::vector<Tensor>> result;
  rep_.guard(stage, [&] {
    bool faulted = false;
    with_gpu_fault_note(faulted, [&] {
      BackwardMemory mem(gpu);
      const LaunchTensors t = backward_tensors(mem, s, rt);
      const lower::KernelModule module = lower::make_module(name, source, "", 0);
      const auto launches = lower::check_launches(module, rt.backward_launches(t), s.label, "backward", &t);
      std::map<std::string, cuda::Kernel> kernels;
      for (std::size_t l = 0; l < launches.size(); ++l) {
        const std::string label = util::cat(s.label, " backward launch ", l);
        const Launch& L = launches[l].launch;
        const std::string& entry = launches[l].entry;
        if (gpu) {
          auto it = kernels.find(entry);
          if (it == kernels.end())
            it = kernels.emplace(entry, cuda::Kernel::compile(name, source, entry)).first;
          try {
            it->second.launch(
                L.grid, L.block, [&](ArgVisitor& v) { replay(L.args, v); }, L.shared_bytes);
          } catch (const Error& err) {
            throw Error(util::cat(label, ": ", err.what()));
          }
        } else {
          emu::LaunchOptions lo;
          lo.checked = true;
          lo.buffers = mem.host_buffers();
          lo.label = label;
          emu::launch(name, source, entry, L.grid, L.block, L.shared_bytes, L.args, lo);
        }
      }
      if (gpu) cuda::synchronize();
      std::vector<Tensor> got;
      for (std::size_t j = 0; j < n_in + s.params.size(); ++j)
        got.push_back(wants(s, j) ? mem.read(j < n_in ? t.grad_inputs[j] : t.grad_params[j - n_in])
                                  : Tensor());
      result = std::move(got);
    });
  });
  return result;
}

void GradChecker::judge_lowered(const Setup& s, Setup& fd, const std::vector<Tensor>& got,
                                const std::vector<Tensor>& want, bool gpu) {
  const std::string stage = at(gpu ? "gpu" : "emulator");
  const std::string what = gpu ? "the GPU backward" : "the emulated backward (checked mode)";
  const std::size_t n = got.size();
  // Every wanted gradient written.
  std::vector<bool> written(n, true);
  for (std::size_t j = 0; j < n; ++j) {
    if (!wants(s, j)) continue;
    std::int64_t first = -1;
    const std::int64_t bad = count_nan(got[j], &first);
    std::int64_t ignored = -1;
    if (bad == 0 || (!want.empty() && count_nan(want[j], &ignored) > 0)) continue;
    rep_.fail(stage, util::cat(s.label, " ", what, " left ", bad, " of ", got[j].numel(),
                               " elements of the gradient of ", tensor_name(s, j),
                               " unwritten (NaN in a NaN-filled buffer; first at ",
                               index_text(first, got[j].shape()), ")"));
    written[j] = false;
  }
  if (want.empty()) {
    // No CPU backward: finite differences of the CPU forward, in the dtypes of `fd`.
    std::vector<Tensor> conv;
    for (std::size_t j = 0; j < n; ++j) {
      const Tensor& like = j < s.inputs.size() ? fd.inputs[j] : fd.params[j - s.inputs.size()];
      conv.push_back(!got[j].defined() || got[j].dtype() == like.dtype() ? got[j] : got[j].to(like.dtype()));
    }
    fd_check(fd, conv, written, stage,
             gpu ? "the GPU backward's gradient of" : "the emulated backward's gradient of",
             gpu ? "the GPU backward" : "the emulated backward", o_.lowered_rtol, o_.lowered_atol);
    return;
  }
  std::vector<std::string> passed;
  for (std::size_t j = 0; j < n; ++j) {
    if (!wants(s, j) || !written[j]) continue;
    const Comparison c =
        compare(got[j], want[j], o_.lowered_rtol, o_.lowered_atol,
                util::cat(what, " for the gradient of ", tensor_name(s, j)), "the CPU backward");
    if (c.ok)
      passed.push_back(c.text);
    else
      rep_.fail(stage, util::cat(s.label, " ", c.text));
  }
  for (const auto& p : passed) rep_.pass(stage, p);
}

}  // namespace

namespace detail {
void run_gradient_checks(CheckOpReport& report, const CustomData& op,
                         const std::vector<std::vector<std::int64_t>>& shapes,
                         const std::vector<DType>& dtypes, const GradCheckOptions& options,
                         const std::string& prefix) {
  GradChecker(report, op, shapes, dtypes, options, prefix).run();
}
}  // namespace detail

CheckOpReport check_gradients(const CustomData& op,
                              const std::vector<std::vector<std::int64_t>>& input_shapes,
                              const std::vector<DType>& dtypes, const GradCheckOptions& options) {
  CheckOpReport report;
  report.check = "check_gradients";
  try {
    detail::run_gradient_checks(report, op, input_shapes, dtypes, options, "");
  } catch (const std::exception& e) {  // from the op's own methods outside any single check
    report.ok = false;
    report.lines.push_back(util::cat("FAIL check_gradients: ", e.what()));
  }
  return report;
}

}  // namespace kg::testing
