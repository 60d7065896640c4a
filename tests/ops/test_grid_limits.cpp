// Block counts over CUDA's grid limits in the built-in ops' GPU launches: a count that a kernel
// takes one tile per block of (no grid-stride loop) is refused by the op with an error naming
// the launch, the work and the limit, rather than cast to 32 bits, where it wraps to a small grid
// that the launch check passes and that would leave most of the output unwritten. Nothing is
// allocated: dry runs where the parameters are small, the node's RuntimeOp asked directly with
// made-up addresses where a dry run would initialise a huge weight.
#include <gtest/gtest.h>

#include "kg/kg.hpp"
#include "lower/dry_run.hpp"
#include "ops/conv_gpu.hpp"
#include "ops/gpu_util.hpp"
#include "support/test_util.hpp"

namespace {

// 2^32 + 1 tiles of 64: the count a 32-bit cast wraps to 1.
constexpr std::int64_t kWrapsToOne = 64 * ((std::int64_t{1} << 32) + 1);

void dry_run(const kg::Model& m, const std::vector<std::vector<std::int64_t>>& shapes) {
  kg::lower::dry_run(m, shapes, 0);
}

}  // namespace

TEST(GridLimits, GridDimRefusesCountsOverEachAxisLimit) {
  EXPECT_EQ(kg::ops::grid_dim(2147483647, 'x', "w"), 2147483647u);
  EXPECT_EQ(kg::ops::grid_dim(65535, 'y', "w"), 65535u);
  EXPECT_EQ(kg::ops::grid_dim(0, 'z', "w"), 1u);  // an empty launch: one idle block
  kg_test::expect_error([] { kg::ops::grid_dim(2147483648, 'x', "the launch"); },
                        {"the launch needs gridDim.x = 2147483648", "over CUDA's limit of 2147483647"});
  kg_test::expect_error([] { kg::ops::grid_dim(65536, 'y', "w"); }, {"gridDim.y = 65536", "limit of 65535"});
  kg_test::expect_error([] { kg::ops::grid_dim(std::int64_t{1} << 32, 'z', "w"); },
                        {"gridDim.z = 4294967296", "limit of 65535"});
}

TEST(GridLimits, LinearRowsWhoseTileCountWrapsAreAnError) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 16});
  const kg::Model m(g, {kg::nn::linear(x, 10, "fc")});
  kg_test::expect_error(
      [&] {
        dry_run(m, {{kWrapsToOne, 16}});
      },
      {"[nn.linear @ fc] launch 0 of kernel 'kg_linear_f32' over 274877907008 rows in tiles of 64",
       "gridDim.y = 4294967297", "over CUDA's limit of 65535"});
  // Just over the y limit: the op's error too, not the launch check's.
  kg_test::expect_error(
      [&] {
        dry_run(m, {{64 * 65535 + 1, 16}});
      },
      {"rows in tiles of 64", "gridDim.y = 65536"});
  dry_run(m, {{64 * 65535, 16}});  // at the limit
}

TEST(GridLimits, LinearOutputFeaturesWhoseTileCountWrapsAreAnError) {
  // A dry run would initialise the 2^38-row weight, so the node's RuntimeOp is asked directly.
  auto [x, g] = kg::SymTensor::input(kg::DType::F64, {kg::Dim::named("batch"), 4});
  const kg::SymTensor y = kg::nn::linear(x, kWrapsToOne, "fc", false);
  const std::optional<kg::Lowered> l = g->node(y.node()).op->op().lower(kg::LowerContext{});
  ASSERT_TRUE(l && l->runtime_op);
  kg::LaunchTensors t;
  t.inputs = {{0x1000, {2, 4}, kg::DType::F64}};
  t.params = {{0x2000, {kWrapsToOne, 4}, kg::DType::F64}};
  t.output = {0x3000, {2, kWrapsToOne}, kg::DType::F64};
  kg_test::expect_error(
      [&] { l->runtime_op->launches(t); },
      {"launch 0 of kernel 'kg_linear_f64' over 274877907008 output features in tiles of 64",
       "gridDim.x = 4294967297", "over CUDA's limit of 2147483647"});
}

TEST(GridLimits, MatmulColumnsWhoseTileCountWrapsAreAnError) {
  auto g = kg::Graph::create();
  auto a = g->input(kg::DType::F32, kg::Shape{2, 4}, "a");
  auto b = g->input(kg::DType::F32, kg::Shape{4, kg::Dim::named("n")}, "b");
  const kg::Model m(g, {kg::matmul(a, b, "mm")});
  kg_test::expect_error(
      [&] {
        dry_run(m, {{2, 4}, {4, kWrapsToOne}});
      },
      {"[nn.matmul @ mm] launch 0 of kernel 'kg_matmul_f32' over 274877907008 columns",
       "gridDim.x = 4294967297", "over CUDA's limit of 2147483647"});
}

TEST(GridLimits, ConvGemmChannelTilesOverTheLimitAreAnError) {
  // 32 input channels and a 1x1 kernel: the implicit-GEMM kernel, a tile of 64 output channels
  // per block along y. The RuntimeOp is asked directly (a dry run would initialise the weight).
  kg::ops::ConvGpuConfig cfg;
  cfg.in_channels = 32;
  cfg.out_channels = kWrapsToOne;
  cfg.options.bias = false;
  ASSERT_EQ(kg::ops::conv_gpu_algo(cfg), kg::ops::ConvGpuAlgo::Gemm);
  const kg::Lowered l = kg::ops::lower_conv(cfg, "nn.conv2d");
  kg::LaunchTensors t;
  t.inputs = {{0x1000, {1, 32, 1, 1}, kg::DType::F32}};
  t.params = {{0x2000, {kWrapsToOne, 32, 1, 1}, kg::DType::F32}};
  t.output = {0x3000, {1, kWrapsToOne, 1, 1}, kg::DType::F32};
  kg_test::expect_error(
      [&] { l.runtime_op->launches(t); },
      {"launch 0 of the gemm kernel over 274877907008 output channels a group in tiles of 64",
       "gridDim.y = 4294967297", "over CUDA's limit of 65535"});
  // At the limit: 65535 tiles.
  cfg.out_channels = 64 * 65535;
  t.params[0].shape[0] = t.output.shape[1] = cfg.out_channels;
  const std::vector<kg::Launch> ok = kg::ops::lower_conv(cfg, "nn.conv2d").runtime_op->launches(t);
  ASSERT_EQ(ok.size(), 1u);
  EXPECT_EQ(ok[0].grid.y, 65535u);
}
