#include "models/cpu/gemm.hpp"

#include <blis.h>

namespace moevement::models::cpu {

void sgemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
           const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
           std::int64_t ldc) {
  // BLIS takes general strides, so row-major needs no transposition trick: (row stride, 1).
  // BLIS's C API is not const-correct; it does not write through a or b.
  bli_sgemm(trans_a ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE,
            trans_b ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE, m, n, k, &alpha, const_cast<float*>(a),
            lda, 1, const_cast<float*>(b), ldb, 1, &beta, c, ldc, 1);
}

void sgemm_reference(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                     float alpha, const float* a, std::int64_t lda, const float* b,
                     std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double acc = 0.0;
      for (std::int64_t p = 0; p < k; ++p) {
        const double av = trans_a ? a[p * lda + i] : a[i * lda + p];
        const double bv = trans_b ? b[j * ldb + p] : b[p * ldb + j];
        acc += av * bv;
      }
      const double prior = beta == 0.0f ? 0.0 : double(beta) * c[i * ldc + j];
      c[i * ldc + j] = static_cast<float>(double(alpha) * acc + prior);
    }
  }
}

void set_gemm_threads(int threads) {
  bli_thread_set_num_threads(threads);
}

}  // namespace moevement::models::cpu
