// nn.matmul on the GPU: C[z] = A[z'] B[z''] for every output batch entry z through the tiled
// GEMM, where z' and z'' are the operands' batch entries under broadcasting. The batch index is
// split over up to KG_MATMUL_MAX_LEVELS broadcast levels (adjacent dims that broadcast alike are
// merged on the host), each with its size and the element strides of A and B (0 where that
// operand is broadcast). Grid: x over n tiles, y over m tiles, z over batch entries; y and z are
// capped (65535) and the kernel loops over the rest. KgMatmulBatch is matmul_shared.cuh's. The
// 16-bit entries keep A, B and C in kg_f16 / kg_bf16 and sum in float (gemm.cuh). A module with a
// fused epilogue (kg.fused_gemm) defines KG_FUSED_MODULE, drops these entries and calls kg_matmul
// with its epilogue functor: C[i] = epi(sum, i), i the element's index in the whole output.
#include "gemm.cuh"
#include "matmul_shared.cuh"

template <class T, class Epi = KgGemmPlain>
__device__ __forceinline__ void kg_matmul(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c,
                                          long long m, long long n, long long k, long long sam, long long sak,
                                          long long sbk, long long sbn, const KgMatmulBatch& batch,
                                          Epi epi = Epi()) {
  for (kg_index z = blockIdx.z; z < batch.batches; z += gridDim.z) {
    kg_index oa = 0, ob = 0, rem = z;
    for (int l = (int)batch.levels - 1; l >= 0; --l) {
      const kg_index q = rem / batch.size[l];
      const kg_index i = rem - q * batch.size[l];
      oa += i * batch.stride_a[l];
      ob += i * batch.stride_b[l];
      rem = q;
    }
    // Rows beyond gridDim.y tiles are taken in further passes.
    for (kg_index m0 = 0; m0 < m; m0 += (kg_index)gridDim.y * KG_GEMM_BM) {
      KgGemmArgs<T> p;
      p.a = a + oa + m0 * sam;
      p.b = b + ob;
      p.c = c + z * m * n + m0 * n;
      p.bias = 0;
      p.m = m - m0;
      p.n = n;
      p.k = k;
      p.sam = sam;
      p.sak = sak;
      p.sbk = sbk;
      p.sbn = sbn;
      p.scm = n;
      p.batch_a = p.batch_b = p.batch_c = 0;
      kg_gemm_tile<T>(p, epi, z * m * n + m0 * n);
    }
  }
}

#ifndef KG_FUSED_MODULE

extern "C" __global__ void __launch_bounds__(KG_GEMM_THREADS)
    kg_matmul_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
                  long long m, long long n, long long k, long long sam, long long sak, long long sbk,
                  long long sbn, KgMatmulBatch batch) {
  kg_matmul<float>(a, b, c, m, n, k, sam, sak, sbk, sbn, batch);
}

extern "C" __global__ void __launch_bounds__(KG_GEMM_THREADS)
    kg_matmul_f64(const double* __restrict__ a, const double* __restrict__ b, double* __restrict__ c,
                  long long m, long long n, long long k, long long sam, long long sak, long long sbk,
                  long long sbn, KgMatmulBatch batch) {
  kg_matmul<double>(a, b, c, m, n, k, sam, sak, sbk, sbn, batch);
}

extern "C" __global__ void __launch_bounds__(KG_GEMM_THREADS)
    kg_matmul_f16(const kg_f16* __restrict__ a, const kg_f16* __restrict__ b, kg_f16* __restrict__ c,
                  long long m, long long n, long long k, long long sam, long long sak, long long sbk,
                  long long sbn, KgMatmulBatch batch) {
  kg_matmul<kg_f16>(a, b, c, m, n, k, sam, sak, sbk, sbn, batch);
}

extern "C" __global__ void __launch_bounds__(KG_GEMM_THREADS)
    kg_matmul_bf16(const kg_bf16* __restrict__ a, const kg_bf16* __restrict__ b, kg_bf16* __restrict__ c,
                   long long m, long long n, long long k, long long sam, long long sak, long long sbk,
                   long long sbn, KgMatmulBatch batch) {
  kg_matmul<kg_bf16>(a, b, c, m, n, k, sam, sak, sbk, sbn, batch);
}
#endif  // KG_FUSED_MODULE
