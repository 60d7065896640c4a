// The kgraph command-line tool, run as a program: exit codes, output and error text.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "graph/dump.hpp"
#include "kg/models.hpp"
#include "support/cli_util.hpp"
#include "support/test_util.hpp"
#include "util/str.hpp"

using kg_test::CliResult;
using kg_test::expect_one_line_error;
using kg_test::read_file;
using kg_test::fresh_seed;
namespace fs = std::filesystem;

namespace {

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "kg-cli-test-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    binary_ = kg_test::kgraph_binary();
    ASSERT_TRUE(fs::exists(binary_)) << binary_ << " is missing: build the kgraph target before the tests";
  }
  void TearDown() override {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }

  std::string file(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  // Runs kgraph with `args`; stdout and stderr are captured apart.
  CliResult run(const std::vector<std::string>& args, const std::string& env = "") {
    return kg_test::run_kgraph(args, env, file("stderr.txt"));
  }

  std::string dir_, binary_;
};

// LeNet-5 weights with fresh random values, shaped like the model's parameters.
std::map<std::string, kg::Tensor> random_lenet_weights(std::mt19937_64& rng) {
  kg::Model model = kg::models::build("lenet5");
  std::map<std::string, kg::Tensor> w;
  for (const auto& p : model.parameters())
    w.emplace(p.name, kg_test::random_tensor(rng, p.dtype, p.shape, -0.3, 0.3));
  return w;
}

long long lenet_parameter_count() {
  // conv 1→6 5x5, conv 6→16 5x5, linear 400→120, 120→84, 84→10, each with a bias.
  return (6 * 1 * 25 + 6) + (16 * 6 * 25 + 16) + (400 * 120 + 120) + (120 * 84 + 84) + (84 * 10 + 10);
}

}  // namespace

TEST_F(Cli, HelpAndVersion) {
  auto r = run({"--help"});
  EXPECT_EQ(r.code, 0) << r.err;
  for (const char* part : {"models", "inspect", "run", "--version", "--help"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  EXPECT_EQ(r.err, "");

  const std::map<std::string, std::vector<std::string>> options{
      {"models", {"models"}},
      {"inspect", {"MODEL", "--batch", "--dim", "--dot", "--render", "--recorded"}},
      {"run",
       {"MODEL", "--device", "--weights", "--input", "--random", "--batch", "--dim", "--seed", "--output", "--runs",
        "--checked"}},
  };
  for (const auto& [sub, parts] : options) {
    auto h = run({sub, "--help"});
    EXPECT_EQ(h.code, 0) << sub << ": " << h.err;
    for (const auto& p : parts)
      EXPECT_NE(h.out.find(p), std::string::npos) << sub << " help lacks " << p << "\n" << h.out;
  }

  auto v = run({"--version"});
  EXPECT_EQ(v.code, 0);
  EXPECT_TRUE(std::regex_search(v.out, std::regex("^kgraph [0-9]+\\.[0-9]+\\.[0-9]+\nbuild: [^\n]+\n$"))) << v.out;
}

TEST_F(Cli, UsageErrorsExitWithTwo) {
  expect_one_line_error(run({}), 2, {"subcommand"});
  expect_one_line_error(run({"inspect"}), 2, {"MODEL", "kgraph inspect --help"});
  expect_one_line_error(run({"inspect", "lenet5", "--bogus"}), 2, {"--bogus"});
  expect_one_line_error(run({"frobnicate"}), 2, {"unknown command 'frobnicate'", "inspect"});
  expect_one_line_error(run({"run", "lenet5", "--batch", "0"}), 2, {"--batch"});
  expect_one_line_error(run({"run", "lenet5", "--batch", "two"}), 2, {"--batch", "two"});
  expect_one_line_error(run({"run", "lenet5", "--runs", "-3"}), 2, {"--runs"});
  expect_one_line_error(run({"run", "lenet5", "--input", file("x.safetensors"), "--random"}), 2,
                        {"--input", "--random"});
}

TEST_F(Cli, ModelsListsTheZoo) {
  auto r = run({"models"});
  EXPECT_EQ(r.code, 0) << r.err;
  for (const auto& name : kg::models::names()) {
    std::istringstream is(r.out);
    std::string line;
    bool found = false;
    while (std::getline(is, line))
      if (line.rfind(name + " ", 0) == 0) found = true;
    EXPECT_TRUE(found) << name << "\n" << r.out;
  }
  std::istringstream is(r.out);
  std::string line;
  while (std::getline(is, line))
    if (line.rfind("lenet5 ", 0) == 0) {
      EXPECT_NE(line.find("[batch, 1, 28, 28]"), std::string::npos) << line;
      EXPECT_NE(line.find(kg::dump::group_digits(lenet_parameter_count())), std::string::npos) << line;
    }
}

TEST_F(Cli, InspectPrintsTheSummary) {
  auto r = run({"inspect", "lenet5"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  kg::Model model = kg::models::build("lenet5");
  for (int id : model.live_nodes()) {
    const kg::Node& n = model.graph().node(id);
    for (const std::string& part : {n.name, n.op_name(), n.shape.to_string()})
      EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  }
  EXPECT_NE(r.out.find("[batch, 6, 28, 28]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(kg::dump::group_digits(lenet_parameter_count()) + " parameters"), std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("memory plan"), std::string::npos) << "no plan without --batch";

  auto rec = run({"inspect", "lenet5", "--recorded"});
  EXPECT_EQ(rec.code, 0) << rec.err;
  EXPECT_NE(rec.out.find("as recorded"), std::string::npos) << rec.out;
  kg::Model recorded = kg::models::build("lenet5", kg::LoweringMode::Training);
  for (const auto& n : recorded.recorded_graph().nodes())
    EXPECT_NE(rec.out.find(" " + n.name + " "), std::string::npos) << n.name << "\n" << rec.out;
}

TEST_F(Cli, InspectWithBatchShowsShapesAndMemoryPlan) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::int64_t batch = std::uniform_int_distribution<std::int64_t>(1, 16)(rng);
  auto r = run({"inspect", "lenet5", "--batch", std::to_string(batch)});
  EXPECT_EQ(r.code, 0) << r.err;
  kg::Model model = kg::models::build("lenet5");
  kg::LoadedModel loaded = model.load(kg::Device::cpu(), {kg::models::input_shape("lenet5", batch)});
  EXPECT_NE(r.out.find(kg::util::cat("output logits: [", batch, ", 10] f32")), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(kg::util::cat("input input: [", batch, ", 1, 28, 28] f32")), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("memory plan: " + loaded.memory_plan().to_string() + "\n"), std::string::npos)
      << r.out;
}

TEST_F(Cli, InspectWritesDotAndRendersIt) {
  if (std::system("command -v dot >/dev/null 2>&1") != 0) GTEST_SKIP() << "graphviz's dot is not installed";
  kg::Model model = kg::models::build("lenet5");
  const std::string dot = file("lenet5.dot"), svg = file("lenet5.svg");
  auto r = run({"inspect", "lenet5", "--dot", dot, "--render", svg});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(read_file(dot), model.to_dot());
  EXPECT_NE(read_file(svg).find("<svg"), std::string::npos);
  EXPECT_NE(read_file(svg).find("features.0"), std::string::npos);

  auto s = run({"inspect", "lenet5", "--dot", "-"});
  EXPECT_EQ(s.code, 0) << s.err;
  EXPECT_EQ(s.out, model.to_dot()) << "--dot - prints only the DOT text";

  expect_one_line_error(run({"inspect", "lenet5", "--render", file("g.txt")}), 1, {"g.txt", ".svg"});
  // Without graphviz on PATH the error says what is missing.
  fs::create_directory(file("empty-bin"));
  expect_one_line_error(run({"inspect", "lenet5", "--render", file("g.png")},
                            "PATH=" + kg_test::shell_quote(file("empty-bin"))),
                        1, {"g.png", "'dot'", "graphviz"});
  EXPECT_FALSE(fs::exists(file("g.png")));
  expect_one_line_error(run({"inspect", "lenet5", "--dot", file("no-dir/g.dot")}), 1, {"no-dir/g.dot"});
}

TEST_F(Cli, RunWithRandomInput) {
  auto r = run({"run", "lenet5", "--random", "--batch", "3", "--runs", "2"});
  EXPECT_EQ(r.code, 0) << r.err;
  for (const char* part :
       {"model lenet5 on cpu", "input input: [3, 1, 28, 28] f32", "output logits: [3, 10] f32",
        "row 0: top-5 ", "row 2: top-5 ", "time: median ", "over 2 runs"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  EXPECT_EQ(r.out.find("row 3:"), std::string::npos) << r.out;
  // --device auto picks cpu on a machine without a usable GPU.
  if (!kg::Device::cuda_available()) {
    auto a = run({"run", "lenet5", "--device", "auto"});
    EXPECT_EQ(a.code, 0) << a.err;
    EXPECT_NE(a.out.find("on cpu"), std::string::npos) << a.out;
  }
}

// Checked mode runs every kernel under the emulator, verified, and gives the same result.
TEST_F(Cli, RunChecked) {
  auto plain = run({"run", "lenet5", "--random", "--batch", "2", "--runs", "1"});
  auto checked = run({"run", "lenet5", "--random", "--batch", "2", "--runs", "1", "--checked"});
  ASSERT_EQ(plain.code, 0) << plain.err;
  ASSERT_EQ(checked.code, 0) << checked.err;
  EXPECT_NE(checked.out.find("model lenet5 on cpu (checked"), std::string::npos) << checked.out;
  // (class, value) pairs of the "row N: top-5 c (v), ..." lines.
  auto top = [](const std::string& out) {
    std::vector<std::pair<int, double>> v;
    static const std::regex pair_re(R"((\d+) \(([-+0-9.eE]+)\))");
    std::istringstream in(out);
    for (std::string line; std::getline(in, line);) {
      if (line.find("row ") == std::string::npos) continue;
      const std::string body = line.substr(line.find("top-5"));
      for (auto it = std::sregex_iterator(body.begin(), body.end(), pair_re); it != std::sregex_iterator(); ++it)
        v.emplace_back(std::stoi((*it)[1]), std::stod((*it)[2]));
    }
    return v;
  };
  const auto a = top(plain.out), b = top(checked.out);
  ASSERT_EQ(a.size(), 10u) << plain.out;
  ASSERT_EQ(b.size(), a.size()) << checked.out;
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(b[i].first, a[i].first) << i;
    EXPECT_NEAR(b[i].second, a[i].second, 1e-5 + 1e-4 * std::abs(a[i].second)) << i;
  }
}

TEST_F(Cli, RunUsesWeightsAndInputAndWritesOutputs) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::int64_t batch = std::uniform_int_distribution<std::int64_t>(1, 6)(rng);
  auto weights = random_lenet_weights(rng);
  kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, kg::models::input_shape("lenet5", batch));
  kg::write_safetensors(file("w.safetensors"), weights);
  kg::write_safetensors(file("x.safetensors"), {{"image", x}});

  auto r = run({"run", "lenet5", "--weights", file("w.safetensors"), "--input", file("x.safetensors"),
                "--output", file("y.safetensors"), "--runs", "1"});
  ASSERT_EQ(r.code, 0) << r.err;

  // The same computation in process, with the same weights.
  kg::Model model = kg::models::build("lenet5");
  kg::LoadedModel loaded = model.load(kg::Device::cpu(), {x.shape()});
  loaded.load_state_dict(weights);
  kg::Tensor want = loaded.forward({x}).at(0);
  auto got = kg::read_safetensors(file("y.safetensors"));
  ASSERT_EQ(got.count("logits"), 1u);
  EXPECT_TRUE(kg_test::all_close(got.at("logits"), want, 1e-6, 1e-7));

  // The printed top-1 of every row is the reference's argmax.
  for (std::int64_t row = 0; row < batch; ++row) {
    std::int64_t best = 0;
    for (std::int64_t j = 1; j < 10; ++j)
      if (want.item(row * 10 + j) > want.item(row * 10 + best)) best = j;
    EXPECT_NE(r.out.find(kg::util::cat("row ", row, ": top-5 ", best, " (")), std::string::npos) << r.out;
  }
  EXPECT_NE(r.out.find("weights: " + file("w.safetensors")), std::string::npos) << r.out;

  // A batch that disagrees with the input file.
  expect_one_line_error(
      run({"run", "lenet5", "--input", file("x.safetensors"), "--batch", std::to_string(batch + 1)}), 1,
      {"--batch", std::to_string(batch + 1), "x.safetensors"});
}

TEST_F(Cli, BadModelName) {
  auto r = run({"run", "nosuchnet", "--random"});
  std::vector<std::string> parts{"nosuchnet"};
  for (const auto& n : kg::models::names()) parts.push_back(n);
  expect_one_line_error(r, 1, parts);
  EXPECT_EQ(r.out, "");
  expect_one_line_error(run({"inspect", "nosuchnet"}), 1, parts);
}

TEST_F(Cli, MissingAndMalformedFiles) {
  const std::string missing = file("missing.safetensors");
  expect_one_line_error(run({"run", "lenet5", "--weights", missing}), 1, {missing});
  expect_one_line_error(run({"run", "lenet5", "--input", missing}), 1, {missing});

  const std::string junk = file("junk.safetensors");
  {
    std::ofstream f(junk, std::ios::binary);
    f << "this is not a safetensors file at all";
  }
  expect_one_line_error(run({"run", "lenet5", "--weights", junk}), 1, {junk});
  const std::string tiny = file("tiny.safetensors");
  {
    std::ofstream f(tiny, std::ios::binary);
    f << "abc";
  }
  expect_one_line_error(run({"run", "lenet5", "--weights", tiny}), 1, {tiny, "truncated"});
}

TEST_F(Cli, InputFileWithTheWrongShape) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  kg::write_safetensors(file("x.safetensors"),
                        {{"input", kg_test::random_tensor(rng, kg::DType::F32, {2, 3, 28, 28})}});
  expect_one_line_error(run({"run", "lenet5", "--input", file("x.safetensors")}), 1,
                        {"x.safetensors", "[2, 3, 28, 28]", "[2, 1, 28, 28]"});
  kg::write_safetensors(file("two.safetensors"),
                        {{"a", kg_test::random_tensor(rng, kg::DType::F32, {1, 1, 28, 28})},
                         {"b", kg_test::random_tensor(rng, kg::DType::F32, {1, 1, 28, 28})}});
  expect_one_line_error(run({"run", "lenet5", "--input", file("two.safetensors")}), 1,
                        {"two.safetensors", "a, b", "'input'"});
}

TEST_F(Cli, Devices) {
  expect_one_line_error(run({"run", "lenet5", "--device", "tpu"}), 1,
                        {"unknown device 'tpu'", "cpu", "cuda"});
  expect_one_line_error(run({"run", "lenet5", "--device", "cuda:x"}), 1, {"'cuda:x'"});
  if (!kg::Device::cuda_available()) {
    auto r = run({"run", "lenet5", "--device", "cuda"});
    expect_one_line_error(r, 1, {"cuda"});
    EXPECT_EQ(r.out, "");
  }
}

TEST_F(Cli, WeightsWithAMisShapedTensor) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto weights = random_lenet_weights(rng);
  weights["features.0.weight"] = kg_test::random_tensor(rng, kg::DType::F32, {6, 1, 3, 3});
  const std::string path = file("bad.safetensors");
  kg::write_safetensors(path, weights);
  auto r = run({"run", "lenet5", "--weights", path});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(r.err.rfind("kgraph: error: ", 0), 0u) << r.err;
  for (const std::string& part :
       {path, std::string("features.0.weight"), std::string("[6, 1, 3, 3]"), std::string("[6, 1, 5, 5]")})
    EXPECT_NE(r.err.find(part), std::string::npos) << part << "\n" << r.err;
  EXPECT_EQ(r.err.find("kgraph: error: ", 1), std::string::npos) << "one error, printed once:\n" << r.err;
}
