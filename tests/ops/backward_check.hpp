// Helpers of the backward tests of the built-in op families: an op's CPU forward and backward
// called directly (poisoned gradients, unwanted gradients left undefined, tensors the op did not
// ask to keep given without data, work split into small chunks run in reverse order), its
// lowered backward kernels run by the CUDA emulator in checked mode (after an NVRTC compile
// checking the packed arguments against the PTX, where NVRTC is present), and central finite
// differences in f64 as the independent reference.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/emu/executor.hpp"
#include "compile/compiler.hpp"
#include "compile/embedded_sources.hpp"
#include "compile/ptx.hpp"
#include "kg/kg.hpp"
#include "lower/launch_plan.hpp"
#include "support/test_util.hpp"

namespace kg_test::bwd {

// The op of the node `build` records on inputs of the given shapes and dtype.
inline kg::CustomData record_op(
    const std::vector<std::vector<std::int64_t>>& shapes, kg::DType dtype,
    const std::function<kg::SymTensor(const std::vector<kg::SymTensor>&)>& build) {
  auto g = kg::Graph::create();
  std::vector<kg::SymTensor> xs;
  for (const auto& s : shapes) xs.push_back(g->input(dtype, kg::Shape::of(s)));
  const kg::SymTensor y = build(xs);
  return *g->node(y.node()).op;
}

// A CPU context whose parallel_for runs chunks of `grain` elements (at least 1) in reverse order,
// so that every chunk boundary of an implementation is exercised.
class ChunkedBackwardContext final : public kg::CpuBackwardContext {
 public:
  using kg::CpuBackwardContext::CpuBackwardContext;
  void parallel_for(std::int64_t n, std::int64_t grain, const RangeFn& fn) const override {
    const std::int64_t g = std::max<std::int64_t>(1, std::min<std::int64_t>(grain, 7));
    std::vector<std::pair<std::int64_t, std::int64_t>> chunks;
    for (std::int64_t b = 0; b < n; b += g) chunks.emplace_back(b, std::min(n, b + g));
    for (auto it = chunks.rbegin(); it != chunks.rend(); ++it) fn(it->first, it->second);
  }
};

// NaN in every element (0xFF bytes).
inline kg::Tensor poisoned(kg::DType dtype, const std::vector<std::int64_t>& shape) {
  kg::Tensor t = kg::Tensor::empty(dtype, shape);
  if (t.nbytes()) std::memset(t.raw(), 0xFF, t.nbytes());
  return t;
}

struct Problem {
  kg::CustomData op;
  std::vector<kg::Tensor> inputs;
  std::vector<kg::Tensor> params;
  bool training = true;
  std::uint64_t seed = 0;
};

// The inputs' shapes, as parameters() and lower() are told them.
inline std::vector<kg::Shape> input_shapes(const Problem& p) {
  std::vector<kg::Shape> v;
  for (const auto& t : p.inputs) v.push_back(kg::Shape::of(t.shape()));
  return v;
}

// What the lowering tells `op` about a node over inputs of these shapes and dtypes, for training
// (the emulator as target).
inline kg::LowerContext lower_context(const kg::CustomData& op, const std::vector<std::vector<std::int64_t>>& shapes,
                                      const std::vector<kg::DType>& dtypes) {
  kg::LowerContext c;
  for (const auto& s : shapes) c.input_shapes.push_back(kg::Shape::of(s));
  c.input_dtypes = dtypes;
  c.concrete_input_shapes = shapes;
  c.output_dtype = op->infer_output_dtype(c.input_dtypes);
  c.output_shape = op->infer_output_shape(c.input_shapes);
  c.concrete_output_shape = c.output_shape.sizes();
  c.mode = kg::LoweringMode::Training;
  return c;
}
// The same with one dtype for every input.
inline kg::LowerContext lower_context(const kg::CustomData& op, const std::vector<std::vector<std::int64_t>>& shapes,
                                      kg::DType dtype) {
  return lower_context(op, shapes, std::vector<kg::DType>(shapes.size(), dtype));
}
// What lower() and lower_backward_source() are told for the problem.
inline kg::LowerContext lower_context(const Problem& p) {
  std::vector<std::vector<std::int64_t>> shapes;
  std::vector<kg::DType> dtypes;
  for (const auto& t : p.inputs) {
    shapes.push_back(t.shape());
    dtypes.push_back(t.dtype());
  }
  return lower_context(p.op, shapes, dtypes);
}

// The problem's parameters with their initialisation replaced by values from `rng` (floats in
// [lo, hi)); integer parameters are zero.
inline std::vector<kg::Tensor> make_params(const Problem& p, std::mt19937_64& rng, double lo = -1.0,
                                           double hi = 1.0) {
  std::vector<kg::Tensor> ps;
  for (const auto& spec : p.op->parameters(input_shapes(p))) {
    if (spec.dtype == kg::DType::F32 || spec.dtype == kg::DType::F64)
      ps.push_back(random_tensor(rng, spec.dtype, spec.shape, lo, hi));
    else
      ps.push_back(kg::Tensor::zeros(spec.dtype, spec.shape));
  }
  return ps;
}

// The CPU forward (the output poisoned first).
inline kg::Tensor forward(const Problem& p) {
  std::vector<kg::Shape> shapes;
  std::vector<kg::DType> dtypes;
  for (const auto& t : p.inputs) {
    shapes.push_back(kg::Shape::of(t.shape()));
    dtypes.push_back(t.dtype());
  }
  const kg::Shape out = p.op->infer_output_shape(shapes);
  kg::Tensor y = poisoned(p.op->infer_output_dtype(dtypes), out.sizes());
  kg::CpuContext ctx(p.inputs, p.params, y, p.training, p.seed);
  p.op->cpu_forward(ctx);
  return y;
}

// Gradients: one per input, then one per parameter; undefined (no data) where not wanted.
struct Grads {
  std::vector<kg::Tensor> inputs, params;
};

// Which gradients a run wants: every float input and trainable parameter unless told otherwise.
struct Wants {
  std::vector<bool> inputs, params;
};

inline Wants want_all(const Problem& p) {
  Wants w;
  for (const auto& t : p.inputs)
    w.inputs.push_back(t.dtype() == kg::DType::F32 || t.dtype() == kg::DType::F64);
  for (const auto& s : p.op->parameters(input_shapes(p))) w.params.push_back(s.trainable);
  return w;
}

// The CPU backward: tensors the op did not ask to keep are given without data, wanted gradients
// are NaN-poisoned first.
inline Grads cpu_backward(const Problem& p, const kg::Tensor& y, const kg::Tensor& dy, const Wants& w) {
  const kg::BackwardSaves saves = p.op->backward_saves();
  std::vector<kg::Tensor> ins;
  for (const auto& t : p.inputs)
    ins.push_back(saves.inputs ? t : kg::Tensor::wrap(nullptr, t.dtype(), t.shape()));
  kg::Tensor out = saves.output ? y : kg::Tensor::wrap(nullptr, y.dtype(), y.shape());
  Grads g;
  for (std::size_t i = 0; i < p.inputs.size(); ++i) {
    const auto& t = p.inputs[i];
    g.inputs.push_back(w.inputs[i] ? poisoned(t.dtype(), t.shape())
                                   : kg::Tensor::wrap(nullptr, t.dtype(), t.shape()));
  }
  for (std::size_t k = 0; k < p.params.size(); ++k) {
    const auto& t = p.params[k];
    g.params.push_back(w.params[k] ? poisoned(t.dtype(), t.shape())
                                   : kg::Tensor::wrap(nullptr, t.dtype(), t.shape()));
  }
  ChunkedBackwardContext ctx(ins, p.params, out, dy, g.inputs, g.params, p.training, p.seed);
  p.op->cpu_backward(ctx);
  return g;
}

inline kg::DevicePtr address(const kg::Tensor& t) { return reinterpret_cast<kg::DevicePtr>(t.raw()); }

// The lowered backward launches of `rt` (the op's own RuntimeOp when null) with source
// op->lower_backward_source(), run by the emulator in checked mode; wanted gradients are
// NaN-poisoned first, the others passed as null pointers. Each launch is checked against the
// kernel's CUDA signature, and against the NVRTC-compiled PTX where NVRTC is present.
inline Grads emulated_backward(const Problem& p, const kg::Tensor& y, const kg::Tensor& dy, const Wants& w,
                               std::shared_ptr<kg::RuntimeOp> rt = nullptr) {
  const kg::LowerContext ctx = lower_context(p);
  const auto lowered = p.op->lower(ctx);
  if (!rt) rt = lowered->runtime_op;
  const std::string source = p.op->lower_backward_source(ctx);
  EXPECT_FALSE(source.empty());
  const kg::BackwardSaves saves = p.op->backward_saves();
  std::vector<kg::emu::HostBuffer> buffers;
  auto dev = [&](const kg::Tensor& t, bool given, const std::string& name) {
    if (given) buffers.push_back({address(t), t.nbytes(), name});
    return kg::DeviceTensor{given ? address(t) : 0, t.shape(), t.dtype()};
  };
  // Copies of the inputs, so that a kernel writing into them shows.
  std::vector<kg::Tensor> keep;
  kg::LaunchTensors bt;
  for (std::size_t i = 0; i < p.inputs.size(); ++i) {
    keep.push_back(p.inputs[i].clone());
    bt.inputs.push_back(dev(keep.back(), saves.inputs, "input " + std::to_string(i)));
  }
  for (std::size_t k = 0; k < p.params.size(); ++k) {
    keep.push_back(p.params[k].clone());
    bt.params.push_back(dev(keep.back(), true, "param " + std::to_string(k)));
  }
  keep.push_back(y.clone());
  bt.output = dev(keep.back(), saves.output, "output");
  keep.push_back(dy.clone());
  bt.grad_output = dev(keep.back(), true, "grad_output");
  Grads g;
  for (std::size_t i = 0; i < p.inputs.size(); ++i) {
    g.inputs.push_back(w.inputs[i] ? poisoned(p.inputs[i].dtype(), p.inputs[i].shape())
                                   : kg::Tensor::wrap(nullptr, p.inputs[i].dtype(), p.inputs[i].shape()));
    bt.grad_inputs.push_back(dev(g.inputs.back(), w.inputs[i], "grad input " + std::to_string(i)));
  }
  for (std::size_t k = 0; k < p.params.size(); ++k) {
    g.params.push_back(w.params[k] ? poisoned(p.params[k].dtype(), p.params[k].shape())
                                   : kg::Tensor::wrap(nullptr, p.params[k].dtype(), p.params[k].shape()));
    bt.grad_params.push_back(dev(g.params.back(), w.params[k], "grad param " + std::to_string(k)));
  }
  bt.seed = p.seed;
  bt.training = p.training;
  kg::Tensor scratch;
  if (const std::size_t sb = rt->backward_scratch_bytes(bt); sb > 0) {
    scratch = poisoned(kg::DType::U8, {static_cast<std::int64_t>(sb)});
    bt.scratch = address(scratch);
    buffers.push_back({bt.scratch, sb, "scratch"});
  }
  const kg::lower::KernelModule module = kg::lower::make_module(p.op.name() + ".backward", source, "",
                                                                kg::compile::Compiler::available() ? 90 : 0);
  const auto launches =
      kg::lower::check_launches(module, rt->backward_launches(bt), "[" + p.op.name() + "]", "backward");
  EXPECT_GE(launches.size(), 1u);
  for (std::size_t l = 0; l < launches.size(); ++l) {
    const std::string label = "[" + p.op.name() + "] backward launch " + std::to_string(l);
    const kg::Launch& L = launches[l].launch;
    kg::emu::LaunchOptions o;
    o.checked = true;
    o.buffers = buffers;
    o.label = label;
    kg::emu::launch(p.op.name() + ".backward", source, launches[l].entry, L.grid, L.block, L.shared_bytes,
                    L.args, o);
  }
  // The kernels did not write what they only read.
  for (std::size_t i = 0; i < p.inputs.size() && saves.inputs; ++i) {
    EXPECT_EQ(std::memcmp(keep[i].raw(), p.inputs[i].raw(), p.inputs[i].nbytes()), 0);
  }
  return g;
}

// Central differences of Σ dy ⊙ y (f64) with respect to input `i` (or parameter i - n_inputs), f64.
inline kg::Tensor numeric_grad(Problem p, const kg::Tensor& dy, std::size_t which, double eps = 1e-6) {
  const bool is_input = which < p.inputs.size();
  kg::Tensor& t = is_input ? p.inputs[which] : p.params[which - p.inputs.size()];
  t = t.clone();
  EXPECT_EQ(t.dtype(), kg::DType::F64);
  double* d = t.data<double>();
  kg::Tensor g = kg::Tensor::zeros(kg::DType::F64, t.shape());
  for (std::int64_t k = 0; k < t.numel(); ++k) {
    const double v = d[k], h = eps * std::max(1.0, std::abs(v));
    d[k] = v + h;
    const kg::Tensor up = forward(p);
    d[k] = v - h;
    const kg::Tensor down = forward(p);
    d[k] = v;
    // Σ dy (up - down): the differences first, so that large outputs do not cancel in the sum.
    double s = 0;
    for (std::int64_t i = 0; i < up.numel(); ++i) s += dy.item(i) * (up.item(i) - down.item(i));
    g.data<double>()[k] = s / (2 * h);
  }
  return g;
}

// Checks every wanted gradient of the f64 problem against finite differences, and (when
// `emulate`) the emulated backward kernels against the CPU backward. The default tolerances leave
// room for the rounding of central differences (eps 1e-6) over sums of thousands of terms.
inline void check_f64(const Problem& p, bool emulate = true, double rtol = 1e-5, double atol = 1e-7,
                      std::shared_ptr<kg::RuntimeOp> rt = nullptr) {
  std::mt19937_64 rng(p.seed ^ 0x51ED);
  const kg::Tensor y = forward(p);
  ASSERT_TRUE(all_written(y));
  const kg::Tensor dy = random_tensor(rng, y.dtype(), y.shape());
  const Wants w = want_all(p);
  const Grads g = cpu_backward(p, y, dy, w);
  for (std::size_t j = 0; j < p.inputs.size() + p.params.size(); ++j) {
    const bool in = j < p.inputs.size();
    if (!(in ? w.inputs[j] : w.params[j - p.inputs.size()])) continue;
    SCOPED_TRACE(in ? "gradient of input " + std::to_string(j)
                    : "gradient of parameter " + std::to_string(j - p.inputs.size()));
    const kg::Tensor& got = in ? g.inputs[j] : g.params[j - p.inputs.size()];
    EXPECT_TRUE(all_written(got)) << "the CPU backward left elements unwritten";
    EXPECT_TRUE(all_close(got, numeric_grad(p, dy, j), rtol, atol)) << "CPU backward vs finite differences";
  }
  if (!emulate) return;
  const Grads e = emulated_backward(p, y, dy, w, rt);
  for (std::size_t j = 0; j < p.inputs.size() + p.params.size(); ++j) {
    const bool in = j < p.inputs.size();
    if (!(in ? w.inputs[j] : w.params[j - p.inputs.size()])) continue;
    SCOPED_TRACE(in ? "emulated gradient of input " + std::to_string(j)
                    : "emulated gradient of parameter " + std::to_string(j - p.inputs.size()));
    const kg::Tensor& got = in ? e.inputs[j] : e.params[j - p.inputs.size()];
    EXPECT_TRUE(all_written(got)) << "the kernel left elements unwritten";
    EXPECT_TRUE(all_close(got, in ? g.inputs[j] : g.params[j - p.inputs.size()], 1e-9, 1e-11))
        << "emulated backward vs the CPU backward";
  }
}

// kg::testing::check_gradients on the op in f64 (finite differences, then the lowered backward
// under the emulator), expecting a passing report.
inline void check_with_checker(const kg::CustomData& op, const std::vector<std::vector<std::int64_t>>& shapes,
                               kg::DType dtype, bool training = true, bool emulate = true, double rtol = 1e-4,
                               double atol = 1e-6) {
  kg::testing::GradCheckOptions o;
  o.seed = fresh_seed();
  o.training = training;
  o.emulate = emulate;
  o.rtol = rtol;
  o.atol = atol;
  const auto r = kg::testing::check_gradients(op, shapes, std::vector<kg::DType>(shapes.size(), dtype), o);
  EXPECT_TRUE(r.ok) << r.to_string();
  // The finite differences, and the kernels when asked, really ran.
  int cpu = 0, emulated = 0;
  for (const auto& l : r.lines) {
    cpu += l.rfind("PASS cpu_backward", 0) == 0;
    emulated += l.rfind("PASS emulator", 0) == 0;
  }
  EXPECT_GT(cpu, 0) << r.to_string();
  if (emulate) {
    EXPECT_GT(emulated, 0) << r.to_string();
  }
}

}  // namespace kg_test::bwd
