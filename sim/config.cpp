#include "sim/config.hpp"

#include <toml++/toml.h>
#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

namespace moevement::sim {
namespace {

[[noreturn]] void fail(const std::string& key, const std::string& what) {
  throw std::invalid_argument("config key '" + key + "': " + what);
}

// Every key the simulator reads. Anything else is an error: a typo must not be silently ignored.
const std::set<std::string>& known_keys() {
  static const std::set<std::string> keys = {
      "name",
      "model.preset",
      "model.layers",
      "model.hidden",
      "model.vocab",
      "model.seq_len",
      "model.experts",
      "model.top_k",
      "model.shared_experts",
      "model.expert_ffn",
      "model.moe_every",
      "model.first_dense",
      "model.dense_ffn",
      "model.gated_ffn",
      "model.tied_embeddings",
      "model.extra_params",
      "cluster.gpu",
      "cluster.peak_tflops",
      "cluster.compute_efficiency",
      "cluster.gpu_memory_gb",
      "cluster.hbm_gb_per_s",
      "cluster.gpus_per_node",
      "cluster.intra_node_gb_per_s",
      "cluster.inter_node_gb_per_s",
      "cluster.host_device_gb_per_s",
      "cluster.storage_gb_per_s",
      "cluster.alpha_intra_us",
      "cluster.alpha_inter_us",
      "cluster.snapshot_gb_per_s_per_gpu",
      "plan.pp",
      "plan.dp",
      "plan.ep",
      "plan.global_batch",
      "plan.micro_batch",
      "plan.zero1",
      "costs.expert_popularity_zipf",
      "costs.frozen_compute_fraction",
      "costs.update_bytes_per_param",
      "costs.sync_overlap",
      "costs.grad_bytes_per_param",
      "failures.mtbf_minutes",
      "failures.duration_hours",
      "failures.restart_s",
      "failures.trials",
      "failures.seed",
      "failures.trace",
      "policies.list",
      "policies.replicas",
      "policies.dense-memory.interval",
      "policies.dense-memory.overhead_cap",
      "policies.dense-disk.interval",
      "policies.dense-disk.overhead_cap",
      "policies.pec.initial_fraction",
      "policies.pec.plt_budget",
      "policies.pec.persist_interval",
      "policies.pec.interval",
      "policies.moevement.w_sparse",
      "profile.file",
      "sweep.models",
      "sweep.gpus",
      "sweep.stages",
      "sweep.pipelines",
      "sweep.mtbf_minutes",
      "sweep.policies",
      "sweep.microbatches_per_stage",
  };
  return keys;
}

void collect_leaves(const toml::table& t, const std::string& prefix,
                    std::vector<std::string>& out) {
  for (const auto& [k, node] : t) {
    const std::string path =
        prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const auto* sub = node.as_table()) {
      collect_leaves(*sub, path, out);
    } else {
      out.push_back(path);
    }
  }
}

void check_keys(const toml::table& root, const std::set<std::string>& known, const char* what) {
  std::vector<std::string> leaves;
  collect_leaves(root, "", leaves);
  for (const auto& k : leaves) {
    if (!known.contains(k)) {
      fail(k, std::string("unknown ") + what + " key (see docs/simulator.md for the keys)");
    }
  }
}

class reader {
 public:
  explicit reader(const toml::table& t) : t_(t) {}

  toml::node_view<const toml::node> at(const std::string& key) const { return t_.at_path(key); }
  bool has(const std::string& key) const { return static_cast<bool>(at(key)); }

  double number(const std::string& key, double fallback) const {
    const auto n = at(key);
    if (!n) return fallback;
    if (const auto i = n.value_exact<std::int64_t>()) return static_cast<double>(*i);
    if (const auto d = n.value_exact<double>()) return *d;
    fail(key, "expected a number");
  }
  double positive(const std::string& key, double fallback) const {
    const double v = number(key, fallback);
    if (!(v > 0)) fail(key, "must be positive, got " + std::to_string(v));
    return v;
  }
  double fraction(const std::string& key, double fallback) const {
    const double v = number(key, fallback);
    if (!(v >= 0 && v <= 1)) fail(key, "must be in [0, 1], got " + std::to_string(v));
    return v;
  }
  std::int64_t integer(const std::string& key, std::int64_t fallback) const {
    const auto n = at(key);
    if (!n) return fallback;
    if (const auto i = n.value_exact<std::int64_t>()) return *i;
    fail(key, "expected an integer");
  }
  int count(const std::string& key, int fallback, int minimum = 1) const {
    const auto v = integer(key, fallback);
    if (v < minimum || v > 1'000'000'000) {
      fail(key, "must be an integer >= " + std::to_string(minimum) + ", got " + std::to_string(v));
    }
    return static_cast<int>(v);
  }
  bool boolean(const std::string& key, bool fallback) const {
    const auto n = at(key);
    if (!n) return fallback;
    if (const auto b = n.value_exact<bool>()) return *b;
    fail(key, "expected true or false");
  }
  std::string string(const std::string& key, const std::string& fallback) const {
    const auto n = at(key);
    if (!n) return fallback;
    if (const auto s = n.value_exact<std::string>()) return *s;
    fail(key, "expected a string");
  }
  std::vector<double> numbers(const std::string& key, const std::vector<double>& fallback) const {
    const auto n = at(key);
    if (!n) return fallback;
    if (n.is_number()) return {number(key, 0)};
    const auto* a = n.as_array();
    if (a == nullptr || a->empty()) fail(key, "expected a number or a non-empty array of numbers");
    std::vector<double> out;
    for (const auto& e : *a) {
      if (const auto i = e.value_exact<std::int64_t>()) {
        out.push_back(static_cast<double>(*i));
      } else if (const auto d = e.value_exact<double>()) {
        out.push_back(*d);
      } else {
        fail(key, "expected an array of numbers");
      }
    }
    return out;
  }
  std::vector<std::string> strings(const std::string& key,
                                   const std::vector<std::string>& fallback) const {
    const auto n = at(key);
    if (!n) return fallback;
    const auto* a = n.as_array();
    if (a == nullptr || a->empty()) fail(key, "expected a non-empty array of strings");
    std::vector<std::string> out;
    for (const auto& e : *a) {
      const auto s = e.value_exact<std::string>();
      if (!s) fail(key, "expected an array of strings");
      out.push_back(*s);
    }
    return out;
  }
  std::vector<int> counts(const std::string& key, const std::vector<int>& fallback) const {
    if (!has(key)) return fallback;
    std::vector<int> out;
    for (double d : numbers(key, {})) {
      if (d < 1 || d != static_cast<double>(static_cast<int>(d)))
        fail(key, "expected positive integers");
      out.push_back(static_cast<int>(d));
    }
    return out;
  }

 private:
  const toml::table& t_;
};

toml::table parse_toml(std::string_view text, const char* what) {
  try {
    return toml::parse(text);
  } catch (const toml::parse_error& e) {
    std::ostringstream msg;
    msg << what << " is not valid TOML: " << e.description() << " at line "
        << e.source().begin.line;
    throw std::invalid_argument(msg.str());
  }
}

void apply_override(toml::table& root, const std::string& assignment) {
  const auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw std::invalid_argument("--set '" + assignment + "': expected key=value");
  }
  const std::string key = assignment.substr(0, eq);
  const std::string value = assignment.substr(eq + 1);
  if (!known_keys().contains(key)) fail(key, "unknown key in --set (see docs/simulator.md)");
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + value);
  } catch (const toml::parse_error&) {
    parsed = toml::table{{"v", value}};  // a bare word is a string
  }
  toml::table* t = &root;
  std::size_t start = 0;
  while (true) {
    const auto dot = key.find('.', start);
    const std::string part = key.substr(start, dot == std::string::npos ? dot : dot - start);
    if (dot == std::string::npos) {
      t->insert_or_assign(part, std::move(*parsed.get("v")));
      return;
    }
    auto* next = t->get(part);
    if (next == nullptr) {
      t->insert(part, toml::table{});
      next = t->get(part);
    }
    t = next->as_table();
    if (t == nullptr) fail(key, "'" + part + "' is not a table");
    start = dot + 1;
  }
}

std::string read_text(const std::filesystem::path& file, const char* what) {
  std::ifstream in(file, std::ios::binary);
  if (!in) {
    throw std::invalid_argument(std::string("cannot read ") + what + " '" + file.string() +
                                "' (check the path)");
  }
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

model_shape read_model(const reader& r) {
  model_shape m;
  if (r.has("model.preset")) {
    try {
      m = paper_model(r.string("model.preset", ""));
    } catch (const std::invalid_argument& e) {
      fail("model.preset", e.what());
    }
  } else if (!r.has("model.layers")) {
    fail("model.preset", "set a preset or give the shape (model.layers, model.hidden, ...)");
  }
  m.name = r.has("model.preset") ? m.name : std::string("custom");
  m.layers = r.count("model.layers", m.layers);
  m.hidden = r.count("model.hidden", m.hidden);
  m.vocab = r.count("model.vocab", m.vocab);
  m.seq_len = r.count("model.seq_len", m.seq_len);
  m.experts = r.count("model.experts", m.experts, 0);
  m.top_k = r.count("model.top_k", m.top_k, 0);
  m.shared_experts = r.count("model.shared_experts", m.shared_experts, 0);
  m.expert_ffn = r.count("model.expert_ffn", m.expert_ffn);
  m.moe_every = r.count("model.moe_every", m.moe_every);
  m.first_dense = r.count("model.first_dense", m.first_dense, 0);
  m.dense_ffn = r.count("model.dense_ffn", m.dense_ffn, 0);
  m.gated_ffn = r.boolean("model.gated_ffn", m.gated_ffn);
  m.tied_embeddings = r.boolean("model.tied_embeddings", m.tied_embeddings);
  m.extra_params = r.number("model.extra_params", m.extra_params);
  if (m.top_k > m.experts) fail("model.top_k", "exceeds model.experts");
  return m;
}

}  // namespace

profile_data parse_profile(std::string_view text) {
  const auto root = parse_toml(text, "profile");
  static const std::set<std::string> keys = {"profile.format_version",
                                             "profile.producer",
                                             "profile.iteration_s",
                                             "profile.update_s",
                                             "profile.sync_s",
                                             "profile.stage_microbatch_s",
                                             "profile.snapshot_gb_per_s_per_gpu",
                                             "profile.restart_s",
                                             "profile.persist_lag_s",
                                             "profile.dispatch_s",
                                             "profile.ep",
                                             "profile.alltoall_s",
                                             "profile.replay_iteration_s",
                                             "profile.snapshot_s.dense-memory",
                                             "profile.snapshot_s.dense-disk",
                                             "profile.snapshot_s.pec",
                                             "profile.snapshot_s.moevement",
                                             "profile.load_s.dense-memory",
                                             "profile.load_s.dense-disk",
                                             "profile.load_s.pec",
                                             "profile.load_s.moevement",
                                             "profile.policy_persist_lag_s.dense-memory",
                                             "profile.policy_persist_lag_s.dense-disk",
                                             "profile.policy_persist_lag_s.pec",
                                             "profile.policy_persist_lag_s.moevement",
                                             "profile.policy_restart_s.dense-memory",
                                             "profile.policy_restart_s.dense-disk",
                                             "profile.policy_restart_s.pec",
                                             "profile.policy_restart_s.moevement",
                                             "profile.persist_lag_samples_s.dense-memory",
                                             "profile.persist_lag_samples_s.dense-disk",
                                             "profile.persist_lag_samples_s.pec",
                                             "profile.persist_lag_samples_s.moevement"};
  check_keys(root, keys, "profile");
  const reader r(root);
  profile_data p;
  if (!r.has("profile.format_version")) {
    fail("profile.format_version",
         "is missing: a profile says which format it is in (format_version = 1, as "
         "`moevement bench policies --profile-out` writes it)");
  }
  p.format_version = r.count("profile.format_version", 0, 0);
  if (p.format_version != 1) {
    fail("profile.format_version",
         "this simulator reads format 1, got " + std::to_string(p.format_version));
  }
  p.producer = r.string("profile.producer", "");
  const auto opt = [&](const std::string& k) { return r.has(k) ? r.positive(k, 1) : -1.0; };
  p.iteration_s = opt("profile.iteration_s");
  // Times the profile gives must be >= 0 (-1 below means "not given": the model's own).
  const auto time_s = [&](const std::string& k) {
    if (!r.has(k)) return -1.0;
    const double v = r.number(k, 0);
    if (!(v >= 0)) fail(k, "must be >= 0");
    return v;
  };
  p.update_s = time_s("profile.update_s");
  p.sync_s = time_s("profile.sync_s");
  p.stage_microbatch_s = r.numbers("profile.stage_microbatch_s", {});
  for (double v : p.stage_microbatch_s) {
    if (!(v > 0)) fail("profile.stage_microbatch_s", "times must be positive");
  }
  if (r.has("profile.snapshot_gb_per_s_per_gpu"))
    p.snapshot_bytes_per_s_per_gpu = r.positive("profile.snapshot_gb_per_s_per_gpu", 1) * 1e9;
  p.restart_s = time_s("profile.restart_s");
  p.dispatch_s = r.has("profile.dispatch_s") ? r.number("profile.dispatch_s", 0) : -1;
  if (r.has("profile.dispatch_s") && p.dispatch_s < 0) fail("profile.dispatch_s", "must be >= 0");
  p.persist_lag_s = r.has("profile.persist_lag_s") ? r.number("profile.persist_lag_s", 0) : -1;
  if (r.has("profile.persist_lag_s") && p.persist_lag_s < 0)
    fail("profile.persist_lag_s", "must be >= 0");
  if (r.has("profile.ep")) p.ep = r.count("profile.ep", 1, 1);
  p.alltoall_s = r.has("profile.alltoall_s") ? r.number("profile.alltoall_s", 0) : -1;
  if (r.has("profile.alltoall_s") && p.alltoall_s < 0) fail("profile.alltoall_s", "must be >= 0");
  if (r.has("profile.replay_iteration_s"))
    p.replay_iteration_s = r.positive("profile.replay_iteration_s", 1);
  for (const char* pol : {"dense-memory", "dense-disk", "pec", "moevement"}) {
    const std::string k = std::string("profile.snapshot_s.") + pol;
    if (r.has(k)) p.snapshot_s[pol] = time_s(k);
    const std::string l = std::string("profile.load_s.") + pol;
    if (r.has(l)) {
      p.load_s[pol] = r.number(l, 0);
      if (p.load_s[pol] < 0) fail(l, "must be >= 0");
    }
    const std::string g = std::string("profile.policy_persist_lag_s.") + pol;
    if (r.has(g)) {
      p.policy_persist_lag_s[pol] = r.number(g, 0);
      if (p.policy_persist_lag_s[pol] < 0) fail(g, "must be >= 0");
    }
    const std::string rs = std::string("profile.policy_restart_s.") + pol;
    if (r.has(rs)) {
      p.policy_restart_s[pol] = r.number(rs, 0);
      if (p.policy_restart_s[pol] < 0) fail(rs, "must be >= 0");
    }
    const std::string d = std::string("profile.persist_lag_samples_s.") + pol;
    if (r.has(d)) {
      auto& v = p.persist_lag_samples_s[pol];
      v = r.numbers(d, {});
      for (double x : v) {
        if (!(x >= 0)) fail(d, "lags must be >= 0");
      }
    }
  }
  return p;
}

iteration_costs apply_profile(iteration_costs costs, const profile_data& p) {
  if (!p.stage_microbatch_s.empty()) {
    if (p.stage_microbatch_s.size() != costs.stages.size()) {
      fail("profile.stage_microbatch_s", "has " + std::to_string(p.stage_microbatch_s.size()) +
                                             " entries but plan.pp is " +
                                             std::to_string(costs.stages.size()));
    }
    double worst = 0;
    for (std::size_t s = 0; s < costs.stages.size(); ++s) {
      auto& st = costs.stages[s];
      const double measured = p.stage_microbatch_s[s];
      if (st.comm_s < measured && st.compute_s > 0) {
        // The communication stays what the configured links give; the rest is compute, at the
        // rate that takes. The rate (peak x efficiency) is what the model knows least: a CPU
        // "cluster" keeps a GPU's peak, which booked a whole CPU micro-batch as communication,
        // and a replay's frozen operators (costs.frozen_compute_fraction) then saved nothing.
        const double compute = measured - st.comm_s;
        st.flops_per_s *= st.compute_s / compute;
        st.compute_s = compute;
      } else {
        // The links alone take longer than the measurement (or the model computes nothing):
        // the model's split, scaled to it.
        if (st.microbatch_s > 0) {
          const double ratio = measured / st.microbatch_s;
          st.flops_per_s /= ratio;
          st.compute_s *= ratio;
          st.comm_s *= ratio;
        } else {
          st.compute_s = measured;  // nothing modelled to split
        }
      }
      st.microbatch_s = measured;
      worst = std::max(worst, st.microbatch_s);
    }
    costs.pipeline_s = (costs.microbatches + static_cast<int>(costs.stages.size()) - 1) * worst;
  }
  if (p.alltoall_s >= 0) {
    // The measured all-to-all share of a micro-batch, the rest compute (at least 1%: the wait
    // is measured inside the compute), its rate scaled to match (a replay's frozen operators
    // compute at that rate, and wait the all-to-all in full).
    for (auto& st : costs.stages) {
      const double before = st.compute_s;
      st.comm_s = std::min(p.alltoall_s, 0.99 * st.microbatch_s);
      st.compute_s = st.microbatch_s - st.comm_s;
      if (before > 0) st.flops_per_s *= before / st.compute_s;
    }
  }
  if (p.sync_s >= 0) {
    for (auto& st : costs.stages) st.sync_s = p.sync_s;
    costs.sync_s = p.sync_s;
  }
  if (p.update_s >= 0) {
    for (auto& st : costs.stages) st.update_s = p.update_s;
    costs.update_s = p.update_s;
  }
  costs.iteration_s = costs.pipeline_s + costs.sync_s + costs.update_s;
  if (p.iteration_s > 0) costs.iteration_s = p.iteration_s;
  if (p.dispatch_s >= 0) costs.dispatch_s = p.dispatch_s;
  if (p.snapshot_bytes_per_s_per_gpu > 0) {
    for (auto& st : costs.stages)
      st.snapshot_bytes_per_s = p.snapshot_bytes_per_s_per_gpu * st.gpus;
  }
  return costs;
}

namespace {

void read_cluster(const reader& r, cluster_spec& c) {
  c.gpu = r.string("cluster.gpu", c.gpu);
  c.peak_flops = r.positive("cluster.peak_tflops", c.peak_flops / 1e12) * 1e12;
  c.compute_efficiency = r.positive("cluster.compute_efficiency", c.compute_efficiency);
  if (c.compute_efficiency > 1) fail("cluster.compute_efficiency", "must be at most 1");
  c.gpu_memory_bytes = r.positive("cluster.gpu_memory_gb", c.gpu_memory_bytes / 1e9) * 1e9;
  c.hbm_bytes_per_s = r.positive("cluster.hbm_gb_per_s", c.hbm_bytes_per_s / 1e9) * 1e9;
  c.gpus_per_node = r.count("cluster.gpus_per_node", c.gpus_per_node);
  c.intra_node_bytes_per_s =
      r.positive("cluster.intra_node_gb_per_s", c.intra_node_bytes_per_s / 1e9) * 1e9;
  c.inter_node_bytes_per_s =
      r.positive("cluster.inter_node_gb_per_s", c.inter_node_bytes_per_s / 1e9) * 1e9;
  c.host_device_bytes_per_s =
      r.positive("cluster.host_device_gb_per_s", c.host_device_bytes_per_s / 1e9) * 1e9;
  c.storage_bytes_per_s = r.positive("cluster.storage_gb_per_s", c.storage_bytes_per_s / 1e9) * 1e9;
  c.alpha_intra_s = r.number("cluster.alpha_intra_us", c.alpha_intra_s * 1e6) * 1e-6;
  c.alpha_inter_s = r.number("cluster.alpha_inter_us", c.alpha_inter_s * 1e6) * 1e-6;
  if (r.has("cluster.snapshot_gb_per_s_per_gpu"))
    c.snapshot_bytes_per_s = r.positive("cluster.snapshot_gb_per_s_per_gpu", 1) * 1e9;
  if (c.alpha_intra_s < 0) fail("cluster.alpha_intra_us", "must be >= 0");
  if (c.alpha_inter_s < 0) fail("cluster.alpha_inter_us", "must be >= 0");
}

void read_plan(const reader& r, model_inputs& in) {
  auto& p = in.plan;
  p.pp = r.count("plan.pp", p.pp);
  p.dp = r.count("plan.dp", p.dp);
  p.ep = r.count("plan.ep", p.ep);
  p.global_batch = r.count("plan.global_batch", p.global_batch);
  p.micro_batch = r.count("plan.micro_batch", p.micro_batch);
  p.zero1 = r.boolean("plan.zero1", p.zero1);
  if (p.pp > 2 * in.model.layers) {
    fail("plan.pp", std::to_string(p.pp) + " stages exceed the model's " +
                        std::to_string(2 * in.model.layers) + " half-layers");
  }
  if (in.model.experts > 0 && in.model.experts % p.ep != 0 && p.ep % in.model.experts != 0) {
    fail("plan.ep", std::to_string(p.ep) + " and the model's " + std::to_string(in.model.experts) +
                        " experts must divide one another");
  }
  if (p.global_batch % (p.micro_batch * p.dp) != 0) {
    fail("plan.global_batch", "must be a multiple of plan.micro_batch x plan.dp");
  }
}

void read_constants(const reader& r, model_constants& k) {
  k.expert_popularity_zipf = r.number("costs.expert_popularity_zipf", k.expert_popularity_zipf);
  if (k.expert_popularity_zipf < 0) fail("costs.expert_popularity_zipf", "must be >= 0");
  k.frozen_compute_fraction =
      r.fraction("costs.frozen_compute_fraction", k.frozen_compute_fraction);
  k.update_bytes_per_param = r.positive("costs.update_bytes_per_param", k.update_bytes_per_param);
  k.sync_overlap = r.fraction("costs.sync_overlap", k.sync_overlap);
  k.grad_bytes_per_param = r.positive("costs.grad_bytes_per_param", k.grad_bytes_per_param);
}

void read_failures(const reader& r, sim_config& cfg, const std::filesystem::path& base_dir) {
  auto& f = cfg.failures;
  // Bounds that keep a run finite: an MTBF under a second or a run of over ten years is no
  // cluster's, and the simulation's events grow with their ratio.
  for (double m : r.numbers("failures.mtbf_minutes", {120, 60, 30, 20, 10})) {
    if (!(m >= 1.0 / 60) || !(m <= 1e9)) {
      fail("failures.mtbf_minutes", "every MTBF must be between 1/60 (a second) and 1e9 minutes");
    }
    cfg.mtbf_s.push_back(m * 60);
  }
  f.duration_s = r.positive("failures.duration_hours", f.duration_s / 3600) * 3600;
  if (!(f.duration_s <= 87600.0 * 3600)) {
    fail("failures.duration_hours", "must be at most 87600 (ten years)");
  }
  f.restart_s = r.number("failures.restart_s", f.restart_s);
  if (f.restart_s < 0) fail("failures.restart_s", "must be >= 0");
  f.trials = r.count("failures.trials", f.trials);
  // Each trial simulates the whole run: a million is far past any useful precision.
  if (f.trials > 1'000'000) fail("failures.trials", "must be at most 1000000");
  const std::int64_t seed = r.integer("failures.seed", static_cast<std::int64_t>(f.seed));
  if (seed < 0) fail("failures.seed", "must be >= 0");
  f.seed = static_cast<std::uint64_t>(seed);
  if (r.has("failures.trace")) {
    const auto path = base_dir / r.string("failures.trace", "");
    try {
      cfg.trace = parse_failure_trace(read_text(path, "failure trace"));
    } catch (const std::invalid_argument& e) {
      fail("failures.trace", e.what());
    }
    cfg.files.push_back(path);
    if (cfg.trace.empty()) fail("failures.trace", "the trace has no failures");
    for (const auto& e : cfg.trace) {
      if (e.stage >= cfg.inputs.plan.pp) {
        fail("failures.trace", "stage " + std::to_string(e.stage) + " at " +
                                   std::to_string(e.time_s) + " s: plan.pp is " +
                                   std::to_string(cfg.inputs.plan.pp) + " (stages 0.." +
                                   std::to_string(cfg.inputs.plan.pp - 1) + ")");
      }
    }
  }
}

std::vector<policy_settings> read_policies(const reader& r) {
  std::vector<policy_settings> out;
  // At least one peer copy: dense-memory and moevement restore from them (0 would model an
  // in-memory restore from nowhere).
  const int replicas = r.count("policies.replicas", 2, 1);
  std::set<std::string> listed;
  for (const auto& name :
       r.strings("policies.list", {"dense-disk", "dense-memory", "pec", "moevement"})) {
    policy_settings ps;
    try {
      ps.kind = parse_policy(name);
    } catch (const std::invalid_argument& e) {
      fail("policies.list", e.what());
    }
    if (!listed.insert(name).second) fail("policies.list", "lists " + name + " twice");
    ps.replicas = replicas;
    if (ps.kind == policy_kind::dense_memory || ps.kind == policy_kind::dense_disk) {
      const std::string base = "policies." + name;
      // CheckFreq caps overhead at 3%; Gemini's interval is the oracle in the paper.
      ps.rule = ps.kind == policy_kind::dense_disk ? interval_rule::cap : interval_rule::oracle;
      const auto n = r.at(base + ".interval");
      if (n) {
        if (const auto i = n.value_exact<std::int64_t>()) {
          if (*i < 1) fail(base + ".interval", "a fixed interval must be >= 1");
          ps.rule = interval_rule::fixed;
          ps.fixed_interval = static_cast<int>(*i);
        } else if (const auto s = n.value_exact<std::string>()) {
          try {
            ps.rule = parse_interval_rule(*s);
          } catch (const std::invalid_argument& e) {
            fail(base + ".interval", e.what());
          }
          if (ps.rule == interval_rule::fixed)
            fail(base + ".interval", "give the interval as an integer");
        } else {
          fail(base + ".interval", "expected \"young\", \"oracle\", \"cap\" or an integer");
        }
      }
      ps.overhead_cap = r.positive(base + ".overhead_cap", ps.overhead_cap);
    }
    if (ps.kind == policy_kind::pec) {
      ps.pec_initial_fraction =
          r.fraction("policies.pec.initial_fraction", ps.pec_initial_fraction);
      if (ps.pec_initial_fraction == 0) fail("policies.pec.initial_fraction", "must be positive");
      ps.pec_plt_budget = r.positive("policies.pec.plt_budget", ps.pec_plt_budget);
      ps.pec_persist_interval = r.count("policies.pec.persist_interval", ps.pec_persist_interval);
      ps.pec_interval = r.count("policies.pec.interval", ps.pec_interval);
    }
    if (ps.kind == policy_kind::moevement && r.has("policies.moevement.w_sparse")) {
      ps.w_sparse = r.count("policies.moevement.w_sparse", ps.w_sparse);
    }
    out.push_back(ps);
  }
  return out;
}

// A profile file (measured costs) overrides the modelled ones, per policy.
void read_profile(const reader& r, sim_config& cfg, const std::filesystem::path& base_dir) {
  auto& f = cfg.failures;
  if (r.has("profile.file")) {
    const auto path = base_dir / r.string("profile.file", "");
    try {
      cfg.profile = parse_profile(read_text(path, "profile"));
    } catch (const std::invalid_argument& e) {
      // (The profile's own key is named in e.what().)
      throw std::invalid_argument("profile.file " + path.string() + ": " + e.what());
    }
    cfg.files.push_back(path);
    if (cfg.profile->ep > 0 && cfg.profile->ep != cfg.inputs.plan.ep) {
      fail("profile.file", "the profile was measured at ep " + std::to_string(cfg.profile->ep) +
                               " but plan.ep is " + std::to_string(cfg.inputs.plan.ep) +
                               ": set plan.ep to the profile's, or measure one at this ep");
    }
    if (cfg.profile->restart_s >= 0) f.restart_s = cfg.profile->restart_s;
    for (auto& ps : cfg.policies) {
      const auto it = cfg.profile->snapshot_s.find(std::string(policy_name(ps.kind)));
      if (it != cfg.profile->snapshot_s.end()) ps.snapshot_s = it->second;
      const auto load = cfg.profile->load_s.find(std::string(policy_name(ps.kind)));
      if (load != cfg.profile->load_s.end()) ps.load_s = load->second;
      ps.persist_lag_s = cfg.profile->persist_lag_s;
      ps.replay_iteration_s = cfg.profile->replay_iteration_s;
      const auto lag = cfg.profile->policy_persist_lag_s.find(std::string(policy_name(ps.kind)));
      if (lag != cfg.profile->policy_persist_lag_s.end()) ps.persist_lag_s = lag->second;
      const auto restart = cfg.profile->policy_restart_s.find(std::string(policy_name(ps.kind)));
      if (restart != cfg.profile->policy_restart_s.end()) ps.restart_s = restart->second;
      const auto samples =
          cfg.profile->persist_lag_samples_s.find(std::string(policy_name(ps.kind)));
      if (samples != cfg.profile->persist_lag_samples_s.end())
        ps.persist_lag_samples_s = samples->second;
    }
  }
}

void read_sweep(const reader& r, sweep_settings& s) {
  s.models = r.strings("sweep.models", s.models);
  s.gpus = r.counts("sweep.gpus", s.gpus);
  s.stages = r.counts("sweep.stages", s.stages);
  s.pipelines = r.counts("sweep.pipelines", s.pipelines);
  s.mtbf_minutes = r.numbers("sweep.mtbf_minutes", s.mtbf_minutes);
  for (double m : s.mtbf_minutes) {
    if (!(m >= 1.0 / 60) || !(m <= 1e9)) {
      fail("sweep.mtbf_minutes", "every MTBF must be between 1/60 (a second) and 1e9 minutes");
    }
  }
  s.policies = r.strings("sweep.policies", s.policies);
  s.microbatches_per_stage = r.count("sweep.microbatches_per_stage", s.microbatches_per_stage);
  if (s.models.size() != s.gpus.size() || s.gpus.size() != s.stages.size() ||
      s.stages.size() != s.pipelines.size()) {
    fail("sweep.models",
         "sweep.models, sweep.gpus, sweep.stages and sweep.pipelines must have "
         "the same length");
  }
}

}  // namespace

sim_config parse_config(std::string_view toml_text, const std::vector<std::string>& overrides,
                        const std::filesystem::path& base_dir) {
  auto root = parse_toml(toml_text, "config");
  for (const auto& o : overrides) apply_override(root, o);
  check_keys(root, known_keys(), "config");
  const reader r(root);
  sim_config cfg;
  cfg.name = r.string("name", "simulation");
  auto& in = cfg.inputs;
  in.model = read_model(r);
  read_cluster(r, in.cluster);
  read_plan(r, in);
  read_constants(r, in.constants);
  read_failures(r, cfg, base_dir);
  cfg.policies = read_policies(r);
  read_profile(r, cfg, base_dir);
  read_sweep(r, cfg.sweep);
  return cfg;
}

sim_config load_config(const std::filesystem::path& file,
                       const std::vector<std::string>& overrides) {
  auto cfg = parse_config(read_text(file, "config"), overrides, file.parent_path());
  cfg.files.push_back(file);
  return cfg;
}

}  // namespace moevement::sim
