// Activation memory planning: buffers whose lifetimes do not overlap share arena bytes.
#pragma once

#include <cstddef>
#include <vector>

namespace kg::plan {

// One buffer to place: its size and the step range [first, last] in which it is live.
struct BufferRequest {
  std::size_t bytes = 0;
  int first = 0;
  int last = 0;
};

struct Placement {
  std::vector<std::size_t> offsets;  // one per request
  std::size_t arena_bytes = 0;
  std::size_t unshared_bytes = 0;
};

// Places each buffer at an offset (aligned to `alignment`) so that buffers live at the same
// step never overlap. Largest buffers first, each at the lowest offset that fits.
Placement plan_buffers(const std::vector<BufferRequest>& requests, std::size_t alignment = 64);

}  // namespace kg::plan
