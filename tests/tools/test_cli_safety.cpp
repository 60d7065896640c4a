// kgraph's outputs, numbers, messages and child processes against hostile input: an --output that
// is a FIFO (standing in for a device node) or a link, links planted in train's --out folder,
// seeds and counts that wrapped, names holding terminal escape sequences, random inputs made before
// the memory check, input files that are folders, and a SIGTERM to `train --nproc`.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kg/data.hpp"
#include "kg/io.hpp"
#include "support/cli_util.hpp"
#include "support/test_util.hpp"

using kg_test::CliResult;
using kg_test::expect_one_line_error;
namespace fs = std::filesystem;

namespace {

class CliSafety : public kg_test::CliTest {
 protected:
  CliResult run(const std::vector<std::string>& args, const std::string& env = "") {
    return kg_test::run_kgraph(args, "KG_CACHE_DIR=" + kg_test::shell_quote(path("cache")) + " " + env,
                               path("stderr.txt"));
  }
  static void write_dataset(const std::string& dir, std::int64_t n_train, std::int64_t n_test) {
    kg_test::write_random_idx_dataset(dir, n_train, n_test);
  }
};

std::string read_text(const std::string& p) { return kg_test::read_file(p); }

}  // namespace

// The finding: --output onto a device node replaced it with a regular file (as root, --output
// /dev/null would replace the system's), and a link planted at '<out>.tmp.<pid>' was followed. A
// FIFO stands in for the device: no test touches /dev.
TEST_F(CliSafety, OutputIsNeverWrittenThroughSpecialFilesOrLinks) {
  const std::string fifo = path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_one_line_error(run({"run", "lenet5", "--runs", "1", "--output", fifo}), 1, {fifo, "a FIFO", "not replaced"});
  struct stat st {};
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  const std::string victim = path("victim"), link = path("link.safetensors");
  { std::ofstream(victim) << "keep"; }
  fs::create_symlink(victim, link);
  expect_one_line_error(run({"run", "lenet5", "--runs", "1", "--output", link}), 1, {link, "symbolic link"});
  EXPECT_EQ(read_text(victim), "keep");
  expect_one_line_error(run({"inspect", "lenet5", "--dot", link}), 1, {link, "symbolic link"});
  expect_one_line_error(run({"inspect", "lenet5", "--render", path("g.svg"), "--dot", fifo}), 1, {fifo, "a FIFO"});
  EXPECT_EQ(read_text(victim), "keep");
  // A plain output still works.
  const CliResult ok = run({"run", "lenet5", "--runs", "1", "--output", path("out.safetensors")});
  ASSERT_EQ(ok.code, 0) << ok.err;
  EXPECT_EQ(kg::read_safetensors(path("out.safetensors")).size(), 1u);
}

// The finding: log.csv and gnuplot.log links planted in `train --out` were written through.
TEST_F(CliSafety, TrainWritesThroughNoPlantedLink) {
  const std::string data = path("data"), out = path("run");
  write_dataset(data, 32, 10);
  fs::create_directories(out);
  const std::string victim = path("victim");
  { std::ofstream(victim) << "keep"; }
  fs::create_symlink(victim, fs::path(out) / "gnuplot.log");
  fs::create_symlink(victim, fs::path(out) / "log.csv");
  const std::vector<std::string> args{"train", "--data", data, "--device", "cpu", "--threads", "1", "--batch-size",
                                      "32", "--limit-train", "32", "--limit-test", "10", "--epochs", "1", "--out", out};
  const CliResult r = run(args, "timeout 300");
  expect_one_line_error(r, 1, {"log.csv", "symbolic link"});
  EXPECT_EQ(read_text(victim), "keep");
  // Without the log link, the plot's log link is refused too (the plot is skipped, training ends).
  fs::remove(fs::path(out) / "log.csv");
  const CliResult r2 = run(args, "timeout 300");
  EXPECT_EQ(r2.code, 0) << r2.err;
  EXPECT_EQ(read_text(victim), "keep");
}

// The finding: `--seed -1` and `--seed 2^64` both became 2^64-1, and numbers past an int wrapped.
TEST_F(CliSafety, SeedsAndCountsAreParsedStrictly) {
  expect_one_line_error(run({"run", "lenet5", "--seed", "-1"}), 2, {"--seed", "-1"});
  expect_one_line_error(run({"run", "lenet5", "--seed", "18446744073709551616"}), 2,
                        {"--seed", "18446744073709551616"});
  expect_one_line_error(run({"run", "lenet5", "--seed", "0x10"}), 2, {"--seed"});
  expect_one_line_error(run({"train", "--seed", "-1"}), 2, {"--seed"});
  expect_one_line_error(run({"run", "lenet5", "--runs", "4294967297"}), 2, {"--runs", "4294967297"});
  expect_one_line_error(run({"train", "--epochs", "4294967297"}), 2, {"--epochs"});
  expect_one_line_error(run({"run", "lenet5", "--batch", "99999999999999999999"}), 2, {"--batch"});
  // --nproc 1000000 made mpirun spin: bounded.
  expect_one_line_error(run({"train", "--nproc", "1000000"}), 2, {"--nproc", "1000000"});
  // On the cpu at most four ranks per core (checked before mpirun is looked for or started).
  if (const unsigned cores = std::thread::hardware_concurrency(); cores > 0 && 4 * cores < 1024)
    expect_one_line_error(run({"train", "--device", "cpu", "--nproc", "1024"}), 1,
                          {"--nproc 1024", "four ranks per core"});
  const CliResult ok = run({"run", "lenet5", "--runs", "1", "--seed", "18446744073709551615"});
  EXPECT_EQ(ok.code, 0) << ok.err;
  EXPECT_NE(ok.out.find("seed 18446744073709551615"), std::string::npos) << ok.out;
}

// The finding: tensor and node names from a file reached the terminal raw, escape sequences and all.
TEST_F(CliSafety, ControlCharactersInNamesAreEscaped) {
  const std::string in = path("in.safetensors");
  kg::write_safetensors(in, {{"evil\x1b]0;pwned\x07\x1b[2J", kg::Tensor::zeros(kg::DType::F32, {1, 1, 28, 28})},
                             {"other", kg::Tensor::zeros(kg::DType::F32, {1})}});
  const CliResult r = run({"run", "lenet5", "--input", in});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(r.err.find('\x1b'), std::string::npos) << "a raw escape reached the terminal";
  EXPECT_EQ(r.err.find('\x07'), std::string::npos);
  EXPECT_NE(r.err.find("evil\\x1b]0;pwned\\x07\\x1b[2J"), std::string::npos) << r.err;
}

// The finding: `kgraph run` drew its random inputs before the memory check (OOM-killed where
// `inspect` refused cleanly); an input or weights file that is a folder gave libstdc++'s text or
// "does not exist". RLIMIT_AS keeps the test safe whatever happens.
TEST_F(CliSafety, HugeRandomInputsAreRefusedBeforeAllocation) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "an AddressSanitizer build reserves more address space than the limit this test sets";
#endif
  const CliResult r =
      run({"run", "lenet5", "--batch", "4000000"}, "sh -c 'ulimit -v 8388608 && exec \"$0\" \"$@\"'");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(r.err.rfind("kgraph: error: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("available"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("bad_alloc"), std::string::npos) << r.err;
  fs::create_directories(path("folder"));
  expect_one_line_error(run({"run", "lenet5", "--input", path("folder")}), 1, {path("folder"), "is a folder"});
  expect_one_line_error(run({"run", "lenet5", "--weights", path("folder")}), 1, {path("folder"), "is a folder"});
}

// The finding: SIGTERM to `kgraph train --nproc 2` ended kgraph and left mpirun and its ranks
// training. The ranks carry a marker in their environment, so that any left behind are found.
TEST_F(CliSafety, SigtermReachesTheRanksOfTrainNproc) {
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun";
  const std::string data = path("data");
  write_dataset(data, 4096, 10);
  const std::string marker = "KG_TEST_MARKER=" + std::to_string(kg_test::fresh_seed());
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::putenv(const_cast<char*>(marker.c_str()));
    ::setenv("KG_NUM_THREADS", "1", 1);
    ::setenv("KG_CACHE_DIR", path("cache").c_str(), 1);
    const int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, 1);
    ::dup2(null, 2);
    const std::string bin = kg_test::kgraph_binary();
    const std::vector<std::string> args{bin,     "train",     "--data", data,        "--device", "cpu",
                                        "--nproc", "2",       "--batch-size", "32", "--epochs", "1000",
                                        "--out",   path("out")};
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(bin.c_str(), argv.data());
    ::_exit(127);
  }
  // The processes whose environment holds the marker, kgraph itself left out.
  auto marked_pids = [&] {
    std::vector<pid_t> found;
    for (const auto& e : fs::directory_iterator("/proc")) {
      const std::string name = e.path().filename().string();
      if (name.find_first_not_of("0123456789") != std::string::npos || name == std::to_string(pid)) continue;
      std::ifstream env(e.path() / "environ", std::ios::binary);
      const std::string text((std::istreambuf_iterator<char>(env)), std::istreambuf_iterator<char>());
      if (text.find(marker) != std::string::npos) found.push_back(static_cast<pid_t>(std::stol(name)));
    }
    return found;
  };
  auto marked = [&] { return static_cast<int>(marked_pids().size()); };
  // Wait until the ranks run (mpirun and at least two more).
  const auto t0 = std::chrono::steady_clock::now();
  while (marked() < 3 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ASSERT_GE(marked(), 3) << "the ranks did not start";
  std::this_thread::sleep_for(std::chrono::seconds(1));
  ::kill(pid, SIGTERM);
  int status = 0;
  const auto t1 = std::chrono::steady_clock::now();
  pid_t w = 0;
  while ((w = ::waitpid(pid, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() - t1 < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  if (w == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    ADD_FAILURE() << "kgraph did not end within 60 s of SIGTERM";
  }
  // Whatever is left is given a few seconds to go.
  const auto t2 = std::chrono::steady_clock::now();
  while (marked() > 0 && std::chrono::steady_clock::now() - t2 < std::chrono::seconds(20))
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const int left = marked();
  EXPECT_EQ(left, 0) << "processes of the job still run after kgraph ended";
  for (pid_t p : marked_pids()) ::kill(p, SIGKILL);  // this test's own job, found by its marker
}
