// Data-parallel training: the processes of one job, one rank each (docs/distributed.md).
//
// A LoadedModel given a ProcessGroup (LoadOptions::process_group) starts from rank 0's
// parameters, and its backward() averages every parameter gradient over the ranks, in buckets
// that start while the backward still runs: MPI's all-reduce for gradients in host memory (the
// cpu), NCCL's for gradients on a GPU. Every rank then takes the same optimiser step.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace kg {

namespace comm {
class Group;
}

class ProcessGroup {
 public:
  // The job this process was started in, from its environment:
  //  - under OpenMPI's mpirun (OMPI_COMM_WORLD_SIZE set): its ranks, over MPI (libmpi is opened
  //    at run time);
  //  - started by `kgraph train --nproc` for GPUs (KG_WORLD_SIZE, KG_RANK, KG_LOCAL_RANK and
  //    KG_RENDEZVOUS, a folder all ranks share): a file rendezvous, enough for NCCL to connect;
  //  - otherwise a group of this process alone.
  // Throws when the environment names a job that cannot be joined (libmpi missing, a bad rank).
  static std::shared_ptr<ProcessGroup> join();
  // A group of this process alone.
  static std::shared_ptr<ProcessGroup> single();

  int rank() const;
  int size() const;
  // This rank's index among the ranks of its machine (which GPU it takes).
  int local_rank() const;
  // "mpi", "rendezvous" or "single".
  std::string transport() const;

  // Small host collectives; every rank makes the same calls in the same order.
  // Copies `bytes` bytes at `data` on rank `root` to `data` on every rank.
  void broadcast(void* data, std::size_t bytes, int root = 0);
  // Element-wise sums over the ranks, in place.
  void all_reduce_sum(double* data, std::size_t n);
  void barrier();

  // Over a transport of kernelgraph's (join() and single() make them; the type is internal).
  explicit ProcessGroup(std::shared_ptr<comm::Group> impl);
  // The transport, for the backends.
  comm::Group& impl() const { return *impl_; }

 private:
  std::shared_ptr<comm::Group> impl_;
};

}  // namespace kg
