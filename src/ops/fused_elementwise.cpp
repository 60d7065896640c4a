// kg.fused_elementwise: the members' per-element forms run in one pass, generated as CUDA C++ for
// the GPU (and the emulator) and chunked on the CPU.
#include "ops/fused_elementwise.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>

#include "kg/error.hpp"
#include "kg/runtime_op.hpp"
#include "ops/divider.hpp"
#include "ops/elementwise_codegen.hpp"
#include "ops/gpu_util.hpp"
#include "ops/op_util.hpp"
#include "util/str.hpp"

namespace kg::ops {
namespace {

constexpr unsigned kThreads = KG_EW_THREADS;
// CPU chunk: every member's values for this many output elements stay in L1/L2 together.
constexpr std::int64_t kChunk = 1024;

// How a group input is read at output index i, and the walk plan (ops/elementwise_codegen).
using Read = EwRead;
using WalkPlan = EwWalkPlan;

// A value of the group in generated code: "v<k>" for member k, "e<j>" for input j.
std::string value_name(int arg) { return arg >= 0 ? util::cat("v", arg) : util::cat("e", -1 - arg); }

WalkPlan plan_walk(const std::vector<std::vector<std::int64_t>>& inputs, const std::vector<std::int64_t>& out,
                   const std::string& label, const std::vector<Read>* reads = nullptr) {
  return plan_ew_walk(inputs, out, label, reads);
}

KgFusedWalk gpu_walk(const WalkPlan& p) { return ew_gpu_walk(p); }

// The generated module's head: the compute type kg_t the members' device functions run in and the
// storage type kg_s of the group's tensors (a 16-bit float is read into float and rounded back).
std::string module_head(DType dtype) { return ew_module_head(dtype); }

// One output's sizes: the node's, or those of a part of the packed value [k, <shape>].
std::vector<std::int64_t> part_sizes(std::vector<std::int64_t> sizes, std::size_t outputs) {
  if (outputs > 1 && !sizes.empty()) sizes.erase(sizes.begin());
  return sizes;
}

// Whether group input j's gradient is a sum over the elements that read it (a scalar or a walked
// input), rather than one value per element.
bool reduced(Read r) { return r != Read::Same; }

// How the kernels lowered for `ctx` read each input and index the value (the forward and the
// backward are written for the same reads).
struct GroupPlan {
  WalkPlan walk;
  bool small = false;  // every index below 2^31: 32-bit index division
};

GroupPlan lowering_plan(const LowerContext& ctx, std::size_t nout, const std::string& label) {
  // One output's shape: the node's, or a part's of the packed value [k, <shape>].
  Shape out_shape = ctx.output_shape;
  if (nout > 1 && out_shape.rank() > 0)
    out_shape = Shape(std::vector<Dim>(ctx.output_shape.begin() + 1, ctx.output_shape.end()));
  const std::vector<std::int64_t> concrete_out = part_sizes(ctx.concrete_output_shape, nout);
  GroupPlan p;
  if (!ctx.concrete_input_shapes.empty())
    p.walk = plan_walk(ctx.concrete_input_shapes, concrete_out, label);
  else  // symbolic shapes only (an op lowered outside a model)
    p.walk.reads = symbolic_ew_reads(ctx.input_shapes, out_shape);
  const std::vector<std::int64_t> out =
      ctx.concrete_output_shape.empty() && out_shape.is_concrete() ? out_shape.sizes() : concrete_out;
  // Unknown sizes: 64-bit.
  p.small = (!out.empty() || out_shape.rank() == 0) && numel_of(out) < (std::int64_t{1} << 31);
  return p;
}

// The backward's scratch: for each reduced input, a slot of one value per element of the group's
// value (its per-element contributions), then the partial sums of the split reductions that sum
// each slot onto its gradient (the largest any of them needs). Offsets in bytes, 256-aligned.
struct BackwardScratch {
  std::vector<std::size_t> slot;  // per input; unused for an input read at the same index
  std::size_t partial = 0, bytes = 0;
};

constexpr std::size_t align256(std::size_t b) { return (b + 255) / 256 * 256; }

class FusedRuntime final : public RuntimeOp {
 public:
  FusedRuntime(std::string entry, std::string label, DType dtype, std::vector<Read> reads, std::size_t outputs)
      : entry_(std::move(entry)),
        label_(std::move(label)),
        dtype_(dtype),
        reads_(std::move(reads)),
        outputs_(outputs) {}

  std::vector<Launch> launches(const LaunchTensors& t) const override {
    Launch l;
    l.entry = entry_;
    l.block = {kThreads, 1, 1};
    const std::int64_t n = t.output.numel() / static_cast<std::int64_t>(outputs_);
    bool walks = false;
    for (const auto& x : t.inputs) l.args.add(x);
    for (std::size_t j = 0; j < outputs_; ++j) l.args.add(ptr(part(t.output, j)));
    l.args.add(n);
    for (Read r : reads_) walks = walks || r == Read::Walk;
    if (walks) {
      std::vector<std::vector<std::int64_t>> shapes;
      for (const auto& x : t.inputs) shapes.push_back(x.shape);
      const KgFusedWalk w = gpu_walk(plan_walk(shapes, part_sizes(t.output.shape, outputs_), label_, &reads_));
      l.args.add(raw_bytes(&w, sizeof w));
      l.grid = grid_1d(tiles_of(n, KG_UNROLL), kThreads);
    } else {
      const auto per_thread = static_cast<std::int64_t>(KG_EW_PACK_BYTES / dtype_size(dtype_)) * KG_UNROLL;
      l.grid = grid_1d(tiles_of(n, per_thread), kThreads);
    }
    return {l};
  }

  std::size_t backward_scratch_bytes(const LaunchTensors& t) const override { return scratch_layout(t).bytes; }

  // (x0.., dy0.., g0.., n[, w]): one incoming gradient per output; a null gradient is one nobody
  // needs. A reduced input's g is its scratch slot, which a reduction (nn.add's, in the backward
  // module as <entry>_backward_sum) then sums onto its gradient.
  std::vector<Launch> backward_launches(const LaunchTensors& t) const override {
    const BackwardScratch s = scratch_layout(t);
    Launch l;
    l.entry = entry_ + "_backward";
    l.block = {kThreads, 1, 1};
    const std::vector<std::int64_t> out = part_sizes(t.grad_output.shape, outputs_);
    const std::int64_t n = numel_of(out);
    for (const auto& x : t.inputs) l.args.add(x);
    for (std::size_t j = 0; j < outputs_; ++j) l.args.add(ptr(part(t.grad_output, j)));
    for (std::size_t j = 0; j < t.inputs.size(); ++j) {
      const DevicePtr g = wanted_grad(t, j);
      l.args.add(ptr(g && reduced(reads_[j]) ? t.scratch + s.slot[j] : g));
    }
    l.args.add(n);
    if (std::find(reads_.begin(), reads_.end(), Read::Walk) != reads_.end()) {
      const KgFusedWalk w = gpu_walk(plan_walk(shapes_of(t), out, label_, &reads_));
      l.args.add(raw_bytes(&w, sizeof w));
    }
    l.grid = grid_1d(tiles_of(n, KG_UNROLL), kThreads);
    std::vector<Launch> all{l};
    for (std::size_t j = 0; j < t.inputs.size(); ++j) {
      if (!wanted_grad(t, j) || !reduced(reads_[j])) continue;
      auto sum = gpu_sum_to_shape(entry_ + "_backward_sum", t.scratch + s.slot[j], wanted_grad(t, j),
                                  t.scratch + s.partial, out, t.inputs[j].shape, "kg.fused_elementwise");
      all.insert(all.end(), sum.begin(), sum.end());
    }
    return all;
  }

 private:
  static DevicePtr wanted_grad(const LaunchTensors& t, std::size_t j) {
    return j < t.grad_inputs.size() ? t.grad_inputs[j].ptr : DevicePtr{0};
  }
  static std::vector<std::vector<std::int64_t>> shapes_of(const LaunchTensors& t) {
    std::vector<std::vector<std::int64_t>> shapes;
    for (const auto& x : t.inputs) shapes.push_back(x.shape);
    return shapes;
  }
  // Sized for every reduced input, wanted or not (while sizing no gradient is known).
  BackwardScratch scratch_layout(const LaunchTensors& t) const {
    BackwardScratch s;
    s.slot.assign(t.inputs.size(), 0);
    const std::vector<std::int64_t> out = part_sizes(t.grad_output.shape, outputs_);
    const auto slot_bytes = align256(static_cast<std::size_t>(numel_of(out)) * dtype_size(dtype_));
    std::size_t partial_bytes = 0;
    for (std::size_t j = 0; j < t.inputs.size() && j < reads_.size(); ++j) {
      if (!reduced(reads_[j])) continue;
      s.slot[j] = s.partial;  // the slots come first; the partial sums follow the last
      s.partial += slot_bytes;
      partial_bytes =
          std::max(partial_bytes, gpu_sum_to_shape_scratch(out, t.inputs[j].shape, dtype_, "kg.fused_elementwise"));
    }
    s.bytes = s.partial == 0 ? 0 : s.partial + align256(partial_bytes);
    return s;
  }

  // The address of output j's part of a packed tensor (0 while sizing).
  DevicePtr part(const DeviceTensor& t, std::size_t j) const {
    if (!t.ptr) return 0;
    const auto n = static_cast<std::uint64_t>(t.numel()) / outputs_;
    return t.ptr + j * n * dtype_size(t.dtype);
  }

  std::string entry_, label_;
  DType dtype_;
  std::vector<Read> reads_;
  std::size_t outputs_;
};

// ---- CPU ----

// The chunk [o0, o0 + len) of input j as a contiguous array: the input itself where it is read at
// the same index, else gathered into `buf`.
template <class T>
const T* chunk_of(const Tensor& x, Read read, const WalkPlan& p, std::size_t j, std::int64_t o0,
                  std::int64_t len, T* buf) {
  const T* data = x.data<T>();
  if (read == Read::Same) return data + o0;
  if (read == Read::Scalar) {
    std::fill(buf, buf + len, data[0]);
    return buf;
  }
  const auto& size = p.size;
  const auto& stride = p.stride[j];
  const std::size_t r = size.size();
  std::int64_t idx[KG_EW_MAX_DIMS] = {};
  std::int64_t off = 0, rest = o0;
  for (std::size_t d = 0; d < r; ++d) {
    idx[d] = rest % size[d];
    rest /= size[d];
    off += idx[d] * stride[d];
  }
  for (std::int64_t k = 0; k < len; ++k) {
    buf[k] = data[off];
    // Odometer step of the output index, innermost dim first.
    for (std::size_t d = 0; d < r; ++d) {
      off += stride[d];
      if (++idx[d] < size[d]) break;
      off -= stride[d] * size[d];
      idx[d] = 0;
    }
  }
  return buf;
}

// Per-thread scratch of at least n values, kept between runs: a warm forward allocates nothing.
template <class T>
T* thread_scratch(std::size_t n) {
  thread_local std::vector<T> s;
  if (s.size() < n) s.resize(n);
  return s.data();
}

}  // namespace

FusedElementwiseOp::FusedElementwiseOp(std::vector<FusedMember> members, int inputs, DType dtype,
                                       LoweringMode mode, std::vector<int> outputs)
    : members_(std::move(members)), inputs_(inputs), outputs_(std::move(outputs)), dtype_(dtype), mode_(mode) {
  if (members_.empty()) throw Error("kg.fused_elementwise: a group needs at least one member");
  const int count = static_cast<int>(members_.size());
  if (outputs_.empty()) outputs_.push_back(count - 1);
  if (outputs_.size() > KG_FUSE_MAX_OUTPUTS)
    throw Error(util::cat("kg.fused_elementwise: a group writes 1 to ", KG_FUSE_MAX_OUTPUTS, " outputs, got ",
                          outputs_.size()));
  std::vector<char> is_output(members_.size(), 0);
  for (std::size_t j = 0; j < outputs_.size(); ++j) {
    const int o = outputs_[j];
    if (o < 0 || o >= count)
      throw Error(util::cat("kg.fused_elementwise: output ", j, " is member ", o, ", but the group has ", count,
                            " members"));
    if (is_output[static_cast<std::size_t>(o)])
      throw Error(util::cat("kg.fused_elementwise: member ", members_[static_cast<std::size_t>(o)].op.name(), " @ ",
                            members_[static_cast<std::size_t>(o)].node, " is listed as an output twice"));
    is_output[static_cast<std::size_t>(o)] = 1;
  }
  if (!is_output.back())
    throw Error(util::cat("kg.fused_elementwise: the root, member ", count - 1, " (", members_.back().op.name(),
                          " @ ", members_.back().node, "), is read by no member and must be an output"));
  if (inputs_ < 1 || inputs_ > KG_FUSE_MAX_INPUTS)
    throw Error(
        util::cat("kg.fused_elementwise: a group reads 1 to ", KG_FUSE_MAX_INPUTS, " inputs, got ", inputs_));
  if (!is_floating(dtype_))
    throw Error(util::cat("kg.fused_elementwise: groups are of f32, f64, f16 or bf16 tensors, not ",
                          dtype_name(dtype_)));
  if (is_half_float(dtype_) && mode_ == LoweringMode::Training)
    throw Error(util::cat("kg.fused_elementwise: a ", dtype_name(dtype_),
                          " group runs in inference only (16-bit training is not supported)"));
  std::vector<char> used(static_cast<std::size_t>(inputs_), 0), read(members_.size(), 0);
  std::string key = util::cat(dtype_name(dtype_), inputs_, mode_ == LoweringMode::Training ? "T" : "I");
  for (std::size_t m = 0; m < members_.size(); ++m) {
    const FusedMember& f = members_[m];
    const std::string who = util::cat("kg.fused_elementwise: member ", f.op.name(), " @ ", f.node);
    if (f.form.function.empty() || !f.form.cpu) throw Error(who + " has no device function or no CPU form");
    if (mode_ == LoweringMode::Training && (f.form.derivative.empty() || !f.form.cpu_derivative))
      throw Error(who + " has no derivative, so it cannot be fused in training");
    for (int a : f.args) {
      if (a >= static_cast<int>(m) || -1 - a >= inputs_)
        throw Error(util::cat(who, " reads value ", a, ", which is not an earlier member or a group input"));
      if (a < 0) used[static_cast<std::size_t>(-1 - a)] = 1;
      if (a >= 0) read[static_cast<std::size_t>(a)] = 1;
    }
    key += util::cat("|", f.op.name(), "(", f.op->attributes(), ")", f.form.function, "/", f.form.derivative,
                     "[");
    for (int a : f.args) key += util::cat(a, ",");
    key += "]" + f.form.device_source;
  }
  for (int j = 0; j < inputs_; ++j)
    if (!used[static_cast<std::size_t>(j)])
      throw Error(util::cat("kg.fused_elementwise: group input ", j, " is read by no member"));
  for (std::size_t m = 0; m < members_.size(); ++m)
    if (!read[m] && !is_output[m])
      throw Error(util::cat("kg.fused_elementwise: member ", members_[m].op.name(), " @ ", members_[m].node,
                            " is read by no member and is no output"));
  if (outputs_.size() > 1) {
    key += "|out";
    for (int o : outputs_) key += util::cat(",", o);
  }
  entry_ = "kg_fused_" + hex_hash(key);
}

std::string FusedElementwiseOp::attributes() const {
  std::string nodes;
  for (const auto& m : members_) nodes += (nodes.empty() ? "" : ",") + m.node;
  if (outputs_.size() == 1) return util::cat("nodes=", nodes, " kernel=", entry_);
  std::string outs;
  for (int o : outputs_) outs += (outs.empty() ? "" : ",") + members_[static_cast<std::size_t>(o)].node;
  return util::cat("nodes=", nodes, " outputs=", outs, " kernel=", entry_);
}

Shape FusedElementwiseOp::infer_output_shape(const std::vector<Shape>& in) const {
  if (static_cast<int>(in.size()) != inputs_)
    throw Error(util::cat("expects ", inputs_, " input(s), got ", in.size()));
  std::vector<Shape> values;
  for (const auto& m : members_) {
    std::vector<Shape> args;
    for (int a : m.args)
      args.push_back(a >= 0 ? values[static_cast<std::size_t>(a)] : in[static_cast<std::size_t>(-1 - a)]);
    try {
      values.push_back(m.op->infer_output_shape(args));
    } catch (const Error& e) {
      throw Error(util::cat("member ", m.op.name(), " @ ", m.node, ": ", e.what()));
    }
  }
  if (outputs_.size() == 1) return values.back();
  // Several outputs: one packed value [k, <shape>].
  const auto first = static_cast<std::size_t>(outputs_[0]);
  for (int o : outputs_)
    if (!(values[static_cast<std::size_t>(o)] == values[first]))
      throw Error(util::cat("the group's outputs share one shape, but ", members_[first].node, " is ",
                            values[first].to_string(), " and ", members_[static_cast<std::size_t>(o)].node, " is ",
                            values[static_cast<std::size_t>(o)].to_string()));
  std::vector<Dim> dims{Dim(static_cast<std::int64_t>(outputs_.size()))};
  dims.insert(dims.end(), values[first].begin(), values[first].end());
  return Shape(std::move(dims));
}

DType FusedElementwiseOp::infer_output_dtype(const std::vector<DType>& in) const {
  for (DType t : in)
    if (t != dtype_)
      throw Error(util::cat("was fused for ", dtype_name(dtype_), " inputs, got ", dtype_name(t)));
  return dtype_;
}

std::optional<Lowered> FusedElementwiseOp::lower(const LowerContext& ctx) const {
  const std::string label = util::cat("[kg.fused_elementwise @ ", ctx.node, "]");
  const std::size_t nout = outputs_.size();
  const GroupPlan gp = lowering_plan(ctx, nout, label);
  const WalkPlan& plan = gp.walk;
  const bool walks = plan.walks();

  std::string src = module_head(dtype_) + ew_member_sources(members_);
  // The group's outputs from its inputs' values e0.. (one expression per member): kg_out, one
  // value per output, and kg_packs, one 16-byte pack per output.
  src += util::cat("\nstruct kg_out {\n  kg_t v[", nout, "];\n};\nstruct kg_packs {\n  KgPack<kg_s> p[", nout,
                   "];\n};\n");
  std::string eval_params, body;
  for (int j = 0; j < inputs_; ++j) eval_params += util::cat(j ? ", " : "", "kg_t e", j);
  body += ew_member_values(members_, "    ");
  body += "    kg_out r;\n";
  for (std::size_t j = 0; j < nout; ++j) body += util::cat("    r.v[", j, "] = v", outputs_[j], ";\n");
  // Each output j from the kg_out `o` to y<j>[at].
  auto store = [&](const char* at) {
    std::string st;
    for (std::size_t j = 0; j < nout; ++j) st += util::cat(" y", j, "[", at, "] = kg_from_compute<kg_s>(o.v[", j, "]);");
    return st;
  };
  std::string params;
  for (int j = 0; j < inputs_; ++j) params += util::cat("const kg_s* __restrict__ x", j, ", ");
  for (std::size_t j = 0; j < nout; ++j) params += util::cat("kg_s* __restrict__ y", j, ", ");
  params += "long long n";
  if (walks) params += ", KgFusedWalk w";
  src += util::cat("\nextern \"C\" __global__ void __launch_bounds__(KG_EW_THREADS)\n", entry_, "(", params,
                   ") {\n  auto eval = [&](", eval_params, ") -> kg_out {\n", body, "    return r;\n  };\n");
  auto read = [&](int j, const char* i) -> std::string {
    switch (plan.reads[static_cast<std::size_t>(j)]) {
      case Read::Same:
        return util::cat("kg_to_compute(x", j, "[", i, "])");
      case Read::Scalar:
        return util::cat("kg_to_compute(x", j, "[0])");
      case Read::Walk:
        return util::cat("kg_to_compute(x", j, "[o", j, "])");
    }
    return {};
  };
  if (!walks) {
    // 16-byte packs where every input read at the same index and every output are aligned. The
    // loads of a thread's packs are apart from the arithmetic (the load step only reads, the store
    // step computes and writes), so that all of them are in flight before the first is used.
    std::string aligned, pack_loads, pack_args, scalars, pack_results, pack_stores;
    for (std::size_t j = 0; j < nout; ++j) {
      aligned += util::cat(j ? " && " : "", "kg_aligned16(y", j, ")");
      pack_results += util::cat("          r.p[", j, "].v[k] = kg_from_compute<kg_s>(o.v[", j, "]);\n");
      pack_stores += util::cat("        reinterpret_cast<KgPack<kg_s>*>(y", j, ")[i] = r.p[", j, "];\n");
    }
    int same = 0;
    for (int j = 0; j < inputs_; ++j) {
      if (plan.reads[static_cast<std::size_t>(j)] == Read::Same) {
        aligned += util::cat(" && kg_aligned16(x", j, ")");
        pack_loads += util::cat("        r.p[", same, "] = reinterpret_cast<const KgPack<kg_s>*>(x", j, ")[i];\n");
        pack_args += util::cat(j ? ", " : "", "kg_to_compute(in.p[", same, "].v[k])");
        ++same;
      } else {
        scalars += util::cat("  const kg_t s", j, " = kg_to_compute(x", j, "[0]);\n");
        pack_args += util::cat(j ? ", " : "", "s", j);
      }
    }
    std::string scalar_args;
    for (int j = 0; j < inputs_; ++j) scalar_args += util::cat(j ? ", " : "", read(j, "i"));
    src += util::cat(
        scalars, "  struct kg_in {\n    KgPack<kg_s> p[", std::max(same, 1), "];\n  };\n",
        "  constexpr int W = KG_EW_PACK_BYTES / sizeof(kg_s);\n  kg_index done = 0;\n  if (", aligned,
        ") {\n    kg_for_each_unrolled<kg_in>(\n      n / W,\n      [&](kg_index i) {\n        kg_in r;\n",
        pack_loads, "        return r;\n      },\n      [&](kg_index i, const kg_in& in) {\n",
        "        kg_packs r;\n#pragma unroll\n        for (int k = 0; k < W; ++k) {\n          const kg_out o = eval(",
        pack_args, ");\n", pack_results, "        }\n", pack_stores, "      });\n",
        "    done = n / W * W;\n  }\n  kg_for_each_unrolled<kg_out>(\n    n - done,\n",
        "    [&](kg_index t) { const kg_index i = done + t; return eval(", scalar_args, "); },\n",
        "    [&](kg_index t, const kg_out& o) {", store("done + t"), " });\n}\n");
  } else {
    std::string args;
    for (int j = 0; j < inputs_; ++j) args += util::cat(j ? ", " : "", read(j, "i"));
    src += util::cat("  kg_for_each_unrolled<kg_out>(\n    n,\n    [&](kg_index i) {\n",
                     ew_walk_offsets(plan.reads, gp.small, "      "), "      return eval(", args, ");\n    },\n",
                     "    [&](kg_index i, const kg_out& o) {", store("i"), " });\n}\n");
  }
  return Lowered{name(), std::move(src), entry_,
                 std::make_shared<FusedRuntime>(entry_, label, dtype_, plan.reads, nout)};
}

// The backward entry recomputes the members at each element i of the value (reading the inputs as
// the forward does) and runs reverse mode over them, writing g<j>[i] for every input: the gradient
// itself for an input read at the same index, else the scratch slot of a reduced input, which
// <entry>_backward_sum (nn.add's reduction) then sums onto the input's gradient.
std::string FusedElementwiseOp::lower_backward_source(const LowerContext& ctx) const {
  if (mode_ != LoweringMode::Training) return {};
  const GroupPlan gp = lowering_plan(ctx, outputs_.size(), util::cat("[kg.fused_elementwise @ ", ctx.node, "]"));
  const std::vector<Read>& reads = gp.walk.reads;
  std::string src = module_head(dtype_) + ew_member_sources(members_);
  std::string params;
  for (int j = 0; j < inputs_; ++j) params += util::cat("const kg_t* __restrict__ x", j, ", ");
  for (std::size_t j = 0; j < outputs_.size(); ++j) params += util::cat(j ? ", " : "", "const kg_t* __restrict__ dy", j);
  for (int j = 0; j < inputs_; ++j) params += util::cat(", kg_t* __restrict__ g", j);
  params += ", long long n";
  if (gp.walk.walks()) params += ", KgFusedWalk w";
  std::string body = ew_walk_offsets(reads, gp.small, "    ");
  for (int j = 0; j < inputs_; ++j) {
    const Read r = reads[static_cast<std::size_t>(j)];
    body += util::cat("    const kg_t e", j, " = x", j, "[",
                      r == Read::Same ? "i" : r == Read::Scalar ? "0" : util::cat("o", j), "];\n");
  }
  body += ew_member_values(members_, "    ");
  // Reverse mode over the members: the gradient of each value, from its consumers' derivatives
  // and, for an output, its incoming gradient.
  const std::size_t last = members_.size() - 1;
  for (int j = 0; j < inputs_; ++j) body += util::cat("    kg_t de", j, " = 0;\n");
  for (std::size_t m = 0; m <= last; ++m) {
    const auto o = std::find(outputs_.begin(), outputs_.end(), static_cast<int>(m));
    body += o == outputs_.end() ? util::cat("    kg_t dv", m, " = 0;\n")
                                : util::cat("    kg_t dv", m, " = dy", o - outputs_.begin(), "[i];\n");
  }
  for (std::size_t m = last + 1; m-- > 0;) {
    const FusedMember& f = members_[m];
    std::string args;
    for (int a : f.args) args += value_name(a) + ", ";
    for (std::size_t k = 0; k < f.args.size(); ++k)
      body += util::cat("    d", value_name(f.args[k]), " += dv", m, " * (kg_t)kg_m", m,
                        "::", f.form.derivative, "(", k, ", ", args, "v", m, ");\n");
  }
  for (int j = 0; j < inputs_; ++j) body += util::cat("    if (g", j, ") g", j, "[i] = de", j, ";\n");
  src += util::cat("\nextern \"C\" __global__ void __launch_bounds__(KG_EW_THREADS)\n", entry_, "_backward(",
                   params, ") {\n  for (kg_index i = kg_thread_index(); i < n; i += kg_grid_stride()) {\n",
                   body, "  }\n}\n");
  if (std::any_of(reads.begin(), reads.end(), reduced))
    src += util::cat("\n// A reduced input's contributions summed onto its gradient (gpu_sum_to_shape).\n",
                     "extern \"C\" __global__ void __launch_bounds__(KG_EW_THREADS)\n", entry_,
                     "_backward_sum(const kg_t* __restrict__ dy, const kg_t* __restrict__ a, const kg_t* __restrict__ b,",
                     " kg_t* __restrict__ g, kg_t* __restrict__ partial, KgReduce p, int which, int phase) {\n",
                     "  kg_binary_backward_entry<KG_ADD>(dy, a, b, g, partial, p, which, phase);\n}\n");
  return src;
}

void FusedElementwiseOp::cpu_forward(CpuContext& ctx) const {
  // 16-bit groups: the members run in float on widened copies, the result is rounded once.
  if (is_half_float(dtype_)) return cpu_forward_in_f32(ctx, [&](CpuContext& c) { forward(c, DType::F32); });
  forward(ctx, dtype_);
}

void FusedElementwiseOp::forward(CpuContext& ctx, DType dtype) const {
  const std::size_t nout = outputs_.size();
  const std::int64_t n = ctx.output.numel() / static_cast<std::int64_t>(nout);
  if (n == 0) return;
  std::vector<std::vector<std::int64_t>> shapes;
  for (const auto& x : ctx.inputs) shapes.push_back(x.shape());
  const WalkPlan plan = plan_walk(shapes, part_sizes(ctx.output.shape(), nout), "[kg.fused_elementwise]");
  const std::size_t mcount = members_.size();
  // Where each member's values go: its part of the output (an output), or the scratch.
  std::vector<int> part(mcount, -1);
  for (std::size_t j = 0; j < nout; ++j) part[static_cast<std::size_t>(outputs_[j])] = static_cast<int>(j);
  dispatch_float(dtype, [&](auto zero) {
    using T = decltype(zero);
    T* y = ctx.output.data<T>();
    ctx.parallel_for(tiles_of(n, kChunk), 16, [&](std::int64_t c0, std::int64_t c1) {
      // A gather buffer per input, a value buffer per member.
      T* buf = thread_scratch<T>((static_cast<std::size_t>(inputs_) + mcount) * kChunk);
      const T* in[KG_FUSE_MAX_INPUTS] = {};
      thread_local std::vector<const void*> args;
      for (std::int64_t c = c0; c < c1; ++c) {
        const std::int64_t o0 = c * kChunk, len = std::min(kChunk, n - o0);
        for (int j = 0; j < inputs_; ++j) {
          const auto uj = static_cast<std::size_t>(j);
          in[uj] = chunk_of<T>(ctx.inputs[uj], plan.reads[uj], plan, uj, o0, len, buf + uj * kChunk);
        }
        auto values = [&](std::size_t m) -> T* {
          return part[m] >= 0 ? y + part[m] * n + o0 : buf + (static_cast<std::size_t>(inputs_) + m) * kChunk;
        };
        for (std::size_t m = 0; m < mcount; ++m) {
          args.clear();
          for (int a : members_[m].args)
            args.push_back(a >= 0 ? static_cast<const void*>(values(static_cast<std::size_t>(a)))
                                  : in[static_cast<std::size_t>(-1 - a)]);
          members_[m].form.cpu(ElementwiseSpan{dtype, args, nullptr, values(m), len, 0});
        }
      }
    });
  });
}

namespace {

// The group's backward on the CPU, chunk by chunk: every member's value recomputed from the
// inputs (read as `plan` says), reverse mode over the members, and input j's contribution at each
// element i of the value written to contributions[j][i] (where not null).
template <class T>
void backward_contributions(const FusedElementwiseOp& op, CpuBackwardContext& ctx, const WalkPlan& plan,
                            const std::vector<T*>& contributions) {
  const std::vector<FusedMember>& members = op.members();
  const std::vector<int>& outputs = op.outputs();
  const DType dtype = op.dtype();
  const std::size_t nout = outputs.size();
  const std::int64_t n = ctx.grad_output.numel() / static_cast<std::int64_t>(nout);
  if (n == 0) return;
  const std::size_t mcount = members.size(), nin = static_cast<std::size_t>(op.inputs());
  const T* dy = ctx.grad_output.data<T>();
  ctx.parallel_for(tiles_of(n, kChunk), 16, [&](std::int64_t c0, std::int64_t c1) {
    // Values v (members), their gradients dv, the inputs' gradients de, one derivative, the
    // inputs' gathered chunks.
    T* v = thread_scratch<T>((2 * mcount + 2 * nin + 1) * kChunk);
    T* dv = v + mcount * kChunk;
    T* de = dv + mcount * kChunk;
    T* d = de + nin * kChunk;
    T* gather = d + kChunk;
    const T* in[KG_FUSE_MAX_INPUTS] = {};
    thread_local std::vector<const void*> args;
    auto value = [&](int a) -> const void* {
      return a >= 0 ? static_cast<const void*>(v + static_cast<std::size_t>(a) * kChunk)
                    : static_cast<const void*>(in[static_cast<std::size_t>(-1 - a)]);
    };
    for (std::int64_t c = c0; c < c1; ++c) {
      const std::int64_t o0 = c * kChunk, len = std::min(kChunk, n - o0);
      const auto ulen = static_cast<std::size_t>(len);
      for (std::size_t j = 0; j < nin; ++j)
        in[j] = chunk_of<T>(ctx.inputs[j], plan.reads[j], plan, j, o0, len, gather + j * kChunk);
      for (std::size_t m = 0; m < mcount; ++m) {
        args.clear();
        for (int a : members[m].args) args.push_back(value(a));
        members[m].form.cpu(ElementwiseSpan{dtype, args, nullptr, v + m * kChunk, len, 0});
      }
      std::fill(dv, dv + mcount * kChunk, T(0));
      std::fill(de, de + nin * kChunk, T(0));
      for (std::size_t j = 0; j < nout; ++j) {  // an output's incoming gradient (packed like the outputs)
        const T* dyj = dy + static_cast<std::int64_t>(j) * n + o0;
        std::copy(dyj, dyj + len, dv + static_cast<std::size_t>(outputs[j]) * kChunk);
      }
      for (std::size_t m = mcount; m-- > 0;) {
        const FusedMember& f = members[m];
        args.clear();
        for (int a : f.args) args.push_back(value(a));
        const T* g = dv + m * kChunk;
        for (std::size_t k = 0; k < f.args.size(); ++k) {
          f.form.cpu_derivative(ElementwiseSpan{dtype, args, v + m * kChunk, d, len, static_cast<int>(k)});
          const int a = f.args[k];
          T* target = a >= 0 ? dv + static_cast<std::size_t>(a) * kChunk
                             : de + static_cast<std::size_t>(-1 - a) * kChunk;
          for (std::size_t i = 0; i < ulen; ++i) target[i] += g[i] * d[i];
        }
      }
      for (std::size_t j = 0; j < nin; ++j)
        if (contributions[j]) std::copy(de + j * kChunk, de + j * kChunk + len, contributions[j] + o0);
    }
  });
}

}  // namespace

// Each wanted input gradient gets one contribution per element of the value: written straight
// into the gradient for an input read at the same index, else into a buffer shaped like the value
// that is then summed onto the input's shape (sum_to_shape, as nn.add's backward does).
void FusedElementwiseOp::cpu_backward(CpuBackwardContext& ctx) const {
  if (mode_ != LoweringMode::Training) throw Error("was fused for inference and has no backward");
  const std::size_t nout = outputs_.size(), nin = static_cast<std::size_t>(inputs_);
  const std::vector<std::int64_t> out = part_sizes(ctx.grad_output.shape(), nout);
  std::vector<std::vector<std::int64_t>> shapes;
  for (const auto& x : ctx.inputs) shapes.push_back(x.shape());
  const WalkPlan plan = plan_walk(shapes, out, "[kg.fused_elementwise]");
  dispatch_float(dtype_, [&](auto zero) {
    using T = decltype(zero);
    std::vector<std::vector<T>> buffers(nin);
    std::vector<T*> contributions(nin, nullptr);
    for (std::size_t j = 0; j < nin; ++j) {
      if (!ctx.wants_input_grad(j)) continue;
      if (!reduced(plan.reads[j])) {
        contributions[j] = ctx.grad_inputs[j].data<T>();
        continue;
      }
      buffers[j].resize(static_cast<std::size_t>(numel_of(out)));
      contributions[j] = buffers[j].data();
    }
    backward_contributions<T>(*this, ctx, plan, contributions);
    for (std::size_t j = 0; j < nin; ++j)
      if (ctx.wants_input_grad(j) && reduced(plan.reads[j]))
        sum_to_shape<T>(ctx, buffers[j].data(), out, shapes[j], ctx.grad_inputs[j].data<T>());
  });
}

// ---- kg.group_output ----

GroupOutputOp::GroupOutputOp(int index, int count) : index_(index), count_(count) {
  if (count_ < 2 || count_ > KG_FUSE_MAX_OUTPUTS || index_ < 0 || index_ >= count_)
    throw Error(util::cat("kg.group_output: output ", index_, " of ", count_, "; a fused group with several outputs has 2 to ",
                          KG_FUSE_MAX_OUTPUTS, ", numbered from 0"));
}

std::string GroupOutputOp::attributes() const { return util::cat("output=", index_, "/", count_); }

Shape GroupOutputOp::infer_output_shape(const std::vector<Shape>& in) const {
  if (in.size() != 1) throw Error(util::cat("expects 1 input (a fused group's packed outputs), got ", in.size()));
  const Shape& packed = in[0];
  if (packed.rank() == 0 || !packed[0].is_static() || packed[0].size() != count_)
    throw Error(util::cat("expects a fused group's ", count_, " outputs packed as [", count_, ", ...], got ",
                          packed.to_string()));
  return Shape(std::vector<Dim>(packed.begin() + 1, packed.end()));
}

std::optional<std::int64_t> GroupOutputOp::view_offset(const std::vector<std::int64_t>& sizes) const {
  if (sizes.empty() || sizes[0] != count_)
    throw Error(util::cat("kg.group_output: expects ", count_, " outputs packed as [", count_, ", ...], got ",
                          sizes_to_string(sizes)));
  return index_ * (numel_of(sizes) / count_);
}

}  // namespace kg::ops
