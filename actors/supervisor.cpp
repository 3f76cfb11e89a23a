#include "actors/supervisor.hpp"

#include <fmt/format.h>

namespace moevement::actors {

child_spec child_spec::named(std::string id, node_id node, std::string type_name,
                             restart_type restart) {
  child_spec s;
  s.id = std::move(id);
  s.restart = restart;
  s.start = [node, type_name](actor_system& sys) {
    return sys.spawn_named(node, type_name, std::chrono::seconds(5));
  };
  return s;
}

supervisor::supervisor(strategy how, restart_intensity intensity, std::vector<child_spec> children)
    : strategy_(how), intensity_(intensity) {
  for (auto& s : children) children_.push_back({std::move(s), {}});
  on<proto::GrowChildren, proto::Ack>(&supervisor::on_grow);
  on<proto::ListChildren, proto::ChildList>(&supervisor::on_list);
}

awaitable<void> supervisor::on_start() {
  trap_exit(true);
  co_await start_range(0);
}

awaitable<bool> supervisor::start_range(std::size_t from) {
  for (;;) {
    auto prepared = co_await before_start();
    if (!prepared.ok()) {
      auto why =
          exit_reason::failure("preparing the children's start failed: " + prepared.err().message);
      co_await give_up(std::move(why));
      co_return false;
    }
    std::string failed;
    for (std::size_t i = from; i < children_.size() && failed.empty(); ++i) {
      auto r = co_await children_[i].spec.start(system());
      if (!r.ok()) {
        failed =
            fmt::format("child '{}' failed to start: {}", children_[i].spec.id, r.err().message);
        break;
      }
      children_[i].ref = *r;
      link(*r);
    }
    if (failed.empty()) co_return true;
    // A failed start is a failed attempt: tried again (counted as a restart) where the
    // subclass asks for it, else the supervisor gives up at once (OTP's behaviour).
    if (!retry_failed_starts_ || !note_restart()) {
      auto why = exit_reason::failure(std::move(failed));
      co_await give_up(std::move(why));
      co_return false;
    }
    co_await stop_range(from);
  }
}

awaitable<void> supervisor::stop_range(std::size_t from) {
  for (std::size_t i = children_.size(); i-- > from;) {
    const actor_ref ref = std::exchange(children_[i].ref, actor_ref{});
    if (!ref.valid()) continue;
    retired_.push_back(ref);
    auto why = exit_reason::shutdown("stopped by supervisor");
    (void)co_await system().stop_and_wait(ref, std::move(why), children_[i].spec.shutdown_timeout);
  }
}

bool supervisor::note_restart() {
  const auto now = system().now();
  restart_log_.push_back(now);
  while (!restart_log_.empty() && now - restart_log_.front() > intensity_.period) {
    restart_log_.pop_front();
  }
  return static_cast<int>(restart_log_.size()) <= intensity_.max_restarts;
}

awaitable<void> supervisor::give_up(exit_reason why) {
  co_await stop_range(0);
  quit(std::move(why));
}

awaitable<void> supervisor::on_exit(actor_ref who, exit_reason why) {
  if (std::erase(retired_, who) != 0) co_return;
  std::size_t i = 0;
  while (i < children_.size() && children_[i].ref != who) ++i;
  if (i == children_.size()) {
    // Not a child: the exit of our own parent. Its failure or shutdown takes this subtree
    // down, children first.
    co_await give_up(why);
    co_return;
  }
  children_[i].ref = {};
  const auto restart = children_[i].spec.restart;
  const bool wanted =
      restart == restart_type::permanent || (restart == restart_type::transient && why.abnormal());
  if (!wanted) {
    const std::string id = children_[i].spec.id;
    if (restart == restart_type::temporary) children_.erase(children_.begin() + i);
    co_await child_ended(id, who, why);
    co_return;
  }
  if (!note_restart()) {
    exit_reason why_up{
        exit_kind::error,
        fmt::format(
            "restart intensity exceeded ({} restarts in {} ms); last: "
            "child '{}' exited ({})",
            intensity_.max_restarts,
            std::chrono::duration_cast<std::chrono::milliseconds>(intensity_.period).count(),
            children_[i].spec.id, why.to_string())};
    co_await give_up(std::move(why_up));
    co_return;
  }
  std::size_t from = i;
  switch (strategy_) {
    case strategy::one_for_one:
      for (;;) {
        auto prepared = co_await before_start();
        if (!prepared.ok()) {
          auto why_up = exit_reason::failure("preparing the children's start failed: " +
                                             prepared.err().message);
          co_await give_up(std::move(why_up));
          co_return;
        }
        auto r = co_await children_[i].spec.start(system());
        if (r.ok()) {
          children_[i].ref = *r;
          link(*r);
          co_return;
        }
        // A failed restart is one more failed attempt where the subclass asks for it (as in
        // start_range), else the supervisor gives up at once.
        if (!retry_failed_starts_ || !note_restart()) {
          auto why_up = exit_reason::failure(fmt::format("child '{}' failed to restart: {}",
                                                         children_[i].spec.id, r.err().message));
          co_await give_up(std::move(why_up));
          co_return;
        }
      }
    case strategy::one_for_all:
      from = 0;
      break;
    case strategy::rest_for_one:
      break;
  }
  co_await stop_range(from);
  // Temporary children are not restarted with the group.
  for (std::size_t j = children_.size(); j-- > from;) {
    if (children_[j].spec.restart == restart_type::temporary && j != i) {
      children_.erase(children_.begin() + static_cast<std::ptrdiff_t>(j));
    }
  }
  co_await start_range(from);
}

void supervisor::on_stop(const exit_reason&) {
  // Stopped from outside (by the parent or the system): stop children synchronously, newest
  // first. Local children stop at once; remote ones are told to.
  for (std::size_t i = children_.size(); i-- > 0;) {
    const actor_ref ref = std::exchange(children_[i].ref, actor_ref{});
    if (ref.valid()) system().stop(ref, exit_reason::shutdown("supervisor stopped"));
  }
}

supervisor::adoption::~adoption() {
  if (done) return;
  asio::post(sys.io(), [s = &sys, c = child] {
    s->stop(c, exit_reason::shutdown("its supervisor stopped before it recorded it"));
  });
}

awaitable<void> supervisor::adopt(child_spec spec, actor_ref ref) {
  children_.push_back({std::move(spec), ref});
  co_return;
}

awaitable<void> supervisor::grow_now(std::vector<child_spec> more, bool counts_as_restart) {
  const std::size_t first_new = children_.size();
  for (auto& s : more) children_.push_back({std::move(s), {}});
  if (counts_as_restart && !note_restart()) {
    exit_reason why{
        exit_kind::error,
        fmt::format(
            "restart intensity exceeded ({} restarts in {} ms); last: the "
            "children grew to {}",
            intensity_.max_restarts,
            std::chrono::duration_cast<std::chrono::milliseconds>(intensity_.period).count(),
            children_.size())};
    co_await give_up(std::move(why));
    co_return;
  }
  if (strategy_ == strategy::one_for_one) {
    // Independent children: only the new ones start.
    co_await start_range(first_new);
    co_return;
  }
  co_await stop_range(0);
  co_await start_range(0);
}

result<void> supervisor::grow(actor_system& sys, actor_ref ref, std::vector<child_spec> more,
                              bool counts_as_restart) {
  return sys.post_call(ref, [more = std::move(more), counts_as_restart](actor& a) mutable {
    return static_cast<supervisor&>(a).grow_now(std::move(more), counts_as_restart);
  });
}

awaitable<void> supervisor::on_grow(proto::GrowChildren::Reader m, proto::Ack::Builder) {
  std::vector<child_spec> more;
  for (auto c : m.getChildren()) {
    const auto r = c.getRestart();
    if (r > static_cast<std::uint8_t>(restart_type::temporary)) {
      throw std::invalid_argument("GrowChildren: restart type out of range");
    }
    more.push_back(
        child_spec::named(c.getId(), c.getNode(), c.getTypeName(), static_cast<restart_type>(r)));
  }
  co_await grow_now(std::move(more), false);
}

awaitable<void> supervisor::on_list(proto::ListChildren::Reader, proto::ChildList::Builder out) {
  auto list = out.initChildren(static_cast<unsigned>(children_.size()));
  for (unsigned i = 0; i < children_.size(); ++i) {
    list[i].setId(children_[i].spec.id);
    auto a = list[i].initActor();
    a.setNode(children_[i].ref.node);
    a.setIncarnation(children_[i].ref.incarnation);
    a.setActor(children_[i].ref.actor);
  }
  co_return;
}

awaitable<result<std::vector<std::pair<std::string, actor_ref>>>> supervisor::which_children(
    actor_system& sys, actor_ref ref, clock::duration timeout) {
  auto r = co_await sys.ask<proto::ListChildren, proto::ChildList>(ref, timeout);
  if (!r.ok()) co_return r.err();
  std::vector<std::pair<std::string, actor_ref>> out;
  for (auto c : r->get().getChildren()) {
    out.emplace_back(c.getId(), actor_ref{c.getActor().getNode(), c.getActor().getIncarnation(),
                                          c.getActor().getActor()});
  }
  co_return out;
}

}  // namespace moevement::actors
