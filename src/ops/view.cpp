// nn.view (see view.hpp).
#include "ops/view.hpp"

#include <algorithm>
#include <cstring>

#include "ops/op_util.hpp"

namespace kg::ops {
namespace {

class ViewOp final : public CustomOp {
 public:
  explicit ViewOp(std::vector<DimRef> dims) : dims_(std::move(dims)) {
    int infer = 0;
    for (const auto& d : dims_) {
      if (d.is_constant() && d.value == -1) ++infer;
      else if (d.is_constant() && d.value < 0)
        throw Error(util::cat("nn.view: invalid size ", d.value, " in ", dims_to_string(dims_)));
    }
    if (infer > 1) throw Error(util::cat("nn.view: at most one size can be inferred (-1), got ", dims_to_string(dims_)));
  }
  std::string name() const override { return "nn.view"; }
  std::string attributes() const override { return "dims=" + dims_to_string(dims_); }
  bool is_view() const override { return true; }
  // Bytes under a new shape: the same for every dtype.
  bool computes_in(DType t) const override { return is_half_float(t); }
  DType infer_output_dtype(const std::vector<DType>& in) const override {
    if (in.empty()) throw Error("expects an input");
    return in[0];
  }

  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    if (in.empty()) throw Error("expects an input");
    const Shape& x = in[0];
    Shape out;
    int infer_at = -1;
    for (std::size_t i = 0; i < dims_.size(); ++i) {
      const DimRef& d = dims_[i];
      if (d.is_constant() && d.value == -1) {
        infer_at = static_cast<int>(i);
        out.push_back(Dim(dynamic));
      } else {
        out.push_back(d.resolve(in));
      }
    }
    // Element counts: known parts and the dynamic dims on each side (equal symbols cancel). A
    // product past an int64 is an error, not a count that wraps round to the other side's.
    const auto too_many = [](const std::string& sizes) {
      return util::cat("the sizes ", sizes, " have more elements than an int64 holds (2^63 - 1)");
    };
    std::int64_t in_known = 1, out_known = 1;
    std::vector<Dim> in_dyn, out_dyn;
    for (const Dim& d : x) {
      if (!d.is_static()) in_dyn.push_back(d);
      else if (__builtin_mul_overflow(in_known, d.size(), &in_known)) throw Error(too_many(x.to_string()));
    }
    for (std::size_t i = 0; i < out.rank(); ++i) {
      if (static_cast<int>(i) == infer_at) continue;
      if (!out[i].is_static()) out_dyn.push_back(out[i]);
      else if (__builtin_mul_overflow(out_known, out[i].size(), &out_known))
        throw Error(too_many(dims_to_string(dims_)));
    }
    for (auto it = out_dyn.begin(); it != out_dyn.end();) {
      auto m = std::find_if(in_dyn.begin(), in_dyn.end(),
                            [&](const Dim& d) { return !d.symbol().empty() && d == *it; });
      if (m != in_dyn.end()) {
        in_dyn.erase(m);
        it = out_dyn.erase(it);
      } else {
        ++it;
      }
    }
    const std::string what = util::cat("cannot view ", x.to_string(), " as ", dims_to_string(dims_));
    if (infer_at >= 0) {
      Dim& slot = out[static_cast<std::size_t>(infer_at)];
      if (out_dyn.empty() && in_dyn.empty()) {
        if (out_known == 0 || in_known % out_known != 0)
          throw Error(util::cat(what, ": ", in_known, " elements do not divide into ", out_known));
        slot = Dim(in_known / out_known);
      } else if (out_dyn.empty() && in_dyn.size() == 1 && in_known == out_known) {
        slot = in_dyn[0];
      }  // else known at load
    } else if (out_dyn.empty() && in_dyn.empty() && in_known != out_known) {
      throw Error(util::cat(what, ": ", in_known, " elements vs ", out_known));
    }
    return out;
  }

  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    if (ctx.output.raw() != x.raw() && x.nbytes()) std::memcpy(ctx.output.raw(), x.raw(), x.nbytes());
  }

 private:
  std::vector<DimRef> dims_;
};

}  // namespace

CustomData view_op(std::vector<DimRef> dims) { return CustomData::make<ViewOp>(std::move(dims)); }

SymTensor view(const SymTensor& x, const std::vector<DimRef>& dims, const std::vector<SymTensor>& sources,
               const std::string& name) {
  return x.record_custom(view_op(dims), sources, std::nullopt, name);
}

}  // namespace kg::ops
