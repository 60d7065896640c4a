#include "testing/check_util.hpp"

#include <cmath>
#include <cstring>
#include <regex>
#include <sstream>

#include "kg/cuda.hpp"

namespace kg::testing::detail {

void with_gpu_fault_note(bool& faulted, const std::function<void()>& fn) {
  const bool before = !cuda::first_fault().empty();
  try {
    fn();
  } catch (const Error& e) {
    if (before || cuda::first_fault().empty()) throw;
    faulted = true;
    throw Error(util::cat(e.what(),
                          "; the kernel faulted on the GPU, which leaves this process's CUDA context ",
                          "unusable: later GPU checks in this process are skipped (check a kernel that may ",
                          "fault in a process of its own)"));
  }
}

std::string gpu_unusable() {
  const std::string f = cuda::first_fault();
  return f.empty() ? f
                   : "not run: a kernel fault earlier in this process left its CUDA context unusable (first "
                     "seen at: " +
                         f + ")";
}

std::string index_text(std::int64_t flat, const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> idx(shape.size(), 0);
  for (std::size_t d = shape.size(); d-- > 0;) {
    if (shape[d] > 0) {
      idx[d] = flat % shape[d];
      flat /= shape[d];
    }
  }
  return sizes_to_string(idx);
}

std::string num(double v) {
  std::ostringstream os;
  os.precision(9);
  os << v;
  return os.str();
}

std::string sci(double v) {
  std::ostringstream os;
  os.precision(2);
  os << std::scientific << v;
  return os.str();
}

Tensor random_input(std::mt19937_64& rng, DType dtype, const std::vector<std::int64_t>& shape) {
  if (is_floating(dtype)) {
    Tensor t = Tensor::empty(DType::F64, shape);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    double* d = t.data<double>();
    for (std::int64_t i = 0; i < t.numel(); ++i) d[i] = u(rng);
    return dtype == DType::F64 ? t : t.to(dtype);
  }
  Tensor t = Tensor::empty(dtype, shape);
  const bool is_unsigned = dtype == DType::U8 || dtype == DType::Bool;
  std::uniform_int_distribution<int> u(is_unsigned ? 0 : -1, 1);
  auto* p = static_cast<unsigned char*>(t.raw());
  const std::size_t size = dtype_size(dtype);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const std::int64_t v = u(rng);
    // Little-endian: the low bytes of the i64, sign-extended by construction.
    std::memcpy(p + static_cast<std::size_t>(i) * size, &v, size);
  }
  return t;
}

std::int64_t count_nan(const Tensor& t, std::int64_t* first) {
  std::int64_t n = 0;
  if (!is_floating(t.dtype())) return 0;
  for (std::int64_t i = 0; i < t.numel(); ++i)
    if (std::isnan(t.item(i)) && n++ == 0) *first = i;
  return n;
}

std::int64_t first_byte_difference(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return 0;
  const std::size_t size = dtype_size(a.dtype());
  const auto* pa = static_cast<const unsigned char*>(a.raw());
  const auto* pb = static_cast<const unsigned char*>(b.raw());
  for (std::int64_t i = 0; i < a.numel(); ++i)
    if (std::memcmp(pa + static_cast<std::size_t>(i) * size, pb + static_cast<std::size_t>(i) * size, size) !=
        0)
      return i;
  return -1;
}

bool all_bytes(const Tensor& t, std::int64_t i, unsigned char v) {
  const std::size_t size = dtype_size(t.dtype());
  const auto* p = static_cast<const unsigned char*>(t.raw()) + static_cast<std::size_t>(i) * size;
  for (std::size_t k = 0; k < size; ++k)
    if (p[k] != v) return false;
  return true;
}

Comparison compare(const Tensor& got, const Tensor& want, double rtol, double atol, const std::string& what,
                   const std::string& ref) {
  Comparison c;
  if (got.shape() != want.shape() || got.dtype() != want.dtype()) {
    c.ok = false;
    c.text = util::cat(what, " gives ", sizes_to_string(got.shape()), " ", dtype_name(got.dtype()), " but ",
                       ref, " gives ", sizes_to_string(want.shape()), " ", dtype_name(want.dtype()));
    return c;
  }
  std::int64_t bad = 0, worst_at = -1, diff_at = -1;
  double worst = 0, max_diff = 0;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.item(i), w = want.item(i);
    const bool gn = std::isnan(g), wn = std::isnan(w);
    double r = 0, d = 0;
    if (gn != wn) {
      r = d = INFINITY;
    } else if (!gn && g != w) {
      d = std::abs(g - w);
      r = d / (atol + rtol * std::abs(w));
    }
    if (d > max_diff || (diff_at < 0 && d > 0)) max_diff = d, diff_at = i;
    if (r > 1) ++bad;
    if (r > worst) worst = r, worst_at = i;
  }
  const std::string tol = util::cat("rtol ", num(rtol), ", atol ", num(atol));
  if (bad == 0) {
    c.text = util::cat(what, " matches ", ref, " within ", tol, " (max |diff| ", sci(max_diff),
                       diff_at >= 0 ? " at " + index_text(diff_at, want.shape()) : std::string(), ")");
    return c;
  }
  c.ok = false;
  c.text = util::cat(what, " differs from ", ref, " at ", bad, " of ", want.numel(), " elements; worst at ",
                     index_text(worst_at, want.shape()), ": ", num(got.item(worst_at)), " where ", ref,
                     " gives ", num(want.item(worst_at)), " (|diff| ",
                     sci(std::abs(got.item(worst_at) - want.item(worst_at))), ", ", sci(worst),
                     "x the tolerance ", tol, ")");
  return c;
}

void Reporter::fail(const std::string& where, const std::string& text) {
  r_.ok = false;
  // Errors from the library already start with "[op @ node]".
  const std::string full = text.rfind("[", 0) == 0 ? text : label_ + " " + text;
  // "batch 3, emulator": a failure of a stage that repeats the last batch's word for word
  // (a kernel that does not compile) is not written out again.
  const std::size_t comma = where.find(", ");
  if (where.rfind("batch ", 0) == 0 && comma != std::string::npos) {
    auto& [batch, last] = last_failure_[where.substr(comma + 2)];
    // The host compiler's temporary file names differ between two failed compiles.
    static const std::regex temp_name(R"(\.tmp\.[0-9]+\.[0-9]+\.)");
    const std::string key = std::regex_replace(full, temp_name, ".tmp.");
    if (last == key) {
      add("FAIL", where, util::cat(label_, " the same failure as ", batch));
      return;
    }
    batch = where.substr(0, comma);
    last = key;
  }
  add("FAIL", where, full);
}

void Reporter::add(const char* kind, const std::string& where, const std::string& text) {
  r_.lines.push_back(util::cat(kind, " ", where, where.empty() ? "" : ": ", text));
}

}  // namespace kg::testing::detail
