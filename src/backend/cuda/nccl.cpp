#ifdef KG_HAVE_CUDA
// make_nccl_sync: one NCCL communicator per synced model; each full bucket of gradients is
// all-reduced (ncclAvg, in place, as one NCCL group) on a stream of its own that waits for the
// backward's stream up to that point, so the transfer of early buckets overlaps the rest of the
// backward; finish() makes the backward's stream wait for the last transfer.
#include "backend/cuda/nccl.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "backend/cuda/driver.hpp"
#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::cuda {
namespace {

// The part of nccl.h used here (NCCL 2.10 or newer, for ncclAvg).
using NcclComm = void*;
using NcclResult = int;
struct NcclUniqueId {
  char internal[128];
};
constexpr int kNcclFloat32 = 7, kNcclFloat64 = 8, kNcclAvg = 4;

struct NcclApi {
  NcclResult (*ncclGetVersion)(int*);
  NcclResult (*ncclGetUniqueId)(NcclUniqueId*);
  NcclResult (*ncclCommInitRank)(NcclComm*, int, NcclUniqueId, int);
  NcclResult (*ncclCommDestroy)(NcclComm);
  NcclResult (*ncclCommGetAsyncError)(NcclComm, NcclResult*);
  NcclResult (*ncclAllReduce)(const void*, void*, std::size_t, int, int, NcclComm, CUstream);
  NcclResult (*ncclGroupStart)();
  NcclResult (*ncclGroupEnd)();
  const char* (*ncclGetErrorString)(NcclResult);
};

const NcclApi& nccl() {
  static const NcclApi a = [] {
    void* lib = ::dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    const char* err = lib ? nullptr : ::dlerror();
    const std::string why = err ? err : "?";
    if (!lib) lib = ::dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib)
      throw Error(util::cat("NCCL: libnccl.so.2 could not be opened (", why,
                            "); it comes with the CUDA toolkit (put its lib folder on LD_LIBRARY_PATH)"));
    NcclApi f{};
#define KG_RESOLVE(name)                                             \
  f.name = reinterpret_cast<decltype(f.name)>(::dlsym(lib, #name)); \
  if (!f.name) throw Error("NCCL: libnccl lacks " #name);
    KG_RESOLVE(ncclGetVersion)
    KG_RESOLVE(ncclGetUniqueId)
    KG_RESOLVE(ncclCommInitRank)
    KG_RESOLVE(ncclCommDestroy)
    KG_RESOLVE(ncclCommGetAsyncError)
    KG_RESOLVE(ncclAllReduce)
    KG_RESOLVE(ncclGroupStart)
    KG_RESOLVE(ncclGroupEnd)
    KG_RESOLVE(ncclGetErrorString)
#undef KG_RESOLVE
    int version = 0;
    f.ncclGetVersion(&version);
    if (version < 21000)
      throw Error(util::cat("NCCL: version ", version, " is too old (2.10 or newer is needed, for ncclAvg)"));
    return f;
  }();
  return a;
}

void check(NcclResult r, const std::string& what) {
  if (r != 0) throw Error(util::cat("NCCL: ", what, " failed: ", nccl().ncclGetErrorString(r), " (", r, ")"));
}

class NcclSync final : public comm::GradientSync {
 public:
  NcclSync(Context& ctx, comm::Group& group, std::vector<std::vector<DeviceTensor>> grads, std::size_t bucket)
      : ctx_(ctx), d_(ctx.driver()), grads_(std::move(grads)), bucket_bytes_(std::max<std::size_t>(bucket, 1)) {
    const NcclApi& n = nccl();
    ::setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
    NcclUniqueId id{};
    if (group.rank() == 0) check(n.ncclGetUniqueId(&id), "ncclGetUniqueId");
    group.broadcast(&id, sizeof id, 0);
    ctx_.make_current();
    check(n.ncclCommInitRank(&comm_, group.size(), id, group.rank()),
          util::cat("ncclCommInitRank (rank ", group.rank(), " of ", group.size(), ")"));
    d_.check(d_.cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate (NCCL)");
    d_.check(d_.cuEventCreate(&ready_, CU_EVENT_DISABLE_TIMING), "cuEventCreate (NCCL)");
    d_.check(d_.cuEventCreate(&done_, CU_EVENT_DISABLE_TIMING), "cuEventCreate (NCCL)");
  }
  ~NcclSync() override {
    ctx_.make_current();
    if (stream_) d_.cuStreamSynchronize(stream_);
    if (comm_) nccl().ncclCommDestroy(comm_);
    if (ready_) d_.cuEventDestroy(ready_);
    if (done_) d_.cuEventDestroy(done_);
    if (stream_) d_.cuStreamDestroy(stream_);
  }
  void ready(std::size_t step) override {
    if (step >= grads_.size()) throw Error(util::cat("gradient sync: plan step ", step, " has no gradients"));
    for (const DeviceTensor& g : grads_[step]) {
      if (!g.ptr) continue;
      if (g.dtype != DType::F32 && g.dtype != DType::F64)
        throw Error(util::cat("data-parallel training averages f32 and f64 gradients; a parameter's is ",
                              dtype_name(g.dtype)));
      open_.push_back(&g);
      open_bytes_ += static_cast<std::size_t>(g.numel()) * dtype_size(g.dtype);
      if (open_bytes_ >= bucket_bytes_) launch();
    }
  }
  void finish() override {
    launch();
    d_.check(d_.cuEventRecord(done_, stream_), "cuEventRecord (NCCL)");
    d_.check(d_.cuStreamWaitEvent(ctx_.stream(), done_, 0), "cuStreamWaitEvent (NCCL)");
    NcclResult async = 0;
    check(nccl().ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError");
    check(async, "a gradient all-reduce");
  }

 private:
  void launch() {
    if (open_.empty()) return;
    const NcclApi& n = nccl();
    d_.check(d_.cuEventRecord(ready_, ctx_.stream()), "cuEventRecord (NCCL)");
    d_.check(d_.cuStreamWaitEvent(stream_, ready_, 0), "cuStreamWaitEvent (NCCL)");
    check(n.ncclGroupStart(), "ncclGroupStart");
    for (const DeviceTensor* g : open_) {
      void* p = reinterpret_cast<void*>(static_cast<std::uintptr_t>(g->ptr));
      const NcclResult r = n.ncclAllReduce(p, p, static_cast<std::size_t>(g->numel()),
                                           g->dtype == DType::F32 ? kNcclFloat32 : kNcclFloat64, kNcclAvg,
                                           comm_, stream_);
      if (r != 0) {
        n.ncclGroupEnd();
        check(r, util::cat("ncclAllReduce of a gradient of ", g->numel(), " elements"));
      }
    }
    check(n.ncclGroupEnd(), util::cat("ncclGroupEnd (a bucket of ", open_.size(), " gradients, ", open_bytes_,
                                      " bytes)"));
    open_.clear();
    open_bytes_ = 0;
  }

  Context& ctx_;
  const Driver& d_;
  std::vector<std::vector<DeviceTensor>> grads_;
  std::size_t bucket_bytes_;
  std::vector<const DeviceTensor*> open_;
  std::size_t open_bytes_ = 0;
  NcclComm comm_ = nullptr;
  CUstream stream_ = nullptr;
  CUevent ready_ = nullptr, done_ = nullptr;
};

}  // namespace

std::unique_ptr<comm::GradientSync> make_nccl_sync(Context& ctx, comm::Group& group,
                                                   std::vector<std::vector<DeviceTensor>> grads,
                                                   std::size_t bucket_bytes) {
  return std::make_unique<NcclSync>(ctx, group, std::move(grads), bucket_bytes);
}

}  // namespace kg::cuda
#endif  // KG_HAVE_CUDA
