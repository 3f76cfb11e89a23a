// Supervisors: strategies, restart types, intensity and escalation, ordered shutdown, grow,
// children started with their ref at once (start_local) and the hook for children that end.
#include "actors/supervisor.hpp"

#include "tests/actors/harness.hpp"

namespace moevement::actors::testing {
namespace {

using children_t = std::vector<std::pair<std::string, actor_ref>>;

awaitable<children_t> children_of(actor_system& sys, actor_ref sup) {
  auto r = co_await supervisor::which_children(sys, sup, 1s);
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.err().message);
  co_return r.ok() ? *r : children_t{};
}

std::vector<child_spec> three(restart_type restart = restart_type::permanent) {
  return {child_spec::local<echo>("a", restart), child_spec::local<echo>("b", restart),
          child_spec::local<echo>("c", restart)};
}

void crash(actor_system& sys, actor_ref who) {
  EXPECT_TRUE(
      sys.tell<msg::Crash>(who, [](msg::Crash::Builder b) { b.setWhy("test crash"); }).ok());
}

TEST(supervisor, one_for_one_restarts_only_the_failed_child) {
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    auto sup = sys.spawn<supervisor>(strategy::one_for_one, restart_intensity{5, 5s}, three());
    auto before = co_await children_of(sys, sup);
    CO_ASSERT(before.size() == 3);
    crash(sys, before[1].second);
    co_await sleep_for(5ms);
    auto after = co_await children_of(sys, sup);
    EXPECT_EQ(after[0].second, before[0].second);
    EXPECT_NE(after[1].second, before[1].second);
    EXPECT_EQ(after[2].second, before[2].second);
    EXPECT_TRUE(sys.alive(after[1].second));
  });
}

TEST(supervisor, one_for_all_restarts_every_child) {
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    auto sup = sys.spawn<supervisor>(strategy::one_for_all, restart_intensity{5, 5s}, three());
    auto before = co_await children_of(sys, sup);
    crash(sys, before[1].second);
    co_await sleep_for(5ms);
    auto after = co_await children_of(sys, sup);
    for (int i = 0; i < 3; ++i) {
      EXPECT_NE(after[i].second, before[i].second) << i;
      EXPECT_TRUE(sys.alive(after[i].second));
      EXPECT_FALSE(sys.alive(before[i].second));
    }
    // Restarted in start order: actor ids increase a < b < c.
    EXPECT_LT(after[0].second.actor, after[1].second.actor);
    EXPECT_LT(after[1].second.actor, after[2].second.actor);
  });
}

TEST(supervisor, rest_for_one_restarts_the_failed_child_and_those_after_it) {
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    auto sup = sys.spawn<supervisor>(strategy::rest_for_one, restart_intensity{5, 5s}, three());
    auto before = co_await children_of(sys, sup);
    crash(sys, before[1].second);
    co_await sleep_for(5ms);
    auto after = co_await children_of(sys, sup);
    EXPECT_EQ(after[0].second, before[0].second);
    EXPECT_NE(after[1].second, before[1].second);
    EXPECT_NE(after[2].second, before[2].second);
    EXPECT_TRUE(sys.alive(after[2].second));
  });
}

TEST(supervisor, transient_and_temporary_children) {
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    std::vector<child_spec> specs{child_spec::local<echo>("t", restart_type::transient),
                                  child_spec::local<echo>("tmp", restart_type::temporary)};
    auto sup = sys.spawn<supervisor>(strategy::one_for_one, restart_intensity{5, 5s}, specs);
    auto before = co_await children_of(sys, sup);
    CO_ASSERT(before.size() == 2);
    sys.stop(before[0].second, exit_reason::normal());  // transient, normal: not restarted
    co_await sleep_for(3ms);
    auto mid = co_await children_of(sys, sup);
    EXPECT_FALSE(mid[0].second.valid());
    crash(sys, before[1].second);  // temporary: never restarted, removed
    co_await sleep_for(3ms);
    auto after = co_await children_of(sys, sup);
    EXPECT_EQ(after.size(), 1u);
  });
}

TEST(supervisor, a_transient_child_that_fails_is_restarted) {
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    auto sup =
        sys.spawn<supervisor>(strategy::one_for_one, restart_intensity{5, 5s},
                              std::vector{child_spec::local<echo>("t", restart_type::transient)});
    auto before = co_await children_of(sys, sup);
    crash(sys, before[0].second);
    co_await sleep_for(3ms);
    auto after = co_await children_of(sys, sup);
    EXPECT_TRUE(after[0].second.valid());
    EXPECT_NE(after[0].second, before[0].second);
  });
}

TEST(supervisor, intensity_exceeded_escalates_to_the_parent) {
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    // Parent (one_for_one, generous) over a child supervisor allowing 2 restarts in 5 s.
    child_spec inner;
    inner.id = "inner";
    inner.start = [](actor_system& s) -> awaitable<result<actor_ref>> {
      return [](actor_system& s2) -> awaitable<result<actor_ref>> {
        co_return s2
            .spawn<supervisor>(
                strategy::one_for_one, restart_intensity{2, 5s},
                std::vector{child_spec::local<echo>("leaf", restart_type::permanent)})
            .ref;
      }(s);
    };
    auto w = sys.spawn<watcher>();
    auto top =
        sys.spawn<supervisor>(strategy::one_for_one, restart_intensity{5, 5s}, std::vector{inner});
    auto tops = co_await children_of(sys, top);
    const actor_ref inner1 = tops[0].second;
    sys.monitor(w, inner1);
    for (int i = 0; i < 3; ++i) {  // the third crash within the period is one too many
      auto leaves = co_await children_of(sys, inner1);
      CO_ASSERT(leaves.size() == 1 && leaves[0].second.valid());
      crash(sys, leaves[0].second);
      co_await sleep_for(3ms);
    }
    EXPECT_FALSE(sys.alive(inner1));
    auto* wa = sys.local_actor<watcher>(w);
    CO_ASSERT(wa->events.size() == 1);
    EXPECT_EQ(wa->events[0].why.kind, exit_kind::error);
    EXPECT_NE(wa->events[0].why.detail.find("intensity"), std::string::npos)
        << wa->events[0].why.detail;
    // The parent restarted the child supervisor, which started a fresh leaf.
    auto tops2 = co_await children_of(sys, top);
    EXPECT_NE(tops2[0].second, inner1);
    EXPECT_TRUE(sys.alive(tops2[0].second));
    auto leaves = co_await children_of(sys, tops2[0].second);
    CO_ASSERT(leaves.size() == 1);
    EXPECT_TRUE(sys.alive(leaves[0].second));
  });
}

// A supervisor whose children's failed starts are failed attempts (retry_failed_starts), as
// the recovery's region supervisors are.
class retrying_supervisor : public supervisor {
 public:
  retrying_supervisor(strategy how, restart_intensity intensity, std::vector<child_spec> children)
      : supervisor(how, intensity, std::move(children)) {
    retry_failed_starts(true);
  }
};

awaitable<result<actor_ref>> started(result<actor_ref> r) {
  co_return r;
}

// A child whose starts fail while *failures is above 0 (each failed start counts one down).
child_spec flaky_child(std::shared_ptr<int> failures) {
  child_spec s;
  s.id = "flaky";
  s.start = [failures](actor_system& sys) -> awaitable<result<actor_ref>> {
    if (*failures > 0) {
      --*failures;
      return started(error{"not yet"});
    }
    return started(sys.spawn<echo>().ref);
  };
  return s;
}

// one_for_one: a restart that fails is tried again where the subclass asks for it (within
// the intensity), and gives the supervisor up at once where it does not.
TEST(supervisor, a_failed_one_for_one_restart_is_retried_only_where_asked) {
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    auto failures = std::make_shared<int>(0);
    auto w = sys.spawn<watcher>();
    auto retrying = sys.spawn<retrying_supervisor>(strategy::one_for_one, restart_intensity{5, 5s},
                                                   std::vector{flaky_child(failures)});
    sys.monitor(w, retrying);
    auto before = co_await children_of(sys, retrying);
    CO_ASSERT(before.size() == 1);
    *failures = 2;  // the next two starts fail
    crash(sys, before[0].second);
    co_await sleep_for(5ms);
    EXPECT_TRUE(sys.alive(retrying));
    auto after = co_await children_of(sys, retrying);
    CO_ASSERT(after.size() == 1);
    EXPECT_NE(after[0].second, before[0].second);
    EXPECT_TRUE(sys.alive(after[0].second)) << "the third start";
    EXPECT_EQ(*failures, 0);

    auto plain = sys.spawn<supervisor>(strategy::one_for_one, restart_intensity{5, 5s},
                                       std::vector{flaky_child(failures)});
    sys.monitor(w, plain);
    auto child = co_await children_of(sys, plain);
    CO_ASSERT(child.size() == 1);
    *failures = 1;
    crash(sys, child[0].second);
    co_await sleep_for(5ms);
    EXPECT_FALSE(sys.alive(plain));
    auto* wa = sys.local_actor<watcher>(w);
    CO_ASSERT(wa->events.size() == 1);
    EXPECT_EQ(wa->events[0].who, plain);
    EXPECT_NE(wa->events[0].why.detail.find("failed to restart: not yet"), std::string::npos)
        << wa->events[0].why.detail;
  });
}

// Records the order in which actors stopped.
class stop_recorder : public actor {
 public:
  using interface = actors::interface<>;
  stop_recorder(std::vector<std::string>* order, std::string name)
      : order_(order), name_(std::move(name)) {}

 protected:
  void on_stop(const exit_reason&) override { order_->push_back(name_); }

 private:
  std::vector<std::string>* order_;
  std::string name_;
};

TEST(supervisor, ordered_shutdown_stops_children_in_reverse_start_order) {
  cluster c;
  auto& sys = c.add(1);
  std::vector<std::string> order;
  c.run([&]() -> awaitable<void> {
    std::vector<child_spec> specs;
    for (const char* n : {"first", "second", "third"}) {
      specs.push_back(
          child_spec::local<stop_recorder>(n, restart_type::permanent, &order, std::string(n)));
    }
    auto sup = sys.spawn<supervisor>(strategy::one_for_one, restart_intensity{}, specs);
    auto kids = co_await children_of(sys, sup);
    CO_ASSERT(kids.size() == 3);
    sys.stop(sup);
    EXPECT_EQ(order, (std::vector<std::string>{"third", "second", "first"}));
    for (auto& k : kids) EXPECT_FALSE(sys.alive(k.second));
  });
}

TEST(supervisor, grow_adds_children_and_restarts_the_whole_set_together) {
  cluster c;
  auto& n1 = c.add(1);
  auto& n2 = c.add(2);
  n2.register_type<echo>("echo");
  c.run([&]() -> awaitable<void> {
    auto sup =
        n1.spawn<supervisor>(strategy::one_for_all, restart_intensity{},
                             std::vector{child_spec::local<echo>("a", restart_type::permanent)});
    auto before = co_await children_of(n1, sup);
    CO_ASSERT(before.size() == 1);
    // Local form: C++ specs; the remote child is spawned on node 2 by type name.
    EXPECT_TRUE(
        supervisor::grow(n1, sup, {child_spec::named("b", 2, "echo", restart_type::permanent)})
            .ok());
    auto after = co_await children_of(n1, sup);
    CO_ASSERT(after.size() == 2);
    EXPECT_NE(after[0].second, before[0].second);  // restarted together
    EXPECT_FALSE(n1.alive(before[0].second));
    EXPECT_EQ(after[1].second.node, 2u);
    EXPECT_TRUE(n2.alive(after[1].second));
    // Message form (as recovery sends it, possibly from another node).
    auto r = co_await n2.ask<proto::GrowChildren, proto::Ack>(
        sup, 2s, [](proto::GrowChildren::Builder b) {
          auto l = b.initChildren(1);
          l[0].setId("c");
          l[0].setNode(2);
          l[0].setTypeName("echo");
          l[0].setRestart(static_cast<std::uint8_t>(restart_type::transient));
        });
    CO_ASSERT(r.ok());
    auto grown = co_await children_of(n1, sup);
    CO_ASSERT(grown.size() == 3);
    for (auto& g : grown) EXPECT_NE(g.second, after[0].second);
    EXPECT_FALSE(n2.alive(after[1].second));  // the remote child was restarted too
    EXPECT_TRUE(n2.alive(grown[2].second));
    // A crash of the remote child is seen through the link and restarts it.
    crash(n2, grown[1].second);
    co_await sleep_for(5ms);
    auto again = co_await children_of(n1, sup);
    EXPECT_NE(again[1].second, grown[1].second);
    EXPECT_TRUE(n2.alive(again[1].second));
  });
}

TEST(supervisor, one_for_one_growth_starts_only_the_new_children) {
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    auto sup = sys.spawn<supervisor>(strategy::one_for_one, restart_intensity{}, three());
    auto before = co_await children_of(sys, sup);
    EXPECT_TRUE(
        supervisor::grow(sys, sup, {child_spec::local<echo>("d", restart_type::permanent)}, true)
            .ok());
    auto after = co_await children_of(sys, sup);
    CO_ASSERT(after.size() == 4);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(after[i].second, before[i].second) << i;
    EXPECT_TRUE(sys.alive(after[3].second));
  });
}

// Records the children that end without a restart, as a subclass's strategy sees them.
class recording_supervisor : public supervisor {
 public:
  recording_supervisor() : supervisor(strategy::one_for_one, restart_intensity{}, {}) {}
  std::vector<std::pair<std::string, exit_reason>> ended;

 protected:
  awaitable<void> child_ended(const std::string& id, actor_ref, const exit_reason& why) override {
    ended.emplace_back(id, why);
    co_return;
  }
};

TEST(supervisor, a_child_started_with_its_ref_is_supervised_and_its_end_reaches_the_hook) {
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    auto sup = sys.spawn<recording_supervisor>();
    auto* s = sys.local_actor<recording_supervisor>(sup);
    auto a = supervisor::start_local<echo>(sys, sup, "a", restart_type::temporary);
    auto b = supervisor::start_local<echo>(sys, sup, "b", restart_type::temporary);
    CO_ASSERT(a.ok() && b.ok());
    EXPECT_TRUE(sys.alive(*a));
    // A crash before the supervisor's next turn is still seen (linked at once).
    crash(sys, *a);
    co_await sleep_for(5ms);
    auto kids = co_await children_of(sys, sup);
    CO_ASSERT(kids.size() == 1);  // temporary: gone, not restarted
    EXPECT_EQ(kids[0].first, "b");
    EXPECT_EQ(kids[0].second, *b);
    CO_ASSERT(s->ended.size() == 1);
    EXPECT_EQ(s->ended[0].first, "a");
    EXPECT_TRUE(s->ended[0].second.abnormal());
    // A child stopped on purpose ends with shutdown: not abnormal.
    sys.stop(*b);
    co_await sleep_for(5ms);
    CO_ASSERT(s->ended.size() == 2);
    EXPECT_EQ(s->ended[1].first, "b");
    EXPECT_FALSE(s->ended[1].second.abnormal());
    // The supervisor stopping takes its adopted children down.
    auto d = supervisor::start_local<echo>(sys, sup, "d", restart_type::temporary);
    CO_ASSERT(d.ok());
    sys.stop(sup);
    co_await sleep_for(5ms);
    EXPECT_FALSE(sys.alive(*d));
    EXPECT_FALSE(supervisor::start_local<echo>(sys, sup, "e", restart_type::temporary).ok());
  });
}

}  // namespace
}  // namespace moevement::actors::testing
