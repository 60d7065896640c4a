// How much memory this process can have, for checking a memory plan before allocating it: the
// smallest of MemAvailable (/proc/meminfo), the cgroup limit (v2 memory.max, v1
// memory.limit_in_bytes) and RLIMIT_AS / RLIMIT_DATA, where each is known and set.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace kg::util {

// The bytes the process can still allocate, and which limit gave that figure ("MemAvailable in
// /proc/meminfo", "cgroup memory.max", "RLIMIT_AS", ...). Empty when nothing is known.
struct MemoryLimit {
  std::uint64_t bytes = 0;
  std::string source;
};
std::optional<MemoryLimit> available_memory();

// Tests only: makes available_memory() report `bytes` ("test hook"), or the real figure again
// when empty.
void set_available_memory_for_testing(std::optional<std::uint64_t> bytes);

// True when KG_NO_MEMORY_CHECK is set to anything but "" or "0": memory plans are not compared
// with the available memory.
bool memory_check_disabled();

// a × b and a + b, or empty when the result does not fit in 64 bits.
std::optional<std::uint64_t> checked_mul(std::uint64_t a, std::uint64_t b);
std::optional<std::uint64_t> checked_add(std::uint64_t a, std::uint64_t b);

}  // namespace kg::util
