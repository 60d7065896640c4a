// DLPack, the tensor-exchange ABI of PyTorch, CuPy, JAX and others: inputs for
// LoadedModel::forward_device from another framework's tensors, and the outputs handed back,
// without a copy. The structs below are DLPack's own C layout (DLManagedTensor, the unversioned
// form every producer supports), declared in this namespace so that no dlpack.h is needed; a
// program that has one converts pointers with reinterpret_cast.
#pragma once

#include <cstdint>

#include "kg/model.hpp"
#include "kg/runtime_op.hpp"

namespace kg::dlpack {

// DLDeviceType values used here: the host, a CUDA device, pinned host memory, managed memory.
enum : std::int32_t { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13 };
// DLDataTypeCode values.
enum : std::uint8_t { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLBool = 6 };

struct DLDevice {
  std::int32_t device_type;
  std::int32_t device_id;
};
struct DLDataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // in elements; null: compact row-major
  std::uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

// A view of `t` as a DeviceTensor for a model loaded on `device`: the tensor must live there (a
// CUDA tensor on that GPU; host, pinned or managed memory for the cpu), be compact row-major
// (strides null or those of its shape; size-1 dims may have any stride) and have a dtype
// kernelgraph has (one lane). Anything else is a kg::Error saying what differs. The producer keeps
// ownership: call its deleter when the tensor is no longer needed.
DeviceTensor import_tensor(const DLTensor& t, const Device& device);

// A DLPack description of `t` on `device` (for a consumer that takes DLManagedTensor). It does not
// own the memory: for forward_device's outputs it is valid until the model's next run. Its deleter
// frees the description only.
DLManagedTensor* export_tensor(const DeviceTensor& t, const Device& device);

}  // namespace kg::dlpack
