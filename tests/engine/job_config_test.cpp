#include "engine/job_config.hpp"

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <gtest/gtest.h>
#include <kj/exception.h>

#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <span>

#include "transport/envelope.hpp"

namespace moevement::engine {
namespace {

using models::config_error;
using models::config_map;

// The key a bad config is rejected with (and its message, for the checks that need it).
struct rejection {
  std::string key;
  std::string message;
};

rejection reject(const config_map& map) {
  try {
    (void)resolve_job(map);
  } catch (const config_error& e) {
    return {e.key(), e.what()};
  }
  ADD_FAILURE() << "accepted a bad config";
  return {};
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(job_config, defaults) {
  const job_config j = resolve_job({});
  EXPECT_EQ(j, job_config{});
  EXPECT_EQ(j.pp, 1);
  EXPECT_EQ(j.dp, 1);
  EXPECT_EQ(j.workers(), 1);
  EXPECT_EQ(j.policy, policy_kind::none);
  EXPECT_EQ(j.backend, "local");
  EXPECT_EQ(j.spares, 0);
  EXPECT_EQ(j.host, "127.0.0.1");
  EXPECT_EQ(j.stage_type, "moe");
  EXPECT_EQ(j.run_log, "run.jsonl");
  EXPECT_EQ(j.heartbeat_ms, 100);
  EXPECT_EQ(j.failure_timeout_ms, 1500);
  EXPECT_EQ(j.start_timeout_ms, 30000);
  EXPECT_EQ(j.iteration_timeout_ms, 600000);
  EXPECT_EQ(j.model, models::preset("tiny"));
  EXPECT_EQ(j.train, models::train_config{});
}

TEST(job_config, every_engine_key_overrides_its_default) {
  // key -> (a value other than the default, how to see it took effect)
  const std::map<std::string,
                 std::pair<models::config_value, std::function<bool(const job_config&)>>>
      cases{
          {"parallel.pp", {std::int64_t(2), [](auto& j) { return j.pp == 2; }}},
          {"parallel.dp", {std::int64_t(3), [](auto& j) { return j.dp == 3; }}},
          {"checkpoint.policy",
           {std::string("moevement"), [](auto& j) { return j.policy == policy_kind::moevement; }}},
          {"checkpoint.w_sparse", {std::int64_t(4), [](auto& j) { return j.w_sparse == 4; }}},
          {"checkpoint.max_overhead", {0.05, [](auto& j) { return j.max_overhead == 0.05; }}},
          {"checkpoint.durable_share", {0.2, [](auto& j) { return j.durable_share == 0.2; }}},
          {"checkpoint.window_rule",
           {std::string("ettr"), [](auto& j) { return j.window_by_ettr; }}},
          {"checkpoint.replicas",
           {std::int64_t(3), [](auto& j) { return j.snapshot_replicas == 3; }}},
          {"checkpoint.replay_threads",
           {std::int64_t(2), [](auto& j) { return j.replay_threads == 2; }}},
          {"checkpoint.region_restarts",
           {std::int64_t(0), [](auto& j) { return j.region_restarts == 0; }}},
          {"checkpoint.max_window_wait_ms",
           {std::int64_t(50), [](auto& j) { return j.max_window_wait_ms == 50; }}},
          {"checkpoint.log_fetch_bytes",
           {std::int64_t(65536), [](auto& j) { return j.log_fetch_bytes == 65536; }}},
          {"checkpoint.verify_every",
           {std::int64_t(3), [](auto& j) { return j.verify_every == 3; }}},
          // (> 0 needs policy moevement and a spare: shadow_replays_need_... below)
          {"checkpoint.shadow_every",
           {std::int64_t(0), [](auto& j) { return j.shadow_every == 0; }}},
          {"checkpoint.shadow_coverage",
           {std::string("full"), [](auto& j) { return j.shadow_full; }}},
          {"checkpoint.share_memory", {false, [](auto& j) { return !j.share_memory; }}},
          {"checkpoint.pipelined_replay", {false, [](auto& j) { return !j.pipelined_replay; }}},
          {"checkpoint.spread_replay", {false, [](auto& j) { return !j.spread_replay; }}},
          {"checkpoint.ordering",
           {std::string("soft-count"), [](auto& j) { return j.ordering == "soft-count"; }}},
          {"checkpoint.decay_alpha", {0.5, [](auto& j) { return j.decay_alpha == 0.5; }}},
          {"checkpoint.reorder_change", {0.2, [](auto& j) { return j.reorder_change == 0.2; }}},
          {"checkpoint.reorder_fraction", {0.5, [](auto& j) { return j.reorder_fraction == 0.5; }}},
          {"checkpoint.durable", {false, [](auto& j) { return j.durable == false; }}},
          {"checkpoint.interval",
           {std::int64_t(5), [](auto& j) { return j.baseline.interval == 5; }}},
          {"checkpoint.mtbf_s", {120.0, [](auto& j) { return j.baseline.mtbf_s == 120.0; }}},
          {"checkpoint.dir", {std::string("ck"), [](auto& j) { return j.baseline.dir == "ck"; }}},
          {"checkpoint.keep", {std::int64_t(4), [](auto& j) { return j.baseline.keep == 4; }}},
          {"checkpoint.pec_experts",
           {std::int64_t(2), [](auto& j) { return j.baseline.pec_experts == 2; }}},
          {"checkpoint.pec_order",
           {std::string("load-aware"),
            [](auto& j) { return j.baseline.pec_order == "load-aware"; }}},
          {"cluster.backend", {std::string("local"), [](auto& j) { return j.backend == "local"; }}},
          {"cluster.spares", {std::int64_t(2), [](auto& j) { return j.spares == 2; }}},
          // (true needs policy moevement: standby_head_needs_the_durable_tier below)
          {"cluster.standby_head", {false, [](auto& j) { return !j.standby_head; }}},
          {"cluster.host", {std::string("::1"), [](auto& j) { return j.host == "::1"; }}},
          {"cluster.heartbeat_ms",
           {std::int64_t(50), [](auto& j) { return j.heartbeat_ms == 50; }}},
          {"cluster.failure_timeout_ms",
           {std::int64_t(700), [](auto& j) { return j.failure_timeout_ms == 700; }}},
          {"cluster.start_timeout_ms",
           {std::int64_t(5000), [](auto& j) { return j.start_timeout_ms == 5000; }}},
          {"cluster.iteration_timeout_ms",
           {std::int64_t(0), [](auto& j) { return j.iteration_timeout_ms == 0; }}},
          {"cluster.slurm_partition",
           {std::string("gpu-a100"), [](auto& j) { return j.slurm_partition == "gpu-a100"; }}},
          {"cluster.slurm_nodes", {std::int64_t(1), [](auto& j) { return j.slurm_nodes == 1; }}},
          {"engine.stage",
           {std::string("my_stage"), [](auto& j) { return j.stage_type == "my_stage"; }}},
          {"engine.run_log",
           {std::string("out/log.jsonl"), [](auto& j) { return j.run_log == "out/log.jsonl"; }}},
          {"engine.abort_at", {std::int64_t(3), [](auto& j) { return j.abort_at == 3; }}},
          {"engine.head_exit_at", {std::int64_t(5), [](auto& j) { return j.head_exit_at == 5; }}},
          {"engine.durable_write_delay_ms",
           {std::int64_t(250), [](auto& j) { return j.durable_write_delay_ms == 250; }}},
          {"engine.durable_fail_from",
           {std::int64_t(3), [](auto& j) { return j.durable_fail_from == 3; }}},
      };
  std::set<std::string> covered;
  config_map all;
  for (const auto& [key, c] : cases) {
    covered.insert(key);
    all[key] = c.first;
    const job_config j = resolve_job({{key, c.first}});
    EXPECT_TRUE(c.second(j)) << key;
  }
  {  // parallel.ep needs a parallel.dp it divides, and policy none (below): not alone
    covered.insert("parallel.ep");
    const job_config j =
        resolve_job({{"parallel.dp", std::int64_t(4)}, {"parallel.ep", std::int64_t(2)}});
    EXPECT_EQ(j.ep, 2);
    EXPECT_EQ(j.train.expert_parallel, 2) << "train.expert_parallel must follow parallel.ep";
  }
  const auto keys = job_config_keys();
  EXPECT_EQ(covered, std::set<std::string>(keys.begin(), keys.end()))
      << "a key of job_config_keys() has no override case here";
  // All at once, with model.* and train.* beside them.
  all["model.preset"] = std::string("small");
  all["train.iterations"] = std::int64_t(7);
  const job_config j = resolve_job(all);
  for (const auto& [key, c] : cases) EXPECT_TRUE(c.second(j)) << key;
  EXPECT_EQ(j.model.preset, "small");
  EXPECT_EQ(j.train.iterations, 7);
  EXPECT_EQ(j.train.data_parallel, 3) << "train.data_parallel must follow parallel.dp";
  EXPECT_EQ(j.workers(), 6);
}

TEST(job_config, wrong_type_names_the_key) {
  for (const auto& key : job_config_keys()) {
    // The boolean keys: an integer is their wrong type.
    const bool boolean = key == "checkpoint.durable" || key == "checkpoint.share_memory" ||
                         key == "checkpoint.pipelined_replay" ||
                         key == "checkpoint.spread_replay" || key == "cluster.standby_head";
    const auto r = boolean ? reject({{key, std::int64_t(1)}}) : reject({{key, true}});
    EXPECT_EQ(r.key, key);
    EXPECT_TRUE(contains(r.message, "expected")) << r.message;
  }
  EXPECT_EQ(reject({{"parallel.pp", 2.5}}).key, "parallel.pp");
  EXPECT_EQ(reject({{"parallel.dp", std::string("2")}}).key, "parallel.dp");
  EXPECT_EQ(reject({{"checkpoint.policy", std::int64_t(1)}}).key, "checkpoint.policy");
}

// A standby head takes over from the durable tier's journal: policy moevement with the durable
// tier on (either backend), else the key is refused by name.
TEST(job_config, shadow_replays_need_policy_moevement_and_a_spare) {
  const config_map ok{{"checkpoint.policy", std::string("moevement")},
                      {"cluster.spares", std::int64_t(1)},
                      {"checkpoint.shadow_every", std::int64_t(5)}};
  EXPECT_EQ(resolve_job(ok).shadow_every, 5);
  EXPECT_EQ(reject({{"checkpoint.shadow_every", std::int64_t(5)}}).key, "checkpoint.shadow_every");
  EXPECT_EQ(reject({{"checkpoint.policy", std::string("moevement")},
                    {"checkpoint.shadow_every", std::int64_t(5)}})
                .key,
            "checkpoint.shadow_every")
      << "no spare";
  auto full = ok;
  full["checkpoint.shadow_coverage"] = std::string("full");
  EXPECT_TRUE(resolve_job(full).shadow_full);
  EXPECT_EQ(reject({{"checkpoint.shadow_coverage", std::string("all")}}).key,
            "checkpoint.shadow_coverage");
}

TEST(job_config, standby_head_needs_the_durable_tier) {
  const config_map ok{{"checkpoint.policy", std::string("moevement")},
                      {"cluster.standby_head", true}};
  EXPECT_TRUE(resolve_job(ok).standby_head);
  EXPECT_EQ(standby_node(resolve_job(ok)), 2u);  // after the one worker (pp = dp = 1)
  EXPECT_EQ(reject({{"cluster.standby_head", true}}).key, "cluster.standby_head");  // policy none
  config_map no_disk = ok;
  no_disk["checkpoint.durable"] = false;
  EXPECT_EQ(reject(no_disk).key, "cluster.standby_head");
  // Under Slurm the durable tier is on only with a checkpoint.dir every node sees.
  config_map slurm = ok;
  slurm["cluster.backend"] = std::string("slurm");
  EXPECT_EQ(reject(slurm).key, "cluster.standby_head");
  slurm["checkpoint.dir"] = std::string("/shared/ck");
  EXPECT_TRUE(resolve_job(slurm).standby_head);
}

TEST(job_config, expert_parallelism_needs_a_dp_and_an_expert_count_it_divides) {
  const auto ep = [](std::int64_t dp, std::int64_t ep) {
    return config_map{{"parallel.dp", dp}, {"parallel.ep", ep}};
  };
  EXPECT_EQ(resolve_job(ep(4, 4)).ep, 4);
  EXPECT_EQ(resolve_job(ep(4, 1)).ep, 1);
  const auto not_dp = reject(ep(4, 3));
  EXPECT_EQ(not_dp.key, "parallel.ep");
  EXPECT_TRUE(contains(not_dp.message, "parallel.dp")) << not_dp.message;
  auto more = ep(8, 8);  // tiny has 4 experts per layer
  EXPECT_EQ(reject(more).key, "parallel.ep");
  EXPECT_TRUE(contains(reject(more).message, "model.experts")) << reject(more).message;
  EXPECT_EQ(reject(ep(2, 0)).key, "parallel.ep");
  auto policy = ep(2, 2);
  policy["checkpoint.policy"] = std::string("moevement");
  EXPECT_EQ(resolve_job(policy).ep, 2);  // sparse checkpoints per EP rank
  policy["checkpoint.policy"] = std::string("dense-memory");
  EXPECT_EQ(resolve_job(policy).ep, 2);  // each worker's full snapshot of its own operators
  policy["checkpoint.policy"] = std::string("pec");
  EXPECT_EQ(resolve_job(policy).ep, 2);  // each rank saves the selected experts it holds
  policy["checkpoint.pec_order"] = std::string("load-aware");
  EXPECT_EQ(reject(policy).key, "checkpoint.pec_order");
  EXPECT_TRUE(contains(reject(policy).message, "sequential")) << reject(policy).message;
  auto gpu = ep(2, 2);
  gpu["train.device"] = std::string("cuda");
  EXPECT_EQ(reject(gpu).key, "parallel.ep");
  // A custom stage type may take it: whether it holds experts is its registration's
  // (stage_registry::check_expert_parallel, moe_stage_test).
  auto custom = ep(2, 2);
  custom["engine.stage"] = std::string("residual_moe");
  EXPECT_EQ(resolve_job(custom).ep, 2);
}

TEST(job_config, bad_values_name_the_key) {
  const std::vector<std::pair<std::string, models::config_value>> bad{
      {"parallel.pp", std::int64_t(0)},
      {"parallel.pp", std::int64_t(-3)},
      {"parallel.dp", std::int64_t(0)},
      {"parallel.dp", std::int64_t(1000)},
      {"cluster.spares", std::int64_t(-1)},
      {"cluster.backend", std::string("kubernetes")},
      {"cluster.host", std::string("")},
      {"cluster.host", std::string("bad host")},
      {"cluster.heartbeat_ms", std::int64_t(0)},
      {"cluster.failure_timeout_ms", std::int64_t(-5)},
      {"cluster.start_timeout_ms", std::int64_t(0)},
      {"cluster.iteration_timeout_ms", std::int64_t(-1)},
      {"cluster.iteration_timeout_ms", std::int64_t(1000)},  // under failure_timeout_ms
      {"engine.stage", std::string("Bad-Name")},
      {"engine.stage", std::string("")},
      {"engine.run_log", std::string("")},
      {"engine.abort_at", std::int64_t(-2)},
      {"engine.head_exit_at", std::int64_t(-2)},
      {"engine.durable_write_delay_ms", std::int64_t(-1)},
      {"engine.durable_fail_from", std::int64_t(-2)},
      {"engine.durable_write_delay_ms", std::int64_t(600001)},
      {"engine.abort_at", std::string("3")},
      {"checkpoint.region_restarts", std::int64_t(-1)},
      {"checkpoint.max_window_wait_ms", std::int64_t(-1)},
      {"checkpoint.verify_every", std::int64_t(-1)},
      {"checkpoint.log_fetch_bytes", std::int64_t(4095)},
      {"checkpoint.log_fetch_bytes", (std::int64_t(8) << 30) + 1},
      {"checkpoint.shadow_every", std::int64_t(-3)},
  };
  for (const auto& [key, value] : bad) EXPECT_EQ(reject({{key, value}}).key, key);
}

TEST(job_config, unknown_keys_are_rejected_by_name) {
  for (const std::string key :
       {"parallel.ppp", "cluster.spare", "engine.stages", "checkpoint.windw", "failure.rate",
        "iterations", "trian.iterations", "model.bogus", "train.bogus"}) {
    const auto r = reject({{key, std::int64_t(1)}});
    EXPECT_EQ(r.key, key);
    EXPECT_TRUE(contains(r.message, "unknown key")) << r.message;
  }
}

TEST(job_config, model_and_train_errors_pass_through) {
  EXPECT_EQ(reject({{"train.iterations", std::string("many")}}).key, "train.iterations");
  EXPECT_EQ(reject({{"model.preset", std::string("huge")}}).key, "model.preset");
  EXPECT_EQ(reject({{"model.top_k", std::int64_t(9)}}).key, "model.top_k");  // > experts
}

TEST(job_config, more_stages_than_layers_is_an_error_on_parallel_pp) {
  EXPECT_EQ(resolve_job({{"parallel.pp", std::int64_t(4)}}).pp, 4);  // tiny: 4 layers
  const auto r = reject({{"parallel.pp", std::int64_t(5)}});
  EXPECT_EQ(r.key, "parallel.pp");
  EXPECT_TRUE(contains(r.message, "4 layers")) << r.message;
  EXPECT_EQ(resolve_job({{"parallel.pp", std::int64_t(5)}, {"model.layers", std::int64_t(8)}}).pp,
            5);
  EXPECT_EQ(reject({{"parallel.pp", std::int64_t(9)}, {"model.preset", std::string("small")}}).key,
            "parallel.pp");
  // A custom stage type decides itself how it splits; only "moe" is checked here.
  EXPECT_EQ(
      resolve_job({{"parallel.pp", std::int64_t(5)}, {"engine.stage", std::string("mine")}}).pp, 5);
}

TEST(job_config, worker_count_is_bounded) {
  const job_config ok =
      resolve_job({{"parallel.pp", std::int64_t(4)}, {"parallel.dp", std::int64_t(64)}});
  EXPECT_EQ(ok.workers(), max_job_workers);
  EXPECT_EQ(reject({{"parallel.pp", std::int64_t(4)}, {"parallel.dp", std::int64_t(65)}}).key,
            "parallel.dp");
  EXPECT_EQ(reject({{"parallel.pp", std::int64_t(2)},
                    {"parallel.dp", std::int64_t(100)},
                    {"cluster.spares", std::int64_t(57)}})
                .key,
            "cluster.spares");
}

TEST(job_config, failure_timeout_must_cover_two_heartbeats) {
  EXPECT_EQ(reject({{"cluster.heartbeat_ms", std::int64_t(800)}}).key,
            "cluster.failure_timeout_ms");
  EXPECT_EQ(resolve_job({{"cluster.heartbeat_ms", std::int64_t(750)}}).heartbeat_ms, 750);
}

TEST(job_config, every_policy_is_available) {
  const auto names = checkpoint_policy_names();
  EXPECT_EQ(names,
            (std::vector<std::string>{"none", "moevement", "dense-memory", "dense-disk", "pec"}));
  for (const auto& name : names) {
    const policy_kind kind = resolve_job({{"checkpoint.policy", name}}).policy;
    EXPECT_EQ(policy_name(kind), name);
    EXPECT_EQ(recovery_of(kind) == recovery_kind::rollback, name != "none" && name != "moevement")
        << name;
    EXPECT_EQ(recovery_of(kind) == recovery_kind::localized, name == "moevement") << name;
  }
  const auto r = reject({{"checkpoint.policy", std::string("sparse")}});
  EXPECT_EQ(r.key, "checkpoint.policy");
  EXPECT_TRUE(contains(r.message, "none, moevement, dense-memory, dense-disk, pec")) << r.message;
}

TEST(job_config, baseline_knobs) {
  const job_config j = resolve_job({{"checkpoint.interval", std::int64_t(3)},
                                    {"checkpoint.mtbf_s", 60.0},
                                    {"checkpoint.dir", std::string("ck")},
                                    {"checkpoint.keep", std::int64_t(3)},
                                    {"checkpoint.pec_experts", std::int64_t(2)},
                                    {"checkpoint.pec_order", std::string("load-aware")}});
  EXPECT_EQ(j.baseline.interval, 3);
  EXPECT_EQ(j.baseline.mtbf_s, 60.0);
  EXPECT_EQ(j.baseline.dir, "ck");
  EXPECT_EQ(j.baseline.keep, 3);
  EXPECT_EQ(j.baseline.pec_experts, 2);
  EXPECT_EQ(j.baseline.pec_order, "load-aware");
  EXPECT_EQ(reject({{"checkpoint.keep", std::int64_t(1)}}).key, "checkpoint.keep");
  EXPECT_EQ(reject({{"checkpoint.interval", std::int64_t(-1)}}).key, "checkpoint.interval");
  EXPECT_EQ(reject({{"checkpoint.mtbf_s", 0.0}}).key, "checkpoint.mtbf_s");
  EXPECT_EQ(reject({{"checkpoint.max_overhead", 1.5}}).key, "checkpoint.max_overhead");
  EXPECT_EQ(reject({{"checkpoint.max_overhead", -0.01}}).key, "checkpoint.max_overhead");
  EXPECT_EQ(reject({{"checkpoint.durable_share", 2.0}}).key, "checkpoint.durable_share");
  EXPECT_EQ(reject({{"checkpoint.window_rule", std::string("fast")}}).key,
            "checkpoint.window_rule");
  EXPECT_EQ(reject({{"checkpoint.pec_order", std::string("random")}}).key, "checkpoint.pec_order");
  EXPECT_EQ(reject({{"checkpoint.dir", std::string("")}}).key, "checkpoint.dir");
}

TEST(job_config, slurm_backend_and_its_keys) {
  const job_config j = resolve_job({{"cluster.backend", std::string("slurm")},
                                    {"parallel.pp", std::int64_t(2)},
                                    {"cluster.spares", std::int64_t(1)},
                                    {"cluster.slurm_nodes", std::int64_t(3)},
                                    {"cluster.slurm_partition", std::string("debug")}});
  EXPECT_EQ(j.backend, "slurm");
  EXPECT_EQ(j.slurm_nodes, 3);
  EXPECT_EQ(j.slurm_partition, "debug");
  auto r = reject({{"cluster.slurm_partition", std::string("a b")}});
  EXPECT_EQ(r.key, "cluster.slurm_partition");
  EXPECT_TRUE(contains(r.message, "sinfo -s")) << r.message;
  r = reject({{"cluster.slurm_nodes", std::int64_t(2)}});  // 1 task: a node would be empty
  EXPECT_EQ(r.key, "cluster.slurm_nodes");
  EXPECT_TRUE(contains(r.message, "use at most 1")) << r.message;
}

// --- the wire form ---------------------------------------------------------------------------

std::vector<capnp::word> encode(const config_map& map) {
  capnp::MallocMessageBuilder message;
  write_config(message.initRoot<wire::JobConfig>(), map);
  const auto flat = capnp::messageToFlatArray(message);
  return {flat.begin(), flat.end()};
}

// Decodes untrusted words with limits, as a receiver would; never throws.
result<config_map> decode(const std::vector<capnp::word>& words,
                          const config_wire_limits& limits = {}) {
  capnp::ReaderOptions options;
  options.traversalLimitInWords = 1 << 20;
  options.nestingLimit = 16;
  try {
    capnp::FlatArrayMessageReader reader(
        kj::ArrayPtr<const capnp::word>(words.data(), words.size()), options);
    return read_config(reader.getRoot<wire::JobConfig>(), limits);
  } catch (const kj::Exception& e) {
    // Only the segment table and root pointer are read outside read_config.
    return error{e.getDescription().cStr()};
  }
}

config_map sample_map() {
  return {
      {"model.preset", std::string("small")},
      {"train.iterations", std::int64_t(20)},
      {"train.seed", std::numeric_limits<std::int64_t>::max()},
      {"train.offset", std::numeric_limits<std::int64_t>::min()},
      {"train.lr", 1e-3},
      {"train.tiny", 4.9e-324},
      {"train.negative", -0.0},
      {"parallel.pp", std::int64_t(2)},
      {"cluster.some_flag", true},
      {"cluster.other-flag", false},
      {"engine.run_log", std::string("runs/ü日本.jsonl")},
      {"engine.empty", std::string("")},
  };
}

TEST(job_config_wire, round_trip_is_exact) {
  for (const config_map& map : {sample_map(), config_map{}}) {
    const auto got = decode(encode(map));
    ASSERT_TRUE(got.ok()) << got.err().message;
    EXPECT_EQ(*got, map);
  }
  // And the resolved job is the same on both sides.
  const config_map job{{"parallel.pp", std::int64_t(2)},
                       {"parallel.dp", std::int64_t(2)},
                       {"model.preset", std::string("small")}};
  EXPECT_EQ(resolve_job(decode(encode(job)).value()), resolve_job(job));
}

TEST(job_config_wire, round_trip_inside_an_envelope) {
  transport::outgoing_envelope out({{1, 1, 1}, {2, 1, 0}, 0, 1, 0});
  write_config(out.init_payload<wire::JobConfig>(), sample_map());
  const auto words = out.to_words();
  auto in =
      transport::incoming_envelope::decode(std::as_bytes(std::span(words.begin(), words.size())));
  ASSERT_TRUE(in.ok()) << in.err().message;
  auto payload = in->payload<wire::JobConfig>();
  ASSERT_TRUE(payload.ok()) << payload.err().message;
  const auto got = read_config(*payload);
  ASSERT_TRUE(got.ok()) << got.err().message;
  EXPECT_EQ(*got, sample_map());
}

bool rejected_with(const result<config_map>& r, const std::string& part) {
  if (r.ok()) {
    ADD_FAILURE() << "accepted a malformed config";
    return false;
  }
  EXPECT_TRUE(contains(r.err().message, part)) << r.err().message;
  return true;
}

TEST(job_config_wire, key_length_is_limited) {
  const std::string ok = "a." + std::string(126, 'x');  // 128 bytes
  EXPECT_TRUE(decode(encode({{ok, true}})).ok());
  EXPECT_TRUE(rejected_with(decode(encode({{ok + "x", true}})), "exceeds 128 bytes"));
}

TEST(job_config_wire, entry_count_is_limited) {
  config_map map;
  for (int i = 0; i < 1024; ++i) map["k.n" + std::to_string(i)] = std::int64_t(i);
  EXPECT_TRUE(decode(encode(map)).ok());
  map["k.last"] = true;
  EXPECT_TRUE(rejected_with(decode(encode(map)), "at most 1024"));
  config_wire_limits small;
  small.max_entries = 3;
  EXPECT_TRUE(rejected_with(decode(encode(sample_map()), small), "at most 3"));
}

TEST(job_config_wire, text_length_is_limited) {
  EXPECT_TRUE(decode(encode({{"a.b", std::string(4096, 'x')}})).ok());
  EXPECT_TRUE(rejected_with(decode(encode({{"a.b", std::string(4097, 'x')}})), "4097 bytes"));
  EXPECT_TRUE(rejected_with(decode(encode({{"a.b", std::string("x\0y", 3)}})), "NUL"));
}

TEST(job_config_wire, keys_must_be_dotted_lower_case_names) {
  for (const std::string& key : std::vector<std::string>{
           "", "nodot", "Model.preset", "model..preset", ".model", "model.", "a b.c", "a.b/c",
           "a.b=c", "model.pre\nset", std::string("a.b\0c", 5), "a.\xc3\xbc"}) {
    EXPECT_TRUE(rejected_with(decode(encode({{key, true}})), "not a dotted name")) << key;
  }
  for (const std::string key : {"a.b", "model.preset", "x-1.y_2.z3"}) {
    EXPECT_TRUE(decode(encode({{key, true}})).ok()) << key;
  }
}

TEST(job_config_wire, duplicate_keys_are_rejected) {
  capnp::MallocMessageBuilder message;
  auto entries = message.initRoot<wire::JobConfig>().initEntries(3);
  entries[0].setKey("parallel.pp");
  entries[0].initValue().setInteger(2);
  entries[1].setKey("parallel.dp");
  entries[1].initValue().setInteger(2);
  entries[2].setKey("parallel.pp");
  entries[2].initValue().setInteger(4);
  const auto flat = capnp::messageToFlatArray(message);
  EXPECT_TRUE(rejected_with(decode({flat.begin(), flat.end()}), "parallel.pp appears twice"));
}

TEST(job_config_wire, unknown_value_kind_is_rejected) {
  // A value union tag from a newer schema (or a flipped bit): ConfigEntry's data section is
  // word 0 (bool in bit 0, union tag in bits 16..31) and word 1 (integer or real).
  constexpr std::uint64_t marker = 0x1234'5678'9abc'def0ull;
  auto words = encode({{"a.b", std::int64_t(marker)}});
  bool patched = false;
  for (std::size_t i = 1; i < words.size(); ++i) {
    std::uint64_t w = 0;
    std::memcpy(&w, &words[i], 8);
    if (w != marker) continue;
    std::uint64_t tag_word = 0;
    std::memcpy(&tag_word, &words[i - 1], 8);
    ASSERT_EQ((tag_word >> 16) & 0xffff, 1u) << "tag of integer";
    tag_word |= std::uint64_t(7) << 16;
    std::memcpy(static_cast<void*>(&words[i - 1]), &tag_word, 8);
    patched = true;
  }
  ASSERT_TRUE(patched);
  EXPECT_TRUE(rejected_with(decode(words), "unknown value kind 7"));
}

TEST(job_config_wire, random_and_mutated_inputs_never_crash) {
  std::mt19937_64 rng(2026);
  const auto good = encode(sample_map());
  int accepted = 0;
  for (int round = 0; round < 20000; ++round) {
    std::vector<capnp::word> w;
    if (round % 2 == 0) {  // pure noise
      w.resize(1 + rng() % 48);
      for (auto& x : w) {
        const std::uint64_t r = rng();
        std::memcpy(static_cast<void*>(&x), &r, 8);
      }
    } else {  // a valid message with a few bits flipped
      w = good;
      auto* b = reinterpret_cast<unsigned char*>(w.data());
      const std::size_t len = w.size() * sizeof(capnp::word);
      const int flips = 1 + int(rng() % 4);
      for (int f = 0; f < flips; ++f)
        b[rng() % len] ^= static_cast<unsigned char>(1u << (rng() % 8));
    }
    result<config_map> r = error{""};
    ASSERT_NO_THROW(r = decode(w));
    if (!r.ok()) {
      EXPECT_FALSE(r.err().message.empty());
      continue;
    }
    ++accepted;
    // Whatever is accepted obeys the limits.
    EXPECT_LE(r->size(), 1024u);
    for (const auto& [key, value] : *r) {
      EXPECT_LE(key.size(), 128u);
      EXPECT_NE(key.find('.'), std::string::npos);
      if (const auto* s = std::get_if<std::string>(&value)) {
        EXPECT_LE(s->size(), 4096u);
      }
    }
  }
  EXPECT_GT(accepted, 0) << "no flip left a valid message: the corpus tests nothing";
}

TEST(job_config_wire, mutated_envelopes_never_crash) {
  transport::outgoing_envelope out({{1, 1, 1}, {2, 1, 0}, 0, 1, 0});
  write_config(out.init_payload<wire::JobConfig>(), sample_map());
  const auto flat = out.to_words();
  const std::vector<capnp::word> good(flat.begin(), flat.end());
  std::mt19937_64 rng(7);
  int read = 0;
  for (int round = 0; round < 5000; ++round) {
    auto w = good;
    auto* b = reinterpret_cast<unsigned char*>(w.data());
    const std::size_t len = w.size() * sizeof(capnp::word);
    for (int f = 0; f < 3; ++f) b[rng() % len] ^= static_cast<unsigned char>(1 + rng() % 255);
    auto in = transport::incoming_envelope::decode(std::as_bytes(std::span(w)));
    if (!in.ok()) continue;
    auto p = in->payload<wire::JobConfig>();
    if (!p.ok()) continue;
    ++read;
    ASSERT_NO_THROW((void)read_config(*p));
  }
  EXPECT_GT(read, 0) << "no mutation reached read_config: the corpus tests nothing";
}

TEST(job_config, the_durable_tier_is_on_for_dense_disk_and_local_moevement_by_default) {
  for (const std::string policy : {"none", "dense-memory", "pec"}) {
    EXPECT_FALSE(durable_tier(resolve_job({{"checkpoint.policy", policy}}))) << policy;
  }
  const models::config_value moe = std::string("moevement");
  EXPECT_TRUE(durable_tier(resolve_job({{"checkpoint.policy", moe}}))) << "the local backend";
  const models::config_value slurm = std::string("slurm");
  // Under Slurm only with a checkpoint.dir given (the default one is each node's own disk).
  EXPECT_FALSE(durable_tier(resolve_job({{"checkpoint.policy", moe}, {"cluster.backend", slurm}})));
  EXPECT_TRUE(durable_tier(resolve_job({{"checkpoint.policy", moe},
                                        {"cluster.backend", slurm},
                                        {"checkpoint.dir", std::string("/shared/ckpt")}})));
  // Its default directory is beside the run log, named after it.
  EXPECT_EQ(resolve_job({}).baseline.dir, "run.checkpoints");
  EXPECT_EQ(resolve_job({{"engine.run_log", std::string("logs/a.jsonl")}}).baseline.dir,
            "logs/a.checkpoints");
  EXPECT_EQ(resolve_job({{"engine.run_log", std::string("logs/a.jsonl")},
                         {"checkpoint.dir", std::string("elsewhere")}})
                .baseline.dir,
            "elsewhere");
  EXPECT_TRUE(durable_tier(resolve_job({{"checkpoint.policy", std::string("dense-disk")}})));
  EXPECT_TRUE(durable_tier(resolve_job(
      {{"checkpoint.policy", std::string("moevement")}, {"checkpoint.durable", true}})));
  EXPECT_TRUE(durable_tier(resolve_job({{"checkpoint.policy", std::string("moevement")},
                                        {"checkpoint.durable", std::string("auto")}})));
  EXPECT_FALSE(durable_tier(resolve_job(
      {{"checkpoint.policy", std::string("moevement")}, {"checkpoint.durable", false}})));
  EXPECT_EQ(reject({{"checkpoint.policy", std::string("pec")}, {"checkpoint.durable", true}}).key,
            "checkpoint.durable");
  EXPECT_EQ(
      reject({{"checkpoint.policy", std::string("dense-disk")}, {"checkpoint.durable", false}}).key,
      "checkpoint.durable");
}

TEST(job_config, the_head_checks_that_the_workers_will_take_the_config) {
  // What the head sends, read back under the workers' limits: every key's own checks aside,
  // a text too long for the wire is found at the head, naming the key.
  config_map ok{{"model.preset", std::string("tiny")}, {"parallel.pp", std::int64_t(2)}};
  EXPECT_TRUE(fits_the_wire(ok).ok());
  config_map long_text{{"model.preset", std::string(5000, 'x')}};
  const auto r = fits_the_wire(long_text);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.err().message, "model.preset: text of 5000 bytes exceeds 4096"))
      << r.err().message;
  config_map many;
  for (int i = 0; i < 1100; ++i) many["k.k" + std::to_string(i)] = std::int64_t(i);
  EXPECT_FALSE(fits_the_wire(many).ok());
}

TEST(job_config, a_replay_takes_its_share_of_the_host) {
  EXPECT_EQ(replay_threads_for(3, 4, 16), 3);   // set: as set
  EXPECT_EQ(replay_threads_for(0, 1, 16), 16);  // alone: every core
  EXPECT_EQ(replay_threads_for(0, 4, 16), 4);   // four at once: a quarter each
  EXPECT_EQ(replay_threads_for(0, 3, 2), 1);    // more replays than cores: one each
  EXPECT_EQ(replay_threads_for(0, 0, 8), 8);    // an older head sends no share
  EXPECT_EQ(replay_threads_for(0, 2, 0), 1);    // unknown cores
}

}  // namespace
}  // namespace moevement::engine
