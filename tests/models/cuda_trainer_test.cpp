// Training on the GPU: the optimizer is bitwise the CPU's, whole runs repeat bit for bit, and
// the model learns as the CPU's does. Needs a GPU: skips cleanly without one (the error a user
// then gets is checked in tests/launcher/train_test.cpp).
#include "models/cuda/trainer.hpp"

#include "models/cuda/stage.hpp"
#include "models/data.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "models/cuda/device.hpp"
#include "models/cuda/kernels.hpp"
#include "models/rng.hpp"
#include "models/trainer.hpp"

namespace moevement::models {
namespace {

class cuda_trainer : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::compiled()) GTEST_SKIP() << "this build has no CUDA backend";
    if (cuda::device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  }
};

std::vector<float> download(cuda::context& ctx, const float* p, std::size_t n) {
  std::vector<float> out(n);
  cuda::copy_to_host(ctx, out.data(), p, n * sizeof(float));
  return out;
}

bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

train_config tiny_train() {
  train_config t;
  t.micro_batches = 2;
  t.micro_batch_size = 4;
  t.seq_len = 32;
  t.lr = 3e-3f;
  t.val_batches = 2;
  return t;
}

// AdamW and the compute-weight rounding on the device give the CPU's bits, for every dtype,
// with weight decay, clipping (grad_mul) and rounding edge cases (ties, subnormals, overflow).
TEST_F(cuda_trainer, optimizer_and_rounding_are_bitwise_the_cpu) {
  cuda::context ctx;
  for (const dtype dt : {dtype::bf16, dtype::f16, dtype::f32}) {
    operator_state op("w", op_kind::attention,
                      {{"a", {37, 29}, 0.02f, 0.0f, true}, {"b", {301}, 0.0f, 1.0f, false}}, dt);
    op.init(7, 3);
    const auto n = std::size_t(op.numel());
    const auto key = make_key({11, std::uint64_t(dt)});
    for (std::size_t i = 0; i < n; ++i) {
      op.grad()[i] = float(random_normal(key, i)) * 0.3f;
      op.adam_m()[i] = float(random_normal(key, i + n)) * 0.01f;
      op.adam_v()[i] = float(random_uniform(key, i + 2 * n)) * 1e-4f;
    }
    // rounding edge cases in the master: halfway ties, f16 subnormals, beyond f16's range
    const float edges[] = {1.0f + 0x1p-8f, 1.0f + 0x1p-11f, 3e-6f,    -7e-8f,
                           70000.0f,       -1e38f,          0x1p-24f, 65519.0f};
    for (std::size_t i = 0; i < std::size(edges); ++i) op.master()[i * 13] = edges[i];
    op.set_step(4);
    const adamw_config cfg{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f};
    const float grad_mul = 0.37f;

    cuda::device_array<float> w(ctx, n), m(ctx, n), v(ctx, n), g(ctx, n), c(ctx, n);
    auto up = [&](cuda::device_array<float>& d, std::span<const float> h) {
      cuda::copy_to_device(ctx, d.data(), h.data(), h.size() * sizeof(float));
    };
    up(w, op.master());
    up(m, op.adam_m());
    up(v, op.adam_v());
    up(g, op.grad());
    // compute weights of the master before the step
    cuda::round_to_compute(ctx, c.data(), w.data(), long(n), dt);
    op.refresh_compute();
    ASSERT_TRUE(same_bits(download(ctx, c.data(), n), {op.weight(0), n})) << dtype_name(dt);

    const auto [bc1, bc2] = adamw_bias_corrections(cfg, op.step() + 1);
    cuda::adamw_scalars a{cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, 0.0f, bc1, bc2, grad_mul};
    const long split = 37 * 29;
    a.weight_decay = cfg.weight_decay;
    cuda::adamw_step(ctx, w.data(), m.data(), v.data(), g.data(), split, a);
    a.weight_decay = 0.0f;
    cuda::adamw_step(ctx, w.data() + split, m.data() + split, v.data() + split, g.data() + split,
                     long(n) - split, a);
    cuda::round_to_compute(ctx, c.data(), w.data(), long(n), dt);
    op.adamw_step(cfg, grad_mul);
    EXPECT_TRUE(same_bits(download(ctx, w.data(), n), op.master())) << dtype_name(dt);
    EXPECT_TRUE(same_bits(download(ctx, m.data(), n), op.adam_m())) << dtype_name(dt);
    EXPECT_TRUE(same_bits(download(ctx, v.data(), n), op.adam_v())) << dtype_name(dt);
    EXPECT_TRUE(same_bits(download(ctx, c.data(), n), {op.weight(0), n})) << dtype_name(dt);
  }
}

// The gradient norm's per-operator sums are the CPU's bits (so clipping decides the same),
// for lengths with and without a tail past the last multiple of 8.
TEST_F(cuda_trainer, sum_squares_is_bitwise_the_cpu) {
  cuda::context ctx;
  std::vector<operator_state> ops;
  for (const std::int64_t len : {1'000'003, 64, 7, 1}) {
    ops.emplace_back("g", op_kind::expert, std::vector<param_spec>{{"w", {len}, 0.0f, 0.0f, true}},
                     dtype::bf16);
  }
  std::vector<std::unique_ptr<cuda::device_array<float>>> dev;
  std::vector<const float*> ptrs;
  std::vector<long> sizes;
  for (std::size_t k = 0; k < ops.size(); ++k) {
    auto g = ops[k].grad();
    const auto key = make_key({5, k});
    for (std::size_t i = 0; i < g.size(); ++i) g[i] = float(random_normal(key, i)) * 1e-3f;
    dev.push_back(std::make_unique<cuda::device_array<float>>(ctx, g.size()));
    cuda::copy_to_device(ctx, dev.back()->data(), g.data(), g.size() * sizeof(float));
    ptrs.push_back(dev.back()->data());
    sizes.push_back(long(g.size()));
  }
  cuda::device_array<double> out(ctx, ops.size());
  cuda::sum_squares(ctx, out.data(), ptrs, sizes);
  const auto got = out.download();
  for (std::size_t k = 0; k < ops.size(); ++k) {
    const double want = ops[k].grad_sq_sum();
    EXPECT_EQ(std::memcmp(&got[k], &want, sizeof(double)), 0)
        << "length " << sizes[k] << ": " << got[k] << " vs " << want;
  }
}

// The same config twice: the same losses and the same state_hash, bit for bit. Also with fp16
// compute weights (the loss scaler) and two data-parallel replicas (the left fold).
TEST_F(cuda_trainer, two_runs_give_the_same_state_hash) {
  for (const dtype dt : {dtype::bf16, dtype::f16}) {
    model_config m = preset("tiny");
    m.compute_dtype = dt;
    train_config t = tiny_train();
    t.data_parallel = dt == dtype::f16 ? 2 : 1;
    std::uint64_t hash[2];
    std::vector<double> losses[2];
    for (int run = 0; run < 2; ++run) {
      cuda::trainer tr(m, t);
      for (int i = 0; i < 5; ++i) losses[run].push_back(tr.train_iteration().loss);
      losses[run].push_back(tr.validation_loss());
      hash[run] = tr.state_hash();
    }
    EXPECT_EQ(hash[0], hash[1]) << dtype_name(dt);
    EXPECT_EQ(losses[0], losses[1]) << dtype_name(dt);
    // the seed reaches the state
    t.seed = 2;
    cuda::trainer other(m, t);
    other.train_iteration();
    EXPECT_NE(other.state_hash(), hash[0]);
  }
}

// Same init and batches as the CPU: the first loss agrees to rounding (the GEMMs sum in another
// order), and training brings the loss well below ln(256) = 5.55 as on the CPU.
TEST_F(cuda_trainer, learns_like_the_cpu) {
  const model_config m = preset("tiny");
  const train_config t = tiny_train();
  cuda::trainer gpu(m, t);
  trainer cpu(m, t);
  EXPECT_EQ(gpu.state_hash(), cpu.state_hash()) << "the same initial state";
  const auto g0 = gpu.train_iteration();
  const auto c0 = cpu.train_iteration();
  EXPECT_NEAR(g0.loss, c0.loss, 1e-4);
  EXPECT_NEAR(g0.aux_loss, c0.aux_loss, 1e-3);
  EXPECT_NEAR(g0.grad_norm, c0.grad_norm, 1e-3 * c0.grad_norm);
  double last = 0.0;
  for (int i = 1; i < 60; ++i) last = gpu.train_iteration().loss;
  EXPECT_LT(last, 4.0) << "the GPU model did not learn";
  const double val = gpu.validation_loss();
  EXPECT_TRUE(std::isfinite(val));
  EXPECT_LT(val, 4.2);
  // popularity counters are kept as on the CPU: every token's K slots are counted
  const auto& gate = gpu.model().ops()[gpu.model().gate(0)];
  std::int64_t routed = 0;
  for (const auto r : gate.routed_tokens()) routed += r;
  EXPECT_EQ(routed, std::int64_t(t.micro_batches) * t.micro_batch_size * t.seq_len * m.top_k);
}

// cuda::stage, as the engine drives it: against the CPU stage (to rounding), frozen operators
// (bitwise the same forward and input gradient as active, no weight gradient), and a pipeline
// of two GPU stages against one (bitwise: activations cross as exact fp32).
TEST_F(cuda_trainer, gpu_stage_matches_the_cpu_and_splits_and_freezes_without_a_bit) {
  const model_config m = preset("tiny");
  const train_config t = tiny_train();
  const corpus data = corpus::load(t.corpus, t.val_fraction, t.seq_len);
  const int n = t.micro_batch_size * t.seq_len;
  std::vector<std::int32_t> tok(static_cast<std::size_t>(n)), tgt(tok.size());
  fill_batch(data, split::train, 1, 0, 0, 0, t.micro_batch_size, t.seq_len, tok.data(), tgt.data());
  cuda::context ctx;

  // whole model on the GPU and on the CPU
  moe_model gm(m, 1), cm(m, 1);
  cuda::stage whole(ctx, gm, partition(m, 1)[0], t.micro_batch_size, t.seq_len);
  stage cpu_whole(cm, partition(m, 1)[0], t.micro_batch_size, t.seq_len);
  const double gl = whole.forward(0, tok.data(), nullptr, tgt.data()).loss;
  const double cl = cpu_whole.forward(0, tok.data(), nullptr, tgt.data()).loss;
  EXPECT_NEAR(gl, cl, 1e-5);
  whole.backward(0, nullptr, 1.0f);
  cpu_whole.backward(0, nullptr, 1.0f);
  whole.download_grads();
  for (std::size_t i = 0; i < gm.ops().size(); ++i) {
    EXPECT_NEAR(std::sqrt(gm.ops()[i].grad_sq_sum()), std::sqrt(cm.ops()[i].grad_sq_sum()),
                1e-3 * std::sqrt(cm.ops()[i].grad_sq_sum()) + 1e-7)
        << gm.ops()[i].name();
  }
  EXPECT_EQ(whole.in_flight(), 0u);

  // two GPU stages: the same loss and the same gradients, bit for bit
  moe_model pm(m, 1);
  const auto parts = partition(m, 2);
  cuda::stage s0(ctx, pm, parts[0], t.micro_batch_size, t.seq_len);
  cuda::stage s1(ctx, pm, parts[1], t.micro_batch_size, t.seq_len);
  const auto a = s0.forward(0, tok.data(), nullptr, nullptr);
  const std::vector<float> act(a.activation.begin(), a.activation.end());
  const auto b = s1.forward(0, nullptr, act.data(), tgt.data());
  EXPECT_EQ(b.loss, gl);
  const auto dx = s1.backward(0, nullptr, 1.0f);
  const std::vector<float> g(dx.begin(), dx.end());
  s0.backward(0, g.data(), 1.0f);
  s0.download_grads();
  s1.download_grads();
  for (std::size_t i = 0; i < pm.ops().size(); ++i) {
    EXPECT_TRUE(same_bits(pm.ops()[i].grad(), gm.ops()[i].grad())) << pm.ops()[i].name();
  }

  // stage 1 with every operator frozen (compute weights loaded as a snapshot would): the
  // same loss and input gradient, bit for bit, and no weight gradient
  moe_model fm(m, 1);
  for (std::size_t i = parts[1].first_op; i < parts[1].last_op; ++i) {
    auto& op = fm.ops()[i];
    const std::vector<std::byte> bytes(op.compute_bytes().begin(), op.compute_bytes().end());
    op.set_mode(op_mode::frozen);
    op.set_compute_bytes(bytes);
  }
  cuda::stage f1(ctx, fm, parts[1], t.micro_batch_size, t.seq_len);
  EXPECT_EQ(f1.forward(0, nullptr, act.data(), tgt.data()).loss, b.loss);
  const auto fdx = f1.backward(0, nullptr, 1.0f);
  EXPECT_TRUE(same_bits(fdx, g)) << "frozen operators change the input gradient";
  std::vector<float> dev_grad(static_cast<std::size_t>(fm.ops()[parts[1].first_op].numel()));
  cuda::copy_to_host(ctx, dev_grad.data(), f1.grads(parts[1].first_op),
                     dev_grad.size() * sizeof(float));
  for (const float x : dev_grad) ASSERT_EQ(x, 0.0f) << "a frozen operator got a gradient";
  EXPECT_THROW(f1.backward(0, nullptr, 1.0f), std::logic_error);
}

}  // namespace
}  // namespace moevement::models
