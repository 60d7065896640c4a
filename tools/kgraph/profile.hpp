// kgraph run --profile: the per-node table of the last timed forward, with the floating-point
// work of the matrix products and a lower bound of the bytes each node moves.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <vector>

#include "kg/graph.hpp"
#include "kg/model.hpp"

namespace kgraph {

// The floating-point operations of a node, 2 per multiply-add, for the ops that are matrix
// products: convolutions (nn.conv2d, nn.fused_conv2d: the convolution, not its epilogue;
// nn.conv_transpose2d), nn.linear and nn.matmul; nullopt for every other op. `inputs` and `output`
// are the node's concrete shapes.
std::optional<double> matrix_flops(const kg::Node& node, const std::vector<std::vector<std::int64_t>>& inputs,
                                   const std::vector<std::int64_t>& output);

// Prints LoadedModel::profile() of the last forward of `loaded` (loaded from `model` with
// LoadOptions::profile) as a table: node, op, ms, share of the nodes' total, GFLOP and GFLOP/s
// where matrix_flops() counts them, the bytes of inputs + output + parameters and their rate;
// then the totals. `run_ms` is the wall time of that forward.
void print_profile(std::ostream& out, const kg::Model& model, const kg::LoadedModel& loaded, double run_ms);

}  // namespace kgraph
