// The index_ops family (index_ops.hpp): ONNX data movement and indexing for every dtype, copied
// by element width. index.expand, index.tile, index.pad and index.slice are one "index map"
// each: every output dim reads input index start + o * step of an input dim, an index outside
// it mapped by the pad mode (IndexMap below); the CPU and the GPU kernel (kg_index_map in
// index_ops.cu) run the same map, merged the same way. index.gather and index.gather_elements
// read indices (i32 or i64): an index out of range is an error on the CPU and clamped on the GPU.
// index.range, index.constant_of_shape and index.shape only read their inputs' shapes.
// The ops that move floating data (the gathers and the index maps) compute in f16 and bf16
// (CustomOp::computes_in) as they are: their copies go by width, index.pad's constant is rounded
// into the dtype (element_bits). index.range and index.constant_of_shape make the dtype their
// attribute names, so they do not: a 16-bit model keeps theirs and casts after them.
#include "ops/index_ops.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <span>
#include <type_traits>

#include "ops/divider.hpp"
#include "ops/gpu_util.hpp"
#include "ops/index_ops_shared.cuh"
#include "ops/op_util.hpp"

namespace kg::ops {
namespace {

constexpr unsigned kIndexThreads = KG_INDEX_THREADS;
constexpr std::int64_t kInt64Max = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t kInt64Min = std::numeric_limits<std::int64_t>::min();

const std::string& source() { return kernel_file("index_ops.cu"); }



// Row-major strides (elements) of a concrete shape.
std::vector<std::int64_t> strides_of(const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> s(shape.size());
  std::int64_t st = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    s[i] = st;
    st *= shape[i];
  }
  return s;
}

std::vector<std::vector<std::int64_t>> shapes_of(std::span<const Tensor> ts) {
  std::vector<std::vector<std::int64_t>> v;
  for (const Tensor& t : ts) v.push_back(t.shape());
  return v;
}
std::vector<std::vector<std::int64_t>> shapes_of(const std::vector<DeviceTensor>& ts) {
  std::vector<std::vector<std::int64_t>> v;
  for (const DeviceTensor& t : ts) v.push_back(t.shape);
  return v;
}

// Throws unless `value` is exactly an element of `dtype`: an integer in range for the integer
// dtypes, 0 or 1 for bool (floats take any value, rounded).
void require_representable(double value, DType dtype, const char* what) {
  if (is_floating(dtype)) return;
  double lo = 0, hi = 0;
  switch (dtype) {
    case DType::Bool:
      lo = 0, hi = 1;
      break;
    case DType::I8:
      lo = -128, hi = 127;
      break;
    case DType::I16:
      lo = -32768, hi = 32767;
      break;
    case DType::I32:
      lo = -2147483648.0, hi = 2147483647.0;
      break;
    case DType::I64:
      lo = -9223372036854775808.0, hi = 9223372036854774784.0;  // the largest double below 2^63
      break;
    case DType::U8:
      lo = 0, hi = 255;
      break;
    default:
      break;
  }
  if (!(std::isfinite(value) && std::trunc(value) == value && value >= lo && value <= hi))
    throw Error(util::cat(what, " ", value, " is not a value of ", dtype_name(dtype), " (",
                          dtype == DType::Bool ? "0 or 1"
                                               : util::cat("an integer in [", static_cast<std::int64_t>(lo),
                                                           ", ", static_cast<std::int64_t>(hi), "]"),
                          ")"));
}

// The bytes of `value` as one element of `dtype`, low bytes first (the kernels take them so).
std::uint64_t element_bits(double value, DType dtype) {
  Tensor t = Tensor::empty(dtype, {});
  t.fill(value);
  std::uint64_t bits = 0;
  std::memcpy(&bits, t.raw(), dtype_size(dtype));
  return bits;
}

// The index at position j of an i32 or i64 index tensor.
std::int64_t index_at(const Tensor& idx, std::int64_t j) {
  return idx.dtype() == DType::I32 ? idx.data<std::int32_t>()[j] : idx.data<std::int64_t>()[j];
}

void require_index_dtype(const std::vector<DType>& in) {
  if (in.size() != 2) throw Error(util::cat("expects 2 inputs (data, indices), got ", in.size()));
  if (in[1] != DType::I32 && in[1] != DType::I64)
    throw Error(util::cat("expects i32 or i64 indices, got ", dtype_name(in[1])));
}

// Every index of `idx` normalised into [0, n) (negative ones count from the end); throws naming
// the first one outside [-n, n).
std::vector<std::int64_t> normalized_indices(const Tensor& idx, std::int64_t n, std::int64_t axis,
                                             const std::vector<std::int64_t>& data_shape) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(idx.numel()));
  for (std::int64_t j = 0; j < idx.numel(); ++j) {
    const std::int64_t k = index_at(idx, j);
    if (k < -n || k >= n) {
      std::vector<std::int64_t> at(idx.rank(), 0);
      std::int64_t rem = j;
      for (std::size_t d = idx.rank(); d-- > 0;) {
        at[d] = rem % idx.shape()[d];
        rem /= idx.shape()[d];
      }
      throw Error(util::cat("index ", k, " at ", sizes_to_string(at), " of indices ",
                            sizes_to_string(idx.shape()), " is out of range for axis ", axis, " of data ",
                            sizes_to_string(data_shape), " (size ", n, "): valid indices are in [", -n, ", ",
                            n, ")"));
    }
    v[static_cast<std::size_t>(j)] = k < 0 ? k + n : k;
  }
  return v;
}

// ---- the index map ----

// Output dim of `size` reading input index start + o * step of an input dim of `in_size`
// elements, `stride` elements apart (see KgIndexMapArgs).
struct MapDim {
  std::int64_t size, start, step, in_size, stride;
  bool plain() const { return start == 0 && step == 1 && in_size == size; }
  bool broadcast() const { return start == 0 && step == 0 && in_size >= 1; }
};

// The input index output index `o` reads, or -1 for the constant (kg_map_index in the kernel).
std::int64_t map_index(std::int64_t o, const MapDim& d, int mode) {
  std::int64_t k = d.start + o * d.step;
  if (k >= 0 && k < d.in_size) return k;
  switch (mode) {
    case KG_MAP_EDGE:
      return k < 0 ? 0 : d.in_size - 1;
    case KG_MAP_REFLECT:
      return k < 0 ? -k : 2 * (d.in_size - 1) - k;
    case KG_MAP_WRAP:
      k %= d.in_size;
      return k < 0 ? k + d.in_size : k;
    default:
      return -1;
  }
}

// A copy as the CPU and the kernel run it: output dims of size 1 folded into `base`, adjacent
// dims that are both plain (and adjacent in the input) or both broadcast merged.
struct IndexMap {
  std::vector<MapDim> dims;
  int mode = KG_MAP_CONSTANT;
  std::uint64_t value = 0;
  std::int64_t base = 0;
  std::int64_t total = 0;

  IndexMap() = default;
  IndexMap(const std::vector<MapDim>& full, int m, std::uint64_t v) : mode(m), value(v) {
    total = 1;
    for (const MapDim& d : full) total *= d.size;
    for (const MapDim& d : full) {
      if (d.size == 1) {
        if (const std::int64_t k = map_index(0, d, mode); k >= 0) {
          base += k * d.stride;
          continue;
        }
      }
      if (!dims.empty()) {
        MapDim& a = dims.back();
        if (a.plain() && d.plain() && a.stride == d.stride * d.size) {
          a = {a.size * d.size, 0, 1, a.size * d.size, d.stride};
          continue;
        }
        if (a.broadcast() && d.broadcast()) {
          a = {a.size * d.size, 0, 0, 1, 0};
          continue;
        }
      }
      dims.push_back(d);
    }
    if (dims.empty()) dims.push_back({1, 0, 0, 1, 0});
  }

  // The kernel's arguments; at most KG_INDEX_MAX_DIMS dims (see launches()).
  KgIndexMapArgs args() const {
    KgIndexMapArgs a{};
    a.total = total;
    a.rank = std::ssize(dims);
    a.mode = mode;
    a.value = value;
    a.base = base;
    for (int d = 0; d < KG_INDEX_MAX_DIMS; ++d) {
      const bool used = static_cast<std::size_t>(d) < dims.size();
      const MapDim m = used ? dims[static_cast<std::size_t>(d)] : MapDim{1, 0, 0, 1, 0};
      a.size[d] = kg_divider(m.size);
      a.start[d] = m.start;
      a.step[d] = m.step;
      a.in_size[d] = m.in_size;
      a.stride[d] = m.stride;
    }
    return a;
  }

  // The launches of kg_index_map `entry` from src to dst (elements of `width` bytes): one, or,
  // with more than KG_INDEX_MAX_DIMS dims, one per index of the leading dims, each writing its
  // contiguous block of the output (all constant where a leading index falls outside).
  std::vector<Launch> launches(const std::string& entry, DevicePtr src, DevicePtr dst,
                               std::size_t width) const {
    auto launch = [&](const IndexMap& m, DevicePtr to) {
      const KgIndexMapArgs a = m.args();
      return Launch{entry,
                    grid_1d((a.total + KG_UNROLL - 1) / KG_UNROLL, kIndexThreads),
                    {kIndexThreads, 1, 1},
                    0,
                    {ptr(src), ptr(to), raw_bytes(&a, sizeof a)}};
    };
    const std::size_t r = dims.size(), inner_rank = KG_INDEX_MAX_DIMS;
    if (r <= inner_rank || total == 0) {
      if (r <= inner_rank) return {launch(*this, dst)};
      IndexMap empty;
      empty.dims = {{0, 0, 1, 0, 0}};
      return {launch(empty, dst)};
    }
    const std::size_t lead = r - inner_rank;
    IndexMap block;
    block.mode = mode;
    block.value = value;
    block.dims.assign(dims.begin() + static_cast<std::ptrdiff_t>(lead), dims.end());
    block.total = 1;
    for (const MapDim& d : block.dims) block.total *= d.size;
    IndexMap fill;  // every index outside an empty input dim: the constant
    fill.value = value;
    fill.total = block.total;
    fill.dims = {{block.total, 0, 1, 0, 0}};
    std::vector<Launch> v;
    const std::int64_t blocks = total / block.total;
    for (std::int64_t c = 0; c < blocks; ++c) {
      std::int64_t rem = c, off = base;
      bool outside = false;
      for (std::size_t d = lead; d-- > 0;) {
        const std::int64_t k = map_index(rem % dims[d].size, dims[d], mode);
        rem /= dims[d].size;
        if (k < 0)
          outside = true;
        else
          off += k * dims[d].stride;
      }
      block.base = off;
      v.push_back(launch(outside ? fill : block, dst + static_cast<DevicePtr>(c * block.total) * width));
    }
    return v;
  }

  // dst = the map of src on the CPU, row by row (a row: the last merged dim).
  void run(const CpuContext& ctx, const void* src_raw, void* dst_raw, std::size_t width) const {
    if (total == 0) return;
    dispatch_width(width, [&](auto zero) {
      using E = decltype(zero);
      const E* src = static_cast<const E*>(src_raw);
      E* dst = static_cast<E*>(dst_raw);
      const E fill = static_cast<E>(value);
      const MapDim& last = dims.back();
      const std::size_t r = dims.size();
      const std::int64_t rows = total / last.size;
      const bool contiguous = last.plain() && last.stride == 1;
      ctx.parallel_for(rows, std::max<std::int64_t>(1, 16384 / last.size),
                       [&](std::int64_t r0, std::int64_t r1) {
                         for (std::int64_t row = r0; row < r1; ++row) {
                           std::int64_t rem = row, off = base;
                           bool outside = false;
                           for (std::size_t d = r - 1; d-- > 0;) {
                             const std::int64_t k = map_index(rem % dims[d].size, dims[d], mode);
                             rem /= dims[d].size;
                             if (k < 0)
                               outside = true;
                             else
                               off += k * dims[d].stride;
                           }
                           E* out = dst + row * last.size;
                           if (outside) {
                             std::fill_n(out, last.size, fill);
                           } else if (contiguous) {
                             std::memcpy(out, src + off, static_cast<std::size_t>(last.size) * sizeof(E));
                           } else {
                             for (std::int64_t j = 0; j < last.size; ++j) {
                               const std::int64_t k = map_index(j, last, mode);
                               out[j] = k < 0 ? fill : src[off + k * last.stride];
                             }
                           }
                         }
                       });
    });
  }
};

using MapPlan =
    std::function<IndexMap(const std::vector<std::int64_t>& in, const std::vector<std::int64_t>& out)>;

// The GPU half of the index map ops: launches of kg_index_map_<width> (IndexMap::launches).
class MapRuntime final : public RuntimeOp {
 public:
  MapRuntime(std::string entry, MapPlan plan) : entry_(std::move(entry)), plan_(std::move(plan)) {}
  std::vector<Launch> launches(const LaunchTensors& t) const override {
    return plan_(t.inputs.at(0).shape, t.output.shape)
        .launches(entry_, t.inputs[0].ptr, t.output.ptr, dtype_size(t.output.dtype));
  }

 private:
  std::string entry_;
  MapPlan plan_;
};

// An op that is an index map of its first input: `Derived::plan(dtype, in, out)` describes it.
template <class Derived>
class MapOp : public CustomOp {
 public:
  bool computes_in(DType t) const override { return is_half_float(t); }
  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    const Derived self = static_cast<const Derived&>(*this);
    const DType dtype = ctx.output_dtype;
    const std::string entry = width_entry("kg_index_map", dtype);
    return Lowered{name(), source(), entry,
                   std::make_shared<MapRuntime>(entry, [self, dtype](const auto& in, const auto& out) {
                     return self.plan(dtype, in, out);
                   })};
  }
  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    static_cast<const Derived&>(*this)
        .plan(ctx.output.dtype(), x.shape(), ctx.output.shape())
        .run(ctx, x.raw(), ctx.output.raw(), dtype_size(ctx.output.dtype()));
  }
};

// ---- index.gather ----

// data [outer, n, inner] and `count` indices: out[o, j, r] = data[o, indices[j], r].
struct GatherDims {
  std::size_t axis;
  std::int64_t outer = 1, n, inner = 1;
};
GatherDims gather_dims(const std::vector<std::int64_t>& data, std::int64_t axis) {
  GatherDims g{static_cast<std::size_t>(normalize_dim(axis, data.size(), "axis")), 1, 0, 1};
  g.n = data[g.axis];
  for (std::size_t i = 0; i < data.size(); ++i) {
    if (i < g.axis) g.outer *= data[i];
    if (i > g.axis) g.inner *= data[i];
  }
  return g;
}

std::string index_suffix(DType t) { return t == DType::I32 ? "_i32" : "_i64"; }

// A launch of kg_index_fill writing zeros over `out`: what a gather from an empty axis, where no
// index is valid, gives on the GPU.
Launch zero_fill(const DeviceTensor& out) {
  const std::int64_t n = numel_of(out.shape);
  return {width_entry("kg_index_fill", out.dtype),
          grid_1d(n, kIndexThreads),
          {kIndexThreads, 1, 1},
          0,
          {out, n, std::int64_t{0}}};
}

// index.gather on the GPU: kg_gather_<width>_<index dtype>(data, indices, out, total, inner,
// count, n); indices out of range are clamped by the kernel.
class GatherRuntime final : public RuntimeOp {
 public:
  GatherRuntime(std::int64_t axis, std::string entry) : axis_(axis), entry_(std::move(entry)) {}
  std::vector<Launch> launches(const LaunchTensors& t) const override {
    const GatherDims g = gather_dims(t.inputs.at(0).shape, axis_);
    const std::int64_t total = numel_of(t.output.shape), count = numel_of(t.inputs.at(1).shape);
    if (g.n == 0 && total > 0) return {zero_fill(t.output)};  // no index is valid (the CPU says which)
    const KgDivider inner = kg_divider(g.inner), cnt = kg_divider(count);
    return {{entry_,
             grid_1d((total + KG_UNROLL - 1) / KG_UNROLL, kIndexThreads),
             {kIndexThreads, 1, 1},
             0,
             {t.inputs[0], t.inputs[1], t.output, total, raw_bytes(&inner, sizeof inner),
              raw_bytes(&cnt, sizeof cnt), g.n}}};
  }

 private:
  std::int64_t axis_;
  std::string entry_;
};

class GatherOp final : public CustomOp {
 public:
  explicit GatherOp(std::int64_t axis) : axis_(axis) {}
  std::string name() const override { return "index.gather"; }
  std::string attributes() const override { return util::cat("axis=", axis_); }
  bool computes_in(DType t) const override { return is_half_float(t); }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 2);
    const Shape &data = in[0], &idx = in[1];
    if (data.rank() == 0) throw Error(util::cat("cannot gather from a scalar data ", data.to_string()));
    const auto a = static_cast<std::size_t>(normalize_dim(axis_, data.rank(), "axis"));
    Shape out;
    for (std::size_t i = 0; i < a; ++i) out.push_back(data[i]);
    for (const Dim& d : idx) out.push_back(d);
    for (std::size_t i = a + 1; i < data.rank(); ++i) out.push_back(data[i]);
    return out;
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override {
    require_index_dtype(in);
    return in[0];
  }

  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    const std::string entry =
        width_entry("kg_gather", ctx.output_dtype) + index_suffix(ctx.input_dtypes.at(1));
    return Lowered{name(), source(), entry, std::make_shared<GatherRuntime>(axis_, entry)};
  }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor &data = ctx.inputs[0], &idx = ctx.inputs[1];
    const GatherDims g = gather_dims(data.shape(), axis_);
    const std::vector<std::int64_t> k =
        normalized_indices(idx, g.n, static_cast<std::int64_t>(g.axis), data.shape());
    const auto count = static_cast<std::int64_t>(k.size());
    const std::int64_t row = g.inner * static_cast<std::int64_t>(dtype_size(data.dtype()));
    if (g.outer * count * row == 0) return;
    const auto* src = static_cast<const std::byte*>(data.raw());
    auto* dst = static_cast<std::byte*>(ctx.output.raw());
    // One row of `inner` elements per (outer, index) pair.
    ctx.parallel_for(g.outer * count, std::max<std::int64_t>(1, 65536 / row),
                     [&](std::int64_t q0, std::int64_t q1) {
                       for (std::int64_t q = q0; q < q1; ++q) {
                         const std::int64_t o = q / count, j = q % count;
                         std::memcpy(dst + q * row, src + (o * g.n + k[static_cast<std::size_t>(j)]) * row,
                                     static_cast<std::size_t>(row));
                       }
                     });
  }

 private:
  std::int64_t axis_;
};

// ---- index.gather_elements ----

// index.gather_elements on the GPU: kg_gather_elements_<width>_<index dtype>(data, indices, out,
// args); indices out of range are clamped by the kernel. Dims are merged first (size-1 dims
// dropped; two neighbours other than the axis merged where they are adjacent in the data too);
// past KG_INDEX_MAX_DIMS, one launch per index of the leading dims writes its block of the output.
class GatherElementsRuntime final : public RuntimeOp {
 public:
  GatherElementsRuntime(std::int64_t axis, std::string entry) : axis_(axis), entry_(std::move(entry)) {}
  std::vector<Launch> launches(const LaunchTensors& t) const override {
    const auto& data = t.inputs.at(0).shape;
    const auto& out = t.output.shape;
    const auto a = static_cast<std::size_t>(normalize_dim(axis_, data.size(), "axis"));
    const std::int64_t total = numel_of(out);
    if (data[a] == 0 && total > 0) return {zero_fill(t.output)};  // no index is valid (the CPU says which)
    // The output's dims and the data's strides, merged; `ax` the gathered dim among them.
    const std::vector<std::int64_t> data_stride = strides_of(data);
    std::vector<std::int64_t> size, stride;
    std::size_t ax = 0;
    for (std::size_t d = 0; d < out.size(); ++d) {
      if (d == a) {
        ax = size.size();
        size.push_back(out[d]);
        stride.push_back(data_stride[d]);
      } else if (out[d] == 1) {
        continue;  // index 0: no offset
      } else if (!size.empty() && size.size() - 1 != ax && stride.back() == data_stride[d] * out[d]) {
        size.back() *= out[d];
        stride.back() = data_stride[d];
      } else {
        size.push_back(out[d]);
        stride.push_back(data_stride[d]);
      }
    }
    const std::size_t r = size.size(), kernel_rank = std::min<std::size_t>(r, KG_INDEX_MAX_DIMS);
    const std::size_t lead = r - kernel_rank;
    KgGatherElementsArgs p{};
    p.rank = static_cast<long long>(kernel_rank);
    p.axis = ax >= lead ? static_cast<long long>(ax - lead) : -1;
    p.axis_size = data[a];
    p.axis_stride = stride[ax];
    p.total = 1;
    for (std::size_t d = 0; d < KG_INDEX_MAX_DIMS; ++d) {
      const bool used = d < kernel_rank;
      p.size[d] = kg_divider(used ? size[lead + d] : 1);
      p.stride[d] = used ? stride[lead + d] : 0;
      if (used) p.total *= size[lead + d];
    }
    const std::size_t es = dtype_size(t.output.dtype), is = dtype_size(t.inputs.at(1).dtype);
    std::vector<Launch> v;
    const std::int64_t blocks = lead == 0 || total == 0 ? 1 : total / p.total;
    if (total == 0) p.total = 0;
    for (std::int64_t c = 0; c < blocks; ++c) {
      // The data offset of the leading dims' index c (the gathered dim's comes from the indices).
      std::int64_t rem = c, off = 0;
      for (std::size_t d = lead; d-- > 0;) {
        if (d != ax) off += (rem % size[d]) * stride[d];
        rem /= size[d];
      }
      const auto block = static_cast<DevicePtr>(c * p.total);
      v.push_back(
          {entry_,
           grid_1d((p.total + KG_UNROLL - 1) / KG_UNROLL, kIndexThreads),
           {kIndexThreads, 1, 1},
           0,
           {ptr(t.inputs[0].ptr + static_cast<DevicePtr>(off) * es), ptr(t.inputs[1].ptr + block * is),
            ptr(t.output.ptr + block * es), raw_bytes(&p, sizeof p)}});
    }
    return v;
  }

 private:
  std::int64_t axis_;
  std::string entry_;
};

class GatherElementsOp final : public CustomOp {
 public:
  explicit GatherElementsOp(std::int64_t axis) : axis_(axis) {}
  std::string name() const override { return "index.gather_elements"; }
  std::string attributes() const override { return util::cat("axis=", axis_); }
  bool computes_in(DType t) const override { return is_half_float(t); }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 2);
    const Shape &data = in[0], &idx = in[1];
    if (data.rank() == 0) throw Error(util::cat("cannot gather from a scalar data ", data.to_string()));
    if (idx.rank() != data.rank())
      throw Error(util::cat("indices ", idx.to_string(), " have rank ", idx.rank(), " but data ",
                            data.to_string(), " has rank ", data.rank(), "; they must have the same rank"));
    const auto a = static_cast<std::size_t>(normalize_dim(axis_, data.rank(), "axis"));
    for (std::size_t d = 0; d < data.rank(); ++d)
      if (d != a && data[d].is_static() && idx[d].is_static() && idx[d].size() > data[d].size())
        throw Error(util::cat("indices ", idx.to_string(), " are larger than data ", data.to_string(),
                              " in dim ", d, " (", idx[d].size(), " vs ", data[d].size(), "); only axis ", a,
                              " may be larger"));
    return idx;
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override {
    require_index_dtype(in);
    return in[0];
  }

  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    const std::string entry =
        width_entry("kg_gather_elements", ctx.output_dtype) + index_suffix(ctx.input_dtypes.at(1));
    return Lowered{name(), source(), entry, std::make_shared<GatherElementsRuntime>(axis_, entry)};
  }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor &data = ctx.inputs[0], &idx = ctx.inputs[1];
    const auto& ds = data.shape();
    const auto& os = idx.shape();
    const auto a = static_cast<std::size_t>(normalize_dim(axis_, ds.size(), "axis"));
    const std::vector<std::int64_t> k = normalized_indices(idx, ds[a], static_cast<std::int64_t>(a), ds);
    const std::vector<std::int64_t> stride = strides_of(ds);
    const std::int64_t total = idx.numel();
    if (total == 0) return;
    dispatch_width(dtype_size(data.dtype()), [&](auto zero) {
      using E = decltype(zero);
      const E* src = static_cast<const E*>(data.raw());
      E* dst = static_cast<E*>(ctx.output.raw());
      ctx.parallel_for(total, 16384, [&](std::int64_t i0, std::int64_t i1) {
        for (std::int64_t i = i0; i < i1; ++i) {
          std::int64_t rem = i, off = 0;
          for (std::size_t d = os.size(); d-- > 0;) {
            const std::int64_t c = rem % os[d];
            rem /= os[d];
            off += (d == a ? k[static_cast<std::size_t>(i)] : c) * stride[d];
          }
          dst[i] = src[off];
        }
      });
    });
  }

 private:
  std::int64_t axis_;
};

// ---- index.expand ----

// The sizes of `refs` against the op's inputs, each non-negative.
Shape resolve_sizes(const std::vector<DimRef>& refs, const std::vector<Shape>& in, const char* what) {
  for (std::size_t i = 0; i < refs.size(); ++i)
    if (refs[i].is_constant() && refs[i].value < 0)
      throw Error(
          util::cat(what, " ", dims_to_string(refs), " has a negative size ", refs[i].value, " at ", i));
  return resolve_dims(refs, in);
}

// numpy broadcasting of one dim of x against one of the target shape.
Dim broadcast_dim(const Dim& a, const Dim& b) {
  if (a.is_static() && a.size() == 1) return b;
  if (b.is_static() && b.size() == 1) return a;
  if (a.is_static()) return a;  // b must be a's size (or 1) at load
  if (b.is_static()) return b;
  if (a == b) return a;  // the same symbol
  return Dim(dynamic);
}

class ExpandOp final : public MapOp<ExpandOp> {
 public:
  explicit ExpandOp(std::vector<DimRef> shape) : shape_(std::move(shape)) {}
  std::string name() const override { return "index.expand"; }
  std::string attributes() const override { return util::cat("shape=", dims_to_string(shape_)); }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    if (in.empty()) throw Error("expects the input x and the shape sources, got no input");
    const Shape& x = in[0];
    const Shape target = resolve_sizes(shape_, in, "shape");
    const std::size_t rank = std::max(x.rank(), target.rank());
    Shape out;
    for (std::size_t i = 0; i < rank; ++i) {
      const Dim a = i + x.rank() >= rank ? x[i + x.rank() - rank] : Dim(1);
      const Dim b = i + target.rank() >= rank ? target[i + target.rank() - rank] : Dim(1);
      if (a.is_static() && b.is_static() && a.size() != b.size() && a.size() != 1 && b.size() != 1)
        throw Error(util::cat("cannot expand ", x.to_string(), " to ", target.to_string(), ": output dim ", i,
                              " is ", a.size(), " in the input and ", b.size(),
                              " in the shape (they must be equal or one of them 1)"));
      out.push_back(broadcast_dim(a, b));
    }
    return out;
  }

  IndexMap plan(DType, const std::vector<std::int64_t>& x, const std::vector<std::int64_t>& out) const {
    const std::vector<std::int64_t> stride = strides_of(x);
    const std::size_t r = out.size(), lead = r - x.size();
    std::vector<MapDim> dims;
    for (std::size_t d = 0; d < r; ++d) {
      if (d < lead) {
        dims.push_back({out[d], 0, 0, 1, 0});
        continue;
      }
      const std::int64_t n = x[d - lead];
      if (n == 1 && out[d] != 1)
        dims.push_back({out[d], 0, 0, 1, stride[d - lead]});
      else
        dims.push_back({out[d], 0, 1, n, stride[d - lead]});
    }
    return IndexMap(dims, KG_MAP_CONSTANT, 0);
  }

 private:
  std::vector<DimRef> shape_;
};

// ---- index.tile ----

class TileOp final : public MapOp<TileOp> {
 public:
  explicit TileOp(std::vector<std::int64_t> repeats) : repeats_(std::move(repeats)) {}
  std::string name() const override { return "index.tile"; }
  std::string attributes() const override { return util::cat("repeats=", sizes_to_string(repeats_)); }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    const Shape& x = in[0];
    if (repeats_.size() != x.rank())
      throw Error(util::cat("repeats ", sizes_to_string(repeats_), " have ", repeats_.size(),
                            " entries for an input of rank ", x.rank(), " ", x.to_string()));
    Shape out;
    for (std::size_t i = 0; i < x.rank(); ++i) {
      const std::int64_t r = repeats_[i];
      if (r < 0)
        throw Error(
            util::cat("repeats ", sizes_to_string(repeats_), " have a negative entry ", r, " at ", i));
      if (x[i].is_static())
        out.push_back(Dim(x[i].size() * r));
      else
        out.push_back(r == 1 ? x[i] : r == 0 ? Dim(0) : Dim(dynamic));
    }
    return out;
  }

  IndexMap plan(DType, const std::vector<std::int64_t>& x, const std::vector<std::int64_t>& out) const {
    const std::vector<std::int64_t> stride = strides_of(x);
    std::vector<MapDim> dims;
    for (std::size_t d = 0; d < x.size(); ++d) dims.push_back({out[d], 0, 1, x[d], stride[d]});
    return IndexMap(dims, KG_MAP_WRAP, 0);
  }

 private:
  std::vector<std::int64_t> repeats_;
};

// ---- index.pad ----

int map_mode(PadMode m) {
  switch (m) {
    case PadMode::Reflect:
      return KG_MAP_REFLECT;
    case PadMode::Edge:
      return KG_MAP_EDGE;
    case PadMode::Wrap:
      return KG_MAP_WRAP;
    default:
      return KG_MAP_CONSTANT;
  }
}

class PadOp final : public MapOp<PadOp> {
 public:
  PadOp(std::vector<std::int64_t> begin, std::vector<std::int64_t> end, PadMode mode, double value)
      : begin_(std::move(begin)), end_(std::move(end)), mode_(mode), value_(value) {}
  std::string name() const override { return "index.pad"; }
  std::string attributes() const override {
    return util::cat("begin=", sizes_to_string(begin_), " end=", sizes_to_string(end_),
                     " mode=", pad_mode_name(mode_),
                     mode_ == PadMode::Constant ? util::cat(" value=", value_) : "");
  }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    const Shape& x = in[0];
    if (begin_.size() != x.rank() || end_.size() != x.rank())
      throw Error(util::cat("pads begin ", sizes_to_string(begin_), " and end ", sizes_to_string(end_),
                            " have ", begin_.size(), " and ", end_.size(), " entries for an input of rank ",
                            x.rank(), " ", x.to_string()));
    Shape out;
    for (std::size_t i = 0; i < x.rank(); ++i) {
      const std::int64_t b = begin_[i], e = end_[i];
      if (x[i].is_dynamic()) {
        out.push_back(b + e == 0 ? x[i] : Dim(dynamic));  // the same size
        continue;
      }
      const std::int64_t n = x[i].size(), o = n + b + e;
      if (o < 0)
        throw Error(util::cat("pads ", b, " and ", e, " crop dim ", i, " of ", x.to_string(), " (size ", n,
                              ") to ", o, " elements"));
      if (mode_ == PadMode::Reflect && ((b > 0 && b >= n) || (e > 0 && e >= n)))
        throw Error(util::cat("reflect padding needs each pad below the dim (pad < dim): dim ", i, " of ",
                              x.to_string(), " has size ", n, " and is padded by ", b, " before and ", e,
                              " after"));
      if ((mode_ == PadMode::Edge || mode_ == PadMode::Wrap) && n == 0 && o > 0)
        throw Error(util::cat(pad_mode_name(mode_), " padding cannot fill dim ", i, " of ", x.to_string(),
                              ": it is empty, so there is no element to repeat"));
      out.push_back(Dim(o));
    }
    return out;
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override {
    if (in.empty()) throw Error("expects 1 input, got none");
    if (mode_ == PadMode::Constant) require_representable(value_, in[0], "the constant pad value");
    return in[0];
  }

  // The constant's bytes in the output's dtype, where the mode uses them.
  IndexMap plan(DType dtype, const std::vector<std::int64_t>& x, const std::vector<std::int64_t>& out) const {
    const std::vector<std::int64_t> stride = strides_of(x);
    std::vector<MapDim> dims;
    for (std::size_t d = 0; d < x.size(); ++d) dims.push_back({out[d], -begin_[d], 1, x[d], stride[d]});
    return IndexMap(dims, map_mode(mode_), mode_ == PadMode::Constant ? element_bits(value_, dtype) : 0);
  }

 private:
  std::vector<std::int64_t> begin_, end_;
  PadMode mode_;
  double value_;
};

// ---- index.slice ----

// One axis of an ONNX slice against a dim of `n`: the first index taken and how many.
struct SliceRange {
  std::int64_t start, len;
};
SliceRange onnx_slice(std::int64_t n, std::int64_t start, std::int64_t end, std::int64_t step) {
  if (n == 0) return {0, 0};
  if (start < 0) start += n;
  if (end < 0) end += n;
  if (step > 0) {
    start = std::clamp<std::int64_t>(start, 0, n);
    end = std::clamp<std::int64_t>(end, 0, n);
    return {start, end > start ? (end - start - 1) / step + 1 : 0};
  }
  start = std::clamp<std::int64_t>(start, 0, n - 1);
  end = std::clamp<std::int64_t>(end, -1, n - 1);
  // -step without overflow for step = INT64_MIN.
  const std::uint64_t back = static_cast<std::uint64_t>(-(step + 1)) + 1;
  return {start, start > end
                     ? static_cast<std::int64_t>(static_cast<std::uint64_t>(start - end - 1) / back) + 1
                     : 0};
}

class SliceAxesOp final : public MapOp<SliceAxesOp> {
 public:
  SliceAxesOp(std::vector<std::int64_t> starts, std::vector<std::int64_t> ends,
              std::vector<std::int64_t> axes, std::vector<std::int64_t> steps)
      : starts_(std::move(starts)),
        ends_(std::move(ends)),
        axes_(std::move(axes)),
        steps_(std::move(steps)) {}
  std::string name() const override { return "index.slice"; }
  std::string attributes() const override {
    return util::cat("starts=", sizes_to_string(starts_), " ends=", sizes_to_string(ends_),
                     " axes=", sizes_to_string(axes_), " steps=", sizes_to_string(steps_));
  }

  // Per input dim: sliced (start, end, step) or not; checks the arguments against `rank`.
  struct Axis {
    bool sliced = false;
    std::int64_t start = 0, end = 0, step = 1;
  };
  std::vector<Axis> axes_for(std::size_t rank) const {
    const std::size_t k = starts_.size();
    if (ends_.size() != k || (!axes_.empty() && axes_.size() != k) || (!steps_.empty() && steps_.size() != k))
      throw Error(util::cat("starts ", sizes_to_string(starts_), ", ends ", sizes_to_string(ends_), ", axes ",
                            sizes_to_string(axes_), " and steps ", sizes_to_string(steps_),
                            " must have the same length (axes and steps may be empty)"));
    std::vector<Axis> v(rank);
    for (std::size_t i = 0; i < k; ++i) {
      const std::int64_t axis = axes_.empty() ? static_cast<std::int64_t>(i) : axes_[i];
      const auto d = static_cast<std::size_t>(normalize_dim(axis, rank, "axis"));
      const std::int64_t step = steps_.empty() ? 1 : steps_[i];
      if (step == 0)
        throw Error(util::cat("steps ", sizes_to_string(steps_), " have a 0 at ", i, "; a step is non-zero"));
      if (v[d].sliced)
        throw Error(
            util::cat("axes ", sizes_to_string(axes_), " name dim ", d, " twice; each axis is sliced once"));
      v[d] = {true, starts_[i], ends_[i], step};
    }
    return v;
  }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    const Shape& x = in[0];
    if (x.rank() == 0 && !starts_.empty()) throw Error(util::cat("cannot slice a scalar ", x.to_string()));
    const std::vector<Axis> ax = axes_for(x.rank());
    Shape out;
    for (std::size_t d = 0; d < x.rank(); ++d) {
      const Axis& a = ax[d];
      const Dim& D = x[d];
      if (!a.sliced) {
        out.push_back(D);
      } else if (D.is_static()) {
        out.push_back(Dim(onnx_slice(D.size(), a.start, a.end, a.step).len));
      } else if ((a.step == 1 && (a.start == 0 || a.start == kInt64Min) && a.end == kInt64Max) ||
                 (a.step == -1 && (a.start == -1 || a.start == kInt64Max) && a.end == kInt64Min)) {
        out.push_back(D);  // the whole dim, forwards or backwards
      } else if (a.start >= 0 && a.end >= 0 && (a.step > 0 ? a.end <= a.start : a.start <= a.end)) {
        out.push_back(Dim(0));  // empty whatever the size
      } else {
        out.push_back(Dim(dynamic));  // depends on the size, known at load
      }
    }
    return out;
  }

  IndexMap plan(DType, const std::vector<std::int64_t>& x, const std::vector<std::int64_t>&) const {
    const std::vector<std::int64_t> stride = strides_of(x);
    const std::vector<Axis> ax = axes_for(x.size());
    std::vector<MapDim> dims;
    for (std::size_t d = 0; d < x.size(); ++d) {
      if (!ax[d].sliced) {
        dims.push_back({x[d], 0, 1, x[d], stride[d]});
        continue;
      }
      const SliceRange s = onnx_slice(x[d], ax[d].start, ax[d].end, ax[d].step);
      dims.push_back({s.len, s.start, ax[d].step, x[d], stride[d]});
    }
    return IndexMap(dims, KG_MAP_CONSTANT, 0);
  }

 private:
  std::vector<std::int64_t> starts_, ends_, axes_, steps_;
};

// ---- index.range ----

// Elements of [start, limit) in steps of delta: max(ceil((limit - start) / delta), 0).
std::int64_t range_length(std::int64_t start, std::int64_t limit, std::int64_t delta) {
  std::int64_t span = 0;
  if (delta > 0 ? limit <= start : limit >= start) return 0;
  if (__builtin_sub_overflow(delta > 0 ? limit : start, delta > 0 ? start : limit, &span))
    throw Error(util::cat("the range from ", start, " to ", limit, " has more than 2^63 elements"));
  const std::uint64_t step =
      delta > 0 ? static_cast<std::uint64_t>(delta) : static_cast<std::uint64_t>(-(delta + 1)) + 1;
  return static_cast<std::int64_t>((static_cast<std::uint64_t>(span) - 1) / step) + 1;
}

void require_range_dtype(DType t) {
  if (t != DType::I32 && t != DType::I64 && t != DType::F32 && t != DType::F64)
    throw Error(util::cat("supports i32, i64, f32 and f64, got ", dtype_name(t)));
}

std::string range_entry(DType t) { return util::cat("kg_index_range_", dtype_name(t)); }

class RangeOp final : public CustomOp {
 public:
  RangeOp(DType dtype, std::int64_t start, DimRef limit, std::int64_t delta)
      : dtype_(dtype), start_(start), limit_(limit), delta_(delta) {}
  std::string name() const override { return "index.range"; }
  std::string attributes() const override {
    return util::cat("dtype=", dtype_name(dtype_), " start=", start_, " limit=", limit_.to_string(),
                     " delta=", delta_);
  }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_range_dtype(dtype_);
    if (delta_ == 0) throw Error("delta must be non-zero, got 0");
    // A constant limit may be negative; a dim of an input is a size.
    const Dim limit = limit_.is_constant() ? Dim(0) : limit_.resolve(in);
    if (limit.is_dynamic()) return Shape{start_ == 0 && delta_ == 1 ? limit : Dim(dynamic)};
    const std::int64_t n = range_length(start_, limit_.is_constant() ? limit_.value : limit.size(), delta_);
    if (dtype_ == DType::I32 && n > 0) {
      // The values are monotonic: the first and the last bound them.
      std::int64_t last = 0;
      const bool overflow =
          __builtin_mul_overflow(n - 1, delta_, &last) || __builtin_add_overflow(last, start_, &last);
      const auto lo = std::numeric_limits<std::int32_t>::min(), hi = std::numeric_limits<std::int32_t>::max();
      if (overflow || start_ < lo || start_ > hi || last < lo || last > hi)
        throw Error(util::cat("the i32 range from ", start_, " in steps of ", delta_, " (", n,
                              " values) leaves the i32 range [", lo, ", ", hi, "]"));
    }
    return Shape{Dim(n)};
  }
  DType infer_output_dtype(const std::vector<DType>&) const override {
    require_range_dtype(dtype_);
    return dtype_;
  }

  std::optional<Lowered> lower(const LowerContext&) const override {
    struct Runtime final : RuntimeOp {
      Runtime(std::string e, std::int64_t s, std::int64_t d) : entry(std::move(e)), start(s), delta(d) {}
      std::vector<Launch> launches(const LaunchTensors& t) const override {
        const std::int64_t n = numel_of(t.output.shape);
        return {{entry, grid_1d(n, kIndexThreads), {kIndexThreads, 1, 1}, 0, {t.output, n, start, delta}}};
      }
      std::string entry;
      std::int64_t start, delta;
    };
    return Lowered{name(), source(), range_entry(dtype_),
                   std::make_shared<Runtime>(range_entry(dtype_), start_, delta_)};
  }

  void cpu_forward(CpuContext& ctx) const override {
    const std::int64_t n = ctx.output.numel();
    auto fill = [&](auto zero) {
      using T = decltype(zero);
      T* o = ctx.output.data<T>();
      ctx.parallel_for(n, 65536, [&](std::int64_t b, std::int64_t e) {
        for (std::int64_t i = b; i < e; ++i) {
          if constexpr (std::is_floating_point_v<T>)
            o[i] = static_cast<T>(static_cast<double>(start_) +
                                  static_cast<double>(i) * static_cast<double>(delta_));
          else
            o[i] = static_cast<T>(start_ + i * delta_);
        }
      });
    };
    switch (dtype_) {
      case DType::I32:
        fill(std::int32_t{});
        break;
      case DType::I64:
        fill(std::int64_t{});
        break;
      case DType::F32:
        fill(float{});
        break;
      default:
        fill(double{});
        break;
    }
  }

 private:
  DType dtype_;
  std::int64_t start_;
  DimRef limit_;
  std::int64_t delta_;
};

// ---- index.constant_of_shape ----

class ConstantOfShapeOp final : public CustomOp {
 public:
  ConstantOfShapeOp(std::vector<DimRef> shape, DType dtype, double value)
      : shape_(std::move(shape)), dtype_(dtype), value_(value) {}
  std::string name() const override { return "index.constant_of_shape"; }
  std::string attributes() const override {
    return util::cat("shape=", dims_to_string(shape_), " dtype=", dtype_name(dtype_), " value=", value_);
  }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_representable(value_, dtype_, "value");
    return resolve_sizes(shape_, in, "shape");
  }
  DType infer_output_dtype(const std::vector<DType>&) const override { return dtype_; }

  std::optional<Lowered> lower(const LowerContext&) const override {
    struct Runtime final : RuntimeOp {
      Runtime(std::string e, std::uint64_t b) : entry(std::move(e)), bits(b) {}
      std::vector<Launch> launches(const LaunchTensors& t) const override {
        const std::int64_t n = numel_of(t.output.shape);
        return {{entry,
                 grid_1d(n, kIndexThreads),
                 {kIndexThreads, 1, 1},
                 0,
                 {t.output, n, static_cast<std::int64_t>(bits)}}};
      }
      std::string entry;
      std::uint64_t bits;
    };
    const std::string entry = width_entry("kg_index_fill", dtype_);
    return Lowered{name(), source(), entry, std::make_shared<Runtime>(entry, element_bits(value_, dtype_))};
  }

  void cpu_forward(CpuContext& ctx) const override {
    const std::uint64_t bits = element_bits(value_, dtype_);
    const std::int64_t n = ctx.output.numel();
    dispatch_width(dtype_size(dtype_), [&](auto zero) {
      using E = decltype(zero);
      E* o = static_cast<E*>(ctx.output.raw());
      const E v = static_cast<E>(bits);
      ctx.parallel_for(n, 65536, [&](std::int64_t b, std::int64_t e) { std::fill(o + b, o + e, v); });
    });
  }

 private:
  std::vector<DimRef> shape_;
  DType dtype_;
  double value_;
};

// ---- index.shape ----

class ShapeTensorOp final : public CustomOp {
 public:
  explicit ShapeTensorOp(std::vector<DimRef> dims) : dims_(std::move(dims)) {}
  std::string name() const override { return "index.shape"; }
  std::string attributes() const override { return util::cat("dims=", dims_to_string(dims_)); }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    resolve_sizes(dims_, in, "dims");  // checks every reference
    return Shape{Dim(static_cast<std::int64_t>(dims_.size()))};
  }
  DType infer_output_dtype(const std::vector<DType>&) const override { return DType::I64; }

  std::optional<Lowered> lower(const LowerContext&) const override {
    struct Runtime final : RuntimeOp {
      explicit Runtime(std::vector<DimRef> d) : dims(std::move(d)) {}
      // One launch per KG_INDEX_VALUES sizes (one launch, writing nothing, for no sizes).
      std::vector<Launch> launches(const LaunchTensors& t) const override {
        const auto shapes = shapes_of(t.inputs);
        std::vector<Launch> v;
        for (std::size_t first = 0; first == 0 || first < dims.size(); first += KG_INDEX_VALUES) {
          KgIndexValues vals{};
          for (std::size_t j = first; j < dims.size() && j < first + KG_INDEX_VALUES; ++j)
            vals.v[j - first] = dims[j].resolve(shapes);
          vals.count = std::min<long long>(KG_INDEX_VALUES, std::ssize(dims) - static_cast<long long>(first));
          vals.count = std::max<long long>(vals.count, 0);
          v.push_back({"kg_index_values",
                       {1, 1, 1},
                       {32, 1, 1},
                       0,
                       {t.output, static_cast<std::int64_t>(first), raw_bytes(&vals, sizeof vals)}});
        }
        return v;
      }
      std::vector<DimRef> dims;
    };
    return Lowered{name(), source(), "kg_index_values", std::make_shared<Runtime>(dims_)};
  }

  void cpu_forward(CpuContext& ctx) const override {
    const auto shapes = shapes_of(ctx.inputs);
    auto* o = ctx.output.data<std::int64_t>();
    for (std::size_t i = 0; i < dims_.size(); ++i) o[i] = dims_[i].resolve(shapes);
  }

 private:
  std::vector<DimRef> dims_;
};

// Records an op whose inputs are shape sources only, on the first of them.
SymTensor record_on_sources(const CustomData& op, const std::vector<SymTensor>& sources,
                            const std::string& name) {
  if (sources.empty())
    throw Error(util::cat("[", op.name(),
                          "] needs at least one source tensor to record into, got none (pass any "
                          "tensor of the graph, even when every size is a constant)"));
  return sources[0].record_custom(op, {sources.begin() + 1, sources.end()}, std::nullopt, name);
}

}  // namespace

const char* pad_mode_name(PadMode mode) {
  switch (mode) {
    case PadMode::Constant:
      return "constant";
    case PadMode::Reflect:
      return "reflect";
    case PadMode::Edge:
      return "edge";
    case PadMode::Wrap:
      return "wrap";
  }
  return "?";
}

CustomData gather_op(std::int64_t axis) { return CustomData::make<GatherOp>(axis); }
CustomData gather_elements_op(std::int64_t axis) { return CustomData::make<GatherElementsOp>(axis); }
CustomData expand_op(const std::vector<DimRef>& shape) { return CustomData::make<ExpandOp>(shape); }
CustomData tile_op(const std::vector<std::int64_t>& repeats) { return CustomData::make<TileOp>(repeats); }
CustomData pad_op(const std::vector<std::int64_t>& begin, const std::vector<std::int64_t>& end, PadMode mode,
                  double value) {
  return CustomData::make<PadOp>(begin, end, mode, value);
}
CustomData slice_axes_op(const std::vector<std::int64_t>& starts, const std::vector<std::int64_t>& ends,
                         const std::vector<std::int64_t>& axes, const std::vector<std::int64_t>& steps) {
  return CustomData::make<SliceAxesOp>(starts, ends, axes, steps);
}
CustomData range_op(DType dtype, std::int64_t start, const DimRef& limit, std::int64_t delta) {
  return CustomData::make<RangeOp>(dtype, start, limit, delta);
}
CustomData constant_of_shape_op(const std::vector<DimRef>& shape, DType dtype, double value) {
  return CustomData::make<ConstantOfShapeOp>(shape, dtype, value);
}
CustomData shape_tensor_op(const std::vector<DimRef>& dims) { return CustomData::make<ShapeTensorOp>(dims); }

SymTensor gather(const SymTensor& data, const SymTensor& indices, std::int64_t axis,
                 const std::string& name) {
  return data.record_custom(gather_op(axis), {indices}, std::nullopt, name);
}
SymTensor gather_elements(const SymTensor& data, const SymTensor& indices, std::int64_t axis,
                          const std::string& name) {
  return data.record_custom(gather_elements_op(axis), {indices}, std::nullopt, name);
}
SymTensor expand(const SymTensor& x, const std::vector<DimRef>& shape, const std::vector<SymTensor>& sources,
                 const std::string& name) {
  return x.record_custom(expand_op(shape), sources, std::nullopt, name);
}
SymTensor tile(const SymTensor& x, const std::vector<std::int64_t>& repeats, const std::string& name) {
  return x.record_custom(tile_op(repeats), {}, std::nullopt, name);
}
SymTensor pad(const SymTensor& x, const std::vector<std::int64_t>& begin,
              const std::vector<std::int64_t>& end, PadMode mode, double value, const std::string& name) {
  return x.record_custom(pad_op(begin, end, mode, value), {}, std::nullopt, name);
}
SymTensor slice_axes(const SymTensor& x, const std::vector<std::int64_t>& starts,
                     const std::vector<std::int64_t>& ends, const std::vector<std::int64_t>& axes,
                     const std::vector<std::int64_t>& steps, const std::string& name) {
  return x.record_custom(slice_axes_op(starts, ends, axes, steps), {}, std::nullopt, name);
}
SymTensor range(DType dtype, std::int64_t start, const DimRef& limit, std::int64_t delta,
                const std::vector<SymTensor>& sources, const std::string& name) {
  return record_on_sources(range_op(dtype, start, limit, delta), sources, name);
}
SymTensor constant_of_shape(const std::vector<DimRef>& shape, const std::vector<SymTensor>& sources,
                            DType dtype, double value, const std::string& name) {
  return record_on_sources(constant_of_shape_op(shape, dtype, value), sources, name);
}
SymTensor shape_tensor(const std::vector<DimRef>& dims, const std::vector<SymTensor>& sources,
                       const std::string& name) {
  return record_on_sources(shape_tensor_op(dims), sources, name);
}

}  // namespace kg::ops
