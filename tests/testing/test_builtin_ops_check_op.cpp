// Every built-in op through kg::testing::check_op, the checker custom-op authors use: shapes at
// several batch sizes, the CPU implementation on poisoned outputs, the CUDA kernel under the
// emulator (checked mode) against the CPU, a GPU where present, and bitwise-equal reruns.
// Views (flatten, reshape) have no kernel and no CPU work; their tests are in test_shape_ops.
#include <gtest/gtest.h>

#include <functional>

#include "kg/testing.hpp"
#include "support/test_util.hpp"

namespace {

struct Case {
  std::string name;
  std::vector<kg::Shape> shapes;  // dim 0 dynamic: bound to each batch size
  std::function<kg::SymTensor(const std::vector<kg::SymTensor>&)> build;
  kg::DType dtype = kg::DType::F32;
  double rtol = 1e-5, atol = 1e-6;
};

kg::Dim b() { return kg::Dim::named("b"); }

std::vector<Case> cases() {
  using V = std::vector<kg::SymTensor>;
  const double red_rtol = 1e-4, red_atol = 1e-5;  // reductions sum in another order on the GPU path
  return {
      {"relu", {{b(), 3, 17}}, [](const V& x) { return kg::relu(x[0]); }},
      {"leaky_relu", {{b(), 3, 17}}, [](const V& x) { return kg::leaky_relu(x[0], 0.2); }},
      {"silu", {{b(), 3, 17}}, [](const V& x) { return kg::silu(x[0]); }},
      {"gelu_erf", {{b(), 3, 17}}, [](const V& x) { return kg::gelu(x[0]); }},
      {"gelu_tanh", {{b(), 3, 17}}, [](const V& x) { return kg::gelu(x[0], kg::GeluApprox::Tanh); }},
      {"sigmoid", {{b(), 3, 17}}, [](const V& x) { return kg::sigmoid(x[0]); }},
      {"tanh", {{b(), 3, 17}}, [](const V& x) { return kg::tanh(x[0]); }},
      {"dropout", {{b(), 3, 17}}, [](const V& x) { return kg::dropout(x[0], 0.3); }},
      {"add_broadcast", {{b(), 4, 5, 6}, {4, 1, 6}}, [](const V& x) { return kg::add(x[0], x[1]); }},
      {"sub_broadcast", {{b(), 4, 5, 6}, {6}}, [](const V& x) { return kg::sub(x[0], x[1]); }},
      {"mul_same", {{b(), 4, 5}, {b(), 4, 5}}, [](const V& x) { return kg::mul(x[0], x[1]); }},
      {"div_channel", {{b(), 4, 5, 6}, {4, 1, 1}}, [](const V& x) { return kg::div(x[0], x[1]); }},
      {"add_scalar", {{b(), 7}}, [](const V& x) { return kg::add(x[0], 1.5); }},
      {"rsub_scalar", {{b(), 7}}, [](const V& x) { return kg::rsub(x[0], 2.0); }},
      {"rdiv_scalar", {{b(), 7}}, [](const V& x) { return kg::rdiv(x[0], 2.0); }},
      {"matmul", {{b(), 3, 5}, {5, 4}}, [](const V& x) { return kg::matmul(x[0], x[1]); }, kg::DType::F32, red_rtol,
       red_atol},
      {"softmax_last", {{b(), 3, 10}}, [](const V& x) { return kg::softmax(x[0], -1); }},
      {"softmax_inner", {{b(), 6, 5}}, [](const V& x) { return kg::softmax(x[0], 1); }},
      {"log_softmax", {{b(), 3, 10}}, [](const V& x) { return kg::log_softmax(x[0], -1); }, kg::DType::F32, red_rtol,
       red_atol},
      {"permute", {{b(), 3, 4, 5}}, [](const V& x) { return kg::permute(x[0], {0, 2, 3, 1}); }},
      {"transpose", {{b(), 3, 4}}, [](const V& x) { return kg::transpose(x[0], 1, 2); }},
      {"concat", {{b(), 2, 5}, {b(), 3, 5}}, [](const V& x) { return kg::concat({x[0], x[1]}, 1); }},
      {"slice", {{b(), 4, 9}}, [](const V& x) { return kg::slice(x[0], 2, 1, 8, 2); }},
      {"max_pool2d", {{b(), 3, 9, 9}}, [](const V& x) { return kg::max_pool2d(x[0], 3, 2, 1); }},
      {"avg_pool2d", {{b(), 3, 9, 9}}, [](const V& x) { return kg::avg_pool2d(x[0], 3, 2, 1, true, false); }},
      {"global_avg_pool", {{b(), 3, 7, 5}}, [](const V& x) { return kg::global_avg_pool(x[0]); }, kg::DType::F32,
       red_rtol, red_atol},
      {"upsample_nearest2d", {{b(), 2, 3, 4}}, [](const V& x) { return kg::upsample_nearest2d(x[0], 2); }},
      {"linear", {{b(), 12}}, [](const V& x) { return kg::nn::linear(x[0], 7); }, kg::DType::F32, red_rtol, red_atol},
      {"conv2d", {{b(), 3, 9, 9}}, [](const V& x) { return kg::nn::conv2d(x[0], 8, 3, {.padding = 1}); },
       kg::DType::F32, red_rtol, red_atol},
      {"conv2d_grouped_strided", {{b(), 4, 9, 9}},
       [](const V& x) { return kg::nn::conv2d(x[0], 6, 3, {.stride = 2, .dilation = 2, .groups = 2}); }, kg::DType::F32,
       red_rtol, red_atol},
      {"batch_norm2d", {{b(), 4, 6, 6}}, [](const V& x) { return kg::nn::batch_norm2d(x[0]); }, kg::DType::F32,
       red_rtol, red_atol},
      {"layer_norm", {{b(), 5, 8}}, [](const V& x) { return kg::nn::layer_norm(x[0], {8}); }, kg::DType::F32, red_rtol,
       red_atol},
      {"conv2d_f64", {{b(), 2, 6, 6}}, [](const V& x) { return kg::nn::conv2d(x[0], 3, 3); }, kg::DType::F64, 1e-10,
       1e-12},
      {"softmax_f64", {{b(), 3, 10}}, [](const V& x) { return kg::softmax(x[0], -1); }, kg::DType::F64, 1e-12, 1e-14},
      {"mse_loss", {{b(), 3, 5}, {b(), 3, 5}}, [](const V& x) { return kg::mse_loss(x[0], x[1]); }, kg::DType::F32,
       red_rtol, red_atol},
      {"attention", {{b(), 3, 5, 8}, {b(), 3, 7, 8}, {b(), 3, 7, 6}},
       [](const V& x) { return kg::nn::attention(x[0], x[1], x[2], {}, true); }, kg::DType::F32, red_rtol, red_atol},
  };
}

// The op of the last node `build` records on fresh inputs of the case's shapes.
kg::CustomData recorded(const Case& c) {
  auto g = kg::Graph::create();
  std::vector<kg::SymTensor> xs;
  for (std::size_t i = 0; i < c.shapes.size(); ++i) xs.push_back(g->input(c.dtype, c.shapes[i]));
  kg::SymTensor y = c.build(xs);
  return *g->node(y.node()).op;
}

}  // namespace

TEST(CheckOp, EveryBuiltInOpPasses) {
  const auto seed = kg_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    kg::testing::CheckOpOptions o;
    o.seed = seed;
    o.batch_sizes = {1, 3};
    o.rtol = c.rtol;
    o.atol = c.atol;
    o.reruns = 1;
    const kg::CustomData op = recorded(c);
    const auto r = kg::testing::check_op(op, c.shapes, std::vector<kg::DType>(c.shapes.size(), c.dtype), o);
    EXPECT_TRUE(r.ok) << r.to_string();
    // The emulated kernel ran and matched at every batch size; an op with a backward had its
    // gradients checked against finite differences at the largest one.
    int emulated = 0, gradients = 0;
    for (const auto& l : r.lines) {
      emulated += l.rfind("PASS batch ", 0) == 0 && l.find(", emulator") != std::string::npos &&
                  l.find("elementwise form") == std::string::npos;
      gradients += l.rfind("PASS gradients batch 3, cpu_backward, ", 0) == 0;
    }
    EXPECT_EQ(emulated, 2) << r.to_string();
    if (op->has_cpu_backward()) {
      EXPECT_GT(gradients, 0) << r.to_string();
    }
  }
}
