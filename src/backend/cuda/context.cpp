#ifdef KG_HAVE_CUDA
#include "backend/cuda/context.hpp"

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
  const std::string key = compile::content_hash(ptx);
  CUmodule& m = modules_[key];
  if (!m) {
    std::vector<char> log(8192, '\0');
    CUjit_option opts[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
    void* vals[] = {log.data(), reinterpret_cast<void*>(log.size())};
    CUresult r = d_.cuModuleLoadDataEx(&m, ptx.c_str(), 2, opts, vals);
    if (r != CUDA_SUCCESS) {
      m = nullptr;
      modules_.erase(key);
      d_.check(r, label + " loading the module for '" + entry + "': " + std::string(log.data()));
    }
  }
  CUfunction f = nullptr;
  d_.check(d_.cuModuleGetFunction(&f, m, entry.c_str()), label + " cuModuleGetFunction('" + entry + "')");
  return f;
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
