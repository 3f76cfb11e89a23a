// ucx_link: the link between processes over UCX (shared memory, TCP, InfiniBand/RoCE).
//
// One UCX context and worker per process, progressed from the link's asio::io_context:
// progress until idle, spin briefly, arm the worker, wait on (a dup of) its event fd; a safety
// timer catches any lost wakeup. Each process listens on host:port with a TCP socket of its own
// (the admission socket, ucx_link_admission.hpp): a dialler presents the job token and its UCX
// worker addresses there and gets the acceptor's back, or is refused (a wrong token is counted;
// the dialler sees its peer lost); both sides then make their endpoints from the addresses, with
// peer error handling. Junk, silence and floods on that socket are closed, counted and reported
// on stderr (rate-limited); the socket keeps listening. Envelopes travel as active messages:
// small ones eagerly, large ones by rendezvous straight into an aligned buffer the envelope is
// then read from in place.
// Bulk regions (bulk.hpp) are pulled with pull(). See docs/transport.md.
#pragma once

#include <asio/io_context.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "transport/bulk.hpp"
#include "transport/delivery_book.hpp"
#include "transport/link.hpp"

namespace moevement::transport {

// Every tunable of the UCX link, with its one default.
struct ucx_link_options {
  node_id self = 0;
  // Required. Both ends of an admission prove that they hold it (HMAC over fresh nonces); it
  // never goes on the wire. A dialler whose proof fails is refused; an acceptor whose proof
  // fails is not connected to.
  std::string job_token;
  // Where the admission socket binds. A loopback address also keeps UCX's network transports on
  // the loopback interface (ucx_context's loopback_only): nothing of the link listens elsewhere.
  std::string listen_host = "127.0.0.1";
  std::uint16_t listen_port = 0;        // 0: any free port (see ucx_link::port())
  std::chrono::microseconds spin{100};  // bound of the adaptive spin window (see pump())
  bool spin_yield = true;               // sched_yield() on each idle pass of the spin (see pump())
  std::chrono::milliseconds safety_tick{5};  // progress at least this often, armed or not
  // An admission request must arrive whole within it (a dial gives up after it too), and an
  // admitted connection's first message too.
  std::chrono::milliseconds hello_timeout{5000};
  // Admission sockets open at once from one source address: one beyond this many is closed at
  // once, so that one source cannot hold more than this for hello_timeout each. Above what a
  // job's start makes legitimately (every process of a host dialling one peer at once: at most
  // 256 workers and their spares).
  std::size_t max_half_open_per_source = 512;
  // Admission sockets open at once from all sources together, so that many sources cannot take
  // every descriptor the process has (UCX needs its own): at most half the descriptor limit
  // (RLIMIT_NOFILE) whatever this says. A job's start makes at most one per process, briefly.
  std::size_t max_half_open = 4096;
  std::chrono::milliseconds close_timeout{1000};  // bound on the flush at destruction
  // A connection its peer closed (it said so first) keeps its endpoints this long before they
  // are closed by force, so that UCX sees the peer's end go first: UCX 1.13's TCP transport
  // may touch a force-closed endpoint's socket after freeing it when the peer's close
  // arrives in the same progress pass (a crash in ucs_socket_send_nb, or its tcp_cm.c
  // assertion).
  std::chrono::milliseconds closed_linger{100};
  decode_limits limits;  // applied to every received envelope
  bulk_path bulk = bulk_path::automatic;
  // RMA pulls of regions the link allocated are served from a lease (docs/transport.md):
  // the exporter validates the first pull of a region and hands out its rkey and bounds; the
  // importer checks later descriptors against those bounds and reads without a round trip.
  // Withdrawing a leased region revokes the lease; the exporter keeps the memory mapped until
  // every holder has released it (or its connection is gone).
  bool lease_regions = true;
  std::size_t max_leases = 64;  // per connection; the oldest is released beyond it
  // A pull longer than this goes in pieces of it, one after another: a connection that fails
  // mid-transfer (an endpoint timeout on a slow, lossy link) costs the piece in flight, not what
  // arrived before. Large enough that a piece's round trip is lost in its transfer time (64 MiB
  // takes 3 ms at 25 GB/s). 0: whole.
  std::size_t pull_piece_bytes = std::size_t{64} << 20;
  // When envelopes are acknowledged and sent again on a live connection (delivery_book.hpp).
  delivery_book::timing delivery;
  // Tests only: an envelope send (first or again) it returns true for is not sent, as if lost
  // on the wire; null in production.
  std::function<bool(node_id peer, std::uint64_t seq)> lose_envelope;
};

// What the link counts besides link_stats.
struct ucx_link_counters {
  std::uint64_t refused_tokens = 0;      // admission requests whose proof of the token failed
  std::uint64_t unproven_acceptors = 0;  // our dials admitted by a process without the token
  std::uint64_t bad_hellos = 0;          // admission requests not ours; hellos malformed or twice
  std::uint64_t hello_timeouts = 0;      // admission sockets closed for silence
  std::uint64_t failed_accepts = 0;      // worker addresses UCX could not make an endpoint of
  std::uint64_t half_open_refused = 0;   // admission sockets past max_half_open_per_source
  std::uint64_t too_many_open = 0;       // admission sockets past max_half_open
  std::uint64_t bulk_rejected = 0;       // pull requests we refused to serve (bad descriptor)
  std::uint64_t bulk_served = 0;         // pull requests served
  std::uint64_t pulls_ok = 0;            // our pulls that completed
  std::uint64_t pulls_failed = 0;        // our pulls that completed with an error
  std::uint64_t pulls_retried = 0;       // our pulls asked again on a new connection
  std::uint64_t pulls_parked = 0;        // our pulls made while the peer had no connection
  std::uint64_t pull_pieces = 0;         // pieces of long pulls asked after the first
  std::uint64_t pulls_by_rma = 0;        // our pulls the exporter answered with an rkey
  std::uint64_t pulls_by_lease = 0;      // our pulls read under a cached lease (no round trip)
  std::uint64_t get_pieces = 0;      // gets issued under leases (a big one from this host: several)
  std::uint64_t leases_granted = 0;  // exporter: leases handed out (one per grant message)
  std::uint64_t leases_revoked = 0;  // exporter: revocations sent for withdrawn regions
  std::uint64_t leases_released = 0;  // exporter: releases received from holders
  std::uint64_t withdrawn_held = 0;   // exporter, now: withdrawn regions kept for lease holders
  std::uint64_t revived = 0;          // lost peers made dialable again (revive)
  std::uint64_t resent = 0;           // envelopes sent again (a new connection's unacked, asked)
  std::uint64_t duplicates = 0;       // envelopes received again, dropped (handed on already)
  std::uint64_t acks_sent = 0;        // explicit acks (none of our envelopes carried one back)
  // A message lost on a live connection (delivery_book.hpp): found, asked for and sent again.
  std::uint64_t early = 0;             // envelopes after a missing one, dropped (it comes again)
  std::uint64_t resend_requests = 0;   // ... for which we asked the sender to send again
  std::uint64_t resends_answered = 0;  // requests from a peer answered (what went: `resent`)
  std::uint64_t probes = 0;            // our oldest unacknowledged sent again, unacked too long
  std::uint64_t skipped = 0;        // envelopes the sender no longer kept, or said goodbye without
  std::uint64_t unacked = 0;        // now: envelopes kept for peers, not yet acknowledged
  std::uint64_t held_sends = 0;     // envelopes and pull requests held until the peer's welcome
  std::uint64_t arms = 0;           // ucp_worker_arm calls
  std::uint64_t arm_busy = 0;       // ... that returned UCS_ERR_BUSY (progress again)
  std::uint64_t arm_errors = 0;     // ... that failed otherwise (no fd wait: tick only)
  std::uint64_t arm_stuck = 0;      // busy arms after a run of idle ones: polled, not spun
  std::uint64_t tick_progress = 0;  // safety-tick wakeups whose progress found events
  std::uint64_t poll_progress = 0;  // poll-timer wakeups whose progress found events
  std::uint64_t fd_progress = 0;    // event-fd wakeups whose progress found events
  std::uint64_t spin_progress = 0;  // spin passes whose progress found events (no wakeup paid)
  std::uint64_t spin_backoffs = 0;  // spins stopped: their yield gave the core to another process
};

class ucx_link final : public link {
 public:
  // Creates the UCX contexts and workers and the admission socket. Throws with a message saying
  // what to check when UCX cannot come up or the address cannot be bound.
  ucx_link(asio::io_context& io, ucx_link_options options);
  // Flushes and closes every endpoint (bounded by close_timeout). Call say_goodbye() first
  // for a clean shutdown; without it peers see a crash.
  ~ucx_link() override;
  ucx_link(const ucx_link&) = delete;
  ucx_link& operator=(const ucx_link&) = delete;

  // The port the admission socket is bound to.
  std::uint16_t port() const;
  // Where to reach a peer; the endpoint is created on the first send or pull. Re-adding a
  // lost peer (e.g. a restarted node) makes it reachable again.
  void add_peer(node_id peer, const std::string& host, std::uint16_t port) override;
  bool can_dial(node_id peer) const override;

  node_id self() const override;
  void set_handlers(link_handlers handlers) override;
  result<void> send(node_id to, kj::Array<capnp::word> message) override;
  void forget(node_id peer) override;
  void revive(node_id peer) override;
  // After it, peers that drop their connections are reported as peer_loss::goodbye: this
  // process is leaving and expects them to.
  void say_goodbye() override;
  link_stats stats() const override;
  ucx_link_counters counters() const;

  // Registers memory for export. export_region: memory the caller owns (on one host, read by
  // rendezvous: UCX 1.13 would emulate a get of it through the FIFOs). allocate_region: UCX
  // allocates it (shareable by the posix/sysv shared-memory transports, the fastest same-host
  // path).
  bulk_region export_region(std::span<std::byte> memory);
  bulk_region allocate_region(std::size_t bytes);

  using pull_handler = std::function<void(result<void>)>;
  // Pulls the bytes a descriptor names from its node into `into` (which must be exactly
  // descriptor.length bytes and stay valid until `done` runs). `done` is posted exactly once:
  // ok, or an error (bad descriptor, peer refused, peer lost mid-transfer).
  // Pulls longer than pull_piece_bytes go in pieces, one after another.
  void pull(const bulk_descriptor& descriptor, std::span<std::byte> into, pull_handler done);
  // The path automatic pulls from this peer take for regions from allocate_region(); for
  // export_region() memory it is RMA only where the RMA lanes register any memory
  // (InfiniBand), else rendezvous. Connects if needed. An error if the peer is unknown, lost,
  // or its endpoint is not wired up yet (then retry after a message exchange).
  result<bulk_path> path_to(node_id peer);

  // UCX's description of the endpoint to a peer (its lanes: which transport carries active
  // messages, RMA, rendezvous), to check what was selected (docs/infiniband.md).
  result<std::string> endpoint_info(node_id peer);

  // For the connection-failure tests only: every connection to `peer` fails as on an endpoint
  // error (the peer lives on).
  void fail_connections_for_tests(node_id peer);

  // For the malformed-input tests only: sends a raw active message of the link's protocol
  // (`am` is one of its ids) with arbitrary header and data bytes.
  void send_raw_for_tests(node_id to, unsigned am, std::span<const std::byte> header,
                          std::span<const std::byte> data);

 private:
  void pull_piece(const bulk_descriptor& descriptor, std::span<std::byte> into, pull_handler done);

  std::shared_ptr<detail::link_state> state_;
};

}  // namespace moevement::transport
