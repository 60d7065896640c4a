#include "kg/tensor.hpp"

#include <cstdlib>
#include <cstring>

#include "util/half.hpp"
#include "util/str.hpp"

namespace kg {

namespace {
std::shared_ptr<void> allocate(std::size_t bytes) {
  // 64-byte alignment for vector loads; at least one byte so the pointer is never null.
  std::size_t n = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, n ? n : 64);
  if (!p) throw Error(util::cat("out of host memory allocating ", bytes, " bytes"));
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}

void check_shape(const std::vector<std::int64_t>& shape) {
  for (auto s : shape)
    if (s < 0) throw Error("Tensor: negative size in shape " + sizes_to_string(shape));
}

// The bytes of a `dtype` tensor of `shape` (sizes not negative), multiplied with overflow
// checks: over 2^63 - 1, which both a size_t and an int64 byte count hold, an error naming the
// shape and dtype rather than a count that wraps to a small allocation.
std::size_t checked_nbytes(const char* who, DType dtype, const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  bool zero = false, over = false;
  for (auto s : shape) {
    if (s == 0) {
      zero = true;
    } else {
      over = over || __builtin_mul_overflow(n, s, &n);
    }
  }
  std::int64_t bytes = 0;  // a zero size makes no bytes, but the other sizes still must multiply (numel_of)
  if (!zero) over = over || __builtin_mul_overflow(n, static_cast<std::int64_t>(dtype_size(dtype)), &bytes);
  if (over)
    throw Error(util::cat(who, ": a ", dtype_name(dtype), " tensor of shape ", sizes_to_string(shape),
                          " takes more bytes than a 64-bit count holds (2^63 - 1)"));
  return static_cast<std::size_t>(bytes);
}
}  // namespace

Tensor Tensor::empty(DType dtype, std::vector<std::int64_t> shape) {
  check_shape(shape);
  const std::size_t bytes = checked_nbytes("Tensor::empty", dtype, shape);
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.storage_ = allocate(bytes);
  t.data_ = t.storage_.get();
  return t;
}

Tensor Tensor::zeros(DType dtype, std::vector<std::int64_t> shape) {
  Tensor t = empty(dtype, std::move(shape));
  std::memset(t.data_, 0, t.nbytes());
  return t;
}

Tensor Tensor::wrap(void* data, DType dtype, std::vector<std::int64_t> shape) {
  return wrap(nullptr, data, dtype, std::move(shape));
}

Tensor Tensor::wrap(std::shared_ptr<void> owner, void* data, DType dtype,
                    std::vector<std::int64_t> shape) {
  check_shape(shape);
  checked_nbytes("Tensor::wrap", dtype, shape);
  Tensor t;
  t.storage_ = std::move(owner);
  t.data_ = data;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  return t;
}

std::int64_t Tensor::numel() const { return numel_of(shape_); }
std::size_t Tensor::nbytes() const { return checked_nbytes("Tensor::nbytes", dtype_, shape_); }

void Tensor::check_dtype(DType want) const {
  if (want != dtype_)
    throw Error(util::cat("tensor of dtype ", dtype_name(dtype_), " accessed as ", dtype_name(want)));
}

Tensor Tensor::clone() const {
  Tensor t = empty(dtype_, shape_);
  if (nbytes()) std::memcpy(t.data_, data_, nbytes());
  return t;
}

Tensor Tensor::reshaped(std::vector<std::int64_t> shape) const {
  if (numel_of(shape) != numel())
    throw Error("Tensor::reshaped: " + sizes_to_string(shape_) + " cannot become " +
                sizes_to_string(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

double Tensor::item(std::int64_t i) const {
  if (i < 0 || i >= numel()) throw Error(util::cat("Tensor::item: index ", i, " out of range ", numel()));
  const auto* p = static_cast<const unsigned char*>(data_);
  auto k = static_cast<std::size_t>(i);
  switch (dtype_) {
    case DType::Bool: return p[k] ? 1.0 : 0.0;
    case DType::I8: return reinterpret_cast<const std::int8_t*>(p)[k];
    case DType::I16: return reinterpret_cast<const std::int16_t*>(p)[k];
    case DType::I32: return reinterpret_cast<const std::int32_t*>(p)[k];
    case DType::I64: return static_cast<double>(reinterpret_cast<const std::int64_t*>(p)[k]);
    case DType::U8: return p[k];
    case DType::F16: return util::half_to_float(reinterpret_cast<const std::uint16_t*>(p)[k]);
    case DType::BF16: return util::bf16_to_float(reinterpret_cast<const std::uint16_t*>(p)[k]);
    case DType::F32: return reinterpret_cast<const float*>(p)[k];
    case DType::F64: return reinterpret_cast<const double*>(p)[k];
  }
  return 0.0;
}

namespace {
void store(void* base, DType t, std::size_t k, double v) {
  auto* p = static_cast<unsigned char*>(base);
  switch (t) {
    case DType::Bool: p[k] = v != 0.0; break;
    case DType::I8: reinterpret_cast<std::int8_t*>(p)[k] = static_cast<std::int8_t>(v); break;
    case DType::I16: reinterpret_cast<std::int16_t*>(p)[k] = static_cast<std::int16_t>(v); break;
    case DType::I32: reinterpret_cast<std::int32_t*>(p)[k] = static_cast<std::int32_t>(v); break;
    case DType::I64: reinterpret_cast<std::int64_t*>(p)[k] = static_cast<std::int64_t>(v); break;
    case DType::U8: p[k] = static_cast<std::uint8_t>(v); break;
    case DType::F16:
      reinterpret_cast<std::uint16_t*>(p)[k] = util::float_to_half(static_cast<float>(v));
      break;
    case DType::BF16:
      reinterpret_cast<std::uint16_t*>(p)[k] = util::float_to_bf16(static_cast<float>(v));
      break;
    case DType::F32: reinterpret_cast<float*>(p)[k] = static_cast<float>(v); break;
    case DType::F64: reinterpret_cast<double*>(p)[k] = v; break;
  }
}
}  // namespace

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return clone();
  if (is_floating(dtype_) != is_floating(dtype) && !is_floating(dtype))
    throw Error(util::cat("Tensor::to: cannot convert ", dtype_name(dtype_), " to ", dtype_name(dtype)));
  Tensor t = empty(dtype, shape_);
  const std::int64_t n = numel();
  // The conversions a model in reduced precision makes on every CPU run, without a double between.
  if (dtype_ == DType::F32 && is_half_float(dtype)) {
    const auto* src = static_cast<const float*>(data_);
    auto* dst = static_cast<std::uint16_t*>(t.data_);
    for (std::int64_t i = 0; i < n; ++i)
      dst[i] = dtype == DType::BF16 ? util::float_to_bf16(src[i]) : util::float_to_half(src[i]);
    return t;
  }
  if (is_half_float(dtype_) && dtype == DType::F32) {
    const auto* src = static_cast<const std::uint16_t*>(data_);
    auto* dst = static_cast<float*>(t.data_);
    for (std::int64_t i = 0; i < n; ++i)
      dst[i] = dtype_ == DType::BF16 ? util::bf16_to_float(src[i]) : util::half_to_float(src[i]);
    return t;
  }
  for (std::int64_t i = 0; i < n; ++i) store(t.data_, dtype, static_cast<std::size_t>(i), item(i));
  return t;
}

void Tensor::fill(double v) {
  const std::int64_t n = numel();
  if (dtype_ == DType::F32) {
    auto* p = static_cast<float*>(data_);
    for (std::int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(v);
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) store(data_, dtype_, static_cast<std::size_t>(i), v);
}

}  // namespace kg
