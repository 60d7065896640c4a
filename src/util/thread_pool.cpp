#include "util/thread_pool.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <string>
#include <string_view>
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

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Waits until done() or for about ThreadPool::kSpinMicroseconds, without blocking; true when
// done() held. A few microseconds of pause instructions, then sched_yield: where the cores are
// oversubscribed (OpenBLAS's or OpenMP's threads, other processes) a thread that is ready to
// compute takes the core at once instead of sharing it with a spinner.
template <class Done>
bool spin_until(Done&& done) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto pause_until = start + std::chrono::microseconds(2);
  const auto deadline = start + std::chrono::microseconds(ThreadPool::kSpinMicroseconds);
  for (;;) {
    for (int i = 0; i < 16; ++i) {
      if (done()) return true;
      cpu_relax();
    }
    const auto now = clock::now();
    if (now >= deadline) return done();
    if (now >= pause_until) std::this_thread::yield();
  }
}

constexpr std::uint64_t kChunkBits = 16;
constexpr std::uint64_t kChunkMask = (std::uint64_t{1} << kChunkBits) - 1;
static_assert(ThreadPool::kMaxThreads <= static_cast<int>(kChunkMask));
}  // namespace

int ThreadPool::default_threads() {
  const int hardware = std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, kMaxThreads);
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
  if (used != text.size() || !std::isdigit(static_cast<unsigned char>(text[0])) || v < 0 || v > kMaxThreads)
    throw Error(cat("KG_NUM_THREADS is '", text, "'; expected a whole number of threads from 0 to ",
                    kMaxThreads, " (0: one per core)"));
  return v == 0 ? hardware : static_cast<int>(v);
}

namespace {

// The OpenMP runtime of the process, looked up at run time: libgomp's entry for a parallel region
// (LLVM's libomp has it too) and the thread queries. Absent when no OpenMP runtime is loaded.
struct OpenMP {
  void (*parallel)(void (*)(void*), void*, unsigned, unsigned) = nullptr;
  int (*thread_num)() = nullptr;
  int (*num_threads)() = nullptr;
  bool loaded() const { return parallel && thread_num && num_threads; }
};

const OpenMP& openmp() {
  static const OpenMP o = [] {
    OpenMP r;
    r.parallel = reinterpret_cast<void (*)(void (*)(void*), void*, unsigned, unsigned)>(
        ::dlsym(RTLD_DEFAULT, "GOMP_parallel"));
    r.thread_num = reinterpret_cast<int (*)()>(::dlsym(RTLD_DEFAULT, "omp_get_thread_num"));
    r.num_threads = reinterpret_cast<int (*)()>(::dlsym(RTLD_DEFAULT, "omp_get_num_threads"));
    return r.loaded() ? r : OpenMP{};
  }();
  return o;
}

// KG_THREAD_POOL: "" (unset) or "auto", "own", "openmp".
ThreadPool::Workers workers_from_env() {
  const char* v = std::getenv("KG_THREAD_POOL");
  if (v == nullptr || *v == '\0' || std::string_view(v) == "auto") return ThreadPool::Workers::Auto;
  if (std::string_view(v) == "own") return ThreadPool::Workers::Own;
  if (std::string_view(v) == "openmp") return ThreadPool::Workers::OpenMP;
  throw Error(cat("KG_THREAD_POOL is '", v, "'; expected auto, own or openmp"));
}

}  // namespace

bool ThreadPool::openmp_available() { return openmp().loaded(); }

ThreadPool::ThreadPool(int threads, Workers workers) {
  if (threads < 0 || threads > kMaxThreads)
    throw Error(cat("a thread pool of ", threads,
                    " threads was asked for (LoadOptions::threads); expected 0 "
                    "(one per core) to ",
                    kMaxThreads));
  if (threads == 0) threads = default_threads();
  threads_ = threads;
  if (workers == Workers::Auto) workers = workers_from_env();
  openmp_ = workers != Workers::Own && openmp().loaded();
  // With OpenMP's threads the pool's own only find out whether as many can start (OpenMP would
  // end the process where one cannot): each waits at `gate` until all are started, then returns.
  std::mutex gate;
  std::unique_lock<std::mutex> hold(gate, std::defer_lock);
  if (openmp_) hold.lock();
  workers_.reserve(static_cast<std::size_t>(threads - 1));
  for (int i = 1; i < threads; ++i) {
    try {
      if (openmp_)
        workers_.emplace_back([&gate] { std::lock_guard<std::mutex> pass(gate); });
      else
        workers_.emplace_back([this, i] { worker_loop(i); });
    } catch (const std::system_error& e) {
      // The pool is not constructed, so its destructor will not run: the workers started so far
      // are stopped and joined here (a joinable std::thread destroyed would terminate).
      if (hold.owns_lock()) hold.unlock();
      stop_and_join();
      throw Error(cat("cannot start worker thread ", i + 1, " of ", threads, " (", e.what(),
                      "); the process or user thread limit may be reached — use fewer threads "
                      "(LoadOptions::threads, --threads or KG_NUM_THREADS)"));
    }
  }
  if (openmp_) {
    hold.unlock();
    stop_and_join();
  }
}

ThreadPool::~ThreadPool() { stop_and_join(); }

void ThreadPool::stop_and_join() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_.store(true);
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
    // The next job: spin a little (the next op of a forward pass comes soon), then block.
    std::uint64_t s = state_.load(std::memory_order_acquire);
    auto ready = [&] {
      s = state_.load(std::memory_order_acquire);
      return s != seen || stop_.load(std::memory_order_relaxed);
    };
    if (!ready() && !spin_until(ready)) {
      std::unique_lock<std::mutex> lk(mu_);
      // Seen by a caller that publishes a job after the check below (both sequentially
      // consistent): it then takes mu_ and notifies, so the wake-up is not lost.
      sleepers_.fetch_add(1);
      cv_.wait(lk, [&] {
        s = state_.load();
        return s != seen || stop_.load();
      });
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
    }
    if (stop_.load()) return;
    seen = s;
    const int chunks = static_cast<int>(s & kChunkMask);
    if (index >= chunks) continue;  // not in this job
    const auto& job = *job_;
    const std::int64_t b = chunk_begin(index, n_, chunks), e = chunk_begin(index + 1, n_, chunks);
    try {
      if (b < e) job(b, e);
    } catch (...) {
      std::lock_guard<std::mutex> lk(error_mu_);
      if (!error_) error_ = std::current_exception();
    }
    // The last chunk wakes the caller if it blocked (the same pairing as sleepers_).
    if (pending_.fetch_sub(1) == 1 && caller_waiting_.load()) {
      { std::lock_guard<std::mutex> lk(done_mu_); }
      done_cv_.notify_one();
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
  if (openmp_) {
    run_openmp(chunks, n, fn);
    return;
  }
  std::lock_guard<std::mutex> run(run_mu_);
  t_in_pool = true;
  struct Reset {
    ~Reset() { t_in_pool = false; }
  } reset;
  job_ = &fn;
  n_ = n;
  error_ = nullptr;
  pending_.store(chunks - 1, std::memory_order_relaxed);
  const std::uint64_t generation = (state_.load(std::memory_order_relaxed) >> kChunkBits) + 1;
  state_.store((generation << kChunkBits) | static_cast<std::uint64_t>(chunks));
  if (sleepers_.load() > 0) {
    { std::lock_guard<std::mutex> lk(mu_); }
    cv_.notify_all();
  }
  std::exception_ptr mine;
  try {
    fn(0, chunk_begin(1, n, chunks));
  } catch (...) {
    mine = std::current_exception();
  }
  auto done = [&] { return pending_.load(std::memory_order_acquire) == 0; };
  if (!done() && !spin_until(done)) {
    std::unique_lock<std::mutex> lk(done_mu_);
    caller_waiting_.store(true);
    done_cv_.wait(lk, [&] { return pending_.load() == 0; });
    caller_waiting_.store(false, std::memory_order_relaxed);
  }
  job_ = nullptr;
  if (mine) std::rethrow_exception(mine);
  if (error_) {
    std::exception_ptr err = std::move(error_);
    error_ = nullptr;
    std::rethrow_exception(err);
  }
}

void ThreadPool::run_openmp(int chunks, std::int64_t n,
                            const std::function<void(std::int64_t, std::int64_t)>& fn) {
  // One region of `chunks` threads, the caller among them; a thread takes chunk k, and more where
  // OpenMP gave fewer threads (a thread limit, or a call inside someone else's region).
  struct Job {
    const std::function<void(std::int64_t, std::int64_t)>* fn;
    std::int64_t n;
    int chunks;
    std::mutex mu;
    std::exception_ptr error;  // the first one
  } job{&fn, n, chunks, {}, {}};
  const OpenMP& omp = openmp();
  struct Region {
    static void body(void* data) {
      Job& j = *static_cast<Job*>(data);
      const OpenMP& o = openmp();
      const int team = std::max(o.num_threads(), 1);
      const bool was = t_in_pool;
      t_in_pool = true;
      for (int k = o.thread_num(); k < j.chunks; k += team) {
        try {
          (*j.fn)(chunk_begin(k, j.n, j.chunks), chunk_begin(k + 1, j.n, j.chunks));
        } catch (...) {
          std::lock_guard<std::mutex> lk(j.mu);
          if (!j.error) j.error = std::current_exception();
        }
      }
      t_in_pool = was;
    }
  };
  omp.parallel(&Region::body, &job, static_cast<unsigned>(chunks), 0);
  if (job.error) std::rethrow_exception(job.error);
}

}  // namespace kg::util

namespace kg {

CpuContext::CpuContext(std::span<const Tensor> in, std::span<const Tensor> ps, Tensor out, bool train,
                       std::uint64_t s)
    : inputs(in), params(ps), output(std::move(out)), training(train), seed(s) {}

void CpuContext::parallel_for(std::int64_t n, std::int64_t grain, const RangeFn& fn) const {
  util::ThreadPool::global().parallel_for(n, grain, fn);
}

}  // namespace kg
