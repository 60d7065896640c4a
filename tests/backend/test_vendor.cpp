// The vendor-library backends (cuBLASLt for GemmCall, cuDNN for Conv2dCall): unavailable without a
// GPU, and on a GPU planned and run on fresh random inputs against naive double-precision host
// references, with outputs poisoned (NaN) beforehand so that an element never written shows.
#ifdef KG_HAVE_CUDA
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/context.hpp"
#include "backend/cuda/cudnn_api.hpp"
#include "backend/cuda/driver.hpp"
#include "backend/cuda/vendor.hpp"
#include "support/test_util.hpp"
#include "util/half.hpp"

using kg::DType;
using kg::cuda::BlasLt;
using kg::cuda::Dnn;
using kg::cuda::Driver;
using kg_test::expect_error;
using kg_test::fresh_seed;

namespace {

// ---------------------------------------------------------------------------------------------
// Without a GPU.

// What cuDNN's plans read back from the tuning cache (a file anyone can edit): a legacy algorithm
// ("3") or a position in the graph API's heuristic list ("graph 3"), 1 to 3 digits; anything
// else, however hostile, is no kept choice (the plan then chooses afresh).
TEST(Vendor, KeptCudnnChoicesAreShortNumbersAndNothingElse) {
  using kg::cuda::parse_kept_number;
  EXPECT_EQ(parse_kept_number(std::string("7")), 7);
  EXPECT_EQ(parse_kept_number(std::string("042")), 42);
  EXPECT_EQ(parse_kept_number(std::string("graph 0"), "graph "), 0);
  EXPECT_EQ(parse_kept_number(std::string("graph 999"), "graph "), 999);
  const std::vector<std::string> bad = {"",        "-1",     "1234",      "3a",     " 3",  "3 ",
                                        "\xff",   "graph 3", std::string("1\0", 2), "9999999999"};
  for (const std::string& t : bad) EXPECT_EQ(parse_kept_number(t), std::nullopt) << t;
  const std::vector<std::string> bad_graph = {"graph ", "graph", "graph 1234", "graph -1", "Graph 3", "graph  3",
                                              "3", "graph 3x", std::string("graph \0", 7)};
  for (const std::string& t : bad_graph) EXPECT_EQ(parse_kept_number(t, "graph "), std::nullopt) << t;
  EXPECT_EQ(parse_kept_number(std::nullopt), std::nullopt);
}

TEST(Vendor, WithoutADriverTheLibrariesAreUnavailableAndSayWhy) {
  if (Driver::get()) GTEST_SKIP() << "a GPU is present";
  const std::string driver_why = Driver::unavailable_reason();
  ASSERT_FALSE(driver_why.empty());
  EXPECT_EQ(BlasLt::get(), nullptr);
  EXPECT_EQ(Dnn::get(), nullptr);
  for (const std::string& why : {BlasLt::unavailable_reason(), Dnn::unavailable_reason()}) {
    EXPECT_NE(why.find("CUDA is not available"), std::string::npos) << why;
    EXPECT_NE(why.find(driver_why), std::string::npos) << why;
  }
  // Asked again: the same answer, loaded once.
  EXPECT_EQ(BlasLt::get(), nullptr);
  EXPECT_EQ(&BlasLt::unavailable_reason(), &BlasLt::unavailable_reason());
}

// ---------------------------------------------------------------------------------------------
// Host helpers: element encoding, buffers.

// `v` rounded to what `t` can hold.
double representable(DType t, double v) {
  switch (t) {
    case DType::F16:
      return kg::util::half_to_float(kg::util::float_to_half(static_cast<float>(v)));
    case DType::BF16:
      return kg::util::bf16_to_float(kg::util::float_to_bf16(static_cast<float>(v)));
    case DType::F32:
      return static_cast<float>(v);
    default:
      return v;
  }
}

// The bytes of `v` as elements of `t`.
std::vector<unsigned char> encode(DType t, const std::vector<double>& v) {
  const std::size_t es = kg::dtype_size(t);
  std::vector<unsigned char> out(v.size() * es);
  for (std::size_t i = 0; i < v.size(); ++i) {
    unsigned char* p = out.data() + i * es;
    if (t == DType::F64) {
      std::memcpy(p, &v[i], 8);
    } else if (t == DType::F32) {
      const float f = static_cast<float>(v[i]);
      std::memcpy(p, &f, 4);
    } else {
      const float f = static_cast<float>(v[i]);
      const std::uint16_t h = t == DType::F16 ? kg::util::float_to_half(f) : kg::util::float_to_bf16(f);
      std::memcpy(p, &h, 2);
    }
  }
  return out;
}

// Elements of `t` as doubles.
std::vector<double> decode(DType t, const std::vector<unsigned char>& bytes) {
  const std::size_t es = kg::dtype_size(t);
  std::vector<double> out(bytes.size() / es);
  for (std::size_t i = 0; i < out.size(); ++i) {
    const unsigned char* p = bytes.data() + i * es;
    if (t == DType::F64) {
      std::memcpy(&out[i], p, 8);
    } else if (t == DType::F32) {
      float f;
      std::memcpy(&f, p, 4);
      out[i] = f;
    } else {
      std::uint16_t h;
      std::memcpy(&h, p, 2);
      out[i] = t == DType::F16 ? kg::util::half_to_float(h) : kg::util::bf16_to_float(h);
    }
  }
  return out;
}

// `n` random values in [-1, 1), each representable in `t`.
std::vector<double> random_values(std::mt19937_64& rng, DType t, std::size_t n) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> v(n);
  for (double& x : v) x = representable(t, u(rng));
  return v;
}

// A device buffer holding `v` as elements of `t`.
kg::cuda::DeviceBuffer upload(kg::cuda::Context& ctx, DType t, const std::vector<double>& v) {
  const auto bytes = encode(t, v);
  kg::cuda::DeviceBuffer b(ctx, std::max<std::size_t>(bytes.size(), 1));
  ctx.upload(b.ptr(), bytes.data(), bytes.size());
  return b;
}

// `n` elements of `t` read back from `p`.
std::vector<double> download(kg::cuda::Context& ctx, DType t, kg::DevicePtr p, std::size_t n) {
  std::vector<unsigned char> bytes(n * kg::dtype_size(t));
  ctx.download(bytes.data(), p, bytes.size());
  return decode(t, bytes);
}

// Runs `plan` once on the context's stream with a fresh workspace and waits.
void run_plan(kg::cuda::Context& ctx, const kg::cuda::VendorPlan& plan, const std::string& label) {
  kg::cuda::DeviceBuffer ws(ctx, std::max<std::size_t>(plan.workspace_bytes(), 1));
  plan.run(ctx.stream(), ws.ptr(), label);
  ctx.synchronize(label);
}

const double kNaN = std::numeric_limits<double>::quiet_NaN();

// The context of cuda:0, or null (the test is then skipped by the caller).
kg::cuda::Context* gpu() {
  if (!Driver::get()) return nullptr;
  return &kg::cuda::Context::get(0);
}

#define KG_REQUIRE_GPU_AND(lib)                                                          \
  kg::cuda::Context* ctx_ptr = gpu();                                                    \
  if (!ctx_ptr) GTEST_SKIP() << "no GPU: " << Driver::unavailable_reason();              \
  kg::cuda::Context& ctx = *ctx_ptr;                                                     \
  const auto* lib_ptr = lib::get();                                                      \
  if (!lib_ptr) GTEST_SKIP() << #lib " is not available: " << lib::unavailable_reason(); \
  const auto& vendor = *lib_ptr;                                                         \
  EXPECT_EQ(lib::unavailable_reason(), "");                                              \
  (void)vendor;                                                                          \
  (void)ctx

// ---------------------------------------------------------------------------------------------
// GEMM.

// One matrix product to check: sizes, layout of the stored operands, epilogue, options.
struct GemmCase {
  const char* name;
  DType dtype = DType::F32;
  std::int64_t m = 1, n = 1, k = 1;
  bool trans_a = false, trans_b = false;
  std::int64_t pad_a = 0, pad_b = 0, pad_c = 0;  // extra elements per stored row
  std::int64_t batch = 1;
  bool shared_b = false;  // stride_b = 0: one B for every batch item
  std::int64_t gap = 0;   // extra elements between batch items
  bool bias = false, relu = false;
  bool tf32 = false, tune = false;
  double tol = 1e-5;  // of |error| against the sum of |a·b| terms (+ |bias|) of each element
};

// Plans and runs `c` on fresh random inputs and compares every element with a host reference;
// the padding of C stays NaN.
void check_gemm(kg::cuda::Context& ctx, const BlasLt& lt, const GemmCase& c, std::mt19937_64& rng) {
  SCOPED_TRACE(c.name);
  const DType t = c.dtype;
  const std::int64_t a_rows = c.trans_a ? c.k : c.m, a_cols = c.trans_a ? c.m : c.k;
  const std::int64_t b_rows = c.trans_b ? c.n : c.k, b_cols = c.trans_b ? c.k : c.n;
  kg::GemmCall g;
  g.dtype = t;
  g.m = c.m, g.n = c.n, g.k = c.k;
  g.trans_a = c.trans_a, g.trans_b = c.trans_b;
  g.lda = a_cols + c.pad_a, g.ldb = b_cols + c.pad_b, g.ldc = c.n + c.pad_c;
  g.batch = c.batch;
  g.stride_a = c.batch > 1 ? a_rows * g.lda + c.gap : 0;
  g.stride_b = c.batch > 1 && !c.shared_b ? b_rows * g.ldb + c.gap : 0;
  g.stride_c = c.batch > 1 ? c.m * g.ldc + c.gap : 0;
  g.relu = c.relu;
  const std::int64_t b_items = c.shared_b ? 1 : c.batch;
  const auto a = random_values(rng, t, static_cast<std::size_t>((c.batch - 1) * g.stride_a + a_rows * g.lda));
  const auto b = random_values(rng, t, static_cast<std::size_t>((b_items - 1) * g.stride_b + b_rows * g.ldb));
  const auto bias = random_values(rng, t, static_cast<std::size_t>(c.n));
  const std::size_t c_size = static_cast<std::size_t>((c.batch - 1) * g.stride_c + c.m * g.ldc);
  auto da = upload(ctx, t, a), db = upload(ctx, t, b), dbias = upload(ctx, t, bias);
  auto dc = upload(ctx, t, std::vector<double>(c_size, kNaN));
  g.a = da.ptr(), g.b = db.ptr(), g.c = dc.ptr();
  if (c.bias) g.bias = dbias.ptr();

  kg::cuda::VendorOptions o;
  o.tf32 = c.tf32;
  o.tune = c.tune;
  const std::string label = std::string("[test.gemm @ ") + c.name + "]";
  auto plan = lt.plan(g, o, ctx.stream(), label);
  ASSERT_NE(plan, nullptr) << "cuBLASLt has no algorithm";
  EXPECT_LE(plan->workspace_bytes(), o.max_workspace_bytes);
  EXPECT_NE(plan->describe().find("cublasLt"), std::string::npos) << plan->describe();
  if (c.tune) {  // tuning ran on the output: poison it again
    const auto nan = encode(t, std::vector<double>(c_size, kNaN));
    ctx.upload(dc.ptr(), nan.data(), nan.size());
  }
  run_plan(ctx, *plan, label);
  const auto got = download(ctx, t, dc.ptr(), c_size);

  std::vector<bool> inside(c_size, false);
  double worst = 0;
  int bad = 0;
  for (std::int64_t bi = 0; bi < c.batch; ++bi)
    for (std::int64_t i = 0; i < c.m; ++i)
      for (std::int64_t j = 0; j < c.n; ++j) {
        double sum = 0, mag = 0;
        for (std::int64_t p = 0; p < c.k; ++p) {
          const double x =
              c.trans_a ? a[bi * g.stride_a + p * g.lda + i] : a[bi * g.stride_a + i * g.lda + p];
          const double y =
              c.trans_b ? b[bi * g.stride_b + j * g.ldb + p] : b[bi * g.stride_b + p * g.ldb + j];
          sum += x * y;
          mag += std::abs(x * y);
        }
        if (c.bias) sum += bias[j], mag += std::abs(bias[j]);
        if (c.relu) sum = std::max(sum, 0.0);
        const std::size_t at = static_cast<std::size_t>(bi * g.stride_c + i * g.ldc + j);
        inside[at] = true;
        const double err = std::isnan(got[at]) ? INFINITY : std::abs(got[at] - sum) / (mag + 1e-30);
        worst = std::max(worst, err);
        if (err > c.tol && bad++ < 5)
          ADD_FAILURE() << "C[" << bi << "][" << i << "][" << j << "] = " << got[at] << ", want " << sum
                        << " (relative error " << err << " > " << c.tol << ")";
      }
  EXPECT_EQ(bad, 0) << bad << " wrong element(s); worst relative error " << worst << "; " << plan->describe();
  std::printf("[   info   ] %s: %s, worst relative error %.2e\n", c.name, plan->describe().c_str(), worst);
  int touched = 0;
  for (std::size_t i = 0; i < c_size; ++i)
    if (!inside[i] && !std::isnan(got[i])) ++touched;
  EXPECT_EQ(touched, 0) << "elements of C's padding were written";
}

#define KG_GEMM_CASE(...) \
  [] {                    \
    GemmCase c;           \
    __VA_ARGS__;          \
    return c;             \
  }()

TEST(VendorGpu, GemmF32MatchesTheHostInEveryLayout) {
  KG_REQUIRE_GPU_AND(BlasLt);
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<GemmCase> cases = {
      KG_GEMM_CASE(c.name = "2x3 by 3x4", c.m = 2, c.n = 4, c.k = 3),
      KG_GEMM_CASE(c.name = "plain", c.m = 37, c.n = 53, c.k = 29),
      KG_GEMM_CASE(c.name = "A transposed", c.m = 33, c.n = 20, c.k = 41, c.trans_a = true),
      KG_GEMM_CASE(c.name = "B transposed", c.m = 18, c.n = 45, c.k = 27, c.trans_b = true),
      KG_GEMM_CASE(c.name = "both transposed", c.m = 25, c.n = 31, c.k = 64, c.trans_a = true,
                   c.trans_b = true),
      KG_GEMM_CASE(c.name = "padded rows", c.m = 19, c.n = 22, c.k = 35, c.pad_a = 5, c.pad_b = 3,
                   c.pad_c = 7),
      KG_GEMM_CASE(c.name = "padded, transposed", c.m = 21, c.n = 17, c.k = 30, c.trans_a = true,
                   c.trans_b = true, c.pad_a = 4, c.pad_b = 9, c.pad_c = 2),
      KG_GEMM_CASE(c.name = "batch", c.m = 12, c.n = 14, c.k = 16, c.batch = 3),
      KG_GEMM_CASE(c.name = "batch, shared B", c.m = 13, c.n = 11, c.k = 24, c.batch = 4, c.shared_b = true),
      KG_GEMM_CASE(c.name = "batch, shared B transposed, gaps", c.m = 9, c.n = 10, c.k = 20, c.batch = 3,
                   c.shared_b = true, c.trans_b = true, c.gap = 3, c.pad_c = 1),
      KG_GEMM_CASE(c.name = "bias", c.m = 24, c.n = 40, c.k = 32, c.bias = true),
      KG_GEMM_CASE(c.name = "relu", c.m = 24, c.n = 40, c.k = 32, c.relu = true),
      KG_GEMM_CASE(c.name = "bias + relu", c.m = 30, c.n = 26, c.k = 18, c.bias = true, c.relu = true),
      KG_GEMM_CASE(c.name = "batch, bias + relu, transposed A", c.m = 8, c.n = 12, c.k = 10, c.batch = 2,
                   c.bias = true, c.relu = true, c.trans_a = true),
      KG_GEMM_CASE(c.name = "m = 1", c.m = 1, c.n = 33, c.k = 17),
      KG_GEMM_CASE(c.name = "n = 1", c.m = 29, c.n = 1, c.k = 23),
      KG_GEMM_CASE(c.name = "n = 1, bias, transposed", c.m = 16, c.n = 1, c.k = 12, c.bias = true,
                   c.trans_a = true, c.trans_b = true),
      KG_GEMM_CASE(c.name = "m = n = 1", c.m = 1, c.n = 1, c.k = 50),
  };
  for (GemmCase c : cases) {
    check_gemm(ctx, vendor, c, rng);
    std::string tf = std::string(c.name) + ", tf32";
    c.name = tf.c_str();
    c.tf32 = true;
    c.tol = 2e-2;
    check_gemm(ctx, vendor, c, rng);
  }
}

TEST(VendorGpu, GemmHalfBfloatAndDoubleMatchTheHost) {
  KG_REQUIRE_GPU_AND(BlasLt);
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (DType t : {DType::F16, DType::BF16}) {
    const std::vector<GemmCase> cases = {
        KG_GEMM_CASE(c.name = "plain", c.m = 40, c.n = 24, c.k = 64),
        KG_GEMM_CASE(c.name = "transposed, bias + relu", c.m = 32, c.n = 48, c.k = 40, c.trans_a = true,
                     c.trans_b = true, c.bias = true, c.relu = true),
        KG_GEMM_CASE(c.name = "batch, shared B, bias", c.m = 16, c.n = 24, c.k = 32, c.batch = 3,
                     c.shared_b = true, c.bias = true),
        KG_GEMM_CASE(c.name = "n = 1", c.m = 24, c.n = 1, c.k = 16),
    };
    for (GemmCase c : cases) {
      const std::string name = std::string(kg::dtype_name(t)) + " " + c.name;
      c.name = name.c_str();
      c.dtype = t;
      c.tol = 2e-2;
      check_gemm(ctx, vendor, c, rng);
    }
  }
  const std::vector<GemmCase> f64 = {
      KG_GEMM_CASE(c.name = "f64", c.dtype = DType::F64, c.m = 23, c.n = 19, c.k = 31, c.tol = 1e-12),
      KG_GEMM_CASE(c.name = "f64 transposed, batch", c.dtype = DType::F64, c.m = 9, c.n = 7, c.k = 13,
                   c.trans_a = true, c.trans_b = true, c.batch = 2, c.tol = 1e-12),
  };
  for (const GemmCase& c : f64) check_gemm(ctx, vendor, c, rng);
}

TEST(VendorGpu, GemmTunedKeepsAWorkingAlgorithm) {
  KG_REQUIRE_GPU_AND(BlasLt);
  std::mt19937_64 rng(fresh_seed());
  check_gemm(ctx, vendor,
             KG_GEMM_CASE(c.name = "tuned", c.m = 256, c.n = 192, c.k = 128, c.bias = true, c.tune = true),
             rng);
  check_gemm(ctx, vendor,
             KG_GEMM_CASE(c.name = "tuned, tf32, batch", c.m = 64, c.n = 96, c.k = 80, c.batch = 2,
                          c.tf32 = true, c.tune = true, c.tol = 2e-2),
             rng);
}

TEST(VendorGpu, GemmRefusesWhatItCannotRun) {
  KG_REQUIRE_GPU_AND(BlasLt);
  kg::cuda::DeviceBuffer buf(ctx, 1 << 16);
  kg::GemmCall g;
  g.a = g.b = g.c = buf.ptr();
  g.m = g.n = g.k = 8;
  g.lda = g.ldb = g.ldc = 8;
  g.dtype = DType::I32;
  EXPECT_EQ(vendor.plan(g, {}, ctx.stream(), "[test.gemm @ i32]"), nullptr);
  g.dtype = DType::F32;
  g.lda = 7;  // shorter than a row
  EXPECT_EQ(vendor.plan(g, {}, ctx.stream(), "[test.gemm @ short lda]"), nullptr);
  g.lda = 8;
  g.batch = 2;  // every item written to one C
  EXPECT_EQ(vendor.plan(g, {}, ctx.stream(), "[test.gemm @ shared C]"), nullptr);
  g.batch = 1;
  EXPECT_NE(vendor.plan(g, {}, ctx.stream(), "[test.gemm @ fine]"), nullptr);
}

// ---------------------------------------------------------------------------------------------
// Convolution.

// One convolution to check.
struct ConvCase {
  const char* name;
  DType dtype = DType::F32;
  std::int64_t n = 1, c = 1, h = 1, w = 1, k = 1, kh = 1, kw = 1;
  std::int64_t pad_h = 0, pad_w = 0, stride_h = 1, stride_w = 1, dil_h = 1, dil_w = 1, groups = 1;
  bool bias = false;
  bool tf32 = false, tune = false;
  double tol = 1e-5;  // of |error| against the sum of |x·w| terms (+ |bias|) of each element
};

// The call for `c` (addresses unset), with the output size of PyTorch's formula.
kg::Conv2dCall conv_call(const ConvCase& c) {
  kg::Conv2dCall k;
  k.dtype = c.dtype;
  k.batch = c.n, k.in_channels = c.c, k.height = c.h, k.width = c.w;
  k.out_channels = c.k, k.kernel_h = c.kh, k.kernel_w = c.kw;
  k.pad_h = c.pad_h, k.pad_w = c.pad_w, k.stride_h = c.stride_h, k.stride_w = c.stride_w;
  k.dilation_h = c.dil_h, k.dilation_w = c.dil_w, k.groups = c.groups;
  k.out_height = (c.h + 2 * c.pad_h - c.dil_h * (c.kh - 1) - 1) / c.stride_h + 1;
  k.out_width = (c.w + 2 * c.pad_w - c.dil_w * (c.kw - 1) - 1) / c.stride_w + 1;
  return k;
}

// Plans and runs `c` on fresh random inputs and compares every output element with a host
// reference.
void check_conv(kg::cuda::Context& ctx, const Dnn& dnn, const ConvCase& c, std::mt19937_64& rng) {
  SCOPED_TRACE(c.name);
  const DType t = c.dtype;
  kg::Conv2dCall k = conv_call(c);
  const std::int64_t cg = c.c / c.groups, kg_ = c.k / c.groups, oh = k.out_height, ow = k.out_width;
  const auto x = random_values(rng, t, static_cast<std::size_t>(c.n * c.c * c.h * c.w));
  const auto w = random_values(rng, t, static_cast<std::size_t>(c.k * cg * c.kh * c.kw));
  const auto bias = random_values(rng, t, static_cast<std::size_t>(c.k));
  const std::size_t y_size = static_cast<std::size_t>(c.n * c.k * oh * ow);
  auto dx = upload(ctx, t, x), dw = upload(ctx, t, w), dbias = upload(ctx, t, bias);
  auto dy = upload(ctx, t, std::vector<double>(y_size, kNaN));
  k.x = dx.ptr(), k.w = dw.ptr(), k.y = dy.ptr();
  if (c.bias) k.bias = dbias.ptr();

  kg::cuda::VendorOptions o;
  o.tf32 = c.tf32;
  o.tune = c.tune;
  const std::string label = std::string("[test.conv @ ") + c.name + "]";
  auto plan = dnn.plan(k, o, ctx.stream(), label);
  ASSERT_NE(plan, nullptr) << "cuDNN has no algorithm";
  EXPECT_LE(plan->workspace_bytes(), o.max_workspace_bytes);
  EXPECT_NE(plan->describe().find("cudnn"), std::string::npos) << plan->describe();
  if (c.tune) {  // tuning ran on the output: poison it again
    const auto nan = encode(t, std::vector<double>(y_size, kNaN));
    ctx.upload(dy.ptr(), nan.data(), nan.size());
  }
  run_plan(ctx, *plan, label);
  const auto got = download(ctx, t, dy.ptr(), y_size);

  double worst = 0;
  int bad = 0;
  for (std::int64_t b = 0; b < c.n; ++b)
    for (std::int64_t o_ = 0; o_ < c.k; ++o_) {
      const std::int64_t grp = o_ / kg_;
      for (std::int64_t i = 0; i < oh; ++i)
        for (std::int64_t j = 0; j < ow; ++j) {
          double sum = 0, mag = 0;
          for (std::int64_t ci = 0; ci < cg; ++ci)
            for (std::int64_t r = 0; r < c.kh; ++r)
              for (std::int64_t s = 0; s < c.kw; ++s) {
                const std::int64_t y = i * c.stride_h - c.pad_h + r * c.dil_h;
                const std::int64_t xx = j * c.stride_w - c.pad_w + s * c.dil_w;
                if (y < 0 || y >= c.h || xx < 0 || xx >= c.w) continue;
                const double v = x[((b * c.c + grp * cg + ci) * c.h + y) * c.w + xx] *
                                 w[((o_ * cg + ci) * c.kh + r) * c.kw + s];
                sum += v;
                mag += std::abs(v);
              }
          if (c.bias) sum += bias[o_], mag += std::abs(bias[o_]);
          const std::size_t at = static_cast<std::size_t>(((b * c.k + o_) * oh + i) * ow + j);
          const double err = std::isnan(got[at]) ? INFINITY : std::abs(got[at] - sum) / (mag + 1e-30);
          worst = std::max(worst, err);
          if (err > c.tol && bad++ < 5)
            ADD_FAILURE() << "y[" << b << "][" << o_ << "][" << i << "][" << j << "] = " << got[at]
                          << ", want " << sum << " (relative error " << err << " > " << c.tol << ")";
        }
    }
  EXPECT_EQ(bad, 0) << bad << " wrong element(s); worst relative error " << worst << "; " << plan->describe();
  std::printf("[   info   ] %s: %s, worst relative error %.2e\n", c.name, plan->describe().c_str(), worst);
}

#define KG_CONV_CASE(...) \
  [] {                    \
    ConvCase c;           \
    __VA_ARGS__;          \
    return c;             \
  }()

TEST(VendorGpu, ConvMatchesTheHostInEveryConfiguration) {
  KG_REQUIRE_GPU_AND(Dnn);
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<ConvCase> cases = {
      KG_CONV_CASE(c.name = "3x3 pad 1", c.n = 2, c.c = 8, c.h = 12, c.w = 10, c.k = 16, c.kh = 3, c.kw = 3,
                   c.pad_h = 1, c.pad_w = 1, c.bias = true),
      KG_CONV_CASE(c.name = "3x3 pad 1, no bias", c.n = 1, c.c = 5, c.h = 9, c.w = 11, c.k = 7, c.kh = 3,
                   c.kw = 3, c.pad_h = 1, c.pad_w = 1),
      KG_CONV_CASE(c.name = "7x7 stride 2 pad 3", c.n = 2, c.c = 3, c.h = 32, c.w = 30, c.k = 8, c.kh = 7,
                   c.kw = 7, c.pad_h = 3, c.pad_w = 3, c.stride_h = 2, c.stride_w = 2, c.bias = true),
      KG_CONV_CASE(c.name = "1x1 stride 2", c.n = 2, c.c = 16, c.h = 9, c.w = 9, c.k = 8, c.stride_h = 2,
                   c.stride_w = 2),
      KG_CONV_CASE(c.name = "dilation 2", c.n = 1, c.c = 4, c.h = 11, c.w = 13, c.k = 6, c.kh = 3, c.kw = 3,
                   c.pad_h = 2, c.pad_w = 2, c.dil_h = 2, c.dil_w = 2, c.bias = true),
      KG_CONV_CASE(c.name = "groups 2", c.n = 2, c.c = 8, c.h = 10, c.w = 10, c.k = 12, c.kh = 3, c.kw = 3,
                   c.pad_h = 1, c.pad_w = 1, c.groups = 2, c.bias = true),
      KG_CONV_CASE(c.name = "depthwise stride 2", c.n = 2, c.c = 8, c.h = 13, c.w = 12, c.k = 8, c.kh = 3,
                   c.kw = 3, c.pad_h = 1, c.pad_w = 1, c.stride_h = 2, c.stride_w = 2, c.groups = 8,
                   c.bias = true),
      KG_CONV_CASE(c.name = "depthwise x2, no bias", c.n = 1, c.c = 4, c.h = 8, c.w = 8, c.k = 8, c.kh = 5,
                   c.kw = 5, c.pad_h = 2, c.pad_w = 2, c.groups = 4),
      KG_CONV_CASE(c.name = "3x5 asymmetric", c.n = 1, c.c = 6, c.h = 10, c.w = 15, c.k = 5, c.kh = 3,
                   c.kw = 5, c.pad_h = 1, c.pad_w = 2, c.stride_h = 2, c.stride_w = 1, c.bias = true),
  };
  for (ConvCase c : cases) {
    check_conv(ctx, vendor, c, rng);
    std::string tf = std::string(c.name) + ", tf32";
    c.name = tf.c_str();
    c.tf32 = true;
    c.tol = 2e-2;
    check_conv(ctx, vendor, c, rng);
  }
}

TEST(VendorGpu, ConvHalfBfloatAndDoubleMatchTheHost) {
  KG_REQUIRE_GPU_AND(Dnn);
  std::mt19937_64 rng(fresh_seed());
  const ConvCase base = KG_CONV_CASE(c.name = "", c.n = 2, c.c = 8, c.h = 10, c.w = 9, c.k = 16, c.kh = 3,
                                     c.kw = 3, c.pad_h = 1, c.pad_w = 1, c.bias = true);
  for (DType t : {DType::F16, DType::BF16, DType::F64}) {
    ConvCase c = base;
    const std::string name = std::string(kg::dtype_name(t)) + " 3x3";
    c.name = name.c_str();
    c.dtype = t;
    c.tol = t == DType::F64 ? 1e-12 : 2e-2;
    check_conv(ctx, vendor, c, rng);
  }
}

TEST(VendorGpu, ConvTunedKeepsAWorkingAlgorithm) {
  KG_REQUIRE_GPU_AND(Dnn);
  std::mt19937_64 rng(fresh_seed());
  check_conv(ctx, vendor,
             KG_CONV_CASE(c.name = "tuned", c.n = 4, c.c = 16, c.h = 20, c.w = 20, c.k = 32, c.kh = 3,
                          c.kw = 3, c.pad_h = 1, c.pad_w = 1, c.bias = true, c.tune = true),
             rng);
}

TEST(VendorGpu, ConvWithAWrongOutputShapeIsAnErrorNamingTheLabel) {
  KG_REQUIRE_GPU_AND(Dnn);
  const ConvCase c = KG_CONV_CASE(c.name = "wrong", c.n = 1, c.c = 3, c.h = 8, c.w = 8, c.k = 4, c.kh = 3,
                                  c.kw = 3, c.pad_h = 1, c.pad_w = 1);
  kg::Conv2dCall k = conv_call(c);
  kg::cuda::DeviceBuffer buf(ctx, 1 << 16);
  k.x = k.w = k.y = buf.ptr();
  k.out_height = 9;  // the convolution gives 8
  expect_error([&] { vendor.plan(k, {}, ctx.stream(), "[test.conv @ block.conv]"); },
               {"[test.conv @ block.conv]", "cuDNN", "[1, 4, 9, 8]", "[1, 4, 8, 8]"});
  k.out_height = 8;
  k.dtype = DType::I32;  // a dtype it does not take
  EXPECT_EQ(vendor.plan(k, {}, ctx.stream(), "[test.conv @ i32]"), nullptr);
}

// ---------------------------------------------------------------------------------------------
// Both plans replayed from a CUDA graph: run() neither allocates nor synchronises.

TEST(VendorGpu, PlansReplayInsideACudaGraph) {
  kg::cuda::Context* ctx_ptr = gpu();
  if (!ctx_ptr) GTEST_SKIP() << "no GPU: " << Driver::unavailable_reason();
  kg::cuda::Context& ctx = *ctx_ptr;
  const BlasLt* lt = BlasLt::get();
  const Dnn* dnn = Dnn::get();
  if (!lt || !dnn) GTEST_SKIP() << "cuBLASLt or cuDNN is not available";
  const Driver& d = ctx.driver();
  std::mt19937_64 rng(fresh_seed());

  kg::GemmCall g;
  g.m = 32, g.n = 24, g.k = 16, g.lda = 16, g.ldb = 24, g.ldc = 24;
  const auto a = random_values(rng, DType::F32, 32 * 16), b = random_values(rng, DType::F32, 16 * 24);
  auto da = upload(ctx, DType::F32, a), db = upload(ctx, DType::F32, b);
  auto dc = upload(ctx, DType::F32, std::vector<double>(32 * 24, kNaN));
  g.a = da.ptr(), g.b = db.ptr(), g.c = dc.ptr();
  auto gemm = lt->plan(g, {}, ctx.stream(), "[test.gemm @ graph]");
  ASSERT_NE(gemm, nullptr);

  const ConvCase cc = KG_CONV_CASE(c.name = "graph", c.n = 1, c.c = 4, c.h = 8, c.w = 8, c.k = 4, c.kh = 3,
                                   c.kw = 3, c.pad_h = 1, c.pad_w = 1, c.bias = true);
  kg::Conv2dCall k = conv_call(cc);
  const auto x = random_values(rng, DType::F32, 4 * 8 * 8), w = random_values(rng, DType::F32, 4 * 4 * 9);
  const auto bias = random_values(rng, DType::F32, 4);
  auto dx = upload(ctx, DType::F32, x), dw = upload(ctx, DType::F32, w),
       dbias = upload(ctx, DType::F32, bias);
  auto dy = upload(ctx, DType::F32, std::vector<double>(4 * 8 * 8, kNaN));
  k.x = dx.ptr(), k.w = dw.ptr(), k.y = dy.ptr(), k.bias = dbias.ptr();
  auto conv = dnn->plan(k, {}, ctx.stream(), "[test.conv @ graph]");
  ASSERT_NE(conv, nullptr);

  kg::cuda::DeviceBuffer ws(ctx,
                            std::max<std::size_t>({gemm->workspace_bytes(), conv->workspace_bytes(), 1}));
  CUgraph graph = nullptr;
  CUgraphExec exec = nullptr;
  d.check(d.cuStreamBeginCapture(ctx.stream(), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
  gemm->run(ctx.stream(), ws.ptr(), "[test.gemm @ graph]");
  conv->run(ctx.stream(), ws.ptr(), "[test.conv @ graph]");
  d.check(d.cuStreamEndCapture(ctx.stream(), &graph), "cuStreamEndCapture");
  d.check(d.cuGraphInstantiateWithFlags(&exec, graph, 0), "cuGraphInstantiateWithFlags");
  d.check(d.cuGraphLaunch(exec, ctx.stream()), "cuGraphLaunch");
  ctx.synchronize("graph");
  d.cuGraphExecDestroy(exec);
  d.cuGraphDestroy(graph);

  const auto c_got = download(ctx, DType::F32, dc.ptr(), 32 * 24);
  for (int i = 0; i < 32; ++i)
    for (int j = 0; j < 24; ++j) {
      double want = 0;
      for (int p = 0; p < 16; ++p) want += a[i * 16 + p] * b[p * 24 + j];
      ASSERT_NEAR(c_got[i * 24 + j], want, 1e-4) << "C[" << i << "][" << j << "]";
    }
  const auto y_got = download(ctx, DType::F32, dy.ptr(), 4 * 8 * 8);
  for (int o = 0; o < 4; ++o)
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 8; ++j) {
        double want = bias[o];
        for (int ci = 0; ci < 4; ++ci)
          for (int r = 0; r < 3; ++r)
            for (int s = 0; s < 3; ++s) {
              const int yy = i - 1 + r, xx = j - 1 + s;
              if (yy >= 0 && yy < 8 && xx >= 0 && xx < 8)
                want += x[(ci * 8 + yy) * 8 + xx] * w[((o * 4 + ci) * 3 + r) * 3 + s];
            }
        ASSERT_NEAR(y_got[(o * 8 + i) * 8 + j], want, 1e-4) << "y[" << o << "][" << i << "][" << j << "]";
      }
}

}  // namespace

#endif  // KG_HAVE_CUDA
