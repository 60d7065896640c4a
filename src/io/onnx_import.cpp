// ONNX import (kg/onnx.hpp): reads the ModelProto, turns graph inputs and initializers into
// values, orders the nodes, lists unsupported ops, converts each node (the standard ones by
// onnx_convert.cpp, registered ones into the user's CustomOp), folds nodes whose inputs are all
// known by running them on the CPU, and names the outputs.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>
#include <new>
#include <queue>
#include <stdexcept>

#include "io/onnx_importer.hpp"
#include "io/onnx_tensor.hpp"
#include "kg/onnx.hpp"
#include "kg/ops.hpp"
#include "ops/constant.hpp"
#include "ops/index_ops.hpp"
#include "util/str.hpp"

namespace kg::onnx {

using detail::quote_name;

// The largest ir_version accepted: ONNX's newest is 11 (ONNX 1.18); this leaves room for later
// ones while refusing numbers no release has (a damaged or hostile file).
constexpr std::int64_t kMaxIrVersion = 64;

// ---- Attributes ----

namespace {
const char* kind_name(Attribute::Kind k) {
  switch (k) {
    case Attribute::Kind::Int: return "int";
    case Attribute::Kind::Float: return "float";
    case Attribute::Kind::String: return "string";
    case Attribute::Kind::Tensor: return "tensor";
    case Attribute::Kind::Ints: return "ints";
    case Attribute::Kind::Floats: return "floats";
    case Attribute::Kind::Strings: return "strings";
    case Attribute::Kind::Graph: return "graph";
    default: return "other";
  }
}
}  // namespace

const Attribute& Attributes::find(const std::string& name, Attribute::Kind kind) const {
  auto it = attrs_.find(name);
  if (it == attrs_.end()) throw Error(util::cat(label_, " has no attribute ", quote_name(name)));
  if (it->second.kind != kind)
    throw Error(util::cat(label_, " attribute ", quote_name(name), " is ", kind_name(it->second.kind), ", expected ",
                          kind_name(kind)));
  return it->second;
}
std::int64_t Attributes::get_int(const std::string& n) const { return find(n, Attribute::Kind::Int).i; }
std::int64_t Attributes::get_int(const std::string& n, std::int64_t d) const { return has(n) ? get_int(n) : d; }
double Attributes::get_float(const std::string& n) const { return find(n, Attribute::Kind::Float).f; }
double Attributes::get_float(const std::string& n, double d) const { return has(n) ? get_float(n) : d; }
std::string Attributes::get_string(const std::string& n) const { return find(n, Attribute::Kind::String).s; }
std::string Attributes::get_string(const std::string& n, const std::string& d) const {
  return has(n) ? get_string(n) : d;
}
Tensor Attributes::get_tensor(const std::string& n) const { return find(n, Attribute::Kind::Tensor).t; }
std::vector<std::int64_t> Attributes::get_ints(const std::string& n) const { return find(n, Attribute::Kind::Ints).ints; }
std::vector<std::int64_t> Attributes::get_ints(const std::string& n, const std::vector<std::int64_t>& d) const {
  return has(n) ? get_ints(n) : d;
}
std::vector<double> Attributes::get_floats(const std::string& n) const { return find(n, Attribute::Kind::Floats).floats; }
std::vector<double> Attributes::get_floats(const std::string& n, const std::vector<double>& d) const {
  return has(n) ? get_floats(n) : d;
}
std::vector<std::string> Attributes::get_strings(const std::string& n) const {
  return find(n, Attribute::Kind::Strings).strings;
}

// ---- OpRegistry ----

namespace {
std::string canonical_domain(std::string d) { return d == "ai.onnx" ? std::string() : d; }
}  // namespace

void OpRegistry::add(std::string domain, std::string op_type, OpFactory factory) {
  if (op_type.empty()) throw Error("OpRegistry::add: empty op type");
  if (!factory) throw Error("OpRegistry::add: empty factory for " + op_type);
  factories_[{canonical_domain(std::move(domain)), std::move(op_type)}] = std::move(factory);
}
const OpFactory* OpRegistry::find(const std::string& domain, const std::string& op_type) const {
  auto it = factories_.find({canonical_domain(domain), op_type});
  return it == factories_.end() ? nullptr : &it->second;
}

namespace detail {

// ---- values ----

SymDim SymDim::dim_of(const SymTensor& t, int axis) {
  const Dim& d = t.shape()[static_cast<std::size_t>(axis)];
  if (d.is_static()) return known(d.size());
  return {Kind::DimOf, 0, t, axis};
}
std::string SymDim::to_string() const {
  switch (kind) {
    case Kind::Known: return std::to_string(value);
    case Kind::DimOf: return util::cat(src.name(), ".dim", axis, "(", src.shape()[static_cast<std::size_t>(axis)].to_string(), ")");
    default: return "?";
  }
}

DType Value::dtype() const {
  if (constant) return constant->dtype();
  if (dims) return DType::I64;
  return tensor.dtype();
}
Shape Value::shape() const {
  if (constant) return Shape::of(constant->shape());
  if (dims) return scalar_dims ? Shape{} : Shape{static_cast<std::int64_t>(dims->size())};
  return tensor.shape();
}

Value tensor_value(const SymTensor& t) {
  Value v;
  v.tensor = t;
  return v;
}
Value constant_value(Tensor t) {
  Value v;
  v.constant = std::move(t);
  return v;
}
Value dims_value(std::vector<SymDim> d, bool scalar) {
  // Fully known: a plain constant.
  if (std::all_of(d.begin(), d.end(), [](const SymDim& s) { return s.is_known(); })) {
    std::vector<std::int64_t> vals;
    for (const auto& s : d) vals.push_back(s.value);
    return constant_value(scalar ? Tensor::from_vector<std::int64_t>({}, vals)
                                 : Tensor::from_vector<std::int64_t>({static_cast<std::int64_t>(vals.size())}, vals));
  }
  Value v;
  v.dims = std::move(d);
  v.scalar_dims = scalar;
  return v;
}

// ---- the importer ----

class Importer {
 public:
  Importer(std::shared_ptr<Graph> graph, const ImportOptions& options, std::string file, ExternalFiles& external,
           bool folding)
      : graph_(std::move(graph)), options_(options), file_(std::move(file)), external_(external), folding_(folding) {}

  Graph& graph() { return *graph_; }
  const std::shared_ptr<Graph>& graph_ptr() { return graph_; }
  const ImportOptions& options() const { return options_; }
  const std::string& file() const { return file_; }
  bool folding() const { return folding_; }
  std::map<std::string, int>& opsets() { return opsets_; }

  std::string unique_name(std::string want) {
    if (want.empty()) want = "node";
    std::string n = want;
    for (int k = 1; used_names_.count(n) || graph_->find(n) >= 0; ++k) n = util::cat(want, "_", k);
    used_names_.insert(n);
    return n;
  }

  // In folding mode, graph inputs stand for the constants and hold their data.
  std::vector<Tensor>& fold_inputs() { return fold_inputs_; }

  void convert_model(const ::onnx::ModelProto& model);
  ImportedGraph finish(const ::onnx::GraphProto& g);

  std::vector<Value> convert_node(const ::onnx::NodeProto& node, std::vector<Value*> inputs);

 private:
  Attributes read_attributes(const ::onnx::NodeProto& node, const std::string& label);
  std::vector<Value> convert_custom(const OpFactory& factory, NodeContext& ctx);
  std::optional<std::vector<Value>> try_fold(const ::onnx::NodeProto& node, const std::vector<Value*>& inputs);
  std::string node_label(const ::onnx::NodeProto& node) const;

  std::shared_ptr<Graph> graph_;
  const ImportOptions& options_;
  std::string file_;
  ExternalFiles& external_;
  bool folding_;
  std::map<std::string, int> opsets_;
  std::set<std::string> used_names_;
  std::vector<Tensor> fold_inputs_;

 public:
  std::map<std::string, Value> values;
};

std::string Importer::node_label(const ::onnx::NodeProto& node) const {
  const std::string op = node.domain().empty() || node.domain() == "ai.onnx"
                             ? node.op_type()
                             : node.domain() + "." + node.op_type();
  return util::cat("[onnx ", util::printable(op), " @ ", node.name().empty() ? "(unnamed)" : util::printable(node.name()),
                   "]");
}

Attributes Importer::read_attributes(const ::onnx::NodeProto& node, const std::string& label) {
  std::map<std::string, Attribute> out;
  for (const auto& a : node.attribute()) {
    Attribute x;
    using A = ::onnx::AttributeProto;
    switch (a.type()) {
      case A::INT: x.kind = Attribute::Kind::Int; x.i = a.i(); break;
      case A::FLOAT: x.kind = Attribute::Kind::Float; x.f = a.f(); break;
      case A::STRING: x.kind = Attribute::Kind::String; x.s = a.s(); break;
      case A::TENSOR:
        x.kind = Attribute::Kind::Tensor;
        x.t = to_tensor(a.t(), util::cat("ONNX file ", quote_name(file_), ": ", label, " attribute ", quote_name(a.name())),
                        external_);
        break;
      case A::INTS: x.kind = Attribute::Kind::Ints; x.ints.assign(a.ints().begin(), a.ints().end()); break;
      case A::FLOATS: x.kind = Attribute::Kind::Floats; x.floats.assign(a.floats().begin(), a.floats().end()); break;
      case A::STRINGS: x.kind = Attribute::Kind::Strings; x.strings.assign(a.strings().begin(), a.strings().end()); break;
      case A::GRAPH:
      case A::GRAPHS: x.kind = Attribute::Kind::Graph; break;
      default: x.kind = Attribute::Kind::Other; break;
    }
    out[a.name()] = std::move(x);
  }
  return Attributes(label, std::move(out));
}

std::vector<Value> Importer::convert_custom(const OpFactory& factory, NodeContext& ctx) {
  NodeInfo info;
  const auto& node = ctx.node;
  info.name = node.name();
  info.domain = canonical_domain(node.domain());
  info.op_type = node.op_type();
  auto it = opsets_.find(info.domain);
  info.opset = it == opsets_.end() ? 0 : it->second;
  info.attributes = ctx.attrs;
  info.inputs.assign(node.input().begin(), node.input().end());
  info.outputs.assign(node.output().begin(), node.output().end());
  std::vector<std::size_t> activations, initializers;
  for (std::size_t i = 0; i < ctx.num_inputs(); ++i) {
    if (!ctx.has_input(i)) continue;
    (ctx.in(i).initializer && ctx.in(i).is_constant() ? initializers : activations).push_back(i);
  }
  std::vector<SymTensor> ins;
  for (std::size_t i : activations) {
    ins.push_back(ctx.tensor(i));
    info.input_shapes.push_back(ins.back().shape());
    info.input_dtypes.push_back(ins.back().dtype());
  }
  if (node.output_size() != 1) ctx.fail(util::cat("has ", node.output_size(), " outputs; a custom op has one"));
  CustomData data = [&] {
    try {
      return factory(info);
    } catch (const Error& e) {
      ctx.fail(util::cat("the registered factory failed: ", e.what()));
    }
  }();
  SymTensor out = graph_->record(data, ins, std::nullopt, ctx.node_name());
  const Node& n = graph_->node(out.node());
  // A node without initializers leaves the op's parameters to their own initialisation.
  if (!initializers.empty() && n.params.size() != initializers.size()) {
    std::vector<std::string> names;
    for (std::size_t i : initializers) names.push_back(node.input(static_cast<int>(i)));
    ctx.fail(util::cat("has ", initializers.size(), " initializer input(s) [", util::join(names, ", "), "] but ",
                       data.name(), " declares ", n.params.size(), " parameter(s); initializers fill the declared "
                       "parameters in order"));
  }
  for (std::size_t k = 0; k < initializers.size(); ++k) {
    Value& v = ctx.in(initializers[k]);
    const ParamSpec& p = n.params[k];
    Tensor t = *v.constant;
    if (t.shape() != p.shape)
      ctx.fail(util::cat("initializer ", quote_name(v.name), " is ", sizes_to_string(t.shape()), " but parameter ", quote_name(p.name),
                         " is declared ", sizes_to_string(p.shape)));
    if (t.dtype() != p.dtype) {
      if (!is_floating(t.dtype()) || !is_floating(p.dtype))
        ctx.fail(util::cat("initializer ", quote_name(v.name), " is ", dtype_name(t.dtype()), " but parameter ", quote_name(p.name),
                           " is declared ", dtype_name(p.dtype)));
      t = t.to(p.dtype);
    }
    std::vector<std::byte> bytes(t.nbytes());
    if (!bytes.empty()) std::memcpy(bytes.data(), t.raw(), bytes.size());
    graph_->bind_param(out.node(), k, v.name, ParamInit::from_bytes(std::move(bytes)),
                       options_.trainable_initializers && p.trainable);
  }
  return {tensor_value(out)};
}

// Runs a node whose inputs are all known on the CPU, in a graph of its own, and returns its
// outputs as constants; nullopt when it cannot be folded (it then becomes part of the graph).
std::optional<std::vector<Value>> Importer::try_fold(const ::onnx::NodeProto& node, const std::vector<Value*>& inputs) {
  std::int64_t elements = 0;
  for (Value* v : inputs) {
    if (!v) continue;
    if (!v->is_constant()) return std::nullopt;
    // Trainable weights stay parameters (a Transpose of a weight is trained through).
    if (v->initializer && options_.trainable_initializers && is_floating(v->constant->dtype())) return std::nullopt;
    elements += v->constant->numel();
  }
  if (elements > (std::int64_t{1} << 24)) return std::nullopt;
  static const std::set<std::string> kRandom{"RandomNormal", "RandomUniform", "RandomNormalLike",
                                             "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"};
  if (kRandom.count(node.op_type())) return std::nullopt;

  Importer sub(Graph::create(), options_, file_, external_, /*folding=*/true);
  sub.opsets_ = opsets_;
  // Copies of the inputs (the sub-importer materialises them as its graph inputs).
  std::vector<Value> local;
  local.reserve(inputs.size());
  for (Value* v : inputs) {
    if (!v) continue;
    Value c = constant_value(*v->constant);
    c.name = v->name;
    local.push_back(std::move(c));
  }
  std::vector<Value*> ptrs;
  std::size_t k = 0;
  for (Value* v : inputs) ptrs.push_back(v ? &local[k++] : nullptr);

  std::vector<Value> outs = sub.convert_node(node, ptrs);
  std::vector<std::pair<std::string, SymTensor>> graph_outs;
  for (std::size_t i = 0; i < outs.size(); ++i) {
    Value& o = outs[i];
    if (o.is_constant()) continue;
    if (o.dims) return std::nullopt;  // symbolic: not constant after all
    graph_outs.push_back({util::cat("out", i), o.tensor});
  }
  if (!graph_outs.empty()) {
    Model m(sub.graph_, graph_outs);
    std::vector<std::vector<std::int64_t>> shapes;
    for (const Tensor& t : sub.fold_inputs_) shapes.push_back(t.shape());
    LoadOptions lo;
    lo.threads = 1;
    LoadedModel lm = m.load(Device::cpu(), shapes, lo);
    std::vector<Tensor> results = lm.forward(sub.fold_inputs_);
    std::size_t r = 0;
    for (auto& o : outs)
      if (!o.is_constant()) o = constant_value(results.at(r++).clone());
  }
  return outs;
}

std::vector<Value> Importer::convert_node(const ::onnx::NodeProto& node, std::vector<Value*> inputs) {
  const std::string label = node_label(node);
  Attributes attrs = read_attributes(node, label);
  const std::string domain = canonical_domain(node.domain());
  auto it = opsets_.find(domain);
  NodeContext ctx(*this, node, std::move(inputs), std::move(attrs), label, it == opsets_.end() ? 0 : it->second);
  if (options_.registry) {
    if (const OpFactory* f = options_.registry->find(domain, node.op_type())) return convert_custom(*f, ctx);
  }
  if (!domain.empty()) ctx.fail("has no converter (register one in kg::onnx::OpRegistry)");
  const auto& table = standard_converters();
  auto c = table.find(node.op_type());
  if (c == table.end())
    ctx.fail("is not supported (kg::onnx::supported_ops() lists the ai.onnx ops kernelgraph converts; register a "
             "CustomOp for it in kg::onnx::OpRegistry under the domain \"\")");
  try {
    if (!folding_) {
      if (auto folded = try_fold(node, ctx.inputs)) return *folded;
    }
    return c->second(ctx);
  } catch (const NeedsValue&) {
    throw;
  } catch (const Error& e) {
    const std::string what = e.what();
    if (what.rfind(label, 0) == 0) throw;
    throw Error(label + " " + what);
  }
}

// ---- NodeContext ----

}  // namespace detail

namespace detail {

NodeContext::NodeContext(Importer& imp, const ::onnx::NodeProto& n, std::vector<Value*> ins, Attributes a,
                         std::string l, int o)
    : node(n), inputs(std::move(ins)), attrs(std::move(a)), label(std::move(l)), opset(o), imp_(imp) {}

Graph& NodeContext::graph() { return imp_.graph(); }

void NodeContext::fail(const std::string& why) const { throw Error(label + " " + why); }

Value& NodeContext::in(std::size_t i) const {
  if (!has_input(i)) fail(util::cat("needs input ", i, ", which is missing"));
  return *inputs[i];
}

std::string NodeContext::node_name(const std::string& suffix) {
  std::string base = node.name();
  while (!base.empty() && base.front() == '/') base.erase(base.begin());
  std::replace(base.begin(), base.end(), '/', '.');
  if (base.empty()) {
    base = node.op_type();
    std::transform(base.begin(), base.end(), base.begin(), [](unsigned char c) { return std::tolower(c); });
  }
  return imp_.unique_name(suffix.empty() ? base : base + "." + suffix);
}

SymTensor materialize(Importer& imp, Value& v, const std::string& hint) {
  if (v.tensor.valid()) return v.tensor;
  if (v.constant) {
    if (imp.folding()) {
      v.tensor = imp.graph().input(v.constant->dtype(), Shape::of(v.constant->shape()),
                                   imp.unique_name("fold_in"));
      imp.fold_inputs().push_back(*v.constant);
      return v.tensor;
    }
    std::string pname = v.name.empty() ? imp.unique_name(hint + ".const") : v.name;
    const bool trainable = v.initializer && imp.options().trainable_initializers && is_floating(v.constant->dtype());
    std::string node_name = pname;
    while (!node_name.empty() && node_name.front() == '/') node_name.erase(node_name.begin());
    std::replace(node_name.begin(), node_name.end(), '/', '.');
    if (!v.initializer) pname = node_name;
    v.tensor = ops::record_constant(imp.graph(), *v.constant, pname, imp.unique_name(node_name), trainable);
    return v.tensor;
  }
  if (v.dims) {
    std::vector<SymTensor> sources;
    std::vector<ops::DimRef> refs;
    for (const SymDim& d : *v.dims) {
      if (d.kind == SymDim::Kind::Known) {
        refs.push_back(ops::DimRef::constant(d.value));
      } else if (d.kind == SymDim::Kind::DimOf) {
        int idx = -1;
        for (std::size_t s = 0; s < sources.size(); ++s)
          if (sources[s].node() == d.src.node()) idx = static_cast<int>(s);
        if (idx < 0) {
          idx = static_cast<int>(sources.size());
          sources.push_back(d.src);
        }
        refs.push_back(ops::DimRef::of(idx, d.axis));
      } else {
        throw Error(util::cat("the shape value ", quote_name(v.name), " has a size known only at run time (a product of "
                                                          "dynamic dims); it cannot be made a tensor"));
      }
    }
    SymTensor t = ops::shape_tensor(refs, sources, imp.unique_name(hint + ".shape"));
    if (v.scalar_dims) t = kg::reshape(t, {}, imp.unique_name(hint + ".scalar"));
    v.tensor = t;
    return t;
  }
  throw Error(util::cat("value ", quote_name(v.name), " has no data"));
}

SymTensor NodeContext::tensor(std::size_t i) { return materialize(imp_, in(i), node_name("in" + std::to_string(i))); }

const Tensor& NodeContext::constant(std::size_t i, const char* what) {
  Value& v = in(i);
  if (v.constant) return *v.constant;
  if (v.graph_input)
    throw NeedsValue(util::cat(label, " needs ", what, " (input ", quote_name(v.name), ", a graph input) known at import; give "
                               "its value in ImportOptions::input_values"),
                     {v.name});
  fail(util::cat("needs ", what, " (input ", quote_name(v.name), ") known at import, but it is computed at run time",
                 v.dims ? util::cat(" (", v.dims->size(), " sizes, not all static)") : std::string()));
}

std::vector<std::int64_t> NodeContext::ints(std::size_t i, const char* what) {
  const Tensor& t = constant(i, what);
  if (is_floating(t.dtype()) || t.rank() > 1)
    fail(util::cat(what, " must be integers of rank 0 or 1, got ", dtype_name(t.dtype()), " ",
                   sizes_to_string(t.shape())));
  std::vector<std::int64_t> out;
  for (std::int64_t k = 0; k < t.numel(); ++k) out.push_back(static_cast<std::int64_t>(t.item(k)));
  // Exact i64 values (item() goes through a double). An empty constant has no storage to copy:
  // memcpy with a null pointer is undefined even for 0 bytes.
  if (t.dtype() == DType::I64 && !out.empty()) std::memcpy(out.data(), t.raw(), out.size() * sizeof(std::int64_t));
  return out;
}

double NodeContext::scalar(std::size_t i, const char* what) {
  const Tensor& t = constant(i, what);
  if (t.numel() != 1)
    fail(util::cat(what, " must have one element, got ", dtype_name(t.dtype()), " ", sizes_to_string(t.shape())));
  return t.item(0);
}

std::optional<std::vector<SymDim>> NodeContext::dims(std::size_t i) const {
  const Value& v = in(i);
  if (v.dims) return v.dims;
  if (v.constant && !is_floating(v.constant->dtype()) && v.constant->rank() <= 1) {
    std::vector<SymDim> d;
    const Tensor& t = *v.constant;
    for (std::int64_t k = 0; k < t.numel(); ++k)
      d.push_back(SymDim::known(t.dtype() == DType::I64 ? t.data<std::int64_t>()[k]
                                                        : static_cast<std::int64_t>(t.item(k))));
    return d;
  }
  return std::nullopt;
}

std::optional<std::vector<ops::DimRef>> NodeContext::dim_refs(const std::vector<SymDim>& d,
                                                              std::vector<SymTensor>& sources, int first) {
  std::vector<ops::DimRef> refs;
  for (const SymDim& s : d) {
    if (s.kind == SymDim::Kind::Known) {
      refs.push_back(ops::DimRef::constant(s.value));
    } else if (s.kind == SymDim::Kind::DimOf) {
      int idx = -1;
      for (std::size_t k = 0; k < sources.size(); ++k)
        if (sources[k].node() == s.src.node()) idx = static_cast<int>(k);
      if (idx < 0) {
        idx = static_cast<int>(sources.size());
        sources.push_back(s.src);
      }
      refs.push_back(ops::DimRef::of(first + idx, s.axis));
    } else {
      return std::nullopt;
    }
  }
  return refs;
}

// ---- the model ----

namespace {

Shape shape_of_type(const ::onnx::TypeProto& type) {
  Shape s;
  if (!type.tensor_type().has_shape()) return s;
  for (const auto& d : type.tensor_type().shape().dim()) {
    if (d.has_dim_value()) {
      if (d.dim_value() < 0) throw Error(util::cat("negative dim ", d.dim_value()));
      s.push_back(Dim(d.dim_value()));
    } else if (d.has_dim_param() && !d.dim_param().empty()) {
      s.push_back(Dim::named(d.dim_param()));
    } else {
      s.push_back(Dim(dynamic));
    }
  }
  return s;
}

}  // namespace

void Importer::convert_model(const ::onnx::ModelProto& model) {
  const std::string where = util::cat("ONNX file ", quote_name(file_));
  for (const auto& o : model.opset_import()) {
    // A version outside 1..2^31-1 is no opset (it was read modulo 2^32: 2^32 + 17 as 17).
    const std::int64_t v = o.version();
    const std::string domain = canonical_domain(o.domain());
    if (v < 1 || v > std::numeric_limits<int>::max())
      throw Error(util::cat(where, ": imports opset version ", v, " of the ",
                            domain.empty() ? std::string("standard domain") : "domain " + quote_name(domain),
                            "; opset versions are 1 to ", std::numeric_limits<int>::max()));
    // "ai.onnx" and "" are the same domain; naming it twice is fine when the versions agree.
    const auto [at, added] = opsets_.emplace(domain, static_cast<int>(v));
    if (!added && at->second != static_cast<int>(v))
      throw Error(util::cat(where, ": imports the ",
                            domain.empty() ? std::string("standard domain") : "domain " + quote_name(domain),
                            " at two versions, ", at->second, " and ", v));
  }
  if (!opsets_.count("")) {
    if (model.ir_version() < 3) opsets_[""] = 1;  // before opset_import existed
  }
  const int opset = opsets_.count("") ? opsets_[""] : 0;
  if (opset > kMaxStandardOpset)
    throw Error(util::cat(where, ": imports opset ", opset, " of the standard domain; this importer knows opsets 1 to ",
                          kMaxStandardOpset, ". Export the model again with opset_version=", kMaxStandardOpset,
                          " (torch.onnx.export) or convert it with onnx.version_converter.convert_version(model, ",
                          kMaxStandardOpset, ")"));
  const auto& g = model.graph();

  // Initializers.
  std::set<std::string> init_names;
  for (const auto& t : g.initializer()) {
    if (t.name().empty()) throw Error(where + ": an initializer has no name");
    if (!init_names.insert(t.name()).second) throw Error(util::cat(where, ": initializer ", quote_name(t.name()), " is defined twice"));
    Value v = constant_value(to_tensor(t, util::cat(where, ": initializer ", quote_name(t.name())), external_));
    v.name = t.name();
    v.initializer = true;
    values[t.name()] = std::move(v);
  }
  for (const auto& t : g.sparse_initializer())
    throw Error(util::cat(where, ": sparse initializer ", quote_name(t.values().name()), " is not supported"));
  // Graph inputs (those that are also initializers are defaults in old files: the initializer wins).
  for (const auto& in : g.input()) {
    if (init_names.count(in.name())) continue;
    if (in.name().empty()) throw Error(where + ": a graph input has no name");
    if (values.count(in.name())) throw Error(util::cat(where, ": graph input ", quote_name(in.name()), " is defined twice"));
    if (!in.type().has_tensor_type())
      throw Error(util::cat(where, ": graph input ", quote_name(in.name()), " is not a tensor (sequences and maps are not supported)"));
    const auto dt = dtype_of(in.type().tensor_type().elem_type());
    if (!dt)
      throw Error(util::cat(where, ": graph input ", quote_name(in.name()), " has element type ",
                            onnx_type_name(in.type().tensor_type().elem_type()), ", which is not supported"));
    auto given = options_.input_values.find(in.name());
    if (given != options_.input_values.end()) {
      Value v = constant_value(given->second);
      v.name = in.name();
      values[in.name()] = std::move(v);
      continue;
    }
    Shape s;
    try {
      s = shape_of_type(in.type());
    } catch (const Error& e) {
      throw Error(util::cat(where, ": graph input ", quote_name(in.name()), ": ", e.what()));
    }
    if (!in.type().tensor_type().has_shape())
      throw Error(util::cat(where, ": graph input ", quote_name(in.name()), " has no shape (its rank must be known)"));
    Value v = tensor_value(graph_->input(*dt, s, in.name()));
    v.name = in.name();
    v.graph_input = true;
    values[in.name()] = std::move(v);
  }
  for (const auto& [name, t] : options_.input_values) {
    (void)t;
    bool found = false;
    for (const auto& in : g.input()) found = found || in.name() == name;
    if (!found) throw Error(util::cat(where, ": ImportOptions::input_values names ", quote_name(name), ", which is not a graph input"));
  }

  // Order the nodes: every input defined before use; a cycle or an undefined value is an error.
  const int n = g.node_size();
  std::map<std::string, int> producer;
  for (int i = 0; i < n; ++i)
    for (const auto& o : g.node(i).output()) {
      if (o.empty()) continue;
      if (values.count(o) || producer.count(o))
        throw Error(util::cat(where, ": value ", quote_name(o), " is produced twice (by node ", quote_name(g.node(i).name()), ")"));
      producer[o] = i;
    }
  std::vector<int> pending(static_cast<std::size_t>(n), 0);
  std::vector<std::vector<int>> users(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    for (const auto& in : g.node(i).input()) {
      if (in.empty() || values.count(in)) continue;
      auto p = producer.find(in);
      if (p == producer.end())
        throw Error(util::cat(where, ": node ", quote_name(g.node(i).name()), " (", util::printable(g.node(i).op_type()), ") reads ", quote_name(in),
                              ", which no node, input or initializer defines"));
      ++pending[static_cast<std::size_t>(i)];
      users[static_cast<std::size_t>(p->second)].push_back(i);
    }
    for (const auto& a : g.node(i).attribute())
      if (a.type() == ::onnx::AttributeProto::GRAPH || a.type() == ::onnx::AttributeProto::GRAPHS)
        throw Error(util::cat(where, ": node ", quote_name(g.node(i).name()), " (", util::printable(g.node(i).op_type()),
                              ") has a subgraph attribute ", quote_name(a.name()), "; control flow (If, Loop, Scan) is not supported"));
  }
  std::vector<int> order;
  std::queue<int> ready;
  for (int i = 0; i < n; ++i)
    if (pending[static_cast<std::size_t>(i)] == 0) ready.push(i);
  while (!ready.empty()) {
    const int i = ready.front();
    ready.pop();
    order.push_back(i);
    for (int u : users[static_cast<std::size_t>(i)])
      if (--pending[static_cast<std::size_t>(u)] == 0) ready.push(u);
  }
  if (static_cast<int>(order.size()) != n) {
    std::vector<std::string> stuck;
    for (int i = 0; i < n && stuck.size() < 5; ++i)
      if (pending[static_cast<std::size_t>(i)] > 0) stuck.push_back(util::cat(quote_name(g.node(i).name()), " (", util::printable(g.node(i).op_type()), ")"));
    throw Error(util::cat(where, ": the graph has a cycle; nodes on or after it: ", util::join(stuck, ", ")));
  }

  // Every op must have a converter: one error listing all that do not.
  struct Missing {
    int count = 0;
    std::string first;
  };
  std::map<std::pair<std::string, std::string>, Missing> missing;
  const auto& table = standard_converters();
  for (int i = 0; i < n; ++i) {
    const auto& node = g.node(i);
    const std::string d = canonical_domain(node.domain());
    if (options_.registry && options_.registry->find(d, node.op_type())) continue;
    if (d.empty() && table.count(node.op_type())) continue;
    auto& m = missing[{d, node.op_type()}];
    if (m.count++ == 0) m.first = node.name().empty() ? util::cat("#", i) : node.name();
  }
  if (!missing.empty()) {
    std::string msg = util::cat(where, ": ", missing.size(), " op type(s) cannot be imported:");
    for (const auto& [key, m] : missing)
      msg += util::cat("\n  ", key.first.empty() ? "ai.onnx" : util::printable(key.first), " ",
                       util::printable(key.second), ": ", m.count, " node(s), first ", quote_name(m.first),
                       key.first.empty() ? "" : " (register a CustomOp for it in kg::onnx::OpRegistry)");
    if (std::any_of(missing.begin(), missing.end(), [](const auto& m) { return m.first.first.empty(); }))
      msg += util::cat("\n(kernelgraph has no converter for these ai.onnx ops at any opset; kg::onnx::supported_ops() "
                       "lists those it has. Export the model without them, or register a CustomOp for each in "
                       "kg::onnx::OpRegistry under the domain \"\")");
    throw Error(msg);
  }

  for (int i : order) {
    const auto& node = g.node(i);
    std::vector<Value*> ins;
    for (const auto& in : node.input()) ins.push_back(in.empty() ? nullptr : &values.at(in));
    std::vector<Value> outs;
    try {
      outs = convert_node(node, std::move(ins));
    } catch (const NeedsValue&) {
      throw;
    } catch (const Error& e) {
      throw Error(util::cat(where, ": ", e.what()));
    }
    for (int k = 0; k < node.output_size(); ++k) {
      const std::string& o = node.output(k);
      if (o.empty()) continue;
      if (static_cast<std::size_t>(k) >= outs.size()) {
        throw Error(util::cat(where, ": ", node_label(node), " output ", k, " (", quote_name(o), ") is not supported"));
      }
      outs[static_cast<std::size_t>(k)].name = o;
      outs[static_cast<std::size_t>(k)].initializer = false;
      outs[static_cast<std::size_t>(k)].graph_input = false;
      values[o] = std::move(outs[static_cast<std::size_t>(k)]);
    }
  }
}

ImportedGraph Importer::finish(const ::onnx::GraphProto& g) {
  const std::string where = util::cat("ONNX file ", quote_name(file_));
  std::vector<std::pair<std::string, SymTensor>> outs;
  if (g.output_size() == 0) throw Error(where + ": the graph has no outputs");
  for (const auto& o : g.output()) {
    auto it = values.find(o.name());
    if (it == values.end()) throw Error(util::cat(where, ": graph output ", quote_name(o.name()), " is not defined by any node"));
    SymTensor t;
    try {
      t = materialize(*this, it->second, o.name());
    } catch (const Error& e) {
      throw Error(util::cat(where, ": graph output ", quote_name(o.name()), ": ", e.what()));
    }
    outs.push_back({o.name(), t});
  }
  return {graph_, outs};
}

ImportedGraph import_proto(const std::string& bytes, const std::string& name, const ImportOptions& options,
                   const std::string& base_dir) {
  const std::string where = util::cat("ONNX file ", quote_name(name));
  ::onnx::ModelProto model;
  if (bytes.empty()) throw Error(where + ": empty file");
  if (bytes.size() > static_cast<std::size_t>(std::numeric_limits<int>::max()))
    throw Error(where + ": larger than 2 GiB; store the weights as external data");
  if (!model.ParseFromString(bytes))
    throw Error(where + ": not a valid ONNX protobuf (truncated, or not an ONNX model)");
  if (model.ir_version() <= 0 || !model.has_graph())
    throw Error(util::cat(where, ": not an ONNX model (ir_version ", model.ir_version(), ", ",
                          model.has_graph() ? "a graph" : "no graph", ")"));
  if (model.ir_version() > kMaxIrVersion)
    throw Error(util::cat(where, ": ir_version ", model.ir_version(), " is not an ONNX IR version (this importer reads 1 to ",
                          kMaxIrVersion, ")"));
  ExternalFiles external(base_dir);
  Importer imp(Graph::create(), options, name, external, false);
  imp.convert_model(model);
  try {
    return imp.finish(model.graph());
  } catch (const Error& e) {
    const std::string what = e.what();
    if (what.rfind(where, 0) == 0) throw;
    throw Error(where + ": " + what);
  }
}

// import_proto, with the standard library's allocation failures (a size the checks let through
// that the machine cannot hold) named as the file's error rather than "std::bad_alloc".
ImportedGraph import_checked(const std::string& bytes, const std::string& name, const ImportOptions& options,
                             const std::string& base_dir) {
  try {
    return import_proto(bytes, name, options, base_dir);
  } catch (const std::bad_alloc&) {
    throw Error(util::cat("ONNX file ", quote_name(name), ": out of memory while importing (",
                          util::format_bytes(bytes.size()), " file); a size in it is larger than this machine holds"));
  } catch (const std::length_error&) {
    throw Error(util::cat("ONNX file ", quote_name(name), ": a size in it is larger than this machine holds"));
  }
}

}  // namespace detail

ImportedGraph import_graph(const std::string& path, const ImportOptions& options) {
  const std::string bytes = detail::read_file(path, std::uint64_t{1} << 31, "ONNX file");
  const std::string dir = std::filesystem::path(path).parent_path().string();
  return detail::import_checked(bytes, path, options, dir.empty() ? "." : dir);
}

ImportedGraph import_graph_bytes(const std::string& bytes, const std::string& name, const ImportOptions& options,
                                 const std::string& base_dir) {
  return detail::import_checked(bytes, name, options, base_dir);
}

Model import(const std::string& path, const ImportOptions& options) {
  ImportedGraph g = import_graph(path, options);
  return Model(g.graph, g.outputs, options.mode, options.model);
}

Model import_bytes(const std::string& bytes, const std::string& name, const ImportOptions& options,
                   const std::string& base_dir) {
  ImportedGraph g = import_graph_bytes(bytes, name, options, base_dir);
  return Model(g.graph, g.outputs, options.mode, options.model);
}

SymTensor ImportedGraph::output(const std::string& name) const {
  std::vector<std::string> names;
  for (const auto& [n, t] : outputs) {
    if (n == name) return t;
    names.push_back(n);
  }
  throw Error(util::cat("the imported graph has no output ", quote_name(name), " (outputs: ", util::join(names, ", "), ")"));
}

std::vector<std::string> supported_ops() {
  std::vector<std::string> out;
  for (const auto& [name, c] : detail::standard_converters()) out.push_back(name);
  return out;
}

std::vector<InputInfo> model_inputs(const Model& model) {
  std::vector<InputInfo> out;
  for (int id : model.graph().inputs()) {
    const Node& n = model.graph().node(id);
    out.push_back({n.name, n.dtype, n.shape});
  }
  return out;
}

Tensor read_tensor_file(const std::string& path) {
  const std::string bytes = detail::read_file(path, std::uint64_t{1} << 31, "ONNX tensor file");
  ::onnx::TensorProto t;
  if (!t.ParseFromString(bytes)) throw Error(util::cat("ONNX tensor file ", quote_name(path), ": not a valid TensorProto"));
  const std::string dir = std::filesystem::path(path).parent_path().string();
  detail::ExternalFiles external(dir.empty() ? "." : dir);
  try {
    return detail::to_tensor(t, util::cat("ONNX tensor file ", quote_name(path)), external);
  } catch (const std::bad_alloc&) {
    throw Error(util::cat("ONNX tensor file ", quote_name(path), ": out of memory while reading it"));
  }
}

}  // namespace kg::onnx
