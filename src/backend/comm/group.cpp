// kg::ProcessGroup: which transport a process's environment names, the group of one, and the
// public methods over kg::comm::Group.
#include "backend/comm/group.hpp"

#include <charconv>
#include <cstdlib>
#include <string_view>

#include "kg/distributed.hpp"
#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::comm {
namespace {

class SingleGroup final : public Group {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  int local_rank() const override { return 0; }
  const char* transport() const override { return "single"; }
  void broadcast(void*, std::size_t, int root) override {
    if (root != 0) throw Error(util::cat("broadcast from rank ", root, " in a group of one"));
  }
  void all_reduce_sum(double*, std::size_t) override {}
  void barrier() override {}
  std::unique_ptr<Request> start_all_reduce_sum(void*, std::size_t, DType) override { return nullptr; }
};

// An environment variable that must be a whole number in [lo, hi].
int env_int(const char* name, int lo, int hi) {
  const char* v = std::getenv(name);
  if (!v) throw Error(util::cat("distributed: ", name, " is not set (KG_WORLD_SIZE is; the launcher sets both)"));
  const std::string_view s(v);
  int out = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  if (s.empty() || ec != std::errc() || ptr != s.data() + s.size() || out < lo || out > hi)
    throw Error(util::cat("distributed: ", name, "='", s, "' is not a whole number from ", lo, " to ", hi));
  return out;
}

}  // namespace

std::shared_ptr<Group> make_single() { return std::make_shared<SingleGroup>(); }

std::shared_ptr<Group> join_from_environment() {
  if (std::getenv("OMPI_COMM_WORLD_SIZE")) return make_mpi();
  if (std::getenv("KG_WORLD_SIZE")) {
    const int size = env_int("KG_WORLD_SIZE", 1, 1 << 20);
    const int rank = env_int("KG_RANK", 0, size - 1);
    const int local = std::getenv("KG_LOCAL_RANK") ? env_int("KG_LOCAL_RANK", 0, size - 1) : rank;
    const char* dir = std::getenv("KG_RENDEZVOUS");
    if (!dir || !*dir)
      throw Error("distributed: KG_WORLD_SIZE is set but KG_RENDEZVOUS (the folder the ranks share) is not");
    double timeout = 600;
    if (std::getenv("KG_RENDEZVOUS_TIMEOUT")) timeout = env_int("KG_RENDEZVOUS_TIMEOUT", 1, 1 << 30);
    return make_rendezvous(dir, rank, size, local, timeout);
  }
  return make_single();
}

}  // namespace kg::comm

namespace kg {

ProcessGroup::ProcessGroup(std::shared_ptr<comm::Group> impl) : impl_(std::move(impl)) {
  if (!impl_) throw Error("ProcessGroup: no transport");
}
std::shared_ptr<ProcessGroup> ProcessGroup::join() {
  return std::make_shared<ProcessGroup>(comm::join_from_environment());
}
std::shared_ptr<ProcessGroup> ProcessGroup::single() { return std::make_shared<ProcessGroup>(comm::make_single()); }
int ProcessGroup::rank() const { return impl_->rank(); }
int ProcessGroup::size() const { return impl_->size(); }
int ProcessGroup::local_rank() const { return impl_->local_rank(); }
std::string ProcessGroup::transport() const { return impl_->transport(); }
void ProcessGroup::broadcast(void* data, std::size_t bytes, int root) { impl_->broadcast(data, bytes, root); }
void ProcessGroup::all_reduce_sum(double* data, std::size_t n) { impl_->all_reduce_sum(data, n); }
void ProcessGroup::barrier() { impl_->barrier(); }

}  // namespace kg
