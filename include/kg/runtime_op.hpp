// The launch-time description of a lowered op (the seed's RuntimeOp): consulted with concrete
// shapes every time the op executes, to size buffers, pack kernel arguments and pick grids.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kg/dtype.hpp"

namespace kg {

// A device address (CUdeviceptr on a GPU; a host address under CUDA-on-CPU emulation).
using DevicePtr = std::uint64_t;

// A buffer handed to pack_args: its address and concrete sizes.
struct DeviceTensor {
  DevicePtr ptr = 0;
  std::vector<std::int64_t> shape;
  DType dtype = DType::F32;
};

// Grid or block dimensions.
struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

// Receives a kernel's arguments in order. The runtime checks what was visited against the
// kernel's PTX parameter list (count and byte sizes, names from the CUDA signature).
class ArgVisitor {
 public:
  virtual ~ArgVisitor() = default;
  virtual void pointer(DevicePtr p) = 0;
  virtual void i32(std::int32_t v) = 0;
  virtual void i64(std::int64_t v) = 0;
  virtual void u32(std::uint32_t v) = 0;
  virtual void f32(float v) = 0;
  virtual void f64(double v) = 0;
  // A by-value struct: `n` raw bytes.
  virtual void bytes(const void* data, std::size_t n) = 0;
};

// What the backward launches of an op see. Tensors the op's CustomOp::backward_saves() did
// not ask for, and gradients nobody needs, have ptr 0 (their shapes are still given).
// Gradients are overwritten, every element; the runtime sums contributions of several
// consumers.
struct BackwardTensors {
  std::vector<DeviceTensor> inputs;       // the forward's activation inputs
  std::vector<DeviceTensor> params;       // the op's parameters
  DeviceTensor output;                    // the forward's output
  DeviceTensor grad_output;               // dLoss/dOutput
  std::vector<DeviceTensor> grad_inputs;  // dLoss/dInput, one per activation input
  std::vector<DeviceTensor> grad_params;  // dLoss/dParam, one per parameter
  DevicePtr scratch = 0;                  // backward_scratch_bytes() bytes
  std::uint64_t seed = 0;                 // the forward's seed (random ops)
  bool training = true;                   // the forward ran in train mode (Dropout, BatchNorm)
};

// What may change from one run of a loaded model to the next: the mode, and a seed that differs
// per run and per node (the one the CPU implementation and the backward get).
struct RunInfo {
  bool training = false;
  std::uint64_t seed = 0;
};

class RuntimeOp {
 public:
  virtual ~RuntimeOp() = default;

  // ---- what every op writes ----
  // How many of the node's inputs are activations (the rest are not passed).
  virtual int n_activation_inputs() const = 0;
  // Packs the kernel arguments of launch 0.
  virtual void pack_args(const std::vector<DeviceTensor>& inputs, const std::vector<DeviceTensor>& params,
                         const DeviceTensor& output, const std::vector<std::int64_t>& output_shape,
                         std::int64_t output_row_stride, ArgVisitor& visitor) const = 0;
  virtual Dim3 block() const = 0;
  virtual Dim3 grid(const std::vector<std::int64_t>& output_shape) const = 0;

  // ---- defaults, right for a single-launch inference op ----
  // Concrete shapes of the op's parameters, uploaded once at load (default: none).
  virtual std::vector<std::vector<std::int64_t>> param_shapes(
      const std::vector<std::vector<std::int64_t>>& input_shapes,
      const std::vector<std::int64_t>& output_shape) const;
  // Parameter names (default "param0", "param1", ...); the node's name is prefixed.
  virtual std::vector<std::string> param_names() const;
  // Parameter dtype (default f32).
  virtual DType param_dtype(int i) const;
  // Initial bytes of parameter i (default none: zero-filled unless weights are loaded). The
  // size is checked against shape × dtype size.
  virtual std::optional<std::vector<std::byte>> param_init_data(int i) const;
  // Scratch bytes needed per execution (planned like any buffer; passed as `scratch`).
  virtual std::size_t scratch_bytes(const std::vector<std::vector<std::int64_t>>& input_shapes,
                                    const std::vector<std::int64_t>& output_shape) const;
  // Dynamic shared memory per block.
  virtual std::size_t dynamic_shared_bytes(const std::vector<std::int64_t>& output_shape) const;
  // Several launches per execution (each packed and sized separately).
  virtual int n_launches(const std::vector<std::int64_t>& output_shape) const;
  virtual void pack_args_for_launch(int launch, const std::vector<DeviceTensor>& inputs,
                                    const std::vector<DeviceTensor>& params, const DeviceTensor& output,
                                    const std::vector<std::int64_t>& output_shape,
                                    std::int64_t output_row_stride, DevicePtr scratch,
                                    ArgVisitor& visitor) const;
  virtual Dim3 grid_for_launch(int launch, const std::vector<std::int64_t>& output_shape) const;
  virtual Dim3 block_for_launch(int launch) const;
  // Elements between output rows (last dim); larger than the last dim pads each row. The
  // padded buffer is allocated and this stride passed to pack_args.
  virtual std::int64_t forward_output_row_stride(const std::vector<std::int64_t>& output_shape) const;
  // The output shape the kernel really writes, if it knows better than the graph's inference
  // (nullopt: the graph's). A disagreement is an error at load.
  virtual std::optional<std::vector<std::int64_t>> compute_concrete_output_shape(
      const std::vector<std::vector<std::int64_t>>& input_shapes) const;

  // False when the kernels only implement inference behaviour: a train-mode run on a GPU is
  // then an error naming the op.
  virtual bool supports_train_mode() const;

  // ---- launches that depend on the run (Dropout's mask, BatchNorm's batch statistics) ----
  // True when the launches differ with RunInfo (default false: they are packed once at load).
  // The runtime then sizes and packs them again on each run through the methods below, whose
  // defaults are the mode-independent ones above.
  virtual bool depends_on_run() const;
  virtual int n_launches_for_run(const RunInfo& run, const std::vector<std::int64_t>& output_shape) const;
  virtual Dim3 grid_for_run(const RunInfo& run, int launch, const std::vector<std::int64_t>& output_shape) const;
  virtual void pack_args_for_run(const RunInfo& run, int launch, const std::vector<DeviceTensor>& inputs,
                                 const std::vector<DeviceTensor>& params, const DeviceTensor& output,
                                 const std::vector<std::int64_t>& output_shape, std::int64_t output_row_stride,
                                 DevicePtr scratch, ArgVisitor& visitor) const;

  // ---- backward (training): kernels from CustomOp::lower_backward_source() ----
  // True when the op has backward launches (default false: training through this op on a
  // GPU is an error naming it).
  virtual bool has_backward() const;
  // Backward launches per execution (default 1), run in order.
  virtual int n_backward_launches(const BackwardTensors& t) const;
  // The __global__ function of backward launch `launch` in the backward source ("" = the
  // only one).
  virtual std::string backward_entry_point(int launch) const;
  // Packs the arguments of backward launch `launch` (checked against the PTX like forward).
  virtual void pack_backward_args(int launch, const BackwardTensors& t, ArgVisitor& visitor) const;
  virtual Dim3 backward_block(int launch) const;
  // A zero dimension is an error naming the op, the node and the launch.
  virtual Dim3 backward_grid(int launch, const BackwardTensors& t) const;
  virtual std::size_t backward_dynamic_shared_bytes(int launch, const BackwardTensors& t) const;
  // Scratch bytes for the backward (default 0).
  virtual std::size_t backward_scratch_bytes(const BackwardTensors& t) const;
};

}  // namespace kg
