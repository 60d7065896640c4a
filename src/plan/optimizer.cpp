#include "plan/optimizer.hpp"

#include <cmath>

#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::plan {

std::vector<std::string> optimizer_slots(const OptimizerOptions& o) {
  if (o.kind == OptimizerOptions::Kind::AdamW) return {"exp_avg", "exp_avg_sq"};
  if (o.momentum != 0.0) return {"momentum_buffer"};
  return {};
}

void check_optimizer(const OptimizerOptions& o) {
  auto bad = [](const std::string& what, double v) {
    throw Error(util::cat("optimizer: ", what, " is ", v));
  };
  if (!(o.lr >= 0.0) || !std::isfinite(o.lr)) bad("learning rate (must be >= 0)", o.lr);
  if (!(o.weight_decay >= 0.0)) bad("weight decay (must be >= 0)", o.weight_decay);
  if (o.kind == OptimizerOptions::Kind::Sgd) {
    if (!(o.momentum >= 0.0)) bad("momentum (must be >= 0)", o.momentum);
    return;
  }
  if (!(o.beta1 >= 0.0 && o.beta1 < 1.0)) bad("beta1 (must be in [0, 1))", o.beta1);
  if (!(o.beta2 >= 0.0 && o.beta2 < 1.0)) bad("beta2 (must be in [0, 1))", o.beta2);
  if (!(o.eps > 0.0)) bad("eps (must be > 0)", o.eps);
}

namespace {

template <class T>
void update(const OptimizerOptions& o, std::int64_t step, T* p, const T* g, std::vector<Tensor>& slots, std::int64_t n) {
  const T lr = static_cast<T>(o.lr), wd = static_cast<T>(o.weight_decay);
  if (o.kind == OptimizerOptions::Kind::Sgd) {
    if (o.momentum == 0.0) {
      for (std::int64_t i = 0; i < n; ++i) p[i] -= lr * (g[i] + wd * p[i]);
      return;
    }
    const T mom = static_cast<T>(o.momentum);
    T* buf = slots[0].data<T>();
    for (std::int64_t i = 0; i < n; ++i) {
      const T d = g[i] + wd * p[i];
      buf[i] = step == 1 ? d : mom * buf[i] + d;
      p[i] -= lr * buf[i];
    }
    return;
  }
  const T b1 = static_cast<T>(o.beta1), b2 = static_cast<T>(o.beta2), eps = static_cast<T>(o.eps);
  const T c1 = static_cast<T>(1.0 - std::pow(o.beta1, static_cast<double>(step)));
  const T c2 = static_cast<T>(std::sqrt(1.0 - std::pow(o.beta2, static_cast<double>(step))));
  T* m = slots[0].data<T>();
  T* v = slots[1].data<T>();
  for (std::int64_t i = 0; i < n; ++i) {
    p[i] -= lr * wd * p[i];
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    p[i] -= lr * (m[i] / c1) / (std::sqrt(v[i]) / c2 + eps);
  }
}

}  // namespace

void optimizer_update_cpu(const OptimizerOptions& o, std::int64_t step, Tensor& param, const Tensor& grad,
                          std::vector<Tensor>& slots) {
  const std::int64_t n = param.numel();
  switch (param.dtype()) {
    case DType::F32: update(o, step, param.data<float>(), grad.data<float>(), slots, n); return;
    case DType::F64: update(o, step, param.data<double>(), grad.data<double>(), slots, n); return;
    default: throw Error(util::cat("optimizer: parameters of dtype ", dtype_name(param.dtype()), " cannot be trained"));
  }
}

}  // namespace kg::plan
