// The worker agent: the first actor of every worker process. It says hello to the coordinator
// (where this process listens), and on Assign learns every peer's address, joins the cluster,
// builds its stage (stage_registry) and spawns the stage actor, or idles as a spare. Shutdown
// ends the process cleanly.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "actors/system.hpp"
#include "engine/bulk_io.hpp"
#include "engine/engine.capnp.h"
#include "engine/stage_registry.hpp"
#include "transport/ucx_link.hpp"

namespace moevement::engine {

class worker_agent : public actors::actor {
 public:
  using interface = actors::interface<actors::tell_t<wire::Assign>, actors::tell_t<wire::Shutdown>>;

  // on_exit(status, message): the process should end (Shutdown: 0; a failure: 1).
  worker_agent(transport::ucx_link& link, const stage_registry& registry,
               std::function<void(int, const std::string&)> on_exit);

  // Tells the coordinator this worker is up (call once the agent has started).
  void say_hello(actors::actor_ref coordinator, const std::string& host);
  bool assigned() const { return assigned_; }

 private:
  asio::awaitable<void> assign(wire::Assign::Reader m);
  asio::awaitable<void> shutdown(wire::Shutdown::Reader m);

  transport::ucx_link& link_;
  const stage_registry& registry_;
  std::function<void(int, const std::string&)> on_exit_;
  std::unique_ptr<bulk_io> bulk_;
  bool assigned_ = false;
  actors::actor_ref stage_;
};

}  // namespace moevement::engine
