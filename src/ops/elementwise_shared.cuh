// What the elementwise kernels (elementwise.cuh) and the host code that launches them
// (ops/elementwise.cpp) share: the block size, and the broadcast walk and gradient reduction
// passed by value. Plain C++: included by the kernels and by host code alike.
#pragma once

#include "index_shared.cuh"

#define KG_EW_THREADS 256    // threads per block of every elementwise kernel
#define KG_EW_PACK_BYTES KG_PACK_BYTES  // contiguous maps load and store packs of this many bytes
#define KG_EW_MAX_DIMS 8     // merged dims of a general broadcast or of a gradient reduction

// ---- broadcasting ----
// How the output's index space maps to the operands (KgBroadcast::mode). The host merges the
// dims first, so that the plain cases are recognised.
constexpr int KG_BCAST_SAME = 0;       // a[i] ⊙ b[i]
constexpr int KG_BCAST_SCALAR_B = 1;   // a[i] ⊙ b[0]
constexpr int KG_BCAST_SCALAR_A = 2;   // a[0] ⊙ b[i]
constexpr int KG_BCAST_CHANNEL_B = 3;  // a[i] ⊙ b[(i / inner) % c]: inner = size[0].d, c = size[1].d
constexpr int KG_BCAST_CHANNEL_A = 4;  // a[(i / inner) % c] ⊙ b[i]
constexpr int KG_BCAST_GENERAL = 5;    // dims innermost first: size[d], strides stride_a[d], stride_b[d]

// 264 bytes.
struct KgBroadcast {
  KgDivider size[KG_EW_MAX_DIMS];
  long long stride_a[KG_EW_MAX_DIMS];
  long long stride_b[KG_EW_MAX_DIMS];
  int rank;
  int mode;  // KG_BCAST_*
};

// ---- gradient of a broadcast operand X of y = a ⊙ b ----
// The output's dims merged into kept ones (they index X; innermost first, X's elements in order)
// and reduced ones, with element strides into the output (so), a (sa) and b (sb); how the blocks
// split the sums (see kg_binary_grad in elementwise.cuh).
struct KgReduce {
  KgDivider kept_size[KG_EW_MAX_DIMS];
  KgDivider red_size[KG_EW_MAX_DIMS];
  long long kept_so[KG_EW_MAX_DIMS], kept_sa[KG_EW_MAX_DIMS], kept_sb[KG_EW_MAX_DIMS];
  long long red_so[KG_EW_MAX_DIMS], red_sa[KG_EW_MAX_DIMS], red_sb[KG_EW_MAX_DIMS];
  long long m;  // elements of X
  long long r;  // output elements summed into each
  int kept_rank, red_rank;
  int width;        // adjacent elements of X per block: a power of two from 1 to KG_EW_THREADS
  int splits;       // blocks per reduction (1: phase 0 writes the gradient itself)
  long long chunk;  // reduction elements per split
};
