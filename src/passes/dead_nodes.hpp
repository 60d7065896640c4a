// Dead-node elimination: the nodes the outputs depend on.
#pragma once

#include <vector>

#include "kg/graph.hpp"

namespace kg::passes {

// Ids of the nodes reachable backwards from `outputs`, plus every graph input, ascending
// (a topological order, since nodes only refer to earlier ones).
std::vector<int> live_nodes(const Graph& graph, const std::vector<int>& outputs);

}  // namespace kg::passes
