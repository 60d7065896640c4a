// Optimiser updates with PyTorch's rules: SGD (momentum, L2 weight decay) and AdamW (decoupled
// weight decay, bias-corrected moments). The CPU form is here; the CUDA kernels in
// optimizer.cu apply the same arithmetic on the device.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kg/model.hpp"

namespace kg::plan {

// Names of the per-parameter state tensors the optimiser keeps ("momentum_buffer";
// "exp_avg", "exp_avg_sq"; none for plain SGD).
std::vector<std::string> optimizer_slots(const OptimizerOptions& options);

// Checks the options (lr >= 0, betas in [0, 1), eps > 0, momentum >= 0, ...).
void check_optimizer(const OptimizerOptions& options);

// One update of `param` from `grad` at step `step` (1-based), with `slots` as named by
// optimizer_slots (zero-initialised before the first step). f32 and f64.
void optimizer_update_cpu(const OptimizerOptions& options, std::int64_t step, Tensor& param, const Tensor& grad,
                          std::vector<Tensor>& slots);

}  // namespace kg::plan
