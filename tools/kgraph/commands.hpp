// The kgraph subcommands. Each prints to `out` and throws kg::Error on failure.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>

namespace kgraph {

struct InspectArgs {
  std::string model;
  std::optional<std::int64_t> batch;  // also load on the CPU for this batch size
  std::string dot_path;               // write the DOT text here ("-": standard output)
  std::string render_path;            // render the graph to this .svg/.png/.pdf
  bool recorded = false;              // the graph as recorded (no inference fusion)
};

struct RunArgs {
  std::string model;
  std::string device = "cpu";
  std::string weights_path;
  std::string input_path;
  bool random = false;
  std::optional<std::int64_t> batch;
  std::uint64_t seed = 0;
  std::string output_path;
  int runs = 3;
  bool checked = false;  // LoadOptions::checked
};

struct CompileArgs {
  std::string model;                  // a zoo model, or empty with `all`
  std::optional<int> arch;            // compute capability (default: the GPU's, else 90)
  std::optional<std::int64_t> batch;  // the batch the launches are packed for (default 1)
  bool all = false;                   // every built-in kernel file instead of a model
};

// Lists the model zoo: name, input shape, parameter count.
void list_models(std::ostream& out);
// Prints the summary (and, with a batch, the concrete shapes and the memory plan); writes the
// DOT text and the rendered graph when asked.
void inspect(const InspectArgs& args, std::ostream& out);
// Loads the model, runs it `runs` times and prints the outputs and the median time.
void run(const RunArgs& args, std::ostream& out);
// Compiles a model's kernels (packing and checking every launch) or every built-in kernel file
// for an architecture, without a GPU; prints one line per kernel and warms the disk cache.
void compile(const CompileArgs& args, std::ostream& out);

}  // namespace kgraph
