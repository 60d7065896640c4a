// `kgraph run` and `kgraph compile` at batch sizes too large to hold: each is a one-line error
// and a non-zero exit, never a wrapped byte count, a negative size, an OOM kill or a launch over
// CUDA's grid limits reported as checked.
#include <unistd.h>

#include <filesystem>

#include "support/cli_util.hpp"
#include "support/test_util.hpp"

namespace fs = std::filesystem;

namespace {

class CliSizes : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "kg-cli-sizes-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }
  // Runs kgraph; `prefix` goes before the binary on the command line (variables, a wrapper).
  kg_test::CliResult run(const std::vector<std::string>& args, const std::string& prefix = "") {
    return kg_test::run_kgraph(args, "KG_CACHE_DIR=" + kg_test::shell_quote(dir_ + "/cache") + " " + prefix,
                               dir_ + "/stderr.txt");
  }
  std::string dir_;
};

// No wrapped (2^64 - something) or negative byte count in an error.
void expect_no_wrapped_count(const kg_test::CliResult& r) {
  EXPECT_EQ(r.err.find("1844674407"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("negative size"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("[-"), std::string::npos) << r.err;
}

}  // namespace

TEST_F(CliSizes, RunAtTheLargestBatchIsAOneLineError) {
  const auto r = run({"run", "lenet5", "--random", "--batch", "9223372036854775807"});
  kg_test::expect_one_line_error(r, 1, {"9223372036854775807"});
  expect_no_wrapped_count(r);
  EXPECT_TRUE(r.out.empty()) << r.out;
}

TEST_F(CliSizes, RunAtABatchWhoseBytesOverflowIsAOneLineError) {
  const auto r = run({"run", "lenet5", "--random", "--batch", "100000000000000000"});
  kg_test::expect_one_line_error(r, 1, {"100000000000000000"});
  expect_no_wrapped_count(r);
  EXPECT_EQ(r.err.find("10701493875245056"), std::string::npos) << r.err;  // the wrapped count
}

TEST_F(CliSizes, RunOverTheMemoryLimitIsRefusedBeforeAllocating) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "an AddressSanitizer build reserves more address space than the limit this test sets";
#endif
  // Under a 4 GiB address-space limit the plan for batch 200000 (4.39 GiB) is refused at load,
  // naming the batch and both byte counts; KG_NO_MEMORY_CHECK=1 lets the allocation be tried.
  const std::string limited = "sh -c 'ulimit -v 4194304 && exec \"$0\" \"$@\"'";
  const auto r = run({"run", "lenet5", "--random", "--batch", "200000"}, limited);
  kg_test::expect_one_line_error(r, 1,
                                 {"cannot load lenet5 on cpu", "the memory plan for input 'input' [200000, 1, 28, 28]",
                                  "needs 4712246824 bytes", "are available (RLIMIT_AS", "KG_NO_MEMORY_CHECK=1"});
  const auto unchecked = run({"run", "lenet5", "--random", "--batch", "200000"}, "KG_NO_MEMORY_CHECK=1 " + limited);
  EXPECT_NE(unchecked.code, 0);
  EXPECT_EQ(unchecked.err.find("the memory plan for input"), std::string::npos) << unchecked.err;
}

TEST_F(CliSizes, CompileOverTheGridLimitIsAOneLineError) {
  const auto r = run({"compile", "lenet5", "--batch", "5000000"});
  kg_test::expect_one_line_error(r, 1, {"launch 0 of kernel", "gridDim.y = 78125", "over CUDA's limit of 65535"});
  EXPECT_EQ(r.out.find("every launch packed and checked"), std::string::npos) << r.out;
}
