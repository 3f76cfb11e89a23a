// engine::run_log_reader: a run log read back strictly, line by line; a bad line stops the
// reading there and says where; a file with no record is not a run log.
#include "engine/run_log_reader.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "engine/run_log.hpp"

namespace moevement::engine {
namespace {

std::string temp_file(const std::string& name, const std::string& text) {
  const std::string path =
      ::testing::TempDir() + "reader_" + std::to_string(::getpid()) + "_" + name;
  std::ofstream(path, std::ios::trunc) << text;
  return path;
}

TEST(run_log_reader, a_record_reads_back_what_run_log_wrote) {
  const std::string path = temp_file("written.jsonl", "");
  {
    run_log log(path);
    log.write(json_record{}
                  .add("kind", "event")
                  .add("event", "worker_lost")
                  .add("how", "was \"killed\"\n\tby signal 9 \\ ok")
                  .add("stage", 2)
                  .add("time_s", 1.25)
                  .add("big", std::int64_t(1) << 40));
  }
  auto r = read_run_log(path);
  ASSERT_TRUE(r.ok()) << r.err().message;
  ASSERT_EQ(r->records.size(), 1u);
  const auto& rec = r->records[0];
  EXPECT_TRUE(rec.is("event", "worker_lost"));
  EXPECT_EQ(rec.text("how"), "was \"killed\"\n\tby signal 9 \\ ok");
  EXPECT_EQ(rec.number("stage"), 2.0);
  EXPECT_EQ(rec.number("time_s"), 1.25);
  EXPECT_EQ(rec.number("big"), double(std::int64_t(1) << 40));
  EXPECT_FALSE(rec.number("how").has_value()) << "a string is not a number";
  EXPECT_TRUE(r->stopped.empty());
}

TEST(run_log_reader, every_json_value_kind_and_escape_parses) {
  auto r = run_record::parse(
      R"({ "kind" : "x", "t": true, "f": false, "n": null, "e": -1.5e3, "u": "\u00e9\u0041\/" })");
  ASSERT_TRUE(r.ok()) << r.err().message;
  EXPECT_EQ(r->number("e"), -1500.0);
  EXPECT_EQ(r->text("u"),
            "\xc3\xa9"
            "A/");
  EXPECT_EQ(r->fields().size(), 6u);
  auto tiny = run_record::parse(R"({"kind":"x","n":1e-400})");
  ASSERT_TRUE(tiny.ok()) << "an underflow is a number (0): " << tiny.err().message;
  EXPECT_EQ(tiny->number("n"), 0.0);
}

TEST(run_log_reader, malformed_lines_say_what_and_where) {
  for (const std::string line :
       {"", "kind", "{", "{\"kind\":\"x\"", "{\"kind\":\"x\",}", "{\"kind\" \"x\"}",
        "{\"kind\":\"x\"} trailing", "{\"kind\":x}", "{\"kind\":\"a\\qb\"}", "{\"kind\":\"a\tb\"}",
        "{\"kind\":\"x\",\"n\":1e}", "{\"kind\":\"x\",\"n\":--1}", "{\"kind\":\"\\u12\"}",
        "{\"kind\":\"unterminated}", "{\"event\":\"no kind\"}", "{\"kind\":3}",
        "{\"kind\":\"\\u-FFF\"}", "{\"kind\":\"\\u0x1F\"}", "{\"kind\":\"x\",\"n\":1e999}"}) {
    auto r = run_record::parse(line);
    EXPECT_FALSE(r.ok()) << line;
    if (!r.ok()) {
      EXPECT_FALSE(r.err().message.empty()) << line;
    }
  }
  auto bad = run_record::parse("{\"kind\":\"x\" \"y\":1}");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.err().message.find("at byte 12"), std::string::npos) << bad.err().message;
}

TEST(run_log_reader, a_truncated_log_keeps_what_it_holds_and_says_where_it_stopped) {
  const std::string path = temp_file(
      "truncated.jsonl",
      "{\"kind\":\"event\",\"event\":\"job_start\"}\n\n{\"kind\":\"iteration\",\"iteration\":0}\n"
      "{\"kind\":\"iteration\",\"itera");
  auto r = read_run_log(path);
  ASSERT_TRUE(r.ok()) << r.err().message;
  EXPECT_EQ(r->records.size(), 2u);
  EXPECT_EQ(r->stopped.rfind("line 4: ", 0), 0u) << r->stopped;
}

// A head killed mid-write, then resumed into the same log: the torn line is skipped (said),
// the resume's records are read; garbage at the end still ends the reading at its first line.
// run_log opened to append after a torn line starts its first record on a line of its own.
TEST(run_log_reader, a_torn_line_with_records_after_it_is_skipped) {
  const std::string path = temp_file("torn.jsonl",
                                     "{\"kind\":\"event\",\"event\":\"job_start\"}\n"
                                     "{\"kind\":\"iteration\",\"itera");
  {
    run_log appended(path, /*append=*/true);
    appended.write(json_record{}.add("kind", "event").add("event", "job_start"));
    appended.write(json_record{}.add("kind", "iteration").add("iteration", std::int64_t{5}));
  }
  std::ofstream(path, std::ios::app) << "garbage\nmore garbage\n";
  auto r = read_run_log(path);
  ASSERT_TRUE(r.ok()) << r.err().message;
  EXPECT_EQ(r->records.size(), 3u);
  EXPECT_EQ(r->skipped_lines, 1u);
  ASSERT_EQ(r->skipped.size(), 1u);
  EXPECT_EQ(r->skipped[0].rfind("line 2: ", 0), 0u) << r->skipped[0];
  EXPECT_EQ(r->stopped.rfind("line 5: ", 0), 0u) << r->stopped;
  EXPECT_EQ(r->records.back().number("iteration"), 5.0);
}

// A standby head that took over: the newest iteration the lost head logged, from the log's
// tail (a part line at its start and a torn last line not counted).
TEST(run_log_reader, the_last_logged_iteration_is_read_from_the_tail) {
  std::string text = "{\"kind\":\"event\",\"event\":\"job_start\"}\n";
  for (int i = 0; i < 40; ++i) {
    text += "{\"kind\":\"iteration\",\"iteration\":" + std::to_string(i) + ",\"loss\":1}\n";
  }
  text += "{\"kind\":\"event\",\"event\":\"window_persisted\",\"iteration\":77}\n";
  text += "{\"kind\":\"iteration\",\"iteration\":40,\"lo";  // torn
  const std::string path = temp_file("tail.jsonl", text);
  EXPECT_EQ(last_logged_iteration(path), std::optional<std::int64_t>(39));
  EXPECT_EQ(last_logged_iteration(path, 200), std::optional<std::int64_t>(39));  // a tail
  EXPECT_EQ(last_logged_iteration(temp_file("none.jsonl", "{\"kind\":\"event\"}\n")), std::nullopt);
  EXPECT_EQ(last_logged_iteration(path + ".missing"), std::nullopt);
}

TEST(run_log_reader, a_log_ends_its_run_with_job_end_failed_or_stopped) {
  const std::string start = "{\"kind\":\"event\",\"event\":\"job_start\"}\n";
  const std::string it = "{\"kind\":\"iteration\",\"iteration\":3}\n";
  for (const char* end : {"job_end", "job_failed", "job_stopped"}) {
    const std::string text =
        start + it + "{\"kind\":\"event\",\"event\":\"" + end + "\"}\n" + "{\"kind\":\"ite";
    EXPECT_TRUE(run_log_ended(temp_file(std::string(end) + ".jsonl", text))) << end;
  }
  EXPECT_FALSE(run_log_ended(temp_file("running.jsonl", start + it)));
  // The stages' last durable writes logged after the end: ended still.
  EXPECT_TRUE(run_log_ended(temp_file("written_after.jsonl",
                                      start + it + "{\"kind\":\"event\",\"event\":\"job_end\"}\n" +
                                          "{\"kind\":\"event\",\"event\":\"durable_written\"}\n")));
  // A resume after an end: running again.
  EXPECT_FALSE(run_log_ended(
      temp_file("again.jsonl", start + "{\"kind\":\"event\",\"event\":\"job_failed\"}\n" + start)));
  EXPECT_FALSE(run_log_ended("/nonexistent/run.jsonl"));
}

// A standby head that took the job over and died before its end: its job_start says so (the
// head that left the job to it then says the standby took it over, not that it never did).
TEST(run_log_reader, the_last_run_is_a_takeover_where_its_job_start_says_so) {
  const std::string start = "{\"kind\":\"event\",\"event\":\"job_start\"}\n";
  const std::string takeover =
      "{\"kind\":\"event\",\"event\":\"job_start\",\"takeover\":\"live\"}\n";
  const std::string it = "{\"kind\":\"iteration\",\"iteration\":3}\n";
  EXPECT_TRUE(run_log_taken_over(temp_file("taken.jsonl", start + it + takeover + it)));
  EXPECT_FALSE(run_log_taken_over(temp_file("head_only.jsonl", start + it)));
  EXPECT_FALSE(run_log_taken_over(temp_file("resumed.jsonl", takeover + it + start)));
  EXPECT_FALSE(run_log_taken_over("/nonexistent/run.jsonl"));
  // A standby that logged long after its start: found further back than the tail first read.
  std::string long_run = start + takeover;
  for (int i = 0; i < 200; ++i) long_run += it;
  EXPECT_TRUE(run_log_taken_over(temp_file("long.jsonl", long_run), 64));
  EXPECT_FALSE(run_log_taken_over(
      temp_file("long_head.jsonl",
                takeover + start + long_run.substr(start.size() + takeover.size())),
      64));
}

TEST(run_log_reader, what_is_not_a_run_log_is_an_error) {
  auto missing = read_run_log(::testing::TempDir() + "no_such_run_log.jsonl");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.err().message.find("cannot open"), std::string::npos);
  auto empty = read_run_log(temp_file("empty.jsonl", ""));
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.err().message.find("is not a run log (it is empty)"), std::string::npos);
  auto text = read_run_log(temp_file("notes.txt", "# my notes\nhello\n"));
  ASSERT_FALSE(text.ok());
  EXPECT_NE(text.err().message.find("is not a run log (line 1: expected '{' at byte 0)"),
            std::string::npos)
      << text.err().message;
  auto dir = read_run_log(::testing::TempDir());
  ASSERT_FALSE(dir.ok());
  EXPECT_NE(dir.err().message.find("is a directory, not a run log"), std::string::npos)
      << dir.err().message;
  auto huge = read_run_log(temp_file("huge.jsonl", std::string(100, 'x') + "\n"), 50);
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.err().message.find("longer than 50 bytes"), std::string::npos);
}

}  // namespace
}  // namespace moevement::engine
