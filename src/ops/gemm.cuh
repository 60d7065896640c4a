// A tiled GEMM for the built-in kernels: C[m, n] = alpha * sum_k A(m, k) B(k, n) + bias[n],
// with arbitrary element strides so one kernel serves x·Wᵀ, batched matmul and transposes.
// 64×64 output tiles, 16-deep k slices in shared memory, 256 threads each computing 4×4.
#pragma once

#include "kg_device.cuh"

#define KG_GEMM_BM 64
#define KG_GEMM_BN 64
#define KG_GEMM_BK 16
#define KG_GEMM_THREADS 256

template <class T>
struct KgGemmArgs {
  const T* a;
  const T* b;
  T* c;
  const T* bias;  // may be null; indexed by n
  kg_index m, n, k;
  kg_index sam, sak;  // A(m, k) = a[m*sam + k*sak]
  kg_index sbk, sbn;  // B(k, n) = b[k*sbk + n*sbn]
  kg_index scm;       // C(m, n) = c[m*scm + n]
  kg_index batch_a, batch_b, batch_c;  // strides between batch entries (blockIdx.z)
};

template <class T>
__device__ __forceinline__ void kg_gemm_tile(const KgGemmArgs<T>& p) {
  __shared__ T as[KG_GEMM_BK][KG_GEMM_BM];
  __shared__ T bs[KG_GEMM_BK][KG_GEMM_BN];
  const T* a = p.a + (kg_index)blockIdx.z * p.batch_a;
  const T* b = p.b + (kg_index)blockIdx.z * p.batch_b;
  T* c = p.c + (kg_index)blockIdx.z * p.batch_c;
  const kg_index m0 = (kg_index)blockIdx.y * KG_GEMM_BM, n0 = (kg_index)blockIdx.x * KG_GEMM_BN;
  const int tid = threadIdx.x;
  const int tm = (tid / 16) * 4, tn = (tid % 16) * 4;
  T acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = T(0);
  for (kg_index k0 = 0; k0 < p.k; k0 += KG_GEMM_BK) {
    // 64×16 elements of each operand, 4 per thread.
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int idx = tid + r * KG_GEMM_THREADS;
      const int kk = idx % KG_GEMM_BK, mm = idx / KG_GEMM_BK;
      const kg_index gm = m0 + mm, gk = k0 + kk;
      as[kk][mm] = (gm < p.m && gk < p.k) ? a[gm * p.sam + gk * p.sak] : T(0);
      const kg_index gn = n0 + mm;
      bs[kk][mm] = (gn < p.n && gk < p.k) ? b[gk * p.sbk + gn * p.sbn] : T(0);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < KG_GEMM_BK; ++kk) {
      T av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = as[kk][tm + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = bs[kk][tn + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const kg_index gm = m0 + tm + i;
    if (gm >= p.m) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const kg_index gn = n0 + tn + j;
      if (gn >= p.n) continue;
      c[gm * p.scm + gn] = acc[i][j] + (p.bias ? p.bias[gn] : T(0));
    }
  }
}
