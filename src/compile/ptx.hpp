// Reading what the checks need out of PTX text: entry points, their parameter lists and their
// thread-count directives; and parameter names out of a CUDA C++ kernel signature.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "kg/runtime_op.hpp"

namespace kg::compile {

struct PtxParam {
  std::string ptx_name;  // e.g. "detect_decode_param_3"
  std::string type;      // ".u64", ".f32", ".b8", ...
  std::size_t bytes = 0; // total size (element size × array count)
  std::size_t align = 0; // alignment in bytes
};

struct PtxEntry {
  std::string name;  // as in the PTX (mangled for C++ linkage)
  bool visible = true;
  std::vector<PtxParam> params;
  std::optional<Dim3> reqntid, maxntid;
};

// Every `.entry` of a PTX module. Throws kg::Error on text that is not PTX.
std::vector<PtxEntry> parse_ptx_entries(const std::string& ptx);

// True when the text is PTX (has `.version` and `.target` directives) rather than CUDA C++.
bool looks_like_ptx(const std::string& text);

// The `.target` of a PTX module ("sm_90"), or "".
std::string ptx_target(const std::string& ptx);

// Whether a PTX entry name is `entry` (exact, or the C++ mangling `_Z<len><entry>...`).
bool entry_matches(const std::string& ptx_name, const std::string& entry);

// Parameter names of `__global__ ... entry(...)` in CUDA C++ source, in order; empty when the
// signature is not found. Default arguments and attributes are skipped.
std::vector<std::string> kernel_param_names(const std::string& source, const std::string& entry);

}  // namespace kg::compile
