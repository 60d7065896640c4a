// Reference models built from the public ops, with PyTorch's parameter names, so that weights
// exported from PyTorch (or the ONNX exports in bench/) load by name.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "kg/model.hpp"

namespace kg::models {

// LeNet-5 for [N, 1, 28, 28] inputs (padding 2 on the first conv), ReLU and max pooling:
// features.{0 conv 6@5x5, 1 relu, 2 maxpool, 3 conv 16@5x5, 4 relu, 5 maxpool},
// classifier.{0 linear 400→120, 1 relu, 2 linear 120→84, 3 relu, 4 linear 84→num_classes}.
SymTensor lenet5(const SymTensor& x, std::int64_t num_classes = 10);

// The same LeNet-5 (names, max pooling) with LeCun's scaled tanh as every activation
// (features.1, features.4, classifier.1, classifier.3 are lenet.scaled_tanh custom ops).
SymTensor lenet5_tanh(const SymTensor& x, std::int64_t num_classes = 10);

// LeCun's scaled hyperbolic tangent y = A·tanh(S·x), a custom op ("lenet.scaled_tanh") with a CPU
// forward and backward and CUDA kernels for both, for f32 or f64 inputs of any shape.
CustomData scaled_tanh_op(DType dtype = DType::F32, double amplitude = 1.7159, double slope = 2.0 / 3.0);
// Records scaled_tanh_op(x.dtype()) after `x`.
SymTensor scaled_tanh(const SymTensor& x, const std::string& name = "");

// Swish y = x·sigmoid(x) as a user's custom op ("user.swish"): CPU and CUDA forward and backward,
// and its per-element form, so that it fuses (f32 or f64).
CustomData swish_op();
SymTensor swish(const SymTensor& x, const std::string& name = "");

// ResNet-18 for [N, 3, H, W] inputs with torchvision's names (conv1, bn1, layer1.0.conv1, ...,
// fc).
SymTensor resnet18(const SymTensor& x, std::int64_t num_classes = 1000);
// The same with `activation` (e.g. swish) in place of every ReLU; the names do not change.
SymTensor resnet18_with(const SymTensor& x,
                        const std::function<SymTensor(const SymTensor&, const std::string&)>& activation,
                        std::int64_t num_classes = 1000);

// Names the CLI accepts: "lenet5", "resnet18", "lenet5-tanh", "resnet18-swish".
std::vector<std::string> names();
// Records the named model's layers on `x` (which must have the model's input shape) and
// returns its logits; for graphs with more than the model in them (a loss, a second input).
SymTensor record(const std::string& name, const SymTensor& x);
// Records the named model with a dynamic batch dim ("batch") and returns it with its output
// named "logits", optimised as `options` say. Throws kg::Error for an unknown name, listing the
// known ones.
Model build(const std::string& name, LoweringMode mode = LoweringMode::Inference, const ModelOptions& options = {});
// The input shape of a named model for a given batch size.
std::vector<std::int64_t> input_shape(const std::string& name, std::int64_t batch);

}  // namespace kg::models
