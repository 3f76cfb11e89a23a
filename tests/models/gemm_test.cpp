#include "models/cpu/gemm.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace moevement::models::cpu {
namespace {

std::vector<float> random_matrix(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

struct shape {
  int m, n, k;
  bool ta, tb;
};

TEST(gemm, blis_matches_fp64_reference_for_all_transpositions) {
  for (const shape s : {shape{7, 5, 3, false, false}, shape{33, 17, 65, true, false},
                        shape{64, 48, 40, false, true}, shape{31, 29, 37, true, true}}) {
    const int lda = s.ta ? s.m : s.k, ldb = s.tb ? s.k : s.n;
    const auto a = random_matrix(std::size_t(s.m) * s.k, 1);
    const auto b = random_matrix(std::size_t(s.k) * s.n, 2);
    auto c_fast = random_matrix(std::size_t(s.m) * s.n, 3);
    auto c_ref = c_fast;
    sgemm(s.ta, s.tb, s.m, s.n, s.k, 0.5f, a.data(), lda, b.data(), ldb, 2.0f, c_fast.data(), s.n);
    sgemm_reference(s.ta, s.tb, s.m, s.n, s.k, 0.5f, a.data(), lda, b.data(), ldb, 2.0f,
                    c_ref.data(), s.n);
    for (std::size_t i = 0; i < c_fast.size(); ++i) {
      // fp32 accumulation of k terms of magnitude <= 1: error well under k * 2^-23.
      ASSERT_NEAR(c_fast[i], c_ref[i], 1e-5 * s.k) << "m=" << s.m << " index " << i;
    }
  }
}

TEST(gemm, identical_bits_for_two_calls_and_for_one_and_two_threads) {
  const int m = 192, n = 160, k = 224;
  const auto a = random_matrix(std::size_t(m) * k, 4);
  const auto b = random_matrix(std::size_t(k) * n, 5);
  std::vector<std::vector<float>> outs;
  for (int threads : {1, 1, 2, 2}) {
    set_gemm_threads(threads);
    std::vector<float> c(std::size_t(m) * n, 0.0f);
    sgemm(false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n);
    outs.push_back(std::move(c));
  }
  set_gemm_threads(1);
  for (std::size_t i = 1; i < outs.size(); ++i) {
    EXPECT_EQ(std::memcmp(outs[0].data(), outs[i].data(), outs[0].size() * sizeof(float)), 0)
        << "call " << i << " differs in its bits";
  }
}

}  // namespace
}  // namespace moevement::models::cpu
