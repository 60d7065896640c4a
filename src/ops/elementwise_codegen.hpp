// Generated code for a group of elementwise members (ops::FusedMember): the pieces a module needs to
// evaluate the group at one element, shared by the kernels that do so. A kernel that reads a value
// through a group (a reduction's prologue, ops/fused_reduction) or stores one through it (a GEMM's
// epilogue, ops/fused_gemm) takes them from here:
//   - how each group input is read at an index of the group's value (the same index, one element,
//     or a broadcast walk over the value's merged dims: KgFusedWalk);
//   - the module head (the compute type kg_t, the storage type kg_s and the helper headers);
//   - each member's device_source in a namespace kg_m<k> of its own;
//   - one statement per member computing its value v<k> from the inputs' values e<j>.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ops/fused_elementwise.cuh"
#include "ops/fused_elementwise.hpp"

namespace kg::ops {

// How a group input is read at index i of the group's value.
enum class EwRead { Same, Scalar, Walk };

// The value's dims merged for the walk of the broadcast inputs, and how each input is read.
struct EwWalkPlan {
  std::vector<EwRead> reads;
  std::vector<std::int64_t> size;                 // merged dims of the value, innermost first
  std::vector<std::vector<std::int64_t>> stride;  // [input][dim]; empty for an input not walked
  bool walks() const;
};

// The plan for inputs of these concrete sizes broadcast to `out`. `reads`, when given, says how each
// input is read (the kernel was written for it); otherwise the sizes decide. More merged dims than
// KG_EW_MAX_DIMS is an error naming `label`.
EwWalkPlan plan_ew_walk(const std::vector<std::vector<std::int64_t>>& inputs,
                        const std::vector<std::int64_t>& out, const std::string& label,
                        const std::vector<EwRead>* reads = nullptr);
// The reads from symbolic shapes only (an op lowered outside a model): an input shaped like the
// value is read at the same index, one of a single static element once, any other by the walk.
std::vector<EwRead> symbolic_ew_reads(const std::vector<Shape>& inputs, const Shape& out);
// The walk as the kernels take it.
KgFusedWalk ew_gpu_walk(const EwWalkPlan& plan);

// Statements declaring o<j>, the offset of index `i` in each walked input j (reads[j] == Walk, j !=
// `skip`), from the walk `w` (KgFusedWalk), each line prefixed by `indent`; empty when none is
// walked. `small` selects 32-bit index division.
std::string ew_walk_offsets(const std::vector<EwRead>& reads, bool small, const std::string& indent, int skip = -1);

// The module head: includes and the typedefs kg_t (compute) and kg_s (storage) for `dtype`.
std::string ew_module_head(DType dtype);
// Each member's device source in its namespace kg_m<k>, with a comment naming it.
std::string ew_member_sources(const std::vector<FusedMember>& members);
// "const kg_t v<k> = (kg_t)kg_m<k>::f(...);\n" for every member, each line prefixed by `indent`.
std::string ew_member_values(const std::vector<FusedMember>& members, const std::string& indent);

// A device struct `name` whose operator()(kg_index i) gives the group's value at index i (its
// last member's), reading each of `inputs` group inputs as `reads` says: members p0.. (const kg_s*)
// and, when an input is walked, `w` (KgFusedWalk), in that order, so that `name{p0, ..., w}` builds
// it. `small` selects 32-bit index division (every index below 2^31).
std::string ew_loader_struct(const std::string& name, const std::vector<FusedMember>& members, int inputs,
                             const std::vector<EwRead>& reads, bool small);
// The same for an epilogue: operator()(kg_t g, kg_index i) gives the group's value at index i with
// group input `given` equal to g (the value a GEMM is about to store there) instead of read; that
// input has no pointer member, so `name{p0, ..., w}` lists the others in order.
std::string ew_epilogue_struct(const std::string& name, const std::vector<FusedMember>& members, int inputs,
                               const std::vector<EwRead>& reads, bool small, int given);

}  // namespace kg::ops
