// nn.cross_entropy and nn.mse_loss: values and gradients against PyTorch (fixtures from
// scripts/fixtures/loss.py) and naive double loops, finite-difference gradient checks, the GPU
// kernels (forward and backward) under the emulator, and every error path.
#include <cmath>
#include <random>

#include "backend/emu/executor.hpp"
#include "kg/testing.hpp"
#include "support/gpu_util.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

kg::Tensor labels_i32(const kg::Tensor& t) {
  std::vector<std::int32_t> v;
  for (std::int64_t i = 0; i < t.numel(); ++i) v.push_back(static_cast<std::int32_t>(t.item(i)));
  return kg::Tensor::from_vector<std::int32_t>({t.numel()}, v);
}

// Labels in [0, c), as `dtype` (i32 or i64).
kg::Tensor random_labels(std::mt19937_64& rng, kg::DType dtype, std::int64_t n, std::int64_t c) {
  std::uniform_int_distribution<std::int64_t> u(0, c - 1);
  std::vector<std::int64_t> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = u(rng);
  kg::Tensor t = kg::Tensor::from_vector<std::int64_t>({n}, v);
  return dtype == kg::DType::I64 ? t : labels_i32(t);
}

// Naive references in double.
double naive_cross_entropy(const kg::Tensor& x, const kg::Tensor& labels) {
  const std::int64_t n = x.dim(0), c = x.dim(1);
  double sum = 0;
  for (std::int64_t r = 0; r < n; ++r) {
    double m = -INFINITY;
    for (std::int64_t j = 0; j < c; ++j) m = std::max(m, x.item(r * c + j));
    double s = 0;
    for (std::int64_t j = 0; j < c; ++j) s += std::exp(x.item(r * c + j) - m);
    sum += m + std::log(s) - x.item(r * c + static_cast<std::int64_t>(labels.item(r)));
  }
  return sum / static_cast<double>(n);
}

double naive_mse(const kg::Tensor& p, const kg::Tensor& t) {
  double sum = 0;
  for (std::int64_t i = 0; i < p.numel(); ++i) sum += (p.item(i) - t.item(i)) * (p.item(i) - t.item(i));
  return sum / static_cast<double>(p.numel());
}

kg::Tensor loss_of(const std::function<kg::SymTensor(const kg::SymTensor&, const kg::SymTensor&)>& f,
                   const kg::Tensor& a, const kg::Tensor& b) {
  return kg_test::run_graph(
      [&](const std::vector<kg::SymTensor>& x) { return std::vector<kg::SymTensor>{f(x[0], x[1])}; },
      {a, b})[0];
}

kg::SymTensor ce(const kg::SymTensor& a, const kg::SymTensor& b) { return kg::cross_entropy(a, b, "loss"); }
kg::SymTensor mse(const kg::SymTensor& a, const kg::SymTensor& b) { return kg::mse_loss(a, b, "loss"); }

// The op recorded on inputs of these dtypes and shapes.
kg::CustomData loss_op(bool cross_entropy, kg::DType a, kg::DType b, const kg::Shape& sa,
                       const kg::Shape& sb) {
  auto g = kg::Graph::create();
  kg::SymTensor x = g->input(a, sa), y = g->input(b, sb);
  kg::SymTensor l = cross_entropy ? ce(x, y) : mse(x, y);
  return *g->node(l.node()).op;
}

// The CPU backward of `op` for inputs and dloss = `g`: the gradient of each float input.
std::vector<kg::Tensor> cpu_grads(const kg::CustomData& op, const std::vector<kg::Tensor>& inputs, double g) {
  const kg::DType dt = inputs[0].dtype();
  kg::Tensor out = kg::Tensor::empty(dt, {});
  kg::CpuContext fctx(inputs, {}, out, true, 1);
  op->cpu_forward(fctx);
  kg::Tensor dout = kg::Tensor::empty(dt, {});
  dout.fill(g);
  std::vector<kg::Tensor> grads;
  for (const auto& t : inputs) {
    if (kg::is_floating(t.dtype())) {
      grads.push_back(kg::Tensor::empty(t.dtype(), t.shape()));
      grads.back().fill(NAN);
    } else {
      grads.push_back(kg::Tensor::wrap(nullptr, t.dtype(), t.shape()));
    }
  }
  kg::CpuBackwardContext ctx(inputs, {}, out, dout, grads, {}, true, 1);
  op->cpu_backward(ctx);
  return grads;
}

}  // namespace

// ---- cross-entropy ----

TEST(CrossEntropy, ShapeAndDtype) {
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64})
    for (kg::DType lt : {kg::DType::I32, kg::DType::I64}) {
      auto g = kg::Graph::create();
      auto x = g->input(dt, {kg::Dim::named("batch"), 10});
      auto y = g->input(lt, {kg::Dim::named("batch")});
      auto l = kg::cross_entropy(x, y, "loss");
      EXPECT_EQ(l.shape().to_string(), "[]");
      EXPECT_EQ(l.dtype(), dt);
      EXPECT_EQ(g->node(l.node()).op_name(), "nn.cross_entropy");
      EXPECT_TRUE((*g->node(l.node()).op)->has_cpu_backward());
    }
}

TEST(CrossEntropy, RecordTimeErrors) {
  auto g = kg::Graph::create();
  auto x = g->input(kg::DType::F32, {kg::dynamic, 5});
  auto x3 = g->input(kg::DType::F32, {kg::dynamic, 5, 2});
  auto xi = g->input(kg::DType::I64, {kg::dynamic, 5});
  auto x4 = g->input(kg::DType::F32, {4, 5});
  auto y = g->input(kg::DType::I64, {kg::dynamic});
  auto y2 = g->input(kg::DType::I64, {kg::dynamic, 1});
  auto y3 = g->input(kg::DType::I32, {3});
  auto yf = g->input(kg::DType::F32, {kg::dynamic});
  kg_test::expect_error([&] { kg::cross_entropy(x3, y, "ce"); },
                        {"[nn.cross_entropy @ ce]", "logits [N, C]", "3-D", "[?, 5, 2]"});
  kg_test::expect_error([&] { kg::cross_entropy(x, y2, "ce"); },
                        {"[nn.cross_entropy @ ce]", "labels [N]", "2-D"});
  kg_test::expect_error([&] { kg::cross_entropy(x4, y3, "ce"); },
                        {"[nn.cross_entropy @ ce]", "disagree on N", "4 rows vs 3 labels"});
  kg_test::expect_error([&] { kg::cross_entropy(x, yf, "ce"); },
                        {"[nn.cross_entropy @ ce]", "integer class labels (i32 or i64)", "f32"});
  kg_test::expect_error([&] { kg::cross_entropy(xi, y, "ce"); },
                        {"[nn.cross_entropy @ ce]", "f32 or f64 logits", "i64"});
}

TEST(CrossEntropy, MatchesPyTorch) {
  auto fx = kg_test::fixture("loss_cross_entropy.safetensors");
  const kg::Tensor& labels = fx.at("labels");
  for (std::string tag : {"f32", "f64"})
    for (std::string set : {"", "large_"})
      for (const kg::Tensor& l : {labels, labels_i32(labels)}) {
        SCOPED_TRACE(set + tag + " labels " + std::string(kg::dtype_name(l.dtype())));
        const kg::Tensor& x = fx.at(set + "logits_" + tag);
        const double tol = tag == "f32" ? 1e-5 : 1e-12;
        kg::Tensor loss = loss_of(ce, x, l);
        ASSERT_EQ(loss.shape(), std::vector<std::int64_t>{});
        EXPECT_TRUE(kg_test::all_close(loss.reshaped({1}), fx.at(set + "loss_" + tag), tol, tol));
        auto op = loss_op(true, x.dtype(), l.dtype(), kg::Shape::of(x.shape()), kg::Shape::of(l.shape()));
        auto grads = cpu_grads(op, {x, l}, 1.0);
        EXPECT_TRUE(kg_test::all_close(grads[0], fx.at(set + "grad_" + tag), tol, tol));
        EXPECT_EQ(grads[1].raw(), nullptr);
      }
}

TEST(CrossEntropy, MatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t n : {1, 7, 64})
    for (std::int64_t c : {1, 3, 40})
      for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
        SCOPED_TRACE(::testing::Message() << "n " << n << " c " << c << " " << kg::dtype_name(dt));
        kg::Tensor x = kg_test::random_tensor(rng, dt, {n, c}, -8, 8);
        kg::Tensor l = random_labels(rng, n % 2 ? kg::DType::I64 : kg::DType::I32, n, c);
        const double tol = dt == kg::DType::F32 ? 1e-5 : 1e-12;
        EXPECT_NEAR(loss_of(ce, x, l).item(0), naive_cross_entropy(x, l),
                    tol * (1 + std::abs(naive_cross_entropy(x, l))));
      }
}

TEST(CrossEntropy, GradientsMatchFiniteDifferences) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (kg::DType lt : {kg::DType::I32, kg::DType::I64}) {
    std::mt19937_64 rng(seed);
    kg::testing::GradCheckOptions o;
    o.seed = seed;
    o.make_input = [&](int i, const std::vector<std::int64_t>& shape) {
      return i == 0 ? kg_test::random_tensor(rng, kg::DType::F64, shape, -3, 3)
                    : random_labels(rng, lt, shape[0], 6);
    };
    auto op = loss_op(true, kg::DType::F64, lt, {kg::dynamic, 6}, {kg::dynamic});
    auto r = kg::testing::check_gradients(op, {{9, 6}, {9}}, {kg::DType::F64, lt}, o);
    EXPECT_TRUE(r.ok) << r.to_string();
    int cpu = 0, emulated = 0;
    for (const auto& l : r.lines) {
      cpu += l.rfind("PASS cpu_backward, input 0", 0) == 0;
      emulated += l.rfind("PASS emulator", 0) == 0;
    }
    EXPECT_EQ(cpu, 1) << r.to_string();
    EXPECT_EQ(emulated, 1) << r.to_string();
  }
}

TEST(CrossEntropy, KernelsUnderEmulationMatchTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // check_op: shapes at several batch sizes, the emulated forward against the CPU, and the
  // gradient check (the emulated backward against the CPU backward) at the largest batch.
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
    kg::testing::CheckOpOptions o;
    o.seed = seed;
    o.batch_sizes = {1, 5, 33};
    o.rtol = dt == kg::DType::F32 ? 1e-5 : 1e-12;
    o.atol = dt == kg::DType::F32 ? 1e-6 : 1e-12;
    o.make_input = [&](int i, const std::vector<std::int64_t>& shape) {
      return i == 0 ? kg_test::random_tensor(rng, dt, shape, -4, 4)
                    : random_labels(rng, kg::DType::I64, shape[0], 37);
    };
    auto op = loss_op(true, dt, kg::DType::I64, {kg::dynamic, 37}, {kg::dynamic});
    auto r = kg::testing::check_op(op, {{kg::Dim::named("n"), 37}, {kg::Dim::named("n")}},
                                   {dt, kg::DType::I64}, o);
    EXPECT_TRUE(r.ok) << r.to_string();
    int lines = 0;
    for (const auto& l : r.lines)
      lines +=
          l.rfind("PASS batch 33, emulator", 0) == 0 || l.rfind("PASS gradients batch 33, emulator", 0) == 0;
    EXPECT_EQ(lines, 2) << r.to_string();
  }
  // Longer rows and more of them, with the NVRTC dry run where NVRTC is present.
  for (std::int64_t n : {1, 9, 130})
    for (std::int64_t c : {5, 1000}) {
      SCOPED_TRACE(::testing::Message() << "n " << n << " c " << c);
      kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {n, c}, -10, 10);
      kg::Tensor l = random_labels(rng, kg::DType::I32, n, c);
      kg_test::check_lowering(
          [](const std::vector<kg::SymTensor>& xs) { return std::vector<kg::SymTensor>{ce(xs[0], xs[1])}; },
          {x, l}, 1e-5, 1e-6);
    }
}

TEST(CrossEntropy, InvalidLabelIsAnErrorOnTheCpuAndNanOnTheGpu) {
  kg::Tensor x = kg::Tensor::from_vector<float>({3, 5}, std::vector<float>(15, 0.5f));
  for (std::int64_t bad : {5, -1}) {
    kg::Tensor l = kg::Tensor::from_vector<std::int64_t>({3}, {0, 4, bad});
    kg_test::expect_error([&] { loss_of(ce, x, l); },
                          {"[nn.cross_entropy @ loss] row 2 has label " + std::to_string(bad) +
                           ", outside [0, 5) for C = 5 classes"});
    // The backward checks too.
    auto op = loss_op(true, kg::DType::F32, kg::DType::I64, {3, 5}, {3});
    kg::Tensor out = kg::Tensor::zeros(kg::DType::F32, {}), dout = kg::Tensor::zeros(kg::DType::F32, {});
    std::vector<kg::Tensor> grads{kg::Tensor::zeros(kg::DType::F32, {3, 5}),
                                  kg::Tensor::wrap(nullptr, kg::DType::I64, {3})};
    std::vector<kg::Tensor> ins{x, l};
    kg::CpuBackwardContext ctx(ins, {}, out, dout, grads, {}, true, 1);
    kg_test::expect_error([&] { op->cpu_backward(ctx); }, {"row 2 has label " + std::to_string(bad)});

    // The kernel cannot throw: the batch's loss is NaN.
    auto g = kg::Graph::create();
    auto xs = g->input(kg::DType::F32, {kg::dynamic, 5});
    auto ls = g->input(kg::DType::I64, {kg::dynamic});
    kg::Model model(g, {ce(xs, ls)});
    kg::Tensor got = kg::emu::run_model(model, {x, l}, {}, true).at(0);
    EXPECT_TRUE(std::isnan(got.item(0))) << got.item(0);
    kg::Tensor good = kg::Tensor::from_vector<std::int64_t>({3}, {0, 4, 2});
    EXPECT_NEAR(kg::emu::run_model(model, {x, good}, {}, true).at(0).item(0), std::log(5.0), 1e-6);

    // The backward kernel writes NaN into the row of the invalid label, the others as usual
    // (softmax 0.2 everywhere; minus 1 at the label; times dloss / N = 1.5 / 3).
    kg::LowerContext lc;
    lc.node = "loss";
    lc.input_dtypes = {kg::DType::F32, kg::DType::I64};
    lc.output_dtype = kg::DType::F32;
    lc.input_shapes = {kg::Shape::of({3, 5}), kg::Shape::of({3})};
    lc.concrete_input_shapes = {{3, 5}, {3}};
    lc.mode = kg::LoweringMode::Training;
    auto lowered = op->lower(lc);
    ASSERT_TRUE(lowered && lowered->runtime_op);
    EXPECT_EQ(lowered->entry_point, "kg_cross_entropy_f32_i64");  // the node's dtypes
    const std::string backward_source = op->lower_backward_source(lc);
    ASSERT_FALSE(backward_source.empty());
    const kg::RuntimeOp& rt = *lowered->runtime_op;
    kg::Tensor xd = x.clone(), ld = l.clone(), dl = kg::Tensor::from_vector<float>({}, {1.5f});
    kg::Tensor dx = kg::Tensor::zeros(kg::DType::F32, {3, 5});
    auto addr = [](kg::Tensor& t) {
      return static_cast<kg::DevicePtr>(reinterpret_cast<std::uintptr_t>(t.raw()));
    };
    kg::LaunchTensors t;
    t.inputs = {{addr(xd), {3, 5}, kg::DType::F32}, {addr(ld), {3}, kg::DType::I64}};
    t.output = {0, {}, kg::DType::F32};
    t.grad_output = {addr(dl), {}, kg::DType::F32};
    t.grad_inputs = {{addr(dx), {3, 5}, kg::DType::F32}, {0, {3}, kg::DType::I64}};
    t.training = true;
    const std::vector<kg::Launch> launches = rt.backward_launches(t);
    ASSERT_EQ(launches.size(), 1u);
    const kg::Launch& bl = launches[0];
    EXPECT_EQ(bl.entry, "kg_cross_entropy_backward_f32_i64");
    kg::emu::LaunchOptions lo;
    lo.checked = true;
    lo.buffers = {{addr(xd), xd.nbytes(), "logits"},
                  {addr(ld), ld.nbytes(), "labels"},
                  {addr(dl), dl.nbytes(), "dloss"},
                  {addr(dx), dx.nbytes(), "dlogits"}};
    kg::emu::launch("nn.cross_entropy.backward", backward_source, bl.entry, bl.grid, bl.block,
                    bl.shared_bytes, bl.args, lo);
    for (std::int64_t j = 0; j < 5; ++j) {
      EXPECT_NEAR(dx.item(j), 0.5 * (0.2 - (j == 0 ? 1.0 : 0.0)), 1e-6) << j;
      EXPECT_NEAR(dx.item(5 + j), 0.5 * (0.2 - (j == 4 ? 1.0 : 0.0)), 1e-6) << j;
      EXPECT_TRUE(std::isnan(dx.item(10 + j))) << j;
    }
  }
}

// ---- mean squared error ----

TEST(MseLoss, ShapeAndDtypeAndErrors) {
  auto g = kg::Graph::create();
  auto p = g->input(kg::DType::F64, {kg::Dim::named("batch"), 3, 2});
  auto t = g->input(kg::DType::F64, {kg::Dim::named("batch"), 3, 2});
  auto l = kg::mse_loss(p, t, "loss");
  EXPECT_EQ(l.shape().to_string(), "[]");
  EXPECT_EQ(l.dtype(), kg::DType::F64);
  EXPECT_EQ(g->node(l.node()).op_name(), "nn.mse_loss");
  auto t2 = g->input(kg::DType::F64, {kg::dynamic, 3, 4});
  auto t3 = g->input(kg::DType::F64, {kg::dynamic, 3});
  auto tf = g->input(kg::DType::F32, {kg::dynamic, 3, 2});
  auto ti = g->input(kg::DType::I32, {kg::dynamic, 3, 2});
  kg_test::expect_error(
      [&] { kg::mse_loss(p, t2, "mse"); },
      {"[nn.mse_loss @ mse]", "prediction [batch, 3, 2] and target [?, 3, 4]", "same shape"});
  kg_test::expect_error([&] { kg::mse_loss(p, t3, "mse"); }, {"[nn.mse_loss @ mse]", "same shape"});
  kg_test::expect_error([&] { kg::mse_loss(p, tf, "mse"); },
                        {"[nn.mse_loss @ mse]", "one dtype", "f64", "f32"});
  kg_test::expect_error([&] { kg::mse_loss(ti, ti, "mse"); }, {"[nn.mse_loss @ mse]", "f32 and f64", "i32"});
  // Dynamic dims are compared at load, with the sizes known.
  auto [a, g2] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 2}, "a");
  auto b = g2->input(kg::DType::F32, {kg::dynamic, 2}, "b");
  kg::Model model(g2, {kg::mse_loss(a, b, "mse")});
  kg_test::expect_error([&] { model.load(kg::Device::cpu(), {{3, 2}, {4, 2}}); }, {"mse", "same shape"});
}

TEST(MseLoss, MatchesPyTorchAndNaiveReference) {
  auto fx = kg_test::fixture("loss_mse.safetensors");
  for (std::string tag : {"f32", "f64"}) {
    SCOPED_TRACE(tag);
    const kg::Tensor &p = fx.at("pred_" + tag), &t = fx.at("target_" + tag);
    const double tol = tag == "f32" ? 1e-6 : 1e-13;
    EXPECT_TRUE(kg_test::all_close(loss_of(mse, p, t).reshaped({1}), fx.at("loss_" + tag), tol, tol));
    auto op = loss_op(false, p.dtype(), t.dtype(), kg::Shape::of(p.shape()), kg::Shape::of(t.shape()));
    auto grads = cpu_grads(op, {p, t}, 1.0);
    EXPECT_TRUE(kg_test::all_close(grads[0], fx.at("grad_pred_" + tag), tol, tol));
    EXPECT_TRUE(kg_test::all_close(grads[1], fx.at("grad_target_" + tag), tol, tol));
  }
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t n : {1, 5, 300})
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      kg::Tensor p = kg_test::random_tensor(rng, dt, {n, 7}), t = kg_test::random_tensor(rng, dt, {n, 7});
      const double tol = dt == kg::DType::F32 ? 1e-6 : 1e-13;
      EXPECT_NEAR(loss_of(mse, p, t).item(0), naive_mse(p, t), tol);
    }
}

TEST(MseLoss, GradientsMatchFiniteDifferencesAndKernelsMatchTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  kg::testing::GradCheckOptions g;
  g.seed = seed;
  auto r = kg::testing::check_gradients(loss_op(false, kg::DType::F64, kg::DType::F64, {4, 3, 5}, {4, 3, 5}),
                                        {{4, 3, 5}, {4, 3, 5}}, {kg::DType::F64, kg::DType::F64}, g);
  EXPECT_TRUE(r.ok) << r.to_string();
  int cpu = 0, emulated = 0;
  for (const auto& l : r.lines) {
    cpu += l.rfind("PASS cpu_backward, input ", 0) == 0;
    emulated += l.rfind("PASS emulator", 0) == 0;
  }
  EXPECT_EQ(cpu, 2) << r.to_string();
  EXPECT_EQ(emulated, 2) << r.to_string();

  std::mt19937_64 rng(seed);
  for (std::int64_t n : {1, 9, 700})
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      SCOPED_TRACE(::testing::Message() << "n " << n << " " << kg::dtype_name(dt));
      kg::Tensor p = kg_test::random_tensor(rng, dt, {n, 3, 5}),
                 t = kg_test::random_tensor(rng, dt, {n, 3, 5});
      kg_test::check_lowering(
          [](const std::vector<kg::SymTensor>& xs) { return std::vector<kg::SymTensor>{mse(xs[0], xs[1])}; },
          {p, t}, dt == kg::DType::F32 ? 1e-5 : 1e-12, dt == kg::DType::F32 ? 1e-6 : 1e-12);
    }
}
