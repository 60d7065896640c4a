// Running a CPU inference model in slices of its batch (LoadOptions::tune). At batch 64 the
// activations of a model such as MobileNetV2 are hundreds of megabytes per layer, and each layer
// streams them from and to memory; run two images at a time instead, and a layer's input is
// still in cache from the layer before. Whether that is faster depends on the model (ResNet-18's
// convolutions are bound by arithmetic and lose a little), so the load that tunes times the
// whole batch and a few slice sizes and keeps the fastest.
#pragma once

#include <cstdint>
#include <vector>

#include "kg/graph.hpp"
#include "plan/shape_binding.hpp"

namespace kg::runtime {

// True when every live node computes each sample of the batch (dim 0, of size `batch` in every
// input, output and intermediate value) from that sample alone: convolutions, pooling, linear
// layers, BatchNorm in inference, elementwise ops (those with an ElementwiseForm, the user's
// included), fused groups and views and permutations that keep dim 0 first. Anything else, a
// user's op without an ElementwiseForm among them, keeps the whole batch together.
bool per_sample(const Graph& graph, const std::vector<int>& live, const plan::BoundShapes& bound,
                std::int64_t batch);

// The slice size that the environment variable KG_BATCH_SLICE forces (0 when unset or empty);
// throws kg::Error when it is set to anything but a positive integer.
std::int64_t forced_slice();

// The slice sizes worth timing for `batch`: 1, 2, 4 and 8 where they divide it and are smaller.
std::vector<std::int64_t> slice_candidates(std::int64_t batch);

}  // namespace kg::runtime
