// The launch checks: packed arguments against the kernel's CUDA signature and its PTX (count,
// width, kind, and a pointer's element type against the dtype of the tensor packed there), block
// against __launch_bounds__ / .reqntid / .maxntid, the entry point against the module, zero
// grids, and parameter init sizes. Each failure is a kg::Error naming op, node and numbers.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "compile/cuda_source.hpp"
#include "compile/ptx.hpp"
#include "kg/error.hpp"
#include "kg/runtime_op.hpp"

namespace kg::lower {

// The arguments of a launch, as bytes ready for cuLaunchKernel.
using ArgPack = KernelArgs;

// The entry named `entry_point` (or the module's only visible entry when empty). `label` is
// "[op @ node]".
const compile::PtxEntry& resolve_entry(const std::vector<compile::PtxEntry>& entries,
                                       const std::string& entry_point, const std::string& label);

// Visited arguments against the entry's parameters: count, byte size and kind. `names` are the
// parameter names from the CUDA signature (may be empty).
void check_args(const compile::PtxEntry& entry, const ArgPack& pack, const std::vector<std::string>& names,
                const std::string& label, int launch = 0);

// The block against the entry's .reqntid / .maxntid, and the 1024-thread limit.
void check_block(const compile::PtxEntry& entry, Dim3 block, const std::string& label, int launch = 0);

// The kernels of a CUDA source as the checks need them (parsed once per distinct source).
const std::vector<compile::KernelSignature>& source_kernels(const std::string& source);

// The kernel `entry` ("" = the only __global__ function) of `kernels`; the error lists the ones
// there are. `what` says which module ("" for the forward, "backward").
const compile::KernelSignature& resolve_source_entry(const std::vector<compile::KernelSignature>& kernels,
                                                     const std::string& entry, const std::string& label,
                                                     const std::string& what);

// One launch against the kernel's CUDA signature, on any device: grid (no zero dimension, within
// CUDA's limits), dynamic shared memory, block (1 to 1024 threads, x and y up to 1024, z up to 64, within __launch_bounds__ where that is a number), and every argument's
// count, width and kind (pointer, integer, float), naming the parameter and its C++ type.
// `index` numbers the launch in messages; `what` is "" for the forward, "backward" for the
// backward.
void check_launch(const compile::KernelSignature& kernel, const Launch& launch, const std::string& label,
                  int index, const std::string& what);

// The dtype a pointer parameter's element type names: `const float*` f32, `double*` f64,
// `__nv_bfloat16*` / `kg_bf16*` bf16, `__half*` / `kg_f16*` f16, `int*` i32, `long long*` /
// `int64_t*` i64, `bool*` bool, vector types (`float4*`) their element's. A typedef or `using`
// alias in `source` is followed. nullopt where the type says nothing checkable: a byte pointer
// (char, unsigned char, int8_t, uint8_t), void, a struct, a template parameter, a non-pointer.
// `unsigned_bytes` is set for unsigned integer elements (`unsigned*`, `uint16_t*`): raw words,
// which the load's check accepts over any dtype (a copy kernel moves any tensor's bytes as words).
struct PointeeType {
  std::optional<DType> dtype;
  std::size_t unsigned_bytes = 0;  // > 0: an unsigned integer of this size (a bit view)
};
PointeeType pointee_type(const std::string& type, const std::string& source = "");

// Every pointer argument of `launch` that points into one of `tensors`' buffers (inputs,
// parameters, output, gradients; not scratch) against that tensor's dtype: an error naming the
// kernel, the argument's index, name and C++ type, the tensor and its dtype.
void check_pointees(const compile::KernelSignature& kernel, const Launch& launch, const LaunchTensors& tensors,
                    const std::string& source, const std::string& label, int index, const std::string& what);

// `err` with "[op @ node]" in front, unless its message already starts with it.
Error labelled(const std::string& label, const Error& err);

// CUDA's launch limits: grid x up to 2^31 - 1 blocks, y and z up to 65535; a block of 1 to
// 1024 threads (x, y up to 1024, z up to 64); dynamic shared memory up to 227 KiB per block (the
// most any supported GPU allows once the runtime raises the 48 KiB default, sm_90's opt-in limit).
inline constexpr unsigned long long kMaxGridX = 2147483647ull;
inline constexpr unsigned long long kMaxGridYZ = 65535ull;
inline constexpr std::size_t kMaxDynamicSharedBytes = 227 * 1024;

// A grid with a zero dimension launches nothing, and one over CUDA's limits (kMaxGridX,
// kMaxGridYZ) cannot be launched: an error naming `kernel` when given.
void check_grid(Dim3 grid, const std::vector<std::int64_t>& output_shape, const std::string& label,
                int launch = 0, const std::string& kernel = "");

// The dynamic shared memory of one launch against kMaxDynamicSharedBytes.
void check_shared(std::size_t shared_bytes, const std::string& label, int launch = 0,
                  const std::string& kernel = "");

}  // namespace kg::lower
