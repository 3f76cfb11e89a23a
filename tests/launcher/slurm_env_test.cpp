// The Slurm node-list grammar and the task environment parser, on good and hostile input.
#include "launcher/slurm_env.hpp"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

namespace moevement::launcher {
namespace {

using names = std::vector<std::string>;

// The message of the slurm_env_error `fn` throws, or "" when it throws none.
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const slurm_env_error& e) {
    return e.what();
  }
  return "";
}

TEST(node_list, single_names_and_lists) {
  EXPECT_EQ(expand_node_list("n1"), names{"n1"});
  EXPECT_EQ(expand_node_list("n1,m7,gpu-a.b_c"), (names{"n1", "m7", "gpu-a.b_c"}));
}

TEST(node_list, ranges_and_lists_inside_brackets) {
  EXPECT_EQ(expand_node_list("n[1-3,5],m7"), (names{"n1", "n2", "n3", "n5", "m7"}));
  EXPECT_EQ(expand_node_list("n[7]"), names{"n7"});
  EXPECT_EQ(expand_node_list("n[9-11]"), (names{"n9", "n10", "n11"}));
  EXPECT_EQ(expand_node_list("a[1-2],b[3-4]"), (names{"a1", "a2", "b3", "b4"}));
}

TEST(node_list, zero_padded_ranges_keep_their_width) {
  const auto v = expand_node_list("n[01-10]");
  ASSERT_EQ(v.size(), 10u);
  EXPECT_EQ(v.front(), "n01");
  EXPECT_EQ(v[8], "n09");
  EXPECT_EQ(v.back(), "n10");
  EXPECT_EQ(expand_node_list("n[001-003,010]"), (names{"n001", "n002", "n003", "n010"}));
  // Without a leading zero there is no padding.
  EXPECT_EQ(expand_node_list("n[8-10]"), (names{"n8", "n9", "n10"}));
}

TEST(node_list, suffixes_and_several_bracket_groups) {
  EXPECT_EQ(expand_node_list("n[1-2]-ib"), (names{"n1-ib", "n2-ib"}));
  EXPECT_EQ(expand_node_list("r[1-2]n[1-2]"), (names{"r1n1", "r1n2", "r2n1", "r2n2"}));
}

TEST(node_list, malformed_input_is_rejected_with_the_reason) {
  const std::map<std::string, std::string> cases = {
      {"", "empty"},
      {"n1,,n2", "empty name"},
      {"n1,", "empty name"},
      {",n1", "empty name"},
      {"n[1-3", "'[' without ']'"},
      {"n1-3]", "']' without '['"},
      {"n[]", "empty brackets"},
      {"n[1,]", "empty range"},
      {"n[3-1]", "decreasing"},
      {"n[a-b]", "not a number"},
      {"n[1-]", "not a number"},
      {"n[-1]", "not a number"},
      {"n[1-2-3]", "not a number"},
      {"n[[1]]", "nested"},
      {"n 1", "not allowed"},
      {"n;rm", "not allowed"},
      {"n\n1", "not allowed"},
      {"n[01-100]", "mixes widths"},
      {"n[0-999999999]", "more than"},
      {"n[1-300]x[1-300]", "more than"},
      {"n[1234567890]", "too long"},
      {"n1,n[1-2]", "appears twice"},
      {std::string(300, 'a'), "longer than"},
  };
  for (const auto& [input, reason] : cases) {
    const auto message = error_of([&] { expand_node_list(input); });
    EXPECT_NE(message.find(reason), std::string::npos)
        << "input '" << input << "' gave '" << message << "', wanted '" << reason << "'";
  }
}

TEST(tasks_per_node, counts_and_repeats) {
  EXPECT_EQ(expand_tasks_per_node("4"), std::vector<int>{4});
  EXPECT_EQ(expand_tasks_per_node("2(x3),1"), (std::vector<int>{2, 2, 2, 1}));
  for (const char* bad : {"", "0", "2(x0)", "2(3)", "2(x3", "x", "2,,1", "-1", "2(x99999999)"}) {
    EXPECT_FALSE(error_of([&] { expand_tasks_per_node(bad); }).empty()) << bad;
  }
}

struct fake_env {
  std::map<std::string, std::string> vars = {
      {"SLURM_PROCID", "2"},
      {"SLURM_NTASKS", "4"},
      {"SLURM_NODELIST", "n[1-3]"},
      {"SLURMD_NODENAME", "n2"},
      {"SLURM_TASKS_PER_NODE", "2,1(x2)"},
      {"SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"},
      {"SLURM_JOB_ID", "42"},
      {"SLURM_STEP_ID", "0"},
  };
  slurm_env parse() const {
    return parse_slurm_env([this](const char* name) -> const char* {
      const auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    });
  }
  std::string error() const {
    return error_of([this] { parse(); });
  }
};

TEST(slurm_env, parses_a_step_environment) {
  const auto env = fake_env{}.parse();
  EXPECT_EQ(env.proc_id, 2);
  EXPECT_EQ(env.ntasks, 4);
  EXPECT_EQ(env.nodes, (names{"n1", "n2", "n3"}));
  EXPECT_EQ(env.node_name, "n2");
  EXPECT_EQ(env.node_index(), 1);
  EXPECT_EQ(env.tasks_per_node, (std::vector<int>{2, 1, 1}));
  EXPECT_EQ(env.launch_node_ipaddr, "127.0.0.1");
  EXPECT_EQ(env.job_id, 42u);
  ASSERT_TRUE(env.step_id.has_value());
  EXPECT_EQ(*env.step_id, 0u);
  EXPECT_EQ(
      env.to_json(),
      R"({"proc_id":2,"ntasks":4,"node_name":"n2","node_index":1,"nodes":["n1","n2","n3"],)"
      R"("tasks_per_node":[2,1,1],"launch_node_ipaddr":"127.0.0.1","job_id":42,"step_id":0})");
}

TEST(slurm_env, step_variables_win_over_job_variables) {
  fake_env f;
  f.vars["SLURM_STEP_NODELIST"] = "n3";
  f.vars["SLURMD_NODENAME"] = "n3";
  f.vars["SLURM_STEP_TASKS_PER_NODE"] = "4";
  f.vars.erase("SLURM_STEP_ID");
  f.vars["SLURM_LAUNCH_NODE_IPADDR"] = "::1";
  const auto env = f.parse();
  EXPECT_EQ(env.nodes, names{"n3"});
  EXPECT_EQ(env.tasks_per_node, std::vector<int>{4});
  EXPECT_FALSE(env.step_id.has_value());
  EXPECT_EQ(env.launch_node_ipaddr, "::1");
}

TEST(slurm_env, bad_values_name_the_variable) {
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {"SLURM_PROCID", "", "SLURM_PROCID=''"},
      {"SLURM_PROCID", "-1", "SLURM_PROCID='-1'"},
      {"SLURM_PROCID", "1x", "SLURM_PROCID='1x'"},
      {"SLURM_PROCID", "+1", "SLURM_PROCID='+1'"},
      {"SLURM_PROCID", "4", "SLURM_PROCID=4 is not below SLURM_NTASKS=4"},
      {"SLURM_PROCID", "99999999999999999999999", "SLURM_PROCID="},
      {"SLURM_NTASKS", "0", "SLURM_NTASKS=0"},
      {"SLURM_NTASKS", "4294967296", "SLURM_NTASKS='4294967296'"},
      {"SLURM_NODELIST", "n[1-3", "SLURM_NODELIST='n[1-3': '[' without ']'"},
      {"SLURMD_NODENAME", "n9", "SLURMD_NODENAME='n9' is not in SLURM_NODELIST"},
      {"SLURM_TASKS_PER_NODE", "2", "names 1 nodes but SLURM_NODELIST has 3"},
      {"SLURM_TASKS_PER_NODE", "2(x", "SLURM_TASKS_PER_NODE='2(x'"},
      {"SLURM_LAUNCH_NODE_IPADDR", "localhost", "SLURM_LAUNCH_NODE_IPADDR='localhost'"},
      {"SLURM_LAUNCH_NODE_IPADDR", "1.2.3.4; x", "not an IPv4 or IPv6"},
      {"SLURM_JOB_ID", "abc", "SLURM_JOB_ID='abc'"},
      {"SLURM_STEP_ID", "1e3", "SLURM_STEP_ID='1e3'"},
  };
  for (const auto& [name, value, expected] : cases) {
    fake_env f;
    f.vars[name] = value;
    const auto message = f.error();
    EXPECT_NE(message.find(expected), std::string::npos)
        << name << "='" << value << "' gave '" << message << "'";
  }
}

TEST(slurm_env, missing_variables_say_to_run_under_srun) {
  for (const char* name : {"SLURM_PROCID", "SLURM_NODELIST", "SLURMD_NODENAME", "SLURM_JOB_ID"}) {
    fake_env f;
    f.vars.erase(name);
    const auto message = f.error();
    EXPECT_NE(message.find("is not set"), std::string::npos) << name << ": " << message;
    EXPECT_NE(message.find("srun"), std::string::npos) << message;
  }
  fake_env f;
  f.vars.erase("SLURM_NTASKS");
  EXPECT_NE(f.error().find("SLURM_STEP_NUM_TASKS is not set"), std::string::npos) << f.error();
  f.vars["SLURM_STEP_NUM_TASKS"] = "4";
  EXPECT_EQ(f.parse().ntasks, 4);
}

TEST(slurm_env, json_escapes_what_it_prints) {
  slurm_env env;
  env.ntasks = 1;
  env.node_name = "a\"b\\c\n";
  EXPECT_NE(env.to_json().find(R"("node_name":"a\"b\\c\u000a")"), std::string::npos)
      << env.to_json();
}

}  // namespace
}  // namespace moevement::launcher
