// The lowering: walks the optimised graph in topological order and turns every op node into an
// executable — a kernel source, its entry point and its RuntimeOp. It runs at load, on every
// device, with the concrete shapes and the target known.
#pragma once

#include <cstdint>
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
  std::string backward_source;  // Training mode only; "" = no lowered backward
  bool view = false;            // a view op: no kernel, aliases its input
  bool lowered = true;          // false: lower() gave nothing (allowed on the cpu, see below)
  LowerContext context;         // what lower() was told
};

struct LoweredGraph {
  LoweringMode mode = LoweringMode::Inference;
  std::vector<Executable> executables;  // one per live op node, topological order
};

// Concrete sizes by node id (empty where unknown); `sm` the target (0: the emulator).
struct LowerTarget {
  std::vector<std::vector<std::int64_t>> concrete;  // by node id
  int sm = 0;
  // When false, a node whose op gives no lowering is kept with lowered = false (the cpu runs
  // its cpu_forward); when true it is the seed's error.
  bool require_all = true;
};

// The context lower() is given for node `id`.
LowerContext lower_context(const Model& model, int id, const LowerTarget& target);
LowerContext lower_context(const Graph& graph, LoweringMode mode, int id, const LowerTarget& target);

// Lowers the live op nodes of `model`. A node whose op returns no lowering fails with
// "[op @ node] custom op '<name>' is not handled — implement CustomOp::lower()" when
// target.require_all.
LoweredGraph lower_model(const Model& model, const LowerTarget& target);
// The same for a graph rewritten at load (the nodes `live`, in order).
LoweredGraph lower_graph(const Graph& graph, const std::vector<int>& live, LoweringMode mode,
                         const LowerTarget& target);

// The seed's error for an op without a lowering, in the one error format.
std::string not_handled(const Node& n);

}  // namespace kg::lower
