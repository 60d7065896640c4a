// lower::same_launches, the comparison that decides whether a captured CUDA graph may be
// replayed for a run: equal lists are the same; a different entry, grid, block, shared memory
// size, argument count, argument kind or a single argument byte makes them differ.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kg/runtime_op.hpp"
#include "lower/launch_plan.hpp"

namespace {

using kg::lower::CheckedLaunch;

// The arguments of launch i below: a pointer, an i64, an f64 and an i32.
kg::KernelArgs args(kg::DevicePtr p, std::int64_t n, std::int32_t flag) {
  kg::KernelArgs a;
  a.pointer(p);
  a.i64(n);
  a.f64(0.5);
  a.i32(flag);
  return a;
}

std::vector<CheckedLaunch> two_launches() {
  std::vector<CheckedLaunch> ls(2);
  for (std::size_t i = 0; i < ls.size(); ++i) {
    CheckedLaunch& c = ls[i];
    c.entry = "kg_step_" + std::to_string(i);
    c.ptx_entry = c.entry;
    c.launch.grid = {static_cast<unsigned>(10 + i), 2, 1};
    c.launch.block = {256, 1, 1};
    c.launch.shared_bytes = 128;
    c.launch.args = args(0x1000 + i, 42, 1);
  }
  return ls;
}

TEST(SameLaunches, EqualListsAreTheSame) {
  EXPECT_TRUE(kg::lower::same_launches(two_launches(), two_launches()));
  EXPECT_TRUE(kg::lower::same_launches({}, {}));
}

TEST(SameLaunches, EveryFieldCounts) {
  const std::vector<std::pair<std::string, std::function<void(std::vector<CheckedLaunch>&)>>> edits = {
      {"one launch fewer", [](auto& v) { v.pop_back(); }},
      {"another entry", [](auto& v) { v[1].entry = "kg_other"; }},
      {"another PTX entry", [](auto& v) { v[1].ptx_entry = "kg_other"; }},
      {"grid x", [](auto& v) { v[0].launch.grid.x += 1; }},
      {"grid y", [](auto& v) { v[0].launch.grid.y += 1; }},
      {"grid z", [](auto& v) { v[1].launch.grid.z += 1; }},
      {"block x", [](auto& v) { v[1].launch.block.x = 128; }},
      {"block y", [](auto& v) { v[0].launch.block.y = 2; }},
      {"shared memory", [](auto& v) { v[0].launch.shared_bytes = 0; }},
      {"one argument more", [](auto& v) { v[1].launch.args.i32(0); }},
      {"a pointer", [](auto& v) { v[0].launch.args = args(0x2000, 42, 1); }},
      {"a seed-like integer", [](auto& v) { v[1].launch.args = args(0x1001, 43, 1); }},
      {"a train-mode flag", [](auto& v) { v[1].launch.args = args(0x1001, 42, 0); }},
      {"the same bytes as another kind",
       [](auto& v) {
         kg::KernelArgs a;
         a.i64(0x1000);  // the pointer's bytes, as an integer
         a.i64(42);
         a.f64(0.5);
         a.i32(1);
         v[0].launch.args = a;
       }},
  };
  for (const auto& [what, edit] : edits) {
    SCOPED_TRACE(what);
    std::vector<CheckedLaunch> changed = two_launches();
    edit(changed);
    EXPECT_FALSE(kg::lower::same_launches(two_launches(), changed));
    EXPECT_FALSE(kg::lower::same_launches(changed, two_launches()));
  }
}

}  // namespace
