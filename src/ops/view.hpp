// nn.view: the first input's bytes under a new shape given dim by dim (a constant, a dim of the
// input itself or of another input, or one dim inferred from the element count). What an
// imported Reshape, Flatten, Squeeze or Unsqueeze becomes, so that dynamic dims survive wherever
// they move. Like nn.reshape, it is a view: no buffer, no kernel.
#pragma once

#include <string>
#include <vector>

#include "kg/graph.hpp"
#include "ops/dim_ref.hpp"

namespace kg::ops {

// `dims` refer to the op's inputs: 0 is x, 1.. are `sources` (read for their shapes only). At
// most one entry may be `infer` (the DimRef constant -1): it takes what the element count leaves.
CustomData view_op(std::vector<DimRef> dims);
SymTensor view(const SymTensor& x, const std::vector<DimRef>& dims, const std::vector<SymTensor>& sources = {},
               const std::string& name = "");

}  // namespace kg::ops
