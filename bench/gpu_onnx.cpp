// Times inference of an imported ONNX model on the GPU with its inputs already in device memory;
// scripts/bench-gpu-suite runs it beside PyTorch (eager, CUDA graph, torch.compile) on the model
// PyTorch exported, with the same weights and inputs.
//
//   gpu_onnx --model FILE.onnx --inputs FILE.safetensors [--precision fp32|tf32|bf16]
//            [--output FILE.safetensors] [--warmup 10] [--runs 50] [--device N] [--tune]
//            [--no-graph] [--no-vendor] [--profile] [--cpu]
//
// --inputs holds one tensor per model input, by the input's name (int64 token ids stay int64;
// floating inputs are given in f32). Their shapes bind the model's dynamic dims. A timed run is
// one LoadedModel::forward_device on the inputs uploaded once; its time is last_device_ms() (CUDA
// events around the forward's launches). It prints
//   "median_ms=<m> min_ms=<m> p90_ms=<m> wall_median_ms=<m> runs=<r> load_ms=<m> import_ms=<m>"
// and, with --output, writes every output in f32 by output name. --precision bf16 loads with
// LoadOptions::precision = bf16 (weights converted at load, f32 inputs cast on the device, f32
// outputs); tf32 sets LoadOptions::tf32. --profile: a second, profiled load, and per op the summed
// node times of one forward ("op=<name> ms=<m> nodes=<n>"), then the slowest nodes
// ("node=<label> op=<name> ms=<m>"). --cpu runs on the CPU (a check of the plumbing).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "kg/cuda.hpp"
#include "kg/io.hpp"
#include "kg/kg.hpp"
#include "kg/onnx.hpp"

namespace {

struct Args {
  std::string model, inputs, output, precision = "fp32";
  int warmup = 10, runs = 50, device = 0;
  bool cpu = false, graph = true, vendor = true, tune = false, profile = false;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "gpu_onnx: %s\n"
               "usage: gpu_onnx --model FILE.onnx --inputs FILE.safetensors [--precision fp32|tf32|bf16]\n"
               "                [--output FILE] [--warmup W] [--runs R] [--device N] [--tune] [--no-graph]\n"
               "                [--no-vendor] [--profile] [--cpu]\n",
               why.c_str());
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") usage("times an ONNX model on the GPU, inputs on the device");
    if (flag == "--cpu") {
      a.cpu = true;
    } else if (flag == "--no-graph") {
      a.graph = false;
    } else if (flag == "--no-vendor") {
      a.vendor = false;
    } else if (flag == "--tune") {
      a.tune = true;
    } else if (flag == "--profile") {
      a.profile = true;
    } else {
      if (i + 1 >= argc) usage(flag + " needs a value");
      const std::string v = argv[++i];
      if (flag == "--model") {
        a.model = v;
      } else if (flag == "--inputs") {
        a.inputs = v;
      } else if (flag == "--output") {
        a.output = v;
      } else if (flag == "--precision") {
        if (v != "fp32" && v != "tf32" && v != "bf16") usage("--precision is fp32, tf32 or bf16, got '" + v + "'");
        a.precision = v;
      } else if (flag == "--warmup") {
        a.warmup = static_cast<int>(kg_bench::parse_int(flag, v, 0, usage));
      } else if (flag == "--runs") {
        a.runs = static_cast<int>(kg_bench::parse_int(flag, v, 1, usage));
      } else if (flag == "--device") {
        a.device = static_cast<int>(kg_bench::parse_int(flag, v, 0, usage));
      } else {
        usage("unknown option " + flag);
      }
    }
  }
  if (a.model.empty() || a.inputs.empty()) usage("--model and --inputs are required");
  return a;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

kg::LoadOptions load_options(const Args& a) {
  kg::LoadOptions o;
  o.cuda_graph = a.graph;
  o.vendor_libraries = a.vendor;
  o.tune = a.tune;
  o.tf32 = a.precision == "tf32";
  if (a.precision == "bf16") o.precision = kg::DType::BF16;
  return o;
}

// The model's inputs in order, from the file by name (floating ones in f32).
std::vector<kg::Tensor> read_inputs(const Args& a, const kg::Model& model) {
  const auto file = kg::read_safetensors(a.inputs);
  std::vector<kg::Tensor> xs;
  for (const kg::onnx::InputInfo& in : kg::onnx::model_inputs(model)) {
    auto it = file.find(in.name);
    if (it == file.end()) throw kg::Error("input file '" + a.inputs + "' has no tensor named '" + in.name + "'");
    kg::Tensor t = it->second;
    if (kg::is_floating(t.dtype()) && t.dtype() != kg::DType::F32) t = t.to(kg::DType::F32);
    if (kg::is_floating(in.dtype) != kg::is_floating(t.dtype()))
      throw kg::Error("input '" + in.name + "' is " + std::string(kg::dtype_name(in.dtype)) + " in the model but " +
                      std::string(kg::dtype_name(t.dtype())) + " in '" + a.inputs + "'");
    xs.push_back(t.clone());
  }
  return xs;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  try {
    if (!a.cpu && !kg::cuda::available()) {
      std::fprintf(stderr, "gpu_onnx: no GPU: %s\n", kg::cuda::unavailable_reason().c_str());
      return 1;
    }
    const kg::Device device = a.cpu ? kg::Device::cpu() : kg::Device::cuda(a.device);
    if (a.cpu)
      std::printf("device: cpu (--cpu: a check of the plumbing, not a GPU measurement)\n");
    else
      std::printf("device: cuda:%d %s (sm_%d)\n", a.device, kg::cuda::device_name(a.device).c_str(),
                  kg::cuda::device_arch(a.device));
    const auto t_import = std::chrono::steady_clock::now();
    const kg::Model model = kg::onnx::import(a.model);
    const double import_ms = ms_since(t_import);
    std::vector<kg::Tensor> xs = read_inputs(a, model);
    std::vector<std::vector<std::int64_t>> shapes;
    for (const auto& x : xs) shapes.push_back(x.shape());

    const auto t_load = std::chrono::steady_clock::now();
    kg::LoadedModel m = model.load(device, shapes, load_options(a));
    const double load_ms = ms_since(t_load);

    std::vector<kg::cuda::DeviceTensorBuffer> bufs;
    std::vector<kg::DeviceTensor> ins;
    bufs.reserve(xs.size());
    for (auto& x : xs) {
      if (a.cpu) {
        ins.push_back(kg_bench::host_device_tensor(x));
      } else {
        bufs.push_back(kg::cuda::DeviceTensorBuffer::from(x, a.device));
        ins.push_back(bufs.back().tensor());
      }
    }
    std::vector<kg::DeviceTensor> out;
    for (int i = 0; i < a.warmup; ++i) out = m.forward_device(ins);
    std::vector<double> dev_ms, wall_ms;
    for (int i = 0; i < a.runs; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      out = m.forward_device(ins);
      wall_ms.push_back(ms_since(t0));
      dev_ms.push_back(m.last_device_ms());
    }
    const kg_bench::Timing t = kg_bench::summarise(dev_ms);
    const kg_bench::Timing w = kg_bench::summarise(wall_ms);
    std::printf("median_ms=%.4f min_ms=%.4f p90_ms=%.4f wall_median_ms=%.4f runs=%d load_ms=%.1f import_ms=%.1f\n",
                t.median, t.min, t.p90, w.median, a.runs, load_ms, import_ms);
    std::fflush(stdout);

    int status = 0;
    std::map<std::string, kg::Tensor> outputs;
    const auto names = m.output_names();
    for (std::size_t i = 0; i < out.size(); ++i) {
      kg::Tensor y = kg_bench::to_host(out[i], !a.cpu, a.device);
      if (kg::is_floating(y.dtype())) {
        y = y.to(kg::DType::F32);
        for (std::int64_t e = 0; e < y.numel(); ++e)
          if (!std::isfinite(y.item(e))) {
            std::fprintf(stderr, "gpu_onnx: output %s element %lld is %g\n", names.at(i).c_str(),
                         static_cast<long long>(e), y.item(e));
            status = 1;
            break;
          }
      }
      outputs.emplace(names.at(i), y.clone());
    }
    if (!a.output.empty()) kg::write_safetensors(a.output, outputs);

    if (a.profile && !a.cpu) {
      kg::LoadOptions po = load_options(a);
      po.profile = true;
      po.cuda_graph = false;
      kg::LoadedModel p = model.load(device, shapes, po);
      for (int i = 0; i < 3; ++i) p.forward_device(ins);
      std::map<std::string, std::pair<double, int>> by_op;
      std::vector<kg::NodeTime> nodes = p.profile();
      double total = 0;
      for (const auto& n : nodes) {
        auto& e = by_op[n.op];
        e.first += n.ms;
        e.second += 1;
        total += n.ms;
      }
      std::vector<std::pair<std::string, std::pair<double, int>>> ops(by_op.begin(), by_op.end());
      std::sort(ops.begin(), ops.end(), [](const auto& x, const auto& y) { return x.second.first > y.second.first; });
      std::printf("profile_total_ms=%.4f\n", total);
      for (const auto& [op, e] : ops) std::printf("op=%s ms=%.4f nodes=%d\n", op.c_str(), e.first, e.second);
      std::sort(nodes.begin(), nodes.end(), [](const auto& x, const auto& y) { return x.ms > y.ms; });
      for (std::size_t i = 0; i < std::min<std::size_t>(nodes.size(), 25); ++i)
        std::printf("node=%s op=%s ms=%.4f kernel=%s\n", nodes[i].node.c_str(), nodes[i].op.c_str(), nodes[i].ms,
                    nodes[i].kernel.c_str());
    }
    return status;
  } catch (const kg::Error& e) {
    std::fprintf(stderr, "gpu_onnx: error: %s\n", e.what());
    return 1;
  }
}
