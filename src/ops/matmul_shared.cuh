// The batch walks of nn.matmul's kernels (matmul.cu, matmul_backward.cu), passed by value and
// filled by ops/matmul.cpp. Plain host C++ too.
#pragma once

#define KG_MATMUL_MAX_LEVELS 8

// The output batch entries as broadcast levels (adjacent dims that broadcast alike merged),
// outermost first, with the element strides of A and B (0 where that operand is broadcast).
struct KgMatmulBatch {
  long long batches;  // output batch entries (product of the level sizes)
  long long levels;
  long long size[KG_MATMUL_MAX_LEVELS];
  long long stride_a[KG_MATMUL_MAX_LEVELS];
  long long stride_b[KG_MATMUL_MAX_LEVELS];
};

// The output batch entries seen from one operand: its matrices (`entries`, over the levels
// where its own stride is non-zero) and for each the output entries that use it (`reps`, over
// the other levels). Outermost level first; strides in elements.
struct KgMatmulGradBatch {
  long long entries, reps, levels;
  long long size[KG_MATMUL_MAX_LEVELS];
  long long stride_own[KG_MATMUL_MAX_LEVELS];
  long long stride_other[KG_MATMUL_MAX_LEVELS];
};
