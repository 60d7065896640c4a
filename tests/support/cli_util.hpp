// Running the built kgraph binary from tests: output captured, exit code checked, and the
// one-line error format asserted.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kg_test {

struct CliResult {
  int code = -1;
  std::string out, err;
};

// The path of the built kgraph binary.
std::string kgraph_binary();

// Runs kgraph with `args` under the environment assignments `env` ("NAME=value ..."), with
// stdout and stderr captured apart (stderr through the file `err_path`). Fails the test if the
// tool aborts, crashes or lets an exception escape.
CliResult run_kgraph(const std::vector<std::string>& args, const std::string& env,
                     const std::string& err_path);

// A failure: exit code `code`, one "kgraph: error: ..." line holding every part.
void expect_one_line_error(const CliResult& r, int code, const std::vector<std::string>& parts);

// Single-quotes an argument for the shell.
std::string shell_quote(const std::string& arg);

// A tiny 10-class IDX data set of random images in `dir` (train and t10k files, as Fashion-MNIST
// names them; the values do not matter to the tests that train on it).
void write_random_idx_dataset(const std::string& dir, std::int64_t n_train, std::int64_t n_test);

// A test of the built tool with a temporary folder of its own, removed after the test.
class CliTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;
  // A path in the test's folder.
  std::string path(const std::string& name) const;

  std::string dir_;
};

}  // namespace kg_test
