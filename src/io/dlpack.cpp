#include "kg/dlpack.hpp"

#include <memory>
#include <vector>

#include "kg/error.hpp"
#include "kg/shape.hpp"
#include "util/str.hpp"

namespace kg::dlpack {
namespace {

std::string describe(const DLDataType& t) {
  return util::cat("code ", int(t.code), " bits ", int(t.bits), " lanes ", t.lanes);
}

DType dtype_of(const DLDataType& t) {
  if (t.lanes != 1) throw Error(util::cat("dlpack: vector types are not taken (", describe(t), ")"));
  switch (t.code) {
    case kDLFloat:
      if (t.bits == 16) return DType::F16;
      if (t.bits == 32) return DType::F32;
      if (t.bits == 64) return DType::F64;
      break;
    case kDLBfloat:
      if (t.bits == 16) return DType::BF16;
      break;
    case kDLInt:
      if (t.bits == 8) return DType::I8;
      if (t.bits == 16) return DType::I16;
      if (t.bits == 32) return DType::I32;
      if (t.bits == 64) return DType::I64;
      break;
    case kDLUInt:
      if (t.bits == 8) return DType::U8;
      break;
    case kDLBool:
      if (t.bits == 8) return DType::Bool;
      break;
    default:
      break;
  }
  throw Error(util::cat("dlpack: no kernelgraph dtype for ", describe(t)));
}

DLDataType code_of(DType t) {
  switch (t) {
    case DType::Bool:
      return {kDLBool, 8, 1};
    case DType::I8:
      return {kDLInt, 8, 1};
    case DType::I16:
      return {kDLInt, 16, 1};
    case DType::I32:
      return {kDLInt, 32, 1};
    case DType::I64:
      return {kDLInt, 64, 1};
    case DType::U8:
      return {kDLUInt, 8, 1};
    case DType::F16:
      return {kDLFloat, 16, 1};
    case DType::BF16:
      return {kDLBfloat, 16, 1};
    case DType::F32:
      return {kDLFloat, 32, 1};
    case DType::F64:
      return {kDLFloat, 64, 1};
  }
  throw Error("dlpack: unknown dtype");
}

const char* device_name(std::int32_t type) {
  switch (type) {
    case kDLCPU:
      return "cpu";
    case kDLCUDA:
      return "cuda";
    case kDLCUDAHost:
      return "cuda pinned host memory";
    case kDLCUDAManaged:
      return "cuda managed memory";
    default:
      return "another device type";
  }
}

// The shape and strides an exported tensor points at.
struct Owned {
  std::vector<std::int64_t> shape, strides;
};

}  // namespace

DeviceTensor import_tensor(const DLTensor& t, const Device& device) {
  if (t.ndim < 0) throw Error(util::cat("dlpack: a negative rank ", t.ndim));
  if (t.ndim > 0 && !t.shape) throw Error("dlpack: a tensor of rank >= 1 without a shape");
  const bool on_cpu = t.device.device_type == kDLCPU || t.device.device_type == kDLCUDAHost ||
                      t.device.device_type == kDLCUDAManaged;
  const bool ok = device.kind == Device::Kind::Cpu
                      ? on_cpu
                      : (t.device.device_type == kDLCUDA && t.device.device_id == device.index) ||
                            t.device.device_type == kDLCUDAManaged;
  if (!ok)
    throw Error(util::cat("dlpack: the tensor is on ", device_name(t.device.device_type),
                          " (DLPack device type ", t.device.device_type, ", id ", t.device.device_id,
                          ") but the model runs on ", device.to_string()));
  DeviceTensor out;
  out.dtype = dtype_of(t.dtype);
  out.shape.assign(t.shape, t.shape + t.ndim);
  for (std::int64_t d : out.shape)
    if (d < 0) throw Error(util::cat("dlpack: a negative size in shape ", sizes_to_string(out.shape)));
  if (t.strides) {
    std::int64_t expect = 1;
    for (std::int32_t i = t.ndim; i-- > 0;) {
      if (out.shape[static_cast<std::size_t>(i)] != 1 && t.strides[i] != expect)
        throw Error(util::cat("dlpack: tensor ", sizes_to_string(out.shape), " has stride ", t.strides[i],
                              " in dim ", i, " where a compact row-major one has ", expect,
                              "; make it contiguous first (e.g. .contiguous() in PyTorch)"));
      expect *= out.shape[static_cast<std::size_t>(i)];
    }
  }
  if (!t.data && numel_of(out.shape) > 0) throw Error("dlpack: a tensor with elements but no data address");
  out.ptr = static_cast<DevicePtr>(reinterpret_cast<std::uintptr_t>(t.data)) + t.byte_offset;
  return out;
}

DLManagedTensor* export_tensor(const DeviceTensor& t, const Device& device) {
  auto owned = std::make_unique<Owned>();
  owned->shape = t.shape;
  owned->strides.resize(t.shape.size());
  std::int64_t stride = 1;
  for (std::size_t i = t.shape.size(); i-- > 0;) {
    owned->strides[i] = stride;
    stride *= t.shape[i];
  }
  auto m = std::make_unique<DLManagedTensor>();
  m->dl_tensor.data = reinterpret_cast<void*>(static_cast<std::uintptr_t>(t.ptr));
  m->dl_tensor.device =
      device.kind == Device::Kind::Cpu ? DLDevice{kDLCPU, 0} : DLDevice{kDLCUDA, device.index};
  m->dl_tensor.ndim = static_cast<std::int32_t>(t.shape.size());
  m->dl_tensor.dtype = code_of(t.dtype);
  m->dl_tensor.shape = owned->shape.data();
  m->dl_tensor.strides = owned->strides.data();
  m->dl_tensor.byte_offset = 0;
  m->manager_ctx = owned.release();
  m->deleter = [](DLManagedTensor* self) {
    delete static_cast<Owned*>(self->manager_ctx);
    delete self;
  };
  return m.release();
}

}  // namespace kg::dlpack
