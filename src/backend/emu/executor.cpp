#include "backend/emu/executor.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <set>

#include "backend/emu/host_jit.hpp"
#include "backend/emu/library_reference.hpp"
#include "compile/compiler.hpp"
#include "kg/error.hpp"
#include "lower/launch_plan.hpp"
#include "lower/lowering.hpp"
#include "plan/plan_builder.hpp"
#include "plan/shape_binding.hpp"
#include "util/half.hpp"
#include "util/str.hpp"

namespace kg::emu {
namespace {

using Kind = KernelArg::Kind;

std::string kind_words(const KgEmuParam& p) {
  switch (p.kind) {
    case KG_EMU_POINTER:
      return "a pointer";
    case KG_EMU_SIGNED:
      return "a signed integer";
    case KG_EMU_UNSIGNED:
      return "an unsigned integer";
    case KG_EMU_FLOAT:
      return "a floating-point value";
    case KG_EMU_HALF:
      return "a __half";
    case KG_EMU_BF16:
      return "a __nv_bfloat16";
    default:
      return "a struct";
  }
}

// "`const float*` (8 bytes)" or, without the source's spelling, "a pointer (8 bytes)".
std::string type_text(const ParamDesc& p) {
  return util::cat(p.type.empty() ? kind_words(p.info) : "`" + p.type + "`", " (", p.info.size, " bytes)");
}

std::string arg_name(const KernelEntry& k, std::size_t i) {
  const std::string& n = k.params.at(i).name;
  return n.empty() ? util::cat("argument ", i) : util::cat("argument ", i, " '", n, "'");
}

bool compatible(Kind kind, std::size_t bytes, const KgEmuParam& p) {
  if (bytes != p.size) return false;
  switch (kind) {
    case Kind::Bytes:
      return true;
    case Kind::Pointer:
      return p.kind == KG_EMU_POINTER || p.kind == KG_EMU_OTHER;
    case Kind::F32:
    case Kind::F64:
      return p.kind == KG_EMU_FLOAT || p.kind == KG_EMU_OTHER;
    default:
      return p.kind == KG_EMU_SIGNED || p.kind == KG_EMU_UNSIGNED || p.kind == KG_EMU_OTHER;
  }
}

// The packed arguments against the kernel's C++ parameters: kind and size each, then the count.
void check_args(const KernelEntry& k, const lower::ArgPack& pack, const std::string& label) {
  const auto& args = pack.args();
  const std::size_t n = std::min(args.size(), k.params.size());
  for (std::size_t i = 0; i < n; ++i)
    if (!compatible(args[i].kind(), args[i].data().size(), k.params[i].info))
      throw Error(util::cat(label, " pack_args: ", arg_name(k, i), " is ", type_text(k.params[i]),
                            " in the kernel '", k.entry, "' but ", KernelArg::kind_name(args[i].kind()), " (",
                            args[i].data().size(), " bytes) was visited"));
  if (args.size() < k.params.size())
    throw Error(util::cat(label, " pack_args: the kernel '", k.entry, "' takes ", k.params.size(),
                          " arguments but ", args.size(), " were visited; missing ", arg_name(k, args.size()),
                          " ", type_text(k.params[args.size()])));
  if (args.size() > k.params.size())
    throw Error(util::cat(label, " pack_args: the kernel '", k.entry, "' takes ", k.params.size(),
                          " arguments but ", args.size(), " were visited"));
}

std::string dim3_text(Dim3 d) { return util::cat("(", d.x, ", ", d.y, ", ", d.z, ")"); }

void check_dims(const KernelEntry& k, Dim3 grid, Dim3 block, const std::string& label) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0)
    throw Error(
        util::cat(label, " grid ", dim3_text(grid), " of kernel '", k.entry, "' has a zero dimension"));
  if (grid.y > 65535 || grid.z > 65535 || grid.x > 2147483647u)
    throw Error(util::cat(label, " grid ", dim3_text(grid), " of kernel '", k.entry,
                          "' is over CUDA's limits (2^31-1, 65535, 65535)"));
  const unsigned long long threads = 1ull * block.x * block.y * block.z;
  if (threads == 0)
    throw Error(
        util::cat(label, " block ", dim3_text(block), " of kernel '", k.entry, "' has a zero dimension"));
  if (threads > 1024 || block.z > 64)
    throw Error(util::cat(label, " block ", dim3_text(block), " of kernel '", k.entry, "' has ", threads,
                          " threads; CUDA allows 1024 (and 64 in z)"));
  if (k.max_threads > 0 && threads > static_cast<unsigned long long>(k.max_threads))
    throw Error(util::cat(label, " block ", dim3_text(block), " has ", threads,
                          " threads, over the __launch_bounds__ (", k.max_threads, ") of kernel '", k.entry,
                          "'"));
}

// One element at `p` as text, by the pointee type.
std::string element_text(const unsigned char* p, const KgEmuParam& info) {
  const unsigned size = info.pointee_size;
  auto get = [&](auto v) {
    std::memcpy(&v, p, sizeof v);
    return v;
  };
  switch (info.pointee_kind) {
    case KG_EMU_FLOAT:
      if (size == 4) return util::cat(get(0.0f));
      if (size == 8) return util::cat(get(0.0));
      break;
    case KG_EMU_HALF:
      return util::cat(util::half_to_float(get(std::uint16_t{})));
    case KG_EMU_BF16:
      return util::cat(util::bf16_to_float(get(std::uint16_t{})));
    case KG_EMU_SIGNED:
      if (size == 1) return util::cat(static_cast<int>(get(std::int8_t{})));
      if (size == 2) return util::cat(get(std::int16_t{}));
      if (size == 4) return util::cat(get(std::int32_t{}));
      if (size == 8) return util::cat(get(std::int64_t{}));
      break;
    case KG_EMU_UNSIGNED:
      if (size == 1) return util::cat(static_cast<unsigned>(get(std::uint8_t{})));
      if (size == 2) return util::cat(get(std::uint16_t{}));
      if (size == 4) return util::cat(get(std::uint32_t{}));
      if (size == 8) return util::cat(get(std::uint64_t{}));
      break;
    default:
      break;
  }
  std::string s = "0x";
  char buf[4];
  for (unsigned i = 0; i < size && i < 16; ++i) {
    std::snprintf(buf, sizeof buf, "%02x", p[i]);
    s += buf;
  }
  return s;
}

long long floor_div(long long a, long long b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// A guarded copy of the host bytes [lo, hi) that one or more pointer arguments point into.
struct Group {
  std::uintptr_t lo = 0, hi = 0;
  std::vector<std::string> names;
  std::vector<std::size_t> args;  // pointer arguments into it
  std::unique_ptr<GuardedRegion> region;
  std::vector<unsigned char> before, forward;
  std::atomic<bool> atomic{false};
};

class CheckedLaunch {
 public:
  CheckedLaunch(const KernelEntry& k, const lower::ArgPack& pack, const std::vector<HostBuffer>& buffers,
                const std::string& label, util::ThreadPool* pool)
      : k_(k), label_(label), pool_(pool) {
    for (const auto& a : pack.args()) bytes_.push_back(a.data());
    // Each pointer argument to the buffer that contains it; overlapping buffers share one copy.
    std::vector<std::pair<std::size_t, std::size_t>> uses;  // (argument, buffer)
    for (std::size_t i = 0; i < bytes_.size(); ++i) {
      if (k.params[i].info.kind != KG_EMU_POINTER || bytes_[i].size() != sizeof(DevicePtr)) continue;
      DevicePtr p;
      std::memcpy(&p, bytes_[i].data(), sizeof p);
      if (p == 0) continue;
      std::size_t found = buffers.size();
      for (std::size_t b = 0; b < buffers.size() && found == buffers.size(); ++b)
        if (p >= buffers[b].address && (p < buffers[b].address + buffers[b].bytes || p == buffers[b].address))
          found = b;
      if (found == buffers.size()) {
        std::vector<std::string> names;
        for (const auto& b : buffers) names.push_back(b.name);
        throw Error(util::cat(label, " ", arg_name(k, i), " of kernel '", k.entry, "' points to 0x", std::hex,
                              p, std::dec, ", inside none of the launch's buffers (", util::join(names, ", "),
                              ")"));
      }
      uses.emplace_back(i, found);
    }
    std::vector<std::size_t> order;
    for (const auto& u : uses)
      if (std::find(order.begin(), order.end(), u.second) == order.end()) order.push_back(u.second);
    std::sort(order.begin(), order.end(),
              [&](std::size_t a, std::size_t b) { return buffers[a].address < buffers[b].address; });
    std::vector<int> group_of(buffers.size(), -1);
    for (std::size_t b : order) {
      const auto lo = static_cast<std::uintptr_t>(buffers[b].address), hi = lo + buffers[b].bytes;
      if (groups_.empty() || lo >= groups_.back()->hi) {
        groups_.push_back(std::make_unique<Group>());
        groups_.back()->lo = lo;
        groups_.back()->hi = hi;
      } else {
        groups_.back()->hi = std::max(groups_.back()->hi, hi);
      }
      groups_.back()->names.push_back(buffers[b].name);
      group_of[b] = static_cast<int>(groups_.size()) - 1;
    }
    for (auto& g : groups_) {
      g->region = std::make_unique<GuardedRegion>(g->hi - g->lo);
      if (g->hi > g->lo) std::memcpy(g->region->data(), reinterpret_cast<const void*>(g->lo), g->hi - g->lo);
    }
    for (const auto& [i, b] : uses) {
      Group& g = *groups_[static_cast<std::size_t>(group_of[b])];
      g.args.push_back(i);
      DevicePtr p;
      std::memcpy(&p, bytes_[i].data(), sizeof p);
      const DevicePtr moved = reinterpret_cast<std::uintptr_t>(g.region->data()) + (p - g.lo);
      std::memcpy(bytes_[i].data(), &moved, sizeof moved);
    }
    for (auto& b : bytes_) ptrs_.push_back(b.data());
  }

  // Guarded only: one run in `order`, the guards and canaries checked, written bytes copied back.
  void run_guarded(Dim3 grid, Dim3 block, std::size_t shared, Order order) {
    run_once(grid, block, shared, order);
    for (auto& g : groups_)
      if (g->hi > g->lo && std::memcmp(g->region->data(), reinterpret_cast<const void*>(g->lo), g->hi - g->lo) != 0)
        std::memcpy(reinterpret_cast<void*>(g->lo), g->region->data(), g->hi - g->lo);
  }

  void run(Dim3 grid, Dim3 block, std::size_t shared) {
    for (auto& g : groups_) g->before.assign(g->region->data(), g->region->data() + g->region->size());
    run_once(grid, block, shared, Order::Forward);
    for (auto& g : groups_) {
      g->forward.assign(g->region->data(), g->region->data() + g->region->size());
      if (!g->before.empty()) std::memcpy(g->region->data(), g->before.data(), g->before.size());
    }
    run_once(grid, block, shared, Order::Reverse);
    for (auto& g : groups_) {
      if (g->atomic) continue;  // float atomics may round differently in another order
      const unsigned char* now = g->region->data();
      for (std::size_t off = 0; off < g->forward.size(); ++off) {
        if (g->forward[off] == now[off]) continue;
        const std::size_t a = g->args.front();
        const auto& info = k_.params[a].info;
        const long long rel = static_cast<long long>(off) - arg_offset(*g, a);
        const long long elem = floor_div(rel, info.pointee_size);
        const std::size_t at = static_cast<std::size_t>(arg_offset(*g, a) + elem * info.pointee_size);
        throw Error(util::cat(
            label_, " kernel '", k_.entry, "': a race between the threads of a block: ", args_text(*g),
            " first differs at element ", elem, " (forward order ",
            element_text(g->forward.data() + at, info), ", reverse order ", element_text(now + at, info),
            ") when the threads run in forward and in reverse order between barriers; look for a missing "
            "__syncthreads() between a write to shared memory and another thread's read of it, or a read of "
            "memory no thread wrote"));
      }
    }
    // Back to the host buffers, only where the kernel wrote: an input may be read-only memory (a
    // memory-mapped safetensors file).
    for (auto& g : groups_)
      if (g->hi > g->lo && std::memcmp(g->region->data(), g->before.data(), g->hi - g->lo) != 0)
        std::memcpy(reinterpret_cast<void*>(g->lo), g->region->data(), g->hi - g->lo);
  }

 private:
  // The byte offset of an address from the start of a group's guarded copy.
  static long long offset_in(const Group& g, std::uintptr_t address) {
    return static_cast<long long>(address - reinterpret_cast<std::uintptr_t>(g.region->data()));
  }
  long long arg_offset(const Group& g, std::size_t a) const {
    DevicePtr p;
    std::memcpy(&p, bytes_[a].data(), sizeof p);
    return offset_in(g, p);
  }
  // The group whose guarded copy holds `address`, or null.
  Group* group_holding(std::uintptr_t address) const {
    for (const auto& g : groups_) {
      const auto lo = reinterpret_cast<std::uintptr_t>(g->region->data());
      if (address >= lo && address < lo + g->region->size()) return g.get();
    }
    return nullptr;
  }

  std::string args_text(const Group& g) const {
    std::vector<std::string> parts;
    for (std::size_t a : g.args) {
      bool seen = false;
      for (const auto& p : parts) seen = seen || p == arg_name(k_, a);
      if (!seen) parts.push_back(arg_name(k_, a));
    }
    const auto& first = k_.params[g.args.front()];
    return util::cat(util::join(parts, " / "), " (", first.type.empty() ? kind_words(first.info) : first.type,
                     "; buffer ", util::join(g.names, " + "), ", ", g.hi - g.lo, " bytes)");
  }

  // "element 100 (byte offset 400)" of the group's first argument, for a byte offset from the copy.
  std::string where_text(const Group& g, long long off) const {
    const std::size_t a = g.args.front();
    const long long rel = off - arg_offset(g, a);
    return util::cat("element ", floor_div(rel, k_.params[a].info.pointee_size), " (byte offset ", rel, ")");
  }

  void run_once(Dim3 grid, Dim3 block, std::size_t shared, Order order) {
    GridLaunch gl;
    gl.kernel = &k_;
    gl.grid = grid;
    gl.block = block;
    gl.shared = shared;
    gl.args = ptrs_.data();
    gl.order = order;
    gl.checked = true;  // guarded dynamic shared memory, atomics noted (also when only guarded)
    gl.label = label_;
    gl.pool = pool_;
    gl.describe_fault = [this](std::uintptr_t address, const std::string& access) -> std::string {
      for (const auto& g : groups_)
        if (auto off = g->region->guard_offset(address))
          return util::cat("out-of-bounds ", access, " ", *off < 0 ? "before the start" : "past the end",
                           " of ", args_text(*g), " at ", where_text(*g, *off));
      return "";
    };
    gl.describe_address = [this](std::uintptr_t address) -> std::string {
      const Group* g = group_holding(address);
      if (!g) return "";
      return util::cat(where_text(*g, offset_in(*g, address)), " of ", args_text(*g));
    };
    gl.note_atomic = [this](const void* address) {
      if (Group* g = group_holding(reinterpret_cast<std::uintptr_t>(address)))
        g->atomic.store(true, std::memory_order_relaxed);
    };
    run_grid(gl);
    for (const auto& g : groups_)
      if (auto off = g->region->check_canaries())
        throw Error(util::cat(label_, " kernel '", k_.entry, "': out-of-bounds write ",
                              *off < 0 ? "before the start" : "past the end", " of ", args_text(*g), " at ",
                              where_text(*g, *off), " (found after the launch; the thread is not known)"));
  }

  const KernelEntry& k_;
  std::string label_;
  util::ThreadPool* pool_ = nullptr;
  std::vector<std::vector<std::byte>> bytes_;
  std::vector<void*> ptrs_;
  std::vector<std::unique_ptr<Group>> groups_;
};

void run_kernel(const KernelEntry& k, Dim3 grid, Dim3 block, std::size_t shared, const lower::ArgPack& pack,
                const LaunchOptions& o, const std::string& label) {
  check_args(k, pack, label);
  check_dims(k, grid, block, label);
  if (o.checked) {
    CheckedLaunch c(k, pack, o.buffers, label, o.pool);
    c.run(grid, block, shared);
    return;
  }
  if (o.guarded && !o.buffers.empty()) {
    CheckedLaunch c(k, pack, o.buffers, label, o.pool);
    c.run_guarded(grid, block, shared, o.order);
    return;
  }
  std::vector<std::vector<std::byte>> bytes;
  std::vector<void*> ptrs;
  for (const auto& a : pack.args()) bytes.push_back(a.data());
  for (auto& b : bytes) ptrs.push_back(b.data());
  GridLaunch gl;
  gl.kernel = &k;
  gl.grid = grid;
  gl.block = block;
  gl.shared = shared;
  gl.args = ptrs.data();
  gl.order = o.order;
  gl.label = label;
  gl.pool = o.pool;
  run_grid(gl);
}

// Host memory aligned like a device allocation (256 bytes).
class HostBlock {
 public:
  explicit HostBlock(std::size_t bytes) : mem_(new std::byte[bytes + 256]), bytes_(bytes) {}
  std::byte* data() const {
    const auto p = reinterpret_cast<std::uintptr_t>(mem_.get());
    return reinterpret_cast<std::byte*>((p + 255) & ~std::uintptr_t(255));
  }
  DevicePtr address() const { return reinterpret_cast<std::uintptr_t>(data()); }
  std::size_t bytes() const { return bytes_; }

 private:
  std::unique_ptr<std::byte[]> mem_;
  std::size_t bytes_;
};

}  // namespace

void launch(const std::string& name, const std::string& source, const std::string& entry, Dim3 grid,
            Dim3 block, std::size_t shared, const lower::ArgPack& args) {
  launch(name, source, entry, grid, block, shared, args, LaunchOptions{});
}

void launch(const std::string& name, const std::string& source, const std::string& entry, Dim3 grid,
            Dim3 block, std::size_t shared, const lower::ArgPack& args, const LaunchOptions& options) {
  const std::string label = options.label.empty() ? "[" + name + "]" : options.label;
  auto mod = HostJit::global().load(name, source);
  run_kernel(mod->find(entry, label), grid, block, shared, args, options, label);
}

void launch(const JitModule& module, const std::string& entry, Dim3 grid, Dim3 block, std::size_t shared,
            const lower::ArgPack& args, const LaunchOptions& options) {
  const std::string label = options.label.empty() ? "[" + module.name + "]" : options.label;
  run_kernel(module.find(entry, label), grid, block, shared, args, options, label);
}

std::vector<Tensor> run_model(const Model& model, const std::vector<Tensor>& inputs,
                              const std::map<std::string, Tensor>& params, bool checked, bool library_calls,
                              int* library_steps, int* fused_steps) {
  if (library_steps) *library_steps = 0;
  const Graph& graph = model.graph();
  const auto& graph_inputs = graph.inputs();
  if (inputs.size() != graph_inputs.size())
    throw Error(util::cat("emu::run_model: the model has ", graph_inputs.size(), " inputs but ",
                          inputs.size(), " were given"));
  std::vector<std::vector<std::int64_t>> shapes;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const Node& n = graph.node(graph_inputs[i]);
    if (inputs[i].dtype() != n.dtype)
      throw Error(util::cat("emu::run_model: input ", i, " '", n.name, "' is ", dtype_name(n.dtype),
                            " but a ", dtype_name(inputs[i].dtype()), " tensor was given"));
    shapes.push_back(inputs[i].shape());
  }
  std::vector<int> outs;
  for (const auto& o : model.outputs()) outs.push_back(o.second);
  const auto bound = plan::bind_shapes(graph, model.live_nodes(), shapes);
  plan::Plan plan = plan::build_plan(graph, model.live_nodes(), outs, bound, 0);
  const lower::LoweredGraph lowered =
      lower::lower_model(model, lower::LowerTarget{bound.node_shapes, 0, true});
  lower::LaunchPlan lp = lower::size_launches(graph, lowered, plan);

  // Parameters by name.
  std::set<std::string> used;
  for (auto& st : plan.steps)
    for (std::size_t i = 0; i < st.specs.size(); ++i) {
      const ParamSpec& spec = st.specs[i];
      auto it = params.find(spec.name);
      if (it == params.end()) continue;
      Tensor v = it->second;
      if (v.shape() != spec.shape)
        throw Error(util::cat("emu::run_model: parameter '", spec.name, "' is ", sizes_to_string(spec.shape),
                              " but a tensor of ", sizes_to_string(v.shape()), " was given"));
      if (v.dtype() != spec.dtype) {
        if (!is_floating(v.dtype()) || !is_floating(spec.dtype))
          throw Error(util::cat("emu::run_model: parameter '", spec.name, "' is ", dtype_name(spec.dtype),
                                " but a ", dtype_name(v.dtype()), " tensor was given"));
        v = v.to(spec.dtype);
      }
      st.params[i] = v.clone();
      used.insert(spec.name);
    }
  std::vector<std::string> unknown;
  for (const auto& [name, t] : params)
    if (!used.count(name)) unknown.push_back("'" + name + "'");
  if (!unknown.empty())
    throw Error(util::cat("emu::run_model: the model has no parameter named ", util::join(unknown, ", ")));

  // Host memory in place of device memory.
  HostBlock arena(std::max<std::size_t>(lp.arena_bytes, 1));
  std::memset(arena.data(), 0xFF, arena.bytes());
  std::vector<HostBlock> input_mem;
  std::vector<DevicePtr> input_ptrs;
  for (const auto& t : inputs) {
    input_mem.emplace_back(std::max<std::size_t>(t.nbytes(), 1));
    if (t.nbytes()) std::memcpy(input_mem.back().data(), t.raw(), t.nbytes());
    input_ptrs.push_back(input_mem.back().address());
  }
  std::vector<std::vector<DevicePtr>> param_ptrs;
  for (auto& st : plan.steps) {
    std::vector<DevicePtr> p;
    for (auto& t : st.params) p.push_back(reinterpret_cast<std::uintptr_t>(t.raw()));
    param_ptrs.push_back(p);
  }
  lower::pack_launches(lp, graph, lowered, plan, 0, arena.address(), input_ptrs, param_ptrs);

  auto value_bytes = [&](int id) { return plan.values[static_cast<std::size_t>(id)].bytes(); };
  std::size_t k = 0;
  for (const auto& e : lowered.executables) {
    if (e.view) continue;
    const lower::StepLaunches& sl = lp.steps.at(k++);
    std::shared_ptr<const JitModule> mod;
    try {
      mod = HostJit::global().load(e.name, e.source);
    } catch (const Error& err) {
      throw Error(sl.label + " " + err.what());
    }
    LaunchOptions o;
    o.checked = checked;
    o.guarded = true;
    o.label = sl.label;
    {
      const Node& n = graph.node(e.node);
      for (std::size_t i = 0; i < n.inputs.size(); ++i) {
        const int in = n.inputs[i];
        o.buffers.push_back({lower::value_address(plan, in, arena.address(), input_ptrs), value_bytes(in),
                             util::cat("input ", i, " '", graph.node(in).name, "'")});
      }
      o.buffers.push_back({lower::value_address(plan, e.node, arena.address(), input_ptrs),
                           value_bytes(e.node), "output '" + n.name + "'"});
      std::size_t si = 0;
      while (si < plan.steps.size() && plan.steps[si].node != e.node) ++si;
      for (std::size_t i = 0; i < plan.steps.at(si).specs.size(); ++i)
        o.buffers.push_back({param_ptrs[si][i], plan.steps[si].params[i].nbytes(),
                             "parameter '" + plan.steps[si].specs[i].name + "'"});
      if (sl.scratch_bytes)
        o.buffers.push_back({arena.address() + sl.scratch_offset, sl.scratch_bytes, "scratch"});
    }
    if (library_calls && sl.library) {
      for (const auto& L : sl.prologue)
        run_kernel(mod->find(L.entry, sl.label), L.launch.grid, L.launch.block, L.launch.shared_bytes,
                   L.launch.args, o, sl.label);
      const bool fused = run_library_reference(*sl.library, sl.label, fused_steps != nullptr);
      if (library_steps) ++*library_steps;
      if (fused) {
        ++*fused_steps;
        continue;
      }
      for (const auto& L : sl.epilogue)
        run_kernel(mod->find(L.entry, sl.label), L.launch.grid, L.launch.block, L.launch.shared_bytes,
                   L.launch.args, o, sl.label);
      continue;
    }
    for (const auto& L : sl.launches)
      run_kernel(mod->find(L.entry, sl.label), L.launch.grid, L.launch.block, L.launch.shared_bytes,
                 L.launch.args, o, sl.label);
  }

  std::vector<Tensor> results;
  for (int id : plan.outputs) {
    const auto& v = plan.values[static_cast<std::size_t>(id)];
    Tensor t = Tensor::empty(v.dtype, v.shape);
    const auto* src =
        reinterpret_cast<const std::byte*>(lower::value_address(plan, id, arena.address(), input_ptrs));
    if (t.nbytes()) std::memcpy(t.raw(), src, t.nbytes());
    results.push_back(t);
  }
  return results;
}

}  // namespace kg::emu
