// Human-readable views of a graph: a text table and Graphviz DOT. Model::summary() and
// Model::to_dot() are these over the model's optimised graph and live nodes.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kg/graph.hpp"

namespace kg::dump {

// What to show: a graph, the node ids to list (topological order) and the named outputs.
struct GraphView {
  const Graph* graph = nullptr;
  std::vector<int> nodes;
  std::vector<std::pair<std::string, int>> outputs;
  // First line of the summary (and a comment in the DOT text); may be empty.
  std::string title;
};

// The node table, the outputs and the totals.
std::string summary(const GraphView& view);
// A Graphviz digraph: one node per listed graph node, edges labelled with shapes, one marker
// per model output.
std::string to_dot(const GraphView& view);

// `text` as the inside of a DOT double-quoted string: quotes and backslashes escaped, line
// breaks as "\n".
std::string escape_dot(std::string_view text);
// 61706 → "61,706".
std::string group_digits(long long value);
// The bytes of a node's parameters (all of them, buffers included).
std::size_t param_bytes(const Node& node);

}  // namespace kg::dump
