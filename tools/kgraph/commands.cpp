// The kgraph subcommands: models, inspect, run (MODEL: a zoo name or an ONNX file).
#include "commands.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "graph/dump.hpp"
#include "compile/tuning_cache.hpp"
#include "graph/render.hpp"
#include "kg/io.hpp"
#include "kg/kg.hpp"
#include "kg/models.hpp"
#include "plan/shape_binding.hpp"
#include "profile.hpp"
#include "util/file.hpp"
#include "util/memory.hpp"
#include "util/str.hpp"

namespace kgraph {
namespace {

std::string format_number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

std::string format_ms(double ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f ms", ms);
  return buf;
}

// A floating tensor of `dtype` drawn uniformly from [-1, 1).
kg::Tensor uniform_tensor(std::mt19937_64& rng, kg::DType dtype, const std::vector<std::int64_t>& shape) {
  kg::Tensor x = kg::Tensor::empty(kg::DType::F64, shape);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  double* d = x.data<double>();
  for (std::int64_t k = 0; k < x.numel(); ++k) d[k] = u(rng);
  return x.to(dtype);
}

// Inputs for a profiled run: uniform in [-1, 1) for floating inputs (never zeros, on which the
// GPU draws less power and may run faster than on real data), zeros for integer ones (indices).
std::vector<kg::Tensor> profile_inputs(const ModelSource& source, const kg::LoadedModel& loaded) {
  std::mt19937_64 rng(0x6b67'7261'7068ULL);
  std::vector<kg::Tensor> v;
  for (const auto& shape : loaded.input_shapes()) {
    const kg::DType dt = source.inputs().at(v.size()).dtype;
    v.push_back(kg::is_floating(dt) ? uniform_tensor(rng, dt, shape) : kg::Tensor::zeros(dt, shape));
  }
  return v;
}

kg::DType output_dtype(const kg::Model& model, std::size_t i) {
  return model.graph().node(model.outputs().at(i).second).dtype;
}

// An output file the user named: written through a new temporary and a rename; a device node, FIFO,
// folder or link at the path is refused, never replaced or written through.
void write_text_file(const std::string& path, const std::string& text) {
  kg::util::write_file_safely(path, text, "output file");
}

std::vector<std::string> shapes_to_strings(const std::vector<std::vector<std::int64_t>>& shapes) {
  std::vector<std::string> v;
  for (const auto& s : shapes) v.push_back(kg::sizes_to_string(s));
  return v;
}

// The tensors of an input file matched to the model's inputs: by input name (tensors that are not
// inputs are left out), or the only tensor of the file for a single-input model.
std::vector<std::pair<std::string, kg::Tensor>> match_input_file(const ModelSource& source,
                                                                 const std::string& path) {
  auto tensors = kg::read_safetensors(path);
  const auto& inputs = source.inputs();
  std::vector<std::pair<std::string, kg::Tensor>> matched;
  std::vector<std::string> missing;
  for (const auto& in : inputs) {
    if (auto it = tensors.find(in.name); it != tensors.end())
      matched.emplace_back(it->first, it->second);
    else
      missing.push_back(in.name);
  }
  if (missing.empty()) return matched;
  if (inputs.size() == 1 && tensors.size() == 1) return {{tensors.begin()->first, tensors.begin()->second}};

  std::vector<std::string> names;
  for (const auto& kv : tensors) names.push_back(kv.first);
  if (inputs.size() == 1)
    throw kg::Error(kg::util::cat("input file '", path, "' has ", tensors.size(), " tensors (",
                                  kg::util::join(names, ", "), "); expected one tensor or one named '",
                                  inputs[0].name, "'"));
  std::vector<std::string> input_names;
  for (const auto& in : inputs) input_names.push_back(in.name);
  throw kg::Error(kg::util::cat(
      "input file '", path, "' has no tensor named '", kg::util::join(missing, "' or '"),
      "' (its tensors: ", names.empty() ? std::string("none") : kg::util::join(names, ", "), "); ",
      source.name(), "'s inputs ", kg::util::join(input_names, ", "), " are matched by name"));
}

// The inputs of `kgraph run` read from a safetensors file, in the model's input order.
// `descriptions` says where each came from.
std::vector<kg::Tensor> read_inputs(const RunArgs& args, const ModelSource& source, DimBinding* binding,
                                    std::vector<std::string>* descriptions) {
  const auto& inputs = source.inputs();
  std::vector<kg::Tensor> out;
  const auto matched = match_input_file(source, args.input_path);
  *binding = source.bind_tensors(matched, args.input_path, args.dims);
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const auto& [tname, t] = matched[i];
    out.push_back(t.dtype() == inputs[i].dtype ? t : t.to(inputs[i].dtype));
    descriptions->push_back(kg::util::cat("tensor '", tname, "' of ", args.input_path));
  }
  return out;
}

// The bytes random_inputs() allocates at its peak for `shapes`: each input, and for a floating one
// the f64 draw it is converted from. Empty when that overflows 64 bits.
std::optional<std::uint64_t> random_input_bytes(const ModelSource& source,
                                                const std::vector<std::vector<std::int64_t>>& shapes) {
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    std::uint64_t numel = 1;
    for (std::int64_t d : shapes[i]) {
      const auto r = kg::util::checked_mul(numel, static_cast<std::uint64_t>(std::max<std::int64_t>(d, 0)));
      if (!r) return std::nullopt;
      numel = *r;
    }
    const kg::DType dt = source.inputs().at(i).dtype;
    const std::uint64_t per = kg::dtype_size(dt) + (kg::is_floating(dt) || dt != kg::DType::I64 ? 8 : 0);
    const auto bytes = kg::util::checked_mul(numel, per);
    if (!bytes) return std::nullopt;
    const auto sum = kg::util::checked_add(total, *bytes);
    if (!sum) return std::nullopt;
    total = *sum;
  }
  return total;
}

// Random inputs of `kgraph run` for `shapes` (floats uniform in [-1, 1), integers and bools from
// {0, 1}: valid token ids for any vocabulary, and a valid mask), made only after the memory they
// take (with the loaded model's `model_bytes`) has been checked against what is available.
std::vector<kg::Tensor> random_inputs(const RunArgs& args, const ModelSource& source,
                                      const std::vector<std::vector<std::int64_t>>& shapes,
                                      std::uint64_t model_bytes, std::vector<std::string>* descriptions) {
  const auto& inputs = source.inputs();
  if (!kg::util::memory_check_disabled()) {
    const auto need = random_input_bytes(source, shapes);
    const auto avail = kg::util::available_memory();
    if (!need || (avail && (model_bytes > avail->bytes || *need > avail->bytes - model_bytes)))
      throw kg::Error(kg::util::cat(
          "the random inputs of ", args.model, " for ", kg::util::join(shapes_to_strings(shapes), ", "), " need ",
          need ? kg::util::cat(*need, " bytes (", kg::util::format_bytes(*need), ")") : std::string("more than 2^64 bytes"),
          " beside the loaded model's ", model_bytes, " bytes, but ", avail ? avail->bytes : 0, " bytes (",
          kg::util::format_bytes(avail ? avail->bytes : 0), ") are available",
          avail ? " (" + avail->source + ")" : std::string(),
          "; use a smaller --batch or --dim, or set KG_NO_MEMORY_CHECK=1 to allocate anyway"));
  }
  std::vector<kg::Tensor> out;
  std::mt19937_64 rng(args.seed);
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const kg::DType dtype = inputs[i].dtype;
    if (kg::is_floating(dtype)) {
      out.push_back(uniform_tensor(rng, dtype, shapes[i]));
      descriptions->push_back(kg::util::cat("random U(-1, 1), seed ", args.seed));
    } else {
      kg::Tensor x = kg::Tensor::empty(kg::DType::I64, shapes[i]);
      std::uniform_int_distribution<std::int64_t> u(0, 1);
      std::int64_t* d = x.data<std::int64_t>();
      for (std::int64_t k = 0; k < x.numel(); ++k) d[k] = u(rng);
      out.push_back(dtype == kg::DType::I64 ? x : x.to(dtype));
      descriptions->push_back(kg::util::cat("random ", dtype == kg::DType::Bool ? "bools" : "integers",
                                            " from {0, 1}, seed ", args.seed));
    }
  }
  return out;
}

void print_output(std::ostream& out, const std::string& name, const kg::Tensor& t) {
  out << "output " << name << ": " << kg::sizes_to_string(t.shape()) << " " << kg::dtype_name(t.dtype())
      << "\n";
  const std::int64_t shown = std::min<std::int64_t>(t.numel(), 8);
  out << "  first values:";
  for (std::int64_t i = 0; i < shown; ++i) out << (i ? ", " : " ") << format_number(t.item(i));
  if (shown < t.numel()) out << " (" << shown << " of " << t.numel() << ")";
  out << "\n";
  if (t.rank() != 2 || t.dim(1) < 2) return;
  const std::int64_t rows = t.dim(0), cols = t.dim(1);
  const std::int64_t k = std::min<std::int64_t>(5, cols);
  const std::int64_t max_rows = 8;
  for (std::int64_t r = 0; r < std::min(rows, max_rows); ++r) {
    auto value = [&](std::int64_t j) {
      double v = t.item(r * cols + j);
      return std::isnan(v) ? -INFINITY : v;
    };
    std::vector<std::int64_t> idx(static_cast<std::size_t>(cols));
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](std::int64_t a, std::int64_t b) {
      const double va = value(a), vb = value(b);
      return va > vb || (va == vb && a < b);
    });
    out << "  row " << r << ": top-" << k;
    for (std::int64_t i = 0; i < k; ++i) {
      const std::int64_t j = idx[static_cast<std::size_t>(i)];
      out << (i ? ", " : " ") << j << " (" << format_number(t.item(r * cols + j)) << ")";
    }
    out << "\n";
  }
  if (rows > max_rows) out << "  ... " << rows - max_rows << " more rows\n";
}

// The times of the timed runs, in ms: the median (the mean of the middle two for an even count),
// p90 and p99 (nearest rank: the smallest time with at least that share of the runs at or below it),
// min and max.
struct TimeStats {
  double median = 0, p90 = 0, p99 = 0, min = 0, max = 0;
};

TimeStats time_stats(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  const std::size_t n = ms.size();
  if (n == 0) return {};
  auto rank = [&](double p) {
    const auto k = static_cast<std::size_t>(std::ceil(p / 100.0 * static_cast<double>(n)));
    return ms[std::clamp<std::size_t>(k, 1, n) - 1];
  };
  TimeStats s;
  s.median = n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
  s.p90 = rank(90);
  s.p99 = rank(99);
  s.min = ms.front();
  s.max = ms.back();
  return s;
}

nlohmann::json stats_json(const TimeStats& s) {
  return {{"median_ms", s.median}, {"p90_ms", s.p90}, {"p99_ms", s.p99}, {"min_ms", s.min}, {"max_ms", s.max}};
}

// Throughput at the median time: samples/s where the first input has a batch dim (its dim 0),
// else runs/s.
struct Throughput {
  double value = 0;
  std::string unit;
  std::int64_t samples_per_run = 1;
};

Throughput throughput(const std::vector<kg::Tensor>& inputs, double median_ms) {
  Throughput t;
  const bool batched = !inputs.empty() && inputs[0].rank() >= 1;
  t.samples_per_run = batched ? inputs[0].dim(0) : 1;
  t.unit = batched ? "samples/s" : "runs/s";
  t.value = median_ms > 0 ? static_cast<double>(t.samples_per_run) * 1e3 / median_ms : 0;
  return t;
}

// A tensor's name, shape and dtype, and for an output the min, max and mean of its finite values
// and the count of those that are not (NaN, ±inf).
nlohmann::json tensor_json(const std::string& name, const kg::Tensor& t, bool summary) {
  nlohmann::json j{{"name", name}, {"shape", t.shape()}, {"dtype", std::string(kg::dtype_name(t.dtype()))}};
  if (!summary) return j;
  double lo = INFINITY, hi = -INFINITY, sum = 0;
  std::int64_t finite = 0;
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const double v = t.item(i);
    if (!std::isfinite(v)) continue;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
    sum += v;
    ++finite;
  }
  j["min"] = finite ? nlohmann::json(lo) : nlohmann::json(nullptr);
  j["max"] = finite ? nlohmann::json(hi) : nlohmann::json(nullptr);
  j["mean"] = finite ? nlohmann::json(sum / static_cast<double>(finite)) : nlohmann::json(nullptr);
  j["non_finite"] = t.numel() - finite;
  return j;
}

// Which nodes of a reduced-precision load run in it, which keep f32, and the casts between.
void print_precision(std::ostream& out, const kg::LoadedModel& loaded, kg::DType precision) {
  std::vector<std::string> low, kept, casts;
  const kg::Graph& g = loaded.graph();
  for (const kg::Node& n : g.nodes()) {
    if (n.kind != kg::Node::Kind::Op) continue;
    if (n.op_name() == "pw.cast") {
      casts.push_back(n.name);
    } else if (n.dtype == precision) {
      low.push_back(n.name);
    } else if (kg::is_floating(n.dtype)) {
      kept.push_back(n.name + " (" + n.op_name() + ", " + std::string(kg::dtype_name(n.dtype)) + ")");
    }
  }
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
    return s;
  };
  out << "precision " << kg::dtype_name(precision) << ": " << low.size() << " nodes in "
      << kg::dtype_name(precision) << ", " << kept.size() << " kept in their recorded dtype"
      << (kept.empty() ? "" : ": " + list(kept)) << "; " << casts.size() << " casts"
      << (casts.empty() ? "" : ": " + list(casts)) << "\n";
}

}  // namespace

void list_models(std::ostream& out) {
  std::vector<std::vector<std::string>> rows{{"name", "input", "output", "parameters"}};
  for (const auto& name : kg::models::names()) {
    const ModelSource source = ModelSource::open(name);
    const kg::Model& model = source.model();
    const auto& in = source.inputs().at(0);
    long long count = 0;
    for (const auto& p : model.parameters()) count += kg::numel_of(p.shape);
    const kg::Node& o = model.graph().node(model.outputs().at(0).second);
    rows.push_back({name, in.shape.to_string() + " " + std::string(kg::dtype_name(in.dtype)),
                    model.outputs().at(0).first + " " + o.shape.to_string(), kg::dump::group_digits(count)});
  }
  std::vector<std::size_t> width(rows[0].size(), 0);
  for (const auto& r : rows)
    for (std::size_t c = 0; c < r.size(); ++c) width[c] = std::max(width[c], r[c].size());
  for (const auto& r : rows) {
    std::string line;
    for (std::size_t c = 0; c < r.size(); ++c) {
      std::string cell = r[c];
      if (c + 1 < r.size()) cell += std::string(width[c] - cell.size() + 2, ' ');
      line += cell;
    }
    out << line << "\n";
  }
}

void inspect(const InspectArgs& args, std::ostream& stdout_stream) {
  // With `--dot -` the DOT text is the only thing written to standard output.
  const bool dot_to_stdout = args.dot_path == "-";
  std::ostringstream discarded;
  std::ostream& out = dot_to_stdout || args.json ? discarded : stdout_stream;
  if (dot_to_stdout && args.json)
    throw kg::Error("inspect --json and --dot - would both write to standard output: give --dot a FILE");

  if (!args.render_path.empty()) kg::dump::render_format(args.render_path);  // fail before any work
  if (!args.dot_path.empty() && !dot_to_stdout) kg::util::check_output_path(args.dot_path, "--dot file");
  // graphviz writes the rendering itself: what stands at the path is checked here, before it runs.
  if (!args.render_path.empty()) kg::util::check_output_path(args.render_path, "--render file");
  const ModelSource source =
      ModelSource::open(args.model, kg::LoweringMode::Inference, {.fusion = !args.recorded});
  const kg::Model& model = source.model();
  std::optional<DimBinding> binding;  // checked before anything is printed
  if (!args.dims.empty()) binding = source.bind(args.dims);
  out << "model " << args.model << "\n" << model.summary();
  nlohmann::json j;                                     // with --json
  std::vector<std::vector<std::int64_t>> concrete;      // with --json and sizes: each node's shape

  const kg::Device device = kg::Device::parse(args.device);
  if (!binding && device.kind != kg::Device::Kind::Cpu)
    throw kg::Error("inspect --device " + args.device + " needs --batch or --dim: the sizes to load for");
  if (binding) {
    kg::LoadOptions options;
    options.profile = device.kind == kg::Device::Kind::Cuda;
    options.precision = *kg::parse_dtype(args.precision);
    kg::LoadedModel loaded = model.load(device, source.shapes(*binding), options);
    out << "\nloaded on " << device.to_string() << " for " << binding->to_string() << ":\n";
    const auto in_shapes = loaded.input_shapes();
    for (std::size_t i = 0; i < source.inputs().size(); ++i)
      out << "  input " << source.inputs()[i].name << ": " << kg::sizes_to_string(in_shapes.at(i)) << " "
          << kg::dtype_name(source.inputs()[i].dtype) << "\n";
    const auto names = loaded.output_names();
    const auto shapes = loaded.output_shapes();
    for (std::size_t i = 0; i < names.size(); ++i)
      out << "  output " << names[i] << ": " << kg::sizes_to_string(shapes.at(i)) << " "
          << kg::dtype_name(output_dtype(model, i)) << "\n";
    out << "memory plan: " << loaded.memory_plan().to_string() << "\n";
    if (args.json) {
      std::vector<int> live = model.live_nodes();
      std::sort(live.begin(), live.end());
      concrete = kg::plan::bind_shapes(model.graph(), live, loaded.input_shapes()).node_shapes;
      const kg::MemoryPlan& plan = loaded.memory_plan();
      j["loaded"] = {{"device", device.to_string()},
                     {"sizes", binding->to_string()},
                     {"precision", args.precision},
                     {"memory_plan",
                      {{"arena_bytes", plan.arena_bytes},
                       {"unshared_bytes", plan.unshared_bytes},
                       {"param_bytes", plan.param_bytes},
                       {"peak_bytes", plan.peak_bytes},
                       {"buffers", plan.buffers}}}};
      j["loaded"]["inputs"] = nlohmann::json::array();
      for (std::size_t i = 0; i < source.inputs().size(); ++i)
        j["loaded"]["inputs"].push_back({{"name", source.inputs()[i].name},
                                         {"shape", in_shapes.at(i)},
                                         {"dtype", std::string(kg::dtype_name(source.inputs()[i].dtype))}});
      j["loaded"]["outputs"] = nlohmann::json::array();
      for (std::size_t i = 0; i < names.size(); ++i)
        j["loaded"]["outputs"].push_back({{"name", names[i]},
                                          {"shape", shapes.at(i)},
                                          {"dtype", std::string(kg::dtype_name(output_dtype(model, i)))}});
    }
    if (options.precision != kg::DType::F32) print_precision(out, loaded, options.precision);
    if (options.profile) {
      // One run on random inputs (the second one: the first also warms the caches), node by node.
      const std::vector<kg::Tensor> inputs = profile_inputs(source, loaded);
      for (int r = 0; r < 2; ++r) loaded.forward(inputs);
      out << "tactics (one run, each node timed alone):\n";
      double total = 0;
      for (const auto& t : loaded.profile()) {
        out << "  " << t.node << "  " << t.op << "  " << t.kernel << "  " << format_ms(t.ms) << "\n";
        total += t.ms;
      }
      out << "  total " << format_ms(total) << "\n";
    }
  }

  if (args.json) {
    const kg::Graph& g = model.graph();
    j["model"] = args.model;
    j["nodes"] = nlohmann::json::array();
    for (std::size_t id = 0; id < g.nodes().size(); ++id) {
      const kg::Node& n = g.nodes()[id];
      nlohmann::json node{{"name", n.name},
                          {"op", n.op_name()},
                          {"dtype", std::string(kg::dtype_name(n.dtype))},
                          {"shape", n.shape.to_string()}};
      nlohmann::json ins = nlohmann::json::array();
      for (int in : n.inputs) ins.push_back(g.node(in).name);
      node["inputs"] = std::move(ins);
      if (id < concrete.size() && !concrete[id].empty()) node["concrete_shape"] = concrete[id];
      j["nodes"].push_back(std::move(node));
    }
  }

  if (!args.dot_path.empty()) {
    const std::string dot = model.to_dot();
    if (dot_to_stdout) {
      stdout_stream << dot;
    } else {
      write_text_file(args.dot_path, dot);
      out << "wrote the DOT graph to " << args.dot_path << "\n";
    }
  }
  if (!args.render_path.empty()) {
    kg::dump::render_dot(model.to_dot(), args.render_path);
    out << "rendered the graph to " << args.render_path << "\n";
  }
  if (args.json) stdout_stream << j.dump(2) << "\n";
}

void tune(const TuneArgs& args, std::ostream& out) {
  const kg::Device device = kg::Device::parse(args.device);
  if (device.kind != kg::Device::Kind::Cuda)
    throw kg::Error("tune measures tactics on a GPU (--device cuda or cuda:N); on the CPU, 'kgraph run --tune' "
                    "times oneDNN's implementations and batch slices at each tuned load");
  const ModelSource source = ModelSource::open(args.model);
  const kg::Model& model = source.model();
  const DimBinding binding = source.bind(args.dims);
  kg::compile::TuningCache& cache = kg::compile::TuningCache::global();
  if (args.fresh) cache.clear();
  kg::LoadOptions options;
  options.tune = true;
  options.profile = true;
  options.tf32 = args.tf32;
  options.precision = *kg::parse_dtype(args.precision);
  auto timed_load = [&](const kg::LoadOptions& o) {
    const auto t0 = std::chrono::steady_clock::now();
    kg::LoadedModel m = model.load(device, source.shapes(binding), o);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return std::pair{std::move(m), ms};
  };
  auto [tuned, tuned_ms] = timed_load(options);
  out << "model " << args.model << " on " << device.to_string() << " for " << binding.to_string() << ", "
      << args.precision << (args.tf32 ? " (tf32)" : "") << ": tuned load " << format_ms(tuned_ms) << "\n";
  const std::vector<kg::Tensor> inputs = profile_inputs(source, tuned);
  for (int r = 0; r < 2; ++r) tuned.forward(inputs);
  out << "tactics (one run, each node timed alone):\n";
  double total = 0;
  for (const auto& t : tuned.profile()) {
    out << "  " << t.node << "  " << t.op << "  " << t.kernel << "  " << format_ms(t.ms) << "\n";
    total += t.ms;
  }
  out << "  total " << format_ms(total) << "\n";
  options.tune = false;
  options.profile = false;
  const double later_ms = timed_load(options).second;
  out << "a later load reads the kept choices: " << format_ms(later_ms) << " (untuned, from the tuning cache "
      << (cache.dir().empty() ? std::string("in memory only: no private cache folder")
                              : cache.dir().string())
      << ")\n";
}

void run(const RunArgs& args, std::ostream& json_out) {
  // With --json the text is not printed: the JSON object is the only thing on standard output.
  std::ostringstream discarded;
  std::ostream& out = args.json ? discarded : json_out;
  const kg::Device device = kg::Device::parse(args.device);
  if (!args.output_path.empty()) kg::util::check_output_path(args.output_path, "--output file");  // before any work
  const ModelSource source = ModelSource::open(args.model);
  const kg::Model& model = source.model();
  DimBinding binding;
  std::vector<std::string> input_descriptions;
  // Inputs from a file are read first (their shapes set the dims); random ones are made after the
  // load, whose memory plan check comes before anything sized by --batch or --dim is allocated.
  std::vector<kg::Tensor> inputs;
  std::vector<std::vector<std::int64_t>> input_shapes;
  if (!args.input_path.empty()) {
    inputs = read_inputs(args, source, &binding, &input_descriptions);
    for (const auto& t : inputs) input_shapes.push_back(t.shape());
  } else {
    binding = source.bind(args.dims);
    input_shapes = source.shapes(binding);
  }

  kg::LoadOptions options;
  options.seed = args.seed;
  options.checked = args.checked;
  options.tf32 = args.tf32;
  options.vendor_libraries = !args.no_vendor;
  options.channels_last = !args.no_channels_last;
  options.tune = args.tune;
  options.cuda_graph = !args.no_cuda_graph;
  options.threads = args.threads;
  options.profile = args.profile;
  options.precision = *kg::parse_dtype(args.precision);
  std::optional<kg::LoadedModel> loaded_or;
  try {
    loaded_or.emplace(model.load(device, input_shapes, options));
  } catch (const kg::Error& e) {
    throw kg::Error(kg::util::cat("cannot load ", args.model, " on ", device.to_string(), ": ", e.what()));
  }
  kg::LoadedModel& loaded = *loaded_or;
  if (args.input_path.empty())
    inputs = random_inputs(args, source, input_shapes, loaded.memory_plan().peak_bytes, &input_descriptions);
  std::string weights_description = source.is_file()
                                        ? kg::util::cat("the initializers of ", args.model)
                                        : kg::util::cat("default initialisation, seed ", args.seed);
  if (!args.weights_path.empty()) {
    loaded.load_weights(args.weights_path);
    weights_description = args.weights_path;
  }

  out << "model " << args.model << " on " << loaded.device().to_string()
      << (options.precision != kg::DType::F32 ? kg::util::cat(" in ", args.precision) : std::string())
      << (args.checked ? " (checked: every kernel's writes verified)" : "") << "\n";
  for (std::size_t i = 0; i < inputs.size(); ++i)
    out << "input " << source.inputs()[i].name << ": " << kg::sizes_to_string(inputs[i].shape()) << " "
        << kg::dtype_name(inputs[i].dtype()) << ", " << input_descriptions[i] << "\n";
  out << "weights: " << weights_description << "\n";

  std::vector<kg::Tensor> outputs;
  for (int r = 0; r < args.warmup; ++r) outputs = loaded.forward(inputs);
  std::vector<double> times, device_times;
  for (int r = 0; r < args.runs; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    outputs = loaded.forward(inputs);
    const auto t1 = std::chrono::steady_clock::now();
    times.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    device_times.push_back(loaded.last_device_ms());
  }
  const auto names = loaded.output_names();
  for (std::size_t i = 0; i < outputs.size(); ++i) print_output(out, names.at(i), outputs[i]);

  const bool cuda = loaded.device().kind == kg::Device::Kind::Cuda;
  const TimeStats host = time_stats(times);
  const TimeStats dev = time_stats(device_times);
  const Throughput rate = throughput(inputs, host.median);
  auto report = [&](const char* what, const TimeStats& s) {
    out << what << ": median " << format_ms(s.median) << " over " << times.size()
        << (times.size() == 1 ? " run" : " runs") << " after " << args.warmup << " warm-up"
        << (args.warmup == 1 ? "" : "s") << " (p90 " << format_ms(s.p90) << ", p99 " << format_ms(s.p99) << ", min "
        << format_ms(s.min) << ", max " << format_ms(s.max) << ")\n";
  };
  if (cuda) {
    report("device time (CUDA events)", dev);
    report("time with host copies", host);
  } else {
    report("time", host);
  }
  out << "throughput: " << format_number(rate.value) << " " << rate.unit << " at the median"
      << (cuda ? " time with host copies" : "")
      << (rate.unit == "samples/s" ? kg::util::cat(" (", rate.samples_per_run, " per run: the first input's dim 0)")
                                   : std::string())
      << "\n";
  if (args.profile) print_profile(out, model, loaded, times.back());

  std::string json_text;  // printed last: after the output file is written
  if (args.json) {
    nlohmann::json j;
    j["model"] = args.model;
    j["device"] = loaded.device().to_string();
    j["precision"] = args.precision;
    j["weights"] = weights_description;
    j["inputs"] = nlohmann::json::array();
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      nlohmann::json in = tensor_json(source.inputs()[i].name, inputs[i], false);
      in["source"] = input_descriptions[i];
      j["inputs"].push_back(std::move(in));
    }
    j["outputs"] = nlohmann::json::array();
    for (std::size_t i = 0; i < outputs.size(); ++i) j["outputs"].push_back(tensor_json(names.at(i), outputs[i], true));
    j["times"] = {{"warmup", args.warmup},
                  {"runs", args.runs},
                  {"host", stats_json(host)},
                  {"device", cuda ? stats_json(dev) : nlohmann::json(nullptr)}};
    j["throughput"] = {{"value", rate.value}, {"unit", rate.unit}, {"samples_per_run", rate.samples_per_run}};
    if (args.profile) {
      nlohmann::json nodes = nlohmann::json::array();
      for (const auto& t : loaded.profile())
        nodes.push_back({{"node", t.node},
                         {"op", t.op},
                         {"kernel", t.kernel.empty() ? nlohmann::json(nullptr) : nlohmann::json(t.kernel)},
                         {"ms", t.ms}});
      j["profile"] = std::move(nodes);
    }
    if (!args.output_path.empty()) j["output_file"] = args.output_path;
    json_text = j.dump(2) + "\n";
  }

  if (!args.output_path.empty()) {
    std::map<std::string, kg::Tensor> tensors;
    for (std::size_t i = 0; i < outputs.size(); ++i) tensors.emplace(names.at(i), outputs[i]);
    kg::write_safetensors(args.output_path, tensors);
    out << "wrote " << outputs.size() << (outputs.size() == 1 ? " output" : " outputs") << " to "
        << args.output_path << "\n";
  }
  json_out << json_text;
}

}  // namespace kgraph
