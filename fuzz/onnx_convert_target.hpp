// The body of the onnx_convert fuzz target (included by targets.hpp): a model of one node whose
// op, attributes and input shapes come from the bytes, imported and then loaded and run on the
// CPU, so the converters' shape and attribute arithmetic is fuzzed and not only the parser.
//
// The bytes, read in order (missing bytes read as 0):
//   op      one byte: an index into kOps
//   opset   one byte: 7 + b % 12 (opsets 7 to 18)
//   outputs one byte: b % 4 outputs ("y0", "y1", ...)
//   inputs  one byte: b % 5 inputs, each a kind byte k then its data:
//     k % 4 == 0  a graph input (f32) of rank (k / 4) % 5; a byte per dim: b % 7, or a dim named
//                 "n" (2 at load) for b >= 0xf0
//     k % 4 == 1  an i64 initializer: (k / 4) % 9 numbers, 1-D (a scalar when k / 4 % 9 == 8: one number)
//     k % 4 == 2  Shape of the first graph input (a symbolic shape value)
//     k % 4 == 3  an f32 initializer of rank (k / 4) % 5, a byte per dim (b % 5), filled with 0.5
//   attrs   one byte: b % 6 attributes, each a name byte (index into kAttrs), a kind byte and its
//           value: kind % 3 == 0 one number, 1 a list of (b % 7) numbers, 2 a string of kStrings
// A number is one byte t: t < 0xf8 gives the small signed value (int8_t)t; otherwise the next 8
// bytes, little-endian: any 64-bit value (INT64_MIN, -1, 2^62, ...).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kg/error.hpp"
#include "kg/model.hpp"
#include "kg/onnx.hpp"
#include "onnx/onnx_pb.h"
#include "util/memory.hpp"

namespace kg::fuzz {

namespace onnx_convert {

inline const std::vector<std::string>& ops() {
  static const std::vector<std::string> v{
      "Conv", "ConvTranspose", "MaxPool", "AveragePool", "Split", "Slice", "Reshape", "Expand",
      "ConstantOfShape", "Range", "Tile", "Pad", "Concat", "Gather", "Unsqueeze", "Squeeze",
      "Flatten", "Transpose", "Trilu", "Hardmax", "Softmax", "LogSoftmax", "ReduceSum", "ReduceProd",
      "ReduceMean", "CumSum", "Resize", "Div", "Mul", "Add", "Sub", "Where", "Equal", "Cast",
      "Gemm", "MatMul", "LayerNormalization", "ArgMax", "GlobalAveragePool", "Shape", "Size",
      "Identity", "Einsum", "BatchNormalization", "InstanceNormalization", "Clip", "Upsample"};
  return v;
}
inline const std::vector<std::string>& attrs() {
  static const std::vector<std::string> v{
      "kernel_shape", "strides", "pads", "dilations", "auto_pad", "axis", "axes", "num_outputs",
      "split", "group", "perm", "starts", "ends", "keepdims", "ceil_mode", "count_include_pad",
      "output_padding", "output_shape", "allowzero", "upper", "to", "mode", "start", "end",
      "exclusive", "reverse", "equation", "transA", "transB", "epsilon", "broadcast", "value"};
  return v;
}
inline const std::vector<std::string>& strings() {
  static const std::vector<std::string> v{"NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID", "constant",
                                          "reflect", "edge", "nearest", "linear", "ij,jk->ik", "bij,bjk->bik"};
  return v;
}

struct Reader {
  const std::uint8_t* data;
  std::size_t size, at = 0;
  std::uint8_t byte() { return at < size ? data[at++] : 0; }
  std::int64_t number() {
    const std::uint8_t t = byte();
    if (t < 0xf8) return static_cast<std::int8_t>(t);
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(byte()) << (8 * i);
    std::int64_t s;
    std::memcpy(&s, &v, sizeof s);
    return s;
  }
};

inline void value_info(::onnx::ValueInfoProto* v, const std::string& name, const std::vector<std::int64_t>& dims) {
  v->set_name(name);
  auto* tt = v->mutable_type()->mutable_tensor_type();
  tt->set_elem_type(::onnx::TensorProto::FLOAT);
  auto* s = tt->mutable_shape();
  for (std::int64_t d : dims) {
    if (d < 0) s->add_dim()->set_dim_param("n");
    else s->add_dim()->set_dim_value(d);
  }
}

}  // namespace onnx_convert

inline int fuzz_onnx_convert(const std::uint8_t* data, std::size_t size) {
  using namespace onnx_convert;
  Reader r{data, size};
  ::onnx::ModelProto model;
  model.set_ir_version(8);
  const std::string op = ops()[r.byte() % ops().size()];
  auto* opset = model.add_opset_import();
  opset->set_domain("");
  opset->set_version(7 + r.byte() % 12);
  const int n_out = r.byte() % 4;
  const int n_in = r.byte() % 5;
  auto* g = model.mutable_graph();
  ::onnx::NodeProto node;
  node.set_op_type(op);
  node.set_name("/fuzz/" + op);
  std::vector<std::vector<std::int64_t>> input_shapes;  // of the graph inputs, -1 for "n"
  std::string first_input;
  bool shape_node = false;
  for (int i = 0; i < n_in; ++i) {
    const std::uint8_t k = r.byte();
    const std::string name = "in" + std::to_string(i);
    switch (k % 4) {
      case 0: {
        std::vector<std::int64_t> dims;
        for (int d = 0, rank = (k / 4) % 5; d < rank; ++d) {
          const std::uint8_t b = r.byte();
          dims.push_back(b >= 0xf0 ? -1 : b % 7);
        }
        value_info(g->add_input(), name, dims);
        input_shapes.push_back(dims);
        if (first_input.empty()) first_input = name;
        node.add_input(name);
        break;
      }
      case 1: {
        const int count = (k / 4) % 9;
        auto* t = g->add_initializer();
        t->set_name(name);
        t->set_data_type(::onnx::TensorProto::INT64);
        if (count == 8) {
          t->add_int64_data(r.number());
        } else {
          t->add_dims(count);
          for (int j = 0; j < count; ++j) t->add_int64_data(r.number());
        }
        node.add_input(name);
        break;
      }
      case 2: shape_node = true; node.add_input("shape_of_x"); break;
      default: {
        auto* t = g->add_initializer();
        t->set_name(name);
        t->set_data_type(::onnx::TensorProto::FLOAT);
        std::int64_t numel = 1;
        for (int d = 0, rank = (k / 4) % 5; d < rank; ++d) {
          const std::int64_t s = r.byte() % 5;
          t->add_dims(s);
          numel *= s;
        }
        for (std::int64_t j = 0; j < numel; ++j) t->add_float_data(0.5f);
        node.add_input(name);
        break;
      }
    }
  }
  if (shape_node) {
    if (first_input.empty()) {
      first_input = "x";
      value_info(g->add_input(), "x", {-1, 3});
      input_shapes.push_back({-1, 3});
    }
    auto* s = g->add_node();
    s->set_op_type("Shape");
    s->set_name("/fuzz/Shape");
    s->add_input(first_input);
    s->add_output("shape_of_x");
  }
  for (int i = 0, n = r.byte() % 6; i < n; ++i) {
    auto* a = node.add_attribute();
    a->set_name(attrs()[r.byte() % attrs().size()]);
    const std::uint8_t kind = r.byte() % 3;
    if (kind == 0) {
      a->set_type(::onnx::AttributeProto::INT);
      a->set_i(r.number());
    } else if (kind == 1) {
      a->set_type(::onnx::AttributeProto::INTS);
      for (int j = 0, m = r.byte() % 7; j < m; ++j) a->add_ints(r.number());
    } else {
      a->set_type(::onnx::AttributeProto::STRING);
      a->set_s(strings()[r.byte() % strings().size()]);
    }
  }
  for (int i = 0; i < n_out; ++i) {
    node.add_output("y" + std::to_string(i));
    value_info(g->add_output(), "y" + std::to_string(i), {});
  }
  *g->add_node() = node;

  // What the memory checks see as available while this input runs: a constant or a plan larger
  // than this is refused (a kg::Error) before it is allocated, as on a machine of that size.
  struct Limit {
    Limit() { util::set_available_memory_for_testing(std::uint64_t{256} << 20); }
    ~Limit() { util::set_available_memory_for_testing(std::nullopt); }
  } limit;
  try {
    const Model m = onnx::import_bytes(model.SerializeAsString(), "fuzz_convert.onnx");
    std::vector<std::vector<std::int64_t>> shapes;
    std::vector<Tensor> inputs;
    for (const auto& in : onnx::model_inputs(m)) {
      std::vector<std::int64_t> s;
      for (const Dim& d : in.shape) s.push_back(d.is_static() ? d.size() : 2);
      shapes.push_back(s);
      inputs.push_back(Tensor::zeros(in.dtype, s));
    }
    LoadOptions options;
    options.threads = 1;
    LoadedModel lm = m.load(Device::cpu(), shapes, options);
    (void)lm.forward(inputs);
  } catch (const Error&) {
  }
  return 0;
}

}  // namespace kg::fuzz
