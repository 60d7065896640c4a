// Reduced precision at load: the nodes that can compute in f16 or bf16 do, the others keep f32,
// and casts join the two. What runs in the reduced dtype is read only from what the ops declare:
//   - an op whose CustomOp::computes_in(dtype) is true: its floating inputs, its output and its
//     f32 parameters take the dtype (the op accumulates in f32 inside where it matters);
//   - a kg.fused_elementwise group and a lone node with an elementwise form (a built-in activation
//     or arithmetic, or a user's op): a 16-bit group whose members compute in float from their
//     f32 forms, so every such op runs in the dtype without a 16-bit kernel of its own.
// An op without floating inputs that computes_in the dtype (a constant: an ONNX model's weights)
// produces it in that dtype when every consumer runs in it, so its value is converted once at load
// rather than cast on every run. Everything else (softmax, norms, losses, ops with f64 or integer
// results, ops that declare nothing) keeps f32. A value is cast at most once per direction, where a node of the other kind
// reads it; model inputs and outputs keep their recorded dtypes, so a caller feeds and reads f32.
#include <map>
#include <set>

#include "graph/param_dtype.hpp"
#include "kg/error.hpp"
#include "ops/fused_elementwise.hpp"
#include "ops/pointwise.hpp"
#include "passes/passes.hpp"
#include "util/str.hpp"

namespace kg::passes {
namespace {

class PrecisionRewrite {
 public:
  PrecisionRewrite(const Graph& old, const std::vector<int>& outputs, DType low)
      : old_(old), low_(low), rw_(old) {
    for (const Node& n : old.nodes()) names_.insert(n.name);
    decide(outputs);
  }

  bool changed() const { return changed_; }

  void node(const Node& n) {
    std::optional<Node> low =
        runs_low_[static_cast<std::size_t>(n.id)] ? low_form(n, /*source=*/true) : std::optional<Node>();
    if (!low) {
      // As recorded: each input in the dtype it was recorded with.
      Node copy = n;
      copy.inputs.clear();
      for (int in : n.inputs) copy.inputs.push_back(value(in, old_.node(in).dtype));
      rw_.map(n.id, rw_.graph()->add_node(std::move(copy)));
      return;
    }
    changed_ = true;
    low->inputs.clear();
    for (int in : n.inputs) {
      const DType t = old_.node(in).dtype;
      low->inputs.push_back(value(in, t == DType::F32 ? low_ : t));
    }
    rw_.map(n.id, rw_.graph()->add_node(std::move(*low)));
  }

  GraphAndOutputs finish(const std::vector<int>& outputs) {
    GraphAndOutputs r{rw_.graph(), {}};
    for (int o : outputs) r.outputs.push_back(value(o, old_.node(o).dtype));
    return r;
  }

 private:
  // Which nodes run in the reduced dtype: those low_form() takes, then the sources (no floating
  // input) whose every consumer does and which are no model output.
  void decide(const std::vector<int>& outputs) {
    const std::size_t count = old_.nodes().size();
    runs_low_.assign(count, 0);
    std::vector<char> is_source(count, 0), output(count, 0);
    std::vector<std::vector<int>> consumers(count);
    for (int o : outputs) output[static_cast<std::size_t>(o)] = 1;
    for (const Node& n : old_.nodes()) {
      for (int i : n.inputs) consumers[static_cast<std::size_t>(i)].push_back(n.id);
      if (n.kind != Node::Kind::Op) continue;
      bool floating_input = false;
      for (int i : n.inputs) floating_input = floating_input || is_floating(old_.node(i).dtype);
      is_source[static_cast<std::size_t>(n.id)] = !floating_input;
      if (floating_input) runs_low_[static_cast<std::size_t>(n.id)] = low_form(n, false).has_value();
    }
    for (const Node& n : old_.nodes()) {
      const auto id = static_cast<std::size_t>(n.id);
      if (!is_source[id] || output[id] || consumers[id].empty()) continue;
      bool all_low = true;
      for (int c : consumers[id]) all_low = all_low && runs_low_[static_cast<std::size_t>(c)];
      runs_low_[id] = all_low && low_form(n, true).has_value();
    }
  }

  // The node as it runs in the reduced dtype, or nullopt when it keeps f32 (a source only where
  // `source` allows it). Its inputs are set by the caller.
  std::optional<Node> low_form(const Node& n, bool source) const {
    if (n.kind != Node::Kind::Op || n.dtype != DType::F32) return std::nullopt;
    std::vector<DType> in;
    bool floating_input = false;
    for (int i : n.inputs) {
      const DType t = old_.node(i).dtype;
      if (is_floating(t) && t != DType::F32) return std::nullopt;  // f64 or 16-bit inputs: as recorded
      floating_input = floating_input || t == DType::F32;
      in.push_back(t == DType::F32 ? low_ : t);
    }
    Node low = n;
    if (!floating_input) {  // its output's dtype is its own: it makes the reduced one directly
      if (!source || !n.op->op().computes_in(low_)) return std::nullopt;
      for (ParamSpec& p : low.params) narrow_param(p, low_);
      low.dtype = low_;
      return low;
    }
    if (const auto* group = n.op->as<ops::FusedElementwiseOp>()) {
      if (group->dtype() != DType::F32 || group->mode() != LoweringMode::Inference) return std::nullopt;
      low.op = CustomData::make<ops::FusedElementwiseOp>(group->members(), group->inputs(), low_,
                                                         LoweringMode::Inference, group->outputs());
    } else if (n.op->op().computes_in(low_)) {
      DType out;
      try {
        out = n.op->op().infer_output_dtype(in);
      } catch (const std::exception& e) {
        throw Error(util::cat(n.label(), " declares that it computes in ", dtype_name(low_),
                              " but refuses its inputs in it: ", e.what()));
      }
      if (out != low_)
        throw Error(util::cat(n.label(), " declares that it computes in ", dtype_name(low_), " but gives ",
                              dtype_name(out), " for inputs in it"));
      for (ParamSpec& p : low.params) narrow_param(p, low_);
    } else if (std::optional<ElementwiseForm> form = fusable_form(old_, n, LoweringMode::Inference)) {
      // A lone elementwise node: a group of one, reading each input as its own group input.
      ops::FusedMember m{n.name, *n.op, std::move(*form), {}};
      for (std::size_t k = 0; k < n.inputs.size(); ++k) m.args.push_back(-1 - static_cast<int>(k));
      low.op = CustomData::make<ops::FusedElementwiseOp>(std::vector<ops::FusedMember>{std::move(m)},
                                                         static_cast<int>(n.inputs.size()), low_,
                                                         LoweringMode::Inference);
    } else {
      return std::nullopt;
    }
    low.dtype = low_;
    return low;
  }

  // The new graph's id of old value `id` in dtype `want`: the value itself, or a cast of it made
  // once.
  int value(int id, DType want) {
    const int have = rw_.mapped(id);
    if (have < 0) throw Error("reduced precision: an input was not copied before its consumer");
    if (rw_.graph()->node(have).dtype == want) return have;
    const auto key = std::pair{id, want};
    if (auto it = casts_.find(key); it != casts_.end()) return it->second;
    const Node& src = rw_.graph()->node(have);
    Node cast;
    cast.kind = Node::Kind::Op;
    cast.name = fresh_name(util::cat(old_.node(id).name, ".to_", dtype_name(want)));
    cast.op = ops::cast_op(want);
    cast.inputs = {have};
    cast.dtype = want;
    cast.shape = src.shape;
    const int made = rw_.graph()->add_node(std::move(cast));
    casts_.emplace(key, made);
    return made;
  }

  std::string fresh_name(const std::string& wanted) {
    std::string name = wanted;
    for (int k = 1; names_.count(name); ++k) name = util::cat(wanted, "_", k);
    names_.insert(name);
    return name;
  }

  const Graph& old_;
  DType low_;
  Rewriter rw_;
  std::vector<char> runs_low_;  // per old node: runs in the reduced dtype
  std::set<std::string> names_;
  std::map<std::pair<int, DType>, int> casts_;
  bool changed_ = false;
};

}  // namespace

GraphAndOutputs reduce_precision(const std::shared_ptr<Graph>& graph, const std::vector<int>& outputs,
                                 DType precision) {
  if (!is_half_float(precision))
    throw Error(util::cat("reduced precision is f16 or bf16, not ", dtype_name(precision)));
  PrecisionRewrite r(*graph, outputs, precision);
  for (const Node& n : graph->nodes())
    if (n.kind == Node::Kind::Op) r.node(n);
  if (!r.changed()) return {graph, outputs};
  return r.finish(outputs);
}

}  // namespace kg::passes
