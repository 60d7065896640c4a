#include "graph/param_dtype.hpp"

#include "kg/error.hpp"
#include "kg/tensor.hpp"
#include "util/str.hpp"

namespace kg {

void follow_input_dtype(ParamSpec& p, const std::vector<DType>& input_dtypes) {
  if (p.dtype_from_input < 0) return;
  const auto k = static_cast<std::size_t>(p.dtype_from_input);
  if (k >= input_dtypes.size())
    throw Error(util::cat("parameter '", p.name, "' takes the dtype of input ", k, " (ParamSpec::dtype_from_input)",
                          " but the op has ", input_dtypes.size(), " input", input_dtypes.size() == 1 ? "" : "s"));
  const DType to = input_dtypes[k];
  if (!is_floating(to))
    throw Error(util::cat("parameter '", p.name, "' takes the dtype of input ", k,
                          " (ParamSpec::dtype_from_input), which is ", dtype_name(to),
                          "; a parameter may follow a float input only"));
  const DType from = p.dtype;
  p.dtype = to;
  p.dtype_from_input = -1;  // resolved
  if (from == to || p.init.kind != ParamInit::Kind::Data) return;
  const std::size_t n = static_cast<std::size_t>(numel_of(p.shape));
  if (!is_floating(from) || p.init.data.size() != n * dtype_size(from)) {
    // Not convertible: the size check at record reports it against the resolved dtype.
    return;
  }
  const Tensor r = Tensor::wrap(p.init.data.data(), from, p.shape).to(to);
  const auto* b = static_cast<const std::byte*>(r.raw());
  p.init.data.assign(b, b + r.nbytes());
}

}  // namespace kg
