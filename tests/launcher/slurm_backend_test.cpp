// The Slurm backend's pure parts, without a Slurm: the srun command line (no -K1, no token),
// each task's role and node id from its environment, and the errors when the step does not
// match the job. The real srun runs in slurm_launch_test.cpp.
#include "launcher/slurm_backend.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>

namespace moevement::launcher {
namespace {

engine::job_config slurm_job(int pp, int dp, int spares) {
  engine::job_config j;
  j.backend = "slurm";
  j.pp = pp;
  j.dp = dp;
  j.spares = spares;
  return j;
}

bool has(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

TEST(slurm_backend, srun_command_keeps_the_step_alive_and_carries_no_token) {
  auto job = slurm_job(2, 2, 1);
  job.slurm_nodes = 3;
  job.slurm_partition = "debug";
  slurm_task_args a;
  a.head = "10.0.0.1:4000";
  a.pp = 2;
  a.dp = 2;
  a.spares = 1;
  const auto c = srun_command(job, "/opt/moevement", a, "moevement-1-abc", false);
  ASSERT_FALSE(c.empty());
  EXPECT_EQ(c[0], "srun");
  EXPECT_TRUE(has(c, "--ntasks=5"));
  EXPECT_TRUE(has(c, "--nodes=3"));
  EXPECT_TRUE(has(c, "--ntasks-per-node=2")) << "the 5 tasks spread over the 3 nodes";
  EXPECT_TRUE(has(c, "--partition=debug"));
  EXPECT_TRUE(has(c, "--job-name=moevement-1-abc"));
  EXPECT_TRUE(has(c, "--kill-on-bad-exit=0"));
  EXPECT_TRUE(has(c, "--distribution=block"));
  EXPECT_TRUE(has(c, "--immediate=22"))
      << "outside an allocation srun must not queue for ever, and gives up before the head";
  EXPECT_FALSE(has(c, "-K1"));
  EXPECT_FALSE(has(c, "--kill-on-bad-exit=1"));
  EXPECT_FALSE(has(c, "--host")) << "not loopback: each task resolves its own node name";
  for (const auto& arg : c) EXPECT_EQ(arg.find("TOKEN"), std::string::npos) << arg;
  const auto self = std::find(c.begin(), c.end(), "/opt/moevement");
  ASSERT_NE(self, c.end());
  EXPECT_EQ(std::vector<std::string>(self + 1, self + 5),
            (std::vector<std::string>{"worker", "--slurm", "--head", "10.0.0.1:4000"}));

  a.worker_host = "127.0.0.1";
  const auto inside = srun_command(slurm_job(1, 1, 0), "m", a, "n", true);
  EXPECT_FALSE(std::any_of(inside.begin(), inside.end(),
                           [](const std::string& s) { return s.starts_with("--immediate"); }));
  EXPECT_FALSE(std::any_of(inside.begin(), inside.end(),
                           [](const std::string& s) { return s.starts_with("--nodes"); }));
  EXPECT_EQ(inside[inside.size() - 2], "--host");
  EXPECT_EQ(inside.back(), "127.0.0.1");
}

// srun spreads the tasks evenly only where they divide by the nodes (it ignores
// --ntasks-per-node otherwise and fills the first node): the spares fill the last node.
TEST(slurm_backend, spares_are_raised_until_the_tasks_fill_the_nodes) {
  auto job = slurm_job(2, 2, 1);
  EXPECT_EQ(spares_filling_nodes(job), 1) << "no cluster.slurm_nodes: nothing to spread";
  job.slurm_nodes = 3;
  EXPECT_EQ(spares_filling_nodes(job), 2) << "4 workers + 2 spares: 2 on each of 3 nodes";
  job.slurm_nodes = 5;
  EXPECT_EQ(spares_filling_nodes(job), 1) << "5 tasks divide by 5 nodes already";
  job.slurm_nodes = 4;
  EXPECT_EQ(spares_filling_nodes(job), 4) << "8 tasks, 2 on each of 4 nodes";
}

TEST(slurm_backend, output_path_follows_the_run_log) {
  EXPECT_EQ(slurm_output_path("run.jsonl"), "run.slurm.log");
  EXPECT_EQ(slurm_output_path("out/job"), "out/job.slurm.log");
}

// The environment of task `proc` of a step over `nodes` with block distribution.
slurm_env step_env(int proc, const std::vector<int>& tasks_per_node) {
  slurm_env e;
  e.proc_id = proc;
  e.tasks_per_node = tasks_per_node;
  int ntasks = 0, node = -1;
  for (std::size_t n = 0; n < tasks_per_node.size(); ++n) {
    e.nodes.push_back("n" + std::to_string(n + 1));
    if (proc >= ntasks && proc < ntasks + tasks_per_node[n]) node = int(n);
    ntasks += tasks_per_node[n];
  }
  e.ntasks = ntasks;
  e.node_name = node >= 0 ? e.nodes[std::size_t(node)] : "nowhere";
  return e;
}

TEST(slurm_backend, every_task_gets_a_distinct_role_and_replicas_spread_over_nodes) {
  // pp=2, dp=2, 1 spare on 3 nodes, as srun -N 3 -n 5 distributes them (2,2,1) and as an
  // allocation of -N 3 -n 5 does (3,1,1).
  for (const std::vector<int>& tpn : {std::vector<int>{2, 2, 1}, std::vector<int>{3, 1, 1}}) {
    std::set<std::uint32_t> ids;
    std::map<int, std::set<int>> nodes_of_stage;
    int spares = 0;
    for (int t = 0; t < 5; ++t) {
      const slurm_role r = slurm_role_of(step_env(t, tpn), 2, 2, 1);
      EXPECT_EQ(r.task, t);
      EXPECT_TRUE(ids.insert(r.node_id).second) << "node id " << r.node_id << " twice";
      if (r.stage < 0) {
        ++spares;
        EXPECT_EQ(r.node_id, 5u) << "spares follow the pp x dp workers";
      } else {
        // The coordinator's numbering: node n = replica * pp + stage + 1.
        EXPECT_EQ(r.node_id, std::uint32_t(r.replica * 2 + r.stage + 1));
        nodes_of_stage[r.stage].insert(r.node_index);
      }
    }
    EXPECT_EQ(ids, (std::set<std::uint32_t>{1, 2, 3, 4, 5}));
    EXPECT_EQ(spares, 1);
    for (const auto& [stage, nodes] : nodes_of_stage) {
      EXPECT_EQ(nodes.size(), 2u) << "the replicas of stage " << stage << " share a node";
    }
  }
}

TEST(slurm_backend, a_step_that_does_not_match_the_job_is_a_clear_error) {
  try {
    (void)slurm_role_of(step_env(0, {2, 2}), 2, 2, 1);
    FAIL() << "4 tasks for 5 accepted";
  } catch (const slurm_env_error& e) {
    EXPECT_NE(std::string(e.what()).find("the step has 4 tasks (SLURM_NTASKS) but pp=2 x dp=2 "
                                         "workers + 1 spares need exactly 5"),
              std::string::npos)
        << e.what();
  }
  auto no_tpn = step_env(0, {1});
  no_tpn.tasks_per_node.clear();
  EXPECT_THROW((void)slurm_role_of(no_tpn, 1, 1, 0), slurm_env_error);
  // A task that is not where the block distribution puts it (a cyclic step).
  auto cyclic = step_env(1, {2, 2});
  cyclic.node_name = "n2";
  EXPECT_THROW((void)slurm_role_of(cyclic, 2, 2, 0), slurm_env_error);
}

TEST(slurm_backend, one_worker_alone_needs_no_snapshot_holder) {
  const slurm_role r = slurm_role_of(step_env(0, {1}), 1, 1, 0);
  EXPECT_EQ(r.stage, 0);
  EXPECT_EQ(r.replica, 0);
  EXPECT_EQ(r.node_id, 1u);
}

}  // namespace
}  // namespace moevement::launcher
