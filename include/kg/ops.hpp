// Built-in ops: functions that record a node and return its output. Every one is a CustomOp
// shipped with the library. `name` is the node's name inside the current NameScope
// (default: derived from the op). Layers with parameters live in kg::nn and take their
// PyTorch names and layouts (a Conv2d node "features.0" owns "features.0.weight",
// [out, in/groups, kh, kw], and "features.0.bias").
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kg/graph.hpp"

namespace kg {

// A pair of sizes for 2-D ops; a single number means the same for height and width.
struct Size2 {
  std::int64_t h = 0, w = 0;
  Size2(std::int64_t v) : h(v), w(v) {}  // NOLINT: implicit on purpose
  Size2(int v) : h(v), w(v) {}           // NOLINT
  Size2(std::int64_t hh, std::int64_t ww) : h(hh), w(ww) {}
};

// ---- elementwise activations (any shape; float dtypes) ----
SymTensor relu(const SymTensor& x, const std::string& name = "");
SymTensor leaky_relu(const SymTensor& x, double negative_slope = 0.01, const std::string& name = "");
SymTensor silu(const SymTensor& x, const std::string& name = "");
enum class GeluApprox { Erf, Tanh };
SymTensor gelu(const SymTensor& x, GeluApprox approx = GeluApprox::Erf, const std::string& name = "");
SymTensor sigmoid(const SymTensor& x, const std::string& name = "");
SymTensor tanh(const SymTensor& x, const std::string& name = "");
// Zeroes elements with probability p and scales the rest by 1/(1-p) in training; identity
// in inference.
SymTensor dropout(const SymTensor& x, double p = 0.5, const std::string& name = "");

// ---- binary arithmetic with numpy broadcasting, and scalar forms ----
SymTensor add(const SymTensor& a, const SymTensor& b, const std::string& name = "");
SymTensor sub(const SymTensor& a, const SymTensor& b, const std::string& name = "");
SymTensor mul(const SymTensor& a, const SymTensor& b, const std::string& name = "");
SymTensor div(const SymTensor& a, const SymTensor& b, const std::string& name = "");
SymTensor add(const SymTensor& a, double b, const std::string& name = "");
SymTensor sub(const SymTensor& a, double b, const std::string& name = "");
SymTensor mul(const SymTensor& a, double b, const std::string& name = "");
SymTensor div(const SymTensor& a, double b, const std::string& name = "");
// b - a and b / a for a scalar b.
SymTensor rsub(const SymTensor& a, double b, const std::string& name = "");
SymTensor rdiv(const SymTensor& a, double b, const std::string& name = "");
inline SymTensor operator+(const SymTensor& a, const SymTensor& b) { return add(a, b); }
inline SymTensor operator-(const SymTensor& a, const SymTensor& b) { return sub(a, b); }
inline SymTensor operator*(const SymTensor& a, const SymTensor& b) { return mul(a, b); }
inline SymTensor operator/(const SymTensor& a, const SymTensor& b) { return div(a, b); }
inline SymTensor operator+(const SymTensor& a, double b) { return add(a, b); }
inline SymTensor operator-(const SymTensor& a, double b) { return sub(a, b); }
inline SymTensor operator*(const SymTensor& a, double b) { return mul(a, b); }
inline SymTensor operator/(const SymTensor& a, double b) { return div(a, b); }
inline SymTensor operator+(double a, const SymTensor& b) { return add(b, a); }
inline SymTensor operator-(double a, const SymTensor& b) { return rsub(b, a); }
inline SymTensor operator*(double a, const SymTensor& b) { return mul(b, a); }
inline SymTensor operator/(double a, const SymTensor& b) { return rdiv(b, a); }

// ---- matrix products ----
// torch.matmul semantics: 1-D and 2-D operands, and batched operands whose leading dims
// broadcast.
SymTensor matmul(const SymTensor& a, const SymTensor& b, const std::string& name = "");

// ---- softmax family (over one dim; negative counts from the end) ----
SymTensor softmax(const SymTensor& x, std::int64_t dim = -1, const std::string& name = "");
SymTensor log_softmax(const SymTensor& x, std::int64_t dim = -1, const std::string& name = "");

// ---- shape ops ----
// Merges dims start..end (inclusive; negative counts from the end) into one.
SymTensor flatten(const SymTensor& x, std::int64_t start_dim = 1, std::int64_t end_dim = -1,
                  const std::string& name = "");
// New sizes with the same element count; one entry may be -1 (inferred), and 0 keeps the
// input's size in that position.
SymTensor reshape(const SymTensor& x, const std::vector<std::int64_t>& sizes,
                  const std::string& name = "");
SymTensor transpose(const SymTensor& x, std::int64_t dim0, std::int64_t dim1,
                    const std::string& name = "");
SymTensor permute(const SymTensor& x, const std::vector<std::int64_t>& dims,
                  const std::string& name = "");
SymTensor concat(const std::vector<SymTensor>& xs, std::int64_t dim, const std::string& name = "");
// Elements start, start+step, ... below end along `dim` (Python slice rules for negative and
// out-of-range start/end; step > 0).
SymTensor slice(const SymTensor& x, std::int64_t dim, std::int64_t start, std::int64_t end,
                std::int64_t step = 1, const std::string& name = "");

// ---- pooling and resampling on [N, C, H, W] ----
// stride 0 means stride = kernel (PyTorch's default).
SymTensor max_pool2d(const SymTensor& x, Size2 kernel, Size2 stride = 0, Size2 padding = 0,
                     Size2 dilation = 1, bool ceil_mode = false, const std::string& name = "");
SymTensor avg_pool2d(const SymTensor& x, Size2 kernel, Size2 stride = 0, Size2 padding = 0,
                     bool ceil_mode = false, bool count_include_pad = true,
                     const std::string& name = "");
// Mean over H and W: [N, C, H, W] → [N, C, 1, 1] (AdaptiveAvgPool2d(1)).
SymTensor global_avg_pool(const SymTensor& x, const std::string& name = "");
SymTensor upsample_nearest2d(const SymTensor& x, Size2 scale_factor, const std::string& name = "");

// ---- losses (scalar outputs [] that LoadedModel::backward starts from) ----
// Mean cross-entropy of logits [N, C] against integer class labels [N] (i32 or i64). A label
// outside [0, C) is an error naming the node, the row and the label when the loss runs.
SymTensor cross_entropy(const SymTensor& logits, const SymTensor& labels, const std::string& name = "");
// Mean squared error mean((prediction - target)²) over every element; equal shapes.
SymTensor mse_loss(const SymTensor& prediction, const SymTensor& target, const std::string& name = "");

namespace nn {

// y = x Wᵀ + b over the last dim. weight [out, in], bias [out]. The last dim must be known.
SymTensor linear(const SymTensor& x, std::int64_t out_features, const std::string& name = "",
                 bool bias = true);

struct Conv2dOptions {
  Size2 stride = 1;
  Size2 padding = 0;
  Size2 dilation = 1;
  std::int64_t groups = 1;
  bool bias = true;
};
// [N, C, H, W] → [N, out_channels, H', W']. weight [out, C/groups, kh, kw], bias [out].
SymTensor conv2d(const SymTensor& x, std::int64_t out_channels, Size2 kernel,
                 const Conv2dOptions& options = {}, const std::string& name = "");

// Over the channels of [N, C, H, W]: weight, bias, running_mean, running_var,
// num_batches_tracked (PyTorch's names).
SymTensor batch_norm2d(const SymTensor& x, const std::string& name = "", double eps = 1e-5,
                       double momentum = 0.1);

// Over the trailing dims given by normalized_shape: weight and bias of that shape.
SymTensor layer_norm(const SymTensor& x, const std::vector<std::int64_t>& normalized_shape,
                     const std::string& name = "", double eps = 1e-5,
                     bool elementwise_affine = true);

// Scaled dot-product attention, softmax(scale · q kᵀ + mask) v over the keys: q [batch..., Sq, D],
// k [batch..., Sk, D], v [batch..., Sk, Dv] → [batch..., Sq, Dv] (heads are a batch dim). `mask`
// (optional) broadcasts to [batch..., Sq, Sk]: bool (true = keep) or additive (q's dtype).
// `causal` masks key j > query i (top-left aligned); `scale` defaults to 1/sqrt(D). A query whose
// every key is masked gives zeros. f32, f64, f16 and bf16 (computed in f32).
SymTensor attention(const SymTensor& q, const SymTensor& k, const SymTensor& v, const SymTensor& mask = {},
                    bool causal = false, std::optional<double> scale = std::nullopt, const std::string& name = "");

}  // namespace nn
}  // namespace kg
