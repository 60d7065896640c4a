// The kgraph tool on ONNX files, run as a program: a small CNN (one input "input"
// [batch, 3, 16, 16]) and a two-layer BERT (input_ids and attention_mask, i64 [batch, sequence])
// from tests/fixtures/onnx/, with --batch, --dim and input files, against ONNX Runtime's outputs.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "compile/compiler.hpp"
#include "kg/models.hpp"
#include "kg/onnx.hpp"
#include "lower/dry_run.hpp"
#include "support/cli_util.hpp"
#include "support/onnx_builder.hpp"
#include "support/test_util.hpp"
#include "util/str.hpp"

using kg_test::fresh_seed;
namespace fs = std::filesystem;

namespace {

const std::string kFixtures = std::string(KG_SOURCE_DIR) + "/tests/fixtures/onnx/";
const std::string kCnn = kFixtures + "cnn_small.onnx";
const std::string kBert = kFixtures + "bert2.onnx";

// The output line that starts with `first` followed by a space.
std::string line_starting(const std::string& text, const std::string& first) {
  std::istringstream is(text);
  for (std::string line; std::getline(is, line);)
    if (line.rfind(first + " ", 0) == 0) return line;
  return "";
}

// Relative agreement within `rtol`, measured against the largest magnitude of the reference (as
// the importer's own ONNX Runtime comparisons do), so values near zero are not held to 1e-4 of
// themselves.
::testing::AssertionResult close_to_reference(const kg::Tensor& got, const kg::Tensor& want, double rtol) {
  if (got.shape() != want.shape())
    return ::testing::AssertionFailure() << "shape " << kg::sizes_to_string(got.shape()) << ", expected "
                                         << kg::sizes_to_string(want.shape());
  double scale = 0;
  for (std::int64_t i = 0; i < want.numel(); ++i) scale = std::max(scale, std::abs(want.item(i)));
  return kg_test::all_close(got, want, rtol, rtol * scale);
}

class CliOnnx : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "kg-cli-onnx-XXXXXX").string();
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

  std::string file(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  // Runs kgraph with `args` and a kernel cache of this test's own.
  kg_test::CliResult run(const std::vector<std::string>& args) {
    return kg_test::run_kgraph(args, "KG_CACHE_DIR=" + kg_test::shell_quote(cache_), file("stderr.txt"));
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

TEST_F(CliOnnx, InspectPrintsTheSummaryOfAnOnnxFile) {
  for (const std::string& path : {kCnn, kBert}) {
    SCOPED_TRACE(path);
    auto r = run({"inspect", path});
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(r.err, "");
    EXPECT_EQ(r.out.rfind("model " + path + "\n", 0), 0u) << r.out;
    const kg::Model model = kg::onnx::import(path);
    EXPECT_NE(r.out.find(model.summary()), std::string::npos) << r.out;
    for (int id : model.live_nodes()) {
      const kg::Node& n = model.graph().node(id);
      for (const std::string& part : {n.name, n.op_name(), n.shape.to_string()})
        EXPECT_NE(r.out.find(part), std::string::npos) << part;
    }
    EXPECT_EQ(r.out.find("memory plan"), std::string::npos) << "no plan without --batch or --dim";
  }
  EXPECT_NE(run({"inspect", kCnn}).out.find("[batch, 3, 16, 16]"), std::string::npos);
  auto b = run({"inspect", kBert});
  EXPECT_NE(b.out.find("[batch, sequence, 32]"), std::string::npos) << b.out;
  EXPECT_NE(b.out.find("last_hidden_state"), std::string::npos) << b.out;
  EXPECT_NE(b.out.find("pooler_output"), std::string::npos) << b.out;

  // --dot works on an imported model as on a zoo one.
  auto dot = run({"inspect", kCnn, "--dot", "-"});
  EXPECT_EQ(dot.code, 0) << dot.err;
  EXPECT_EQ(dot.out, kg::onnx::import(kCnn).to_dot());
}

TEST_F(CliOnnx, InspectWithBatchAndDimLoadsBothInputs) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::int64_t batch = std::uniform_int_distribution<std::int64_t>(1, 4)(rng);
  const std::int64_t seq = std::uniform_int_distribution<std::int64_t>(1, 9)(rng);
  auto r = run({"inspect", kBert, "--batch", std::to_string(batch), "--dim", kg::util::cat("sequence=", seq)});
  ASSERT_EQ(r.code, 0) << r.err;
  const kg::Model model = kg::onnx::import(kBert);
  kg::LoadedModel loaded = model.load(kg::Device::cpu(), {{batch, seq}, {batch, seq}});
  for (const std::string& part :
       {kg::util::cat("loaded on cpu for batch ", batch, ", sequence ", seq, ":\n"),
        kg::util::cat("  input input_ids: [", batch, ", ", seq, "] i64\n"),
        kg::util::cat("  input attention_mask: [", batch, ", ", seq, "] i64\n"),
        kg::util::cat("  output last_hidden_state: [", batch, ", ", seq, ", 32] f32\n"),
        kg::util::cat("  output pooler_output: [", batch, ", 32] f32\n"),
        "memory plan: " + loaded.memory_plan().to_string() + "\n"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;

  // --dim alone loads too, with batch 1.
  auto d = run({"inspect", kBert, "--dim", "sequence=3"});
  ASSERT_EQ(d.code, 0) << d.err;
  EXPECT_NE(d.out.find("loaded on cpu for batch 1, sequence 3:"), std::string::npos) << d.out;
}

TEST_F(CliOnnx, RunBertWithRandomInputsPrintsBothOutputs) {
  auto r = run({"run", kBert, "--batch", "2", "--dim", "sequence=5", "--runs", "2"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  for (const std::string& part :
       {"model " + kBert + " on cpu\n", std::string("input input_ids: [2, 5] i64, random integers from {0, 1}, seed 0\n"),
        std::string("input attention_mask: [2, 5] i64, random integers from {0, 1}, seed 0\n"),
        "weights: the initializers of " + kBert + "\n", std::string("output last_hidden_state: [2, 5, 32] f32\n"),
        std::string("output pooler_output: [2, 32] f32\n"), std::string("row 1: top-5 "),
        std::string("time: median "), std::string("over 2 runs")})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  EXPECT_LT(r.out.find("output last_hidden_state"), r.out.find("output pooler_output")) << r.out;
}

// With batch 1 and sequence 2 there are 16 inputs whose ids and mask are all 0 or 1: the
// random run's outputs must be those of one of them, in process.
TEST_F(CliOnnx, RandomIntegerInputsAreZerosAndOnes) {
  const auto seed = fresh_seed() % 1000;
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto r = run({"run", kBert, "--dim", "sequence=2", "--seed", std::to_string(seed), "--runs", "1", "--output",
                file("y.safetensors")});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("input input_ids: [1, 2] i64, random integers from {0, 1}, seed " + std::to_string(seed)),
            std::string::npos)
      << r.out;
  const auto got = kg::read_safetensors(file("y.safetensors"));
  ASSERT_EQ(got.count("pooler_output"), 1u);
  const kg::Model model = kg::onnx::import(kBert);
  kg::LoadedModel loaded = model.load(kg::Device::cpu(), {{1, 2}, {1, 2}});
  int matches = 0;
  for (int bits = 0; bits < 16; ++bits) {
    const kg::Tensor ids = kg::Tensor::from_vector<std::int64_t>({1, 2}, {bits & 1, (bits >> 1) & 1});
    const kg::Tensor mask = kg::Tensor::from_vector<std::int64_t>({1, 2}, {(bits >> 2) & 1, (bits >> 3) & 1});
    const auto want = loaded.forward({ids, mask});
    matches += static_cast<bool>(kg_test::all_close(got.at("pooler_output"), want.at(1), 1e-6, 1e-7)) &&
               static_cast<bool>(kg_test::all_close(got.at("last_hidden_state"), want.at(0), 1e-6, 1e-7));
  }
  EXPECT_GE(matches, 1) << "the outputs are not those of any input of zeros and ones\n" << r.out;
}

TEST_F(CliOnnx, RunBertOnTheReferenceInputsMatchesOnnxRuntime) {
  const std::string ref = kFixtures + "bert2.case2.safetensors";  // inputs and ORT outputs, [3, 7]
  auto r = run({"run", kBert, "--input", ref, "--output", file("y.safetensors"), "--runs", "1"});
  ASSERT_EQ(r.code, 0) << r.err;
  for (const std::string& part :
       {"input input_ids: [3, 7] i64, tensor 'input_ids' of " + ref + "\n",
        "input attention_mask: [3, 7] i64, tensor 'attention_mask' of " + ref + "\n",
        std::string("output last_hidden_state: [3, 7, 32] f32\n"), std::string("output pooler_output: [3, 32] f32\n"),
        "wrote 2 outputs to " + file("y.safetensors")})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  const auto got = kg::read_safetensors(file("y.safetensors"));
  const auto want = kg::read_safetensors(ref);
  EXPECT_EQ(got.size(), 2u);
  for (const char* name : {"last_hidden_state", "pooler_output"}) {
    ASSERT_EQ(got.count(name), 1u) << name;
    EXPECT_TRUE(close_to_reference(got.at(name), want.at(name), 1e-4)) << name;
  }

  // Options that agree with the file are accepted; one that disagrees is an error.
  auto agree = run({"run", kBert, "--input", ref, "--batch", "3", "--dim", "sequence=7", "--runs", "1"});
  EXPECT_EQ(agree.code, 0) << agree.err;
  expect_one_line_error(run({"run", kBert, "--input", ref, "--dim", "sequence=6"}), 1,
                        {"--dim sequence=6", "disagrees", ref, "sequence 7", "[3, 7]"});
  expect_one_line_error(run({"run", kBert, "--input", ref, "--batch", "2"}), 1,
                        {"--batch 2", "disagrees", ref, "batch 3"});
}

TEST_F(CliOnnx, RunSmallCnnOnItsInputFileMatchesOnnxRuntime) {
  const std::string ref = kFixtures + "cnn_small.case2.safetensors";  // "input" [4, 3, 16, 16] and "logits"
  auto r = run({"run", kCnn, "--input", ref, "--output", file("y.safetensors"), "--runs", "1"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("input input: [4, 3, 16, 16] f32, tensor 'input' of " + ref), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("row 3: top-5 "), std::string::npos) << r.out;
  const auto got = kg::read_safetensors(file("y.safetensors"));
  ASSERT_EQ(got.count("logits"), 1u);
  EXPECT_TRUE(close_to_reference(got.at("logits"), kg::read_safetensors(ref).at("logits"), 1e-4));

  // A single tensor under another name feeds a single-input model, as for the zoo; random
  // float inputs are uniform in [-1, 1) as for the zoo.
  kg::write_safetensors(file("x.safetensors"), {{"pixels", kg::read_safetensors(ref).at("input")}});
  auto one = run({"run", kCnn, "--input", file("x.safetensors"), "--runs", "1"});
  EXPECT_EQ(one.code, 0) << one.err;
  EXPECT_NE(one.out.find("tensor 'pixels' of "), std::string::npos) << one.out;
  auto rnd = run({"run", kCnn, "--batch", "2", "--seed", "3", "--runs", "1"});
  EXPECT_EQ(rnd.code, 0) << rnd.err;
  EXPECT_NE(rnd.out.find("input input: [2, 3, 16, 16] f32, random U(-1, 1), seed 3"), std::string::npos) << rnd.out;
  EXPECT_NE(rnd.out.find("output logits: [2, 10] f32"), std::string::npos) << rnd.out;
}

TEST_F(CliOnnx, CompileSmallCnnPacksEveryLaunch) {
  if (!kg::compile::Compiler::available()) GTEST_SKIP() << "built without NVRTC";
  const kg::Model model = kg::onnx::import(kCnn);
  const kg::lower::LoweredGraph lowered = kg::lower::dry_run(model, {{2, 3, 16, 16}}, 0).lowered;
  auto r = run({"compile", kCnn, "--arch", "90", "--batch", "2"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_NE(r.out.find("compiling " + kCnn + " for sm_90 at batch 2 with NVRTC"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("every launch packed and checked for [2, 3, 16, 16]"), std::string::npos) << r.out;
  int kernels = 0;
  for (const auto& e : lowered.executables) {
    if (e.view) continue;
    ++kernels;
    const std::string line = line_starting(r.out, model.graph().node(e.node).name);
    ASSERT_FALSE(line.empty()) << model.graph().node(e.node).name << "\n" << r.out;
    EXPECT_NE(line.find(e.name), std::string::npos) << line;
    EXPECT_NE(line.find("grid ("), std::string::npos) << line;
  }
  EXPECT_NE(r.out.find(kg::util::cat(kernels, " kernels")), std::string::npos) << r.out;
  EXPECT_GT(cached_ptx_files(), 0);

  // The BERT needs its sequence; nothing is compiled without it.
  const int before = cached_ptx_files();
  expect_one_line_error(run({"compile", kBert, "--arch", "90"}), 1, {"'sequence'", "--dim sequence=SIZE"});
  EXPECT_EQ(cached_ptx_files(), before);
  expect_one_line_error(run({"compile", "--all", "--dim", "sequence=4"}), 1, {"--dim", "--all"});
}

TEST_F(CliOnnx, ModelErrors) {
  std::vector<std::string> zoo;
  for (const auto& n : kg::models::names()) zoo.push_back(n);
  const std::string missing = file("missing.onnx");
  for (const char* command : {"inspect", "run"}) {
    SCOPED_TRACE(command);
    auto parts = zoo;
    parts.insert(parts.end(), {missing, "does not exist", ".onnx"});
    expect_one_line_error(run({command, missing}), 1, parts);
    parts = zoo;
    parts.insert(parts.end(), {"unknown model 'nosuchnet'", ".onnx"});
    expect_one_line_error(run({command, "nosuchnet"}), 1, parts);
  }
  // An existing file that is not ONNX: the importer's error names it.
  {
    std::ofstream f(file("junk.onnx"), std::ios::binary);
    f << "not a protobuf";
  }
  expect_one_line_error(run({"inspect", file("junk.onnx")}), 1, {file("junk.onnx")});
  fs::create_directory(file("dir.onnx"));
  expect_one_line_error(run({"inspect", file("dir.onnx")}), 1, {file("dir.onnx"), "directory"});
}

TEST_F(CliOnnx, DimErrors) {
  // An unset named dim: the input, the dim and the option to use.
  expect_one_line_error(run({"run", kBert, "--batch", "2"}), 1, {"input_ids", "'sequence'", "--dim sequence=SIZE"});
  expect_one_line_error(run({"inspect", kBert, "--batch", "2"}), 1, {"input_ids", "'sequence'", "--dim"});
  // Bad --dim syntax is a usage error.
  for (const std::string bad : {"sequence", "sequence=", "=5", "sequence=0", "sequence=two", "sequence=-1"}) {
    SCOPED_TRACE(bad);
    expect_one_line_error(run({"run", kBert, "--dim", bad}), 2, {"--dim", "NAME=SIZE", "'" + bad + "'"});
  }
  expect_one_line_error(run({"inspect", kBert, "--dim"}), 2, {"--dim"});
  // A dim the model does not have.
  expect_one_line_error(run({"run", kBert, "--dim", "seq=4"}), 1, {"--dim seq=4", "'seq'", "batch, sequence"});
  expect_one_line_error(run({"run", kCnn, "--dim", "sequence=4"}), 1, {"'sequence'", "batch"});
  // --batch and --dim batch=N are the same option and must agree.
  auto same = run({"run", kCnn, "--dim", "batch=2", "--runs", "1"});
  EXPECT_EQ(same.code, 0) << same.err;
  EXPECT_NE(same.out.find("input input: [2, 3, 16, 16]"), std::string::npos) << same.out;
  expect_one_line_error(run({"run", kCnn, "--batch", "3", "--dim", "batch=2"}), 1, {"--batch 3", "--dim batch=2"});
  // --dim goes with any command that takes MODEL.
  for (const char* command : {"inspect", "run", "compile"}) {
    auto h = run({command, "--help"});
    EXPECT_NE(h.out.find("--dim"), std::string::npos) << command << "\n" << h.out;
    EXPECT_NE(h.out.find(".onnx"), std::string::npos) << command << "\n" << h.out;
  }
  auto h = run({"run", "--help"});
  EXPECT_NE(h.out.find("{0, 1}"), std::string::npos) << h.out;
}

TEST_F(CliOnnx, InputFileErrors) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto ids = [&](std::vector<std::int64_t> shape) {
    return kg_test::random_tensor(rng, kg::DType::F64, shape, 0, 2).to(kg::DType::F32);
  };
  auto ints = [&](std::vector<std::int64_t> shape) {
    kg::Tensor t = kg::Tensor::zeros(kg::DType::I64, shape);
    std::int64_t* d = t.data<std::int64_t>();
    for (std::int64_t i = 0; i < t.numel(); ++i) d[i] = static_cast<std::int64_t>(rng() % 2);
    return t;
  };

  // An input missing from the file: named, with the file's tensors.
  kg::write_safetensors(file("ids.safetensors"), {{"input_ids", ints({2, 5})}, {"other", ints({2, 5})}});
  expect_one_line_error(run({"run", kBert, "--input", file("ids.safetensors")}), 1,
                        {file("ids.safetensors"), "'attention_mask'", "input_ids, other"});
  // A single tensor does not feed a two-input model.
  kg::write_safetensors(file("one.safetensors"), {{"x", ints({2, 5})}});
  expect_one_line_error(run({"run", kBert, "--input", file("one.safetensors")}), 1,
                        {file("one.safetensors"), "'input_ids'", "'attention_mask'"});
  // Inputs that disagree on a shared dim.
  kg::write_safetensors(file("skew.safetensors"), {{"input_ids", ints({2, 5})}, {"attention_mask", ints({2, 6})}});
  expect_one_line_error(run({"run", kBert, "--input", file("skew.safetensors")}), 1,
                        {"'attention_mask'", "[2, 6]", "[2, 5]", "sequence 5 from tensor 'input_ids'"});
  // The wrong rank and the wrong dtype.
  kg::write_safetensors(file("rank.safetensors"), {{"input_ids", ints({10})}, {"attention_mask", ints({2, 5})}});
  expect_one_line_error(run({"run", kBert, "--input", file("rank.safetensors")}), 1,
                        {"'input_ids'", "[10]", "[batch, sequence]"});
  kg::write_safetensors(file("float.safetensors"), {{"input_ids", ids({2, 5})}, {"attention_mask", ints({2, 5})}});
  expect_one_line_error(run({"run", kBert, "--input", file("float.safetensors")}), 1, {"'input_ids'", "f32", "i64"});
  // A static dim that does not match.
  kg::write_safetensors(file("cnn.safetensors"), {{"input", kg_test::random_tensor(rng, kg::DType::F32, {2, 4, 16, 16})}});
  expect_one_line_error(run({"run", kCnn, "--input", file("cnn.safetensors")}), 1,
                        {"[2, 4, 16, 16]", "[2, 3, 16, 16]", "batch 2"});
}

// A file without the .onnx extension is imported when it exists; an unnamed dynamic dim can only
// be sized by an input file.
TEST_F(CliOnnx, AnUnnamedDynamicDimNeedsAnInputFile) {
  kg_test::OnnxBuilder m;
  m.input("x", kg::DType::F32, {std::string("batch"), std::int64_t{-1}});  // [batch, ?]
  m.node("Relu", {"x"}, {"y"}, "/relu/Relu");
  m.output("y");
  const std::string path = file("relu.model");
  {
    std::ofstream f(path, std::ios::binary);
    f << m.bytes();
  }
  auto r = run({"inspect", path});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("[batch, ?]"), std::string::npos) << r.out;

  for (const char* command : {"run", "inspect"})
    expect_one_line_error(run({command, path, "--batch", "2"}), 1, {"'x'", "unnamed dynamic dim", "dim 1", "--input"});

  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {2, 3});
  kg::write_safetensors(file("x.safetensors"), {{"x", x}});
  auto ok = run({"run", path, "--input", file("x.safetensors"), "--output", file("y.safetensors"), "--runs", "1"});
  ASSERT_EQ(ok.code, 0) << ok.err;
  EXPECT_NE(ok.out.find("output y: [2, 3] f32"), std::string::npos) << ok.out;
  const kg::Tensor y = kg::read_safetensors(file("y.safetensors")).at("y");
  ASSERT_EQ(y.shape(), x.shape());
  for (std::int64_t i = 0; i < x.numel(); ++i) EXPECT_EQ(y.item(i), std::max(0.0, x.item(i))) << i;
}
