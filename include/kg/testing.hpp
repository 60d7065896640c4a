// Checking a custom op the way the library checks its own: shape inference at several batch
// sizes, the CPU implementation (every output element written, reruns bitwise equal), the
// lowered kernel run by the CUDA emulator in checked mode (guard pages, forward and reverse
// thread order) against the CPU, and on a GPU when one is present.
#pragma once

#include <cstdint>
#include <functional>
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
};

struct CheckOpReport {
  // One line per check: "PASS ...", "FAIL ..." or "SKIP ...", with the op, node and numbers.
  std::vector<std::string> lines;
  // False when any check failed.
  bool ok = true;
  // A heading and the lines, one per row.
  std::string to_string() const;
};

// Records `op` on inputs of `input_shapes` (symbolic: dynamic dims are bound to each batch size)
// and `dtypes`, then for each batch size: checks infer_output_shape with concrete sizes against
// the recorded shape and the kernel's, runs the CPU implementation on poisoned outputs, the
// lowered kernel under emulation and on a GPU, compares them with the CPU and reruns each. An op
// with a backward (CustomOp::has_cpu_backward) also gets check_gradients at the largest batch
// size. Never throws for a failing op: every failure is a line of the report.
// Options of the gradient check.
struct GradCheckOptions {
  // Central-difference step, taken in f64 when the op accepts f64 inputs.
  double eps = 1e-6;
  // |backward - reference| <= atol + rtol * |reference|, per element.
  double rtol = 1e-4, atol = 1e-6;
  // Seed of the random inputs, parameters and output gradient; 0 draws a fresh one.
  std::uint64_t seed = 0;
  // Run the op in train mode (Dropout, BatchNorm batch statistics).
  bool training = true;
  // Also run the lowered backward kernels under the CUDA emulator (checked mode), and on a GPU
  // when one is usable, against the CPU backward.
  bool emulate = true;
  bool gpu = true;
  // Makes input `index` (as CheckOpOptions::make_input); e.g. valid class labels.
  std::function<Tensor(int index, const std::vector<std::int64_t>& shape)> make_input;
};

// Checks an op's backward at concrete input shapes: its CPU backward against central finite
// differences of its CPU forward, for every float input and trainable parameter and a random
// output gradient (in f64 when `dtypes` are f64); every wanted gradient element written; then
// the lowered backward kernels against the CPU backward. Every failure is a report line naming
// the op, the tensor, the element and both values. Never throws for a failing op.
CheckOpReport check_gradients(const CustomData& op, const std::vector<std::vector<std::int64_t>>& input_shapes,
                              const std::vector<DType>& dtypes, const GradCheckOptions& options = {});

CheckOpReport check_op(const CustomData& op, const std::vector<Shape>& input_shapes,
                       const std::vector<DType>& dtypes, const CheckOpOptions& options = {});

}  // namespace kg::testing
