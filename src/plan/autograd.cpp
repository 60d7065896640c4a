#include "plan/autograd.hpp"

#include <algorithm>
#include <set>
#include <utility>

#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::plan {

int find_loss(const Graph& graph, const std::vector<std::pair<std::string, int>>& outputs, const BoundShapes& bound,
              const std::string& loss) {
  (void)graph;
  if (!loss.empty()) {
    for (const auto& [name, id] : outputs) {
      if (name != loss) continue;
      const auto& shape = bound.node_shapes.at(static_cast<std::size_t>(id));
      if (numel_of(shape) != 1)
        throw Error(util::cat("loss output '", loss, "' must be a scalar, but its shape is ", sizes_to_string(shape)));
      return id;
    }
    std::string names;
    for (const auto& o : outputs) names += (names.empty() ? "" : ", ") + o.first;
    throw Error(util::cat("no output named '", loss, "' to use as the loss (outputs: ", names, ")"));
  }
  int found = -1;
  for (const auto& o : outputs) {
    if (!bound.node_shapes.at(static_cast<std::size_t>(o.second)).empty()) continue;
    if (found >= 0) return -1;  // ambiguous: the caller must name it
    found = o.second;
  }
  return found;
}

void plan_training(const Graph& graph, Plan& plan, int loss_node, const std::string& loss_name,
                   const HasBackward& has_backward) {
  TrainingPlan& tp = plan.training;
  tp = TrainingPlan{};
  if (loss_node < 0) return;
  tp.enabled = true;
  tp.loss_node = loss_node;
  const std::size_t nn = graph.nodes().size();
  const int n_live = static_cast<int>(plan.live.size());
  auto at = [](auto& v, int id) -> auto& { return v[static_cast<std::size_t>(id)]; };
  auto root = [&](int id) { return at(plan.values, id).root; };
  auto bwd_pos = [&](int id) { return 2 * n_live - 1 - at(plan.step_of, id); };

  // Which values depend on a trainable parameter (and through which one, for errors).
  std::vector<char> requires_grad(nn, 0);
  std::vector<std::string> via(nn);
  for (int id : plan.live) {
    const Node& n = graph.node(id);
    if (n.kind == Node::Kind::Input || !is_floating(n.dtype)) continue;
    for (const auto& p : n.params)
      if (p.trainable && is_floating(p.dtype) && via[static_cast<std::size_t>(id)].empty()) {
        requires_grad[static_cast<std::size_t>(id)] = 1;
        via[static_cast<std::size_t>(id)] = p.name;
      }
    for (int in : n.inputs)
      if (at(requires_grad, in) && !at(requires_grad, id)) {
        at(requires_grad, id) = 1;
        at(via, id) = at(via, in);
      }
  }
  // Which of those the loss depends on.
  std::vector<char> on_path(nn, 0);
  at(on_path, loss_node) = at(requires_grad, loss_node);
  for (auto it = plan.live.rbegin(); it != plan.live.rend(); ++it) {
    if (!at(on_path, *it)) continue;
    const Node& n = graph.node(*it);
    for (int in : n.inputs)
      if (at(requires_grad, in)) at(on_path, in) = 1;
  }

  // Backward steps in reverse order of the forward steps.
  std::vector<int> step_index(nn, -1);
  for (std::size_t s = 0; s < plan.steps.size(); ++s) at(step_index, plan.steps[s].node) = static_cast<int>(s);
  for (auto it = plan.steps.rbegin(); it != plan.steps.rend(); ++it) {
    const Node& n = graph.node(it->node);
    if (!at(on_path, n.id)) continue;
    if (!has_backward(n))
      throw Error(util::cat(n.label(), " has no backward, but it lies on the path from parameter '", at(via, n.id),
                            "' to the loss '", loss_name,
                            "': training would leave that parameter's gradient wrong. Implement "
                            "CustomOp::cpu_backward (CPU) or lower_backward_source() with "
                            "RuntimeOp::backward_launches() (GPU and emulation)"));
    BackwardStep b;
    b.step = at(step_index, n.id);
    b.node = n.id;
    b.saves = n.op->op().backward_saves();
    for (int in : n.inputs) b.inputs.push_back({at(requires_grad, in) ? root(in) : -1, false, 0});
    for (const auto& p : it->specs) b.want_param.push_back(p.trainable && is_floating(p.dtype));
    b.param_temp_offsets.assign(it->specs.size(), 0);
    tp.steps.push_back(std::move(b));
  }

  // Gradient buffers: one per storage root, written by its first contribution; later ones go
  // through a temporary and are added. Live from the first contribution (or the start of the
  // backward for the loss and for gradients nobody writes) to the producer's backward. A root
  // read through views of its parts (a packed value) has one first write per part, and is zeroed
  // first when some part of it has no contribution at all.
  tp.grad_offset.assign(nn, 0);
  tp.has_grad.assign(nn, 0);
  std::vector<int> first_write(nn, -1);
  std::vector<std::size_t> written_bytes(nn, 0);            // by root: bytes of its parts written
  std::set<std::pair<int, std::size_t>> written_parts;      // (root, byte offset of the part)
  auto write = [&](int id, int pos) {                       // false: the part was written before
    const Value& v = at(plan.values, id);
    if (!written_parts.insert({v.root, v.view_bytes}).second) return false;
    at(written_bytes, v.root) += v.bytes();
    if (at(first_write, v.root) < 0) at(first_write, v.root) = pos;
    return true;
  };
  const int loss_root = root(loss_node);
  write(loss_node, n_live);
  for (std::size_t k = 0; k < tp.steps.size(); ++k) {
    BackwardStep& b = tp.steps[k];
    const int pos = bwd_pos(b.node);
    const Node& n = graph.node(b.node);
    for (std::size_t i = 0; i < b.inputs.size(); ++i) {
      GradTarget& g = b.inputs[i];
      if (g.root < 0) continue;
      if (!write(n.inputs[i], pos)) {
        g.accumulate = true;
        tp.requests.push_back({at(plan.values, n.inputs[i]).bytes(), pos, pos});
        tp.targets.push_back({TrainingPlan::Target::Kind::InputTemp, static_cast<int>(k), static_cast<int>(i)});
      }
    }
    const Step& st = plan.steps[static_cast<std::size_t>(b.step)];
    for (std::size_t p = 0; p < st.specs.size(); ++p) {
      if (!b.want_param[p]) continue;
      tp.requests.push_back({st.params[p].nbytes(), pos, pos});
      tp.targets.push_back({TrainingPlan::Target::Kind::ParamTemp, static_cast<int>(k), static_cast<int>(p)});
    }
    // Forward values this backward reads stay alive until it runs.
    if (b.saves.inputs)
      for (int in : n.inputs) {
        const int r = root(in);
        if (at(plan.values, r).input_index < 0) at(plan.last, r) = std::max(at(plan.last, r), pos);
      }
    if (b.saves.output) at(plan.last, root(b.node)) = std::max(at(plan.last, root(b.node)), pos);
  }
  for (const BackwardStep& b : tp.steps) {
    const int r = root(b.node);
    if (at(tp.has_grad, r)) continue;
    at(tp.has_grad, r) = 1;
    int first = at(first_write, r);
    if (first < 0 || at(written_bytes, r) < at(plan.values, r).bytes()) {
      tp.zero_roots.push_back(r);
      first = n_live;
    }
    tp.requests.push_back({at(plan.values, r).bytes(), first, bwd_pos(r)});
    tp.targets.push_back({TrainingPlan::Target::Kind::Grad, r, 0});
  }
  if (!at(tp.has_grad, loss_root)) {  // a loss no parameter reaches: nothing to do
    tp.requests.push_back({at(plan.values, loss_root).bytes(), n_live, n_live});
    tp.targets.push_back({TrainingPlan::Target::Kind::Grad, loss_root, 0});
    at(tp.has_grad, loss_root) = 1;
  }
}

}  // namespace kg::plan
