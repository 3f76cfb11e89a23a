// The recovery tree's region supervisor on the deterministic scheduler (no processes, no
// sleeps): its children are region_member actors on the members' workers; a member's worker
// lost restarts the region (the job is asked for the next generation first, and says where
// each member runs now); a worker lost between that answer and its child's start is tried
// again; growth counts as a restart; past the restart intensity the supervisor gives up and
// the job (its parent) sees why.
#include "recovery/region_supervisor.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "actors/deterministic.hpp"
#include "engine/engine.capnp.h"

namespace moevement::recovery {
namespace {

using namespace std::chrono_literals;
using actors::actor_ref;
using actors::awaitable;
using actors::node_id;
namespace wire = engine::wire;

// The coordinator's part: answers RegionRestart with answers_[call] (the last one once past
// the end), and keeps the exits of the supervisors it is linked to.
class fake_job : public actors::actor {
 public:
  using interface = actors::interface<actors::ask_t<wire::RegionRestart, wire::RegionMembers>>;
  explicit fake_job(std::vector<std::vector<node_id>> answers) : answers_(std::move(answers)) {
    on<wire::RegionRestart, wire::RegionMembers>(&fake_job::restart);
  }
  int restarts = 0;
  std::vector<std::string> exits;

 protected:
  awaitable<void> on_start() override {
    trap_exit(true);
    co_return;
  }
  awaitable<void> on_exit(actor_ref, actors::exit_reason why) override {
    exits.push_back(why.to_string());
    co_return;
  }

 private:
  awaitable<void> restart(wire::RegionRestart::Reader m, wire::RegionMembers::Builder out) {
    EXPECT_EQ(m.getRegion(), 7u);
    const auto& a = answers_[std::min<std::size_t>(std::size_t(restarts), answers_.size() - 1)];
    ++restarts;
    auto l = out.initNodes(static_cast<unsigned>(a.size()));
    for (unsigned i = 0; i < a.size(); ++i) l.set(i, a[i]);
    co_return;
  }
  std::vector<std::vector<node_id>> answers_;
};

struct tree {
  actors::deterministic d;
  actors::actor_system& head;
  std::vector<actors::actor_system*> workers;
  tree() : head(d.add(0)) {
    actors::system_config cfg;
    cfg.head = 0;
    for (node_id n = 1; n <= 4; ++n) {
      workers.push_back(&d.add(n, cfg));
      workers.back()->register_type<region_member>(region_member::registered_name);
    }
  }
  awaitable<std::vector<std::pair<std::string, actor_ref>>> children(actor_ref sup) {
    auto r = co_await actors::supervisor::which_children(head, sup, 1s);
    EXPECT_TRUE(r.ok());
    co_return r.ok() ? *r : std::vector<std::pair<std::string, actor_ref>>{};
  }
};

TEST(region_supervisor, a_lost_member_worker_restarts_the_region_where_the_job_says) {
  tree t;
  t.d.run_body([&]() -> awaitable<void> {
    for (auto* w : t.workers) {
      auto joined = co_await w->join(1s);
      if (!joined.ok()) ADD_FAILURE() << joined.err().message;
    }
    // generation 1 on workers 1 and 2; after worker 2's loss, its role on the spare, 3
    auto job = t.head.spawn<fake_job>(std::vector<std::vector<node_id>>{{1, 2}, {1, 3}});
    auto nodes = std::make_shared<region_supervisor::member_nodes>();
    auto sup = t.head.spawn<region_supervisor>(7, job.ref, nodes, 2, 1).ref;
    t.head.link(job.ref, sup);
    co_await t.head.sleep_for(100ms);
    auto* j = t.head.local_actor<fake_job>(job.ref);
    EXPECT_EQ(j->restarts, 1);
    auto first = co_await t.children(sup);
    if (first.size() != 2) {
      ADD_FAILURE() << first.size() << " children";
      co_return;
    }
    EXPECT_EQ(first[0].second.node, 1u);
    EXPECT_EQ(first[1].second.node, 2u);

    t.d.hub().crash(2);
    co_await t.head.sleep_for(100ms);
    EXPECT_EQ(j->restarts, 2);
    auto second = co_await t.children(sup);
    if (second.size() != 2) {
      ADD_FAILURE() << second.size() << " children";
      co_return;
    }
    EXPECT_EQ(second[0].second.node, 1u);
    EXPECT_EQ(second[1].second.node, 3u);
    EXPECT_NE(second[0].second, first[0].second) << "one_for_all: the survivor's child too";
    EXPECT_TRUE(j->exits.empty());

    // Grown by a member on worker 4: a second restart, past the intensity of 1.
    auto more = region_supervisor::member_specs(nodes, 2, 1);
    EXPECT_TRUE(actors::supervisor::grow(t.head, sup, std::move(more), true).ok());
    co_await t.head.sleep_for(100ms);
    EXPECT_FALSE(t.head.alive(sup));
    if (j->exits.size() != 1) {
      ADD_FAILURE() << j->exits.size() << " exits";
      co_return;
    }
    EXPECT_NE(j->exits[0].find("restart intensity exceeded"), std::string::npos) << j->exits[0];
  });
}

TEST(region_supervisor, a_worker_lost_before_its_child_started_is_tried_again) {
  tree t;
  t.d.run_body([&]() -> awaitable<void> {
    for (auto* w : t.workers) {
      auto joined = co_await w->join(1s);
      if (!joined.ok()) ADD_FAILURE() << joined.err().message;
    }
    t.d.hub().crash(2);
    co_await t.head.sleep_for(100ms);
    // The first answer names the dead worker 2 (the job had not heard yet); the next, 3.
    auto job = t.head.spawn<fake_job>(std::vector<std::vector<node_id>>{{1, 2}, {1, 3}});
    auto sup = t.head
                   .spawn<region_supervisor>(
                       7, job.ref, std::make_shared<region_supervisor::member_nodes>(), 2, 3)
                   .ref;
    co_await t.head.sleep_for(15s);  // the spawn on worker 2 fails (at most its timeout)
    auto* j = t.head.local_actor<fake_job>(job.ref);
    EXPECT_EQ(j->restarts, 2);
    auto kids = co_await t.children(sup);
    if (kids.size() != 2) {
      ADD_FAILURE() << kids.size() << " children";
      co_return;
    }
    EXPECT_EQ(kids[1].second.node, 3u);
    EXPECT_TRUE(t.head.alive(sup));
  });
}

}  // namespace
}  // namespace moevement::recovery
