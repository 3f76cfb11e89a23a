#include "examples/custom_stage/residual_mlp_actor.hpp"

#include <cmath>

namespace custom_stage {

residual_mlp_actor::residual_mlp_actor(moevement::engine::stage_actor_args args)
    : stage_actor(std::move(args)) {
  on<wire::StatsQuery, wire::Stats>(&residual_mlp_actor::stats);
}

asio::awaitable<void> residual_mlp_actor::stats(wire::StatsQuery::Reader,
                                                wire::Stats::Builder out) {
  // The weights are the compute thread's: read them there, between the engine's own work.
  double sum = 0.0;
  std::uint64_t count = 0;
  co_await on_compute_thread([this, &sum, &count] {
    for (const auto* op : model().operators()) {
      for (const float w : op->master()) sum += double(w) * double(w);
      count += op->master().size();
    }
  });
  out.setStage(setup().stage);
  out.setReplica(setup().replica);
  out.setIteration(iteration());
  out.setParameters(count);
  out.setWeightRms(count > 0 ? std::sqrt(sum / double(count)) : 0.0);
}

}  // namespace custom_stage
