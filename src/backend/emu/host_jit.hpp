// CUDA C++ → a shared object for the CPU, with the host C++ compiler: the kernel source compiled
// against the emulation header (cuda_emu.hpp) and our .cuh helpers, plus generated trampolines
// that call each __global__ function with packed arguments. Disk-cached by content hash beside
// the PTX cache (KG_CACHE_DIR/emu/<key>.so, written through a temporary file and a rename, sealed
// with compile::seal_cache_file() and checked before each dlopen) and cached per process; loaded
// with dlopen.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/emu/emu_abi.hpp"
#include "compile/cuda_source.hpp"

namespace kg::emu {

// A kernel parameter: its C++ type as the compiler sees it, and its name and spelling in the
// source.
struct ParamDesc {
  KgEmuParam info{};
  std::string name;  // "" when the signature could not be read
  std::string type;  // "const float*"
};

// One __global__ function of a module.
struct KernelEntry {
  std::string module_name;  // the op or kernel name the source was compiled under
  std::string entry;
  void (*run)(const KgEmuThreadInfo*, void**) = nullptr;
  std::vector<ParamDesc> params;
  int max_threads = 0;  // __launch_bounds__'s first argument (0: none)
};

struct JitModule {
  std::string name;
  std::string key;             // content hash
  std::filesystem::path path;  // the shared object
  bool from_disk = false;      // served by the disk cache
  double compile_seconds = 0;  // host compile time when it was built here
  std::vector<KernelEntry> entries;
  // The entry named `entry`, or the only one when `entry` is empty. `label` prefixes errors.
  const KernelEntry& find(const std::string& entry, const std::string& label) const;
};

using compile::find_kernels;
using compile::KernelSignature;

// `extern __shared__ T name[];` → a pointer to the block's dynamic shared memory.
std::string rewrite_dynamic_shared(const std::string& source);

// The emulation header's text (kg_cuda_emu.h).
const std::string& emulation_header();

class HostJit {
 public:
  // The process-wide JIT, caching under compile::Compiler::global().cache_dir() / "emu".
  static HostJit& global();
  // `dir` is checked with util::private_dir() before each load, before anything in it is opened:
  // when it is not private to this user (another's, writable by group or others, a symbolic link),
  // it is not used at all (a note on stderr once) and modules are built in a temporary folder of
  // this process's own.
  explicit HostJit(std::filesystem::path dir);
  // The JIT of a kernel cache folder: modules in `base`/emu, where both `base` and emu/ are checked
  // (emu/ a link elsewhere, or another user's, is refused like `base` itself).
  static HostJit in_cache(const std::filesystem::path& base);
  HostJit(HostJit&& o) noexcept;

  // Builds (or finds) the module of `source`; `name` names the op or kernel in errors. A failed
  // compile throws kg::Error with the compiler's full output.
  std::shared_ptr<const JitModule> load(const std::string& name, const std::string& source);

  struct Stats {
    int compiled = 0, disk_hits = 0, memory_hits = 0;
    int untrusted_folders = 0;  // cache folders refused by the privacy check
    double compile_seconds = 0;
  };
  Stats stats() const;
  const std::filesystem::path& cache_dir() const { return dir_; }
  // The host compiler command: $KG_EMU_CXX (split by the shell: "ccache g++" works), else g++.
  static std::string compiler();

 private:
  std::filesystem::path include_dir();
  void check_folder();
  std::filesystem::path dir_;
  std::filesystem::path trust_base_;  // when set, dir_ is trust_base_/emu and both are checked
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<const JitModule>> modules_;
  std::string include_dir_;
  std::string compiler_id_;
  Stats stats_;
};

}  // namespace kg::emu
