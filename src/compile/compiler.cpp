#include "compile/compiler.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>

#include "compile/embedded_sources.hpp"
#include "compile/nvrtc_loader.hpp"
#include "compile/ptx.hpp"
#include "kg/error.hpp"
#include "util/file.hpp"
#include "util/str.hpp"

namespace kg::compile {
namespace fs = std::filesystem;

std::string content_hash(const std::string& text) {
  std::uint64_t a = 0xcbf29ce484222325ull, b = 0x84222325cbf29ce4ull;
  for (unsigned char c : text) {
    a = (a ^ c) * 0x100000001b3ull;
    b = (b ^ static_cast<unsigned char>(c + 0x5b)) * 0x100000001b3ull;
  }
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(a),
                static_cast<unsigned long long>(b));
  return buf;
}

namespace {

std::uint64_t fnv1a64(const char* p, std::size_t n) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(p[i])) * 0x100000001b3ull;
  return h;
}

// "\n// kg-cache-seal v1 size=<20 digits> fnv1a64=<16 hex digits>\n": a fixed length, at the end.
constexpr const char* kSealHead = "\n// kg-cache-seal v1 size=";
constexpr const char* kSealMid = " fnv1a64=";
constexpr std::size_t kSealHeadLen = std::char_traits<char>::length(kSealHead),
                      kSealMidLen = std::char_traits<char>::length(kSealMid),
                      kSealLen = kSealHeadLen + 20 + kSealMidLen + 16 + 1;

}  // namespace

std::string seal_cache_file(const std::string& bytes) {
  char tail[kSealLen + 1];
  std::snprintf(tail, sizeof tail, "%s%020llu%s%016llx\n", kSealHead,
                static_cast<unsigned long long>(bytes.size()), kSealMid, static_cast<unsigned long long>(fnv1a64(bytes.data(), bytes.size())));
  return bytes + std::string(tail, kSealLen);
}

std::optional<std::string> unseal_cache_file(const std::string& file) {
  if (file.size() < kSealLen) return std::nullopt;
  const std::size_t n = file.size() - kSealLen;
  const char* t = file.data() + n;
  if (std::memcmp(t, kSealHead, kSealHeadLen) != 0 ||
      std::memcmp(t + kSealHeadLen + 20, kSealMid, kSealMidLen) != 0 || t[kSealLen - 1] != '\n')
    return std::nullopt;
  unsigned long long size = 0, hash = 0;
  for (std::size_t i = 0; i < 20; ++i) {
    const char c = t[kSealHeadLen + i];
    if (c < '0' || c > '9') return std::nullopt;
    size = size * 10 + static_cast<unsigned long long>(c - '0');
  }
  for (std::size_t i = 0; i < 16; ++i) {
    const char c = t[kSealHeadLen + 20 + kSealMidLen + i];
    const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return std::nullopt;
    hash = hash << 4 | static_cast<unsigned long long>(d);
  }
  if (size != n || hash != fnv1a64(file.data(), n)) return std::nullopt;
  return file.substr(0, n);
}

bool read_cache_file(const fs::path& p, std::string& out, std::uint64_t max_bytes) {
  // A FIFO or device planted in the folder is refused without blocking, a link is not followed,
  // and a file larger than any cache entry is not read at all.
  return util::try_read_file(p, {max_bytes, /*follow_links=*/false}, out);
}

bool private_cache_dir(const fs::path& dir, std::string& why) { return util::private_dir(dir, why); }

fs::path Compiler::default_cache_dir() {
  fs::path dir;
  if (const char* d = std::getenv("KG_CACHE_DIR"); d && *d) {
    dir = d;
  } else if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) {
    dir = fs::path(x) / "kernelgraph";
  } else if (const char* h = std::getenv("HOME"); h && *h) {
    dir = fs::path(h) / ".cache" / "kernelgraph";
  } else {
    // A folder every local user can reach: one per user.
    std::error_code ec;
    fs::path tmp = fs::temp_directory_path(ec);
    if (ec) tmp = "/tmp";
    dir = tmp / util::cat("kernelgraph-cache-", ::geteuid());
  }
  // Whichever folder it is, the CUDA emulator loads shared objects from it and the GPU runs what
  // is in it: it is used only when nobody else can write to it, before any file in it is opened.
  std::error_code ec;
  if (dir.has_parent_path() && !fs::exists(dir, ec)) fs::create_directories(dir.parent_path(), ec);
  std::string why;
  if (private_cache_dir(dir, why)) return dir;
  static std::atomic<bool> told{false};
  if (!told.exchange(true))
    std::cerr << "kernelgraph: not using the cache folder " << dir.string() << ": " << why
              << "; compiled kernels are not cached on disk\n";
  return {};
}

Compiler& Compiler::global() {
  static Compiler c(Compiler::default_cache_dir());
  return c;
}

Compiler::Compiler(fs::path cache_dir) : dir_(std::move(cache_dir)) {}

bool Compiler::available() {
#ifdef KG_HAVE_NVRTC
  return Nvrtc::get() != nullptr;
#else
  return false;
#endif
}

std::string Compiler::unavailable_reason() {
#ifdef KG_HAVE_NVRTC
  return available() ? std::string() : "NVRTC could not be loaded: " + Nvrtc::unavailable_reason();
#else
  return "this build has no NVRTC (configured without the CUDA toolkit)";
#endif
}

std::string Compiler::nvrtc_version() {
#ifdef KG_HAVE_NVRTC
  if (const Nvrtc* nv = Nvrtc::get()) return util::cat(nv->major, ".", nv->minor);
#endif
  return "none";
}

void Compiler::clear_memory_cache() {
  std::lock_guard<std::mutex> lk(mu_);
  memory_.clear();
}

CompileResult Compiler::compile(const std::string& name, const std::string& source, int arch,
                                const std::vector<std::string>& extra_options) {
  CompileResult r;
  if (looks_like_ptx(source)) {
    r.ptx = source;
    r.key = content_hash(source);
    r.was_ptx = true;
    return r;
  }
#ifdef KG_HAVE_NVRTC
  const Nvrtc& nv = Nvrtc::require(name);
#else
  throw Error("[" + name + "] " + unavailable_reason());
#endif
  std::vector<std::string> options = {util::cat("--gpu-architecture=compute_", arch), "--std=c++17",
                                      "--device-as-default-execution-space"};
  options.insert(options.end(), extra_options.begin(), extra_options.end());
  std::string key_text = util::cat("nvrtc ", nvrtc_version(), "\narch ", arch, "\n", util::join(options, " "), "\n");
  for (const auto& [hname, htext] : helper_headers()) key_text += util::cat("header ", hname, "\n", htext, "\n");
  key_text += source;
  r.key = content_hash(key_text);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (auto it = memory_.find(r.key); it != memory_.end()) {
      r.ptx = it->second;
      r.from_memory = true;
      return r;
    }
  }
  // The folder is checked before anything in it is read (it may have changed hands since the
  // compiler was made): a PTX planted by someone else is never served.
  std::string untrusted;
  const bool disk = !dir_.empty() && private_cache_dir(dir_, untrusted);
  const fs::path ptx_path = disk ? dir_ / (r.key + ".ptx") : fs::path();
  std::string cached;
  if (disk && read_cache_file(ptx_path, cached)) {
    if (auto ptx = unseal_cache_file(cached); ptx && looks_like_ptx(*ptx)) {
      r.ptx = std::move(*ptx);
      r.from_disk = true;
    } else {
      std::error_code ec;
      fs::remove(ptx_path, ec);  // cut short, damaged or from an older version: compiled again
    }
  }
  if (!r.from_disk) {
#ifdef KG_HAVE_NVRTC
    std::vector<const char*> hdr_src, hdr_names;
    for (const auto& [hname, htext] : helper_headers()) {
      hdr_names.push_back(hname.c_str());
      hdr_src.push_back(htext.c_str());
    }
    nvrtcProgram prog;
    const std::string file = name + ".cu";
    if (nv.nvrtcCreateProgram(&prog, source.c_str(), file.c_str(), static_cast<int>(hdr_src.size()),
                              hdr_src.data(), hdr_names.data()) != NVRTC_SUCCESS)
      throw Error("[" + name + "] NVRTC could not create a program");
    std::vector<const char*> opts;
    for (const auto& o : options) opts.push_back(o.c_str());
    nvrtcResult res = nv.nvrtcCompileProgram(prog, static_cast<int>(opts.size()), opts.data());
    std::size_t log_size = 0;
    nv.nvrtcGetProgramLogSize(prog, &log_size);
    std::string log(log_size, '\0');
    if (log_size) nv.nvrtcGetProgramLog(prog, log.data());
    if (res != NVRTC_SUCCESS) {
      nv.nvrtcDestroyProgram(&prog);
      throw Error(util::cat("[", name, "] NVRTC failed to compile ", file, " for sm_", arch, " (",
                            nv.nvrtcGetErrorString(res), "):\n", log));
    }
    std::size_t ptx_size = 0;
    nv.nvrtcGetPTXSize(prog, &ptx_size);
    r.ptx.assign(ptx_size, '\0');
    nv.nvrtcGetPTX(prog, r.ptx.data());
    nv.nvrtcDestroyProgram(&prog);
    while (!r.ptx.empty() && r.ptx.back() == '\0') r.ptx.pop_back();
    if (disk) {
      util::write_file_atomic(dir_ / (r.key + ".cu"), source, 0600);
      util::write_file_atomic(ptx_path, seal_cache_file(r.ptx), 0600);
    }
#endif
  }
  std::lock_guard<std::mutex> lk(mu_);
  memory_.emplace(r.key, r.ptx);
  return r;
}

// ---------------------------------------------------------------------------------------------
// CUBIN cache

namespace {

bool is_hex(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(),
                                   [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

std::mutex cubin_dir_mu;
std::optional<fs::path> cubin_dir_override;

std::atomic<long> load_counts[4];

}  // namespace

CubinCache::CubinCache(fs::path dir) : dir_(std::move(dir)) {}

std::string CubinCache::key(const std::string& ptx_hash, int arch, int driver_version) {
  // The key is a file name: anything but a content hash is hashed first.
  const std::string h = is_hex(ptx_hash) && ptx_hash.size() <= 64 ? ptx_hash : content_hash(ptx_hash);
  return util::cat(h, ".sm_", arch, ".drv", driver_version);
}

bool CubinCache::usable(std::string* why) const {
  std::string reason;
  bool ok = false;
  if (dir_.empty()) {
    reason = "there is no cache folder";
  } else {
    std::error_code ec;
    if (dir_.has_parent_path()) fs::create_directories(dir_.parent_path(), ec);
    ok = private_cache_dir(dir_, reason);
  }
  if (why) *why = reason;
  return ok;
}

fs::path CubinCache::path(const std::string& key) const { return dir_ / (key + ".cubin"); }

std::optional<std::string> CubinCache::read(const std::string& key) const {
  if (!usable()) return std::nullopt;
  const fs::path p = path(key);
  std::string file;
  if (!read_cache_file(p, file)) return std::nullopt;
  auto bytes = unseal_cache_file(file);
  if (!bytes || bytes->compare(0, 4, "\177ELF") != 0) {
    // Cut short, damaged, from an older version or not machine code: built again.
    std::error_code ec;
    fs::remove(p, ec);
    count_module_load(ModuleLoad::dropped_cubin);
    return std::nullopt;
  }
  return bytes;
}

bool CubinCache::store(const std::string& key, const std::string& cubin) const {
  return usable() && util::write_file_atomic(path(key), seal_cache_file(cubin));
}

void CubinCache::drop(const std::string& key) const {
  if (dir_.empty()) return;
  std::error_code ec;
  fs::remove(path(key), ec);
}

fs::path cubin_cache_dir() {
  {
    std::lock_guard<std::mutex> lk(cubin_dir_mu);
    if (cubin_dir_override) return *cubin_dir_override;
  }
  return Compiler::global().cache_dir();
}

void set_cubin_cache_dir(std::optional<fs::path> dir) {
  std::lock_guard<std::mutex> lk(cubin_dir_mu);
  cubin_dir_override = std::move(dir);
}

void count_module_load(ModuleLoad what) {
  load_counts[static_cast<int>(what)].fetch_add(1, std::memory_order_relaxed);
}

ModuleLoadCounts module_load_counts() {
  ModuleLoadCounts c;
  c.cached_cubin = load_counts[static_cast<int>(ModuleLoad::cached_cubin)].load();
  c.built_cubin = load_counts[static_cast<int>(ModuleLoad::built_cubin)].load();
  c.ptx_jit = load_counts[static_cast<int>(ModuleLoad::ptx_jit)].load();
  c.dropped_cubin = load_counts[static_cast<int>(ModuleLoad::dropped_cubin)].load();
  return c;
}

}  // namespace kg::compile
