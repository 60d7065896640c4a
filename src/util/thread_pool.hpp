// A fixed pool of worker threads for CPU ops.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kg::util {

class ThreadPool {
 public:
  // The most threads a pool may have (LoadOptions::threads, kgraph --threads, KG_NUM_THREADS).
  static constexpr int kMaxThreads = 256;
  // How long an idle worker, and a caller waiting for the workers, spin before they block: long
  // enough that the ops of one forward pass hand work over without a sleep and a wake-up, short
  // enough that a pool idle between runs costs next to no CPU.
  static constexpr int kSpinMicroseconds = 50;

  // Whose threads run the chunks. Where an OpenMP runtime is loaded in the process (oneDNN
  // brings libgomp), Auto runs each parallel_for as an OpenMP parallel region of the calling
  // thread: the ops and oneDNN's primitives then share one set of threads, instead of two sets
  // that take the cores from each other (an OpenMP thread spins for milliseconds after each
  // region). Elsewhere Auto is the pool's own worker threads. KG_THREAD_POOL=own or =openmp
  // overrides Auto (openmp where none is loaded: own).
  enum class Workers { Auto, Own, OpenMP };

  // `threads` threads including the caller (0: KG_NUM_THREADS, else one per core). A count below
  // 0 or above kMaxThreads is a kg::Error; so is a thread that cannot be started (the workers
  // already started are stopped and joined first; with OpenMP's threads, the pool starts and
  // joins as many threads of its own to find out).
  explicit ThreadPool(int threads = 0, Workers workers = Workers::Auto);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return threads_; }
  // True when the chunks run on OpenMP's threads (Workers above).
  bool uses_openmp() const { return openmp_; }
  // True when an OpenMP runtime is loaded in this process.
  static bool openmp_available();
  // Splits [0, n) into at most size() chunks of at least `grain`, runs them (the caller takes
  // one) and returns when all are done. The first exception thrown is rethrown. A range of one
  // chunk (n < 2 * grain, or a pool of one thread) and a call from inside a chunk run on the
  // calling thread at once, without touching the workers.
  void parallel_for(std::int64_t n, std::int64_t grain,
                    const std::function<void(std::int64_t, std::int64_t)>& fn);

  // The process-wide pool (its size from KG_NUM_THREADS, else one per core).
  static ThreadPool& global();

  // The threads of a pool of size 0: KG_NUM_THREADS when set and not empty (a whole number from
  // 0 to kMaxThreads, 0 meaning one per core; anything else is a kg::Error naming the variable),
  // else the hardware threads, at most kMaxThreads.
  static int default_threads();

 private:
  void worker_loop(int index);
  void stop_and_join();
  void run_openmp(int chunks, std::int64_t n, const std::function<void(std::int64_t, std::int64_t)>& fn);
  int threads_ = 1;
  bool openmp_ = false;
  std::vector<std::thread> workers_;
  // The job: written by the caller before it publishes a new state_, read only by the workers
  // that take part in it (which the caller waits for before it writes the next one).
  const std::function<void(std::int64_t, std::int64_t)>* job_ = nullptr;
  std::int64_t n_ = 0;
  // (generation << 16) | chunks of the latest job; a worker takes part when its index < chunks.
  alignas(64) std::atomic<std::uint64_t> state_{0};
  alignas(64) std::atomic<int> pending_{0};  // chunks of the workers not finished yet
  std::atomic<int> sleepers_{0};             // workers blocked (or about to block) on cv_
  std::atomic<bool> caller_waiting_{false};  // the caller blocked on done_cv_
  std::atomic<bool> stop_{false};
  std::mutex mu_;  // cv_'s
  std::condition_variable cv_;
  std::mutex done_mu_;  // done_cv_'s
  std::condition_variable done_cv_;
  std::mutex error_mu_;
  std::exception_ptr error_;  // the first exception of a worker's chunk
  std::mutex run_mu_;         // one parallel_for at a time
};

}  // namespace kg::util
