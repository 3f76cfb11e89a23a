#include "models/operator_state.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include <immintrin.h>

#include "base/hash.hpp"
#include "models/rng.hpp"

namespace moevement::models {

std::string_view op_kind_name(op_kind k) {
  switch (k) {
    case op_kind::embedding:
      return "embedding";
    case op_kind::norm:
      return "norm";
    case op_kind::attention:
      return "attention";
    case op_kind::gate:
      return "gate";
    case op_kind::expert:
      return "expert";
    case op_kind::head:
      return "head";
  }
  return "?";
}

operator_state::operator_state(std::string name, op_kind kind, std::vector<param_spec> params,
                               dtype compute, bool allocate)
    : name_(std::move(name)), kind_(kind), dtype_(compute), params_(std::move(params)) {
  offsets_.push_back(0);
  for (const auto& p : params_) {
    std::int64_t n = 1;
    for (const auto d : p.shape) n *= d;
    numel_ += n;
    offsets_.push_back(numel_);
  }
  allocated_ = allocate;
  if (!allocate) return;
  const auto n = static_cast<std::size_t>(numel_);
  master_.assign(n, 0.0f);
  m_.assign(n, 0.0f);
  v_.assign(n, 0.0f);
  grad_.assign(n, 0.0f);
  expanded_.assign(n, 0.0f);
  compute_.assign(n * dtype_size(dtype_), std::byte{0});
}

void operator_state::init(std::uint64_t seed, std::uint64_t op_index) {
  for (std::size_t p = 0; p < params_.size(); ++p) {
    const auto key = make_key({seed, 0x696e6974 /*"init"*/, op_index, p});
    for (std::int64_t j = offsets_[p]; j < offsets_[p + 1]; ++j) {
      master_[j] = params_[p].init_std == 0.0f
                       ? params_[p].init_value
                       : static_cast<float>(params_[p].init_std *
                                            random_normal(key, std::uint64_t(j - offsets_[p])));
    }
  }
  std::fill(m_.begin(), m_.end(), 0.0f);
  std::fill(v_.begin(), v_.end(), 0.0f);
  step_ = 0;
  refresh_compute();
}

void operator_state::refresh_compute() {
  convert_from_f32(dtype_, master_, compute_);
  convert_to_f32(dtype_, compute_, expanded_);
}

void operator_state::set_compute_bytes(std::span<const std::byte> bytes) {
  if (bytes.size() != compute_.size()) {
    throw std::invalid_argument("operator " + name_ + ": compute weights of " +
                                std::to_string(bytes.size()) + " bytes, expected " +
                                std::to_string(compute_.size()));
  }
  std::copy(bytes.begin(), bytes.end(), compute_.begin());
  convert_to_f32(dtype_, compute_, expanded_);
}

void operator_state::set_mode(op_mode m) {
  if (m == mode_) return;
  mode_ = m;
  if (m == op_mode::active) refresh_compute();
  zero_grad();
}

void operator_state::zero_grad() {
  std::fill(grad_.begin(), grad_.end(), 0.0f);
}

double operator_state::grad_sq_sum() const {
  if (mode_ != op_mode::active) return 0.0;
  // Fixed order: 8 fp64 partial sums, element j going to partial j % 8 (in element order),
  // then the partials added 0..7, then the tail. One long dependency chain would be 8x slower.
  const float* g = grad_.data();
  const std::size_t n = grad_.size();
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  std::size_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_loadu_ps(g + j);
    const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    lo = _mm256_add_pd(lo, _mm256_mul_pd(a, a));
    hi = _mm256_add_pd(hi, _mm256_mul_pd(b, b));
  }
  double part[8];
  _mm256_storeu_pd(part, lo);
  _mm256_storeu_pd(part + 4, hi);
  double s = 0.0;
  for (const double p : part) s += p;
  for (; j < n; ++j) s += double(g[j]) * g[j];
  return s;
}

adamw_bias adamw_bias_corrections(const adamw_config& cfg, std::int64_t step) {
  return {static_cast<float>(1.0 - std::pow(double(cfg.beta1), double(step))),
          static_cast<float>(1.0 - std::pow(double(cfg.beta2), double(step)))};
}

void operator_state::adamw_step(const adamw_config& cfg, float grad_mul) {
  if (mode_ != op_mode::active) return;
  ++step_;
  const auto [bc1, bc2] = adamw_bias_corrections(cfg, step_);  // once per operator
  const float b1 = cfg.beta1, b2 = cfg.beta2, lr = cfg.lr, eps = cfg.eps;
  float* __restrict w = master_.data();
  float* __restrict m = m_.data();
  float* __restrict v = v_.data();
  const float* __restrict grad = grad_.data();
  const float one_b1 = 1.0f - b1, one_b2 = 1.0f - b2;
  for (std::size_t p = 0; p < params_.size(); ++p) {
    const float wd = params_[p].decay ? cfg.weight_decay : 0.0f;
    // Elementwise only (no reduction). The AVX2 lanes run the scalar tail's exact sequence of
    // IEEE operations (no FMA; sqrt and division are correctly rounded in both), so the bits do
    // not depend on where a parameter falls. std::sqrt alone would not vectorise (errno).
    std::int64_t j = offsets_[p];
    const std::int64_t end = offsets_[p + 1];
    const __m256 vmul = _mm256_set1_ps(grad_mul), vb1 = _mm256_set1_ps(b1),
                 vb2 = _mm256_set1_ps(b2), v1b1 = _mm256_set1_ps(one_b1),
                 v1b2 = _mm256_set1_ps(one_b2), vbc1 = _mm256_set1_ps(bc1),
                 vbc2 = _mm256_set1_ps(bc2), vlr = _mm256_set1_ps(lr), veps = _mm256_set1_ps(eps),
                 vwd = _mm256_set1_ps(wd);
    for (; j + 8 <= end; j += 8) {
      const __m256 g = _mm256_mul_ps(_mm256_loadu_ps(grad + j), vmul);
      const __m256 mj =
          _mm256_add_ps(_mm256_mul_ps(vb1, _mm256_loadu_ps(m + j)), _mm256_mul_ps(v1b1, g));
      const __m256 vj = _mm256_add_ps(_mm256_mul_ps(vb2, _mm256_loadu_ps(v + j)),
                                      _mm256_mul_ps(v1b2, _mm256_mul_ps(g, g)));
      _mm256_storeu_ps(m + j, mj);
      _mm256_storeu_ps(v + j, vj);
      const __m256 mhat = _mm256_div_ps(mj, vbc1);
      const __m256 vhat = _mm256_div_ps(vj, vbc2);
      const __m256 wj = _mm256_loadu_ps(w + j);
      const __m256 upd = _mm256_add_ps(
          _mm256_div_ps(mhat, _mm256_add_ps(_mm256_sqrt_ps(vhat), veps)), _mm256_mul_ps(vwd, wj));
      _mm256_storeu_ps(w + j, _mm256_sub_ps(wj, _mm256_mul_ps(vlr, upd)));
    }
    for (; j < end; ++j) {
      const float g = grad[j] * grad_mul;
      m[j] = b1 * m[j] + one_b1 * g;
      v[j] = b2 * v[j] + one_b2 * (g * g);
      const float mhat = m[j] / bc1;
      const float vhat = v[j] / bc2;
      w[j] = w[j] - lr * (mhat / (std::sqrt(vhat) + eps) + wd * w[j]);
    }
  }
  refresh_compute();
}

std::uint64_t operator_state::digest() const {
  hasher h;
  h.update(std::as_bytes(std::span<const float>(master_)));
  h.update(std::as_bytes(std::span<const float>(m_)));
  h.update(std::as_bytes(std::span<const float>(v_)));
  h.update_value(step_);
  return h.digest();
}

void operator_state::release() {
  for (auto* b : {&master_, &m_, &v_, &grad_, &expanded_}) std::vector<float>().swap(*b);
  std::vector<std::byte>().swap(compute_);
  allocated_ = false;
}

void operator_state::reset_popularity() {
  std::fill(routed_tokens_.begin(), routed_tokens_.end(), 0);
  std::fill(prob_sums_.begin(), prob_sums_.end(), 0.0);
}

}  // namespace moevement::models
