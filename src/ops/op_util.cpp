#include "ops/op_util.hpp"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::ops {

Tensor thread_scratch_tensor(DType dtype, const std::vector<std::int64_t>& shape) {
  thread_local std::vector<std::byte> scratch;
  const std::size_t bytes = static_cast<std::size_t>(numel_of(shape)) * dtype_size(dtype);
  if (scratch.size() < bytes + 64) scratch.resize(bytes + 64);
  void* aligned = scratch.data() + (64 - reinterpret_cast<std::uintptr_t>(scratch.data()) % 64) % 64;
  return Tensor::wrap(aligned, dtype, shape);
}

std::string hex_hash(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

DType require_float_or_half(const std::vector<DType>& in) {
  if (in.empty()) throw Error("expects at least one input");
  for (DType t : in)
    if (!is_floating(t))
      throw Error(util::cat("supports f32, f64, f16 and bf16 inputs, got ", dtype_name(t)));
  for (DType t : in)
    if (t != in[0])
      throw Error(util::cat("inputs must share one dtype, got ", dtype_name(in[0]), " and ", dtype_name(t)));
  return in[0];
}

namespace {

// A context over f32 copies whose parallel_for is the original context's.
class Forwarding final : public CpuContext {
 public:
  Forwarding(const CpuContext& outer, std::span<const Tensor> in, std::span<const Tensor> ps, Tensor out)
      : CpuContext(in, ps, std::move(out), outer.training, outer.seed), outer_(outer) {}
  void parallel_for(std::int64_t n, std::int64_t grain, const RangeFn& fn) const override {
    outer_.parallel_for(n, grain, fn);
  }

 private:
  const CpuContext& outer_;
};

class ForwardingBackward final : public CpuBackwardContext {
 public:
  ForwardingBackward(const CpuContext& outer, std::span<const Tensor> in, std::span<const Tensor> ps, Tensor out,
                     Tensor gout, std::span<Tensor> gin, std::span<Tensor> gps)
      : CpuBackwardContext(in, ps, std::move(out), std::move(gout), gin, gps, outer.training, outer.seed),
        outer_(outer) {}
  void parallel_for(std::int64_t n, std::int64_t grain, const RangeFn& fn) const override {
    outer_.parallel_for(n, grain, fn);
  }

 private:
  const CpuContext& outer_;
};

// An f32 copy of a 16-bit float tensor; other tensors (and undefined ones) as they are.
Tensor widened(const Tensor& t) {
  if (!is_half_float(t.dtype()) || t.raw() == nullptr) return t;
  return t.to(DType::F32);
}
std::vector<Tensor> widened(std::span<const Tensor> ts) {
  std::vector<Tensor> out;
  out.reserve(ts.size());
  for (const Tensor& t : ts) out.push_back(widened(t));
  return out;
}
// An f32 tensor to write in place of a 16-bit one (undefined stays undefined).
Tensor f32_target(const Tensor& t) {
  if (!is_half_float(t.dtype())) return t;
  if (t.raw() == nullptr) return Tensor::wrap(nullptr, DType::F32, t.shape());
  return Tensor::empty(DType::F32, t.shape());
}
// Rounds `computed` into `target` when they differ (a 16-bit target).
void narrow_into(const Tensor& computed, Tensor& target) {
  if (computed.raw() == target.raw() || target.raw() == nullptr) return;
  Tensor r = computed.to(target.dtype());
  std::memcpy(target.raw(), r.raw(), target.nbytes());
}

}  // namespace

void cpu_forward_in_f32(CpuContext& ctx, const std::function<void(CpuContext&)>& f32_forward) {
  std::vector<Tensor> in = widened(ctx.inputs), ps = widened(ctx.params);
  Tensor out = f32_target(ctx.output);
  Forwarding inner(ctx, in, ps, out);
  f32_forward(inner);
  narrow_into(out, ctx.output);
}

void cpu_backward_in_f32(CpuBackwardContext& ctx, const std::function<void(CpuBackwardContext&)>& f32_backward) {
  std::vector<Tensor> in = widened(ctx.inputs), ps = widened(ctx.params);
  std::vector<Tensor> gin, gps;
  for (const Tensor& g : ctx.grad_inputs) gin.push_back(f32_target(g));
  for (const Tensor& g : ctx.grad_params) gps.push_back(f32_target(g));
  ForwardingBackward inner(ctx, in, ps, widened(ctx.output), widened(ctx.grad_output), gin, gps);
  f32_backward(inner);
  for (std::size_t i = 0; i < gin.size(); ++i) narrow_into(gin[i], ctx.grad_inputs[i]);
  for (std::size_t i = 0; i < gps.size(); ++i) narrow_into(gps[i], ctx.grad_params[i]);
}

std::string device_literal(double v) {
  if (!std::isfinite(v)) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "__longlong_as_double(0x%016llxLL)",
                  static_cast<unsigned long long>(std::bit_cast<std::uint64_t>(v)));
    return buf;
  }
  char buf[40];
  auto res = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, res.ptr);
  // A whole number such as "2" would be an int literal: make it a double.
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return "(" + s + ")";
}

Shape broadcast_shapes(const Shape& a, const Shape& b) {
  const std::size_t r = std::max(a.rank(), b.rank());
  Shape out;
  for (std::size_t i = 0; i < r; ++i) {
    // Align from the right.
    const bool has_a = i + a.rank() >= r, has_b = i + b.rank() >= r;
    Dim da = has_a ? a[i + a.rank() - r] : Dim(1);
    Dim db = has_b ? b[i + b.rank() - r] : Dim(1);
    if (da.is_static() && da.size() == 1) {
      out.push_back(db);
    } else if (db.is_static() && db.size() == 1) {
      out.push_back(da);
    } else if (da.is_static() && db.is_static()) {
      if (da.size() != db.size())
        throw Error(util::cat("shapes ", a.to_string(), " and ", b.to_string(),
                              " do not broadcast (", da.size(), " vs ", db.size(), ")"));
      out.push_back(da);
    } else if (da.is_static()) {
      out.push_back(da);  // the dynamic side must be this size or 1 at load
    } else {
      out.push_back(db.is_static() ? db : da);
    }
  }
  return out;
}

Dim window_out(const Dim& in, std::int64_t k, std::int64_t stride, std::int64_t pad,
               std::int64_t dilation, bool ceil_mode, const char* what) {
  if (in.is_dynamic()) return Dim(dynamic);
  const std::int64_t span = dilation * (k - 1) + 1;
  const std::int64_t avail = in.size() + 2 * pad - span;
  if (avail < 0)
    throw Error(util::cat(what, " of ", in.size(), " with padding ", pad, " is smaller than the window ",
                          span, " (kernel ", k, ", dilation ", dilation, ")"));
  std::int64_t out = (ceil_mode ? (avail + stride - 1) / stride : avail / stride) + 1;
  // PyTorch: the last window must start inside the input or the left padding.
  if (ceil_mode && (out - 1) * stride >= in.size() + pad) --out;
  return Dim(out);
}

}  // namespace kg::ops
