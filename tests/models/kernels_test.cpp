// Every CPU kernel against its naive fp64 reference, and every reference backward against
// central finite differences of its forward.
#include "models/cpu/kernels.hpp"

#include <gtest/gtest.h>
#include <immintrin.h>

#include <cmath>
#include <functional>
#include <vector>

#include "models/cpu/reference.hpp"
#include "models/rng.hpp"
#include "models/tensor.hpp"

namespace moevement::models::cpu {
namespace {

using ref::vec;

vec rand_vec(std::size_t n, std::uint64_t seed, double scale = 1.0) {
  vec v(n);
  const auto key = make_key({seed});
  for (std::size_t i = 0; i < n; ++i) v[i] = scale * (2.0 * random_uniform(key, i) - 1.0);
  return v;
}
// Rounded to fp32 first so fast and reference kernels see the same inputs.
std::vector<float> to_f(const vec& v) {
  return {v.begin(), v.end()};
}
vec to_d(const std::vector<float>& v) {
  return {v.begin(), v.end()};
}
vec rounded(const vec& v) {
  return to_d(to_f(v));
}

void expect_close(const std::vector<float>& fast, const vec& want, double tol, const char* what) {
  ASSERT_EQ(fast.size(), want.size()) << what;
  for (std::size_t i = 0; i < fast.size(); ++i) {
    ASSERT_NEAR(fast[i], want[i], tol * std::max(1.0, std::abs(want[i]))) << what << " at " << i;
  }
}

double dot(const vec& a, const vec& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Checks grad (d loss / d x) against central differences at every index of x.
void fd_check(vec& x, const vec& grad, const std::function<double()>& loss, const char* what,
              double tol = 1e-6) {
  ASSERT_EQ(x.size(), grad.size()) << what;
  const double eps = 1e-6;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    x[i] = keep + eps;
    const double up = loss();
    x[i] = keep - eps;
    const double down = loss();
    x[i] = keep;
    const double fd = (up - down) / (2 * eps);
    ASSERT_NEAR(grad[i], fd, tol * std::max(1.0, std::abs(fd))) << what << " at " << i;
  }
}

TEST(kernels, matmul_matches_reference_and_finite_differences) {
  const int n = 7, in = 5, out = 6;
  vec x = rounded(rand_vec(n * in, 1)), w = rounded(rand_vec(in * out, 2));
  const vec r = rounded(rand_vec(n * out, 3));
  std::vector<float> y(n * out), dx(n * in), dw(in * out, 0.0f);
  matmul_forward(y.data(), to_f(x).data(), to_f(w).data(), n, in, out);
  expect_close(y, ref::matmul(x, w, n, in, out), 1e-5, "y");
  matmul_backward(dx.data(), dw.data(), to_f(r).data(), to_f(x).data(), to_f(w).data(), n, in, out);
  vec rdx, rdw;
  ref::matmul_backward(rdx, rdw, r, x, w, n, in, out);
  expect_close(dx, rdx, 1e-5, "dx");
  expect_close(dw, rdw, 1e-5, "dw");
  auto loss = [&] { return dot(ref::matmul(x, w, n, in, out), r); };
  fd_check(x, rdx, loss, "ref dx");
  fd_check(w, rdw, loss, "ref dw");
}

TEST(kernels, embedding_matches_reference_and_finite_differences) {
  const int b = 2, t = 3, c = 4, v = 5, max_t = 4;
  const std::vector<std::int32_t> tokens{1, 4, 1, 0, 3, 1};
  vec wte = rounded(rand_vec(v * c, 4)), wpe = rounded(rand_vec(max_t * c, 5));
  const vec r = rounded(rand_vec(b * t * c, 6));
  std::vector<float> y(b * t * c), dwte(v * c, 0.0f), dwpe(max_t * c, 0.0f);
  embedding_forward(y.data(), tokens.data(), to_f(wte).data(), to_f(wpe).data(), b, t, c);
  expect_close(y, ref::embedding(tokens, wte, wpe, b, t, c), 1e-6, "y");
  embedding_backward(dwte.data(), dwpe.data(), to_f(r).data(), tokens.data(), b, t, c);
  vec rdwte, rdwpe;
  ref::embedding_backward(rdwte, rdwpe, r, tokens, b, t, c, v, max_t);
  expect_close(dwte, rdwte, 1e-6, "dwte");
  expect_close(dwpe, rdwpe, 1e-6, "dwpe");
  auto loss = [&] { return dot(ref::embedding(tokens, wte, wpe, b, t, c), r); };
  fd_check(wte, rdwte, loss, "ref dwte");
  fd_check(wpe, rdwpe, loss, "ref dwpe");
}

TEST(kernels, rmsnorm_matches_reference_and_finite_differences) {
  const int n = 5, c = 8;
  vec x = rounded(rand_vec(n * c, 7, 2.0)), w = rounded(rand_vec(c, 8));
  const vec r = rounded(rand_vec(n * c, 9));
  std::vector<float> y(n * c), rstd(n), dx(n * c), dw(c, 0.0f);
  rmsnorm_forward(y.data(), rstd.data(), to_f(x).data(), to_f(w).data(), n, c);
  expect_close(y, ref::rmsnorm(x, w, n, c), 1e-5, "y");
  rmsnorm_backward(dx.data(), dw.data(), to_f(r).data(), to_f(x).data(), to_f(w).data(),
                   rstd.data(), n, c);
  vec rdx, rdw;
  ref::rmsnorm_backward(rdx, rdw, r, x, w, n, c);
  expect_close(dx, rdx, 1e-5, "dx");
  expect_close(dw, rdw, 1e-5, "dw");
  auto loss = [&] { return dot(ref::rmsnorm(x, w, n, c), r); };
  fd_check(x, rdx, loss, "ref dx");
  fd_check(w, rdw, loss, "ref dw");
}

TEST(kernels, attention_matches_reference_and_finite_differences) {
  const int b = 2, t = 5, c = 8, nh = 2;
  vec qkv = rounded(rand_vec(b * t * 3 * c, 10, 1.5));
  const vec r = rounded(rand_vec(b * t * c, 11));
  std::vector<float> y(b * t * c), att(b * nh * t * t), dqkv(b * t * 3 * c), scratch(t * t);
  attention_forward(y.data(), att.data(), to_f(qkv).data(), b, t, c, nh);
  expect_close(y, ref::attention(qkv, b, t, c, nh), 1e-5, "y");
  for (int h = 0; h < b * nh; ++h)
    for (int i = 0; i < t; ++i)
      for (int j = i + 1; j < t; ++j) ASSERT_EQ(att[(h * t + i) * t + j], 0.0f) << "not causal";
  attention_backward(dqkv.data(), scratch.data(), to_f(r).data(), att.data(), to_f(qkv).data(), b,
                     t, c, nh);
  const vec rd = ref::attention_backward(r, qkv, b, t, c, nh);
  expect_close(dqkv, rd, 1e-5, "dqkv");
  fd_check(
      qkv, rd, [&] { return dot(ref::attention(qkv, b, t, c, nh), r); }, "ref dqkv");
}

TEST(kernels, gelu_matches_reference_and_finite_differences) {
  vec x = rounded(rand_vec(64, 12, 4.0));
  const vec r = rounded(rand_vec(64, 13));
  std::vector<float> y(64), dx(64);
  gelu_forward(y.data(), to_f(x).data(), 64);
  expect_close(y, ref::gelu(x), 1e-6, "y");
  gelu_backward(dx.data(), to_f(r).data(), to_f(x).data(), 64);
  const vec rd = ref::gelu_backward(r, x);
  expect_close(dx, rd, 1e-6, "dx");
  fd_check(
      x, rd, [&] { return dot(ref::gelu(x), r); }, "ref dx");
}

TEST(kernels, gelu_vector_lanes_and_scalar_tail_give_identical_bits) {
  const std::vector<float> x = to_f(rand_vec(4099, 15, 12.0));
  const std::vector<float> d = to_f(rand_vec(4099, 16));
  std::vector<float> y(x.size()), dx(x.size());
  gelu_forward(y.data(), x.data(), int(x.size()));
  gelu_backward(dx.data(), d.data(), x.data(), int(x.size()));
  for (std::size_t i = 0; i < x.size(); ++i) {
    float y1, dx1;
    gelu_forward(&y1, &x[i], 1);  // n = 1: the scalar path
    gelu_backward(&dx1, &d[i], &x[i], 1);
    ASSERT_EQ(std::bit_cast<std::uint32_t>(y1), std::bit_cast<std::uint32_t>(y[i])) << x[i];
    ASSERT_EQ(std::bit_cast<std::uint32_t>(dx1), std::bit_cast<std::uint32_t>(dx[i])) << x[i];
  }
}

TEST(kernels, softmax_xent_matches_reference_and_finite_differences) {
  const int n = 4, v = 9;
  vec logits = rounded(rand_vec(n * v, 14, 3.0));
  const std::vector<std::int32_t> targets{0, 8, 3, 3};
  std::vector<float> losses(n), probs(n * v), dl(n * v);
  softmax_xent_forward(losses.data(), probs.data(), to_f(logits).data(), targets.data(), n, v);
  expect_close(losses, ref::softmax_xent(logits, targets, n, v), 1e-6, "losses");
  softmax_xent_backward(dl.data(), probs.data(), targets.data(), 0.25f, n, v);
  const vec rd = ref::softmax_xent_backward(logits, targets, 0.25, n, v);
  expect_close(dl, rd, 1e-6, "dlogits");
  fd_check(
      logits, rd,
      [&] {
        const vec l = ref::softmax_xent(logits, targets, n, v);
        return 0.25 * (l[0] + l[1] + l[2] + l[3]);
      },
      "ref dlogits");
}

TEST(kernels, gate_routes_stably_breaks_ties_low_and_drops_past_capacity) {
  // 4 tokens, 3 experts, top-1; token logits make tokens 0, 1, 3 prefer expert 2.
  const std::vector<float> logits{0, 0, 5, 0, 0, 5, 1, 1, 0, 0, 0, 5};
  routing r;
  gate_forward(r, logits.data(), 4, 3, 1, 0.0);
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{2, 2, 0, 2}));  // token 2: tie 0/1 -> 0
  EXPECT_EQ(r.offsets, (std::vector<std::int32_t>{0, 1, 1, 4}));
  EXPECT_EQ(r.token, (std::vector<std::int32_t>{2, 0, 1, 3}));  // stable within expert 2
  EXPECT_EQ(r.routed, (std::vector<std::int32_t>{1, 0, 3}));
  // capacity = ceil(0.75 * 4 * 1 / 3) = 1: expert 2 keeps token 0 only
  gate_forward(r, logits.data(), 4, 3, 1, 0.75);
  EXPECT_EQ(r.offsets, (std::vector<std::int32_t>{0, 1, 1, 2}));
  EXPECT_EQ(r.token, (std::vector<std::int32_t>{2, 0}));
  EXPECT_EQ(r.row, (std::vector<std::int32_t>{1, -1, 0, -1}));
  EXPECT_EQ(r.routed, (std::vector<std::int32_t>{1, 0, 3}));  // counted before the drop
}

// The MoE block composed from the kernels exactly as models/model.cpp does it.
struct moe_fast {
  int n, c, e, k, f;
  double cf;
  std::vector<float> out, dx, dwg;
  std::vector<std::vector<float>> dw1, dw2;
  float aux;
  void run(const vec& x, const ref::moe_weights& w, const vec& dout, double daux) {
    const auto xf = to_f(x), wg = to_f(w.wg), df = to_f(dout);
    std::vector<float> logits(n * e);
    matmul_forward(logits.data(), xf.data(), wg.data(), n, c, e);
    routing r;
    gate_forward(r, logits.data(), n, e, k, cf);
    aux = r.aux_loss;
    const int rows = r.rows();
    std::vector<float> xs(rows * c), hpre(rows * f), act(rows * f), ye(rows * c);
    moe_gather(xs.data(), xf.data(), r, c);
    for (int j = 0; j < e; ++j) {
      const int r0 = r.offsets[j], m = r.offsets[j + 1] - r0;
      if (m == 0) continue;
      matmul_forward(&hpre[r0 * f], &xs[r0 * c], to_f(w.w1[j]).data(), m, c, f);
      gelu_forward(&act[r0 * f], &hpre[r0 * f], m * f);
      matmul_forward(&ye[r0 * c], &act[r0 * f], to_f(w.w2[j]).data(), m, f, c);
    }
    out.assign(n * c, 0.0f);
    moe_combine_forward(out.data(), ye.data(), r, c);
    std::vector<float> dye(rows * c), dweight(n * k), dxs(rows * c), da(rows * f), dh(rows * f);
    moe_combine_backward(dye.data(), dweight.data(), df.data(), ye.data(), r, c);
    dw1.assign(e, std::vector<float>(c * f, 0.0f));
    dw2.assign(e, std::vector<float>(f * c, 0.0f));
    for (int j = 0; j < e; ++j) {
      const int r0 = r.offsets[j], m = r.offsets[j + 1] - r0;
      if (m == 0) continue;
      matmul_backward(da.data(), dw2[j].data(), &dye[r0 * c], &act[r0 * f], to_f(w.w2[j]).data(), m,
                      f, c);
      gelu_backward(dh.data(), da.data(), &hpre[r0 * f], m * f);
      matmul_backward(&dxs[r0 * c], dw1[j].data(), dh.data(), &xs[r0 * c], to_f(w.w1[j]).data(), m,
                      c, f);
    }
    std::vector<float> dlogits(n * e);
    gate_backward(dlogits.data(), r, dweight.data(), float(daux));
    dx.assign(n * c, 0.0f);
    dwg.assign(c * e, 0.0f);
    matmul_backward(dx.data(), dwg.data(), dlogits.data(), xf.data(), wg.data(), n, c, e);
    moe_scatter_add(dx.data(), dxs.data(), r, c);
  }
};

void moe_check(double cf) {
  const int n = 9, c = 6, e = 4, k = 2, f = 5;
  vec x = rounded(rand_vec(n * c, 20, 1.0));
  ref::moe_weights w;
  w.wg = rounded(rand_vec(c * e, 21, 1.0));
  for (int j = 0; j < e; ++j) {
    w.w1.push_back(rounded(rand_vec(c * f, 30 + j, 0.7)));
    w.w2.push_back(rounded(rand_vec(f * c, 40 + j, 0.7)));
  }
  const vec r = rounded(rand_vec(n * c, 22));
  const double daux = 0.5;
  moe_fast fast{n, c, e, k, f, cf, {}, {}, {}, {}, {}, 0.0f};
  fast.run(x, w, r, daux);
  const auto want = ref::moe(x, w, n, c, e, k, f, cf);
  expect_close(fast.out, want.out, 1e-5, "out");
  EXPECT_NEAR(fast.aux, want.aux, 1e-6);
  const auto g = ref::moe_backward(r, daux, x, w, n, c, e, k, f, cf);
  expect_close(fast.dx, g.dx, 1e-5, "dx");
  expect_close(fast.dwg, g.dw.wg, 1e-5, "dwg");
  for (int j = 0; j < e; ++j) {
    expect_close(fast.dw1[j], g.dw.w1[j], 1e-5, "dw1");
    expect_close(fast.dw2[j], g.dw.w2[j], 1e-5, "dw2");
  }
  auto loss = [&] {
    const auto m = ref::moe(x, w, n, c, e, k, f, cf);
    return dot(m.out, r) + daux * m.aux;
  };
  fd_check(x, g.dx, loss, "ref dx", 1e-5);
  fd_check(w.wg, g.dw.wg, loss, "ref dwg", 1e-5);
  for (int j = 0; j < e; ++j) {
    fd_check(w.w1[j], g.dw.w1[j], loss, "ref dw1", 1e-5);
    fd_check(w.w2[j], g.dw.w2[j], loss, "ref dw2", 1e-5);
  }
}

TEST(kernels, moe_block_dropless_matches_reference_and_finite_differences) {
  moe_check(0.0);
}
TEST(kernels, moe_block_with_capacity_matches_reference_and_finite_differences) {
  moe_check(0.6);  // capacity ceil(0.6*9*2/4) = 3 of the 18 assignments per expert: drops
}

TEST(tensor, f16_conversion_matches_the_cpu_f16c_unit) {
  // every f16 value round-trips exactly
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_f32(static_cast<std::uint16_t>(h));
    const auto hw = static_cast<std::uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_f16(f), h) << h;
    ASSERT_EQ(_cvtsh_ss(static_cast<unsigned short>(h)), f) << h;
    ASSERT_EQ(hw, h);
  }
  // and arbitrary floats (ties, subnormals, overflow) round like the hardware does
  const auto key = make_key({99});
  for (std::uint64_t i = 0; i < 200000; ++i) {
    const std::uint32_t bits = static_cast<std::uint32_t>(random_bits(key, i));
    const float f = std::bit_cast<float>(bits & 0xc7ffffffu);  // mostly in or near f16 range
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_f16(f), static_cast<std::uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)))
        << f;
  }
}

TEST(tensor, bf16_rounds_to_nearest_even) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f808000u)), 0x3f80);  // tie -> even
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f818000u)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f808001u)), 0x3f81);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  tensor t({2, 3}, dtype::f32);
  auto v = t.as<float>();
  for (int i = 0; i < 6; ++i) v[i] = 0.1f * float(i);
  const tensor h = t.to(dtype::bf16);
  EXPECT_EQ(h.bytes().size(), 12u);
  EXPECT_EQ(h.as<std::uint16_t>()[1], f32_to_bf16(0.1f));
  EXPECT_THROW(tensor({1}, dtype::f32, device::cuda), std::invalid_argument);
}

}  // namespace
}  // namespace moevement::models::cpu
