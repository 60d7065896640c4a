// Small string helpers shared by the library's modules.
#pragma once

#include <sstream>
#include <string>
#include <string_view>
#include <string_view>
#include <vector>

namespace kg::util {

// Concatenates the streamed forms of the arguments.
template <class... A> std::string cat(const A&... a) {
  std::ostringstream os;
  (os << ... << a);
  return os.str();
}

// Joins the streamed forms of the items with `sep`.
template <class C> std::string join(const C& items, const std::string& sep) {
  std::ostringstream os;
  bool first = true;
  for (const auto& it : items) {
    if (!first) os << sep;
    os << it;
    first = false;
  }
  return os.str();
}

// Human-readable byte count: "1.50 MiB".
std::string format_bytes(std::size_t bytes);

// `text` safe to print on a terminal: every control character (bytes 0-31 and 127, so ESC, BEL
// and CR included) becomes a visible escape ("\x1b", "\r"), except the characters in `keep`
// (by default line feeds and tabs). Bytes of 128 and above pass unchanged (UTF-8).
std::string escape_control(std::string_view text, std::string_view keep = "\n\t");

// A name read from a file, quoted in a message: escape_control() with nothing kept, so that an
// escape sequence or a line break in a name never reaches the terminal raw.
inline std::string printable(std::string_view s) { return escape_control(s, ""); }

}  // namespace kg::util
