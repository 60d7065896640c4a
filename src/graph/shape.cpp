#include "kg/shape.hpp"

#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg {

Dim::Dim(std::int64_t size) : size_(size) {
  if (size < 0) throw Error(util::cat("Dim: size must be >= 0 (use kg::dynamic), got ", size));
}

Dim Dim::named(std::string symbol) {
  Dim d{dynamic};
  d.symbol_ = std::move(symbol);
  return d;
}

std::string Dim::to_string() const {
  if (is_static()) return std::to_string(size_);
  return symbol_.empty() ? "?" : symbol_;
}

Shape Shape::of(const std::vector<std::int64_t>& sizes) {
  std::vector<Dim> d;
  d.reserve(sizes.size());
  for (auto s : sizes) d.emplace_back(s);
  return Shape(std::move(d));
}

const Dim& Shape::at(std::int64_t i) const {
  auto r = static_cast<std::int64_t>(dims_.size());
  std::int64_t j = i < 0 ? i + r : i;
  if (j < 0 || j >= r) throw Error(util::cat("dim ", i, " is out of range for shape ", to_string()));
  return dims_[static_cast<std::size_t>(j)];
}

bool Shape::is_concrete() const {
  for (const auto& d : dims_)
    if (d.is_dynamic()) return false;
  return true;
}

std::vector<std::int64_t> Shape::sizes() const {
  std::vector<std::int64_t> s;
  s.reserve(dims_.size());
  for (const auto& d : dims_) {
    if (d.is_dynamic()) throw Error("shape " + to_string() + " has a dynamic dim");
    s.push_back(d.size());
  }
  return s;
}

std::int64_t Shape::static_numel() const {
  std::vector<std::int64_t> sizes;
  sizes.reserve(dims_.size());
  for (const auto& d : dims_)
    if (d.is_static()) sizes.push_back(d.size());
  return numel_of(sizes);
}

std::string Shape::to_string() const {
  std::string s = "[";
  for (std::size_t i = 0; i < dims_.size(); ++i) {
    if (i) s += ", ";
    s += dims_[i].to_string();
  }
  return s + "]";
}

std::string sizes_to_string(const std::vector<std::int64_t>& sizes) {
  return "[" + util::join(sizes, ", ") + "]";
}

// Checked: the product of the non-zero sizes must fit an int64. A zero size makes the count 0, but
// does not excuse the others — [2^32-1, 2^32-1, 0] would overflow in a partial product or a stride.
std::int64_t numel_of(const std::vector<std::int64_t>& sizes) {
  std::int64_t n = 1;
  bool zero = false;
  for (auto s : sizes) {
    if (s == 0) {
      zero = true;
      continue;
    }
    if (__builtin_mul_overflow(n, s, &n))
      throw Error(util::cat("the sizes ", sizes_to_string(sizes),
                            " have more elements than an int64 holds (2^63 - 1)"));
  }
  return zero ? 0 : n;
}

}  // namespace kg
