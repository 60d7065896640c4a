// Times inference of ResNet-18 and an MLP on the GPU with the inputs already in device memory;
// scripts/bench-gpu-models runs it beside PyTorch (eager, CUDA graph, channels-last,
// torch.compile) on the same weights and inputs.
//
//   gpu_models --model resnet18|mlp|lenet5 [--batches 1,32,256] [--dtype f32|bf16] [--tf32]
//              [--data-dir DIR] [--warmup 20] [--runs 200] [--seed S] [--device N] [--cpu]
//              [--no-graph] [--no-vendor] [--no-channels-last] [--tune] [--list-params]
//
// Models: "resnet18" is the zoo's (kg::models::build, torchvision's parameter names, input
// [N, 3, 224, 224]); "mlp" is 784-4096-4096-10 (fc1, relu, fc2, relu, fc3; PyTorch's nn.Linear
// names fc1.weight, fc1.bias, ...), input [N, 784]; "lenet5" is the zoo's too (for
// --list-params; scripts/bench-gpu-train times it). Each is loaded with
// LoadOptions{.cuda_graph, .vendor_libraries, .channels_last, .tf32, .tune}.
//
// A timed run is one LoadedModel::forward_device on an input uploaded once before the runs;
// its time is LoadedModel::last_device_ms() (CUDA events around the forward's launches). Per
// batch it prints
//   "model=<m> batch=<n> precision=<fp32|tf32> median_ms=<m> min_ms=<m> p90_ms=<m>
//    wall_median_ms=<m> runs=<r> load_ms=<m>"
// where wall_median_ms is the host clock around forward_device (which waits for the outputs).
// With --data-dir, the weights come from DIR/<model>.safetensors (strict: every parameter, equal
// shapes), each input from DIR/<model>_b<n>.safetensors (tensor "input"), and the output of
// the last timed run goes to DIR/kg_<model>_b<n>_<precision>.safetensors (tensor "output");
// without it, the default initialisation (seed S) and uniform [-1, 1) inputs.
//
// --dtype bf16: the model (recorded in f32) loads with LoadOptions::precision = bf16: its
// weights are converted at load, the input is f32 and cast on the device, the output is f32.
// --list-params prints "param <name> <dtype> <d0,d1,...>" for every parameter and exits (no
// device needed): the script checks its name mapping against it. --cpu runs on the CPU (a
// smoke test of the plumbing; the times are wall times and mean nothing).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
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
  std::string model;
  std::vector<std::int64_t> batches;
  std::string dtype = "f32";
  bool tf32 = false, cpu = false, graph = true, vendor = true, tune = false, list_params = false;
  bool channels_last = true;
  std::string data_dir;
  int warmup = 20, runs = 200, device = 0;
  std::uint64_t seed = 0;
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr
      << "gpu_models: " << why << "\n"
      << "usage: gpu_models --model resnet18|mlp|lenet5 [--batches 1,32,256] [--dtype f32|bf16] [--tf32]\n"
      << "                  [--data-dir DIR] [--warmup W] [--runs R] [--seed S] [--device N] [--cpu]\n"
      << "                  [--no-graph] [--no-vendor] [--no-channels-last] [--tune] [--list-params]\n";
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h")
      usage("times ResNet-18 and an MLP on the GPU, inputs on the device");
    if (flag == "--tf32") {
      a.tf32 = true;
    } else if (flag == "--cpu") {
      a.cpu = true;
    } else if (flag == "--no-graph") {
      a.graph = false;
    } else if (flag == "--no-vendor") {
      a.vendor = false;
    } else if (flag == "--no-channels-last") {
      a.channels_last = false;
    } else if (flag == "--tune") {
      a.tune = true;
    } else if (flag == "--list-params") {
      a.list_params = true;
    } else {
      if (i + 1 >= argc) usage(flag + " needs a value");
      const std::string v = argv[++i];
      if (flag == "--model") {
        if (v != "resnet18" && v != "mlp" && v != "lenet5")
          usage("--model is resnet18, mlp or lenet5, got '" + v + "'");
        a.model = v;
      } else if (flag == "--batches") {
        a.batches = kg_bench::parse_batches(flag, v, usage);
      } else if (flag == "--dtype") {
        if (v != "f32" && v != "bf16") usage("--dtype is f32 or bf16, got '" + v + "'");
        a.dtype = v;
      } else if (flag == "--data-dir") {
        a.data_dir = v;
      } else if (flag == "--warmup") {
        a.warmup = static_cast<int>(kg_bench::parse_int(flag, v, 0, usage));
      } else if (flag == "--runs") {
        a.runs = static_cast<int>(kg_bench::parse_int(flag, v, 1, usage));
      } else if (flag == "--seed") {
        a.seed = static_cast<std::uint64_t>(kg_bench::parse_int(flag, v, 0, usage));
      } else if (flag == "--device") {
        a.device = static_cast<int>(kg_bench::parse_int(flag, v, 0, usage));
      } else {
        usage("unknown option " + flag);
      }
    }
  }
  if (a.model.empty()) usage("--model is required");
  if (a.batches.empty())
    a.batches = a.model == "mlp" ? std::vector<std::int64_t>{4096} : std::vector<std::int64_t>{1, 32, 256};
  if (a.tf32 && a.dtype != "f32") usage("--tf32 applies to --dtype f32 only");
  return a;
}

constexpr std::int64_t kMlpIn = 784, kMlpHidden = 4096, kMlpOut = 10;

// 784-4096-4096-10 with ReLU between the layers, output "logits".
kg::Model mlp_model() {
  auto [x, graph] = kg::SymTensor::input(kg::DType::F32, kg::Shape{kg::Dim::named("batch"), kMlpIn}, "input");
  kg::SymTensor h = kg::relu(kg::nn::linear(x, kMlpHidden, "fc1"), "relu1");
  h = kg::relu(kg::nn::linear(h, kMlpHidden, "fc2"), "relu2");
  kg::SymTensor out = kg::nn::linear(h, kMlpOut, "fc3");
  return kg::Model(graph, {{"logits", out}});
}

kg::Model build(const Args& a) {
  if (a.model == "mlp") return mlp_model();
  return kg::models::build(a.model);
}

std::vector<std::int64_t> input_shape(const std::string& model, std::int64_t batch) {
  if (model == "mlp") return {batch, kMlpIn};
  return kg::models::input_shape(model, batch);
}

kg::Tensor make_input(const Args& a, const std::vector<std::int64_t>& shape) {
  if (!a.data_dir.empty()) {
    const std::string path = a.data_dir + "/" + a.model + "_b" + std::to_string(shape[0]) + ".safetensors";
    auto tensors = kg::read_safetensors(path);
    if (!tensors.count("input")) throw kg::Error("input file '" + path + "' has no tensor named 'input'");
    const kg::Tensor x = tensors.at("input");
    if (x.shape() != shape)
      throw kg::Error("input file '" + path + "' holds " + kg::sizes_to_string(x.shape()) + " but " +
                      a.model + " takes " + kg::sizes_to_string(shape));
    return x.to(kg::DType::F32).clone();
  }
  std::mt19937_64 rng(a.seed + static_cast<std::uint64_t>(shape[0]));
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  kg::Tensor x = kg::Tensor::empty(kg::DType::F32, shape);
  for (std::int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = u(rng);
  return x;
}

std::string join_sizes(const std::vector<std::int64_t>& s) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  try {
    const kg::Model model = build(a);
    if (a.list_params) {
      for (const kg::ParamInfo& p : model.parameters())
        std::printf("param %s %s %s\n", p.name.c_str(), std::string(kg::dtype_name(p.dtype)).c_str(),
                    join_sizes(p.shape).c_str());
      return 0;
    }
    if (!a.cpu && !kg::cuda::available()) {
      std::fprintf(stderr, "gpu_models: no GPU: %s\n", kg::cuda::unavailable_reason().c_str());
      return 1;
    }
    const kg::Device device = a.cpu ? kg::Device::cpu() : kg::Device::cuda(a.device);
    const std::string precision = a.dtype == "bf16" ? "bf16" : a.tf32 ? "tf32" : "fp32";
    if (a.cpu)
      std::printf("device: cpu (--cpu: a check of the plumbing, not a GPU measurement)\n");
    else
      std::printf("device: cuda:%d %s (sm_%d)\n", a.device, kg::cuda::device_name(a.device).c_str(),
                  kg::cuda::device_arch(a.device));
    std::printf("model: %s, precision %s; cuda_graph %s, vendor libraries %s, channels-last %s, tune %s\n",
                a.model.c_str(), precision.c_str(), a.graph ? "on" : "off", a.vendor ? "on" : "off",
                a.channels_last ? "on" : "off", a.tune ? "on" : "off");
    std::printf(
        "timing: last_device_ms() of forward_device (input already on the device); %d warm-up runs, "
        "median of %d\n",
        a.warmup, a.runs);
    if (!a.data_dir.empty()) std::filesystem::create_directories(a.data_dir);
    int status = 0;
    for (std::int64_t batch : a.batches) {
      const auto shape = input_shape(a.model, batch);
      kg::Tensor x = make_input(a, shape);
      kg::LoadOptions opt;
      opt.seed = a.seed;
      opt.cuda_graph = a.graph;
      opt.vendor_libraries = a.vendor;
      opt.channels_last = a.channels_last;
      opt.tf32 = a.tf32;
      opt.tune = a.tune;
      if (a.dtype == "bf16") opt.precision = kg::DType::BF16;
      const auto t_load = std::chrono::steady_clock::now();
      kg::LoadedModel m = model.load(device, {shape}, opt);
      if (!a.data_dir.empty()) m.load_weights(a.data_dir + "/" + a.model + ".safetensors");
      const double load_ms = ms_since(t_load);

      // The input in device memory, uploaded once; on the cpu the host tensor itself.
      kg::cuda::DeviceTensorBuffer x_dev;
      kg::DeviceTensor in;
      if (a.cpu) {
        in = kg_bench::host_device_tensor(x);
      } else {
        x_dev = kg::cuda::DeviceTensorBuffer::from(x, a.device);
        in = x_dev.tensor();
      }
      std::vector<kg::DeviceTensor> out;
      for (int i = 0; i < a.warmup; ++i) out = m.forward_device({in});
      std::vector<double> dev_ms, wall_ms;
      dev_ms.reserve(static_cast<std::size_t>(a.runs));
      wall_ms.reserve(static_cast<std::size_t>(a.runs));
      for (int i = 0; i < a.runs; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        out = m.forward_device({in});
        wall_ms.push_back(ms_since(t0));
        dev_ms.push_back(m.last_device_ms());
      }
      const kg_bench::Timing t = kg_bench::summarise(dev_ms);
      const kg_bench::Timing w = kg_bench::summarise(wall_ms);
      std::printf(
          "model=%s batch=%lld precision=%s median_ms=%.4f min_ms=%.4f p90_ms=%.4f wall_median_ms=%.4f "
          "runs=%d "
          "load_ms=%.1f\n",
          a.model.c_str(), static_cast<long long>(batch), precision.c_str(), t.median, t.min, t.p90, w.median,
          a.runs, load_ms);
      std::fflush(stdout);

      const kg::Tensor y = kg_bench::to_host(out.at(0), !a.cpu, a.device);
      for (std::int64_t i = 0; i < y.numel(); ++i)
        if (!std::isfinite(y.item(i))) {
          std::fprintf(stderr, "gpu_models: %s batch %lld: output %lld is %g\n", a.model.c_str(),
                       static_cast<long long>(batch), static_cast<long long>(i), y.item(i));
          status = 1;
          break;
        }
      if (!a.data_dir.empty())
        kg::write_safetensors(
            a.data_dir + "/kg_" + a.model + "_b" + std::to_string(batch) + "_" + precision + ".safetensors",
            {{"output", y.to(kg::DType::F32)}});
    }
    return status;
  } catch (const kg::Error& e) {
    std::fprintf(stderr, "gpu_models: error: %s\n", e.what());
    return 1;
  }
}
