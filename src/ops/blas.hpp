// Row-major GEMM: float through oneDNN when the build has it (else OpenBLAS), double through
// OpenBLAS.
#pragma once

#include <cstdint>

namespace kg::ops {

// C[M,N] = alpha * op(A)[M,K] * op(B)[K,N] + beta * C, row-major with leading dims lda, ldb, ldc.
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
          std::int64_t ldc);
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, double alpha,
          const double* a, std::int64_t lda, const double* b, std::int64_t ldb, double beta,
          double* c, std::int64_t ldc);

}  // namespace kg::ops
