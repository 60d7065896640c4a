// kgraph run --threads and --profile: the thread count reaches the load, bad counts are usage
// errors, and the per-node table counts the work of the convolutions and matrix products.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "kg/io.hpp"
#include "kg/model.hpp"
#include "ops/dnnl.hpp"
#include "support/cli_util.hpp"
#include "util/thread_pool.hpp"

using kg_test::CliResult;
using kg_test::expect_one_line_error;
namespace fs = std::filesystem;

namespace {

class CliProfile : public kg_test::CliTest {
 protected:
  CliResult run(const std::vector<std::string>& args, const std::string& env = "") {
    return kg_test::run_kgraph(args, env, path("stderr.txt"));
  }
};

// The whitespace-separated fields of the profile row of `node` ("" fields when there is none).
std::vector<std::string> profile_row(const std::string& out, const std::string& node) {
  std::istringstream in(out.substr(std::min(out.size(), out.find("profile of the last run"))));
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    std::vector<std::string> f;
    for (std::string w; fields >> w;) f.push_back(w);
    if (!f.empty() && f[0] == node) return f;
  }
  return {};
}

// LeNet-5 at batch 2: 2·N·O·OH·OW·(C/groups)·KH·KW per convolution, 2·M·N·K per linear layer.
constexpr double kConv1 = 2.0 * 2 * 6 * 28 * 28 * 1 * 5 * 5;   // 470,400
constexpr double kConv2 = 2.0 * 2 * 16 * 10 * 10 * 6 * 5 * 5;  // 960,000
constexpr double kFc1 = 2.0 * 2 * 120 * 400, kFc2 = 2.0 * 2 * 84 * 120, kFc3 = 2.0 * 2 * 10 * 84;

}  // namespace

TEST_F(CliProfile, HelpListsTheFlags) {
  const CliResult h = run({"run", "--help"});
  EXPECT_EQ(h.code, 0) << h.err;
  for (const char* part : {"--threads", "--profile", "GFLOP/s"})
    EXPECT_NE(h.out.find(part), std::string::npos) << part << "\n" << h.out;
}

TEST_F(CliProfile, ThreadsGiveTheSameOutputs) {
  std::map<std::string, kg::Tensor> outs[2];
  const char* counts[] = {"1", "2"};
  for (int i = 0; i < 2; ++i) {
    const std::string file = path(std::string("out") + counts[i] + ".safetensors");
    const CliResult r = run({"run", "lenet5", "--batch", "4", "--seed", "3", "--runs", "2", "--threads",
                             counts[i], "--output", file});
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_NE(r.out.find("time: median "), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("profile of the last run"), std::string::npos) << "no table without --profile\n"
                                                                        << r.out;
    outs[i] = kg::read_safetensors(file);
  }
  const kg::Tensor &a = outs[0].at("logits"), &b = outs[1].at("logits");
  ASSERT_EQ(a.shape(), b.shape());
  for (std::int64_t k = 0; k < a.numel(); ++k) EXPECT_NEAR(a.item(k), b.item(k), 1e-5) << "logit " << k;
  // 0 is one per core (or KG_NUM_THREADS), as for kgraph train.
  EXPECT_EQ(run({"run", "lenet5", "--threads", "0", "--runs", "1"}).code, 0);
}

TEST_F(CliProfile, BadThreadCountsAreUsageErrors) {
  const std::string max = std::to_string(kg::util::ThreadPool::kMaxThreads);
  const std::string over = std::to_string(kg::util::ThreadPool::kMaxThreads + 1);
  for (const std::string& n :
       {std::string("-1"), std::string("100000"), over, std::string("2x"), std::string("")}) {
    SCOPED_TRACE("--threads '" + n + "'");
    const CliResult r = run({"run", "lenet5", "--threads", n});
    expect_one_line_error(r, 2, {"--threads"});
    if (!n.empty()) {
      EXPECT_NE(r.err.find("from 0 (one per core) to " + max + ", got '" + n + "'"), std::string::npos)
          << r.err;
    }
    EXPECT_EQ(r.out, "");
  }
  // --threads 0 takes KG_NUM_THREADS; a bad value there is an error naming it.
  expect_one_line_error(run({"run", "lenet5", "--threads", "0"}, "KG_NUM_THREADS=abc"), 1,
                        {"KG_NUM_THREADS is 'abc'", "from 0 to " + max});
}

TEST_F(CliProfile, ProfileCountsTheMatrixProducts) {
  const CliResult r = run({"run", "lenet5", "--batch", "2", "--runs", "3", "--profile", "--threads", "1"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("time: median "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("profile of the last run: "), std::string::npos) << r.out;
  for (const char* head : {"node", "op", "ms", "%", "GFLOP", "GFLOP/s", "bytes (min)", "GB/s"})
    EXPECT_NE(r.out.find(head), std::string::npos) << head << "\n" << r.out;

  // node, op, ms, %, GFLOP, GFLOP/s, bytes, unit, GB/s
  const std::map<std::string, double> flops{{"features.0", kConv1},
                                            {"features.3", kConv2},
                                            {"classifier.0", kFc1},
                                            {"classifier.2", kFc2},
                                            {"classifier.4", kFc3}};
  for (const auto& [node, f] : flops) {
    const auto row = profile_row(r.out, node);
    ASSERT_GE(row.size(), 9u) << node << "\n" << r.out;
    EXPECT_NEAR(std::stod(row[4]) * 1e9, f, f * 1e-3) << node << "\n" << r.out;
    EXPECT_NE(row[5], "-") << node;
  }
  // classifier.0 (its ReLU folded in) moves at least its input [2, 400], its output [2, 120] and
  // its 48,120 parameters.
  const auto fc1 = profile_row(r.out, "classifier.0");
  ASSERT_GE(fc1.size(), 9u);
  EXPECT_EQ(fc1[1], "kg.fused_gemm");
  EXPECT_EQ(fc1[6] + " " + fc1[7], "192.03 KiB") << r.out;
  // A pooling node does no counted work but moves bytes.
  const auto pool = profile_row(r.out, "features.2");
  ASSERT_GE(pool.size(), 8u) << r.out;
  EXPECT_EQ(pool[4], "-");
  EXPECT_EQ(pool[5], "-");
  EXPECT_NE(pool[6], "-");

  const std::string total = r.out.substr(r.out.find("\ntotal: ") + 1);
  char expected[32];
  std::snprintf(expected, sizeof expected, "%.6g GFLOP", (kConv1 + kConv2 + kFc1 + kFc2 + kFc3) / 1e9);
  EXPECT_NE(total.find(expected), std::string::npos) << expected << "\n" << total;
  EXPECT_NE(total.find("GFLOP/s"), std::string::npos) << total;
}

TEST_F(CliProfile, ProfileWithoutFusionCountsTheSameWork) {
  const CliResult r = run({"run", "lenet5", "--batch", "2", "--runs", "1", "--profile", "--no-fusion"});
  ASSERT_EQ(r.code, 0) << r.err;
  char expected[32];
  std::snprintf(expected, sizeof expected, "%.6g GFLOP", (kConv1 + kConv2 + kFc1 + kFc2 + kFc3) / 1e9);
  EXPECT_NE(r.out.find(expected), std::string::npos) << expected << "\n" << r.out;
  // The ReLU after the first convolution is a node of its own now.
  EXPECT_FALSE(profile_row(r.out, "features.1").empty()) << r.out;
}

// ResNet-18 on the CPU runs its convolutions channels-last (oneDNN) unless told not to.
TEST_F(CliProfile, NoChannelsLastKeepsTheRecordedLayout) {
  if (!kg::ops::dnnl::available()) GTEST_SKIP() << kg::ops::dnnl::unavailable_reason();
  const CliResult nhwc = run({"run", "resnet18", "--batch", "1", "--runs", "1", "--profile"});
  ASSERT_EQ(nhwc.code, 0) << nhwc.err;
  EXPECT_NE(nhwc.out.find("nn.conv2d_nhwc"), std::string::npos) << nhwc.out;
  const CliResult nchw = run({"run", "resnet18", "--batch", "1", "--runs", "1", "--profile", "--no-channels-last"});
  ASSERT_EQ(nchw.code, 0) << nchw.err;
  EXPECT_EQ(nchw.out.find("nhwc"), std::string::npos) << nchw.out;
  EXPECT_NE(nchw.out.find("nn.fused_conv2d"), std::string::npos) << nchw.out;
}

TEST_F(CliProfile, ProfileCountsAnOnnxMatmul) {
  const std::string model = std::string(KG_SOURCE_DIR) + "/tests/fixtures/onnx/bert2.onnx";
  const CliResult r = run({"run", model, "--batch", "2", "--dim", "sequence=16", "--runs", "1", "--profile"});
  ASSERT_EQ(r.code, 0) << r.err;
  // [2, 16, 32] x [32, 32]: 2·(2·16)·32·32.
  const auto q = profile_row(r.out, "encoder.layer.0.attention.self.query.MatMul");
  ASSERT_GE(q.size(), 5u) << r.out;
  EXPECT_EQ(q[1], "kg.fused_gemm");  // the bias Add after it is its epilogue
  EXPECT_NEAR(std::stod(q[4]) * 1e9, 2.0 * 2 * 16 * 32 * 32, 65536 * 1e-3) << r.out;  // printed with 4 digits
}

TEST_F(CliProfile, ProfileErrors) {
  // Checked mode runs every kernel under the emulator: its times are not the model's.
  const CliResult checked = run({"run", "lenet5", "--profile", "--checked"});
  expect_one_line_error(checked, 2, {"--checked", "--profile"});
  EXPECT_EQ(checked.out, "");
  if (!kg::Device::cuda_available()) {
    const CliResult r = run({"run", "lenet5", "--device", "cuda", "--profile"});
    expect_one_line_error(r, 1, {"cannot load lenet5 on cuda", "CUDA is not available"});
    EXPECT_EQ(r.out, "");
  }
  expect_one_line_error(run({"run", "lenet5", "--profile", "yes"}), 2, {"yes"});
}
