// The error the default CustomOp::cpu_forward throws. The CPU executor catches this type (and
// only this one) to run the op's lowered kernel through the CUDA emulator instead.
#pragma once

#include "kg/error.hpp"

namespace kg {

class NoCpuImplementation : public Error {
 public:
  NoCpuImplementation();
};

}  // namespace kg
