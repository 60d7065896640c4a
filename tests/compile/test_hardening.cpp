// Hostile input to the PTX reader and the kernel caches: text that made std::regex recurse past the
// stack, numbers that overflowed or truncated, names that were spliced into a regex, cache files
// cut short, and a shared cache folder that another user could write to.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "compile/compiler.hpp"
#include "compile/cuda_source.hpp"
#include "compile/ptx.hpp"
#include "support/test_util.hpp"

namespace fs = std::filesystem;
using kg::compile::Compiler;
using namespace std::string_literals;

namespace {

std::string ptx_module(const std::string& entry_text) {
  return ".version 8.0\n.target sm_90\n.address_size 64\n\n" + entry_text;
}

fs::path fresh_dir(const std::string& tag) {
  fs::path d = fs::temp_directory_path() / ("kg-harden-" + tag + "-" + std::to_string(kg_test::fresh_seed()));
  fs::remove_all(d);
  return d;
}

// Sets (or with nullopt, unsets) an environment variable for the life of the object.
class EnvVar {
 public:
  EnvVar(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      ::setenv(name, value->c_str(), 1);
    else
      ::unsetenv(name);
  }
  ~EnvVar() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

const char* kSaxpy = R"(
extern "C" __global__ void saxpy(const float* x, float* y, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}
)";

}  // namespace

// --- std::regex recursion on long whitespace runs -------------------------------------------------

TEST(Hardening, PtxParamLineWithAHugeWhitespaceRunParses) {
  const std::string ws(200 * 1024, ' ');
  const std::string ptx = ptx_module(".visible .entry k(\n  .param .u64" + ws + "k_param_0,\n  .param" + ws +
                                     ".align" + ws + "4 .b8 k_param_1[12]\n)\n.reqntid" + ws + "32," + ws +
                                     "2\n{\n ret;\n}\n");
  const auto entries = kg::compile::parse_ptx_entries(ptx);
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].name, "k");
  EXPECT_TRUE(entries[0].visible);
  ASSERT_EQ(entries[0].params.size(), 2u);
  EXPECT_EQ(entries[0].params[0].ptx_name, "k_param_0");
  EXPECT_EQ(entries[0].params[0].bytes, 8u);
  EXPECT_EQ(entries[0].params[1].bytes, 12u);
  EXPECT_EQ(entries[0].params[1].align, 4u);
  ASSERT_TRUE(entries[0].reqntid.has_value());
  EXPECT_EQ(entries[0].reqntid->x, 32u);
  EXPECT_EQ(entries[0].reqntid->y, 2u);
  EXPECT_EQ(kg::compile::ptx_target(".version 8.0\n.target" + ws + "sm_80\n"), "sm_80");
}

TEST(Hardening, PtxReaderKeepsItsAnswersOnOrdinaryPtx) {
  const std::string ptx = ptx_module(
      "// a comment\n.weak .entry _Z4axpyPfS_(\n\t.param .u64 .ptr .global .align 4 _Z4axpyPfS__param_0,\n"
      "\t.param .f32 _Z4axpyPfS__param_1,\n\t.param .align 8 .b8 _Z4axpyPfS__param_2[24]\n)\n"
      ".maxntid 128, 1, 1\n{\n ret;\n}\n"
      ".visible .entry plain(\n)\n.reqntid 64\n{\n ret;\n}\n.entry noparen\n");
  const auto entries = kg::compile::parse_ptx_entries(ptx);
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].name, "_Z4axpyPfS_");
  EXPECT_FALSE(entries[0].visible);
  ASSERT_EQ(entries[0].params.size(), 3u);
  EXPECT_EQ(entries[0].params[0].type, ".u64");
  EXPECT_EQ(entries[0].params[0].ptx_name, "_Z4axpyPfS__param_0");
  EXPECT_EQ(entries[0].params[0].align, 8u);
  EXPECT_EQ(entries[0].params[1].type, ".f32");
  EXPECT_EQ(entries[0].params[1].bytes, 4u);
  EXPECT_EQ(entries[0].params[2].bytes, 24u);
  EXPECT_EQ(entries[0].params[2].align, 8u);
  ASSERT_TRUE(entries[0].maxntid.has_value());
  EXPECT_EQ(entries[0].maxntid->x, 128u);
  EXPECT_EQ(entries[0].maxntid->y, 1u);
  EXPECT_FALSE(entries[0].reqntid.has_value());
  EXPECT_EQ(entries[1].name, "plain");
  EXPECT_TRUE(entries[1].visible);
  EXPECT_TRUE(entries[1].params.empty());
  ASSERT_TRUE(entries[1].reqntid.has_value());
  EXPECT_EQ(entries[1].reqntid->x, 64u);
  EXPECT_EQ(entries[1].reqntid->y, 1u);
  EXPECT_EQ(kg::compile::ptx_target(ptx), "sm_90");
  EXPECT_EQ(kg::compile::ptx_target("no target here"), "");
}

TEST(Hardening, KernelSignatureWithAHugeDeclarationIsRead) {
  const std::string ws(200 * 1024, ' ');
  const std::string src = "extern \"C\" __global__ void" + ws + "k(const float" + ws + "* __restrict__" + ws +
                          "x, int" + ws + "n) {}\n";
  const auto ks = kg::compile::find_kernels(src);
  ASSERT_EQ(ks.size(), 1u);
  EXPECT_EQ(ks[0].param_names, (std::vector<std::string>{"x", "n"}));
  EXPECT_EQ(ks[0].param_types[0], "const float*");
  EXPECT_EQ(kg::compile::kernel_param_names(src, "k"), (std::vector<std::string>{"x", "n"}));
}

// --- numbers and names in the PTX reader -------------------------------------------------------

TEST(Hardening, PtxThreadCountOutOfRangeIsAKgError) {
  const auto with = [](const std::string& directive) {
    return ptx_module(".visible .entry k(\n)\n" + directive + "\n{\n ret;\n}\n");
  };
  kg_test::expect_error([&] { kg::compile::parse_ptx_entries(with(".reqntid 99999999999999999999999")); },
                        {"'k'", ".reqntid", "99999999999999999999999", "4294967295"});
  // 2^32 used to wrap silently to 0.
  kg_test::expect_error([&] { kg::compile::parse_ptx_entries(with(".maxntid 1, 4294967296")); },
                        {".maxntid", "4294967296"});
  EXPECT_EQ(kg::compile::parse_ptx_entries(with(".maxntid 4294967295"))[0].maxntid->x, 4294967295u);
  kg_test::expect_error(
      [&] {
        kg::compile::parse_ptx_entries(
            ptx_module(".visible .entry k(\n.param .align 99999999999999999999 .b8 k_param_0[4]\n)\n{\n}\n"));
      },
      {"'k'", ".align", "99999999999999999999"});
  kg_test::expect_error(
      [&] {
        kg::compile::parse_ptx_entries(
            ptx_module(".visible .entry k(\n.param .b8 k_param_0[18446744073709551617]\n)\n{\n}\n"));
      },
      {"'k'", "k_param_0", "18446744073709551617"});
}

TEST(Hardening, EntryNamesAreNotSplicedIntoARegex) {
  const std::string src =
      "extern \"C\" __global__ void axb(int n) {}\nextern \"C\" __global__ void a(float* p) {}\n";
  EXPECT_NO_THROW(kg::compile::kernel_param_names(src, "k("));
  EXPECT_TRUE(kg::compile::kernel_param_names(src, "k(").empty());
  EXPECT_TRUE(kg::compile::kernel_param_names(src, "a[").empty());
  EXPECT_TRUE(kg::compile::kernel_param_names(src, "a.b").empty());  // '.' is not "any character"
  EXPECT_TRUE(kg::compile::kernel_param_names(src, "").empty());
  EXPECT_EQ(kg::compile::kernel_param_names(src, "a"), (std::vector<std::string>{"p"}));
  EXPECT_EQ(kg::compile::kernel_param_names(src, "axb"), (std::vector<std::string>{"n"}));
}

// --- cache files ---------------------------------------------------------------------------------

TEST(Hardening, SealedCacheFilesDetectTruncationAndCorruption) {
  const std::string bytes = "some\ncache\0bytes"s;
  const std::string sealed = kg::compile::seal_cache_file(bytes);
  ASSERT_TRUE(kg::compile::unseal_cache_file(sealed).has_value());
  EXPECT_EQ(*kg::compile::unseal_cache_file(sealed), bytes);
  EXPECT_FALSE(kg::compile::unseal_cache_file(sealed.substr(0, sealed.size() / 2)).has_value());
  EXPECT_FALSE(kg::compile::unseal_cache_file(bytes).has_value());  // no trailer: an old or foreign file
  std::string flipped = sealed;
  flipped[2] = 'X';
  EXPECT_FALSE(kg::compile::unseal_cache_file(flipped).has_value());
  EXPECT_FALSE(kg::compile::unseal_cache_file("").has_value());
  EXPECT_EQ(*kg::compile::unseal_cache_file(kg::compile::seal_cache_file("")), "");
}

TEST(Hardening, TruncatedCachedPtxIsRecompiled) {
  if (!Compiler::available()) GTEST_SKIP() << "built without NVRTC";
  const fs::path dir = fresh_dir("ptx");
  const auto first = Compiler(dir).compile("test.saxpy", kSaxpy, 90);
  const fs::path ptx = dir / (first.key + ".ptx");
  ASSERT_TRUE(fs::exists(ptx));
  fs::resize_file(ptx, fs::file_size(ptx) / 2);  // still has .version and .target
  const auto second = Compiler(dir).compile("test.saxpy", kSaxpy, 90);
  EXPECT_FALSE(second.from_disk);
  EXPECT_EQ(second.ptx, first.ptx);
  EXPECT_EQ(kg::compile::parse_ptx_entries(second.ptx).size(), 1u);
  // The file was replaced by a whole one, served from then on.
  const auto third = Compiler(dir).compile("test.saxpy", kSaxpy, 90);
  EXPECT_TRUE(third.from_disk);
  EXPECT_EQ(third.ptx, first.ptx);
  fs::remove_all(dir);
}

TEST(Hardening, CacheFilesAreNotReadThroughSymbolicLinks) {
  const fs::path dir = fresh_dir("link");
  fs::create_directories(dir);
  { std::ofstream(dir / "target") << "hello"; }
  fs::create_symlink(dir / "target", dir / "link");
  std::string out;
  EXPECT_TRUE(kg::compile::read_cache_file(dir / "target", out));
  EXPECT_EQ(out, "hello");
  EXPECT_FALSE(kg::compile::read_cache_file(dir / "link", out));
  EXPECT_FALSE(kg::compile::read_cache_file(dir / "missing", out));
  EXPECT_FALSE(kg::compile::read_cache_file(dir, out));  // a folder is not a cache file
  fs::remove_all(dir);
}

// The tests run as root here: ownership by another user is made with chown, which needs root;
// elsewhere that part is skipped and only the mode checks run.
TEST(Hardening, SharedFallbackCacheFolderIsPerUserAndPrivate) {
  const fs::path tmp = fresh_dir("tmp");
  fs::create_directories(tmp);
  EnvVar no_kg("KG_CACHE_DIR", std::nullopt), no_xdg("XDG_CACHE_HOME", std::nullopt),
      no_home("HOME", std::nullopt), tmpdir("TMPDIR", tmp.string());
  const fs::path expected = tmp / ("kernelgraph-cache-" + std::to_string(::geteuid()));
  EXPECT_EQ(Compiler::default_cache_dir(), expected);
  struct stat st{};
  ASSERT_EQ(::lstat(expected.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_EQ(st.st_uid, ::geteuid());

  std::string why;
  EXPECT_TRUE(kg::compile::private_cache_dir(expected, why)) << why;
  fs::permissions(expected, fs::perms::all);  // 0777: anyone could plant a .so
  EXPECT_FALSE(kg::compile::private_cache_dir(expected, why));
  EXPECT_NE(why.find("writable by group or others"), std::string::npos) << why;
  EXPECT_EQ(Compiler::default_cache_dir(), fs::path());  // not used
  ::chmod(expected.c_str(), 0720);
  EXPECT_FALSE(kg::compile::private_cache_dir(expected, why));
  ::chmod(expected.c_str(), 0700);
  EXPECT_EQ(Compiler::default_cache_dir(), expected);

  if (::geteuid() == 0) {
    ASSERT_EQ(::chown(expected.c_str(), 12345, 12345), 0);
    EXPECT_FALSE(kg::compile::private_cache_dir(expected, why));
    EXPECT_NE(why.find("owned by uid 12345"), std::string::npos) << why;
    EXPECT_EQ(Compiler::default_cache_dir(), fs::path());
  }
  // A symbolic link in the folder's place is refused too.
  fs::remove_all(expected);
  fs::create_directories(tmp / "elsewhere");
  ::chmod((tmp / "elsewhere").c_str(), 0700);
  fs::create_directory_symlink(tmp / "elsewhere", expected);
  EXPECT_FALSE(kg::compile::private_cache_dir(expected, why));
  EXPECT_EQ(Compiler::default_cache_dir(), fs::path());

  // Without a disk cache, compiles still work (from memory only).
  if (Compiler::available()) {
    Compiler c{fs::path()};
    EXPECT_FALSE(c.compile("test.saxpy", kSaxpy, 90).from_disk);
    EXPECT_TRUE(c.compile("test.saxpy", kSaxpy, 90).from_memory);
  }
  fs::remove_all(tmp);
}

// The finding: only the /tmp fallback was checked; a KG_CACHE_DIR (or XDG/home cache) that was
// world-writable or another user's was used as is, so a PTX planted there was served by compile
// (and a shared object loaded by the emulator). Every choice of folder is checked now.
TEST(Hardening, EveryCacheFolderChoiceIsCheckedBeforeUse) {
  const fs::path root = fresh_dir("choice");
  fs::create_directories(root);
  const fs::path kg_dir = root / "kg";
  fs::create_directories(kg_dir);
  {
    EnvVar kg("KG_CACHE_DIR", kg_dir.string());
    EXPECT_EQ(Compiler::default_cache_dir(), kg_dir);
    fs::permissions(kg_dir, fs::perms::all);
    EXPECT_EQ(Compiler::default_cache_dir(), fs::path()) << "a world-writable KG_CACHE_DIR is not used";
    fs::permissions(kg_dir, fs::perms::owner_all);
  }
  {
    EnvVar no_kg("KG_CACHE_DIR", std::nullopt), xdg("XDG_CACHE_HOME", (root / "xdg").string());
    EXPECT_EQ(Compiler::default_cache_dir(), root / "xdg" / "kernelgraph") << "created, private";
    fs::permissions(root / "xdg" / "kernelgraph", fs::perms::all);
    EXPECT_EQ(Compiler::default_cache_dir(), fs::path());
  }
  fs::remove_all(root);
}

// The same for a Compiler made with a folder: the folder is checked before a cached PTX is read.
TEST(Hardening, PlantedPtxInAWorldWritableFolderIsNotServed) {
  if (!Compiler::available()) GTEST_SKIP() << Compiler::unavailable_reason();
  const fs::path dir = fresh_dir("planted-ptx");
  fs::create_directories(dir);
  const auto honest = Compiler(dir).compile("test.saxpy", kSaxpy, 90);
  const fs::path file = dir / (honest.key + ".ptx");
  const std::string planted = ptx_module("// planted\n.visible .entry saxpy() { ret; }\n");
  { std::ofstream(file, std::ios::binary | std::ios::trunc) << kg::compile::seal_cache_file(planted); }
  fs::permissions(dir, fs::perms::all);
  const auto got = Compiler(dir).compile("test.saxpy", kSaxpy, 90);
  EXPECT_FALSE(got.from_disk);
  EXPECT_EQ(got.ptx.find("// planted"), std::string::npos);
  fs::permissions(dir, fs::perms::owner_all);
  fs::remove_all(dir);
}

// The finding: a FIFO in place of a cache file blocked its open forever (no O_NONBLOCK).
TEST(Hardening, FifoInPlaceOfACacheFileDoesNotBlock) {
  const fs::path dir = fresh_dir("fifo");
  fs::create_directories(dir);
  ASSERT_EQ(::mkfifo((dir / "x.ptx").c_str(), 0600), 0);
  std::string out;
  EXPECT_FALSE(kg::compile::read_cache_file(dir / "x.ptx", out));
  // A file larger than the bound is not read.
  { std::ofstream(dir / "big.ptx") << std::string(4096, 'x'); }
  EXPECT_FALSE(kg::compile::read_cache_file(dir / "big.ptx", out, 4095));
  EXPECT_TRUE(kg::compile::read_cache_file(dir / "big.ptx", out, 4096));
  fs::remove_all(dir);
}
