// Reading CUDA C++ source text without a compiler: comments blanked, balanced groups, and the
// signatures of the __global__ functions with each parameter's type classified.
#include "compile/cuda_source.hpp"

#include <cctype>
#include <regex>
#include <sstream>

namespace kg::compile {
namespace text {

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

}  // namespace text

using namespace text;

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

}  // namespace kg::compile

namespace kg::compile {

ParamClass classify_param_type(const std::string& type) {
  using K = ParamClass::Kind;
  if (type.find('*') != std::string::npos || type.find('&') != std::string::npos) return {K::Pointer, 8};
  // The words of the type without qualifiers.
  std::vector<std::string> words;
  std::string w;
  for (char c : type + " ") {
    if (text::is_ident(c) || c == ':') {
      w += c;
      continue;
    }
    if (!w.empty() && w != "const" && w != "volatile" && w != "struct" && w != "std::" && w != "signed")
      words.push_back(w.rfind("std::", 0) == 0 ? w.substr(5) : w);
    else if (w == "signed")
      words.push_back("int");
    w.clear();
  }
  std::string t;
  for (const auto& x : words) t += (t.empty() ? "" : " ") + x;
  if (t == "float") return {K::Float, 4};
  if (t == "double") return {K::Float, 8};
  if (t == "int" || t == "int32_t" || t == "int int") return {K::SignedInt, 4};
  if (t == "unsigned" || t == "unsigned int" || t == "uint32_t") return {K::UnsignedInt, 4};
  if (t == "long long" || t == "long" || t == "long int" || t == "long long int" || t == "int64_t" ||
      t == "ptrdiff_t" || t == "intptr_t" || t == "ssize_t" || t == "int long long")
    return {K::SignedInt, 8};
  if (t == "unsigned long long" || t == "unsigned long" || t == "unsigned long int" ||
      t == "unsigned long long int" || t == "uint64_t" || t == "size_t" || t == "uintptr_t")
    return {K::UnsignedInt, 8};
  if (t == "short" || t == "int16_t" || t == "short int") return {K::SignedInt, 2};
  if (t == "unsigned short" || t == "uint16_t") return {K::UnsignedInt, 2};
  if (t == "char" || t == "int8_t" || t == "bool") return {K::SignedInt, 1};
  if (t == "unsigned char" || t == "uint8_t") return {K::UnsignedInt, 1};
  return {K::Unknown, 0};
}

}  // namespace kg::compile
