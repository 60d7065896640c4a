// Averaging parameter gradients over the ranks of a data-parallel job during the backward: the
// backends tell a GradientSync when each plan step's gradients are final, and it starts an
// all-reduce for each bucket as soon as the bucket is full.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "backend/comm/group.hpp"
#include "kg/tensor.hpp"

namespace kg::comm {

class GradientSync {
 public:
  virtual ~GradientSync() = default;
  // The parameter gradients of plan step `step` are final (on a GPU: their work is enqueued).
  virtual void ready(std::size_t step) = 0;
  // After the backward's last step: every gradient holds its mean over the ranks (on a GPU:
  // the work that makes it so is ordered before anything enqueued later).
  virtual void finish() = 0;
};

// Host gradients (`grads[step][param]`, undefined tensors for parameters without one), flattened
// into buckets of about `bucket_bytes` in the order they become ready and summed by the group's
// all-reduce (MPI), then divided by the number of ranks.
std::unique_ptr<GradientSync> make_host_sync(Group& group, std::vector<std::vector<Tensor>>& grads,
                                             std::size_t bucket_bytes);

}  // namespace kg::comm
