// Element counts are checked: a product of sizes that does not fit an int64 is a kg::Error naming
// the sizes, not a signed overflow — also when a zero size makes the count 0.
#include <limits>

#include "support/test_util.hpp"

using kg_test::expect_error;

namespace {

constexpr std::int64_t k32 = 0xFFFFFFFFll;  // 2^32 - 1, the largest IDX dim

TEST(ShapeOverflow, NumelOfIsChecked) {
  EXPECT_EQ(kg::numel_of({}), 1);
  EXPECT_EQ(kg::numel_of({3, 0, 5}), 0);
  EXPECT_EQ(kg::numel_of({std::int64_t{1} << 31, std::int64_t{1} << 31}), std::int64_t{1} << 62);
  EXPECT_EQ(kg::numel_of({std::numeric_limits<std::int64_t>::max(), 1}), std::numeric_limits<std::int64_t>::max());
  EXPECT_EQ(kg::numel_of({0, k32, 7}), 0);
  expect_error([] { kg::numel_of({k32, k32, 0}); }, {"[4294967295, 4294967295, 0]", "more elements than an int64"});
  expect_error([] { kg::numel_of({0, k32, k32}); }, {"[0, 4294967295, 4294967295]"});
  expect_error([] { kg::numel_of({k32, k32}); }, {"[4294967295, 4294967295]"});
  expect_error([] { kg::numel_of({std::int64_t{1} << 32, std::int64_t{1} << 31}); }, {"more elements"});
}

TEST(ShapeOverflow, StaticNumelIsChecked) {
  EXPECT_EQ(kg::Shape({kg::Dim::named("batch"), 3, 4}).static_numel(), 12);
  expect_error([] { kg::Shape({kg::Dim::named("batch"), k32, k32, 0}).static_numel(); },
               {"[4294967295, 4294967295, 0]", "more elements than an int64"});
}

TEST(ShapeOverflow, TensorOfAnOverflowingShapeIsAnError) {
  expect_error([] { kg::Tensor::empty(kg::DType::U8, {k32, k32, 0}); }, {"[4294967295, 4294967295, 0]"});
  EXPECT_EQ(kg::Tensor::empty(kg::DType::F32, {0, k32}).numel(), 0);
}

}  // namespace
