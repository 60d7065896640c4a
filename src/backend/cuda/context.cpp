#ifdef KG_HAVE_CUDA
#include "backend/cuda/context.hpp"

#include <atomic>
#include <iostream>
#include <vector>

#include "compile/compiler.hpp"
#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::cuda {

Context& Context::get(int index) {
  static std::mutex mu;
  static std::map<int, std::unique_ptr<Context>> contexts;
  std::lock_guard<std::mutex> lk(mu);
  auto& c = contexts[index];
  if (!c) c.reset(new Context(index));
  c->make_current();
  return *c;
}

Context::Context(int index) : d_(Driver::require()), index_(index) {
  int count = 0;
  d_.check(d_.cuDeviceGetCount(&count), "cuDeviceGetCount");
  if (index < 0 || index >= count)
    throw Error(util::cat("device cuda:", index, " does not exist (", count, " CUDA device(s))"));
  d_.check(d_.cuDeviceGet(&device_, index), "cuDeviceGet");
  int major = 0, minor = 0;
  d_.check(d_.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device_),
           "cuDeviceGetAttribute");
  d_.check(d_.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device_),
           "cuDeviceGetAttribute");
  arch_ = major * 10 + minor;
  if (d_.cuDriverGetVersion(&driver_version_) != CUDA_SUCCESS) driver_version_ = 0;
  char name[256] = {};
  d_.check(d_.cuDeviceGetName(name, sizeof name, device_), "cuDeviceGetName");
  name_ = name;
  d_.check(d_.cuDevicePrimaryCtxRetain(&ctx_, device_), "cuDevicePrimaryCtxRetain");
  d_.check(d_.cuCtxSetCurrent(ctx_), "cuCtxSetCurrent");
  d_.check(d_.cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
}

Context::~Context() {
  // Process exit: the driver may already be tearing down; release quietly.
  for (auto& [k, m] : modules_) d_.cuModuleUnload(m);
  if (stream_) d_.cuStreamDestroy(stream_);
  if (ctx_) d_.cuDevicePrimaryCtxRelease(device_);
}

void Context::make_current() const { d_.check(d_.cuCtxSetCurrent(ctx_), "cuCtxSetCurrent"); }

DevicePtr Context::alloc(std::size_t bytes) {
  CUdeviceptr p = 0;
  if (bytes == 0) bytes = 1;
  CUresult r = d_.cuMemAlloc(&p, bytes);
  if (r != CUDA_SUCCESS) {
    std::size_t free_b = 0, total = 0;
    d_.cuMemGetInfo(&free_b, &total);
    d_.check(r, util::cat("cuMemAlloc of ", bytes, " bytes on cuda:", index_, " (", free_b, " of ", total,
                          " bytes free)"));
  }
  return static_cast<DevicePtr>(p);
}

Context::MemoryInfo Context::memory_info() const {
  make_current();
  MemoryInfo m;
  d_.check(d_.cuMemGetInfo(&m.free, &m.total), util::cat("cuMemGetInfo on cuda:", index_));
  return m;
}

void Context::free(DevicePtr p) noexcept {
  if (p) d_.cuMemFree(static_cast<CUdeviceptr>(p));
}

// Synchronous copies go through the context's own stream (kernels run on it, and it does not
// synchronise with the legacy default stream), then wait for it.
void Context::upload(DevicePtr dst, const void* src, std::size_t bytes) {
  if (!bytes) return;
  upload_async(dst, src, bytes);
  synchronize();
}
void Context::download(void* dst, DevicePtr src, std::size_t bytes) {
  if (!bytes) return;
  download_async(dst, src, bytes);
  synchronize();
}
void Context::upload_async(DevicePtr dst, const void* src, std::size_t bytes) {
  if (bytes)
    d_.check(d_.cuMemcpyHtoDAsync(static_cast<CUdeviceptr>(dst), src, bytes, stream_), "cuMemcpyHtoDAsync");
}
void Context::download_async(void* dst, DevicePtr src, std::size_t bytes) {
  if (bytes)
    d_.check(d_.cuMemcpyDtoHAsync(dst, static_cast<CUdeviceptr>(src), bytes, stream_), "cuMemcpyDtoHAsync");
}
void Context::fill_bytes_async(DevicePtr dst, unsigned char value, std::size_t bytes) {
  if (bytes)
    d_.check(d_.cuMemsetD8Async(static_cast<CUdeviceptr>(dst), value, bytes, stream_), "cuMemsetD8Async");
}
void Context::synchronize(const std::string& after) {
  d_.check(d_.cuStreamSynchronize(stream_),
           after.empty() ? "cuStreamSynchronize" : after + ": cuStreamSynchronize");
}

CUfunction Context::function(const std::string& ptx, const std::string& entry, const std::string& label) {
  std::lock_guard<std::mutex> lk(mu_);
  const std::string ptx_hash = compile::content_hash(ptx);
  const std::filesystem::path cubin_dir = compile::cubin_cache_dir();
  const std::string key = ptx_hash + "\n" + cubin_dir.string();
  CUmodule& m = modules_[key];
  if (!m) {
    try {
      m = load_module(ptx, ptx_hash, cubin_dir, label + " loading the module for '" + entry + "'");
    } catch (...) {
      modules_.erase(key);
      throw;
    }
  }
  CUfunction f = nullptr;
  d_.check(d_.cuModuleGetFunction(&f, m, entry.c_str()), label + " cuModuleGetFunction('" + entry + "')");
  return f;
}

CUmodule Context::load_module(const std::string& ptx, const std::string& ptx_hash,
                              const std::filesystem::path& cubin_dir, const std::string& what) {
  make_current();
  const compile::CubinCache cache(cubin_dir);
  std::string why;
  const bool usable = driver_version_ > 0 && cache.usable(&why);
  if (!usable && !cubin_dir.empty()) {
    static std::atomic<bool> told{false};
    if (driver_version_ <= 0) why = "the driver did not give its version";
    if (!told.exchange(true))
      std::cerr << "kernelgraph: not keeping machine code in " << cubin_dir.string() << ": " << why
                << "; kernels are compiled from PTX at every load\n";
  }
  if (usable) {
    const std::string key = compile::CubinCache::key(ptx_hash, arch_, driver_version_);
    if (const auto cubin = cache.read(key)) {
      CUmodule m = nullptr;
      if (d_.cuModuleLoadData(&m, cubin->data()) == CUDA_SUCCESS) {
        compile::count_module_load(compile::ModuleLoad::cached_cubin);
        return m;
      }
      // Refused (built for another device or driver, or damaged past the seal): built again.
      cache.drop(key);
      compile::count_module_load(compile::ModuleLoad::dropped_cubin);
    }
    if (const auto cubin = link_cubin(ptx)) {
      CUmodule m = nullptr;
      if (d_.cuModuleLoadData(&m, cubin->data()) == CUDA_SUCCESS) {
        cache.store(key, *cubin);  // a failed write only costs a link next time
        compile::count_module_load(compile::ModuleLoad::built_cubin);
        return m;
      }
    }
  }
  // Without a CUBIN: the driver JIT-compiles the PTX, and its log explains a failure.
  std::vector<char> log(8192, '\0');
  CUjit_option opts[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void* vals[] = {log.data(), reinterpret_cast<void*>(log.size())};
  CUmodule m = nullptr;
  d_.check(d_.cuModuleLoadDataEx(&m, ptx.c_str(), 2, opts, vals), what + ": " + std::string(log.data()));
  compile::count_module_load(compile::ModuleLoad::ptx_jit);
  return m;
}

std::optional<std::string> Context::link_cubin(const std::string& ptx) const {
  // The linker targets the current context's device, at the JIT's default optimisation level.
  CUlinkState state = nullptr;
  if (d_.cuLinkCreate(0, nullptr, nullptr, &state) != CUDA_SUCCESS || !state) return std::nullopt;
  std::optional<std::string> cubin;
  void* image = nullptr;
  std::size_t size = 0;
  // The PTX is passed with its terminating NUL, as the driver reads it as a string.
  if (d_.cuLinkAddData(state, CU_JIT_INPUT_PTX, const_cast<char*>(ptx.c_str()), ptx.size() + 1, "kernel.ptx",
                       0, nullptr, nullptr) == CUDA_SUCCESS &&
      d_.cuLinkComplete(state, &image, &size) == CUDA_SUCCESS && image && size > 0)
    cubin.emplace(static_cast<const char*>(image), size);  // the image dies with the link state
  d_.cuLinkDestroy(state);
  return cubin;
}

void Context::launch(CUfunction f, Dim3 grid, Dim3 block, std::size_t shared_bytes, void** params,
                     const std::string& label) {
  if (shared_bytes > 48 * 1024)
    d_.check(d_.cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                   static_cast<int>(shared_bytes)),
             label + " raising the dynamic shared memory limit to " + std::to_string(shared_bytes));
  d_.check(d_.cuLaunchKernel(f, grid.x, grid.y, grid.z, block.x, block.y, block.z,
                             static_cast<unsigned>(shared_bytes), stream_, params, nullptr),
           util::cat(label, " cuLaunchKernel grid (", grid.x, ", ", grid.y, ", ", grid.z, ") block (",
                     block.x, ", ", block.y, ", ", block.z, ")"));
}

DeviceBuffer::DeviceBuffer(Context& ctx, std::size_t bytes)
    : ctx_(&ctx), ptr_(ctx.alloc(bytes)), bytes_(bytes) {}
DeviceBuffer::~DeviceBuffer() {
  if (ctx_) ctx_->free(ptr_);
}
DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : ctx_(o.ctx_), ptr_(o.ptr_), bytes_(o.bytes_) {
  o.ctx_ = nullptr;
  o.ptr_ = 0;
}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ctx_) ctx_->free(ptr_);
    ctx_ = o.ctx_;
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ctx_ = nullptr;
    o.ptr_ = 0;
  }
  return *this;
}

}  // namespace kg::cuda

#endif  // KG_HAVE_CUDA
