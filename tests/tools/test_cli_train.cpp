// `kgraph train`, run as a program on a small synthetic IDX data set written by the test: the
// output format, the files of a run, resumption at the next epoch with the same result as an
// uninterrupted run, and every error path.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>

#include "kg/data.hpp"
#include "kg/io.hpp"
#include "support/cli_util.hpp"
#include "support/test_util.hpp"

using kg_test::CliResult;
using kg_test::expect_one_line_error;
using kg_test::read_file;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream is(text);
  std::string l;
  while (std::getline(is, l)) out.push_back(l);
  return out;
}

// Lines of `text` that start with `prefix`.
std::vector<std::string> lines_starting(const std::string& text, const std::string& prefix) {
  std::vector<std::string> out;
  for (const auto& l : lines_of(text))
    if (l.rfind(prefix, 0) == 0) out.push_back(l);
  return out;
}

bool have_gnuplot() { return std::system("command -v gnuplot >/dev/null 2>&1") == 0; }

class CliTrain : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "kg-cli-train-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    ASSERT_TRUE(fs::exists(kg_test::kgraph_binary())) << "build the kgraph target before the tests";
    seed_ = kg_test::fresh_seed();
    data_ = (fs::path(dir_) / "data").string();
    write_dataset(data_, 200, 70);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  // A learnable 10-class set: class c is a bright 6x6 square at a place of its own, with noise.
  // Training images gzipped, the rest plain.
  void write_dataset(const std::string& dir, std::int64_t n_train, std::int64_t n_test) {
    fs::create_directories(dir);
    std::mt19937_64 rng(seed_);
    for (const bool train : {true, false}) {
      const std::int64_t n = train ? n_train : n_test;
      kg::Tensor img = kg::Tensor::empty(kg::DType::U8, {n, 28, 28});
      kg::Tensor lab = kg::Tensor::empty(kg::DType::U8, {n});
      for (std::int64_t i = 0; i < n; ++i) {
        const auto c = static_cast<std::uint8_t>(rng() % 10);
        lab.data<std::uint8_t>()[i] = c;
        const std::int64_t y0 = 2 + (c / 5) * 12, x0 = 2 + (c % 5) * 5;
        for (std::int64_t y = 0; y < 28; ++y)
          for (std::int64_t x = 0; x < 28; ++x) {
            const bool on = y >= y0 && y < y0 + 6 && x >= x0 && x < x0 + 6;
            img.data<std::uint8_t>()[(i * 28 + y) * 28 + x] =
                static_cast<std::uint8_t>((on ? 200 : 0) + rng() % 40);
          }
      }
      const std::string stem = train ? "train" : "t10k";
      kg::data::write_idx((fs::path(dir) / (stem + "-images-idx3-ubyte" + (train ? ".gz" : ""))).string(),
                          img, train);
      kg::data::write_idx((fs::path(dir) / (stem + "-labels-idx1-ubyte")).string(), lab);
    }
  }

  std::string path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  // kgraph train on the synthetic data, on the CPU, with one thread (bitwise reproducible).
  CliResult train(std::vector<std::string> extra, const std::string& env = "") {
    std::vector<std::string> args{"train",     "--data", data_,          "--device", "cpu",
                                  "--threads", "1",      "--batch-size", "32"};
    args.insert(args.end(), extra.begin(), extra.end());
    return kg_test::run_kgraph(args, env, path("stderr.txt"));
  }

  std::string dir_, data_;
  std::uint64_t seed_ = 0;
};

const std::regex kEpochLine(
    R"(epoch (\d+): train loss (\d+\.\d{4}|nan), test loss (\d+\.\d{4}|nan), test accuracy (\d+\.\d\d)%, time \d+\.\d s)");
const std::regex kFinalLine(R"(final test accuracy: (\d+\.\d\d)%)");

// The epoch lines without their times.
std::vector<std::string> epoch_results(const std::string& out) {
  std::vector<std::string> r;
  for (const auto& l : lines_starting(out, "epoch ")) {
    std::smatch m;
    if (std::regex_match(l, m, kEpochLine)) r.push_back(l.substr(0, l.rfind(", time")));
  }
  return r;
}

// epochs.csv without the seconds column.
std::string without_seconds(const std::string& csv) {
  std::string out;
  for (const auto& l : lines_of(csv)) out += l.substr(0, l.rfind(',')) + "\n";
  return out;
}

}  // namespace

TEST_F(CliTrain, TinyRunWritesLogsPlotAndCheckpoints) {
  SCOPED_TRACE("data seed " + std::to_string(seed_));
  const std::string out = path("run");
  const CliResult r =
      train({"--epochs", "2", "--limit-train", "128", "--limit-test", "50", "--seed", "3", "--out", out});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_EQ(r.err, "");
  const auto lines = lines_of(r.out);
  ASSERT_FALSE(lines.empty());
  std::smatch fm;
  ASSERT_TRUE(std::regex_match(lines.back(), fm, kFinalLine)) << "last line: " << lines.back();
  EXPECT_NE(r.out.find("training lenet5-tanh on cpu: 128 training and 50 test images from " + data_),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("batch 32 (4 steps per epoch), adamw lr 0.002 weight decay 0.01, seed 3"),
            std::string::npos)
      << r.out;
  // Not a terminal: progress lines, then one line per epoch.
  EXPECT_FALSE(lines_starting(r.out, "epoch 1/2  batch 4/4  ").empty()) << r.out;
  const auto epochs = lines_starting(r.out, "epoch ");
  std::vector<std::string> summaries;
  for (const auto& l : epochs)
    if (l.find(": train loss") != std::string::npos) summaries.push_back(l);
  ASSERT_EQ(summaries.size(), 2u) << r.out;
  std::smatch m;
  for (int e = 1; e <= 2; ++e) {
    ASSERT_TRUE(std::regex_match(summaries[static_cast<std::size_t>(e - 1)], m, kEpochLine))
        << summaries[static_cast<std::size_t>(e - 1)];
    EXPECT_EQ(m[1].str(), std::to_string(e));
  }
  EXPECT_EQ(m[4].str(), fm[1].str()) << "the final accuracy is the last epoch's";
  const double acc = std::stod(fm[1].str());
  EXPECT_GE(acc, 0.0);
  EXPECT_LE(acc, 100.0);
  // 50 test images: the accuracy is a multiple of 2%.
  EXPECT_NEAR(std::fmod(acc + 1e-9, 2.0), 0.0, 1e-6) << acc;

  // Files: a checkpoint per epoch with the run's metadata, the logs, the plot.
  for (int e = 1; e <= 2; ++e) {
    const fs::path ck = fs::path(out) / ("checkpoint-epoch" + std::to_string(e) + ".safetensors");
    ASSERT_TRUE(fs::exists(ck)) << ck;
    std::map<std::string, std::string> meta;
    const auto tensors = kg::read_safetensors(ck.string(), &meta);
    EXPECT_EQ(meta["epoch"], std::to_string(e));
    EXPECT_EQ(meta["step"], std::to_string(4 * e));
    EXPECT_EQ(meta["seed"], "3");
    EXPECT_EQ(meta["model"], "lenet5-tanh");
    EXPECT_EQ(meta["optimizer"], "adamw");
    EXPECT_EQ(std::stod(meta["lr"]), 0.002);
    EXPECT_EQ(meta["batch_size"], "32");
    EXPECT_EQ(meta["limit_train"], "128");
    ASSERT_TRUE(tensors.count("features.0.weight"));
    EXPECT_EQ(tensors.at("features.0.weight").shape(), (std::vector<std::int64_t>{6, 1, 5, 5}));
    EXPECT_TRUE(tensors.count("classifier.4.bias"));
    EXPECT_TRUE(tensors.count("optimizer/step"));
  }
  const auto log = lines_of(read_file(fs::path(out) / "log.csv"));
  ASSERT_EQ(log.size(), 1u + 8u);
  EXPECT_EQ(log[0], "epoch,step,loss,test_accuracy");
  EXPECT_EQ(log[1].rfind("1,1,", 0), 0u) << log[1];
  EXPECT_EQ(log[1].back(), ',') << "no accuracy before the epoch ends: " << log[1];
  EXPECT_EQ(log[8].rfind("2,8,", 0), 0u) << log[8];
  EXPECT_NE(log[8].back(), ',') << "the epoch's last step carries the test accuracy: " << log[8];
  const auto ep = lines_of(read_file(fs::path(out) / "epochs.csv"));
  ASSERT_EQ(ep.size(), 3u);
  EXPECT_EQ(ep[0], "epoch,step,train_loss,test_loss,test_accuracy,seconds");
  if (have_gnuplot()) {
    ASSERT_TRUE(fs::exists(fs::path(out) / "plot.png"));
    const std::string png = read_file(fs::path(out) / "plot.png");
    EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
    EXPECT_NE(r.out.find("plot: " + out + "/plot.png"), std::string::npos);
  } else {
    EXPECT_NE(r.out.find("gnuplot not found"), std::string::npos) << r.out;
  }
}

TEST_F(CliTrain, ResumeContinuesAtTheNextEpochAsAnUninterruptedRun) {
  SCOPED_TRACE("data seed " + std::to_string(seed_));
  const std::vector<std::string> common{"--limit-train", "96", "--limit-test", "40", "--seed", "11"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = common;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const std::string whole = path("whole"), part = path("part");
  const CliResult full = train(with({"--epochs", "3", "--out", whole}));
  ASSERT_EQ(full.code, 0) << full.err;
  const CliResult first = train(with({"--epochs", "1", "--out", part}));
  ASSERT_EQ(first.code, 0) << first.err;
  ASSERT_TRUE(fs::exists(fs::path(part) / "checkpoint-epoch1.safetensors"));
  EXPECT_FALSE(fs::exists(fs::path(part) / "checkpoint-epoch2.safetensors"));

  // The settings come from the checkpoint; the output folder defaults to the checkpoint's.
  const CliResult rest = kg_test::run_kgraph(
      {"train", "--data", data_, "--device", "cpu", "--threads", "1", "--resume",
       part + "/checkpoint-epoch1.safetensors", "--epochs", "3", "--limit-train", "96", "--limit-test", "40"},
      "", path("stderr.txt"));
  ASSERT_EQ(rest.code, 0) << rest.err;
  EXPECT_NE(rest.out.find("resuming from " + part + "/checkpoint-epoch1.safetensors after epoch 1"),
            std::string::npos)
      << rest.out;
  const auto resumed = epoch_results(rest.out);
  ASSERT_EQ(resumed.size(), 2u) << rest.out;
  EXPECT_EQ(resumed[0].rfind("epoch 2:", 0), 0u);
  EXPECT_EQ(resumed[1].rfind("epoch 3:", 0), 0u);
  const auto uninterrupted = epoch_results(full.out);
  ASSERT_EQ(uninterrupted.size(), 3u);
  EXPECT_EQ(resumed[0], uninterrupted[1]);
  EXPECT_EQ(resumed[1], uninterrupted[2]);
  EXPECT_EQ(lines_of(rest.out).back(), lines_of(full.out).back());
  EXPECT_TRUE(fs::exists(fs::path(part) / "checkpoint-epoch3.safetensors"));
  // The logs of the resumed folder are those of the uninterrupted run.
  EXPECT_EQ(read_file(fs::path(part) / "log.csv"), read_file(fs::path(whole) / "log.csv"));
  EXPECT_EQ(without_seconds(read_file(fs::path(part) / "epochs.csv")),
            without_seconds(read_file(fs::path(whole) / "epochs.csv")));
  // So are the parameters.
  const auto a = kg::read_safetensors(part + "/checkpoint-epoch3.safetensors");
  const auto b = kg::read_safetensors(whole + "/checkpoint-epoch3.safetensors");
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    ASSERT_EQ(t.nbytes(), b.at(name).nbytes()) << name;
    EXPECT_EQ(std::memcmp(t.raw(), b.at(name).raw(), t.nbytes()), 0) << name;
  }

  // A checkpoint already at --epochs: evaluated, nothing trained.
  const CliResult done = train(with({"--resume", whole + "/checkpoint-epoch3.safetensors", "--epochs", "3"}));
  ASSERT_EQ(done.code, 0) << done.err;
  EXPECT_TRUE(epoch_results(done.out).empty()) << done.out;
  EXPECT_EQ(lines_of(done.out).back(), lines_of(full.out).back());
}

TEST_F(CliTrain, ErrorPaths) {
  // Bad flags: usage errors (exit 2).
  expect_one_line_error(train({"--epochs", "0"}), 2, {"--epochs"});
  expect_one_line_error(train({"--batch-size", "two"}), 2, {"--batch-size", "two"});
  expect_one_line_error(train({"--optimizer", "adam"}), 2, {"--optimizer", "adam"});
  expect_one_line_error(train({"--lr", "-1"}), 2, {"--lr"});
  expect_one_line_error(train({"--limit-train", "0"}), 2, {"--limit-train"});
  expect_one_line_error(train({"--bogus"}), 2, {"--bogus"});
  // Flags that contradict each other, an unknown model or device.
  expect_one_line_error(train({"--momentum", "0.9"}), 1, {"--momentum", "sgd"});
  expect_one_line_error(train({"vgg16"}), 1, {"unknown model 'vgg16'", "lenet5-tanh"});
  expect_one_line_error(train({"--device", "tpu"}), 1, {"unknown device 'tpu'"});
  expect_one_line_error(train({"--batch-size", "256", "--limit-train", "100"}), 1,
                        {"100 images", "fewer than one batch of 256"});

  // Missing data: a folder without the files, a folder that does not exist, no package.
  fs::create_directories(path("empty"));
  expect_one_line_error(kg_test::run_kgraph({"train", "--data", path("empty")}, "", path("stderr.txt")), 1,
                        {path("empty"), "train-images-idx3-ubyte"});
  expect_one_line_error(kg_test::run_kgraph({"train", "--data", path("nope")}, "", path("stderr.txt")), 1,
                        {path("nope"), "does not exist"});
  expect_one_line_error(
      kg_test::run_kgraph({"train"}, "KG_FASHION_MNIST_DIR=" + kg_test::shell_quote(path("nope")),
                          path("stderr.txt")),
      1, {path("nope"), "KG_FASHION_MNIST_DIR"});
  expect_one_line_error(
      kg_test::run_kgraph({"train"},
                          "KG_FASHION_MNIST_DIR= KG_DPKG_INFO_DIR=" + kg_test::shell_quote(path("empty")),
                          path("stderr.txt")),
      1, {"Fashion-MNIST not found", "dataset-fashion-mnist", "--data DIR"});

  // Broken data: a truncated gzip file, counts that disagree, labels the model cannot have.
  const std::string bad = path("bad");
  write_dataset(bad, 40, 20);
  const std::string gz = bad + "/train-images-idx3-ubyte.gz";
  const std::string whole = read_file(gz);
  { std::ofstream(gz, std::ios::binary | std::ios::trunc) << whole.substr(0, whole.size() / 2); }
  expect_one_line_error(kg_test::run_kgraph({"train", "--data", bad}, "", path("stderr.txt")), 1,
                        {gz, "truncated gzip stream"});
  write_dataset(bad, 40, 20);
  kg::data::write_idx(bad + "/t10k-labels-idx1-ubyte", kg::Tensor::zeros(kg::DType::U8, {19}));
  expect_one_line_error(kg_test::run_kgraph({"train", "--data", bad}, "", path("stderr.txt")), 1,
                        {"t10k-labels-idx1-ubyte", "20 images but 19 labels"});
  kg::Tensor labels = kg::Tensor::zeros(kg::DType::U8, {20});
  labels.data<std::uint8_t>()[7] = 12;
  kg::data::write_idx(bad + "/t10k-labels-idx1-ubyte", labels);
  expect_one_line_error(kg_test::run_kgraph({"train", "--data", bad, "--batch-size", "8", "--device", "cpu"},
                                            "", path("stderr.txt")),
                        1, {"labels", "go up to 12", "10 classes"});

  // Checkpoints: missing, of another model, of other settings.
  expect_one_line_error(train({"--resume", path("none.safetensors")}), 1,
                        {path("none.safetensors"), "does not exist"});
  const CliResult r =
      train({"--epochs", "1", "--limit-train", "32", "--limit-test", "10", "--out", path("run")});
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string ck = path("run") + "/checkpoint-epoch1.safetensors";
  expect_one_line_error(train({"lenet5", "--resume", ck, "--limit-train", "32"}), 1,
                        {ck, "of model 'lenet5-tanh', not 'lenet5'"});
  expect_one_line_error(train({"--resume", ck, "--limit-train", "32", "--seed", "5"}), 1,
                        {"--seed 5", ck, "trained with 0"});
  expect_one_line_error(train({"--resume", ck, "--limit-train", "64"}), 1, {"--limit-train 64", ck, "32"});
  // A weights file that is not a checkpoint of this command.
  kg::write_safetensors(path("w.safetensors"), {{"x", kg::Tensor::zeros(kg::DType::F32, {2})}});
  expect_one_line_error(train({"--resume", path("w.safetensors")}), 1,
                        {path("w.safetensors"), "no 'epoch' in its metadata"});
}

// ---- data-parallel training (--nproc, mpirun) ----

bool have_mpirun() { return std::system("command -v mpirun >/dev/null 2>&1") == 0; }

// Every tensor of two checkpoints (parameters and optimiser state) within what float summation
// order leaves after two epochs of training: 1e-3 of each element, plus 1e-3 of the tensor's
// largest magnitude (a small element that is a difference of larger ones, a bias's momentum say,
// carries their rounding, and the runs' small differences grow step by step). A wrong gradient
// average or a missed reduction moves values by far more.
void expect_close_checkpoints(const fs::path& a, const fs::path& b) {
  const auto ta = kg::read_safetensors(a.string()), tb = kg::read_safetensors(b.string());
  ASSERT_EQ(ta.size(), tb.size()) << a << " " << b;
  for (const auto& [name, t] : ta) {
    ASSERT_TRUE(tb.count(name)) << name;
    double scale = 0;
    for (std::int64_t i = 0; i < t.numel(); ++i) scale = std::max(scale, std::abs(t.item(i)));
    EXPECT_TRUE(kg_test::all_close(tb.at(name), t, 1e-3, 1e-6 + 1e-3 * scale))
        << name << ": " << a << " against " << b;
  }
}

TEST_F(CliTrain, TwoMpiRanksMatchOneProcessAndTheirCheckpointsResumeAtEitherCount) {
  if (!have_mpirun()) GTEST_SKIP() << "no mpirun (scripts/install-deps installs openmpi-bin)";
  SCOPED_TRACE("data seed " + std::to_string(seed_));
  const std::vector<std::string> common{"lenet5", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9",
                                        "--limit-test", "40", "--seed", "5"};
  auto run = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = common;
    args.insert(args.end(), extra.begin(), extra.end());
    return train(args);
  };
  // 200 images, batch 32: 6 steps per epoch, 16 images per rank.
  const CliResult two = run({"--nproc", "2", "--epochs", "1", "--out", path("two")});
  ASSERT_EQ(two.code, 0) << two.out << two.err;
  EXPECT_EQ(two.err, "");
  EXPECT_NE(two.out.find("data parallel: 2 ranks over mpi, 16 images per rank of each batch"), std::string::npos)
      << two.out;
  // One job, one set of lines: the epoch and the final line once, progress lines of the global batch.
  EXPECT_EQ(epoch_results(two.out).size(), 1u) << two.out;
  EXPECT_EQ(lines_starting(two.out, "final test accuracy").size(), 1u) << two.out;
  EXPECT_EQ(lines_starting(two.out, "epoch 1/1  batch 6/6  ").size(), 1u) << two.out;
  std::map<std::string, std::string> meta;
  kg::read_safetensors(path("two") + "/checkpoint-epoch1.safetensors", &meta);
  EXPECT_EQ(meta["batch_size"], "32");
  EXPECT_EQ(meta["ranks"], "2");

  const CliResult one = run({"--epochs", "1", "--out", path("one")});
  ASSERT_EQ(one.code, 0) << one.out << one.err;
  expect_close_checkpoints(path("one") + "/checkpoint-epoch1.safetensors",
                           path("two") + "/checkpoint-epoch1.safetensors");
  // The same test results (rank 0 evaluates the same parameters).
  EXPECT_EQ(lines_starting(two.out, "final test accuracy"), lines_starting(one.out, "final test accuracy"));

  // What the comparison tells apart: a process training on one rank's share alone.
  const CliResult alone = train({"lenet5", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9",
                                 "--limit-test", "40", "--seed", "5", "--epochs", "1", "--batch-size", "16",
                                 "--limit-train", "96", "--out", path("alone")});
  ASSERT_EQ(alone.code, 0) << alone.err;
  {
    const auto a = kg::read_safetensors(path("alone") + "/checkpoint-epoch1.safetensors");
    const auto b = kg::read_safetensors(path("two") + "/checkpoint-epoch1.safetensors");
    EXPECT_FALSE(kg_test::all_close(a.at("features.0.weight"), b.at("features.0.weight"), 1e-3, 1e-4));
  }

  // The two-rank checkpoint resumes in one process, and the one-process checkpoint in two ranks;
  // both end where the uninterrupted one-process run's second epoch ends.
  const CliResult one_more = run({"--epochs", "2", "--resume", path("one") + "/checkpoint-epoch1.safetensors",
                                  "--out", path("one2")});
  ASSERT_EQ(one_more.code, 0) << one_more.err;
  const CliResult from_two = run({"--epochs", "2", "--resume", path("two") + "/checkpoint-epoch1.safetensors",
                                  "--out", path("from_two")});
  ASSERT_EQ(from_two.code, 0) << from_two.err;
  const CliResult into_two = run({"--nproc", "2", "--epochs", "2", "--resume",
                                  path("one") + "/checkpoint-epoch1.safetensors", "--out", path("into_two")});
  ASSERT_EQ(into_two.code, 0) << into_two.out << into_two.err;
  for (const char* d : {"from_two", "into_two"})
    expect_close_checkpoints(path("one2") + "/checkpoint-epoch2.safetensors",
                             path(d) + "/checkpoint-epoch2.safetensors");
}

TEST_F(CliTrain, DataParallelErrorPaths) {
  // A batch that does not split, before any rank starts.
  expect_one_line_error(train({"--nproc", "3", "--epochs", "1", "--out", path("e1")}), 1,
                        {"--batch-size 32 does not split over --nproc 3 ranks", "multiple of 3"});
  // No mpirun for the cpu's ranks.
  expect_one_line_error(train({"--nproc", "2", "--epochs", "1", "--out", path("e2")}, "PATH=/nonexistent"), 1,
                        {"--nproc 2 on the cpu", "mpirun", "openmpi-bin"});
  // --nproc inside a job.
  expect_one_line_error(train({"--nproc", "2", "--epochs", "1", "--out", path("e3")}, "KG_WORLD_SIZE=2"), 1,
                        {"--nproc starts the ranks itself", "leave --nproc out"});
  // GPU ranks take cuda:r.
  expect_one_line_error(train({"--nproc", "2", "--device", "cuda:1", "--epochs", "1", "--out", path("e4")}), 1,
                        {"--nproc 2 puts rank r on cuda:r", "cuda:1"});
  // A rank whose peer never comes: the rendezvous gives up, naming it.
  const std::string rv = path("rendezvous");
  fs::create_directories(rv);
  expect_one_line_error(
      train({"--epochs", "1", "--out", path("e5")},
            "KG_WORLD_SIZE=2 KG_RANK=0 KG_RENDEZVOUS=" + rv + " KG_RENDEZVOUS_TIMEOUT=1"),
      1, {"rank 0 of 2", "waited 1 s", "rank(s) 1"});
  // Two ranks of a rendezvous on the cpu: their gradients need MPI. (A group of one needs nothing.)
  const CliResult solo =
      train({"--epochs", "1", "--limit-train", "64", "--out", path("solo")},
            "KG_WORLD_SIZE=1 KG_RANK=0 KG_RENDEZVOUS=" + rv);
  EXPECT_EQ(solo.code, 0) << solo.err;
  EXPECT_NE(solo.out.find("data parallel: 1 rank over rendezvous"), std::string::npos) << solo.out;
}
