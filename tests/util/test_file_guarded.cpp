// The guarded read (util::ReadFile), the safe write (util::write_file_atomic, write_file_safely,
// AppendFile) and the private-folder check (util::private_dir, private_subdir): folders, FIFOs and
// devices are named as such (never "does not exist"), a FIFO never blocks, a file larger than its
// limit is refused unread, a non-regular output target or a planted link is never written through,
// a file-size limit is an error with no temporary left, and a cache subfolder that is a link or
// writable by others is refused.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>

#include "kg/error.hpp"
#include "support/test_util.hpp"
#include "util/file.hpp"

namespace fs = std::filesystem;
using kg::util::ReadFile;
using kg::util::ReadLimits;

namespace {

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / (name + "." + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  fs::permissions(d, fs::perms::owner_all);
  return d;
}

std::string read_error(const fs::path& p, const ReadLimits& limits = {}) {
  try {
    kg::util::read_file(p, limits, "test file");
  } catch (const kg::Error& e) {
    return e.what();
  }
  return "(no error)";
}

void write_file(const fs::path& p, const std::string& text) {
  ASSERT_TRUE(kg::util::write_file_atomic(p, text));
}

std::size_t entries(const fs::path& d) {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(d)) ++n;
  return n;
}

}  // namespace

TEST(GuardedRead, NamesWhatIsThereInsteadOfDoesNotExist) {
  const fs::path d = fresh_dir("kg_guarded_read");
  EXPECT_NE(read_error(d).find("is a folder"), std::string::npos) << read_error(d);
  EXPECT_NE(read_error(d / "missing").find("does not exist"), std::string::npos);
  ASSERT_EQ(::mkfifo((d / "fifo").c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string fifo = read_error(d / "fifo");  // no writer: a blocking open would hang here
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  EXPECT_NE(fifo.find("is a FIFO"), std::string::npos) << fifo;
  EXPECT_NE(fifo.find((d / "fifo").string()), std::string::npos) << fifo;
  if (fs::exists("/dev/zero")) {  // opened read-only and refused at fstat: nothing is read
    const std::string dev = read_error("/dev/zero");
    EXPECT_NE(dev.find("is a device"), std::string::npos) << dev;
  }
  fs::remove_all(d);
}

TEST(GuardedRead, RefusesAFileLargerThanItsLimitUnread) {
  const fs::path d = fresh_dir("kg_guarded_size");
  write_file(d / "f", std::string(1000, 'x'));
  const std::string e = read_error(d / "f", {999, true});
  EXPECT_NE(e.find("is 1000 bytes, larger than the limit of 999 bytes"), std::string::npos) << e;
  EXPECT_EQ(kg::util::read_file(d / "f", {1000, true}), std::string(1000, 'x'));
  ReadFile f(d / "f", {}, "test file");
  char buf[4];
  EXPECT_THROW(f.read_at(buf, 998, 4), kg::Error);  // past the end: named, never a short read
  ::truncate((d / "f").c_str(), 10);                // cut short after the open
  EXPECT_THROW(f.read_all(), kg::Error);
  fs::remove_all(d);
}

TEST(GuardedRead, RefusesALinkWhereLinksAreNotAllowed) {
  const fs::path d = fresh_dir("kg_guarded_link");
  write_file(d / "target", "secret");
  fs::create_symlink(d / "target", d / "link");
  EXPECT_EQ(kg::util::read_file(d / "link"), "secret");
  const std::string e = read_error(d / "link", {1 << 20, false});
  EXPECT_NE(e.find("symbolic link"), std::string::npos) << e;
  std::string out, why;
  EXPECT_FALSE(kg::util::try_read_file(d / "link", {1 << 20, false}, out, &why));
  EXPECT_TRUE(out.empty());
  fs::remove_all(d);
}

TEST(SafeWrite, RefusesNonRegularTargetsAndPlantedLinks) {
  const fs::path d = fresh_dir("kg_safe_write");
  // A FIFO stands in for a device node: it must stay a FIFO, never become a regular file.
  ASSERT_EQ(::mkfifo((d / "fifo").c_str(), 0600), 0);
  std::string why;
  EXPECT_FALSE(kg::util::write_file_atomic(d / "fifo", "x", 0644, &why));
  EXPECT_NE(why.find("a FIFO"), std::string::npos) << why;
  struct stat st {};
  ASSERT_EQ(::lstat((d / "fifo").c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  // A link at the final path: refused, its target untouched.
  write_file(d / "victim", "keep");
  fs::create_symlink(d / "victim", d / "out");
  EXPECT_THROW(kg::util::write_file_safely(d / "out", "new"), kg::Error);
  EXPECT_THROW(kg::util::check_output_path(d / "out"), kg::Error);
  EXPECT_EQ(kg_test::read_file((d / "victim").string()), "keep");
  // Links planted at the temporary names this process would use next: skipped, never followed.
  write_file(d / "victim2", "keep");
  for (int i = 0; i < 40; ++i)
    fs::create_symlink(d / "victim2", d / ("real.tmp." + std::to_string(::getpid()) + "." + std::to_string(i)));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(kg::util::write_file_atomic(d / "real", "mine"));
  EXPECT_EQ(kg_test::read_file((d / "real").string()), "mine");
  EXPECT_EQ(kg_test::read_file((d / "victim2").string()), "keep");
  fs::remove_all(d);
}

TEST(SafeWrite, AFileSizeLimitIsAnErrorWithNoTemporaryLeft) {
  const fs::path d = fresh_dir("kg_safe_write_fsize");
  // In a child: the limit and the signal disposition are the process's.
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    kg::util::ignore_file_size_signal();
    struct rlimit rl {4096, 4096};
    ::setrlimit(RLIMIT_FSIZE, &rl);
    std::string why;
    const bool ok = kg::util::write_file_atomic(d / "big", std::string(1 << 20, 'x'), 0644, &why);
    int code = ok ? 2 : why.find("EFBIG") == std::string::npos ? 3 : 0;
    try {
      kg::util::AppendFile log(d / "log");
      log.write(std::string(1 << 20, 'x'));
      code = code ? code : 4;
    } catch (const kg::Error&) {
    }
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_FALSE(fs::exists(d / "big"));
  EXPECT_EQ(entries(d), 1u) << "only the log, no .tmp file";
  fs::remove_all(d);
}

TEST(SafeWrite, AppendFileRefusesLinksAndFifos) {
  const fs::path d = fresh_dir("kg_append_file");
  write_file(d / "victim", "keep");
  fs::create_symlink(d / "victim", d / "log.csv");
  EXPECT_THROW(kg::util::AppendFile(d / "log.csv"), kg::Error);
  EXPECT_EQ(kg_test::read_file((d / "victim").string()), "keep");
  ASSERT_EQ(::mkfifo((d / "gnuplot.log").c_str(), 0600), 0);
  EXPECT_THROW(kg::util::AppendFile(d / "gnuplot.log"), kg::Error);  // no reader: never blocks
  kg::util::AppendFile ok(d / "plain");
  ok.write("a,b\n");
  ok.write("1,2\n");
  ok.close();
  EXPECT_EQ(kg_test::read_file((d / "plain").string()), "a,b\n1,2\n");
  fs::remove_all(d);
}

TEST(PrivateDir, RefusesALinkedOrSharedSubfolder) {
  const fs::path d = fresh_dir("kg_private_dir");
  const fs::path base = d / "cache", elsewhere = d / "elsewhere";
  std::string why;
  fs::path out;
  ASSERT_TRUE(kg::util::private_subdir(base, "emu", why, &out)) << why;
  EXPECT_EQ(out, base / "emu");
  fs::remove_all(base / "emu");
  fs::create_directories(elsewhere);
  fs::permissions(elsewhere, fs::perms::owner_all);
  fs::create_symlink(elsewhere, base / "emu");
  EXPECT_FALSE(kg::util::private_subdir(base, "emu", why));
  EXPECT_NE(why.find("symbolic link"), std::string::npos) << why;
  fs::remove(base / "emu");
  fs::create_directories(base / "emu");
  fs::permissions(base / "emu", fs::perms::all);  // world-writable
  EXPECT_FALSE(kg::util::private_subdir(base, "emu", why));
  EXPECT_NE(why.find("writable by group or others"), std::string::npos) << why;
  fs::permissions(base / "emu", fs::perms::owner_all);
  fs::permissions(base, fs::perms::all);
  EXPECT_FALSE(kg::util::private_subdir(base, "emu", why)) << "the base is checked too";
  fs::remove_all(d);
}
