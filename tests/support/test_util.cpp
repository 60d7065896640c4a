#include "support/test_util.hpp"

#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

namespace kg_test {

std::uint64_t fresh_seed() {
  static std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

kg::Tensor random_tensor(std::mt19937_64& rng, kg::DType dtype, std::vector<std::int64_t> shape, double lo,
                         double hi) {
  kg::Tensor t = kg::Tensor::empty(kg::DType::F64, std::move(shape));
  std::uniform_real_distribution<double> u(lo, hi);
  double* d = t.data<double>();
  for (std::int64_t i = 0; i < t.numel(); ++i) d[i] = u(rng);
  return dtype == kg::DType::F64 ? t : t.to(dtype);
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

bool all_written(const kg::Tensor& t) {
  for (std::int64_t i = 0; i < t.numel(); ++i)
    if (std::isnan(t.item(i))) return false;
  return true;
}

std::vector<kg::Tensor> run_graph(
    const std::function<std::vector<kg::SymTensor>(const std::vector<kg::SymTensor>&)>& build,
    const std::vector<kg::Tensor>& inputs, const std::map<std::string, kg::Tensor>& params,
    bool dynamic_batch, bool check_written) {
  auto graph = kg::Graph::create();
  std::vector<kg::SymTensor> xs;
  std::vector<std::vector<std::int64_t>> shapes;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    kg::Shape s = kg::Shape::of(inputs[i].shape());
    if (dynamic_batch && s.rank() > 0) s[0] = kg::Dim::named("batch");
    xs.push_back(graph->input(inputs[i].dtype(), s, "x" + std::to_string(i)));
    shapes.push_back(inputs[i].shape());
  }
  std::vector<kg::SymTensor> outs = build(xs);
  kg::Model model(graph, outs);
  kg::LoadOptions opt;
  opt.poison_buffers = true;
  kg::LoadedModel m = model.load(kg::Device::cpu(), shapes, opt);
  if (!params.empty()) m.load_state_dict(params, false);
  std::vector<kg::Tensor> result = m.forward(inputs);
  if (check_written) {
    for (std::size_t i = 0; i < result.size(); ++i) {
      EXPECT_TRUE(all_written(result[i])) << "output " << i << " has elements the op never wrote";
    }
  }
  return result;
}

kg::Tensor run_op(const std::function<kg::SymTensor(const kg::SymTensor&)>& build, const kg::Tensor& input,
                  const std::map<std::string, kg::Tensor>& params) {
  return run_graph([&](const std::vector<kg::SymTensor>& xs) { return std::vector<kg::SymTensor>{build(xs[0])}; },
                   {input}, params)[0];
}

::testing::AssertionResult all_close(const kg::Tensor& got, const kg::Tensor& want, double rtol, double atol) {
  if (got.shape() != want.shape())
    return ::testing::AssertionFailure() << "shape " << kg::sizes_to_string(got.shape()) << " vs expected "
                                         << kg::sizes_to_string(want.shape());
  double worst = 0;
  std::int64_t at = -1;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    double g = got.item(i), w = want.item(i);
    double r = std::isnan(g) != std::isnan(w) ? INFINITY
               : (std::isnan(g) || g == w)     ? 0.0
                                               : std::abs(g - w) / (atol + rtol * std::abs(w));
    if (!(r <= worst)) {
      worst = r;
      at = i;
    }
  }
  if (worst <= 1.0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "element " << at << ": got " << got.item(at) << ", expected "
                                       << want.item(at) << " (error " << worst << "x the tolerance rtol=" << rtol
                                       << " atol=" << atol << ")";
}

std::map<std::string, kg::Tensor> fixture(const std::string& name, std::map<std::string, std::string>* metadata) {
  return kg::read_safetensors(std::string(KG_SOURCE_DIR) + "/tests/fixtures/" + name, metadata);
}

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const kg::Error& e) {
    std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "error lacks '" << p << "':\n" << msg;
    return;
  }
  ADD_FAILURE() << "expected a kg::Error";
}

int count_lines(const kg::testing::CheckOpReport& r, const std::string& prefix, const std::vector<std::string>& parts) {
  int n = 0;
  for (const auto& l : r.lines) {
    if (l.rfind(prefix, 0) != 0) continue;
    bool all = true;
    for (const auto& p : parts) all = all && l.find(p) != std::string::npos;
    n += all;
  }
  return n;
}

kg::Tensor nan_tensor(kg::DType dtype, std::vector<std::int64_t> shape) {
  kg::Tensor t = kg::Tensor::empty(dtype, std::move(shape));
  t.fill(std::numeric_limits<double>::quiet_NaN());
  return t;
}

::testing::AssertionResult matches(const kg::Tensor& got, const std::vector<double>& want, double rtol,
                                   double atol) {
  if (got.numel() != static_cast<std::int64_t>(want.size()))
    return ::testing::AssertionFailure() << got.numel() << " elements, want " << want.size();
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.item(i), r = want[static_cast<std::size_t>(i)];
    if (!(std::abs(g - r) <= atol + rtol * std::abs(r)))
      return ::testing::AssertionFailure() << "element " << i << ": got " << g << ", want " << r;
  }
  return ::testing::AssertionSuccess();
}

void expect_same_gradients(kg::LoadedModel& want, kg::LoadedModel& got, const std::vector<kg::Tensor>& in,
                           double rtol, double atol, bool written) {
  for (auto* m : {&want, &got}) {
    m->zero_grad();
    m->forward(in);
    m->backward();
  }
  const auto w = want.gradients();
  const auto g = got.gradients();
  for (const auto& [name, t] : w) {
    SCOPED_TRACE(name);
    if (written) {
      EXPECT_TRUE(all_written(g.at(name)));
    }
    EXPECT_TRUE(all_close(g.at(name), t, rtol, atol));
  }
}

}  // namespace kg_test
