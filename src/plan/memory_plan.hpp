// Activation memory planning: buffers whose lifetimes do not overlap share arena bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kg/dtype.hpp"

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
// Every size is computed with checked arithmetic: an arena past 2^64 bytes is a kg::Error.
Placement plan_buffers(const std::vector<BufferRequest>& requests, std::size_t alignment = 64);

// The bytes of a tensor of `shape` and `dtype`, computed with checked arithmetic: a product that
// does not fit in 63 bits (or a negative size) is a kg::Error naming `what` (the node), the shape
// and the dtype.
std::size_t checked_bytes(const std::vector<std::int64_t>& shape, DType dtype, const std::string& what);

// While one of these is alive on a thread, place_in_arena does not compare the plan's peak with
// the host memory the process can have: the arena it places is not allocated on the host (a dry
// run, a GPU's arena). Otherwise a peak over that memory is a kg::Error before any allocation
// (unless KG_NO_MEMORY_CHECK=1).
class ArenaNotOnHost {
 public:
  ArenaNotOnHost();
  ~ArenaNotOnHost();
  ArenaNotOnHost(const ArenaNotOnHost&) = delete;
  ArenaNotOnHost& operator=(const ArenaNotOnHost&) = delete;
  // True while one is alive on this thread.
  static bool active();
};

}  // namespace kg::plan
