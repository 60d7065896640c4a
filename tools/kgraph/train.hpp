// kgraph train: trains a zoo model on Fashion-MNIST with a per-epoch evaluation, a CSV log, a
// plot, checkpoints and resumption.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace kgraph {

struct TrainArgs {
  std::optional<std::string> model;         // default lenet5-tanh (or the checkpoint's)
  std::string device = "auto";              // auto | cpu | cuda | cuda:N
  std::string data_dir;                     // folder of the IDX files (default: found)
  std::optional<std::string> optimizer;     // adamw (default) | sgd
  std::optional<double> lr;                 // default 2e-3
  std::optional<double> weight_decay;       // default 0.01 for adamw, 0 for sgd
  std::optional<double> momentum;           // sgd only (default 0)
  int epochs = 8;                           // total epochs of the run
  std::optional<std::int64_t> batch_size;   // default 128
  std::optional<std::uint64_t> seed;        // default 0
  int threads = 0;                          // CPU worker threads (0: one per core)
  bool checked = false;                     // LoadOptions::checked
  std::string out_dir;                      // default runs/<model>-<timestamp>
  std::string resume;                       // checkpoint to continue from
  std::optional<std::int64_t> limit_train;  // use the first N training images
  std::optional<std::int64_t> limit_test;   // use the first N test images
  int nproc = 0;                            // start this many ranks (data-parallel), 0: this process
  std::vector<std::string> command_line;    // kgraph's arguments, for the ranks --nproc starts
};

// Adds the `train` subcommand to `app`, filling `args` when it is parsed.
CLI::App* add_train_command(CLI::App& app, TrainArgs& args);

// Runs the training; prints progress, one line per epoch and "final test accuracy: NN.NN%".
// Under mpirun (or as a rank --nproc started) this process is one rank of a data-parallel job:
// it trains on its shard of each global batch, and rank 0 alone prints and writes files.
// With --nproc N it starts the N ranks instead and waits for them.
void train(const TrainArgs& args, std::ostream& out);

}  // namespace kgraph
