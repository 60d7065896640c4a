// CUDA C++ → PTX with NVRTC, behind an in-process cache and a content-addressed disk cache.
#pragma once

#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace kg::compile {

struct CompileResult {
  std::string ptx;
  std::string key;          // content hash: source, options, arch, NVRTC version
  bool from_disk = false;   // served by the disk cache
  bool from_memory = false; // served by the in-process cache
  bool was_ptx = false;     // the source already was PTX and was taken as is
};

class Compiler {
 public:
  // The process-wide compiler (cache directory from KG_CACHE_DIR, else
  // $XDG_CACHE_HOME/kernelgraph, else ~/.cache/kernelgraph).
  static Compiler& global();
  explicit Compiler(std::filesystem::path cache_dir);

  // True when this build has the CUDA path and libnvrtc could be opened (it is loaded at run
  // time, on the first call; see compile/nvrtc_loader.hpp for where it is looked for).
  static bool available();
  // Why available() is false: no CUDA path in this build, or where libnvrtc was looked for ("" when
  // it is true).
  static std::string unavailable_reason();
  // NVRTC's version as "major.minor" ("none" without NVRTC).
  static std::string nvrtc_version();

  // Compiles `source` for compute capability `arch` (90 for sm_90). `name` names the op or
  // kernel in errors; a failure carries NVRTC's full log. A source that already is PTX is
  // returned as is. Our .cuh helpers are given to NVRTC as in-memory headers. Without NVRTC
  // (available() is false), anything but PTX throws kg::Error with unavailable_reason().
  CompileResult compile(const std::string& name, const std::string& source, int arch,
                        const std::vector<std::string>& extra_options = {});

  const std::filesystem::path& cache_dir() const { return dir_; }
  // Drops the in-process cache (the disk cache stays).
  void clear_memory_cache();

 private:
  std::filesystem::path dir_;
  std::mutex mu_;
  std::map<std::string, std::string> memory_;
};

// A stable 128-bit hex digest of `text` (two FNV-1a 64 lanes).
std::string content_hash(const std::string& text);

}  // namespace kg::compile
