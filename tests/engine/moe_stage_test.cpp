// The built-in stage: setup errors name the key, boundary sizes are checked, an aborted
// iteration leaves nothing in flight, the registry builds it by name. On a GPU: the optimizer
// step on the device (device_state) gives the host step's bits, whichever copy held the state.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <stdexcept>
#include <vector>

#include "engine/stage_model.hpp"
#include "engine/stage_registry.hpp"
#include "models/cuda/device.hpp"

namespace moevement::engine {
namespace {

stage_setup tiny_setup(int stage, int stages) {
  stage_setup s;
  s.model = models::preset("tiny");
  s.train.micro_batches = 2;
  s.train.micro_batch_size = 2;
  s.train.seq_len = 8;
  s.stage = stage;
  s.stages = stages;
  return s;
}

std::string key_of(const stage_setup& s) {
  try {
    make_moe_stage(s);
  } catch (const models::config_error& e) {
    return e.key();
  }
  return "(accepted)";
}

TEST(moe_stage, bad_setup_names_the_key) {
  EXPECT_EQ(key_of(tiny_setup(2, 2)), "parallel.pp");  // stage >= stages
  EXPECT_EQ(key_of(tiny_setup(-1, 2)), "parallel.pp");
  EXPECT_EQ(key_of(tiny_setup(0, 5)), "parallel.pp");  // more stages than tiny's 4 layers
  auto s = tiny_setup(0, 2);
  s.replica = 1;  // of 1
  EXPECT_EQ(key_of(s), "parallel.dp");
  s.replicas = 2;  // but train.data_parallel is 1
  EXPECT_EQ(key_of(s), "parallel.dp");
  s = tiny_setup(0, 1);
  s.train.seq_len = 1000;  // > model.max_seq_len
  EXPECT_NE(key_of(s), "(accepted)");
  try {
    make_moe_stage(tiny_setup(0, 5));
  } catch (const models::config_error& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers"), std::string::npos) << e.what();
  }
}

TEST(moe_stage, owns_its_partition_and_checks_boundaries) {
  const auto s0 = make_moe_stage(tiny_setup(0, 2));
  const auto s1 = make_moe_stage(tiny_setup(1, 2));
  const auto parts = models::partition(models::preset("tiny"), 2);
  EXPECT_EQ(s0->operators().size(), parts[0].last_op - parts[0].first_op);
  EXPECT_EQ(s1->operators().size(), parts[1].last_op - parts[1].first_op);
  EXPECT_EQ(s0->operators().front()->name(), "embedding");
  EXPECT_EQ(s1->operators().back()->name(), "head");
  EXPECT_EQ(s0->boundary_floats(), 2u * 8u * 32u);
  s0->begin_iteration(0);
  s1->begin_iteration(0);
  const std::vector<float> wrong(7);
  EXPECT_THROW(s0->forward(0, wrong), std::invalid_argument);  // the first stage takes none
  EXPECT_THROW(s1->forward(0, wrong), std::invalid_argument);
  EXPECT_THROW(s0->forward(2, {}), std::out_of_range);  // micro_batches is 2
  const auto a = s0->forward(0, {});
  const std::vector<float> x(a.activation.begin(), a.activation.end());
  ASSERT_EQ(x.size(), s0->boundary_floats());
  const auto out = s1->forward(0, x);
  EXPECT_TRUE(out.activation.empty());
  EXPECT_GT(out.loss, 0.0);
  // validation carries an activation too, and matches the last stage's loss path
  const auto v0 = s0->validate(0, {});
  const std::vector<float> xv(v0.activation.begin(), v0.activation.end());
  EXPECT_EQ(xv.size(), s0->boundary_floats());
  EXPECT_GT(s1->validate(0, xv).loss, 0.0);
}

TEST(moe_stage, abort_drops_micro_batches_in_flight) {
  const auto s0 = make_moe_stage(tiny_setup(0, 2));
  s0->begin_iteration(0);
  s0->forward(0, {});
  EXPECT_THROW(s0->forward(0, {}), std::logic_error);  // already in flight
  s0->abort_iteration();
  EXPECT_THROW(s0->backward(0, std::vector<float>(s0->boundary_floats()), 1.0f),
               std::logic_error);     // nothing left to run backward on
  const auto a = s0->forward(0, {});  // runs again after the abort
  const auto b_first = std::vector<float>(a.activation.begin(), a.activation.end());
  s0->begin_iteration(0);  // a new iteration also drops what is in flight
  const auto b = s0->forward(0, {});
  EXPECT_EQ(std::vector<float>(b.activation.begin(), b.activation.end()), b_first);
}

TEST(moe_stage, registry_builds_moe_by_name) {
  const auto reg = stage_registry::with_builtins();
  const auto st = reg.find("moe")(tiny_setup(0, 1));
  EXPECT_EQ(st->operators().size(), models::moe_model(models::preset("tiny"), 1).ops().size());
  try {
    reg.find("nope");
    FAIL();
  } catch (const models::config_error& e) {
    EXPECT_EQ(e.key(), "engine.stage");
  }
}

TEST(moe_stage, only_types_registered_with_experts_take_expert_parallelism) {
  auto reg = stage_registry::with_builtins();
  EXPECT_TRUE(reg.traits("moe").expert_parallel);
  EXPECT_NO_THROW(reg.check_expert_parallel("moe", 4));
  reg.add("dense", [](const stage_setup& s) { return make_moe_stage(s); });
  EXPECT_NO_THROW(reg.check_expert_parallel("dense", 1));
  try {
    reg.check_expert_parallel("dense", 2);
    FAIL() << "a type without experts took parallel.ep = 2";
  } catch (const models::config_error& e) {
    EXPECT_EQ(e.key(), "parallel.ep");
    EXPECT_NE(std::string(e.what()).find("dense"), std::string::npos) << e.what();
  }
}

// One iteration of a single-stage job on `st`: forwards and backwards of every micro-batch
// (the GPU stage brings its gradients back after the last), then the plan the engine would
// send. Returns the loss summed over the micro-batches.
double run_iteration(stage_model& st, const stage_setup& s, std::int64_t it) {
  const auto ops = st.operators();
  begin_operators(ops);
  st.begin_iteration(it);
  double loss = 0;
  for (int mb = 0; mb < s.train.micro_batches; ++mb) {
    loss += st.forward(mb, {}).loss;
    st.backward(mb, {}, 1.0f / float(s.train.micro_batches));
  }
  return loss;
}

TEST(moe_stage, a_gpu_stage_steps_on_the_device_with_the_host_steps_bits) {
  if (models::cuda::device_count() == 0) {
    GTEST_SKIP() << "no usable GPU: " << models::cuda::describe_device();
  }
  auto s = tiny_setup(0, 1);
  s.train.device = models::device::cuda;
  const auto dev = make_moe_stage(s);   // steps on the device
  const auto host = make_moe_stage(s);  // steps the host operators (the replay's way)
  ASSERT_NE(dev->device(), nullptr);
  const auto dops = dev->operators(), hops = host->operators();
  models::loss_scaler scaler;
  const auto same_state = [&](const char* when) {
    dev->device()->sync_to_host();
    EXPECT_EQ(operator_digests(dops), operator_digests(hops)) << when;
    for (std::size_t i = 0; i < dops.size(); ++i) {
      ASSERT_EQ(dops[i]->step(), hops[i]->step()) << when << ": " << dops[i]->name();
      ASSERT_EQ(0, std::memcmp(dops[i]->compute_bytes().data(), hops[i]->compute_bytes().data(),
                               dops[i]->compute_bytes().size()))
          << when << ": " << dops[i]->name();
    }
  };
  EXPECT_FALSE(dev->device()->state_on_device());
  for (std::int64_t it = 0; it < 6; ++it) {
    const double ld = run_iteration(*dev, s, it), lh = run_iteration(*host, s, it);
    EXPECT_EQ(ld, lh) << "iteration " << it << " computed on different weights";
    // One replica: once the state is on the device, the gradients stay there too.
    EXPECT_EQ(dev->device()->grads_on_device(), it > 0);
    const auto dev_sums =
        dev->device()->grads_on_device() ? dev->device()->grad_sq_sums() : gradient_sq_sums(dops);
    EXPECT_EQ(dev_sums, gradient_sq_sums(hops)) << "iteration " << it;
    const bool from_host = it == 2;  // as after a reduction across replicas on the host
    if (from_host) {
      std::vector<float> g(gradient_floats(hops));
      copy_gradients_out(hops, g);
      for (auto& x : g) x *= 0.5f;
      copy_gradients_in(hops, g);
      copy_gradients_in(dops, g);
    }
    const auto plan = models::plan_step(gradient_sq_sums(hops), scaler, s.train.grad_clip);
    dev->device()->step(plan, s.train, from_host);
    apply_step(hops, plan, s.train);
    EXPECT_TRUE(dev->device()->state_on_device());
    if (it == 3) same_state("after iteration 3");
  }
  same_state("after iteration 5");
  // The host copy written (a restore): the device takes it up before it computes or steps.
  for (std::size_t i = 0; i < dops.size(); ++i) {
    auto& op = *dops[i];
    for (auto& x : op.master()) x *= 0.75f;
    op.refresh_compute();
    auto& h = *hops[i];
    std::copy(op.master().begin(), op.master().end(), h.master().begin());
    h.refresh_compute();
  }
  dev->device()->host_changed();
  EXPECT_FALSE(dev->device()->state_on_device());
  for (std::int64_t it = 6; it < 8; ++it) {
    const double ld = run_iteration(*dev, s, it), lh = run_iteration(*host, s, it);
    EXPECT_EQ(ld, lh) << "iteration " << it;
    const auto plan = models::plan_step(gradient_sq_sums(hops), scaler, s.train.grad_clip);
    dev->device()->step(plan, s.train, false);
    apply_step(hops, plan, s.train);
  }
  same_state("after the host's state was taken up");
  // validation reads the device's current weights
  EXPECT_EQ(dev->validate(0, {}).loss, host->validate(0, {}).loss);
}

TEST(moe_stage, canonical_order_interleaves_each_layers_experts_by_rank) {
  using k = models::op_kind;
  // two ranks: norm, gate, their experts (rank 0 holds 0-1, rank 1 holds 2-3), head
  const std::vector<std::vector<k>> kinds{{k::norm, k::gate, k::expert, k::expert, k::head},
                                          {k::norm, k::gate, k::expert, k::expert, k::head}};
  const auto order = canonical_order(kinds);
  const std::vector<std::pair<int, std::size_t>> want{{0, 0}, {0, 1}, {0, 2}, {0, 3},
                                                      {1, 2}, {1, 3}, {0, 4}};
  ASSERT_EQ(order.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(order[i].rank, want[i].first) << i;
    EXPECT_EQ(order[i].index, want[i].second) << i;
  }
  const std::vector<std::vector<k>> one{{k::norm, k::expert, k::head}};
  EXPECT_EQ(canonical_order(one).size(), 3u);
  const std::vector<std::vector<k>> differ{{k::norm, k::expert}, {k::gate, k::expert}};
  EXPECT_THROW(canonical_order(differ), std::invalid_argument);
  const std::vector<std::vector<k>> short_rank{{k::norm, k::expert, k::head}, {k::norm, k::expert}};
  EXPECT_THROW(canonical_order(short_rank), std::invalid_argument);
}

TEST(moe_stage, ep_ranks_report_popularity_in_canonical_order_and_take_their_share) {
  // Every gate counts tokens for every expert of its layer: expert j of layer L gets 10 L + j.
  const auto counted = [](stage_model& st) {
    auto ops = st.operators();
    int layer = 0;
    for (auto* op : ops) {
      if (op->kind() != models::op_kind::gate) continue;
      auto& routed = op->routed_tokens();
      auto& probs = op->prob_sums();
      for (std::size_t j = 0; j < routed.size(); ++j) {
        routed[j] = 10 * layer + std::int64_t(j);
        probs[j] = 0.5 * double(routed[j]);
      }
      ++layer;
    }
    return std::vector<models::operator_state*>(ops.begin(), ops.end());
  };
  auto whole_setup = tiny_setup(0, 1);
  auto whole = make_moe_stage(whole_setup);
  const auto whole_ops = counted(*whole);
  const auto want = canonical_popularity(whole_ops, {});
  EXPECT_EQ(want, operator_popularity(whole_ops));
  EXPECT_EQ(canonical_popularity(whole_ops, {}, true), operator_popularity(whole_ops, true));
  std::map<std::string, double> by_name;
  for (std::size_t i = 0; i < whole_ops.size(); ++i) by_name[whole_ops[i]->name()] = want[i];

  for (int rank = 0; rank < 2; ++rank) {
    auto s = tiny_setup(0, 1);
    s.replicas = s.train.data_parallel = 2;
    s.train.expert_parallel = 2;
    s.replica = rank;
    auto st = make_moe_stage(s);
    const auto ops = counted(*st);
    ASSERT_LT(ops.size(), whole_ops.size());
    const models::expert_split split = expert_split_of(s);
    EXPECT_EQ(canonical_popularity(ops, split), want) << "rank " << rank;
    const auto mine = rank_popularity(want, ops, split);
    ASSERT_EQ(mine.size(), ops.size());
    for (std::size_t i = 0; i < ops.size(); ++i) {
      EXPECT_EQ(mine[i], by_name.at(ops[i]->name())) << ops[i]->name() << " on rank " << rank;
    }
    EXPECT_THROW(rank_popularity(std::vector<double>(ops.size(), 1.0), ops, split),
                 std::invalid_argument);
  }
}

TEST(moe_stage, expert_parallelism_on_a_gpu_is_refused_naming_the_key) {
  auto s = tiny_setup(0, 1);
  s.replicas = 2;
  s.train.data_parallel = 2;
  s.train.expert_parallel = 2;
  EXPECT_NE(make_moe_stage(s)->experts(), nullptr);
  s.train.device = models::device::cuda;
  EXPECT_EQ(key_of(s), "parallel.ep");
}

TEST(moe_stage, a_cpu_stage_has_no_device_state) {
  EXPECT_EQ(make_moe_stage(tiny_setup(0, 1))->device(), nullptr);
}

}  // namespace
}  // namespace moevement::engine
