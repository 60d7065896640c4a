// nn.constant: copies the parameter into the output (the output buffer is the runtime's), and
// back for the gradient, in 8-, 4- or 1-byte words, whichever divides the size.
#define KG_CONSTANT_THREADS 256

template <class T>
__device__ void kg_constant_copy(const T* __restrict__ src, T* __restrict__ dst, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = src[i];
}

extern "C" __global__ void __launch_bounds__(KG_CONSTANT_THREADS)
    kg_constant_copy_u8(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst, long long n) {
  kg_constant_copy(src, dst, n);
}
extern "C" __global__ void __launch_bounds__(KG_CONSTANT_THREADS)
    kg_constant_copy_u32(const unsigned int* __restrict__ src, unsigned int* __restrict__ dst, long long n) {
  kg_constant_copy(src, dst, n);
}
extern "C" __global__ void __launch_bounds__(KG_CONSTANT_THREADS)
    kg_constant_copy_u64(const unsigned long long* __restrict__ src, unsigned long long* __restrict__ dst, long long n) {
  kg_constant_copy(src, dst, n);
}
