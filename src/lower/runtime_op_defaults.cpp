// Default behaviour of RuntimeOp: right for a single-launch inference op.
#include "kg/runtime_op.hpp"
#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg {

std::vector<std::vector<std::int64_t>> RuntimeOp::param_shapes(const std::vector<std::vector<std::int64_t>>&,
                                                               const std::vector<std::int64_t>&) const {
  return {};
}
std::vector<std::string> RuntimeOp::param_names() const { return {}; }
DType RuntimeOp::param_dtype(int) const { return DType::F32; }
std::optional<std::vector<std::byte>> RuntimeOp::param_init_data(int) const { return std::nullopt; }
std::size_t RuntimeOp::scratch_bytes(const std::vector<std::vector<std::int64_t>>&,
                                     const std::vector<std::int64_t>&) const {
  return 0;
}
std::size_t RuntimeOp::dynamic_shared_bytes(const std::vector<std::int64_t>&) const { return 0; }
int RuntimeOp::n_launches(const std::vector<std::int64_t>&) const { return 1; }
void RuntimeOp::pack_args_for_launch(int, const std::vector<DeviceTensor>& inputs,
                                     const std::vector<DeviceTensor>& params, const DeviceTensor& output,
                                     const std::vector<std::int64_t>& output_shape, std::int64_t output_row_stride,
                                     DevicePtr, ArgVisitor& visitor) const {
  pack_args(inputs, params, output, output_shape, output_row_stride, visitor);
}
Dim3 RuntimeOp::grid_for_launch(int, const std::vector<std::int64_t>& output_shape) const {
  return grid(output_shape);
}
Dim3 RuntimeOp::block_for_launch(int) const { return block(); }
std::int64_t RuntimeOp::forward_output_row_stride(const std::vector<std::int64_t>& output_shape) const {
  return output_shape.empty() ? 1 : output_shape.back();
}
std::optional<std::vector<std::int64_t>> RuntimeOp::compute_concrete_output_shape(
    const std::vector<std::vector<std::int64_t>>&) const {
  return std::nullopt;
}

bool RuntimeOp::supports_train_mode() const { return true; }
bool RuntimeOp::depends_on_run() const { return false; }
int RuntimeOp::n_launches_for_run(const RunInfo&, const std::vector<std::int64_t>& output_shape) const {
  return n_launches(output_shape);
}
Dim3 RuntimeOp::grid_for_run(const RunInfo&, int launch, const std::vector<std::int64_t>& output_shape) const {
  return grid_for_launch(launch, output_shape);
}
void RuntimeOp::pack_args_for_run(const RunInfo&, int launch, const std::vector<DeviceTensor>& inputs,
                                  const std::vector<DeviceTensor>& params, const DeviceTensor& output,
                                  const std::vector<std::int64_t>& output_shape, std::int64_t output_row_stride,
                                  DevicePtr scratch, ArgVisitor& visitor) const {
  pack_args_for_launch(launch, inputs, params, output, output_shape, output_row_stride, scratch, visitor);
}
bool RuntimeOp::has_backward() const { return false; }
int RuntimeOp::n_backward_launches(const BackwardTensors&) const { return 1; }
std::string RuntimeOp::backward_entry_point(int) const { return {}; }
void RuntimeOp::pack_backward_args(int, const BackwardTensors&, ArgVisitor&) const {
  throw Error("has_backward() is true but RuntimeOp::pack_backward_args is not overridden");
}
Dim3 RuntimeOp::backward_block(int) const { return block(); }
Dim3 RuntimeOp::backward_grid(int, const BackwardTensors& t) const { return grid(t.grad_output.shape); }
std::size_t RuntimeOp::backward_dynamic_shared_bytes(int, const BackwardTensors&) const { return 0; }
std::size_t RuntimeOp::backward_scratch_bytes(const BackwardTensors&) const { return 0; }

}  // namespace kg
