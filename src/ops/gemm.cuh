// A tiled GEMM for the built-in kernels: C[m, n] = alpha * sum_k A(m, k) B(k, n) + bias[n],
// with arbitrary element strides so one kernel serves x·Wᵀ, batched matmul and transposes.
// 64×64 output tiles, 16-deep k slices in shared memory, 256 threads each computing 4×4
// (gemm_shared.cuh, which the host code that sizes the grids includes too).
// T is the storage type (float, double, kg_f16 or kg_bf16); the tiles, the accumulators and the
// bias add are in its compute type (kg_compute_t<T>: float for the 16-bit types), and C is
// rounded into T once, when stored.
#pragma once

#include "gemm_shared.cuh"
#include "kg_device.cuh"

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

// Adds this thread's 4×4 share of the 64×64 tile at (m0, n0) of sum over k of A(m, k) B(k, n)
// to acc, with a and b already offset to the batch entry. Every thread of the block calls it
// (it synchronises the block).
template <class T>
__device__ __forceinline__ void kg_gemm_accumulate(const KgGemmArgs<T>& p, const T* a, const T* b, kg_index m0,
                                                   kg_index n0, kg_compute_t<T> (&acc)[4][4]) {
  typedef kg_compute_t<T> C;
  __shared__ C as[KG_GEMM_BK][KG_GEMM_BM];
  __shared__ C bs[KG_GEMM_BK][KG_GEMM_BN];
  const int tid = threadIdx.x;
  const int tm = (tid / 16) * 4, tn = (tid % 16) * 4;
  for (kg_index k0 = 0; k0 < p.k; k0 += KG_GEMM_BK) {
    // 64×16 elements of each operand, 4 per thread.
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int idx = tid + r * KG_GEMM_THREADS;
      const int kk = idx % KG_GEMM_BK, mm = idx / KG_GEMM_BK;
      const kg_index gm = m0 + mm, gk = k0 + kk;
      as[kk][mm] = (gm < p.m && gk < p.k) ? kg_ld(a, gm * p.sam + gk * p.sak) : C(0);
      const kg_index gn = n0 + mm;
      bs[kk][mm] = (gn < p.n && gk < p.k) ? kg_ld(b, gk * p.sbk + gn * p.sbn) : C(0);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < KG_GEMM_BK; ++kk) {
      C av[4], bv[4];
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
}

// Zeroes a thread's accumulators (of the compute type).
template <class C>
__device__ __forceinline__ void kg_gemm_zero(C (&acc)[4][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = C(0);
}

// The plain epilogue: C(m, n) is the sum (plus the bias) itself.
struct KgGemmPlain {
  template <class C>
  __device__ __forceinline__ C operator()(C v, kg_index) const {
    return v;
  }
};

// Writes this thread's 4×4 share of the tile at (m0, n0): C(m, n) = epi(acc + bias[n], i)
// (overwriting), within the m × n bounds, rounded into T once. i = base + m * scm + n is the
// element's index in the whole output (base: where `c` starts in it), which a fused epilogue
// (kg.fused_gemm) reads its other inputs at; the computation before the rounding is in the
// compute type.
template <class T, class Epi = KgGemmPlain>
__device__ __forceinline__ void kg_gemm_store(const KgGemmArgs<T>& p, T* c, kg_index m0, kg_index n0,
                                              const kg_compute_t<T> (&acc)[4][4], Epi epi = Epi(),
                                              kg_index base = 0) {
  typedef kg_compute_t<T> C;
  const int tid = threadIdx.x;
  const int tm = (tid / 16) * 4, tn = (tid % 16) * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const kg_index gm = m0 + tm + i;
    if (gm >= p.m) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const kg_index gn = n0 + tn + j;
      if (gn >= p.n) continue;
      const kg_index at = gm * p.scm + gn;
      kg_st(c, at, epi(acc[i][j] + (p.bias ? kg_ld(p.bias, gn) : C(0)), base + at));
    }
  }
}

// The block's tile: blockIdx.x picks the n tile, blockIdx.y the m tile, blockIdx.z the batch entry;
// `epi` and `base` as for kg_gemm_store (base: where p.c starts in the output).
template <class T, class Epi = KgGemmPlain>
__device__ __forceinline__ void kg_gemm_tile(const KgGemmArgs<T>& p, Epi epi = Epi(), kg_index base = 0) {
  const T* a = p.a + (kg_index)blockIdx.z * p.batch_a;
  const T* b = p.b + (kg_index)blockIdx.z * p.batch_b;
  T* c = p.c + (kg_index)blockIdx.z * p.batch_c;
  const kg_index m0 = (kg_index)blockIdx.y * KG_GEMM_BM, n0 = (kg_index)blockIdx.x * KG_GEMM_BN;
  kg_compute_t<T> acc[4][4];
  kg_gemm_zero(acc);
  kg_gemm_accumulate(p, a, b, m0, n0, acc);
  kg_gemm_store(p, c, m0, n0, acc, epi, base + (kg_index)blockIdx.z * p.batch_c);
}

// Every tile of C, whatever the grid: the block takes tiles (x, y) and batch entries z a grid
// apart (so any m and n fit the grid's y limit).
template <class T>
__device__ __forceinline__ void kg_gemm_grid(const KgGemmArgs<T>& p, kg_index batches) {
  for (kg_index z = blockIdx.z; z < batches; z += gridDim.z)
    for (kg_index m0 = (kg_index)blockIdx.y * KG_GEMM_BM; m0 < p.m; m0 += (kg_index)gridDim.y * KG_GEMM_BM)
      for (kg_index n0 = (kg_index)blockIdx.x * KG_GEMM_BN; n0 < p.n; n0 += (kg_index)gridDim.x * KG_GEMM_BN) {
        kg_compute_t<T> acc[4][4];
        kg_gemm_zero(acc);
        kg_gemm_accumulate(p, p.a + z * p.batch_a, p.b + z * p.batch_b, m0, n0, acc);
        kg_gemm_store(p, p.c + z * p.batch_c, m0, n0, acc);
      }
}
