// `kgraph compile`, run as a program: kernels listed per node or per file, the disk cache
// warmed and then used, and one-line errors.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "compile/compiler.hpp"
#include "compile/embedded_sources.hpp"
#include "kg/cuda.hpp"
#include "kg/models.hpp"
#include "lower/dry_run.hpp"
#include "lower/lowering.hpp"
#include "support/cli_util.hpp"
#include "support/test_util.hpp"

namespace fs = std::filesystem;

namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> v;
  std::istringstream is(text);
  std::string line;
  while (std::getline(is, line)) v.push_back(line);
  return v;
}

// The output line that starts with `first` followed by a space.
std::string line_starting(const std::string& text, const std::string& first) {
  for (const auto& l : lines_of(text))
    if (l.rfind(first + " ", 0) == 0) return l;
  return "";
}

class CliCompile : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "kg-cli-compile-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    cache_ = (fs::path(dir_) / "cache").string();
    binary_ = kg_test::kgraph_binary();
    ASSERT_TRUE(fs::exists(binary_)) << binary_ << " is missing: build the kgraph target before the tests";
  }
  void TearDown() override {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }

  // Runs kgraph with `args` and a cache directory of this test's own.
  kg_test::CliResult run(const std::vector<std::string>& args) {
    return kg_test::run_kgraph(args, "KG_CACHE_DIR=" + kg_test::shell_quote(cache_),
                               (fs::path(dir_) / "stderr.txt").string());
  }

  // A one-line error and nothing on stdout.
  void expect_one_line_error(const kg_test::CliResult& r, int code, const std::vector<std::string>& parts) {
    kg_test::expect_one_line_error(r, code, parts);
    EXPECT_EQ(r.out, "");
  }

  int cached_ptx_files() const {
    int n = 0;
    std::error_code ec;
    if (!fs::exists(cache_)) return 0;
    for (const auto& e : fs::directory_iterator(cache_, ec)) n += e.path().extension() == ".ptx";
    return n;
  }

  std::string dir_, cache_, binary_;
};

}  // namespace

TEST_F(CliCompile, Lenet5ListsEveryKernelAndWarmsTheCache) {
  if (!kg::compile::Compiler::available()) GTEST_SKIP() << "built without NVRTC";
  const kg::Model model = kg::models::build("lenet5");
  // The lowering `kgraph compile` does for batch 3 (arch 0: the signature checks only, no NVRTC).
  const kg::lower::LoweredGraph lowered =
      kg::lower::dry_run(model, {kg::models::input_shape("lenet5", 3)}, 0).lowered;
  int kernels = 0;
  for (const auto& e : lowered.executables) kernels += !e.view;
  ASSERT_GT(kernels, 0);

  for (int pass = 0; pass < 2; ++pass) {
    SCOPED_TRACE(pass == 0 ? "cold cache" : "warm cache");
    auto r = run({"compile", "lenet5", "--arch", "90", "--batch", "3"});
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(r.err, "");
    EXPECT_NE(r.out.find("sm_90"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("batch 3"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(cache_), std::string::npos) << "the cache directory is named\n" << r.out;
    int disk = 0;
    for (const auto& e : lowered.executables) {
      if (e.view) continue;
      const kg::Node& n = model.graph().node(e.node);
      const std::string line = line_starting(r.out, n.name);
      ASSERT_FALSE(line.empty()) << "no line for " << n.name << "\n" << r.out;
      EXPECT_NE(line.find(e.name), std::string::npos) << line;
      if (!e.entry_point.empty()) {
        EXPECT_NE(line.find(e.entry_point), std::string::npos) << line;
      }
      EXPECT_NE(line.find("grid ("), std::string::npos) << line;
      if (pass == 0) {
        EXPECT_TRUE(line.find(" compiled ") != std::string::npos ||
                    line.find(" memory ") != std::string::npos)
            << line;
      } else {
        EXPECT_EQ(line.find(" compiled "), std::string::npos)
            << "the second run must hit the cache: " << line;
      }
      disk += line.find(" disk ") != std::string::npos;
    }
    if (pass == 1) {
      EXPECT_GT(disk, 0) << r.out;
    }
    EXPECT_NE(r.out.find(std::to_string(kernels) + (kernels == 1 ? " kernel" : " kernels")),
              std::string::npos)
        << r.out;
    EXPECT_GT(cached_ptx_files(), 0);
  }
}

TEST_F(CliCompile, AllCompilesEveryBuiltInKernelFile) {
  if (!kg::compile::Compiler::available()) GTEST_SKIP() << "built without NVRTC";
  auto r = run({"compile", "--all", "--arch", "90"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto files = kg::compile::kernel_files();
  ASSERT_FALSE(files.empty());
  for (const auto& f : files) {
    const std::string line = line_starting(r.out, f);
    ASSERT_FALSE(line.empty()) << f << "\n" << r.out;
    EXPECT_NE(line.find(" compiled "), std::string::npos) << line;
    EXPECT_NE(line.find("kg_"), std::string::npos) << "no entry point listed: " << line;
  }
  EXPECT_EQ(cached_ptx_files(), static_cast<int>(files.size()));
  auto again = run({"compile", "--all", "--arch", "90"});
  ASSERT_EQ(again.code, 0) << again.err;
  for (const auto& f : files)
    EXPECT_NE(line_starting(again.out, f).find(" disk "), std::string::npos) << again.out;
}

TEST_F(CliCompile, BadArgumentsErrorInOneLine) {
  if (!kg::compile::Compiler::available()) GTEST_SKIP() << "built without NVRTC";
  const auto archs = kg::cuda::compile_archs();
  ASSERT_FALSE(archs.empty());
  expect_one_line_error(run({"compile", "lenet5", "--arch", "7"}), 1,
                        {"--arch 7", "not an architecture", std::to_string(archs.front()), "90"});
  expect_one_line_error(run({"compile", "--all", "--arch", "91"}), 1, {"--arch 91"});
  expect_one_line_error(run({"compile", "lenet5", "--arch", "0"}), 2, {"--arch"});
  expect_one_line_error(run({"compile", "lenet5", "--arch", "sm_90"}), 2, {"--arch", "sm_90"});
  expect_one_line_error(run({"compile", "lenet5", "--batch", "0"}), 2, {"--batch"});
  expect_one_line_error(run({"compile", "lenet6", "--arch", "90"}), 1, {"unknown model 'lenet6'", "lenet5"});
  expect_one_line_error(run({"compile"}), 1, {"MODEL", "--all"});
  expect_one_line_error(run({"compile", "lenet5", "--all"}), 1, {"MODEL", "--all", "not both"});
  expect_one_line_error(run({"compile", "--all", "--batch", "2"}), 1, {"--batch", "--all"});
  EXPECT_EQ(cached_ptx_files(), 0) << "nothing is compiled when the arguments are wrong";
}

TEST_F(CliCompile, HelpListsTheOptions) {
  auto r = run({"compile", "--help"});
  EXPECT_EQ(r.code, 0) << r.err;
  for (const char* part : {"MODEL", "--arch", "--batch", "--dim", "--all"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  auto top = run({"--help"});
  EXPECT_NE(top.out.find("compile"), std::string::npos) << top.out;
}
