// nn.constant: a tensor held by the model as a parameter, with no inputs. It is how an imported
// model's initializers and constants that feed ordinary inputs (a MatMul's weight, an embedding
// table, a bias added by Add) become values of the graph; trainable when the model trains them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kg/graph.hpp"

namespace kg::ops {

// The op: output = its parameter "value" of `shape` and `dtype` (initialised with `init`).
CustomData constant_op(DType dtype, std::vector<std::int64_t> shape, ParamInit init, bool trainable);

// Records a constant node in `graph` whose parameter is called `param_name` in full (its node
// gets the name `node_name`, made unique).
SymTensor record_constant(Graph& graph, const Tensor& value, const std::string& param_name,
                          const std::string& node_name, bool trainable);

}  // namespace kg::ops
