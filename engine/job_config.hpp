// PROVISIONAL (replaced by the engine-config branch).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/result.hpp"
#include "engine/job_config.capnp.h"
#include "models/config.hpp"

namespace moevement::engine {

struct job_config {
  models::model_config model;
  models::train_config train;
  int pp = 1, dp = 1;
  std::string policy = "none";
  std::string backend = "local";
  int spares = 0;
  std::string host = "127.0.0.1";
  std::string stage_type = "moe";
  std::string run_log = "run.jsonl";
  std::int64_t heartbeat_ms = 100;
  std::int64_t failure_timeout_ms = 1000;
  std::int64_t start_timeout_ms = 30000;
  int workers() const { return pp * dp; }
};

job_config resolve_job(models::config_map map);
std::vector<std::string> job_config_keys();
void write_config(wire::JobConfig::Builder b, const models::config_map& map);
result<models::config_map> read_config(wire::JobConfig::Reader r);

}  // namespace moevement::engine
