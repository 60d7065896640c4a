// What the kernels the elementwise fusion pass generates and the host code that launches them
// (ops/fused_elementwise.cpp) share. Plain C++: included by the generated modules (after
// elementwise.cuh) and by host code alike. Each module holds each member op's device source in a
// namespace of its own and the group's entries. A group with several outputs writes each to its
// own part of one packed output [k, <shape>] (the entry takes a pointer per part).
//
// A group's inputs are read at each output index i in one of three ways, fixed when the kernel is
// written: the same index (x[i]), one element (x[0]), or a broadcast walk over the output's dims
// (KgFusedWalk: the offset of i in each broadcast input, from the output's merged dims).
#pragma once

#include "elementwise_shared.cuh"

#define KG_FUSE_MAX_INPUTS 8   // inputs of one fused group
#define KG_FUSE_MAX_OUTPUTS 4  // values one fused group writes (its root and values needed outside)

// The output's dims merged as far as every broadcast input allows, innermost first, and each
// input's element strides along them (0 where it is broadcast). Passed by value.
struct KgFusedWalk {
  KgDivider size[KG_EW_MAX_DIMS];
  long long stride[KG_FUSE_MAX_INPUTS][KG_EW_MAX_DIMS];
  int rank;
};
