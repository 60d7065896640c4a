// Generated code for evaluating a group of elementwise members at one element (see the header).
#include "ops/elementwise_codegen.hpp"

#include <algorithm>

#include "kg/error.hpp"
#include "ops/divider.hpp"
#include "ops/gpu_util.hpp"
#include "ops/op_util.hpp"
#include "util/str.hpp"

namespace kg::ops {
namespace {

// A value of the group in generated code: "v<k>" for member k, "e<j>" for input j.
std::string value_name(int arg) { return arg >= 0 ? util::cat("v", arg) : util::cat("e", -1 - arg); }

}  // namespace

bool EwWalkPlan::walks() const { return std::find(reads.begin(), reads.end(), EwRead::Walk) != reads.end(); }

EwWalkPlan plan_ew_walk(const std::vector<std::vector<std::int64_t>>& inputs, const std::vector<std::int64_t>& out,
                        const std::string& label, const std::vector<EwRead>* reads) {
  EwWalkPlan p;
  const std::int64_t n = numel_of(out);
  const std::size_t r = out.size();
  std::vector<std::size_t> walked;
  for (std::size_t j = 0; j < inputs.size(); ++j) {
    const std::int64_t m = numel_of(inputs[j]);
    // Same: only size-1 dims differ.
    EwRead read = m == n ? EwRead::Same : m == 1 ? EwRead::Scalar : EwRead::Walk;
    if (reads) read = reads->at(j);
    p.reads.push_back(read);
    if (read == EwRead::Walk) walked.push_back(j);
  }
  p.stride.assign(inputs.size(), {});
  if (walked.empty()) return p;
  // Innermost first: the value's dims, each walked input's strides along them (0 where broadcast).
  std::vector<std::int64_t> size;
  std::vector<std::vector<std::int64_t>> stride(inputs.size());
  for (std::size_t d = 0; d < r; ++d) {
    const std::size_t od = r - 1 - d;
    if (out[od] == 1) continue;
    size.push_back(out[od]);
    for (std::size_t j : walked) {
      const auto& in = inputs[j];
      std::int64_t s = 0;
      if (d < in.size() && in[in.size() - 1 - d] != 1) {
        s = 1;
        for (std::size_t k = 0; k < d; ++k) s *= in[in.size() - 1 - k];
      }
      stride[j].push_back(s);
    }
  }
  // Merge dim d+1 into d where every walked input is contiguous across them.
  for (std::size_t d = 0; d < size.size();) {
    if (d + 1 < size.size() && std::all_of(walked.begin(), walked.end(), [&](std::size_t j) {
          return stride[j][d + 1] == stride[j][d] * size[d];
        })) {
      size[d] *= size[d + 1];
      size.erase(size.begin() + static_cast<std::ptrdiff_t>(d) + 1);
      for (std::size_t j : walked) stride[j].erase(stride[j].begin() + static_cast<std::ptrdiff_t>(d) + 1);
      continue;
    }
    ++d;
  }
  if (size.size() > KG_EW_MAX_DIMS)
    throw Error(util::cat(label, " broadcasts over ", size.size(),
                          " dims after merging; the generated kernel walks at most ", KG_EW_MAX_DIMS));
  p.size = std::move(size);
  p.stride = std::move(stride);
  return p;
}

std::vector<EwRead> symbolic_ew_reads(const std::vector<Shape>& inputs, const Shape& out) {
  std::vector<EwRead> reads;
  for (const auto& s : inputs)
    reads.push_back(s == out                                        ? EwRead::Same
                    : s.is_concrete() && numel_of(s.sizes()) == 1 ? EwRead::Scalar
                                                                  : EwRead::Walk);
  return reads;
}

KgFusedWalk ew_gpu_walk(const EwWalkPlan& p) {
  KgFusedWalk w{};
  w.rank = static_cast<int>(p.size.size());
  for (std::size_t d = 0; d < p.size.size(); ++d) {
    w.size[d] = kg_divider(p.size[d]);
    for (std::size_t j = 0; j < p.stride.size(); ++j)
      if (!p.stride[j].empty()) w.stride[j][d] = p.stride[j][d];
  }
  return w;
}

std::string ew_walk_offsets(const std::vector<EwRead>& reads, bool small, const std::string& indent, int skip) {
  std::string offsets, step;
  for (std::size_t j = 0; j < reads.size(); ++j)
    if (static_cast<int>(j) != skip && reads[j] == EwRead::Walk) {
      offsets += util::cat(" o", j, " = 0,");
      step += util::cat(" o", j, " += k * w.stride[", j, "][d];");
    }
  if (offsets.empty()) return {};
  offsets.back() = ';';
  // The loop runs to the constant bound, unrolled, so that every index into the walk is a
  // constant: a walk indexed by a run-time d would be copied from the kernel's parameters to local
  // memory by every thread (about 700 bytes each: that copy, not the arithmetic, bounded the
  // epilogue kernels).
  return util::cat(indent, "kg_index", offsets, "\n", indent, "kg_index rest = i;\n", indent,
                   "#pragma unroll\n", indent, "for (int d = 0; d < KG_EW_MAX_DIMS; ++d) {\n", indent,
                   "  if (d >= w.rank) break;\n", indent, "  const kg_index q = kg_div<",
                   small ? "true" : "false", ">(w.size[d], rest);\n", indent,
                   "  const kg_index k = rest - q * w.size[d].d;\n", indent, " ", step, "\n", indent,
                   "  rest = q;\n", indent, "}\n");
}

std::string ew_module_head(DType dtype) {
  return util::cat("#include \"elementwise.cuh\"\n#include \"fused_elementwise.cuh\"\ntypedef ",
                   device_compute_type(dtype), " kg_t;\ntypedef ", device_type(dtype),
                   " kg_s;\n#include \"pointwise.cuh\"\n");
}

std::string ew_member_sources(const std::vector<FusedMember>& members) {
  std::string src;
  for (std::size_t m = 0; m < members.size(); ++m)
    src += util::cat("// ", members[m].op.name(), " @ ", members[m].node, "\nnamespace kg_m", m, " {\n",
                     members[m].form.device_source, "\n}  // namespace kg_m", m, "\n");
  return src;
}

std::string ew_member_values(const std::vector<FusedMember>& members, const std::string& indent) {
  std::string body;
  for (std::size_t m = 0; m < members.size(); ++m) {
    body += util::cat(indent, "const kg_t v", m, " = (kg_t)kg_m", m, "::", members[m].form.function, "(");
    for (std::size_t k = 0; k < members[m].args.size(); ++k)
      body += util::cat(k ? ", " : "", value_name(members[m].args[k]));
    body += ");\n";
  }
  return body;
}

namespace {

// The loader (given < 0) or epilogue struct: input `given`, when >= 0, is the operator's argument g
// rather than a pointer field.
std::string group_struct(const char* what, const std::string& name, const std::vector<FusedMember>& members,
                         int inputs, const std::vector<EwRead>& reads, bool small, int given) {
  if (members.empty()) throw Error(util::cat(what, ": a group needs at least one member"));
  if (static_cast<int>(reads.size()) != inputs)
    throw Error(util::cat(what, ": ", reads.size(), " reads for ", inputs, " inputs"));
  if (given >= inputs) throw Error(util::cat(what, ": input ", given, " of ", inputs, " cannot be the given value"));
  bool walks = false;
  std::string fields;
  for (int j = 0; j < inputs; ++j)
    if (j != given) fields += util::cat("  const kg_s* p", j, ";\n");
  for (int j = 0; j < inputs; ++j) walks = walks || (j != given && reads[static_cast<std::size_t>(j)] == EwRead::Walk);
  if (walks) fields += "  KgFusedWalk w;\n";
  std::string body = ew_walk_offsets(reads, small, "    ", given);
  for (int j = 0; j < inputs; ++j) {
    if (j == given) {
      body += util::cat("    const kg_t e", j, " = g;\n");
      continue;
    }
    const EwRead r = reads[static_cast<std::size_t>(j)];
    body += util::cat("    const kg_t e", j, " = kg_to_compute(p", j, "[",
                      r == EwRead::Same ? "i" : r == EwRead::Scalar ? "0" : util::cat("o", j), "]);\n");
  }
  body += ew_member_values(members, "    ");
  return util::cat("struct ", name, " {\n", fields, "  __device__ __forceinline__ kg_t operator()(",
                   given >= 0 ? "kg_t g, " : "", "kg_index i) const {\n", body, "    return v", members.size() - 1,
                   ";\n  }\n};\n");
}

}  // namespace

std::string ew_loader_struct(const std::string& name, const std::vector<FusedMember>& members, int inputs,
                             const std::vector<EwRead>& reads, bool small) {
  return group_struct("ew_loader_struct", name, members, inputs, reads, small, -1);
}

std::string ew_epilogue_struct(const std::string& name, const std::vector<FusedMember>& members, int inputs,
                               const std::vector<EwRead>& reads, bool small, int given) {
  if (given < 0) throw Error("ew_epilogue_struct: the given input must be one of the group's");
  return group_struct("ew_epilogue_struct", name, members, inputs, reads, small, given);
}

}  // namespace kg::ops
