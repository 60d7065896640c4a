// Loading a model in a reduced precision (LoadOptions::precision): which nodes run in f16/bf16 and
// which keep f32 with casts between, whole models against their f32 run on the same weights (CPU
// forms, and the kernels under the CUDA emulator in checked mode; on a GPU its own kernels and the
// vendor libraries), weights in and out, and the errors.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "kg/models.hpp"
#include "ops/constant.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

// The loaded graph's live op nodes by name.
std::map<std::string, const kg::Node*> ops_by_name(const kg::LoadedModel& m) {
  std::map<std::string, const kg::Node*> out;
  for (const kg::Node& n : m.graph().nodes())
    if (n.kind == kg::Node::Kind::Op) out[n.name] = &n;
  return out;
}

int count_casts(const kg::LoadedModel& m) {
  int n = 0;
  for (const kg::Node& node : m.graph().nodes()) n += node.kind == kg::Node::Kind::Op && node.op_name() == "pw.cast";
  return n;
}

// f32 parameters drawn fresh, so that a bug that only shows off the default init shows: weights
// uniform within ±sqrt(3 / fan-in) (activations keep their scale through the layers, as in a
// trained model, so f16's range holds them), BatchNorm statistics and affine terms near identity.
std::map<std::string, kg::Tensor> random_params(const kg::Model& model, std::mt19937_64& rng) {
  std::map<std::string, kg::Tensor> p;
  for (const auto& info : model.parameters()) {
    if (!kg::is_floating(info.dtype)) continue;
    const bool var = info.name.find("running_var") != std::string::npos;
    const bool bn_weight = info.shape.size() == 1 && info.name.find("bn") != std::string::npos &&
                           info.name.find(".weight") != std::string::npos;
    double lo = -0.5, hi = 0.5;
    if (var || bn_weight) {
      lo = 0.5, hi = 1.5;
    } else if (info.shape.size() >= 2) {
      const double fan_in = double(kg::numel_of(info.shape)) / double(info.shape[0]);
      hi = std::sqrt(3.0 / fan_in), lo = -hi;
    }
    p[info.name] = kg_test::random_tensor(rng, info.dtype, info.shape, lo, hi);
  }
  return p;
}

// The largest |x| of a tensor.
double max_abs(const kg::Tensor& t) {
  double m = 0;
  for (std::int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(t.item(i)));
  return m;
}

// Tolerance of a whole small model against its f32 run, relative to the output's scale: bf16
// keeps 8 significant bits (2^-9 relative rounding), f16 11 (2^-12); a handful of layers of
// rounded activations and weights stay within a few dozen such steps.
double model_tolerance(kg::DType p) { return p == kg::DType::BF16 ? 4e-2 : 6e-3; }

class PrecisionModels : public ::testing::TestWithParam<std::tuple<std::string, kg::DType>> {};

// A zoo model in f16/bf16 on the CPU against its f32 run with the same f32 weights.
TEST_P(PrecisionModels, MatchTheF32RunWithinTheDtypesRounding) {
  const auto& [name, precision] = GetParam();
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << name << " " << kg::dtype_name(precision) << " seed " << seed);
  std::mt19937_64 rng(seed);
  const kg::Model model = kg::models::build(name);
  const std::int64_t batch = 2;
  const auto shape = kg::models::input_shape(name, batch);
  const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, shape);
  const auto params = random_params(model, rng);

  kg::LoadOptions f32_opt;
  kg::LoadedModel ref = model.load(kg::Device::cpu(), {shape}, f32_opt);
  ref.load_state_dict(params, false);
  const kg::Tensor want = ref.forward({x})[0];

  kg::LoadOptions low_opt;
  low_opt.precision = precision;
  low_opt.poison_buffers = true;
  kg::LoadedModel low = model.load(kg::Device::cpu(), {shape}, low_opt);
  low.load_state_dict(params, false);  // f32 tensors, converted into the 16-bit parameters
  const kg::Tensor got = low.forward({x})[0];
  ASSERT_EQ(got.dtype(), kg::DType::F32) << "outputs keep their recorded dtype";
  ASSERT_EQ(got.shape(), want.shape());
  EXPECT_TRUE(kg_test::all_written(got));
  const double scale = max_abs(want);
  ASSERT_GT(scale, 0.0);
  EXPECT_TRUE(kg_test::all_close(got, want, 0.0, model_tolerance(precision) * scale));

  // It really ran in the reduced precision: every convolution and linear layer, and their weights.
  int low_nodes = 0;
  for (const auto& [node_name, n] : ops_by_name(low)) {
    const std::string op = n->op_name();
    if (op == "nn.conv2d" || op == "nn.fused_conv2d" || op == "nn.linear") {
      EXPECT_EQ(n->dtype, precision) << node_name << " (" << op << ")";
      ++low_nodes;
    }
  }
  EXPECT_GT(low_nodes, 2);
  const auto sd = low.state_dict();
  for (const auto& [pname, t] : params) EXPECT_EQ(sd.at(pname).dtype(), precision) << pname;
  // Casts only at the edges: the input into the first layer, the logits out of the last.
  EXPECT_EQ(count_casts(low), 2);
}

INSTANTIATE_TEST_SUITE_P(Zoo, PrecisionModels,
                         ::testing::Combine(::testing::Values("lenet5", "lenet5-tanh", "resnet18-swish"),
                                            ::testing::Values(kg::DType::BF16, kg::DType::F16)),
                         [](const auto& info) {
                           std::string n = std::get<0>(info.param) + "_" +
                                           std::string(kg::dtype_name(std::get<1>(info.param)));
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

// The kernels of a 16-bit model under the CUDA emulator (checked mode: every buffer guarded,
// every output element verified written) agree with the CPU forms of the same 16-bit model.
TEST(Precision, EmulatedKernelsMatchTheCpuForms) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (kg::DType precision : {kg::DType::BF16, kg::DType::F16}) {
    SCOPED_TRACE(kg::dtype_name(precision));
    const kg::Model model = kg::models::build("lenet5-tanh");
    const auto shape = kg::models::input_shape("lenet5-tanh", 2);
    const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, shape);
    const auto params = random_params(model, rng);
    kg::LoadOptions opt;
    opt.precision = precision;
    kg::LoadedModel cpu = model.load(kg::Device::cpu(), {shape}, opt);
    cpu.load_state_dict(params, false);
    opt.checked = true;
    kg::LoadedModel emu = model.load(kg::Device::cpu(), {shape}, opt);
    emu.load_state_dict(params, false);
    const kg::Tensor want = cpu.forward({x})[0], got = emu.forward({x})[0];
    // Both compute in f32 from the same 16-bit values; sums in another order may round an
    // intermediate value to the neighbouring 16-bit number, and the flips add up through the
    // layers. Over 400 seeds the largest difference was 2.6 (bf16) and 2.3 (f16) rounding units
    // of the dtype (2^-8 and 2^-11) times the output's largest magnitude, the median 1.2 for
    // both; 8 units leaves room and still catches a wrong kernel by far.
    const double unit = precision == kg::DType::BF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    EXPECT_TRUE(kg_test::all_close(got, want, 0.0, 8 * unit * max_abs(want)));
  }
}

// Which nodes run in bf16: ops that declare it, elementwise ops (built-in and a user's, alone or
// fused), and not softmax (its statistics stay f32), an op that declares nothing, or f64 nodes.
TEST(Precision, OnlyOpsThatDeclareItRunInTheReducedDtype) {
  auto graph = kg::Graph::create();
  kg::SymTensor x = graph->input(kg::DType::F32, {kg::Dim::named("batch"), 16}, "x");
  kg::SymTensor h = kg::nn::linear(x, 12, "fc1");
  h = kg::models::swish(h, "act");  // a user's op with an elementwise form: the linear's epilogue
  kg::SymTensor s = kg::softmax(h, -1, "probs");
  kg::SymTensor y = kg::add(kg::mul(s, 2.0, "scale"), h, "mix");  // a fused group
  kg::SymTensor d = graph->input(kg::DType::F64, {kg::Dim::named("batch"), 3}, "d");
  kg::SymTensor e = kg::relu(d, "f64_relu");
  kg::Model model(graph, {y, e});
  kg::LoadOptions opt;
  opt.precision = kg::DType::BF16;
  kg::LoadedModel m = model.load(kg::Device::cpu(), {{3, 16}, {3, 3}}, opt);
  const auto nodes = ops_by_name(m);
  EXPECT_EQ(nodes.at("fc1")->dtype, kg::DType::BF16);
  EXPECT_EQ(nodes.at("fc1")->op_name(), "kg.fused_gemm");
  EXPECT_EQ(nodes.count("act"), 0u);
  EXPECT_EQ(nodes.at("probs")->dtype, kg::DType::F32);
  EXPECT_EQ(nodes.at("mix")->dtype, kg::DType::BF16);
  EXPECT_EQ(nodes.at("f64_relu")->dtype, kg::DType::F64);
  // x in, softmax in and out, the output out: four casts, one per value and direction.
  EXPECT_EQ(count_casts(m), 4);

  std::mt19937_64 rng(fresh_seed());
  const kg::Tensor xv = kg_test::random_tensor(rng, kg::DType::F32, {3, 16});
  const kg::Tensor dv = kg_test::random_tensor(rng, kg::DType::F64, {3, 3});
  kg::LoadedModel ref = model.load(kg::Device::cpu(), {{3, 16}, {3, 3}});
  std::map<std::string, kg::Tensor> params;
  for (const auto& [n, t] : ref.state_dict()) params[n] = kg_test::random_tensor(rng, t.dtype(), t.shape());
  ref.load_state_dict(params);
  m.load_state_dict(params);
  const auto want = ref.forward({xv, dv}), got = m.forward({xv, dv});
  EXPECT_EQ(got[0].dtype(), kg::DType::F32);
  EXPECT_TRUE(kg_test::all_close(got[0], want[0], 0.0, 3e-2 * max_abs(want[0])));
  EXPECT_TRUE(kg_test::all_close(got[1], want[1], 0.0, 0.0)) << "the f64 branch is untouched";
}

// A broadcasting elementwise group (the generated kernel's walk path) and an odd-sized one (its
// scalar tail) in bf16 and f16: the CPU form, and the generated kernel under the emulator, against
// the f32 run. Each input is rounded once on the way in and the result once on the way out.
TEST(Precision, BroadcastingGroupsMatchTheF32Run) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  auto graph = kg::Graph::create();
  kg::SymTensor x = graph->input(kg::DType::F32, {kg::Dim::named("batch"), 4, 37}, "x");
  kg::SymTensor y = graph->input(kg::DType::F32, {4, 1}, "y");
  kg::SymTensor b = kg::relu(kg::add(kg::mul(x, y, "scale"), x, "shift"), "act");  // broadcasts y
  kg::SymTensor c = kg::sigmoid(kg::sub(x, 0.25, "centre"), "gate");               // same shape
  kg::Model model(graph, {b, c});
  const std::vector<std::vector<std::int64_t>> shapes{{3, 4, 37}, {4, 1}};
  const kg::Tensor xv = kg_test::random_tensor(rng, kg::DType::F32, shapes[0], -2, 2);
  const kg::Tensor yv = kg_test::random_tensor(rng, kg::DType::F32, shapes[1], -2, 2);
  const auto want = model.load(kg::Device::cpu(), shapes).forward({xv, yv});
  for (kg::DType precision : {kg::DType::BF16, kg::DType::F16})
    for (bool checked : {false, true}) {
      SCOPED_TRACE(::testing::Message() << kg::dtype_name(precision) << (checked ? " emulated" : " cpu"));
      kg::LoadOptions opt;
      opt.precision = precision;
      opt.checked = checked;
      opt.poison_buffers = !checked;
      kg::LoadedModel m = model.load(kg::Device::cpu(), shapes, opt);
      EXPECT_EQ(ops_by_name(m).at("act")->dtype, precision);
      const auto got = m.forward({xv, yv});
      // x·y + x from rounded x and y: a few units in the last place of the largest term (|x·y| < 4).
      const double ulp = precision == kg::DType::BF16 ? 1.0 / 128 : 1.0 / 1024;
      EXPECT_TRUE(kg_test::all_close(got[0], want[0], 2 * ulp, 8 * ulp));
      EXPECT_TRUE(kg_test::all_close(got[1], want[1], 2 * ulp, ulp));
    }
}

// An imported model's weights are constants: one read only by 16-bit nodes is itself kept in
// bf16 (converted at load, no cast per run); one that an f32 node reads stays f32.
TEST(Precision, ConstantsReadOnlyByReducedNodesAreConverted) {
  std::mt19937_64 rng(fresh_seed());
  auto graph = kg::Graph::create();
  kg::SymTensor x = graph->input(kg::DType::F32, {kg::Dim::named("batch"), 6}, "x");
  const kg::Tensor wv = kg_test::random_tensor(rng, kg::DType::F32, {6, 4});
  const kg::Tensor sv = kg_test::random_tensor(rng, kg::DType::F32, {4});
  auto constant = [&](const kg::Tensor& v, const std::string& name) {
    std::vector<std::byte> bytes(v.nbytes());
    std::memcpy(bytes.data(), v.raw(), v.nbytes());
    return graph->record(kg::ops::constant_op(kg::DType::F32, v.shape(), kg::ParamInit::from_bytes(bytes), false),
                         {}, std::nullopt, name);
  };
  const kg::SymTensor w = constant(wv, "w"), shift = constant(sv, "shift"), logits = constant(sv, "logits");
  kg::SymTensor h = kg::matmul(x, w, "mm");                             // bf16: w is only read here
  kg::SymTensor y = kg::softmax(kg::add(h, shift, "biased"), -1, "p");  // the add in bf16, softmax f32
  kg::SymTensor z = kg::softmax(logits, -1, "q");                       // logits: read by an f32 node
  kg::Model model(graph, {y, z, shift});                                // shift: also an output
  kg::LoadOptions opt;
  opt.precision = kg::DType::BF16;
  kg::LoadedModel m = model.load(kg::Device::cpu(), {{3, 6}}, opt);
  const auto nodes = ops_by_name(m);
  EXPECT_EQ(nodes.at("w")->dtype, kg::DType::BF16);
  EXPECT_EQ(m.state_dict().at("w.value").dtype(), kg::DType::BF16);
  EXPECT_EQ(nodes.at("shift")->dtype, kg::DType::F32);
  EXPECT_EQ(nodes.at("logits")->dtype, kg::DType::F32);
  const kg::Tensor xv = kg_test::random_tensor(rng, kg::DType::F32, {3, 6});
  const auto want = model.load(kg::Device::cpu(), {{3, 6}}).forward({xv});
  const auto got = m.forward({xv});
  EXPECT_TRUE(kg_test::all_close(got[0], want[0], 0.0, 2e-2));
  EXPECT_TRUE(kg_test::all_close(got[1], want[1], 0.0, 0.0)) << "an f32 branch, untouched";
  EXPECT_TRUE(kg_test::all_close(got[2], want[2], 0.0, 0.0));
}

// A graph with nothing to convert loads as it is.
TEST(Precision, AGraphWithNothingToConvertIsUnchanged) {
  auto graph = kg::Graph::create();
  kg::SymTensor x = graph->input(kg::DType::F32, {2, 5}, "x");
  kg::Model model(graph, {kg::softmax(x, -1, "p")});
  kg::LoadOptions opt;
  opt.precision = kg::DType::F16;
  kg::LoadedModel m = model.load(kg::Device::cpu(), {{2, 5}}, opt);
  EXPECT_EQ(count_casts(m), 0);
  EXPECT_EQ(&m.graph(), &model.graph());
}

// Weights saved from a 16-bit load are 16-bit and load back bit for bit; f32 files convert.
TEST(Precision, WeightsRoundTripInTheReducedDtype) {
  std::mt19937_64 rng(fresh_seed());
  const kg::Model model = kg::models::build("lenet5");
  const auto shape = kg::models::input_shape("lenet5", 1);
  kg::LoadOptions opt;
  opt.precision = kg::DType::BF16;
  kg::LoadedModel a = model.load(kg::Device::cpu(), {shape}, opt);
  a.load_state_dict(random_params(model, rng), false);
  const std::string path = ::testing::TempDir() + "/precision_weights.safetensors";
  a.save_weights(path);
  kg::LoadedModel b = model.load(kg::Device::cpu(), {shape}, opt);
  b.load_weights(path);
  const auto sa = a.state_dict(), sb = b.state_dict();
  ASSERT_EQ(sa.size(), sb.size());
  for (const auto& [n, t] : sa) {
    ASSERT_EQ(sb.at(n).dtype(), kg::DType::BF16) << n;
    ASSERT_EQ(t.nbytes(), sb.at(n).nbytes());
    EXPECT_EQ(0, std::memcmp(t.raw(), sb.at(n).raw(), t.nbytes())) << n;
  }
  // The same file into an f32 load widens exactly.
  kg::LoadedModel c = model.load(kg::Device::cpu(), {shape});
  c.load_weights(path);
  const kg::Tensor w = c.state_dict().at("features.0.weight");
  EXPECT_EQ(w.dtype(), kg::DType::F32);
  EXPECT_TRUE(kg_test::all_close(w, sa.at("features.0.weight").to(kg::DType::F32), 0.0, 0.0));
}

TEST(Precision, RejectsWhatItCannotDo) {
  const kg::Model model = kg::models::build("lenet5");
  const auto shape = kg::models::input_shape("lenet5", 1);
  for (kg::DType bad : {kg::DType::F64, kg::DType::I32}) {
    kg::LoadOptions opt;
    opt.precision = bad;
    try {
      model.load(kg::Device::cpu(), {shape}, opt);
      ADD_FAILURE() << "precision " << kg::dtype_name(bad) << " loaded";
    } catch (const kg::Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("not ") + std::string(kg::dtype_name(bad))),
                std::string::npos)
          << e.what();
    }
  }
  const kg::Model training = kg::models::build("lenet5", kg::LoweringMode::Training);
  kg::LoadOptions opt;
  opt.precision = kg::DType::BF16;
  try {
    training.load(kg::Device::cpu(), {shape}, opt);
    ADD_FAILURE() << "a training model loaded in bf16";
  } catch (const kg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("for inference"), std::string::npos) << e.what();
  }
}

// On a GPU: ResNet-18 in bf16 and f16, own kernels and vendor libraries, against the CPU's f32
// run on the same weights.
TEST(PrecisionGpu, ResNet18MatchesTheF32Cpu) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(fresh_seed());
  const kg::Model model = kg::models::build("resnet18");
  const std::vector<std::int64_t> shape{2, 3, 224, 224};
  const kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, shape);
  kg::LoadedModel ref = model.load(kg::Device::cpu(), {shape});
  const auto params = ref.state_dict();  // the default init
  const kg::Tensor want = ref.forward({x})[0];
  for (kg::DType precision : {kg::DType::BF16, kg::DType::F16})
    for (bool vendor : {false, true}) {
      SCOPED_TRACE(::testing::Message() << kg::dtype_name(precision) << (vendor ? " vendor" : " own kernels"));
      kg::LoadOptions opt;
      opt.precision = precision;
      opt.vendor_libraries = vendor;
      opt.poison_buffers = true;
      kg::LoadedModel gpu = model.load(kg::Device::cuda(), {shape}, opt);
      gpu.load_state_dict(params, false);
      const kg::Tensor got = gpu.forward({x})[0];
      EXPECT_TRUE(kg_test::all_written(got));
      EXPECT_TRUE(kg_test::all_close(got, want, 0.0, 2 * model_tolerance(precision) * max_abs(want)));
    }
}

}  // namespace
