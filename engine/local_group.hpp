// Every replica of one stage in this process (engine::local_pipeline; a recovery's replay of a
// whole group, recovery/sparse_to_dense.hpp): under expert parallelism their EP groups of `ep`
// consecutive replicas compute each other's expert rows directly (models::direct_exchange),
// and the all-reduce that training does across processes, in replica order.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "engine/stage_model.hpp"
#include "models/expert_shard.hpp"

namespace moevement::engine {

class local_group {
 public:
  // replicas: every replica of the stage, in replica order; ep divides their count. With
  // ep > 1 each replica's expert exchange is set to its EP group's shards (the destructor puts
  // back the exchange each had before). Throws models::config_error naming parallel.ep when a
  // replica has no experts to shard, or ep does not divide the replicas.
  local_group(std::span<stage_model* const> replicas, int ep);
  ~local_group();
  local_group(const local_group&) = delete;
  local_group& operator=(const local_group&) = delete;

  // The all-reduce: every replica's gradients become g_0 + g_1 + ... in replica order. Under
  // expert parallelism the non-experts so, and each block of experts over every replica's
  // rows (kept apart per source by the shard that computed them), in replica order too.
  void all_reduce();

 private:
  void reduce_experts();

  std::vector<stage_model*> replicas_;
  int ep_;
  // [replica]: what the first fold sums (every operator; under EP the non-experts)
  std::vector<std::vector<models::operator_state*>> dense_ops_;
  std::vector<std::unique_ptr<models::direct_exchange>> exchanges_;  // [replica], EP only
  std::vector<models::expert_exchange*> before_;                     // [replica], EP only
  std::vector<float> acc_, tmp_;
};

}  // namespace moevement::engine
