// kg::comm over files in a folder every rank sees: each collective is one exchange in which
// every rank publishes its bytes as "<generation>.<rank>" (written aside, then renamed, so a
// reader never sees half a file) and reads everybody's. Enough for small messages: a NCCL
// unique id, a barrier, a loss to average. Gradients go over NCCL, never through here.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "backend/comm/group.hpp"
#include "kg/error.hpp"
#include "util/file.hpp"
#include "util/str.hpp"

namespace kg::comm {
namespace {

namespace fs = std::filesystem;

// The largest message a rank reads from another: the collectives here carry ids, flags and a few
// numbers (gradients go over NCCL or MPI).
constexpr std::uint64_t kMaxMessageBytes = std::uint64_t(64) << 20;

class RendezvousGroup final : public Group {
 public:
  RendezvousGroup(std::string dir, int rank, int size, int local_rank, double timeout_s)
      : dir_(std::move(dir)), rank_(rank), size_(size), local_rank_(local_rank), timeout_s_(timeout_s) {
    std::error_code ec;
    if (!fs::is_directory(dir_, ec))
      throw Error(util::cat("rendezvous: the folder '", dir_, "' (KG_RENDEZVOUS) does not exist"));
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  const char* transport() const override { return "rendezvous"; }

  void broadcast(void* data, std::size_t bytes, int root) override {
    check_root(root);
    const std::string mine = rank_ == root ? std::string(static_cast<const char*>(data), bytes) : std::string();
    const std::vector<std::string> all = exchange(mine, "broadcast");
    if (all[static_cast<std::size_t>(root)].size() != bytes)
      throw Error(util::cat("rendezvous: broadcast of ", bytes, " bytes, but rank ", root, " sent ",
                            all[static_cast<std::size_t>(root)].size()));
    if (rank_ != root) std::copy(all[static_cast<std::size_t>(root)].begin(), all[static_cast<std::size_t>(root)].end(),
                                 static_cast<char*>(data));
  }
  void all_reduce_sum(double* data, std::size_t n) override {
    const std::vector<std::string> all =
        exchange(std::string(reinterpret_cast<const char*>(data), n * sizeof(double)), "all-reduce");
    std::vector<double> sum(n, 0.0);
    for (int r = 0; r < size_; ++r) {  // in rank order: every rank gets the same bits
      const std::string& s = all[static_cast<std::size_t>(r)];
      if (s.size() != n * sizeof(double))
        throw Error(util::cat("rendezvous: all-reduce of ", n, " values, but rank ", r, " sent ",
                              s.size() / sizeof(double)));
      for (std::size_t i = 0; i < n; ++i) {
        double v;
        std::memcpy(&v, s.data() + i * sizeof(double), sizeof v);
        sum[i] += v;
      }
    }
    std::copy(sum.begin(), sum.end(), data);
  }
  void barrier() override { exchange({}, "barrier"); }
  std::unique_ptr<Request> start_all_reduce_sum(void*, std::size_t, DType) override {
    if (size_ == 1) return nullptr;  // the sum over one rank is the data
    throw Error(
        "data-parallel training with gradients in host memory (the cpu) averages them over MPI; start the "
        "ranks with mpirun (kgraph train --nproc does so when OpenMPI's mpirun is installed)");
  }

 private:
  std::string path(std::uint64_t gen, int rank) const { return util::cat(dir_, "/", gen, ".", rank); }
  void check_root(int root) const {
    if (root < 0 || root >= size_)
      throw Error(util::cat("rendezvous: root rank ", root, " is not one of the ", size_, " ranks"));
  }

  std::vector<std::string> exchange(const std::string& mine, const char* what) {
    const std::uint64_t gen = gen_++;
    const std::string final_path = path(gen, rank_), tmp = util::cat(final_path, ".part.", ::getpid());
    {
      // Created new (O_EXCL | O_NOFOLLOW): a file or link planted at the name is never written through.
      ::unlink(tmp.c_str());
      const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
      if (fd < 0) throw Error(util::cat("rendezvous: cannot write '", tmp, "': ", std::strerror(errno)));
      bool ok = true;
      for (std::size_t done = 0; ok && done < mine.size();) {
        const ssize_t n = ::write(fd, mine.data() + done, mine.size() - done);
        if (n < 0 && errno == EINTR) continue;
        ok = n > 0;
        if (ok) done += static_cast<std::size_t>(n);
      }
      ok = ::close(fd) == 0 && ok;
      if (!ok) {
        ::unlink(tmp.c_str());
        throw Error(util::cat("rendezvous: cannot write '", tmp, "'"));
      }
    }
    std::error_code ec;
    fs::rename(tmp, final_path, ec);
    if (ec) throw Error(util::cat("rendezvous: cannot publish '", final_path, "': ", ec.message()));
    std::vector<std::string> all(static_cast<std::size_t>(size_));
    std::vector<char> have(static_cast<std::size_t>(size_), 0);
    const auto t0 = std::chrono::steady_clock::now();
    auto wait = std::chrono::microseconds(50);
    for (int left = size_;;) {
      for (int r = 0; r < size_; ++r) {
        if (have[static_cast<std::size_t>(r)]) continue;
        // A regular file no larger than any message, never followed if a link, never blocking on
        // a FIFO: anything else in its place is an error, not a wait.
        const std::string p = path(gen, r);
        std::string why;
        const util::ReadLimits limits{kMaxMessageBytes, /*follow_links=*/false};
        std::string& dst = all[static_cast<std::size_t>(r)];
        if (!util::try_read_file(p, limits, dst, &why)) {
          struct stat st {};
          if (::lstat(p.c_str(), &st) != 0 && errno == ENOENT) continue;  // not published yet
          if (!util::try_read_file(p, limits, dst, &why))  // published since the first try, or not a message
            throw Error(util::cat("rendezvous: rank ", rank_, " cannot read rank ", r, "'s message '", p, "' in ",
                                what, " #", gen, ": it ", why));
        }
        have[static_cast<std::size_t>(r)] = 1;
        --left;
      }
      if (left == 0) break;
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > timeout_s_) {
        std::string missing;
        for (int r = 0; r < size_; ++r)
          if (!have[static_cast<std::size_t>(r)]) missing += util::cat(missing.empty() ? "" : ", ", r);
        throw Error(util::cat("rendezvous: rank ", rank_, " waited ", timeout_s_, " s in ", what, " #", gen,
                              " for rank(s) ", missing, " (in '", dir_, "'); a rank failed or was not started"));
      }
      std::this_thread::sleep_for(wait);
      wait = std::min(wait * 2, std::chrono::microseconds(20000));
    }
    // Everyone published gen, so everyone has read gen - 1 and before. The last generation's files
    // stay for the slowest reader; the job's launcher removes the folder.
    if (gen >= 1) fs::remove(path(gen - 1, rank_), ec);
    return all;
  }

  std::string dir_;
  int rank_, size_, local_rank_;
  double timeout_s_;
  std::uint64_t gen_ = 0;
};

}  // namespace

std::shared_ptr<Group> make_rendezvous(const std::string& dir, int rank, int size, int local_rank,
                                       double timeout_s) {
  if (size < 1 || rank < 0 || rank >= size)
    throw Error(util::cat("rendezvous: rank ", rank, " of ", size, " ranks (expected 0 <= rank < size)"));
  return std::make_shared<RendezvousGroup>(dir, rank, size, local_rank, timeout_s);
}

}  // namespace kg::comm
