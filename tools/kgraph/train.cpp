// kgraph train: a zoo model trained on Fashion-MNIST. Each epoch shuffles the training set with a
// seed derived from (seed, epoch), runs zero_grad / forward / backward / step per batch, then
// evaluates on the test set and writes the logs, the plot and a checkpoint.
#include "train.hpp"
#include "validators.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <csignal>
#include <iterator>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <sstream>
#include <string_view>
#include <thread>
#include <vector>

#include "kg/cuda.hpp"
#include "kg/data.hpp"
#include "kg/distributed.hpp"
#include "kg/io.hpp"
#include "kg/kg.hpp"
#include "kg/models.hpp"
#include "util/file.hpp"
#include "util/str.hpp"

namespace kgraph {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kDefaultModel = "lenet5-tanh";
constexpr const char* kDefaultOptimizer = "adamw";
constexpr double kDefaultLr = 2e-3;
constexpr double kDefaultAdamWDecay = 0.01;
constexpr std::int64_t kDefaultBatch = 128;
constexpr const char* kLogHeader = "epoch,step,loss,test_accuracy";
constexpr const char* kEpochsHeader = "epoch,step,train_loss,test_loss,test_accuracy,seconds";

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

// Round-trip text of a double, for checkpoint metadata.
std::string exact(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

// "1:05" or "1:02:03".
std::string clock_text(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<long long>(seconds + 0.5);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  else
    std::snprintf(buf, sizeof buf, "%lld:%02lld", s / 60, s % 60);
  return buf;
}

// The settings that define a run, resolved from the flags and (when resuming) the checkpoint.
struct Settings {
  std::string model, optimizer;
  double lr = kDefaultLr, weight_decay = 0, momentum = 0;
  std::int64_t batch = kDefaultBatch;
  std::uint64_t seed = 0;
  std::optional<std::int64_t> limit_train;
};

std::string meta_value(const std::map<std::string, std::string>& meta, const std::string& key,
                       const std::string& path) {
  auto it = meta.find(key);
  if (it == meta.end())
    throw kg::Error(kg::util::cat("checkpoint '", path, "' has no '", key,
                                  "' in its metadata; it was not written by kgraph train"));
  return it->second;
}

// The largest epoch a checkpoint may claim (an epoch of 2^63-1 would overflow the epoch loop).
constexpr std::int64_t kMaxCheckpointEpoch = 1'000'000;
// The largest step count: far beyond a real run, far below overflow.
constexpr std::int64_t kMaxCheckpointStep = 1'000'000'000'000'000;
constexpr std::int64_t kMaxCheckpointBatch = 2'147'483'647;

[[noreturn]] void bad_meta(const std::string& path, const std::string& key, const std::string& text,
                           const std::string& expected) {
  throw kg::Error(kg::util::cat("checkpoint '", path, "': metadata '", key, "' is '", text, "'; expected ",
                                expected));
}

// A whole number in [lo, hi], the whole text (no sign on an unsigned, no trailing characters).
template <class T>
T parse_meta_int(const std::string& text, const std::string& key, const std::string& path, T lo, T hi) {
  T v{};
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || ptr != end || v < lo || v > hi)
    bad_meta(path, key, text, kg::util::cat("a whole number from ", lo, " to ", hi));
  return v;
}

// A finite number in [lo, hi], the whole text.
double parse_meta_real(const std::string& text, const std::string& key, const std::string& path, double lo,
                       double hi) {
  double v = NAN;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || ptr != end || !std::isfinite(v) || v < lo || v > hi)
    bad_meta(path, key, text,
             std::isinf(hi) ? kg::util::cat("a finite number >= ", lo)
                            : kg::util::cat("a number from ", lo, " to ", hi));
  return v;
}

// A run-defining flag given again on resume must agree with the checkpoint.
template <class T>
void agree(const char* flag, const std::optional<T>& given, const T& saved, const std::string& path) {
  if (given && *given != saved)
    throw kg::Error(kg::util::cat(flag, " ", *given, " disagrees with checkpoint '", path,
                                  "', which was trained with ", saved,
                                  "; a resumed run keeps the settings it started with"));
}

Settings resolve(const TrainArgs& a, const std::map<std::string, std::string>* meta) {
  Settings s;
  if (meta) {
    const std::string& path = a.resume;
    s.model = meta_value(*meta, "model", path);
    if (a.model && *a.model != s.model)
      throw kg::Error(
          kg::util::cat("checkpoint '", path, "' is of model '", s.model, "', not '", *a.model, "'"));
    s.optimizer = meta_value(*meta, "optimizer", path);
    agree<std::string>("--optimizer", a.optimizer, s.optimizer, path);
    s.batch = parse_meta_int<std::int64_t>(meta_value(*meta, "batch_size", path), "batch_size", path, 1,
                                             kMaxCheckpointBatch);
    agree("--batch-size", a.batch_size, s.batch, path);
    s.seed = parse_meta_int<std::uint64_t>(meta_value(*meta, "seed", path), "seed", path, 0,
                                           std::numeric_limits<std::uint64_t>::max());
    agree("--seed", a.seed, s.seed, path);
    const std::string lt = meta_value(*meta, "limit_train", path);
    if (lt != "all")
      s.limit_train = parse_meta_int<std::int64_t>(lt, "limit_train", path, 1,
                                                   std::numeric_limits<std::int64_t>::max());
    if (a.limit_train && a.limit_train != s.limit_train)
      throw kg::Error(
          kg::util::cat("--limit-train ", *a.limit_train, " disagrees with checkpoint '", path,
                        "', which was trained with ",
                        s.limit_train ? kg::util::cat("--limit-train ", *s.limit_train) : "all images",
                        "; a resumed run keeps the settings it started with"));
    // The step sizes may change on resume; by default they are the checkpoint's.
    // Each is read (and checked) even when a flag overrides it: a damaged checkpoint is named.
    constexpr double inf = std::numeric_limits<double>::infinity();
    const double lr = parse_meta_real(meta_value(*meta, "lr", path), "lr", path, 0, inf);
    const double wd = parse_meta_real(meta_value(*meta, "weight_decay", path), "weight_decay", path, 0, inf);
    const double mom = parse_meta_real(meta_value(*meta, "momentum", path), "momentum", path, 0, 1);
    s.lr = a.lr.value_or(lr);
    s.weight_decay = a.weight_decay.value_or(wd);
    s.momentum = a.momentum.value_or(mom);
  } else {
    s.model = a.model.value_or(kDefaultModel);
    s.optimizer = a.optimizer.value_or(kDefaultOptimizer);
    s.batch = a.batch_size.value_or(kDefaultBatch);
    s.seed = a.seed.value_or(0);
    s.limit_train = a.limit_train;
    s.lr = a.lr.value_or(kDefaultLr);
    s.weight_decay = a.weight_decay.value_or(s.optimizer == "adamw" ? kDefaultAdamWDecay : 0.0);
    s.momentum = a.momentum.value_or(0.0);
  }
  if (s.optimizer != "adamw" && s.optimizer != "sgd")
    throw kg::Error(kg::util::cat("unknown optimizer '", s.optimizer, "' (expected adamw or sgd)"));
  if (s.optimizer == "adamw" && a.momentum)
    throw kg::Error("--momentum applies to --optimizer sgd only; AdamW has no momentum setting");
  return s;
}

kg::OptimizerOptions optimizer_options(const Settings& s) {
  return s.optimizer == "sgd" ? kg::OptimizerOptions::sgd(s.lr, s.momentum, s.weight_decay)
                              : kg::OptimizerOptions::adamw(s.lr, s.weight_decay);
}

// The training graph: image and label inputs, outputs "logits" and "loss".
kg::Model build_training_model(const std::string& name) {
  const std::vector<std::int64_t> sample = kg::models::input_shape(name, 1);  // throws for unknown names
  std::vector<kg::Dim> dims{kg::Dim::named("batch")};
  for (std::size_t d = 1; d < sample.size(); ++d) dims.emplace_back(sample[d]);
  auto [image, graph] = kg::SymTensor::input(kg::DType::F32, kg::Shape(std::move(dims)), "image");
  kg::SymTensor label = graph->input(kg::DType::I64, kg::Shape({kg::Dim::named("batch")}), "label");
  kg::SymTensor logits = kg::models::record(name, image);
  kg::SymTensor loss = kg::cross_entropy(logits, label, "loss");
  return kg::Model(graph, {{"logits", logits}, {"loss", loss}}, kg::LoweringMode::Training);
}

std::string timestamp() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", &tm);
  return buf;
}

// A CSV file of the run: on resume, rows of epochs after the checkpoint's are dropped.
class CsvLog {
 public:
  CsvLog(const fs::path& path, const std::string& header, std::int64_t keep_through_epoch) {
    std::vector<std::string> kept;
    if (keep_through_epoch > 0) {
      // The old log through the guarded read: a link, FIFO or device in its place is not read, and
      // a log of any real run is far below the bound.
      std::string text, why;
      if (kg::util::try_read_file(path, {std::uint64_t(256) << 20, /*follow_links=*/false}, text, &why)) {
        std::istringstream in(text);
        std::string line;
        bool first = true;
        while (std::getline(in, line)) {
          if (first) {
            first = false;
            continue;
          }
          const long long epoch = std::atoll(line.c_str());
          if (epoch >= 1 && epoch <= keep_through_epoch) kept.push_back(line);
        }
      }
    }
    // Opened with O_NOFOLLOW and refused unless regular: a link planted in --out is not written
    // through, a FIFO does not block.
    f_ = kg::util::AppendFile(path);
    std::string start = header + "\n";
    for (const auto& l : kept) start += l + "\n";
    f_.write(start);
  }
  void row(const std::string& line) { f_.write(line + "\n"); }

 private:
  kg::util::AppendFile f_;
};

// A program on $PATH ("" when there is none), found without a shell. An empty entry of $PATH is
// the current folder, as for the shell.
std::string find_program(const std::string& name) {
  const char* env = std::getenv("PATH");
  const std::string path = env ? env : "/usr/local/bin:/usr/bin:/bin";
  std::size_t begin = 0;
  for (;;) {
    const std::size_t end = std::min(path.find(':', begin), path.size());
    const std::string folder = path.substr(begin, end - begin);
    const fs::path candidate = fs::path(folder.empty() ? "." : folder) / name;
    std::error_code ec;
    if (fs::is_regular_file(candidate, ec) && ::access(candidate.c_str(), X_OK) == 0)
      return fs::absolute(candidate, ec).string();  // absolute: the child changes folder
    if (end == path.size()) return {};
    begin = end + 1;
  }
}

// Runs `program script` with `dir` as its working folder, stdin from /dev/null and stdout and
// stderr to dir/gnuplot.log; no shell is involved, so no character of the folder's name is
// special. True when it ran and exited 0.
bool run_in_folder(const std::string& program, const std::string& script, const fs::path& dir,
                   std::string* problem) {
  // Everything the child needs is made before fork: the child only makes async-signal-safe calls.
  const std::string dir_text = dir.string(), log_text = (dir / "gnuplot.log").string();
  std::string arg0 = "gnuplot", arg1 = script;
  char* const argv[] = {arg0.data(), arg1.data(), nullptr};
  // The log is opened here, the careful way (no link followed, a regular file only), and handed to
  // the child; plot.png is refused when something else stands at its name (gnuplot would write
  // through a link).
  kg::util::AppendFile log_file;
  try {
    log_file = kg::util::AppendFile(log_text);
    kg::util::check_output_path(dir / "plot.png", "plot");
  } catch (const kg::Error& e) {
    *problem = e.what();
    return false;
  }
  const int log = log_file.fd();
  const pid_t pid = ::fork();
  if (pid < 0) {
    *problem = kg::util::cat("cannot start gnuplot: ", std::strerror(errno));
    return false;
  }
  if (pid == 0) {
    const int in = ::open("/dev/null", O_RDONLY);
    if (in < 0 || log < 0 || ::dup2(in, STDIN_FILENO) < 0 || ::dup2(log, STDOUT_FILENO) < 0 ||
        ::dup2(log, STDERR_FILENO) < 0 || ::chdir(dir_text.c_str()) != 0)
      ::_exit(127);
    ::execv(program.c_str(), argv);
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      *problem = kg::util::cat("cannot wait for gnuplot: ", std::strerror(errno));
      return false;
    }
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    *problem = kg::util::cat("gnuplot failed (see ", log_text, ")");
    return false;
  }
  return true;
}

// A gnuplot single-quoted string: a quote inside is doubled.
std::string gnuplot_quote(const std::string& text) {
  std::string q = "'";
  for (char c : text) q += c == '\'' ? std::string("''") : std::string(1, c);
  return q + "'";
}

// Training and test loss (top) and test accuracy (bottom) per epoch, from epochs.csv.
bool write_plot(const std::string& gnuplot, const fs::path& dir, std::int64_t epochs, const std::string& title,
                std::string* problem) {
  const fs::path script = dir / "plot.gp";
  {
    std::ostringstream g;
    g << "# Made by kgraph train; run `gnuplot plot.gp` in this folder to redraw.\n"
      << "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) { set terminal pngcairo size 900,720 } "
         "else { set terminal png size 900,720 }\n"
      << "set output 'plot.png'\n"
      << "set datafile separator ','\n"
      << "set key autotitle columnhead\n"
      << "set xrange [0.5:" << epochs << ".5]\n"
      << "set xtics 1\n"
      << "set grid\n"
      << "set lmargin 10\n"
      << "set multiplot layout 2,1 title " << gnuplot_quote(title) << "\n"
      << "set ylabel 'loss'\n"
      << "plot 'epochs.csv' using 1:3 with linespoints lw 2 title 'training loss', \\\n"
      << "     'epochs.csv' using 1:4 with linespoints lw 2 title 'test loss'\n"
      << "set xlabel 'epoch'\n"
      << "set ylabel 'test accuracy (%)'\n"
      << "set key bottom right\n"
      << "plot 'epochs.csv' using 1:5 with linespoints lw 2 title 'test accuracy'\n"
      << "unset multiplot\n";
    std::string why;
    if (!kg::util::write_file_atomic(script, g.str(), 0644, &why)) {
      *problem = "cannot write " + script.string() + ": " + why;
      return false;
    }
  }
  return run_in_folder(gnuplot, "plot.gp", dir, problem);
}

struct EvalResult {
  double loss = 0, accuracy = 0;
};

// Mean cross-entropy and accuracy over the real rows of every (padded) test batch, in inference
// mode, from the logits.
EvalResult evaluate(kg::LoadedModel& m, const kg::data::ImageDataset& test, std::int64_t batch,
                    std::size_t logits_index) {
  m.set_training(false);
  double loss_sum = 0;
  std::int64_t correct = 0, count = 0;
  const std::int64_t n = test.num_batches(batch, /*drop_last=*/false);
  for (std::int64_t k = 0; k < n; ++k) {
    const kg::data::Batch b = test.batch(k, batch);
    const std::vector<kg::Tensor> outs = m.forward({b.images, b.labels});
    const kg::Tensor& logits = outs.at(logits_index);
    const std::int64_t classes = logits.dim(1);
    for (std::int64_t r = 0; r < b.real; ++r) {
      double best = -INFINITY, mx = -INFINITY;
      std::int64_t arg = -1;
      for (std::int64_t c = 0; c < classes; ++c) {
        const double v = logits.item(r * classes + c);
        if (v > best || arg < 0) {
          best = v;
          arg = c;
        }
        mx = std::max(mx, v);
      }
      double sum = 0;
      for (std::int64_t c = 0; c < classes; ++c) sum += std::exp(logits.item(r * classes + c) - mx);
      const std::int64_t label = b.labels.data<std::int64_t>()[r];
      loss_sum += mx + std::log(sum) - logits.item(r * classes + label);
      correct += arg == label;
      ++count;
    }
  }
  m.set_training(true);
  return {count ? loss_sum / static_cast<double>(count) : NAN,
          count ? 100.0 * static_cast<double>(correct) / static_cast<double>(count) : NAN};
}

// The progress line: redrawn in place on a terminal, printed a few times per epoch otherwise.
class Progress {
 public:
  Progress(std::ostream& out, bool tty) : out_(out), tty_(tty) {}
  // An error that ends the run is printed on a clean line.
  ~Progress() { clear(); }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  void update(std::int64_t epoch, std::int64_t epochs, std::int64_t k, std::int64_t n, double images_per_s,
              double mean_loss, double eta_s) {
    const std::int64_t every = std::max<std::int64_t>(1, n / 4);
    if (!tty_ && k % every != 0 && k != n) return;
    const std::string line =
        kg::util::cat("epoch ", epoch, "/", epochs, "  batch ", k, "/", n, "  ", fixed(images_per_s, 0),
                      " images/s  loss ", fixed(mean_loss, 4), "  ETA ", clock_text(eta_s));
    if (tty_) {
      // At most ten redraws a second (a GPU runs hundreds of batches a second).
      const auto now = Clock::now();
      if (drawn_ && k != n && now - last_ < std::chrono::milliseconds(100)) return;
      last_ = now;
      out_ << "\r" << line << "\033[K" << std::flush;
      drawn_ = true;
    } else {
      out_ << line << "\n" << std::flush;
    }
  }
  // Clears a drawn line before other output.
  void clear() {
    if (tty_ && drawn_) out_ << "\r\033[K" << std::flush;
    drawn_ = false;
  }

 private:
  std::ostream& out_;
  bool tty_;
  bool drawn_ = false;
  Clock::time_point last_{};
};

// Swallows what ranks other than 0 would print.
class NullStream : public std::ostream {
 public:
  NullStream() : std::ostream(nullptr) {}
};

// The device of this rank: with several ranks on GPUs each takes cuda:<local rank>.
kg::Device rank_device(const std::string& text, const kg::ProcessGroup* group) {
  kg::Device d = kg::Device::parse(text);
  if (!group || d.kind != kg::Device::Kind::Cuda) return d;
  if (text.find(':') != std::string::npos && group->size() > 1)
    throw kg::Error(kg::util::cat("--device ", text, " names one GPU, but the job has ", group->size(),
                                  " ranks, each on a GPU of its own; pass --device cuda"));
  if (text.find(':') == std::string::npos) {
    const int count = kg::cuda::device_count();
    if (group->local_rank() >= count)
      throw kg::Error(kg::util::cat("rank ", group->rank(), " is local rank ", group->local_rank(),
                                    " on a machine with ", count, count == 1 ? " GPU" : " GPUs",
                                    "; start at most one rank per GPU"));
    d.index = group->local_rank();
  }
  return d;
}

// Rows [rank * rows, (rank + 1) * rows) of a global batch.
kg::data::Batch shard(const kg::data::Batch& b, int rank, std::int64_t rows) {
  const std::int64_t total = b.images.dim(0);
  if (rows == total) return b;
  auto rows_of = [&](const kg::Tensor& t) {
    std::vector<std::int64_t> shape = t.shape();
    const std::size_t row_bytes = t.nbytes() / static_cast<std::size_t>(total);
    shape[0] = rows;
    kg::Tensor out = kg::Tensor::empty(t.dtype(), shape);
    std::memcpy(out.raw(), static_cast<const char*>(t.raw()) + static_cast<std::size_t>(rank * rows) * row_bytes,
                out.nbytes());
    return out;
  };
  kg::data::Batch out = b;
  out.images = rows_of(b.images);
  out.labels = rows_of(b.labels);
  out.real = std::clamp<std::int64_t>(b.real - rank * rows, 0, rows);
  return out;
}

// kgraph's arguments without --nproc (both "--nproc N" and "--nproc=N").
std::vector<std::string> rank_arguments(const std::vector<std::string>& cl) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < cl.size(); ++i) {
    if (cl[i] == "--nproc") {
      ++i;
      continue;
    }
    if (cl[i].rfind("--nproc=", 0) == 0) continue;
    out.push_back(cl[i]);
  }
  return out;
}

std::string self_executable() {
  std::error_code ec;
  const fs::path p = fs::read_symlink("/proc/self/exe", ec);
  if (ec) throw kg::Error("--nproc: cannot find kgraph's own executable (/proc/self/exe): " + ec.message());
  return p.string();
}

// The process groups of the children of --nproc (mpirun, or the ranks on GPUs), each its own, so
// that a signal to kgraph reaches all of them: the handler forwards SIGTERM, SIGINT and SIGHUP to
// every group (kill() is async-signal-safe) and the launcher waits for them before it goes.
std::atomic<pid_t> child_groups[kgraph_cli::kMaxProcesses];
std::atomic<int> child_group_count{0};
volatile std::sig_atomic_t forwarded_signal = 0;

extern "C" void forward_signal(int sig) {
  forwarded_signal = sig;
  const int n = child_group_count.load();
  for (int i = 0; i < n; ++i)
    if (const pid_t g = child_groups[i].load(); g > 0) ::kill(-g, sig);
}

// Forwards the signals while alive; restores the old handlers after.
class SignalForwarding {
 public:
  SignalForwarding() {
    struct sigaction sa {};
    sa.sa_handler = forward_signal;
    sigemptyset(&sa.sa_mask);
    for (std::size_t i = 0; i < std::size(kSignals); ++i) ::sigaction(kSignals[i], &sa, &old_[i]);
  }
  ~SignalForwarding() {
    for (std::size_t i = 0; i < std::size(kSignals); ++i) ::sigaction(kSignals[i], &old_[i], nullptr);
    child_group_count = 0;
  }
  // After the children are gone: a forwarded signal ends kgraph too, as it would have.
  static void raise_forwarded() {
    if (const int sig = forwarded_signal) {
      ::signal(sig, SIG_DFL);
      ::raise(sig);
    }
  }

 private:
  static constexpr int kSignals[] = {SIGTERM, SIGINT, SIGHUP};
  struct sigaction old_[3] {};
};

// Starts `argv` as a child with `env` added to this process's environment, in a process group of
// its own (registered for SignalForwarding) and with standard input from /dev/null (a child in
// another group reading the terminal would be stopped).
pid_t spawn(const std::vector<std::string>& argv, const std::vector<std::pair<std::string, std::string>>& env) {
  std::vector<std::string> args = argv;
  std::vector<char*> cargv;
  for (auto& a : args) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  std::vector<std::string> envs;
  for (char** e = environ; *e; ++e) {
    const std::string_view kv(*e);
    bool replaced = false;
    for (const auto& [k, v] : env) replaced = replaced || kv.rfind(k + "=", 0) == 0;
    if (!replaced) envs.emplace_back(kv);
  }
  for (const auto& [k, v] : env) envs.push_back(k + "=" + v);
  std::vector<char*> cenv;
  for (auto& e : envs) cenv.push_back(e.data());
  cenv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) throw kg::Error(kg::util::cat("--nproc: cannot start a rank: ", std::strerror(errno)));
  if (pid == 0) {
    ::setpgid(0, 0);
    if (const int in = ::open("/dev/null", O_RDONLY); in >= 0) ::dup2(in, STDIN_FILENO);
    ::execve(cargv[0], cargv.data(), cenv.data());
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here: a signal may come before the child runs
  const int k = child_group_count.load();
  if (k < kgraph_cli::kMaxProcesses) {
    child_groups[k] = pid;
    child_group_count = k + 1;
  }
  if (forwarded_signal) ::kill(-pid, forwarded_signal);  // signalled while it was being started
  return pid;
}

// Waits for the children; when one fails, stops the others (they would wait for it). Returns the
// first failure's text, or "".
std::string wait_all(std::vector<pid_t> pids, const std::vector<std::string>& names) {
  std::string failure;
  std::size_t left = pids.size();
  while (left > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    const auto it = std::find(pids.begin(), pids.end(), pid);
    if (it == pids.end()) continue;
    const std::size_t k = static_cast<std::size_t>(it - pids.begin());
    *it = -1;
    --left;
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok && failure.empty()) {
      failure = WIFEXITED(status) ? kg::util::cat(names[k], " exited with status ", WEXITSTATUS(status))
                                  : kg::util::cat(names[k], " was killed by signal ", WTERMSIG(status));
      for (pid_t other : pids)
        if (other > 0) ::kill(other, SIGTERM);
    }
  }
  return failure;
}

// --nproc N: on the cpu the ranks run under OpenMPI's mpirun (their gradients go over MPI); on
// GPUs they are N children of this process that meet in a rendezvous folder and average their
// gradients with NCCL.
void launch_ranks(const TrainArgs& a, std::ostream& out) {
  const int n = a.nproc;
  SignalForwarding forwarding;
  const kg::Device device = kg::Device::parse(a.device);
  std::vector<std::string> rest = rank_arguments(a.command_line);
  const std::string self = self_executable();
  if (a.batch_size && *a.batch_size % n != 0)
    throw kg::Error(kg::util::cat("--batch-size ", *a.batch_size, " does not split over --nproc ", n,
                                  " ranks (each rank takes an equal share; pick a multiple of ", n, ")"));
  const std::string tty = &out == &std::cout && ::isatty(STDOUT_FILENO) ? "1" : "0";
  out << std::flush;
  if (device.kind == kg::Device::Kind::Cpu) {
    // Four ranks per core is already far past a useful job; more made mpirun spin.
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    if (n > 4 * cores)
      throw kg::Error(kg::util::cat("--nproc ", n, " on the cpu starts more than four ranks per core (this machine has ",
                                    cores, " cores: at most ", 4 * cores, ")"));
    const std::string mpirun = find_program("mpirun");
    if (mpirun.empty())
      throw kg::Error(kg::util::cat("--nproc ", n, " on the cpu runs the ranks under OpenMPI's mpirun, which is not "
                                    "on PATH (Debian: apt install openmpi-bin), or start them yourself: "
                                    "mpirun -np ", n, " kgraph train ..."));
    std::vector<std::string> argv{mpirun, "-np", std::to_string(n), "--oversubscribe", "--bind-to", "none"};
    if (::geteuid() == 0) argv.push_back("--allow-run-as-root");
    argv.push_back(self);
    argv.insert(argv.end(), rest.begin(), rest.end());
    // The cores are shared out between the ranks unless --threads says otherwise.
    if (a.threads == 0 && !std::getenv("KG_NUM_THREADS")) {
      const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
      argv.push_back("--threads");
      argv.push_back(std::to_string(std::max(1u, cores / static_cast<unsigned>(n))));
    }
    const std::string failure = wait_all({spawn(argv, {{"KG_PROGRESS_TTY", tty}})}, {"mpirun"});
    SignalForwarding::raise_forwarded();
    if (!failure.empty()) throw kg::Error("the data-parallel job failed: " + failure);
    return;
  }
  if (device.index != 0 || a.device.find(':') != std::string::npos)
    throw kg::Error(kg::util::cat("--nproc ", n, " puts rank r on cuda:r; pass --device cuda, not ", a.device));
  if (n > kg::cuda::device_count())
    throw kg::Error(kg::util::cat("--nproc ", n, " needs a GPU per rank; this machine has ", kg::cuda::device_count()));
  std::string pattern = (fs::temp_directory_path() / "kgraph-rendezvous-XXXXXX").string();
  if (!::mkdtemp(pattern.data()))
    throw kg::Error(kg::util::cat("--nproc: cannot make a rendezvous folder: ", std::strerror(errno)));
  std::vector<pid_t> pids;
  std::vector<std::string> names;
  std::vector<std::string> argv{self};
  argv.insert(argv.end(), rest.begin(), rest.end());
  for (int r = 0; r < n; ++r) {
    pids.push_back(spawn(argv, {{"KG_WORLD_SIZE", std::to_string(n)},
                                {"KG_RANK", std::to_string(r)},
                                {"KG_LOCAL_RANK", std::to_string(r)},
                                {"KG_RENDEZVOUS", pattern},
                                {"KG_PROGRESS_TTY", tty}}));
    names.push_back(kg::util::cat("rank ", r));
  }
  const std::string failure = wait_all(pids, names);
  std::error_code ec;
  fs::remove_all(pattern, ec);
  SignalForwarding::raise_forwarded();
  if (!failure.empty()) throw kg::Error("the data-parallel job failed: " + failure);
}

}  // namespace

CLI::App* add_train_command(CLI::App& app, TrainArgs& a) {
  CLI::App* t = app.add_subcommand("train", "Train a zoo model on Fashion-MNIST (logs, plot, checkpoints)");
  // A flag given twice takes its last value (scripts append overrides).
  t->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  t->add_option_function<std::string>(
      "MODEL", [&a](const std::string& v) { a.model = v; },
      "Model name (default lenet5-tanh; see 'kgraph models')");
  t->add_option("--device", a.device, "auto (the default: the GPU when there is one), cpu, cuda or cuda:N")
      ->option_text("DEVICE");
  t->add_option("--data", a.data_dir,
                "Folder of the Fashion-MNIST IDX files (default: $KG_FASHION_MNIST_DIR, else the "
                "dataset-fashion-mnist package's)")
      ->option_text("DIR");
  t->add_option_function<std::string>(
       "--optimizer", [&a](const std::string& v) { a.optimizer = v; }, "adamw (the default) or sgd")
      ->check(CLI::IsMember({"adamw", "sgd"}))
      ->option_text("NAME");
  t->add_option_function<double>(
       "--lr", [&a](const double& v) { a.lr = v; }, "Learning rate (default 0.002)")
      ->check(kgraph_cli::finite_non_negative)
      ->check(CLI::PositiveNumber)
      ->option_text("LR");
  t->add_option_function<double>(
       "--weight-decay", [&a](const double& v) { a.weight_decay = v; },
       "Weight decay (default 0.01 for adamw, decoupled; 0 for sgd)")
      ->check(kgraph_cli::finite_non_negative)
      ->option_text("WD");
  t->add_option_function<double>(
       "--momentum", [&a](const double& v) { a.momentum = v; }, "SGD momentum (default 0)")
      ->check(CLI::Range(0.0, 1.0))
      ->option_text("M");
  t->add_option("--epochs", a.epochs, "Epochs in all, counting those of a resumed checkpoint (default 8)")
      ->check(kgraph_cli::positive_int)
      ->option_text("N");
  t->add_option_function<std::int64_t>(
       "--batch-size", [&a](const std::int64_t& v) { a.batch_size = v; }, "Batch size (default 128)")
      ->check(kgraph_cli::positive_integer)
      ->option_text("N");
  t->add_option_function<std::uint64_t>(
       "--seed", [&a](const std::uint64_t& v) { a.seed = v; },
       "Seed of the shuffling and the parameter initialisation (default 0)")
      ->check(kgraph_cli::seed_value)
      ->option_text("S");
  t->add_option("--threads", a.threads,
                "CPU worker threads, at most " + std::to_string(kg::util::ThreadPool::kMaxThreads) +
                    " (default 0: $KG_NUM_THREADS, else one per core)")
      ->check(kgraph_cli::thread_count)
      ->option_text("N");
  t->add_flag("--checked", a.checked,
              "Checked mode: every kernel's writes verified, forward and backward (slow; finds a broken op)");
  t->add_option(
       "--out", a.out_dir,
       "Folder for log.csv, epochs.csv, plot.png and checkpoints (default runs/<model>-<time>, or the "
       "checkpoint's folder with --resume)")
      ->option_text("DIR");
  t->add_option("--resume", a.resume,
                "Continue from a checkpoint of this command, at the epoch after its own")
      ->option_text("CKPT");
  t->add_option_function<std::int64_t>(
       "--limit-train", [&a](const std::int64_t& v) { a.limit_train = v; },
       "Train on the first N training images only")
      ->check(kgraph_cli::positive_integer)
      ->option_text("N");
  t->add_option_function<std::int64_t>(
       "--limit-test", [&a](const std::int64_t& v) { a.limit_test = v; },
       "Evaluate on the first N test images only")
      ->check(kgraph_cli::positive_integer)
      ->option_text("N");
  t->add_option("--nproc", a.nproc,
                "Data-parallel: start N ranks, each training on its share of every batch (cpu: under "
                "OpenMPI's mpirun; GPUs: one per rank, gradients over NCCL)")
      ->check(kgraph_cli::process_count)
      ->option_text("N");
  return t;
}

// One rank of a job (`group`), or the whole run when `group` is null.
static void train_rank(const TrainArgs& args, std::ostream& all_out, kg::ProcessGroup* group) {
  const int rank = group ? group->rank() : 0, ranks = group ? group->size() : 1;
  const bool lead = rank == 0;  // prints, evaluates and writes the files
  NullStream quiet;
  std::ostream& out = lead ? all_out : quiet;
  // ---- settings, from the flags and the checkpoint ----
  std::map<std::string, std::string> meta;
  std::int64_t done_epochs = 0, global_step = 0;
  if (!args.resume.empty()) {
    if (!fs::is_regular_file(args.resume))
      throw kg::Error(kg::util::cat("checkpoint '", args.resume, "' does not exist"));
    kg::read_safetensors(args.resume, &meta);
    done_epochs = parse_meta_int<std::int64_t>(meta_value(meta, "epoch", args.resume), "epoch", args.resume,
                                               0, kMaxCheckpointEpoch);
    global_step = parse_meta_int<std::int64_t>(meta_value(meta, "step", args.resume), "step", args.resume,
                                               0, kMaxCheckpointStep);
  }
  const Settings s = resolve(args, args.resume.empty() ? nullptr : &meta);
  if (s.batch % ranks != 0)
    throw kg::Error(kg::util::cat("the batch of ", s.batch, " does not split over ", ranks,
                                  " ranks (each rank takes an equal share; pick a multiple of ", ranks, ")"));
  const std::int64_t local_batch = s.batch / ranks;
  const kg::Device device = rank_device(args.device, group);
  kg::Model model = build_training_model(s.model);

  // ---- data ----
  kg::data::FashionMnistFiles files;
  try {
    files = kg::data::find_fashion_mnist(args.data_dir);
  } catch (const kg::Error& e) {
    if (!args.data_dir.empty()) throw;
    throw kg::Error(kg::util::cat(e.what(), "; or pass --data DIR"));
  }
  const std::string& data_dir = files.dir;
  kg::data::ImageDataset train_set = kg::data::ImageDataset::load(files.train_images, files.train_labels);
  kg::data::ImageDataset test_set = kg::data::ImageDataset::load(files.test_images, files.test_labels);
  if (s.limit_train) train_set.truncate(*s.limit_train);
  if (args.limit_test) test_set.truncate(*args.limit_test);
  const std::vector<std::int64_t> in_shape = kg::models::input_shape(s.model, local_batch);
  if (train_set.height() != in_shape[2] || train_set.width() != in_shape[3] ||
      test_set.height() != in_shape[2] || test_set.width() != in_shape[3])
    throw kg::Error(kg::util::cat("the images in '", data_dir, "' are ", train_set.height(), "x",
                                  train_set.width(), " (test ", test_set.height(), "x", test_set.width(),
                                  ") but ", s.model, " takes ", in_shape[2], "x", in_shape[3]));
  const std::int64_t steps = train_set.num_batches(s.batch, /*drop_last=*/true);
  if (steps == 0)
    throw kg::Error(kg::util::cat("the training set has ", train_set.size(),
                                  " images, fewer than one batch of ", s.batch,
                                  " (use a smaller --batch-size)"));

  // ---- the model ----
  kg::LoadOptions lo;
  lo.seed = s.seed;
  lo.threads = args.threads;
  lo.checked = args.checked;
  lo.loss = "loss";
  if (group) lo.process_group = std::shared_ptr<kg::ProcessGroup>(group, [](kg::ProcessGroup*) {});
  std::optional<kg::LoadedModel> loaded;
  try {
    loaded.emplace(model.load(device, {in_shape, {local_batch}}, lo));
  } catch (const kg::Error& e) {
    throw kg::Error(
        kg::util::cat("cannot load ", s.model, " for training on ", device.to_string(), ": ", e.what()));
  }
  kg::LoadedModel& m = *loaded;
  const std::vector<std::string> names = m.output_names();
  const auto index_of = [&](const std::string& n) {
    return static_cast<std::size_t>(std::find(names.begin(), names.end(), n) - names.begin());
  };
  const std::size_t logits_i = index_of("logits"), loss_i = index_of("loss");
  const std::int64_t classes = m.output_shapes().at(logits_i).at(1);
  for (const auto* set : {&train_set, &test_set})
    if (set->num_classes() > classes)
      throw kg::Error(kg::util::cat("the labels in '", data_dir, "' go up to ", set->num_classes() - 1,
                                    " but ", s.model, " has ", classes, " classes"));
  m.set_optimizer(optimizer_options(s));
  m.set_training(true);
  if (!args.resume.empty()) m.load_checkpoint(args.resume);

  // ---- output folder ----
  fs::path dir = args.out_dir;
  if (dir.empty())
    dir = args.resume.empty() ? fs::path("runs") / kg::util::cat(s.model, "-", timestamp())
                              : fs::absolute(args.resume).parent_path();
  std::optional<CsvLog> log, epochs_log;
  if (lead) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (!fs::is_directory(dir))
      throw kg::Error(kg::util::cat("cannot create the output folder '", dir.string(), "'"));
    log.emplace(dir / "log.csv", kLogHeader, done_epochs);
    epochs_log.emplace(dir / "epochs.csv", kEpochsHeader, done_epochs);
  }
  const std::string gnuplot_program = lead ? find_program("gnuplot") : std::string();
  const bool gnuplot = !gnuplot_program.empty();

  const std::string opt_text =
      s.optimizer == "sgd"
          ? kg::util::cat("sgd lr ", s.lr, " momentum ", s.momentum, " weight decay ", s.weight_decay)
          : kg::util::cat("adamw lr ", s.lr, " weight decay ", s.weight_decay);
  out << "training " << s.model << " on " << m.device().to_string() << ": " << train_set.size()
      << " training and " << test_set.size() << " test images from " << data_dir << "\n";
  out << "batch " << s.batch << " (" << steps << " steps per epoch), " << opt_text << ", seed " << s.seed
      << ", writing to " << dir.string() << "\n";
  if (group)
    out << "data parallel: " << ranks << (ranks == 1 ? " rank" : " ranks") << " over " << group->transport()
        << (device.kind == kg::Device::Kind::Cuda ? " (gradients over NCCL)" : "") << ", " << local_batch
        << " images per rank of each batch\n";
  if (!args.resume.empty()) out << "resuming from " << args.resume << " after epoch " << done_epochs << "\n";
  if (lead && !gnuplot) out << "note: gnuplot not found, so no plot is drawn (install gnuplot-nox)\n";
  out << std::flush;

  // mpirun gives its ranks a pseudo-terminal whatever its own output is: there the launcher says
  // (KG_PROGRESS_TTY), and a rank under a user's mpirun prints plain lines.
  const char* tty_env = std::getenv("KG_PROGRESS_TTY");
  const bool tty = lead && &all_out == &std::cout &&
                   (tty_env ? std::string_view(tty_env) == "1"
                            : (!group || group->transport() != "mpi") && ::isatty(STDOUT_FILENO));
  Progress progress(out, tty);
  EvalResult last{};
  if (done_epochs >= args.epochs) {
    out << "the checkpoint is at epoch " << done_epochs << ", which --epochs " << args.epochs
        << " does not go beyond; evaluating it\n";
    if (lead) last = evaluate(m, test_set, local_batch, logits_i);
    out << "epoch " << done_epochs << ": test loss " << fixed(last.loss, 4) << ", test accuracy "
        << fixed(last.accuracy, 2) << "%\n";
  }

  for (std::int64_t epoch = done_epochs + 1; epoch <= args.epochs; ++epoch) {
    const auto t0 = Clock::now();
    train_set.shuffle(kg::data::epoch_seed(s.seed, epoch));
    double loss_sum = 0;
    for (std::int64_t k = 0; k < steps; ++k) {
      const kg::data::Batch b = shard(train_set.batch(k, s.batch), rank, local_batch);
      m.zero_grad();
      const std::vector<kg::Tensor> outs = m.forward({b.images, b.labels});
      m.backward();
      m.step();
      const double loss = outs.at(loss_i).item(0);
      loss_sum += loss;
      ++global_step;
      const bool last_step = k + 1 == steps;
      if (lead && !last_step) log->row(kg::util::cat(epoch, ",", global_step, ",", fixed(loss, 6), ","));
      const double elapsed = seconds_since(t0);
      const double per_batch = elapsed / static_cast<double>(k + 1);
      progress.update(epoch, args.epochs, k + 1, steps, static_cast<double>((k + 1) * s.batch) / elapsed,
                      loss_sum / static_cast<double>(k + 1), per_batch * static_cast<double>(steps - k - 1));
      if (last_step && lead) {
        progress.clear();
        last = evaluate(m, test_set, local_batch, logits_i);
        log->row(kg::util::cat(epoch, ",", global_step, ",", fixed(loss, 6), ",", fixed(last.accuracy, 4)));
      }
    }
    // Each rank's mean over its shards; the job's mean is the mean over the ranks.
    if (group) group->all_reduce_sum(&loss_sum, 1);
    const double train_loss = loss_sum / static_cast<double>(steps * ranks);
    const double secs = seconds_since(t0);
    if (!lead) continue;
    epochs_log->row(kg::util::cat(epoch, ",", global_step, ",", fixed(train_loss, 6), ",", fixed(last.loss, 6),
                                 ",", fixed(last.accuracy, 4), ",", fixed(secs, 3)));
    out << "epoch " << epoch << ": train loss " << fixed(train_loss, 4) << ", test loss "
        << fixed(last.loss, 4) << ", test accuracy " << fixed(last.accuracy, 2) << "%, time "
        << fixed(secs, 1) << " s\n"
        << std::flush;

    const fs::path ckpt = dir / kg::util::cat("checkpoint-epoch", epoch, ".safetensors");
    m.save_checkpoint(ckpt.string(), {{"epoch", std::to_string(epoch)},
                                      {"step", std::to_string(global_step)},
                                      {"seed", std::to_string(s.seed)},
                                      {"model", s.model},
                                      {"optimizer", s.optimizer},
                                      {"lr", exact(s.lr)},
                                      {"weight_decay", exact(s.weight_decay)},
                                      {"momentum", exact(s.momentum)},
                                      {"batch_size", std::to_string(s.batch)},
                                      {"ranks", std::to_string(ranks)},
                                      {"limit_train", s.limit_train ? std::to_string(*s.limit_train) : "all"},
                                      {"train_loss", fixed(train_loss, 6)},
                                      {"test_loss", fixed(last.loss, 6)},
                                      {"test_accuracy", fixed(last.accuracy, 4)}});
    if (gnuplot) {
      std::string problem;
      if (!write_plot(gnuplot_program, dir, args.epochs, kg::util::cat(s.model, " on Fashion-MNIST"),
                      &problem))
        out << "note: no plot: " << problem << "\n";
    }
  }
  if (!lead) return;
  if (gnuplot && fs::exists(dir / "plot.png")) out << "plot: " << (dir / "plot.png").string() << "\n";
  out << "final test accuracy: " << fixed(last.accuracy, 2) << "%\n";
}


void train(const TrainArgs& args, std::ostream& out) {
  const bool in_job = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("KG_WORLD_SIZE");
  if (args.nproc > 0) {
    if (in_job)
      throw kg::Error(
          "--nproc starts the ranks itself; under mpirun (or in a rank it started) leave --nproc out");
    launch_ranks(args, out);
    return;
  }
  if (!in_job) {
    train_rank(args, out, nullptr);
    return;
  }
  const std::shared_ptr<kg::ProcessGroup> group = kg::ProcessGroup::join();
  try {
    train_rank(args, out, group.get());
  } catch (const kg::Error& e) {
    if (group->size() > 1)
      throw kg::Error(kg::util::cat("rank ", group->rank(), " of ", group->size(), ": ", e.what()));
    throw;
  }
}

}  // namespace kgraph
