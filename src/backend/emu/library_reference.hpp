// The emulator's stand-in for the vendor libraries: a RuntimeOp's LibraryCall (a GemmCall or a
// Conv2dCall, include/kg/runtime_op.hpp) computed by its definition, with f64 sums, over host
// addresses. With it the emulator runs an op's library-call path (the call, then the op's
// epilogue kernels) on the CPU, so the description and the epilogue are checked where no GPU is.
#pragma once

#include <string>

#include "kg/runtime_op.hpp"

namespace kg::emu {

// Writes the call's output (for a convolution's backward passes, the gradient the pass writes).
// f32, f64, f16 and bf16 calls; another dtype is a kg::Error naming `label`. With `fuse`, a
// convolution's fusable epilogue (Conv2dCall::fusable) is computed too, as a library that fuses
// it would: returns whether it was, in which case the call's epilogue launches must not run.
bool run_library_reference(const LibraryCall& call, const std::string& label, bool fuse = false);

}  // namespace kg::emu
