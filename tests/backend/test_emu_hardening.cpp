// The emulator's source scanner on hostile declarations, and its shared-object cache against
// files cut short.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "backend/emu/host_jit.hpp"
#include "compile/compiler.hpp"
#include "kg/error.hpp"
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

// ---------------------------------------------------------------------------------------------
// The finding: the emulator dlopen()ed <cache>/emu/<key>.so without checking who could write the
// folder, so a library planted in a world-writable cache folder, another user's, or behind an emu/
// link ran its constructor in our process. The planted library here is sealed like a real cache
// entry (the seal guards against accidents, not against a writer), so only the folder check
// stands between it and dlopen.

namespace {

// A sealed shared object whose constructor creates `marker`; empty when no host compiler builds it.
std::string planted_library(const fs::path& work, const fs::path& marker) {
  fs::create_directories(work);
  const fs::path src = work / "planted.cpp", so = work / "planted.so";
  {
    std::ofstream f(src);
    f << "#include <fcntl.h>\n#include <unistd.h>\n"
         "__attribute__((constructor)) static void planted() {\n"
         "  int fd = ::open(\"" << marker.string() << "\", O_WRONLY | O_CREAT, 0600);\n"
         "  if (fd >= 0) ::close(fd);\n}\n";
  }
  const std::string cmd = kg::emu::HostJit::compiler() + " -shared -fPIC -o '" + so.string() + "' '" + src.string() +
                          "' >/dev/null 2>&1";
  if (std::system(cmd.c_str()) != 0) return {};
  std::ifstream in(so, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return kg::compile::seal_cache_file(bytes);
}

void put(const fs::path& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

TEST(EmuHardening, PlantedLibraryInAnUntrustedCacheFolderNeverRuns) {
  const fs::path root = fresh_dir("planted");
  fs::create_directories(root);
  const fs::path marker = root / "constructor-ran";
  const std::string lib = planted_library(root / "build", marker);
  if (lib.empty()) GTEST_SKIP() << "no host C++ compiler to build the planted library";
  // The module's key, from a build in a private folder.
  kg::emu::HostJit honest(root / "private");
  const std::string name = honest.load("test.scale", kScale)->path.filename().string();

  // 1. A world-writable folder with the library at the module's name.
  const fs::path shared = root / "shared";
  fs::create_directories(shared);
  put(shared / name, lib);
  fs::permissions(shared, fs::perms::all);
  kg::emu::HostJit open_jit(shared);
  const auto mod = open_jit.load("test.scale", kScale);
  EXPECT_FALSE(fs::exists(marker)) << "the planted constructor ran";
  EXPECT_FALSE(mod->from_disk);
  EXPECT_EQ(open_jit.stats().untrusted_folders, 1);
  EXPECT_NE(mod->path.parent_path(), shared) << "the module was built elsewhere";
  ASSERT_EQ(mod->entries.size(), 1u);
  EXPECT_NE(mod->entries[0].run, nullptr);

  // 2. A private cache folder whose emu/ is a link to a folder holding the library.
  const fs::path base = root / "cache", elsewhere = root / "elsewhere";
  fs::create_directories(base);
  fs::create_directories(elsewhere);
  put(elsewhere / name, lib);
  fs::create_directory_symlink(elsewhere, base / "emu");
  kg::emu::HostJit linked = kg::emu::HostJit::in_cache(base);
  EXPECT_FALSE(linked.load("test.scale", kScale)->from_disk);
  EXPECT_FALSE(fs::exists(marker)) << "the planted constructor ran through an emu/ link";
  EXPECT_EQ(linked.stats().untrusted_folders, 1);

  // 3. The same library in a private folder is served (the test's planted file is well-formed:
  // only the folder check kept it out above).
  const fs::path mine = root / "mine";
  fs::create_directories(mine);
  put(mine / name, lib);
  kg::emu::HostJit trusted(mine);
  try {
    trusted.load("test.scale", kScale);
  } catch (const std::exception&) {
    // It has no kg_emu_bind: loading fails after dlopen, which is the point.
  }
  EXPECT_TRUE(fs::exists(marker)) << "control: dlopen of the planted library in a private folder runs it";
  fs::permissions(shared, fs::perms::owner_all);
  fs::remove_all(root);
}

// The finding: a FIFO in place of a cached module blocked the load forever; a huge file was read
// whole. Both are skipped (the module is built again) without blocking.
TEST(EmuHardening, FifoOrHugeFileInPlaceOfACachedModuleIsSkipped) {
  const fs::path root = fresh_dir("fifo");
  kg::emu::HostJit honest(root / "a");
  const std::string name = honest.load("test.scale", kScale)->path.filename().string();
  fs::create_directories(root / "b");
  ASSERT_EQ(::mkfifo((root / "b" / name).c_str(), 0600), 0);
  kg::emu::HostJit jit(root / "b");
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(jit.load("test.scale", kScale), kg::Error);  // the FIFO cannot be replaced: an error, not a hang
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 60.0);
  fs::remove_all(root);
}
