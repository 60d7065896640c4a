// Times one training step of a zoo LeNet-5 on the CPU; scripts/bench-train runs it beside PyTorch
// on the same weights, batch, optimiser and thread count, in the same run, interleaved.
//
//   cpu_train [--model lenet5-tanh] [--batch 64] [--threads 2] [--weights W.safetensors]
//             [--input X.safetensors] [--optimizer adamw|sgd] [--lr X] [--weight-decay X]
//             [--momentum X] [--check-steps 10] [--params-out P.safetensors]
//             [--warmup 10] [--runs 50] [--serve] [--profile] [--seed S]
//
// The model is trained as `kgraph train` (make demo) trains it: the zoo model on an input "image"
// [batch, 1, 28, 28] f32 and a "label" [batch] i64, with outputs "logits" and "loss" =
// kg::cross_entropy(logits, label) (the mean over the batch), lowered with LoweringMode::Training
// and loaded on the cpu with LoadOptions::threads = --threads. One step is
//
//   zero_grad(); forward({image, label}); loss.item(0); backward(); step();
//
// By default the optimiser is the demo's: AdamW, lr 0.002, weight decay 0.01 (PyTorch's betas
// and eps). The batch comes from --input (tensors "input" and "labels", i64 or i32), else it is
// drawn from --seed (standard normal images, uniform labels); the weights from --weights, else
// the default initialisation (seed S).
//
// It first runs --check-steps steps from the loaded weights and prints
// "check_steps=<k> first_loss=<l> last_loss=<l>"; with --params-out the parameters after those
// steps and the loss of each step ("losses", f64 [k]) are written there. Then either
//   - (default) --warmup steps and --runs timed steps (steady clock around each step), and
//     "median_ms=<m> min_ms=<m> p90_ms=<m> runs=<r>"; or
//   - with --serve, it reads commands from standard input, one a line, so that a driver can
//     interleave its blocks of steps with another runtime's: "steps N" runs and times N steps and
//     prints "ms=<t1>,<t2>,...,<tN> loss=<last loss>"; "quit" (or the end of input) ends it.
// --profile finally prints the per-node time of one more step on a model loaded with
// LoadOptions::profile (forward nodes, then the backward nodes).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "kg/io.hpp"
#include "kg/kg.hpp"
#include "kg/models.hpp"

namespace {

struct Args {
  std::string model = "lenet5-tanh";
  std::int64_t batch = 64;
  int threads = 2;
  std::string weights, input, params_out;
  std::string optimizer = "adamw";
  double lr = -1, weight_decay = -1, momentum = 0;  // -1: the optimiser's default
  int check_steps = 10, warmup = 10, runs = 50;
  bool serve = false, profile = false;
  std::uint64_t seed = 0;
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr
      << "cpu_train: " << why << "\n"
      << "usage: cpu_train [--model lenet5-tanh|lenet5] [--batch N] [--threads T] [--weights PATH]\n"
      << "                 [--input PATH] [--optimizer adamw|sgd] [--lr X] [--weight-decay X]\n"
      << "                 [--momentum X] [--check-steps K] [--params-out PATH] [--warmup W]\n"
      << "                 [--runs R] [--serve] [--profile] [--seed S]\n"
      << "defaults: adamw lr 0.002 weight decay 0.01 (make demo's); sgd lr 0.01 momentum 0 weight decay 0\n";
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
    if (flag == "--serve" || flag == "--profile") {
      (flag == "--serve" ? a.serve : a.profile) = true;
      continue;
    }
    if (flag == "--help" || flag == "-h") usage("times a training step of a zoo LeNet-5 on the CPU");
    if (i + 1 >= argc) usage(flag + " needs a value");
    const std::string v = argv[++i];
    if (flag == "--model") {
      if (v != "lenet5-tanh" && v != "lenet5") usage("--model is lenet5-tanh or lenet5, got '" + v + "'");
      a.model = v;
    } else if (flag == "--batch") {
      a.batch = parse_int(flag, v, 1);
    } else if (flag == "--threads") {
      a.threads = static_cast<int>(parse_int(flag, v, 0));
    } else if (flag == "--weights") {
      a.weights = v;
    } else if (flag == "--input") {
      a.input = v;
    } else if (flag == "--params-out") {
      a.params_out = v;
    } else if (flag == "--optimizer") {
      if (v != "adamw" && v != "sgd") usage("--optimizer is adamw or sgd, got '" + v + "'");
      a.optimizer = v;
    } else if (flag == "--lr") {
      a.lr = parse_double(flag, v);
    } else if (flag == "--weight-decay") {
      a.weight_decay = parse_double(flag, v);
    } else if (flag == "--momentum") {
      a.momentum = parse_double(flag, v);
    } else if (flag == "--check-steps") {
      a.check_steps = static_cast<int>(parse_int(flag, v, 0));
    } else if (flag == "--warmup") {
      a.warmup = static_cast<int>(parse_int(flag, v, 0));
    } else if (flag == "--runs") {
      a.runs = static_cast<int>(parse_int(flag, v, 1));
    } else if (flag == "--seed") {
      a.seed = static_cast<std::uint64_t>(parse_int(flag, v, 0));
    } else {
      usage("unknown option " + flag);
    }
  }
  return a;
}

kg::OptimizerOptions optimizer(const Args& a) {
  return kg_bench::optimizer_options(a.optimizer, a.lr, a.momentum, a.weight_decay, 2e-3);
}

// The graph kgraph train builds: inputs image and label, outputs logits and loss.
kg::Model training_model(const std::string& name) {
  const std::vector<std::int64_t> sample = kg::models::input_shape(name, 1);
  std::vector<kg::Dim> dims{kg::Dim::named("batch")};
  for (std::size_t d = 1; d < sample.size(); ++d) dims.emplace_back(sample[d]);
  auto [image, graph] = kg::SymTensor::input(kg::DType::F32, kg::Shape(std::move(dims)), "image");
  kg::SymTensor label = graph->input(kg::DType::I64, kg::Shape({kg::Dim::named("batch")}), "label");
  kg::SymTensor logits = kg::models::record(name, image);
  kg::SymTensor loss = kg::cross_entropy(logits, label, "loss");
  return kg::Model(graph, {{"logits", logits}, {"loss", loss}}, kg::LoweringMode::Training);
}

struct Batch {
  kg::Tensor images, labels;
};

kg::Tensor labels_i64(const kg::Tensor& t, const std::string& path) {
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
  if (!a.input.empty()) {
    auto tensors = kg::read_safetensors(a.input);
    for (const char* key : {"input", "labels"})
      if (!tensors.count(key))
        throw kg::Error("input file '" + a.input + "' has no tensor named '" + key + "'");
    Batch b{tensors.at("input").to(kg::DType::F32).clone(), labels_i64(tensors.at("labels"), a.input)};
    if (b.images.shape() != shape)
      throw kg::Error("input file '" + a.input + "' holds an input " + kg::sizes_to_string(b.images.shape()) +
                      " but " + a.model + " takes " + kg::sizes_to_string(shape) + " at --batch " +
                      std::to_string(n));
    if (b.labels.shape() != std::vector<std::int64_t>{n})
      throw kg::Error("input file '" + a.input + "' holds labels " + kg::sizes_to_string(b.labels.shape()) +
                      ", want [" + std::to_string(n) + "]");
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t c = b.labels.data<std::int64_t>()[i];
      if (c < 0 || c > 9)
        throw kg::Error("input file '" + a.input + "': label " + std::to_string(i) + " is " +
                        std::to_string(c) + ", want 0 to 9");
    }
    return b;
  }
  std::mt19937_64 rng(a.seed + static_cast<std::uint64_t>(n));
  std::normal_distribution<float> z(0.f, 1.f);
  std::uniform_int_distribution<std::int64_t> cls(0, 9);
  Batch b{kg::Tensor::empty(kg::DType::F32, shape), kg::Tensor::empty(kg::DType::I64, {n})};
  for (std::int64_t i = 0; i < b.images.numel(); ++i) b.images.data<float>()[i] = z(rng);
  for (std::int64_t i = 0; i < n; ++i) b.labels.data<std::int64_t>()[i] = cls(rng);
  return b;
}

// A loaded training model and the index of its loss output.
struct Trainer {
  kg::LoadedModel model;
  std::size_t loss_index;

  // One training step, as kgraph train runs it; returns the loss of its forward.
  double step(const Batch& b) {
    model.zero_grad();
    const std::vector<kg::Tensor> outs = model.forward({b.images, b.labels});
    const double loss = outs.at(loss_index).item(0);
    model.backward();
    model.step();
    return loss;
  }
};

Trainer load(const kg::Model& model, const Args& a, const std::vector<std::int64_t>& shape, bool profile) {
  kg::LoadOptions lo;
  lo.seed = a.seed;
  lo.threads = a.threads;
  lo.loss = "loss";
  lo.profile = profile;
  kg::LoadedModel m = model.load(kg::Device::cpu(), {shape, {shape[0]}}, lo);
  if (!a.weights.empty()) m.load_weights(a.weights);
  m.set_training(true);
  m.set_optimizer(optimizer(a));
  const std::vector<std::string> names = m.output_names();
  const auto it = std::find(names.begin(), names.end(), "loss");
  return {std::move(m), static_cast<std::size_t>(it - names.begin())};
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Reads "steps N" / "quit" lines from standard input and answers each "steps N" with one line.
int serve(Trainer& t, const Batch& b) {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream is(line);
    std::string cmd;
    long n = 0;
    is >> cmd;
    if (cmd.empty()) continue;
    if (cmd == "quit") break;
    if (cmd != "steps" || !(is >> n) || n < 1) {
      std::printf("error unknown command '%s' (expected 'steps N' or 'quit')\n", line.c_str());
      std::fflush(stdout);
      continue;
    }
    std::string text;
    double loss = 0;
    for (long i = 0; i < n; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      loss = t.step(b);
      const double ms = ms_since(t0);
      char buf[32];
      std::snprintf(buf, sizeof buf, "%s%.4f", i ? "," : "", ms);
      text += buf;
    }
    std::printf("ms=%s loss=%.9g\n", text.c_str(), loss);
    std::fflush(stdout);
    if (!std::isfinite(loss)) {
      std::fprintf(stderr, "cpu_train: the loss is %g\n", loss);
      return 1;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  try {
    const kg::Model model = training_model(a.model);
    const std::vector<std::int64_t> shape = kg::models::input_shape(a.model, a.batch);
    const Batch b = make_batch(a, shape);
    const auto t_load = std::chrono::steady_clock::now();
    Trainer t = load(model, a, shape, false);
    std::printf("model=%s batch=%lld threads=%d optimizer=\"%s\" weights=%s load_ms=%.1f\n", a.model.c_str(),
                static_cast<long long>(a.batch), a.threads, kg_bench::describe(optimizer(a)).c_str(),
                a.weights.empty() ? ("init-seed-" + std::to_string(a.seed)).c_str() : a.weights.c_str(),
                ms_since(t_load));

    std::vector<double> losses;
    for (int i = 0; i < a.check_steps; ++i) losses.push_back(t.step(b));
    if (!losses.empty())
      std::printf("check_steps=%d first_loss=%.9g last_loss=%.9g\n", a.check_steps, losses.front(),
                  losses.back());
    for (std::size_t i = 0; i < losses.size(); ++i)
      if (!std::isfinite(losses[i])) {
        std::fprintf(stderr, "cpu_train: the loss of check step %zu is %g\n", i + 1, losses[i]);
        return 1;
      }
    if (!a.params_out.empty()) {
      std::map<std::string, kg::Tensor> out = t.model.state_dict();
      out["losses"] = kg::Tensor::from_vector<double>({static_cast<std::int64_t>(losses.size())}, losses);
      kg::write_safetensors(a.params_out, out, {{"model", a.model}, {"optimizer", kg_bench::describe(optimizer(a))}});
    }
    std::fflush(stdout);

    int status = 0;
    if (a.serve) {
      status = serve(t, b);
    } else {
      double last = 0;
      for (int i = 0; i < a.warmup; ++i) last = t.step(b);
      std::vector<double> ms;
      for (int i = 0; i < a.runs; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        last = t.step(b);
        ms.push_back(ms_since(t0));
      }
      const kg_bench::Timing s = kg_bench::summarise(ms);
      std::printf("median_ms=%.4f min_ms=%.4f p90_ms=%.4f runs=%d last_loss=%.9g\n", s.median, s.min, s.p90,
                  a.runs, last);
      if (!std::isfinite(last)) {
        std::fprintf(stderr, "cpu_train: the loss of the last timed step is %g\n", last);
        status = 1;
      }
    }
    if (a.profile) {
      Trainer p = load(model, a, shape, true);
      for (int i = 0; i < 3; ++i) p.step(b);
      double total = 0;
      const std::vector<kg::NodeTime> nodes = p.model.profile();
      for (const auto& n : nodes) total += n.ms;
      std::printf("per-node ms of one training step (forward and backward nodes): %.3f ms in all\n", total);
      for (const auto& n : nodes)
        std::printf("  %-24s %-36s %9.4f  %5.1f%%\n", n.node.c_str(), n.op.c_str(), n.ms,
                    total > 0 ? 100.0 * n.ms / total : 0.0);
    }
    return status;
  } catch (const kg::Error& e) {
    std::fprintf(stderr, "cpu_train: error: %s\n", e.what());
    return 1;
  }
}
