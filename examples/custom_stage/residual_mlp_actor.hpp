// The residual-MLP stage type's own stage actor: the engine's stage_actor (the whole engine
// protocol, checkpointing and recovery unchanged) plus one message of its own, StatsQuery,
// answered with statistics of the stage's weights. Registered with
// stage_registry::add_actor<residual_mlp_actor>; main.cpp's head asks every stage for it as
// the job trains (launcher::head_extension).
#pragma once

#include "engine/stage_actor.hpp"
#include "examples/custom_stage/stats.capnp.h"

namespace custom_stage {

class residual_mlp_actor : public moevement::engine::stage_actor {
 public:
  using interface =
      moevement::actors::extended<moevement::engine::stage_actor::interface,
                                  moevement::actors::ask_t<wire::StatsQuery, wire::Stats>>;

  explicit residual_mlp_actor(moevement::engine::stage_actor_args args);

 private:
  asio::awaitable<void> stats(wire::StatsQuery::Reader, wire::Stats::Builder out);
};

}  // namespace custom_stage
