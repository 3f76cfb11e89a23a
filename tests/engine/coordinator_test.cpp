// The coordinator's own end, on the deterministic scheduler: one that stops abnormally (a
// handler that threw) ends the job saying why, in the run log too, instead of leaving its
// workers idle with no head driving them.
#include "engine/coordinator.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "actors/deterministic.hpp"

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

}  // namespace
}  // namespace moevement::engine
