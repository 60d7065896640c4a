// What the pointwise kernels (pointwise.cu) and the host code that launches them
// (ops/pointwise.cpp) share: the block size and the broadcast walk with the function's
// attributes, passed by value. Plain C++: included by the kernels and by host code alike.
#pragma once

#include "index_shared.cuh"

#define KG_PW_THREADS 256   // threads per block of every pointwise kernel
#define KG_PW_MAX_DIMS 8    // output dims after merging
#define KG_PW_MAX_INPUTS 3  // Where(cond, x, y)

// How output element i reads its inputs. The host drops size-1 dims and merges adjacent dims
// that every input walks alike; the merged dims are stored innermost first. Output index i
// unravels into k[d] < size[d].d, and input j reads its element sum_d k[d] * stride[j][d]
// (stride 0 along the dims it is broadcast over). When `same` is set every input has the
// output's elements in order and is read at i. 368 bytes.
struct KgPwArgs {
  KgDivider size[KG_PW_MAX_DIMS];
  long long stride[KG_PW_MAX_INPUTS][KG_PW_MAX_DIMS];
  long long n;         // output elements
  double attr[2];      // the function's attributes (alpha, beta, gamma; Clip's min and max)
  long long iattr[2];  // Clip's bounds for an integer dtype, within the dtype's range
  int rank;            // merged dims, 0 .. KG_PW_MAX_DIMS
  int same;            // 1: every input is read at the output's index
};
