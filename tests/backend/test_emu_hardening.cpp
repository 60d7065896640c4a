// The emulator's source scanner on hostile declarations, and its shared-object cache against
// files cut short.
#include <gtest/gtest.h>

#include <filesystem>

#include "backend/emu/host_jit.hpp"
#include "support/test_util.hpp"

namespace fs = std::filesystem;

namespace {

fs::path fresh_dir(const std::string& tag) {
  fs::path d =
      fs::temp_directory_path() / ("kg-emu-harden-" + tag + "-" + std::to_string(kg_test::fresh_seed()));
  fs::remove_all(d);
  return d;
}

const char* kScale = R"(
extern "C" __global__ void scale(float* y, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] *= a;
}
)";

}  // namespace

TEST(EmuHardening, HugeExternSharedDeclarationIsRewritten) {
  const std::string ws(40 * 1024, ' ');
  const std::string src = "__global__ void k(float* y) {\n  extern __shared__" + ws + "__align__(16)" + ws +
                          "float" + ws + "smem" + ws + "[" + ws + "]" + ws + ";\n  y[0] = smem[0];\n}\n";
  const std::string out = kg::emu::rewrite_dynamic_shared(src);
  EXPECT_NE(out.find("float* const smem = reinterpret_cast<float*>(kg_emu_dynamic_shared());"),
            std::string::npos);
}

TEST(EmuHardening, ExternSharedRewriteKeepsItsAnswers) {
  const std::string src =
      "extern __shared__ __attribute__((aligned(8))) double table[];\n"
      "__global__ void k(float* y) {\n  extern   __shared__ alignas(16) unsigned  int  bits [ ] ;\n"
      "  extern __shared__ float not_an_array;\n  extern __shared__ float 9bad[];\n"
      "  my_extern __shared__ float x[];\n  y[0] = bits[0] + table[0];\n}\n";
  const std::string out = kg::emu::rewrite_dynamic_shared(src);
  EXPECT_NE(out.find("#define table (reinterpret_cast<double*>(kg_emu_dynamic_shared()))\n#line 1\n"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("unsigned int* const bits = reinterpret_cast<unsigned int*>(kg_emu_dynamic_shared());"),
            std::string::npos)
      << out;
  // Left for the compiler to report, untouched.
  EXPECT_NE(out.find("extern __shared__ float not_an_array;"), std::string::npos);
  EXPECT_NE(out.find("extern __shared__ float 9bad[];"), std::string::npos);
  EXPECT_NE(out.find("my_extern __shared__ float x[];"), std::string::npos);
}

TEST(EmuHardening, TruncatedCachedSharedObjectIsRebuilt) {
  const fs::path a = fresh_dir("a"), b = fresh_dir("b");
  kg::emu::HostJit first(a);
  const auto mod = first.load("test.scale", kScale);
  ASSERT_TRUE(fs::exists(mod->path));
  // The same key in another folder (a path this process has not opened yet), cut in half.
  fs::create_directories(b);
  fs::copy_file(mod->path, b / mod->path.filename());
  fs::resize_file(b / mod->path.filename(), fs::file_size(mod->path) / 2);
  kg::emu::HostJit second(b);
  const auto again = second.load("test.scale", kScale);
  EXPECT_FALSE(again->from_disk);
  EXPECT_EQ(second.stats().compiled, 1);
  EXPECT_EQ(again->key, mod->key);
  ASSERT_EQ(again->entries.size(), 1u);
  EXPECT_NE(again->entries[0].run, nullptr);
  // A whole file is served from disk.
  kg::emu::HostJit third(b);
  EXPECT_TRUE(third.load("test.scale", kScale)->from_disk);
  fs::remove_all(a);
  fs::remove_all(b);
}
