// libFuzzer's entry point for kg::fuzz::fuzz_onnx_convert (fuzz/onnx_convert_target.hpp); built by KG_BUILD_FUZZ.
#include <cstddef>
#include <cstdint>

#include "targets.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return kg::fuzz::fuzz_onnx_convert(data, size);
}
