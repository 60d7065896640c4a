#include "compile/tuning_cache.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "compile/compiler.hpp"
#include "kg/error.hpp"
#include "util/file.hpp"
#include "util/str.hpp"

namespace kg::compile {
namespace fs = std::filesystem;

namespace {

// File format, one entry per line after a header naming the scope:
//   # kernelgraph tuning cache v1 scope=<scope>
//   <key>\t<value>\t<16 hex digits: FNV-1a 64 of key, tab, value>
// A line whose digest does not match (cut short by a crash, edited) is skipped.
constexpr std::string_view kHeader = "# kernelgraph tuning cache v1 scope=";

std::string digest(const std::string& key, const std::string& value) {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&](std::string_view s) {
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  };
  mix(key);
  mix("\t");
  mix(value);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

void check_text(const std::string& s, const char* what) {
  if (s.empty() || s.find_first_of("\t\n\r") != std::string::npos)
    throw Error(util::cat("tuning cache: a ", what, " must be non-empty and hold no tab or newline: '", s, "'"));
}

// Appends `text` to `p` in one write (O_APPEND: whole lines from several processes do not
// interleave); false when the file cannot be written.
bool append(const fs::path& p, const std::string& text) {
  // O_NONBLOCK: a FIFO planted in place of the file never blocks the open; anything but a regular
  // file is left alone.
  const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY, 0600);
  if (fd < 0) return false;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return false;
  }
  const ssize_t n = ::write(fd, text.data(), text.size());
  ::close(fd);
  return n == static_cast<ssize_t>(text.size());
}

// The largest tuning file read: a scope holds a few thousand short lines at most.
constexpr std::uint64_t kMaxTuningFileBytes = std::uint64_t(64) << 20;

bool disabled_by_env() {
  const char* v = std::getenv("KG_TUNING_CACHE");
  return v && std::string_view(v) == "0";
}

}  // namespace

TuningCache::TuningCache(fs::path dir) : dir_(std::move(dir)) {
  if (dir_.empty()) return;
  std::string why;
  if (!private_cache_dir(dir_, why)) dir_.clear();  // memory only: the folder is not ours alone
}

TuningCache& TuningCache::global() {
  static TuningCache cache = [] {
    const fs::path base = cubin_cache_dir();
    if (disabled_by_env() || base.empty()) return TuningCache(fs::path());
    // The kernel folder and tuning/ in it are both checked: a tuning/ that is a link elsewhere or
    // another user's folder leaves the cache in memory only.
    std::string why;
    fs::path dir;
    if (!util::private_subdir(base, "tuning", why, &dir)) return TuningCache(fs::path());
    return TuningCache(dir);
  }();
  return cache;
}

fs::path TuningCache::file(const std::string& scope) const {
  return dir_.empty() ? fs::path() : dir_ / (content_hash(scope).substr(0, 24) + ".tune");
}

std::map<std::string, std::string>& TuningCache::entries(const std::string& scope) {
  auto it = scopes_.find(scope);
  if (it != scopes_.end()) return it->second;
  std::map<std::string, std::string>& e = scopes_[scope];
  std::string text;
  if (dir_.empty() || !read_cache_file(file(scope), text, kMaxTuningFileBytes)) return e;
  std::size_t pos = text.find('\n');
  if (pos == std::string::npos || text.compare(0, pos, std::string(kHeader) + scope) != 0) {
    unreadable_.insert(scope);  // another scope's file under the same name, or damaged: ignored
    return e;
  }
  if (text.back() != '\n') cut_short_.insert(scope);
  while (pos < text.size()) {
    const std::size_t start = pos + 1, end = text.find('\n', start);
    if (end == std::string::npos) break;  // a last line without its newline was cut short
    const std::string line = text.substr(start, end - start);
    pos = end;
    const std::size_t t1 = line.find('\t'), t2 = line.rfind('\t');
    if (t1 == std::string::npos || t2 == t1) continue;
    std::string key = line.substr(0, t1), value = line.substr(t1 + 1, t2 - t1 - 1);
    if (line.substr(t2 + 1) != digest(key, value)) continue;
    e[std::move(key)] = std::move(value);
  }
  return e;
}

std::optional<std::string> TuningCache::find(const std::string& scope, const std::string& key) {
  check_text(scope, "scope");
  check_text(key, "key");
  std::lock_guard<std::mutex> lk(mu_);
  const auto& e = entries(scope);
  auto it = e.find(key);
  if (it == e.end()) return std::nullopt;
  return it->second;
}

void TuningCache::store(const std::string& scope, const std::string& key, const std::string& value) {
  check_text(scope, "scope");
  check_text(key, "key");
  check_text(value, "value");
  std::lock_guard<std::mutex> lk(mu_);
  auto& e = entries(scope);
  e[key] = value;
  if (dir_.empty()) return;
  const fs::path p = file(scope);
  std::error_code ec;
  if (unreadable_.count(scope)) {
    // A file this scope cannot read would hide every line appended to it: write it anew.
    std::string text = util::cat(kHeader, scope, "\n");
    for (const auto& [k, v] : e) text += util::cat(k, "\t", v, "\t", digest(k, v), "\n");
    if (util::write_file_atomic(p, text, 0600)) unreadable_.erase(scope);
    return;
  }
  std::string line = util::cat(key, "\t", value, "\t", digest(key, value), "\n");
  if (!fs::exists(p, ec)) line = util::cat(kHeader, scope, "\n", line);
  // After a last line cut short, start a line of our own (the cut one stays unreadable).
  if (cut_short_.count(scope)) line = "\n" + line;
  if (append(p, line)) cut_short_.erase(scope);
}

void TuningCache::clear() {
  std::lock_guard<std::mutex> lk(mu_);
  scopes_.clear();
  unreadable_.clear();
  cut_short_.clear();
  if (dir_.empty()) return;
  std::error_code ec;
  for (const auto& f : fs::directory_iterator(dir_, ec))
    if (f.path().extension() == ".tune") fs::remove(f.path(), ec);
}

}  // namespace kg::compile
