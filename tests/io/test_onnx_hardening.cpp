// Hostile ONNX files against the importer: window attributes that do not fit the input, sizes
// whose arithmetic overflows or divides by zero, constant inputs of the wrong dtype or rank,
// opset numbers out of range, external data outside the model's folder or in special files,
// constants folded at import larger than the memory, names with terminal escapes, and the time
// to import a long chain. Each model is built here with the protobuf schema.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <random>

#include "kg/onnx.hpp"
#include "support/onnx_builder.hpp"
#include "support/test_util.hpp"
#include "util/memory.hpp"

using kg_test::OnnxBuilder;

namespace {

namespace fs = std::filesystem;
constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();

kg::Tensor i64s(std::vector<std::int64_t> v) {
  const auto n = static_cast<std::int64_t>(v.size());
  return kg::Tensor::from_vector<std::int64_t>({n}, v);
}

kg::Model import_model(const OnnxBuilder& m) { return kg::onnx::import_bytes(m.bytes(), "hostile.onnx"); }

// The available memory reported as `bytes` while it lives (the memory checks then refuse alike
// on every machine).
struct MemoryLimit {
  explicit MemoryLimit(std::uint64_t bytes) { kg::util::set_available_memory_for_testing(bytes); }
  ~MemoryLimit() { kg::util::set_available_memory_for_testing(std::nullopt); }
};

// A folder of its own under the temporary folder, removed at the end.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name)
      : path(fs::temp_directory_path() / ("kg_onnx_hard_" + std::to_string(::getpid()) + "_" + name)) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

// ---- windows (Conv, MaxPool, AveragePool) ----

OnnxBuilder pool_model(const std::string& op, std::vector<OnnxBuilder::DimSpec> in,
                       const std::vector<std::int64_t>& kernel, const std::vector<std::int64_t>& pads) {
  OnnxBuilder m;
  m.input("x", kg::DType::F32, in);
  auto& n = m.node(op, {"x"}, {"y"}, "/pool");
  OnnxBuilder::attr(n, "kernel_shape", kernel);
  if (!pads.empty()) OnnxBuilder::attr(n, "pads", pads);
  if (op == "AveragePool") OnnxBuilder::attr(n, "count_include_pad", std::int64_t{1});
  m.output("y");
  return m;
}

// The 136-byte file of the report: a kernel of three dims over one spatial dim, with pads that
// differ at both ends, wrote the pads past two vectors of the input's rank.
TEST(OnnxHardening, PoolKernelWithMoreDimsThanTheInputIsAnError) {
  for (const char* op : {"MaxPool", "AveragePool"}) {
    SCOPED_TRACE(op);
    kg_test::expect_error(
        [&] { import_model(pool_model(op, {std::int64_t{1}, std::int64_t{1}, std::int64_t{8}}, {2, 2, 2}, {0, 0, 0, 5, 6, 7})); },
        {"hostile.onnx", op, "kernel_shape [2, 2, 2] has 3 dims for the 1 spatial dims"});
    kg_test::expect_error(
        [&] { import_model(pool_model(op, {std::int64_t{1}, std::int64_t{1}, std::int64_t{8}, std::int64_t{8}}, {2, 2}, {0, 1})); },
        {"pads [0, 1]", "must have 2, 2 and 4 entries"});
  }
}

// Pads that differ at both ends still work: against the maximum over each window computed here.
TEST(OnnxHardening, PoolWithAsymmetricPadsMatchesTheWindowMaximum) {
  kg::Model model = import_model(pool_model("MaxPool", {std::int64_t{1}, std::int64_t{1}, std::int64_t{4}, std::int64_t{4}},
                                      {2, 2}, {0, 0, 1, 1}));
  std::mt19937_64 rng(kg_test::fresh_seed());
  const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {1, 1, 4, 4});
  kg::LoadedModel lm = model.load(kg::Device::cpu(), {x.shape()});
  const kg::Tensor y = lm.forward({x}).at(0);
  ASSERT_EQ(y.shape(), (std::vector<std::int64_t>{1, 1, 4, 4}));  // (4 + 0 + 1 - 2) / 1 + 1
  std::vector<double> want;
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) {
      double best = -INFINITY;
      for (int di = 0; di < 2; ++di)
        for (int dj = 0; dj < 2; ++dj)
          if (i + di < 4 && j + dj < 4) best = std::max(best, x.item((i + di) * 4 + j + dj));
      want.push_back(best);
    }
  EXPECT_TRUE(kg_test::matches(y, want, 0, 0));
}

TEST(OnnxHardening, ZeroOrNegativeStridesDilationsAndKernelsAreErrors) {
  struct Case {
    const char* attr;
    std::vector<std::int64_t> value;
    const char* says;
  };
  for (const char* op : {"MaxPool", "Conv"}) {
    for (const Case& k : {Case{"strides", {0, 1}, "strides [0, 1] must be positive"},
                          Case{"strides", {1, -3}, "strides [1, -3] must be positive"},
                          Case{"dilations", {0, 1}, "dilations [0, 1] must be positive"},
                          Case{"kernel_shape", {0, 2}, "kernel_shape [0, 2] must be positive"}}) {
      if (std::string(op) == "Conv" && std::string(k.attr) == "kernel_shape") continue;  // the weight's
      SCOPED_TRACE(std::string(op) + " " + k.attr);
      OnnxBuilder m;
      m.input("x", kg::DType::F32, {std::int64_t{1}, std::int64_t{1}, std::int64_t{5}, std::int64_t{5}});
      std::vector<std::string> ins{"x"};
      if (std::string(op) == "Conv") {
        m.initializer("w", kg::Tensor::zeros(kg::DType::F32, {1, 1, 2, 2}));
        ins.push_back("w");
      }
      auto& n = m.node(op, ins, {"y"}, "/win");
      if (std::string(op) == "MaxPool") OnnxBuilder::attr(n, "kernel_shape", std::string(k.attr) == "kernel_shape" ? k.value : std::vector<std::int64_t>{2, 2});
      if (std::string(k.attr) != "kernel_shape") OnnxBuilder::attr(n, k.attr, k.value);
      OnnxBuilder::attr(n, "auto_pad", std::string("SAME_UPPER"));
      m.output("y");
      kg_test::expect_error([&] { import_model(m); }, {"/win", k.says});
    }
  }
}

// ---- checked size arithmetic ----

// x [batch, 5]: Shape(x) concatenated with a constant is a shape value with one size known only
// at run time, so arithmetic on it stays in the importer (it is not folded on the CPU).
OnnxBuilder shape_arith(const std::string& op, std::int64_t known, std::int64_t other) {
  OnnxBuilder m;
  m.input("x", kg::DType::F32, {std::string("batch"), std::int64_t{5}});
  m.initializer("k", i64s({known}));
  m.initializer("o", i64s({other}));
  m.node("Shape", {"x"}, {"s"});
  auto& c = m.node("Concat", {"s", "k"}, {"sk"});
  OnnxBuilder::attr(c, "axis", std::int64_t{0});
  m.node(op, {"sk", "o"}, {"r"}, "/arith");
  m.node("Reshape", {"x", "r"}, {"y"});
  m.output("y");
  return m;
}

TEST(OnnxHardening, SizeArithmeticThatOverflowsIsAnErrorNamingTheNumbers) {
  kg_test::expect_error([&] { import_model(shape_arith("Div", kMin, -1)); },
                        {"/arith", "-9223372036854775808 / -1 does not fit in 64 bits"});
  kg_test::expect_error([&] { import_model(shape_arith("Div", 7, 0)); }, {"/arith", "5 / 0 divides by zero"});
  kg_test::expect_error([&] { import_model(shape_arith("Mul", std::int64_t{1} << 62, 4)); },
                        {"/arith", "4611686018427387904 × 4 does not fit in 64 bits"});
  kg_test::expect_error([&] { import_model(shape_arith("Sub", kMin, 1)); }, {"/arith", "- 1 does not fit in 64 bits"});
  kg_test::expect_error([&] { import_model(shape_arith("Add", std::numeric_limits<std::int64_t>::max(), 1)); },
                        {"/arith", "+ 1 does not fit in 64 bits"});
}

TEST(OnnxHardening, SplitWithoutOutputsZeroPartsOrBadSizesIsAnError) {
  auto split = [](int opset, int outputs, std::optional<std::int64_t> parts, std::vector<std::int64_t> sizes) {
    OnnxBuilder m(opset);
    m.input("x", kg::DType::F32, {std::int64_t{2}, std::int64_t{4}});
    std::vector<std::string> ins{"x"};
    if (!sizes.empty()) {
      m.initializer("sizes", i64s(sizes));
      ins.push_back("sizes");
    }
    std::vector<std::string> outs;
    for (int i = 0; i < outputs; ++i) outs.push_back("y" + std::to_string(i));
    auto& n = m.node("Split", ins, outs, "/split");
    OnnxBuilder::attr(n, "axis", std::int64_t{1});
    if (parts) OnnxBuilder::attr(n, "num_outputs", *parts);
    m.output(outputs > 0 ? "y0" : "x");
    return m;
  };
  kg_test::expect_error([&] { import_model(split(18, 1, 0, {})); }, {"/split", "num_outputs 0 but 1 outputs"});
  kg_test::expect_error([&] { import_model(split(18, 0, std::nullopt, {})); }, {"/split", "has no outputs"});
  kg_test::expect_error([&] { import_model(split(13, 2, std::nullopt, {-5, 9})); },
                        {"/split", "negative split size in [-5, 9]"});
  kg_test::expect_error([&] { import_model(split(13, 2, std::nullopt, {1, 2})); },
                        {"/split", "split sizes [1, 2] add up to 3 but the dim is 4"});
  // Valid: [1, 3], and three equal-ish parts of 4 (2, 2, 0 per ONNX: ceil(4 / 3) = 2).
  kg::Model ok = import_model(split(13, 2, std::nullopt, {1, 3}));
  std::mt19937_64 rng(kg_test::fresh_seed());
  const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {2, 4});
  kg::LoadedModel lm = ok.load(kg::Device::cpu(), {x.shape()});
  const kg::Tensor y0 = lm.forward({x}).at(0);
  EXPECT_TRUE(kg_test::matches(y0, {x.item(0), x.item(4)}, 0, 0));
}

TEST(OnnxHardening, RangeOverflowAndNonFiniteBoundsAreErrors) {
  auto range = [](kg::Tensor s, kg::Tensor l, kg::Tensor d) {
    OnnxBuilder m;
    m.initializer("s", s);
    m.initializer("l", l);
    m.initializer("d", d);
    m.node("Range", {"s", "l", "d"}, {"y"}, "/range");
    m.output("y");
    return m;
  };
  auto i64 = [](std::int64_t v) { return kg::Tensor::from_vector<std::int64_t>({}, {v}); };
  kg_test::expect_error([&] { import_model(range(i64(kMin), i64(std::numeric_limits<std::int64_t>::max()), i64(1))); },
                        {"/range", "would have more than 2147483648 elements"});
  kg_test::expect_error([&] { import_model(range(i64(0), i64(5), i64(0))); }, {"/range", "zero delta"});
  auto f64 = [](double v) { return kg::Tensor::from_vector<double>({}, {v}); };
  kg_test::expect_error([&] { import_model(range(f64(0), f64(INFINITY), f64(1))); }, {"/range", "no finite length"});
  // Exact at the ends of i64: 3 values from INT64_MAX - 2.
  kg::Model m = import_model(range(i64(std::numeric_limits<std::int64_t>::max() - 2), i64(std::numeric_limits<std::int64_t>::max()), i64(1)));
  (void)m;
}

// ---- constant inputs of the wrong dtype or rank ----

TEST(OnnxHardening, SliceWithFloatOrRankTwoArgumentsIsAnError) {
  auto slice = [](kg::Tensor starts, kg::Tensor ends) {
    OnnxBuilder m;
    m.input("x", kg::DType::F32, {std::int64_t{4}, std::int64_t{6}});
    m.initializer("starts", starts);
    m.initializer("ends", ends);
    m.node("Slice", {"x", "starts", "ends"}, {"y"}, "/slice");
    m.output("y");
    return m;
  };
  kg_test::expect_error([&] { import_model(slice(i64s({0}), kg::Tensor::from_vector<float>({1}, {2.f}))); },
                        {"/slice", "the ends must be a 1-D integer tensor, got f32 [1]"});
  kg_test::expect_error([&] { import_model(slice(i64s({0}), kg::Tensor::from_vector<std::int64_t>({1, 2}, {2, 3}))); },
                        {"/slice", "the ends must be a 1-D integer tensor", "[1, 2]"});
  kg_test::expect_error([&] { import_model(slice(kg::Tensor::from_vector<std::int64_t>({1, 1}, {0}), i64s({2}))); },
                        {"/slice", "the starts must be integers of rank 0 or 1"});
  kg_test::expect_error([&] { import_model(slice(i64s({0}), i64s({2, 3}))); },
                        {"/slice", "has 1 starts, 2 ends"});
}

// ---- versions ----

TEST(OnnxHardening, OpsetAndIrVersionsOutOfRangeAreErrors) {
  auto model = [](std::int64_t opset, std::int64_t ir) {
    OnnxBuilder m;
    m.model().mutable_opset_import(0)->set_version(opset);
    m.model().set_ir_version(ir);
    m.input("x", kg::DType::F32, {std::int64_t{2}});
    m.node("Relu", {"x"}, {"y"});
    m.output("y");
    return m;
  };
  kg_test::expect_error([&] { import_model(model((std::int64_t{1} << 32) + 17, 8)); },
                        {"opset version 4294967313 of the standard domain", "1 to 2147483647"});
  kg_test::expect_error([&] { import_model(model(-5, 8)); }, {"opset version -5"});
  kg_test::expect_error([&] { import_model(model(0, 8)); }, {"opset version 0"});
  kg_test::expect_error([&] { import_model(model(17, std::int64_t{1} << 40)); }, {"ir_version 1099511627776"});
  EXPECT_NO_THROW(import_model(model(17, 8)));
}

// ---- external data ----

struct ExternalModel {
  TempDir dir{"ext"};
  // Writes model.onnx with one initializer per (location, offset) and returns its path.
  std::string write(const std::vector<std::pair<std::string, std::uint64_t>>& tensors, std::int64_t numel = 3) {
    OnnxBuilder m;
    m.input("x", kg::DType::F32, {numel});
    std::string prev = "x";
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      auto* t = m.graph().add_initializer();
      t->set_name("w" + std::to_string(i));
      t->set_data_type(::onnx::TensorProto::FLOAT);
      t->add_dims(numel);
      t->set_data_location(::onnx::TensorProto::EXTERNAL);
      auto* kv = t->add_external_data();
      kv->set_key("location");
      kv->set_value(tensors[i].first);
      kv = t->add_external_data();
      kv->set_key("offset");
      kv->set_value(std::to_string(tensors[i].second));
      const std::string out = "a" + std::to_string(i);
      m.node("Add", {prev, "w" + std::to_string(i)}, {out});
      prev = out;
    }
    m.node("Identity", {prev}, {"y"});
    m.output("y");
    const std::string path = (dir.path / "model.onnx").string();
    write_file(path, m.bytes());
    return path;
  }
};

std::string floats(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

TEST(OnnxHardening, ExternalDataMayNotLeaveTheModelsFolderThroughALink) {
  ExternalModel m;
  TempDir outside("outside");
  write_file(outside.path / "secret.bin", floats({1, 2, 3}));
  fs::create_symlink(outside.path / "secret.bin", m.dir.path / "link.bin");
  kg_test::expect_error([&] { kg::onnx::import(m.write({{"link.bin", 0}})); },
                        {"external data location 'link.bin'", "outside the model's folder"});
  // A folder link out of it too.
  fs::create_directory_symlink(outside.path, m.dir.path / "sub");
  kg_test::expect_error([&] { kg::onnx::import(m.write({{"sub/secret.bin", 0}})); }, {"outside the model's folder"});
  kg_test::expect_error([&] { kg::onnx::import(m.write({{"../outside/secret.bin", 0}})); }, {"'..' component"});
  // A link that stays inside is followed.
  write_file(m.dir.path / "real.bin", floats({1, 2, 3}));
  fs::create_symlink("real.bin", m.dir.path / "inside.bin");
  EXPECT_NO_THROW(kg::onnx::import(m.write({{"inside.bin", 0}})));
}

TEST(OnnxHardening, ExternalDataNamedWithTwoDotsInsideTheFolderIsRead) {
  ExternalModel m;
  write_file(m.dir.path / "a..b.bin", floats({0, 10, 20, 30, 40, 50}));
  kg::Model model = kg::onnx::import(m.write({{"a..b.bin", 8}}));  // floats 2..4
  kg::LoadedModel lm = model.load(kg::Device::cpu(), {{3}});
  const kg::Tensor y = lm.forward({kg::Tensor::from_vector<float>({3}, {1, 1, 1})}).at(0);
  EXPECT_TRUE(kg_test::matches(y, {21, 31, 41}, 0, 0));
}

TEST(OnnxHardening, ExternalDataInAFifoFolderOrDeviceIsRefusedWithoutBlocking) {
  ExternalModel m;
  ASSERT_EQ(::mkfifo((m.dir.path / "fifo.bin").c_str(), 0600), 0);
  fs::create_directory(m.dir.path / "folder.bin");
  const auto start = std::chrono::steady_clock::now();
  kg_test::expect_error([&] { kg::onnx::import(m.write({{"fifo.bin", 0}})); }, {"'fifo.bin'", "is a FIFO"});
  kg_test::expect_error([&] { kg::onnx::import(m.write({{"folder.bin", 0}})); }, {"'folder.bin'", "is a folder"});
  if (fs::exists("/dev/zero")) {
    fs::create_symlink("/dev/zero", m.dir.path / "zero.bin");
    kg_test::expect_error([&] { kg::onnx::import(m.write({{"zero.bin", 0}})); }, {"'zero.bin'", "outside the model's folder"});
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10.0);
}

// 12 bytes near the end of a 64 GiB sparse file: only the range is read (the whole file was read
// once per initializer, and 24 bytes of a 40 GB file were std::bad_alloc); 200 initializers in
// one file open it once.
TEST(OnnxHardening, ExternalDataReadsOnlyTheRangeItNeeds) {
  ExternalModel m;
  const fs::path big = m.dir.path / "sparse.bin";
  {
    const int fd = ::open(big.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0600);
    ASSERT_GE(fd, 0);
    const std::uint64_t size = std::uint64_t{64} << 30;
    const std::string tail = floats({7, 8, 9});
    if (::ftruncate(fd, static_cast<off_t>(size)) != 0 ||
        ::pwrite(fd, tail.data(), tail.size(), static_cast<off_t>(size - 12)) != 12) {
      ::close(fd);
      GTEST_SKIP() << "this file system has no 64 GiB sparse files";
    }
    ::close(fd);
  }
  const auto start = std::chrono::steady_clock::now();
  kg::Model model = kg::onnx::import(m.write({{"sparse.bin", (std::uint64_t{64} << 30) - 12}}));
  kg::LoadedModel lm = model.load(kg::Device::cpu(), {{3}});
  EXPECT_TRUE(kg_test::matches(lm.forward({kg::Tensor::zeros(kg::DType::F32, {3})}).at(0), {7, 8, 9}, 0, 0));
  kg_test::expect_error([&] { kg::onnx::import(m.write({{"sparse.bin", (std::uint64_t{64} << 30) - 8}})); },
                        {"has 68719476736 bytes; 12 are needed at offset 68719476728"});
  // 200 initializers of 64 KiB each at their own offsets of one 12.5 MiB file.
  const std::int64_t numel = 16384;
  std::string bytes(200 * numel * 4, '\0');
  for (std::size_t i = 0; i < 200; ++i) {
    const float v = static_cast<float>(i);
    std::memcpy(bytes.data() + i * numel * 4, &v, 4);
  }
  write_file(m.dir.path / "many.bin", bytes);
  std::vector<std::pair<std::string, std::uint64_t>> tensors;
  for (std::uint64_t i = 0; i < 200; ++i) tensors.push_back({"many.bin", i * numel * 4});
  kg::Model many = kg::onnx::import(m.write(tensors, numel));
  EXPECT_EQ(many.parameters().size(), 200u);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10.0);
}

// ---- constants made at import ----

TEST(OnnxHardening, ConstantsFoldedAtImportAreCheckedAgainstTheMemory) {
  MemoryLimit limit(std::uint64_t{1} << 30);
  {
    OnnxBuilder m;
    m.initializer("shape", i64s({std::int64_t{1} << 20, std::int64_t{1} << 20}));
    m.node("ConstantOfShape", {"shape"}, {"y"}, "/cos");
    m.output("y");
    kg_test::expect_error([&] { import_model(m); }, {"/cos", "[1048576, 1048576] f32", "needs 4398046511104 bytes",
                                                "1073741824 bytes", "KG_NO_MEMORY_CHECK"});
  }
  {
    OnnxBuilder m;
    m.initializer("s", kg::Tensor::from_vector<std::int64_t>({}, {0}));
    m.initializer("l", kg::Tensor::from_vector<std::int64_t>({}, {std::int64_t{1} << 30}));
    m.initializer("d", kg::Tensor::from_vector<std::int64_t>({}, {1}));
    m.node("Range", {"s", "l", "d"}, {"y"}, "/range");
    m.output("y");
    kg_test::expect_error([&] { import_model(m); }, {"/range", "needs 8589934592 bytes"});
  }
  {
    OnnxBuilder m;
    m.input("x", kg::DType::F32, {std::int64_t{1} << 20, std::int64_t{1} << 20});
    m.node("Trilu", {"x"}, {"y"}, "/trilu");
    m.output("y");
    kg_test::expect_error([&] { import_model(m); }, {"/trilu", "1048576 × 1048576 mask", "needs 1099511627776 bytes"});
  }
  {
    // Expand of a constant: folded on the CPU, whose memory plan is checked before it allocates.
    // (An initializer would stay a trainable parameter, not folded: nothing is allocated then.)
    OnnxBuilder m;
    auto& one = m.node("Constant", {}, {"one"}, "/one");
    OnnxBuilder::attr(one, "value_float", 1.0f);
    m.initializer("shape", i64s({std::int64_t{1} << 20, std::int64_t{1} << 20}));
    m.node("Expand", {"one", "shape"}, {"y"}, "/expand");
    m.output("y");
    kg_test::expect_error([&] { import_model(m); }, {"hostile.onnx", "/expand", "bytes"});
  }
}

// ---- names ----

TEST(OnnxHardening, TerminalEscapesInNamesAreEscapedInErrors) {
  OnnxBuilder m;
  m.input("x\x1b[2J", kg::DType::F32, {std::int64_t{2}});
  m.node("NoSuchOp\x1b]0;t\x07", {"x\x1b[2J"}, {"y"}, "evil\x1b[31m");
  m.output("y");
  try {
    import_model(m);
    FAIL() << "imported";
  } catch (const kg::Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find('\x1b'), std::string::npos) << what;
    EXPECT_EQ(what.find('\x07'), std::string::npos) << what;
    EXPECT_NE(what.find("NoSuchOp\\x1b]0;t\\x07"), std::string::npos) << what;
    EXPECT_NE(what.find("'evil\\x1b[31m'"), std::string::npos) << what;
  }
  OnnxBuilder r;
  r.input("x", kg::DType::F32, {std::int64_t{2}});
  r.node("Relu", {"missing\x1b[1m"}, {"y"}, "n");
  r.output("y");
  kg_test::expect_error([&] { import_model(r); }, {"reads 'missing\\x1b[1m'"});
}

// ---- time ----

// Recording a node looked its name up in every node before it, so a chain's import was
// quadratic (a 100k-node chain: 283 s). 20k nodes now take well under a second on a laptop.
TEST(OnnxHardening, ALongChainImportsInLinearTime) {
  const int n = 20000;
  OnnxBuilder m;
  m.input("x", kg::DType::F32, {std::string("batch"), std::int64_t{4}});
  for (int i = 0; i < n; ++i)
    m.node("Relu", {i == 0 ? "x" : "v" + std::to_string(i - 1)}, {i + 1 == n ? "y" : "v" + std::to_string(i)},
           "/relu" + std::to_string(i));
  m.output("y");
  const std::string bytes = m.bytes();
  const auto start = std::chrono::steady_clock::now();
  const kg::onnx::ImportedGraph g = kg::onnx::import_graph_bytes(bytes, "chain.onnx");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(g.graph->nodes().size(), static_cast<std::size_t>(n + 1));
  EXPECT_LT(s, 20.0) << "a 20000-node chain took " << s << " s to import";
}

}  // namespace
