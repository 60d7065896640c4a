// cuDNN's functions as the runtime opened them, shared by the legacy convolution API's plans
// (cudnn.cpp) and the graph API's fused ones (cudnn_graph.cpp). Internal to backend/cuda.
#pragma once

#ifdef KG_HAVE_CUDA
#include <cudnn.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "backend/cuda/driver.hpp"
#include "backend/cuda/vendor.hpp"

namespace kg::cuda {

#define KG_CUDNN_FUNCTIONS(X)                           \
  X(cudnnGetVersion)                                    \
  X(cudnnGetErrorString)                                \
  X(cudnnCreate)                                        \
  X(cudnnSetStream)                                     \
  X(cudnnCreateTensorDescriptor)                        \
  X(cudnnSetTensor4dDescriptor)                         \
  X(cudnnDestroyTensorDescriptor)                       \
  X(cudnnCreateFilterDescriptor)                        \
  X(cudnnSetFilter4dDescriptor)                         \
  X(cudnnDestroyFilterDescriptor)                       \
  X(cudnnCreateConvolutionDescriptor)                   \
  X(cudnnSetConvolution2dDescriptor)                    \
  X(cudnnSetConvolutionGroupCount)                      \
  X(cudnnSetConvolutionMathType)                        \
  X(cudnnDestroyConvolutionDescriptor)                  \
  X(cudnnGetConvolution2dForwardOutputDim)              \
  X(cudnnGetConvolutionForwardAlgorithmMaxCount)        \
  X(cudnnGetConvolutionForwardAlgorithm_v7)             \
  X(cudnnFindConvolutionForwardAlgorithmEx)             \
  X(cudnnGetConvolutionForwardWorkspaceSize)            \
  X(cudnnConvolutionForward)                            \
  X(cudnnAddTensor)                                     \
  X(cudnnGetConvolutionBackwardDataAlgorithmMaxCount)   \
  X(cudnnGetConvolutionBackwardDataAlgorithm_v7)        \
  X(cudnnFindConvolutionBackwardDataAlgorithmEx)        \
  X(cudnnGetConvolutionBackwardDataWorkspaceSize)       \
  X(cudnnConvolutionBackwardData)                       \
  X(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount) \
  X(cudnnGetConvolutionBackwardFilterAlgorithm_v7)      \
  X(cudnnFindConvolutionBackwardFilterAlgorithmEx)      \
  X(cudnnGetConvolutionBackwardFilterWorkspaceSize)     \
  X(cudnnConvolutionBackwardFilter)                     \
  X(cudnnBackendCreateDescriptor)                       \
  X(cudnnBackendDestroyDescriptor)                      \
  X(cudnnBackendSetAttribute)                           \
  X(cudnnBackendGetAttribute)                           \
  X(cudnnBackendFinalize)                               \
  X(cudnnBackendExecute)

// Function pointers of cuDNN, typed by the toolkit's cudnn.h.
struct DnnApi {
#define KG_DECLARE(name) decltype(&::name) name = nullptr;
  KG_CUDNN_FUNCTIONS(KG_DECLARE)
#undef KG_DECLARE
};

// A cuDNN handle of one context; `mu` keeps cudnnSetStream and the calls after it together.
struct DnnHandle {
  cudnnHandle_t h = nullptr;
  std::mutex mu;
};

// A choice kept in the tuning cache: `prefix` then a number of 1 to 3 digits (a legacy algorithm,
// "3"; a position in the graph API's heuristic list, "graph 3"); nullopt for anything else.
std::optional<int> parse_kept_number(const std::optional<std::string>& text, std::string_view prefix = {});

// Throws "<label> cuDNN <fn>: <status> (status <n>)" unless s is success.
void dnn_check(const DnnApi& f, cudnnStatus_t s, const std::string& label, const char* fn);

// A forward convolution with its fusable epilogue (Conv2dCall::fusable: shift, residual, ReLU)
// as one operation graph of cuDNN's graph API: the first engine configuration of the library's
// heuristic that builds within the workspace limit, or with `o.tune` the fastest of the first
// few, timed on the call's own buffers (kept in the tuning cache). Null, with `why` set, when the
// call is not one it takes (not f16/bf16, no fusable epilogue) or no engine builds: the caller
// then plans the plain convolution.
std::unique_ptr<VendorPlan> plan_fused_forward(const Driver& d, const DnnApi& f, DnnHandle& h, const Conv2dCall& c,
                                               const VendorOptions& o, CUstream stream, const std::string& label,
                                               std::string& why);

}  // namespace kg::cuda

#endif  // KG_HAVE_CUDA
