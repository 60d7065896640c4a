// Attention recognition (inference): the chain the ONNX exporters write for scaled dot-product
// attention,
//
//   MatMul(q', k') → [Mul or Div by a scalar] → [Add(mask)] → Softmax(last dim) → MatMul(·, v)
//
// with k' = kᵀ (a Transpose of k, or the product's operand as it is), the scale applied before or
// after the first product (to q and to k separately too, √scale each, as some exporters do), and
// shape-preserving views (an f32 → f32 Cast) anywhere between, becomes one nn.attention node
// (ops/attention) with the final product's name. Every value inside the chain must be read by the
// chain alone and be no model output; q, k and v must have one batch shape (no broadcasting in the
// products), the mask must not widen the scores, and D and Dv must be known and fit the op's GPU
// kernel. A transpose of k made by an nn.permute is folded into one permute giving k as
// [batch..., Sk, D] (none when that is the identity); otherwise a transpose is added. The ops are
// recognised by what they declare (ops/matmul.hpp, ops/softmax.hpp, ops/elementwise.hpp,
// ops/shape_ops.hpp), never by name. In training the graph is copied unchanged.
#include <algorithm>
#include <numeric>

#include "kg/error.hpp"
#include "kg/ops.hpp"
#include "ops/attention.hpp"
#include "ops/elementwise.hpp"
#include "ops/matmul.hpp"
#include "ops/shape_ops.hpp"
#include "ops/softmax.hpp"
#include "passes/passes.hpp"

namespace kg::passes {
namespace {

struct Match {
  int final_mm = -1;
  int q = -1, v = -1, mask = -1;
  int k = -1;                      // k as [batch..., Sk, D] when k_perm is empty, else permuted by it
  std::vector<std::int64_t> k_perm;
  bool k_transpose = false;        // k is [batch..., D, Sk]: transpose its last two dims
  std::string k_name;              // the name for a new permute of k
  double scale = 1;
  std::vector<int> absorbed;       // nodes the attention node replaces
};

class Matcher {
 public:
  Matcher(const Graph& g, const std::vector<int>& outputs) : g_(g), uses_(use_counts(g, outputs)) {
    is_output_.assign(g.nodes().size(), 0);
    for (int o : outputs) is_output_[static_cast<std::size_t>(o)] = 1;
  }

  std::optional<Match> at(const Node& n) const {
    if (n.kind != Node::Kind::Op || n.inputs.size() != 2 || !ops::is_matmul(n.op->op())) return std::nullopt;
    if (!is_floating(n.dtype) || n.shape.rank() < 2) return std::nullopt;
    Match m;
    m.final_mm = n.id;
    // The probabilities: Softmax over the last dim, through identity views.
    int p = skip_views(n.inputs[0], m);
    const Node& sm = g_.node(p);
    const auto dim = sm.kind == Node::Kind::Op ? ops::softmax_dim(sm.op->op()) : std::nullopt;
    const auto rank = static_cast<std::int64_t>(sm.shape.rank());
    if (!dim || !inner(p) || rank < 2 || (*dim != -1 && *dim != rank - 1)) return std::nullopt;
    m.absorbed.push_back(p);
    // [Add(mask)] and the scaled scores (a scale after the mask would scale the mask too: not taken).
    int s = skip_views(sm.inputs[0], m);
    const Node& add = g_.node(s);
    if (add.kind == Node::Kind::Op && add.inputs.size() == 2 && ops::binary_fn(add.op->op()) == ops::BinaryFn::Add &&
        inner(s)) {
      for (int side = 0; side < 2 && m.mask < 0; ++side) {
        Match t = m;
        t.absorbed.push_back(s);
        const int scores = skip_scales(add.inputs[static_cast<std::size_t>(side)], t);
        if (!is_product(scores)) continue;
        const int mask = add.inputs[static_cast<std::size_t>(1 - side)];
        const Node& mn = g_.node(mask);
        if (mn.dtype != add.dtype || !(add.shape == g_.node(scores).shape)) continue;
        t.mask = mask;
        t.absorbed.push_back(scores);
        m = std::move(t);
        s = scores;
      }
      if (m.mask < 0) return std::nullopt;
    } else {
      s = skip_scales(s, m);
      if (!is_product(s)) return std::nullopt;
      m.absorbed.push_back(s);
    }
    // The scores' product q' k'.
    const Node& mm = g_.node(s);
    m.q = skip_scales(mm.inputs[0], m);
    int kt = skip_scales(mm.inputs[1], m);
    m.v = n.inputs[1];
    const Node &q = g_.node(m.q), &v = g_.node(m.v), &ktn = g_.node(kt);
    const std::size_t r = q.shape.rank();
    if (r < 2 || ktn.shape.rank() != r || v.shape.rank() != r || n.shape.rank() != r) return std::nullopt;
    if (q.dtype != n.dtype || ktn.dtype != n.dtype || v.dtype != n.dtype) return std::nullopt;
    for (std::size_t i = 0; i + 2 < r; ++i)
      if (!(q.shape[i] == ktn.shape[i]) || !(q.shape[i] == v.shape[i])) return std::nullopt;
    const Dim &d = q.shape[r - 1], &dv = v.shape[r - 1];
    if (!d.is_static() || !dv.is_static() || d.size() > ops::attention_max_head() ||
        dv.size() > ops::attention_max_head())
      return std::nullopt;
    // k: kt is [batch..., D, Sk]; fold a permute that made it, else transpose it.
    const auto perm = ktn.kind == Node::Kind::Op ? ops::permute_dims(ktn.op->op(), r) : std::nullopt;
    if (perm && inner(kt)) {
      std::vector<std::int64_t> pk = *perm;
      std::swap(pk[r - 1], pk[r - 2]);
      m.absorbed.push_back(kt);
      m.k = skip_scales(ktn.inputs[0], m);  // a scale of k before its transpose
      m.k_name = ktn.name;
      std::vector<std::int64_t> id(r);
      std::iota(id.begin(), id.end(), std::int64_t{0});
      if (pk != id) m.k_perm = std::move(pk);
    } else {
      m.k = kt;
      m.k_transpose = true;
      m.k_name = n.name + ".k_transpose";
    }
    return m;
  }

 private:
  // Read once, by the chain, and no model output.
  bool inner(int id) const {
    const auto u = static_cast<std::size_t>(id);
    return uses_[u] == 1 && !is_output_[u];
  }
  bool is_product(int id) const {
    const Node& n = g_.node(id);
    return n.kind == Node::Kind::Op && n.inputs.size() == 2 && ops::is_matmul(n.op->op()) && inner(id);
  }
  // A view that changes nothing (same shape and dtype as its input).
  bool identity_view(const Node& n) const {
    if (n.kind != Node::Kind::Op || n.inputs.size() != 1 || !n.op->op().is_view()) return false;
    const Node& in = g_.node(n.inputs[0]);
    return in.dtype == n.dtype && in.shape == n.shape;
  }
  int skip_views(int id, Match& m) const {
    while (identity_view(g_.node(id)) && inner(id)) {
      m.absorbed.push_back(id);
      id = g_.node(id).inputs[0];
    }
    return id;
  }
  // Identity views and products or quotients by a scalar, their factors gathered into m.scale.
  int skip_scales(int id, Match& m) const {
    for (;;) {
      id = skip_views(id, m);
      const Node& n = g_.node(id);
      if (n.kind != Node::Kind::Op || !inner(id)) return id;
      const auto s = ops::scalar_spec(n.op->op());
      if (!s) return id;
      if (s->fn == ops::BinaryFn::Mul)
        m.scale *= s->scalar;
      else if (s->fn == ops::BinaryFn::Div && !s->reversed && s->scalar != 0)
        m.scale /= s->scalar;
      else
        return id;
      m.absorbed.push_back(id);
      id = n.inputs[0];
    }
  }

  const Graph& g_;
  std::vector<int> uses_;
  std::vector<char> is_output_;
};

}  // namespace

GraphAndOutputs fuse_attention(const Graph& graph, const std::vector<int>& outputs, LoweringMode mode) {
  const auto& nodes = graph.nodes();
  std::vector<std::optional<Match>> at_final(nodes.size());
  std::vector<char> absorbed(nodes.size(), 0);
  if (mode == LoweringMode::Inference) {
    Matcher matcher(graph, outputs);
    for (const auto& n : nodes) {
      std::optional<Match> m = matcher.at(n);
      if (!m) continue;
      // A chain's inner nodes are read by it alone, so two chains never share one; checked anyway.
      if (std::any_of(m->absorbed.begin(), m->absorbed.end(),
                      [&](int id) {
                        const auto a = static_cast<std::size_t>(id);
                        return absorbed[a] != 0 || at_final[a].has_value();
                      }))
        continue;
      for (int id : m->absorbed) absorbed[static_cast<std::size_t>(id)] = 1;
      at_final[static_cast<std::size_t>(n.id)] = std::move(m);
    }
  }
  Rewriter rw(graph);
  for (const auto& n : nodes) {
    if (n.kind != Node::Kind::Op) continue;
    const auto u = static_cast<std::size_t>(n.id);
    if (absorbed[u]) continue;
    if (!at_final[u]) {
      rw.copy(n.id);
      continue;
    }
    const Match& m = *at_final[u];
    auto value = [&](int old_id) { return SymTensor(rw.graph(), rw.mapped(old_id)); };
    try {
      SymTensor k = value(m.k);
      if (m.k_transpose)
        k = kg::transpose(k, -1, -2, m.k_name);
      else if (!m.k_perm.empty())
        k = kg::permute(k, m.k_perm, m.k_name);
      const SymTensor mask = m.mask >= 0 ? value(m.mask) : SymTensor();
      const SymTensor out = kg::nn::attention(value(m.q), k, value(m.v), mask, false, m.scale, n.name);
      rw.map(n.id, out.node());
    } catch (const Error& e) {
      throw Error(n.label() + " attention: " + e.what());
    }
  }
  return rw.finish(outputs);
}

}  // namespace kg::passes
