// A custom stage type: a residual-MLP byte-level language model (no attention, no experts),
// written against engine::stage_model and registered as "residual_mlp". It shows everything
// a stage owes the engine: its operators (the unit of state), forward and backward per
// micro-batch, validation, and dropping an aborted iteration.
//
// Model (pre-norm residual blocks):
//   x0 = wte[tokens] + wpe[t]                      [N,C]   (N = B*T rows)
//   block l:  x_{l+1} = x_l + gelu(rmsnorm(x_l) W1) W2    W1 [C,F], W2 [F,C]
//   logits = rmsnorm_f(x_L) W_head                  [N,V]   loss = mean cross-entropy
// Operators in canonical order: embedding; per block: norm, mlp; final_norm; head.
#pragma once

#include <memory>

#include "engine/stage_model.hpp"

namespace custom_stage {

std::unique_ptr<moevement::engine::stage_model> make_residual_mlp(
    const moevement::engine::stage_setup& setup);

}  // namespace custom_stage
