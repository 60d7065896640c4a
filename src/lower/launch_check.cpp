#include "lower/launch_check.hpp"

#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <regex>

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

namespace {

// The words of a pointer parameter's element type, without qualifiers ("const float* __restrict__"
// → "float"); "" when the type is not a pointer to one level.
std::string element_words(const std::string& type) {
  const std::size_t star = type.find('*');
  if (star == std::string::npos || type.find('*', star + 1) != std::string::npos) return "";
  std::vector<std::string> words;
  std::string w;
  for (char c : type.substr(0, star) + " ") {
    if (compile::text::is_ident(c) || c == ':') {
      w += c;
      continue;
    }
    if (!w.empty() && w != "const" && w != "volatile" && w != "struct" && w != "__restrict__" &&
        w != "__restrict" && w != "restrict")
      words.push_back(w.rfind("std::", 0) == 0 ? w.substr(5) : w.rfind("::", 0) == 0 ? w.substr(2) : w);
    w.clear();
  }
  std::string t;
  for (const auto& x : words) t += (t.empty() ? "" : " ") + x;
  return t;
}

PointeeType named_pointee(const std::string& t) {
  PointeeType r;
  auto vec = [&](const char* base) {  // "float" matches float, float1 .. float4
    const std::string b = base;
    return t == b || (t.size() == b.size() + 1 && t.rfind(b, 0) == 0 && t.back() >= '1' && t.back() <= '4');
  };
  if (vec("float")) r.dtype = DType::F32;
  else if (vec("double")) r.dtype = DType::F64;
  else if (t == "__half" || t == "half" || t == "__half2" || t == "half2" || t == "kg_f16")
    r.dtype = DType::F16;
  else if (t == "__nv_bfloat16" || t == "nv_bfloat16" || t == "__nv_bfloat162" || t == "nv_bfloat162" ||
           t == "kg_bf16")
    r.dtype = DType::BF16;
  else if (vec("int") || t == "signed int" || t == "signed" || t == "int32_t")
    r.dtype = DType::I32;
  else if (vec("longlong") || vec("long") || t == "long long" || t == "long long int" || t == "long int" ||
           t == "signed long long" || t == "int64_t")
    r.dtype = DType::I64;
  else if (vec("short") || t == "short int" || t == "signed short" || t == "int16_t")
    r.dtype = DType::I16;
  else if (t == "bool")
    r.dtype = DType::Bool;
  else if (vec("uint") || t == "unsigned" || t == "unsigned int" || t == "uint32_t")
    r.unsigned_bytes = 4;
  else if (vec("ushort") || t == "unsigned short" || t == "unsigned short int" || t == "uint16_t")
    r.unsigned_bytes = 2;
  else if (vec("ulonglong") || vec("ulong") || t == "unsigned long long" || t == "unsigned long long int" ||
           t == "unsigned long" || t == "unsigned long int" || t == "uint64_t" || t == "size_t")
    r.unsigned_bytes = 8;
  return r;
}

// `typedef T name;` and `using name = T;` of a source, by name (parsed once per distinct source).
const std::map<std::string, std::string>& source_aliases(const std::string& source) {
  static std::mutex mu;
  static std::map<std::size_t, std::vector<std::pair<std::string, std::map<std::string, std::string>>>> cache;
  const std::size_t h = std::hash<std::string>{}(source);
  std::lock_guard<std::mutex> lk(mu);
  auto& bucket = cache[h];
  for (auto& [text, aliases] : bucket)
    if (text == source) return aliases;
  std::map<std::string, std::string> aliases;
  if (source.find("typedef") != std::string::npos || source.find("using") != std::string::npos) {
    const std::string text = compile::text::blank_comments(source);
    static const std::regex typedef_re(R"(\btypedef\s+([A-Za-z_][\w:\s]*?)\s+([A-Za-z_]\w*)\s*;)");
    static const std::regex using_re(R"(\busing\s+([A-Za-z_]\w*)\s*=\s*([A-Za-z_][\w:\s]*?)\s*;)");
    for (std::sregex_iterator it(text.begin(), text.end(), typedef_re), end; it != end; ++it)
      aliases.emplace((*it)[2].str(), (*it)[1].str());
    for (std::sregex_iterator it(text.begin(), text.end(), using_re), end; it != end; ++it)
      aliases.emplace((*it)[1].str(), (*it)[2].str());
  }
  bucket.emplace_back(source, std::move(aliases));
  return bucket.back().second;
}

}  // namespace

PointeeType pointee_type(const std::string& type, const std::string& source) {
  std::string t = element_words(type);
  if (t.empty()) return {};
  PointeeType r = named_pointee(t);
  // An alias of the source (typedef float real;), followed a few levels.
  for (int depth = 0; depth < 4 && !r.dtype && r.unsigned_bytes == 0 && !source.empty(); ++depth) {
    const auto& aliases = source_aliases(source);
    auto it = aliases.find(t);
    if (it == aliases.end()) break;
    t = element_words(it->second + "*");
    r = named_pointee(t);
  }
  return r;
}

void check_pointees(const compile::KernelSignature& kernel, const Launch& launch, const LaunchTensors& tensors,
                    const std::string& source, const std::string& label, int index, const std::string& what) {
  struct Buffer {
    const DeviceTensor* t;
    std::string name;
  };
  std::vector<Buffer> buffers;
  for (std::size_t i = 0; i < tensors.inputs.size(); ++i) buffers.push_back({&tensors.inputs[i], util::cat("input ", i)});
  for (std::size_t i = 0; i < tensors.params.size(); ++i)
    buffers.push_back({&tensors.params[i], util::cat("parameter ", i)});
  buffers.push_back({&tensors.output, "the output"});
  buffers.push_back({&tensors.grad_output, "the output's gradient"});
  for (std::size_t i = 0; i < tensors.grad_inputs.size(); ++i)
    buffers.push_back({&tensors.grad_inputs[i], util::cat("the gradient of input ", i)});
  for (std::size_t i = 0; i < tensors.grad_params.size(); ++i)
    buffers.push_back({&tensors.grad_params[i], util::cat("the gradient of parameter ", i)});
  const auto& args = launch.args.args();
  for (std::size_t i = 0; i < args.size() && i < kernel.param_types.size(); ++i) {
    if (args[i].kind() != KernelArg::Kind::Pointer || args[i].data().size() != sizeof(DevicePtr)) continue;
    DevicePtr p = 0;
    std::memcpy(&p, args[i].data().data(), sizeof p);
    if (p == 0 || (tensors.scratch != 0 && p == tensors.scratch)) continue;
    const PointeeType want = pointee_type(kernel.param_types[i], source);
    // An unsigned word pointer (unsigned long long*, unsigned char*) moves raw bytes: a copy
    // kernel may move any dtype through it, so only typed pointers are checked.
    if (!want.dtype) continue;
    // The tensors whose buffer starts at the address, else those that contain it.
    std::vector<const Buffer*> at, inside;
    for (const auto& b : buffers) {
      if (b.t->ptr == 0) continue;
      const DevicePtr end = b.t->ptr + static_cast<DevicePtr>(numel_of(b.t->shape)) * dtype_size(b.t->dtype);
      if (p == b.t->ptr)
        at.push_back(&b);
      else if (p > b.t->ptr && p < end)
        inside.push_back(&b);
    }
    const auto& candidates = at.empty() ? inside : at;
    if (candidates.empty()) continue;
    bool any = false;
    for (const Buffer* b : candidates) any = any || b->t->dtype == *want.dtype;
    if (any) continue;
    const Buffer& b = *candidates.front();
    const std::string& n = i < kernel.param_names.size() ? kernel.param_names[i] : std::string();
    throw Error(util::cat(
        label, what.empty() ? "" : " " + what, " launch ", index, " of kernel '", kernel.name, "': argument ", i,
        n.empty() ? "" : " '" + n + "'", " (", kernel.param_types[i], ") points to ",
        dtype_name(*want.dtype), " elements",
        " but ", b.name, " packed there is ", dtype_name(b.t->dtype), " ", sizes_to_string(b.t->shape),
        "; the kernel would read and write it as the wrong type"));
  }
}

Error labelled(const std::string& label, const Error& err) {
  const std::string what = err.what();
  if (what.rfind(label, 0) == 0) return err;
  return Error(label + " " + what);
}

}  // namespace kg::lower
