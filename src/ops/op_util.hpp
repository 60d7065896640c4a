// Helpers shared by the built-in op families: dim normalisation, float dispatch, broadcasting.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kg/custom_op.hpp"
#include "kg/error.hpp"
#include "kg/runtime_op.hpp"
#include "kg/shape.hpp"
#include "util/str.hpp"

namespace kg::ops {

// A dim index counted from the end when negative, checked against `rank`.
inline std::int64_t normalize_dim(std::int64_t dim, std::size_t rank, const char* what = "dim") {
  auto r = static_cast<std::int64_t>(rank);
  std::int64_t d = dim < 0 ? dim + r : dim;
  if (d < 0 || d >= r)
    throw Error(util::cat(what, " ", dim, " is out of range for rank ", rank));
  return d;
}

// Throws unless the input has exactly `rank` dims; `layout` describes them ("[N, C, H, W]").
inline void require_rank(const Shape& s, std::size_t rank, const char* layout) {
  if (s.rank() != rank)
    throw Error(util::cat("expects a ", rank, "-D input ", layout, ", got ", rank == 1 ? "" : "",
                          s.rank(), "-D ", s.to_string()));
}

// Throws unless there are exactly `n` inputs.
inline void require_inputs(const std::vector<Shape>& in, std::size_t n) {
  if (in.size() != n) throw Error(util::cat("expects ", n, " input(s), got ", in.size()));
}

// Throws unless the dtype is f32 or f64 (what the CPU implementations compute in).
inline DType require_float(const std::vector<DType>& in) {
  if (in.empty()) throw Error("expects at least one input");
  for (DType t : in)
    if (t != DType::F32 && t != DType::F64)
      throw Error(util::cat("supports f32 and f64 inputs, got ", dtype_name(t)));
  for (DType t : in)
    if (t != in[0])
      throw Error(util::cat("inputs must share one dtype, got ", dtype_name(in[0]), " and ", dtype_name(t)));
  return in[0];
}

// Throws unless every dtype is f32, f64, f16 or bf16 and they are all the same; returns it.
DType require_float_or_half(const std::vector<DType>& in);

// The CPU form of an op computing in f16 or bf16 (CustomOp::computes_in) by way of its f32 one:
// the floating inputs and parameters are converted to f32, `f32_forward` runs on a context over
// the copies (its parallel_for is ctx's), and its output is rounded to nearest even into
// ctx.output. Correct, not fast.
void cpu_forward_in_f32(CpuContext& ctx, const std::function<void(CpuContext&)>& f32_forward);
// The same for a backward: every floating tensor converted, every wanted gradient rounded back.
void cpu_backward_in_f32(CpuBackwardContext& ctx, const std::function<void(CpuBackwardContext&)>& f32_backward);

// A CpuContext over other tensors whose parallel_for runs on an outer context's threads: how a
// fused op runs its parts' CPU forms one after another.
class SubContext final : public CpuContext {
 public:
  SubContext(const CpuContext& outer, std::span<const Tensor> inputs, std::span<const Tensor> params, Tensor output)
      : CpuContext(inputs, params, std::move(output), outer.training, outer.seed), outer_(outer) {}
  void parallel_for(std::int64_t n, std::int64_t grain, const RangeFn& fn) const override {
    outer_.parallel_for(n, grain, fn);
  }

 private:
  const CpuContext& outer_;
};

// A tensor over scratch memory owned by the calling thread (64-byte aligned, kept between calls):
// how a fused op's CPU form holds the value between its parts. Valid until the same thread calls
// again, so the caller must be done with it before anything it runs could call it.
Tensor thread_scratch_tensor(DType dtype, const std::vector<std::int64_t>& shape);

// 16 hex digits of the 64-bit FNV-1a hash of `s`: how a generated kernel's entry is named after
// its description.
std::string hex_hash(const std::string& s);

// Calls fn(T{}) with T = float or double according to the tensor's dtype.
template <class F> void dispatch_float(DType t, F&& fn) {
  if (t == DType::F32)
    fn(float{});
  else if (t == DType::F64)
    fn(double{});
  else
    throw Error(util::cat("CPU implementation supports f32 and f64, got ", dtype_name(t)));
}

// The copy kernel of an op family for a dtype, by element width: "<stem>_u8" ... "<stem>_u64".
inline std::string width_entry(const std::string& stem, DType t) {
  switch (dtype_size(t)) {
    case 1: return stem + "_u8";
    case 2: return stem + "_u16";
    case 4: return stem + "_u32";
    case 8: return stem + "_u64";
    default:
      throw Error(util::cat(stem, ": no copy kernel for ", dtype_name(t), " (", dtype_size(t), " bytes)"));
  }
}

// Calls fn(E{}) with E the unsigned integer of the element width, so that copies handle any dtype.
template <class F>
void dispatch_width(std::size_t width, F&& fn) {
  switch (width) {
    case 1: fn(std::uint8_t{}); return;
    case 2: fn(std::uint16_t{}); return;
    case 4: fn(std::uint32_t{}); return;
    case 8: fn(std::uint64_t{}); return;
    default: throw Error(util::cat("unsupported element width ", width));
  }
}

// `v` as a C++ double expression for generated kernel source: the shortest literal that reads back
// exactly, or the bit pattern for infinities and NaN.
std::string device_literal(double v);

// numpy broadcasting of two symbolic shapes. A dynamic dim against 1 stays dynamic; two
// dynamic dims give the first (they must agree at load, where shapes are concrete).
Shape broadcast_shapes(const Shape& a, const Shape& b);

// Broadcast gradients: the sum of `src` (contiguous, of shape `out`) over the dims where `target`
// is broadcast (numpy rules), written to `dst` as `target`'s elements in order (negated when
// `negate`). Every element of dst is overwritten; an empty `out` gives zeros. Defined in
// ops/elementwise.cpp, where nn.add's backward uses them; kg.fused_elementwise's too.
// On the CPU (f32, f64), in fixed order whatever the threads:
template <class T>
void sum_to_shape(const CpuContext& ctx, const T* src, const std::vector<std::int64_t>& out,
                  const std::vector<std::int64_t>& target, T* dst, bool negate = false);
// On the GPU: the launches of `entry`, a kernel of a module that includes elementwise.cuh with
// nn.add's backward signature, entry(dy, a, b, g, partial, KgReduce, which, phase), calling
// kg_binary_backward_entry<KG_ADD> (a and b are passed null). `partial` is
// gpu_sum_to_shape_scratch() bytes of scratch (none is needed when that is 0). `op_name` is for
// the error when the shapes need more dims than the kernel walks.
std::vector<Launch> gpu_sum_to_shape(const std::string& entry, DevicePtr src, DevicePtr dst, DevicePtr partial,
                                     const std::vector<std::int64_t>& out, const std::vector<std::int64_t>& target,
                                     const char* op_name);
std::size_t gpu_sum_to_shape_scratch(const std::vector<std::int64_t>& out, const std::vector<std::int64_t>& target,
                                     DType dtype, const char* op_name);

// Output dim of a sliding window (conv, pooling): floor or ceil of
// (in + 2*pad - dilation*(k-1) - 1) / stride + 1, following PyTorch's ceil_mode rule.
Dim window_out(const Dim& in, std::int64_t k, std::int64_t stride, std::int64_t pad,
               std::int64_t dilation, bool ceil_mode, const char* what);

}  // namespace kg::ops
