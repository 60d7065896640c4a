// The fuzz targets (fuzz/targets.hpp) run in the ordinary build on their regression inputs
// (fuzz/regressions/<name>/: inputs that once crashed a reader or escaped it with an exception
// other than kg::Error) and on their seed corpora (fuzz/corpus/<name>/). A target returns
// normally when the reader accepted or refused the input; anything else fails here as it would
// under libFuzzer, only without the sanitizers (the fuzz preset has them: docs/hardening.md).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "../../fuzz/targets.hpp"
#include "ops/dim_ref.hpp"
#include "ops/view.hpp"

namespace {

namespace fs = std::filesystem;
using Target = int (*)(const std::uint8_t*, std::size_t);

std::vector<std::uint8_t> read_bytes(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// Every file of fuzz/<folder>/<name>/, sorted.
std::vector<fs::path> inputs(const std::string& folder, const std::string& name) {
  std::vector<fs::path> out;
  const fs::path dir = fs::path(KG_SOURCE_DIR) / "fuzz" / folder / name;
  if (fs::is_directory(dir))
    for (const auto& e : fs::directory_iterator(dir))
      if (e.is_regular_file()) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

// Replays the regressions and the seed corpus of one target; returns how many inputs ran.
std::size_t replay(const std::string& name, Target target) {
  std::size_t n = 0;
  for (const char* folder : {"regressions", "corpus"}) {
    for (const auto& path : inputs(folder, name)) {
      SCOPED_TRACE(path.string());
      const auto bytes = read_bytes(path);
      try {
        EXPECT_EQ(target(bytes.data(), bytes.size()), 0);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "fuzz_" << name << " let an exception other than kg::Error escape: " << e.what();
      }
      ++n;
    }
  }
  return n;
}

TEST(FuzzRegressions, Safetensors) { EXPECT_GT(replay("safetensors", kg::fuzz::fuzz_safetensors), 0u); }
TEST(FuzzRegressions, Weights) { EXPECT_GT(replay("weights", kg::fuzz::fuzz_weights), 0u); }
TEST(FuzzRegressions, Idx) { EXPECT_GT(replay("idx", kg::fuzz::fuzz_idx), 0u); }
TEST(FuzzRegressions, Ptx) { EXPECT_GT(replay("ptx", kg::fuzz::fuzz_ptx), 0u); }
TEST(FuzzRegressions, CudaSource) { EXPECT_GT(replay("cuda_source", kg::fuzz::fuzz_cuda_source), 0u); }
TEST(FuzzRegressions, Onnx) { EXPECT_GT(replay("onnx", kg::fuzz::fuzz_onnx), 0u); }
TEST(FuzzRegressions, OnnxConvert) { EXPECT_GT(replay("onnx_convert", kg::fuzz::fuzz_onnx_convert), 0u); }
TEST(FuzzRegressions, Cli) { EXPECT_GT(replay("cli", kg::fuzz::fuzz_cli), 0u); }
TEST(FuzzRegressions, TuningCache) { EXPECT_GT(replay("tuning_cache", kg::fuzz::fuzz_tuning_cache), 0u); }
TEST(FuzzRegressions, EmuCache) { EXPECT_GT(replay("emu_cache", kg::fuzz::fuzz_emu_cache), 0u); }
TEST(FuzzRegressions, Rendezvous) { EXPECT_GT(replay("rendezvous", kg::fuzz::fuzz_rendezvous), 0u); }

// The known findings the regression folders hold are refused with a kg::Error (not only
// survived): each reader says what is wrong with the input.
TEST(FuzzRegressions, KnownFindingsAreRefused) {
  const fs::path regressions = fs::path(KG_SOURCE_DIR) / "fuzz" / "regressions";
  // A safetensors header nested 100000 levels deep (inside a shape).
  EXPECT_THROW(kg::read_safetensors((regressions / "safetensors" / "nested_100000.safetensors").string()),
               kg::Error);
  EXPECT_THROW(
      kg::read_safetensors((regressions / "safetensors" / "nested_100000_unterminated.safetensors").string()),
      kg::Error);
  // IDX dims [2^32-1, 2^32-1, 0]: the product of the non-zero dims overflows an int64 (a zero dim
  // must not hide it).
  EXPECT_THROW(kg::data::read_idx((regressions / "idx" / "dims_max_max_zero.idx").string()), kg::Error);
  // `.reqntid 99999999999999999999999`: a count past 2^32 - 1 (and past 64 bits). The file's
  // first line is fuzz_ptx's entry name.
  const auto ptx = read_bytes(regressions / "ptx" / "reqntid_overflow.ptx");
  const std::string file(ptx.begin(), ptx.end());
  const std::string text = file.substr(file.find('\n') + 1);
  EXPECT_THROW(kg::compile::parse_ptx_entries(text), kg::Error);
}

}  // namespace

// fuzz_onnx's first finding (fuzz/regressions/onnx/reshape_target_overflow.onnx): a Reshape whose
// target sizes multiply past an int64 overflowed nn.view's element count (UBSan: signed overflow
// in src/ops/view.cpp). Where the product wraps round to the input's count, [4] viewed as
// [2^62 + 1, 4] was accepted; it must be an error naming the sizes.
TEST(FuzzRegressions, ViewElementCountOverflowIsAnError) {
  using kg::ops::DimRef;
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {4});
  const std::int64_t big = (std::int64_t{1} << 62) + 1;
  try {
    const kg::SymTensor y = kg::ops::view(x, {DimRef::constant(big), DimRef::constant(4)});
    ADD_FAILURE() << "[4] viewed as [2^62 + 1, 4] was accepted as " << y.shape().to_string();
  } catch (const kg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("int64"), std::string::npos) << e.what();
  }
  // The input's count overflowing is refused too.
  auto [x2, g2] = kg::SymTensor::input(kg::DType::F32, {big, 4});
  EXPECT_THROW(kg::ops::view(x2, {DimRef::constant(4)}), kg::Error);
}
