// What nn.attention's kernels (attention.cu) share with ops/attention.cpp: the block shape, the
// largest head size the kernel keeps in shared memory, and the arguments passed by value. Plain
// host C++ too.
#pragma once

#define KG_ATTN_THREADS 128  // four warps
#define KG_ATTN_WARPS (KG_ATTN_THREADS / 32)
// Query rows per warp (f32 and 16-bit; f64 takes half as many) and keys per tile (f64: 16).
#define KG_ATTN_ROWS_PER_WARP 4
#define KG_ATTN_KEYS 32
#define KG_ATTN_ROWS_PER_WARP_F64 2
#define KG_ATTN_KEYS_F64 16
// The largest D (query/key width) and Dv (value width) the kernel takes.
#define KG_ATTN_MAX_HEAD 128
// Batch dims (every dim before Sq, heads included) the mask's walk takes.
#define KG_ATTN_MAX_LEVELS 6

// The mask's kinds.
#define KG_ATTN_MASK_NONE 0
#define KG_ATTN_MASK_ADD 1   // added to the scaled scores (the query's dtype)
#define KG_ATTN_MASK_BOOL 2  // one byte per element, nonzero = keep

// One launch over bh = product of the batch dims, each (bh, tile of query rows) a block.
struct KgAttnArgs {
  long long bh, sq, sk, d, dv;
  long long mask_kind, causal;
  // The mask's element strides along each batch dim (0 where it is broadcast) and along Sq and Sk.
  long long levels;
  long long size[KG_ATTN_MAX_LEVELS];
  long long mask_stride[KG_ATTN_MAX_LEVELS];
  long long mask_sq, mask_sk;
  double scale;
};
