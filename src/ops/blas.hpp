// Row-major GEMM: float through oneDNN when the build has it (else OpenBLAS), double through
// OpenBLAS. Also the dtype rules of the ops built on it (nn.linear, nn.matmul).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kg/dtype.hpp"

namespace kg::ops {

// C[M,N] = alpha * op(A)[M,K] * op(B)[K,N] + beta * C, row-major with leading dims lda, ldb, ldc.
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
          std::int64_t ldc);
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, double alpha,
          const double* a, std::int64_t lda, const double* b, std::int64_t ldb, double beta,
          double* c, std::int64_t ldc);

// The one dtype of a GEMM op's inputs: f32 or f64, or f16 or bf16 (stored 16-bit, summed in
// f32). Throws for any other dtype and for inputs of different dtypes.
DType gemm_dtype(const std::vector<DType>& in);

// Throws unless the GEMM op `op` (its name) has a backward in `dtype`: f32 and f64 do; the
// 16-bit dtypes are for inference only.
void require_gemm_backward(const std::string& op, DType dtype);

}  // namespace kg::ops
