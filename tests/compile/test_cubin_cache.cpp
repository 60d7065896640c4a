// The machine-code (CUBIN) cache beside the PTX: keys, sealed files read back, damaged or planted
// files refused; and, on a GPU, a module loaded a second time from its cached CUBIN (no JIT), and a
// damaged or refused CUBIN rebuilt from the PTX.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "compile/compiler.hpp"
#include "kg/cuda.hpp"
#include "support/test_util.hpp"

namespace fs = std::filesystem;
using kg::compile::CubinCache;
using namespace std::string_literals;

namespace {

// A fresh folder name under the temporary folder (not created).
fs::path fresh_dir(const std::string& tag) {
  fs::path d =
      fs::temp_directory_path() / ("kg-cubin-test-" + tag + "-" + std::to_string(kg_test::fresh_seed()));
  fs::remove_all(d);
  return d;
}

// Bytes that look like an ELF image (with NULs and a byte over 0x7f), enough for the cache layer.
std::string fake_cubin(char tag) {
  return "\x7f"s + "ELF\x02\x01\x01\0\0\0"s + std::string(200, tag) + "\xff\0end"s;
}

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_all(const fs::path& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << bytes;
}

// The .cubin files of `dir`.
std::vector<fs::path> cubin_files(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == ".cubin") out.push_back(e.path());
  return out;
}

const std::string kPtxHash = kg::compile::content_hash("// some PTX\n");

}  // namespace

TEST(CubinCache, StoresAndReadsBackACubinByKey) {
  const fs::path dir = fresh_dir("store");
  const CubinCache cache(dir);
  const std::string key = CubinCache::key(kPtxHash, 90, 13000);
  EXPECT_EQ(key, kPtxHash + ".sm_90.drv13000");
  EXPECT_EQ(cache.path(key), dir / (kPtxHash + ".sm_90.drv13000.cubin"));
  EXPECT_FALSE(cache.read(key).has_value());  // nothing yet
  const std::string blob = fake_cubin('a');
  ASSERT_TRUE(cache.store(key, blob));
  // The folder was created private, and the file on disk is the sealed blob.
  struct stat st {};
  ASSERT_EQ(::lstat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  const auto on_disk = kg::compile::unseal_cache_file(read_all(cache.path(key)));
  ASSERT_TRUE(on_disk.has_value());
  EXPECT_EQ(*on_disk, blob);
  const auto back = CubinCache(dir).read(key);  // as a new process would
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(*back, blob);
  // Storing again replaces it; no temporary file is left behind.
  ASSERT_TRUE(cache.store(key, fake_cubin('b')));
  EXPECT_EQ(*cache.read(key), fake_cubin('b'));
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir)) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
  fs::remove_all(dir);
}

TEST(CubinCache, KeyDiffersByPtxArchAndDriverVersion) {
  const std::string base = CubinCache::key(kPtxHash, 90, 13000);
  EXPECT_NE(base, CubinCache::key(kPtxHash, 100, 13000));
  EXPECT_NE(base, CubinCache::key(kPtxHash, 90, 13010));
  EXPECT_NE(base, CubinCache::key(kg::compile::content_hash("// other PTX\n"), 90, 13000));
  EXPECT_EQ(base, CubinCache::key(kPtxHash, 90, 13000));
  // Anything but a hex digest is hashed before it becomes a file name.
  const std::string odd = CubinCache::key("../../etc/passwd", 90, 13000);
  EXPECT_EQ(odd.find('/'), std::string::npos) << odd;
  EXPECT_EQ(odd.find(".."), std::string::npos) << odd;

  // What one key stored, another key does not read.
  const fs::path dir = fresh_dir("keys");
  const CubinCache cache(dir);
  ASSERT_TRUE(cache.store(base, fake_cubin('a')));
  EXPECT_FALSE(cache.read(CubinCache::key(kPtxHash, 100, 13000)).has_value());
  EXPECT_FALSE(cache.read(CubinCache::key(kPtxHash, 90, 13010)).has_value());
  EXPECT_TRUE(cache.read(base).has_value());
  fs::remove_all(dir);
}

TEST(CubinCache, TruncatedTamperedOrForeignFilesAreRefusedRemovedAndRebuilt) {
  const fs::path dir = fresh_dir("damage");
  const CubinCache cache(dir);
  const std::string key = CubinCache::key(kPtxHash, 90, 13000);
  const fs::path file = cache.path(key);
  const std::string blob = fake_cubin('a');
  const auto before = kg::compile::module_load_counts();

  ASSERT_TRUE(cache.store(key, blob));
  fs::resize_file(file, fs::file_size(file) / 2);  // cut short
  EXPECT_FALSE(cache.read(key).has_value());
  EXPECT_FALSE(fs::exists(file)) << "a damaged file is removed so that it is rebuilt";

  ASSERT_TRUE(cache.store(key, blob));
  std::string bytes = read_all(file);
  bytes[bytes.size() / 3] ^= 0x20;  // one byte changed, the trailer intact
  write_all(file, bytes);
  EXPECT_FALSE(cache.read(key).has_value());
  EXPECT_FALSE(fs::exists(file));

  write_all(file, blob);  // no trailer: an old or foreign file
  EXPECT_FALSE(cache.read(key).has_value());
  EXPECT_FALSE(fs::exists(file));

  write_all(file, kg::compile::seal_cache_file("not machine code"));  // sealed, but not ELF
  EXPECT_FALSE(cache.read(key).has_value());
  EXPECT_FALSE(fs::exists(file));

  EXPECT_EQ(kg::compile::module_load_counts().dropped_cubin - before.dropped_cubin, 4);

  // Rebuilt: stored again, then served.
  ASSERT_TRUE(cache.store(key, blob));
  ASSERT_TRUE(cache.read(key).has_value());
  EXPECT_EQ(*cache.read(key), blob);
  cache.drop(key);
  EXPECT_FALSE(fs::exists(file));
  fs::remove_all(dir);
}

TEST(CubinCache, FilesAreNotReadThroughSymbolicLinks) {
  const fs::path dir = fresh_dir("link");
  const CubinCache cache(dir);
  ASSERT_TRUE(cache.usable());
  const std::string key = CubinCache::key(kPtxHash, 90, 13000);
  write_all(dir / "elsewhere", kg::compile::seal_cache_file(fake_cubin('a')));
  fs::create_symlink(dir / "elsewhere", cache.path(key));
  EXPECT_FALSE(cache.read(key).has_value());
  fs::remove_all(dir);
}

TEST(CubinCache, AFolderOthersCanWriteOrNoFolderKeepsNoMachineCode) {
  const fs::path dir = fresh_dir("open");
  fs::create_directories(dir);
  fs::permissions(dir, fs::perms::all);  // 0777: anyone could plant machine code
  const CubinCache cache(dir);
  std::string why;
  EXPECT_FALSE(cache.usable(&why));
  EXPECT_NE(why.find("writable by group or others"), std::string::npos) << why;
  const std::string key = CubinCache::key(kPtxHash, 90, 13000);
  EXPECT_FALSE(cache.store(key, fake_cubin('a')));
  EXPECT_FALSE(fs::exists(cache.path(key)));
  // A planted file is not served from such a folder.
  write_all(cache.path(key), kg::compile::seal_cache_file(fake_cubin('a')));
  EXPECT_FALSE(cache.read(key).has_value());
  fs::remove_all(dir);

  const CubinCache none{fs::path()};
  EXPECT_FALSE(none.usable(&why));
  EXPECT_FALSE(none.store(key, fake_cubin('a')));
  EXPECT_FALSE(none.read(key).has_value());
}

TEST(CubinCache, FolderDefaultsToTheCompilersAndCanBeSet) {
  EXPECT_EQ(kg::compile::cubin_cache_dir(), kg::compile::Compiler::global().cache_dir());
  const fs::path dir = fresh_dir("set");
  kg::compile::set_cubin_cache_dir(dir);
  EXPECT_EQ(kg::compile::cubin_cache_dir(), dir);
  kg::compile::set_cubin_cache_dir(std::nullopt);
  EXPECT_EQ(kg::compile::cubin_cache_dir(), kg::compile::Compiler::global().cache_dir());
}

TEST(CubinCache, LoadCountersAddUp) {
  using kg::compile::ModuleLoad;
  const auto before = kg::compile::module_load_counts();
  kg::compile::count_module_load(ModuleLoad::cached_cubin);
  kg::compile::count_module_load(ModuleLoad::built_cubin);
  kg::compile::count_module_load(ModuleLoad::built_cubin);
  kg::compile::count_module_load(ModuleLoad::ptx_jit);
  const auto after = kg::compile::module_load_counts();
  EXPECT_EQ(after.cached_cubin - before.cached_cubin, 1);
  EXPECT_EQ(after.built_cubin - before.built_cubin, 2);
  EXPECT_EQ(after.ptx_jit - before.ptx_jit, 1);
  EXPECT_EQ(after.compiled() - before.compiled(), 3);
  EXPECT_EQ(after.dropped_cubin, before.dropped_cubin);
}

// ---------------------------------------------------------------------------------------------
// With a GPU: the module table of a device context is keyed by the PTX and the CUBIN folder, so
// pointing the folder at a copy of the cache makes the next load go to the disk.

namespace {

// y[i] = x[i] * 2 + c, with c made part of the source so that its PTX is new to this process.
std::string affine_source(int c) {
  return "extern \"C\" __global__ void __launch_bounds__(128)\n"
         "kg_test_cubin_affine(const float* __restrict__ x, float* __restrict__ y, int n) {\n"
         "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
         "  if (i < n) y[i] = x[i] * 2.0f + " +
         std::to_string(c) + ".0f;\n}\n";
}

// Sets the CUBIN folder for the life of the object, then goes back to the default.
struct CubinDirScope {
  explicit CubinDirScope(const fs::path& d) { kg::compile::set_cubin_cache_dir(d); }
  ~CubinDirScope() { kg::compile::set_cubin_cache_dir(std::nullopt); }
  CubinDirScope(const CubinDirScope&) = delete;
  CubinDirScope& operator=(const CubinDirScope&) = delete;
};

// Loads the kernel with `dir` as the CUBIN folder, runs it on n values and checks every output.
void load_and_run(const fs::path& dir, const std::string& source, int c) {
  CubinDirScope scope(dir);
  const auto k = kg::cuda::Kernel::compile("test.cubin_affine", source, "kg_test_cubin_affine");
  const int n = 1000;
  std::vector<float> xs(n);
  for (int i = 0; i < n; ++i) xs[static_cast<std::size_t>(i)] = static_cast<float>(i % 97) - 40.f;
  auto dx = kg::cuda::DeviceTensorBuffer::from(kg::Tensor::from_vector<float>({n}, xs));
  auto dy = kg::cuda::DeviceTensorBuffer::from(kg::Tensor::zeros(kg::DType::F32, {n}));
  dy.fill_bytes(0xFF);  // NaN: an element not written shows
  k.launch({(n + 127) / 128, 1, 1}, {128, 1, 1}, [&](kg::ArgVisitor& a) {
    a.pointer(dx.ptr());
    a.pointer(dy.ptr());
    a.i32(n);
  });
  const kg::Tensor y = dy.download();
  int wrong = 0;
  for (int i = 0; i < n; ++i)
    wrong += y.data<float>()[i] != xs[static_cast<std::size_t>(i)] * 2.f + static_cast<float>(c);
  EXPECT_EQ(wrong, 0) << "of " << n << " outputs";
}

// The counts since `before`.
kg::compile::ModuleLoadCounts since(const kg::compile::ModuleLoadCounts& before) {
  const auto now = kg::compile::module_load_counts();
  kg::compile::ModuleLoadCounts d;
  d.cached_cubin = now.cached_cubin - before.cached_cubin;
  d.built_cubin = now.built_cubin - before.built_cubin;
  d.ptx_jit = now.ptx_jit - before.ptx_jit;
  d.dropped_cubin = now.dropped_cubin - before.dropped_cubin;
  return d;
}

// A fresh folder holding a copy of `file`, under the same name; returns the copy.
fs::path copy_into_fresh(const fs::path& file, const std::string& tag, std::vector<fs::path>& made) {
  const fs::path dir = fresh_dir(tag);
  made.push_back(dir);
  std::string why;
  EXPECT_TRUE(kg::compile::private_cache_dir(dir, why)) << why;
  fs::copy_file(file, dir / file.filename());
  return dir / file.filename();
}

}  // namespace

TEST(CubinCacheGpu, SecondLoadReadsCachedMachineCodeAndADamagedOneIsRebuilt) {
  if (!kg::compile::Compiler::available()) GTEST_SKIP() << "built without NVRTC";
  if (!kg::cuda::available()) GTEST_SKIP() << "no GPU: " << kg::cuda::unavailable_reason();
  const int c = static_cast<int>(kg_test::fresh_seed() % 100000);
  const std::string source = affine_source(c);
  std::vector<fs::path> made;

  // Cold: the PTX is linked to a CUBIN for this device, loaded and kept.
  const fs::path cold = fresh_dir("gpu-cold");
  made.push_back(cold);
  auto before = kg::compile::module_load_counts();
  load_and_run(cold, source, c);
  auto d = since(before);
  EXPECT_EQ(d.built_cubin, 1);
  EXPECT_EQ(d.cached_cubin, 0);
  EXPECT_EQ(d.ptx_jit, 0);
  const auto files = cubin_files(cold);
  ASSERT_EQ(files.size(), 1u);
  const std::string name = files[0].filename().string();
  EXPECT_NE(name.find(".sm_" + std::to_string(kg::cuda::device_arch(0)) + ".drv"), std::string::npos) << name;
  const auto cubin = kg::compile::unseal_cache_file(read_all(files[0]));
  ASSERT_TRUE(cubin.has_value()) << "the CUBIN is kept sealed";
  EXPECT_EQ(cubin->compare(0, 4, "\177ELF"), 0) << "the CUBIN is an ELF image";

  // Warm: the same PTX with a copy of that cache is loaded from the machine code, no JIT.
  const fs::path warm = copy_into_fresh(files[0], "gpu-warm", made);
  before = kg::compile::module_load_counts();
  load_and_run(warm.parent_path(), source, c);
  d = since(before);
  EXPECT_EQ(d.cached_cubin, 1);
  EXPECT_EQ(d.built_cubin, 0);
  EXPECT_EQ(d.ptx_jit, 0);
  EXPECT_EQ(d.dropped_cubin, 0);

  // Damaged (one byte of the machine code changed): refused by the seal, removed, rebuilt.
  const fs::path damaged = copy_into_fresh(files[0], "gpu-damaged", made);
  {
    std::string bytes = read_all(damaged);
    bytes[bytes.size() / 2] ^= 0x5a;
    write_all(damaged, bytes);
  }
  before = kg::compile::module_load_counts();
  load_and_run(damaged.parent_path(), source, c);
  d = since(before);
  EXPECT_EQ(d.dropped_cubin, 1);
  EXPECT_EQ(d.built_cubin, 1);
  EXPECT_EQ(d.cached_cubin, 0);
  EXPECT_EQ(d.ptx_jit, 0);
  ASSERT_TRUE(fs::exists(damaged)) << "the rebuilt CUBIN is stored again";
  EXPECT_TRUE(kg::compile::unseal_cache_file(read_all(damaged)).has_value());

  // Intact seal, but not an image the driver takes (an ELF header of zeros: no class, no machine,
  // no sections, so nothing points outside the buffer): refused by the driver, removed, rebuilt.
  const fs::path refused = copy_into_fresh(files[0], "gpu-refused", made);
  const std::string junk = "\177ELF" + std::string(4096, '\0');
  write_all(refused, kg::compile::seal_cache_file(junk));
  before = kg::compile::module_load_counts();
  load_and_run(refused.parent_path(), source, c);
  d = since(before);
  EXPECT_EQ(d.dropped_cubin, 1);
  EXPECT_EQ(d.built_cubin, 1);
  EXPECT_EQ(d.cached_cubin, 0);
  EXPECT_EQ(d.ptx_jit, 0);
  const auto rebuilt = kg::compile::unseal_cache_file(read_all(refused));
  ASSERT_TRUE(rebuilt.has_value());
  EXPECT_NE(*rebuilt, junk);

  // And the rebuilt file serves the next load.
  const fs::path again = copy_into_fresh(refused, "gpu-again", made);
  before = kg::compile::module_load_counts();
  load_and_run(again.parent_path(), source, c);
  EXPECT_EQ(since(before).cached_cubin, 1);
  kg::cuda::synchronize();
  for (const auto& dir : made) fs::remove_all(dir);
}
