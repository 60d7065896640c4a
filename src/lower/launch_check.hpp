// The checks where the seed says "nothing checks it": packed arguments against the kernel's PTX
// signature, block against .reqntid/.maxntid, the entry point against the module, zero grids,
// and parameter init sizes. Each failure is a kg::Error naming op, node and numbers.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "compile/ptx.hpp"
#include "kg/error.hpp"
#include "kg/runtime_op.hpp"

namespace kg::lower {

// Collects the arguments a RuntimeOp visits, as bytes ready for a launch.
class ArgPack final : public ArgVisitor {
 public:
  enum class Kind { Pointer, I32, I64, U32, F32, F64, Bytes };
  struct Arg {
    Kind kind;
    std::vector<std::byte> data;
  };
  void pointer(DevicePtr p) override { add(Kind::Pointer, &p, sizeof p); }
  void i32(std::int32_t v) override { add(Kind::I32, &v, sizeof v); }
  void i64(std::int64_t v) override { add(Kind::I64, &v, sizeof v); }
  void u32(std::uint32_t v) override { add(Kind::U32, &v, sizeof v); }
  void f32(float v) override { add(Kind::F32, &v, sizeof v); }
  void f64(double v) override { add(Kind::F64, &v, sizeof v); }
  void bytes(const void* data, std::size_t n) override { add(Kind::Bytes, data, n); }

  const std::vector<Arg>& args() const { return args_; }
  // Pointers to each argument's bytes, as cuLaunchKernel's kernelParams wants them.
  std::vector<void*> kernel_params();
  static const char* kind_name(Kind k);

 private:
  void add(Kind k, const void* p, std::size_t n);
  std::vector<Arg> args_;
};

// The entry named `entry_point` (or the module's only visible entry when empty). `label` is
// "[op @ node]".
const compile::PtxEntry& resolve_entry(const std::vector<compile::PtxEntry>& entries,
                                       const std::string& entry_point, const std::string& label);

// Visited arguments against the entry's parameters: count, byte size and kind. `names` are the
// parameter names from the CUDA signature (may be empty).
void check_args(const compile::PtxEntry& entry, const ArgPack& pack, const std::vector<std::string>& names,
                const std::string& label, int launch = 0);

// The block against the entry's .reqntid / .maxntid, and the 1024-thread limit.
void check_block(const compile::PtxEntry& entry, Dim3 block, const std::string& label, int launch = 0);

// `err` with "[op @ node]" in front, unless its message already starts with it.
Error labelled(const std::string& label, const Error& err);

// A grid with a zero dimension launches nothing: an error.
void check_grid(Dim3 grid, const std::vector<std::int64_t>& output_shape, const std::string& label,
                int launch = 0);

// param_init_data bytes against shape × dtype size.
void check_param_init(std::size_t got_bytes, const std::vector<std::int64_t>& shape, DType dtype,
                      const std::string& param_name, const std::string& label);

}  // namespace kg::lower
