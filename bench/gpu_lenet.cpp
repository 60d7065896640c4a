// Times LeNet-5 inference on the GPU, eager and replayed from a CUDA graph; scripts/bench-gpu
// runs it beside PyTorch on the same weights and inputs.
//
//   gpu_lenet [--batches 1,256] [--weights W.safetensors] [--input-dir DIR] [--output-dir DIR]
//             [--warmup 50] [--runs 500] [--seed S] [--device N] [--profile]
//
// A timed run is one LoadedModel::forward: the input copied host → device, every kernel (or
// one graph launch), the logits copied device → host and waited for. forward() returns host
// tensors, so a host clock around it measures that whole round trip. Per batch and mode it
// prints "batch=<n> mode=<eager|graph> median_ms=<m> min_ms=<m> p90_ms=<m> runs=<r>".
// Inputs come from DIR/input_b<n>.safetensors (tensor "input") when --input-dir is given, else
// uniform in [-1, 1); weights from --weights, else the default initialisation (seed S). With
// --output-dir the last logits of each mode go to DIR/logits_b<n>_<mode>.safetensors.
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
  std::vector<std::int64_t> batches{1, 256};
  std::string weights, input_dir, output_dir;
  int warmup = 50, runs = 500, device = 0;
  std::uint64_t seed = 0;
  bool profile = false;
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "gpu_lenet: " << why << "\n"
            << "usage: gpu_lenet [--batches 1,256] [--weights PATH] [--input-dir DIR] [--output-dir DIR]\n"
            << "                 [--warmup W] [--runs R] [--seed S] [--device N] [--profile]\n";
  std::exit(2);
}

long parse_int(const std::string& flag, const std::string& v, long lo) {
  return kg_bench::parse_int(flag, v, lo, usage);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--profile") {
      a.profile = true;
      continue;
    }
    if (flag == "--help" || flag == "-h") usage("times LeNet-5 on the GPU, eager and with CUDA graphs");
    if (i + 1 >= argc) usage(flag + " needs a value");
    const std::string v = argv[++i];
    if (flag == "--batches") {
      a.batches = kg_bench::parse_batches(flag, v, usage);
    } else if (flag == "--weights") {
      a.weights = v;
    } else if (flag == "--input-dir") {
      a.input_dir = v;
    } else if (flag == "--output-dir") {
      a.output_dir = v;
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

kg::Tensor make_input(const Args& a, const std::vector<std::int64_t>& shape) {
  if (!a.input_dir.empty()) {
    const std::string path = a.input_dir + "/input_b" + std::to_string(shape[0]) + ".safetensors";
    auto tensors = kg::read_safetensors(path);
    if (!tensors.count("input")) throw kg::Error("input file '" + path + "' has no tensor named 'input'");
    const kg::Tensor x = tensors.at("input");
    if (x.shape() != shape)
      throw kg::Error("input file '" + path + "' holds " + kg::sizes_to_string(x.shape()) +
                      " but LeNet-5 takes " + kg::sizes_to_string(shape));
    return x.to(kg::DType::F32).clone();
  }
  std::mt19937_64 rng(a.seed + static_cast<std::uint64_t>(shape[0]));
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  kg::Tensor x = kg::Tensor::empty(kg::DType::F32, shape);
  for (std::int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = u(rng);
  return x;
}

using kg_bench::Timing;
using kg_bench::summarise;

double max_abs_diff(const kg::Tensor& a, const kg::Tensor& b) {
  double d = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) d = std::max(d, std::abs(a.item(i) - b.item(i)));
  return d;
}

void print_profile(const std::vector<kg::NodeTime>& nodes) {
  double total = 0;
  for (const auto& n : nodes) total += n.ms;
  std::printf("  profile (each node synchronised; %.3f ms in total):\n", total);
  for (const auto& n : nodes)
    std::printf("    %-24s %-20s %8.3f ms  %5.1f%%\n", n.node.c_str(), n.op.c_str(), n.ms,
                total > 0 ? 100.0 * n.ms / total : 0.0);
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  try {
    if (!kg::cuda::available()) {
      std::fprintf(stderr, "gpu_lenet: no GPU: %s\n", kg::cuda::unavailable_reason().c_str());
      return 1;
    }
    std::printf("device: cuda:%d %s (sm_%d)\n", a.device, kg::cuda::device_name(a.device).c_str(),
                kg::cuda::device_arch(a.device));
    std::printf("weights: %s\n", a.weights.empty()
                                     ? ("default initialisation, seed " + std::to_string(a.seed)).c_str()
                                     : a.weights.c_str());
    std::printf(
        "timing: host clock around forward(): H2D of the input + kernels + D2H of the logits; "
        "%d warm-up runs, median of %d\n",
        a.warmup, a.runs);
    if (!a.output_dir.empty()) std::filesystem::create_directories(a.output_dir);
    const kg::Model model = kg::models::build("lenet5");
    int status = 0;
    for (std::int64_t batch : a.batches) {
      const auto shape = kg::models::input_shape("lenet5", batch);
      const kg::Tensor x = make_input(a, shape);
      std::map<std::string, kg::Tensor> results;
      for (const char* mode_name : {"eager", "graph"}) {
        const std::string mode = mode_name;
        kg::LoadOptions opt;
        opt.seed = a.seed;
        opt.cuda_graph = mode == "graph";
        const auto t_load = std::chrono::steady_clock::now();
        kg::LoadedModel m = model.load(kg::Device::cuda(a.device), {shape}, opt);
        if (!a.weights.empty()) m.load_weights(a.weights);
        const double load_ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_load).count();
        std::vector<kg::Tensor> out;
        for (int i = 0; i < a.warmup; ++i) out = m.forward({x});
        std::vector<double> ms;
        ms.reserve(static_cast<std::size_t>(a.runs));
        for (int i = 0; i < a.runs; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          out = m.forward({x});
          ms.push_back(
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        }
        const Timing t = summarise(ms);
        std::printf("batch=%lld mode=%s median_ms=%.4f min_ms=%.4f p90_ms=%.4f runs=%d load_ms=%.1f\n",
                    static_cast<long long>(batch), mode.c_str(), t.median, t.min, t.p90, a.runs, load_ms);
        const kg::Tensor logits = out.at(0);
        for (std::int64_t i = 0; i < logits.numel(); ++i)
          if (!std::isfinite(logits.item(i))) {
            std::fprintf(stderr, "gpu_lenet: batch %lld %s: logit %lld is %g\n",
                         static_cast<long long>(batch), mode.c_str(), static_cast<long long>(i),
                         logits.item(i));
            status = 1;
            break;
          }
        results[mode] = logits;
        if (!a.output_dir.empty())
          kg::write_safetensors(
              a.output_dir + "/logits_b" + std::to_string(batch) + "_" + mode + ".safetensors",
              {{"logits", logits}});
        if (a.profile && mode == "eager") {
          kg::LoadOptions popt = opt;
          popt.profile = true;
          kg::LoadedModel p = model.load(kg::Device::cuda(a.device), {shape}, popt);
          if (!a.weights.empty()) p.load_weights(a.weights);
          for (int i = 0; i < 3; ++i) p.forward({x});
          print_profile(p.profile());
        }
      }
      std::printf("batch=%lld graph_vs_eager_max_abs=%.3g\n", static_cast<long long>(batch),
                  max_abs_diff(results.at("graph"), results.at("eager")));
    }
    return status;
  } catch (const kg::Error& e) {
    std::fprintf(stderr, "gpu_lenet: error: %s\n", e.what());
    return 1;
  }
}
