// Default behaviour of RuntimeOp (right for a single-launch inference op) and the typed kernel
// arguments.
#include <cstring>

#include "kg/error.hpp"
#include "kg/runtime_op.hpp"
#include "kg/shape.hpp"
#include "util/str.hpp"

namespace kg {

std::int64_t DeviceTensor::numel() const { return numel_of(shape); }

KernelArg::KernelArg(Kind kind, const void* data, std::size_t n) : kind_(kind), data_(n) {
  if (n) std::memcpy(data_.data(), data, n);
}
KernelArg::KernelArg(const DeviceTensor& t) : KernelArg(Kind::Pointer, &t.ptr, sizeof t.ptr) {}
KernelArg::KernelArg(std::int32_t v) : KernelArg(Kind::I32, &v, sizeof v) {}
KernelArg::KernelArg(std::int64_t v) : KernelArg(Kind::I64, &v, sizeof v) {}
KernelArg::KernelArg(std::uint32_t v) : KernelArg(Kind::U32, &v, sizeof v) {}
KernelArg::KernelArg(float v) : KernelArg(Kind::F32, &v, sizeof v) {}
KernelArg::KernelArg(double v) : KernelArg(Kind::F64, &v, sizeof v) {}

const char* KernelArg::kind_name(Kind k) {
  switch (k) {
    case Kind::Pointer:
      return "a pointer";
    case Kind::I32:
      return "an i32";
    case Kind::I64:
      return "an i64";
    case Kind::U32:
      return "a u32";
    case Kind::F32:
      return "an f32";
    case Kind::F64:
      return "an f64";
    case Kind::Bytes:
      return "raw bytes";
  }
  return "?";
}

KernelArg ptr(DevicePtr p) { return KernelArg(KernelArg::Kind::Pointer, &p, sizeof p); }
KernelArg raw_bytes(const void* data, std::size_t n) { return KernelArg(KernelArg::Kind::Bytes, data, n); }

std::vector<void*> KernelArgs::kernel_params() const {
  std::vector<void*> v;
  for (const auto& a : args_) v.push_back(const_cast<std::byte*>(a.data().data()));
  return v;
}

void RuntimeOp::pack_args(const LaunchTensors&, ArgVisitor&) const {
  throw Error("RuntimeOp describes no launch: override pack_args() (one launch) or launches()");
}
Dim3 RuntimeOp::block() const { return {256, 1, 1}; }
Dim3 RuntimeOp::grid(const std::vector<std::int64_t>& output_shape) const {
  const std::int64_t n = numel_of(output_shape), b = std::max<std::int64_t>(1, block().x);
  // One thread per element: more blocks than gridDim.x can hold is an error, not a wrapped grid
  // (override grid() with a grid-stride loop for larger outputs).
  const std::int64_t blocks = n / b + (n % b != 0);
  constexpr std::int64_t kMaxX = (std::int64_t{1} << 31) - 1;
  if (blocks > kMaxX)
    throw Error(util::cat("the default grid (one thread per output element) for ",
                          sizes_to_string(output_shape), " needs gridDim.x = ", blocks,
                          ", over CUDA's limit of ", kMaxX,
                          "; override RuntimeOp::grid() (a grid-stride loop) for outputs this large"));
  return {static_cast<unsigned>(blocks), 1, 1};
}
std::vector<Launch> RuntimeOp::launches(const LaunchTensors& t) const {
  Launch l;
  l.block = block();
  l.grid = grid(t.output.shape);
  pack_args(t, l.args);
  std::vector<Launch> v;
  v.push_back(std::move(l));
  return v;
}
bool RuntimeOp::depends_on_run() const { return false; }
std::size_t RuntimeOp::scratch_bytes(const LaunchTensors&) const { return 0; }
bool RuntimeOp::supports_train_mode() const { return true; }
std::optional<LibraryCall> RuntimeOp::library_call(const LaunchTensors&) const { return std::nullopt; }
std::optional<LibraryBackward> RuntimeOp::backward_library_calls(const LaunchTensors&) const {
  return std::nullopt;
}
std::vector<Launch> RuntimeOp::backward_launches(const LaunchTensors&) const { return {}; }
std::size_t RuntimeOp::backward_scratch_bytes(const LaunchTensors&) const { return 0; }

}  // namespace kg
