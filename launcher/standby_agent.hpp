// The standby head's one actor before it takes over (cluster.standby_head): it says hello to
// the coordinator like a worker, learns every peer's address from its Assign and joins the
// cluster, so that every member heartbeats it and it sees the head go. A Shutdown (the job
// ended under its head) ends the standby.
#pragma once

#include <functional>
#include <string>

#include "actors/system.hpp"
#include "engine/engine.capnp.h"
#include "transport/ucx_link.hpp"

namespace moevement::launcher {

class standby_agent : public actors::actor {
 public:
  using interface = actors::interface<actors::tell_t<engine::wire::Assign>,
                                      actors::tell_t<engine::wire::Shutdown>>;

  // on_end(status, message): the standby should end (a Shutdown: 0; no cluster to join: 1).
  standby_agent(transport::ucx_link& link, std::function<void(int, const std::string&)> on_end);

  void say_hello(actors::actor_ref coordinator, const std::string& host);

 private:
  actors::awaitable<void> assign(engine::wire::Assign::Reader m);
  actors::awaitable<void> shutdown(engine::wire::Shutdown::Reader m);

  transport::ucx_link& link_;
  std::function<void(int, const std::string&)> on_end_;
  bool assigned_ = false;
};

}  // namespace moevement::launcher
