// Times one training step of a zoo model on the GPU; scripts/bench-gpu-train runs it beside
// PyTorch eager on the same weights, batch and optimiser.
//
//   gpu_train [--model lenet5-tanh] [--batches 256,64] [--weights W.safetensors]
//             [--input-dir DIR] [--output-dir DIR] [--optimizer sgd|adamw] [--lr X]
//             [--momentum X] [--weight-decay X] [--check-steps N] [--warmup 20] [--runs 200]
//             [--check-only] [--device-time] [--seed S] [--device N] [--cpu] [--profile]
//             [--tune]
//
// The model is the zoo's (kg::models::record) followed by kg::cross_entropy against integer
// labels, lowered for training, loaded on cuda:N. One step is
//
//   zero_grad(); forward({input, labels}); backward(); step(); kg::cuda::synchronize()
//
// forward() copies the input and labels host → device and returns the loss on the host (its
// only output), which waits for the forward; the synchronize at the end waits for the backward
// and the optimiser update, so a host clock around the step measures all of it.
//
// Per batch it first runs --check-steps steps from the loaded weights and prints
// "batch=<n> check_steps=<k> first_loss=<l> last_loss=<l>"; with --output-dir the parameters
// after those steps, and the loss of each step ("losses", f64 [k]), go to
// DIR/params_b<n>.safetensors. Unless --check-only, it then continues with --warmup steps and
// --runs timed steps and prints
// "batch=<n> median_ms=<m> min_ms=<m> p90_ms=<m> runs=<r> load_ms=<m>".
//
// --device-time times the steps on the device instead (scripts/bench-gpu-models): the batch is
// uploaded once, and a step is zero_grad(); forward_device({input, labels}); backward(); step()
// with CUDA events recorded on the models' stream before and after it (kg_bench::StreamTimer;
// the wall time on the cpu); the median of those times is printed, with "timing=device" and
// "host_issue_ms=<m>" added: the median host time to issue a step, before waiting for it; a
// second line, "batch=<n> host ms (medians): zero_grad=... forward_device=... backward=...
// step=...", splits that time by call (forward_device includes the wait for the forward; the GPU
// idles through backward's share).
// Inputs come from DIR/input_b<n>.safetensors (tensors "input" f32 and "labels" i64 or i32) when
// --input-dir is given, else uniform in [-1, 1) with random labels; weights from --weights, else
// the default initialisation (seed S). --tune loads with LoadOptions::tune: every cuDNN and
// cuBLASLt algorithm of the forward and backward calls is timed at load (or read from the tuning
// cache), as PyTorch's cudnn.benchmark does. --cpu runs the same steps on the CPU instead: it checks
// the plumbing (files, parameter agreement) where there is no GPU; its times mean nothing here.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "kg/cuda.hpp"
#include "kg/io.hpp"
#include "kg/kg.hpp"
#include "kg/models.hpp"

namespace {

struct Args {
  std::string model = "lenet5-tanh";
  std::vector<std::int64_t> batches{256, 64};
  std::string weights, input_dir, output_dir;
  std::string optimizer = "sgd";
  double lr = -1, momentum = 0.9, weight_decay = -1;  // -1: the optimiser's default
  int check_steps = 10, warmup = 20, runs = 200, device = 0;
  bool check_only = false, cpu = false, profile = false, device_time = false, tune = false;
  std::uint64_t seed = 0;
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr
      << "gpu_train: " << why << "\n"
      << "usage: gpu_train [--model NAME] [--batches 256,64] [--weights PATH] [--input-dir DIR]\n"
      << "                 [--output-dir DIR] [--optimizer sgd|adamw] [--lr X] [--momentum X]\n"
      << "                 [--weight-decay X] [--check-steps N] [--warmup W] [--runs R] [--check-only]\n"
      << "                 [--device-time] [--seed S] [--device N] [--cpu] [--profile] [--tune]\n"
      << "defaults: sgd lr 0.01 momentum 0.9 weight decay 0; adamw lr 0.001 weight decay 0.01\n";
  std::exit(2);
}

long parse_int(const std::string& flag, const std::string& v, long lo) {
  return kg_bench::parse_int(flag, v, lo, usage);
}

double parse_double(const std::string& flag, const std::string& v) {
  return kg_bench::parse_double(flag, v, usage);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--check-only" || flag == "--cpu" || flag == "--profile" || flag == "--device-time" ||
        flag == "--tune") {
      (flag == "--cpu"           ? a.cpu
       : flag == "--profile"     ? a.profile
       : flag == "--device-time" ? a.device_time
       : flag == "--tune"        ? a.tune
                                 : a.check_only) = true;
      continue;
    }
    if (flag == "--help" || flag == "-h") usage("times a training step of a zoo model on the GPU");
    if (i + 1 >= argc) usage(flag + " needs a value");
    const std::string v = argv[++i];
    if (flag == "--model") {
      a.model = v;
    } else if (flag == "--batches") {
      a.batches = kg_bench::parse_batches(flag, v, usage);
    } else if (flag == "--weights") {
      a.weights = v;
    } else if (flag == "--input-dir") {
      a.input_dir = v;
    } else if (flag == "--output-dir") {
      a.output_dir = v;
    } else if (flag == "--optimizer") {
      if (v != "sgd" && v != "adamw") usage("--optimizer is sgd or adamw, got '" + v + "'");
      a.optimizer = v;
    } else if (flag == "--lr") {
      a.lr = parse_double(flag, v);
    } else if (flag == "--momentum") {
      a.momentum = parse_double(flag, v);
    } else if (flag == "--weight-decay") {
      a.weight_decay = parse_double(flag, v);
    } else if (flag == "--check-steps") {
      a.check_steps = static_cast<int>(parse_int(flag, v, 1));
    } else if (flag == "--warmup") {
      a.warmup = static_cast<int>(parse_int(flag, v, 0));
    } else if (flag == "--runs") {
      a.runs = static_cast<int>(parse_int(flag, v, 1));
    } else if (flag == "--seed") {
      a.seed = static_cast<std::uint64_t>(parse_int(flag, v, 0));
    } else if (flag == "--device") {
      a.device = static_cast<int>(parse_int(flag, v, 0));
    } else {
      usage("unknown option " + flag);
    }
  }
  return a;
}

kg::OptimizerOptions optimizer(const Args& a) {
  return kg_bench::optimizer_options(a.optimizer, a.lr, a.momentum, a.weight_decay, 1e-3);
}

// The zoo model with a mean cross-entropy loss, lowered for training; its only output is "loss".
kg::Model training_model(const std::string& name) {
  const std::vector<std::int64_t> sample = kg::models::input_shape(name, 1);
  std::vector<kg::Dim> dims{kg::Dim::named("batch")};
  for (std::size_t i = 1; i < sample.size(); ++i) dims.emplace_back(sample[i]);
  auto [x, graph] = kg::SymTensor::input(kg::DType::F32, kg::Shape(std::move(dims)), "input");
  kg::SymTensor labels = graph->input(kg::DType::I64, kg::Shape{kg::Dim::named("batch")}, "labels");
  kg::SymTensor loss = kg::cross_entropy(kg::models::record(name, x), labels, "loss");
  return kg::Model(graph, {{"loss", loss}}, kg::LoweringMode::Training);
}

struct Batch {
  kg::Tensor input, labels;
};

kg::Tensor to_i64(const kg::Tensor& t, const std::string& path) {
  if (t.dtype() == kg::DType::I64) return t.clone();
  if (t.dtype() != kg::DType::I32)
    throw kg::Error("input file '" + path + "': labels are " + std::string(kg::dtype_name(t.dtype())) +
                    ", want i64 or i32");
  kg::Tensor out = kg::Tensor::empty(kg::DType::I64, t.shape());
  for (std::int64_t i = 0; i < t.numel(); ++i) out.data<std::int64_t>()[i] = t.data<std::int32_t>()[i];
  return out;
}

Batch make_batch(const Args& a, const std::vector<std::int64_t>& shape) {
  const std::int64_t n = shape[0];
  if (!a.input_dir.empty()) {
    const std::string path = a.input_dir + "/input_b" + std::to_string(n) + ".safetensors";
    auto tensors = kg::read_safetensors(path);
    for (const char* key : {"input", "labels"})
      if (!tensors.count(key)) throw kg::Error("input file '" + path + "' has no tensor named '" + key + "'");
    Batch b{tensors.at("input").to(kg::DType::F32).clone(), to_i64(tensors.at("labels"), path)};
    if (b.input.shape() != shape)
      throw kg::Error("input file '" + path + "' holds an input " + kg::sizes_to_string(b.input.shape()) +
                      " but " + a.model + " takes " + kg::sizes_to_string(shape));
    if (b.labels.shape() != std::vector<std::int64_t>{n})
      throw kg::Error("input file '" + path + "' holds labels " + kg::sizes_to_string(b.labels.shape()) +
                      ", want [" + std::to_string(n) + "]");
    return b;
  }
  std::mt19937_64 rng(a.seed + static_cast<std::uint64_t>(n));
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::uniform_int_distribution<std::int64_t> cls(0, 9);
  Batch b{kg::Tensor::empty(kg::DType::F32, shape), kg::Tensor::empty(kg::DType::I64, {n})};
  for (std::int64_t i = 0; i < b.input.numel(); ++i) b.input.data<float>()[i] = u(rng);
  for (std::int64_t i = 0; i < n; ++i) b.labels.data<std::int64_t>()[i] = cls(rng);
  return b;
}

using kg_bench::summarise;
using kg_bench::Timing;

// One training step; returns the loss of its forward.
double train_step(kg::LoadedModel& m, const Batch& b, const kg::Device& device) {
  m.zero_grad();
  const double loss = m.forward({b.input, b.labels}).at(0).item(0);
  m.backward();
  m.step();
  if (device.kind == kg::Device::Kind::Cuda) kg::cuda::synchronize(device.index);
  return loss;
}

// The batch in device memory for forward_device: uploaded once on cuda, the host tensors on cpu.
struct DeviceBatch {
  kg::Tensor input, labels;  // cpu: the storage the DeviceTensors point at
  kg::cuda::DeviceTensorBuffer input_dev, labels_dev;
  std::vector<kg::DeviceTensor> tensors;

  DeviceBatch(const Batch& b, const kg::Device& device) : input(b.input.clone()), labels(b.labels.clone()) {
    if (device.kind == kg::Device::Kind::Cuda) {
      input_dev = kg::cuda::DeviceTensorBuffer::from(input, device.index);
      labels_dev = kg::cuda::DeviceTensorBuffer::from(labels, device.index);
      tensors = {input_dev.tensor(), labels_dev.tensor()};
    } else {
      tensors = {kg_bench::host_device_tensor(input), kg_bench::host_device_tensor(labels)};
    }
  }
};

// The host's time in each call of a device step, ms. forward_device returns when the forward is
// done on the device, so the GPU idles through backward's host time (until its launches or
// graph reach the stream).
struct HostPhases {
  double zero_grad = 0, forward = 0, backward = 0, step = 0;
  double total() const { return zero_grad + forward + backward + step; }
};

// One training step on a batch already on the device; returns its device time in ms and leaves
// the loss (on the device) in `loss`.
// `host` gets the host's time to issue each part of the step (before waiting for the device):
// when their sum is close to the device time, the host, not the GPU, sets the pace.
double device_step(kg::LoadedModel& m, const DeviceBatch& b, kg_bench::StreamTimer& timer,
                   kg::DeviceTensor& loss, HostPhases& host) {
  using clock = std::chrono::steady_clock;
  auto since = [](clock::time_point& t) {
    const auto now = clock::now();
    const double ms = std::chrono::duration<double, std::milli>(now - t).count();
    t = now;
    return ms;
  };
  timer.start();
  auto t = clock::now();
  m.zero_grad();
  host.zero_grad = since(t);
  loss = m.forward_device(b.tensors).at(0);
  host.forward = since(t);
  m.backward();
  host.backward = since(t);
  m.step();
  host.step = since(t);
  return timer.stop_ms();
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  try {
    if (!a.cpu && !kg::cuda::available()) {
      std::fprintf(stderr, "gpu_train: no GPU: %s\n", kg::cuda::unavailable_reason().c_str());
      return 1;
    }
    const kg::Device device = a.cpu ? kg::Device::cpu() : kg::Device::cuda(a.device);
    const kg::OptimizerOptions opt = optimizer(a);
    const kg::Model model = training_model(a.model);
    if (a.cpu)
      std::printf("device: cpu (--cpu: a check of the plumbing, not a GPU measurement)\n");
    else
      std::printf("device: cuda:%d %s (sm_%d)\n", a.device, kg::cuda::device_name(a.device).c_str(),
                  kg::cuda::device_arch(a.device));
    std::printf("model: %s + cross-entropy; optimiser: %s\n", a.model.c_str(), kg_bench::describe(opt).c_str());
    std::printf("weights: %s\n", a.weights.empty()
                                     ? ("default initialisation, seed " + std::to_string(a.seed)).c_str()
                                     : a.weights.c_str());
    if (a.device_time)
      std::printf(
          "timing: %s around zero_grad + forward_device (batch already on the device) + backward + step; "
          "%d check steps (forward() from the host), then %d warm-up steps, median of %d\n",
          a.cpu ? "wall clock" : "CUDA events", a.check_steps, a.check_only ? 0 : a.warmup,
          a.check_only ? 0 : a.runs);
    else
      std::printf(
          "timing: host clock around zero_grad + forward (input H2D, loss D2H) + backward + step + "
          "synchronize; %d check steps, then %d warm-up steps, median of %d\n",
          a.check_steps, a.check_only ? 0 : a.warmup, a.check_only ? 0 : a.runs);
    if (!a.output_dir.empty()) std::filesystem::create_directories(a.output_dir);
    int status = 0;
    for (std::int64_t batch : a.batches) {
      const auto shape = kg::models::input_shape(a.model, batch);
      const Batch b = make_batch(a, shape);
      kg::LoadOptions lopt;
      lopt.seed = a.seed;
      lopt.tune = a.tune;
      const auto t_load = std::chrono::steady_clock::now();
      kg::LoadedModel m = model.load(device, {shape, {batch}}, lopt);
      if (!a.weights.empty()) m.load_weights(a.weights);
      m.set_training(true);
      m.set_optimizer(opt);
      const double load_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_load).count();

      std::vector<double> losses;
      for (int i = 0; i < a.check_steps; ++i) losses.push_back(train_step(m, b, device));
      std::printf("batch=%lld check_steps=%d first_loss=%.9g last_loss=%.9g\n", static_cast<long long>(batch),
                  a.check_steps, losses.front(), losses.back());
      for (std::size_t i = 0; i < losses.size(); ++i)
        if (!std::isfinite(losses[i])) {
          std::fprintf(stderr, "gpu_train: batch %lld: the loss of step %zu is %g\n",
                       static_cast<long long>(batch), i + 1, losses[i]);
          status = 1;
          break;
        }
      if (!a.output_dir.empty()) {
        std::map<std::string, kg::Tensor> out = m.state_dict();
        out["losses"] = kg::Tensor::from_vector<double>({static_cast<std::int64_t>(losses.size())}, losses);
        kg::write_safetensors(a.output_dir + "/params_b" + std::to_string(batch) + ".safetensors", out,
                              {{"model", a.model}, {"optimizer", kg_bench::describe(opt)}});
      }
      if (a.check_only) continue;

      double last = 0;
      std::vector<double> ms;
      std::vector<HostPhases> host;
      ms.reserve(static_cast<std::size_t>(a.runs));
      if (a.device_time) {
        const DeviceBatch db(b, device);
        kg_bench::StreamTimer timer(!a.cpu, a.device);
        kg::DeviceTensor loss;
        HostPhases h;
        for (int i = 0; i < a.warmup; ++i) device_step(m, db, timer, loss, h);
        for (int i = 0; i < a.runs; ++i) {
          ms.push_back(device_step(m, db, timer, loss, h));
          host.push_back(h);
        }
        last = kg_bench::to_host(loss, !a.cpu, a.device).item(0);
      } else {
        for (int i = 0; i < a.warmup; ++i) last = train_step(m, b, device);
        for (int i = 0; i < a.runs; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          last = train_step(m, b, device);
          ms.push_back(
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        }
      }
      if (!std::isfinite(last)) {
        std::fprintf(stderr, "gpu_train: batch %lld: the loss of the last timed step is %g\n",
                     static_cast<long long>(batch), last);
        status = 1;
      }
      const Timing t = summarise(ms);
      std::printf("batch=%lld median_ms=%.4f min_ms=%.4f p90_ms=%.4f runs=%d load_ms=%.1f%s",
                  static_cast<long long>(batch), t.median, t.min, t.p90, a.runs, load_ms,
                  a.device_time ? " timing=device" : "");
      auto host_median = [&](double HostPhases::*part) {
        std::vector<double> v;
        for (const HostPhases& h : host) v.push_back(h.*part);
        return summarise(v).median;
      };
      if (!host.empty()) {
        std::vector<double> totals;
        for (const HostPhases& h : host) totals.push_back(h.total());
        std::printf(" host_issue_ms=%.4f", summarise(totals).median);
      }
      std::printf(" cuda_graph_replays=%lld", static_cast<long long>(m.cuda_graph_replays()));
      std::printf("\n");
      if (!host.empty())
        std::printf("batch=%lld host ms (medians): zero_grad=%.4f forward_device=%.4f (until the device is done) "
                    "backward=%.4f (the device idles) step=%.4f\n",
                    static_cast<long long>(batch), host_median(&HostPhases::zero_grad),
                    host_median(&HostPhases::forward), host_median(&HostPhases::backward),
                    host_median(&HostPhases::step));
      if (a.profile) {
        // One more step on a model loaded with per-node timing (each node synchronised).
        kg::LoadOptions popt = lopt;
        popt.profile = true;
        kg::LoadedModel pm = model.load(device, {shape, {batch}}, popt);
        pm.set_training(true);
        pm.set_optimizer(opt);
        for (int i = 0; i < 3; ++i) train_step(pm, b, device);
        std::printf("batch=%lld per-node ms of one forward and backward:\n", static_cast<long long>(batch));
        for (const auto& nt : pm.profile())
          std::printf("  %-24s %-28s %8.4f\n", nt.node.c_str(), nt.op.c_str(), nt.ms);
      }
    }
    return status;
  } catch (const kg::Error& e) {
    std::fprintf(stderr, "gpu_train: error: %s\n", e.what());
    return 1;
  }
}
