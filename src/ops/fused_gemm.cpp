// kg.fused_gemm: a GEMM storing its output through a folded elementwise epilogue.
#include "ops/fused_gemm.hpp"

#include <algorithm>

#include "kg/error.hpp"
#include "kg/runtime_op.hpp"
#include "ops/elementwise_codegen.hpp"
#include "ops/epilogue.hpp"
#include "ops/gpu_util.hpp"
#include "ops/op_util.hpp"
#include "util/str.hpp"

namespace kg::ops {
namespace {

constexpr unsigned kApplyThreads = 256;

// The GEMM's launches with the epilogue's arguments after their own: a pointer per group input
// other than the GEMM's output and, when one is walked, the walk. The vendor-library tactic is the
// GEMM's call, then the module's apply entry over its output (or, for an epilogue that is one
// ReLU, cuBLASLt's own ReLU).
class EpilogueRuntime final : public RuntimeOp {
 public:
  EpilogueRuntime(std::shared_ptr<RuntimeOp> inner, int gemm_inputs, int given, std::vector<EwRead> reads,
                  std::string apply_entry, bool relu_only, std::string label)
      : inner_(std::move(inner)),
        gemm_inputs_(gemm_inputs),
        given_(given),
        reads_(std::move(reads)),
        apply_entry_(std::move(apply_entry)),
        relu_only_(relu_only),
        label_(std::move(label)) {}

  std::vector<Launch> launches(const LaunchTensors& t) const override {
    std::vector<Launch> ls = inner_->launches(inner_tensors(t));
    const KernelArgs extra = epilogue_args(t);
    for (auto& l : ls)
      for (const auto& a : extra.args()) l.args.add(a);
    return ls;
  }
  std::optional<LibraryCall> library_call(const LaunchTensors& t) const override {
    std::optional<LibraryCall> call = inner_->library_call(inner_tensors(t));
    if (!call) return std::nullopt;
    if (auto* g = std::get_if<GemmCall>(&call->call); g && relu_only_ && call->epilogue.empty() && !g->relu) {
      g->relu = true;
      return call;
    }
    Launch L;
    L.entry = apply_entry_;
    L.block = {kApplyThreads, 1, 1};
    const std::int64_t n = t.output.numel();
    L.grid = grid_1d(n, kApplyThreads);
    L.args.add(t.output);
    L.args.add(n);
    const KernelArgs extra = epilogue_args(t);
    for (const auto& a : extra.args()) L.args.add(a);
    call->epilogue.push_back(std::move(L));
    return call;
  }
  bool depends_on_run() const override { return inner_->depends_on_run(); }
  std::size_t scratch_bytes(const LaunchTensors& t) const override { return inner_->scratch_bytes(inner_tensors(t)); }
  bool supports_train_mode() const override { return false; }

 private:
  // What the GEMM's own runtime sees: its own inputs.
  LaunchTensors inner_tensors(const LaunchTensors& t) const {
    LaunchTensors r = t;
    r.inputs.assign(t.inputs.begin(), t.inputs.begin() + gemm_inputs_);
    return r;
  }
  KernelArgs epilogue_args(const LaunchTensors& t) const {
    KernelArgs a;
    std::vector<std::vector<std::int64_t>> shapes;
    std::size_t next = static_cast<std::size_t>(gemm_inputs_);
    for (int j = 0; j < static_cast<int>(reads_.size()); ++j) {
      if (j == given_) {
        shapes.push_back(t.output.shape);
        continue;
      }
      const DeviceTensor& x = t.inputs.at(next++);
      shapes.push_back(x.shape);
      a.add(x);
    }
    bool walks = false;
    for (int j = 0; j < static_cast<int>(reads_.size()); ++j)
      walks = walks || (j != given_ && reads_[static_cast<std::size_t>(j)] == EwRead::Walk);
    if (walks) {
      const KgFusedWalk w = ew_gpu_walk(plan_ew_walk(shapes, t.output.shape, label_, &reads_));
      a.add(raw_bytes(&w, sizeof w));
    }
    return a;
  }

  std::shared_ptr<RuntimeOp> inner_;
  int gemm_inputs_, given_;
  std::vector<EwRead> reads_;
  std::string apply_entry_;
  bool relu_only_;
  std::string label_;
};

}  // namespace

FusedGemmOp::FusedGemmOp(CustomData gemm, int gemm_inputs, std::vector<FusedMember> members, int inputs, int given,
                         DType dtype)
    : gemm_(std::move(gemm)), epilogue_gemm_(nullptr), gemm_inputs_(gemm_inputs), given_(given), dtype_(dtype) {
  const std::string who = util::cat("kg.fused_gemm (", gemm_.name(), ")");
  epilogue_gemm_ = dynamic_cast<const EpilogueGemm*>(&gemm_.op());
  if (!epilogue_gemm_) throw Error(util::cat(who, ": op ", gemm_.name(), " is not a GEMM that takes an epilogue"));
  if (!epilogue_gemm_->takes_epilogue(dtype_))
    throw Error(util::cat(who, ": op ", gemm_.name(), " takes no epilogue for ", dtype_name(dtype_), " outputs"));
  if (gemm_inputs_ < 1) throw Error(util::cat(who, ": the GEMM needs at least one input, got ", gemm_inputs_));
  if (given_ < 0 || given_ >= inputs)
    throw Error(util::cat(who, ": the GEMM's output is group input ", given_, ", but the group has ", inputs));
  std::vector<DType> dtypes{dtype_};
  if (dtype_ == DType::F32)
    for (DType half : {DType::F16, DType::BF16})
      if (gemm_->computes_in(half)) dtypes.push_back(half);
  for (DType t : dtypes) {
    try {
      groups_.emplace_back(t, std::make_shared<const FusedElementwiseOp>(members, inputs, t, LoweringMode::Inference));
    } catch (const Error& e) {
      throw Error(util::cat(who, ": epilogue: ", e.what()));
    }
  }
  const std::string key = util::cat(groups_[0].second->entry(), "|", gemm_.name(), "(", gemm_->attributes(), ")",
                                    gemm_inputs_, "/", given_);
  entry_ = "kg_epilogue_" + hex_hash(key);
}

const FusedElementwiseOp& FusedGemmOp::group(DType dtype) const {
  for (const auto& [t, g] : groups_)
    if (t == dtype) return *g;
  throw Error(util::cat("kg.fused_gemm (", gemm_.name(), "): no epilogue in ", dtype_name(dtype), " (declared ",
                        dtype_name(dtype_), ")"));
}

template <class T>
std::vector<T> FusedGemmOp::group_list(const std::vector<T>& node, T gemm_out) const {
  const int n = group_inputs();
  if (static_cast<int>(node.size()) != gemm_inputs_ + n - 1)
    throw Error(util::cat("expects ", gemm_inputs_ + n - 1, " inputs (", gemm_inputs_, " of ", gemm_.name(),
                          ", then ", n - 1, " of the epilogue), got ", node.size()));
  std::vector<T> r;
  std::size_t next = static_cast<std::size_t>(gemm_inputs_);
  for (int j = 0; j < n; ++j) r.push_back(j == given_ ? gemm_out : node[next++]);
  return r;
}

std::string FusedGemmOp::attributes() const {
  std::string nodes;
  for (const auto& m : members()) nodes += (nodes.empty() ? "" : ",") + m.node;
  const std::string attrs = gemm_->attributes();
  return util::cat(gemm_.name(), attrs.empty() ? "" : " ", attrs, " epilogue=", nodes, " kernel=", entry_);
}

Shape FusedGemmOp::infer_output_shape(const std::vector<Shape>& in) const {
  if (static_cast<int>(in.size()) < gemm_inputs_)
    throw Error(util::cat("expects at least the ", gemm_inputs_, " input(s) of ", gemm_.name(), ", got ", in.size()));
  Shape out;
  try {
    out = gemm_->infer_output_shape(std::vector<Shape>(in.begin(), in.begin() + gemm_inputs_));
  } catch (const Error& e) {
    throw Error(util::cat("GEMM ", gemm_.name(), ": ", e.what()));
  }
  const Shape value = group(dtype_).infer_output_shape(group_list(in, out));
  if (value != out)
    throw Error(util::cat("the epilogue's value is ", value.to_string(), " but the GEMM's output is ", out.to_string(),
                          "; an epilogue keeps the GEMM's shape"));
  return out;
}

DType FusedGemmOp::infer_output_dtype(const std::vector<DType>& in) const {
  if (static_cast<int>(in.size()) < gemm_inputs_)
    throw Error(util::cat("expects at least the ", gemm_inputs_, " input(s) of ", gemm_.name(), ", got ", in.size()));
  const DType out = gemm_->infer_output_dtype(std::vector<DType>(in.begin(), in.begin() + gemm_inputs_));
  return group(out).infer_output_dtype(group_list(in, out));
}

std::vector<ParamSpec> FusedGemmOp::parameters(const std::vector<Shape>& in) const {
  return gemm_->parameters(std::vector<Shape>(in.begin(), in.begin() + std::min<std::size_t>(in.size(), gemm_inputs_)));
}

bool FusedGemmOp::computes_in(DType dtype) const {
  return std::any_of(groups_.begin() + 1, groups_.end(), [&](const auto& g) { return g.first == dtype; });
}

std::optional<Lowered> FusedGemmOp::lower(const LowerContext& ctx) const {
  const std::string label = util::cat("[kg.fused_gemm @ ", ctx.node, "]");
  const DType dtype = ctx.output_dtype;
  const FusedElementwiseOp& g = group(dtype);
  const int n_in = g.inputs();
  if (static_cast<int>(ctx.input_shapes.size()) != gemm_inputs_ + n_in - 1)
    throw Error(util::cat(label, " expects ", gemm_inputs_ + n_in - 1, " input(s), got ", ctx.input_shapes.size()));
  // The GEMM's own context: its inputs, the node's output.
  LowerContext gc = ctx;
  gc.input_dtypes.resize(static_cast<std::size_t>(gemm_inputs_));
  gc.input_shapes.resize(static_cast<std::size_t>(gemm_inputs_));
  if (!gc.concrete_input_shapes.empty()) gc.concrete_input_shapes.resize(static_cast<std::size_t>(gemm_inputs_));
  std::vector<EwRead> reads;
  std::vector<std::int64_t> value;
  if (!ctx.concrete_input_shapes.empty()) {
    value = ctx.concrete_output_shape;
    reads = plan_ew_walk(group_list(ctx.concrete_input_shapes, value), value, label).reads;
  } else {
    reads = symbolic_ew_reads(group_list(ctx.input_shapes, ctx.output_shape), ctx.output_shape);
    if (ctx.output_shape.is_concrete()) value = ctx.output_shape.sizes();
  }
  if (reads[static_cast<std::size_t>(given_)] != EwRead::Same)
    throw Error(util::cat(label, " the GEMM's output must be read at the epilogue's own index"));
  const bool small = (!value.empty() || ctx.output_shape.rank() == 0) && numel_of(value) < (std::int64_t{1} << 31);
  EpilogueCode code;
  code.head = ew_module_head(dtype) + "#define KG_FUSED_MODULE\n";
  code.source = util::cat("\n// The epilogue: the value stored at output index i.\n", ew_member_sources(g.members()),
                          ew_epilogue_struct("KgEpilogue", g.members(), n_in, reads, small, given_));
  std::string epi = "KgEpilogue{";
  bool walks = false;
  for (int j = 0, k = 0; j < n_in; ++j) {
    if (j == given_) continue;
    code.params += util::cat(", const kg_s* __restrict__ p", j);
    epi += util::cat(k++ ? ", " : "", "p", j);
    walks = walks || reads[static_cast<std::size_t>(j)] == EwRead::Walk;
  }
  if (walks) {
    code.params += ", KgFusedWalk pw";
    epi += ", pw";  // after at least one pointer: a walked input has one
  }
  code.epilogue = epi + "}";
  code.entry = entry_;
  std::optional<Lowered> low;
  try {
    low = epilogue_gemm_->lower_with_epilogue(gc, code);
  } catch (const Error& e) {
    throw Error(util::cat(label, " GEMM ", gemm_.name(), ": ", e.what()));
  }
  if (!low) return std::nullopt;
  // The epilogue alone, in place over the output, for the vendor-library tactic.
  const std::string apply = entry_ + "_apply";
  low->source += util::cat("\nextern \"C\" __global__ void __launch_bounds__(", kApplyThreads, ")\n    ", apply,
                           "(kg_s* y, long long n", code.params, ") {\n  const KgEpilogue epi = ", code.epilogue,
                           ";\n  for (kg_index i = kg_thread_index(); i < n; i += kg_grid_stride())\n",
                           "    y[i] = kg_from_compute<kg_s>(epi(kg_to_compute(y[i]), i));\n}\n");
  const auto& m = g.members();
  const bool relu_only = m.size() == 1 && m[0].op.name() == "nn.relu" && m[0].args == std::vector<int>{-1 - given_};
  low->name = name();
  low->entry_point = entry_;
  low->runtime_op =
      std::make_shared<EpilogueRuntime>(std::move(low->runtime_op), gemm_inputs_, given_, std::move(reads), apply,
                                        relu_only, label);
  return low;
}

void FusedGemmOp::cpu_forward(CpuContext& ctx) const {
  const DType dtype = ctx.output.dtype();
  // The GEMM's output in scratch kept by the calling thread between runs.
  const Tensor mid = thread_scratch_tensor(dtype, ctx.output.shape());
  {
    SubContext gc(ctx, ctx.inputs.subspan(0, static_cast<std::size_t>(gemm_inputs_)), ctx.params, mid);
    gemm_->cpu_forward(gc);
  }
  std::vector<Tensor> node(ctx.inputs.begin(), ctx.inputs.end());
  const std::vector<Tensor> ins = group_list(node, mid);
  SubContext ec(ctx, ins, {}, ctx.output);
  group(dtype).cpu_forward(ec);
}

}  // namespace kg::ops
