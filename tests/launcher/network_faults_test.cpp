// `moevement launch` on a network that loses packets, inside a network namespace the test
// creates (`unshare -n`: only its own loopback, nothing else reachable) with nftables dropping
// the first SYN of every third connection. A dropped SYN costs Linux 1 s before it tries
// again. That was a worker declared lost at iteration 0 and a failed or hung job (4 of 4
// launches with 30% of SYNs dropped): UCX's TCP transport connected blocking, stopping the
// process's io thread and its heartbeats for the retry, and a member's silence was counted
// from its join. Now connects are non-blocking (transport/ucx_context.cpp) and a member never
// heard from gets the join grace (actors::system_config::join_grace): every launch ends with
// `moevement train`'s state_hash. Skips, saying why, without root, unshare, ip or nft.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "tests/support/launch_job.hpp"
#include "tests/support/run_moevement.hpp"

namespace {

using namespace moevement::test_support;

std::string skip_reason() {
  if (::geteuid() != 0) return "needs root (a network namespace with nftables rules)";
  if (std::system("command -v unshare && command -v ip && command -v nft") != 0) {
    return "needs unshare, ip and nft (util-linux, iproute2, nftables)";
  }
  if (std::system("unshare -n sh -c 'ip link set lo up && nft add table inet probe'") != 0) {
    return "cannot make a network namespace with nftables rules here";
  }
  return "";
}

run_result shell(const std::string& cmd) {
  std::FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  std::string out;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// `moevement launch ARGS` in a fresh network namespace whose loopback drops the first SYN of
// every `nth` new connection (once: its retry, a second later, gets through; the same pattern
// every run). The output ends with the drop rule's counter.
run_result launch_dropping_syns(int nth, const std::string& args) {
  const std::string dir = ::testing::TempDir() + "netfault_" + std::to_string(::getpid());
  {
    std::ofstream rules(dir + ".nft");
    rules << "table inet fault {\n"
          << "  set dropped { type ipv4_addr . inet_service; flags dynamic; }\n"
          << "  chain in {\n    type filter hook input priority 0;\n"
          << "    tcp flags & (syn | ack) == syn ip saddr . tcp sport @dropped accept\n"
          << "    tcp flags & (syn | ack) == syn numgen inc mod " << nth
          << " < 1 add @dropped { ip saddr . tcp sport } counter drop\n  }\n}\n";
    std::ofstream script(dir + ".sh");
    script << "ip link set lo up || exit 90\nnft -f " << dir << ".nft || exit 91\n"
           << std::getenv("MOEVEMENT_BIN") << " launch " << args << "\nrc=$?\n"
           << "nft list chain inet fault in | grep -o 'packets [0-9]*'\nexit $rc\n";
  }
  return shell("unshare -n sh " + dir + ".sh");
}

TEST(network_faults, dropped_syns_cost_no_worker_and_no_bit) {
  if (const auto why = skip_reason(); !why.empty()) GTEST_SKIP() << why;
  const std::string job = source_path("examples/configs/tiny.toml") +
                          " --set train.iterations=6 --set train.seq_len=16 --set parallel.pp=2 "
                          "--set parallel.dp=2";
  const auto ref = run_moevement("train " + job);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  long dropped = 0;
  for (int i = 0; i < 2; ++i) {
    const auto r = launch_dropping_syns(
        3, job + " --set engine.run_log=" + log_path("netfault" + std::to_string(i)));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(hash_of(r.output.substr(0, r.output.rfind("packets "))), hash_of(ref.output))
        << r.output;
    const auto at = r.output.rfind("packets ");
    ASSERT_NE(at, std::string::npos) << r.output;
    dropped += std::atol(r.output.c_str() + at + 8);
  }
  // Not vacuous: every run lost SYNs, of connections opened after the workers joined too.
  EXPECT_GE(dropped, 2 * 5);
}

// Whose connections fail: the workers of stages 0 and 1 (replica 0), the head and the worker
// of stage 1, or the head and the standby head.
enum class between { stages, head_and_stage, head_and_standby };

// `moevement launch ARGS` in a fresh network namespace where, once iteration `at` is in the
// run log, every TCP connection between `who` fails, the processes living on (new
// connections get through):
//   cut    blackholed both ways for good: two live processes that cannot hear each other,
//          while both still hear the head;
//   reset  closed under them (`ss -K`: an endpoint error on each side).
// The output says how many connections, and ends with the blackhole's packet counter.
run_result launch_failing_stage_link(const std::string& mode, int at, const std::string& args,
                                     const std::string& log, between who = between::stages) {
  const std::string dir = ::testing::TempDir() + "netcut_" + std::to_string(::getpid());
  {
    std::ofstream rules(dir + ".nft");
    rules << "table inet fault {\n  set cut { type inet_service . inet_service; }\n"
          << "  chain in {\n    type filter hook input priority 0;\n"
          << "    tcp sport . tcp dport @cut counter drop\n  }\n}\n";
    // Established connections of pid A and pid B that are each other's: "portA portB".
    std::ofstream pairs(dir + ".awk");
    pairs << "index($0, A) { split($3, l, \":\"); split($4, p, \":\"); a[l[2] \" \" p[2]] = 1 }\n"
          << "index($0, B) { split($3, l, \":\"); split($4, p, \":\"); b[p[2] \" \" l[2]] = 1 }\n"
          << "END { for (x in a) if (x in b) print x }\n";
    std::ofstream elements(dir + ".elements.awk");
    elements << "{ print $1 \" . \" $2 \", \" $2 \" . \" $1 }\n";
    const std::string fail =
        mode == "cut"
            ? "nft add element inet fault cut \"{ $(awk -f " + dir + ".elements.awk " + dir +
                  ".pairs | paste -sd,) }\"\n"
            : "while read a b; do ss -K -tn state established \"( sport = :$a and dport = :$b )\""
              " > /dev/null; done < " +
                  dir + ".pairs\n" +
                  // how many of them are still there (0: the kernel closed them)
                  "echo \"still $(ss -tnH state established | awk '{split($3, l, \":\");"
                  " split($4, p, \":\"); print l[2], p[2]}' | grep -cxFf " +
                  dir + ".pairs)\"\n";
    std::ofstream script(dir + ".sh");
    script << "ip link set lo up || exit 90\nnft -f " << dir << ".nft || exit 91\n"
           << std::getenv("MOEVEMENT_BIN") << " launch " << args << " &\njob=$!\n"
           << "i=0; until grep -q '\"iteration\":" << at << ",' " << log
           << " 2>/dev/null; do sleep 0.02; i=$((i+1)); [ $i -gt 3000 ] && break; done\n"
           << "pid() { grep \"\\\"stage\\\":$1,\\\"replica\\\":0\" " << log
           << " | head -1 | sed 's/.*\"pid\":\\([0-9]*\\).*/\\1/'; }\n"
           << "standby() { grep '\"standby_up\"' " << log
           << " | head -1 | sed 's/.*\"pid\":\\([0-9]*\\).*/\\1/'; }\n"
           << "ss -tnpH state established | awk -v A=\"pid="
           << (who == between::stages ? "$(pid 0)" : "$job")
           << ",\" -v B=\"pid=" << (who == between::head_and_standby ? "$(standby)" : "$(pid 1)")
           << ",\" -f " << dir << ".awk > " << dir << ".pairs\n"
           << "echo \"failed $(wc -l < " << dir << ".pairs) connections\"\n"
           << "[ -s " << dir << ".pairs ] && " << fail << "wait $job\nrc=$?\n"
           << "nft list chain inet fault in | grep -o 'packets [0-9]*'\nexit $rc\n";
  }
  return shell("unshare -n sh " + dir + ".sh");
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// 150 iterations: the fault comes at iteration 10, through a shell (ss, awk, nft) that a
// loaded machine runs slowly, and the job must still be running then.
const std::string stage_job = source_path("examples/configs/tiny.toml") +
                              " --set train.iterations=150 --set train.seq_len=16 "
                              "--set parallel.pp=2 --set cluster.spares=1 "
                              "--set checkpoint.policy=moevement";

// `moevement train` of stage_job, once for the tests that compare with it.
const run_result& stage_reference() {
  static const run_result ref = run_moevement("train " + stage_job);
  return ref;
}

// A reset run (launch_failing_stage_link "reset") ended as a fault-free one: the reference's
// hash, connections there were and were closed, no worker lost, no recovery.
void expect_reset_costs_nothing(const run_result& r, const run_result& ref,
                                const std::string& log) {
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(hash_of(r.output.substr(0, r.output.rfind("packets "))), hash_of(ref.output))
      << r.output;
  EXPECT_EQ(r.output.find("failed 0 connections"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("still 0"), std::string::npos) << r.output;  // they were closed
  EXPECT_EQ(r.output.find("recovered on worker"), std::string::npos) << r.output;
  EXPECT_EQ(read_file(log).find("worker_lost"), std::string::npos);
}

// Two live workers that cannot hear each other decide nothing themselves: each reports the
// other to the head, the head declares one lost (fenced: it is ended), a spare takes its stage,
// and the job ends with `moevement train`'s state_hash. (Before, each declared the other
// lost on its own, the head heard of nothing, and the pipeline stalled.)
TEST(network_faults, a_link_cut_between_two_live_workers_is_judged_by_the_head) {
  if (const auto why = skip_reason(); !why.empty()) GTEST_SKIP() << why;
  const auto& ref = stage_reference();
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::string log = log_path("netcut");
  const auto r =
      launch_failing_stage_link("cut", 10, stage_job + " --set engine.run_log=" + log, log);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(hash_of(r.output.substr(0, r.output.rfind("packets "))), hash_of(ref.output))
      << r.output;
  EXPECT_NE(r.output.find("recovered on worker"), std::string::npos) << r.output;
  // Not vacuous: connections were cut and packets dropped on them.
  EXPECT_EQ(r.output.find("failed 0 connections"), std::string::npos) << r.output;
  const auto at = r.output.rfind("packets ");
  ASSERT_NE(at, std::string::npos) << r.output;
  EXPECT_GT(std::atol(r.output.c_str() + at + 8), 0) << r.output;
  // The loss is the head's verdict on a report, not a transport error or its own heartbeats.
  const std::string text = read_file(log);
  EXPECT_NE(text.find("unreachable from node"), std::string::npos) << text.substr(0, 2000);
}

// Connections between two live workers closed under them (an endpoint error on each side) cost
// nothing: they dial again, what was in flight is sent again and handed on once, no worker is
// lost, and the job ends with `moevement train`'s state_hash. (Before, each declared the other
// lost on its own and the pipeline stalled.)
TEST(network_faults, connections_reset_between_two_live_workers_cost_no_worker_and_no_bit) {
  if (const auto why = skip_reason(); !why.empty()) GTEST_SKIP() << why;
  const auto& ref = stage_reference();
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::string log = log_path("netreset");
  expect_reset_costs_nothing(
      launch_failing_stage_link("reset", 10, stage_job + " --set engine.run_log=" + log, log), ref,
      log);
}

// The same reset between the head and a live worker costs nothing either: both sides redial
// (the head no longer takes a failed connection for a dead worker; only a redial the worker
// refuses, its process's exit, or its silence past the failure timeout is one).
TEST(network_faults, connections_reset_between_the_head_and_a_live_worker_cost_no_worker) {
  if (const auto why = skip_reason(); !why.empty()) GTEST_SKIP() << why;
  const auto& ref = stage_reference();
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::string log = log_path("netheadreset");
  expect_reset_costs_nothing(
      launch_failing_stage_link("reset", 10, stage_job + " --set engine.run_log=" + log, log,
                                between::head_and_stage),
      ref, log);
}

// The link between the head and its standby blackholed for good, both alive, every worker
// hearing both: the standby must not take the head's place (it took it, and two heads drove
// the job: each wrote the run log, each declared the other's workers lost, and the job
// failed). The workers still hear the head, so the standby waits; the head declares the
// standby lost, ends it, and the job ends with `moevement train`'s state_hash.
TEST(network_faults, a_link_cut_between_the_head_and_its_standby_leaves_one_head) {
  if (const auto why = skip_reason(); !why.empty()) GTEST_SKIP() << why;
  // Long enough to run on past the failure timeout after the cut.
  const std::string longer = stage_job + " --set train.iterations=700";
  const auto ref = run_moevement("train " + longer);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::string log = log_path("netstandbycut");
  const auto r = launch_failing_stage_link(
      "cut", 10, longer + " --set cluster.standby_head=true --set engine.run_log=" + log, log,
      between::head_and_standby);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(hash_of(r.output.substr(0, r.output.rfind("packets "))), hash_of(ref.output))
      << r.output;
  EXPECT_EQ(r.output.find("failed 0 connections"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("the standby head (node 4) was lost"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("taking over"), std::string::npos) << r.output;
  const std::string text = read_file(log);
  EXPECT_NE(text.find("\"event\":\"standby_lost\""), std::string::npos);
  EXPECT_EQ(text.find("job_failed"), std::string::npos) << text.substr(0, 2000);
}

}  // namespace
