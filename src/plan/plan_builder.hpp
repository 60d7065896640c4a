// Building a loaded model's plan: values with storage roots (views alias their input), buffer
// lifetimes, steps with initialised host parameters, and arena placement.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "plan/memory_plan.hpp"
#include "plan/plan.hpp"
#include "plan/shape_binding.hpp"

namespace kg::plan {

// Values, lifetimes (first/last step index of each storage root) and steps with parameters
// initialised from their ParamInit (PyTorch's defaults for built-in layers), seeded by `seed`.
Plan build_plan(const Graph& graph, const std::vector<int>& live, const std::vector<int>& outputs,
                const BoundShapes& bound, std::uint64_t seed);

// Fills `t` from `spec.init`; throws naming the node for a Data init of the wrong size.
void init_param(Tensor& t, const ParamSpec& spec, const Node& node, std::mt19937_64& rng);

// Places every non-input storage root in one arena, `bytes_of(root node)` bytes each, plus
// `extra` buffers (scratch), and fills plan.memory. Returns the offsets of the extras.
std::vector<std::size_t> place_in_arena(Plan& plan, const Graph& graph, const std::function<std::size_t(int)>& bytes_of,
                                        const std::vector<BufferRequest>& extra);

// The model's inputs with their bound shapes, for messages: "input 'x' [64, 784]", or
// "inputs 'a' [2, 3], 'b' [2]".
std::string describe_inputs(const Plan& plan, const Graph& graph);

}  // namespace kg::plan
