// Flag validators shared by the kgraph subcommands.
#pragma once

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "kg/error.hpp"
#include "model_source.hpp"
#include "util/thread_pool.hpp"

namespace kgraph_cli {

// `value` as a decimal whole number from `lo` to `hi`: digits only (a '-' before a number that
// must be >= 0, a '+', spaces, hex or a fraction are refused), every digit checked for overflow, so
// that "-1" never wraps to 2^64-1 and 2^64 never saturates. Empty when it is not one.
inline std::optional<std::uint64_t> parse_decimal(const std::string& value, std::uint64_t lo, std::uint64_t hi) {
  if (value.empty() || value.size() > 20) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : value) {
    if (c < '0' || c > '9') return std::nullopt;
    if (v > (std::numeric_limits<std::uint64_t>::max() - static_cast<std::uint64_t>(c - '0')) / 10)
      return std::nullopt;
    v = v * 10 + static_cast<std::uint64_t>(c - '0');
  }
  if (v < lo || v > hi) return std::nullopt;
  return v;
}

// A whole number from `lo` to `hi` (inclusive), in decimal digits only.
inline CLI::Validator whole_number(std::uint64_t lo, std::uint64_t hi, const std::string& what) {
  return CLI::Validator(
      [lo, hi, what](std::string& value) -> std::string {
        if (parse_decimal(value, lo, hi)) return {};
        return "expects " + what + " from " + std::to_string(lo) + " to " + std::to_string(hi) + ", got '" + value + "'";
      },
      std::to_string(lo) + "<=N<=" + std::to_string(hi));
}

// A whole number >= 1 that fits the flag's type ("--batch 0", "--batch two" and "--runs 2^40"
// are usage errors, not a wrapped number).
inline const CLI::Validator positive_integer =
    whole_number(1, static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()), "a whole number");
// The same for flags held in an int (--runs, --epochs, --arch).
inline const CLI::Validator positive_int =
    whole_number(1, static_cast<std::uint64_t>(std::numeric_limits<int>::max()), "a whole number");
// A seed: any of the 2^64 values, in decimal ("--seed -1" and "--seed 18446744073709551616" are
// usage errors; they had both become 2^64-1).
inline const CLI::Validator seed_value =
    whole_number(0, std::numeric_limits<std::uint64_t>::max(), "a seed: a whole number");
// The most ranks --nproc starts: a thousand processes is past any machine this runs on (on the cpu
// the bound is four per core; see train.cpp).
constexpr int kMaxProcesses = 1024;
inline const CLI::Validator process_count = whole_number(1, kMaxProcesses, "a number of processes");

// A finite number >= 0 ("--lr -1" and "--lr inf" are usage errors).
inline const CLI::Validator finite_non_negative(
    [](std::string& value) -> std::string {
      std::size_t used = 0;
      double v = -1;
      try {
        v = std::stod(value, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != value.size() || value.empty() || !std::isfinite(v) || v < 0)
        return "expects a finite number >= 0, got '" + value + "'";
      return {};
    },
    "X>=0");

// A thread count for --threads: a whole number from 0 (one per core) to the pool's bound
// ("--threads 1000000" is a usage error, not a million threads started).
inline const CLI::Validator thread_count(
    [](std::string& value) -> std::string {
      constexpr int max = kg::util::ThreadPool::kMaxThreads;
      if (!parse_decimal(value, 0, static_cast<std::uint64_t>(max)))
        return "expects a whole number of threads from 0 (one per core) to " + std::to_string(max) +
               ", got '" + value + "'";
      return {};
    },
    "0<=N<=" + std::to_string(kg::util::ThreadPool::kMaxThreads));

// NAME=SIZE for --dim ("--dim sequence" and "--dim sequence=0" are usage errors).
inline const CLI::Validator dim_assignment(
    [](std::string& value) -> std::string {
      try {
        kgraph::parse_dim(value);
      } catch (const kg::Error& e) {
        return e.what();
      }
      return {};
    },
    "NAME=SIZE");

}  // namespace kgraph_cli
