// Helpers the benchmark programs share: integer flags and the summary of timed runs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace kg_bench {

// The program's usage message; it exits and does not return.
using UsageFn = void (*)(const std::string& why);

// The integer value of `flag`, at least `lo`; anything else is a usage error.
inline long parse_int(const std::string& flag, const std::string& v, long lo, UsageFn usage) {
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n < lo) usage(flag + " wants an integer >= " + std::to_string(lo) + ", got '" + v + "'");
  return n;
}

// A comma-separated list of batch sizes (each >= 1, at least one).
inline std::vector<std::int64_t> parse_batches(const std::string& flag, const std::string& v, UsageFn usage) {
  std::vector<std::int64_t> out;
  std::stringstream ss(v);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(parse_int(flag, item, 1, usage));
  if (out.empty()) usage(flag + " needs at least one batch size");
  return out;
}

// Median, minimum and 90th percentile of run times.
struct Timing {
  double median = 0, min = 0, p90 = 0;
};

inline Timing summarise(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  const std::size_t n = ms.size();
  Timing t;
  if (n == 0) return t;
  t.median = n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
  t.min = ms.front();
  t.p90 = ms[std::min(n - 1, static_cast<std::size_t>(std::ceil(0.9 * static_cast<double>(n))) - 1)];
  return t;
}

}  // namespace kg_bench
