// ONNX import: an .onnx file becomes a kg::Model. Graph inputs keep their dynamic dims (named by
// the file's dim_param, "batch"), initializers become parameters under their ONNX names (so
// state_dict() and safetensors files round-trip by name), shape arithmetic (Shape → Gather →
// Concat → Reshape) is evaluated symbolically so an exported model keeps its dynamic batch, and
// nodes of any domain can be served by a user's CustomOp through an OpRegistry.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kg/custom_op.hpp"
#include "kg/error.hpp"
#include "kg/model.hpp"
#include "kg/tensor.hpp"

namespace kg::onnx {

// One attribute of a node, typed as the file stores it.
struct Attribute {
  enum class Kind { Int, Float, String, Tensor, Ints, Floats, Strings, Graph, Other };
  Kind kind = Kind::Other;
  std::int64_t i = 0;
  double f = 0.0;
  std::string s;
  kg::Tensor t;
  std::vector<std::int64_t> ints;
  std::vector<double> floats;
  std::vector<std::string> strings;
};

// A node's attributes by name. The getters throw a kg::Error naming the node and the attribute
// when it is missing (without a default) or has another kind.
class Attributes {
 public:
  Attributes() = default;
  Attributes(std::string node_label, std::map<std::string, Attribute> attributes)
      : label_(std::move(node_label)), attrs_(std::move(attributes)) {}
  bool has(const std::string& name) const { return attrs_.count(name) != 0; }
  std::int64_t get_int(const std::string& name) const;
  std::int64_t get_int(const std::string& name, std::int64_t fallback) const;
  double get_float(const std::string& name) const;
  double get_float(const std::string& name, double fallback) const;
  std::string get_string(const std::string& name) const;
  std::string get_string(const std::string& name, const std::string& fallback) const;
  kg::Tensor get_tensor(const std::string& name) const;
  std::vector<std::int64_t> get_ints(const std::string& name) const;
  std::vector<std::int64_t> get_ints(const std::string& name, const std::vector<std::int64_t>& fallback) const;
  std::vector<double> get_floats(const std::string& name) const;
  std::vector<double> get_floats(const std::string& name, const std::vector<double>& fallback) const;
  std::vector<std::string> get_strings(const std::string& name) const;
  const std::map<std::string, Attribute>& all() const { return attrs_; }

 private:
  const Attribute& find(const std::string& name, Attribute::Kind kind) const;
  std::string label_;
  std::map<std::string, Attribute> attrs_;
};

// What a factory is told about the node it replaces.
struct NodeInfo {
  std::string name;     // the node's name in the file (may be empty)
  std::string domain;   // "" for the standard domain
  std::string op_type;  // "RmsNorm"
  int opset = 0;        // the opset the file imports for this domain
  Attributes attributes;
  std::vector<std::string> inputs, outputs;  // value names; "" for an omitted optional input
  // The activation inputs the op will get, in order: every input that is not an initializer
  // (initializers fill the op's declared parameters, see OpRegistry).
  std::vector<Shape> input_shapes;
  std::vector<DType> input_dtypes;
};

using OpFactory = std::function<CustomData(const NodeInfo&)>;

// Maps (domain, op_type) to a factory of the CustomOp that serves such nodes. A node's inputs
// that are initializers of the file fill the op's declared parameters (CustomOp::parameters()) in
// order, keeping their ONNX names and values; its other inputs are the op's inputs, in order. The
// node must have exactly one output. Registering a standard op ("" domain, e.g.
// "LayerNormalization") replaces kernelgraph's own conversion of it.
class OpRegistry {
 public:
  // "ai.onnx" is the same as "".
  void add(std::string domain, std::string op_type, OpFactory factory);
  const OpFactory* find(const std::string& domain, const std::string& op_type) const;
  bool empty() const { return factories_.empty(); }

 private:
  std::map<std::pair<std::string, std::string>, OpFactory> factories_;
};

struct ImportOptions {
  // Custom ops by domain and op type (may also replace standard ones).
  const OpRegistry* registry = nullptr;
  // Inference or training lowering of the Model, and its optimisation (ModelOptions::fusion).
  LoweringMode mode = LoweringMode::Inference;
  ModelOptions model;
  // Values of graph inputs known at import (they become constants): for models that compute a
  // shape from an input (a Reshape whose target shape is a graph input).
  std::map<std::string, kg::Tensor> input_values;
  // Whether float initializers are trainable parameters (else they are frozen buffers).
  bool trainable_initializers = true;
};

// Thrown when the model computes a shape from graph inputs (a Reshape whose target shape is an
// input): the message says which, and `inputs` names them, for ImportOptions::input_values.
struct InputValuesNeeded : Error {
  InputValuesNeeded(const std::string& what, std::vector<std::string> names) : Error(what), inputs(std::move(names)) {}
  std::vector<std::string> inputs;
};

// The standard op types the importer converts (ai.onnx domain).
std::vector<std::string> supported_ops();

// Reads and converts the file (external-data files are read from its folder). Any problem — a
// file that is not ONNX, truncated or inconsistent, an op that cannot be imported (all of them
// listed at once, with counts and the first node of each) — is a kg::Error naming the file.
Model import(const std::string& path, const ImportOptions& options = {});
// The same from bytes in memory; `name` stands for the file in errors, and external data is read
// relative to `base_dir`.
Model import_bytes(const std::string& bytes, const std::string& name, const ImportOptions& options = {},
                   const std::string& base_dir = ".");

// The recorded graph of a file and its outputs by ONNX name, before a Model is made of it: for
// adding to it (a loss to train the imported model, a second head) and then building the Model.
struct ImportedGraph {
  std::shared_ptr<Graph> graph;
  std::vector<std::pair<std::string, SymTensor>> outputs;
  // The SymTensor of the output with this name (throws for an unknown name, listing the outputs).
  SymTensor output(const std::string& name) const;
};
ImportedGraph import_graph(const std::string& path, const ImportOptions& options = {});
ImportedGraph import_graph_bytes(const std::string& bytes, const std::string& name, const ImportOptions& options = {},
                                 const std::string& base_dir = ".");

// A graph input of a file: its name, dtype and symbolic shape.
struct InputInfo {
  std::string name;
  DType dtype;
  Shape shape;
};
// The inputs of the imported Model in order (its graph inputs that are not initializers).
std::vector<InputInfo> model_inputs(const Model& model);

// Reads a serialized ONNX TensorProto (a test-data .pb file) into a tensor.
kg::Tensor read_tensor_file(const std::string& path);

}  // namespace kg::onnx
