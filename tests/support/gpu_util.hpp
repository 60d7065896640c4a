// Checking an op's GPU lowering: everywhere, every launch is packed and checked against its
// kernel's CUDA signature (a dry run; with NVRTC every kernel is also compiled for sm_90 and
// checked against its PTX), and the model runs through the CUDA emulator in
// checked mode and must match the CPU; where a GPU is present, the graph also runs on it and must
// match the CPU implementation.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "kg/kg.hpp"

namespace kg_test {

using BuildFn = std::function<std::vector<kg::SymTensor>(const std::vector<kg::SymTensor>&)>;

// Dry run at sm_90 (at arch 0, the signature checks only, without NVRTC); an emulated run compared with the CPU
// (check_emulated); with a GPU, a run on it compared with the CPU. Comparisons are elementwise
// |got - cpu| <= atol + rtol*|cpu|; parameters are copied from the CPU model. Returns true when
// the GPU path ran.
bool check_lowering(const BuildFn& build, const std::vector<kg::Tensor>& inputs, double rtol = 1e-5,
                    double atol = 1e-6);

// Outputs with more elements than this are not emulated (emulation is for small shapes; every
// size the op tests use today stays under it).
constexpr std::int64_t kMaxEmulatedElements = 5'000'000;

// Runs `model` through the CUDA emulator in checked mode (kg::emu::run_model: every buffer
// guarded, threads in both orders) with `params` and compares its outputs with `want` (the CPU
// outputs) at the given tolerances. Skipped, with a note, when the outputs have more than
// kMaxEmulatedElements elements (KG_TEST_EMULATE_MAX=<n> changes the limit) or when
// KG_TEST_EMULATE=0. Returns true when it ran.
bool check_emulated(const kg::Model& model, const std::vector<kg::Tensor>& inputs,
                    const std::map<std::string, kg::Tensor>& params, const std::vector<kg::Tensor>& want,
                    double rtol = 1e-5, double atol = 1e-6);

}  // namespace kg_test
