// `kgraph train` against hostile input: an output folder whose name is shell syntax, crafted
// checkpoint metadata, and thread counts past the pool's bound (flag and KG_NUM_THREADS).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kg/data.hpp"
#include "kg/io.hpp"
#include "support/cli_util.hpp"
#include "support/test_util.hpp"
#include "util/thread_pool.hpp"

using kg_test::CliResult;
using kg_test::expect_one_line_error;
namespace fs = std::filesystem;

namespace {

class CliHardening : public kg_test::CliTest {
 protected:
  void SetUp() override {
    kg_test::CliTest::SetUp();
    data_ = path("data");
    write_dataset(data_, 40, 10);
  }

  static void write_dataset(const std::string& dir, std::int64_t n_train, std::int64_t n_test) {
    kg_test::write_random_idx_dataset(dir, n_train, n_test);
  }

  // kgraph train on the tiny data on the CPU, one batch per epoch, under `timeout` so that a run
  // that would never end fails the test instead of hanging it.
  CliResult train(std::vector<std::string> extra, const std::string& env = "",
                  const std::string& threads = "1") {
    std::vector<std::string> args{"train",     "--data",  data_,          "--device", "cpu",
                                  "--threads", threads,   "--batch-size", "32",       "--limit-train",
                                  "32",        "--limit-test", "10"};
    args.insert(args.end(), extra.begin(), extra.end());
    return kg_test::run_kgraph(args, env + " timeout 300", path("stderr.txt"));
  }

  std::string data_;
};

// The files of a folder, by name.
std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

// The output folder's name reached a shell (`cd '<dir>' && gnuplot ...`): a quote in it ran
// commands. gnuplot is now started without a shell; whether a plot is drawn does not matter here.
TEST_F(CliHardening, OutputFolderNameIsNotShellSyntax) {
  const std::string marker = path("pwned");
  const std::string out = path("run'; touch '" + marker + "'; echo '");
  const CliResult r = train({"--epochs", "1", "--out", out});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_FALSE(fs::exists(marker)) << "a shell ran the folder name: " << r.out;
  EXPECT_TRUE(fs::exists(fs::path(out) / "checkpoint-epoch1.safetensors"));
  // The same through a resumed checkpoint's folder (the default --out of --resume).
  const CliResult again =
      train({"--epochs", "2", "--resume", (fs::path(out) / "checkpoint-epoch1.safetensors").string()});
  ASSERT_EQ(again.code, 0) << again.out << again.err;
  EXPECT_FALSE(fs::exists(marker)) << "a shell ran the folder name: " << again.out;
  EXPECT_TRUE(fs::exists(fs::path(out) / "checkpoint-epoch2.safetensors"));
  // A drawn plot says where it is; gnuplot.log lies in that folder, not in the working one.
  if (fs::exists(fs::path(out) / "plot.png")) {
    EXPECT_TRUE(fs::exists(fs::path(out) / "gnuplot.log"));
  }
}

// A checkpoint whose metadata numbers are out of range or not numbers: epoch 2^63-1 overflowed
// the epoch loop (training forever, a checkpoint per epoch) and a negative epoch was taken.
TEST_F(CliHardening, CraftedCheckpointMetadataIsRejected) {
  const CliResult r = train({"--epochs", "1", "--out", path("run")});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const std::string good = path("run") + "/checkpoint-epoch1.safetensors";
  std::map<std::string, std::string> meta;
  const std::map<std::string, kg::Tensor> tensors = kg::read_safetensors(good, &meta);
  ASSERT_EQ(meta["epoch"], "1");

  struct Case {
    std::string key, value, expected;
  };
  const std::vector<Case> cases{
      {"epoch", "9223372036854775807", "a whole number from 0 to 1000000"},
      {"epoch", "-1", "a whole number from 0 to 1000000"},
      {"epoch", "12abc", "a whole number from 0 to 1000000"},
      {"epoch", "", "a whole number from 0 to 1000000"},
      {"epoch", " 1", "a whole number"},
      {"step", "-5", "a whole number from 0"},
      {"step", "9223372036854775807", "a whole number from 0"},
      {"seed", "-1", "a whole number from 0"},
      {"batch_size", "0", "a whole number from 1"},
      {"limit_train", "-32", "a whole number from 1"},
      {"lr", "nan", "a finite number >= 0"},
      {"lr", "-0.5", "a finite number >= 0"},
      {"weight_decay", "1e999", "a finite number >= 0"},
      {"momentum", "2", "a number from 0 to 1"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.key + " = '" + c.value + "'");
    const std::string folder = path("crafted");
    fs::remove_all(folder);
    fs::create_directories(folder);
    std::map<std::string, std::string> m = meta;
    m[c.key] = c.value;
    const std::string ck = folder + "/checkpoint-epoch1.safetensors";
    kg::write_safetensors(ck, tensors, m);
    const CliResult bad = train({"--epochs", "3", "--resume", ck});
    expect_one_line_error(bad, 1, {ck, "'" + c.key + "'", "'" + c.value + "'", c.expected});
    // Nothing trained: no epoch line, no log and no checkpoint beyond the crafted one.
    EXPECT_EQ(bad.out.find("train loss"), std::string::npos) << bad.out;
    EXPECT_EQ(files_in(folder), std::vector<std::string>{"checkpoint-epoch1.safetensors"});
  }
}

// --threads 1000000 started a million threads until the process limit was spent.
TEST_F(CliHardening, ThreadCountsAreBounded) {
  const std::string max = std::to_string(kg::util::ThreadPool::kMaxThreads);
  const std::string over = std::to_string(kg::util::ThreadPool::kMaxThreads + 1);
  for (const std::string& n : {over, std::string("1000000"), std::string("-1"), std::string("2x")}) {
    SCOPED_TRACE("--threads " + n);
    expect_one_line_error(train({"--epochs", "1", "--out", path("run")}, "", n), 2,
                          {"--threads", "from 0 (one per core) to " + max, "'" + n + "'"});
  }
  EXPECT_FALSE(fs::exists(path("run")));
  // KG_NUM_THREADS sizes the pool of --threads 0: a bad value is an error naming it, not atoi's 0.
  for (const std::string& v : {std::string("abc"), std::string("-3"), std::string("4x"), over}) {
    SCOPED_TRACE("KG_NUM_THREADS=" + v);
    const CliResult r = train({"--epochs", "1", "--out", path("env-run")}, "KG_NUM_THREADS=" + v, "0");
    expect_one_line_error(r, 1, {"KG_NUM_THREADS is '" + v + "'", "from 0 to " + max});
  }
  const CliResult ok = train({"--epochs", "1", "--out", path("env-ok")}, "KG_NUM_THREADS=2", "0");
  EXPECT_EQ(ok.code, 0) << ok.out << ok.err;
}
