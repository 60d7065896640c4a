#include "compile/ptx.hpp"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <limits>

#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::compile {
namespace {

// PTX and CUDA text is read with small scanners rather than std::regex: libstdc++'s regex
// recurses once per character matched by `\s+` or `.*`, so a long whitespace run in a file from
// the cache or the user overflowed the stack. Each scanner below moves forward only.

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_word(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }
bool is_ptx_ident_start(char c) {
  return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == '$';
}
bool is_ptx_ident(char c) { return is_word(c) || c == '$'; }

std::size_t skip_spaces(const std::string& s, std::size_t i) {
  while (i < s.size() && is_space(s[i])) ++i;
  return i;
}

// Past one or more spaces at `i`, or npos when there is none.
std::size_t skip_some_spaces(const std::string& s, std::size_t i) {
  const std::size_t j = skip_spaces(s, i);
  return j == i ? std::string::npos : j;
}

bool starts_with_at(const std::string& s, std::size_t i, const char* word) {
  return s.compare(i, std::char_traits<char>::length(word), word) == 0;
}

// The run of characters satisfying `pred` at `i` (empty when none).
template <class Pred> std::string run_at(const std::string& s, std::size_t i, Pred pred) {
  std::size_t j = i;
  while (j < s.size() && pred(s[j])) ++j;
  return s.substr(i, j - i);
}

// A decimal number of a PTX directive, checked against `max`: `what` names it in the error.
std::uint64_t checked_number(const std::string& digits, std::uint64_t max, const std::string& entry,
                             const std::string& what) {
  std::uint64_t v = 0;
  for (char c : digits) {
    const auto d = static_cast<std::uint64_t>(c - '0');
    if (v > (max - d) / 10)
      throw Error(util::cat("PTX entry '", entry, "': ", what, " ", digits, " is out of range (at most ", max,
                            ")"));
    v = v * 10 + d;
  }
  return v;
}

std::size_t type_bytes(const std::string& t) {
  if (t == ".u8" || t == ".s8" || t == ".b8") return 1;
  if (t == ".u16" || t == ".s16" || t == ".b16" || t == ".f16") return 2;
  if (t == ".u32" || t == ".s32" || t == ".b32" || t == ".f32") return 4;
  if (t == ".u64" || t == ".s64" || t == ".b64" || t == ".f64") return 8;
  return 0;
}

// `directive N[, N[, N]]` (the first such in `header`), each count at most 2^32 - 1.
std::optional<Dim3> parse_ntid(const std::string& header, const std::string& directive,
                               const std::string& entry) {
  constexpr std::uint64_t kMax = std::numeric_limits<unsigned>::max();
  for (std::size_t at = header.find(directive); at != std::string::npos;
       at = header.find(directive, at + 1)) {
    std::size_t i = skip_some_spaces(header, at + directive.size());
    if (i == std::string::npos || i >= header.size() || !is_digit(header[i])) continue;
    std::vector<std::string> nums{run_at(header, i, is_digit)};
    i += nums.back().size();
    while (nums.size() < 3) {
      const std::size_t comma = skip_spaces(header, i);
      if (comma >= header.size() || header[comma] != ',') break;
      const std::size_t n = skip_spaces(header, comma + 1);
      if (n >= header.size() || !is_digit(header[n])) break;
      nums.push_back(run_at(header, n, is_digit));
      i = n + nums.back().size();
    }
    Dim3 d;
    d.x = static_cast<unsigned>(checked_number(nums[0], kMax, entry, directive));
    if (nums.size() > 1) d.y = static_cast<unsigned>(checked_number(nums[1], kMax, entry, directive));
    if (nums.size() > 2) d.z = static_cast<unsigned>(checked_number(nums[2], kMax, entry, directive));
    return d;
  }
  return std::nullopt;
}

// One `.param [.align N] .type [.ptr [.space] [.align N]] name[[count]]` starting at plist[at]
// (which holds ".param"); false when the text there is not one. `end` gets the position after it.
bool parse_param(const std::string& plist, std::size_t at, const std::string& entry, PtxParam& prm,
                 std::size_t& end) {
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint32_t>::max();
  std::size_t i = skip_some_spaces(plist, at + 6);
  if (i == std::string::npos) return false;
  std::string align;
  if (starts_with_at(plist, i, ".align")) {
    i = skip_some_spaces(plist, i + 6);
    if (i == std::string::npos || i >= plist.size() || !is_digit(plist[i])) return false;
    align = run_at(plist, i, is_digit);
    i = skip_some_spaces(plist, i + align.size());
    if (i == std::string::npos) return false;
  }
  if (i >= plist.size() || plist[i] != '.') return false;
  const auto lower_or_digit = [](char c) { return std::islower(static_cast<unsigned char>(c)) || is_digit(c); };
  const std::string type = "." + run_at(plist, i + 1, lower_or_digit);
  if (type.size() == 1) return false;
  i = skip_some_spaces(plist, i + type.size());
  if (i == std::string::npos) return false;
  if (starts_with_at(plist, i, ".ptr")) {  // a pointer's state space and alignment: not the param's
    i = skip_some_spaces(plist, i + 4);
    if (i == std::string::npos) return false;
    if (i < plist.size() && plist[i] == '.' && !starts_with_at(plist, i, ".align")) {
      i += 1 + run_at(plist, i + 1, is_word).size();
      if ((i = skip_some_spaces(plist, i)) == std::string::npos) return false;
    }
    if (starts_with_at(plist, i, ".align")) {
      i = skip_some_spaces(plist, i + 6);
      if (i == std::string::npos) return false;
      i += run_at(plist, i, is_digit).size();
      if ((i = skip_some_spaces(plist, i)) == std::string::npos) return false;
    }
  }
  if (i >= plist.size() || !is_ptx_ident_start(plist[i])) return false;
  prm.type = type;
  prm.ptx_name = run_at(plist, i, is_ptx_ident);
  i += prm.ptx_name.size();
  std::uint64_t count = 1;
  if (i < plist.size() && plist[i] == '[') {
    const std::string digits = run_at(plist, i + 1, is_digit);
    if (!digits.empty() && i + 1 + digits.size() < plist.size() && plist[i + 1 + digits.size()] == ']') {
      count = checked_number(digits, kMax, entry, util::cat("the element count of parameter ", prm.ptx_name));
      i += digits.size() + 2;
    }
  }
  prm.bytes = type_bytes(prm.type) * static_cast<std::size_t>(count);
  prm.align = align.empty() ? type_bytes(prm.type)
                            : static_cast<std::size_t>(checked_number(align, kMax, entry, ".align"));
  end = i;
  return true;
}

}  // namespace

bool looks_like_ptx(const std::string& text) {
  return text.find(".version") != std::string::npos && text.find(".target") != std::string::npos &&
         text.find("__global__") == std::string::npos;
}

std::string ptx_target(const std::string& ptx) {
  for (std::size_t at = ptx.find(".target"); at != std::string::npos; at = ptx.find(".target", at + 1)) {
    const std::size_t i = skip_some_spaces(ptx, at + 7);
    if (i == std::string::npos) continue;
    std::string t = run_at(ptx, i, is_word);
    if (!t.empty()) return t;
  }
  return {};
}

std::vector<PtxEntry> parse_ptx_entries(const std::string& ptx) {
  if (!looks_like_ptx(ptx)) throw Error("not PTX text (no .version/.target directives)");
  std::vector<PtxEntry> out;
  // `[.visible|.weak] .entry name (`; the parameter list runs to the next ')', the header (with
  // the thread-count directives) from there to the body's '{'.
  for (std::size_t at = ptx.find(".entry"); at != std::string::npos; at = ptx.find(".entry", at + 1)) {
    std::size_t i = skip_some_spaces(ptx, at + 6);
    if (i == std::string::npos || i >= ptx.size() || !is_ptx_ident_start(ptx[i])) continue;
    PtxEntry e;
    e.name = run_at(ptx, i, is_ptx_ident);
    i = skip_spaces(ptx, i + e.name.size());
    if (i >= ptx.size() || ptx[i] != '(') continue;
    std::size_t before = at;
    while (before > 0 && is_space(ptx[before - 1])) --before;
    e.visible = before < at && before >= 8 && ptx.compare(before - 8, 8, ".visible") == 0;
    // Searched only up to the next entry, so that each part of the text is read once.
    const std::size_t open = i + 1;
    const std::size_t next = std::min(ptx.find(".entry", open), ptx.size());
    const auto find_before_next = [&](char c, std::size_t from) {
      const auto it = std::find(ptx.begin() + static_cast<std::ptrdiff_t>(from),
                                ptx.begin() + static_cast<std::ptrdiff_t>(next), c);
      const auto at_it = static_cast<std::size_t>(it - ptx.begin());
      return at_it == next ? std::string::npos : at_it;
    };
    const std::size_t close = find_before_next(')', open);
    if (close == std::string::npos) throw Error("PTX entry '" + e.name + "' has no closing ')'");
    const std::string plist = ptx.substr(open, close - open);
    for (std::size_t p = plist.find(".param"); p != std::string::npos;) {
      PtxParam prm;
      std::size_t end = 0;
      if (parse_param(plist, p, e.name, prm, end)) {
        e.params.push_back(prm);
        p = plist.find(".param", end);
      } else {
        p = plist.find(".param", p + 1);
      }
    }
    const std::size_t body = find_before_next('{', close);
    const std::string header = ptx.substr(close, (body == std::string::npos ? next : body) - close);
    e.reqntid = parse_ntid(header, ".reqntid", e.name);
    e.maxntid = parse_ntid(header, ".maxntid", e.name);
    out.push_back(std::move(e));
    at = close;
  }
  return out;
}

bool entry_matches(const std::string& ptx_name, const std::string& entry) {
  if (ptx_name == entry) return true;
  const std::string mangled = util::cat("_Z", entry.size(), entry);
  return ptx_name.rfind(mangled, 0) == 0;
}

std::vector<std::string> kernel_param_names(const std::string& source, const std::string& entry) {
  // The entry's name (a C++ identifier, found as a whole word) followed by '(' whose declaration
  // (back to the previous ';', '{' or '}') says __global__; then its balanced parameter list. The
  // name is compared as text: a name that is not an identifier is not found.
  if (entry.empty() || is_digit(entry[0]) || !std::all_of(entry.begin(), entry.end(), is_word)) return {};
  for (std::size_t at = source.find(entry); at != std::string::npos; at = source.find(entry, at + 1)) {
    if (at > 0 && is_word(source[at - 1])) continue;
    const std::size_t paren = skip_spaces(source, at + entry.size());
    if (paren >= source.size() || source[paren] != '(') continue;
    const std::size_t decl_start = source.find_last_of(";{}", at == 0 ? 0 : at - 1);
    const std::string decl = source.substr(decl_start == std::string::npos ? 0 : decl_start + 1,
                                           at - (decl_start == std::string::npos ? 0 : decl_start + 1));
    if (decl.find("__global__") == std::string::npos) continue;
    std::size_t i = paren;
    int depth = 0;
    std::vector<std::string> params;
    std::string cur;
    for (; i < source.size(); ++i) {
      char c = source[i];
      if (c == '(' || c == '<' || c == '[') {
        if (depth++ > 0) cur += c;
        continue;
      }
      if (c == ')' || c == '>' || c == ']') {
        if (--depth == 0) break;
        cur += c;
        continue;
      }
      if (c == ',' && depth == 1) {
        params.push_back(cur);
        cur.clear();
        continue;
      }
      cur += c;
    }
    if (cur.find_first_not_of(" \t\r\n") != std::string::npos) params.push_back(cur);
    std::vector<std::string> names;
    for (std::string p : params) {
      if (auto eq = p.find('='); eq != std::string::npos) p = p.substr(0, eq);
      std::size_t end = p.find_last_not_of(" \t\r\n");
      if (end == std::string::npos) continue;
      std::size_t start = end;
      while (start > 0 && (std::isalnum(static_cast<unsigned char>(p[start - 1])) || p[start - 1] == '_')) --start;
      names.push_back(p.substr(start, end - start + 1));
    }
    if (names.size() == 1 && names[0] == "void") names.clear();
    return names;
  }
  return {};
}

}  // namespace kg::compile
