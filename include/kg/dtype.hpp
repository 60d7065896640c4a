// Element types of tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kg {

// The element type of a tensor.
enum class DType : std::uint8_t { Bool, I8, I16, I32, I64, U8, F16, BF16, F32, F64 };

// Bytes per element.
std::size_t dtype_size(DType t);
// Short lowercase name: "f32", "i64", "bool", ...
std::string_view dtype_name(DType t);
// Parses a short name ("f32") or a safetensors code ("F32"); nullopt when unknown.
std::optional<DType> parse_dtype(std::string_view s);
// The safetensors code of a dtype ("F32", "BF16", "BOOL", ...).
std::string_view dtype_safetensors_code(DType t);
// True for f16, bf16, f32, f64.
bool is_floating(DType t);
// True for the 16-bit floats, f16 and bf16 (the reduced precisions a model can be loaded in).
inline bool is_half_float(DType t) { return t == DType::F16 || t == DType::BF16; }

// Maps a C++ element type to its DType.
template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::F32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::F64; };
template <> struct dtype_of<std::int8_t> { static constexpr DType value = DType::I8; };
template <> struct dtype_of<std::int16_t> { static constexpr DType value = DType::I16; };
template <> struct dtype_of<std::int32_t> { static constexpr DType value = DType::I32; };
template <> struct dtype_of<std::int64_t> { static constexpr DType value = DType::I64; };
template <> struct dtype_of<std::uint8_t> { static constexpr DType value = DType::U8; };
template <> struct dtype_of<bool> { static constexpr DType value = DType::Bool; };
template <class T> inline constexpr DType dtype_of_v = dtype_of<T>::value;

}  // namespace kg
