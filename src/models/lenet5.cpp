// LeNet-5 with torch.nn.Sequential names: features.{0..5}, classifier.{0..4}; with ReLU (lenet5)
// or LeCun's scaled tanh custom op (lenet5-tanh) as the activations.
#include "kg/models.hpp"
#include "kg/ops.hpp"
#include "util/str.hpp"

namespace kg::models {

namespace {

using Activation = SymTensor (*)(const SymTensor&, const std::string&);

SymTensor relu_activation(const SymTensor& x, const std::string& name) { return relu(x, name); }

SymTensor lenet5_with(const char* model, const SymTensor& x, std::int64_t num_classes, Activation act) {
  if (num_classes <= 0) throw Error(util::cat(model, ": num_classes must be positive, got ", num_classes));
  const Shape& s = x.shape();
  // The classifier's 400 inputs are 16 maps of 5x5, which only a 28x28 image gives.
  if (s.rank() != 4 || s[1] != Dim(1) || s[2] != Dim(28) || s[3] != Dim(28))
    throw Error(
        util::cat(model, ": expects an input [N, 1, 28, 28], got ", s.to_string(), " from '", x.name(), "'"));
  SymTensor h = x;
  {
    NameScope scope(h, "features");
    nn::Conv2dOptions pad2;
    pad2.padding = 2;
    h = nn::conv2d(h, 6, 5, pad2, "0");  // [N, 6, 28, 28]
    h = act(h, "1");
    h = max_pool2d(h, 2, 2, 0, 1, false, "2");  // [N, 6, 14, 14]
    h = nn::conv2d(h, 16, 5, {}, "3");          // [N, 16, 10, 10]
    h = act(h, "4");
    h = max_pool2d(h, 2, 2, 0, 1, false, "5");  // [N, 16, 5, 5]
  }
  h = flatten(h, 1, -1, "flatten");  // [N, 400]
  NameScope scope(h, "classifier");
  h = nn::linear(h, 120, "0");
  h = act(h, "1");
  h = nn::linear(h, 84, "2");
  h = act(h, "3");
  return nn::linear(h, num_classes, "4");
}

}  // namespace

SymTensor lenet5(const SymTensor& x, std::int64_t num_classes) {
  return lenet5_with("lenet5", x, num_classes, relu_activation);
}

SymTensor lenet5_tanh(const SymTensor& x, std::int64_t num_classes) {
  return lenet5_with("lenet5-tanh", x, num_classes, scaled_tanh);
}

}  // namespace kg::models
