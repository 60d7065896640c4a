// The bodies of the fuzz targets (docs/hardening.md): each fuzz_<name>() hands untrusted bytes to
// one reader and returns 0. A kg::Error is the reader refusing the input, which is what it should
// do; any other exception escapes (libFuzzer reports it as a crash, the regression test as a
// failure), and so does a crash or a sanitizer report. fuzz/<name>.cpp wraps one of these in
// LLVMFuzzerTestOneInput; tests/fuzz/test_fuzz_regressions.cpp replays fuzz/regressions/<name>/
// through the same functions in the ordinary build.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "../tools/kgraph/model_source.hpp"  // parse_dim (--dim)
#include "../tools/kgraph/validators.hpp"    // the kgraph flag validators
#include "compile/cuda_source.hpp"
#include "compile/ptx.hpp"
#include "compile/tuning_cache.hpp"
#ifdef KG_HAVE_CUDA
#include "backend/cuda/cudnn_api.hpp"  // parse_kept_number
#endif
#include "kg/data.hpp"
#include "kg/dtype.hpp"
#include "kg/error.hpp"
#include "kg/io.hpp"
#include "kg/model.hpp"
#include "kg/models.hpp"
#include "kg/onnx.hpp"

namespace kg::fuzz {

// A folder of this process's own under the temporary folder, removed at exit: the readers that
// take a path get the bytes written to a file in it.
inline const std::filesystem::path& scratch_dir() {
  struct Dir {
    std::filesystem::path path;
    Dir() {
      std::string tmpl = (std::filesystem::temp_directory_path() / "kg-fuzz-XXXXXX").string();
      if (!mkdtemp(tmpl.data())) throw std::runtime_error("kg fuzz: cannot create a folder from " + tmpl);
      path = tmpl;
    }
    ~Dir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Dir dir;
  return dir.path;
}

// Writes the bytes to scratch_dir()/name and returns the path.
inline std::string write_input(const std::string& name, const std::uint8_t* data, std::size_t size) {
  const std::string path = (scratch_dir() / name).string();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  f.close();
  if (!f) throw std::runtime_error("kg fuzz: cannot write " + path);
  return path;
}

inline std::string as_string(const std::uint8_t* data, std::size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

// ---- safetensors: kg::read_safetensors of the bytes as a file ----
inline int fuzz_safetensors(const std::uint8_t* data, std::size_t size) {
  const std::string path = write_input("input.safetensors", data, size);
  try {
    std::map<std::string, std::string> metadata;
    const auto tensors = read_safetensors(path, &metadata);
    // Touch every byte the reader says a tensor has: a view past the mapping is an ASan report.
    volatile std::uint8_t sink = 0;
    for (const auto& [name, t] : tensors) {
      const auto* p = static_cast<const std::uint8_t*>(t.raw());
      for (std::size_t i = 0; i < t.nbytes(); ++i) sink = sink ^ p[i];
    }
  } catch (const Error&) {
  }
  return 0;
}

// ---- weights: load_weights and load_checkpoint of LeNet-5 (on the CPU) from the bytes ----
inline LoadedModel& fuzz_lenet5() {
  static LoadedModel model = [] {
    LoadOptions options;
    options.threads = 1;
    return models::build("lenet5", LoweringMode::Inference)
        .load(Device::cpu(), {models::input_shape("lenet5", 1)}, options);
  }();
  return model;
}

inline int fuzz_weights(const std::uint8_t* data, std::size_t size) {
  LoadedModel& model = fuzz_lenet5();
  const std::string path = write_input("weights.safetensors", data, size);
  try {
    model.load_weights(path);
  } catch (const Error&) {
  }
  try {
    model.load_checkpoint(path);
  } catch (const Error&) {
  }
  return 0;
}

// ---- IDX: kg::read_idx of the bytes as a file (plain or gzip, as the bytes say) ----
inline int fuzz_idx(const std::uint8_t* data, std::size_t size) {
  const std::string path = write_input("input.idx", data, size);
  try {
    const Tensor t = data::read_idx(path);
    volatile std::uint8_t sink = 0;
    const auto* p = static_cast<const std::uint8_t*>(t.raw());
    for (std::size_t i = 0; i < t.nbytes(); ++i) sink = sink ^ p[i];
  } catch (const Error&) {
  }
  return 0;
}

// ---- the tuning cache: a scope's file in the kernel cache folder, as a later load reads it.
// Every key a line names is looked up, then a new choice is stored and read back. ----
inline int fuzz_tuning_cache(const std::uint8_t* data, std::size_t size) {
  const std::filesystem::path dir = scratch_dir() / "tuning";
  const std::string scope = "fuzz sm_90 driver 13000 cudnn 91300";
  {
    compile::TuningCache probe(dir);  // creates the folder (0700)
    if (probe.dir().empty()) throw std::runtime_error("kg fuzz: the tuning folder is not private");
    std::ofstream f(probe.file(scope), std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  compile::TuningCache cache(dir);
  const std::string text = as_string(data, size);
  for (std::size_t at = 0; at < text.size();) {
    const std::size_t end = std::min(text.find_first_of("\t\n", at), text.size());
    const std::string key = text.substr(at, end - at);
    if (!key.empty() && key.find('\r') == std::string::npos && key.size() < 4096) {
      if (const auto v = cache.find(scope, key)) {
        volatile std::size_t sink = v->size();
        (void)sink;
#ifdef KG_HAVE_CUDA
        // What cuDNN's plans make of a kept value: a number of 1 to 3 digits or nothing.
        for (std::string_view prefix : {std::string_view(), std::string_view("graph ")})
          if (const auto n = cuda::parse_kept_number(v, prefix); n && (*n < 0 || *n > 999)) __builtin_trap();
#endif
      }
    }
    at = end + 1;
  }
  cache.store(scope, "conv fwd bf16 x1,3,224,224", "1");
  if (cache.find(scope, "conv fwd bf16 x1,3,224,224") != "1") __builtin_trap();
  compile::TuningCache again(dir);
  if (again.find(scope, "conv fwd bf16 x1,3,224,224") != "1") __builtin_trap();
  return 0;
}

// ---- PTX: the PTX readers of src/compile/ptx.hpp. The first line is an entry name for
// entry_matches and kernel_param_names, the rest the text. ----
inline int fuzz_ptx(const std::uint8_t* data, std::size_t size) {
  const std::string all = as_string(data, size);
  const std::size_t nl = all.find('\n');
  const std::string entry = nl == std::string::npos ? std::string() : all.substr(0, nl);
  const std::string text = nl == std::string::npos ? all : all.substr(nl + 1);
  try {
    (void)compile::looks_like_ptx(text);
    (void)compile::ptx_target(text);
    for (const auto& e : compile::parse_ptx_entries(text)) (void)compile::entry_matches(e.name, entry);
  } catch (const Error&) {
  }
  try {
    (void)compile::kernel_param_names(text, entry);
  } catch (const Error&) {
  }
  return 0;
}

// ---- CUDA source: find_kernels, classify_param_type and the text helpers of cuda_source.hpp ----
inline int fuzz_cuda_source(const std::uint8_t* data, std::size_t size) {
  const std::string source = as_string(data, size);
  try {
    for (const auto& k : compile::find_kernels(source))
      for (const auto& type : k.param_types) (void)compile::classify_param_type(type);
  } catch (const Error&) {
  }
  try {
    namespace text = compile::text;
    const std::string blanked = text::blank_comments(source);
    if (blanked.size() != source.size())
      throw std::logic_error("blank_comments changed the length of the text");
    (void)text::squeeze_spaces(text::trim(blanked));
    (void)text::split_top(blanked);
    // The helpers at the first few brackets (each is linear in the text).
    int seen = 0;
    for (std::size_t i = 0; i < blanked.size() && seen < 8; ++i) {
      if (blanked[i] != '(' && blanked[i] != '{') continue;
      ++seen;
      std::size_t end = 0;
      (void)text::balanced(blanked, i, end);
      if (end <= i || end > blanked.size())
        throw std::logic_error("balanced() returned an end outside the text");
      (void)text::inside_extern_c_block(blanked, i);
      (void)text::brace_depth(blanked, i);
    }
  } catch (const Error&) {
  }
  return 0;
}

// ---- ONNX: kg::onnx::import_bytes (external data is looked for in an empty folder) ----
inline int fuzz_onnx(const std::uint8_t* data, std::size_t size) {
  static const std::string base = [] {
    const auto dir = scratch_dir() / "onnx-base";
    std::filesystem::create_directories(dir);
    return dir.string();
  }();
  try {
    const Model m = onnx::import_bytes(as_string(data, size), "fuzz.onnx", {}, base);
    (void)m.summary();
  } catch (const Error&) {
  }
  return 0;
}

// ---- CLI strings: Device::parse, parse_dtype, parse_dim and the kgraph flag validators ----
inline int fuzz_cli(const std::uint8_t* data, std::size_t size) {
  std::string s = as_string(data, size);
  if (s == "auto") return 0;  // asks the driver whether there is a GPU: not a parser
  try {
    (void)Device::parse(s);
  } catch (const Error&) {
  }
  (void)parse_dtype(s);
  try {
    (void)kgraph::parse_dim(s);
  } catch (const Error&) {
  }
  for (const CLI::Validator* v : {&kgraph_cli::positive_integer, &kgraph_cli::finite_non_negative,
                                  &kgraph_cli::thread_count, &kgraph_cli::dim_assignment}) {
    std::string value = s;
    (void)(*v)(value);
  }
  return 0;
}

}  // namespace kg::fuzz

// ---- ONNX converters: a one-node model from the bytes, imported, loaded and run on the CPU ----
#include "onnx_convert_target.hpp"  // NOLINT(build/include_order): kg::fuzz::fuzz_onnx_convert
// ---- the emulator's module cache and the file rendezvous ----
#include "cache_targets.hpp"  // NOLINT(build/include_order): kg::fuzz::fuzz_emu_cache, fuzz_rendezvous
