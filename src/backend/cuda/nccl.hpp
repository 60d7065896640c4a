// Data-parallel gradient averaging on GPUs with NCCL, opened with dlopen at first use (libnccl.so.2
// from the CUDA toolkit). The ranks agree on a NCCL unique id through their kg::comm::Group (MPI
// or the file rendezvous); NVLink multicast stays off unless NCCL_NVLS_ENABLE says otherwise.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "backend/comm/gradient_sync.hpp"
#include "backend/cuda/context.hpp"
#include "kg/runtime_op.hpp"

namespace kg::cuda {

// `grads[step][param]`: the device gradients (ptr 0 where a parameter has none). Creating it is
// collective: every rank of `group` makes one at the same point.
std::unique_ptr<comm::GradientSync> make_nccl_sync(Context& ctx, comm::Group& group,
                                                   std::vector<std::vector<DeviceTensor>> grads,
                                                   std::size_t bucket_bytes);

}  // namespace kg::cuda
