// link_state: the UCX workers driven from Asio, UCX requests, and shutdown.
#include "transport/ucx_link_state.hpp"

#include <sys/resource.h>

namespace moevement::transport::detail {

std::uint64_t new_session() {
  std::random_device rd;  // (the kernel's source: getrandom, or the CPU's)
  std::uint64_t v = (std::uint64_t{rd()} << 32) ^ rd() ^
                    static_cast<std::uint64_t>(clock::now().time_since_epoch().count());
  return v == 0 ? 1 : v;
}

void check_status(ucs_status_t status, const std::string& what) {
  if (status != UCS_OK) {
    throw std::runtime_error(fmt::format("{} failed: {} (see docs/transport.md for UCX settings)",
                                         what, ucs_status_string(status)));
  }
}

std::size_t admission_cap(std::size_t max_half_open) {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) {
    return max_half_open;
  }
  return std::max<std::size_t>(1, std::min<std::size_t>(max_half_open, limit.rlim_cur / 2));
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

void link_state::start() {
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
  message_address = worker.address();
  admission = admission_listener::start(
      io, opt.listen_host, opt.listen_port,
      {opt.hello_timeout, opt.max_half_open_per_source, admission_cap(opt.max_half_open), opt.self,
       opt.job_token},
      [w = weak_from_this(), self = opt.self](const admission_request& r, const std::string& from) {
        if (auto s = w.lock()) return s->admit(r, from);
        return admission_reply{self, admission_verdict::leaving, {}, {}, 0};
      },
      [w = weak_from_this()](admission_refusal why, const std::string& from) {
        if (auto s = w.lock()) s->refused_admission(why, from);
      });
  schedule_tick();
  kick();
}

void* link_state::new_am_arg(am_id id) {
  am_args[id] = {this, id};
  return &am_args[id];
}

void link_state::kick() {
  if (kick_pending || dying) return;
  kick_pending = true;
  asio::post(io, [w = weak_from_this()] {
    if (auto s = w.lock()) {
      s->kick_pending = false;
      s->pump();
    }
  });
}

void link_state::pump(wake why) {
  if (dying) return;
  bool found = false;
  // Bounded: a peer that keeps the workers busy (a long pull's stream of pieces) must not keep
  // this thread from its timers and actors (heartbeats among them); the rest is a pump later.
  constexpr int max_rounds = 256;
  int rounds = 0;
  while (rounds < max_rounds && (worker.progress() + bulk_worker.progress()) != 0) {
    found = true;
    ++rounds;
  }
  deliver_ready();
  if (dying) return;  // a handler destroyed the link
  if (rounds == max_rounds) kick();
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

void link_state::wait_on(asio::posix::stream_descriptor& d, bool& waiting) {
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

void link_state::grow_spin() {
  if (clock::now() < contended_until) return;
  spin_now = std::min<std::chrono::nanoseconds>(
      opt.spin, std::max<std::chrono::nanoseconds>(2 * spin_now, std::chrono::microseconds(1)));
}

void link_state::cover_wait(std::chrono::nanoseconds waited) {
  if (waited >= opt.spin || clock::now() < contended_until) return;
  spin_now = std::min<std::chrono::nanoseconds>(
      opt.spin,
      std::max<std::chrono::nanoseconds>(
          {spin_now, waited * 3 / 2, std::chrono::nanoseconds(std::chrono::microseconds(1))}));
}

void link_state::shrink_spin() {
  spin_now /= 2;
  if (spin_now < std::chrono::microseconds(1)) spin_now = std::chrono::nanoseconds(0);
}

void link_state::schedule_poll(bool found) {
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

void link_state::schedule_tick() {
  tick.expires_after(opt.safety_tick);
  tick.async_wait([w = weak_from_this()](const std::error_code& ec) {
    auto s = w.lock();
    if (!s || ec || s->dying) return;
    s->check_hello_timeouts();
    s->check_delivery();
    s->pump(wake::tick);
    s->schedule_tick();
  });
}

void link_state::reap_closing() {
  std::erase_if(closing, [](void* req) {
    if (ucp_request_check_status(req) == UCS_INPROGRESS) return false;
    ucp_request_free(req);
    return true;
  });
}

void link_state::on_send_done(void* request, ucs_status_t status, void* user_data) {
  finish_request(request, status, user_data);
}

void link_state::on_recv_done(void* request, ucs_status_t status, std::size_t, void* user_data) {
  finish_request(request, status, user_data);
}

void link_state::finish_request(void* request, ucs_status_t status, void* user_data) {
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

void link_state::untrack(pending_request& p) {
  inflight[p.slot] = inflight.back();
  inflight[p.slot]->slot = p.slot;
  inflight.pop_back();
  --outstanding;
}

void link_state::track(ucs_status_ptr_t r, std::unique_ptr<pending_request> p) {
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

ucp_request_param_t link_state::request_params(pending_request* p, bool recv_am) {
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

result<void> link_state::send_am(connection& c, am_id id, const void* header,
                                 std::size_t header_len, const void* data, std::size_t len,
                                 std::shared_ptr<void> keep, std::function<void(ucs_status_t)> done,
                                 ucp_mem_h memh) {
  if (c.ep == nullptr || header_len > max_header_bytes - key_bytes) {
    ++stats.send_errors;
    return error{fmt::format("sending to node {} failed: no endpoint yet, or a header of {} bytes",
                             c.peer, header_len)};
  }
  auto p = std::make_unique<pending_request>();
  p->keep = std::move(keep);
  p->done = std::move(done);
  // The receiver tells its connections apart by the key (not by the endpoint: ours to it is
  // one of two, each made from a worker address).
  std::memcpy(p->header.data(), &c.send_key, key_bytes);
  if (header_len > 0) std::memcpy(p->header.data() + key_bytes, header, header_len);
  const void* full_header = p->header.data();
  ucp_request_param_t param = request_params(p.get());
  if (memh != nullptr) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    param.memh = memh;
  }
  ucs_status_ptr_t r =
      ucp_am_send_nbx(c.ep, id, full_header, key_bytes + header_len, data, len, &param);
  last_activity = clock::now();  // an answer may follow soon: worth a spin
  if (UCS_PTR_IS_ERR(r)) {
    ++stats.send_errors;
    return error{
        fmt::format("sending to node {} failed: {}", c.peer, ucs_status_string(UCS_PTR_STATUS(r)))};
  }
  track(r, std::move(p));
  kick();
  return {};
}

result<void> link_state::send_envelope(connection& c, const delivery_book::header& h,
                                       std::shared_ptr<kj::Array<capnp::word>> owned) {
  if (opt.lose_envelope && opt.lose_envelope(c.peer, h.seq)) return {};  // tests: lost
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

void link_state::resend_unacked(connection& c) {
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

void link_state::reissue_pull(connection& c, pull_op& op, bool hold) {
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

void link_state::park_or_fail_pull(std::uint64_t id, const std::string& why) {
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

pull_op& link_state::add_pull(const bulk_descriptor& d, std::span<std::byte> into,
                              std::uint64_t conn, std::uint32_t rma, ucx_link::pull_handler done) {
  auto op = std::make_unique<pull_op>();
  op->id = next_pull++;
  op->peer = d.node;
  op->conn = conn;
  op->region = d.region;
  op->offset = d.offset;
  op->into = into.data();
  op->length = into.size();
  op->rma = rma;
  op->done = std::move(done);
  auto& ref = *op;
  pulls[ref.id] = std::move(op);
  return ref;
}

void link_state::fail_parked_pulls(node_id peer, const std::string& why) {
  std::vector<std::uint64_t> ids;
  for (auto& [id, op] : pulls) {
    if (op->peer == peer && op->conn == 0) ids.push_back(id);
  }
  for (auto id : ids) finish_pull(id, error{"pull failed: peer lost: " + why});
}

void link_state::release_held(std::uint64_t serial) {
  connection* c = find_conn(serial);
  if (c == nullptr) return;
  while (!c->held.empty()) {
    auto send = std::move(c->held.front());
    c->held.pop_front();
    send(*c);  // a failure is counted in send_am
  }
}

void link_state::send_when_welcomed(connection& c, std::function<void(connection&)> send) {
  if (!c.welcomed || !c.held.empty()) {
    ++counters.held_sends;
    c.held.push_back(std::move(send));
    return;
  }
  send(c);
}

void link_state::send_signal(connection& c, am_id id) {
  (void)send_am(c, id, nullptr, 0, nullptr, 0, nullptr, [this](ucs_status_t s) {
    if (s != UCS_OK) ++stats.send_errors;
  });
}

void link_state::shutdown() {
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
  // A connection still being set up (no first message from the other end yet, to a peer that
  // may be gone) has nothing to flush but its hello or welcome; it is closed by force, which
  // fails what waits on it. Flushing it left the message pending on a wireup endpoint, and
  // ucp_worker_destroy then aborts ("pending request ... should have been flushed").
  if (admission) admission->close();
  for (ucp_ep_h ep : lingering) close_ep(ep, /*force=*/true);  // their peers closed them
  lingering.clear();
  for (auto& [serial, c] : conns) {
    if (c->dial) c->dial->give_up();
    close_conn(*c, /*force=*/!c->welcomed);
  }
  conns.clear();
  by_key.clear();
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
}

}  // namespace moevement::transport::detail
