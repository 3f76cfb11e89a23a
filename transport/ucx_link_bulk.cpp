// link_state: bulk transfers: serving and issuing pulls, RMA gets, and leases on regions.
#include "transport/ucx_link_state.hpp"

namespace moevement::transport::detail {

void link_state::serve_pull(std::uint64_t serial, const bulk_request_header& h) {
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
      send_control(*c, am_bulk_lease,
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

void link_state::finish_pull(std::uint64_t id, result<void> r) {
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

void link_state::fail_waiting_pulls(std::uint64_t serial, const std::string& detail) {
  std::vector<std::uint64_t> ids;
  for (auto& [id, op] : pulls) {
    if (op->conn == serial && !op->transferring) ids.push_back(id);
  }
  for (auto id : ids) park_or_fail_pull(id, detail);
}

ucs_status_t link_state::on_bulk_reply(connection& c, am_id id, const void* header,
                                       std::size_t header_len, void* data, std::size_t len,
                                       bool rndv) {
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
    if (op.rma == rma_none || rndv || lh.length != op.length || len == 0 || len > max_rkey_bytes ||
        lh.region_length == 0 || lh.region_base + lh.region_length < lh.region_base ||
        lh.address < lh.region_base || lh.address - lh.region_base > lh.region_length ||
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

void link_state::post_finish(std::uint64_t id, result<void> r) {
  asio::post(io, [w = weak_from_this(), id, r = std::move(r)]() mutable {
    if (auto s = w.lock()) s->finish_pull(id, std::move(r));
  });
}

void link_state::complete_transfer(std::uint64_t id, ucs_status_t st) {
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

ucp_mem_h link_state::local_memh(const std::byte* p, std::size_t n, bool messages) const {
  for (const auto& [id, r] : regions) {
    if (r->base != nullptr && p >= r->base && std::size_t(p - r->base) <= r->length &&
        n <= r->length - std::size_t(p - r->base)) {
      return messages ? r->message_memh : r->memh;
    }
  }
  return nullptr;
}

void link_state::register_for_messages(region_record& r) {
  ucp_mem_map_params_t p{};
  p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  p.address = r.base;
  p.length = r.length;
  r.message_context = context.handle();
  if (ucp_mem_map(context.handle(), &p, &r.message_memh) != UCS_OK) r.message_memh = nullptr;
}

void link_state::use_memh(ucp_request_param_t& param, ucp_mem_h memh) {
  if (memh == nullptr) return;
  param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
  param.memh = memh;
}

void link_state::start_get(std::uint64_t id, const std::vector<std::byte>& packed,
                           std::uint64_t address) {
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

void link_state::adopt_lease(std::uint64_t id, const std::vector<std::byte>& packed,
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

void link_state::issue_get(pull_op& op, connection& c, const std::shared_ptr<lease>& l,
                           std::uint64_t address) {
  op.transferring = true;
  op.under = l;
  ++l->gets;
  if (bulk_ep_of(c) == nullptr) {  // finish_pull gives the lease's get back (op.under)
    return finish_pull(op.id, error{"pull failed: no bulk endpoint to the peer"});
  }
  get_piece(op.id, c.serial, l, address, 0);
}

void link_state::get_piece(std::uint64_t id, std::uint64_t serial, std::shared_ptr<lease> l,
                           std::uint64_t address, std::size_t done) {
  const auto it = pulls.find(id);
  if (it == pulls.end()) return;
  pull_op& op = *it->second;
  connection* c = find_conn(serial);
  if (c == nullptr || c->bulk_ep == nullptr) {  // failed between two pieces
    return complete_transfer(id, UCS_ERR_CONNECTION_RESET);
  }
  const std::size_t left = op.length - done;
  const std::size_t n = on_this_host(*c) ? std::min(get_piece_bytes, left) : left;
  auto p = std::make_unique<pending_request>();
  p->keep = l;  // the rkey outlives the get even if the lease is dropped
  p->done = [this, id, serial, l, address, next = done + n, total = op.length](ucs_status_t st) {
    if (st != UCS_OK || next == total) return complete_transfer(id, st);
    asio::post(io, [w = weak_from_this(), id, serial, l, address, next] {
      if (auto s = w.lock()) s->get_piece(id, serial, l, address, next);
    });
  };
  ucp_request_param_t param = request_params(p.get());
  use_memh(param, local_memh(op.into, op.length, /*messages=*/false));
  ++counters.get_pieces;
  track(ucp_get_nbx(c->bulk_ep, op.into + done, n, address + done, l->key->handle, &param),
        std::move(p));
  kick();
}

void link_state::retire(lease& l) {
  if (l.retired) return;
  l.retired = true;
  if (l.gets == 0) post_release(l.conn, l.region);
}

void link_state::post_release(std::uint64_t serial, std::uint64_t region) {
  asio::post(io, [w = weak_from_this(), serial, region] {
    auto s = w.lock();
    if (!s) return;
    if (connection* c = s->find_conn(serial)) {
      s->send_control(*c, am_bulk_release, region_header{region});
    }
  });
}

void link_state::on_revoke(std::uint64_t serial, std::uint64_t region) {
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

void link_state::withdraw(const std::shared_ptr<region_record>& r) {
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

void link_state::on_release(std::uint64_t serial, std::uint64_t region) {
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

void link_state::drop_grants(std::uint64_t serial) {
  for (auto& [id, r] : regions) r->grants.erase(serial);
  std::erase_if(withdrawn, [&](auto& w) {
    w.second->grants.erase(serial);
    return w.second->grants.empty();
  });
}

std::string link_state::describe(ucp_ep_h ep) {
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

std::optional<std::uint32_t> link_state::detect_rma_level(ucp_ep_h ep) {
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

}  // namespace moevement::transport::detail
