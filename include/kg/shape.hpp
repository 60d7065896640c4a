// Symbolic shapes: each dimension is a known size or a dynamic one (known only at load).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace kg {

struct DynamicTag {
  explicit constexpr DynamicTag(int) {}
};
// A dimension whose size is unknown until load: `Shape{kg::dynamic, 784}`.
inline constexpr DynamicTag dynamic{0};

// One dimension: a known size, or a dynamic one optionally named by a symbol ("batch").
// Two dynamic dims with the same non-empty symbol are the same unknown.
class Dim {
 public:
  Dim(std::int64_t size);  // NOLINT: implicit on purpose, `Shape{dynamic, 784}`
  Dim(int size) : Dim(static_cast<std::int64_t>(size)) {}  // NOLINT
  Dim(DynamicTag) {}                                        // NOLINT
  // A dynamic dim named `symbol`.
  static Dim named(std::string symbol);

  bool is_dynamic() const { return size_ < 0; }
  bool is_static() const { return size_ >= 0; }
  // The size; -1 when dynamic.
  std::int64_t size() const { return size_; }
  // The symbol of a dynamic dim ("" when anonymous or static).
  const std::string& symbol() const { return symbol_; }
  // "784", "batch", or "?".
  std::string to_string() const;

  // Equal when both static and the same size, or both dynamic with the same symbol.
  bool operator==(const Dim& o) const { return size_ == o.size_ && symbol_ == o.symbol_; }

 private:
  std::int64_t size_ = -1;
  std::string symbol_;
};

// A list of dims. `Shape{kg::dynamic, 784}` or `Shape::of({64, 784})`.
class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<Dim> dims) : dims_(dims) {}
  explicit Shape(std::vector<Dim> dims) : dims_(std::move(dims)) {}
  // A fully known shape.
  static Shape of(const std::vector<std::int64_t>& sizes);

  std::size_t rank() const { return dims_.size(); }
  std::size_t size() const { return dims_.size(); }
  const Dim& operator[](std::size_t i) const { return dims_[i]; }
  Dim& operator[](std::size_t i) { return dims_[i]; }
  // Dim `i` counted from the end when negative (-1 is the last).
  const Dim& at(std::int64_t i) const;
  auto begin() const { return dims_.begin(); }
  auto end() const { return dims_.end(); }
  const std::vector<Dim>& dims() const { return dims_; }
  void push_back(Dim d) { dims_.push_back(std::move(d)); }

  // True when no dim is dynamic.
  bool is_concrete() const;
  // The sizes; throws kg::Error when a dim is dynamic.
  std::vector<std::int64_t> sizes() const;
  // Product of the static dims (dynamic dims skipped).
  std::int64_t static_numel() const;
  // "[batch, 784]", "[?, 10]".
  std::string to_string() const;

  bool operator==(const Shape& o) const { return dims_ == o.dims_; }

 private:
  std::vector<Dim> dims_;
};

// "[64, 784]".
std::string sizes_to_string(const std::vector<std::int64_t>& sizes);
// Product of sizes (1 for rank 0).
std::int64_t numel_of(const std::vector<std::int64_t>& sizes);

}  // namespace kg
