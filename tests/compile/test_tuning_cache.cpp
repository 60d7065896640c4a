// The tuning cache: choices survive the process (a second cache on the same folder reads them), the
// last stored value wins, damaged lines and another scope's file are ignored, bad text is refused,
// and a folder that is not private keeps the cache in memory.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "compile/tuning_cache.hpp"
#include "kg/error.hpp"
#include "support/test_util.hpp"

namespace fs = std::filesystem;
using kg::compile::TuningCache;

namespace {

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::path(::testing::TempDir()) / (name + "_" + std::to_string(kg_test::fresh_seed()));
  fs::remove_all(d);
  return d;
}

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

TEST(TuningCache, ChoicesSurviveTheProcessAndTheLastOneWins) {
  const fs::path dir = fresh_dir("tuning");
  {
    TuningCache a(dir);
    EXPECT_FALSE(a.find("H200 sm_90 cudnn 91300", "conv fwd bf16 x1,3,224,224"));
    a.store("H200 sm_90 cudnn 91300", "conv fwd bf16 x1,3,224,224", "1");
    a.store("H200 sm_90 cudnn 91300", "conv fwd bf16 x8,64,56,56", "6");
    a.store("H200 sm_90 cudnn 91300", "conv fwd bf16 x1,3,224,224", "7");  // measured again
    a.store("H200 sm_90 cublasLt 130000", "gemm bf16 m4096 n4096 k4096", "00ff 1024");
    EXPECT_EQ(a.find("H200 sm_90 cudnn 91300", "conv fwd bf16 x1,3,224,224"), "7");
  }
  TuningCache b(dir);  // as a later process sees the folder
  EXPECT_EQ(b.find("H200 sm_90 cudnn 91300", "conv fwd bf16 x1,3,224,224"), "7");
  EXPECT_EQ(b.find("H200 sm_90 cudnn 91300", "conv fwd bf16 x8,64,56,56"), "6");
  EXPECT_EQ(b.find("H200 sm_90 cublasLt 130000", "gemm bf16 m4096 n4096 k4096"), "00ff 1024");
  EXPECT_FALSE(b.find("H100 sm_90 cudnn 91300", "conv fwd bf16 x8,64,56,56")) << "scopes are apart";
  EXPECT_NE(b.file("a"), b.file("b"));
  struct stat st {};
  ASSERT_EQ(::stat(b.file("H200 sm_90 cudnn 91300").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0077, 0u) << "the file is the user's alone";
  b.clear();
  EXPECT_FALSE(b.find("H200 sm_90 cudnn 91300", "conv fwd bf16 x8,64,56,56"));
  EXPECT_FALSE(TuningCache(dir).find("H200 sm_90 cudnn 91300", "conv fwd bf16 x8,64,56,56"));
}

TEST(TuningCache, DamagedLinesAndForeignFilesAreIgnored) {
  const fs::path dir = fresh_dir("tuning_damaged");
  const std::string scope = "dev sm_90 cudnn 9";
  {
    TuningCache a(dir);
    a.store(scope, "k1", "1");
    a.store(scope, "k2", "2");
    a.store(scope, "k3", "3");
  }
  const fs::path f = TuningCache(dir).file(scope);
  std::string text = read_all(f);
  // Change k2's value without its digest, and cut the last line short (a crash mid-write).
  const auto at = text.find("k2\t2");
  ASSERT_NE(at, std::string::npos);
  text[at + 3] = '5';
  text.resize(text.size() - 4);
  std::ofstream(f, std::ios::binary | std::ios::trunc) << text;
  TuningCache b(dir);
  EXPECT_EQ(b.find(scope, "k1"), "1");
  EXPECT_FALSE(b.find(scope, "k2")) << "a line whose digest does not match";
  EXPECT_FALSE(b.find(scope, "k3")) << "a line cut short";
  // Another scope's file under this scope's name (a hash collision) is not read.
  fs::copy_file(f, TuningCache(dir).file("other scope"));
  EXPECT_FALSE(TuningCache(dir).find("other scope", "k1"));
}

// A store after a damaged file is still read back: after a last line cut short it starts a line
// of its own, and a file whose header is not the scope's is written anew.
TEST(TuningCache, AStoreAfterDamageIsReadBack) {
  const fs::path dir = fresh_dir("tuning_after_damage");
  const std::string scope = "dev sm_90 cudnn 9";
  fs::path f;
  {
    TuningCache a(dir);
    a.store(scope, "k1", "1");
    f = a.file(scope);
  }
  std::ofstream(f, std::ios::binary | std::ios::app) << "k2\t2\t12";  // a crash mid-line
  {
    TuningCache b(dir);
    EXPECT_FALSE(b.find(scope, "k2"));
    b.store(scope, "k3", "3");
  }
  EXPECT_EQ(TuningCache(dir).find(scope, "k1"), "1");
  EXPECT_EQ(TuningCache(dir).find(scope, "k3"), "3");
  std::ofstream(f, std::ios::binary | std::ios::trunc) << "not a tuning cache\n";
  {
    TuningCache c(dir);
    EXPECT_FALSE(c.find(scope, "k1"));
    c.store(scope, "k4", "4");
  }
  EXPECT_EQ(TuningCache(dir).find(scope, "k4"), "4");
}

TEST(TuningCache, RefusesTextThatWouldBreakTheFile) {
  TuningCache c{fs::path()};
  EXPECT_THROW(c.store("s", "a\tb", "1"), kg::Error);
  EXPECT_THROW(c.store("s", "k", "1\n2"), kg::Error);
  EXPECT_THROW(c.store("", "k", "1"), kg::Error);
  EXPECT_THROW(c.find("s", ""), kg::Error);
  c.store("s", "k", "1");  // memory only
  EXPECT_EQ(c.find("s", "k"), "1");
  EXPECT_TRUE(c.dir().empty());
}

TEST(TuningCache, AFolderOthersCanWriteKeepsItInMemory) {
  const fs::path dir = fresh_dir("tuning_open");
  fs::create_directories(dir);
  fs::permissions(dir, fs::perms::all);  // 0777
  TuningCache c(dir);
  EXPECT_TRUE(c.dir().empty());
  c.store("s", "k", "1");
  EXPECT_EQ(c.find("s", "k"), "1");
  EXPECT_TRUE(fs::is_empty(dir));
}

// The finding: a FIFO in place of a .tune file blocked its open forever, for reading and for
// appending. Both are skipped now (the cache stays in memory for that scope).
TEST(TuningCache, AFifoInPlaceOfTheFileDoesNotBlock) {
  const fs::path dir = fresh_dir("tuning_fifo");
  fs::create_directories(dir);
  TuningCache probe(dir);
  ASSERT_FALSE(probe.dir().empty());
  const fs::path file = probe.file("s");
  ASSERT_EQ(::mkfifo(file.c_str(), 0600), 0);
  TuningCache c(dir);
  EXPECT_EQ(c.find("s", "k"), std::nullopt);
  c.store("s", "k", "1");  // appending to a FIFO without a reader would block too
  EXPECT_EQ(c.find("s", "k"), "1");
  struct stat st {};
  ASSERT_EQ(::lstat(file.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
}

}  // namespace
