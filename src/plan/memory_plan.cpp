#include "plan/memory_plan.hpp"

#include <algorithm>
#include <limits>
#include <numeric>

#include "kg/error.hpp"
#include "kg/shape.hpp"
#include "util/memory.hpp"
#include "util/str.hpp"

namespace kg::plan {

namespace {
thread_local int t_not_on_host = 0;
}  // namespace

ArenaNotOnHost::ArenaNotOnHost() { ++t_not_on_host; }
ArenaNotOnHost::~ArenaNotOnHost() { --t_not_on_host; }
bool ArenaNotOnHost::active() { return t_not_on_host > 0; }

std::size_t checked_bytes(const std::vector<std::int64_t>& shape, DType dtype, const std::string& what) {
  auto fail = [&](const std::string& why) {
    return Error(util::cat(what, " ", sizes_to_string(shape), " ", dtype_name(dtype), ": ", why));
  };
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  std::int64_t n = 1;
  for (std::int64_t s : shape) {
    if (s < 0) throw fail(util::cat("a dimension of size ", s, " (expected 0 or more)"));
    if (__builtin_mul_overflow(n, s, &n))
      throw fail(util::cat("the element count overflows 64 bits (the limit is ", kMax, ")"));
  }
  std::int64_t bytes = 0;
  if (__builtin_mul_overflow(n, static_cast<std::int64_t>(dtype_size(dtype)), &bytes))
    throw fail(util::cat(n, " elements × ", dtype_size(dtype), " bytes overflows 64 bits (the limit is ", kMax,
                         " bytes)"));
  return static_cast<std::size_t>(bytes);
}

Placement plan_buffers(const std::vector<BufferRequest>& req, std::size_t alignment) {
  Placement p;
  p.offsets.assign(req.size(), 0);
  std::vector<std::size_t> order(req.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return req[a].bytes > req[b].bytes; });
  auto overflow = [&](std::size_t i, const char* what) {
    return Error(util::cat("memory plan: ", what, " of buffer ", i, " (", req[i].bytes,
                           " bytes) overflows 64 bits; the shapes are too large"));
  };
  auto add = [&](std::size_t a, std::size_t b, std::size_t i, const char* what) {
    const auto r = util::checked_add(a, b);
    if (!r) throw overflow(i, what);
    return static_cast<std::size_t>(*r);
  };
  auto align = [&](std::size_t v, std::size_t i) {
    return add(v, alignment - 1, i, "the aligned size") / alignment * alignment;
  };
  std::vector<std::size_t> placed;
  for (std::size_t i : order) {
    const auto& r = req[i];
    const std::size_t size = align(r.bytes, i);
    p.unshared_bytes = add(p.unshared_bytes, size, i, "the unshared total");
    if (r.bytes == 0) continue;
    // Intervals of already placed buffers whose lifetime overlaps this one, by offset.
    std::vector<std::pair<std::size_t, std::size_t>> busy;
    for (std::size_t j : placed) {
      const auto& q = req[j];
      if (q.last < r.first || r.last < q.first) continue;
      busy.emplace_back(p.offsets[j], p.offsets[j] + align(q.bytes, j));
    }
    std::sort(busy.begin(), busy.end());
    std::size_t off = 0;
    for (const auto& [b, e] : busy) {
      if (add(off, size, i, "the arena offset") <= b) break;
      off = std::max(off, e);
    }
    p.offsets[i] = off;
    p.arena_bytes = std::max(p.arena_bytes, add(off, size, i, "the arena end"));
    placed.push_back(i);
  }
  return p;
}

std::optional<std::string> device_memory_shortfall(const DeviceMemoryNeed& need, std::uint64_t free_bytes,
                                                   std::uint64_t total_bytes, const std::string& device,
                                                   const std::string& inputs) {
  std::optional<std::uint64_t> total = need.activations;
  for (std::uint64_t part : {need.parameters, need.inputs, need.gradients})
    if (total) total = util::checked_add(*total, part);
  if (total && *total <= free_bytes) return std::nullopt;
  const std::string needs =
      total ? util::cat(*total, " bytes (", util::format_bytes(*total)) : std::string("more than 2^64 bytes (");
  return util::cat("the memory plan for ", inputs, " needs ", needs, ": activations ", need.activations,
                   ", parameters ", need.parameters, ", inputs ", need.inputs,
                   need.gradients ? util::cat(", gradients ", need.gradients) : std::string(), ") on ", device,
                   " but ", free_bytes, " bytes (", util::format_bytes(free_bytes), ") of its ", total_bytes,
                   " are free (cuMemGetInfo); use a smaller batch, or set KG_NO_MEMORY_CHECK=1 to allocate anyway");
}

}  // namespace kg::plan
