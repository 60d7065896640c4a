// CUDA's launch limits, checked at load on every device: a grid over 2^31 - 1 blocks in x or
// 65535 in y or z, a block over 1024 threads in x/y or 64 in z, and dynamic shared memory over
// 227 KiB are each an error naming the op, the node, the kernel, the launch and the limit.
#include <gtest/gtest.h>

#include "kg/kg.hpp"
#include "kg/runtime_op.hpp"
#include "lower/dry_run.hpp"
#include "lower/launch_check.hpp"
#include "support/test_util.hpp"

namespace {

const char* kTallSource = R"(
extern "C" __global__ void test_tall(const float* __restrict__ x, float* __restrict__ y, int n) {
  int i = (blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i];
}
)";

// The one launch a test.tall node makes.
struct Shape3 {
  kg::Dim3 grid{1, 1, 1};
  kg::Dim3 block{32, 1, 1};
  std::size_t shared = 0;
};

class TallRuntime final : public kg::RuntimeOp {
 public:
  explicit TallRuntime(Shape3 s) : s_(s) {}
  std::vector<kg::Launch> launches(const kg::LaunchTensors& t) const override {
    kg::Launch L;
    L.grid = s_.grid;
    L.block = s_.block;
    L.shared_bytes = s_.shared;
    L.args.pointer(t.inputs[0].ptr);
    L.args.pointer(t.output.ptr);
    L.args.i32(static_cast<std::int32_t>(t.output.numel()));
    return {L};
  }

 private:
  Shape3 s_;
};

class TallOp final : public kg::CustomOp {
 public:
  explicit TallOp(Shape3 s) : s_(s) {}
  std::string name() const override { return "test.tall"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  std::optional<kg::Lowered> lower(const kg::LowerContext&) const override {
    return kg::Lowered{"test.tall", kTallSource, "test_tall", std::make_shared<TallRuntime>(s_)};
  }
  void cpu_forward(kg::CpuContext& ctx) const override {
    for (std::int64_t i = 0; i < ctx.output.numel(); ++i)
      ctx.output.data<float>()[i] = ctx.inputs[0].data<float>()[i];
  }

 private:
  Shape3 s_;
};

kg::Model model(Shape3 s) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 10});
  kg::SymTensor y = x.record_custom(kg::CustomData::make<TallOp>(s), {}, std::nullopt, "tall");
  return kg::Model(g, {y});
}

// The error at arch 0 (the signature checks, as `kgraph compile` without a GPU) and at load on
// the cpu.
void expect_refused(Shape3 s, const std::vector<std::string>& parts) {
  {
    SCOPED_TRACE("dry run");
    kg_test::expect_error([&] { kg::lower::dry_run(model(s), {{3, 10}}, 0); }, parts);
  }
  SCOPED_TRACE("cpu load");
  kg_test::expect_error([&] { model(s).load(kg::Device::cpu(), {{3, 10}}); }, parts);
}

}  // namespace

TEST(LaunchLimits, GridsAtTheLimitsAreAccepted) {
  kg::lower::dry_run(model({{2147483647u, 1, 1}, {32, 1, 1}, 0}), {{3, 10}}, 0);
  kg::lower::dry_run(model({{1, 65535, 65535}, {1024, 1, 1}, 227 * 1024}), {{3, 10}}, 0);
  kg::lower::dry_run(model({{1, 1, 1}, {1, 16, 64}, 0}), {{3, 10}}, 0);
}

TEST(LaunchLimits, GridYOverTheLimitIsRefused) {
  expect_refused({{1, 70000, 1}, {32, 1, 1}, 0},
                 {"[test.tall @ tall] launch 0 of kernel 'test_tall': grid (1, 70000, 1) has gridDim.y = 70000",
                  "over CUDA's limit of 65535"});
}

TEST(LaunchLimits, GridXAndZOverTheLimitAreRefused) {
  expect_refused({{2147483648u, 1, 1}, {32, 1, 1}, 0},
                 {"[test.tall @ tall] launch 0 of kernel 'test_tall'", "gridDim.x = 2147483648",
                  "over CUDA's limit of 2147483647"});
  expect_refused({{1, 1, 65536}, {32, 1, 1}, 0},
                 {"[test.tall @ tall] launch 0 of kernel 'test_tall'", "gridDim.z = 65536", "limit of 65535"});
}

TEST(LaunchLimits, BlockZOverSixtyFourIsRefused) {
  expect_refused({{1, 1, 1}, {1, 1, 65}, 0},
                 {"[test.tall @ tall] launch 0 of kernel 'test_tall': block (1, 1, 65)", "64 (z)"});
}

TEST(LaunchLimits, SharedMemoryOverTheLimitIsRefused) {
  expect_refused({{1, 1, 1}, {32, 1, 1}, 227 * 1024 + 1},
                 {"[test.tall @ tall] launch 0 of kernel 'test_tall'", "dynamic shared memory of 232449 bytes",
                  "limit of 232448 bytes"});
}

TEST(LaunchLimits, CheckGridNamesTheOutputAndKernel) {
  kg_test::expect_error([] { kg::lower::check_grid({1, 70000, 1}, {4, 5}, "[op @ node]", 2, "k"); },
                        {"[op @ node] launch 2 of kernel 'k': grid (1, 70000, 1) for output [4, 5]",
                         "gridDim.y = 70000"});
}

namespace {

// The seed's default grid (one thread per output element) refuses an output whose block count
// does not fit gridDim.x instead of wrapping it to 32 bits.
class DefaultGridRuntime final : public kg::RuntimeOp {
 public:
  void pack_args(const kg::LaunchTensors&, kg::ArgVisitor&) const override {}
};

TEST(LaunchLimits, DefaultGridRefusesOutputsWhoseBlockCountWraps) {
  DefaultGridRuntime r;
  EXPECT_EQ(r.grid({1000}).x, 4u);
  EXPECT_EQ(r.grid({std::int64_t{1} << 38}).x, 1u << 30);
  kg_test::expect_error([&] { r.grid({std::int64_t{1} << 40}); },
                        {"default grid", "gridDim.x = 4294967296", "over CUDA's limit of 2147483647",
                         "override RuntimeOp::grid()"});
}

}  // namespace
