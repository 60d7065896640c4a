// What the copy kernels of nn.permute, nn.concat and nn.slice (shape_ops.cu) share with
// ops/shape_ops.cpp: the block size and the argument structs passed by value. Plain C++: included
// by the kernels and by host code alike.
#pragma once

#include "index_shared.cuh"

#define KG_COPY_THREADS 256  // threads per block of every copy kernel

// ---- nn.permute ----

#define KG_PERMUTE_MAX_DIMS 8  // output dims after merging
#define KG_TILE 32             // the tiled path's tiles are KG_TILE × KG_TILE elements
#define KG_PERMUTE_ROW_MAX 16  // the rows path's rows are shorter than this

struct KgPermuteArgs {
  long long total;                            // elements
  long long rank;                             // dims after merging, 1..KG_PERMUTE_MAX_DIMS
  long long tiled_p;                          // the tiled path's dim (see shape_ops.cu); -1: gather, -2: rows
  KgDivider tiles_a, tiles_b;                 // tiled: tiles along dim tiled_p and the last dim
  KgDivider size[KG_PERMUTE_MAX_DIMS];        // output dims, outermost first
  long long src_stride[KG_PERMUTE_MAX_DIMS];  // input elements per step along each output dim
  long long dst_stride[KG_PERMUTE_MAX_DIMS];  // output elements per step along each output dim
};

// ---- nn.concat ----

#define KG_CONCAT_MAX 16  // inputs per launch

// The output is [outer, row]; input k fills columns offset[k] .. offset[k] + chunk[k] of each row.
struct KgConcatArgs {
  unsigned long long src[KG_CONCAT_MAX];  // input addresses (backward: the input gradients')
  long long chunk[KG_CONCAT_MAX];         // elements of input k per outer index
  long long offset[KG_CONCAT_MAX];        // where they start in an output row
  KgDivider chunk_div[KG_CONCAT_MAX];
  long long outer;
  long long row;
};
