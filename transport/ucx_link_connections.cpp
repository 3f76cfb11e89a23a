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
  c->admitted = outgoing;
  c->peer = peer;
  c->created = clock::now();
  auto& ref = *c;
  by_ep[ep] = c->serial;
  conns[c->serial] = std::move(c);
  return ref;
}

connection* link_state::find_conn(std::uint64_t serial) {
  auto it = conns.find(serial);
  return it == conns.end() ? nullptr : it->second.get();
}

ucp_ep_params_t link_state::ep_params() {
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = &on_ep_error;
  p.err_handler.arg = this;
  return p;
}

void link_state::on_conn_request(ucp_conn_request_h request, void* arg) {
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

std::string link_state::source_of(const std::string& from) {
  return from.substr(0, std::min(from.rfind(':'), from.size()));
}

std::size_t link_state::half_open_from(const std::string& source) const {
  std::size_t n = 0;
  for (const auto& [serial, c] : conns) {
    n += !c->outgoing && !c->admitted && source_of(c->from) == source;
  }
  return n;
}

void link_state::accept(ucp_conn_request_h request) {
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

std::string link_state::client_of(ucp_conn_request_h request) {
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  if (ucp_conn_request_query(request, &attr) != UCS_OK) return "?";
  return address_text(attr.client_address);
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
  by_ep.erase(ep);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
  if (r != nullptr && !UCS_PTR_IS_ERR(r)) closing.push_back(r);
  kick();
}

void link_state::fail_connection(std::uint64_t serial, const std::string& detail) {
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

void link_state::check_hello_timeouts() {
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

}  // namespace moevement::transport::detail
