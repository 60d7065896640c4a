// What the tests of the fusion passes share: finding the fused nodes of a loaded graph, their
// members, counting nodes, random inputs, and the comparison of a fused model with the same graph
// unfused (ModelOptions::fusion off) on the CPU forms and under the CUDA emulator.
#pragma once

#include <map>
#include <random>
#include <string>
#include <vector>

#include "kg/kg.hpp"

namespace kg_test {

// The live op nodes of `m` whose op is a T (kg::ops::FusedElementwiseOp, FusedGemmOp,
// FusedReductionOp), in graph order.
template <class T>
std::vector<const T*> ops_of(const kg::Model& m) {
  std::vector<const T*> v;
  for (int id : m.live_nodes()) {
    const kg::Node& node = m.graph().node(id);
    if (node.kind != kg::Node::Kind::Op) continue;
    if (const auto* f = node.op->as<T>()) v.push_back(f);
  }
  return v;
}

// The node names of a fused op's members, in order.
template <class F>
std::vector<std::string> member_names(const F& f) {
  std::vector<std::string> v;
  for (const auto& member : f.members()) v.push_back(member.node);
  return v;
}

// The live op nodes of `m`; with `views` false only those that run something (a view, such as a
// group's output part, runs nothing).
int count_ops(const kg::Model& m, bool views = true);

// One tensor uniform in [lo, hi) per shape.
std::vector<kg::Tensor> random_inputs(std::mt19937_64& rng, const std::vector<std::vector<std::int64_t>>& shapes,
                                      kg::DType dt, double lo = -2.0, double hi = 2.0);

// Loads `plain` (poisoned buffers) and `fused` twice, on the CPU forms (poisoned) and checked under
// the emulator (the generated kernels; every output element must be written), sets `params` on
// all three when given, runs them on `inputs` and expects the fused outputs to be written and
// within `tol` (relative and absolute) of the unfused ones.
void expect_fused_matches_plain(const kg::Model& fused, const kg::Model& plain,
                                const std::vector<std::vector<std::int64_t>>& shapes,
                                const std::vector<kg::Tensor>& inputs, double tol,
                                const std::map<std::string, kg::Tensor>& params = {});

}  // namespace kg_test
