// The state behind ucx_link (private to transport/): its wire headers, its connections, peers,
// pulls and leases, and link_state, whose methods live by concern in ucx_link_state.cpp (the
// worker driven from Asio, UCX requests, shutdown), ucx_link_connections.cpp (dialling,
// admission, failures), ucx_link_receiving.cpp (active messages, hello, delivery, repair) and
// ucx_link_bulk.cpp (pulls, RMA, leases). ucx_link.cpp is the public class over it.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <kj/exception.h>
#include <netdb.h>
#include <sched.h>
#include <unistd.h>
#include <array>
#include <asio/posix/stream_descriptor.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <unordered_map>
#include <vector>
#include "base/hash.hpp"
#include "transport/delivery_book.hpp"
#include "transport/shared_memory.hpp"
#include "transport/ucx_context.hpp"
#include "transport/ucx_link_admission.hpp"

#include "transport/ucx_link.hpp"

namespace moevement::transport {
namespace detail {

using clock = std::chrono::steady_clock;

// MOEVEMENT_TRACE_LINK=1: one stderr line per connection event (connect, accept, hello,
// welcome, failure, peer loss, goodbye, pull), for diagnosing stalls between processes.
inline bool link_tracing() {
  static const bool on = std::getenv("MOEVEMENT_TRACE_LINK") != nullptr;
  return on;
}

// Active message ids of the link's own protocol. Each message's UCX header starts with the
// receiver's key for the connection (connection::send_key), then the header named here.
enum am_id : unsigned {
  am_hello = 1,          // header hello_header: the dialler's first message on its endpoint
  am_welcome = 2,        // header hello_header: the acceptor's first, answering the hello
  am_closed = 3,         // no payload: the sender closed its end (the receiver fails its own)
  am_envelope = 4,       // header delivery_book::header, data: one serialized envelope
  am_goodbye = 5,        // header delivery_book::header (seq: the last one numbered for us):
                         // the sender is shutting down cleanly
  am_bulk_request = 6,   // header bulk_request_header
  am_bulk_data = 7,      // header bulk_reply_header, data: the bytes (rendezvous when large)
  am_bulk_rkey = 8,      // header bulk_reply_header, data: the packed rkey
  am_bulk_error = 9,     // header bulk_reply_header (code says why)
  am_bulk_lease = 10,    // header bulk_lease_header, data: the packed rkey (a lease on the region)
  am_bulk_revoke = 11,   // header region_header: the exporter withdrew a region we hold a lease on
  am_bulk_release = 12,  // header region_header: the importer gives one lease back
  am_ack = 13,           // header delivery_book::header: envelopes handed on (delivery_book.hpp)
  am_resend = 14,        // header delivery_book::header: an ack, and "send again what follows"
};
constexpr am_id all_am_ids[] = {am_hello,      am_welcome,      am_closed,      am_envelope,
                                am_goodbye,    am_bulk_request, am_bulk_data,   am_bulk_rkey,
                                am_bulk_error, am_bulk_lease,   am_bulk_revoke, am_bulk_release,
                                am_ack,        am_resend};

constexpr std::uint32_t wire_magic = 0x56454f4d;  // "MOEV"
constexpr std::uint32_t wire_version = 7;
constexpr std::size_t max_token_bytes = admission_max_token;
constexpr std::size_t host_tag_bytes = 8;  // leads the bulk address, see bulk_ep_of
constexpr std::size_t key_bytes = sizeof(std::uint64_t);
constexpr std::size_t max_header_bytes = 64;  // a key and the largest header of the protocol

constexpr std::size_t max_rkey_bytes = 4096;

struct hello_header {
  std::uint32_t magic, version, node;
};
struct bulk_request_header {
  std::uint64_t request, region, offset, length;
  std::uint32_t rma;    // an rma_level, what the puller's endpoint can do
  std::uint32_t flags;  // request_flags
};
enum request_flags : std::uint32_t {
  accepts_lease = 1,  // the puller caches a lease (and releases it) if the exporter grants one
};
// How far the puller's RMA lanes are native (not emulated over TCP).
enum rma_level : std::uint32_t {
  rma_none = 0,       // rendezvous only
  rma_allocated = 1,  // native for regions UCX allocated (shared-memory transports)
  rma_any = 2,        // native for any registered memory (InfiniBand, RoCE), or forced
};
enum bulk_error_code : std::uint32_t { no_such_region = 1, out_of_range = 2, not_mapped = 3 };
struct bulk_reply_header {
  std::uint64_t request, address, length;
  std::uint32_t code, reserved;
};
// A lease: the whole region [region_base, region_base + region_length) in the exporter's
// address space, readable with the rkey until revoked; address/length answer this request.
struct bulk_lease_header {
  std::uint64_t request, address, length, region_base, region_length;
};
struct region_header {
  std::uint64_t region;
};

// A link's session: tells a peer's envelopes from those of an earlier process on that node.
std::uint64_t new_session();

template <class T>
inline bool read_header(const void* header, std::size_t length, T& out) {
  if (length != sizeof(T)) return false;
  std::memcpy(&out, header, sizeof(T));
  return true;
}

// max_half_open, at most half the process's descriptor limit.
std::size_t admission_cap(std::size_t max_half_open);

void check_status(ucs_status_t status, const std::string& what);

sockaddr_storage resolve(const std::string& host, std::uint16_t port, socklen_t& len);

// Whether the listener's address is a loopback one (then every peer is on this host).
bool on_loopback(const std::string& host);

// A dup of `fd` that is closed on exec: our copies of UCX's event fds are not a child's.
inline int dup_cloexec(int fd) {
  return ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
}

struct region_record {
  std::uint64_t id = 0;
  std::byte* base = nullptr;
  std::size_t length = 0;
  ucp_context_h context = nullptr;
  ucp_mem_h memh = nullptr;
  // The same memory registered with the messages context too: its rendezvous sends and
  // receives then need no on-the-fly registration, which a transfer cut off at shutdown
  // would leave behind for UCX to assert on when the context goes.
  ucp_context_h message_context = nullptr;
  ucp_mem_h message_memh = nullptr;
  std::vector<std::byte> rkey;  // packed once, sent to pullers taking the RMA path
  std::uint64_t in_flight = 0;
  bool allocated = false;  // UCX allocated it: shareable by the shared-memory transports
  // Leases handed out and not yet released, by connection serial (a count: a holder may have
  // been granted the region more than once, and it releases each grant). While any remain,
  // a withdrawn region stays mapped (link_state::withdrawn).
  std::map<std::uint64_t, std::uint32_t> grants;
  void unmap_messages() {
    if (message_memh != nullptr) ucp_mem_unmap(message_context, message_memh);
    message_memh = nullptr;
  }
  void unmap() {
    unmap_messages();
    if (memh != nullptr) ucp_mem_unmap(context, memh);
    memh = nullptr;
    base = nullptr;
    length = 0;
  }
  ~region_record() { unmap(); }
};

// One received envelope awaiting in-order delivery.
struct inbound {
  enum class kind { envelope, goodbye } what = kind::envelope;
  delivery_book::header stream;           // envelopes: where it is in the sender's stream
  std::shared_ptr<capnp::word[]> buffer;  // uninitialised: filled by a copy or the rendezvous
  std::size_t bytes = 0;
  bool ready = false;
  bool failed = false;
};

// An unpacked remote key; destroyed when neither the cache nor a get in flight holds it.
struct remote_key {
  ucp_rkey_h handle = nullptr;
  ~remote_key() {
    if (handle != nullptr) ucp_rkey_destroy(handle);
  }
};
constexpr std::size_t max_cached_rkeys = 64;  // per connection; unpacking maps shared memory
constexpr std::size_t max_revoked_tombstones = 4096;  // per connection, see connection::revoked

// A lease the importer holds on one exporter region (granted by am_bulk_lease): pulls of any
// range inside it are read by ucp_get_nbx without asking the exporter first. Retired (out of
// the cache: revoked, evicted, or the connection gone) it starts no new get; the release goes
// back once the gets it started have completed, so the exporter never unmaps under a get.
struct lease {
  std::uint64_t region = 0;
  std::uint64_t conn = 0;
  std::shared_ptr<remote_key> key;
  std::uint64_t base = 0;    // the region's address in the exporter
  std::uint64_t length = 0;  // the region's bytes
  std::uint64_t gets = 0;    // gets in flight under this lease
  bool retired = false;
};

struct connection {
  std::uint64_t serial = 0;
  // Messages (on the link's message worker), made from the peer's worker address once the
  // admission exchange is done; nullptr while an outgoing one is still being admitted.
  ucp_ep_h ep = nullptr;
  std::uint64_t recv_key = 0;  // ours: the peer's messages on this connection start with it
  std::uint64_t send_key = 0;  // the peer's: ours start with it
  std::shared_ptr<admission_dialing> dial;  // outgoing: the admission exchange under way
  // RMA reads from the peer's bulk worker, created on first use from the address the peer
  // sent in its hello or welcome (known only once it is admitted).
  ucp_ep_h bulk_ep = nullptr;
  std::vector<std::byte> bulk_address;
  bool outgoing = false;
  // The first message arrived from the other end (outgoing: the welcome; incoming: the
  // hello, and our welcome has gone out): both endpoints work, and what was held goes out.
  bool welcomed = false;
  // Incoming: the hello arrived; `welcomed` only once our welcome is sent (a posted handler).
  // A send between the two went out ahead of the welcome, the dialler dropped it as
  // unadmitted, and the next message's number made the receiver count it as handed on: lost
  // for good, a group replay waiting ten minutes for it.
  bool hello_seen = false;
  node_id peer = 0;
  clock::time_point created;
  std::deque<std::shared_ptr<inbound>> inbox;
  bool deliver_posted = false;  // one deliver() handler at a time, however many arrive
  // Everything (envelopes, pull requests) issued before the welcome (incoming: the hello), sent
  // in order once it arrives; a connection's first message goes out alone. UCX 1.13 on shared
  // memory fails sends queued while the endpoint is wiring up (measured: "Invalid am_short_iov
  // length: 168 (expected: <= 100)", the message lost) when several go out back to back on a fresh
  // endpoint, and it may deliver a message sent after the hello before it (seen: a pull request
  // overtook the hello, the acceptor dropped it as unadmitted and the pull never completed: a
  // silent job stall).
  std::deque<std::function<void(connection&)>> held;
  // Unpacked rkeys by region id: unpacking (and, on shared memory, mapping the segment and
  // faulting its pages in) costs more than a pull of megabytes.
  std::map<std::uint64_t, std::shared_ptr<remote_key>> rkeys;
  // Leases granted by the peer on this connection, by region id (at most opt.max_leases).
  std::map<std::uint64_t, std::shared_ptr<lease>> leases;
  // Regions the peer revoked while we held no lease on them: a grant for one arriving late
  // (overtaken by its revocation) is released at once and its pull fails. Ids are never
  // reused; the set is capped (oldest first).
  std::set<std::uint64_t> revoked;
};

struct peer_entry {
  std::string host;
  std::uint16_t port = 0;
  bool addressed = false;
  std::uint64_t send_conn = 0;  // serial of the connection we send on; 0: none yet
  bool lost = false;
  bool path_known = false;
  bulk_path path = bulk_path::rendezvous;
  std::uint32_t rma = 0;  // rma_level, once path_known
  // Its connection failed but nobody gave it up (forget, goodbye): sends to it are numbered and
  // kept (delivery_book) for its next connection, dialled after revive() or by the peer.
  bool kept = false;
  // Its goodbye, held until every message it numbered before it was handed on (asked for
  // again if one went missing; on another connection, still in flight), or goodbye_until.
  std::shared_ptr<inbound> goodbye;
  clock::time_point goodbye_until;
  std::uint64_t goodbye_heard = 0;  // the session we had heard from it when the goodbye came
  // The same address, everything else afresh (a lost peer back).
  static peer_entry again(const peer_entry& was) {
    peer_entry p;
    p.host = was.host;
    p.port = was.port;
    p.addressed = was.addressed;
    return p;
  }
};

struct pull_op {
  std::uint64_t id = 0;
  node_id peer = 0;
  std::uint64_t conn = 0;
  std::uint64_t region = 0;
  std::uint64_t offset = 0;
  std::byte* into = nullptr;
  std::size_t length = 0;
  int attempts = 1;              // a pull whose connection failed is asked again on the next one
  std::uint32_t rma = rma_none;  // the rma_level we offered the exporter
  bool transferring = false;     // a UCX request moves the bytes; it completes on its own
  std::shared_ptr<lease> under;  // the lease the get runs under, if any
  ucx_link::pull_handler done;
};

// Heap state of one UCX request; the callback frees it.
struct pending_request {
  std::function<void(ucs_status_t)> done;
  std::shared_ptr<void> keep;  // whatever the request reads from or writes to
  // A send's UCX header (the receiver's key, then the message's own), valid until completion.
  std::array<std::byte, max_header_bytes> header;
  // UCX may run the callback inside the call that starts the request (seen with
  // ucp_am_recv_data_nbx on a failed endpoint); track() then finishes it.
  bool issued = false;
  bool early = false;
  ucs_status_t early_status = UCS_OK;
  // While in flight: the UCX request, and where link_state::inflight lists it (no allocation
  // per request: a burst of sends leaves hundreds of thousands in flight).
  link_state* owner = nullptr;
  void* request = nullptr;
  std::size_t slot = 0;
};

#define LINK_TRACE(...)                                                                           \
  do {                                                                                            \
    if (link_tracing()) fmt::print(stderr, "[link {}] {}\n", opt.self, fmt::format(__VA_ARGS__)); \
  } while (0)

struct link_state : std::enable_shared_from_this<link_state> {
  link_state(asio::io_context& io_in, ucx_link_options options)
      : io(io_in),
        opt(std::move(options)),
        loopback_only(on_loopback(opt.listen_host)),
        bulk_context(context_use::bulk, loopback_only),
        bulk_worker(bulk_context),
        context(context_use::messages, loopback_only),
        worker(context),
        fd(io),
        bulk_fd(io),
        tick(io),
        poll(io) {}

  asio::io_context& io;
  ucx_link_options opt;
  // Listening on a loopback address: UCX's network transports stay on the loopback interface
  // too (its TCP transport would otherwise listen on every interface's address, per worker).
  bool loopback_only = false;
  // Two workers (see context_use): one-sided bulk reads, and messages. The bulk context comes
  // first: it reads the shared-memory settings (UCX warns of environment variables unused by
  // the first context).
  ucx_context bulk_context;
  ucx_worker bulk_worker;
  ucx_context context;
  ucx_worker worker;
  std::vector<std::byte> bulk_address;     // bulk_worker's, sent to every peer we admit or join
  std::vector<std::byte> message_address;  // worker's, likewise
  std::shared_ptr<admission_listener> admission;
  asio::posix::stream_descriptor fd;
  asio::posix::stream_descriptor bulk_fd;
  bool bulk_fd_waiting = false;
  asio::steady_timer tick;
  asio::steady_timer poll;  // see pump(): requests in flight without events
  bool poll_pending = false;
  // A request was left in flight since the last poll was scheduled: poll soon again (a get or
  // a send waiting for room completes by our progress only, no event wakes us for it).
  bool request_started = false;
  std::chrono::nanoseconds poll_interval{20'000};
  // Consecutive arms answered UCS_ERR_BUSY by passes that found nothing; at max_busy_idle the
  // pump polls (schedule_poll) instead of spinning.
  static constexpr int max_busy_idle = 64;
  int busy_idle = 0;

  link_handlers handlers;
  link_stats stats;
  ucx_link_counters counters;
  delivery_book book{new_session(), opt.delivery};

  std::uint64_t next_serial = 1;
  std::map<std::uint64_t, std::unique_ptr<connection>> conns;
  std::unordered_map<ucp_ep_h, std::uint64_t> by_ep;
  std::unordered_map<std::uint64_t, std::uint64_t> by_key;  // recv_key -> serial
  // A connection's key, each drawn afresh from the system's random source: a peer that knows
  // one of this process's keys (its own connection's) must not predict the others, as it could
  // from a generator seeded with 32 bits.
  static std::uint64_t keys() { return new_session(); }
  std::unordered_map<ucp_ep_h, std::uint64_t> by_bulk_ep;
  std::map<node_id, peer_entry> peers;
  std::vector<void*> closing;  // ucp_ep_close_nbx requests not yet complete
  // Endpoints of connections their peer closed, waiting out opt.closed_linger (linger_conn).
  std::vector<ucp_ep_h> lingering;
  std::map<std::uint64_t, std::shared_ptr<region_record>> regions;
  // Withdrawn regions some connection still holds a lease on: mapped until released.
  std::map<std::uint64_t, std::shared_ptr<region_record>> withdrawn;
  std::uint64_t next_region = 1;
  std::map<std::uint64_t, std::unique_ptr<pull_op>> pulls;
  // Pulls whose connection failed while their peer lives on (conn 0): asked again, whole, on
  // the peer's next connection (pulls are idempotent); failed on forget() or a goodbye.
  static constexpr int max_pull_attempts = 3;
  std::uint64_t next_pull = 1;
  std::uint64_t outstanding = 0;           // UCX requests whose callback has not run
  std::vector<pending_request*> inflight;  // those requests, cancelled at shutdown

  bool kick_pending = false;
  bool fd_waiting = false;
  bool dying = false;
  bool said_goodbye = false;
  clock::time_point last_activity = clock::now();
  std::chrono::nanoseconds spin_now{0};  // the adaptive spin window, at most opt.spin
  // A spin's yield that returned this late gave the core to another process (an idle core
  // returns at once, a busy one after the other's time slice, ~1 ms): the window stays 0 for
  // contention_backoff after it. Short, because re-trying costs the others little (one pass,
  // whose yield gives them the core again) and a spell of load should not cost the spin for long.
  static constexpr std::chrono::microseconds contended_yield{50};
  static constexpr std::chrono::milliseconds contention_backoff{20};
  clock::time_point contended_until;
  bool spinning = false;

  // ---- driving the worker from Asio -------------------------------------------------------

  void start();

  // The AM callback gets the link and the id through one pointer: ids are small, so the
  // argument is the address of an element of am_args.
  std::array<std::pair<link_state*, am_id>, 16> am_args{};
  void* new_am_arg(am_id id);

  void kick();

  // Progress until idle; keep going (re-posting, so other handlers run) while within the spin
  // window after the last activity; then arm and wait on the event fd. Arm and async_wait
  // follow each other with nothing in between: Asio's reactor is edge-triggered.
  //
  // The window adapts: it doubles (up to opt.spin) when spinning caught an event, covers the
  // wait (1.5x, up to opt.spin) when an event woke us sooner than opt.spin after the last
  // activity, and halves when it ran out with nothing. On an idle machine
  // spinning halves the latency of a hop. On an oversubscribed one (more runnable processes
  // than cores) a spinner that does not yield holds the core its peer needs to answer and the
  // window shrinks to 0; yielding on idle passes (opt.spin_yield) keeps the spin useful there.
  enum class wake { kick, fd, poll, tick };
  void pump(wake why = wake::kick);
  void wait_on(asio::posix::stream_descriptor& d, bool& waiting);
  void grow_spin();
  // An event woke us `waited` after the last activity (the spin, if any, and the sleep
  // together). Sooner than opt.spin, a window that long would have caught it: take the window
  // there at once, with a margin for the wakeup's own cost. (Doubling from 0 on each such wake
  // and halving on each fruitless spin never got past 1 us: the window oscillated between 0
  // and 1 us and every hop paid the wakeup.)
  void cover_wait(std::chrono::nanoseconds waited);
  void shrink_spin();
  // A pump after poll_interval, which starts at 20 us and doubles up to the safety tick while
  // nothing moves.
  void schedule_poll(bool found);

  void schedule_tick();

  void reap_closing();

  // ---- UCX requests --------------------------------------------------------------------------

  static void on_send_done(void* request, ucs_status_t status, void* user_data);
  static void on_recv_done(void* request, ucs_status_t status, std::size_t, void* user_data);
  static void finish_request(void* request, ucs_status_t status, void* user_data);
  void untrack(pending_request& p);
  // Completes `r` now if UCX did, else when its callback runs (inside progress).
  void track(ucs_status_ptr_t r, std::unique_ptr<pending_request> p);

  ucp_request_param_t request_params(pending_request* p, bool recv_am = false);

  // Sends one active message on a connection. `keep` owns what header and data point into.
  result<void> send_am(connection& c, am_id id, const void* header, std::size_t header_len,
                       const void* data, std::size_t len, std::shared_ptr<void> keep,
                       std::function<void(ucs_status_t)> done, ucp_mem_h memh = nullptr);

  result<void> send_envelope(connection& c, const delivery_book::header& h,
                             std::shared_ptr<kj::Array<capnp::word>> owned);
  // c became the connection we send to its peer on: what the peer has not acknowledged goes
  // again first (held until then, in order), so a failed connection loses no message.
  void resend_unacked(connection& c);
  // hold: queued behind what c holds, released by the caller (after the welcome, outside
  // progress); else sent now if c may send.
  void reissue_pull(connection& c, pull_op& op, bool hold = false);
  // A pull whose connection failed: asked again on the next one, or failed (no attempts left,
  // or this link is leaving).
  void park_or_fail_pull(std::uint64_t id, const std::string& why);
  // A new pull of `d` into `into`, asked on connection `conn` (0: parked until the peer's next).
  pull_op& add_pull(const bulk_descriptor& d, std::span<std::byte> into, std::uint64_t conn,
                    std::uint32_t rma, ucx_link::pull_handler done);
  // The peer is given up: its parked pulls fail.
  void fail_parked_pulls(node_id peer, const std::string& why);
  void release_held(std::uint64_t serial);
  // Runs `send` now, or once the peer welcomed us on this (outgoing) connection: nothing but
  // the hello may go out before, and what was held goes first (in order).
  void send_when_welcomed(connection& c, std::function<void(connection&)> send);

  // A message of the link's own protocol: a header copy lives with the request.
  template <class Header>
  void send_control(connection& c, am_id id, const Header& h, const void* data = nullptr,
                    std::size_t len = 0, std::shared_ptr<void> keep = nullptr) {
    struct holder {
      Header header;
      std::shared_ptr<void> keep;
    };
    auto hold = std::make_shared<holder>(holder{h, std::move(keep)});
    const void* hp = &hold->header;
    (void)send_am(c, id, hp, sizeof(Header), data, len, hold, [this](ucs_status_t s) {
      if (s != UCS_OK) ++stats.send_errors;
    });
  }
  void send_signal(connection& c, am_id id);

  // ---- connections -------------------------------------------------------------------------

  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status);

  connection& add_connection(ucp_ep_h ep, bool outgoing, node_id peer);

  connection* find_conn(std::uint64_t serial);

  ucp_ep_params_t ep_params();

  // An endpoint (with peer error handling) to a worker address a peer sent; nullptr if UCX
  // cannot make one of it.
  ucp_ep_h ep_to(const std::vector<std::byte>& address);

  // The acceptor's side of an admission: a new incoming connection, or why not.
  admission_reply admit(const admission_request& request, const std::string& from);
  void refused_admission(admission_refusal why, const std::string& from);
  // The dialler's side: the acceptor's answer (or the dial's failure) for connection `serial`.
  void on_admission_reply(std::uint64_t serial, result<admission_reply> reply);

  // Forgets a connection whose endpoints are closed already.
  void drop_conn(std::uint64_t serial);

  // Connections refused by the admission socket are not the job's own traffic (another
  // job, a stale token, a port scanner): said on stderr for the 1st, 2nd, 4th, 8th... of each
  // kind, with the count so far, so that a flood of them cannot flood the log.
  void report_refusal(std::uint64_t count, const std::string& from, const std::string& why);

  result<connection*> connection_to(node_id peer);

  // Closes the connection's bulk endpoint, if it has one (before the connection goes).
  void close_bulk(connection& c, bool force);
  // The bulk endpoint to c's peer, created on first use; nullptr before the peer's address
  // arrived (or if UCX refuses it).
  //
  // To a peer on this host (and UCX_TLS unset, so shared memory carries the reads) the endpoint
  // has no peer error handling: with it, UCX wires the endpoint up and tears it down through
  // the exporter's shared-memory FIFO, and a process killed in that instant wedges the FIFO
  // (see ucx_context.hpp); the pull never completed and the job stalled silently (about 1
  // launch in 9 of rollback_test's loss-during-rollback case, none in 45 without). Reads
  // from a mapped segment need no handshake. A dead exporter is still found at once, by its
  // message connection, which fails its pulls and closes this endpoint. Between hosts (no
  // FIFO; IB, RoCE or TCP, where an error without handling would be fatal) it has peer error
  // handling like every other endpoint.
  ucp_ep_h bulk_ep_of(connection& c);
  // Whether c's peer runs on this host (its bulk address leads with our host tag).
  bool on_this_host(const connection& c) const {
    return c.bulk_address.size() > host_tag_bytes &&
           std::memcmp(c.bulk_address.data(), bulk_address.data(), host_tag_bytes) == 0;
  }

  void close_ep(ucp_ep_h ep, bool force);
  // Closes c's endpoints. Unless it is leaving or told us it is, its peer is told first
  // (am_closed): each side sends on an endpoint of its own, so closing ours alone would leave
  // the peer sending into a connection we dropped.
  void close_conn(connection& c, bool force, bool tell = true);

  // Drops a connection; if it carried an admitted peer, that peer is lost. `linger`: the
  // peer closed it (am_closed), so its endpoints wait out opt.closed_linger before their
  // forced close (linger_conn).
  void fail_connection(std::uint64_t serial, const std::string& detail, bool linger = false);
  // Takes c's endpoints out of the link (their errors are no longer ours) and closes them by
  // force after opt.closed_linger, or at shutdown.
  void linger_conn(connection& c);
  void post_release_held(std::uint64_t serial);

  // Marks a peer lost (once), closes all its connections, reports it.
  void lose_peer(node_id peer, peer_loss why, const std::string& detail);

  void check_hello_timeouts();
  // On the tick (delivery_book.hpp): explicit acks due, held goodbyes past their time, resend
  // requests asked again, and probes of envelopes unacknowledged too long.
  void check_delivery();
  // A peer asked for what followed its ack again (a message went missing): it is resent.
  void answer_resend(node_id peer, const delivery_book::header& h);
  // A connection to `peer` that sends now (welcomed, nothing held), or nullptr; nullptr too
  // for a peer whose goodbye we hold, unless `even_leaving`.
  connection* sendable_conn(node_id peer, bool even_leaving = false);
  // Acts on the peer's held goodbye once nothing before it is missing, or its time is up (what
  // is still missing then is counted as skipped). May lose the peer: connections go.
  void settle_goodbye(node_id peer);

  // ---- receiving ---------------------------------------------------------------------------

  static ucs_status_t on_am(void* arg, const void* header, std::size_t header_len, void* data,
                            std::size_t len, const ucp_am_recv_param_t* param);

  ucs_status_t receive(am_id id, const void* header, std::size_t header_len, void* data,
                       std::size_t len, const ucp_am_recv_param_t* param);

  ucs_status_t on_hello(connection& c, const void* header, std::size_t header_len, std::size_t len,
                        bool rndv);

  ucs_status_t on_envelope(connection& c, const void* header, std::size_t header_len, void* data,
                           std::size_t len, bool rndv);

  // Connections whose inbox got eager envelopes during the last progress (see on_envelope).
  std::vector<std::uint64_t> ready;
  void deliver_ready();

  void post_deliver(std::uint64_t serial);
  void post_fail(std::uint64_t serial, std::string detail, bool linger = false);

  // Hands ready envelopes to the handler in arrival order.
  void deliver(std::uint64_t serial);

  // ---- bulk: the exporter's side ----------------------------------------------------------

  void serve_pull(std::uint64_t serial, const bulk_request_header& h);

  // ---- bulk: the puller's side ------------------------------------------------------------

  void finish_pull(std::uint64_t id, result<void> r);

  void fail_waiting_pulls(std::uint64_t serial, const std::string& detail);

  ucs_status_t on_bulk_reply(connection& c, am_id id, const void* header, std::size_t header_len,
                             void* data, std::size_t len, bool rndv);

  void post_finish(std::uint64_t id, result<void> r);

  void complete_transfer(std::uint64_t id, ucs_status_t st);

  // The registration of the link's region that holds [p, p + n), if any: a get into it then
  // needs no on-the-fly registration (which a get cancelled at shutdown could leave behind,
  // and UCX asserts on when its context goes).
  ucp_mem_h local_memh(const std::byte* p, std::size_t n, bool messages) const;
  void register_for_messages(region_record& r);
  static void use_memh(ucp_request_param_t& param, ucp_mem_h memh);

  void start_get(std::uint64_t id, const std::vector<std::byte>& packed, std::uint64_t address);

  // ---- bulk: leases, the importer's side ---------------------------------------------------

  // A grant arrived for pull `id`: cache the lease (unless one is cached, or the region was
  // revoked already) and read under it.
  void adopt_lease(std::uint64_t id, const std::vector<std::byte>& packed,
                   const bulk_lease_header& h);

  // Reads op's bytes at `address` of the exporter under lease `l`.
  void issue_get(pull_op& op, connection& c, const std::shared_ptr<lease>& l,
                 std::uint64_t address);
  // From a peer on this host a get is a copy UCX makes inside ucp_get_nbx, on this thread: a
  // stage's gradient (55 MB for the small preset) held it 0.2-0.5 s on a loaded host, and the
  // node's heartbeats with it. Such a get goes in pieces of get_piece_bytes, each next one
  // posted, so that timers and messages run between them. Bytes [done, op.length) remain.
  static constexpr std::size_t get_piece_bytes = std::size_t{4} << 20;
  void get_piece(std::uint64_t id, std::uint64_t serial, std::shared_ptr<lease> l,
                 std::uint64_t address, std::size_t done);

  // Takes a lease out of use; released to the exporter once its gets have completed.
  void retire(lease& l);
  void post_release(std::uint64_t serial, std::uint64_t region);

  void on_revoke(std::uint64_t serial, std::uint64_t region);

  // ---- bulk: leases, the exporter's side ---------------------------------------------------

  // The owner dropped its bulk_region: no new pull is served, and holders of leases are told
  // to stop; the memory stays mapped until they have released them.
  void withdraw(const std::shared_ptr<region_record>& r);

  void on_release(std::uint64_t serial, std::uint64_t region);

  // A connection is gone: what it held is released (its process cannot read any more, or
  // reads what it has mapped of the segment, which outlives our mapping).
  void drop_grants(std::uint64_t serial);

  // How native the endpoint's RMA is, from the lanes UCX chose (ucp_ep_print_info): rma_bw
  // lanes (registered user memory) and get lanes (memory of the transports' own kind). Lanes
  // over TCP only emulate RMA (slower than rendezvous), so they do not count.
  static std::string describe(ucp_ep_h ep);
  static std::optional<std::uint32_t> detect_rma_level(ucp_ep_h ep);

  // ---- shutdown ----------------------------------------------------------------------------

  void shutdown();
};

}  // namespace detail
}  // namespace moevement::transport
