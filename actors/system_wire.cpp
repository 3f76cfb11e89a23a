// The actor system's side of the wire: envelopes in (actor messages, replies, the system
// protocol: down, watch, stop, spawn by name, join, the global registry) and the membership
// (join, heartbeats, lost peers).
#include "actors/system.hpp"

#include <fmt/format.h>
#include <asio/post.hpp>

#include <algorithm>

namespace moevement::actors {
namespace {

exit_reason get_reason(proto::ExitReason::Reader r) {
  const auto k = r.getKind();
  exit_reason why;
  why.kind = k <= static_cast<std::uint8_t>(exit_kind::node_lost) ? static_cast<exit_kind>(k)
                                                                  : exit_kind::error;
  why.detail = r.getDetail();
  return why;
}

}  // namespace

// ---- wire ------------------------------------------------------------------------------------

result<void> actor_system::send_envelope(node_id to, transport::outgoing_envelope& out) {
  return link_.send(to, out.to_words());
}

void actor_system::reply_error(const transport::envelope_header& request,
                               const std::string& message) {
  if (request.correlation_id == 0 || (request.correlation_id & reply_bit) != 0) return;
  if (request.sender.node == node_) {
    pending_complete(request.correlation_id, error{message});
    return;
  }
  reply_wire<proto::ErrorReply>(request,
                                [&](proto::ErrorReply::Builder b) { b.setMessage(message); });
}

void actor_system::on_wire(node_id from, transport::incoming_envelope env) {
  const auto& h = env.header();
  // A node declared lost is never trusted again in this job (it may be alive behind a cut
  // link, and redial); only the head hears a new incarnation of it join.
  if (fenced_.contains(from) &&
      !(node_ == head_ && h.receiver.actor == 0 && h.type_id == capnp::typeId<proto::Join>())) {
    ++stats_.fenced;
    return;
  }
  // A member speaks only for itself: the link's `from` is the node that proved the job token
  // on this connection; a sender naming another node is refused (its replies would go there).
  // A tell from outside an actor has no sender at all.
  const bool anonymous = h.sender == transport::actor_address{} && h.correlation_id == 0;
  if (!anonymous && h.sender.node != from) {
    ++stats_.wrong_sender;
    return;
  }
  heard(from);
  if ((h.correlation_id & reply_bit) != 0) {
    on_wire_reply(from, env);
    return;
  }
  if (h.receiver.node != node_ || (h.receiver.incarnation != config_.incarnation &&
                                   !(h.receiver.actor == 0 && h.receiver.incarnation == 0))) {
    ++stats_.dead_letters;
    reply_error(h,
                fmt::format("actor {} belongs to an incarnation of node {} that is gone "
                            "(now {})",
                            actor_ref::from(h.receiver).to_string(), node_, config_.incarnation));
    return;
  }
  if (h.receiver.actor == 0) {
    try {
      on_wire_system(from, env);
    } catch (const kj::Exception& e) {
      ++stats_.malformed;
      reply_error(h, std::string("malformed system message: ") + e.getDescription().cStr());
    } catch (const std::exception& e) {
      // A payload that is not the struct its type names (payload<T>() an error, read with
      // value()): counted, never fatal. (It left the event loop, ending the process.)
      ++stats_.malformed;
      reply_error(h, std::string("malformed system message: ") + e.what());
    }
    return;
  }
  auto it = cells_.find(h.receiver.actor);
  if (it == cells_.end()) {
    ++stats_.dead_letters;
    reply_error(h, fmt::format("actor {} is not running (it stopped or never existed)",
                               actor_ref::from(h.receiver).to_string()));
    return;
  }
  cell& c = *it->second;
  const actor::handler_entry* entry = c.impl->find_handler(h.type_id);
  if (entry == nullptr || (entry->reply_type_id != 0) != (h.correlation_id != 0)) {
    ++stats_.malformed;
    reply_error(h,
                fmt::format("actor {} does not handle message type {:#x} as {}", c.ref.to_string(),
                            h.type_id, h.correlation_id != 0 ? "an ask" : "a tell"));
    return;
  }
  if (c.mailbox.size() >= c.capacity) {
    ++stats_.mailbox_full;
    reply_error(
        h, fmt::format("mailbox of actor {} is full ({} messages)", c.ref.to_string(), c.capacity));
    return;
  }
  auto m = make_mail();
  m->header = h;
  if (h.budget_ns != 0) m->deadline = now() + std::chrono::nanoseconds(h.budget_ns);
  if (auto ok = entry->copy_in(env, *m); !ok) {
    ++stats_.malformed;
    reply_error(
        h, fmt::format("malformed message for actor {}: {}", c.ref.to_string(), ok.err().message));
    return;
  }
  enqueue(c, std::move(m));
}

void actor_system::on_wire_reply(node_id from, transport::incoming_envelope& env) {
  const auto& h = env.header();
  pending* p = pending_find(h.correlation_id);
  if (p == nullptr) {
    ++stats_.late_replies;
    return;
  }
  if (p->target.node != from) {  // only the node asked answers an ask
    ++stats_.wrong_sender;
    return;
  }
  const std::uint64_t corr = h.correlation_id & ~reply_bit;
  if (h.type_id == capnp::typeId<proto::ErrorReply>()) {
    auto e = env.payload<proto::ErrorReply>();
    std::string text = "remote error";
    try {
      if (e.ok()) text = e->getMessage();
    } catch (const kj::Exception&) {
    }
    pending_complete(corr, error{text});
    return;
  }
  if (h.type_id != p->reply_type || p->copy_in == nullptr) {
    ++stats_.malformed;
    pending_complete(corr, error{fmt::format("reply of unexpected type {:#x}", h.type_id)});
    return;
  }
  auto m = make_mail();
  m->header = h;
  if (auto ok = p->copy_in(env, *m); !ok) {
    ++stats_.malformed;
    pending_complete(corr, error{"malformed reply: " + ok.err().message});
    return;
  }
  pending_complete(corr, std::move(m));
}

void actor_system::on_wire_system(node_id from, transport::incoming_envelope& env) {
  const auto& h = env.header();
  const std::uint64_t t = h.type_id;
  if (t == capnp::typeId<proto::Heartbeat>()) return;  // heard() already noted it
  if (t == capnp::typeId<proto::Down>()) {
    on_system_down(from, env.payload<proto::Down>().value());
  } else if (t == capnp::typeId<proto::Watch>()) {
    on_system_watch(from, env.payload<proto::Watch>().value());
  } else if (t == capnp::typeId<proto::Stop>()) {
    auto s = env.payload<proto::Stop>().value();
    stop(read_ref(s.getTarget()), get_reason(s.getReason()));
    reply_wire<proto::Ack>(h, [](proto::Ack::Builder) {});
  } else if (t == capnp::typeId<proto::Spawn>()) {
    on_system_spawn(h, env.payload<proto::Spawn>().value());
  } else if (t == capnp::typeId<proto::Join>()) {
    on_system_join(from, h, env.payload<proto::Join>().value());
  } else if (t == capnp::typeId<proto::MemberUp>()) {
    // Only the head admits members (its join): from anyone else, a member's incarnation
    // rewritten (its fence lifted, every message to it refused) on one member's word.
    if (from != head_) {
      ++stats_.malformed;
      return;
    }
    auto m = env.payload<proto::MemberUp>().value().getMember();
    if (m.getNode() != node_) add_member(m.getNode(), m.getIncarnation());
  } else if (t == capnp::typeId<proto::Unreachable>()) {
    on_system_unreachable(from, env.payload<proto::Unreachable>().value());
  } else if (t == capnp::typeId<proto::Reachable>()) {
    on_system_reachable(from, env.payload<proto::Reachable>().value());
  } else if (t == capnp::typeId<proto::MemberLost>()) {
    on_system_member_lost(from, env.payload<proto::MemberLost>().value());
  } else if (t == capnp::typeId<proto::Register>()) {
    on_system_register(from, h, env.payload<proto::Register>().value());
  } else if (t == capnp::typeId<proto::Unregister>()) {
    auto r = env.payload<proto::Unregister>().value();
    if (read_ref(r.getActor()).node != from) {  // a node unregisters its own actors only
      ++stats_.wrong_sender;
      return;
    }
    auto it = global_names_.find(r.getName());
    if (it != global_names_.end() && it->second == read_ref(r.getActor())) {
      global_names_.erase(it);
    }
  } else if (t == capnp::typeId<proto::Lookup>()) {
    auto l = env.payload<proto::Lookup>().value();
    auto it = global_names_.find(l.getName());
    const actor_ref found = it == global_names_.end() ? actor_ref{} : it->second;
    reply_wire<proto::Found>(h, [&](proto::Found::Builder b) { write_ref(b.initActor(), found); });
  } else {
    ++stats_.malformed;
    reply_error(h, fmt::format("node {} has no system message of type {:#x}", node_, t));
  }
}

void actor_system::on_system_down(node_id from, proto::Down::Reader d) {
  const actor_ref watcher = read_ref(d.getWatcher());
  const actor_ref target = read_ref(d.getTarget());
  if (target.node != from) {  // an actor's end is told by its own node (a loss: by this one)
    ++stats_.wrong_sender;
    return;
  }
  const bool is_link = d.getIsLink();
  std::erase_if(remote_watches_, [&](const remote_watch& w) {
    return w.watcher == watcher && w.target == target && w.is_link == is_link;
  });
  if (is_link) {
    if (cell* c = find_cell(watcher)) {
      std::erase_if(c->watchers, [&](const watch& w) { return w.who == target; });
    }
  }
  deliver_down(watcher, target, get_reason(d.getReason()), is_link);
}

void actor_system::on_system_watch(node_id from, proto::Watch::Reader w) {
  const actor_ref watcher = read_ref(w.getWatcher());
  const actor_ref target = read_ref(w.getTarget());
  if (watcher.node != from) {
    ++stats_.malformed;
    return;
  }
  if (cell* c = find_cell(target)) {
    c->watchers.push_back({watcher, w.getIsLink()});
  } else {
    deliver_down(watcher, target, {exit_kind::noproc, "not running when watched"}, w.getIsLink());
  }
}

void actor_system::on_system_spawn(const transport::envelope_header& h, proto::Spawn::Reader s) {
  auto it = types_.find(s.getTypeName());
  if (it == types_.end() || shut_down_) {
    reply_error(h, fmt::format("no actor type '{}' is registered on node {}; call "
                               "register_type there",
                               std::string(s.getTypeName()), node_));
    return;
  }
  const actor_ref r = start_actor(it->second(), {s.getMailboxCapacity()});
  reply_wire<proto::Spawned>(h, [&](proto::Spawned::Builder b) { write_ref(b.initActor(), r); });
}

void actor_system::on_system_join(node_id from, const transport::envelope_header& h,
                                  proto::Join::Reader j) {
  if (node_ != head_) {
    reply_error(h, fmt::format("node {} is not the head (node {} is)", node_, head_));
    return;
  }
  if (auto it = lost_.find(from);
      it != lost_.end() && fenced_.contains(from) && j.getIncarnation() <= it->second) {
    ++stats_.fenced;  // the process declared lost, back: only a newer incarnation may join
    return;
  }
  for (const auto& [n, m] : members_) {  // tell the others first
    if (n == from) continue;
    transport::outgoing_envelope out({{}, {n, 0, 0}, capnp::typeId<proto::MemberUp>(), 0, 0});
    auto up = out.init_payload<proto::MemberUp>().initMember();
    up.setNode(from);
    up.setIncarnation(j.getIncarnation());
    (void)send_envelope(n, out);
  }
  add_member(from, j.getIncarnation());
  reply_wire<proto::Welcome>(h, [&](proto::Welcome::Builder b) {
    auto list = b.initMembers(static_cast<unsigned>(members_.size() + 1));
    unsigned i = 0;
    list[i].setNode(node_);
    list[i++].setIncarnation(config_.incarnation);
    for (const auto& [n, m] : members_) {
      list[i].setNode(n);
      list[i++].setIncarnation(m.incarnation);
    }
    if (standby_) {
      b.setStandby(*standby_);
      b.setHasStandby(true);
    }
  });
}

void actor_system::on_system_register(node_id from, const transport::envelope_header& h,
                                      proto::Register::Reader r) {
  const actor_ref ref = read_ref(r.getActor());
  // The standby takes them too: a member whose redial of a dead head was refused follows it
  // at once, and registers its names there before the standby's takeover (the quorum).
  if ((node_ != head_ && !is_standby()) || ref.node != from) {
    reply_error(h, "register_global: not the head, or an actor of another node");
    return;
  }
  const std::string name = r.getName();
  if (global_names_.contains(name)) {
    reply_error(h, fmt::format("global name '{}' is taken", name));
    return;
  }
  global_names_[name] = ref;
  reply_wire<proto::Ack>(h, [](proto::Ack::Builder) {});
}

void actor_system::on_peer_lost(node_id peer, transport::peer_loss why, const std::string& detail) {
  const bool clean = why == transport::peer_loss::goodbye;
  auto m = members_.find(peer);
  if (m == members_.end() && lost_.contains(peer)) return;  // declared already
  // A failed connection to a live-looking member is no verdict by itself (a reset, a
  // transport's timeout on a slow link): it is redialled. Asks to it stand: their requests and
  // replies are kept and sent again by the link, so they end with their reply, their deadline,
  // or a verdict. Where this node's verdict counts (the head on any member, a member on the
  // head), a redial that the peer refuses before it is heard again is one: nothing listens
  // there any more. Elsewhere the heartbeats decide (silence is reported to the head).
  if (!clean && m != members_.end() && !shut_down_ && !winding_down_) {
    const bool judges = node_ == head_ || peer == head_;
    const bool redial_refused = why == transport::peer_loss::refused && redialled_.contains(peer);
    // (Where we cannot dial it, only its own redial could tell: the failure is the verdict.)
    if (!judges || (!redial_refused && link_.can_dial(peer))) {
      redialled_.insert(peer);
      ++stats_.reconnects;
      last_reconnect_ = fmt::format("node {}: {}", peer, detail.substr(0, 200));
      link_.revive(peer);
      return;
    }
    // On the standby a failed dial of the head is no verdict by itself (a dial into a cut link
    // fails too): it counts as the head's silence, and the members decide with it
    // (system_standby.cpp). Dialled again meanwhile.
    if (is_standby() && peer == head_) {
      m->second.suspected = true;
      head_loss_ = detail.substr(0, 200);
      redialled_.insert(peer);
      link_.revive(peer);
      maybe_take_over();
      return;
    }
  }
  declare_lost(peer, clean, detail);
}

void actor_system::wind_down() {
  winding_down_ = true;
}

void actor_system::lose_member(node_id peer, const std::string& detail) {
  declare_lost(peer, false, detail);
}

void actor_system::fence(node_id peer, std::uint32_t incarnation, const std::string& detail) {
  if (peer == node_) return;
  if (members_.contains(peer)) {
    lose_member(peer, detail);
    return;
  }
  auto& fenced_at = lost_[peer];
  fenced_at = std::max(fenced_at, incarnation);
  lost_why_[peer] = detail.substr(0, 300);
  fenced_.insert(peer);
}

void actor_system::add_peer_address(node_id peer, const std::string& host, std::uint16_t port) {
  if (peer != node_ && !host.empty() && port != 0) link_.add_peer(peer, host, port);
}

void actor_system::fail_pending_to(node_id peer, const std::string& why) {
  for (std::size_t i = 0; i < pending_.size(); ++i) {
    pending& p = pending_[i];
    if (p.used && p.target.node == peer) {
      const std::uint64_t corr = (std::uint64_t{p.generation & 0x7fffffffu} << 32) | i;
      pending_complete(corr, error{fmt::format("ask to {} failed: {}", p.target.to_string(), why)});
    }
  }
}

bool actor_system::yield_to_standby() {
  if (yielded_) return true;
  if (node_ != head_ || !standby_ || !members_.contains(*standby_)) return false;
  if (last_tick_ == clock::time_point{} || now() - last_tick_ <= config_.heartbeat_timeout) {
    return false;
  }
  yielded_ = true;
  lost_why_[node_] = fmt::format(
      "this head did not run for longer than the failure timeout ({} ms) while a standby "
      "waited: the standby may have taken its place, so it leaves the job to it",
      config_.heartbeat_timeout.count());
  if (membership_fn_) membership_fn_(node_, member_event::lost);
  return true;
}

void actor_system::declare_lost(node_id peer, bool clean, const std::string& detail) {
  if (yield_to_standby()) return;
  auto m = members_.find(peer);
  if (m == members_.end() && lost_.contains(peer)) return;  // declared already
  redialled_.erase(peer);
  // The head lost where a standby waits: the standby is the head from now on (on the standby
  // itself this is its taking over, and the verdict below goes to every member).
  const bool head_changes =
      !clean && peer == head_ && standby_ && *standby_ != peer && m != members_.end();
  if (head_changes) {
    report_head(true);  // a member's own verdict (a refused redial) counts at the standby too
    head_ = *standby_;
    standby_.reset();
    head_unheard_.clear();
    head_loss_.clear();
    suspicions_ = {};
    // Silences noted under the old head are judged again by the new one: on the new head, a
    // member silent past the timeout is declared at its next tick; a member that suspected
    // the new head gives it a full timeout from now.
    for (auto& [n, mem] : members_) {
      if (!mem.suspected) continue;
      mem.suspected = false;
      if (n == head_) mem.last_heard = now();
    }
  } else if (standby_ && peer == *standby_) {
    standby_.reset();
  }
  const std::uint32_t incarnation = m != members_.end() ? m->second.incarnation : 0;
  lost_[peer] = incarnation;
  lost_why_[peer] = detail.substr(0, 300);
  head_unheard_.erase(peer);
  if (!clean) fenced_.insert(peer);
  if (m != members_.end()) members_.erase(m);
  const exit_reason reason =
      clean ? exit_reason::shutdown(fmt::format("node {} shut down", peer))
            : exit_reason{exit_kind::node_lost, fmt::format("node {} lost: {}", peer, detail)};
  fail_pending_to(peer, reason.to_string());  // every ask waiting on that node fails now
  // Every monitor and link of a local actor on an actor there fires.
  std::vector<remote_watch> fired;
  std::erase_if(remote_watches_, [&](const remote_watch& w) {
    if (w.target.node != peer) return false;
    fired.push_back(w);
    return true;
  });
  for (const auto& w : fired) deliver_down(w.watcher, w.target, reason, w.is_link);
  // Watchers on that node of local actors are gone too.
  for (auto& [id, c] : cells_) {
    std::erase_if(c->watchers, [peer](const watch& w) { return w.who.node == peer; });
  }
  if (node_ == head_) {
    head_drop_names_of(peer);
    suspicions_.forget(peer);
    // The verdict goes to every member, so that none acts on a view of its own, and (best
    // effort, before its connection goes) to the lost node itself: it is fenced. A goodbye
    // each member hears itself (and at a job's end nothing is sent to nodes on their way out).
    if (incarnation != 0 && !clean && !shut_down_) {
      std::vector<node_id> told{peer};
      for (const auto& [n, mem] : members_) told.push_back(n);
      for (node_id n : told) {
        transport::outgoing_envelope out({{}, {n, 0, 0}, capnp::typeId<proto::MemberLost>(), 0, 0});
        auto b = out.init_payload<proto::MemberLost>();
        auto who = b.initMember();
        who.setNode(peer);
        who.setIncarnation(incarnation);
        b.setDetail(detail.substr(0, 1000));
        b.setGoodbye(false);
        (void)send_envelope(n, out);
      }
    }
  }
  link_.forget(peer);  // its report comes back posted and finds it declared
  if (membership_fn_) membership_fn_(peer, clean ? member_event::goodbye : member_event::lost);
  if (head_changes) follow_standby();
}

void actor_system::follow_standby() {
  for (auto& [id, c] : cells_) {
    for (const auto& n : c->global_names) {
      if (node_ == head_) {
        global_names_[n] = c->ref;
        continue;
      }
      // A tell (no reply): a name taken meanwhile at the new head stays the other actor's.
      transport::outgoing_envelope out(
          {c->ref.address(), {head_, 0, 0}, capnp::typeId<proto::Register>(), 0, 0});
      auto r = out.init_payload<proto::Register>();
      r.setName(n);
      write_ref(r.initActor(), c->ref);
      (void)send_envelope(head_, out);
    }
  }
  if (membership_fn_) membership_fn_(head_, member_event::head_changed);
}

// ---- membership ------------------------------------------------------------------------------

awaitable<result<void>> actor_system::join(clock::duration timeout) {
  if (node_ == head_) co_return result<void>{};
  auto r = co_await ask_system<proto::Join, proto::Welcome>(
      head_, timeout, [this](proto::Join::Builder b) { b.setIncarnation(config_.incarnation); });
  if (!r.ok()) co_return r.err();
  if (r->get().getHasStandby() && r->get().getStandby() != head_) {
    standby_ = r->get().getStandby();
  }
  for (auto m : r->get().getMembers()) {
    if (m.getNode() != node_) add_member(m.getNode(), m.getIncarnation());
  }
  // The welcome came from the head: heard, so its silence from now on is judged by the
  // heartbeat timeout, not the join grace of a member never heard from (a head lost before its
  // first heartbeat reached this node was otherwise taken over only after the grace).
  heard(head_);
  co_return result<void>{};
}

std::vector<member_info> actor_system::members() const {
  std::vector<member_info> out;
  for (const auto& [n, m] : members_) out.push_back({n, m.incarnation});
  return out;
}

void actor_system::add_member(node_id n, std::uint32_t incarnation) {
  if (shut_down_) return;
  lost_.erase(n);
  fenced_.erase(n);
  lost_why_.erase(n);
  head_unheard_.erase(n);
  members_[n] = member{incarnation, now(), false};
  if (membership_fn_) membership_fn_(n, member_event::up);
  if (!heartbeat_running_) {
    heartbeat_running_ = true;
    heartbeat_tick();
  }
}

void actor_system::heard(node_id from) {
  auto it = members_.find(from);
  if (it == members_.end()) return;
  it->second.last_heard = now();
  it->second.heard = true;
  redialled_.erase(from);                        // a redial (if any) reached it
  if (it->second.suspected && node_ != head_) {  // back: the report is withdrawn
    it->second.suspected = false;
    if (from == head_) {
      report_head(false);  // (to the standby, which judges the head)
      head_loss_.clear();
    } else {
      report_to_head(from, false, {});
    }
  }
}

void actor_system::report_to_head(node_id peer, bool unreachable, const std::string& detail) {
  auto m = members_.find(peer);
  if (m == members_.end()) return;
  const std::uint64_t type =
      unreachable ? capnp::typeId<proto::Unreachable>() : capnp::typeId<proto::Reachable>();
  transport::outgoing_envelope out({{}, {head_, 0, 0}, type, 0, 0});
  if (unreachable) {
    ++stats_.suspicions;
    auto u = out.init_payload<proto::Unreachable>();
    auto who = u.initMember();
    who.setNode(peer);
    who.setIncarnation(m->second.incarnation);
    u.setDetail(detail);
  } else {
    auto who = out.init_payload<proto::Reachable>().initMember();
    who.setNode(peer);
    who.setIncarnation(m->second.incarnation);
  }
  (void)send_envelope(head_, out);
}

void actor_system::on_system_unreachable(node_id from, proto::Unreachable::Reader u) {
  const node_id suspect = u.getMember().getNode();
  const auto m = members_.find(suspect);
  if (is_standby() && suspect == head_ && members_.contains(from) && m != members_.end() &&
      m->second.incarnation == u.getMember().getIncarnation()) {
    head_unheard_.insert(from);  // (system_standby.cpp)
    maybe_take_over();
    return;
  }
  if (node_ != head_ || !members_.contains(from) || m == members_.end() ||
      m->second.incarnation != u.getMember().getIncarnation()) {
    return;  // not ours to judge, or about a member that is gone already
  }
  suspicions_.report(from, suspect, now(), std::string(u.getDetail()).substr(0, 200));
  if (verdict_timer_ == 0) {
    const auto due = suspicions_.next_due(config_.suspicion_window);
    verdict_timer_ = time_->call_at(*due, [this, alive = alive_] {
      if (!*alive) return;
      verdict_timer_ = 0;
      take_verdicts();
    });
  }
}

void actor_system::on_system_reachable(node_id from, proto::Reachable::Reader r) {
  if (is_standby() && r.getMember().getNode() == head_ && members_.contains(from)) {
    head_unheard_.erase(from);
  }
  if (node_ == head_) suspicions_.withdraw(from, r.getMember().getNode());
}

void actor_system::on_system_member_lost(node_id from, proto::MemberLost::Reader m) {
  const node_id peer = m.getMember().getNode();
  // Only the head's verdicts count, and the standby's on the head (its taking over).
  const bool takeover = standby_ && from == *standby_ && peer == head_;
  if (!takeover && (from != head_ || node_ == head_)) {
    ++stats_.malformed;
    return;
  }
  const std::string detail = m.getDetail();
  if (peer == node_) {  // this node itself: fenced (why_lost(node()) says the head's reason)
    lost_why_[node_] = detail.substr(0, 300);
    if (membership_fn_) membership_fn_(node_, member_event::lost);
    return;
  }
  const auto it = members_.find(peer);
  if (it == members_.end() || it->second.incarnation != m.getMember().getIncarnation()) return;
  declare_lost(peer, m.getGoodbye(), detail);
}

void actor_system::take_verdicts() {
  if (shut_down_) return;
  // A suspect the head does not hear either is the head's own heartbeats' to decide (soon):
  // reports about it wait, and count against nobody.
  const auto hears = [this](node_id n) {
    auto it = members_.find(n);
    return it != members_.end() && !it->second.suspected &&
           now() - it->second.last_heard <= 2 * config_.heartbeat_interval;
  };
  for (const auto& v :
       suspicions_.decide(now(), config_.suspicion_window, config_.suspicion_memory, hears)) {
    if (!members_.contains(v.node)) continue;
    ++stats_.verdicts;
    declare_lost(v.node, false, v.why);
  }
  if (auto due = suspicions_.next_due(config_.suspicion_window)) {
    due = std::max(*due, now() + config_.heartbeat_interval);  // deferred ones: look again
    verdict_timer_ = time_->call_at(*due, [this, alive = alive_] {
      if (!*alive) return;
      verdict_timer_ = 0;
      take_verdicts();
    });
  }
}

void actor_system::heartbeat_tick() {
  if (shut_down_ || members_.empty()) {
    heartbeat_running_ = false;
    last_tick_ = {};
    return;
  }
  const auto now = this->now();
  if (yield_to_standby()) {
    heartbeat_running_ = false;
    return;
  }
  if (last_tick_ != clock::time_point{} && now - last_tick_ > config_.heartbeat_timeout) {
    for (auto& [n, m] : members_) m.last_heard = now;  // their silence was our own stall
    if (stall_fn_) stall_fn_(now - last_tick_);
  } else if (last_tick_ != clock::time_point{} &&
             now - last_tick_ > 2 * config_.heartbeat_interval) {
    // A late tick (this process starved of CPU, or blocked, for less than the timeout): that
    // part of every member's silence is our own, and what they sent meanwhile may still wait
    // to be read after this tick. Each is judged on the time this node ran.
    const auto late = now - last_tick_ - config_.heartbeat_interval;
    for (auto& [n, m] : members_) m.last_heard = std::min(now, m.last_heard + late);
  }
  last_tick_ = now;
  std::vector<node_id> silent;
  for (auto& [n, m] : members_) {
    const auto timeout = m.heard ? config_.heartbeat_timeout
                                 : std::max(config_.heartbeat_timeout, config_.join_grace);
    if (!m.suspected && now - m.last_heard > timeout) {
      m.suspected = true;
      silent.push_back(n);
      // The head and the head's silence are decided here; another member is only reported,
      // and keeps its heartbeats (hearing it again withdraws the report).
      if (node_ == head_ || n == head_) continue;
    }
    transport::outgoing_envelope out({{}, {n, 0, 0}, capnp::typeId<proto::Heartbeat>(), 0, 0});
    out.init_payload<proto::Heartbeat>().setIncarnation(config_.incarnation);
    (void)send_envelope(n, out);
  }
  if (head_cut_off(node_ == head_ ? silent.size() : 0)) {
    heartbeat_running_ = false;
    return;
  }
  for (node_id n : silent) {
    if (node_ == head_) {
      declare_lost(n, false,
                   fmt::format("no heartbeat for {} ms", config_.heartbeat_timeout.count()));
    } else if (n == head_) {
      head_silent();
    } else {
      report_to_head(n, true,
                     fmt::format("not heard for {} ms", config_.heartbeat_timeout.count()));
    }
  }
  // The head still unheard since an earlier tick: the standby decides again (members it heard
  // may have gone silent), and a member whose standby went silent too decides itself.
  if (const auto h = members_.find(head_);
      node_ != head_ && h != members_.end() && h->second.suspected &&
      std::find(silent.begin(), silent.end(), head_) == silent.end()) {
    head_still_silent();
  }
  heartbeat_timer_ = time_->call_at(now + config_.heartbeat_interval, [this, alive = alive_] {
    if (!*alive) return;
    heartbeat_timer_ = 0;
    heartbeat_tick();
  });
}

}  // namespace moevement::actors
