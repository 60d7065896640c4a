// The CPU thread pool: coverage of every index exactly once, chunk sizes, exceptions, nesting
// and concurrent callers.
#include <atomic>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#include "util/thread_pool.hpp"
#include "support/test_util.hpp"

using kg::util::ThreadPool;
using kg_test::expect_error;

namespace {

struct Chunk {
  std::int64_t b, e;
  std::thread::id thread;
};

// Runs parallel_for and checks: every index once, chunk count and sizes, no empty chunk.
void check_cover(ThreadPool& pool, std::int64_t n, std::int64_t grain) {
  SCOPED_TRACE("threads " + std::to_string(pool.size()) + " n " + std::to_string(n) + " grain " +
               std::to_string(grain));
  std::vector<std::atomic<int>> hits(static_cast<std::size_t>(std::max<std::int64_t>(n, 0)));
  std::mutex mu;
  std::vector<Chunk> chunks;
  pool.parallel_for(n, grain, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) hits[static_cast<std::size_t>(i)].fetch_add(1);
    std::lock_guard<std::mutex> lk(mu);
    chunks.push_back({b, e, std::this_thread::get_id()});
  });
  for (std::size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i].load(), 1) << "index " << i;
  if (n <= 0) {
    EXPECT_TRUE(chunks.empty());
    return;
  }
  ASSERT_GE(chunks.size(), 1u);
  EXPECT_LE(chunks.size(), static_cast<std::size_t>(pool.size()));
  std::int64_t total = 0;
  std::set<std::thread::id> threads;
  for (const auto& c : chunks) {
    EXPECT_LT(c.b, c.e) << "empty chunk";
    // Chunks are at least `grain` long, unless the whole range is shorter.
    EXPECT_GE(c.e - c.b, std::min(std::max<std::int64_t>(grain, 1), n)) << "[" << c.b << ", " << c.e << ")";
    total += c.e - c.b;
    threads.insert(c.thread);
  }
  EXPECT_EQ(total, n);
  // Each chunk runs on its own thread.
  EXPECT_EQ(threads.size(), chunks.size());
  // Work is split as widely as the grain allows.
  const std::int64_t g = std::max<std::int64_t>(grain, 1);
  EXPECT_EQ(static_cast<std::int64_t>(chunks.size()), std::clamp<std::int64_t>(n / g, 1, pool.size()));
}

}  // namespace

TEST(ThreadPool, CoversEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3, 4, 7}) {
    ThreadPool pool(threads);
    ASSERT_EQ(pool.size(), threads);
    for (std::int64_t n : {-5, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 13, 64, 100, 1000, 4097})
      for (std::int64_t grain : {-1, 0, 1, 2, 3, 4, 6, 16, 100, 256, 10000}) check_cover(pool, n, grain);
  }
}

TEST(ThreadPool, ManyRunsInARow) {
  // Back-to-back jobs with changing chunk counts exercise the wake-up of idle workers.
  ThreadPool pool(4);
  std::vector<std::int64_t> sums;
  for (int r = 0; r < 2000; ++r) {
    const std::int64_t n = 1 + r % 37;
    std::atomic<std::int64_t> sum{0};
    pool.parallel_for(n, 1 + r % 5, [&](std::int64_t b, std::int64_t e) {
      std::int64_t s = 0;
      for (std::int64_t i = b; i < e; ++i) s += i;
      sum += s;
    });
    ASSERT_EQ(sum.load(), n * (n - 1) / 2) << "run " << r;
  }
}

TEST(ThreadPool, ExceptionsPropagate) {
  ThreadPool pool(4);
  // From a worker's chunk (not the caller's, which is [0, ...)).
  expect_error(
      [&] {
        pool.parallel_for(100, 1, [](std::int64_t b, std::int64_t) {
          if (b >= 75) throw kg::Error("bad row " + std::to_string(b));
        });
      },
      {"bad row 75"});
  // From the caller's chunk.
  EXPECT_THROW(pool.parallel_for(100, 1,
                                 [](std::int64_t b, std::int64_t) {
                                   if (b == 0) throw std::invalid_argument("first chunk");
                                 }),
               std::invalid_argument);
  // From every chunk: one of them comes out, the others are dropped, and all chunks finished.
  std::atomic<int> ran{0};
  EXPECT_THROW(pool.parallel_for(100, 1,
                                 [&](std::int64_t, std::int64_t) {
                                   ++ran;
                                   throw std::runtime_error("all");
                                 }),
               std::runtime_error);
  EXPECT_EQ(ran.load(), 4);
  // Inline path (one chunk) too.
  EXPECT_THROW(
      pool.parallel_for(3, 100, [](std::int64_t, std::int64_t) { throw std::logic_error("inline"); }),
      std::logic_error);
  // The pool still works afterwards.
  check_cover(pool, 1000, 1);
}

TEST(ThreadPool, NestedCallsRunInline) {
  ThreadPool pool(4);
  const std::int64_t outer = 8, inner = 50;
  std::vector<std::atomic<int>> hits(outer * inner);
  pool.parallel_for(outer, 1, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) {
      const auto me = std::this_thread::get_id();
      pool.parallel_for(inner, 1, [&](std::int64_t ib, std::int64_t ie) {
        EXPECT_EQ(std::this_thread::get_id(), me);  // nested: same thread, no deadlock
        for (std::int64_t j = ib; j < ie; ++j) hits[static_cast<std::size_t>(i * inner + j)].fetch_add(1);
      });
    }
  });
  for (std::size_t k = 0; k < hits.size(); ++k) ASSERT_EQ(hits[k].load(), 1) << k;
  // Nested into another pool, and into the global one.
  ThreadPool other(3);
  std::atomic<std::int64_t> sum{0};
  pool.parallel_for(4, 1, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i)
      other.parallel_for(10, 1, [&](std::int64_t ib, std::int64_t ie) {
        ThreadPool::global().parallel_for(ie - ib, 1, [&](std::int64_t, std::int64_t) {});
        for (std::int64_t j = ib; j < ie; ++j) sum += i * 10 + j;
      });
  });
  EXPECT_EQ(sum.load(), 39 * 40 / 2);
  // After nesting the pool is parallel again.
  check_cover(pool, 400, 1);
}

TEST(ThreadPool, ConcurrentCallersAreSerialised) {
  ThreadPool pool(3);
  std::atomic<int> failures{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t)
    callers.emplace_back([&, t] {
      for (int r = 0; r < 300; ++r) {
        const std::int64_t n = 10 + (r * 7 + t) % 90;
        std::atomic<std::int64_t> sum{0};
        pool.parallel_for(n, 2, [&](std::int64_t b, std::int64_t e) {
          for (std::int64_t i = b; i < e; ++i) sum += i + 1;
        });
        if (sum.load() != n * (n + 1) / 2) ++failures;
      }
    });
  for (auto& c : callers) c.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST(ThreadPool, GlobalPoolAndCpuContext) {
  ThreadPool& g = ThreadPool::global();
  EXPECT_EQ(&g, &ThreadPool::global());
  EXPECT_GE(g.size(), 1);
  check_cover(g, 777, 3);
  // CpuContext's default parallel_for runs on the global pool.
  kg::Tensor out = kg::Tensor::zeros(kg::DType::F32, {100});
  kg::CpuContext ctx({}, {}, out, false, 0);
  std::vector<std::atomic<int>> hits(100);
  ctx.parallel_for(100, 7, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) hits[static_cast<std::size_t>(i)].fetch_add(1);
  });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
}
