// Checked mode's test for output elements a launch did not write, shared by the cpu and cuda
// backends: the output is filled with a poison byte before the launch, and an element whose bytes
// all still hold it afterwards is a suspect. A kernel may write that very value (a u8 or bool
// output can hold 0xA5 = 165, an i8 one -91), so a suspect is not reported yet: the launch runs
// again over a second poison byte, and only an element that kept the first poison after the
// first run and the second after the second run was not written. A written element holds the
// kernel's value both times, which cannot equal two different poisons.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "kg/dtype.hpp"

namespace kg::backend {

// The first fill: 0xFF bytes for floats (a NaN no arithmetic produces), 0xA5 for integers.
unsigned char poison_byte(DType dtype);
// The second fill, different from both first ones.
constexpr unsigned char kSecondPoison = 0x5A;

// The first element at or after `from` of `numel` elements of `elem_bytes` bytes whose bytes
// all equal `byte`, or -1.
std::int64_t first_filled_with(const unsigned char* data, std::int64_t numel, std::size_t elem_bytes,
                               unsigned char byte, std::int64_t from = 0);

// One output of a checked launch, as it is after the first run (filled with poison_byte(dtype)
// before it).
struct CheckedOutput {
  const unsigned char* bytes = nullptr;
  std::int64_t numel = 0;
  DType dtype = DType::U8;
};
struct Unwritten {
  std::size_t output = 0;   // index in the list given
  std::int64_t element = 0;  // the first unwritten element of that output
};
// The first element of the first output that the launch did not write, or empty. Only when some
// output has a suspect is `rerun` called: it fills every output with `byte`, runs the launch
// again and returns the outputs' bytes after it, in the same order (the bytes of the first run
// are copied before it is called, so it may reuse their memory).
std::optional<Unwritten> find_unwritten(
    const std::vector<CheckedOutput>& after_first,
    const std::function<std::vector<const unsigned char*>(unsigned char byte)>& rerun);

}  // namespace kg::backend
