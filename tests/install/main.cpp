// Checks an installed kernelgraph from outside its source tree: the detect_decode example's op
// through kg::testing::check_op (its CPU implementation, and its kernel run by the CUDA emulator,
// which builds it with the host compiler), and NVRTC, which the library opens at run time.
#include <cstdio>
#include <string>

#include "detect_decode.hpp"
#include "kg/cuda.hpp"
#include "kg/kg.hpp"

int main() {
  try {
    kg::CustomData op(yolo::DetectDecodeOp::for_level(4, 6, 8.f));
    kg::testing::CheckOpOptions options;
    options.batch_sizes = {1, 2};
    options.seed = 1;
    const kg::testing::CheckOpReport report =
        kg::testing::check_op(op, {{kg::Dim::named("batch"), 4, 24}}, {kg::DType::F32}, options);
    std::printf("%s\n", report.to_string().c_str());
    bool emulated = false;
    for (const std::string& line : report.lines)
      emulated = emulated || (line.rfind("PASS", 0) == 0 && line.find(", emulator") != std::string::npos);
    if (!report.ok || !emulated) {
      std::fprintf(stderr, "install_check: check_op %s\n", report.ok ? "did not run the emulator" : "failed");
      return 1;
    }

    const char* probe = "extern \"C\" __global__ void probe(float* x) { x[threadIdx.x] = 1.f; }";
    if (kg::cuda::compile_archs().empty()) {
      try {
        kg::cuda::compile_ptx("install.probe", probe, 90);
        std::fprintf(stderr, "install_check: compile_ptx worked, but compile_archs() is empty\n");
        return 1;
      } catch (const kg::Error& e) {
        if (std::string(e.what()).find("NVRTC") == std::string::npos) {
          std::fprintf(stderr, "install_check: compile_ptx without NVRTC: unexpected error: %s\n", e.what());
          return 1;
        }
        std::printf("nvrtc: not available (%s)\n", e.what());
      }
    } else {
      const std::string ptx = kg::cuda::compile_ptx("install.probe", probe, 90);
      if (ptx.find(".entry probe") == std::string::npos) {
        std::fprintf(stderr, "install_check: the PTX has no entry 'probe':\n%s\n", ptx.c_str());
        return 1;
      }
      std::printf("nvrtc: compiled a kernel for sm_90\n");
    }
    return 0;
  } catch (const kg::Error& e) {
    std::fprintf(stderr, "install_check: error: %s\n", e.what());
    return 1;
  }
}
