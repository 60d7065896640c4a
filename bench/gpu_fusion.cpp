// Times fused against unfused graphs on the GPU; scripts/bench-fusion runs it beside PyTorch eager
// and torch.compile on the same inputs.
//
//   gpu_fusion [--elements N] [--input X.safetensors] [--output-dir DIR] [--lenet-batch B]
//              [--resnet-batch B] [--warmup W] [--runs R] [--device N] [--cpu]
//
// Cases, each with fusion on and off (ModelOptions::fusion):
//   chain   relu(x * sigmoid(x) + 1) over N floats (default 64M): device time is the sum of the
//           nodes' times (LoadOptions::profile: CUDA events around each node's launches, the
//           launches replayed as one CUDA graph); the achieved bandwidth counts one
//           read and one write of N floats.
//   lenet   LeNet-5 with the custom scaled tanh (lenet5-tanh) at batch B: the nodes' summed time
//           as above, and the host round trip of forward() (input in, logits out).
//   resnet18-swish  ResNet-18 with a user's swish custom op for every ReLU, the same at batch B.
//   train-* a training step (zero_grad, forward, backward, SGD step, synchronised) of both models
//           with a cross-entropy loss, host clock.
//   mlp-b<B>  GEMM epilogues: an MLP 1024-1024-1024-10 with the user's swish after each hidden
//           layer, at batch 64 and 4096, tuned loads: unfused (fusion=off: cuBLASLt or our GEMM,
//           then the swish kernel), fused with the vendor libraries off (fusion=own: our GEMM with
//           the swish in its store) and fused with the tactic chosen by timing (fusion=on:
//           cuBLASLt plus the in-place epilogue kernel, or our fused GEMM); tactics=node:kernel.
// Prints "case=<c> fusion=<on|off> ..." lines with medians; with --output-dir the chain's output
// goes to DIR/chain_<on|off>.safetensors (tensor "y") for comparison.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
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
  std::int64_t elements = 64LL << 20;
  std::string input, output_dir;
  std::int64_t lenet_batch = 256;
  std::int64_t resnet_batch = 32;  // 0: no ResNet-18 cases
  int warmup = 5, runs = 30, device = 0;
  bool cpu = false;  // --cpu: the same runs on the CPU (a smoke test of the program)
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr
      << "gpu_fusion: " << why << "\n"
      << "usage: gpu_fusion [--elements N] [--input X.safetensors] [--output-dir DIR] [--lenet-batch B]\n"
      << "                  [--warmup W] [--runs R] [--device N]\n";
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") usage("times fused against unfused graphs on the GPU");
    if (flag == "--cpu") {
      a.cpu = true;
      continue;
    }
    if (i + 1 >= argc) usage(flag + " needs a value");
    const std::string v = argv[++i];
    if (flag == "--elements")
      a.elements = kg_bench::parse_int(flag, v, 1, usage);
    else if (flag == "--input")
      a.input = v;
    else if (flag == "--output-dir")
      a.output_dir = v;
    else if (flag == "--lenet-batch")
      a.lenet_batch = kg_bench::parse_int(flag, v, 1, usage);
    else if (flag == "--resnet-batch")
      a.resnet_batch = kg_bench::parse_int(flag, v, 0, usage);
    else if (flag == "--warmup")
      a.warmup = static_cast<int>(kg_bench::parse_int(flag, v, 0, usage));
    else if (flag == "--runs")
      a.runs = static_cast<int>(kg_bench::parse_int(flag, v, 1, usage));
    else if (flag == "--device")
      a.device = static_cast<int>(kg_bench::parse_int(flag, v, 0, usage));
    else
      usage("unknown option " + flag);
  }
  return a;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Median of the summed node times of `runs` profiled forwards, and of their host round trips.
struct Measured {
  kg_bench::Timing device, round_trip;
  // With `forward_events`: CUDA events around each forward's launches of a load without
  // per-node timing (LoadedModel::last_device_ms), as PyTorch is timed: no event between nodes.
  kg_bench::Timing forward;
  int nodes = 0;
  kg::Tensor out;
};

// `tactics`, when given, gets "node:kernel" for every node, comma-separated.
Measured measure(const kg::Model& model, const kg::Tensor& x, const Args& a, bool tune = false,
                 bool vendor = true, std::string* tactics = nullptr, bool forward_events = false) {
  kg::LoadOptions opt;
  opt.profile = true;
  opt.tune = tune;
  opt.vendor_libraries = vendor;
  kg::LoadedModel m = model.load(a.cpu ? kg::Device::cpu() : kg::Device::cuda(a.device), {x.shape()}, opt);
  Measured r;
  for (int i = 0; i < a.warmup; ++i) m.forward({x});
  std::vector<double> dev, trip;
  for (int i = 0; i < a.runs; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    r.out = m.forward({x}).at(0);
    trip.push_back(ms_since(t0));
    double sum = 0;
    const auto p = m.profile();
    for (const auto& n : p) sum += n.ms;
    r.nodes = static_cast<int>(p.size());
    dev.push_back(sum);
    if (tactics) {
      tactics->clear();
      for (const auto& t : p) *tactics += (tactics->empty() ? "" : ",") + t.node + ":" + t.kernel;
    }
  }
  r.out = r.out.clone();  // the model's output buffer goes with the model
  if (forward_events) {
    opt.profile = false;
    kg::LoadedModel plain = model.load(a.cpu ? kg::Device::cpu() : kg::Device::cuda(a.device), {x.shape()}, opt);
    std::vector<double> fwd;
    for (int i = 0; i < a.warmup + a.runs; ++i) {
      plain.forward({x});
      if (i >= a.warmup) fwd.push_back(plain.last_device_ms());
    }
    r.forward = kg_bench::summarise(fwd);
  }
  r.device = kg_bench::summarise(dev);
  r.round_trip = kg_bench::summarise(trip);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  try {
    if (a.cpu) {
      std::printf("device: cpu (smoke test)\n");
    } else if (!kg::cuda::available()) {
      std::fprintf(stderr, "gpu_fusion: no GPU: %s\n", kg::cuda::unavailable_reason().c_str());
      return 1;
    } else {
      std::printf("device: cuda:%d %s (sm_%d)\n", a.device, kg::cuda::device_name(a.device).c_str(),
                  kg::cuda::device_arch(a.device));
    }
    std::printf("%d warm-up runs, median of %d\n", a.warmup, a.runs);
    std::fflush(stdout);
    if (!a.output_dir.empty()) std::filesystem::create_directories(a.output_dir);

    // ---- the chain ----
    kg::Tensor x;
    if (!a.input.empty()) {
      auto t = kg::read_safetensors(a.input);
      if (!t.count("x")) throw kg::Error("input file '" + a.input + "' has no tensor named 'x'");
      x = t.at("x").to(kg::DType::F32).clone();
    } else {
      x = kg::Tensor::empty(kg::DType::F32, {a.elements});
      std::mt19937_64 rng(1);
      std::uniform_real_distribution<float> u(-4.f, 4.f);
      for (std::int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = u(rng);
    }
    const std::int64_t n = x.numel();
    auto [in, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("n")}, "x");
    auto y = kg::relu(kg::add(kg::mul(in, kg::sigmoid(in, "sigmoid"), "mul"), 1.0, "add"), "relu");
    const double bytes = 2.0 * static_cast<double>(n) * sizeof(float);
    std::printf("chain: relu(x * sigmoid(x) + 1) over %lld floats; HBM floor at 4.3 TB/s: %.4f ms\n",
                static_cast<long long>(n), bytes / 4.3e12 * 1e3);
    for (bool fusion : {true, false}) {
      kg::Model model(g, {y}, kg::LoweringMode::Inference, {.fusion = fusion});
      const Measured r = measure(model, x, a, false, true, nullptr, /*forward_events=*/true);
      std::printf("case=chain fusion=%s nodes=%d device_median_ms=%.4f device_min_ms=%.4f GBps=%.0f "
                  "forward_median_ms=%.4f forward_min_ms=%.4f\n",
                  fusion ? "on" : "off", r.nodes, r.device.median, r.device.min,
                  bytes / (r.device.median * 1e-3) / 1e9, r.forward.median, r.forward.min);
      std::fflush(stdout);
      if (!a.output_dir.empty())
        kg::write_safetensors(
            a.output_dir + std::string("/chain_") + (fusion ? "on" : "off") + ".safetensors", {{"y", r.out}});
    }

    // ---- LeNet-5 with the custom scaled tanh ----
    const auto shape = kg::models::input_shape("lenet5-tanh", a.lenet_batch);
    kg::Tensor img = kg::Tensor::empty(kg::DType::F32, shape);
    std::mt19937_64 rng(2);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (std::int64_t i = 0; i < img.numel(); ++i) img.data<float>()[i] = u(rng);
    kg::Tensor ref;  // the fused model's logits
    for (bool fusion : {true, false}) {
      const kg::Model model =
          kg::models::build("lenet5-tanh", kg::LoweringMode::Inference, {.fusion = fusion});
      const Measured r = measure(model, img, a);
      double diff = 0;
      if (fusion)
        ref = r.out;
      else
        for (std::int64_t i = 0; i < ref.numel(); ++i)
          diff = std::max(diff, std::abs(ref.item(i) - r.out.item(i)));
      std::printf(
          "case=lenet batch=%lld fusion=%s nodes=%d device_median_ms=%.4f round_trip_median_ms=%.4f%s\n",
          static_cast<long long>(a.lenet_batch), fusion ? "on" : "off", r.nodes, r.device.median,
          r.round_trip.median, fusion ? "" : (" max_abs_vs_fused=" + std::to_string(diff)).c_str());
    }
    // ---- ResNet-18 with the user's swish: inference, and both models' training steps ----
    if (a.resnet_batch > 0) {
      const auto rshape = kg::models::input_shape("resnet18-swish", a.resnet_batch);
      kg::Tensor rimg = kg::Tensor::empty(kg::DType::F32, rshape);
      for (std::int64_t i = 0; i < rimg.numel(); ++i) rimg.data<float>()[i] = u(rng);
      for (bool fusion : {true, false}) {
        const kg::Model model =
            kg::models::build("resnet18-swish", kg::LoweringMode::Inference, {.fusion = fusion});
        const Measured r = measure(model, rimg, a);
        std::printf(
            "case=resnet18-swish batch=%lld fusion=%s nodes=%d device_median_ms=%.4f "
            "round_trip_median_ms=%.4f\n",
            static_cast<long long>(a.resnet_batch), fusion ? "on" : "off", r.nodes, r.device.median,
            r.round_trip.median);
        std::fflush(stdout);
      }
    }
    // ---- GEMM epilogues: an MLP with the user's swish, three ways ----
    for (std::int64_t batch : {64, 4096}) {
      auto [mx, mg] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 1024}, "x");
      kg::SymTensor h = kg::models::swish(kg::nn::linear(mx, 1024, "fc1"), "act1");
      h = kg::models::swish(kg::nn::linear(h, 1024, "fc2"), "act2");
      kg::SymTensor logits = kg::nn::linear(h, 10, "fc3");
      kg::Tensor mxv = kg::Tensor::empty(kg::DType::F32, {batch, 1024});
      for (std::int64_t i = 0; i < mxv.numel(); ++i) mxv.data<float>()[i] = u(rng);
      for (const char* mode : {"off", "own", "on"}) {
        const bool fusion = std::string(mode) != "off";
        const kg::Model model(mg, {logits}, kg::LoweringMode::Inference, {.fusion = fusion});
        std::string tactics;
        const Measured r = measure(model, mxv, a, true, std::string(mode) != "own", &tactics);
        std::printf("case=mlp-b%lld fusion=%s nodes=%d device_median_ms=%.4f tactics=%s\n",
                    static_cast<long long>(batch), mode, r.nodes, r.device.median, tactics.c_str());
        std::fflush(stdout);
      }
    }
    for (const auto& [name, batch] :
         {std::pair<std::string, std::int64_t>{"lenet5-tanh", a.lenet_batch},
          std::pair<std::string, std::int64_t>{"resnet18-swish", a.resnet_batch}}) {
      if (batch <= 0) continue;
      const auto tshape = kg::models::input_shape(name, batch);
      kg::Tensor timg = kg::Tensor::empty(kg::DType::F32, tshape);
      for (std::int64_t i = 0; i < timg.numel(); ++i) timg.data<float>()[i] = u(rng);
      kg::Tensor labels = kg::Tensor::empty(kg::DType::I64, {batch});
      for (std::int64_t i = 0; i < batch; ++i) labels.data<std::int64_t>()[i] = i % 10;
      for (bool fusion : {true, false}) {
        std::vector<kg::Dim> dims{kg::Dim::named("batch")};
        for (std::size_t d = 1; d < tshape.size(); ++d) dims.emplace_back(tshape[d]);
        auto [tx, tg] = kg::SymTensor::input(kg::DType::F32, kg::Shape(dims), "input");
        auto tl = tg->input(kg::DType::I64, {kg::Dim::named("batch")}, "labels");
        auto loss = kg::cross_entropy(kg::models::record(name, tx), tl, "loss");
        kg::Model model(tg, {{"loss", loss}}, kg::LoweringMode::Training, {.fusion = fusion});
        kg::LoadedModel m =
            model.load(a.cpu ? kg::Device::cpu() : kg::Device::cuda(a.device), {tshape, {batch}});
        m.set_optimizer(kg::OptimizerOptions::sgd(0.01, 0.9));
        m.set_training(true);
        std::vector<double> ms;
        for (int i = 0; i < a.warmup + a.runs; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          m.zero_grad();
          m.forward({timg, labels});
          m.backward();
          m.step();
          if (!a.cpu) kg::cuda::synchronize(a.device);
          if (i >= a.warmup) ms.push_back(ms_since(t0));
        }
        int nodes = 0;
        for (int id : model.live_nodes()) nodes += model.graph().node(id).kind == kg::Node::Kind::Op;
        std::printf("case=train-%s batch=%lld fusion=%s nodes=%d step_median_ms=%.4f\n", name.c_str(),
                    static_cast<long long>(batch), fusion ? "on" : "off", nodes,
                    kg_bench::summarise(ms).median);
        std::fflush(stdout);
      }
    }
    return 0;
  } catch (const kg::Error& e) {
    std::fprintf(stderr, "gpu_fusion: error: %s\n", e.what());
    return 1;
  }
}
