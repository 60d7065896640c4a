#include <algorithm>

#include "ops/conv.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

using Build = std::function<std::vector<kg::SymTensor>(const kg::SymTensor&)>;

struct Built {
  std::shared_ptr<kg::Graph> graph;
  std::vector<kg::SymTensor> outputs;
};

Built record(kg::DType dt, std::int64_t c, std::int64_t hw, const Build& build) {
  auto [x, g] = kg::SymTensor::input(dt, {kg::Dim::named("batch"), c, hw, hw}, "x");
  return {g, build(x)};
}

int op_nodes(const kg::Model& m) {
  int n = 0;
  for (int id : m.live_nodes()) n += m.graph().node(id).kind == kg::Node::Kind::Op;
  return n;
}

const kg::Node* find_node(const kg::Model& m, const std::string& name) {
  int id = m.graph().find(name);
  return id < 0 ? nullptr : &m.graph().node(id);
}

// Random values for every parameter by name (running variances positive, the counter left).
std::map<std::string, kg::Tensor> random_params(const kg::Model& m, std::mt19937_64& rng) {
  std::map<std::string, kg::Tensor> p;
  for (const auto& info : m.parameters()) {
    if (info.dtype == kg::DType::I64) continue;
    const bool var = info.name.ends_with("running_var");
    p[info.name] = kg_test::random_tensor(rng, info.dtype, info.shape, var ? 0.5 : -1.0, var ? 1.5 : 1.0);
  }
  return p;
}

// Runs the recorded graph lowered for inference (fused) and for training (every node kept),
// with the same parameters and input; expects the same outputs.
// Returns the inference model for inspection.
kg::Model compare_fused(const Built& b, const kg::Tensor& x, std::mt19937_64& rng, double rtol = 1e-5) {
  kg::Model fused(b.graph, b.outputs, kg::LoweringMode::Inference);
  kg::Model plain(b.graph, b.outputs, kg::LoweringMode::Training);
  auto params = random_params(plain, rng);
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  kg::LoadedModel mf = fused.load(kg::Device::cpu(), {x.shape()}, opt);
  kg::LoadedModel mp = plain.load(kg::Device::cpu(), {x.shape()}, opt);
  // Every parameter of the unfused graph is still there, under its full name.
  std::vector<std::string> names_f, names_p;
  for (const auto& i : fused.parameters()) names_f.push_back(i.name);
  for (const auto& i : plain.parameters()) names_p.push_back(i.name);
  std::sort(names_f.begin(), names_f.end());
  std::sort(names_p.begin(), names_p.end());
  EXPECT_EQ(names_f, names_p);
  mf.load_state_dict(params, false);
  mp.load_state_dict(params, false);
  auto yf = mf.forward({x});
  auto yp = mp.forward({x});
  EXPECT_EQ(yf.size(), yp.size());
  for (std::size_t i = 0; i < std::min(yf.size(), yp.size()); ++i) {
    SCOPED_TRACE("output " + std::to_string(i));
    EXPECT_TRUE(kg_test::all_written(yf[i]));
    EXPECT_TRUE(kg_test::all_close(yf[i], yp[i], rtol, rtol));
  }
  return fused;
}

}  // namespace

TEST(FuseConv, ConvBnReluBecomesOneNodeWithTheSameOutputs) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
    SCOPED_TRACE(std::string(kg::dtype_name(dt)));
    Built b = record(dt, 3, 10, [](const kg::SymTensor& x) {
      kg::NameScope scope(x, "layer1");
      auto y = kg::nn::conv2d(x, 8, 3, {.padding = 1}, "conv1");
      y = kg::relu(kg::nn::batch_norm2d(y, "bn1"), "relu1");
      y = kg::nn::batch_norm2d(kg::nn::conv2d(y, 6, 3, {.stride = 2, .bias = false}, "conv2"), "bn2", 1e-3);
      y = kg::relu(kg::nn::conv2d(y, 5, 1, {}, "conv3"), "relu3");
      return std::vector<kg::SymTensor>{y};
    });
    for (std::int64_t batch : {1, 7}) {
      kg::Model m = compare_fused(b, kg_test::random_tensor(rng, dt, {batch, 3, 10, 10}), rng);
      EXPECT_EQ(op_nodes(m), 3);
      const kg::Node* c1 = find_node(m, "layer1.conv1");
      ASSERT_NE(c1, nullptr);
      EXPECT_EQ(c1->op_name(), "nn.fused_conv2d");
      std::vector<std::string> names;
      for (const auto& p : c1->params) names.push_back(p.name);
      EXPECT_EQ(names,
                (std::vector<std::string>{"layer1.conv1.weight", "layer1.conv1.bias", "layer1.bn1.weight",
                                          "layer1.bn1.bias", "layer1.bn1.running_mean",
                                          "layer1.bn1.running_var", "layer1.bn1.num_batches_tracked"}));
      const std::string attrs = c1->op->op().attributes();
      EXPECT_NE(attrs.find("batch_norm(eps=1e-05)"), std::string::npos) << attrs;
      EXPECT_NE(attrs.find("layer1.bn1:nn.batch_norm2d"), std::string::npos) << attrs;
      EXPECT_NE(attrs.find("layer1.relu1:nn.relu"), std::string::npos) << attrs;
      const std::string a2 = find_node(m, "layer1.conv2")->op->op().attributes();
      EXPECT_NE(a2.find("batch_norm(eps=0.001)"), std::string::npos) << a2;
      EXPECT_EQ(a2.find("nn.relu"), std::string::npos) << a2;
      const std::string a3 = find_node(m, "layer1.conv3")->op->op().attributes();
      EXPECT_NE(a3.find("epilogue=[nn.relu]"), std::string::npos) << a3;
      EXPECT_EQ(find_node(m, "layer1.bn1"), nullptr);
      EXPECT_EQ(find_node(m, "layer1.relu1"), nullptr);
    }
  }
}

TEST(FuseConv, BasicBlockWithResidualAndDownsample) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // torchvision's BasicBlock: the downsample branch is recorded after the main branch's bn2,
  // so the residual is computed after conv2 in node order.
  Built b = record(kg::DType::F32, 4, 12, [](const kg::SymTensor& x) {
    kg::NameScope scope(x, "layer2.0");
    auto y =
        kg::relu(kg::nn::batch_norm2d(
                     kg::nn::conv2d(x, 8, 3, {.stride = 2, .padding = 1, .bias = false}, "conv1"), "bn1"),
                 "relu1");
    y = kg::nn::batch_norm2d(kg::nn::conv2d(y, 8, 3, {.padding = 1, .bias = false}, "conv2"), "bn2");
    kg::SymTensor identity;
    {
      kg::NameScope ds(x, "downsample");
      identity = kg::nn::batch_norm2d(kg::nn::conv2d(x, 8, 1, {.stride = 2, .bias = false}, "0"), "1");
    }
    auto out = kg::relu(kg::add(y, identity, "add"), "relu2");
    // An identity block after it: the residual is the block's input.
    kg::NameScope next(x, "next");
    auto z = kg::nn::batch_norm2d(kg::nn::conv2d(out, 8, 3, {.padding = 1}, "conv"), "bn");
    return std::vector<kg::SymTensor>{kg::relu(kg::add(out, z, "add"), "relu")};
  });
  for (std::int64_t batch : {1, 7}) {
    kg::Model m = compare_fused(b, kg_test::random_tensor(rng, kg::DType::F32, {batch, 4, 12, 12}), rng);
    // conv1+bn1+relu1, conv2+bn2+add+relu2, downsample conv+bn, next conv+bn+add+relu.
    EXPECT_EQ(op_nodes(m), 4);
    const kg::Node* c2 = find_node(m, "layer2.0.conv2");
    ASSERT_NE(c2, nullptr);
    ASSERT_EQ(c2->inputs.size(), 2u);
    EXPECT_EQ(m.graph().node(c2->inputs[1]).name, "layer2.0.downsample.0");
    EXPECT_NE(c2->op->op().attributes().find("epilogue=[batch_norm(eps=1e-05) add nn.relu]"),
              std::string::npos)
        << c2->op->op().attributes();
    const kg::Node* nc = find_node(m, "layer2.0.next.conv");
    ASSERT_NE(nc, nullptr);
    ASSERT_EQ(nc->inputs.size(), 2u);
    EXPECT_EQ(nc->inputs[1], c2->id);
  }
}

TEST(FuseConv, LeavesSharedValuesAndOutputsAlone) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {3, 3, 8, 8});

  // The batch norm's output has two consumers: conv+bn fuse, the relu stays.
  Built shared_bn = record(kg::DType::F32, 3, 8, [](const kg::SymTensor& x) {
    auto bn = kg::nn::batch_norm2d(kg::nn::conv2d(x, 4, 3, {}, "conv"), "bn");
    return std::vector<kg::SymTensor>{kg::relu(bn, "relu"), kg::mul(bn, 2.0, "twice")};
  });
  kg::Model m1 = compare_fused(shared_bn, x, rng);
  EXPECT_EQ(op_nodes(m1), 3);
  ASSERT_NE(find_node(m1, "relu"), nullptr);
  EXPECT_EQ(find_node(m1, "relu")->op_name(), "nn.relu");
  EXPECT_EQ(find_node(m1, "conv")->op->op().attributes().find("nn.relu"), std::string::npos);

  // The batch norm's output is a model output: nothing after it fuses.
  Built bn_output = record(kg::DType::F32, 3, 8, [](const kg::SymTensor& x) {
    auto bn = kg::nn::batch_norm2d(kg::nn::conv2d(x, 4, 3, {}, "conv"), "bn");
    return std::vector<kg::SymTensor>{kg::relu(bn, "relu"), bn};
  });
  kg::Model m2 = compare_fused(bn_output, x, rng);
  EXPECT_EQ(op_nodes(m2), 2);
  EXPECT_EQ(find_node(m2, "relu")->op_name(), "nn.relu");

  // The convolution's output has two consumers: no fusion at all.
  Built shared_conv = record(kg::DType::F32, 3, 8, [](const kg::SymTensor& x) {
    auto c = kg::nn::conv2d(x, 4, 3, {}, "conv");
    return std::vector<kg::SymTensor>{kg::relu(kg::nn::batch_norm2d(c, "bn"), "relu"), kg::relu(c, "relu_b")};
  });
  kg::Model m3 = compare_fused(shared_conv, x, rng);
  EXPECT_EQ(op_nodes(m3), 4);
  EXPECT_EQ(find_node(m3, "conv")->op_name(), "nn.conv2d");
  EXPECT_EQ(find_node(m3, "bn")->op_name(), "nn.batch_norm2d");

  // The convolution is itself a model output.
  Built conv_output = record(kg::DType::F32, 3, 8, [](const kg::SymTensor& x) {
    auto c = kg::nn::conv2d(x, 4, 3, {}, "conv");
    return std::vector<kg::SymTensor>{c, kg::relu(c, "relu")};
  });
  kg::Model m4 = compare_fused(conv_output, x, rng);
  EXPECT_EQ(op_nodes(m4), 2);
  EXPECT_EQ(find_node(m4, "conv")->op_name(), "nn.conv2d");

  // A broadcasting add is not a residual.
  Built bcast = record(kg::DType::F32, 3, 8, [](const kg::SymTensor& x) {
    auto c = kg::nn::conv2d(x, 4, 3, {.padding = 1}, "conv");
    auto pooled = kg::global_avg_pool(c, "gap");
    auto d = kg::nn::conv2d(x, 4, 3, {.padding = 1}, "conv_b");
    return std::vector<kg::SymTensor>{kg::add(d, pooled, "add")};
  });
  kg::Model m5 = compare_fused(bcast, x, rng);
  EXPECT_EQ(find_node(m5, "conv_b")->op_name(), "nn.conv2d");
  EXPECT_EQ(find_node(m5, "add")->op_name(), "nn.add");
}

TEST(FuseConv, OtherActivationsAndDepthwiseResidual) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Built b = record(kg::DType::F64, 3, 9, [](const kg::SymTensor& x) {
    auto a = kg::silu(kg::nn::batch_norm2d(kg::nn::conv2d(x, 6, 3, {.padding = 1}, "c1"), "bn1"), "act1");
    // Depthwise, with the first block's output as the residual.
    auto d = kg::nn::batch_norm2d(kg::nn::conv2d(a, 6, 3, {.padding = 1, .groups = 6}, "dw"), "bn2");
    auto y = kg::leaky_relu(kg::add(d, a, "add"), 0.1, "act2");
    return std::vector<kg::SymTensor>{y};
  });
  kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F64, {5, 3, 9, 9});
  kg::Model m = compare_fused(b, x, rng, 1e-12);
  EXPECT_EQ(op_nodes(m), 2);
  EXPECT_NE(find_node(m, "c1")->op->op().attributes().find("nn.silu"), std::string::npos);
  EXPECT_NE(
      find_node(m, "dw")->op->op().attributes().find("epilogue=[batch_norm(eps=1e-05) add nn.leaky_relu]"),
      std::string::npos);
}

// Few output channels (LeNet-5's layers): the CPU computes these with the Rows algorithm, in
// both of its forms, and the fused epilogue (BatchNorm, residual, ReLU or another activation)
// must match the unfused graph.
TEST(FuseConv, EpilogueOnRowsConvolutions) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  using kg::ops::ConvAlgo;
  if (kg::ops::conv_algo_available(ConvAlgo::Rows, kg::DType::F32)) {
    const kg::ops::Conv2dOp c1(1, 6, 5, {.padding = 2}, kg::DType::F32), c2(6, 16, 5, {}, kg::DType::F32);
    EXPECT_EQ(kg::ops::conv_algo_for(c1, {3, 1, 28, 28}, kg::DType::F32), ConvAlgo::Rows);
    EXPECT_EQ(kg::ops::conv_algo_for(c2, {3, 6, 14, 14}, kg::DType::F32), ConvAlgo::Rows);
  }
  Built b = record(kg::DType::F32, 1, 28, [](const kg::SymTensor& x) {
    auto a = kg::relu(kg::nn::batch_norm2d(kg::nn::conv2d(x, 6, 5, {.padding = 2}, "c1"), "bn1"), "act1");
    auto p = kg::max_pool2d(a, 2, 2, 0, 1, false, "pool");
    auto main = kg::nn::batch_norm2d(kg::nn::conv2d(p, 16, 5, {}, "c2"), "bn2");
    auto side = kg::nn::conv2d(p, 16, 5, {}, "side");
    return std::vector<kg::SymTensor>{kg::silu(kg::add(main, side, "add"), "act2")};
  });
  for (std::int64_t batch : {1, 5}) {
    kg::Model m = compare_fused(b, kg_test::random_tensor(rng, kg::DType::F32, {batch, 1, 28, 28}), rng, 1e-4);
    EXPECT_NE(find_node(m, "c1")->op->op().attributes().find("epilogue=[batch_norm(eps=1e-05) nn.relu]"),
              std::string::npos);
    EXPECT_NE(find_node(m, "c2")->op->op().attributes().find("epilogue=[batch_norm(eps=1e-05) add nn.silu]"),
              std::string::npos);
  }
}

// Many channels on small images: the CPU computes these convolutions by gathering pixels of
// several images into one block (the Packed algorithm), and the fused epilogue must follow
// each pixel back to its image.
TEST(FuseConv, EpilogueOnBlocksSpanningImages) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  using kg::ops::ConvAlgo;
  if (kg::ops::conv_algo_available(ConvAlgo::Packed, kg::DType::F32)) {
    const kg::ops::Conv2dOp c3(16, 256, 3, {.padding = 1}, kg::DType::F32),
        c1(16, 256, 1, {}, kg::DType::F32);
    EXPECT_EQ(kg::ops::conv_algo_for(c3, {7, 16, 5, 5}, kg::DType::F32), ConvAlgo::Packed);
    EXPECT_EQ(kg::ops::conv_algo_for(c1, {7, 16, 5, 5}, kg::DType::F32), ConvAlgo::Packed);
  }
  Built b = record(kg::DType::F32, 16, 5, [](const kg::SymTensor& x) {
    auto main = kg::nn::batch_norm2d(kg::nn::conv2d(x, 256, 3, {.padding = 1}, "conv"), "bn");
    auto side = kg::nn::batch_norm2d(kg::nn::conv2d(x, 256, 1, {.bias = false}, "proj"), "proj_bn");
    return std::vector<kg::SymTensor>{kg::relu(kg::add(main, side, "add"), "relu")};
  });
  for (std::int64_t batch : {1, 7}) {
    kg::Model m = compare_fused(b, kg_test::random_tensor(rng, kg::DType::F32, {batch, 16, 5, 5}), rng, 1e-4);
    EXPECT_EQ(op_nodes(m), 2);
    EXPECT_NE(
        find_node(m, "conv")->op->op().attributes().find("epilogue=[batch_norm(eps=1e-05) add nn.relu]"),
        std::string::npos);
  }
}
