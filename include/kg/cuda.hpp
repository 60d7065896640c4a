// The by-hand path: compile a CUDA C++ kernel, own device memory, and launch the kernel
// yourself, outside any graph. It shares the graph path's compiler and caches (NVRTC, the
// in-process cache, the disk cache of KG_CACHE_DIR) and its checks: the entry point against the
// compiled PTX, the block against __launch_bounds__, the grid, and every packed argument
// against the kernel's parameters (count, sizes, int vs float, names from the source).
//
//   auto k = kg::cuda::Kernel::compile("my.saxpy", source, "saxpy");
//   kg::cuda::DeviceTensorBuffer x = kg::cuda::DeviceTensorBuffer::from(host_x), y = ...;
//   k.launch({blocks, 1, 1}, {256, 1, 1}, [&](kg::ArgVisitor& a) {
//     a.pointer(x.ptr()); a.pointer(y.ptr()); a.f32(2.f); a.i32(n);
//   });
//   kg::Tensor result = y.download();  // waits for the launch
//
// Launches go to the device's stream, the one loaded models on that device use, so a kernel
// launched by hand is ordered with a model's forward passes. Without a GPU every call that
// needs one throws kg::Error "CUDA is not available: <why>"; compile_ptx and
// Kernel::compile_for_arch work anywhere NVRTC does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kg/runtime_op.hpp"
#include "kg/tensor.hpp"

namespace kg::cuda {

// True when a GPU is usable by this build on this machine.
bool available();
// Why available() is false ("" when it is true).
std::string unavailable_reason();
// Usable CUDA devices (0 without a GPU).
int device_count();
// The name of device `device` ("NVIDIA H200"). Throws kg::Error without a GPU.
std::string device_name(int device = 0);
// The compute capability of device `device` as major*10+minor (90 for sm_90).
int device_arch(int device = 0);
// Waits until everything launched on the device's stream has finished.
void synchronize(int device = 0);
// Where a kernel fault was first seen ("" while none was). A fault leaves the CUDA context
// unusable for the rest of the process (CUDA cannot recover from it in-process); every later CUDA
// error says where it was first seen. Run GPU checks of a kernel that may fault in a process of
// their own.
std::string first_fault();

// The architectures (major*10+minor) this build's NVRTC compiles for; empty without NVRTC.
std::vector<int> compile_archs();
// CUDA C++ → PTX for compute capability `arch`, through the shared compiler and its caches.
// `name` names the kernel in errors (an NVRTC failure carries its full log). No GPU needed.
std::string compile_ptx(const std::string& name, const std::string& source, int arch = 90);

// Device memory holding one tensor (dtype and sizes fixed at construction). Move-only.
class DeviceTensorBuffer {
 public:
  DeviceTensorBuffer();
  // Uninitialised memory for `shape` × `dtype` on device `device`.
  DeviceTensorBuffer(DType dtype, std::vector<std::int64_t> shape, int device = 0);
  // A buffer shaped like `t`, holding a copy of it.
  static DeviceTensorBuffer from(const Tensor& t, int device = 0);
  ~DeviceTensorBuffer();
  DeviceTensorBuffer(DeviceTensorBuffer&&) noexcept;
  DeviceTensorBuffer& operator=(DeviceTensorBuffer&&) noexcept;
  DeviceTensorBuffer(const DeviceTensorBuffer&) = delete;
  DeviceTensorBuffer& operator=(const DeviceTensorBuffer&) = delete;

  // Copies `t` to the device (ordered after earlier launches); its dtype and sizes must match.
  void upload(const Tensor& t);
  // Waits for earlier launches and copies the buffer back.
  Tensor download() const;
  // Sets every byte to `value` (0xFF makes every float a NaN), ordered with launches.
  void fill_bytes(unsigned char value);

  // The device address (0 for an empty buffer), for ArgVisitor::pointer.
  DevicePtr ptr() const;
  // Address, sizes and dtype together.
  DeviceTensor tensor() const;
  DType dtype() const;
  const std::vector<std::int64_t>& shape() const;
  std::size_t nbytes() const;
  int device() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A compiled kernel entry point. Copies share the compiled module.
class Kernel {
 public:
  // Compiles `source` for device `device`'s architecture and loads it; `entry` is the
  // kernel's name (declare it extern "C" __global__; a C++-mangled name is matched too).
  // Throws kg::Error naming `name` for a compile error, an entry missing from the PTX, or
  // no GPU.
  static Kernel compile(const std::string& name, const std::string& source, const std::string& entry,
                        int device = 0);
  // Compiles for compute capability `arch` without a device: check() works, launch() throws.
  static Kernel compile_for_arch(const std::string& name, const std::string& source, const std::string& entry,
                                 int arch);

  // Packs the arguments with `pack`, checks block, grid and arguments, and launches on the
  // device's stream (asynchronous; DeviceTensorBuffer::download or synchronize() waits).
  void launch(Dim3 grid, Dim3 block, const std::function<void(ArgVisitor&)>& pack,
              std::size_t shared_bytes = 0) const;
  // Everything launch() checks, without launching.
  void check(Dim3 grid, Dim3 block, const std::function<void(ArgVisitor&)>& pack) const;

  const std::string& name() const;
  // The entry point as it appears in the PTX.
  const std::string& entry() const;
  const std::string& ptx() const;
  // The compute capability the PTX was compiled for.
  int arch() const;
  // The kernel's parameter names, from the CUDA signature (empty when not found).
  const std::vector<std::string>& param_names() const;
  // Whether compile() found the PTX in the disk cache.
  bool from_disk_cache() const;

  struct Impl;  // private to the library

 private:
  std::shared_ptr<const Impl> impl_;
};

}  // namespace kg::cuda
