#include "backend/cpu/executor.hpp"

#include <chrono>

#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::cpu {
namespace {

class PoolContext final : public CpuContext {
 public:
  PoolContext(std::span<const Tensor> in, std::span<const Tensor> ps, Tensor out, bool train,
              std::uint64_t seed, ThreadPool& pool)
      : CpuContext(in, ps, std::move(out), train, seed), pool_(pool) {}
  void parallel_for(std::int64_t n, std::int64_t grain, const RangeFn& fn) const override {
    pool_.parallel_for(n, grain, fn);
  }

 private:
  ThreadPool& pool_;
};

}  // namespace

Executor::Executor(int threads) {
  if (threads > 0) own_ = std::make_unique<ThreadPool>(threads);
}

Tensor Executor::value_tensor(const runtime::Plan& plan, int node, const std::vector<Tensor>& inputs,
                              void* arena) {
  const auto& v = plan.values.at(static_cast<std::size_t>(node));
  if (v.input_index >= 0) {
    const Tensor& in = inputs.at(static_cast<std::size_t>(v.input_index));
    return Tensor::wrap(const_cast<void*>(in.raw()), v.dtype, v.shape);
  }
  return Tensor::wrap(static_cast<std::byte*>(arena) + v.offset, v.dtype, v.shape);
}

void Executor::run(const Graph& graph, runtime::Plan& plan, const std::vector<Tensor>& inputs,
                   void* arena, bool training, std::uint64_t seed, std::vector<NodeTime>* profile) {
  using clock = std::chrono::steady_clock;
  std::vector<Tensor> ins;
  for (auto& step : plan.steps) {
    const Node& n = graph.node(step.node);
    ins.clear();
    for (int in : n.inputs) ins.push_back(value_tensor(plan, in, inputs, arena));
    Tensor out = value_tensor(plan, step.node, inputs, arena);
    PoolContext ctx(ins, step.params, out, training,
                    seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(step.node), pool());
    auto t0 = clock::now();
    try {
      n.op->op().cpu_forward(ctx);
    } catch (const Error& e) {
      throw Error(n.label() + " " + e.what());
    } catch (const std::exception& e) {
      throw Error(n.label() + " cpu_forward failed: " + e.what());
    }
    if (profile)
      profile->push_back({n.name, n.op_name(),
                          std::chrono::duration<double, std::milli>(clock::now() - t0).count()});
  }
}

}  // namespace kg::cpu
