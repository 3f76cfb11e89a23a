// Multi-process tests of ucx_link: this process is node 0; link_peer processes (spawned with
// posix_spawn, talking over 127.0.0.1) are the other nodes. Each transport runs twice: the
// default (shared memory on one host) and UCX_TLS=tcp.
#include "transport/ucx_link.hpp"

#include <gtest/gtest.h>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <algorithm>
#include <random>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <thread>

#include "base/hash.hpp"
#include "tests/transport/link_test_util.hpp"

extern char** environ;

namespace moevement::transport {
namespace {

using namespace std::chrono_literals;
using testing::decode;
using testing::encode;
using testing::test_message;

constexpr char token[] = "job-token-for-tests";

// Bytes of the big tensors. The issue asks for 1 GiB; the default run uses 256 MiB to stay
// within the CI's time budget on 2 cores (MOEVEMENT_TEST_TENSOR_BYTES=1073741824 for 1 GiB).
std::size_t tensor_bytes() {
  if (const char* v = std::getenv("MOEVEMENT_TEST_TENSOR_BYTES")) return std::stoull(v);
  return 256u << 20;
}

struct loss {
  node_id peer;
  peer_loss why;
  std::string detail;
};

class ucx_link_test : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    helper_ = std::getenv("MOEVEMENT_LINK_PEER") ? std::getenv("MOEVEMENT_LINK_PEER") : "";
    ASSERT_FALSE(helper_.empty()) << "run through meson test (MOEVEMENT_LINK_PEER names the "
                                     "link_peer helper)";
    if (tcp()) ::setenv("UCX_TLS", "tcp", 1);
  }
  void TearDown() override {
    for (pid_t pid : children_) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    link_.reset();
    ::unsetenv("UCX_TLS");
  }
  bool tcp() const { return GetParam() == "tcp"; }

  void make_link(ucx_link_options o = {}) {
    o.self = 0;
    o.job_token = token;
    link_ = std::make_unique<ucx_link>(io_, o);
    link_->set_handlers(link_handlers{
        [this](node_id from, incoming_envelope env) { inbox_.emplace_back(from, decode(env)); },
        [this](node_id peer, peer_loss why, const std::string& detail) {
          losses_.push_back({peer, why, detail});
        }});
  }

  pid_t spawn(std::vector<std::string> args) {
    args.insert(args.begin(), helper_);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = -1;
    EXPECT_EQ(::posix_spawn(&pid, helper_.c_str(), nullptr, nullptr, argv.data(), environ), 0);
    children_.push_back(pid);
    return pid;
  }
  std::vector<std::string> peer_args(const std::string& mode, node_id node,
                                     const std::string& tok = token) {
    return {mode, std::to_string(link_->port()), tok, std::to_string(node)};
  }

  template <class Pred>
  bool run_until(Pred pred, std::chrono::milliseconds limit = 20s) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!pred()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      io_.restart();
      io_.run_for(2ms);
    }
    return true;
  }

  // Runs the link while waiting for a child to exit; its exit status, or -1 on timeout.
  int wait_exit(pid_t pid, std::chrono::milliseconds limit = 20s) {
    int status = -1;
    const bool exited = run_until(
        [&] {
          int st = 0;
          if (::waitpid(pid, &st, WNOHANG) != pid) return false;
          status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
          return true;
        },
        limit);
    if (exited) std::erase(children_, pid);
    return exited ? status : -1;
  }

  std::optional<test_message> wait_message(const std::string& kind) {
    std::optional<test_message> found;
    run_until([&] {
      for (auto it = inbox_.begin(); it != inbox_.end(); ++it) {
        if (it->second.kind == kind) {
          found = it->second;
          inbox_.erase(it);
          return true;
        }
      }
      return false;
    });
    return found;
  }

  // Says bye to a peer and checks it leaves cleanly: goodbye seen here, exit status 0.
  void part(node_id peer, pid_t pid) {
    ASSERT_TRUE(link_->send(peer, encode(0, peer, testing::make("bye"))).ok());
    ASSERT_TRUE(run_until([&] { return !losses_.empty(); }));
    EXPECT_EQ(losses_.back().peer, peer);
    EXPECT_EQ(losses_.back().why, peer_loss::goodbye) << losses_.back().detail;
    EXPECT_EQ(wait_exit(pid), 0);
  }

  std::string helper_;
  asio::io_context io_;
  std::unique_ptr<ucx_link> link_;
  std::vector<std::pair<node_id, test_message>> inbox_;
  std::vector<loss> losses_;
  std::vector<pid_t> children_;
};

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

INSTANTIATE_TEST_SUITE_P(transports, ucx_link_test, ::testing::Values("shm", "tcp"));

// ---- big tensors, each path ------------------------------------------------------------------

struct tensor_case {
  std::string transport;  // shm | tcp
  bulk_path path;
  std::string memory;  // alloc: UCX allocates the region; user: the exporter's own vector
};

class ucx_tensor_test : public ::testing::TestWithParam<tensor_case> {};

TEST_P(ucx_tensor_test, big_tensor_pulled_with_matching_checksum) {
  const auto& c = GetParam();
  if (c.transport == "tcp") ::setenv("UCX_TLS", "tcp", 1);
  const char* helper = std::getenv("MOEVEMENT_LINK_PEER");
  ASSERT_NE(helper, nullptr);
  asio::io_context io;
  ucx_link_options o;
  o.self = 0;
  o.job_token = token;
  o.bulk = c.path;
  ucx_link link(io, o);
  std::optional<test_message> region;
  std::optional<peer_loss> lost;
  link.set_handlers({[&](node_id, incoming_envelope env) { region = decode(env); },
                     [&](node_id, peer_loss why, const std::string&) { lost = why; }});
  std::vector<std::string> args{helper,  "export", std::to_string(link.port()),
                                token,   "8",      std::to_string(tensor_bytes()),
                                c.memory};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  ASSERT_EQ(::posix_spawn(&pid, helper, nullptr, nullptr, argv.data(), environ), 0);
  auto run_until = [&](auto pred) {
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (!pred() && std::chrono::steady_clock::now() < deadline) {
      io.restart();
      io.run_for(2ms);
    }
    return pred();
  };
  ASSERT_TRUE(run_until([&] { return region.has_value(); }));
  std::vector<std::byte> into(region->descriptor.length);
  std::optional<result<void>> done;
  const auto t0 = std::chrono::steady_clock::now();
  link.pull(region->descriptor, into, [&](result<void> r) { done = std::move(r); });
  ASSERT_TRUE(run_until([&] { return done.has_value(); }));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(done->ok()) << done->err().message;
  EXPECT_EQ(xxhash64(into), region->checksum) << "the pulled bytes differ from the exported ones";
  const bool rma_expected =
      c.path == bulk_path::rma ||
      (c.path == bulk_path::automatic && c.transport == "shm" && c.memory != "user");
  EXPECT_EQ(link.counters().pulls_by_rma, rma_expected ? 1u : 0u);
  std::printf("pulled %zu MiB over %s by %s from %s memory in %.3f s (%.2f GB/s)\n",
              into.size() >> 20, c.transport.c_str(),
              link.counters().pulls_by_rma ? "RMA get" : "AM rendezvous", c.memory.c_str(), s,
              into.size() / s / 1e9);
  ASSERT_TRUE(link.send(8, encode(0, 8, testing::make("bye"))).ok());
  ASSERT_TRUE(run_until([&] { return lost.has_value(); }));
  EXPECT_EQ(*lost, peer_loss::goodbye);
  int st = 0;
  ::waitpid(pid, &st, 0);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  ::unsetenv("UCX_TLS");
}

INSTANTIATE_TEST_SUITE_P(paths, ucx_tensor_test,
                         ::testing::Values(tensor_case{"shm", bulk_path::rma, "alloc"},
                                           tensor_case{"shm", bulk_path::rendezvous, "user"},
                                           tensor_case{"shm", bulk_path::automatic, "alloc"},
                                           // registered memory of our own: UCX 1.13 would
                                           // emulate a get of it through the FIFOs
                                           tensor_case{"shm", bulk_path::automatic, "user"},
                                           tensor_case{"tcp", bulk_path::rendezvous, "alloc"},
                                           tensor_case{"tcp", bulk_path::rma, "user"},
                                           tensor_case{"tcp", bulk_path::automatic, "alloc"}),
                         [](const auto& info) {
                           const auto p = info.param.path;
                           return info.param.transport + "_" +
                                  (p == bulk_path::rma          ? "rma"
                                   : p == bulk_path::rendezvous ? "rendezvous"
                                                                : "auto") +
                                  "_" + info.param.memory;
                         });

// ---- kill -9 of the exporter while a pull is in flight ----------------------------------------

struct kill_case {
  std::string transport;
  bulk_path path;
  int delay_ms;  // after pull(): 0 kills before any reply, >0 during the transfer
};
class ucx_kill_test : public ::testing::TestWithParam<kill_case> {};

TEST_P(ucx_kill_test, pull_fails_in_bounded_time_when_the_exporter_dies) {
  const auto& c = GetParam();
  if (c.transport == "tcp") ::setenv("UCX_TLS", "tcp", 1);
  const char* helper = std::getenv("MOEVEMENT_LINK_PEER");
  ASSERT_NE(helper, nullptr);
  asio::io_context io;
  ucx_link_options o;
  o.self = 0;
  o.job_token = token;
  o.bulk = c.path;
  ucx_link link(io, o);
  std::optional<test_message> region;
  std::optional<peer_loss> lost;
  link.set_handlers({[&](node_id, incoming_envelope env) { region = decode(env); },
                     [&](node_id, peer_loss why, const std::string&) { lost = why; }});
  std::vector<std::string> args{helper, "export", std::to_string(link.port()),
                                token,  "8",      std::to_string(tensor_bytes()),
                                "alloc"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  ASSERT_EQ(::posix_spawn(&pid, helper, nullptr, nullptr, argv.data(), environ), 0);
  auto run_until = [&](auto pred, std::chrono::milliseconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!pred() && std::chrono::steady_clock::now() < deadline) {
      io.restart();
      io.run_for(1ms);
    }
    return pred();
  };
  ASSERT_TRUE(run_until([&] { return region.has_value(); }, 60s));
  std::vector<std::byte> into(region->descriptor.length);
  std::optional<result<void>> done;
  link.pull(region->descriptor, into, [&](result<void> r) { done = std::move(r); });
  if (c.delay_ms > 0) run_until([] { return false; }, std::chrono::milliseconds(c.delay_ms));
  ASSERT_FALSE(done.has_value()) << "the pull finished before the kill; the test needs a "
                                    "bigger tensor (MOEVEMENT_TEST_TENSOR_BYTES)";
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(run_until([&] { return done.has_value(); }, 10s))
      << "a pull from a dead peer never completed";
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  EXPECT_FALSE(done->ok()) << "a pull from a killed peer reported success";
  std::printf("pull failed %lld ms after the kill: %s\n", static_cast<long long>(ms),
              done->ok() ? "" : done->err().message.c_str());
  ASSERT_TRUE(run_until([&] { return lost.has_value(); }, 10s));
  EXPECT_EQ(*lost, peer_loss::crash);
  EXPECT_EQ(link.counters().pulls_failed, 1u);
  ::unsetenv("UCX_TLS");
}

INSTANTIATE_TEST_SUITE_P(paths, ucx_kill_test,
                         ::testing::Values(kill_case{"shm", bulk_path::rendezvous, 0},
                                           kill_case{"shm", bulk_path::rma, 0},
                                           kill_case{"tcp", bulk_path::rendezvous, 0},
                                           kill_case{"tcp", bulk_path::rendezvous, 5}),
                         [](const auto& info) {
                           return info.param.transport + "_" +
                                  (info.param.path == bulk_path::rma ? "rma" : "rendezvous") +
                                  "_after_" + std::to_string(info.param.delay_ms) + "ms";
                         });

}  // namespace
}  // namespace moevement::transport
