// kgraph compile: compiles a model's kernels (a zoo model or an ONNX file; or every built-in
// kernel file) for a GPU architecture with NVRTC, without needing a GPU, and warms the disk cache.
#include <algorithm>
#include <chrono>
#include <set>
#include <sstream>
#include <vector>

#include "commands.hpp"
#include "compile/compiler.hpp"
#include "compile/embedded_sources.hpp"
#include "compile/ptx.hpp"
#include "graph/dump.hpp"
#include "kg/cuda.hpp"
#include "kg/kg.hpp"
#include "lower/dry_run.hpp"
#include "lower/lowering.hpp"
#include "model_source.hpp"
#include "util/str.hpp"

namespace kgraph {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

std::string format_ms(double ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f ms", ms);
  return buf;
}

const char* cache_word(const kg::compile::CompileResult& r) {
  if (r.from_memory) return "memory";
  if (r.from_disk) return "disk";
  if (r.was_ptx) return "ptx";
  return "compiled";
}

std::string dim3_text(kg::Dim3 d) { return kg::util::cat("(", d.x, ", ", d.y, ", ", d.z, ")"); }

// Left-aligned columns, two spaces apart; columns listed in `right` are right-aligned.
void print_table(std::ostream& out, const std::vector<std::vector<std::string>>& rows,
                 const std::set<std::size_t>& right = {}) {
  std::vector<std::size_t> width;
  for (const auto& r : rows) {
    width.resize(std::max(width.size(), r.size()), 0);
    for (std::size_t c = 0; c < r.size(); ++c) width[c] = std::max(width[c], r[c].size());
  }
  for (const auto& r : rows) {
    std::string line;
    for (std::size_t c = 0; c < r.size(); ++c) {
      const std::string pad(width[c] - r[c].size(), ' ');
      const bool last = c + 1 == r.size();
      line += right.count(c) ? pad + r[c] : (last ? r[c] : r[c] + pad);
      if (!last) line += "  ";
    }
    out << line << "\n";
  }
}

// The architecture to compile for: --arch, else the GPU's, else 90; checked against NVRTC.
int pick_arch(const CompileArgs& args, std::string* why) {
  if (!kg::compile::Compiler::available())
    throw kg::Error("NVRTC is not available (" + kg::compile::Compiler::unavailable_reason() +
                    "); nothing can be compiled");
  int arch = 90;
  *why = "the default";
  if (args.arch) {
    arch = *args.arch;
    *why = "--arch";
  } else if (kg::cuda::available()) {
    arch = kg::cuda::device_arch(0);
    *why = "this machine's GPU, " + kg::cuda::device_name(0);
  }
  const auto archs = kg::cuda::compile_archs();
  if (!archs.empty() && std::find(archs.begin(), archs.end(), arch) == archs.end()) {
    std::vector<std::string> names;
    for (int a : archs) names.push_back(std::to_string(a));
    throw kg::Error(kg::util::cat("--arch ", arch, " is not an architecture NVRTC ",
                                  kg::compile::Compiler::nvrtc_version(), " compiles for (it knows ",
                                  kg::util::join(names, ", "), "; 90 is sm_90, the H100 and H200)"));
  }
  return arch;
}

struct Tally {
  int kernels = 0, compiled = 0, disk = 0, memory = 0;
  void add(const kg::compile::CompileResult& r) {
    ++kernels;
    if (r.from_memory)
      ++memory;
    else if (r.from_disk)
      ++disk;
    else
      ++compiled;
  }
  std::string text(const std::string& noun) const {
    return kg::util::cat(kernels, " ", noun, kernels == 1 ? ": " : "s: ", compiled, " compiled, ", disk,
                         " from the disk cache, ", memory, " from this run's memory cache");
  }
};

// A kernel to load on the GPU: its name, source and one entry point of its PTX.
struct GpuLoad {
  std::string name, source, entry;
};

// With a GPU of architecture `arch`, loads each module on cuda:0, which keeps its machine code in the
// cache, and says where the machine code came from ("; on cuda:0: N kernels from cached machine
// code, M compiled"); "" without one (the PTX cache is then all this command warms).
std::string load_on_gpu(const std::vector<GpuLoad>& loads, int arch) {
  if (loads.empty() || !kg::cuda::available() || kg::cuda::device_arch(0) != arch) return "";
  const kg::compile::ModuleLoadCounts before = kg::compile::module_load_counts();
  for (const GpuLoad& l : loads) kg::cuda::Kernel::compile(l.name, l.source, l.entry, 0);
  const kg::compile::ModuleLoadCounts after = kg::compile::module_load_counts();
  const long cached = after.cached_cubin - before.cached_cubin;
  const long compiled = after.compiled() - before.compiled();
  return kg::util::cat("; on cuda:0: ", cached, cached == 1 ? " kernel" : " kernels",
                       " from cached machine code, ", compiled, " compiled");
}

// The first entry point the PTX makes visible ("" when there is none).
std::string first_entry(const std::string& ptx) {
  for (const auto& e : kg::compile::parse_ptx_entries(ptx))
    if (e.visible) return e.name;
  return "";
}

void compile_model(const CompileArgs& args, int arch, std::ostream& out) {
  const ModelSource source = ModelSource::open(args.model);
  const kg::Model& model = source.model();
  const DimBinding binding = source.bind(args.dims);
  const auto shapes = source.shapes(binding);
  kg::compile::Compiler& compiler = kg::compile::Compiler::global();

  // Each kernel compiled once here (to see where it came from), then the whole model lowered,
  // planned and every launch packed and checked against its PTX (served from memory).
  const auto t0 = Clock::now();
  const kg::lower::LoweredGraph lowered =
      kg::lower::lower_model(model, kg::lower::LowerTarget{{}, arch, true});
  std::vector<kg::compile::CompileResult> results;
  std::vector<double> times;
  Tally tally;
  int views = 0;
  for (const auto& e : lowered.executables) {
    if (e.view) {
      ++views;
      continue;
    }
    const auto t = Clock::now();
    try {
      results.push_back(compiler.compile(e.name, e.source, arch));
    } catch (const kg::Error& err) {
      throw kg::Error(model.graph().node(e.node).label() + " " + err.what());
    }
    times.push_back(ms_since(t));
    tally.add(results.back());
  }
  const kg::lower::DryRun dry = kg::lower::dry_run(model, shapes, arch);

  std::vector<std::vector<std::string>> rows{
      {"node", "kernel", "entry", "PTX bytes", "cache", "time", "launch"}};
  std::size_t k = 0;
  for (const auto& e : lowered.executables) {
    if (e.view) continue;
    const auto& step = dry.launches.steps.at(k);
    const auto& r = results.at(k);
    const kg::Node& n = model.graph().node(e.node);
    std::string launch = "-";
    if (!step.launches.empty()) {
      launch = "grid " + dim3_text(step.launches[0].launch.grid) + " block " +
               dim3_text(step.launches[0].launch.block);
      if (step.launches.size() > 1) launch += kg::util::cat(" (+", step.launches.size() - 1, " more)");
    }
    rows.push_back({n.name, e.name, step.launches.empty() ? std::string("-") : step.launches[0].ptx_entry,
                    kg::dump::group_digits(static_cast<long long>(r.ptx.size())), cache_word(r),
                    format_ms(times.at(k)), launch});
    ++k;
  }
  out << "compiling " << args.model << " for sm_" << arch << " at " << binding.to_string() << " with NVRTC "
      << kg::compile::Compiler::nvrtc_version() << "\n";
  print_table(out, rows, {3, 5});
  std::vector<GpuLoad> loads;
  std::set<std::string> seen;
  k = 0;
  for (const auto& e : lowered.executables) {
    if (e.view) continue;
    const auto& r = results.at(k++);
    if (const std::string entry = first_entry(r.ptx); !entry.empty() && seen.insert(r.ptx).second)
      loads.push_back({e.name, e.source, entry});
  }
  out << tally.text("kernel") << load_on_gpu(loads, arch);
  if (views)
    out << kg::util::cat("; ", views, views == 1 ? " view node needs" : " view nodes need", " no kernel");
  std::string shape_text;
  if (shapes.size() == 1) {
    shape_text = kg::sizes_to_string(shapes[0]);
  } else {
    std::vector<std::string> parts;
    for (std::size_t i = 0; i < shapes.size(); ++i)
      parts.push_back(source.inputs()[i].name + " " + kg::sizes_to_string(shapes[i]));
    shape_text = kg::util::join(parts, ", ");
  }
  out << "\nevery launch packed and checked for " << shape_text << " in " << format_ms(ms_since(t0)) << "\n";
}

void compile_all(int arch, std::ostream& out) {
  kg::compile::Compiler& compiler = kg::compile::Compiler::global();
  const auto t0 = Clock::now();
  std::vector<std::vector<std::string>> rows{
      {"file", "entries", "PTX bytes", "cache", "time", "entry points"}};
  Tally tally;
  std::vector<GpuLoad> loads;
  for (const std::string& file : kg::compile::kernel_files()) {
    const auto t = Clock::now();
    const std::string name = file.substr(0, file.rfind('.'));
    const kg::compile::CompileResult r = compiler.compile(name, kg::compile::kernel_source(file), arch);
    const double ms = ms_since(t);
    tally.add(r);
    std::vector<std::string> entries;
    for (const auto& e : kg::compile::parse_ptx_entries(r.ptx))
      if (e.visible) entries.push_back(e.name);
    if (!entries.empty()) loads.push_back({name, kg::compile::kernel_source(file), entries[0]});
    rows.push_back({file, std::to_string(entries.size()),
                    kg::dump::group_digits(static_cast<long long>(r.ptx.size())), cache_word(r),
                    format_ms(ms), entries.empty() ? "-" : kg::util::join(entries, ", ")});
  }
  out << "compiling every built-in kernel file for sm_" << arch << " with NVRTC "
      << kg::compile::Compiler::nvrtc_version() << "\n";
  print_table(out, rows, {1, 2, 4});
  const std::string gpu = load_on_gpu(loads, arch);
  out << tally.text("file") << gpu << "; " << format_ms(ms_since(t0)) << "\n";
}

}  // namespace

void compile(const CompileArgs& args, std::ostream& out) {
  if (args.all && !args.model.empty()) throw kg::Error("give either a MODEL or --all, not both");
  if (!args.all && args.model.empty())
    throw kg::Error(
        "give a MODEL to compile its kernels (see 'kgraph models'), or --all for every built-in kernel");
  if (args.all && args.dims.batch) throw kg::Error("--batch applies to a MODEL, not to --all");
  if (args.all && !args.dims.dims.empty()) throw kg::Error("--dim applies to a MODEL, not to --all");
  std::string why;
  const int arch = pick_arch(args, &why);
  if (args.all)
    compile_all(arch, out);
  else
    compile_model(args, arch, out);
  out << "arch: sm_" << arch << " (" << why
      << "); cache: " << kg::compile::Compiler::global().cache_dir().string() << "\n";
}

}  // namespace kgraph
