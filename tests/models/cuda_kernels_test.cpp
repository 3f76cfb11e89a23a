// The CUDA kernels against the CPU kernels, and against themselves run to run (bitwise).
// Needs a GPU: skips cleanly without one (and without the CUDA backend).
#include "models/cuda/kernels.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "models/cpu/kernels.hpp"
#include "models/cuda/device.hpp"
#include "models/rng.hpp"

namespace moevement::models {
namespace {

std::vector<float> rand_vec(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  std::vector<float> v(n);
  const auto key = make_key({seed, 77});
  for (std::size_t i = 0; i < n; ++i) v[i] = scale * float(2.0 * random_uniform(key, i) - 1.0);
  return v;
}

void expect_close(const std::vector<float>& gpu, const std::vector<float>& cpu, float tol,
                  const char* what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  for (std::size_t i = 0; i < gpu.size(); ++i) {
    ASSERT_NEAR(gpu[i], cpu[i], tol * std::max(1.0f, std::abs(cpu[i]))) << what << " at " << i;
  }
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class cuda_kernels : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::compiled()) GTEST_SKIP() << "this build has no CUDA backend";
    if (cuda::device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  }
  template <class T>
  std::unique_ptr<cuda::device_array<T>> dev(cuda::context& ctx, const std::vector<T>& host) {
    auto d = std::make_unique<cuda::device_array<T>>(ctx, host.size());
    d->upload(host);
    return d;
  }
};

TEST_F(cuda_kernels, matmul_and_rmsnorm_match_the_cpu_and_repeat_bitwise) {
  cuda::context ctx;
  const int n = 96, in = 64, out = 80;
  const auto x = rand_vec(n * in, 1), w = rand_vec(in * out, 2), d = rand_vec(n * out, 3);
  auto dx_ = dev(ctx, x), dw_ = dev(ctx, w), dd_ = dev(ctx, d);
  std::vector<float> y_cpu(n * out), dx_cpu(n * in), dw_cpu(in * out, 0.0f);
  cpu::matmul_forward(y_cpu.data(), x.data(), w.data(), n, in, out);
  cpu::matmul_backward(dx_cpu.data(), dw_cpu.data(), d.data(), x.data(), w.data(), n, in, out);
  std::vector<std::vector<float>> runs;
  for (int r = 0; r < 2; ++r) {
    cuda::device_array<float> y(ctx, n * out), dx(ctx, n * in);
    auto dw = dev(ctx, std::vector<float>(in * out, 0.0f));
    cuda::matmul_forward(ctx, y.data(), dx_->data(), dw_->data(), n, in, out);
    cuda::matmul_backward(ctx, dx.data(), dw->data(), dd_->data(), dx_->data(), dw_->data(), n, in,
                          out);
    expect_close(y.download(), y_cpu, 1e-5f, "y");
    expect_close(dx.download(), dx_cpu, 1e-5f, "dx");
    expect_close(dw->download(), dw_cpu, 1e-5f, "dw");
    runs.push_back(dw->download());
  }
  EXPECT_TRUE(same_bits(runs[0], runs[1]));

  const int c = 64;
  const auto g = rand_vec(c, 4);
  std::vector<float> o_cpu(n * c), r_cpu(n), ndx_cpu(n * c), ndw_cpu(c, 0.0f);
  cpu::rmsnorm_forward(o_cpu.data(), r_cpu.data(), x.data(), g.data(), n, c);
  cpu::rmsnorm_backward(ndx_cpu.data(), ndw_cpu.data(), x.data(), x.data(), g.data(), r_cpu.data(),
                        n, c);
  auto gd = dev(ctx, g), ndw = dev(ctx, std::vector<float>(c, 0.0f));
  cuda::device_array<float> o(ctx, n * c), rs(ctx, n), ndx(ctx, n * c);
  cuda::rmsnorm_forward(ctx, o.data(), rs.data(), dx_->data(), gd->data(), n, c);
  cuda::rmsnorm_backward(ctx, ndx.data(), ndw->data(), dx_->data(), dx_->data(), gd->data(),
                         rs.data(), n, c);
  expect_close(o.download(), o_cpu, 1e-6f, "rmsnorm out");
  expect_close(ndx.download(), ndx_cpu, 1e-5f, "rmsnorm dx");
  expect_close(ndw->download(), ndw_cpu, 1e-5f, "rmsnorm dw");
}

TEST_F(cuda_kernels, attention_matches_the_cpu) {
  cuda::context ctx;
  const int b = 2, t = 33, c = 32, nh = 4;
  const auto qkv = rand_vec(b * t * 3 * c, 5, 1.5f), dy = rand_vec(b * t * c, 6);
  std::vector<float> y(b * t * c), att(b * nh * t * t), dqkv(b * t * 3 * c), scr(t * t);
  cpu::attention_forward(y.data(), att.data(), qkv.data(), b, t, c, nh);
  cpu::attention_backward(dqkv.data(), scr.data(), dy.data(), att.data(), qkv.data(), b, t, c, nh);
  auto q = dev(ctx, qkv), d = dev(ctx, dy);
  cuda::device_array<float> gy(ctx, y.size()), ga(ctx, att.size()), gd(ctx, dqkv.size()),
      gs(ctx, std::size_t(b) * nh * t * t);
  cuda::attention_forward(ctx, gy.data(), ga.data(), q->data(), b, t, c, nh);
  cuda::attention_backward(ctx, gd.data(), gs.data(), d->data(), ga.data(), q->data(), b, t, c, nh);
  expect_close(gy.download(), y, 1e-5f, "y");
  expect_close(ga.download(), att, 1e-5f, "att");
  expect_close(gd.download(), dqkv, 1e-4f, "dqkv");
}

TEST_F(cuda_kernels, gelu_is_bitwise_the_cpu_and_embedding_and_xent_match) {
  cuda::context ctx;
  const int n = 4099;
  const auto x = rand_vec(n, 7, 10.0f), d = rand_vec(n, 8);
  std::vector<float> y(n), dx(n);
  cpu::gelu_forward(y.data(), x.data(), n);
  cpu::gelu_backward(dx.data(), d.data(), x.data(), n);
  auto gx = dev(ctx, x), gdd = dev(ctx, d);
  cuda::device_array<float> gy(ctx, n), gdx(ctx, n);
  cuda::gelu_forward(ctx, gy.data(), gx->data(), n);
  cuda::gelu_backward(ctx, gdx.data(), gdd->data(), gx->data(), n);
  EXPECT_TRUE(same_bits(gy.download(), y));
  EXPECT_TRUE(same_bits(gdx.download(), dx));

  const int b = 3, t = 5, c = 8, v = 11;
  std::vector<std::int32_t> tok(b * t), tgt(b * t);
  for (int i = 0; i < b * t; ++i) tok[i] = (i * 7) % v, tgt[i] = (i * 3 + 1) % v;
  const auto wte = rand_vec(v * c, 9), wpe = rand_vec(t * c, 10), dout = rand_vec(b * t * c, 11);
  std::vector<float> e(b * t * c), dwte(v * c, 0.0f), dwpe(t * c, 0.0f);
  cpu::embedding_forward(e.data(), tok.data(), wte.data(), wpe.data(), b, t, c);
  cpu::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), b, t, c);
  auto gtok = dev(ctx, tok), gtgt = dev(ctx, tgt);
  auto gwte = dev(ctx, wte), gwpe = dev(ctx, wpe), gdout = dev(ctx, dout);
  auto gdwte = dev(ctx, std::vector<float>(v * c, 0.0f)),
       gdwpe = dev(ctx, std::vector<float>(t * c, 0.0f));
  cuda::device_array<float> ge(ctx, e.size());
  cuda::embedding_forward(ctx, ge.data(), gtok->data(), gwte->data(), gwpe->data(), b, t, c);
  cuda::embedding_backward(ctx, gdwte->data(), gdwpe->data(), gdout->data(), gtok->data(), b, t, c,
                           v);
  EXPECT_TRUE(same_bits(ge.download(), e));
  EXPECT_TRUE(same_bits(gdwte->download(), dwte)) << "same order as the CPU";
  EXPECT_TRUE(same_bits(gdwpe->download(), dwpe));

  const auto logits = rand_vec(b * t * v, 12, 3.0f);
  std::vector<float> loss(b * t), probs(b * t * v), dl(b * t * v);
  cpu::softmax_xent_forward(loss.data(), probs.data(), logits.data(), tgt.data(), b * t, v);
  cpu::softmax_xent_backward(dl.data(), probs.data(), tgt.data(), 0.5f, b * t, v);
  auto glog = dev(ctx, logits);
  cuda::device_array<float> gl(ctx, loss.size()), gp(ctx, probs.size()), gdl(ctx, dl.size());
  cuda::softmax_xent_forward(ctx, gl.data(), gp.data(), glog->data(), gtgt->data(), b * t, v);
  cuda::softmax_xent_backward(ctx, gdl.data(), gp.data(), gtgt->data(), 0.5f, b * t, v);
  expect_close(gl.download(), loss, 1e-5f, "losses");
  expect_close(gdl.download(), dl, 1e-5f, "dlogits");
}

TEST_F(cuda_kernels, moe_routing_gather_combine_and_scatter_are_bitwise_the_cpu) {
  cuda::context ctx;
  const int n = 40, e = 5, k = 2, c = 16;
  for (const double cf : {0.0, 0.7}) {
    const auto logits = rand_vec(n * e, 20, 2.0f), x = rand_vec(n * c, 21);
    const auto dout = rand_vec(n * c, 22);
    cpu::routing r;
    cpu::gate_forward(r, logits.data(), n, e, k, cf);
    const int rows = r.rows();
    const auto ye = rand_vec(std::size_t(rows) * c, 23), dxs = rand_vec(std::size_t(rows) * c, 24);
    std::vector<float> xs(rows * c), out(n * c), dye(rows * c), dw(n * k), dl(n * e),
        dx(n * c, 0.5f);
    cpu::moe_gather(xs.data(), x.data(), r, c);
    cpu::moe_combine_forward(out.data(), ye.data(), r, c);
    cpu::moe_combine_backward(dye.data(), dw.data(), dout.data(), ye.data(), r, c);
    cpu::gate_backward(dl.data(), r, dw.data(), 0.01f);
    cpu::moe_scatter_add(dx.data(), dxs.data(), r, c);

    auto glog = dev(ctx, logits), gx = dev(ctx, x), gdout = dev(ctx, dout);
    auto gye = dev(ctx, ye), gdxs = dev(ctx, dxs), gdx = dev(ctx, std::vector<float>(n * c, 0.5f));
    cuda::device_routing gr;
    cuda::gate_forward(ctx, gr, glog->data(), n, e, k, cf);
    EXPECT_EQ(gr.host.token, r.token);
    cuda::device_array<float> gxs(ctx, xs.size()), gout(ctx, out.size()), gdye(ctx, dye.size()),
        gdw(ctx, dw.size()), gdl(ctx, dl.size());
    cuda::moe_gather(ctx, gxs.data(), gx->data(), gr, c);
    cuda::moe_combine_forward(ctx, gout.data(), gye->data(), gr, c);
    cuda::moe_combine_backward(ctx, gdye.data(), gdw.data(), gdout->data(), gye->data(), gr, c);
    cuda::gate_backward(ctx, gdl.data(), gr, gdw.data(), 0.01f);
    cuda::moe_scatter_add(ctx, gdx->data(), gdxs->data(), gr, c);
    EXPECT_TRUE(same_bits(gxs.download(), xs));
    EXPECT_TRUE(same_bits(gout.download(), out));
    EXPECT_TRUE(same_bits(gdye.download(), dye));
    EXPECT_TRUE(same_bits(gdw.download(), dw));
    EXPECT_TRUE(same_bits(gdl.download(), dl));
    EXPECT_TRUE(same_bits(gdx->download(), dx));
  }
}

}  // namespace
}  // namespace moevement::models

namespace moevement::models {
namespace {

// A context names its device; one past the visible ones is refused, and a context built on one
// thread runs kernels from another (CUDA's current device is per thread).
TEST(cuda_context, picks_its_device_and_works_from_any_thread) {
  if (!cuda::compiled()) GTEST_SKIP() << "this build has no CUDA backend";
  if (cuda::device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  EXPECT_THROW(cuda::context(cuda::device_count()), std::invalid_argument);
  EXPECT_THROW(cuda::context(-1), std::invalid_argument);
  const int last = cuda::device_count() - 1;
  cuda::context ctx(last);
  EXPECT_EQ(ctx.device(), last);
  const std::vector<float> x{1.0f, -2.0f, 3.0f}, y{0.5f, 0.5f, 0.5f};
  std::vector<float> got;
  std::thread other([&] {
    cuda::device_array<float> a(ctx, 3), b(ctx, 3), out(ctx, 3);
    a.upload(x);
    b.upload(y);
    cuda::add(ctx, out.data(), a.data(), b.data(), 3);
    got = out.download();
  });
  other.join();
  EXPECT_EQ(got, (std::vector<float>{1.5f, -1.5f, 3.5f}));
}

}  // namespace
}  // namespace moevement::models
