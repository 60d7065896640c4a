// One rank of a data-parallel training benchmark; scripts/bench-data-parallel starts the ranks
// (mpirun on the cpu, one process per GPU with a file rendezvous) and compares the runs.
//
//   data_parallel [--model resnet18|lenet5|...] [--batch-per-rank 256] [--check-steps 3]
//                 [--warmup 5] [--runs 20] [--device cpu|cuda] [--threads N] [--bucket-mb 25]
//                 [--output FILE] [--plain]
//
// The job is kg::ProcessGroup::join()'s. The global batch is batch-per-rank × ranks; batch k of
// the job is synthetic, the same on every rank (uniform in [-1, 1) and labels from a generator
// seeded with k), and rank r trains on its rows [r·B, (r+1)·B). The model is the zoo's followed by
// kg::cross_entropy, lowered for training, with the default initialisation (seed 0) and SGD
// (lr 0.01, momentum 0.9). --plain loads without a process group (one process, the reference).
//
// First --check-steps steps from that start; rank 0 writes the parameters after them to
// --output (safetensors) and prints "check_steps=<k> last_loss=<l>" (its share's loss). Then
// --warmup and --runs timed steps (a host clock around zero_grad, forward on device-resident
// inputs, backward, step and a device synchronisation); rank 0 prints
// "ranks=<n> transport=<t> device=<d> batch_per_rank=<b> global_batch=<g> median_ms=<m> images_per_s=<x>".
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "kg/cuda.hpp"
#include "kg/io.hpp"
#include "kg/kg.hpp"
#include "kg/models.hpp"

namespace {

struct Args {
  std::string model = "resnet18", device = "cuda", output;
  std::int64_t batch = 256;
  int check_steps = 3, warmup = 5, runs = 20, threads = 0;
  double bucket_mb = 25;
  bool plain = false;  // no process group: the reference run
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "data_parallel: %s\nusage: data_parallel [--model M] [--batch-per-rank B] [--check-steps K] "
               "[--warmup W] [--runs R] [--device cpu|cuda] [--threads N] [--bucket-mb X] [--output FILE] [--plain]\n",
               why.c_str());
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") usage("one rank of a data-parallel training benchmark");
    if (flag == "--plain") {
      a.plain = true;
      continue;
    }
    if (i + 1 >= argc) usage(flag + " needs a value");
    const std::string v = argv[++i];
    if (flag == "--model") a.model = v;
    else if (flag == "--device") a.device = v;
    else if (flag == "--output") a.output = v;
    else if (flag == "--batch-per-rank") a.batch = kg_bench::parse_int(flag, v, 1, usage);
    else if (flag == "--check-steps") a.check_steps = static_cast<int>(kg_bench::parse_int(flag, v, 0, usage));
    else if (flag == "--warmup") a.warmup = static_cast<int>(kg_bench::parse_int(flag, v, 0, usage));
    else if (flag == "--runs") a.runs = static_cast<int>(kg_bench::parse_int(flag, v, 1, usage));
    else if (flag == "--threads") a.threads = static_cast<int>(kg_bench::parse_int(flag, v, 0, usage));
    else if (flag == "--bucket-mb") a.bucket_mb = kg_bench::parse_double(flag, v, usage);
    else usage("unknown option " + flag);
  }
  if (a.device != "cpu" && a.device != "cuda") usage("--device is cpu or cuda");
  return a;
}

// Rows [rank·b, (rank+1)·b) of global batch k.
struct Shard {
  kg::Tensor input, labels;
};
Shard make_shard(const std::vector<std::int64_t>& sample, std::int64_t b, int rank, int ranks, int k,
                 std::int64_t classes) {
  std::mt19937_64 rng(0x5eed0000u + static_cast<std::uint64_t>(k));
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::uniform_int_distribution<std::int64_t> c(0, classes - 1);
  std::int64_t per_row = 1;
  for (std::size_t d = 1; d < sample.size(); ++d) per_row *= sample[d];
  std::vector<std::int64_t> shape = sample;
  shape[0] = b;
  Shard s{kg::Tensor::empty(kg::DType::F32, shape), kg::Tensor::empty(kg::DType::I64, {b})};
  for (int r = 0; r < ranks; ++r)
    for (std::int64_t i = 0; i < b; ++i) {  // every rank draws the whole batch, keeps its rows
      const bool mine = r == rank;
      for (std::int64_t j = 0; j < per_row; ++j) {
        const float v = u(rng);
        if (mine) s.input.data<float>()[i * per_row + j] = v;
      }
      const std::int64_t l = c(rng);
      if (mine) s.labels.data<std::int64_t>()[i] = l;
    }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  try {
    const auto group = a.plain ? kg::ProcessGroup::single() : kg::ProcessGroup::join();
    const int rank = group->rank(), ranks = group->size();
    const bool cuda = a.device == "cuda";
    const kg::Device device = cuda ? kg::Device::cuda(group->local_rank()) : kg::Device::cpu();
    const std::vector<std::int64_t> sample = kg::models::input_shape(a.model, a.batch);
    std::vector<kg::Dim> dims{kg::Dim::named("batch")};
    for (std::size_t d = 1; d < sample.size(); ++d) dims.emplace_back(sample[d]);
    auto [x, graph] = kg::SymTensor::input(kg::DType::F32, kg::Shape(std::move(dims)), "input");
    kg::SymTensor labels = graph->input(kg::DType::I64, kg::Shape({kg::Dim::named("batch")}), "labels");
    kg::SymTensor logits = kg::models::record(a.model, x);
    kg::SymTensor loss = kg::cross_entropy(logits, labels, "loss");
    kg::Model model(graph, {{"loss", loss}}, kg::LoweringMode::Training);
    kg::LoadOptions o;
    o.threads = a.threads;
    if (!a.plain) o.process_group = group;
    o.bucket_bytes = static_cast<std::size_t>(a.bucket_mb * 1024 * 1024);
    kg::LoadedModel m = model.load(device, {sample, {a.batch}}, o);
    m.set_optimizer(kg::OptimizerOptions::sgd(0.01, 0.9));
    m.set_training(true);
    const std::int64_t classes = logits.shape().dims().back().size();

    // The check: the first steps from the shared start.
    double last_loss = 0;
    for (int k = 0; k < a.check_steps; ++k) {
      const Shard s = make_shard(sample, a.batch, rank, ranks, k, classes);
      m.zero_grad();
      last_loss = m.forward({s.input, s.labels}).at(0).item(0);
      m.backward();
      m.step();
    }
    if (rank == 0) {
      std::printf("check_steps=%d last_loss=%.6f\n", a.check_steps, last_loss);
      if (!a.output.empty()) m.save_weights(a.output);
    }

    // The timing, on one batch kept on the device.
    const Shard s = make_shard(sample, a.batch, rank, ranks, 1000, classes);
    kg::Tensor in = s.input.clone(), lab = s.labels.clone();
    kg::cuda::DeviceTensorBuffer in_dev, lab_dev;
    std::vector<kg::DeviceTensor> inputs;
    if (cuda) {
      in_dev = kg::cuda::DeviceTensorBuffer::from(in, device.index);
      lab_dev = kg::cuda::DeviceTensorBuffer::from(lab, device.index);
      inputs = {in_dev.tensor(), lab_dev.tensor()};
    } else {
      inputs = {kg_bench::host_device_tensor(in), kg_bench::host_device_tensor(lab)};
    }
    std::vector<double> ms;
    for (int k = 0; k < a.warmup + a.runs; ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      m.zero_grad();
      m.forward_device(inputs);
      m.backward();
      m.step();
      if (cuda) kg::cuda::synchronize(device.index);
      const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (k >= a.warmup) ms.push_back(t);
    }
    // Each step's time, averaged over the ranks (they wait for each other in the all-reduce, so
    // their times agree closely).
    std::vector<double> mean = ms;
    group->all_reduce_sum(mean.data(), mean.size());
    for (double& v : mean) v /= ranks;
    const kg_bench::Timing t = kg_bench::summarise(mean);
    if (rank == 0) {
      const double global = static_cast<double>(a.batch) * ranks;
      std::printf("ranks=%d transport=%s device=%s batch_per_rank=%lld global_batch=%lld median_ms=%.3f "
                  "images_per_s=%.1f\n",
                  ranks, group->transport().c_str(), a.device.c_str(), static_cast<long long>(a.batch),
                  static_cast<long long>(global), t.median, global / (t.median / 1000.0));
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "data_parallel: %s\n", e.what());
    return 1;
  }
}
