// Bad settings fail with the key named; good ones land where they should.
#include "models/config.hpp"

#include <gtest/gtest.h>

#include "models/trainer.hpp"

namespace moevement::models {
namespace {

// The key a bad config is rejected with (empty if it was accepted).
std::string rejected_key(config_map map, bool build_trainer = false) {
  model_config m = preset("tiny");
  train_config t;
  try {
    apply_config(map, m, t);
    validate(m, t);
    if (build_trainer) trainer tr(m, t);
  } catch (const config_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(e.key() + ": ", 0), 0u) << e.what();
    return e.key();
  }
  return "";
}

TEST(config, presets_and_overrides_apply_in_order) {
  config_map map{{"model.d_model", std::int64_t{48}},
                 {"model.preset", std::string("small")},
                 {"train.lr", 0.5},
                 {"train.iterations", std::int64_t{7}},
                 {"train.weight_decay", std::int64_t{0}},
                 {"parallel.pp", std::int64_t{2}}};
  model_config m;
  train_config t;
  apply_config(map, m, t);
  EXPECT_EQ(m.preset, "small");
  EXPECT_EQ(m.layers, 8);
  EXPECT_EQ(m.d_model, 48) << "model keys override the preset";
  EXPECT_EQ(t.lr, 0.5f);
  EXPECT_EQ(t.iterations, 7);
  EXPECT_EQ(map.size(), 1u) << "other sections are left for their layer";
  EXPECT_TRUE(map.contains("parallel.pp"));
}

TEST(config, bad_configs_name_the_key) {
  EXPECT_EQ(rejected_key({{"model.preset", std::string("huge")}}), "model.preset");
  EXPECT_EQ(rejected_key({{"model.experts", std::int64_t{0}}}), "model.experts");
  EXPECT_EQ(rejected_key({{"model.top_k", std::int64_t{5}}}), "model.top_k");
  EXPECT_EQ(rejected_key({{"model.heads", std::int64_t{5}}}), "model.heads");
  EXPECT_EQ(rejected_key({{"model.widht", std::int64_t{5}}}), "model.widht");
  EXPECT_EQ(rejected_key({{"train.lr", std::string("fast")}}), "train.lr");
  EXPECT_EQ(rejected_key({{"train.seq_len", std::int64_t{1000}}}), "train.seq_len");
  EXPECT_EQ(rejected_key({{"train.micro_batches", std::int64_t{0}}}), "train.micro_batches");
  EXPECT_EQ(rejected_key({{"model.compute_dtype", std::string("f8")}}), "model.compute_dtype");
  EXPECT_EQ(rejected_key({{"model.preset", std::string("deepseek-moe")}}), "model.preset");
  EXPECT_EQ(rejected_key({{"train.corpus", std::string("/nonexistent/corpus")}}, true),
            "train.corpus");
  EXPECT_EQ(rejected_key({{"train.iterations", std::int64_t{1}}}, true), "");
  // How replicas sum: a known choice, and NCCL only for GPU stages.
  EXPECT_EQ(rejected_key({{"train.collectives", std::string("mpi")}}), "train.collectives");
  EXPECT_EQ(rejected_key({{"train.collectives", std::string("nccl")}}), "train.collectives");
  EXPECT_EQ(rejected_key({{"train.collectives", std::string("host")}}), "");
  EXPECT_EQ(rejected_key({{"train.nccl_timeout_s", std::int64_t{0}}}), "train.nccl_timeout_s");
}

TEST(config, nccl_sums_only_gpu_stages_unless_host_is_asked_for) {
  train_config t;
  EXPECT_FALSE(uses_nccl(t));  // cpu
  t.device = device::cuda;
  EXPECT_TRUE(uses_nccl(t));  // auto
  t.collectives = collectives::host;
  EXPECT_FALSE(uses_nccl(t));
  t.collectives = collectives::nccl;
  EXPECT_TRUE(uses_nccl(t));
}

}  // namespace
}  // namespace moevement::models
