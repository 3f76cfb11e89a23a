// The group inbox of a parallel group replay: announcements are taken by (generation,
// iteration, replica); a newer restore supersedes the waits of an older one; an older
// generation's announcement is refused, a newer one kept without ending anything; the inbox
// is bounded; a wait nothing ends times out.
#include "recovery/group_replay.hpp"

#include <gtest/gtest.h>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>

#include <optional>
#include <string>

namespace moevement::recovery {
namespace {

using namespace std::chrono_literals;

transport::bulk_descriptor desc(std::uint64_t length) {
  transport::bulk_descriptor d;
  d.node = 3;
  d.length = length;
  return d;
}

// Runs what is ready on `io` (again after it ran out of work).
void pump(asio::io_context& io) {
  io.restart();
  io.poll();
}

// Starts a take on `io`; its descriptor or error lands in the returned state.
struct taken {
  std::optional<transport::bulk_descriptor> got;
  std::string error;
  bool done = false;
};
std::shared_ptr<taken> start_take(asio::io_context& io, group_inbox& inbox, std::uint64_t gen,
                                  std::int64_t it, std::uint32_t replica,
                                  std::chrono::steady_clock::duration timeout = 10s) {
  auto out = std::make_shared<taken>();
  asio::co_spawn(
      io,
      [&inbox, out, gen, it, replica, timeout]() -> asio::awaitable<void> {
        try {
          out->got = co_await inbox.take(gen, it, replica, timeout);
        } catch (const std::exception& e) {
          out->error = e.what();
        }
        out->done = true;
      },
      asio::detached);
  return out;
}

TEST(group_inbox, a_take_waits_for_its_announcement_only) {
  asio::io_context io;
  group_inbox inbox(io);
  inbox.begin(2);
  auto t = start_take(io, inbox, 2, 5, 1);
  pump(io);
  EXPECT_FALSE(t->done);
  EXPECT_TRUE(inbox.put(2, 5, 0, desc(8)));  // another replica
  EXPECT_TRUE(inbox.put(2, 4, 1, desc(8)));  // another iteration
  pump(io);
  EXPECT_FALSE(t->done);
  EXPECT_TRUE(inbox.put(2, 5, 1, desc(12)));
  pump(io);
  ASSERT_TRUE(t->done);
  ASSERT_TRUE(t->got.has_value()) << t->error;
  EXPECT_EQ(t->got->length, 12u);
  // taken once: the same key again waits
  auto again = start_take(io, inbox, 2, 5, 1, 50ms);
  io.restart();
  io.run_for(1s);
  EXPECT_TRUE(again->done);
  EXPECT_NE(again->error.find("never sent its gradients of iteration 5"), std::string::npos)
      << again->error;
}

// A peer whose replay is over (its end marker) while this member waits for one of its
// iterations: the members replayed different iterations, said at once, not after the wait's
// whole timeout. Its earlier announcements still come first (they arrive in order).
TEST(group_inbox, a_peer_that_ended_its_replay_fails_a_wait_for_more_at_once) {
  asio::io_context io;
  group_inbox inbox(io);
  inbox.begin(1);
  auto out = std::make_shared<taken>();
  const auto take = [&](std::int64_t it) {
    out = std::make_shared<taken>();
    asio::co_spawn(
        io,
        [&inbox, o = out, it]() -> asio::awaitable<void> {
          try {
            o->got = co_await inbox.take(1, it, 1, 10s, INT64_MAX);
          } catch (const std::exception& e) {
            o->error = e.what();
          }
          o->done = true;
        },
        asio::detached);
    pump(io);
  };
  EXPECT_TRUE(inbox.put(1, 6, 1, desc(8)));
  EXPECT_TRUE(inbox.put(1, INT64_MAX, 1, desc(8)));  // group_reducer's end marker
  take(6);
  ASSERT_TRUE(out->done);
  EXPECT_TRUE(out->got.has_value()) << out->error;
  take(7);
  ASSERT_TRUE(out->done);
  EXPECT_NE(out->error.find("ended its replay without sending its gradients of iteration 7"),
            std::string::npos)
      << out->error;
}

TEST(group_inbox, a_newer_restore_supersedes_an_older_wait_and_its_announcements) {
  asio::io_context io;
  group_inbox inbox(io);
  inbox.begin(1);
  EXPECT_TRUE(inbox.put(1, 3, 0, desc(8)));
  auto old = start_take(io, inbox, 1, 7, 0);
  pump(io);
  EXPECT_FALSE(old->done);
  // A peer replays generation 4 already: its announcement is kept, and the old wait goes on
  // until this worker hears of generation 4 (the coordinator's ReplayGeneration).
  EXPECT_TRUE(inbox.put(4, 3, 0, desc(8)));
  pump(io);
  EXPECT_FALSE(old->done);
  inbox.begin(4);
  pump(io);
  ASSERT_TRUE(old->done);
  EXPECT_NE(old->error.find("superseded by generation 4"), std::string::npos) << old->error;
  EXPECT_EQ(inbox.size(), 1u);                // generation 1's entry dropped
  EXPECT_FALSE(inbox.put(3, 3, 0, desc(8)));  // older than the newest begun: refused
  inbox.begin(4);                             // this worker's Restore of 4: nothing lost
  EXPECT_EQ(inbox.size(), 1u);
  inbox.begin(3);  // an older one later: nothing changes
  EXPECT_EQ(inbox.size(), 1u);
  auto now = start_take(io, inbox, 4, 3, 0);
  pump(io);
  ASSERT_TRUE(now->got.has_value()) << now->error;
  // A newer restore begun here ends an older wait the same way.
  auto older = start_take(io, inbox, 4, 8, 1);
  pump(io);
  inbox.begin(5);
  pump(io);
  ASSERT_TRUE(older->done);
  EXPECT_NE(older->error.find("superseded by generation 5"), std::string::npos) << older->error;
}

TEST(group_inbox, is_bounded) {
  asio::io_context io;
  group_inbox inbox(io, 4);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(inbox.put(1, i, 0, desc(8)));
  EXPECT_FALSE(inbox.put(1, 9, 0, desc(8)));
  EXPECT_EQ(inbox.size(), 4u);
  // A long wait's report says what was refused and what is held.
  EXPECT_EQ(inbox.refused(), 1u);
  const std::string said = inbox.describe();
  EXPECT_NE(said.find("at generation 0, has refused 1"), std::string::npos) << said;
  EXPECT_NE(said.find("(generation 1, iteration 3, from 0)"), std::string::npos) << said;
}

}  // namespace
}  // namespace moevement::recovery
