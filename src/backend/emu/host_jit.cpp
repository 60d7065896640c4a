#include "backend/emu/host_jit.hpp"

#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <regex>
#include <sstream>

#include "backend/emu/emu_runtime.hpp"
#include "compile/compiler.hpp"
#include "compile/embedded_sources.hpp"
#include "compile/ptx.hpp"
#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::emu {
namespace fs = std::filesystem;

namespace {

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Woverlength-strings"
const char kEmulationHeader[] =
#include "backend/emu/cuda_emu.hpp"
    ;
#pragma GCC diagnostic pop

// Bump when the generated code or the flags change meaning, so old cached objects are not used.
constexpr const char* kJitVersion = "kg-emu-jit 1";
constexpr const char* kFlags =
    "-O2 -std=c++17 -shared -fPIC -fvisibility=hidden -fno-strict-aliasing -fno-math-errno "
    "-fstack-clash-protection -w";

const std::string& abi_header() {
  static const std::string text = util::cat("#pragma once\n#define KG_EMU_ABI_VERSION ", KG_EMU_ABI_VERSION,
                                            "\n", KG_EMU_ABI(KG_EMU_ABI_TEXT), "\n");
  return text;
}

bool is_ident(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// The source with comments replaced by spaces (newlines kept), so that positions still match.
std::string blank_comments(const std::string& s) {
  std::string out = s;
  std::size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (c == '"' || c == '\'') {
      const char q = c;
      ++i;
      while (i < s.size() && s[i] != q && s[i] != '\n') i += s[i] == '\\' ? 2 : 1;
      ++i;
    } else if (c == '/' && i + 1 < s.size() && s[i + 1] == '/') {
      while (i < s.size() && s[i] != '\n') out[i++] = ' ';
    } else if (c == '/' && i + 1 < s.size() && s[i + 1] == '*') {
      const std::size_t end = s.find("*/", i + 2);
      const std::size_t stop = end == std::string::npos ? s.size() : end + 2;
      for (; i < stop; ++i)
        if (out[i] != '\n') out[i] = ' ';
    } else {
      ++i;
    }
  }
  return out;
}

std::string trim(const std::string& s) {
  const std::size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

// Whitespace runs as one space, none before '*' or '&': "const float *" → "const float*".
std::string squeeze_spaces(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (std::isspace(static_cast<unsigned char>(c))) {
      if (!out.empty() && out.back() != ' ') out += ' ';
      continue;
    }
    if ((c == '*' || c == '&') && !out.empty() && out.back() == ' ') out.pop_back();
    out += c;
  }
  if (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

// The text of the balanced group opening at s[open] ('(' or '<'), without the brackets; `end` gets
// the position after the closing bracket.
std::string balanced(const std::string& s, std::size_t open, std::size_t& end) {
  int depth = 0;
  for (std::size_t i = open; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '(' || c == '[' || c == '{') ++depth;
    if (c == ')' || c == ']' || c == '}') {
      if (--depth == 0) {
        end = i + 1;
        return s.substr(open + 1, i - open - 1);
      }
    }
  }
  end = s.size();
  return s.substr(open + 1);
}

// Splits at commas outside (), [], {} and <>.
std::vector<std::string> split_top(const std::string& s) {
  std::vector<std::string> parts;
  std::string cur;
  int depth = 0;
  for (char c : s) {
    if (c == '(' || c == '[' || c == '{' || c == '<') ++depth;
    if (c == ')' || c == ']' || c == '}' || c == '>') --depth;
    if (c == ',' && depth == 0) {
      parts.push_back(cur);
      cur.clear();
      continue;
    }
    cur += c;
  }
  if (!trim(cur).empty()) parts.push_back(cur);
  return parts;
}

// True when position `at` lies inside an `extern "C" { ... }` block.
bool inside_extern_c_block(const std::string& s, std::size_t at) {
  std::vector<std::size_t> open;
  for (std::size_t i = 0; i < at; ++i) {
    if (s[i] == '"' || s[i] == '\'') {
      const char q = s[i++];
      while (i < at && s[i] != q && s[i] != '\n') i += s[i] == '\\' ? 2 : 1;
      continue;
    }
    if (s[i] == '{') open.push_back(i);
    if (s[i] == '}' && !open.empty()) open.pop_back();
  }
  for (std::size_t o : open) {
    const std::string before = trim(s.substr(o >= 40 ? o - 40 : 0, o >= 40 ? 40 : o));
    if (before.size() >= 10 && before.compare(before.size() - 10, 10, "extern \"C\"") == 0) return true;
  }
  return false;
}

int brace_depth(const std::string& s, std::size_t at) {
  int depth = 0;
  for (std::size_t i = 0; i < at; ++i) {
    if (s[i] == '"' || s[i] == '\'') {
      const char q = s[i++];
      while (i < at && s[i] != q && s[i] != '\n') i += s[i] == '\\' ? 2 : 1;
      continue;
    }
    if (s[i] == '{') ++depth;
    if (s[i] == '}') --depth;
  }
  return depth;
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs a shell command; returns its exit status and puts stdout and stderr in `output`.
int run_command(const std::string& cmd, std::string& output) {
  FILE* f = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!f) return -1;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) output.append(buf, n);
  const int status = ::pclose(f);
  if (status == -1 || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

std::string temp_suffix() {
  static std::atomic<unsigned> counter{0};
  return util::cat(".tmp.", ::getpid(), ".", counter++);
}

// Writes through a temporary file and a rename, so that a concurrent reader never sees a torn file.
bool write_atomic(const fs::path& p, const std::string& text) {
  fs::path tmp = p;
  tmp += temp_suffix();
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return false;
    f << text;
    if (!f.good()) {
      std::error_code ec;
      fs::remove(tmp, ec);
      return false;
    }
  }
  std::error_code ec;
  fs::rename(tmp, p, ec);
  if (ec) fs::remove(tmp, ec);
  return !ec;
}

bool read_text(const fs::path& p, std::string& out) {
  std::ifstream f(p, std::ios::binary);
  if (!f) return false;
  std::ostringstream ss;
  ss << f.rdbuf();
  out = ss.str();
  return true;
}

// The helper headers as the module sees them (dynamic shared arrays rewritten).
const std::vector<std::pair<std::string, std::string>>& emu_helper_headers() {
  static const std::vector<std::pair<std::string, std::string>> headers = [] {
    std::vector<std::pair<std::string, std::string>> h;
    for (const auto& [name, text] : compile::helper_headers())
      h.emplace_back(name, rewrite_dynamic_shared(text));
    // Kernels that include the toolkit's half-precision headers find the types in kg_cuda_emu.h.
    h.emplace_back("cuda_fp16.h", "#pragma once\n");
    h.emplace_back("cuda_bf16.h", "#pragma once\n");
    return h;
  }();
  return headers;
}

std::string escape_line_name(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

// The translation unit: the emulation header, the source, then one trampoline per kernel.
std::string translation_unit(const std::string& name, const std::string& source,
                             const std::vector<KernelSignature>& kernels) {
  std::ostringstream tu;
  const bool has_ext = name.size() > 3 && name.compare(name.size() - 3, 3, ".cu") == 0;
  tu << "#include \"kg_cuda_emu.h\"\n#line 1 \"" << escape_line_name(name) << (has_ext ? "" : ".cu") << "\"\n"
     << rewrite_dynamic_shared(source) << "\n\n// ---- generated by the host JIT ----\n"
     << "KG_EMU_EXPORT int kg_emu_bind(const KgEmuApi* api) { kg_emu_api_ = api; return KG_EMU_ABI_VERSION; "
        "}\n";
  for (const auto& k : kernels) {
    const std::string& e = k.name;
    tu << "KG_EMU_EXPORT void kg_emu_call_" << e << "(const KgEmuThreadInfo* t, void** a) { kg_emu_enter(t); "
       << "kg_emu_invoke(&" << e << ", a); }\n"
       << "KG_EMU_EXPORT int kg_emu_params_" << e << "(KgEmuParam* out, int cap) { return kg_emu_describe(&"
       << e << ", out, cap); }\n"
       << "KG_EMU_EXPORT int kg_emu_max_threads_" << e << "(void) { return (int)("
       << (k.launch_bounds.empty() ? "0" : k.launch_bounds) << "); }\n";
  }
  return tu.str();
}

template <class F>
F symbol(void* handle, const std::string& name) {
  return reinterpret_cast<F>(::dlsym(handle, name.c_str()));
}

}  // namespace

const std::string& emulation_header() {
  static const std::string text = kEmulationHeader;
  return text;
}

std::vector<KernelSignature> find_kernels(const std::string& source) {
  const std::string s = blank_comments(source);
  std::vector<KernelSignature> out;
  const std::string kw = "__global__";
  for (std::size_t at = s.find(kw); at != std::string::npos; at = s.find(kw, at + kw.size())) {
    if ((at > 0 && is_ident(s[at - 1])) || (at + kw.size() < s.size() && is_ident(s[at + kw.size()])))
      continue;
    // The declaration back to the previous ';', '{' or '}', without preprocessor lines.
    const std::size_t prev = s.find_last_of(";{}", at == 0 ? 0 : at - 1);
    const std::size_t decl_start = prev == std::string::npos || at == 0 ? 0 : prev + 1;
    std::string decl;
    {
      std::istringstream lines(s.substr(decl_start, at - decl_start));
      for (std::string line; std::getline(lines, line);)
        if (trim(line).rfind('#', 0) != 0) decl += line + "\n";
    }
    if (std::regex_search(decl, std::regex("\\btemplate\\b"))) continue;
    KernelSignature k;
    k.extern_c = decl.find("extern \"C\"") != std::string::npos || inside_extern_c_block(s, at);
    // Past the return type and attributes to the name.
    std::size_t i = at + kw.size();
    std::string name;
    while (i < s.size()) {
      while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
      if (i >= s.size() || !is_ident(s[i])) break;
      std::size_t j = i;
      while (j < s.size() && is_ident(s[j])) ++j;
      const std::string word = s.substr(i, j - i);
      std::size_t k2 = j;
      while (k2 < s.size() && std::isspace(static_cast<unsigned char>(s[k2]))) ++k2;
      if (k2 < s.size() && s[k2] == '(') {
        std::size_t end = 0;
        const std::string inner = balanced(s, k2, end);
        if (word == "__launch_bounds__") {
          const auto args = split_top(inner);
          if (!args.empty()) k.launch_bounds = trim(args[0]);
          i = end;
          continue;
        }
        if (word == "__attribute__" || word == "alignas" || word == "__declspec" || word == "__align__") {
          i = end;
          continue;
        }
        name = word;
        i = k2;
        break;
      }
      i = j;
    }
    if (name.empty()) continue;
    if (const auto lb = decl.find("__launch_bounds__"); k.launch_bounds.empty() && lb != std::string::npos) {
      const auto open = decl.find('(', lb);  // __launch_bounds__ written before __global__
      std::size_t lb_end = 0;
      if (open != std::string::npos) {
        const auto lb_args = split_top(balanced(decl, open, lb_end));
        if (!lb_args.empty()) k.launch_bounds = trim(lb_args[0]);
      }
    }
    std::size_t end = 0;
    const std::string params = balanced(s, i, end);
    bool seen = false;
    for (const auto& o : out) seen = seen || o.name == name;
    if (seen) continue;
    k.name = name;
    for (std::string p : split_top(params)) {
      if (auto eq = p.find('='); eq != std::string::npos) p = p.substr(0, eq);
      p = trim(p);
      if (p.empty() || p == "void") continue;
      std::size_t e = p.size();
      std::size_t b = e;
      while (b > 0 && is_ident(p[b - 1])) --b;
      std::string pname = p.substr(b, e - b), ptype = trim(p.substr(0, b));
      if (ptype.empty()) std::swap(pname, ptype);  // an unnamed parameter: only a type
      ptype = std::regex_replace(ptype, std::regex("\\b(__restrict__|__restrict|__grid_constant__)\\b"), " ");
      k.param_names.push_back(pname);
      k.param_types.push_back(squeeze_spaces(ptype));
    }
    out.push_back(std::move(k));
  }
  return out;
}

std::string rewrite_dynamic_shared(const std::string& source) {
  const std::string s = blank_comments(source);
  static const std::regex decl_re("\\bextern\\s+__shared__\\b");
  static const std::regex attr_re("(__align__|alignas)\\s*\\([^)]*\\)|__attribute__\\s*\\(\\([^)]*\\)\\)");
  static const std::regex tail_re("^([\\s\\S]*?)\\b([A-Za-z_]\\w*)\\s*\\[\\s*\\]\\s*$");
  std::string out;
  std::size_t copied = 0;
  for (auto it = std::sregex_iterator(s.begin(), s.end(), decl_re); it != std::sregex_iterator(); ++it) {
    const auto at = static_cast<std::size_t>(it->position(0));
    const std::size_t semi = s.find(';', at);
    if (semi == std::string::npos || at < copied) continue;
    const std::size_t body = at + static_cast<std::size_t>(it->length(0));
    const std::string decl = std::regex_replace(s.substr(body, semi - body), attr_re, " ");
    std::smatch m;
    if (!std::regex_match(decl, m, tail_re)) continue;  // left for the compiler to report
    const std::string type = squeeze_spaces(m[1].str()), name = m[2].str();
    out += source.substr(copied, at - copied);
    const int lines = static_cast<int>(std::count(s.begin() + static_cast<std::ptrdiff_t>(at),
                                                  s.begin() + static_cast<std::ptrdiff_t>(semi), '\n'));
    if (brace_depth(s, at) > 0) {
      out += util::cat(type, "* const ", name, " = reinterpret_cast<", type, "*>(kg_emu_dynamic_shared());");
      out += std::string(static_cast<std::size_t>(lines), '\n');
    } else {
      // At namespace scope the name must stay valid in every function: a macro.
      const int line =
          1 + static_cast<int>(std::count(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(semi), '\n'));
      out += util::cat("\n#undef ", name, "\n#define ", name, " (reinterpret_cast<", type,
                       "*>(kg_emu_dynamic_shared()))\n#line ", line, "\n");
    }
    copied = semi + 1;
  }
  out += source.substr(copied);
  return out;
}

const KernelEntry& JitModule::find(const std::string& entry, const std::string& label) const {
  std::vector<std::string> names;
  for (const auto& e : entries) names.push_back(e.entry);
  if (entry.empty()) {
    if (entries.size() == 1) return entries[0];
    throw Error(util::cat(label, " no entry point was named and the source has ", entries.size(),
                          " __global__ functions (", names.empty() ? "none" : util::join(names, ", "),
                          "); name one in Lowered::entry_point"));
  }
  for (const auto& e : entries)
    if (e.entry == entry) return e;
  throw Error(util::cat(label, " entry point '", entry,
                        "' is not a __global__ function of the source (it has: ",
                        names.empty() ? "none" : util::join(names, ", "), ")"));
}

HostJit& HostJit::global() {
  static HostJit jit(compile::Compiler::global().cache_dir() / "emu");
  return jit;
}

HostJit::HostJit(fs::path dir) : dir_(std::move(dir)) {}

std::string HostJit::compiler() {
  if (const char* c = std::getenv("KG_EMU_CXX"); c && *c) return c;
  return "g++";
}

HostJit::Stats HostJit::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

fs::path HostJit::include_dir() {
  if (!include_dir_.empty()) return include_dir_;
  std::string all = abi_header() + emulation_header();
  for (const auto& [n, t] : emu_helper_headers()) all += util::cat("\n// ", n, "\n", t);
  const fs::path inc = dir_ / ("include-" + compile::content_hash(all));
  std::error_code ec;
  fs::create_directories(inc, ec);
  if (ec)
    throw Error(
        util::cat("CUDA emulation: cannot create the cache folder ", inc.string(), ": ", ec.message()));
  auto put = [&](const std::string& n, const std::string& text) {
    std::string have;
    if (read_text(inc / n, have) && have == text) return;
    if (!write_atomic(inc / n, text))
      throw Error(util::cat("CUDA emulation: cannot write ", (inc / n).string()));
  };
  put("kg_emu_abi.h", abi_header());
  put("kg_cuda_emu.h", emulation_header());
  for (const auto& [n, t] : emu_helper_headers()) put(n, t);
  include_dir_ = inc.string();
  return inc;
}

std::shared_ptr<const JitModule> HostJit::load(const std::string& name, const std::string& source) {
  if (compile::looks_like_ptx(source))
    throw Error(util::cat("[", name, "] the kernel source is PTX; CUDA emulation needs the CUDA C++ source"));
  const auto kernels = find_kernels(source);
  const std::string tu = translation_unit(name, source, kernels);
  std::lock_guard<std::mutex> lk(mu_);
  const std::string cxx = compiler();
  if (compiler_id_.empty()) {
    std::string out;
    if (run_command(cxx + " -dumpfullversion -dumpmachine", out) != 0)
      throw Error(util::cat("[", name, "] CUDA emulation needs a host C++ compiler, and '", cxx,
                            "' could not be run (set KG_EMU_CXX): ", trim(out)));
    compiler_id_ = trim(out);
  }
  const fs::path inc = include_dir();
  const std::string key = compile::content_hash(util::cat(kJitVersion, "\n", cxx, " ", compiler_id_, "\n",
                                                          kFlags, "\n", inc.filename().string(), "\n", tu));
  if (auto it = modules_.find(key); it != modules_.end()) {
    ++stats_.memory_hits;
    return it->second;
  }
  auto mod = std::make_shared<JitModule>();
  mod->name = name;
  mod->key = key;
  mod->path = dir_ / (key + ".so");
  void* handle = nullptr;
  std::error_code ec;
  if (fs::exists(mod->path, ec)) {
    handle = ::dlopen(mod->path.c_str(), RTLD_NOW | RTLD_LOCAL);
    mod->from_disk = handle != nullptr;
  }
  if (!handle) {
    const std::string suffix = temp_suffix();
    const fs::path cpp = dir_ / (key + suffix + ".cpp"), so = dir_ / (key + suffix + ".so");
    if (!write_atomic(cpp, tu))
      throw Error(util::cat("[", name, "] CUDA emulation: cannot write ", cpp.string()));
    const std::string cmd = util::cat(cxx, " ", kFlags, " -I", shell_quote(inc.string()), " -o ",
                                      shell_quote(so.string()), " ", shell_quote(cpp.string()));
    const auto t0 = std::chrono::steady_clock::now();
    std::string log;
    const int rc = run_command(cmd, log);
    mod->compile_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rc != 0) {
      fs::remove(cpp, ec);
      fs::remove(so, ec);
      throw Error(util::cat("[", name,
                            "] the host compiler failed to build the kernel source for CUDA emulation (", cmd,
                            "):\n", log));
    }
    fs::rename(cpp, dir_ / (key + ".cpp"), ec);
    fs::rename(so, mod->path, ec);
    if (ec)
      throw Error(util::cat("[", name, "] CUDA emulation: cannot move ", so.string(), ": ", ec.message()));
    handle = ::dlopen(mod->path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) throw Error(util::cat("[", name, "] CUDA emulation: dlopen failed: ", ::dlerror()));
    ++stats_.compiled;
    stats_.compile_seconds += mod->compile_seconds;
  } else {
    ++stats_.disk_hits;
  }
  // The module stays loaded for the life of the process: its thread-locals back the shared
  // memory of blocks that may still be cached by worker threads.
  auto bind = symbol<int (*)(const KgEmuApi*)>(handle, "kg_emu_bind");
  if (!bind)
    throw Error(util::cat("[", name, "] CUDA emulation: ", mod->path.string(), " has no kg_emu_bind"));
  if (const int v = bind(runtime_api()); v != KG_EMU_ABI_VERSION)
    throw Error(util::cat("[", name, "] CUDA emulation: ", mod->path.string(), " was built for ABI ", v,
                          ", not ", KG_EMU_ABI_VERSION));
  for (const auto& k : kernels) {
    KernelEntry e;
    e.module_name = name;
    e.entry = k.name;
    e.run = symbol<void (*)(const KgEmuThreadInfo*, void**)>(handle, "kg_emu_call_" + k.name);
    auto params = symbol<int (*)(KgEmuParam*, int)>(handle, "kg_emu_params_" + k.name);
    auto max_threads = symbol<int (*)()>(handle, "kg_emu_max_threads_" + k.name);
    if (!e.run || !params || !max_threads)
      throw Error(util::cat("[", name, "] CUDA emulation: the trampolines of '", k.name,
                            "' are missing from ", mod->path.string()));
    const int n = params(nullptr, 0);
    std::vector<KgEmuParam> info(static_cast<std::size_t>(n));
    params(info.data(), n);
    const bool named = k.param_names.size() == info.size();
    for (std::size_t i = 0; i < info.size(); ++i)
      e.params.push_back({info[i], named ? k.param_names[i] : "", named ? k.param_types[i] : ""});
    e.max_threads = max_threads();
    mod->entries.push_back(std::move(e));
  }
  modules_.emplace(key, mod);
  return mod;
}

}  // namespace kg::emu
