// Tensor files: safetensors read (memory-mapped) and write.
#pragma once

#include <map>
#include <string>

#include "kg/tensor.hpp"

namespace kg {

// Tensors of a safetensors file by name. The file is memory-mapped and the tensors keep the
// mapping alive. A truncated or malformed file is a kg::Error naming the file and the problem.
std::map<std::string, Tensor> read_safetensors(const std::string& path);
// Also returns the "__metadata__" string map.
std::map<std::string, Tensor> read_safetensors(const std::string& path,
                                               std::map<std::string, std::string>* metadata);
// Writes tensors (sorted by name) with optional metadata; replaces the file atomically.
void write_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace kg
