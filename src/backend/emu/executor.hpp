// Running CUDA kernels on the CPU: a single launch of a kernel source with packed arguments, or a
// whole model lowered exactly as for a GPU (same kernels, same RuntimeOps, same argument packs)
// with host addresses in place of device ones. Pointer arguments get guarded copies of the
// buffers they point into (an access past either end faults at once and is reported with the
// argument's name and the element index) in checked mode and, where the caller says so
// (LaunchOptions::guarded), in plain runs too; in checked mode every launch also runs twice, its
// threads in forward and in reverse order between barriers: a difference in the results is a race.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "backend/emu/emu_runtime.hpp"
#include "kg/model.hpp"
#include "kg/runtime_op.hpp"
#include "lower/launch_check.hpp"

namespace kg::emu {

struct JitModule;  // backend/emu/host_jit.hpp

// Host memory a launch may touch: pointer arguments are matched to these in checked mode.
struct HostBuffer {
  DevicePtr address = 0;
  std::size_t bytes = 0;
  std::string name;
};

struct LaunchOptions {
  // Guarded copies of `buffers`, the launch run in both orders and the results compared.
  bool checked = false;
  // Without `checked`: guarded copies of `buffers` all the same, the launch run once (in
  // `order`), so that an access past a buffer's end faults and is reported instead of
  // corrupting the process's memory. What plain cpu runs of emulated kernels use.
  bool guarded = false;
  // Every buffer the pointer arguments point into (checked or guarded; a pointer outside all of
  // them is an error). Empty: pointer arguments are not guarded.
  std::vector<HostBuffer> buffers;
  std::string label;             // error prefix; default "[<name>]"
  Order order = Order::Forward;  // unchecked launches
  // The pool the blocks run on (the model's); null: the process-wide one.
  util::ThreadPool* pool = nullptr;
};

// Compiles `source` for the CPU (cached) and runs `entry` ("" for the only __global__ function)
// on the grid. The arguments are checked against the kernel's C++ signature: count, byte size and
// kind, naming the parameter.
void launch(const std::string& name, const std::string& source, const std::string& entry, Dim3 grid,
            Dim3 block, std::size_t shared, const lower::ArgPack& args);
void launch(const std::string& name, const std::string& source, const std::string& entry, Dim3 grid,
            Dim3 block, std::size_t shared, const lower::ArgPack& args, const LaunchOptions& options);
// The same for a module already loaded (HostJit::load): no source to hash on every launch.
void launch(const JitModule& module, const std::string& entry, Dim3 grid, Dim3 block, std::size_t shared,
            const lower::ArgPack& args, const LaunchOptions& options);

// Lowers `model`, sizes its launches for the shapes of `inputs`, places the arena, inputs and
// parameters in host memory (the arena filled with 0xFF bytes: NaN for floats) and runs every
// launch through the emulator (on guarded copies of the node's buffers, also unchecked). `params` replace parameters by full dotted name (the others keep
// their initialisation with seed 0). With `library_calls`, an op that describes a vendor-library
// call runs that path instead of its launches, as on a GPU with the libraries: the call by its
// definition (run_library_reference), then the op's epilogue launches emulated; `library_steps`,
// when given, gets the number of ops that did. With `fused_steps` given, a convolution's call
// that describes a fusable epilogue (Conv2dCall::fusable) computes it, as cuDNN's fused graphs
// do, and its epilogue launches do not run; `fused_steps` gets the number of such ops. Returns
// the model's outputs.
std::vector<Tensor> run_model(const Model& model, const std::vector<Tensor>& inputs,
                              const std::map<std::string, Tensor>& params, bool checked,
                              bool library_calls = false, int* library_steps = nullptr,
                              int* fused_steps = nullptr);

}  // namespace kg::emu
