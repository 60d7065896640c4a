// CUDA C++ → PTX with NVRTC, behind an in-process cache and a content-addressed disk cache.
#pragma once

#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
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
  // The process-wide compiler, caching in default_cache_dir().
  static Compiler& global();
  // `cache_dir` empty: no disk cache (compiles are cached in memory only).
  explicit Compiler(std::filesystem::path cache_dir);
  // KG_CACHE_DIR, else $XDG_CACHE_HOME/kernelgraph, else ~/.cache/kernelgraph, else the per-user
  // $TMPDIR/kernelgraph-cache-<uid> (created 0700). That last one is refused, with a note on
  // stderr once, when private_cache_dir() says no: the result is then empty (no disk cache).
  static std::filesystem::path default_cache_dir();

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

  // The disk cache's folder; empty when there is none.
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

// Cache files (PTX here, shared objects of the CUDA emulator) end in a trailer line with the size
// and the 64-bit FNV-1a hash of the bytes before it, so that a file cut short or damaged is
// dropped and rebuilt rather than served. A trailer at the end (rather than a header) keeps a PTX
// file valid PTX (it is a `//` comment) and a shared object loadable (the loader ignores bytes past
// the ELF's last section). The hash guards against accidents, not against someone who can write
// the folder: that is what private_cache_dir() is for.
std::string seal_cache_file(const std::string& bytes);
// The bytes of a sealed file, or nullopt when the trailer is missing or does not match them.
std::optional<std::string> unseal_cache_file(const std::string& file);
// The largest file a disk cache reads (a PTX, a CUBIN, an emulator module): anything larger in a
// cache folder was not written by kernelgraph and is ignored unread.
constexpr std::uint64_t kMaxCacheFileBytes = std::uint64_t(512) << 20;
// Reads a cache file through util::try_read_file (O_NOFOLLOW, a regular file only, never blocking
// on a FIFO or device): false when it is missing, a symbolic link, not a regular file or larger
// than `max_bytes`.
bool read_cache_file(const std::filesystem::path& p, std::string& out,
                     std::uint64_t max_bytes = kMaxCacheFileBytes);
// util::private_dir(): creates `dir` (mode 0700) when it is missing, and says whether it is safe to
// keep files in that are later loaded as code: a folder (not a symbolic link) owned by this user and
// not writable by group or others. `why` gets the reason when it is not.
bool private_cache_dir(const std::filesystem::path& dir, std::string& why);

// Machine code beside the PTX: the CUBIN the driver's linker made from a PTX for one device
// architecture, kept sealed in the cache folder so that a later load reads machine code instead of
// JIT-compiling the PTX again. The file is `<PTX content hash>.sm_<arch>.drv<driver version>.cubin`;
// the folder must pass private_cache_dir(), since what is in it runs on the GPU.
class CubinCache {
 public:
  // `dir` empty: no cache (read() misses, store() does nothing).
  explicit CubinCache(std::filesystem::path dir);
  // The key of the CUBIN of the PTX whose content_hash() is `ptx_hash`, for compute capability
  // `arch` (90) under the driver version `driver_version` (cuDriverGetVersion: 13000 for 13.0).
  static std::string key(const std::string& ptx_hash, int arch, int driver_version);
  // Whether the folder can hold CUBINs: set and private_cache_dir() (which creates it). `why` gets
  // the reason when not.
  bool usable(std::string* why = nullptr) const;
  // The file of `key` (whether or not it exists).
  std::filesystem::path path(const std::string& key) const;
  // The CUBIN of `key`, or nullopt when there is none; a file cut short, damaged or not an ELF
  // image is removed (counted as dropped) so that it is rebuilt.
  std::optional<std::string> read(const std::string& key) const;
  // Keeps `cubin` under `key`, sealed, through a temporary file and a rename; false when the
  // folder is unusable or the write failed (which only costs a JIT next time).
  bool store(const std::string& key, const std::string& cubin) const;
  // Removes the file of `key` (a CUBIN the driver refused).
  void drop(const std::string& key) const;
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
};

// The folder where device contexts keep CUBINs: the one given to set_cubin_cache_dir(), else
// Compiler::global().cache_dir().
std::filesystem::path cubin_cache_dir();
// Overrides cubin_cache_dir() for the process (nullopt: back to the default). Loads after the change
// read and write the new folder; modules already loaded are not loaded again.
void set_cubin_cache_dir(std::optional<std::filesystem::path> dir);

// How a module came to be loaded on a GPU, for the counters below.
enum class ModuleLoad {
  cached_cubin,  // machine code read from the disk cache: no JIT
  built_cubin,   // the PTX compiled to a CUBIN by the driver's linker (then kept in the cache)
  ptx_jit,       // the PTX handed to the driver as is (no usable cache, or building the CUBIN failed)
  dropped_cubin  // not a load: a cached CUBIN that was damaged or that the driver refused, removed
};
// What the module loads of this process did, over every device.
struct ModuleLoadCounts {
  long cached_cubin = 0;   // modules loaded from a cached CUBIN
  long built_cubin = 0;    // modules compiled to a CUBIN in this process
  long ptx_jit = 0;        // modules JIT-compiled by the driver from PTX
  long dropped_cubin = 0;  // cached CUBINs removed as damaged or refused
  // Modules whose machine code was compiled in this process (built_cubin + ptx_jit).
  long compiled() const { return built_cubin + ptx_jit; }
};
// Counts one event (thread-safe).
void count_module_load(ModuleLoad what);
// The counts so far.
ModuleLoadCounts module_load_counts();

}  // namespace kg::compile
