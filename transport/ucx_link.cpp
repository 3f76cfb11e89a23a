#include "transport/ucx_link.hpp"

#include "transport/ucx_link_state.hpp"

namespace moevement::transport {

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
  return state_->admission->port();
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
  c.skipped = state_->book.gaps();
  c.unacked = state_->book.kept();
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
    if (c->peer == peer) doomed.push_back(serial);
  }
  for (auto serial : doomed) s.fail_connection(serial, "failed by the test");
}

void ucx_link::revive(node_id peer) {
  auto& s = *state_;
  auto it = s.peers.find(peer);
  if (it == s.peers.end() || !it->second.lost) return;
  const detail::peer_entry was = it->second;
  it->second = detail::peer_entry::again(was);
  it->second.kept = true;  // still kept while it has no connection (and no address to dial)
  ++s.counters.revived;
}

void ucx_link::say_goodbye() {
  auto& s = *state_;
  s.said_goodbye = true;
  if (detail::link_tracing()) fmt::print(stderr, "[link {}] saying goodbye\n", s.opt.self);
  for (auto& [serial, c] : s.conns) {
    // Behind what the connection holds (resends), never overtaking it.
    // It says the last message numbered for the peer: the peer waits for all of them.
    s.send_when_welcomed(*c, [&s](detail::connection& conn) {
      s.send_control(conn, detail::am_goodbye, s.book.goodbye_header(conn.peer));
    });
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
  // An outgoing endpoint is wired once the acceptor welcomed us; an accepted one once the
  // hello arrived.
  if (!(*c)->welcomed) {
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
  const std::size_t piece = state_->opt.pull_piece_bytes;
  if (d.node == state_->opt.self || piece == 0 || d.length <= piece || into.size() != d.length) {
    return pull_piece(d, into, std::move(done));
  }
  // In pieces, one after another: a connection that fails mid-transfer costs the piece in
  // flight (asked again on the next one), not what arrived before it. Under a lease, pieces
  // after the first are read without asking.
  struct chain {
    bulk_descriptor whole;
    std::span<std::byte> into;
    pull_handler done;
    std::uint64_t at = 0;
  };
  auto c = std::make_shared<chain>(chain{d, into, std::move(done)});
  auto next = std::make_shared<std::function<void()>>();
  *next = [this, c, next, w = std::weak_ptr<detail::link_state>(state_), piece] {
    const std::uint64_t n = std::min<std::uint64_t>(piece, c->whole.length - c->at);
    bulk_descriptor part = c->whole;
    part.offset += c->at;
    part.length = n;
    pull_piece(part, c->into.subspan(c->at, n), [c, next, w, n](result<void> r) {
      const auto s = w.lock();
      if (r.ok() && (s == nullptr || s->dying)) r = error{"the link was destroyed"};
      if (!r.ok() || (c->at += n) == c->whole.length) {
        auto done = std::move(c->done);
        *next = nullptr;  // the chain ends: no cycle left
        return done(std::move(r));
      }
      ++s->counters.pull_pieces;
      (*next)();  // from a posted handler: outside UCX's progress; the link lives (not dying)
    });
  };
  (*next)();
}

void ucx_link::pull_piece(const bulk_descriptor& d, std::span<std::byte> into, pull_handler done) {
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
  if (!c.ok()) {
    // A peer the link still keeps (a failed connection, no verdict yet; or revived, with no
    // address to dial: its own redial is awaited) gets the pull parked, as its messages are:
    // asked on its next connection, failed once it is forgotten.
    const auto pe = s.peers.find(d.node);
    if (pe == s.peers.end() || !pe->second.kept || s.said_goodbye) {
      return fail("pull: " + c.err().message);
    }
    ++s.counters.pulls_parked;
    // No path to the peer is known now: byte copies, unless RMA is the only path allowed.
    (void)s.add_pull(d, into, /*conn=*/0,
                     s.opt.bulk == bulk_path::rma ? detail::rma_any : detail::rma_none,
                     std::move(done));
    return;
  }
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
  auto& op_ref = s.add_pull(d, into, (*c)->serial, rma, std::move(done));
  const std::uint64_t id = op_ref.id;
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
