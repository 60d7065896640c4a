#include "ops/blas.hpp"

#include <cblas.h>

#include "kg/error.hpp"
#include "ops/op_util.hpp"
#include "util/str.hpp"

#if KG_HAVE_DNNL
#include <oneapi/dnnl/dnnl.h>
#endif

namespace kg::ops {

void gemm(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
          std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
#if KG_HAVE_DNNL
  // oneDNN's GEMM: its AVX-512 kernels are chosen by the CPU alone, and it runs on the same
  // OpenMP threads as its convolutions (OpenBLAS keeps its own pool, and Debian's picks its
  // kernels from OPENBLAS_CORETYPE). It returns an error only for invalid arguments.
  if (dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) == dnnl_success) return;
#endif
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

void gemm(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, double alpha, const double* a,
          std::int64_t lda, const double* b, std::int64_t ldb, double beta, double* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

DType gemm_dtype(const std::vector<DType>& in) {
  for (DType t : in)
    if (!is_floating(t))
      throw Error(util::cat("supports f32 and f64 inputs (and f16, bf16 summed in f32), got ", dtype_name(t)));
  return require_float_or_half(in);
}

void require_gemm_backward(const std::string& op, DType dtype) {
  if (!is_half_float(dtype)) return;
  throw Error(util::cat(op, " computes in ", dtype_name(dtype),
                        " for inference only: it has no backward in that dtype, so a model that trains "
                        "through it must keep it in f32 (or f64)"));
}

}  // namespace kg::ops
