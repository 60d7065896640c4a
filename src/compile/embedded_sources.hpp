// Kernel sources embedded at build time: every src/ops/*.cu and the .cuh helpers beside them.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace kg::compile {

// The text of an embedded kernel source by file name ("conv.cu"); throws kg::Error if absent.
const std::string& kernel_source(const std::string& file);
// Every embedded .cu file name.
std::vector<std::string> kernel_files();
// The .cuh helpers as (include name, text), given to NVRTC as in-memory headers.
const std::vector<std::pair<std::string, std::string>>& helper_headers();

}  // namespace kg::compile
