// Kernels of the training runtime: gradient sums, the loss seed, and optimiser updates with
// the arithmetic of src/runtime/optimizer.cpp. f32, grid-stride loops.

extern "C" __global__ void kg_fill_f32(float* p, float value, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    p[i] = value;
}

// dst += src
extern "C" __global__ void kg_add_f32(float* dst, const float* src, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] += src[i];
}

// SGD with L2 weight decay and optional momentum (buf null when momentum is 0; `first` on the
// first step, where the buffer takes the gradient as is).
extern "C" __global__ void kg_sgd_f32(float* p, const float* g, float* buf, float lr, float wd, float momentum,
                                      int first, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    float d = g[i] + wd * p[i];
    if (buf) {
      d = first ? d : momentum * buf[i] + d;
      buf[i] = d;
    }
    p[i] -= lr * d;
  }
}

// AdamW: decoupled weight decay, then the bias-corrected Adam update. c1 = 1 - beta1^t,
// c2 = sqrt(1 - beta2^t).
extern "C" __global__ void kg_adamw_f32(float* p, const float* g, float* m, float* v, float lr, float wd, float beta1,
                                        float beta2, float c1, float c2, float eps, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    float pi = p[i] - lr * wd * p[i];
    const float gi = g[i];
    const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
    const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi - lr * (mi / c1) / (sqrtf(vi) / c2 + eps);
  }
}
