// kgraph: inspect and run kernelgraph models (the zoo, or ONNX files) from the command line.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <new>
#include <stdexcept>
#include <streambuf>
#include <string>
#include <vector>

#include "commands.hpp"
#include "kg/error.hpp"
#include "util/file.hpp"
#include "util/str.hpp"
#include "train.hpp"
#include "validators.hpp"

#include "kg/version.hpp"

#ifndef KG_BUILD_TYPE
#define KG_BUILD_TYPE ""
#endif
#ifndef KG_BUILD_CUDA
#define KG_BUILD_CUDA 0
#endif
#ifndef KG_BUILD_DNNL
#define KG_BUILD_DNNL 0
#endif

namespace {

// kgraph --version: the version, then the build configuration on a second line.
std::string version_text() {
#if defined(__clang__)
  const std::string compiler = "clang " __clang_version__;
#elif defined(__GNUC__)
  const std::string compiler = "gcc " __VERSION__;
#else
  const std::string compiler = "an unknown compiler";
#endif
  const std::string build_type = KG_BUILD_TYPE;
  return std::string("kgraph " KG_VERSION_STRING "\nbuild: ") +
         (build_type.empty() ? std::string("no build type") : build_type) +
         ", CUDA path " + (KG_BUILD_CUDA ? "on" : "off") + ", oneDNN " + (KG_BUILD_DNNL ? "on" : "off") +
         ", " + compiler;
}

// Error text for one line: line breaks become spaces, trailing blanks go.
std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t')) text.pop_back();
  return text;
}

// Error text that may keep its lines (a kg::Error listing several problems).
std::string trimmed(std::string text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return text;
}

int fail(const std::string& message, int code) {
  // Names from a file (a tensor's, a node's) may hold terminal escape sequences: shown, not obeyed.
  std::cerr << "kgraph: error: " << kg::util::escape_control(message, "\n") << "\n";
  return code;
}

// Standard output with every control character but line feeds and tabs made visible (see
// util::escape_control): what the commands print holds names read from model and tensor files.
class EscapingBuffer final : public std::streambuf {
 public:
  explicit EscapingBuffer(std::streambuf* to) : to_(to) {}

 protected:
  int_type overflow(int_type c) override {
    if (traits_type::eq_int_type(c, traits_type::eof())) return traits_type::not_eof(c);
    const char ch = traits_type::to_char_type(c);
    const std::string text = kg::util::escape_control(std::string_view(&ch, 1));
    return to_->sputn(text.data(), static_cast<std::streamsize>(text.size())) ==
                   static_cast<std::streamsize>(text.size())
               ? c
               : traits_type::eof();
  }
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    const std::string text = kg::util::escape_control(std::string_view(s, static_cast<std::size_t>(n)));
    return to_->sputn(text.data(), static_cast<std::streamsize>(text.size())) ==
                   static_cast<std::streamsize>(text.size())
               ? n
               : 0;
  }
  int sync() override { return to_->pubsync(); }

 private:
  std::streambuf* to_;
};

// What a std::exception that is not a kg::Error says about the failure, without libstdc++'s own
// text ("vector::_M_range_check", "basic_filebuf::underflow"), which means nothing to a user.
std::string internal_failure(const std::exception& e) {
  if (dynamic_cast<const std::ios_base::failure*>(&e)) return "a file could not be read or written";
  if (dynamic_cast<const std::out_of_range*>(&e) || dynamic_cast<const std::length_error*>(&e))
    return "an index or size out of range";
  if (dynamic_cast<const std::invalid_argument*>(&e)) return "an invalid value";
  return "an unexpected failure inside the library";
}

constexpr const char* kModelHelp = "A zoo model name (see 'kgraph models') or an ONNX file (.onnx)";
constexpr const char* kPrecisionHelp =
    "f32 (the default: as recorded), f16 or bf16: run the ops that can in that precision, parameters "
    "converted at load, softmax, norms and losses kept in f32; inputs and outputs stay f32";

// --dim NAME=SIZE, repeatable; each --dim takes one value (so it cannot swallow MODEL).
CLI::Option* add_dim_option(CLI::App* command, std::vector<std::string>& values, const std::string& what) {
  return command
      ->add_option("--dim", values,
                   "Size of a named dynamic dim other than batch, e.g. --dim sequence=16 (repeatable)" + what)
      ->allow_extra_args(false)
      ->check(kgraph_cli::dim_assignment)
      ->option_text("NAME=SIZE");
}

// --batch and the --dim values as DimOptions (the values are checked by the validators).
kgraph::DimOptions dim_options(const CLI::Option* batch_opt, std::int64_t batch,
                               const std::vector<std::string>& dims) {
  kgraph::DimOptions o;
  if (*batch_opt) o.batch = batch;
  for (const auto& d : dims) o.dims.push_back(kgraph::parse_dim(d));
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  // A write past a file-size limit (ulimit -f) fails with EFBIG and is reported, its temporary
  // removed, instead of SIGXFSZ killing the process with half-written files left behind.
  kg::util::ignore_file_size_signal();
  CLI::App app{"Inspect and run kernelgraph models: the zoo, or ONNX files.", "kgraph"};
  app.set_version_flag("--version", version_text());
  app.require_subcommand(1);
  app.footer(
      "Examples:\n"
      "  kgraph models\n"
      "  kgraph inspect lenet5 --batch 4\n"
      "  kgraph run lenet5 --random --batch 2\n"
      "  kgraph run bert.onnx --batch 2 --dim sequence=16\n"
      "  kgraph compile lenet5 --arch 90\n"
      "  kgraph tune resnet18 --batch 256 --precision bf16\n"
      "  kgraph train --epochs 2\n"
      "Run 'kgraph <command> --help' for a command's options.");

  CLI::App* models = app.add_subcommand("models", "List the models of the zoo");

  kgraph::InspectArgs ia;
  std::int64_t inspect_batch = 0;
  std::vector<std::string> inspect_dims;
  CLI::App* inspect = app.add_subcommand("inspect", "Print a model's graph: nodes, shapes, parameters");
  inspect->add_option("MODEL", ia.model, kModelHelp)->required();
  CLI::Option* inspect_batch_opt =
      inspect
          ->add_option("--batch", inspect_batch,
                       "Also load on the CPU for this batch size (the dims named "
                       "batch) and print the concrete shapes and the memory plan")
          ->check(kgraph_cli::positive_integer)
          ->option_text("N");
  add_dim_option(inspect, inspect_dims, "; also loads on the CPU, like --batch (whose default is then 1)");
  inspect
      ->add_option("--dot", ia.dot_path,
                   "Write the graph as Graphviz DOT to FILE ('-': standard output only)")
      ->option_text("FILE");
  inspect->add_option("--render", ia.render_path, "Render the graph with graphviz to FILE.svg, .png or .pdf")
      ->option_text("FILE");
  inspect->add_flag("--recorded", ia.recorded,
                    "Show the graph as recorded, before the inference fusion passes");
  inspect
      ->add_option("--device", ia.device,
                   "With --batch or --dim, load there: cpu (the default), cuda, cuda:N or auto; on cuda also "
                   "run once and print each node's tactic (kernel or vendor library) and time")
      ->option_text("DEVICE");

  inspect->add_flag("--json", ia.json,
                    "Print one JSON object (the nodes with op, dtype, shape and inputs; with --batch or --dim "
                    "the loaded shapes and the memory plan) instead of the text");
  inspect->add_option("--precision", ia.precision, kPrecisionHelp)
      ->check(CLI::IsMember({"f32", "f16", "bf16"}))
      ->option_text("P");

  kgraph::RunArgs ra;
  std::int64_t run_batch = 0;
  std::vector<std::string> run_dims;
  CLI::App* run = app.add_subcommand("run", "Load a model, run it and print its outputs and time");
  run->add_option("MODEL", ra.model, kModelHelp)->required();
  run->add_option("--device", ra.device, "cpu (the default), cuda, cuda:N or auto")->option_text("DEVICE");
  run->add_option(
         "--weights", ra.weights_path,
         "Load parameters from a safetensors file, by name (dotted names; an ONNX file's initializer "
         "names)")
      ->option_text("FILE");
  CLI::Option* input_opt =
      run->add_option(
             "--input", ra.input_path,
             "Inputs from a safetensors file, matched by input name (other tensors are ignored; "
             "a single-input model also takes a file's only tensor); their shapes set the dynamic dims")
          ->option_text("FILE");
  CLI::Option* random_opt = run->add_flag(
      "--random", ra.random,
      "Random inputs (the default without --input): floats uniform in [-1, 1), integers and bools "
      "from {0, 1} (valid token ids for any vocabulary, and a valid mask)");
  input_opt->excludes(random_opt);
  CLI::Option* run_batch_opt =
      run->add_option("--batch", run_batch, "Size of the dims named batch (default 1, or the input file's)")
          ->check(kgraph_cli::positive_integer)
          ->option_text("N");
  add_dim_option(run, run_dims, "; with --input it must agree with the file");
  run->add_option(
         "--seed", ra.seed,
         "Seed of the random inputs and of a zoo model's default parameter initialisation (default 0)")
      ->check(kgraph_cli::seed_value)
      ->option_text("S");
  run->add_option("--output", ra.output_path, "Write the outputs to a safetensors file, by output name")
      ->option_text("FILE");
  run->add_option("--runs", ra.runs,
                  "Forward passes to time; the median, p90, p99, min, max and the throughput are printed "
                  "(default 3)")
      ->check(kgraph_cli::positive_int)
      ->option_text("N");
  run->add_option("--warmup", ra.warmup, "Forward passes before the timed ones, not counted (default 1)")
      ->check(kgraph_cli::whole_number(0, static_cast<std::uint64_t>(std::numeric_limits<int>::max()),
                                       "a whole number"))
      ->option_text("N");
  run->add_flag("--json", ra.json,
                "Print one JSON object (model, device, inputs, outputs with min/max/mean, times, throughput; "
                "with --profile the nodes' times) instead of the text");
  run->add_flag("--checked", ra.checked,
                "Checked mode: every kernel's writes verified (cpu: emulated with guard pages; cuda: guard "
                "canaries and poisoned outputs). Slow; finds a broken op inside the model");
  run->add_option("--precision", ra.precision, kPrecisionHelp)
      ->check(CLI::IsMember({"f32", "f16", "bf16"}))
      ->option_text("P");
  run->add_flag("--tf32", ra.tf32, "cuda: f32 matrix products and convolutions may use TF32 tensor cores");
  run->add_flag(
      "--no-vendor", ra.no_vendor,
      "run every op on kernelgraph's own kernels: not cuBLASLt or cuDNN (cuda), not oneDNN (cpu); "
      "also KG_NO_VENDOR=1");
  run->add_flag("--no-channels-last", ra.no_channels_last,
                "keep every convolution in the recorded NCHW layout (by default inference keeps activations "
                "channels-last between convolutions where the library is faster on them: cpu f32, cuda "
                "f16/bf16 and --tf32)");
  run->add_flag(
      "--tune", ra.tune,
      "time the libraries' algorithms per node and keep the fastest: cuda at load (and the op's own "
      "kernels); cpu at the first run (oneDNN's convolutions), and batch slices at load in inference");
  run->add_flag("--no-cuda-graph", ra.no_cuda_graph,
                "cuda: launch every kernel on every run instead of "
                "replaying a captured CUDA graph");
  run->add_option("--threads", ra.threads,
                  "CPU worker threads, at most " + std::to_string(kg::util::ThreadPool::kMaxThreads) +
                      " (default 0: $KG_NUM_THREADS, else one per core)")
      ->check(kgraph_cli::thread_count)
      ->option_text("N");
  run->add_flag("--profile", ra.profile,
                "Print the last run's time per node, with GFLOP/s of the convolutions and matrix products "
                "and the bytes each node moves at least")
      ->excludes(run->get_option("--checked"));

  kgraph::CompileArgs ca;
  int compile_arch = 0;
  std::int64_t compile_batch = 0;
  std::vector<std::string> compile_dims;
  CLI::App* compile =
      app.add_subcommand("compile", "Compile a model's kernels for a GPU architecture (no GPU needed)");
  compile->add_option("MODEL", ca.model, kModelHelp);
  CLI::Option* compile_arch_opt =
      compile->add_option("--arch", compile_arch, "Compute capability: 90 for sm_90 (default: the GPU's)")
          ->check(kgraph_cli::positive_int)
          ->option_text("SM");
  CLI::Option* compile_batch_opt =
      compile->add_option("--batch", compile_batch, "Batch size the launches are packed for (default 1)")
          ->check(kgraph_cli::positive_integer)
          ->option_text("N");
  add_dim_option(compile, compile_dims, "; the launches are packed for it");
  compile->add_flag("--all", ca.all, "Every built-in kernel file instead of a model");

  kgraph::TuneArgs tua;
  std::int64_t tune_batch = 0;
  std::vector<std::string> tune_dims;
  CLI::App* tune = app.add_subcommand(
      "tune", "Measure a model's tactics on a GPU for its sizes and keep them in the tuning cache");
  tune->add_option("MODEL", tua.model, kModelHelp)->required();
  CLI::Option* tune_batch_opt =
      tune->add_option("--batch", tune_batch, "Size of the dims named batch (default 1)")
          ->check(kgraph_cli::positive_integer)
          ->option_text("N");
  add_dim_option(tune, tune_dims, "");
  tune->add_option("--device", tua.device, "cuda (the default) or cuda:N")->option_text("DEVICE");
  tune->add_option("--precision", tua.precision, kPrecisionHelp)
      ->check(CLI::IsMember({"f32", "f16", "bf16"}))
      ->option_text("P");
  tune->add_flag("--tf32", tua.tf32, "f32 matrix products and convolutions may use TF32 tensor cores");
  tune->add_flag("--fresh", tua.fresh, "Forget every kept choice first (of every model and device)");

  kgraph::TrainArgs ta;
  CLI::App* train = kgraph::add_train_command(app, ta);
  ta.command_line.assign(argv + 1, argv + argc);  // --nproc starts its ranks with these

  // --no-fusion on every command that builds a model: the fusion passes are skipped (through
  // KG_NO_FUSION, which every Model made in this process reads), for comparison.
  bool no_fusion = false;
  for (CLI::App* c : {inspect, run, compile, tune, train})
    c->add_flag(
        "--no-fusion", no_fusion,
        "Skip the fusion passes (elementwise groups, convolution epilogues): every node is its own kernel");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string where = "kgraph";
    for (const CLI::App* sub : app.get_subcommands()) where += " " + sub->get_name();
    if (app.get_subcommands().empty() && argc > 1 && argv[1][0] != '-')
      return fail(std::string("unknown command '") + argv[1] +
                      "' (expected models, inspect, run, compile, tune or train; see 'kgraph --help')",
                  2);
    return fail(one_line(e.what()) + " (see '" + where + " --help')", 2);
  }

  if (no_fusion) ::setenv("KG_NO_FUSION", "1", 1);
  // What is being done, for a failure that is not a kg::Error: "kgraph run resnet18".
  std::string doing = "kgraph";
  for (const CLI::App* sub : app.get_subcommands()) doing += " " + sub->get_name();
  for (const std::string* m : {&ia.model, &ra.model, &ca.model, &tua.model})
    if (!m->empty()) doing += " " + *m;
  doing = kg::util::escape_control(doing);
  // Train draws its progress line with a carriage return and an erase sequence of its own; every
  // other command's output is escaped.
  EscapingBuffer escaping(std::cout.rdbuf());
  std::streambuf* const plain = std::cout.rdbuf();
  if (!*train) std::cout.rdbuf(&escaping);
  struct Restore {
    std::streambuf* buf;
    ~Restore() { std::cout.rdbuf(buf); }
  } restore{plain};
  try {
    ia.dims = dim_options(inspect_batch_opt, inspect_batch, inspect_dims);
    ra.dims = dim_options(run_batch_opt, run_batch, run_dims);
    if (*compile_arch_opt) ca.arch = compile_arch;
    ca.dims = dim_options(compile_batch_opt, compile_batch, compile_dims);
    tua.dims = dim_options(tune_batch_opt, tune_batch, tune_dims);
    if (*models) kgraph::list_models(std::cout);
    if (*inspect) kgraph::inspect(ia, std::cout);
    if (*run) kgraph::run(ra, std::cout);
    if (*compile) kgraph::compile(ca, std::cout);
    if (*tune) kgraph::tune(tua, std::cout);
    if (*train) kgraph::train(ta, std::cout);
    std::cout.flush();
    if (!std::cout) return fail("cannot write to standard output", 1);
  } catch (const kg::Error& e) {
    std::cout.flush();
    return fail(trimmed(e.what()), 1);
  } catch (const std::bad_alloc&) {
    std::cout.flush();
    return fail("out of memory in '" + doing +
                    "': an allocation failed (use a smaller --batch or smaller inputs, or free memory)",
                1);
  } catch (const std::exception& e) {
    std::cout.flush();
    return fail("internal failure in '" + doing + "': " + internal_failure(e), 1);
  } catch (...) {
    return fail("internal failure in '" + doing + "'", 1);
  }
  return 0;
}
