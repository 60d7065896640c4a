// Fuzz target bodies for the emulator's module cache and the file rendezvous (see targets.hpp for
// the contract: a kg::Error is a refusal, anything else a finding).
#pragma once

#include <stdlib.h>
#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "backend/comm/group.hpp"
#include "backend/emu/host_jit.hpp"
#include "compile/compiler.hpp"
#include "compile/ptx.hpp"
#include "kg/error.hpp"

namespace kg::fuzz {

namespace cache_detail {

inline void put_bytes(const std::filesystem::path& p, const std::uint8_t* data, std::size_t size) {
  std::error_code ec;
  std::filesystem::remove(p, ec);
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

// Sets an environment variable for the life of the object (the regression test replays this target
// inside the test suite, whose other tests need the real compiler).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_, old_->c_str(), 1);
    else ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// Whether this process has a file of `dir` mapped (a dlopen'ed module shows in /proc/self/maps).
inline bool maps_file_in(const std::filesystem::path& dir) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const std::string needle = dir.string() + "/";
  while (std::getline(maps, line))
    if (line.find(needle) != std::string::npos) return true;
  return false;
}

}  // namespace cache_detail

// ---- the emulator's module cache: the bytes as the cached shared object of a kernel (and as a
// cached PTX). In a folder others can write to they must never be opened, let alone dlopen'ed; in a
// private folder they are checked against the seal and dropped unless whole. The host compiler is
// replaced by `true` (it "succeeds" without making anything), so an input costs no real build. ----
inline int fuzz_emu_cache(const std::uint8_t* data, std::size_t size) {
  namespace fs = std::filesystem;
  using cache_detail::put_bytes;
  cache_detail::ScopedEnv cxx("KG_EMU_CXX", "true");
  static const char* kSource = "__global__ void k(float* y) { y[threadIdx.x] = 1.0f; }\n";
  const fs::path root = scratch_dir() / "emu-cache";
  const fs::path mine = root / "private", shared = root / "shared";
  fs::create_directories(mine);
  fs::create_directories(shared);
  ::chmod(mine.c_str(), 0700);
  ::chmod(shared.c_str(), 0777);  // anyone could plant a module here
  // The module's file name: the failed "build" in the private folder leaves <key>.cpp behind.
  static const std::string key = [&] {
    try {
      emu::HostJit(mine).load("fuzz.k", kSource);
    } catch (const Error&) {
    }
    for (const auto& e : fs::directory_iterator(mine))
      if (e.path().extension() == ".cpp") return e.path().stem().string();
    throw std::runtime_error("kg fuzz: the emulator cache left no source to name the module");
  }();
  // 1. Planted in the shared folder: never opened. The JIT builds in a folder of its own instead.
  put_bytes(shared / (key + ".so"), data, size);
  {
    emu::HostJit jit(shared);
    try {
      jit.load("fuzz.k", kSource);
    } catch (const Error&) {
    }
    if (cache_detail::maps_file_in(shared)) __builtin_trap();  // a planted module was loaded
    if (jit.stats().untrusted_folders != 1 || jit.stats().disk_hits != 0) __builtin_trap();
    std::error_code ec;
    if (jit.cache_dir() != shared) fs::remove_all(jit.cache_dir(), ec);
  }
  // 2. In the private folder: served only when the seal matches (the fuzzer does not forge one).
  put_bytes(mine / (key + ".so"), data, size);
  {
    emu::HostJit jit(mine);
    try {
      jit.load("fuzz.k", kSource);
    } catch (const Error&) {
    }
  }
  // 3. As a cached PTX: read through the guarded read, unsealed, then looked at as PTX.
  put_bytes(mine / "fuzz.ptx", data, size);
  std::string text;
  if (compile::read_cache_file(mine / "fuzz.ptx", text))
    if (const auto ptx = compile::unseal_cache_file(text)) (void)compile::looks_like_ptx(*ptx);
  return 0;
}

// ---- the file rendezvous: the bytes as rank 1's message of a two-rank job, read by rank 0. The
// first byte picks the collective (barrier, broadcast from rank 1, all-reduce), the second its size. ----
inline int fuzz_rendezvous(const std::uint8_t* data, std::size_t size) {
  namespace fs = std::filesystem;
  const fs::path dir = scratch_dir() / "rendezvous";
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directories(dir);
  const int op = size > 0 ? data[0] % 3 : 0;
  const std::size_t n = size > 1 ? data[1] % 17 : 1;
  const std::uint8_t* body = size > 2 ? data + 2 : data;
  const std::size_t body_size = size > 2 ? size - 2 : 0;
  cache_detail::put_bytes(dir / "0.1", body, body_size);
  try {
    auto g = comm::make_rendezvous(dir.string(), 0, 2, 0, 0.2);
    if (op == 0) {
      g->barrier();
    } else if (op == 1) {
      std::string buf(n, '\0');
      g->broadcast(buf.data(), buf.size(), 1);
      if (std::string(reinterpret_cast<const char*>(body), body_size) != buf) __builtin_trap();
    } else {
      std::vector<double> v(n, 1.0);
      g->all_reduce_sum(v.data(), v.size());
    }
  } catch (const Error&) {
  }
  return 0;
}

}  // namespace kg::fuzz
