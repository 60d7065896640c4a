// Activation memory planning: buffers whose lifetimes do not overlap share arena bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
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

// What a loaded model allocates on a GPU, by part, in bytes.
struct DeviceMemoryNeed {
  std::uint64_t activations = 0;  // the arena (with checked mode's guard bytes)
  std::uint64_t parameters = 0;
  std::uint64_t inputs = 0;       // the device copies of the model's inputs
  std::uint64_t gradients = 0;    // parameter gradients (training)
};

// The check of a plan against a GPU's free memory (cuMemGetInfo's free and total bytes), before
// anything is allocated: empty when `need` fits in `free_bytes`, otherwise the one-line text of
// the error, which names `inputs` (the model's input shapes, as describe_inputs writes them), the
// device, every byte count and KG_NO_MEMORY_CHECK=1.
std::optional<std::string> device_memory_shortfall(const DeviceMemoryNeed& need, std::uint64_t free_bytes,
                                                   std::uint64_t total_bytes, const std::string& device,
                                                   const std::string& inputs);

}  // namespace kg::plan
