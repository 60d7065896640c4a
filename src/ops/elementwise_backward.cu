// The backward of the elementwise op family on the GPU (device code: elementwise.cuh). Each op's
// backward source (CustomOp::lower_backward_source) is this file, with KG_EW_ONE_ENTRY defined,
// followed by its one entry (kg_<op>_backward_f32 / _f64) calling an entry body of
// elementwise.cuh: ops/elementwise.cpp writes it. Compiled alone
// (kgraph compile --all), the file instantiates every entry.
#include "elementwise.cuh"

// ---- every entry, when the file is compiled alone ----
// The same entries ops/elementwise.cpp writes one at a time.
#ifndef KG_EW_ONE_ENTRY

// (The entry macros come first: the emulator's scan for kernels reads the text as written.)
#define KG_EW_ENTRY extern "C" __global__ void __launch_bounds__(KG_EW_THREADS)

#define KG_EW_GRAD_ENTRIES(name, body)                                                                 \
  KG_EW_ENTRY name##_f32(const float* __restrict__ s, const float* __restrict__ dy, float* __restrict__ dx, \
                         long long n, double param) {                                                 \
    body(s, dy, dx, n, param);                                                                        \
  }                                                                                                   \
  KG_EW_ENTRY name##_f64(const double* __restrict__ s, const double* __restrict__ dy,                   \
                         double* __restrict__ dx, long long n, double param) {                        \
    body(s, dy, dx, n, param);                                                                        \
  }

#define KG_EW_BINARY_GRAD_ENTRIES(name, F)                                                               \
  KG_EW_ENTRY name##_f32(const float* __restrict__ dy, const float* __restrict__ a,                      \
                         const float* __restrict__ b, float* __restrict__ g, float* __restrict__ partial, \
                         KgReduce p, int which, int phase) {                                             \
    kg_binary_backward_entry<F>(dy, a, b, g, partial, p, which, phase);                                  \
  }                                                                                                      \
  KG_EW_ENTRY name##_f64(const double* __restrict__ dy, const double* __restrict__ a,                    \
                         const double* __restrict__ b, double* __restrict__ g,                           \
                         double* __restrict__ partial, KgReduce p, int which, int phase) {               \
    kg_binary_backward_entry<F>(dy, a, b, g, partial, p, which, phase);                                  \
  }

KG_EW_GRAD_ENTRIES(kg_relu_backward, kg_unary_backward_entry<KG_RELU>)
KG_EW_GRAD_ENTRIES(kg_leaky_relu_backward, kg_unary_backward_entry<KG_LEAKY_RELU>)
KG_EW_GRAD_ENTRIES(kg_silu_backward, kg_unary_backward_entry<KG_SILU>)
KG_EW_GRAD_ENTRIES(kg_gelu_erf_backward, kg_unary_backward_entry<KG_GELU_ERF>)
KG_EW_GRAD_ENTRIES(kg_gelu_tanh_backward, kg_unary_backward_entry<KG_GELU_TANH>)
KG_EW_GRAD_ENTRIES(kg_sigmoid_backward, kg_unary_backward_entry<KG_SIGMOID>)
KG_EW_GRAD_ENTRIES(kg_tanh_backward, kg_unary_backward_entry<KG_TANH>)

#define KG_EW_SCALAR_GRAD_BODY(F, Reversed) kg_scalar_backward_entry<F, Reversed>
KG_EW_GRAD_ENTRIES(kg_add_scalar_backward, KG_EW_SCALAR_GRAD_BODY(KG_ADD, false))
KG_EW_GRAD_ENTRIES(kg_sub_scalar_backward, KG_EW_SCALAR_GRAD_BODY(KG_SUB, false))
KG_EW_GRAD_ENTRIES(kg_rsub_scalar_backward, KG_EW_SCALAR_GRAD_BODY(KG_SUB, true))
KG_EW_GRAD_ENTRIES(kg_mul_scalar_backward, KG_EW_SCALAR_GRAD_BODY(KG_MUL, false))
KG_EW_GRAD_ENTRIES(kg_div_scalar_backward, KG_EW_SCALAR_GRAD_BODY(KG_DIV, false))
KG_EW_GRAD_ENTRIES(kg_rdiv_scalar_backward, KG_EW_SCALAR_GRAD_BODY(KG_DIV, true))

KG_EW_ENTRY kg_dropout_backward_f32(const float* __restrict__ dy, float* __restrict__ dx, long long n,
                                    long long seed, long long threshold, double scale, int training) {
  kg_dropout_backward_entry(dy, dx, n, seed, threshold, scale, training);
}
KG_EW_ENTRY kg_dropout_backward_f64(const double* __restrict__ dy, double* __restrict__ dx, long long n,
                                    long long seed, long long threshold, double scale, int training) {
  kg_dropout_backward_entry(dy, dx, n, seed, threshold, scale, training);
}

KG_EW_BINARY_GRAD_ENTRIES(kg_add_backward, KG_ADD)
KG_EW_BINARY_GRAD_ENTRIES(kg_sub_backward, KG_SUB)
KG_EW_BINARY_GRAD_ENTRIES(kg_mul_backward, KG_MUL)
KG_EW_BINARY_GRAD_ENTRIES(kg_div_backward, KG_DIV)

#endif  // KG_EW_ONE_ENTRY
