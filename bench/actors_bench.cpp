// `moevement bench actors`: our actor runtime against CAF 0.17.6 in the same run.
//   request_response_rt_per_s  one client actor asks one server actor, one ask outstanding
//                              (ours: ask with a deadline; CAF: request(...).then chained)
//   one_way_msgs_per_s         one sender tells one receiver N messages
//   <tls>_ping_pong_latency_us cross-process: an ask from node 0 to a server actor spawned by
//                              name on node 1 (another process, ucx_link over 127.0.0.1), half
//                              the round trip, median; against ucx_perftest -t ucp_am_lat -s 8
//                              (median) on the same transport (shm: UCX's default on one host;
//                              tcp: UCX_TLS=tcp). ratio = theirs/ours (latency: lower is better).
// Ours runs on one io_context thread (the design); CAF runs with its default scheduler.
// Usage: bench_actors [round_trips] [messages] [pings]     (bench_actors --peer PORT: node 1)
#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <caf/all.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <thread>

#include "actors/system.hpp"
#include "bench/actors_bench.capnp.h"
#include "bench/ucx_perftest.hpp"
#include "transport/loopback_link.hpp"
#include "transport/ucx_link.hpp"

extern char** environ;

namespace {

using namespace moevement;
using namespace moevement::actors;
using moevement::bench::Note;
using moevement::bench::Num;
using moevement::bench::Ran;
using moevement::bench::Run;
using std::chrono::duration;

double seconds_since(clock::time_point t0) {
  return duration<double>(clock::now() - t0).count();
}

// ---- ours ----------------------------------------------------------------------------------

class server : public actor {
 public:
  using interface = actors::interface<ask_t<Num, Num>, tell_t<Note>>;
  server() {
    on<Num, Num>(&server::inc);
    on<Note>(&server::count);
  }
  std::uint64_t received = 0;

 private:
  awaitable<void> inc(Num::Reader m, Num::Builder out) {
    out.setValue(m.getValue() + 1);
    co_return;
  }
  awaitable<void> count(Note::Reader) {
    ++received;
    co_return;
  }
};

class client : public actor {
 public:
  using interface = actors::interface<ask_t<Run, Ran>>;
  explicit client(actor_ref srv) : server_(srv) { on<Run, Ran>(&client::run); }

 private:
  awaitable<void> run(Run::Reader m, Ran::Builder out) {
    const std::uint64_t n = m.getCount();
    std::int64_t v = 0;
    for (std::uint64_t i = 0; i < n; ++i) {
      auto r = co_await ask<Num, Num>(server_, std::chrono::seconds(10),
                                      [v](Num::Builder b) { b.setValue(v); });
      if (!r.ok()) throw std::runtime_error(r.err().message);
      v = r->get().getValue();
    }
    out.setCount(static_cast<std::uint64_t>(v));
  }
  actor_ref server_;
};

template <class Body>
void run_ours(Body body) {
  asio::io_context io;
  transport::loopback_hub hub(io);
  auto link = hub.attach(1);
  actor_system sys(io, *link);
  asio::co_spawn(io, body(sys), [&](std::exception_ptr e) {
    sys.shutdown();
    if (e) std::rethrow_exception(e);
  });
  io.run();
}

double ours_round_trips(std::uint64_t n) {
  double rate = 0;
  run_ours([&](actor_system& sys) -> awaitable<void> {
    auto srv = sys.spawn<server>();
    auto cli = sys.spawn<client>(srv.ref);
    const auto t0 = clock::now();
    auto r =
        co_await cli.ask<Run>(std::chrono::seconds(600), [n](Run::Builder b) { b.setCount(n); });
    const double s = seconds_since(t0);
    if (!r.ok() || r->get().getCount() != n) throw std::runtime_error("round trips failed");
    rate = static_cast<double>(n) / s;
  });
  return rate;
}

double ours_one_way(std::uint64_t n) {
  double rate = 0;
  run_ours([&](actor_system& sys) -> awaitable<void> {
    auto srv = sys.spawn<server>();
    auto* s = sys.local_actor<server>(srv);  // read the count at the end, on this thread
    auto ex = co_await asio::this_coro::executor;
    const auto t0 = clock::now();
    std::uint64_t sent = 0;
    while (sent < n) {
      // Send until the bounded mailbox refuses, then let the receiver drain it.
      if (srv.tell<Note>([sent](Note::Builder b) { b.setValue(static_cast<std::int64_t>(sent)); })
              .ok()) {
        ++sent;
        continue;
      }
      co_await asio::post(ex, asio::use_awaitable);
    }
    while (s->received < n) {
      co_await asio::post(ex, asio::use_awaitable);
    }
    rate = static_cast<double>(n) / seconds_since(t0);
  });
  return rate;
}

// ---- ours, across processes ----------------------------------------------------------------

constexpr char token[] = "bench-actors-token";

// Node 1: serves `server` actors by name until the head leaves.
int run_peer(std::uint16_t port) {
  asio::io_context io(1);
  transport::ucx_link_options o;
  o.self = 1;
  o.job_token = token;
  transport::ucx_link link(io, o);
  link.add_peer(0, "127.0.0.1", port);
  actor_system sys(io, link, {.incarnation = 1, .head = 0});
  sys.register_type<server>("server");
  bool done = false;
  int status = 0;
  sys.on_membership([&](transport::node_id n, member_event e) {
    if (n == 0 && e != member_event::up) {
      status = e == member_event::goodbye ? 0 : 1;
      done = true;
    }
  });
  asio::co_spawn(
      io,
      [&]() -> awaitable<void> {
        if (auto j = co_await sys.join(std::chrono::seconds(30)); !j.ok()) {
          std::fprintf(stderr, "bench peer: %s\n", j.err().message.c_str());
          status = 1;
          done = true;
        }
      },
      asio::detached);
  const auto limit = clock::now() + std::chrono::minutes(10);
  while (!done && clock::now() < limit) io.run_one_for(std::chrono::milliseconds(100));
  sys.shutdown();
  io.restart();
  io.run_for(std::chrono::milliseconds(100));
  return status;
}

// Median half round trip (µs) of `pings` asks from this process to a server on node 1.
double ours_ping_pong_us(int pings) {
  asio::io_context io(1);
  transport::ucx_link_options o;
  o.self = 0;
  o.job_token = token;
  transport::ucx_link link(io, o);
  actor_system sys(io, link, {.incarnation = 1, .head = 0});
  bool joined = false;
  sys.on_membership([&](transport::node_id, member_event e) {
    if (e == member_event::up) joined = true;
  });
  const std::string self = std::filesystem::read_symlink("/proc/self/exe");
  std::vector<std::string> args{self, "--peer", std::to_string(link.port())};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (::posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv.data(), environ) != 0) {
    throw std::runtime_error("cannot start the bench peer");
  }
  double median = 0;
  std::exception_ptr failure;
  bool finished = false;
  asio::co_spawn(
      io,
      [&]() -> awaitable<void> {
        const auto until = clock::now() + std::chrono::seconds(60);
        while (!joined) {
          if (clock::now() > until) throw std::runtime_error("bench peer never joined");
          asio::steady_timer t(io, std::chrono::milliseconds(1));
          co_await t.async_wait(asio::use_awaitable);
        }
        auto srv = co_await sys.spawn_named(1, "server", std::chrono::seconds(10));
        if (!srv.ok()) throw std::runtime_error(srv.err().message);
        std::vector<double> half_rtt;
        half_rtt.reserve(static_cast<std::size_t>(pings));
        std::int64_t v = 0;
        for (int i = 0; i < pings + pings / 10; ++i) {  // the first tenth warms up
          const auto t0 = clock::now();
          auto fill = [v](Num::Builder b) { b.setValue(v); };
          auto r = co_await sys.ask<Num, Num>(*srv, std::chrono::seconds(10), fill);
          const auto t1 = clock::now();
          if (!r.ok()) throw std::runtime_error(r.err().message);
          if (r->get().getValue() != v + 1) throw std::runtime_error("wrong reply");
          v = r->get().getValue();
          if (i >= pings / 10) {
            half_rtt.push_back(duration<double, std::micro>(t1 - t0).count() / 2);
          }
        }
        std::nth_element(half_rtt.begin(), half_rtt.begin() + half_rtt.size() / 2, half_rtt.end());
        median = half_rtt[half_rtt.size() / 2];
      },
      [&](std::exception_ptr e) {
        failure = e;
        finished = true;
      });
  const auto limit = clock::now() + std::chrono::minutes(5);
  while (!finished && clock::now() < limit) {
    io.restart();
    io.run_one_for(std::chrono::milliseconds(100));
  }
  sys.shutdown();  // goodbye: the peer exits
  io.restart();
  io.run_for(std::chrono::milliseconds(200));
  int st = 0;
  for (int i = 0; i < 50 && ::waitpid(pid, &st, WNOHANG) != pid; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (i == 49) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &st, 0);
    }
  }
  if (failure) std::rethrow_exception(failure);
  if (!finished) throw std::runtime_error("cross-process ping-pong did not finish");
  return median;
}

// ---- theirs across processes: ucx_perftest ---------------------------------------------------

// p50 latency (µs) of one ucx_perftest ucp_am_lat client/server pair (8-byte messages).
double perftest_am_lat_us(long iters, int port) {
  return moevement::bench::perftest("ucp_am_lat", 8, iters, port)[1];  // p50 latency
}

// ---- CAF -----------------------------------------------------------------------------------

caf::behavior caf_server(caf::event_based_actor*) {
  return {[](std::int64_t x) { return x + 1; }};
}

void caf_loop(caf::event_based_actor* self, caf::actor srv, std::uint64_t left, std::int64_t v) {
  self->request(srv, caf::infinite, v).then([=](std::int64_t r) {
    if (left > 1) {
      caf_loop(self, srv, left - 1, r);
    } else {
      self->quit();
    }
  });
}

double caf_round_trips(caf::actor_system& sys, std::uint64_t n) {
  auto srv = sys.spawn(caf_server);
  const auto t0 = clock::now();
  sys.spawn([=](caf::event_based_actor* self) { caf_loop(self, srv, n, 0); });
  // Wait for the client only: the server stays up until we drop it.
  while (sys.registry().running() > 1) std::this_thread::yield();
  const double s = seconds_since(t0);
  caf::anon_send_exit(srv, caf::exit_reason::user_shutdown);
  while (sys.registry().running() > 0) std::this_thread::yield();
  return static_cast<double>(n) / s;
}

struct counter_state {
  std::uint64_t n = 0;
};

double caf_one_way(caf::actor_system& sys, std::uint64_t n) {
  auto receiver = sys.spawn([n](caf::stateful_actor<counter_state>* self) -> caf::behavior {
    return {[=](std::int64_t) {
      if (++self->state.n == n) self->quit();
    }};
  });
  const auto t0 = clock::now();
  sys.spawn([=](caf::event_based_actor* self) {
    for (std::uint64_t i = 0; i < n; ++i) self->send(receiver, static_cast<std::int64_t>(i));
    self->quit();
  });
  while (sys.registry().running() > 0) std::this_thread::yield();
  return static_cast<double>(n) / seconds_since(t0);
}

void report(const char* metric, double ours, double theirs) {
  fmt::print("{}: ours={:.0f} theirs={:.0f} ratio={:.2f}\n", metric, ours, theirs, ours / theirs);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 3 && std::string(argv[1]) == "--peer") {
    return run_peer(static_cast<std::uint16_t>(std::stoi(argv[2])));
  }
  // Positive whole numbers, or the usage (a count of 0 would report a ratio of nothing).
  auto count = [&](int i, std::uint64_t fallback) -> std::uint64_t {
    if (argc <= i) return fallback;
    char* end = nullptr;
    const std::uint64_t n = std::strtoull(argv[i], &end, 10);
    if (*argv[i] == '\0' || *end != '\0' || n == 0 || *argv[i] == '-') {
      fmt::print(stderr,
                 "bench actors: '{}' is not a positive count (usage: bench actors [round_trips] "
                 "[messages] [pings])\n",
                 argv[i]);
      std::exit(2);
    }
    return n;
  };
  if (argc > 4) {
    fmt::print(stderr, "bench actors: at most three counts (round_trips messages pings)\n");
    return 2;
  }
  const std::uint64_t round_trips = count(1, 1'000'000);
  const std::uint64_t messages = count(2, 4'000'000);
  const int pings = int(std::min<std::uint64_t>(count(3, 20000), 1u << 30));
  constexpr int repeats = 3;  // best of three, each side
  const bool verbose = std::getenv("BENCH_VERBOSE") != nullptr;
  double ours_rt = 0, caf_rt = 0, ours_ow = 0, caf_ow = 0;
  {
    caf::actor_system_config cfg;
    caf::actor_system sys{cfg};
    for (int i = 0; i < repeats; ++i) {
      ours_rt = std::max(ours_rt, ours_round_trips(round_trips));
      if (verbose) fmt::print(stderr, "ours rt {:.0f}\n", ours_rt);
      caf_rt = std::max(caf_rt, caf_round_trips(sys, round_trips));
      if (verbose) fmt::print(stderr, "caf rt {:.0f}\n", caf_rt);
      ours_ow = std::max(ours_ow, ours_one_way(messages));
      if (verbose) fmt::print(stderr, "ours ow {:.0f}\n", ours_ow);
      caf_ow = std::max(caf_ow, caf_one_way(sys, messages));
      if (verbose) fmt::print(stderr, "caf ow {:.0f}\n", caf_ow);
    }
  }
  report("local_request_response_rt_per_s", ours_rt, caf_rt);
  report("local_one_way_msgs_per_s", ours_ow, caf_ow);
  int port = 20000 + ::getpid() % 20000;
  for (const std::string tls : {"shm", "tcp"}) {
    if (tls == "tcp") {
      ::setenv("UCX_TLS", "tcp", 1);
    } else {
      ::unsetenv("UCX_TLS");
    }
    double ours = 0, theirs = 0;
    try {
      ours = ours_ping_pong_us(pings);
      theirs = perftest_am_lat_us(pings, port++);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_actors: %s ping-pong: %s\n", tls.c_str(), e.what());
      return 1;
    }
    fmt::print("{}_ping_pong_latency_us: ours={:.2f} theirs={:.2f} ratio={:.2f}\n", tls, ours,
               theirs, theirs / ours);
  }
  ::unsetenv("UCX_TLS");
  return 0;
}
