#include "compile/compiler.hpp"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>

#include "compile/embedded_sources.hpp"
#include "compile/nvrtc_loader.hpp"
#include "compile/ptx.hpp"
#include "kg/error.hpp"
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

fs::path default_cache_dir() {
  if (const char* d = std::getenv("KG_CACHE_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return fs::path(x) / "kernelgraph";
  if (const char* h = std::getenv("HOME"); h && *h) return fs::path(h) / ".cache" / "kernelgraph";
  return fs::temp_directory_path() / "kernelgraph-cache";
}

bool read_file(const fs::path& p, std::string& out) {
  std::ifstream f(p, std::ios::binary);
  if (!f) return false;
  std::ostringstream ss;
  ss << f.rdbuf();
  out = ss.str();
  return true;
}

// Writes through a temporary file and rename, so a concurrent reader never sees a torn file.
// (Unused in a build without NVRTC.)
[[maybe_unused]] void write_atomic(const fs::path& p, const std::string& text) {
  fs::path tmp = p;
  tmp += util::cat(".tmp.", ::getpid(), ".", std::hash<std::string>{}(text) & 0xffff);
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return;  // an unwritable cache only costs time
    f << text;
    if (!f.good()) {
      std::error_code ec;
      fs::remove(tmp, ec);
      return;
    }
  }
  std::error_code ec;
  fs::rename(tmp, p, ec);
  if (ec) fs::remove(tmp, ec);
}

}  // namespace

Compiler& Compiler::global() {
  static Compiler c(default_cache_dir());
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
  const fs::path ptx_path = dir_ / (r.key + ".ptx");
  if (read_file(ptx_path, r.ptx) && looks_like_ptx(r.ptx)) {
    r.from_disk = true;
  } else {
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
    std::error_code ec;
    fs::create_directories(dir_, ec);
    write_atomic(dir_ / (r.key + ".cu"), source);
    write_atomic(ptx_path, r.ptx);
#endif
  }
  std::lock_guard<std::mutex> lk(mu_);
  memory_.emplace(r.key, r.ptx);
  return r;
}

}  // namespace kg::compile
