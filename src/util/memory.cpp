#include "util/memory.hpp"

#include <sys/resource.h>

#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>

namespace kg::util {
namespace {

std::mutex g_mu;
std::optional<std::uint64_t> g_test_bytes;

// The first number after "MemAvailable:" in /proc/meminfo (kB), in bytes.
std::optional<std::uint64_t> mem_available() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  std::uint64_t kb = 0;
  std::string unit;
  while (f >> key >> kb) {
    std::getline(f, unit);
    if (key == "MemAvailable:") return kb * 1024;
  }
  return std::nullopt;
}

// A number in a one-line file ("max" or a missing file: no limit).
std::optional<std::uint64_t> number_in(const std::string& path) {
  std::ifstream f(path);
  std::string text;
  if (!(f >> text) || text == "max") return std::nullopt;
  std::istringstream is(text);
  std::uint64_t v = 0;
  if (!(is >> v)) return std::nullopt;
  // cgroup v1 reports "no limit" as a huge page-rounded number.
  if (v >= (std::uint64_t{1} << 62)) return std::nullopt;
  return v;
}

// The smallest memory limit of this process's cgroup: v2's memory.max (the "0::/path" line of
// /proc/self/cgroup) or v1's memory.limit_in_bytes (the "memory" controller's line).
std::optional<MemoryLimit> cgroup_limit() {
  std::ifstream f("/proc/self/cgroup");
  std::string line;
  std::optional<MemoryLimit> best;
  auto consider = [&](std::optional<std::uint64_t> v, const std::string& source) {
    if (v && (!best || *v < best->bytes)) best = MemoryLimit{*v, source};
  };
  while (std::getline(f, line)) {
    const auto a = line.find(':');
    const auto b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const std::string path = line.substr(b + 1);
    if (controllers.empty()) {
      consider(number_in("/sys/fs/cgroup" + path + "/memory.max"), "cgroup memory.max");
      consider(number_in("/sys/fs/cgroup/memory.max"), "cgroup memory.max");
    } else if (controllers.find("memory") != std::string::npos) {
      consider(number_in("/sys/fs/cgroup/memory" + path + "/memory.limit_in_bytes"),
               "cgroup memory.limit_in_bytes");
      consider(number_in("/sys/fs/cgroup/memory/memory.limit_in_bytes"), "cgroup memory.limit_in_bytes");
    }
  }
  return best;
}

// A "VmSize:" style line of /proc/self/status (kB), in bytes; 0 when missing.
std::uint64_t status_bytes(const std::string& key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key, 0) != 0) continue;
    std::istringstream is(line.substr(key.size()));
    std::uint64_t kb = 0;
    is >> kb;
    return kb * 1024;
  }
  return 0;
}

// What a resource limit leaves: the limit less what the process has mapped already (`used`,
// a /proc/self/status key).
std::optional<std::uint64_t> rlimit_left(int which, const std::string& used) {
  struct rlimit r {};
  if (getrlimit(which, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return std::nullopt;
  const auto limit = static_cast<std::uint64_t>(r.rlim_cur);
  const std::uint64_t have = status_bytes(used);
  return limit > have ? limit - have : 0;
}

}  // namespace

std::optional<MemoryLimit> available_memory() {
  {
    std::lock_guard<std::mutex> lk(g_mu);
    if (g_test_bytes) return MemoryLimit{*g_test_bytes, "test hook"};
  }
  std::optional<MemoryLimit> best;
  auto consider = [&](std::optional<std::uint64_t> v, const char* source) {
    if (v && (!best || *v < best->bytes)) best = MemoryLimit{*v, source};
  };
  consider(mem_available(), "MemAvailable in /proc/meminfo");
  if (auto c = cgroup_limit()) consider(c->bytes, c->source.c_str());
  consider(rlimit_left(RLIMIT_AS, "VmSize:"), "RLIMIT_AS (less the mapped VmSize)");
  consider(rlimit_left(RLIMIT_DATA, "VmData:"), "RLIMIT_DATA (less VmData)");
  return best;
}

void set_available_memory_for_testing(std::optional<std::uint64_t> bytes) {
  std::lock_guard<std::mutex> lk(g_mu);
  g_test_bytes = bytes;
}

bool memory_check_disabled() {
  const char* v = std::getenv("KG_NO_MEMORY_CHECK");
  return v && *v && std::string(v) != "0";
}

std::optional<std::uint64_t> checked_mul(std::uint64_t a, std::uint64_t b) {
  std::uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

std::optional<std::uint64_t> checked_add(std::uint64_t a, std::uint64_t b) {
  std::uint64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

}  // namespace kg::util
