#include "plan/shape_binding.hpp"

#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::plan {
namespace {

// Matches a symbolic shape against concrete sizes, binding named symbols. Returns an empty
// string on success, else a description of the first disagreement.
std::string match(const Shape& sym, const std::vector<std::int64_t>& sizes,
                  std::map<std::string, std::int64_t>& symbols) {
  if (sym.rank() != sizes.size())
    return util::cat("rank ", sizes.size(), " where ", sym.rank(), " was declared");
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const Dim& d = sym[i];
    if (d.is_static()) {
      if (d.size() != sizes[i]) return util::cat("dim ", i, " is ", sizes[i], ", declared ", d.size());
    } else if (!d.symbol().empty()) {
      auto [it, fresh] = symbols.emplace(d.symbol(), sizes[i]);
      if (!fresh && it->second != sizes[i])
        return util::cat("dim ", i, " ('", d.symbol(), "') is ", sizes[i], " but '", d.symbol(),
                         "' is already bound to ", it->second);
    }
  }
  return {};
}

}  // namespace

BoundShapes bind_shapes(const Graph& graph, const std::vector<int>& live,
                        const std::vector<std::vector<std::int64_t>>& input_shapes) {
  BoundShapes out;
  out.node_shapes.resize(graph.nodes().size());
  const auto& ins = graph.inputs();
  if (input_shapes.size() != ins.size())
    throw Error(util::cat("load: the graph has ", ins.size(), " input(s) but ", input_shapes.size(),
                          " shape(s) were given"));
  for (std::size_t k = 0; k < ins.size(); ++k) {
    const Node& n = graph.node(ins[k]);
    for (auto s : input_shapes[k])
      if (s < 0)
        throw Error(util::cat("load: input '", n.name, "' has a negative size in ",
                              sizes_to_string(input_shapes[k])));
    std::string why = match(n.shape, input_shapes[k], out.symbols);
    if (!why.empty())
      throw Error(util::cat("load: input '", n.name, "' declared ", n.shape.to_string(), " got ",
                            sizes_to_string(input_shapes[k]), ": ", why));
    out.node_shapes[static_cast<std::size_t>(n.id)] = input_shapes[k];
  }
  for (int id : live) {
    const Node& n = graph.node(id);
    if (n.kind == Node::Kind::Input) continue;
    std::vector<Shape> in_shapes;
    std::vector<std::string> in_text;
    for (int in : n.inputs) {
      in_shapes.push_back(Shape::of(out.node_shapes[static_cast<std::size_t>(in)]));
      in_text.push_back(in_shapes.back().to_string());
    }
    const std::string inputs_str = util::join(in_text, ", ");
    Shape got;
    try {
      got = n.op->op().infer_output_shape(in_shapes);
    } catch (const Error& e) {
      throw Error(util::cat(n.label(), " at load, with inputs ", inputs_str, ": ", e.what()));
    }
    if (!got.is_concrete())
      throw Error(util::cat(n.label(), " infer_output_shape returned ", got.to_string(),
                            " for concrete inputs ", inputs_str,
                            "; with every input dim known, every output dim must be known"));
    std::vector<std::int64_t> sizes = got.sizes();
    std::string why = match(n.shape, sizes, out.symbols);
    if (!why.empty())
      throw Error(util::cat(n.label(), " infer_output_shape disagrees with itself: at record time it "
                            "declared ", n.shape.to_string(), ", but with inputs ", inputs_str,
                            " it gives ", sizes_to_string(sizes), " (", why, ")"));
    out.node_shapes[static_cast<std::size_t>(id)] = std::move(sizes);
  }
  return out;
}

}  // namespace kg::plan
