// The model zoo by name: what `kgraph` and the benchmarks build.
#include <functional>

#include "kg/models.hpp"
#include "util/str.hpp"

namespace kg::models {
namespace {

struct Entry {
  const char* name;
  std::vector<std::int64_t> sample;  // the input's dims after the batch dim
  std::function<SymTensor(const SymTensor&)> build;
};

const std::vector<Entry>& zoo() {
  static const std::vector<Entry> entries{
      {"lenet5", {1, 28, 28}, [](const SymTensor& x) { return lenet5(x); }},
      {"resnet18", {3, 224, 224}, [](const SymTensor& x) { return resnet18(x); }},
      {"lenet5-tanh", {1, 28, 28}, [](const SymTensor& x) { return lenet5_tanh(x); }},
      {"resnet18-swish", {3, 224, 224},
       [](const SymTensor& x) {
         return resnet18_with(x, [](const SymTensor& h, const std::string& n) { return swish(h, n); });
       }},
  };
  return entries;
}

const Entry& find(const std::string& name) {
  for (const Entry& e : zoo())
    if (name == e.name) return e;
  throw Error(util::cat("unknown model '", name, "'; known models: ", util::join(names(), ", ")));
}

}  // namespace

std::vector<std::string> names() {
  std::vector<std::string> out;
  for (const Entry& e : zoo()) out.emplace_back(e.name);
  return out;
}

SymTensor record(const std::string& name, const SymTensor& x) { return find(name).build(x); }

Model build(const std::string& name, LoweringMode mode, const ModelOptions& options) {
  const Entry& e = find(name);
  std::vector<Dim> dims{Dim::named("batch")};
  for (std::int64_t d : e.sample) dims.emplace_back(d);
  auto [x, graph] = SymTensor::input(DType::F32, Shape(std::move(dims)), "input");
  SymTensor logits = e.build(x);
  std::vector<std::pair<std::string, SymTensor>> outputs{{"logits", logits}};
  return Model(graph, std::move(outputs), mode, options);
}

std::vector<std::int64_t> input_shape(const std::string& name, std::int64_t batch) {
  const Entry& e = find(name);
  if (batch <= 0) throw Error(util::cat("model '", name, "': batch must be positive, got ", batch));
  std::vector<std::int64_t> shape{batch};
  shape.insert(shape.end(), e.sample.begin(), e.sample.end());
  return shape;
}

}  // namespace kg::models
