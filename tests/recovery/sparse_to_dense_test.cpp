// Sparse-to-dense conversion: a whole job trained with the moevement capture on every stage
// replica; one stage is then rebuilt from scratch (fresh stage models, as a replacement is)
// from its persisted window and its neighbours' logs, and must be bit-identical to the
// survivor's stage; the job with the rebuilt stage has the same state_hash and trains on
// identically. Broken inputs fail with a clear error.
#include "recovery/sparse_to_dense.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>

#include "engine/local_pipeline.hpp"
#include "tests/support/small_train.hpp"

namespace moevement::recovery {
namespace {

constexpr int w_sparse = 3;
// Three windows and two iterations: window 2 (iterations 7..9) is persisted, window 3 is in
// flight, and t = 11 is not at a window boundary.
constexpr int iterations = 11;

using test_support::test_train;

struct captured_job {
  models::train_config train;
  int pp;
  engine::local_pipeline pipe;
  models::model_config model;
  std::vector<std::unique_ptr<stage_schedule>> schedules;  // [stage]
  std::vector<std::unique_ptr<sparse_capture>> caps;       // [replica * pp + stage]

  captured_job(int stages, int dp, const models::model_config& m = models::preset("tiny"),
               std::optional<models::train_config> t = std::nullopt)
      : train(t ? *t : test_train(dp)), pp(stages), pipe(m, train, stages), model(m) {
    for (int s = 0; s < pp; ++s) {
      schedules.push_back(
          std::make_unique<stage_schedule>(sparse_config{w_sparse}, pipe.stage(s, 0).operators()));
    }
    for (int d = 0; d < dp; ++d) {
      for (int s = 0; s < pp; ++s) {
        caps.push_back(
            std::make_unique<sparse_capture>(*schedules[std::size_t(s)], s, d, &pipe.scaler()));
        pipe.set_hooks(s, d, caps.back().get());
      }
    }
  }
  sparse_capture& cap(int s, int d) { return *caps[std::size_t(d * pp + s)]; }

  // What a recovery of stage s at the current iteration gathers from the survivors.
  conversion_input input(int s) {
    conversion_input in;
    in.stage = s;
    in.stages = pp;
    in.micro_batches = train.micro_batches;
    in.target_iteration = pipe.iteration();
    in.train = train;
    for (int d = 0; d < train.data_parallel; ++d) {
      const auto w = cap(s, d).persisted();
      EXPECT_TRUE(w.has_value());
      in.windows.push_back(w ? w->slots : std::vector<std::span<const std::byte>>{});
      in.upstream.push_back(s > 0 ? &cap(s - 1, d).log() : nullptr);
      in.downstream.push_back(s + 1 < pp ? &cap(s + 1, d).log() : nullptr);
    }
    // the plans are job-wide: any other stage has them
    in.steps = &cap((s + 1) % pp, 0).steps();
    return in;
  }
};

// One source's part of replica d's expert blocks over stages first..last.
std::size_t experts_block_floats(engine::local_pipeline& p, int first, int last, int d) {
  std::size_t n = 0;
  for (int s = first; s <= last; ++s) n += p.stage(s, d).experts()->source_gradient(0).size();
  return n;
}

void copy_state(std::span<models::operator_state* const> from,
                std::span<models::operator_state* const> to) {
  ASSERT_EQ(from.size(), to.size());
  for (std::size_t i = 0; i < from.size(); ++i) {
    std::ranges::copy(from[i]->master(), to[i]->master().begin());
    std::ranges::copy(from[i]->adam_m(), to[i]->adam_m().begin());
    std::ranges::copy(from[i]->adam_v(), to[i]->adam_v().begin());
    to[i]->set_step(from[i]->step());
    to[i]->refresh_compute();
  }
}

std::vector<engine::stage_model*> replicas_of(engine::local_pipeline& p, int s) {
  std::vector<engine::stage_model*> out;
  for (int d = 0; d < p.replicas(); ++d) out.push_back(&p.stage(s, d));
  return out;
}

// Trains `iterations` with the capture on, then rebuilds each stage in turn.
void expect_bit_exact_conversions(captured_job& job) {
  const int pp = job.pp, dp = job.train.data_parallel;
  for (int i = 0; i < iterations; ++i) job.pipe.train_iteration();
  for (int s = 0; s < pp; ++s) {
    SCOPED_TRACE(testing::Message() << "pp=" << pp << " dp=" << dp << " stage " << s);
    // the replacement job: survivors' state copied, stage s fresh and converted
    engine::local_pipeline fresh(job.model, job.train, pp);
    for (int d = 0; d < dp; ++d) {
      for (int o = 0; o < pp; ++o) {
        if (o != s) copy_state(job.pipe.stage(o, d).operators(), fresh.stage(o, d).operators());
      }
    }
    auto in = job.input(s);
    for (int d = 0; d < dp; ++d) in.own.push_back(&job.cap(s, d).log());
    const auto rep = sparse_to_dense(replicas_of(fresh, s), in);
    EXPECT_EQ(rep.first_iteration, 7);
    EXPECT_EQ(rep.iterations_replayed, 4);
    ASSERT_EQ(rep.active_after_slot.size(), std::size_t(w_sparse));
    EXPECT_LT(rep.active_after_slot.front(), rep.active_after_slot.back());
    EXPECT_EQ(rep.sparse_replays, (w_sparse - 1) * dp);
    // every tensor the replay sent matched what the lost stage had sent
    const std::size_t sent_per_iteration =
        std::size_t((s > 0) + (s + 1 < pp)) * std::size_t(job.train.micro_batches);
    EXPECT_EQ(rep.tensors_checked, sent_per_iteration * 4 * std::size_t(dp));
    for (int d = 0; d < dp; ++d) {
      EXPECT_EQ(engine::operator_digests(fresh.stage(s, d).operators()),
                engine::operator_digests(job.pipe.stage(s, d).operators()))
          << "replica " << d;
    }
    fresh.set_position(job.pipe.iteration(), job.pipe.scaler());
    EXPECT_EQ(fresh.state_hash(), job.pipe.state_hash());
    if (s == pp - 1) {  // the rebuilt job resumes at t bit for bit (after the last check)
      const auto sa = job.pipe.train_iteration();
      const auto sb = fresh.train_iteration();
      EXPECT_EQ(sa.loss, sb.loss);
      EXPECT_EQ(job.pipe.state_hash(), fresh.state_hash());
    }
  }
}

TEST(sparse_to_dense, a_rebuilt_stage_is_bit_identical_and_the_job_trains_on_identically) {
  for (int pp : {2, 3}) {
    for (int dp : {1, 2}) {
      captured_job job(pp, dp);
      expect_bit_exact_conversions(job);
    }
  }
}

// Joint recovery: contiguous stages first..last lost together (the logs between them are
// gone with them) are rebuilt in one conversion from their windows and the logs of the
// stages just outside the region; every tensor the region sends across its boundary and
// inside it matches what the lost stages sent.
void expect_bit_exact_region(captured_job& job, int first, int last) {
  const int pp = job.pp, dp = job.train.data_parallel, k = last - first + 1;
  SCOPED_TRACE(testing::Message() << "pp=" << pp << " dp=" << dp << " region " << first << ".."
                                  << last);
  engine::local_pipeline fresh(job.model, job.train, pp);
  std::vector<engine::stage_model*> region;
  for (int s = 0; s < pp; ++s) {
    for (int d = 0; d < dp; ++d) {
      if (s < first || s > last) {
        copy_state(job.pipe.stage(s, d).operators(), fresh.stage(s, d).operators());
      }
    }
  }
  conversion_input in;
  in.stage = first;
  in.region_stages = k;
  in.stages = pp;
  in.micro_batches = job.train.micro_batches;
  in.target_iteration = job.pipe.iteration();
  in.train = job.train;
  for (int s = first; s <= last; ++s) {
    for (int d = 0; d < dp; ++d) {
      region.push_back(&fresh.stage(s, d));
      const auto w = job.cap(s, d).persisted();
      ASSERT_TRUE(w.has_value());
      in.windows.push_back(w->slots);
      in.own.push_back(&job.cap(s, d).log());
    }
  }
  for (int d = 0; d < dp; ++d) {
    in.upstream.push_back(first > 0 ? &job.cap(first - 1, d).log() : nullptr);
    in.downstream.push_back(last + 1 < pp ? &job.cap(last + 1, d).log() : nullptr);
  }
  in.steps = &job.cap(0, 0).steps();
  int sent = 0;
  in.on_sent = [&](int s, std::int64_t, int, log_direction, std::size_t, std::span<const float>) {
    EXPECT_GE(s, first);
    EXPECT_LE(s, last);
    ++sent;
  };
  const auto rep = sparse_to_dense(region, in);
  EXPECT_EQ(rep.iterations_replayed, 4);
  EXPECT_EQ(rep.sparse_replays, (w_sparse - 1) * dp * k);
  // each region stage sends downstream unless last, upstream unless first
  std::size_t per_iteration = 0;
  for (int s = first; s <= last; ++s) per_iteration += std::size_t((s > 0) + (s + 1 < pp));
  per_iteration *= std::size_t(job.train.micro_batches * dp);
  EXPECT_EQ(rep.tensors_checked, per_iteration * 4);
  EXPECT_EQ(std::size_t(sent), per_iteration * 4);
  for (int s = first; s <= last; ++s) {
    for (int d = 0; d < dp; ++d) {
      EXPECT_EQ(engine::operator_digests(fresh.stage(s, d).operators()),
                engine::operator_digests(job.pipe.stage(s, d).operators()))
          << "stage " << s << " replica " << d;
    }
  }
  fresh.set_position(job.pipe.iteration(), job.pipe.scaler());
  EXPECT_EQ(fresh.state_hash(), job.pipe.state_hash());
}

TEST(sparse_to_dense, contiguous_stages_are_rebuilt_jointly) {
  for (int dp : {1, 2}) {
    captured_job job(4, dp);
    for (int i = 0; i < iterations; ++i) job.pipe.train_iteration();
    expect_bit_exact_region(job, 1, 2);  // the middle: logs on both sides
    expect_bit_exact_region(job, 0, 1);  // from the data loader
    expect_bit_exact_region(job, 2, 3);  // to the loss
    expect_bit_exact_region(job, 0, 3);  // every stage lost: the whole pipeline
  }
}

TEST(sparse_to_dense, a_region_without_its_neighbours_log_says_which) {
  captured_job job(3, 1);
  for (int i = 0; i < iterations; ++i) job.pipe.train_iteration();
  engine::local_pipeline fresh(job.model, job.train, 3);
  conversion_input in;
  in.stage = 0;
  in.region_stages = 2;
  in.stages = 3;
  in.micro_batches = job.train.micro_batches;
  in.target_iteration = job.pipe.iteration();
  in.train = job.train;
  std::vector<engine::stage_model*> region{&fresh.stage(0, 0), &fresh.stage(1, 0)};
  for (int s = 0; s < 2; ++s) in.windows.push_back(job.cap(s, 0).persisted()->slots);
  in.upstream.push_back(nullptr);
  in.downstream.push_back(nullptr);  // stage 2's log is missing
  in.steps = &job.cap(0, 0).steps();
  try {
    sparse_to_dense(region, in);
    ADD_FAILURE() << "converted without the log of stage 2";
  } catch (const conversion_error& e) {
    EXPECT_NE(std::string(e.what()).find("no log of stage 2"), std::string::npos) << e.what();
  }
  in.region_stages = 3;  // three stages but two models
  EXPECT_THROW(sparse_to_dense(region, in), conversion_error);
}

// The recovery group replays in parallel: each replica of the region replays on a thread of
// its own (as each member does on its own worker) and the gradients are summed through
// `reduce` in replica order; every member ends bit-identical to the lost stages, as the
// whole group replayed in one place does. dp = 3: the order of the sum matters.
// Where the members of a group replay on threads leave their gradients: each waits for every
// member's of the same iteration and gets them all, in replica order.
class gradient_board {
 public:
  explicit gradient_board(int members) : members_(std::size_t(members)) {}
  std::vector<std::vector<float>> all(std::int64_t it, std::size_t me, std::span<const float> g) {
    std::unique_lock lock(mu_);
    auto& got = deposits_[it];
    got.resize(members_);
    got[me].assign(g.begin(), g.end());
    cv_.notify_all();
    cv_.wait(lock, [&] {
      return failed_ ||
             std::all_of(got.begin(), got.end(), [](const auto& v) { return !v.empty(); });
    });
    if (failed_) throw std::runtime_error("another member failed");
    return got;
  }
  // A member failed: the others' waits end.
  void fail() {
    std::lock_guard lock(mu_);
    failed_ = true;
    cv_.notify_all();
  }

 private:
  std::size_t members_;
  bool failed_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::int64_t, std::vector<std::vector<float>>> deposits_;
};

TEST(sparse_to_dense, a_group_replaying_in_parallel_ends_bit_identical) {
  const int pp = 4, dp = 3, first = 1, last = 2;
  captured_job job(pp, dp, models::preset("tiny"), test_train(dp));
  for (int i = 0; i < iterations; ++i) job.pipe.train_iteration();
  engine::local_pipeline fresh(job.model, job.train, pp);
  // The sum in replica order.
  gradient_board board(dp);
  auto reduce_as = [&](std::size_t me) {
    return [&, me](std::int64_t it, std::span<float> g) {
      const auto got = board.all(it, me, g);
      std::copy(got[0].begin(), got[0].end(), g.begin());
      for (int d = 1; d < dp; ++d) engine::accumulate(g, got[std::size_t(d)]);
    };
  };
  std::vector<std::thread> members;
  std::vector<std::string> errors(static_cast<std::size_t>(dp));
  std::vector<int> replays(static_cast<std::size_t>(dp));
  for (int d = 0; d < dp; ++d) {
    members.emplace_back([&, d] {
      conversion_input in;
      in.stage = first;
      in.region_stages = last - first + 1;
      in.stages = pp;
      in.micro_batches = job.train.micro_batches;
      in.target_iteration = job.pipe.iteration();
      in.train = job.train;
      in.first_replica = std::size_t(d);
      in.reduce = reduce_as(std::size_t(d));
      std::vector<engine::stage_model*> mine;
      for (int s = first; s <= last; ++s) {
        mine.push_back(&fresh.stage(s, d));
        in.windows.push_back(job.cap(s, d).persisted()->slots);
        in.own.push_back(&job.cap(s, d).log());
      }
      in.upstream.push_back(&job.cap(first - 1, d).log());
      in.downstream.push_back(&job.cap(last + 1, d).log());
      in.steps = &job.cap(0, 0).steps();
      try {
        replays[std::size_t(d)] = sparse_to_dense(mine, in).sparse_replays;
      } catch (const std::exception& e) {
        errors[std::size_t(d)] = e.what();
        board.fail();
      }
    });
  }
  for (auto& t : members) t.join();
  for (int d = 0; d < dp; ++d) {
    ASSERT_EQ(errors[std::size_t(d)], "") << "replica " << d;
    EXPECT_EQ(replays[std::size_t(d)], (w_sparse - 1) * (last - first + 1));
    for (int s = first; s <= last; ++s) {
      EXPECT_EQ(engine::operator_digests(fresh.stage(s, d).operators()),
                engine::operator_digests(job.pipe.stage(s, d).operators()))
          << "stage " << s << " replica " << d;
    }
  }
  // A member given the whole group cannot also sum with others.
  conversion_input in = job.input(first);
  in.reduce = [](std::int64_t, std::span<float>) {};
  EXPECT_THROW(sparse_to_dense(replicas_of(fresh, first), in), conversion_error);
}

// Members on threads, as on workers: each calls its EP group's shards as the router would
// (one call at a time: the shards are not shared between threads otherwise), and a barrier
// paces what engine::expert_router paces by epochs (rows of an iteration only once every
// member began it; the reduce only once every source's rows were served).
class threaded_experts {
 public:
  threaded_experts(int members) : members_(members) {}
  void barrier() {
    std::unique_lock lock(mu_);
    const std::uint64_t round = round_;
    if (++arrived_ == members_) {
      arrived_ = 0;
      ++round_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return round_ != round || failed_; });
    if (failed_) throw std::runtime_error("a member failed");
  }
  void fail() {
    std::lock_guard lock(mu_);
    failed_ = true;
    cv_.notify_all();
  }
  std::mutex& shards() { return shards_mu_; }

 private:
  std::mutex mu_, shards_mu_;
  std::condition_variable cv_;
  int members_, arrived_ = 0;
  std::uint64_t round_ = 0;
  bool failed_ = false;
};

class locked_exchange final : public models::expert_exchange {
 public:
  locked_exchange(std::vector<models::expert_shard*> group, int source, int experts, int c,
                  std::mutex& mu)
      : inner_(std::move(group), source, experts, c), mu_(mu) {}
  void forward(int layer, int mb, std::span<const int> offsets, std::span<const float> xs,
               std::span<float> ye, bool training) override {
    std::lock_guard lock(mu_);
    inner_.forward(layer, mb, offsets, xs, ye, training);
  }
  void backward(int layer, int mb, std::span<const int> offsets, std::span<const float> d_ye,
                std::span<float> d_xs) override {
    std::lock_guard lock(mu_);
    inner_.backward(layer, mb, offsets, d_ye, d_xs);
  }

 private:
  models::direct_exchange inner_;
  std::mutex& mu_;
};

// A joint region replayed as a pipeline across workers: each (stage, replica) of region 1..2
// replays only its own stage, on a thread of its own (as each member would on its own
// worker). The boundary tensors between the region's stages pass live from one member to the
// next the moment they are made (take_live / on_sent); those with the healthy stages outside
// come from their logs; each stage's replicas sum their gradients in replica order. Every
// member ends bit-identical to the lost stage it stands for, and sends what it sent.
// Under expert parallelism (ep 2) each stage's members also compute each other's expert rows
// (as the replay routers do across workers) and fold their experts over the copies.
void expect_pipelined_region(int ep) {
  SCOPED_TRACE(testing::Message() << "ep " << ep);
  const int pp = 4, dp = 2, first = 1, last = 2;
  auto t = test_train(dp);
  t.expert_parallel = ep;
  captured_job job(pp, dp, models::preset("tiny"), t);
  for (int i = 0; i < iterations; ++i) job.pipe.train_iteration();
  engine::local_pipeline fresh(job.model, job.train, pp);
  // [stage - first]: its members' pace, and their exchanges
  std::vector<std::unique_ptr<threaded_experts>> paces;
  std::vector<std::unique_ptr<locked_exchange>> exchanges;
  for (int s = first; s <= last && ep > 1; ++s) {
    paces.push_back(std::make_unique<threaded_experts>(dp));
    for (int d = 0; d < dp; ++d) {
      std::vector<models::expert_shard*> group;
      for (int k = 0; k < ep; ++k) group.push_back(fresh.stage(s, d / ep * ep + k).experts());
      exchanges.push_back(std::make_unique<locked_exchange>(
          group, d % ep, job.model.experts, job.model.d_model, paces.back()->shards()));
      fresh.stage(s, d).set_expert_exchange(exchanges.back().get());
    }
  }
  std::mutex mu;
  std::condition_variable cv;
  bool failed = false;
  // What the members sent each other: (sending stage, replica, iteration, mb, direction).
  std::map<std::tuple<int, int, std::int64_t, int, int>, std::vector<float>> wire;
  // Each stage's gradient deposits by iteration: [replica].
  std::map<std::pair<int, std::int64_t>, std::vector<std::vector<float>>> deposits;
  auto wait_for = [&](std::unique_lock<std::mutex>& lock, auto ready) {
    cv.wait(lock, [&] { return failed || ready(); });
    if (failed) throw std::runtime_error("another member failed");
  };
  auto member = [&](int s, int d) {
    conversion_input in;
    in.stage = s;
    in.region_stages = 1;
    in.stages = pp;
    in.micro_batches = job.train.micro_batches;
    in.target_iteration = job.pipe.iteration();
    in.train = job.train;
    in.first_replica = std::size_t(d);
    in.live_before = s > first;
    in.live_after = s < last;
    in.windows.push_back(job.cap(s, d).persisted()->slots);
    in.own.push_back(&job.cap(s, d).log());
    in.upstream.push_back(s == first ? &job.cap(s - 1, d).log() : nullptr);
    in.downstream.push_back(s == last ? &job.cap(s + 1, d).log() : nullptr);
    in.steps = &job.cap(0, 0).steps();
    in.reduce = [&, s, d](std::int64_t it, std::span<float> g) {
      std::unique_lock lock(mu);
      auto& got = deposits[{s, it}];
      got.resize(std::size_t(dp));
      got[std::size_t(d)].assign(g.begin(), g.end());
      cv.notify_all();
      wait_for(lock, [&] {
        return std::all_of(got.begin(), got.end(), [](const auto& v) { return !v.empty(); });
      });
      const std::size_t block = ep > 1 ? experts_block_floats(fresh, s, s, d) : 0;
      const group_layout l{g.size() - block * std::size_t(ep), block, ep};
      for (std::size_t r = 0; r < std::size_t(dp); ++r) {
        fold_group(l, std::size_t(d), r, got[r], g.first(l.dense + l.block));
      }
    };
    if (ep > 1) {
      threaded_experts& pace = *paces[std::size_t(s - first)];
      in.experts_begin = [&pace](std::int64_t) { pace.barrier(); };
      in.experts_end = [&pace](std::int64_t) { pace.barrier(); };
    }
    in.take_live = [&, s, d](std::int64_t it, int mb, log_direction dir) {
      const int from = dir == log_direction::activation ? s - 1 : s + 1;
      const auto key = std::make_tuple(from, d, it, mb, int(dir));
      std::unique_lock lock(mu);
      wait_for(lock, [&] { return wire.contains(key); });
      return wire[key];
    };
    in.on_sent = [&, d](int st, std::int64_t it, int mb, log_direction dir, std::size_t,
                        std::span<const float> t) {
      std::lock_guard lock(mu);
      wire[std::make_tuple(st, d, it, mb, int(dir))].assign(t.begin(), t.end());
      cv.notify_all();
    };
    engine::stage_model* mine[] = {&fresh.stage(s, d)};
    return sparse_to_dense(mine, in);
  };
  std::vector<std::thread> members;
  std::map<std::pair<int, int>, std::string> errors;
  std::map<std::pair<int, int>, conversion_report> reports;
  for (int s = first; s <= last; ++s) {
    for (int d = 0; d < dp; ++d) {
      errors[{s, d}];
      reports[{s, d}];
    }
  }
  for (int s = first; s <= last; ++s) {
    for (int d = 0; d < dp; ++d) {
      members.emplace_back([&, s, d] {
        try {
          reports.at({s, d}) = member(s, d);
        } catch (const std::exception& e) {
          std::lock_guard lock(mu);
          errors.at({s, d}) = e.what();
          failed = true;
          cv.notify_all();
          for (auto& p : paces) p->fail();
        }
      });
    }
  }
  for (auto& t : members) t.join();
  for (int s = first; s <= last; ++s) {
    for (int d = 0; d < dp; ++d) {
      ASSERT_EQ(errors.at({s, d}), "") << "stage " << s << " replica " << d;
      const auto& rep = reports.at({s, d});
      EXPECT_EQ(rep.iterations_replayed, 4);
      EXPECT_EQ(rep.sparse_replays, w_sparse - 1);
      // every tensor it sent (both ways: stages 1 and 2 of 4) matched the lost stage's log
      EXPECT_EQ(rep.tensors_checked, std::size_t(2 * job.train.micro_batches * 4));
      EXPECT_EQ(engine::operator_digests(fresh.stage(s, d).operators()),
                engine::operator_digests(job.pipe.stage(s, d).operators()))
          << "stage " << s << " replica " << d;
    }
  }
}

TEST(sparse_to_dense, a_joint_region_replayed_as_a_pipeline_ends_bit_identical) {
  expect_pipelined_region(1);
  expect_pipelined_region(2);
  const int pp = 4, dp = 2, first = 1;
  captured_job job(pp, dp, models::preset("tiny"), test_train(dp));
  for (int i = 0; i < iterations; ++i) job.pipe.train_iteration();
  engine::local_pipeline fresh(job.model, job.train, pp);
  // A pipelined replay is one stage replica with live neighbours inside the pipeline.
  conversion_input bad = job.input(first);
  bad.live_before = true;
  bad.take_live = [](std::int64_t, int, log_direction) { return std::vector<float>{}; };
  EXPECT_THROW(sparse_to_dense(replicas_of(fresh, first), bad), conversion_error);
}

// f16 with dynamic loss scaling (the scale changes inside the replayed iterations: the logged
// plans and loss gradients, not recomputed ones, must be applied) and dp = 3 (the
// all-reduce order matters from three replicas on).
TEST(sparse_to_dense, f16_loss_scaling_and_three_replicas) {
  auto m = models::preset("tiny");
  m.compute_dtype = models::dtype::f16;
  auto t = test_train(3);
  t.loss_scale_window = 1;  // doubles after every good step, halves on overflow
  captured_job job(2, 3, m, t);
  expect_bit_exact_conversions(job);
  // the scale moved inside the replayed iterations (the logged loss gradients differ)
  float lo = 1e30f, hi = 0.0f;
  for (const auto& [it, rec] : job.cap(0, 0).steps()) {
    lo = std::min(lo, rec.loss_grad);
    hi = std::max(hi, rec.loss_grad);
  }
  EXPECT_LT(lo, hi);
  EXPECT_EQ(parse_snapshot(job.cap(1, 2).persisted()->slots.back()).scaler.enabled, true);
}

// Expert parallelism: a replay of the whole group in one process, whose EP groups compute each
// other's expert rows, ends with every replica's bits (each EP rank holds other operators).
TEST(sparse_to_dense, an_expert_parallel_group_is_rebuilt_bit_identical) {
  for (const auto& [dp, ep] : {std::pair{2, 2}, std::pair{4, 2}}) {
    auto t = test_train(dp);
    t.expert_parallel = ep;
    captured_job job(2, dp, models::preset("tiny"), t);
    expect_bit_exact_conversions(job);
  }
  // A member replaying its own replica needs the hooks that pace its expert exchange.
  auto t = test_train(2);
  t.expert_parallel = 2;
  captured_job job(2, 2, models::preset("tiny"), t);
  for (int i = 0; i < iterations; ++i) job.pipe.train_iteration();
  engine::local_pipeline fresh(job.model, job.train, 2);
  auto in = job.input(0);
  in.windows.resize(1);
  in.reduce = [](std::int64_t, std::span<float>) {};
  engine::stage_model* one[] = {&fresh.stage(0, 0)};
  try {
    sparse_to_dense(one, in);
    ADD_FAILURE() << "a replay over workers with expert parallelism was accepted without hooks";
  } catch (const conversion_error& e) {
    EXPECT_NE(std::string(e.what()).find("experts_begin"), std::string::npos) << e.what();
  }
}

// Under expert parallelism too, each member replays its own replica (its block of experts
// and the non-experts), the EP group computing each other's rows, and the group's sum
// (fold_group) gives each member the bits the lost replica had.
TEST(sparse_to_dense, an_expert_parallel_group_replaying_in_parallel_ends_bit_identical) {
  for (const auto& [dp, ep] : {std::pair{2, 2}, std::pair{4, 2}}) {
    SCOPED_TRACE(testing::Message() << "dp " << dp << " ep " << ep);
    const int pp = 3, first = 1, last = 2;
    auto t = test_train(dp);
    t.expert_parallel = ep;
    captured_job job(pp, dp, models::preset("tiny"), t);
    for (int i = 0; i < iterations; ++i) job.pipe.train_iteration();
    engine::local_pipeline fresh(job.model, job.train, pp);
    threaded_experts pace(dp);
    std::vector<std::unique_ptr<locked_exchange>> exchanges;  // [j][d]
    for (int s = first; s <= last; ++s) {
      for (int d = 0; d < dp; ++d) {
        std::vector<models::expert_shard*> group;
        for (int k = 0; k < ep; ++k) group.push_back(fresh.stage(s, d / ep * ep + k).experts());
        exchanges.push_back(std::make_unique<locked_exchange>(group, d % ep, job.model.experts,
                                                              job.model.d_model, pace.shards()));
        fresh.stage(s, d).set_expert_exchange(exchanges.back().get());
      }
    }
    gradient_board board(dp);
    auto reduce_as = [&](std::size_t me) {
      return [&, me](std::int64_t it, std::span<float> g) {
        const auto got = board.all(it, me, g);
        // the layout as the member made it: every member's buffer has the same size
        const std::size_t block = experts_block_floats(fresh, first, last, int(me));
        const group_layout l{g.size() - block * std::size_t(ep), block, ep};
        for (std::size_t d = 0; d < std::size_t(dp); ++d) {
          fold_group(l, me, d, got[d], g.first(l.dense + l.block));
        }
      };
    };
    std::vector<std::thread> members;
    std::vector<std::string> errors(static_cast<std::size_t>(dp));
    for (int d = 0; d < dp; ++d) {
      members.emplace_back([&, d] {
        conversion_input in;
        in.stage = first;
        in.region_stages = last - first + 1;
        in.stages = pp;
        in.micro_batches = job.train.micro_batches;
        in.target_iteration = job.pipe.iteration();
        in.train = job.train;
        in.first_replica = std::size_t(d);
        in.reduce = reduce_as(std::size_t(d));
        in.experts_begin = [&](std::int64_t) { pace.barrier(); };
        in.experts_end = [&](std::int64_t) { pace.barrier(); };
        std::vector<engine::stage_model*> mine;
        for (int s = first; s <= last; ++s) {
          mine.push_back(&fresh.stage(s, d));
          in.windows.push_back(job.cap(s, d).persisted()->slots);
          in.own.push_back(&job.cap(s, d).log());
        }
        in.upstream.push_back(&job.cap(first - 1, d).log());
        in.steps = &job.cap(0, 0).steps();
        try {
          (void)sparse_to_dense(mine, in);
        } catch (const std::exception& e) {
          errors[std::size_t(d)] = e.what();
          pace.fail();
          board.fail();
        }
      });
    }
    for (auto& th : members) th.join();
    for (int d = 0; d < dp; ++d) {
      ASSERT_EQ(errors[std::size_t(d)], "") << "replica " << d;
      for (int s = first; s <= last; ++s) {
        EXPECT_EQ(engine::operator_digests(fresh.stage(s, d).operators()),
                  engine::operator_digests(job.pipe.stage(s, d).operators()))
            << "stage " << s << " replica " << d;
      }
    }
  }
}

TEST(sparse_to_dense, a_gradient_buffer_that_does_not_fit_the_layout_is_refused) {
  const group_layout l{4, 2, 2};
  std::vector<float> g(l.floats()), sum(l.dense + l.block);
  EXPECT_NO_THROW(fold_group(l, 0, 0, g, sum));
  g.pop_back();
  EXPECT_THROW(fold_group(l, 0, 0, g, sum), std::invalid_argument);
}

TEST(sparse_to_dense, every_operator_is_full_exactly_once_per_window) {
  captured_job job(2, 1);
  for (int i = 0; i < iterations; ++i) {
    job.pipe.train_iteration();
    for (int s = 0; s < 2; ++s) {
      auto& sched = *job.schedules[std::size_t(s)];
      const auto& w = sched.window_schedule(std::uint64_t(i / w_sparse));
      EXPECT_EQ(sim::check_schedule(w, sched.operators()), "") << "stage " << s;
    }
  }
  // popularity moved enough between windows to reorder (so conversions above ran across
  // schedules that differ from window to window)
  EXPECT_GT(job.schedules[0]->reorders() + job.schedules[1]->reorders(), 0u);
  for (int s = 0; s < 2; ++s) {
    const auto w = job.cap(s, 0).persisted();
    ASSERT_TRUE(w.has_value());
    const auto n = job.pipe.stage(s, 0).operators().size();
    std::vector<int> full(n, 0);
    for (const auto slot : w->slots) {
      for (const auto& e : parse_snapshot(slot).entries) {
        if (e.mode == models::op_mode::active) ++full[e.index];
      }
    }
    EXPECT_TRUE(std::ranges::all_of(full, [](int c) { return c == 1; })) << "stage " << s;
  }
}

struct broken_inputs : testing::Test {
  captured_job job{3, 1};
  std::vector<engine::stage_model*> fresh_replicas;
  engine::local_pipeline fresh{models::preset("tiny"), test_train(1), 3};
  void SetUp() override {
    for (int i = 0; i < iterations; ++i) job.pipe.train_iteration();
    fresh_replicas = replicas_of(fresh, 1);
  }
};

TEST_F(broken_inputs, a_corrupt_slot_is_rejected) {
  auto in = job.input(1);
  std::vector<std::byte> bad(in.windows[0][1].begin(), in.windows[0][1].end());
  bad[bad.size() / 2] ^= std::byte{0x10};
  in.windows[0][1] = bad;
  try {
    sparse_to_dense(fresh_replicas, in);
    FAIL() << "a corrupt slot was accepted";
  } catch (const snapshot_error& e) {
    EXPECT_NE(std::string(e.what()).find("slot 1 of stage 1 replica 0"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("checksum"), std::string::npos) << e.what();
  }
  in = job.input(1);
  in.windows[0][2] = in.windows[0][2].first(in.windows[0][2].size() - 3);  // truncated
  EXPECT_THROW(sparse_to_dense(fresh_replicas, in), snapshot_error);
  in = job.input(1);
  in.windows[0].pop_back();  // a slot missing: some operators never get their full state
  EXPECT_THROW(sparse_to_dense(fresh_replicas, in), conversion_error);
}

TEST_F(broken_inputs, a_missing_log_entry_or_plan_is_named) {
  auto in = job.input(1);
  // the upstream log without iteration 8's micro-batch 1 activation
  log_store partial;
  const log_store& full = job.cap(0, 0).log();
  const auto [lo, hi] = *full.span_held();
  for (auto it = lo; it <= hi; ++it) {
    for (const auto& k : full.keys_of(it, log_direction::activation)) {
      if (!(k.iteration == 8 && k.micro_batch == 1)) partial.append(k, *full.find(k));
    }
  }
  in.upstream[0] = &partial;
  try {
    sparse_to_dense(fresh_replicas, in);
    FAIL() << "a missing log entry was not noticed";
  } catch (const conversion_error& e) {
    EXPECT_NE(std::string(e.what()).find("no activation of iteration 8 micro-batch 1"),
              std::string::npos)
        << e.what();
  }
  in = job.input(1);
  in.downstream[0] = nullptr;
  EXPECT_THROW(sparse_to_dense(fresh_replicas, in), conversion_error);
  in = job.input(1);
  auto steps = *in.steps;
  steps.erase(9);
  in.steps = &steps;
  EXPECT_THROW(sparse_to_dense(fresh_replicas, in), conversion_error);
  in = job.input(1);
  in.target_iteration = 8;  // inside the persisted window
  EXPECT_THROW(sparse_to_dense(fresh_replicas, in), conversion_error);
}

}  // namespace
}  // namespace moevement::recovery
