// Inference fusion of a convolution's epilogue: conv2d → [batch_norm2d] → [add(residual)] →
// [activation] (at least one of them) becomes one nn.fused_conv2d node that applies the folded
// BatchNorm, the residual add and the activation while each output tile is in cache. The
// activation is a built-in one or any single-input op with an ElementwiseForm (a user's).
//
// A node joins the chain only when the node before it has exactly one consumer (it) and is
// not a model output. The fused node takes the convolution's name and all the absorbed
// nodes' parameters with their full names, so weights still load by their PyTorch names. It
// is placed where the chain's last node was: a residual may be computed after the
// convolution (a downsample branch recorded later), and no node between them can read the
// chain's interior values.
#include <algorithm>

#include "ops/conv.hpp"
#include "ops/norm.hpp"
#include "ops/pointwise.hpp"
#include "passes/passes.hpp"

namespace kg::passes {
namespace {

struct Chain {
  int conv = -1;
  int tail = -1;  // the last absorbed node: the fused node replaces its value
  int residual = -1;
  std::vector<int> absorbed;  // after the convolution, in order
  ops::ConvEpilogueSpec spec;
};

}  // namespace

GraphAndOutputs fuse_conv_epilogue(const Graph& graph, const std::vector<int>& outputs) {
  const auto& nodes = graph.nodes();
  const std::vector<int> uses = use_counts(graph, outputs);
  std::vector<std::vector<int>> consumers(nodes.size());
  for (const auto& n : nodes)
    for (int in : n.inputs) consumers[static_cast<std::size_t>(in)].push_back(n.id);

  std::vector<Chain> chains;
  std::vector<int> chain_of_tail(nodes.size(), -1);
  std::vector<char> absorbed(nodes.size(), 0);
  // The single consumer of `id` when it is free to join a chain; -1 when `id` has several
  // consumers or is a model output.
  auto sole_consumer = [&](int id) {
    const auto i = static_cast<std::size_t>(id);
    if (uses[i] != 1 || consumers[i].size() != 1) return -1;
    const int next = consumers[i][0];
    return absorbed[static_cast<std::size_t>(next)] ? -1 : next;
  };
  for (const auto& n : nodes) {
    if (n.kind != Node::Kind::Op) continue;
    const auto* conv = n.op->as<ops::Conv2dOp>();
    if (!conv) continue;
    Chain c;
    c.conv = n.id;
    int cur = n.id;
    const Shape& shape = n.shape;
    int next = sole_consumer(cur);
    // batch_norm2d over the convolution's channels.
    if (next >= 0) {
      const Node& m = graph.node(next);
      const auto* bn = m.op->as<ops::BatchNorm2dOp>();
      if (bn && m.inputs.size() == 1 && bn->channels() == conv->out_channels() && m.dtype == n.dtype) {
        c.spec.batch_norm = true;
        c.spec.bn_eps = bn->eps();
        c.absorbed.push_back(next);
        cur = next;
        next = sole_consumer(cur);
      }
    }
    // add(chain, residual) or add(residual, chain) with equal shapes (no broadcasting).
    if (next >= 0) {
      const Node& m = graph.node(next);
      if (m.op->name() == "nn.add" && m.inputs.size() == 2 && m.shape == shape && m.dtype == n.dtype) {
        const int other = m.inputs[0] == cur ? m.inputs[1] : m.inputs[0];
        const Node& r = graph.node(other);
        if (other != cur && r.shape == shape && r.dtype == n.dtype) {
          c.spec.residual = true;
          c.residual = other;
          c.absorbed.push_back(next);
          cur = next;
          next = sole_consumer(cur);
        }
      }
    }
    // An elementwise activation: a built-in one, or any single-input op that declares its
    // per-element form (a user's activation), with no parameters and the same shape and dtype.
    if (next >= 0) {
      const Node& m = graph.node(next);
      if (auto act = ops::unary_spec(m.op->op()); act && m.inputs.size() == 1 && m.dtype == n.dtype) {
        c.spec.activation = act;
        c.absorbed.push_back(next);
        cur = next;
      } else if (m.inputs.size() == 1 && m.params.empty() && m.dtype == n.dtype && m.shape == shape) {
        std::optional<ElementwiseForm> form = m.op->op().elementwise_form({n.dtype});
        if (form && !form->function.empty() && form->cpu) {
          c.spec.activation_form = std::move(form);
          c.spec.activation_op = m.op_name();
          c.spec.clip = ops::clip_bounds(m.op->op());
          c.absorbed.push_back(next);
          cur = next;
        }
      }
    }
    if (c.absorbed.empty()) continue;
    c.tail = cur;
    for (int id : c.absorbed) {
      absorbed[static_cast<std::size_t>(id)] = 1;
      c.spec.fused_nodes.push_back(graph.node(id).name);
      c.spec.fused_ops.push_back(graph.node(id).op_name());
    }
    absorbed[static_cast<std::size_t>(c.conv)] = 1;
    chain_of_tail[static_cast<std::size_t>(c.tail)] = static_cast<int>(chains.size());
    chains.push_back(std::move(c));
  }

  Rewriter rw(graph);
  for (const auto& n : nodes) {
    if (n.kind != Node::Kind::Op) continue;
    const int ci = chain_of_tail[static_cast<std::size_t>(n.id)];
    if (ci < 0) {
      if (!absorbed[static_cast<std::size_t>(n.id)]) rw.copy(n.id);
      continue;
    }
    const Chain& c = chains[static_cast<std::size_t>(ci)];
    const Node& conv = graph.node(c.conv);
    Node fused;
    fused.kind = Node::Kind::Op;
    fused.name = conv.name;
    fused.dtype = n.dtype;
    fused.shape = n.shape;
    fused.params = conv.params;
    for (int id : c.absorbed) {
      const auto& p = graph.node(id).params;
      fused.params.insert(fused.params.end(), p.begin(), p.end());
    }
    fused.op = CustomData::make<ops::FusedConv2dOp>(*conv.op->as<ops::Conv2dOp>(), c.spec, fused.params);
    std::vector<int> ins{conv.inputs[0]};
    if (c.residual >= 0) ins.push_back(c.residual);
    rw.map(n.id, rw.add(std::move(fused), ins));
  }
  return rw.finish(outputs);
}

}  // namespace kg::passes
