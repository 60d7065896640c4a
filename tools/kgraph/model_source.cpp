// MODEL of the kgraph commands: a zoo model or an imported ONNX file, and the concrete input
// shapes made of --batch, --dim and input files.
#include "model_source.hpp"

#include <algorithm>
#include <cctype>
#include <filesystem>

#include "kg/error.hpp"
#include "kg/models.hpp"
#include "util/str.hpp"

namespace kgraph {
namespace {

constexpr const char* kBatch = "batch";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string zoo_list() { return kg::util::join(kg::models::names(), ", "); }

// A size given on the command line and the option that gave it ("--batch 2", "--dim sequence=5").
struct Given {
  std::int64_t size;
  std::string option;
};

// The options by symbol; "--dim batch=N" is the same as "--batch N" (the two must agree), and a
// --dim given twice for one name takes its last value.
std::map<std::string, Given> given_sizes(const DimOptions& options) {
  std::map<std::string, Given> given;
  for (const auto& [name, size] : options.dims) given[name] = {size, kg::util::cat("--dim ", name, "=", size)};
  if (options.batch) {
    auto it = given.find(kBatch);
    if (it != given.end() && it->second.size != *options.batch)
      throw kg::Error(kg::util::cat("--batch ", *options.batch, " and ", it->second.option, " disagree"));
    given[kBatch] = {*options.batch, kg::util::cat("--batch ", *options.batch)};
  }
  return given;
}

}  // namespace

std::pair<std::string, std::int64_t> parse_dim(const std::string& text) {
  const auto bad = [&] {
    return kg::Error(kg::util::cat("expects NAME=SIZE with SIZE a whole number >= 1 (e.g. sequence=16), got '", text,
                                   "'"));
  };
  const std::size_t eq = text.find('=');
  if (eq == std::string::npos || eq == 0) throw bad();
  const std::string name = text.substr(0, eq), value = text.substr(eq + 1);
  std::size_t used = 0;
  long long size = 0;
  try {
    size = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (value.empty() || used != value.size() || size < 1 || !std::isdigit(static_cast<unsigned char>(value[0])))
    throw bad();
  return {name, static_cast<std::int64_t>(size)};
}

std::optional<std::int64_t> DimBinding::find(const std::string& symbol) const {
  for (const auto& [s, size] : sizes)
    if (s == symbol) return size;
  return std::nullopt;
}

std::string DimBinding::to_string() const {
  if (sizes.empty()) return "static shapes";
  std::vector<std::string> parts;
  for (const auto& [s, size] : sizes) parts.push_back(kg::util::cat(s, " ", size));
  return kg::util::join(parts, ", ");
}

ModelSource::ModelSource(std::string name, bool is_file, kg::Model model)
    : name_(std::move(name)), is_file_(is_file), model_(std::move(model)), inputs_(kg::onnx::model_inputs(model_)) {}

ModelSource ModelSource::open(const std::string& spec, kg::LoweringMode mode, const kg::ModelOptions& model_options) {
  namespace fs = std::filesystem;
  const auto zoo = kg::models::names();
  const bool onnx_path = ends_with(spec, ".onnx");
  if (!onnx_path && std::find(zoo.begin(), zoo.end(), spec) != zoo.end())
    return ModelSource(spec, false, kg::models::build(spec, mode, model_options));
  std::error_code ec;
  const bool exists = fs::exists(spec, ec);
  if (onnx_path || exists) {
    if (!exists)
      throw kg::Error(kg::util::cat("model file '", spec, "' does not exist (MODEL is a zoo model: ", zoo_list(),
                                    "; or a path to an .onnx file)"));
    if (fs::is_directory(spec, ec))
      throw kg::Error(kg::util::cat("model file '", spec, "' is a directory, not an .onnx file (MODEL is a zoo model: ",
                                    zoo_list(), "; or a path to an .onnx file)"));
    kg::onnx::ImportOptions options;
    options.mode = mode;
    options.model = model_options;
    return ModelSource(spec, true, kg::onnx::import(spec, options));
  }
  throw kg::Error(kg::util::cat("unknown model '", spec, "'; known models: ", zoo_list(),
                                "; MODEL may also be a path to an .onnx file"));
}

std::vector<std::string> ModelSource::symbols() const {
  std::vector<std::string> out;
  for (const auto& in : inputs_)
    for (const kg::Dim& d : in.shape)
      if (d.is_dynamic() && !d.symbol().empty() && std::find(out.begin(), out.end(), d.symbol()) == out.end())
        out.push_back(d.symbol());
  return out;
}

void ModelSource::check_options_name_dims(const DimOptions& options) const {
  const auto known = symbols();
  for (const auto& [symbol, given] : given_sizes(options)) {
    if (std::find(known.begin(), known.end(), symbol) != known.end()) continue;
    throw kg::Error(kg::util::cat(given.option, ": ", name_, " has no dynamic dim named '", symbol, "' (",
                                  known.empty() ? std::string("its input shapes are all static")
                                                : "its dynamic dims: " + kg::util::join(known, ", "),
                                  ")"));
  }
}

DimBinding ModelSource::bind(const DimOptions& options) const {
  check_options_name_dims(options);
  const auto given = given_sizes(options);
  DimBinding binding;
  for (const auto& in : inputs_) {
    for (std::size_t k = 0; k < in.shape.rank(); ++k) {
      const kg::Dim& d = in.shape[k];
      if (d.is_static()) continue;
      if (d.symbol().empty())
        throw kg::Error(kg::util::cat("input '", in.name, "' of ", name_, " has an unnamed dynamic dim (dim ", k,
                                      " of ", in.shape.to_string(),
                                      "); --batch and --dim size dims by name, so only an --input file "
                                      "(kgraph run --input FILE) can give its size"));
      if (binding.find(d.symbol())) continue;
      if (auto it = given.find(d.symbol()); it != given.end()) {
        binding.sizes.emplace_back(d.symbol(), it->second.size);
      } else if (d.symbol() == kBatch) {
        binding.sizes.emplace_back(d.symbol(), 1);
      } else {
        throw kg::Error(kg::util::cat("input '", in.name, "' of ", name_, " has the dynamic dim '", d.symbol(), "' (",
                                      in.shape.to_string(), ") and no size for it: give one with --dim ",
                                      d.symbol(), "=SIZE"));
      }
    }
  }
  return binding;
}

std::vector<std::vector<std::int64_t>> ModelSource::shapes(const DimBinding& binding) const {
  std::vector<std::vector<std::int64_t>> out;
  for (const auto& in : inputs_) {
    std::vector<std::int64_t> sizes;
    for (const kg::Dim& d : in.shape) {
      if (d.is_static()) {
        sizes.push_back(d.size());
        continue;
      }
      const auto size = binding.find(d.symbol());
      if (!size)
        throw kg::Error(kg::util::cat("input '", in.name, "' of ", name_, ": no size for its dynamic dim '",
                                      d.to_string(), "' (", in.shape.to_string(), ")"));
      sizes.push_back(*size);
    }
    out.push_back(std::move(sizes));
  }
  return out;
}

DimBinding ModelSource::bind_tensors(const std::vector<std::pair<std::string, kg::Tensor>>& tensors,
                                     const std::string& file, const DimOptions& options) const {
  if (tensors.size() != inputs_.size())
    throw kg::Error(kg::util::cat("internal: ", tensors.size(), " tensors for ", inputs_.size(), " inputs"));
  DimBinding binding;
  std::map<std::string, std::string> bound_by;  // symbol → the tensor that set it
  for (std::size_t i = 0; i < inputs_.size(); ++i) {
    const auto& in = inputs_[i];
    const auto& [tname, t] = tensors[i];
    const std::string where = kg::util::cat("input file '", file, "': tensor '", tname, "'");
    if (t.rank() != in.shape.rank())
      throw kg::Error(kg::util::cat(where, " is ", kg::sizes_to_string(t.shape()), " (rank ", t.rank(), ") but ",
                                    name_, "'s input '", in.name, "' is ", in.shape.to_string(), " (rank ",
                                    in.shape.rank(), ")"));
    // The shape this input must have: its static dims, the symbols bound by earlier tensors, and
    // this tensor's own sizes for the rest (a symbol twice in one input, [n, n], binds at its
    // first dim).
    std::vector<std::int64_t> want;
    std::vector<std::pair<std::string, std::int64_t>> own;  // symbols this tensor binds
    std::vector<std::string> why;
    for (std::size_t k = 0; k < in.shape.rank(); ++k) {
      const kg::Dim& d = in.shape[k];
      const std::string& symbol = d.symbol();
      const auto own_size = [&]() -> std::optional<std::int64_t> {
        for (const auto& [s, size] : own)
          if (s == symbol) return size;
        return std::nullopt;
      };
      if (d.is_static()) {
        want.push_back(d.size());
      } else if (symbol.empty()) {
        want.push_back(t.dim(k));
      } else if (const auto earlier = binding.find(symbol)) {
        want.push_back(*earlier);
        const std::string text = kg::util::cat(symbol, " ", *earlier, " from tensor '", bound_by.at(symbol), "'");
        if (std::find(why.begin(), why.end(), text) == why.end()) why.push_back(text);
      } else if (const auto mine = own_size()) {
        want.push_back(*mine);
      } else {
        want.push_back(t.dim(k));
        own.emplace_back(symbol, t.dim(k));
        why.push_back(kg::util::cat(symbol, " ", t.dim(k)));
      }
    }
    if (t.shape() != want)
      throw kg::Error(kg::util::cat(where, " is ", kg::sizes_to_string(t.shape()), " but ", name_, " takes ",
                                    kg::sizes_to_string(want), why.empty() ? "" : " for " + kg::util::join(why, ", "),
                                    " (input '", in.name, "' is ", in.shape.to_string(), ")"));
    if (t.dtype() != in.dtype && !(kg::is_floating(t.dtype()) && kg::is_floating(in.dtype)))
      throw kg::Error(kg::util::cat(where, " is ", kg::dtype_name(t.dtype()), " but ", name_, "'s input '", in.name,
                                    "' is ", kg::dtype_name(in.dtype)));
    for (const auto& [symbol, size] : own) {
      binding.sizes.emplace_back(symbol, size);
      bound_by[symbol] = tname;
    }
  }

  check_options_name_dims(options);
  for (const auto& [symbol, given] : given_sizes(options)) {
    const auto size = binding.find(symbol);
    if (!size || *size == given.size) continue;
    const auto& tname = bound_by.at(symbol);
    const auto it = std::find_if(tensors.begin(), tensors.end(), [&](const auto& p) { return p.first == tname; });
    throw kg::Error(kg::util::cat(given.option, " disagrees with the input file '", file, "', whose tensor '", tname,
                                  "' has ", symbol, " ", *size, " (", kg::sizes_to_string(it->second.shape()), ")"));
  }
  return binding;
}

}  // namespace kgraph
