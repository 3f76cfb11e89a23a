// `moevement bench transport`: ucx_link against ucx_perftest, same machine, same run.
//
// For each transport (shared memory: UCX's default on one host; TCP: UCX_TLS=tcp) it runs
//   latency   ours: ping-pong of envelopes carrying 8 bytes (seq), half the round trip, median
//             theirs: ucx_perftest -t ucp_am_lat -s 8 (median)
//   msg rate  ours: a burst of such envelopes one way, counted by the peer
//             theirs: ucx_perftest -t ucp_am_bw -s 8 (overall message rate)
//   bandwidth ours: pull() of a bulk region of SIZE (the automatic path: RMA get on shared
//             memory, active-message rendezvous on TCP), repeated, into one buffer
//             theirs: the same UCP operation in ucx_perftest: -t ucp_get on shared memory,
//             -t ucp_am_bw on TCP
// and prints `<metric>: ours=<v> theirs=<v> ratio=<r>` (better-is-higher: theirs/ours for
// latency). With --admission it times instead one admission dial over loopback TCP in this
// process (ours: ucx_link_admission's four frames, two HMAC-SHA256 proofs, the name resolved
// off the loop; theirs: the one round trip every admission costs at least: connect, 64 bytes
// each way, close; the exchange protocol 1 made, which sent the token itself) and prints
// `admission_dial_us: ours=<median> theirs=<median> ratio=theirs/ours`.
// Usage: bench_transport [--quick] [--no-1g] [--transport shm|tcp] [--no-lease]
// [--no-yield] [--spin US] [--ours-only] [--repeat N] [--admission]. --no-lease: every pull asks
// the exporter first (ucx_link_options::lease_regions off, the behaviour before leases);
// --no-yield: the spin does not yield the core (spin_yield off, as before); --spin US: the spin
// window's bound (ucx_link_options::spin) in both processes; --ours-only: skip ucx_perftest (and
// print the median time of one pull too, which preemption spells do not move);
// --repeat N: N alternating runs of ours and theirs, each figure the median of its N.
#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/read.hpp>
#include <asio/write.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/transport_bench.capnp.h"
#include "bench/ucx_perftest.hpp"
#include "transport/ucx_link.hpp"
#include "transport/ucx_link_admission.hpp"

extern char** environ;

namespace {

using namespace moevement;
using namespace moevement::transport;
using clock_type = std::chrono::steady_clock;

constexpr char token[] = "bench-token";

enum kind : std::uint8_t {
  k_ready = 1,
  k_ping,
  k_pong,
  k_rate,
  k_rate_done,
  k_export,
  k_exported,
  k_release,
  k_bye
};

kj::Array<capnp::word> message(node_id from, node_id to, kind k, std::uint64_t value,
                               const bulk_descriptor& d = {}) {
  outgoing_envelope out({{from, 1, 1}, {to, 1, 1}, 0, 0, 0});
  auto p = out.init_payload<wire::bench::BenchMessage>();
  p.setKind(k);
  p.setValue(value);
  write_descriptor(p.initDescriptor(), d);
  return out.to_words();
}

struct decoded {
  kind k;
  std::uint64_t value;
  bulk_descriptor d;
};
decoded read(const incoming_envelope& env) {
  auto p = env.payload<wire::bench::BenchMessage>().value();
  auto d = p.getDescriptor();
  return {static_cast<kind>(p.getKind()),
          p.getValue(),
          {d.getNode(), d.getRegion(), d.getOffset(), d.getLength()}};
}

// ---- the peer process --------------------------------------------------------------------------

// What our side runs with (the options the flags change; the rest are the defaults).
struct our_settings {
  bool lease = true;
  bool yield = true;
  long spin_us = -1;  // -1: ucx_link_options' default
  void apply(ucx_link_options& o) const {
    o.lease_regions = lease;
    o.spin_yield = yield;
    if (spin_us >= 0) o.spin = std::chrono::microseconds(spin_us);
  }
};

int run_peer(std::uint16_t port, const our_settings& set) {
  asio::io_context io;
  ucx_link_options o;
  o.self = 1;
  o.job_token = token;
  set.apply(o);
  ucx_link link(io, o);
  link.add_peer(0, "127.0.0.1", port);
  std::optional<bulk_region> region;
  std::uint64_t rate_count = 0;
  link.set_handlers({[&](node_id, incoming_envelope env) {
                       const auto m = read(env);
                       switch (m.k) {
                         case k_ping:
                           (void)link.send(0, message(1, 0, k_pong, m.value));
                           break;
                         case k_rate:
                           if (++rate_count == m.value) {
                             (void)link.send(0, message(1, 0, k_rate_done, rate_count));
                             rate_count = 0;
                           }
                           break;
                         case k_export: {
                           region = link.allocate_region(m.value);
                           auto mem = region->memory();
                           for (std::size_t i = 0; i < mem.size(); i += 4096)
                             mem[i] = std::byte(i >> 12);
                           (void)link.send(0, message(1, 0, k_exported, 0, region->describe_all()));
                           break;
                         }
                         case k_release:
                           region.reset();
                           break;
                         case k_bye:
                           link.say_goodbye();
                           io.stop();
                           break;
                         default:
                           break;
                       }
                     },
                     [&](node_id, peer_loss, const std::string&) { io.stop(); }});
  (void)link.send(0, message(1, 0, k_ready, 0));
  io.run();
  return 0;
}

// ---- ours --------------------------------------------------------------------------------------

struct numbers {
  double latency_us = 0;
  double latency_sleep_us = 0;  // theirs: ucx_perftest -E sleep (waits on events, like ours)
  double rate_mps = 0;
  std::vector<double> bw_gbps;      // per size
  std::vector<double> pull_p50_us;  // ours, per size: the median pull (robust to preemption)
};

numbers run_ours(const std::vector<std::size_t>& sizes, bool quick, const our_settings& set) {
  asio::io_context io;
  ucx_link_options o;
  o.self = 0;
  o.job_token = token;
  set.apply(o);
  ucx_link link(io, o);
  std::vector<decoded> inbox;
  std::optional<std::string> gone;
  link.set_handlers({[&](node_id, incoming_envelope env) { inbox.push_back(read(env)); },
                     [&](node_id, peer_loss, const std::string& d) { gone = d; }});
  const std::string self = std::filesystem::read_symlink("/proc/self/exe");
  std::vector<std::string> args{self, "--peer", std::to_string(link.port()),
                                set.yield ? "yield" : "no-yield", std::to_string(set.spin_us)};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (::posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv.data(), environ) != 0) {
    throw std::runtime_error("cannot start the bench peer");
  }
  auto wait_for = [&](kind k) {
    const auto deadline = clock_type::now() + std::chrono::seconds(120);
    for (;;) {
      for (auto it = inbox.begin(); it != inbox.end(); ++it) {
        if (it->k == k) {
          auto m = *it;
          inbox.erase(it);
          return m;
        }
      }
      if (gone) throw std::runtime_error("bench peer lost: " + *gone);
      if (clock_type::now() > deadline) throw std::runtime_error("bench peer went silent");
      io.restart();
      io.run_one_for(std::chrono::milliseconds(10));
    }
  };
  wait_for(k_ready);
  numbers n;

  // Latency: one ping in flight; each pong triggers the next ping from the handler's loop.
  {
    const int iters = quick ? 2000 : 20000;
    std::vector<double> half_rtt;
    half_rtt.reserve(iters);
    for (int i = 0; i < iters + iters / 10; ++i) {
      const auto t0 = clock_type::now();
      (void)link.send(1, message(0, 1, k_ping, i));
      while (inbox.empty()) {
        io.restart();
        io.run_one();
      }
      inbox.clear();
      if (i >= iters / 10) {  // the first tenth warms up
        half_rtt.push_back(
            std::chrono::duration<double, std::micro>(clock_type::now() - t0).count() / 2);
      }
    }
    std::nth_element(half_rtt.begin(), half_rtt.begin() + half_rtt.size() / 2, half_rtt.end());
    n.latency_us = half_rtt[half_rtt.size() / 2];
  }
  // Message rate: a burst, the peer answers after the last one (per-peer FIFO).
  {
    const std::uint64_t count = quick ? 20000 : 200000;
    const auto t0 = clock_type::now();
    for (std::uint64_t i = 0; i < count; ++i) (void)link.send(1, message(0, 1, k_rate, count));
    wait_for(k_rate_done);
    n.rate_mps = count / std::chrono::duration<double>(clock_type::now() - t0).count() / 1e6;
  }
  // Bandwidth: pulls of an exported region into one (pre-touched) buffer.
  for (std::size_t size : sizes) {
    (void)link.send(1, message(0, 1, k_export, size));
    const auto d = wait_for(k_exported).d;
    std::vector<std::byte> into(size, std::byte{1});
    const int reps = std::max<int>(2, static_cast<int>(((quick ? 256ull : 2048ull) << 20) / size));
    double seconds = 0;
    std::vector<double> each_us;
    for (int r = 0; r < reps + 1; ++r) {
      std::optional<result<void>> done;
      const auto t0 = clock_type::now();
      link.pull(d, into, [&](result<void> res) { done = std::move(res); });
      while (!done) {
        io.restart();
        io.run_one();
      }
      if (!done->ok()) throw std::runtime_error("pull failed: " + done->err().message);
      const auto dt = std::chrono::duration<double>(clock_type::now() - t0).count();
      if (r > 0) {
        seconds += dt;
        each_us.push_back(dt * 1e6);
      }
    }
    n.bw_gbps.push_back(static_cast<double>(size) * reps / seconds / 1e9);
    std::nth_element(each_us.begin(), each_us.begin() + each_us.size() / 2, each_us.end());
    n.pull_p50_us.push_back(each_us[each_us.size() / 2]);
    (void)link.send(1, message(0, 1, k_release, 0));
  }
  (void)link.send(1, message(0, 1, k_bye, 0));
  int status = 0;
  const auto deadline = clock_type::now() + std::chrono::seconds(10);
  while (::waitpid(pid, &status, WNOHANG) == 0 && clock_type::now() < deadline) {
    io.restart();
    io.run_for(std::chrono::milliseconds(5));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return n;
}

// ---- theirs: ucx_perftest ----------------------------------------------------------------------

using moevement::bench::perftest;

numbers run_theirs(bool tcp, const std::vector<std::size_t>& sizes, bool quick) {
  static int next_port = 20000 + ::getpid() % 20000;  // fresh ports for each repeat
  int port = next_port;
  next_port += 8;
  numbers n;
  n.latency_us = perftest("ucp_am_lat", 8, quick ? 2000 : 20000, port++)[1];
  n.latency_sleep_us = perftest("ucp_am_lat", 8, quick ? 2000 : 20000, port++, "-E sleep")[1];
  n.rate_mps = perftest("ucp_am_bw", 8, quick ? 20000 : 200000, port++)[7] / 1e6;
  for (std::size_t size : sizes) {
    const long reps =
        std::max<long>(2, static_cast<long>(((quick ? 256ull : 2048ull) << 20) / size));
    const auto f = perftest(tcp ? "ucp_am_bw" : "ucp_get", size, reps, port++);
    n.bw_gbps.push_back(f[5] * 1e6 / 1e9 * 1.048576);  // perftest's MB is 2^20 bytes
  }
  return n;
}

// The median of each figure over repeated runs (odd counts: a figure of one of the runs).
numbers median(std::vector<numbers> runs) {
  auto mid = [&](auto get) {
    std::vector<double> v;
    for (auto& r : runs) v.push_back(get(r));
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  numbers m;
  m.latency_us = mid([](const numbers& n) { return n.latency_us; });
  m.latency_sleep_us = mid([](const numbers& n) { return n.latency_sleep_us; });
  m.rate_mps = mid([](const numbers& n) { return n.rate_mps; });
  for (std::size_t i = 0; i < runs[0].bw_gbps.size(); ++i) {
    m.bw_gbps.push_back(mid([i](const numbers& n) { return n.bw_gbps[i]; }));
    if (!runs[0].pull_p50_us.empty()) {
      m.pull_p50_us.push_back(mid([i](const numbers& n) { return n.pull_p50_us[i]; }));
    }
  }
  return m;
}

std::string size_name(std::size_t s) {
  return s >= (1u << 30) ? fmt::format("{}GiB", s >> 30) : fmt::format("{}MiB", s >> 20);
}

}  // namespace

// ---- admission: one dial, ours against one plain round trip ------------------------------------

// The median of `dials` dials, in microseconds, each run to its end by `dial_once` on `io`.
template <class Dial>
double median_dial_us(asio::io_context& io, int dials, Dial dial_once) {
  std::vector<double> us;
  for (int i = 0; i < dials; ++i) {
    bool done = false;
    const auto t0 = clock_type::now();
    dial_once([&] { done = true; });
    while (!done) io.run_one();
    us.push_back(std::chrono::duration<double, std::micro>(clock_type::now() - t0).count());
  }
  std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
  return us[us.size() / 2];
}

int run_admission(int rounds) {
  using asio::ip::tcp;
  asio::io_context io;
  const std::vector<std::byte> address(300, std::byte{7});  // a UCX worker address's size
  auto listener = detail::admission_listener::start(
      io, "127.0.0.1", 0, {std::chrono::seconds(5), 64, 64, 0, token},
      [&](const detail::admission_request&, const std::string&) {
        return detail::admission_reply{0, detail::admission_verdict::admitted, address, address, 1};
      },
      [](detail::admission_refusal, const std::string&) {});
  // Theirs: a server that reads 64 bytes and answers 64.
  tcp::acceptor plain(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  std::function<void()> serve_plain = [&] {
    plain.async_accept([&](std::error_code ec, tcp::socket s) {
      if (ec) return;
      auto sock = std::make_shared<tcp::socket>(std::move(s));
      auto buf = std::make_shared<std::array<char, 64>>();
      asio::async_read(*sock, asio::buffer(*buf), [sock, buf](std::error_code e, std::size_t) {
        if (!e) asio::async_write(*sock, asio::buffer(*buf), [sock, buf](auto, auto) {});
      });
      serve_plain();
    });
  };
  serve_plain();
  const auto plain_port = plain.local_endpoint().port();
  const auto ours_once = [&](auto done) {
    detail::admission_dial(io, 0, "127.0.0.1", listener->port(), token, {1, address, address, 2},
                           std::chrono::seconds(5), [done](result<detail::admission_reply> r) {
                             if (!r.ok()) throw std::runtime_error(r.err().message);
                             done();
                           });
  };
  const auto theirs_once = [&](auto done) {
    auto s = std::make_shared<tcp::socket>(io);
    auto buf = std::make_shared<std::array<char, 64>>();
    s->async_connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), plain_port),
                     [s, buf, done](std::error_code ec) {
                       if (ec) throw std::runtime_error("plain connect: " + ec.message());
                       asio::async_write(*s, asio::buffer(*buf), [s, buf, done](auto, auto) {
                         asio::async_read(*s, asio::buffer(*buf), [s, buf, done](auto, auto) {
                           std::error_code ignored;
                           s->close(ignored);
                           done();
                         });
                       });
                     });
  };
  std::vector<double> ours, theirs;
  for (int r = 0; r < rounds; ++r) {  // alternating blocks: both see the same load
    ours.push_back(median_dial_us(io, 100, ours_once));
    theirs.push_back(median_dial_us(io, 100, theirs_once));
  }
  std::sort(ours.begin(), ours.end());
  std::sort(theirs.begin(), theirs.end());
  const double o = ours[ours.size() / 2], t = theirs[theirs.size() / 2];
  std::printf("admission_dial_us: ours=%.1f theirs=%.1f ratio=%.3f\n", o, t, t / o);
  listener->close();
  return 0;
}

int main(int argc, char** argv) {
  try {
    if (argc >= 5 && std::string(argv[1]) == "--peer") {
      our_settings set;
      set.yield = std::string(argv[3]) == "yield";
      set.spin_us = std::stol(argv[4]);
      return run_peer(static_cast<std::uint16_t>(std::stoi(argv[2])), set);
    }
    our_settings set;
    bool quick = false, with_1g = true, ours_only = false, admission = false;
    int repeat = 1;
    std::vector<std::string> transports{"shm", "tcp"};
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--quick") {
        quick = true;
        with_1g = false;
      } else if (a == "--no-1g") {
        with_1g = false;
      } else if (a == "--no-yield") {
        set.yield = false;
      } else if (a == "--spin" && i + 1 < argc) {
        set.spin_us = std::max(0L, std::stol(argv[++i]));
      } else if (a == "--no-lease") {
        set.lease = false;
      } else if (a == "--ours-only") {
        ours_only = true;
      } else if (a == "--admission") {
        admission = true;
      } else if (a == "--repeat" && i + 1 < argc) {
        const std::string v = argv[++i];
        if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos || v.size() > 6 ||
            std::stoi(v) < 1) {
          std::fprintf(stderr, "bench_transport: --repeat takes a whole number >= 1, not '%s'\n",
                       v.c_str());
          return 2;
        }
        repeat = std::stoi(v);
      } else if (a == "--transport" && i + 1 < argc &&
                 (std::string_view(argv[i + 1]) == "shm" ||
                  std::string_view(argv[i + 1]) == "tcp")) {
        transports = {argv[++i]};
      } else {
        std::fprintf(stderr,
                     "usage: bench_transport [--quick] [--no-1g] [--transport shm|tcp] "
                     "[--no-lease] [--no-yield] [--spin US] [--ours-only] [--repeat N] "
                     "[--admission]\n");
        return 2;
      }
    }
    if (admission) return run_admission(quick ? 3 : 5 * repeat);
    std::vector<std::size_t> sizes{4u << 20, 64u << 20};
    if (with_1g) sizes.push_back(1u << 30);
    for (const auto& t : transports) {
      const bool tcp = t == "tcp";
      if (tcp) {
        ::setenv("UCX_TLS", "tcp", 1);
      } else {
        ::unsetenv("UCX_TLS");
      }
      // Ours and theirs alternate, so that both see the same spells of machine load.
      std::vector<numbers> our_runs, their_runs;
      for (int r = 0; r < repeat; ++r) {
        our_runs.push_back(run_ours(sizes, quick, set));
        if (!ours_only) their_runs.push_back(run_theirs(tcp, sizes, quick));
      }
      const numbers ours = median(our_runs);
      if (ours_only) {
        std::printf("transport_%s_latency_8B_us: ours=%.3f\n", t.c_str(), ours.latency_us);
        std::printf("transport_%s_msg_rate_8B_Mmsg_per_s: ours=%.4f\n", t.c_str(), ours.rate_mps);
        for (std::size_t i = 0; i < sizes.size(); ++i) {
          std::printf("transport_%s_bandwidth_%s_GB_per_s: ours=%.3f\n", t.c_str(),
                      size_name(sizes[i]).c_str(), ours.bw_gbps[i]);
          std::printf("transport_%s_pull_%s_median_us: ours=%.1f\n", t.c_str(),
                      size_name(sizes[i]).c_str(), ours.pull_p50_us[i]);
        }
        continue;
      }
      const numbers theirs = median(their_runs);
      std::printf("transport_%s_latency_8B_us: ours=%.3f theirs=%.3f ratio=%.3f\n", t.c_str(),
                  ours.latency_us, theirs.latency_us, theirs.latency_us / ours.latency_us);
      std::printf("transport_%s_latency_8B_sleep_us: ours=%.3f theirs=%.3f ratio=%.3f\n", t.c_str(),
                  ours.latency_us, theirs.latency_sleep_us,
                  theirs.latency_sleep_us / ours.latency_us);
      std::printf("transport_%s_msg_rate_8B_Mmsg_per_s: ours=%.4f theirs=%.4f ratio=%.3f\n",
                  t.c_str(), ours.rate_mps, theirs.rate_mps, ours.rate_mps / theirs.rate_mps);
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        std::printf("transport_%s_bandwidth_%s_GB_per_s: ours=%.3f theirs=%.3f ratio=%.3f\n",
                    t.c_str(), size_name(sizes[i]).c_str(), ours.bw_gbps[i], theirs.bw_gbps[i],
                    ours.bw_gbps[i] / theirs.bw_gbps[i]);
      }
      std::fflush(stdout);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_transport: %s\n", e.what());
    return 1;
  }
}
