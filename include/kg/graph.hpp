// Recording a model: a Graph of nodes, SymTensor handles, and name scopes.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kg/custom_op.hpp"
#include "kg/dtype.hpp"
#include "kg/shape.hpp"

namespace kg {

class Graph;

// One node of a graph: a model input, or an op applied to earlier nodes.
struct Node {
  enum class Kind { Input, Op };
  int id = -1;
  Kind kind = Kind::Op;
  std::string name;  // dotted, unique in the graph ("features.0")
  std::optional<CustomData> op;  // set for Kind::Op
  std::vector<int> inputs;       // ids of earlier nodes
  DType dtype = DType::F32;
  Shape shape;                   // symbolic output shape
  // The op's parameters with full dotted names ("features.0.weight"): CustomOp::parameters()
  // prefixed with the node name at record time. A fused node may own several nodes' parameters.
  std::vector<ParamSpec> params;

  // "nn.conv2d", or "input" for inputs.
  std::string op_name() const;
  // "[nn.conv2d @ features.0]" — the prefix of every error about this node.
  std::string label() const;
};

// A cheap handle to a node's output: node id, dtype, shape and the shared graph.
// Operations on it append nodes; nothing is computed.
class SymTensor {
 public:
  SymTensor() = default;
  SymTensor(std::shared_ptr<Graph> graph, int node);

  // Starts a graph with one input: `auto [x, graph] = SymTensor::input(DType::F32, {dynamic, 784});`
  static std::pair<SymTensor, std::shared_ptr<Graph>> input(DType dtype, Shape shape,
                                                            std::string name = "");

  // Records `data` with this tensor as first input, then `other_inputs`. `dtype` overrides the
  // op's output dtype; `name` is the node's name inside the current scope (default: derived
  // from the op's name). Shape errors name the op and the node.
  SymTensor record_custom(const CustomData& data, const std::vector<SymTensor>& other_inputs = {},
                          std::optional<DType> dtype = std::nullopt,
                          const std::string& name = "") const;

  int node() const { return node_; }
  DType dtype() const;
  const Shape& shape() const;
  std::size_t rank() const { return shape().rank(); }
  // The node's dotted name.
  const std::string& name() const;
  Graph& graph() const;
  const std::shared_ptr<Graph>& graph_ptr() const { return graph_; }
  bool valid() const { return graph_ != nullptr; }

 private:
  std::shared_ptr<Graph> graph_;
  int node_ = -1;
};

// A recorded graph. Nodes only refer to earlier nodes, so it is acyclic by construction and
// node order is a topological order.
class Graph : public std::enable_shared_from_this<Graph> {
 public:
  static std::shared_ptr<Graph> create();

  // Adds a model input. Names are unique; without one it is "input", "input_1", ...
  SymTensor input(DType dtype, Shape shape, std::string name = "");
  // Records an op node (SymTensor::record_custom is the usual way in).
  SymTensor record(const CustomData& data, const std::vector<SymTensor>& inputs,
                   std::optional<DType> dtype = std::nullopt, const std::string& name = "");

  // Appends a fully formed op node (for optimisation passes): its inputs must be earlier nodes
  // and its name unused. Returns its id.
  int add_node(Node node);
  // Gives parameter `index` of node `id` its full name and initial value, for importers whose
  // files name and hold the weights ("conv1.weight" from an ONNX initializer). The init must have
  // the parameter's size; the name must not be used by another parameter of the graph.
  void bind_param(int id, std::size_t index, std::string full_name, ParamInit init,
                  std::optional<bool> trainable = std::nullopt);

  const std::vector<Node>& nodes() const { return nodes_; }
  const Node& node(int id) const { return nodes_.at(static_cast<std::size_t>(id)); }
  // Ids of the input nodes, in the order they were added.
  const std::vector<int>& inputs() const { return inputs_; }
  // The node with this dotted name, or -1.
  int find(const std::string& name) const;

  // The current scope prefix ("features" or "") that new node names go under.
  std::string scope() const;
  void push_scope(std::string part);
  void pop_scope();

 private:
  Graph() = default;
  std::string unique_name(const std::string& wanted, const std::string& fallback_stem);
  std::vector<Node> nodes_;
  std::vector<int> inputs_;
  std::vector<std::string> scope_;
  std::unordered_map<std::string, int> by_name_;  // find() in constant time (node names never change)
};

// RAII name scope: nodes recorded while it lives get "<scope>." prefixed to their names.
class NameScope {
 public:
  NameScope(Graph& graph, std::string part);
  NameScope(const SymTensor& t, std::string part) : NameScope(t.graph(), std::move(part)) {}
  ~NameScope();
  NameScope(const NameScope&) = delete;
  NameScope& operator=(const NameScope&) = delete;

 private:
  Graph& graph_;
};

}  // namespace kg
