// kg::comm over MPI. OpenMPI's libmpi is opened with dlopen at first use (no MPI headers or
// link at build time), so one binary runs with or without it. OpenMPI's handles are the addresses
// of predefined objects (MPI_COMM_WORLD is &ompi_mpi_comm_world), which dlsym gives; a libmpi
// without them (MPICH's integer handles) is refused by name.
#include <dlfcn.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "backend/comm/group.hpp"
#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::comm {
namespace {

using Handle = void*;  // MPI_Comm, MPI_Datatype, MPI_Op, MPI_Errhandler, MPI_Request in OpenMPI
constexpr int kSuccess = 0;
constexpr int kThreadFunneled = 1;  // MPI_THREAD_FUNNELED
void* const kInPlace = reinterpret_cast<void*>(1);  // MPI_IN_PLACE
constexpr std::size_t kMaxCount = 1u << 30;         // elements per call (MPI counts are int)

struct Api {
  int (*MPI_Initialized)(int*);
  int (*MPI_Finalized)(int*);
  int (*MPI_Init_thread)(int*, char***, int, int*);
  int (*MPI_Finalize)();
  int (*MPI_Comm_rank)(Handle, int*);
  int (*MPI_Comm_size)(Handle, int*);
  int (*MPI_Comm_set_errhandler)(Handle, Handle);
  int (*MPI_Bcast)(void*, int, Handle, int, Handle);
  int (*MPI_Allreduce)(const void*, void*, int, Handle, Handle, Handle);
  int (*MPI_Iallreduce)(const void*, void*, int, Handle, Handle, Handle, Handle*);
  int (*MPI_Wait)(Handle*, void*);
  int (*MPI_Test)(Handle*, int*, void*);
  int (*MPI_Barrier)(Handle);
  int (*MPI_Error_string)(int, char*, int*);
  Handle comm_world, byte, f32, f64, sum, errors_return;
};

#define KG_MPI_FUNCTIONS(X)                                                                              \
  X(MPI_Initialized) X(MPI_Finalized) X(MPI_Init_thread) X(MPI_Finalize) X(MPI_Comm_rank) X(MPI_Comm_size) \
  X(MPI_Comm_set_errhandler) X(MPI_Bcast) X(MPI_Allreduce) X(MPI_Iallreduce) X(MPI_Wait) X(MPI_Test)      \
  X(MPI_Barrier) X(MPI_Error_string)

const Api& api() {
  static const Api a = [] {
    void* lib = nullptr;
    std::string why;
    for (const char* name : {"libmpi.so.40", "libmpi.so"}) {
      // Global: OpenMPI's plugins, opened by libmpi in turn, resolve its symbols.
      lib = ::dlopen(name, RTLD_NOW | RTLD_GLOBAL);
      if (lib) break;
      if (why.empty()) why = ::dlerror();
    }
    if (!lib)
      throw Error(util::cat("MPI: OpenMPI's libmpi could not be opened (", why,
                            "); install it (Debian: apt install openmpi-bin)"));
    Api f{};
#define KG_RESOLVE(name)                                                                   \
  f.name = reinterpret_cast<decltype(f.name)>(::dlsym(lib, #name));                        \
  if (!f.name) throw Error("MPI: libmpi lacks " #name);
    KG_MPI_FUNCTIONS(KG_RESOLVE)
#undef KG_RESOLVE
    const std::pair<Handle*, const char*> handles[] = {
        {&f.comm_world, "ompi_mpi_comm_world"}, {&f.byte, "ompi_mpi_byte"},
        {&f.f32, "ompi_mpi_float"},             {&f.f64, "ompi_mpi_double"},
        {&f.sum, "ompi_mpi_op_sum"},            {&f.errors_return, "ompi_mpi_errors_return"}};
    for (const auto& [h, name] : handles) {
      *h = ::dlsym(lib, name);
      if (!*h)
        throw Error(util::cat("MPI: the libmpi found has no '", name,
                              "'; kernelgraph speaks OpenMPI's interface (Debian's openmpi-bin)"));
    }
    return f;
  }();
  return a;
}

void check(int rc, const char* what) {
  if (rc == kSuccess) return;
  char text[512] = {};
  int len = 0;
  if (api().MPI_Error_string(rc, text, &len) != kSuccess) len = 0;
  throw Error(util::cat("MPI: ", what, " failed: ", std::string(text, static_cast<std::size_t>(std::max(len, 0))),
                        " (error ", rc, ")"));
}

Handle mpi_type(DType t) {
  if (t == DType::F32) return api().f32;
  if (t == DType::F64) return api().f64;
  throw Error(util::cat("MPI: all-reduce of ", dtype_name(t), " data (only f32 and f64 gradients are summed)"));
}

// Several requests when the count is over an int's reach.
class MpiRequest final : public Request {
 public:
  explicit MpiRequest(std::vector<Handle> r) : r_(std::move(r)) {}
  ~MpiRequest() override {
    try {
      wait();
    } catch (...) {  // a destructor does not throw; the error was the waiter's to see
    }
  }
  bool test() override {
    bool all = true;
    for (Handle& h : r_) {
      if (!h) continue;
      int done = 0;
      check(api().MPI_Test(&h, &done, nullptr), "MPI_Test");
      if (done) h = nullptr;  // MPI_REQUEST_NULL is not needed again
      all = all && done;
    }
    return all;
  }
  void wait() override {
    for (Handle& h : r_) {
      if (!h) continue;
      Handle mine = h;
      h = nullptr;
      check(api().MPI_Wait(&mine, nullptr), "MPI_Wait (gradient all-reduce)");
    }
  }

 private:
  std::vector<Handle> r_;
};

class MpiGroup final : public Group {
 public:
  MpiGroup() {
    const Api& a = api();
    int inited = 0, finalized = 0;
    check(a.MPI_Finalized(&finalized), "MPI_Finalized");
    if (finalized) throw Error("MPI: MPI_Finalize has already run in this process");
    check(a.MPI_Initialized(&inited), "MPI_Initialized");
    if (!inited) {
      int provided = 0;
      check(a.MPI_Init_thread(nullptr, nullptr, kThreadFunneled, &provided), "MPI_Init_thread");
      owns_ = true;
    }
    // Errors come back as codes (and then as kg::Error), not as an abort of the job.
    check(a.MPI_Comm_set_errhandler(a.comm_world, a.errors_return), "MPI_Comm_set_errhandler");
    check(a.MPI_Comm_rank(a.comm_world, &rank_), "MPI_Comm_rank");
    check(a.MPI_Comm_size(a.comm_world, &size_), "MPI_Comm_size");
    local_rank_ = rank_;
    if (const char* l = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")) local_rank_ = std::atoi(l);
  }
  ~MpiGroup() override {
    int finalized = 1;
    if (owns_ && api().MPI_Finalized(&finalized) == kSuccess && !finalized) api().MPI_Finalize();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  const char* transport() const override { return "mpi"; }
  void broadcast(void* data, std::size_t bytes, int root) override {
    auto* p = static_cast<char*>(data);
    for (std::size_t done = 0; done < bytes;) {
      const std::size_t n = std::min(bytes - done, kMaxCount);
      check(api().MPI_Bcast(p + done, static_cast<int>(n), api().byte, root, api().comm_world), "MPI_Bcast");
      done += n;
    }
  }
  void all_reduce_sum(double* data, std::size_t n) override {
    for (std::size_t done = 0; done < n;) {
      const std::size_t k = std::min(n - done, kMaxCount);
      check(api().MPI_Allreduce(kInPlace, data + done, static_cast<int>(k), api().f64, api().sum,
                                api().comm_world),
            "MPI_Allreduce");
      done += k;
    }
  }
  void barrier() override { check(api().MPI_Barrier(api().comm_world), "MPI_Barrier"); }
  std::unique_ptr<Request> start_all_reduce_sum(void* data, std::size_t count, DType dtype) override {
    const Handle t = mpi_type(dtype);
    auto* p = static_cast<char*>(data);
    std::vector<Handle> reqs;
    for (std::size_t done = 0; done < count;) {
      const std::size_t k = std::min(count - done, kMaxCount);
      Handle r = nullptr;
      check(api().MPI_Iallreduce(kInPlace, p + done * dtype_size(dtype), static_cast<int>(k), t, api().sum,
                                 api().comm_world, &r),
            "MPI_Iallreduce");
      reqs.push_back(r);
      done += k;
    }
    return std::make_unique<MpiRequest>(std::move(reqs));
  }

 private:
  bool owns_ = false;
  int rank_ = 0, size_ = 1, local_rank_ = 0;
};

}  // namespace

std::shared_ptr<Group> make_mpi() {
  // One MPI world per process: every join shares it.
  static std::mutex mu;
  static std::weak_ptr<Group> live;
  std::lock_guard<std::mutex> lock(mu);
  if (auto g = live.lock()) return g;
  auto g = std::make_shared<MpiGroup>();
  live = g;
  return g;
}

}  // namespace kg::comm
