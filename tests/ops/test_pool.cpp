#include <cmath>
#include <limits>
#include <sstream>

#include "backend/emu/executor.hpp"
#include "compile/compiler.hpp"
#include "lower/dry_run.hpp"
#include "support/gpu_util.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

struct PoolCfg {
  bool max;  // max_pool2d, else avg_pool2d
  kg::Size2 kernel, stride = 0, padding = 0, dilation = 1;
  bool ceil_mode = false;
  bool count_include_pad = true;

  std::string text() const {
    std::ostringstream os;
    os << (max ? "max" : "avg") << " k=" << kernel.h << "x" << kernel.w << " s=" << stride.h << "x"
       << stride.w << " p=" << padding.h << "x" << padding.w << " d=" << dilation.h << "x" << dilation.w
       << " ceil=" << ceil_mode << " count_include_pad=" << count_include_pad;
    return os.str();
  }
  kg::SymTensor record(const kg::SymTensor& x) const {
    return max ? kg::max_pool2d(x, kernel, stride, padding, dilation, ceil_mode, "pool")
               : kg::avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad, "pool");
  }
};

// Output size written out from PyTorch's documentation (not through the library's helper).
std::int64_t pool_out(std::int64_t in, std::int64_t k, std::int64_t s, std::int64_t p, std::int64_t d,
                      bool ceil) {
  const double span = static_cast<double>(in + 2 * p - d * (k - 1) - 1) / static_cast<double>(s);
  auto out = static_cast<std::int64_t>(ceil ? std::ceil(span) : std::floor(span)) + 1;
  if (ceil && (out - 1) * s >= in + p) --out;
  return out;
}

// Max or average over each window, in double, element by element.
kg::Tensor naive_pool(const kg::Tensor& x, const PoolCfg& cfg) {
  const std::int64_t n = x.dim(0), c = x.dim(1), h = x.dim(2), w = x.dim(3);
  const kg::Size2 s(cfg.stride.h ? cfg.stride.h : cfg.kernel.h, cfg.stride.w ? cfg.stride.w : cfg.kernel.w);
  const std::int64_t ho = pool_out(h, cfg.kernel.h, s.h, cfg.padding.h, cfg.dilation.h, cfg.ceil_mode);
  const std::int64_t wo = pool_out(w, cfg.kernel.w, s.w, cfg.padding.w, cfg.dilation.w, cfg.ceil_mode);
  kg::Tensor y = kg::Tensor::empty(kg::DType::F64, {n, c, ho, wo});
  for (std::int64_t pl = 0; pl < n * c; ++pl)
    for (std::int64_t i = 0; i < ho; ++i)
      for (std::int64_t j = 0; j < wo; ++j) {
        double best = -std::numeric_limits<double>::infinity(), sum = 0;
        std::int64_t inside = 0, padded = 0;
        for (std::int64_t ky = 0; ky < cfg.kernel.h; ++ky)
          for (std::int64_t kx = 0; kx < cfg.kernel.w; ++kx) {
            const std::int64_t iy = i * s.h - cfg.padding.h + ky * cfg.dilation.h;
            const std::int64_t ix = j * s.w - cfg.padding.w + kx * cfg.dilation.w;
            // A tap counts toward count_include_pad's divisor while inside the padded input.
            if (iy < h + cfg.padding.h && ix < w + cfg.padding.w) ++padded;
            if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;
            const double v = x.item((pl * h + iy) * w + ix);
            best = std::max(best, v);
            sum += v;
            ++inside;
          }
        y.data<double>()[(pl * ho + i) * wo + j] =
            cfg.max ? best : sum / static_cast<double>(cfg.count_include_pad ? padded : inside);
      }
  return y;
}

// Records `build` on an input declared [batch, C, H, W] (H and W dynamic when `dynamic_hw`),
// loads it for x's shape with poisoned buffers and runs it.
kg::Tensor run_declared(const kg::Tensor& x, bool dynamic_hw,
                        const std::function<kg::SymTensor(const kg::SymTensor&)>& build) {
  auto g = kg::Graph::create();
  kg::Shape s{kg::Dim::named("batch"), x.dim(1), dynamic_hw ? kg::Dim(kg::dynamic) : kg::Dim(x.dim(2)),
              dynamic_hw ? kg::Dim(kg::dynamic) : kg::Dim(x.dim(3))};
  kg::Model model(g, {build(g->input(x.dtype(), s, "x"))});
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  kg::Tensor out = model.load(kg::Device::cpu(), {x.shape()}, opt).forward({x})[0];
  EXPECT_TRUE(kg_test::all_written(out)) << "the op left output elements unwritten";
  return out;
}

std::vector<std::int64_t> pair_of(const std::string& s) {
  const auto comma = s.find(',');
  return {std::stoll(s.substr(0, comma)), std::stoll(s.substr(comma + 1))};
}

}  // namespace

TEST(Pool2d, ShapeInference) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 64, 112, 112});
  auto m = kg::max_pool2d(x, 3, 2, 1, 1, false, "maxpool");
  EXPECT_EQ(m.shape().to_string(), "[batch, 64, 56, 56]");
  EXPECT_EQ(g->node(m.node()).op->name(), "nn.max_pool2d");
  EXPECT_EQ(g->node(m.node()).op->op().attributes(), "k=3 s=2 p=1");
  EXPECT_TRUE(g->node(m.node()).params.empty());
  // Stride defaults to the kernel.
  EXPECT_EQ(kg::max_pool2d(x, 2).shape().to_string(), "[batch, 64, 56, 56]");
  EXPECT_EQ(kg::avg_pool2d(x, {3, 2}).shape().to_string(), "[batch, 64, 37, 56]");
  // ceil_mode: 8 → (8 - 3)/2 = 2.5 → 3 + 1 = 4 windows; the last one must start inside the input.
  auto [s, g2] = kg::SymTensor::input(kg::DType::F64, {2, 3, 8, 7});
  EXPECT_EQ(kg::max_pool2d(s, 3, 2, 0, 1, true).shape().to_string(), "[2, 3, 4, 3]");
  EXPECT_EQ(kg::max_pool2d(s, 3, 2, 0, 1, false).shape().to_string(), "[2, 3, 3, 3]");
  // 7 + 2 - 2 = 7 → ceil(7/2) + 1 = 5, but window 5 would start at 8 >= 7 + 1: dropped.
  EXPECT_EQ(kg::avg_pool2d(s, 2, 2, 1, true).shape().to_string(), "[2, 3, 5, 4]");
  EXPECT_EQ(kg::max_pool2d(s, 3, 1, 1, 2).shape().to_string(), "[2, 3, 6, 5]");
  // Dynamic H and W propagate; global pooling makes them 1.
  auto [d, g3] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, kg::dynamic, kg::dynamic, 16});
  EXPECT_EQ(kg::max_pool2d(d, 2).shape().to_string(), "[?, ?, ?, 8]");
  EXPECT_EQ(kg::global_avg_pool(d).shape().to_string(), "[?, ?, 1, 1]");
  EXPECT_EQ(kg::upsample_nearest2d(d, {2, 3}).shape().to_string(), "[?, ?, ?, 48]");
  EXPECT_EQ(kg::global_avg_pool(x, "gap").shape().to_string(), "[batch, 64, 1, 1]");
  EXPECT_EQ(kg::upsample_nearest2d(x, 2).shape().to_string(), "[batch, 64, 224, 224]");
}

TEST(Pool2d, RejectsBadInputs) {
  auto [flat, g0] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 784});
  kg_test::expect_error([&] { kg::max_pool2d(flat, 2, 0, 0, 1, false, "p"); },
                        {"[nn.max_pool2d @ p]", "expects a 4-D input [N, C, H, W], got 2-D [?, 784]"});
  kg_test::expect_error([&] { kg::avg_pool2d(flat, 2, 0, 0, false, true, "p"); },
                        {"[nn.avg_pool2d @ p]", "expects a 4-D input", "[?, 784]"});
  kg_test::expect_error([&] { kg::global_avg_pool(flat, "p"); },
                        {"[nn.global_avg_pool @ p]", "expects a 4-D input", "[?, 784]"});
  kg_test::expect_error([&] { kg::upsample_nearest2d(flat, 2, "p"); },
                        {"[nn.upsample_nearest2d @ p]", "expects a 4-D input", "[?, 784]"});

  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 3, 6, 6});
  kg_test::expect_error(
      [&] { kg::max_pool2d(x, 7, 0, 0, 1, false, "p"); },
      {"[nn.max_pool2d @ p]", "input height of 6 with padding 0 is smaller than the window 7"});
  kg_test::expect_error(
      [&] {
        kg::max_pool2d(x, 3, 1, 0, {1, 3}, false, "p");
      },
      {"[nn.max_pool2d @ p]", "input width of 6 with padding 0", "window 7 (kernel 3, dilation 3)"});
  kg_test::expect_error([&] { kg::max_pool2d(x, 3, 1, 2, 1, false, "p"); },
                        {"[nn.max_pool2d @ p]", "padding 2x2 must be at most half the kernel size 3x3"});
  kg_test::expect_error(
      [&] {
        kg::avg_pool2d(x, {2, 4}, 1, {1, 3}, false, true, "p");
      },
      {"[nn.avg_pool2d @ p]", "padding 1x3 must be at most half the kernel size 2x4"});
  kg_test::expect_error(
      [&] {
        kg::max_pool2d(x, 3, {1, -1}, 0, 1, false, "p");
      },
      {"[nn.max_pool2d @ p]", "stride must be positive, got 1x-1"});
  kg_test::expect_error(
      [&] {
        kg::max_pool2d(x, {0, 2}, 1, 0, 1, false, "p");
      },
      {"[nn.max_pool2d @ p]", "kernel size must be positive, got 0x2"});
  kg_test::expect_error([&] { kg::max_pool2d(x, 3, 1, 0, 0, false, "p"); },
                        {"[nn.max_pool2d @ p]", "dilation must be positive, got 0x0"});
  kg_test::expect_error([&] { kg::avg_pool2d(x, 3, 1, -1, false, true, "p"); },
                        {"[nn.avg_pool2d @ p]", "padding must be non-negative, got -1x-1"});
  kg_test::expect_error(
      [&] {
        kg::upsample_nearest2d(x, {2, 0}, "p");
      },
      {"[nn.upsample_nearest2d @ p]", "scale factors must be positive integers, got 2x0"});
  auto [e, g1] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 3, 0, 6});
  kg_test::expect_error([&] { kg::global_avg_pool(e, "p"); },
                        {"[nn.global_avg_pool @ p]", "non-empty H and W", "[?, 3, 0, 6]"});
  auto [i, g2] = kg::SymTensor::input(kg::DType::I64, {kg::dynamic, 3, 6, 6});
  kg_test::expect_error([&] { kg::max_pool2d(i, 2, 0, 0, 1, false, "p"); },
                        {"[nn.max_pool2d @ p]", "f32 and f64", "i64"});
  kg_test::expect_error([&] { kg::global_avg_pool(i, "p"); },
                        {"[nn.global_avg_pool @ p]", "f32 and f64", "i64"});

  // A dynamic height that turns out too small is reported at load.
  auto [d, g3] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 3, kg::dynamic, 8});
  auto y = kg::avg_pool2d(d, 3, 0, 0, false, true, "p");
  kg::Model model(g3, {y});
  kg_test::expect_error(
      [&] {
        model.load(kg::Device::cpu(), {{1, 3, 2, 8}});
      },
      {"[nn.avg_pool2d @ p]", "[1, 3, 2, 8]",
       "input height of 2 with padding 0 is smaller than the window 3"});
}

TEST(Pool2d, MatchesPyTorchFixtures) {
  for (const char* name : {"pool_max_resnet", "pool_max_default_stride", "pool_max_ceil", "pool_max_dilation",
                           "pool_avg_pad", "pool_avg_nopad_count", "pool_avg_ceil", "pool_avg_ceil_nopad"}) {
    SCOPED_TRACE(name);
    std::map<std::string, std::string> meta;
    auto t = kg_test::fixture(std::string(name) + ".safetensors", &meta);
    auto k = pair_of(meta.at("kernel")), s = pair_of(meta.at("stride")), p = pair_of(meta.at("padding")),
         d = pair_of(meta.at("dilation"));
    PoolCfg cfg{meta.at("op") == "max",
                kg::Size2(k[0], k[1]),
                kg::Size2(s[0], s[1]),
                kg::Size2(p[0], p[1]),
                kg::Size2(d[0], d[1]),
                meta.at("ceil_mode") == "1",
                meta.at("count_include_pad") == "1"};
    SCOPED_TRACE(cfg.text());
    kg::Tensor y = kg_test::run_op([&](const kg::SymTensor& x) { return cfg.record(x); }, t.at("x"));
    EXPECT_TRUE(kg_test::all_close(y, t.at("y"), 1e-6, 1e-6));
  }
  auto gap = kg_test::fixture("pool_global_avg.safetensors");
  EXPECT_TRUE(kg_test::all_close(
      kg_test::run_op([](const kg::SymTensor& x) { return kg::global_avg_pool(x); }, gap.at("x")),
      gap.at("y"), 1e-6, 1e-6));
  std::map<std::string, std::string> meta;
  auto up = kg_test::fixture("pool_upsample_nearest.safetensors", &meta);
  auto sc = pair_of(meta.at("scale"));
  EXPECT_TRUE(kg_test::all_close(kg_test::run_op(
                                     [&](const kg::SymTensor& x) {
                                       return kg::upsample_nearest2d(x, {sc[0], sc[1]});
                                     },
                                     up.at("x")),
                                 up.at("y"), 0, 1e-300));
}

TEST(Pool2d, MatchesNaiveReferenceAtSeveralBatches) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<PoolCfg> configs = {
      {true, 3, 2, 1},                        // ResNet's stem
      {true, 2},                              // stride = kernel
      {true, 3, 2, 0, 1, true},               // ceil_mode
      {true, {3, 2}, {1, 2}, 1, {2, 1}},      // dilated, rectangular
      {true, {1, 3}, 1, {0, 1}},              // 1-row windows
      {false, 3, 2, 1},                       // padding counted
      {false, 3, 2, 1, 1, false, false},      // padding not counted
      {false, {3, 2}, 2, 1, 1, true, true},   // ceil_mode with padding counted
      {false, {3, 2}, 2, 1, 1, true, false},  // ceil_mode without
      {false, 2},
  };
  for (const PoolCfg& cfg : configs) {
    for (std::int64_t batch : {1, 7, 64}) {
      for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
        SCOPED_TRACE(cfg.text() + " batch " + std::to_string(batch) + " " + std::string(kg::dtype_name(dt)));
        kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, 3, 9, 10});
        kg::Tensor y = run_declared(x, batch == 7, [&](const kg::SymTensor& t) { return cfg.record(t); });
        EXPECT_TRUE(kg_test::all_close(y, naive_pool(x, cfg), dt == kg::DType::F32 ? 1e-6 : 1e-14, 1e-7));
      }
    }
  }
}

TEST(Pool2d, GlobalAverageAndUpsampleMatchNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t batch : {1, 7, 64}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      SCOPED_TRACE("batch " + std::to_string(batch) + " " + std::string(kg::dtype_name(dt)));
      // 37 elements per plane: the vector body and the tail of the sum both run.
      kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, 4, 37, 1});
      kg::Tensor mean = kg::Tensor::empty(kg::DType::F64, {batch, 4, 1, 1});
      for (std::int64_t pl = 0; pl < batch * 4; ++pl) {
        double s = 0;
        for (std::int64_t i = 0; i < 37; ++i) s += x.item(pl * 37 + i);
        mean.data<double>()[pl] = s / 37;
      }
      EXPECT_TRUE(kg_test::all_close(
          run_declared(x, batch == 7, [](const kg::SymTensor& t) { return kg::global_avg_pool(t); }), mean,
          dt == kg::DType::F32 ? 1e-5 : 1e-13, 1e-7));

      kg::Tensor u = kg_test::random_tensor(rng, dt, {batch, 2, 3, 5});
      kg::Tensor up = kg::Tensor::empty(kg::DType::F64, {batch, 2, 9, 10});
      for (std::int64_t pl = 0; pl < batch * 2; ++pl)
        for (std::int64_t i = 0; i < 9; ++i)
          for (std::int64_t j = 0; j < 10; ++j)
            up.data<double>()[(pl * 9 + i) * 10 + j] = u.item((pl * 3 + i / 3) * 5 + j / 2);
      EXPECT_TRUE(kg_test::all_close(run_declared(u, batch == 7,
                                                  [](const kg::SymTensor& t) {
                                                    return kg::upsample_nearest2d(t, {3, 2});
                                                  }),
                                     up, 0, 1e-300));
    }
  }
}

TEST(Pool2d, MaxPoolPropagatesNaN) {
  // PyTorch: a NaN in the window wins.
  std::vector<float> v(16);
  for (int i = 0; i < 16; ++i) v[static_cast<std::size_t>(i)] = static_cast<float>(i);
  v[5] = std::numeric_limits<float>::quiet_NaN();
  kg::Tensor x = kg::Tensor::from_vector<float>({1, 1, 4, 4}, v);
  kg::Tensor y = kg_test::run_graph(
      [](const std::vector<kg::SymTensor>& xs) {
        return std::vector<kg::SymTensor>{kg::max_pool2d(xs[0], 2)};
      },
      {x}, {}, true, false)[0];
  ASSERT_EQ(y.shape(), (std::vector<std::int64_t>{1, 1, 2, 2}));
  EXPECT_TRUE(std::isnan(y.item(0)));
  EXPECT_EQ(y.item(1), 7.0);
  EXPECT_EQ(y.item(2), 13.0);
  EXPECT_EQ(y.item(3), 15.0);
}

TEST(Pool2d, GpuLoweringCompilesAndMatchesTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<PoolCfg> configs = {
      {true, 3, 2, 1},                        // ResNet's stem
      {true, 2},                              // stride = kernel
      {true, 3, 2, 0, 1, true},               // ceil_mode
      {true, {3, 2}, {1, 2}, 1, {2, 1}},      // dilated, rectangular
      {true, {1, 3}, 1, {0, 1}},              // 1-row windows
      {false, 3, 2, 1},                       // padding counted
      {false, 3, 2, 1, 1, false, false},      // padding not counted
      {false, {3, 2}, 2, 1, 1, true, true},   // ceil_mode with padding counted
      {false, {3, 2}, 2, 1, 1, true, false},  // ceil_mode without
      {false, 2},
  };
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
    // Max and average pooling visit the taps in the CPU's order; the GPU's global average sums
    // each plane in another order.
    const double rtol = dt == kg::DType::F32 ? 1e-6 : 1e-14, atol = dt == kg::DType::F32 ? 1e-7 : 1e-15;
    for (std::int64_t batch : {1, 7, 64}) {
      for (const PoolCfg& cfg : configs) {
        SCOPED_TRACE(cfg.text() + " batch " + std::to_string(batch) + " " + std::string(kg::dtype_name(dt)));
        kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, 3, 9, 10});
        kg_test::check_lowering(
            [&](const std::vector<kg::SymTensor>& xs) {
              return std::vector<kg::SymTensor>{cfg.record(xs[0])};
            },
            {x}, rtol, atol);
      }
      SCOPED_TRACE("global average and upsampling, batch " + std::to_string(batch) + " " +
                   std::string(kg::dtype_name(dt)));
      kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, 5, 7, 9});
      kg_test::check_lowering(
          [](const std::vector<kg::SymTensor>& xs) {
            return std::vector<kg::SymTensor>{kg::global_avg_pool(xs[0])};
          },
          {x}, dt == kg::DType::F32 ? 1e-5 : 1e-13, 1e-7);
      // A plane longer than a warp's stride several times over.
      kg::Tensor big = kg_test::random_tensor(rng, dt, {batch, 2, 33, 20});
      kg_test::check_lowering(
          [](const std::vector<kg::SymTensor>& xs) {
            return std::vector<kg::SymTensor>{kg::global_avg_pool(xs[0])};
          },
          {big}, dt == kg::DType::F32 ? 1e-5 : 1e-13, 1e-7);
      kg_test::check_lowering(
          [](const std::vector<kg::SymTensor>& xs) {
            return std::vector<kg::SymTensor>{kg::upsample_nearest2d(xs[0], {3, 2})};
          },
          {x}, 0, 1e-300);
    }
  }
}

// The GPU's 3×3 max-pool path (every tap loaded before the first compare) keeps PyTorch's rule:
// the first of equal values (told apart here by the sign of zero), a NaN anywhere in the window,
// -inf where every tap is -inf; in f32, f16 and bf16 (compared in float). Checked bit for bit
// against a naive loop of that rule, through the emulator (and on a GPU where there is one).
TEST(Pool2d, GpuMaxPool3x3PathKeepsTiesNaNAndInfinities) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  const std::vector<double> values = {0.0, -0.0, 1.0, -1.0, -inf, -inf, -inf, 0.5, nan};  // NaN last
  const std::int64_t n = 2, c = 3, h = 9, w = 11;
  // Without NaNs first, where an element never written (poisoned with NaN) shows.
  for (bool with_nan : {false, true})
    for (kg::DType dt : {kg::DType::F32, kg::DType::F16, kg::DType::BF16})
      for (const PoolCfg& cfg : {PoolCfg{true, 3, 2, 1}, PoolCfg{true, 3, 1, 1}, PoolCfg{true, 3, 2, 0, 1, true}}) {
        SCOPED_TRACE(cfg.text() + " " + std::string(kg::dtype_name(dt)) + (with_nan ? " with NaNs" : ""));
        std::uniform_int_distribution<std::size_t> pick(0, values.size() - (with_nan ? 1 : 2));
        std::vector<float> v(static_cast<std::size_t>(n * c * h * w));
        for (float& e : v) e = static_cast<float>(values[pick(rng)]);
        const kg::Tensor x = kg::Tensor::from_vector<float>({n, c, h, w}, v).to(dt);
        auto g = kg::Graph::create();
        kg::Model model(g, {cfg.record(g->input(dt, {kg::Dim::named("batch"), c, h, w}, "x"))});
        // The rule, tap by tap in row-major order.
        const std::int64_t s = cfg.stride.h, p = cfg.padding.h;
        const std::int64_t ho = pool_out(h, 3, s, p, 1, cfg.ceil_mode), wo = pool_out(w, 3, s, p, 1, cfg.ceil_mode);
        std::vector<double> want;
        for (std::int64_t pl = 0; pl < n * c; ++pl)
          for (std::int64_t oy = 0; oy < ho; ++oy)
            for (std::int64_t ox = 0; ox < wo; ++ox) {
              double m = -inf;
              for (std::int64_t ky = 0; ky < 3; ++ky)
                for (std::int64_t kx = 0; kx < 3; ++kx) {
                  const std::int64_t iy = oy * s - p + ky, ix = ox * s - p + kx;
                  if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;
                  const double t = v[static_cast<std::size_t>((pl * h + iy) * w + ix)];
                  if (t > m || std::isnan(t)) m = t;
                }
              want.push_back(m);
            }
        auto same_bits = [&](const kg::Tensor& got) {
          ASSERT_EQ(got.numel(), static_cast<std::int64_t>(want.size()));
          if (!with_nan) {
            EXPECT_TRUE(kg_test::all_written(got));
          }
          for (std::int64_t i = 0; i < got.numel(); ++i) {
            const double a = got.item(i), b = want[static_cast<std::size_t>(i)];
            if (std::isnan(b)) {
              EXPECT_TRUE(std::isnan(a)) << "element " << i;
            } else {
              EXPECT_TRUE(a == b && std::signbit(a) == std::signbit(b)) << "element " << i << ": " << a << " vs " << b;
            }
          }
        };
        same_bits(kg::emu::run_model(model, {x}, {}, /*checked=*/true).at(0));
        if (kg::Device::cuda_available()) same_bits(model.load(kg::Device::cuda(), {x.shape()}).forward({x}).at(0));
      }
}

TEST(Pool2d, GpuEntriesAndGrids) {
  if (!kg::compile::Compiler::available()) GTEST_SKIP() << "no NVRTC in this build";
  auto launch_of = [](kg::DType dt, const std::vector<std::int64_t>& shape,
                      const std::function<kg::SymTensor(const kg::SymTensor&)>& build) {
    auto g = kg::Graph::create();
    auto x = g->input(dt, kg::Shape{kg::Dim::named("batch"), shape[1], shape[2], shape[3]}, "x");
    kg::Model model(g, {build(x)});
    auto steps = kg::lower::dry_run(model, {shape}, 90).launches.steps;
    EXPECT_EQ(steps.size(), 1u);
    EXPECT_EQ(steps.at(0).launches.size(), 1u);
    return std::make_pair(steps.at(0).launches.at(0).entry, steps.at(0).launches.at(0).launch);
  };
  // One thread per output element: 256 × 6 × 14 × 14 outputs, 256 threads a block.
  auto [e1, l1] = launch_of(kg::DType::F32, {256, 6, 28, 28},
                            [](const kg::SymTensor& x) { return kg::max_pool2d(x, 2); });
  EXPECT_EQ(e1, "kg_max_pool2d_f32");
  EXPECT_EQ(l1.grid.x, 6u * 14 * 14);
  EXPECT_EQ(l1.block.x, 256u);
  auto [e2, l2] = launch_of(kg::DType::F64, {3, 2, 9, 10},
                            [](const kg::SymTensor& x) { return kg::avg_pool2d(x, 3, 2, 1, false, false); });
  EXPECT_EQ(e2, "kg_avg_pool2d_f64");
  EXPECT_EQ(l2.grid.x, 1u);
  // One warp per plane, 8 planes a block.
  auto [e3, l3] = launch_of(kg::DType::F32, {5, 512, 7, 7},
                            [](const kg::SymTensor& x) { return kg::global_avg_pool(x); });
  EXPECT_EQ(e3, "kg_global_avg_pool_f32");
  EXPECT_EQ(l3.grid.x, 5u * 512 / 8);
  auto [e4, l4] = launch_of(kg::DType::F64, {2, 3, 10, 10},
                            [](const kg::SymTensor& x) { return kg::upsample_nearest2d(x, 2); });
  EXPECT_EQ(e4, "kg_upsample_nearest2d_f64");
  EXPECT_EQ(l4.grid.x, (2u * 3 * 400 + 255) / 256);
}

TEST(Pool2d, GpuMaxPoolPropagatesNaN) {
  if (!kg::Device::cuda_available()) GTEST_SKIP() << "no GPU";
  std::vector<float> v(16);
  for (int i = 0; i < 16; ++i) v[static_cast<std::size_t>(i)] = static_cast<float>(i);
  v[5] = std::numeric_limits<float>::quiet_NaN();
  kg::Tensor x = kg::Tensor::from_vector<float>({1, 1, 4, 4}, v);
  auto g = kg::Graph::create();
  kg::Model model(g, {kg::max_pool2d(g->input(kg::DType::F32, {kg::dynamic, 1, 4, 4}, "x"), 2)});
  kg::Tensor y = model.load(kg::Device::cuda(), {{1, 1, 4, 4}}).forward({x})[0];
  ASSERT_EQ(y.shape(), (std::vector<std::int64_t>{1, 1, 2, 2}));
  EXPECT_TRUE(std::isnan(y.item(0)));
  EXPECT_EQ(y.item(1), 7.0);
  EXPECT_EQ(y.item(2), 13.0);
  EXPECT_EQ(y.item(3), 15.0);
}

// The CPU max pooling's paths (pool.cpp, max_pool_planes): the column pass over blocks of
// output rows (windows that neither overlap nor reach into padding horizontally, blocks that
// span planes and end mid-plane), the per-row pass with edges (padding, overlap, dilation,
// ceil_mode windows past the row's end), rows wider than the stack buffer, and planes split over
// 3 threads. Max is exact, so each element must equal the naive reference, and each is written.
TEST(Pool2d, MaxPoolCpuPathsMatchNaiveReferenceExactly) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    PoolCfg cfg;
    std::vector<std::int64_t> shape;
  };
  const std::vector<Case> cases = {
      {{true, 2}, {64, 16, 10, 10}},              // LeNet's second pool: blocks over planes
      {{true, 2}, {5, 6, 28, 28}},                // LeNet's first
      {{true, 2}, {3, 5, 7, 9}},                  // odd sizes: the last row and column dropped
      {{true, 3}, {2, 3, 11, 13}},                // stride 3 (the portable loop)
      {{true, {2, 3}, {2, 3}}, {2, 3, 9, 14}},    // rectangular, non-overlapping
      {{true, {2, 1}, {2, 3}}, {2, 3, 9, 14}},    // kw < sw: columns skipped
      {{true, 2, 2, 0, 1, true}, {2, 3, 9, 11}},  // ceil_mode: a window past the row's end
      {{true, 2, 2, 1}, {2, 3, 9, 10}},           // padding: the per-row path
      {{true, 3, 2, 1}, {2, 4, 17, 33}},          // ResNet's stem, odd width
      {{true, 3, 1, 1}, {1, 2, 6, 40}},           // stride 1
      {{true, 3, 2, 1, 2}, {2, 2, 13, 21}},       // dilation 2
      {{true, {3, 2}, {1, 2}, {1, 0}, {2, 1}}, {1, 3, 12, 19}},
      {{true, 3, 2, 1, 1, true}, {2, 2, 10, 10}},  // ceil_mode with padding
      {{true, 2}, {1, 2, 4, 5000}},                // rows wider than the stack buffer
      {{true, 3, 2, 1}, {1, 1, 3, 4500}},
      {{true, 2}, {40, 10, 28, 28}},  // several chunks on 3 threads
      {{true, 3, 2, 1}, {40, 10, 15, 15}},
      {{true, 1}, {2, 3, 5, 7}},  // 1x1: a copy
  };
  for (const Case& c : cases) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      SCOPED_TRACE(c.cfg.text() + " " + kg::sizes_to_string(c.shape) + " " + std::string(kg::dtype_name(dt)));
      kg::Tensor x = kg_test::random_tensor(rng, dt, c.shape);
      auto g = kg::Graph::create();
      kg::Model model(
          g, {c.cfg.record(
                 g->input(dt, kg::Shape{kg::Dim::named("batch"), c.shape[1], c.shape[2], c.shape[3]}, "x"))});
      kg::LoadOptions opt;
      opt.poison_buffers = true;
      opt.threads = 3;
      kg::LoadedModel m = model.load(kg::Device::cpu(), {x.shape()}, opt);
      for (int run = 0; run < 2; ++run) {  // the second run reuses the steps' prepared tensors
        const kg::Tensor y = m.forward({x})[0];
        EXPECT_TRUE(kg_test::all_written(y));
        EXPECT_TRUE(kg_test::all_close(y, naive_pool(x, c.cfg), 0, 1e-300));
      }
    }
  }
}

// A NaN anywhere in a window wins, on the block path and the per-row path alike.
TEST(Pool2d, MaxPoolNaNOnEveryCpuPath) {
  for (const PoolCfg& cfg : {PoolCfg{true, 2}, PoolCfg{true, 3, 2, 1}, PoolCfg{true, 2, 2, 0, 1, true}}) {
    for (std::int64_t at : {0, 7, 10, 55, 98}) {
      SCOPED_TRACE(cfg.text() + " NaN at " + std::to_string(at));
      std::vector<float> v(2 * 99);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 13) - 6.0f;
      v[static_cast<std::size_t>(99 + at)] = std::numeric_limits<float>::quiet_NaN();  // plane 1
      kg::Tensor x = kg::Tensor::from_vector<float>({1, 2, 9, 11}, v);
      kg::Tensor y = kg_test::run_graph(
          [&](const std::vector<kg::SymTensor>& xs) { return std::vector<kg::SymTensor>{cfg.record(xs[0])}; },
          {x}, {}, true, false)[0];
      const kg::Tensor want = naive_pool(x, cfg);  // std::max drops the NaN: find its windows here
      const std::int64_t ho = y.dim(2), wo = y.dim(3), iy = at / 11, ix = at % 11;
      const kg::Size2 s(cfg.stride.h ? cfg.stride.h : cfg.kernel.h,
                        cfg.stride.w ? cfg.stride.w : cfg.kernel.w);
      for (std::int64_t pl = 0; pl < 2; ++pl)
        for (std::int64_t oy = 0; oy < ho; ++oy)
          for (std::int64_t ox = 0; ox < wo; ++ox) {
            const std::int64_t y0 = oy * s.h - cfg.padding.h, x0 = ox * s.w - cfg.padding.w;
            const bool covers =
                pl == 1 && iy >= y0 && iy < y0 + cfg.kernel.h && ix >= x0 && ix < x0 + cfg.kernel.w;
            const std::int64_t i = (pl * ho + oy) * wo + ox;
            if (covers)
              EXPECT_TRUE(std::isnan(y.item(i))) << "output " << i;
            else
              EXPECT_EQ(y.item(i), want.item(i)) << "output " << i;
          }
    }
  }
}
