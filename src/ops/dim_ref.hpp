// A size known at record time or taken from an input's shape: how ops whose output shape comes
// from a run-time shape (an imported Expand, Range, ConstantOfShape, a materialised Shape) keep a
// dynamic batch. The op gets the tensors whose dims it reads as extra inputs ("shape sources"),
// so at load, where every input shape is concrete, the size is read off them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kg/error.hpp"
#include "kg/shape.hpp"
#include "util/str.hpp"

namespace kg::ops {

struct DimRef {
  std::int64_t value = 0;  // the size when input < 0
  int input = -1;          // the op's input whose dim is read, or -1 for a constant
  int axis = 0;            // which dim of that input (non-negative)

  static DimRef constant(std::int64_t v) { return {v, -1, 0}; }
  static DimRef of(int input, int axis) { return {0, input, axis}; }
  bool is_constant() const { return input < 0; }

  // The dim this refers to, given the op's input shapes (symbolic at record, concrete at load).
  Dim resolve(const std::vector<Shape>& inputs) const {
    if (input < 0) return Dim(value);
    if (static_cast<std::size_t>(input) >= inputs.size())
      throw Error(util::cat("a size refers to input ", input, " but the op has ", inputs.size(), " inputs"));
    const Shape& s = inputs[static_cast<std::size_t>(input)];
    if (axis < 0 || static_cast<std::size_t>(axis) >= s.rank())
      throw Error(util::cat("a size refers to dim ", axis, " of input ", input, " ", s.to_string(),
                            ", which has rank ", s.rank()));
    return s[static_cast<std::size_t>(axis)];
  }
  // The concrete value, given concrete input sizes.
  std::int64_t resolve(const std::vector<std::vector<std::int64_t>>& inputs) const {
    if (input < 0) return value;
    return inputs.at(static_cast<std::size_t>(input)).at(static_cast<std::size_t>(axis));
  }
  std::string to_string() const {
    return input < 0 ? std::to_string(value) : util::cat("in", input, ".dim", axis);
  }
};

inline Shape resolve_dims(const std::vector<DimRef>& refs, const std::vector<Shape>& inputs) {
  Shape s;
  for (const auto& r : refs) s.push_back(r.resolve(inputs));
  return s;
}

inline std::string dims_to_string(const std::vector<DimRef>& refs) {
  std::string s = "[";
  for (std::size_t i = 0; i < refs.size(); ++i) s += (i ? ", " : "") + refs[i].to_string();
  return s + "]";
}

}  // namespace kg::ops
