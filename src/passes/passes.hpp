// Optimisation passes: each takes a graph and its output node ids and returns a rewritten
// graph with the outputs remapped. Passes never change what the outputs compute.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "kg/graph.hpp"
#include "kg/model.hpp"
#include "ops/fused_elementwise.hpp"

namespace kg::passes {

struct GraphAndOutputs {
  std::shared_ptr<Graph> graph;
  std::vector<int> outputs;
};

// Builds a new graph from an old one: copies the inputs, then nodes one at a time with their
// input ids remapped. A pass copies what it keeps and adds fused nodes in place of patterns.
class Rewriter {
 public:
  explicit Rewriter(const Graph& old);
  // Copies old node `id` (its inputs must have been copied or replaced already).
  int copy(int id);
  // Adds a node built by the pass; `old_inputs` are ids in the old graph.
  int add(Node node, const std::vector<int>& old_inputs);
  // Records that old node `old_id` is now computed by new node `new_id`.
  void map(int old_id, int new_id) { map_.at(static_cast<std::size_t>(old_id)) = new_id; }
  int mapped(int old_id) const { return map_.at(static_cast<std::size_t>(old_id)); }
  // The graph being built.
  const std::shared_ptr<Graph>& graph() const { return graph_; }
  const Graph& old() const { return old_; }
  // The new graph and the old outputs remapped.
  GraphAndOutputs finish(const std::vector<int>& old_outputs);

 private:
  const Graph& old_;
  std::shared_ptr<Graph> graph_;
  std::vector<int> map_;
};

// For each node, how many nodes (and model outputs) consume it.
std::vector<int> use_counts(const Graph& graph, const std::vector<int>& outputs);

// The graph without the nodes that no output depends on (`graph` itself when there are none).
GraphAndOutputs without_dead_nodes(std::shared_ptr<Graph> graph, std::vector<int> outputs);

// True unless KG_NO_FUSION is set to anything but "" or "0".
bool fusion_enabled_by_env();

// Runs the passes for `mode` in order; with options.fusion false (or KG_NO_FUSION set to anything
// but "" or "0") none of the fusion passes runs.
GraphAndOutputs optimize(std::shared_ptr<Graph> graph, std::vector<int> outputs, LoweringMode mode,
                         const ModelOptions& options = {});

// The passes themselves (each in its own file).
// Where a channels-last graph runs: the CPU (oneDNN: f32 convolutions), or a GPU (cuDNN on tensor
// cores: f16 and bf16 convolutions, and f32 ones where `tf32` allows TF32).
struct ChannelsLastTarget {
  bool gpu = false;
  bool tf32 = false;
};
// At load, in inference: the target's convolutions and the pooling and elementwise nodes between
// them run on channels-last activations, with nn.permute nodes at the edges. Returns `graph`
// itself when nothing is rewritten (no such convolution, or, on the CPU, no oneDNN). With `tune`,
// on the CPU each convolution times oneDNN's implementations at its first run and keeps the fastest.
GraphAndOutputs channels_last(const std::shared_ptr<Graph>& graph, const std::vector<int>& outputs,
                              bool tune = false, const ChannelsLastTarget& target = {});
// Inference only (in training the graph is copied unchanged): the exporters' attention chain,
// MatMul(q, kᵀ) → [scale] → [Add(mask)] → Softmax(last dim) → MatMul(·, v), whose inner values
// nothing else reads, becomes one nn.attention node (passes/fuse_attention.cpp says exactly what).
GraphAndOutputs fuse_attention(const Graph& graph, const std::vector<int>& outputs, LoweringMode mode);
// Inference only: conv2d → batch_norm2d → (relu) and conv2d → relu become one fused conv.
GraphAndOutputs fuse_conv_epilogue(const Graph& graph, const std::vector<int>& outputs);
// Nodes whose op splits (CustomOp::split) are replaced by what the split records. Runs first,
// with or without fusion.
GraphAndOutputs split_nodes(const Graph& graph, const std::vector<int>& outputs);
// Groups of elementwise nodes (ops with an ElementwiseForm) become kg.fused_elementwise nodes.
GraphAndOutputs fuse_elementwise(const Graph& graph, const std::vector<int>& outputs, LoweringMode mode);
// Inference only (in training the graph is copied unchanged): an elementwise group, or a lone
// fusable node, whose value only a reduction taking a prologue reads (softmax, layer norm,
// reduce.<fn>; ops/prologue.hpp) and which is not a model output becomes the reduction's prologue:
// the two become one kg.fused_reduction node with the reduction's name.
GraphAndOutputs fuse_prologue(const Graph& graph, const std::vector<int>& outputs, LoweringMode mode);
// The per-element form of node `n` when it may be fused in `mode` (one dtype, f32 or f64, no
// parameters, output the broadcast of its inputs; in training a derivative and no broadcasting).
std::optional<ElementwiseForm> fusable_form(const Graph& g, const Node& n, LoweringMode mode);
// What an inference node computes as an elementwise group with one output: a kg.fused_elementwise
// node's members, or a lone fusable node as a group of one; nothing for any other node.
struct ElementwiseGroup {
  std::vector<ops::FusedMember> members;
  int inputs = 0;               // group inputs (each of the node's distinct inputs once)
  std::vector<int> old_inputs;  // the node ids they are, in group input order
};
std::optional<ElementwiseGroup> elementwise_group(const Graph& g, const Node& n);
// Inference only (in training the graph is copied unchanged): a GEMM that takes an epilogue
// (nn.linear, nn.matmul; ops/epilogue.hpp) whose value only an elementwise group (or a lone
// fusable node) of the same shape reads, and which is not a model output, becomes one
// kg.fused_gemm node with the GEMM's name and parameters that stores through the group.
GraphAndOutputs fuse_gemm_epilogue(const Graph& graph, const std::vector<int>& outputs, LoweringMode mode);
// At load, for inference in a reduced precision (LoadOptions::precision, f16 or bf16): every f32
// node whose op computes in that dtype (CustomOp::computes_in), every fused elementwise group and
// every lone fusable node runs in it, with its f32 parameters converted; the other nodes keep f32,
// with a cast inserted once per value wherever the two meet. Inputs and outputs keep their
// recorded dtypes. Returns `graph` itself when no node runs in the reduced precision.
GraphAndOutputs reduce_precision(const std::shared_ptr<Graph>& graph, const std::vector<int>& outputs,
                                 DType precision);

}  // namespace kg::passes
