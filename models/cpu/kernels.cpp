#include "models/cpu/kernels.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include <immintrin.h>

#include "models/cpu/gemm.hpp"

namespace moevement::models::cpu {

void matmul_forward(float* out, const float* x, const float* w, int n, int in, int out_dim) {
  if (n == 0) return;
  sgemm(false, false, n, out_dim, in, 1.0f, x, in, w, out_dim, 0.0f, out, out_dim);
}

void matmul_backward(float* dx, float* dw, const float* dout, const float* x, const float* w, int n,
                     int in, int out_dim) {
  if (n == 0) return;
  if (dx != nullptr)
    sgemm(false, true, n, in, out_dim, 1.0f, dout, out_dim, w, out_dim, 0.0f, dx, in);
  if (dw != nullptr)
    sgemm(true, false, in, out_dim, n, 1.0f, x, in, dout, out_dim, 1.0f, dw, out_dim);
}

void embedding_forward(float* out, const std::int32_t* tokens, const float* wte, const float* wpe,
                       int b, int t, int c) {
  for (int i = 0; i < b; ++i) {
    for (int j = 0; j < t; ++j) {
      float* o = out + (std::int64_t(i) * t + j) * c;
      const float* e = wte + std::int64_t(tokens[i * t + j]) * c;
      const float* p = wpe + std::int64_t(j) * c;
      for (int x = 0; x < c; ++x) o[x] = e[x] + p[x];
    }
  }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const std::int32_t* tokens,
                        int b, int t, int c) {
  for (int i = 0; i < b; ++i) {
    for (int j = 0; j < t; ++j) {
      const float* d = dout + (std::int64_t(i) * t + j) * c;
      if (dwte != nullptr) {
        float* e = dwte + std::int64_t(tokens[i * t + j]) * c;
        for (int x = 0; x < c; ++x) e[x] += d[x];
      }
      if (dwpe != nullptr) {
        float* p = dwpe + std::int64_t(j) * c;
        for (int x = 0; x < c; ++x) p[x] += d[x];
      }
    }
  }
}

void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int n, int c) {
  for (int i = 0; i < n; ++i) {
    const float* xi = x + std::int64_t(i) * c;
    double ss = 0.0;  // one sequential fp64 sum per row: order fixed, accurate
    for (int j = 0; j < c; ++j) ss += double(xi[j]) * xi[j];
    const float r = static_cast<float>(1.0 / std::sqrt(ss / c + rmsnorm_eps));
    rstd[i] = r;
    float* oi = out + std::int64_t(i) * c;
    for (int j = 0; j < c; ++j) oi[j] = (xi[j] * r) * w[j];
  }
}

void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w,
                      const float* rstd, int n, int c) {
  for (int i = 0; i < n; ++i) {
    const float* xi = x + std::int64_t(i) * c;
    const float* di = dout + std::int64_t(i) * c;
    const float r = rstd[i];
    // xhat = x * r; dxhat = dout * w; dx = r * (dxhat - xhat * mean(dxhat * xhat))
    double dot = 0.0;
    for (int j = 0; j < c; ++j) dot += double(di[j] * w[j]) * double(xi[j] * r);
    const float mean = static_cast<float>(dot / c);
    float* dxi = dx + std::int64_t(i) * c;
    for (int j = 0; j < c; ++j) {
      const float xhat = xi[j] * r;
      dxi[j] = r * (di[j] * w[j] - xhat * mean);
    }
    if (dw != nullptr) {
      for (int j = 0; j < c; ++j) dw[j] += di[j] * (xi[j] * r);
    }
  }
}

void attention_forward(float* y, float* att, const float* qkv, int b, int t, int c, int nh) {
  const int hs = c / nh;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int c3 = 3 * c;
  for (int i = 0; i < b; ++i) {
    const float* base = qkv + std::int64_t(i) * t * c3;
    for (int h = 0; h < nh; ++h) {
      const float* q = base + h * hs;
      const float* k = base + c + h * hs;
      const float* v = base + 2 * c + h * hs;
      float* a = att + (std::int64_t(i) * nh + h) * t * t;
      // scores [T,T] = scale * q k^T
      sgemm(false, true, t, t, hs, scale, q, c3, k, c3, 0.0f, a, t);
      for (int r = 0; r < t; ++r) {
        float* row = a + std::int64_t(r) * t;
        float mx = -std::numeric_limits<float>::infinity();
        for (int j = 0; j <= r; ++j) mx = std::max(mx, row[j]);
        double sum = 0.0;
        for (int j = 0; j <= r; ++j) {
          row[j] = std::exp(row[j] - mx);
          sum += row[j];
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (int j = 0; j <= r; ++j) row[j] *= inv;
        for (int j = r + 1; j < t; ++j) row[j] = 0.0f;
      }
      // y_h [T,hs] = att @ v
      sgemm(false, false, t, hs, t, 1.0f, a, t, v, c3, 0.0f, y + std::int64_t(i) * t * c + h * hs,
            c);
    }
  }
}

void attention_backward(float* dqkv, float* scratch, const float* dy, const float* att,
                        const float* qkv, int b, int t, int c, int nh) {
  const int hs = c / nh;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int c3 = 3 * c;
  for (int i = 0; i < b; ++i) {
    const float* base = qkv + std::int64_t(i) * t * c3;
    float* dbase = dqkv + std::int64_t(i) * t * c3;
    for (int h = 0; h < nh; ++h) {
      const float* q = base + h * hs;
      const float* k = base + c + h * hs;
      const float* v = base + 2 * c + h * hs;
      const float* a = att + (std::int64_t(i) * nh + h) * t * t;
      const float* dyh = dy + std::int64_t(i) * t * c + h * hs;
      // datt [T,T] = dy_h v^T ; dv [T,hs] = att^T dy_h
      sgemm(false, true, t, t, hs, 1.0f, dyh, c, v, c3, 0.0f, scratch, t);
      sgemm(true, false, t, hs, t, 1.0f, a, t, dyh, c, 0.0f, dbase + 2 * c + h * hs, c3);
      // softmax backward in place: ds = att * (datt - sum_j att*datt), causal part only
      for (int r = 0; r < t; ++r) {
        float* ds = scratch + std::int64_t(r) * t;
        const float* ar = a + std::int64_t(r) * t;
        double dot = 0.0;
        for (int j = 0; j <= r; ++j) dot += double(ar[j]) * ds[j];
        const float d = static_cast<float>(dot);
        for (int j = 0; j <= r; ++j) ds[j] = ar[j] * (ds[j] - d);
        for (int j = r + 1; j < t; ++j) ds[j] = 0.0f;
      }
      // dq = scale * ds k ; dk = scale * ds^T q
      sgemm(false, false, t, hs, t, scale, scratch, t, k, c3, 0.0f, dbase + h * hs, c3);
      sgemm(true, false, t, hs, t, scale, scratch, t, q, c3, 0.0f, dbase + c + h * hs, c3);
    }
  }
}

namespace {
constexpr float gelu_s = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float gelu_a = 0.044715f;

// exp(x) from + - * only (Cephes' expf: Cody-Waite reduction, degree-6 polynomial, ~1 ulp), so
// the bits depend on no libm. Inputs clamped to [-87, 88]. exp_poly8 is the same sequence of
// IEEE operations on 8 lanes (AVX2 is part of the fixed -march; no FMA is used), so a vector
// lane and the scalar tail give identical bits.
inline float exp_poly(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  // n = round(x / ln 2) by the 1.5 * 2^23 trick (|x / ln 2| < 2^22)
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = (y * (r * r) + r) + 1.0f;
  const auto bits = static_cast<std::uint32_t>(static_cast<std::int32_t>(n) + 127) << 23;
  return y * std::bit_cast<float>(bits);
}

inline __m256 exp_poly8(__m256 x) {
  const auto c = [](float v) { return _mm256_set1_ps(v); };
  x = _mm256_min_ps(_mm256_max_ps(x, c(-87.0f)), c(88.0f));
  const __m256 n = _mm256_sub_ps(
      _mm256_add_ps(_mm256_mul_ps(x, c(1.44269504088896341f)), c(12582912.0f)), c(12582912.0f));
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, c(0.693359375f))),
                                 _mm256_mul_ps(n, c(-2.12194440e-4f)));
  __m256 y = c(1.9875691500e-4f);
  y = _mm256_add_ps(_mm256_mul_ps(y, r), c(1.3981999507e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), c(8.3334519073e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), c(4.1665795894e-2f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), c(1.6666665459e-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), c(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(r, r)), r), c(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

inline float gelu1(float v) {
  const float u = gelu_s * (v + gelu_a * v * v * v);
  return v / (1.0f + exp_poly(-2.0f * u));
}
inline float gelu_grad1(float v, float d) {
  const float u = gelu_s * (v + gelu_a * v * v * v);
  const float s = 1.0f / (1.0f + exp_poly(-2.0f * u));
  const float du = gelu_s * (1.0f + 3.0f * gelu_a * v * v);
  return (s + 2.0f * v * s * (1.0f - s) * du) * d;
}
}  // namespace

// gelu(v) = 0.5 v (1 + tanh(u)) = v * sigmoid(2u),  u = sqrt(2/pi) (v + 0.044715 v^3)
void gelu_forward(float* out, const float* x, int n) {
  const __m256 s = _mm256_set1_ps(gelu_s), a = _mm256_set1_ps(gelu_a);
  const __m256 one = _mm256_set1_ps(1.0f), m2 = _mm256_set1_ps(-2.0f);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 v3 = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(a, v), v), v);
    const __m256 u = _mm256_mul_ps(s, _mm256_add_ps(v, v3));
    const __m256 e = exp_poly8(_mm256_mul_ps(m2, u));
    _mm256_storeu_ps(out + i, _mm256_div_ps(v, _mm256_add_ps(one, e)));
  }
  for (; i < n; ++i) out[i] = gelu1(x[i]);
}

// d gelu / dv = s + 2 v s (1 - s) du/dv,  s = sigmoid(2u)
void gelu_backward(float* dx, const float* dout, const float* x, int n) {
  const __m256 gs = _mm256_set1_ps(gelu_s), a = _mm256_set1_ps(gelu_a);
  const __m256 one = _mm256_set1_ps(1.0f), m2 = _mm256_set1_ps(-2.0f), two = _mm256_set1_ps(2.0f);
  const __m256 three_a = _mm256_set1_ps(3.0f * gelu_a);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 v3 = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(a, v), v), v);
    const __m256 u = _mm256_mul_ps(gs, _mm256_add_ps(v, v3));
    const __m256 sg = _mm256_div_ps(one, _mm256_add_ps(one, exp_poly8(_mm256_mul_ps(m2, u))));
    const __m256 du =
        _mm256_mul_ps(gs, _mm256_add_ps(one, _mm256_mul_ps(_mm256_mul_ps(three_a, v), v)));
    // (s + ((((2 v) s) (1 - s)) du)) d, the association order of gelu_grad1
    const __m256 t = _mm256_mul_ps(
        _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(two, v), sg), _mm256_sub_ps(one, sg)), du);
    _mm256_storeu_ps(dx + i, _mm256_mul_ps(_mm256_add_ps(sg, t), _mm256_loadu_ps(dout + i)));
  }
  for (; i < n; ++i) dx[i] = gelu_grad1(x[i], dout[i]);
}

void softmax_xent_forward(float* losses, float* probs, const float* logits,
                          const std::int32_t* targets, int n, int v) {
  for (int i = 0; i < n; ++i) {
    const float* l = logits + std::int64_t(i) * v;
    float* p = probs + std::int64_t(i) * v;
    float mx = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < v; ++j) mx = std::max(mx, l[j]);
    double sum = 0.0;
    for (int j = 0; j < v; ++j) {
      p[j] = std::exp(l[j] - mx);
      sum += p[j];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int j = 0; j < v; ++j) p[j] *= inv;
    // -log p[target] computed from the logits for accuracy: log(sum) + mx - l[target]
    losses[i] = static_cast<float>(std::log(sum) + mx - l[targets[i]]);
  }
}

void softmax_xent_backward(float* dlogits, const float* probs, const std::int32_t* targets,
                           float dloss, int n, int v) {
  for (int i = 0; i < n; ++i) {
    const float* p = probs + std::int64_t(i) * v;
    float* d = dlogits + std::int64_t(i) * v;
    for (int j = 0; j < v; ++j) d[j] = (p[j] - (j == targets[i] ? 1.0f : 0.0f)) * dloss;
  }
}

void gate_forward(routing& r, const float* logits, int n, int e, int k, double capacity_factor) {
  r.n = n;
  r.e = e;
  r.k = k;
  r.probs.resize(std::size_t(n) * e);
  r.expert.resize(std::size_t(n) * k);
  r.weight.resize(std::size_t(n) * k);
  r.row.resize(std::size_t(n) * k);
  r.routed.assign(e, 0);
  for (int i = 0; i < n; ++i) {
    const float* l = logits + std::int64_t(i) * e;
    float* p = r.probs.data() + std::int64_t(i) * e;
    float mx = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < e; ++j) mx = std::max(mx, l[j]);
    double sum = 0.0;
    for (int j = 0; j < e; ++j) {
      p[j] = std::exp(l[j] - mx);
      sum += p[j];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int j = 0; j < e; ++j) p[j] *= inv;
    // top-k by repeated selection: k is small; strict > keeps the lower index on ties
    std::int32_t* chosen = r.expert.data() + std::int64_t(i) * k;
    for (int s = 0; s < k; ++s) {
      int best = -1;
      for (int j = 0; j < e; ++j) {
        bool taken = false;
        for (int q = 0; q < s; ++q) taken = taken || chosen[q] == j;
        if (!taken && (best < 0 || p[j] > p[best])) best = j;
      }
      chosen[s] = best;
      r.weight[std::size_t(i) * k + s] = p[best];
      ++r.routed[best];
    }
  }
  // stable counting sort of the (token, slot) assignments by expert
  const std::int64_t cap =
      capacity_factor > 0.0
          ? static_cast<std::int64_t>(std::ceil(capacity_factor * double(n) * k / e))
          : std::numeric_limits<std::int64_t>::max();
  r.offsets.assign(e + 1, 0);
  for (int j = 0; j < e; ++j)
    r.offsets[j + 1] = r.offsets[j] + std::int32_t(std::min<std::int64_t>(r.routed[j], cap));
  r.token.resize(r.offsets[e]);
  std::vector<std::int32_t> fill(e, 0);
  for (int i = 0; i < n; ++i) {
    for (int s = 0; s < k; ++s) {
      const int x = r.expert[std::size_t(i) * k + s];
      if (fill[x] < cap) {
        const std::int32_t row = r.offsets[x] + fill[x]++;
        r.row[std::size_t(i) * k + s] = row;
        r.token[row] = i;
      } else {
        r.row[std::size_t(i) * k + s] = -1;
      }
    }
  }
  // aux = E * sum_e f_e P_e with f_e = routed_e / (N K), P_e = mean_n probs[n,e]
  double aux = 0.0;
  for (int j = 0; j < e; ++j) {
    double pe = 0.0;
    for (int i = 0; i < n; ++i) pe += r.probs[std::size_t(i) * e + j];
    aux += (double(r.routed[j]) / (double(n) * k)) * (pe / n);
  }
  r.aux_loss = static_cast<float>(aux * e);
}

void gate_backward(float* dlogits, const routing& r, const float* dweight, float daux) {
  const int n = r.n, e = r.e, k = r.k;
  std::vector<float> dp(e);
  std::vector<float> aux_grad(e);  // d aux / d probs[n,e] = E * f_e / N, times daux
  for (int j = 0; j < e; ++j) {
    aux_grad[j] =
        static_cast<float>(double(daux) * e * (double(r.routed[j]) / (double(n) * k)) / n);
  }
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < e; ++j) dp[j] = aux_grad[j];
    for (int s = 0; s < k; ++s) {
      const std::size_t a = std::size_t(i) * k + s;
      dp[r.expert[a]] += dweight[a];
    }
    const float* p = r.probs.data() + std::int64_t(i) * e;
    double dot = 0.0;
    for (int j = 0; j < e; ++j) dot += double(p[j]) * dp[j];
    const float d = static_cast<float>(dot);
    float* dl = dlogits + std::int64_t(i) * e;
    for (int j = 0; j < e; ++j) dl[j] = p[j] * (dp[j] - d);
  }
}

void moe_gather(float* xs, const float* x, const routing& r, int c) {
  for (int row = 0; row < r.rows(); ++row) {
    std::memcpy(xs + std::int64_t(row) * c, x + std::int64_t(r.token[row]) * c, sizeof(float) * c);
  }
}

void moe_combine_forward(float* out, const float* ye, const routing& r, int c) {
  for (int i = 0; i < r.n; ++i) {
    float* o = out + std::int64_t(i) * c;
    for (int x = 0; x < c; ++x) o[x] = 0.0f;
    for (int s = 0; s < r.k; ++s) {
      const std::size_t a = std::size_t(i) * r.k + s;
      if (r.row[a] < 0) continue;
      const float w = r.weight[a];
      const float* y = ye + std::int64_t(r.row[a]) * c;
      for (int x = 0; x < c; ++x) o[x] += w * y[x];
    }
  }
}

void moe_combine_backward(float* dye, float* dweight, const float* dout, const float* ye,
                          const routing& r, int c) {
  for (int i = 0; i < r.n; ++i) {
    const float* d = dout + std::int64_t(i) * c;
    for (int s = 0; s < r.k; ++s) {
      const std::size_t a = std::size_t(i) * r.k + s;
      if (r.row[a] < 0) {
        dweight[a] = 0.0f;
        continue;
      }
      const float w = r.weight[a];
      const float* y = ye + std::int64_t(r.row[a]) * c;
      float* dy = dye + std::int64_t(r.row[a]) * c;
      double dot = 0.0;
      for (int x = 0; x < c; ++x) {
        dy[x] = w * d[x];
        dot += double(d[x]) * y[x];
      }
      dweight[a] = static_cast<float>(dot);
    }
  }
}

void moe_scatter_add(float* dx, const float* dxs, const routing& r, int c) {
  for (int i = 0; i < r.n; ++i) {
    float* d = dx + std::int64_t(i) * c;
    for (int s = 0; s < r.k; ++s) {
      const std::int32_t row = r.row[std::size_t(i) * r.k + s];
      if (row < 0) continue;
      const float* g = dxs + std::int64_t(row) * c;
      for (int x = 0; x < c; ++x) d[x] += g[x];
    }
  }
}

}  // namespace moevement::models::cpu
