#include "ops/op_util.hpp"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace kg::ops {

std::string device_literal(double v) {
  if (!std::isfinite(v)) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "__longlong_as_double(0x%016llxLL)",
                  static_cast<unsigned long long>(std::bit_cast<std::uint64_t>(v)));
    return buf;
  }
  char buf[40];
  auto res = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, res.ptr);
  // A whole number such as "2" would be an int literal: make it a double.
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return "(" + s + ")";
}

Shape broadcast_shapes(const Shape& a, const Shape& b) {
  const std::size_t r = std::max(a.rank(), b.rank());
  Shape out;
  for (std::size_t i = 0; i < r; ++i) {
    // Align from the right.
    const bool has_a = i + a.rank() >= r, has_b = i + b.rank() >= r;
    Dim da = has_a ? a[i + a.rank() - r] : Dim(1);
    Dim db = has_b ? b[i + b.rank() - r] : Dim(1);
    if (da.is_static() && da.size() == 1) {
      out.push_back(db);
    } else if (db.is_static() && db.size() == 1) {
      out.push_back(da);
    } else if (da.is_static() && db.is_static()) {
      if (da.size() != db.size())
        throw Error(util::cat("shapes ", a.to_string(), " and ", b.to_string(),
                              " do not broadcast (", da.size(), " vs ", db.size(), ")"));
      out.push_back(da);
    } else if (da.is_static()) {
      out.push_back(da);  // the dynamic side must be this size or 1 at load
    } else {
      out.push_back(db.is_static() ? db : da);
    }
  }
  return out;
}

Dim window_out(const Dim& in, std::int64_t k, std::int64_t stride, std::int64_t pad,
               std::int64_t dilation, bool ceil_mode, const char* what) {
  if (in.is_dynamic()) return Dim(dynamic);
  const std::int64_t span = dilation * (k - 1) + 1;
  const std::int64_t avail = in.size() + 2 * pad - span;
  if (avail < 0)
    throw Error(util::cat(what, " of ", in.size(), " with padding ", pad, " is smaller than the window ",
                          span, " (kernel ", k, ", dilation ", dilation, ")"));
  std::int64_t out = (ceil_mode ? (avail + stride - 1) / stride : avail / stride) + 1;
  // PyTorch: the last window must start inside the input or the left padding.
  if (ceil_mode && (out - 1) * stride >= in.size() + pad) --out;
  return Dim(out);
}

}  // namespace kg::ops
