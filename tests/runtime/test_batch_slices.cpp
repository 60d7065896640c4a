// Running a CPU inference model in slices of its batch (LoadOptions::tune times it;
// KG_BATCH_SLICE forces a slice size): the outputs are the whole batch's, and only models whose
// ops compute each sample alone are sliced.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <random>
#include <string>

#include "kg/kg.hpp"
#include "kg/models.hpp"
#include "plan/shape_binding.hpp"
#include "runtime/batch_slices.hpp"
#include "support/test_util.hpp"

namespace {

// Sets an environment variable for the scope.
struct ScopedEnv {
  std::string name;
  ScopedEnv(const std::string& n, const std::string& v) : name(n) { setenv(n.c_str(), v.c_str(), 1); }
  ~ScopedEnv() { unsetenv(name.c_str()); }
};

// conv → BatchNorm → ReLU → max pool → permute → flatten → linear, with a residual add: each
// sample alone.
kg::Model small_cnn() {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, 12, 12}, "x");
  (void)g;
  auto a = kg::relu(kg::nn::batch_norm2d(kg::nn::conv2d(x, 24, 3, {.padding = 1}, "c1"), "bn"), "r1");
  auto b = kg::add(kg::nn::conv2d(a, 24, 3, {.padding = 1}, "c2"), a, "res");
  auto p = kg::max_pool2d(b, 2, 2, 0, 1, false, "pool");
  auto q = kg::permute(p, {0, 2, 3, 1}, "nhwc");
  auto y = kg::nn::linear(kg::flatten(q, 1, -1, "flat"), 10, "fc");
  return kg::Model(y.graph_ptr(), {y}, kg::LoweringMode::Inference);
}

std::map<std::string, kg::Tensor> random_params(const kg::Model& m, std::mt19937_64& rng) {
  std::map<std::string, kg::Tensor> p;
  for (const auto& info : m.parameters()) {
    if (info.dtype != kg::DType::F32) continue;
    const bool var = info.name.ends_with("running_var");
    p[info.name] = kg_test::random_tensor(rng, info.dtype, info.shape, var ? 0.5 : -0.3, var ? 1.5 : 0.3);
  }
  return p;
}

// small_cnn() with random parameters, a random input of batch 8 and the whole batch's output.
struct Reference {
  kg::Model model = small_cnn();
  std::map<std::string, kg::Tensor> params;
  kg::Tensor x, want;
  std::size_t arena_bytes = 0;  // the whole batch's plan
  explicit Reference(std::mt19937_64& rng) {
    params = random_params(model, rng);
    x = kg_test::random_tensor(rng, kg::DType::F32, {8, 3, 12, 12}, -1.0, 1.0);
    kg::LoadedModel whole = model.load(kg::Device::cpu(), {{8, 3, 12, 12}});
    whole.load_state_dict(params, false);
    want = whole.forward({x})[0];
    arena_bytes = whole.memory_plan().arena_bytes;
  }
};

}  // namespace

TEST(BatchSlices, SlicedForwardsMatchTheWholeBatch) {
  const auto seed = kg_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const Reference ref(rng);
  const kg::Model& m = ref.model;
  const auto& params = ref.params;
  const kg::Tensor& x = ref.x;
  const kg::Tensor& want = ref.want;
  for (const char* slice : {"1", "2", "4"}) {
    SCOPED_TRACE(std::string("KG_BATCH_SLICE=") + slice);
    ScopedEnv env("KG_BATCH_SLICE", slice);
    kg::LoadOptions opt;
    opt.poison_buffers = true;
    opt.profile = true;
    kg::LoadedModel sliced = m.load(kg::Device::cpu(), {{8, 3, 12, 12}}, opt);
    // The batch's shapes outside; the slice's plan inside.
    EXPECT_EQ(sliced.input_shapes(), (std::vector<std::vector<std::int64_t>>{{8, 3, 12, 12}}));
    EXPECT_EQ(sliced.output_shapes(), (std::vector<std::vector<std::int64_t>>{{8, 10}}));
    EXPECT_LT(sliced.memory_plan().arena_bytes, ref.arena_bytes);
    sliced.load_state_dict(params, false);
    for (int run = 0; run < 2; ++run) {
      const kg::Tensor got = sliced.forward({x})[0];
      ASSERT_EQ(got.shape(), want.shape());
      EXPECT_TRUE(kg_test::all_written(got));
      EXPECT_TRUE(kg_test::all_close(got, want, 1e-5, 1e-6));
    }
    EXPECT_FALSE(sliced.profile().empty());
    // forward_device on the cpu: host addresses, outputs held by the model.
    const auto dev = sliced.forward_device(
        {kg::DeviceTensor{reinterpret_cast<std::uintptr_t>(x.raw()), x.shape(), x.dtype()}});
    const kg::Tensor got = kg::Tensor::wrap(reinterpret_cast<void*>(static_cast<std::uintptr_t>(dev.at(0).ptr)),
                                            dev.at(0).dtype, dev.at(0).shape);
    EXPECT_TRUE(kg_test::all_close(got, want, 1e-5, 1e-6));
    // A wrong input names the batch's shape.
    kg_test::expect_error(
        [&] { sliced.forward({kg::Tensor::zeros(kg::DType::F32, {2, 3, 12, 12})}); },
        {"was loaded as [8, 3, 12, 12]", "got [2, 3, 12, 12]"});
  }
}

TEST(BatchSlices, TuningKeepsTheResult) {
  const auto seed = kg_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const Reference ref(rng);
  kg::LoadOptions opt;
  opt.tune = true;
  kg::LoadedModel tuned = ref.model.load(kg::Device::cpu(), {{8, 3, 12, 12}}, opt);  // sliced or not: timed
  tuned.load_state_dict(ref.params, false);
  EXPECT_EQ(tuned.input_shapes(), (std::vector<std::vector<std::int64_t>>{{8, 3, 12, 12}}));
  // The tuned load may also run other oneDNN implementations, which round differently.
  EXPECT_TRUE(kg_test::all_close(tuned.forward({ref.x})[0], ref.want, 1e-4, 1e-5));
}

TEST(BatchSlices, OnlyModelsThatKeepSamplesApartAreSliced) {
  auto check = [](const kg::SymTensor& y, std::int64_t batch, bool want) {
    kg::Model m(y.graph_ptr(), {y}, kg::LoweringMode::Inference);
    std::vector<std::int64_t> shape{batch};
    const kg::Node& in = m.graph().node(m.graph().inputs()[0]);
    for (std::size_t k = 1; k < in.shape.rank(); ++k) shape.push_back(in.shape[k].size());
    const kg::plan::BoundShapes bound = kg::plan::bind_shapes(m.graph(), m.live_nodes(), {shape});
    EXPECT_EQ(kg::runtime::per_sample(m.graph(), m.live_nodes(), bound, batch), want) << m.summary();
  };
  auto input = [] {
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 4, 6}, "x");
    (void)g;
    return x;
  };
  check(kg::relu(kg::nn::linear(input(), 5, "fc"), "r"), 4, true);
  check(kg::relu(kg::nn::linear(input(), 5, "fc"), "r"), 1, false);         // nothing to slice
  check(kg::softmax(input(), 0, "over_batch"), 4, false);                // mixes the samples
  check(kg::softmax(input(), -1, "over_features"), 4, false);            // not known to keep them apart
  check(kg::permute(input(), {1, 0, 2}, "batch_second"), 4, false);       // the batch leaves dim 0
  check(kg::flatten(input(), 0, -1, "all"), 4, false);                    // folded into one dim
  check(kg::permute(input(), {0, 2, 1}, "features_swapped"), 4, true);
  check(kg::transpose(input(), 1, 2, "t12"), 4, true);
  check(kg::transpose(input(), 0, 1, "t01"), 4, false);
  check(kg::transpose(input(), -3, -1, "t_first_last"), 4, false);
  // A fused elementwise group keeps the samples apart; a group with several outputs packs them
  // ahead of the batch, so its model is not sliced.
  {
    const kg::SymTensor x = input();
    check(kg::relu(kg::add(kg::sigmoid(kg::nn::linear(x, 5, "fc"), "s"), 1.0, "p"), "r"), 4, true);
  }
  {
    const kg::SymTensor h = kg::nn::linear(input(), 5, "fc");
    const kg::SymTensor s = kg::sigmoid(h, "s");
    const kg::SymTensor a = kg::mul(s, h, "a");
    const kg::SymTensor b = kg::add(s, 1.0, "b");
    check(kg::add(kg::nn::linear(a, 3, "fa"), kg::nn::linear(b, 3, "fb"), "sum"), 4, false);
  }
}

TEST(BatchSlices, ABadSliceSizeIsAnError) {
  const kg::Model m = small_cnn();
  const std::size_t whole = m.load(kg::Device::cpu(), {{8, 3, 12, 12}}).memory_plan().arena_bytes;
  {
    ScopedEnv env("KG_BATCH_SLICE", "two");
    kg_test::expect_error([] { kg::runtime::forced_slice(); }, {"KG_BATCH_SLICE='two'", "positive"});
    kg_test::expect_error([&] { m.load(kg::Device::cpu(), {{8, 3, 12, 12}}); }, {"KG_BATCH_SLICE='two'"});
  }
  {
    ScopedEnv env("KG_BATCH_SLICE", "0");
    kg_test::expect_error([] { kg::runtime::forced_slice(); }, {"KG_BATCH_SLICE='0'"});
  }
  ScopedEnv env("KG_BATCH_SLICE", "3");
  EXPECT_EQ(kg::runtime::forced_slice(), 3);
  // 3 does not divide 8: the whole batch runs, in one plan.
  EXPECT_EQ(m.load(kg::Device::cpu(), {{8, 3, 12, 12}}).memory_plan().arena_bytes, whole);
}
