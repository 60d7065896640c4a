// What the reduction kernels (reduce_ops.cu) share with ops/reduce_ops.cpp: the block size, how
// the work is split, and the argument structs passed by value. Plain C++: included by the kernels
// and by host code alike.
#pragma once

#include "index_shared.cuh"

#define KG_REDUCE_THREADS 256  // threads per block of every kernel of the family

// Kept dims and reduced dims (each) of a reduction after merging: size-1 dims dropped, adjacent
// dims of the same kind merged.
#define KG_REDUCE_MAX_DIMS 8

// Who reduces one output element, by the number of input elements reduced into it (count):
//   count < KG_REDUCE_WARP_MIN: one thread;
//   else, when the innermost input dim is kept and at least KG_REDUCE_COLUMNS long (adjacent
//     outputs read adjacent elements): columns, KG_REDUCE_COLUMNS adjacent outputs per block, one
//     per lane, the block's warps splitting their elements;
//   else count < KG_REDUCE_BLOCK_MIN: one warp (KG_REDUCE_THREADS / 32 outputs per block);
//   else a whole block.
#define KG_REDUCE_WARP_MIN 32
#define KG_REDUCE_BLOCK_MIN 1024
#define KG_REDUCE_COLUMNS 32
#define KG_REDUCE_BY_THREAD 0
#define KG_REDUCE_BY_WARP 1
#define KG_REDUCE_BY_BLOCK 2
#define KG_REDUCE_BY_COLUMNS 3

// A reduction with few outputs of many elements each (fewer than KG_REDUCE_SPLIT_BLOCKS blocks in
// the block or columns layout) is split in two launches: the first (stage KG_REDUCE_STAGE_PARTIAL)
// reduces each output's elements in `splits` shares of `chunk` into a scratch buffer of partials
// (KG_REDUCE_PART_BYTES each, output-major), the second (KG_REDUCE_STAGE_COMBINE), one thread per
// output, combines them in order. A share has at least KG_REDUCE_SPLIT_MIN elements
// (KG_REDUCE_SPLIT_MIN_ROWS for columns).
#define KG_REDUCE_SPLIT_BLOCKS 1024
#define KG_REDUCE_SPLIT_MIN 4096
#define KG_REDUCE_SPLIT_MIN_ROWS 256
#define KG_REDUCE_PART_BYTES 16
#define KG_REDUCE_STAGE_WHOLE 0
#define KG_REDUCE_STAGE_PARTIAL 1
#define KG_REDUCE_STAGE_COMBINE 2

// A reduction (and arg-max/min) as the kernels see it. Output element o (row-major over the kept
// dims) reduces the input elements at offset base(o) + offset(r) for r in [0, count), where
// base(o) unravels o over the kept dims and offset(r) unravels r over the reduced dims, each
// outermost first with its input stride. For arg-max/min there is one reduced dim (or none, when
// the axis has size 1), so r is the index along the axis.
struct KgReduceArgs {
  long long outputs;    // output elements
  long long count;      // input elements reduced into each (0 for an empty axis)
  long long mode;       // KG_REDUCE_BY_THREAD, _WARP, _BLOCK or _COLUMNS
  long long small;      // 1 when the input has fewer than 2^31 elements (32-bit index math)
  long long width;      // the innermost kept dim's size (1 when none is kept)
  long long stage;      // KG_REDUCE_STAGE_WHOLE, _PARTIAL or _COMBINE
  long long splits;     // shares per output (1 unless split)
  long long chunk;      // elements per share (count unless split)
  long long kept_rank;  // kept dims after merging, 0..KG_REDUCE_MAX_DIMS
  long long red_rank;   // reduced dims after merging, 0..KG_REDUCE_MAX_DIMS
  KgDivider kept[KG_REDUCE_MAX_DIMS];
  long long kept_stride[KG_REDUCE_MAX_DIMS];  // input elements per step along each kept dim
  KgDivider red[KG_REDUCE_MAX_DIMS];
  long long red_stride[KG_REDUCE_MAX_DIMS];  // input elements per step along each reduced dim
};

// Lines up to this long are scanned by one thread each; longer ones by a block each when the
// lines are contiguous (inner == 1) or few (fewer than KG_CUMSUM_FEW_LINES).
#define KG_CUMSUM_SERIAL_MAX 256
#define KG_CUMSUM_FEW_LINES 1024

// A cumulative sum over the input viewed as [outer, n, inner], along n.
struct KgCumsumArgs {
  long long outer, n, inner;
  long long exclusive;  // 1: each element gets the sum of those before it (the first gets 0)
  long long reverse;    // 1: sums run from the end of the line
  long long by_block;   // 1: a block scans each line; 0: a thread each
};
