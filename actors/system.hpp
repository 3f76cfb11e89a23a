// The actor system: one per process (node), on one asio::io_context.
//
// Threading: the system, every actor in it and the link are driven by the ONE thread that runs
// the io_context. Nothing here locks; call every method from that thread (from a handler, a
// coroutine co_spawned on the io_context, or before run()). Heavy compute belongs on another
// thread whose result is awaited, so heartbeats are never stuck behind it.
//
// Actors: a C++ class deriving from `actor`, with an `interface` naming the messages it takes
// (Cap'n Proto structs) and coroutine handlers registered in its constructor:
//
//   class counter : public actor {
//    public:
//     using interface = actors::interface<tell_t<Add>, ask_t<Get, Total>>;
//     counter() { on<Add>(&counter::add); on<Get, Total>(&counter::get); }
//    private:
//     awaitable<void> add(Add::Reader m) { total_ += m.getN(); co_return; }
//     awaitable<void> get(Get::Reader, Total::Builder out) { out.setN(total_); co_return; }
//     std::int64_t total_ = 0;
//   };
//
// Reentrancy: an actor handles one message at a time, start to finish. When a handler
// co_awaits (an ask, a timer, anything), the actor stays busy: its mailbox is not read until
// the handler returns; new messages queue (and count against the bound). Replies to the
// actor's own asks do not go through its mailbox (they go straight to the waiting handler),
// so a handler may ask others; two actors asking each other from inside handlers wait until
// one ask times out (an error, never a hang). Down and exit notifications also queue.
//
// Compiler caveat (g++ 12): an aggregate temporary (`T{...}`, `{...}`, a lambda capturing
// something with a destructor) inside a co_await expression is destroyed twice. Name such
// values first and std::move them in: `auto why = ...; co_await f(std::move(why));`.
//
// Delivery: same-process messages are built once in an in-memory Cap'n Proto message and
// handed over without serialization; remote ones go through the link in an envelope and are
// copied (and so validated) into the same in-memory form on arrival. Either way the handler
// reads a Reader, runs later (never inside the sender's call), and per sender-receiver pair
// order is FIFO.
#pragma once

#include <capnp/message.h>
#include <kj/exception.h>
#include <asio/async_result.hpp>
#include <asio/awaitable.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <asio/use_awaitable.hpp>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "actors/actor_ref.hpp"
#include "actors/disposer.hpp"
#include "actors/exit_reason.hpp"
#include "actors/suspicions.hpp"
#include "actors/system.capnp.h"
#include "actors/system_config.hpp"
#include "actors/time_source.hpp"
#include "actors/unique_function.hpp"
#include "base/result.hpp"
#include "transport/link.hpp"

namespace moevement::actors {

using asio::awaitable;
using transport::node_id;

// ---- typed interfaces ------------------------------------------------------------------------

template <class Msg>
struct tell_t {
  using request = Msg;
  using response = void;
};
template <class Req, class Resp>
struct ask_t {
  using request = Req;
  using response = Resp;
};

namespace detail {
template <class Req, class... Entries>
struct find_reply {
  using type = void;
};
template <class Req, class E, class... Rest>
struct find_reply<Req, E, Rest...> {
  using type = std::conditional_t<std::is_same_v<typename E::request, Req>, typename E::response,
                                  typename find_reply<Req, Rest...>::type>;
};
}  // namespace detail

// What an actor accepts; typed refs check sends against it at compile time.
template <class... Entries>
struct interface {
  template <class Msg>
  static constexpr bool accepts_tell = (false || ... ||
                                        (std::is_same_v<typename Entries::request, Msg> &&
                                         std::is_void_v<typename Entries::response>));
  template <class Req>
  static constexpr bool accepts_ask = (false || ... ||
                                       (std::is_same_v<typename Entries::request, Req> &&
                                        !std::is_void_v<typename Entries::response>));
  template <class Req>
  using reply_of = typename detail::find_reply<Req, Entries...>::type;
};

// A subclass actor's interface: its base's entries and more (say, a custom stage actor that
// takes the engine's protocol and messages of its own). The base's handlers stay registered
// under the base's interface.
template <class Base, class... More>
struct extend_interface;
template <class... Entries, class... More>
struct extend_interface<interface<Entries...>, More...> {
  using type = interface<Entries..., More...>;
};
template <class Base, class... More>
using extended = typename extend_interface<Base, More...>::type;

// ---- messages --------------------------------------------------------------------------------

// Replies carry this bit in their correlation id; requests never do.
inline constexpr std::uint64_t reply_bit = std::uint64_t{1} << 63;

class actor;

// One message in a mailbox (or one reply on its way to an ask).
struct mail {
  enum class kind : std::uint8_t { user, down, exit, call };
  kind what = kind::user;
  transport::envelope_header header;
  clock::time_point deadline = clock::time_point::max();  // asks: when the caller gives up
  actor_ref about;                                        // down/exit: who stopped
  exit_reason reason;                                     // down/exit: why
  unique_function<awaitable<void>(actor&)> call;          // kind::call (local only)

  // Back to a fresh state, for reuse from the system's pool.
  void reset() {
    what = kind::user;
    header = {};
    deadline = clock::time_point::max();
    about = {};
    reason = {};
    call = {};
    builder_.reset();
  }

  capnp::MallocMessageBuilder& builder() {
    if (!builder_) {
      std::memset(static_cast<void*>(first_), 0, sizeof(first_));
      builder_.emplace(kj::arrayPtr(first_, inline_words));
    }
    return *builder_;
  }

 private:
  // Small messages fit in this first segment: one allocation per message.
  static constexpr std::size_t inline_words = 24;
  capnp::word first_[inline_words];
  std::optional<capnp::MallocMessageBuilder> builder_;
};
using mail_ptr = std::unique_ptr<mail>;

// The answer to an ask: reads the reply in place.
template <class T>
class reply {
 public:
  explicit reply(mail_ptr m) : mail_(std::move(m)) {}
  typename T::Reader get() const { return mail_->builder().getRoot<T>().asReader(); }
  typename T::Reader operator*() const { return get(); }

 private:
  mail_ptr mail_;
};

struct noop_fill {
  template <class B>
  void operator()(B&&) const {}
};

class actor_system;

// ---- actors ----------------------------------------------------------------------------------

struct spawn_options {
  std::size_t mailbox_capacity = 0;  // 0 = the system's default
};

class actor {
 public:
  actor() = default;
  virtual ~actor() = default;
  actor(const actor&) = delete;
  actor& operator=(const actor&) = delete;

  // Valid from on_start() on (not in the constructor).
  actor_ref self() const { return self_; }
  actor_system& system() const { return *system_; }

  // Sends with this actor as the sender.
  template <class Msg, class Fill = noop_fill>
  result<void> tell(actor_ref to, Fill&& fill = {});
  template <class Req, class Resp, class Fill = noop_fill>
  awaitable<result<reply<Resp>>> ask(actor_ref to, clock::duration timeout, Fill fill = {});
  // A down message (on_down) when `target` stops, with the reason; at once (noproc) if it is
  // already gone.
  void monitor(actor_ref target);
  // Exit propagation both ways: when either stops abnormally the other stops with the same
  // reason, unless it traps exits (then on_exit gets a message instead).
  void link(actor_ref other);
  void trap_exit(bool on) { trap_exit_ = on; }
  // Stops this actor at once, as sys.stop(self) does: on_stop runs, asks in its mailbox fail,
  // monitors and links fire, and the running handler is cancelled at its next await.
  void quit(exit_reason why = exit_reason::normal());

 protected:
  template <class Msg, class Self>
  void on(awaitable<void> (Self::*fn)(typename Msg::Reader));
  template <class Req, class Resp, class Self>
  void on(awaitable<void> (Self::*fn)(typename Req::Reader, typename Resp::Builder));

  // The sender of the message being handled (empty from outside an actor, and in on_start,
  // on_down, on_exit, posted calls): its node proved the job's token (stats().wrong_sender).
  actor_ref sender() const { return sender_; }

  // Runs as the actor's first turn, before any message.
  virtual awaitable<void> on_start() { co_return; }
  // A monitored actor stopped.
  virtual awaitable<void> on_down(actor_ref /*who*/, exit_reason /*why*/) { co_return; }
  // A linked actor stopped and this actor traps exits.
  virtual awaitable<void> on_exit(actor_ref /*who*/, exit_reason /*why*/) { co_return; }
  // Synchronous clean-up when the actor stops (any reason); must not throw.
  virtual void on_stop(const exit_reason& /*why*/) {}

 private:
  friend class actor_system;
  using copy_fn = result<void> (*)(const transport::incoming_envelope&, mail&);
  struct handler_entry {
    std::uint64_t type_id = 0;
    std::uint64_t reply_type_id = 0;  // 0 for tell
    copy_fn copy_in = nullptr;
    // Not a coroutine itself: it calls the member coroutine, whose frame holds what it needs.
    std::function<awaitable<void>(actor&, mail&)> invoke;
  };
  const handler_entry* find_handler(std::uint64_t type_id) const {
    for (const auto& h : handlers_) {
      if (h.type_id == type_id) return &h;
    }
    return nullptr;
  }

  std::vector<handler_entry> handlers_;
  actor_ref self_;
  actor_ref sender_;  // of the message being handled (sender())
  actor_system* system_ = nullptr;
  bool trap_exit_ = false;
};

// A ref that knows the actor's interface: sends are checked at compile time.
template <class A>
struct typed_ref {
  actor_system* sys = nullptr;
  actor_ref ref;

  operator actor_ref() const { return ref; }  // NOLINT: implicit, a typed ref is a ref
  bool valid() const { return ref.valid(); }

  template <class Msg, class Fill = noop_fill>
  result<void> tell(Fill&& fill = {}) const;
  template <class Req, class Fill = noop_fill>
  awaitable<result<reply<typename A::interface::template reply_of<Req>>>> ask(
      clock::duration timeout, Fill fill = {}) const;
};

// head_changed: `node` is the head now (the old one was lost, reported just before).
enum class member_event : std::uint8_t { up, goodbye, lost, head_changed };
struct member_info {
  node_id node = 0;
  std::uint32_t incarnation = 0;
};

class actor_system {
 public:
  actor_system(asio::io_context& io, transport::link& link, system_config config = {});
  ~actor_system();
  actor_system(const actor_system&) = delete;
  actor_system& operator=(const actor_system&) = delete;

  node_id node() const { return node_; }
  // The head now (config().head until a standby took over) and the standby, if any.
  node_id head() const { return head_; }
  std::optional<node_id> standby() const { return standby_; }
  std::uint32_t incarnation() const { return config_.incarnation; }
  const system_config& config() const { return config_; }
  asio::io_context& io() { return io_; }
  const system_stats& stats() const { return stats_; }
  // The last connection redialled (stats().reconnects) and why: "node N: DETAIL"; empty if none.
  const std::string& last_reconnect() const { return last_reconnect_; }

  // ---- time: actors read it and sleep through the system, never the clock directly, so
  // that a test's manual time governs them too.
  clock::time_point now() const { return time_->now(); }
  time_source& time() { return *time_; }
  // Completes after `d`; throws asio::system_error (operation_aborted) when the awaiting
  // actor is stopped meanwhile, like an Asio timer.
  awaitable<void> sleep_for(clock::duration d);

  // ---- spawn
  template <class A, class... Args>
  typed_ref<A> spawn(Args&&... args) {
    return spawn_with<A>(spawn_options{}, std::forward<Args>(args)...);
  }
  template <class A, class... Args>
  typed_ref<A> spawn_with(spawn_options opts, Args&&... args) {
    return {this, start_actor(std::make_unique<A>(std::forward<Args>(args)...), opts)};
  }
  // Types that other nodes may spawn here by name.
  void register_type(std::string name, std::function<std::unique_ptr<actor>()> factory);
  template <class A>
  void register_type(std::string name) {
    register_type(std::move(name), [] { return std::make_unique<A>(); });
  }
  // Spawns a registered type here (node == node()) or on another node.
  awaitable<result<actor_ref>> spawn_named(node_id where, std::string type_name,
                                           clock::duration timeout, spawn_options opts = {});

  // ---- messaging (from outside an actor the sender is empty)
  template <class Msg, class Fill = noop_fill>
  result<void> tell(actor_ref to, Fill&& fill = {}, actor_ref from = {});
  template <class Req, class Resp, class Fill = noop_fill>
  awaitable<result<reply<Resp>>> ask(actor_ref to, clock::duration timeout, Fill fill = {},
                                     actor_ref from = {});
  // Runs `fn` as one turn of a local actor (local-only messages, e.g. C++ closures for a
  // supervisor). An error if the actor is not local or gone.
  result<void> post_call(actor_ref to, unique_function<awaitable<void>(actor&)> fn);

  // ---- lifecycle, monitors, links
  // Stops an actor: a local one at once (its running handler is cancelled at its current or
  // next await), a remote one by a message to its node.
  void stop(actor_ref target, exit_reason why = exit_reason::shutdown());
  // Like stop(), and waits until the target is gone (remote: its node confirmed it).
  awaitable<result<void>> stop_and_wait(actor_ref target, exit_reason why, clock::duration timeout);
  void monitor(actor_ref watcher, actor_ref target);
  void link(actor_ref a, actor_ref b);
  bool alive(actor_ref ref) const;  // local actors only
  // The object of a running local actor (nullptr otherwise), for tests and diagnostics: use it
  // on the io_context thread and do not keep it past the current turn.
  template <class A>
  A* local_actor(actor_ref ref) {
    cell* c = find_cell(ref);
    return c == nullptr ? nullptr : dynamic_cast<A*>(c->impl.get());
  }
  std::size_t actor_count() const { return cells_.size(); }

  // ---- registry
  // Node-local names; a name is released when its actor stops.
  result<void> register_name(const std::string& name, actor_ref ref);
  std::optional<actor_ref> whereis(const std::string& name) const;
  // Cluster-wide names, held by the head node (released when the actor or its node stops).
  awaitable<result<void>> register_global(std::string name, actor_ref ref, clock::duration timeout);
  awaitable<result<actor_ref>> whereis_global(std::string name, clock::duration timeout);

  // ---- membership and failure detection
  // Non-head nodes join through the head; afterwards every member heartbeats every other.
  awaitable<result<void>> join(clock::duration timeout);
  std::vector<member_info> members() const;
  // When a member was last heard from (any message); nullopt for non-members.
  std::optional<clock::time_point> last_heard(node_id n) const {
    auto it = members_.find(n);
    if (it == members_.end()) return std::nullopt;
    return it->second.last_heard;
  }
  // Members coming and going, as this node knows them. `fn(node(), lost)`: the head declared
  // this node itself lost (others could not reach it), or this node is a head that stalled
  // while a standby waited (yield_to_standby); it is fenced and should stop.
  void on_membership(std::function<void(node_id, member_event)> fn) {
    membership_fn_ = std::move(fn);
  }
  // The caller knows the process behind member `peer` is gone (a launcher saw it exit): it is
  // declared lost now, on the head with the verdict sent to every member. (A failed connection
  // alone is redialled first: see on_peer_lost.)
  void lose_member(node_id peer, const std::string& detail);
  // `peer` (process incarnation `incarnation`) leaves the job: a member is declared lost; one
  // not joined yet has its Join refused when it comes (hung as it started, then woken).
  void fence(node_id peer, std::uint32_t incarnation, const std::string& detail);
  // The job is over: members are about to leave, and a failed connection to one is taken as
  // its leaving (declared at once), never redialled.
  void wind_down();
  // Where member `peer` listens: the head learns its workers' addresses so that it can redial
  // one whose connection failed (a member that dialled us is reachable without it, but then
  // only it can reconnect, and a failed connection to it is a verdict at once).
  void add_peer_address(node_id peer, const std::string& host, std::uint16_t port);
  // Why a node was declared lost (the transport's detail, the heartbeat silence, or the
  // head's verdict); empty if it was not.
  std::string why_lost(node_id n) const {
    auto it = lost_why_.find(n);
    return it == lost_why_.end() ? std::string() : it->second;
  }
  // This node itself did not run its heartbeats for longer than the heartbeat timeout (it was
  // stopped, e.g. SIGSTOP, or starved of CPU): `fn(gap)`. The members' silence over that gap
  // is this node's own, so none is declared lost for it: each gets a fresh timeout (one that
  // died meanwhile is found then, or at once by the transport).
  void on_stall(std::function<void(clock::duration)> fn) { stall_fn_ = std::move(fn); }

  // Destroys `object` off the actor thread (actors/disposer.hpp): for memory dropped in bulk,
  // whose freeing would hold the heartbeats. Never for transport handles (bulk regions).
  template <class T>
  void dispose(T object) {
    disposer_.dispose(std::move(object));
  }

  // Ordered shutdown: stops every local actor, newest first, fails pending asks, says goodbye
  // to peers and stops the timers. Run the io_context afterwards to let coroutines unwind.
  void shutdown();

  // ---- used by actor and typed_ref templates
  mail_ptr make_mail() {
    if (mail_pool_.empty()) return std::make_unique<mail>();
    mail_ptr m = std::move(mail_pool_.back());
    mail_pool_.pop_back();
    return m;
  }
  void recycle(mail_ptr m) {
    if (mail_pool_.size() >= mail_pool_limit) return;
    m->reset();
    mail_pool_.push_back(std::move(m));
  }
  void send_reply_local(std::uint64_t correlation_id, mail_ptr reply);
  result<void> send_envelope(node_id to, transport::outgoing_envelope& out);

 private:
  struct watch {
    actor_ref who;
    bool is_link = false;
  };
  struct cell {
    actor_ref ref;
    std::unique_ptr<actor> impl;
    std::deque<mail_ptr> mailbox;
    std::size_t capacity = 0;
    unique_function<void()> waiter;  // set while the loop waits for mail
    asio::cancellation_signal cancel;
    bool dead = false;
    bool in_handler = false;
    exit_reason reason;
    std::vector<watch> watchers;
    std::vector<std::string> names;
    std::vector<std::string> global_names;
  };
  struct remote_watch {
    actor_ref watcher;  // local
    actor_ref target;   // remote
    bool is_link = false;
  };
  struct pending {
    std::uint32_t generation = 1;
    bool used = false;
    actor_ref target;
    clock::time_point deadline;
    std::uint64_t reply_type = 0;
    actor::copy_fn copy_in = nullptr;
    unique_function<void(result<mail_ptr>)> waiter;
  };
  struct member {
    std::uint32_t incarnation = 0;
    clock::time_point last_heard;
    bool suspected = false;  // not heard for the timeout (reported to the head, off the head)
    bool heard = false;      // anything from it since it joined (else join_grace applies)
  };

  actor_ref start_actor(std::unique_ptr<actor> impl, spawn_options opts);
  awaitable<void> run_cell(std::shared_ptr<cell> c, std::shared_ptr<bool> alive);
  // Not a coroutine: returns the handler's own awaitable (one frame per message).
  awaitable<void> dispatch(cell& c, mail& m);
  static awaitable<void> nothing() { co_return; }
  void enqueue(cell& c, mail_ptr m);
  void terminate(cell& c, exit_reason why);
  void deliver_down(actor_ref watcher, actor_ref target, const exit_reason& why, bool is_link);
  cell* find_cell(actor_ref ref);
  const cell* find_cell(actor_ref ref) const;
  result<void> check_reachable(actor_ref to) const;
  // reply_type: 0 for a tell, else the reply type the asker expects.
  result<void> check_local_target(actor_ref to, std::uint64_t type_id, std::uint64_t reply_type,
                                  cell*& out);
  void reply_error(const transport::envelope_header& request, const std::string& message);

  // Resumptions (mailbox wake-ups, ask completions) run later from one posted drain, in
  // order: never inside the caller's call, and without one trip through Asio's scheduler
  // (and its reactor poll) per message.
  void schedule(unique_function<void()> fn);
  void drain();

  // asks
  std::uint64_t pending_open(actor_ref target, clock::time_point deadline, std::uint64_t reply_type,
                             actor::copy_fn copy_in);
  pending* pending_find(std::uint64_t correlation_id);
  void pending_complete(std::uint64_t correlation_id, result<mail_ptr> r);
  void pending_close(std::uint64_t correlation_id);
  template <class Resp>
  awaitable<result<reply<Resp>>> await_reply(std::uint64_t correlation_id);
  void push_deadline(clock::time_point at, std::uint64_t correlation_id);
  void arm_deadline(clock::time_point at);
  void on_deadline();
  template <class Req, class Resp, class Fill>
  awaitable<result<reply<Resp>>> ask_system(node_id to, clock::duration timeout, Fill fill);

  // wire
  void on_wire(node_id from, transport::incoming_envelope env);
  void on_wire_reply(node_id from, transport::incoming_envelope& env);
  void on_wire_system(node_id from, transport::incoming_envelope& env);
  void on_system_down(node_id from, proto::Down::Reader d);
  void on_system_watch(node_id from, proto::Watch::Reader w);
  void on_system_spawn(const transport::envelope_header& h, proto::Spawn::Reader s);
  void on_system_join(node_id from, const transport::envelope_header& h, proto::Join::Reader j);
  void on_system_register(node_id from, const transport::envelope_header& h,
                          proto::Register::Reader r);
  void on_peer_lost(node_id peer, transport::peer_loss why, const std::string& detail);
  // The one place a member becomes lost on this node (the head's verdict, or on the head
  // itself its own): fails asks, fires monitors and links, and, on the head, tells the others.
  void declare_lost(node_id peer, bool clean, const std::string& detail);
  void fail_pending_to(node_id peer, const std::string& why);
  void on_system_unreachable(node_id from, proto::Unreachable::Reader u);
  void on_system_reachable(node_id from, proto::Reachable::Reader r);
  void on_system_member_lost(node_id from, proto::MemberLost::Reader m);
  void report_to_head(node_id peer, bool unreachable, const std::string& detail);
  void take_verdicts();
  template <class Resp, class Fill>
  void reply_wire(const transport::envelope_header& request, Fill&& fill);
  void send_watch(actor_ref watcher, actor_ref target, bool is_link);

  // membership
  void add_member(node_id n, std::uint32_t incarnation);
  void heartbeat_tick();
  void heard(node_id from);
  void head_drop_names_of(node_id n);
  // The head `lost` is gone and the standby takes its place (on every member, the standby
  // included): the names of local actors go to the new head.
  void follow_standby();
  // On a head with a standby that did not run for longer than the heartbeat timeout (it was
  // stopped): the standby may have taken its place, so it judges nobody from now on and
  // reports itself lost (fenced). True once it has.
  bool yield_to_standby();
  // A quorum for the head's place (actors/system_standby.cpp), so that a cut link does not
  // leave two heads: the nodes but the head vote. The head with a standby yields when a
  // majority of them fell silent at once (it is the one cut off); a member tells the standby
  // that it no longer hears the head; the standby takes over only once every member it hears
  // says so and they and it are a majority.
  bool head_cut_off(std::size_t newly_silent);
  void head_silent();        // on a member: the head's silence passed the timeout
  void head_still_silent();  // and on each tick after, while it lasts
  void report_head(bool unreachable);
  void maybe_take_over();
  bool is_standby() const { return standby_ && *standby_ == node_; }

  asio::io_context& io_;
  transport::link& link_;
  system_config config_;
  node_id node_;
  node_id head_;                    // config_.head until the standby takes over
  std::optional<node_id> standby_;  // config_.standby, or the head's (Welcome); reset if lost
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
  bool shut_down_ = false;
  system_stats stats_;
  std::string last_reconnect_;

  std::uint64_t next_actor_id_ = 1;
  std::unordered_map<std::uint64_t, std::shared_ptr<cell>> cells_;
  std::map<std::string, std::function<std::unique_ptr<actor>()>> types_;
  std::map<std::string, actor_ref> names_;
  std::map<std::string, actor_ref> global_names_;  // head only
  std::vector<remote_watch> remote_watches_;
  static constexpr std::size_t mail_pool_limit = 4096;
  std::vector<mail_ptr> mail_pool_;
  std::vector<unique_function<void()>> ready_;
  std::vector<unique_function<void()>> running_;
  bool drain_posted_ = false;

  std::vector<pending> pending_;
  std::vector<std::uint32_t> free_pending_;
  std::vector<std::pair<clock::time_point, std::uint64_t>> deadlines_;  // min-heap
  std::size_t live_pending_ = 0;
  std::unique_ptr<steady_time> own_time_;  // when the config gave none
  time_source* time_ = nullptr;
  time_source::timer_id deadline_timer_ = 0;
  bool deadline_armed_ = false;
  clock::time_point deadline_armed_at_;

  disposer disposer_;
  std::map<node_id, member> members_;
  std::map<node_id, std::uint32_t> lost_;  // node -> the incarnation that was lost
  std::map<node_id, std::string> lost_why_;
  std::set<node_id> fenced_;        // lost, not by goodbye: nothing from it is read
  std::set<node_id> redialled_;     // members redialled after a failed connection, not heard since
  bool winding_down_ = false;       // wind_down(): failed connections are not redialled
  bool yielded_ = false;            // a head that stalled with a standby waiting (yield_to_standby)
  std::set<node_id> head_unheard_;  // the standby: members that report the head silent
  std::string head_loss_;           // the standby: how it lost the head itself (the first way)
  time_source::timer_id heartbeat_timer_ = 0;
  bool heartbeat_running_ = false;
  std::function<void(node_id, member_event)> membership_fn_;
  std::function<void(clock::duration)> stall_fn_;
  suspicion_book suspicions_;                // head only
  time_source::timer_id verdict_timer_ = 0;  // head only: the next suspicion window's end
  clock::time_point last_tick_{};            // of heartbeat_tick (a gap past the timeout: a stall)
};

// ---- templates -------------------------------------------------------------------------------

namespace detail {
template <class T>
result<void> copy_payload(const transport::incoming_envelope& env, mail& m) {
  auto p = env.payload<T>();
  if (!p.ok()) return p.err();
  try {
    m.builder().setRoot(*p);  // a deep copy; reads (and so checks) every pointer
  } catch (const kj::Exception& e) {
    return error{std::string("malformed payload: ") + e.getDescription().cStr()};
  }
  return {};
}
}  // namespace detail

template <class Msg, class Self>
void actor::on(awaitable<void> (Self::*fn)(typename Msg::Reader)) {
  static_assert(Self::interface::template accepts_tell<Msg>,
                "this message is not a tell_t<> in the actor's interface");
  if (find_handler(capnp::typeId<Msg>()) != nullptr) {
    throw std::logic_error("actor: a message type can have one handler only");
  }
  handler_entry h;
  h.type_id = capnp::typeId<Msg>();
  h.copy_in = &detail::copy_payload<Msg>;
  h.invoke = [fn](actor& a, mail& m) -> awaitable<void> {
    return (static_cast<Self&>(a).*fn)(m.builder().getRoot<Msg>().asReader());
  };
  handlers_.push_back(h);
}

template <class Req, class Resp, class Self>
void actor::on(awaitable<void> (Self::*fn)(typename Req::Reader, typename Resp::Builder)) {
  static_assert(Self::interface::template accepts_ask<Req>,
                "this message is not an ask_t<> in the actor's interface");
  static_assert(std::is_same_v<typename Self::interface::template reply_of<Req>, Resp>,
                "the handler's reply type differs from the interface's");
  using fn_t = decltype(fn);
  if (find_handler(capnp::typeId<Req>()) != nullptr) {
    throw std::logic_error("actor: a message type can have one handler only");
  }
  handler_entry h;
  h.type_id = capnp::typeId<Req>();
  h.reply_type_id = capnp::typeId<Resp>();
  h.copy_in = &detail::copy_payload<Req>;
  h.invoke = [fn](actor& a, mail& m) -> awaitable<void> {
    // A plain coroutine (not a lambda coroutine): everything it needs is in its parameters.
    return [](Self& self, fn_t f, mail& req, actor_system& sys) -> awaitable<void> {
      const transport::envelope_header reply_header{req.header.receiver, req.header.sender,
                                                    capnp::typeId<Resp>(),
                                                    req.header.correlation_id | reply_bit, 0};
      if (req.header.sender.node == sys.node()) {
        auto r = sys.make_mail();
        r->header = reply_header;
        co_await (self.*f)(req.builder().getRoot<Req>().asReader(), r->builder().initRoot<Resp>());
        sys.send_reply_local(req.header.correlation_id, std::move(r));
      } else {
        transport::outgoing_envelope out(reply_header);
        co_await (self.*f)(req.builder().getRoot<Req>().asReader(), out.init_payload<Resp>());
        (void)sys.send_envelope(req.header.sender.node, out);
      }
    }(static_cast<Self&>(a), fn, m, a.system());
  };
  handlers_.push_back(h);
}

template <class Msg, class Fill>
result<void> actor::tell(actor_ref to, Fill&& fill) {
  return system_->tell<Msg>(to, std::forward<Fill>(fill), self_);
}

template <class Req, class Resp, class Fill>
awaitable<result<reply<Resp>>> actor::ask(actor_ref to, clock::duration timeout, Fill fill) {
  return system_->ask<Req, Resp>(to, timeout, std::move(fill), self_);
}

template <class A>
template <class Msg, class Fill>
result<void> typed_ref<A>::tell(Fill&& fill) const {
  static_assert(A::interface::template accepts_tell<Msg>, "the actor does not take this tell");
  return sys->tell<Msg>(ref, std::forward<Fill>(fill));
}

template <class A>
template <class Req, class Fill>
awaitable<result<reply<typename A::interface::template reply_of<Req>>>> typed_ref<A>::ask(
    clock::duration timeout, Fill fill) const {
  static_assert(A::interface::template accepts_ask<Req>, "the actor does not take this ask");
  return sys->ask<Req, typename A::interface::template reply_of<Req>>(ref, timeout,
                                                                      std::move(fill));
}

template <class Msg, class Fill>
result<void> actor_system::tell(actor_ref to, Fill&& fill, actor_ref from) {
  const std::uint64_t type_id = capnp::typeId<Msg>();
  if (!from.valid()) from = {node_, config_.incarnation, 0};  // replies route by node
  if (to.node == node_) {
    cell* c = nullptr;
    if (auto ok = check_local_target(to, type_id, 0, c); !ok) return ok;
    auto m = make_mail();
    m->header = {from.address(), to.address(), type_id, 0, 0};
    fill(m->builder().initRoot<Msg>());
    enqueue(*c, std::move(m));
    return {};
  }
  if (auto ok = check_reachable(to); !ok) return ok;
  transport::outgoing_envelope out({from.address(), to.address(), type_id, 0, 0});
  fill(out.init_payload<Msg>());
  return send_envelope(to.node, out);
}

template <class Req, class Resp, class Fill>
awaitable<result<reply<Resp>>> actor_system::ask(actor_ref to, clock::duration timeout, Fill fill,
                                                 actor_ref from) {
  const std::uint64_t type_id = capnp::typeId<Req>();
  if (!from.valid()) from = {node_, config_.incarnation, 0};  // replies route by node
  const auto deadline = now() + timeout;
  if (to.node == node_) {
    cell* c = nullptr;
    if (auto ok = check_local_target(to, type_id, capnp::typeId<Resp>(), c); !ok) {
      co_return ok.err();
    }
    const std::uint64_t corr = pending_open(to, deadline, capnp::typeId<Resp>(), nullptr);
    auto m = make_mail();
    m->header = {from.address(), to.address(), type_id, corr, 0};
    m->deadline = deadline;
    fill(m->builder().initRoot<Req>());
    enqueue(*c, std::move(m));
    co_return co_await await_reply<Resp>(corr);
  }
  if (auto ok = check_reachable(to); !ok) co_return ok.err();
  const std::uint64_t corr =
      pending_open(to, deadline, capnp::typeId<Resp>(), &detail::copy_payload<Resp>);
  const auto budget = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
  transport::outgoing_envelope out(
      {from.address(), to.address(), type_id, corr, static_cast<std::uint64_t>(budget)});
  fill(out.init_payload<Req>());
  if (auto sent = send_envelope(to.node, out); !sent) {
    pending_close(corr);
    co_return sent.err();
  }
  co_return co_await await_reply<Resp>(corr);
}

template <class Resp>
awaitable<result<reply<Resp>>> actor_system::await_reply(std::uint64_t corr) {
  // Only trivially destructible captures here (see run_cell).
  result<mail_ptr> r =
      co_await asio::async_initiate<const asio::use_awaitable_t<>&, void(result<mail_ptr>)>(
          [this, corr](auto handler) {
            pending* p = pending_find(corr);
            if (p == nullptr) {  // cannot happen: nothing ran since pending_open
              handler(result<mail_ptr>(error{"internal: ask vanished before its wait"}));
              return;
            }
            auto slot = asio::get_associated_cancellation_slot(handler);
            if (slot.is_connected()) {
              // Emitted only by terminate(), while the system is alive.
              slot.assign([this, corr](asio::cancellation_type) {
                pending_complete(corr, error{"ask cancelled: the asking actor stopped"});
              });
            }
            p->waiter = std::move(handler);
            push_deadline(p->deadline, corr);
          },
          asio::use_awaitable);
  if (!r.ok()) co_return r.err();
  co_return reply<Resp>(std::move(*r));
}

template <class Req, class Resp, class Fill>
awaitable<result<reply<Resp>>> actor_system::ask_system(node_id to, clock::duration timeout,
                                                        Fill fill) {
  // Actor 0 is a node's system; incarnation 0 means "whichever incarnation runs there".
  return ask<Req, Resp>(actor_ref{to, 0, 0}, timeout, std::move(fill));
}

template <class Resp, class Fill>
void actor_system::reply_wire(const transport::envelope_header& request, Fill&& fill) {
  if (request.correlation_id == 0) return;
  transport::outgoing_envelope out({request.receiver, request.sender, capnp::typeId<Resp>(),
                                    request.correlation_id | reply_bit, 0});
  fill(out.init_payload<Resp>());
  (void)send_envelope(request.sender.node, out);
}

}  // namespace moevement::actors
