// Loading: shape binding at load, the checks on what ops declared, forward, errors from ops,
// poisoned buffers, dead nodes, views, profiling and modes.
#include <atomic>
#include <cmath>
#include <stdexcept>

#include "support/test_util.hpp"

using kg_test::expect_error;
using kg_test::fresh_seed;

namespace {

// ---- test ops ----

// Elementwise y = factor * x (f32 or f64), multithreaded.
class ScaleOp final : public kg::CustomOp {
 public:
  explicit ScaleOp(double f) : f_(f) {}
  std::string name() const override { return "test.scale"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    if (in.size() != 1) throw kg::Error("expects 1 input, got " + std::to_string(in.size()));
    return in[0];
  }
  void cpu_forward(kg::CpuContext& ctx) const override {
    const kg::Tensor& x = ctx.inputs[0];
    kg::Tensor& y = ctx.output;
    if (x.dtype() == kg::DType::F64) {
      run(ctx, x.data<double>(), y.data<double>(), y.numel());
    } else {
      run(ctx, x.data<float>(), y.data<float>(), y.numel());
    }
  }

 private:
  template <class T>
  void run(const kg::CpuContext& ctx, const T* x, T* y, std::int64_t n) const {
    ctx.parallel_for(n, 16, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) y[i] = static_cast<T>(f_ * x[i]);
    });
  }
  double f_;
};

kg::SymTensor scale(const kg::SymTensor& x, double f, const std::string& name = "") {
  return x.record_custom(kg::CustomData::make<ScaleOp>(f), {}, std::nullopt, name);
}

// [N, ...] -> [N, prod(...)] reinterpreting the input's bytes. Never executed.
class FlattenView final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.flatten"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    const kg::Shape& s = in.at(0);
    kg::Shape out{s[0]};
    std::int64_t n = 1;
    bool dyn = false;
    for (std::size_t i = 1; i < s.rank(); ++i) {
      dyn = dyn || s[i].is_dynamic();
      n *= s[i].is_dynamic() ? 1 : s[i].size();
    }
    out.push_back(dyn ? kg::Dim(kg::dynamic) : kg::Dim(n));
    return out;
  }
  bool is_view() const override { return true; }
  void cpu_forward(kg::CpuContext&) const override { throw kg::Error("a view must not be executed"); }
};

// y = a + b for two inputs of one shape (f32).
class AddOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.add"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    if (in.size() != 2 || in[0].rank() != in[1].rank()) throw kg::Error("expects two inputs of one rank");
    return in[0];
  }
  void cpu_forward(kg::CpuContext& ctx) const override {
    const float* a = ctx.inputs[0].data<float>();
    const float* b = ctx.inputs[1].data<float>();
    float* y = ctx.output.data<float>();
    for (std::int64_t i = 0; i < ctx.output.numel(); ++i) y[i] = a[i] + b[i];
  }
};

// How an op's infer_output_shape lies at load.
enum class Lie {
  Dynamic,         // returns a dynamic dim even for concrete inputs
  StaticAtRecord,  // declares [in0, 5] at record time, computes [in0, in1] at load
  FlipAtLoad,      // declares the input's shape, returns it reversed at load
  GrowAtLoad,      // declares the input's shape, appends a dim at load
  ThrowAtLoad,     // fine at record time, throws at load
};

class LyingOp final : public kg::CustomOp {
 public:
  explicit LyingOp(Lie lie) : lie_(lie) {}
  std::string name() const override { return "test.liar"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    const kg::Shape& s = in.at(0);
    const bool load = s.is_concrete();
    switch (lie_) {
      case Lie::Dynamic:
        return kg::Shape{s[0], kg::dynamic};
      case Lie::StaticAtRecord:
        return load ? s : kg::Shape{s[0], 5};
      case Lie::FlipAtLoad:
        return load ? kg::Shape{s[1], s[0]} : s;
      case Lie::GrowAtLoad: {
        kg::Shape g = s;
        if (load) g.push_back(1);
        return g;
      }
      case Lie::ThrowAtLoad:
        if (load) throw kg::Error("cannot take " + s.to_string());
        return s;
    }
    return s;
  }
  void cpu_forward(kg::CpuContext& ctx) const override { ctx.output.fill(0.0); }

 private:
  Lie lie_;
};

// cpu_forward fails in one of several ways.
enum class Boom { KgError, StdError, InWorker };
class BoomOp final : public kg::CustomOp {
 public:
  explicit BoomOp(Boom how) : how_(how) {}
  std::string name() const override { return "test.boom"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  void cpu_forward(kg::CpuContext& ctx) const override {
    switch (how_) {
      case Boom::KgError:
        throw kg::Error("exploded at row 3");
      case Boom::StdError:
        throw std::runtime_error("vector::_M_range_check");
      case Boom::InWorker:
        ctx.parallel_for(1000, 1, [](std::int64_t b, std::int64_t e) {
          if (b > 0 && b < e) throw kg::Error("worker chunk failed");
        });
        ctx.output.fill(0.0);
        return;
    }
  }

 private:
  Boom how_;
};

class NoCpuOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.gpu_only"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
};

// Writes y = x at even flat indices only: a bug that poisoned buffers must reveal.
class SkipOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.skip"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  void cpu_forward(kg::CpuContext& ctx) const override {
    const float* x = ctx.inputs[0].data<float>();
    float* y = ctx.output.data<float>();
    for (std::int64_t i = 0; i < ctx.output.numel(); i += 2) y[i] = x[i];
  }
};

// Counts its executions (the counter is shared by the test through a pointer).
class CountingOp final : public kg::CustomOp {
 public:
  explicit CountingOp(std::atomic<int>* runs) : runs_(runs) {}
  std::string name() const override { return "test.count"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  void cpu_forward(kg::CpuContext& ctx) const override {
    ++*runs_;
    ctx.output.fill(1.0);
  }

 private:
  std::atomic<int>* runs_;
};

// y = x * (training ? 2 : 1).
class TrainFlagOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.train_flag"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  void cpu_forward(kg::CpuContext& ctx) const override {
    const float* x = ctx.inputs[0].data<float>();
    float* y = ctx.output.data<float>();
    for (std::int64_t i = 0; i < ctx.output.numel(); ++i) y[i] = ctx.training ? 2 * x[i] : x[i];
  }
};

// ---- references ----

// y = x wᵀ + b in double over the last dim.
kg::Tensor ref_linear(const kg::Tensor& x, const kg::Tensor& w, const kg::Tensor* b) {
  const std::int64_t in = w.dim(1), out = w.dim(0), rows = x.numel() / in;
  std::vector<std::int64_t> shape = x.shape();
  shape.back() = out;
  kg::Tensor y = kg::Tensor::empty(kg::DType::F64, shape);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < out; ++j) {
      double s = b ? b->item(j) : 0.0;
      for (std::int64_t k = 0; k < in; ++k) s += x.item(r * in + k) * w.item(j * in + k);
      y.data<double>()[r * out + j] = s;
    }
  return y;
}

kg::Tensor ref_scale(const kg::Tensor& x, double f) {
  kg::Tensor y = kg::Tensor::empty(kg::DType::F64, x.shape());
  for (std::int64_t i = 0; i < x.numel(); ++i) y.data<double>()[i] = f * x.item(i);
  return y;
}

// Random values for every parameter of a loaded model.
std::map<std::string, kg::Tensor> random_params(const kg::LoadedModel& m, std::mt19937_64& rng) {
  std::map<std::string, kg::Tensor> p;
  for (const auto& info : m.parameters()) p[info.name] = kg_test::random_tensor(rng, info.dtype, info.shape);
  return p;
}

// Same shape, dtype and every element bit-for-bit equal in value.
::testing::AssertionResult same_values(const kg::Tensor& a, const kg::Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype())
    return ::testing::AssertionFailure()
           << kg::sizes_to_string(a.shape()) << " " << kg::dtype_name(a.dtype()) << " vs "
           << kg::sizes_to_string(b.shape()) << " " << kg::dtype_name(b.dtype());
  for (std::int64_t i = 0; i < a.numel(); ++i)
    if (!(a.item(i) == b.item(i)))
      return ::testing::AssertionFailure() << "element " << i << ": " << a.item(i) << " vs " << b.item(i);
  return ::testing::AssertionSuccess();
}

kg::LoadOptions poisoned(int threads = 0) {
  kg::LoadOptions o;
  o.poison_buffers = true;
  o.threads = threads;
  return o;
}

// x [batch, 12] -> fc1 (8) -> half (×0.5) -> fc2 (3); outputs logits and hidden.
kg::Model mlp(kg::DType dt) {
  auto [x, g] = kg::SymTensor::input(dt, {kg::Dim::named("batch"), 12}, "x");
  kg::SymTensor h, y;
  {
    kg::NameScope enc(*g, "enc");
    h = scale(kg::nn::linear(x, 8, "fc1"), 0.5, "half");
  }
  y = kg::nn::linear(h, 3, "fc2");
  return kg::Model(g, {{"logits", y}, {"hidden", h}});
}

}  // namespace

TEST(Load, DynamicBatchMatchesReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
    kg::Model model = mlp(dt);
    ASSERT_EQ(model.parameters().size(), 4u);
    EXPECT_EQ(model.parameters()[0].name, "enc.fc1.weight");
    EXPECT_EQ(model.parameters()[3].name, "fc2.bias");
    for (std::int64_t batch : {1, 7, 64}) {
      SCOPED_TRACE(std::string(kg::dtype_name(dt)) + " batch " + std::to_string(batch));
      kg::LoadedModel m = model.load(kg::Device::cpu(), {{batch, 12}}, poisoned(batch == 7 ? 3 : 0));
      EXPECT_EQ(m.device().to_string(), "cpu");
      EXPECT_EQ(m.output_names(), (std::vector<std::string>{"logits", "hidden"}));
      EXPECT_EQ(m.input_shapes(), (std::vector<std::vector<std::int64_t>>{{batch, 12}}));
      EXPECT_EQ(m.output_shapes(), (std::vector<std::vector<std::int64_t>>{{batch, 3}, {batch, 8}}));
      auto params = random_params(m, rng);
      m.load_state_dict(params);
      kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, 12});
      // Run twice: the second run must not depend on what the first left in the buffers.
      for (int run = 0; run < 2; ++run) {
        std::vector<kg::Tensor> out = m.forward({x});
        ASSERT_EQ(out.size(), 2u);
        kg::Tensor h = ref_scale(ref_linear(x, params["enc.fc1.weight"], &params["enc.fc1.bias"]), 0.5);
        kg::Tensor y = ref_linear(h, params["fc2.weight"], &params["fc2.bias"]);
        EXPECT_EQ(out[0].dtype(), dt);
        EXPECT_TRUE(kg_test::all_written(out[0]));
        EXPECT_TRUE(kg_test::all_written(out[1]));
        const double rtol = dt == kg::DType::F32 ? 1e-5 : 1e-12;
        EXPECT_TRUE(kg_test::all_close(out[0], y, rtol, 1e-6));
        EXPECT_TRUE(kg_test::all_close(out[1], h, rtol, 1e-6));
      }
    }
  }
}

TEST(Load, InputShapeErrorsNameTheInputAndSizes) {
  kg::Model model = mlp(kg::DType::F32);
  auto cpu = kg::Device::cpu();
  expect_error([&] { model.load(cpu, {}); }, {"graph has 1 input(s) but 0 shape(s)"});
  expect_error([&] { model.load(cpu, {{2, 12}, {2, 12}}); }, {"graph has 1 input(s) but 2 shape(s)"});
  expect_error([&] { model.load(cpu, {{24}}); },
               {"input 'x'", "declared [batch, 12]", "got [24]", "rank 1 where 2 was declared"});
  expect_error([&] { model.load(cpu, {{2, 12, 1}}); }, {"input 'x'", "[2, 12, 1]", "rank 3 where 2"});
  expect_error(
      [&] {
        model.load(cpu, {{4, 13}});
      },
      {"input 'x'", "declared [batch, 12]", "got [4, 13]", "dim 1 is 13, declared 12"});
  expect_error([&] { model.load(cpu, {{-1, 12}}); }, {"input 'x'", "negative size", "[-1, 12]"});

  // Two inputs sharing the symbol "batch" must agree.
  auto g = kg::Graph::create();
  kg::SymTensor a = g->input(kg::DType::F32, {kg::Dim::named("batch"), 4}, "a");
  kg::SymTensor b = g->input(kg::DType::F32, {kg::Dim::named("batch"), kg::Dim::named("len")}, "b");
  kg::Model two(g, {scale(a, 1.0, "sa"), scale(b, 1.0, "sb")});
  EXPECT_EQ(two.outputs()[0].first, "output0");
  EXPECT_EQ(two.outputs()[1].first, "output1");
  expect_error(
      [&] {
        two.load(cpu, {{3, 4}, {5, 4}});
      },
      {"input 'b'", "declared [batch, len]", "got [5, 4]", "dim 0 ('batch') is 5",
       "'batch' is already bound to 3"});
  kg::LoadedModel ok = two.load(cpu, {{3, 4}, {3, 9}});
  EXPECT_EQ(ok.output_shapes(), (std::vector<std::vector<std::int64_t>>{{3, 4}, {3, 9}}));
  // Anonymous dynamic dims are independent unknowns.
  auto g2 = kg::Graph::create();
  kg::SymTensor c = g2->input(kg::DType::F32, {kg::dynamic, 2}, "c");
  kg::SymTensor d = g2->input(kg::DType::F32, {kg::dynamic, 2}, "d");
  kg::Model anon(g2, {scale(c, 1.0), scale(d, 1.0)});
  EXPECT_EQ(anon.load(cpu, {{3, 2}, {8, 2}}).output_shapes(),
            (std::vector<std::vector<std::int64_t>>{{3, 2}, {8, 2}}));
}

TEST(Load, LyingShapeInferenceIsCaught) {
  auto cpu = kg::Device::cpu();
  auto build = [](Lie lie) {
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 4}, "x");
    kg::NameScope s(*g, "head");
    kg::SymTensor y = x.record_custom(kg::CustomData::make<LyingOp>(lie), {}, std::nullopt, "decode");
    return kg::Model(g, {scale(y, 1.0)});
  };
  // (a) a dynamic dim although every input dim is known.
  expect_error(
      [&] {
        build(Lie::Dynamic).load(cpu, {{3, 4}});
      },
      {"[test.liar @ head.decode]", "infer_output_shape returned [3, ?]", "concrete inputs [3, 4]",
       "every output dim must be known"});
  // (b) the load-time answer disagrees with the record-time declaration.
  expect_error(
      [&] {
        build(Lie::StaticAtRecord).load(cpu, {{3, 4}});
      },
      {"[test.liar @ head.decode]", "disagrees with itself", "declared [batch, 5]", "inputs [3, 4]",
       "gives [3, 4]", "dim 1 is 4, declared 5"});
  expect_error(
      [&] {
        build(Lie::FlipAtLoad).load(cpu, {{3, 4}});
      },
      {"[test.liar @ head.decode]", "declared [batch, 4]", "gives [4, 3]", "dim 0 ('batch') is 4",
       "already bound to 3"});
  expect_error(
      [&] {
        build(Lie::GrowAtLoad).load(cpu, {{3, 4}});
      },
      {"[test.liar @ head.decode]", "declared [batch, 4]", "gives [3, 4, 1]", "rank 3 where 2"});
  expect_error(
      [&] {
        build(Lie::ThrowAtLoad).load(cpu, {{3, 4}});
      },
      {"[test.liar @ head.decode] at load, with inputs [3, 4]: cannot take [3, 4]"});
  // The flip is only a lie when the sizes differ: a square input satisfies the declaration.
  kg::LoadedModel sq = build(Lie::FlipAtLoad).load(cpu, {{4, 4}});
  EXPECT_EQ(sq.output_shapes()[0], (std::vector<std::int64_t>{4, 4}));
}

TEST(Load, ForwardChecksItsInputs) {
  kg::Model model = mlp(kg::DType::F32);
  kg::LoadedModel m = model.load(kg::Device::cpu(), {{7, 12}});
  expect_error([&] { m.forward({}); }, {"forward", "1 input(s) but 0 tensor(s)"});
  kg::Tensor x = kg::Tensor::zeros(kg::DType::F32, {7, 12});
  expect_error([&] { m.forward({x, x}); }, {"1 input(s) but 2 tensor(s)"});
  expect_error(
      [&] {
        m.forward({kg::Tensor::zeros(kg::DType::F32, {8, 12})});
      },
      {"input 'x'", "loaded as [7, 12] f32", "got [8, 12] f32", "load the model again"});
  expect_error(
      [&] {
        m.forward({kg::Tensor::zeros(kg::DType::F64, {7, 12})});
      },
      {"input 'x'", "loaded as [7, 12] f32", "got [7, 12] f64"});
  expect_error([&] { m.forward({kg::Tensor::zeros(kg::DType::F32, {7, 12, 1})}); }, {"got [7, 12, 1] f32"});
  EXPECT_EQ(m.forward({x}).size(), 2u);
}

TEST(Load, OpErrorsArePrefixedWithTheNodeLabel) {
  auto cpu = kg::Device::cpu();
  auto run = [&](kg::CustomData op) {
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 4}, "x");
    kg::NameScope s(*g, "blk");
    kg::SymTensor y = x.record_custom(op, {}, std::nullopt, "b");
    kg::LoadedModel m = kg::Model(g, {scale(y, 1.0)}).load(cpu, {{5, 4}}, poisoned(4));
    m.forward({kg::Tensor::zeros(kg::DType::F32, {5, 4})});
  };
  expect_error([&] { run(kg::CustomData::make<BoomOp>(Boom::KgError)); },
               {"[test.boom @ blk.b] exploded at row 3"});
  expect_error([&] { run(kg::CustomData::make<BoomOp>(Boom::StdError)); },
               {"[test.boom @ blk.b] cpu_forward failed: vector::_M_range_check"});
  expect_error([&] { run(kg::CustomData::make<BoomOp>(Boom::InWorker)); },
               {"[test.boom @ blk.b] worker chunk failed"});
  expect_error([&] { run(kg::CustomData::make<NoCpuOp>()); },
               {"[test.gpu_only @ blk.b] has no CPU implementation"});
}

TEST(Load, PoisonedBuffersRevealUnwrittenElements) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 5}, "x");
  kg::SymTensor skipped = x.record_custom(kg::CustomData::make<SkipOp>(), {}, std::nullopt, "skip");
  kg::SymTensor after = scale(skipped, 3.0, "after");
  kg::Model model(g, {{"skipped", skipped}, {"after", after}});
  kg::LoadedModel m = model.load(kg::Device::cpu(), {{3, 5}}, poisoned());
  EXPECT_TRUE(m.memory_plan().arena_bytes >= 2 * 15 * sizeof(float));
  kg::Tensor in = kg_test::random_tensor(rng, kg::DType::F32, {3, 5});
  for (int run = 0; run < 2; ++run) {
    auto out = m.forward({in});
    EXPECT_FALSE(kg_test::all_written(out[0]));
    EXPECT_FALSE(kg_test::all_written(out[1]));
    for (std::int64_t i = 0; i < 15; ++i) {
      if (i % 2 == 0) {
        EXPECT_EQ(out[0].item(i), in.item(i));
        EXPECT_FLOAT_EQ(static_cast<float>(out[1].item(i)), static_cast<float>(3.0 * in.item(i)));
      } else {
        EXPECT_TRUE(std::isnan(out[0].item(i))) << i;
        EXPECT_TRUE(std::isnan(out[1].item(i))) << i;
      }
    }
  }
  // A correct op under the same poisoning writes everything.
  kg::Model fine(g, {scale(x, 2.0, "fine")});
  auto out = fine.load(kg::Device::cpu(), {{3, 5}}, poisoned()).forward({in});
  EXPECT_TRUE(kg_test::all_written(out[0]));
  EXPECT_TRUE(kg_test::all_close(out[0], ref_scale(in, 2.0)));
}

TEST(Load, SameModelLoadedTwiceGivesIndependentModels) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  kg::Model model = mlp(kg::DType::F32);
  kg::LoadedModel a = model.load(kg::Device::cpu(), {{2, 12}}, poisoned());
  kg::LoadedModel b = model.load(kg::Device::cpu(), {{9, 12}}, poisoned());
  EXPECT_EQ(a.output_shapes()[0], (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(b.output_shapes()[0], (std::vector<std::int64_t>{9, 3}));
  EXPECT_LT(a.memory_plan().arena_bytes, b.memory_plan().arena_bytes);
  // The same default seed initialises both the same way; storage is not shared.
  for (const auto& [name, t] : a.state_dict()) EXPECT_TRUE(same_values(t, b.parameter(name))) << name;
  auto pa = random_params(a, rng);
  auto pb = random_params(b, rng);
  a.load_state_dict(pa);
  b.load_state_dict(pb);
  EXPECT_TRUE(same_values(a.parameter("fc2.weight"), pa["fc2.weight"]));
  EXPECT_TRUE(same_values(b.parameter("fc2.weight"), pb["fc2.weight"]));
  kg::Tensor xa = kg_test::random_tensor(rng, kg::DType::F32, {2, 12});
  kg::Tensor xb = kg_test::random_tensor(rng, kg::DType::F32, {9, 12});
  // Interleaved runs.
  auto ya = a.forward({xa});
  auto yb = b.forward({xb});
  auto ya2 = a.forward({xa});
  auto ref = [](const kg::Tensor& x, std::map<std::string, kg::Tensor>& p) {
    kg::Tensor h = ref_scale(ref_linear(x, p["enc.fc1.weight"], &p["enc.fc1.bias"]), 0.5);
    return ref_linear(h, p["fc2.weight"], &p["fc2.bias"]);
  };
  EXPECT_TRUE(kg_test::all_close(ya[0], ref(xa, pa)));
  EXPECT_TRUE(kg_test::all_close(ya2[0], ref(xa, pa)));
  EXPECT_TRUE(kg_test::all_close(yb[0], ref(xb, pb)));
  // A different seed gives a different default initialisation.
  kg::LoadOptions other;
  other.seed = 12345;
  kg::LoadedModel c = model.load(kg::Device::cpu(), {{2, 12}}, other);
  EXPECT_FALSE(same_values(c.parameter("enc.fc1.weight"),
                           model.load(kg::Device::cpu(), {{2, 12}}).parameter("enc.fc1.weight")));
}

TEST(Load, DeadNodesAreNotExecuted) {
  std::atomic<int> live_runs{0}, dead_runs{0};
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 6}, "x");
  kg::SymTensor used =
      x.record_custom(kg::CustomData::make<CountingOp>(&live_runs), {}, std::nullopt, "used");
  kg::SymTensor dead =
      x.record_custom(kg::CustomData::make<CountingOp>(&dead_runs), {}, std::nullopt, "dead");
  kg::SymTensor dead_fc = kg::nn::linear(dead, 4, "dead_fc");
  // A dead node's shape inference is not consulted at load either.
  dead_fc.record_custom(kg::CustomData::make<LyingOp>(Lie::ThrowAtLoad), {}, std::nullopt, "dead_liar");
  kg::SymTensor out = scale(used, 2.0, "out");
  kg::Model model(g, {out});
  std::vector<std::string> live;
  for (int id : model.live_nodes()) live.push_back(model.graph().node(id).name);
  EXPECT_EQ(live, (std::vector<std::string>{"x", "used", "out"}));
  EXPECT_TRUE(model.parameters().empty());
  kg::LoadOptions opt = poisoned();
  opt.profile = true;
  kg::LoadedModel m = model.load(kg::Device::cpu(), {{4, 6}}, opt);
  EXPECT_EQ(m.memory_plan().buffers, 2);
  EXPECT_EQ(m.memory_plan().param_bytes, 0u);
  EXPECT_TRUE(m.parameters().empty());
  expect_error([&] { m.parameter("dead_fc.weight"); }, {"no parameter named 'dead_fc.weight'"});
  auto y = m.forward({kg::Tensor::zeros(kg::DType::F32, {4, 6})});
  m.forward({kg::Tensor::zeros(kg::DType::F32, {4, 6})});
  EXPECT_EQ(live_runs.load(), 2);
  EXPECT_EQ(dead_runs.load(), 0);
  for (std::int64_t i = 0; i < y[0].numel(); ++i) EXPECT_EQ(y[0].item(i), 2.0);
  ASSERT_EQ(m.profile().size(), 2u);
  EXPECT_EQ(m.profile()[0].node, "used");
  EXPECT_EQ(m.profile()[1].node, "out");
}

TEST(Load, ProfileHasOneEntryPerExecutedNode) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, 4}, "x");
  kg::SymTensor a = scale(x, 2.0, "a");
  kg::SymTensor v = a.record_custom(kg::CustomData::make<FlattenView>(), {}, std::nullopt, "flat");
  EXPECT_EQ(v.shape().to_string(), "[batch, 12]");
  kg::SymTensor b = scale(v, -1.5, "b");
  kg::SymTensor fc = kg::nn::linear(b, 5, "fc");
  kg::Model model(g, {{"y", fc}, {"flat", v}});
  kg::LoadOptions opt = poisoned();
  opt.profile = true;
  kg::LoadedModel m = model.load(kg::Device::cpu(), {{6, 3, 4}}, opt);
  EXPECT_TRUE(m.profile().empty());
  auto p = random_params(m, rng);
  m.load_state_dict(p);
  kg::Tensor in = kg_test::random_tensor(rng, kg::DType::F32, {6, 3, 4});
  for (int run = 0; run < 2; ++run) {
    auto out = m.forward({in});
    std::vector<kg::NodeTime> prof = m.profile();
    ASSERT_EQ(prof.size(), 3u);  // the view is not executed
    EXPECT_EQ(prof[0].node, "a");
    EXPECT_EQ(prof[0].op, "test.scale");
    EXPECT_EQ(prof[1].node, "b");
    EXPECT_EQ(prof[2].node, "fc");
    EXPECT_EQ(prof[2].op, "nn.linear");
    for (const auto& t : prof) EXPECT_GE(t.ms, 0.0);
    kg::Tensor flat = ref_scale(in, 2.0).reshaped({6, 12});
    EXPECT_TRUE(kg_test::all_close(out[1], flat));
    EXPECT_TRUE(kg_test::all_close(out[0], ref_linear(ref_scale(flat, -1.5), p["fc.weight"], &p["fc.bias"])));
  }
  // Without the option, nothing is recorded.
  kg::LoadedModel q = model.load(kg::Device::cpu(), {{6, 3, 4}});
  q.forward({in});
  EXPECT_TRUE(q.profile().empty());
}

TEST(Load, ViewsAndInputsAsOutputs) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 2, 3}, "x");
  kg::SymTensor v = x.record_custom(kg::CustomData::make<FlattenView>(), {}, std::nullopt, "flat");
  kg::Model model(g, {{"x", x}, {"flat", v}, {"s", scale(v, 4.0)}});
  kg::LoadedModel m = model.load(kg::Device::cpu(), {{5, 2, 3}}, poisoned());
  EXPECT_EQ(m.memory_plan().buffers, 1);
  kg::Tensor in = kg_test::random_tensor(rng, kg::DType::F32, {5, 2, 3});
  auto out = m.forward({in});
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].shape(), (std::vector<std::int64_t>{5, 2, 3}));
  EXPECT_EQ(out[1].shape(), (std::vector<std::int64_t>{5, 6}));
  EXPECT_TRUE(same_values(out[0], in));
  EXPECT_TRUE(same_values(out[1], in.reshaped({5, 6})));
  EXPECT_TRUE(kg_test::all_close(out[2], ref_scale(in, 4.0).reshaped({5, 6})));
  // Outputs are copies: the caller's input is not aliased.
  EXPECT_NE(out[0].raw(), in.raw());
}

TEST(Load, OutputsConsumedLaterAreNotOverwritten) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 64}, "x");
  kg::SymTensor first = scale(x, 2.0, "first");
  kg::SymTensor t = first;
  for (int i = 0; i < 8; ++i) t = scale(t, 1.5);
  kg::Model model(g, {{"first", first}, {"last", t}});
  kg::LoadedModel m = model.load(kg::Device::cpu(), {{3, 64}}, poisoned());
  const std::size_t buf = 3 * 64 * sizeof(float);
  EXPECT_EQ(m.memory_plan().buffers, 9);
  EXPECT_EQ(m.memory_plan().unshared_bytes, 9 * buf);
  // "first" lives to the end; the chain needs two more buffers at a time.
  EXPECT_EQ(m.memory_plan().arena_bytes, 3 * buf);
  kg::Tensor in = kg_test::random_tensor(rng, kg::DType::F32, {3, 64});
  auto out = m.forward({in});
  EXPECT_TRUE(kg_test::all_close(out[0], ref_scale(in, 2.0)));
  EXPECT_TRUE(kg_test::all_close(out[1], ref_scale(in, 2.0 * std::pow(1.5, 8))));
}

TEST(Load, TrainingMode) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 3}, "x");
  kg::SymTensor y = x.record_custom(kg::CustomData::make<TrainFlagOp>(), {}, std::nullopt, "flag");
  kg::Tensor in = kg::Tensor::from_vector<float>({1, 3}, {1.f, -2.f, 0.5f});

  kg::LoadedModel inf = kg::Model(g, {y}).load(kg::Device::cpu(), {{1, 3}});
  expect_error([&] { inf.set_training(true); },
               {"set_training", "lowered for inference", "LoweringMode::Training"});
  inf.set_training(false);
  EXPECT_EQ(inf.forward({in})[0].item(1), -2.0);

  kg::Model train_model(g, {y}, kg::LoweringMode::Training);
  EXPECT_EQ(train_model.mode(), kg::LoweringMode::Training);
  kg::LoadedModel tr = train_model.load(kg::Device::cpu(), {{1, 3}});
  EXPECT_EQ(tr.forward({in})[0].item(1), -2.0);
  tr.set_training(true);
  EXPECT_EQ(tr.forward({in})[0].item(1), -4.0);
  EXPECT_EQ(tr.forward({in})[0].item(2), 1.0);
  tr.set_training(false);
  EXPECT_EQ(tr.forward({in})[0].item(0), 1.0);
}

TEST(Load, ModelConstructionErrors) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 3}, "x");
  auto [y, g2] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 3}, "y");
  kg::SymTensor s = scale(x, 1.0);
  expect_error([&] { kg::Model(g, std::vector<kg::SymTensor>{}); }, {"at least one output"});
  expect_error([&] { kg::Model(g, {{"a", s}, {"a", x}}); }, {"output name 'a' is used twice"});
  expect_error([&] { kg::Model(g, {{"foreign", y}}); }, {"output 'foreign'", "not a tensor of this graph"});
  expect_error([&] { kg::Model(g, {{"empty", kg::SymTensor()}}); }, {"output 'empty'"});
  expect_error([&] { kg::Model(nullptr, {{"a", s}}); }, {"null graph"});
}

TEST(Load, DeviceParsing) {
  EXPECT_EQ(kg::Device::parse("cpu").kind, kg::Device::Kind::Cpu);
  EXPECT_EQ(kg::Device::parse("cuda").to_string(), "cuda:0");
  EXPECT_EQ(kg::Device::parse("cuda:3").index, 3);
  const kg::Device a = kg::Device::parse("auto");
  EXPECT_EQ(a.kind, kg::Device::cuda_available() ? kg::Device::Kind::Cuda : kg::Device::Kind::Cpu);
  for (const char* bad : {"gpu", "cuda:", "cuda:x", "cuda:-1", "cuda:1x", "CPU", ""})
    expect_error([&] { kg::Device::parse(bad); }, {"unknown device '" + std::string(bad) + "'"});
}

TEST(Load, ViewKeepsItsSourceBufferAlive) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // a's bytes are read through the view only at the last step; the chain in between must not
  // be placed over them.
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 4, 8}, "x");
  kg::SymTensor a = scale(x, 3.0, "a");
  kg::SymTensor v = a.record_custom(kg::CustomData::make<FlattenView>(), {}, std::nullopt, "v");
  kg::SymTensor xf = x.record_custom(kg::CustomData::make<FlattenView>(), {}, std::nullopt, "xf");
  kg::SymTensor c = xf;
  for (int i = 0; i < 5; ++i) c = scale(c, 0.5);
  kg::SymTensor y = v.record_custom(kg::CustomData::make<AddOp>(), {c}, std::nullopt, "sum");
  kg::LoadedModel m = kg::Model(g, {y}).load(kg::Device::cpu(), {{6, 4, 8}}, poisoned());
  const std::size_t buf = 6 * 32 * sizeof(float);
  EXPECT_EQ(m.memory_plan().buffers, 7);
  EXPECT_EQ(m.memory_plan().arena_bytes, 3 * buf);  // a, and two more at any step
  kg::Tensor in = kg_test::random_tensor(rng, kg::DType::F32, {6, 4, 8});
  kg::Tensor got = m.forward({in})[0];
  kg::Tensor want = kg::Tensor::empty(kg::DType::F64, {6, 32});
  for (std::int64_t i = 0; i < 6 * 32; ++i) want.data<double>()[i] = 3.0 * in.item(i) + in.item(i) / 32.0;
  EXPECT_TRUE(kg_test::all_close(got, want));
}
