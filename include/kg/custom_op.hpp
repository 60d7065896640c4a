// The graph-level description of an operation (CustomOp) and its CPU execution hook.
// Built-in ops implement this same interface.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kg/dtype.hpp"
#include "kg/shape.hpp"
#include "kg/tensor.hpp"

namespace kg {

class RuntimeOp;  // the launch-time description; see the lowering
class SymTensor;  // kg/graph.hpp

// How a graph is lowered: for inference, or for training (backward kernels too).
enum class LoweringMode { Inference, Training };

// What CustomOp::lower() and lower_backward_source() are told about the node being lowered, so
// that one op instance can serve every dtype, shape and target.
struct LowerContext {
  std::string node;                 // the node's dotted name ("" when lowered outside a model)
  std::vector<DType> input_dtypes;  // recorded order
  DType output_dtype = DType::F32;
  std::vector<Shape> input_shapes;  // as recorded (dynamic dims stay dynamic)
  Shape output_shape;
  // Every input's concrete sizes when the lowering happens at load (always, in a model);
  // empty when an op is lowered without concrete shapes.
  std::vector<std::vector<std::int64_t>> concrete_input_shapes;
  std::vector<std::int64_t> concrete_output_shape;
  LoweringMode mode = LoweringMode::Inference;
  // The target: the GPU's compute capability ×10 (90 for sm_90), or 0 for the CUDA emulator on
  // the CPU.
  int sm = 0;
  bool emulated() const { return sm == 0; }
};

// What CustomOp::lower() returns: a kernel and how to launch it.
struct Lowered {
  std::string name;         // kernel name used in errors and caches
  std::string source;       // CUDA C++ source (or PTX)
  std::string entry_point;  // the __global__ function; empty = the only entry in the module
  std::shared_ptr<RuntimeOp> runtime_op;
};

// How a parameter is initialised when no weights are loaded.
struct ParamInit {
  enum class Kind { Uniform, Normal, Constant, Data };
  Kind kind = Kind::Constant;
  double a = 0.0;               // Uniform: low; Normal: mean; Constant: value
  double b = 0.0;               // Uniform: high; Normal: std
  std::vector<std::byte> data;  // Data: raw bytes, exactly numel × dtype size

  static ParamInit uniform(double lo, double hi) { return {Kind::Uniform, lo, hi, {}}; }
  static ParamInit normal(double mean, double std) { return {Kind::Normal, mean, std, {}}; }
  static ParamInit constant(double v) { return {Kind::Constant, v, 0.0, {}}; }
  static ParamInit from_bytes(std::vector<std::byte> bytes) {
    return {Kind::Data, 0.0, 0.0, std::move(bytes)};
  }
  // Data from values of the parameter's element type (e.g. a std::vector<float> for f32).
  template <class T>
  static ParamInit from_values(const std::vector<T>& v) {
    std::vector<std::byte> b(v.size() * sizeof(T));
    if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
    return from_bytes(std::move(b));
  }
};

// A parameter (or buffer, such as BatchNorm's running mean) owned by an op node. Its full
// name is the node's dotted name + "." + `name` (e.g. "features.0.weight").
struct ParamSpec {
  std::string name;
  std::vector<std::int64_t> shape;
  DType dtype = DType::F32;
  ParamInit init;
  bool trainable = true;  // false for running statistics and counters
  // -1: the parameter is `dtype`. k >= 0: it takes the dtype of input k (recorded order), which
  // must be a float dtype, so that one op instance serves f32 and f64 models (and f16/bf16 ones
  // where the op computes in them): f64 inputs, an f64 parameter. Data init is then given in
  // `dtype` and converted.
  int dtype_from_input = -1;
};

// What a CPU implementation gets: concrete inputs, parameters, and the output to fill.
class CpuContext {
 public:
  using RangeFn = std::function<void(std::int64_t begin, std::int64_t end)>;
  CpuContext(std::span<const Tensor> inputs, std::span<const Tensor> params, Tensor output, bool training,
             std::uint64_t seed);
  virtual ~CpuContext() = default;

  std::span<const Tensor> inputs;  // activation inputs, in recorded order
  std::span<const Tensor> params;  // parameters, in the order of CustomOp::parameters()
  Tensor output;                   // allocated with the planned shape and dtype
  bool training;                   // train mode (Dropout, BatchNorm)
  std::uint64_t seed;              // differs per run and per node; for random ops

  // Runs fn over [0, n) split into chunks of at least `grain` on the runtime's threads.
  virtual void parallel_for(std::int64_t n, std::int64_t grain, const RangeFn& fn) const;
};

// What the backward of an op reads from the forward pass. The runtime keeps exactly these
// tensors alive until the op's backward has run; the others may be overwritten by then.
struct BackwardSaves {
  bool inputs = true;   // the activation inputs
  bool output = false;  // the op's output
};

// What a CPU backward gets: the forward's tensors, the gradient of the loss with respect to
// the output, and the gradients to write. Inputs (or the output) that the op did not ask to
// be saved carry their shape and dtype but no data (raw() is null). A gradient the runtime
// does not need (an input that depends on no parameter, a buffer that is not trainable) is
// likewise undefined: check `wants_input_grad(i)` / `wants_param_grad(i)`. Every element of
// each wanted gradient must be written (overwritten, not accumulated: the runtime sums
// gradients from several consumers).
class CpuBackwardContext : public CpuContext {
 public:
  CpuBackwardContext(std::span<const Tensor> inputs, std::span<const Tensor> params, Tensor output,
                     Tensor grad_output, std::span<Tensor> grad_inputs, std::span<Tensor> grad_params,
                     bool training, std::uint64_t seed);

  Tensor grad_output;             // same shape and dtype as the output
  std::span<Tensor> grad_inputs;  // one per input, shaped like it
  std::span<Tensor> grad_params;  // one per parameter, shaped like it
  bool wants_input_grad(std::size_t i) const {
    return i < grad_inputs.size() && grad_inputs[i].raw() != nullptr;
  }
  bool wants_param_grad(std::size_t i) const {
    return i < grad_params.size() && grad_params[i].raw() != nullptr;
  }
};

// A block of elements given to an elementwise op's CPU form (ElementwiseForm::cpu and
// cpu_derivative): every array holds `n` values of the compute type (float for f32 tensors,
// double for f64), element j of each input belonging to element j of the result (the fusion pass
// has already applied broadcasting).
struct ElementwiseSpan {
  DType dtype = DType::F32;             // F32 or F64
  std::span<const void* const> inputs;  // one array per input, in recorded order
  const void* output = nullptr;         // cpu_derivative only: the op's values y
  void* result = nullptr;               // cpu: y; cpu_derivative: dy/dx_wrt
  std::int64_t n = 0;
  int wrt = 0;                          // cpu_derivative only: the input differentiated by
};

// The per-element form of an elementwise op: what lets the fusion pass put the op into one
// generated kernel with its elementwise neighbours (docs/fusion.md). The op must compute
// y[i] = f(x0[i], ..., xk[i]) with numpy broadcasting: its output shape is the broadcast of its
// inputs' shapes and its dtype theirs (f32 or f64).
struct ElementwiseForm {
  // CUDA C++ defining the device functions named below, for the compute type (float for f32
  // groups, double for f64: write overloads or templates). It is placed in a namespace of its
  // own inside the generated kernel, so names do not clash with other ops' (do not #define).
  std::string device_source;
  // y = function(x0, ..., xk): one argument per input, in recorded order.
  std::string function;
  // dy/dx_i = derivative(i, x0, ..., xk, y), the derivative alone (the kernel multiplies by the
  // incoming gradient). Empty: the op has no fused derivative and is not fused in training.
  std::string derivative;
  // The same two on the CPU, over contiguous spans (see ElementwiseSpan). Required with
  // `function` / `derivative`; cpu_map() builds one from a scalar function.
  std::function<void(const ElementwiseSpan&)> cpu;
  std::function<void(const ElementwiseSpan&)> cpu_derivative;

  // A CPU form from `f`, a generic callable of the compute type called as f(x0, ..., xk) (or, for
  // a derivative, f(wrt, x0, ..., xk, y)) with K inputs: a plain loop the compiler can
  // vectorise when f is inlineable.
  template <int K, class F>
  static std::function<void(const ElementwiseSpan&)> cpu_map(F f);
  template <int K, class F>
  static std::function<void(const ElementwiseSpan&)> cpu_map_derivative(F f);
};

// The graph-level description of an operation. Hold configuration here, never per-run state.
class CustomOp {
 public:
  virtual ~CustomOp() = default;

  // Namespaced name used in errors and dumps, e.g. "yolo.detect_decode", "nn.conv2d".
  virtual std::string name() const = 0;
  // Output shape from the inputs' symbolic shapes (recorded order). Propagate dynamic dims;
  // throw kg::Error for inputs the op cannot take. Called at record time and again at load
  // with every dim known.
  virtual Shape infer_output_shape(const std::vector<Shape>& input_shapes) const = 0;
  // Output dtype from the input dtypes (default: the first input's). Throw for bad dtypes.
  virtual DType infer_output_dtype(const std::vector<DType>& input_dtypes) const;
  // Parameters (and buffers) the op owns, declared once for every device: name, concrete shape
  // (a function of the inputs' recorded shapes; a dim a parameter needs must be static), dtype
  // (fixed, or that of an input: ParamSpec::dtype_from_input), initialisation, trainable. Called
  // when the op is recorded (default: none).
  virtual std::vector<ParamSpec> parameters(const std::vector<Shape>& input_shapes) const;
  // The GPU kernel for this node; nullopt (the default) means the lowering cannot handle it.
  // Called at load for every device (the CPU too: its launches are checked there, and run under
  // the emulator when the op has no cpu_forward or the model is loaded checked).
  virtual std::optional<Lowered> lower(const LowerContext& ctx) const;
  // CUDA source of the backward kernels, launched as RuntimeOp::backward_launches() says
  // (default: none, so the op has no lowered backward).
  virtual std::string lower_backward_source(const LowerContext& ctx) const;
  // Computes the output on the CPU. The default throws "has no CPU implementation".
  virtual void cpu_forward(CpuContext& ctx) const;
  // True when cpu_backward is implemented. Training a model in which this op lies on a path
  // from a parameter to the loss needs a backward: this one on the CPU, or the lowered one
  // (lower_backward_source() with RuntimeOp::backward_launches()) on a GPU and under emulation.
  virtual bool has_cpu_backward() const { return false; }
  // Writes the gradients of the loss with respect to the wanted inputs and parameters. The
  // seed and training flag are the forward's, so a random op can regenerate its mask.
  virtual void cpu_backward(CpuBackwardContext& ctx) const;
  // What the backward reads from the forward (default: the inputs, not the output).
  virtual BackwardSaves backward_saves() const { return {}; }
  // Attributes for dumps, e.g. "k=5 s=1 p=2" (default: none).
  virtual std::string attributes() const { return {}; }
  // A split of the node into several (default: none). When a Model is made, the node is replaced by
  // what this records on `inputs` (the node's inputs in the graph being built) with the public
  // API, and the returned value stands for the node's output. The node's name is `name`: give the
  // last node that name and the others names under it ("<name>.bias_add"), and keep the node's
  // parameters under their full names (Graph::bind_param renames one), so weights still load by
  // them. Every parameter the node declared must appear exactly once, with its shape and dtype, and
  // the output must have the node's shape and dtype; anything else is an error naming the node.
  virtual SymTensor split(const std::vector<SymTensor>& inputs, const std::string& name) const;
  // The op's per-element form for the given input dtypes, when it has one (default: none, so
  // the op is never fused). Built-in activations and arithmetic declare theirs the same way.
  virtual std::optional<ElementwiseForm> elementwise_form(const std::vector<DType>& input_dtypes) const;
  // True when the op computes in `dtype` (f16 or bf16) in a model loaded in that precision
  // (LoadOptions::precision): its floating inputs, output and floating parameters then all have
  // that dtype, and infer_output_dtype, lower() and cpu_forward() accept it (computing in f32
  // inside wherever accuracy needs it; ops::cpu_forward_in_f32 gives a CPU form for free).
  // Default false: the op keeps f32 and the precision pass puts casts around it. An op with an
  // ElementwiseForm for f32 need not say true: the pass runs it in a generated 16-bit kernel.
  virtual bool computes_in(DType dtype) const {
    (void)dtype;
    return false;
  }
  // True when the output is the first input's bytes reinterpreted (Reshape, Flatten): the
  // runtime then gives it no buffer of its own and cpu_forward is not called.
  virtual bool is_view() const { return false; }
  // For a view of a part of its first input (a slice of a packed tensor): the element of that
  // input, from its concrete sizes, where the output's contiguous numel() elements start. nullopt
  // (the default): the view is all of its input's bytes. Its gradient is the same part of the
  // input's gradient.
  virtual std::optional<std::int64_t> view_offset(const std::vector<std::int64_t>& input_sizes) const {
    (void)input_sizes;
    return std::nullopt;
  }
};

// A shared, immutable handle to a CustomOp.
class CustomData {
 public:
  explicit CustomData(std::shared_ptr<const CustomOp> op);
  // Builds the op in place: `CustomData::make<MyOp>(args...)`.
  template <class T, class... Args>
  static CustomData make(Args&&... args) {
    return CustomData(std::make_shared<const T>(std::forward<Args>(args)...));
  }
  const CustomOp& op() const { return *op_; }
  const CustomOp* operator->() const { return op_.get(); }
  std::string name() const { return op_->name(); }
  // The op as its concrete type, or nullptr.
  template <class T>
  const T* as() const {
    return dynamic_cast<const T*>(op_.get());
  }

 private:
  std::shared_ptr<const CustomOp> op_;
};

std::ostream& operator<<(std::ostream& os, const CustomData& d);

// ---- ElementwiseForm::cpu_map ----
namespace detail {
template <class T, int K, class F, std::size_t... I>
void elementwise_loop(const ElementwiseSpan& s, F& f, std::index_sequence<I...>) {
  const T* in[K > 0 ? K : 1] = {static_cast<const T*>(s.inputs[I])...};
  T* r = static_cast<T*>(s.result);
  for (std::int64_t j = 0; j < s.n; ++j) r[j] = static_cast<T>(f(in[I][j]...));
}
template <class T, int K, class F, std::size_t... I>
void elementwise_derivative_loop(const ElementwiseSpan& s, F& f, std::index_sequence<I...>) {
  const T* in[K > 0 ? K : 1] = {static_cast<const T*>(s.inputs[I])...};
  const T* y = static_cast<const T*>(s.output);
  T* r = static_cast<T*>(s.result);
  const int w = s.wrt;
  for (std::int64_t j = 0; j < s.n; ++j) r[j] = static_cast<T>(f(w, in[I][j]..., y[j]));
}
}  // namespace detail

template <int K, class F>
std::function<void(const ElementwiseSpan&)> ElementwiseForm::cpu_map(F f) {
  return [f](const ElementwiseSpan& s) mutable {
    if (s.dtype == DType::F64)
      detail::elementwise_loop<double, K>(s, f, std::make_index_sequence<K>{});
    else
      detail::elementwise_loop<float, K>(s, f, std::make_index_sequence<K>{});
  };
}

template <int K, class F>
std::function<void(const ElementwiseSpan&)> ElementwiseForm::cpu_map_derivative(F f) {
  return [f](const ElementwiseSpan& s) mutable {
    if (s.dtype == DType::F64)
      detail::elementwise_derivative_loop<double, K>(s, f, std::make_index_sequence<K>{});
    else
      detail::elementwise_derivative_loop<float, K>(s, f, std::make_index_sequence<K>{});
  };
}

}  // namespace kg
