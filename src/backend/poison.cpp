#include "backend/poison.hpp"

#include <algorithm>

#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::backend {

unsigned char poison_byte(DType dtype) { return is_floating(dtype) ? 0xFF : 0xA5; }

namespace {
bool element_is(const unsigned char* e, std::size_t elem_bytes, unsigned char byte) {
  for (std::size_t k = 0; k < elem_bytes; ++k)
    if (e[k] != byte) return false;
  return true;
}
}  // namespace

std::int64_t first_filled_with(const unsigned char* data, std::int64_t numel, std::size_t elem_bytes,
                               unsigned char byte, std::int64_t from) {
  for (std::int64_t i = std::max<std::int64_t>(from, 0); i < numel; ++i)
    if (element_is(data + static_cast<std::size_t>(i) * elem_bytes, elem_bytes, byte)) return i;
  return -1;
}

std::optional<Unwritten> find_unwritten(
    const std::vector<CheckedOutput>& after_first,
    const std::function<std::vector<const unsigned char*>(unsigned char byte)>& rerun) {
  // The first suspect of each output, and a copy of the first run's bytes from there on.
  std::vector<std::int64_t> suspect(after_first.size(), -1);
  std::vector<std::vector<unsigned char>> first(after_first.size());
  bool any = false;
  for (std::size_t o = 0; o < after_first.size(); ++o) {
    const CheckedOutput& c = after_first[o];
    const std::size_t es = dtype_size(c.dtype);
    suspect[o] = first_filled_with(c.bytes, c.numel, es, poison_byte(c.dtype));
    if (suspect[o] < 0) continue;
    any = true;
    const std::size_t from = static_cast<std::size_t>(suspect[o]) * es;
    first[o].assign(c.bytes + from, c.bytes + static_cast<std::size_t>(c.numel) * es);
  }
  if (!any) return std::nullopt;
  const std::vector<const unsigned char*> second = rerun(kSecondPoison);
  if (second.size() != after_first.size())
    throw Error(util::cat("checked mode: the second run gave ", second.size(), " outputs for ", after_first.size()));
  for (std::size_t o = 0; o < after_first.size(); ++o) {
    if (suspect[o] < 0) continue;
    const CheckedOutput& c = after_first[o];
    const std::size_t es = dtype_size(c.dtype);
    const unsigned char p = poison_byte(c.dtype);
    for (std::int64_t i = suspect[o]; i < c.numel; ++i) {
      const auto at = static_cast<std::size_t>(i) * es;
      if (element_is(second[o] + at, es, kSecondPoison) &&
          element_is(first[o].data() + (at - static_cast<std::size_t>(suspect[o]) * es), es, p))
        return Unwritten{o, i};
    }
  }
  return std::nullopt;
}

}  // namespace kg::backend
