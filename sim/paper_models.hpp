// Shapes of the MoE models the paper evaluates (Table 2) and of its scale study (Figure 11).
//
// The models as published (SwiGLU or GELU experts, shared experts, leading dense layers, tied
// embeddings, a vision encoder), which the trainer's operators cannot all express: models/'s
// presets of the same names are these models in those operators (their parameter counts). Shapes
// are the public configurations closest to Table 2's totals; docs/simulator.md lists how each
// was chosen.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moevement::sim {

struct model_shape {
  std::string name;
  int layers = 0;
  int hidden = 0;
  int vocab = 0;
  int seq_len = 2048;
  int experts = 0;         // routed experts per MoE layer
  int top_k = 0;           // routed experts per token
  int shared_experts = 0;  // always-active experts per MoE layer
  int expert_ffn = 0;      // FFN width of one expert
  int moe_every = 1;       // every moe_every-th layer (after first_dense) is MoE
  int first_dense = 0;     // leading dense layers
  int dense_ffn = 0;       // FFN width of dense layers (0: expert_ffn)
  bool gated_ffn = true;   // SwiGLU (3 matrices) or GELU (2)
  bool tied_embeddings = false;
  double extra_params = 0;  // e.g. a vision encoder, counted with the embedding on stage 0
  // Table 2's published counts, for the check in the tests and docs.
  double nominal_total_params = 0;
  double nominal_active_params = 0;
};

bool layer_is_moe(const model_shape& m, int layer);
double attention_params(const model_shape& m);  // per layer: Q, K, V, O projections
double expert_params(const model_shape& m);     // one expert
double dense_ffn_params(const model_shape& m);  // the FFN of a dense layer
double embedding_params(const model_shape& m);  // input embedding + extra (stage 0)
double head_params(const model_shape& m);       // output head (0 when tied), last stage
double total_params(const model_shape& m);
double active_params(const model_shape& m);

// Table 2: "moe-llava", "gpt-moe", "qwen-moe", "deepseek-moe"; Figure 11: "deepseek-32b",
// "deepseek-67b", "deepseek-145b", "deepseek-671b". Throws naming the known names otherwise.
model_shape paper_model(std::string_view name);
std::vector<std::string> paper_model_names();

}  // namespace moevement::sim
