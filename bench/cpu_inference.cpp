// Times a model's forward pass on the CPU; scripts/bench runs it beside ONNX Runtime.
//   cpu_inference --model resnet18 --batch 64 --weights W.safetensors --input X.safetensors
//                 --output Y.safetensors [--warmup 2] [--runs 10] [--threads 2] [--profile 1] [--tune 1]
//   cpu_inference --onnx resnet18.onnx --batch 64 --input X.safetensors --output Y.safetensors ...
// --model builds a zoo model and loads --weights into it; --onnx imports the file instead (its
// initializers are the weights, --batch binds its dynamic batch dim, and the input is the file's
// single graph input). Prints "median_ms=<m> min_ms=<m>" and a line "samples_ms=" with every
// timed run, and writes the last forward's first output (the logits) to --output. With
// --tune 1 the model loads with LoadOptions::tune (on the CPU, oneDNN's convolution
// implementations are timed at the first forward, a warm-up run). With --profile 1 it also
// prints each node's median time over the timed runs: per op, then the ten
// slowest nodes (--profile 2: every node, slowest first).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "kg/io.hpp"
#include "kg/kg.hpp"
#include "kg/models.hpp"
#include "kg/onnx.hpp"

namespace {

struct Args {
  std::string model, onnx, weights, input, output;
  std::int64_t batch = 1;
  int warmup = 2, runs = 10, threads = 2;
  bool profile = false, profile_all = false;  // --profile 1: the ten slowest nodes; 2: all
  bool tune = false;                          // --tune 1: LoadOptions::tune
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "cpu_inference: " << why << "\n"
            << "usage: cpu_inference --model NAME --batch N --weights PATH --input PATH --output PATH\n"
            << "       cpu_inference --onnx FILE --batch N --input PATH --output PATH\n"
            << "                     [--warmup W] [--runs R] [--threads T] [--profile 0|1|2] [--tune 0|1]\n";
  std::exit(2);
}

long parse_int(const std::string& flag, const std::string& v, long lo) {
  return kg_bench::parse_int(flag, v, lo, usage);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) usage(flag + " needs a value");
    const std::string v = argv[++i];
    if (flag == "--model")
      a.model = v;
    else if (flag == "--onnx")
      a.onnx = v;
    else if (flag == "--batch")
      a.batch = parse_int(flag, v, 1);
    else if (flag == "--weights")
      a.weights = v;
    else if (flag == "--input")
      a.input = v;
    else if (flag == "--output")
      a.output = v;
    else if (flag == "--warmup")
      a.warmup = static_cast<int>(parse_int(flag, v, 0));
    else if (flag == "--runs")
      a.runs = static_cast<int>(parse_int(flag, v, 1));
    else if (flag == "--threads")
      a.threads = static_cast<int>(parse_int(flag, v, 0));
    else if (flag == "--tune")
      a.tune = parse_int(flag, v, 0) != 0;
    else if (flag == "--profile") {
      const long p = parse_int(flag, v, 0);
      a.profile = p != 0;
      a.profile_all = p >= 2;
    }
    else
      usage("unknown option " + flag);
  }
  if (!a.model.empty() && !a.onnx.empty()) usage("--model and --onnx exclude each other; give one");
  if (!a.onnx.empty()) {
    if (!a.weights.empty()) usage("--weights goes with --model; an --onnx file holds its weights");
    if (a.input.empty() || a.output.empty()) usage("--onnx, --input and --output are required");
  } else if (a.model.empty() || a.weights.empty() || a.input.empty() || a.output.empty()) {
    usage("--model (or --onnx), --weights, --input and --output are required");
  }
  return a;
}

// The model to time and its one input, for the batch: a zoo model with --weights loaded later,
// or an imported ONNX file with its initializers.
struct Subject {
  kg::Model model;
  std::vector<std::int64_t> input_shape;
  kg::DType input_dtype = kg::DType::F32;
};

Subject zoo_subject(const Args& a) {
  return {kg::models::build(a.model), kg::models::input_shape(a.model, a.batch), kg::DType::F32};
}

// The file's single input, its dynamic batch dim (named "batch", or an unnamed leading one)
// bound to --batch; any other dynamic dim, or a static leading dim other than --batch, is an error.
Subject onnx_subject(const Args& a) {
  kg::Model model = kg::onnx::import(a.onnx);
  const auto inputs = kg::onnx::model_inputs(model);
  if (inputs.size() != 1) {
    std::string names;
    for (const auto& in : inputs) names += (names.empty() ? "" : ", ") + in.name;
    throw kg::Error("'" + a.onnx + "' has " + std::to_string(inputs.size()) + " graph inputs (" + names +
                    "); cpu_inference times models with exactly one");
  }
  const kg::onnx::InputInfo& in = inputs.front();
  std::vector<std::int64_t> shape;
  for (std::size_t k = 0; k < in.shape.rank(); ++k) {
    const kg::Dim& d = in.shape[k];
    if (d.is_static()) {
      if (k == 0 && d.size() != a.batch)
        throw kg::Error("input '" + in.name + "' of '" + a.onnx + "' has the static batch " + std::to_string(d.size()) +
                        " (shape " + in.shape.to_string() + "), but --batch is " + std::to_string(a.batch));
      shape.push_back(d.size());
    } else if (d.symbol() == "batch" || (k == 0 && d.symbol().empty())) {
      shape.push_back(a.batch);
    } else {
      throw kg::Error("input '" + in.name + "' of '" + a.onnx + "' has the dynamic dim " + d.to_string() + " (dim " +
                      std::to_string(k) + " of " + in.shape.to_string() +
                      "); only the batch dim can be bound, by --batch");
    }
  }
  return {std::move(model), shape, in.dtype};
}

// The input file's one tensor (or the one named "input"), checked against the model's shape.
kg::Tensor read_input(const std::string& path, const std::vector<std::int64_t>& want, kg::DType dtype) {
  auto tensors = kg::read_safetensors(path);
  kg::Tensor x;
  if (tensors.count("input"))
    x = tensors.at("input");
  else if (tensors.size() == 1)
    x = tensors.begin()->second;
  else
    throw kg::Error("input file '" + path + "' holds " + std::to_string(tensors.size()) +
                    " tensors and none is named 'input'");
  if (x.shape() != want)
    throw kg::Error("input file '" + path + "' holds " + kg::sizes_to_string(x.shape()) +
                    " but the model takes " + kg::sizes_to_string(want));
  return x.to(dtype).clone();
}

// Each node's median time over the timed forwards (one shared machine's slow spells then move
// no node), in the order of the first.
std::vector<kg::NodeTime> median_profile(const std::vector<std::vector<kg::NodeTime>>& runs) {
  if (runs.empty()) return {};
  std::vector<kg::NodeTime> out = runs.front();
  for (std::size_t k = 0; k < out.size(); ++k) {
    std::vector<double> t;
    for (const auto& r : runs)
      if (k < r.size()) t.push_back(r[k].ms);
    std::sort(t.begin(), t.end());
    out[k].ms = t[t.size() / 2];
  }
  return out;
}

// Time per op kind, then the ten slowest nodes, of the median profile.
void print_profile(const std::vector<kg::NodeTime>& nodes, bool every_node) {
  double total = 0;
  std::map<std::string, std::pair<double, int>> by_op;
  for (const auto& n : nodes) {
    total += n.ms;
    by_op[n.op].first += n.ms;
    by_op[n.op].second += 1;
  }
  std::vector<std::pair<std::string, std::pair<double, int>>> ops(by_op.begin(), by_op.end());
  std::sort(ops.begin(), ops.end(),
            [](const auto& x, const auto& y) { return x.second.first > y.second.first; });
  std::printf("profile (median per node over the timed forwards): %.3f ms over %zu nodes\n", total,
              nodes.size());
  for (const auto& [op, t] : ops)
    std::printf("  %-24s %9.3f ms  %5.1f%%  (%d nodes)\n", op.c_str(), t.first,
                total > 0 ? 100.0 * t.first / total : 0.0, t.second);
  std::vector<kg::NodeTime> slow = nodes;
  std::sort(slow.begin(), slow.end(), [](const auto& x, const auto& y) { return x.ms > y.ms; });
  if (!every_node) slow.resize(std::min<std::size_t>(slow.size(), 10));
  std::printf("slowest nodes:\n");
  for (const auto& n : slow) std::printf("  %-28s %-24s %9.3f ms\n", n.node.c_str(), n.op.c_str(), n.ms);
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  try {
    const Subject s = a.onnx.empty() ? zoo_subject(a) : onnx_subject(a);
    const std::string name = a.onnx.empty() ? a.model : a.onnx;
    kg::LoadOptions opt;
    opt.threads = a.threads;
    opt.profile = a.profile;
    opt.tune = a.tune;
    kg::LoadedModel m = s.model.load(kg::Device::cpu(), {s.input_shape}, opt);
    if (!a.weights.empty()) m.load_weights(a.weights);
    const kg::Tensor x = read_input(a.input, s.input_shape, s.input_dtype);

    for (int i = 0; i < a.warmup; ++i) m.forward({x});
    std::vector<double> ms;
    std::vector<kg::Tensor> out;
    std::vector<std::vector<kg::NodeTime>> profiles;
    for (int i = 0; i < a.runs; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      out = m.forward({x});
      const auto t1 = std::chrono::steady_clock::now();
      ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      if (a.profile) profiles.push_back(m.profile());
    }
    std::vector<double> sorted = ms;
    std::sort(sorted.begin(), sorted.end());
    const std::size_t n = sorted.size();
    const double median = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
    std::printf("model=%s batch=%lld runs=%d median_ms=%.4f min_ms=%.4f\n", name.c_str(),
                static_cast<long long>(a.batch), a.runs, median, sorted.front());
    std::printf("samples_ms=");
    for (std::size_t i = 0; i < ms.size(); ++i) std::printf("%s%.5f", i ? "," : "", ms[i]);
    std::printf("\n");
    if (a.profile) print_profile(median_profile(profiles), a.profile_all);
    kg::write_safetensors(a.output, {{"logits", out.at(0).clone()}},
                          {{"model", name}, {"median_ms", std::to_string(median)}});
  } catch (const kg::Error& e) {
    std::cerr << "cpu_inference: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
