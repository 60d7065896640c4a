#include <algorithm>
#include <cmath>
#include <sstream>

#include "ops/resize.hpp"
#include "support/gpu_util.hpp"
#include "support/test_util.hpp"

using kg::ops::ResizeSpec;
using kg_test::fresh_seed;

namespace {

using Mode = ResizeSpec::Mode;

const std::vector<std::string> kCoords = {"half_pixel", "pytorch_half_pixel",   "align_corners",
                                          "asymmetric", "tf_half_pixel_for_nn", "half_pixel_symmetric"};
const std::vector<std::string> kNearestModes = {"round_prefer_floor", "round_prefer_ceil", "floor", "ceil"};

ResizeSpec spec_of(Mode mode, const std::string& coord, std::vector<double> scales,
                   std::vector<std::int64_t> sizes = {}, const std::string& nearest = "round_prefer_floor",
                   double a = -0.75, bool exclude = false) {
  ResizeSpec s;
  s.mode = mode;
  s.coordinate_transformation_mode = coord;
  s.nearest_mode = nearest;
  s.cubic_coeff_a = a;
  s.exclude_outside = exclude;
  s.scales = std::move(scales);
  s.sizes = std::move(sizes);
  return s;
}

std::string text(const ResizeSpec& s) {
  std::ostringstream os;
  os << (s.mode == Mode::Nearest  ? "nearest"
         : s.mode == Mode::Linear ? "linear"
                                  : "cubic")
     << " " << s.coordinate_transformation_mode << " " << s.nearest_mode << " a=" << s.cubic_coeff_a
     << " exclude_outside=" << s.exclude_outside << " scales=[";
  for (double v : s.scales) os << v << " ";
  os << "] sizes=[";
  for (auto v : s.sizes) os << v << " ";
  os << "]";
  return os.str();
}

// ---- the reference: ONNX's formulas, one output element at a time ----

// One dim as the reference sees it: lengths and the scale of the coordinates.
struct RefDim {
  std::int64_t in, out;
  double scale;
};

// x_original of output index o (the spec's formulas; align_corners divides by the real output
// length scale * in, as the ONNX reference does).
double ref_coord(const std::string& mode, std::int64_t o, const RefDim& d) {
  const double x = static_cast<double>(o), real_out = d.scale * static_cast<double>(d.in);
  if (mode == "half_pixel") return (x + 0.5) / d.scale - 0.5;
  if (mode == "pytorch_half_pixel") return d.out > 1 ? (x + 0.5) / d.scale - 0.5 : 0.0;
  if (mode == "align_corners")
    return real_out == 1.0 ? 0.0 : x * static_cast<double>(d.in - 1) / (real_out - 1.0);
  if (mode == "asymmetric") return x / d.scale;
  if (mode == "tf_half_pixel_for_nn") return (x + 0.5) / d.scale;
  EXPECT_EQ(mode, "half_pixel_symmetric");
  const double adjustment = static_cast<double>(d.out) / real_out, center = static_cast<double>(d.in) / 2.0;
  const double offset = center * (1.0 - adjustment);
  return offset + (x + 0.5) / d.scale - 0.5;
}

// Keys' cubic convolution kernel with parameter a, at distance t.
double keys(double t, double a) {
  t = std::abs(t);
  if (t <= 1) return (a + 2) * t * t * t - (a + 3) * t * t + 1;
  if (t < 2) return a * t * t * t - 5 * a * t * t + 8 * a * t - 4 * a;
  return 0;
}

// The `n` integer positions nearest to x, ties to the smaller one (the reference's neighbours
// in the edge-padded input), in increasing order.
std::vector<std::int64_t> nearest_positions(double x, int n) {
  std::vector<std::int64_t> c;
  for (auto i = static_cast<std::int64_t>(std::floor(x)) - n;
       i <= static_cast<std::int64_t>(std::floor(x)) + n; ++i)
    c.push_back(i);
  std::sort(c.begin(), c.end(), [&](std::int64_t a, std::int64_t b) {
    const double da = std::abs(x - static_cast<double>(a)), db = std::abs(x - static_cast<double>(b));
    return da != db ? da < db : a < b;
  });
  c.resize(static_cast<std::size_t>(n));
  std::sort(c.begin(), c.end());
  return c;
}

// The taps of output index o along one dim: clamped input indices and weights.
std::vector<std::pair<std::int64_t, double>> ref_taps(const ResizeSpec& s, std::int64_t o, const RefDim& d) {
  auto clamp = [&](std::int64_t i) { return std::clamp<std::int64_t>(i, 0, d.in - 1); };
  if (d.scale == 1.0 && d.out == d.in) return {{o, 1.0}};  // kept dims pass through
  const double x = ref_coord(s.coordinate_transformation_mode, o, d);
  if (s.mode == Mode::Nearest) {
    std::int64_t i;
    const std::string& m = s.nearest_mode;
    if (m == "floor")
      i = static_cast<std::int64_t>(std::floor(x));
    else if (m == "ceil")
      i = static_cast<std::int64_t>(std::ceil(x));
    else if (m == "round_prefer_floor")
      i = nearest_positions(x, 1)[0];
    else  // round_prefer_ceil: the nearest, ties to the larger
      i = std::abs(x - std::floor(x) - 0.5) == 0 ? static_cast<std::int64_t>(std::ceil(x))
                                                 : nearest_positions(x, 1)[0];
    return {{clamp(i), 1.0}};
  }
  const int n = s.mode == Mode::Linear ? 2 : 4;
  std::vector<std::pair<std::int64_t, double>> t;
  double sum = 0;
  for (std::int64_t i : nearest_positions(x, n)) {
    const double dist = x - static_cast<double>(i);
    double w = s.mode == Mode::Linear ? std::max(0.0, 1.0 - std::abs(dist)) : keys(dist, s.cubic_coeff_a);
    if (s.exclude_outside && (i < 0 || i >= d.in)) w = 0;
    sum += w;
    t.push_back({i, w});
  }
  for (auto& [i, w] : t) {
    i = clamp(i);
    if (s.exclude_outside) w /= sum;
  }
  return t;
}

// The output of the resize, every element the sum over one tap per dim of the taps' weight
// product times the input there, in double.
kg::Tensor naive_resize(const kg::Tensor& x, const ResizeSpec& s) {
  const std::size_t r = x.rank();
  std::vector<RefDim> dims(r);
  std::vector<std::int64_t> out_shape(r);
  for (std::size_t d = 0; d < r; ++d) {
    const std::int64_t in = x.dim(d);
    if (!s.scales.empty()) {
      dims[d] = {in, static_cast<std::int64_t>(std::floor(static_cast<double>(in) * s.scales[d])),
                 s.scales[d]};
    } else {
      const std::int64_t o = s.sizes[d] == -1 ? in : s.sizes[d];
      dims[d] = {in, o, static_cast<double>(o) / static_cast<double>(in)};
    }
    out_shape[d] = dims[d].out;
  }
  kg::Tensor y = kg::Tensor::empty(kg::DType::F64, out_shape);
  std::vector<std::int64_t> idx(r, 0), stride(r, 1);
  for (std::size_t d = r - 1; d-- > 0;) stride[d] = stride[d + 1] * x.dim(d + 1);
  for (std::int64_t e = 0; e < y.numel(); ++e) {
    std::int64_t rem = e;
    for (std::size_t d = r; d-- > 0;) {
      idx[d] = rem % out_shape[d];
      rem /= out_shape[d];
    }
    // Depth-first over the dims.
    std::function<double(std::size_t, std::int64_t, double)> sum = [&](std::size_t d, std::int64_t off,
                                                                       double w) {
      if (d == r) return w * x.item(off);
      double acc = 0;
      for (const auto& [i, wt] : ref_taps(s, idx[d], dims[d])) acc += sum(d + 1, off + i * stride[d], w * wt);
      return acc;
    };
    y.data<double>()[e] = sum(0, 0, 1.0);
  }
  return y;
}

// Records the resize on an input declared with a dynamic batch (dim 0 "batch") when the spec
// keeps dim 0, loads it for x's shape with poisoned buffers and runs it.
kg::Tensor run_resize(const kg::Tensor& x, const ResizeSpec& s) {
  auto g = kg::Graph::create();
  const bool keeps_dim0 = s.scales.empty() ? s.sizes.at(0) == -1 : s.scales.at(0) == 1.0;
  std::vector<kg::Dim> dims{keeps_dim0 ? kg::Dim::named("batch") : kg::Dim(x.dim(0))};
  for (std::size_t d = 1; d < x.rank(); ++d) dims.push_back(x.dim(d));
  auto y = kg::ops::resize(g->input(x.dtype(), kg::Shape(dims), "x"), s, "rs");
  kg::Model model(g, {y});
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  kg::Tensor out = model.load(kg::Device::cpu(), {x.shape()}, opt).forward({x})[0];
  EXPECT_TRUE(kg_test::all_written(out)) << "the resize left output elements unwritten";
  return out;
}

// Runs `s` on x and compares with the reference: nearest bitwise, else within the dtype's
// tolerance.
void expect_matches(const kg::Tensor& x, const ResizeSpec& s) {
  SCOPED_TRACE(text(s) + " input " + kg::sizes_to_string(x.shape()) + " " +
               std::string(kg::dtype_name(x.dtype())));
  const kg::Tensor want = naive_resize(x, s);
  const kg::Tensor got = run_resize(x, s);
  ASSERT_EQ(got.shape(), want.shape());
  if (s.mode == Mode::Nearest)
    EXPECT_TRUE(kg_test::all_close(got, want, 0, 1e-300));
  else if (x.dtype() == kg::DType::F32)
    EXPECT_TRUE(kg_test::all_close(got, want, 1e-6, 1e-6));
  else
    EXPECT_TRUE(kg_test::all_close(got, want, 1e-13, 1e-13));
}

double f32(double v) { return static_cast<double>(static_cast<float>(v)); }  // ONNX scales are float

}  // namespace

TEST(Resize, ShapeInference) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, 5, 7});
  auto y = kg::ops::resize(x, spec_of(Mode::Linear, "half_pixel", {1, 1, 2, 1.5}), "up");
  // floor(7 * 1.5) = 10.
  EXPECT_EQ(y.shape().to_string(), "[batch, 3, 10, 10]");
  const kg::Node& node = g->node(y.node());
  EXPECT_EQ(node.op->name(), "nn.resize");
  EXPECT_TRUE(node.params.empty());
  EXPECT_EQ(node.op->op().attributes(),
            "mode=linear coordinate_transformation_mode=half_pixel scales=[1, 1, 2, 1.5]");
  EXPECT_EQ(y.dtype(), kg::DType::F32);
  // Down: floor(5 * 0.5) = 2, floor(7 * 0.3) = 2.
  EXPECT_EQ(kg::ops::resize(x, spec_of(Mode::Nearest, "asymmetric", {1, 1, 0.5, 0.3})).shape().to_string(),
            "[batch, 3, 2, 2]");
  // Sizes: -1 keeps a dim (dynamic or not); a static dim may be given its own size.
  auto z =
      kg::ops::resize(x, spec_of(Mode::Cubic, "align_corners", {}, {-1, 3, 4, -1}, "floor", -0.5, true), "z");
  EXPECT_EQ(z.shape().to_string(), "[batch, 3, 4, 7]");
  EXPECT_EQ(g->node(z.node()).op->op().attributes(),
            "mode=cubic coordinate_transformation_mode=align_corners cubic_coeff_a=-0.5 exclude_outside=1 "
            "sizes=[-1, 3, 4, -1]");
  auto n = kg::ops::resize(x, spec_of(Mode::Nearest, "half_pixel", {}, {-1, -1, 1, 9}, "ceil"), "n");
  EXPECT_EQ(n.shape().to_string(), "[batch, 3, 1, 9]");
  EXPECT_EQ(g->node(n.node()).op->op().attributes(),
            "mode=nearest coordinate_transformation_mode=half_pixel nearest_mode=ceil sizes=[-1, -1, 1, 9]");
  // Anonymous dynamic dims, any rank, f64.
  auto [d, g2] = kg::SymTensor::input(kg::DType::F64, {kg::dynamic, kg::dynamic, 4});
  auto dz = kg::ops::resize(d, spec_of(Mode::Linear, "asymmetric", {1, 1, 2.5}));
  EXPECT_EQ(dz.shape().to_string(), "[?, ?, 10]");
  EXPECT_EQ(dz.dtype(), kg::DType::F64);
  auto [v, g3] = kg::SymTensor::input(kg::DType::F32, {6});
  EXPECT_EQ(kg::ops::resize(v, spec_of(Mode::Cubic, "half_pixel", {0.5})).shape().to_string(), "[3]");
  auto [f, g4] = kg::SymTensor::input(kg::DType::F32, {1, 2, 3, 4, 5, 6, 7, 8});
  EXPECT_EQ(kg::ops::resize(f, spec_of(Mode::Nearest, "half_pixel", {}, {2, -1, -1, -1, -1, -1, -1, 4}))
                .shape()
                .to_string(),
            "[2, 2, 3, 4, 5, 6, 7, 4]");
  // The concrete shape at load, and the op on its own.
  auto op = kg::ops::resize_op(spec_of(Mode::Linear, "half_pixel", {1, 1, 2, 2}));
  EXPECT_EQ(op->infer_output_shape({kg::Shape{2, 3, 5, 7}}).to_string(), "[2, 3, 10, 14]");
  EXPECT_EQ(op->infer_output_dtype({kg::DType::F64}), kg::DType::F64);
}

TEST(Resize, RejectsBadInputs) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, 5, 7});
  const std::string at = "[nn.resize @ rs]";
  auto rs = [&](const ResizeSpec& s) { kg::ops::resize(x, s, "rs"); };
  kg_test::expect_error(
      [&] {
        rs(spec_of(Mode::Linear, "half_pixel", {1, 1, 2}));
      },
      {at, "has 3 scales for the 4-D input [batch, 3, 5, 7]; it needs one per dim"});
  kg_test::expect_error(
      [&] {
        rs(spec_of(Mode::Linear, "half_pixel", {}, {-1, -1, 2, 2, 2}));
      },
      {at, "has 5 sizes for the 4-D input [batch, 3, 5, 7]"});
  kg_test::expect_error([&] { rs(spec_of(Mode::Linear, "half_pixel", {})); },
                        {at, "needs scales or sizes, got neither"});
  kg_test::expect_error(
      [&] {
        rs(spec_of(Mode::Linear, "half_pixel", {1, 1, 2, 2}, {-1, -1, 10, 14}));
      },
      {at, "takes scales or sizes, not both (scales [1, 1, 2, 2], sizes [-1, -1, 10, 14])"});
  kg_test::expect_error(
      [&] {
        rs(spec_of(Mode::Linear, "half_pixel", {1, 1, 0, 2}));
      },
      {at, "scale 0 of dim 2 must be positive and finite (scales [1, 1, 0, 2])"});
  kg_test::expect_error(
      [&] {
        rs(spec_of(Mode::Linear, "half_pixel", {1, 1, -2, 2}));
      },
      {at, "scale -2 of dim 2 must be positive and finite"});
  kg_test::expect_error(
      [&] {
        rs(spec_of(Mode::Linear, "half_pixel", {1, 1, 2, std::nan("")}));
      },
      {at, "scale nan of dim 3 must be positive and finite"});
  kg_test::expect_error(
      [&] {
        rs(spec_of(Mode::Linear, "half_pixel", {1, 1, 2, HUGE_VAL}));
      },
      {at, "scale inf of dim 3 must be positive and finite"});
  kg_test::expect_error(
      [&] {
        rs(spec_of(Mode::Linear, "half_pixel", {}, {-1, -1, 0, 4}));
      },
      {at, "size 0 of dim 2 must be positive, or -1 to keep the input's (sizes [-1, -1, 0, 4])"});
  kg_test::expect_error(
      [&] {
        rs(spec_of(Mode::Linear, "half_pixel", {}, {-1, -1, 4, -3}));
      },
      {at, "size -3 of dim 3 must be positive, or -1"});
  // Only kept dims may be dynamic.
  kg_test::expect_error(
      [&] {
        rs(spec_of(Mode::Linear, "half_pixel", {2, 1, 2, 2}));
      },
      {at,
       "dim 0 of the input [batch, 3, 5, 7] is dynamic but its scale is 2; only a dim kept at its size "
       "(scale 1) may be dynamic"});
  kg_test::expect_error(
      [&] {
        rs(spec_of(Mode::Linear, "half_pixel", {}, {4, -1, 2, 2}));
      },
      {at,
       "dim 0 of the input [batch, 3, 5, 7] is dynamic but its size is 4; only a dim kept at its size "
       "(size -1) may be dynamic"});
  kg_test::expect_error(
      [&] {
        rs(spec_of(Mode::Linear, "tf_crop_and_resize", {1, 1, 2, 2}));
      },
      {at,
       "coordinate_transformation_mode 'tf_crop_and_resize' is not supported: it needs the roi input and "
       "extrapolation_value"});
  kg_test::expect_error(
      [&] {
        rs(spec_of(Mode::Linear, "half-pixel", {1, 1, 2, 2}));
      },
      {at,
       "coordinate_transformation_mode 'half-pixel' is not one of half_pixel, pytorch_half_pixel, "
       "align_corners, asymmetric, tf_half_pixel_for_nn, half_pixel_symmetric"});
  kg_test::expect_error(
      [&] {
        rs(spec_of(Mode::Nearest, "half_pixel", {1, 1, 2, 2}, {}, "round"));
      },
      {at, "nearest_mode 'round' is not one of round_prefer_floor, round_prefer_ceil, floor, ceil"});
  kg_test::expect_error(
      [&] {
        rs(spec_of(Mode::Cubic, "half_pixel", {1, 1, 2, 2}, {}, "floor", std::nan("")));
      },
      {at, "cubic_coeff_a must be finite, got nan"});
  kg_test::expect_error(
      [&] {
        rs(spec_of(static_cast<Mode>(7), "half_pixel", {1, 1, 2, 2}));
      },
      {at, "mode 7 is not Nearest, Linear or Cubic"});

  auto [s, g1] = kg::SymTensor::input(kg::DType::F32, kg::Shape{});
  kg_test::expect_error([&] { kg::ops::resize(s, spec_of(Mode::Linear, "half_pixel", {}, {}), "rs"); },
                        {at, "needs scales or sizes, got neither"});
  kg_test::expect_error([&] { kg::ops::resize(s, spec_of(Mode::Linear, "half_pixel", {2}), "rs"); },
                        {at, "expects an input of rank >= 1, got a scalar []"});
  auto [big, g2] = kg::SymTensor::input(kg::DType::F32, {1, 1, 1, 1, 1, 1, 1, 1, 2});
  kg_test::expect_error(
      [&] {
        kg::ops::resize(big, spec_of(Mode::Linear, "half_pixel", {1, 1, 1, 1, 1, 1, 1, 1, 2}), "rs");
      },
      {at, "supports inputs of rank 1 to 8, got 9-D [1, 1, 1, 1, 1, 1, 1, 1, 2]"});
  auto [e, g3] = kg::SymTensor::input(kg::DType::F32, {2, 0, 3});
  kg_test::expect_error(
      [&] {
        kg::ops::resize(e, spec_of(Mode::Linear, "half_pixel", {}, {-1, 4, -1}), "rs");
      },
      {at, "dim 1 of the input [2, 0, 3] is empty but its output size is 4: there is nothing to sample"});
  auto [i, g4] = kg::SymTensor::input(kg::DType::I64, {2, 3});
  kg_test::expect_error(
      [&] {
        kg::ops::resize(i, spec_of(Mode::Nearest, "half_pixel", {1, 2}), "rs");
      },
      {at, "supports f32 and f64 inputs, got i64"});
}

// ONNX's own test cases (onnx/backend/test/case/node/resize.py): inputs, scales (float32) or
// sizes, and the expected outputs as its reference computes them.
TEST(Resize, MatchesOnnxTestCases) {
  auto iota = [](std::vector<std::int64_t> shape) {
    kg::Tensor t = kg::Tensor::empty(kg::DType::F32, std::move(shape));
    for (std::int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(i + 1);
    return t;
  };
  struct Case {
    const char* name;
    kg::Tensor x;
    ResizeSpec spec;
    std::vector<double> want;
  };
  const double s06 = f32(0.6), s08 = f32(0.8);
  const std::vector<Case> cases = {
      {"upsample_scales_nearest",
       iota({1, 1, 2, 2}),
       spec_of(Mode::Nearest, "half_pixel", {1, 1, 2, 3}),
       {1, 1, 1, 2, 2, 2, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 3, 3, 3, 4, 4, 4}},
      {"downsample_scales_nearest",
       iota({1, 1, 2, 4}),
       spec_of(Mode::Nearest, "half_pixel", {1, 1, s06, s06}),
       {1, 3}},
      {"downsample_sizes_nearest",
       iota({1, 1, 2, 4}),
       spec_of(Mode::Nearest, "half_pixel", {}, {1, 1, 1, 3}),
       {1, 2, 4}},
      {"upsample_sizes_nearest_round_prefer_ceil_asymmetric",
       iota({1, 1, 4, 4}),
       spec_of(Mode::Nearest, "asymmetric", {}, {1, 1, 8, 8}, "round_prefer_ceil"),
       {1,  2,  2,  3,  3,  4,  4,  4,  5,  6,  6,  7,  7,  8,  8,  8,  5,  6,  6,  7,  7,  8,
        8,  8,  9,  10, 10, 11, 11, 12, 12, 12, 9,  10, 10, 11, 11, 12, 12, 12, 13, 14, 14, 15,
        15, 16, 16, 16, 13, 14, 14, 15, 15, 16, 16, 16, 13, 14, 14, 15, 15, 16, 16, 16}},
      {"downsample_scales_linear",
       iota({1, 1, 2, 4}),
       spec_of(Mode::Linear, "half_pixel", {1, 1, s06, s06}),
       {2.6666665077209473, 4.3333330154418945}},
      // The real output length 2.4 in the divisor: 1 * 3 / 1.4 = 2.142857.
      {"downsample_scales_linear_align_corners",
       iota({1, 1, 2, 4}),
       spec_of(Mode::Linear, "align_corners", {1, 1, s06, s06}),
       {1.0, 3.142857074737549}},
      {"downsample_sizes_linear_pytorch_half_pixel",
       iota({1, 1, 4, 4}),
       spec_of(Mode::Linear, "pytorch_half_pixel", {}, {1, 1, 3, 1}),
       {1.6666666269302368, 7.0, 12.333333015441895}},
      {"downsample_scales_linear_half_pixel_symmetric",
       iota({1, 1, 1, 4}),
       spec_of(Mode::Linear, "half_pixel_symmetric", {1, 1, 1, s06}),
       {1.6666667461395264, 3.3333332538604736}},
      {"downsample_scales_cubic_A_n0p5_exclude_outside",
       iota({1, 1, 4, 4}),
       spec_of(Mode::Cubic, "half_pixel", {1, 1, s08, s08}, {}, "round_prefer_floor", -0.5, true),
       {1.3681267499923706, 2.669501304626465, 4.013336658477783, 6.573625087738037, 7.875, 9.21883487701416,
        11.948966026306152, 13.250341415405273, 14.594176292419434}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const kg::Tensor got = run_resize(c.x, c.spec);
    ASSERT_EQ(got.numel(), static_cast<std::int64_t>(c.want.size()));
    EXPECT_TRUE(kg_test::matches(got, c.want, 1e-6, 1e-6));
    // The reference of this file agrees.
    EXPECT_TRUE(kg_test::matches(naive_resize(c.x, c.spec).to(kg::DType::F32), c.want, 1e-6, 1e-6));
  }
}

TEST(Resize, NearestMatchesReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // Up by integers (ties under asymmetric), up and down by float scales, and sizes.
  const std::vector<std::pair<std::vector<double>, std::vector<std::int64_t>>> resizes = {
      {{1, 1, 2, 3}, {}},
      {{1, 1, f32(1.7), f32(2.5)}, {}},
      {{1, 1, f32(0.6), f32(0.45)}, {}},
      {{}, {-1, -1, 7, 3}},
      {{}, {-1, 1, 1, 12}},
  };
  int k = 0;
  for (const std::string& nm : kNearestModes)
    for (const std::string& coord : kCoords)
      for (const auto& [scales, sizes] : resizes) {
        const kg::DType dt = ++k % 2 ? kg::DType::F32 : kg::DType::F64;
        kg::Tensor x = kg_test::random_tensor(rng, dt, {k % 3 + 1, 2, 5, 6});
        expect_matches(x, spec_of(Mode::Nearest, coord, scales, sizes, nm));
      }
}

TEST(Resize, LinearMatchesReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<std::pair<std::vector<double>, std::vector<std::int64_t>>> resizes = {
      {{1, 1, 2, 2}, {}},
      {{1, 1, f32(1.3), f32(3.0)}, {}},
      {{1, 1, f32(0.6), f32(0.75)}, {}},
      {{}, {-1, -1, 9, 4}},
      {{}, {-1, 3, 1, 2}},
  };
  for (const std::string& coord : kCoords)
    for (const auto& [scales, sizes] : resizes)
      for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
        kg::Tensor x = kg_test::random_tensor(rng, dt, {3, 3, 5, 6});
        expect_matches(x, spec_of(Mode::Linear, coord, scales, sizes));
      }
  // exclude_outside changes no linear weight inside the input.
  kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F64, {2, 2, 4, 5});
  expect_matches(x, spec_of(Mode::Linear, "half_pixel", {1, 1, 2.5, 0.5}, {}, "floor", -0.75, true));
}

TEST(Resize, CubicMatchesReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<std::pair<std::vector<double>, std::vector<std::int64_t>>> resizes = {
      {{1, 1, 2, 3}, {}},
      {{1, 1, f32(0.8), f32(0.6)}, {}},
      {{}, {-1, -1, 11, 3}},
      {{}, {-1, -1, 1, 7}},  // pytorch_half_pixel samples 0 for a length of 1
  };
  int k = 0;
  for (double a : {-0.75, -0.5})
    for (bool exclude : {false, true})
      for (const std::string& coord : kCoords)
        for (const auto& [scales, sizes] : resizes) {
          const kg::DType dt = ++k % 2 ? kg::DType::F32 : kg::DType::F64;
          kg::Tensor x = kg_test::random_tensor(rng, dt, {2, 2, 6, 5});
          expect_matches(x, spec_of(Mode::Cubic, coord, scales, sizes, "round_prefer_floor", a, exclude));
        }
}

// Resized dims anywhere, in ranks 1 to 5; kept dims (scale 1) pass through in every mode.
TEST(Resize, AnyRankMatchesReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    std::vector<std::int64_t> shape;
    ResizeSpec spec;
  };
  const std::vector<Case> cases = {
      {{7}, spec_of(Mode::Linear, "half_pixel", {f32(2.3)})},
      {{9}, spec_of(Mode::Cubic, "align_corners", {}, {4})},
      {{4, 6}, spec_of(Mode::Nearest, "asymmetric", {2, 0.5}, {}, "round_prefer_ceil")},
      {{3, 4, 5}, spec_of(Mode::Cubic, "half_pixel", {f32(1.5), f32(0.75), 2})},
      {{3, 4, 5}, spec_of(Mode::Linear, "pytorch_half_pixel", {}, {5, 2, 8})},
      {{2, 3, 4, 3, 4}, spec_of(Mode::Linear, "half_pixel", {1, 2, 1, f32(0.7), 1.5})},
      {{2, 3, 4, 3, 4}, spec_of(Mode::Nearest, "tf_half_pixel_for_nn", {1, 1, 2, 1, 0.5}, {}, "ceil")},
      {{4, 5, 3}, spec_of(Mode::Linear, "tf_half_pixel_for_nn", {1, 1, 1})},
  };
  for (const Case& c : cases)
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64})
      expect_matches(kg_test::random_tensor(rng, dt, c.shape), c.spec);
  // A kept dim is copied even where its mode would move it (tf_half_pixel_for_nn with ceil).
  kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {3, 4, 2});
  const kg::Tensor y = run_resize(x, spec_of(Mode::Nearest, "tf_half_pixel_for_nn", {1, 1, 1}, {}, "ceil"));
  EXPECT_TRUE(kg_test::all_close(y, x, 0, 1e-300));
}

// check_op: shapes at several batch sizes, the CPU against the reference, the kernel under the
// emulator (checked mode, both thread orders) and on a GPU when there is one.
TEST(Resize, CheckOpWithEmulatedKernel) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<ResizeSpec> specs = {
      spec_of(Mode::Nearest, "asymmetric", {1, 1, 2, f32(1.5)}, {}, "round_prefer_ceil"),
      spec_of(Mode::Nearest, "half_pixel", {}, {-1, -1, 2, 7}, "floor"),
      spec_of(Mode::Linear, "align_corners", {1, 1, f32(0.6), 2}),
      spec_of(Mode::Linear, "half_pixel_symmetric", {}, {-1, 2, 5, 3}),
      spec_of(Mode::Cubic, "half_pixel", {1, 1, 2, f32(0.8)}, {}, "round_prefer_floor", -0.5, true),
      spec_of(Mode::Cubic, "pytorch_half_pixel", {}, {-1, -1, 1, 6}),
  };
  for (const ResizeSpec& s : specs)
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      SCOPED_TRACE(text(s) + " " + std::string(kg::dtype_name(dt)));
      kg::testing::CheckOpOptions o;
      o.seed = seed;
      o.batch_sizes = {1, 3};
      o.rtol = dt == kg::DType::F32 ? 1e-6 : 1e-13;
      o.atol = dt == kg::DType::F32 ? 1e-6 : 1e-13;
      o.reference = [&](const std::vector<kg::Tensor>& in, const std::map<std::string, kg::Tensor>&) {
        return naive_resize(in[0], s);
      };
      auto r = kg::testing::check_op(kg::ops::resize_op(s), {{kg::Dim::named("n"), 3, 4, 5}}, {dt}, o);
      EXPECT_TRUE(r.ok) << r.to_string();
      EXPECT_EQ(kg_test::count_lines(r, "PASS batch 3, emulator"), 1) << r.to_string();
      EXPECT_EQ(kg_test::count_lines(r, "PASS batch 3, reference"), 1) << r.to_string();
    }
}

// The kernel compiled with NVRTC for sm_90 where NVRTC is present (its launches checked against
// the PTX), emulated against the CPU, and run on a GPU when there is one, on larger shapes.
TEST(Resize, LowersForTheGpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<std::pair<std::vector<std::int64_t>, ResizeSpec>> cases = {
      {{2, 3, 17, 23}, spec_of(Mode::Nearest, "asymmetric", {1, 1, 2, 2}, {}, "floor")},
      {{2, 3, 17, 23}, spec_of(Mode::Linear, "half_pixel", {}, {-1, -1, 30, 9})},
      {{2, 3, 17, 23}, spec_of(Mode::Cubic, "align_corners", {1, 1, f32(1.5), f32(0.7)})},
      {{3, 40, 2, 5, 6}, spec_of(Mode::Linear, "pytorch_half_pixel", {1, 1, 2, f32(0.5), 3})},
  };
  for (const auto& [shape, s] : cases)
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      SCOPED_TRACE(text(s) + " " + std::string(kg::dtype_name(dt)));
      kg_test::check_lowering(
          [&](const std::vector<kg::SymTensor>& xs) {
            return std::vector<kg::SymTensor>{kg::ops::resize(xs[0], s)};
          },
          {kg_test::random_tensor(rng, dt, shape)}, dt == kg::DType::F32 ? 1e-6 : 1e-13,
          dt == kg::DType::F32 ? 1e-6 : 1e-13);
    }
}
