// What the kgraph commands take as MODEL: a zoo model or an ONNX file, with its inputs (name,
// dtype, symbolic shape) and the concrete input shapes made from --batch, --dim or an input file.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kg/model.hpp"
#include "kg/onnx.hpp"
#include "kg/tensor.hpp"

namespace kgraph {

// The sizes of named dynamic dims given on the command line.
struct DimOptions {
  std::optional<std::int64_t> batch;                       // --batch N: every dim named "batch"
  std::vector<std::pair<std::string, std::int64_t>> dims;  // --dim NAME=SIZE, in the order given
  bool empty() const { return !batch && dims.empty(); }
};

// Parses the value of --dim, "NAME=SIZE" with SIZE a whole number >= 1; throws kg::Error saying
// what was expected and what was got.
std::pair<std::string, std::int64_t> parse_dim(const std::string& text);

// The size of each dynamic dim symbol, in the order the symbols first appear in the inputs.
struct DimBinding {
  std::vector<std::pair<std::string, std::int64_t>> sizes;
  std::optional<std::int64_t> find(const std::string& symbol) const;
  // "batch 2, sequence 5"; "static shapes" when there are none.
  std::string to_string() const;
};

class ModelSource {
 public:
  // `spec` is a zoo name (kg::models::names()) or a path: one ending in ".onnx", or any existing
  // file, is imported with kg::onnx::import. A missing file or an unknown name is a kg::Error
  // listing the zoo and saying that an .onnx path is accepted too.
  static ModelSource open(const std::string& spec, kg::LoweringMode mode = kg::LoweringMode::Inference,
                          const kg::ModelOptions& options = {});

  // MODEL as given ("lenet5", "models/bert.onnx").
  const std::string& name() const { return name_; }
  // True for an imported file (its parameters hold the file's initializers).
  bool is_file() const { return is_file_; }
  const kg::Model& model() const { return model_; }
  // The graph inputs in order.
  const std::vector<kg::onnx::InputInfo>& inputs() const { return inputs_; }

  // Binds every dynamic dim from the options: "batch" from --batch (default 1), the others from
  // --dim. An unnamed dynamic dim, an unset named one, or an option naming no dim of the model
  // is a kg::Error naming the input, the dim and the option to use.
  DimBinding bind(const DimOptions& options) const;
  // The concrete input shapes, in input order, for a binding of every named dim.
  std::vector<std::vector<std::int64_t>> shapes(const DimBinding& binding) const;

  // Checks tensors (one per input, in order, read from `file`) against the inputs: rank, static
  // dims, dtype (a float tensor may feed another float dtype), the same size for a symbol shared
  // by several inputs, and agreement with any --batch/--dim given. Returns the binding the
  // tensors' shapes make.
  DimBinding bind_tensors(const std::vector<std::pair<std::string, kg::Tensor>>& tensors, const std::string& file,
                          const DimOptions& options) const;

 private:
  ModelSource(std::string name, bool is_file, kg::Model model);
  // The dynamic dim symbols of the inputs, in order of first appearance ("" left out).
  std::vector<std::string> symbols() const;
  // Throws for an option that names no dynamic dim of the model.
  void check_options_name_dims(const DimOptions& options) const;

  std::string name_;
  bool is_file_ = false;
  kg::Model model_;
  std::vector<kg::onnx::InputInfo> inputs_;
};

}  // namespace kgraph
