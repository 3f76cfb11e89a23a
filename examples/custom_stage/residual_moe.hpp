// A custom stage type with experts: the residual byte-level model of residual_mlp.hpp whose
// blocks' MLP is a mixture of model.experts GELU experts, each token routed to one of them by a
// softmax gate and scaled by its probability. Registered as "residual_moe" with
// engine::stage_traits::expert_parallel: under parallel.ep > 1 each replica allocates only its
// block of every layer's experts and hands the routed rows to the engine's all-to-all
// (models::expert_exchange, the one the built-in stage uses; docs/custom-stages.md).
//
// Block l (pre-norm, top-1 routing):
//   n = rmsnorm(x);  p = softmax(n Wg);  e = argmax p;  x' = x + p_e * expert_e(n)
//   Wg [C,E]; expert_j: gelu(n W1_j) W2_j, W1 [C,F], W2 [F,C]
// Operators in canonical order: embedding; per block: norm, gate, expert 0..E-1; final_norm;
// head.
#pragma once

#include <memory>

#include "engine/stage_model.hpp"

namespace custom_stage {

// Throws models::config_error naming the key for a model it cannot build (model.top_k other
// than 1, more stages than model.layers).
std::unique_ptr<moevement::engine::stage_model> make_residual_moe(
    const moevement::engine::stage_setup& setup);

}  // namespace custom_stage
