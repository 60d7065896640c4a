// Model::summary() and Model::to_dot(): the text table and the Graphviz view of a graph.
#include "graph/dump.hpp"

#include <algorithm>
#include <sstream>

#include "kg/error.hpp"
#include "kg/model.hpp"
#include "util/str.hpp"

namespace kg::dump {

std::string escape_dot(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 8);
  for (char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string group_digits(long long value) {
  const auto magnitude =
      value < 0 ? 0ULL - static_cast<unsigned long long>(value) : static_cast<unsigned long long>(value);
  const std::string digits = std::to_string(magnitude);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return value < 0 ? "-" + out : out;
}

std::size_t param_bytes(const Node& node) {
  std::size_t bytes = 0;
  for (const auto& p : node.params)
    bytes += static_cast<std::size_t>(numel_of(p.shape)) * dtype_size(p.dtype);
  return bytes;
}

namespace {

void check_view(const GraphView& view) {
  if (view.graph == nullptr) throw Error("dump: no graph to show");
  const auto count = static_cast<int>(view.graph->nodes().size());
  for (int id : view.nodes)
    if (id < 0 || id >= count)
      throw Error(util::cat("dump: node ", id, " is not in the graph (", count, " nodes)"));
  for (const auto& [name, id] : view.outputs)
    if (id < 0 || id >= count)
      throw Error(util::cat("dump: output '", name, "' refers to node ", id, ", not in the graph (", count,
                            " nodes)"));
}

// A parameter's name relative to its node ("weight" for "features.0.weight"); a fused node's
// parameters that came from another node keep their full name.
std::string short_param_name(const Node& node, const std::string& full) {
  const std::string prefix = node.name + ".";
  return full.rfind(prefix, 0) == 0 ? full.substr(prefix.size()) : full;
}

// Words of `text` on lines of at most `width` characters (a longer word gets a line of its own).
std::string wrap_words(const std::string& text, std::size_t width) {
  std::istringstream is(text);
  std::string word, out, line;
  while (is >> word) {
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      out += (out.empty() ? "" : "\n") + line;
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
  }
  if (!line.empty()) out += (out.empty() ? "" : "\n") + line;
  return out;
}

std::string pad(const std::string& s, std::size_t width, bool right_align = false) {
  if (s.size() >= width) return s;
  const std::string fill(width - s.size(), ' ');
  return right_align ? fill + s : s + fill;
}

}  // namespace

std::string summary(const GraphView& view) {
  check_view(view);
  const Graph& g = *view.graph;

  const std::vector<std::string> header{"id", "op", "name", "dtype", "shape", "params", "attributes"};
  std::vector<std::vector<std::string>> rows;
  long long param_count = 0, trainable_count = 0;
  std::size_t total_bytes = 0, tensors = 0;
  for (int id : view.nodes) {
    const Node& n = g.node(id);
    const std::size_t bytes = param_bytes(n);
    for (const auto& p : n.params) {
      const long long numel = numel_of(p.shape);
      param_count += numel;
      if (p.trainable) trainable_count += numel;
      ++tensors;
    }
    total_bytes += bytes;
    std::string attrs = n.kind == Node::Kind::Op ? n.op->op().attributes() : std::string();
    std::replace(attrs.begin(), attrs.end(), '\n', ' ');
    rows.push_back({std::to_string(n.id), n.op_name(), n.name, std::string(dtype_name(n.dtype)),
                    n.shape.to_string(), bytes > 0 ? util::format_bytes(bytes) : "-", attrs});
  }

  std::vector<std::size_t> width(header.size());
  for (std::size_t c = 0; c < header.size(); ++c) {
    width[c] = header[c].size();
    for (const auto& r : rows) width[c] = std::max(width[c], r[c].size());
  }
  auto line = [&](const std::vector<std::string>& cells) {
    std::string s;
    for (std::size_t c = 0; c < cells.size(); ++c) {
      const bool last = c + 1 == cells.size();
      const bool numeric = c == 0 || c == 5;
      s += last ? cells[c] : pad(cells[c], width[c], numeric);
      if (!last) s += "  ";
    }
    while (!s.empty() && s.back() == ' ') s.pop_back();
    return s + "\n";
  };

  std::ostringstream os;
  if (!view.title.empty()) os << view.title << "\n";
  os << line(header);
  for (const auto& r : rows) os << line(r);
  if (!view.outputs.empty()) {
    os << "outputs:";
    for (std::size_t i = 0; i < view.outputs.size(); ++i) {
      const Node& n = g.node(view.outputs[i].second);
      os << (i ? ", " : " ") << view.outputs[i].first << " = " << n.name << " " << n.shape.to_string() << " "
         << dtype_name(n.dtype);
    }
    os << "\n";
  }
  os << "total: " << view.nodes.size() << " nodes, " << group_digits(param_count) << " parameters ("
     << group_digits(trainable_count) << " trainable) in " << tensors << " tensors, "
     << util::format_bytes(total_bytes) << "\n";
  return os.str();
}

std::string to_dot(const GraphView& view) {
  check_view(view);
  const Graph& g = *view.graph;
  std::vector<char> listed(g.nodes().size(), 0);
  for (int id : view.nodes) listed[static_cast<std::size_t>(id)] = 1;
  std::vector<char> is_output(g.nodes().size(), 0);
  for (const auto& o : view.outputs) is_output[static_cast<std::size_t>(o.second)] = 1;

  std::ostringstream os;
  os << "digraph \"model\" {\n";
  if (!view.title.empty()) os << "  label=\"" << escape_dot(view.title) << "\";\n  labelloc=t;\n";
  os << "  rankdir=TB;\n  fontname=\"Helvetica\";\n"
     << "  node [shape=box, style=\"rounded,filled\", fillcolor=\"#ffffff\", fontname=\"Helvetica\", "
        "fontsize=10];\n"
     << "  edge [fontname=\"Helvetica\", fontsize=9, color=\"#555555\"];\n";

  for (int id : view.nodes) {
    const Node& n = g.node(id);
    std::string label = n.name + "\n" + n.op_name();
    if (n.kind == Node::Kind::Op) {
      const std::string attrs = n.op->op().attributes();
      if (!attrs.empty()) label += "\n" + wrap_words(attrs, 56);
    }
    label += "\n" + n.shape.to_string() + " " + std::string(dtype_name(n.dtype));
    for (const auto& p : n.params)
      label += "\n" + short_param_name(n, p.name) + " " + sizes_to_string(p.shape);
    os << "  n" << id << " [label=\"" << escape_dot(label) << "\"";
    if (n.kind == Node::Kind::Input)
      os << ", shape=ellipse, fillcolor=\"#dbe9ff\"";
    else if (n.op->op().is_view())
      os << ", style=\"rounded,dashed,filled\"";
    if (is_output[static_cast<std::size_t>(id)]) os << ", penwidth=2";
    os << "];\n";
    // A fused node (its attributes list the nodes it stands for, "nodes=a,b,c", a reduction's
    // folded prologue, "prologue=a,b,c", or a GEMM's folded epilogue, "epilogue=a,b,c") is drawn inside a cluster with one small box per member,
    // in order.
    if (n.kind == Node::Kind::Op) {
      const std::string attrs = n.op->op().attributes();
      std::string key = "nodes=";
      auto at = attrs.find(key);
      if (at == std::string::npos) at = attrs.find(key = "prologue=");
      // (A fused convolution's "epilogue=[...]" names op kinds, not nodes.)
      if (at == std::string::npos && (at = attrs.find(key = "epilogue=")) != std::string::npos &&
          attrs.compare(at + key.size(), 1, "[") == 0)
        at = std::string::npos;
      if (at != std::string::npos) {
        const auto end = attrs.find(' ', at);
        const auto from = at + key.size();
        const std::string list = attrs.substr(from, end == std::string::npos ? std::string::npos : end - from);
        std::vector<std::string> members;
        for (std::size_t b = 0; b <= list.size();) {
          const auto c = std::min(list.find(',', b), list.size());
          members.push_back(list.substr(b, c - b));
          b = c + 1;
        }
        os << "  subgraph cluster_n" << id << " {\n    label=\"" << escape_dot("fused: " + n.name)
           << "\";\n    style=\"rounded,dashed\";\n    color=\"#c06000\";\n    n" << id << ";\n";
        for (std::size_t k = 0; k < members.size(); ++k)
          os << "    n" << id << "_m" << k << " [label=\"" << escape_dot(members[k])
             << "\", shape=box, style=\"rounded\", fontsize=8, color=\"#c06000\"];\n";
        for (std::size_t k = 0; k < members.size(); ++k) {
          const std::string next = k + 1 < members.size() ? util::cat("n", id, "_m", k + 1) : util::cat("n", id);
          os << "    n" << id << "_m" << k << " -> " << next << " [style=dotted, arrowhead=none];\n";
        }
        os << "  }\n";
      }
    }
  }
  for (int id : view.nodes) {
    const Node& n = g.node(id);
    for (int in : n.inputs) {
      if (!listed[static_cast<std::size_t>(in)]) continue;
      os << "  n" << in << " -> n" << id << " [label=\"" << escape_dot(g.node(in).shape.to_string())
         << "\"];\n";
    }
  }
  for (std::size_t i = 0; i < view.outputs.size(); ++i) {
    const auto& [name, id] = view.outputs[i];
    if (!listed[static_cast<std::size_t>(id)]) continue;
    os << "  out" << i << " [label=\"" << escape_dot(name)
       << "\", shape=doubleoctagon, fillcolor=\"#ffe2c4\"];\n"
       << "  n" << id << " -> out" << i << " [label=\"" << escape_dot(g.node(id).shape.to_string())
       << "\", style=bold];\n";
  }
  os << "}\n";
  return os.str();
}

}  // namespace kg::dump

namespace kg {

namespace {

dump::GraphView model_view(const Graph& g, const Graph& recorded, LoweringMode mode, bool fused,
                           const std::vector<int>& live,
                           const std::vector<std::pair<std::string, int>>& outputs) {
  dump::GraphView v;
  v.graph = &g;
  v.nodes = live;
  v.outputs = outputs;
  const char* what = mode == LoweringMode::Inference ? "inference graph" : "training graph";
  const char* how = !fused ? "as recorded (no fusion)"
                    : mode == LoweringMode::Inference ? "after fusion"
                                                      : "after elementwise fusion";
  v.title = util::cat(what, " ", how, ": ", live.size(), " live nodes (", recorded.nodes().size(), " recorded)");
  return v;
}

}  // namespace

std::string Model::summary() const {
  return dump::summary(model_view(*graph_, *recorded_, mode_, fused_, live_, outputs_));
}

std::string Model::to_dot() const {
  return dump::to_dot(model_view(*graph_, *recorded_, mode_, fused_, live_, outputs_));
}

}  // namespace kg
