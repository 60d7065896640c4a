// DLPack interchange: tensors described the way another framework's producer does are viewed as
// DeviceTensors (checked for device, layout and dtype), run through forward_device on the cpu, and
// the outputs handed back as DLManagedTensors.
#include <gtest/gtest.h>

#include <cstdint>

#include "kg/kg.hpp"
#include "kg/models.hpp"
#include "support/test_util.hpp"

using namespace kg::dlpack;
using kg_test::expect_error;

namespace {

DLTensor describe(void* data, std::vector<std::int64_t>& shape, DLDataType dtype,
                  std::int64_t* strides = nullptr, DLDevice device = {kDLCPU, 0}) {
  return DLTensor{data, device, static_cast<std::int32_t>(shape.size()), dtype, shape.data(), strides, 0};
}

TEST(DlPack, ProducerTensorRunsThroughForwardDeviceAndComesBackAsDlPack) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  kg::Model model = kg::models::build("lenet5");
  const auto in_shape = kg::models::input_shape("lenet5", 2);
  kg::LoadedModel m = model.load(kg::Device::cpu(), {in_shape});
  const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, in_shape);
  const kg::Tensor want = m.forward({x}).at(0);
  // What a producer hands over: its own shape and strides arrays, an offset into its buffer.
  std::vector<float> buffer(static_cast<std::size_t>(x.numel()) + 3);
  std::copy(x.data<float>(), x.data<float>() + x.numel(), buffer.begin() + 3);
  std::vector<std::int64_t> shape = in_shape, strides{784, 784, 28, 1};
  DLTensor t = describe(buffer.data(), shape, {kDLFloat, 32, 1}, strides.data());
  t.byte_offset = 3 * sizeof(float);
  const kg::DeviceTensor in = import_tensor(t, kg::Device::cpu());
  EXPECT_EQ(in.shape, in_shape);
  const auto outs = m.forward_device({in});
  DLManagedTensor* back = export_tensor(outs.at(0), kg::Device::cpu());
  ASSERT_NE(back, nullptr);
  EXPECT_EQ(back->dl_tensor.device.device_type, kDLCPU);
  EXPECT_EQ(back->dl_tensor.ndim, 2);
  EXPECT_EQ(back->dl_tensor.shape[0], 2);
  EXPECT_EQ(back->dl_tensor.shape[1], 10);
  EXPECT_EQ(back->dl_tensor.strides[0], 10);
  EXPECT_EQ(back->dl_tensor.strides[1], 1);
  EXPECT_EQ(back->dl_tensor.dtype.code, kDLFloat);
  const auto* got = static_cast<const float*>(back->dl_tensor.data);
  for (std::int64_t i = 0; i < want.numel(); ++i) EXPECT_EQ(got[i], want.data<float>()[i]) << i;
  back->deleter(back);
}

TEST(DlPack, EveryDtypeRoundTrips) {
  float dummy = 0;
  for (kg::DType d : {kg::DType::Bool, kg::DType::I8, kg::DType::I16, kg::DType::I32, kg::DType::I64,
                      kg::DType::U8, kg::DType::F16, kg::DType::BF16, kg::DType::F32, kg::DType::F64}) {
    SCOPED_TRACE(std::string(kg::dtype_name(d)));
    kg::DeviceTensor t{static_cast<kg::DevicePtr>(reinterpret_cast<std::uintptr_t>(&dummy)), {1}, d};
    DLManagedTensor* m = export_tensor(t, kg::Device::cpu());
    EXPECT_EQ(m->dl_tensor.dtype.bits, 8 * kg::dtype_size(d));
    const kg::DeviceTensor back = import_tensor(m->dl_tensor, kg::Device::cpu());
    EXPECT_EQ(back.dtype, d);
    EXPECT_EQ(back.ptr, t.ptr);
    m->deleter(m);
  }
}

TEST(DlPack, SizeOneDimsMayHaveAnyStride) {
  float data[6] = {};
  std::vector<std::int64_t> shape{2, 1, 3}, strides{3, 99, 1};
  const DLTensor t = describe(data, shape, {kDLFloat, 32, 1}, strides.data());
  EXPECT_EQ(import_tensor(t, kg::Device::cpu()).shape, shape);
}

TEST(DlPack, WhatCannotBeViewedIsAnErrorSayingWhy) {
  float data[6] = {};
  std::vector<std::int64_t> shape{2, 3}, transposed{1, 2};
  expect_error(
      [&] {
        import_tensor(describe(data, shape, {kDLFloat, 32, 1}, transposed.data()), kg::Device::cpu());
      },
      {"dlpack", "[2, 3]", "stride 2 in dim 1", "compact row-major one has 1", "contiguous"});
  expect_error(
      [&] {
        import_tensor(describe(data, shape, {kDLFloat, 32, 2}), kg::Device::cpu());
      },
      {"dlpack", "vector types", "lanes 2"});
  expect_error(
      [&] {
        import_tensor(describe(data, shape, {5, 64, 1}), kg::Device::cpu());
      },
      {"dlpack", "no kernelgraph dtype", "code 5 bits 64"});
  expect_error(
      [&] {
        import_tensor(describe(data, shape, {kDLFloat, 8, 1}), kg::Device::cpu());
      },
      {"dlpack", "no kernelgraph dtype", "code 2 bits 8"});
  expect_error(
      [&] {
        import_tensor(describe(data, shape, {kDLFloat, 32, 1}, nullptr, {kDLCUDA, 0}), kg::Device::cpu());
      },
      {"dlpack", "is on cuda", "device type 2, id 0", "the model runs on cpu"});
  expect_error(
      [&] {
        import_tensor(describe(data, shape, {kDLFloat, 32, 1}, nullptr, {kDLCUDA, 1}), kg::Device::cuda(0));
      },
      {"dlpack", "is on cuda", "id 1", "cuda:0"});
  expect_error(
      [&] {
        import_tensor(describe(data, shape, {kDLFloat, 32, 1}), kg::Device::cuda(0));
      },
      {"dlpack", "is on cpu", "cuda:0"});
  expect_error(
      [&] {
        import_tensor(describe(nullptr, shape, {kDLFloat, 32, 1}), kg::Device::cpu());
      },
      {"dlpack", "no data address"});
  DLTensor bad = describe(data, shape, {kDLFloat, 32, 1});
  bad.ndim = -1;
  expect_error([&] { import_tensor(bad, kg::Device::cpu()); }, {"dlpack", "negative rank -1"});
  bad.ndim = 2;
  bad.shape = nullptr;
  expect_error([&] { import_tensor(bad, kg::Device::cpu()); }, {"dlpack", "without a shape"});
  std::vector<std::int64_t> negative{2, -3};
  expect_error(
      [&] {
        import_tensor(describe(data, negative, {kDLFloat, 32, 1}), kg::Device::cpu());
      },
      {"dlpack", "negative size", "[2, -3]"});
}

}  // namespace
