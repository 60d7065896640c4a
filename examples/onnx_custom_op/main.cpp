// A model exported from PyTorch with a custom op: Linear -> RMSNorm -> ReLU -> Linear, where the
// RMSNorm is one ONNX node of the domain com.example (op RmsNorm), as PyTorch's exporter writes a
// torch.library kernel. kernelgraph serves that node with the user's CustomOp (the demo.rmsnorm of
// examples/rmsnorm: CUDA forward and backward, CPU forward and backward), runs the model against
// PyTorch's output, then trains it.
//
//   onnx_custom_op [model.onnx]   (default: tests/fixtures/onnx/rmsnorm_mlp.onnx of the source tree)
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>

#include "../rmsnorm/rmsnorm.hpp"
#include "kg/kg.hpp"
#include "kg/onnx.hpp"

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : KG_EXAMPLE_FIXTURES "/rmsnorm_mlp.onnx";
  try {
    // 1. Without a registration the importer lists what it cannot import, all at once.
    try {
      kg::onnx::import(path);
      std::printf("unexpected: the model imported without its custom op\n");
      return 1;
    } catch (const kg::Error& e) {
      std::printf("without the custom op:\n  %s\n\n", e.what());
    }

    // 2. The registration: com.example RmsNorm becomes demo.rmsnorm, with the node's epsilon. The
    //    node's initializer input (the weight) fills the op's declared parameter under its ONNX name.
    kg::onnx::OpRegistry registry;
    registry.add("com.example", "RmsNorm", [](const kg::onnx::NodeInfo& node) {
      return kg::CustomData::make<demo::RmsNormOp>(node.attributes.get_float("epsilon", 1e-6));
    });
    kg::onnx::ImportOptions options;
    options.registry = &registry;
    kg::Model model = kg::onnx::import(path, options);
    std::printf("%s\n", model.summary().c_str());

    // 3. Against PyTorch's output, on the CPU and (when there is one) on the GPU.
    const std::string case_path = std::filesystem::path(path).replace_filename("rmsnorm_mlp.case1.safetensors").string();
    const auto ref = kg::read_safetensors(case_path);
    const kg::Tensor& x = ref.at("input");
    const kg::Tensor& want = ref.at("logits");
    std::vector<kg::Device> devices{kg::Device::cpu()};
    if (kg::Device::cuda_available()) devices.push_back(kg::Device::cuda());
    for (const auto& d : devices) {
      kg::LoadedModel lm = model.load(d, {x.shape()});
      const kg::Tensor y = lm.forward({x}).at(0);
      double worst = 0;
      for (std::int64_t i = 0; i < want.numel(); ++i) worst = std::max(worst, std::abs(y.item(i) - want.item(i)));
      std::printf("%s: logits %s, max |kernelgraph - PyTorch| = %.2e\n", d.to_string().c_str(),
                  kg::sizes_to_string(y.shape()).c_str(), worst);
      if (!(worst <= 1e-4)) {
        std::printf("FAILED: the imported model differs from PyTorch\n");
        return 1;
      }
    }

    // 4. Training: the imported graph gets an MSE loss to a target; every parameter trains,
    //    the file's (fc1.weight, ...) and the custom op's (norm.weight).
    options.mode = kg::LoweringMode::Training;
    kg::onnx::ImportedGraph g = kg::onnx::import_graph(path, options);
    kg::SymTensor target = g.graph->input(kg::DType::F32, {kg::Dim::named("batch"), 4}, "target");
    kg::SymTensor loss = kg::mse_loss(g.output("logits"), target, "loss");
    kg::Model trainable(g.graph, {{"loss", loss}}, kg::LoweringMode::Training);
    std::mt19937_64 rng(7);
    std::normal_distribution<float> n(0.0f, 1.0f);
    std::vector<float> t(static_cast<std::size_t>(x.dim(0)) * 4);
    for (auto& v : t) v = n(rng);
    const kg::Tensor tgt = kg::Tensor::from_vector<float>({x.dim(0), 4}, t);
    kg::LoadedModel tm = trainable.load(kg::Device::cpu(), {x.shape(), tgt.shape()});
    tm.set_optimizer(kg::OptimizerOptions::adamw(1e-2, 0.0));
    double first = 0, last = 0;
    for (int step = 0; step < 50; ++step) {
      tm.zero_grad();
      last = tm.forward({x, tgt}).at(0).item(0);
      if (step == 0) first = last;
      tm.backward();
      tm.step();
    }
    std::printf("training: loss %.4f -> %.4f in 50 AdamW steps\n", first, last);
    if (!(last < 0.5 * first)) {
      std::printf("FAILED: the loss did not fall\n");
      return 1;
    }
    std::printf("parameters by their ONNX names:");
    for (const auto& p : tm.parameters()) std::printf(" %s", p.name.c_str());
    std::printf("\n");
  } catch (const kg::Error& e) {
    std::printf("error: %s\n", e.what());
    return 1;
  }
  return 0;
}
