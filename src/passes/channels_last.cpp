// Channels-last layout (docs/cpu.md, docs/gpu.md). oneDNN's convolutions reach the CPU cores' FMA
// peak on [N, H, W, C] activations and not on [N, C, H, W], and cuDNN's tensor-core convolutions
// on a GPU want NHWC too (on NCHW they transpose inside, or take slower algorithms); converting
// around every convolution would cost more than it saves. So at load the graph is rewritten to
// keep activations channels-last from one convolution to the next:
//
// - every nn.conv2d / nn.fused_conv2d of the target's dtypes (CPU: f32; GPU: f16 and bf16, and
//   f32 where TF32 is allowed) becomes nn.conv2d_nhwc (same name, same parameters), except, on
//   the CPU, those with few output channels whose input is NCHW, where our NCHW kernel (Rows) is
//   faster;
// - a pooling node whose input is channels-last becomes its _nhwc form;
// - an elementwise node (an op with an ElementwiseForm, or a fused group) whose inputs are all
//   channels-last and all of the output's shape stays elementwise, on permuted shapes;
// - an nn.permute node converts each value where it crosses the region's edge, once per value
//   and direction ("<node>.to_nhwc", "<node>.to_nchw"), and the model's outputs keep their
//   layout. Where the value entering the region is a cast (pw.cast between f32, f16 and bf16:
//   the model input's conversion to bf16, say) that nothing outside the region reads, the cast
//   is folded into the permute, which then reads the cast's input and converts as it copies: one
//   pass over the value instead of two.
//
// Node names and parameter names do not change, so weights load as before.
#include <map>

#include "kg/error.hpp"
#include "ops/conv.hpp"
#include "ops/conv_dnnl.hpp"
#include "ops/fused_elementwise.hpp"
#include "ops/pool_dnnl.hpp"
#include "ops/shape_ops.hpp"
#include "passes/dead_nodes.hpp"
#include "passes/passes.hpp"

namespace kg::passes {

namespace {

Shape to_nhwc(const Shape& s) { return Shape(std::vector<Dim>{s[0], s[2], s[3], s[1]}); }

// A 4-d node of a dtype the target runs channels-last.
bool is_4d_for(const Node& n, const ChannelsLastTarget& target) {
  if (n.shape.rank() != 4) return false;
  if (!target.gpu) return n.dtype == DType::F32;
  return is_half_float(n.dtype) || (n.dtype == DType::F32 && target.tf32);
}

// True when our own NCHW kernel beats oneDNN's channels-last one for this convolution whose
// input is NCHW, so that it stays out of the region: the Rows algorithm (few output channels,
// as in LeNet-5's layers, where oneDNN reaches a third of its usual rate and the conversions
// cost more than the layer). Inside a region (MobileNetV2's 32 -> 16 projections) the
// conversions it would need cost more, so there it converts like any other. Rows does not
// depend on the batch, so the check holds for every batch size.
bool own_kernel_better(const Graph& g, const Node& n, const ops::Conv2dOp& c, const std::vector<char>& in_region) {
  if (in_region[static_cast<std::size_t>(n.inputs.at(0))]) return false;
  const Shape& s = g.node(n.inputs.at(0)).shape;
  std::vector<std::int64_t> sizes{1};
  for (std::size_t k = 1; k < 4; ++k) {
    if (!s[k].is_static()) return false;
    sizes.push_back(s[k].size());
  }
  return ops::conv_algo_for(c, sizes, DType::F32) == ops::ConvAlgo::Rows;
}

// The channels-last op replacing `n` when it starts or continues a region (nullopt: it stays).
// `in_region[i]` says whether input i is channels-last.
std::optional<CustomData> channels_last_op(const Graph& g, const Node& n, const std::vector<char>& in_region,
                                           bool tune, const ChannelsLastTarget& target) {
  if (n.kind != Node::Kind::Op || !is_4d_for(n, target)) return std::nullopt;
  // On the CPU: where oneDNN runs and beats our own kernel. On a GPU every convolution: cuDNN
  // takes any group count, and the op's own kernel serves without it.
  auto convert = [&](const ops::Conv2dOp& c) {
    if (target.gpu) return true;
    return ops::ChannelsLastConvOp::supports(c) && !own_kernel_better(g, n, c, in_region);
  };
  if (const auto* c = n.op->as<ops::Conv2dOp>()) {
    if (!convert(*c)) return std::nullopt;
    return CustomData::make<ops::ChannelsLastConvOp>(*c, ops::ConvEpilogueSpec{}, n.params, tune);
  }
  if (const auto* f = n.op->as<ops::FusedConv2dOp>()) {
    if (!convert(f->conv())) return std::nullopt;
    return CustomData::make<ops::ChannelsLastConvOp>(f->conv(), f->spec(), n.params, tune);
  }
  // The rest only continues a region: every input must be in it already.
  for (int in : n.inputs)
    if (!in_region[static_cast<std::size_t>(in)]) return std::nullopt;
  if (auto pc = ops::pool_config(n.op->op())) {
    if (!ops::channels_last_pool_supported(*pc, target.gpu) || n.inputs.size() != 1) return std::nullopt;
    return ops::channels_last_pool(*pc);
  }
  // Elementwise without broadcasting: the same op on permuted shapes.
  for (int in : n.inputs)
    if (!(g.node(in).shape == n.shape) || g.node(in).dtype != n.dtype) return std::nullopt;
  if (n.op->as<ops::FusedElementwiseOp>()) return *n.op;
  std::vector<DType> dtypes(n.inputs.size(), n.dtype);
  if (!n.inputs.empty() && n.op->op().elementwise_form(dtypes)) return *n.op;
  return std::nullopt;
}

}  // namespace

GraphAndOutputs channels_last(const std::shared_ptr<Graph>& graph, const std::vector<int>& outputs, bool tune,
                              const ChannelsLastTarget& target) {
  const Graph& g = *graph;
  const std::vector<int> live = live_nodes(g, outputs);
  std::vector<char> region(g.nodes().size(), 0);
  std::map<int, CustomData> replaced;
  for (int id : live) {
    const Node& n = g.node(id);
    if (n.kind != Node::Kind::Op) continue;
    if (auto op = channels_last_op(g, n, region, tune, target)) {
      region[static_cast<std::size_t>(id)] = 1;
      replaced.emplace(id, std::move(*op));
    }
  }
  if (replaced.empty()) return {graph, outputs};

  // Casts that only region nodes read, and that are not outputs: folded into their permute.
  const std::vector<int> uses = use_counts(g, outputs);
  std::vector<int> region_reads(g.nodes().size(), 0);
  for (int id : live)
    if (region[static_cast<std::size_t>(id)])
      for (int in : g.node(id).inputs) ++region_reads[static_cast<std::size_t>(in)];
  std::vector<char> folded(g.nodes().size(), 0);
  for (int id : live) {
    const Node& n = g.node(id);
    const auto u = static_cast<std::size_t>(id);
    if (n.kind != Node::Kind::Op || region[u] || n.op->op().name() != "pw.cast" || n.inputs.size() != 1) continue;
    auto converts = [](DType t) { return t == DType::F32 || t == DType::F16 || t == DType::BF16; };
    if (uses[u] > 0 && uses[u] == region_reads[u] && converts(n.dtype) && converts(g.node(n.inputs[0]).dtype))
      folded[u] = 1;
  }

  Rewriter rw(g);
  Graph& out = *rw.graph();
  std::map<int, int> nhwc_of, nchw_of;  // old id → new permute node
  auto unique_name = [&](const std::string& base) {
    std::string name = base;
    for (int k = 2; out.find(name) >= 0 || g.find(name) >= 0; ++k) name = base + "." + std::to_string(k);
    return name;
  };
  auto convert = [&](int old_id, bool to_last) {
    auto& cache = to_last ? nhwc_of : nchw_of;
    if (auto it = cache.find(old_id); it != cache.end()) return it->second;
    const Node& src = g.node(old_id);
    Node p;
    p.kind = Node::Kind::Op;
    p.name = unique_name(src.name + (to_last ? ".to_nhwc" : ".to_nchw"));
    p.dtype = src.dtype;
    p.shape = to_last ? to_nhwc(src.shape) : src.shape;
    std::vector<std::int64_t> dims =
        to_last ? std::vector<std::int64_t>{0, 2, 3, 1} : std::vector<std::int64_t>{0, 3, 1, 2};
    if (folded[static_cast<std::size_t>(old_id)]) {  // the cast's input, converted as it is copied
      p.op = ops::permute_op(std::move(dims), src.dtype);
      p.inputs = {rw.mapped(src.inputs[0])};
    } else {
      p.op = ops::permute_op(std::move(dims));
      p.inputs = {rw.mapped(old_id)};
    }
    const int fresh = out.add_node(std::move(p));
    cache.emplace(old_id, fresh);
    return fresh;
  };
  for (int id : live) {
    const Node& n = g.node(id);
    if (n.kind != Node::Kind::Op || folded[static_cast<std::size_t>(id)]) continue;
    const bool here = region[static_cast<std::size_t>(id)] != 0;
    Node copy = n;
    copy.inputs.clear();
    for (int in : n.inputs) {
      const bool there = region[static_cast<std::size_t>(in)] != 0;
      copy.inputs.push_back(here == there ? rw.mapped(in) : convert(in, here));
    }
    if (here) {
      copy.op = replaced.at(id);
      copy.shape = to_nhwc(n.shape);
    }
    rw.map(id, out.add_node(std::move(copy)));
  }
  GraphAndOutputs r{rw.graph(), {}};
  for (int o : outputs)
    r.outputs.push_back(region[static_cast<std::size_t>(o)] ? convert(o, false) : rw.mapped(o));
  // The symbolic shapes the pass wrote must be what the new ops infer.
  for (const auto& n : out.nodes()) {
    if (n.kind != Node::Kind::Op) continue;
    std::vector<Shape> in;
    for (int i : n.inputs) in.push_back(out.node(i).shape);
    const Shape s = n.op->op().infer_output_shape(in);
    if (!(s == n.shape))
      throw Error(n.label() + " channels-last pass: the op infers " + s.to_string() + ", the pass wrote " +
                  n.shape.to_string());
  }
  return r;
}

}  // namespace kg::passes
