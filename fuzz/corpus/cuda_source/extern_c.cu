// A kernel with C linkage, launch bounds, a struct parameter and comments in the signature.
struct Box { float x0, y0, x1, y1; };
template <int N> __global__ void templated(float* p) { p[N] = 0; }
extern "C" {
__global__ void __launch_bounds__(256, 2) decode(const float* /* raw */ in, Box* out,
                                                 unsigned long long n, double scale, char flag) {
  /* body */ if (threadIdx.x < n) out[threadIdx.x].x0 = in[0] * scale + flag;
}
}
__global__ void plain(int16_t a, uint8_t* b, const half* __restrict__ c) {}
