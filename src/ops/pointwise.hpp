// The pointwise op family: n-ary elementwise functions with numpy broadcasting for every dtype
// but f16 and bf16 (bool, i8, i16, i32, i64, u8, f32, f64), with ONNX's semantics, as an ONNX
// importer needs them; and Cast between any two dtypes, f16 and bf16 included. Unlike the
// elementwise family (f32 and f64, with backward) these ops have no backward.
//
// One op class serves every function: the function and its attributes are the op's
// configuration; the dtypes come from the inputs. On the GPU every (function, dtypes) pair the
// op is instantiated for gets its own entry, generated at lowering from an expression for the
// function and the C types of the dtypes (pointwise.cuh holds the device helpers, pointwise.cu
// the broadcasting loops). For f32 and f64 the functions whose result has the inputs' dtype
// declare elementwise forms (docs/fusion.md), so the fusion pass can join them with their
// neighbours in inference.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kg/custom_op.hpp"
#include "kg/dtype.hpp"
#include "kg/graph.hpp"

namespace kg::ops {

// clang-format off
enum class PointwiseFn {
  // unary
  Neg, Abs, Exp, Log, Sqrt, Reciprocal, Erf, Sin, Cos, Tan, Asin, Acos, Atan, Sinh, Cosh, Asinh,
  Acosh, Atanh, Floor, Ceil, Round, Sign, IsNaN, IsInf, Not, Relu, Sigmoid, Tanh, Softplus, Softsign,
  Elu, Selu, Celu, LeakyRelu, HardSigmoid, HardSwish, ThresholdedRelu, Mish, Clip, Identity,
  // binary (broadcasting)
  Add, Sub, Mul, Div, Pow, Max, Min, Mod, FMod, PRelu, Equal, Less, LessOrEqual, Greater,
  GreaterOrEqual, And, Or, Xor, BitwiseAnd, BitwiseOr, BitwiseXor,
  // ternary (broadcasting): Where(cond, x, y)
  Where };
// clang-format on

// What each function computes (ONNX semantics):
//  - the inputs of a binary op share one dtype; Where's condition is bool and x, y share one;
//  - comparisons, IsNaN, IsInf and the logical ops (Not, And, Or, Xor: bool inputs) give bool;
//  - Bitwise* take integers; Neg, Abs, Sign, Relu, Clip, the arithmetic, Max, Min, PRelu and the
//    ordering comparisons take every dtype but bool; Equal, Identity and Where take every dtype;
//    the others (Exp, Log, Erf, trigonometry, Floor, Ceil, Round, the activations, ...) take f32
//    and f64 only;
//  - integer arithmetic wraps (two's complement); integer Div truncates toward zero; Mod has the
//    divisor's sign (Python), FMod the dividend's (C fmod); an integer division by zero gives 0;
//  - Pow of integers multiplies (a negative exponent gives 0, except for a base of 1 or -1);
//  - Max and Min propagate NaN; Round rounds half to even; Sign gives -1, 0 or 1 (NaN stays NaN);
//  - Clip on integers clamps to ceil(min) and floor(max) within the dtype's range.
// attrs by fn: Elu{alpha}, Selu{alpha, gamma}, Celu{alpha}, LeakyRelu{alpha}, HardSigmoid{alpha, beta},
// ThresholdedRelu{alpha}, Clip{min, max} (either may be ±infinity); others none. Wrong count → kg::Error.
SymTensor pointwise(PointwiseFn fn, const std::vector<SymTensor>& inputs,
                    const std::vector<double>& attrs = {}, const std::string& name = "");
// The CustomData of the same op (for callers that record it themselves).
CustomData pointwise_op(PointwiseFn fn, const std::vector<double>& attrs = {});

// Clip's {min, max} when `op` is a pointwise Clip; nullopt for any other op. The fusion of a
// convolution with its activation uses it to hand the clip to oneDNN as a post-op.
std::optional<std::pair<double, double>> clip_bounds(const CustomOp& op);

// Cast to `to` from any dtype (f16 and bf16 on both sides): float to integer truncates toward
// zero (NaN gives 0; values beyond i64 saturate, then narrower integers wrap), to bool is x != 0,
// to f16 and bf16 rounds to nearest even.
SymTensor cast(const SymTensor& x, DType to, const std::string& name = "");
CustomData cast_op(DType to);

// The ONNX-style name used in the op name, e.g. "pw.exp", "pw.where".
const char* pointwise_name(PointwiseFn fn);
// Inputs the function takes: 1, 2 or 3 (Where).
int pointwise_arity(PointwiseFn fn);

}  // namespace kg::ops
