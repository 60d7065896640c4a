#ifdef KG_HAVE_CUDA
#include "backend/cuda/driver.hpp"

#include <dlfcn.h>

#include <mutex>

#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::cuda {
namespace {

struct Loaded {
  Driver driver;
  bool ok = false;
  std::string reason;
};

Loaded load() {
  Loaded l;
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) lib = ::dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    l.reason = "no NVIDIA driver found (libcuda.so.1 could not be opened)";
    return l;
  }
  using GetProc = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
  auto get_proc = reinterpret_cast<GetProc>(::dlsym(lib, "cuGetProcAddress_v2"));
  if (!get_proc) {
    l.reason = "the NVIDIA driver is too old (no cuGetProcAddress_v2; CUDA 12 or newer is needed)";
    return l;
  }
  bool missing = false;
#define KG_RESOLVE(name)                                                                                 \
  {                                                                                                      \
    void* fn = nullptr;                                                                                  \
    CUdriverProcAddressQueryResult q{};                                                                  \
    if (get_proc(#name, &fn, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &q) != CUDA_SUCCESS || !fn) {    \
      l.reason =                                                                                         \
          std::string("the NVIDIA driver lacks ") + #name + " for CUDA " + std::to_string(CUDA_VERSION); \
      missing = true;                                                                                    \
    } else {                                                                                             \
      l.driver.name = reinterpret_cast<decltype(l.driver.name)>(fn);                                     \
    }                                                                                                    \
  }
  KG_CUDA_DRIVER_FUNCTIONS(KG_RESOLVE)
#undef KG_RESOLVE
  if (missing) return l;
  CUresult r = l.driver.cuInit(0);
  if (r != CUDA_SUCCESS) {
    const char* name = nullptr;
    l.driver.cuGetErrorName(r, &name);
    l.reason = util::cat("cuInit failed: ", name ? name : "unknown error", " (is a GPU visible?)");
    return l;
  }
  int count = 0;
  if (l.driver.cuDeviceGetCount(&count) != CUDA_SUCCESS || count == 0) {
    l.reason = "the NVIDIA driver reports no CUDA device";
    return l;
  }
  l.ok = true;
  return l;
}

const Loaded& loaded() {
  static const Loaded l = load();
  return l;
}

}  // namespace

const Driver* Driver::get() { return loaded().ok ? &loaded().driver : nullptr; }
const std::string& Driver::unavailable_reason() { return loaded().reason; }

const Driver& Driver::require() {
  if (const Driver* d = get()) return *d;
  throw Error("CUDA is not available: " + unavailable_reason());
}

void Driver::check(CUresult r, const std::string& what) const {
  if (r == CUDA_SUCCESS) return;
  const char* name = nullptr;
  const char* text = nullptr;
  cuGetErrorName(r, &name);
  cuGetErrorString(r, &text);
  std::string msg =
      util::cat(what, ": ", name ? name : "CUDA error", " (", text ? text : "no description", ")");
  // A kernel fault leaves the context unusable: every later call fails with the same code. Say so,
  // and where it was first seen, instead of blaming the later call.
  const bool sticky = r == CUDA_ERROR_ILLEGAL_ADDRESS || r == CUDA_ERROR_LAUNCH_FAILED ||
                      r == CUDA_ERROR_ILLEGAL_INSTRUCTION || r == CUDA_ERROR_MISALIGNED_ADDRESS ||
                      r == CUDA_ERROR_HARDWARE_STACK_ERROR || r == CUDA_ERROR_INVALID_PC ||
                      r == CUDA_ERROR_ASSERT;
  if (sticky) {
    if (first_fault_.empty()) {
      first_fault_ = what;
      msg +=
          "; a kernel faulted, and the CUDA context stays unusable for the rest of this process (run the "
          "model "
          "with LoadOptions::checked / --checked to find the op)";
    } else {
      msg += util::cat("; the CUDA context has been unusable since a kernel fault first seen at: ",
                       first_fault_);
    }
  }
  throw Error(msg);
}

}  // namespace kg::cuda

#endif  // KG_HAVE_CUDA
