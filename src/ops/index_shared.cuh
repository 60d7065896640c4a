// What index.cuh shares with the host code that packs its kernels' arguments: KgDivider's layout
// (filled on the host by ops/divider.hpp) and the indices per thread of
// kg_for_each_unrolled. Plain C++: included by the kernels and by host code alike.
#pragma once

// Division by a divisor fixed for a launch (kg_div in index.cuh); 16 bytes, passed by value.
struct KgDivider {
  unsigned mul;    // magic multiplier, valid when the divisor and dividends are below 2^31
  unsigned shift;  // ceil(log2(d))
  long long d;     // the divisor itself, for the 64-bit path
};

// Indices each thread takes per round of kg_for_each_unrolled: grids are sized for
// total / KG_UNROLL threads.
#define KG_UNROLL 4
// Bytes of the packs (KgPack) in which memory-bound kernels move contiguous values.
#define KG_PACK_BYTES 16
