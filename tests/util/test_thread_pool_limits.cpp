// The thread pool's bounds: the thread count asked for, KG_NUM_THREADS, and a thread that cannot
// be started (a kg::Error with the started workers joined, not a hang or std::terminate).
#include <gtest/gtest.h>
#include <grp.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kg/error.hpp"
#include "kg/kg.hpp"
#include "support/test_util.hpp"
#include "util/thread_pool.hpp"

using kg::util::ThreadPool;
using kg_test::expect_error;

namespace {

// Sets KG_NUM_THREADS for the scope, restoring the previous value after.
class EnvThreads {
 public:
  explicit EnvThreads(const std::optional<std::string>& value) {
    if (const char* old = std::getenv("KG_NUM_THREADS")) old_ = old;
    if (value)
      ::setenv("KG_NUM_THREADS", value->c_str(), 1);
    else
      ::unsetenv("KG_NUM_THREADS");
  }
  ~EnvThreads() {
    if (old_)
      ::setenv("KG_NUM_THREADS", old_->c_str(), 1);
    else
      ::unsetenv("KG_NUM_THREADS");
  }
  EnvThreads(const EnvThreads&) = delete;
  EnvThreads& operator=(const EnvThreads&) = delete;

 private:
  std::optional<std::string> old_;
};

int hardware_threads() {
  return std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, ThreadPool::kMaxThreads);
}

}  // namespace

TEST(ThreadPoolLimits, CountOutsideTheBoundIsAnError) {
  const std::string max = std::to_string(ThreadPool::kMaxThreads);
  for (const int n : {ThreadPool::kMaxThreads + 1, 1'000'000, -1}) {
    SCOPED_TRACE(n);
    expect_error([&] { ThreadPool pool(n); },
                 {"thread pool of " + std::to_string(n) + " threads", "0 (one per core) to " + max});
  }
  ThreadPool three(3);
  EXPECT_EQ(three.size(), 3);
}

// LoadOptions::threads sizes the model's own pool: past the bound it is an error at load.
TEST(ThreadPoolLimits, LoadOptionsThreadsAreBounded) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 4}, "x");
  kg::Model model(g, {{"y", kg::relu(x, "act")}});
  kg::LoadOptions o;
  o.threads = ThreadPool::kMaxThreads + 1;
  expect_error([&] { model.load(kg::Device::parse("cpu"), {{2, 4}}, o); },
               {std::to_string(ThreadPool::kMaxThreads + 1) + " threads", "LoadOptions::threads",
                "to " + std::to_string(ThreadPool::kMaxThreads)});
  o.threads = 2;
  EXPECT_EQ(model.load(kg::Device::parse("cpu"), {{2, 4}}, o).output_names().size(), 1u);
}

TEST(ThreadPoolLimits, EnvironmentVariableIsParsedStrictly) {
  const std::string max = std::to_string(ThreadPool::kMaxThreads);
  for (const std::string& bad : std::vector<std::string>{"abc", "-1", "4x", " 4", "+4", "1e3", "99999999999999999999",
                                std::to_string(ThreadPool::kMaxThreads + 1)}) {
    SCOPED_TRACE("KG_NUM_THREADS=" + bad);
    EnvThreads env(bad);
    expect_error([] { ThreadPool::default_threads(); },
                 {"KG_NUM_THREADS is '" + bad + "'", "from 0 to " + max});
    expect_error([] { ThreadPool pool(0); }, {"KG_NUM_THREADS"});
  }
  {
    EnvThreads env(std::string("3"));
    EXPECT_EQ(ThreadPool::default_threads(), 3);
    ThreadPool pool(0);
    EXPECT_EQ(pool.size(), 3);
    ThreadPool explicit_count(2);  // an explicit count is not the variable's
    EXPECT_EQ(explicit_count.size(), 2);
  }
  {
    EnvThreads env(max);
    EXPECT_EQ(ThreadPool::default_threads(), ThreadPool::kMaxThreads);
  }
  for (const std::optional<std::string>& per_core :
       {std::optional<std::string>(), std::optional<std::string>(""), std::optional<std::string>("0")}) {
    EnvThreads env(per_core);
    EXPECT_EQ(ThreadPool::default_threads(), hardware_threads()) << (per_core ? *per_core : "(unset)");
  }
}

// In a child process with a thread limit that lets at most a few threads start, a pool of 64
// must fail with a kg::Error naming the thread it could not start. Before, the exception of
// std::thread unwound past joinable workers (std::terminate) or hung on their condition variable.
TEST(ThreadPoolLimits, ThreadStartFailureIsAnErrorNotAHang) {
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0) << std::strerror(errno);
  if (pid == 0) {
    // RLIMIT_NPROC (which counts threads) does not bind root: become nobody first when root.
    if (::geteuid() == 0) {
      if (::setgroups(0, nullptr) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(77);
    }
    const rlimit lim{4, 4};
    if (::setrlimit(RLIMIT_NPROC, &lim) != 0) ::_exit(77);
    try {
      ThreadPool pool(64);
      ::_exit(77);  // the limit did not bind here
    } catch (const kg::Error& e) {
      const std::string what = e.what();
      ::_exit(what.find("cannot start worker thread") != std::string::npos &&
                      what.find(" of 64") != std::string::npos
                  ? 0
                  : 3);
    } catch (...) {
      ::_exit(4);
    }
  }
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  pid_t done = 0;
  while ((done = ::waitpid(pid, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (done == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    FAIL() << "the pool hung when a thread could not be started";
  }
  ASSERT_EQ(done, pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << WTERMSIG(status)
                                 << " (std::terminate aborts)";
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "RLIMIT_NPROC cannot be made to bind here";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: a kg::Error without the expected text; 4: not a kg::Error";
}
