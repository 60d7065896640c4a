// The backward of nn.matmul (C = A B with broadcast batch dims) on the GPU, through the tiled
// GEMM of gemm.cuh: dA = dC Bᵀ and dB = Aᵀ dC per output batch entry. An operand broadcast over
// some batch dims is shared by several output entries; its gradient matrix is the sum over
// them, accumulated in the tile's registers one entry after the other (a fixed order, so runs
// repeat bitwise; no atomics). Grid: x over the gradient's column tiles, y over its row tiles,
// z over its matrices; each is capped and the kernel loops over the rest. A kernel whose
// gradient is not wanted (a null pointer) returns at once. KgMatmulGradBatch, the batch walk
// seen from one operand, is matmul_shared.cuh's.
#include "gemm.cuh"
#include "matmul_shared.cuh"

// The output entry z of (matrix e, use r) and the element offsets of the own and other operands.
__device__ __forceinline__ void kg_matmul_grad_entry(const KgMatmulGradBatch& g, long long e, long long r,
                                                     long long& z, long long& own, long long& other) {
  z = 0;
  own = 0;
  other = 0;
  long long zmul = 1;
  for (int l = (int)g.levels - 1; l >= 0; --l) {
    long long c;
    if (g.stride_own[l] != 0) {
      const long long q = e / g.size[l];
      c = e - q * g.size[l];
      e = q;
    } else {
      const long long q = r / g.size[l];
      c = r - q * g.size[l];
      r = q;
    }
    z += c * zmul;
    zmul *= g.size[l];
    own += c * g.stride_own[l];
    other += c * g.stride_other[l];
  }
}

// grad[e] = sum over the uses r of e of dC[z] · other' (dc_first) or other' · dC[z], where `p`
// describes one such product with its operands at dc + z * m * n and other + (the other
// operand's offset): every tile of every matrix of the gradient.
template <class T>
__device__ __forceinline__ void kg_matmul_grad(const KgGemmArgs<T>& p, const T* dc, long long dc_step,
                                               const T* other, bool dc_first, T* grad,
                                               const KgMatmulGradBatch& g) {
  for (long long e = blockIdx.z; e < g.entries; e += gridDim.z)
    for (long long m0 = (long long)blockIdx.y * KG_GEMM_BM; m0 < p.m; m0 += (long long)gridDim.y * KG_GEMM_BM)
      for (long long n0 = (long long)blockIdx.x * KG_GEMM_BN; n0 < p.n; n0 += (long long)gridDim.x * KG_GEMM_BN) {
        T acc[4][4];
        kg_gemm_zero(acc);
        long long z, own, off;
        kg_matmul_grad_entry(g, e, 0, z, own, off);
        T* dst = grad + own;
        for (long long r = 0; r < g.reps; ++r) {
          kg_matmul_grad_entry(g, e, r, z, own, off);
          if (dc_first)
            kg_gemm_accumulate(p, dc + z * dc_step, other + off, m0, n0, acc);
          else
            kg_gemm_accumulate(p, other + off, dc + z * dc_step, m0, n0, acc);
        }
        kg_gemm_store(p, dst, m0, n0, acc);
      }
}

// dA [m, k] = dC [m, n] · Bᵀ, with B [k, n].
template <class T>
__device__ __forceinline__ void kg_matmul_backward_a(const T* __restrict__ dc, const T* __restrict__ b,
                                                     T* __restrict__ da, long long m, long long n, long long k,
                                                     const KgMatmulGradBatch& g) {
  if (!da) return;
  KgGemmArgs<T> p;
  p.a = dc;
  p.b = b;
  p.c = da;
  p.bias = 0;
  p.m = m;
  p.n = k;
  p.k = n;
  p.sam = n;  // A(i, t) = dC[i, t]
  p.sak = 1;
  p.sbk = 1;  // B(t, j) = b[j, t]
  p.sbn = n;
  p.scm = k;
  p.batch_a = p.batch_b = p.batch_c = 0;
  kg_matmul_grad<T>(p, dc, m * n, b, true, da, g);
}

// dB [k, n] = Aᵀ · dC [m, n], with A [m, k].
template <class T>
__device__ __forceinline__ void kg_matmul_backward_b(const T* __restrict__ dc, const T* __restrict__ a,
                                                     T* __restrict__ db, long long m, long long n, long long k,
                                                     const KgMatmulGradBatch& g) {
  if (!db) return;
  KgGemmArgs<T> p;
  p.a = a;
  p.b = dc;
  p.c = db;
  p.bias = 0;
  p.m = k;
  p.n = n;
  p.k = m;
  p.sam = 1;  // A(i, t) = a[t, i]
  p.sak = k;
  p.sbk = n;  // B(t, j) = dC[t, j]
  p.sbn = 1;
  p.scm = n;
  p.batch_a = p.batch_b = p.batch_c = 0;
  kg_matmul_grad<T>(p, dc, m * n, a, false, db, g);
}

// ---- entries ----

extern "C" __global__ void __launch_bounds__(KG_GEMM_THREADS)
    kg_matmul_backward_a_f32(const float* __restrict__ dc, const float* __restrict__ b, float* __restrict__ da,
                             long long m, long long n, long long k, KgMatmulGradBatch batch) {
  kg_matmul_backward_a<float>(dc, b, da, m, n, k, batch);
}
extern "C" __global__ void __launch_bounds__(KG_GEMM_THREADS)
    kg_matmul_backward_a_f64(const double* __restrict__ dc, const double* __restrict__ b,
                             double* __restrict__ da, long long m, long long n, long long k,
                             KgMatmulGradBatch batch) {
  kg_matmul_backward_a<double>(dc, b, da, m, n, k, batch);
}

extern "C" __global__ void __launch_bounds__(KG_GEMM_THREADS)
    kg_matmul_backward_b_f32(const float* __restrict__ dc, const float* __restrict__ a, float* __restrict__ db,
                             long long m, long long n, long long k, KgMatmulGradBatch batch) {
  kg_matmul_backward_b<float>(dc, a, db, m, n, k, batch);
}
extern "C" __global__ void __launch_bounds__(KG_GEMM_THREADS)
    kg_matmul_backward_b_f64(const double* __restrict__ dc, const double* __restrict__ a,
                             double* __restrict__ db, long long m, long long n, long long k,
                             KgMatmulGradBatch batch) {
  kg_matmul_backward_b<double>(dc, a, db, m, n, k, batch);
}
