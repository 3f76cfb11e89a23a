#include "actors/system.hpp"

#include <fmt/format.h>
#include <asio/bind_cancellation_slot.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/error.hpp>
#include <asio/post.hpp>

#include <algorithm>
#include <exception>
#include <optional>

namespace moevement::actors {
namespace {

void set_reason(proto::ExitReason::Builder b, const exit_reason& why) {
  b.setKind(static_cast<std::uint8_t>(why.kind));
  b.setDetail(why.detail);
}
std::string describe(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (const kj::Exception& x) {
    return x.getDescription().cStr();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace

std::string exit_reason::to_string() const {
  static constexpr const char* names[] = {"normal", "shutdown", "error",
                                          "killed", "noproc",   "node_lost"};
  const auto i = static_cast<std::size_t>(kind);
  std::string s = i < std::size(names) ? names[i] : "unknown";
  if (!detail.empty()) s += ": " + detail;
  return s;
}

void actor::monitor(actor_ref target) {
  system_->monitor(self_, target);
}
void actor::link(actor_ref other) {
  system_->link(self_, other);
}
void actor::quit(exit_reason why) {
  system_->stop(self_, std::move(why));
}

actor_system::actor_system(asio::io_context& io, transport::link& link, system_config config)
    : io_(io),
      link_(link),
      config_(config),
      node_(link.self()),
      head_(config.head),
      standby_(config.standby) {
  if (config_.time == nullptr) own_time_ = std::make_unique<steady_time>(io);
  time_ = config_.time != nullptr ? config_.time : own_time_.get();
  transport::link_handlers h;
  h.on_message = [this](node_id from, transport::incoming_envelope env) {
    on_wire(from, std::move(env));
  };
  h.on_peer_lost = [this](node_id peer, transport::peer_loss why, const std::string& detail) {
    on_peer_lost(peer, why, detail);
  };
  link_.set_handlers(std::move(h));
}

actor_system::~actor_system() {
  shutdown();
  *alive_ = false;
  link_.set_handlers({});
}

awaitable<void> actor_system::sleep_for(clock::duration d) {
  time_source* ts = time_;
  const auto at = ts->now() + d;
  co_await asio::async_initiate<const asio::use_awaitable_t<>&, void(asio::error_code)>(
      [ts, at](auto handler) {
        using handler_t = decltype(handler);
        // Completed once: by the timer, or by a cancellation (the awaiting actor stopped).
        auto held = std::make_shared<std::optional<handler_t>>(std::move(handler));
        auto slot = asio::get_associated_cancellation_slot(**held);
        const auto id = ts->call_at(at, [held] {
          if (!held->has_value()) return;
          auto h = std::move(**held);
          held->reset();
          std::move(h)(asio::error_code{});
        });
        if (slot.is_connected()) {
          slot.assign([ts, id, held](asio::cancellation_type) {
            if (!held->has_value()) return;  // already completed: ts may be gone
            ts->cancel(id);
            auto h = std::move(**held);
            held->reset();
            auto ex = asio::get_associated_executor(h);
            asio::post(ex, [h = std::move(h)]() mutable {
              std::move(h)(asio::error_code(asio::error::operation_aborted));
            });
          });
        }
      },
      asio::use_awaitable);
}

// ---- actors ----------------------------------------------------------------------------------

actor_ref actor_system::start_actor(std::unique_ptr<actor> impl, spawn_options opts) {
  if (shut_down_) throw std::logic_error("actor_system: spawn after shutdown()");
  auto c = std::make_shared<cell>();
  c->ref = {node_, config_.incarnation, next_actor_id_++};
  c->capacity = opts.mailbox_capacity != 0 ? opts.mailbox_capacity : config_.mailbox_capacity;
  impl->self_ = c->ref;
  impl->system_ = this;
  c->impl = std::move(impl);
  cells_.emplace(c->ref.actor, c);
  asio::co_spawn(io_, run_cell(c, alive_),
                 asio::bind_cancellation_slot(c->cancel.slot(), asio::detached));
  return c->ref;
}

awaitable<void> actor_system::run_cell(std::shared_ptr<cell> c, std::shared_ptr<bool> alive) {
  // After every resumption `c->dead` is checked before `this` is touched: a stopped actor's
  // loop only unwinds.
  if (!c->dead) {
    c->in_handler = true;
    std::exception_ptr failure;
    try {
      co_await c->impl->on_start();
    } catch (...) {
      failure = std::current_exception();
    }
    c->in_handler = false;
    if (failure && !c->dead && *alive) {
      terminate(*c, exit_reason::failure("on_start failed: " + describe(failure)));
    }
  }
  while (!c->dead) {
    if (c->mailbox.empty()) {
      // Only trivially destructible captures in a co_await expression: g++ 12 can destroy
      // such temporaries twice (a shared_ptr capture here freed the cell).
      cell* waiting = c.get();
      co_await asio::async_initiate<const asio::use_awaitable_t<>&, void()>(
          [waiting](auto handler) { waiting->waiter = std::move(handler); }, asio::use_awaitable);
      continue;
    }
    mail_ptr m = std::move(c->mailbox.front());
    c->mailbox.pop_front();
    c->in_handler = true;
    std::exception_ptr failure;
    try {
      co_await dispatch(*c, *m);
    } catch (...) {
      failure = std::current_exception();
    }
    c->in_handler = false;
    if (failure && *alive) {
      const bool was_dead = c->dead;
      const std::string what = describe(failure);
      if (m->what == mail::kind::user && m->header.correlation_id != 0) {
        reply_error(m->header, was_dead ? fmt::format("actor {} stopped while handling the ask: {}",
                                                      c->ref.to_string(), c->reason.to_string())
                                        : fmt::format("actor {} failed handling the ask: {}",
                                                      c->ref.to_string(), what));
      }
      if (!was_dead) terminate(*c, exit_reason::failure(what));
    }
    if (*alive) recycle(std::move(m));
  }
  // The actor object goes with the last reference to the cell, after its handlers unwound.
}

awaitable<void> actor_system::dispatch(cell& c, mail& m) {
  actor* a = c.impl.get();
  a->sender_ = m.what == mail::kind::user ? actor_ref::from(m.header.sender) : actor_ref{};
  if (m.what == mail::kind::down) return a->on_down(m.about, m.reason);
  if (m.what == mail::kind::exit) return a->on_exit(m.about, m.reason);
  if (m.what == mail::kind::call) return m.call(*a);
  if (m.header.correlation_id != 0 && m.deadline < now()) {
    ++stats_.expired;  // the caller has already given up: do not run the handler
    return nothing();
  }
  if (const actor::handler_entry* h = a->find_handler(m.header.type_id)) return h->invoke(*a, m);
  reply_error(m.header, "no handler for this message type");  // checked at send; kept
  return nothing();
}

void actor_system::enqueue(cell& c, mail_ptr m) {
  c.mailbox.push_back(std::move(m));
  if (c.waiter) schedule(std::exchange(c.waiter, {}));
}

void actor_system::schedule(unique_function<void()> fn) {
  ready_.push_back(std::move(fn));
  if (drain_posted_) return;
  drain_posted_ = true;
  asio::post(io_, [this, alive = alive_] {
    if (*alive) drain();
  });
}

void actor_system::drain() {
  // Bounded rounds, then back to Asio so timers and I/O are served between bursts.
  constexpr int max_rounds = 64;
  for (int round = 0; round < max_rounds && !ready_.empty(); ++round) {
    std::swap(running_, ready_);
    for (auto& fn : running_) fn();
    running_.clear();
  }
  drain_posted_ = false;
  if (!ready_.empty()) {
    drain_posted_ = true;
    asio::post(io_, [this, alive = alive_] {
      if (*alive) drain();
    });
  }
}

void actor_system::terminate(cell& c, exit_reason why) {
  if (c.dead) return;
  c.dead = true;
  c.reason = why;
  auto keep = cells_.at(c.ref.actor);  // the loop holds another reference
  cells_.erase(c.ref.actor);
  for (const auto& n : c.names) names_.erase(n);
  for (const auto& n : c.global_names) {
    if (node_ == head_) {
      auto it = global_names_.find(n);
      if (it != global_names_.end() && it->second == c.ref) global_names_.erase(it);
    } else {
      transport::outgoing_envelope out(
          {c.ref.address(), {head_, 0, 0}, capnp::typeId<proto::Unregister>(), 0, 0});
      auto u = out.init_payload<proto::Unregister>();
      u.setName(n);
      write_ref(u.initActor(), c.ref);
      (void)send_envelope(head_, out);
    }
  }
  try {
    c.impl->on_stop(why);
  } catch (...) {  // on_stop must not throw; a throwing one changes nothing
  }
  // Asks still queued get an error now rather than a timeout later.
  auto queued = std::move(c.mailbox);
  for (auto& m : queued) {
    if (m->what == mail::kind::user && m->header.correlation_id != 0) {
      reply_error(m->header, fmt::format("actor {} stopped before handling the ask: {}",
                                         c.ref.to_string(), why.to_string()));
    }
  }
  auto watchers = std::move(c.watchers);
  for (const auto& w : watchers) deliver_down(w.who, c.ref, why, w.is_link);
  if (c.waiter) {
    schedule(std::exchange(c.waiter, {}));
  } else if (c.in_handler) {
    c.cancel.emit(asio::cancellation_type::terminal);
  }
}

void actor_system::deliver_down(actor_ref watcher, actor_ref target, const exit_reason& why,
                                bool is_link) {
  if (!watcher.valid()) return;
  if (watcher.node != node_) {
    if (lost_.contains(watcher.node)) return;
    transport::outgoing_envelope out(
        {target.address(), {watcher.node, 0, 0}, capnp::typeId<proto::Down>(), 0, 0});
    auto d = out.init_payload<proto::Down>();
    write_ref(d.initWatcher(), watcher);
    write_ref(d.initTarget(), target);
    set_reason(d.initReason(), why);
    d.setIsLink(is_link);
    (void)send_envelope(watcher.node, out);
    return;
  }
  cell* w = find_cell(watcher);
  if (w == nullptr) return;
  if (is_link) {
    if (w->impl->trap_exit_) {
      auto m = make_mail();
      m->what = mail::kind::exit;
      m->about = target;
      m->reason = why;
      enqueue(*w, std::move(m));
    } else if (why.abnormal()) {
      terminate(*w, {why.kind, fmt::format("linked actor {} exited ({})", target.to_string(),
                                           why.to_string())});
    }
    return;
  }
  auto m = make_mail();
  m->what = mail::kind::down;
  m->about = target;
  m->reason = why;
  enqueue(*w, std::move(m));
}

actor_system::cell* actor_system::find_cell(actor_ref ref) {
  if (ref.node != node_ || ref.incarnation != config_.incarnation) return nullptr;
  auto it = cells_.find(ref.actor);
  return it == cells_.end() ? nullptr : it->second.get();
}
const actor_system::cell* actor_system::find_cell(actor_ref ref) const {
  return const_cast<actor_system*>(this)->find_cell(ref);
}

bool actor_system::alive(actor_ref ref) const {
  return find_cell(ref) != nullptr;
}

result<void> actor_system::check_local_target(actor_ref to, std::uint64_t type_id,
                                              std::uint64_t reply_type, cell*& out) {
  if (to.incarnation != config_.incarnation) {
    return error{
        fmt::format("actor {} belongs to incarnation {} of node {}, which is gone "
                    "(now {}); look the actor up again",
                    to.to_string(), to.incarnation, node_, config_.incarnation)};
  }
  auto it = cells_.find(to.actor);
  if (it == cells_.end()) {
    return error{
        fmt::format("actor {} is not running (it stopped or never existed)", to.to_string())};
  }
  cell& c = *it->second;
  const actor::handler_entry* h = c.impl->find_handler(type_id);
  if (h == nullptr || h->reply_type_id != reply_type) {
    return error{fmt::format("actor {} does not handle message type {:#x} as {}", to.to_string(),
                             type_id, reply_type != 0 ? "an ask with this reply type" : "a tell")};
  }
  if (c.mailbox.size() >= c.capacity) {
    ++stats_.mailbox_full;
    return error{
        fmt::format("mailbox of actor {} is full ({} messages); retry later or raise "
                    "its mailbox_capacity",
                    to.to_string(), c.capacity)};
  }
  out = &c;
  return {};
}

result<void> actor_system::check_reachable(actor_ref to) const {
  if (shut_down_) return error{"actor system is shut down"};
  if (auto it = lost_.find(to.node); it != lost_.end()) {
    return error{
        fmt::format("node {} is lost; actor {} cannot be reached", to.node, to.to_string())};
  }
  if (auto it = members_.find(to.node);
      it != members_.end() && to.incarnation != 0 && to.incarnation != it->second.incarnation) {
    return error{
        fmt::format("actor {} belongs to incarnation {} of node {}, which is gone "
                    "(now {})",
                    to.to_string(), to.incarnation, to.node, it->second.incarnation)};
  }
  return {};
}

result<void> actor_system::post_call(actor_ref to, unique_function<awaitable<void>(actor&)> fn) {
  cell* c = find_cell(to);
  if (c == nullptr)
    return error{fmt::format("actor {} is not a running local actor", to.to_string())};
  auto m = make_mail();
  m->what = mail::kind::call;
  m->call = std::move(fn);
  enqueue(*c, std::move(m));
  return {};
}

void actor_system::stop(actor_ref target, exit_reason why) {
  if (target.node == node_) {
    if (cell* c = find_cell(target)) terminate(*c, std::move(why));
    return;
  }
  if (check_reachable(target).ok()) {
    transport::outgoing_envelope out({{}, {target.node, 0, 0}, capnp::typeId<proto::Stop>(), 0, 0});
    auto s = out.init_payload<proto::Stop>();
    write_ref(s.initTarget(), target);
    set_reason(s.initReason(), why);
    (void)send_envelope(target.node, out);
  }
}

awaitable<result<void>> actor_system::stop_and_wait(actor_ref target, exit_reason why,
                                                    clock::duration timeout) {
  if (target.node == node_) {
    stop(target, std::move(why));
    co_return result<void>{};
  }
  auto r = co_await ask_system<proto::Stop, proto::Ack>(target.node, timeout,
                                                        [&](proto::Stop::Builder s) {
                                                          write_ref(s.initTarget(), target);
                                                          set_reason(s.initReason(), why);
                                                        });
  if (!r.ok()) co_return r.err();
  co_return result<void>{};
}

void actor_system::send_watch(actor_ref watcher, actor_ref target, bool is_link) {
  remote_watches_.push_back({watcher, target, is_link});
  transport::outgoing_envelope out(
      {watcher.address(), {target.node, 0, 0}, capnp::typeId<proto::Watch>(), 0, 0});
  auto w = out.init_payload<proto::Watch>();
  write_ref(w.initWatcher(), watcher);
  write_ref(w.initTarget(), target);
  w.setIsLink(is_link);
  if (!send_envelope(target.node, out).ok()) {
    remote_watches_.pop_back();
    deliver_down(watcher, target,
                 {exit_kind::node_lost, fmt::format("node {} cannot be reached", target.node)},
                 is_link);
  }
}

void actor_system::monitor(actor_ref watcher, actor_ref target) {
  if (target.node == node_) {
    if (cell* t = find_cell(target)) {
      t->watchers.push_back({watcher, false});
    } else {
      deliver_down(watcher, target, {exit_kind::noproc, "not running when monitored"}, false);
    }
    return;
  }
  if (auto ok = check_reachable(target); !ok) {
    deliver_down(watcher, target, {exit_kind::node_lost, ok.err().message}, false);
    return;
  }
  send_watch(watcher, target, false);
}

void actor_system::link(actor_ref a, actor_ref b) {
  // `a` is the local side (the caller); b may be anywhere.
  cell* ca = find_cell(a);
  if (ca == nullptr) return;
  if (b.node == node_) {
    cell* cb = find_cell(b);
    if (cb == nullptr) {
      deliver_down(a, b, {exit_kind::noproc, "not running when linked"}, true);
      return;
    }
    ca->watchers.push_back({b, true});
    cb->watchers.push_back({a, true});
    return;
  }
  if (auto ok = check_reachable(b); !ok) {
    deliver_down(a, b, {exit_kind::node_lost, ok.err().message}, true);
    return;
  }
  ca->watchers.push_back({b, true});
  send_watch(a, b, true);
}

// ---- registry --------------------------------------------------------------------------------

result<void> actor_system::register_name(const std::string& name, actor_ref ref) {
  cell* c = find_cell(ref);
  if (c == nullptr)
    return error{
        fmt::format("cannot register '{}': {} is not a running local "
                    "actor",
                    name, ref.to_string())};
  if (names_.contains(name))
    return error{fmt::format("name '{}' is taken on node {}", name, node_)};
  names_[name] = ref;
  c->names.push_back(name);
  return {};
}

std::optional<actor_ref> actor_system::whereis(const std::string& name) const {
  auto it = names_.find(name);
  if (it == names_.end()) return std::nullopt;
  return it->second;
}

awaitable<result<void>> actor_system::register_global(std::string name, actor_ref ref,
                                                      clock::duration timeout) {
  cell* c = find_cell(ref);
  if (c == nullptr) {
    co_return error{fmt::format("cannot register '{}' globally: {} is not a running local actor",
                                name, ref.to_string())};
  }
  if (node_ == head_) {
    if (global_names_.contains(name)) {
      co_return error{fmt::format("global name '{}' is taken", name)};
    }
    global_names_[name] = ref;
  } else {
    auto r = co_await ask_system<proto::Register, proto::Ack>(head_, timeout,
                                                              [&](proto::Register::Builder b) {
                                                                b.setName(name);
                                                                write_ref(b.initActor(), ref);
                                                              });
    if (!r.ok()) co_return r.err();
    c = find_cell(ref);  // it may have stopped while we waited
    if (c == nullptr) co_return error{"the actor stopped while it was being registered"};
  }
  c->global_names.push_back(name);
  co_return result<void>{};
}

awaitable<result<actor_ref>> actor_system::whereis_global(std::string name,
                                                          clock::duration timeout) {
  if (node_ == head_) {
    auto it = global_names_.find(name);
    if (it == global_names_.end()) co_return error{fmt::format("no actor named '{}'", name)};
    co_return it->second;
  }
  auto r = co_await ask_system<proto::Lookup, proto::Found>(
      head_, timeout, [&](proto::Lookup::Builder b) { b.setName(name); });
  if (!r.ok()) co_return r.err();
  const actor_ref found = read_ref(r->get().getActor());
  if (!found.valid()) co_return error{fmt::format("no actor named '{}'", name)};
  co_return found;
}

void actor_system::head_drop_names_of(node_id n) {
  std::erase_if(global_names_, [n](const auto& kv) { return kv.second.node == n; });
}

// ---- spawn by name ---------------------------------------------------------------------------

void actor_system::register_type(std::string name,
                                 std::function<std::unique_ptr<actor>()> factory) {
  types_[std::move(name)] = std::move(factory);
}

awaitable<result<actor_ref>> actor_system::spawn_named(node_id where, std::string type_name,
                                                       clock::duration timeout,
                                                       spawn_options opts) {
  if (where == node_) {
    auto it = types_.find(type_name);
    if (it == types_.end()) {
      co_return error{
          fmt::format("no actor type '{}' is registered on node {}; call "
                      "register_type there",
                      type_name, node_)};
    }
    co_return start_actor(it->second(), opts);
  }
  auto r = co_await ask_system<proto::Spawn, proto::Spawned>(
      where, timeout, [&](proto::Spawn::Builder b) {
        b.setTypeName(type_name);
        b.setMailboxCapacity(static_cast<std::uint32_t>(opts.mailbox_capacity));
      });
  if (!r.ok()) co_return r.err();
  co_return read_ref(r->get().getActor());
}

// ---- asks ------------------------------------------------------------------------------------

std::uint64_t actor_system::pending_open(actor_ref target, clock::time_point deadline,
                                         std::uint64_t reply_type, actor::copy_fn copy_in) {
  std::uint32_t index;
  if (!free_pending_.empty()) {
    index = free_pending_.back();
    free_pending_.pop_back();
  } else {
    index = static_cast<std::uint32_t>(pending_.size());
    pending_.emplace_back();
  }
  pending& p = pending_[index];
  p.used = true;
  p.target = target;
  p.deadline = deadline;
  p.reply_type = reply_type;
  p.copy_in = copy_in;
  ++live_pending_;
  // Correlation id: generation (31 bits) above the slot index; never 0, reply bit clear.
  return (std::uint64_t{p.generation & 0x7fffffffu} << 32) | index;
}

actor_system::pending* actor_system::pending_find(std::uint64_t corr) {
  corr &= ~reply_bit;
  const auto index = static_cast<std::uint32_t>(corr & 0xffffffffu);
  const auto gen = static_cast<std::uint32_t>(corr >> 32);
  if (index >= pending_.size()) return nullptr;
  pending& p = pending_[index];
  if (!p.used || (p.generation & 0x7fffffffu) != gen) return nullptr;
  return &p;
}

void actor_system::pending_close(std::uint64_t corr) {
  pending* p = pending_find(corr);
  if (p == nullptr) return;
  p->used = false;
  p->waiter = {};
  p->copy_in = nullptr;
  if (++p->generation == 0x80000000u) p->generation = 1;
  free_pending_.push_back(static_cast<std::uint32_t>(p - pending_.data()));
  --live_pending_;
}

void actor_system::pending_complete(std::uint64_t corr, result<mail_ptr> r) {
  pending* p = pending_find(corr);
  if (p == nullptr) {
    ++stats_.late_replies;
    return;
  }
  auto waiter = std::move(p->waiter);
  pending_close(corr);
  if (!waiter) return;
  // Always posted: a completion never resumes the asker inside someone else's call.
  schedule([w = std::move(waiter), r = std::move(r)]() mutable { w(std::move(r)); });
}

void actor_system::send_reply_local(std::uint64_t corr, mail_ptr reply) {
  pending_complete(corr, std::move(reply));
}

void actor_system::push_deadline(clock::time_point at, std::uint64_t corr) {
  // The heap holds (deadline, correlation id); completed asks leave stale entries that are
  // skipped when popped, and the heap is rebuilt when they dominate.
  if (deadlines_.size() > 4 * live_pending_ + 64) {
    std::erase_if(deadlines_, [this](const auto& e) { return pending_find(e.second) == nullptr; });
    std::make_heap(deadlines_.begin(), deadlines_.end(), std::greater<>{});
  }
  deadlines_.emplace_back(at, corr);
  std::push_heap(deadlines_.begin(), deadlines_.end(), std::greater<>{});
  arm_deadline(at);
}

void actor_system::arm_deadline(clock::time_point at) {
  if (shut_down_ || (deadline_armed_ && deadline_armed_at_ <= at)) return;
  deadline_armed_ = true;
  deadline_armed_at_ = at;
  if (deadline_timer_ != 0) time_->cancel(deadline_timer_);
  deadline_timer_ = time_->call_at(at, [this, alive = alive_] {
    if (!*alive) return;
    deadline_timer_ = 0;
    deadline_armed_ = false;
    on_deadline();
  });
}

void actor_system::on_deadline() {
  const auto now = this->now();
  while (!deadlines_.empty() && deadlines_.front().first <= now) {
    std::pop_heap(deadlines_.begin(), deadlines_.end(), std::greater<>{});
    const std::uint64_t corr = deadlines_.back().second;
    deadlines_.pop_back();
    pending* p = pending_find(corr);
    if (p == nullptr) continue;
    const std::string target = p->target.to_string();
    pending_complete(
        corr, error{fmt::format("ask to {} timed out (deadline passed); the target may be busy "
                                "(one message at a time), overloaded, or on a hung node",
                                target)});
  }
  if (!deadlines_.empty()) arm_deadline(deadlines_.front().first);
}

// ---- shutdown --------------------------------------------------------------------------------

void actor_system::shutdown() {
  if (shut_down_) return;
  // Newest first: children were started after their supervisors.
  std::vector<std::shared_ptr<cell>> all;
  for (auto& [id, c] : cells_) all.push_back(c);
  std::sort(all.begin(), all.end(),
            [](const auto& a, const auto& b) { return a->ref.actor > b->ref.actor; });
  for (auto& c : all) terminate(*c, exit_reason::shutdown("actor system shutting down"));
  for (std::size_t i = 0; i < pending_.size(); ++i) {
    if (pending_[i].used) {
      const std::uint64_t corr = (std::uint64_t{pending_[i].generation & 0x7fffffffu} << 32) | i;
      pending_complete(corr, error{"actor system shutting down"});
    }
  }
  shut_down_ = true;
  time_->cancel(std::exchange(deadline_timer_, 0));
  time_->cancel(std::exchange(heartbeat_timer_, 0));
  time_->cancel(std::exchange(verdict_timer_, 0));
  // A head that yielded leaves without a goodbye: to a standby that has not taken its place
  // yet, a goodbye reads as the job's end, and it would leave too.
  if (!members_.empty() && !yielded_) link_.say_goodbye();
  members_.clear();
}

}  // namespace moevement::actors
