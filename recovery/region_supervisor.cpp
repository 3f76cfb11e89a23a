#include "recovery/region_supervisor.hpp"

#include <fmt/format.h>

#include <chrono>

#include "engine/engine.capnp.h"

namespace moevement::recovery {

namespace {

// How long a restart waits for the coordinator's answer: it may be busy choosing the durable
// tier's window (asks of up to 300 s) when the region restarts.
constexpr auto restart_timeout = std::chrono::seconds(600);

actors::awaitable<result<actors::actor_ref>> start_member(
    actors::actor_system& sys, std::shared_ptr<region_supervisor::member_nodes> nodes,
    std::size_t i) {
  if (i >= nodes->size()) co_return error{fmt::format("member {} has no worker", i)};
  co_return co_await sys.spawn_named((*nodes)[i], region_member::registered_name,
                                     std::chrono::seconds(10));
}

}  // namespace

region_supervisor::region_supervisor(std::uint64_t region, actors::actor_ref coordinator,
                                     std::shared_ptr<member_nodes> nodes, std::size_t members,
                                     int max_restarts)
    : actors::supervisor(actors::strategy::one_for_all,
                         // restarts over the whole recovery count (it never lasts a day)
                         actors::restart_intensity{max_restarts, std::chrono::hours(24)},
                         member_specs(nodes, 0, members)),
      region_(region),
      coordinator_(coordinator),
      nodes_(std::move(nodes)) {
  // A member's worker lost between the restart's answer and its child's start: the next
  // attempt gives the role a spare.
  retry_failed_starts(true);
}

std::vector<actors::child_spec> region_supervisor::member_specs(std::shared_ptr<member_nodes> nodes,
                                                                std::size_t from,
                                                                std::size_t count) {
  std::vector<actors::child_spec> specs;
  for (std::size_t i = from; i < from + count; ++i) {
    actors::child_spec s;
    s.id = fmt::format("member {}", i);
    s.restart = actors::restart_type::permanent;
    s.start = [nodes, i](actors::actor_system& sys) { return start_member(sys, nodes, i); };
    specs.push_back(std::move(s));
  }
  return specs;
}

asio::awaitable<result<void>> region_supervisor::before_start() {
  auto fill = [&](engine::wire::RegionRestart::Builder b) { b.setRegion(region_); };
  auto r = co_await ask<engine::wire::RegionRestart, engine::wire::RegionMembers>(
      coordinator_, restart_timeout, fill);
  if (!r.ok()) co_return error{"the coordinator did not answer: " + r.err().message};
  if (r->get().getError().size() > 0) co_return error{std::string(r->get().getError())};
  nodes_->clear();
  for (auto n : r->get().getNodes()) nodes_->push_back(n);
  co_return result<void>{};
}

}  // namespace moevement::recovery
