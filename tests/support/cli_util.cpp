#include "support/cli_util.hpp"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <random>

#include "kg/data.hpp"
#include "kg/tensor.hpp"
#include "support/test_util.hpp"

namespace kg_test {

std::string kgraph_binary() { return std::string(KG_BINARY_DIR) + "/kgraph"; }

namespace fs = std::filesystem;

void CliTest::SetUp() {
  std::string pattern = (fs::temp_directory_path() / "kg-cli-test-XXXXXX").string();
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  dir_ = pattern;
  ASSERT_TRUE(fs::exists(kgraph_binary())) << "build the kgraph target before the tests";
}

void CliTest::TearDown() {
  std::error_code ec;
  if (!dir_.empty()) fs::remove_all(dir_, ec);
}

std::string CliTest::path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

void write_random_idx_dataset(const std::string& dir, std::int64_t n_train, std::int64_t n_test) {
  fs::create_directories(dir);
  std::mt19937_64 rng(fresh_seed());
  for (const bool train : {true, false}) {
    const std::int64_t n = train ? n_train : n_test;
    kg::Tensor img = kg::Tensor::empty(kg::DType::U8, {n, 28, 28});
    kg::Tensor lab = kg::Tensor::empty(kg::DType::U8, {n});
    for (std::int64_t i = 0; i < n * 28 * 28; ++i) img.data<std::uint8_t>()[i] = rng() % 256;
    for (std::int64_t i = 0; i < n; ++i) lab.data<std::uint8_t>()[i] = static_cast<std::uint8_t>(i % 10);
    const std::string stem = train ? "train" : "t10k";
    kg::data::write_idx((fs::path(dir) / (stem + "-images-idx3-ubyte")).string(), img);
    kg::data::write_idx((fs::path(dir) / (stem + "-labels-idx1-ubyte")).string(), lab);
  }
}

std::string shell_quote(const std::string& arg) {
  std::string q = "'";
  for (char c : arg) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

CliResult run_kgraph(const std::vector<std::string>& args, const std::string& env,
                     const std::string& err_path) {
  std::string cmd = "KG_NUM_THREADS=2 " + env + " " + shell_quote(kgraph_binary());
  for (const auto& a : args) cmd += " " + shell_quote(a);
  cmd += " 2>" + shell_quote(err_path);
  CliResult r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) {
    ADD_FAILURE() << "popen failed: " << cmd;
    return r;
  }
  char buf[4096];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.err = read_file(err_path);
  if (WIFEXITED(status)) {
    r.code = WEXITSTATUS(status);
  } else {
    ADD_FAILURE() << cmd << " did not exit normally (status " << status << ")\n" << r.err;
  }
  EXPECT_EQ(r.err.find("terminate called"), std::string::npos) << r.err;
  EXPECT_NE(r.code, 134) << "aborted: " << r.err;
  EXPECT_NE(r.code, 139) << "crashed: " << r.err;
  return r;
}

void expect_one_line_error(const CliResult& r, int code, const std::vector<std::string>& parts) {
  EXPECT_EQ(r.code, code) << r.err;
  EXPECT_EQ(r.err.rfind("kgraph: error: ", 0), 0u) << r.err;
  int lines = 0;
  for (char c : r.err) lines += c == '\n';
  EXPECT_EQ(lines, 1) << r.err;
  for (const auto& p : parts)
    EXPECT_NE(r.err.find(p), std::string::npos) << "error lacks '" << p << "': " << r.err;
}

}  // namespace kg_test
