// `moevement report`: one self-contained HTML file of one or more run logs, with the
// failures and recoveries on the throughput chart and in a table; a truncated log renders what
// it holds; a file that is not a run log is a clear error. (A real job's run log is reported in
// tests/launcher/recovery_test.)
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "tests/support/run_moevement.hpp"

namespace {

using namespace moevement::test_support;

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "report_" + std::to_string(::getpid()) + "_" + name;
}

std::string write(const std::string& name, const std::string& text) {
  const std::string path = temp_path(name);
  std::ofstream(path, std::ios::trunc) << text;
  return path;
}

std::string read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A run of 6 iterations with a kill of stage 1 at iteration 3, recovered.
std::string run_log_text(double tokens_per_s) {
  std::string t =
      "{\"kind\":\"event\",\"event\":\"job_start\",\"time_s\":0}\n"
      "{\"kind\":\"event\",\"event\":\"window_chosen\",\"w_sparse\":2}\n";
  for (int i = 0; i < 6; ++i) {
    t += "{\"kind\":\"iteration\",\"iteration\":" + std::to_string(i) +
         ",\"loss\":" + std::to_string(5.5 - 0.1 * i) +
         ",\"iteration_s\":0.1,\"tokens_per_s\":" + std::to_string(tokens_per_s) +
         ",\"stall_s\":0.001,\"capture_cpu_s\":0.002,\"snapshot_bytes\":2000000,\"time_s\":" +
         std::to_string(0.1 * (i + 1) + (i >= 3 ? 0.5 : 0)) + "}\n";
    if (i == 2) {
      t += "{\"kind\":\"event\",\"event\":\"window_persisted\",\"window\":1,\"time_s\":0.3}\n"
           "{\"kind\":\"event\",\"event\":\"inject\",\"spec\":\"kill:stage=1,replica=0,iter=3\","
           "\"time_s\":0.31}\n"
           "{\"kind\":\"event\",\"event\":\"worker_lost\",\"stage\":1,\"replica\":0,\"time_s\":"
           "0.32}\n"
           "{\"kind\":\"event\",\"event\":\"recovery_start\",\"recovery\":\"region\",\"stage\":1,"
           "\"replica\":0,\"region\":1,\"supervision\":\"started\",\"first_stage\":1,"
           "\"last_stage\":1,\"roles\":\"1/0\",\"generation\":1,\"restarts\":0,\"time_s\":0.33}\n"
           "{\"kind\":\"event\",\"event\":\"recovery_end\",\"recovery\":\"region\",\"stage\":1,"
           "\"target_iteration\":3,\"iterations_replayed\":2,\"seconds\":0.47,\"spawn_s\":0.1,"
           "\"pull_s\":0.05,\"replay_s\":0.2,\"rejoin_s\":0.12,\"time_s\":0.8}\n";
    }
  }
  t += "{\"kind\":\"validation\",\"iteration\":5,\"val_loss\":5.1}\n"
       "{\"kind\":\"event\",\"event\":\"job_end\",\"state_hash\":\"0123456789abcdef\","
       "\"ettr\":0.62,\"wall_s\":1.1,\"time_s\":1.1}\n";
  return t;
}

TEST(report, a_run_log_becomes_one_self_contained_html_file) {
  // Besides, an idle spare lost, and a worker lost while a standby took over.
  std::string text = run_log_text(1000);
  text.insert(text.find("{\"kind\":\"validation\""),
              "{\"kind\":\"event\",\"event\":\"worker_lost\",\"node\":5,\"stage\":-1,"
              "\"replica\":-1,\"time_s\":0.95}\n"
              "{\"kind\":\"event\",\"event\":\"worker_lost\",\"node\":6,\"during\":"
              "\"takeover\",\"time_s\":0.97}\n");
  const std::string log = write("run.jsonl", text);
  const std::string out = temp_path("run.html");
  const auto r = run_moevement("report " + log + " -o " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("report: " + out), std::string::npos) << r.output;
  const std::string html = read(out);
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(html.find("Throughput over wall time"), std::string::npos);
  EXPECT_NE(html.find("seconds since the job started"), std::string::npos) << "axes labelled";
  EXPECT_NE(html.find("stage 1 replica 0 lost"), std::string::npos) << "the failure marked";
  EXPECT_NE(html.find("spare worker 5 lost"), std::string::npos) << "a spare by its worker";
  EXPECT_NE(html.find("worker 6 lost"), std::string::npos) << "no role: by its worker";
  EXPECT_EQ(html.find("stage -1"), std::string::npos);
  EXPECT_NE(html.find("kill:stage=1,replica=0,iter=3"), std::string::npos) << "the injection";
  EXPECT_NE(html.find("<td>region</td><td>stage 1 replica 0</td><td>3</td><td>2</td>"
                      "<td>0.470</td><td>0.100</td><td>0.050</td><td>0.200</td><td>0.120</td>"),
            std::string::npos)
      << "the recovery's row";
  EXPECT_NE(html.find("<td>1</td><td>started</td><td>1</td><td>1/0</td><td>1</td><td>0</td>"),
            std::string::npos)
      << "the recovery tree's row";
  EXPECT_NE(html.find("state_hash 0123456789abcdef"), std::string::npos);
  EXPECT_NE(html.find("<td>0.620</td><td>2</td>"), std::string::npos) << "ETTR, W_sparse";
  EXPECT_NE(html.find("capture CPU (ms)"), std::string::npos);
  EXPECT_NE(html.find("stall (ms)"), std::string::npos);
  EXPECT_NE(html.find("loss (nats)"), std::string::npos);
  // Self-contained: nothing fetched, no script.
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(html.find("src="), std::string::npos);
  EXPECT_EQ(html.find("href="), std::string::npos);
  // Without -o: beside the run log.
  const auto beside = run_moevement("report " + log);
  ASSERT_EQ(beside.exit_code, 0) << beside.output;
  EXPECT_NE(read(temp_path("run.html")).find("<svg"), std::string::npos);
}

TEST(report, several_runs_overlay_and_a_truncated_one_says_where_it_stopped) {
  const std::string a = write("a.jsonl", run_log_text(1000));
  std::string cut = run_log_text(2000);
  cut.resize(cut.find("\"event\":\"job_end\"") + 10);
  const std::string b = write("b.jsonl", cut);
  const std::string out = temp_path("ab.html");
  const auto r = run_moevement("report " + a + " " + b + " -o " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string html = read(out);
  EXPECT_NE(html.find(">report_" + std::to_string(::getpid()) + "_a.jsonl</td>"),
            std::string::npos);
  EXPECT_NE(html.find(">report_" + std::to_string(::getpid()) + "_b.jsonl</td>"),
            std::string::npos);
  EXPECT_NE(html.find("_b.jsonl: read up to line 15:"), std::string::npos) << html;
  EXPECT_NE(html.find("no job_end record"), std::string::npos);
}

// A resumed job appends to its log: the wall time is every run's (on the clock that joins
// them), and the ETTR says it is the last run's.
TEST(report, a_resumed_jobs_log_counts_every_runs_wall_time) {
  std::string killed = run_log_text(1000);
  killed.resize(killed.find("{\"kind\":\"validation\""));  // killed before its end
  const std::string log = write("resumed.jsonl", killed + run_log_text(1000));
  const std::string out = temp_path("resumed.html");
  const auto r = run_moevement("report " + log + " -o " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string html = read(out);
  // 1.1 s to the killed run's last iteration, then the resumed run's 1.1 s.
  EXPECT_NE(html.find("<td>2.20</td><td>0.620 (the last of 2 runs: resumed)</td>"),
            std::string::npos)
      << html;
  // A standby head's takeover appends a job_start that says so.
  std::string taken = run_log_text(1000);
  taken.replace(taken.find("\"event\":\"job_start\","), 20,
                "\"event\":\"job_start\",\"takeover\":\"live\",");
  const std::string log2 = write("taken.jsonl", killed + taken);
  ASSERT_EQ(run_moevement("report " + log2 + " -o " + out).exit_code, 0);
  EXPECT_NE(read(out).find("(the last of 2 runs: a standby head took over)"), std::string::npos);
  // The head's loss counts among the failures (the two workers' losses alone said 2).
  EXPECT_NE(read(out).find("<td>2 (and the head: a standby took over)</td>"), std::string::npos)
      << read(out);
  // A resume's recovery lost no stage (its event names the first role it restores).
  std::string resumed = run_log_text(1000);
  resumed.insert(resumed.find('\n') + 1,
                 "{\"kind\":\"event\",\"event\":\"recovery_start\",\"recovery\":\"resume\","
                 "\"stage\":0,\"replica\":0,\"time_s\":0.01}\n");
  const std::string log3 = write("resumed3.jsonl", killed + resumed);
  ASSERT_EQ(run_moevement("report " + log3 + " -o " + out).exit_code, 0);
  EXPECT_NE(read(out).find("<td>resume</td><td>none (every stage from disk)</td>"),
            std::string::npos)
      << read(out);
}

// A killed run's torn last line, then its resume's records: the torn line is skipped (said)
// and the resumed run's end shown. Two logs of one name are told apart by their paths.
TEST(report, a_torn_line_is_skipped_and_logs_of_one_name_are_told_apart) {
  std::string killed = run_log_text(1000);
  killed.resize(killed.find("{\"kind\":\"validation\"") - 30);  // torn mid-record
  const std::string log = write("torn.jsonl", killed + "\n" + run_log_text(1000));
  const std::string out = temp_path("torn.html");
  ASSERT_EQ(run_moevement("report " + log + " -o " + out).exit_code, 0);
  const std::string html = read(out);
  EXPECT_NE(html.find("1 unreadable line(s) skipped"), std::string::npos) << html;
  EXPECT_NE(html.find("state_hash 0123456789abcdef"), std::string::npos) << html;
  const std::string a = temp_path("a_dir"), b = temp_path("b_dir");
  std::filesystem::create_directories(a);
  std::filesystem::create_directories(b);
  std::ofstream(a + "/run.jsonl") << run_log_text(1000);
  std::ofstream(b + "/run.jsonl") << run_log_text(2000);
  ASSERT_EQ(run_moevement("report " + a + "/run.jsonl " + b + "/run.jsonl -o " + out).exit_code, 0);
  EXPECT_NE(read(out).find(">" + a + "/run.jsonl</td>"), std::string::npos) << read(out);
  EXPECT_NE(read(out).find(">" + b + "/run.jsonl</td>"), std::string::npos);
  std::filesystem::remove_all(a);
  std::filesystem::remove_all(b);
}

// SIGUSR1's stop is shown as the stop it is, and once resumed (or after a failure the resume
// carried on) the end is the resumed run's hash, not the earlier run's stop or failure.
TEST(report, a_stop_is_not_a_failure_and_a_resume_ends_with_its_hash) {
  std::string stopped = run_log_text(1000);
  stopped.resize(stopped.find("{\"kind\":\"validation\""));
  stopped +=
      "{\"kind\":\"event\",\"event\":\"job_stopped\",\"message\":\"stopped on SIGUSR1 with "
      "window 1 on disk\",\"time_s\":0.9}\n";
  const std::string log = write("stopped.jsonl", stopped);
  const std::string out = temp_path("stopped.html");
  ASSERT_EQ(run_moevement("report " + log + " -o " + out).exit_code, 0);
  EXPECT_NE(read(out).find("<td>stopped on SIGUSR1 with window 1 on disk</td>"), std::string::npos)
      << read(out);
  EXPECT_EQ(read(out).find("failed:"), std::string::npos);
  for (const char* end : {"job_stopped", "job_failed"}) {
    std::string first = stopped;
    first.replace(first.find("job_stopped"), 11, end);
    const std::string both = write("both.jsonl", first + run_log_text(1000));
    ASSERT_EQ(run_moevement("report " + both + " -o " + out).exit_code, 0);
    EXPECT_NE(read(out).find("state_hash 0123456789abcdef"), std::string::npos) << end;
    EXPECT_EQ(read(out).find("failed:"), std::string::npos) << end;
  }
}

// Values a hostile or broken log may hold: huge, null (a diverged loss), missing. The report
// is still written (no hang, nothing drawn at infinity), and a diverged loss is not drawn as 0.
// A region that restarted, grew and escalated to the durable tier's rollback: each is a row of
// the recovery tree, in order, and the baselines' rollback is one region of its own.
TEST(report, the_recovery_tree_lists_every_supervision_event) {
  const std::string log = write(
      "tree.jsonl",
      "{\"kind\":\"event\",\"event\":\"job_start\",\"time_s\":0}\n"
      "{\"kind\":\"event\",\"event\":\"recovery_start\",\"recovery\":\"region\",\"region\":1,"
      "\"supervision\":\"started\",\"first_stage\":2,\"last_stage\":2,\"roles\":\"2/0\","
      "\"generation\":1,\"restarts\":0,\"time_s\":1}\n"
      "{\"kind\":\"event\",\"event\":\"recovery_start\",\"recovery\":\"region\",\"region\":1,"
      "\"supervision\":\"grew\",\"first_stage\":1,\"last_stage\":2,\"roles\":\"2/0,1/0\","
      "\"generation\":2,\"restarts\":1,\"time_s\":2}\n"
      "{\"kind\":\"event\",\"event\":\"region_escalated\",\"region\":1,\"first_stage\":1,"
      "\"last_stage\":2,\"restarts\":2,\"to\":\"durable_rollback\",\"reason\":\"restart "
      "intensity exceeded <&>\",\"time_s\":3}\n"
      "{\"kind\":\"event\",\"event\":\"recovery_start\",\"recovery\":\"rollback\",\"stage\":0,"
      "\"replica\":1,\"attempt\":2,\"time_s\":4}\n");
  const std::string out = temp_path("tree.html");
  const auto r = run_moevement("report " + log + " -o " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string html = read(out);
  const auto started = html.find("<td>1</td><td>started</td><td>2</td><td>2/0</td><td>1</td>");
  const auto grew = html.find("<td>1</td><td>grew</td><td>1..2</td><td>2/0,1/0</td><td>2</td>");
  const auto escalated = html.find(
      "<td>1</td><td>escalated to durable_rollback</td><td>1..2</td><td>restart intensity "
      "exceeded &lt;&amp;&gt;</td><td>-</td><td>2</td>");
  ASSERT_NE(started, std::string::npos) << html;
  ASSERT_NE(grew, std::string::npos) << html;
  ASSERT_NE(escalated, std::string::npos) << html;
  EXPECT_LT(started, grew);
  EXPECT_LT(grew, escalated);
  EXPECT_NE(html.find("<td>rollback</td><td>restarted</td><td>all</td><td>0/1 rebuilt</td>"
                      "<td>2</td>"),
            std::string::npos)
      << html;
}

TEST(report, hostile_values_are_left_out_not_drawn) {
  const std::string log =
      write("hostile.jsonl",
            "{\"kind\":\"event\",\"event\":\"job_start\",\"time_s\":1e308}\n"
            "{\"kind\":\"iteration\",\"iteration\":0,\"loss\":null,\"tokens_per_s\":1.79e308,"
            "\"time_s\":1.7e308}\n"
            "{\"kind\":\"iteration\",\"iteration\":1e300,\"loss\":5}\n"
            "{\"kind\":\"iteration\",\"iteration\":2,\"loss\":4.5,\"tokens_per_s\":10,"
            "\"time_s\":-5}\n"
            "{\"kind\":\"event\",\"event\":\"recovery_end\",\"target_iteration\":1e300}\n");
  const std::string out = temp_path("hostile.html");
  const auto r = run_moevement("report " + log + " -o " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string html = read(out);
  EXPECT_EQ(html.find("inf"), std::string::npos) << html;
  EXPECT_EQ(html.find("nan"), std::string::npos) << html;
  // The record whose iteration is too large to draw is left out, and the page says so.
  EXPECT_NE(html.find("1 iteration or validation record(s) left out"), std::string::npos);
}

// Regions recovering side by side: each recovery_end goes to its own row (by generation; all
// went to the newest, the other row said "did not end"), and a generation its region's next
// one restarted says so.
TEST(report, side_by_side_recoveries_each_end_in_their_own_row) {
  std::string text = "{\"kind\":\"event\",\"event\":\"job_start\",\"time_s\":0}\n";
  auto start = [](int region, int generation, int stage) {
    return fmt::format(
        "{{\"kind\":\"event\",\"event\":\"recovery_start\",\"recovery\":\"region\","
        "\"stage\":{},\"replica\":0,\"region\":{},\"generation\":{},\"time_s\":1}}\n",
        stage, region, generation);
  };
  auto end = [](int generation, int target) {
    return fmt::format(
        "{{\"kind\":\"event\",\"event\":\"recovery_end\",\"recovery\":\"region\","
        "\"generation\":{},\"target_iteration\":{},\"seconds\":0.5,\"time_s\":2}}\n",
        generation, target);
  };
  text += start(1, 1, 0) + start(2, 2, 2) + start(2, 3, 2) + end(1, 10) + end(3, 11);
  const std::string log = write("side_by_side.jsonl", text);
  const std::string out = temp_path("side_by_side.html");
  const auto r = run_moevement("report " + log + " -o " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string html = read(out);
  EXPECT_EQ(html.find("(did not end)"), std::string::npos) << html;
  EXPECT_NE(html.find("(restarted)"), std::string::npos) << html;
  EXPECT_NE(html.find(">10<"), std::string::npos) << html;
  EXPECT_NE(html.find(">11<"), std::string::npos) << html;
}

// Records of a known kind with a badly typed iteration are left out, and the page says so
// (they went silently).
TEST(report, records_with_a_badly_typed_iteration_are_counted_as_left_out) {
  std::string text = run_log_text(100);
  text +=
      "{\"kind\":\"iteration\",\"iteration\":\"abc\",\"loss\":5}\n"
      "{\"kind\":\"validation\",\"val_loss\":5}\n";
  const std::string log = write("typed.jsonl", text);
  const std::string out = temp_path("typed.html");
  const auto r = run_moevement("report " + log + " -o " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(read(out).find("2 iteration or validation record(s) left out"), std::string::npos);
  const auto help = run_moevement("report --help");
  EXPECT_EQ(help.exit_code, 0) << help.output;
  EXPECT_NE(help.output.find("moevement report"), std::string::npos) << help.output;
}

TEST(report, what_is_not_a_run_log_is_refused) {
  const std::string notes = write("notes.txt", "these are my notes\n");
  auto r = run_moevement("report " + notes + " -o " + temp_path("notes.html"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("is not a run log (line 1: expected '{' at byte 0)"), std::string::npos)
      << r.output;
  r = run_moevement("report");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("usage: moevement report"), std::string::npos) << r.output;
  r = run_moevement("report " + notes + " --colour red");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("unexpected argument '--colour'"), std::string::npos) << r.output;
  r = run_moevement("report " + notes + " -o");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("-o needs a file name"), std::string::npos) << r.output;
  r = run_moevement("launch " + source_path("examples/configs/tiny.toml") + " --dry-run --report " +
                    temp_path("x.html"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--report draws the job's run log"), std::string::npos) << r.output;
  // -o naming the run log itself (here also through "./"): refused, the log left as it was.
  const std::string log = write("self.jsonl", "{\"kind\":\"event\",\"event\":\"job_start\"}\n");
  const auto self = std::filesystem::path(log);
  r = run_moevement("report " + log + " -o " +
                    (self.parent_path() / "." / self.filename()).string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("would overwrite its run log"), std::string::npos) << r.output;
  std::ifstream kept(log);
  std::string first;
  std::getline(kept, first);
  EXPECT_EQ(first, "{\"kind\":\"event\",\"event\":\"job_start\"}");
  r = run_moevement("report " + temp_path("missing.jsonl"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("cannot open"), std::string::npos) << r.output;
}

}  // namespace
