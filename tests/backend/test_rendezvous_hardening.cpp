// The file rendezvous against hostile folders: a FIFO in place of a rank's message blocked the
// reader forever (past KG_RENDEZVOUS_TIMEOUT), a huge file there was read whole, and a link planted
// at the writer's temporary name was written through. Each is now an error (or skipped) at once.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <thread>

#include "backend/comm/group.hpp"
#include "kg/error.hpp"
#include "support/test_util.hpp"

namespace fs = std::filesystem;

namespace {

fs::path fresh_dir(const std::string& tag) {
  const fs::path d =
      fs::temp_directory_path() / ("kg-rdv-" + tag + "-" + std::to_string(kg_test::fresh_seed()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// Runs `fn` on a thread; false when it did not finish within `seconds` (the thread is left behind:
// the test has failed by then).
template <class F>
bool finishes_within(F fn, double seconds, std::string* error) {
  auto task = std::make_shared<std::packaged_task<std::string()>>([fn] {
    try {
      fn();
    } catch (const kg::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  });
  auto fut = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  if (fut.wait_for(std::chrono::duration<double>(seconds)) != std::future_status::ready) return false;
  *error = fut.get();
  return true;
}

}  // namespace

TEST(RendezvousHardening, AFifoInPlaceOfAMessageIsAnErrorNotAHang) {
  const fs::path dir = fresh_dir("fifo");
  // Rank 1's first message is a FIFO nobody writes to.
  ASSERT_EQ(::mkfifo((dir / "0.1").c_str(), 0600), 0);
  auto g = kg::comm::make_rendezvous(dir.string(), 0, 2, 0, 30.0);
  std::string error;
  ASSERT_TRUE(finishes_within([g] { g->barrier(); }, 10.0, &error)) << "the barrier blocked on a FIFO";
  EXPECT_NE(error.find("rank 1"), std::string::npos) << error;
  EXPECT_NE(error.find("FIFO"), std::string::npos) << error;
  fs::remove_all(dir);
}

TEST(RendezvousHardening, AHugeMessageIsRefusedUnread) {
  const fs::path dir = fresh_dir("huge");
  {
    std::ofstream f(dir / "0.1", std::ios::binary);
    f.seekp((std::int64_t{1} << 30) - 1);  // a sparse 1 GiB file
    f.put('\0');
  }
  auto g = kg::comm::make_rendezvous(dir.string(), 0, 2, 0, 30.0);
  std::string error;
  ASSERT_TRUE(finishes_within([g] { g->barrier(); }, 20.0, &error));
  EXPECT_NE(error.find("larger than the limit"), std::string::npos) << error;
  fs::remove_all(dir);
}

TEST(RendezvousHardening, APlantedLinkAtTheTemporaryNameIsNotWrittenThrough) {
  const fs::path dir = fresh_dir("link");
  { std::ofstream(dir / "victim") << "keep"; }
  // The writer's old temporary name.
  fs::create_symlink(dir / "victim", dir / "0.0.part");
  fs::create_symlink(dir / "victim", dir / ("0.0.part." + std::to_string(::getpid())));
  auto g = kg::comm::make_rendezvous(dir.string(), 0, 1, 0, 5.0);
  double x = 2.5;
  g->all_reduce_sum(&x, 1);
  EXPECT_EQ(x, 2.5);
  std::ifstream in(dir / "victim");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "keep");
  fs::remove_all(dir);
}
