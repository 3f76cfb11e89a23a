#include "launcher/standby_agent.hpp"

#include <unistd.h>

#include "engine/worker_agent.hpp"

namespace moevement::launcher {

standby_agent::standby_agent(transport::ucx_link& link,
                             std::function<void(int, const std::string&)> on_end)
    : link_(link), on_end_(std::move(on_end)) {
  on<engine::wire::Assign>(&standby_agent::assign);
  on<engine::wire::Shutdown>(&standby_agent::shutdown);
}

void standby_agent::say_hello(actors::actor_ref coordinator, const std::string& host) {
  (void)tell<engine::wire::WorkerHello>(coordinator, [&](engine::wire::WorkerHello::Builder b) {
    b.setNode(system().node());
    b.setHost(host);
    b.setPort(link_.port());
    actors::write_ref(b.initAgent(), self());
    b.setPid(::getpid());
    b.setDomain(host);
    b.setStandby(true);
  });
}

actors::awaitable<void> standby_agent::assign(engine::wire::Assign::Reader m) {
  // Only from the coordinator it names, on the head (sender(): the node that proved the token).
  if (assigned_ || !sender().valid() || sender() != actors::read_ref(m.getCoordinator()) ||
      sender().node != system().head()) {
    co_return;
  }
  assigned_ = true;
  engine::add_assigned_peers(link_, system(), m.getPeers());
  const actors::actor_ref coordinator = actors::read_ref(m.getCoordinator());
  auto joined = co_await system().join(std::chrono::seconds(30));
  if (!joined.ok()) {
    if (on_end_) on_end_(1, "joining the cluster failed: " + joined.err().message);
    co_return;
  }
  // A member now, watching the head: the head starts training on this word.
  (void)tell<engine::wire::StandbyJoined>(
      coordinator, [&](engine::wire::StandbyJoined::Builder b) { b.setNode(system().node()); });
}

actors::awaitable<void> standby_agent::shutdown(engine::wire::Shutdown::Reader) {
  if (!sender().valid() || sender().node != system().head()) co_return;  // only the head's
  system().wind_down();
  if (on_end_) on_end_(0, "the job ended under its head");
  co_return;
}

}  // namespace moevement::launcher
