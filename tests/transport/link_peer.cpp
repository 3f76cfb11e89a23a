// The other process of the multi-process link tests. It connects to the test process (node 0)
// over 127.0.0.1 and plays one role:
//   link_peer echo      PORT TOKEN NODE            echo every "echo" message; goodbye on "bye"
//   link_peer redial    PORT TOKEN NODE            echo; on "break" fail its connections to
//                                                  node 0, then revive it and dial again
//   link_peer export    PORT TOKEN NODE BYTES KIND [redial]
//                                                  export BYTES (KIND: alloc|user) filled with
//                                                  a pattern, send its descriptor + checksum,
//                                                  serve pulls until the test says goodbye
//                                                  (redial: a failed connection is dialled
//                                                  again, as in mode redial)
//   link_peer flood     PORT TOKEN NODE            sends "flood" envelopes of 8000 bytes to
//                                                  node 0 without pause (until killed)
//   link_peer intruder  PORT TOKEN NODE            expects to be refused (wrong token)
//   link_peer malformed PORT TOKEN NODE            sends a corpus of malformed input, then
//                                                  pulls with bad descriptors, then reports
// Exit status: 0 when the role went as expected, 1 otherwise (the test checks it).
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>

#include "base/hash.hpp"
#include "tests/transport/link_test_util.hpp"
#include "transport/ucx_link.hpp"

using namespace moevement;
using namespace moevement::transport;
using namespace moevement::transport::testing;

namespace {

int usage() {
  std::fprintf(stderr, "usage: link_peer MODE PORT TOKEN NODE [BYTES KIND]\n");
  return 2;
}

void say(const char* what) {
  std::fprintf(stderr, "link_peer[%d]: %s\n", ::getpid(), what);
}

// The malformed-input corpus, sent as raw active messages of the link's own protocol. Returns
// how many the receiver must count as malformed (the rest are bulk requests it must reject).
std::uint64_t send_corpus(ucx_link& link) {
  std::mt19937_64 rng(4);
  std::uint64_t expected = 0;
  auto raw = [&](unsigned am, std::vector<std::byte> header, std::vector<std::byte> data) {
    link.send_raw_for_tests(0, am, header, data);
  };
  auto noise = [&](std::size_t n) {
    std::vector<std::byte> v(n);
    for (auto& b : v) b = std::byte(rng());
    return v;
  };
  constexpr unsigned am_hello = 1, am_envelope = 4, am_bulk_request = 6, am_bulk_data = 7,
                     am_bulk_rkey = 8;
  // Random envelopes of whole words and of ragged lengths.
  for (int i = 0; i < 40; ++i) {
    raw(am_envelope, {}, noise(8 * (1 + rng() % 64)));
    ++expected;
  }
  for (int i = 0; i < 10; ++i) {
    raw(am_envelope, {}, noise(1 + rng() % 7 + 8 * (rng() % 4)));
    ++expected;
  }
  // Every truncation of a valid envelope.
  test_message m{"valid", 1, noise(40), {}, 0, {1, 2, 3}};
  auto words = encode(link.self(), 0, m);
  const auto full = std::as_bytes(std::span(words.begin(), words.size()));
  for (std::size_t len = 8; len < full.size(); len += 8) {
    raw(am_envelope, {},
        std::vector<std::byte>(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(len)));
    ++expected;
  }
  // Oversized counts: a segment table claiming 2^32-16 segments, and one segment claiming
  // 2^31 words.
  {
    auto v = std::vector<std::byte>(full.begin(), full.end());
    const std::uint32_t segs = 0xfffffff0u;
    std::memcpy(v.data(), &segs, 4);
    raw(am_envelope, {}, v);
    ++expected;
    const std::uint32_t words1 = 0x80000000u;
    v.assign(full.begin(), full.end());
    std::memcpy(v.data() + 4, &words1, 4);
    raw(am_envelope, {}, v);
    ++expected;
  }
  // Larger than the receiver's decode limit (the test lowers it to 1 MiB): by rendezvous.
  raw(am_envelope, {}, std::vector<std::byte>(2u << 20));
  ++expected;
  // A second hello on an admitted connection, and one with a garbage header.
  raw(am_hello, noise(16), noise(8));
  ++expected;
  // Bulk messages with headers of the wrong size, and replies to requests never made.
  raw(am_bulk_request, noise(5), {});
  ++expected;
  raw(am_bulk_data, noise(40), noise(64));
  ++expected;
  raw(am_bulk_rkey, noise(40), noise(64));
  ++expected;
  raw(am_bulk_data, noise(3), {});
  ++expected;
  // Lease messages: a release of a region never granted to us, one of the wrong size, and a
  // lease answering nothing.
  constexpr unsigned am_bulk_lease = 10, am_bulk_release = 12;
  const std::uint64_t never_granted = 1u << 30;
  std::vector<std::byte> release_header(8);
  std::memcpy(release_header.data(), &never_granted, 8);
  raw(am_bulk_release, release_header, {});
  ++expected;
  raw(am_bulk_release, noise(5), {});
  ++expected;
  raw(am_bulk_lease, noise(40), noise(64));
  ++expected;
  return expected;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) return usage();
  const std::string mode = argv[1];
  const auto port = static_cast<std::uint16_t>(std::stoi(argv[2]));
  asio::io_context io;
  ucx_link_options opt;
  opt.self = static_cast<node_id>(std::stoul(argv[4]));
  opt.job_token = argv[3];
  ucx_link link(io, opt);
  link.add_peer(0, "127.0.0.1", port);
  int status = 1;
  auto finish = [&](int s) {
    status = s;
    io.stop();
  };
  const node_id me = link.self();

  bulk_region region;
  std::vector<std::byte> user_memory;
  bulk_descriptor parent_region;
  std::uint64_t corpus_expected = 0;
  std::vector<std::uint64_t> pull_results;  // 1: failed as it should, 0: wrongly succeeded
  std::vector<std::byte> pull_buffer;

  link.set_handlers(link_handlers{
      [&](node_id from, incoming_envelope env) {
        auto m = decode(env);
        if ((mode == "echo" || mode == "redial") && m.kind == "echo") {
          (void)link.send(from, encode(me, from, m));
        } else if (mode == "redial" && m.kind == "break") {
          asio::post(io, [&link] { link.fail_connections_for_tests(0); });
        } else if (m.kind == "bye") {
          link.say_goodbye();
          // Leave time for the goodbye to flush; the destructor flushes too.
          auto t = std::make_shared<asio::steady_timer>(io, std::chrono::milliseconds(50));
          t->async_wait([t, &finish](const std::error_code&) { finish(0); });
        } else if (mode == "malformed" && m.kind == "region") {
          parent_region = m.descriptor;
          corpus_expected = send_corpus(link);
          // Bad descriptors: no such region, past the end, overflowing, and zero length
          // (refused locally), then one good pull that must still work.
          const auto d = parent_region;
          const bulk_descriptor bad[] = {
              {0, d.region + 1000, 0, 64},
              {0, d.region, d.length - 8, 64},
              {0, d.region, ~0ull - 16, 64},
              {0, d.region, 0, d.length + 1},
          };
          pull_buffer.resize(d.length + 1);
          for (const auto& b : bad) {
            link.pull(b, std::span(pull_buffer).first(b.length),
                      [&](result<void> r) { pull_results.push_back(r.ok() ? 0 : 1); });
          }
          link.pull(d, std::span(pull_buffer).first(d.length),
                    [&, d, sum_expected = m.checksum](result<void> r) {
                      const auto sum = xxhash64(std::span(pull_buffer).first(d.length));
                      pull_results.push_back(r.ok() && sum == sum_expected ? 1 : 0);
                      test_message report{"report", 0, {}, {}, corpus_expected, pull_results};
                      (void)link.send(0, encode(me, 0, report));
                    });
        }
      },
      [&](node_id, peer_loss why, const std::string& detail) {
        say(detail.c_str());
        if (mode == "intruder") {
          finish(detail.find("refused") != std::string::npos ? 0 : 1);
        } else if ((mode == "redial" || (argc > 7 && std::string(argv[7]) == "redial")) &&
                   why == peer_loss::crash) {
          link.revive(0);  // a failed connection, not a lost peer: dial again, lose nothing
          (void)link.send(0, encode(me, 0, make("back")));  // (heartbeats would dial in a job)
        } else {
          finish(why == peer_loss::goodbye ? 0 : 1);
        }
      }});

  if (mode == "export") {
    if (argc < 7) return usage();
    const std::size_t bytes = std::stoull(argv[5]);
    std::span<std::byte> mem;
    if (std::string(argv[6]) == "alloc") {
      region = link.allocate_region(bytes);
      mem = region.memory();
    } else {
      user_memory.resize(bytes);
      mem = user_memory;
    }
    fill_pattern(mem, 0x5eed);
    if (!region.id()) region = link.export_region(mem);
    test_message m{"region", 0, {}, region.describe_all(), xxhash64(mem), {}};
    if (!link.send(0, encode(me, 0, m)).ok()) return 1;
  } else {
    if (!link.send(0, encode(me, 0, test_message{"ready", 0, {}, {}, 0, {}})).ok()) return 1;
  }

  // Flooding: 64 envelopes per turn of the loop, for as long as the process lives (the test
  // kills it mid-send). Each turn is posted, so the link's own handlers run in between.
  std::function<void()> flood_turn = [&] {
    std::vector<std::byte> blob(8000);
    fill_pattern(blob, 3);
    for (int i = 0; i < 64; ++i) (void)link.send(0, encode(me, 0, make("flood", i, blob)));
    asio::post(io, flood_turn);
  };
  if (mode == "flood") asio::post(io, flood_turn);

  // Bounded: a helper never outlives a broken test by more than a minute.
  asio::steady_timer limit(io, std::chrono::seconds(60));
  limit.async_wait([&](const std::error_code& ec) {
    if (!ec) {
      say("timed out");
      finish(1);
    }
  });
  io.run();
  return status;
}
