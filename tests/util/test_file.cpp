// util::write_file_atomic, which the disk caches write through: the new text replaces the old
// one whole, readers racing the writers only ever see a complete text, and a write that fails
// leaves the old file and no temporary behind.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "support/test_util.hpp"
#include "util/file.hpp"

namespace fs = std::filesystem;

namespace {

// A fresh, empty folder for one test.
fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / (name + "." + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::size_t entries(const fs::path& d) {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(d)) ++n;
  return n;
}

}  // namespace

TEST(WriteFileAtomic, WritesAndReplacesWithTheGivenMode) {
  const fs::path d = fresh_dir("kg_atomic_write");
  const fs::path p = d / "f.txt";
  ASSERT_TRUE(kg::util::write_file_atomic(p, "first", 0600));
  EXPECT_EQ(kg_test::read_file(p), "first");
  struct stat st{};
  ASSERT_EQ(::stat(p.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  const std::string big(3 << 20, 'x');  // more than one write() may take
  ASSERT_TRUE(kg::util::write_file_atomic(p, big));
  EXPECT_EQ(kg_test::read_file(p), big);
  ASSERT_TRUE(kg::util::write_file_atomic(p, ""));
  EXPECT_EQ(kg_test::read_file(p), "");
  EXPECT_EQ(entries(d), 1u) << "no temporary file is left";
  fs::remove_all(d);
}

TEST(WriteFileAtomic, AFailedWriteKeepsTheOldFileAndLeavesNothing) {
  const fs::path d = fresh_dir("kg_atomic_fail");
  EXPECT_FALSE(kg::util::write_file_atomic(d / "missing" / "f.txt", "text")) << "no such folder";
  // The target is a folder that is not empty: the rename fails after the temporary was written.
  fs::create_directories(d / "busy" / "inside");
  EXPECT_FALSE(kg::util::write_file_atomic(d / "busy", "text"));
  EXPECT_TRUE(fs::is_directory(d / "busy" / "inside"));
  EXPECT_EQ(entries(d), 1u) << "the temporary was removed";
  if (::geteuid() != 0) {  // root may write anywhere
    const fs::path p = d / "ro" / "f.txt";
    fs::create_directories(p.parent_path());
    ASSERT_TRUE(kg::util::write_file_atomic(p, "old"));
    fs::permissions(p.parent_path(), fs::perms::owner_read | fs::perms::owner_exec);
    EXPECT_FALSE(kg::util::write_file_atomic(p, "new"));
    EXPECT_EQ(kg_test::read_file(p), "old");
    fs::permissions(p.parent_path(), fs::perms::owner_all);
  }
  fs::remove_all(d);
}

TEST(WriteFileAtomic, ReadersRacingWritersSeeOnlyWholeTexts) {
  const fs::path d = fresh_dir("kg_atomic_race");
  const fs::path p = d / "f.txt";
  // Each writer's text is one letter repeated, of a length of its own: a torn or mixed file shows.
  auto text_of = [](int w) { return std::string(static_cast<std::size_t>(40000 + 997 * w), static_cast<char>('a' + w)); };
  ASSERT_TRUE(kg::util::write_file_atomic(p, text_of(0)));
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0}, reads{0};
  std::thread reader([&] {
    while (!stop) {
      const std::string s = kg_test::read_file(p);
      ++reads;
      const int w = s.empty() ? -1 : s[0] - 'a';
      if (w < 0 || w >= 4 || s != text_of(w)) ++bad;
    }
  });
  std::vector<std::thread> writers;
  std::atomic<int> failed{0};
  for (int w = 0; w < 4; ++w)
    writers.emplace_back([&, w] {
      for (int i = 0; i < 40; ++i) failed += !kg::util::write_file_atomic(p, text_of(w));
    });
  for (auto& t : writers) t.join();
  stop = true;
  reader.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(bad.load(), 0) << "of " << reads.load() << " reads";
  EXPECT_GT(reads.load(), 0);
  EXPECT_EQ(entries(d), 1u);
  fs::remove_all(d);
}
