// nn.constant (see constant.hpp).
#include "ops/constant.hpp"

#include <cstring>

#include "ops/gpu_util.hpp"
#include "ops/op_util.hpp"

namespace kg::ops {
namespace {

constexpr unsigned kThreads = 256;  // KG_CONSTANT_THREADS

// The widest word (8, 4 or 1 bytes) that divides `bytes`.
std::size_t word_of(std::size_t bytes) { return bytes % 8 == 0 ? 8 : bytes % 4 == 0 ? 4 : 1; }
std::string copy_entry(std::size_t word) {
  return word == 8 ? "kg_constant_copy_u64" : word == 4 ? "kg_constant_copy_u32" : "kg_constant_copy_u8";
}

std::size_t bytes_of(const DeviceTensor& t) { return static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype); }

Launch copy_launch(DevicePtr src, DevicePtr dst, std::size_t bytes) {
  const std::size_t w = word_of(bytes);
  const auto n = static_cast<std::int64_t>(bytes / w);
  return {copy_entry(w), grid_1d(n, kThreads), {kThreads, 1, 1}, 0, {ptr(src), ptr(dst), n}};
}

class ConstantRuntime final : public RuntimeOp {
 public:
  std::vector<Launch> launches(const LaunchTensors& t) const override {
    return {copy_launch(t.params.at(0).ptr, t.output.ptr, bytes_of(t.output))};
  }
  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    return {copy_launch(t.grad_output.ptr, t.grad_params.at(0).ptr, bytes_of(t.grad_output))};
  }
};

class ConstantOp final : public CustomOp {
 public:
  ConstantOp(DType dtype, std::vector<std::int64_t> shape, ParamInit init, bool trainable)
      : dtype_(dtype), shape_(std::move(shape)), init_(std::move(init)), trainable_(trainable) {}
  std::string name() const override { return "nn.constant"; }
  std::string attributes() const override {
    return util::cat(sizes_to_string(shape_), " ", dtype_name(dtype_), trainable_ ? " trainable" : "");
  }
  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 0);
    return Shape::of(shape_);
  }
  DType infer_output_dtype(const std::vector<DType>&) const override { return dtype_; }
  // An f32 constant (an imported model's weight) may be kept in f16 or bf16: its value is a
  // parameter, converted at load, and the copy below moves bytes whatever the dtype.
  bool computes_in(DType t) const override { return is_half_float(t) && dtype_ == DType::F32; }
  std::vector<ParamSpec> parameters(const std::vector<Shape>&) const override {
    return {{"value", shape_, dtype_, init_, trainable_ && is_floating(dtype_)}};
  }
  void cpu_forward(CpuContext& ctx) const override {
    if (ctx.output.nbytes()) std::memcpy(ctx.output.raw(), ctx.params[0].raw(), ctx.output.nbytes());
  }
  bool has_cpu_backward() const override { return true; }
  BackwardSaves backward_saves() const override { return {false, false}; }
  void cpu_backward(CpuBackwardContext& ctx) const override {
    if (ctx.wants_param_grad(0) && ctx.grad_output.nbytes())
      std::memcpy(ctx.grad_params[0].raw(), ctx.grad_output.raw(), ctx.grad_output.nbytes());
  }
  std::optional<Lowered> lower(const LowerContext&) const override {
    return Lowered{"nn.constant", kernel_file("constant.cu"), "", std::make_shared<ConstantRuntime>()};
  }
  std::string lower_backward_source(const LowerContext&) const override { return kernel_file("constant.cu"); }

 private:
  DType dtype_;
  std::vector<std::int64_t> shape_;
  ParamInit init_;
  bool trainable_;
};

}  // namespace

CustomData constant_op(DType dtype, std::vector<std::int64_t> shape, ParamInit init, bool trainable) {
  return CustomData::make<ConstantOp>(dtype, std::move(shape), std::move(init), trainable);
}

SymTensor record_constant(Graph& graph, const Tensor& value, const std::string& param_name,
                          const std::string& node_name, bool trainable) {
  std::vector<std::byte> bytes(value.nbytes());
  if (!bytes.empty()) std::memcpy(bytes.data(), value.raw(), bytes.size());
  // The node holds a default init; bind_param gives it the data under the file's name.
  SymTensor t = graph.record(constant_op(value.dtype(), value.shape(), ParamInit::constant(0.0), trainable), {},
                             value.dtype(), node_name);
  graph.bind_param(t.node(), 0, param_name, ParamInit::from_bytes(std::move(bytes)));
  return t;
}

}  // namespace kg::ops
