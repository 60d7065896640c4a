// onnx-conformance: runs the ONNX backend test data (Debian's libonnx-testdata: every node test, the
// pytorch-converted and pytorch-operator models) through the importer on the CPU, with each test's
// own inputs and outputs and ONNX's tolerances, and writes a table per op.
//
//   onnx-conformance [--data DIR] [--markdown FILE] [--results FILE] [--baseline FILE] [--filter TEXT]
//
// Each test runs in a child process (a crash or a hang is that test's failure, not the runner's).
// With --baseline, the run fails when a test listed there as passing does not pass, or when an op
// claimed there passes fewer than 95% of its tests.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "kg/kg.hpp"
#include "kg/onnx.hpp"
#include "onnx/onnx_pb.h"

namespace fs = std::filesystem;

namespace {

struct Result {
  std::string suite, test, op;
  std::string status;  // pass, fail, unsupported
  std::string reason;
};

// Why a group of op types is not supported, for the table's last section.
const std::vector<std::pair<std::string, std::vector<std::string>>>& not_supported_by_design() {
  static const std::vector<std::pair<std::string, std::vector<std::string>>> groups{
      {"control flow (subgraphs)", {"If", "Loop", "Scan", "SequenceMap"}},
      {"sequences and optionals", {"SequenceInsert", "SequenceAt", "SequenceConstruct", "SequenceEmpty",
                                   "SequenceErase", "SequenceLength", "SplitToSequence", "ConcatFromSequence",
                                   "Optional", "OptionalHasElement", "OptionalGetElement"}},
      {"strings", {"StringNormalizer", "TfIdfVectorizer", "RegexFullMatch", "StringConcat", "StringSplit"}},
      {"quantized integer arithmetic", {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv",
                                        "QLinearMatMul", "ConvInteger", "MatMulInteger"}},
      {"training operators (ai.onnx.preview.training)", {"Adagrad", "Adam", "Momentum", "Gradient"}},
      {"random numbers (no reproducible reference)", {"Bernoulli", "RandomNormal", "RandomNormalLike", "RandomUniform",
                                                      "RandomUniformLike", "Multinomial"}},
      {"output shapes that depend on the data", {"NonZero", "Unique", "NonMaxSuppression", "Compress"}},
  };
  return groups;
}

// A reason without the file path the importer puts in front.
std::string strip_paths(std::string s) {
  for (const char* prefix : {"ONNX file '", "test data: ONNX tensor file '"}) {
    const auto at = s.find(prefix);
    if (at == std::string::npos) continue;
    const auto end = s.find("': ", at);
    if (end != std::string::npos) s.erase(at, end + 3 - at);
  }
  return s;
}

std::string one_line(std::string s, std::size_t max = 160) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  std::replace(s.begin(), s.end(), '|', '/');
  if (s.size() > max) s = s.substr(0, max - 3) + "...";
  return s;
}

// Compares as numpy.testing.assert_allclose(rtol, atol) with equal NaNs.
std::string compare(const kg::Tensor& got, const kg::Tensor& want, const std::string& name) {
  if (got.shape() != want.shape())
    return "output " + name + " is " + kg::sizes_to_string(got.shape()) + ", expected " + kg::sizes_to_string(want.shape());
  if (got.dtype() != want.dtype())
    return "output " + name + " is " + std::string(kg::dtype_name(got.dtype())) + ", expected " +
           std::string(kg::dtype_name(want.dtype()));
  const double rtol = 1e-3, atol = 1e-7;
  for (std::int64_t i = 0; i < want.numel(); ++i) {
    const double g = got.item(i), w = want.item(i);
    if (std::isnan(g) && std::isnan(w)) continue;
    if (g == w) continue;
    if (!(std::abs(g - w) <= atol + rtol * std::abs(w))) {
      std::ostringstream o;
      o << "output " << name << " element " << i << ": got " << g << ", expected " << w;
      return o.str();
    }
  }
  return "";
}

bool is_unsupported_message(const std::string& m) {
  for (const char* k : {"cannot be imported", "is not supported", "are not supported", "not supported",
                        "which is not supported", "element type STRING", "control flow"})
    if (m.find(k) != std::string::npos) return true;
  return false;
}

// Runs one test directory: every test_data_set_* against the model. Returns "" on success.
std::string run_test(const fs::path& dir, bool* unsupported) {
  *unsupported = false;
  const std::string model_path = (dir / "model.onnx").string();
  ::onnx::ModelProto proto;
  {
    std::ifstream f(model_path, std::ios::binary);
    if (!proto.ParseFromIstream(&f)) return "cannot parse model.onnx";
  }
  std::vector<std::string> input_names, output_names;
  std::set<std::string> inits;
  for (const auto& t : proto.graph().initializer()) inits.insert(t.name());
  for (const auto& i : proto.graph().input())
    if (!inits.count(i.name())) input_names.push_back(i.name());
  for (const auto& o : proto.graph().output()) output_names.push_back(o.name());
  for (const auto* list : {&proto.graph().input(), &proto.graph().output()})
    for (const auto& v : *list)
      if (!v.type().has_tensor_type()) {
      *unsupported = true;
      return "sequence, map or optional inputs are not supported";
    }
  std::vector<fs::path> sets;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_directory() && e.path().filename().string().rfind("test_data_set_", 0) == 0) sets.push_back(e.path());
  std::sort(sets.begin(), sets.end());
  if (sets.empty()) return "no test data sets";
  for (const auto& set : sets) {
    std::vector<kg::Tensor> inputs, outputs;
    try {
      for (std::size_t i = 0;; ++i) {
        const fs::path p = set / ("input_" + std::to_string(i) + ".pb");
        if (!fs::exists(p)) break;
        inputs.push_back(kg::onnx::read_tensor_file(p.string()));
      }
      for (std::size_t i = 0;; ++i) {
        const fs::path p = set / ("output_" + std::to_string(i) + ".pb");
        if (!fs::exists(p)) break;
        outputs.push_back(kg::onnx::read_tensor_file(p.string()));
      }
    } catch (const kg::Error& e) {
      *unsupported = is_unsupported_message(e.what());
      return std::string("test data: ") + e.what();
    }
    if (inputs.size() != input_names.size()) return "the data set's inputs do not match the graph's";
    std::map<std::string, kg::Tensor> by_name;
    for (std::size_t i = 0; i < inputs.size(); ++i) by_name[input_names[i]] = inputs[i];
    kg::onnx::ImportOptions opt;
    std::optional<kg::Model> model;
    // Inputs the importer needs as values (shapes, weights fed as graph inputs) are given one by one.
    for (int attempt = 0; attempt < 16 && !model; ++attempt) {
      try {
        model.emplace(kg::onnx::import(model_path, opt));
      } catch (const kg::onnx::InputValuesNeeded& e) {
        if (attempt == 15) return e.what();
        for (const auto& n : e.inputs) opt.input_values[n] = by_name.at(n);
      } catch (const kg::Error& e) {
        *unsupported = is_unsupported_message(e.what());
        return e.what();
      }
    }
    std::vector<kg::Tensor> feed;
    std::vector<std::vector<std::int64_t>> shapes;
    for (const auto& in : kg::onnx::model_inputs(*model)) {
      feed.push_back(by_name.at(in.name));
      shapes.push_back(feed.back().shape());
    }
    try {
      kg::LoadOptions lo;
      lo.threads = 1;
      kg::LoadedModel lm = model->load(kg::Device::cpu(), shapes, lo);
      const auto got = lm.forward(feed);
      const auto names = lm.output_names();
      for (std::size_t i = 0; i < outputs.size() && i < output_names.size(); ++i) {
        auto it = std::find(names.begin(), names.end(), output_names[i]);
        if (it == names.end()) return "output " + output_names[i] + " missing";
        const std::string diff = compare(got[static_cast<std::size_t>(it - names.begin())], outputs[i], output_names[i]);
        if (!diff.empty()) return diff;
      }
    } catch (const kg::Error& e) {
      *unsupported = is_unsupported_message(e.what());
      return e.what();
    }
  }
  return "";
}

// The op a node test is about: the op type of the model whose snake_case name is the longest
// prefix of the test name.
std::string snake(const std::string& op) {
  std::string s;
  for (std::size_t i = 0; i < op.size(); ++i) {
    const char c = op[i];
    if (std::isupper(static_cast<unsigned char>(c))) {
      const bool prev_lower = i > 0 && (std::islower(static_cast<unsigned char>(op[i - 1])) || std::isdigit(static_cast<unsigned char>(op[i - 1])));
      const bool next_lower = i + 1 < op.size() && std::islower(static_cast<unsigned char>(op[i + 1]));
      if (i > 0 && (prev_lower || (next_lower && std::isupper(static_cast<unsigned char>(op[i - 1]))))) s += '_';
      s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    } else {
      s += c;
    }
  }
  return s;
}

std::string op_of(const fs::path& dir, const std::string& suite) {
  if (suite != "node") return suite;
  ::onnx::ModelProto proto;
  std::ifstream f((dir / "model.onnx").string(), std::ios::binary);
  if (!proto.ParseFromIstream(&f)) return "?";
  const std::string name = dir.filename().string().substr(5);  // after "test_"
  std::string best;
  std::size_t best_len = 0;
  for (const auto& n : proto.graph().node()) {
    const std::string s = snake(n.op_type());
    if (name.rfind(s, 0) == 0 && s.size() > best_len) best = n.op_type(), best_len = s.size();
  }
  if (best.empty() && proto.graph().node_size() > 0) best = proto.graph().node(proto.graph().node_size() - 1).op_type();
  return best.empty() ? "?" : best;
}

// Runs run_test in a child process with a time limit.
Result run_isolated(const fs::path& dir, const std::string& suite, int timeout_s) {
  Result r{suite, dir.filename().string(), op_of(dir, suite), "fail", ""};
  int fds[2];
  if (::pipe(fds) != 0) {
    r.reason = "pipe failed";
    return r;
  }
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    ::alarm(static_cast<unsigned>(timeout_s));
    bool unsupported = false;
    std::string msg;
    try {
      msg = run_test(dir, &unsupported);
    } catch (const std::exception& e) {
      msg = std::string("exception: ") + e.what();
    }
    const std::string out = (msg.empty() ? "pass" : unsupported ? "unsupported" : "fail") + std::string("\n") + msg;
    const ssize_t w = ::write(fds[1], out.data(), out.size());
    (void)w;
    ::close(fds[1]);
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) text.append(buf, static_cast<std::size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) {
    r.reason = WTERMSIG(status) == SIGALRM ? "timed out" : std::string("crashed: ") + strsignal(WTERMSIG(status));
    return r;
  }
  const auto nl = text.find('\n');
  r.status = text.substr(0, nl);
  r.reason = nl == std::string::npos ? "" : one_line(strip_paths(text.substr(nl + 1)), 400);
  if (r.status.empty()) r.status = "fail", r.reason = "no result";
  return r;
}

struct Baseline {
  std::set<std::string> passing;  // suite/test
  std::set<std::string> claimed;  // op types
};

Baseline read_baseline(const std::string& path) {
  Baseline b;
  std::ifstream f(path);
  if (!f) throw kg::Error("cannot read the baseline '" + path + "'");
  std::string kind, name;
  for (std::string line; std::getline(f, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream in(line);
    in >> kind >> name;
    if (kind == "pass") b.passing.insert(name);
    else if (kind == "claim") b.claimed.insert(name);
  }
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  std::string data = "/usr/share/libonnx-testdata/data", markdown, results_path, baseline_path, filter, write_baseline;
  int timeout_s = 60;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << "onnx-conformance: " << a << " needs a value\n";
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--data") data = next();
    else if (a == "--markdown") markdown = next();
    else if (a == "--results") results_path = next();
    else if (a == "--baseline") baseline_path = next();
    else if (a == "--filter") filter = next();
    else if (a == "--write-baseline") write_baseline = next();
    else if (a == "--timeout") timeout_s = std::stoi(next());
    else if (a == "--help" || a == "-h") {
      std::cout << "usage: onnx-conformance [--data DIR] [--markdown FILE] [--results FILE] [--baseline FILE]\n"
                   "                        [--write-baseline FILE] [--filter TEXT] [--timeout S]\n"
                   "Runs the ONNX backend test data on the cpu and prints a table per op.\n";
      return 0;
    } else {
      std::cerr << "onnx-conformance: unknown argument " << a << "\n";
      return 2;
    }
  }
  if (!fs::is_directory(data)) {
    std::cerr << "onnx-conformance: no test data at " << data << " (Debian's libonnx-testdata; scripts/install-deps installs it)\n";
    return 77;
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Result> results;
  for (const char* suite : {"node", "pytorch-converted", "pytorch-operator"}) {
    const fs::path root = fs::path(data) / suite;
    if (!fs::is_directory(root)) continue;
    std::vector<fs::path> dirs;
    for (const auto& e : fs::directory_iterator(root))
      if (e.is_directory() && fs::exists(e.path() / "model.onnx")) dirs.push_back(e.path());
    std::sort(dirs.begin(), dirs.end());
    for (const auto& d : dirs) {
      if (!filter.empty() && d.filename().string().find(filter) == std::string::npos) continue;
      results.push_back(run_isolated(d, suite, timeout_s));
      if (results.size() % 100 == 0) std::cerr << "onnx-conformance: " << results.size() << " tests run\n";
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  struct Row {
    int tests = 0, pass = 0, fail = 0, unsupported = 0;
    std::string first_fail, first_unsupported;
  };
  std::map<std::string, Row> by_op;
  std::map<std::string, Row> by_suite;
  for (const auto& r : results) {
    for (Row* row : {&by_op[r.suite == "node" ? r.op : r.suite + " (models)"], &by_suite[r.suite]}) {
      ++row->tests;
      if (r.status == "pass") ++row->pass;
      else if (r.status == "unsupported") {
        ++row->unsupported;
        if (row->first_unsupported.empty()) row->first_unsupported = r.test + ": " + r.reason;
      } else {
        ++row->fail;
        if (row->first_fail.empty()) row->first_fail = r.test + ": " + r.reason;
      }
    }
  }

  std::ostringstream md;
  md << "# ONNX conformance\n\n"
     << "The ONNX backend test data (Debian's `libonnx-testdata`, ONNX 1.12) run through the importer on the\n"
     << "cpu, each test with its own inputs and expected outputs, compared with ONNX's tolerances (rtol 1e-3,\n"
     << "atol 1e-7, NaNs equal). *Unsupported* means the importer refuses the model with a clear error (an op\n"
     << "or a feature it does not convert); *failed* means it imported but gave a wrong result or error.\n"
     << "Regenerate with `scripts/onnx-conformance` (it also updates the baseline the tests check).\n"
     << "The importer knows opsets 1 to 21 of the standard domain; this data is ONNX 1.12's (opsets up to 17),\n"
     << "so the changes of opsets 18 to 21 are checked by `tests/io/test_onnx_opset.cpp` (docs/onnx.md, Opsets).\n\n";
  md << "| suite | tests | passed | failed | unsupported |\n| --- | ---: | ---: | ---: | ---: |\n";
  Row total;
  for (const auto& [suite, row] : by_suite) {
    md << "| " << suite << " | " << row.tests << " | " << row.pass << " | " << row.fail << " | " << row.unsupported << " |\n";
    total.tests += row.tests, total.pass += row.pass, total.fail += row.fail, total.unsupported += row.unsupported;
  }
  md << "| **all** | " << total.tests << " | " << total.pass << " | " << total.fail << " | " << total.unsupported << " |\n\n";
  const auto supported = kg::onnx::supported_ops();
  auto is_supported = [&](const std::string& op) {
    return std::find(supported.begin(), supported.end(), op) != supported.end();
  };
  md << "## Per op\n\nAn op is *claimed* when the importer converts it and it passes at least 95% of its tests;\n"
     << "the suite fails when a claimed op falls below that or a passing test stops passing.\n\n"
     << "| op | claimed | tests | passed | failed | unsupported | first failure / first unsupported |\n"
     << "| --- | :---: | ---: | ---: | ---: | ---: | --- |\n";
  for (const auto& [op, row] : by_op) {
    std::string why = row.first_fail.empty() ? row.first_unsupported : row.first_fail;
    const bool claimed = is_supported(op) && row.pass * 100 >= row.tests * 95;
    md << "| " << op << " | " << (claimed ? "yes" : is_supported(op) ? "partly" : "no") << " | " << row.tests << " | "
       << row.pass << " | " << row.fail << " | " << row.unsupported << " | " << one_line(why, 200) << " |\n";
  }
  md << "\n## Not supported, and why\n\n";
  for (const auto& [why, ops] : not_supported_by_design()) {
    std::vector<std::string> present;
    for (const auto& op : ops)
      if (by_op.count(op)) present.push_back(op);
    if (present.empty()) continue;
    md << "- " << why << ": ";
    for (std::size_t i = 0; i < present.size(); ++i) md << (i ? ", " : "") << present[i];
    md << "\n";
  }
  md << "- string, bfloat16-as-uint16 and uint16/32/64 test tensors: element types kernelgraph does not have\n"
     << "  (the Cast, CastLike, Max, Min, Mod and Pow tests on those types)\n"
     << "- 3-D convolution and pooling, MaxPool's indices output, Dropout's mask output and training mode\n"
     << "  (BatchNormalization, Dropout): not implemented yet; listed per op above\n";
  std::cout << "onnx-conformance: " << total.tests << " tests in " << static_cast<int>(seconds) << " s: " << total.pass
            << " passed, " << total.fail << " failed, " << total.unsupported << " unsupported\n";
  for (const auto& [suite, row] : by_suite)
    std::cout << "  " << suite << ": " << row.pass << " / " << row.tests << " passed\n";
  if (!markdown.empty()) {
    std::ofstream f(markdown, std::ios::trunc);
    f << md.str();
    if (!f) {
      std::cerr << "onnx-conformance: cannot write " << markdown << "\n";
      return 1;
    }
  }
  if (!results_path.empty()) {
    std::ofstream f(results_path, std::ios::trunc);
    for (const auto& r : results) f << r.status << " " << r.suite << "/" << r.test << " " << r.op << " " << r.reason << "\n";
  }
  if (!write_baseline.empty()) {
    // Every passing test, and the supported ops that pass at least 95% of their tests.
    std::ofstream f(write_baseline, std::ios::trunc);
    f << "# The ONNX conformance baseline, written by scripts/onnx-conformance: a test listed as pass must\n"
         "# keep passing, and a claimed op must pass at least 95% of its node tests.\n";
    const auto supported = kg::onnx::supported_ops();
    for (const auto& [op, row] : by_op)
      if (std::find(supported.begin(), supported.end(), op) != supported.end() && row.tests > 0 &&
          row.pass * 100 >= row.tests * 95)
        f << "claim " << op << "\n";
    for (const auto& r : results)
      if (r.status == "pass") f << "pass " << r.suite << "/" << r.test << "\n";
    if (!f) {
      std::cerr << "onnx-conformance: cannot write " << write_baseline << "\n";
      return 1;
    }
  }
  if (!baseline_path.empty()) {
    const Baseline b = read_baseline(baseline_path);
    int bad = 0;
    std::map<std::string, const Result*> by_name;
    for (const auto& r : results) by_name[r.suite + "/" + r.test] = &r;
    for (const auto& name : b.passing) {
      auto it = by_name.find(name);
      if (it == by_name.end()) {
        if (filter.empty()) std::cout << "REGRESSION " << name << ": not found in the test data\n", ++bad;
        continue;
      }
      if (it->second->status != "pass")
        std::cout << "REGRESSION " << name << " (" << it->second->op << "): " << it->second->status << ": "
                  << it->second->reason << "\n",
            ++bad;
    }
    for (const auto& op : b.claimed) {
      auto it = by_op.find(op);
      if (it == by_op.end()) continue;
      const Row& row = it->second;
      if (row.pass * 100 < row.tests * 95)
        std::cout << "CLAIMED OP BELOW 95% " << op << ": " << row.pass << " / " << row.tests << "\n", ++bad;
    }
    if (bad) {
      std::cout << "onnx-conformance: " << bad << " check(s) against " << baseline_path << " failed\n";
      return 1;
    }
    std::cout << "onnx-conformance: every baseline pass still passes and every claimed op is at or above 95%\n";
  }
  return 0;
}
