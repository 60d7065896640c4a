// `kgraph compile` at a batch whose block counts pass 2^32: the op refuses the grid in one line
// and a non-zero exit, rather than a grid dimension cast to 32 bits, wrapped to a small count
// that the launch check passes and reported as "every launch packed and checked".
#include <unistd.h>

#include <filesystem>

#include "support/cli_util.hpp"
#include "support/test_util.hpp"

namespace fs = std::filesystem;

namespace {

class CliGrid : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "kg-cli-grid-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }
  kg_test::CliResult run(const std::vector<std::string>& args) {
    return kg_test::run_kgraph(args, "KG_CACHE_DIR=" + kg_test::shell_quote(dir_ + "/cache"),
                               dir_ + "/stderr.txt");
  }
  std::string dir_;
};

}  // namespace

TEST_F(CliGrid, CompileAtABatchWhoseRowTilesWrapIsAOneLineError) {
  // 274877907008 rows in tiles of 64 are 2^32 + 1 tiles, which a 32-bit cast made 1.
  const auto r = run({"compile", "lenet5", "--batch", "274877907008"});
  kg_test::expect_one_line_error(
      r, 1,
      {"[kg.fused_gemm @ classifier.0] launch 0 of kernel 'kg_epilogue_",  // the ReLU is its epilogue
       "' over 274877907008 rows in tiles of 64",
       "gridDim.y = 4294967297", "over CUDA's limit of 65535"});
  EXPECT_EQ(r.out.find("every launch packed and checked"), std::string::npos) << r.out;
}
