// The one exception type kernelgraph throws for user-facing errors.
#pragma once

#include <stdexcept>
#include <string>

namespace kg {

// Every error caused by user input (a bad shape, a bad file, a bad argument) is a kg::Error.
// Errors about a node read "[<op name> @ <dotted node name>] <what went wrong, with numbers>".
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace kg
