// ONNX tensors and files: reading a model or tensor file safely, TensorProto → kg::Tensor
// (raw_data, typed fields or external data), ONNX element types → kg::DType.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "kg/dtype.hpp"
#include "kg/tensor.hpp"
#include "onnx/onnx_pb.h"

namespace kg::onnx::detail {

// The bytes of a regular file (not a FIFO or device), at most `max_bytes`; errors name `what`.
std::string read_file(const std::string& path, std::uint64_t max_bytes, const std::string& what);

// The files external data is read from during one import, each opened once (regular files only,
// inside `base_dir` after symlinks are resolved, opened without blocking) and read by range.
class ExternalFiles {
 public:
  explicit ExternalFiles(std::string base_dir);
  ~ExternalFiles();
  ExternalFiles(const ExternalFiles&) = delete;
  ExternalFiles& operator=(const ExternalFiles&) = delete;
  const std::string& base_dir() const { return base_dir_; }
  // Reads `length` bytes at `offset` of `location` (relative to the base folder) into `out`.
  // `context` names the tensor in errors.
  void read(const std::string& location, std::uint64_t offset, std::uint64_t length, void* out,
            const std::string& context);

 private:
  struct File {
    int fd = -1;
    std::uint64_t size = 0;
    std::string path;
  };
  const File& open(const std::string& location, const std::string& context);
  std::string base_dir_;
  std::map<std::string, File> files_;
};

// Throws an error naming `who` and `what` when `bytes` exceed the memory this process can have
// (util::available_memory; KG_NO_MEMORY_CHECK=1 skips the check), before anything is allocated.
void check_memory(const std::string& who, std::uint64_t bytes, const std::string& what);

// The kg dtype of an ONNX TensorProto data type, or nullopt (string, complex, uint16/32/64).
std::optional<DType> dtype_of(int onnx_type);
// "FLOAT", "INT64", ... for messages.
std::string onnx_type_name(int onnx_type);

// The tensor a TensorProto holds. `context` names the file and the tensor in errors; external
// data is read relative to `base_dir`. Sizes are checked against the data before anything is
// allocated.
kg::Tensor to_tensor(const ::onnx::TensorProto& t, const std::string& context, ExternalFiles& external);

}  // namespace kg::onnx::detail
