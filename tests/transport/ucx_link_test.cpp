// Multi-process tests of ucx_link: this process is node 0; link_peer processes (spawned with
// posix_spawn, talking over 127.0.0.1) are the other nodes. Each transport runs twice: the
// default (shared memory on one host) and UCX_TLS=tcp.

#include "tests/transport/ucx_link_fixture.hpp"

namespace moevement::transport {
namespace {

using namespace link_tests;  // the fixture, its helpers and names

TEST_P(ucx_link_test, messages_round_trip_in_order_then_goodbye) {
  make_link();
  const pid_t pid = spawn(peer_args("echo", 7));
  ASSERT_TRUE(wait_message("ready"));
  ASSERT_EQ(inbox_.size(), 0u);
  // Small (eager) and large (rendezvous) envelopes interleaved; order must hold.
  constexpr int n = 200;
  std::vector<std::vector<std::byte>> blobs;
  for (int i = 0; i < n; ++i) {
    const std::size_t size = i % 10 == 9 ? (1u << 20) + 8 * i : 8 * i;
    std::vector<std::byte> blob(size);
    testing::fill_pattern(blob, i);
    blobs.push_back(blob);
    ASSERT_TRUE(link_->send(7, encode(0, 7, testing::make("echo", i, blob))).ok());
  }
  ASSERT_TRUE(run_until([&] { return inbox_.size() == n; })) << inbox_.size() << " echoes";
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(inbox_[i].first, 7u);
    EXPECT_EQ(inbox_[i].second.seq, std::uint64_t(i));
    EXPECT_EQ(inbox_[i].second.blob, blobs[i]) << "echo " << i;
  }
  EXPECT_EQ(link_->stats().received, n + 1u);
  EXPECT_EQ(link_->stats().malformed, 0u);
  part(7, pid);
  EXPECT_FALSE(link_->send(7, encode(0, 7, testing::make("echo"))).ok()) << "sent to a lost peer";
}

// A connection that fails between two live peers loses no message and repeats none: each side
// numbers its envelopes and keeps them until acknowledged, the peer dials again, and what was
// not acknowledged goes again first; copies already handed on are dropped. The helper fails
// its connection in the middle of each round (with echoes in flight both ways).
TEST_P(ucx_link_test, a_failed_connection_loses_and_repeats_no_message) {
  make_link();
  link_->set_handlers(link_handlers{
      [this](node_id from, incoming_envelope env) { inbox_.emplace_back(from, decode(env)); },
      [this](node_id peer, peer_loss why, const std::string& detail) {
        losses_.push_back({peer, why, detail});
        if (why == peer_loss::crash) link_->revive(peer);  // the peer dials us again
      }});
  const pid_t pid = spawn(peer_args("redial", 7));
  ASSERT_TRUE(wait_message("ready"));
  constexpr int rounds = 4, per_round = 60;
  std::vector<std::byte> blob(512);
  testing::fill_pattern(blob, 1);
  for (int r = 0; r < rounds; ++r) {
    for (int i = 0; i < per_round; ++i) {
      const int seq = r * per_round + i;
      ASSERT_TRUE(link_->send(7, encode(0, 7, testing::make("echo", seq, blob))).ok()) << seq;
      if (i == per_round / 2) {
        ASSERT_TRUE(link_->send(7, encode(0, 7, testing::make("break"))).ok());
      }
    }
    ASSERT_TRUE(run_until([&] {
      std::erase_if(inbox_, [](const auto& m) { return m.second.kind == "back"; });
      return inbox_.size() == std::size_t(r + 1) * per_round;
    })) << "round "
        << r << ": " << inbox_.size() << " echoes";
  }
  run_until([] { return false; }, 200ms);  // late copies would show up here
  std::erase_if(inbox_, [](const auto& m) { return m.second.kind == "back"; });
  ASSERT_EQ(inbox_.size(), std::size_t(rounds * per_round));
  for (int i = 0; i < rounds * per_round; ++i) {
    EXPECT_EQ(inbox_[i].second.seq, std::uint64_t(i)) << "echo " << i;
    EXPECT_EQ(inbox_[i].second.blob, blob);
  }
  // Not vacuous: messages were sent again, or dropped here as copies of ones sent again.
  EXPECT_GT(link_->counters().resent + link_->counters().duplicates, 0u);
  ASSERT_TRUE(link_->send(7, encode(0, 7, testing::make("bye"))).ok());
  EXPECT_TRUE(run_until([&] {
    return std::any_of(losses_.begin(), losses_.end(),
                       [](const loss& l) { return l.why == peer_loss::goodbye; });
  }));
  EXPECT_EQ(wait_exit(pid), 0);
}

// A pull whose connection fails (waiting for its reply, or while its bytes move) is asked again,
// whole, on the peer's next connection: pulls are idempotent. The exporter lives on and dials
// again; both pulls complete with the right bytes.
TEST_P(ucx_link_test, a_pull_whose_connection_fails_is_asked_again_on_the_next_one) {
  make_link();
  link_->set_handlers(link_handlers{
      [this](node_id from, incoming_envelope env) { inbox_.emplace_back(from, decode(env)); },
      [this](node_id peer, peer_loss why, const std::string& detail) {
        losses_.push_back({peer, why, detail});
        if (why == peer_loss::crash) link_->revive(peer);
      }});
  auto args = peer_args("export", 8);
  args.insert(args.end(), {std::to_string(64 << 20), "alloc", "redial"});
  const pid_t pid = spawn(args);
  const auto region = wait_message("region");
  ASSERT_TRUE(region);
  std::vector<std::byte> into(region->descriptor.length);
  for (int delay_ms : {0, 3}) {
    std::fill(into.begin(), into.end(), std::byte{0});
    std::optional<result<void>> done;
    link_->pull(region->descriptor, into, [&](result<void> r) { done = std::move(r); });
    if (delay_ms > 0) run_until([] { return false; }, std::chrono::milliseconds(delay_ms));
    link_->fail_connections_for_tests(8);
    ASSERT_TRUE(run_until([&] { return done.has_value(); })) << "delay " << delay_ms;
    ASSERT_TRUE(done->ok()) << done->err().message;
    EXPECT_EQ(xxhash64(into), region->checksum) << "delay " << delay_ms;
  }
  EXPECT_GE(losses_.size(), 1u);  // not vacuous: connections failed, a pull was asked again
  EXPECT_GE(link_->counters().pulls_retried, 1u);
  ASSERT_TRUE(link_->send(8, encode(0, 8, testing::make("bye"))).ok());
  EXPECT_TRUE(run_until([&] {
    return std::any_of(losses_.begin(), losses_.end(),
                       [](const loss& l) { return l.why == peer_loss::goodbye; });
  }));
  EXPECT_EQ(wait_exit(pid), 0);
}

// A long pull goes in pieces (ucx_link_options::pull_piece_bytes): a connection that fails
// mid-transfer costs the piece in flight, asked again on the next connection, not the pieces
// already in. Whole, every byte went again.
TEST_P(ucx_link_test, a_long_pull_whose_connection_fails_keeps_the_pieces_already_in) {
  ucx_link_options o;
  o.pull_piece_bytes = 4u << 20;
  make_link(o);
  link_->set_handlers(link_handlers{
      [this](node_id from, incoming_envelope env) { inbox_.emplace_back(from, decode(env)); },
      [this](node_id peer, peer_loss why, const std::string& detail) {
        losses_.push_back({peer, why, detail});
        if (why == peer_loss::crash) link_->revive(peer);
      }});
  constexpr std::size_t bytes = std::size_t{128} << 20;
  auto args = peer_args("export", 8);
  args.insert(args.end(), {std::to_string(bytes), "alloc", "redial"});
  const pid_t pid = spawn(args);
  const auto region = wait_message("region");
  ASSERT_TRUE(region);
  std::vector<std::byte> into(region->descriptor.length);
  std::optional<result<void>> done;
  link_->pull(region->descriptor, into, [&](result<void> r) { done = std::move(r); });
  ASSERT_TRUE(run_until([&] { return done.has_value() || link_->counters().pull_pieces >= 2; }));
  ASSERT_FALSE(done.has_value()) << "the pull ended before the test could fail its connection";
  link_->fail_connections_for_tests(8);
  ASSERT_TRUE(run_until([&] { return done.has_value(); }));
  ASSERT_TRUE(done->ok()) << done->err().message;
  EXPECT_EQ(xxhash64(into), region->checksum);
  EXPECT_EQ(link_->counters().pull_pieces, bytes / o.pull_piece_bytes - 1);
  EXPECT_EQ(link_->counters().pulls_retried, 1u) << "more than the piece in flight went again";
  ASSERT_TRUE(link_->send(8, encode(0, 8, testing::make("bye"))).ok());
  EXPECT_TRUE(run_until([&] {
    return std::any_of(losses_.begin(), losses_.end(),
                       [](const loss& l) { return l.why == peer_loss::goodbye; });
  }));
  EXPECT_EQ(wait_exit(pid), 0);
}

// A pull made after the link lost a live peer but before the caller's verdict (a job's head
// decides who is lost) is parked like a message: asked on the peer's next connection, or failed
// once the peer is forgotten. It used to fail at once ("node 8 is lost"), and a stage that
// pulled in that gap failed its job although its peer was alive (seen once in network_faults).
TEST_P(ucx_link_test, a_pull_in_the_gap_before_the_verdict_waits_for_the_peer) {
  make_link();  // its loss handler records and decides nothing
  auto args = peer_args("export", 8);
  args.insert(args.end(), {std::to_string(1 << 20), "alloc", "redial"});
  const pid_t pid = spawn(args);
  const auto region = wait_message("region");
  ASSERT_TRUE(region);
  std::vector<std::byte> into(region->descriptor.length);
  std::optional<result<void>> done;
  link_->fail_connections_for_tests(8);  // lost now, kept: no verdict yet
  link_->pull(region->descriptor, into, [&](result<void> r) { done = std::move(r); });
  EXPECT_EQ(link_->counters().pulls_parked, 1u);
  EXPECT_FALSE(done.has_value());
  ASSERT_TRUE(run_until([&] { return done.has_value(); }));  // the peer dials again
  ASSERT_TRUE(done->ok()) << done->err().message;
  EXPECT_EQ(xxhash64(into), region->checksum);
  // The same gap, then the verdict: the parked pull fails and says so.
  done.reset();
  link_->fail_connections_for_tests(8);
  link_->pull(region->descriptor, into, [&](result<void> r) { done = std::move(r); });
  EXPECT_EQ(link_->counters().pulls_parked, 2u);
  link_->forget(8);
  ASSERT_TRUE(run_until([&] { return done.has_value(); }));
  ASSERT_FALSE(done->ok());
  EXPECT_NE(done->err().message.find("peer lost"), std::string::npos) << done->err().message;
  ::kill(pid, SIGKILL);
}

// The adaptive spin engages: once a reply woke us sooner than opt.spin after our send, the
// window covers that wait, so later replies are caught while spinning (no wakeup paid). It
// used to double from 0 on each such wake and halve on each fruitless spin, never getting past
// 1 us, so every reply came through the event fd whatever opt.spin said. The bound is large
// here so that a loaded machine's slow replies still fall inside it, and the spin does not
// yield (a yield on a loaded machine stops the spin: the next test).
TEST_P(ucx_link_test, spin_window_grows_to_cover_the_reply_wait) {
  ucx_link_options o;
  o.spin = 20ms;
  o.spin_yield = false;
  make_link(o);
  const pid_t pid = spawn(peer_args("echo", 9));
  ASSERT_TRUE(wait_message("ready"));
  constexpr int rounds = 200;
  const auto before = link_->counters();
  for (int i = 0; i < rounds; ++i) {
    ASSERT_TRUE(link_->send(9, encode(0, 9, testing::make("echo", i))).ok());
    ASSERT_TRUE(wait_message("echo")) << "round " << i;
  }
  const auto after = link_->counters();
  const auto caught = after.spin_progress - before.spin_progress;
  const auto woken = after.fd_progress - before.fd_progress;
  EXPECT_GE(caught, std::uint64_t{rounds / 2})
      << "replies caught by the spin: " << caught << ", by the event fd: " << woken;
  EXPECT_LT(woken, std::uint64_t{rounds / 2}) << "caught by the spin: " << caught;
  part(9, pid);
}

// On oversubscribed cores the spin backs off: a busy process pinned to our core makes each
// yield of the spin hand the core over, and the spin stops (the window stays 0 for a while),
// so replies come through the event fd instead of a spin that takes the busy process's time.
TEST_P(ucx_link_test, spin_backs_off_when_its_yield_gives_the_core_away) {
  cpu_set_t saved;
  ASSERT_EQ(::sched_getaffinity(0, sizeof saved, &saved), 0);
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(::sched_getcpu(), &one);
  ASSERT_EQ(::sched_setaffinity(0, sizeof one, &one), 0);
  const pid_t busy = ::fork();  // inherits the single-core affinity
  if (busy == 0) {
    volatile std::uint64_t spin = 0;
    for (;;) spin = spin + 1;
  }
  ASSERT_GT(busy, 0);
  children_.push_back(busy);
  ucx_link_options o;
  o.spin = 20ms;
  make_link(o);
  const pid_t pid = spawn(peer_args("echo", 10));
  ASSERT_TRUE(wait_message("ready"));
  constexpr int rounds = 50;
  const auto before = link_->counters();
  for (int i = 0; i < rounds; ++i) {
    ASSERT_TRUE(link_->send(10, encode(0, 10, testing::make("echo", i))).ok());
    ASSERT_TRUE(wait_message("echo")) << "round " << i;
  }
  const auto after = link_->counters();
  ::sched_setaffinity(0, sizeof saved, &saved);
  const auto caught = after.spin_progress - before.spin_progress;
  const auto woken = after.fd_progress - before.fd_progress;
  EXPECT_GE(after.spin_backoffs, 1u)  // counted from the start: it may back off on the "ready"
      << "caught by the spin: " << caught << ", woken by the event fd: " << woken;
  EXPECT_LT(caught, std::uint64_t{rounds / 2}) << "woken by the event fd: " << woken;
  part(10, pid);
}

// A sender killed while it floods us must not take our hearing of other peers with it. Over
// UCX's shared-memory FIFOs it could: a sender killed between reserving a slot in our FIFO and
// marking it written leaves a hole that our in-order reads never pass (the link keeps messages
// off those transports, see transport/ucx_context.hpp). Each round kills a flooding peer at a
// random point of its sending; a live peer's echo must still come back every time.
TEST_P(ucx_link_test, a_sender_killed_mid_flood_leaves_the_others_heard) {
  make_link();
  const pid_t echo = spawn(peer_args("echo", 2));
  ASSERT_TRUE(wait_message("ready"));
  std::mt19937 rng(11);
  for (int round = 0; round < 40; ++round) {
    const node_id flooder = 10 + round;
    const pid_t pid = spawn(peer_args("flood", flooder));
    ASSERT_TRUE(wait_message("ready")) << "round " << round;
    ASSERT_TRUE(run_until([&] {
      return std::ranges::any_of(inbox_, [&](const auto& m) { return m.first == flooder; });
    })) << "round "
        << round << ": the flood never arrived";
    // Let it flood for a while (the loop keeps draining), then kill it wherever it is.
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(5 + rng() % 20);
    run_until([&] { return std::chrono::steady_clock::now() > until; });
    ::kill(pid, SIGKILL);
    EXPECT_EQ(wait_exit(pid), 128 + SIGKILL);
    ASSERT_TRUE(link_->send(2, encode(0, 2, testing::make("echo", round))).ok());
    ASSERT_TRUE(wait_message("echo")) << "round " << round
                                      << ": the live peer's echo never came back after a "
                                         "flooding sender was killed";
    std::erase_if(inbox_, [](const auto& m) { return m.second.kind == "flood"; });
  }
  // Every flooder is reported lost as a crash, and no one else.
  ASSERT_TRUE(run_until([&] { return losses_.size() >= 40; })) << losses_.size() << " losses";
  for (const auto& l : losses_) {
    EXPECT_GE(l.peer, 10u);
    EXPECT_EQ(l.why, peer_loss::crash);
  }
  losses_.clear();
  part(2, echo);
}

TEST_P(ucx_link_test, send_to_self_is_posted_and_unknown_peer_fails_at_once) {
  make_link();
  ASSERT_TRUE(link_->send(0, encode(0, 0, testing::make("self", 5))).ok());
  EXPECT_TRUE(inbox_.empty()) << "delivered inline from send()";
  ASSERT_TRUE(wait_message("self"));
  EXPECT_FALSE(link_->send(42, encode(0, 42, testing::make("x"))).ok());
}

TEST_P(ucx_link_test, killed_idle_peer_is_reported_as_crash) {
  make_link();
  const pid_t pid = spawn(peer_args("echo", 3));
  ASSERT_TRUE(wait_message("ready"));
  ::kill(pid, SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(run_until([&] { return !losses_.empty(); }, 10s)) << "a killed peer went unnoticed";
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  EXPECT_EQ(losses_[0].peer, 3u);
  EXPECT_EQ(losses_[0].why, peer_loss::crash);
  RecordProperty("detect_ms", static_cast<int>(ms.count()));
  // A failed connection is not a verdict: sends are kept for a next connection until the
  // caller gives the peer up (forget), and fail fast from then on.
  EXPECT_TRUE(link_->send(3, encode(0, 3, testing::make("x"))).ok());
  link_->forget(3);
  EXPECT_FALSE(link_->send(3, encode(0, 3, testing::make("x"))).ok());
  run_until([] { return false; }, 50ms);
  EXPECT_EQ(losses_.size(), 1u) << "a loss must be reported once";
}

TEST_P(ucx_link_test, forget_reports_once_and_fails_sends) {
  make_link();
  const pid_t pid = spawn(peer_args("echo", 4));
  ASSERT_TRUE(wait_message("ready"));
  link_->forget(4);
  EXPECT_TRUE(losses_.empty()) << "reported inline";
  EXPECT_FALSE(link_->send(4, encode(0, 4, testing::make("x"))).ok());
  ASSERT_TRUE(run_until([&] { return !losses_.empty(); }));
  EXPECT_EQ(losses_[0].why, peer_loss::crash);
  EXPECT_EQ(wait_exit(pid), 1) << "the forgotten peer should see its connection fail";
  EXPECT_EQ(losses_.size(), 1u);
}

// A peer that hangs (SIGSTOP) with sends to it in flight, is forgotten (as the heartbeat does)
// and then killed must leave the link as responsive as before: round trips to a survivor are
// driven by event-fd wakeups again, not by the safety tick (the regression: ~5 ms a hop).
TEST_P(ucx_link_test, hung_forgotten_then_killed_peer_leaves_survivors_fast) {
  make_link();
  const pid_t survivor = spawn(peer_args("echo", 11));
  const pid_t hung = spawn(peer_args("echo", 12));
  ASSERT_TRUE(wait_message("ready"));
  ASSERT_TRUE(wait_message("ready"));
  constexpr int rounds = 200;
  // One message in flight at a time: each round trip needs a wakeup on each side.
  auto ping_pong = [&](node_id peer) {
    for (int i = 0; i < rounds; ++i) {
      ASSERT_TRUE(link_->send(peer, encode(0, peer, testing::make("echo", i))).ok());
      auto echo = wait_message("echo");
      ASSERT_TRUE(echo.has_value()) << "round " << i;
      ASSERT_EQ(echo->seq, std::uint64_t(i));
    }
  };
  auto delta = [](const ucx_link_counters& a, const ucx_link_counters& b) {
    ucx_link_counters d;
    d.tick_progress = b.tick_progress - a.tick_progress;
    d.arm_errors = b.arm_errors - a.arm_errors;
    d.fd_progress = b.fd_progress - a.fd_progress;
    d.arms = b.arms - a.arms;
    d.arm_busy = b.arm_busy - a.arm_busy;
    d.poll_progress = b.poll_progress - a.poll_progress;
    d.arm_stuck = b.arm_stuck - a.arm_stuck;
    return d;
  };
  ping_pong(12);
  auto c0 = link_->counters();
  ping_pong(11);
  const auto before = delta(c0, link_->counters());

  // Hang the peer, queue enough to it that sends stay in flight, then give up on it.
  ASSERT_EQ(::kill(hung, SIGSTOP), 0);
  const std::vector<std::byte> blob(4096, std::byte{7});
  for (int i = 0; i < 500; ++i) {
    (void)link_->send(12, encode(0, 12, testing::make("echo", i, blob)));
  }
  run_until([] { return false; }, 200ms);
  link_->forget(12);
  ASSERT_TRUE(run_until([&] { return !losses_.empty(); }));
  ::kill(hung, SIGKILL);
  ::waitpid(hung, nullptr, 0);
  std::erase(children_, hung);
  run_until([] { return false; }, 200ms);

  c0 = link_->counters();
  ping_pong(11);
  const auto after = delta(c0, link_->counters());
  auto show = [](const char* when, const ucx_link_counters& d) {
    std::printf("%s: arms=%lu busy=%lu stuck=%lu errors=%lu progress by tick=%lu poll=%lu fd=%lu\n",
                when, d.arms, d.arm_busy, d.arm_stuck, d.arm_errors, d.tick_progress,
                d.poll_progress, d.fd_progress);
  };
  show("before", before);
  show("after", after);
  EXPECT_EQ(after.arm_errors, before.arm_errors) << "the worker cannot be armed any more";
  // The regression: UCX kept refusing to arm (UCS_ERR_BUSY) for ever, so the link spun on the
  // worker at 100% CPU: hundreds of thousands of busy arms where there had been one per round.
  EXPECT_LE(after.arm_busy, 2 * before.arm_busy + rounds) << "the worker stays busy: spinning";
  EXPECT_LE(after.arms, 2 * before.arms + rounds) << "far more pump passes per round trip";
  // The pump's own guard (polling after a run of idle busy arms) must not be what saves it:
  // with the bug it fired on nearly every round trip. One episode is tolerated (seen once in
  // six sanitizer runs on a loaded machine: the killed peer's endpoint still closing).
  EXPECT_LE(after.arm_stuck, 1u) << "UCX refuses to arm: the link fell back to polling";
  // Before, the safety tick drove next to none of the round trips; a link that cannot sleep
  // on the event fd needs it for most of them (counts, not times: both phases see the same
  // machine load).
  EXPECT_LE(after.tick_progress, 2 * before.tick_progress + rounds / 4)
      << "round trips to the survivor are driven by the safety tick";
  ASSERT_EQ(losses_.size(), 1u);
  losses_.clear();
  part(11, survivor);
}

TEST_P(ucx_link_test, wrong_token_is_refused_and_counted) {
  make_link();
  const pid_t pid = spawn(peer_args("intruder", 9, "not-the-job-token"));
  EXPECT_EQ(wait_exit(pid), 0) << "the intruder was not told it was refused";
  EXPECT_EQ(link_->counters().refused_tokens, 1u);
  EXPECT_TRUE(inbox_.empty()) << "a message from a refused connection was delivered";
  EXPECT_TRUE(losses_.empty());
  EXPECT_GE(link_->stats().malformed, 1u);
}

TEST_P(ucx_link_test, malformed_corpus_and_bad_descriptors_are_rejected_and_counted) {
  ucx_link_options o;
  o.limits.max_bytes = 1u << 20;
  make_link(o);
  auto region = link_->allocate_region(1u << 20);
  testing::fill_pattern(region.memory(), 11);
  const pid_t pid = spawn(peer_args("malformed", 5));
  ASSERT_TRUE(wait_message("ready"));
  ASSERT_TRUE(
      link_
          ->send(5,
                 encode(0, 5,
                        test_message{
                            "region", 0, {}, region.describe_all(), xxhash64(region.memory()), {}}))
          .ok());
  auto report = wait_message("report");
  ASSERT_TRUE(report) << "the peer never reported (did malformed input break the link?)";
  EXPECT_EQ(link_->stats().malformed, report->checksum) << "every malformed input counted once";
  EXPECT_EQ(report->counts, (std::vector<std::uint64_t>{1, 1, 1, 1, 1}))
      << "bad descriptors must fail, the good pull must succeed with the right bytes";
  EXPECT_EQ(link_->counters().bulk_rejected, 4u);
  EXPECT_EQ(link_->counters().bad_hellos, 1u);
  EXPECT_TRUE(inbox_.empty());
  part(5, pid);
}

// A TCP connection of our own to the link's port (127.0.0.1), or -1.
int connect_to(std::uint16_t port) {
  const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(s, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
    ::close(s);
    return -1;
  }
  return s;
}

// Junk on the listener's port (a scanner, a stray client) costs the job nothing: junk
// connections in a row (the 64 zero bytes that used to abort the process inside UCX's
// connection manager among them, and a head announcing more than any address holds), and one
// left open, then a real peer still gets in.
TEST_P(ucx_link_test, junk_connections_leave_the_listener_listening) {
  make_link();
  std::vector<std::vector<unsigned char>> junk(4, std::vector<unsigned char>(64, 0));
  std::fill(junk[1].begin(), junk[1].end(), 0xa5);
  // A greeting of ours ("MADM", v2, node 9, no nonce), then a head past every bound.
  const std::uint32_t head[20] = {0x4d44414d, 2, 9,          0, 0, 0, 0,           0, 0, 0,
                                  0,          0, 0x4d44414d, 2, 9, 0, 0xffffffffu, 0, 0, 0};
  junk[2].resize(sizeof head);
  std::memcpy(junk[2].data(), head, sizeof head);
  junk[3].resize(5);  // a fragment, then the connection closes
  std::vector<int> open_junk;
  for (std::size_t i = 0; i <= junk.size(); ++i) {
    const int s = connect_to(link_->port());
    ASSERT_GE(s, 0);
    const auto& bytes = junk[std::min(i, junk.size() - 1)];
    ASSERT_EQ(::send(s, bytes.data(), bytes.size(), MSG_NOSIGNAL), ssize_t(bytes.size()));
    run_until([] { return false; }, 50ms);  // the link's loop sees it
    if (i < junk.size()) {
      ::close(s);
    } else {
      open_junk.push_back(s);
    }
  }
  EXPECT_TRUE(run_until([&] { return link_->counters().bad_hellos >= junk.size(); }));
  const pid_t pid = spawn(peer_args("echo", 7));
  ASSERT_TRUE(wait_message("ready")) << "the listener stopped accepting after junk";
  ASSERT_TRUE(link_->send(7, encode(0, 7, testing::make("echo", 1))).ok());
  ASSERT_TRUE(run_until([&] { return !inbox_.empty(); }));
  part(7, pid);
  for (int s : open_junk) ::close(s);
}

// One source may hold only so many connections that have not said hello: the next one from it
// is refused (counted, reported) and the listener goes on listening; the silent ones are closed
// after hello_timeout.
TEST_P(ucx_link_test, half_open_connections_from_one_source_are_limited) {
  ucx_link_options o;
  o.max_half_open_per_source = 2;
  o.hello_timeout = 1s;
  make_link(o);
  std::vector<int> silent;
  for (int i = 0; i < 3; ++i) {
    silent.push_back(connect_to(link_->port()));
    ASSERT_GE(silent.back(), 0);
    // each connection reaches the listener before the next is made (the order is the test's)
    run_until([] { return false; }, 100ms);
  }
  EXPECT_TRUE(run_until([&] { return link_->counters().half_open_refused == 1; }));
  EXPECT_EQ(link_->counters().half_open_refused, 1u);
  EXPECT_TRUE(run_until([&] { return link_->counters().hello_timeouts >= 2; }));
  // Once the silent ones are closed, a real peer from the same source gets in.
  const pid_t pid = spawn(peer_args("echo", 7));
  ASSERT_TRUE(wait_message("ready")) << "the listener stopped accepting";
  part(7, pid);
  for (int s : silent) ::close(s);
}

// This process's TCP sockets (listening only, or all), by their local addresses as
// /proc/net/tcp{,6} write them (hex, network order).
std::vector<std::string> tcp_sockets(bool listening_only = true) {
  std::set<std::string> ours;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::string target = std::filesystem::read_symlink(e.path(), ec).string();
    if (!ec && target.starts_with("socket:[")) ours.insert(target.substr(8, target.size() - 9));
  }
  std::vector<std::string> out;
  for (const char* table : {"/proc/self/net/tcp", "/proc/self/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string slot, local, remote, state, queues, timer, retr, uid, timeout, inode;
      f >> slot >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode;
      const bool listening = state == "0A";  // LISTEN
      if ((listening || !listening_only) && ours.contains(inode)) out.push_back(local);
    }
  }
  return out;
}

// With listen_host on loopback nothing of the link listens elsewhere (UCX's TCP transport
// listened on every interface's address, per worker).
TEST_P(ucx_link_test, a_loopback_link_listens_on_loopback_only) {
  make_link();
  const auto listening = tcp_sockets();
  EXPECT_FALSE(listening.empty());
  for (const auto& local : listening) {
    const std::string host = local.substr(0, local.find(':'));
    const bool v4_loopback = host.size() == 8 && host.ends_with("7F");  // 127.x, little-endian
    const bool v6_loopback = host == "00000000000000000000000001000000";
    EXPECT_TRUE(v4_loopback || v6_loopback) << "listening on " << local;
  }
}

// The automatic choice follows the transport: RMA on shared memory, rendezvous on TCP.
TEST_P(ucx_link_test, automatic_bulk_path_follows_the_transport) {
  make_link();
  const pid_t pid = spawn(peer_args("echo", 6));
  ASSERT_TRUE(wait_message("ready"));
  auto path = link_->path_to(6);
  ASSERT_TRUE(path.ok()) << path.err().message;
  EXPECT_EQ(*path, tcp() ? bulk_path::rendezvous : bulk_path::rma);
  auto info = link_->endpoint_info(6);
  ASSERT_TRUE(info.ok());
  EXPECT_NE(info->find(tcp() ? "tcp/" : "memory"), std::string::npos) << *info;
  part(6, pid);
}

// A pull issued on a fresh connection (nothing exchanged yet, the launcher's case: a stage
// pulls from a peer it never spoke to) must not go out before the acceptor welcomed us: UCX may
// deliver it ahead of the hello, the acceptor drops it as unadmitted and the pull never ends.
// Held requests are counted; the pull then completes with the right bytes and the exporter saw
// nothing malformed.
TEST_P(ucx_link_test, pull_on_a_fresh_connection_waits_for_the_welcome) {
  make_link();
  auto region = link_->allocate_region(4096);
  testing::fill_pattern(region.memory(), 7);
  ucx_link_options o;
  o.self = 1;
  o.job_token = token;
  ucx_link puller(io_, o);
  puller.add_peer(0, "127.0.0.1", link_->port());
  for (int round = 0; round < 2; ++round) {
    std::vector<std::byte> into(region.memory().size());
    std::optional<result<void>> done;
    puller.pull(region.describe_all(), into, [&](result<void> r) { done = std::move(r); });
    // The first pull opens the connection; the second comes after the welcome and goes out
    // at once.
    EXPECT_EQ(puller.counters().held_sends, 1u) << "round " << round;
    ASSERT_TRUE(run_until([&] { return done.has_value(); })) << "the pull never completed";
    ASSERT_TRUE(done->ok()) << done->err().message;
    EXPECT_EQ(xxhash64(into), xxhash64(region.memory()));
  }
  EXPECT_EQ(link_->stats().malformed, 0u) << "the acceptor dropped something (before the hello?)";
  EXPECT_EQ(link_->counters().bulk_served, 2u);
  puller.say_goodbye();
  ASSERT_TRUE(run_until([&] { return !losses_.empty(); }));
  EXPECT_EQ(losses_.back().why, peer_loss::goodbye);
}

// The acceptor's side of a fresh connection: from the dialler's hello to the welcome it sends
// (from a posted handler), whatever it sends waits behind the welcome. A send in that gap went
// out first, the dialler dropped it as unadmitted, and the next one's number made the dialler
// count it as handed on: lost for good (a group replay's first message between two workers,
// and the replay waited ten minutes for it). A handler that re-posts itself looks at every turn
// of the loop and sends its first message as soon as the connection says it is wired up (once
// the hello arrived, before the fix: in that gap).
TEST_P(ucx_link_test, the_acceptors_first_sends_wait_for_its_welcome) {
  make_link();
  ucx_link_options o;
  o.self = 1;
  o.job_token = token;
  ucx_link dialler(io_, o);
  std::vector<std::uint64_t> got;
  dialler.set_handlers(
      link_handlers{[&](node_id, incoming_envelope env) { got.push_back(decode(env).seq); }, {}});
  dialler.add_peer(0, "127.0.0.1", link_->port());
  ASSERT_TRUE(dialler.send(0, encode(1, 0, testing::make("hello", 1))).ok());
  constexpr std::uint64_t count = 20;
  std::uint64_t sent = 0;
  std::function<void()> turn = [&] {
    // Node 0 knows node 1 only once it admitted it; wired up once its hello came.
    if (sent > 0 || link_->path_to(1).ok()) {
      ASSERT_TRUE(link_->send(1, encode(0, 1, testing::make("n", sent + 1))).ok());
      ++sent;
    }
    if (sent < count) asio::post(io_, turn);
  };
  asio::post(io_, turn);
  ASSERT_TRUE(run_until([&] { return got.size() == count; }, 5s))
      << got.size() << " of " << count << " arrived";
  for (std::uint64_t i = 0; i < count; ++i) ASSERT_EQ(got[i], i + 1);
  EXPECT_EQ(dialler.stats().malformed, 0u) << "the dialler dropped something before the welcome";
  dialler.say_goodbye();
  ASSERT_TRUE(run_until([&] { return !losses_.empty(); }));
}

// A message lost on a connection that stays up (UCX completing a send with an error, a message
// the other end dropped) was skipped for good: the next one's number made the receiver take
// it as handed on. Now the receiver finds the gap and asks for the stream again from it, and a
// lost last message (no gap behind it to show) goes again once unacknowledged for
// resend_after. The dialler loses, on the wire, the first envelope of its stream, one in the
// middle, two in a row, one twice (its resend too) and the last.
TEST_P(ucx_link_test, envelopes_lost_on_a_live_connection_are_sent_again_in_order) {
  make_link();
  ucx_link_options o;
  o.self = 1;
  o.job_token = token;
  o.delivery.resend_after = 100ms;
  // Seq -> how many of its sends are lost: the first of the stream, one in the middle, two in
  // a row, one whose resend is lost too, the last one (alone), and the one before a goodbye.
  std::map<std::uint64_t, int> to_lose{{1, 1}, {5, 1}, {9, 1}, {10, 1}, {14, 2}, {20, 1}, {21, 1}};
  std::uint64_t lost = 0;
  o.lose_envelope = [&](node_id peer, std::uint64_t seq) {
    auto it = to_lose.find(seq);
    if (peer != 0 || it == to_lose.end() || it->second == 0) return false;
    --it->second;
    ++lost;
    return true;
  };
  ucx_link dialler(io_, o);
  dialler.set_handlers(link_handlers{[](node_id, incoming_envelope) {}, {}});
  dialler.add_peer(0, "127.0.0.1", link_->port());
  auto send = [&](std::uint64_t i) {
    ASSERT_TRUE(dialler.send(0, encode(1, 0, testing::make("n", i))).ok());
  };
  for (std::uint64_t i = 1; i < 20; ++i) send(i);
  ASSERT_TRUE(run_until([&] { return inbox_.size() == 19; }, 10s)) << inbox_.size() << " of 19";
  // Everything acknowledged (and the repair's traffic over), the last one is lost: only its
  // sender can tell.
  ASSERT_TRUE(run_until([&] { return dialler.counters().unacked == 0; }, 5s));
  run_until([] { return false; }, 2 * o.delivery.resend_after);
  const auto before = dialler.counters();
  ASSERT_EQ(before.unacked, 0u);
  send(20);
  ASSERT_TRUE(run_until([&] { return inbox_.size() == 20; }, 10s)) << "the last one is lost";
  EXPECT_GT(dialler.counters().probes, before.probes) << "the last one came without a probe?";
  EXPECT_EQ(dialler.counters().resends_answered, before.resends_answered);
  // Everything acknowledged: nothing is probed again.
  ASSERT_TRUE(run_until([&] { return dialler.counters().unacked == 0; }, 5s));
  const auto probes = dialler.counters().probes;
  run_until([] { return false; }, 4 * o.delivery.resend_after);
  EXPECT_EQ(dialler.counters().probes, probes) << "probed after everything was acked";
  // One lost just before a goodbye: the goodbye waits for it (asked for again).
  send(21);
  dialler.say_goodbye();
  ASSERT_TRUE(run_until([&] { return !losses_.empty(); }));
  EXPECT_EQ(losses_.back().why, peer_loss::goodbye);
  ASSERT_EQ(inbox_.size(), 21u) << "the goodbye overtook the message lost before it";
  for (std::uint64_t i = 0; i < 21; ++i) EXPECT_EQ(inbox_[i].second.seq, i + 1);
  EXPECT_EQ(lost, 8u) << "the test lost fewer envelopes than it meant to";
  const auto got = link_->counters();
  EXPECT_GE(got.early, 1u);
  EXPECT_GE(got.resend_requests, 3u);
  EXPECT_GE(dialler.counters().resends_answered, 3u);
  EXPECT_EQ(got.skipped, 0u);
  EXPECT_EQ(link_->stats().malformed, 0u);
}

INSTANTIATE_TEST_SUITE_P(transports, ucx_link_test, ::testing::Values("shm", "tcp"));

// With shared memory only (UCX_TLS=sm,self) UCX opens no TCP socket, and its own listener
// could not connect such processes at all ("Destination is unreachable"). The admission socket
// is then the link's one TCP socket: messages, a pull and junk on that socket, as above.
class ucx_link_sm_test : public ucx_link_test {};

TEST_P(ucx_link_sm_test, shared_memory_only_links_connect_with_one_tcp_socket_their_own) {
  make_link();
  auto args = peer_args("export", 8);
  args.insert(args.end(), {std::to_string(4 << 20), "alloc"});
  const pid_t pid = spawn(args);
  const auto region = wait_message("region");
  ASSERT_TRUE(region) << "a peer using shared memory only could not connect";
  std::vector<std::byte> into(region->descriptor.length);
  std::optional<result<void>> done;
  link_->pull(region->descriptor, into, [&](result<void> r) { done = std::move(r); });
  ASSERT_TRUE(run_until([&] { return done.has_value(); }));
  ASSERT_TRUE(done->ok()) << done->err().message;
  EXPECT_EQ(xxhash64(into), region->checksum);
  EXPECT_EQ(tcp_sockets(/*listening_only=*/false).size(), 1u)
      << "a TCP socket besides the admission socket";
  const int junk = connect_to(link_->port());
  ASSERT_GE(junk, 0);
  const std::array<unsigned char, 64> zeros{};
  ASSERT_EQ(::send(junk, zeros.data(), zeros.size(), MSG_NOSIGNAL), 64);
  ::close(junk);
  EXPECT_TRUE(run_until([&] { return link_->counters().bad_hellos == 1; }));
  ASSERT_TRUE(link_->send(8, encode(0, 8, testing::make("bye"))).ok());
  EXPECT_TRUE(run_until([&] {
    return std::any_of(losses_.begin(), losses_.end(),
                       [](const loss& l) { return l.why == peer_loss::goodbye; });
  }));
  EXPECT_EQ(wait_exit(pid), 0);
}

INSTANTIATE_TEST_SUITE_P(transports, ucx_link_sm_test, ::testing::Values("sm"));
}  // namespace
}  // namespace moevement::transport
