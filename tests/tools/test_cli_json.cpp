// kgraph run --json, --warmup and the times' percentiles, and kgraph --version against
// include/kg/version.hpp and CMakeLists.txt.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "kg/io.hpp"
#include "kg/kg.hpp"
#include "kg/models.hpp"
#include "support/cli_util.hpp"

namespace fs = std::filesystem;
using kg_test::CliResult;
using kg_test::expect_one_line_error;
using nlohmann::json;

namespace {

class CliJson : public kg_test::CliTest {
 protected:
  CliResult run(const std::vector<std::string>& args) {
    return kg_test::run_kgraph(args, "KG_NUM_THREADS=2", path("stderr.txt"));
  }
  // Parses standard output as exactly one JSON object.
  static json parse(const CliResult& r) {
    json j = json::parse(r.out, nullptr, /*allow_exceptions=*/false);
    EXPECT_TRUE(j.is_object()) << "not one JSON object:\n" << r.out;
    return j;
  }
  static void expect_ordered_times(const json& t) {
    ASSERT_TRUE(t.is_object()) << t;
    for (const char* k : {"median_ms", "p90_ms", "p99_ms", "min_ms", "max_ms"})
      ASSERT_TRUE(t.contains(k) && t[k].is_number()) << k << " in " << t;
    const double mn = t["min_ms"], med = t["median_ms"], p90 = t["p90_ms"], p99 = t["p99_ms"], mx = t["max_ms"];
    EXPECT_GE(mn, 0.0);
    EXPECT_LE(mn, med);
    EXPECT_LE(med, p90);
    EXPECT_LE(p90, p99);
    EXPECT_LE(p99, mx);
  }
};

}  // namespace

// One JSON object with every field; the output's summary agrees with the output file written by the
// same run, the throughput with the batch and the median.
TEST_F(CliJson, RunJsonHasTheFields) {
  const std::string out_file = path("out.safetensors");
  auto r = run({"run", "lenet5", "--batch", "2", "--seed", "3", "--runs", "3", "--warmup", "2", "--json",
                "--output", out_file});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  const json j = parse(r);
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["model"], "lenet5");
  EXPECT_EQ(j["device"], "cpu");
  EXPECT_EQ(j["precision"], "f32");
  ASSERT_EQ(j["inputs"].size(), 1u);
  EXPECT_EQ(j["inputs"][0]["name"], "input");
  EXPECT_EQ(j["inputs"][0]["dtype"], "f32");
  EXPECT_EQ(j["inputs"][0]["shape"], json::array({2, 1, 28, 28}));

  ASSERT_EQ(j["outputs"].size(), 1u);
  const json& o = j["outputs"][0];
  EXPECT_EQ(o["name"], "logits");
  EXPECT_EQ(o["dtype"], "f32");
  EXPECT_EQ(o["shape"], json::array({2, 10}));
  const auto tensors = kg::read_safetensors(out_file);
  ASSERT_EQ(tensors.count("logits"), 1u);
  const kg::Tensor& t = tensors.at("logits");
  double lo = INFINITY, hi = -INFINITY, sum = 0;
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    lo = std::min(lo, t.item(i));
    hi = std::max(hi, t.item(i));
    sum += t.item(i);
  }
  EXPECT_DOUBLE_EQ(o["min"].get<double>(), lo);
  EXPECT_DOUBLE_EQ(o["max"].get<double>(), hi);
  EXPECT_NEAR(o["mean"].get<double>(), sum / static_cast<double>(t.numel()), 1e-12);
  EXPECT_EQ(o["non_finite"], 0);
  EXPECT_EQ(j["output_file"], out_file);

  const json& times = j["times"];
  EXPECT_EQ(times["warmup"], 2);
  EXPECT_EQ(times["runs"], 3);
  expect_ordered_times(times["host"]);
  EXPECT_TRUE(times["device"].is_null()) << "no device time apart from the host's on the cpu";
  EXPECT_EQ(j["throughput"]["unit"], "samples/s");
  EXPECT_EQ(j["throughput"]["samples_per_run"], 2);
  EXPECT_NEAR(j["throughput"]["value"].get<double>(), 2 * 1e3 / times["host"]["median_ms"].get<double>(), 1e-6);
  EXPECT_FALSE(j.contains("profile"));
}

// One timed run: every statistic is that run's time.
TEST_F(CliJson, OneRunWithoutWarmupGivesOneTime) {
  auto r = run({"run", "lenet5", "--runs", "1", "--warmup", "0", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json j = parse(r);
  EXPECT_EQ(j["times"]["warmup"], 0);
  EXPECT_EQ(j["times"]["runs"], 1);
  const json& h = j["times"]["host"];
  for (const char* k : {"p90_ms", "p99_ms", "min_ms", "max_ms"}) EXPECT_EQ(h[k], h["median_ms"]) << k;
}

// --profile adds the nodes: every one named, with its op and a time; the model's own nodes are there.
TEST_F(CliJson, RunJsonWithProfileListsTheNodes) {
  auto r = run({"run", "lenet5", "--runs", "2", "--json", "--profile"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json j = parse(r);
  ASSERT_TRUE(j.contains("profile") && j["profile"].is_array()) << r.out;
  ASSERT_FALSE(j["profile"].empty());
  const kg::Model model = kg::models::build("lenet5");
  int found = 0;
  for (const json& n : j["profile"]) {
    ASSERT_TRUE(n["node"].is_string() && n["op"].is_string() && n["ms"].is_number()) << n;
    EXPECT_GE(n["ms"].get<double>(), 0.0);
    EXPECT_TRUE(n.contains("kernel"));
    if (model.graph().find(n["node"].get<std::string>()) >= 0) ++found;
  }
  EXPECT_GT(found, 0) << r.out;
}

// The text gives the counts, the percentiles and the throughput.
TEST_F(CliJson, RunTextGivesWarmupRunsPercentilesAndThroughput) {
  auto r = run({"run", "lenet5", "--batch", "3", "--runs", "4", "--warmup", "2"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("time: median [0-9.]+ ms over 4 runs after 2 warm-ups \\(p90 "
                                                  "[0-9.]+ ms, p99 [0-9.]+ ms, min [0-9.]+ ms, max [0-9.]+ ms\\)\n")))
      << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("throughput: [0-9.e+]+ samples/s at the median \\(3 per run")))
      << r.out;
  auto one = run({"run", "lenet5", "--runs", "1", "--warmup", "1"});
  ASSERT_EQ(one.code, 0) << one.err;
  EXPECT_NE(one.out.find("over 1 run after 1 warm-up ("), std::string::npos) << one.out;
}

TEST_F(CliJson, BadCountsAreOneLineUsageErrors) {
  expect_one_line_error(run({"run", "lenet5", "--warmup", "-1"}), 2, {"--warmup", "-1"});
  expect_one_line_error(run({"run", "lenet5", "--warmup", "two"}), 2, {"--warmup", "two"});
  expect_one_line_error(run({"run", "lenet5", "--warmup", "99999999999"}), 2, {"--warmup"});
  expect_one_line_error(run({"run", "lenet5", "--runs", "0"}), 2, {"--runs", "0"});
  expect_one_line_error(run({"run", "lenet5", "--runs", "0", "--json"}), 2, {"--runs"});
}

// A failure under --json is the usual one line on stderr, with nothing on stdout.
TEST_F(CliJson, FailureUnderJsonIsOneLineOnStderr) {
  auto r = run({"run", "no-such-model", "--json"});
  expect_one_line_error(r, 1, {"no-such-model"});
  EXPECT_EQ(r.out, "");
}

// inspect --json: the graph's nodes as the library builds them (inference, fused); with --batch the loaded
// shapes and the memory plan, whose parameter bytes are LeNet-5's parameter count in f32.
TEST_F(CliJson, InspectJsonListsNodesAndMemoryPlan) {
  auto r = run({"inspect", "lenet5", "--json", "--batch", "2"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json j = parse(r);
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["model"], "lenet5");
  const kg::Model model = kg::models::build("lenet5");
  const kg::Graph& g = model.graph();
  ASSERT_EQ(j["nodes"].size(), g.nodes().size()) << r.out;
  for (std::size_t i = 0; i < g.nodes().size(); ++i) {
    const json& n = j["nodes"][i];
    EXPECT_EQ(n["name"], g.nodes()[i].name);
    EXPECT_EQ(n["op"], g.nodes()[i].op_name());
    EXPECT_EQ(n["dtype"], "f32");
    EXPECT_EQ(n["shape"], g.nodes()[i].shape.to_string());
    EXPECT_EQ(n["inputs"].size(), g.nodes()[i].inputs.size());
  }
  EXPECT_EQ(j["nodes"].front()["concrete_shape"], json::array({2, 1, 28, 28}));
  EXPECT_EQ(j["nodes"].back()["concrete_shape"], json::array({2, 10}));
  const json& loaded = j["loaded"];
  EXPECT_EQ(loaded["device"], "cpu");
  EXPECT_EQ(loaded["inputs"][0]["shape"], json::array({2, 1, 28, 28}));
  EXPECT_EQ(loaded["outputs"][0]["shape"], json::array({2, 10}));
  const long long params = (6 * 1 * 25 + 6) + (16 * 6 * 25 + 16) + (400 * 120 + 120) + (120 * 84 + 84) + (84 * 10 + 10);
  EXPECT_EQ(loaded["memory_plan"]["param_bytes"], params * 4);
  EXPECT_GE(loaded["memory_plan"]["peak_bytes"].get<long long>(), params * 4);
  EXPECT_GT(loaded["memory_plan"]["buffers"].get<int>(), 0);

  auto bare = run({"inspect", "lenet5", "--json"});
  ASSERT_EQ(bare.code, 0) << bare.err;
  EXPECT_FALSE(parse(bare).contains("loaded"));
  auto both = run({"inspect", "lenet5", "--json", "--dot", "-"});
  expect_one_line_error(both, 1, {"--json", "--dot -"});
  EXPECT_EQ(both.out, "");
}

// --version: the header's version, then the build configuration.
TEST_F(CliJson, VersionPrintsTheHeadersVersionAndTheBuild) {
  auto r = run({"--version"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.substr(0, r.out.find('\n')), std::string("kgraph ") + KG_VERSION_STRING);
  EXPECT_TRUE(std::regex_search(r.out, std::regex("\nbuild: [^\n]*, CUDA path (on|off), oneDNN (on|off), [^\n]+\n$")))
      << r.out;
}

// include/kg/version.hpp says what project() in CMakeLists.txt says.
TEST(Version, HeaderAgreesWithCMakeLists) {
  std::ifstream in(std::string(KG_SOURCE_DIR) + "/CMakeLists.txt");
  ASSERT_TRUE(in) << KG_SOURCE_DIR;
  std::stringstream text;
  text << in.rdbuf();
  const std::string cmake = text.str();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(cmake, m, std::regex("project\\(kernelgraph VERSION ([0-9]+)\\.([0-9]+)\\.([0-9]+)")));
  EXPECT_EQ(std::stoi(m[1]), KG_VERSION_MAJOR);
  EXPECT_EQ(std::stoi(m[2]), KG_VERSION_MINOR);
  EXPECT_EQ(std::stoi(m[3]), KG_VERSION_PATCH);
  EXPECT_EQ(std::string(KG_VERSION_STRING), m[1].str() + "." + m[2].str() + "." + m[3].str());
}
