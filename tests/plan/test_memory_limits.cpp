// Sizes that do not fit: byte counts that overflow 64 bits are a kg::Error naming the node, the
// shape and the dtype, and a plan whose peak is over the memory the process can have is refused
// at load, before the arena is allocated, naming the input shapes and both byte counts.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>

#include "kg/kg.hpp"
#include "kg/models.hpp"
#include "lower/dry_run.hpp"
#include "plan/memory_plan.hpp"
#include "support/test_util.hpp"
#include "util/memory.hpp"

namespace {

// Sets the "available" figure for the test's lifetime.
struct AvailableMemory {
  explicit AvailableMemory(std::uint64_t bytes) { kg::util::set_available_memory_for_testing(bytes); }
  ~AvailableMemory() { kg::util::set_available_memory_for_testing(std::nullopt); }
};

// Sets an environment variable for the test's lifetime.
struct EnvVar {
  EnvVar(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
  ~EnvVar() { ::unsetenv(name_); }
  const char* name_;
};

// x [batch, 2] f32 -> relu.
kg::Model relu_model() {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 2});
  return kg::Model(g, {{"y", kg::relu(x, "act")}});
}

}  // namespace

TEST(MemoryLimits, BytesOfAShapeOverflowingInt64AreAnError) {
  EXPECT_EQ(kg::plan::checked_bytes({3, 5}, kg::DType::F64, "[x @ y]"), 120u);
  EXPECT_EQ(kg::plan::checked_bytes({0, std::numeric_limits<std::int64_t>::max()}, kg::DType::F32, "[x @ y]"), 0u);
  // 2^61 × 2 elements fit in an int64; × 4 bytes do not.
  kg_test::expect_error(
      [] { kg::plan::checked_bytes({std::int64_t{1} << 61, 2}, kg::DType::F32, "[op @ node] output"); },
      {"[op @ node] output [2305843009213693952, 2] f32", "4611686018427387904 elements × 4 bytes overflows 64 bits"});
  kg_test::expect_error([] { kg::plan::checked_bytes({std::int64_t{1} << 40, std::int64_t{1} << 40}, kg::DType::U8, "v"); },
                        {"v [1099511627776, 1099511627776] u8", "element count overflows 64 bits"});
  kg_test::expect_error([] { kg::plan::checked_bytes({4, -1}, kg::DType::F32, "v"); },
                        {"v [4, -1] f32", "a dimension of size -1"});
}

TEST(MemoryLimits, ArenaOffsetsThatOverflowAreAnError) {
  const std::size_t huge = std::numeric_limits<std::size_t>::max() / 2 + 1;
  // Two live at once: the second's offset plus its size passes 2^64.
  kg_test::expect_error([&] { kg::plan::plan_buffers({{huge, 0, 1}, {huge, 0, 1}}); },
                        {"memory plan", "overflows 64 bits"});
  // Aligning a size next to 2^64 overflows too.
  kg_test::expect_error([] { kg::plan::plan_buffers({{std::numeric_limits<std::size_t>::max() - 3, 0, 0}}); },
                        {"memory plan", "aligned size", "overflows 64 bits"});
}

TEST(MemoryLimits, ModelWhoseBytesOverflowNamesTheNode) {
  kg::Model m = relu_model();
  kg_test::expect_error([&] { m.load(kg::Device::cpu(), {{std::int64_t{1} << 61, 2}}); },
                        {"@ input] output [2305843009213693952, 2] f32", "overflows 64 bits"});
}

TEST(MemoryLimits, PlanOverTheAvailableMemoryIsRefusedAtLoad) {
  kg::Model m = kg::models::build("lenet5");
  const auto shape = kg::models::input_shape("lenet5", 64);
  const std::size_t peak = m.load(kg::Device::cpu(), {shape}).memory_plan().peak_bytes;
  {
    AvailableMemory avail(peak - 1);
    kg_test::expect_error([&] { m.load(kg::Device::cpu(), {shape}); },
                          {"the memory plan for input 'input' [64, 1, 28, 28] needs " + std::to_string(peak) + " bytes",
                           "but " + std::to_string(peak - 1) + " bytes", "are available (test hook)",
                           "KG_NO_MEMORY_CHECK=1"});
    EnvVar off("KG_NO_MEMORY_CHECK", "1");
    EXPECT_EQ(m.load(kg::Device::cpu(), {shape}).memory_plan().peak_bytes, peak);
  }
  AvailableMemory enough(peak);
  EXPECT_EQ(m.load(kg::Device::cpu(), {shape}).memory_plan().peak_bytes, peak);
}

TEST(MemoryLimits, DryRunsAndGpuArenasAreNotCheckedAgainstHostMemory) {
  AvailableMemory avail(1);
  {
    const kg::plan::ArenaNotOnHost not_on_host;
    EXPECT_TRUE(kg::plan::ArenaNotOnHost::active());
  }
  EXPECT_FALSE(kg::plan::ArenaNotOnHost::active());
  kg::Model m = kg::models::build("lenet5");
  const auto r = kg::lower::dry_run(m, {kg::models::input_shape("lenet5", 64)}, 0);
  EXPECT_GT(r.launches.arena_bytes, 1u);
}

TEST(MemoryLimits, RlimitAsIsSeenInAForkedChild) {
  // In a child under RLIMIT_AS = what is mapped now + 64 MiB, a plan of about 470 MB is refused
  // with the real figure; the parent is unaffected.
  kg::Model m = kg::models::build("lenet5");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::ifstream f("/proc/self/status");
    std::string line;
    std::uint64_t vm_kb = 0;
    while (std::getline(f, line))
      if (line.rfind("VmSize:", 0) == 0) std::istringstream(line.substr(7)) >> vm_kb;
    rlimit r{};
    r.rlim_cur = r.rlim_max = vm_kb * 1024 + (64u << 20);
    if (::setrlimit(RLIMIT_AS, &r) != 0) ::_exit(3);
    try {
      m.load(kg::Device::cpu(), {kg::models::input_shape("lenet5", 20000)});
    } catch (const kg::Error& e) {
      const std::string what = e.what();
      ::_exit(what.find("[20000, 1, 28, 28] needs") != std::string::npos &&
                      what.find("(RLIMIT_AS") != std::string::npos
                  ? 0
                  : 1);
    } catch (...) {
      ::_exit(4);
    }
    ::_exit(2);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: another error, 2: the load succeeded, 3: setrlimit failed, 4: not a kg::Error";
}

// The GPU's check (the CUDA executor calls it with cuMemGetInfo's figures before allocating the
// arena): a plan that fits the free bytes passes, one byte more is a one-line error with every
// count in it.
TEST(MemoryLimits, GpuPlanOverTheFreeDeviceMemoryIsAOneLineError) {
  kg::plan::DeviceMemoryNeed need;
  need.activations = 4'000'000'000;
  need.parameters = 246'824;
  need.inputs = 627'200'000;
  const std::uint64_t total = need.activations + need.parameters + need.inputs;  // 4627446824
  EXPECT_FALSE(kg::plan::device_memory_shortfall(need, total, total, "cuda:0", "input 'x' [200000, 1, 28, 28]"));
  EXPECT_FALSE(kg::plan::device_memory_shortfall(need, total + 1, total + 5, "cuda:0", "input 'x' [1]"));
  const auto e = kg::plan::device_memory_shortfall(need, total - 1, 85'000'000'000, "cuda:1",
                                                   "input 'input' [200000, 1, 28, 28]");
  ASSERT_TRUE(e);
  for (const std::string part :
       {"the memory plan for input 'input' [200000, 1, 28, 28] needs 4627446824 bytes (",
        "activations 4000000000, parameters 246824, inputs 627200000) on cuda:1",
        "but 4627446823 bytes (", "of its 85000000000 are free (cuMemGetInfo)", "KG_NO_MEMORY_CHECK=1"})
    EXPECT_NE(e->find(part), std::string::npos) << "lacks '" << part << "': " << *e;
  EXPECT_EQ(e->find('\n'), std::string::npos) << *e;
  EXPECT_EQ(e->find("gradients"), std::string::npos) << *e;  // none: an inference plan

  need.gradients = 246'824;
  const auto t = kg::plan::device_memory_shortfall(need, total, total, "cuda:0", "inputs 'a' [2], 'b' [3]");
  ASSERT_TRUE(t);
  EXPECT_NE(t->find("inputs 'a' [2], 'b' [3] needs 4627693648 bytes"), std::string::npos) << *t;
  EXPECT_NE(t->find(", gradients 246824) on cuda:0"), std::string::npos) << *t;

  // Parts whose sum passes 2^64 are refused, not wrapped round to a small count.
  need.activations = std::numeric_limits<std::uint64_t>::max();
  const std::uint64_t all = ~std::uint64_t{0};
  const auto o = kg::plan::device_memory_shortfall(need, all, all, "cuda:0", "input 'x' [1]");
  ASSERT_TRUE(o);
  EXPECT_NE(o->find("needs more than 2^64 bytes"), std::string::npos) << *o;
}
