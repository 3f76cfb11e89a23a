#include "transport/ucx_link.hpp"

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

namespace moevement::transport {
namespace detail {
namespace {

using clock = std::chrono::steady_clock;

// MOEVEMENT_TRACE_LINK=1: one stderr line per connection event (connect, accept, hello,
// welcome, failure, peer loss, goodbye, pull), for diagnosing stalls between processes.
bool link_tracing() {
  static const bool on = std::getenv("MOEVEMENT_TRACE_LINK") != nullptr;
  return on;
}

// Active message ids of the link's own protocol.
enum am_id : unsigned {
  am_hello = 1,     // header hello_header, data: the job token, then the bulk worker address
  am_welcome,       // header welcome_header, data: the acceptor's bulk worker address
  am_refused,       // no payload: the acceptor refused our token
  am_envelope,      // header delivery_book::header, data: one serialized envelope
  am_goodbye,       // no payload: the sender is shutting down cleanly
  am_bulk_request,  // header bulk_request_header
  am_bulk_data,     // header bulk_reply_header, data: the bytes (rendezvous when large)
  am_bulk_rkey,     // header bulk_reply_header, data: the packed rkey
  am_bulk_error,    // header bulk_reply_header (code says why)
  am_bulk_lease,    // header bulk_lease_header, data: the packed rkey (a lease on the region)
  am_bulk_revoke,   // header region_header: the exporter withdrew a region we hold a lease on
  am_bulk_release,  // header region_header: the importer gives one lease back
  am_ack,           // header delivery_book::header: envelopes handed on (delivery_book.hpp)
};
constexpr am_id all_am_ids[] = {am_hello,      am_welcome,      am_refused,     am_envelope,
                                am_goodbye,    am_bulk_request, am_bulk_data,   am_bulk_rkey,
                                am_bulk_error, am_bulk_lease,   am_bulk_revoke, am_bulk_release,
                                am_ack};

constexpr std::uint32_t wire_magic = 0x56454f4d;  // "MOEV"
constexpr std::uint32_t wire_version = 5;
constexpr std::size_t max_token_bytes = 256;
constexpr std::size_t max_address_bytes = 8192;  // a UCX worker address is a few hundred
constexpr std::size_t host_tag_bytes = 8;        // leads the bulk address, see bulk_ep_of

constexpr std::size_t max_rkey_bytes = 4096;

struct hello_header {
  std::uint32_t magic, version, node, token_bytes, address_bytes, reserved;
};
struct welcome_header {
  std::uint32_t magic, version, node, address_bytes;
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
std::uint64_t new_session() {
  std::random_device rd;
  std::uint64_t v = (std::uint64_t{rd()} << 32) ^ rd() ^
                    static_cast<std::uint64_t>(clock::now().time_since_epoch().count());
  return v == 0 ? 1 : v;
}

template <class T>
bool read_header(const void* header, std::size_t length, T& out) {
  if (length != sizeof(T)) return false;
  std::memcpy(&out, header, sizeof(T));
  return true;
}

bool same_token(const std::string& a, const void* b, std::size_t b_len) {
  // Constant time in the token's content, so a prober learns nothing from timing.
  if (a.size() != b_len) return false;
  unsigned char diff = 0;
  const auto* p = static_cast<const unsigned char*>(b);
  for (std::size_t i = 0; i < b_len; ++i) diff |= static_cast<unsigned char>(a[i]) ^ p[i];
  return diff == 0;
}

void check_status(ucs_status_t status, const std::string& what) {
  if (status != UCS_OK) {
    throw std::runtime_error(fmt::format("{} failed: {} (see docs/transport.md for UCX settings)",
                                         what, ucs_status_string(status)));
  }
}

sockaddr_storage resolve(const std::string& host, std::uint16_t port, socklen_t& len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res); rc != 0) {
    throw std::runtime_error(
        fmt::format("cannot resolve '{}': {} (give a host name or an IP "
                    "address this machine can reach)",
                    host, ::gai_strerror(rc)));
  }
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  len = res->ai_addrlen;
  ::freeaddrinfo(res);
  return ss;
}

// Whether the listener's address is a loopback one (then every peer is on this host).
bool on_loopback(const std::string& host) {
  socklen_t len = 0;
  const sockaddr_storage ss = resolve(host, 0, len);
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    return (ntohl(a->sin_addr.s_addr) >> 24) == 127;
  }
  const auto* a6 = reinterpret_cast<const sockaddr_in6*>(&ss);
  return ss.ss_family == AF_INET6 && IN6_IS_ADDR_LOOPBACK(&a6->sin6_addr);
}

// "host:port" of a connecting client, for the refusal reports.
std::string address_text(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    return fmt::format("{}:{}", host, ntohs(a->sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    return fmt::format("[{}]:{}", host, ntohs(a->sin6_port));
  }
  return host;
}

// A dup of `fd` that is closed on exec: our copies of UCX's event fds are not a child's.
int dup_cloexec(int fd) {
  return ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
}

}  // namespace

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

namespace {

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
  ucp_ep_h ep = nullptr;  // messages (on the link's message worker)
  // RMA reads from the peer's bulk worker, created on first use from the address the peer
  // sent in its hello or welcome (known only once it is admitted).
  ucp_ep_h bulk_ep = nullptr;
  std::vector<std::byte> bulk_address;
  bool outgoing = false;
  bool admitted = false;  // outgoing: from the start; incoming: after a valid hello
  bool welcomed = false;  // outgoing: the acceptor admitted us (the endpoint is wired)
  node_id peer = 0;
  std::string from;  // incoming: the client's address, for the refusal reports
  clock::time_point created;
  std::deque<std::shared_ptr<inbound>> inbox;
  bool deliver_posted = false;  // one deliver() handler at a time, however many arrive
  // Outgoing: everything but the hello (envelopes, pull requests) issued before the welcome,
  // sent in order once it arrives. UCX 1.13 on shared memory fails sends queued while the
  // endpoint is wiring up (measured: "Invalid am_short_iov length: 168 (expected: <= 100)",
  // the message lost) when several go out back to back on a fresh endpoint, and it may deliver
  // a message sent after the hello before it (seen: a pull request overtook the hello, the
  // acceptor dropped it as unadmitted and the pull never completed: a silent job stall).
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

}  // namespace

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
  std::vector<std::byte> bulk_address;  // bulk_worker's, sent to every peer we admit or join
  ucp_listener_h listener = nullptr;
  std::uint16_t port = 0;
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
  delivery_book book{new_session()};

  std::uint64_t next_serial = 1;
  std::map<std::uint64_t, std::unique_ptr<connection>> conns;
  std::unordered_map<ucp_ep_h, std::uint64_t> by_ep;
  std::unordered_map<ucp_ep_h, std::uint64_t> by_bulk_ep;
  std::map<node_id, peer_entry> peers;
  std::vector<void*> closing;  // ucp_ep_close_nbx requests not yet complete
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

  void start() {
    const int dup_fd = dup_cloexec(worker.event_fd());
    if (dup_fd < 0) throw std::runtime_error("dup of the UCX worker event fd failed");
    fd.assign(dup_fd);
    const int bulk_dup_fd = dup_cloexec(bulk_worker.event_fd());
    if (bulk_dup_fd < 0) throw std::runtime_error("dup of the UCX bulk worker event fd failed");
    bulk_fd.assign(bulk_dup_fd);
    // What we send: our host tag, then the bulk worker's UCX address.
    const std::uint64_t tag = host_tag();
    bulk_address.resize(host_tag_bytes);
    std::memcpy(bulk_address.data(), &tag, host_tag_bytes);
    const auto address = bulk_worker.address();
    bulk_address.insert(bulk_address.end(), address.begin(), address.end());
    for (am_id id : all_am_ids) {
      ucp_am_handler_param_t p{};
      p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                     UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
      p.id = id;
      p.flags = UCP_AM_FLAG_WHOLE_MSG;
      p.cb = &on_am;
      p.arg = new_am_arg(id);
      check_status(ucp_worker_set_am_recv_handler(worker.handle(), &p),
                   "ucp_worker_set_am_recv_handler");
    }
    socklen_t len = 0;
    sockaddr_storage ss = resolve(opt.listen_host, opt.listen_port, len);
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
    lp.sockaddr.addrlen = len;
    lp.conn_handler.cb = &on_conn_request;
    lp.conn_handler.arg = this;
    check_status(ucp_listener_create(worker.handle(), &lp, &listener),
                 fmt::format("listening on {}:{}", opt.listen_host, opt.listen_port));
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    check_status(ucp_listener_query(listener, &attr), "ucp_listener_query");
    if (attr.sockaddr.ss_family == AF_INET) {
      port = ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port);
    } else {
      port = ntohs(reinterpret_cast<const sockaddr_in6*>(&attr.sockaddr)->sin6_port);
    }
    schedule_tick();
    kick();
  }

  // The AM callback gets the link and the id through one pointer: ids are small, so the
  // argument is the address of an element of am_args.
  std::array<std::pair<link_state*, am_id>, 16> am_args{};
  void* new_am_arg(am_id id) {
    am_args[id] = {this, id};
    return &am_args[id];
  }

  void kick() {
    if (kick_pending || dying) return;
    kick_pending = true;
    asio::post(io, [w = weak_from_this()] {
      if (auto s = w.lock()) {
        s->kick_pending = false;
        s->pump();
      }
    });
  }

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
  void pump(wake why = wake::kick) {
    if (dying) return;
    bool found = false;
    while ((worker.progress() + bulk_worker.progress()) != 0) found = true;
    deliver_ready();
    if (dying) return;  // a handler destroyed the link
    if (found) {
      if (why == wake::tick) ++counters.tick_progress;
      if (why == wake::poll) ++counters.poll_progress;
      if (why == wake::fd) ++counters.fd_progress;
    }
    const auto now = clock::now();
    if (found) {
      if (spinning) {
        ++counters.spin_progress;
        grow_spin();
      }
      last_activity = now;
    }
    reap_closing();
    if (now - last_activity < spin_now) {
      spinning = true;
      // An idle pass of the spin gives the core away: on an oversubscribed machine the peer
      // whose answer we wait for may be queued behind us on this very core (on an idle core
      // the yield returns at once). A yield that took long means another process ran: the
      // cores are oversubscribed and every spin takes time from the others (measured: a
      // training job with two other busy processes on 2 cores, at load 6-9, ran 1.5-3x slower
      // per iteration with the spin on), so stop spinning for a while.
      if (opt.spin_yield && !found) {
        ::sched_yield();
        if (clock::now() - now > contended_yield) {
          ++counters.spin_backoffs;
          contended_until = now + contention_backoff;
          spin_now = std::chrono::nanoseconds(0);
          spinning = false;  // what the next pass finds was not caught by a cheap spin
        }
      }
      kick();
      return;
    }
    if (spinning) shrink_spin();
    spinning = false;
    ucs_status_t s = ucp_worker_arm(worker.handle());
    if (s == UCS_OK) s = ucp_worker_arm(bulk_worker.handle());
    ++counters.arms;
    if (s == UCS_ERR_BUSY) {
      ++counters.arm_busy;
      // BUSY means events arrived between progress and arm: the next pass finds them. A run
      // of BUSY with nothing found means UCX is stuck on something our progress cannot finish
      // (see ucx_worker for the case we know); then poll instead of spinning on the core.
      busy_idle = found ? 0 : busy_idle + 1;
      if (busy_idle < max_busy_idle) {
        kick();
      } else {
        ++counters.arm_stuck;
        schedule_poll(found);
      }
      return;
    }
    busy_idle = 0;
    if (s != UCS_OK) {
      ++counters.arm_errors;
      return;  // the safety tick keeps progressing
    }
    // Requests in flight may need our progress without any event arriving (a send waiting for
    // room in a full shared-memory FIFO: the receiver draining it signals nothing, and the
    // worker wakes us for arriving data only).
    if (outstanding > 0) schedule_poll(found);
    wait_on(fd, fd_waiting);
    wait_on(bulk_fd, bulk_fd_waiting);
  }
  void wait_on(asio::posix::stream_descriptor& d, bool& waiting) {
    if (waiting) return;
    waiting = true;
    d.async_wait(asio::posix::stream_descriptor::wait_read,
                 [w = weak_from_this(), &waiting](const std::error_code& ec) {
                   auto s = w.lock();
                   if (!s) return;
                   waiting = false;
                   if (!ec) {
                     const auto now = clock::now();
                     s->cover_wait(now - s->last_activity);
                     s->last_activity = now;
                     s->pump(wake::fd);
                   }
                 });
  }
  void grow_spin() {
    if (clock::now() < contended_until) return;
    spin_now = std::min<std::chrono::nanoseconds>(
        opt.spin, std::max<std::chrono::nanoseconds>(2 * spin_now, std::chrono::microseconds(1)));
  }
  // An event woke us `waited` after the last activity (the spin, if any, and the sleep
  // together). Sooner than opt.spin, a window that long would have caught it: take the window
  // there at once, with a margin for the wakeup's own cost. (Doubling from 0 on each such wake
  // and halving on each fruitless spin never got past 1 us: the window oscillated between 0
  // and 1 us and every hop paid the wakeup.)
  void cover_wait(std::chrono::nanoseconds waited) {
    if (waited >= opt.spin || clock::now() < contended_until) return;
    spin_now = std::min<std::chrono::nanoseconds>(
        opt.spin,
        std::max<std::chrono::nanoseconds>(
            {spin_now, waited * 3 / 2, std::chrono::nanoseconds(std::chrono::microseconds(1))}));
  }
  void shrink_spin() {
    spin_now /= 2;
    if (spin_now < std::chrono::microseconds(1)) spin_now = std::chrono::nanoseconds(0);
  }
  // A pump after poll_interval, which starts at 20 us and doubles up to the safety tick while
  // nothing moves.
  void schedule_poll(bool found) {
    poll_interval = found || request_started
                        ? std::chrono::nanoseconds(20'000)
                        : std::min<std::chrono::nanoseconds>(2 * poll_interval, opt.safety_tick);
    request_started = false;
    if (poll_pending) return;
    poll_pending = true;
    poll.expires_after(poll_interval);
    poll.async_wait([w = weak_from_this()](const std::error_code& ec) {
      auto st = w.lock();
      if (!st) return;
      st->poll_pending = false;
      if (!ec) st->pump(wake::poll);
    });
  }

  void schedule_tick() {
    tick.expires_after(opt.safety_tick);
    tick.async_wait([w = weak_from_this()](const std::error_code& ec) {
      auto s = w.lock();
      if (!s || ec || s->dying) return;
      s->check_hello_timeouts();
      s->pump(wake::tick);
      s->schedule_tick();
    });
  }

  void reap_closing() {
    std::erase_if(closing, [](void* req) {
      if (ucp_request_check_status(req) == UCS_INPROGRESS) return false;
      ucp_request_free(req);
      return true;
    });
  }

  // ---- UCX requests --------------------------------------------------------------------------

  static void on_send_done(void* request, ucs_status_t status, void* user_data) {
    finish_request(request, status, user_data);
  }
  static void on_recv_done(void* request, ucs_status_t status, std::size_t, void* user_data) {
    finish_request(request, status, user_data);
  }
  static void finish_request(void* request, ucs_status_t status, void* user_data) {
    auto* raw = static_cast<pending_request*>(user_data);
    ucp_request_free(request);
    if (!raw->issued) {  // inside the starting call: track() owns it still
      raw->early = true;
      raw->early_status = status;
      return;
    }
    std::unique_ptr<pending_request> p(raw);
    if (p->owner != nullptr) p->owner->untrack(*p);
    p->done(status);
  }
  void untrack(pending_request& p) {
    inflight[p.slot] = inflight.back();
    inflight[p.slot]->slot = p.slot;
    inflight.pop_back();
    --outstanding;
  }
  // Completes `r` now if UCX did, else when its callback runs (inside progress).
  void track(ucs_status_ptr_t r, std::unique_ptr<pending_request> p) {
    p->issued = true;
    if (r == nullptr) {
      p->done(UCS_OK);
    } else if (UCS_PTR_IS_ERR(r)) {
      p->done(UCS_PTR_STATUS(r));
    } else if (p->early) {  // completed (and freed) inside the starting call
      p->done(p->early_status);
    } else {
      ++outstanding;
      p->owner = this;
      p->request = r;
      p->slot = inflight.size();
      inflight.push_back(p.get());
      request_started = true;
      last_activity = clock::now();  // its completion may come soon: worth a spin
      p.release();                   // owned by the request's callback now
    }
  }

  ucp_request_param_t request_params(pending_request* p, bool recv_am = false) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    if (recv_am) {
      param.cb.recv_am = &on_recv_done;
    } else {
      param.cb.send = &on_send_done;
    }
    param.user_data = p;
    return param;
  }

  // Sends one active message on a connection. `keep` owns what header and data point into.
  result<void> send_am(connection& c, am_id id, const void* header, std::size_t header_len,
                       const void* data, std::size_t len, std::shared_ptr<void> keep,
                       std::function<void(ucs_status_t)> done, ucp_mem_h memh = nullptr) {
    auto p = std::make_unique<pending_request>();
    p->keep = std::move(keep);
    p->done = std::move(done);
    ucp_request_param_t param = request_params(p.get());
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_REPLY;  // the receiver learns which endpoint it came on
    if (memh != nullptr) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      param.memh = memh;
    }
    ucs_status_ptr_t r = ucp_am_send_nbx(c.ep, id, header, header_len, data, len, &param);
    last_activity = clock::now();  // an answer may follow soon: worth a spin
    if (UCS_PTR_IS_ERR(r)) {
      ++stats.send_errors;
      return error{fmt::format("sending to node {} failed: {}", c.peer,
                               ucs_status_string(UCS_PTR_STATUS(r)))};
    }
    track(r, std::move(p));
    kick();
    return {};
  }

  result<void> send_envelope(connection& c, const delivery_book::header& h,
                             std::shared_ptr<kj::Array<capnp::word>> owned) {
    struct holder {
      delivery_book::header header;
      std::shared_ptr<kj::Array<capnp::word>> words;
    };
    auto hold = std::make_shared<holder>(holder{h, std::move(owned)});
    const void* data = hold->words->begin();
    const std::size_t bytes = hold->words->size() * sizeof(capnp::word);
    return send_am(c, am_envelope, &hold->header, sizeof(delivery_book::header), data, bytes, hold,
                   [this](ucs_status_t status) {
                     if (status != UCS_OK) ++stats.send_errors;
                   });
  }
  // c became the connection we send to its peer on: what the peer has not acknowledged goes
  // again first (held until then, in order), so a failed connection loses no message.
  void resend_unacked(connection& c) {
    auto kept = book.unacked(c.peer);
    counters.resent += kept.size();
    for (auto& k : kept) {
      c.held.push_back([this, k = std::move(k)](connection& conn) {
        (void)send_envelope(conn, book.restamp(conn.peer, k.seq), k.message);
      });
    }
    for (auto& [id, op] : pulls) {
      if (op->peer == c.peer && op->conn == 0) reissue_pull(c, *op, /*hold=*/true);
    }
  }
  // hold: queued behind what c holds, released by the caller (after the welcome, outside
  // progress); else sent now if c may send.
  void reissue_pull(connection& c, pull_op& op, bool hold = false) {
    op.conn = c.serial;
    ++op.attempts;
    ++counters.pulls_retried;
    const std::uint32_t flags =
        opt.lease_regions && op.rma != rma_none ? std::uint32_t{accepts_lease} : 0u;
    const bulk_request_header request{op.id, op.region, op.offset, op.length, op.rma, flags};
    auto send = [this, request](connection& conn) { send_control(conn, am_bulk_request, request); };
    if (hold) {
      c.held.push_back(std::move(send));
    } else {
      send_when_welcomed(c, std::move(send));
    }
  }
  // A pull whose connection failed: asked again on the next one, or failed (no attempts left,
  // or this link is leaving).
  void park_or_fail_pull(std::uint64_t id, const std::string& why) {
    auto it = pulls.find(id);
    if (it == pulls.end()) return;
    pull_op& op = *it->second;
    auto pe = peers.find(op.peer);
    if (op.attempts >= max_pull_attempts || said_goodbye || pe == peers.end() ||
        (pe->second.lost && !pe->second.kept)) {
      return finish_pull(id, error{"pull failed: peer lost: " + why});
    }
    if (op.under) {  // the lease was the old connection's
      auto& l = *op.under;
      --l.gets;
      if (l.retired && l.gets == 0) post_release(l.conn, l.region);
      op.under.reset();
    }
    op.conn = 0;
    op.transferring = false;
    // A connection to the peer is up already (it redialled first): asked again there now.
    if (connection* c = find_conn(pe->second.send_conn)) reissue_pull(*c, op);
  }
  // The peer is given up: its parked pulls fail.
  void fail_parked_pulls(node_id peer, const std::string& why) {
    std::vector<std::uint64_t> ids;
    for (auto& [id, op] : pulls) {
      if (op->peer == peer && op->conn == 0) ids.push_back(id);
    }
    for (auto id : ids) finish_pull(id, error{"pull failed: peer lost: " + why});
  }
  void release_held(std::uint64_t serial) {
    connection* c = find_conn(serial);
    if (c == nullptr) return;
    while (!c->held.empty()) {
      auto send = std::move(c->held.front());
      c->held.pop_front();
      send(*c);  // a failure is counted in send_am
    }
  }
  // Runs `send` now, or once the peer welcomed us on this (outgoing) connection: nothing but
  // the hello may go out before, and what was held goes first (in order).
  void send_when_welcomed(connection& c, std::function<void(connection&)> send) {
    if ((c.outgoing && !c.welcomed) || !c.held.empty()) {
      ++counters.held_sends;
      c.held.push_back(std::move(send));
      return;
    }
    send(c);
  }

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
  void send_signal(connection& c, am_id id) {
    (void)send_am(c, id, nullptr, 0, nullptr, 0, nullptr, [this](ucs_status_t s) {
      if (s != UCS_OK) ++stats.send_errors;
    });
  }

  // ---- connections -------------------------------------------------------------------------

  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* s = static_cast<link_state*>(arg);
    auto it = s->by_ep.find(ep);
    if (it == s->by_ep.end()) {
      it = s->by_bulk_ep.find(ep);
      if (it == s->by_bulk_ep.end()) return;
    }
    const std::uint64_t serial = it->second;
    if (link_tracing()) {
      fmt::print(stderr, "[link {}] endpoint error on conn {}: {}\n", s->opt.self, serial,
                 ucs_status_string(status));
    }
    asio::post(s->io, [w = s->weak_from_this(), serial, status] {
      if (auto st = w.lock()) {
        st->fail_connection(serial, fmt::format("endpoint error: {}", ucs_status_string(status)));
      }
    });
  }

  connection& add_connection(ucp_ep_h ep, bool outgoing, node_id peer) {
    auto c = std::make_unique<connection>();
    c->serial = next_serial++;
    c->ep = ep;
    c->outgoing = outgoing;
    c->admitted = outgoing;
    c->peer = peer;
    c->created = clock::now();
    auto& ref = *c;
    by_ep[ep] = c->serial;
    conns[c->serial] = std::move(c);
    return ref;
  }

  connection* find_conn(std::uint64_t serial) {
    auto it = conns.find(serial);
    return it == conns.end() ? nullptr : it->second.get();
  }

  ucp_ep_params_t ep_params() {
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = &on_ep_error;
    p.err_handler.arg = this;
    return p;
  }

  static void on_conn_request(ucp_conn_request_h request, void* arg) {
    auto* s = static_cast<link_state*>(arg);
    // Endpoints are not created inside progress; the accept runs as a posted handler.
    asio::post(s->io, [w = s->weak_from_this(), request, listener = s->listener] {
      auto st = w.lock();
      if (!st || st->dying || st->said_goodbye) {  // leaving: as for a dial, nothing new
        if (st) ucp_listener_reject(listener, request);
        return;
      }
      st->accept(request);
    });
  }

  // The address part of "host:port" (or "[v6]:port").
  static std::string source_of(const std::string& from) {
    return from.substr(0, std::min(from.rfind(':'), from.size()));
  }

  std::size_t half_open_from(const std::string& source) const {
    std::size_t n = 0;
    for (const auto& [serial, c] : conns) {
      n += !c->outgoing && !c->admitted && source_of(c->from) == source;
    }
    return n;
  }

  void accept(ucp_conn_request_h request) {
    const std::string from = client_of(request);  // before ucp_ep_create, which frees it
    if (half_open_from(source_of(from)) >= opt.max_half_open_per_source) {
      ucp_listener_reject(listener, request);  // frees the request; the listener listens on
      ++counters.half_open_refused;
      report_refusal(counters.half_open_refused, from,
                     fmt::format("{} connections from it not admitted yet (the limit)",
                                 opt.max_half_open_per_source));
      return;
    }
    ucp_ep_params_t p = ep_params();
    p.field_mask |= UCP_EP_PARAM_FIELD_CONN_REQUEST;
    p.conn_request = request;
    ucp_ep_h ep = nullptr;
    if (const ucs_status_t st = ucp_ep_create(worker.handle(), &p, &ep); st != UCS_OK) {
      // Not a client of ours (bytes that framed as a UCX request, another UCX). Nothing to
      // close: UCX 1.13 has rejected and freed the request on every failing path but one (an
      // unknown request version, which it leaks), so a reject here would free it twice. The
      // listener is untouched and keeps listening.
      ++counters.failed_accepts;
      report_refusal(counters.failed_accepts, from,
                     fmt::format("not a UCX client of this link ({})", ucs_status_string(st)));
      return;
    }
    auto& c = add_connection(ep, /*outgoing=*/false, 0);
    c.from = from;
    LINK_TRACE("accepted conn {} from {}", c.serial, from);
    kick();
  }

  static std::string client_of(ucp_conn_request_h request) {
    ucp_conn_request_attr_t attr{};
    attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
    if (ucp_conn_request_query(request, &attr) != UCS_OK) return "?";
    return address_text(attr.client_address);
  }

  // Connections refused or closed before admission are not the job's own traffic (another
  // job, a stale token, a port scanner): said on stderr for the 1st, 2nd, 4th, 8th... of each
  // kind, with the count so far, so that a flood of them cannot flood the log.
  void report_refusal(std::uint64_t count, const std::string& from, const std::string& why) {
    if ((count & (count - 1)) != 0) return;
    fmt::print(stderr, "[link {}] refused a connection from {}: {} ({} so far)\n", opt.self,
               from.empty() ? "?" : from, why, count);
  }

  result<connection*> connection_to(node_id peer) {
    auto it = peers.find(peer);
    if (it == peers.end()) {
      return error{fmt::format("unknown node {}: call add_peer() with its address first", peer)};
    }
    auto& pe = it->second;
    if (pe.lost) return error{fmt::format("node {} is lost; re-add it once it is back", peer)};
    if (auto* c = find_conn(pe.send_conn)) return c;
    if (!pe.addressed) return error{fmt::format("no address for node {}", peer)};
    // Leaving: no new connection. One still being set up when the worker goes leaves UCX 1.13's
    // connection manager a handler that its async thread then runs on freed memory.
    if (said_goodbye) return error{fmt::format("not dialling node {}: this node is leaving", peer)};
    socklen_t len = 0;
    sockaddr_storage ss{};
    try {
      ss = resolve(pe.host, pe.port, len);
    } catch (const std::exception& e) {
      return error{e.what()};
    }
    ucp_ep_params_t p = ep_params();
    p.field_mask |= UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
    p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
    p.sockaddr.addrlen = len;
    ucp_ep_h ep = nullptr;
    if (const ucs_status_t st = ucp_ep_create(worker.handle(), &p, &ep); st != UCS_OK) {
      return error{fmt::format("cannot connect to node {} at {}:{}: {}", peer, pe.host, pe.port,
                               ucs_status_string(st))};
    }
    connection& c = add_connection(ep, /*outgoing=*/true, peer);
    pe.send_conn = c.serial;
    LINK_TRACE("connecting to node {} on conn {}", peer, c.serial);
    auto token = std::make_shared<std::string>(opt.job_token);
    token->append(reinterpret_cast<const char*>(bulk_address.data()), bulk_address.size());
    hello_header h{wire_magic,
                   wire_version,
                   opt.self,
                   static_cast<std::uint32_t>(opt.job_token.size()),
                   static_cast<std::uint32_t>(bulk_address.size()),
                   0};
    send_control(c, am_hello, h, token->data(), token->size(), token);
    resend_unacked(c);
    return &c;
  }

  // Closes the connection's bulk endpoint, if it has one (before the connection goes).
  void close_bulk(connection& c, bool force) {
    if (c.bulk_ep == nullptr) return;
    by_bulk_ep.erase(c.bulk_ep);
    close_ep(c.bulk_ep, force);
    c.bulk_ep = nullptr;
  }
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
  ucp_ep_h bulk_ep_of(connection& c) {
    if (c.bulk_ep != nullptr || c.bulk_address.size() <= host_tag_bytes) return c.bulk_ep;
    const bool same_host =
        std::memcmp(c.bulk_address.data(), bulk_address.data(), host_tag_bytes) == 0;
    const bool tls_default = std::getenv("UCX_TLS") == nullptr;
    ucp_ep_params_t p = same_host && tls_default ? ucp_ep_params_t{} : ep_params();
    p.field_mask |= UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    p.address = reinterpret_cast<const ucp_address_t*>(c.bulk_address.data() + host_tag_bytes);
    ucp_ep_h ep = nullptr;
    if (ucp_ep_create(bulk_worker.handle(), &p, &ep) != UCS_OK) return nullptr;
    c.bulk_ep = ep;
    by_bulk_ep[ep] = c.serial;
    LINK_TRACE("bulk endpoint to node {} on conn {} ({})", c.peer, c.serial,
               same_host && tls_default ? "same host, no error handling" : "peer error handling");
    kick();
    return ep;
  }

  void close_ep(ucp_ep_h ep, bool force) {
    by_ep.erase(ep);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) closing.push_back(r);
    kick();
  }

  // Drops a connection; if it carried an admitted peer, that peer is lost.
  void fail_connection(std::uint64_t serial, const std::string& detail) {
    connection* c = find_conn(serial);
    if (c == nullptr) return;
    const bool admitted = c->admitted;
    const node_id peer = c->peer;
    const bool refused = c->outgoing && !c->welcomed;  // our dial: the peer never answered
    LINK_TRACE("failing conn {} (node {}, admitted {}): {}", serial, peer, admitted, detail);
    close_bulk(*c, /*force=*/true);
    close_ep(c->ep, /*force=*/true);
    conns.erase(serial);
    drop_grants(serial);
    fail_waiting_pulls(serial, detail);
    if (!admitted) return;
    // Another connection to that peer still works (one each way, or a redial overtook this
    // failure): the peer is not lost; its messages go on there, what was unacked first.
    for (auto& [other, oc] : conns) {
      if (!oc->admitted || oc->peer != peer) continue;
      auto& pe = peers[peer];
      if (find_conn(pe.send_conn) == nullptr) {
        pe.send_conn = other;
        resend_unacked(*oc);
        if (!oc->outgoing || oc->welcomed) post_release_held(other);  // else at the welcome
      }
      return;
    }
    lose_peer(peer, refused ? peer_loss::refused : peer_loss::crash, detail);
  }
  void post_release_held(std::uint64_t serial) {
    asio::post(io, [w = weak_from_this(), serial] {
      if (auto st = w.lock()) st->release_held(serial);
    });
  }

  // Marks a peer lost (once), closes all its connections, reports it.
  void lose_peer(node_id peer, peer_loss why, const std::string& detail) {
    auto it = peers.find(peer);
    if (it == peers.end() || it->second.lost) return;
    // After our own goodbye, peers closing on us is expected, not news.
    if (said_goodbye) why = peer_loss::goodbye;
    LINK_TRACE("node {} lost ({}): {}", peer, why == peer_loss::goodbye ? "goodbye" : "failure",
               detail);
    it->second.lost = true;
    it->second.kept = why != peer_loss::goodbye;
    it->second.send_conn = 0;
    it->second.path_known = false;
    if (why == peer_loss::goodbye) {
      book.forget(peer);
      fail_parked_pulls(peer, detail);
    }
    std::vector<std::uint64_t> doomed;
    for (auto& [serial, c] : conns) {
      if (c->admitted && c->peer == peer) doomed.push_back(serial);
    }
    for (auto serial : doomed) {
      close_bulk(*conns[serial], why != peer_loss::goodbye);
      close_ep(conns[serial]->ep, why != peer_loss::goodbye);
      conns.erase(serial);
      drop_grants(serial);
      fail_waiting_pulls(serial, detail);
    }
    if (handlers.on_peer_lost) {
      asio::post(io, [w = weak_from_this(), peer, why, detail] {
        if (auto s = w.lock()) {
          if (s->handlers.on_peer_lost) s->handlers.on_peer_lost(peer, why, detail);
        }
      });
    }
  }

  void check_hello_timeouts() {
    const auto now = clock::now();
    std::vector<std::uint64_t> silent;
    for (auto& [serial, c] : conns) {
      if (!c->outgoing && !c->admitted && now - c->created > opt.hello_timeout) {
        silent.push_back(serial);
      }
    }
    for (auto serial : silent) {
      ++counters.hello_timeouts;
      if (const connection* c = find_conn(serial)) {
        report_refusal(counters.hello_timeouts, c->from, "no hello within hello_timeout");
      }
      fail_connection(serial, "no hello within the timeout");
    }
  }

  // ---- receiving ---------------------------------------------------------------------------

  static ucs_status_t on_am(void* arg, const void* header, std::size_t header_len, void* data,
                            std::size_t len, const ucp_am_recv_param_t* param) {
    auto* a = static_cast<std::pair<link_state*, am_id>*>(arg);
    return a->first->receive(a->second, header, header_len, data, len, param);
  }

  ucs_status_t receive(am_id id, const void* header, std::size_t header_len, void* data,
                       std::size_t len, const ucp_am_recv_param_t* param) {
    last_activity = clock::now();
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0 || param->reply_ep == nullptr) {
      ++stats.malformed;  // we cannot tell who sent it
      return UCS_OK;      // drops it (a rendezvous is completed empty for the sender)
    }
    auto it = by_ep.find(param->reply_ep);
    if (it == by_ep.end()) {
      LINK_TRACE("am {} on an unknown endpoint dropped", unsigned(id));
      return UCS_OK;  // a connection being closed
    }
    connection& c = *conns.at(it->second);
    if (id == am_hello) return on_hello(c, header, header_len, data, len, rndv);
    if (!c.admitted) {
      LINK_TRACE("am {} before the hello on conn {} dropped", unsigned(id), c.serial);
      ++stats.malformed;  // nothing but a hello is accepted before admission
      return UCS_OK;
    }
    switch (id) {
      case am_welcome: {
        welcome_header h{};
        if (!c.outgoing || rndv || !read_header(header, header_len, h) || h.magic != wire_magic ||
            h.node != c.peer || h.address_bytes != len || len > max_address_bytes) {
          ++stats.malformed;
          post_fail(c.serial, "bad welcome (is another node listening at that address?)");
          return UCS_OK;
        }
        c.welcomed = true;
        c.bulk_address.assign(static_cast<const std::byte*>(data),
                              static_cast<const std::byte*>(data) + len);
        LINK_TRACE("welcomed by node {} on conn {}", c.peer, c.serial);
        if (!c.held.empty()) {  // not inside progress: sends go out from a posted handler
          asio::post(io, [w = weak_from_this(), serial = c.serial] {
            if (auto st = w.lock()) st->release_held(serial);
          });
        }
        return UCS_OK;
      }
      case am_refused:
        if (c.outgoing) {
          post_lose(c.peer, peer_loss::refused, "refused by the peer: wrong job token");
        }
        return UCS_OK;
      case am_envelope:
        return on_envelope(c, header, header_len, data, len, rndv);
      case am_ack: {
        delivery_book::header h{};
        if (!read_header(header, header_len, h) || len != 0) {
          ++stats.malformed;
          return UCS_OK;
        }
        book.acked(c.peer, h.ack_session, h.ack_seq);
        return UCS_OK;
      }
      case am_goodbye: {
        LINK_TRACE("goodbye from node {} on conn {} (header {} B, data {} B)", c.peer, c.serial,
                   header_len, len);
        auto in = std::make_shared<inbound>();
        in->what = inbound::kind::goodbye;
        in->ready = true;
        c.inbox.push_back(in);
        post_deliver(c.serial);
        return UCS_OK;
      }
      case am_bulk_request: {
        bulk_request_header h{};
        if (!read_header(header, header_len, h) || len != 0) {
          ++stats.malformed;
          return UCS_OK;
        }
        asio::post(io, [w = weak_from_this(), serial = c.serial, h] {
          if (auto s = w.lock()) s->serve_pull(serial, h);
        });
        return UCS_OK;
      }
      case am_bulk_data:
      case am_bulk_rkey:
      case am_bulk_error:
      case am_bulk_lease:
        return on_bulk_reply(c, id, header, header_len, data, len, rndv);
      case am_bulk_revoke:
      case am_bulk_release: {
        region_header h{};
        if (!read_header(header, header_len, h) || len != 0) {
          ++stats.malformed;
          return UCS_OK;
        }
        // Not inside progress: a release may unmap a region, a revocation may send.
        asio::post(io, [w = weak_from_this(), serial = c.serial, region = h.region, id] {
          auto s = w.lock();
          if (!s) return;
          if (id == am_bulk_revoke) {
            s->on_revoke(serial, region);
          } else {
            s->on_release(serial, region);
          }
        });
        return UCS_OK;
      }
      default:
        LINK_TRACE("unknown am {} on conn {} dropped", unsigned(id), c.serial);
        ++stats.malformed;
        return UCS_OK;
    }
  }

  ucs_status_t on_hello(connection& c, const void* header, std::size_t header_len, const void* data,
                        std::size_t len, bool rndv) {
    hello_header h{};
    if (c.admitted) {  // a second hello (or one on our own connection): ignored, counted
      ++counters.bad_hellos;
      ++stats.malformed;
      return UCS_OK;
    }
    if (c.outgoing || rndv || !read_header(header, header_len, h) || h.magic != wire_magic ||
        h.version != wire_version || h.token_bytes > max_token_bytes ||
        h.address_bytes > max_address_bytes ||
        std::size_t{h.token_bytes} + h.address_bytes != len) {
      ++counters.bad_hellos;
      ++stats.malformed;
      report_refusal(counters.bad_hellos, c.from, "malformed hello");
      post_fail(c.serial, "bad hello");
      return UCS_OK;
    }
    if (!same_token(opt.job_token, data, h.token_bytes)) {
      ++counters.refused_tokens;
      ++stats.malformed;
      report_refusal(counters.refused_tokens, c.from, "wrong job token");
      const std::uint64_t serial = c.serial;
      asio::post(io, [w = weak_from_this(), serial] {
        auto s = w.lock();
        if (!s) return;
        if (connection* conn = s->find_conn(serial)) {
          s->send_signal(*conn, am_refused);
          s->close_ep(conn->ep, /*force=*/false);  // flushes the refusal first
          s->conns.erase(serial);
        }
      });
      return UCS_OK;
    }
    if (said_goodbye) {
      // Leaving: a peer's dial that got here late (a dropped SYN tried again) is not welcomed.
      // A welcome queued on an endpoint still wiring up is what UCX 1.13 aborts on when the
      // worker then goes ("pending request ... should have been flushed").
      post_fail(c.serial, "this node is leaving");
      return UCS_OK;
    }
    c.admitted = true;
    c.peer = h.node;
    // Used only now that the token is right: a job member's own worker address.
    c.bulk_address.assign(static_cast<const std::byte*>(data) + h.token_bytes,
                          static_cast<const std::byte*>(data) + len);
    LINK_TRACE("hello from node {} on conn {}", h.node, c.serial);
    auto& pe = peers[h.node];
    if (pe.lost) pe = peer_entry{pe.host, pe.port, pe.addressed};  // a restarted node is back
    const std::uint64_t serial = c.serial;
    // We send on the newest connection the peer dialled: a peer that dials again has given up
    // the one before (which may look alive from here: a shared-memory endpoint whose other
    // end closed reports nothing). What it has not acknowledged goes first, after the welcome;
    // copies it already has are dropped there.
    pe.send_conn = c.serial;
    resend_unacked(c);
    asio::post(io, [w = weak_from_this(), serial] {
      auto s = w.lock();
      if (!s) return;
      if (connection* conn = s->find_conn(serial)) {
        auto address = std::make_shared<std::vector<std::byte>>(s->bulk_address);
        s->send_control(*conn, am_welcome,
                        welcome_header{wire_magic, wire_version, s->opt.self,
                                       static_cast<std::uint32_t>(address->size())},
                        address->data(), address->size(), address);
        s->release_held(serial);
      }
    });
    return UCS_OK;
  }

  ucs_status_t on_envelope(connection& c, const void* header, std::size_t header_len, void* data,
                           std::size_t len, bool rndv) {
    delivery_book::header stream{};
    if (len > opt.limits.max_bytes || len < sizeof(capnp::word) || len % sizeof(capnp::word) ||
        !read_header(header, header_len, stream) || stream.seq == 0 || stream.session == 0) {
      ++stats.malformed;
      return UCS_OK;  // a rendezvous is dropped without moving its bytes
    }
    auto in = std::make_shared<inbound>();
    in->stream = stream;
    in->buffer = std::make_shared_for_overwrite<capnp::word[]>(len / sizeof(capnp::word));
    in->bytes = len;
    c.inbox.push_back(in);
    if (!rndv) {
      // Eager data lives only during this callback: one copy of a small message into an
      // aligned buffer, which the envelope then reads in place.
      std::memcpy(static_cast<void*>(in->buffer.get()), data, len);
      in->ready = true;
      // Handed out by pump() once progress has returned (no handler runs inside a UCX
      // callback), without a trip through the io_context queue.
      if (!c.deliver_posted) {
        c.deliver_posted = true;
        ready.push_back(c.serial);
      }
      return UCS_OK;
    }
    // Rendezvous: the bytes go straight into our aligned buffer (no copy), started outside
    // progress.
    asio::post(io, [w = weak_from_this(), serial = c.serial, in, data] {
      auto s = w.lock();
      if (!s) return;
      if (s->find_conn(serial) == nullptr) {
        ucp_am_data_release(s->worker.handle(), data);
        return;
      }
      auto p = std::make_unique<pending_request>();
      p->keep = in;
      p->done = [s = s.get(), serial, in](ucs_status_t st) {
        if (st == UCS_OK) {
          in->ready = true;
        } else {
          in->failed = true;
        }
        s->post_deliver(serial);
      };
      ucp_request_param_t param = s->request_params(p.get(), /*recv_am=*/true);
      s->track(ucp_am_recv_data_nbx(s->worker.handle(), data, in->buffer.get(), in->bytes, &param),
               std::move(p));
      s->kick();
    });
    return UCS_INPROGRESS;
  }

  // Connections whose inbox got eager envelopes during the last progress (see on_envelope).
  std::vector<std::uint64_t> ready;
  void deliver_ready() {
    if (ready.empty()) return;
    auto serials = std::move(ready);
    ready.clear();
    for (auto serial : serials) deliver(serial);
  }

  void post_deliver(std::uint64_t serial) {
    if (connection* c = find_conn(serial)) {
      if (c->deliver_posted) return;
      c->deliver_posted = true;
    }
    asio::post(io, [w = weak_from_this(), serial] {
      if (auto s = w.lock()) s->deliver(serial);
    });
  }
  void post_fail(std::uint64_t serial, std::string detail) {
    asio::post(io, [w = weak_from_this(), serial, detail = std::move(detail)] {
      if (auto s = w.lock()) s->fail_connection(serial, detail);
    });
  }
  void post_lose(node_id peer, peer_loss why, std::string detail) {
    asio::post(io, [w = weak_from_this(), peer, why, detail = std::move(detail)] {
      if (auto s = w.lock()) s->lose_peer(peer, why, detail);
    });
  }

  // Hands ready envelopes to the handler in arrival order.
  void deliver(std::uint64_t serial) {
    connection* c = find_conn(serial);
    if (c != nullptr) c->deliver_posted = false;
    while (c != nullptr && !c->inbox.empty() &&
           (c->inbox.front()->ready || c->inbox.front()->failed)) {
      auto in = std::move(c->inbox.front());
      c->inbox.pop_front();
      const node_id from = c->peer;
      if (in->failed) {
        // Its bytes never came (the connection is failing): nothing after it may be handed
        // on, or it would be skipped for good. The connection goes; the next one resends.
        c->inbox.clear();
        post_fail(serial, "a message's bytes failed to arrive");
        return;
      }
      if (in->what == inbound::kind::goodbye) {
        book.forget(from);
        lose_peer(from, peer_loss::goodbye, "the peer said goodbye");
        return;
      }
      if (!book.accept(from, in->stream)) {
        ++counters.duplicates;  // sent again after a failed connection, handed on already
        continue;
      }
      auto env = incoming_envelope::decode(
          std::as_bytes(std::span(in->buffer.get(), in->bytes / sizeof(capnp::word))), opt.limits);
      if (!env.ok()) {
        ++stats.malformed;
        continue;
      }
      ++stats.received;
      env->hold(in->buffer);
      if (handlers.on_message) {
        try {
          handlers.on_message(from, std::move(*env));
        } catch (const kj::Exception&) {
          ++stats.malformed;  // a payload field failed lazy validation in the handler
        }
      }
      c = find_conn(serial);  // the handler may have forgotten the peer
    }
    // Nothing of ours carried the acknowledgement back for a while: an explicit one.
    if (c != nullptr && c->admitted && book.ack_due(c->peer)) {
      ++counters.acks_sent;
      const auto ack = book.ack_header(c->peer);
      send_when_welcomed(*c, [this, ack](connection& conn) { send_control(conn, am_ack, ack); });
    }
  }

  // ---- bulk: the exporter's side ----------------------------------------------------------

  void serve_pull(std::uint64_t serial, const bulk_request_header& h) {
    connection* c = find_conn(serial);
    if (c == nullptr) return;
    auto reject = [&](bulk_error_code code) {
      ++counters.bulk_rejected;
      send_control(*c, am_bulk_error, bulk_reply_header{h.request, 0, 0, code, 0});
    };
    auto it = regions.find(h.region);
    if (it == regions.end() || it->second->memh == nullptr) return reject(no_such_region);
    auto region = it->second;
    if (h.length == 0 || h.offset > region->length || h.length > region->length - h.offset) {
      return reject(out_of_range);
    }
    ++counters.bulk_served;
    std::byte* start = region->base + h.offset;
    if (h.rma == rma_any || (h.rma == rma_allocated && region->allocated)) {
      if (region->rkey.empty()) return reject(not_mapped);
      // A lease only on memory the link owns: after a withdrawal it can keep that mapped until
      // the holders release it. Memory the caller exported is theirs to free once the region
      // is dropped, so every pull of it asks first.
      if (region->allocated && opt.lease_regions && (h.flags & accepts_lease) != 0) {
        ++region->grants[c->serial];
        ++counters.leases_granted;
        send_control(
            *c, am_bulk_lease,
            bulk_lease_header{h.request, reinterpret_cast<std::uint64_t>(start), h.length,
                              reinterpret_cast<std::uint64_t>(region->base), region->length},
            region->rkey.data(), region->rkey.size(), region);
        return;
      }
      send_control(
          *c, am_bulk_rkey,
          bulk_reply_header{h.request, reinterpret_cast<std::uint64_t>(start), h.length, 0, 0},
          region->rkey.data(), region->rkey.size(), region);
      return;
    }
    struct holder {
      bulk_reply_header header;
      std::shared_ptr<region_record> region;
    };
    auto hold = std::make_shared<holder>(holder{{h.request, 0, h.length, 0, 0}, region});
    ++region->in_flight;
    (void)send_am(
        *c, am_bulk_data, &hold->header, sizeof(bulk_reply_header), start, h.length, hold,
        [this, region](ucs_status_t s) {
          --region->in_flight;
          if (s != UCS_OK) ++stats.send_errors;
        },
        region->message_memh);
  }

  // ---- bulk: the puller's side ------------------------------------------------------------

  void finish_pull(std::uint64_t id, result<void> r) {
    auto it = pulls.find(id);
    if (it == pulls.end()) return;
    auto op = std::move(it->second);
    pulls.erase(it);
    if (op->under) {
      auto& l = *op->under;
      --l.gets;
      if (l.retired && l.gets == 0) post_release(l.conn, l.region);
    }
    if (r.ok()) {
      ++counters.pulls_ok;
    } else {
      ++counters.pulls_failed;
    }
    LINK_TRACE("pull {} from node {} finished: {}", id, op->peer, r.ok() ? "ok" : r.err().message);
    asio::post(io, [done = std::move(op->done), r = std::move(r)] { done(r); });
  }

  void fail_waiting_pulls(std::uint64_t serial, const std::string& detail) {
    std::vector<std::uint64_t> ids;
    for (auto& [id, op] : pulls) {
      if (op->conn == serial && !op->transferring) ids.push_back(id);
    }
    for (auto id : ids) park_or_fail_pull(id, detail);
  }

  ucs_status_t on_bulk_reply(connection& c, am_id id, const void* header, std::size_t header_len,
                             void* data, std::size_t len, bool rndv) {
    bulk_reply_header h{};
    bulk_lease_header lh{};
    if (id == am_bulk_lease ? !read_header(header, header_len, lh)
                            : !read_header(header, header_len, h)) {
      ++stats.malformed;
      return UCS_OK;
    }
    const std::uint64_t request = id == am_bulk_lease ? lh.request : h.request;
    auto it = pulls.find(request);
    if (it == pulls.end() || it->second->conn != c.serial || it->second->transferring) {
      LINK_TRACE("bulk reply {} for pull {} on conn {} matches nothing", unsigned(id), request,
                 c.serial);
      ++stats.malformed;  // a reply to nothing we asked this peer for
      return UCS_OK;
    }
    pull_op& op = *it->second;
    const std::uint64_t pid = op.id;
    if (id == am_bulk_error) {
      post_finish(pid, error{fmt::format("node {} refused the pull: {}", op.peer,
                                         h.code == no_such_region ? "no such region"
                                         : h.code == out_of_range ? "range outside the region"
                                                                  : "region not mapped")});
      return UCS_OK;
    }
    if (id == am_bulk_data) {
      if (h.length != op.length || len != op.length) {
        ++stats.malformed;
        post_finish(pid, error{"pull failed: the peer sent a reply of the wrong size"});
        return UCS_OK;
      }
      op.transferring = true;
      if (!rndv) {
        std::memcpy(op.into, data, len);
        post_finish(pid, {});
        return UCS_OK;
      }
      asio::post(io, [w = weak_from_this(), pid, data] {
        auto s = w.lock();
        if (!s) return;
        auto pit = s->pulls.find(pid);
        if (pit == s->pulls.end()) {
          ucp_am_data_release(s->worker.handle(), data);
          return;
        }
        auto p = std::make_unique<pending_request>();
        p->done = [s = s.get(), pid](ucs_status_t st) { s->complete_transfer(pid, st); };
        ucp_request_param_t param = s->request_params(p.get(), /*recv_am=*/true);
        use_memh(param, s->local_memh(pit->second->into, pit->second->length, /*messages=*/true));
        s->track(ucp_am_recv_data_nbx(s->worker.handle(), data, pit->second->into,
                                      pit->second->length, &param),
                 std::move(p));
        s->kick();
      });
      return UCS_INPROGRESS;
    }
    if (id == am_bulk_lease) {
      if (op.rma == rma_none || rndv || lh.length != op.length || len == 0 ||
          len > max_rkey_bytes || lh.region_length == 0 ||
          lh.region_base + lh.region_length < lh.region_base || lh.address < lh.region_base ||
          lh.address - lh.region_base > lh.region_length ||
          lh.length > lh.region_length - (lh.address - lh.region_base)) {
        ++stats.malformed;
        post_finish(pid, error{"pull failed: the peer sent a malformed lease"});
        return UCS_OK;
      }
      op.transferring = true;
      auto rkey = std::make_shared<std::vector<std::byte>>(len);
      std::memcpy(rkey->data(), data, len);
      asio::post(io, [w = weak_from_this(), pid, rkey, lh] {
        if (auto s = w.lock()) s->adopt_lease(pid, *rkey, lh);
      });
      return UCS_OK;
    }
    // am_bulk_rkey
    if (op.rma == rma_none || rndv || h.length != op.length || len == 0 || len > max_rkey_bytes) {
      ++stats.malformed;
      post_finish(pid, error{"pull failed: the peer sent a malformed rkey reply"});
      return UCS_OK;
    }
    op.transferring = true;
    auto rkey = std::make_shared<std::vector<std::byte>>(len);
    std::memcpy(rkey->data(), data, len);
    asio::post(io, [w = weak_from_this(), pid, rkey, address = h.address] {
      if (auto s = w.lock()) s->start_get(pid, *rkey, address);
    });
    return UCS_OK;
  }

  void post_finish(std::uint64_t id, result<void> r) {
    asio::post(io, [w = weak_from_this(), id, r = std::move(r)]() mutable {
      if (auto s = w.lock()) s->finish_pull(id, std::move(r));
    });
  }

  void complete_transfer(std::uint64_t id, ucs_status_t st) {
    if (st == UCS_OK) {
      post_finish(id, {});
      return;
    }
    // Its connection failed under it (an endpoint timeout on a slow, lossy link): asked again
    // on the next connection, if the peer is not given up by then.
    asio::post(io, [w = weak_from_this(), id, why = std::string(ucs_status_string(st))] {
      auto s = w.lock();
      if (!s) return;
      auto it = s->pulls.find(id);
      if (it == s->pulls.end()) return;
      if (s->find_conn(it->second->conn) != nullptr) {
        return s->finish_pull(id, error{"pull failed mid-transfer: " + why});
      }
      s->park_or_fail_pull(id, "mid-transfer: " + why);
    });
  }

  // The registration of the link's region that holds [p, p + n), if any: a get into it then
  // needs no on-the-fly registration (which a get cancelled at shutdown could leave behind,
  // and UCX asserts on when its context goes).
  ucp_mem_h local_memh(const std::byte* p, std::size_t n, bool messages) const {
    for (const auto& [id, r] : regions) {
      if (r->base != nullptr && p >= r->base && std::size_t(p - r->base) <= r->length &&
          n <= r->length - std::size_t(p - r->base)) {
        return messages ? r->message_memh : r->memh;
      }
    }
    return nullptr;
  }
  void register_for_messages(region_record& r) {
    ucp_mem_map_params_t p{};
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    p.address = r.base;
    p.length = r.length;
    r.message_context = context.handle();
    if (ucp_mem_map(context.handle(), &p, &r.message_memh) != UCS_OK) r.message_memh = nullptr;
  }
  static void use_memh(ucp_request_param_t& param, ucp_mem_h memh) {
    if (memh == nullptr) return;
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    param.memh = memh;
  }

  void start_get(std::uint64_t id, const std::vector<std::byte>& packed, std::uint64_t address) {
    auto pit = pulls.find(id);
    if (pit == pulls.end()) return;
    pull_op& op = *pit->second;
    connection* c = find_conn(op.conn);
    if (c == nullptr) return park_or_fail_pull(id, "its connection failed");
    std::shared_ptr<remote_key> key;
    if (auto it = c->rkeys.find(op.region); it != c->rkeys.end()) {
      key = it->second;
    } else {
      key = std::make_shared<remote_key>();
      if (bulk_ep_of(*c) == nullptr ||
          ucp_ep_rkey_unpack(c->bulk_ep, packed.data(), &key->handle) != UCS_OK) {
        key->handle = nullptr;
        return finish_pull(id, error{"pull failed: the peer's rkey does not unpack"});
      }
      if (c->rkeys.size() >= max_cached_rkeys) c->rkeys.erase(c->rkeys.begin());  // the oldest
      c->rkeys[op.region] = key;
    }
    ++counters.pulls_by_rma;
    auto p = std::make_unique<pending_request>();
    p->keep = key;  // the rkey outlives the get even if the cache drops it
    p->done = [this, id](ucs_status_t st) { complete_transfer(id, st); };
    ucp_request_param_t param = request_params(p.get());
    use_memh(param, local_memh(op.into, op.length, /*messages=*/false));
    track(ucp_get_nbx(c->bulk_ep, op.into, op.length, address, key->handle, &param), std::move(p));
    kick();
  }

  // ---- bulk: leases, the importer's side ---------------------------------------------------

  // A grant arrived for pull `id`: cache the lease (unless one is cached, or the region was
  // revoked already) and read under it.
  void adopt_lease(std::uint64_t id, const std::vector<std::byte>& packed,
                   const bulk_lease_header& h) {
    auto pit = pulls.find(id);
    if (pit == pulls.end()) return;
    pull_op& op = *pit->second;
    connection* c = find_conn(op.conn);
    if (c == nullptr) return park_or_fail_pull(id, "its connection failed");
    if (c->revoked.contains(op.region)) {
      send_control(*c, am_bulk_release, region_header{op.region});
      return finish_pull(id, error{fmt::format("node {} refused the pull: no such region "
                                               "(withdrawn)",
                                               op.peer)});
    }
    std::shared_ptr<lease> l;
    if (auto it = c->leases.find(op.region); it != c->leases.end()) {
      l = it->second;  // two first pulls raced: this grant is one too many, give it back
      send_control(*c, am_bulk_release, region_header{op.region});
    } else {
      l = std::make_shared<lease>();
      l->key = std::make_shared<remote_key>();
      if (bulk_ep_of(*c) == nullptr ||
          ucp_ep_rkey_unpack(c->bulk_ep, packed.data(), &l->key->handle) != UCS_OK) {
        l->key->handle = nullptr;
        send_control(*c, am_bulk_release, region_header{op.region});
        return finish_pull(id, error{"pull failed: the peer's rkey does not unpack"});
      }
      l->region = op.region;
      l->conn = c->serial;
      l->base = h.region_base;
      l->length = h.region_length;
      if (c->leases.size() >= opt.max_leases) {
        auto oldest = c->leases.begin();  // the lowest region id: the oldest region
        retire(*oldest->second);
        c->leases.erase(oldest);
      }
      c->leases[op.region] = l;
    }
    ++counters.pulls_by_rma;
    issue_get(op, *c, l, h.address);
  }

  // Reads op's bytes at `address` of the exporter under lease `l`.
  void issue_get(pull_op& op, connection& c, const std::shared_ptr<lease>& l,
                 std::uint64_t address) {
    op.transferring = true;
    op.under = l;
    ++l->gets;
    auto p = std::make_unique<pending_request>();
    p->keep = l;  // the rkey outlives the get even if the lease is dropped
    p->done = [this, id = op.id](ucs_status_t st) { complete_transfer(id, st); };
    ucp_request_param_t param = request_params(p.get());
    if (bulk_ep_of(c) == nullptr) {  // finish_pull gives the lease's get back (op.under)
      return finish_pull(op.id, error{"pull failed: no bulk endpoint to the peer"});
    }
    use_memh(param, local_memh(op.into, op.length, /*messages=*/false));
    track(ucp_get_nbx(c.bulk_ep, op.into, op.length, address, l->key->handle, &param),
          std::move(p));
    kick();
  }

  // Takes a lease out of use; released to the exporter once its gets have completed.
  void retire(lease& l) {
    if (l.retired) return;
    l.retired = true;
    if (l.gets == 0) post_release(l.conn, l.region);
  }
  void post_release(std::uint64_t serial, std::uint64_t region) {
    asio::post(io, [w = weak_from_this(), serial, region] {
      auto s = w.lock();
      if (!s) return;
      if (connection* c = s->find_conn(serial)) {
        s->send_control(*c, am_bulk_release, region_header{region});
      }
    });
  }

  void on_revoke(std::uint64_t serial, std::uint64_t region) {
    connection* c = find_conn(serial);
    if (c == nullptr) return;
    LINK_TRACE("node {} revoked its region {} on conn {}", c->peer, region, serial);
    auto it = c->leases.find(region);
    if (it == c->leases.end()) {
      c->revoked.insert(region);
      if (c->revoked.size() > max_revoked_tombstones) c->revoked.erase(c->revoked.begin());
      return;
    }
    retire(*it->second);
    c->leases.erase(it);
  }

  // ---- bulk: leases, the exporter's side ---------------------------------------------------

  // The owner dropped its bulk_region: no new pull is served, and holders of leases are told
  // to stop; the memory stays mapped until they have released them.
  void withdraw(const std::shared_ptr<region_record>& r) {
    regions.erase(r->id);
    if (dying) return;
    std::erase_if(r->grants, [&](const auto& g) { return find_conn(g.first) == nullptr; });
    if (r->grants.empty()) return;
    withdrawn[r->id] = r;
    for (const auto& [serial, count] : r->grants) {
      ++counters.leases_revoked;
      send_control(*find_conn(serial), am_bulk_revoke, region_header{r->id});
    }
  }

  void on_release(std::uint64_t serial, std::uint64_t region) {
    std::shared_ptr<region_record> r;
    if (auto it = regions.find(region); it != regions.end()) r = it->second;
    if (auto it = withdrawn.find(region); it != withdrawn.end()) r = it->second;
    auto g = r ? r->grants.find(serial) : std::map<std::uint64_t, std::uint32_t>::iterator{};
    if (!r || g == r->grants.end()) {
      ++stats.malformed;  // a release of nothing we granted on this connection
      return;
    }
    ++counters.leases_released;
    if (--g->second == 0) r->grants.erase(g);
    if (r->grants.empty()) withdrawn.erase(region);  // unmapped with its last holder
  }

  // A connection is gone: what it held is released (its process cannot read any more, or
  // reads what it has mapped of the segment, which outlives our mapping).
  void drop_grants(std::uint64_t serial) {
    for (auto& [id, r] : regions) r->grants.erase(serial);
    std::erase_if(withdrawn, [&](auto& w) {
      w.second->grants.erase(serial);
      return w.second->grants.empty();
    });
  }

  // How native the endpoint's RMA is, from the lanes UCX chose (ucp_ep_print_info): rma_bw
  // lanes (registered user memory) and get lanes (memory of the transports' own kind). Lanes
  // over TCP only emulate RMA (slower than rendezvous), so they do not count.
  static std::string describe(ucp_ep_h ep) {
    char* text = nullptr;
    std::size_t size = 0;
    FILE* f = ::open_memstream(&text, &size);
    if (f == nullptr) return {};
    ucp_ep_print_info(ep, f);
    std::fclose(f);
    std::string info(text, size);
    std::free(text);
    return info;
  }
  static std::optional<std::uint32_t> detect_rma_level(ucp_ep_h ep) {
    const std::string info = describe(ep);
    std::map<int, bool> lane_is_tcp;
    bool any_bw = false, bw_native = true, any_get = false, get_native = true;
    bool bw_takes_keys = true;
    std::vector<int> get_lanes;
    std::size_t pos = 0;
    while (pos < info.size()) {
      std::size_t eol = info.find('\n', pos);
      if (eol == std::string::npos) eol = info.size();
      const std::string line = info.substr(pos, eol - pos);
      pos = eol + 1;
      int lane = -1;
      // "rma_bw: mds [1 2] ...": the memory domains whose remote keys the bandwidth lanes take.
      // None listed (UCX 1.13's CMA lane on one host): a get of registered memory is emulated
      // by messages, so only allocated memory reads natively.
      if (const auto m = line.find("rma_bw: mds"); m != std::string::npos) {
        const auto next = line.find_first_not_of(' ', m + 11);
        bw_takes_keys = next != std::string::npos && line[next] == '[';
        continue;
      }
      if (std::sscanf(line.c_str(), "# lane[%d]", &lane) == 1 ||
          (line.find("lane[") != std::string::npos &&
           std::sscanf(line.c_str() + line.find("lane["), "lane[%d]", &lane) == 1)) {
        const bool tcp = line.find("tcp/") != std::string::npos;
        lane_is_tcp[lane] = tcp;
        if (line.find("rma_bw") != std::string::npos) {
          any_bw = true;
          bw_native = bw_native && !tcp;
        }
      } else if (const auto g = line.find("get[");
                 g != std::string::npos && std::sscanf(line.c_str() + g, "get[%d]", &lane) == 1) {
        get_lanes.push_back(lane);
      }
    }
    for (int lane : get_lanes) {
      any_get = true;
      get_native = get_native && !lane_is_tcp[lane];
    }
    if (lane_is_tcp.empty()) return std::nullopt;  // not wired up yet
    if (any_bw && bw_native && bw_takes_keys) return rma_any;
    if (any_get && get_native) return rma_allocated;
    return rma_none;
  }

  // ---- shutdown ----------------------------------------------------------------------------

  void shutdown() {
    dying = true;
    std::error_code ignored;
    tick.cancel();
    poll.cancel();
    fd.cancel(ignored);
    fd.close(ignored);
    bulk_fd.cancel(ignored);
    bulk_fd.close(ignored);
    auto drain = [&](clock::duration limit) {
      const auto deadline = clock::now() + limit;
      while ((!closing.empty() || outstanding > 0) && clock::now() < deadline) {
        worker.progress();
        bulk_worker.progress();
        reap_closing();
      }
    };
    // Requests still in flight complete (or fail) before their endpoints close: UCX 1.13
    // aborts the process (ucp_ep_destroy_base: "proto_reqs" not empty) when a flushing close
    // falls back to a local disconnect, after a send error, with a request still listed on
    // the endpoint. Seen at the end of a job whose peers were exiting at the same time.
    drain(opt.close_timeout);
    // A connection still being set up (no welcome yet: a dial whose SYN was dropped, to a peer
    // that may be gone) has nothing to flush but its hello; it is closed by force, which fails
    // what waits on it. Flushing it left the hello pending on a wireup endpoint, and
    // ucp_worker_destroy then aborts ("pending request ... should have been flushed").
    bool dialling = false;
    for (auto& [serial, c] : conns) {
      dialling = dialling || (c->outgoing && !c->welcomed);
      close_bulk(*c, /*force=*/false);
      close_ep(c->ep, /*force=*/c->outgoing && !c->welcomed);
    }
    conns.clear();
    drain(opt.close_timeout);
    // What the flush did not finish in time (a peer that vanished) is cancelled: UCX must see
    // every request released before the worker goes.
    std::vector<void*> left;
    for (pending_request* p : inflight) left.push_back(p->request);
    for (void* r : left) ucp_request_cancel(worker.handle(), r);
    for (void* r : closing) ucp_request_cancel(worker.handle(), r);
    drain(opt.close_timeout);
    for (void* r : closing) ucp_request_free(r);  // no callback: released, freed with the worker
    closing.clear();
    for (auto& [id, op] : pulls) {
      if (op->done) {
        asio::post(io, [done = std::move(op->done)] { done(error{"the link was destroyed"}); });
      }
    }
    pulls.clear();
    if (listener != nullptr) ucp_listener_destroy(listener);
    // Memory the link allocated that a bulk_region still holds stays mapped (its handle is
    // let go, not unmapped) until the process exits: a thread still writing it (a capture
    // finishing while the worker shuts down) must not fault. Other registrations are only
    // deregistered; their memory is the caller's.
    bool let_go = false;
    auto release = [&](const std::shared_ptr<region_record>& r) {
      if (r->allocated && r.use_count() > 1) {
        r->unmap_messages();  // a registration only: the memory stays
        r->memh = nullptr;
        let_go = true;
      } else {
        r->unmap();
      }
    };
    for (auto& [id, r] : regions) release(r);
    regions.clear();
    for (auto& [id, r] : withdrawn) release(r);
    withdrawn.clear();
    // A handle let go still holds UCX's registration cache entry of that memory, and
    // ucp_cleanup asserts on it: the bulk context is then left for the process's exit.
    if (let_go) bulk_context.abandon();
    // A dial still unanswered (its SYN dropped): UCX 1.13's TCP connection manager keeps the
    // endpoint's socket handlers registered past its forced close, and its async thread then
    // ran them on the destroyed worker (a segfault at the exit of 1 in 6 workers under 30%
    // SYN loss). Such a worker and its context are left for the process's exit.
    if (dialling) {
      worker.abandon();
      context.abandon();
    }
  }
};

}  // namespace detail

using detail::link_state;

// ---- bulk descriptors and regions -------------------------------------------------------------

bulk_region::bulk_region(std::shared_ptr<detail::region_record> record,
                         std::weak_ptr<detail::link_state> link)
    : record_(std::move(record)), link_(std::move(link)) {}
bulk_region::~bulk_region() {
  reset();
}
bulk_region::bulk_region(bulk_region&& o) noexcept
    : record_(std::move(o.record_)), link_(std::move(o.link_)) {}
bulk_region& bulk_region::operator=(bulk_region&& o) noexcept {
  if (this != &o) {
    reset();
    record_ = std::move(o.record_);
    link_ = std::move(o.link_);
  }
  return *this;
}
void bulk_region::reset() {
  if (!record_) return;
  if (auto s = link_.lock()) s->withdraw(record_);
  // The mapping goes when the last holder does: a pull being served keeps it alive.
  record_.reset();
}
std::span<std::byte> bulk_region::memory() const {
  if (!record_) return {};
  return {record_->base, record_->length};
}
std::uint64_t bulk_region::id() const {
  return record_ ? record_->id : 0;
}
std::uint64_t bulk_region::in_flight() const {
  return record_ ? record_->in_flight : 0;
}
bulk_descriptor bulk_region::describe(std::uint64_t offset, std::uint64_t length) const {
  auto s = link_.lock();
  if (!record_ || !s) throw std::logic_error("describe() on a withdrawn bulk region");
  if (length == 0 || offset > record_->length || length > record_->length - offset) {
    throw std::out_of_range(fmt::format("bytes [{}, +{}) are outside the region of {} bytes",
                                        offset, length, record_->length));
  }
  return {s->opt.self, record_->id, offset, length};
}

// ---- ucx_link ---------------------------------------------------------------------------------

namespace {
ucx_link_options checked(ucx_link_options o) {
  if (o.job_token.empty() || o.job_token.size() > detail::max_token_bytes) {
    throw std::invalid_argument(
        "ucx_link needs a job token of 1 to 256 bytes (every process of the job must share it)");
  }
  return o;
}
}  // namespace

ucx_link::ucx_link(asio::io_context& io, ucx_link_options options)
    : state_(std::make_shared<link_state>(io, checked(std::move(options)))) {
  state_->start();
}

ucx_link::~ucx_link() {
  state_->shutdown();
}

std::uint16_t ucx_link::port() const {
  return state_->port;
}

void ucx_link::add_peer(node_id peer, const std::string& host, std::uint16_t port) {
  auto& pe = state_->peers[peer];
  if (pe.lost) pe = {};
  pe.host = host;
  pe.port = port;
  pe.addressed = true;
}

bool ucx_link::can_dial(node_id peer) const {
  const auto it = state_->peers.find(peer);
  return it != state_->peers.end() && it->second.addressed;
}

node_id ucx_link::self() const {
  return state_->opt.self;
}
void ucx_link::set_handlers(link_handlers handlers) {
  state_->handlers = std::move(handlers);
}
link_stats ucx_link::stats() const {
  return state_->stats;
}
ucx_link_counters ucx_link::counters() const {
  auto c = state_->counters;
  c.withdrawn_held = state_->withdrawn.size();
  return c;
}

result<void> ucx_link::send(node_id to, kj::Array<capnp::word> message) {
  auto& s = *state_;
  const std::size_t bytes = message.size() * sizeof(capnp::word);
  if (bytes > s.opt.limits.max_bytes) {
    return error{
        fmt::format("envelope of {} bytes exceeds the limit of {} bytes; send tensors "
                    "as bulk descriptors",
                    bytes, s.opt.limits.max_bytes)};
  }
  if (to == s.opt.self) {
    // Same semantics as a remote send: decoded, counted, delivered by a posted handler.
    auto buffer = std::make_shared<kj::Array<capnp::word>>(std::move(message));
    asio::post(s.io, [w = s.weak_from_this(), buffer] {
      auto st = w.lock();
      if (!st) return;
      auto env = incoming_envelope::decode(
          std::as_bytes(std::span(buffer->begin(), buffer->size())), st->opt.limits);
      if (!env.ok()) {
        ++st->stats.malformed;
        return;
      }
      ++st->stats.received;
      env->hold(buffer);
      if (st->handlers.on_message) st->handlers.on_message(st->opt.self, std::move(*env));
    });
    ++s.stats.sent;
    return {};
  }
  auto c = s.connection_to(to);
  if (!c.ok()) {
    if (auto pe = s.peers.find(to); pe != s.peers.end() && pe->second.kept) {
      (void)s.book.stamp(to, std::make_shared<kj::Array<capnp::word>>(std::move(message)));
      ++s.stats.sent;  // goes out first on the peer's next connection
      return {};
    }
    ++s.stats.send_errors;
    return c.err();
  }
  // Numbered and kept until the peer acknowledges it: from here on it reaches the peer even
  // if this connection fails and another is dialled (an error now is counted, not returned).
  auto owned = std::make_shared<kj::Array<capnp::word>>(std::move(message));
  const auto stream = s.book.stamp(to, owned);
  s.send_when_welcomed(**c, [&s, stream, owned = std::move(owned)](detail::connection& conn) {
    (void)s.send_envelope(conn, stream, owned);
  });
  ++s.stats.sent;
  return {};
}

void ucx_link::forget(node_id peer) {
  state_->lose_peer(peer, peer_loss::crash, "forgotten (declared lost by the caller)");
  if (auto it = state_->peers.find(peer); it != state_->peers.end()) it->second.kept = false;
  state_->book.forget(peer);  // lost for good: nothing kept for it
  state_->fail_parked_pulls(peer, "forgotten (declared lost by the caller)");
}

void ucx_link::fail_connections_for_tests(node_id peer) {
  auto& s = *state_;
  std::vector<std::uint64_t> doomed;
  for (auto& [serial, c] : s.conns) {
    if (c->admitted && c->peer == peer) doomed.push_back(serial);
  }
  for (auto serial : doomed) s.fail_connection(serial, "failed by the test");
}

void ucx_link::revive(node_id peer) {
  auto& s = *state_;
  auto it = s.peers.find(peer);
  if (it == s.peers.end() || !it->second.lost) return;
  const detail::peer_entry was = it->second;
  it->second = detail::peer_entry{was.host, was.port, was.addressed};
  it->second.kept = true;  // still kept while it has no connection (and no address to dial)
  ++s.counters.revived;
}

void ucx_link::say_goodbye() {
  auto& s = *state_;
  s.said_goodbye = true;
  if (detail::link_tracing()) fmt::print(stderr, "[link {}] saying goodbye\n", s.opt.self);
  for (auto& [serial, c] : s.conns) {
    // Behind what the connection holds (resends), never overtaking it.
    if (c->admitted) {
      s.send_when_welcomed(
          *c, [&s](detail::connection& conn) { s.send_signal(conn, detail::am_goodbye); });
    }
  }
}

bulk_region ucx_link::export_region(std::span<std::byte> memory) {
  auto& s = *state_;
  if (memory.empty()) throw std::invalid_argument("export_region of zero bytes");
  ucp_mem_map_params_t p{};
  p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  p.address = memory.data();
  p.length = memory.size();
  auto r = std::make_shared<detail::region_record>();
  r->context = s.bulk_context.handle();
  detail::check_status(ucp_mem_map(s.bulk_context.handle(), &p, &r->memh),
                       "ucp_mem_map (export_region)");
  r->base = memory.data();
  r->length = memory.size();
  void* packed = nullptr;
  std::size_t packed_len = 0;
  if (ucp_rkey_pack(s.bulk_context.handle(), r->memh, &packed, &packed_len) == UCS_OK) {
    r->rkey.resize(packed_len);
    std::memcpy(r->rkey.data(), packed, packed_len);
    ucp_rkey_buffer_release(packed);
  }
  s.register_for_messages(*r);
  r->id = s.next_region++;
  s.regions[r->id] = r;
  return bulk_region(r, s.weak_from_this());
}

bulk_region ucx_link::allocate_region(std::size_t bytes) {
  auto& s = *state_;
  if (bytes == 0) throw std::invalid_argument("allocate_region of zero bytes");
  ucp_mem_map_params_t p{};
  p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                 UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  p.address = nullptr;
  p.length = bytes;
  p.flags = UCP_MEM_MAP_ALLOCATE;
  auto r = std::make_shared<detail::region_record>();
  r->context = s.bulk_context.handle();
  detail::check_status(ucp_mem_map(s.bulk_context.handle(), &p, &r->memh),
                       "ucp_mem_map (allocate_region)");
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  detail::check_status(ucp_mem_query(r->memh, &attr), "ucp_mem_query");
  r->base = static_cast<std::byte*>(attr.address);
  r->length = bytes;
  r->allocated = true;
  void* packed = nullptr;
  std::size_t packed_len = 0;
  if (ucp_rkey_pack(s.bulk_context.handle(), r->memh, &packed, &packed_len) == UCS_OK) {
    r->rkey.resize(packed_len);
    std::memcpy(r->rkey.data(), packed, packed_len);
    ucp_rkey_buffer_release(packed);
  }
  s.register_for_messages(*r);
  r->id = s.next_region++;
  s.regions[r->id] = r;
  return bulk_region(r, s.weak_from_this());
}

result<bulk_path> ucx_link::path_to(node_id peer) {
  auto& s = *state_;
  auto c = s.connection_to(peer);
  if (!c.ok()) return c.err();
  auto& pe = s.peers[peer];
  if (s.opt.bulk != bulk_path::automatic) return s.opt.bulk;
  if (pe.path_known) return pe.path;
  // An outgoing endpoint is wired once the acceptor welcomed us; an accepted one is wired
  // once the hello arrived.
  if ((*c)->outgoing && !(*c)->welcomed) {
    return error{fmt::format("endpoint to node {} not wired up yet", peer)};
  }
  ucp_ep_h bulk = s.bulk_ep_of(**c);
  if (bulk == nullptr) return error{fmt::format("no bulk endpoint to node {} yet", peer)};
  auto level = detail::link_state::detect_rma_level(bulk);
  if (!level) return error{fmt::format("cannot tell the RMA transport to node {}", peer)};
  pe.path_known = true;
  pe.rma = *level;
  pe.path = *level == detail::rma_none ? bulk_path::rendezvous : bulk_path::rma;
  return pe.path;
}

result<std::string> ucx_link::endpoint_info(node_id peer) {
  auto c = state_->connection_to(peer);
  if (!c.ok()) return c.err();
  ucp_ep_h bulk = state_->bulk_ep_of(**c);
  return "messages:\n" + detail::link_state::describe((*c)->ep) + "bulk reads:\n" +
         (bulk != nullptr ? detail::link_state::describe(bulk) : std::string("(none yet)\n"));
}

void ucx_link::pull(const bulk_descriptor& d, std::span<std::byte> into, pull_handler done) {
  auto& s = *state_;
  auto fail = [&](std::string why) {
    ++s.counters.pulls_failed;
    asio::post(s.io, [done = std::move(done), why = std::move(why)] { done(error{why}); });
  };
  if (d.length == 0 || into.size() != d.length) {
    return fail(fmt::format("pull: the buffer has {} bytes, the descriptor names {}", into.size(),
                            d.length));
  }
  if (d.node == s.opt.self) {
    auto it = s.regions.find(d.region);
    if (it == s.regions.end() || d.offset > it->second->length ||
        d.length > it->second->length - d.offset) {
      ++s.counters.bulk_rejected;
      return fail("pull: the descriptor names no local region range");
    }
    std::memcpy(into.data(), it->second->base + d.offset, d.length);
    ++s.counters.pulls_ok;
    asio::post(s.io, [done = std::move(done)] { done(result<void>{}); });
    return;
  }
  auto c = s.connection_to(d.node);
  if (!c.ok()) return fail("pull: " + c.err().message);
  // The exporter makes the final choice: it knows whether the region is of a kind the
  // endpoint's native RMA lanes can reach.
  std::uint32_t rma = detail::rma_none;
  if (s.opt.bulk == bulk_path::rma) {
    rma = detail::rma_any;
  } else if (s.opt.bulk == bulk_path::automatic && path_to(d.node).ok()) {
    rma = s.peers[d.node].rma;
  }
  // A lease on the region: the range is checked against the bounds the exporter gave and the
  // bytes are read at once, without asking.
  std::shared_ptr<detail::lease> lease;
  if (rma != detail::rma_none && s.opt.lease_regions) {
    if (auto it = (*c)->leases.find(d.region); it != (*c)->leases.end()) lease = it->second;
  }
  if (lease && (d.offset > lease->length || d.length > lease->length - d.offset)) {
    return fail(
        fmt::format("pull: node {} refused the pull: range outside the region (bytes "
                    "[{}, +{}) of a region of {})",
                    d.node, d.offset, d.length, lease->length));
  }
  auto op = std::make_unique<detail::pull_op>();
  op->id = s.next_pull++;
  op->peer = d.node;
  op->conn = (*c)->serial;
  op->region = d.region;
  op->offset = d.offset;
  op->into = into.data();
  op->length = into.size();
  op->rma = rma;
  op->done = std::move(done);
  const std::uint64_t id = op->id;
  auto& op_ref = *op;
  s.pulls[id] = std::move(op);
  if (lease) {
    ++s.counters.pulls_by_lease;
    s.issue_get(op_ref, **c, lease, lease->base + d.offset);
    return;
  }
  if (detail::link_tracing()) {
    fmt::print(stderr, "[link {}] pull {} from node {} region {} on conn {} (rma {})\n", s.opt.self,
               id, d.node, d.region, (*c)->serial, rma);
  }
  const std::uint32_t flags =
      s.opt.lease_regions && rma != detail::rma_none ? detail::accepts_lease : 0u;
  const detail::bulk_request_header request{id, d.region, d.offset, d.length, rma, flags};
  s.send_when_welcomed(**c, [&s, request](detail::connection& conn) {
    s.send_control(conn, detail::am_bulk_request, request);
  });
}

void ucx_link::send_raw_for_tests(node_id to, unsigned am, std::span<const std::byte> header,
                                  std::span<const std::byte> data) {
  auto& s = *state_;
  auto c = s.connection_to(to);
  if (!c.ok()) return;
  auto h = std::make_shared<std::vector<std::byte>>(header.begin(), header.end());
  auto d = std::make_shared<std::vector<std::byte>>(data.begin(), data.end());
  auto keep = std::make_shared<std::pair<decltype(h), decltype(d)>>(h, d);
  (void)s.send_am(**c, static_cast<detail::am_id>(am), h->data(), h->size(), d->data(), d->size(),
                  keep, [](ucs_status_t) {});
}

}  // namespace moevement::transport
