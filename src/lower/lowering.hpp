// The lowering: walks the optimised graph in topological order and turns every op node into an
// executable — a kernel source, its entry point and its RuntimeOp.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kg/model.hpp"
#include "kg/runtime_op.hpp"

namespace kg::lower {

struct Executable {
  int node = -1;
  std::string name;         // kernel name (from Lowered::name)
  std::string source;       // CUDA C++ or PTX
  std::string entry_point;  // "" = the module's only entry
  std::shared_ptr<RuntimeOp> runtime_op;
  std::string backward_source;  // Training mode only
  bool view = false;            // a view op: no kernel, aliases its input
};

struct LoweredGraph {
  LoweringMode mode = LoweringMode::Inference;
  std::vector<Executable> executables;  // one per live op node, topological order
};

// Lowers the live op nodes of `model`. A node whose op returns no lowering fails with
// "custom op '<name>' is not handled — implement CustomOp::lower()" and the node's name.
LoweredGraph lower_model(const Model& model);

}  // namespace kg::lower
