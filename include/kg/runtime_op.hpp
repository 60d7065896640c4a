// The launch-time description of a lowered op (RuntimeOp): consulted with concrete
// shapes to size scratch buffers and to describe the kernel launches of one execution — each
// launch an entry point, a grid, a block, dynamic shared bytes and typed arguments. The same
// description serves the forward, launches that depend on the run, and the backward.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "kg/dtype.hpp"

namespace kg {

// A device address (CUdeviceptr on a GPU; a host address under CUDA-on-CPU emulation).
using DevicePtr = std::uint64_t;

// A buffer as a launch sees it: its address and concrete sizes.
struct DeviceTensor {
  DevicePtr ptr = 0;
  std::vector<std::int64_t> shape;
  DType dtype = DType::F32;
  std::int64_t numel() const;
};

// Grid or block dimensions.
struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

// Receives a kernel's arguments in order (the single-launch packing interface). What was visited
// is checked against the kernel's CUDA signature on every device (count, byte size, pointer
// versus integer versus float, and a pointer's element type against the dtype of the tensor it
// points into: `float*` for an f32 tensor), and against its PTX on a GPU.
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

// One typed kernel argument. Converts implicitly from a DeviceTensor (its address) and from
// int32, int64, uint32, float and double values, each to its own kind; other integer types are
// refused at compile time (say which width you mean). Raw addresses go through kg::ptr().
class KernelArg {
 public:
  enum class Kind { Pointer, I32, I64, U32, F32, F64, Bytes };
  KernelArg(const DeviceTensor& t);   // NOLINT: implicit on purpose
  KernelArg(std::int32_t v);          // NOLINT
  KernelArg(std::int64_t v);          // NOLINT
  KernelArg(std::uint32_t v);         // NOLINT
  KernelArg(float v);                 // NOLINT
  KernelArg(double v);                // NOLINT
  KernelArg(std::uint64_t) = delete;  // a size or an address? use kg::ptr(p) or an int64
  KernelArg(bool) = delete;
  KernelArg(Kind kind, const void* data, std::size_t n);

  Kind kind() const { return kind_; }
  const std::vector<std::byte>& data() const { return data_; }
  // "a pointer", "an i32", ... for messages.
  static const char* kind_name(Kind k);

 private:
  Kind kind_;
  std::vector<std::byte> data_;
};

// A raw device address as a pointer argument.
KernelArg ptr(DevicePtr p);
// `n` bytes of a by-value struct.
KernelArg raw_bytes(const void* data, std::size_t n);

// A launch's arguments in order: built from a braced list of KernelArgs, or visited one by one
// (it is an ArgVisitor, so a pack_args() written for the visitor fills it too).
class KernelArgs final : public ArgVisitor {
 public:
  KernelArgs() = default;
  KernelArgs(std::initializer_list<KernelArg> args) : args_(args) {}
  void pointer(DevicePtr p) override { args_.push_back(ptr(p)); }
  void i32(std::int32_t v) override { args_.emplace_back(v); }
  void i64(std::int64_t v) override { args_.emplace_back(v); }
  void u32(std::uint32_t v) override { args_.emplace_back(v); }
  void f32(float v) override { args_.emplace_back(v); }
  void f64(double v) override { args_.emplace_back(v); }
  void bytes(const void* data, std::size_t n) override { args_.push_back(raw_bytes(data, n)); }
  void add(const KernelArg& a) { args_.push_back(a); }

  const std::vector<KernelArg>& args() const { return args_; }
  std::size_t size() const { return args_.size(); }
  // Pointers to each argument's bytes, as cuLaunchKernel's kernelParams wants them.
  std::vector<void*> kernel_params() const;

 private:
  std::vector<KernelArg> args_;
};

// One kernel launch.
struct Launch {
  // The __global__ function. Empty: Lowered::entry_point for the forward; the backward module's
  // only entry for the backward.
  std::string entry;
  Dim3 grid, block;
  std::size_t shared_bytes = 0;  // dynamic shared memory per block
  KernelArgs args;
};

// Everything one execution of a lowered op is given. In the forward the gradient fields are
// empty; in the backward every field is set. Tensors that CustomOp::backward_saves() did not keep
// and gradients nobody needs have ptr 0 (their shapes are still given). Gradients are
// overwritten, every element; the runtime sums contributions of several consumers. While sizing
// (scratch_bytes) every ptr is 0.
struct LaunchTensors {
  std::vector<DeviceTensor> inputs;  // the node's inputs, in recorded order
  std::vector<DeviceTensor> params;  // the op's parameters, in CustomOp::parameters() order
  DeviceTensor output;
  DevicePtr scratch = 0;   // scratch_bytes() (forward) or backward_scratch_bytes() (backward)
  bool training = false;   // the run is in train mode (Dropout, BatchNorm batch statistics)
  std::uint64_t seed = 0;  // differs per run and per node; the backward gets the forward's
  // Backward only:
  DeviceTensor grad_output;               // dLoss/dOutput
  std::vector<DeviceTensor> grad_inputs;  // dLoss/dInput, one per input
  std::vector<DeviceTensor> grad_params;  // dLoss/dParam, one per parameter
};

// A matrix product, possibly batched, over row-major operands that a vendor library can run:
//   C[i] = op(A[i]) · op(B[i]) (+ bias, one value per column) (then relu, if set),
// with op(X) = Xᵀ where trans_* is set, op(A) [m, k], op(B) [k, n], C [m, n], for i < batch.
struct GemmCall {
  DType dtype = DType::F32;  // of A, B, C and the bias
  DevicePtr a = 0, b = 0, c = 0;
  DevicePtr bias = 0;  // n values, or 0 for none
  bool trans_a = false, trans_b = false;
  std::int64_t m = 0, n = 0, k = 0;
  std::int64_t lda = 0, ldb = 0, ldc = 0;  // elements between rows of A, B and C as stored
  std::int64_t batch = 1;
  std::int64_t stride_a = 0, stride_b = 0, stride_c = 0;  // elements between batch items (0: one shared)
  bool relu = false;
};

// A 2-d convolution that a vendor library can run: y = conv(x, w) (+ bias, one value per output
// channel), cross-correlation as in PyTorch. In NCHW, x [N, C, H, W], y [N, O, OH, OW] and
// w [out_channels, in_channels / groups, kh, kw]; `channels_last`: x [N, H, W, C], y [N, OH, OW, O]
// and w [out_channels, kh, kw, in_channels / groups] (the sizes below are the same in both).
// The backward passes use the same description: BackwardData writes x = dL/dx from y = dL/dy and w;
// BackwardFilter writes w = dL/dw from x and y = dL/dy (the bias is not used by either).
struct Conv2dCall {
  enum class Pass { Forward, BackwardData, BackwardFilter };
  Pass pass = Pass::Forward;
  DType dtype = DType::F32;  // of x, w, y and the bias
  DevicePtr x = 0, w = 0, y = 0;
  DevicePtr bias = 0;  // out_channels values, or 0 for none
  std::int64_t batch = 0, in_channels = 0, height = 0, width = 0;
  std::int64_t out_channels = 0, kernel_h = 0, kernel_w = 0, out_height = 0, out_width = 0;
  std::int64_t pad_h = 0, pad_w = 0, stride_h = 1, stride_w = 1, dilation_h = 1, dilation_w = 1;
  std::int64_t groups = 1;
  bool channels_last = false;
  // Forward only, optional: what follows the convolution in the op, for a library that can fuse
  // it into the convolution's kernel: y = act(conv(x, w) + shift + residual), computed in f32 and
  // rounded once, `shift` out_channels values of `dtype`, `residual` a tensor laid out as y (0 for
  // none), act ReLU where `relu`. It must compute what the LibraryCall's epilogue launches compute
  // over the library's output (a library that takes it runs the call without them; one that does
  // not runs the plain convolution, then them).
  struct Fusable {
    DevicePtr shift = 0;
    DevicePtr residual = 0;
    bool relu = false;
  };
  std::optional<Fusable> fusable;
};

// A forward described for a vendor library (cuBLASLt for a GEMM, cuDNN for a convolution), so the
// runtime may call the library instead of the op's own launches where it is available (a tactic;
// docs/gpu.md). The op's launches stay the reference and the fallback: the CUDA emulator and a
// machine without the library run them, so both must compute the same output. `epilogue` lists
// launches of the op's own module that run after the library call, in place on the output, for
// what the library does not fuse (a folded BatchNorm, a residual add, an activation).
// `prologue` lists launches of the module that run before the call, e.g. to lay the weights out
// in the op's scratch the way the library wants them.
struct LibraryCall {
  std::variant<GemmCall, Conv2dCall> call;
  std::vector<Launch> epilogue;
  std::vector<Launch> prologue = {};
  // The op's own launches are expected to be faster on these shapes: a load that does not tune
  // (and has no kept choice) runs them; a tuned load still times both and keeps the faster.
  bool own_first = false;
};

// The backward described for vendor libraries: `calls` (each overwriting one gradient; their
// epilogues are launches of the backward module), then `launches` of the backward module for the
// gradients no library computes (a bias gradient). Gradients nobody wants (ptr 0) need no call.
struct LibraryBackward {
  std::vector<LibraryCall> calls;
  std::vector<Launch> launches;
};

class RuntimeOp {
 public:
  virtual ~RuntimeOp() = default;

  // ---- the single-launch form: override these three ----
  // Packs the kernel arguments (default: throws, for an op that overrides launches() instead).
  virtual void pack_args(const LaunchTensors& t, ArgVisitor& visitor) const;
  // Threads per block (default 256).
  virtual Dim3 block() const;
  // Blocks for the output's concrete shape (default: one thread per output element).
  virtual Dim3 grid(const std::vector<std::int64_t>& output_shape) const;

  // ---- the general form ----
  // The launches of one forward execution, run in order (default: one launch of the module's
  // entry from pack_args(), block() and grid()). At least one.
  virtual std::vector<Launch> launches(const LaunchTensors& t) const;
  // True when launches() reads t.training or t.seed: it is then called again on every run
  // (default false: the launches are described once, at load). On a GPU a run whose launches
  // equal the last run's replays the captured CUDA graph.
  virtual bool depends_on_run() const;
  // Scratch bytes of the forward (planned like any buffer, passed as t.scratch; default 0).
  virtual std::size_t scratch_bytes(const LaunchTensors& t) const;
  // False when the kernels only implement inference behaviour: a train-mode run through the
  // kernels is then an error naming the op.
  virtual bool supports_train_mode() const;
  // The forward as a vendor-library call for these tensors (default: none). Used only on a GPU,
  // for the forward; the backward still runs backward_launches().
  virtual std::optional<LibraryCall> library_call(const LaunchTensors& t) const;
  // The backward as vendor-library calls for these tensors (default: none), used on a GPU in
  // place of backward_launches() when every call can be planned.
  virtual std::optional<LibraryBackward> backward_library_calls(const LaunchTensors& t) const;

  // ---- backward (training): the kernels of CustomOp::lower_backward_source() ----
  // The backward launches, run in order. Called when lower_backward_source() is not empty, which
  // is what gives the op a lowered backward; an empty list is then an error naming the op.
  virtual std::vector<Launch> backward_launches(const LaunchTensors& t) const;
  // Scratch bytes of the backward (default 0).
  virtual std::size_t backward_scratch_bytes(const LaunchTensors& t) const;
};

}  // namespace kg
