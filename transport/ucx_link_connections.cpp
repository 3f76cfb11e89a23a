// link_state: connections: dialling a peer, admitting one, and their failures.
#include "transport/ucx_link_state.hpp"

namespace moevement::transport::detail {

void link_state::on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status) {
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

connection& link_state::add_connection(ucp_ep_h ep, bool outgoing, node_id peer) {
  auto c = std::make_unique<connection>();
  c->serial = next_serial++;
  c->ep = ep;
  c->outgoing = outgoing;
  c->peer = peer;
  c->created = clock::now();
  do {
    c->recv_key = keys();
  } while (c->recv_key == 0 || by_key.contains(c->recv_key));
  auto& ref = *c;
  if (ep != nullptr) by_ep[ep] = c->serial;
  by_key[c->recv_key] = c->serial;
  conns[c->serial] = std::move(c);
  return ref;
}

connection* link_state::find_conn(std::uint64_t serial) {
  auto it = conns.find(serial);
  return it == conns.end() ? nullptr : it->second.get();
}

void link_state::drop_conn(std::uint64_t serial) {
  auto it = conns.find(serial);
  if (it == conns.end()) return;
  by_key.erase(it->second->recv_key);
  if (it->second->dial) it->second->dial->give_up();
  conns.erase(it);
}

ucp_ep_params_t link_state::ep_params() {
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = &on_ep_error;
  p.err_handler.arg = this;
  return p;
}

ucp_ep_h link_state::ep_to(const std::vector<std::byte>& address) {
  ucp_ep_params_t p = ep_params();
  p.field_mask |= UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
  p.address = reinterpret_cast<const ucp_address_t*>(address.data());
  ucp_ep_h ep = nullptr;
  if (ucp_ep_create(worker.handle(), &p, &ep) != UCS_OK) return nullptr;
  return ep;
}

admission_reply link_state::admit(const admission_request& request, const std::string& from) {
  admission_reply reply;
  reply.node = opt.self;
  // Leaving: a peer's dial that got here late (a dropped SYN tried again) is not let in.
  if (dying || said_goodbye) {
    reply.verdict = admission_verdict::leaving;
    return reply;
  }
  // Used only now that the dialler proved it holds the token: a job member's own worker address.
  ucp_ep_h ep = ep_to(request.message_address);
  if (ep == nullptr) {
    ++counters.failed_accepts;
    report_refusal(counters.failed_accepts, from, "a worker address UCX cannot reach");
    reply.verdict = admission_verdict::unusable;
    return reply;
  }
  connection& c = add_connection(ep, /*outgoing=*/false, request.node);
  c.send_key = request.key;
  c.bulk_address = request.bulk_address;
  LINK_TRACE("admitted node {} from {} on conn {}", request.node, from, c.serial);
  auto& pe = peers[request.node];
  if (pe.lost) pe = peer_entry::again(pe);  // a restarted node is back
  // We send on the newest connection the peer dialled: a peer that dials again has given up
  // the one before (which may look alive from here: a shared-memory endpoint whose other
  // end closed reports nothing). What it has not acknowledged goes first, after its hello;
  // copies it already has are dropped there.
  pe.send_conn = c.serial;
  resend_unacked(c);
  reply.message_address = message_address;
  reply.bulk_address = bulk_address;
  reply.key = c.recv_key;
  kick();
  return reply;
}

void link_state::refused_admission(admission_refusal why, const std::string& from) {
  switch (why) {
    case admission_refusal::malformed:
      ++counters.bad_hellos;
      report_refusal(counters.bad_hellos, from, "not a hello of this link");
      return;
    case admission_refusal::timeout:
      ++counters.hello_timeouts;
      report_refusal(counters.hello_timeouts, from, "no hello within hello_timeout");
      return;
    case admission_refusal::half_open:
      ++counters.half_open_refused;
      report_refusal(counters.half_open_refused, from,
                     fmt::format("{} connections from it not admitted yet (the limit)",
                                 opt.max_half_open_per_source));
      return;
    case admission_refusal::too_many:
      ++counters.too_many_open;
      report_refusal(counters.too_many_open, from,
                     fmt::format("{} connections from all sources not admitted yet (the limit)",
                                 admission_cap(opt.max_half_open)));
      return;
    case admission_refusal::wrong_token:
      ++counters.refused_tokens;
      ++stats.malformed;
      report_refusal(counters.refused_tokens, from, "wrong job token");
      return;
  }
}

void link_state::on_admission_reply(std::uint64_t serial, result<admission_reply> reply) {
  connection* c = find_conn(serial);
  if (c == nullptr || dying) return;  // given up meanwhile
  c->dial.reset();
  const node_id peer = c->peer;
  if (!reply.ok()) return fail_connection(serial, reply.err().message);
  switch (reply->verdict) {
    case admission_verdict::admitted:
      break;
    case admission_verdict::wrong_token:  // (unproven: where another connection works, kept)
      return fail_connection(serial, "refused by the peer: wrong job token");
    case admission_verdict::leaving:
      return fail_connection(serial, "the peer is leaving");
    case admission_verdict::unusable:
      return fail_connection(serial, "the peer cannot reach this node's worker address");
    case admission_verdict::unproven:
      ++counters.unproven_acceptors;
      return fail_connection(serial,
                             "the process at its address admitted this node without proving "
                             "that it holds the job token (a process of another job or user "
                             "listening at the peer's old address?)");
  }
  // (An admitted reply comes from the node dialled: admission_dial checked its greeting.)
  ucp_ep_h ep = ep_to(reply->message_address);
  if (ep == nullptr) return fail_connection(serial, "UCX cannot reach the peer's worker address");
  c->ep = ep;
  by_ep[ep] = serial;
  c->send_key = reply->key;
  c->bulk_address = std::move(reply->bulk_address);
  LINK_TRACE("admitted by node {} on conn {}", peer, serial);
  send_control(*c, am_hello, hello_header{wire_magic, wire_version, opt.self});
}

void link_state::report_refusal(std::uint64_t count, const std::string& from,
                                const std::string& why) {
  if ((count & (count - 1)) != 0) return;
  fmt::print(stderr, "[link {}] refused a connection from {}: {} ({} so far)\n", opt.self,
             from.empty() ? "?" : from, why, count);
}

result<connection*> link_state::connection_to(node_id peer) {
  auto it = peers.find(peer);
  if (it == peers.end()) {
    return error{fmt::format("unknown node {}: call add_peer() with its address first", peer)};
  }
  auto& pe = it->second;
  if (pe.lost) return error{fmt::format("node {} is lost; re-add it once it is back", peer)};
  if (auto* c = find_conn(pe.send_conn)) return c;
  if (!pe.addressed) return error{fmt::format("no address for node {}", peer)};
  if (said_goodbye) return error{fmt::format("not dialling node {}: this node is leaving", peer)};
  connection& c = add_connection(nullptr, /*outgoing=*/true, peer);
  pe.send_conn = c.serial;
  LINK_TRACE("dialling node {} at {}:{} on conn {}", peer, pe.host, pe.port, c.serial);
  admission_request request{opt.self, message_address, bulk_address, c.recv_key};
  c.dial = admission_dial(io, peer, pe.host, pe.port, opt.job_token, request, opt.hello_timeout,
                          [w = weak_from_this(), serial = c.serial](result<admission_reply> r) {
                            if (auto s = w.lock()) s->on_admission_reply(serial, std::move(r));
                          });
  resend_unacked(c);
  return &c;
}

void link_state::close_bulk(connection& c, bool force) {
  if (c.bulk_ep == nullptr) return;
  by_bulk_ep.erase(c.bulk_ep);
  close_ep(c.bulk_ep, force);
  c.bulk_ep = nullptr;
}

ucp_ep_h link_state::bulk_ep_of(connection& c) {
  if (c.bulk_ep != nullptr || c.bulk_address.size() <= host_tag_bytes) return c.bulk_ep;
  const bool same_host = on_this_host(c);
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

void link_state::close_ep(ucp_ep_h ep, bool force) {
  if (ep == nullptr) return;  // an outgoing connection still being admitted
  by_ep.erase(ep);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
  if (r != nullptr && !UCS_PTR_IS_ERR(r)) closing.push_back(r);
  kick();
}

void link_state::linger_conn(connection& c) {
  std::vector<ucp_ep_h> eps;
  for (ucp_ep_h* ep : {&c.ep, &c.bulk_ep}) {
    if (*ep == nullptr) continue;
    by_ep.erase(*ep);
    by_bulk_ep.erase(*ep);
    eps.push_back(*ep);
    lingering.push_back(*ep);
    *ep = nullptr;
  }
  if (eps.empty()) return;
  auto timer = std::make_shared<asio::steady_timer>(io, opt.closed_linger);
  timer->async_wait([w = weak_from_this(), timer, eps](const std::error_code&) {
    auto s = w.lock();
    if (!s || s->dying) return;  // shutdown closes what is left
    for (ucp_ep_h ep : eps) {
      if (std::erase(s->lingering, ep) > 0) s->close_ep(ep, /*force=*/true);
    }
  });
}

void link_state::close_conn(connection& c, bool force, bool tell) {
  if (tell && c.ep != nullptr && !said_goodbye) send_signal(c, am_closed);
  close_bulk(c, force);
  close_ep(c.ep, force);
  c.ep = nullptr;
}

void link_state::fail_connection(std::uint64_t serial, const std::string& detail, bool linger) {
  connection* c = find_conn(serial);
  if (c == nullptr) return;
  const node_id peer = c->peer;
  const bool refused = c->outgoing && !c->welcomed;  // our dial: the peer never answered
  LINK_TRACE("failing conn {} (node {}): {}", serial, peer, detail);
  if (linger) {
    linger_conn(*c);
  } else {
    close_conn(*c, /*force=*/true);
  }
  drop_conn(serial);
  drop_grants(serial);
  fail_waiting_pulls(serial, detail);
  // Another connection to that peer still works (one each way, or a redial overtook this
  // failure): the peer is not lost; its messages go on there, what was unacked first.
  for (auto& [other, oc] : conns) {
    if (oc->peer != peer) continue;
    auto& pe = peers[peer];
    if (find_conn(pe.send_conn) == nullptr) {
      pe.send_conn = other;
      resend_unacked(*oc);
      if (oc->welcomed) post_release_held(other);  // else at the welcome (or hello)
    }
    return;
  }
  lose_peer(peer, refused ? peer_loss::refused : peer_loss::crash, detail);
}

void link_state::post_release_held(std::uint64_t serial) {
  asio::post(io, [w = weak_from_this(), serial] {
    if (auto st = w.lock()) st->release_held(serial);
  });
}

void link_state::lose_peer(node_id peer, peer_loss why, const std::string& detail) {
  auto it = peers.find(peer);
  if (it == peers.end() || it->second.lost) return;
  // After our own goodbye, peers closing on us is expected, not news.
  if (said_goodbye) why = peer_loss::goodbye;
  if (auto& bye = it->second.goodbye) {
    // It said goodbye, and went before all it sent before that arrived: it left, cleanly;
    // what is missing is counted.
    if (book.peer_session(peer) == bye->stream.session) {
      book.give_up_before_goodbye(book.missing_before_goodbye(peer, bye->stream));
    }
    bye.reset();
    why = peer_loss::goodbye;
  }
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
    if (c->peer == peer) doomed.push_back(serial);
  }
  for (auto serial : doomed) {
    close_conn(*conns[serial], why != peer_loss::goodbye, why != peer_loss::goodbye);
    drop_conn(serial);
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

void link_state::check_hello_timeouts() {
  const auto now = clock::now();
  std::vector<std::uint64_t> silent;
  for (auto& [serial, c] : conns) {
    // Admitted over TCP but no first message on the endpoints: UCX could not connect them
    // (outgoing: the admission exchange has its own deadline before).
    const auto limit = c->outgoing ? 2 * opt.hello_timeout : opt.hello_timeout;
    if (!c->welcomed && !c->hello_seen && now - c->created > limit) silent.push_back(serial);
  }
  for (auto serial : silent) {
    fail_connection(serial, "admitted, but no first message on the endpoints in time");
  }
}

}  // namespace moevement::transport::detail
