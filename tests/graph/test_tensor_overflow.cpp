// Tensor byte counts past 64 bits: numel × element size is multiplied with overflow checks when
// a tensor is created (empty, zeros, wrap) and in nbytes(), so a shape whose bytes wrap is an
// error naming the shape and dtype, never a small allocation behind a huge shape.
#include <gtest/gtest.h>

#include "kg/kg.hpp"
#include "support/test_util.hpp"

namespace {

// 2^61 elements: an int64 numel, but 2^64 bytes as f64 (wraps to 0) and 2^63 as f32.
constexpr std::int64_t k2p61 = std::int64_t{1} << 61;

}  // namespace

TEST(TensorOverflow, EmptyWhoseBytesWrapIsAnError) {
  kg_test::expect_error([] { kg::Tensor::empty(kg::DType::F64, {k2p61}); },
                        {"Tensor::empty", "f64", "[2305843009213693952]", "2^63 - 1"});
  kg_test::expect_error([] { kg::Tensor::empty(kg::DType::F32, {k2p61}); },
                        {"Tensor::empty", "f32", "[2305843009213693952]"});
  kg_test::expect_error(
      [] {
        kg::Tensor::empty(kg::DType::I64, {4, std::int64_t{1} << 60});
      },
      {"Tensor::empty", "i64", "[4, 1152921504606846976]"});
}

TEST(TensorOverflow, ZerosWhoseBytesWrapIsAnError) {
  kg_test::expect_error(
      [] {
        kg::Tensor::zeros(kg::DType::F64, {2, std::int64_t{1} << 60});
      },
      {"f64", "[2, 1152921504606846976]", "2^63 - 1"});
}

TEST(TensorOverflow, WrapWhoseBytesWrapIsAnError) {
  float v = 0;
  kg_test::expect_error([&] { kg::Tensor::wrap(&v, kg::DType::F64, {k2p61}); },
                        {"Tensor::wrap", "f64", "[2305843009213693952]"});
}

TEST(TensorOverflow, ElementCountOverflowIsAnError) {
  kg_test::expect_error(
      [] {
        kg::Tensor::empty(kg::DType::U8, {std::int64_t{1} << 40, std::int64_t{1} << 40});
      },
      {"[1099511627776, 1099511627776]"});
}

TEST(TensorOverflow, LargestBytesThatFitAreCountedExactly) {
  // Wrapped, so nothing is allocated: 2^60 f64 elements are 2^63 bytes, one over the limit;
  // 2^60 - 1 of them, or 2^62 one-byte elements, fit.
  float v = 0;
  const kg::Tensor a = kg::Tensor::wrap(&v, kg::DType::F64, {(std::int64_t{1} << 60) - 1});
  EXPECT_EQ(a.nbytes(), ((std::size_t{1} << 60) - 1) * 8);
  const kg::Tensor b = kg::Tensor::wrap(&v, kg::DType::U8, {std::int64_t{1} << 62});
  EXPECT_EQ(b.nbytes(), std::size_t{1} << 62);
  kg_test::expect_error([&] { kg::Tensor::wrap(&v, kg::DType::F64, {std::int64_t{1} << 60}); },
                        {"f64", "[1152921504606846976]"});
  const kg::Tensor empty = kg::Tensor::wrap(&v, kg::DType::F64, {0, k2p61});
  EXPECT_EQ(empty.nbytes(), 0u);
}
