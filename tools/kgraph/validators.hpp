// Flag validators shared by the kgraph subcommands.
#pragma once

#include <CLI/CLI.hpp>
#include <cmath>
#include <string>

#include "kg/error.hpp"
#include "model_source.hpp"
#include "util/thread_pool.hpp"

namespace kgraph_cli {

// A whole number >= 1 ("--batch 0" and "--batch two" are usage errors).
inline const CLI::Validator positive_integer(
    [](std::string& value) -> std::string {
      std::size_t used = 0;
      long long v = 0;
      try {
        v = std::stoll(value, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != value.size() || value.empty() || v < 1)
        return "expects a whole number >= 1, got '" + value + "'";
      return {};
    },
    "N>=1");

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
      std::size_t used = 0;
      long long v = -1;
      try {
        v = std::stoll(value, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != value.size() || value.empty() || v < 0 || v > max)
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
