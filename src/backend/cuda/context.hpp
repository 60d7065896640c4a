// One GPU: its primary context, a stream, memory, modules and launches.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "backend/cuda/driver.hpp"
#include "kg/runtime_op.hpp"

namespace kg::cuda {

class Context {
 public:
  // The context of device `index` (created at first use). Throws kg::Error without a GPU.
  static Context& get(int index);
  ~Context();

  const Driver& driver() const { return d_; }
  int index() const { return index_; }
  // Compute capability as major*10+minor (90 for sm_90).
  int arch() const { return arch_; }
  const std::string& name() const { return name_; }
  CUstream stream() const { return stream_; }
  void make_current() const;

  DevicePtr alloc(std::size_t bytes);
  // The device's free and total memory now, in bytes (cuMemGetInfo).
  struct MemoryInfo {
    std::size_t free = 0;
    std::size_t total = 0;
  };
  MemoryInfo memory_info() const;
  void free(DevicePtr p) noexcept;
  void upload(DevicePtr dst, const void* src, std::size_t bytes);    // synchronous
  void download(void* dst, DevicePtr src, std::size_t bytes);        // synchronous
  void upload_async(DevicePtr dst, const void* src, std::size_t bytes);
  void download_async(void* dst, DevicePtr src, std::size_t bytes);
  void fill_bytes_async(DevicePtr dst, unsigned char value, std::size_t bytes);
  // Waits for the stream; `after` names what ran (an op's kernel) in the error of a fault.
  void synchronize(const std::string& after = "");

  // The function `entry` (exact PTX name) of the module built from `ptx`; modules are cached in
  // memory by content (and machine-code folder), their CUBINs on disk (see load_module). `label`
  // names the op in errors.
  CUfunction function(const std::string& ptx, const std::string& entry, const std::string& label);
  // The driver's version (cuDriverGetVersion: 13000 for 13.0; 0 when it would not say).
  int driver_version() const { return driver_version_; }
  // Launches on the context's stream and checks the launch status.
  void launch(CUfunction f, Dim3 grid, Dim3 block, std::size_t shared_bytes, void** params,
              const std::string& label);

 private:
  explicit Context(int index);
  // Loads the module of `ptx` (content hash `ptx_hash`) from the CUBIN cached in `cubin_dir` for this
  // device and driver; on a miss, or a CUBIN the driver refuses, links the PTX to a CUBIN, loads and
  // stores that; when no CUBIN can be had, loads the PTX (the driver JITs it). Throws only when the
  // PTX itself cannot be loaded.
  CUmodule load_module(const std::string& ptx, const std::string& ptx_hash,
                       const std::filesystem::path& cubin_dir, const std::string& what);
  // The PTX compiled to a CUBIN for this device by the driver's linker; nullopt when that failed.
  std::optional<std::string> link_cubin(const std::string& ptx) const;
  const Driver& d_;
  int index_;
  int arch_ = 0;
  int driver_version_ = 0;
  std::string name_;
  CUdevice device_ = 0;
  CUcontext ctx_ = nullptr;
  CUstream stream_ = nullptr;
  std::mutex mu_;
  std::map<std::string, CUmodule> modules_;  // by content hash of the PTX and CUBIN folder
};

// Owns device memory.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Context& ctx, std::size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DevicePtr ptr() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }

 private:
  Context* ctx_ = nullptr;
  DevicePtr ptr_ = 0;
  std::size_t bytes_ = 0;
};

}  // namespace kg::cuda
