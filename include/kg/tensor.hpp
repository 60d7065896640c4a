// Host tensors with concrete shapes: what goes in and out of a loaded model, and what CPU
// implementations of ops read and write.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kg/dtype.hpp"
#include "kg/error.hpp"
#include "kg/shape.hpp"

namespace kg {

// A dense, row-major tensor in host memory. Copies share the storage (handle semantics);
// `clone()` copies the bytes.
class Tensor {
 public:
  Tensor() = default;
  // Uninitialised storage of the given dtype and sizes.
  static Tensor empty(DType dtype, std::vector<std::int64_t> shape);
  // All zeros.
  static Tensor zeros(DType dtype, std::vector<std::int64_t> shape);
  // Copies `values` (numel must match the shape).
  template <class T>
  static Tensor from_vector(std::vector<std::int64_t> shape, const std::vector<T>& values);
  // Wraps memory owned elsewhere; the caller keeps it alive and unchanged in size.
  static Tensor wrap(void* data, DType dtype, std::vector<std::int64_t> shape);
  // Wraps memory kept alive by `owner`.
  static Tensor wrap(std::shared_ptr<void> owner, void* data, DType dtype,
                     std::vector<std::int64_t> shape);

  DType dtype() const { return dtype_; }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  std::int64_t dim(std::size_t i) const { return shape_.at(i); }
  std::size_t rank() const { return shape_.size(); }
  std::int64_t numel() const;
  std::size_t nbytes() const;
  bool defined() const { return data_ != nullptr || numel() == 0; }

  void* raw() { return data_; }
  const void* raw() const { return data_; }
  // Typed pointer; throws kg::Error when T does not match the dtype.
  template <class T> T* data();
  template <class T> const T* data() const;

  // A deep copy.
  Tensor clone() const;
  // Same storage, new sizes with the same element count.
  Tensor reshaped(std::vector<std::int64_t> shape) const;
  // Converts between float dtypes (and integer to float); returns a new tensor.
  Tensor to(DType dtype) const;
  // Fills every element with `v` converted to the dtype.
  void fill(double v);
  // Element `i` (flat index) as double, whatever the dtype.
  double item(std::int64_t i) const;

 private:
  void check_dtype(DType want) const;
  std::shared_ptr<void> storage_;
  void* data_ = nullptr;
  DType dtype_ = DType::F32;
  std::vector<std::int64_t> shape_;
};

template <class T>
Tensor Tensor::from_vector(std::vector<std::int64_t> shape, const std::vector<T>& values) {
  Tensor t = empty(dtype_of_v<T>, std::move(shape));
  if (static_cast<std::int64_t>(values.size()) != t.numel())
    throw Error("Tensor::from_vector: " + std::to_string(values.size()) +
                " values for a shape of " + std::to_string(t.numel()) + " elements");
  T* d = t.data<T>();
  for (std::size_t i = 0; i < values.size(); ++i) d[i] = values[i];
  return t;
}

template <class T> T* Tensor::data() {
  check_dtype(dtype_of_v<T>);
  return static_cast<T*>(data_);
}
template <class T> const T* Tensor::data() const {
  check_dtype(dtype_of_v<T>);
  return static_cast<const T*>(data_);
}

}  // namespace kg
