#include "compile/ptx.hpp"

#include <cctype>
#include <regex>

#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::compile {
namespace {

std::size_t type_bytes(const std::string& t) {
  if (t == ".u8" || t == ".s8" || t == ".b8") return 1;
  if (t == ".u16" || t == ".s16" || t == ".b16" || t == ".f16") return 2;
  if (t == ".u32" || t == ".s32" || t == ".b32" || t == ".f32") return 4;
  if (t == ".u64" || t == ".s64" || t == ".b64" || t == ".f64") return 8;
  return 0;
}

std::optional<Dim3> parse_ntid(const std::string& header, const std::string& directive) {
  std::regex re("\\" + directive + "\\s+(\\d+)(?:\\s*,\\s*(\\d+))?(?:\\s*,\\s*(\\d+))?");
  std::smatch m;
  if (!std::regex_search(header, m, re)) return std::nullopt;
  Dim3 d;
  d.x = static_cast<unsigned>(std::stoul(m[1].str()));
  if (m[2].matched) d.y = static_cast<unsigned>(std::stoul(m[2].str()));
  if (m[3].matched) d.z = static_cast<unsigned>(std::stoul(m[3].str()));
  return d;
}

}  // namespace

bool looks_like_ptx(const std::string& text) {
  return text.find(".version") != std::string::npos && text.find(".target") != std::string::npos &&
         text.find("__global__") == std::string::npos;
}

std::string ptx_target(const std::string& ptx) {
  std::smatch m;
  if (std::regex_search(ptx, m, std::regex("\\.target\\s+([A-Za-z0-9_]+)"))) return m[1].str();
  return {};
}

std::vector<PtxEntry> parse_ptx_entries(const std::string& ptx) {
  if (!looks_like_ptx(ptx)) throw Error("not PTX text (no .version/.target directives)");
  std::vector<PtxEntry> out;
  static const std::regex entry_re("(\\.visible\\s+|\\.weak\\s+)?\\.entry\\s+([A-Za-z_$][A-Za-z0-9_$]*)\\s*\\(");
  static const std::regex param_re(
      "\\.param\\s+(?:\\.align\\s+(\\d+)\\s+)?(\\.[a-z0-9]+)\\s+(?:\\.ptr\\s+[^ ]+\\s+)*([A-Za-z_$][A-Za-z0-9_$]*)"
      "(?:\\[(\\d+)\\])?");
  auto begin = std::sregex_iterator(ptx.begin(), ptx.end(), entry_re);
  for (auto it = begin; it != std::sregex_iterator(); ++it) {
    PtxEntry e;
    e.visible = (*it)[1].matched && (*it)[1].str().find("visible") != std::string::npos;
    e.name = (*it)[2].str();
    std::size_t open = static_cast<std::size_t>(it->position(0) + it->length(0));
    std::size_t close = ptx.find(')', open);
    if (close == std::string::npos) throw Error("PTX entry '" + e.name + "' has no closing ')'");
    std::string plist = ptx.substr(open, close - open);
    for (auto p = std::sregex_iterator(plist.begin(), plist.end(), param_re); p != std::sregex_iterator(); ++p) {
      PtxParam prm;
      prm.type = (*p)[2].str();
      prm.ptx_name = (*p)[3].str();
      std::size_t count = (*p)[4].matched ? std::stoul((*p)[4].str()) : 1;
      prm.bytes = type_bytes(prm.type) * count;
      prm.align = (*p)[1].matched ? std::stoul((*p)[1].str()) : type_bytes(prm.type);
      e.params.push_back(prm);
    }
    std::size_t body = ptx.find('{', close);
    std::string header = ptx.substr(close, body == std::string::npos ? std::string::npos : body - close);
    e.reqntid = parse_ntid(header, ".reqntid");
    e.maxntid = parse_ntid(header, ".maxntid");
    out.push_back(std::move(e));
  }
  return out;
}

bool entry_matches(const std::string& ptx_name, const std::string& entry) {
  if (ptx_name == entry) return true;
  const std::string mangled = util::cat("_Z", entry.size(), entry);
  return ptx_name.rfind(mangled, 0) == 0;
}

std::vector<std::string> kernel_param_names(const std::string& source, const std::string& entry) {
  // The entry's name followed by '(' whose declaration (back to the previous ';', '{' or '}')
  // says __global__; then its balanced parameter list.
  const std::regex name_re("\\b" + entry + "\\s*\\(");
  for (auto it = std::sregex_iterator(source.begin(), source.end(), name_re); it != std::sregex_iterator(); ++it) {
    const auto at = static_cast<std::size_t>(it->position(0));
    const std::size_t decl_start = source.find_last_of(";{}", at == 0 ? 0 : at - 1);
    const std::string decl = source.substr(decl_start == std::string::npos ? 0 : decl_start + 1,
                                           at - (decl_start == std::string::npos ? 0 : decl_start + 1));
    if (decl.find("__global__") == std::string::npos) continue;
    std::size_t i = at + static_cast<std::size_t>(it->length(0)) - 1;  // the '('
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
