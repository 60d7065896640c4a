// ONNX tensors and files: reading a model or tensor file safely, TensorProto → kg::Tensor
// (raw_data, typed fields or external data), ONNX element types → kg::DType.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kg/dtype.hpp"
#include "kg/tensor.hpp"
#include "onnx/onnx_pb.h"

namespace kg::onnx::detail {

// The bytes of a regular file (not a FIFO or device), at most `max_bytes`; errors name `what`.
std::string read_file(const std::string& path, std::uint64_t max_bytes, const std::string& what);

// The kg dtype of an ONNX TensorProto data type, or nullopt (string, complex, uint16/32/64).
std::optional<DType> dtype_of(int onnx_type);
// "FLOAT", "INT64", ... for messages.
std::string onnx_type_name(int onnx_type);

// The tensor a TensorProto holds. `context` names the file and the tensor in errors; external
// data is read relative to `base_dir`. Sizes are checked against the data before anything is
// allocated.
kg::Tensor to_tensor(const ::onnx::TensorProto& t, const std::string& context, const std::string& base_dir);

}  // namespace kg::onnx::detail
