// The transports behind kg::ProcessGroup: MPI (OpenMPI opened with dlopen), a file rendezvous
// (the ranks `kgraph train --nproc` starts for GPUs; enough to agree on a NCCL id) and a group of
// one. Each gives small host collectives; MPI also all-reduces host gradients.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "kg/dtype.hpp"

namespace kg::comm {

// A host all-reduce in flight.
class Request {
 public:
  virtual ~Request() = default;
  // Lets the transport make progress; true once the result is in place.
  virtual bool test() = 0;
  // Returns when the result is in place.
  virtual void wait() = 0;
};

class Group {
 public:
  virtual ~Group() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual int local_rank() const = 0;
  virtual const char* transport() const = 0;
  virtual void broadcast(void* data, std::size_t bytes, int root) = 0;
  virtual void all_reduce_sum(double* data, std::size_t n) = 0;
  virtual void barrier() = 0;
  // Starts summing `count` elements of `dtype` (F32 or F64) at `data` over the ranks, in place.
  // The rendezvous cannot (it carries small messages only) and throws for more than one rank.
  virtual std::unique_ptr<Request> start_all_reduce_sum(void* data, std::size_t count, DType dtype) = 0;
};

// The group of the job this process was started in (kg::ProcessGroup::join).
std::shared_ptr<Group> join_from_environment();
std::shared_ptr<Group> make_single();
// Over OpenMPI's libmpi (initialised here unless the program did it already; finalised when the
// last group goes).
std::shared_ptr<Group> make_mpi();
// Over files in `dir`: `rank` of `size`, giving up on a missing rank after `timeout_s` seconds.
std::shared_ptr<Group> make_rendezvous(const std::string& dir, int rank, int size, int local_rank,
                                       double timeout_s);

}  // namespace kg::comm
