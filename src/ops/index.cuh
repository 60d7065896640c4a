// Index helpers for memory-bound kernels (copies, elementwise normalisation):
//  - division by a divisor fixed for a launch through a precomputed multiplier (Granlund and
//    Montgomery's round-up method); KgDivider is laid out in index_shared.cuh, which the host
//    fills from ops/divider.hpp (16 bytes, passed by value);
//  - a grid-stride loop that keeps KG_UNROLL loads in flight per thread;
//  - 16-byte packs of contiguous values.
#pragma once

#include "index_shared.cuh"
#include "kg_device.cuh"

// n / d for 0 <= n. With Small (every dividend and the divisor below 2^31) it takes a multiply-high,
// an add and a shift; otherwise it is a plain 64-bit division.
template <bool Small>
__device__ __forceinline__ kg_index kg_div(const KgDivider& f, kg_index n) {
  if (Small) {
    const unsigned u = (unsigned)n;
    return (kg_index)((__umulhi(u, f.mul) + u) >> f.shift);
  }
  return n / f.d;
}

// KG_PACK_BYTES / sizeof(T) contiguous values, moved by one 16-byte access.
template <class T>
struct alignas(KG_PACK_BYTES) KgPack {
  T v[KG_PACK_BYTES / sizeof(T)];
};

__device__ __forceinline__ bool kg_aligned16(const void* p) {
  return ((unsigned long long)p & (KG_PACK_BYTES - 1)) == 0;
}

// For every i = first, first + step, ... below end: v = load(i), then use(i, v). Each round
// takes U indices and issues their loads before their uses, so that the thread keeps U memory
// requests in flight.
template <class V, int U, class Load, class Use>
__device__ __forceinline__ void kg_strided_unrolled(kg_index first, kg_index end, kg_index step, const Load& load,
                                                    const Use& use) {
  for (kg_index i0 = first; i0 < end; i0 += U * step) {
    V v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const kg_index i = i0 + u * step;
      if (i < end) v[u] = load(i);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const kg_index i = i0 + u * step;
      if (i < end) use(i, v[u]);
    }
  }
}

// For every i in [0, total): v = load(i), then store(i, v). Each thread takes KG_UNROLL indices a
// grid stride apart per round and issues their loads before their stores, so that each thread
// has several memory requests in flight; adjacent threads still touch adjacent indices. Size
// the grid for total / KG_UNROLL threads (any grid is correct). U = 1 keeps rare paths (64-bit
// index math) small.
template <class V, int U = KG_UNROLL, class Load, class Store>
__device__ __forceinline__ void kg_for_each_unrolled(kg_index total, Load load, Store store) {
  kg_strided_unrolled<V, U>(kg_thread_index(), total, kg_grid_stride(), load, store);
}
