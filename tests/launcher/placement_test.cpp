// Placement properties on many shapes: every worker placed once, replicas of a stage spread
// over nodes. (Where snapshot copies go is tested with the coordinator's placement:
// tests/engine/snapshot_placement_test.cpp.)
#include "launcher/placement.hpp"

#include "engine/snapshot_placement.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>

namespace moevement::launcher {
namespace {

struct shape {
  std::vector<int> tasks_per_node;
  int pp, dp, spares;
};

std::string name_of(const shape& s) {
  std::string tpn;
  for (int n : s.tasks_per_node) tpn += std::to_string(n) + " ";
  return "tasks_per_node [" + tpn + "] pp=" + std::to_string(s.pp) + " dp=" + std::to_string(s.dp) +
         " spares=" + std::to_string(s.spares);
}

void check_properties(const shape& s) {
  SCOPED_TRACE(name_of(s));
  const placement p = place_workers({s.tasks_per_node, s.pp, s.dp, s.spares});
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

  // Deterministic.
  const placement again = place_workers({s.tasks_per_node, s.pp, s.dp, s.spares});
  EXPECT_EQ(again.describe(), p.describe());
}

TEST(placement, properties_hold_on_many_shapes) {
  const std::vector<shape> shapes = {
      {{4}, 2, 2, 0},                 // one node: nothing to spread, still valid
      {{2, 2}, 2, 2, 0},              // pp=2 dp=2 on two nodes
      {{3, 3}, 2, 2, 2},              // with a spare per node
      {{2, 2, 2}, 2, 2, 2},           // a spare node
      {{4, 4, 4, 4}, 2, 4, 8},        // dp = nodes
      {{8, 8}, 4, 2, 0},              // dp = nodes, deep pipeline
      {{1, 1, 1, 1, 1, 1}, 2, 2, 2},  // one task per node
      {{2, 2, 2, 2}, 3, 2, 2},
      {{2, 1, 3, 2}, 2, 3, 2},  // uneven tasks per node
      {{5, 5, 5}, 3, 4, 3},     // dp > nodes
      {{4, 4}, 1, 8, 0},        // one stage
      {{16}, 4, 4, 0},          // sixteen workers on one node
      {{2, 2, 2}, 3, 2, 0},     // full nodes: pipelines must not stay on one node
      {{3, 3, 3, 3}, 4, 3, 0},  // full nodes, dp = 3
      {{4, 4, 4}, 4, 3, 0},     // full nodes, pp = tasks per node
  };
  for (const auto& s : shapes) check_properties(s);
}

TEST(placement, pp2_dp2_on_two_nodes_is_what_we_expect) {
  const auto p = place_workers({{2, 2}, 2, 2, 0});
  // Replica 0's pipeline on node 0, replica 1's on node 1.
  EXPECT_EQ(p.worker(0, 0).node, 0);
  EXPECT_EQ(p.worker(1, 0).node, 0);
  EXPECT_EQ(p.worker(0, 1).node, 1);
  EXPECT_EQ(p.worker(1, 1).node, 1);
}

TEST(placement, extra_tasks_become_spares) {
  const auto p = place_workers({{3, 3}, 1, 2, 1});
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
  EXPECT_NE(message({{2, 2}, 2, 2, 1}).find("too few Slurm tasks"), std::string::npos);
  EXPECT_NE(message({{2, 2}, 2, 2, 1}).find("need 5 tasks, the step has 4"), std::string::npos);
  EXPECT_NE(message({{}, 1, 1, 0}).find("no Slurm nodes"), std::string::npos);
  EXPECT_NE(message({{4}, 0, 1, 0}).find("must be at least 1"), std::string::npos);
  EXPECT_NE(message({{4}, 1, 1, -1}).find("must not be negative"), std::string::npos);
  EXPECT_NE(message({{4, -1}, 1, 1, 0}).find("negative task count"), std::string::npos);
  EXPECT_THROW((void)place_workers({{4}, 2, 2, 0}).worker(2, 0), placement_error);
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
            if (nodes * tpn < pp * dp + spares) continue;
            check_properties(
                {std::vector<int>(static_cast<std::size_t>(nodes), tpn), pp, dp, spares});
            ++checked;
            if (::testing::Test::HasFailure()) return;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 300);
}

// What production does with a Slurm placement: the coordinator places snapshot copies with
// each task's Slurm node as its failure domain (engine/snapshot_placement). Losing any one
// Slurm node leaves a copy of every worker's state, on every small uniform shape.
TEST(placement, no_slurm_node_takes_every_copy_of_a_worker) {
  int checked = 0;
  for (int nodes = 2; nodes <= 5; ++nodes) {
    for (int tpn = 1; tpn <= 4; ++tpn) {
      for (int pp = 1; pp <= 4; ++pp) {
        for (int dp = 1; dp <= 3; ++dp) {
          for (int spares = 0; spares <= 2; ++spares) {
            if (nodes * tpn < pp * dp + spares) continue;
            const placement p = place_workers(
                {std::vector<int>(static_cast<std::size_t>(nodes), tpn), pp, dp, spares});
            std::vector<engine::placement_candidate> c;
            std::map<transport::node_id, int> slurm_node;
            for (const auto& w : p.workers) {
              const auto id = transport::node_id(w.replica * pp + w.stage + 1);
              c.push_back({id, w.stage, "n" + std::to_string(w.node)});
              slurm_node[id] = w.node;
            }
            for (std::size_t i = 0; i < p.spare_tasks.size(); ++i) {
              const auto id = transport::node_id(pp * dp + 1 + int(i));
              const int n = p.node_of_task[std::size_t(p.spare_tasks[i])];
              c.push_back({id, -1, "n" + std::to_string(n)});
              slurm_node[id] = n;
            }
            const auto copies = engine::place_snapshot_copies(c, pp, 2);
            for (const auto& [owner, holders] : copies) {
              for (int lost = 0; lost < nodes; ++lost) {
                bool survives = slurm_node[owner] != lost;
                for (auto h : holders) survives = survives || slurm_node[h] != lost;
                EXPECT_TRUE(survives) << "losing Slurm node " << lost << " loses every copy of "
                                      << "worker " << owner << "; " << p.describe();
              }
            }
            ++checked;
            if (::testing::Test::HasFailure()) return;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 200);
}

}  // namespace
}  // namespace moevement::launcher
