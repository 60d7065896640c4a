// The index_ops family: the ONNX data-movement and indexing ops an importer needs (Gather,
// GatherElements, Expand, Tile, Pad, Slice, Range, ConstantOfShape, Shape), for every dtype
// (copied by element width: bool, i8 .. i64, u8, f16, bf16, f32, f64). Sizes that ONNX gives as
// run-time tensors are DimRefs (ops/dim_ref.hpp): a constant, or a dim of one of the op's inputs,
// so that a dynamic batch survives. Ops whose only inputs are such shape sources never read
// their data. The GPU kernels are index_ops.cu; none of these ops has a backward. The ops that
// move floating data (gather, gather_elements, expand, tile, pad, slice_axes) compute in f16 and
// bf16 (CustomOp::computes_in), so a model loaded in reduced precision keeps them in its dtype.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kg/custom_op.hpp"
#include "kg/graph.hpp"
#include "ops/dim_ref.hpp"

namespace kg::ops {

// clang-format off
// data[..., indices[...], ...] along `axis`: output shape data[:axis] + indices + data[axis+1:].
// Indices are i32 or i64; negative ones count from the end; out of range → a kg::Error on the CPU
// naming the index and the bound (on the GPU: clamp, and say so in a comment).
SymTensor gather(const SymTensor& data, const SymTensor& indices, std::int64_t axis, const std::string& name = "");
// out[i][j][k] = data[index[i][j][k]][j][k] (for axis 0) etc.; indices have data's rank.
SymTensor gather_elements(const SymTensor& data, const SymTensor& indices, std::int64_t axis, const std::string& name = "");
// numpy-broadcasts x to `shape` (ONNX Expand: the output is broadcast(x.shape, shape)). DimRef input
// numbers count the op's inputs: 0 is x, 1.. are `sources` (tensors whose dims sizes are read).
SymTensor expand(const SymTensor& x, const std::vector<DimRef>& shape, const std::vector<SymTensor>& sources,
                 const std::string& name = "");
SymTensor tile(const SymTensor& x, const std::vector<std::int64_t>& repeats, const std::string& name = "");
enum class PadMode { Constant, Reflect, Edge, Wrap };
// Pads (negative: crops) each dim by begin[i] before and end[i] after; `value` for Constant.
SymTensor pad(const SymTensor& x, const std::vector<std::int64_t>& begin, const std::vector<std::int64_t>& end,
              PadMode mode, double value, const std::string& name = "");
// ONNX Slice over several axes at once with any non-zero step (negative walks backwards), starts and
// ends clamped exactly as the ONNX spec says (INT64_MAX/INT64_MIN as "to the end"); axes may be
// negative; works on dynamic dims (output dim dynamic unless the slice is the whole dim).
SymTensor slice_axes(const SymTensor& x, const std::vector<std::int64_t>& starts, const std::vector<std::int64_t>& ends,
                     const std::vector<std::int64_t>& axes, const std::vector<std::int64_t>& steps,
                     const std::string& name = "");
// [start, start+delta, ...) below `limit`, length max(ceil((limit-start)/delta), 0); limit is a
// DimRef into `sources` (input 0 is sources[0]); dtype i32, i64, f32 or f64.
SymTensor range(DType dtype, std::int64_t start, const DimRef& limit, std::int64_t delta,
                const std::vector<SymTensor>& sources, const std::string& name = "");
// A tensor of `shape` (DimRefs into `sources`, input 0 = sources[0]) filled with `value`.
SymTensor constant_of_shape(const std::vector<DimRef>& shape, const std::vector<SymTensor>& sources,
                            DType dtype, double value, const std::string& name = "");
// The i64 vector of the sizes `dims` (DimRefs into `sources`): a run-time Shape.
SymTensor shape_tensor(const std::vector<DimRef>& dims, const std::vector<SymTensor>& sources,
                       const std::string& name = "");
// Each also as CustomData: gather_op(axis), gather_elements_op(axis), expand_op(shape), tile_op(repeats),
// pad_op(begin, end, mode, value), slice_axes_op(starts, ends, axes, steps),
// range_op(dtype, start, limit, delta), constant_of_shape_op(shape, dtype, value), shape_tensor_op(dims).
// clang-format on
//
// The ops as CustomData, for recording with Graph::record on inputs in the order above: (data,
// indices) for the gathers, (x, sources...) for expand, (x) for tile, pad and slice_axes, and
// (sources...) for range, constant_of_shape and shape_tensor. The functions above record these.
// Arguments are checked when the op is recorded (infer_output_shape), so errors name the node.
//
// Notes:
//  - gather_elements: each non-axis dim of the indices may be at most the data's (as PyTorch's
//    gather); the output has the indices' shape.
//  - expand: a DimRef that is dynamic against a static dim of x other than 1 gives x's dim; two
//    dynamic dims with different symbols give an anonymous dynamic dim (sized at load).
//  - pad: Reflect needs each positive pad below the dim (pad < dim), Edge and Wrap a non-empty dim
//    when there is anything to pad; Wrap may wrap around several times. `value` must be
//    representable in an integer or bool dtype (an integer in range; 0 or 1 for bool).
//  - slice_axes: empty `axes` means 0, 1, ...; empty `steps` means all 1; an axis may appear once.
//  - range: the values are start + i * delta, computed in 64-bit integers (i32: then narrowed; every
//    value must fit) or in double (f32, f64: then rounded). With start 0 and delta 1 the output
//    dim is the limit's own (a dynamic batch keeps its symbol).
//  - range, constant_of_shape and shape_tensor record on sources[0]: they need at least one
//    source even when every size is a constant.
CustomData gather_op(std::int64_t axis);
CustomData gather_elements_op(std::int64_t axis);
CustomData expand_op(const std::vector<DimRef>& shape);
CustomData tile_op(const std::vector<std::int64_t>& repeats);
CustomData pad_op(const std::vector<std::int64_t>& begin, const std::vector<std::int64_t>& end, PadMode mode,
                  double value);
CustomData slice_axes_op(const std::vector<std::int64_t>& starts, const std::vector<std::int64_t>& ends,
                         const std::vector<std::int64_t>& axes, const std::vector<std::int64_t>& steps);
CustomData range_op(DType dtype, std::int64_t start, const DimRef& limit, std::int64_t delta);
CustomData constant_of_shape_op(const std::vector<DimRef>& shape, DType dtype, double value);
CustomData shape_tensor_op(const std::vector<DimRef>& dims);

// "constant", "reflect", "edge" or "wrap".
const char* pad_mode_name(PadMode mode);

}  // namespace kg::ops
