// Dim, Shape and DType: printing, equality, sizes, names and parsing.
#include <limits>

#include "support/test_util.hpp"

using kg_test::expect_error;

TEST(Dim, StaticDynamicAndNamed) {
  kg::Dim s(784);
  EXPECT_TRUE(s.is_static());
  EXPECT_FALSE(s.is_dynamic());
  EXPECT_EQ(s.size(), 784);
  EXPECT_EQ(s.symbol(), "");
  EXPECT_EQ(s.to_string(), "784");

  kg::Dim z(0);
  EXPECT_TRUE(z.is_static());
  EXPECT_EQ(z.to_string(), "0");

  kg::Dim d = kg::dynamic;
  EXPECT_TRUE(d.is_dynamic());
  EXPECT_EQ(d.size(), -1);
  EXPECT_EQ(d.symbol(), "");
  EXPECT_EQ(d.to_string(), "?");

  kg::Dim b = kg::Dim::named("batch");
  EXPECT_TRUE(b.is_dynamic());
  EXPECT_FALSE(b.is_static());
  EXPECT_EQ(b.size(), -1);
  EXPECT_EQ(b.symbol(), "batch");
  EXPECT_EQ(b.to_string(), "batch");

  kg::Dim big(std::int64_t{1} << 40);
  EXPECT_EQ(big.to_string(), "1099511627776");
}

TEST(Dim, Equality) {
  EXPECT_EQ(kg::Dim(3), kg::Dim(3));
  EXPECT_FALSE(kg::Dim(3) == kg::Dim(4));
  EXPECT_EQ(kg::Dim::named("batch"), kg::Dim::named("batch"));
  EXPECT_FALSE(kg::Dim::named("batch") == kg::Dim::named("n"));
  // An anonymous unknown is not proven equal to a named one.
  EXPECT_FALSE(kg::Dim(kg::dynamic) == kg::Dim::named("batch"));
  EXPECT_EQ(kg::Dim(kg::dynamic), kg::Dim(kg::dynamic));
  EXPECT_FALSE(kg::Dim(kg::dynamic) == kg::Dim(0));
}

TEST(Dim, NegativeSizeIsAnError) {
  expect_error([] { kg::Dim d(-1); }, {"Dim", "must be >= 0", "kg::dynamic", "-1"});
  expect_error([] { kg::Dim d(std::int64_t{-7}); }, {"-7"});
  expect_error([] { kg::Shape::of({3, -2}); }, {"-2"});
}

TEST(Shape, Printing) {
  EXPECT_EQ((kg::Shape{kg::Dim::named("batch"), 784}).to_string(), "[batch, 784]");
  EXPECT_EQ((kg::Shape{kg::dynamic, 10}).to_string(), "[?, 10]");
  EXPECT_EQ(kg::Shape{}.to_string(), "[]");
  EXPECT_EQ(kg::Shape::of({64, 3, 224, 224}).to_string(), "[64, 3, 224, 224]");
  EXPECT_EQ((kg::Shape{kg::Dim::named("n"), kg::dynamic, 0}).to_string(), "[n, ?, 0]");
  EXPECT_EQ(kg::sizes_to_string({64, 784}), "[64, 784]");
  EXPECT_EQ(kg::sizes_to_string({}), "[]");
}

TEST(Shape, SizesAndQueries) {
  kg::Shape s{kg::Dim::named("batch"), 3, 5};
  EXPECT_EQ(s.rank(), 3u);
  EXPECT_EQ(s.size(), 3u);
  EXPECT_FALSE(s.is_concrete());
  EXPECT_EQ(s.static_numel(), 15);
  EXPECT_EQ(s.at(-1).size(), 5);
  EXPECT_EQ(s.at(-3).symbol(), "batch");
  EXPECT_EQ(s.at(1).size(), 3);
  expect_error([&] { s.at(3); }, {"dim 3", "out of range", "[batch, 3, 5]"});
  expect_error([&] { s.at(-4); }, {"dim -4", "out of range"});
  expect_error([&] { s.sizes(); }, {"[batch, 3, 5]", "dynamic"});

  kg::Shape c = kg::Shape::of({2, 3, 4});
  EXPECT_TRUE(c.is_concrete());
  EXPECT_EQ(c.sizes(), (std::vector<std::int64_t>{2, 3, 4}));
  EXPECT_EQ(c.static_numel(), 24);
  EXPECT_TRUE(kg::Shape{}.is_concrete());
  EXPECT_EQ(kg::Shape{}.static_numel(), 1);

  kg::Shape e;
  e.push_back(7);
  e.push_back(kg::dynamic);
  EXPECT_EQ(e.to_string(), "[7, ?]");
  e[1] = kg::Dim(2);
  EXPECT_EQ(e, kg::Shape::of({7, 2}));
  EXPECT_FALSE(e == kg::Shape::of({7, 3}));
  EXPECT_FALSE(e == kg::Shape::of({7, 2, 1}));
  EXPECT_EQ((kg::Shape{kg::Dim::named("b"), 2}), (kg::Shape{kg::Dim::named("b"), 2}));
  EXPECT_FALSE((kg::Shape{kg::Dim::named("b"), 2}) == (kg::Shape{kg::dynamic, 2}));

  EXPECT_EQ(kg::numel_of({}), 1);
  EXPECT_EQ(kg::numel_of({2, 3, 7}), 42);
  EXPECT_EQ(kg::numel_of({5, 0, 3}), 0);
}

namespace {
struct DTypeRow {
  kg::DType t;
  std::size_t size;
  const char* name;
  const char* code;
  bool floating;
};
// The table every dtype must follow (PyTorch / safetensors element sizes and codes).
const std::vector<DTypeRow>& dtype_table() {
  static const std::vector<DTypeRow> rows{
      {kg::DType::Bool, 1, "bool", "BOOL", false}, {kg::DType::I8, 1, "i8", "I8", false},
      {kg::DType::I16, 2, "i16", "I16", false},    {kg::DType::I32, 4, "i32", "I32", false},
      {kg::DType::I64, 8, "i64", "I64", false},    {kg::DType::U8, 1, "u8", "U8", false},
      {kg::DType::F16, 2, "f16", "F16", true},     {kg::DType::BF16, 2, "bf16", "BF16", true},
      {kg::DType::F32, 4, "f32", "F32", true},     {kg::DType::F64, 8, "f64", "F64", true}};
  return rows;
}
}  // namespace

TEST(DType, NamesSizesAndCodes) {
  ASSERT_EQ(dtype_table().size(), 10u);
  for (const auto& r : dtype_table()) {
    SCOPED_TRACE(r.name);
    EXPECT_EQ(kg::dtype_size(r.t), r.size);
    EXPECT_EQ(kg::dtype_name(r.t), r.name);
    EXPECT_EQ(kg::dtype_safetensors_code(r.t), r.code);
    EXPECT_EQ(kg::is_floating(r.t), r.floating);
  }
  EXPECT_EQ(kg::dtype_size(kg::dtype_of_v<float>), sizeof(float));
  EXPECT_EQ(kg::dtype_size(kg::dtype_of_v<double>), sizeof(double));
  EXPECT_EQ(kg::dtype_size(kg::dtype_of_v<std::int16_t>), sizeof(std::int16_t));
  EXPECT_EQ(kg::dtype_size(kg::dtype_of_v<std::int64_t>), sizeof(std::int64_t));
  EXPECT_EQ(kg::dtype_of_v<bool>, kg::DType::Bool);
  EXPECT_EQ(kg::dtype_of_v<std::uint8_t>, kg::DType::U8);
  EXPECT_EQ(kg::dtype_of_v<std::int8_t>, kg::DType::I8);
  EXPECT_EQ(kg::dtype_of_v<std::int32_t>, kg::DType::I32);
}

TEST(DType, Parse) {
  for (const auto& r : dtype_table()) {
    SCOPED_TRACE(r.name);
    auto a = kg::parse_dtype(r.name);
    auto b = kg::parse_dtype(r.code);
    ASSERT_TRUE(a.has_value());
    ASSERT_TRUE(b.has_value());
    EXPECT_EQ(*a, r.t);
    EXPECT_EQ(*b, r.t);
    // Round trip through the printed forms.
    EXPECT_EQ(*kg::parse_dtype(kg::dtype_name(*a)), r.t);
    EXPECT_EQ(*kg::parse_dtype(kg::dtype_safetensors_code(*a)), r.t);
  }
  for (const char* bad : {"", "float32", "F8_E4M3", "f32 ", " f32", "F", "int", "Bf16", "u16", "U16"})
    EXPECT_FALSE(kg::parse_dtype(bad).has_value()) << "'" << bad << "'";
}
