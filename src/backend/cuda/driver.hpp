// The CUDA driver API, opened with dlopen at first use so that one binary runs with or without
// a GPU. Types come from the toolkit's cuda.h; no symbol of libcuda is linked.
#pragma once

#include <cuda.h>

#include <string>

namespace kg::cuda {

#define KG_CUDA_DRIVER_FUNCTIONS(X)                                                                     \
  X(cuInit)                                                                                             \
  X(cuDriverGetVersion) X(cuDeviceGet) X(cuDeviceGetCount) X(cuDeviceGetName) X(cuDeviceGetAttribute)   \
      X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) X(cuCtxSetCurrent) X(cuCtxSynchronize)   \
          X(cuModuleLoadDataEx) X(cuModuleUnload) X(cuModuleGetFunction) X(cuFuncSetAttribute)          \
              X(cuFuncGetAttribute) X(cuLaunchKernel) X(cuMemAlloc) X(cuMemFree) X(cuMemcpyHtoD)        \
                  X(cuMemcpyDtoH) X(cuMemcpyHtoDAsync) X(cuMemcpyDtoHAsync) X(cuMemcpyDtoDAsync)        \
                      X(cuMemsetD8Async) X(cuMemGetInfo) X(cuStreamCreate) X(cuStreamDestroy)           \
                          X(cuStreamSynchronize) X(cuStreamBeginCapture) X(cuStreamEndCapture)          \
                              X(cuGraphInstantiateWithFlags) X(cuGraphLaunch) X(cuGraphExecDestroy)     \
                                  X(cuGraphDestroy) X(cuEventCreate) X(cuEventDestroy) X(cuEventRecord) X(cuEventRecordWithFlags) \
                                      X(cuEventSynchronize) X(cuEventElapsedTime) X(cuGetErrorName)     \
                                          X(cuGetErrorString)                                           \
                                              X(cuModuleLoadData) X(cuLinkCreate) X(cuLinkAddData)      \
                                                  X(cuLinkComplete) X(cuLinkDestroy) X(cuCtxGetCurrent) \
                                                      X(cuStreamWaitEvent)

// Function pointers of the driver API, resolved through cuGetProcAddress for the ABI of the
// cuda.h this was compiled with.
struct Driver {
#define KG_DECLARE(name) decltype(&::name) name = nullptr;
  KG_CUDA_DRIVER_FUNCTIONS(KG_DECLARE)
#undef KG_DECLARE

  // The loaded driver, or nullptr when none is usable (no libcuda, no device, init failed).
  static const Driver* get();
  // Why get() returned nullptr ("" when it did not).
  static const std::string& unavailable_reason();
  // Throws kg::Error when get() is null, with the reason.
  static const Driver& require();

  // Throws kg::Error "<what>: CUDA_ERROR_X (text)" unless r is CUDA_SUCCESS.
  // After a kernel fault every later message also says where the fault was first seen.
  void check(CUresult r, const std::string& what) const;
  // Where a kernel fault was first seen ("" while none was): from then on the context is
  // unusable, for the rest of the process.
  const std::string& first_fault() const { return first_fault_; }

 private:
  mutable std::string first_fault_;
};

}  // namespace kg::cuda
