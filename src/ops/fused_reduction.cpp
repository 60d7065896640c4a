// kg.fused_reduction: a reduction reading its data input through a folded elementwise prologue.
#include "ops/fused_reduction.hpp"

#include <cstdio>
#include <cstring>

#include "kg/error.hpp"
#include "kg/runtime_op.hpp"
#include "ops/elementwise_codegen.hpp"
#include "ops/op_util.hpp"
#include "ops/prologue.hpp"
#include "util/str.hpp"

namespace kg::ops {
namespace {

// numpy broadcasting of concrete sizes (the prologue's inputs to its value).
std::vector<std::int64_t> broadcast_sizes(const std::vector<std::vector<std::int64_t>>& in, const std::string& label) {
  std::size_t r = 0;
  for (const auto& s : in) r = std::max(r, s.size());
  std::vector<std::int64_t> out(r, 1);
  for (const auto& s : in)
    for (std::size_t k = 0; k < s.size(); ++k) {
      std::int64_t& o = out[r - s.size() + k];
      const std::int64_t v = s[k];
      if (v == o || v == 1) continue;
      if (o != 1)
        throw Error(util::cat(label, " prologue inputs of sizes ", sizes_to_string(s), " and ", sizes_to_string(out),
                              " do not broadcast"));
      o = v;
    }
  return out;
}

// The reduction's launches with their data pointer (argument 0 of each) replaced by the prologue's
// arguments: a pointer per prologue input and, when an input is walked, the walk.
class PrologueRuntime final : public RuntimeOp {
 public:
  PrologueRuntime(std::shared_ptr<RuntimeOp> inner, std::vector<EwRead> reads, std::string label, DType dtype)
      : inner_(std::move(inner)), reads_(std::move(reads)), label_(std::move(label)), dtype_(dtype) {}

  std::vector<Launch> launches(const LaunchTensors& t) const override {
    std::vector<std::vector<std::int64_t>> shapes;
    for (const auto& x : t.inputs) shapes.push_back(x.shape);
    const std::vector<std::int64_t> value = broadcast_sizes(shapes, label_);
    std::vector<Launch> ls = inner_->launches(inner_tensors(t, value));
    KernelArgs pro;
    for (const auto& x : t.inputs) pro.add(x);
    bool walks = false;
    for (EwRead r : reads_) walks = walks || r == EwRead::Walk;
    if (walks) {
      const KgFusedWalk w = ew_gpu_walk(plan_ew_walk(shapes, value, label_, &reads_));
      pro.add(raw_bytes(&w, sizeof w));
    }
    for (std::size_t k = 0; k < ls.size(); ++k) {
      const auto& old = ls[k].args.args();
      if (old.empty() || old[0].kind() != KernelArg::Kind::Pointer)
        throw Error(util::cat(label_, " launch ", k, " of the reduction does not take its input as argument 0 (",
                              old.empty() ? "no arguments" : KernelArg::kind_name(old[0].kind()),
                              "); a prologue cannot be folded into it"));
      KernelArgs args = pro;
      for (std::size_t a = 1; a < old.size(); ++a) args.add(old[a]);
      ls[k].args = std::move(args);
    }
    return ls;
  }
  bool depends_on_run() const override { return inner_->depends_on_run(); }
  std::size_t scratch_bytes(const LaunchTensors& t) const override {
    std::vector<std::vector<std::int64_t>> shapes;
    for (const auto& x : t.inputs) shapes.push_back(x.shape);
    return inner_->scratch_bytes(inner_tensors(t, broadcast_sizes(shapes, label_)));
  }
  bool supports_train_mode() const override { return false; }

 private:
  // What the reduction's own runtime sees: one input, the prologue's value, with no address.
  LaunchTensors inner_tensors(const LaunchTensors& t, const std::vector<std::int64_t>& value) const {
    LaunchTensors r = t;
    r.inputs = {DeviceTensor{0, value, dtype_}};
    return r;
  }

  std::shared_ptr<RuntimeOp> inner_;
  std::vector<EwRead> reads_;
  std::string label_;
  DType dtype_;
};

}  // namespace

FusedReductionOp::FusedReductionOp(std::vector<FusedMember> members, int inputs, CustomData reduction, DType dtype)
    : reduction_(std::move(reduction)), reducer_(nullptr), dtype_(dtype) {
  const std::string who = util::cat("kg.fused_reduction (", reduction_.name(), ")");
  if (dtype_ != DType::F32 && dtype_ != DType::F64)
    throw Error(util::cat(who, ": a prologue computes in f32 or f64, not ", dtype_name(dtype_)));
  reducer_ = dynamic_cast<const PrologueReduction*>(&reduction_.op());
  if (!reducer_) throw Error(util::cat(who, ": op ", reduction_.name(), " is not a reduction that takes a prologue"));
  if (!reducer_->takes_prologue(dtype_))
    throw Error(util::cat(who, ": op ", reduction_.name(), " takes no prologue for ", dtype_name(dtype_), " inputs"));
  try {
    prologue_ = std::make_shared<const FusedElementwiseOp>(std::move(members), inputs, dtype_, LoweringMode::Inference);
  } catch (const Error& e) {
    throw Error(util::cat(who, ": prologue: ", e.what()));
  }
  const std::string key =
      util::cat(prologue_->entry(), "|", reduction_.name(), "(", reduction_->attributes(), ")", dtype_name(dtype_));
  entry_ = "kg_prologue_" + hex_hash(key);
}

std::string FusedReductionOp::attributes() const {
  std::string nodes;
  for (const auto& m : prologue_->members()) nodes += (nodes.empty() ? "" : ",") + m.node;
  const std::string attrs = reduction_->attributes();
  return util::cat(reduction_.name(), attrs.empty() ? "" : " ", attrs, " prologue=", nodes, " kernel=", entry_);
}

Shape FusedReductionOp::infer_output_shape(const std::vector<Shape>& in) const {
  const Shape value = prologue_->infer_output_shape(in);
  try {
    return reduction_->infer_output_shape({value});
  } catch (const Error& e) {
    throw Error(util::cat("reduction ", reduction_.name(), ": ", e.what()));
  }
}

DType FusedReductionOp::infer_output_dtype(const std::vector<DType>& in) const {
  return reduction_->infer_output_dtype({prologue_->infer_output_dtype(in)});
}

std::vector<ParamSpec> FusedReductionOp::parameters(const std::vector<Shape>& in) const {
  return reduction_->parameters({prologue_->infer_output_shape(in)});
}

std::optional<Lowered> FusedReductionOp::lower(const LowerContext& ctx) const {
  const std::string label = util::cat("[kg.fused_reduction @ ", ctx.node, "]");
  const int n_in = prologue_->inputs();
  if (static_cast<int>(ctx.input_shapes.size()) != n_in)
    throw Error(util::cat(label, " expects ", n_in, " input(s), got ", ctx.input_shapes.size()));
  // The prologue's value, symbolic and (at load) concrete.
  LowerContext rc = ctx;
  rc.input_dtypes = {dtype_};
  rc.input_shapes = {prologue_->infer_output_shape(ctx.input_shapes)};
  std::vector<EwRead> reads;
  std::vector<std::int64_t> value;
  if (!ctx.concrete_input_shapes.empty()) {
    value = broadcast_sizes(ctx.concrete_input_shapes, label);
    rc.concrete_input_shapes = {value};
    reads = plan_ew_walk(ctx.concrete_input_shapes, value, label).reads;
  } else {
    reads = symbolic_ew_reads(ctx.input_shapes, rc.input_shapes[0]);
    if (rc.input_shapes[0].is_concrete()) value = rc.input_shapes[0].sizes();
  }
  // 32-bit index division where every index fits (unknown sizes: 64-bit).
  const bool small = (!value.empty() || rc.input_shapes[0].rank() == 0) && numel_of(value) < (std::int64_t{1} << 31);
  PrologueCode code;
  code.head = ew_module_head(dtype_) + "#define KG_FUSED_MODULE\n";
  code.source = util::cat("\n// The prologue: element i of the reduction's input.\n", ew_member_sources(members()),
                          ew_loader_struct("KgPrologue", members(), n_in, reads, small));
  std::string loader = "KgPrologue{";
  for (int j = 0; j < n_in; ++j) {
    code.params += util::cat(j ? ", " : "", "const kg_s* __restrict__ p", j);
    loader += util::cat(j ? ", " : "", "p", j);
  }
  if (std::find(reads.begin(), reads.end(), EwRead::Walk) != reads.end()) {
    code.params += ", KgFusedWalk pw";
    loader += ", pw";
  }
  code.loader = loader + "}";
  code.entry = entry_;
  std::optional<Lowered> low;
  try {
    low = reducer_->lower_with_prologue(rc, code);
  } catch (const Error& e) {
    throw Error(util::cat(label, " reduction ", reduction_.name(), ": ", e.what()));
  }
  if (!low) return std::nullopt;
  low->name = name();
  low->entry_point = entry_;
  low->runtime_op = std::make_shared<PrologueRuntime>(std::move(low->runtime_op), std::move(reads), label, dtype_);
  return low;
}

void FusedReductionOp::cpu_forward(CpuContext& ctx) const {
  std::vector<std::vector<std::int64_t>> shapes;
  for (const auto& x : ctx.inputs) shapes.push_back(x.shape());
  // The prologue's value in scratch kept by the calling thread between runs.
  const std::vector<std::int64_t> value = broadcast_sizes(shapes, "[kg.fused_reduction]");
  std::vector<Tensor> mid{thread_scratch_tensor(dtype_, value)};
  {
    SubContext pc(ctx, ctx.inputs, {}, mid[0]);
    prologue_->cpu_forward(pc);
  }
  SubContext rc(ctx, mid, ctx.params, ctx.output);
  reduction_->cpu_forward(rc);
}

}  // namespace kg::ops
