// The elementwise op family on the GPU: activations, dropout (a mask in training, a copy in
// inference), tensor ⊙ tensor with numpy broadcasting, and tensor ⊙ scalar. The device code is
// elementwise.cuh.
//
// Each op's kernel source is this file, with KG_EW_ONE_ENTRY defined, followed by its one entry
// (kg_<op>_f32 or kg_<op>_f64) calling one of the entry bodies of elementwise.cuh:
// ops/elementwise.cpp writes it. One entry per module keeps compiles, PTX checks and module loads
// to what a model uses. Compiled alone (kgraph compile --all), the file instantiates every entry.
// The backward entries are elementwise_backward.cu's, written the same way.
#include "elementwise.cuh"

// ---- every entry, when the file is compiled alone ----
// The same entries ops/elementwise.cpp writes one at a time.
#ifndef KG_EW_ONE_ENTRY

#define KG_EW_ENTRY extern "C" __global__ void __launch_bounds__(KG_EW_THREADS)

#define KG_EW_MAP_ENTRIES(name, body)                                                                  \
  KG_EW_ENTRY name##_f32(const float* __restrict__ x, float* __restrict__ y, long long n, double s) {  \
    body(x, y, n, s);                                                                                  \
  }                                                                                                    \
  KG_EW_ENTRY name##_f64(const double* __restrict__ x, double* __restrict__ y, long long n, double s) { \
    body(x, y, n, s);                                                                                  \
  }

#define KG_EW_BINARY_ENTRIES(name, F)                                                                    \
  KG_EW_ENTRY name##_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ y, \
                         long long n, KgBroadcast bc) {                                                  \
    kg_binary_entry<F>(a, b, y, n, bc);                                                                  \
  }                                                                                                      \
  KG_EW_ENTRY name##_f64(const double* __restrict__ a, const double* __restrict__ b,                     \
                         double* __restrict__ y, long long n, KgBroadcast bc) {                          \
    kg_binary_entry<F>(a, b, y, n, bc);                                                                  \
  }

KG_EW_MAP_ENTRIES(kg_relu, kg_unary_entry<KG_RELU>)
KG_EW_MAP_ENTRIES(kg_leaky_relu, kg_unary_entry<KG_LEAKY_RELU>)
KG_EW_MAP_ENTRIES(kg_silu, kg_unary_entry<KG_SILU>)
KG_EW_MAP_ENTRIES(kg_gelu_erf, kg_unary_entry<KG_GELU_ERF>)
KG_EW_MAP_ENTRIES(kg_gelu_tanh, kg_unary_entry<KG_GELU_TANH>)
KG_EW_MAP_ENTRIES(kg_sigmoid, kg_unary_entry<KG_SIGMOID>)
KG_EW_MAP_ENTRIES(kg_tanh, kg_unary_entry<KG_TANH>)

KG_EW_ENTRY kg_dropout_f32(const float* __restrict__ x, float* __restrict__ y, long long n, long long seed,
                           long long threshold, double scale, int training) {
  kg_dropout_entry(x, y, n, seed, threshold, scale, training);
}
KG_EW_ENTRY kg_dropout_f64(const double* __restrict__ x, double* __restrict__ y, long long n, long long seed,
                           long long threshold, double scale, int training) {
  kg_dropout_entry(x, y, n, seed, threshold, scale, training);
}

#define KG_EW_SCALAR_BODY(F, Reversed) kg_scalar_entry<F, Reversed>
KG_EW_MAP_ENTRIES(kg_add_scalar, KG_EW_SCALAR_BODY(KG_ADD, false))
KG_EW_MAP_ENTRIES(kg_sub_scalar, KG_EW_SCALAR_BODY(KG_SUB, false))
KG_EW_MAP_ENTRIES(kg_rsub_scalar, KG_EW_SCALAR_BODY(KG_SUB, true))
KG_EW_MAP_ENTRIES(kg_mul_scalar, KG_EW_SCALAR_BODY(KG_MUL, false))
KG_EW_MAP_ENTRIES(kg_div_scalar, KG_EW_SCALAR_BODY(KG_DIV, false))
KG_EW_MAP_ENTRIES(kg_rdiv_scalar, KG_EW_SCALAR_BODY(KG_DIV, true))

KG_EW_BINARY_ENTRIES(kg_add, KG_ADD)
KG_EW_BINARY_ENTRIES(kg_sub, KG_SUB)
KG_EW_BINARY_ENTRIES(kg_mul, KG_MUL)
KG_EW_BINARY_ENTRIES(kg_div, KG_DIV)

#endif  // KG_EW_ONE_ENTRY
