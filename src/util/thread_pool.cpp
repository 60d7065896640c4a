#include "util/thread_pool.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>
#include <system_error>

#include "kg/custom_op.hpp"
#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::util {
namespace {
thread_local bool t_in_pool = false;  // nested parallel_for calls run inline

// Start of chunk `k` when [0, n) is split into `chunks` chunks whose sizes differ by at most one
// (the first n % chunks take one more); k == chunks gives n.
std::int64_t chunk_begin(std::int64_t k, std::int64_t n, std::int64_t chunks) {
  return k * (n / chunks) + std::min(k, n % chunks);
}
}  // namespace

int ThreadPool::default_threads() {
  const int hardware =
      std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, kMaxThreads);
  const char* env = std::getenv("KG_NUM_THREADS");
  if (env == nullptr || *env == '\0') return hardware;
  // Strictly a whole number: atoi would read "8x" as 8, "x" as 0 and 10^12 as garbage.
  const std::string text = env;
  long long v = -1;
  std::size_t used = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || !std::isdigit(static_cast<unsigned char>(text[0])) || v < 0 ||
      v > kMaxThreads)
    throw Error(cat("KG_NUM_THREADS is '", text, "'; expected a whole number of threads from 0 to ",
                    kMaxThreads, " (0: one per core)"));
  return v == 0 ? hardware : static_cast<int>(v);
}

ThreadPool::ThreadPool(int threads) {
  if (threads < 0 || threads > kMaxThreads)
    throw Error(cat("a thread pool of ", threads, " threads was asked for (LoadOptions::threads); expected 0 "
                    "(one per core) to ", kMaxThreads));
  if (threads == 0) threads = default_threads();
  workers_.reserve(static_cast<std::size_t>(threads - 1));
  for (int i = 1; i < threads; ++i) {
    try {
      workers_.emplace_back([this, i] { worker_loop(i); });
    } catch (const std::system_error& e) {
      // The pool is not constructed, so its destructor will not run: the workers started so far
      // are stopped and joined here (a joinable std::thread destroyed would terminate).
      stop_and_join();
      throw Error(cat("cannot start worker thread ", i + 1, " of ", threads, " (", e.what(),
                      "); the process or user thread limit may be reached — use fewer threads "
                      "(LoadOptions::threads, --threads or KG_NUM_THREADS)"));
    }
  }
}

ThreadPool::~ThreadPool() { stop_and_join(); }

void ThreadPool::stop_and_join() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_)
    if (t.joinable()) t.join();
  workers_.clear();
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool;
  return pool;
}

void ThreadPool::worker_loop(int index) {
  t_in_pool = true;
  std::uint64_t seen = 0;
  for (;;) {
    const std::function<void(std::int64_t, std::int64_t)>* job;
    std::int64_t b, e;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (index >= chunks_) continue;
      job = job_;
      b = chunk_begin(index, n_, chunks_);
      e = chunk_begin(index + 1, n_, chunks_);
    }
    std::exception_ptr err;
    try {
      if (b < e) (*job)(b, e);
    } catch (...) {
      err = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (err && !error_) error_ = err;
      err = nullptr;  // drop this thread's reference before the caller may free the exception
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(std::int64_t n, std::int64_t grain,
                              const std::function<void(std::int64_t, std::int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<std::int64_t>(grain, 1);
  // As many chunks as the threads, but none smaller than `grain`: chunk sizes differ by at most
  // one, so each has at least floor(n / chunks) >= grain elements.
  const int chunks = static_cast<int>(std::clamp<std::int64_t>(n / grain, 1, size()));
  if (chunks <= 1 || t_in_pool) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> run(run_mu_);
  t_in_pool = true;
  struct Reset {
    ~Reset() { t_in_pool = false; }
  } reset;
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = &fn;
    n_ = n;
    chunk_ = n / chunks;
    chunks_ = chunks;
    pending_ = chunks - 1;
    error_ = nullptr;
    ++generation_;
  }
  cv_.notify_all();
  std::exception_ptr mine;
  try {
    fn(0, chunk_begin(1, n, chunks));
  } catch (...) {
    mine = std::current_exception();
  }
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return pending_ == 0; });
  job_ = nullptr;
  if (mine) std::rethrow_exception(mine);
  if (error_) std::rethrow_exception(error_);
}

}  // namespace kg::util

namespace kg {

CpuContext::CpuContext(std::span<const Tensor> in, std::span<const Tensor> ps, Tensor out,
                       bool train, std::uint64_t s)
    : inputs(in), params(ps), output(std::move(out)), training(train), seed(s) {}

void CpuContext::parallel_for(std::int64_t n, std::int64_t grain, const RangeFn& fn) const {
  util::ThreadPool::global().parallel_for(n, grain, fn);
}

}  // namespace kg
