// The ONNX importer: dynamic dims, initializers as named parameters, symbolic shape chains,
// custom ops by domain, the one-error list of unsupported ops, bad files, and exported models
// (BERT, GPT-2, a CNN) against ONNX Runtime's outputs.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "../../examples/rmsnorm/rmsnorm.hpp"
#include "kg/io.hpp"
#include "kg/onnx.hpp"
#include "support/onnx_builder.hpp"
#include "support/test_util.hpp"

using kg_test::OnnxBuilder;

namespace {

namespace fs = std::filesystem;

std::string temp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("kg_onnx_" + std::to_string(::getpid()) + "_" + name)).string();
}
void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

kg::Tensor random_f32(std::mt19937_64& rng, std::vector<std::int64_t> shape) {
  return kg_test::random_tensor(rng, kg::DType::F32, std::move(shape));
}

// y = relu(x · Wᵀ + b) as PyTorch exports nn.Linear + ReLU, batch named "batch".
OnnxBuilder linear_relu(const kg::Tensor& w, const kg::Tensor& b) {
  OnnxBuilder m;
  m.input("x", kg::DType::F32, {std::string("batch"), w.dim(1)});
  m.initializer("fc.weight", w);
  m.initializer("fc.bias", b);
  auto& g = m.node("Gemm", {"x", "fc.weight", "fc.bias"}, {"h"}, "/fc/Gemm");
  OnnxBuilder::attr(g, "transB", std::int64_t{1});
  m.node("Relu", {"h"}, {"y"}, "/relu/Relu");
  m.output("y");
  return m;
}

TEST(OnnxImport, LinearReluKeepsTheBatchDynamicAndNamesParametersAsTheFile) {
  const auto seed = kg_test::fresh_seed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const kg::Tensor w = random_f32(rng, {3, 5}), b = random_f32(rng, {3});
  kg::Model model = kg::onnx::import_bytes(linear_relu(w, b).bytes(), "linear.onnx");
  const auto inputs = kg::onnx::model_inputs(model);
  ASSERT_EQ(inputs.size(), 1u);
  EXPECT_EQ(inputs[0].name, "x");
  EXPECT_EQ(inputs[0].shape.to_string(), "[batch, 5]");
  std::vector<std::string> names;
  for (const auto& p : model.parameters()) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"fc.weight", "fc.bias"}));
  for (std::int64_t batch : {1, 4}) {
    const kg::Tensor x = random_f32(rng, {batch, 5});
    kg::LoadOptions o;
    o.poison_buffers = true;
    kg::LoadedModel lm = model.load(kg::Device::cpu(), {x.shape()}, o);
    const kg::Tensor y = lm.forward({x}).at(0);
    ASSERT_EQ(y.shape(), (std::vector<std::int64_t>{batch, 3}));
    std::vector<double> want;
    for (std::int64_t i = 0; i < batch; ++i)
      for (std::int64_t j = 0; j < 3; ++j) {
        double s = b.item(j);
        for (std::int64_t k = 0; k < 5; ++k) s += x.item(i * 5 + k) * w.item(j * 5 + k);
        want.push_back(std::max(0.0, s));
      }
    EXPECT_TRUE(kg_test::matches(y, want, 1e-5, 1e-6));
    // The weights round-trip by their ONNX names.
    const auto sd = lm.state_dict();
    ASSERT_TRUE(sd.count("fc.weight"));
    EXPECT_TRUE(kg_test::all_close(sd.at("fc.weight"), w, 0, 0));
  }
}

TEST(OnnxImport, ImportedGraphNamesItsOutputsAndSupportedOpsAreListed) {
  const auto seed = kg_test::fresh_seed();
  std::mt19937_64 rng(seed);
  kg::onnx::ImportedGraph g =
      kg::onnx::import_graph_bytes(linear_relu(random_f32(rng, {3, 5}), random_f32(rng, {3})).bytes(), "g.onnx");
  EXPECT_EQ(g.output("y").shape().to_string(), "[batch, 3]");
  kg_test::expect_error([&] { g.output("logits"); }, {"no output 'logits'", "outputs: y"});
  const auto ops = kg::onnx::supported_ops();
  for (const char* op : {"Conv", "Gemm", "Reshape", "LayerNormalization", "Resize"})
    EXPECT_NE(std::find(ops.begin(), ops.end(), op), ops.end()) << op;
  EXPECT_EQ(std::find(ops.begin(), ops.end(), "Loop"), ops.end());
}

TEST(OnnxImport, ShapeGatherConcatReshapeChainKeepsTheDynamicBatch) {
  const auto seed = kg_test::fresh_seed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  OnnxBuilder m;
  m.input("x", kg::DType::F32, {std::string("batch"), std::int64_t{6}});
  m.initializer("zero", kg::Tensor::from_vector<std::int64_t>({}, {0}));
  m.initializer("axes0", kg::Tensor::from_vector<std::int64_t>({1}, {0}));
  m.initializer("rest", kg::Tensor::from_vector<std::int64_t>({2}, {2, 3}));
  m.node("Shape", {"x"}, {"s"});
  auto& g = m.node("Gather", {"s", "zero"}, {"n"});
  OnnxBuilder::attr(g, "axis", std::int64_t{0});
  m.node("Unsqueeze", {"n", "axes0"}, {"n1"});
  auto& c = m.node("Concat", {"n1", "rest"}, {"target"});
  OnnxBuilder::attr(c, "axis", std::int64_t{0});
  m.node("Reshape", {"x", "target"}, {"r"});
  m.node("Neg", {"r"}, {"y"});
  m.output("y");
  kg::Model model = kg::onnx::import_bytes(m.bytes(), "chain.onnx");
  EXPECT_EQ(model.graph().node(model.outputs()[0].second).shape.to_string(), "[batch, 2, 3]");
  for (std::int64_t batch : {2, 5}) {
    const kg::Tensor x = random_f32(rng, {batch, 6});
    kg::LoadedModel lm = model.load(kg::Device::cpu(), {x.shape()});
    const kg::Tensor y = lm.forward({x}).at(0);
    ASSERT_EQ(y.shape(), (std::vector<std::int64_t>{batch, 2, 3}));
    std::vector<double> want;
    for (std::int64_t i = 0; i < x.numel(); ++i) want.push_back(-x.item(i));
    EXPECT_TRUE(kg_test::matches(y, want, 0, 0));
  }
}

TEST(OnnxImport, EveryUnsupportedOpIsListedInOneError) {
  OnnxBuilder m;
  m.import_domain("com.example", 1);
  m.input("x", kg::DType::F32, {std::int64_t{2}, std::int64_t{3}});
  m.node("Foo", {"x"}, {"a"}, "foo_first", "com.example");
  m.node("Foo", {"a"}, {"b"}, "foo_second", "com.example");
  m.node("NotAnOnnxOp", {"b"}, {"c"}, "strange");
  m.node("Relu", {"c"}, {"y"});
  m.output("y");
  kg_test::expect_error([&] { kg::onnx::import_bytes(m.bytes(), "unsupported.onnx"); },
                        {"unsupported.onnx", "2 op type(s) cannot be imported", "com.example Foo: 2 node(s), first 'foo_first'",
                         "ai.onnx NotAnOnnxOp: 1 node(s), first 'strange'", "OpRegistry"});
}

// A node of domain com.example, op RmsNorm, with its weight as an initializer, after a Linear.
OnnxBuilder rmsnorm_model(const kg::Tensor& w, const kg::Tensor& b, const kg::Tensor& g) {
  OnnxBuilder m;
  m.import_domain("com.example", 1);
  m.input("x", kg::DType::F32, {std::string("batch"), w.dim(1)});
  m.initializer("fc.weight", w);
  m.initializer("fc.bias", b);
  m.initializer("norm.weight", g);
  auto& gemm = m.node("Gemm", {"x", "fc.weight", "fc.bias"}, {"h"}, "/fc/Gemm");
  OnnxBuilder::attr(gemm, "transB", std::int64_t{1});
  auto& n = m.node("RmsNorm", {"h", "norm.weight"}, {"y"}, "/norm/RmsNorm", "com.example");
  OnnxBuilder::attr(n, "epsilon", 1e-5f);
  m.output("y");
  return m;
}

kg::onnx::OpRegistry rmsnorm_registry() {
  kg::onnx::OpRegistry r;
  r.add("com.example", "RmsNorm", [](const kg::onnx::NodeInfo& node) {
    return kg::CustomData::make<demo::RmsNormOp>(node.attributes.get_float("epsilon", 1e-6));
  });
  return r;
}

TEST(OnnxImport, ACustomDomainNodeRunsAsTheRegisteredCustomOpAndTrains) {
  const auto seed = kg_test::fresh_seed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const kg::Tensor w = random_f32(rng, {8, 4}), b = random_f32(rng, {8});
  kg::Tensor g = random_f32(rng, {8});
  const OnnxBuilder m = rmsnorm_model(w, b, g);
  const auto registry = rmsnorm_registry();
  kg::onnx::ImportOptions opt;
  opt.registry = &registry;
  kg::Model model = kg::onnx::import_bytes(m.bytes(), "rms.onnx", opt);
  const kg::Tensor x = random_f32(rng, {3, 4});
  kg::LoadedModel lm = model.load(kg::Device::cpu(), {x.shape()});
  EXPECT_TRUE(kg_test::all_close(lm.parameter("norm.weight"), g, 0, 0));
  const kg::Tensor y = lm.forward({x}).at(0);
  std::vector<double> want;
  for (std::int64_t i = 0; i < 3; ++i) {
    std::vector<double> h(8);
    double ms = 0;
    for (std::int64_t j = 0; j < 8; ++j) {
      h[static_cast<std::size_t>(j)] = b.item(j);
      for (std::int64_t k = 0; k < 4; ++k) h[static_cast<std::size_t>(j)] += x.item(i * 4 + k) * w.item(j * 4 + k);
      ms += h[static_cast<std::size_t>(j)] * h[static_cast<std::size_t>(j)] / 8;
    }
    for (std::int64_t j = 0; j < 8; ++j) want.push_back(h[static_cast<std::size_t>(j)] / std::sqrt(ms + 1e-5) * g.item(j));
  }
  EXPECT_TRUE(kg_test::matches(y, want, 1e-4, 1e-5));

  // Training: the imported graph with an MSE loss to a target; the loss falls and every
  // parameter (the file's and the custom op's) moves.
  {
    kg::onnx::ImportOptions t = opt;
    t.mode = kg::LoweringMode::Training;
    kg::onnx::ImportedGraph imported = kg::onnx::import_graph_bytes(m.bytes(), "rms.onnx", t);
    auto graph = imported.graph;
    kg::SymTensor out = imported.output("y");
    kg::SymTensor target = graph->input(kg::DType::F32, {kg::Dim::named("batch"), 8}, "target");
    kg::SymTensor loss = kg::mse_loss(out, target, "loss");
    kg::Model train(graph, {{"loss", loss}}, kg::LoweringMode::Training);
    const kg::Tensor tgt = random_f32(rng, {3, 8});
    kg::LoadedModel tm = train.load(kg::Device::cpu(), {x.shape(), tgt.shape()});
    tm.set_optimizer(kg::OptimizerOptions::sgd(0.1));
    const auto before = tm.state_dict();
    double first = 0, last = 0;
    for (int step = 0; step < 30; ++step) {
      tm.zero_grad();
      last = tm.forward({x, tgt}).at(0).item(0);
      if (step == 0) first = last;
      tm.backward();
      tm.step();
    }
    EXPECT_LT(last, 0.8 * first);
    const auto after = tm.state_dict();
    for (const char* p : {"fc.weight", "fc.bias", "norm.weight"})
      EXPECT_FALSE(kg_test::all_close(after.at(p), before.at(p), 0, 0)) << p << " did not train";
  }

  // Without the registration, the one-error list names it.
  kg_test::expect_error([&] { kg::onnx::import_bytes(m.bytes(), "rms.onnx"); },
                        {"rms.onnx", "com.example RmsNorm: 1 node(s), first '/norm/RmsNorm'", "OpRegistry"});
}

TEST(OnnxImport, ARegisteredStandardOpReplacesTheBuiltInConversion) {
  const auto seed = kg_test::fresh_seed();
  std::mt19937_64 rng(seed);
  OnnxBuilder m;
  m.input("x", kg::DType::F32, {std::string("batch"), std::int64_t{6}});
  m.node("Relu", {"x"}, {"y"}, "act");
  m.output("y");
  kg::onnx::OpRegistry r;
  int calls = 0;
  r.add("", "Relu", [&](const kg::onnx::NodeInfo& info) {
    ++calls;
    EXPECT_EQ(info.input_shapes.at(0).to_string(), "[batch, 6]");
    return kg::CustomData::make<demo::RmsNormOp>(1e-6);
  });
  kg::onnx::ImportOptions o;
  o.registry = &r;
  kg::Model model = kg::onnx::import_bytes(m.bytes(), "relu.onnx", o);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(model.graph().node(model.outputs()[0].second).op_name(), "demo.rmsnorm");
}

TEST(OnnxImport, AShapeFromAGraphInputMustBeGivenAtImport) {
  const auto seed = kg_test::fresh_seed();
  std::mt19937_64 rng(seed);
  OnnxBuilder m;
  m.input("x", kg::DType::F32, {std::int64_t{2}, std::int64_t{6}});
  m.input("shape", kg::DType::I64, {std::int64_t{2}});
  m.node("Reshape", {"x", "shape"}, {"y"}, "reshape");
  m.output("y");
  kg_test::expect_error([&] { kg::onnx::import_bytes(m.bytes(), "r.onnx"); },
                        {"Reshape @ reshape", "the target shape", "'shape'", "ImportOptions::input_values"});
  kg::onnx::ImportOptions o;
  o.input_values["shape"] = kg::Tensor::from_vector<std::int64_t>({2}, {3, 4});
  kg::Model model = kg::onnx::import_bytes(m.bytes(), "r.onnx", o);
  const kg::Tensor x = random_f32(rng, {2, 6});
  const kg::Tensor y = model.load(kg::Device::cpu(), {x.shape()}).forward({x}).at(0);
  EXPECT_EQ(y.shape(), (std::vector<std::int64_t>{3, 4}));
  o.input_values["nope"] = o.input_values["shape"];
  kg_test::expect_error([&] { kg::onnx::import_bytes(m.bytes(), "r.onnx", o); }, {"'nope'", "not a graph input"});
}

// ---- bad files ----

TEST(OnnxImport, BadFilesGiveAnErrorNamingTheFileAndTheProblem) {
  const auto seed = kg_test::fresh_seed();
  std::mt19937_64 rng(seed);
  const std::string good = linear_relu(random_f32(rng, {3, 5}), random_f32(rng, {3})).bytes();
  // Truncated.
  {
    const std::string path = temp_path("truncated.onnx");
    write_file(path, good.substr(0, good.size() / 2));
    kg_test::expect_error([&] { kg::onnx::import(path); }, {path, "not a valid ONNX protobuf"});
    fs::remove(path);
  }
  // Not ONNX at all (another format's magic, text).
  {
    const std::string path = temp_path("magic.onnx");
    write_file(path, "\x89PNG\r\n\x1a\n this is not a model");
    kg_test::expect_error([&] { kg::onnx::import(path); }, {path});
    write_file(path, "");
    kg_test::expect_error([&] { kg::onnx::import(path); }, {path, "empty file"});
    fs::remove(path);
  }
  // A missing file and a FIFO (must not block).
  kg_test::expect_error([&] { kg::onnx::import(temp_path("missing.onnx")); }, {"cannot open"});
  {
    const std::string path = temp_path("fifo.onnx");
    ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
    kg_test::expect_error([&] { kg::onnx::import(path); }, {path, "not a regular file"});
    fs::remove(path);
  }
  // A tensor whose data is shorter than its shape.
  {
    OnnxBuilder m;
    m.input("x", kg::DType::F32, {std::int64_t{2}, std::int64_t{5}});
    m.initializer("w", kg::Tensor::zeros(kg::DType::F32, {3, 5}));
    m.graph().mutable_initializer(0)->mutable_raw_data()->resize(20);
    m.node("MatMul", {"x", "w"}, {"y"});
    m.output("y");
    kg_test::expect_error([&] { kg::onnx::import_bytes(m.bytes(), "short.onnx"); },
                          {"short.onnx", "initializer 'w'", "raw data of 20 bytes", "[3, 5] f32 needs 60"});
  }
  // A 10^12-element shape: refused before any allocation.
  {
    OnnxBuilder m;
    m.input("x", kg::DType::F32, {std::int64_t{2}});
    auto* t = m.graph().add_initializer();
    t->set_name("huge");
    t->set_data_type(::onnx::TensorProto::FLOAT);
    t->add_dims(1000000);
    t->add_dims(1000000);
    t->set_raw_data(std::string(16, '\0'));
    m.node("Add", {"x", "huge"}, {"y"});
    m.output("y");
    kg_test::expect_error([&] { kg::onnx::import_bytes(m.bytes(), "huge.onnx"); },
                          {"huge.onnx", "initializer 'huge'", "raw data of 16 bytes", "[1000000, 1000000] f32"});
  }
  // A cycle.
  {
    OnnxBuilder m;
    m.input("x", kg::DType::F32, {std::int64_t{2}});
    m.node("Add", {"x", "b"}, {"a"}, "first");
    m.node("Relu", {"a"}, {"b"}, "second");
    m.output("b");
    kg_test::expect_error([&] { kg::onnx::import_bytes(m.bytes(), "cycle.onnx"); },
                          {"cycle.onnx", "cycle", "'first' (Add)", "'second' (Relu)"});
  }
  // A value nobody defines, and an opset from the future.
  {
    OnnxBuilder m;
    m.input("x", kg::DType::F32, {std::int64_t{2}});
    m.node("Add", {"x", "ghost"}, {"y"}, "adder");
    m.output("y");
    kg_test::expect_error([&] { kg::onnx::import_bytes(m.bytes(), "ghost.onnx"); },
                          {"ghost.onnx", "'adder'", "'ghost'", "no node, input or initializer"});
    OnnxBuilder f(30);
    f.input("x", kg::DType::F32, {std::int64_t{2}});
    f.node("Relu", {"x"}, {"y"});
    f.output("y");
    kg_test::expect_error([&] { kg::onnx::import_bytes(f.bytes(), "future.onnx"); }, {"future.onnx", "opset 30"});
  }
  // An op whose attributes are wrong names the node.
  {
    OnnxBuilder m;
    m.input("x", kg::DType::F32, {std::int64_t{2}, std::int64_t{3}});
    auto& n = m.node("Transpose", {"x"}, {"y"}, "tr");
    OnnxBuilder::attr(n, "perm", std::int64_t{1});
    m.output("y");
    kg_test::expect_error([&] { kg::onnx::import_bytes(m.bytes(), "attr.onnx"); },
                          {"attr.onnx", "[onnx Transpose @ tr]", "attribute 'perm' is int, expected ints"});
  }
}

TEST(OnnxImport, AShapeInputThatIsNotIntegersOfRankOneIsAnError) {
  for (const auto& shape : {kg::Tensor::from_vector<float>({2}, {3.0f, 4.0f}),
                            kg::Tensor::from_vector<std::int64_t>({1, 2}, {3, 4})}) {
    for (const char* op : {"Reshape", "Expand"}) {
      OnnxBuilder m;
      m.input("x", kg::DType::F32, {std::int64_t{2}, std::int64_t{6}});
      m.initializer("shape", shape);
      m.node(op, {"x", "shape"}, {"y"}, "target");
      m.output("y");
      kg_test::expect_error([&] { kg::onnx::import_bytes(m.bytes(), "shape.onnx"); },
                            {"shape.onnx", std::string("[onnx ") + op + " @ target]",
                             "the target shape must be a 1-D integer tensor, got",
                             shape.dtype() == kg::DType::F32 ? "f32 [2]" : "[1, 2]"});
    }
  }
}

TEST(OnnxImport, ExternalDataIsReadFromTheModelsFolderAndChecked) {
  const auto seed = kg_test::fresh_seed();
  std::mt19937_64 rng(seed);
  const kg::Tensor w = random_f32(rng, {5, 3});
  const std::string dir = temp_path("ext");
  fs::create_directories(dir);
  write_file(dir + "/weights.bin", std::string(8, 'x') + std::string(static_cast<const char*>(w.raw()), w.nbytes()));
  auto build = [&](const std::string& location, std::int64_t offset) {
    OnnxBuilder m;
    m.input("x", kg::DType::F32, {std::string("batch"), std::int64_t{5}});
    auto* t = m.graph().add_initializer();
    t->set_name("w");
    t->set_data_type(::onnx::TensorProto::FLOAT);
    t->add_dims(5);
    t->add_dims(3);
    t->set_data_location(::onnx::TensorProto::EXTERNAL);
    auto* kv = t->add_external_data();
    kv->set_key("location");
    kv->set_value(location);
    kv = t->add_external_data();
    kv->set_key("offset");
    kv->set_value(std::to_string(offset));
    m.node("MatMul", {"x", "w"}, {"y"});
    m.output("y");
    write_file(dir + "/model.onnx", m.bytes());
  };
  build("weights.bin", 8);
  kg::Model model = kg::onnx::import(dir + "/model.onnx");
  kg::LoadedModel lm = model.load(kg::Device::cpu(), {{2, 5}});
  EXPECT_TRUE(kg_test::all_close(lm.parameter("w"), w, 0, 0));
  build("weights.bin", 16);
  kg_test::expect_error([&] { kg::onnx::import(dir + "/model.onnx"); }, {"external data file", "at offset 16"});
  build("../escape.bin", 0);
  kg_test::expect_error([&] { kg::onnx::import(dir + "/model.onnx"); }, {"must be a relative path inside"});
  fs::remove_all(dir);
}

// ---- exported models against ONNX Runtime ----

struct Case {
  std::map<std::string, kg::Tensor> tensors;
};

// Runs the exported model on `device` (checked: every kernel under the CUDA emulator, or with
// guard canaries on a GPU; in `precision`) against ONNX Runtime's f32 outputs stored beside it.
void check_against_ort(const std::string& model_name, const std::vector<std::string>& inputs,
                       const std::vector<std::string>& outputs, double tolerance,
                       kg::Device device = kg::Device::cpu(), bool checked = false,
                       kg::DType precision = kg::DType::F32) {
  const std::string dir = std::string(KG_SOURCE_DIR) + "/tests/fixtures/onnx/";
  kg::Model model = kg::onnx::import(dir + model_name + ".onnx");
  for (int k : {1, 2}) {
    SCOPED_TRACE(model_name + " case " + std::to_string(k));
    const auto t = kg::read_safetensors(dir + model_name + ".case" + std::to_string(k) + ".safetensors");
    std::vector<kg::Tensor> ins;
    std::vector<std::vector<std::int64_t>> shapes;
    for (const auto& n : inputs) {
      ins.push_back(t.at(n));
      shapes.push_back(t.at(n).shape());
    }
    kg::LoadOptions o;
    o.poison_buffers = !checked;
    o.checked = checked;
    o.precision = precision;
    kg::LoadedModel lm = model.load(device, shapes, o);
    const auto got = lm.forward(ins);
    const auto names = lm.output_names();
    for (const auto& out : outputs) {
      const auto at = std::find(names.begin(), names.end(), out) - names.begin();
      ASSERT_LT(static_cast<std::size_t>(at), names.size()) << out;
      const kg::Tensor& want = t.at(out);
      const kg::Tensor& y = got[static_cast<std::size_t>(at)];
      ASSERT_EQ(y.shape(), want.shape()) << out;
      double scale = 0;
      for (std::int64_t i = 0; i < want.numel(); ++i) scale = std::max(scale, std::abs(want.item(i)));
      EXPECT_TRUE(kg_test::all_close(y, want, tolerance, tolerance * scale)) << out;
    }
  }
}

TEST(OnnxModels, SmallCnnMatchesOnnxRuntime) { check_against_ort("cnn_small", {"input"}, {"logits"}, 1e-4); }

TEST(OnnxModels, Bert2MatchesOnnxRuntimeWithDynamicBatchAndSequence) {
  const std::string path = std::string(KG_SOURCE_DIR) + "/tests/fixtures/onnx/bert2.onnx";
  kg::Model model = kg::onnx::import(path);
  const auto ins = kg::onnx::model_inputs(model);
  ASSERT_EQ(ins.size(), 2u);
  EXPECT_EQ(ins[0].shape.to_string(), "[batch, sequence]");
  check_against_ort("bert2", {"input_ids", "attention_mask"}, {"last_hidden_state", "pooler_output"}, 1e-4);
}

TEST(OnnxModels, Gpt2MatchesOnnxRuntimeWithDynamicBatchAndSequence) {
  check_against_ort("gpt2", {"input_ids"}, {"logits"}, 1e-4);
}

// Every kernel of the imported models (the lowering of each op) run by the CUDA emulator in
// checked mode: guard pages, both thread orders, outputs poisoned and verified.
TEST(OnnxModels, ImportedModelsRunCheckedUnderTheEmulator) {
  check_against_ort("cnn_small", {"input"}, {"logits"}, 1e-4, kg::Device::cpu(), true);
  check_against_ort("bert2", {"input_ids", "attention_mask"}, {"last_hidden_state", "pooler_output"}, 1e-4,
                    kg::Device::cpu(), true);
  check_against_ort("gpt2", {"input_ids"}, {"logits"}, 1e-4, kg::Device::cpu(), true);
}

// In bf16 (weights, which the files hold as constants, converted at load): within bf16's rounding
// of ONNX Runtime's f32 outputs, on the CPU forms and under the emulator.
TEST(OnnxModels, ImportedModelsRunInBf16) {
  for (bool checked : {false, true}) {
    SCOPED_TRACE(checked ? "emulated" : "cpu");
    const auto bf16 = kg::DType::BF16;
    check_against_ort("cnn_small", {"input"}, {"logits"}, 3e-2, kg::Device::cpu(), checked, bf16);
    check_against_ort("bert2", {"input_ids", "attention_mask"}, {"last_hidden_state", "pooler_output"}, 3e-2,
                      kg::Device::cpu(), checked, bf16);
    check_against_ort("gpt2", {"input_ids"}, {"logits"}, 3e-2, kg::Device::cpu(), checked, bf16);
  }
}

TEST(OnnxModelsGpu, ImportedModelsMatchOnnxRuntimeOnTheGpu) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no usable CUDA GPU";
  for (bool checked : {false, true}) {
    SCOPED_TRACE(checked ? "checked" : "unchecked");
    check_against_ort("cnn_small", {"input"}, {"logits"}, 1e-4, kg::Device::cuda(), checked);
    check_against_ort("bert2", {"input_ids", "attention_mask"}, {"last_hidden_state", "pooler_output"}, 1e-4,
                      kg::Device::cuda(), checked);
    check_against_ort("gpt2", {"input_ids"}, {"logits"}, 1e-4, kg::Device::cuda(), checked);
  }
}

}  // namespace
