// Checking an op's GPU lowering: everywhere, every kernel is compiled with NVRTC for sm_90 and
// every launch packed and checked (a dry run); where a GPU is present, the graph also runs on it
// and must match the CPU implementation.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "kg/kg.hpp"

namespace kg_test {

using BuildFn = std::function<std::vector<kg::SymTensor>(const std::vector<kg::SymTensor>&)>;

// Dry run at sm_90 (skipped without NVRTC) and, with a GPU, a run on it compared with the CPU
// at relative tolerance `rtol` (elementwise |gpu - cpu| <= atol + rtol*|cpu|); parameters are
// copied from the CPU model to the GPU model. Returns true when the GPU path ran.
bool check_lowering(const BuildFn& build, const std::vector<kg::Tensor>& inputs, double rtol = 1e-5,
                    double atol = 1e-6);

}  // namespace kg_test
