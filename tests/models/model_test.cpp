// Operators, stages and training: whole-model gradient check, frozen == active bitwise,
// pipelining changes no bit, determinism across runs and BLIS thread counts, learning.
#include "models/model.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "models/data.hpp"
#include "models/trainer.hpp"

namespace moevement::models {
namespace {

train_config test_train() {
  train_config t;
  t.micro_batches = 2;
  t.micro_batch_size = 4;
  t.seq_len = 16;
  t.iterations = 4;
  t.val_batches = 2;
  return t;
}

bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

TEST(model, canonical_operator_order_and_partition) {
  const model_config m = preset("tiny");
  moe_model model(m, 1);
  ASSERT_EQ(model.ops().size(), 1 + 4 * (4 + 4) + 2u);
  EXPECT_EQ(model.ops()[model.gate(2)].name(), "layer2.gate");
  EXPECT_EQ(model.ops()[model.expert(3, 1)].name(), "layer3.expert1");
  EXPECT_EQ(model.ops()[model.head()].name(), "head");
  std::int64_t params = 0;
  for (const auto& op : model.ops()) params += op.numel();
  EXPECT_EQ(params, m.parameter_count());
  EXPECT_LT(params, 1'000'000);
  for (int s : {1, 2, 3, 4}) {
    const auto parts = partition(m, s);
    ASSERT_EQ(int(parts.size()), s);
    EXPECT_EQ(parts.front().first_op, 0u);
    EXPECT_EQ(parts.back().last_op, model.ops().size());
    for (int i = 1; i < s; ++i) {
      EXPECT_EQ(parts[i].first_op, parts[i - 1].last_op);
      EXPECT_EQ(parts[i].first_layer, parts[i - 1].last_layer);
    }
  }
  EXPECT_THROW(partition(m, 5), std::invalid_argument);
}

TEST(model, gradient_square_sum_has_its_documented_fixed_order) {
  operator_state op("x", op_kind::norm, {{"w", {27}, 0.0f, 1.0f, false}}, dtype::f32);
  for (int j = 0; j < 27; ++j) op.grad()[j] = 0.1f * float(j * j % 11) - 0.37f;
  double part[8] = {};
  for (int j = 0; j < 24; ++j) part[j % 8] += double(op.grad()[j]) * op.grad()[j];
  double want = 0.0;
  for (const double p : part) want += p;
  for (int j = 24; j < 27; ++j) want += double(op.grad()[j]) * op.grad()[j];
  EXPECT_EQ(op.grad_sq_sum(), want);
  op.set_mode(op_mode::frozen);
  EXPECT_EQ(op.grad_sq_sum(), 0.0);
}

TEST(model, paper_presets_have_about_the_published_parameter_counts) {
  const std::pair<const char*, double> want[] = {
      {"moe-llava", 2.9e9}, {"gpt-moe", 7.3e9}, {"qwen-moe", 14.3e9}, {"deepseek-moe", 16.4e9}};
  for (const auto& [name, total] : want) {
    const auto m = preset(name);
    EXPECT_NEAR(double(m.parameter_count()) / total, 1.0, 0.1) << name;
  }
  EXPECT_GT(preset("small").parameter_count(), 10'000'000);
  EXPECT_LT(preset("small").parameter_count(), 100'000'000);
}

// Directional finite differences through the whole model (f32 compute weights so that a
// perturbation of the master reaches the kernels): for each operator, d = grad / |grad| and
// (L(w + eps d) - L(w - eps d)) / 2 eps must equal |grad|.
TEST(model, whole_model_gradient_matches_finite_differences_per_operator) {
  model_config m = preset("tiny");
  m.compute_dtype = dtype::f32;
  m.layers = 2;
  // top-k = E: a token's expert set never changes, so the loss is smooth (with k < E a
  // perturbation can flip a near-tie choice, a true discontinuity; kernels_test checks k < E
  // in fp64 where the step is small enough not to flip).
  m.top_k = m.experts;
  m.aux_loss_coef = 0.1f;
  train_config t = test_train();
  t.micro_batch_size = 2;
  t.seq_len = 8;
  const corpus c = corpus::load(t.corpus, t.val_fraction, t.seq_len);
  moe_model model(m, 3);
  stage st(model, partition(m, 1)[0], t.micro_batch_size, t.seq_len);
  std::vector<std::int32_t> tok(16), tgt(16);
  fill_batch(c, split::train, 1, 0, 0, 0, 2, 8, tok.data(), tgt.data());
  auto loss = [&] {
    const auto r = st.forward(-1, tok.data(), nullptr, tgt.data(), false);
    return r.loss + m.aux_loss_coef * r.aux_loss;
  };
  for (auto& op : model.ops()) op.zero_grad();
  st.forward(0, tok.data(), nullptr, tgt.data());
  st.backward(0, nullptr, 1.0f);
  int checked = 0;
  for (auto& op : model.ops()) {
    const double norm = std::sqrt(op.grad_sq_sum());
    if (norm < 1e-4) continue;  // an expert that got no token this batch
    std::vector<float> dir(op.grad().begin(), op.grad().end());
    const std::vector<float> keep(op.master().begin(), op.master().end());
    const double eps = 1e-3;
    auto at = [&](double s) {
      for (std::size_t i = 0; i < dir.size(); ++i) {
        op.master()[i] = float(keep[i] + s * dir[i] / norm);
      }
      op.refresh_compute();
      return loss();
    };
    const double fd = (at(eps) - at(-eps)) / (2 * eps);
    at(0.0);
    std::copy(keep.begin(), keep.end(), op.master().begin());
    op.refresh_compute();
    EXPECT_NEAR(fd, norm, 0.03 * norm + 2e-4) << op.name();
    ++checked;
  }
  EXPECT_GE(checked, 12);
}

// Runs training with `replicas` data-parallel copies of the model, each split into `stages`
// stages in this process, exchanging copies of activations and gradients as the engine would:
// all forwards of the micro-batches, then their backwards in micro-batch order; then the
// replicas' gradients are summed in replica order and every replica steps.
std::uint64_t train_distributed(int stages, int replicas, const model_config& m,
                                const train_config& t) {
  const corpus c = corpus::load(t.corpus, t.val_fraction, t.seq_len);
  const auto parts = partition(m, stages);
  // one partial model per (replica, stage), holding only that stage's operators
  std::vector<std::vector<std::unique_ptr<moe_model>>> models(replicas);
  std::vector<std::vector<std::unique_ptr<stage>>> st(replicas);
  for (int d = 0; d < replicas; ++d) {
    for (const auto& r : parts) {
      models[d].push_back(std::make_unique<moe_model>(m, t.seed, r.first_op, r.last_op));
      st[d].push_back(std::make_unique<stage>(*models[d].back(), r, t.micro_batch_size, t.seq_len));
    }
  }
  auto owner = [&](int d, std::size_t i) -> operator_state& {
    for (int s = 0; s < stages; ++s) {
      if (i >= parts[s].first_op && i < parts[s].last_op) return models[d][s]->ops()[i];
    }
    throw std::logic_error("no owner");
  };
  const std::size_t n_ops = parts.back().last_op;
  std::vector<loss_scaler> scaler(replicas);
  const int n = t.micro_batch_size * t.seq_len;
  std::vector<std::int32_t> tok(n), tgt(n);
  const float loss_grad = 1.0f / float(t.micro_batches * replicas);
  for (std::int64_t it = 0; it < t.iterations; ++it) {
    for (int d = 0; d < replicas; ++d) {
      for (std::size_t i = 0; i < n_ops; ++i) owner(d, i).zero_grad();
      for (int mb = 0; mb < t.micro_batches; ++mb) {
        fill_batch(c, split::train, t.seed, it, d, mb, t.micro_batch_size, t.seq_len, tok.data(),
                   tgt.data());
        std::vector<float> x;
        for (int s = 0; s < stages; ++s) {
          const auto r =
              st[d][s]->forward(mb, tok.data(), x.empty() ? nullptr : x.data(), tgt.data());
          x.assign(r.activation.begin(), r.activation.end());  // "sent" to the next stage
        }
      }
      for (int mb = 0; mb < t.micro_batches; ++mb) {
        std::vector<float> g;
        for (int s = stages - 1; s >= 0; --s) {
          const auto r = st[d][s]->backward(mb, g.empty() ? nullptr : g.data(), loss_grad);
          g.assign(r.begin(), r.end());
        }
      }
    }
    // all-reduce: left fold in replica order, result on every replica
    for (std::size_t i = 0; i < n_ops; ++i) {
      std::vector<float> sum(owner(0, i).grad().begin(), owner(0, i).grad().end());
      for (int d = 1; d < replicas; ++d) {
        const auto g = owner(d, i).grad();
        for (std::size_t j = 0; j < sum.size(); ++j) sum[j] += g[j];
      }
      for (int d = 0; d < replicas; ++d)
        std::copy(sum.begin(), sum.end(), owner(d, i).grad().begin());
    }
    for (int d = 0; d < replicas; ++d) {
      std::vector<double> sq;  // gathered from the stages in canonical order
      for (std::size_t i = 0; i < n_ops; ++i) sq.push_back(owner(d, i).grad_sq_sum());
      const auto plan = plan_step(sq, scaler[d], t.grad_clip);
      const adamw_config a{t.lr, t.beta1, t.beta2, t.eps, t.weight_decay};
      for (std::size_t i = 0; i < n_ops; ++i) owner(d, i).adamw_step(a, plan.grad_mul);
    }
  }
  auto hash = [&](int d) {
    std::vector<std::uint64_t> digests;
    for (int s = 0; s < stages; ++s) {
      const auto part = models[d][s]->op_digests(parts[s].first_op, parts[s].last_op);
      digests.insert(digests.end(), part.begin(), part.end());
    }
    return state_hash(digests, scaler[d]);
  };
  for (int d = 1; d < replicas; ++d) EXPECT_EQ(hash(d), hash(0)) << "replica " << d;
  return hash(0);
}

TEST(model, a_partial_model_holds_only_its_stage_and_the_full_models_values) {
  const model_config m = preset("tiny");
  moe_model full(m, 5);
  const auto parts = partition(m, 2);
  moe_model part(m, 5, parts[1].first_op, parts[1].last_op);
  EXPECT_FALSE(part.ops()[0].allocated());
  EXPECT_TRUE(part.ops()[0].master().empty()) << "other stages' operators get no memory at all";
  EXPECT_TRUE(part.ops()[part.head()].allocated());
  EXPECT_EQ(part.op_digests(parts[1].first_op, parts[1].last_op),
            full.op_digests(parts[1].first_op, parts[1].last_op));
  EXPECT_THROW(part.op_digests(), std::logic_error);
  EXPECT_THROW(stage(part, parts[0], 2, 8), std::invalid_argument);
}

TEST(model, pipelining_over_1_2_and_4_stages_changes_no_bit) {
  const model_config m = preset("tiny");
  train_config t = test_train();
  t.iterations = 3;
  trainer tr(m, t);
  for (int i = 0; i < t.iterations; ++i) tr.train_iteration();
  const auto want = tr.state_hash();
  for (int s : {1, 2, 4}) EXPECT_EQ(train_distributed(s, 1, m, t), want) << s << " stages";
}

TEST(model, data_parallel_replicas_match_the_trainer_for_any_pipeline_depth) {
  const model_config m = preset("tiny");
  train_config t = test_train();
  t.iterations = 2;
  t.data_parallel = 3;
  trainer tr(m, t);
  for (int i = 0; i < t.iterations; ++i) tr.train_iteration();
  const auto want = tr.state_hash();
  for (int s : {1, 2}) EXPECT_EQ(train_distributed(s, 3, m, t), want) << s << " stages";
  t.data_parallel = 1;
  trainer single(m, t);
  for (int i = 0; i < t.iterations; ++i) single.train_iteration();
  EXPECT_NE(single.state_hash(), want) << "replicas see different data";
}

TEST(trainer, restoring_master_m_v_step_and_position_resumes_bit_exactly) {
  model_config m = preset("tiny");
  m.compute_dtype = dtype::f16;  // so the loss scaler is part of what must be restored
  const train_config t = test_train();
  trainer a(m, t);
  for (int i = 0; i < 3; ++i) a.train_iteration();
  trainer b(m, t);
  for (std::size_t i = 0; i < a.model().ops().size(); ++i) {
    const auto& from = a.model().ops()[i];
    auto& to = b.model().ops()[i];
    std::copy(from.master().begin(), from.master().end(), to.master().begin());
    std::copy(from.adam_m().begin(), from.adam_m().end(), to.adam_m().begin());
    std::copy(from.adam_v().begin(), from.adam_v().end(), to.adam_v().begin());
    to.set_step(from.step());
    to.refresh_compute();
  }
  b.set_position(a.iteration(), a.scaler());
  EXPECT_EQ(b.state_hash(), a.state_hash());
  for (int i = 0; i < 2; ++i) {
    a.train_iteration();
    b.train_iteration();
  }
  EXPECT_EQ(b.state_hash(), a.state_hash());
}

// Sparse checkpoint and sparse-to-dense conversion by replay (paper section 3.2) on the
// operator API: slot 0 (end of iteration 2) holds the full state of the even operators and the
// compute weights of the odd ones; slot 1 (end of iteration 3) the full state of the odd ones.
// Recovery loads slot 0 (odd operators frozen), replays iteration 3, activates the odd
// operators from slot 1, and continues: the result must be bit-identical to never failing.
// The global-norm clip couples all operators, so replay must reuse the step plan logged for
// iteration 3 (frozen operators have no gradient to contribute to the norm).
struct full_state {
  std::vector<float> master, m, v;
  std::int64_t step;
};
struct replay_fixture {
  model_config m = preset("tiny");
  train_config t = test_train();
  corpus c = corpus::load(t.corpus, t.val_fraction, t.seq_len);
  // forward+backward of iteration `it` on all micro-batches; returns the step plan
  step_plan grads(moe_model& model, std::int64_t it, loss_scaler& scaler) {
    stage st(model, partition(m, 1)[0], t.micro_batch_size, t.seq_len);
    const int n = t.micro_batch_size * t.seq_len;
    std::vector<std::int32_t> tok(n), tgt(n);
    for (auto& op : model.ops()) op.zero_grad();
    for (int mb = 0; mb < t.micro_batches; ++mb) {
      fill_batch(c, split::train, t.seed, it, 0, mb, t.micro_batch_size, t.seq_len, tok.data(),
                 tgt.data());
      st.forward(mb, tok.data(), nullptr, tgt.data());
      st.backward(mb, nullptr, 1.0f / float(t.micro_batches));
    }
    std::vector<double> sq;
    for (const auto& op : model.ops()) sq.push_back(op.grad_sq_sum());
    return plan_step(sq, scaler, t.grad_clip);
  }
  void step(moe_model& model, const step_plan& plan) {
    const adamw_config a{t.lr, t.beta1, t.beta2, t.eps, t.weight_decay};
    for (auto& op : model.ops()) op.adamw_step(a, plan.grad_mul);
  }
};

TEST(model, sparse_snapshots_and_replay_with_frozen_operators_recover_bit_exactly) {
  replay_fixture f;
  f.t.grad_clip = 0.05f;  // small enough that clipping is active every iteration
  moe_model model(f.m, f.t.seed);
  loss_scaler scaler;
  std::vector<full_state> slot0_full(model.ops().size()), slot1_full(model.ops().size());
  std::vector<std::vector<std::byte>> slot0_compute(model.ops().size());
  std::vector<step_plan> plans;
  for (std::int64_t it = 0; it < 6; ++it) {
    plans.push_back(f.grads(model, it, scaler));
    EXPECT_LT(plans.back().grad_mul, 1.0f) << "clipping is active";
    f.step(model, plans.back());
    for (std::size_t i = 0; i < model.ops().size(); ++i) {
      const auto& op = model.ops()[i];
      const full_state s{{op.master().begin(), op.master().end()},
                         {op.adam_m().begin(), op.adam_m().end()},
                         {op.adam_v().begin(), op.adam_v().end()},
                         op.step()};
      if (it == 2 && i % 2 == 0) slot0_full[i] = s;
      if (it == 2 && i % 2 == 1) {
        slot0_compute[i].assign(op.compute_bytes().begin(), op.compute_bytes().end());
      }
      if (it == 3 && i % 2 == 1) slot1_full[i] = s;
    }
  }
  const auto want = state_hash(model.op_digests(), scaler);

  auto recover = [&](bool reuse_logged_plan) {
    moe_model r(f.m, 999);  // a replacement: its own init is overwritten
    loss_scaler rs;
    auto load_full = [](operator_state& op, const full_state& s) {
      std::copy(s.master.begin(), s.master.end(), op.master().begin());
      std::copy(s.m.begin(), s.m.end(), op.adam_m().begin());
      std::copy(s.v.begin(), s.v.end(), op.adam_v().begin());
      op.set_step(s.step);
      op.refresh_compute();
    };
    for (std::size_t i = 0; i < r.ops().size(); ++i) {
      if (i % 2 == 0) {
        load_full(r.ops()[i], slot0_full[i]);
      } else {
        r.ops()[i].set_mode(op_mode::frozen);
        r.ops()[i].set_compute_bytes(slot0_compute[i]);
      }
    }
    const auto plan = f.grads(r, 3, rs);  // replay iteration 3
    f.step(r, reuse_logged_plan ? plans[3] : plan);
    for (std::size_t i = 1; i < r.ops().size(); i += 2) {
      load_full(r.ops()[i], slot1_full[i]);
      r.ops()[i].set_mode(op_mode::active);
    }
    for (std::int64_t it = 4; it < 6; ++it) f.step(r, f.grads(r, it, rs));
    return state_hash(r.op_digests(), rs);
  };
  EXPECT_EQ(recover(true), want);
  EXPECT_NE(recover(false), want) << "a norm over the active operators only is not the norm";
}

TEST(model, frozen_operators_give_bitwise_the_same_output_and_input_gradient) {
  const model_config m = preset("tiny");
  const train_config t = test_train();
  const corpus c = corpus::load(t.corpus, t.val_fraction, t.seq_len);
  moe_model active(m, 7), frozen(m, 7);
  // Freeze a mix of operators in `frozen`, wreck their FP32 state, and hand them the active
  // model's compute weights as a snapshot would.
  const std::vector<std::size_t> freeze = {
      frozen.embedding(),  frozen.norm2(0),     frozen.attention(1), frozen.gate(1),
      frozen.expert(1, 0), frozen.expert(2, 3), frozen.expert(3, 1), frozen.head()};
  for (const auto i : freeze) {
    auto& op = frozen.ops()[i];
    op.set_mode(op_mode::frozen);
    std::fill(op.master().begin(), op.master().end(), 123.0f);
    std::fill(op.adam_m().begin(), op.adam_m().end(), 0.5f);
    op.set_compute_bytes(active.ops()[i].compute_bytes());
    EXPECT_EQ(op.grad(0), nullptr);
  }
  const auto parts = partition(m, 2);
  stage a0(active, parts[0], t.micro_batch_size, t.seq_len),
      a1(active, parts[1], t.micro_batch_size, t.seq_len);
  stage f0(frozen, parts[0], t.micro_batch_size, t.seq_len),
      f1(frozen, parts[1], t.micro_batch_size, t.seq_len);
  const int n = t.micro_batch_size * t.seq_len;
  std::vector<std::int32_t> tok(n), tgt(n);
  for (int mb = 0; mb < 2; ++mb) {
    fill_batch(c, split::train, 1, 0, 0, mb, t.micro_batch_size, t.seq_len, tok.data(), tgt.data());
    const auto ya = a0.forward(mb, tok.data(), nullptr, tgt.data());
    const auto yf = f0.forward(mb, tok.data(), nullptr, tgt.data());
    ASSERT_TRUE(same_bits(ya.activation, yf.activation)) << "stage 0 output, mb " << mb;
    const std::vector<float> xa(ya.activation.begin(), ya.activation.end());
    const std::vector<float> xf(yf.activation.begin(), yf.activation.end());
    const auto la = a1.forward(mb, nullptr, xa.data(), tgt.data());
    const auto lf = f1.forward(mb, nullptr, xf.data(), tgt.data());
    ASSERT_EQ(std::memcmp(&la.loss, &lf.loss, sizeof(double)), 0);
    const auto ga = a1.backward(mb, nullptr, 0.5f);
    const std::vector<float> gac(ga.begin(), ga.end());
    const auto gf = f1.backward(mb, nullptr, 0.5f);
    ASSERT_TRUE(same_bits(gac, gf)) << "input gradient of stage 1, mb " << mb;
    a0.backward(mb, gac.data(), 0.5f);
    f0.backward(mb, gac.data(), 0.5f);
  }
  for (std::size_t i = 0; i < active.ops().size(); ++i) {
    const bool is_frozen = std::find(freeze.begin(), freeze.end(), i) != freeze.end();
    if (is_frozen) {
      EXPECT_EQ(frozen.ops()[i].grad_sq_sum(), 0.0) << frozen.ops()[i].name();
    } else {
      EXPECT_TRUE(same_bits(active.ops()[i].grad(), frozen.ops()[i].grad()))
          << "weight gradient of active " << active.ops()[i].name();
    }
  }
  // an update leaves frozen operators' state alone
  const auto before = frozen.ops()[frozen.gate(1)].digest();
  for (auto& op : frozen.ops()) op.adamw_step({1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f}, 1.0f);
  EXPECT_EQ(frozen.ops()[frozen.gate(1)].digest(), before);
  EXPECT_EQ(frozen.ops()[frozen.gate(1)].step(), 0);
  EXPECT_EQ(frozen.ops()[frozen.norm1(0)].step(), 1);
}

TEST(model, popularity_counters_count_every_routed_assignment) {
  const model_config m = preset("tiny");
  train_config t = test_train();
  t.iterations = 1;
  trainer tr(m, t);
  tr.train_iteration();
  for (int l = 0; l < m.layers; ++l) {
    const auto& g = tr.model().ops()[tr.model().gate(l)];
    std::int64_t routed = 0;
    double probs = 0.0;
    for (int e = 0; e < m.experts; ++e) routed += g.routed_tokens()[e], probs += g.prob_sums()[e];
    EXPECT_EQ(routed, tr.tokens_per_iteration() * m.top_k);
    EXPECT_NEAR(probs, double(tr.tokens_per_iteration()), 1e-3);
  }
}

TEST(trainer, tiny_learns_real_text_well_below_uniform) {
  const model_config m = preset("tiny");
  train_config t = test_train();
  t.iterations = 80;
  t.micro_batch_size = 8;
  t.seq_len = 32;
  t.val_batches = 4;
  trainer tr(m, t);
  const double before = tr.validation_loss();
  EXPECT_NEAR(before, std::log(256.0), 0.3);
  for (int i = 0; i < t.iterations; ++i) tr.train_iteration();
  const double after = tr.validation_loss();
  EXPECT_LT(after, 3.6) << "ln(256) = 5.545";
}

TEST(trainer, two_runs_give_the_same_state_hash) {
  const model_config m = preset("tiny");
  const train_config t = test_train();
  std::uint64_t h[2], initial = 0;
  for (int r = 0; r < 2; ++r) {
    trainer tr(m, t);
    initial = tr.state_hash();
    for (int i = 0; i < t.iterations; ++i) tr.train_iteration();
    h[r] = tr.state_hash();
  }
  EXPECT_EQ(h[0], h[1]);
  EXPECT_NE(h[0], initial);
}

TEST(trainer, one_and_two_blis_threads_give_the_same_state_hash) {
  model_config m = preset("tiny");
  m.d_model = 64;
  m.d_ff = 192;
  train_config t = test_train();
  // big enough that BLIS splits the projection GEMMs (N = 256 rows), small enough to be quick
  t.micro_batch_size = 4;
  t.seq_len = 64;
  t.micro_batches = 1;
  t.iterations = 1;
  std::uint64_t h[2];
  for (int threads : {1, 2}) {
    t.blis_threads = threads;
    trainer tr(m, t);
    for (int i = 0; i < t.iterations; ++i) tr.train_iteration();
    h[threads - 1] = tr.state_hash();
  }
  EXPECT_EQ(h[0], h[1]);
}

TEST(trainer, loss_scaler_halves_on_overflow_grows_after_a_window_and_skips_the_step) {
  loss_scaler s{true, 1024.0f, 0, 3};
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> sq{1.0, inf, 2.0};
  auto plan = plan_step(sq, s, 1.0f);
  EXPECT_FALSE(plan.apply);
  EXPECT_EQ(s.scale, 512.0f);
  sq = {4.0 * 512 * 512, 0.0, 0.0};  // norm 2 after unscaling: clipped to 1
  plan = plan_step(sq, s, 1.0f);
  EXPECT_TRUE(plan.apply);
  EXPECT_DOUBLE_EQ(plan.grad_norm, 2.0);
  EXPECT_EQ(plan.grad_mul, float(1.0 / 512 * 0.5));
  plan_step(sq, s, 1.0f);
  plan_step(sq, s, 1.0f);
  EXPECT_EQ(s.scale, 1024.0f) << "three good steps double it";
  EXPECT_EQ(s.good_steps, 0);
  // It never grows to infinity (whose half is infinity: every later step would be skipped).
  loss_scaler top{true, 0x1p127f, 0, 1};
  plan_step(std::vector<double>{1.0}, top, 1.0f);
  EXPECT_EQ(top.scale, 0x1p127f);
  EXPECT_FALSE(plan_step(std::vector<double>{inf}, top, 1.0f).apply);
  EXPECT_EQ(top.scale, 0x1p126f) << "and halves from there on an overflow";
  loss_scaler off;  // bf16/f32: no scaling, but an overflow still skips the step
  EXPECT_FALSE(plan_step(std::vector<double>{inf}, off, 1.0f).apply);
  EXPECT_EQ(off.scale, 1.0f);
}

TEST(trainer, fp16_compute_weights_train_reproducibly_with_the_scaler_in_the_state) {
  model_config m = preset("tiny");
  m.compute_dtype = dtype::f16;
  train_config t = test_train();
  std::uint64_t h[2];
  for (int r = 0; r < 2; ++r) {
    trainer tr(m, t);
    EXPECT_TRUE(tr.scaler().enabled);
    for (int i = 0; i < t.iterations; ++i) EXPECT_TRUE(tr.train_iteration().applied);
    EXPECT_EQ(tr.model().ops()[0].compute_bytes().size(), 2 * tr.model().ops()[0].master().size());
    h[r] = tr.state_hash();
  }
  EXPECT_EQ(h[0], h[1]);
  // the same weights with another scaler state hash differently
  trainer tr(m, t);
  loss_scaler other = tr.scaler();
  other.good_steps += 1;
  EXPECT_NE(state_hash(tr.model().op_digests(), other), tr.state_hash());
}

TEST(model, stage_abort_drops_in_flight_and_validation_returns_the_activation) {
  const model_config m = preset("tiny");
  const train_config t = test_train();
  const corpus c = corpus::load(t.corpus, t.val_fraction, t.seq_len);
  moe_model model(m, 1);
  const auto parts = partition(m, 2);
  stage s0(model, parts[0], t.micro_batch_size, t.seq_len);
  const int n = t.micro_batch_size * t.seq_len;
  std::vector<std::int32_t> tok(n), tgt(n);
  fill_batch(c, split::train, 1, 0, 0, 0, t.micro_batch_size, t.seq_len, tok.data(), tgt.data());
  const auto r = s0.forward(0, tok.data(), nullptr, tgt.data());
  const std::vector<float> train_out(r.activation.begin(), r.activation.end());
  s0.forward(1, tok.data(), nullptr, tgt.data());
  EXPECT_EQ(s0.in_flight(), 2u);
  s0.abort();
  EXPECT_EQ(s0.in_flight(), 0u);
  EXPECT_THROW(s0.backward(0, train_out.data(), 1.0f), std::logic_error);
  // validation keeps nothing in flight but hands out the same activation a training forward
  // computes (the next stage of a pipeline needs it)
  const auto v = s0.forward(-1, tok.data(), nullptr, tgt.data(), false);
  EXPECT_EQ(s0.in_flight(), 0u);
  EXPECT_TRUE(same_bits(v.activation, train_out));
}

}  // namespace
}  // namespace moevement::models
