// The kgraph subcommands. Each prints to `out` and throws kg::Error on failure.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>

#include "model_source.hpp"

namespace kgraph {

// MODEL in every command is a zoo name or an ONNX file (see ModelSource::open).
struct InspectArgs {
  std::string model;
  DimOptions dims;             // --batch/--dim: also load on the CPU for these sizes
  std::string dot_path;        // write the DOT text here ("-": standard output)
  std::string render_path;     // render the graph to this .svg/.png/.pdf
  bool recorded = false;       // the graph as recorded (no inference fusion)
  std::string device = "cpu";  // with dims: where to load; on cuda the nodes' tactics and times too
  std::string precision = "f32";  // LoadOptions::precision: f32, f16 or bf16
  bool json = false;              // print one JSON object instead of the text
};

struct RunArgs {
  std::string model;
  std::string device = "cpu";
  std::string weights_path;
  std::string input_path;
  bool random = false;
  DimOptions dims;  // --batch/--dim (default batch 1, or the input file's sizes)
  std::uint64_t seed = 0;
  std::string output_path;
  int runs = 3;                // timed forward passes
  int warmup = 1;              // forward passes before them, not timed
  bool json = false;           // print one JSON object instead of the text
  bool checked = false;        // LoadOptions::checked
  bool tf32 = false;           // LoadOptions::tf32
  bool no_vendor = false;      // LoadOptions::vendor_libraries off
  bool no_channels_last = false;  // LoadOptions::channels_last off
  bool tune = false;           // LoadOptions::tune
  bool no_cuda_graph = false;  // LoadOptions::cuda_graph off
  int threads = 0;             // LoadOptions::threads (0: KG_NUM_THREADS, else one per core)
  bool profile = false;        // LoadOptions::profile: print the last run's per-node table
  std::string precision = "f32";  // LoadOptions::precision: f32, f16 or bf16
};

struct CompileArgs {
  std::string model;        // a zoo model or an ONNX file, or empty with `all`
  std::optional<int> arch;  // compute capability (default: the GPU's, else 90)
  DimOptions dims;          // the sizes the launches are packed for (default batch 1)
  bool all = false;         // every built-in kernel file instead of a model
};

struct TuneArgs {
  std::string model;
  DimOptions dims;                // the sizes to tune for (default batch 1)
  std::string device = "cuda";    // a GPU: cuda or cuda:N
  std::string precision = "f32";  // LoadOptions::precision
  bool tf32 = false;              // LoadOptions::tf32
  bool fresh = false;             // forget every kept choice first
};

// Lists the model zoo: name, input shape, parameter count.
void list_models(std::ostream& out);
// Prints the summary (and, with --batch or --dim, the concrete shapes and the memory plan);
// writes the DOT text and the rendered graph when asked.
void inspect(const InspectArgs& args, std::ostream& out);
// Loads the model, runs it `warmup` times untimed and `runs` times timed on random inputs or those
// of a file, and prints the outputs and the times (median, p90, p99, min, max) and the throughput;
// with `json`, one JSON object holding the same instead of the text.
void run(const RunArgs& args, std::ostream& out);
// Compiles a model's kernels (packing and checking every launch) or every built-in kernel file
// for an architecture, without a GPU; prints one line per kernel and warms the disk cache.
void compile(const CompileArgs& args, std::ostream& out);
// Loads the model on a GPU with LoadOptions::tune (measuring what the tuning cache lacks and keeping
// it), prints each node's tactic and time, then loads it again untuned to show that a later load
// reads the kept choices.
void tune(const TuneArgs& args, std::ostream& out);

}  // namespace kgraph
