// The backward of nn.linear (y = x Wᵀ + b over the last dim, x seen as [rows, in]) on the GPU:
//
// - input:  dx = dy W, the tiled GEMM with m = rows, n = in, k = out;
// - weight: dW = dyᵀ x, the tiled GEMM with m = out, n = in and the rows as its reduction;
// - bias:   db[j] = sum over rows of dy[r, j], one block per column and a block reduction.
//
// Each output element is summed by one thread (or one block) in a fixed order: runs repeat
// bitwise. A kernel whose gradient is not wanted (a null pointer) returns at once.
#include "gemm.cuh"
#include "reduce.cuh"

template <class T>
__device__ __forceinline__ void kg_linear_backward_input(const T* __restrict__ dy, const T* __restrict__ w,
                                                         T* __restrict__ dx, long long rows, long long in,
                                                         long long out) {
  if (!dx) return;
  KgGemmArgs<T> p;
  p.a = dy;  // A(r, j) = dy[r, j]
  p.b = w;   // B(j, i) = w[j, i]
  p.c = dx;
  p.bias = 0;
  p.m = rows;
  p.n = in;
  p.k = out;
  p.sam = out;
  p.sak = 1;
  p.sbk = in;
  p.sbn = 1;
  p.scm = in;
  p.batch_a = p.batch_b = p.batch_c = 0;
  kg_gemm_grid<T>(p, 1);
}

template <class T>
__device__ __forceinline__ void kg_linear_backward_weight(const T* __restrict__ x, const T* __restrict__ dy,
                                                          T* __restrict__ dw, long long rows, long long in,
                                                          long long out) {
  if (!dw) return;
  KgGemmArgs<T> p;
  p.a = dy;  // A(j, r) = dy[r, j]
  p.b = x;   // B(r, i) = x[r, i]
  p.c = dw;
  p.bias = 0;
  p.m = out;
  p.n = in;
  p.k = rows;
  p.sam = 1;
  p.sak = out;
  p.sbk = in;
  p.sbn = 1;
  p.scm = in;
  p.batch_a = p.batch_b = p.batch_c = 0;
  kg_gemm_grid<T>(p, 1);
}

template <class T>
__device__ __forceinline__ void kg_linear_backward_bias(const T* __restrict__ dy, T* __restrict__ db,
                                                        long long rows, long long out) {
  __shared__ T red[32];
  if (!db) return;
  for (long long j = blockIdx.x; j < out; j += gridDim.x) {
    T acc = T(0);
    for (long long r = threadIdx.x; r < rows; r += blockDim.x) acc += dy[r * out + j];
    acc = kg_block_sum(acc, red);
    if (threadIdx.x == 0) db[j] = acc;
  }
}

// ---- entries ----

extern "C" __global__ void __launch_bounds__(KG_GEMM_THREADS)
    kg_linear_backward_input_f32(const float* __restrict__ dy, const float* __restrict__ w, float* __restrict__ dx,
                                 long long rows, long long in, long long out) {
  kg_linear_backward_input<float>(dy, w, dx, rows, in, out);
}
extern "C" __global__ void __launch_bounds__(KG_GEMM_THREADS)
    kg_linear_backward_input_f64(const double* __restrict__ dy, const double* __restrict__ w,
                                 double* __restrict__ dx, long long rows, long long in, long long out) {
  kg_linear_backward_input<double>(dy, w, dx, rows, in, out);
}

extern "C" __global__ void __launch_bounds__(KG_GEMM_THREADS)
    kg_linear_backward_weight_f32(const float* __restrict__ x, const float* __restrict__ dy,
                                  float* __restrict__ dw, long long rows, long long in, long long out) {
  kg_linear_backward_weight<float>(x, dy, dw, rows, in, out);
}
extern "C" __global__ void __launch_bounds__(KG_GEMM_THREADS)
    kg_linear_backward_weight_f64(const double* __restrict__ x, const double* __restrict__ dy,
                                  double* __restrict__ dw, long long rows, long long in, long long out) {
  kg_linear_backward_weight<double>(x, dy, dw, rows, in, out);
}

extern "C" __global__ void __launch_bounds__(KG_GEMM_THREADS)
    kg_linear_backward_bias_f32(const float* __restrict__ dy, float* __restrict__ db, long long rows,
                                long long out) {
  kg_linear_backward_bias<float>(dy, db, rows, out);
}
extern "C" __global__ void __launch_bounds__(KG_GEMM_THREADS)
    kg_linear_backward_bias_f64(const double* __restrict__ dy, double* __restrict__ db, long long rows,
                                long long out) {
  kg_linear_backward_bias<double>(dy, db, rows, out);
}
