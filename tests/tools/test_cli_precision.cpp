// kgraph run/inspect --precision and kgraph tune: a 16-bit run agrees with the f32 run on the same
// weights, inspect says which nodes run in it and where the casts are, bad values are usage
// errors, and tune refuses the CPU with a line that says what to use instead.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "kg/io.hpp"
#include "support/cli_util.hpp"
#include "support/test_util.hpp"

using kg_test::CliResult;
using kg_test::expect_one_line_error;
namespace fs = std::filesystem;

namespace {

class CliPrecision : public kg_test::CliTest {
 protected:
  CliResult run(const std::vector<std::string>& args) { return kg_test::run_kgraph(args, "", path("stderr.txt")); }
};

TEST_F(CliPrecision, ABf16RunAgreesWithTheF32Run) {
  const CliResult f32 = run({"run", "lenet5", "--batch", "3", "--seed", "7", "--output", path("f32.safetensors")});
  ASSERT_EQ(f32.code, 0) << f32.err;
  const CliResult low = run({"run", "lenet5", "--batch", "3", "--seed", "7", "--precision", "bf16", "--output",
                             path("bf16.safetensors")});
  ASSERT_EQ(low.code, 0) << low.err;
  EXPECT_NE(low.out.find("on cpu in bf16"), std::string::npos) << low.out;
  const kg::Tensor want = kg::read_safetensors(path("f32.safetensors")).at("logits");
  const kg::Tensor got = kg::read_safetensors(path("bf16.safetensors")).at("logits");
  ASSERT_EQ(got.dtype(), kg::DType::F32);
  double scale = 0;
  for (std::int64_t i = 0; i < want.numel(); ++i) scale = std::max(scale, std::abs(want.item(i)));
  EXPECT_TRUE(kg_test::all_close(got, want, 0.0, 4e-2 * scale));
}

TEST_F(CliPrecision, InspectSaysWhatRunsInTheReducedPrecision) {
  const CliResult r = run({"inspect", "lenet5", "--batch", "2", "--precision", "f16"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("precision f16: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("0 kept in their recorded dtype"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("2 casts: input.to_f16, classifier.4.to_f32"), std::string::npos) << r.out;
}

TEST_F(CliPrecision, BadValuesAreUsageErrors) {
  expect_one_line_error(run({"run", "lenet5", "--precision", "f64"}), 2, {"--precision", "f64"});
  expect_one_line_error(run({"inspect", "lenet5", "--batch", "1", "--precision", "int8"}), 2, {"--precision"});
  expect_one_line_error(run({"tune", "lenet5", "--precision", "half"}), 2, {"--precision"});
  expect_one_line_error(run({"tune"}), 2, {"MODEL"});
}

TEST_F(CliPrecision, TuneNeedsAGpu) {
  expect_one_line_error(run({"tune", "lenet5", "--device", "cpu"}), 1, {"on a GPU", "kgraph run --tune"});
}

}  // namespace
