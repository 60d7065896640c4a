// Load-time shape binding: every dynamic dim gets its size from the concrete inputs, and each
// op's shape inference is re-run with concrete sizes and checked against what it declared.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kg/graph.hpp"

namespace kg::plan {

struct BoundShapes {
  std::vector<std::vector<std::int64_t>> node_shapes;  // by node id; empty for dead nodes
  std::map<std::string, std::int64_t> symbols;          // named dims and their sizes
};

// `live` ascending; `input_shapes` one per graph input. Throws kg::Error naming the input or
// the op, the node and the sizes on any disagreement.
BoundShapes bind_shapes(const Graph& graph, const std::vector<int>& live,
                        const std::vector<std::vector<std::int64_t>>& input_shapes);

}  // namespace kg::plan
