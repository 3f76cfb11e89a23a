#include "models/cpu/kernels.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

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
}  // namespace

void gelu_forward(float* out, const float* x, int n) {
  for (int i = 0; i < n; ++i) {
    const float v = x[i];
    const float u = gelu_s * (v + gelu_a * v * v * v);
    out[i] = 0.5f * v * (1.0f + std::tanh(u));
  }
}

void gelu_backward(float* dx, const float* dout, const float* x, int n) {
  for (int i = 0; i < n; ++i) {
    const float v = x[i];
    const float u = gelu_s * (v + gelu_a * v * v * v);
    const float th = std::tanh(u);
    const float du = gelu_s * (1.0f + 3.0f * gelu_a * v * v);
    const float g = 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * du;
    dx[i] = g * dout[i];
  }
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
