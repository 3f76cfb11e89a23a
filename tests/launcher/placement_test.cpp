// Placement properties on many shapes: every worker placed once, replicas of a stage spread
// over nodes, snapshot holders off the worker's node (and off its stage's nodes when there
// are such nodes), and no single node loss that takes every copy of any worker's state.
#include "launcher/placement.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>

namespace moevement::launcher {
namespace {

struct shape {
  std::vector<int> tasks_per_node;
  int pp, dp, spares, r;
};

std::string name_of(const shape& s) {
  std::string tpn;
  for (int n : s.tasks_per_node) tpn += std::to_string(n) + " ";
  return "tasks_per_node [" + tpn + "] pp=" + std::to_string(s.pp) + " dp=" + std::to_string(s.dp) +
         " spares=" + std::to_string(s.spares) + " r=" + std::to_string(s.r);
}

// check_load: nobody holds more than 2r copies. Holder load is the last preference, so
// shapes where few nodes run no replica of a stage can concentrate copies; the sweep below
// does not check it.
void check_properties(const shape& s, bool check_load = true) {
  SCOPED_TRACE(name_of(s));
  const placement p = place_workers({s.tasks_per_node, s.pp, s.dp, s.spares, s.r});
  const int nodes = static_cast<int>(s.tasks_per_node.size());
  int total = 0;
  for (int n : s.tasks_per_node) total += n;

  // Every task is exactly one worker or one spare; node_of_task follows block distribution.
  ASSERT_EQ(static_cast<int>(p.node_of_task.size()), total);
  ASSERT_EQ(static_cast<int>(p.workers.size()), s.pp * s.dp);
  EXPECT_GE(static_cast<int>(p.spare_tasks.size()), s.spares);
  std::set<int> seen;
  for (const auto& w : p.workers) EXPECT_TRUE(seen.insert(w.task).second) << "task twice";
  for (int t : p.spare_tasks) EXPECT_TRUE(seen.insert(t).second) << "spare task twice";
  EXPECT_EQ(static_cast<int>(seen.size()), total);
  for (int t = 1; t < total; ++t) EXPECT_LE(p.node_of_task[t - 1], p.node_of_task[t]);

  for (int st = 0; st < s.pp; ++st) {
    std::map<int, int> per_node;
    for (int k = 0; k < s.dp; ++k) {
      const auto& w = p.worker(st, k);
      EXPECT_EQ(w.stage, st);
      EXPECT_EQ(w.replica, k);
      EXPECT_EQ(w.node, p.node_of_task[w.task]);
      EXPECT_EQ(p.worker_on_task(w.task), &w);
      ++per_node[w.node];
    }
    // Replicas spread: no node has more than ceil(dp / nodes) of a stage's replicas.
    const int cap = (s.dp + nodes - 1) / nodes;
    for (const auto& [node, count] : per_node) {
      EXPECT_LE(count, cap) << "stage " << st << " has " << count << " replicas on node " << node;
    }
  }

  std::map<int, int> held;
  for (const auto& w : p.workers) {
    std::set<int> stage_nodes;
    for (int k = 0; k < s.dp; ++k) stage_nodes.insert(p.worker(w.stage, k).node);
    // Workers on nodes that run no replica of this stage: the preferred holders.
    int off_stage_workers = 0;
    for (const auto& x : p.workers) off_stage_workers += stage_nodes.count(x.node) ? 0 : 1;
    ASSERT_EQ(static_cast<int>(w.holders.size()), s.r);
    std::set<int> holder_tasks;
    int off_stage_holders = 0, off_node_holders = 0, off_node_workers = 0;
    for (const auto& x : p.workers) off_node_workers += x.node != w.node ? 1 : 0;
    for (int h : w.holders) {
      EXPECT_TRUE(holder_tasks.insert(h).second) << "holder twice";
      EXPECT_NE(h, w.task);
      ASSERT_NE(p.worker_on_task(h), nullptr) << "holder task " << h << " is a spare";
      const int hn = p.node_of_task[h];
      ++held[h];
      off_node_holders += hn != w.node ? 1 : 0;
      off_stage_holders += stage_nodes.count(hn) ? 0 : 1;
    }
    EXPECT_GE(off_node_holders, std::min(s.r, off_node_workers))
        << "a copy on the worker's own node while other nodes could hold it";
    EXPECT_GE(off_stage_holders, std::min(s.r, off_stage_workers))
        << "stage " << w.stage << " replica " << w.replica
        << ": copies on nodes that run the stage while other nodes could hold them";
    // The property the whole thing is for: no single node holds every copy.
    if (nodes >= 2 && s.r >= 1) {
      for (int lost = 0; lost < nodes; ++lost) {
        bool survives = w.node != lost;
        for (int h : w.holders) survives = survives || p.node_of_task[h] != lost;
        EXPECT_TRUE(survives) << "losing node " << lost << " loses every copy of stage " << w.stage
                              << " replica " << w.replica;
      }
    }
  }
  // Load stays balanced: nobody holds more than 2r copies.
  for (const auto& [task, count] : held) {
    if (check_load) {
      EXPECT_LE(count, 2 * s.r) << "task " << task;
    }
  }

  // Deterministic.
  const placement again = place_workers({s.tasks_per_node, s.pp, s.dp, s.spares, s.r});
  EXPECT_EQ(again.describe(), p.describe());
}

TEST(placement, properties_hold_on_many_shapes) {
  const std::vector<shape> shapes = {
      {{4}, 2, 2, 0, 2},                 // one node: nothing to spread, still valid
      {{2, 2}, 2, 2, 0, 2},              // pp=2 dp=2 on two nodes
      {{3, 3}, 2, 2, 2, 2},              // with a spare per node
      {{2, 2, 2}, 2, 2, 2, 2},           // a spare node
      {{4, 4, 4, 4}, 2, 4, 8, 2},        // dp = nodes
      {{8, 8}, 4, 2, 0, 2},              // dp = nodes, deep pipeline
      {{1, 1, 1, 1, 1, 1}, 2, 2, 2, 2},  // one task per node
      {{2, 2, 2, 2}, 3, 2, 2, 3},        // r = 3
      {{2, 1, 3, 2}, 2, 3, 2, 2},        // uneven tasks per node
      {{5, 5, 5}, 3, 4, 3, 2},           // dp > nodes
      {{4, 4}, 1, 8, 0, 1},              // one stage, r = 1
      {{16}, 4, 4, 0, 2},                // sixteen workers on one node
      {{2, 2, 2}, 3, 2, 0, 2},           // full nodes: pipelines must not stay on one node
      {{3, 3, 3, 3}, 4, 3, 0, 2},        // full nodes, dp = 3
      {{4, 4, 4}, 4, 3, 0, 2},           // full nodes, pp = tasks per node
  };
  for (const auto& s : shapes) check_properties(s);
}

TEST(placement, pp2_dp2_on_two_nodes_is_what_we_expect) {
  const auto p = place_workers({{2, 2}, 2, 2, 0, 2});
  // Replica 0's pipeline on node 0, replica 1's on node 1.
  EXPECT_EQ(p.worker(0, 0).node, 0);
  EXPECT_EQ(p.worker(1, 0).node, 0);
  EXPECT_EQ(p.worker(0, 1).node, 1);
  EXPECT_EQ(p.worker(1, 1).node, 1);
  for (const auto& w : p.workers) {
    for (int h : w.holders) EXPECT_NE(p.node_of_task[h], w.node);
  }
}

TEST(placement, stage_copies_go_to_nodes_without_the_stage) {
  // Three nodes, pp=3 dp=2: every stage runs on two nodes; its copies go to the third.
  const auto p = place_workers({{2, 2, 2}, 3, 2, 0, 2});
  for (const auto& w : p.workers) {
    const int a = p.worker(w.stage, 0).node, b = p.worker(w.stage, 1).node;
    ASSERT_NE(a, b);
    for (int h : w.holders) {
      EXPECT_NE(p.node_of_task[h], a);
      EXPECT_NE(p.node_of_task[h], b);
    }
  }
}

TEST(placement, extra_tasks_become_spares) {
  const auto p = place_workers({{3, 3}, 1, 2, 1, 1});
  EXPECT_EQ(p.spare_tasks.size(), 4u);
}

TEST(placement, errors_say_what_to_change) {
  auto message = [](const placement_request& r) -> std::string {
    try {
      place_workers(r);
    } catch (const placement_error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(message({{2, 2}, 2, 2, 1, 2}).find("too few Slurm tasks"), std::string::npos);
  EXPECT_NE(message({{2, 2}, 2, 2, 1, 2}).find("need 5 tasks, the step has 4"), std::string::npos);
  EXPECT_NE(message({{2}, 1, 2, 0, 2}).find("replication=2 needs at least 3 workers"),
            std::string::npos);
  EXPECT_NE(message({{}, 1, 1, 0, 0}).find("no Slurm nodes"), std::string::npos);
  EXPECT_NE(message({{4}, 0, 1, 0, 0}).find("must be at least 1"), std::string::npos);
  EXPECT_NE(message({{4}, 1, 1, -1, 0}).find("must not be negative"), std::string::npos);
  EXPECT_NE(message({{4, -1}, 1, 1, 0, 0}).find("negative task count"), std::string::npos);
  EXPECT_THROW((void)place_workers({{4}, 2, 2, 0, 2}).worker(2, 0), placement_error);
}

}  // namespace
}  // namespace moevement::launcher

namespace moevement::launcher {
namespace {

// Every feasible uniform shape up to 6 nodes x 4 tasks, pp and dp up to 4.
TEST(placement, properties_hold_on_every_small_uniform_shape) {
  int checked = 0;
  for (int nodes = 1; nodes <= 6; ++nodes) {
    for (int tpn = 1; tpn <= 4; ++tpn) {
      for (int pp = 1; pp <= 4; ++pp) {
        for (int dp = 1; dp <= 4; ++dp) {
          for (int spares = 0; spares <= 2; ++spares) {
            for (int r = 1; r <= 2; ++r) {
              if (nodes * tpn < pp * dp + spares || r > pp * dp - 1) continue;
              check_properties(
                  {std::vector<int>(static_cast<std::size_t>(nodes), tpn), pp, dp, spares, r},
                  /*check_load=*/false);
              ++checked;
              if (::testing::Test::HasFailure()) return;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 500);
}

}  // namespace
}  // namespace moevement::launcher
