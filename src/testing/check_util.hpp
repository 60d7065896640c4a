// Helpers shared by the op checkers (check_op, check_gradients): random inputs, poisoned-buffer
// checks, elementwise comparison with a tolerance, and the report writer.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "kg/error.hpp"
#include "kg/tensor.hpp"
#include "kg/testing.hpp"
#include "util/str.hpp"

namespace kg::testing::detail {

// "[1, 2]": the multi-index of flat element `flat` in `shape`.
std::string index_text(std::int64_t flat, const std::vector<std::int64_t>& shape);
// A value with 9 significant digits, and in scientific notation with 2.
std::string num(double v);
std::string sci(double v);

// Uniform values in [-1, 1]; integers in {-1, 0, 1} ({0, 1} when unsigned or bool).
Tensor random_input(std::mt19937_64& rng, DType dtype, const std::vector<std::int64_t>& shape);

// Elements that are NaN (float dtypes): never written into a NaN-poisoned buffer. `first` gets
// the first one's flat index.
std::int64_t count_nan(const Tensor& t, std::int64_t* first);
// The first element whose bytes differ, or -1 (0 when shapes or dtypes differ).
std::int64_t first_byte_difference(const Tensor& a, const Tensor& b);
// True when every byte of element `i` is `v`.
bool all_bytes(const Tensor& t, std::int64_t i, unsigned char v);

// Runs `fn` (a GPU check). When a kernel faulted in it, the error says that the process's CUDA
// context is now unusable, and `faulted` is set.
void with_gpu_fault_note(bool& faulted, const std::function<void()>& fn);
// Why GPU checks cannot run in this process any more ("" while they can).
std::string gpu_unusable();

struct Comparison {
  bool ok = true;
  std::string text;
};

// |got - want| <= atol + rtol * |want| elementwise; NaN only where the reference is NaN. The text
// names `what` and `ref`, the worst element and both values.
Comparison compare(const Tensor& got, const Tensor& want, double rtol, double atol, const std::string& what,
                   const std::string& ref);

// Writes PASS/FAIL/SKIP/INFO lines into a report.
class Reporter {
 public:
  Reporter(CheckOpReport& r, std::string label) : r_(r), label_(std::move(label)) {}
  void set_label(std::string label) { label_ = std::move(label); }
  const std::string& label() const { return label_; }
  void pass(const std::string& where, const std::string& text) { add("PASS", where, text); }
  void skip(const std::string& where, const std::string& text) { add("SKIP", where, text); }
  void info(const std::string& text) { r_.lines.push_back("INFO " + text); }
  // A failure; the label is prefixed unless the text starts with "[" (errors from the library
  // already start with "[op @ node]").
  void fail(const std::string& where, const std::string& text);
  // Runs `fn`; a kg::Error or other exception becomes a failure line. Returns false on failure.
  template <class Fn>
  bool guard(const std::string& where, Fn&& fn) {
    try {
      fn();
      return true;
    } catch (const Error& e) {
      fail(where, e.what());
    } catch (const std::exception& e) {
      fail(where, util::cat("unexpected ", typeid(e).name(), ": ", e.what()));
    }
    return false;
  }

 private:
  void add(const char* kind, const std::string& where, const std::string& text);
  CheckOpReport& r_;
  std::string label_;
  std::map<std::string, std::pair<std::string, std::string>> last_failure_;  // stage -> (batch, text)
};

// check_gradients writing into `report`, with `prefix` before every stage name.
void run_gradient_checks(CheckOpReport& report, const CustomData& op,
                         const std::vector<std::vector<std::int64_t>>& shapes,
                         const std::vector<DType>& dtypes, const GradCheckOptions& options,
                         const std::string& prefix);

}  // namespace kg::testing::detail
