// Reading CUDA C++ source text without a compiler: the __global__ functions of a source with their
// parameters' names and C++ types, each type classified (pointer, integer, float, struct) so that
// packed arguments can be checked against the signature on any machine, GPU or not.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace kg::compile {

// A __global__ function as the source spells it.
struct KernelSignature {
  std::string name;
  std::vector<std::string> param_names, param_types;
  std::string launch_bounds;  // the first argument of __launch_bounds__, or ""
  bool extern_c = false;
};

// The non-template __global__ functions of `source`, in order of appearance.
std::vector<KernelSignature> find_kernels(const std::string& source);

// What a kernel parameter's C++ type is, for argument checks.
struct ParamClass {
  enum class Kind { Pointer, SignedInt, UnsignedInt, Float, Unknown };
  Kind kind = Kind::Unknown;
  std::size_t bytes = 0;  // 0 when unknown (a struct or a typedef the reader cannot see through)
};
ParamClass classify_param_type(const std::string& type);

// Helpers over source text, shared with the emulator's source rewriting.
namespace text {
bool is_ident(char c);
// The source with comments replaced by spaces (newlines kept), so that positions still match.
std::string blank_comments(const std::string& s);
std::string trim(const std::string& s);
// Whitespace runs as one space, none before '*' or '&': "const float *" → "const float*".
std::string squeeze_spaces(const std::string& s);
// The text of the balanced group opening at s[open], without the brackets; `end` gets the
// position after the closing bracket.
std::string balanced(const std::string& s, std::size_t open, std::size_t& end);
// Splits at commas outside (), [], {} and <>.
std::vector<std::string> split_top(const std::string& s);
// True when position `at` lies inside an `extern "C" { ... }` block.
bool inside_extern_c_block(const std::string& s, std::size_t at);
// Depth of braces at position `at`.
int brace_depth(const std::string& s, std::size_t at);
}  // namespace text

}  // namespace kg::compile
