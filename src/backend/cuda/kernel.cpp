// The by-hand path of include/kg/cuda.hpp: kernels compiled through the shared compiler,
// checked like the graph path's launches, and launched on the device's stream.
#include <algorithm>
#include <optional>

#include "compile/compiler.hpp"
#include "compile/ptx.hpp"
#include "kg/cuda.hpp"
#include "kg/error.hpp"
#include "lower/launch_check.hpp"
#include "util/str.hpp"

#ifdef KG_HAVE_CUDA
#include "backend/cuda/context.hpp"
#endif
#ifdef KG_HAVE_NVRTC
#include "compile/nvrtc_loader.hpp"
#endif

namespace kg::cuda {
namespace {

#ifdef KG_HAVE_CUDA
Context& context(int device) { return Context::get(device); }
#else
[[noreturn]] void no_cuda() { throw Error("CUDA is not available: " + unavailable_reason()); }
#endif

std::string dim3_text(Dim3 d) { return util::cat("(", d.x, ", ", d.y, ", ", d.z, ")"); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Devices and compilation

std::string unavailable_reason() {
#ifdef KG_HAVE_CUDA
  return available() ? std::string() : Driver::unavailable_reason();
#else
  return "this build has no CUDA path (configured without the CUDA toolkit)";
#endif
}

int device_count() {
#ifdef KG_HAVE_CUDA
  const Driver* d = Driver::get();
  if (!d) return 0;
  int count = 0;
  if (d->cuDeviceGetCount(&count) != CUDA_SUCCESS) return 0;
  return count;
#else
  return 0;
#endif
}

std::string device_name(int device) {
#ifdef KG_HAVE_CUDA
  return context(device).name();
#else
  (void)device;
  no_cuda();
#endif
}

int device_arch(int device) {
#ifdef KG_HAVE_CUDA
  return context(device).arch();
#else
  (void)device;
  no_cuda();
#endif
}

void synchronize(int device) {
#ifdef KG_HAVE_CUDA
  context(device).synchronize();
#else
  (void)device;
  no_cuda();
#endif
}

std::string first_fault() {
#ifdef KG_HAVE_CUDA
  const Driver* d = Driver::get();
  return d ? d->first_fault() : std::string();
#else
  return {};
#endif
}

std::vector<int> compile_archs() {
  std::vector<int> archs;
#ifdef KG_HAVE_NVRTC
  int n = 0;
  if (const compile::Nvrtc* nv = compile::Nvrtc::get();
      nv && nv->nvrtcGetNumSupportedArchs(&n) == NVRTC_SUCCESS && n > 0) {
    archs.resize(static_cast<std::size_t>(n));
    if (nv->nvrtcGetSupportedArchs(archs.data()) != NVRTC_SUCCESS) archs.clear();
  }
#endif
  return archs;
}

std::string compile_ptx(const std::string& name, const std::string& source, int arch) {
  if (arch <= 0)
    throw Error(util::cat("[", name, "] compile_ptx: arch must be a compute capability like 90, got ", arch));
  return compile::Compiler::global().compile(name, source, arch).ptx;
}

// ---------------------------------------------------------------------------------------------
// DeviceTensorBuffer

struct DeviceTensorBuffer::Impl {
  int device = 0;
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
  std::size_t nbytes = 0;
#ifdef KG_HAVE_CUDA
  Context* ctx = nullptr;
  DeviceBuffer buffer;
#endif
};

DeviceTensorBuffer::DeviceTensorBuffer() = default;
DeviceTensorBuffer::~DeviceTensorBuffer() = default;
DeviceTensorBuffer::DeviceTensorBuffer(DeviceTensorBuffer&&) noexcept = default;
DeviceTensorBuffer& DeviceTensorBuffer::operator=(DeviceTensorBuffer&&) noexcept = default;

DeviceTensorBuffer::DeviceTensorBuffer(DType dtype, std::vector<std::int64_t> shape, int device) {
  for (std::int64_t d : shape)
    if (d < 0) throw Error("DeviceTensorBuffer: negative size in " + sizes_to_string(shape));
#ifdef KG_HAVE_CUDA
  auto impl = std::make_unique<Impl>();
  impl->device = device;
  impl->dtype = dtype;
  impl->nbytes = static_cast<std::size_t>(numel_of(shape)) * dtype_size(dtype);
  impl->shape = std::move(shape);
  impl->ctx = &context(device);
  impl->buffer = DeviceBuffer(*impl->ctx, impl->nbytes);
  impl_ = std::move(impl);
#else
  (void)dtype;
  (void)device;
  no_cuda();
#endif
}

DeviceTensorBuffer DeviceTensorBuffer::from(const Tensor& t, int device) {
  DeviceTensorBuffer b(t.dtype(), t.shape(), device);
  b.upload(t);
  return b;
}

void DeviceTensorBuffer::upload(const Tensor& t) {
  if (!impl_)
    throw Error("DeviceTensorBuffer::upload: the buffer is empty (default-constructed or moved from)");
  if (t.dtype() != impl_->dtype || t.shape() != impl_->shape)
    throw Error(util::cat("DeviceTensorBuffer::upload: the tensor is ", dtype_name(t.dtype()), " ",
                          sizes_to_string(t.shape()), " but the buffer holds ", dtype_name(impl_->dtype), " ",
                          sizes_to_string(impl_->shape)));
#ifdef KG_HAVE_CUDA
  // On the stream, so that the copy is ordered with launches; then wait, so that `t` may go.
  impl_->ctx->make_current();
  impl_->ctx->upload_async(impl_->buffer.ptr(), t.raw(), impl_->nbytes);
  impl_->ctx->synchronize();
#endif
}

Tensor DeviceTensorBuffer::download() const {
  if (!impl_)
    throw Error("DeviceTensorBuffer::download: the buffer is empty (default-constructed or moved from)");
  Tensor t = Tensor::empty(impl_->dtype, impl_->shape);
#ifdef KG_HAVE_CUDA
  impl_->ctx->make_current();
  impl_->ctx->download_async(t.raw(), impl_->buffer.ptr(), impl_->nbytes);
  impl_->ctx->synchronize();
#endif
  return t;
}

void DeviceTensorBuffer::fill_bytes(unsigned char value) {
  if (!impl_)
    throw Error("DeviceTensorBuffer::fill_bytes: the buffer is empty (default-constructed or moved from)");
#ifdef KG_HAVE_CUDA
  impl_->ctx->make_current();
  impl_->ctx->fill_bytes_async(impl_->buffer.ptr(), value, impl_->nbytes);
#else
  (void)value;
#endif
}

DevicePtr DeviceTensorBuffer::ptr() const {
#ifdef KG_HAVE_CUDA
  if (impl_) return impl_->buffer.ptr();
#endif
  return 0;
}

DeviceTensor DeviceTensorBuffer::tensor() const {
  if (!impl_) return {};
  return {ptr(), impl_->shape, impl_->dtype};
}

DType DeviceTensorBuffer::dtype() const { return impl_ ? impl_->dtype : DType::F32; }

const std::vector<std::int64_t>& DeviceTensorBuffer::shape() const {
  static const std::vector<std::int64_t> none;
  return impl_ ? impl_->shape : none;
}

std::size_t DeviceTensorBuffer::nbytes() const { return impl_ ? impl_->nbytes : 0; }
int DeviceTensorBuffer::device() const { return impl_ ? impl_->device : -1; }

// ---------------------------------------------------------------------------------------------
// Kernel

struct Kernel::Impl {
  std::string name, label, ptx;
  compile::PtxEntry entry;
  std::vector<std::string> param_names;
  std::optional<compile::KernelSignature> signature;  // from the source, when it has the entry
  int arch = 0;
  int device = -1;  // -1: compiled for an arch only
  bool from_disk = false;
#ifdef KG_HAVE_CUDA
  CUfunction fn = nullptr;
  Context* ctx = nullptr;
#endif
};

namespace {

std::shared_ptr<Kernel::Impl> build_kernel(const std::string& name, const std::string& source,
                                           const std::string& entry, int arch) {
  auto k = std::make_shared<Kernel::Impl>();
  k->name = name;
  k->label = "[" + name + "]";
  if (entry.empty())
    throw Error(k->label +
                " Kernel::compile needs the kernel's entry point (the name of its extern \"C\" "
                "__global__ function)");
  if (arch <= 0) throw Error(util::cat(k->label, " arch must be a compute capability like 90, got ", arch));
  const compile::CompileResult r = compile::Compiler::global().compile(name, source, arch);
  k->ptx = r.ptx;
  k->from_disk = r.from_disk;
  k->arch = arch;
  const auto entries = compile::parse_ptx_entries(r.ptx);
  k->entry = lower::resolve_entry(entries, entry, k->label);
  k->param_names = compile::kernel_param_names(source, entry);
  for (const auto& sig : lower::source_kernels(source))
    if (sig.name == entry) k->signature = sig;
  return k;
}

// The graph path's launch checks: grid, block against the PTX directives, packed arguments.
void check_launch(const Kernel::Impl& k, Dim3 grid, Dim3 block, const lower::ArgPack& args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0)
    throw Error(util::cat(k.label, " grid ", dim3_text(grid), " has a zero dimension; nothing would run"));
  if (grid.x > 0x7fffffffu || grid.y > 65535u || grid.z > 65535u)
    throw Error(util::cat(k.label, " grid ", dim3_text(grid),
                          " is over the limits (x up to 2147483647, y and z up to 65535)"));
  lower::check_block(k.entry, block, k.label);
  lower::check_args(k.entry, args, k.param_names, k.label);
  // What the PTX cannot tell apart (a pointer and a 64-bit integer, an int and a float of one
  // width), the C++ signature can.
  if (k.signature) {
    Launch l;
    l.grid = grid;
    l.block = block;
    l.args = args;
    lower::check_launch(*k.signature, l, k.label, 0, "");
  }
}

const Kernel::Impl& need(const std::shared_ptr<const Kernel::Impl>& k) {
  if (!k) throw Error("kg::cuda::Kernel: this kernel is empty (default-constructed); use Kernel::compile");
  return *k;
}

}  // namespace

Kernel Kernel::compile(const std::string& name, const std::string& source, const std::string& entry,
                       int device) {
#ifdef KG_HAVE_CUDA
  Context& ctx = context(device);
  auto k = build_kernel(name, source, entry, ctx.arch());
  k->device = device;
  k->ctx = &ctx;
  k->fn = ctx.function(k->ptx, k->entry.name, k->label);
  Kernel kernel;
  kernel.impl_ = std::move(k);
  return kernel;
#else
  (void)name;
  (void)source;
  (void)entry;
  (void)device;
  no_cuda();
#endif
}

Kernel Kernel::compile_for_arch(const std::string& name, const std::string& source, const std::string& entry,
                                int arch) {
  Kernel kernel;
  kernel.impl_ = build_kernel(name, source, entry, arch);
  return kernel;
}

void Kernel::check(Dim3 grid, Dim3 block, const std::function<void(ArgVisitor&)>& pack) const {
  lower::ArgPack args;
  if (pack) pack(args);
  check_launch(need(impl_), grid, block, args);
}

void Kernel::launch(Dim3 grid, Dim3 block, const std::function<void(ArgVisitor&)>& pack,
                    std::size_t shared_bytes) const {
  if (need(impl_).device < 0)
    throw Error(util::cat(impl_->label, " was compiled for sm_", impl_->arch,
                          " without a device (Kernel::compile_for_arch); use Kernel::compile to launch it"));
#ifdef KG_HAVE_CUDA
  lower::ArgPack args;
  if (pack) pack(args);
  check_launch(*impl_, grid, block, args);
  std::vector<void*> params = args.kernel_params();
  impl_->ctx->make_current();
  impl_->ctx->launch(impl_->fn, grid, block, shared_bytes, params.data(), impl_->label);
#else
  (void)grid;
  (void)block;
  (void)pack;
  (void)shared_bytes;
  no_cuda();
#endif
}

const std::string& Kernel::name() const { return need(impl_).name; }
const std::string& Kernel::entry() const { return need(impl_).entry.name; }
const std::string& Kernel::ptx() const { return need(impl_).ptx; }
int Kernel::arch() const { return need(impl_).arch; }
const std::vector<std::string>& Kernel::param_names() const { return need(impl_).param_names; }
bool Kernel::from_disk_cache() const { return need(impl_).from_disk; }

}  // namespace kg::cuda
