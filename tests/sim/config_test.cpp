#include "sim/config.hpp"

#include <gtest/gtest.h>

#include <unistd.h>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "sim/report.hpp"

namespace moevement::sim {
namespace {

std::filesystem::path source_root() {
  const char* root = std::getenv("MOEVEMENT_SOURCE_ROOT");
  if (root == nullptr)
    throw std::runtime_error("MOEVEMENT_SOURCE_ROOT is not set (run via meson test)");
  return root;
}

constexpr const char* minimal = R"(
[model]
preset = "gpt-moe"
[plan]
pp = 3
dp = 4
ep = 8
)";

std::string error_of(const std::string& text, const std::vector<std::string>& sets = {}) {
  try {
    parse_config(text, sets, ".");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "no error";
}

TEST(config, every_example_config_loads_and_runs) {
  int found = 0;
  for (const auto& e :
       std::filesystem::directory_iterator(source_root() / "examples" / "configs")) {
    const auto name = e.path().filename().string();
    if (!name.starts_with("simulate_")) continue;
    ++found;
    const auto cfg = load_config(e.path(), {"failures.trials=3", "failures.mtbf_minutes=[30]"});
    const auto r = run_simulation(cfg);
    EXPECT_EQ(r.rows.size(), cfg.policies.size()) << name;
    for (const auto& row : r.rows) {
      EXPECT_GT(row.closed.ettr, 0) << name;
      EXPECT_LE(row.closed.ettr, 1) << name;
    }
  }
  EXPECT_GE(found, 4);
}

TEST(config, defaults_and_overrides) {
  const auto cfg = parse_config(
      minimal,
      {"failures.mtbf_minutes=[60, 10]", "plan.dp=2", "policies.dense-memory.interval=7",
       "policies.list=[\"dense-memory\",\"moevement\"]", "cluster.gpu=h100"},
      ".");
  EXPECT_EQ(cfg.inputs.model.name, "gpt-moe");
  EXPECT_EQ(cfg.inputs.plan.dp, 2);
  EXPECT_EQ(cfg.mtbf_s, (std::vector<double>{3600, 600}));
  EXPECT_EQ(cfg.inputs.cluster.gpu, "h100");  // a bare word is a string
  ASSERT_EQ(cfg.policies.size(), 2u);
  EXPECT_EQ(cfg.policies[0].rule, interval_rule::fixed);
  EXPECT_EQ(cfg.policies[0].fixed_interval, 7);
  EXPECT_EQ(cfg.failures.duration_s, 12 * 3600.0);
}

TEST(config, bad_configs_name_the_key) {
  EXPECT_NE(error_of(std::string(minimal) + "[plan2]\nx = 1\n").find("'plan2.x'"),
            std::string::npos);
  EXPECT_NE(error_of(minimal, {"plan.pq=3"}).find("'plan.pq'"), std::string::npos);
  EXPECT_NE(error_of(minimal, {"plan.pp=\"three\""}).find("'plan.pp': expected an integer"),
            std::string::npos);
  EXPECT_NE(error_of(minimal, {"plan.ep=5"}).find("'plan.ep'"), std::string::npos);
  EXPECT_NE(error_of(minimal, {"plan.pp=25"}).find("'plan.pp'"), std::string::npos);
  EXPECT_NE(error_of(minimal, {"plan.global_batch=500"}).find("'plan.global_batch'"),
            std::string::npos);
  EXPECT_NE(error_of(minimal, {"failures.mtbf_minutes=[60, -1]"}).find("'failures.mtbf_minutes'"),
            std::string::npos);
  EXPECT_NE(
      error_of(minimal, {"cluster.compute_efficiency=1.5"}).find("'cluster.compute_efficiency'"),
      std::string::npos);
  EXPECT_NE(error_of(minimal, {"policies.list=[\"gemini\"]"}).find("'policies.list'"),
            std::string::npos);
  EXPECT_NE(error_of(minimal, {"policies.dense-disk.interval=\"daly\""})
                .find("'policies.dense-disk.interval'"),
            std::string::npos);
  EXPECT_NE(error_of(minimal, {"model.preset=gpt-9"}).find("'model.preset'"), std::string::npos);
  EXPECT_NE(error_of("[plan]\npp = 1\n").find("'model.preset'"), std::string::npos);
  EXPECT_NE(error_of(minimal, {"failures.trace=no-such-file"}).find("'failures.trace'"),
            std::string::npos);
  // Bounds that keep a run finite (an MTBF of a nanominute hung), and a peer copy to restore
  // from.
  for (const char* bad :
       {"failures.mtbf_minutes=[1e-9]", "failures.duration_hours=1e6", "sweep.mtbf_minutes=[0.001]",
        "policies.replicas=0", "policies.moevement.w_sparse=0"}) {
    const std::string key = std::string(bad).substr(0, std::string(bad).find('='));
    EXPECT_NE(error_of(minimal, {bad}).find("'" + key + "'"), std::string::npos) << bad;
  }
  EXPECT_NE(error_of("[model\n").find("not valid TOML"), std::string::npos);
  EXPECT_NE(error_of(minimal, {"novalue"}).find("expected key=value"), std::string::npos);
}

// A measured micro-batch of a CPU job, on a "cluster" that keeps a GPU's peak: the links'
// share stays what the configured bandwidths give and the rest is compute, so a replay's frozen
// operators save their share (before, the whole micro-batch was booked as communication and a
// replay of frozen operators cost as much as a full one). Links slower than the measurement:
// the model's split, scaled to it.
TEST(config, a_measured_micro_batch_is_compute_beyond_the_links_share) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("sim_split_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "p.toml") << "[profile]\nformat_version = 1\n"
                                   "stage_microbatch_s = [0.002, 0.002, 0.002]\n";
  const std::string config =
      "[model]\nlayers = 4\nhidden = 32\nvocab = 256\nseq_len = 32\nexperts = 4\ntop_k = 2\n"
      "expert_ffn = 64\ngated_ffn = false\n[cluster]\ngpu = \"cpu-process\"\n"
      "gpus_per_node = 3\nintra_node_gb_per_s = 1.45\n[plan]\npp = 3\ndp = 1\nep = 1\n"
      "global_batch = 16\nmicro_batch = 4\n[profile]\nfile = \"p.toml\"\n";
  const auto cfg = parse_config(config, {"failures.trials=1"}, dir);
  const auto modelled = estimate_iteration(cfg.inputs.model, cfg.inputs.cluster, cfg.inputs.plan,
                                           cfg.inputs.constants, 2);
  const auto costs = apply_profile(modelled, *cfg.profile);
  for (std::size_t s = 0; s < costs.stages.size(); ++s) {
    const auto& st = costs.stages[s];
    EXPECT_EQ(st.comm_s, modelled.stages[s].comm_s);
    EXPECT_GT(st.comm_s, 0.0);
    EXPECT_NEAR(st.compute_s + st.comm_s, 0.002, 1e-15);
    EXPECT_GT(st.compute_s, 0.9 * 0.002) << "the micro-batch is mostly compute";
    const std::vector<bool> all(st.ops.size(), true), none(st.ops.size(), false);
    const double full = local_replay_iteration_s(st, all, 4, cfg.inputs.constants);
    const double frozen = local_replay_iteration_s(st, none, 4, cfg.inputs.constants);
    EXPECT_NEAR(frozen,
                4 * (st.compute_s * cfg.inputs.constants.frozen_compute_fraction + st.comm_s),
                1e-12);
    EXPECT_LT(frozen, 0.75 * full);
  }
  // Links of 1 kB/s: they alone would take longer than the measured micro-batch.
  const auto slow =
      parse_config(config, {"failures.trials=1", "cluster.intra_node_gb_per_s=1e-6"}, dir);
  const auto slow_model = estimate_iteration(slow.inputs.model, slow.inputs.cluster,
                                             slow.inputs.plan, slow.inputs.constants, 2);
  ASSERT_GT(slow_model.stages[1].comm_s, 0.002);
  const auto scaled = apply_profile(slow_model, *slow.profile);
  const auto& st = scaled.stages[1];
  EXPECT_NEAR(st.comm_s / 0.002, slow_model.stages[1].comm_s / slow_model.stages[1].microbatch_s,
              1e-12);
  EXPECT_NEAR(st.compute_s + st.comm_s, 0.002, 1e-15);
  std::filesystem::remove_all(dir);
}

// A fixed W_sparse (the engine's tuned one) replaces Algorithm 1's in moevement's model.
TEST(config, a_fixed_w_sparse_replaces_algorithm_1s) {
  const auto chosen = run_simulation(parse_config(minimal, {"failures.trials=1"}, "."));
  const auto fixed = run_simulation(
      parse_config(minimal, {"failures.trials=1", "policies.moevement.w_sparse=37"}, "."));
  for (const auto& row : chosen.rows) {
    if (row.policy == policy_kind::moevement) {
      EXPECT_NE(row.model.w_sparse, 37);
    }
  }
  bool seen = false;
  for (const auto& row : fixed.rows) {
    if (row.policy != policy_kind::moevement) continue;
    seen = true;
    EXPECT_EQ(row.model.w_sparse, 37);
    EXPECT_GT(row.model.o_active, 0);
  }
  EXPECT_TRUE(seen);
  // Past one operator per slot: held to the largest stage's operator count, as the engine does
  // (a W of 10^8 reserved memory for every slot).
  const auto huge = run_simulation(
      parse_config(minimal, {"failures.trials=1", "policies.moevement.w_sparse=100000000"}, "."));
  for (const auto& row : huge.rows) {
    if (row.policy == policy_kind::moevement) {
      EXPECT_LT(row.model.w_sparse, 10000);
      EXPECT_EQ(row.model.o_active, 1);
    }
  }
}

// The engine's measured replay per iteration calibrates moevement's replay: the expected replay
// (a window's conversion and half a window of catch-up) costs that per iteration, the shape of
// the modelled replay kept.
TEST(config, a_measured_replay_speed_scales_moevements_replay) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("sim_replay_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "p.toml") << "[profile]\nformat_version = 1\nreplay_iteration_s = 0.5\n";
  const auto modelled = run_simulation(
      parse_config(minimal, {"failures.trials=1", "policies.moevement.w_sparse=4"}, "."));
  const auto measured =
      run_simulation(parse_config(std::string(minimal) + "[profile]\nfile = \"p.toml\"\n",
                                  {"failures.trials=1", "policies.moevement.w_sparse=4"}, dir));
  const auto moevement = [](const simulation_result& r) {
    for (const auto& row : r.rows) {
      if (row.policy == policy_kind::moevement) return row.model;
    }
    throw std::logic_error("no moevement row");
  };
  const auto a = moevement(modelled), b = moevement(measured);
  ASSERT_EQ(a.w_sparse, b.w_sparse);
  const int w = b.w_sparse;
  ASSERT_GT(w, 1);
  for (std::size_t s = 0; s < b.conversion_s.size(); ++s) {
    // As a failure replays on average (evaluate_closed_form): W - 1 conversion iterations and
    // (W - 1) / 2 all-active ones.
    double sum = 0.5 * (w - 1) * b.catch_up_s[s];
    for (int j = 0; j + 1 < w; ++j) sum += b.conversion_s[s][std::size_t(j)];
    EXPECT_NEAR(sum / (1.5 * (w - 1)), 0.5, 1e-9) << s;
    const double scale = b.catch_up_s[s] / a.catch_up_s[s];
    for (std::size_t j = 0; j < b.conversion_s[s].size(); ++j)
      EXPECT_NEAR(b.conversion_s[s][j], a.conversion_s[s][j] * scale, 1e-9 * scale);
  }
  std::ofstream(dir / "bad.toml") << "[profile]\nformat_version = 1\nreplay_iteration_s = 0\n";
  EXPECT_THROW(parse_config(std::string(minimal) + "[profile]\nfile = \"bad.toml\"\n",
                            {"failures.trials=1"}, dir),
               std::invalid_argument);
  // The error names the profile's key once, with the file (not "config key" twice), and a
  // profile with no format_version says it is missing.
  std::ofstream(dir / "unversioned.toml") << "[profile]\nreplay_iteration_s = 0.5\n";
  for (const char* f : {"bad.toml", "unversioned.toml"}) {
    try {
      (void)parse_config(std::string(minimal) + "[profile]\nfile = \"" + f + "\"\n",
                         {"failures.trials=1"}, dir);
      ADD_FAILURE() << f;
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_TRUE(what.starts_with("profile.file " + (dir / f).string() + ": config key")) << what;
      if (std::string(f) == "unversioned.toml") {
        EXPECT_NE(what.find("'profile.format_version': is missing"), std::string::npos) << what;
      }
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(config, profile_replaces_modelled_costs) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("sim_profile_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir / "p.toml") << "[profile]\nformat_version = 1\nproducer = \"test\"\n"
                                     "stage_microbatch_s = [0.1, 0.2, 0.1]\nsync_s = 0.05\n"
                                     "update_s = 0.02\nsnapshot_gb_per_s_per_gpu = 0.5\n"
                                     "restart_s = 4\npersist_lag_s = 0.75\n"
                                     "[profile.snapshot_s]\ndense-memory = 3.5\n"
                                     "[profile.load_s]\ndense-memory = 1.25\n";
  }
  const auto cfg = parse_config(std::string(minimal) + "[profile]\nfile = \"p.toml\"\n",
                                {"failures.trials=10"}, dir);
  ASSERT_TRUE(cfg.profile.has_value());
  EXPECT_EQ(cfg.failures.restart_s, 4);
  const auto r = run_simulation(cfg);
  // (M + S - 1) x max stage time + sync + update, from the measured values.
  EXPECT_NEAR(r.costs.iteration_s, (4 + 3 - 1) * 0.2 + 0.05 + 0.02, 1e-12);
  EXPECT_NEAR(r.costs.stages[0].snapshot_bytes_per_s, 0.5e9 * 32, 1);
  for (const auto& row : r.rows) {
    if (row.policy == policy_kind::dense_memory) {
      EXPECT_EQ(row.model.snapshot_s, 3.5);
      EXPECT_EQ(row.model.load_s, 1.25);  // measured load replaces the modelled one
    }
    // The measured persist lag replaces the modelled one (pec keeps its own).
    if (row.policy != policy_kind::pec) {
      EXPECT_EQ(row.model.persist_lag_s, 0.75);
    }
  }
  // The optional measured distributions and per-policy values reach the policies' models.
  std::ofstream(dir / "dist.toml")
      << "[profile]\nformat_version = 1\nrestart_s = 4\ndispatch_s = 0.001\n"
         "[profile.policy_restart_s]\ndense-memory = 2.5\n"
         "[profile.persist_lag_samples_s]\ndense-memory = [0.5, 0.25, 2.0]\n";
  const auto dist = run_simulation(parse_config(
      std::string(minimal) + "[profile]\nfile = \"dist.toml\"\n", {"failures.trials=10"}, dir));
  EXPECT_EQ(dist.costs.dispatch_s, 0.001);
  for (const auto& row : dist.rows) {
    EXPECT_EQ(row.model.dispatch_s, 0.001);
    if (row.policy == policy_kind::dense_memory) {
      EXPECT_EQ(row.model.restart_s, 2.5);
      EXPECT_EQ(row.model.persist_lag_samples_s, (std::vector<double>{0.25, 0.5, 2.0}));
      EXPECT_EQ(row.model.persist_lag_s, 0.5);  // their median
    } else {
      EXPECT_EQ(row.model.restart_s, 4);
      EXPECT_TRUE(row.model.persist_lag_samples_s.empty());
    }
  }
  std::ofstream(dir / "bad.toml") << "[profile]\nformat_version = 2\n";
  try {
    parse_config(std::string(minimal) + "[profile]\nfile = \"bad.toml\"\n", {}, dir);
    ADD_FAILURE() << "format 2 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("profile.format_version"), std::string::npos) << e.what();
  }
  std::ofstream(dir / "lag.toml") << "[profile]\nformat_version = 1\npersist_lag_s = -1\n";
  EXPECT_THROW(parse_config(std::string(minimal) + "[profile]\nfile = \"lag.toml\"\n", {}, dir),
               std::invalid_argument);
  std::ofstream(dir / "short.toml") << "[profile]\nformat_version = 1\nstage_microbatch_s = [1]\n";
  const auto short_cfg =
      parse_config(std::string(minimal) + "[profile]\nfile = \"short.toml\"\n", {}, dir);
  EXPECT_THROW(run_simulation(short_cfg), std::invalid_argument);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace moevement::sim
