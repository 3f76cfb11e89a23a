#include "models/config.hpp"

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <limits>

namespace moevement::models {

std::int64_t model_config::parameter_count() const {
  const std::int64_t c = d_model, f = d_ff, e = experts + shared_experts;
  const std::int64_t per_layer =
      2 * c /*norms*/ + 4 * c * c /*attention*/ + c * experts /*gate*/ + e * 2 * c * f /*experts*/;
  return std::int64_t(vocab) * c + std::int64_t(max_seq_len) * c + layers * per_layer +
         c /*final norm*/ + c * vocab /*head*/;
}

std::int64_t model_config::active_parameter_count() const {
  const std::int64_t c = d_model, f = d_ff;
  const std::int64_t per_layer =
      2 * c + 4 * c * c + c * experts + (top_k + shared_experts) * 2 * c * f;
  return std::int64_t(vocab) * c + std::int64_t(max_seq_len) * c + layers * per_layer + c +
         c * vocab;
}

std::vector<std::string> preset_names() {
  return {"tiny", "small", "moe-llava", "gpt-moe", "qwen-moe", "deepseek-moe"};
}

model_config preset(std::string_view name) {
  model_config m;
  m.preset = std::string(name);
  auto set = [&m](int layers, int c, int nh, int e, int k, int f, int t, int v, int shared) {
    m.layers = layers, m.d_model = c, m.heads = nh, m.experts = e, m.top_k = k, m.d_ff = f;
    m.max_seq_len = t, m.vocab = v, m.shared_experts = shared;
  };
  //                 L   C     NH  E   K  F     maxT  V       shared
  if (name == "tiny")
    set(4, 32, 4, 4, 2, 64, 64, 256, 0);  // ~0.1 M parameters
  else if (name == "small")
    set(8, 256, 8, 8, 2, 768, 128, 256, 0);  // ~27 M parameters
  // The paper's Table 2 models: layer, expert and top-k counts as published; widths chosen so
  // that this architecture (GELU experts of two matrices) has about the published totals.
  // Shapes and counts only (the simulator has its own, sim/paper_models); far too large to train.
  else if (name == "moe-llava")
    set(32, 2048, 32, 4, 2, 3712, 2048, 100352, 0);
  else if (name == "gpt-moe")
    set(12, 2048, 16, 32, 6, 4352, 2048, 50257, 0);
  else if (name == "qwen-moe")
    set(24, 2048, 16, 64, 8, 2112, 2048, 151936, 0);
  else if (name == "deepseek-moe")
    set(28, 2048, 16, 64, 8, 1888, 2048, 102400, 2);
  else {
    std::string names;
    for (const auto& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
    throw config_error("model.preset",
                       fmt::format("unknown preset '{}' (choose one of: {})", name, names));
  }
  return m;
}

std::string config_type_name(const config_value& v) {
  switch (v.index()) {
    case 0:
      return "a boolean";
    case 1:
      return "an integer";
    case 2:
      return "a number";
    default:
      return "a string";
  }
}

std::int64_t config_int(const std::string& key, const config_value& v, std::int64_t lo,
                        std::int64_t hi) {
  if (!std::holds_alternative<std::int64_t>(v)) {
    throw config_error(key, "expected an integer, got " + config_type_name(v));
  }
  const auto x = std::get<std::int64_t>(v);
  if (x < lo || x > hi)
    throw config_error(key, fmt::format("{} is out of range [{}, {}]", x, lo, hi));
  return x;
}

double config_double(const std::string& key, const config_value& v, double lo, double hi) {
  double x;
  if (std::holds_alternative<std::int64_t>(v)) {
    x = double(std::get<std::int64_t>(v));
  } else if (std::holds_alternative<double>(v)) {
    x = std::get<double>(v);
  } else {
    throw config_error(key, "expected a number, got " + config_type_name(v));
  }
  if (!(x >= lo && x <= hi))
    throw config_error(key, fmt::format("{} is out of range [{}, {}]", x, lo, hi));
  return x;
}

std::string config_string(const std::string& key, const config_value& v) {
  if (!std::holds_alternative<std::string>(v)) {
    throw config_error(key, "expected a string, got " + config_type_name(v) + " (quote it: " + key +
                                " = \"...\", or --set " + key + "='\"...\"' on a command line)");
  }
  return std::get<std::string>(v);
}

namespace {

constexpr std::int64_t int_max = std::numeric_limits<int>::max();

using setter = std::function<void(const std::string&, const config_value&)>;
using setter_map = std::map<std::string, setter, std::less<>>;

// Every model.* and train.* key with how it is parsed and validated: the one list of keys.
setter_map make_setters(model_config& model, train_config& train) {
  return {
      {"model.layers", [&](auto& k, auto& v) { model.layers = int(config_int(k, v, 1, 4096)); }},
      {"model.d_model",
       [&](auto& k, auto& v) { model.d_model = int(config_int(k, v, 1, 1 << 16)); }},
      {"model.heads", [&](auto& k, auto& v) { model.heads = int(config_int(k, v, 1, 1024)); }},
      {"model.experts",
       [&](auto& k, auto& v) { model.experts = int(config_int(k, v, 1, 1 << 16)); }},
      {"model.top_k", [&](auto& k, auto& v) { model.top_k = int(config_int(k, v, 1, 1 << 16)); }},
      {"model.d_ff", [&](auto& k, auto& v) { model.d_ff = int(config_int(k, v, 1, 1 << 20)); }},
      {"model.max_seq_len",
       [&](auto& k, auto& v) { model.max_seq_len = int(config_int(k, v, 1, 1 << 20)); }},
      {"model.capacity_factor",
       [&](auto& k, auto& v) { model.capacity_factor = config_double(k, v, 0.0, 1e6); }},
      {"model.aux_loss_coef",
       [&](auto& k, auto& v) { model.aux_loss_coef = float(config_double(k, v, 0.0, 1e3)); }},
      {"model.compute_dtype",
       [&](auto& k, auto& v) {
         try {
           model.compute_dtype = parse_dtype(config_string(k, v));
         } catch (const std::invalid_argument& e) {
           throw config_error(k, e.what());
         }
       }},
      {"train.iterations",
       [&](auto& k, auto& v) {
         train.iterations = config_int(k, v, 0, std::numeric_limits<std::int64_t>::max());
       }},
      {"train.micro_batches",
       [&](auto& k, auto& v) { train.micro_batches = int(config_int(k, v, 1, int_max)); }},
      {"train.micro_batch_size",
       [&](auto& k, auto& v) { train.micro_batch_size = int(config_int(k, v, 1, int_max)); }},
      {"train.seq_len",
       [&](auto& k, auto& v) { train.seq_len = int(config_int(k, v, 1, int_max)); }},
      {"train.seed",
       [&](auto& k, auto& v) {
         train.seed = std::uint64_t(config_int(k, v, 0, std::numeric_limits<std::int64_t>::max()));
       }},
      {"train.lr", [&](auto& k, auto& v) { train.lr = float(config_double(k, v, 0.0, 10.0)); }},
      {"train.beta1",
       [&](auto& k, auto& v) { train.beta1 = float(config_double(k, v, 0.0, 0.999999)); }},
      {"train.beta2",
       [&](auto& k, auto& v) { train.beta2 = float(config_double(k, v, 0.0, 0.999999)); }},
      {"train.eps", [&](auto& k, auto& v) { train.eps = float(config_double(k, v, 1e-30, 1.0)); }},
      {"train.weight_decay",
       [&](auto& k, auto& v) { train.weight_decay = float(config_double(k, v, 0.0, 1.0)); }},
      {"train.grad_clip",
       [&](auto& k, auto& v) { train.grad_clip = float(config_double(k, v, 0.0, 1e9)); }},
      {"train.val_every",
       [&](auto& k, auto& v) {
         train.val_every = config_int(k, v, 0, std::numeric_limits<std::int64_t>::max());
       }},
      {"train.val_batches",
       [&](auto& k, auto& v) { train.val_batches = int(config_int(k, v, 0, int_max)); }},
      {"train.corpus", [&](auto& k, auto& v) { train.corpus = config_string(k, v); }},
      {"train.val_fraction",
       [&](auto& k, auto& v) { train.val_fraction = config_double(k, v, 0.01, 0.5); }},
      {"train.blis_threads",
       [&](auto& k, auto& v) { train.blis_threads = int(config_int(k, v, 1, 1024)); }},
      {"train.loss_scale",
       [&](auto& k, auto& v) { train.loss_scale = float(config_double(k, v, 1.0, 1e30)); }},
      {"train.loss_scale_window",
       [&](auto& k, auto& v) { train.loss_scale_window = int(config_int(k, v, 1, int_max)); }},
      {"train.device",
       [&](auto& k, auto& v) {
         const std::string d = config_string(k, v);
         if (d == "cpu") {
           train.device = device::cpu;
         } else if (d == "cuda") {
           train.device = device::cuda;
         } else {
           throw config_error(k, fmt::format("expected \"cpu\" or \"cuda\", got \"{}\"", d));
         }
       }},
      {"train.collectives",
       [&](auto& k, auto& v) {
         const std::string c = config_string(k, v);
         if (c == "auto") {
           train.collectives = collectives::automatic;
         } else if (c == "nccl") {
           train.collectives = collectives::nccl;
         } else if (c == "host") {
           train.collectives = collectives::host;
         } else {
           throw config_error(
               k, fmt::format("expected \"auto\", \"nccl\" or \"host\", got \"{}\"", c));
         }
       }},
      {"train.nccl_timeout_s",
       [&](auto& k, auto& v) { train.nccl_timeout_s = int(config_int(k, v, 1, 86400)); }},
      {"train.log_every",
       [&](auto& k, auto& v) {
         train.log_every = config_int(k, v, 1, std::numeric_limits<std::int64_t>::max());
       }},
  };
}

}  // namespace

std::vector<std::string> config_keys() {
  model_config model;
  train_config train;
  std::vector<std::string> keys{"model.preset"};
  for (const auto& [key, set] : make_setters(model, train)) keys.push_back(key);
  return keys;
}

void apply_config(config_map& map, model_config& model, train_config& train) {
  if (auto it = map.find("model.preset"); it != map.end()) {
    model = preset(config_string(it->first, it->second));
    map.erase(it);
  }
  const setter_map setters = make_setters(model, train);
  for (auto it = map.begin(); it != map.end();) {
    const std::string& key = it->first;
    const bool ours = key.starts_with("model.") || key.starts_with("train.");
    if (!ours) {
      ++it;
      continue;
    }
    const auto s = setters.find(key);
    if (s == setters.end()) {
      throw config_error(key,
                         "unknown key (see docs/configuration.md for the model.* and "
                         "train.* keys)");
    }
    s->second(key, it->second);
    it = map.erase(it);
  }
}

void validate(const model_config& m, const train_config& t) {
  if (m.experts < 1) throw config_error("model.experts", "must be at least 1");
  if (m.top_k < 1 || m.top_k > m.experts) {
    throw config_error(
        "model.top_k",
        fmt::format("must be between 1 and model.experts ({}), got {}", m.experts, m.top_k));
  }
  if (m.d_model % m.heads != 0) {
    throw config_error("model.heads", fmt::format("model.d_model ({}) must be a multiple of the "
                                                  "head count ({})",
                                                  m.d_model, m.heads));
  }
  if (m.shared_experts != 0) {
    throw config_error("model.preset", fmt::format("preset '{}' has shared experts and is for the "
                                                   "simulator only; train tiny or small",
                                                   m.preset));
  }
  if (t.seq_len > m.max_seq_len) {
    throw config_error("train.seq_len",
                       fmt::format("{} exceeds model.max_seq_len ({})", t.seq_len, m.max_seq_len));
  }
  if (t.data_parallel < 1) throw config_error("parallel.dp", "must be at least 1");
  if (t.expert_parallel < 1) throw config_error("parallel.ep", "must be at least 1");
  if (t.data_parallel % t.expert_parallel != 0) {
    throw config_error("parallel.ep", fmt::format("{} does not divide parallel.dp ({}): EP groups "
                                                  "are ep consecutive data-parallel replicas",
                                                  t.expert_parallel, t.data_parallel));
  }
  if (m.experts % t.expert_parallel != 0) {
    throw config_error("parallel.ep", fmt::format("{} does not divide the {} experts of each "
                                                  "layer (model.experts): each EP rank holds "
                                                  "experts / ep of them",
                                                  t.expert_parallel, m.experts));
  }
  if (m.vocab != 256) {
    throw config_error("model.preset",
                       fmt::format("the byte-level trainer needs vocab 256, and preset '{}' has {} "
                                   "(one of the paper's models, far too large to train here; "
                                   "`moevement simulate` models them); train tiny or small",
                                   m.preset, m.vocab));
  }
  if (t.collectives == collectives::nccl && t.device != device::cuda) {
    throw config_error("train.collectives",
                       "\"nccl\" sums GPU stages' gradients; with train.device = \"cpu\" use "
                       "\"auto\" or \"host\"");
  }
}

bool uses_nccl(const train_config& t) {
  return t.device == device::cuda && t.collectives != collectives::host;
}

}  // namespace moevement::models
