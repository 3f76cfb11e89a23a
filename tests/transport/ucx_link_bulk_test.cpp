// Multi-process tests of ucx_link's bulk transfers: leases, big tensors on each path, an
// exporter killed mid-pull. The same executable as ucx_link_test.cpp (its fixture:
// ucx_link_fixture.hpp).

#include "tests/transport/ucx_link_fixture.hpp"

namespace moevement::transport {
namespace {

using namespace link_tests;  // the fixture, its helpers and names

// ---- leases: RMA pulls of allocated regions without a round trip ----------------------------

// A second link in this process pulls from link_ (node 0) with RMA forced (on TCP that is
// UCX's emulated RMA: slow but the same protocol), after one message wired the endpoint up.
struct lease_rig {
  explicit lease_rig(asio::io_context& io) : puller(io, options()) {}
  static ucx_link_options options() {
    ucx_link_options o;
    o.self = 1;
    o.job_token = token;
    o.bulk = bulk_path::rma;
    // Its destructor flushes while node 0 (same thread) cannot answer: do not wait long.
    o.close_timeout = std::chrono::milliseconds(50);
    return o;
  }
  ucx_link puller;
};

class ucx_lease_test : public ucx_link_test {
 protected:
  std::unique_ptr<lease_rig> connect() {
    auto rig = std::make_unique<lease_rig>(io_);
    rig->puller.add_peer(0, "127.0.0.1", link_->port());
    EXPECT_TRUE(rig->puller.send(0, encode(1, 0, testing::make("hi"))).ok());
    EXPECT_TRUE(wait_message("hi"));
    return rig;
  }
  result<void> pull(ucx_link& by, const bulk_descriptor& d, std::span<std::byte> into) {
    std::optional<result<void>> done;
    by.pull(d, into, [&](result<void> r) { done = std::move(r); });
    if (!run_until([&] { return done.has_value(); })) return error{"the pull never completed"};
    return *done;
  }
};

TEST_P(ucx_lease_test, later_pulls_read_under_the_lease_and_ranges_are_checked) {
  make_link();
  auto region = link_->allocate_region(1u << 20);
  testing::fill_pattern(region.memory(), 21);
  auto rig = connect();
  auto& puller = rig->puller;
  std::vector<std::byte> into(region.memory().size());
  auto r = pull(puller, region.describe_all(), into);
  ASSERT_TRUE(r.ok()) << r.err().message;
  EXPECT_EQ(xxhash64(into), xxhash64(region.memory()));
  EXPECT_EQ(link_->counters().bulk_served, 1u);
  EXPECT_EQ(link_->counters().leases_granted, 1u);
  EXPECT_EQ(puller.counters().pulls_by_lease, 0u) << "the first pull must ask the exporter";
  // Ranges inside the region: read under the lease, the exporter is not asked again.
  const std::pair<std::uint64_t, std::uint64_t> ranges[] = {
      {0, 8}, {4096, 65536}, {(1u << 20) - 24, 24}, {12345, 777}};
  for (auto [offset, length] : ranges) {
    std::vector<std::byte> part(length);
    r = pull(puller, region.describe(offset, length), part);
    ASSERT_TRUE(r.ok()) << r.err().message;
    EXPECT_TRUE(std::equal(part.begin(), part.end(), region.memory().begin() + offset))
        << "bytes [" << offset << ", +" << length << ")";
  }
  EXPECT_EQ(puller.counters().pulls_by_lease, 4u);
  EXPECT_EQ(link_->counters().bulk_served, 1u) << "a leased pull asked the exporter";
  // A range the lease does not cover fails here, without asking; another region is asked for
  // (and refused by the exporter).
  std::vector<std::byte> one(64);
  auto past_end = region.describe(0, 64);
  past_end.offset = (1u << 20) - 32;
  EXPECT_FALSE(pull(puller, past_end, one).ok());
  auto overflow = past_end;
  overflow.offset = ~0ull - 16;
  EXPECT_FALSE(pull(puller, overflow, one).ok());
  EXPECT_EQ(link_->counters().bulk_rejected, 0u);
  auto other = region.describe(0, 64);
  other.region += 1000;
  EXPECT_FALSE(pull(puller, other, one).ok());
  EXPECT_EQ(link_->counters().bulk_rejected, 1u);
  EXPECT_EQ(puller.counters().pulls_by_lease, 4u);
  EXPECT_EQ(link_->stats().malformed, 0u);
}

// From a peer on this host a get is a copy made on the link's thread: a big one goes in pieces
// of 4 MiB, each posted after the last (the thread's timers and messages run between them),
// the first pull (the grant) and those under the lease alike, every byte in its place.
TEST_P(ucx_lease_test, a_big_get_from_this_host_goes_in_pieces) {
  make_link();
  const std::size_t bytes = (10u << 20) + 123;  // 3 pieces
  auto region = link_->allocate_region(bytes);
  testing::fill_pattern(region.memory(), 5);
  auto rig = connect();
  auto& puller = rig->puller;
  std::vector<std::byte> into(bytes);
  auto r = pull(puller, region.describe_all(), into);
  ASSERT_TRUE(r.ok()) << r.err().message;
  EXPECT_EQ(xxhash64(into), xxhash64(region.memory()));
  EXPECT_EQ(puller.counters().get_pieces, 3u);
  std::vector<std::byte> part((5u << 20) + 1);
  r = pull(puller, region.describe(bytes - part.size(), part.size()), part);
  ASSERT_TRUE(r.ok()) << r.err().message;
  EXPECT_TRUE(std::equal(part.begin(), part.end(), region.memory().end() - part.size()));
  EXPECT_EQ(puller.counters().pulls_by_lease, 1u);
  EXPECT_EQ(puller.counters().get_pieces, 5u);
}

// Withdrawal: the exporter revokes the lease and keeps the memory mapped until the holder has
// released it (after the gets it started); later pulls are refused by the exporter.
TEST_P(ucx_lease_test, withdrawn_region_is_revoked_then_refused_and_freed_after_release) {
  make_link();
  auto region = std::make_optional(link_->allocate_region(1u << 20));
  testing::fill_pattern(region->memory(), 22);
  const auto sum = xxhash64(region->memory());
  const auto d = region->describe_all();
  auto rig = connect();
  auto& puller = rig->puller;
  std::vector<std::byte> into(d.length);
  ASSERT_TRUE(pull(puller, d, into).ok());
  // A leased pull and the withdrawal in the same turn: the get is issued before the revocation
  // can arrive, so it must read the region's bytes (still mapped), not freed memory.
  std::fill(into.begin(), into.end(), std::byte{0});
  std::optional<result<void>> done;
  puller.pull(d, into, [&](result<void> r) { done = std::move(r); });
  region.reset();
  EXPECT_EQ(link_->counters().withdrawn_held, 1u) << "a leased region was unmapped at once";
  EXPECT_EQ(link_->counters().leases_revoked, 1u);
  ASSERT_TRUE(run_until([&] { return done.has_value(); }));
  ASSERT_TRUE(done->ok()) << done->err().message;
  EXPECT_EQ(xxhash64(into), sum);
  EXPECT_EQ(puller.counters().pulls_by_lease, 1u);
  ASSERT_TRUE(run_until([&] { return link_->counters().withdrawn_held == 0; }))
      << "the holder never released the revoked lease";
  EXPECT_EQ(link_->counters().leases_released, 1u);
  // After the revocation the puller asks again and is refused.
  auto r = pull(puller, d, into);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.err().message.find("no such region"), std::string::npos) << r.err().message;
  EXPECT_EQ(puller.counters().pulls_by_lease, 1u);
  EXPECT_EQ(link_->counters().bulk_rejected, 1u);
  EXPECT_EQ(link_->stats().malformed, 0u);
}

// A holder that goes away without releasing (its process died) does not pin the memory.
TEST_P(ucx_lease_test, lost_holder_frees_the_withdrawn_region) {
  make_link();
  auto region = std::make_optional(link_->allocate_region(64u << 10));
  testing::fill_pattern(region->memory(), 23);
  auto rig = connect();
  std::vector<std::byte> into(region->memory().size());
  ASSERT_TRUE(pull(rig->puller, region->describe_all(), into).ok());
  region.reset();
  EXPECT_EQ(link_->counters().withdrawn_held, 1u);
  rig.reset();  // no goodbye, and the revocation is never read: as a crash
  ASSERT_TRUE(run_until([&] { return !losses_.empty(); }));
  EXPECT_EQ(link_->counters().withdrawn_held, 0u);
  EXPECT_EQ(link_->counters().leases_released, 0u);
}

// A revocation that overtakes its grant (the importer holds no lease when it arrives): the
// late grant is given back at once and its pull fails; nothing is read under it.
TEST_P(ucx_lease_test, grant_arriving_after_its_revocation_is_released_and_the_pull_fails) {
  make_link();
  auto region = link_->allocate_region(4096);
  testing::fill_pattern(region.memory(), 24);
  auto rig = connect();
  auto& puller = rig->puller;
  // As the exporter would after a withdrawal (am_bulk_revoke = 11, header: the region id).
  constexpr unsigned am_bulk_revoke = 11;
  const std::uint64_t id = region.id();
  link_->send_raw_for_tests(1, am_bulk_revoke, std::as_bytes(std::span(&id, 1)), {});
  run_until([] { return false; }, 50ms);
  std::vector<std::byte> into(4096);
  auto r = pull(puller, region.describe_all(), into);
  ASSERT_FALSE(r.ok()) << "a grant revoked before it arrived was used";
  EXPECT_NE(r.err().message.find("withdrawn"), std::string::npos) << r.err().message;
  EXPECT_EQ(link_->counters().leases_granted, 1u);
  ASSERT_TRUE(run_until([&] { return link_->counters().leases_released == 1; }))
      << "the late grant was never given back";
  EXPECT_EQ(puller.counters().pulls_by_lease, 0u);
  EXPECT_EQ(link_->stats().malformed, 0u);
  EXPECT_EQ(puller.stats().malformed, 0u);
}

INSTANTIATE_TEST_SUITE_P(transports, ucx_lease_test, ::testing::Values("shm", "tcp"));

// ---- big tensors, each path ------------------------------------------------------------------

struct tensor_case {
  std::string transport;  // shm | tcp
  bulk_path path;
  std::string memory;  // alloc: UCX allocates the region; user: the exporter's own vector
  // The full tensor_bytes() (1 GiB under meson test), once per transport; the other paths pull
  // at most 256 MiB (still 32 pieces): which path a pull takes does not depend on its size.
  bool full = false;
};

class ucx_tensor_test : public ::testing::TestWithParam<tensor_case> {};

// Node 0's link of a path test: over `transport` (UCX_TLS for the test's processes), pulling
// by `path`.
ucx_link_options node0_options(const std::string& transport, bulk_path path) {
  if (transport == "tcp") ::setenv("UCX_TLS", "tcp", 1);
  ucx_link_options o;
  o.self = 0;
  o.job_token = token;
  o.bulk = path;
  return o;
}

TEST_P(ucx_tensor_test, big_tensor_pulled_with_matching_checksum) {
  const auto& c = GetParam();
  const char* helper = std::getenv("MOEVEMENT_LINK_PEER");
  ASSERT_NE(helper, nullptr);
  asio::io_context io;
  ucx_link link(io, node0_options(c.transport, c.path));
  std::optional<test_message> region;
  std::optional<peer_loss> lost;
  link.set_handlers({[&](node_id, incoming_envelope env) { region = decode(env); },
                     [&](node_id, peer_loss why, const std::string&) { lost = why; }});
  const std::size_t bytes = c.full ? tensor_bytes() : capped_tensor_bytes();
  std::vector<std::string> args{
      helper, "export", std::to_string(link.port()), token, "8", std::to_string(bytes), c.memory};
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
  // In pieces of pull_piece_bytes: each read by RMA (the first asks the exporter, the next
  // ones read under its lease where it grants one), or none.
  const std::uint64_t piece = ucx_link_options{}.pull_piece_bytes;
  const std::uint64_t pieces = (bytes + piece - 1) / piece;
  const auto by_rma = link.counters().pulls_by_rma, by_lease = link.counters().pulls_by_lease;
  if (rma_expected) {
    EXPECT_GE(by_rma, 1u);
    EXPECT_EQ(by_rma + by_lease, pieces);
  } else {
    EXPECT_EQ(by_rma + by_lease, 0u);
  }
  EXPECT_EQ(link.counters().pull_pieces, pieces - 1);
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
                         ::testing::Values(tensor_case{"shm", bulk_path::rma, "alloc", true},
                                           tensor_case{"shm", bulk_path::rendezvous, "user"},
                                           tensor_case{"shm", bulk_path::automatic, "alloc"},
                                           // registered memory of our own: UCX 1.13 would
                                           // emulate a get of it through the FIFOs
                                           tensor_case{"shm", bulk_path::automatic, "user"},
                                           tensor_case{"tcp", bulk_path::rendezvous, "alloc", true},
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
  // A first pull completes (the exporter grants a lease); the killed pull is read under it.
  bool leased = false;
};
class ucx_kill_test : public ::testing::TestWithParam<kill_case> {};

TEST_P(ucx_kill_test, pull_fails_in_bounded_time_when_the_exporter_dies) {
  const auto& c = GetParam();
  const char* helper = std::getenv("MOEVEMENT_LINK_PEER");
  ASSERT_NE(helper, nullptr);
  asio::io_context io;
  ucx_link link(io, node0_options(c.transport, c.path));
  std::optional<test_message> region;
  std::optional<peer_loss> lost;
  link.set_handlers({[&](node_id, incoming_envelope env) { region = decode(env); },
                     [&](node_id peer, peer_loss why, const std::string&) {
                       lost = why;
                       // A failed connection keeps its pulls for a next one until the caller
                       // gives the peer up, as the actor layer does on the head's verdict.
                       if (why == peer_loss::crash) link.forget(peer);
                     }});
  std::vector<std::string> args{helper, "export", std::to_string(link.port()),
                                token,  "8",      std::to_string(capped_tensor_bytes()),
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
  if (c.leased) {
    link.pull(region->descriptor, into, [&](result<void> r) { done = std::move(r); });
    ASSERT_TRUE(run_until([&] { return done.has_value(); }, 60s));
    ASSERT_TRUE(done->ok()) << done->err().message;
    done.reset();
  }
  link.pull(region->descriptor, into, [&](result<void> r) { done = std::move(r); });
  if (c.delay_ms > 0) run_until([] { return false; }, std::chrono::milliseconds(c.delay_ms));
  if (c.leased) {
    // (the first pull's pieces after its first read under the lease too)
    ASSERT_EQ(link.counters().pulls_by_lease, link.counters().pull_pieces + 1)
        << "the second pull asked the exporter";
  } else {
    ASSERT_FALSE(done.has_value()) << "the pull finished before the kill; the test needs a "
                                      "bigger tensor (capped_tensor_bytes)";
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(run_until([&] { return done.has_value(); }, 10s))
      << "a pull from a dead peer never completed";
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  if (done->ok()) {
    // Success only with every exported byte: a leased get on shared memory may read the
    // importer's own mapping of the dead exporter's segment, and a rendezvous may have had all
    // its bytes sent (in the kernel's socket buffers) before the kill, the receiver behind
    // (seen once over TCP in the sanitizer build, 5 ms after the start).
    EXPECT_EQ(xxhash64(into), region->checksum) << "a pull from a killed peer read junk";
  }
  std::printf("pull completed %lld ms after the kill: %s\n", static_cast<long long>(ms),
              done->ok() ? "ok" : done->err().message.c_str());
  ASSERT_TRUE(run_until([&] { return lost.has_value(); }, 10s));
  EXPECT_EQ(*lost, peer_loss::crash);
  EXPECT_EQ(link.counters().pulls_failed, done->ok() ? 0u : 1u);
  ::unsetenv("UCX_TLS");
}

INSTANTIATE_TEST_SUITE_P(paths, ucx_kill_test,
                         ::testing::Values(kill_case{"shm", bulk_path::rendezvous, 0},
                                           kill_case{"shm", bulk_path::rma, 0},
                                           kill_case{"tcp", bulk_path::rendezvous, 0},
                                           kill_case{"tcp", bulk_path::rendezvous, 5},
                                           kill_case{"shm", bulk_path::rma, 0, true},
                                           kill_case{"tcp", bulk_path::rma, 0, true}),
                         [](const auto& info) {
                           return info.param.transport + "_" +
                                  (info.param.path == bulk_path::rma ? "rma" : "rendezvous") +
                                  (info.param.leased ? "_leased" : "") + "_after_" +
                                  std::to_string(info.param.delay_ms) + "ms";
                         });

}  // namespace
}  // namespace moevement::transport
