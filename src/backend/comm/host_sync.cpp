// make_host_sync: gradients in host memory averaged over MPI in buckets.
#include <algorithm>
#include <cstring>

#include "backend/comm/gradient_sync.hpp"
#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::comm {
namespace {

class HostSync final : public GradientSync {
 public:
  HostSync(Group& group, std::vector<std::vector<Tensor>>& grads, std::size_t bucket_bytes)
      : group_(group), grads_(grads), bucket_bytes_(std::max<std::size_t>(bucket_bytes, 1)) {}

  void ready(std::size_t step) override {
    if (step >= grads_.size()) throw Error(util::cat("gradient sync: plan step ", step, " has no gradients"));
    for (Tensor& g : grads_[step]) {
      if (!g.raw()) continue;
      if (!open_.members.empty() && open_.dtype != g.dtype()) launch();
      open_.dtype = g.dtype();
      open_.members.push_back(&g);
      open_.bytes += g.nbytes();
      if (open_.bytes >= bucket_bytes_) launch();
    }
    // Lets MPI move the buckets already started while this backward goes on.
    for (auto& b : started_)
      if (b.request) b.request->test();
  }

  void finish() override {
    if (!open_.members.empty()) launch();
    const double n = group_.size();
    for (auto& b : started_) {
      if (b.request) b.request->wait();
      std::size_t at = 0;
      for (Tensor* g : b.members) {
        std::memcpy(g->raw(), b.flat.data() + at, g->nbytes());
        at += g->nbytes();
        if (g->dtype() == DType::F32) {
          auto* p = g->data<float>();
          for (std::int64_t i = 0, e = g->numel(); i < e; ++i) p[i] = static_cast<float>(p[i] / n);
        } else {
          auto* p = g->data<double>();
          for (std::int64_t i = 0, e = g->numel(); i < e; ++i) p[i] /= n;
        }
      }
    }
    // The flat buffers are kept for the next backward, which fills its buckets the same way.
    for (auto& b : started_) spare_.push_back(std::move(b.flat));
    started_.clear();
  }

 private:
  struct Bucket {
    DType dtype = DType::F32;
    std::vector<Tensor*> members;
    std::size_t bytes = 0;
    std::vector<std::byte> flat;
    std::unique_ptr<Request> request;
  };

  void launch() {
    Bucket b = std::move(open_);
    open_ = Bucket{};
    if (b.dtype != DType::F32 && b.dtype != DType::F64)
      throw Error(util::cat("data-parallel training averages f32 and f64 gradients; a parameter's is ",
                            dtype_name(b.dtype)));
    if (!spare_.empty()) {
      b.flat = std::move(spare_.back());
      spare_.pop_back();
    }
    b.flat.resize(b.bytes);
    std::size_t at = 0;
    for (Tensor* g : b.members) {
      std::memcpy(b.flat.data() + at, g->raw(), g->nbytes());
      at += g->nbytes();
    }
    b.request = group_.start_all_reduce_sum(b.flat.data(), b.bytes / dtype_size(b.dtype), b.dtype);
    started_.push_back(std::move(b));
  }

  Group& group_;
  std::vector<std::vector<Tensor>>& grads_;
  std::size_t bucket_bytes_;
  Bucket open_;
  std::vector<Bucket> started_;
  std::vector<std::vector<std::byte>> spare_;
};

}  // namespace

std::unique_ptr<GradientSync> make_host_sync(Group& group, std::vector<std::vector<Tensor>>& grads,
                                             std::size_t bucket_bytes) {
  return std::make_unique<HostSync>(group, grads, bucket_bytes);
}

}  // namespace kg::comm
