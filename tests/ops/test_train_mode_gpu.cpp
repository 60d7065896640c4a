// The train-mode forward kernels of nn.dropout and nn.batch_norm2d (launches packed per run with
// RunInfo) against the CPU's train-mode forward. Under the emulator: an op wrapping the real one
// without its cpu_forward runs its kernels on the CPU executor's emulated path. On a GPU (tests
// named "Gpu", skipped without one): forward, backward and running statistics against the CPU.
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
  std::vector<kg::ParamSpec> parameters() const override { return real_->parameters(); }
  std::optional<kg::Lowered> lower() const override { return real_->lower(); }
  std::string lower_backward_source() const override { return real_->lower_backward_source(); }
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
        const Tensor x = kg_test::random_tensor(rng, dt, shape, -2.0, 3.0);
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

// What a RuntimeOp packs, as text.
struct Recorder final : kg::ArgVisitor {
  std::vector<std::string> args;
  void pointer(kg::DevicePtr p) override { args.push_back("p" + std::to_string(p)); }
  void i32(std::int32_t v) override { args.push_back("i32 " + std::to_string(v)); }
  void i64(std::int64_t v) override { args.push_back("i64 " + std::to_string(v)); }
  void u32(std::uint32_t v) override { args.push_back("u32 " + std::to_string(v)); }
  void f32(float v) override { args.push_back("f32 " + std::to_string(v)); }
  void f64(double v) override { args.push_back("f64 " + std::to_string(v)); }
  void bytes(const void*, std::size_t n) override { args.push_back("bytes " + std::to_string(n)); }
};

std::shared_ptr<kg::RuntimeOp> runtime_of(const Build& build, const kg::Shape& sym) {
  auto [x, g] = SymTensor::input(DType::F32, sym, "x");
  SymTensor y = build(x);
  auto lowered = g->node(y.node()).op->op().lower();
  if (!lowered || !lowered->runtime_op) throw kg::Error("no lowering");
  return lowered->runtime_op;
}

TEST(TrainMode, DropoutPacksTheSameArgumentsInBothModes) {
  auto rt = runtime_of([](const SymTensor& t) { return kg::dropout(t, 0.25); }, {4, 10});
  EXPECT_TRUE(rt->depends_on_run());
  EXPECT_TRUE(rt->supports_train_mode());
  const kg::DeviceTensor x{16, {4, 10}, DType::F32}, y{32, {4, 10}, DType::F32};
  Recorder eval, plain, train;
  rt->pack_args({x}, {}, y, {4, 10}, 10, plain);
  rt->pack_args_for_run(kg::RunInfo{false, 99}, 0, {x}, {}, y, {4, 10}, 10, 0, eval);
  rt->pack_args_for_run(kg::RunInfo{true, 99}, 0, {x}, {}, y, {4, 10}, 10, 0, train);
  const std::vector<std::string> want_train = {"p16",          "p32",  "i64 40", "i64 99", "i64 1073741824",
                                               "f64 1.333333", "i32 1"};
  EXPECT_EQ(train.args, want_train);
  ASSERT_EQ(plain.args.size(), train.args.size());
  EXPECT_EQ(plain.args.back(), "i32 0");  // the copy
  EXPECT_EQ(eval.args.back(), "i32 0");
  EXPECT_EQ(rt->n_launches_for_run(kg::RunInfo{true, 1}, {4, 10}), 1);
}

TEST(TrainMode, BatchNormTrainLaunchTakesABlockPerChannel) {
  auto rt = runtime_of([](const SymTensor& t) { return kg::nn::batch_norm2d(t, "bn"); }, {2, 300, 5, 5});
  EXPECT_TRUE(rt->depends_on_run());
  EXPECT_TRUE(rt->supports_train_mode());
  const std::vector<std::int64_t> shape{2, 300, 5, 5};
  EXPECT_EQ(rt->n_launches_for_run(kg::RunInfo{true, 0}, shape), 2);
  EXPECT_EQ(rt->grid_for_run(kg::RunInfo{true, 0}, 0, shape).x, 300u);
  EXPECT_EQ(rt->grid_for_run(kg::RunInfo{false, 0}, 0, shape).x, 2u);  // a thread per channel
  EXPECT_EQ(rt->grid_for_run(kg::RunInfo{true, 0}, 1, shape).x,
            rt->grid_for_run(kg::RunInfo{false, 0}, 1, shape).x);
  // Both modes pack the same argument list; only `training` differs.
  const kg::DeviceTensor x{16, shape, DType::F32};
  const std::vector<kg::DeviceTensor> params = {{100, {300}, DType::F32},
                                                {200, {300}, DType::F32},
                                                {300, {300}, DType::F32},
                                                {400, {300}, DType::F32},
                                                {500, {}, DType::I64}};
  Recorder eval, train;
  rt->pack_args_for_launch(0, {x}, params, x, shape, 5, 64, eval);
  rt->pack_args_for_run(kg::RunInfo{true, 7}, 0, {x}, params, x, shape, 5, 64, train);
  ASSERT_EQ(eval.args.size(), train.args.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < eval.args.size(); ++i) differ += eval.args[i] != train.args[i];
  EXPECT_EQ(differ, 1u);
  EXPECT_EQ(train.args.at(5), "p500");  // num_batches_tracked
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
