#include "support/gpu_util.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include "backend/emu/executor.hpp"
#include "compile/compiler.hpp"
#include "lower/dry_run.hpp"
#include "support/test_util.hpp"

namespace kg_test {
namespace {

// Records the largest normwise relative error (max |gpu - cpu| / max |cpu|) seen in the current
// test as the XML property "max_rel_err" (scripts/gpu-check prints it).
void record_max_rel_err(const kg::Tensor& got, const kg::Tensor& want) {
  double diff = 0, scale = 0;
  for (std::int64_t i = 0; i < want.numel() && i < got.numel(); ++i) {
    const double g = got.item(i), w = want.item(i);
    diff = std::max(diff, std::isnan(g) != std::isnan(w) ? INFINITY : std::isnan(w) ? 0.0 : std::abs(g - w));
    if (!std::isnan(w)) scale = std::max(scale, std::abs(w));
  }
  static std::string test;
  static double worst = 0;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (info == nullptr) return;
  const std::string name = std::string(info->test_suite_name()) + "." + info->name();
  if (name != test) test = name, worst = 0;
  worst = std::max(worst, diff / std::max(scale, 1e-30));
  std::ostringstream os;
  os.precision(3);
  os << std::scientific << worst;
  ::testing::Test::RecordProperty("max_rel_err", os.str());
}

bool emulation_enabled() {
  const char* v = std::getenv("KG_TEST_EMULATE");
  return v == nullptr || std::string(v) != "0";
}

// Counts the emulated and skipped runs of the current test in the XML property "emulation".
void record_emulation(bool ran) {
  static std::string test;
  static int runs = 0, skipped = 0;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (info == nullptr) return;
  const std::string name = std::string(info->test_suite_name()) + "." + info->name();
  if (name != test) test = name, runs = skipped = 0;
  (ran ? runs : skipped) += 1;
  ::testing::Test::RecordProperty(
      "emulation", std::to_string(runs) + " run, " + std::to_string(skipped) + " skipped (large outputs)");
}

}  // namespace

bool check_emulated(const kg::Model& model, const std::vector<kg::Tensor>& inputs,
                    const std::map<std::string, kg::Tensor>& params, const std::vector<kg::Tensor>& want,
                    double rtol, double atol) {
  if (!emulation_enabled()) return false;
  std::int64_t elements = 0;
  for (const auto& w : want) elements += w.numel();
  std::int64_t limit = kMaxEmulatedElements;
  if (const char* v = std::getenv("KG_TEST_EMULATE_MAX")) limit = std::atoll(v);
  if (elements > limit) {
    std::cout << "[ emulation ] skipped: the outputs have " << elements << " elements (emulated up to "
              << limit << "; KG_TEST_EMULATE_MAX raises it)\n";
    record_emulation(false);
    return false;
  }
  record_emulation(true);
  // The library-call path first (the vendor call by its definition, then the op's epilogue
  // kernels), then, when some op took it, the ops' own kernels; otherwise the first run was theirs.
  for (bool library : {true, false}) {
    const char* path = library ? " (library-call path)" : "";
    std::vector<kg::Tensor> got;
    int library_steps = 0;
    try {
      got = kg::emu::run_model(model, inputs, params, /*checked=*/true, library, &library_steps);
    } catch (const kg::Error& e) {
      ADD_FAILURE() << "emulated run" << path << " failed: " << e.what();
      return true;
    }
    if (library && library_steps == 0) path = "";  // no op took it: this was the kernels' run
    EXPECT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) {
      EXPECT_TRUE(all_written(got[i]) || !all_written(want[i]))
          << "emulated output " << i << path << " has elements the kernel never wrote";
      EXPECT_TRUE(all_close(got[i], want[i], rtol, atol))
          << "emulated output " << i << path << " differs from the CPU";
    }
    if (library && library_steps == 0) break;
  }
  return true;
}

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
  // With NVRTC every kernel is compiled for sm_90 and its launches checked against the PTX too;
  // without it (arch 0) the launches are checked against the CUDA signatures only.
  kg::lower::dry_run(model, shapes, kg::compile::Compiler::available() ? 90 : 0);
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  kg::LoadedModel cpu = model.load(kg::Device::cpu(), shapes, opt);
  const auto want = cpu.forward(inputs);
  check_emulated(model, inputs, cpu.state_dict(), want, rtol, atol);
  if (!kg::Device::cuda_available()) return false;
  // The op's own kernels, then the vendor libraries where the op describes a library call.
  for (bool vendor : {false, true}) {
    opt.vendor_libraries = vendor;
    const char* path = vendor ? " (vendor libraries on)" : " (own kernels)";
    kg::LoadedModel gpu = model.load(kg::Device::cuda(), shapes, opt);
    gpu.load_state_dict(cpu.state_dict(), false);
    auto got = gpu.forward(inputs);
    EXPECT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) {
      EXPECT_TRUE(all_written(got[i]))
          << "GPU output " << i << path << " has elements the kernel never wrote";
      EXPECT_TRUE(all_close(got[i], want[i], rtol, atol))
          << "GPU output " << i << path << " differs from the CPU";
      record_max_rel_err(got[i], want[i]);
    }
  }
  return true;
}

}  // namespace kg_test
