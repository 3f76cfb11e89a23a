// One UCX context and one worker per process. The worker is progressed from the actor
// system's Asio loop through its event fd (see ../shared notes on the arm/progress order).
#pragma once

#include <ucp/api/ucp.h>

#include <string>
#include <vector>

namespace moevement::transport {

class ucx_context {
 public:
  // Features: active messages (actor messages), RMA (bulk pulls), wakeup (event fd).
  ucx_context();
  ~ucx_context();
  ucx_context(const ucx_context&) = delete;
  ucx_context& operator=(const ucx_context&) = delete;

  ucp_context_h handle() const { return context_; }

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
  // The worker's own address blob (for out-of-band exchange in tests and diagnostics).
  std::vector<std::byte> address() const;

 private:
  ucp_worker_h worker_ = nullptr;
};

// The UCX library version the process runs with, e.g. "1.13.1".
std::string ucx_version();

}  // namespace moevement::transport
