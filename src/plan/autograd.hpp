// Planning the backward pass of a model lowered for training: which ops run a backward, where
// each gradient lives, which forward activations stay alive until their backward, and where
// gradients from several consumers are summed.
#pragma once

#include <functional>
#include <string>

#include "kg/graph.hpp"
#include "plan/plan.hpp"
#include "plan/shape_binding.hpp"

namespace kg::plan {

// Whether the node's op has a backward on the device the model is loaded on.
using HasBackward = std::function<bool(const Node& node)>;

// The output node backward() starts from: the output named `loss`, or (empty) the only output
// of rank 0; -1 when there is none. A named output that is missing or not a scalar throws.
int find_loss(const Graph& graph, const std::vector<std::pair<std::string, int>>& outputs,
              const BoundShapes& bound, const std::string& loss);

// Fills plan.training from the loss node and extends the lifetimes (plan.last) of the forward
// values a backward reads. An op on a path from a trainable parameter to the loss without a
// backward is an error naming it, the parameter and the loss.
void plan_training(const Graph& graph, Plan& plan, int loss_node, const std::string& loss_name,
                   const HasBackward& has_backward);

}  // namespace kg::plan
