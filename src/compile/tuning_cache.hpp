// Tactics measured at a tuned load, kept on disk so that later loads do not measure again: which
// cuDNN or cuBLASLt algorithm a call runs, and whether a node runs the library or its own kernels.
// Entries are grouped in scopes, one file each: a scope names what a measurement holds for (the
// device, its driver and the library's version), a key what was measured (a call's shapes, dtypes
// and options), a value what won. Values are only ever choices among what the library offers, so
// a stale or damaged entry costs speed, never correctness: the caller checks what it reads.
#pragma once

#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>

namespace kg::compile {

class TuningCache {
 public:
  // Files in `dir` (created 0700 when missing); empty: in memory only, for the process.
  explicit TuningCache(std::filesystem::path dir);
  // The process-wide cache: `tuning/` in the kernel cache folder (cubin_cache_dir()); in memory
  // only when that folder is not private, or when KG_TUNING_CACHE=0.
  static TuningCache& global();

  // The value stored under `key` in `scope`, or nullopt. Neither may contain a tab or a newline.
  std::optional<std::string> find(const std::string& scope, const std::string& key);
  // Stores `value` (the last stored value of a key wins, in this process and in later ones).
  // Writes append one line to the scope's file; a failed write only costs a measurement later.
  void store(const std::string& scope, const std::string& key, const std::string& value);
  // Forgets every entry of every scope, on disk too (`kgraph tune --fresh`).
  void clear();

  // The scope's file: `<dir>/<hash of scope>.tune`.
  std::filesystem::path file(const std::string& scope) const;
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::map<std::string, std::string>& entries(const std::string& scope);

  std::filesystem::path dir_;
  std::mutex mu_;
  std::map<std::string, std::map<std::string, std::string>> scopes_;
  std::set<std::string> unreadable_;  // scopes whose file has no valid header: rewritten on store
  std::set<std::string> cut_short_;   // scopes whose file's last line has no newline
};

}  // namespace kg::compile
