#include "passes/dead_nodes.hpp"

namespace kg::passes {

std::vector<int> live_nodes(const Graph& graph, const std::vector<int>& outputs) {
  std::vector<char> live(graph.nodes().size(), 0);
  for (int o : outputs) live.at(static_cast<std::size_t>(o)) = 1;
  for (int i : graph.inputs()) live[static_cast<std::size_t>(i)] = 1;
  for (int id = static_cast<int>(graph.nodes().size()) - 1; id >= 0; --id) {
    if (!live[static_cast<std::size_t>(id)]) continue;
    for (int in : graph.node(id).inputs) live[static_cast<std::size_t>(in)] = 1;
  }
  std::vector<int> ids;
  for (std::size_t i = 0; i < live.size(); ++i)
    if (live[i]) ids.push_back(static_cast<int>(i));
  return ids;
}

}  // namespace kg::passes
