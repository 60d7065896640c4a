#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "compile/compiler.hpp"
#include "compile/ptx.hpp"
#include "support/test_util.hpp"

namespace fs = std::filesystem;
using kg::compile::Compiler;

namespace {

const char* kSaxpy = R"(
extern "C" __global__ void __launch_bounds__(128) saxpy(const float* __restrict__ x, float* y, float a, int n,
                                                      long long stride) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i * stride] += a * x[i];
}
)";

fs::path fresh_dir(const std::string& tag) {
  fs::path d = fs::temp_directory_path() / ("kg-cache-test-" + tag + "-" + std::to_string(kg_test::fresh_seed()));
  fs::remove_all(d);
  return d;
}

}  // namespace

TEST(Compiler, CompilesToPtxAndParsesTheEntry) {
  if (!Compiler::available()) GTEST_SKIP() << "built without NVRTC";
  Compiler c(fresh_dir("a"));
  auto r = c.compile("test.saxpy", kSaxpy, 90);
  EXPECT_FALSE(r.from_disk);
  EXPECT_EQ(kg::compile::ptx_target(r.ptx), "sm_90");
  auto entries = kg::compile::parse_ptx_entries(r.ptx);
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].name, "saxpy");
  ASSERT_EQ(entries[0].params.size(), 5u);
  EXPECT_EQ(entries[0].params[0].bytes, 8u);
  EXPECT_EQ(entries[0].params[2].type, ".f32");
  EXPECT_EQ(entries[0].params[3].bytes, 4u);
  EXPECT_EQ(entries[0].params[4].bytes, 8u);
  ASSERT_TRUE(entries[0].maxntid.has_value());
  EXPECT_EQ(entries[0].maxntid->x, 128u);
  EXPECT_EQ(kg::compile::kernel_param_names(kSaxpy, "saxpy"),
            (std::vector<std::string>{"x", "y", "a", "n", "stride"}));
}

TEST(Compiler, DiskCacheKeepsSourceBesidePtxAndServesTheSecondCompile) {
  if (!Compiler::available()) GTEST_SKIP() << "built without NVRTC";
  fs::path dir = fresh_dir("b");
  auto first = Compiler(dir).compile("test.saxpy", kSaxpy, 90);
  EXPECT_TRUE(fs::exists(dir / (first.key + ".ptx")));
  EXPECT_TRUE(fs::exists(dir / (first.key + ".cu")));
  Compiler again(dir);  // a new process would see the same directory
  auto second = again.compile("test.saxpy", kSaxpy, 90);
  EXPECT_TRUE(second.from_disk);
  EXPECT_EQ(second.ptx, first.ptx);
  auto third = again.compile("test.saxpy", kSaxpy, 90);
  EXPECT_TRUE(third.from_memory);
  // A different arch is a different key.
  auto other = again.compile("test.saxpy", kSaxpy, 80);
  EXPECT_NE(other.key, first.key);
  EXPECT_EQ(kg::compile::ptx_target(other.ptx), "sm_80");
  // No temporary files are left behind.
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << e.path();
  fs::remove_all(dir);
}

TEST(Compiler, ConcurrentCompilesOfOneSourceAgree) {
  if (!Compiler::available()) GTEST_SKIP() << "built without NVRTC";
  fs::path dir = fresh_dir("c");
  std::vector<std::string> ptx(3);
  std::vector<std::thread> ts;
  for (int i = 0; i < 3; ++i)
    ts.emplace_back([&, i] { ptx[static_cast<std::size_t>(i)] = Compiler(dir).compile("t", kSaxpy, 90).ptx; });
  for (auto& t : ts) t.join();
  EXPECT_EQ(ptx[0], ptx[1]);
  EXPECT_EQ(ptx[1], ptx[2]);
  fs::remove_all(dir);
}

TEST(Compiler, CompileErrorCarriesTheFullLogAndTheOpName) {
  if (!Compiler::available()) GTEST_SKIP() << "built without NVRTC";
  Compiler c(fresh_dir("d"));
  kg_test::expect_error([&] { c.compile("user.broken", "extern \"C\" __global__ void k() { undeclared_thing = 1; }", 90); },
                        {"[user.broken]", "NVRTC failed", "user.broken.cu", "undeclared_thing", "sm_90"});
}

TEST(Compiler, PtxSourceIsTakenAsIs) {
  if (!Compiler::available()) GTEST_SKIP() << "built without NVRTC";
  Compiler c(fresh_dir("e"));
  auto ptx = c.compile("test.saxpy", kSaxpy, 90).ptx;
  auto r = c.compile("from.triton", ptx, 90);
  EXPECT_TRUE(r.was_ptx);
  EXPECT_EQ(r.ptx, ptx);
}

TEST(Ptx, RejectsTextThatIsNotPtx) {
  kg_test::expect_error([] { kg::compile::parse_ptx_entries("hello"); }, {"not PTX"});
}

TEST(Ptx, EntryMatchingAcceptsCppMangling) {
  EXPECT_TRUE(kg::compile::entry_matches("_Z5saxpyPKfPffi", "saxpy"));
  EXPECT_TRUE(kg::compile::entry_matches("saxpy", "saxpy"));
  EXPECT_FALSE(kg::compile::entry_matches("_Z6saxpy2Pf", "saxpy"));
}
