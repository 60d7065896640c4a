// The loss family on the GPU: nn.cross_entropy (logits [N, C], integer labels [N]) and
// nn.mse_loss (two tensors of one shape), both to a scalar mean. The forward kernels run as one
// block of KG_LOSS_THREADS threads that reduces in a fixed order (no atomics: the loss is the
// same bit for bit on every run); the backward kernels are grid-stride maps.
//
// A label outside [0, C) cannot raise an error inside a kernel: its row's loss is NaN, so the
// batch's loss is NaN, and the backward writes NaN into that row's gradient. The CPU
// implementation raises an error naming the row and the label instead.
#include "loss_shared.cuh"
#include "reduce.cuh"

__device__ __forceinline__ float kg_loss_exp(float v) { return expf(v); }
__device__ __forceinline__ double kg_loss_exp(double v) { return exp(v); }
__device__ __forceinline__ float kg_loss_log(float v) { return logf(v); }
__device__ __forceinline__ double kg_loss_log(double v) { return log(v); }
template <class T>
__device__ __forceinline__ T kg_loss_nan();
template <>
__device__ __forceinline__ float kg_loss_nan<float>() {
  return __int_as_float(0x7fc00000);
}
template <>
__device__ __forceinline__ double kg_loss_nan<double>() {
  return __longlong_as_double(0x7ff8000000000000ULL);
}

// Row r's maximum and sum of exp(x - max) over its C logits, reduced over the warp's 32 lanes
// (every lane gets both).
template <class T>
__device__ __forceinline__ void kg_ce_row_stats(const T* __restrict__ row, kg_index c, int lane, T& m, T& s) {
  m = kg_neg_inf<T>();
  for (kg_index j = lane; j < c; j += 32) m = fmax(m, row[j]);
  m = kg_warp_max(m);
  if (m == kg_neg_inf<T>()) m = T(0);  // a row of -inf
  s = T(0);
  for (kg_index j = lane; j < c; j += 32) s += kg_loss_exp(row[j] - m);
  s = kg_warp_sum(s);
}

// loss = mean over rows of logsumexp(x_r) - x_r[label_r]: one warp per row, rows strided over
// the block's warps; each warp's lane 0 sums its rows' losses, then the block sums the warps.
template <class T, class L>
__device__ __forceinline__ void kg_cross_entropy(const T* __restrict__ logits, const L* __restrict__ labels,
                                                 T* __restrict__ loss, kg_index n, kg_index c) {
  __shared__ T smem[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = KG_LOSS_THREADS / 32;
  T acc = T(0);
  for (kg_index r = warp; r < n; r += warps) {
    const T* row = logits + r * c;
    T m, s;
    kg_ce_row_stats(row, c, lane, m, s);
    const long long label = (long long)labels[r];
    const T picked = label >= 0 && label < c ? row[label] : kg_loss_nan<T>();
    if (lane == 0) acc += (m + kg_loss_log(s)) - picked;
  }
  acc = kg_block_sum(acc, smem);
  if (threadIdx.x == 0) loss[0] = acc / T(n);  // N = 0: 0/0, NaN (as PyTorch's mean)
}

// dlogits[r, j] = dloss / N * (softmax(x_r)_j - [j == label_r]): one warp per row, rows
// grid-strided over the warps of the grid.
template <class T, class L>
__device__ __forceinline__ void kg_cross_entropy_backward(const T* __restrict__ logits,
                                                          const L* __restrict__ labels,
                                                          const T* __restrict__ dloss, T* __restrict__ dlogits,
                                                          kg_index n, kg_index c) {
  if (!dlogits) return;
  const int lane = threadIdx.x & 31;
  const kg_index warps = (kg_index)gridDim.x * (blockDim.x >> 5);
  const T scale = dloss[0] / T(n);
  for (kg_index r = (kg_index)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < n; r += warps) {
    const T* row = logits + r * c;
    T* drow = dlogits + r * c;
    T m, s;
    kg_ce_row_stats(row, c, lane, m, s);
    const long long label = (long long)labels[r];
    const bool valid = label >= 0 && label < c;
    const T inv = T(1) / s;
    for (kg_index j = lane; j < c; j += 32) {
      const T p = kg_loss_exp(row[j] - m) * inv;
      drow[j] = valid ? scale * (p - (j == label ? T(1) : T(0))) : kg_loss_nan<T>();
    }
  }
}

// loss = mean((p - t)^2): the block's threads stride over the elements, then a block sum.
template <class T>
__device__ __forceinline__ void kg_mse_loss(const T* __restrict__ p, const T* __restrict__ t, T* __restrict__ loss,
                                            kg_index n) {
  __shared__ T smem[32];
  T acc = T(0);
  for (kg_index i = threadIdx.x; i < n; i += KG_LOSS_THREADS) {
    const T d = p[i] - t[i];
    acc += d * d;
  }
  acc = kg_block_sum(acc, smem);
  if (threadIdx.x == 0) loss[0] = acc / T(n);
}

// dp = 2 (p - t) dloss / n, dt = -dp; either may be absent (null).
template <class T>
__device__ __forceinline__ void kg_mse_loss_backward(const T* __restrict__ p, const T* __restrict__ t,
                                                     const T* __restrict__ dloss, T* __restrict__ dp,
                                                     T* __restrict__ dt, kg_index n) {
  const T scale = T(2) * dloss[0] / T(n);
  for (kg_index i = kg_thread_index(); i < n; i += kg_grid_stride()) {
    const T g = scale * (p[i] - t[i]);
    if (dp) dp[i] = g;
    if (dt) dt[i] = -g;
  }
}

// ---- entries: f32 and f64; labels i32 and i64 ----

extern "C" __global__ void __launch_bounds__(KG_LOSS_THREADS)
    kg_cross_entropy_f32_i32(const float* __restrict__ logits, const int* __restrict__ labels, float* __restrict__ loss,
                            long long n, long long c) {
  kg_cross_entropy<float, int>(logits, labels, loss, n, c);
}

extern "C" __global__ void __launch_bounds__(KG_LOSS_THREADS)
    kg_cross_entropy_backward_f32_i32(const float* __restrict__ logits, const int* __restrict__ labels,
                                     const float* __restrict__ dloss, float* __restrict__ dlogits, long long n,
                                     long long c) {
  kg_cross_entropy_backward<float, int>(logits, labels, dloss, dlogits, n, c);
}

extern "C" __global__ void __launch_bounds__(KG_LOSS_THREADS)
    kg_cross_entropy_f32_i64(const float* __restrict__ logits, const long long* __restrict__ labels, float* __restrict__ loss,
                            long long n, long long c) {
  kg_cross_entropy<float, long long>(logits, labels, loss, n, c);
}

extern "C" __global__ void __launch_bounds__(KG_LOSS_THREADS)
    kg_cross_entropy_backward_f32_i64(const float* __restrict__ logits, const long long* __restrict__ labels,
                                     const float* __restrict__ dloss, float* __restrict__ dlogits, long long n,
                                     long long c) {
  kg_cross_entropy_backward<float, long long>(logits, labels, dloss, dlogits, n, c);
}

extern "C" __global__ void __launch_bounds__(KG_LOSS_THREADS)
    kg_cross_entropy_f64_i32(const double* __restrict__ logits, const int* __restrict__ labels, double* __restrict__ loss,
                            long long n, long long c) {
  kg_cross_entropy<double, int>(logits, labels, loss, n, c);
}

extern "C" __global__ void __launch_bounds__(KG_LOSS_THREADS)
    kg_cross_entropy_backward_f64_i32(const double* __restrict__ logits, const int* __restrict__ labels,
                                     const double* __restrict__ dloss, double* __restrict__ dlogits, long long n,
                                     long long c) {
  kg_cross_entropy_backward<double, int>(logits, labels, dloss, dlogits, n, c);
}

extern "C" __global__ void __launch_bounds__(KG_LOSS_THREADS)
    kg_cross_entropy_f64_i64(const double* __restrict__ logits, const long long* __restrict__ labels, double* __restrict__ loss,
                            long long n, long long c) {
  kg_cross_entropy<double, long long>(logits, labels, loss, n, c);
}

extern "C" __global__ void __launch_bounds__(KG_LOSS_THREADS)
    kg_cross_entropy_backward_f64_i64(const double* __restrict__ logits, const long long* __restrict__ labels,
                                     const double* __restrict__ dloss, double* __restrict__ dlogits, long long n,
                                     long long c) {
  kg_cross_entropy_backward<double, long long>(logits, labels, dloss, dlogits, n, c);
}

extern "C" __global__ void __launch_bounds__(KG_LOSS_THREADS)
    kg_mse_loss_f32(const float* __restrict__ p, const float* __restrict__ t, float* __restrict__ loss, long long n) {
  kg_mse_loss<float>(p, t, loss, n);
}

extern "C" __global__ void __launch_bounds__(KG_LOSS_THREADS)
    kg_mse_loss_backward_f32(const float* __restrict__ p, const float* __restrict__ t, const float* __restrict__ dloss,
                           float* __restrict__ dp, float* __restrict__ dt, long long n) {
  kg_mse_loss_backward<float>(p, t, dloss, dp, dt, n);
}

extern "C" __global__ void __launch_bounds__(KG_LOSS_THREADS)
    kg_mse_loss_f64(const double* __restrict__ p, const double* __restrict__ t, double* __restrict__ loss, long long n) {
  kg_mse_loss<double>(p, t, loss, n);
}

extern "C" __global__ void __launch_bounds__(KG_LOSS_THREADS)
    kg_mse_loss_backward_f64(const double* __restrict__ p, const double* __restrict__ t, const double* __restrict__ dloss,
                           double* __restrict__ dp, double* __restrict__ dt, long long n) {
  kg_mse_loss_backward<double>(p, t, dloss, dp, dt, n);
}
