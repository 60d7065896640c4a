// kernelgraph: record a graph of symbolic tensors with built-in and custom ops, load it for
// concrete shapes on a device, and run it. Include this header.
#pragma once

#include "kg/custom_op.hpp"
#include "kg/distributed.hpp"
#include "kg/dlpack.hpp"
#include "kg/dtype.hpp"
#include "kg/error.hpp"
#include "kg/graph.hpp"
#include "kg/io.hpp"
#include "kg/model.hpp"
#include "kg/ops.hpp"
#include "kg/shape.hpp"
#include "kg/tensor.hpp"
#include "kg/testing.hpp"
#include "kg/version.hpp"
