#include "sim/paper_models.hpp"

#include <stdexcept>

namespace moevement::sim {

bool layer_is_moe(const model_shape& m, int layer) {
  if (m.experts == 0 || layer < m.first_dense) return false;
  return (layer - m.first_dense) % m.moe_every == m.moe_every - 1;
}

double attention_params(const model_shape& m) {
  return 4.0 * m.hidden * static_cast<double>(m.hidden);
}

double expert_params(const model_shape& m) {
  return (m.gated_ffn ? 3.0 : 2.0) * m.hidden * static_cast<double>(m.expert_ffn);
}

double dense_ffn_params(const model_shape& m) {
  const int f = m.dense_ffn > 0 ? m.dense_ffn : m.expert_ffn;
  return (m.gated_ffn ? 3.0 : 2.0) * m.hidden * static_cast<double>(f);
}

double embedding_params(const model_shape& m) {
  return static_cast<double>(m.vocab) * m.hidden + m.extra_params;
}

double head_params(const model_shape& m) {
  return m.tied_embeddings ? 0.0 : static_cast<double>(m.vocab) * m.hidden;
}

namespace {

double params(const model_shape& m, bool active_only) {
  double p = embedding_params(m) + head_params(m);
  for (int l = 0; l < m.layers; ++l) {
    p += attention_params(m);
    if (layer_is_moe(m, l)) {
      const int experts = (active_only ? m.top_k : m.experts) + m.shared_experts;
      p += experts * expert_params(m) + static_cast<double>(m.hidden) * m.experts;
    } else {
      p += dense_ffn_params(m);
    }
  }
  return p;
}

model_shape make(std::string name, int layers, int hidden, int vocab, int experts, int top_k,
                 int shared, int expert_ffn, double total, double active) {
  model_shape m;
  m.name = std::move(name);
  m.layers = layers;
  m.hidden = hidden;
  m.vocab = vocab;
  m.experts = experts;
  m.top_k = top_k;
  m.shared_experts = shared;
  m.expert_ffn = expert_ffn;
  m.nominal_total_params = total;
  m.nominal_active_params = active;
  return m;
}

}  // namespace

double total_params(const model_shape& m) {
  return params(m, false);
}
double active_params(const model_shape& m) {
  return params(m, true);
}

std::vector<std::string> paper_model_names() {
  return {"moe-llava",    "gpt-moe",      "qwen-moe",      "deepseek-moe",
          "deepseek-32b", "deepseek-67b", "deepseek-145b", "deepseek-671b"};
}

model_shape paper_model(std::string_view name) {
  // MoE-LLaVA on StableLM-style blocks: 32 layers, MoE in every other layer (4 experts, top-2),
  // plus a ~0.3B CLIP vision encoder folded into the embedding operator.
  if (name == "moe-llava") {
    auto m = make("moe-llava", 32, 2048, 32000, 4, 2, 0, 4096, 2.9e9, 2.0e9);
    m.moe_every = 2;
    m.extra_params = 0.3e9;
    return m;
  }
  // GPT-MoE (DeepSpeed-MoE style): GELU experts of width 4d, tied embeddings.
  if (name == "gpt-moe") {
    auto m = make("gpt-moe", 12, 1536, 50257, 32, 6, 0, 4 * 1536, 7.3e9, 1.6e9);
    m.gated_ffn = false;
    m.tied_embeddings = true;
    return m;
  }
  // Qwen1.5-MoE-A2.7B counted as Table 2 does: 64 experts of width 1408, 8 per token.
  if (name == "qwen-moe") return make("qwen-moe", 24, 2048, 151936, 64, 8, 0, 1408, 14.3e9, 2.7e9);
  // DeepSeekMoE 16B: first layer dense (width 10944), then 64 routed + 2 shared experts.
  const auto deepseek = [](std::string n, int layers, int hidden, int vocab, int experts,
                           int shared, int ffn, int dense_ffn, int first_dense, double total,
                           double active) {
    auto m = make(std::move(n), layers, hidden, vocab, experts, 8, shared, ffn, total, active);
    m.first_dense = first_dense;
    m.dense_ffn = dense_ffn;
    return m;
  };
  if (name == "deepseek-moe")
    return deepseek("deepseek-moe", 28, 2048, 102400, 64, 2, 1408, 10944, 1, 16.4e9, 3.7e9);
  // Figure 11's family: shapes scaled from DeepSeekMoE to the named totals (active counts are
  // what these shapes give; the paper does not publish them).
  if (name == "deepseek-32b")
    return deepseek("deepseek-32b", 28, 2560, 102400, 80, 2, 1792, 13824, 1, 32e9, 0);
  if (name == "deepseek-67b")
    return deepseek("deepseek-67b", 32, 3072, 102400, 112, 2, 2048, 16384, 1, 67e9, 0);
  if (name == "deepseek-145b")
    return deepseek("deepseek-145b", 56, 4096, 102400, 128, 4, 1536, 16384, 1, 145e9, 0);
  // DeepSeek-V3: 61 layers, 3 dense, 256 routed + 1 shared experts of width 2048.
  if (name == "deepseek-671b")
    return deepseek("deepseek-671b", 61, 7168, 129280, 256, 1, 2048, 18432, 3, 671e9, 37e9);
  std::string known;
  for (const auto& n : paper_model_names()) known += (known.empty() ? "" : ", ") + n;
  throw std::invalid_argument("model.preset: unknown model '" + std::string(name) +
                              "' (known: " + known + ")");
}

}  // namespace moevement::sim
