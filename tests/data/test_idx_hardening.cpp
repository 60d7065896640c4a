// The IDX reader against hostile inputs: a FIFO in place of a file (must not block) and dims whose
// products overflow, a zero dim included.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "kg/data.hpp"
#include "support/test_util.hpp"

namespace fs = std::filesystem;
using kg_test::expect_error;

namespace {

class IdxHardening : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "kg-idx-hard-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (fs::path(dir_) / name).string(); }
  std::string dir_;
};

using Bytes = std::vector<unsigned char>;

// An IDX file: magic, type code, big-endian dims, payload.
Bytes idx_bytes(unsigned char type, const std::vector<std::uint32_t>& dims, const Bytes& payload) {
  Bytes b{0, 0, type, static_cast<unsigned char>(dims.size())};
  for (auto d : dims)
    for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<unsigned char>((d >> s) & 0xFF));
  b.insert(b.end(), payload.begin(), payload.end());
  return b;
}

void write_plain(const std::string& path, const Bytes& b) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// The finding: opening a FIFO waited for a writer forever, before the regular-file check. The read
// runs in a child that is killed after a few seconds, so a regression fails instead of hanging.
TEST_F(IdxHardening, FifoIsRejectedWithoutBlocking) {
  const std::string p = path("pipe.idx");
  ASSERT_EQ(::mkfifo(p.c_str(), 0600), 0) << std::strerror(errno);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(fds[0]);
    std::string msg = "no error";
    int code = 1;
    try {
      kg::data::read_idx(p);
    } catch (const kg::Error& e) {
      msg = e.what();
      code = 0;
    } catch (...) {
      msg = "another exception";
    }
    const ssize_t w = ::write(fds[1], msg.data(), msg.size());
    (void)w;
    ::_exit(code);
  }
  ::close(fds[1]);
  int status = 0;
  bool finished = false;
  while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5)) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      finished = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!finished) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
  }
  std::string msg;
  char buf[1024];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0) msg.append(buf, static_cast<std::size_t>(n));
  ::close(fds[0]);
  ASSERT_TRUE(finished) << "reading a FIFO blocked";
  EXPECT_LT(secs, 1.0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << msg;
  EXPECT_NE(msg.find("IDX file '" + p + "'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not a regular file"), std::string::npos) << msg;
  expect_error([&] { kg::data::read_idx(p); }, {p, "not a regular file"});
}

// The finding: dims [2^32-1, 2^32-1, 0] gave a 0-element tensor through a signed overflow in the
// element count. Every product of the non-zero dims must fit an int64, whatever the order.
TEST_F(IdxHardening, OverflowingDimsAreAnError) {
  const std::vector<std::vector<std::uint32_t>> bad = {
      {0xFFFFFFFFu, 0xFFFFFFFFu, 0},
      {0, 0xFFFFFFFFu, 0xFFFFFFFFu},
      {0xFFFFFFFFu, 0, 0xFFFFFFFFu},
      {0x80000000u, 0x80000000u, 2, 0},  // 2^63: one past int64
  };
  for (std::size_t i = 0; i < bad.size(); ++i) {
    SCOPED_TRACE(i);
    const std::string p = path("bad" + std::to_string(i) + ".idx");
    write_plain(p, idx_bytes(0x08, bad[i], {}));
    expect_error([&] { kg::data::read_idx(p); }, {"IDX file '" + p + "'", "absurd dims", "the sizes overflow"});
  }
  // A zero dim with sizes that do fit reads as an empty tensor.
  const std::string p = path("empty.idx");
  write_plain(p, idx_bytes(0x0D, {0, 0xFFFFFFFFu, 7}, {}));
  kg::Tensor t = kg::data::read_idx(p);
  EXPECT_EQ(t.shape(), (std::vector<std::int64_t>{0, 0xFFFFFFFFll, 7}));
  EXPECT_EQ(t.numel(), 0);
}

}  // namespace
