// Elementwise fusion: maximal groups of nodes whose ops declare a per-element form
// (CustomOp::elementwise_form) become one kg.fused_elementwise node each. The pass reads only what
// the ops declare; built-in activations and arithmetic are found the same way as a user's op.
//
// A node is fusable when its op gives a form for its input dtypes, it owns no parameters, its
// inputs and output share one dtype (f32 or f64) and its output shape is the broadcast of its
// inputs' shapes. In training it also needs the form's derivative; its inputs may broadcast as in
// inference (the group's backward sums a broadcast input's contributions onto its shape).
//
// Groups grow from their root (the last node, whose value leaves the group) towards the inputs:
// a fusable producer joins when every consumer of its value is in the group and it is not a model
// output. When no producer can join that way, one whose value is also needed outside (read by a
// node outside the group, or a model output), or a node that reads a member's value, joins as one
// more output of the group, if it has the root's shape, the group writes at most KG_FUSE_MAX_OUTPUTS values, and the group does not become
// its own ancestor (no input of the group may depend on one of its members). A group reads at most
// KG_FUSE_MAX_INPUTS values from outside; a lone node stays as it is. A group with one output
// becomes one node under the root's name; one with k outputs becomes a node of their packed value
// [k, <shape>] ("<root>.group") and a kg.group_output view per output under the member's name, so
// readers, model outputs and names are as recorded.
#include <algorithm>
#include <functional>
#include <map>
#include <queue>

#include "kg/error.hpp"
#include "ops/fused_elementwise.hpp"
#include "ops/op_util.hpp"
#include "passes/passes.hpp"
#include "util/str.hpp"

namespace kg::passes {
namespace {

bool same_shape(const Shape& a, const Shape& b) { return a == b; }

}  // namespace

std::optional<ElementwiseForm> fusable_form(const Graph& g, const Node& n, LoweringMode mode) {
  if (n.kind != Node::Kind::Op || !n.params.empty() || n.inputs.empty()) return std::nullopt;
  if (n.dtype != DType::F32 && n.dtype != DType::F64) return std::nullopt;
  std::vector<DType> dtypes;
  for (int in : n.inputs) {
    const Node& src = g.node(in);
    if (src.dtype != n.dtype) return std::nullopt;
    dtypes.push_back(src.dtype);
  }
  std::optional<ElementwiseForm> form;
  try {
    form = n.op->op().elementwise_form(dtypes);
  } catch (const std::exception& e) {
    throw Error(n.label() + " elementwise_form: " + e.what());
  }
  if (!form || form->function.empty() || !form->cpu) return std::nullopt;
  if (mode == LoweringMode::Training && (form->derivative.empty() || !form->cpu_derivative)) return std::nullopt;
  // The output must be the broadcast of the inputs.
  Shape b = g.node(n.inputs[0]).shape;
  try {
    for (std::size_t k = 1; k < n.inputs.size(); ++k) b = ops::broadcast_shapes(b, g.node(n.inputs[k]).shape);
  } catch (const Error&) {
    return std::nullopt;
  }
  if (!same_shape(b, n.shape)) return std::nullopt;
  return form;
}

std::optional<ElementwiseGroup> elementwise_group(const Graph& g, const Node& p) {
  if (p.kind != Node::Kind::Op) return std::nullopt;
  if (const auto* group = p.op->as<ops::FusedElementwiseOp>()) {
    if (group->mode() != LoweringMode::Inference || group->dtype() != p.dtype) return std::nullopt;
    // A group with several outputs writes a packed value that views read.
    if (group->outputs().size() > 1) return std::nullopt;
    return ElementwiseGroup{group->members(), group->inputs(), p.inputs};
  }
  std::optional<ElementwiseForm> form = fusable_form(g, p, LoweringMode::Inference);
  if (!form) return std::nullopt;
  ElementwiseGroup r;
  ops::FusedMember m{p.name, *p.op, std::move(*form), {}};
  for (int in : p.inputs) {
    auto it = std::find(r.old_inputs.begin(), r.old_inputs.end(), in);
    if (it == r.old_inputs.end()) it = r.old_inputs.insert(r.old_inputs.end(), in);
    m.args.push_back(-1 - static_cast<int>(it - r.old_inputs.begin()));
  }
  r.members.push_back(std::move(m));
  r.inputs = static_cast<int>(r.old_inputs.size());
  return r;
}

namespace {

struct Group {
  std::vector<int> members;  // node ids, topological order, root last
  std::vector<int> inputs;   // node ids read from outside, in order of first use
  std::vector<int> outputs;  // members whose values are needed outside, in member order (the root last)
};

}  // namespace

GraphAndOutputs fuse_elementwise(const Graph& graph, const std::vector<int>& outputs, LoweringMode mode) {
  const auto& nodes = graph.nodes();
  const std::size_t count = nodes.size();
  auto at = [](auto& v, int id) -> auto& { return v[static_cast<std::size_t>(id)]; };
  // Each node's readers, once each, in id order (a node reading a value twice is one reader).
  std::vector<std::vector<int>> consumers(count);
  for (const auto& n : nodes)
    for (int in : n.inputs) {
      auto& c = at(consumers, in);
      if (c.empty() || c.back() != n.id) c.push_back(n.id);
    }
  std::vector<char> is_output(count, 0);
  for (int o : outputs) at(is_output, o) = 1;
  std::vector<std::optional<ElementwiseForm>> forms(count);
  for (const auto& n : nodes) at(forms, n.id) = fusable_form(graph, n, mode);
  // A node's distinct inputs, in order.
  auto distinct_inputs = [&](int id) {
    std::vector<int> v;
    for (int in : graph.node(id).inputs)
      if (std::find(v.begin(), v.end(), in) == v.end()) v.push_back(in);
    return v;
  };

  // The growing group is kept as running tallies, so that each join costs the joining node's edges
  // and not the group's size (a chain of n fusable nodes is one group built in O(n)):
  //   inside[v]  how many readers of v are members (v a member or not; zero outside a formation),
  //   ext        the group's external values in order of first use by the members in join order,
  //   open       the members read by some node outside the group, in join order,
  //   outs       how many members the group writes.
  std::vector<int> group_of(count, -1);
  std::vector<int> inside(count, 0);
  std::vector<Group> groups;
  bool any_several = false;  // some group formed so far has several outputs
  // Visit marks of the cycle check: a node (group) is seen in the current walk when its mark is
  // the walk's stamp.
  std::vector<int> seen(count, 0), group_seen;
  int stamp = 0;
  for (std::size_t r = count; r-- > 0;) {
    if (!forms[r] || group_of[r] >= 0) continue;
    const int gi = static_cast<int>(groups.size());
    const int root = static_cast<int>(r);
    std::vector<int> members, ext, open;
    std::size_t outs = 0;
    int top = root;  // the member with the largest id
    // A member's value is needed outside: a model output, or read by a node outside the group.
    auto needed_outside = [&](int m) {
      return at(is_output, m) || static_cast<std::size_t>(at(inside, m)) < at(consumers, m).size();
    };
    // A member the group writes: one needed outside, or one no member reads (the last one).
    auto written = [&](int m) { return needed_outside(m) || at(inside, m) == 0; };
    // Adds p to the group and updates the tallies.
    auto join = [&](int p) {
      at(group_of, p) = gi;
      members.push_back(p);
      top = std::max(top, p);
      ext.erase(std::remove(ext.begin(), ext.end(), p), ext.end());
      for (int q : distinct_inputs(p)) {
        if (at(group_of, q) == gi) {
          const bool was = written(q);
          ++at(inside, q);
          if (was && !written(q)) --outs;
          if (static_cast<std::size_t>(at(inside, q)) == at(consumers, q).size())
            open.erase(std::remove(open.begin(), open.end(), q), open.end());
        } else {
          ++at(inside, q);
          if (std::find(ext.begin(), ext.end(), q) == ext.end()) ext.push_back(q);
        }
      }
      if (written(p)) ++outs;
      if (static_cast<std::size_t>(at(inside, p)) < at(consumers, p).size()) open.push_back(p);
    };
    join(root);
    // No external input of the group depends on one of its members: the group, as one node, must
    // not be its own ancestor. A group formed earlier counts as one node too: whatever reaches one of
    // its members reaches all its outputs.
    int limit_of = -1, limit = -1;  // `limit` computed for a group whose last member is `limit_of`
    auto acyclic = [&]() {
      // Past `limit` no path leads back below the group's last member (where its inputs are): only
      // a formed group with a member below it can lead back, and no node past its last one.
      if (limit_of != top) {
        limit_of = top;
        limit = top;
        for (const Group& h : groups)
          if (h.members.front() < limit) limit = std::max(limit, h.members.back());
      }
      ++stamp;
      if (group_seen.size() < groups.size()) group_seen.resize(groups.size(), 0);
      std::vector<int> stack;
      // Only the members in `open` have readers outside the group.
      for (int m : open)
        for (int c : at(consumers, m))
          if (at(group_of, c) != gi) stack.push_back(c);
      while (!stack.empty()) {
        const int v = stack.back();
        stack.pop_back();
        if (at(seen, v) == stamp || v > limit) continue;
        at(seen, v) = stamp;
        if (at(group_of, v) == gi || std::find(ext.begin(), ext.end(), v) != ext.end()) return false;
        for (int c : at(consumers, v)) stack.push_back(c);
        const int h = at(group_of, v);
        if (h >= 0 && at(group_seen, h) != stamp) {
          at(group_seen, h) = stamp;
          for (int m : at(groups, h).members) stack.push_back(m);
        }
      }
      return true;
    };
    auto try_join = [&](int p, bool as_output) {
      const std::vector<int> ext_before = ext, open_before = open;
      const std::size_t outs_before = outs;
      const int top_before = top;
      join(p);
      bool ok = ext.size() <= KG_FUSE_MAX_INPUTS;
      if (ok && as_output) ok = outs <= KG_FUSE_MAX_OUTPUTS;
      if (ok && (any_several || outs > 1)) ok = acyclic();
      if (!ok) {
        at(group_of, p) = -1;
        members.pop_back();
        for (int q : distinct_inputs(p)) --at(inside, q);
        ext = ext_before;
        open = open_before;
        outs = outs_before;
        top = top_before;
      }
      return ok;
    };
    for (bool grew = true; grew;) {
      grew = false;
      // Producers whose every reader is in the group first.
      for (int p : std::vector<int>(ext)) {
        if (!at(forms, p) || at(group_of, p) >= 0 || at(is_output, p)) continue;
        if (static_cast<std::size_t>(at(inside, p)) != at(consumers, p).size()) continue;
        grew = try_join(p, false) || grew;
      }
      if (grew) continue;
      // Then one value also needed outside, as one more output of the group's shape: a producer,
      // or a node that reads the group's values (a sibling of the root, such as a in
      // s = sigmoid(x), a = s * x, b = s + 1).
      auto joinable = [&](int p) {
        return at(forms, p) && at(group_of, p) < 0 && graph.node(p).shape == graph.node(root).shape;
      };
      for (int p : std::vector<int>(ext)) {
        if (joinable(p) && try_join(p, true)) {
          grew = true;
          break;
        }
      }
      if (grew) continue;
      // Readers outside the group are readers of the members in `open`.
      for (int m : std::vector<int>(open)) {
        for (int c : at(consumers, m))
          if (joinable(c) && (at(is_output, c) || !at(consumers, c).empty()) && try_join(c, true)) {
            grew = true;
            break;
          }
        if (grew) break;
      }
    }
    const bool formed = members.size() >= 2;
    Group g;
    if (formed) {
      std::sort(members.begin(), members.end());
      g.members = members;
      for (int m : members) {
        for (int in : graph.node(m).inputs)
          if (at(group_of, in) != gi && std::find(g.inputs.begin(), g.inputs.end(), in) == g.inputs.end())
            g.inputs.push_back(in);
        if (written(m)) g.outputs.push_back(m);
      }
    }
    for (int m : members)
      for (int q : graph.node(m).inputs) at(inside, q) = 0;
    if (!formed) {
      group_of[r] = -1;
      continue;
    }
    any_several = any_several || g.outputs.size() > 1;
    groups.push_back(std::move(g));
  }

  // Emission in a topological order of the rewritten graph: a group is one node, placed once its
  // inputs are; the rest keep their order (a smallest-id-first topological sort, a group counting
  // as its root's id), so a graph whose groups have one output each keeps its order exactly.
  auto unit = [&](int id) { const int gi = at(group_of, id); return gi < 0 ? id : at(groups, gi).members.back(); };
  auto unit_inputs = [&](int u) {
    const int gi = at(group_of, u);
    return gi < 0 ? graph.node(u).inputs : at(groups, gi).inputs;
  };
  std::vector<int> waiting(count, 0);
  std::vector<std::vector<int>> readers(count);
  std::priority_queue<int, std::vector<int>, std::greater<int>> ready;
  for (const auto& n : nodes) {
    if (n.kind != Node::Kind::Op || unit(n.id) != n.id) continue;
    std::vector<int> deps;
    for (int in : unit_inputs(n.id))
      if (graph.node(in).kind == Node::Kind::Op && std::find(deps.begin(), deps.end(), unit(in)) == deps.end())
        deps.push_back(unit(in));
    for (int d : deps) at(readers, d).push_back(n.id);
    at(waiting, n.id) = static_cast<int>(deps.size());
    if (deps.empty()) ready.push(n.id);
  }
  Rewriter rw(graph);
  auto fresh_name = [&](const std::string& wanted) {
    std::string name = wanted;
    for (int k = 2; graph.find(name) >= 0 || rw.graph()->find(name) >= 0; ++k) name = util::cat(wanted, "_", k);
    return name;
  };
  auto emit_group = [&](const Group& g) {
    const Node& root = graph.node(g.members.back());
    std::map<int, int> index;  // node id -> member index
    std::vector<ops::FusedMember> members;
    std::vector<int> out_members;
    for (int m : g.members) {
      const Node& mn = graph.node(m);
      ops::FusedMember f{mn.name, *mn.op, *at(forms, m), {}};
      for (int in : mn.inputs) {
        auto it = index.find(in);
        if (it != index.end()) {
          f.args.push_back(it->second);
        } else {
          const auto pos = std::find(g.inputs.begin(), g.inputs.end(), in) - g.inputs.begin();
          f.args.push_back(-1 - static_cast<int>(pos));
        }
      }
      index[m] = static_cast<int>(members.size());
      if (std::find(g.outputs.begin(), g.outputs.end(), m) != g.outputs.end()) out_members.push_back(index[m]);
      members.push_back(std::move(f));
    }
    const std::size_t k = g.outputs.size();
    Node fused;
    fused.kind = Node::Kind::Op;
    // One output: the node is the root's value and takes its name. Several: the node is their
    // packed value, and each output is a view of its part under its member's name.
    fused.name = k == 1 ? root.name : fresh_name(root.name + ".group");
    fused.dtype = root.dtype;
    const auto op = CustomData::make<ops::FusedElementwiseOp>(std::move(members), static_cast<int>(g.inputs.size()),
                                                               root.dtype, mode, std::move(out_members));
    if (k == 1) {
      fused.shape = root.shape;
    } else {
      std::vector<Dim> dims{Dim(static_cast<std::int64_t>(k))};
      dims.insert(dims.end(), root.shape.begin(), root.shape.end());
      fused.shape = Shape(std::move(dims));
    }
    fused.op = op;
    const int packed = rw.add(std::move(fused), g.inputs);
    if (k == 1) {
      rw.map(g.members.back(), packed);
      return;
    }
    for (std::size_t j = 0; j < k; ++j) {
      const Node& m = graph.node(g.outputs[j]);
      Node view;
      view.kind = Node::Kind::Op;
      view.name = m.name;
      view.dtype = m.dtype;
      view.shape = m.shape;
      view.op = CustomData::make<ops::GroupOutputOp>(static_cast<int>(j), static_cast<int>(k));
      view.inputs = {packed};
      rw.map(g.outputs[j], rw.graph()->add_node(std::move(view)));
    }
  };
  while (!ready.empty()) {
    const int u = ready.top();
    ready.pop();
    const int gi = at(group_of, u);
    if (gi < 0)
      rw.copy(u);
    else
      emit_group(at(groups, gi));
    for (int c : at(readers, u))
      if (--at(waiting, c) == 0) ready.push(c);
  }
  return rw.finish(outputs);
}

}  // namespace kg::passes
