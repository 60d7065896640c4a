// Tensor-core matrix products of one warp, for the built-in kernels that run on tensor cores:
//
//   kg_mma_16816<T>(d, a, b):  D[16×8] += A[16×16] · B[16×8],  T = kg_bf16 or kg_f16, D in f32
//
// (PTX mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32). Every lane of the warp
// calls it with its own fragments; each 32-bit register holds two 16-bit elements, the first in
// its low half. With g = lane / 4 and t = lane % 4 (PTX ISA, "matrix fragments for
// mma.m16n8k16"):
//
//   a[0] = A[g][2t, 2t+1]      a[1] = A[g+8][2t, 2t+1]
//   a[2] = A[g][2t+8, 2t+9]    a[3] = A[g+8][2t+8, 2t+9]
//   b[0] = B[2t, 2t+1][g]      b[1] = B[2t+8, 2t+9][g]
//   d[0], d[1] = D[g][2t, 2t+1]    d[2], d[3] = D[g+8][2t, 2t+1]
//
// On a GPU of compute capability 8.0 or newer it is the one instruction. Under the CUDA emulator,
// and on older GPUs, the warp computes the same product through shared memory: each lane puts
// its fragments into the warp's slot, the warp synchronises, each lane sums the terms of its own
// four outputs in f32 (the products of two 16-bit values are exact in f32) and the warp
// synchronises again before the slot is reused. Slow, but the same function, so the emulator
// checks the kernels that use it.
// Given to NVRTC as an in-memory header through the kernel that includes it; it includes only
// kg_dtype.cuh.
#pragma once

#include "kg_dtype.cuh"

#if defined(KG_CUDA_EMU) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800)
#define KG_MMA_BY_WARP_EXCHANGE 1
#endif

// The two 16-bit elements of a fragment register as floats (the low half first).
__device__ __forceinline__ void kg_mma_unpack(kg_bf16, unsigned r, float& lo, float& hi) {
  lo = kg_bf16_to_float((unsigned short)(r & 0xffffu));
  hi = kg_bf16_to_float((unsigned short)(r >> 16));
}
__device__ __forceinline__ void kg_mma_unpack(kg_f16, unsigned r, float& lo, float& hi) {
  lo = kg_f16_to_float((unsigned short)(r & 0xffffu));
  hi = kg_f16_to_float((unsigned short)(r >> 16));
}

#ifdef KG_MMA_BY_WARP_EXCHANGE
// The warps a block may have (a kernel may define it before including this file): each lane's
// 4 A registers and 2 B registers take a slot of shared memory.
#ifndef KG_MMA_MAX_WARPS
#define KG_MMA_MAX_WARPS 8
#endif

template <class T>
__device__ __forceinline__ void kg_mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  __shared__ unsigned kg_mma_slot[KG_MMA_MAX_WARPS][32][6];
  const unsigned tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned warp = tid / 32, lane = tid % 32;
  if (warp >= KG_MMA_MAX_WARPS) __trap();
  unsigned* mine = kg_mma_slot[warp][lane];
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b[0];
  mine[5] = b[1];
  __syncwarp();
  const unsigned g = lane / 4, t = lane % 4;
  // A[r][k] and B[k][n] from the lanes that hold them.
  auto a_at = [&](unsigned r, unsigned k) {
    const unsigned reg = (r >= 8 ? 1u : 0u) + (k >= 8 ? 2u : 0u);
    const unsigned v = kg_mma_slot[warp][(r % 8) * 4 + (k % 8) / 2][reg];
    float lo, hi;
    kg_mma_unpack(T(), v, lo, hi);
    return k % 2 ? hi : lo;
  };
  auto b_at = [&](unsigned k, unsigned n) {
    const unsigned v = kg_mma_slot[warp][n * 4 + (k % 8) / 2][4 + (k >= 8 ? 1u : 0u)];
    float lo, hi;
    kg_mma_unpack(T(), v, lo, hi);
    return k % 2 ? hi : lo;
  };
  for (int i = 0; i < 4; ++i) {
    const unsigned r = g + (i >= 2 ? 8u : 0u), n = 2 * t + (unsigned)(i % 2);
    float s = d[i];
    for (unsigned k = 0; k < 16; ++k) s += a_at(r, k) * b_at(k, n);
    d[i] = s;
  }
  __syncwarp();
}
#else
template <class T>
__device__ __forceinline__ void kg_mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]);

// The instruction for one 16-bit type (its PTX name).
#define KG_MMA_16816_FOR(T, PTX)                                                                             \
  template <>                                                                                                \
  __device__ __forceinline__ void kg_mma_16816<T>(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) { \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX                                        \
                 ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"                     \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                            \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));                        \
  }
KG_MMA_16816_FOR(kg_bf16, "bf16")
KG_MMA_16816_FOR(kg_f16, "f16")
#undef KG_MMA_16816_FOR
#endif
