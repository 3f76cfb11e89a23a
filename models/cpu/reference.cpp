#include "models/cpu/reference.hpp"

#include <algorithm>
#include <cmath>

namespace moevement::models::cpu::ref {

vec matmul(const vec& x, const vec& w, int n, int in, int out) {
  vec y(std::size_t(n) * out, 0.0);
  for (int i = 0; i < n; ++i)
    for (int o = 0; o < out; ++o) {
      double s = 0.0;
      for (int p = 0; p < in; ++p) s += x[std::size_t(i) * in + p] * w[std::size_t(p) * out + o];
      y[std::size_t(i) * out + o] = s;
    }
  return y;
}

void matmul_backward(vec& dx, vec& dw, const vec& dout, const vec& x, const vec& w, int n, int in,
                     int out) {
  dx.assign(std::size_t(n) * in, 0.0);
  dw.assign(std::size_t(in) * out, 0.0);
  for (int i = 0; i < n; ++i)
    for (int p = 0; p < in; ++p)
      for (int o = 0; o < out; ++o) {
        const double d = dout[std::size_t(i) * out + o];
        dx[std::size_t(i) * in + p] += d * w[std::size_t(p) * out + o];
        dw[std::size_t(p) * out + o] += d * x[std::size_t(i) * in + p];
      }
}

vec embedding(const std::vector<std::int32_t>& tokens, const vec& wte, const vec& wpe, int b, int t,
              int c) {
  vec out(std::size_t(b) * t * c);
  for (int i = 0; i < b * t; ++i)
    for (int x = 0; x < c; ++x)
      out[std::size_t(i) * c + x] =
          wte[std::size_t(tokens[i]) * c + x] + wpe[std::size_t(i % t) * c + x];
  return out;
}

void embedding_backward(vec& dwte, vec& dwpe, const vec& dout,
                        const std::vector<std::int32_t>& tokens, int b, int t, int c, int v,
                        int max_t) {
  dwte.assign(std::size_t(v) * c, 0.0);
  dwpe.assign(std::size_t(max_t) * c, 0.0);
  for (int i = 0; i < b * t; ++i)
    for (int x = 0; x < c; ++x) {
      dwte[std::size_t(tokens[i]) * c + x] += dout[std::size_t(i) * c + x];
      dwpe[std::size_t(i % t) * c + x] += dout[std::size_t(i) * c + x];
    }
}

namespace {
constexpr double eps = 1e-5;
}

vec rmsnorm(const vec& x, const vec& w, int n, int c) {
  vec out(x.size());
  for (int i = 0; i < n; ++i) {
    double ms = 0.0;
    for (int j = 0; j < c; ++j) ms += x[std::size_t(i) * c + j] * x[std::size_t(i) * c + j];
    const double r = 1.0 / std::sqrt(ms / c + eps);
    for (int j = 0; j < c; ++j) out[std::size_t(i) * c + j] = x[std::size_t(i) * c + j] * r * w[j];
  }
  return out;
}

void rmsnorm_backward(vec& dx, vec& dw, const vec& dout, const vec& x, const vec& w, int n, int c) {
  dx.assign(x.size(), 0.0);
  dw.assign(c, 0.0);
  for (int i = 0; i < n; ++i) {
    const double* xi = &x[std::size_t(i) * c];
    const double* di = &dout[std::size_t(i) * c];
    double ms = 0.0;
    for (int j = 0; j < c; ++j) ms += xi[j] * xi[j];
    ms /= c;
    const double r = 1.0 / std::sqrt(ms + eps);
    // y_j = x_j w_j r(x); dr/dx_m = -r^3 x_m / c
    double s = 0.0;
    for (int j = 0; j < c; ++j) s += di[j] * w[j] * xi[j];
    for (int m = 0; m < c; ++m) {
      dx[std::size_t(i) * c + m] = di[m] * w[m] * r - s * r * r * r * xi[m] / c;
      dw[m] += di[m] * xi[m] * r;
    }
  }
}

vec attention(const vec& qkv, int b, int t, int c, int nh) {
  const int hs = c / nh;
  const double scale = 1.0 / std::sqrt(double(hs));
  vec y(std::size_t(b) * t * c, 0.0);
  auto at = [&](int i, int tt, int col) { return qkv[(std::size_t(i) * t + tt) * 3 * c + col]; };
  for (int i = 0; i < b; ++i)
    for (int h = 0; h < nh; ++h)
      for (int r = 0; r < t; ++r) {
        vec s(r + 1);
        double mx = -1e300;
        for (int j = 0; j <= r; ++j) {
          double d = 0.0;
          for (int x = 0; x < hs; ++x) d += at(i, r, h * hs + x) * at(i, j, c + h * hs + x);
          s[j] = d * scale;
          mx = std::max(mx, s[j]);
        }
        double z = 0.0;
        for (int j = 0; j <= r; ++j) z += std::exp(s[j] - mx);
        for (int j = 0; j <= r; ++j) {
          const double p = std::exp(s[j] - mx) / z;
          for (int x = 0; x < hs; ++x)
            y[(std::size_t(i) * t + r) * c + h * hs + x] += p * at(i, j, 2 * c + h * hs + x);
        }
      }
  return y;
}

vec attention_backward(const vec& dy, const vec& qkv, int b, int t, int c, int nh) {
  const int hs = c / nh;
  const double scale = 1.0 / std::sqrt(double(hs));
  vec d(qkv.size(), 0.0);
  auto idx = [&](int i, int tt, int col) { return (std::size_t(i) * t + tt) * 3 * c + col; };
  for (int i = 0; i < b; ++i)
    for (int h = 0; h < nh; ++h)
      for (int r = 0; r < t; ++r) {
        vec p(r + 1);
        double mx = -1e300;
        for (int j = 0; j <= r; ++j) {
          double s = 0.0;
          for (int x = 0; x < hs; ++x)
            s += qkv[idx(i, r, h * hs + x)] * qkv[idx(i, j, c + h * hs + x)];
          p[j] = s * scale;
          mx = std::max(mx, p[j]);
        }
        double z = 0.0;
        for (int j = 0; j <= r; ++j) z += std::exp(p[j] - mx);
        for (int j = 0; j <= r; ++j) p[j] = std::exp(p[j] - mx) / z;
        const double* g = &dy[(std::size_t(i) * t + r) * c + h * hs];
        vec dp(r + 1);
        for (int j = 0; j <= r; ++j) {
          double s = 0.0;
          for (int x = 0; x < hs; ++x) {
            s += g[x] * qkv[idx(i, j, 2 * c + h * hs + x)];
            d[idx(i, j, 2 * c + h * hs + x)] += p[j] * g[x];
          }
          dp[j] = s;
        }
        double dot = 0.0;
        for (int j = 0; j <= r; ++j) dot += p[j] * dp[j];
        for (int j = 0; j <= r; ++j) {
          const double ds = p[j] * (dp[j] - dot) * scale;
          for (int x = 0; x < hs; ++x) {
            d[idx(i, r, h * hs + x)] += ds * qkv[idx(i, j, c + h * hs + x)];
            d[idx(i, j, c + h * hs + x)] += ds * qkv[idx(i, r, h * hs + x)];
          }
        }
      }
  return d;
}

namespace {
double gelu1_f64(double v) {
  const double s = std::sqrt(2.0 / M_PI);
  return 0.5 * v * (1.0 + std::tanh(s * (v + 0.044715 * v * v * v)));
}
}  // namespace

vec gelu(const vec& x) {
  vec y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = gelu1_f64(x[i]);
  return y;
}

vec gelu_backward(const vec& dout, const vec& x) {
  const double s = std::sqrt(2.0 / M_PI);
  vec d(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double v = x[i];
    const double th = std::tanh(s * (v + 0.044715 * v * v * v));
    d[i] = dout[i] * (0.5 * (1 + th) + 0.5 * v * (1 - th * th) * s * (1 + 3 * 0.044715 * v * v));
  }
  return d;
}

vec softmax_xent(const vec& logits, const std::vector<std::int32_t>& targets, int n, int v) {
  vec l(n);
  for (int i = 0; i < n; ++i) {
    double mx = -1e300;
    for (int j = 0; j < v; ++j) mx = std::max(mx, logits[std::size_t(i) * v + j]);
    double z = 0.0;
    for (int j = 0; j < v; ++j) z += std::exp(logits[std::size_t(i) * v + j] - mx);
    l[i] = std::log(z) + mx - logits[std::size_t(i) * v + targets[i]];
  }
  return l;
}

vec softmax_xent_backward(const vec& logits, const std::vector<std::int32_t>& targets, double dloss,
                          int n, int v) {
  vec d(logits.size());
  for (int i = 0; i < n; ++i) {
    double mx = -1e300;
    for (int j = 0; j < v; ++j) mx = std::max(mx, logits[std::size_t(i) * v + j]);
    double z = 0.0;
    for (int j = 0; j < v; ++j) z += std::exp(logits[std::size_t(i) * v + j] - mx);
    for (int j = 0; j < v; ++j)
      d[std::size_t(i) * v + j] =
          (std::exp(logits[std::size_t(i) * v + j] - mx) / z - (j == targets[i] ? 1.0 : 0.0)) *
          dloss;
  }
  return d;
}

namespace {

struct route {
  vec probs;                             // [N,E]
  std::vector<std::vector<int>> chosen;  // [N][K]
  std::vector<std::vector<bool>> kept;   // [N][K]
  std::vector<int> routed;               // [E]
};

route route_tokens(const vec& x, const vec& wg, int n, int c, int e, int k, double cf) {
  route r;
  r.probs = matmul(x, wg, n, c, e);
  r.routed.assign(e, 0);
  for (int i = 0; i < n; ++i) {
    double* p = &r.probs[std::size_t(i) * e];
    double mx = -1e300, z = 0.0;
    for (int j = 0; j < e; ++j) mx = std::max(mx, p[j]);
    for (int j = 0; j < e; ++j) z += std::exp(p[j] - mx);
    for (int j = 0; j < e; ++j) p[j] = std::exp(p[j] - mx) / z;
    std::vector<int> ch;
    for (int s = 0; s < k; ++s) {
      int best = -1;
      for (int j = 0; j < e; ++j) {
        if (std::find(ch.begin(), ch.end(), j) != ch.end()) continue;
        if (best < 0 || p[j] > p[best]) best = j;
      }
      ch.push_back(best);
      ++r.routed[best];
    }
    r.chosen.push_back(ch);
  }
  // capacity: the earliest (token, slot) assignments of each expert are kept
  const long cap = cf > 0 ? long(std::ceil(cf * n * k / e)) : long(n) * k;
  std::vector<long> used(e, 0);
  for (int i = 0; i < n; ++i) {
    std::vector<bool> kk;
    for (int s = 0; s < k; ++s) kk.push_back(used[r.chosen[i][s]]++ < cap);
    r.kept.push_back(kk);
  }
  return r;
}

// one expert on one token: y = gelu(x w1) w2
vec expert_apply(const double* x, const vec& w1, const vec& w2, int c, int f, vec* pre = nullptr) {
  vec h(f, 0.0);
  for (int p = 0; p < c; ++p)
    for (int o = 0; o < f; ++o) h[o] += x[p] * w1[std::size_t(p) * f + o];
  if (pre != nullptr) *pre = h;
  const vec a = gelu(h);
  vec y(c, 0.0);
  for (int p = 0; p < f; ++p)
    for (int o = 0; o < c; ++o) y[o] += a[p] * w2[std::size_t(p) * c + o];
  return y;
}

}  // namespace

moe_result moe(const vec& x, const moe_weights& w, int n, int c, int e, int k, int f,
               double capacity_factor) {
  const route r = route_tokens(x, w.wg, n, c, e, k, capacity_factor);
  moe_result res;
  res.out.assign(std::size_t(n) * c, 0.0);
  for (int i = 0; i < n; ++i)
    for (int s = 0; s < k; ++s) {
      if (!r.kept[i][s]) continue;
      const int j = r.chosen[i][s];
      const vec y = expert_apply(&x[std::size_t(i) * c], w.w1[j], w.w2[j], c, f);
      for (int o = 0; o < c; ++o)
        res.out[std::size_t(i) * c + o] += r.probs[std::size_t(i) * e + j] * y[o];
    }
  for (int j = 0; j < e; ++j) {
    double pe = 0.0;
    for (int i = 0; i < n; ++i) pe += r.probs[std::size_t(i) * e + j];
    res.aux += double(r.routed[j]) / (double(n) * k) * pe / n;
  }
  res.aux *= e;
  return res;
}

moe_grads moe_backward(const vec& dout, double daux, const vec& x, const moe_weights& w, int n,
                       int c, int e, int k, int f, double capacity_factor) {
  const route r = route_tokens(x, w.wg, n, c, e, k, capacity_factor);
  moe_grads g;
  g.dx.assign(std::size_t(n) * c, 0.0);
  g.dw.wg.assign(std::size_t(c) * e, 0.0);
  g.dw.w1.assign(e, vec(std::size_t(c) * f, 0.0));
  g.dw.w2.assign(e, vec(std::size_t(f) * c, 0.0));
  vec dlogits(std::size_t(n) * e, 0.0);
  for (int i = 0; i < n; ++i) {
    const double* xi = &x[std::size_t(i) * c];
    const double* di = &dout[std::size_t(i) * c];
    vec dp(e, 0.0);
    for (int j = 0; j < e; ++j) dp[j] = daux * e * (double(r.routed[j]) / (double(n) * k)) / n;
    for (int s = 0; s < k; ++s) {
      if (!r.kept[i][s]) continue;
      const int j = r.chosen[i][s];
      const double p = r.probs[std::size_t(i) * e + j];
      vec pre;
      const vec y = expert_apply(xi, w.w1[j], w.w2[j], c, f, &pre);
      for (int o = 0; o < c; ++o) dp[j] += di[o] * y[o];
      // back through the expert with dy = p * dout
      const vec a = gelu(pre);
      vec da(f, 0.0);
      for (int q = 0; q < f; ++q)
        for (int o = 0; o < c; ++o) {
          da[q] += p * di[o] * w.w2[j][std::size_t(q) * c + o];
          g.dw.w2[j][std::size_t(q) * c + o] += a[q] * p * di[o];
        }
      const vec dh = gelu_backward(da, pre);
      for (int q = 0; q < c; ++q)
        for (int o = 0; o < f; ++o) {
          g.dx[std::size_t(i) * c + q] += dh[o] * w.w1[j][std::size_t(q) * f + o];
          g.dw.w1[j][std::size_t(q) * f + o] += xi[q] * dh[o];
        }
    }
    const double* p = &r.probs[std::size_t(i) * e];
    double dot = 0.0;
    for (int j = 0; j < e; ++j) dot += p[j] * dp[j];
    for (int j = 0; j < e; ++j) dlogits[std::size_t(i) * e + j] = p[j] * (dp[j] - dot);
  }
  vec dxg, dwg;
  matmul_backward(dxg, dwg, dlogits, x, w.wg, n, c, e);
  for (std::size_t i = 0; i < g.dx.size(); ++i) g.dx[i] += dxg[i];
  g.dw.wg = dwg;
  return g;
}

}  // namespace moevement::models::cpu::ref
