// The source tree keeps its layers (README, "Layout"): a file under src/ or tools/ includes files
// of its own module or of modules below it, never above; the peers cpu and cuda do not include
// each other; and no chain of includes comes back to the file it started from. The checker reads
// `#include "..."` lines as text; a made-up tree shows that it reports both kinds of fault.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

// Layers, lowest first; a module may include its own layer's files and those of lower layers.
// `backend` is the executor interface the peers implement; `models` and `data` use the public
// API only. Public headers (include/kg/) are the API and may be included anywhere.
const std::map<std::string, int>& layer_of_module() {
  static const std::map<std::string, int> layers = {
      {"util", 0},          {"compile", 1},     {"data", 1},         {"graph", 2},
      {"ops", 3},           {"passes", 4},      {"plan", 5},         {"lower", 6},
      {"backend/comm", 7},  {"backend/emu", 7}, {"backend", 8},      {"backend/cpu", 9},
      {"backend/cuda", 9},  {"runtime", 10},    {"models", 11},      {"testing", 11},
      {"io", 11},           {"tools", 12},
  };
  return layers;
}

struct Include {
  std::string from;  // the including file, relative to the tree's root (src/ops/conv.cpp)
  int line;
  std::string path;  // as written
};

// The module of a path relative to src/ (ops/conv.cpp -> ops, backend/cuda/x.cpp -> backend/cuda).
std::string module_of(const std::string& rel) {
  const auto slash = rel.find('/');
  if (slash == std::string::npos) return "";
  std::string top = rel.substr(0, slash);
  if (top == "backend") {
    const auto second = rel.find('/', slash + 1);
    if (second != std::string::npos) {
      std::string sub = "backend/" + rel.substr(slash + 1, second - slash - 1);
      if (layer_of_module().count(sub)) return sub;
    }
  }
  return top;
}

// Every quoted include of every C++ or CUDA file under root/src and root/tools.
std::vector<Include> read_includes(const fs::path& root) {
  static const std::regex include_line(R"(^\s*#\s*include\s+"([^"]+)\")");
  std::vector<Include> out;
  for (const char* top : {"src", "tools"}) {
    if (!fs::exists(root / top)) continue;
    for (const auto& e : fs::recursive_directory_iterator(root / top)) {
      if (!e.is_regular_file()) continue;
      const std::string ext = e.path().extension().string();
      if (ext != ".cpp" && ext != ".hpp" && ext != ".cu" && ext != ".cuh" && ext != ".h") continue;
      std::ifstream in(e.path());
      std::string text;
      int n = 0;
      while (std::getline(in, text)) {
        ++n;
        std::smatch m;
        if (std::regex_search(text, m, include_line))
          out.push_back({fs::relative(e.path(), root).generic_string(), n, m[1].str()});
      }
    }
  }
  return out;
}

// The module a file belongs to: tools/... is `tools`, src/<module>/... its module.
std::string module_of_file(const std::string& from) {
  if (from.rfind("tools/", 0) == 0) return "tools";
  return module_of(from.substr(4));  // past "src/"
}

// "from includes path: a (layer i) may not include b (layer j)" for each include that points up or
// across to another module of its layer (the peers cpu and cuda); a module the table does not know
// is a fault too, so that a new module gets its place. Headers from outside the tree (a quoted
// "onnx/onnx_pb.h") are not the tree's business.
std::vector<std::string> layer_faults(const fs::path& root, const std::vector<Include>& includes) {
  const auto& layers = layer_of_module();
  std::vector<std::string> faults;
  for (const Include& inc : includes) {
    const std::string from = module_of_file(inc.from);
    if (inc.path.find('/') == std::string::npos) continue;  // a file beside it
    if (!fs::exists(root / "src" / inc.path)) continue;    // the public API, or from outside
    const std::string to = module_of(inc.path);
    if (to == from) continue;
    const std::string where = inc.from + ":" + std::to_string(inc.line) + " includes \"" + inc.path + "\": ";
    if (!layers.count(from) || !layers.count(to)) {
      faults.push_back(where + "module '" + (layers.count(from) ? to : from) + "' has no layer in the table");
      continue;
    }
    const int a = layers.at(from), b = layers.at(to);
    if (b >= a)  // up, or across to another module of the same layer
      faults.push_back(where + from + " (layer " + std::to_string(a) + ") may not include " + to + " (layer " +
                       std::to_string(b) + ")");
  }
  return faults;
}

// A cycle of includes among the tree's own files, as "a -> b -> a", or "" when there is none.
// An include resolves beside the including file first, then under src/.
std::string include_cycle(const fs::path& root, const std::vector<Include>& includes) {
  std::map<std::string, std::vector<std::string>> edges;
  for (const Include& inc : includes) {
    const fs::path beside = fs::path(inc.from).parent_path() / inc.path;
    const fs::path under_src = fs::path("src") / inc.path;
    std::string target;
    if (fs::exists(root / beside))
      target = beside.lexically_normal().generic_string();
    else if (fs::exists(root / under_src))
      target = under_src.lexically_normal().generic_string();
    if (!target.empty()) edges[inc.from].push_back(target);
  }
  std::map<std::string, int> state;  // 1 on the current path, 2 finished
  std::vector<std::string> path;
  std::string found;
  std::function<void(const std::string&)> visit = [&](const std::string& f) {
    state[f] = 1;
    path.push_back(f);
    for (const std::string& g : edges[f]) {
      if (!found.empty()) break;
      if (state[g] == 1) {
        auto it = std::find(path.begin(), path.end(), g);
        for (; it != path.end(); ++it) found += *it + " -> ";
        found += g;
      } else if (state[g] == 0) {
        visit(g);
      }
    }
    path.pop_back();
    state[f] = 2;
  };
  for (const auto& [f, _] : edges)
    if (found.empty() && state[f] == 0) visit(f);
  return found;
}

std::string joined(const std::vector<std::string>& lines) {
  std::ostringstream s;
  for (const auto& l : lines) s << l << "\n";
  return s.str();
}

void write(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

}  // namespace

TEST(SourceLayers, IncludesPointOnlyDownAndNeverInACircle) {
  const fs::path root = KG_SOURCE_DIR;
  const std::vector<Include> includes = read_includes(root);
  ASSERT_GT(includes.size(), 500u) << "the tree was not found under " << root;
  const std::vector<std::string> faults = layer_faults(root, includes);
  EXPECT_TRUE(faults.empty()) << faults.size() << " includes break the layers:\n" << joined(faults);
  const std::string cycle = include_cycle(root, includes);
  EXPECT_EQ(cycle, "") << "an include circle";
}

TEST(SourceLayers, TheCheckerReportsAnUpwardIncludeAPeerAndACircle) {
  const fs::path root = fs::temp_directory_path() / ("kg_layers_" + std::to_string(::getpid()));
  fs::remove_all(root);
  write(root / "src/util/a.hpp", "#pragma once\n#include \"ops/b.hpp\"\n");                   // up
  write(root / "src/ops/b.hpp", "#pragma once\n#include \"util/a.hpp\"\n#include \"c.cuh\"\n");  // a circle
  write(root / "src/ops/c.cuh", "#include \"kg/graph.hpp\"\n");
  write(root / "src/backend/cpu/x.cpp", "#include \"backend/cuda/y.hpp\"\n#include \"backend/executor.hpp\"\n");
  write(root / "src/backend/cuda/y.hpp", "#include \"backend/emu/z.hpp\"\n");
  write(root / "src/widgets/w.cpp", "#include \"util/a.hpp\"\n#include \"onnx/onnx_pb.h\"\n");
  const std::vector<Include> includes = read_includes(root);
  const std::vector<std::string> faults = layer_faults(root, includes);
  const std::string all = joined(faults);
  EXPECT_EQ(faults.size(), 3u) << all;
  EXPECT_NE(all.find("src/util/a.hpp:2 includes \"ops/b.hpp\": util (layer 0) may not include ops (layer 3)"),
            std::string::npos)
      << all;
  EXPECT_NE(all.find("backend/cpu (layer 9) may not include backend/cuda (layer 9)"), std::string::npos) << all;
  EXPECT_NE(all.find("module 'widgets' has no layer in the table"), std::string::npos) << all;
  EXPECT_EQ(include_cycle(root, includes), "src/ops/b.hpp -> src/util/a.hpp -> src/ops/b.hpp");
  fs::remove_all(root);
}
