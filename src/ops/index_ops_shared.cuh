// What the index_ops kernels (index_ops.cu) share with ops/index_ops.cpp: the block size, the
// index map's modes and the argument structs passed by value. Plain C++: included by the kernels
// and by host code alike.
#pragma once

#include "index_shared.cuh"

#define KG_INDEX_THREADS 256  // threads per block of every index_ops kernel
#define KG_INDEX_MAX_DIMS 8   // dims of one launch of an index map or a gather_elements
#define KG_INDEX_VALUES 8     // values per launch of kg_index_values (index.shape)

// ---- the index map (index.expand, index.tile, index.pad, index.slice) ----
// Output dim d of size size[d] reads input index k = start[d] + o * step[d] (o the output index
// along d) of an input dim of in_size[d] elements, stride[d] elements apart. An index outside
// [0, in_size) is mapped by the mode:
#define KG_MAP_CONSTANT 0  // the element is `value`
#define KG_MAP_REFLECT 1   // mirrored about the first and the last element (once; pad < dim)
#define KG_MAP_EDGE 2      // clamped to the first or the last element
#define KG_MAP_WRAP 3      // modulo in_size

struct KgIndexMapArgs {
  long long total;                       // output elements
  long long rank;                        // dims after merging, 1..KG_INDEX_MAX_DIMS
  long long mode;                        // KG_MAP_*
  unsigned long long value;              // KG_MAP_CONSTANT: the element's bytes (low bytes first)
  long long base;                        // input offset added to every element (dropped dims)
  KgDivider size[KG_INDEX_MAX_DIMS];     // output dims, outermost first
  long long start[KG_INDEX_MAX_DIMS];    // input index of output index 0
  long long step[KG_INDEX_MAX_DIMS];     // input indices per output index (0: broadcast)
  long long in_size[KG_INDEX_MAX_DIMS];  // input dim
  long long stride[KG_INDEX_MAX_DIMS];   // input elements per input index
};

// ---- index.gather_elements ----
// out[i] = data[the output's index with dim `axis` replaced by indices[i]]; the output (and the
// indices) are [size...], the data is laid out with `stride` (elements per index of each dim).
// axis is -1 when the gathered dim is not among these dims (a launch of a block of the output
// whose leading dims the host has fixed); indices[i] then still moves axis_stride per step.
struct KgGatherElementsArgs {
  long long total;                      // output elements
  long long rank;                       // 1..KG_INDEX_MAX_DIMS
  long long axis;                       // the dim whose index comes from indices, or -1
  long long axis_size;                  // data's size along the gathered dim
  long long axis_stride;                // data's stride along it
  KgDivider size[KG_INDEX_MAX_DIMS];    // the output's dims
  long long stride[KG_INDEX_MAX_DIMS];  // the data's strides
};

// ---- index.shape ----
// Up to KG_INDEX_VALUES sizes written at dst[offset ...] by one launch.
struct KgIndexValues {
  long long count;
  long long v[KG_INDEX_VALUES];
};
