// The CUDA execution model on the CPU: the blocks of a grid spread over the thread pool, the
// threads of a block run as fibers of one OS thread, round-robin between barriers in a fixed,
// configurable order. __syncthreads is a real barrier, warp shuffles and votes wait for every lane
// their mask names and check the masks; faults (SIGSEGV, SIGBUS, SIGFPE) inside a kernel are
// caught and reported with the thread that faulted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "backend/emu/emu_abi.hpp"
#include "kg/runtime_op.hpp"
#include "util/thread_pool.hpp"

namespace kg::emu {

struct KernelEntry;

// The order in which the runnable threads of a block run between two barriers.
enum class Order { Forward, Reverse };

struct GridLaunch {
  const KernelEntry* kernel = nullptr;
  Dim3 grid, block;
  std::size_t shared = 0;  // dynamic shared memory per block
  void** args = nullptr;   // one pointer per kernel parameter, to its bytes
  Order order = Order::Forward;
  // Checked: the dynamic shared memory lies against a guard page and is filled with 0xFF bytes
  // before each block, and atomics report their addresses to `note_atomic`.
  bool checked = false;
  std::string label;  // "[op @ node]", the prefix of errors
  // Words for a faulting address the caller knows (a guard page of an argument buffer), or "".
  // `access` is "read", "write" or "access" (when the hardware does not say).
  std::function<std::string(std::uintptr_t address, const std::string& access)> describe_fault;
  // Words for where an address lies ("byte offset 4 of x (float*; buffer x, 64 bytes)"), for a
  // misaligned access; "" when the caller does not know it.
  std::function<std::string(std::uintptr_t address)> describe_address;
  std::function<void(const void* address)> note_atomic;
  // The pool the blocks run on: the model's (LoadOptions::threads); null: the process-wide one.
  util::ThreadPool* pool = nullptr;
};

// Runs every block of the grid. Throws kg::Error, prefixed by the label and naming the kernel
// and the thread, for the first failure: a fault, a misaligned access, a wrong warp mask, a
// deadlock, __trap().
void run_grid(const GridLaunch& launch);

// The function table given to every module (kg_emu_bind).
const KgEmuApi* runtime_api();

// A buffer whose bytes end against a no-access page (and begin one page after another), so that
// an access past either end faults at once; the few bytes between the data and the pages, kept
// for 16-byte alignment, hold a canary pattern that check_canaries() verifies.
class GuardedRegion {
 public:
  explicit GuardedRegion(std::size_t bytes);
  ~GuardedRegion();
  GuardedRegion(const GuardedRegion&) = delete;
  GuardedRegion& operator=(const GuardedRegion&) = delete;

  unsigned char* data() const { return data_; }
  std::size_t size() const { return bytes_; }
  // The offset from data() of an address inside either guard page.
  std::optional<std::ptrdiff_t> guard_offset(std::uintptr_t address) const;
  // The offset from data() of the first canary byte that changed, if any.
  std::optional<std::ptrdiff_t> check_canaries() const;
  void reset_canaries();

 private:
  unsigned char* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  unsigned char* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Lane sets as text: "0-15, 17".
std::string lanes_text(unsigned mask);

}  // namespace kg::emu
