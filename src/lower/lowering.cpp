#include "lower/lowering.hpp"

#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::lower {

std::string not_handled(const Node& n) {
  return util::cat(n.label(), " custom op '", n.op->name(), "' is not handled — implement CustomOp::lower()");
}

LowerContext lower_context(const Model& model, int id, const LowerTarget& target) {
  return lower_context(model.graph(), model.mode(), id, target);
}

LowerContext lower_context(const Graph& g, LoweringMode mode, int id, const LowerTarget& target) {
  const Node& n = g.node(id);
  LowerContext c;
  c.node = n.name;
  c.mode = mode;
  c.sm = target.sm;
  c.output_dtype = n.dtype;
  c.output_shape = n.shape;
  auto concrete = [&](int node) -> std::vector<std::int64_t> {
    if (static_cast<std::size_t>(node) < target.concrete.size())
      return target.concrete[static_cast<std::size_t>(node)];
    return {};
  };
  bool all_known = static_cast<std::size_t>(id) < target.concrete.size();
  for (int in : n.inputs) {
    const Node& src = g.node(in);
    c.input_dtypes.push_back(src.dtype);
    c.input_shapes.push_back(src.shape);
    all_known = all_known && static_cast<std::size_t>(in) < target.concrete.size();
  }
  if (all_known) {
    for (int in : n.inputs) c.concrete_input_shapes.push_back(concrete(in));
    c.concrete_output_shape = concrete(id);
  }
  return c;
}

LoweredGraph lower_model(const Model& model, const LowerTarget& target) {
  return lower_graph(model.graph(), model.live_nodes(), model.mode(), target);
}

LoweredGraph lower_graph(const Graph& g, const std::vector<int>& live, LoweringMode mode, const LowerTarget& target) {
  LoweredGraph out;
  out.mode = mode;
  for (int id : live) {
    const Node& n = g.node(id);
    if (n.kind == Node::Kind::Input) continue;
    const CustomOp& op = n.op->op();
    Executable e;
    e.node = id;
    e.name = op.name();
    if (op.is_view()) {
      e.view = true;
      out.executables.push_back(std::move(e));
      continue;
    }
    e.context = lower_context(g, mode, id, target);
    std::optional<Lowered> l;
    try {
      l = op.lower(e.context);
      if (l && out.mode == LoweringMode::Training) e.backward_source = op.lower_backward_source(e.context);
    } catch (const Error& err) {
      const std::string what = err.what();
      throw Error(what.rfind(n.label(), 0) == 0 ? what : n.label() + " lower: " + what);
    } catch (const std::exception& err) {
      throw Error(n.label() + " lower() failed: " + err.what());
    }
    if (!l) {
      if (target.require_all) throw Error(not_handled(n));
      e.lowered = false;
      out.executables.push_back(std::move(e));
      continue;
    }
    if (!l->runtime_op) throw Error(n.label() + " lower() returned no RuntimeOp");
    if (l->source.empty()) throw Error(n.label() + " lower() returned an empty kernel source");
    if (!l->name.empty()) e.name = l->name;
    e.source = std::move(l->source);
    e.entry_point = std::move(l->entry_point);
    e.runtime_op = std::move(l->runtime_op);
    out.executables.push_back(std::move(e));
  }
  return out;
}

}  // namespace kg::lower
