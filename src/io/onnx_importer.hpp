// The ONNX importer's inner vocabulary: values (a graph tensor, a constant known at import, or a
// shape computed symbolically), the context a converter of one node works in, and the table of
// converters of the standard ops (onnx_convert.cpp).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "kg/graph.hpp"
#include "io/onnx_tensor.hpp"
#include "kg/onnx.hpp"
#include "ops/dim_ref.hpp"

namespace kg::onnx::detail {

// The newest opset of the standard domain (ai.onnx) the importer knows: files that import a newer
// one are refused with what to do. The converters follow each op's versions up to it.
constexpr int kMaxStandardOpset = 21;

// One element of a shape value: a size known at import, or dim `axis` of a graph tensor, or a
// size only known at run time (a product of dynamic dims, say).
struct SymDim {
  enum class Kind { Known, DimOf, Unknown };
  Kind kind = Kind::Known;
  std::int64_t value = 0;
  SymTensor src;
  int axis = 0;
  static SymDim known(std::int64_t v) { return {Kind::Known, v, {}, 0}; }
  static SymDim unknown() { return {Kind::Unknown, 0, {}, 0}; }
  static SymDim dim_of(const SymTensor& t, int axis);  // Known when that dim is static
  bool is_known() const { return kind == Kind::Known; }
  std::string to_string() const;
};

// A value of the ONNX graph.
struct Value {
  std::string name;
  std::optional<Tensor> constant;           // known at import
  std::optional<std::vector<SymDim>> dims;  // an i64 shape value (1-D, or 0-D when scalar_dims)
  bool scalar_dims = false;
  SymTensor tensor;                         // in the graph (made on demand for constants and dims)
  bool initializer = false;                 // a float initializer: a parameter when materialised
  bool graph_input = false;                 // a graph input (not an initializer)

  bool is_constant() const { return constant.has_value(); }
  DType dtype() const;
  // The symbolic shape (a constant's is static).
  Shape shape() const;
};

using NeedsValue = InputValuesNeeded;

class Importer;

// What a converter of one node gets.
class NodeContext {
 public:
  NodeContext(Importer& imp, const ::onnx::NodeProto& node, std::vector<Value*> inputs, Attributes attrs,
              std::string label, int opset);
  const ::onnx::NodeProto& node;
  std::vector<Value*> inputs;  // nullptr where an optional input is omitted
  Attributes attrs;
  std::string label;  // "[onnx Conv @ /conv1/Conv]"
  int opset;

  std::size_t num_inputs() const { return inputs.size(); }
  bool has_input(std::size_t i) const { return i < inputs.size() && inputs[i] != nullptr; }
  Value& in(std::size_t i) const;
  // Input i as a graph tensor (a constant becomes an nn.constant node, dims an index.shape node).
  SymTensor tensor(std::size_t i);
  // Input i's value, which must be known at import; `what` says what it is for.
  const Tensor& constant(std::size_t i, const char* what);
  // Input i as integers (known at import), e.g. axes or pads: an integer tensor of rank 0 or 1.
  std::vector<std::int64_t> ints(std::size_t i, const char* what);
  // Input i's one value (known at import), e.g. Clip's minimum: a tensor of one element.
  double scalar(std::size_t i, const char* what);
  // Input i as a shape value: known, or symbolic dims; nullopt when neither.
  std::optional<std::vector<SymDim>> dims(std::size_t i) const;
  // A unique node name for the graph, derived from the ONNX node's name and `suffix`.
  std::string node_name(const std::string& suffix = "");
  Graph& graph();
  Importer& importer() { return imp_; }
  // Throws an error that starts with the node's label.
  [[noreturn]] void fail(const std::string& why) const;

  // Turns shape values into DimRefs over `sources` (tensors appended as the op's shape inputs,
  // starting at input `first`), or nullopt when a dim is unknown at import.
  std::optional<std::vector<ops::DimRef>> dim_refs(const std::vector<SymDim>& d, std::vector<SymTensor>& sources,
                                                   int first);

 private:
  Importer& imp_;
};

// Checked integer arithmetic for converters: the result, or the node's error naming `what` and
// the numbers when it does not fit in 64 bits (or divides by zero). Every size or attribute a
// file gives goes through these before it is combined with another.
std::int64_t checked_add(const NodeContext& c, std::int64_t a, std::int64_t b, const char* what);
std::int64_t checked_sub(const NodeContext& c, std::int64_t a, std::int64_t b, const char* what);
std::int64_t checked_mul(const NodeContext& c, std::int64_t a, std::int64_t b, const char* what);
std::int64_t checked_div(const NodeContext& c, std::int64_t a, std::int64_t b, const char* what);
// A double from the file as an integer: the node's error when it is not finite or out of range.
std::int64_t checked_int(const NodeContext& c, double v, const char* what);

// `name` quoted for a message, its control characters escaped: 'name'.
std::string quote_name(const std::string& name);

using Converter = std::function<std::vector<Value>(NodeContext&)>;

// The standard-domain converters by op type.
const std::map<std::string, Converter>& standard_converters();

// Values of outputs made by converters.
Value tensor_value(const SymTensor& t);
Value constant_value(Tensor t);
Value dims_value(std::vector<SymDim> d, bool scalar = false);

// Materialises a value as a graph tensor (shared by NodeContext::tensor).
SymTensor materialize(Importer& imp, Value& v, const std::string& name_hint);

}  // namespace kg::onnx::detail
