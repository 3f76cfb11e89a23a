// PROVISIONAL (replaced by the engine-config branch).
#include "engine/job_config.hpp"

namespace moevement::engine {

namespace {
std::int64_t int_of(models::config_map& m, const std::string& k, std::int64_t def) {
  auto it = m.find(k);
  if (it == m.end()) return def;
  const auto* v = std::get_if<std::int64_t>(&it->second);
  if (v == nullptr) throw models::config_error(k, "expected an integer");
  const auto r = *v;
  m.erase(it);
  return r;
}
std::string str_of(models::config_map& m, const std::string& k, std::string def) {
  auto it = m.find(k);
  if (it == m.end()) return def;
  const auto* v = std::get_if<std::string>(&it->second);
  if (v == nullptr) throw models::config_error(k, "expected a string");
  auto r = *v;
  m.erase(it);
  return r;
}
}  // namespace

job_config resolve_job(models::config_map map) {
  job_config j;
  j.model = models::preset("tiny");
  models::apply_config(map, j.model, j.train);
  j.pp = int(int_of(map, "parallel.pp", 1));
  j.dp = int(int_of(map, "parallel.dp", 1));
  j.spares = int(int_of(map, "cluster.spares", 0));
  j.policy = str_of(map, "checkpoint.policy", "none");
  j.backend = str_of(map, "cluster.backend", "local");
  j.stage_type = str_of(map, "engine.stage", "moe");
  j.run_log = str_of(map, "engine.run_log", "run.jsonl");
  if (!map.empty()) throw models::config_error(map.begin()->first, "unknown key");
  if (j.pp > j.model.layers) throw models::config_error("parallel.pp", "more stages than layers");
  j.train.data_parallel = j.dp;
  return j;
}

std::vector<std::string> job_config_keys() { return {}; }

void write_config(wire::JobConfig::Builder b, const models::config_map& map) {
  auto list = b.initEntries(static_cast<unsigned>(map.size()));
  unsigned i = 0;
  for (const auto& [k, v] : map) {
    auto e = list[i++];
    e.setKey(k);
    if (const auto* x = std::get_if<bool>(&v)) e.getValue().setBoolean(*x);
    if (const auto* x = std::get_if<std::int64_t>(&v)) e.getValue().setInteger(*x);
    if (const auto* x = std::get_if<double>(&v)) e.getValue().setReal(*x);
    if (const auto* x = std::get_if<std::string>(&v)) e.getValue().setText(*x);
  }
}

result<models::config_map> read_config(wire::JobConfig::Reader r) {
  models::config_map m;
  for (auto e : r.getEntries()) {
    auto v = e.getValue();
    switch (v.which()) {
      case wire::ConfigEntry::Value::BOOLEAN: m[e.getKey()] = v.getBoolean(); break;
      case wire::ConfigEntry::Value::INTEGER: m[e.getKey()] = v.getInteger(); break;
      case wire::ConfigEntry::Value::REAL: m[e.getKey()] = v.getReal(); break;
      case wire::ConfigEntry::Value::TEXT: m[e.getKey()] = std::string(v.getText()); break;
      default: return error{"bad entry"};
    }
  }
  return m;
}

}  // namespace moevement::engine
