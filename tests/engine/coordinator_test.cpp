// The coordinator on the deterministic scheduler: one that stops abnormally (a handler that
// threw) ends the job saying why, in the run log too, instead of leaving its workers idle with
// no head driving them; a worker lost before training started has its role taken by a spare.
#include "engine/coordinator.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "actors/deterministic.hpp"
#include "tests/support/co_assert.hpp"

namespace moevement::engine {
namespace {

using namespace std::chrono_literals;

std::string file_text(const std::filesystem::path& p) {
  std::ifstream in(p);
  return {std::istreambuf_iterator<char>(in), {}};
}

TEST(coordinator, one_that_fails_ends_the_job_saying_why) {
  const auto path = std::filesystem::path(::testing::TempDir()) /
                    ("coordinator_" + std::to_string(::getpid()) + ".jsonl");
  std::optional<job_outcome> outcome;
  {
    run_log log(path);
    actors::deterministic d;
    auto& head = d.add(0);
    job_config job;
    job.pp = 1;
    job.dp = 1;
    coordinator_callbacks cb;
    cb.on_finished = [&](const job_outcome& o) { outcome = o; };
    const auto ref =
        head.spawn<coordinator>(job, models::config_map{}, cb, &log, nullptr, std::nullopt).ref;
    d.run_body([&]() -> actors::awaitable<void> {
      co_await head.sleep_for(10ms);
      EXPECT_FALSE(outcome.has_value());  // waiting for its workers
      head.stop(ref, actors::exit_reason::failure("boom"));
      co_await head.sleep_for(10ms);
    });
  }
  ASSERT_TRUE(outcome.has_value()) << "the job never ended";
  EXPECT_FALSE(outcome->ok);
  EXPECT_NE(outcome->message.find("the head's coordinator failed"), std::string::npos)
      << outcome->message;
  EXPECT_NE(outcome->message.find("boom"), std::string::npos) << outcome->message;
  const std::string log = file_text(path);
  EXPECT_NE(log.find("\"event\":\"job_failed\""), std::string::npos) << log;
  EXPECT_NE(log.find("boom"), std::string::npos) << log;
  std::filesystem::remove(path);
}

// A stop on purpose (the head's shutdown at the job's end) is no failure.
TEST(coordinator, one_shut_down_ends_nothing) {
  std::optional<job_outcome> outcome;
  actors::deterministic d;
  auto& head = d.add(0);
  job_config job;
  coordinator_callbacks cb;
  cb.on_finished = [&](const job_outcome& o) { outcome = o; };
  const auto ref =
      head.spawn<coordinator>(job, models::config_map{}, cb, nullptr, nullptr, std::nullopt).ref;
  d.run_body([&]() -> actors::awaitable<void> {
    co_await head.sleep_for(10ms);
    head.stop(ref, actors::exit_reason::shutdown("the head leaves"));
    co_await head.sleep_for(10ms);
  });
  EXPECT_FALSE(outcome.has_value());
}

// A worker as the coordinator sees it: says hello (with a role, to a standby that took over),
// records its Assigns and reports each role's stage (itself), or, `silent`, dies building it.
class fake_worker : public actors::actor {
 public:
  using interface =
      actors::interface<actors::tell_t<wire::Assign>, actors::ask_t<wire::Wire, wire::WireAck>>;
  struct assigned {
    int stage = -1, replica = -1;
    bool resume = false;
  };
  // silent: never reports a stage; hello: says hello at all.
  fake_worker(actors::actor_ref head, int stage, int replica, bool taken, bool silent, bool hello)
      : head_(head),
        stage_(stage),
        replica_(replica),
        taken_(taken),
        silent_(silent),
        hello_(hello) {
    on<wire::Assign>(&fake_worker::assign);
    on<wire::Wire, wire::WireAck>(&fake_worker::wire);
  }
  std::vector<assigned> assigns;

 protected:
  actors::awaitable<void> on_start() override {
    if (!hello_) co_return;
    (void)tell<wire::WorkerHello>(head_, [&](wire::WorkerHello::Builder b) {
      b.setNode(system().node());
      b.setHost("localhost");
      write_ref(b.initAgent(), self());
      b.setPid(int(system().node()));
      b.setTaken(taken_);
      b.setStage(stage_);
      b.setReplica(replica_);
    });
    co_return;
  }

 private:
  actors::awaitable<void> assign(wire::Assign::Reader m) {
    assigns.push_back({m.getStage(), m.getReplica(), m.getResume()});
    if (silent_) co_return;
    if (assigns.size() == 1) (void)co_await system().join(std::chrono::seconds(1));
    const bool resume = m.getResume();
    (void)tell<wire::StageReady>(head_, [&](wire::StageReady::Builder b) {
      b.setNode(system().node());
      b.setStage(m.getStage());
      b.setReplica(m.getReplica());
      // (a role's stage; a resume's comes with its durable Restore)
      write_ref(b.initActor(), m.getStage() >= 0 && !resume ? self() : actors::actor_ref{});
    });
  }
  actors::awaitable<void> wire(wire::Wire::Reader, wire::WireAck::Builder) { co_return; }

  actors::actor_ref head_;
  int stage_, replica_;
  bool taken_, silent_, hello_;
};

// pp = 2, dp = 1 and one spare (workers 1 and 2, spare 3); worker `silent` (2) dies while its
// stage is built (after the Assigns, before its report), or before its hello (`says_hello`
// false).
struct starting_job {
  actors::deterministic d;
  actors::actor_system& head = d.add(0);
  std::optional<job_outcome> outcome;
  std::vector<std::string> notices;
  actors::actor_ref coordinator_ref;
  std::map<actors::node_id, actors::actor_ref> workers;

  explicit starting_job(bool takeover, actors::node_id silent = 2, bool says_hello = true) {
    job_config job;
    job.pp = 2;
    job.dp = 1;
    job.spares = 1;
    job.train.iterations = 4;
    job.start_timeout_ms = 1000;
    coordinator_callbacks cb;
    cb.on_finished = [this](const job_outcome& o) { outcome = o; };
    cb.on_notice = [this](const std::string& line) { notices.push_back(line); };
    std::optional<resume_point> resume;
    std::set<transport::node_id> taken;
    if (takeover) {
      resume.emplace();
      resume->window = 3;
      resume->w_sparse = 2;
      resume->target_iteration = 8;
      resume->pp = 2;
      taken = {1, 2, 3};
    }
    coordinator_ref =
        head.spawn<coordinator>(job, models::config_map{}, cb, nullptr, nullptr, resume, taken).ref;
    actors::system_config cfg;
    cfg.head = 0;
    for (actors::node_id n = 1; n <= 3; ++n) {
      const int stage = n <= 2 ? int(n) - 1 : -1;
      workers[n] = d.add(n, cfg)
                       .spawn<fake_worker>(coordinator_ref, stage, stage < 0 ? -1 : 0, takeover,
                                           n == silent, n != silent || says_hello)
                       .ref;
    }
  }
  const std::vector<fake_worker::assigned>& assigns(actors::node_id n) {
    return d[n].local_actor<fake_worker>(workers[n])->assigns;
  }
  coordinator& head_coordinator() { return *head.local_actor<coordinator>(coordinator_ref); }
  bool said(const std::string& what) const {
    return std::any_of(notices.begin(), notices.end(),
                       [&](const std::string& l) { return l.find(what) != std::string::npos; });
  }
};

// The spare is sent the lost worker's role by a second Assign, reports its stage, and training
// starts. (It used to end the job: "the job had not started training yet".)
TEST(coordinator, a_spare_takes_the_role_of_a_worker_lost_before_training_starts) {
  starting_job j(false);
  j.d.run_body([&]() -> actors::awaitable<void> {
    co_await j.head.sleep_for(50ms);
    CO_ASSERT(j.assigns(3).size() == 1u);
    EXPECT_EQ(j.assigns(3)[0].stage, -1) << "a spare at first";
    EXPECT_FALSE(j.head_coordinator().started()) << "worker 2 never reported";
    j.d.hub().crash(2);
    j.head_coordinator().lose_worker(2, "was killed by signal 9 (Killed)");
    co_await j.head.sleep_for(50ms);
    CO_ASSERT(j.assigns(3).size() == 2u);
    EXPECT_EQ(j.assigns(3)[1].stage, 1);
    EXPECT_EQ(j.assigns(3)[1].replica, 0);
    EXPECT_FALSE(j.assigns(3)[1].resume);
    EXPECT_TRUE(j.head_coordinator().started());
    EXPECT_FALSE(j.outcome.has_value()) << j.outcome->message;
    EXPECT_TRUE(j.said("before training started; spare worker 3 takes its role"));
    EXPECT_EQ(j.head_coordinator().workers().count(2), 0u);
    j.head.stop(j.coordinator_ref, actors::exit_reason::shutdown("the test ends"));
    co_await j.head.sleep_for(10ms);
  });
}

// A worker whose process ended before its hello (a node that failed to start): admission goes
// on without it, and the spare is given its role (the role of its number) in the Assigns.
TEST(coordinator, a_worker_that_ended_before_its_hello_has_its_role_taken_by_a_spare) {
  starting_job j(false, 2, /*says_hello=*/false);
  j.d.run_body([&]() -> actors::awaitable<void> {
    co_await j.head.sleep_for(50ms);
    EXPECT_TRUE(j.assigns(3).empty()) << "admission waits for worker 2";
    EXPECT_TRUE(j.head_coordinator().awaits_hello(2));
    j.d.hub().crash(2);
    j.head_coordinator().lose_worker(2, "exited with status 1");
    co_await j.head.sleep_for(50ms);
    CO_ASSERT(j.assigns(3).size() == 1u);
    EXPECT_EQ(j.assigns(3)[0].stage, 1);
    EXPECT_EQ(j.assigns(3)[0].replica, 0);
    EXPECT_TRUE(j.head_coordinator().started());
    EXPECT_FALSE(j.outcome.has_value()) << j.outcome->message;
    EXPECT_TRUE(
        j.said("worker 2 exited with status 1 before training started; its role goes to a "
               "spare, if one is left"));
    j.head.stop(j.coordinator_ref, actors::exit_reason::shutdown("the test ends"));
    co_await j.head.sleep_for(10ms);
  });
}

// A spare lost before training started is one fewer: training starts without it.
TEST(coordinator, a_spare_lost_before_training_starts_is_one_fewer) {
  starting_job j(false, /*silent=*/3);
  j.d.run_body([&]() -> actors::awaitable<void> {
    co_await j.head.sleep_for(50ms);
    EXPECT_FALSE(j.head_coordinator().started()) << "the spare never reported";
    j.d.hub().crash(3);
    j.head_coordinator().lose_worker(3, "was killed by signal 9 (Killed)");
    co_await j.head.sleep_for(50ms);
    EXPECT_TRUE(j.head_coordinator().started());
    EXPECT_FALSE(j.outcome.has_value()) << j.outcome->message;
    EXPECT_TRUE(j.said("before training started; 0 spare(s) left"));
    j.head.stop(j.coordinator_ref, actors::exit_reason::shutdown("the test ends"));
    co_await j.head.sleep_for(10ms);
  });
}

// cluster.start_timeout_ms: worker 2, silent (hung as it built its stage), is past its deadline
// and declared lost; the spare, on time, takes its role and gets a deadline of its own, and
// training starts once it reports. Before the deadline nothing is late, and the launcher is
// told when to look again.
TEST(coordinator, a_worker_late_at_the_start_deadline_is_replaced_by_a_spare_on_time) {
  starting_job j(false);
  std::vector<coordinator::start_check> checks;
  const auto check = [&] {
    j.head_coordinator().check_start(
        [&](const coordinator::start_check& r) { checks.push_back(r); });
  };
  j.d.run_body([&]() -> actors::awaitable<void> {
    co_await j.head.sleep_for(400ms);
    check();
    co_await j.head.sleep_for(10ms);
    CO_ASSERT(checks.size() == 1u);
    EXPECT_FALSE(checks[0].started);
    EXPECT_FALSE(checks[0].short_of_spares);
    EXPECT_EQ(j.assigns(3).size(), 1u) << "nobody is late yet";
    EXPECT_GE(checks[0].next, 500ms) << "worker 2's deadline, 1 s from the start";
    co_await j.head.sleep_for(700ms);
    check();
    co_await j.head.sleep_for(10ms);
    CO_ASSERT(checks.size() == 2u);
    EXPECT_FALSE(checks[1].short_of_spares);
    EXPECT_TRUE(checks[1].unheard.empty()) << "worker 2 said hello";
    CO_ASSERT(j.assigns(3).size() == 2u);
    EXPECT_EQ(j.assigns(3)[1].stage, 1);
    EXPECT_TRUE(
        j.said("did not report its stage within cluster.start_timeout_ms = 1000 ms "
               "before training started; spare worker 3 takes its role"));
    EXPECT_TRUE(j.head_coordinator().started());
    j.head.stop(j.coordinator_ref, actors::exit_reason::shutdown("the test ends"));
    co_await j.head.sleep_for(10ms);
  });
}

// Late workers the spares on time cannot all replace: the start fails (the launcher says how
// many said hello), and nobody is declared lost for it.
TEST(coordinator, late_workers_beyond_the_spares_fail_the_start) {
  starting_job j(false, /*silent=*/2, /*says_hello=*/false);
  std::optional<coordinator::start_check> got;
  j.d.run_body([&]() -> actors::awaitable<void> {
    co_await j.head.sleep_for(1100ms);
    j.d.hub().crash(3);  // the one spare, lost: nobody on time to take worker 2's role
    j.head_coordinator().lose_worker(3, "was killed by signal 9 (Killed)");
    co_await j.head.sleep_for(10ms);
    j.head_coordinator().check_start([&](const coordinator::start_check& r) { got = r; });
    co_await j.head.sleep_for(10ms);
    CO_ASSERT(got.has_value());
    EXPECT_TRUE(got->short_of_spares);
    EXPECT_TRUE(j.head_coordinator().awaits_hello(2)) << "not declared lost";
    j.head.stop(j.coordinator_ref, actors::exit_reason::shutdown("the test ends"));
    co_await j.head.sleep_for(10ms);
  });
}

// The same loss under a standby head that took over, between the last hello and the last stage
// report: the spare is given the role with a resume (its stage comes from disk with the
// others'), and the takeover goes on to the journal's window. (It used to end the job: "lost
// while the standby head took over, before every stage reported".) Here no recovery policy
// is given, so the start from disk stops there, saying so.
TEST(coordinator, a_spare_takes_the_role_of_a_worker_lost_while_a_takeover_starts) {
  starting_job j(true);
  j.d.run_body([&]() -> actors::awaitable<void> {
    co_await j.head.sleep_for(50ms);
    CO_ASSERT(j.assigns(3).size() == 1u);
    j.d.hub().crash(2);
    j.head_coordinator().lose_worker(2, "was killed by signal 9 (Killed)");
    co_await j.head.sleep_for(50ms);
    CO_ASSERT(j.assigns(3).size() == 2u);
    EXPECT_EQ(j.assigns(3)[1].stage, 1);
    EXPECT_TRUE(j.assigns(3)[1].resume);
    EXPECT_TRUE(j.said("before training started; spare worker 3 takes its role"));
    CO_ASSERT(j.outcome.has_value());
    EXPECT_NE(j.outcome->message.find("--resume needs checkpoint.policy"), std::string::npos)
        << j.outcome->message;
  });
}

}  // namespace
}  // namespace moevement::engine
