// Model and training settings: presets, the `model.*` and `train.*` keys of the TOML config,
// and their validation. Every default lives here, once (docs/configuration.md lists them).
// The TOML file itself is read by the launcher into a flat key -> value map (config_map), so
// this layer needs no TOML library and the engine's keys stay the engine's.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "models/tensor.hpp"

namespace moevement::models {

using config_value = std::variant<bool, std::int64_t, double, std::string>;
// Dotted keys ("model.preset") to values, as read from TOML and `--set key=value`.
using config_map = std::map<std::string, config_value, std::less<>>;

// A bad setting; what() starts with the key so the user knows what to fix.
class config_error : public std::runtime_error {
 public:
  config_error(std::string key, const std::string& problem)
      : std::runtime_error(key + ": " + problem), key_(std::move(key)) {}
  const std::string& key() const { return key_; }

 private:
  std::string key_;
};

struct model_config {
  std::string preset = "tiny";
  int layers = 4;
  int d_model = 32;              // C
  int heads = 4;                 // NH (C % NH == 0)
  int experts = 4;               // E routed experts per layer
  int top_k = 2;                 // K slots per token
  int d_ff = 64;                 // F, hidden size of each expert
  int max_seq_len = 64;          // rows of the position embedding
  int vocab = 256;               // bytes as tokens
  int shared_experts = 0;        // paper presets only (DeepSeek-MoE); the CPU model trains with 0
  double capacity_factor = 0.0;  // 0: dropless
  float aux_loss_coef = 0.01f;
  dtype compute_dtype = dtype::bf16;  // 2-byte compute weights (f32 allowed for gradient tests)

  bool operator==(const model_config&) const = default;
  std::int64_t parameter_count() const;         // all operators
  std::int64_t active_parameter_count() const;  // per token: non-experts + (K + shared) experts
};

enum class collectives : std::uint8_t { automatic, nccl, host };
struct train_config;
// Whether the replicas of a stage sum their gradients with NCCL (on GPUs, unless host).
bool uses_nccl(const train_config& t);

struct train_config {
  std::int64_t iterations = 200;
  int micro_batches = 2;
  int micro_batch_size = 8;  // B
  int seq_len = 32;          // T
  std::uint64_t seed = 1;
  float lr = 3e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;   // on matrices only (never norms or embeddings)
  float grad_clip = 1.0f;      // global L2 norm; 0 disables
  std::int64_t val_every = 0;  // 0: validate only at the end
  int val_batches = 4;
  std::string corpus = "/usr/share/games/fortunes";  // a file, or a directory of them
  double val_fraction = 0.1;  // the tail of the corpus held out for validation
  int blis_threads = 1;
  // Where stages compute: cpu (BLIS) or cuda (a GPU per process; models/cuda/). Both
  // `moevement train` and `moevement launch` honour it.
  models::device device = models::device::cpu;
  // How the data-parallel replicas of a GPU stage sum their gradients: auto (NCCL, device to
  // device, where train.device = cuda; the host otherwise), nccl, or host (through the link,
  // as CPU stages do). Both give the same bits.
  models::collectives collectives = models::collectives::automatic;
  // Seconds a GPU stage's NCCL group may take to form (every replica joined) before the stage
  // fails, naming this key.
  int nccl_timeout_s = 120;
  float loss_scale = 65536.0f;  // initial dynamic loss scale (f16 compute only)
  int loss_scale_window = 200;  // good steps before the scale doubles
  std::int64_t log_every = 10;  // iterations between progress lines
  // Data-parallel replicas emulated in one process (the engine's parallel.dp; not a train.*
  // key): replica d trains on its own micro-batches (data position keyed by d).
  int data_parallel = 1;
  // Expert parallelism (the engine's parallel.ep; not a train.* key): every MoE layer's experts
  // are sharded over EP groups of this many consecutive replicas (models/expert_exchange.hpp).
  // Divides data_parallel and the expert count; changes no bit.
  int expert_parallel = 1;

  bool operator==(const train_config&) const = default;
};

// Typed reads of one setting, for every layer's config: a wrong type or a value outside
// [lo, hi] throws config_error naming the key ("expected an integer, got a string").
std::string config_type_name(const config_value& v);  // "a boolean", "an integer", ...
std::int64_t config_int(const std::string& key, const config_value& v, std::int64_t lo,
                        std::int64_t hi);
double config_double(const std::string& key, const config_value& v, double lo, double hi);
std::string config_string(const std::string& key, const config_value& v);

std::vector<std::string> preset_names();
// The shapes of a preset; throws config_error("model.preset") for an unknown name.
model_config preset(std::string_view name);

// Applies and removes every `model.*` and `train.*` key of `map` (model.preset first, so other
// model keys override the preset). Unknown keys in these sections, wrong types and bad values
// throw config_error naming the key. Keys of other sections are left in the map.
void apply_config(config_map& map, model_config& model, train_config& train);
// Every key apply_config accepts (docs/configuration.md must list each; a test checks).
std::vector<std::string> config_keys();
// Cross-checks that need both (top-k > experts, seq_len > max_seq_len, ...).
void validate(const model_config& model, const train_config& train);

}  // namespace moevement::models
