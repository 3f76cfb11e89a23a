#include "recovery/job_supervisor.hpp"

#include <fmt/format.h>

#include "base/parse.hpp"
#include "engine/engine.capnp.h"

namespace moevement::recovery {

job_supervisor::job_supervisor(actors::actor_ref coordinator)
    // Its children are temporary: it never restarts one, so the intensity never applies.
    : actors::supervisor(actors::strategy::one_for_one, actors::restart_intensity{}, {}),
      coordinator_(coordinator) {}

asio::awaitable<void> job_supervisor::child_ended(const std::string& id, actors::actor_ref,
                                                  const actors::exit_reason& why) {
  if (!why.abnormal()) co_return;  // stopped on purpose
  std::uint64_t region = 0;
  if (!parse_int(id, region)) co_return;  // not a region's (every child is one)
  const std::string reason = why.to_string();
  auto fill = [&](engine::wire::RegionEscalated::Builder b) {
    b.setRegion(region);
    b.setReason(reason);
  };
  (void)system().tell<engine::wire::RegionEscalated>(coordinator_, fill, self());
}

actors::actor_ref recovery_tree::start_region(
    std::uint64_t region, std::shared_ptr<region_supervisor::member_nodes> nodes,
    std::size_t members) {
  auto& self = job_.actor();
  auto& sys = self.system();
  if (!root_.valid()) {
    root_ = sys.spawn<job_supervisor>(self.self()).ref;
    self.link(root_);
  }
  auto r = actors::supervisor::start_local<region_supervisor>(
      sys, root_, fmt::format("{}", region), actors::restart_type::temporary, region, self.self(),
      std::move(nodes), members, job_.job().region_restarts);
  if (!r.ok()) {
    job_.fail("the recovery tree could not start region " + std::to_string(region) + ": " +
              r.err().message);
    return {};
  }
  return *r;
}

void recovery_tree::stop_region(actors::actor_ref& supervisor) {
  if (!supervisor.valid()) return;
  job_.actor().system().stop(supervisor, actors::exit_reason::shutdown("its recovery ended"));
  supervisor = {};
}

void recovery_tree::stop() {
  if (!root_.valid()) return;
  job_.actor().system().stop(std::exchange(root_, actors::actor_ref{}),
                             actors::exit_reason::shutdown("the job ended"));
}

}  // namespace moevement::recovery
