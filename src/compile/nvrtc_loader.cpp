#ifdef KG_HAVE_NVRTC
#include "compile/nvrtc_loader.hpp"

#include <cuda.h>  // CUDA_VERSION of the toolkit whose nvrtc.h this is compiled with
#include <dlfcn.h>
#include <link.h>

#include <cstdlib>
#include <filesystem>
#include <vector>

#include "kg/error.hpp"
#include "util/str.hpp"

// The folder holding libnvrtc when the library was configured (set by CMake; may be empty).
#ifndef KG_NVRTC_HINT_DIR
#define KG_NVRTC_HINT_DIR ""
#endif

namespace kg::compile {
namespace fs = std::filesystem;
namespace {

struct Loaded {
  Nvrtc nvrtc;
  bool ok = false;
  std::string reason;
};

std::vector<std::string> library_names() {
  return {util::cat("libnvrtc.so.", CUDA_VERSION / 1000), "libnvrtc.so"};
}

std::vector<fs::path> search_dirs() {
  std::vector<fs::path> dirs;
  auto add = [&](const fs::path& d) {
    if (d.empty()) return;
    for (const fs::path& have : dirs)
      if (have == d) return;
    dirs.push_back(d);
  };
  for (const char* var : {"CUDA_PATH", "CUDA_HOME"}) {
    if (const char* root = std::getenv(var); root && *root) {
      add(fs::path(root) / "lib64");
      add(fs::path(root) / "lib");
    }
  }
  add(KG_NVRTC_HINT_DIR);
  add("/usr/local/cuda/lib64");
  return dirs;
}

// NVRTC opens libnvrtc-builtins by its soname on its first compile, a search that ignores the
// folder libnvrtc came from. Loading the builtins from that folder first makes the later open
// find them already loaded.
void preload_builtins(const Nvrtc& nv) {
  const fs::path dir = fs::path(nv.path).parent_path();
  for (const std::string& name :
       {util::cat("libnvrtc-builtins.so.", nv.major, ".", nv.minor),
        util::cat("libnvrtc-builtins.so.", nv.major), std::string("libnvrtc-builtins.so")}) {
    std::error_code ec;
    if (fs::exists(dir / name, ec) && ::dlopen((dir / name).c_str(), RTLD_NOW | RTLD_GLOBAL)) return;
  }
}

Loaded load() {
  Loaded l;
  std::string detail;  // the first failure that is not a missing file
  std::string opened;
  auto try_open = [&](const std::string& file) {
    ::dlerror();
    void* h = ::dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h) {
      opened = file;
    } else {
      const char* e = ::dlerror();
      const std::string msg = e ? e : file + ": dlopen failed";
      if (detail.empty() && msg.find("No such file") == std::string::npos) detail = msg;
    }
    return h;
  };
  void* lib = nullptr;
  if (const char* over = std::getenv("KG_NVRTC_LIBRARY"); over && *over) {
    lib = try_open(over);
    if (!lib) {
      l.reason = util::cat("$KG_NVRTC_LIBRARY (", over, ") could not be opened",
                           detail.empty() ? std::string(": no such file") : ": " + detail);
      return l;
    }
  } else {
    const std::vector<std::string> names = library_names();
    const std::vector<fs::path> dirs = search_dirs();
    for (const std::string& n : names)
      if (!lib) lib = try_open(n);
    for (const fs::path& d : dirs) {
      for (const std::string& n : names) {
        std::error_code ec;
        if (!lib && fs::exists(d / n, ec)) lib = try_open((d / n).string());
      }
    }
    if (!lib) {
      std::vector<std::string> where;
      for (const fs::path& d : dirs) where.push_back(d.string());
      l.reason = util::cat("looked for ", util::join(names, " and "),
                           " on the library search path (LD_LIBRARY_PATH, ld.so.cache) and in ",
                           util::join(where, ", "), detail.empty() ? std::string() : " (" + detail + ")",
                           "; set CUDA_PATH to the CUDA toolkit, or KG_NVRTC_LIBRARY to the library file");
      return l;
    }
  }
  const char* missing = nullptr;
#define KG_RESOLVE(name)                                                        \
  l.nvrtc.name = reinterpret_cast<decltype(l.nvrtc.name)>(::dlsym(lib, #name)); \
  if (!l.nvrtc.name && !missing) missing = #name;
  KG_NVRTC_FUNCTIONS(KG_RESOLVE)
#undef KG_RESOLVE
  link_map* map = nullptr;
  l.nvrtc.path =
      ::dlinfo(lib, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && *map->l_name ? map->l_name : opened;
  if (missing) {
    l.reason =
        util::cat(l.nvrtc.path, " has no ", missing, " (is it NVRTC ", CUDA_VERSION / 1000, " or newer?)");
    return l;
  }
  if (l.nvrtc.nvrtcVersion(&l.nvrtc.major, &l.nvrtc.minor) != NVRTC_SUCCESS) {
    l.reason = l.nvrtc.path + ": nvrtcVersion failed";
    return l;
  }
  preload_builtins(l.nvrtc);
  l.ok = true;
  return l;
}

const Loaded& loaded() {
  static const Loaded l = load();
  return l;
}

}  // namespace

const Nvrtc* Nvrtc::get() { return loaded().ok ? &loaded().nvrtc : nullptr; }

const std::string& Nvrtc::unavailable_reason() { return loaded().reason; }

const Nvrtc& Nvrtc::require(const std::string& what) {
  if (const Nvrtc* n = get()) return *n;
  throw Error(util::cat(what.empty() ? std::string() : "[" + what + "] ",
                        "NVRTC could not be loaded: ", unavailable_reason()));
}

}  // namespace kg::compile

#endif  // KG_HAVE_NVRTC
