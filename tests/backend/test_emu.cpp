// CUDA-on-CPU emulation: real kernels (nn.linear's tiled GEMM, the seed's detect_decode) run by
// the emulator against the CPU implementations and naive references, a reduction with shared
// memory, shuffles, votes and atomics, and planted bugs that the checks must catch and name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "../../examples/detect_decode/detect_decode.hpp"
#include "backend/emu/executor.hpp"
#include "backend/emu/host_jit.hpp"
#include "compile/embedded_sources.hpp"
#include "kg/cuda.hpp"
#include "support/test_util.hpp"

using kg_test::expect_error;
using kg_test::fresh_seed;

namespace {

kg::DevicePtr addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
kg::DevicePtr addr(kg::Tensor& t) { return addr(t.raw()); }

// A reduction over a grid-stride loop: warp sums with __shfl_xor_sync, per-warp partials in
// static shared memory, a block total added atomically; and a count of positive elements with
// __ballot_sync, __reduce_add_sync, __match_any_sync and __syncthreads_count, and the largest
// element through dynamic shared memory.
const char* kReduceSource = R"(
extern "C" __global__ void __launch_bounds__(256)
    block_stats(const float* __restrict__ x, float* __restrict__ sum, int* __restrict__ positives,
                float* __restrict__ block_max, unsigned* __restrict__ warp_info, long long n) {
  __shared__ float partial[32];
  extern __shared__ float maxima[];
  float v = 0.f, m = -3.402823466e38f;  // -FLT_MAX: NVRTC has no INFINITY macro
  int pos = 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
    v += x[i];
    m = fmaxf(m, x[i]);
    pos += x[i] > 0.f;
  }
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned b = __ballot_sync(0xffffffffu, pos > 0);
  const unsigned count = __reduce_add_sync(0xffffffffu, pos > 0 ? 1u : 0u);
  const unsigned same = __match_any_sync(0xffffffffu, pos > 0);
  if (lane == 0) {
    partial[warp] = v;
    unsigned* info = warp_info + 3 * (blockIdx.x * (blockDim.x >> 5) + warp);
    info[0] = b;
    info[1] = count;
    info[2] = same;
  }
  maxima[threadIdx.x] = m;
  const int block_pos = __syncthreads_count(pos > 0);
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) maxima[threadIdx.x] = fmaxf(maxima[threadIdx.x], maxima[threadIdx.x + s]);
    __syncthreads();
  }
  if (warp == 0) {
    v = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) {
      atomicAdd(sum, v);
      atomicAdd(positives, block_pos);
      block_max[blockIdx.x] = maxima[0];
    }
  }
}
)";

// Math functions, intrinsics and the 16-bit float types, one result per column.
const char* kMathSource = R"(
extern "C" __global__ void math_table(const float* __restrict__ x, float* __restrict__ out,
                                      unsigned* __restrict__ bits,
                                      int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = x[i], a = fabsf(v) + 0.5f;
  float* o = out + 12 * i;
  o[0] = expf(v);
  o[1] = __expf(v);
  o[2] = logf(a);
  o[3] = tanhf(v);
  o[4] = erff(v);
  o[5] = rsqrtf(a);
  o[6] = __fdividef(v, a);
  o[7] = fmaxf(v, 0.25f) + min(v, -0.25f);
  o[8] = __saturatef(v);
  o[9] = __half2float(__float2half(v));
  o[10] = __bfloat162float(__float2bfloat16(v));
  o[11] = float(__half(v) * __half(2.0f));
  unsigned* b = bits + 4 * i;
  const unsigned u = __float_as_uint(v);
  b[0] = __popc(u);
  b[1] = __brev(u);
  b[2] = __umulhi(u, 0x9e3779b9u);
  b[3] = (unsigned)__float2int_rn(v * 100.f);
}
)";

// Every shuffle flavour with widths, out-of-range deltas and lane masks, votes, match and reduce:
// one row of results per thread.
const char* kLaneRulesSource = R"(
extern "C" __global__ void lane_rules(int* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int v = lane * 10 + warp * 1000 + 7;
  const unsigned full = 0xffffffffu;
  int* o = out + threadIdx.x * 16;
  o[0] = __shfl_sync(full, v, (lane * 7 + 3) % 32);
  o[1] = __shfl_sync(full, v, lane * 3 + 5, 8);
  o[2] = __shfl_up_sync(full, v, 3, 8);
  o[3] = __shfl_down_sync(full, v, 5, 16);
  o[4] = __shfl_xor_sync(full, v, 6, 16);
  o[5] = __shfl_xor_sync(full, v, 20, 16);
  o[6] = __shfl_up_sync(full, v, 40);
  o[7] = __shfl_down_sync(full, v, 33);
  o[8] = __shfl_sync(full, v, -3);
  o[9] = __shfl_xor_sync(full, v, 37);
  o[10] = -1;
  if (lane % 2 == 0) o[10] = __shfl_down_sync(0x55555555u, v, 2);
  o[11] = (int)__ballot_sync(full, v % 3 == 0);
  o[12] = __all_sync(full, v > 0) + 2 * __any_sync(full, v % 7 == 0);
  o[13] = (int)__match_any_sync(full, v % 3);
  o[14] = (int)__reduce_add_sync(full, (unsigned)v);
  o[15] = __shfl_sync(full, v, lane + 3, 4);
}
)";

// Kernels with planted bugs, and correct twins.
const char* kBugsSource = R"(
extern "C" __global__ void copy_off_by_one(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= n) y[i] = 2.f * x[i < n ? i : 0];  // writes y[n]
}

extern "C" __global__ void read_past_end(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i + 1];  // reads x[n]
}

template <bool Sync>
__device__ void tree_sum(const float* x, float* out) {
  __shared__ float s[128];
  const int t = threadIdx.x;
  s[t] = x[blockIdx.x * 128 + t];
  if (Sync) __syncthreads();  // without it, thread t may read s[t + stride] before it is written
  for (int stride = 64; stride > 0; stride >>= 1) {
    if (t < stride) s[t] += s[t + stride];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = s[0];
}
extern "C" __global__ void __launch_bounds__(128) tree_sum_synced(const float* x, float* out) {
  tree_sum<true>(x, out);
}
extern "C" __global__ void __launch_bounds__(128) tree_sum_racy(const float* x, float* out) {
  tree_sum<false>(x, out);
}

extern "C" __global__ void warp_sum_wrong_mask(const float* x, float* out) {
  float v = x[threadIdx.x];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0x0000ffffu, v, o);  // should name all 32 lanes
  if (threadIdx.x == 0) out[0] = v;
}

extern "C" __global__ void ballot_masks_disagree(const float* x, unsigned* out) {
  const unsigned mask = threadIdx.x == 5 ? 0x0000ffffu : 0xffffffffu;
  out[threadIdx.x] = __ballot_sync(mask, x[threadIdx.x] > 0.f);
}

extern "C" __global__ void shuffle_after_exit(const float* x, float* out, int n) {
  const int i = threadIdx.x;
  if (i >= n) return;
  out[i] = __shfl_down_sync(0xffffffffu, x[i], 1);
}

extern "C" __global__ void barrier_against_shuffle(float* out) {
  float v = threadIdx.x;
  if (threadIdx.x == 0) __syncthreads();
  else v = __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}
)";

// Pointers (DevicePtr) and i32 values, in order.
template <class... Args>
kg::lower::ArgPack args(Args... a) {
  kg::lower::ArgPack p;
  auto add = [&](auto v) {
    if constexpr (std::is_same_v<decltype(v), int>)
      p.i32(v);
    else
      p.pointer(v);
  };
  (add(a), ...);
  return p;
}

kg::emu::LaunchOptions checked(std::vector<kg::emu::HostBuffer> buffers) {
  kg::emu::LaunchOptions o;
  o.checked = true;
  o.buffers = std::move(buffers);
  return o;
}

kg::emu::HostBuffer buffer(kg::Tensor& t, const std::string& name) { return {addr(t), t.nbytes(), name}; }

// y = x wᵀ + b in double.
std::vector<double> naive_linear(const kg::Tensor& x, const kg::Tensor& w, const kg::Tensor& b) {
  const std::int64_t in = w.dim(1), out = w.dim(0), rows = x.dim(0);
  std::vector<double> y(static_cast<std::size_t>(rows * out));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < out; ++j) {
      double s = b.item(j);
      for (std::int64_t k = 0; k < in; ++k) s += x.item(r * in + k) * w.item(j * in + k);
      y[static_cast<std::size_t>(r * out + j)] = s;
    }
  return y;
}

}  // namespace

TEST(Emu, FindsKernelSignatures) {
  const auto ks = kg::emu::find_kernels(kg::compile::kernel_source("linear.cu"));
  ASSERT_EQ(ks.size(), 4u);  // f32, f64, f16, bf16
  EXPECT_EQ(ks[0].name, "kg_linear_f32");
  EXPECT_TRUE(ks[0].extern_c);
  EXPECT_EQ(ks[0].launch_bounds, "KG_GEMM_THREADS");
  EXPECT_EQ(ks[0].param_names, (std::vector<std::string>{"x", "w", "bias", "y", "rows", "in", "out"}));
  EXPECT_EQ(ks[0].param_types[0], "const float*");
  EXPECT_EQ(ks[0].param_types[4], "long long");
  EXPECT_EQ(kg::emu::find_kernels(kBugsSource).size(), 8u);  // the template is not an entry
  const auto other = kg::emu::find_kernels(
      "extern \"C\" {\n__launch_bounds__(64) __global__ void a(int n, const double* __restrict__ p = "
      "nullptr) {}\n}\n"
      "__global__ void b(float * x) {}\ntemplate <int N> __global__ void c(int* y) {}\n");
  ASSERT_EQ(other.size(), 2u);
  EXPECT_TRUE(other[0].extern_c);
  EXPECT_EQ(other[0].launch_bounds, "64");
  EXPECT_EQ(other[0].param_names, (std::vector<std::string>{"n", "p"}));
  EXPECT_EQ(other[0].param_types[1], "const double*");
  EXPECT_FALSE(other[1].extern_c);
  EXPECT_EQ(other[1].param_types[0], "float*");
  const std::string rewritten = kg::emu::rewrite_dynamic_shared(kReduceSource);
  EXPECT_NE(rewritten.find("float* const maxima = reinterpret_cast<float*>(kg_emu_dynamic_shared());"),
            std::string::npos);
}

TEST(Emu, LinearKernelMatchesTheCpuAtSeveralBatches) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 70}, "x");
  kg::Model model(g, {kg::nn::linear(x, 65, "fc")});
  for (std::int64_t batch : {1, 7, 64}) {
    SCOPED_TRACE("batch " + std::to_string(batch));
    kg::Tensor in = kg_test::random_tensor(rng, kg::DType::F32, {batch, 70});
    kg::LoadOptions opt;
    opt.poison_buffers = true;
    opt.seed = seed;
    kg::LoadedModel cpu = model.load(kg::Device::cpu(), {in.shape()}, opt);
    const auto params = cpu.state_dict();
    kg::Tensor want = cpu.forward({in})[0];
    // Batch 7 runs unchecked; the others in checked mode (guarded buffers, both thread orders).
    kg::Tensor got = kg::emu::run_model(model, {in}, params, batch != 7)[0];
    ASSERT_EQ(got.shape(), want.shape());
    EXPECT_TRUE(kg_test::all_written(got));
    EXPECT_TRUE(kg_test::all_close(got, want, 1e-5, 1e-6));
    const auto ref = naive_linear(in, params.at("fc.weight"), params.at("fc.bias"));
    for (std::int64_t i = 0; i < got.numel(); ++i)
      ASSERT_NEAR(got.item(i), ref[static_cast<std::size_t>(i)],
                  1e-5 + 1e-5 * std::abs(ref[static_cast<std::size_t>(i)]))
          << "element " << i;
  }
}

TEST(Emu, LinearKernelInDoublePrecision) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F64, {kg::Dim::named("batch"), 33}, "x");
  kg::Model model(g, {kg::nn::linear(x, 70, "fc")});
  kg::Tensor in = kg_test::random_tensor(rng, kg::DType::F64, {130, 33});
  kg::Tensor w = kg_test::random_tensor(rng, kg::DType::F64, {70, 33});
  kg::Tensor b = kg_test::random_tensor(rng, kg::DType::F64, {70});
  kg::Tensor got = kg::emu::run_model(model, {in}, {{"fc.weight", w}, {"fc.bias", b}}, false)[0];
  const auto ref = naive_linear(in, w, b);
  for (std::int64_t i = 0; i < got.numel(); ++i)
    ASSERT_NEAR(got.item(i), ref[static_cast<std::size_t>(i)], 1e-12) << "element " << i;
}

TEST(Emu, DetectDecodeMatchesItsCpuForward) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int h = 5, w = 7;
  const float stride = 8.f;
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 4, h * w}, "dist");
  auto op = yolo::DetectDecodeOp::for_level(h, w, stride, 32);  // two tiles per image, the second partial
  kg::Model model(g, {x.record_custom(kg::CustomData(op), {}, std::nullopt, "decode")});
  for (std::int64_t batch : {1, 3}) {
    kg::Tensor in = kg_test::random_tensor(rng, kg::DType::F32, {batch, 4, h * w}, 0.0, 3.0);
    kg::LoadOptions opt;
    opt.poison_buffers = true;
    kg::Tensor want = model.load(kg::Device::cpu(), {in.shape()}, opt).forward({in})[0];
    kg::Tensor got = kg::emu::run_model(model, {in}, {}, true)[0];
    EXPECT_TRUE(kg_test::all_close(got, want, 1e-6, 1e-6));
    // And the boxes from first principles.
    const std::int64_t A = h * w;
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t a = 0; a < A; ++a) {
        const double ax = static_cast<double>(a % w) + 0.5, ay = static_cast<double>(a / w) + 0.5;
        auto d = [&](int k) { return in.item((b * 4 + k) * A + a); };
        auto o = [&](int k) { return got.item((b * 4 + k) * A + a); };
        EXPECT_NEAR(o(0), (ax + (d(2) - d(0)) / 2) * stride, 1e-4);
        EXPECT_NEAR(o(1), (ay + (d(3) - d(1)) / 2) * stride, 1e-4);
        EXPECT_NEAR(o(2), (d(0) + d(2)) * stride, 1e-4);
        EXPECT_NEAR(o(3), (d(1) + d(3)) * stride, 1e-4);
      }
  }
}

TEST(Emu, ReductionWithSharedMemoryShufflesVotesAndAtomics) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int n = 10007, blocks = 6, threads = 256, warps = threads / 32;
  kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {n});
  double want_sum = 0, abs_sum = 0;
  int want_pos_threads = 0;
  std::vector<float> want_max(blocks, -INFINITY);
  std::vector<unsigned> want_ballot(blocks * warps, 0);
  for (int b = 0; b < blocks; ++b)
    for (int t = 0; t < threads; ++t) {
      bool any = false;
      for (int i = b * threads + t; i < n; i += blocks * threads) {
        const float v = x.data<float>()[i];
        want_sum += v;
        abs_sum += std::abs(v);
        want_max[static_cast<std::size_t>(b)] = std::max(want_max[static_cast<std::size_t>(b)], v);
        any = any || v > 0.f;
      }
      want_pos_threads += any;
      if (any) want_ballot[static_cast<std::size_t>(b * warps + t / 32)] |= 1u << (t % 32);
    }
  for (bool check : {false, true}) {
    for (kg::emu::Order order : {kg::emu::Order::Forward, kg::emu::Order::Reverse}) {
      if (check && order == kg::emu::Order::Reverse) continue;  // checked runs both orders itself
      SCOPED_TRACE(check ? "checked" : order == kg::emu::Order::Forward ? "forward" : "reverse");
      kg::Tensor sum = kg::Tensor::zeros(kg::DType::F32, {1});
      kg::Tensor pos = kg::Tensor::zeros(kg::DType::I32, {1});
      kg::Tensor mx = kg::Tensor::zeros(kg::DType::F32, {blocks});
      kg::Tensor info = kg::Tensor::zeros(kg::DType::I32, {blocks * warps, 3});
      kg::lower::ArgPack a = args(addr(x), addr(sum), addr(pos), addr(mx), addr(info));
      a.i64(n);
      kg::emu::LaunchOptions o = check
                                     ? checked({buffer(x, "x"), buffer(sum, "sum"), buffer(pos, "positives"),
                                                buffer(mx, "block_max"), buffer(info, "warp_info")})
                                     : kg::emu::LaunchOptions{};
      o.order = order;
      kg::emu::launch("test.block_stats", kReduceSource, "block_stats", {blocks, 1, 1}, {threads, 1, 1},
                      threads * sizeof(float), a, o);
      EXPECT_NEAR(sum.item(0), want_sum, 1e-5 * abs_sum);
      EXPECT_EQ(pos.item(0), want_pos_threads);
      for (int b = 0; b < blocks; ++b)
        EXPECT_EQ(mx.item(b), want_max[static_cast<std::size_t>(b)]) << "block " << b;
      for (int k = 0; k < blocks * warps; ++k) {
        const auto* got = reinterpret_cast<const unsigned*>(info.data<std::int32_t>()) + 3 * k;
        const unsigned ballot = want_ballot[static_cast<std::size_t>(k)];
        EXPECT_EQ(got[0], ballot) << "warp " << k;
        EXPECT_EQ(got[1], static_cast<unsigned>(__builtin_popcount(ballot))) << "warp " << k;
        EXPECT_EQ(got[2], (ballot & 1u) ? ballot : ~ballot) << "warp " << k;
      }
    }
  }
}

// CUDA's lane rules, as documented (and as an H200 computes them): lanes form segments of
// `width`; a source lane index or delta uses its low 5 bits; up/down/xor reading outside the
// caller's segment (xor: past its end) return the caller's own value.
TEST(Emu, WarpIntrinsicsFollowCudaLaneRules) {
  std::vector<std::int32_t> out(64 * 16, 0);
  kg::emu::launch("test.lanes", kLaneRulesSource, "lane_rules", {1, 1, 1}, {64, 1, 1}, 0,
                  args(addr(out.data())));
  for (int t = 0; t < 64; ++t) {
    const int lane = t % 32, warp = t / 32;
    auto v = [&](int l) { return l * 10 + warp * 1000 + 7; };
    auto idx = [&](int src, int width) { return v((lane & ~(width - 1)) + (src & (width - 1))); };
    auto up = [&](int d, int width) {
      return lane - (d & 31) >= (lane & ~(width - 1)) ? v(lane - (d & 31)) : v(lane);
    };
    auto down = [&](int d, int width) {
      return lane + (d & 31) <= (lane | (width - 1)) ? v(lane + (d & 31)) : v(lane);
    };
    auto bfly = [&](int m, int width) {
      return (lane ^ (m & 31)) <= (lane | (width - 1)) ? v(lane ^ (m & 31)) : v(lane);
    };
    unsigned ballot = 0, same = 0, sum = 0;
    bool all = true, any = false;
    for (int l = 0; l < 32; ++l) {
      if (v(l) % 3 == 0) ballot |= 1u << l;
      if (v(l) % 3 == v(lane) % 3) same |= 1u << l;
      sum += static_cast<unsigned>(v(l));
      all = all && v(l) > 0;
      any = any || v(l) % 7 == 0;
    }
    const std::int32_t want[16] = {idx((lane * 7 + 3) % 32, 32),
                                   idx(lane * 3 + 5, 8),
                                   up(3, 8),
                                   down(5, 16),
                                   bfly(6, 16),
                                   bfly(20, 16),
                                   up(40, 32),
                                   down(33, 32),
                                   idx(-3, 32),
                                   bfly(37, 32),
                                   lane % 2 ? -1 : down(2, 32),
                                   static_cast<std::int32_t>(ballot),
                                   (all ? 1 : 0) + (any ? 2 : 0),
                                   static_cast<std::int32_t>(same),
                                   static_cast<std::int32_t>(sum),
                                   idx(lane + 3, 4)};
    for (int r = 0; r < 16; ++r)
      EXPECT_EQ(out[static_cast<std::size_t>(t * 16 + r)], want[r]) << "thread " << t << " result " << r;
  }
}

// x rounded to `bits` significant bits, to nearest even (for normal values).
double round_to_bits(double x, int bits) {
  int e = 0;
  const double m = std::frexp(x, &e);
  return std::ldexp(std::nearbyint(std::ldexp(m, bits)), e - bits);
}

TEST(Emu, MathFunctionsIntrinsicsAndHalfTypes) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int n = 300;
  kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {n}, -3.0, 3.0);
  x.data<float>()[0] = 0.5f + 1.0f / 4096;  // a half-way case for __half: rounds to even
  kg::Tensor out = kg::Tensor::zeros(kg::DType::F32, {n, 12});
  kg::Tensor bits = kg::Tensor::zeros(kg::DType::I32, {n, 4});
  kg::emu::launch("test.math", kMathSource, "", {3, 1, 1}, {128, 1, 1}, 0,
                  args(addr(x), addr(out), addr(bits), n),
                  checked({buffer(x, "x"), buffer(out, "out"), buffer(bits, "bits")}));
  for (int i = 0; i < n; ++i) {
    SCOPED_TRACE("x[" + std::to_string(i) + "] = " + std::to_string(x.item(i)));
    const double v = x.item(i), a = std::abs(v) + 0.5;
    const double want[12] = {std::exp(v),
                             std::exp(v),
                             std::log(a),
                             std::tanh(v),
                             std::erf(v),
                             1 / std::sqrt(a),
                             v / a,
                             std::max(v, 0.25) + std::min(v, -0.25),
                             std::clamp(v, 0.0, 1.0),
                             std::abs(v) < 1e-4 ? v : round_to_bits(v, 11),
                             std::abs(v) < 1e-30 ? v : round_to_bits(v, 8),
                             std::abs(v) < 1e-4 ? 2 * v : 2 * round_to_bits(v, 11)};
    for (int c = 0; c < 12; ++c) {
      const double tol = c >= 9 ? std::abs(v) * 1e-3 : 2e-6 * (1 + std::abs(want[c]));
      if (c >= 9 && std::abs(v) >= 1e-4)
        EXPECT_EQ(out.item(i * 12 + c), want[c]) << "column " << c;
      else
        EXPECT_NEAR(out.item(i * 12 + c), want[c], tol) << "column " << c;
    }
    const float f = x.data<float>()[i];
    unsigned u;
    std::memcpy(&u, &f, 4);
    unsigned rev = 0;
    for (int k = 0; k < 32; ++k) rev |= ((u >> k) & 1u) << (31 - k);
    const auto* b = reinterpret_cast<const unsigned*>(bits.data<std::int32_t>()) + 4 * i;
    EXPECT_EQ(b[0], static_cast<unsigned>(__builtin_popcount(u)));
    EXPECT_EQ(b[1], rev);
    EXPECT_EQ(b[2], static_cast<unsigned>((static_cast<unsigned long long>(u) * 0x9e3779b9ull) >> 32));
    EXPECT_EQ(static_cast<int>(b[3]), static_cast<int>(std::nearbyint(static_cast<double>(f * 100.f))));
  }
}

TEST(Emu, CatchesAnOutOfBoundsWriteAtTheGuardPage) {
  kg::Tensor x = kg::Tensor::zeros(kg::DType::F32, {100}), y = kg::Tensor::zeros(kg::DType::F32, {100});
  expect_error(
      [&] {
        kg::emu::launch("test.bugs", kBugsSource, "copy_off_by_one", {4, 1, 1}, {32, 1, 1}, 0,
                        args(addr(x), addr(y), 100), checked({buffer(x, "x"), buffer(y, "y")}));
      },
      {"[test.bugs] kernel 'copy_off_by_one'", "out-of-bounds write past the end of argument 1 'y'",
       "float*; buffer y, 400 bytes", "element 100 (byte offset 400)",
       "thread (4, 0, 0) of block (3, 0, 0)"});
  // 101 floats leave 12 bytes before the guard page: the write lands in the canary zone.
  kg::Tensor x2 = kg::Tensor::zeros(kg::DType::F32, {101}), y2 = kg::Tensor::zeros(kg::DType::F32, {101});
  expect_error(
      [&] {
        kg::emu::launch("test.bugs", kBugsSource, "copy_off_by_one", {4, 1, 1}, {32, 1, 1}, 0,
                        args(addr(x2), addr(y2), 101), checked({buffer(x2, "x"), buffer(y2, "y")}));
      },
      {"kernel 'copy_off_by_one'", "out-of-bounds write past the end of argument 1 'y'",
       "element 101 (byte offset 404)", "found after the launch"});
  // Unchecked, the same launch within bounds is fine and the output is right.
  kg::Tensor y3 = kg::Tensor::zeros(kg::DType::F32, {101});
  for (int i = 0; i < 100; ++i) x2.data<float>()[i] = static_cast<float>(i);
  kg::emu::launch("test.bugs", kBugsSource, "copy_off_by_one", {1, 1, 1}, {100, 1, 1}, 0,
                  args(addr(x2), addr(y3), 101));
  for (int i = 0; i < 100; ++i) ASSERT_EQ(y3.item(i), 2.0 * i);
}

TEST(Emu, CatchesAnOutOfBoundsRead) {
  kg::Tensor x = kg::Tensor::zeros(kg::DType::F32, {64}), y = kg::Tensor::zeros(kg::DType::F32, {64});
  expect_error(
      [&] {
        kg::emu::launch("test.bugs", kBugsSource, "read_past_end", {2, 1, 1}, {32, 1, 1}, 0,
                        args(addr(x), addr(y), 64), checked({buffer(x, "x"), buffer(y, "y")}));
      },
      {"kernel 'read_past_end'",
       "out-of-bounds read past the end of argument 0 'x' (const float*; buffer x, 256 bytes)",
       "element 64 (byte offset 256)", "thread (31, 0, 0) of block (1, 0, 0)"});
}

// Vector loads and stores through pointers that a GPU would refuse: x + 1 is 4 bytes past a
// multiple of 16, so a float4 cannot be read from it, nor a float2 written to y + 1.
const char* kAlignSource = R"(
extern "C" __global__ void load_float4(const float* x, float* y, int offset) {
  const float4 v = reinterpret_cast<const float4*>(x + offset)[threadIdx.x];
  y[threadIdx.x] = v.x + v.y + v.z + v.w;
}
extern "C" __global__ void store_float2(float* y, int offset) {
  reinterpret_cast<float2*>(y + offset)[threadIdx.x] = make_float2(1.f, 2.f);
}
)";

TEST(Emu, CatchesAMisalignedVectorAccess) {
  kg::Tensor x = kg::Tensor::zeros(kg::DType::F32, {40}), y = kg::Tensor::zeros(kg::DType::F32, {40});
  for (int i = 0; i < 40; ++i) x.data<float>()[i] = static_cast<float>(i);
  // Aligned: the sums of four.
  kg::emu::launch("test.align", kAlignSource, "load_float4", {1, 1, 1}, {8, 1, 1}, 0, args(addr(x), addr(y), 4),
                  checked({buffer(x, "x"), buffer(y, "y")}));
  for (int i = 0; i < 8; ++i) ASSERT_EQ(y.item(i), 16.0 * i + 22) << i;  // x[4 + 4i] + ... + x[7 + 4i]
  expect_error(
      [&] {
        kg::emu::launch("test.align", kAlignSource, "load_float4", {1, 1, 1}, {8, 1, 1}, 0,
                        args(addr(x), addr(y), 1), checked({buffer(x, "x"), buffer(y, "y")}));
      },
      {"[test.align] kernel 'load_float4'", "misaligned", "float4", "element 1 (byte offset 4) of argument 0 'x' (const float*; buffer x, 160 bytes)",
       "4 bytes past a multiple of 16", "test.align.cu:3", "thread (0, 0, 0) of block (0, 0, 0)"});
  expect_error(
      [&] {
        kg::emu::launch("test.align", kAlignSource, "store_float2", {1, 1, 1}, {4, 1, 1}, 0, args(addr(y), 1),
                        checked({buffer(y, "y")}));
      },
      {"kernel 'store_float2'", "misaligned", "float2", "misaligned store", "element 1 (byte offset 4) of argument 0 'y'", "4 bytes past a multiple of 8",
       "test.align.cu:7"});
  // Unchecked launches are checked too; the address is then all there is to name.
  expect_error(
      [&] {
        kg::emu::launch("test.align", kAlignSource, "load_float4", {1, 1, 1}, {8, 1, 1}, 0,
                        args(addr(x), addr(y), 3));
      },
      {"misaligned", "float4' at address 0x", "12 bytes past a multiple of 16"});
}

TEST(Emu, CatchesAMissingSyncthreadsAsARace) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int blocks = 3;
  kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {blocks * 128}, 1.0, 2.0);
  kg::Tensor out = kg::Tensor::zeros(kg::DType::F32, {blocks});
  auto opts = checked({buffer(x, "x"), buffer(out, "out")});
  kg::emu::launch("test.bugs", kBugsSource, "tree_sum_synced", {blocks, 1, 1}, {128, 1, 1}, 0,
                  args(addr(x), addr(out)), opts);
  for (int b = 0; b < blocks; ++b) {
    double s = 0;
    for (int t = 0; t < 128; ++t) s += x.item(b * 128 + t);
    EXPECT_NEAR(out.item(b), s, 1e-4) << "block " << b;
  }
  expect_error(
      [&] {
        kg::emu::launch("test.bugs", kBugsSource, "tree_sum_racy", {blocks, 1, 1}, {128, 1, 1}, 0,
                        args(addr(x), addr(out)), opts);
      },
      {"[test.bugs] kernel 'tree_sum_racy': a race between the threads of a block",
       "argument 1 'out' (float*; buffer out, 12 bytes)", "first differs at element",
       "missing __syncthreads()"});
}

TEST(Emu, CatchesWrongWarpMasks) {
  kg::Tensor x = kg::Tensor::zeros(kg::DType::F32, {32}), out = kg::Tensor::zeros(kg::DType::F32, {32});
  expect_error(
      [&] {
        kg::emu::launch("test.bugs", kBugsSource, "warp_sum_wrong_mask", {1, 1, 1}, {32, 1, 1}, 0,
                        args(addr(x), addr(out)));
      },
      {"[test.bugs] kernel 'warp_sum_wrong_mask': __shfl_xor_sync: mask 0x0000ffff does not include the "
       "calling "
       "lane 16",
       "thread (16, 0, 0) of block (0, 0, 0)"});
  expect_error(
      [&] {
        kg::emu::launch("test.bugs", kBugsSource, "ballot_masks_disagree", {1, 1, 1}, {32, 1, 1}, 0,
                        args(addr(x), addr(out)));
      },
      {"kernel 'ballot_masks_disagree': __ballot_sync: called with mask 0x0000ffff while lanes 0-4 wait in "
       "__ballot_sync with mask 0xffffffff",
       "the lanes disagree on the mask", "lane 5 of warp 0"});
  expect_error(
      [&] {
        kg::emu::launch("test.bugs", kBugsSource, "shuffle_after_exit", {1, 1, 1}, {32, 1, 1}, 0,
                        args(addr(x), addr(out), 20));
      },
      {"kernel 'shuffle_after_exit': lane 20 of warp 0 exited while lanes 0-19 wait for it in "
       "__shfl_down_sync with "
       "mask 0xffffffff"});
  expect_error(
      [&] {
        kg::emu::launch("test.bugs", kBugsSource, "barrier_against_shuffle", {1, 1, 1}, {32, 1, 1}, 0,
                        args(addr(out)));
      },
      {"kernel 'barrier_against_shuffle': deadlock in block (0, 0, 0)",
       "lanes 1-31 of warp 0 wait in __shfl_xor_sync with mask 0xffffffff for lanes 0 (lane 0 waits at "
       "__syncthreads())",
       "1 of 32 live threads wait at __syncthreads()"});
}

TEST(Emu, ChecksArgumentsAgainstTheKernelSignature) {
  kg::Tensor x = kg::Tensor::zeros(kg::DType::F32, {8}), y = kg::Tensor::zeros(kg::DType::F32, {8});
  kg::lower::ArgPack wide = args(addr(x), addr(y));
  wide.i64(8);
  expect_error(
      [&] {
        kg::emu::launch("test.bugs", kBugsSource, "copy_off_by_one", {1, 1, 1}, {8, 1, 1}, 0, wide);
      },
      {"[test.bugs] pack_args: argument 2 'n' is `int` (4 bytes) in the kernel 'copy_off_by_one' but an i64 "
       "(8 "
       "bytes) was visited"});
  kg::lower::ArgPack swapped = args(addr(x), 8, 8);
  expect_error(
      [&] {
        kg::emu::launch("test.bugs", kBugsSource, "copy_off_by_one", {1, 1, 1}, {8, 1, 1}, 0, swapped);
      },
      {"argument 1 'y' is `float*` (8 bytes)", "but an i32 (4 bytes) was visited"});
  expect_error(
      [&] {
        kg::emu::launch("test.bugs", kBugsSource, "copy_off_by_one", {1, 1, 1}, {8, 1, 1}, 0,
                        args(addr(x), addr(y)));
      },
      {"the kernel 'copy_off_by_one' takes 3 arguments but 2 were visited; missing argument 2 'n' `int` (4 "
       "bytes)"});
  expect_error(
      [&] {
        kg::emu::launch("test.bugs", kBugsSource, "tree_sum_synced", {1, 1, 1}, {256, 1, 1}, 0,
                        args(addr(x), addr(y)));
      },
      {"block (256, 1, 1) has 256 threads, over the __launch_bounds__ (128) of kernel 'tree_sum_synced'"});
  expect_error(
      [&] {
        kg::emu::launch("test.bugs", kBugsSource, "nope", {1, 1, 1}, {8, 1, 1}, 0, args(addr(x)));
      },
      {"entry point 'nope' is not a __global__ function", "copy_off_by_one", "tree_sum_racy"});
  expect_error(
      [&] {
        kg::emu::launch("test.bugs", kBugsSource, "copy_off_by_one", {1, 1, 1}, {8, 1, 1}, 0,
                        args(addr(x), addr(y), 8), checked({buffer(x, "x")}));
      },
      {"argument 1 'y' of kernel 'copy_off_by_one' points to 0x", "inside none of the launch's buffers (x)"});
}

TEST(Emu, CompilesEachSourceOnceAndCachesOnDisk) {
  auto& jit = kg::emu::HostJit::global();
  auto a = jit.load("test.bugs", kBugsSource);
  const auto before = jit.stats();
  auto b = jit.load("test.bugs", kBugsSource);
  EXPECT_EQ(a.get(), b.get());
  EXPECT_EQ(jit.stats().memory_hits, before.memory_hits + 1);
  EXPECT_EQ(jit.stats().compiled, before.compiled);
  EXPECT_TRUE(std::filesystem::exists(a->path));
  EXPECT_EQ(a->path.parent_path(), jit.cache_dir());
  expect_error(
      [&] { jit.load("test.broken", "extern \"C\" __global__ void k(float* y) { y[0] = undefined_name; }"); },
      {"[test.broken] the host compiler failed to build the kernel source", "test.broken.cu:1",
       "undefined_name"});
}

// The same shared-memory + __shfl_xor_sync reduction (with ballot, match, reduce and atomics)
// run emulated and on a GPU: everything but the float sum (whose atomicAdd order differs
// between runs on a GPU) must agree exactly. Skipped without a GPU; scripts/gpu-check runs it.
TEST(Emu, GpuReductionMatchesTheEmulator) {
  if (!kg::cuda::available()) GTEST_SKIP() << "no GPU: " << kg::cuda::unavailable_reason();
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int n = 100003, blocks = 24, threads = 256, warps = threads / 32;
  kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {n});
  // Emulated.
  kg::Tensor sum = kg::Tensor::zeros(kg::DType::F32, {1});
  kg::Tensor pos = kg::Tensor::zeros(kg::DType::I32, {1});
  kg::Tensor mx = kg::Tensor::zeros(kg::DType::F32, {blocks});
  kg::Tensor info = kg::Tensor::zeros(kg::DType::I32, {blocks * warps, 3});
  kg::lower::ArgPack a = args(addr(x), addr(sum), addr(pos), addr(mx), addr(info));
  a.i64(n);
  kg::emu::launch("test.block_stats", kReduceSource, "block_stats", {blocks, 1, 1}, {threads, 1, 1},
                  threads * sizeof(float), a);
  // On the GPU.
  auto dx = kg::cuda::DeviceTensorBuffer::from(x);
  auto dsum = kg::cuda::DeviceTensorBuffer::from(kg::Tensor::zeros(kg::DType::F32, {1}));
  auto dpos = kg::cuda::DeviceTensorBuffer::from(kg::Tensor::zeros(kg::DType::I32, {1}));
  auto dmx = kg::cuda::DeviceTensorBuffer::from(kg::Tensor::zeros(kg::DType::F32, {blocks}));
  auto dinfo = kg::cuda::DeviceTensorBuffer::from(kg::Tensor::zeros(kg::DType::I32, {blocks * warps, 3}));
  auto k = kg::cuda::Kernel::compile("test.block_stats", kReduceSource, "block_stats");
  k.launch({blocks, 1, 1}, {threads, 1, 1},
           [&](kg::ArgVisitor& v) {
             v.pointer(dx.ptr());
             v.pointer(dsum.ptr());
             v.pointer(dpos.ptr());
             v.pointer(dmx.ptr());
             v.pointer(dinfo.ptr());
             v.i64(n);
           },
           threads * sizeof(float));
  kg::Tensor gsum = dsum.download(), gpos = dpos.download(), gmx = dmx.download(), ginfo = dinfo.download();
  double abs_sum = 0;
  for (std::int64_t i = 0; i < n; ++i) abs_sum += std::abs(x.item(i));
  EXPECT_NEAR(gsum.item(0), sum.item(0), 1e-6 * abs_sum);
  EXPECT_EQ(gpos.item(0), pos.item(0));
  for (int b = 0; b < blocks; ++b) EXPECT_EQ(gmx.item(b), mx.item(b)) << "block " << b;
  for (std::int64_t i = 0; i < info.numel(); ++i) EXPECT_EQ(ginfo.item(i), info.item(i)) << "warp info " << i;
}
