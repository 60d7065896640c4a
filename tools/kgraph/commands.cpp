// The kgraph subcommands: models, inspect, run.
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

#include "graph/dump.hpp"
#include "graph/render.hpp"
#include "kg/io.hpp"
#include "kg/kg.hpp"
#include "kg/models.hpp"
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

// The zoo models take one input; anything else is a model this tool does not know how to feed.
const kg::Node& single_input(const kg::Model& model, const std::string& name) {
  const kg::Graph& g = model.graph();
  if (g.inputs().size() != 1)
    throw kg::Error(
        kg::util::cat("model '", name, "' has ", g.inputs().size(), " inputs; kgraph feeds exactly one"));
  return g.node(g.inputs()[0]);
}

kg::DType output_dtype(const kg::Model& model, std::size_t i) {
  return model.graph().node(model.outputs().at(i).second).dtype;
}

void write_text_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) throw kg::Error("cannot open '" + path + "' for writing");
  f << text;
  f.close();
  if (!f) throw kg::Error("error writing '" + path + "'");
}

// The input tensor of `kgraph run`: read from a safetensors file or drawn at random.
kg::Tensor make_input(const RunArgs& args, const kg::Node& input, std::string* description) {
  if (!args.input_path.empty()) {
    auto tensors = kg::read_safetensors(args.input_path);
    const kg::Tensor* t = nullptr;
    std::string tname;
    if (tensors.size() == 1) {
      tname = tensors.begin()->first;
      t = &tensors.begin()->second;
    } else if (auto it = tensors.find(input.name); it != tensors.end()) {
      tname = it->first;
      t = &it->second;
    } else {
      std::vector<std::string> names;
      for (const auto& kv : tensors) names.push_back(kv.first);
      throw kg::Error(kg::util::cat("input file '", args.input_path, "' has ", tensors.size(), " tensors (",
                                    kg::util::join(names, ", "), "); expected one tensor or one named '",
                                    input.name, "'"));
    }
    if (t->rank() == 0)
      throw kg::Error(kg::util::cat("input file '", args.input_path, "': tensor '", tname,
                                    "' is a scalar; the model takes ", input.shape.to_string()));
    const std::int64_t batch = t->dim(0);
    if (args.batch && *args.batch != batch)
      throw kg::Error(kg::util::cat("--batch ", *args.batch, " disagrees with the input file '",
                                    args.input_path, "', whose tensor '", tname, "' has batch ", batch, " (",
                                    kg::sizes_to_string(t->shape()), ")"));
    const auto want = kg::models::input_shape(args.model, batch);
    if (t->shape() != want)
      throw kg::Error(kg::util::cat("input file '", args.input_path, "': tensor '", tname, "' is ",
                                    kg::sizes_to_string(t->shape()), " but ", args.model, " takes ",
                                    kg::sizes_to_string(want), " for batch ", batch));
    if (t->dtype() != input.dtype && !(kg::is_floating(t->dtype()) && kg::is_floating(input.dtype)))
      throw kg::Error(kg::util::cat("input file '", args.input_path, "': tensor '", tname, "' is ",
                                    kg::dtype_name(t->dtype()), " but the model's input is ",
                                    kg::dtype_name(input.dtype)));
    *description = kg::util::cat("tensor '", tname, "' of ", args.input_path);
    return t->dtype() == input.dtype ? *t : t->to(input.dtype);
  }
  if (!kg::is_floating(input.dtype))
    throw kg::Error(kg::util::cat("random inputs need a float input; ", args.model, "'s input is ",
                                  kg::dtype_name(input.dtype)));
  const auto shape = kg::models::input_shape(args.model, args.batch.value_or(1));
  kg::Tensor x = kg::Tensor::empty(kg::DType::F64, shape);
  std::mt19937_64 rng(args.seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  double* d = x.data<double>();
  for (std::int64_t i = 0; i < x.numel(); ++i) d[i] = u(rng);
  *description = kg::util::cat("random U(-1, 1), seed ", args.seed);
  return x.to(input.dtype);
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

}  // namespace

void list_models(std::ostream& out) {
  std::vector<std::vector<std::string>> rows{{"name", "input", "output", "parameters"}};
  for (const auto& name : kg::models::names()) {
    kg::Model model = kg::models::build(name);
    const kg::Node& in = single_input(model, name);
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
  std::ostream& out = dot_to_stdout ? discarded : stdout_stream;

  if (!args.render_path.empty()) kg::dump::render_format(args.render_path);  // fail before any work
  const auto mode = args.recorded ? kg::LoweringMode::Training : kg::LoweringMode::Inference;
  kg::Model model = kg::models::build(args.model, mode);
  const kg::Node& input = single_input(model, args.model);
  out << "model " << args.model << "\n" << model.summary();

  if (args.batch) {
    const auto shape = kg::models::input_shape(args.model, *args.batch);
    kg::LoadedModel loaded = model.load(kg::Device::cpu(), {shape});
    out << "\nloaded on cpu for batch " << *args.batch << ":\n";
    out << "  input " << input.name << ": " << kg::sizes_to_string(loaded.input_shapes().at(0)) << " "
        << kg::dtype_name(input.dtype) << "\n";
    const auto names = loaded.output_names();
    const auto shapes = loaded.output_shapes();
    for (std::size_t i = 0; i < names.size(); ++i)
      out << "  output " << names[i] << ": " << kg::sizes_to_string(shapes.at(i)) << " "
          << kg::dtype_name(output_dtype(model, i)) << "\n";
    out << "memory plan: " << loaded.memory_plan().to_string() << "\n";
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
}

void run(const RunArgs& args, std::ostream& out) {
  const kg::Device device = kg::Device::parse(args.device);
  kg::Model model = kg::models::build(args.model);
  const kg::Node& input_node = single_input(model, args.model);
  std::string input_description;
  kg::Tensor input = make_input(args, input_node, &input_description);

  kg::LoadOptions options;
  options.seed = args.seed;
  options.checked = args.checked;
  std::optional<kg::LoadedModel> loaded_or;
  try {
    loaded_or.emplace(model.load(device, {input.shape()}, options));
  } catch (const kg::Error& e) {
    throw kg::Error(kg::util::cat("cannot load ", args.model, " on ", device.to_string(), ": ", e.what()));
  }
  kg::LoadedModel& loaded = *loaded_or;
  std::string weights_description = kg::util::cat("default initialisation, seed ", args.seed);
  if (!args.weights_path.empty()) {
    loaded.load_weights(args.weights_path);
    weights_description = args.weights_path;
  }

  out << "model " << args.model << " on " << loaded.device().to_string()
      << (args.checked ? " (checked: every kernel's writes verified)" : "") << "\n";
  out << "input " << input_node.name << ": " << kg::sizes_to_string(input.shape()) << " "
      << kg::dtype_name(input.dtype()) << ", " << input_description << "\n";
  out << "weights: " << weights_description << "\n";

  std::vector<kg::Tensor> outputs;
  std::vector<double> times;
  for (int r = 0; r < args.runs; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    outputs = loaded.forward({input});
    const auto t1 = std::chrono::steady_clock::now();
    times.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  const auto names = loaded.output_names();
  for (std::size_t i = 0; i < outputs.size(); ++i) print_output(out, names.at(i), outputs[i]);

  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  const std::size_t n = sorted.size();
  const double median = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  out << "time: median " << format_ms(median) << " over " << n << (n == 1 ? " run" : " runs") << " (min "
      << format_ms(sorted.front()) << ", max " << format_ms(sorted.back()) << ")\n";

  if (!args.output_path.empty()) {
    std::map<std::string, kg::Tensor> tensors;
    for (std::size_t i = 0; i < outputs.size(); ++i) tensors.emplace(names.at(i), outputs[i]);
    kg::write_safetensors(args.output_path, tensors);
    out << "wrote " << outputs.size() << (outputs.size() == 1 ? " output" : " outputs") << " to "
        << args.output_path << "\n";
  }
}

}  // namespace kgraph
