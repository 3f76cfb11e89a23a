// Stage types by name: the config's `engine.stage` selects one. The built-in "moe" is the MoE
// transformer (make_moe_stage); a program with custom stages builds a registry with its own
// types added and hands it to the launcher (examples/custom_stage); a custom type may bring its
// own stage actor class too (add_actor). No global registry: the worker processes are the same
// program, so they build the same one.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "actors/actor_ref.hpp"
#include "engine/hooks.hpp"
#include "engine/stage_model.hpp"

namespace moevement::actors {
class actor_system;
}

namespace moevement::engine {

class bulk_io;
class expert_router;

using stage_factory = std::function<std::unique_ptr<stage_model>(const stage_setup&)>;

// What a stage actor is built from (the worker's agent hands it to the stage type's spawner).
// A custom stage actor's constructor takes it and hands it on to engine::stage_actor's.
struct stage_actor_args {
  stage_setup setup;
  std::unique_ptr<stage_model> model;
  bulk_io* io = nullptr;  // the worker's, outlives the actor
  actors::actor_ref coordinator;
  std::unique_ptr<stage_hooks> hooks;  // null: policy none
  fault_hooks faults;                  // empty: no failure injection
  // Expert parallelism (parallel.ep > 1): the stage's router, shared with its router actor.
  std::shared_ptr<expert_router> experts;
};
// Spawns a stage type's stage actor and returns its ref; empty: engine::stage_actor itself.
using stage_spawner = std::function<actors::actor_ref(actors::actor_system&, stage_actor_args&&)>;

// What a stage type can do beyond the stage_model contract.
struct stage_traits {
  // Its stages hold experts that parallel.ep shards: stage_model::experts() gives the replica's
  // block, and set_expert_exchange() the all-to-all its MoE layers go through
  // (docs/custom-stages.md). Without it, parallel.ep > 1 is refused naming the key.
  bool expert_parallel = false;
};

class stage_registry {
 public:
  // With the built-in types ("moe").
  static stage_registry with_builtins();

  // Throws std::invalid_argument when the name is taken or not [a-z0-9_]+. spawner: how its
  // stage actor is made (empty: engine::stage_actor).
  void add(const std::string& name, stage_factory factory, stage_spawner spawner = {},
           stage_traits traits = {});
  // A stage type whose stage actor is a class of its own: A derives from engine::stage_actor
  // and is constructed from stage_actor_args, and may take messages of its own beside the
  // engine's protocol (docs/custom-stages.md). Include engine/stage_actor.hpp where it is
  // called.
  template <class A>
  void add_actor(const std::string& name, stage_factory factory, stage_traits traits = {}) {
    add(
        name, std::move(factory),
        [](auto& system, stage_actor_args&& args) {
          return system.template spawn<A>(std::move(args)).ref;
        },
        traits);
  }
  // Throws models::config_error("engine.stage") naming the registered types.
  const stage_factory& find(const std::string& name) const;
  const stage_spawner& spawner(const std::string& name) const;  // as find()
  const stage_traits& traits(const std::string& name) const;    // as find()
  // parallel.ep > 1 for a type without stage_traits::expert_parallel: models::config_error
  // naming parallel.ep.
  void check_expert_parallel(const std::string& name, int ep) const;
  std::vector<std::string> names() const;

 private:
  struct stage_type {
    stage_factory model;
    stage_spawner spawn;
    stage_traits traits;
  };
  const stage_type& type(const std::string& name) const;
  std::map<std::string, stage_type> types_;
};

}  // namespace moevement::engine
