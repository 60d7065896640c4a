#include "kg/graph.hpp"

#include <set>

#include "graph/no_cpu_impl.hpp"
#include "graph/param_dtype.hpp"
#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg {

void narrow_param(ParamSpec& p, DType dtype) {
  if (p.dtype != DType::F32) return;
  p.dtype = dtype;
  if (p.init.kind != ParamInit::Kind::Data) return;
  std::int64_t n = 1;
  for (std::int64_t d : p.shape) n *= d;
  if (p.init.data.size() != static_cast<std::size_t>(n) * sizeof(float)) return;  // reported later
  Tensor f = Tensor::wrap(p.init.data.data(), DType::F32, p.shape);
  Tensor r = f.to(dtype);
  const auto* b = static_cast<const std::byte*>(r.raw());
  p.init.data.assign(b, b + r.nbytes());
}

std::string Node::op_name() const { return kind == Kind::Input ? "input" : op->name(); }
std::string Node::label() const { return "[" + op_name() + " @ " + name + "]"; }

// ---- SymTensor ----

SymTensor::SymTensor(std::shared_ptr<Graph> graph, int node) : graph_(std::move(graph)), node_(node) {}

std::pair<SymTensor, std::shared_ptr<Graph>> SymTensor::input(DType dtype, Shape shape,
                                                              std::string name) {
  auto g = Graph::create();
  SymTensor t = g->input(dtype, std::move(shape), std::move(name));
  return {t, g};
}

SymTensor SymTensor::record_custom(const CustomData& data, const std::vector<SymTensor>& other_inputs,
                                   std::optional<DType> dtype, const std::string& name) const {
  std::vector<SymTensor> ins;
  ins.reserve(other_inputs.size() + 1);
  ins.push_back(*this);
  ins.insert(ins.end(), other_inputs.begin(), other_inputs.end());
  return graph().record(data, ins, dtype, name);
}

Graph& SymTensor::graph() const {
  if (!graph_) throw Error("SymTensor: use of an empty (default-constructed) tensor");
  return *graph_;
}
DType SymTensor::dtype() const { return graph().node(node_).dtype; }
const Shape& SymTensor::shape() const { return graph().node(node_).shape; }
const std::string& SymTensor::name() const { return graph().node(node_).name; }

// ---- Graph ----

std::shared_ptr<Graph> Graph::create() { return std::shared_ptr<Graph>(new Graph()); }

std::string Graph::scope() const { return util::join(scope_, "."); }
void Graph::push_scope(std::string part) {
  if (part.empty()) throw Error("NameScope: empty scope name");
  scope_.push_back(std::move(part));
}
void Graph::pop_scope() {
  if (!scope_.empty()) scope_.pop_back();
}

int Graph::find(const std::string& name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? -1 : it->second;
}

std::string Graph::unique_name(const std::string& wanted, const std::string& stem) {
  const std::string prefix = scope().empty() ? "" : scope() + ".";
  if (!wanted.empty()) {
    std::string full = prefix + wanted;
    if (find(full) >= 0)
      throw Error(util::cat("node name '", full, "' is already used by node ", find(full),
                            " (", node(find(full)).op_name(), "); names must be unique"));
    return full;
  }
  std::string full = prefix + stem;
  for (int k = 1; find(full) >= 0; ++k) full = util::cat(prefix, stem, "_", k);
  return full;
}

SymTensor Graph::input(DType dtype, Shape shape, std::string name) {
  Node n;
  n.id = static_cast<int>(nodes_.size());
  n.kind = Node::Kind::Input;
  try {
    n.name = unique_name(name, "input");
  } catch (const Error& e) {
    throw Error(util::cat("[input @ ", scope().empty() ? "" : scope() + ".", name.empty() ? "input" : name,
                          "] ", e.what()));
  }
  n.dtype = dtype;
  n.shape = std::move(shape);
  by_name_.emplace(n.name, n.id);
  nodes_.push_back(std::move(n));
  inputs_.push_back(nodes_.back().id);
  return SymTensor(shared_from_this(), nodes_.back().id);
}

SymTensor Graph::record(const CustomData& data, const std::vector<SymTensor>& inputs,
                        std::optional<DType> dtype, const std::string& name) {
  const std::string op_name = data.name();
  std::string stem = op_name.substr(op_name.rfind('.') == std::string::npos ? 0 : op_name.rfind('.') + 1);
  if (stem.empty()) stem = "op";
  Node n;
  n.id = static_cast<int>(nodes_.size());
  n.kind = Node::Kind::Op;
  try {
    n.name = unique_name(name, stem);
  } catch (const Error& e) {  // a duplicate name: say which op wanted it
    throw Error(util::cat("[", op_name, " @ ", scope().empty() ? "" : scope() + ".", name, "] ", e.what()));
  }
  n.op = data;
  const std::string label = n.label();

  std::vector<Shape> shapes;
  std::vector<DType> dtypes;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const SymTensor& t = inputs[i];
    if (!t.valid()) throw Error(util::cat(label, " input ", i, " is an empty tensor"));
    if (&t.graph() != this)
      throw Error(util::cat(label, " input ", i, " ('", t.name(), "') belongs to another graph"));
    n.inputs.push_back(t.node());
    shapes.push_back(t.shape());
    dtypes.push_back(t.dtype());
  }
  try {
    n.shape = data->infer_output_shape(shapes);
    n.dtype = dtype ? *dtype : data->infer_output_dtype(dtypes);
    n.params = data->parameters(shapes);
    for (std::size_t i = 0; i < n.params.size(); ++i) {
      if (n.params[i].name.empty()) throw Error(util::cat("parameter ", i, " has an empty name"));
      follow_input_dtype(n.params[i], dtypes);
      n.params[i].name = n.name + "." + n.params[i].name;
    }
    // An op computing in f16 or bf16 keeps its floating parameters in that dtype too.
    if (is_half_float(n.dtype) && data->computes_in(n.dtype))
      for (ParamSpec& p : n.params) narrow_param(p, n.dtype);
  } catch (const Error& e) {
    throw Error(label + " " + e.what());
  } catch (const std::exception& e) {
    throw Error(label + " shape inference failed: " + e.what());
  }
  std::set<std::string> seen;
  for (const auto& p : n.params) {
    if (p.name.empty() || !seen.insert(p.name).second)
      throw Error(util::cat(label, " parameter names must be unique and non-empty ('", p.name, "')"));
    for (auto s : p.shape)
      if (s < 0) throw Error(label + " parameter '" + p.name + "' has a negative size");
    if (p.init.kind == ParamInit::Kind::Data) {
      const auto want = static_cast<std::size_t>(numel_of(p.shape)) * dtype_size(p.dtype);
      if (p.init.data.size() != want)
        throw Error(util::cat(label, " parameter '", p.name, "': init data is ", p.init.data.size(),
                              " bytes but ", sizes_to_string(p.shape), " × ", dtype_name(p.dtype), " needs ", want));
    }
  }
  by_name_.emplace(n.name, n.id);
  nodes_.push_back(std::move(n));
  return SymTensor(shared_from_this(), nodes_.back().id);
}

int Graph::add_node(Node n) {
  n.id = static_cast<int>(nodes_.size());
  if (n.kind != Node::Kind::Op || !n.op) throw Error("Graph::add_node: only op nodes can be added");
  for (int in : n.inputs)
    if (in < 0 || in >= n.id) throw Error(util::cat(n.label(), " Graph::add_node: input ", in, " is not an earlier node"));
  if (find(n.name) >= 0) throw Error(util::cat(n.label(), " Graph::add_node: name already used"));
  by_name_.emplace(n.name, n.id);
  nodes_.push_back(std::move(n));
  return nodes_.back().id;
}

void Graph::bind_param(int id, std::size_t index, std::string full_name, ParamInit init,
                       std::optional<bool> trainable) {
  if (id < 0 || static_cast<std::size_t>(id) >= nodes_.size() || nodes_[static_cast<std::size_t>(id)].kind != Node::Kind::Op)
    throw Error(util::cat("Graph::bind_param: no op node ", id));
  Node& n = nodes_[static_cast<std::size_t>(id)];
  if (index >= n.params.size())
    throw Error(util::cat(n.label(), " has ", n.params.size(), " parameters; cannot bind parameter ", index,
                          " to '", full_name, "'"));
  ParamSpec& p = n.params[index];
  if (full_name.empty()) throw Error(n.label() + " Graph::bind_param: empty parameter name");
  for (const auto& other : nodes_)
    for (std::size_t k = 0; k < other.params.size(); ++k)
      if (other.params[k].name == full_name && !(other.id == id && k == index))
        throw Error(util::cat(n.label(), " parameter '", full_name, "' is already a parameter of ", other.label()));
  if (init.kind == ParamInit::Kind::Data) {
    const auto want = static_cast<std::size_t>(numel_of(p.shape)) * dtype_size(p.dtype);
    if (init.data.size() != want)
      throw Error(util::cat(n.label(), " parameter '", full_name, "' (", p.name, "): ", init.data.size(),
                            " bytes of data but ", sizes_to_string(p.shape), " × ", dtype_name(p.dtype), " needs ", want));
  }
  p.name = std::move(full_name);
  p.init = std::move(init);
  if (trainable) p.trainable = *trainable;
}

NameScope::NameScope(Graph& graph, std::string part) : graph_(graph) { graph_.push_scope(std::move(part)); }
NameScope::~NameScope() { graph_.pop_scope(); }

// ---- CustomOp defaults ----

DType CustomOp::infer_output_dtype(const std::vector<DType>& input_dtypes) const {
  if (input_dtypes.empty()) throw Error("op has no inputs; give record_custom an output dtype");
  return input_dtypes.front();
}

NoCpuImplementation::NoCpuImplementation()
    : Error("has no CPU implementation (override CustomOp::cpu_forward)") {}

void CustomOp::cpu_forward(CpuContext&) const { throw NoCpuImplementation(); }

std::vector<ParamSpec> CustomOp::parameters(const std::vector<Shape>&) const { return {}; }
std::optional<Lowered> CustomOp::lower(const LowerContext&) const { return std::nullopt; }
std::string CustomOp::lower_backward_source(const LowerContext&) const { return {}; }
std::optional<ElementwiseForm> CustomOp::elementwise_form(const std::vector<DType>&) const {
  return std::nullopt;
}
SymTensor CustomOp::split(const std::vector<SymTensor>&, const std::string&) const { return {}; }

void CustomOp::cpu_backward(CpuBackwardContext&) const {
  throw Error("has no CPU backward (override CustomOp::cpu_backward and has_cpu_backward)");
}

CpuBackwardContext::CpuBackwardContext(std::span<const Tensor> in, std::span<const Tensor> ps, Tensor out,
                                       Tensor grad_out, std::span<Tensor> grad_in, std::span<Tensor> grad_ps,
                                       bool train, std::uint64_t s)
    : CpuContext(in, ps, std::move(out), train, s),
      grad_output(std::move(grad_out)),
      grad_inputs(grad_in),
      grad_params(grad_ps) {}

CustomData::CustomData(std::shared_ptr<const CustomOp> op) : op_(std::move(op)) {
  if (!op_) throw Error("CustomData: null op");
}

std::ostream& operator<<(std::ostream& os, const CustomData& d) {
  os << d.name();
  auto a = d->attributes();
  if (!a.empty()) os << "(" << a << ")";
  return os;
}

}  // namespace kg
