// libFuzzer's entry point for kg::fuzz::fuzz_rendezvous (fuzz/cache_targets.hpp); built by KG_BUILD_FUZZ.
#include <cstddef>
#include <cstdint>

#include "targets.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return kg::fuzz::fuzz_rendezvous(data, size);
}
