#include "kg/dtype.hpp"

#include <array>

namespace kg {
namespace {
struct Info {
  DType t;
  std::size_t size;
  std::string_view name, st;
};
constexpr std::array<Info, 10> kInfo{{{DType::Bool, 1, "bool", "BOOL"},
                                      {DType::I8, 1, "i8", "I8"},
                                      {DType::I16, 2, "i16", "I16"},
                                      {DType::I32, 4, "i32", "I32"},
                                      {DType::I64, 8, "i64", "I64"},
                                      {DType::U8, 1, "u8", "U8"},
                                      {DType::F16, 2, "f16", "F16"},
                                      {DType::BF16, 2, "bf16", "BF16"},
                                      {DType::F32, 4, "f32", "F32"},
                                      {DType::F64, 8, "f64", "F64"}}};
const Info& info(DType t) { return kInfo[static_cast<std::size_t>(t)]; }
}  // namespace

std::size_t dtype_size(DType t) { return info(t).size; }
std::string_view dtype_name(DType t) { return info(t).name; }
std::string_view dtype_safetensors_code(DType t) { return info(t).st; }
bool is_floating(DType t) {
  return t == DType::F16 || t == DType::BF16 || t == DType::F32 || t == DType::F64;
}
std::optional<DType> parse_dtype(std::string_view s) {
  for (const auto& i : kInfo)
    if (s == i.name || s == i.st) return i.t;
  return std::nullopt;
}

}  // namespace kg
