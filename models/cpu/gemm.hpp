// GEMM on the CPU. The fast path is BLIS (bit-identical across thread counts on one CPU
// kind); the naive reference beside it accumulates in fp64 and is only for tests.
#pragma once

#include <cstdint>

namespace moevement::models::cpu {

// Row-major C[m,n] = alpha * op(A) * op(B) + beta * C, where op(A) is [m,k] and op(B) is
// [k,n]; trans_a means A is stored [k,m], trans_b means B is stored [n,k].
// lda/ldb/ldc are row strides in elements.
void sgemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
           const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
           std::int64_t ldc);

void sgemm_reference(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                     float alpha, const float* a, std::int64_t lda, const float* b,
                     std::int64_t ldb, float beta, float* c, std::int64_t ldc);

// Threads BLIS may use in this process (default 1: one per process, processes share cores).
void set_gemm_threads(int threads);

}  // namespace moevement::models::cpu
