// kgraph run --profile: per-node times of the last forward with the work and traffic of each node.
#include "profile.hpp"

#include <algorithm>
#include <cstdio>
#include <string>

#include "graph/dump.hpp"
#include "kg/error.hpp"
#include "plan/shape_binding.hpp"
#include "util/str.hpp"

namespace kgraph {
namespace {

double numel(const std::vector<std::int64_t>& shape) {
  double n = 1;
  for (std::int64_t d : shape) n *= static_cast<double>(d);
  return n;
}

// The first parameter of rank 4: a convolution's weight, also in a fused node (which lists the
// convolution's parameters first).
const kg::ParamSpec* conv_weight(const kg::Node& node) {
  for (const auto& p : node.params)
    if (p.shape.size() == 4) return &p;
  return nullptr;
}

std::string text(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// GFLOP/s or GB/s from a count and a time in ms ("-" for a time too short to divide by).
std::string rate(double count, double ms) {
  return ms > 0 ? text("%.2f", count / 1e9 / (ms / 1e3)) : std::string("-");
}

}  // namespace

std::optional<double> matrix_flops(const kg::Node& node, const std::vector<std::vector<std::int64_t>>& inputs,
                                   const std::vector<std::int64_t>& output) {
  if (node.kind != kg::Node::Kind::Op || inputs.empty() || inputs[0].empty() || output.empty())
    return std::nullopt;
  const std::string op = node.op_name();
  if (op == "nn.conv2d" || op == "nn.fused_conv2d" || op == "nn.conv2d_nhwc" || op == "nn.conv_transpose2d") {
    // conv: weight [O, C/groups, KH, KW] in every activation layout, 2·N·O·OH·OW · (C/groups)·KH·KW.
    // transposed: weight [C, O/groups, KH, KW]; every input element meets (O/groups)·KH·KW weights.
    const kg::ParamSpec* w = conv_weight(node);
    if (!w) return std::nullopt;
    const double per_point = static_cast<double>(w->shape[1] * w->shape[2] * w->shape[3]);
    return 2 * numel(op == "nn.conv_transpose2d" ? inputs[0] : output) * per_point;
  }
  if (op == "nn.linear" || op == "nn.matmul" || op == "kg.fused_gemm") {
    // [..., M, K] x [K, N] -> [..., M, N]: 2·M·N·K per batch entry; K is the first operand's last dim
    // (a fused GEMM's first input is its GEMM's; the epilogue's arithmetic is not counted).
    return 2 * numel(output) * static_cast<double>(inputs[0].back());
  }
  return std::nullopt;
}

void print_profile(std::ostream& out, const kg::Model& model, const kg::LoadedModel& loaded, double run_ms) {
  const std::vector<kg::NodeTime> times = loaded.profile();
  const kg::Graph& graph = model.graph();
  std::vector<int> live = model.live_nodes();
  std::sort(live.begin(), live.end());
  const kg::plan::BoundShapes bound = kg::plan::bind_shapes(graph, live, loaded.input_shapes());
  const auto shape_of = [&](int id) -> const std::vector<std::int64_t>& {
    return bound.node_shapes.at(static_cast<std::size_t>(id));
  };

  bool tactics = false;
  double total_ms = 0;
  for (const auto& t : times) {
    total_ms += t.ms;
    tactics = tactics || !t.kernel.empty();
  }

  std::vector<std::vector<std::string>> rows;
  rows.push_back({"node", "op", "ms", "%", "GFLOP", "GFLOP/s", "bytes (min)", "GB/s"});
  if (tactics) rows[0].push_back("tactic");
  double flops_total = 0, flops_ms = 0, bytes_total = 0;
  std::vector<std::string> added;  // nodes the load added (layout changes): not in the model's graph
  for (const auto& t : times) {
    std::vector<std::string> row{t.node, t.op, text("%.3f", t.ms),
                                 text("%.1f", total_ms > 0 ? 100.0 * t.ms / total_ms : 0.0)};
    const int id = graph.find(t.node);
    if (id < 0) added.push_back(t.node);
    std::optional<double> flops;
    std::optional<double> bytes;
    if (id >= 0 && graph.node(id).kind == kg::Node::Kind::Op && !shape_of(id).empty()) {
      const kg::Node& n = graph.node(id);
      std::vector<std::vector<std::int64_t>> ins;
      double b = numel(shape_of(id)) * static_cast<double>(kg::dtype_size(n.dtype)) +
                 static_cast<double>(kg::dump::param_bytes(n));
      for (int in : n.inputs) {
        ins.push_back(shape_of(in));
        b += numel(ins.back()) * static_cast<double>(kg::dtype_size(graph.node(in).dtype));
      }
      flops = matrix_flops(n, ins, shape_of(id));
      if (!n.op->op().is_view()) bytes = b;  // a view moves nothing
    }
    if (flops) {
      flops_total += *flops;
      flops_ms += t.ms;
      row.push_back(text("%.4g", *flops / 1e9));
      row.push_back(rate(*flops, t.ms));
    } else {
      row.insert(row.end(), {"-", "-"});
    }
    if (bytes) {
      bytes_total += *bytes;
      row.push_back(kg::util::format_bytes(static_cast<std::size_t>(*bytes)));
      row.push_back(rate(*bytes, t.ms));
    } else {
      row.insert(row.end(), {"-", "-"});
    }
    if (tactics) row.push_back(t.kernel.empty() ? "-" : t.kernel);
    rows.push_back(std::move(row));
  }

  std::vector<std::size_t> width(rows[0].size(), 0);
  for (const auto& r : rows)
    for (std::size_t c = 0; c < r.size(); ++c) width[c] = std::max(width[c], r[c].size());
  out << "profile of the last run: " << times.size() << " nodes, each timed on its own"
      << (loaded.device().kind == kg::Device::Kind::Cuda ? " (synchronised after each, no CUDA graph)" : "")
      << "\n";
  for (const auto& r : rows) {
    std::string line = " ";
    for (std::size_t c = 0; c < r.size(); ++c) {
      const bool left = c < 2 || (tactics && c + 1 == r.size());
      const std::string pad(width[c] - r[c].size(), ' ');
      line += "  " + (left ? r[c] + (c + 1 < r.size() ? pad : "") : pad + r[c]);
    }
    out << line << "\n";
  }
  out << "total: " << text("%.3f", total_ms) << " ms in the nodes (the run: " << text("%.3f", run_ms)
      << " ms); " << text("%.6g", flops_total / 1e9) << " GFLOP, " << rate(flops_total, total_ms)
      << " GFLOP/s over the nodes' time";
  if (flops_total > 0)
    out << ", " << rate(flops_total, flops_ms) << " GFLOP/s in the convolutions and matrix products ("
        << text("%.3f", flops_ms) << " ms)";
  out << "; at least " << kg::util::format_bytes(static_cast<std::size_t>(bytes_total)) << " moved, "
      << rate(bytes_total, total_ms) << " GB/s\n";
  if (!added.empty())
    out << "not counted in the bytes (added at load for a layout change, so not in the model's graph): "
        << kg::util::join(added, ", ") << "\n";
}

}  // namespace kgraph
