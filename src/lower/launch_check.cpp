#include "lower/launch_check.hpp"

#include <cstring>

#include "kg/error.hpp"
#include "kg/shape.hpp"
#include "util/str.hpp"

namespace kg::lower {

void ArgPack::add(Kind k, const void* p, std::size_t n) {
  Arg a{k, std::vector<std::byte>(n)};
  if (n) std::memcpy(a.data.data(), p, n);
  args_.push_back(std::move(a));
}

std::vector<void*> ArgPack::kernel_params() {
  std::vector<void*> v;
  for (auto& a : args_) v.push_back(a.data.data());
  return v;
}

const char* ArgPack::kind_name(Kind k) {
  switch (k) {
    case Kind::Pointer: return "a pointer";
    case Kind::I32: return "an i32";
    case Kind::I64: return "an i64";
    case Kind::U32: return "a u32";
    case Kind::F32: return "an f32";
    case Kind::F64: return "an f64";
    case Kind::Bytes: return "raw bytes";
  }
  return "?";
}

namespace {

std::string dim3_str(Dim3 d) { return util::cat("(", d.x, ", ", d.y, ", ", d.z, ")"); }

// What a PTX parameter type is, in words.
std::string ptx_kind(const compile::PtxParam& p) {
  if (p.type == ".b8" && p.bytes != 1) return util::cat(p.bytes, " bytes (a by-value struct)");
  if (p.type == ".u64" || p.type == ".b64") return "8 bytes (.u64: a pointer or a 64-bit integer)";
  if (p.type == ".s64") return "8 bytes (.s64)";
  if (p.type == ".u32" || p.type == ".s32" || p.type == ".b32") return util::cat("4 bytes (", p.type, ": an integer)");
  if (p.type == ".f32") return "4 bytes (.f32: a float)";
  if (p.type == ".f64") return "8 bytes (.f64: a double)";
  return util::cat(p.bytes, " bytes (", p.type, ")");
}

bool compatible(ArgPack::Kind k, std::size_t bytes, const compile::PtxParam& p) {
  if (bytes != p.bytes) return false;
  const bool is_float_param = p.type == ".f32" || p.type == ".f64";
  switch (k) {
    case ArgPack::Kind::F32:
    case ArgPack::Kind::F64: return is_float_param || p.type == ".b8" || p.type.rfind(".b", 0) == 0;
    case ArgPack::Kind::Bytes: return true;
    default: return !is_float_param;
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
                          " visible entries (", util::join(names, ", "), "); name one in Lowered::entry_point"));
  }
  for (const auto& e : entries)
    if (e.visible && compile::entry_matches(e.name, entry_point)) return e;
  throw Error(util::cat(label, " entry point '", entry_point, "' is not a .visible .entry of the compiled module (it has: ",
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
    if (!compatible(args[i].kind, args[i].data.size(), entry.params[i]))
      throw Error(util::cat(label, " pack_args", where, ": argument ", i, pname(i), " is ", ptx_kind(entry.params[i]),
                            " in the kernel but ", ArgPack::kind_name(args[i].kind), " (", args[i].data.size(),
                            " bytes) was visited"));
  }
  if (args.size() < entry.params.size())
    throw Error(util::cat(label, " pack_args", where, ": the kernel '", entry.name, "' takes ", entry.params.size(),
                          " arguments but ", args.size(), " were visited; missing argument ", args.size(),
                          pname(args.size()), " (", ptx_kind(entry.params[args.size()]), ")"));
  if (args.size() > entry.params.size())
    throw Error(util::cat(label, " pack_args", where, ": the kernel '", entry.name, "' takes ", entry.params.size(),
                          " arguments but ", args.size(), " were visited"));
}

void check_block(const compile::PtxEntry& entry, Dim3 block, const std::string& label, int launch) {
  const std::string where = launch ? util::cat(" (launch ", launch, ")") : "";
  const unsigned long long threads = 1ull * block.x * block.y * block.z;
  if (threads == 0) throw Error(util::cat(label, " block", where, " ", dim3_str(block), " has a zero dimension"));
  if (threads > 1024)
    throw Error(util::cat(label, " block", where, " ", dim3_str(block), " has ", threads,
                          " threads; the limit is 1024"));
  if (entry.reqntid) {
    const Dim3 r = *entry.reqntid;
    if (r.x != block.x || r.y != block.y || r.z != block.z)
      throw Error(util::cat(label, " block", where, " ", dim3_str(block), " differs from the kernel's required .reqntid ",
                            dim3_str(r)));
  }
  if (entry.maxntid) {
    const Dim3 m = *entry.maxntid;
    const unsigned long long limit = 1ull * m.x * m.y * m.z;
    if (threads > limit)
      throw Error(util::cat(label, " block", where, " ", dim3_str(block), " has ", threads,
                            " threads, over the kernel's .maxntid ", dim3_str(m), " (", limit, ")"));
  }
}

void check_grid(Dim3 grid, const std::vector<std::int64_t>& output_shape, const std::string& label, int launch) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0)
    throw Error(util::cat(label, " grid", launch ? util::cat(" (launch ", launch, ")") : "", " ", dim3_str(grid),
                          " has a zero dimension for output ", sizes_to_string(output_shape),
                          "; nothing would run"));
}

void check_param_init(std::size_t got_bytes, const std::vector<std::int64_t>& shape, DType dtype,
                      const std::string& param_name, const std::string& label) {
  const std::size_t want = static_cast<std::size_t>(numel_of(shape)) * dtype_size(dtype);
  if (got_bytes != want)
    throw Error(util::cat(label, " param_init_data for '", param_name, "' has ", got_bytes, " bytes; its shape ",
                          sizes_to_string(shape), " × ", dtype_size(dtype), " bytes (", dtype_name(dtype), ") needs ",
                          want));
}

Error labelled(const std::string& label, const Error& err) {
  const std::string what = err.what();
  if (what.rfind(label, 0) == 0) return err;
  return Error(label + " " + what);
}

}  // namespace kg::lower
