// The train-mode forward kernels of nn.dropout and nn.batch_norm2d (launches described per run
// from LaunchTensors::training and seed) against the CPU's train-mode forward. Under the
// emulator: an op wrapping the real one without its cpu_forward runs its kernels on the CPU
// executor's emulated path. On a GPU (tests named "Gpu", skipped without one): forward, backward
// and running statistics against the CPU.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kg/kg.hpp"
#include "kg/runtime_op.hpp"
#include "support/test_util.hpp"

namespace {

using kg::DType;
using kg::SymTensor;
using kg::Tensor;
using kg_test::fresh_seed;

// The real op with everything but its CPU implementation: the CPU executor then runs its
// lowered kernels through the emulator, forward launches packed for each run.
class KernelOnly final : public kg::CustomOp {
 public:
  explicit KernelOnly(kg::CustomData real) : real_(std::move(real)) {}
  std::string name() const override { return real_->name(); }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    return real_->infer_output_shape(in);
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override {
    return real_->infer_output_dtype(in);
  }
  std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>& in) const override {
    return real_->parameters(in);
  }
  std::optional<kg::Lowered> lower(const kg::LowerContext& ctx) const override { return real_->lower(ctx); }
  std::string lower_backward_source(const kg::LowerContext& ctx) const override {
    return real_->lower_backward_source(ctx);
  }
  kg::BackwardSaves backward_saves() const override { return real_->backward_saves(); }
  std::string attributes() const override { return real_->attributes(); }

 private:
  kg::CustomData real_;
};

using Build = std::function<SymTensor(const SymTensor&)>;

// x (shape `sym`) → build(x) named "op", lowered for training; with `kernel_only` the recorded op
// is wrapped in KernelOnly.
kg::Model one_op_model(DType dt, const kg::Shape& sym, const Build& build, bool kernel_only) {
  auto [x, g] = SymTensor::input(dt, sym, "x");
  const SymTensor y = build(x);
  if (!kernel_only) return kg::Model(g, std::vector<SymTensor>{y}, kg::LoweringMode::Training);
  auto [x2, g2] = SymTensor::input(dt, sym, "x");
  const SymTensor y2 =
      x2.record_custom(kg::CustomData::make<KernelOnly>(*g->node(y.node()).op), {}, std::nullopt, "op");
  return kg::Model(g2, std::vector<SymTensor>{y2}, kg::LoweringMode::Training);
}

kg::LoadedModel load(const kg::Model& m, kg::Device device, const std::vector<std::int64_t>& shape,
                     std::uint64_t seed) {
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  opt.seed = seed;
  return m.load(device, {shape}, opt);
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// Random BatchNorm parameters for `c` channels under the node name "op".
std::map<std::string, Tensor> bn_params(std::mt19937_64& rng, DType dt, std::int64_t c) {
  Tensor tracked = Tensor::empty(DType::I64, {});
  tracked.data<std::int64_t>()[0] = std::uniform_int_distribution<std::int64_t>(0, 100)(rng);
  return {{"op.weight", kg_test::random_tensor(rng, dt, {c}, 0.5, 2.0)},
          {"op.bias", kg_test::random_tensor(rng, dt, {c})},
          {"op.running_mean", kg_test::random_tensor(rng, dt, {c})},
          {"op.running_var", kg_test::random_tensor(rng, dt, {c}, 0.2, 2.0)},
          {"op.num_batches_tracked", tracked}};
}

// ---- under the emulator ----

TEST(TrainMode, EmulatedBatchNormMatchesTheCpuTrainForward) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // Per-channel counts N*H*W from 6 to 4200: one warp, several warps, several rounds per thread.
  const std::vector<std::vector<std::int64_t>> shapes = {
      {3, 5, 1, 2}, {2, 3, 4, 5}, {8, 4, 17, 19}, {1, 2, 60, 70}};
  for (const auto& shape : shapes) {
    for (DType dt : {DType::F32, DType::F64}) {
      SCOPED_TRACE(kg::sizes_to_string(shape) + " " + std::string(kg::dtype_name(dt)));
      const double momentum = std::uniform_real_distribution<double>(0.05, 0.5)(rng);
      const Build build = [momentum](const SymTensor& t) {
        return kg::nn::batch_norm2d(t, "op", 1e-4, momentum);
      };
      const kg::Shape sym{kg::Dim::named("batch"), shape[1], shape[2], shape[3]};
      kg::Model real = one_op_model(dt, sym, build, false), emulated = one_op_model(dt, sym, build, true);
      kg::LoadedModel cpu = load(real, kg::Device::cpu(), shape, 1),
                      emu = load(emulated, kg::Device::cpu(), shape, 1);
      const auto params = bn_params(rng, dt, shape[1]);
      cpu.load_state_dict(params);
      emu.load_state_dict(params);
      const double rtol = dt == DType::F32 ? 1e-5 : 1e-12, atol = dt == DType::F32 ? 1e-5 : 1e-12;
      for (int run = 0; run < 2; ++run) {
        SCOPED_TRACE("run " + std::to_string(run));
        // The second run's values lie far from zero: the kernels' one-pass sums, shifted by a
        // value of each range, must not cancel.
        const Tensor x = run == 0 ? kg_test::random_tensor(rng, dt, shape, -2.0, 3.0)
                                  : kg_test::random_tensor(rng, dt, shape, 18.0, 23.0);
        for (auto* m : {&cpu, &emu}) m->set_training(true);
        const Tensor want = cpu.forward({x})[0], got = emu.forward({x})[0];
        ASSERT_TRUE(kg_test::all_written(got));
        EXPECT_TRUE(kg_test::all_close(got, want, rtol, atol));
        const auto sc = cpu.state_dict(), se = emu.state_dict();
        for (const char* name : {"op.running_mean", "op.running_var"})
          EXPECT_TRUE(kg_test::all_close(se.at(name), sc.at(name), rtol, atol)) << name;
        EXPECT_EQ(se.at("op.num_batches_tracked").item(0), sc.at("op.num_batches_tracked").item(0));
        EXPECT_EQ(sc.at("op.num_batches_tracked").item(0),
                  params.at("op.num_batches_tracked").item(0) + run + 1);
        // The weight and bias are left alone.
        EXPECT_TRUE(same_bytes(se.at("op.weight"), params.at("op.weight")));
        EXPECT_TRUE(same_bytes(se.at("op.bias"), params.at("op.bias")));
        // Inference afterwards normalises with the updated running statistics, statistics unchanged.
        for (auto* m : {&cpu, &emu}) m->set_training(false);
        EXPECT_TRUE(kg_test::all_close(emu.forward({x})[0], cpu.forward({x})[0], rtol, atol));
        EXPECT_TRUE(same_bytes(emu.state_dict().at("op.running_var"), se.at("op.running_var")));
        EXPECT_EQ(emu.state_dict().at("op.num_batches_tracked").item(0),
                  se.at("op.num_batches_tracked").item(0));
      }
    }
  }
}

TEST(TrainMode, EmulatedBatchNormNeedsMoreThanOneValuePerChannel) {
  const Build build = [](const SymTensor& t) { return kg::nn::batch_norm2d(t, "op"); };
  const kg::Shape sym{kg::Dim::named("batch"), 3, 1, 1};
  kg::Model emulated = one_op_model(DType::F32, sym, build, true);
  kg::LoadedModel m = load(emulated, kg::Device::cpu(), {1, 3, 1, 1}, 0);
  std::mt19937_64 rng(2);
  const Tensor x = kg_test::random_tensor(rng, DType::F32, {1, 3, 1, 1});
  m.set_training(true);
  kg_test::expect_error([&] { m.forward({x}); },
                        {"nn.batch_norm2d", "op", "more than 1 value per channel", "[1, 3, 1, 1]"});
  // Inference takes a single value per channel.
  m.set_training(false);
  EXPECT_TRUE(kg_test::all_written(m.forward({x})[0]));
}

TEST(TrainMode, EmulatedDropoutDrawsTheCpuMask) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& shape : std::vector<std::vector<std::int64_t>>{{1, 7}, {3, 1000}, {64, 257}}) {
    for (double p : {0.0, 0.1, 0.5, 0.9}) {
      for (DType dt : {DType::F32, DType::F64}) {
        SCOPED_TRACE(kg::sizes_to_string(shape) + " p " + std::to_string(p) + " " +
                     std::string(kg::dtype_name(dt)));
        const Build build = [p](const SymTensor& t) { return kg::dropout(t, p, "op"); };
        const kg::Shape sym{kg::Dim::named("batch"), shape[1]};
        kg::Model real = one_op_model(dt, sym, build, false), emulated = one_op_model(dt, sym, build, true);
        const std::uint64_t load_seed = rng();
        kg::LoadedModel cpu = load(real, kg::Device::cpu(), shape, load_seed);
        kg::LoadedModel emu = load(emulated, kg::Device::cpu(), shape, load_seed);
        Tensor previous;
        for (int run = 0; run < 2; ++run) {
          const Tensor x = kg_test::random_tensor(rng, dt, shape, 0.5, 1.5);
          for (auto* m : {&cpu, &emu}) m->set_training(true);
          const Tensor want = cpu.forward({x})[0], got = emu.forward({x})[0];
          ASSERT_TRUE(kg_test::all_written(got));
          EXPECT_TRUE(same_bytes(got, want)) << "run " << run << ": another mask than the CPU's";
          if (p == 0.0) {
            EXPECT_TRUE(same_bytes(got, x));
          }
          // Inference (both models, keeping their run counts and so their seeds equal): the copy.
          for (auto* m : {&cpu, &emu}) m->set_training(false);
          EXPECT_TRUE(same_bytes(emu.forward({x})[0], x));
          EXPECT_TRUE(same_bytes(cpu.forward({x})[0], x));
        }
      }
    }
  }
}

// A kernel argument as text: "p<address>", "i64 <value>", ..., "bytes <size>".
std::string arg_text(const kg::KernelArg& a) {
  auto get = [&](auto v) {
    std::memcpy(&v, a.data().data(), sizeof v);
    return std::to_string(v);
  };
  switch (a.kind()) {
    case kg::KernelArg::Kind::Pointer:
      return "p" + get(kg::DevicePtr{});
    case kg::KernelArg::Kind::I32:
      return "i32 " + get(std::int32_t{});
    case kg::KernelArg::Kind::I64:
      return "i64 " + get(std::int64_t{});
    case kg::KernelArg::Kind::U32:
      return "u32 " + get(std::uint32_t{});
    case kg::KernelArg::Kind::F32:
      return "f32 " + get(float{});
    case kg::KernelArg::Kind::F64:
      return "f64 " + get(double{});
    case kg::KernelArg::Kind::Bytes:
      break;
  }
  return "bytes " + std::to_string(a.data().size());
}

// A launch's arguments, as text.
std::vector<std::string> as_text(const kg::KernelArgs& args) {
  std::vector<std::string> out;
  for (const kg::KernelArg& a : args.args()) out.push_back(arg_text(a));
  return out;
}

std::shared_ptr<kg::RuntimeOp> runtime_of(const Build& build, const kg::Shape& sym) {
  auto [x, g] = SymTensor::input(DType::F32, sym, "x");
  SymTensor y = build(x);
  kg::LowerContext ctx;
  ctx.node = y.name();
  ctx.input_dtypes = {DType::F32};
  ctx.output_dtype = y.dtype();
  ctx.input_shapes = {sym};
  ctx.output_shape = y.shape();
  ctx.mode = kg::LoweringMode::Training;
  auto lowered = g->node(y.node()).op->op().lower(ctx);
  if (!lowered || !lowered->runtime_op) throw kg::Error("no lowering");
  return lowered->runtime_op;
}

// The tensors of a run in the given mode.
kg::LaunchTensors run_tensors(kg::LaunchTensors t, bool training, std::uint64_t seed) {
  t.training = training;
  t.seed = seed;
  return t;
}

TEST(TrainMode, DropoutPacksTheSameArgumentsInBothModes) {
  auto rt = runtime_of([](const SymTensor& t) { return kg::dropout(t, 0.25); }, {4, 10});
  EXPECT_TRUE(rt->depends_on_run());
  EXPECT_TRUE(rt->supports_train_mode());
  kg::LaunchTensors t;
  t.inputs = {{16, {4, 10}, DType::F32}};
  t.output = {32, {4, 10}, DType::F32};
  const auto eval = rt->launches(run_tensors(t, false, 99)), train = rt->launches(run_tensors(t, true, 99));
  ASSERT_EQ(eval.size(), 1u);
  ASSERT_EQ(train.size(), 1u);
  const std::vector<std::string> want_train = {"p16",          "p32",  "i64 40", "i64 99", "i64 1073741824",
                                               "f64 1.333333", "i32 1"};
  EXPECT_EQ(as_text(train[0].args), want_train);
  const auto eval_args = as_text(eval[0].args);
  ASSERT_EQ(eval_args.size(), want_train.size());
  EXPECT_EQ(eval_args.back(), "i32 0");  // the copy
}

TEST(TrainMode, BatchNormTrainLaunchesTakeABlockPerChannelRange) {
  for (const std::vector<std::int64_t>& shape :
       std::vector<std::vector<std::int64_t>>{{2, 300, 5, 5}, {2, 300, 40, 40}, {64, 4, 56, 56}}) {
    SCOPED_TRACE(kg::sizes_to_string(shape));
    auto rt = runtime_of([](const SymTensor& t) { return kg::nn::batch_norm2d(t, "bn"); }, kg::Shape::of(shape));
    EXPECT_TRUE(rt->depends_on_run());
    EXPECT_TRUE(rt->supports_train_mode());
    const std::int64_t c = shape[1];
    kg::LaunchTensors t;
    t.inputs = {{16, shape, DType::F32}};
    t.params = {{100, {c}, DType::F32}, {200, {c}, DType::F32}, {300, {c}, DType::F32},
                {400, {c}, DType::F32}, {500, {}, DType::I64}};
    t.output = {16, shape, DType::F32};
    t.scratch = 64;
    const auto eval = rt->launches(run_tensors(t, false, 0)), train = rt->launches(run_tensors(t, true, 7));
    ASSERT_EQ(train.size(), 3u);  // partial moments, scale and shift, y
    ASSERT_EQ(eval.size(), 2u);   // scale and shift, y
    // Ranges of at least 1024 values, up to about 1024 blocks in all: 50 values per channel give
    // one range; 3200 give 3; 200704 give 196 (1024 / 4 channels = 256, capped by 200704 / 1024).
    const unsigned ranges = shape[2] == 5 ? 1u : shape[2] == 40 ? 3u : 196u;
    EXPECT_EQ(train[0].grid.x, static_cast<unsigned>(c) * ranges);
    EXPECT_EQ(train[1].grid.x, static_cast<unsigned>((c + 255) / 256));  // a thread per channel
    EXPECT_EQ(eval[0].grid.x, train[1].grid.x);
    EXPECT_EQ(train[2].grid.x, eval[1].grid.x);
    // y: 4 rounds of 16-byte packs per thread where a plane holds whole packs, else of values.
    const std::int64_t numel = shape[0] * c * shape[2] * shape[3], per_thread = shape[2] == 5 ? 4 : 16;
    EXPECT_EQ(train[2].grid.x, static_cast<unsigned>((numel / per_thread + 255) / 256));
    // Both modes pack the same argument list for the same phase; only `training` differs.
    const auto eval_args = as_text(eval[0].args), train_args = as_text(train[1].args);
    ASSERT_EQ(eval_args.size(), train_args.size());
    std::size_t differ = 0;
    for (std::size_t i = 0; i < eval_args.size(); ++i) differ += eval_args[i] != train_args[i];
    EXPECT_EQ(differ, 1u);
    EXPECT_EQ(train_args.at(5), "p500");  // num_batches_tracked
    EXPECT_EQ(train_args.at(11), "i64 " + std::to_string(ranges));
  }
}

// ---- on a GPU ----

#define KG_REQUIRE_GPU()                                         \
  do {                                                           \
    if (!kg::Device::cuda_available()) GTEST_SKIP() << "no GPU"; \
  } while (0)

void expect_close(const std::map<std::string, Tensor>& gpu, const std::map<std::string, Tensor>& cpu,
                  const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  for (const auto& [name, t] : cpu) {
    ASSERT_TRUE(gpu.count(name)) << what << ": " << name;
    EXPECT_TRUE(kg_test::all_close(gpu.at(name), t, 1e-4, 1e-6)) << what << ": " << name;
  }
}

// Runs `model` (inputs x, target; outputs "y" and "loss") in train mode on the CPU and the GPU
// with the same parameters, `runs` times forward + backward, comparing outputs, gradients and the
// state (running statistics) after each.
void compare_training(const kg::Model& model, const std::vector<std::int64_t>& x_shape,
                      const std::vector<std::int64_t>& y_shape, std::mt19937_64& rng, int runs) {
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  opt.seed = rng();
  opt.loss = "loss";
  kg::LoadedModel cpu = model.load(kg::Device::cpu(), {x_shape, y_shape}, opt);
  kg::LoadedModel gpu = model.load(kg::Device::cuda(), {x_shape, y_shape}, opt);
  gpu.load_state_dict(cpu.state_dict());
  for (int run = 0; run < runs; ++run) {
    SCOPED_TRACE("run " + std::to_string(run));
    const Tensor x = kg_test::random_tensor(rng, DType::F32, x_shape, -2.0, 2.0);
    const Tensor target = kg_test::random_tensor(rng, DType::F32, y_shape);
    std::vector<Tensor> outs[2];
    int k = 0;
    for (auto* m : {&cpu, &gpu}) {
      m->set_training(true);
      m->zero_grad();
      outs[k++] = m->forward({x, target});
      m->backward();
    }
    ASSERT_EQ(outs[0].size(), outs[1].size());
    for (std::size_t i = 0; i < outs[0].size(); ++i)
      EXPECT_TRUE(kg_test::all_close(outs[1][i], outs[0][i], 1e-4, 1e-6)) << "output " << i;
    expect_close(gpu.gradients(), cpu.gradients(), "gradients");
    expect_close(gpu.state_dict(), cpu.state_dict(), "state");
  }
}

TEST(TrainModeGpu, BatchNormMatchesTheCpu) {
  KG_REQUIRE_GPU();
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& shape :
       std::vector<std::vector<std::int64_t>>{{4, 3, 5, 6}, {16, 8, 32, 32}, {2, 2, 90, 100}}) {
    SCOPED_TRACE(kg::sizes_to_string(shape));
    auto [x, g] = SymTensor::input(DType::F32, {kg::Dim::named("batch"), shape[1], shape[2], shape[3]}, "x");
    SymTensor target =
        g->input(DType::F32, {kg::Dim::named("batch"), shape[1], shape[2], shape[3]}, "target");
    SymTensor y = kg::nn::batch_norm2d(x, "bn", 1e-5, 0.2);
    SymTensor loss = kg::mse_loss(y, target, "loss");
    kg::Model model(g, {{"y", y}, {"loss", loss}}, kg::LoweringMode::Training);
    compare_training(model, shape, shape, rng, 3);
  }
}

TEST(TrainModeGpu, DropoutMasksMatchTheCpu) {
  KG_REQUIRE_GPU();
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (double p : {0.1, 0.5}) {
    SCOPED_TRACE("p " + std::to_string(p));
    auto [x, g] = SymTensor::input(DType::F32, {kg::Dim::named("batch"), 40}, "x");
    SymTensor target = g->input(DType::F32, {kg::Dim::named("batch"), 5}, "target");
    SymTensor h = kg::dropout(kg::nn::linear(x, 300, "fc1"), p, "drop");
    SymTensor y = kg::nn::linear(h, 5, "fc2");
    SymTensor loss = kg::mse_loss(y, target, "loss");
    kg::Model model(g, {{"y", y}, {"loss", loss}}, kg::LoweringMode::Training);
    compare_training(model, {64, 40}, {64, 5}, rng, 3);
  }
}

}  // namespace
