// ResNet-18 with torchvision's module names, so that its state_dict loads by name.
#include "kg/models.hpp"
#include "kg/ops.hpp"
#include "util/str.hpp"

namespace kg::models {
namespace {

nn::Conv2dOptions conv_opts(std::int64_t stride, std::int64_t padding) {
  nn::Conv2dOptions o;
  o.stride = stride;
  o.padding = padding;
  o.bias = false;
  return o;
}

// torchvision's BasicBlock: conv3x3(stride) → bn → relu → conv3x3 → bn, plus the identity (or a
// 1x1 strided conv + bn when the shape changes), then relu.
using Activation = std::function<SymTensor(const SymTensor&, const std::string&)>;

SymTensor basic_block(const SymTensor& x, std::int64_t planes, std::int64_t stride, const std::string& name,
                      const Activation& act) {
  NameScope scope(x, name);
  const std::int64_t in_planes = x.shape()[1].size();
  SymTensor h = nn::conv2d(x, planes, 3, conv_opts(stride, 1), "conv1");
  h = nn::batch_norm2d(h, "bn1");
  h = act(h, "relu");
  h = nn::conv2d(h, planes, 3, conv_opts(1, 1), "conv2");
  h = nn::batch_norm2d(h, "bn2");
  SymTensor identity = x;
  if (stride != 1 || in_planes != planes) {
    NameScope ds(x, "downsample");
    identity = nn::conv2d(x, planes, 1, conv_opts(stride, 0), "0");
    identity = nn::batch_norm2d(identity, "1");
  }
  h = add(h, identity, "add");
  return act(h, "relu_1");
}

SymTensor layer(const SymTensor& x, std::int64_t planes, std::int64_t stride, const std::string& name,
                const Activation& act) {
  NameScope scope(x, name);
  SymTensor h = basic_block(x, planes, stride, "0", act);
  return basic_block(h, planes, 1, "1", act);
}

}  // namespace

SymTensor resnet18(const SymTensor& x, std::int64_t num_classes) {
  return resnet18_with(x, [](const SymTensor& h, const std::string& n) { return relu(h, n); }, num_classes);
}

SymTensor resnet18_with(const SymTensor& x, const Activation& act, std::int64_t num_classes) {
  if (num_classes <= 0) throw Error(util::cat("resnet18: num_classes must be positive, got ", num_classes));
  const Shape& s = x.shape();
  if (s.rank() != 4 || s[1].is_dynamic() || s[1].size() != 3)
    throw Error("resnet18: expects an input [N, 3, H, W], got " + s.to_string() + " from '" + x.name() + "'");
  SymTensor h = nn::conv2d(x, 64, 7, conv_opts(2, 3), "conv1");
  h = nn::batch_norm2d(h, "bn1");
  h = act(h, "relu");
  h = max_pool2d(h, 3, 2, 1, 1, false, "maxpool");
  h = layer(h, 64, 1, "layer1", act);
  h = layer(h, 128, 2, "layer2", act);
  h = layer(h, 256, 2, "layer3", act);
  h = layer(h, 512, 2, "layer4", act);
  h = global_avg_pool(h, "avgpool");
  h = flatten(h, 1, -1, "flatten");
  return nn::linear(h, num_classes, "fc");
}

}  // namespace kg::models
