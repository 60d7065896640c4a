// Checking a custom op the way the library checks its own: shape inference at several batch
// sizes, the CPU implementation (every output element written, reruns bitwise equal), the
// lowered kernel run by the CUDA emulator in checked mode (guard pages, forward and reverse
// thread order) against the CPU, and on a GPU when one is present.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "kg/custom_op.hpp"
#include "kg/dtype.hpp"
#include "kg/shape.hpp"
#include "kg/tensor.hpp"

namespace kg::testing {

struct CheckOpOptions {
  // Every dynamic dim of the input shapes takes each of these sizes in turn.
  std::vector<std::int64_t> batch_sizes = {1, 3, 8};
  // Elementwise tolerance of the comparisons: |got - cpu| <= atol + rtol * |cpu|.
  double rtol = 1e-5, atol = 1e-6;
  // Seed of the random inputs; 0 draws a fresh one (printed in the report).
  std::uint64_t seed = 0;
  // Run the lowered kernel through the CUDA emulator (checked mode).
  bool emulate = true;
  // Run on the GPU when one is usable.
  bool gpu = true;
  // Extra identical runs of each path whose results must be bitwise equal to the first.
  int reruns = 2;
  // Makes input `index` of the given concrete shape (it must have that shape and the input's
  // dtype). Empty: uniform random values in [-1, 1] (integers in {-1, 0, 1}; {0, 1} unsigned).
  std::function<Tensor(int index, const std::vector<std::int64_t>& shape)> make_input;
  // An independent reference for the output: given the inputs and the parameters (by the names
  // the op declares), returns what the op should compute. The CPU implementation (or, for an op
  // without one, the emulated kernel) is compared with it; the other paths with the CPU. Without
  // it, an op with no CPU implementation has no independent reference (a SKIP line says so).
  std::function<Tensor(const std::vector<Tensor>& inputs, const std::map<std::string, Tensor>& params)> reference;
};

struct CheckOpReport {
  // One line per check: "PASS ...", "FAIL ..." or "SKIP ...", with the op, node and numbers.
  // Every check has its line: one that could not run is a SKIP line that says why.
  std::vector<std::string> lines;
  // False when any check failed.
  bool ok = true;
  // The function that made the report ("check_op", "check_gradients"), for the heading.
  std::string check = "check_op";
  // A heading with the worst result and the counts ("check_op: FAILED (2 failed, 9 passed,
  // 3 skipped)"), then the lines, one per row.
  std::string to_string() const;
};

// Options of the gradient check.
struct GradCheckOptions {
  // Central-difference step (times max(1, |x|)), taken in f64 when the op accepts f64 copies of
  // the inputs. When it does not (an op configured for f32), the check runs in the dtypes given
  // with the step at least 3e-3 (f32) or 3e-2 (f16, bf16) and rtol, atol at least 1e-2, 1e-3.
  double eps = 1e-6;
  // |backward - reference| <= atol + rtol * |reference|, per element. At a non-differentiable
  // point (the one-sided differences disagree) a value between the one-sided slopes passes.
  double rtol = 1e-4, atol = 1e-6;
  // Seed of the random inputs, parameters and output gradient; 0 draws a fresh one.
  std::uint64_t seed = 0;
  // Run the op in train mode (Dropout, BatchNorm batch statistics). Every forward and backward
  // gets the same seed, so random masks repeat.
  bool training = true;
  // Also run the lowered backward kernels under the CUDA emulator (checked mode), and on a GPU
  // when one is usable, against the CPU backward.
  bool emulate = true;
  bool gpu = true;
  // Makes input `index` (as CheckOpOptions::make_input); e.g. valid class labels.
  std::function<Tensor(int index, const std::vector<std::int64_t>& shape)> make_input;
  // Finite differences at most at this many elements per tensor (the first, the last and
  // random others); a tensor with fewer is checked at every element.
  std::int64_t max_elements = 64;
  // Tolerance of the lowered backward (emulated, GPU) against the CPU backward, which is run in
  // the dtypes given (kernels reduce in another order).
  double lowered_rtol = 1e-4, lowered_atol = 1e-5;
};

// Checks an op's backward at concrete input shapes, for every float input and trainable
// parameter (non-trainable ones get no gradient) and a random output gradient:
//  - the CPU backward on NaN-poisoned gradients: every element written, and equal to central
//    finite differences of sum(grad_output * cpu_forward), in f64 when the op recorded on f64
//    copies of the inputs gives an f64 output (its parameters then in the dtypes it declares
//    for f64 inputs, as in a model: see ParamSpec::dtype_from_input), else in the dtypes given;
//    an INFO line says which dtypes were used;
//  - tensors that backward_saves() does not keep are given without data, as the runtime does.
//    Before that, the backward runs with stand-ins of other values for them: a changed
//    gradient means it reads such a tensor, which is reported (a backward that reads one
//    without changing its result would crash on the null data instead);
//  - the lowered backward (lower_backward_source, RuntimeOp::backward_launches): compiled with
//    NVRTC for sm_90 and checked against the PTX where NVRTC is present, run under the
//    emulator in checked mode and on a GPU when one is usable, in the dtypes given, on
//    NaN-filled gradient buffers, against the CPU backward (or against finite differences
//    when the op has no CPU backward). A zero grid dimension fails naming the launch.
// Every failure is a report line naming the op, the tensor, the element and both values.
// Never throws for a failing op.
CheckOpReport check_gradients(const CustomData& op, const std::vector<std::vector<std::int64_t>>& input_shapes,
                              const std::vector<DType>& dtypes, const GradCheckOptions& options = {});

// Records `op` on inputs of `input_shapes` (symbolic: dynamic dims are bound to each batch size)
// and `dtypes`, then for each batch size: checks infer_output_shape with concrete sizes against
// the recorded shape and the kernel's, runs the CPU implementation on poisoned outputs (with a
// canary after the output's end), the lowered kernel under emulation and on a GPU (in checked
// mode; not after the emulator found the kernel broken, nor after a GPU fault earlier in the
// process), compares them with the CPU (or CheckOpOptions::reference) and reruns each. An op
// with an elementwise_form() also has that form (what the fusion pass runs in its place) run on
// the CPU and compared with the op's own result. An op with a backward (a CPU one, or backward
// launches in its RuntimeOp) also gets check_gradients at the largest batch size, its lines
// marked "gradients batch <n>". Never throws for a failing op: every failure is a line of the
// report, and a check that cannot run after an earlier failure is a SKIP line saying so.
CheckOpReport check_op(const CustomData& op, const std::vector<Shape>& input_shapes,
                       const std::vector<DType>& dtypes, const CheckOpOptions& options = {});

}  // namespace kg::testing
