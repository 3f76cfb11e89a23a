#include "engine/job_config.hpp"

#include <capnp/message.h>
#include <fmt/format.h>
#include <kj/exception.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <string_view>

namespace moevement::engine {

namespace {

using models::config_error;
using models::config_value;

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

std::string get_choice(const std::string& key, const config_value& v,
                       const std::vector<std::string>& choices) {
  std::string s = models::config_string(key, v);
  if (std::find(choices.begin(), choices.end(), s) == choices.end()) {
    throw config_error(key,
                       fmt::format("unknown value '{}' (choose one of: {})", s, join(choices)));
  }
  return s;
}

// A name of checkpoint_policy_names() (checked by get_choice) as its kind: the names are in
// the enum's order.
policy_kind parse_policy(const std::string& name) {
  const auto names = checkpoint_policy_names();
  return policy_kind(std::find(names.begin(), names.end(), name) - names.begin());
}

bool all_of_chars(std::string_view s, std::string_view allowed) {
  return s.find_first_not_of(allowed) == std::string_view::npos;
}

constexpr std::string_view lower_digits_underscore = "abcdefghijklmnopqrstuvwxyz0123456789_";
constexpr std::int64_t hour_ms = 3'600'000;

const std::vector<std::string>& backend_names() {
  static const std::vector<std::string> names{"local", "slurm"};
  return names;
}

using setter = std::function<void(const std::string&, const config_value&)>;
using setter_map = std::map<std::string, setter, std::less<>>;

// The checkpoint.* keys.
setter_map checkpoint_setters(job_config& j) {
  return {
      {"checkpoint.policy",
       [&](auto& k, auto& v) {
         const std::string name = get_choice(k, v, checkpoint_policy_names());
         if (!policy_available(name)) {
           throw config_error(k, fmt::format("'{}' is not available in this version", name));
         }
         j.policy = parse_policy(name);
       }},
      {"checkpoint.w_sparse",
       [&](auto& k, auto& v) { j.w_sparse = int(models::config_int(k, v, 0, 1 << 20)); }},
      {"checkpoint.max_overhead",
       [&](auto& k, auto& v) { j.max_overhead = models::config_double(k, v, 0.0, 1.0); }},
      {"checkpoint.durable_share",
       [&](auto& k, auto& v) { j.durable_share = models::config_double(k, v, 0.0, 1.0); }},
      {"checkpoint.window_rule",
       [&](auto& k, auto& v) {
         const std::string rule = models::config_string(k, v);
         if (rule != "overhead" && rule != "ettr") {
           throw config_error(k, "'" + rule + "': expected \"overhead\" or \"ettr\"");
         }
         j.window_by_ettr = rule == "ettr";
       }},
      {"checkpoint.replicas",
       [&](auto& k, auto& v) {
         j.snapshot_replicas = int(models::config_int(k, v, 1, max_job_workers));
       }},
      {"checkpoint.region_restarts",
       [&](auto& k, auto& v) { j.region_restarts = int(models::config_int(k, v, 0, 1000)); }},
      {"checkpoint.max_window_wait_ms",
       [&](auto& k, auto& v) {
         j.max_window_wait_ms = int(models::config_int(k, v, 0, 3600 * 1000));
       }},
      {"checkpoint.log_fetch_bytes",
       [&](auto& k, auto& v) {
         j.log_fetch_bytes = std::uint64_t(models::config_int(k, v, 4096, std::int64_t(8) << 30));
       }},
      {"checkpoint.verify_every",
       [&](auto& k, auto& v) { j.verify_every = int(models::config_int(k, v, 0, 1 << 20)); }},
      {"checkpoint.shadow_every",
       [&](auto& k, auto& v) { j.shadow_every = int(models::config_int(k, v, 0, 1 << 20)); }},
      {"checkpoint.shadow_coverage",
       [&](auto& k, auto& v) {
         j.shadow_full = get_choice(k, v, {"recent", "full"}) == "full";
       }},
      {"checkpoint.replay_threads",
       [&](auto& k, auto& v) { j.replay_threads = int(models::config_int(k, v, 0, 1024)); }},
      {"checkpoint.share_memory",
       [&](auto& k, auto& v) {
         const auto* b = std::get_if<bool>(&v);
         if (b == nullptr) throw config_error(k, "expected true or false");
         j.share_memory = *b;
       }},
      {"checkpoint.pipelined_replay",
       [&](auto& k, auto& v) {
         const auto* b = std::get_if<bool>(&v);
         if (b == nullptr) throw config_error(k, "expected true or false");
         j.pipelined_replay = *b;
       }},
      {"checkpoint.spread_replay",
       [&](auto& k, auto& v) {
         const auto* b = std::get_if<bool>(&v);
         if (b == nullptr) throw config_error(k, "expected true or false");
         j.spread_replay = *b;
       }},
      {"checkpoint.ordering",
       [&](auto& k, auto& v) { j.ordering = get_choice(k, v, ordering_names()); }},
      {"checkpoint.decay_alpha",
       [&](auto& k, auto& v) { j.decay_alpha = models::config_double(k, v, 0.0, 0.999); }},
      {"checkpoint.reorder_change",
       [&](auto& k, auto& v) { j.reorder_change = models::config_double(k, v, 0.0, 100.0); }},
      {"checkpoint.reorder_fraction",
       [&](auto& k, auto& v) { j.reorder_fraction = models::config_double(k, v, 0.0, 1.0); }},
      {"checkpoint.durable",
       [&](auto& k, auto& v) {
         if (const auto* b = std::get_if<bool>(&v)) {
           j.durable = *b;
         } else if (std::holds_alternative<std::string>(v) && std::get<std::string>(v) == "auto") {
           j.durable.reset();
         } else {
           throw config_error(k, fmt::format("expected true, false or \"auto\" (on for "
                                             "dense-disk, and for moevement on the local "
                                             "backend or with checkpoint.dir set), got {}",
                                             models::config_type_name(v)));
         }
       }},
      {"checkpoint.interval",
       [&](auto& k, auto& v) { j.baseline.interval = int(models::config_int(k, v, 0, 1 << 30)); }},
      {"checkpoint.mtbf_s",
       [&](auto& k, auto& v) { j.baseline.mtbf_s = models::config_double(k, v, 1e-3, 1e12); }},
      {"checkpoint.dir",
       [&](auto& k, auto& v) {
         std::string p = models::config_string(k, v);
         if (p.empty() || p.size() > 4096 || p.find('\0') != std::string::npos) {
           throw config_error(k, "expected a directory path (non-empty, at most 4096 bytes)");
         }
         j.baseline.dir = std::move(p);
       }},
      {"checkpoint.keep",
       [&](auto& k, auto& v) { j.baseline.keep = int(models::config_int(k, v, 2, 1 << 20)); }},
      {"checkpoint.pec_experts",
       [&](auto& k, auto& v) {
         j.baseline.pec_experts = int(models::config_int(k, v, 1, 1 << 20));
       }},
      {"checkpoint.pec_order",
       [&](auto& k, auto& v) {
         j.baseline.pec_order = get_choice(k, v, {"sequential", "load-aware"});
       }},
  };
}

// The cluster.* keys.
setter_map cluster_setters(job_config& j) {
  return {
      {"cluster.backend", [&](auto& k, auto& v) { j.backend = get_choice(k, v, backend_names()); }},
      {"cluster.standby_head",
       [&](auto& k, auto& v) {
         const auto* b = std::get_if<bool>(&v);
         if (b == nullptr) throw config_error(k, "expected true or false");
         j.standby_head = *b;
       }},
      {"cluster.spares",
       [&](auto& k, auto& v) { j.spares = int(models::config_int(k, v, 0, max_job_workers)); }},
      {"cluster.host",
       [&](auto& k, auto& v) {
         std::string h = models::config_string(k, v);
         if (h.empty() || h.size() > 253 ||
             !all_of_chars(h,
                           "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.:-_")) {
           throw config_error(k, fmt::format("'{}' is not a host name or IP address (letters, "
                                             "digits, '.', ':', '-', '_'; e.g. 127.0.0.1)",
                                             h));
         }
         j.host = std::move(h);
       }},
      {"cluster.heartbeat_ms",
       [&](auto& k, auto& v) { j.heartbeat_ms = models::config_int(k, v, 1, max_heartbeat_ms); }},
      {"cluster.failure_timeout_ms",
       [&](auto& k, auto& v) {
         j.failure_timeout_ms = models::config_int(k, v, 1, max_failure_timeout_ms);
       }},
      {"cluster.start_timeout_ms",
       [&](auto& k, auto& v) { j.start_timeout_ms = models::config_int(k, v, 1, 24 * hour_ms); }},
      {"cluster.iteration_timeout_ms",
       [&](auto& k, auto& v) {
         j.iteration_timeout_ms = models::config_int(k, v, 0, 24 * hour_ms);
       }},
      {"cluster.slurm_partition",
       [&](auto& k, auto& v) {
         std::string p = models::config_string(k, v);
         if (p.size() > 64 || !all_of_chars(p,
                                            "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                            "0123456789._-")) {
           throw config_error(k, fmt::format("'{}' is not a Slurm partition name (letters, "
                                             "digits, '.', '_', '-'; `sinfo -s` lists them)",
                                             p));
         }
         j.slurm_partition = std::move(p);
       }},
      {"cluster.slurm_nodes",
       [&](auto& k, auto& v) {
         j.slurm_nodes = int(models::config_int(k, v, 0, max_job_workers));
       }},
  };
}

// Every engine key with how it is parsed and validated on its own: the one list of keys.
setter_map make_setters(job_config& j) {
  setter_map m{
      {"parallel.pp",
       [&](auto& k, auto& v) { j.pp = int(models::config_int(k, v, 1, max_job_workers)); }},
      {"parallel.dp",
       [&](auto& k, auto& v) { j.dp = int(models::config_int(k, v, 1, max_job_workers)); }},
      {"parallel.ep",
       [&](auto& k, auto& v) { j.ep = int(models::config_int(k, v, 1, max_job_workers)); }},
      {"engine.stage",
       [&](auto& k, auto& v) {
         std::string s = models::config_string(k, v);
         if (s.empty() || s.size() > 64 || !all_of_chars(s, lower_digits_underscore)) {
           throw config_error(k, fmt::format("'{}' is not a stage type name (lower-case letters, "
                                             "digits and _; the built-in type is moe)",
                                             s));
         }
         j.stage_type = std::move(s);
       }},
      {"engine.run_log",
       [&](auto& k, auto& v) {
         std::string p = models::config_string(k, v);
         if (p.empty() || p.size() > 4096 || p.find('\0') != std::string::npos) {
           throw config_error(k, "expected a file path (non-empty, at most 4096 bytes)");
         }
         j.run_log = std::move(p);
       }},
      {"engine.abort_at",
       [&](auto& k, auto& v) { j.abort_at = models::config_int(k, v, -1, std::int64_t(1) << 40); }},
      {"engine.head_exit_at",
       [&](auto& k, auto& v) {
         j.head_exit_at = models::config_int(k, v, -1, std::int64_t(1) << 40);
       }},
      {"engine.durable_fail_from",
       [&](auto& k, auto& v) {
         j.durable_fail_from = models::config_int(k, v, -1, std::int64_t{1} << 40);
       }},
      {"engine.durable_write_delay_ms",
       [&](auto& k, auto& v) { j.durable_write_delay_ms = models::config_int(k, v, 0, 600000); }},

  };
  m.merge(checkpoint_setters(j));
  m.merge(cluster_setters(j));
  return m;
}

bool is_engine_key(std::string_view key) {
  for (const std::string_view s : {"parallel.", "checkpoint.", "cluster.", "engine."}) {
    if (key.starts_with(s)) return true;
  }
  return false;
}

}  // namespace

std::vector<std::string> ordering_names() {
  return {"popularity", "soft-count", "time-decayed", "capacity-aware"};
}

std::vector<std::string> checkpoint_policy_names() {
  return {"none", "moevement", "dense-memory", "dense-disk", "pec"};
}

bool policy_available(const std::string& name) {
  const auto names = checkpoint_policy_names();
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::string policy_name(policy_kind policy) {
  return checkpoint_policy_names().at(std::size_t(policy));
}

recovery_kind recovery_of(policy_kind policy) {
  switch (policy) {
    case policy_kind::none:
      return recovery_kind::none;
    case policy_kind::moevement:
      return recovery_kind::localized;
    case policy_kind::dense_memory:
    case policy_kind::dense_disk:
    case policy_kind::pec:
      return recovery_kind::rollback;
  }
  return recovery_kind::none;
}

int replay_threads_for(int configured, int host_share, int cores) {
  if (configured > 0) return configured;
  return std::max(1, std::max(1, cores) / std::max(1, host_share));
}

bool durable_tier(const job_config& job) {
  // Under Slurm the default directory would be each node's own disk: on only where it was set.
  const bool dir_given = job.baseline.dir != checkpoint_dir_beside(job.run_log);
  const bool moevement_default =
      job.policy == policy_kind::moevement && (job.backend == "local" || dir_given);
  return job.durable.value_or(job.policy == policy_kind::dense_disk || moevement_default);
}

std::string checkpoint_dir_beside(const std::string& run_log) {
  std::filesystem::path p(run_log);
  p.replace_extension(".checkpoints");
  return p.string();
}

std::vector<std::string> job_config_keys() {
  job_config j;
  std::vector<std::string> keys;
  for (const auto& [key, set] : make_setters(j)) keys.push_back(key);
  return keys;
}

job_config resolve_job(models::config_map map) {
  job_config j;
  const bool dir_given = map.contains("checkpoint.dir");
  models::apply_config(map, j.model, j.train);  // consumes model.* and train.*
  const setter_map setters = make_setters(j);
  for (const auto& [key, value] : map) {
    const auto s = setters.find(key);
    if (s == setters.end()) {
      throw config_error(key, is_engine_key(key)
                                  ? "unknown key (the engine's parallel.*, checkpoint.*, "
                                    "cluster.* and engine.* keys are in docs/configuration.md)"
                                  : "unknown key (sections: model, train, parallel, checkpoint, "
                                    "cluster, engine; see docs/configuration.md)");
    }
    s->second(key, value);
  }
  j.train.data_parallel = j.dp;
  j.train.expert_parallel = j.ep;
  if (!dir_given) j.baseline.dir = checkpoint_dir_beside(j.run_log);

  // Cross-checks, after every key is read so that the order of keys does not matter.
  models::validate(j.model, j.train);
  if (j.stage_type == "moe" && j.pp > j.model.layers) {
    throw config_error("parallel.pp",
                       fmt::format("{} pipeline stages but the model has {} layers (model.layers); "
                                   "use at most {} stages",
                                   j.pp, j.model.layers, j.model.layers));
  }
  if (j.ep > 1 && j.train.device != models::device::cpu) {
    throw config_error("parallel.ep",
                       "expert parallelism trains on train.device = \"cpu\" only "
                       "so far; set parallel.ep = 1 on GPUs");
  }
  if (j.ep > 1 && j.policy == policy_kind::pec && j.baseline.pec_order == "load-aware") {
    throw config_error("checkpoint.pec_order",
                       "load-aware ranks every expert of a layer by the tokens routed to it, which "
                       "an expert-parallel worker does not count: use \"sequential\" (the "
                       "default) with parallel.ep > 1");
  }
  if (j.workers() > max_job_workers) {
    throw config_error("parallel.dp",
                       fmt::format("parallel.pp x parallel.dp = {} x {} = {} workers; at most {}",
                                   j.pp, j.dp, j.workers(), max_job_workers));
  }
  if (j.workers() + j.spares > max_job_workers) {
    throw config_error(
        "cluster.spares",
        fmt::format("{} workers + {} spares exceed {} processes; use at most {} "
                    "spares",
                    j.workers(), j.spares, max_job_workers, max_job_workers - j.workers()));
  }
  if (j.failure_timeout_ms < 2 * j.heartbeat_ms) {
    throw config_error("cluster.failure_timeout_ms",
                       fmt::format("{} ms is less than two heartbeats (cluster.heartbeat_ms = {}); "
                                   "a late heartbeat would look like a failure",
                                   j.failure_timeout_ms, j.heartbeat_ms));
  }
  if (j.iteration_timeout_ms != 0 && j.iteration_timeout_ms < j.failure_timeout_ms) {
    throw config_error("cluster.iteration_timeout_ms",
                       fmt::format("{} ms is less than cluster.failure_timeout_ms = {}: a lost "
                                   "worker would end the job before its loss is found (use 0 "
                                   "for no limit)",
                                   j.iteration_timeout_ms, j.failure_timeout_ms));
  }
  if (j.durable == true && j.policy != policy_kind::moevement &&
      j.policy != policy_kind::dense_disk) {
    throw config_error("checkpoint.durable",
                       fmt::format("the durable tier is written by policies moevement and "
                                   "dense-disk, not {}; leave it \"auto\" or change the policy",
                                   policy_name(j.policy)));
  }
  if (j.durable == false && j.policy == policy_kind::dense_disk) {
    throw config_error("checkpoint.durable",
                       "dense-disk checkpoints are the durable tier and cannot turn it off; use "
                       "policy dense-memory for checkpoints in peers' memory only");
  }
  if (j.standby_head && (j.policy != policy_kind::moevement || !durable_tier(j))) {
    throw config_error("cluster.standby_head",
                       "a standby head takes over from the resume journal of the durable tier: it "
                       "needs checkpoint.policy = \"moevement\" with the durable tier on "
                       "(checkpoint.durable left \"auto\" or true; under Slurm with "
                       "checkpoint.dir set to a directory every node sees)");
  }
  if (j.shadow_every > 0 && (j.policy != policy_kind::moevement || j.spares < 1)) {
    throw config_error("checkpoint.shadow_every",
                       "a shadow replay runs on an idle spare from policy moevement's windows: "
                       "it needs checkpoint.policy = \"moevement\" and cluster.spares "
                       ">= 1");
  }
  if (j.slurm_nodes > j.workers() + j.spares) {
    throw config_error("cluster.slurm_nodes",
                       fmt::format("{} Slurm nodes for {} tasks (pp x dp + spares): a node "
                                   "would have no task; use at most {}",
                                   j.slurm_nodes, j.workers() + j.spares, j.workers() + j.spares));
  }
  return j;
}

void write_config(wire::JobConfig::Builder out, const models::config_map& map) {
  auto entries = out.initEntries(static_cast<unsigned>(map.size()));
  unsigned i = 0;
  for (const auto& [key, value] : map) {
    auto e = entries[i++];
    e.setKey(capnp::Text::Reader(key.data(), key.size()));
    auto v = e.initValue();
    if (const auto* b = std::get_if<bool>(&value)) {
      v.setBoolean(*b);
    } else if (const auto* n = std::get_if<std::int64_t>(&value)) {
      v.setInteger(*n);
    } else if (const auto* d = std::get_if<double>(&value)) {
      v.setReal(*d);
    } else {
      const auto& text = std::get<std::string>(value);
      v.setText(capnp::Text::Reader(text.data(), text.size()));
    }
  }
}

namespace {

// A short printable rendering of untrusted text for error messages.
std::string printable(std::string_view s) {
  std::string out;
  for (const char c : s.substr(0, 40)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  if (s.size() > 40) out += "...";
  return out;
}

// Dotted names of [a-z0-9_-] segments, at least two, none empty: "model.preset".
bool valid_key(std::string_view key) {
  constexpr std::string_view segment_chars = "abcdefghijklmnopqrstuvwxyz0123456789_-";
  if (key.find('.') == std::string_view::npos) return false;
  std::size_t start = 0;
  while (true) {
    const std::size_t dot = key.find('.', start);
    const std::string_view seg =
        key.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start);
    if (seg.empty() || !all_of_chars(seg, segment_chars)) return false;
    if (dot == std::string_view::npos) return true;
    start = dot + 1;
  }
}

}  // namespace

result<models::config_map> read_config(wire::JobConfig::Reader in,
                                       const config_wire_limits& limits) {
  try {
    auto entries = in.getEntries();
    if (entries.size() > limits.max_entries) {
      return error{fmt::format("job config has {} entries; at most {} are accepted", entries.size(),
                               limits.max_entries)};
    }
    models::config_map out;
    for (unsigned i = 0; i < entries.size(); ++i) {
      const auto e = entries[i];
      const auto key_text = e.getKey();
      const std::string_view key(key_text.begin(), key_text.size());
      if (key.size() > limits.max_key_bytes) {
        return error{fmt::format("job config entry {}: key of {} bytes exceeds {} bytes", i,
                                 key.size(), limits.max_key_bytes)};
      }
      if (!valid_key(key)) {
        return error{
            fmt::format("job config entry {}: key '{}' is not a dotted name of "
                        "[a-z0-9_-] parts",
                        i, printable(key))};
      }
      models::config_value value;
      const auto v = e.getValue();
      switch (v.which()) {
        case wire::ConfigEntry::Value::BOOLEAN:
          value = v.getBoolean();
          break;
        case wire::ConfigEntry::Value::INTEGER:
          value = std::int64_t(v.getInteger());
          break;
        case wire::ConfigEntry::Value::REAL:
          value = v.getReal();
          break;
        case wire::ConfigEntry::Value::TEXT: {
          const auto t = v.getText();
          const std::string_view text(t.begin(), t.size());
          if (text.size() > limits.max_text_bytes) {
            return error{fmt::format("job config key {}: text of {} bytes exceeds {} bytes", key,
                                     text.size(), limits.max_text_bytes)};
          }
          if (text.find('\0') != std::string_view::npos) {
            return error{fmt::format("job config key {}: text contains a NUL byte", key)};
          }
          value = std::string(text);
          break;
        }
        default:
          return error{fmt::format("job config key {}: unknown value kind {}", key,
                                   static_cast<unsigned>(v.which()))};
      }
      if (!out.emplace(std::string(key), std::move(value)).second) {
        return error{fmt::format("job config key {} appears twice", key)};
      }
    }
    return out;
  } catch (const kj::Exception& e) {
    return error{fmt::format("malformed job config: {}", e.getDescription().cStr())};
  }
}

result<void> fits_the_wire(const models::config_map& map, const config_wire_limits& limits) {
  capnp::MallocMessageBuilder message;
  write_config(message.initRoot<wire::JobConfig>(), map);
  auto back = read_config(message.getRoot<wire::JobConfig>().asReader(), limits);
  if (!back.ok()) return back.err();
  return {};
}

}  // namespace moevement::engine
