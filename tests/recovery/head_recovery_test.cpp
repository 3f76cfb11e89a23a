// The head side of recovery on the deterministic scheduler (no processes, no sleeps): a fake
// coordinator (head_control) hosts a head_recovery; workers are actor systems whose "agents"
// record the Restores they are sent (and answer a rollback's queries), and a loss is a crashed
// node.
// Policy moevement (region_recovery): contiguous losses in one step are one region; a
// replacement lost during its restore restarts the region on another spare (a new generation
// to every member); a disjoint loss is a region of its own and a loss next to a region grows
// it; past the restart intensity the job stops, saying so; once every member reports, the
// stages are rewired and training goes on at the target. The tree: a job supervisor whose
// children are the regions' supervisors (a merge stops one on purpose, an escalation reaches
// the job supervisor and is reported, the job's end takes the tree down).
// The baselines (rollback_recovery): one region spanning the pipeline; a spare lost during
// the rollback restarts it (another spare, a new generation), then every stage loads the
// newest checkpoint all offer; past the restart intensity the job stops.
#include "recovery/region_recovery.hpp"
#include "recovery/rollback_recovery.hpp"

#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "actors/deterministic.hpp"
#include "actors/supervisor.hpp"
#include "recovery/region_supervisor.hpp"
#include "recovery/window_book.hpp"
#include "recovery/window_plan.hpp"
#include "recovery/window_tuner.hpp"

namespace moevement::recovery {
namespace {

using namespace std::chrono_literals;
using actors::actor_ref;
using actors::awaitable;
using actors::node_id;
namespace wire = engine::wire;

// A worker's agent: keeps the Restores it is sent; offers checkpoints 0 and 8 to a rollback.
class fake_agent : public actors::actor {
 public:
  using interface = actors::interface<actors::tell_t<wire::Restore>,
                                      actors::ask_t<wire::RollbackQuery, wire::RollbackOffer>,
                                      actors::ask_t<wire::RollbackLoad, wire::RollbackLoaded>>;
  struct restore {
    int stage = -1, first = -1, last = -1;
    std::uint64_t generation = 0;
    std::int64_t target = 0, first_iteration = 0, window = 0;
    std::size_t steps = 0;
  };
  std::vector<restore> restores;
  std::vector<std::int64_t> loads;
  fake_agent() {
    on<wire::Restore>(&fake_agent::take);
    on<wire::RollbackQuery, wire::RollbackOffer>(&fake_agent::offer);
    on<wire::RollbackLoad, wire::RollbackLoaded>(&fake_agent::load);
  }

 private:
  awaitable<void> take(wire::Restore::Reader m) {
    restores.push_back({m.getStage(), m.getFirstStage(), m.getLastStage(), m.getGeneration(),
                        m.getTargetIteration(), m.getFirstIteration(), std::int64_t(m.getWindow()),
                        m.getSteps().size()});
    co_return;
  }
  awaitable<void> offer(wire::RollbackQuery::Reader, wire::RollbackOffer::Builder out) {
    auto l = out.initIterations(2);
    l.set(0, 0);
    l.set(1, 8);
    co_return;
  }
  awaitable<void> load(wire::RollbackLoad::Reader m, wire::RollbackLoaded::Builder) {
    loads.push_back(m.getIteration());
    co_return;
  }
};

// The coordinator's part: the workers, the window persisted, and what the recovery asked of
// the job (failures, rewirings, where training went on).
class fake_head : public actors::actor, public engine::head_control {
 public:
  using interface = actors::interface<actors::ask_t<wire::RegionRestart, wire::RegionMembers>,
                                      actors::tell_t<wire::RegionEscalated>>;
  fake_head(engine::job_config job, std::map<node_id, engine::worker_info> workers)
      : job_(std::move(job)), workers_(std::move(workers)) {
    on<wire::RegionRestart, wire::RegionMembers>(&fake_head::restart);
    on<wire::RegionEscalated>(&fake_head::escalated);
  }
  std::vector<std::string> tree_exits;  // the job supervisor's end, as the coordinator sees it
  std::unique_ptr<engine::head_recovery> recovery;
  std::vector<std::string> failures, notices;
  std::vector<engine::recovery_done> done;
  int rewirings = 0;

  // A replacement's report of generation `generation` (as the coordinator passes it on).
  awaitable<void> report(node_id n, std::uint64_t generation) {
    capnp::MallocMessageBuilder msg;
    auto b = msg.initRoot<wire::StageReady>();
    b.setNode(n);
    b.setGeneration(generation);
    if (recovery->rebuilding(n) && recovery->current(n, generation)) {
      co_await recovery->restored(n, b.asReader());
    }
  }

  // Worker n's restore fails (as the coordinator passes its report on): a turn of this actor,
  // which waits out the failure timeout in it.
  void fail_restore(node_id n, std::string message) {
    (void)system().post_call(self(), [this, n, message](actors::actor&) -> awaitable<void> {
      co_await recovery->restore_failed(n, message, false);
    });
  }

  // head_control
  actors::actor& actor() override { return *this; }
  const engine::job_config& job() const override { return job_; }
  engine::run_log* log() const override { return nullptr; }
  const std::map<node_id, engine::worker_info>& workers() const override { return workers_; }
  std::map<node_id, engine::worker_info>& worker_roles() override { return workers_; }
  const models::loss_scaler& scaler() const override { return scaler_; }
  std::int64_t iteration() const override { return 12; }
  bool stepping() const override { return false; }
  bool validating() const override { return false; }
  bool finished() const override { return !failures.empty(); }
  void fail(const std::string& message) override { failures.push_back(message); }
  void notice(const std::string& line) override { notices.push_back(line); }
  void recovery_event(const std::string&, std::int64_t) override {}
  void durable_window(const engine::resume_point&) override {}
  void report_rejected(const char*, const char*, const std::vector<std::string>&) override {}
  bool loss_pending() const override {
    // As the coordinator's: a lost spare no recovery counts on holds nothing up.
    for (const auto& [n, w] : workers_) {
      const bool counts = w.stage >= 0 || (recovery && recovery->involves(n));
      if (counts && !system().last_heard(n)) return true;
    }
    return false;
  }
  awaitable<bool> loss_follows() override { co_return loss_pending(); }
  void drop_stage(int, int) override {}
  awaitable<void> finish_stepping() override { co_return; }
  void enter_recovery() override {}
  awaitable<bool> hold_training(double&) override { co_return !loss_pending(); }
  awaitable<bool> rewire() override {
    ++rewirings;
    co_return true;
  }
  awaitable<void> recovered(const engine::recovery_done& d) override {
    done.push_back(d);
    co_return;
  }

 protected:
  awaitable<void> on_start() override {
    trap_exit(true);
    recovery = any_head_recovery(job_.policy)(*this);
    // Twelve iterations trained (W_sparse 4: job.w_sparse; the baselines' interval 4), window
    // 3 (iterations 8..11) replicated by every stage: the persisted window a recovery starts
    // from.
    for (std::int64_t i = 0; i < 12; ++i) {
      engine::planned_iteration it;
      it.iteration = i;
      EXPECT_EQ(recovery->planned(it).w_sparse, 4);
    }
    for (int s = 0; s < job_.pp; ++s) {
      capnp::MallocMessageBuilder msg;
      auto b = msg.initRoot<wire::WindowReplicated>();
      b.setStage(s);
      b.setWindow(3);
      b.setFirstIteration(8);
      co_await recovery->window_replicated(b.asReader());
    }
    system().on_membership([this](node_id n, actors::member_event e) {
      if (e == actors::member_event::up) return;
      (void)system().post_call(self(),
                               [this, n](actors::actor&) -> awaitable<void> { co_await lose(n); });
    });
    co_return;
  }
  awaitable<void> on_exit(actor_ref who, actors::exit_reason why) override {
    if (who == recovery->tree_root()) tree_exits.push_back(why.to_string());
    co_return;
  }

 private:
  // As the coordinator's worker_lost: the recovery's own workers are its to handle; a stage's
  // worker is a loss to place.
  awaitable<void> lose(node_id n) {
    const auto it = workers_.find(n);
    if (it == workers_.end()) co_return;
    const engine::worker_info w = it->second;
    workers_.erase(it);
    if (recovery->involves(n)) {
      co_await recovery->lost_member(n);
    } else if (w.stage >= 0) {
      co_await recovery->lost(w);
    }
  }
  awaitable<void> restart(wire::RegionRestart::Reader m, wire::RegionMembers::Builder out) {
    co_await recovery->region_restart(m, out);
  }
  awaitable<void> escalated(wire::RegionEscalated::Reader m) {
    std::string reason = m.getReason();
    co_await recovery->escalated(m.getRegion(), std::move(reason));
  }
  engine::job_config job_;
  std::map<node_id, engine::worker_info> workers_;
  models::loss_scaler scaler_;
};

// pp 4, dp 1: stage s on worker s + 1; workers 5..8 are spares.
struct cluster {
  actors::deterministic d;
  actors::actor_system& head;
  std::map<node_id, actor_ref> agents;
  cluster() : head(d.add(0)) {
    actors::system_config cfg;
    cfg.head = 0;
    for (node_id n = 1; n <= 8; ++n) {
      auto& w = d.add(n, cfg);
      w.register_type<region_member>(region_member::registered_name);
      agents[n] = w.spawn<fake_agent>().ref;
    }
  }
  awaitable<fake_head*> start(int region_restarts,
                              engine::policy_kind policy = engine::policy_kind::moevement) {
    for (node_id n = 1; n <= 8; ++n) {
      auto joined = co_await d[n].join(1s);
      if (!joined.ok()) ADD_FAILURE() << joined.err().message;
    }
    engine::job_config job;
    job.pp = 4;
    job.dp = 1;
    job.region_restarts = region_restarts;
    job.w_sparse = 4;
    job.baseline.interval = 4;
    job.policy = policy;
    job.durable = false;  // an escalation stops the job (no disk in these fakes)
    std::map<node_id, engine::worker_info> workers;
    for (node_id n = 1; n <= 8; ++n) {
      engine::worker_info w;
      w.node = n;
      w.agent = agents[n];
      w.checkpoint = agents[n];
      if (n <= 4) {
        w.stage = int(n) - 1;
        w.replica = 0;
      }
      workers[n] = w;
    }
    auto ref = head.spawn<fake_head>(job, workers).ref;
    co_await head.sleep_for(10ms);
    co_return head.local_actor<fake_head>(ref);
  }
  const std::vector<fake_agent::restore>& restores(node_id n) {
    return d[n].local_actor<fake_agent>(agents[n])->restores;
  }
  // Under a rollback: stage 1's worker (2) dies and spare 5 is sent a fresh stage 1; its
  // Restore's generation, or nullopt (a failure added) when it was not sent just so.
  awaitable<std::optional<std::uint64_t>> lose_stage_1() {
    d.hub().crash(2);
    co_await head.sleep_for(100ms);
    if (restores(5).size() != 1 || restores(5)[0].stage != 1) {
      ADD_FAILURE() << restores(5).size() << " Restores on spare 5, not one of stage 1";
      co_return std::nullopt;
    }
    co_return restores(5)[0].generation;
  }
};

TEST(region_recovery, contiguous_losses_are_one_region_and_a_lost_replacement_restarts_it) {
  cluster c;
  c.d.run_body([&]() -> awaitable<void> {
    fake_head* h = co_await c.start(3);
    c.d.hub().crash(2);  // stages 1 and 2 in one step
    c.d.hub().crash(3);
    co_await c.head.sleep_for(100ms);
    // One region, stages 1..2, rebuilt on spares 5 and 6 from window 3 (iterations 8..11).
    for (node_id spare : {5u, 6u}) {
      const auto& r = c.restores(spare);
      if (r.size() != 1) {
        ADD_FAILURE() << "spare " << spare << ": " << r.size() << " Restores";
        co_return;
      }
      EXPECT_EQ(r[0].first, 1);
      EXPECT_EQ(r[0].last, 2);
      EXPECT_EQ(r[0].target, 12);
      EXPECT_EQ(r[0].window, 3);
      EXPECT_EQ(r[0].first_iteration, 8);
      EXPECT_EQ(r[0].steps, 4u);
    }
    const std::uint64_t g1 = c.restores(5)[0].generation;
    EXPECT_EQ(c.restores(6)[0].generation, g1);
    EXPECT_TRUE(c.restores(7).empty());

    // Spare 6 dies during its restore: the region restarts, 6's role on spare 7, and every
    // member restores the new generation (5 again: the joint replay needs all of them).
    c.d.hub().crash(6);
    co_await c.head.sleep_for(100ms);
    if (c.restores(7).size() != 1 || c.restores(5).size() != 2) {
      ADD_FAILURE() << c.restores(7).size() << " and " << c.restores(5).size() << " Restores";
      co_return;
    }
    const std::uint64_t g2 = c.restores(7)[0].generation;
    EXPECT_GT(g2, g1);
    EXPECT_EQ(c.restores(5)[1].generation, g2);
    EXPECT_EQ(c.restores(7)[0].stage, c.restores(6)[0].stage);

    // A report of the old generation counts for nothing; the new ones end the recovery.
    co_await h->report(5, g1);
    EXPECT_EQ(h->rewirings, 0);
    co_await h->report(5, g2);
    EXPECT_EQ(h->rewirings, 0);
    co_await h->report(7, g2);
    EXPECT_EQ(h->rewirings, 1);
    if (h->done.size() != 1) {
      ADD_FAILURE() << h->done.size() << " recoveries ended";
      co_return;
    }
    EXPECT_EQ(h->done[0].target, 12);
    EXPECT_TRUE(h->done[0].counts);
    EXPECT_FALSE(h->recovery->active());
    EXPECT_TRUE(h->failures.empty()) << h->failures.front();
  });
}

TEST(region_recovery, a_disjoint_loss_is_a_region_of_its_own_and_a_neighbours_loss_grows_it) {
  cluster c;
  c.d.run_body([&]() -> awaitable<void> {
    fake_head* h = co_await c.start(3);
    c.d.hub().crash(1);  // stage 0
    co_await c.head.sleep_for(100ms);
    c.d.hub().crash(4);  // stage 3: not next to stage 0
    co_await c.head.sleep_for(100ms);
    if (c.restores(5).size() != 1 || c.restores(6).size() != 1) {
      ADD_FAILURE() << c.restores(5).size() << " and " << c.restores(6).size() << " Restores";
      co_return;
    }
    EXPECT_EQ(c.restores(5)[0].first, 0);
    EXPECT_EQ(c.restores(5)[0].last, 0);
    EXPECT_EQ(c.restores(6)[0].first, 3);
    EXPECT_EQ(c.restores(6)[0].last, 3);

    c.d.hub().crash(2);  // stage 1, next to the region of stage 0: it grows to 0..1
    co_await c.head.sleep_for(100ms);
    if (c.restores(5).size() != 2 || c.restores(7).size() != 1) {
      ADD_FAILURE() << c.restores(5).size() << " and " << c.restores(7).size() << " Restores";
      co_return;
    }
    EXPECT_EQ(c.restores(5)[1].first, 0);
    EXPECT_EQ(c.restores(5)[1].last, 1);
    EXPECT_EQ(c.restores(7)[0].first, 0);
    EXPECT_EQ(c.restores(7)[0].last, 1);
    EXPECT_EQ(c.restores(6).size(), 1u) << "the disjoint region is not restarted";
    // Every member reports: one rewiring, training goes on.
    co_await h->report(6, c.restores(6)[0].generation);
    EXPECT_EQ(h->rewirings, 0);
    co_await h->report(5, c.restores(5)[1].generation);
    co_await h->report(7, c.restores(7)[0].generation);
    EXPECT_EQ(h->rewirings, 1);
    EXPECT_EQ(h->done.size(), 1u);
    EXPECT_TRUE(h->failures.empty()) << h->failures.front();
  });
}

// Spare 5's restore of stage 1 fails while stage 3, not next to it, is lost: that loss is a
// region of its own, and stage 1's region stays failed, so the job stops saying why. (The loss
// pending after the failure timeout was taken for one that restarts the region: it waited for
// ever.)
TEST(region_recovery, a_failed_restore_stops_the_job_though_a_disjoint_loss_came_meanwhile) {
  cluster c;
  c.d.run_body([&]() -> awaitable<void> {
    fake_head* h = co_await c.start(3);
    c.d.hub().crash(2);  // stage 1: rebuilt on spare 5
    co_await c.head.sleep_for(100ms);
    if (c.restores(5).size() != 1) {
      ADD_FAILURE() << c.restores(5).size() << " Restores on spare 5";
      co_return;
    }
    h->fail_restore(5, "worker 5 could not start its stage: a peer's log answer was malformed");
    co_await c.head.sleep_for(10ms);  // in the failure timeout
    c.d.hub().crash(4);               // stage 3: a region of its own, on spare 6
    co_await c.head.sleep_for(5s);
    EXPECT_EQ(c.restores(5).size(), 1u) << "stage 1's region is not restarted";
    if (h->failures.size() != 1) {
      ADD_FAILURE() << h->failures.size() << " failures: the recovery waits for ever";
      co_return;
    }
    EXPECT_NE(h->failures[0].find("malformed"), std::string::npos) << h->failures[0];
  });
}

// The same with the loss next to it: the region grows to stages 1..2 and restarts, and the
// failure of its old generation stops nothing.
TEST(region_recovery, a_failed_restore_is_left_to_the_restart_a_neighbours_loss_causes) {
  cluster c;
  c.d.run_body([&]() -> awaitable<void> {
    fake_head* h = co_await c.start(3);
    c.d.hub().crash(2);
    co_await c.head.sleep_for(100ms);
    if (c.restores(5).size() != 1) {
      ADD_FAILURE() << c.restores(5).size() << " Restores on spare 5";
      co_return;
    }
    h->fail_restore(5, "worker 5 could not start its stage: its peer went");
    co_await c.head.sleep_for(10ms);
    c.d.hub().crash(3);  // stage 2
    co_await c.head.sleep_for(5s);
    EXPECT_TRUE(h->failures.empty()) << h->failures.front();
    if (c.restores(5).size() != 2 || c.restores(6).size() != 1) {
      ADD_FAILURE() << c.restores(5).size() << " and " << c.restores(6).size() << " Restores";
      co_return;
    }
    const std::uint64_t g = c.restores(6)[0].generation;
    EXPECT_EQ(c.restores(5)[1].generation, g);
    co_await h->report(5, g);
    co_await h->report(6, g);
    EXPECT_EQ(h->done.size(), 1u);
    EXPECT_TRUE(h->failures.empty()) << h->failures.front();
  });
}

// The region supervisors under the job supervisor, by region.
awaitable<std::vector<std::string>> regions_under(actors::actor_system& head, fake_head* h) {
  std::vector<std::string> ids;
  auto r = co_await actors::supervisor::which_children(head, h->recovery->tree_root(), 1s);
  if (!r.ok()) {
    ADD_FAILURE() << r.err().message;
    co_return ids;
  }
  for (const auto& [id, ref] : *r) {
    EXPECT_TRUE(head.alive(ref)) << id;
    ids.push_back(id);
  }
  co_return ids;
}

TEST(region_recovery, the_tree_is_a_job_supervisor_over_a_region_supervisor_per_region) {
  cluster c;
  c.d.run_body([&]() -> awaitable<void> {
    fake_head* h = co_await c.start(3);
    EXPECT_FALSE(h->recovery->tree_root().valid()) << "no tree before a loss";
    c.d.hub().crash(1);  // stage 0
    c.d.hub().crash(3);  // stage 2: a region of its own
    co_await c.head.sleep_for(100ms);
    const actor_ref root = h->recovery->tree_root();
    EXPECT_TRUE(c.head.alive(root));
    const auto two = co_await regions_under(c.head, h);
    const std::vector<std::string> expected{"1", "2"};
    EXPECT_EQ(two, expected);
    // Stage 1 joins them: one region absorbs the other, whose supervisor is stopped on
    // purpose (not escalated), and grows.
    c.d.hub().crash(2);
    co_await c.head.sleep_for(100ms);
    const auto merged = co_await regions_under(c.head, h);
    EXPECT_EQ(merged.size(), 1u);
    EXPECT_TRUE(h->failures.empty()) << h->failures.front();
    for (node_id n : {5u, 6u, 7u}) {
      if (c.restores(n).empty()) {
        ADD_FAILURE() << "spare " << n << " got no Restore";
        co_return;
      }
      EXPECT_EQ(c.restores(n).back().first, 0) << n;
      EXPECT_EQ(c.restores(n).back().last, 2) << n;
    }
    for (node_id n : {5u, 6u, 7u}) co_await h->report(n, c.restores(n).back().generation);
    EXPECT_EQ(h->done.size(), 1u);
    // The recovery ended: its region supervisors went, the job supervisor stays for the next.
    co_await c.head.sleep_for(10ms);
    const auto none = co_await regions_under(c.head, h);
    EXPECT_TRUE(none.empty());
    EXPECT_EQ(h->recovery->tree_root(), root);
    EXPECT_TRUE(h->tree_exits.empty());
    // The job's end takes the tree down.
    h->recovery->stop();
    co_await c.head.sleep_for(10ms);
    EXPECT_FALSE(c.head.alive(root));
    EXPECT_TRUE(h->failures.empty()) << h->failures.front();
  });
}

TEST(region_recovery, a_region_past_its_restart_intensity_stops_the_job_saying_so) {
  cluster c;
  c.d.run_body([&]() -> awaitable<void> {
    fake_head* h = co_await c.start(0);  // no restart allowed
    c.d.hub().crash(3);                  // stage 2, rebuilt on spare 5
    co_await c.head.sleep_for(100ms);
    EXPECT_EQ(c.restores(5).size(), 1u);
    c.d.hub().crash(5);  // the replacement dies: a restart, past the intensity
    co_await c.head.sleep_for(100ms);
    if (h->failures.size() != 1) {
      ADD_FAILURE() << h->failures.size() << " failures";
      co_return;
    }
    EXPECT_NE(h->failures[0].find("past checkpoint.region_restarts = 0"), std::string::npos)
        << h->failures[0];
    EXPECT_TRUE(c.restores(6).empty()) << "no generation after the escalation";
    EXPECT_TRUE(h->done.empty());
    // The region supervisor gave up and reached the job supervisor, which reported it and
    // stays (its strategy decided: here, no durable tier, the job stops).
    EXPECT_TRUE(c.head.alive(h->recovery->tree_root()));
    const auto left = co_await regions_under(c.head, h);
    EXPECT_TRUE(left.empty());
    EXPECT_TRUE(h->tree_exits.empty());
  });
}

// A region that gives up while a loss merges it into its neighbour: the merged region keeps
// its escalation (it was erased with the absorbed region, the escalation dropped as stale,
// and the merged region restarted past the limit until the spares ran out). Either loss may
// be handled first (declared in one heartbeat tick, in node order).
TEST(region_recovery, a_merge_keeps_the_escalation_of_the_region_it_absorbs) {
  for (const bool member_first : {true, false}) {
    SCOPED_TRACE(member_first ? "the member's loss first" : "the neighbour's loss first");
    cluster c;
    c.d.run_body([&]() -> awaitable<void> {
      fake_head* h = co_await c.start(1);
      c.d.hub().crash(1);  // region 1: stage 0 on spare 5
      co_await c.head.sleep_for(100ms);
      c.d.hub().crash(3);  // region 2: stage 2 on spare 6
      co_await c.head.sleep_for(100ms);
      c.d.hub().crash(6);  // region 2 restarts on spare 7 (1 restart of 1)
      co_await c.head.sleep_for(100ms);
      EXPECT_EQ(c.restores(7).size(), 1u);
      // Region 2 gives up as stage 1's loss merges stages 0..2.
      c.d.hub().crash(member_first ? 7 : 2);
      c.d.hub().crash(member_first ? 2 : 7);
      co_await c.head.sleep_for(200ms);
      if (h->failures.size() != 1) {
        ADD_FAILURE() << h->failures.size() << " failures";
        co_return;
      }
      EXPECT_NE(h->failures[0].find("past checkpoint.region_restarts = 1"), std::string::npos)
          << h->failures[0];
      EXPECT_TRUE(c.restores(8).empty()) << "no generation after the escalation";
    });
  }
}

TEST(region_recovery, a_window_a_stage_never_replicates_is_reported_once_naming_it) {
  cluster c;
  c.d.run_body([&]() -> awaitable<void> {
    fake_head* h = co_await c.start(3);
    // Window 4 (iterations 16..19) reaches the replicators of every stage but stage 2.
    for (int s : {0, 1, 3}) {
      capnp::MallocMessageBuilder msg;
      auto b = msg.initRoot<wire::WindowReplicated>();
      b.setStage(s);
      b.setWindow(4);
      b.setFirstIteration(16);
      co_await h->recovery->window_replicated(b.asReader());
    }
    auto plan_to = [&](std::int64_t last) {
      for (std::int64_t i = 12; i <= last; ++i) {
        engine::planned_iteration it;
        it.iteration = i;
        (void)h->recovery->planned(it);
      }
    };
    plan_to(27);  // three windows after it began: not yet
    EXPECT_TRUE(h->notices.empty()) << h->notices.front();
    plan_to(40);
    if (h->notices.size() != 1) {
      ADD_FAILURE() << h->notices.size() << " notices";
      co_return;
    }
    EXPECT_NE(h->notices[0].find("window 4 (iterations 16..19) is not on the replicators of "
                                 "stage 2 replica 0 at iteration 28; a recovery now replays "
                                 "from window 3"),
              std::string::npos)
        << h->notices[0];
  });
}

TEST(rollback_recovery, a_spare_lost_during_the_rollback_restarts_it_then_every_stage_loads) {
  cluster c;
  c.d.run_body([&]() -> awaitable<void> {
    fake_head* h = co_await c.start(3, engine::policy_kind::dense_memory);
    const auto lost = co_await c.lose_stage_1();  // a fresh stage 1 on spare 5
    if (!lost) co_return;
    const std::uint64_t g1 = *lost;
    c.d.hub().crash(5);  // the spare dies while it builds the stage: the region restarts
    co_await c.head.sleep_for(100ms);
    if (c.restores(6).size() != 1) {
      ADD_FAILURE() << c.restores(6).size() << " Restores on spare 6";
      co_return;
    }
    EXPECT_EQ(c.restores(6)[0].stage, 1);
    EXPECT_GT(c.restores(6)[0].generation, g1);
    EXPECT_EQ(h->rewirings, 0);
    co_await h->report(6, g1);  // an older generation's report counts for nothing
    EXPECT_EQ(h->rewirings, 0);
    co_await h->report(6, c.restores(6)[0].generation);
    co_await c.head.sleep_for(100ms);
    EXPECT_EQ(h->rewirings, 1);
    // Every stage loaded the newest checkpoint all of them offered; training goes on there.
    for (node_id n : {1u, 3u, 4u, 6u}) {
      const auto& loads = c.d[n].local_actor<fake_agent>(c.agents[n])->loads;
      EXPECT_EQ(loads, std::vector<std::int64_t>{8}) << "worker " << n;
    }
    if (h->done.size() != 1) {
      ADD_FAILURE() << h->done.size() << " recoveries ended; "
                    << testing::PrintToString(h->failures);
      co_return;
    }
    EXPECT_EQ(h->done[0].target, 8);
    EXPECT_TRUE(h->done[0].rolled_back.has_value());
    EXPECT_FALSE(h->recovery->active());
  });
}

// A fresh stage that reports while the rollback is about to restart (a survivor was just lost,
// its supervisor's restart not here yet) keeps its report: the restart sends it no new Restore,
// so a dropped report would leave the rollback waiting for it for ever.
TEST(rollback_recovery, a_report_between_a_loss_and_the_restart_it_causes_still_counts) {
  cluster c;
  c.d.run_body([&]() -> awaitable<void> {
    fake_head* h = co_await c.start(3, engine::policy_kind::dense_memory);
    const auto lost = co_await c.lose_stage_1();  // a fresh stage 1 on spare 5
    if (!lost) co_return;
    const std::uint64_t g1 = *lost;
    // The head learns that survivor stage 2 (worker 3) is gone; spare 5 reports before the
    // region's supervisor asks for the restart.
    co_await h->recovery->lost_member(3);
    co_await h->report(5, g1);
    c.d.hub().crash(3);
    co_await c.head.sleep_for(100ms);
    if (c.restores(6).size() != 1) {
      ADD_FAILURE() << c.restores(6).size() << " Restores on spare 6";
      co_return;
    }
    EXPECT_EQ(c.restores(6)[0].stage, 2);
    EXPECT_EQ(c.restores(5).size(), 1u) << "the fresh stage still up keeps its build";
    co_await h->report(6, c.restores(6)[0].generation);
    co_await c.head.sleep_for(100ms);
    EXPECT_EQ(h->rewirings, 1);
    if (h->done.size() != 1) {
      ADD_FAILURE() << h->done.size() << " recoveries ended; "
                    << testing::PrintToString(h->failures);
      co_return;
    }
    EXPECT_EQ(h->done[0].target, 8);
  });
}

TEST(rollback_recovery, past_its_restart_intensity_the_job_stops_saying_so) {
  cluster c;
  c.d.run_body([&]() -> awaitable<void> {
    fake_head* h = co_await c.start(0, engine::policy_kind::dense_memory);
    c.d.hub().crash(2);
    co_await c.head.sleep_for(100ms);
    c.d.hub().crash(5);  // a restart, past the intensity of 0
    co_await c.head.sleep_for(100ms);
    if (h->failures.size() != 1) {
      ADD_FAILURE() << h->failures.size() << " failures";
      co_return;
    }
    EXPECT_NE(h->failures[0].find("past checkpoint.region_restarts = 0"), std::string::npos)
        << h->failures[0];
    EXPECT_TRUE(c.restores(6).empty());
    EXPECT_TRUE(h->done.empty());
  });
}

// ---- W_sparse re-chosen at a window's start (window_plan, window_tuner)

TEST(window_plan, places_every_step_and_changes_w_only_at_a_window_start) {
  window_plan p;
  EXPECT_EQ(p.at(3).w_sparse, 0) << "nothing placed before the plan starts";
  p.start(0, 4);
  const auto at = [&](std::int64_t i) {
    const auto c = p.at(i);
    return std::tuple{c.w_sparse, c.window, c.slot};
  };
  EXPECT_EQ(at(0), std::tuple(4, 0u, 0u));
  EXPECT_EQ(at(5), std::tuple(4, 1u, 1u));
  EXPECT_THROW(p.start(9, 2), std::logic_error) << "step 9 is slot 1 of window 2";
  p.start(8, 2);  // window 2 onwards: windows of 2, numbered on
  EXPECT_EQ(at(7), std::tuple(4, 1u, 3u)) << "the steps before keep their places";
  EXPECT_EQ(at(8), std::tuple(2, 2u, 0u));
  EXPECT_EQ(at(11), std::tuple(2, 3u, 1u));
  p.start(12, 8);
  EXPECT_EQ(at(21), std::tuple(8, 5u, 1u));
  EXPECT_EQ(p.w_of(1), 4);
  EXPECT_EQ(p.w_of(3), 2);
  EXPECT_EQ(p.w_of(9), 8);
  // A step planned again after a recovery gets the place it had; replacing a segment from
  // its own first step changes only what follows.
  p.start(12, 3);
  EXPECT_EQ(at(12), std::tuple(3, 4u, 0u));
  EXPECT_EQ(p.segments().size(), 3u);
  p.forget_before(4);
  EXPECT_EQ(p.segments().size(), 1u) << "windows 4.. lie in the last segment only";
  EXPECT_EQ(p.w_of(3), 0) << "forgotten";
  EXPECT_EQ(p.w_of(4), 3);
  EXPECT_THROW(p.start(20, 0), std::invalid_argument);
  window_plan resumed;  // a resumed job: windows go on from the journal's
  resumed.start(75, 25, 3);
  EXPECT_EQ(resumed.at(100).window, 4u);
  EXPECT_EQ(resumed.at(100).slot, 0u);
}

engine::iteration_cost cost(double seconds, double stall, std::uint64_t fresh = 0, double cpu = 0.0,
                            double replication_cpu = 0.0) {
  engine::iteration_cost c;
  c.replication_cpu_s = replication_cpu;
  c.snapshot_bytes = 100 << 20;
  c.seconds = seconds;
  c.stall_s = stall;
  c.capture_cpu_s = cpu;
  c.fresh_bytes = fresh;
  return c;
}

TEST(window_book, durable_writes_take_their_share_of_the_cores) {
  // 2 s of writers' CPU on 2 cores at 1%: the next write 100 s after this one began.
  EXPECT_DOUBLE_EQ(durable_gap_s(2.0, 2.0, 0.01), 100.0);
  EXPECT_DOUBLE_EQ(durable_gap_s(2.0, 4.0, 0.01), 50.0);      // twice the cores, half the wait
  EXPECT_EQ(durable_gap_s(2.0, 0.0, 0.01), 0.0);              // GPU stages: not paced
  EXPECT_EQ(durable_gap_s(2.0, 2.0, 0.0), 0.0);               // durable_share 0: every window
  EXPECT_EQ(durable_gap_s(0.0, 2.0, 0.01), 0.0);              // nothing measured
  EXPECT_EQ(durable_gap_s(1e6, 1.0, 1e-9), 7 * 24 * 3600.0);  // at most a week
}

TEST(window_tuner, raises_w_while_capturing_costs_over_the_bound_and_halves_it_when_cheap) {
  window_tuner t({.max_overhead = 0.01, .ceiling = 40});
  for (int i = 0; i < 7; ++i) t.add(cost(1.0, 0.1));
  EXPECT_FALSE(t.decide(4)) << "at least min_iterations measured";
  t.add(cost(1.0, 0.1));
  // 0.1 s of stall in each second, one iteration (the costliest) left out: 0.7 / 6.3 = 11%.
  auto d = t.decide(4);
  ASSERT_TRUE(d);
  EXPECT_NEAR(d->overhead, 0.7 / 6.3, 1e-12);
  EXPECT_EQ(d->w, 16) << "at most four times at once";
  EXPECT_FALSE(d->capped);
  for (int i = 0; i < 16; ++i) t.add(cost(1.0, i == 0 ? 0.024 : (i == 1 ? 0.003 : 0.0)));
  d = t.decide(16);
  ASSERT_TRUE(d);
  EXPECT_NEAR(d->overhead, 0.003 / (15 - 0.003), 1e-12) << "the 24 ms one-off left out";
  EXPECT_EQ(d->w, 16) << "one cheap window is not enough to halve";
  for (int i = 0; i < 16; ++i) t.add(cost(1.0, 0.0));
  d = t.decide(16);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->w, 8) << "two in a row are";
  for (int i = 0; i < 8; ++i) t.add(cost(1.0, 0.0101));  // just over 1%: at least W + 1
  d = t.decide(8);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->w, 9);
  for (int i = 0; i < 9; ++i) t.add(cost(1.0, 0.5));
  EXPECT_EQ(t.decide(9)->w, 36);
  for (int i = 0; i < 36; ++i) t.add(cost(1.0, 0.5));
  d = t.decide(36);
  EXPECT_EQ(d->w, 40) << "never past the ceiling (one operator per slot)";
  EXPECT_TRUE(d->capped) << "the console says the ceiling chose it, not the bound";
}

// A resume at a deeper pipeline: the journal's W is past the most operators a stage has now;
// either rule brings it down to that ceiling and says so (also when the W was cheap; the ETTR
// rule looks no lower than W / 2, past the ceiling here).
TEST(window_tuner, a_w_past_the_ceiling_comes_down_to_it_under_either_rule) {
  for (const auto& [mtbf, w] : {std::pair{0.0, 18}, std::pair{3600.0, 40}}) {
    window_tuner t({.max_overhead = 0.01, .mtbf_s = mtbf, .restart_s = 1, .ceiling = 10});
    for (int i = 0; i < w; ++i) t.add(cost(1.0, 0.0));
    const auto d = t.decide(w);
    ASSERT_TRUE(d);
    EXPECT_EQ(d->w, 10) << mtbf;
    EXPECT_TRUE(d->capped) << mtbf;
    for (int i = 0; i < 10; ++i) t.add(cost(1.0, 0.0));
    EXPECT_FALSE(t.decide(10)->capped) << mtbf << ": at the ceiling, not past it";
  }
}

// A resumed job's tuner is made before its stages report their operators (they come with the
// restore): a ceiling not known yet holds W where the journal left it, where it fell to 1
// before; once the stages report theirs, W grows up to it.
TEST(window_tuner, a_ceiling_not_reported_yet_holds_w_and_a_reported_one_lets_it_grow) {
  window_tuner t({.max_overhead = 0.01});  // ceiling 0: nothing reported
  for (int i = 0; i < 10; ++i) t.add(cost(1.0, 0.0));
  auto d = t.decide(10);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->w, 10) << "cheap once: held";
  for (int i = 0; i < 10; ++i) t.add(cost(1.0, 0.5));
  d = t.decide(10);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->w, 10) << "over the bound, but no ceiling known to grow to";
  t.raise_ceiling(64);
  t.raise_ceiling(0);  // a worker that reported none yet lowers nothing
  for (int i = 0; i < 10; ++i) t.add(cost(1.0, 0.5));
  d = t.decide(10);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->w, 40) << "four times at once";
}

// checkpoint.mtbf_s: the W in [W/2, 4 x W] that maximises the predicted ETTR. Capturing costs
// 11% at W 1 over 0.9 s of compute (one iteration of the nine, the costliest, left out): with a
// failure an hour the optimum is near W 16 (the capture's o / W against a replay's 1.5 W
// iterations), reached four times at a time; with one a minute it is W 2, and a larger W halves.
TEST(window_tuner, with_an_mtbf_w_maximises_the_predicted_ettr) {
  window_tuner rare({.max_overhead = 0.01, .mtbf_s = 3600, .restart_s = 1, .ceiling = 64});
  for (int i = 0; i < 9; ++i) rare.add(cost(1.0, 0.1));
  auto d = rare.decide(1);
  ASSERT_TRUE(d);
  EXPECT_TRUE(d->ettr_rule);
  EXPECT_NEAR(d->overhead, 0.8 / 7.2, 1e-12);
  EXPECT_EQ(d->w, 4) << "at most four times at once";
  EXPECT_NEAR(d->predicted_ettr, rare.predicted_ettr(4, 0.8 / 7.2, 1, 0.9), 1e-12);
  EXPECT_GT(d->predicted_ettr, d->previous_ettr);
  for (int i = 0; i < 9; ++i) rare.add(cost(1.0, 0.025));  // a quarter of the cost at W 4
  d = rare.decide(4);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->w, 16);
  for (int i = 0; i < 17; ++i) rare.add(cost(1.0, 0.1 / 16));
  EXPECT_EQ(rare.decide(16)->w, 16) << "the optimum, where it stays";

  window_tuner often({.max_overhead = 0.01, .mtbf_s = 60, .restart_s = 1, .ceiling = 64});
  for (int i = 0; i < 9; ++i) often.add(cost(1.0, 0.1));
  EXPECT_EQ(often.decide(1)->w, 2);
  for (int i = 0; i < 9; ++i) often.add(cost(1.0, 0.1 / 8));
  EXPECT_EQ(often.decide(8)->w, 4) << "halved at most at once";
  // The overhead bound plays no part under the ETTR rule, not even at 0.
  window_tuner no_bound({.max_overhead = 0.0, .mtbf_s = 60, .restart_s = 1, .ceiling = 64});
  for (int i = 0; i < 9; ++i) no_bound.add(cost(1.0, 0.1));
  ASSERT_TRUE(no_bound.decide(1));
}

TEST(window_tuner, warm_up_iterations_are_no_samples_and_cpu_counts_on_cpu_stages) {
  window_tuner t({.max_overhead = 0.01, .cores = 2, .ceiling = 64});
  // Slots into fresh memory (the kernel made their pages), in every other iteration: those
  // are left out, the others measured.
  for (int i = 0; i < 14; ++i) t.add(i % 2 == 0 ? cost(1.0, 0.9, 60 << 20) : cost(1.0, 0.0));
  EXPECT_FALSE(t.decide(4)) << "seven samples";
  EXPECT_EQ(t.warm_ups(), 7);
  t.add(cost(1.0, 0.0, 4 << 20));  // a few fresh bytes (a slot grew a little): a sample
  EXPECT_EQ(t.warm_ups(), 7);
  const auto calm = t.decide(4);
  ASSERT_TRUE(calm);
  EXPECT_EQ(calm->iterations, 8);
  EXPECT_EQ(calm->w, 4) << "the warm-ups' stall did not count";
  for (int i = 0; i < 8; ++i) t.add(cost(1.0, 0.0, 0, 0.05));  // 5% of a core of two: 2.5%
  auto d = t.decide(4);
  ASSERT_TRUE(d);
  EXPECT_NEAR(d->cpu_share_s, 0.2, 1e-12);
  EXPECT_EQ(d->w, 11);  // ceil(4 x 2.56)
  // GPU stages: the host's cores are not the compute's.
  window_tuner gpu({.max_overhead = 0.01, .ceiling = 64});
  for (int i = 0; i < 8; ++i) gpu.add(cost(1.0, 0.0, 0, 0.05));
  EXPECT_EQ(gpu.decide(4)->w, 4);
  window_tuner off({.max_overhead = 0.0, .cores = 2, .ceiling = 64});  // max_overhead = 0
  for (int i = 0; i < 8; ++i) off.add(cost(1.0, 0.9));
  EXPECT_FALSE(off.decide(4));
  // A recovery clears what was measured.
  window_tuner r({.max_overhead = 0.01, .ceiling = 64});
  for (int i = 0; i < 7; ++i) r.add(cost(1.0, 0.9));
  r.clear();
  r.add(cost(1.0, 0.9));
  EXPECT_FALSE(r.decide(1)) << "one iteration since the recovery";
}

TEST(window_tuner, the_replications_cpu_counts_beside_the_captures_on_cpu_stages) {
  // Copies that cost nothing, offers and answers that cost 4% of a core of two (2%): a larger
  // W, as if the capture itself cost that.
  window_tuner t({.max_overhead = 0.01, .cores = 2, .ceiling = 64});
  for (int i = 0; i < 8; ++i) t.add(cost(1.0, 0.0, 0, 0.0, 0.04));
  const auto d = t.decide(4);
  ASSERT_TRUE(d);
  EXPECT_NEAR(d->replication_cpu_s, 0.32, 1e-12) << "summed over the eight";
  EXPECT_DOUBLE_EQ(d->capture_cpu_s, 0.0);
  EXPECT_NEAR(d->cpu_share_s, 0.16, 1e-12);
  EXPECT_EQ(d->w, 9);  // ceil(4 x 2.04)
  // Both together are summed.
  window_tuner both({.max_overhead = 0.01, .cores = 2, .ceiling = 64});
  for (int i = 0; i < 8; ++i) both.add(cost(1.0, 0.0, 0, 0.01, 0.01));
  EXPECT_EQ(both.decide(4)->w, 5) << "1% of the time: over the bound by a hair";
  // GPU stages: their host's cores are not the compute's.
  window_tuner gpu({.max_overhead = 0.01, .ceiling = 64});
  for (int i = 0; i < 8; ++i) gpu.add(cost(1.0, 0.0, 0, 0.0, 0.05));
  EXPECT_EQ(gpu.decide(4)->w, 4);
}

}  // namespace
}  // namespace moevement::recovery
