#include <cstring>
#include <limits>

#include "compile/compiler.hpp"
#include "lower/dry_run.hpp"
#include "support/gpu_util.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

constexpr std::int64_t kEnd = std::numeric_limits<std::int64_t>::max();

// Element-for-element equality (copies must be exact).
::testing::AssertionResult same_values(const kg::Tensor& got, const kg::Tensor& want) {
  if (got.shape() != want.shape())
    return ::testing::AssertionFailure() << "shape " << kg::sizes_to_string(got.shape()) << " vs expected "
                                         << kg::sizes_to_string(want.shape());
  for (std::int64_t i = 0; i < got.numel(); ++i)
    if (!(got.item(i) == want.item(i)))
      return ::testing::AssertionFailure()
             << "element " << i << ": got " << got.item(i) << ", expected " << want.item(i);
  return ::testing::AssertionSuccess();
}

std::string shape_after(const kg::Shape& in, const std::function<kg::SymTensor(const kg::SymTensor&)>& op) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, in);
  return op(x).shape().to_string();
}

// Output of permuting `x` by `perm` (output dim i is input dim perm[i]), element by element.
kg::Tensor naive_permute(const kg::Tensor& x, const std::vector<std::size_t>& perm) {
  const auto& s = x.shape();
  const std::size_t r = s.size();
  std::vector<std::int64_t> os(r);
  for (std::size_t i = 0; i < r; ++i) os[i] = s[perm[i]];
  kg::Tensor y = kg::Tensor::empty(kg::DType::F64, os);
  std::vector<std::int64_t> idx(r, 0), in_idx(r);
  for (std::int64_t flat = 0; flat < y.numel(); ++flat) {
    std::int64_t rem = flat;
    for (std::size_t i = r; i-- > 0;) {
      idx[i] = rem % os[i];
      rem /= os[i];
    }
    for (std::size_t i = 0; i < r; ++i) in_idx[perm[i]] = idx[i];
    std::int64_t src = 0;
    for (std::size_t i = 0; i < r; ++i) src = src * s[i] + in_idx[i];
    y.data<double>()[flat] = x.item(src);
  }
  return y;
}

// Python's slice of range(size): the taken indices, by stepping from the normalised start.
std::vector<std::int64_t> python_slice(std::int64_t size, std::int64_t start, std::int64_t end,
                                       std::int64_t step) {
  auto norm = [&](std::int64_t v) {
    if (v < 0) v = std::max<std::int64_t>(v + size, 0);
    return std::min(v, size);
  };
  std::vector<std::int64_t> out;
  for (std::int64_t i = norm(start); i < norm(end); i += step) out.push_back(i);
  return out;
}

kg::Tensor naive_slice(const kg::Tensor& x, std::size_t d, const std::vector<std::int64_t>& take) {
  auto s = x.shape();
  std::int64_t outer = 1, inner = 1;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i < d) outer *= s[i];
    if (i > d) inner *= s[i];
  }
  const std::int64_t size = s[d];
  s[d] = static_cast<std::int64_t>(take.size());
  kg::Tensor y = kg::Tensor::empty(kg::DType::F64, s);
  std::int64_t at = 0;
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t t : take)
      for (std::int64_t j = 0; j < inner; ++j) y.data<double>()[at++] = x.item((o * size + t) * inner + j);
  return y;
}

kg::Tensor naive_concat(const std::vector<kg::Tensor>& xs, std::size_t d) {
  auto s = xs[0].shape();
  std::int64_t outer = 1, inner = 1, total = 0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i < d) outer *= s[i];
    if (i > d) inner *= s[i];
  }
  for (const auto& t : xs) total += t.shape()[d];
  s[d] = total;
  kg::Tensor y = kg::Tensor::empty(kg::DType::F64, s);
  std::int64_t at = 0;
  for (std::int64_t o = 0; o < outer; ++o)
    for (const auto& t : xs)
      for (std::int64_t j = 0; j < t.shape()[d] * inner; ++j)
        y.data<double>()[at++] = t.item(o * t.shape()[d] * inner + j);
  return y;
}

// Integer tensor with distinct values, to check exact copies of non-float dtypes.
kg::Tensor iota_i64(std::vector<std::int64_t> shape, std::int64_t base) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(kg::numel_of(shape)));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = base + static_cast<std::int64_t>(i) * 3;
  return kg::Tensor::from_vector<std::int64_t>(std::move(shape), v);
}

// Random values of an integer dtype (i8, i16, i32, i64, u8), to check copies by element width.
kg::Tensor random_ints(std::mt19937_64& rng, kg::DType dt, const std::vector<std::int64_t>& shape) {
  auto fill = [&](auto zero) {
    using T = decltype(zero);
    std::uniform_int_distribution<std::int64_t> u(std::is_signed_v<T> ? -100 : 0, 100);
    std::vector<T> v(static_cast<std::size_t>(kg::numel_of(shape)));
    for (T& e : v) e = static_cast<T>(u(rng));
    return kg::Tensor::from_vector<T>(shape, v);
  };
  switch (dt) {
    case kg::DType::U8:
      return fill(std::uint8_t{});
    case kg::DType::I16:
      return fill(std::int16_t{});
    case kg::DType::I32:
      return fill(std::int32_t{});
    case kg::DType::I64:
      return fill(std::int64_t{});
    default:
      ADD_FAILURE() << "random_ints: " << kg::dtype_name(dt);
      return kg::Tensor{};
  }
}

// Every element width the copy kernels have (1, 2, 4 and 8 bytes), floats and integers.
const kg::DType kEveryWidth[] = {kg::DType::U8,  kg::DType::I16, kg::DType::F32,
                                 kg::DType::I32, kg::DType::F64, kg::DType::I64};

kg::Tensor random_of(std::mt19937_64& rng, kg::DType dt, const std::vector<std::int64_t>& shape) {
  return kg::is_floating(dt) ? kg_test::random_tensor(rng, dt, shape) : random_ints(rng, dt, shape);
}

const char* width_suffix(kg::DType dt) {
  switch (kg::dtype_size(dt)) {
    case 1:
      return "_u8";
    case 2:
      return "_u16";
    case 4:
      return "_u32";
    default:
      return "_u64";
  }
}

// The dry run of `outputs` recorded on inputs of the given shapes (nullopt without NVRTC).
std::optional<kg::lower::DryRun> dry_run_of(const std::shared_ptr<kg::Graph>& g,
                                            const std::vector<kg::SymTensor>& outputs,
                                            const std::vector<std::vector<std::int64_t>>& shapes) {
  if (!kg::compile::Compiler::available()) return std::nullopt;
  return kg::lower::dry_run(kg::Model(g, outputs), shapes, 90);
}

}  // namespace

// ---- flatten ----

TEST(Flatten, ShapeInference) {
  const kg::Dim B = kg::Dim::named("batch");
  auto flat = [](std::int64_t s, std::int64_t e) {
    return [=](const kg::SymTensor& t) { return kg::flatten(t, s, e); };
  };
  EXPECT_EQ(shape_after({B, 3, 4, 5}, flat(1, -1)), "[batch, 60]");
  EXPECT_EQ(shape_after({B, 3, 4, 5}, flat(0, -1)), "[?]");
  EXPECT_EQ(shape_after({B, 3, 4, 5}, flat(1, 2)), "[batch, 12, 5]");
  EXPECT_EQ(shape_after({B, 3, 4, 5}, flat(-2, -1)), "[batch, 3, 20]");
  EXPECT_EQ(shape_after({B, 3, 4, 5}, flat(2, 2)), "[batch, 3, 4, 5]");
  EXPECT_EQ(shape_after({B, 1, 4}, flat(0, 1)), "[batch, 4]");
  EXPECT_EQ(shape_after({2, kg::dynamic, 4}, flat(1, 2)), "[2, ?]");
  EXPECT_EQ(shape_after(kg::Shape{}, flat(0, -1)), "[1]");
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {B, 3, 4});
  EXPECT_EQ(g->node(kg::flatten(x, 1, -1, "f").node()).op_name(), "nn.flatten");
}

TEST(Flatten, RejectsBadDims) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 3, 4});
  kg_test::expect_error([&] { kg::flatten(x, 2, 1, "f"); },
                        {"[nn.flatten @ f]", "start_dim 2", "end_dim 1", "[?, 3, 4]"});
  kg_test::expect_error([&] { kg::flatten(x, 3, -1, "f"); }, {"[nn.flatten @ f]", "start_dim 3", "rank 3"});
  kg_test::expect_error([&] { kg::flatten(x, 0, -4, "f"); }, {"[nn.flatten @ f]", "end_dim -4", "rank 3"});
}

// ---- reshape ----

TEST(Reshape, ShapeInference) {
  const kg::Dim B = kg::Dim::named("batch");
  auto rs = [](std::vector<std::int64_t> s) {
    return [=](const kg::SymTensor& t) { return kg::reshape(t, s); };
  };
  EXPECT_EQ(shape_after({2, 3, 4}, rs({4, -1})), "[4, 6]");
  EXPECT_EQ(shape_after({2, 3, 4}, rs({-1})), "[24]");
  EXPECT_EQ(shape_after({2, 3, 4}, rs({0, 0, 2, 2})), "[2, 3, 2, 2]");
  EXPECT_EQ(shape_after({2, 3, 4}, rs({0, -1, 2})), "[2, 6, 2]");
  EXPECT_EQ(shape_after({B, 3, 4}, rs({-1, 12})), "[batch, 12]");
  EXPECT_EQ(shape_after({B, 3, 4}, rs({0, -1})), "[batch, 12]");
  EXPECT_EQ(shape_after({B, 3, 4}, rs({0, 2, 6})), "[batch, 2, 6]");
  EXPECT_EQ(shape_after({B, 3, 4}, rs({-1})), "[?]");
  EXPECT_EQ(shape_after({B, 3, 4}, rs({-1, 6})), "[?, 6]");
  EXPECT_EQ(shape_after({B, 3, 4}, rs({-1, 5})), "[?, 5]");
  EXPECT_EQ(shape_after({B, 3, kg::dynamic}, rs({0, 0, -1})), "[batch, 3, ?]");
  EXPECT_EQ(shape_after({B, 3, kg::dynamic}, rs({0, -1, 1})), "[batch, ?, 1]");
  EXPECT_EQ(shape_after(kg::Shape{}, rs({1, 1})), "[1, 1]");
  EXPECT_EQ(shape_after({1, 1}, rs({})), "[]");
}

TEST(Reshape, RejectsBadSizes) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {2, 3, 4});
  kg_test::expect_error(
      [&] {
        kg::reshape(x, {-1, 2, -1}, "r");
      },
      {"[nn.reshape @ r]", "two -1", "[-1, 2, -1]"});
  kg_test::expect_error(
      [&] {
        kg::reshape(x, {5, -1}, "r");
      },
      {"[nn.reshape @ r]", "[2, 3, 4]", "[5, -1]", "24", "5"});
  kg_test::expect_error(
      [&] {
        kg::reshape(x, {5, 5}, "r");
      },
      {"[nn.reshape @ r]", "[5, 5]", "24 elements vs 25"});
  kg_test::expect_error([&] { kg::reshape(x, {24, -2}, "r"); }, {"[nn.reshape @ r]", "invalid entry -2"});
  kg_test::expect_error(
      [&] {
        kg::reshape(x, {1, 2, 3, 0}, "r");
      },
      {"[nn.reshape @ r]", "copy dim 3", "rank 3"});
  auto [z, g2] = kg::SymTensor::input(kg::DType::F32, {2, 0});
  kg_test::expect_error([&] { kg::reshape(z, {-1, 0}, "r"); }, {"[nn.reshape @ r]", "multiply to 0"});
  EXPECT_EQ(kg::reshape(z, {0, -1}).shape().to_string(), "[2, 0]");
  auto [d, g3] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 4});
  kg_test::expect_error([&] { kg::reshape(d, {-1, -1}, "r"); }, {"[nn.reshape @ r]", "two -1"});
  // Unknown until load, then wrong.
  auto [y, g4] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 3, 4}, "x");
  kg::Model model(g4, {kg::reshape(y, {-1, 5}, "r")});
  kg_test::expect_error(
      [&] {
        model.load(kg::Device::cpu(), {{2, 3, 4}});
      },
      {"[nn.reshape @ r]", "at load", "[2, 3, 4]", "24 elements are not divisible by 5"});
  EXPECT_NO_THROW(model.load(kg::Device::cpu(), {{5, 3, 4}}));
}

TEST(Reshape, ViewsKeepTheBytes) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t batch : {1, 7, 64}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      SCOPED_TRACE(::testing::Message() << "batch " << batch << " " << kg::dtype_name(dt));
      kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, 3, 4, 5});
      // A relu-free chain of views must reproduce the input element for element; a following
      // softmax makes the view an intermediate value, not a model output.
      auto outs = kg_test::run_graph(
          [](const std::vector<kg::SymTensor>& xs) {
            auto r = kg::reshape(xs[0], {0, -1, 5}, "r");
            auto f = kg::flatten(r, 1, -1, "f");
            return std::vector<kg::SymTensor>{r, f, kg::softmax(kg::reshape(f, {-1}, "r2"), 0)};
          },
          {x});
      ASSERT_EQ(outs[0].shape(), (std::vector<std::int64_t>{batch, 12, 5}));
      ASSERT_EQ(outs[1].shape(), (std::vector<std::int64_t>{batch, 60}));
      ASSERT_EQ(outs[2].shape(), (std::vector<std::int64_t>{batch * 60}));
      EXPECT_TRUE(same_values(outs[0], x.reshaped({batch, 12, 5})));
      EXPECT_TRUE(same_values(outs[1], x.reshaped({batch, 60})));
      // softmax over the flat input, computed here in double.
      double m = -INFINITY, s = 0;
      for (std::int64_t i = 0; i < x.numel(); ++i) m = std::max(m, x.item(i));
      for (std::int64_t i = 0; i < x.numel(); ++i) s += std::exp(x.item(i) - m);
      kg::Tensor want = kg::Tensor::empty(kg::DType::F64, {batch * 60});
      for (std::int64_t i = 0; i < x.numel(); ++i) want.data<double>()[i] = std::exp(x.item(i) - m) / s;
      EXPECT_TRUE(kg_test::all_close(outs[2], want, dt == kg::DType::F32 ? 1e-5 : 1e-12, 1e-9));
    }
  }
}

TEST(Reshape, ViewOpsAliasTheirInput) {
  // x → linear → reshape → linear → flatten → linear: the views get no buffer of their own.
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 4, 4}, "x");
  auto a = kg::nn::linear(x, 4, "fc1");
  auto r = kg::reshape(a, {0, -1}, "r");
  auto b = kg::nn::linear(r, 6, "fc2");
  auto f = kg::flatten(kg::reshape(b, {0, 2, 3}, "r2"), 1, -1, "f");
  auto y = kg::nn::linear(f, 3, "fc3");
  for (const char* v : {"r", "r2", "f"}) EXPECT_TRUE((*g->node(g->find(v)).op)->is_view()) << v;
  kg::Model model(g, {y});
  const kg::LoadedModel m = model.load(kg::Device::cpu(), {{5, 4, 4}});
  EXPECT_EQ(m.memory_plan().buffers, 3) << m.memory_plan().to_string();  // six op nodes, three views
  // A view of the model input aliases the input: no buffer at all.
  auto [x2, g2] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), 4, 4}, "x");
  kg::Model model2(g2, {kg::nn::linear(kg::flatten(x2), 2, "fc")});
  EXPECT_EQ(model2.load(kg::Device::cpu(), {{2, 4, 4}}).memory_plan().buffers, 1);
}

TEST(Reshape, ReshapeThenLinearAtTwoBatchSizes) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto [x, g] = kg::SymTensor::input(kg::DType::F64, {kg::Dim::named("batch"), 2, 3, 4}, "x");
  auto r = kg::reshape(x, {-1, 24}, "r");
  EXPECT_EQ(r.shape().to_string(), "[batch, 24]");
  kg::Model model(g, {kg::nn::linear(r, 5, "fc")});
  kg::Tensor w = kg_test::random_tensor(rng, kg::DType::F64, {5, 24});
  kg::Tensor b = kg_test::random_tensor(rng, kg::DType::F64, {5});
  for (std::int64_t batch : {3, 9}) {
    SCOPED_TRACE(::testing::Message() << "batch " << batch);
    kg::LoadOptions opt;
    opt.poison_buffers = true;
    kg::LoadedModel m = model.load(kg::Device::cpu(), {{batch, 2, 3, 4}}, opt);
    m.load_state_dict({{"fc.weight", w}, {"fc.bias", b}});
    kg::Tensor in = kg_test::random_tensor(rng, kg::DType::F64, {batch, 2, 3, 4});
    kg::Tensor y = m.forward({in})[0];
    kg::Tensor want = kg::Tensor::empty(kg::DType::F64, {batch, 5});
    for (std::int64_t i = 0; i < batch; ++i)
      for (std::int64_t j = 0; j < 5; ++j) {
        double s = b.item(j);
        for (std::int64_t k = 0; k < 24; ++k) s += in.item(i * 24 + k) * w.item(j * 24 + k);
        want.data<double>()[i * 5 + j] = s;
      }
    EXPECT_TRUE(kg_test::all_close(y, want, 1e-12, 1e-12));
  }
}

// ---- permute / transpose ----

TEST(Permute, ShapeInference) {
  const kg::Dim B = kg::Dim::named("batch");
  EXPECT_EQ(shape_after({B, 3, 4, 5},
                        [](const kg::SymTensor& t) {
                          return kg::permute(t, {0, 2, 3, 1});
                        }),
            "[batch, 4, 5, 3]");
  EXPECT_EQ(shape_after({B, 3, 4, 5},
                        [](const kg::SymTensor& t) {
                          return kg::permute(t, {-1, 0, -2, 1});
                        }),
            "[5, batch, 4, 3]");
  EXPECT_EQ(shape_after({B, 3, 4}, [](const kg::SymTensor& t) { return kg::transpose(t, 0, -1); }),
            "[4, 3, batch]");
  EXPECT_EQ(shape_after({B, 3}, [](const kg::SymTensor& t) { return kg::transpose(t, 1, 1); }), "[batch, 3]");
  EXPECT_EQ(shape_after(kg::Shape{}, [](const kg::SymTensor& t) { return kg::permute(t, {}); }), "[]");
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {B, 3});
  EXPECT_EQ(g->node(kg::transpose(x, 0, 1, "t").node()).op_name(), "nn.permute");
}

TEST(Permute, RejectsBadDims) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 3, 4});
  kg_test::expect_error(
      [&] {
        kg::permute(x, {0, 1}, "p");
      },
      {"[nn.permute @ p]", "[0, 1]", "2 entries", "rank 3"});
  kg_test::expect_error(
      [&] {
        kg::permute(x, {0, 2, 2}, "p");
      },
      {"[nn.permute @ p]", "[0, 2, 2]", "dim 2 twice"});
  kg_test::expect_error([&] { kg::permute(x, {0, -1, 2}, "p"); }, {"[nn.permute @ p]", "dim 2 twice"});
  kg_test::expect_error([&] { kg::permute(x, {0, 1, 3}, "p"); }, {"[nn.permute @ p]", "dim 3", "rank 3"});
  kg_test::expect_error([&] { kg::transpose(x, 0, 3, "t"); }, {"[nn.permute @ t]", "dim1 3", "rank 3"});
  kg_test::expect_error([&] { kg::transpose(x, -4, 1, "t"); }, {"[nn.permute @ t]", "dim0 -4", "rank 3"});
  auto [s, g2] = kg::SymTensor::input(kg::DType::F32, kg::Shape{});
  kg_test::expect_error([&] { kg::transpose(s, 0, 0, "t"); }, {"[nn.permute @ t]", "scalar"});
}

TEST(Permute, MatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<std::vector<std::int64_t>> perms = {
      {0, 1, 2, 3}, {0, 2, 3, 1}, {0, 3, 1, 2}, {3, 2, 1, 0}, {1, 0, 3, 2}, {2, 0, 1, 3}, {0, 1, 3, 2}};
  for (std::int64_t batch : {1, 7, 64}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, 3, 5, 4});
      for (const auto& p : perms) {
        SCOPED_TRACE(::testing::Message()
                     << "batch " << batch << " " << kg::dtype_name(dt) << " perm " << kg::sizes_to_string(p));
        kg::Tensor y = kg_test::run_op([&](const kg::SymTensor& t) { return kg::permute(t, p); }, x);
        std::vector<std::size_t> up(p.begin(), p.end());
        EXPECT_TRUE(same_values(y, naive_permute(x, up)));
      }
      SCOPED_TRACE("transpose(1, -1)");
      kg::Tensor t = kg_test::run_op([](const kg::SymTensor& s) { return kg::transpose(s, 1, -1); }, x);
      EXPECT_TRUE(same_values(t, naive_permute(x, {0, 3, 2, 1})));
    }
  }
}

TEST(Permute, LargeTensorsAndIntegers) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {16, 64, 32, 9});
  for (std::vector<std::int64_t> p : {std::vector<std::int64_t>{0, 2, 3, 1}, {3, 1, 2, 0}}) {
    kg::Tensor y = kg_test::run_op([&](const kg::SymTensor& t) { return kg::permute(t, p); }, x);
    EXPECT_TRUE(same_values(
        y, naive_permute(x, {std::size_t(p[0]), std::size_t(p[1]), std::size_t(p[2]), std::size_t(p[3])})));
  }
  kg::Tensor xi = iota_i64({3, 4, 5}, 11);
  kg::Tensor yi = kg_test::run_op([](const kg::SymTensor& t) { return kg::transpose(t, 0, 2); }, xi);
  ASSERT_EQ(yi.dtype(), kg::DType::I64);
  EXPECT_TRUE(same_values(yi, naive_permute(xi, {2, 1, 0})));
}

// ---- concat ----

TEST(Concat, ShapeInference) {
  const kg::Dim B = kg::Dim::named("batch");
  auto g = kg::Graph::create();
  auto a = g->input(kg::DType::F32, {B, 3, 4}, "a");
  auto b = g->input(kg::DType::F32, {B, 5, 4}, "b");
  auto c = g->input(kg::DType::F32, {2, 3, 4}, "c");
  auto d = g->input(kg::DType::F32, {kg::dynamic, kg::dynamic, 4}, "d");
  EXPECT_EQ(kg::concat({a, b}, 1).shape().to_string(), "[batch, 8, 4]");
  EXPECT_EQ(kg::concat({a, b, a}, -2).shape().to_string(), "[batch, 11, 4]");
  EXPECT_EQ(kg::concat({a, c}, 0).shape().to_string(), "[?, 3, 4]");
  EXPECT_EQ(kg::concat({c, c}, 0).shape().to_string(), "[4, 3, 4]");
  EXPECT_EQ(kg::concat({d, a}, 1).shape().to_string(), "[?, ?, 4]");
  EXPECT_EQ(kg::concat({d, c}, 1).shape().to_string(), "[2, ?, 4]");
  EXPECT_EQ(kg::concat({a}, 2).shape().to_string(), "[batch, 3, 4]");
  auto y = kg::concat({a, b}, 1, "cat");
  EXPECT_EQ(g->node(y.node()).op_name(), "nn.concat");
  EXPECT_EQ(g->node(y.node()).inputs, (std::vector<int>{a.node(), b.node()}));
}

TEST(Concat, RejectsBadInputs) {
  auto g = kg::Graph::create();
  auto a = g->input(kg::DType::F32, {kg::dynamic, 3, 4}, "a");
  auto b = g->input(kg::DType::F32, {kg::dynamic, 3, 5}, "b");
  auto r = g->input(kg::DType::F32, {kg::dynamic, 3}, "r");
  auto f = g->input(kg::DType::F64, {kg::dynamic, 3, 4}, "f");
  auto s = g->input(kg::DType::F32, kg::Shape{}, "s");
  kg_test::expect_error(
      [&] {
        kg::concat({a, b}, 1, "cat");
      },
      {"[nn.concat @ cat]", "input 1 [?, 3, 5]", "[?, 3, 4]", "dim 2 (5 vs 4)"});
  kg_test::expect_error([&] { kg::concat({a, r}, 1, "cat"); }, {"[nn.concat @ cat]", "rank 2", "rank 3"});
  kg_test::expect_error(
      [&] {
        kg::concat({a, f}, 0, "cat");
      },
      {"[nn.concat @ cat]", "f32", "input 1 is f64"});
  kg_test::expect_error([&] { kg::concat({a, a}, 3, "cat"); }, {"[nn.concat @ cat]", "dim 3", "rank 3"});
  kg_test::expect_error([&] { kg::concat({s, s}, 0, "cat"); }, {"[nn.concat @ cat]", "scalars"});
  kg_test::expect_error([&] { kg::concat({}, 0, "cat"); }, {"nn.concat", "at least one"});
}

TEST(Concat, MatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t batch : {1, 7, 64}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      for (std::int64_t dim : {0, 1, 2, 3, -1}) {
        SCOPED_TRACE(::testing::Message()
                     << "batch " << batch << " " << kg::dtype_name(dt) << " dim " << dim);
        const auto d = static_cast<std::size_t>(dim < 0 ? dim + 4 : dim);
        std::vector<kg::Tensor> xs;
        for (std::int64_t along : {2, 0, 3, 1}) {
          std::vector<std::int64_t> s{batch, 3, 4, 5};
          if (d > 0) s[d] = along;  // dim 0 is the shared batch dim
          xs.push_back(kg_test::random_tensor(rng, dt, s));
        }
        auto out = kg_test::run_graph(
            [&](const std::vector<kg::SymTensor>& in) {
              return std::vector<kg::SymTensor>{kg::concat(in, dim)};
            },
            xs);
        EXPECT_TRUE(same_values(out[0], naive_concat(xs, d)));
      }
    }
  }
}

TEST(Concat, LargeTensorsAndIntegers) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::vector<kg::Tensor> xs{kg_test::random_tensor(rng, kg::DType::F32, {3, 40000}),
                             kg_test::random_tensor(rng, kg::DType::F32, {3, 70001})};
  auto wide = kg_test::run_graph(
      [&](const std::vector<kg::SymTensor>& in) { return std::vector<kg::SymTensor>{kg::concat(in, 1)}; },
      xs);
  EXPECT_TRUE(same_values(wide[0], naive_concat(xs, 1)));
  std::vector<kg::Tensor> big{kg_test::random_tensor(rng, kg::DType::F64, {50000, 2}),
                              kg_test::random_tensor(rng, kg::DType::F64, {30000, 2})};
  auto out = kg_test::run_graph(
      [&](const std::vector<kg::SymTensor>& in) { return std::vector<kg::SymTensor>{kg::concat(in, 0)}; },
      big, {}, false);
  EXPECT_TRUE(same_values(out[0], naive_concat(big, 0)));
  std::vector<kg::Tensor> ints{iota_i64({2, 3}, 1), iota_i64({2, 2}, 100)};
  auto oi = kg_test::run_graph(
      [&](const std::vector<kg::SymTensor>& in) { return std::vector<kg::SymTensor>{kg::concat(in, 1)}; },
      ints);
  ASSERT_EQ(oi[0].dtype(), kg::DType::I64);
  EXPECT_TRUE(same_values(oi[0], naive_concat(ints, 1)));
}

// ---- slice ----

TEST(Slice, ShapeInferenceFollowsPythonRules) {
  for (std::int64_t start : {-12, -10, -3, -1, 0, 2, 9, 10, 15})
    for (std::int64_t end : {std::int64_t{-15}, std::int64_t{-10}, std::int64_t{-2}, std::int64_t{0},
                             std::int64_t{3}, std::int64_t{8}, std::int64_t{10}, std::int64_t{11}, kEnd})
      for (std::int64_t step : {1, 2, 3, 7}) {
        const auto want = static_cast<std::int64_t>(python_slice(10, start, end, step).size());
        EXPECT_EQ(
            shape_after({4, 10}, [&](const kg::SymTensor& t) { return kg::slice(t, 1, start, end, step); }),
            kg::Shape({4, want}).to_string())
            << start << ":" << end << ":" << step;
      }
}

TEST(Slice, DynamicDims) {
  const kg::Dim B = kg::Dim::named("batch");
  auto sl = [](std::int64_t d, std::int64_t s, std::int64_t e, std::int64_t st = 1) {
    return [=](const kg::SymTensor& t) { return kg::slice(t, d, s, e, st); };
  };
  EXPECT_EQ(shape_after({B, 10}, sl(0, 0, kEnd)), "[batch, 10]");
  EXPECT_EQ(shape_after({B, 10}, sl(0, -1, kEnd)), "[?, 10]");
  EXPECT_EQ(shape_after({B, 10}, sl(0, 1, 3)), "[?, 10]");
  EXPECT_EQ(shape_after({B, 10}, sl(0, 0, kEnd, 2)), "[?, 10]");
  EXPECT_EQ(shape_after({B, 10}, sl(0, 5, 2)), "[0, 10]");
  EXPECT_EQ(shape_after({B, 10}, sl(1, 2, -2)), "[batch, 6]");
  EXPECT_EQ(shape_after({B, 10}, sl(-1, -3, kEnd)), "[batch, 3]");
  // The dynamic output dim gets its size at load.
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t batch : {1, 7, 64}) {
    kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {batch, 3});
    kg::Tensor y = kg_test::run_op([](const kg::SymTensor& t) { return kg::slice(t, 0, -5, kEnd, 2); }, x);
    EXPECT_TRUE(same_values(y, naive_slice(x, 0, python_slice(batch, -5, kEnd, 2))));
  }
}

TEST(Slice, RejectsBadArguments) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::dynamic, 10});
  kg_test::expect_error([&] { kg::slice(x, 1, 0, 5, 0, "s"); },
                        {"[nn.slice @ s]", "step must be positive, got 0"});
  kg_test::expect_error([&] { kg::slice(x, 1, 0, 5, -1, "s"); }, {"[nn.slice @ s]", "got -1"});
  kg_test::expect_error([&] { kg::slice(x, 2, 0, 5, 1, "s"); }, {"[nn.slice @ s]", "dim 2", "rank 2"});
  auto [s, g2] = kg::SymTensor::input(kg::DType::F32, kg::Shape{});
  kg_test::expect_error([&] { kg::slice(s, 0, 0, 1, 1, "s"); }, {"[nn.slice @ s]", "scalar"});
}

TEST(Slice, MatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::int64_t> bound(-9, 9), steps(1, 4);
  for (std::int64_t batch : {1, 7, 64}) {
    for (kg::DType dt : {kg::DType::F32, kg::DType::F64}) {
      kg::Tensor x = kg_test::random_tensor(rng, dt, {batch, 6, 5, 4});
      for (std::size_t d = 1; d < 4; ++d)
        for (int trial = 0; trial < 6; ++trial) {
          const std::int64_t start = bound(rng), end = trial == 0 ? kEnd : bound(rng), step = steps(rng);
          SCOPED_TRACE(::testing::Message() << "batch " << batch << " " << kg::dtype_name(dt) << " dim " << d
                                            << " " << start << ":" << end << ":" << step);
          kg::Tensor y = kg_test::run_op(
              [&](const kg::SymTensor& t) {
                return kg::slice(t, static_cast<std::int64_t>(d), start, end, step);
              },
              x);
          EXPECT_TRUE(same_values(y, naive_slice(x, d, python_slice(x.dim(d), start, end, step))));
        }
    }
  }
}

TEST(Slice, LargeTensorsAndIntegers) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  kg::Tensor x = kg_test::random_tensor(rng, kg::DType::F32, {4, 300, 257});
  struct Case {
    std::int64_t dim, start, end, step;
  };
  for (const Case& c : {Case{1, 7, -5, 1}, Case{1, 3, kEnd, 4}, Case{2, -200, 250, 3}, Case{2, 1, kEnd, 1}}) {
    SCOPED_TRACE(::testing::Message() << "dim " << c.dim << " " << c.start << ":" << c.end << ":" << c.step);
    kg::Tensor y = kg_test::run_op(
        [&](const kg::SymTensor& t) { return kg::slice(t, c.dim, c.start, c.end, c.step); }, x);
    const auto d = static_cast<std::size_t>(c.dim);
    EXPECT_TRUE(same_values(y, naive_slice(x, d, python_slice(x.dim(d), c.start, c.end, c.step))));
  }
  kg::Tensor xi = iota_i64({3, 8}, 5);
  kg::Tensor yi = kg_test::run_op([](const kg::SymTensor& t) { return kg::slice(t, 1, 1, -1, 3); }, xi);
  ASSERT_EQ(yi.dtype(), kg::DType::I64);
  EXPECT_TRUE(same_values(yi, naive_slice(xi, 1, python_slice(8, 1, -1, 3))));
}

// ---- GPU lowerings ----

TEST(Permute, GpuLoweringCompilesAndMatchesTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    std::vector<std::int64_t> shape;  // after the batch dim
    std::vector<std::int64_t> perm;
  };
  const std::vector<Case> cases = {
      // Gathered element by element (short dims, or the last dim kept).
      {{3, 5, 4}, {0, 2, 3, 1}},
      {{3, 5, 4}, {3, 2, 1, 0}},
      {{3, 5, 4}, {1, 0, 3, 2}},
      {{3, 5, 4}, {2, 0, 1, 3}},
      {{40, 50}, {1, 0, 2}},
      // Through 32×32 tiles: the input's last dim and the output's are both long.
      {{40, 50}, {0, 2, 1}},
      {{32, 6, 8}, {0, 2, 3, 1}},    // NCHW -> NHWC
      {{20, 17, 33}, {0, 3, 1, 2}},  // NHWC -> NCHW, partial tiles
      {{33, 2, 47}, {3, 1, 2, 0}},
  };
  for (std::int64_t batch : {1, 7, 70}) {
    for (kg::DType dt : kEveryWidth) {
      // Every case in f32; one gathered and one tiled in the other widths (dry runs are not free).
      for (std::size_t ci = 0; ci < cases.size(); ++ci) {
        if (dt != kg::DType::F32 && ci != 1 && ci != 7) continue;
        const Case& c = cases[ci];
        SCOPED_TRACE(::testing::Message()
                     << "batch " << batch << " " << kg::dtype_name(dt) << " shape "
                     << kg::sizes_to_string(c.shape) << " perm " << kg::sizes_to_string(c.perm));
        std::vector<std::int64_t> shape{batch};
        shape.insert(shape.end(), c.shape.begin(), c.shape.end());
        kg_test::check_lowering(
            [&](const std::vector<kg::SymTensor>& xs) {
              return std::vector<kg::SymTensor>{kg::permute(xs[0], c.perm)};
            },
            {random_of(rng, dt, shape)}, 0, 0);  // copies are exact
      }
      SCOPED_TRACE("transpose(1, -1)");
      kg_test::check_lowering(
          [&](const std::vector<kg::SymTensor>& xs) {
            return std::vector<kg::SymTensor>{kg::transpose(xs[0], 1, -1)};
          },
          {random_of(rng, dt, {batch, 36, 3, 20})}, 0, 0);
    }
  }
}

TEST(Permute, GpuPicksGatherTilesOrRows) {
  auto grid_of = [](kg::DType dt, std::vector<std::int64_t> shape, std::vector<std::int64_t> perm) {
    auto [x, g] = kg::SymTensor::input(dt, kg::Shape::of(shape), "x");
    auto dry = dry_run_of(g, {kg::permute(x, perm)}, {shape});
    if (!dry) return 0u;
    const auto& step = dry->launches.steps.at(0);
    EXPECT_EQ(step.launches.at(0).entry, std::string("kg_permute") + width_suffix(dt));
    return step.launches.at(0).launch.grid.x;
  };
  if (!kg::compile::Compiler::available()) GTEST_SKIP() << "built without NVRTC";
  // Gather: one thread per four elements, 256 threads per block.
  EXPECT_EQ(grid_of(kg::DType::U8, {7, 40, 50}, {1, 0, 2}), (7u * 2000 + 1023) / 1024);
  // [5, 3, 400]: the input's last dim (5 long) is the output's first.
  EXPECT_EQ(grid_of(kg::DType::F32, {400, 3, 5}, {2, 1, 0}), (6000u + 1023) / 1024);
  // Rows: a short last dim (3 channels going NCHW → NHWC) after the input's last: one thread per
  // output row, 256 per block.
  EXPECT_EQ(grid_of(kg::DType::F32, {7, 3, 50, 40}, {0, 2, 3, 1}), (7u * 2000 + 255) / 256);
  EXPECT_EQ(grid_of(kg::DType::F32, {7, 3, 500}, {0, 2, 1}), (7u * 500 + 255) / 256);
  // Tiles of 32×32 for each batch entry.
  EXPECT_EQ(grid_of(kg::DType::F64, {7, 40, 50}, {0, 2, 1}), 7u * 2 * 2);
  EXPECT_EQ(grid_of(kg::DType::I16, {5, 32, 6, 8}, {0, 2, 3, 1}), 5u * 2 * 1);  // [5, 48, 32]
  EXPECT_EQ(grid_of(kg::DType::F32, {1, 20, 17, 33}, {0, 3, 1, 2}), 2u * 11);   // [33, 340]
}

TEST(Permute, GpuRejectsTooManyDims) {
  if (!kg::compile::Compiler::available()) GTEST_SKIP() << "built without NVRTC";
  // Reversing 9 dims leaves no two of them adjacent in the input: nothing merges.
  std::vector<std::int64_t> shape(9, 2), perm(9);
  for (std::int64_t i = 0; i < 9; ++i) perm[static_cast<std::size_t>(i)] = 8 - i;
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, kg::Shape::of(shape), "x");
  auto y = kg::permute(x, perm, "p");
  kg_test::expect_error([&] { dry_run_of(g, {y}, {shape}); },
                        {"nn.permute", kg::sizes_to_string(shape), "9 dims after merging", "handles 8"});
}

TEST(Concat, GpuLoweringCompilesAndMatchesTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::int64_t batch : {1, 7, 70}) {
    for (kg::DType dt : kEveryWidth) {
      for (std::int64_t dim : {1, 2, 3, -1}) {
        if (dt != kg::DType::F32 && dim != 2) continue;  // every dim in f32, one in the other widths
        SCOPED_TRACE(::testing::Message()
                     << "batch " << batch << " " << kg::dtype_name(dt) << " dim " << dim);
        const auto d = static_cast<std::size_t>(dim < 0 ? dim + 4 : dim);
        std::vector<kg::Tensor> xs;
        for (std::int64_t along : {2, 0, 3, 1}) {  // an empty input among them
          std::vector<std::int64_t> s{batch, 3, 4, 5};
          s[d] = along;
          xs.push_back(random_of(rng, dt, s));
        }
        kg_test::check_lowering(
            [&](const std::vector<kg::SymTensor>& in) {
              return std::vector<kg::SymTensor>{kg::concat(in, dim)};
            },
            xs, 0, 0);
      }
      // More inputs than one launch takes (16): two launches.
      SCOPED_TRACE(::testing::Message() << "batch " << batch << " " << kg::dtype_name(dt) << " 21 inputs");
      std::vector<kg::Tensor> many;
      for (std::int64_t k = 0; k < 21; ++k) many.push_back(random_of(rng, dt, {batch, k % 4, 7}));
      kg_test::check_lowering(
          [&](const std::vector<kg::SymTensor>& in) { return std::vector<kg::SymTensor>{kg::concat(in, 1)}; },
          many, 0, 0);
    }
  }
}

TEST(Concat, GpuLaunchesAndTheBatchDim) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // Inputs of different sizes along dim 0, recorded with static shapes.
  std::vector<kg::Tensor> xs{random_of(rng, kg::DType::F64, {500, 2}),
                             random_of(rng, kg::DType::F64, {300, 2}),
                             random_of(rng, kg::DType::F64, {1, 2})};
  auto g = kg::Graph::create();
  std::vector<kg::SymTensor> in;
  for (std::size_t i = 0; i < xs.size(); ++i)
    in.push_back(g->input(xs[i].dtype(), kg::Shape::of(xs[i].shape()), "x" + std::to_string(i)));
  auto y = kg::concat(in, 0, "cat");
  kg::Model model(g, {y});
  if (kg::compile::Compiler::available()) {
    auto dry = kg::lower::dry_run(model, {xs[0].shape(), xs[1].shape(), xs[2].shape()}, 90);
    const auto& step = dry.launches.steps.at(0);
    ASSERT_EQ(step.launches.size(), 1u);
    EXPECT_EQ(step.launches[0].entry, "kg_concat_u64");
    EXPECT_EQ(step.launches[0].launch.grid.y, 3u);                        // one row of blocks per input
    EXPECT_EQ(step.launches[0].launch.grid.x, (801u * 2 + 1023) / 1024);  // four elements per thread
  }
  if (kg::Device::cuda_available()) {
    kg::LoadOptions opt;
    opt.poison_buffers = true;
    std::vector<std::vector<std::int64_t>> shapes{xs[0].shape(), xs[1].shape(), xs[2].shape()};
    const kg::Tensor want = model.load(kg::Device::cpu(), shapes, opt).forward(xs)[0];
    const kg::Tensor got = model.load(kg::Device::cuda(), shapes, opt).forward(xs)[0];
    EXPECT_TRUE(same_values(got, want));
  }
  // 40 inputs: launches of 16, 16 and 8, each a row of blocks per input.
  if (!kg::compile::Compiler::available()) return;
  auto [x, g2] = kg::SymTensor::input(kg::DType::F32, {4, 3}, "x");
  auto many = kg::concat(std::vector<kg::SymTensor>(40, x), 1, "cat");
  auto dry = dry_run_of(g2, {many}, {{4, 3}});
  const auto& launches = dry->launches.steps.at(0).launches;
  ASSERT_EQ(launches.size(), 3u);
  EXPECT_EQ(launches[0].launch.grid.y, 16u);
  EXPECT_EQ(launches[1].launch.grid.y, 16u);
  EXPECT_EQ(launches[2].launch.grid.y, 8u);
  for (const auto& l : launches) EXPECT_EQ(l.entry, "kg_concat_u32");
}

TEST(Slice, GpuLoweringCompilesAndMatchesTheCpu) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::int64_t> bound(-9, 9), steps(1, 4);
  for (std::int64_t batch : {1, 7, 70}) {
    for (kg::DType dt : kEveryWidth) {
      kg::Tensor x = random_of(rng, dt, {batch, 6, 5, 4});
      for (std::int64_t d = 0; d < 4; ++d) {
        // Every dim in f32 (four slices each), a random dim in the other widths (two slices).
        if (dt != kg::DType::F32 && d != std::uniform_int_distribution<std::int64_t>(0, 3)(rng)) continue;
        for (int trial = 0; trial < (dt == kg::DType::F32 ? 4 : 2); ++trial) {
          // Trial 0 takes a step-1 run to the end; the batch dim takes Python bounds too.
          const std::int64_t start = bound(rng), end = trial == 0 ? kEnd : bound(rng);
          const std::int64_t step = trial == 0 ? 1 : steps(rng);
          SCOPED_TRACE(::testing::Message() << "batch " << batch << " " << kg::dtype_name(dt) << " dim " << d
                                            << " " << start << ":" << end << ":" << step);
          kg_test::check_lowering(
              [&](const std::vector<kg::SymTensor>& xs) {
                return std::vector<kg::SymTensor>{kg::slice(xs[0], d, start, end, step)};
              },
              {x}, 0, 0);
        }
      }
    }
  }
}

TEST(Slice, GpuGridCoversTheOutput) {
  if (!kg::compile::Compiler::available()) GTEST_SKIP() << "built without NVRTC";
  for (kg::DType dt : kEveryWidth) {
    SCOPED_TRACE(kg::dtype_name(dt));
    auto [x, g] = kg::SymTensor::input(dt, {4, 300, 257}, "x");
    auto y = kg::slice(x, 2, -200, 250, 3, "s");  // 65 of 257
    auto dry = dry_run_of(g, {y}, {{4, 300, 257}});
    const auto& step = dry->launches.steps.at(0);
    EXPECT_EQ(step.launches.at(0).entry, std::string("kg_slice") + width_suffix(dt));
    EXPECT_EQ(step.launches.at(0).launch.grid.x, (4u * 300 * 65 + 1023) / 1024);  // four elements per thread
  }
}
