#include "support/gpu_util.hpp"

#include <gtest/gtest.h>

#include "compile/compiler.hpp"
#include "lower/dry_run.hpp"
#include "support/test_util.hpp"

namespace kg_test {

bool check_lowering(const BuildFn& build, const std::vector<kg::Tensor>& inputs, double rtol, double atol) {
  auto graph = kg::Graph::create();
  std::vector<kg::SymTensor> xs;
  std::vector<std::vector<std::int64_t>> shapes;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    kg::Shape s = kg::Shape::of(inputs[i].shape());
    if (s.rank() > 0) s[0] = kg::Dim::named("batch");
    xs.push_back(graph->input(inputs[i].dtype(), s, "x" + std::to_string(i)));
    shapes.push_back(inputs[i].shape());
  }
  kg::Model model(graph, build(xs));
  if (kg::compile::Compiler::available()) kg::lower::dry_run(model, shapes, 90);
  if (!kg::Device::cuda_available()) return false;
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  kg::LoadedModel cpu = model.load(kg::Device::cpu(), shapes, opt);
  kg::LoadedModel gpu = model.load(kg::Device::cuda(), shapes, opt);
  gpu.load_state_dict(cpu.state_dict(), false);
  auto want = cpu.forward(inputs);
  auto got = gpu.forward(inputs);
  EXPECT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) {
    EXPECT_TRUE(all_written(got[i])) << "GPU output " << i << " has elements the kernel never wrote";
    EXPECT_TRUE(all_close(got[i], want[i], rtol, atol)) << "GPU output " << i << " differs from the CPU";
  }
  return true;
}

}  // namespace kg_test
