// Small string helpers shared by the library's modules.
#pragma once

#include <sstream>
#include <string>
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

}  // namespace kg::util
