// Default behaviour of RuntimeOp: right for a single-launch inference op.
#include "kg/runtime_op.hpp"
#include "util/str.hpp"

namespace kg {

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

}  // namespace kg
