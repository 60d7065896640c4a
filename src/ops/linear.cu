// nn.linear on the GPU: y[r, j] = sum_k x[r, k] w[j, k] + b[j], through the tiled GEMM. The
// 16-bit entries keep x, w, b and y in kg_f16 / kg_bf16 and sum in float (gemm.cuh). A module
// with a fused epilogue (kg.fused_gemm) defines KG_FUSED_MODULE, drops these entries and calls
// kg_linear with its epilogue functor: y[i] = epi(sum + b, i).
#include "gemm.cuh"

template <class T, class Epi = KgGemmPlain>
__device__ void kg_linear(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                          T* __restrict__ y, long long rows, long long in, long long out, Epi epi = Epi()) {
  KgGemmArgs<T> p;
  p.a = x;
  p.b = w;
  p.c = y;
  p.bias = bias;
  p.m = rows;
  p.n = out;
  p.k = in;
  p.sam = in;
  p.sak = 1;
  p.sbk = 1;   // B(k, n) = w[n, k]
  p.sbn = in;
  p.scm = out;
  p.batch_a = p.batch_b = p.batch_c = 0;
  kg_gemm_tile<T>(p, epi);
}

#ifndef KG_FUSED_MODULE

extern "C" __global__ void __launch_bounds__(KG_GEMM_THREADS)
    kg_linear_f32(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
                  float* __restrict__ y, long long rows, long long in, long long out) {
  kg_linear<float>(x, w, bias, y, rows, in, out);
}

extern "C" __global__ void __launch_bounds__(KG_GEMM_THREADS)
    kg_linear_f64(const double* __restrict__ x, const double* __restrict__ w, const double* __restrict__ bias,
                  double* __restrict__ y, long long rows, long long in, long long out) {
  kg_linear<double>(x, w, bias, y, rows, in, out);
}

extern "C" __global__ void __launch_bounds__(KG_GEMM_THREADS)
    kg_linear_f16(const kg_f16* __restrict__ x, const kg_f16* __restrict__ w, const kg_f16* __restrict__ bias,
                  kg_f16* __restrict__ y, long long rows, long long in, long long out) {
  kg_linear<kg_f16>(x, w, bias, y, rows, in, out);
}

extern "C" __global__ void __launch_bounds__(KG_GEMM_THREADS)
    kg_linear_bf16(const kg_bf16* __restrict__ x, const kg_bf16* __restrict__ w, const kg_bf16* __restrict__ bias,
                   kg_bf16* __restrict__ y, long long rows, long long in, long long out) {
  kg_linear<kg_bf16>(x, w, bias, y, rows, in, out);
}
#endif  // KG_FUSED_MODULE
