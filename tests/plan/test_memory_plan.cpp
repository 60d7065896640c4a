// The activation memory planner: placement properties on random requests, reuse along a
// chain, and the MemoryPlan a loaded model reports.
#include <algorithm>

#include "plan/memory_plan.hpp"
#include "support/test_util.hpp"

using kg::plan::BufferRequest;
using kg::plan::plan_buffers;
using kg_test::fresh_seed;

namespace {

std::size_t round_up(std::size_t v, std::size_t a) { return (v + a - 1) / a * a; }

// Checks every property a placement must have; returns the first violation.
::testing::AssertionResult valid_placement(const std::vector<BufferRequest>& req,
                                           const kg::plan::Placement& p, std::size_t alignment) {
  if (p.offsets.size() != req.size())
    return ::testing::AssertionFailure() << p.offsets.size() << " offsets for " << req.size() << " requests";
  std::size_t unshared = 0;
  int last_step = 0;
  for (const auto& r : req) {
    unshared += round_up(r.bytes, alignment);
    last_step = std::max(last_step, r.last);
  }
  if (p.unshared_bytes != unshared)
    return ::testing::AssertionFailure()
           << "unshared_bytes " << p.unshared_bytes << ", expected " << unshared;
  if (p.arena_bytes > unshared)
    return ::testing::AssertionFailure() << "arena " << p.arena_bytes << " exceeds the unshared " << unshared;
  for (std::size_t i = 0; i < req.size(); ++i) {
    if (p.offsets[i] % alignment != 0)
      return ::testing::AssertionFailure()
             << "buffer " << i << " offset " << p.offsets[i] << " not aligned to " << alignment;
    if (req[i].bytes > 0 && p.offsets[i] + req[i].bytes > p.arena_bytes)
      return ::testing::AssertionFailure() << "buffer " << i << " ends at " << p.offsets[i] + req[i].bytes
                                           << " beyond the arena " << p.arena_bytes;
  }
  for (std::size_t i = 0; i < req.size(); ++i)
    for (std::size_t j = i + 1; j < req.size(); ++j) {
      const auto &a = req[i], &b = req[j];
      if (a.bytes == 0 || b.bytes == 0) continue;
      if (a.last < b.first || b.last < a.first) continue;  // never live together
      const std::size_t a0 = p.offsets[i], a1 = a0 + a.bytes, b0 = p.offsets[j], b1 = b0 + b.bytes;
      if (a0 < b1 && b0 < a1)
        return ::testing::AssertionFailure()
               << "buffers " << i << " [" << a0 << ", " << a1 << ") steps " << a.first << ".." << a.last
               << " and " << j << " [" << b0 << ", " << b1 << ") steps " << b.first << ".." << b.last
               << " overlap";
    }
  // No placement can beat the bytes live at the busiest step.
  for (int s = 0; s <= last_step; ++s) {
    std::size_t live = 0;
    for (const auto& r : req)
      if (r.first <= s && s <= r.last) live += r.bytes;
    if (p.arena_bytes < live)
      return ::testing::AssertionFailure()
             << "arena " << p.arena_bytes << " below the " << live << " bytes live at step " << s;
  }
  return ::testing::AssertionSuccess();
}

}  // namespace

TEST(MemoryPlan, RandomRequestsNeverOverlap) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::size_t alignments[] = {1, 8, 64, 256};
  for (int trial = 0; trial < 400; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const int n = std::uniform_int_distribution<int>(0, 60)(rng);
    const int steps = std::uniform_int_distribution<int>(1, 40)(rng);
    std::vector<BufferRequest> req;
    for (int i = 0; i < n; ++i) {
      BufferRequest r;
      // Mostly distinct sizes, some repeats and zeros, now and then a big one.
      const int kind = std::uniform_int_distribution<int>(0, 9)(rng);
      r.bytes = kind == 0   ? 0
                : kind == 1 ? 4096
                : kind == 2 ? std::uniform_int_distribution<std::size_t>(1, 1 << 20)(rng)
                            : std::uniform_int_distribution<std::size_t>(1, 5000)(rng);
      r.first = std::uniform_int_distribution<int>(0, steps - 1)(rng);
      r.last = std::uniform_int_distribution<int>(r.first, std::min(steps, r.first + 8))(rng);
      req.push_back(r);
    }
    const std::size_t align = alignments[trial % 4];
    auto p = plan_buffers(req, align);
    ASSERT_TRUE(valid_placement(req, p, align));
  }
}

TEST(MemoryPlan, ChainReusesMemory) {
  // Layer i reads buffer i-1 and writes buffer i: only two are ever live together.
  for (std::size_t bytes : {std::size_t{1}, std::size_t{64}, std::size_t{1000}, std::size_t{1} << 16}) {
    SCOPED_TRACE("bytes " + std::to_string(bytes));
    const int n = 50;
    std::vector<BufferRequest> req;
    for (int i = 0; i < n; ++i) req.push_back({bytes, i, i + 1});
    auto p = plan_buffers(req);
    ASSERT_TRUE(valid_placement(req, p, 64));
    const std::size_t one = round_up(bytes, 64);
    EXPECT_EQ(p.unshared_bytes, n * one);
    EXPECT_EQ(p.arena_bytes, 2 * one);
    for (int i = 2; i < n; ++i)
      EXPECT_EQ(p.offsets[static_cast<std::size_t>(i)], p.offsets[static_cast<std::size_t>(i - 2)]);
  }
  // Growing sizes: each buffer may still reuse what two layers back freed.
  std::vector<BufferRequest> grow;
  for (int i = 0; i < 30; ++i) grow.push_back({static_cast<std::size_t>(100 + 64 * i), i, i + 1});
  auto p = plan_buffers(grow, 64);
  ASSERT_TRUE(valid_placement(grow, p, 64));
  EXPECT_LT(p.arena_bytes * 5, p.unshared_bytes);
}

TEST(MemoryPlan, EdgeCases) {
  auto empty = plan_buffers({});
  EXPECT_EQ(empty.arena_bytes, 0u);
  EXPECT_EQ(empty.unshared_bytes, 0u);
  EXPECT_TRUE(empty.offsets.empty());
  // Zero-byte buffers take no room.
  auto zeros = plan_buffers({{0, 0, 5}, {0, 0, 5}});
  EXPECT_EQ(zeros.arena_bytes, 0u);
  // All live at once: the arena is the sum, each aligned.
  std::vector<BufferRequest> all{{10, 0, 3}, {100, 1, 2}, {1, 2, 3}};
  auto p = plan_buffers(all, 64);
  ASSERT_TRUE(valid_placement(all, p, 64));
  EXPECT_EQ(p.arena_bytes, 64u + 128u + 64u);
  // Disjoint lifetimes: all share offset 0.
  std::vector<BufferRequest> apart{{300, 0, 0}, {200, 1, 1}, {100, 2, 2}};
  auto q = plan_buffers(apart, 1);
  EXPECT_EQ(q.offsets, (std::vector<std::size_t>{0, 0, 0}));
  EXPECT_EQ(q.arena_bytes, 300u);
  EXPECT_EQ(q.unshared_bytes, 600u);
  // A gap between two live buffers is reused when the new one fits.
  std::vector<BufferRequest> gap{{64, 0, 2}, {64, 0, 0}, {64, 0, 2}, {64, 1, 2}};
  auto r = plan_buffers(gap, 64);
  ASSERT_TRUE(valid_placement(gap, r, 64));
  EXPECT_EQ(r.arena_bytes, 192u);
  EXPECT_EQ(r.offsets[3], r.offsets[1]);
}

namespace {
// y = x (elementwise copy), to build long chains.
class CopyOp final : public kg::CustomOp {
 public:
  std::string name() const override { return "test.copy"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  void cpu_forward(kg::CpuContext& ctx) const override {
    const float* x = ctx.inputs[0].data<float>();
    float* y = ctx.output.data<float>();
    for (std::int64_t i = 0; i < ctx.output.numel(); ++i) y[i] = x[i] + 1.0f;
  }
};
}  // namespace

TEST(MemoryPlan, LoadedModelReportsItsPlan) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int layers = 20;
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 256}, "x");
  kg::SymTensor t = x;
  for (int i = 0; i < layers; ++i) t = t.record_custom(kg::CustomData::make<CopyOp>());
  kg::SymTensor y = kg::nn::linear(t, 10, "head");
  kg::Model model(g, {y});
  for (std::int64_t batch : {1, 8, 33}) {
    SCOPED_TRACE("batch " + std::to_string(batch));
    kg::LoadOptions opt;
    opt.poison_buffers = true;
    kg::LoadedModel m = model.load(kg::Device::cpu(), {{batch, 256}}, opt);
    const kg::MemoryPlan& mp = m.memory_plan();
    const std::size_t buf = round_up(static_cast<std::size_t>(batch) * 256 * 4, 64);
    const std::size_t out = static_cast<std::size_t>(batch) * 10 * 4;
    EXPECT_EQ(mp.buffers, layers + 1);
    EXPECT_EQ(mp.unshared_bytes, layers * buf + round_up(out, 64));
    EXPECT_EQ(mp.arena_bytes, 2 * buf);  // the output fits where an early layer was
    EXPECT_LT(mp.arena_bytes * 5, mp.unshared_bytes);
    EXPECT_EQ(mp.param_bytes, (10u * 256u + 10u) * 4u);
    EXPECT_GE(mp.peak_bytes, mp.arena_bytes + mp.param_bytes);
    EXPECT_EQ(mp.peak_bytes, mp.arena_bytes + mp.param_bytes + out);
    const std::string s = mp.to_string();
    EXPECT_NE(s.find(std::to_string(layers + 1) + " buffers"), std::string::npos) << s;
    // Sharing memory does not change results.
    kg::Tensor in = kg_test::random_tensor(rng, kg::DType::F32, {batch, 256});
    kg::Tensor w = m.parameter("head.weight"), b = m.parameter("head.bias");
    kg::Tensor got = m.forward({in})[0];
    kg::Tensor want = kg::Tensor::empty(kg::DType::F64, {batch, 10});
    for (std::int64_t r = 0; r < batch; ++r)
      for (std::int64_t j = 0; j < 10; ++j) {
        double s2 = b.item(j);
        for (std::int64_t k = 0; k < 256; ++k)
          s2 += static_cast<double>(static_cast<float>(in.item(r * 256 + k)) + static_cast<float>(layers)) *
                w.item(j * 256 + k);
        want.data<double>()[r * 10 + j] = s2;
      }
    EXPECT_TRUE(kg_test::all_close(got, want, 1e-4, 1e-4));
  }
}
