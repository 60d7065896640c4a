// NVRTC, opened with dlopen at first use so that the library never links libnvrtc: without it,
// everything but compiling kernels for a GPU keeps working. Types come from the toolkit's nvrtc.h.
#pragma once

#ifdef KG_HAVE_NVRTC
#include <nvrtc.h>

#include <string>

namespace kg::compile {

// clang-format off
#define KG_NVRTC_FUNCTIONS(X)                                                                     \
  X(nvrtcVersion) X(nvrtcGetErrorString) X(nvrtcCreateProgram) X(nvrtcDestroyProgram)             \
  X(nvrtcCompileProgram) X(nvrtcGetProgramLogSize) X(nvrtcGetProgramLog) X(nvrtcGetPTXSize)       \
  X(nvrtcGetPTX) X(nvrtcGetNumSupportedArchs) X(nvrtcGetSupportedArchs)
// clang-format on

// The functions of libnvrtc that kernelgraph calls, resolved with dlsym.
struct Nvrtc {
#define KG_DECLARE(name) decltype(&::name) name = nullptr;
  KG_NVRTC_FUNCTIONS(KG_DECLARE)
#undef KG_DECLARE

  std::string path;          // the file that was opened
  int major = 0, minor = 0;  // its version

  // The library, loaded on the first call; nullptr when it cannot be opened. Where it looks, in
  // order: $KG_NVRTC_LIBRARY (only there when set); libnvrtc.so.<major>, libnvrtc.so on the
  // loader's search path; lib64/ and lib/ of $CUDA_PATH and $CUDA_HOME; the folder found when
  // the library was configured; /usr/local/cuda/lib64.
  static const Nvrtc* get();
  // Why get() returned nullptr: where it looked and what failed ("" when it did not).
  static const std::string& unavailable_reason();
  // get(), or kg::Error "[what] NVRTC could not be loaded: <reason>".
  static const Nvrtc& require(const std::string& what);
};

}  // namespace kg::compile

#endif  // KG_HAVE_NVRTC
