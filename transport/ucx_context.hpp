// One UCX context and one worker per process. The worker is progressed from the actor
// system's Asio loop through its event fd (see ../shared notes on the arm/progress order).
#pragma once

#include <ucp/api/ucp.h>

#include <string>
#include <string_view>
#include <vector>

namespace moevement::transport {

// What a context carries. Messages never go through the shared-memory FIFO transports
// (UCX's `mm` group: posix, sysv, xpmem): a sender killed between reserving a slot in the
// receiver's FIFO and marking it written leaves that slot unwritten for ever, and the receiver,
// which reads its FIFO in order, then hears no other sender either (seen: a survivor deaf to every
// peer for the whole failure timeout after a neighbour was killed). Bulk reads of memory UCX
// allocated are one-sided gets that write nothing into the exporter's FIFO (their endpoints to
// same-host peers skip the handshake that would, see bulk_ep_of in ucx_link.cpp), so they keep
// shared memory's bandwidth; other registered memory goes by rendezvous on the message
// endpoint (see detect_rma_level in ucx_link.cpp).
enum class context_use { messages, bulk };

// UCX turns its log to debug level on SIGHUP (UCX_DEBUG_SIGNO's default), the handler set as
// the library loads: a terminal's hang-up, or the kernel's to a process group left orphaned
// with a stopped member, flooded the console with UCX's debug lines. Gives SIGHUP back its
// disposition from before UCX (SIG_DFL, or SIG_IGN under nohup), unless UCX_DEBUG_SIGNO is set
// (then the user asked for UCX's). Call before setting a handler of one's own.
void release_hangup_signal();

class ucx_context {
 public:
  // Features: active messages (actor messages), RMA (bulk pulls), wakeup (event fd).
  // `messages` leaves the FIFO transports out unless UCX_TLS names the transports itself.
  // `loopback_only`: network transports on the loopback interface only, unless UCX_NET_DEVICES
  // names the devices itself (for a link listening on a loopback address, whose peers are all
  // on this host: UCX's TCP transport otherwise listens on every interface's address).
  explicit ucx_context(context_use use = context_use::bulk, bool loopback_only = false);
  ~ucx_context();
  ucx_context(const ucx_context&) = delete;
  ucx_context& operator=(const ucx_context&) = delete;

  ucp_context_h handle() const { return context_; }
  // Never cleaned up (left for the process's exit): UCX 1.13 asserts in ucp_cleanup while
  // memory it allocated is still registered, and some must outlive the context (ucx_link).
  void abandon() { context_ = nullptr; }

 private:
  ucp_context_h context_ = nullptr;
};

class ucx_worker {
 public:
  explicit ucx_worker(const ucx_context& context);
  ~ucx_worker();
  ucx_worker(const ucx_worker&) = delete;
  ucx_worker& operator=(const ucx_worker&) = delete;

  ucp_worker_h handle() const { return worker_; }
  // The fd that becomes readable when the armed worker has events.
  int event_fd() const;
  // One progress pass; returns how many events it completed.
  unsigned progress();
  // The worker's own address blob, which peers make endpoints from (ucx_link's admission).
  std::vector<std::byte> address() const;

 private:
  ucp_worker_h worker_ = nullptr;
};

// The UCX library version the process runs with, e.g. "1.13.1".
std::string ucx_version();

// The transports UCX has on this host whatever UCX_TLS says, e.g. {"cma", "posix", "self",
// "sysv", "tcp"} (a context of every transport, as `ucx_info -d` lists them).
std::vector<std::string> ucx_transports();
// The names in a UCX_TLS value that none of `available` serves ("rc" with no rc_verbs or
// rc_mlx5): UCX only warns of them, and a job whose peers need them cannot connect. Aliases
// as UCX reads them (sm, shm, mm, ib, rc, ud, dc, rc_v, rc_x, ud_v, ud_x, dc_x, cuda); a
// value that excludes (^...) or says all names none.
std::vector<std::string> unavailable_transports(std::string_view ucx_tls,
                                                const std::vector<std::string>& available);
// This process's UCX_TLS, where it names a transport this host lacks: what it names and what
// the host has, said ("" when UCX_TLS is unset, every name is served, or the host's transports
// could not be read: never an error of its own).
std::string ucx_tls_problem();

}  // namespace moevement::transport
