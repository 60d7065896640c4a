// nn.attention (kg::nn::attention): shapes and errors; the CPU forward and the CUDA kernel run by
// the emulator (checked mode, every output element written) against a naive reference written
// here in double (scores by loops, scale, mask, softmax, product with v) on fresh random inputs, in
// f32, f64, f16 and bf16, with additive and bool masks of several broadcasts, causal, odd sequence
// lengths (Sq = 7, Sk = 13), heads 3 and 12, D 64 and 80; rows whose every key is masked (zeros);
// the CPU backward against central finite differences (kg::testing::check_gradients).
//
// Tolerances: f32 and f64 against the double reference at 2e-5 / 1e-12 relative (the CPU forms
// take the scores by a GEMM in the dtype, the kernel sums in another order). 16-bit inputs are
// rounded to the dtype before the reference reads them; the output is rounded once (half an ulp:
// 2^-11 in f16, 2^-8 in bf16) after f32 sums, so 2e-3 (f16) and 1e-2 (bf16) of |ref| plus as much
// of the output's scale (max |ref|) covers it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

#include "backend/emu/executor.hpp"
#include "kg/testing.hpp"
#include "support/test_util.hpp"

using kg_test::fresh_seed;

namespace {

enum class MaskKind { None, Additive, Bool };

struct Problem {
  std::vector<std::int64_t> q, k, v, mask;  // mask empty: none
  MaskKind kind = MaskKind::None;
  bool causal = false;
  std::optional<double> scale;
};

// out[..., i, :] = Σ_j softmax_j(scale q_i·k_j + mask_ij) v_j in double, masked keys (causal j > i,
// bool false, additive -inf) left out; a row with none left is zeros.
kg::Tensor naive_attention(const Problem& p, const kg::Tensor& q, const kg::Tensor& k, const kg::Tensor& v,
                           const kg::Tensor* mask) {
  const std::size_t r = p.q.size();
  const std::int64_t sq = p.q[r - 2], d = p.q[r - 1], sk = p.k[r - 2], dv = p.v[r - 1];
  std::int64_t bh = 1;
  for (std::size_t i = 0; i + 2 < r; ++i) bh *= p.q[i];
  const double scale = p.scale ? *p.scale : 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<std::int64_t> out_shape(p.q.begin(), p.q.end() - 1);
  out_shape.push_back(dv);
  kg::Tensor out = kg::Tensor::empty(kg::DType::F64, out_shape);
  double* o = out.data<double>();
  // The mask element of (batch entry b, i, j) by numpy broadcasting.
  std::vector<std::int64_t> full(p.q.begin(), p.q.end() - 2);
  full.push_back(sq);
  full.push_back(sk);
  auto mask_at = [&](std::int64_t b, std::int64_t i, std::int64_t j) {
    std::vector<std::int64_t> idx(r);
    idx[r - 1] = j;
    idx[r - 2] = i;
    for (std::size_t a = r - 2; a-- > 0;) {
      idx[a] = b % full[a];
      b /= full[a];
    }
    std::int64_t off = 0;
    const std::size_t mr = p.mask.size();
    for (std::size_t a = 0; a < mr; ++a) {
      const std::int64_t c = p.mask[a] == 1 ? 0 : idx[r - mr + a];
      off = off * p.mask[a] + c;
    }
    return mask->item(off);
  };
  std::vector<double> s(static_cast<std::size_t>(sk));
  for (std::int64_t b = 0; b < bh; ++b)
    for (std::int64_t i = 0; i < sq; ++i) {
      double mx = -INFINITY;
      for (std::int64_t j = 0; j < sk; ++j) {
        double x = 0;
        for (std::int64_t c = 0; c < d; ++c) x += q.item((b * sq + i) * d + c) * k.item((b * sk + j) * d + c);
        x *= scale;
        if (p.causal && j > i) x = -INFINITY;
        if (p.kind == MaskKind::Additive) x += mask_at(b, i, j);
        if (p.kind == MaskKind::Bool && mask_at(b, i, j) == 0) x = -INFINITY;
        s[static_cast<std::size_t>(j)] = x;
        mx = std::max(mx, x);
      }
      double sum = 0;
      for (double& x : s) sum += (x = mx == -INFINITY ? 0 : std::exp(x - mx));
      for (std::int64_t c = 0; c < dv; ++c) {
        double acc = 0;
        for (std::int64_t j = 0; j < sk; ++j) acc += s[static_cast<std::size_t>(j)] * v.item((b * sk + j) * dv + c);
        o[(b * sq + i) * dv + c] = sum > 0 ? acc / sum : 0;
      }
    }
  return out;
}

kg::Tensor random_bool(std::mt19937_64& rng, std::vector<std::int64_t> shape, double p_keep = 0.7) {
  kg::Tensor t = kg::Tensor::empty(kg::DType::Bool, std::move(shape));
  auto* b = static_cast<unsigned char*>(t.raw());
  std::bernoulli_distribution keep(p_keep);
  for (std::int64_t i = 0; i < t.numel(); ++i) b[i] = keep(rng) ? 1 : 0;
  return t;
}

struct Inputs {
  std::vector<kg::Tensor> tensors;  // q, k, v[, mask]
};

Inputs make_inputs(std::mt19937_64& rng, const Problem& p, kg::DType dt) {
  Inputs in;
  in.tensors.push_back(kg_test::random_tensor(rng, dt, p.q, -1.5, 1.5));
  in.tensors.push_back(kg_test::random_tensor(rng, dt, p.k, -1.5, 1.5));
  in.tensors.push_back(kg_test::random_tensor(rng, dt, p.v, -1, 1));
  if (p.kind == MaskKind::Additive) in.tensors.push_back(kg_test::random_tensor(rng, dt, p.mask, -3, 1));
  if (p.kind == MaskKind::Bool) in.tensors.push_back(random_bool(rng, p.mask));
  return in;
}

kg::Tensor reference(const Problem& p, const Inputs& in) {
  return naive_attention(p, in.tensors[0], in.tensors[1], in.tensors[2],
                         in.tensors.size() > 3 ? &in.tensors[3] : nullptr);
}

kg::SymTensor record(const Problem& p, const std::vector<kg::SymTensor>& xs, const std::string& name = "att") {
  return kg::nn::attention(xs[0], xs[1], xs[2], xs.size() > 3 ? xs[3] : kg::SymTensor(), p.causal, p.scale, name);
}

// The model over static shapes.
kg::Model model_of(const Problem& p, const Inputs& in) {
  auto g = kg::Graph::create();
  std::vector<kg::SymTensor> xs;
  for (std::size_t i = 0; i < in.tensors.size(); ++i)
    xs.push_back(g->input(in.tensors[i].dtype(), kg::Shape::of(in.tensors[i].shape()), "x" + std::to_string(i)));
  return kg::Model(g, {record(p, xs)});
}

std::vector<std::vector<std::int64_t>> shapes_of(const Inputs& in) {
  std::vector<std::vector<std::int64_t>> s;
  for (const auto& t : in.tensors) s.push_back(t.shape());
  return s;
}

// The CPU forward on poisoned buffers.
kg::Tensor run_cpu(const Problem& p, const Inputs& in) {
  kg::LoadOptions o;
  o.poison_buffers = true;
  kg::LoadedModel m = model_of(p, in).load(kg::Device::cpu(), shapes_of(in), o);
  return m.forward(in.tensors).at(0);
}

// The op's kernel under the emulator (checked mode: guarded buffers, threads in both orders).
kg::Tensor run_emulated(const Problem& p, const Inputs& in) {
  return kg::emu::run_model(model_of(p, in), in.tensors, {}, /*checked=*/true).at(0);
}

double tolerance(kg::DType t) {
  switch (t) {
    case kg::DType::F16: return 2e-3;
    case kg::DType::BF16: return 1e-2;
    case kg::DType::F64: return 1e-12;
    default: return 2e-5;
  }
}

::testing::AssertionResult near(const kg::Tensor& got, const kg::Tensor& want, kg::DType dt) {
  if (got.dtype() != dt) return ::testing::AssertionFailure() << "output is " << kg::dtype_name(got.dtype());
  if (!kg_test::all_written(got)) return ::testing::AssertionFailure() << "an output element was never written";
  // The absolute part against the output's scale: an output near zero is a sum of terms of the
  // output's size, and its rounding error is theirs (f32 sums over many keys miss a bound of
  // tolerance / 100 there for some draws).
  double scale = 0;
  for (std::int64_t i = 0; i < want.numel(); ++i) scale = std::max(scale, std::abs(want.item(i)));
  return kg_test::all_close(got, want, tolerance(dt), tolerance(dt) * std::max(scale, 1e-6));
}

std::string describe(const Problem& p, kg::DType dt) {
  std::ostringstream s;
  s << kg::dtype_name(dt) << " q " << kg::sizes_to_string(p.q) << " k " << kg::sizes_to_string(p.k) << " v "
    << kg::sizes_to_string(p.v);
  if (p.kind != MaskKind::None)
    s << (p.kind == MaskKind::Bool ? " bool" : " additive") << " mask " << kg::sizes_to_string(p.mask);
  if (p.causal) s << " causal";
  if (p.scale) s << " scale " << *p.scale;
  return s.str();
}

// Heads 3 and 12, D 64 and 80, odd lengths, each mask form and broadcast, causal with Sq < Sk and
// Sq > Sk, a rank-3 input (no head dim), a given scale, a key tile boundary (Sk = 33).
std::vector<Problem> problems() {
  using MK = MaskKind;
  return {
      {{2, 3, 7, 64}, {2, 3, 13, 64}, {2, 3, 13, 64}, {}, MK::None, false, std::nullopt},
      {{2, 3, 7, 80}, {2, 3, 13, 80}, {2, 3, 13, 80}, {2, 1, 1, 13}, MK::Additive, false, std::nullopt},
      {{1, 12, 9, 64}, {1, 12, 33, 64}, {1, 12, 33, 64}, {9, 33}, MK::Bool, false, std::nullopt},
      {{2, 3, 7, 32}, {2, 3, 13, 32}, {2, 3, 13, 48}, {}, MK::None, true, std::nullopt},
      {{2, 3, 13, 64}, {2, 3, 7, 64}, {2, 3, 7, 64}, {2, 3, 13, 7}, MK::Additive, true, 0.2},
      {{3, 17, 128}, {3, 17, 128}, {3, 17, 128}, {3, 1, 17}, MK::Bool, true, std::nullopt},
      {{2, 12, 5, 80}, {2, 12, 6, 80}, {2, 12, 6, 80}, {1, 12, 5, 1}, MK::Additive, false, std::nullopt},
  };
}

}  // namespace

TEST(Attention, ShapeInference) {
  auto g = kg::Graph::create();
  auto q = g->input(kg::DType::F32, {kg::Dim::named("batch"), 12, kg::Dim::named("seq"), 64}, "q");
  auto k = g->input(kg::DType::F32, {kg::Dim::named("batch"), 12, kg::dynamic, 64}, "k");
  auto v = g->input(kg::DType::F32, {kg::Dim::named("batch"), 12, kg::dynamic, 80}, "v");
  auto m = g->input(kg::DType::F32, {kg::Dim::named("batch"), 1, 1, kg::dynamic}, "m");
  auto b = g->input(kg::DType::Bool, {kg::Dim::named("seq"), kg::dynamic}, "b");
  auto y = kg::nn::attention(q, k, v, m, false, std::nullopt, "att");
  EXPECT_EQ(y.shape().to_string(), "[batch, 12, seq, 80]");
  EXPECT_EQ(y.dtype(), kg::DType::F32);
  EXPECT_EQ(g->node(y.node()).op_name(), "nn.attention");
  EXPECT_EQ(g->node(y.node()).op->op().attributes(), "mask=additive scale=1/sqrt(D)");
  auto z = kg::nn::attention(q, k, v, b, true, 0.125, "att2");
  EXPECT_EQ(z.shape().to_string(), "[batch, 12, seq, 80]");
  EXPECT_EQ(g->node(z.node()).op->op().attributes(), "mask=bool causal scale=0.125");
  EXPECT_EQ(kg::nn::attention(q, k, v).shape().to_string(), "[batch, 12, seq, 80]");
}

TEST(Attention, RejectsBadInputs) {
  auto g = kg::Graph::create();
  auto q = g->input(kg::DType::F32, {2, 3, 7, 64}, "q");
  auto k = g->input(kg::DType::F32, {2, 3, 13, 64}, "k");
  auto v = g->input(kg::DType::F32, {2, 3, 13, 80}, "v");
  auto k32 = g->input(kg::DType::F32, {2, 3, 13, 32}, "k32");
  auto v12 = g->input(kg::DType::F32, {2, 3, 12, 80}, "v12");
  auto k4 = g->input(kg::DType::F32, {2, 4, 13, 64}, "k4");
  auto k3d = g->input(kg::DType::F32, {6, 13, 64}, "k3d");
  auto bad_mask = g->input(kg::DType::F32, {2, 3, 7, 12}, "bad_mask");
  auto long_mask = g->input(kg::DType::F32, {1, 2, 3, 7, 13}, "long_mask");
  auto f64_mask = g->input(kg::DType::F64, {7, 13}, "f64_mask");
  auto qi = g->input(kg::DType::I32, {2, 3, 7, 64}, "qi");
  kg_test::expect_error([&] { kg::nn::attention(q, k32, v, {}, false, std::nullopt, "att"); },
                        {"[nn.attention @ att]", "same last dim D", "[2, 3, 7, 64]", "[2, 3, 13, 32]"});
  kg_test::expect_error([&] { kg::nn::attention(q, k, v12, {}, false, std::nullopt, "att"); },
                        {"[nn.attention @ att]", "number of keys", "[2, 3, 12, 80]"});
  kg_test::expect_error([&] { kg::nn::attention(q, k4, v, {}, false, std::nullopt, "att"); },
                        {"[nn.attention @ att]", "same batch dims", "dim 1", "[2, 4, 13, 64]"});
  kg_test::expect_error([&] { kg::nn::attention(q, k3d, v, {}, false, std::nullopt, "att"); },
                        {"[nn.attention @ att]", "one rank", "[6, 13, 64]"});
  kg_test::expect_error([&] { kg::nn::attention(q, k, v, bad_mask, false, std::nullopt, "att"); },
                        {"[nn.attention @ att]", "mask [2, 3, 7, 12]", "does not broadcast", "[2, 3, 7, 13]"});
  kg_test::expect_error([&] { kg::nn::attention(q, k, v, long_mask, false, std::nullopt, "att"); },
                        {"[nn.attention @ att]", "mask [1, 2, 3, 7, 13]", "does not broadcast"});
  kg_test::expect_error([&] { kg::nn::attention(q, k, v, f64_mask, false, std::nullopt, "att"); },
                        {"[nn.attention @ att]", "additive mask", "f32", "f64"});
  kg_test::expect_error([&] { kg::nn::attention(qi, k, v, {}, false, std::nullopt, "att"); },
                        {"[nn.attention @ att]", "i32"});
  kg_test::expect_error([&] { kg::nn::attention(q, k, v, {}, false, std::numeric_limits<double>::infinity(), "a"); },
                        {"scale must be finite"});
}

TEST(Attention, CpuMatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : {kg::DType::F32, kg::DType::F64, kg::DType::F16, kg::DType::BF16})
    for (const Problem& p : problems()) {
      SCOPED_TRACE(describe(p, dt));
      const Inputs in = make_inputs(rng, p, dt);
      EXPECT_TRUE(near(run_cpu(p, in), reference(p, in), dt));
    }
}

TEST(Attention, EmulatedKernelMatchesNaiveReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (kg::DType dt : {kg::DType::F32, kg::DType::F16, kg::DType::BF16, kg::DType::F64})
    for (const Problem& p : problems()) {
      SCOPED_TRACE(describe(p, dt));
      const Inputs in = make_inputs(rng, p, dt);
      EXPECT_TRUE(near(run_emulated(p, in), reference(p, in), dt));
    }
}

TEST(Attention, FullyMaskedRowsGiveZeros) {
  // Row 1 of the bool mask keeps nothing; row 2 of the additive mask is all -inf; the rest is kept.
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (MaskKind kind : {MaskKind::Bool, MaskKind::Additive}) {
    Problem p{{1, 2, 4, 16}, {1, 2, 5, 16}, {1, 2, 5, 8}, {4, 5}, kind, false, std::nullopt};
    Inputs in = make_inputs(rng, p, kg::DType::F32);
    kg::Tensor& mask = in.tensors[3];
    for (std::int64_t j = 0; j < 5; ++j) {
      if (kind == MaskKind::Bool) {
        auto* b = static_cast<unsigned char*>(mask.raw());
        b[1 * 5 + j] = 0;
        b[0 * 5 + j] = b[2 * 5 + j] = b[3 * 5 + j] = 1;
      } else {
        float* a = mask.data<float>();
        a[2 * 5 + j] = -std::numeric_limits<float>::infinity();
      }
    }
    const kg::Tensor want = reference(p, in);
    for (bool emulated : {false, true}) {
      SCOPED_TRACE(std::string(kind == MaskKind::Bool ? "bool" : "additive") + (emulated ? " emulated" : " cpu"));
      const kg::Tensor got = emulated ? run_emulated(p, in) : run_cpu(p, in);
      EXPECT_TRUE(near(got, want, kg::DType::F32));
      const std::int64_t row = kind == MaskKind::Bool ? 1 : 2;
      for (std::int64_t h = 0; h < 2; ++h)
        for (std::int64_t c = 0; c < 8; ++c) EXPECT_EQ(got.item((h * 4 + row) * 8 + c), 0.0);
    }
  }
}

// The CPU backward against central finite differences in f64, and the lowered backward kernels
// under the emulator against the CPU backward (check_gradients), except for a broadcast additive
// mask, whose gradient only the CPU gives.
TEST(Attention, BackwardMatchesFiniteDifferences) {
  struct Case {
    std::vector<std::vector<std::int64_t>> shapes;
    MaskKind kind;
    bool causal;
    bool emulate = true;
  };
  const std::vector<Case> cases = {
      {{{2, 3, 5, 8}, {2, 3, 7, 8}, {2, 3, 7, 6}}, MaskKind::None, false},
      {{{2, 3, 5, 8}, {2, 3, 7, 8}, {2, 3, 7, 6}, {2, 1, 5, 7}}, MaskKind::Additive, false, false},
      {{{2, 3, 5, 8}, {2, 3, 7, 8}, {2, 3, 7, 6}, {2, 3, 5, 7}}, MaskKind::Additive, true},
      {{{2, 6, 8}, {2, 6, 8}, {2, 6, 4}, {6, 6}}, MaskKind::Bool, true},
      {{{1, 2, 7, 4}, {1, 2, 35, 4}, {1, 2, 35, 3}}, MaskKind::None, true},
      {{{1, 2, 40, 4}, {1, 2, 5, 4}, {1, 2, 5, 3}}, MaskKind::None, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "q " << kg::sizes_to_string(c.shapes[0])
                                      << (c.kind == MaskKind::Bool ? " bool mask" : c.kind == MaskKind::Additive ? " additive mask" : "")
                                      << (c.causal ? " causal" : ""));
    auto g = kg::Graph::create();
    std::vector<kg::SymTensor> xs;
    for (std::size_t i = 0; i < c.shapes.size(); ++i)
      xs.push_back(g->input(i == 3 && c.kind == MaskKind::Bool ? kg::DType::Bool : kg::DType::F64,
                            kg::Shape::of(c.shapes[i])));
    const Problem p{{}, {}, {}, {}, c.kind, c.causal, std::nullopt};
    const kg::CustomData op = *g->node(record(p, xs).node()).op;
    std::vector<kg::DType> dtypes(c.shapes.size(), kg::DType::F64);
    if (c.kind == MaskKind::Bool) dtypes[3] = kg::DType::Bool;
    kg::testing::GradCheckOptions o;
    o.emulate = c.emulate;
    std::mt19937_64 rng(fresh_seed());
    o.make_input = [&](int index, const std::vector<std::int64_t>& shape) {
      if (index == 3 && c.kind == MaskKind::Bool) return random_bool(rng, shape);
      return kg_test::random_tensor(rng, kg::DType::F64, shape, -1, 1);
    };
    const auto rep = kg::testing::check_gradients(op, c.shapes, dtypes, o);
    EXPECT_TRUE(rep.ok) << rep.to_string();
  }
}
