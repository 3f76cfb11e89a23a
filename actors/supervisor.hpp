// Supervisors, after Erlang/OTP: an actor that starts children from specs, links to them,
// traps their exits and restarts them by strategy, within a restart intensity; past it, it
// stops its children and fails, so that its own supervisor decides (escalation).
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "actors/system.hpp"

namespace moevement::actors {

enum class restart_type : std::uint8_t {
  permanent = 0,  // always restarted
  transient = 1,  // restarted only after an abnormal exit (not normal or shutdown)
  temporary = 2,  // never restarted; removed from the set when it stops
};

enum class strategy : std::uint8_t {
  one_for_one,   // restart the child that stopped
  one_for_all,   // stop all others (reverse start order), restart all (start order)
  rest_for_one,  // stop the children started after it (reverse), restart it and them
};

// More than `max_restarts` restarts within `period` and the supervisor gives up: it stops its
// children and exits with an error, which its parent supervisor sees. OTP's default.
struct restart_intensity {
  int max_restarts = 1;
  clock::duration period = std::chrono::seconds(5);
};

struct child_spec {
  std::string id;
  // Starts the child (locally or on another node) and returns its ref. Must not be a lambda
  // coroutine with captures (it would dangle); call a coroutine taking its values as
  // parameters, as local() and named() do.
  std::function<awaitable<result<actor_ref>>(actor_system&)> start;
  restart_type restart = restart_type::permanent;
  // How long an ordered shutdown waits for a remote child to confirm it stopped.
  clock::duration shutdown_timeout = std::chrono::seconds(5);

  // A child of type A built from copies of `args` on this node.
  template <class A, class... Args>
  static child_spec local(std::string id, restart_type restart, Args... args) {
    child_spec s;
    s.id = std::move(id);
    s.restart = restart;
    s.start = [args...](actor_system& sys) { return ready(sys.spawn<A>(args...).ref); };
    return s;
  }
  // A child of a registered type on `node` (this node or another).
  static child_spec named(std::string id, node_id node, std::string type_name,
                          restart_type restart);

 private:
  static awaitable<result<actor_ref>> ready(actor_ref r) { co_return r; }
};

class supervisor : public actor {
 public:
  using interface = actors::interface<ask_t<proto::GrowChildren, proto::Ack>,
                                      ask_t<proto::ListChildren, proto::ChildList>>;

  supervisor(strategy how, restart_intensity intensity, std::vector<child_spec> children);

  // Adds children and restarts the whole enlarged set together (stop all, reverse order;
  // start all, in order). Local form of the GrowChildren message; runs as one turn of the
  // supervisor, after what is already queued. counts_as_restart: the growth counts against
  // the restart intensity like a child's restart (past it, the supervisor gives up).
  static result<void> grow(actor_system& sys, actor_ref supervisor_ref,
                           std::vector<child_spec> more, bool counts_as_restart = false);
  // Starts a child of type A, built from copies of `args`, on this node under the running local
  // supervisor `supervisor_ref`, and returns its ref: spawned and linked before this returns,
  // so its exit cannot be missed (the supervisor records it in its next turn, before any exit
  // of it). For children whose ref the caller needs at once (a restarted child has a new one:
  // which_children). Under one_for_one, no other child is touched.
  template <class A, class... Args>
  static result<actor_ref> start_local(actor_system& sys, actor_ref supervisor_ref, std::string id,
                                       restart_type restart, Args... args);
  // The children and their current refs (actor 0 when not running), in start order.
  static awaitable<result<std::vector<std::pair<std::string, actor_ref>>>> which_children(
      actor_system& sys, actor_ref supervisor_ref, clock::duration timeout);

  std::size_t restarts() const { return restart_log_.size(); }

 protected:
  awaitable<void> on_start() override;
  awaitable<void> on_exit(actor_ref who, exit_reason why) override;
  void on_stop(const exit_reason& why) override;
  // Called before every start of children (the first, each restart, each growth), after the
  // ones to restart were stopped: a subclass prepares what their start functions read (say,
  // where each runs now). An error makes the supervisor give up with it.
  virtual awaitable<result<void>> before_start() { co_return result<void>{}; }
  // A child ended and is not restarted (temporary, or transient after a normal exit): the
  // subclass's strategy for it (say, report an abnormal end upwards). The default does nothing.
  virtual awaitable<void> child_ended(const std::string& /*id*/, actor_ref /*who*/,
                                      const exit_reason& /*why*/) {
    co_return;
  }
  // A child that fails to start is tried again, with the others (before_start first),
  // counted as a restart; off (the default), the supervisor gives up at once.
  void retry_failed_starts(bool on) { retry_failed_starts_ = on; }

 private:
  struct child {
    child_spec spec;
    actor_ref ref;
  };
  // A start_local child until the supervisor records it: stopped (in a later turn of the
  // io_context) if the supervisor never does.
  struct adoption {
    adoption(actor_system& s, actor_ref c) : sys(s), child(c) {}
    ~adoption();
    actor_system& sys;
    actor_ref child;
    bool done = false;
  };
  awaitable<void> on_grow(proto::GrowChildren::Reader m, proto::Ack::Builder);
  awaitable<void> on_list(proto::ListChildren::Reader, proto::ChildList::Builder out);
  awaitable<void> grow_now(std::vector<child_spec> more, bool counts_as_restart);
  awaitable<void> adopt(child_spec spec, actor_ref ref);
  // Starts children [from, end) in order; false (and the supervisor quits) if one fails.
  awaitable<bool> start_range(std::size_t from);
  // Stops children [from, end) in reverse order and waits for each.
  awaitable<void> stop_range(std::size_t from);
  bool note_restart();  // false when the intensity is exceeded
  awaitable<void> give_up(exit_reason why);

  strategy strategy_;
  restart_intensity intensity_;
  std::vector<child> children_;
  std::deque<clock::time_point> restart_log_;
  std::vector<actor_ref> retired_;  // children we stopped on purpose: their exits are ignored
  bool retry_failed_starts_ = false;
};

template <class A, class... Args>
result<actor_ref> supervisor::start_local(actor_system& sys, actor_ref supervisor_ref,
                                          std::string id, restart_type restart, Args... args) {
  if (!sys.alive(supervisor_ref)) {
    return error{"start_local: the supervisor " + supervisor_ref.to_string() + " is not running"};
  }
  const actor_ref child = sys.spawn<A>(args...).ref;
  sys.link(supervisor_ref, child);
  auto spec = child_spec::local<A>(std::move(id), restart, std::move(args)...);
  // The mailbox is FIFO: this turn comes before any exit of the child. Should the supervisor
  // stop first, the turn is dropped unrun, and the guard stops the child instead.
  auto guard = std::make_shared<adoption>(sys, child);
  (void)sys.post_call(supervisor_ref, [spec = std::move(spec), guard](actor& a) mutable {
    guard->done = true;
    return static_cast<supervisor&>(a).adopt(std::move(spec), guard->child);
  });
  return child;
}

}  // namespace moevement::actors
