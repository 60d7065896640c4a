#include "lower/lowering.hpp"

#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::lower {

LoweredGraph lower_model(const Model& model) {
  LoweredGraph out;
  out.mode = model.mode();
  const Graph& g = model.graph();
  for (int id : model.live_nodes()) {
    const Node& n = g.node(id);
    if (n.kind == Node::Kind::Input) continue;
    const CustomOp& op = n.op->op();
    Executable e;
    e.node = id;
    if (op.is_view()) {
      e.view = true;
      e.name = op.name();
      out.executables.push_back(std::move(e));
      continue;
    }
    std::optional<Lowered> l = op.lower();
    if (!l)
      throw Error(util::cat("custom op '", op.name(), "' is not handled — implement CustomOp::lower() (node '",
                            n.name, "')"));
    if (!l->runtime_op) throw Error(n.label() + " lower() returned no RuntimeOp");
    if (l->source.empty()) throw Error(n.label() + " lower() returned an empty kernel source");
    e.name = l->name.empty() ? op.name() : l->name;
    e.source = std::move(l->source);
    e.entry_point = std::move(l->entry_point);
    e.runtime_op = std::move(l->runtime_op);
    if (out.mode == LoweringMode::Training) e.backward_source = op.lower_backward_source();
    out.executables.push_back(std::move(e));
  }
  return out;
}

}  // namespace kg::lower
