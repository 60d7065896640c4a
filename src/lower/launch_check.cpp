#include "lower/launch_check.hpp"

#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "kg/error.hpp"
#include "kg/shape.hpp"
#include "util/str.hpp"

namespace kg::lower {

namespace {

std::string dim3_str(Dim3 d) { return util::cat("(", d.x, ", ", d.y, ", ", d.z, ")"); }

// What a PTX parameter type is, in words.
std::string ptx_kind(const compile::PtxParam& p) {
  if (p.type == ".b8" && p.bytes != 1) return util::cat(p.bytes, " bytes (a by-value struct)");
  if (p.type == ".u64" || p.type == ".b64") return "8 bytes (.u64: a pointer or a 64-bit integer)";
  if (p.type == ".s64") return "8 bytes (.s64)";
  if (p.type == ".u32" || p.type == ".s32" || p.type == ".b32")
    return util::cat("4 bytes (", p.type, ": an integer)");
  if (p.type == ".f32") return "4 bytes (.f32: a float)";
  if (p.type == ".f64") return "8 bytes (.f64: a double)";
  return util::cat(p.bytes, " bytes (", p.type, ")");
}

bool compatible(KernelArg::Kind k, std::size_t bytes, const compile::PtxParam& p) {
  if (bytes != p.bytes) return false;
  const bool is_float_param = p.type == ".f32" || p.type == ".f64";
  switch (k) {
    case KernelArg::Kind::F32:
    case KernelArg::Kind::F64:
      return is_float_param || p.type == ".b8" || p.type.rfind(".b", 0) == 0;
    case KernelArg::Kind::Bytes:
      return true;
    default:
      return !is_float_param;
  }
}

}  // namespace

const compile::PtxEntry& resolve_entry(const std::vector<compile::PtxEntry>& entries,
                                       const std::string& entry_point, const std::string& label) {
  std::vector<std::string> names;
  for (const auto& e : entries)
    if (e.visible) names.push_back(e.name);
  if (entry_point.empty()) {
    const compile::PtxEntry* only = nullptr;
    int count = 0;
    for (const auto& e : entries)
      if (e.visible) only = &e, ++count;
    if (count == 1) return *only;
    throw Error(util::cat(label, " lower() gave no entry point and the module has ", count,
                          " visible entries (", util::join(names, ", "),
                          "); name one in Lowered::entry_point"));
  }
  for (const auto& e : entries)
    if (e.visible && compile::entry_matches(e.name, entry_point)) return e;
  throw Error(util::cat(label, " entry point '", entry_point,
                        "' is not a .visible .entry of the compiled module (it has: ",
                        names.empty() ? "none" : util::join(names, ", "),
                        "); check the name, and declare the kernel extern \"C\" __global__"));
}

void check_args(const compile::PtxEntry& entry, const ArgPack& pack, const std::vector<std::string>& names,
                const std::string& label, int launch) {
  const auto& args = pack.args();
  const std::string where = launch ? util::cat(" (launch ", launch, ")") : "";
  auto pname = [&](std::size_t i) {
    return i < names.size() && names.size() == entry.params.size() ? " '" + names[i] + "'" : std::string();
  };
  const std::size_t n = std::min(args.size(), entry.params.size());
  for (std::size_t i = 0; i < n; ++i) {
    if (!compatible(args[i].kind(), args[i].data().size(), entry.params[i]))
      throw Error(util::cat(label, " pack_args", where, ": argument ", i, pname(i), " is ",
                            ptx_kind(entry.params[i]), " in the kernel but ",
                            KernelArg::kind_name(args[i].kind()), " (", args[i].data().size(),
                            " bytes) was visited"));
  }
  if (args.size() < entry.params.size())
    throw Error(util::cat(label, " pack_args", where, ": the kernel '", entry.name, "' takes ",
                          entry.params.size(), " arguments but ", args.size(),
                          " were visited; missing argument ", args.size(), pname(args.size()), " (",
                          ptx_kind(entry.params[args.size()]), ")"));
  if (args.size() > entry.params.size())
    throw Error(util::cat(label, " pack_args", where, ": the kernel '", entry.name, "' takes ",
                          entry.params.size(), " arguments but ", args.size(), " were visited"));
}

void check_block(const compile::PtxEntry& entry, Dim3 block, const std::string& label, int launch) {
  const std::string where = launch ? util::cat(" (launch ", launch, ")") : "";
  const unsigned long long threads = 1ull * block.x * block.y * block.z;
  if (threads == 0)
    throw Error(util::cat(label, " block", where, " ", dim3_str(block), " has a zero dimension"));
  if (threads > 1024)
    throw Error(util::cat(label, " block", where, " ", dim3_str(block), " has ", threads,
                          " threads; the limit is 1024"));
  if (entry.reqntid) {
    const Dim3 r = *entry.reqntid;
    if (r.x != block.x || r.y != block.y || r.z != block.z)
      throw Error(util::cat(label, " block", where, " ", dim3_str(block),
                            " differs from the kernel's required .reqntid ", dim3_str(r)));
  }
  if (entry.maxntid) {
    const Dim3 m = *entry.maxntid;
    const unsigned long long limit = 1ull * m.x * m.y * m.z;
    if (threads > limit)
      throw Error(util::cat(label, " block", where, " ", dim3_str(block), " has ", threads,
                            " threads, over the kernel's .maxntid ", dim3_str(m), " (", limit, ")"));
  }
}

void check_grid(Dim3 grid, const std::vector<std::int64_t>& output_shape, const std::string& label, int launch,
                const std::string& kernel) {
  const std::string output = output_shape.empty() ? "" : " for output " + sizes_to_string(output_shape);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0)
    throw Error(util::cat(label, " grid", launch ? util::cat(" (launch ", launch, ")") : "", " ", dim3_str(grid),
                          " has a zero dimension", output, "; nothing would run"));
  auto over = [&](const char* axis, unsigned v, unsigned long long limit) {
    if (v > limit)
      throw Error(util::cat(label, " launch ", launch, kernel.empty() ? "" : " of kernel '" + kernel + "'",
                            ": grid ", dim3_str(grid), output, " has gridDim.", axis, " = ", v,
                            ", over CUDA's limit of ", limit,
                            "; cover the work with a grid-stride loop or split it into several launches"));
  };
  over("x", grid.x, kMaxGridX);
  over("y", grid.y, kMaxGridYZ);
  over("z", grid.z, kMaxGridYZ);
}

void check_shared(std::size_t shared_bytes, const std::string& label, int launch, const std::string& kernel) {
  if (shared_bytes > kMaxDynamicSharedBytes)
    throw Error(util::cat(label, " launch ", launch, kernel.empty() ? "" : " of kernel '" + kernel + "'",
                          ": dynamic shared memory of ", shared_bytes, " bytes is over the limit of ",
                          kMaxDynamicSharedBytes, " bytes (227 KiB) per block"));
}

const std::vector<compile::KernelSignature>& source_kernels(const std::string& source) {
  static std::mutex mu;
  static std::map<std::size_t,
                  std::vector<std::pair<std::string, std::unique_ptr<std::vector<compile::KernelSignature>>>>>
      cache;
  const std::size_t h = std::hash<std::string>{}(source);
  std::lock_guard<std::mutex> lk(mu);
  auto& bucket = cache[h];
  for (auto& [text, kernels] : bucket)
    if (text == source) return *kernels;
  bucket.emplace_back(source,
                      std::make_unique<std::vector<compile::KernelSignature>>(compile::find_kernels(source)));
  return *bucket.back().second;
}

const compile::KernelSignature& resolve_source_entry(const std::vector<compile::KernelSignature>& kernels,
                                                     const std::string& entry, const std::string& label,
                                                     const std::string& what) {
  std::vector<std::string> names;
  for (const auto& k : kernels) names.push_back(k.name);
  const std::string module = what.empty() ? "kernel source" : what + " kernel source";
  if (entry.empty()) {
    if (kernels.size() == 1) return kernels[0];
    throw Error(util::cat(label, " no entry point was named and the ", module, " has ", kernels.size(),
                          " __global__ functions (", names.empty() ? "none" : util::join(names, ", "),
                          "); name one in ",
                          what.empty() ? "Lowered::entry_point or Launch::entry" : "Launch::entry"));
  }
  for (const auto& k : kernels)
    if (k.name == entry) return k;
  throw Error(util::cat(label, " entry point '", entry, "' is not a __global__ function of the ", module,
                        " (it has: ", names.empty() ? "none" : util::join(names, ", "), ")"));
}

namespace {

std::string cxx_kind(const compile::ParamClass& c) {
  using K = compile::ParamClass::Kind;
  switch (c.kind) {
    case K::Pointer:
      return "a pointer";
    case K::SignedInt:
      return util::cat("a ", c.bytes, "-byte signed integer");
    case K::UnsignedInt:
      return util::cat("a ", c.bytes, "-byte unsigned integer");
    case K::Float:
      return c.bytes == 8 ? "a double" : "a float";
    case K::Unknown:
      break;
  }
  return "a by-value type";
}

bool matches(const KernelArg& a, const compile::ParamClass& c) {
  using K = compile::ParamClass::Kind;
  using A = KernelArg::Kind;
  if (a.kind() == A::Bytes) return c.bytes == 0 || a.data().size() == c.bytes;
  switch (c.kind) {
    case K::Pointer:
      return a.kind() == A::Pointer;
    case K::SignedInt:
    case K::UnsignedInt:
      return (a.kind() == A::I32 || a.kind() == A::U32 || a.kind() == A::I64) && a.data().size() == c.bytes;
    case K::Float:
      return (a.kind() == A::F32 && c.bytes == 4) || (a.kind() == A::F64 && c.bytes == 8);
    case K::Unknown:
      return true;
  }
  return true;
}

}  // namespace

void check_launch(const compile::KernelSignature& kernel, const Launch& launch, const std::string& label,
                  int index, const std::string& what) {
  const std::string where =
      util::cat(what.empty() ? "" : " " + what, " launch ", index, " of kernel '", kernel.name, "'");
  check_grid(launch.grid, {}, label + (what.empty() ? "" : " " + what), index, kernel.name);
  check_shared(launch.shared_bytes, label + (what.empty() ? "" : " " + what), index, kernel.name);
  const unsigned long long threads = 1ull * launch.block.x * launch.block.y * launch.block.z;
  if (threads == 0 || threads > 1024)
    throw Error(util::cat(label, where, ": block ", dim3_str(launch.block), " has ", threads,
                          " threads; a block has 1 to 1024"));
  if (launch.block.x > 1024 || launch.block.y > 1024 || launch.block.z > 64)
    throw Error(util::cat(label, where, ": block ", dim3_str(launch.block),
                          " is over CUDA's limits of 1024 (x), 1024 (y) and 64 (z) threads"));
  if (!kernel.launch_bounds.empty()) {
    char* end = nullptr;
    const unsigned long long bound = std::strtoull(kernel.launch_bounds.c_str(), &end, 0);
    if (end && *end == '\0' && bound > 0 && threads > bound)
      throw Error(util::cat(label, where, ": block ", dim3_str(launch.block), " has ", threads,
                            " threads, over the kernel's __launch_bounds__(", bound, ")"));
  }
  const auto& args = launch.args.args();
  const std::size_t want = kernel.param_types.size();
  auto param = [&](std::size_t i) {
    const std::string& n = i < kernel.param_names.size() ? kernel.param_names[i] : std::string();
    return util::cat("argument ", i, n.empty() ? "" : " '" + n + "'", " (", kernel.param_types[i], ")");
  };
  for (std::size_t i = 0; i < std::min(args.size(), want); ++i) {
    const compile::ParamClass c = compile::classify_param_type(kernel.param_types[i]);
    if (!matches(args[i], c))
      throw Error(util::cat(label, where, ": ", param(i), " is ", cxx_kind(c), " in the kernel but ",
                            KernelArg::kind_name(args[i].kind()), " (", args[i].data().size(),
                            " bytes) was packed"));
  }
  if (args.size() < want)
    throw Error(util::cat(label, where, ": the kernel takes ", want, " arguments but ", args.size(),
                          " were packed; missing ", param(args.size())));
  if (args.size() > want)
    throw Error(
        util::cat(label, where, ": the kernel takes ", want, " arguments but ", args.size(), " were packed"));
}

Error labelled(const std::string& label, const Error& err) {
  const std::string what = err.what();
  if (what.rfind(label, 0) == 0) return err;
  return Error(label + " " + what);
}

}  // namespace kg::lower
