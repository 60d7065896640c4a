// The reduction op family, ONNX style: reduce.<fn> over a set of axes (ReduceSum, ReduceMean,
// ReduceMax, ... ReduceLogSumExp), reduce.argmax / reduce.argmin along one axis, and
// reduce.cumsum along one axis. Each op has a CPU implementation and one CUDA kernel per
// instance (src/ops/reduce_ops.cu) that takes any axes; neither has a backward.
//
// Dtypes: f32 and f64 for every op; i32 and i64 too for Sum, Max, Min, Prod, L1, SumSquare,
// arg-max/min and cumsum, with exact integer arithmetic that wraps like two's complement. Floats
// accumulate in double (f32 too). Reducing an empty axis gives the function's identity: 0 for
// Sum, L1, L2 and SumSquare, 1 for Prod, -inf for Max (the lowest value for integers) and +inf
// for Min (the highest); Mean gives NaN, LogSum and LogSumExp -inf, as numpy does. Max and Min
// propagate NaN; arg-max/min take NaN as the largest (smallest) value, as numpy does.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kg/custom_op.hpp"
#include "kg/graph.hpp"

namespace kg::ops {

enum class ReduceFn { Sum, Mean, Max, Min, Prod, L1, L2, SumSquare, LogSum, LogSumExp };

// The op's name for `fn`: "reduce.sum", "reduce.mean", "reduce.max", "reduce.min",
// "reduce.prod", "reduce.l1", "reduce.l2", "reduce.sum_square", "reduce.log_sum",
// "reduce.log_sum_exp".
std::string reduce_op_name(ReduceFn fn);

// Reduces `axes` (negative count from the end; empty = every dim; duplicates are an error) keeping
// them as size-1 dims when keepdims. A rank-0 input with empty axes gives a rank-0 output.
SymTensor reduce(ReduceFn fn, const SymTensor& x, const std::vector<std::int64_t>& axes, bool keepdims,
                 const std::string& name = "");
CustomData reduce_op(ReduceFn fn, const std::vector<std::int64_t>& axes, bool keepdims);

// Index of the max (or min) along `axis`, as i64; ties give the first index, or the last with
// select_last_index. An empty axis is an error at shape inference. Op names "reduce.argmax" and
// "reduce.argmin".
SymTensor arg_reduce(bool is_max, const SymTensor& x, std::int64_t axis, bool keepdims,
                     bool select_last_index, const std::string& name = "");
CustomData arg_reduce_op(bool is_max, std::int64_t axis, bool keepdims, bool select_last_index);

// Cumulative sum along `axis`; exclusive starts at 0; reverse sums from the end. Op name
// "reduce.cumsum"; the output has the input's shape and dtype.
SymTensor cumsum(const SymTensor& x, std::int64_t axis, bool exclusive, bool reverse,
                 const std::string& name = "");
CustomData cumsum_op(std::int64_t axis, bool exclusive, bool reverse);

}  // namespace kg::ops
