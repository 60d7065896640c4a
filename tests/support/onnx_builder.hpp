// Builds small ONNX models in tests with the protobuf schema, so the importer's behaviour on
// well-formed and broken files can be checked without fixture files.
#pragma once

#include <cstring>
#include <string>
#include <variant>
#include <vector>

#include "kg/tensor.hpp"
#include "onnx/onnx_pb.h"

namespace kg_test {

class OnnxBuilder {
 public:
  using DimSpec = std::variant<std::int64_t, std::string>;  // a size or a dim_param name

  explicit OnnxBuilder(int opset = 17) {
    model_.set_ir_version(8);
    model_.set_producer_name("kg_tests");
    auto* o = model_.add_opset_import();
    o->set_domain("");
    o->set_version(opset);
  }
  void import_domain(const std::string& domain, int version) {
    auto* o = model_.add_opset_import();
    o->set_domain(domain);
    o->set_version(version);
  }
  ::onnx::GraphProto& graph() { return *model_.mutable_graph(); }
  ::onnx::ModelProto& model() { return model_; }

  static int elem_type(kg::DType t) {
    using T = ::onnx::TensorProto;
    switch (t) {
      case kg::DType::F32: return T::FLOAT;
      case kg::DType::F64: return T::DOUBLE;
      case kg::DType::I64: return T::INT64;
      case kg::DType::I32: return T::INT32;
      case kg::DType::Bool: return T::BOOL;
      case kg::DType::F16: return T::FLOAT16;
      default: return T::UNDEFINED;
    }
  }

  void input(const std::string& name, kg::DType t, const std::vector<DimSpec>& dims) {
    value_info(graph().add_input(), name, t, dims);
  }
  void output(const std::string& name, kg::DType t = kg::DType::F32, const std::vector<DimSpec>& dims = {}) {
    value_info(graph().add_output(), name, t, dims);
  }
  static void fill_tensor(::onnx::TensorProto* p, const std::string& name, const kg::Tensor& t) {
    p->set_name(name);
    p->set_data_type(elem_type(t.dtype()));
    for (auto d : t.shape()) p->add_dims(d);
    p->set_raw_data(std::string(static_cast<const char*>(t.raw()), t.nbytes()));
  }
  void initializer(const std::string& name, const kg::Tensor& t) { fill_tensor(graph().add_initializer(), name, t); }

  ::onnx::NodeProto& node(const std::string& op, const std::vector<std::string>& inputs,
                          const std::vector<std::string>& outputs, const std::string& name = "",
                          const std::string& domain = "") {
    auto* n = graph().add_node();
    n->set_op_type(op);
    n->set_domain(domain);
    n->set_name(name.empty() ? op + "_" + std::to_string(graph().node_size()) : name);
    for (const auto& i : inputs) n->add_input(i);
    for (const auto& o : outputs) n->add_output(o);
    return *n;
  }
  static void attr(::onnx::NodeProto& n, const std::string& name, std::int64_t v) {
    auto* a = n.add_attribute();
    a->set_name(name);
    a->set_type(::onnx::AttributeProto::INT);
    a->set_i(v);
  }
  static void attr(::onnx::NodeProto& n, const std::string& name, float v) {
    auto* a = n.add_attribute();
    a->set_name(name);
    a->set_type(::onnx::AttributeProto::FLOAT);
    a->set_f(v);
  }
  static void attr(::onnx::NodeProto& n, const std::string& name, const std::string& v) {
    auto* a = n.add_attribute();
    a->set_name(name);
    a->set_type(::onnx::AttributeProto::STRING);
    a->set_s(v);
  }
  static void attr(::onnx::NodeProto& n, const std::string& name, const std::vector<std::int64_t>& v) {
    auto* a = n.add_attribute();
    a->set_name(name);
    a->set_type(::onnx::AttributeProto::INTS);
    for (auto x : v) a->add_ints(x);
  }

  std::string bytes() const { return model_.SerializeAsString(); }

 private:
  static void value_info(::onnx::ValueInfoProto* v, const std::string& name, kg::DType t,
                         const std::vector<DimSpec>& dims) {
    v->set_name(name);
    auto* tt = v->mutable_type()->mutable_tensor_type();
    tt->set_elem_type(elem_type(t));
    auto* s = tt->mutable_shape();
    for (const auto& d : dims) {
      auto* dim = s->add_dim();
      if (std::holds_alternative<std::int64_t>(d)) {
        const auto size = std::get<std::int64_t>(d);
        if (size >= 0) dim->set_dim_value(size);  // -1: no value, no name
      } else {
        dim->set_dim_param(std::get<std::string>(d));
      }
    }
  }
  ::onnx::ModelProto model_;
};

}  // namespace kg_test
