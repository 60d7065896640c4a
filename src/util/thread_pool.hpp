// A fixed pool of worker threads for CPU ops.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kg::util {

class ThreadPool {
 public:
  // The most threads a pool may have (LoadOptions::threads, kgraph --threads, KG_NUM_THREADS).
  static constexpr int kMaxThreads = 256;

  // `threads` workers including the caller (0: KG_NUM_THREADS, else one per core). A count below
  // 0 or above kMaxThreads is a kg::Error; so is a thread that cannot be started (the workers
  // already started are stopped and joined first).
  explicit ThreadPool(int threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }
  // Splits [0, n) into at most size() chunks of at least `grain`, runs them (the caller takes
  // one) and returns when all are done. The first exception thrown is rethrown.
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
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(std::int64_t, std::int64_t)>* job_ = nullptr;
  std::int64_t n_ = 0, chunk_ = 0;
  int chunks_ = 0, pending_ = 0;
  std::uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::mutex run_mu_;  // one parallel_for at a time
};

}  // namespace kg::util
