#include "plan/memory_plan.hpp"

#include <algorithm>
#include <numeric>

namespace kg::plan {

Placement plan_buffers(const std::vector<BufferRequest>& req, std::size_t alignment) {
  Placement p;
  p.offsets.assign(req.size(), 0);
  std::vector<std::size_t> order(req.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return req[a].bytes > req[b].bytes; });
  auto align = [&](std::size_t v) { return (v + alignment - 1) / alignment * alignment; };
  std::vector<std::size_t> placed;
  for (std::size_t i : order) {
    const auto& r = req[i];
    p.unshared_bytes += align(r.bytes);
    if (r.bytes == 0) continue;
    // Intervals of already placed buffers whose lifetime overlaps this one, by offset.
    std::vector<std::pair<std::size_t, std::size_t>> busy;
    for (std::size_t j : placed) {
      const auto& q = req[j];
      if (q.last < r.first || r.last < q.first) continue;
      busy.emplace_back(p.offsets[j], p.offsets[j] + align(q.bytes));
    }
    std::sort(busy.begin(), busy.end());
    std::size_t off = 0;
    for (const auto& [b, e] : busy) {
      if (off + align(r.bytes) <= b) break;
      off = std::max(off, e);
    }
    p.offsets[i] = off;
    p.arena_bytes = std::max(p.arena_bytes, off + align(r.bytes));
    placed.push_back(i);
  }
  return p;
}

}  // namespace kg::plan
