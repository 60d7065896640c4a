// Shared test helpers: fresh random inputs, running a graph through the real runtime with
// poisoned buffers, comparing against references, reading PyTorch fixtures.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kg/kg.hpp"

namespace kg_test {

// A seed drawn fresh for each test run; printed by SCOPED_TRACE in the helpers' callers.
std::uint64_t fresh_seed();

// Uniform random tensor in [lo, hi).
kg::Tensor random_tensor(std::mt19937_64& rng, kg::DType dtype, std::vector<std::int64_t> shape,
                         double lo = -1.0, double hi = 1.0);

// Builds a graph with one input per entry of `inputs` (batch dim 0 recorded as dynamic
// "batch" when `dynamic_batch`), records `build`, loads it on the CPU with poisoned buffers,
// sets `params` (by dotted name; others keep their default init), runs it and returns the
// outputs. Fails the test if any output element is NaN (never written).
std::vector<kg::Tensor> run_graph(
    const std::function<std::vector<kg::SymTensor>(const std::vector<kg::SymTensor>&)>& build,
    const std::vector<kg::Tensor>& inputs, const std::map<std::string, kg::Tensor>& params = {},
    bool dynamic_batch = true, bool check_written = true);
// One input, one output.
kg::Tensor run_op(const std::function<kg::SymTensor(const kg::SymTensor&)>& build, const kg::Tensor& input,
                  const std::map<std::string, kg::Tensor>& params = {});

// Max |a - b| / (atol + rtol*|b|) must stay <= 1; reports the worst element.
::testing::AssertionResult all_close(const kg::Tensor& got, const kg::Tensor& want, double rtol = 1e-5,
                                     double atol = 1e-6);

// A tensor of NaN: a gradient or output buffer whose unwritten elements show.
kg::Tensor nan_tensor(kg::DType dtype, std::vector<std::int64_t> shape);

// |got - want| <= atol + rtol * |want| at every element, against a reference in double (a NaN,
// i.e. an element never written, fails).
::testing::AssertionResult matches(const kg::Tensor& got, const std::vector<double>& want, double rtol,
                                   double atol);

// The whole content of a file ("" when it cannot be read).
std::string read_file(const std::string& path);

// True when no element is NaN.
bool all_written(const kg::Tensor& t);

// Tensors of a fixture file under tests/fixtures/ (with its metadata).
std::map<std::string, kg::Tensor> fixture(const std::string& name,
                                          std::map<std::string, std::string>* metadata = nullptr);

// The lines of a check_op / check_gradients report that start with `prefix` and contain every
// one of `parts`.
int count_lines(const kg::testing::CheckOpReport& r, const std::string& prefix,
                const std::vector<std::string>& parts = {});

// Runs `fn` and expects a kg::Error whose message contains every string of `parts`.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts);

// Runs zero_grad, forward(in) and backward() on both models and expects each of `want`'s
// parameter gradients in `got` within rtol/atol (and, with `written`, every element written).
void expect_same_gradients(kg::LoadedModel& want, kg::LoadedModel& got, const std::vector<kg::Tensor>& in,
                           double rtol, double atol, bool written = false);

}  // namespace kg_test
